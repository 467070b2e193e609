"""The agent's memory does not grow with files or roots (docs/agent-memory.md).

``shmctl watch --reap`` is a DaemonSet with a memory limit on every GPU node: a root that
fills with region files, or a node with thousands of pod volumes, must not take it past that
limit (an OOM kill restarts it into the same state, possibly mid-reap). The bound is the
contract, so these tests assert it: a real ``shmctl watch`` process over 100,000 files in
one root and over 10,000 roots peaks at 100 MiB of RSS at most, every orphan is removed and
nothing else is. The peak is the kernel's high-water mark of the process, ``VmHWM`` in
``/proc/PID/status``, read every 10 ms until it exits (the mark only grows; the last pass,
after everything was removed, is the smallest). Not ``wait4``'s ``ru_maxrss``: it keeps the
high-water mark of the memory the child ran in before its ``exec``, this test's own.

And ``/metrics`` for 10,000 roots stays a bounded number of series: the largest roots by
orphaned bytes by name, the rest folded into ``root="other"``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import RootError
from kvoffload.liveness.events import PassReport, PassSummary, RootPass, RootReap, RootScan, Usage
from kvoffload.liveness.report import ScanEntry, ScanSummary
from kvoffload.liveness.scan import STREAM_CHUNK_FILES, ScanStream, Status, scan
from shmctl.render.metrics import DEFAULT_TOP_ENGINES, DEFAULT_TOP_ROOTS, OTHER_ROOTS
from shmctl.serve.state import WatchMetrics
from tests.support.peak import run_with_peak
from tests.support.procs import Child, region_path, write_file

MIB = 1 << 20
#: The contract (issue 19): at 100,000 files and at 10,000 roots.
RSS_BOUND = 100 * MIB


@dataclass(frozen=True)
class Run:
    returncode: int
    events: list[dict[str, object]]
    stderr: str
    #: ``VmHWM`` as last read while it ran, in bytes.
    vm_hwm: int


def watch(tmp_path: Path, *args: str) -> Run:
    """``shmctl watch --reap`` for three back-to-back passes, its peak RSS and its events."""
    command = [
        sys.executable,
        "-m",
        "shmctl",
        "watch",
        "--reap",
        "--max-passes",
        "3",
        "--interval",
        "1ms",  # the next pass starts as soon as one ends
        "--grace",
        "0s",
        *args,
    ]
    out, err = tmp_path / "events", tmp_path / "stderr"
    code, peak = run_with_peak(command, out, err)
    lines = out.read_text(encoding="utf-8").splitlines()
    return Run(
        code,
        [json.loads(line) for line in lines],
        err.read_text(encoding="utf-8", errors="replace"),
        peak,
    )


def assert_within_bound(run: Run) -> None:
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert [e["event"] for e in run.events].count("pass") == 3
    assert 0 < run.vm_hwm <= RSS_BOUND, f"VmHWM {run.vm_hwm / MIB:.1f} MiB"


def removed_files(run: Run) -> int:
    return sum(int(str(e["files"])) for e in run.events if e["event"] == "removed")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
def test_watch_reap_over_100000_files_in_one_root_stays_within_100_mib(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    files = 100_000
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(files):
            # 0 bytes: an empty base file whose creator is gone is an orphan (it died before
            # sizing it); memory is about the number of files, not their size.
            name = region_path(root, f"{engine_id}{i:06d}").name
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    live = region_path(root, f"{engine_id}live")
    with Child("vllm", live):
        run = watch(tmp_path, "--root", str(root))

        assert_within_bound(run)
        assert os.listdir(root) == [live.name], "every orphan removed, the live region kept"
        assert removed_files(run) == files


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
def test_watch_reap_over_10000_roots_stays_within_100_mib(root: Path, engine_id: str, tmp_path: Path) -> None:
    roots = 10_000
    orphans = []
    for i in range(roots):
        pod = root / f"pod-{i:05d}"
        pod.mkdir()
        if i % 100 == 0:
            orphan = region_path(pod, f"{engine_id}{i:05d}")
            orphan.touch(mode=0o600)
            orphans.append(orphan)
    live = region_path(root / "pod-00001", f"{engine_id}live")
    with Child("vllm", live):
        # With the HTTP side up, as the DaemonSet runs it: its memory counts too.
        run = watch(tmp_path, "--root", f"{root}/pod-*", "--listen", "127.0.0.1:0")

        assert_within_bound(run)
        assert not any(p.exists() for p in orphans)
        assert live.exists()
        assert removed_files(run) == len(orphans)
        assert len(os.listdir(root)) == roots, "a root is never removed, only files in it"


def test_the_agents_stream_judges_every_file_as_scan_does(root: Path, engine_id: str) -> None:
    # A region with segments whose base file is the last of a chunk by name, with another
    # engine's base between it and its first segment ("E.mmap-x"); a skipped name, a live region.
    for i in range(STREAM_CHUNK_FILES - 1):
        region_path(root, f"{engine_id}-{i:04d}").touch(mode=0o600)
    for segment in range(3):
        write_file(region_path(root, engine_id, segment))
    write_file(region_path(root, f"{engine_id}.mmap-x"))
    region_path(root, f"{engine_id}link").symlink_to(region_path(root, engine_id))
    with Child("vllm", region_path(root, f"{engine_id}live")):
        report = scan(root, grace_s=0)
        with ScanStream(root, grace_s=0) as stream:
            streamed = [e for region in stream.regions() for e in region]

    def judged(entries: Iterable[ScanEntry]) -> list[tuple[str, Status, str]]:
        return sorted((e.name, e.status, e.reason) for e in entries)

    assert judged(streamed) == judged(report.entries)
    assert {e.status for e in streamed} == {Status.ORPHANED, Status.LIVE, Status.SKIPPED}


def scanned(root: Path, orphaned_bytes: int, *, at: float = 1.7e9) -> RootPass:
    """A root's turn as the agent keeps it: numbers only."""
    summary = ScanSummary(
        total=2,
        live=1,
        orphaned=1,
        starting=0,
        unknown=0,
        skipped=0,
        orphaned_size_bytes=orphaned_bytes,
        orphaned_resident_bytes=orphaned_bytes,
        resident_bytes=orphaned_bytes + 4096,
        uninspected_processes=0,
    )
    resident = dict.fromkeys(Status, 0) | {Status.LIVE: 4096, Status.ORPHANED: orphaned_bytes}
    scan = RootScan(
        root=root,
        scanned_at=at,
        summary=summary,
        resident_bytes=resident,
        orphaned_engines=((f"engine-of-{root.name}", orphaned_bytes),),
        region_size_max=max(orphaned_bytes, 4096),
        regions={Status.LIVE: 1, Status.ORPHANED: 1},
    )
    return RootPass(
        root,
        None,
        at,
        0.001,
        report=scan,
        usage=Usage(1 << 30, 1 << 29),
        last_success=at,
        reaped=RootReap(),
    )


def failed(root: Path, *, at: float = 1.7e9) -> RootPass:
    return RootPass(root, None, at, 0.001, error=RootError(root, "permission denied"), last_success=at - 60)


def recorded(metrics: WatchMetrics, passes: list[RootPass]) -> None:
    metrics.record(
        PassReport(1, 1.7e9, 1.0, len(passes), tuple(passes), (), PassSummary(1.7e9, None, None), False)
    )


def samples(metrics: WatchMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.text().decode("utf-8")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_for_10000_roots_stay_under_a_fixed_number_of_series() -> None:
    metrics = WatchMetrics(interval_s=60, reaping=True)
    roots = [
        Path(f"/var/lib/kubelet/pods/pod-{i:05d}/volumes/kubernetes.io~empty-dir/shm") for i in range(10_000)
    ]
    recorded(metrics, [failed(r) if i % 7 == 0 else scanned(r, 4096 * (i % 13)) for i, r in enumerate(roots)])

    got = samples(metrics)

    # Per root: success, error, last run, last success, duration, 6 statuses three times
    # (regions, files, bytes), orphan bytes, its engines and "other", unlinked, uninspected,
    # size, free, region max, 2 counters.
    per_root = 4 + 1 + 3 * len(Status) + 1 + DEFAULT_TOP_ENGINES + 1 + 5 + 2
    assert len(got) <= (DEFAULT_TOP_ROOTS + 1) * per_root + 10
    assert len(metrics.text()) < 1 * MIB
    assert len(metrics.series_roots) == 10_000, "every root is kept, as numbers"
    exported = {dict(labels)["root"] for (name, labels) in got if name == "shmctl_scan_success"}
    assert len(exported) == DEFAULT_TOP_ROOTS + 1


def test_roots_beyond_top_roots_are_folded_into_other_and_the_sums_still_add_up() -> None:
    metrics = WatchMetrics(interval_s=60, top_roots=2)
    big, bigger, small, tiny = (Path(f"/shm/{name}") for name in ("big", "bigger", "small", "tiny"))
    broken = Path("/shm/broken")
    recorded(
        metrics,
        [
            scanned(big, 8192),
            scanned(bigger, 16384, at=1.7e9 + 5),
            scanned(small, 4096, at=1.7e9 - 30),
            scanned(tiny, 0),
            failed(broken),
        ],
    )

    got = samples(metrics)

    def value(name: str, root: str, **labels: str) -> float:
        return got[(name, frozenset({"root": root, "pod_uid": "", **labels}.items()))]

    named = {dict(labels)["root"] for (name, labels) in got if name == "shmctl_orphan_bytes"}
    assert named == {str(bigger), str(big), OTHER_ROOTS}
    assert value("shmctl_orphan_bytes", OTHER_ROOTS) == 4096
    assert value("shmctl_orphan_engine_bytes", OTHER_ROOTS, engine_id="other") == 4096
    assert sum(v for (name, _), v in got.items() if name == "shmctl_orphan_bytes") == 8192 + 16384 + 4096
    assert value("shmctl_regions", OTHER_ROOTS, status="live") == 2  # small and tiny
    assert value("shmctl_region_files", OTHER_ROOTS, status="live") == 2
    assert value("shmctl_scan_success", OTHER_ROOTS) == 0, "a folded root failed"
    assert value("shmctl_last_success_timestamp_seconds", OTHER_ROOTS) == 1.7e9 - 60, "the oldest"
    assert not any(name == "shmctl_scan_error_info" for (name, _) in got), "the failed root is folded"
