"""The streamed commands on a read-only root filesystem, as ``kubectl exec`` into the DaemonSet
(``readOnlyRootFilesystem: true``, no writable ``/tmp``) runs them.

Long tables and ``reap --json``'s lists wait in an unlinked temporary file; where no directory
is writable they wait in memory, and the output is the same. Real ``bwrap`` sandboxes: ``/``
bound read-only, only the shm root writable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmctl.render.document import HELD_ROWS
from tests.support.procs import TEST_TAG

BWRAP = shutil.which("bwrap")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _bwrap_works() -> bool:
    if BWRAP is None:
        return False
    done = subprocess.run([BWRAP, "--ro-bind", "/", "/", "true"], capture_output=True, check=False)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not _bwrap_works(), reason="bwrap is not installed or cannot sandbox here")


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path("/dev/shm") / f"{TEST_TAG}-ro-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def orphans(root: Path, count: int) -> list[str]:
    names = [f"vllm_offload_{TEST_TAG}-ro-{i:05d}.mmap" for i in range(count)]
    page = b"\0" * PAGE
    for name in names:
        fd = os.open(root / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
    return names


def shmctl(root: Path, *args: str, read_only: bool) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shmctl", *args, "--root", str(root), "--grace", "0s"]
    if read_only:  # / read-only (no writable /tmp, nor cwd), the shm root writable
        assert BWRAP is not None
        sandbox = ["--ro-bind", "/", "/", "--dev", "/dev", "--bind", str(root), str(root)]
        argv = [BWRAP, *sandbox, "--proc", "/proc", "--chdir", "/", *argv]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_reap_json_on_a_read_only_root_filesystem_is_the_same_document(root: Path) -> None:
    names = orphans(root, 3)
    sandboxed = shmctl(root, "reap", "--dry-run", "--json", read_only=True)
    plain = shmctl(root, "reap", "--dry-run", "--json", read_only=False)
    assert (sandboxed.returncode, sandboxed.stderr) == (plain.returncode, plain.stderr)
    ours, theirs = json.loads(sandboxed.stdout), json.loads(plain.stdout)
    assert [e["name"] for e in ours["removed"]] == names
    for doc in (ours, theirs):
        doc.pop("scanned_at", None)
        for e in doc["removed"]:
            for volatile in ("age_s", "changed_age_s"):
                e.pop(volatile, None)
    assert ours == theirs
    assert sorted(os.listdir(root)) == names  # a dry run


def test_a_table_longer_than_what_is_held_on_a_read_only_root_filesystem(root: Path) -> None:
    count = HELD_ROWS + 3
    orphans(root, count)
    sandboxed = shmctl(root, "scan", "--no-headers", "--limit", "0", read_only=True)
    assert sandboxed.returncode == 1, sandboxed.stderr
    rows = sandboxed.stdout.splitlines()
    assert len([r for r in rows if f"{TEST_TAG}-ro-" in r]) == count
    plain = shmctl(root, "scan", "--no-headers", "--limit", "0", read_only=False)
    strip = [r.split()[0] for r in rows]
    assert strip == [r.split()[0] for r in plain.stdout.splitlines()]
