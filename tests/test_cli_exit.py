"""The engine's process exit through run.sh, against the fake frontend: what
runs in native threads at the end (runtime/grammar_pool.py)."""

import signal

import gevent

from fake_frontend import FakeFrontend
from gmock_engine.tools import model_dir
from test_cli_subprocess import clean_env, engine_process, log_text, wait_exit


def test_sigterm_while_the_grammar_pool_works_exits_0(tmp_path):
    """SIGTERM while the pool's native thread is inside llguidance (here the
    warm-up of a 150 000-id vocabulary, about a second from the join): the
    ordered shutdown waits for it (bounded) and the process exits 0; the
    interpreter's teardown ending that thread with pthread_exit kills it
    with SIGSEGV after its last log line (here, about one run in five
    without the fix: tests/unit/test_main_exit.py holds the wiring)."""
    model = model_dir.write_model_dir(tmp_path / "model", vocab_size=150_000)
    frontend = FakeFrontend(num_clients=1, dp=1)
    args = ["--handshake-address", frontend.handshake_address, "--tokenizer", str(model)]
    with engine_process(tmp_path, args, frontend, env=clean_env(PYTHONFAULTHANDLER="1")) as (proc, log):
        frontend.accept_engines(timeout=60)
        gevent.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        status = wait_exit(proc, 30)
        assert status == 0, log_text(log)[-3000:]
        assert "Segmentation fault" not in log_text(log)
