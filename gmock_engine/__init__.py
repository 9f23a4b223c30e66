"""gmock_engine: a headless, model-free, GPU-free stand-in for vLLM's engine core.

Importing the package has no side effects (no monkey-patching, no sockets):
`python -m gmock_engine` / the `gmock-engine` script patches gevent first.

§N in comments: section N of docs/protocol.md; an appendix cited by its letter is that page's too.
"""

__version__ = "0.1.0"
