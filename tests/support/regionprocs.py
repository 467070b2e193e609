"""Child-process bodies for region tests (importable, so the spawn start method works)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion

CHUNKS = 4
ROW = 2 * PAGESIZE


def create_write_and_hold(engine_id: str, root: str, conn: Connection) -> None:
    """Create (or join) the region as rank 0, fill slot 0 with 0x5A, report, wait for 'go'."""
    with SharedOffloadRegion(engine_id, CHUNKS, 0, ROW, PAGESIZE, root=Path(root)) as region:
        view = region.create_kv_memoryview()
        for row in range(CHUNKS):
            view[row, 0] = 0x5A
        view.release()
        conn.send(("ready", region.creator, region.identity))
        conn.recv()


def race(engine_id: str, root: str, rank: int, participants: int, conn: Connection) -> None:
    """Join a race for the region; report creator flag and inode; hold until told."""
    with SharedOffloadRegion(
        engine_id,
        CHUNKS,
        rank,
        participants * PAGESIZE,
        PAGESIZE,
        root=Path(root),
        participant=rank,
        participants=participants,
    ) as region:
        view = region.create_kv_memoryview()
        view[0, rank * PAGESIZE] = rank + 1
        view.release()
        conn.send((region.creator, region.identity))
        conn.recv()


CRASH_CHILD = """
import sys
from pathlib import Path
from kvoffload.cpu.shared_offload_region import SharedOffloadRegion, PAGESIZE
eid, root, lifetime = sys.argv[1], sys.argv[2], sys.argv[3]
SharedOffloadRegion(eid, 4, 0, 2 * PAGESIZE, PAGESIZE, root=Path(root),
                    participant=0, participants=1, lifetime=lifetime)
print("survived")
"""


def crash_child_argv(engine_id: str, root: Path, lifetime: str = "kvoffload") -> list[str]:
    return [sys.executable, "-c", CRASH_CHILD, engine_id, str(root), lifetime]


def child_env(failpoints: str) -> dict[str, str]:
    env = dict(os.environ)
    env["KVOFFLOAD_FAILPOINTS"] = failpoints
    return env
