"""README and docs/ tell the truth: every relative link resolves, every command they show
names options that exist (and the README's node commands run), and every figure they quote
from `make bench` is the latest table's.

README is the front door and the reference lives in docs/, so text moves between them; a link
to a file that is not there, or to a heading that is not in it, is a broken promise.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO

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


def _console_commands(document: Path) -> list[str]:
    """Every ``$ shmctl ...`` line of the document's console blocks (continuations joined)."""
    found = []
    for block in _FENCE.findall(document.read_text()):
        lines = block.splitlines()[1:-1]
        i = 0
        while i < len(lines):
            line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            text = line.strip().removeprefix("$ ").removeprefix("sudo ")
            if line.strip().startswith("$ ") and text.startswith("shmctl "):
                found.append(text)
    return found


_SHOWN = [(doc.name, line) for doc in DOCUMENTS for line in _console_commands(doc)]


def test_the_docs_show_commands_to_check() -> None:
    readme = [line for name, line in _SHOWN if name == "README.md"]
    assert len(readme) >= 3
    assert len(_SHOWN) >= 20


@pytest.mark.parametrize(("document", "line"), _SHOWN, ids=[f"{d}:{line[:60]}" for d, line in _SHOWN])
def test_every_command_shown_in_the_docs_names_options_that_exist(document: str, line: str) -> None:
    """Parsed by the command's own parser: an unknown option, a missing value or an extra
    argument fails; a placeholder where a number goes (``--pid PID``) is the reader's to fill."""
    import shlex

    import typer.main

    from shmctl.app import app

    words = shlex.split(line.split(" | ", 1)[0].split(" && ", 1)[0], comments=True)
    root: Any = typer.main.get_command(app)
    parent = root.make_context("shmctl", [], resilient_parsing=True)
    name = words[1]
    command = root.get_command(parent, name)
    assert command is not None, f"{document}: no command {name!r} in {line!r}"
    try:
        command.make_context(name, words[2:], parent=parent).close()
    except Exception as e:
        if type(e).__name__ != "BadParameter":  # a placeholder value, not a wrong flag
            raise AssertionError(f"{document}: {line!r}: {e}") from None


@pytest.mark.parametrize("line", [line for name, line in _SHOWN if name == "README.md"])
def test_the_readmes_node_commands_run_as_shown(line: str, root: Path) -> None:
    """The three commands of "On a node, now" run (on a test root: the destructive one is
    pointed at an empty directory) and answer with a verdict, not a usage or runtime error."""
    import shlex
    import subprocess
    import sys

    words = shlex.split(line, comments=True)
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", *words[1:]],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "SHMCTL_ROOT": str(root)},
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr


def _latest_figures() -> dict[str, tuple[float, float]]:
    """``{figure: (median, ratio)}`` from docs/benchmarks.md's "Latest figures" table."""
    text = (REPO / "docs" / "benchmarks.md").read_text().split("### Latest figures", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1] and cells[1][0].isdigit():
            median = float(cells[1].split()[0].replace(",", ""))
            rows[cells[0]] = (median, float(cells[4]))
    return rows


_REGION = "create + pre-fault 1024 MiB: "
_DEFAULT = _REGION + "kvoffload SharedOffloadRegion, default populate threads [tmpfs]"
_HUGE = _REGION + "kvoffload SharedOffloadRegion, default populate threads [tmpfs huge=within_size]"


@pytest.mark.parametrize(
    ("row", "quoted"),
    [
        (_DEFAULT, "{ratio:.2f}x vLLM's own sequence on the default"),
        (
            _REGION + "kvoffload on one populate thread (fallocate + madvise) [tmpfs]",
            "{ratio:.2f}x on one thread",
        ),
        (
            _REGION + "kvoffload, per-page touch fallback (no MADV_POPULATE_WRITE) [tmpfs]",
            "{ratio:.2f}x\n  with the per-page touch fallback",
        ),
        (_HUGE, "{ratio:.2f}x vLLM's sequence on the"),
    ],
)
def test_the_library_quotes_the_latest_bench_table(row: str, quoted: str) -> None:
    _, ratio = _latest_figures()[row]
    assert quoted.format(ratio=ratio) in (REPO / "docs" / "library.md").read_text()


def test_the_huge_page_speedup_that_fixes_quote_is_the_latest_tables() -> None:
    """scan's JSON, doctor and init --dry-run say "about Nx faster": N is huge over default,
    never more than the latest table measured, and not so far below it that it misleads (the
    ratio moves with the VM: 5.5x on 2026-12-02, 9.7x on 2026-12-06's kernel build)."""
    from kvoffload.shm.mounts import HUGE_PAGE_SPEEDUP

    figures = _latest_figures()
    measured = figures[_HUGE][0] / figures[_DEFAULT][0]
    assert HUGE_PAGE_SPEEDUP <= round(measured) < 2.5 * HUGE_PAGE_SPEEDUP
    assert (
        f"about {HUGE_PAGE_SPEEDUP:g}x kvoffload on the default tmpfs"
        in (REPO / "docs" / "library.md").read_text()
    )
