"""gmock_engine/tools: kept off the serving path."""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "gmock_engine")


def _imports(path):
    """Every module a file imports, relative imports resolved within the package."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # the serving modules sit at the package's top level: `.` is gmock_engine
            module = ("gmock_engine" + (f".{node.module}" if node.module else "")) if node.level else node.module
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_serving_modules_never_import_the_tools():
    # __main__ dispatches `gmock-engine bench` to tools/bench.py; nothing else may.
    serving = [name for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__main__.py"]
    assert "engine.py" in serving and "cli.py" in serving
    for name in serving:
        offending = [m for m in _imports(os.path.join(PACKAGE, name)) if m == "gmock_engine.tools" or m.startswith("gmock_engine.tools.")]
        assert not offending, f"gmock_engine/{name} imports {offending}"


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from .tools import bench\nfrom . import tools\nimport gmock_engine.tools.procfs\nfrom .stats import summarize\n")
    assert set(_imports(str(path))) >= {"gmock_engine.tools", "gmock_engine.tools.bench", "gmock_engine.tools.procfs", "gmock_engine.stats"}
