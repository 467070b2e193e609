"""What a bring-up would allocate, and whether it fits, without allocating anything.

``plan(config)`` answers an operator's questions before a 200 GiB region is attempted:
which files (names, segment split, bytes each), the row layout of the worker slots,
which tiers in which order, which stages run where, and whether the shm root has room,
with the exact fix when it does not, and whether the root's mount gives the region huge
pages (and how to turn them on when it does not). Everything is computed from the
configuration, one ``statvfs`` of the root and the mount table; nothing is created, opened
or mapped.

The stage list is the fault-point registry filtered to what this spec and world size
run, so ``--fail-at`` names, the matrix rows and the plan always agree.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload import faults
from kvoffload.cpu.segments import plan_segments
from kvoffload.errors import ConfigError, RootError
from kvoffload.fixes import fit
from kvoffload.settings import PAGESIZE, OffloadingSettings, OffloadingSizing
from kvoffload.shm import mounts
from kvoffload.shm.mounts import HugePages, check_huge_pages
from kvoffload.shm.names import DEFAULT_ROOT

SCHEMA_VERSION = 1
MIB = 1 << 20
GIB = 1 << 30
#: Docker's default ``--shm-size``: the classic reason a region does not fit.
DOCKER_DEFAULT_SHM = 64 * MIB

WORKER = "worker"
SCHEDULER = "scheduler"
#: The most workers one engine may have. vLLM's world size is one engine's tensor x pipeline
#: parallel size (data-parallel ranks are engines of their own): up to 8 on one node, a few
#: nodes' worth (16 to 64) for the largest models, 72 on an NVL72 rack. 1024 is over ten
#: times any of those, yet keeps the per-worker work bounded: the plan lists one slot per
#: worker and a bring-up starts one process per worker (a world size of 10 million once ran
#: a dry run for 38 s into a MemoryError).
MAX_WORLD_SIZE = 1024
#: Points that run wherever a region is mapped: every worker, and the tiering scheduler.
_REGION_POINTS = frozenset(
    {"region.open", "region.space", "region.truncate", "region.mmap", "region.attach", "region.populate"}
)
_SIDES: dict[str, tuple[str, ...]] = {
    "validate": (WORKER, SCHEDULER),
    "worker": (WORKER,),
    "scheduler.region": (SCHEDULER,),
    "primary": (SCHEDULER,),
    "secondary": (SCHEDULER,),
    "manager": (SCHEDULER,),
    "cleanup.secondary": (SCHEDULER,),
    "cleanup.primary": (SCHEDULER,),
    "cleanup.worker": (WORKER,),
}
#: Only the process that wins the O_EXCL create checks free space and sizes the files.
CREATOR_ONLY = frozenset({"region.space", "region.truncate"})
#: The hosted tiers' own stages (``secondary.p2p.data``, ...): the tiering scheduler builds them.
TIER_POINTS = frozenset(p.name for p in faults.REGISTRY if p.tier is not None)
TIERING_ONLY = frozenset(
    {"scheduler.region", "primary", "secondary", "cleanup.secondary", "cleanup.primary", *TIER_POINTS}
)
_INDEXED_DESCRIPTIONS = {
    "secondary": "tiering scheduler: before secondary tier {index} ({type}) is built",
    "cleanup.secondary": "secondary tier {index} ({type}) reports a shutdown failure; it is still shut down",
}


@dataclass(frozen=True, slots=True)
class PlanStage:
    """One fault point this bring-up reaches: where it runs and what fails there."""

    name: str
    phase: str
    sides: tuple[str, ...]
    creator_only: bool
    description: str


@dataclass(frozen=True, slots=True)
class PlannedFile:
    path: Path
    segment: int
    offset: int
    bytes: int


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Worker ``rank``'s bytes ``[offset, offset + bytes)`` of every row, and what it pre-faults."""

    rank: int
    offset: int
    bytes: int
    populate_bytes: int


@dataclass(frozen=True, slots=True)
class SlotLayout:
    rows: int
    row_bytes: int
    slot_bytes: int
    copies: int
    padding: int
    slots: tuple[WorkerSlot, ...]
    scheduler_populate_bytes: int


@dataclass(frozen=True, slots=True)
class TierPlan:
    """A tier in creation order: the primary (CPU, the region) first, then each secondary."""

    role: str
    index: int
    type: str
    chunks: int
    bytes: int | None
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Geometry:
    """The model-side inputs vLLM takes from the loaded model, and the config's budget."""

    cpu_bytes_to_use: int
    worker_kv_bytes_per_block: int
    gpu_block_size: int
    blocks_per_chunk: int
    replicated_layout: bool


@dataclass(frozen=True, slots=True)
class Capacity:
    """Free bytes of the root against what the region needs; ``fix`` when it does not fit."""

    root: Path
    mount_point: Path
    fs_type: str | None
    mount_bytes: int
    used_bytes: int
    free_bytes: int
    needed_bytes: int
    fits: bool
    fix: str | None


class CapacityError(RootError):
    """The root has less free space than what is about to be allocated; nothing was started.

    ``capacity`` is the same pre-flight the dry-run plan prints, ``fix`` its exact remedy.
    """

    def __init__(self, capacity: Capacity, what: str) -> None:
        fs = f" ({capacity.fs_type})" if capacity.fs_type else ""
        super().__init__(
            capacity.root,
            f"{size_text(capacity.free_bytes)} free of {size_text(capacity.mount_bytes)}{fs}, "
            f"{what} needs {size_text(capacity.needed_bytes)}: it does not fit; nothing was started",
            fix=capacity.fix,
        )
        self.capacity = capacity


@dataclass(frozen=True, slots=True)
class InitPlan:
    schema_version: int
    engine_id: str
    spec: str
    root: Path
    lifetime: str
    world_size: int
    participants: tuple[str, ...]
    region_participants: int
    path_lifetime: str
    geometry: Geometry
    sizing: OffloadingSizing
    files: tuple[PlannedFile, ...]
    layout: SlotLayout
    tiers: tuple[TierPlan, ...]
    stages: tuple[PlanStage, ...]
    capacity: Capacity
    huge_pages: HugePages
    warnings: tuple[str, ...]

    def stage(self, name: str) -> PlanStage | None:
        for s in self.stages:
            if s.name == name:
                return s
        return None


def check_world_size(world_size: int) -> int:
    """``world_size`` if one engine can have that many workers, else ``ConfigError``.

    Checked before anything is planned: every figure of the plan and every process of a
    bring-up is per worker.
    """
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            "--world-size",
            f"{world_size} is more than the {MAX_WORLD_SIZE} workers one engine can have",
            fix=f"give one engine's tensor x pipeline parallel size, at most {MAX_WORLD_SIZE}; "
            "data-parallel ranks are engines of their own, so rehearse one of them",
        )
    return world_size


def participant_names(world_size: int) -> tuple[str, ...]:
    """Every process of an engine, in vLLM's creation order: the workers, then the scheduler."""
    return (*(f"{WORKER} {r}" for r in range(world_size)), SCHEDULER)


def plan_stages(config: OffloadingSettings) -> tuple[PlanStage, ...]:
    """The registry's points this spec and tier list reach, in stage order; ``secondary.N`` expanded."""
    tiering = config.is_tiering
    tiers = len(config.secondary_tiers)
    stages: list[PlanStage] = []
    kinds = [str(tier.get("type", "?")) for tier in config.secondary_tiers]
    for point in faults.REGISTRY:
        if point.name in TIERING_ONLY and not tiering:
            continue
        if point.tier is not None:
            # A hosted tier's own stage: planned where a tier of its type is configured.
            where = [str(i) for i, kind in enumerate(kinds) if kind == point.tier]
            if where:
                description = f"secondary tier {', '.join(where)}: {point.description}"
                stages.append(PlanStage(point.name, point.phase, (SCHEDULER,), False, description))
            continue
        sides = stage_sides(point.name, tiering)
        if point.name in faults.INDEXED:
            template = _INDEXED_DESCRIPTIONS.get(point.name, point.description + " (tier {index}, {type})")
            for index in range(tiers):
                kind = config.secondary_tiers[index].get("type", "?")
                description = template.format(index=index, type=kind)
                stages.append(PlanStage(f"{point.name}.{index}", point.phase, sides, False, description))
            continue
        stages.append(
            PlanStage(point.name, point.phase, sides, point.name in CREATOR_ONLY, point.description)
        )
    return tuple(stages)


def stage_sides(name: str, tiering: bool) -> tuple[str, ...]:
    """Which kind of participant reaches point ``name`` (a point we cannot place: both)."""
    if name in TIER_POINTS:
        return (SCHEDULER,)
    base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
    if base in _REGION_POINTS or base == "cleanup.region":
        return (WORKER, SCHEDULER) if tiering else (WORKER,)
    return _SIDES.get(base, (WORKER, SCHEDULER))


def plan(config: OffloadingSettings) -> InitPlan:
    """Everything ``bring_up(config)`` would allocate and run; allocates nothing.

    Raises ``ConfigError`` when the world size is beyond ``MAX_WORLD_SIZE`` or the budget is
    smaller than one chunk (the worker would refuse an empty region), ``RootError`` when the
    root cannot hold files at all.
    """
    check_world_size(config.world_size)
    sizing = config.sizing
    if sizing.num_chunks <= 0:
        raise ConfigError(
            "kv_connector_extra_config.cpu_bytes_to_use",
            f"{config.cpu_bytes_to_use} bytes is smaller than one chunk of {sizing.kv_bytes_per_chunk} "
            "bytes: the region would be empty",
            fix=f"raise it to at least {sizing.kv_bytes_per_chunk}",
        )
    tiering = config.is_tiering
    segments = plan_segments(
        config.engine_id, sizing.num_chunks, sizing.kv_bytes_per_chunk, 1 if tiering else _cpu_segments()
    )
    files = tuple(PlannedFile(config.root / s.name, s.index, s.offset, s.length) for s in segments)
    layout = _layout(config, sizing)
    region_participants = config.world_size + (1 if tiering else 0)
    warnings = list(config.warnings)
    capacity = check_capacity(config.root, sizing.total_bytes, sizing.kv_bytes_per_chunk)
    cgroup_note = _cgroup_headroom_note(sizing.total_bytes)
    if cgroup_note:
        warnings.append(cgroup_note)
    return InitPlan(
        schema_version=SCHEMA_VERSION,
        engine_id=config.engine_id,
        spec=config.spec_name,
        root=config.root,
        lifetime=config.lifetime,
        world_size=config.world_size,
        participants=participant_names(config.world_size),
        region_participants=region_participants,
        path_lifetime=_path_lifetime(config, region_participants),
        geometry=Geometry(
            cpu_bytes_to_use=config.cpu_bytes_to_use,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            gpu_block_size=config.gpu_block_size,
            blocks_per_chunk=config.blocks_per_chunk,
            replicated_layout=config.replicated_layout,
        ),
        sizing=sizing,
        files=files,
        layout=layout,
        tiers=_tiers(config, sizing),
        stages=plan_stages(config),
        capacity=capacity,
        huge_pages=check_huge_pages(config.root, region_bytes=sizing.total_bytes),
        warnings=tuple(warnings),
    )


def _cpu_segments() -> int:
    from kvoffload.cpu.spec import CPUOffloadingSpec

    return CPUOffloadingSpec.region_segments


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout(config: OffloadingSettings, sizing: OffloadingSizing) -> SlotLayout:
    rows, stride, slot = sizing.num_chunks, sizing.kv_bytes_per_chunk, sizing.cpu_page_size_per_worker
    slots = []
    for rank in range(config.world_size):
        if config.replicated_layout:
            # Every worker maps slot 0; each pre-faults one page-rounded share of the region.
            share = _round_up(-(-sizing.total_bytes // config.world_size), PAGESIZE)
            start = min(sizing.total_bytes, rank * share)
            populate = min(sizing.total_bytes, start + share) - start
            slots.append(WorkerSlot(rank, 0, slot, populate))
            continue
        lo, hi = rank * slot, (rank + 1) * slot
        # Page-rounded per row; consecutive rows never overlap because hi <= stride.
        per_row = _round_up(hi, PAGESIZE) - lo // PAGESIZE * PAGESIZE
        slots.append(WorkerSlot(rank, lo, slot, rows * per_row))
    return SlotLayout(
        rows=rows,
        row_bytes=stride,
        slot_bytes=slot,
        copies=sizing.num_copies,
        padding=sizing.row_padding,
        slots=tuple(slots),
        scheduler_populate_bytes=sizing.total_bytes if config.is_tiering else 0,
    )


def _tiers(config: OffloadingSettings, sizing: OffloadingSizing) -> tuple[TierPlan, ...]:
    if not config.is_tiering:
        return ()
    primary = TierPlan(
        "primary",
        0,
        "cpu",
        sizing.num_chunks,
        sizing.total_bytes,
        {"eviction_policy": config.eviction_policy},
    )
    secondaries = tuple(
        TierPlan(
            "secondary",
            i,
            str(tier.get("type", "?")),
            sizing.num_chunks,
            None,
            {k: v for k, v in tier.items() if k != "type"},
        )
        for i, tier in enumerate(config.secondary_tiers)
    )
    return (primary, *secondaries)


def _path_lifetime(config: OffloadingSettings, participants: int) -> str:
    if not config.is_tiering:
        return (
            f"unlinked by its creator once all {config.world_size} worker(s) have mapped it "
            "(barrier, as vLLM 0.33's CPU spec does)"
        )
    if config.lifetime == "vllm":
        return (
            "kept while the engine lives; its creator unlinks it at graceful shutdown "
            "(vLLM 0.33's tiering lifetime: a crash after startup leaves it behind)"
        )
    return (
        f"unlinked once all {participants} participants ({config.world_size} worker(s) and the "
        "scheduler) have mapped it (attach ledger)"
    )


# ----------------------------------------------------------------- capacity


def check_capacity(root: Path, needed: int, chunk_bytes: int) -> Capacity:
    """Free bytes of ``root`` (``statvfs``, as the creator checks) against ``needed``."""
    try:
        st = os.statvfs(root)
    except FileNotFoundError:
        raise RootError(root, "does not exist", fix="create it or pass another --root") from None
    except OSError as e:
        raise RootError(root, f"cannot be inspected: {e.strerror}") from None
    if not root.is_dir():
        raise RootError(root, "is not a directory", fix="pass the shm mount point")
    free = st.f_bavail * st.f_frsize
    size = st.f_blocks * st.f_frsize
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    info = mounts.root_mount(root)
    mount_point, fs_type = (
        (Path(os.path.realpath(root)), None) if info is None else (info.mount_point, info.fs_type)
    )
    fits = free >= needed
    fix = None if fits else _fix(root, mount_point, fs_type, size, used, free, needed, chunk_bytes)
    return Capacity(root, mount_point, fs_type, size, used, free, needed, fits, fix)


def require_room(the_plan: InitPlan, what: str = "the region") -> None:
    """Refuse a bring-up whose region the root cannot hold, before any process or file exists.

    The rule is the dry run's own (``the_plan.capacity``, one ``statvfs`` as vLLM's creator
    checks it), so ``--dry-run`` saying "does not fit" and a real bring-up refusing to start
    never disagree. Without it a real bring-up started every worker and met vLLM's own check
    (``InsufficientSpaceError`` at region creation) seconds later, with a fault aimed past
    that point reported as not fired. That check stays vLLM's, in the region; this one is
    the rehearsal's, in front of it.
    """
    if not the_plan.capacity.fits:
        raise CapacityError(the_plan.capacity, what)


def size_text(n: int) -> str:
    """Bytes for a message: GiB from 1 GiB up, MiB below."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _size_arg(n: int, big: str, small: str) -> str:
    return f"{math.ceil(n / GIB)}{big}" if n >= GIB else f"{math.ceil(n / MIB)}{small}"


def _fix(
    root: Path, mount: Path, fs_type: str | None, size: int, used: int, free: int, needed: int, chunk: int
) -> str:
    """The remedies for a region that does not fit, most specific first, as many as two lines
    of a terminal hold (``kvoffload.fixes.fit``); docs/doctor.md#space has every one."""
    want = used + needed
    remedies = []
    if used > 0 and needed <= size:
        # Space already taken may be dead engines' regions, the very leak this tool is for
        # (where the mount could hold the region once empty: else only a bigger one helps).
        remedies.append(f"remove orphaned regions: shmctl reap --root {shlex.quote(str(root))}")
    if size == DOCKER_DEFAULT_SHM or mount == DEFAULT_ROOT:
        default = " (64 MiB is Docker's default)" if size == DOCKER_DEFAULT_SHM else ""
        remedies.append(f"docker run --shm-size={_size_arg(want, 'g', 'm')}{default}")
    if mount == DEFAULT_ROOT:
        remedies.append(f"a pod's emptyDir sizeLimit: {_size_arg(want, 'Gi', 'Mi')}")
    if fs_type == "tmpfs":
        remedies.append(f"mount -o remount,size={_size_arg(want, 'G', 'M')} {shlex.quote(str(mount))}")
    largest = free // chunk * chunk if chunk > 0 else 0
    if largest > 0:
        remedies.append(f"cpu_bytes_to_use at most {largest}")
    return fit(remedies, "space")


def _cgroup_headroom_note(needed: int, cgroup: Path = Path("/sys/fs/cgroup")) -> str | None:
    """tmpfs pages are charged to the memory cgroup: warn when the region alone exceeds its room.

    Like vLLM, never a rejection: the limit may be raised before the engine starts.
    """
    try:
        limit_text = (cgroup / "memory.max").read_text().strip()
        current = int((cgroup / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit_text == "max":
        return None
    try:
        limit = int(limit_text)
    except ValueError:
        return None
    room = limit - current
    if needed <= room:
        return None
    return (
        f"the region ({needed} bytes) exceeds this cgroup's memory headroom ({max(room, 0)} of {limit} "
        "bytes): shm pages are charged to the cgroup, so populating it would invite the OOM killer"
    )
