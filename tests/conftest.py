"""Suite-wide fixtures. The autouse check makes every test prove it leaked nothing:
no region file left in the shm root, no fd and no mapping of one in this process.

The suite runs on several workers at once (``make pytest``: pytest-xdist), so every name a
test makes carries its worker's ``TEST_TAG`` and every check here looks only at those. A test
that changes a setting of the whole machine is marked ``system_wide`` and runs alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvoffload import faults
from tests.support.procs import TEST_TAG

# pytest 9.2's node id; older pytests (vLLM's venv of `make vllm-hosted`) have none.
NodeId: Any = None
with contextlib.suppress(ImportError):
    NodeId = importlib.import_module("_pytest.nodeid").NodeId

SHM = Path("/dev/shm")


def _still_ignored(signum: int, frame: object) -> None:
    """A handler that does nothing: the runner stays deaf to the signal; exec resets it."""


def pytest_configure(config: pytest.Config) -> None:
    # A runner started by nohup, or in the background of a non-interactive shell (`make test &`,
    # some CI agents), ignores SIGHUP or SIGINT, and an ignored signal stays ignored across exec:
    # every process a test starts would be deaf to it, and the tests that send it (Ctrl-C to
    # `init --hold`, a hangup that `audit` passes on) would wait out their timeouts. A handler
    # leaves the runner as deaf as it was, and its children start with the default, as they
    # would from a terminal.
    for signum in (signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, _still_ignored)
    if not hasattr(config, "workerinput"):  # the session's own process, not an xdist worker
        config.stash[_UNNAMED_AT_START] = _unnamed_regions()


#: Region files in /dev/shm that no test session named (no ``kvtest-`` tag), at the start.
_UNNAMED_AT_START = pytest.StashKey[set[str]]()


def _unnamed_regions() -> set[str]:
    """Region names in /dev/shm without any session's tag: a real engine's, or a test's that
    named its engine without the ``engine_id`` fixture (which the per-test checks cannot see)."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("vllm_offload_") and "kvtest-" not in n}
    except OSError:
        return set()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_UNNAMED_AT_START, None)
    if before is None:
        return
    new = sorted(_unnamed_regions() - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"/dev/shm gained {len(new)} region file(s) no test named with its tag: "
                + ", ".join(new[:5])
                + (" ..." if len(new) > 5 else "")
                + " (a test that names an engine without the engine_id fixture, or an engine "
                "started on this host meanwhile)",
                red=True,
            )
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _turn(item: pytest.Item) -> int:
    if item.get_closest_marker("system_wide") is not None:
        return 2
    return 0 if item.get_closest_marker("slow") is not None else 1


def _keep_xdist_group(item: pytest.Item) -> None:
    """Name a grouped test ``NODEID@GROUP``, as pytest-xdist's ``--dist loadgroup`` needs.

    pytest-xdist 3.8 renames it through ``item._nodeid``, which pytest 9.2 no longer reads (the
    id is ``item._id``): without this every group would be silently split across workers.
    """
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    if not names:
        return
    suffix = "@" + "_".join(sorted(names))
    if (
        NodeId is not None
        and not item.nodeid.endswith(suffix)
        and isinstance(getattr(item, "_id", None), NodeId)
    ):
        item._id = NodeId.parse(item.nodeid + suffix)
    if not item.nodeid.endswith(suffix):
        raise pytest.UsageError(f"{item.nodeid}: this pytest and pytest-xdist do not keep xdist_group")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist hands tests out in this order (and the largest xdist_group first). The long
    # ones (slow) go first, so that none is left running alone at the end while the other
    # workers have nothing to do; the system-wide ones go last, when they no longer wait for a
    # long test to end, nor keep the other workers waiting at the turnstile.
    items.sort(key=_turn)
    if getattr(config.option, "loadgroup", False):  # a worker of pytest -n with --dist loadgroup
        for item in items:
            _keep_xdist_group(item)


#: Held shared by every test and alone by a ``system_wide`` one, across xdist workers and every
#: other session of this suite on the host: fs.leases-enable = 0 for one test makes every lease
#: of every other test refused. A test waiting to run alone bars new tests at the turnstile, so
#: a stream of short tests on the other workers cannot keep it waiting for ever.
SYSTEM_WIDE_LOCK = Path(tempfile.gettempdir()) / "kvtest-system-wide.lock"
SYSTEM_WIDE_TURNSTILE = Path(tempfile.gettempdir()) / "kvtest-system-wide.turnstile"


@contextmanager
def _flocked(path: Path, operation: int) -> Iterator[None]:
    # Read-only, and created only when missing: any user can lock it (fs.protected_regular
    # refuses O_CREAT on another user's file in /tmp). O_CLOEXEC: no child inherits the lock.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Around the whole protocol, fixtures included, and outside pytest-timeout's clock: the
    # wait for a turn is not the test's own time.
    if item.get_closest_marker("system_wide") is not None:
        with _flocked(SYSTEM_WIDE_TURNSTILE, fcntl.LOCK_EX), _flocked(SYSTEM_WIDE_LOCK, fcntl.LOCK_EX):
            yield
        return
    with ExitStack() as held:
        with _flocked(SYSTEM_WIDE_TURNSTILE, fcntl.LOCK_EX):
            held.enter_context(_flocked(SYSTEM_WIDE_LOCK, fcntl.LOCK_SH))
        yield


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
    from tests.support.procs import shm_dir

    with shm_dir() as path:
        yield path


@pytest.fixture
def victim() -> Iterator[Path]:
    """A file outside the root that a hostile region name points at; it must survive."""
    from tests.support.procs import shm_dir, write_file

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
