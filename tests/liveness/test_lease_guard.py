"""A lease never stalls an engine: whichever shmctl process stops while it holds one.

While shmctl holds a write lease, an engine's ``open()`` of the file blocks in the kernel
until the lease goes or ``fs.lease-break-time`` (45 s) passes. ``kvoffload.liveness.watchdog``
bounds that wait: a watchdog SIGKILLs a stopped, traced or stuck holder once an opener
waits on it, and Ctrl-Z (``SIGTSTP``) is deferred until the lease is released.

Real processes hold real leases on files in the real ``/dev/shm``; the openers are this
process. Timings are asserted here, against the rule, because the bound is the contract:
an opener must get its file within ``BOUND_S`` (the kernel's own bound is 45 s, so a
failure is unambiguous; the guard's worst case is ``HOLD_LIMIT_S`` plus a poll or two).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.liveness import lease, prober, watchdog
from tests.support.procs import REPO, region_path, write_file

#: What an engine's open may wait at most, whatever shmctl process is stopped.
BOUND_S = 1.0
#: Runs of the randomized scan test per stopped process (main, prober).
RUNS = 6
FILES = 2000

HOLDER = r"""
import os, sys, time
from kvoffload.liveness import lease, watchdog
path, how = sys.argv[1], sys.argv[2]
with lease.sigio_ignored():
    deadline = time.monotonic() + 30
    while not watchdog.status().watching and time.monotonic() < deadline:
        time.sleep(0.005)
    fd = os.open(path, os.O_RDONLY)
    me = os.geteuid()
    if how == "loop":  # hold almost all the time: take, 2 ms busy, release, again
        print("held", watchdog.status().watchdog_pid, os.getpgrp(), flush=True)
        while True:
            assert lease.take(fd, me, me).free
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            lease.release(fd)
    if how == "batch":  # a batch of leases (a reap's): take, 2 ms busy, release, 0.5 ms busy, again
        print("held", watchdog.status().watchdog_pid, os.getpgrp(), flush=True)
        with lease.batched():
            while True:
                assert lease.take(fd, me, me).free
                end = time.perf_counter() + 0.002
                while time.perf_counter() < end:
                    pass
                lease.release(fd)
                end = time.perf_counter() + 0.0005
                while time.perf_counter() < end:
                    pass
    if how == "batch-gap":  # one lease of a batch, then a gap inside the batch until a line comes
        with lease.batched():
            assert lease.take(fd, me, me).free
            lease.release(fd)
            print("held", watchdog.status().watchdog_pid, os.getpgrp(), flush=True)
            sys.stdin.readline()
        print("out", flush=True)
        sys.stdin.read()
        sys.exit(0)
    assert lease.take(fd, me, me).free
    print("held", watchdog.status().watchdog_pid, os.getpgrp(), flush=True)
    if how == "spin":  # alive, running, never lets go
        while True:
            pass
    sys.stdin.read()  # "wait": holds until stdin closes
"""

#: Runs a command as a child subreaper: whatever the command leaves running becomes ours.
SUBREAPER = r"""
import ctypes, json, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
env = {**os.environ, **json.loads(sys.argv[2])}
quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
rc = subprocess.run(json.loads(sys.argv[1]), env=env, **quiet).returncode
ended = time.monotonic()
exited = []
while time.monotonic() < ended + 5:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break  # nothing of the command's is left
    if pid:
        exited.append(time.monotonic() - ended)
    else:
        time.sleep(0.005)
with open(f"/proc/self/task/{os.getpid()}/children") as f:
    left = [int(pid) for pid in f.read().split()]
for pid in left:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"rc": rc, "exited_after": exited, "still_running": len(left)}))
"""


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from field 3 (state) on; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def state(pid: int) -> str | None:
    fields = proc_stat(pid)
    return None if fields is None else fields[0]


def wait_for_state(pid: int, wanted: str, timeout: float = 10) -> str | None:
    """Wait until ``pid`` is in one of the states ``wanted`` (or has exited: None)."""
    deadline = time.monotonic() + timeout
    while (now := state(pid)) is not None and now not in wanted:
        assert time.monotonic() < deadline, f"pid {pid} still in state {now}, not {wanted}"
        time.sleep(0.001)
    return now


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (a reparented grandchild)."""
    return state(pid) in (None, "Z", "X")


def wait_exited(pid: int, timeout: float) -> float:
    """Seconds until ``pid`` exited; fails after ``timeout``."""
    start = time.monotonic()
    while not exited(pid):
        assert time.monotonic() - start < timeout, f"pid {pid} still runs after {timeout}s"
        time.sleep(0.005)
    return time.monotonic() - start


def timed_open(path: Path) -> tuple[float, int]:
    """An engine's open: how long it waited, and its fd (the caller closes it)."""
    start = time.monotonic()
    fd = os.open(path, os.O_RDWR)
    return time.monotonic() - start, fd


def timed_open_close(path: Path) -> float:
    waited, fd = timed_open(path)
    os.close(fd)
    return waited


class Holder:
    """A Python child holding a write lease on ``path`` through the library (``HOLDER``)."""

    def __init__(self, path: Path, how: str) -> None:
        # A process group of its own, under ours: not orphaned, so Ctrl-Z's SIGTSTP stops it.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), how],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            text=True,
            process_group=0,
        )
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], 30)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("held "):
            self.close()
            raise RuntimeError(f"holder failed: {line!r}")
        _, watchdog, pgrp = line.split()
        self.watchdog = int(watchdog)
        self.pgrp = int(pgrp)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def reap(self) -> int:
        """Wait for it to end (also when this process traces it); its exit code, -N for signal N."""
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                break
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                break
        assert self.proc.returncode is not None
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.reap()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@contextlib.contextmanager
def holding(path: Path, how: str) -> Iterator[Holder]:
    holder = Holder(path, how)
    try:
        yield holder
    finally:
        holder.close()


def subreaped(argv: list[str], env: dict[str, str] | None = None) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", SUBREAPER, json.dumps(argv), json.dumps(env or {})],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    answer: dict[str, object] = json.loads(result.stdout)
    return answer


# ---------------------------------------------------------------------------------------
# a holder that cannot answer
# ---------------------------------------------------------------------------------------


def test_a_sigstopped_holder_is_killed_and_the_opener_gets_the_file_within_the_bound(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "wait") as holder:
        os.kill(holder.pid, signal.SIGSTOP)
        assert wait_for_state(holder.pid, "T") == "T"
        waited = timed_open_close(path)
        assert holder.reap() == -signal.SIGKILL
    assert waited < BOUND_S


def test_a_ptrace_stopped_holder_is_killed_and_the_opener_gets_the_file_within_the_bound(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    with holding(path, "wait") as holder:
        # A debugger's stop: PTRACE_SEIZE, then PTRACE_INTERRUPT (state "t", tracing stop).
        if libc.ptrace(0x4206, holder.pid, None, None) != 0:
            pytest.skip(f"ptrace is not allowed here: {os.strerror(ctypes.get_errno())}")
        assert libc.ptrace(0x4207, holder.pid, None, None) == 0
        assert wait_for_state(holder.pid, "t") == "t"
        waited = timed_open_close(path)
        assert holder.reap() == -signal.SIGKILL
    assert waited < BOUND_S


def test_a_running_holder_that_keeps_its_lease_too_long_is_killed_once_an_opener_waits(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "spin") as holder:
        waited = timed_open_close(path)  # right after the take: the worst case, HOLD_LIMIT_S
        assert holder.reap() == -signal.SIGKILL
    assert waited < BOUND_S


def test_a_stopped_holder_nobody_waits_on_is_left_alone(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "wait") as holder:
        os.kill(holder.pid, signal.SIGSTOP)
        assert wait_for_state(holder.pid, "T") == "T"
        time.sleep(watchdog.HOLD_LIMIT_S + 10 * watchdog.POLL_S)
        assert state(holder.pid) == "T"  # a debugger may keep it as long as no engine needs the file
        waited = timed_open_close(path)  # now an engine does
        assert holder.reap() == -signal.SIGKILL
    assert waited < BOUND_S


def test_ctrl_z_waits_until_the_lease_is_released(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "loop") as holder:  # holds ~99% of the time
        os.kill(holder.pid, signal.SIGTSTP)
        assert wait_for_state(holder.pid, "T") == "T"
        waited = timed_open_close(path)
        # Stopped between two leases: nothing to break, nobody killed.
        assert state(holder.pid) == "T"
        os.kill(holder.pid, signal.SIGCONT)
        assert wait_for_state(holder.pid, "RS") in ("R", "S")
    assert waited < 10 * watchdog.POLL_S


def test_ctrl_z_in_a_batch_of_leases_stops_it_between_two_leases(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "batch") as holder:  # holds ~80% of the time, stops deferred between leases
        os.kill(holder.pid, signal.SIGTSTP)
        assert wait_for_state(holder.pid, "T") == "T"
        waited = timed_open_close(path)
        # Stopped between two leases, none held: nothing to break, nobody killed.
        assert state(holder.pid) == "T"
        os.kill(holder.pid, signal.SIGCONT)
        assert wait_for_state(holder.pid, "RS") in ("R", "S")
    assert waited < 10 * watchdog.POLL_S


def test_a_ctrl_z_deferred_in_a_batch_stops_it_when_the_batch_ends(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "batch-gap") as holder:
        assert holder.proc.stdin is not None
        assert holder.proc.stdout is not None
        os.kill(holder.pid, signal.SIGTSTP)
        time.sleep(0.2)
        assert state(holder.pid) != "T"  # deferred since the batch's lease, not lost...
        holder.proc.stdin.write("end the batch\n")
        holder.proc.stdin.flush()
        assert wait_for_state(holder.pid, "T") == "T"  # ...and delivered as the batch ends
        assert timed_open_close(path) < 10 * watchdog.POLL_S
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.proc.stdout.readline() == "out\n"


# ---------------------------------------------------------------------------------------
# a real scan, stopped at random moments
# ---------------------------------------------------------------------------------------


MODULE = [sys.executable, "-m", "shmctl"]
#: ``shmctl`` on one CPU, as on a one-core node: the main process probes (no prober child).
ONE_CPU = [
    sys.executable,
    "-c",
    "import os, runpy, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    "sys.argv[0] = 'shmctl'; runpy.run_module('shmctl', run_name='__main__')",
]


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def prober_child(scan_pid: int, watchdog: int | None) -> int | None:
    """The scan's forked prober (its child in its own session, unlike the watchdog)."""
    for pid in children(scan_pid):
        fields = proc_stat(pid)
        if pid != watchdog and fields is not None and int(fields[3]) != pid:  # field 6: session
            return pid
    return None


def tree(pid: int) -> dict[int, str | None]:
    """States of a process and its children, for a failure message."""
    return {p: state(p) for p in (pid, *children(pid))}


def watchdog_of(scan_pid: int) -> int | None:
    for pid in children(scan_pid):
        fields = proc_stat(pid)
        if fields is not None and int(fields[3]) == pid:  # a session leader: the watchdog
            return pid
    return None


def leased_inode(pid: int) -> int | None:
    """The inode a write lease of ``pid`` covers now, per /proc/locks."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "LEASE" and fields[4] == str(pid):
            return int(fields[5].rsplit(":", 1)[1])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("target", ["main", "prober"])
def test_sigstop_of_a_real_scan_at_random_moments_never_stalls_an_opener(
    root: Path, engine_id: str, target: str, tmp_path: Path
) -> None:
    """Two runs in three stop it until a stop catches a lease held, and open that file; the
    third stops it once at a random moment and opens a random file."""
    if target == "prober" and not prober.parallel_possible():
        pytest.skip("needs two CPUs: the scan probes in the main process")
    paths = [write_file(region_path(root, f"{engine_id}-{i}"), 4096, touch=0) for i in range(FILES)]
    by_inode = {p.stat().st_ino: p for p in paths}
    rng = random.Random(f"{engine_id}{target}")
    caught = 0
    for run in range(RUNS):
        at_random = run % 3 == 2
        report = tmp_path / f"scan-{run}.json"  # a file, not a pipe we would have to drain
        with report.open("w") as out:
            scan = subprocess.Popen(
                [
                    *(ONE_CPU if target == "main" else MODULE),
                    "scan",
                    "--root",
                    str(root),
                    "--grace",
                    "0s",
                    "--json",
                ],
                stdout=out,
                stderr=subprocess.DEVNULL,
                cwd=REPO,
            )
        opened: tuple[Path, int, bool] | None = None  # path, fd, opened while it held its lease
        watchdog = None
        try:
            if at_random:
                time.sleep(rng.uniform(0, 0.5))
            deadline = time.monotonic() + 30
            while opened is None and scan.poll() is None:
                assert time.monotonic() < deadline, f"scan stuck: {tree(scan.pid)}"
                watchdog = watchdog or watchdog_of(scan.pid)
                pid = scan.pid if target == "main" else prober_child(scan.pid, watchdog)
                if pid is None:
                    time.sleep(0.001)
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                if wait_for_state(pid, "TZX") != "T":
                    continue  # it ended before the stop
                ino = leased_inode(pid)
                if ino is not None or at_random:
                    path = by_inode[ino] if ino is not None else rng.choice(paths)
                    waited, fd = timed_open(path)
                    assert waited < BOUND_S, f"the opener waited {waited:.3f}s on a stopped {target}"
                    opened = (path, fd, ino is not None)
                    caught += ino is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                time.sleep(rng.uniform(0, 0.002))
            scan.wait(60)
        finally:
            if scan.poll() is None:
                scan.kill()
            scan.wait(30)
            if opened is not None:
                os.close(opened[1])
        if opened is not None and opened[2] and scan.returncode >= 0:
            # Opened while the scan held its lease on it: never "orphaned".
            entries = json.loads(report.read_text())["entries"]
            entry = next(e for e in entries if e["name"] == opened[0].name)
            assert entry["status"] != "orphaned", entry
        if watchdog is not None:
            wait_exited(watchdog, 5)
    assert caught > 0, "no stop ever caught a lease held: the test tested nothing"


# ---------------------------------------------------------------------------------------
# the watchdog itself
# ---------------------------------------------------------------------------------------


def test_the_watchdog_is_in_a_session_of_its_own_and_ignores_the_terminals_signals(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "wait") as holder:
        fields = proc_stat(holder.watchdog)
        assert fields is not None
        ppid, pgrp, session = (int(f) for f in fields[1:4])
        assert ppid == holder.pid
        assert pgrp == session == holder.watchdog != holder.pgrp
        os.killpg(holder.pgrp, signal.SIGTSTP)  # Ctrl-Z to the holder's group
        for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
            os.kill(holder.watchdog, signum)
        time.sleep(4 * watchdog.POLL_S)
        assert state(holder.watchdog) in ("R", "S")
        assert state(holder.pid) == "S"  # holding: its Ctrl-Z waits for the release
        assert {int(fd) for fd in os.listdir(f"/proc/{holder.watchdog}/fd")} <= {0, 1, 2, 3}
        assert os.readlink(f"/proc/{holder.watchdog}/cwd") == "/"
        os.kill(holder.pid, signal.SIGCONT)


def test_the_watchdog_exits_when_its_parent_is_killed(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with holding(path, "wait") as holder:
        watchdog = holder.watchdog
        os.kill(holder.pid, signal.SIGKILL)
        holder.reap()
        assert wait_exited(watchdog, 5) < BOUND_S


def test_a_real_scan_leaves_no_process_behind(root: Path, engine_id: str) -> None:
    for i in range(3):
        write_file(region_path(root, f"{engine_id}-{i}"))
    result = subreaped([sys.executable, "-m", "shmctl", "scan", "--root", str(root), "--grace", "0s"])
    exited_after = result["exited_after"]
    assert isinstance(exited_after, list)
    assert result["still_running"] == 0
    assert len(exited_after) == 1  # the watchdog, once its scan had ended
    assert exited_after[0] < BOUND_S


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--help"], {}),
        (["scan", "--help"], {}),
        ([], {"COMP_WORDS": "shmctl sc", "COMP_CWORD": "1", "_SHMCTL_COMPLETE": "complete_bash"}),
    ],
    ids=["help", "scan-help", "completion"],
)
def test_help_and_completion_start_no_watchdog(argv: list[str], env: dict[str, str]) -> None:
    result = subreaped([sys.executable, "-m", "shmctl", *argv], env)
    assert result == {"rc": 0, "exited_after": [], "still_running": 0}


def test_leases_work_unguarded_when_no_watchdog_can_be_spawned(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    script = r"""
import json, os, sys
sys.executable = "/nonexistent/python"
from kvoffload.liveness import lease
with lease.sigio_ignored():
    fd = os.open(sys.argv[1], os.O_RDONLY)
    free = lease.take(fd, os.geteuid(), os.geteuid()).free
    lease.release(fd)
    os.close(fd)
    status = lease.guard_status()
print(json.dumps({"free": free, "watching": status.watching, "error": status.error}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    answer = json.loads(result.stdout)
    assert answer["free"] is True
    assert answer["watching"] is False
    assert "cannot spawn the watchdog" in answer["error"]


# ---------------------------------------------------------------------------------------
# fs.lease-break-time
# ---------------------------------------------------------------------------------------


def test_break_time_is_the_sysctl() -> None:
    expected = float(Path("/proc/sys/fs/lease-break-time").read_text())
    assert lease.break_time_s() == expected


def test_break_time_is_none_where_it_cannot_be_read(tmp_path: Path) -> None:
    assert lease.break_time_s(proc_root=tmp_path) is None
    (tmp_path / "sys" / "fs").mkdir(parents=True)
    (tmp_path / "sys" / "fs" / "lease-break-time").write_text("soon\n")
    assert lease.break_time_s(proc_root=tmp_path) is None


def test_a_scan_starts_the_watchdog_only_where_it_probes_a_file(root: Path, engine_id: str) -> None:
    # An empty root (a node with no engine) takes no lease: no watchdog process is spawned.
    probe = (
        "import sys; from kvoffload.liveness import scan, watchdog; "
        "scan.scan(sys.argv[1], grace_s=0); print(watchdog.status().error or 'started')"
    )
    empty = subprocess.run(
        [sys.executable, "-c", probe, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    assert empty.stdout.strip() == "not started"
    write_file(region_path(root, engine_id))
    one = subprocess.run(
        [sys.executable, "-c", probe, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    assert one.stdout.strip() == "started"
