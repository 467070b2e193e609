"""The node agent on a root out of inodes (issue #28): it frees the root, or says why it cannot.

A tmpfs full by inodes refuses the park directory's ``mkdir`` (``ENOSPC``). The agent's removal
is ``reap``'s: where no other uid can rename the region's names it removes the first region in
place under the same proofs, then parks the rest; where others can, it removes nothing and
tells ``removal_failed`` with the reason, every pass it tries.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness.watch import WatchConfig, Watcher
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import region_path

pytestmark = pytest.mark.root

USER = 1000


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", "size=8m,nr_inodes=16,mode=1777") as point:
        yield point


def fill(root: Path, engine_id: str) -> list[Path]:
    """Dead one-file regions until the filesystem has no inode left."""
    made: list[Path] = []
    for i in range(100):
        path = region_path(root, f"{engine_id}-{i:02d}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            return made
        try:
            os.write(fd, b"\1" * 4096)
        finally:
            os.close(fd)
        os.utime(path, (time.time() - 60, time.time() - 60))
        made.append(path)
    raise AssertionError("the tmpfs never ran out of inodes")


def passes(root: Path, count: int) -> list[Any]:
    seen: list[Any] = []
    watcher = Watcher(
        WatchConfig(roots=(str(root),), interval_s=0, reap=True, grace_s=0), on_event=seen.append
    )
    for _ in range(count):
        watcher.run_pass()
    return seen


def test_the_agent_frees_a_root_out_of_inodes(full_tmpfs: Path, engine_id: str) -> None:
    made = fill(full_tmpfs, engine_id)
    seen = passes(full_tmpfs, 2)  # orphaned in one pass, removed in the next
    assert os.listdir(full_tmpfs) == []
    assert sum(e.files for e in seen if e.event == "removed") == len(made)
    assert not [e for e in seen if e.event == "removal_failed"]


def test_the_agent_says_why_it_keeps_a_full_root_others_may_rename_in(
    full_tmpfs: Path, engine_id: str
) -> None:
    volume = full_tmpfs / "volume"
    volume.mkdir()
    os.chown(volume, USER, USER)  # a pod volume its user owns: the user may rename root's files
    volume.chmod(0o755)
    made = fill(volume, engine_id)
    seen = passes(volume, 3)
    failed = [e for e in seen if e.event == "removal_failed"]
    assert len(failed) == 2 * len(made)  # told in each pass that tried, for each region
    assert all("no inode left for a park directory" in e.reason for e in failed)
    assert not [e for e in seen if e.event == "removed"]
    assert sorted(os.listdir(volume)) == sorted(p.name for p in made)
