"""Process evidence under stress: reused pids, zombies, a leader that exited before its
threads, other PID namespaces, unreadable /proc entries and processes that exit mid-scan.

Real processes where the kernel allows it (unshare, ns_last_pid, pthread_exit); a /proc tree
the test controls where only that can pin the moment down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload import procfs
from kvoffload.liveness.holders import collect_holders
from kvoffload.liveness.namespace import INITIAL_PID_NAMESPACE
from kvoffload.liveness.reap import ReapFilter, reap
from kvoffload.liveness.report import ScanReport
from kvoffload.liveness.scan import Status, scan
from tests.support.hostile import ZombieLeader
from tests.support.procs import (
    NOBODY,
    REPO,
    TEST_TAG,
    Child,
    entry,
    leave_orphan,
    region_path,
    uninspectable_pids,
    write_file,
)

IN_OWN_PID_NS = ("unshare", "--pid", "--fork", "--mount-proc")


def judge(root: Path) -> ScanReport:
    return scan(root, grace_s=0)


def unshare_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*IN_OWN_PID_NS, "true"], check=False, capture_output=True)
    return probe.returncode == 0


# ---------------------------------------------------------------------------- zombies


def test_a_process_whose_main_thread_exited_still_holds_what_its_threads_map(root: Path) -> None:
    path = region_path(root, f"{TEST_TAG}zombie-leader")
    with ZombieLeader(path) as proc:
        assert proc.state() == "Z"
        e = entry(judge(root), path.name)
        assert e.status is Status.LIVE
        assert [(h.pid, h.via) for h in e.holders] == [(proc.pid, ("fd", "map"))]
        assert reap(root, grace_s=0).removed == ()
        assert path.exists()
    assert entry(judge(root), path.name).status is Status.ORPHANED


def test_an_owner_that_died_and_was_not_yet_waited_for_is_a_zombie_not_an_owner(
    root: Path, engine_id: str
) -> None:
    path = region_path(root, engine_id)
    child = Child("region", path)
    try:
        os.kill(child.pid, signal.SIGKILL)  # not waited for: it stays a zombie
        deadline = time.monotonic() + 10
        while not procfs.read_stat(child.pid).is_zombie:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        e = entry(judge(root), path.name)
    finally:
        child.kill()
    assert e.status is Status.ORPHANED
    assert e.reason == f"{NOBODY}; owner pid {child.pid} is a zombie"
    assert e.owner is not None
    assert e.owner.alive is False


# ---------------------------------------------------------------------------- pid reuse


_CREATE = r"""
import sys, time
from pathlib import Path
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
region = SharedOffloadRegion(sys.argv[2], 4, None, 2 * PAGESIZE, PAGESIZE, root=Path(sys.argv[1]))
print("ready", flush=True)
time.sleep(60)
"""

# Runs as pid 1 of a fresh PID namespace, where pids can be steered with ns_last_pid: the
# creator of a region is SIGKILLed, and its pid is handed to a new, unrelated process.
_PID_REUSE = r"""
import json, subprocess, sys
root, engine_id, create = sys.argv[1], sys.argv[2], sys.argv[3]
creator = subprocess.Popen([sys.executable, "-c", create, root, engine_id], stdout=subprocess.PIPE, text=True)
assert creator.stdout.readline() == "ready\n"
creator.kill()
creator.wait()
creator.stdout.close()
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(creator.pid - 1))
reuser = subprocess.Popen(["sleep", "60"])
from kvoffload.liveness.reap import ReapFilter, reap
from kvoffload.liveness.scan import scan
e = scan(root, grace_s=0).entries[0]
removed = reap(root, grace_s=0, filters=ReapFilter(owner_pids=(creator.pid,))).removed
reuser.kill()
reuser.wait()
print(json.dumps({
    "dead": creator.pid, "reuser": reuser.pid, "status": e.status.value, "reason": e.reason,
    "owner_pid": e.owner.pid, "owner_alive": e.owner.alive, "holders": [h.pid for h in e.holders],
    "removed": [r.name for r in removed],
}))
"""


@pytest.mark.root
def test_a_pid_reused_by_another_process_does_not_keep_a_dead_owners_region(
    root: Path, engine_id: str
) -> None:
    if not unshare_available():
        pytest.skip("needs root and unshare(1) for a PID namespace whose pids the test can steer")
    path = region_path(root, engine_id)
    try:
        done = subprocess.run(
            [*IN_OWN_PID_NS, sys.executable, "-c", _PID_REUSE, str(root), engine_id, _CREATE],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        if done.returncode != 0 and "ns_last_pid" in done.stderr:
            pytest.skip(f"cannot steer pids here: {done.stderr.strip().splitlines()[-1]}")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["reuser"] == result["dead"]  # a live process now has the owner's pid
        assert result["owner_pid"] == result["dead"]
        assert result["owner_alive"] is False
        assert result["holders"] == []
        assert result["status"] == "orphaned"
        assert result["reason"] == (
            f"{NOBODY}; owner pid {result['dead']} was reused by another process (sleep)"
        )
        assert result["removed"] == [path.name]
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------- PID namespaces


@pytest.mark.root
def test_a_vllm_holder_inside_a_child_pid_namespace_is_seen_from_the_host(root: Path, engine_id: str) -> None:
    if not unshare_available():
        pytest.skip("needs root and unshare(1) to run a holder in its own PID namespace")
    path = region_path(root, engine_id)
    with Child("vllm", path, prefix=(*IN_OWN_PID_NS, "--kill-child")) as child:
        e = entry(judge(root), path.name)
        assert e.status is Status.LIVE
        assert e.lock_held is False  # a lockless vLLM file: the kernel's maps are the evidence
        assert child.pid not in [h.pid for h in e.holders]  # the holder is unshare's child
        assert reap(root, grace_s=0).removed == ()
    deadline = time.monotonic() + 10
    while entry(judge(root), path.name).status is Status.LIVE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [e.name for e in reap(root, grace_s=0).removed] == [path.name]


# ---------------------------------------------------------------- unreadable and vanishing


def test_a_process_seen_through_its_fds_holds_the_file_even_if_its_maps_cannot_be_read(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    proc = tmp_path / "proc" / "4243"
    (proc / "fd").mkdir(parents=True)
    (proc / "fd" / "3").symlink_to(path)
    (proc / "stat").write_text("4243 (half) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0\n")
    (proc / "maps").mkdir()  # EISDIR on read
    report = scan(root, grace_s=0, proc_root=tmp_path / "proc")
    e = entry(report, path.name)
    assert e.status is Status.LIVE
    assert [(h.pid, h.via) for h in e.holders] == [(4243, ("fd",))]
    assert [(u.pid, u.error, u.what) for u in report.uninspected] == [(4243, "EISDIR", "maps")]
    assert reap(root, grace_s=0, proc_root=tmp_path / "proc").removed == ()


@pytest.mark.parametrize("gone", ["fd", "maps", "stat"])
def test_a_process_that_exits_while_it_is_being_read_is_neither_a_holder_nor_a_blind_spot(
    root: Path, engine_id: str, tmp_path: Path, gone: str
) -> None:
    # A process read in the order the pass reads it (fds, maps, then stat where it holds
    # nothing), whose next file is gone: it exited between two reads.
    path = write_file(region_path(root, engine_id))
    proc = tmp_path / "proc"
    base = proc / "4244"
    (base / "fd").mkdir(parents=True)
    (base / "maps").write_text("")
    (base / "stat").write_text("4244 (leaving) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n")
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to(INITIAL_PID_NAMESPACE)  # it lists every process
    target = base / gone
    if target.is_dir():
        target.rmdir()
    else:
        target.unlink()
    index = collect_holders(proc)
    assert (index.uninspected, index.processes) == ((), 0)
    e = entry(scan(root, grace_s=0, proc_root=proc), path.name)
    assert e.status is Status.ORPHANED  # a process that exited holds nothing and hides nothing


def test_scans_racing_a_storm_of_short_lived_processes_stay_exact(root: Path, engine_id: str) -> None:
    live = region_path(root, engine_id)
    orphan = leave_orphan(root, engine_id + "-dead")
    storm = subprocess.Popen(
        ["sh", "-c", "while :; do /bin/true; /bin/true; /bin/true; done"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with Child("vllm", live):
            for _ in range(15):
                report = judge(root)
                assert {u.pid for u in report.uninspected} <= uninspectable_pids()
                assert entry(report, live.name).status is Status.LIVE
                assert entry(report, orphan.name).status is Status.ORPHANED
            removed = reap(root, grace_s=0, filters=ReapFilter()).removed
            assert [e.name for e in removed] == [orphan.name]
            assert live.exists()
    finally:
        storm.kill()
        storm.wait(30)
    live.unlink()
