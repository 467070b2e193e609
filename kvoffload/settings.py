"""Offloading settings: vLLM's ``--kv-transfer-config`` checked and frozen, and the sizing vLLM derives.

Everything here is checked before anything is allocated: a bad value raises
``ConfigError`` naming the key and the fix. Keys we do not know are kept and reported
as warnings, never errors: vLLM passes extra keys through to out-of-tree specs and
tiers, and real configs carry them.

Sizing follows vLLM 0.33 (``cpu/spec.py``) exactly:

    copies               = 1 if replicated_layout else world_size
    bytes_per_chunk      = worker_kv_bytes_per_block * copies * blocks_per_chunk
    cpu_page_size_per_worker = bytes_per_chunk // copies
    kv_bytes_per_chunk   = round_up(bytes_per_chunk, PAGESIZE)
    num_chunks           = cpu_bytes_to_use // kv_bytes_per_chunk

Every number has a sane maximum (``MAX_CPU_BYTES`` and the like), so no arithmetic on it
later can overflow a float, a C long or a sleep. The document itself is read, bounded, by
``kvoffload.kv_transfer_config``; vLLM's dataclasses these settings convert to and from are
in ``kvoffload.config``.

Where this sits: it asks the policy and tier registries (``kvoffload.cpu.policies``,
``kvoffload.tiering.factory``) whether a named policy or tier exists, so nothing they import
may import this module; the specs (``cpu/spec.py``, ``tiering/spec.py``) and the engine read
it from above. ``tests/settings/test_import_graph.py`` holds kvoffload's imports to a graph
without a cycle.
"""

from __future__ import annotations

import math
import mmap
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvoffload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvoffload.cpu.policies import KNOWN_POLICIES
from kvoffload.errors import ConfigError
from kvoffload.kv_transfer_config import DIGITS_FIX, parse_kv_transfer_config
from kvoffload.shm.names import DEFAULT_ROOT, validate_engine_id
from kvoffload.tiering.factory import SecondaryTierFactory

PAGESIZE = mmap.PAGESIZE
SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
#: vLLM's ``_REGION_SEGMENTS``: the CPU spec splits regions of >= 2 GiB into up to this many files.
CPU_SPEC_SEGMENTS = 32

_TOP_LEVEL_KEYS = frozenset(
    {
        "kv_connector",
        "engine_id",
        "kv_role",
        "kv_rank",
        "kv_parallel_size",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_ip",
        "kv_port",
        "kv_connector_extra_config",
        "kv_connector_module_path",
        "enable_permute_local_kv",
        "kv_load_failure_policy",
    }
)
_EXTRA_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "cpu_bytes_to_use",
        "block_size",
        "blocks_per_chunk",
        "eviction_policy",
        "cache_policy_module_path",
        "store_threshold",
        "max_tracker_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "secondary_tiers",
        "tier_poll_interval_s",
        "backpressure",
    }
)

#: 1 EiB: more memory than any host has, and far below the attach ledger's lock offset
#: (``1 << 62``) and ``off_t``, so every size derived from it is representable.
MAX_CPU_BYTES = 1 << 60
#: A chunk of a million GPU blocks is already far past any real chunk.
MAX_BLOCKS_PER_CHUNK = 1 << 20
#: Counts (tracked blocks, sightings before a store) beyond 2**32 mean nothing.
MAX_COUNT = 1 << 32
#: An hour between polls of the secondary tiers is already no polling (and Event.wait
#: overflows far past it).
MAX_TIER_POLL_INTERVAL_S = 3600.0

Lifetime = Literal["kvoffload", "vllm"]
#: ASCII digits only: ``str.isdigit()`` is also true of '²', which ``int()`` refuses.
_DIGITS = re.compile(r"[0-9]+")
#: What ``int()`` reads that is plainly a whole number: an optional sign, then ASCII digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True, slots=True)
class OffloadingSizing:
    """The figures vLLM derives from the config and the model, under vLLM's names."""

    num_copies: int
    cpu_page_size_per_worker: int
    kv_bytes_per_chunk: int
    num_chunks: int
    total_bytes: int
    row_padding: int

    @classmethod
    def compute(
        cls,
        cpu_bytes_to_use: int,
        worker_kv_bytes_per_block: int,
        blocks_per_chunk: int,
        world_size: int,
        replicated_layout: bool,
        page_size: int = PAGESIZE,
    ) -> OffloadingSizing:
        if worker_kv_bytes_per_block <= 0 or world_size <= 0:
            return cls(0, 0, 0, 0, 0, 0)
        copies = 1 if replicated_layout else world_size
        bytes_per_chunk = worker_kv_bytes_per_block * copies * blocks_per_chunk
        per_worker = bytes_per_chunk // copies
        kv_bytes_per_chunk = -(-bytes_per_chunk // page_size) * page_size
        num_chunks = cpu_bytes_to_use // kv_bytes_per_chunk
        return cls(
            num_copies=copies,
            cpu_page_size_per_worker=per_worker,
            kv_bytes_per_chunk=kv_bytes_per_chunk,
            num_chunks=num_chunks,
            total_bytes=num_chunks * kv_bytes_per_chunk,
            row_padding=kv_bytes_per_chunk - bytes_per_chunk,
        )


@dataclass(frozen=True, slots=True)
class OffloadingSettings:
    """One engine's offloading configuration plus the geometry vLLM takes from the model."""

    engine_id: str
    spec_name: str
    cpu_bytes_to_use: int
    worker_kv_bytes_per_block: int
    world_size: int = 1
    rank: int = 0
    gpu_block_size: int = 16
    blocks_per_chunk: int = 1
    replicated_layout: bool = False
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    canonical_layout: bool = False
    secondary_tiers: tuple[Mapping[str, Any], ...] = ()
    tier_poll_interval_s: float = 0.001
    root: Path = DEFAULT_ROOT
    lifetime: Lifetime = "kvoffload"
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def sizing(self) -> OffloadingSizing:
        return OffloadingSizing.compute(
            self.cpu_bytes_to_use,
            self.worker_kv_bytes_per_block,
            self.blocks_per_chunk,
            self.world_size,
            self.replicated_layout,
        )

    @property
    def is_tiering(self) -> bool:
        return self.spec_name == "TieringOffloadingSpec"

    def for_rank(self, rank: int) -> OffloadingSettings:
        """The same engine as seen by worker ``rank``."""
        _check_range("rank", rank, 0, self.world_size - 1)
        return _replace(self, rank=rank)

    @classmethod
    def from_kv_transfer_config(
        cls,
        kv_transfer_config: str | Mapping[str, Any],
        *,
        worker_kv_bytes_per_block: int,
        world_size: int = 1,
        rank: int = 0,
        gpu_block_size: int = 16,
        replicated_layout: bool = False,
        root: Path | str = DEFAULT_ROOT,
        lifetime: Lifetime = "kvoffload",
    ) -> OffloadingSettings:
        """Parse vLLM's ``--kv-transfer-config`` (JSON text or an already-parsed mapping)."""
        top = parse_kv_transfer_config(kv_transfer_config)
        warnings = [
            f"unknown key {key!r} in kv_transfer_config (passed through)"
            for key in top
            if key not in _TOP_LEVEL_KEYS
        ]
        connector = top.get("kv_connector")
        if connector is not None and connector != "OffloadingConnector":
            raise ConfigError(
                "kv_connector",
                f"{connector!r} is not OffloadingConnector",
                fix='set "kv_connector": "OffloadingConnector"',
            )
        engine_id = top.get("engine_id")
        if engine_id is None:
            engine_id = str(uuid.uuid4())  # what vLLM does when none is pinned
        elif not isinstance(engine_id, str):
            raise ConfigError("engine_id", f"must be a string, got {type(engine_id).__name__}")
        validate_engine_id(engine_id)
        extra = top.get("kv_connector_extra_config", {})
        if not isinstance(extra, Mapping):
            raise ConfigError("kv_connector_extra_config", "must be a JSON object")
        warnings += [
            f"unknown key {key!r} in kv_connector_extra_config (passed through to the spec)"
            for key in extra
            if key not in _EXTRA_KEYS
        ]

        _check_int("world_size", world_size, minimum=1)
        _check_range("rank", _check_int("rank", rank, minimum=0), 0, world_size - 1)
        _check_int("gpu_block_size", gpu_block_size, minimum=1, maximum=MAX_BLOCKS_PER_CHUNK)
        _check_int("worker_kv_bytes_per_block", worker_kv_bytes_per_block, minimum=1, maximum=MAX_CPU_BYTES)
        if lifetime not in ("kvoffload", "vllm"):
            raise ConfigError("lifetime", f"{lifetime!r} is neither 'kvoffload' nor 'vllm'")

        spec_name = extra.get("spec_name", "CPUOffloadingSpec")
        if spec_name not in SPEC_NAMES:
            hint = (
                " (out-of-tree specs via spec_module_path are not supported here)"
                if "spec_module_path" in extra
                else ""
            )
            raise ConfigError(
                "kv_connector_extra_config.spec_name",
                f"unknown spec {spec_name!r}{hint}",
                fix="use CPUOffloadingSpec or TieringOffloadingSpec",
            )
        cpu_bytes = _cpu_bytes(extra)
        blocks_per_chunk = _blocks_per_chunk(extra, gpu_block_size)
        eviction_policy = _string(extra, "eviction_policy", "lru")
        module_path = extra.get("cache_policy_module_path")
        if module_path is not None and not isinstance(module_path, str):
            raise ConfigError("kv_connector_extra_config.cache_policy_module_path", "must be a string")
        if module_path is None and eviction_policy not in KNOWN_POLICIES:
            raise ConfigError(
                "kv_connector_extra_config.eviction_policy",
                f"unknown eviction policy {eviction_policy!r}",
                fix="use one of: " + ", ".join(KNOWN_POLICIES) + " (or set cache_policy_module_path)",
            )
        store_threshold = _extra_int(extra, "store_threshold", 0, minimum=0, maximum=MAX_COUNT)
        if spec_name == "TieringOffloadingSpec" and store_threshold >= 2:
            raise ConfigError(
                "kv_connector_extra_config.store_threshold",
                "store_threshold is not supported for TieringOffloadingSpec",
                fix="remove store_threshold or set it below 2",
            )
        tiers = _secondary_tiers(extra, spec_name)
        poll = _poll_interval(extra)

        return cls(
            engine_id=engine_id,
            spec_name=spec_name,
            cpu_bytes_to_use=cpu_bytes,
            worker_kv_bytes_per_block=worker_kv_bytes_per_block,
            world_size=world_size,
            rank=rank,
            gpu_block_size=gpu_block_size,
            blocks_per_chunk=blocks_per_chunk,
            replicated_layout=_check_bool("replicated_layout", replicated_layout),
            eviction_policy=eviction_policy,
            cache_policy_module_path=module_path,
            store_threshold=store_threshold,
            max_tracker_size=_extra_int(extra, "max_tracker_size", 64_000, minimum=1, maximum=MAX_COUNT),
            offload_prompt_only=_extra_bool(extra, "offload_prompt_only", True),
            canonical_layout=_extra_bool(extra, "canonical_layout", False),
            secondary_tiers=tiers,
            tier_poll_interval_s=poll,
            root=Path(root),
            lifetime=lifetime,
            extra_config=dict(extra),
            warnings=tuple(warnings),
        )

    @classmethod
    def from_offloading_config(
        cls,
        config: OffloadingConfig,
        *,
        root: Path | str = DEFAULT_ROOT,
        lifetime: Lifetime = "kvoffload",
    ) -> OffloadingSettings:
        """What a spec reads from vLLM's ``OffloadingConfig``, checked.

        vLLM's connector has already chosen the spec, the chunk geometry and the layout, so
        this accepts what vLLM's specs accept (integral strings, which vLLM ``int()``-converts;
        a zero-byte block, which gives an empty cache; any ``spec_name``, out-of-tree ones too)
        and refuses only what they could not use, naming the key and the fix.
        """
        extra = config.extra_config
        if not isinstance(extra, Mapping):
            raise ConfigError("kv_connector_extra_config", "must be a JSON object")
        parallel = config.parallel
        world_size = _check_int("parallel.world_size", parallel.world_size, minimum=1)
        rank = _check_range(
            "parallel.rank", _check_int("parallel.rank", parallel.rank, minimum=0), 0, world_size - 1
        )
        module_path = extra.get("cache_policy_module_path")
        if module_path is not None and not isinstance(module_path, str):
            raise ConfigError("kv_connector_extra_config.cache_policy_module_path", "must be a string")
        tiers = extra.get("secondary_tiers", [])
        if not isinstance(tiers, list) or not all(isinstance(t, Mapping) for t in tiers):
            raise ConfigError(
                "kv_connector_extra_config.secondary_tiers",
                "secondary_tiers must be a list of tier configurations",
                fix='give a JSON list of objects, each with a "type"',
            )
        if lifetime not in ("kvoffload", "vllm"):
            raise ConfigError("lifetime", f"{lifetime!r} is neither 'kvoffload' nor 'vllm'")
        return cls(
            engine_id=validate_engine_id(config.engine_id),
            spec_name=str(extra.get("spec_name", "CPUOffloadingSpec")),
            cpu_bytes_to_use=_cpu_bytes(extra),
            worker_kv_bytes_per_block=_check_int(
                "worker_kv_bytes_per_block",
                config.worker_kv_bytes_per_block,
                minimum=0,
                maximum=MAX_CPU_BYTES,
            ),
            world_size=world_size,
            rank=rank,
            gpu_block_size=config.groups[0].tokens_per_block if config.groups else 16,
            blocks_per_chunk=_check_int(
                "cache.blocks_per_chunk",
                config.cache.blocks_per_chunk,
                minimum=1,
                maximum=MAX_BLOCKS_PER_CHUNK,
            ),
            replicated_layout=_check_bool("replicated_layout", config.replicated_layout),
            eviction_policy=_string(extra, "eviction_policy", "lru"),
            cache_policy_module_path=module_path,
            store_threshold=_extra_int(extra, "store_threshold", 0, minimum=0, maximum=MAX_COUNT),
            max_tracker_size=_extra_int(extra, "max_tracker_size", 64_000, minimum=1, maximum=MAX_COUNT),
            offload_prompt_only=_extra_bool(extra, "offload_prompt_only", True),
            canonical_layout=_check_bool("canonical_layout", config.canonical_layout),
            secondary_tiers=tuple(dict(t) for t in tiers),
            tier_poll_interval_s=_poll_interval(extra),
            root=Path(root),
            lifetime=lifetime,
            extra_config=dict(extra),
        )

    def to_offloading_config(self) -> OffloadingConfig:
        """This engine as vLLM's connector would describe it to a spec.

        ``from_offloading_config`` reads it back to these settings: the settings' own values
        replace whatever ``extra_config`` said, so a ``dataclasses.replace`` is not lost.
        """
        extra = dict(self.extra_config)
        extra.update(
            spec_name=self.spec_name,
            cpu_bytes_to_use=self.cpu_bytes_to_use,
            eviction_policy=self.eviction_policy,
            store_threshold=self.store_threshold,
            max_tracker_size=self.max_tracker_size,
            offload_prompt_only=self.offload_prompt_only,
            canonical_layout=self.canonical_layout,
            secondary_tiers=[dict(t) for t in self.secondary_tiers],
            tier_poll_interval_s=self.tier_poll_interval_s,
        )
        if self.cache_policy_module_path is None:
            extra.pop("cache_policy_module_path", None)
        else:
            extra["cache_policy_module_path"] = self.cache_policy_module_path
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(self.gpu_block_size, (), 0),),
            worker_kv_bytes_per_block=self.worker_kv_bytes_per_block,
            enable_kv_cache_events=False,
            extra_config=extra,
            engine_id=self.engine_id,
            model=OffloadingModelConfig(name="", dtype="int8"),
            cache=OffloadingCacheConfig(
                tokens_per_hash=self.gpu_block_size, blocks_per_chunk=self.blocks_per_chunk
            ),
            parallel=OffloadingParallelConfig.tensor_parallel(self.rank, self.world_size),
            replicated_layout=self.replicated_layout,
            canonical_layout=self.canonical_layout,
        )


def _replace(config: OffloadingSettings, **changes: Any) -> OffloadingSettings:
    import dataclasses

    return dataclasses.replace(config, **changes)


def _shown(value: float) -> str:
    """``value`` for an error message: ``str()`` of an int past 4300 digits raises ValueError."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit number"
    return str(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_int(key: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(
            key, f"must be at most {maximum}, got {_shown(value)}", fix=f"use at most {maximum}"
        )
    return value


def _check_range(key: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ConfigError(key, f"{_shown(value)} is outside {low}..{high}")
    return value


def _check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _extra_int(
    extra: Mapping[str, Any], key: str, default: int, *, minimum: int, maximum: int | None = None
) -> int:
    """``extra[key]`` as vLLM's ``int()`` reads it: an integer, an integral float or a string of
    ASCII digits; anything else is refused with the key and the fix, on one line."""
    name = f"kv_connector_extra_config.{key}"
    value = extra.get(key, default)
    if isinstance(value, float) and _finite(value) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        text = value.strip()
        if len(text.lstrip("+-").lstrip("0")) > 20:  # int() refuses past sys.get_int_max_str_digits()
            raise ConfigError(name, f"is a {len(text)}-digit number", fix=DIGITS_FIX)
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
        raise ConfigError(
            name,
            f"must be a whole number, got {shown}",
            fix=f'write it as a number, e.g. "{key}": {max(default, minimum)}',
        )
    return _check_int(name, value, minimum=minimum, maximum=maximum)


def _extra_bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    return _check_bool(f"kv_connector_extra_config.{key}", extra.get(key, default))


def _string(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kv_connector_extra_config.{key}", f"must be a non-empty string, got {value!r}")
    return value


def _poll_interval(extra: Mapping[str, Any]) -> float:
    key = "kv_connector_extra_config.tier_poll_interval_s"
    poll = extra.get("tier_poll_interval_s", 0.001)
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not _finite(poll):
        raise ConfigError(key, "must be a number of seconds", fix='e.g. "tier_poll_interval_s": 0.001')
    if poll > MAX_TIER_POLL_INTERVAL_S:
        raise ConfigError(
            key,
            f"must be at most {MAX_TIER_POLL_INTERVAL_S:g} seconds, got {_shown(poll)}",
            fix="poll the secondary tiers at least once an hour (vLLM's default is 0.001)",
        )
    return float(poll)


def _cpu_bytes(extra: Mapping[str, Any]) -> int:
    key = "kv_connector_extra_config.cpu_bytes_to_use"
    value = extra.get("cpu_bytes_to_use")
    if value is None or value in (0, ""):
        raise ConfigError(
            key,
            "cpu_bytes_to_use must be specified in kv_connector_extra_config",
            fix='add "cpu_bytes_to_use": <bytes> (the total across all workers)',
        )
    if isinstance(value, bool):
        raise ConfigError(key, f"must be a number of bytes, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    too_large = f"must be at most {MAX_CPU_BYTES} bytes (1 EiB)"
    too_large_fix = "give the bytes of CPU memory to use, the total across all workers"
    if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        digits = value.strip().lstrip("0") or "0"
        if len(digits) > 20:  # int() refuses past sys.get_int_max_str_digits()
            raise ConfigError(key, f"{too_large}, got a {len(digits)}-digit number", fix=too_large_fix)
        value = int(digits)  # vLLM int()-converts it
    if not isinstance(value, int):
        raise ConfigError(key, f"must be a whole number of bytes, got {value!r}")
    if value <= 0:
        raise ConfigError(key, f"must be positive, got {_shown(value)}")
    if value > MAX_CPU_BYTES:
        raise ConfigError(key, f"{too_large}, got {_shown(value)}", fix=too_large_fix)
    return value


def _blocks_per_chunk(extra: Mapping[str, Any], gpu_block_size: int) -> int:
    # None is absent, as in vLLM's connector.
    has_block_size = extra.get("block_size") is not None
    has_bpc = extra.get("blocks_per_chunk") is not None
    if has_block_size and has_bpc:
        raise ConfigError(
            "kv_connector_extra_config.block_size",
            "block_size and blocks_per_chunk are mutually exclusive",
            fix="keep one of them",
        )
    if has_bpc:
        return _extra_int(extra, "blocks_per_chunk", 1, minimum=1, maximum=MAX_BLOCKS_PER_CHUNK)
    if has_block_size:
        block_size = _extra_int(
            extra, "block_size", gpu_block_size, minimum=1, maximum=gpu_block_size * MAX_BLOCKS_PER_CHUNK
        )
        if block_size % gpu_block_size:
            raise ConfigError(
                "kv_connector_extra_config.block_size",
                f"{block_size} is not a multiple of the GPU block size {gpu_block_size}",
                fix=f"use a multiple of {gpu_block_size}",
            )
        return block_size // gpu_block_size
    return 1


def _secondary_tiers(extra: Mapping[str, Any], spec_name: str) -> tuple[Mapping[str, Any], ...]:
    key = "kv_connector_extra_config.secondary_tiers"
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ConfigError(key, "secondary_tiers must be a list of tier configurations")
    if tiers and spec_name != "TieringOffloadingSpec":
        raise ConfigError(
            key, "secondary tiers need TieringOffloadingSpec", fix='set "spec_name": "TieringOffloadingSpec"'
        )
    if not tiers:
        return ()
    checked = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise ConfigError(f"{key}[{i}]", "must be a JSON object with a 'type'")
        SecondaryTierFactory.get_tier_class(tier, index=i)
        checked.append(dict(tier))
    return tuple(checked)
