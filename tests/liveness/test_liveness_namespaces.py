"""Liveness across PID namespaces and uids, with real processes: the write lease decides.

A scanner in a child PID namespace cannot see the engines; a holder in one is seen from the
host; a process of another uid cannot be inspected; an fd in flight in a unix socket is in
no process's fd table at all. In each case the kernel's lease still knows the file is open
(``live``, ``decided_by`` ``lease``) and a file nobody has open is proven free
(``orphaned``). Where no lease can be taken (``--no-lease``, no ``CAP_LEASE``) the ``/proc``
evidence applies, fail-closed, and the entry says why the lease is missing.

Scanners run as the CLI (``python -m shmctl``) under ``unshare``/``setpriv``; every process
a test starts dies with it (``--kill-child``), and the ``root`` fixture removes the files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness.lease import LeaseState
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import Evidence, Status, scan
from tests.support.procs import NOBODY, REPO, Child, entry, leave_orphan, region_path, vouch_args, write_file

#: A child PID namespace with its own /proc; its processes die with unshare.
IN_CHILD_PID_NS = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
SCANNER_UID = 65533
HOLDER_UID = 65534
AS_SCANNER = ("setpriv", f"--reuid={SCANNER_UID}", f"--regid={SCANNER_UID}", "--clear-groups")
AS_HOLDER = ("setpriv", f"--reuid={HOLDER_UID}", f"--regid={HOLDER_UID}", "--clear-groups")
#: Root without CAP_LEASE (as in Docker's default capability set): leases only on its own files.
WITHOUT_CAP_LEASE = ("setpriv", "--bounding-set=-lease")
NOTE = "shmctl: note: this scan's /proc shows a child PID namespace"
NO_LEASE = "disabled (--no-lease)"


def judged_by_proc(no_lease: str) -> str:
    """The reason of a file a complete /proc walk found nobody holding, without a lease."""
    return f"no process maps or opens it (every process inspected; no write lease: {no_lease})"


JSON = dict[str, Any]


def require_root() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run processes as other uids")


def require_unshare() -> None:
    require_root()
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a child PID namespace")
    probe = subprocess.run([*IN_CHILD_PID_NS, "true"], check=False, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {probe.stderr.decode().strip()}")


def shmctl(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m shmctl ARGS``, run under ``prefix`` (unshare, setpriv), output captured."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "shmctl", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )


def cli_scan(root: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return shmctl("scan", "--root", str(root), "--grace", "0s", "--json", *extra, prefix=prefix)


def cli_reap(root: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return shmctl("reap", "--root", str(root), "--grace", "0s", "--yes", "--json", *extra, prefix=prefix)


def json_entry(report: JSON, name: str) -> JSON:
    found = [e for e in report["entries"] if e["name"] == name]
    assert len(found) == 1, [e["name"] for e in report["entries"]]
    entry_json: JSON = found[0]
    return entry_json


def removed_names(report: JSON) -> list[str]:
    return sorted(e["name"] for e in report["removed"])


def give_to(uid: int, *paths: Path, mode: int = 0o644) -> None:
    for path in paths:
        os.chown(path, uid, uid)
        os.chmod(path, mode)


# Opens the file read-only, maps it PROT_READ with libc (Python's mmap would keep a dup of
# the fd) and closes the fd: only the read-only mapping keeps the file.
READ_ONLY_MAPPING = r"""
import ctypes, mmap, os, sys
fd = os.open(sys.argv[2], os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
addr = libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
if addr in (None, ctypes.c_void_p(-1).value):
    raise OSError(ctypes.get_errno(), "mmap failed")
os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""

# Sends an fd of the file over a unix socket to itself and closes it without receiving it:
# the open file description lives in the socket's queue, in no process's fd table or maps.
FD_IN_FLIGHT = r"""
import os, socket, sys
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
fd = os.open(sys.argv[2], os.O_RDWR)
socket.send_fds(ours, [b"fd"], [fd])
os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""

HOLDERS = ("map-only", "fd-only", "read-only-mapping")


@contextmanager
def holding(kind: str, path: Path, *, prefix: tuple[str, ...] = ()) -> Iterator[Child]:
    """A process holding the existing ``path`` as ``kind`` (``HOLDERS``) until the block ends."""
    holder: Child
    if kind == "read-only-mapping":
        holder = Child("read-only-mapping", path, prefix=prefix, script=READ_ONLY_MAPPING)
    else:
        holder = Child(kind, path, prefix=prefix)
    try:
        yield holder
    finally:
        holder.kill()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# ------------------------------------------------- a scanner in a child PID namespace


@pytest.mark.root
@pytest.mark.parametrize("kind", HOLDERS)
def test_a_scan_from_a_child_pid_namespace_finds_a_file_held_outside_it_live_by_the_lease(
    root: Path, engine_id: str, kind: str
) -> None:
    require_unshare()
    held = write_file(region_path(root, engine_id))
    dead = leave_orphan(root, engine_id + "-dead")
    with holding(kind, held):
        done = cli_scan(root, prefix=IN_CHILD_PID_NS)
    assert done.returncode == 1, done.stderr  # 1: an orphan was found
    assert NOTE in done.stderr
    assert "holders outside it are proven by the write lease" in done.stderr
    report = json.loads(done.stdout)
    assert report["visibility"]["complete"] is False
    live = json_entry(report, held.name)
    assert (live["status"], live["lease"], live["decided_by"]) == ("live", "held", "lease")
    assert live["holders"] == []  # invisible from there: only the lease knows
    assert "cannot see" in live["reason"]
    assert "another PID namespace" in live["reason"]
    orphan = json_entry(report, dead.name)
    assert (orphan["status"], orphan["lease"], orphan["decided_by"]) == ("orphaned", "free", "lease")
    assert orphan["reason"] == NOBODY


@pytest.mark.root
@pytest.mark.parametrize("kind", HOLDERS)
def test_a_reap_from_a_child_pid_namespace_removes_the_dead_file_and_never_one_held_outside_it(
    root: Path, engine_id: str, kind: str
) -> None:
    require_unshare()
    held = write_file(region_path(root, engine_id))
    identity = os.stat(held).st_ino
    dead = leave_orphan(root, engine_id + "-dead")
    with holding(kind, held):
        done = cli_reap(root, prefix=IN_CHILD_PID_NS)
        assert os.stat(held).st_ino == identity  # checked while it is still held
    assert done.returncode == 0, done.stderr
    assert NOTE in done.stderr
    report = json.loads(done.stdout)
    assert removed_names(report) == [dead.name]
    assert report["kept"] == []  # the held file was live in the scan: never a candidate
    assert not dead.exists()


# --------------------------------------------------- a holder in a child PID namespace


@pytest.mark.root
@pytest.mark.parametrize("kind", HOLDERS)
def test_a_holder_in_a_child_pid_namespace_is_named_from_the_host_and_its_lease_is_refused(
    root: Path, engine_id: str, kind: str
) -> None:
    require_unshare()
    held = write_file(region_path(root, engine_id))
    dead = leave_orphan(root, engine_id + "-dead")
    with holding(kind, held, prefix=IN_CHILD_PID_NS) as holder:
        report = scan(root, grace_s=0)
        # The holder is unshare's child, pid 1 of its namespace: the host's /proc shows it.
        parents = [parent_of(h.pid) for h in entry(report, held.name).holders]
        kept = reap(root, grace_s=0)
        still = held.exists()
    live = entry(report, held.name)
    assert (live.status, live.decided_by) == (Status.LIVE, Evidence.PROC)
    assert live.lease is LeaseState.HELD  # the kernel agrees with /proc
    assert parents == [holder.pid]
    assert [e.name for e in kept.removed] == [dead.name]
    assert still


@pytest.mark.root
def test_a_holder_in_a_child_pid_namespace_that_the_hosts_proc_cannot_show_is_live_by_the_lease(
    root: Path, engine_id: str
) -> None:
    require_unshare()
    held = write_file(region_path(root, engine_id))
    dead = leave_orphan(root, engine_id + "-dead")
    with Child("fd-in-flight", held, prefix=IN_CHILD_PID_NS, script=FD_IN_FLIGHT):
        scanned = cli_scan(root)
        reaped = cli_reap(root)
        still = held.exists()
    assert scanned.returncode == 1, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["visibility"]["complete"] is True  # the host's /proc, and root reads all of it...
    live = json_entry(report, held.name)
    assert live["holders"] == []  # ...but no process has the file in its fds or maps
    assert (live["status"], live["lease"], live["decided_by"]) == ("live", "held", "lease")
    assert "cannot see" in live["reason"]
    assert "file(s) are held by processes this /proc does not show" in scanned.stderr
    assert reaped.returncode == 0, reaped.stderr
    assert removed_names(json.loads(reaped.stdout)) == [dead.name]
    assert still


# ------------------------------------------------ without a lease, in a child namespace


@pytest.mark.root
def test_without_a_lease_a_scan_from_a_child_pid_namespace_leaves_a_dead_file_unknown(
    root: Path, engine_id: str
) -> None:
    require_unshare()
    dead = leave_orphan(root, engine_id)
    done = cli_scan(root, "--no-lease", prefix=IN_CHILD_PID_NS)
    assert done.returncode == 0, done.stderr  # 0: nothing orphaned
    assert NOTE in done.stderr
    assert "holders outside it are unproven: leases are off" in done.stderr
    e = json_entry(json.loads(done.stdout), dead.name)
    assert (e["status"], e["decided_by"]) == ("unknown", "proc")
    assert (e["lease"], e["lease_error"]) == (None, NO_LEASE)
    assert f"no write lease ({NO_LEASE})" in e["reason"]
    assert "this /proc does not show every process" in e["reason"]
    assert e["reason"].endswith("liveness unproven")


@pytest.mark.root
def test_without_a_lease_a_reap_from_a_child_pid_namespace_keeps_the_dead_file_and_says_so(
    root: Path, engine_id: str
) -> None:
    require_unshare()
    dead = leave_orphan(root, engine_id)
    done = cli_reap(root, "--no-lease", prefix=IN_CHILD_PID_NS)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["removed"] == []
    assert [e["name"] for e in report["unknown"]] == [dead.name]
    assert "shmctl: warning: kept 1 unknown file(s)" in done.stderr
    assert "fix: drop --no-lease" in done.stderr
    assert dead.exists()


# ------------------------------------------------------------- an uninspectable holder


@pytest.mark.root
def test_a_holder_the_scanner_cannot_inspect_keeps_its_file_live_by_the_lease_and_orphans_still_go(
    root: Path, engine_id: str
) -> None:
    require_root()
    held = write_file(region_path(root, engine_id))
    dead = write_file(region_path(root, engine_id + "-dead"))
    dead_segment = write_file(region_path(root, engine_id + "-dead", 1))
    give_to(SCANNER_UID, root, mode=0o755)  # the scanner may rename and unlink in its root
    give_to(SCANNER_UID, held, dead, dead_segment)  # the scanner's own files: it may lease them
    with Child("fd-only", held, prefix=AS_HOLDER) as holder:  # another uid: EACCES on its fds
        scanned = cli_scan(root, prefix=AS_SCANNER)
        reaped = cli_reap(root, prefix=AS_SCANNER)  # no --assume-not-holding
        still = held.exists()
    assert scanned.returncode == 1, scanned.stderr
    report = json.loads(scanned.stdout)
    blind = {u["pid"]: u for u in report["uninspected"]}
    assert holder.pid in blind  # /proc could not have decided: the holder was not read
    assert blind[holder.pid]["uids"][0] == HOLDER_UID
    live = json_entry(report, held.name)
    assert (live["status"], live["lease"], live["decided_by"]) == ("live", "held", "lease")
    assert live["holders"] == []
    for name in (dead.name, dead_segment.name):
        e = json_entry(report, name)
        assert (e["status"], e["lease"], e["decided_by"]) == ("orphaned", "free", "lease")
    assert reaped.returncode == 0, reaped.stderr
    assert removed_names(json.loads(reaped.stdout)) == sorted([dead.name, dead_segment.name])
    assert still


# -------------------------------------------------- where the scanner may not lease


@pytest.mark.root
def test_with_no_lease_root_judges_from_proc_and_every_entry_says_the_lease_was_off(
    root: Path, engine_id: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: another user cannot inspect every process without a lease")
    held = write_file(region_path(root, engine_id))
    dead = leave_orphan(root, engine_id + "-dead")
    with Child("fd-only", held) as holder:
        scanned = cli_scan(root, "--no-lease", *vouch_args())
        reaped = cli_reap(root, "--no-lease", *vouch_args())
        still = held.exists()
    assert scanned.returncode == 1, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["lease_enabled"] is False
    live = json_entry(report, held.name)
    assert (live["status"], live["decided_by"]) == ("live", "proc")
    assert [h["pid"] for h in live["holders"]] == [holder.pid]
    orphan = json_entry(report, dead.name)
    assert (orphan["status"], orphan["decided_by"]) == ("orphaned", "proc")
    assert orphan["reason"] == judged_by_proc(NO_LEASE)
    for e in (live, orphan):
        assert (e["lease"], e["lease_error"]) == (None, NO_LEASE)
    assert removed_names(json.loads(reaped.stdout)) == [dead.name]
    assert still


@pytest.mark.root
def test_root_without_cap_lease_judges_other_users_files_from_proc_and_names_the_missing_capability(
    root: Path, engine_id: str
) -> None:
    require_root()
    held = write_file(region_path(root, engine_id))
    dead = write_file(region_path(root, engine_id + "-dead"))
    give_to(HOLDER_UID, held, dead)
    no_cap = f"not the file's owner (uid {HOLDER_UID}, we are 0) and no CAP_LEASE"
    with Child("fd-only", held, prefix=AS_HOLDER) as holder:
        scanned = cli_scan(root, "--all-users", *vouch_args(), prefix=WITHOUT_CAP_LEASE)
        reaped = cli_reap(root, "--all-users", *vouch_args(), prefix=WITHOUT_CAP_LEASE)
        still = held.exists()
    assert scanned.returncode == 1, scanned.stderr
    report = json.loads(scanned.stdout)
    live = json_entry(report, held.name)
    assert (live["status"], live["decided_by"]) == ("live", "proc")
    assert [h["pid"] for h in live["holders"]] == [holder.pid]
    orphan = json_entry(report, dead.name)
    assert (orphan["status"], orphan["decided_by"]) == ("orphaned", "proc")
    assert orphan["reason"] == judged_by_proc(no_cap)
    for e in (live, orphan):
        assert (e["lease"], e["lease_error"]) == (None, no_cap)
    assert reaped.returncode == 0, reaped.stderr
    assert removed_names(json.loads(reaped.stdout)) == [dead.name]
    assert still


@pytest.mark.root
def test_with_no_lease_a_user_who_cannot_inspect_roots_processes_keeps_its_dead_file_unknown(
    root: Path, engine_id: str
) -> None:
    require_root()
    dead = write_file(region_path(root, engine_id))
    give_to(SCANNER_UID, root, mode=0o755)
    give_to(SCANNER_UID, dead)
    with Child("fd-only", write_file(region_path(root, engine_id + "-roots"))) as roots:  # root's holder
        scanned = cli_scan(root, "--no-lease", prefix=AS_SCANNER)
        reaped = cli_reap(root, "--no-lease", prefix=AS_SCANNER)
    assert scanned.returncode == 0, scanned.stderr
    report = json.loads(scanned.stdout)
    assert roots.pid in {u["pid"] for u in report["uninspected"]}
    e = json_entry(report, dead.name)
    assert (e["status"], e["decided_by"]) == ("unknown", "proc")
    assert (e["lease"], e["lease_error"]) == (None, NO_LEASE)
    assert e["reason"].startswith("cannot inspect ")
    assert f"no write lease ({NO_LEASE})" in e["reason"]
    assert reaped.returncode == 0, reaped.stderr
    assert json.loads(reaped.stdout)["removed"] == []
    assert dead.exists()


# ------------------------------------------------------------------ a region is one unit


def link_elsewhere(segment: Path) -> None:
    os.link(segment, segment.parent / f"second-name-of-{segment.name}")


def owned_by_another_user(segment: Path) -> None:
    give_to(HOLDER_UID, segment)


#: Ways a segment is not ours to judge. Root judges another user's file by default: these
#: scans judge their own files only (``all_users=False``, ``--own-only``), as any other user's do.
SKIPPED_SEGMENT = {"a second hard link": link_elsewhere, "another user's file": owned_by_another_user}


@pytest.mark.root
@pytest.mark.parametrize("client", ["library", "cli"])
@pytest.mark.parametrize("why", sorted(SKIPPED_SEGMENT))
def test_a_base_file_whose_mapped_segment_is_skipped_is_never_reaped(
    root: Path, engine_id: str, why: str, client: str
) -> None:
    require_root()
    base = write_file(region_path(root, engine_id))
    segment = write_file(region_path(root, engine_id, 1))
    SKIPPED_SEGMENT[why](segment)
    with Child("map-only", segment):  # a live engine maps the segment; nobody holds the base
        assert entry(scan(root, grace_s=0, all_users=False), base.name).status is Status.SKIPPED
        if client == "library":
            report = reap(root, grace_s=0, all_users=False)
            removed = [e.name for e in report.removed]
            kept = [e.name for e in report.kept]
        else:
            done = cli_reap(root, "--own-only")
            assert done.returncode == 0, done.stderr
            removed = removed_names(json.loads(done.stdout))
            kept = [e["name"] for e in json.loads(done.stdout)["kept"]]
        assert base.exists()
        assert segment.exists()
    assert (removed, kept) == ([], [])


@pytest.mark.root
@pytest.mark.parametrize("why", sorted(SKIPPED_SEGMENT))
def test_a_base_file_whose_segment_is_skipped_says_which_file_keeps_it(
    root: Path, engine_id: str, why: str
) -> None:
    require_root()
    base = write_file(region_path(root, engine_id))
    segment = write_file(region_path(root, engine_id, 1))
    SKIPPED_SEGMENT[why](segment)
    e = entry(scan(root, grace_s=0, all_users=False), base.name)
    assert (e.status, e.decided_by) == (Status.SKIPPED, Evidence.FILE)
    assert e.reason.startswith(f"another file of this region is skipped ({segment.name}: ")
