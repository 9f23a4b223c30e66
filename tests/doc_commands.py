"""The shell commands the documentation shows, read out of its fenced blocks (pure).

tests/e2e/test_docs_commands.py holds every command found here against the one
table of how each is checked (tests/doc_commands_table.py): run in CI, or listed
with why it cannot run here. This module only reads markdown; it runs nothing.

What counts as a command: a logical line of a fenced block whose language is a
shell one (``bash``, ``sh``, ``shell``, ``console`` or none) that, after any
leading ``NAME=value`` assignments, starts with one of `PROGRAMS` (by the
program's base name, so ``~/.cache/.../bin/vllm`` and ``.venv/bin/python`` count).
A logical line joins backslash continuations and lines inside an open quote
(a ``-d '{`` JSON body over several lines). In a ``console`` block only lines
after a ``$ `` prompt are commands (the rest is output). The block's other lines
(``MODEL_DIR=...``, ``unset HF_HUB_OFFLINE``) are kept as the setup of the
commands after them, which a run does first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

#: Programs whose fenced commands must be run or listed.
PROGRAMS = frozenset({"run.sh", "vllm", "vllm-rs", "guidellm", "aiperf", "curl", "python", "python3"})

#: Fence languages that hold shell commands (a fence without a language counts).
SHELL_LANGUAGES = frozenset({"", "bash", "sh", "shell", "console", "zsh"})

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class DocCommand:
    """One command as a page shows it."""

    page: str  #: the page's path from the repository root, e.g. "docs/quickstart.md"
    line: int  #: 1-based line of the command's first line in the page
    text: str  #: the command as written: continuations joined, its trailing comment dropped
    program: str  #: the base name of the program it runs ("run.sh", "vllm", ...)
    setup: Tuple[str, ...] = ()  #: the block's other lines before it (MODEL_DIR=..., unset ...)

    @property
    def key(self) -> str:
        """The command with its whitespace collapsed: what the table matches."""
        return normalize(self.text)


def normalize(command: str) -> str:
    """`command` with every run of whitespace as one space (outside quotes too: a
    re-wrapped line is the same command; any other edit is a different one)."""
    return " ".join(command.split())


def _scan(text: str) -> Tuple[Optional[str], int]:
    """(the quote still open at the end of `text` or None, where a trailing
    `# comment` starts or -1), as bash reads quotes and comments."""
    quote: Optional[str] = None
    i, comment = 0, -1
    while i < len(text):
        c = text[i]
        if quote is None:
            if c == "\\":
                i += 2
                continue
            if c in "'\"":
                quote = c
            elif c == "#" and (i == 0 or text[i - 1].isspace()):
                comment = i
                break
        elif quote == '"' and c == "\\":
            i += 2
            continue
        elif c == quote:
            quote = None
        i += 1
    return quote, comment


def logical_lines(lines: Sequence[str]) -> Iterable[Tuple[int, str]]:
    """(index of the first physical line, the logical line) of a block's lines:
    backslash continuations joined with a space, a line inside an open quote
    joined with its newline kept, a trailing comment dropped."""
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while True:
            quote, comment = _scan(text)
            if quote is None and comment >= 0:
                text = text[:comment]
            if quote is not None and i + 1 < len(lines):
                i += 1
                text = text + "\n" + lines[i]
                continue
            stripped = text.rstrip()
            if quote is None and stripped.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = stripped[:-1].rstrip() + " " + lines[i].strip()
                continue
            break
        i += 1
        yield start, text.strip()


def program_of(command: str) -> Optional[str]:
    """The base name of the program `command` runs, past leading NAME=value words."""
    for word in command.split():
        if _ASSIGNMENT.match(word):
            continue
        return word.strip("\"'").rsplit("/", 1)[-1]
    return None


def is_assignment(command: str) -> bool:
    """A line that only sets shell variables (MODEL_DIR=...)."""
    words = command.split()
    return bool(words) and all(_ASSIGNMENT.match(w) for w in words)


def blocks(markdown: str) -> Iterable[Tuple[str, int, List[str]]]:
    """(language, 0-based index of the first line inside, the lines) of each fenced block."""
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, language = m.group(1), m.group(2), m.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line)
            j += 1
        yield language, i + 1, body
        i = j + 1


def commands_in(markdown: str, page: str) -> List[DocCommand]:
    """Every command of `PROGRAMS` in the shell blocks of one page."""
    found: List[DocCommand] = []
    for language, first, body in blocks(markdown):
        if language not in SHELL_LANGUAGES:
            continue
        setup: List[str] = []
        if language == "console":
            # only what follows a prompt; output lines end a command
            prompted, at = [], []
            for k, line in enumerate(body):
                if line.startswith("$ "):
                    prompted.append(line[2:])
                    at.append(k)
                elif prompted and prompted[-1].rstrip().endswith("\\"):
                    prompted.append(line)
                    at.append(k)
            pieces = [(at[k], text) for k, text in logical_lines(prompted)]
        else:
            pieces = list(logical_lines(body))
        for k, text in pieces:
            if not text:
                continue
            program = program_of(text)
            if program in PROGRAMS and not is_assignment(text):
                found.append(DocCommand(page, first + k + 1, text, program, tuple(setup)))
            else:
                setup.append(text)
    return found


def documented_pages(repo: Path) -> List[Path]:
    """The pages whose commands are held to the table: README.md, docs/*.md,
    benchmarks/README.md (a page added to docs/ is found without being named)."""
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "benchmarks" / "README.md"]
    return [p for p in pages if p.exists()]


def documented_commands(repo: Path) -> List[DocCommand]:
    """Every command of every documented page, in page order."""
    out: List[DocCommand] = []
    for path in documented_pages(repo):
        out.extend(commands_in(path.read_text(encoding="utf-8"), path.relative_to(repo).as_posix()))
    return out


# -- what the load clients report (their own output formats) --------------------------------

_GUIDELLM_DONE = re.compile(r"\): completed \|.*?successful=(\d+) errored=(\d+)")
_AIPERF_ROW = re.compile(r"^\s*│\s*([^│]*?)\s*│\s*([\d,.]+)\s*│")


def guidellm_counts(out: str) -> Optional[Tuple[int, int]]:
    """(successful, errored) requests of GuideLLM 0.8's last completed benchmark, from
    its progress log line ("Benchmark 1 (constant@10.00): completed | ... successful=50
    errored=0 ..."); None when no benchmark completed."""
    found = _GUIDELLM_DONE.findall(out)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def aiperf_counts(out: str) -> Tuple[Optional[float], List[str]]:
    """(the "Request Count" of aiperf's summary table or None, the error rows whose
    value is not 0: "Request Error Rate (%)", an "Error Request Count"; not "Completed
    Requests (Success + Error)", which counts every request)."""
    count: Optional[float] = None
    errors: List[str] = []
    for line in out.splitlines():
        m = _AIPERF_ROW.match(line)
        if not m:
            continue
        label, value = m.group(1), float(m.group(2).replace(",", ""))
        if label.startswith("Request Count"):
            count = value
        elif "Error" in label and "Success" not in label and value != 0:
            errors.append(line.strip())
    return count, errors
