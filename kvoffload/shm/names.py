"""Region file names, exactly as vLLM spells them.

vLLM names the region ``vllm_offload_{engine_id}.mmap`` and segment ``i >= 1``
``vllm_offload_{engine_id}.mmap.{i}`` (at most 32 files, so segments 1..31). The
engine id is any string: a uuid4, a user-pinned id, ``{id}_dp{N}`` under data
parallelism, legacy ``{time_ns}_dp{N}`` and ``hisparse_{time_ns}..._dp{N}``.
``vllm_ec_*.mmap`` belongs to another subsystem and never matches.

Invariant: ``parse(format_name(e, s)) == RegionName(e, s)`` for every valid engine id.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ConfigError

#: Where vLLM puts region files, and where every shmctl command looks unless told otherwise.
DEFAULT_ROOT = Path("/dev/shm")
PREFIX = "vllm_offload_"
SUFFIX = ".mmap"
#: vLLM's ``_REGION_SEGMENTS``: a region is at most this many files.
MAX_SEGMENTS = 32
NAME_MAX = 255

_PATTERN = re.compile(r"vllm_offload_(?P<id>.+?)\.mmap(?:\.(?P<seg>[1-9][0-9]?))?", re.DOTALL)
_DP_SUFFIX = re.compile(r"_dp(?P<dp>[0-9]+)$")
_TIME_NS = re.compile(r"(?:hisparse_)?(?P<ns>[0-9]{19})(?:_dp[0-9]+)*$")


@dataclass(frozen=True, slots=True)
class RegionName:
    """A parsed region file name: the engine id and the segment (0 = base file)."""

    engine_id: str
    segment: int = 0

    # A parsed name exists on disk already; it must read back even when the engine id
    # could not name every segment (a 255-byte ``.mmap.1`` name has no ``.mmap.31`` sibling).
    @property
    def name(self) -> str:
        return format_name(self.engine_id, self.segment, _check=False)

    @property
    def base_name(self) -> str:
        return format_name(self.engine_id, 0, _check=False)

    @property
    def dp_rank(self) -> int | None:
        """The data-parallel rank vLLM appended as ``_dpN``, if any."""
        m = _DP_SUFFIX.search(self.engine_id)
        return int(m.group("dp")) if m else None

    @property
    def flavour(self) -> str:
        """``hisparse``, ``legacy`` (time_ns id) or ``engine`` (uuid or pinned id)."""
        if self.engine_id.startswith("hisparse_"):
            return "hisparse"
        return "legacy" if _TIME_NS.fullmatch(self.engine_id) else "engine"

    @property
    def created_ns_hint(self) -> int | None:
        """Legacy and HiSparse ids embed ``time.time_ns()`` at creation: a hint, not evidence."""
        m = _TIME_NS.fullmatch(self.engine_id)
        return int(m.group("ns")) if m else None


def validate_engine_id(engine_id: str) -> str:
    """Return ``engine_id`` if it can name a region file, else raise ``ConfigError``."""
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError("engine_id", "must be a non-empty string", fix="set kv_transfer_config.engine_id")
    if "/" in engine_id or "\0" in engine_id:
        raise ConfigError(
            "engine_id", f"{engine_id!r} contains '/' or NUL", fix="use letters, digits, '-' and '_'"
        )
    longest = format_name(engine_id, MAX_SEGMENTS - 1, _check=False)
    try:
        encoded = longest.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        # A lone surrogate outside U+DC80..U+DCFF (JSON's "\ud800") has no bytes on disk.
        raise ConfigError(
            "engine_id", f"{engine_id!r} is not valid Unicode text", fix="use letters, digits, '-' and '_'"
        ) from None
    if len(encoded) > NAME_MAX:
        raise ConfigError(
            "engine_id", f"too long: file names would exceed {NAME_MAX} bytes", fix="use a shorter engine_id"
        )
    return engine_id


def format_name(engine_id: str, segment: int = 0, *, _check: bool = True) -> str:
    """The file name of ``segment`` (0 = base) of engine ``engine_id``'s region."""
    if _check:
        validate_engine_id(engine_id)
        if not 0 <= segment < MAX_SEGMENTS:
            raise ConfigError("segment", f"{segment} is outside 0..{MAX_SEGMENTS - 1}")
    base = f"{PREFIX}{engine_id}{SUFFIX}"
    return base if segment == 0 else f"{base}.{segment}"


def parse(name: str) -> RegionName | None:
    """Parse a directory entry name; ``None`` when it is not a region file of ours."""
    m = _PATTERN.fullmatch(name)
    if m is None:
        return None
    seg = int(m.group("seg")) if m.group("seg") else 0
    engine_id = m.group("id")
    if seg >= MAX_SEGMENTS or "/" in engine_id or "\0" in engine_id:
        return None
    return RegionName(engine_id, seg)


def engine_ids(root: str | os.PathLike[str], prefix: str = "") -> list[str]:
    """The engine ids of ``root``'s region files that start with ``prefix``, sorted: what a Tab
    after ``--engine`` offers. One directory listing; a root that cannot be listed offers none."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    parsed = (parse(entry) for entry in entries)
    return sorted(
        {p.engine_id for p in parsed if p is not None and p.segment == 0 and p.engine_id.startswith(prefix)}
    )
