"""README and docs/ tell the truth about where things are: every relative link resolves.

README is the front door and the reference lives in docs/, so text moves between them; a link
to a file that is not there, or to a heading that is not in it, is a broken promise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.procs import REPO

DOCUMENTS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    found = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_and_heading_that_exist(document: Path) -> None:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", document.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_the_readme_is_a_front_door_not_the_reference() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, "README.md grew past a screenful of sections: move reference into docs/"
