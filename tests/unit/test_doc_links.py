"""Every relative link in README.md and docs/*.md points to a file that
exists (anchors are not checked, only the file part), so moving or renaming
a page cannot leave a dead link behind."""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: [text](target) and [text](target "title"); images too. Code spans and
#: fenced blocks are removed first, so a bracket in code is no link.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def _pages():
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def relative_links(text):
    """The relative link targets of a markdown text, without their anchors."""
    text = CODE.sub("", FENCE.sub("", text))
    found = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, mailto: ... and anchors within the page
        found.append(target.split("#", 1)[0])
    return found


def test_the_link_pattern_finds_links_and_skips_code_and_urls():
    text = "see [a](docs/a.md#x) and ![i](img.png \"t\")\n`[b](no.md)`\n```\n[c](no2.md)\n```\n[u](https://x.org) [h](#top)"
    assert relative_links(text) == ["docs/a.md", "img.png"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_points_to_an_existing_file(page):
    with open(page) as f:
        text = f.read()
    base = os.path.dirname(page)
    broken = []
    for target in relative_links(text):
        path = os.path.normpath(os.path.join(base, target))
        if not os.path.exists(path):
            broken.append(target)
    assert not broken, f"{os.path.relpath(page, REPO)} links to missing files: {broken}"
