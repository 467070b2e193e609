"""Suite-wide fixtures. The autouse check makes every test prove it leaked nothing:
no region file left in the shm root, no fd and no mapping of one in this process."""

from __future__ import annotations

import gc
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload import faults
from tests.procs import TEST_TAG

SHM = Path("/dev/shm")


def _shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM) if TEST_TAG in name}
    except OSError:
        return set()


def region_fds() -> list[str]:
    """Targets of this process's fds that are kvoffload/vLLM region files."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "vllm_offload_" in target:
            found.append(target)
    return found


def region_maps() -> list[str]:
    """Lines of /proc/self/maps that map a region file (deleted or not)."""
    with open("/proc/self/maps") as f:
        return [line.rstrip("\n") for line in f if "vllm_offload_" in line]


@pytest.fixture(scope="session", autouse=True)
def _session_leaves_shm_as_found() -> Iterator[None]:
    """The suite as a whole leaves /dev/shm as it found it; what a failed test left goes."""
    before = _shm_entries()
    yield
    left = sorted(_shm_entries() - before)
    for name in left:
        path = SHM / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if left:
        pytest.fail(f"the suite left {left} in {SHM} (removed now)")


@pytest.fixture(autouse=True)
def _leaves_shm_as_found() -> Iterator[None]:
    before = _shm_entries()
    yield
    faults.configure(None)
    # A mapping may be kept alive by garbage in a reference cycle (an exception's traceback);
    # that is not a leak, so collect it before looking.
    gc.collect()
    leaked = sorted(_shm_entries() - before)
    fds = region_fds()
    maps = region_maps()
    problems = []
    if leaked:
        # Reported, not removed: another pytest session on this host may own it. The next
        # test's snapshot includes it, so one leak fails one test; the session check below
        # removes what this session left.
        problems.append(f"files left in {SHM}: {leaked}")
    if fds:
        problems.append(f"open fds on region files: {fds}")
    if maps:
        problems.append(f"mappings of region files: {maps}")
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture
def engine_id() -> str:
    """A unique engine id so tests never collide with each other or a real engine."""
    return f"{TEST_TAG}{uuid.uuid4().hex[:12]}"


@pytest.fixture
def root() -> Iterator[Path]:
    """A private directory on the real /dev/shm tmpfs, removed with everything in it."""
    from tests.procs import shm_dir

    with shm_dir() as path:
        yield path


@pytest.fixture
def victim() -> Iterator[Path]:
    """A file outside the root that a hostile region name points at; it must survive."""
    from tests.procs import shm_dir, write_file

    with shm_dir() as elsewhere:
        yield write_file(elsewhere / "victim")


@pytest.fixture
def empty_proc(tmp_path: Path) -> Path:
    """A /proc that lists no process and says it is the initial PID namespace's: with it, only
    the write lease stands between an opener and a reap, and an iteration is a millisecond."""
    from kvoffload.liveness.namespace import INITIAL_PID_NAMESPACE

    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to(INITIAL_PID_NAMESPACE)
    return proc
