"""The region's files: how vLLM splits one region into a base file and segment files.

A region of ``num_chunks`` rows of ``row_stride`` bytes is one file, or for a large region a
run of files (``vllm_offload_{engine_id}.mmap``, ``.mmap.1``, ...; names from
``kvoffload.shm.names``), each holding whole rows. The region maps them into one contiguous
range, the bring-up plan lists them before anything is created, and the pre-fault widens its
ranges to huge pages within each of them.

Invariants: the split is vLLM 0.33's, byte for byte (a region made here and one made by vLLM
for the same engine have the same files, of the same sizes); the segments are in order,
contiguous and cover the region exactly; planning creates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.shm import names

#: vLLM's minimum segment size: regions under two of these are always one file. Page-cache
#: inserts are serialised per file, so a file of less is not worth its own walker.
MIN_SEGMENT_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Segment:
    """One file of the region: the bytes ``[offset, offset + length)`` of the whole."""

    index: int
    name: str
    offset: int
    length: int


def plan_segments(
    engine_id: str,
    num_chunks: int,
    row_stride: int,
    num_segments: int = 1,
    min_segment_bytes: int | None = None,
) -> list[Segment]:
    """Split the region into files exactly as vLLM does.

    Count = min(requested, total // min_segment_bytes); rows per file = ceil(num_chunks /
    max(1, count)); one file per run of that many rows. Regions under two minimum
    segments stay one file. ``min_segment_bytes`` defaults to ``MIN_SEGMENT_BYTES`` as it is now.
    """
    if min_segment_bytes is None:
        min_segment_bytes = MIN_SEGMENT_BYTES
    total = num_chunks * row_stride
    count = min(num_segments, total // min_segment_bytes) if min_segment_bytes > 0 else num_segments
    rows_per = max(1, -(-num_chunks // max(1, count)))
    segments = []
    for index, first_row in enumerate(range(0, max(num_chunks, 1), rows_per)):
        rows = min(rows_per, num_chunks - first_row)
        segments.append(
            Segment(index, names.format_name(engine_id, index), first_row * row_stride, rows * row_stride)
        )
    return segments
