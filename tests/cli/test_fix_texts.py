"""Every "fix:" is true to the error it follows: the errno decides the fix, and a full disk,
a privileged port or a loop of links never gets the fix of a permission problem.

And every fix fits a screen: two lines of 80 columns with its ``fix: `` (a link to the docs
for the rest). The fixes are collected from the source itself, so a new long one fails here
the day it is written: every ``fix=`` argument, every fix and finding of a doctor ``Check``,
every text in a function that makes fixes (``*fix*``, ``*advice*``), and every literal that
prints ``fix: ``. A placeholder counts as ``PLACEHOLDER`` characters (a path such as
/dev/shm, a number of bytes); what a placeholder really holds is checked on real output in
tests/cli/test_doctor_sandbox.py.
"""

from __future__ import annotations

import ast
import errno
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvoffload.fixes import FINDING_WIDTH, FIX_WIDTH, fit
from kvoffload.tiering.fs.manager import _namespace_fix
from shmctl.render.fixes import unwritable_fix
from tests.support.procs import REPO

NOBODY = 65534


def test_a_config_that_is_a_loop_of_links_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmctl",
            "init",
            "--dry-run",
            "--model",
            "llama-3-8b",
            "--config",
            str(tmp_path / "a.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "loop of symbolic links" in done.stderr
    assert "this user can read" not in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_privileged_port_asks_for_the_capability_not_another_address(tmp_path: Path) -> None:
    if int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) <= 80:
        pytest.skip("this host lets any user bind port 80 (net.ipv4.ip_unprivileged_port_start)")
    root = tmp_path / "root"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
         sys.executable, "-m", "shmctl", "watch", "--once", "--root", str(root), "--listen", "127.0.0.1:80"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "CAP_NET_BIND_SERVICE" in done.stderr
    assert "local address" not in done.stderr


@pytest.mark.parametrize(
    ("code", "says", "never"),
    [
        (errno.ENOSPC, "free space", "write access"),
        (errno.EDQUOT, "free space", "write access"),
        (errno.EROFS, "read-only mount", "free space"),
        (errno.EACCES, "write access", "free space"),
        (errno.EIO, "dmesg", "write access"),
        (errno.ENOTDIR, "is a file", "free space"),
    ],
    ids=lambda v: errno.errorcode.get(v, str(v)) if isinstance(v, int) else v,
)
def test_the_fs_tiers_namespace_fix_follows_the_errno(code: int, says: str, never: str) -> None:
    fix = _namespace_fix(code, "/mnt/kv")
    assert says in fix
    assert never not in fix


# ----------------------------------------------------------------- every fix fits two lines

#: Two lines of an 80-column terminal.
LINE = 160
PREFIX = "fix: "
#: What a placeholder of an f-string is counted as: /dev/shm, a size, a number of bytes.
PLACEHOLDER = 10
SOURCES = sorted([*(REPO / "kvoffload").rglob("*.py"), *(REPO / "shmctl").rglob("*.py")])


@dataclass(frozen=True)
class FixText:
    where: str
    width: int
    limit: int

    def __str__(self) -> str:
        return f"{self.where}: {self.width} characters, more than {self.limit}"


def width(node: ast.expr) -> int | None:
    """The characters a string expression prints, placeholders counted as PLACEHOLDER; None
    for what is no string literal (a name, a call: its text is measured where it is written)."""
    if isinstance(node, ast.Constant):
        return len(node.value) if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return sum(len(str(v.value)) if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = width(node.left), width(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.IfExp):
        return max((w for w in (width(node.body), width(node.orelse)) if w is not None), default=None)
    return None


def _literal_text(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(v.value) if isinstance(v, ast.Constant) else "x" * PLACEHOLDER for v in node.values
        )
    return ""


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def fix_texts() -> list[FixText]:
    """Every fix (and doctor finding) the source can print, with the width it may have."""
    found: list[FixText] = []

    def add(node: ast.expr, path: Path, limit: int, what: str = "fix") -> None:
        measured = width(node)
        if measured is not None:
            found.append(FixText(f"{path.relative_to(REPO)}:{node.lineno} ({what})", measured, limit))

    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "fix":
                add(node.value, path, LINE - len(PREFIX))
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Check"
                and len(node.args) >= 4
            ):
                add(node.args[2], path, FINDING_WIDTH, "doctor finding")
                add(node.args[3], path, FIX_WIDTH, "doctor fix")
            elif isinstance(node, ast.FunctionDef) and any(w in node.name.lower() for w in ("fix", "advice")):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Constant, ast.JoinedStr)) and id(sub) not in docstrings:
                        add(sub, path, LINE - len(PREFIX), f"text of {node.name}()")
            elif isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in docstrings:
                text = _literal_text(node)
                if PREFIX in text and "\n" not in text:
                    tail = text.split(PREFIX, 1)[1]
                    found.append(
                        FixText(
                            f"{path.relative_to(REPO)}:{node.lineno} (after fix: )",
                            len(tail),
                            LINE - len(PREFIX),
                        )
                    )
    return found


def test_the_fixes_are_collected_from_every_module_that_makes_one() -> None:
    texts = fix_texts()
    # A collector that finds nothing passes everything: it must see the fixes we know of.
    assert len(texts) > 150
    places = {t.where.split(":")[0] for t in texts}
    for module in ("kvoffload/doctor/checks.py", "kvoffload/shm/mounts.py", "shmctl/render/fixes.py"):
        assert module in places


def test_every_fix_in_the_source_fits_two_lines_of_a_terminal() -> None:
    too_long = [str(t) for t in fix_texts() if t.width > t.limit]
    assert not too_long, "shorten these, with a docs/ link for the rest:\n" + "\n".join(too_long)


@pytest.mark.parametrize("code", sorted(errno.errorcode), ids=lambda code: errno.errorcode[code])
def test_every_unwritable_fix_fits_two_lines_of_a_terminal(code: int) -> None:
    fix = unwritable_fix(
        OSError(code, os.strerror(code)), Path("/dev/shm/kv"), instead="pass another --textfile"
    )
    assert len(PREFIX + fix) <= LINE, fix


def test_several_remedies_keep_their_order_and_as_many_as_fit_then_the_link() -> None:
    remedies = ["a" * 60, "b" * 40, "c" * 40]
    fix = fit(remedies, "space")
    assert fix == f"{'a' * 60}; {'b' * 40} (docs/doctor.md#space)"
    assert len(fix) <= FIX_WIDTH
    assert len(fit(["a" * 60, "b" * 40], "space")) <= FIX_WIDTH  # both fit: both kept


def test_the_first_remedy_is_kept_whatever_its_length() -> None:
    """A long path is still the operator's one pasteable line: never a bare link."""
    long_root = "x" * 300
    assert fit([long_root, "short"], "space") == f"{long_root} (docs/doctor.md#space)"
