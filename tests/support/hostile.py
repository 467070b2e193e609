"""Tools for the hostile tests: a /proc tree that stops a pass at an exact moment, a small
tmpfs, processes of another uid or with a zombie leader, and the CLI as a subprocess.

Everything here cleans up what it starts; nothing touches a name the test did not create.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvoffload.liveness.namespace import INITIAL_PID_NAMESPACE
from tests.support.procs import REPO, Child

if TYPE_CHECKING:
    import pytest

GATE_PID = 4242
_STAT = f"{GATE_PID} (gate) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n"


class ProcGate:
    """A /proc tree with one inspectable process whose ``stat`` is a FIFO.

    Every pass of ``collect_holders`` over this tree opens that FIFO and blocks until the
    gate serves it, so ``actions[n]`` runs while the library is inside its n-th pass: in
    ``scan`` the pass comes after the listing and before the lock probe, in ``reap`` the
    second pass is step 4, after the files are locked and before they are unlinked.
    The process holds nothing (empty fds and maps), so the gate itself is no evidence.
    """

    def __init__(self, tmp: Path, actions: Sequence[Callable[[], None] | None]) -> None:
        self.root = tmp / "proc"
        base = self.root / str(GATE_PID)
        (base / "fd").mkdir(parents=True)
        (base / "maps").write_text("")
        (base / "status").write_text("Name:\tgate\nUid:\t0\t0\t0\t0\nCapEff:\t0\nCapPrm:\t0\n")
        (self.root / "self" / "ns").mkdir(parents=True)
        (self.root / "self" / "ns" / "pid").symlink_to(INITIAL_PID_NAMESPACE)  # it lists every process
        self._fifo = base / "stat"
        os.mkfifo(self._fifo)
        self._actions = list(actions)
        self.passes = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="proc-gate", daemon=True)

    def __enter__(self) -> ProcGate:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.errors and kind is None:
            raise self.errors[0]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                    self.errors.append(e)
                    return
                time.sleep(0.0005)
                continue
            try:
                index, self.passes = self.passes, self.passes + 1
                action = self._actions[index] if index < len(self._actions) else None
                if action is not None:
                    action()
            except BaseException as e:
                self.errors.append(e)
            finally:
                os.write(fd, _STAT.encode())
                # A fresh FIFO for the next pass: this reader keeps the old one until EOF,
                # so it can never be mistaken for the next pass's reader.
                fresh = self._fifo.with_name("stat.next")
                os.mkfifo(fresh)
                os.replace(fresh, self._fifo)
                os.close(fd)


@contextmanager
def small_tmpfs(parent: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted for the test; skips when mounting is not allowed here."""
    import pytest

    mnt = parent / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        mnt.rmdir()


def fill(directory: Path, name: str = "filler") -> Path:
    """Write zeros to ``directory/name`` until the filesystem has no byte left."""
    path = directory / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path


def fill_after_the_space_check(monkeypatch: pytest.MonkeyPatch, directory: Path) -> list[Path]:
    """Fill ``directory`` (``fill``) the moment a region's free-space check has passed.

    That is where another tenant's writes land in production: after the check, before the
    reservation or the faults. The module looks ``check_shm_free_space`` up at call time so a
    test can replace it; here the real check runs first, so the window is opened at the same
    point on every run, however loaded the machine (a filler thread racing the region lost
    or won that race by scheduling luck). Returns the filled files, one per check passed.
    """
    from kvoffload.cpu import shared_offload_region as module

    check = module.check_shm_free_space
    filled: list[Path] = []

    def check_then_fill(*args: Any, **kwargs: Any) -> None:
        check(*args, **kwargs)
        filled.append(fill(directory))

    monkeypatch.setattr(module, "check_shm_free_space", check_then_fill)
    return filled


def as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child as ``uid`` (root only); return its JSON-able result.

    An exception in the child comes back as ``{"error": "Type: message"}``. The child cannot
    import what this interpreter has not imported yet when its stdlib is private to root, so
    run ``fn``'s code paths once before.
    """
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to switch uid")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out: Any = fn()
        except BaseException as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        try:
            os.write(write_end, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


class ForeignHolder:
    """A forked child running as ``uid`` that opens and maps ``path`` until closed."""

    def __init__(self, path: Path, uid: int = 65534) -> None:
        import pytest

        if os.geteuid() != 0:
            pytest.skip("needs root to run a holder as another uid")
        ready_r, ready_w = os.pipe()
        hold_r, hold_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_r)
                os.close(hold_w)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                fd = os.open(path, os.O_RDWR)
                mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
                os.write(ready_w, b"ready")
                os.close(ready_w)
                os.read(hold_r, 1)  # until the parent closes its end
                mm.close()
                os.close(fd)
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(hold_r)
        self.pid = pid
        self._hold = hold_w
        with os.fdopen(ready_r, "rb") as f:
            if f.read() != b"ready":
                self.close()
                raise RuntimeError(f"holder as uid {uid} could not map {path}")

    def close(self) -> None:
        if self._hold >= 0:
            os.close(self._hold)
            self._hold = -1
            os.waitpid(self.pid, 0)

    def __enter__(self) -> ForeignHolder:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# The main thread maps the file, starts a thread that keeps the mapping, then ends with
# pthread_exit: the process lives on, but its leader is a zombie (state Z) whose /proc/PID
# fd and maps are empty. Only /proc/PID/task/TID still shows the mapping.
_ZOMBIE_LEADER = r"""
import ctypes, mmap, os, sys, threading
path = sys.argv[2]
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED)
mm[0] = 1
def hold():
    sys.stdin.read()
    mm.close()
    os.close(fd)
threading.Thread(target=hold).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


class ZombieLeader(Child):
    """A live process holding ``path`` whose thread-group leader has already exited."""

    def __init__(self, path: Path) -> None:
        super().__init__("zombie-leader", path, script=_ZOMBIE_LEADER)
        deadline = time.monotonic() + 10
        while self.state() != "Z":  # the leader's pthread_exit has completed
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the leader of the zombie-leader child never exited")
            time.sleep(0.005)

    def state(self) -> str:
        from kvoffload import procfs

        return procfs.read_stat(self.pid).state


def shmctl(
    *args: str, env: Mapping[str, str | None] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m shmctl ARGS`` off a terminal, output captured and decoded leniently.

    ``env`` adds variables to this process's environment; a value of None removes one.
    """
    merged = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return subprocess.run(
        [sys.executable, "-m", "shmctl", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="surrogateescape",
        cwd=REPO,
        env=merged,
        timeout=timeout,
        check=False,
    )
