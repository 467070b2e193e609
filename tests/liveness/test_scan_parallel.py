"""The scan's probes in a forked child beside the ``/proc`` pass: same verdicts, no new holder.

``kvoffload.liveness.prober`` forks a child that opens, leases and locks every region file
while the parent walks ``/proc``. The child's fds, leases and flocks are the scan's own: a
verdict must never count them, and a child that fails must leave the whole answer to the
parent. Real files, real holders, real forks; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness import prober
from kvoffload.liveness.lease import LeaseState
from kvoffload.liveness.report import ScanReport
from kvoffload.liveness.scan import Evidence, Status, scan
from tests.liveness.test_liveness_namespaces import (
    AS_HOLDER,
    AS_SCANNER,
    HOLDER_UID,
    IN_CHILD_PID_NS,
    SCANNER_UID,
    cli_scan,
    give_to,
    json_entry,
    require_root,
    require_unshare,
)
from tests.support.procs import Child, entry, leave_orphan, region_path, write_file

needs_two_cpus = pytest.mark.skipif(not prober.parallel_possible(), reason="needs two CPUs and fork")


def verdicts(report: ScanReport) -> list[tuple[Any, ...]]:
    return [
        (e.name, e.status, e.decided_by, tuple(h.pid for h in e.holders), e.lease, e.lock_held)
        for e in report.entries
    ]


@contextmanager
def watching_probes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[prober.Probing[Any, Any]]]:
    """Every ``Probing`` the scan makes, to see whether its child answered."""
    made: list[prober.Probing[Any, Any]] = []
    real = prober.start

    @contextmanager
    def start(items: Sequence[Any], probe: Callable[[Any], Any], *, parallel: bool | None = None) -> Any:
        with real(items, probe, parallel=parallel) as probing:
            made.append(probing)
            yield probing

    monkeypatch.setattr(prober, "start", start)
    yield made


def gone(pid: int) -> bool:
    """True once ``pid`` is neither running nor a zombie waiting for us."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_two_cpus
def test_probing_in_a_child_gives_the_verdicts_of_probing_after_the_walk(
    root: Path, engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    orphan = leave_orphan(root, engine_id + "-dead")
    fresh = write_file(region_path(root, engine_id + "-fresh"))
    holders: dict[str, Child] = {}
    try:
        for mode in ("vllm", "map-only", "fd-only", "lock-only", "region"):
            path = region_path(root, f"{engine_id}-{mode}")
            if mode in ("map-only", "fd-only", "lock-only"):
                write_file(path)
            holders[mode] = Child(mode, path)
        with watching_probes(monkeypatch) as made:
            forked = scan(root, grace_s=0, parallel=True)
        serial = scan(root, grace_s=0, parallel=False)
        fresh_kept = scan(root, grace_s=3600, parallel=True)
    finally:
        for child in holders.values():
            child.kill()
    assert made[0].parallel, "the child's answer was not used"
    assert verdicts(forked) == verdicts(serial)
    for mode, child in holders.items():
        e = entry(forked, child.path.name)
        assert e.status is Status.LIVE, (mode, e.reason)
        assert child.pid in [h.pid for h in e.holders], mode
        assert made[0].pids.isdisjoint(h.pid for h in e.holders)
    for path in (orphan, fresh):
        e = entry(forked, path.name)
        assert (e.status, e.decided_by, e.lease, e.lock_held) == (
            Status.ORPHANED,
            Evidence.LEASE,
            LeaseState.FREE,
            False,
        )
    assert entry(fresh_kept, fresh.name).status is Status.STARTING


@needs_two_cpus
def test_the_childs_own_leases_and_locks_never_make_a_file_live(
    root: Path, engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enough files for the scan to fork by itself: every one nobody holds is orphaned."""
    count = prober.PARALLEL_MIN + 88
    paths = [write_file(region_path(root, f"{engine_id}-{i:04d}"), 4096) for i in range(count)]
    with watching_probes(monkeypatch) as made:
        report = scan(root, grace_s=0)
    assert made[0].parallel
    assert [e.name for e in report.entries] == sorted(p.name for p in paths)
    assert {(e.status, e.decided_by, e.holders) for e in report.entries} == {
        (Status.ORPHANED, Evidence.LEASE, ())
    }
    assert report.summary.orphaned == count


@needs_two_cpus
def test_what_the_scanning_process_itself_holds_is_still_seen(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    fd = os.open(path, os.O_RDONLY)
    try:
        report = scan(root, grace_s=0, parallel=True)
    finally:
        os.close(fd)
    e = entry(report, path.name)
    assert (e.status, e.decided_by) == (Status.LIVE, Evidence.PROC)
    assert [h.pid for h in e.holders] == [os.getpid()]
    assert e.lease is LeaseState.HELD  # the child inherited our fd: a second open file description


@needs_two_cpus
@pytest.mark.root
def test_a_forking_scan_in_a_child_pid_namespace_keeps_what_only_the_lease_sees(
    root: Path, engine_id: str
) -> None:
    """The CLI, in its own PID namespace, with enough files to fork: the host's holder it
    cannot see keeps its file (the lease), every other file is orphaned."""
    require_unshare()
    held = write_file(region_path(root, engine_id + "-held"))
    for i in range(prober.PARALLEL_MIN):
        write_file(region_path(root, f"{engine_id}-{i:04d}"), 4096)
    with Child("map-only", held):
        result = cli_scan(root, prefix=IN_CHILD_PID_NS)
    assert result.returncode == 1, result.stderr  # 1: orphans were found
    report = json.loads(result.stdout)
    live = json_entry(report, held.name)
    assert (live["status"], live["lease"], live["decided_by"]) == ("live", "held", "lease")
    others = [e for e in report["entries"] if e["name"] != held.name]
    assert len(others) == prober.PARALLEL_MIN
    assert {(e["status"], e["decided_by"]) for e in others} == {("orphaned", "lease")}


@needs_two_cpus
@pytest.mark.root
def test_a_forking_scan_as_a_non_root_account_keeps_what_another_uid_holds(
    root: Path, engine_id: str
) -> None:
    """The CLI as an unprivileged uid, with enough files to fork: a holder of another uid
    cannot be inspected, so only the lease keeps its file; the scanner's own orphans go."""
    require_root()
    held = write_file(region_path(root, engine_id + "-held"))
    dead = [write_file(region_path(root, f"{engine_id}-{i:04d}"), 4096) for i in range(prober.PARALLEL_MIN)]
    give_to(SCANNER_UID, root, mode=0o755)
    give_to(SCANNER_UID, held, *dead, mode=0o666)  # the scanner's own files: it may lease them
    with Child("fd-only", held, prefix=AS_HOLDER) as holder:
        result = cli_scan(root, prefix=AS_SCANNER)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert holder.pid in {u["pid"] for u in report["uninspected"]}
    assert {u["uids"][0] for u in report["uninspected"] if u["pid"] == holder.pid} == {HOLDER_UID}
    live = json_entry(report, held.name)
    assert (live["status"], live["lease"], live["decided_by"]) == ("live", "held", "lease")
    others = [e for e in report["entries"] if e["name"] != held.name]
    assert sorted(e["name"] for e in others) == sorted(p.name for p in dead)
    assert {(e["status"], e["decided_by"]) for e in others} == {("orphaned", "lease")}


def test_a_child_that_fails_leaves_every_probe_to_the_parent() -> None:
    parent = os.getpid()

    def probe(item: int) -> tuple[int, int]:
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return item, os.getpid()

    with prober.start(range(5), probe, parallel=True) as probing:
        (child,) = probing.pids
        answers = probing.results()
    assert answers == [(i, parent) for i in range(5)]
    assert not probing.parallel
    assert gone(child)


def test_a_child_killed_mid_probe_leaves_every_probe_to_the_parent() -> None:
    parent = os.getpid()

    def probe(item: int) -> int:
        if os.getpid() != parent:
            time.sleep(60)
        return item * 2

    with prober.start(range(3), probe, parallel=True) as probing:
        (child,) = probing.pids
        os.kill(child, signal.SIGKILL)
        assert probing.results() == [0, 2, 4]
    assert not probing.parallel
    assert gone(child)


def test_an_interrupted_scan_kills_and_reaps_its_child() -> None:
    def probe(item: int) -> int:
        time.sleep(60)
        return item

    children: list[int] = []

    def interrupted_walk() -> None:
        with prober.start(range(3), probe, parallel=True) as probing:
            children.extend(probing.pids)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_walk()
    assert len(children) == 1
    assert gone(children[0])


def _logged(log: Path, pause_in_child_s: float = 0.0) -> Callable[[int], tuple[int, int]]:
    """A probe that appends "pid item" to ``log`` (O_APPEND: one whole line per write)."""
    parent = os.getpid()

    def probe(item: int) -> tuple[int, int]:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {item}\n".encode())
        finally:
            os.close(fd)
        if os.getpid() != parent:
            time.sleep(pause_in_child_s)
        return item, os.getpid()

    return probe


def _probed(log: Path) -> list[tuple[int, int]]:
    return [(int(pid), int(item)) for pid, item in (line.split() for line in log.read_text().splitlines())]


def test_parent_and_child_share_the_items_and_probe_each_exactly_once(tmp_path: Path) -> None:
    log = tmp_path / "probes"
    count = prober.RUN * 12
    # The child is slowed down so that the parent, once it asks for results, surely claims runs.
    with prober.start(range(count), _logged(log, 0.0005), parallel=True) as probing:
        (child,) = probing.pids
        answers = probing.results()
    assert probing.parallel
    assert [item for item, _ in answers] == list(range(count))
    probed = _probed(log)
    assert sorted(item for _, item in probed) == list(range(count))  # each once, none skipped
    assert dict((item, pid) for pid, item in probed) == dict(answers)  # each answer is its prober's
    assert {pid for _, pid in answers} == {os.getpid(), child}


def test_runs_a_killed_child_had_claimed_are_probed_by_the_parent_once(tmp_path: Path) -> None:
    log = tmp_path / "probes"
    count = prober.RUN * 8
    with prober.start(range(count), _logged(log, 60), parallel=True) as probing:
        (child,) = probing.pids
        deadline = time.monotonic() + 30
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has claimed a run and is inside its first probe
        os.kill(child, signal.SIGKILL)
        answers = probing.results()
    assert not probing.parallel
    assert answers == [(i, os.getpid()) for i in range(count)]
    parent_probes = sorted(item for pid, item in _probed(log) if pid == os.getpid())
    assert parent_probes == list(range(count))
    assert gone(child)


def test_a_huge_list_is_claimed_in_runs_that_fit_one_page_of_pipe() -> None:
    runs = prober._runs(5_000_000)
    assert len(runs) <= prober._MAX_RUNS
    assert [i for span in runs[:2] for i in span] == list(range(2 * len(runs[0])))
    assert runs[-1].stop == 5_000_000


def test_a_threaded_process_never_forks_to_probe() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not prober.parallel_possible()
        with prober.start(range(prober.PARALLEL_MIN * 2), lambda i: i) as probing:
            assert probing.pids == frozenset()
            assert probing.results() == list(range(prober.PARALLEL_MIN * 2))
    finally:
        stop.set()
        thread.join()
