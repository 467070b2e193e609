"""The regions ``shmctl doctor`` checks the root's room against: ``--plan`` and ``--need``.

``--plan FILE`` is an engine's configuration, sized by the same plan ``shmctl init --dry-run``
prints (``kvoffload.bringup.plan``); ``--need BYTES`` is a size as tmpfs's ``size=`` takes it.
Both become a ``PlannedRegion``; a wrong file, geometry or size is a ``ConfigError`` naming the
option.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.doctor.facts import PlannedRegion
from kvoffload.errors import ConfigError
from kvoffload.shm import mounts
from kvoffload.shm.names import DEFAULT_ROOT

if TYPE_CHECKING:
    from kvoffload.settings import OffloadingSettings


def planned_from_config(config: OffloadingSettings, source: str) -> PlannedRegion:
    """The region ``config`` would allocate, sized by the same plan ``shmctl init --dry-run`` prints."""
    from kvoffload.bringup.plan import plan

    the_plan = plan(config)
    return PlannedRegion(
        source, the_plan.engine_id, the_plan.sizing.total_bytes, the_plan.sizing.kv_bytes_per_chunk
    )


def planned_from_files(
    files: Iterable[Path],
    *,
    kv_bytes_per_block: int | None,
    model: str | None,
    world_size: int = 1,
    gpu_block_size: int = 16,
    root: Path = DEFAULT_ROOT,
) -> list[PlannedRegion]:
    """Each engine config file (``init --config``'s JSON or TOML) as the region it would allocate.

    The geometry (``kv_bytes_per_block`` or a ``model`` preset, world size, block size) is
    the same for every file; ``ConfigError`` when a file or the geometry is wrong.
    """
    files = list(files)
    if not files:
        return []
    from kvoffload.bringup.inputs import load_config

    planned = []
    for file in files:
        try:
            config = load_config(
                kv_transfer_config=None,
                config_file=file,
                kv_bytes_per_block=kv_bytes_per_block,
                model=model,
                world_size=world_size,
                gpu_block_size=gpu_block_size,
                root=root,
            )
        except ConfigError as e:
            if e.key != "--config":
                raise
            # The reader is init's, which names its option --config: name ours.
            message = e.message.removeprefix(f"{e.key}: ")
            raise ConfigError("--plan", message, fix=e.fix) from None
        planned.append(planned_from_config(config, str(file)))
    return planned


def planned_bytes(text: str, *, option: str = "--need") -> PlannedRegion:
    """``--need 40g``: bytes, or a number with k, m, g, t (powers of 1024) as tmpfs's size= takes."""
    size = mounts.parse_size(text)
    if size is None or size <= 0:
        raise ConfigError(
            option,
            f"{text!r} is not a size in bytes",
            fix=f"bytes, or a number with k, m, g or t (powers of 1024): {option} 40g",
        )
    return PlannedRegion(option, None, size, 0)
