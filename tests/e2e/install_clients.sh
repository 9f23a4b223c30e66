#!/usr/bin/env bash
# The heavy benchmark clients whose lines docs/quickstart.md shows ("Benchmark
# clients"), each in a venv of its own under the frontends' cache, for the docs
# test's slow step (tests/e2e/test_docs_commands.py, GMOCK_DOCS_SLOW=1):
#
#   $GMOCK_FRONTENDS_HOME/clients/guidellm/   guidellm==$GUIDELLM_VERSION
#   $GMOCK_FRONTENDS_HOME/clients/aiperf/     aiperf==$AIPERF_VERSION
#
# GuideLLM requires torch (and transformers), which pip takes from PyPI as the
# CUDA build: about 6 GB and many minutes. The Python frontend's venv
# (tests/e2e/install_frontends.sh, installed first) holds a CPU torch and
# transformers: when it is there, GuideLLM's venv is made from that venv's
# interpreter and a .pth file appends its site-packages, so pip finds both
# installed (GuideLLM's own venv goes first on sys.path: what pip installs
# there wins). About 0.35 GB then.
#
# Idempotent: a venv whose mark names its version is kept (a rerun costs a file
# test); an interrupted install is redone (the venv's mark is written last, after
# the client answered --help). Prints each client's path.
set -euo pipefail

GUIDELLM_VERSION="0.8.1"
AIPERF_VERSION="0.13.0"
HOME_DIR="${GMOCK_FRONTENDS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/gmock-frontends}"
CLIENTS="$HOME_DIR/clients"
mkdir -p "$CLIENTS"

install_client() {
  local name="$1" version="$2" dest="$CLIENTS/$1"
  if [[ "$(cat "$dest/.gmock-client-ok" 2>/dev/null)" == "$version" ]]; then
    echo "$name=$dest/bin/$name"
    return
  fi
  local t0
  t0=$(date +%s)
  echo "install_clients: installing $name==$version into $dest (minutes)" >&2
  rm -rf "$dest"
  local base="$HOME_DIR/venv"
  if [[ "$name" == guidellm && -x "$base/bin/python" ]]; then
    "$base/bin/python" -m venv "$dest"
    local site
    site="$("$dest/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/gmock-clients-shared-torch.pth"
  else
    "${PYTHON:-python3}" -m venv "$dest"
  fi
  if ! "$dest/bin/python" -m pip install -q --disable-pip-version-check "$name==$version" >&2; then
    echo "install_clients: installing $name==$version failed (pip's error above); run this script again to retry" >&2
    exit 1
  fi
  "$dest/bin/$name" --help >/dev/null
  echo "$version" >"$dest/.gmock-client-ok"
  echo "install_clients: $name==$version in $(( $(date +%s) - t0 )) s, $(du -sh "$dest" | cut -f1)" >&2
  echo "$name=$dest/bin/$name"
}

install_client guidellm "$GUIDELLM_VERSION"
install_client aiperf "$AIPERF_VERSION"
