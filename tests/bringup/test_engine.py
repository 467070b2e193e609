"""``kvoffload.bringup`` with kvoffload's own participants: the plan allocates nothing, the
bring-up runs vLLM's order in real processes, and every fault at every stage ends with the
cleanup contract checked in the root.

Bring-ups run in a private directory of the real /dev/shm tmpfs (``tests.support.procs.shm_dir``)
with a test-tagged engine id, so a concurrent run elsewhere on the host cannot touch them.
Participants start from a forkserver that has imported torch once, which keeps a bring-up
at a few tens of milliseconds after the first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import faults
from kvoffload.bringup import (
    BringUpOutcome,
    BringUpRequest,
    FailMode,
    LiveEngine,
    bring_up,
    build_fault_plan,
    plan,
    run_matrix,
)
from kvoffload.bringup.inputs import load_config
from kvoffload.bringup.plan import (
    CREATOR_ONLY,
    MAX_WORLD_SIZE,
    SCHEDULER,
    WORKER,
    CapacityError,
    plan_stages,
    stage_sides,
)
from kvoffload.bringup.report import ErrorInfo, InitReport, MatrixCell
from kvoffload.bringup.residue import measure_residue
from kvoffload.errors import ConfigError, FaultSpecError, InjectedFault, RootError
from kvoffload.kv_transfer_config import read_kv_transfer_config
from kvoffload.liveness.reap import ReapFilter, reap
from kvoffload.liveness.scan import Status, scan
from kvoffload.presets import PRESETS, get_preset
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.shm import names
from tests.support.procs import uninspectable_pids

torch = pytest.importorskip("torch")

CPU, TIERING = "CPUOffloadingSpec", "TieringOffloadingSpec"
KV_BYTES_PER_BLOCK = 4 * PAGESIZE
MIB = 1 << 20


def make_config(
    engine_id: str,
    root: Path,
    spec: str = TIERING,
    world_size: int = 1,
    *,
    lifetime: str = "kvoffload",
    cpu_bytes: int = 4 * MIB,
    tiers: int = 1,
    extra: dict[str, Any] | None = None,
) -> OffloadingSettings:
    extra_config: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": cpu_bytes, **(extra or {})}
    if spec == TIERING and tiers:
        extra_config["secondary_tiers"] = [{"type": "example", "custom_param": i} for i in range(tiers)]
    return OffloadingSettings.from_kv_transfer_config(
        json.dumps({"engine_id": engine_id, "kv_connector_extra_config": extra_config}),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        world_size=world_size,
        root=root,
        lifetime="vllm" if lifetime == "vllm" else "kvoffload",
    )


def region_file(config: OffloadingSettings) -> Path:
    return config.root / names.format_name(config.engine_id)


def stage(report: InitReport, participant: str, name: str) -> Any:
    found = [s for s in report.stages if s.participant == participant and s.name == name]
    assert len(found) == 1, (participant, name, report.stages)
    return found[0]


# ----------------------------------------------------------------- plan


def test_plan_names_files_slots_tiers_and_stages_as_vllm_would(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, TIERING, world_size=2, tiers=2)
    p = plan(config)
    sizing = config.sizing
    assert p.sizing == sizing
    assert [(f.path, f.segment, f.offset, f.bytes) for f in p.files] == [
        (root / f"vllm_offload_{engine_id}.mmap", 0, 0, sizing.total_bytes)
    ]
    assert [(s.rank, s.offset, s.bytes) for s in p.layout.slots] == [
        (0, 0, KV_BYTES_PER_BLOCK),
        (1, KV_BYTES_PER_BLOCK, KV_BYTES_PER_BLOCK),
    ]
    assert p.layout.slots[0].populate_bytes == sizing.num_chunks * KV_BYTES_PER_BLOCK
    assert p.layout.scheduler_populate_bytes == sizing.total_bytes
    assert [(t.role, t.index, t.type) for t in p.tiers] == [
        ("primary", 0, "cpu"),
        ("secondary", 0, "example"),
        ("secondary", 1, "example"),
    ]
    assert p.participants == ("worker 0", "worker 1", "scheduler")
    assert p.region_participants == 3
    assert [s.name for s in p.stages] == [
        "validate",
        "region.open",
        "region.space",
        "region.truncate",
        "region.mmap",
        "region.attach",
        "region.populate",
        "worker",
        "scheduler.region",
        "primary",
        "secondary.0",
        "secondary.1",
        "manager",
        "cleanup.secondary.0",
        "cleanup.secondary.1",
        "cleanup.primary",
        "cleanup.worker",
        "cleanup.region",
    ]


def test_plan_of_the_cpu_spec_has_no_scheduler_region_or_tiers(engine_id: str, root: Path) -> None:
    p = plan(make_config(engine_id, root, CPU, world_size=2))
    assert p.tiers == ()
    assert p.layout.scheduler_populate_bytes == 0
    assert [s.name for s in p.stages] == [
        "validate",
        "region.open",
        "region.space",
        "region.truncate",
        "region.mmap",
        "region.attach",
        "region.populate",
        "worker",
        "manager",
        "cleanup.worker",
        "cleanup.region",
    ]
    assert all(s.sides == (WORKER,) for s in p.stages if s.name.startswith(("region.", "cleanup.region")))


def with_tiers(config: OffloadingSettings, tiers: list[dict[str, Any]]) -> OffloadingSettings:
    """``config`` with these secondary tiers, unchecked: a hosted tier's class needs vLLM to
    import, and planning its stages does not."""
    return dataclasses.replace(config, secondary_tiers=tuple(tiers))


@pytest.mark.parametrize("point", [p.name for p in faults.REGISTRY])
def test_every_registry_point_is_placed_and_planned_for_the_tiering_spec(
    point: str, engine_id: str, root: Path
) -> None:
    """A point added to the registry shows up in the plan (and so in the matrix) the day it is added."""
    sides = stage_sides(point, tiering=True)
    assert set(sides) <= {WORKER, SCHEDULER}
    assert sides
    # A hosted tier's own points are planned where a tier of that type is configured.
    hosted: list[dict[str, Any]] = [
        {"type": "p2p", "port": 5710},
        {"type": "obj", "store_config": {"bucket": "kv"}},
    ]
    planned = {
        s.name.rsplit(".", 1)[0] if s.name[-1].isdigit() else s.name
        for s in plan_stages(with_tiers(make_config(engine_id, root, TIERING), hosted))
    }
    assert point in planned
    assert (point in CREATOR_ONLY) == (point in ("region.space", "region.truncate"))


@pytest.mark.parametrize("kind", ["p2p", "obj"])
def test_a_hosted_tiers_points_are_planned_only_where_that_tier_is_configured(
    engine_id: str, root: Path, kind: str
) -> None:
    ours = [p.name for p in faults.REGISTRY if p.tier == kind]
    assert ours
    tiers: list[dict[str, Any]] = [{"type": "example"}, {"type": kind}]
    with_it = plan_stages(with_tiers(make_config(engine_id, root, TIERING), tiers))
    planned = {s.name: s for s in with_it}
    assert all(planned[name].sides == (SCHEDULER,) for name in ours)
    assert all(planned[name].description.startswith("secondary tier 1: ") for name in ours)
    without = {s.name for s in plan_stages(make_config(engine_id, root, TIERING))}
    assert without.isdisjoint(ours)
    assert {s.name for s in plan_stages(make_config(engine_id, root, CPU))}.isdisjoint(ours)


def test_plan_splits_a_large_cpu_region_into_segments_like_vllm(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, CPU, cpu_bytes=3 << 30)
    p = plan(config)
    assert [f.path.name for f in p.files] == [names.format_name(engine_id, i) for i in range(3)]
    assert sum(f.bytes for f in p.files) == config.sizing.total_bytes
    assert [f.offset for f in p.files] == [0, p.files[0].bytes, 2 * p.files[0].bytes]


@pytest.mark.system_wide  # the free blocks of the whole /dev/shm tmpfs: no other test may allocate
def test_dry_run_plan_allocates_nothing(engine_id: str, root: Path) -> None:
    before = (sorted(os.listdir(root)), os.statvfs(root).f_bfree)
    p = plan(make_config(engine_id, root, TIERING, world_size=2, cpu_bytes=64 * MIB))
    assert p.capacity.needed_bytes == 64 * MIB
    assert (sorted(os.listdir(root)), os.statvfs(root).f_bfree) == before


def test_plan_of_a_budget_under_one_chunk_is_a_config_error(engine_id: str, root: Path) -> None:
    with pytest.raises(ConfigError, match="smaller than one chunk"):
        plan(make_config(engine_id, root, CPU, cpu_bytes=PAGESIZE))


def test_plan_refuses_more_workers_than_one_engine_has(engine_id: str, root: Path) -> None:
    """However the config was built: bring_up and run_matrix plan first, so they refuse it too."""
    config = make_config(engine_id, root, CPU, world_size=MAX_WORLD_SIZE + 1, cpu_bytes=64 * MIB)
    with pytest.raises(ConfigError, match=rf"^--world-size: {MAX_WORLD_SIZE + 1} is more than the "):
        plan(config)


def test_plan_of_a_missing_root_is_a_root_error(engine_id: str, tmp_path: Path) -> None:
    with pytest.raises(RootError, match="does not exist"):
        plan(make_config(engine_id, tmp_path / "nowhere"))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs whose free space the test controls (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("this environment does not allow mounting a tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.root
@pytest.mark.parametrize(("cpu_mib", "fits"), [(2, True), (8, False)])
def test_capacity_verdict_of_the_dry_run_is_the_real_bring_ups(
    cpu_mib: int, fits: bool, engine_id: str, small_tmpfs: Path
) -> None:
    """One rule: what the dry run says does not fit, a real bring-up refuses before it starts
    anything (``CapacityError`` carrying the plan's own capacity and fix)."""
    config = make_config(engine_id, small_tmpfs, CPU, cpu_bytes=cpu_mib * MIB)
    p = plan(config)
    assert p.capacity.fits is fits
    assert (p.capacity.mount_point, p.capacity.fs_type, p.capacity.mount_bytes) == (
        small_tmpfs,
        "tmpfs",
        4 * MIB,
    )
    if fits:
        report = bring_up(BringUpRequest(config, roundtrip=False))
        assert report.residue.paths == ()
        assert p.capacity.fix is None
        assert report.verdict is BringUpOutcome.OK
        return
    assert p.capacity.fix is not None
    # An empty tmpfs: a bigger mount is the first remedy; what two lines cannot hold is linked.
    assert p.capacity.fix.startswith(f"mount -o remount,size=8M {small_tmpfs}")
    assert p.capacity.fix.endswith(" (docs/doctor.md#space)")
    assert "shmctl reap" not in p.capacity.fix  # an empty root has no orphan to reap
    with pytest.raises(CapacityError) as refused:
        bring_up(BringUpRequest(config, roundtrip=False))
    assert refused.value.capacity == p.capacity
    assert refused.value.fix == p.capacity.fix
    assert os.listdir(small_tmpfs) == []


@pytest.mark.root
@pytest.mark.parametrize("fail_at", [(), ("region.space",), ("secondary",)], ids=str)
def test_a_bring_up_the_root_cannot_hold_refuses_whatever_fault_it_was_to_inject(
    fail_at: tuple[str, ...], engine_id: str, small_tmpfs: Path
) -> None:
    """Not a fault "that did not fire" after the workers met vLLM's own space check: refused."""
    config = make_config(engine_id, small_tmpfs, TIERING, cpu_bytes=8 * MIB)
    refused = r"the region needs 8\.0 MiB: it does not fit; nothing was started"
    with pytest.raises(CapacityError, match=refused):
        bring_up(BringUpRequest(config, fail_at=fail_at, roundtrip=False))
    assert os.listdir(small_tmpfs) == []


@pytest.mark.root
def test_the_fix_of_a_root_holding_other_files_names_the_reap_of_that_root(
    engine_id: str, small_tmpfs: Path
) -> None:
    """Space already taken may be dead engines' regions: the fix offers the reap."""
    (small_tmpfs / "taken").write_bytes(b"x" * MIB)
    try:
        capacity = plan(make_config(engine_id, small_tmpfs, CPU, cpu_bytes=4 * MIB)).capacity
    finally:
        (small_tmpfs / "taken").unlink()
    assert capacity.fix is not None
    assert capacity.fix.startswith(f"remove orphaned regions: shmctl reap --root {small_tmpfs}")


# ----------------------------------------------------------------- bring-up


def test_bring_up_maps_workers_first_then_the_scheduler_and_leaves_nothing(
    engine_id: str, root: Path
) -> None:
    config = make_config(engine_id, root, TIERING, world_size=2)
    report = bring_up(BringUpRequest(config))
    assert report.verdict is BringUpOutcome.OK
    assert (report.error, report.residue.paths, report.crash) == (None, (), None)
    workers_up = [stage(report, f"worker {r}", "create_worker") for r in (0, 1)]
    manager = stage(report, "scheduler", "get_manager")
    assert all(w.started_s + w.seconds <= manager.started_s for w in workers_up)
    assert sorted(w.detail for w in workers_up) == ["created the region", "joined the region"]
    assert {w.bytes for w in workers_up} == {plan(config).layout.slots[0].populate_bytes}
    assert manager.bytes == config.sizing.total_bytes
    assert "secondary.0" in manager.points
    for rank in (0, 1):
        roundtrip = stage(report, f"worker {rank}", "roundtrip")
        assert (roundtrip.result, roundtrip.bytes) == ("ok", 2 * KV_BYTES_PER_BLOCK)
    shutdowns = [s for s in report.stages if s.name == "shutdown"]
    assert [s.participant for s in shutdowns][-1] == "scheduler"
    assert report.device == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_injected_raise_reports_the_error_the_cleanup_in_order_and_no_residue(
    engine_id: str, root: Path
) -> None:
    report = bring_up(
        BringUpRequest(make_config(engine_id, root, TIERING, world_size=2, tiers=2), fail_at=["secondary.1"])
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.error is not None
    assert (report.error.type, report.error.injected, report.error.point) == (
        "InjectedFault",
        True,
        "secondary.1",
    )
    assert (report.error.participant, report.error.stage) == ("scheduler", "get_manager")
    assert report.fault is not None
    assert (report.fault.fired, report.fault.fired_in) == (True, ("scheduler",))
    scheduler_steps = [c.what for c in report.cleanup if c.participant == "scheduler"]
    # get_manager unwinds in reverse: the built secondary tier, then the primary (and its region).
    first_secondary = scheduler_steps.index("shut down secondary tier 0 (example)")
    assert first_secondary < scheduler_steps.index("shut down primary tier")
    assert "shut down secondary tier 1 (example)" not in scheduler_steps
    parent = [c.what for c in report.cleanup if c.participant == "parent"]
    # Teardown in vLLM's order: the workers, then the scheduler (which reports its unwind).
    assert parent == ["ask worker 0 to shut down", "ask worker 1 to shut down", "ask scheduler to shut down"]
    assert report.residue.paths == ()


def test_a_fault_aimed_at_one_worker_fails_the_engine_and_its_peer_is_torn_down(
    engine_id: str, root: Path
) -> None:
    """CPU spec: worker 1 fails after the barrier, so worker 0 is up and the parent shuts it down."""
    report = bring_up(
        BringUpRequest(make_config(engine_id, root, CPU, world_size=2), fail_at=["worker"], target_rank=1)
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert stage(report, "worker 0", "create_worker").result == "ok"
    assert stage(report, "worker 1", "create_worker").result == "failed"
    assert not [s for s in report.stages if s.participant == "scheduler"]
    assert "ask worker 0 to shut down" in [c.what for c in report.cleanup if c.participant == "parent"]
    assert stage(report, "worker 0", "shutdown").result == "ok"
    assert report.residue.paths == ()


def test_a_tiering_worker_may_see_its_creator_fail_and_the_contract_still_holds(
    engine_id: str, root: Path
) -> None:
    """Tiering has no barrier: if worker 1 won the creation and then fails, worker 0 may be
    joining at that moment and fail with CreatorFailedError, or be up and be shut down.
    Either way the injected fault is the reported error and nothing is left."""
    report = bring_up(
        BringUpRequest(make_config(engine_id, root, TIERING, world_size=2), fail_at=["worker"], target_rank=1)
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.error is not None
    assert (report.error.participant, report.error.point) == ("worker 1", "worker")
    peer = stage(report, "worker 0", "create_worker")
    if peer.result == "ok":
        assert stage(report, "worker 0", "shutdown").result == "ok"
    else:
        assert peer.error is not None
        assert peer.error.type == "CreatorFailedError"
    assert not [s for s in report.stages if s.participant == "scheduler"]
    assert report.residue.paths == ()


def test_a_worker_failing_before_the_barrier_releases_its_peer_instead_of_hanging(
    engine_id: str, root: Path
) -> None:
    """Worker 1 fails before it ever maps the region, so it never reaches the CPU spec's barrier;
    the parent aborts the barrier and worker 0 fails fast (BrokenBarrierError) and cleans up."""
    report = bring_up(
        BringUpRequest(
            make_config(engine_id, root, CPU, world_size=2),
            fail_at=["validate"],
            target_rank=1,
            idle_timeout_s=100,  # a peer left hanging waits 100 s in the barrier; released, seconds
        )
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.error is not None
    assert report.error.participant == "worker 1"
    peer = stage(report, "worker 0", "create_worker")
    assert peer.result == "failed"
    assert peer.error is not None
    assert peer.error.type == "BrokenBarrierError"
    assert peer.seconds < 60  # not the idle timeout: a bound no load reaches
    assert any("abort the workers' barrier" in c.what for c in report.cleanup)
    assert report.residue.paths == ()


def test_cleanup_raise_fails_every_release_step_and_the_contract_still_holds(
    engine_id: str, root: Path
) -> None:
    report = bring_up(
        BringUpRequest(make_config(engine_id, root, TIERING), fail_at=["manager"], fail_mode="cleanup-raise")
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    failed_steps = [c for c in report.cleanup if not c.ok]
    assert failed_steps
    assert all("injected fault at cleanup." in (c.error or "") for c in failed_steps)
    assert report.residue.paths == ()


def test_a_fault_at_a_cleanup_point_fails_the_shutdown_not_the_init(engine_id: str, root: Path) -> None:
    report = bring_up(BringUpRequest(make_config(engine_id, root, CPU), fail_at=["cleanup.region"]))
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.error is not None
    assert (report.error.stage, report.error.point) == ("shutdown", "cleanup.region")
    assert stage(report, "worker 0", "create_worker").result == "ok"
    assert report.residue.paths == ()


def test_oserror_mode_injects_that_errno(engine_id: str, root: Path) -> None:
    report = bring_up(
        BringUpRequest(
            make_config(engine_id, root, CPU), fail_at=["region.populate"], fail_mode="oserror:EFAULT"
        )
    )
    assert report.error is not None
    assert (report.error.type, report.error.errno, report.error.injected) == ("OSError", 14, True)
    assert report.verdict is BringUpOutcome.CONTRACT_HELD


def test_a_broken_cleanup_is_caught_by_the_residue_check(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test-only switch makes the worker exit without releasing anything. The scheduler
    fails before it maps the region, so the path was never unlinked by the attach ledger and
    only the worker's release (its creator unlink) could remove it: the check must see it."""
    config = make_config(engine_id, root, TIERING)
    monkeypatch.setenv("KVOFFLOAD_INIT_SKIP_RELEASE", "worker")
    report = bring_up(BringUpRequest(config, fail_at=["scheduler.region"]))
    assert report.verdict is BringUpOutcome.LEAKED
    assert report.residue.paths == (region_file(config),)
    assert report.residue.bytes == config.sizing.total_bytes
    assert any("skipped" in c.what and not c.ok for c in report.cleanup)
    region_file(config).unlink()


def test_without_the_switch_the_same_failure_leaves_nothing(engine_id: str, root: Path) -> None:
    report = bring_up(BringUpRequest(make_config(engine_id, root, TIERING), fail_at=["scheduler.region"]))
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.residue.paths == ()


def test_crash_at_secondary_leaves_the_region_that_scan_calls_orphaned_and_reap_removes(
    engine_id: str, root: Path
) -> None:
    """vLLM 0.33's tiering lifetime keeps the path while the engine lives, so an OOM kill of the
    engine (here: the scheduler dies at ``secondary``, the parent SIGKILLs the workers) leaves
    the region. With kvoffload's lifetime the path is already gone by then (next test)."""
    config = make_config(engine_id, root, TIERING, world_size=2, lifetime="vllm")
    report = bring_up(BringUpRequest(config, fail_at=["secondary"], fail_mode="crash"))
    assert report.verdict is BringUpOutcome.ORPHANED
    assert report.crash is not None
    assert (report.crash.participant, report.crash.injected, report.crash.exit_code) == (
        "scheduler",
        True,
        -9,
    )
    assert report.crash.killed == ("worker 0", "worker 1")
    assert report.crash.orphans == (region_file(config),)
    assert report.crash.reap_command == f"shmctl reap --root {root} --engine {engine_id} --grace 0 --yes"
    found = {e.name: e.status for e in scan(root, grace_s=0, assume_not_holding=uninspectable_pids()).entries}
    assert found == {region_file(config).name: Status.ORPHANED}
    removed = reap(
        root, grace_s=0, filters=ReapFilter.exactly(engine_id), assume_not_holding=uninspectable_pids()
    )
    assert [e.path for e in removed.removed] == [region_file(config)]
    assert measure_residue(root, engine_id).paths == ()


def test_crash_after_everyone_attached_leaves_nothing_with_our_lifetime(engine_id: str, root: Path) -> None:
    report = bring_up(
        BringUpRequest(
            make_config(engine_id, root, TIERING, world_size=2), fail_at=["secondary"], fail_mode="crash"
        )
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.crash is not None
    assert report.crash.orphans == ()
    assert report.crash.why_nothing_left is not None
    assert report.residue.paths == ()


def test_hold_keeps_the_engine_live_for_scan_until_released(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, TIERING, lifetime="vllm")
    seen: list[tuple[LiveEngine, dict[str, Status]]] = []

    def look(live: LiveEngine) -> None:
        statuses = {
            e.name: e.status for e in scan(root, grace_s=0, assume_not_holding=uninspectable_pids()).entries
        }
        seen.append((live, statuses))

    report = bring_up(BringUpRequest(config, hold=look, hold_s=0.2, roundtrip=False))
    [(live, statuses)] = seen
    assert set(live.pids) == {"worker 0", "scheduler"}
    assert live.files == (region_file(config),)
    assert statuses == {region_file(config).name: Status.LIVE}
    assert report.held_s is not None
    assert report.held_s >= 0.2
    assert report.verdict is BringUpOutcome.OK


def test_progress_reports_populated_bytes_per_participant(engine_id: str, root: Path) -> None:
    events: list[Any] = []
    config = make_config(engine_id, root, TIERING)
    bring_up(BringUpRequest(config, roundtrip=False), progress=events.append)
    last = {(e.participant, e.stage): (e.done, e.total) for e in events}
    total = config.sizing.total_bytes
    assert last[("scheduler", "get_manager")] == (total, total)
    done, todo = last[("worker 0", "create_worker")]
    assert done == todo == plan(config).layout.slots[0].populate_bytes


# ----------------------------------------------------------------- faults: names, modes, seeds


def test_a_stage_this_spec_never_runs_is_a_usage_error(engine_id: str, root: Path) -> None:
    cpu = plan(make_config(engine_id, root, CPU))
    with pytest.raises(ConfigError, match="runs only with TieringOffloadingSpec"):
        build_fault_plan(cpu, ["primary"])
    with pytest.raises(FaultSpecError, match="unknown point"):
        build_fault_plan(cpu, ["region.opne"])
    tiering = plan(make_config(engine_id, root, TIERING, world_size=2))
    with pytest.raises(ConfigError, match="1 secondary tier"):
        build_fault_plan(tiering, ["secondary.3"])
    with pytest.raises(ConfigError, match="never in worker 0"):
        build_fault_plan(tiering, ["primary"], target=0)
    with pytest.raises(ConfigError, match=r"outside 0\.\.1"):
        build_fault_plan(tiering, ["worker"], target=2)


def test_fail_modes_map_to_the_fault_grammar() -> None:
    assert FailMode.parse("raise").action == "raise"
    assert FailMode.parse("oserror:EFAULT").action == "oserror(14)"
    assert str(FailMode.parse("oserror:28")) == "oserror:ENOSPC"
    assert FailMode.parse("crash").action == "crash"
    assert FailMode.parse("25%cleanup-raise").action == "25%raise"
    for bad in ("explode", "oserror", "oserror:EWHAT", "raise:1", "150%raise"):
        with pytest.raises(ConfigError):
            FailMode.parse(bad)


def test_cleanup_raise_arms_every_cleanup_point_in_the_targeted_participant(
    engine_id: str, root: Path
) -> None:
    fault = build_fault_plan(
        plan(make_config(engine_id, root, TIERING, world_size=2)), ["primary"], "cleanup-raise", "scheduler"
    )
    assert fault is not None
    assert fault.failpoints == (
        "primary=raise;cleanup.secondary=raise;cleanup.primary=raise;cleanup.worker=raise;cleanup.region=raise"
    )
    assert fault.targeted == ("scheduler",)
    assert "primary=raise" not in fault.per_participant["worker 0"]
    faults.parse_config(fault.per_participant["scheduler"])


def _seed_whose_first_draw(fires: bool) -> int:
    return next(s for s in range(1000) if (random.Random(s).random() < 0.5) is fires)


@pytest.mark.parametrize("fires", [True, False])
def test_a_probabilistic_fault_is_replayed_by_its_seed(fires: bool, engine_id: str, root: Path) -> None:
    seed = _seed_whose_first_draw(fires)
    config = make_config(engine_id, root, CPU)
    reports = [
        bring_up(
            BringUpRequest(
                dataclasses.replace(config, engine_id=f"{engine_id}-{i}"),
                fail_at=["worker"],
                fail_mode="50%raise",
                seed=seed,
                roundtrip=False,
            )
        )
        for i in range(2)
    ]
    expected = BringUpOutcome.CONTRACT_HELD if fires else BringUpOutcome.NOT_FIRED
    assert [r.verdict for r in reports] == [expected, expected]
    assert reports[0].fault is not None
    assert reports[0].fault.seed == seed
    if not fires:
        assert any("probability 50%" in w for w in reports[0].warnings)


def test_a_seed_is_chosen_and_reported_when_a_probabilistic_mode_has_none(engine_id: str, root: Path) -> None:
    the_plan = plan(make_config(engine_id, root, CPU))
    fault = build_fault_plan(the_plan, ["worker"], "10%raise")
    assert fault is not None
    assert fault.seed is not None
    assert 0 <= fault.seed < 1 << 31
    # Reported so that it can be replayed: the same seed given back builds the same fault.
    assert build_fault_plan(the_plan, ["worker"], "10%raise", None, fault.seed) == fault


def test_injected_errors_are_told_apart_from_real_ones() -> None:
    assert ErrorInfo.of(InjectedFault("worker"), "worker 0", "create_worker").injected
    injected_os = OSError(14, "Bad address (injected at region.populate)")
    assert ErrorInfo.of(injected_os, "worker 0", "create_worker").point == "region.populate"
    assert not ErrorInfo.of(OSError(14, "Bad address"), "worker 0", "create_worker").injected


# ----------------------------------------------------------------- matrix


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("spec", [CPU, TIERING])
def test_matrix_in_raise_modes_holds_the_contract_at_every_stage(
    spec: str, world_size: int, engine_id: str, root: Path
) -> None:
    config = make_config(engine_id, root, spec, world_size=world_size)
    report = run_matrix(config)
    stages = [s.name for s in plan(config).stages]
    assert report.stages == tuple(stages)
    assert report.modes == ("raise", "oserror:EFAULT", "cleanup-raise")
    assert len(report.cells) == 3 * len(stages)
    failures = [(c.stage, c.mode, c.verdict, c.error) for c in report.cells if not c.passed or not c.fired]
    assert failures == []
    assert (report.failed, report.leaked) == (0, 0)
    assert all(c.residue.bytes == 0 for c in report.cells)
    assert len({c.engine_id for c in report.cells}) == len(report.cells)


@pytest.mark.slow
def test_matrix_crash_cells_are_scanned_and_reaped(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, TIERING, world_size=2, lifetime="vllm")
    report = run_matrix(
        config,
        stages=["region.truncate", "secondary.0", "cleanup.primary"],
        modes=[],
        include_crash=True,
        assume_not_holding=uninspectable_pids(),
    )
    by_stage = {c.stage: c for c in report.cells}
    assert all(c.passed for c in report.cells)
    assert len(by_stage["secondary.0"].orphans) == 1
    assert by_stage["secondary.0"].scan_status == ("orphaned",)
    assert by_stage["secondary.0"].reaped == by_stage["secondary.0"].orphans
    # The scheduler shuts down last: by then the creator worker had unlinked the path.
    assert by_stage["cleanup.primary"].orphans == ()
    assert os.listdir(root) == []


def test_each_crash_cell_is_reaped_before_the_next_cell_starts(engine_id: str, root: Path) -> None:
    """The recovery is part of the cell: done before anyone hears of it, whatever the output."""
    config = make_config(engine_id, root, TIERING, lifetime="vllm")
    seen: list[tuple[str, int, list[str]]] = []

    def on_cell(cell: MatrixCell, index: int, total: int) -> None:
        seen.append((cell.stage, len(cell.reaped), sorted(os.listdir(root))))

    report = run_matrix(
        config,
        stages=["region.populate", "secondary.0"],
        modes=[],
        include_crash=True,
        on_cell=on_cell,
        assume_not_holding=uninspectable_pids(),
    )
    assert seen == [("region.populate", 1, []), ("secondary.0", 1, [])]
    assert (report.passed, report.stopped) == (2, None)


def test_matrix_checks_every_cell_before_running_one(engine_id: str, root: Path) -> None:
    with pytest.raises(ConfigError):
        run_matrix(make_config(engine_id, root, CPU), stages=["worker", "primary"])
    assert os.listdir(root) == []


# ----------------------------------------------------------------- inputs


def test_presets_follow_the_documented_formula() -> None:
    llama = get_preset("llama-3-8b")
    assert llama.worker_kv_bytes_per_block(16, 1) == 32 * 2 * 8 * 128 * 2 * 16 == 2 * MIB
    assert llama.worker_kv_bytes_per_block(16, 2) == MIB
    assert llama.worker_kv_bytes_per_block(16, 16) == llama.worker_kv_bytes_per_block(16, 8)
    deepseek = get_preset("deepseek-v3")
    assert deepseek.mla
    assert (
        deepseek.worker_kv_bytes_per_block(64, 8)
        == 61 * 576 * 2 * 64
        == deepseek.worker_kv_bytes_per_block(64, 1)
    )
    assert len(PRESETS) >= 5
    with pytest.raises(ConfigError, match="no preset"):
        get_preset("gpt-17")


def test_an_mla_preset_implies_the_replicated_layout_unless_told_otherwise(tmp_path: Path) -> None:
    text = json.dumps({"kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
    common: dict[str, Any] = {"kv_transfer_config": text, "config_file": None, "kv_bytes_per_block": None}
    mla = load_config(model="deepseek-v3", world_size=8, root=tmp_path, **common)
    assert mla.replicated_layout
    assert not load_config(
        model="deepseek-v3", replicated_layout=False, root=tmp_path, **common
    ).replicated_layout
    assert not load_config(model="llama-3-70b", world_size=8, root=tmp_path, **common).replicated_layout


def test_config_files_may_be_json_or_toml_with_the_same_keys(tmp_path: Path) -> None:
    as_json = tmp_path / "engine.json"
    as_json.write_text(
        json.dumps({"kv_connector_extra_config": {"cpu_bytes_to_use": 4096, "blocks_per_chunk": 2}})
    )
    as_toml = tmp_path / "engine.toml"
    as_toml.write_text("[kv_connector_extra_config]\ncpu_bytes_to_use = 4096\nblocks_per_chunk = 2\n")
    assert read_kv_transfer_config(as_json) == read_kv_transfer_config(as_toml)
    broken = tmp_path / "broken.toml"
    broken.write_text("[kv_connector_extra_config\n")
    with pytest.raises(ConfigError, match="malformed TOML"):
        read_kv_transfer_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        read_kv_transfer_config(tmp_path / "missing.json")
