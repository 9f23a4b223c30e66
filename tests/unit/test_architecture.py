"""The shape docs/architecture.md promises: the wire protocol and the
engine's parts are pure (no zmq, no gevent), so they run and are tested
without sockets or a hub."""

import subprocess
import sys

import pytest

PURE = [
    "wire",
    "wire.types",
    "wire.eras",
    "wire.inputs",
    "wire.handshake",
    "wire.outputs",
    "wire.checks",
    "engine",
    "request",
    "request_queue",
    "kv_cache_manager",
    "prefix_cache",
    "scheduler",
    "sampler",
    "sched_output",
    "output_processor",
    "lanes",
    "spec_decode",
    "pooling",
    "outbox",
    "utilities",
    "tokens",
    "structured_output",
    "structural_tag",
    "ledger",
    "faults",
    "latency",
    "latency_profile",
    "lengths",
    "reload",
    "config",
    "option",
    "options",
    "validators",
    "settings",
    "tools.serve_config",
    "tools.record_config",
    "tools.config_reference",
    "trace",
    "tools.steps",
    "tools.fit",
    "tools.fit_models",
    "tools.fit_spread",
    "replay",
    "tokenizer",
    "corpus",
    "content",
    "frontend_link",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_neither_zmq_nor_gevent(module):
    code = (
        f"import sys, gmock_engine.{module}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'gevent')); "
        "print(' '.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"gmock_engine.{module} pulls in {result.stdout.strip()} {result.stderr[-500:]}"
