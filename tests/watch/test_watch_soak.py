"""shmctl watch over hours, compressed: 10,000 passes over 100 roots that come and go.

The pass loop runs in-process (``Watcher.run`` with a pass hook), as the agent runs it, with
``--reap`` on: every pass one root appears and one vanishes (plain directories, the way a
kubelet pod directory comes and goes), a few roots are real tmpfs mounts that stay (root
only), and orphans keep appearing in them, to be reaped two passes later. Every pass goes
through ``WatchMetrics`` and the exposition is built as a scrape would. After a warm-up the
process's RSS (``VmRSS``) and its fd count must not grow beyond a small bound, and the
series must name only the roots that exist: memory and label cardinality stay flat while
pods come and go.

``/proc`` is a one-process tree of the test's own (``proc_root``): the test is about the
loop's own state, not about the cost of walking a busy host's ``/proc`` 600,000 times.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.liveness.events import PassReport
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.serve.state import WatchMetrics
from tests.support.kubelet import VOLUMES, KubeletNode
from tests.support.procs import REPO, fake_proc, region_path, write_file

PASSES = 10_000
POOL = 100
#: Roots present at once: the window slides one root per pass, so each root of the pool
#: appears and vanishes about a hundred times.
PRESENT = 4
WARM_UP = 1_000
MOUNTS = 2
RSS_BOUND = 4 << 20
FD_BOUND = 2


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def mounts(base: Path) -> Iterator[list[Path]]:
    """A few real tmpfs pod volumes that stay for the whole soak (none where mounting is not allowed)."""
    if os.geteuid() != 0:
        yield []
        return
    node = KubeletNode(base)
    try:
        yield [node.add_pod(f"mounted-{i}", size="4m") for i in range(MOUNTS)]
    finally:
        node.close()


def soak(tmp_path: Path, engine_id: str) -> dict[str, object]:
    """The soak itself, in this process: what it measured, for the test to judge."""
    proc = fake_proc(tmp_path, maps_readable=True)
    base = tmp_path / "kubelet"
    pool = [base / "pods" / f"pod-{i:03}" / VOLUMES / "dshm" for i in range(POOL)]
    with mounts(base) as mounted:
        config = WatchConfig(
            roots=(str(base / "pods" / "*" / VOLUMES / "*"),),
            interval_s=0,
            reap=True,
            grace_s=0,
            proc_root=proc,
        )
        metrics = WatchMetrics(interval_s=1)
        removed = 0
        samples: dict[str, list[int]] = {"rss": [], "fds": []}
        widest = 0
        orphans: list[Path] = []

        def on_event(event: object) -> None:
            nonlocal removed
            if getattr(event, "event", None) == "removed":
                removed += 1

        def on_pass(report: PassReport) -> None:
            nonlocal widest
            n = report.number
            metrics.record(report)
            # The window slides: one root vanishes, the next appears.
            shutil.rmtree(pool[n % POOL].parent.parent.parent, ignore_errors=True)
            pool[(n + PRESENT) % POOL].mkdir(parents=True, exist_ok=True)
            if mounted and n % 10 == 0:
                orphans.append(
                    write_file(region_path(mounted[n // 10 % MOUNTS], f"{engine_id}-{n}"), size=4096)
                )
            if n % 100 == 0:
                widest = max(widest, len(metrics.series_roots))
                assert metrics.text()  # a scrape, as the HTTP thread makes it
            if n >= WARM_UP and n % 500 == 0:
                samples["rss"].append(rss_bytes())
                samples["fds"].append(fd_count())

        for i in range(PRESENT):
            pool[i].mkdir(parents=True)
        started = time.monotonic()
        passes = Watcher(config, on_event=on_event).run(max_passes=PASSES, on_pass=on_pass)
        seconds = time.monotonic() - started

        for path in orphans:
            path.unlink(missing_ok=True)
        return {
            "passes": passes,
            "seconds": seconds,
            "rss": samples["rss"],
            "fds": samples["fds"],
            "widest": widest,
            "mounted": len(mounted),
            "orphans": len(orphans),
            "removed": removed,
        }


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
def test_ten_thousand_passes_over_roots_that_come_and_go_keep_memory_fds_and_series_flat(
    tmp_path: Path, engine_id: str
) -> None:
    """Run in a fresh interpreter, as the agent runs: pytest's own process (coverage, captured
    warnings, a heap grown by a thousand other tests) would blur what the loop itself keeps."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.watch.test_watch_soak", str(tmp_path), engine_id],
        cwd=REPO,
        # Nor a coverage tracer started in the child by the suite's coverage run.
        env={k: v for k, v in os.environ.items() if not k.startswith(("COV_CORE_", "COVERAGE_"))},
        capture_output=True,
        text=True,
        timeout=590,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    rss, fds = result["rss"], result["fds"]
    print(
        f"\nsoak: {result['passes']} passes in {result['seconds']:.1f}s; RSS {rss[0] >> 10} -> "
        f"{rss[-1] >> 10} KiB (max {max(rss) >> 10}); fds {fds[0]} -> {fds[-1]}; "
        f"{result['removed']} regions removed; at most {result['widest']} roots with series"
    )
    assert result["passes"] == PASSES
    assert max(rss) - rss[0] <= RSS_BOUND
    assert max(fds) - fds[0] <= FD_BOUND
    # Series name only what the last pass saw: the window, the mounts, and the one that
    # appeared since (never the hundred that came and went).
    assert result["widest"] <= PRESENT + result["mounted"] + 1
    if result["mounted"]:
        assert result["removed"] >= result["orphans"] - 2  # the last ones were made after their second pass


if __name__ == "__main__":
    try:
        print(json.dumps(soak(Path(sys.argv[1]), sys.argv[2])))
    except pytest.skip.Exception as skipped:
        print(json.dumps({"skip": str(skipped)}))
