"""Protocol citations in the code point into the repository.

Code cites the wire contract as "§3.2" or "Appendix D": a section of
docs/protocol.md, whose headings carry those numbers ("### 3.2 ADD: ...",
"## Appendix D. KV-cache events ..."). A citation of a section that has no
heading there, or a reference to a file outside the repository (the contract's
old place), is a dead link a reader cannot follow. Outside the package (whose
__init__ docstring says what "§N" means) a module citing bare "§N" says so in
its own docstring.
"""

import ast
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTOCOL_PAGE = os.path.join(REPO, "docs", "protocol.md")

#: "## 0. Encoding ...", "### 2.1 Sequence ...", "## Appendix D. KV-cache ...".
SECTION_HEADING = re.compile(r"^#{2,}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
APPENDIX_HEADING = re.compile(r"^#{2,}\s+Appendix ([A-Z])\b", re.M)

#: "§3.2", "§ 4", a range "§1-2" (both ends cited); "§N" (a letter) is the
#: notation itself, not a citation.
SECTION_CITATION = re.compile(r"§\s?(\d+(?:\.\d+)*)(?:\s?[-–]\s?(\d+(?:\.\d+)*))?")
APPENDIX_CITATION = re.compile(r"\bAppendix ([A-Z])\b")

#: References to the contract's place outside the repository. Spelled in
#: pieces so that this file does not match itself.
OUTSIDE = ("PROTOCOL" + ".md", "shared" + "/")

def _code_files():
    patterns = ("gmock_engine/**/*.py", "benchmarks/*.py", "tests/**/*.py")
    found = set()
    for pattern in patterns:
        found.update(glob.glob(os.path.join(REPO, pattern), recursive=True))
    return sorted(os.path.relpath(path, REPO) for path in found)


def protocol_sections(text):
    """The section numbers ("0", "2.1") and appendix letters ("D") headed in docs/protocol.md."""
    return set(SECTION_HEADING.findall(text)), set(APPENDIX_HEADING.findall(text))


def citations(text):
    """(kind, cited) pairs of a source text: ("§", "3.2") or ("Appendix", "D")."""
    found = []
    for first, last in SECTION_CITATION.findall(text):
        found.append(("§", first))
        if last:
            found.append(("§", last))
    found.extend(("Appendix", letter) for letter in APPENDIX_CITATION.findall(text))
    return found


def dead_citations(text, sections, appendices):
    """The citations of `text` that name no heading of docs/protocol.md."""
    return [
        f"{kind} {cited}" if kind == "Appendix" else f"§{cited}"
        for kind, cited in citations(text)
        if (cited not in sections if kind == "§" else cited not in appendices)
    ]


def outside_references(text):
    """Lines of `text` that refer to the contract outside the repository."""
    return [line.strip() for line in text.splitlines() if any(word in line for word in OUTSIDE)]


def _read(rel):
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def headed():
    with open(PROTOCOL_PAGE, encoding="utf-8") as f:
        return protocol_sections(f.read())


def test_the_page_numbers_its_sections_as_the_code_cites_them(headed):
    sections, appendices = headed
    assert {"0", "1", "2.5", "3.2", "4.3", "8.1", "9.2"} <= sections
    assert {"D", "E", "F"} <= appendices


def test_the_checks_catch_a_dead_citation_and_an_outside_reference(headed):
    sections, appendices = headed
    bogus = "# the ADD (§3.2, §1-2, Appendix D) and §" + "3.99, §2-" + "12, Appendix " + "Z; §N is notation"
    assert dead_citations(bogus, sections, appendices) == ["§" + "3.99", "§" + "12", "Appendix " + "Z"]
    line = "# see ../" + OUTSIDE[1] + OUTSIDE[0] + " §4"
    assert outside_references("x = 1\n" + line + "\n") == [line.strip()]


@pytest.mark.parametrize("rel", _code_files())
def test_every_protocol_citation_names_a_heading_of_docs_protocol_md(rel, headed):
    assert dead_citations(_read(rel), *headed) == []


@pytest.mark.parametrize("rel", _code_files())
def test_no_code_refers_to_the_contract_outside_the_repository(rel):
    assert outside_references(_read(rel)) == []


@pytest.mark.parametrize("rel", [rel for rel in _code_files() if not rel.startswith("gmock_engine" + os.sep)])
def test_a_module_citing_bare_sections_outside_the_package_says_where_they_are(rel):
    text = _read(rel)
    if not citations(text):
        return
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert "docs/protocol.md" in docstring, f"{rel} cites § sections; its docstring should say they are docs/protocol.md's"


def test_the_package_docstring_says_where_sections_are():
    import gmock_engine

    assert "§N in comments: section N of docs/protocol.md" in gmock_engine.__doc__
