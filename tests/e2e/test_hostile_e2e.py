"""Hostile HTTP requests through the real frontends (DP 1, both): the catalogue
in hostile_catalogue.py (vllm_xargs keys with huge, negative, fractional,
string, bool, nested and null values; sampling parameters at their extremes;
prompts near and beyond max_model_len and out-of-vocabulary ids; odd request
ids; 200 streams closed at once).

One test per case and frontend. Each must (1) get an answer within a bound (any
HTTP status, or a stream that ends), (2) leave the engine (and the frontend)
running and (3) leave a normal completion (5 tokens) and a streaming chat (7
tokens) served exactly. A failed case names itself, with the engine's log since
it began; the runner then restarts the stack, so one bad case hides no other.

The last test per frontend prints the observed table (case, HTTP status,
excerpt; "FAIL" marks) to the terminal and writes it, for both frontends, to
`<pytest basetemp>/hostile_table.{md,json}`; the fixture's teardown writes it
too (also after `-x`). Without pytest:

    .venv/bin/python tests/e2e/test_hostile_e2e.py [--frontend python|rust] [case-id-substring ...]

Run time: about a minute per frontend when every case passes; each failed
case adds a restart (Python ~9 s, Rust ~1 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402
import hostile_catalogue as hc  # noqa: E402

pytestmark = pytest.mark.e2e

#: The DP 1 topologies, narrowed by $GMOCK_E2E_TOPOLOGIES as the `stack` fixture is.
_WANTED = {w.strip() for w in os.environ.get("GMOCK_E2E_TOPOLOGIES", "").split(",") if w.strip()}
TOPOLOGIES = [t for t in (h.Topology("python", dp=1, api_servers=1), h.Topology("rust", dp=1))
              if not _WANTED or t.id in _WANTED]

#: Every row of this session, both frontends (what the tables hold).
ROWS: list = []


def _write_all(tmp_path_factory) -> tuple:
    return hc.write_tables(ROWS, Path(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def hostile_model_dir(frontends, tmp_path_factory) -> Path:
    """The test model with max_model_len 8192 (the harness's own has 1048576)."""
    return hc.make_model_dir(tmp_path_factory.mktemp("hostile-model"))


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda t: t.id)
def hostile(request, frontends, hostile_model_dir, tmp_path_factory):
    """A case runner per frontend: one stack, restarted after each failed case."""
    runner = hc.Runner(request.param, frontends, hostile_model_dir, tmp_path_factory.mktemp(request.param.id))
    runner.start()
    try:
        yield runner
    finally:
        problems = runner.close()
        ROWS[:] = [r for r in ROWS if r.frontend != runner.frontend_name] + runner.rows
        _write_all(tmp_path_factory)
        if problems:
            pytest.fail(f"{runner.frontend_name}: teardown problems: {problems}", pytrace=False)


@pytest.mark.parametrize("case", hc.CASES, ids=lambda c: c.id)
def test_hostile_case(hostile, case):
    row = hostile.run(case)
    print(f"{row.frontend} {row.case}: {hc._client_saw(row)} [engine {row.engine}] {row.seconds:.2f}s")
    if row.failed:
        pytest.fail(f"{row.frontend} case {row.case!r}: {'; '.join(row.problems)}\n"
                    f"client saw: {hc._client_saw(row)}\nengine: {row.engine}\n"
                    f"----- engine log since the case began (tail)\n{row.engine_log}", pytrace=False)


def test_hostile_table(hostile, tmp_path_factory, capsys):
    """Print this frontend's table (and write both frontends' so far). A report
    only: the failed cases have failed on their own."""
    ROWS[:] = [r for r in ROWS if r.frontend != hostile.frontend_name] + hostile.rows
    js, md = _write_all(tmp_path_factory)
    mine = [r for r in ROWS if r.frontend == hostile.frontend_name]
    with capsys.disabled():
        print(f"\n\n{hostile.frontend_name}: {len(mine)} hostile cases, "
              f"{sum(r.failed for r in mine)} failed, {len(hostile.stacks)} stack(s), "
              f"{sum(r.seconds for r in mine):.0f} s in cases; tables: {md} {js}")
        print(hc.markdown_table(mine))
        if any(r.failed for r in mine):
            print(f"\n{hostile.frontend_name} failures:\n" + hc.failures_report(mine))


if __name__ == "__main__":
    sys.exit(hc.main())
