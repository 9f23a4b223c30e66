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
    "core.engine",
    "core.request",
    "core.request_queue",
    "core.kv_cache_manager",
    "core.prefix_cache",
    "core.scheduler",
    "content.sampler",
    "core.sched_output",
    "core.output_processor",
    "core.lanes",
    "content.spec_decode",
    "content.pooling",
    "core.outbox",
    "core.utilities",
    "content.tokens",
    "content.structured_output",
    "content.structural_tag",
    "core.ledger",
    "faults.specs",
    "timing.latency",
    "timing.profile",
    "content.lengths",
    "config.reload",
    "config.loader",
    "config.option",
    "config.options",
    "config.validators",
    "config.settings",
    "tools.serve_config",
    "tools.record_config",
    "tools.config_reference",
    "timing.trace",
    "tools.steps",
    "tools.fit",
    "timing.replay",
    "content.tokenizer",
    "content.corpus",
    "content.answer",
    "runtime.frontend_link",
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
