"""``scan`` says how its root is mounted and, where regions get 4 KiB pages, how to get huge ones.

Real tmpfs mounts of the test's own (``huge=never`` and ``huge=within_size``), a real file in
each, the CLI's JSON checked against its schema. The fix is the JSON's only: a text scan, even
on a terminal, leaves it to ``shmctl doctor`` and ``init --dry-run``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.liveness.scan import scan
from kvoffload.shm import mounts
from tests.support.hostile import shmctl
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import region_path, write_file
from tests.support.schemas import validate
from tests.support.terminal import on_a_terminal

pytestmark = pytest.mark.root


@pytest.fixture(params=["never", "within_size"])
def shm_root(tmp_path: Path, request: pytest.FixtureRequest, engine_id: str) -> Iterator[tuple[Path, str]]:
    """A tmpfs mounted huge=PARAM holding one orphaned region file."""
    with mounted_tmpfs(tmp_path / "shm root", f"size=16m,huge={request.param}") as point:
        write_file(region_path(point, engine_id))
        yield point, request.param


def huge_pages_on(huge: str) -> bool:
    info = mounts.root_mount("/")
    deny_or_force = info is not None and info.shmem_enabled in ("deny", "force")
    if deny_or_force:
        pytest.skip("shmem_enabled deny/force overrides every mount's huge= here")
    return huge != "never"


def test_the_report_names_the_mount_its_huge_policy_and_the_fix_as_the_plan_does(
    shm_root: tuple[Path, str],
) -> None:
    root, huge = shm_root
    on = huge_pages_on(huge)
    pages = scan(root, grace_s=0).huge_pages
    assert pages is not None
    assert (pages.mount_point, pages.fs_type, pages.huge, pages.effective) == (root, "tmpfs", huge, huge)
    assert pages == mounts.check_huge_pages(root)  # what init --dry-run's plan reports
    if on:
        assert pages.fix is None
    else:
        assert pages.fix is not None
        assert f"mount -o remount,huge=within_size {shlex.quote(str(root))}" in pages.fix
        assert f"{mounts.HUGE_PAGE_SPEEDUP:g}x faster" in pages.fix


def test_the_json_carries_the_mount_and_validates(shm_root: tuple[Path, str]) -> None:
    root, huge = shm_root
    huge_pages_on(huge)
    done = shmctl("scan", "--root", str(root), "--json", "--grace", "0")
    document = json.loads(done.stdout)
    validate(document, "scan")
    pages = document["huge_pages"]
    assert pages["mount_point"] == str(root)
    assert (pages["huge"], pages["effective"]) == (huge, huge)
    assert (pages["fix"] is None) == (huge != "never")
    assert "huge" not in done.stderr  # JSON mode: the document says it, stderr does not


def test_neither_a_terminal_nor_a_pipe_gets_the_fix_from_scan_doctor_gives_it(
    shm_root: tuple[Path, str],
) -> None:
    root, huge = shm_root
    on = huge_pages_on(huge)
    seen = on_a_terminal("scan", "--root", str(root), "--grace", "0", on=("stdout", "stderr"))
    piped = shmctl("scan", "--root", str(root), "--grace", "0")
    assert "pre-faulting" not in seen.plain, seen.plain
    assert "pre-faulting" not in piped.stderr
    assert "orphaned" in seen.plain
    assert "orphaned" in piped.stdout
    # Huge pages are init's matter: doctor weighs them for a planned region of 1 GiB and up (#32).
    doctor = json.loads(shmctl("doctor", "--root", str(root), "--json", "--need", "2g").stdout)
    [check] = [c for c in doctor["checks"] if c["name"] == "huge-pages"]
    assert (check["status"], check["fix"]) == (
        ("ok", None) if on else ("warn", mounts.check_huge_pages(root).fix)
    )
