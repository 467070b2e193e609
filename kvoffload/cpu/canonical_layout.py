"""The canonical CPU layout: KV pages whose bytes do not depend on how the model is sharded.

Under ``canonical_layout`` every worker sees the same CPU page per block (the region's
canonical view), and each layer's ``CanonicalPageMapping`` says where this worker's bytes go
in it: runs of ``num_fragments`` fragments of ``fragment_size`` bytes, ``local_stride`` apart
in the worker's GPU page and ``canonical_stride`` apart in the canonical page. Ranks that hold
different heads scatter into disjoint fragments of one page, so a reader at another tensor
parallel size gathers its own heads from the same bytes.

Ranks that hold the same bytes (``num_writers > 1``) take turns: on a store a rank writes only
the pages whose canonical page id (``chunk * blocks_per_chunk + sub-block``, the same number on
every rank) is ``writer_index`` modulo ``num_writers``. Loads read every page.

vLLM unrolls each mapping into one copy descriptor per fragment (``CopyPlan``, kept here with
its numbers for the byte counts and for vLLM's tests). kvoffload copies a run of consecutive
blocks and one mapping run at a time as one strided ``copy_`` (``copy_canonical_runs``): the
same bytes, fewer calls, on CPU and CUDA tensors alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvoffload.base import CanonicalKVCacheRef, CanonicalPageMapping, CopyRun
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

    from kvoffload.cpu.block_copy import BlockCopyPlan


class CopyPlan(NamedTuple):
    """One layer's mapping unrolled into fragments (vLLM's ``CopyPlan``).

    Offsets are relative to a block's first byte on each side: the GPU page when storing
    (``src``), the canonical page when loading.
    """

    frag_offsets_src: NDArray[np.uint64]
    frag_offsets_dst: NDArray[np.uint64]
    frag_sizes: NDArray[np.int64]
    total_bytes: int

    @property
    def num_frags(self) -> int:
        return len(self.frag_sizes)


def build_copy_plan(ref: CanonicalKVCacheRef, gpu_to_cpu: bool) -> CopyPlan:
    """``ref``'s mapping unrolled, fragment by fragment, in run order."""
    import numpy as np

    mapping = _mapping_of(ref)
    local: list[int] = []
    canonical: list[int] = []
    sizes: list[int] = []
    for run in mapping.runs:
        local += range(
            run.local_offset, run.local_offset + run.num_fragments * run.local_stride, run.local_stride
        )
        canonical += range(
            run.canonical_offset,
            run.canonical_offset + run.num_fragments * run.canonical_stride,
            run.canonical_stride,
        )
        sizes += [run.fragment_size] * run.num_fragments
    src, dst = (local, canonical) if gpu_to_cpu else (canonical, local)
    return CopyPlan(
        frag_offsets_src=np.asarray(src, dtype=np.uint64),
        frag_offsets_dst=np.asarray(dst, dtype=np.uint64),
        frag_sizes=np.asarray(sizes, dtype=np.int64),
        total_bytes=sum(sizes),
    )


def canonical_page_ids(
    chunk_ids: NDArray[np.int64], blocks_per_chunk: int, count: int, skip_count: int
) -> NDArray[np.int64]:
    """The canonical page id of each of ``count`` sub-blocks from sub-block ``skip_count`` on.

    The same number on every rank, so it decides whose turn it is to write a page.
    """
    import numpy as np

    if blocks_per_chunk == 1:
        return chunk_ids[:count]
    flat = (chunk_ids[:, np.newaxis] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return flat[skip_count : skip_count + count]


def canonical_block_sizes(
    layer_refs_per_group: Sequence[Sequence[CanonicalKVCacheRef]], num_tensors: int
) -> list[int]:
    """Canonical CPU bytes per block of each KV-cache tensor: the largest page of its layers."""
    sizes = [0] * num_tensors
    for layer_refs in layer_refs_per_group:
        for ref in layer_refs:
            if not 0 <= ref.tensor_idx < num_tensors:
                raise ConfigError(
                    "kv_caches.group_data_refs", f"tensor_idx {ref.tensor_idx} of {num_tensors}"
                )
            sizes[ref.tensor_idx] = max(sizes[ref.tensor_idx], _mapping_of(ref).canonical_page_size_bytes)
    empty = [i for i, size in enumerate(sizes) if size <= 0]
    if empty:
        raise ConfigError(
            "kv_caches.group_data_refs",
            f"tensors {empty[:4]} have no canonical bytes: no layer maps into them",
        )
    return sizes


def identity_mapping(page_size_bytes: int) -> CanonicalPageMapping:
    """A page that is its own canonical page (one writer, the whole page in one fragment)."""
    whole = CopyRun(0, 0, page_size_bytes, 1, page_size_bytes, page_size_bytes)
    return CanonicalPageMapping(page_size_bytes, page_size_bytes, (whole,), 1, 0, True)


def check_mapping(ref: CanonicalKVCacheRef, local_page: int, canonical_page: int, where: str) -> None:
    """Refuse a mapping whose fragments leave the GPU page or the canonical page.

    A strided copy is only bounded by the tensor's storage: a fragment past its page would
    overwrite the neighbouring block, or another rank's bytes, without an error.
    """
    mapping = _mapping_of(ref)
    if not 0 <= mapping.writer_index < mapping.num_writers:
        raise ConfigError(where, f"writer {mapping.writer_index} of {mapping.num_writers} writers")
    for i, run in enumerate(mapping.runs):
        local_end = run.local_offset + (run.num_fragments - 1) * run.local_stride + run.fragment_size
        canonical_end = (
            run.canonical_offset + (run.num_fragments - 1) * run.canonical_stride + run.fragment_size
        )
        if (
            min(run.fragment_size, run.num_fragments) <= 0
            or min(run.local_offset, run.canonical_offset, run.local_stride, run.canonical_stride) < 0
            or local_end > local_page
            or canonical_end > canonical_page
        ):
            raise ConfigError(
                where,
                f"run {i} ({run}) does not fit a {local_page}-byte page and a "
                f"{canonical_page}-byte canonical page",
            )


def copy_canonical_runs(
    gpu: torch.Tensor,
    cpu: torch.Tensor,
    plan: BlockCopyPlan,
    runs: Sequence[CopyRun],
    to_cpu: bool,
    non_blocking: bool,
) -> None:
    """Move ``plan``'s blocks through mapping ``runs``: a strided ``copy_`` per block run and mapping run.

    ``gpu`` is ``(blocks, page)`` and ``cpu`` ``(chunks, bpc, canonical page)``, both int8
    views whose last dimension is contiguous.
    """
    gpu_row, gpu_base = gpu.stride(0), gpu.storage_offset()
    cpu_row, cpu_sub, cpu_base = cpu.stride(0), cpu.stride(1), cpu.storage_offset()
    for block, chunk, sub, count in plan.runs():
        for run in runs:
            shape = (count, run.num_fragments, run.fragment_size)
            local = gpu.as_strided(
                shape, (gpu_row, run.local_stride, 1), gpu_base + block * gpu_row + run.local_offset
            )
            canonical = cpu.as_strided(
                shape,
                (cpu_sub, run.canonical_stride, 1),
                cpu_base + chunk * cpu_row + sub * cpu_sub + run.canonical_offset,
            )
            if to_cpu:
                canonical.copy_(local, non_blocking=non_blocking)
            else:
                local.copy_(canonical, non_blocking=non_blocking)


def _mapping_of(ref: CanonicalKVCacheRef) -> CanonicalPageMapping:
    if ref.mapping is None:
        raise ConfigError(
            "kv_caches.group_data_refs",
            f"the layer of tensor {ref.tensor_idx} has no canonical mapping, which canonical_layout needs",
        )
    return ref.mapping


__all__ = [
    "CopyPlan",
    "build_copy_plan",
    "canonical_block_sizes",
    "canonical_page_ids",
    "check_mapping",
    "copy_canonical_runs",
    "identity_mapping",
]
