"""Tools that play the other side: the frontend, a yardstick engine, /proc.

Not on the serving path: the engine (gmock_engine/*.py) never imports this
package. It ships inside the installed package because `gmock-engine bench`
must work from an installed copy; benchmarks/ and tests/ use it too.

* bench.py: `gmock-engine bench`, the blocking-pyzmq load driver;
* reference_emitter.py: the bare yardstick engine the driver compares against;
* procfs.py: CPU and RSS of a process tree, from /proc.

Like the package `__init__`, this imports nothing (STYLE.md pitfall 1).
"""
