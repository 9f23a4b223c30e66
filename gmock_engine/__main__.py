"""Entry point: `python -m gmock_engine` and the `gmock-engine` script.

`gmock-engine bench ...` runs the load driver (tools/bench.py), a plain pyzmq
program that starts the engine as a subprocess; `gmock-engine serve ...`
(`./run.sh serve`) a real frontend and the engine behind it (tools/serve.py),
plain Python that starts and watches processes; `gmock-engine record ...`
(`./run.sh record`) the record tap (tools/record.py), plain pyzmq; `gmock-engine calibrate ...`
(`./run.sh calibrate`) the tap under a standard sweep (tools/calibrate.py); `gmock-engine fit ...`
(`./run.sh fit`) a step-time profile from its traces (tools/fit.py); `gmock-engine profile ...`
(`./run.sh profile`) one from AIConfigurator's GPU tables (tools/gpu_profile.py). Everything else is the
engine, which needs gevent's monkey-patching before anything else imports
socket, threading or time-related modules (STYLE.md pitfall 1): it is the
first thing the engine path does.
"""

import os
import sys


def main() -> None:
    """Console-script entry: exit with the program's status."""
    if sys.argv[1:2] == ["bench"]:
        from gmock_engine.tools.bench import main as bench_main

        sys.exit(bench_main(sys.argv[2:]))
    if sys.argv[1:2] == ["serve"]:
        from gmock_engine.tools.serve import main as serve_main

        sys.exit(serve_main(sys.argv[2:]))
    if sys.argv[1:2] == ["record"]:
        from gmock_engine.tools.record import main as record_main

        sys.exit(record_main(sys.argv[2:]))
    if sys.argv[1:2] == ["calibrate"]:
        from gmock_engine.tools.calibrate import main as calibrate_main

        sys.exit(calibrate_main(sys.argv[2:]))
    if sys.argv[1:2] == ["fit"]:
        from gmock_engine.tools.fit import main as fit_main

        sys.exit(fit_main(sys.argv[2:]))
    if sys.argv[1:2] == ["profile"]:
        from gmock_engine.tools.gpu_profile import main as profile_main

        sys.exit(profile_main(sys.argv[2:]))

    from gevent import monkey

    monkey.patch_all()

    from gmock_engine.runtime.cli import main as engine_main

    end(engine_main())


def end(status: int) -> None:
    """Exit the engine's process with `status`, its ordered shutdown done.
    With a thread still inside llguidance (runtime/grammar_pool.py: a job past
    the shutdown's bound) the interpreter's teardown would end that thread
    with pthread_exit, whose unwind through Rust frames crashes the process:
    then the logs are flushed and the process ends without the teardown."""
    from gmock_engine.runtime import grammar_pool

    if grammar_pool.busy():
        from loguru import logger

        logger.complete()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)

if __name__ == "__main__":
    main()
