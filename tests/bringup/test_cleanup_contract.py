"""PR #51227's cleanup contract, on every branch, for every fault point in the registry.

For every init point x every raise-type action: the original exception reaches the
caller unchanged, and the failing call leaves nothing of its own behind: no file in the
root, no fd and no mapping in this process (the autouse fixture checks the end state;
these tests also check the failing call's own footprint before survivors are torn down).
Again with a cleanup step failing at the same time. The lists are read from the
registry, so a new point is covered the day it is added.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvoffload import faults
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import ConfigError, InjectedFault
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.tiering.spec import TieringOffloadingSpec
from tests.conftest import region_fds, region_maps

torch = pytest.importorskip("torch")

SHM = Path("/dev/shm")
# A hosted tier's own points (p2p, obj) need vLLM: tests/tiering/test_tiering_hosted.py covers them.
INIT_POINTS = [p.name for p in faults.REGISTRY if p.phase == "init" and p.tier is None]
CLEANUP_POINTS = [p.name for p in faults.REGISTRY if p.phase == "cleanup" and p.tier is None]
ACTIONS: dict[str, Callable[[BaseException, str], bool]] = {
    "raise": lambda e, point: isinstance(e, InjectedFault) and e.point == point,
    "oserror(14)": lambda e, point: type(e) is OSError and e.errno == 14 and f"injected at {point}" in str(e),
}
TIERING_ONLY = {"scheduler.region", "primary", "secondary"}
KV_BYTES_PER_BLOCK = PAGESIZE // 2
JOINER_SKIPS = {"region.space", "region.truncate"}


def make_config(engine_id: str, spec: str) -> OffloadingSettings:
    extra: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": 8 * PAGESIZE, "blocks_per_chunk": 2}
    if spec == "TieringOffloadingSpec":
        extra["secondary_tiers"] = [{"type": "example"}, {"type": "example", "custom_param": 1}]
    return OffloadingSettings.from_kv_transfer_config(
        json.dumps({"engine_id": engine_id, "kv_connector_extra_config": extra}),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        world_size=1,
        root=SHM,
    )


def kv_caches() -> list[Any]:
    return [torch.arange(16 * KV_BYTES_PER_BLOCK, dtype=torch.int8).reshape(16, KV_BYTES_PER_BLOCK)]


def spec_class(spec: str) -> type[CPUOffloadingSpec]:
    return TieringOffloadingSpec if spec == "TieringOffloadingSpec" else CPUOffloadingSpec


def reachable(spec: str, point: str) -> bool:
    return spec == "TieringOffloadingSpec" or point not in TIERING_ONLY


def cases() -> Iterator[Any]:
    for spec in ("CPUOffloadingSpec", "TieringOffloadingSpec"):
        for point in INIT_POINTS:
            if reachable(spec, point):
                yield pytest.param(spec, point, id=f"{spec[:-15] or 'CPU'}-{point}")


@contextmanager
def engine(config: OffloadingSettings, cls: type[CPUOffloadingSpec]) -> Iterator[dict[str, Any]]:
    """Bring up one worker then the scheduler, in vLLM's order; tear down whatever was built."""
    built: dict[str, Any] = {}
    try:
        yield built
    finally:
        faults.configure(None)
        if "manager" in built:
            built["manager"].shutdown()
        if "worker" in built:
            built["worker"].shutdown()


def bring_up(config: OffloadingSettings, cls: type[CPUOffloadingSpec], built: dict[str, Any]) -> None:
    built["worker_spec"] = cls.from_settings(config.for_rank(0))
    built["worker"] = built["worker_spec"].create_worker(kv_caches())
    footprint = (len(region_fds()), len(region_maps()))
    built["scheduler_spec"] = cls.from_settings(config)
    try:
        built["manager"] = built["scheduler_spec"].get_manager()
    except BaseException:
        # The failing call must leave exactly the worker's footprint, nothing of its own.
        assert (len(region_fds()), len(region_maps())) == footprint
        raise


@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize(("spec", "point"), list(cases()))
def test_injected_failure_reaches_caller_and_leaves_nothing(
    engine_id: str, spec: str, point: str, action: str
) -> None:
    config = make_config(engine_id, spec)
    with engine(config, spec_class(spec)) as built:
        faults.configure({point: action})
        with pytest.raises((InjectedFault, OSError)) as info:
            bring_up(config, spec_class(spec), built)
        assert ACTIONS[action](info.value, point), repr(info.value)
        assert faults.hits() == {point: 1}
    assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []


@pytest.mark.parametrize("cleanup_point", CLEANUP_POINTS)
@pytest.mark.parametrize(("spec", "point"), list(cases()))
def test_original_error_survives_a_failing_cleanup_step(
    engine_id: str, spec: str, point: str, cleanup_point: str
) -> None:
    config = make_config(engine_id, spec)
    with engine(config, spec_class(spec)) as built:
        faults.configure({point: "raise", cleanup_point: "raise"})
        with pytest.raises(InjectedFault) as info:
            bring_up(config, spec_class(spec), built)
        assert info.value.point == point
    assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []


# region.space and region.truncate run only in the creator, and the scheduler joins.
JOINER_POINTS = [p for p in INIT_POINTS if p.startswith("region.") and p not in JOINER_SKIPS]


@pytest.mark.parametrize("point", JOINER_POINTS)
def test_scheduler_side_region_failure_is_unwound(engine_id: str, point: str) -> None:
    """``1*off->raise`` skips the worker's region and fails the scheduler's one."""
    config = make_config(engine_id, "TieringOffloadingSpec")
    with engine(config, TieringOffloadingSpec) as built:
        faults.configure({point: "1*off->raise"})
        with pytest.raises(InjectedFault):
            bring_up(config, TieringOffloadingSpec, built)
        assert "worker" in built
        assert built["scheduler_spec"]._scheduler_mmap is None
    assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []


def test_secondary_n_fails_only_the_nth_tier_and_unwinds_in_reverse(engine_id: str) -> None:
    config = make_config(engine_id, "TieringOffloadingSpec")
    with engine(config, TieringOffloadingSpec) as built:
        faults.configure({"secondary.1": "raise"})
        with pytest.raises(InjectedFault, match=r"secondary\.1"):
            bring_up(config, TieringOffloadingSpec, built)
        steps = [s.what for s in built["scheduler_spec"].journal.steps]
    assert steps[0] == "shut down secondary tier 0 (example)"
    assert steps[1] == "shut down primary tier"
    assert "clean scheduler region" in steps[-1]


def test_primary_failure_cleans_the_bare_region(engine_id: str) -> None:
    config = make_config(engine_id, "TieringOffloadingSpec")
    with engine(config, TieringOffloadingSpec) as built:
        faults.configure({"primary": "raise"})
        with pytest.raises(InjectedFault):
            bring_up(config, TieringOffloadingSpec, built)
        steps = built["scheduler_spec"].journal.steps
    assert [s.what.split()[0:3] for s in steps if s.what.startswith("clean")] == [
        ["clean", "scheduler", "region"]
    ]
    assert all(s.ok for s in steps)


def test_worker_failure_cleans_its_region(engine_id: str) -> None:
    config = make_config(engine_id, "CPUOffloadingSpec")
    spec = CPUOffloadingSpec.from_settings(config)
    faults.configure({"worker": "raise"})
    with pytest.raises(InjectedFault):
        spec.create_worker(kv_caches())
    name = f"vllm_offload_{engine_id}.mmap"
    assert [s.what for s in spec.journal.steps] == [
        f"clean worker region {name}",
        f"unmap {name}",
        f"close fd of {name}",
        # No unlink: the only expected participant had attached, so the path was already gone.
        f"close root fd of {name}",
    ]
    assert all(s.ok for s in spec.journal.steps)


def test_get_manager_is_memoised_and_shutdown_releases_everything(engine_id: str) -> None:
    config = make_config(engine_id, "TieringOffloadingSpec")
    with engine(config, TieringOffloadingSpec) as built:
        bring_up(config, TieringOffloadingSpec, built)
        assert built["scheduler_spec"].get_manager() is built["manager"]
        # Every participant attached: the path is already gone, while both still map it.
        assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []
        assert len(region_maps()) == 2


def test_store_threshold_is_rejected_before_any_allocation(engine_id: str) -> None:
    config = dataclasses.replace(make_config(engine_id, "TieringOffloadingSpec"), store_threshold=2)
    with pytest.raises(ConfigError, match="store_threshold"):
        TieringOffloadingSpec.from_settings(config).get_manager()
    assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []


def test_runtime_shutdown_releases_the_region_when_a_tier_shutdown_raises(engine_id: str) -> None:
    """vLLM #52290 skips the primary when a secondary fails; we release it and raise after."""
    config = make_config(engine_id, "TieringOffloadingSpec")
    with engine(config, TieringOffloadingSpec) as built:
        bring_up(config, TieringOffloadingSpec, built)
        manager = built.pop("manager")
        faults.configure({"cleanup.secondary.0": "raise"})
        with pytest.raises(InjectedFault, match=r"cleanup\.secondary\.0"):
            manager.shutdown()
        assert len(region_maps()) == 1  # only the worker's mapping is left


def test_vllm_lifetime_keeps_the_tiering_path_while_the_engine_lives(engine_id: str) -> None:
    config = dataclasses.replace(make_config(engine_id, "TieringOffloadingSpec"), lifetime="vllm")
    with engine(config, TieringOffloadingSpec) as built:
        bring_up(config, TieringOffloadingSpec, built)
        assert [p.name for p in SHM.glob(f"vllm_offload_{engine_id}*")] == [f"vllm_offload_{engine_id}.mmap"]
    assert list(SHM.glob(f"vllm_offload_{engine_id}*")) == []
