"""Each run on its own: a process group killed whole, and a tmpfs of its own over ``/dev/shm``.

A run is the leader of a new session (so of a new process group); its children stay in that
group unless they make their own session, which no test here does. When the run ends, runs
out of time, or the harness is interrupted (``ProcessGroups.kill_all``), the whole group is
killed: no child of a test outlives it. The run sees a private tmpfs mounted over
``/dev/shm`` in a mount namespace of its own; the host's ``/dev/shm`` is never touched.
``compat/vllm_engine/`` runs its scenarios the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import SetupError

#: After the time limit pytest gets SIGINT and this long to write its report, then SIGKILL.
REPORT_GRACE_S = 30
#: How long a run may take to exit once its report is written. Past that it is held by children
#: that wait on each other (multiprocessing joins them at exit): the group is killed.
EXIT_GRACE_S = 60
TMPFS_SIZE = "8g"


class Interrupted(Exception):
    """The harness was interrupted: no new run starts."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI's time limit, ``timeout``): unwound as an interrupt, so groups are killed."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


class ProcessGroups:
    """The process group of every run in flight, so that an interrupted harness kills them all.

    A run is started as the leader of a new session (so of a new process group); its children
    stay in that group unless they make their own session, which no test here does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._closed = False

    def add(self, pgid: int) -> None:
        with self._lock:
            if self._closed:
                _kill_group(pgid)
                raise Interrupted
            self._live.add(pgid)

    def discard(self, pgid: int) -> None:
        with self._lock:
            self._live.discard(pgid)

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            for pgid in self._live:
                _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes in group ``pgid`` other than its leader, from ``/proc/<pid>/stat``."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            members.append(int(entry.name))
    return members


def _exited_within(pid: int, timeout_s: float) -> bool:
    """Whether child ``pid`` exits within ``timeout_s``; it is left unreaped (a zombie).

    Unreaped, the leader keeps its pid, and so its process group id, from being reused: the
    group can be killed afterwards without hitting anyone else's.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:  # a kernel before 5.3: poll
        if exc.errno != errno.ENOSYS:
            raise
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if status is not None:
                return True
            time.sleep(0.1)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class GroupRun:
    returncode: int
    timed_out: bool
    leftovers: int  # processes still in the group when its leader ended (killed with it)
    duration_s: float
    hung_at_exit: bool = False  # its report was written, but it did not exit: killed


def run_in_group(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    timeout_s: float,
    groups: ProcessGroups | None = None,
    grace_s: float = REPORT_GRACE_S,
    report: Path | None = None,
    exit_grace_s: float = EXIT_GRACE_S,
) -> GroupRun:
    """Run ``argv`` as the leader of a new process group; kill the whole group when it is done.

    At ``timeout_s`` the leader gets SIGINT (pytest then stops and writes its report with the
    tests it finished) and ``grace_s`` more. A leader that has written ``report`` and still runs
    ``exit_grace_s`` later is done too. Then, or as soon as the leader exits, every process left
    in the group is killed: a test's child that waits forever cannot hold the harness.
    """
    groups = groups or ProcessGroups()
    started = time.monotonic()
    deadline = started + timeout_s
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    timed_out = hung = False
    try:
        groups.add(proc.pid)
        reported: float | None = None
        while not _exited_within(proc.pid, max(0.0, min(1.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
                _exited_within(proc.pid, grace_s)
                break
            if report is not None and reported is None and report.exists():
                reported = now
            if reported is not None and now - reported >= exit_grace_s:
                hung = True
                break
        leftovers = len(group_members(proc.pid))
    finally:
        _kill_group(proc.pid)
        returncode = proc.wait()
        groups.discard(proc.pid)
    return GroupRun(returncode, timed_out, leftovers, time.monotonic() - started, hung)


def private_shm_argv() -> list[str]:
    """Run the rest of argv with a fresh tmpfs over /dev/shm that only it and its children see."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SetupError("unshare is not installed; install util-linux")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = f'mount -t tmpfs -o size={TMPFS_SIZE},mode=1777 vllm-compat /dev/shm && exec "$@"'
    return [unshare, *user, "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
