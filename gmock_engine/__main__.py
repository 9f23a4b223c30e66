"""Entry point: `python -m gmock_engine` and the `gmock-engine` script.

gevent's monkey-patching must come before anything else imports socket,
threading or time-related modules (STYLE.md pitfall 1).
"""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402

from gmock_engine.cli import main as _main  # noqa: E402


def main() -> None:
    """Console-script entry: exit with the engine's status."""
    sys.exit(_main())


if __name__ == "__main__":
    main()
