"""Reap against real openers at the worst moments: a live file is never removed under them.

An opener process (vLLM attaching to its region) opens an orphan ``O_RDWR`` while a reaper
process removes it. The opener watches the file with inotify and opens it a random few
microseconds after the reaper's k-th open of it (a scan's probe, or the open that starts
the removal), so its ``open`` lands inside the removal: before the lease, while it is held
(the open blocks in the kernel and the reaper gets ``SIGIO``), between the rename and the
unlink, or after. Whatever the moment, the opener must end up with the file still under its
name (``intact``) or find the name gone and create a new one (``absent``): never with an fd
of an unlinked inode (``dead``) or of a file that lost its name (``misplaced``).

The reaper is a process of its own, so that a ``SIGIO`` that killed it shows as its exit
status; it reports, then waits while the test reads ``/proc/locks``. The library reaper is
given an empty ``/proc`` (one that lists no process, in the initial PID namespace): only the
lease stands between the opener and the unlink, and an iteration takes about a millisecond
instead of a full ``/proc`` pass. The CLI reaper runs on the real ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests.support.procs import REPO

#: CPU-bound (a thousand races, CPUs pinned): one at a time, never against the other heavy tests.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("cpu-heavy")]

#: The longest spin after the k-th open. With it the opens spread over the whole removal: every
#: outcome (live in the scan, lease refused, lease broken, removed) shows in a run.
MAX_DELAY_NS = 150_000
CLI_REAP = ("reap", "--grace", "0s", "--yes", "--json")
#: Outcomes that mean a reap removed or displaced a file an opener holds.
VIOLATIONS = ("dead", "dead (created)", "misplaced", "create-failed")

#: The opener, driven over stdin/stdout. ``arm PATH K DELAY_NS``: watch PATH; after the K-th
#: open of it by anyone (or at ``check`` if fewer came), spin DELAY_NS, then open it O_RDWR,
#: or create it O_CREAT|O_EXCL if the name is gone, as vLLM's creator would. ``check`` (sent
#: once the reap returned): report what its fd is now, and close it. Closes are watched too,
#: so that two opens in a row are two events (inotify merges identical consecutive events).
OPENER = r"""
import ctypes, json, os, select, struct, sys, time
IN_OPEN, IN_CLOSE = 0x20, 0x08 | 0x10
EVENT = struct.Struct("iIII")
libc = ctypes.CDLL(None, use_errno=True)
buffered = b""
# Waiting is polled, not slept on (no wake-up latency), on a CPU of its own where there are two.
cpus = sorted(os.sched_getaffinity(0))
if len(cpus) > 1:
    os.sched_setaffinity(0, {cpus[-1]})

def more_input():
    global buffered
    chunk = os.read(0, 4096)
    if not chunk:
        sys.exit(0)
    buffered += chunk

def read_line():
    global buffered
    while b"\n" not in buffered:
        more_input()
    line, buffered = buffered.split(b"\n", 1)
    return line.decode()

def count_opens(fd):
    data, seen, at = os.read(fd, 65536), 0, 0
    while at < len(data):
        wd, mask, cookie, length = EVENT.unpack_from(data, at)
        at += EVENT.size + length
        seen += bool(mask & IN_OPEN)
    return seen

while True:
    _, path, k, delay_ns = read_line().split(" ")
    watch = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    if watch < 0 or libc.inotify_add_watch(watch, os.fsencode(path), IN_OPEN | IN_CLOSE) < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    print("armed", flush=True)
    seen, give_up = 0, time.monotonic() + 60
    while seen < int(k) and b"\n" not in buffered:
        try:
            seen += count_opens(watch)
        except BlockingIOError:
            if select.select([0], [], [], 0 if len(cpus) > 1 else 0.0001)[0]:
                more_input()
            elif time.monotonic() > give_up:
                raise SystemExit("no open and no check for 60 s")
    late = seen < int(k)
    deadline = time.perf_counter_ns() + int(delay_ns)
    while time.perf_counter_ns() < deadline:
        pass
    created = False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            created = True
        except FileExistsError:
            fd = -1
    if read_line() != "check":
        raise SystemExit("expected check")
    if fd < 0:
        outcome = "create-failed"
    else:
        st = os.fstat(fd)
        try:
            named = os.stat(path).st_ino == st.st_ino
        except FileNotFoundError:
            named = False
        if st.st_nlink == 0:
            outcome = "dead" if not created else "dead (created)"
        elif not named:
            outcome = "misplaced"
        else:
            outcome = "absent" if created else "intact"
        os.close(fd)
    os.close(watch)
    print(json.dumps({"outcome": outcome, "late": late}), flush=True)
"""

#: How the reaper side of one iteration ended, from its ReapReport (also used by the CLI test).
CLASSIFY = r"""
def reaped(removed, kept, live):
    if removed:
        return "removed"
    if kept:
        if "raced with an opener" in kept[0]:
            return "kept: lease broken"
        if "opened since the scan" in kept[0]:
            return "kept: lease refused"
        if kept[0].startswith("held by"):
            return "live in the scan"  # the CLI's second scan, after its plan
        return "kept: " + kept[0]
    return "live in the scan" if live else "nothing chosen"
"""

#: The library reaper: one orphan per iteration, reaped by engine id while the opener is
#: armed on it; the opener's report and the reap's outcome are tallied together. It stops
#: after ITERATIONS, or once BREAKS of its leases were broken under it (0: never), prints the
#: tallies as one JSON line, then waits on stdin.
REAPER = (
    CLASSIFY
    + r"""
import json, os, random, signal, subprocess, sys
from collections import Counter
from pathlib import Path
from kvoffload.liveness.reap import ReapFilter, reap

root, proc_root, prefix, iterations, seed, max_delay_ns, breaks, opener_source = sys.argv[1:]
rng = random.Random(int(seed))
cpus = sorted(os.sched_getaffinity(0))
if len(cpus) > 1:
    os.sched_setaffinity(0, {cpus[0]})  # the opener takes the last one
opener = subprocess.Popen(
    [sys.executable, "-c", opener_source], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)

def ask(line):
    opener.stdin.write(line + "\n")
    opener.stdin.flush()
    return opener.stdout.readline()

openers, reaps, pairs, leftovers, violations = Counter(), Counter(), Counter(), [], []
done = 0
for i in range(int(iterations)):
    if int(breaks) and reaps["kept: lease broken"] >= int(breaks):
        break
    done += 1
    engine_id = f"{prefix}{i}"
    path = Path(root) / f"vllm_offload_{engine_id}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    k, delay_ns = rng.randint(1, 2), rng.randint(0, int(max_delay_ns))
    assert ask(f"arm {path} {k} {delay_ns}") == "armed\n"
    report = reap(root, grace_s=0, filters=ReapFilter.exactly(engine_id), proc_root=Path(proc_root))
    seen = json.loads(ask("check"))
    side = reaped(report.removed, [e.reason for e in report.kept], report.summary.live)
    openers[seen["outcome"]] += 1
    if seen["outcome"] not in ("intact", "absent"):
        violations.append({"iteration": i, "k": k, "delay_ns": delay_ns, "outcome": seen["outcome"]})
    reaps[side] += 1
    pairs[f"{side} / {seen['outcome']}" + " (after the reap)" * seen["late"]] += 1
    path.unlink(missing_ok=True)
    rest = os.listdir(root)
    if rest:
        leftovers.append(rest)
        for name in rest:
            os.unlink(os.path.join(root, name))
opener.stdin.close()
status = opener.wait(30)
print(json.dumps({
    "iterations": done, "openers": openers, "reaps": reaps, "pairs": pairs, "leftovers": leftovers,
    "violations": violations,
    "opener_status": status, "sigio_default_after": signal.getsignal(signal.SIGIO) is signal.SIG_DFL,
}), flush=True)
sys.stdin.read()
"""
)

#: scan() in a thread of a fresh interpreter, whose SIGIO is at its default (terminate) unless
#: argv[2] says ``ignore``; then scan() in the main thread. Prints each entry's lease answer.
SCAN_IN_A_THREAD = r"""
import json, signal, sys, threading
from kvoffload.liveness.scan import scan
root, disposition = sys.argv[1], sys.argv[2]
if disposition == "ignore":
    signal.signal(signal.SIGIO, signal.SIG_IGN)
answers = {}
def judge(where):
    report = scan(root, grace_s=0)
    answers[where] = {
        "enabled": report.lease_enabled,
        "entries": [[e.lease, e.lease_error] for e in report.entries],
        "sigio": signal.getsignal(signal.SIGIO).name,
    }
thread = threading.Thread(target=judge, args=("thread",))
thread.start()
thread.join()
judge("main")
print(json.dumps(answers))
"""


def leases_of(pid: int) -> list[str]:
    """Lines of /proc/locks for leases ``pid`` holds (a lease shows as ``LEASE``)."""
    with open("/proc/locks") as f:
        return [line.rstrip() for line in f if "LEASE" in line.split() and str(pid) in line.split()]


class Reaper:
    """A process (a session of its own, with what it starts) running ``script``, which prints one
    JSON line of results, then waits on stdin; killed with its children on exit."""

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            text=True,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def results(self, timeout: float = 90) -> dict[str, Any]:
        """Its report; fails with its exit status and stderr if it ended without one."""
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self._kill()
            status, stderr = self.proc.returncode, self.proc.stderr.read()
            pytest.fail(f"the reaper gave no report (exit status {status}): {stderr}")
        result: dict[str, Any] = json.loads(line)
        return result

    def finish(self) -> int:
        """Let it exit; its exit status (negative: the signal that killed it)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the reaper, and the opener it started
        self.proc.wait(30)

    def __enter__(self) -> Reaper:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._kill()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


class Opener:
    """The OPENER process, driven from the test (the CLI race: the reaper is ``shmctl``)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OPENER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def arm(self, path: Path, k: int, delay_ns: int) -> None:
        assert self._ask(f"arm {path} {k} {delay_ns}") == "armed\n"

    def check(self) -> dict[str, Any]:
        seen: dict[str, Any] = json.loads(self._ask("check"))
        return seen

    def __enter__(self) -> Opener:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def classify(removed: list[Any], kept_reasons: list[str], live: int) -> str:
    scope: dict[str, Any] = {}
    exec(CLASSIFY, scope)
    side: str = scope["reaped"](removed, kept_reasons, live)
    return side


# ------------------------------------------------------------------ the opener race


def test_a_reap_racing_an_opener_never_removes_the_file_the_opener_gets(
    root: Path, engine_id: str, empty_proc: Path
) -> None:
    iterations = 1000
    args = (str(root), str(empty_proc), f"{engine_id}-", str(iterations), "7", str(MAX_DELAY_NS), "0", OPENER)
    with Reaper(REAPER, *args) as reaper:
        results = reaper.results()
        leases_left = leases_of(reaper.pid)
        status = reaper.finish()
    print(f"\nreap race, {iterations} iterations: {json.dumps(results, sort_keys=True)}")
    assert status == 0  # it lived through every lease break (SIGIO would be -29)
    assert results["opener_status"] == 0
    assert leases_left == []
    assert results["leftovers"] == []  # no file of any iteration, no private name, left behind
    openers = results["openers"]
    assert sum(openers.values()) == iterations
    assert {k: openers.get(k, 0) for k in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0)
    # Every removal left the opener a free name; every file the opener got was kept.
    pairs = results["pairs"]
    assert all(pair.split(" / ")[1].startswith("absent") for pair in pairs if pair.startswith("removed"))
    assert all(pair.startswith(("kept", "live")) for pair in pairs if " / intact" in pair)


def test_a_cli_reap_racing_an_opener_never_removes_the_file_the_opener_gets(
    root: Path, engine_id: str
) -> None:
    rng = random.Random(11)
    iterations = 30
    openers: dict[str, int] = {}
    reaps: dict[str, int] = {}
    statuses = set()
    with Opener() as opener:
        for i in range(iterations):
            path = root / f"vllm_offload_{engine_id}-{i}.mmap"
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            # The CLI opens it three times: the plan's probe, the reap's probe, the removal.
            opener.arm(path, rng.randint(1, 3), rng.randint(0, MAX_DELAY_NS))
            done = subprocess.run(
                [sys.executable, "-m", "shmctl", *CLI_REAP, "--root", str(root)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=60,
                check=False,
            )
            seen = opener.check()
            statuses.add(done.returncode)
            report = json.loads(done.stdout) if done.returncode == 0 else {"removed": [], "kept": []}
            live = report.get("summary", {}).get("live", 0)
            side = classify(report["removed"], [e["reason"] for e in report["kept"]], live)
            openers[seen["outcome"]] = openers.get(seen["outcome"], 0) + 1
            reaps[side] = reaps.get(side, 0) + 1
            path.unlink(missing_ok=True)
            assert os.listdir(root) == []
    print(f"\ncli reap race, {iterations} iterations: openers {openers}, reaps {reaps}")
    assert statuses == {0}  # no run killed by SIGIO
    assert {k: openers.get(k, 0) for k in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0)


# ------------------------------------------------------------------------------ SIGIO


def test_a_reaper_whose_leases_openers_break_again_and_again_lives_on_and_restores_sigio(
    root: Path, engine_id: str, empty_proc: Path
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a lease break needs the opener to run while the reaper holds the lease: two CPUs")
    breaks = 25  # each one a SIGIO sent to the reaper while it held a lease
    args = (str(root), str(empty_proc), f"{engine_id}-", "5000", "13", str(MAX_DELAY_NS), str(breaks), OPENER)
    with Reaper(REAPER, *args) as reaper:
        results = reaper.results()
        leases_left = leases_of(reaper.pid)
        status = reaper.finish()
    tallies = json.dumps(results["reaps"], sort_keys=True)
    print(f"\nlease breaks, {results['iterations']} iterations: {tallies}")
    assert status == 0  # SIGIO's default action would have ended it
    assert results["reaps"].get("kept: lease broken", 0) == breaks
    assert results["sigio_default_after"] is True  # the library gave SIGIO back as it found it
    assert leases_left == []


def scan_in_a_thread(root: Path, disposition: str) -> dict[str, Any]:
    os.close(os.open(root / "vllm_offload_threaded.mmap", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    done = subprocess.run(
        [sys.executable, "-c", SCAN_IN_A_THREAD, str(root), disposition],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answers: dict[str, Any] = json.loads(done.stdout)
    return answers


def test_a_scan_in_a_thread_takes_no_lease_while_sigio_would_terminate_the_process(root: Path) -> None:
    answers = scan_in_a_thread(root, "default")
    thread = answers["thread"]
    assert thread["enabled"] is False
    [[lease, error]] = thread["entries"]
    assert lease is None
    assert "SIGIO" in error
    assert thread["sigio"] == "SIG_DFL"  # left as it was
    main = answers["main"]  # the main thread may ignore SIGIO for the duration: leases are taken
    assert (main["enabled"], main["entries"], main["sigio"]) == (True, [["free", None]], "SIG_DFL")


def test_a_scan_in_a_thread_takes_leases_when_the_program_already_ignores_sigio(root: Path) -> None:
    thread = scan_in_a_thread(root, "ignore")["thread"]
    assert (thread["enabled"], thread["entries"], thread["sigio"]) == (True, [["free", None]], "SIG_IGN")
