"""Real processes that hold region files the ways vLLM and kvoffload do, for scan/reap tests.

A ``Child`` runs a short Python script, prints ``ready`` once it holds what it was asked
to hold, then blocks on stdin: closing stdin ends it cleanly, ``kill()`` SIGKILLs it (no
cleanup code runs, like an OOM kill). Every helper here cleans up what it starts.

Ways to hold a file (``mode``):

* ``vllm``: create it like vLLM 0.33 (``O_CREAT|O_EXCL``, 0600, ftruncate, MAP_SHARED
  with the fd kept open; no lock, no owner record);
* ``region``: create it with the real ``SharedOffloadRegion`` (flock + owner record);
* ``map-only``: open an existing file, map it with libc ``mmap`` and close the fd, as C
  code and vLLM's segment files do (only ``/proc/PID/maps`` shows it);
* ``fd-only``: open an existing file and keep only the fd;
* ``lock-only``: open an existing file, ``flock(LOCK_SH)``, keep the fd (no mapping).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from kvoffload.liveness.namespace import INITIAL_PID_NAMESPACE
from kvoffload.shm import names

if TYPE_CHECKING:
    from kvoffload.liveness.report import ScanEntry, ScanReport

REPO = Path(__file__).resolve().parents[2]
#: Every name this test session makes in /dev/shm carries this tag (engine ids, roots), so the
#: leak checks never trip over a real engine on the host or another pytest session's files.
TEST_TAG = f"kvtest-{os.getpid():x}{uuid.uuid4().hex[:4]}-"
SIZE = 1 << 20
#: The reason of a file the write lease proved nobody holds.
NOBODY = "no process anywhere has it open or mapped (write lease granted)"

_SCRIPT = r"""
import ctypes, fcntl, mmap, os, sys
mode, path = sys.argv[1], sys.argv[2]
keep = []
if mode == "vllm":
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, int(sys.argv[3]))
    keep.append(mmap.mmap(fd, int(sys.argv[3]), flags=mmap.MAP_SHARED))
    keep[-1][0] = 1
elif mode == "region":
    from pathlib import Path
    from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
    p = Path(path)
    engine_id = p.name[len("vllm_offload_"):-len(".mmap")]
    keep.append(SharedOffloadRegion(engine_id, 4, None, 2 * PAGESIZE, PAGESIZE, root=p.parent))
elif mode == "map-only":
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    c = ctypes
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    os.close(fd)
elif mode == "fd-only":
    keep.append(os.open(path, os.O_RDONLY))
elif mode == "lock-only":
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    keep.append(fd)
else:
    raise SystemExit(f"unknown mode {mode}")
print("ready", flush=True)
sys.stdin.read()
"""


class Child:
    """A process holding ``path`` in ``mode`` (module docstring) until stopped or killed.

    ``script`` replaces the built-in modes with a script of the test's own: it gets the same
    arguments (``mode``, ``path``, ``size``), must print ``ready`` once it holds the file and
    then wait on stdin.
    """

    def __init__(
        self,
        mode: str,
        path: Path,
        size: int = SIZE,
        *,
        prefix: tuple[str, ...] = (),
        script: str = _SCRIPT,
    ) -> None:
        self.mode = mode
        self.path = path
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", script, mode, str(path), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.kill()
            assert self.proc.stderr is not None
            raise RuntimeError(f"holder child ({mode} {path}) failed: {self.proc.stderr.read()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL and reap it: no cleanup code runs, as with an OOM kill."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._close_pipes()

    def stop(self) -> None:
        """Let it exit normally (closing stdin ends its wait)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()


def region_path(root: Path, engine_id: str, segment: int = 0) -> Path:
    return root / names.format_name(engine_id, segment)


def leave_orphan(root: Path, engine_id: str, *, mode: str = "vllm", size: int = SIZE) -> Path:
    """A region file whose creator was SIGKILLed while holding it: a real orphan."""
    path = region_path(root, engine_id)
    Child(mode, path, size).kill()
    return path


def write_file(path: Path, size: int = SIZE, *, touch: int = 1) -> Path:
    """A plain file of ``size`` bytes with ``touch`` pages written (the rest stays sparse)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        for page in range(touch):
            os.pwrite(fd, b"x", page * 4096)
    finally:
        os.close(fd)
    return path


def uninspectable_pids() -> frozenset[int]:
    """Processes this test run cannot inspect and does not control (here: the sandbox's init).

    With the write lease no test needs to vouch for them; the tests of the fallback without
    a lease (``--no-lease``) do, as an operator would with ``--assume-not-holding``.
    """
    from kvoffload.liveness.holders import collect_holders

    return frozenset(u.pid for u in collect_holders(inodes=()).uninspected if u.pid != os.getpid())


def vouch_args() -> list[str]:
    """``--assume-not-holding PID`` for each of ``uninspectable_pids()``."""
    return [arg for pid in sorted(uninspectable_pids()) for arg in ("--assume-not-holding", str(pid))]


@contextmanager
def shm_dir() -> Iterator[Path]:
    """A private directory on the real /dev/shm tmpfs, removed with everything in it."""
    path = Path("/dev/shm") / f"{TEST_TAG}root-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        # rmtree never follows symlinks out of the tree; hostile tests leave nested dirs.
        shutil.rmtree(path)


_CHURN = r"""
import json, mmap, os, random, sys, time, uuid
from pathlib import Path
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
root, seconds = Path(sys.argv[1]), float(sys.argv[2])
violations, iterations, orphans = [], 0, 0
HOLD_S = (0.0005, 0.005, 0.04)  # some regions outlive a whole scan, some appear and go within one
random.seed(int(sys.argv[3]))
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    iterations += 1
    engine_id = f"churn-{uuid.uuid4().hex[:10]}"
    path = root / f"vllm_offload_{engine_id}.mmap"
    if iterations % 2:
        region = SharedOffloadRegion(engine_id, 2, None, PAGESIZE, PAGESIZE, root=root)
        ino = region.identity[1]
        time.sleep(random.choice(HOLD_S))
        try:
            if os.stat(path).st_ino != ino:
                violations.append(f"{path.name}: replaced while attached")
        except FileNotFoundError:
            violations.append(f"{path.name}: removed while attached (kvoffload region)")
        region.cleanup()
        continue
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 2 * PAGESIZE)
    mm = mmap.mmap(fd, 2 * PAGESIZE, flags=mmap.MAP_SHARED)
    mm[0] = 1
    ino = os.fstat(fd).st_ino
    time.sleep(random.choice(HOLD_S))
    try:
        if os.stat(path).st_ino != ino:
            violations.append(f"{path.name}: replaced while attached")
    except FileNotFoundError:
        violations.append(f"{path.name}: removed while attached (vLLM-style file)")
    mm.close()
    os.close(fd)
    if iterations % 4 == 0:
        orphans += 1  # left behind like a crashed vLLM: the reaper's work
    else:
        os.unlink(path)
print(json.dumps({"iterations": iterations, "violations": violations, "orphans": orphans}), flush=True)
"""


def churn(root: Path, seconds: float, seed: int = 0) -> subprocess.Popen[str]:
    """A process that creates, attaches to, checks and releases regions in ``root`` for ``seconds``.

    It alternates kvoffload regions and vLLM-style files, leaves every fourth vLLM-style
    file behind as an orphan, and prints a JSON line: iterations, violations (a region
    removed or replaced while it was attached), orphans left.
    """
    return subprocess.Popen(
        [sys.executable, "-c", _CHURN, str(root), str(seconds), str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )


def entry(report: ScanReport, name: str) -> ScanEntry:
    """The one scan entry named ``name``."""
    found = [e for e in report.entries if e.name == name]
    assert len(found) == 1, [e.name for e in report.entries]
    return found[0]


def fake_proc(tmp_path: Path, *, maps_readable: bool, uid: int = 0, caps: int = 0x1FF) -> Path:
    """A /proc with one process (pid 4242, comm ``blind``) whose maps is readable or not."""
    proc = tmp_path / "proc"
    base = proc / "4242"
    (base / "fd").mkdir(parents=True)
    (base / "stat").write_text("4242 (blind) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n")
    (base / "status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapEff:\t{caps:x}\nCapPrm:\t{caps:x}\n")
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to(INITIAL_PID_NAMESPACE)  # a /proc that lists every process
    if maps_readable:
        (base / "maps").write_text("")
    else:
        (base / "maps").mkdir()  # reading it fails (EISDIR): the process cannot be inspected
    return proc
