"""The shape docs/architecture.md promises: the wire protocol and the
engine's parts are pure (no zmq, no gevent), so they run and are tested
without sockets or a hub; and the folders stand in one order, each
importing only the folders below it."""

import ast
import os
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
    "core.intake",
    "core.sched_kv",
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
    "config.parsed",
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
    "core.ledger",
    "kv.events",
    "kv.transfer",
    "timing.trace",
    "utils.logs",
    "utils.stats",
    "core.grammar_wait",
    "tools.fit_models",
    "tools.fit_spread",
    "tools.fit_coverage",
    "tools.calibrate_plan",
    "tools.calibrate",
    "tools.gpu_deployment",
]

#: The folders, bottom first (docs/architecture.md#folders): each imports only those before it.
FOLDERS = ["utils", "wire", "kv", "content", "timing", "faults", "config", "core", "runtime", "tools"]
PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "gmock_engine")
REPO = os.path.join(os.path.dirname(__file__), "..", "..")
#: The most lines one module may hold, in the package, the tests and the
#: benchmarks alike: past it a file holds more than one concern.
MAX_MODULE_LINES = 600


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_neither_zmq_nor_gevent(module):
    code = (
        f"import sys, gmock_engine.{module}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'gevent')); "
        "print(' '.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"gmock_engine.{module} pulls in {result.stdout.strip()} {result.stderr[-500:]}"


def _folder_imports():
    """(importing folder, imported folder, file) for every absolute import of
    the package's folders (the package imports itself absolutely)."""
    for folder in FOLDERS:
        for name in sorted(os.listdir(os.path.join(PACKAGE, folder))):
            if not name.endswith(".py"):
                continue
            path = os.path.join(PACKAGE, folder, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for module in modules:
                    parts = (module or "").split(".")
                    if parts[0] == "gmock_engine" and len(parts) > 1 and parts[1] in FOLDERS:
                        yield folder, parts[1], f"{folder}/{name}"


def test_every_folder_is_in_the_order():
    assert sorted(FOLDERS) == sorted(e for e in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, e)) and not e.startswith("__"))


def test_each_folder_imports_only_the_folders_below_it():
    upward = [f"{where} imports {imported}/" for folder, imported, where in _folder_imports() if FOLDERS.index(imported) > FOLDERS.index(folder)]
    assert not upward, upward


def test_every_module_is_at_most_600_lines():
    """Every .py file under gmock_engine/, tests/ and benchmarks/."""
    too_long = []
    for top in ("gmock_engine", "tests", "benchmarks"):
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
                if lines > MAX_MODULE_LINES:
                    too_long.append(f"{os.path.relpath(path, REPO)}: {lines} lines")
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
