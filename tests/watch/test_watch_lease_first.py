"""Lease-first passes (issue #31): verdicts, reasons and metrics unchanged where evidence is unchanged.

The agent's steady passes judge a region by its write leases and the last ``/proc`` walk
(``ScanStream`` with ``walks``), and walk only for what a lease cannot answer. Here a real host
(real tmpfs, real holder processes mapping and opening regions, orphans, a starting region, a
region whose recorded owner runs, another uid's files where no lease can be taken, an unlinked
region still mapped) is judged both ways over the same evidence: every entry's status, reason
and deciding evidence, and the metrics text (but for the walk counters and the durations),
must be the same. Then the evidence changes between passes (a holder exits and another maps
the file, a holder lets go and the file becomes leasable, a new engine appears), and the
lease-first pass must walk or judge exactly as a full walk does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness import lease
from kvoffload.liveness.scan import ScanOptions, ScanStream
from kvoffload.liveness.walks import ProcWalks
from kvoffload.liveness.watch import WatchConfig, Watcher
from kvoffload.shm.owner import OwnerRecord, write_owner
from shmctl.serve.state import WatchMetrics
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import REPO, Child, region_path, write_file

NOBODY_UID = 65534
#: Root without CAP_LEASE: it leases its own files by ownership, and no other uid's.
WITHOUT_CAP_LEASE = ("setpriv", "--bounding-set", "-lease")
#: Long enough for a pass or two, short enough to wait out once for the orphans.
GRACE_S = 3.0
#: Families whose values are times or walk counts: the only ones the two agents may differ in.
TIMING = (
    "shmctl_proc_walk",
    "shmctl_scan_duration_seconds",
    "shmctl_watch_pass_duration_seconds",
    "shmctl_last_run_timestamp_seconds",
    "shmctl_last_success_timestamp_seconds",
)

# Run as root without CAP_LEASE (setpriv): another uid's files get no lease, as in a DaemonSet
# without that capability. Judges every root twice with the same clock (a full walk, and
# lease-first after a walk in an earlier "pass"), then runs two agents over the same host, one
# walking every pass and one lease-first, and prints what both saw.
_COMPARE = r"""
import json, os, sys, time
from pathlib import Path
from kvoffload.liveness import lease
from kvoffload.liveness.scan import ScanOptions, ScanStream
from kvoffload.liveness.walks import ProcWalks
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.serve.state import WatchMetrics

base, grace, pattern = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
options = ScanOptions(grace_s=grace)
roots = sorted(p for p in base.iterdir() if p.match(pattern))

def judged(stream):
    entries = [[e.name, e.status, e.reason, e.decided_by] for region in stream.regions() for e in region]
    return {
        "entries": entries,
        "uninspected": len(stream.uninspected),
        "deleted": sum(d.mapped_bytes for d in stream.deleted),
    }

out = {"full": {}, "lease_first": {}, "walked": {}}
with lease.sigio_ignored():
    now = time.time()
    walks = ProcWalks(options.proc_root)
    devices = {os.stat(r).st_dev for r in roots}
    walks.begin(1, devices)
    walks.walk("first")
    walks.begin(2, devices)
    for r in roots:
        with ScanStream(r, options, now=now) as s:
            out["full"][r.name] = judged(s)
        holders, lead = (walks.last, None) if walks.fresh else (walks.last, walks)
        with ScanStream(r, options, holders=holders, walks=lead, now=now) as s:
            out["lease_first"][r.name] = judged(s)
        out["walked"][r.name] = list(walks.reasons)

    def agent(every):
        config = WatchConfig(roots=(str(base / pattern),), interval_s=0, scan=options, walk_every=every)
        return Watcher(config), WatchMetrics(interval_s=1)

    full, full_metrics = agent(1)
    first, first_metrics = agent(10)
    passes = [
        first.run_pass(on_pass=first_metrics.record),
        full.run_pass(on_pass=full_metrics.record),
        full.run_pass(on_pass=full_metrics.record),
        first.run_pass(on_pass=first_metrics.record),
    ]
out["passes"] = [list(p.proc_walks) for p in passes]
out["metrics"] = [full_metrics.text().decode(), first_metrics.text().decode()]
print(json.dumps(out))
"""


def compare(base: Path, pattern: str) -> dict[str, Any]:
    done = subprocess.run(
        [*WITHOUT_CAP_LEASE, sys.executable, "-c", _COMPARE, str(base), str(GRACE_S), pattern],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def comparable(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if not any(name in line for name in TIMING)]


def owned_by_us(path: Path) -> Path:
    """A region file whose owner record names this (running) process: ``unknown``."""
    write_file(path)
    fd = os.open(path, os.O_RDWR)
    try:
        engine_id = path.name.removeprefix("vllm_offload_").removesuffix(".mmap")
        assert write_owner(fd, OwnerRecord.for_current_process(engine_id))
    finally:
        os.close(fd)
    return path


@pytest.fixture
def host(tmp_path: Path, engine_id: str) -> Iterator[Path]:
    """Two roots on a tmpfs of the test's own: ``a`` answers every question by leases, ``b`` holds
    another uid's files (no lease without CAP_LEASE). Orphans are older than the grace period;
    a starting region is not."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a tmpfs of its own, another uid's files, setpriv")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv(1) to drop CAP_LEASE")
    with mounted_tmpfs(tmp_path / "shm", "size=64m,mode=0755") as shm:
        a, b = shm / "a", shm / "b"
        a.mkdir()
        b.mkdir()
        e = engine_id
        write_file(region_path(a, f"{e}-orphan"), touch=2)
        write_file(region_path(a, f"{e}-orphan", 1))
        foreign_orphan = write_file(region_path(b, f"{e}-foreign-orphan"))
        os.chown(foreign_orphan, NOBODY_UID, NOBODY_UID)
        time.sleep(GRACE_S + 0.5)
        with (
            Child("vllm", region_path(a, f"{e}-live")),
            Child("map-only", write_file(region_path(a, f"{e}-live", 1))),
            Child("fd-only", write_file(region_path(a, f"{e}-reader"))),
            Child("map-only", write_file(region_path(a, f"{e}-gone"))),
            Child("map-only", write_file(region_path(b, f"{e}-foreign-live"))),
        ):
            os.chown(region_path(b, f"{e}-foreign-live"), NOBODY_UID, NOBODY_UID)
            region_path(a, f"{e}-gone").unlink()  # unlinked, still mapped: unlinked_mapped_bytes
            owned_by_us(region_path(a, f"{e}-ours"))
            write_file(region_path(a, f"{e}-starting"))
            yield shm


def test_a_lease_first_pass_judges_every_region_as_a_full_walk_does(host: Path) -> None:
    seen = compare(host, "*")

    assert seen["lease_first"] == seen["full"]
    statuses = sorted({entry[1] for root in seen["full"].values() for entry in root["entries"]})
    assert statuses == ["live", "orphaned", "starting", "unknown"]
    assert seen["full"]["a"]["deleted"] > 0
    # Root a's every lease answered: no walk; root b's files get none, so it walked for them.
    assert seen["walked"] == {"a": [], "b": ["no_lease"]}


def test_a_lease_first_agent_exports_the_metrics_of_one_that_walks_every_pass(host: Path) -> None:
    seen = compare(host, "*")

    full, first = seen["metrics"]
    assert comparable(first) == comparable(full)
    assert "shmctl_unlinked_mapped_bytes{" in full
    assert seen["passes"] == [["first"], ["first"], ["periodic"], ["no_lease"]]
    assert 'shmctl_proc_walks_total{reason="no_lease"} 1.0' in first


def test_where_every_lease_answers_the_steady_pass_walks_no_proc_and_exports_the_same(host: Path) -> None:
    seen = compare(host, "a")

    assert seen["lease_first"] == seen["full"]
    full, first = seen["metrics"]
    assert comparable(first) == comparable(full)
    assert seen["passes"][3] == []  # the leases decided everything
    assert "shmctl_proc_walk_timestamp_seconds" in first


# --- evidence that changes between passes ---------------------------------------------------------


class Passes:
    """A root judged as the agent's passes judge it: a walk first, then lease-first passes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.options = ScanOptions(grace_s=0)
        self.walks = ProcWalks(self.options.proc_root)
        self.number = 0
        self.devices = {os.stat(root).st_dev}
        self.next(walk="first")

    def next(self, walk: str | None = None) -> tuple[list[list[Any]], list[list[Any]], list[str]]:
        """One more pass: (its entries lease-first, a full walk's entries, why it walked)."""
        self.number += 1
        self.walks.begin(self.number, self.devices)
        if walk is not None:
            self.walks.walk(walk)
        now = time.time()
        with lease.sigio_ignored():
            lead = None if self.walks.fresh else self.walks
            with ScanStream(self.root, self.options, holders=self.walks.last, walks=lead, now=now) as s:
                first = [[e.name, e.status, e.reason] for region in s.regions() for e in region]
            with ScanStream(self.root, self.options, now=now) as s:
                full = [[e.name, e.status, e.reason] for region in s.regions() for e in region]
        return first, full, list(self.walks.reasons)


def test_a_holder_gone_and_another_come_make_the_pass_walk_and_name_the_new_one(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("map-only", path) as old:
        passes = Passes(root)
        old.kill()
        with Child("fd-only", path) as new:
            first, full, walked = passes.next()
            assert walked == ["holders_changed"]
            assert first == full
            assert f"{new.pid}:" in first[0][2]


def test_a_file_its_holder_let_go_is_judged_by_its_lease_not_by_the_last_walks_holder(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("map-only", path) as holder:
        passes = Passes(root)
        holder.stop()  # its mapping is gone: the file is leasable now
        first, full, walked = passes.next()
    # The last walk named a holder; the lease says nobody: orphaned, with no walk.
    assert walked == []
    assert first == full
    assert first[0][1] == "orphaned"


def test_a_new_engine_makes_the_pass_walk_and_a_steady_one_then_rests_on_leases(
    root: Path, engine_id: str
) -> None:
    passes = Passes(root)
    with Child("vllm", region_path(root, engine_id)) as engine:
        first, full, walked = passes.next()
        assert walked == ["holders_changed"]
        assert first == full
        assert f"{engine.pid}:" in first[0][2]

        first, full, walked = passes.next()
        assert walked == []
        assert first == full


def test_a_walk_is_made_every_walk_every_passes_and_counted_by_reason(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("map-only", path):
        config = WatchConfig(roots=(str(root),), interval_s=0, grace_s=0, walk_every=3)
        metrics = WatchMetrics(interval_s=1)
        w = Watcher(config)
        with lease.sigio_ignored():
            walked = [list(w.run_pass(on_pass=metrics.record).proc_walks) for _ in range(5)]
    path.unlink()
    assert walked == [["first"], [], [], ["periodic"], []]
    text = metrics.text().decode()
    assert 'shmctl_proc_walks_total{reason="first"} 1.0' in text
    assert 'shmctl_proc_walks_total{reason="periodic"} 1.0' in text


def test_walk_every_below_1_is_refused() -> None:
    from kvoffload.errors import ConfigError

    with pytest.raises(ConfigError, match="--walk-every"):
        WatchConfig(roots=("/dev/shm",), walk_every=0)


# An agent in a PID namespace of its own (a DaemonSet without hostPID) sees no engine: a walk names
# no holder of a live region, so walking again for it would show nobody either.
_OUT_OF_SIGHT = r"""
import json, sys, time
from pathlib import Path
from kvoffload.liveness import lease
from kvoffload.liveness.scan import ScanOptions, ScanStream
from kvoffload.liveness.watch import WatchConfig, Watcher

root = Path(sys.argv[1])
options = ScanOptions(grace_s=0)
w = Watcher(WatchConfig(roots=(str(root),), interval_s=0, scan=options))
with lease.sigio_ignored():
    passes = [list(w.run_pass().proc_walks) for _ in range(3)]
    w.walks.begin(4, w.walks.devices)
    now = time.time()
    with ScanStream(root, options, holders=w.walks.last, walks=w.walks, now=now) as s:
        first = [[e.name, e.status, e.reason] for region in s.regions() for e in region]
    with ScanStream(root, options, now=now) as s:
        full = [[e.name, e.status, e.reason] for region in s.regions() for e in region]
print(json.dumps({"passes": passes, "first": first, "full": full, "walked": w.walks.reasons}))
"""
IN_CHILD_PID_NS = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")


def test_a_region_held_out_of_sight_is_judged_by_its_lease_without_a_walk_every_pass(
    root: Path, engine_id: str
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for an agent in its own PID namespace")
    with Child("vllm", region_path(root, engine_id)):
        done = subprocess.run(
            [*IN_CHILD_PID_NS, sys.executable, "-c", _OUT_OF_SIGHT, str(root)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot create a PID namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["passes"] == [["first"], [], []]
    assert seen["walked"] == []
    assert seen["first"] == seen["full"]
    assert "cannot see" in seen["first"][0][2]


def test_a_holder_that_came_after_the_walk_in_full_sight_is_named_by_the_next_pass(
    root: Path, engine_id: str
) -> None:
    from kvoffload.liveness.namespace import visibility
    from tests.support.procs import uninspectable_pids

    if not visibility().complete:
        pytest.skip("this /proc does not show every process: a walk could never name the holder")
    # Every process in sight (the uninspectable ones vouched for, as an operator would).
    options = ScanOptions(grace_s=0, assume_not_holding=uninspectable_pids())
    walks = ProcWalks(options.proc_root)
    devices = {os.stat(root).st_dev}
    walks.begin(1, devices)
    walks.walk("first")
    with Child("vllm", region_path(root, engine_id)) as engine, lease.sigio_ignored():
        # Opened after this pass's walk, before its probe: refused, and named by nobody yet.
        with ScanStream(root, options, holders=walks.last, walks=walks) as s:
            assert [e.status for region in s.regions() for e in region] == ["live"]
        walks.begin(2, devices)
        with ScanStream(root, options, holders=walks.last, walks=walks) as s:
            reasons = [e.reason for region in s.regions() for e in region]
    assert walks.reasons == ["holders_changed"]
    assert f"{engine.pid}:" in reasons[0]
