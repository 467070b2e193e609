"""Manager cost per operation at 1k, 10k and 100k chunks, for the LRU and the ARC policy.

For every policy and pool size the pool is filled to the brim (every chunk stored and
ready; with ARC a random half touched once more, so both of its lists hold keys), then
each operation is timed over ``--ops`` calls, ``--repeat`` times:

* ``lookup``: one ``lookup`` of a random stored key;
* ``store+complete (evicting)``: ``prepare_store`` of ``--batch`` new keys into the full
  pool (so it evicts as many) and ``complete_store`` of them;
* ``store+complete (evicting past pins)``: the same with the oldest 1% of the pool pinned
  by a long load, which an eviction that walks the LRU order must step over;
* ``touch+prepare_load+complete_load``: the three calls of a load of ``--batch`` random
  stored keys.

A figure is the median over the repetitions of the cost of one call (one group of calls),
in microseconds; its ratio is cost at the largest pool / cost at the smallest, and the goal
is a flat cost (ratio <= 1.5). Every size is timed within each repetition, so noise on a
shared machine hits all sizes alike.

The "memory floor" rows time the same access pattern on a bare OrderedDict of as many keys:
a random key of a large pool is a cache miss whatever the code does, so they show how much
of a ratio the machine itself charges. Nothing is written except ``--json``.

    .venv/bin/python bench/bench_manager.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from figures import Row, entry, report

from kvoffload.base import LookupResult, OffloadKey, make_offload_key
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.policies import ChunkStatus

FLAT_GOAL = 1.5
PINNED_FRACTION = 0.01
LOOKUP = "lookup"
LOAD = "touch+prepare_load+complete_load"
STORE = "store+complete (evicting)"
STORE_PAST_PINS = "store+complete (evicting past 1% pinned)"
FLOOR = "floor"


def key(i: int) -> OffloadKey:
    # vLLM's block hashes are 32 bytes (sha256); the key appends the group index.
    return make_offload_key(i.to_bytes(32, "big"), 0)


class Keys:
    """Fresh keys, never handed out twice."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[OffloadKey]:
        first, self._next = self._next, self._next + n
        return [key(i) for i in range(first, first + n)]


class Pool:
    """A manager filled to the brim, and the keys it holds (tracked from its own answers)."""

    def __init__(self, policy: str, num_chunks: int, batch: int, fresh: Keys, rng: random.Random) -> None:
        self.manager = CPUOffloadingManager(num_chunks, cache_policy=policy)
        self.stored: dict[OffloadKey, None] = {}  # in store order
        self.batch = batch
        self.fresh = fresh
        for start in range(0, num_chunks, batch):
            self.store(fresh.take(min(batch, num_chunks - start)), evicting=False)
        self.once_used = list(self.stored)
        if policy == "arc":
            # Half the keys used twice, so ARC's frequent list is as full as its recent one.
            twice = set(rng.sample(self.once_used, len(self.once_used) // 2))
            self.manager.touch(list(twice))
            self.once_used = [k for k in self.once_used if k not in twice]
        if self.manager.num_free_chunks != 0:
            raise RuntimeError("the pool is not full")

    def store(self, keys: list[OffloadKey], evicting: bool = True) -> None:
        out = self.manager.prepare_store(keys)
        if (
            out is None
            or out.keys_to_store != keys
            or len(out.evicted_keys) != (len(keys) if evicting else 0)
        ):
            raise RuntimeError(f"the store did not evict one chunk per key: {out}")
        self.manager.complete_store(keys)
        for k in out.evicted_keys:
            del self.stored[k]
        self.stored.update(dict.fromkeys(keys))

    def lookups(self, ops: int, rng: random.Random) -> Callable[[], object]:
        # Fresh objects, as the scheduler's keys are: their hash is not cached yet.
        probes = [OffloadKey(bytes(bytearray(k))) for k in rng.choices(list(self.stored), k=ops)]
        lookup = self.manager.lookup

        def run() -> None:
            for k in probes:
                if lookup(k) is not LookupResult.HIT:
                    raise RuntimeError("a stored key was not a hit")

        return run

    def loads(self, ops: int, rng: random.Random) -> Callable[[], object]:
        stored = list(self.stored)
        batches = [rng.sample(stored, self.batch) for _ in range(ops)]
        manager = self.manager

        def run() -> None:
            for keys in batches:
                manager.touch(keys)
                manager.prepare_load(keys)
                manager.complete_load(keys)

        return run

    def stores(self, ops: int) -> Callable[[], object]:
        batches = [self.fresh.take(self.batch) for _ in range(ops)]

        def run() -> None:
            for keys in batches:
                self.store(keys)

        return run

    def pin_oldest(self, fraction: float) -> list[OffloadKey]:
        """Pin the keys next in line for eviction (a long load of cold blocks, or a slow tier copy)."""
        pinned = self.once_used[: max(1, int(len(self.once_used) * fraction))]
        self.manager.prepare_load(pinned)
        return pinned


def timed_us(calls: Callable[[], object], ops: int) -> float:
    """Microseconds per operation of ``calls``, which runs ``ops`` operations."""
    gc.collect()
    start = time.perf_counter_ns()
    calls()
    return (time.perf_counter_ns() - start) / ops / 1e3


class Floor:
    """What the memory hierarchy alone charges: an OrderedDict of ``size`` keys, no manager.

    A random key of a large dict is a cache miss wherever it lives; this times the same
    access pattern (a lookup, and a touch and two passes over 16 keys, as in a load) so
    the manager's ratios can be read against the machine's own.
    """

    def __init__(self, size: int, fresh: Keys) -> None:
        self.chunks: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict(
            (k, ChunkStatus(i, 0)) for i, k in enumerate(fresh.take(size))
        )

    def lookups(self, ops: int, rng: random.Random) -> Callable[[], object]:
        probes = [OffloadKey(bytes(bytearray(k))) for k in rng.choices(list(self.chunks), k=ops)]
        get = self.chunks.get

        def run() -> None:
            for k in probes:
                get(k)

        return run

    def loads(self, ops: int, batch: int, rng: random.Random) -> Callable[[], object]:
        stored = list(self.chunks)
        batches = [rng.sample(stored, batch) for _ in range(ops)]
        chunks = self.chunks

        def run() -> None:
            for keys in batches:
                for k in reversed(keys):
                    chunks.move_to_end(k)
                for k in keys:
                    chunks[k].ref_cnt += 1
                for k in keys:
                    chunks[k].ref_cnt -= 1

        return run


Samples = dict[tuple[str, str, int], list[float]]  # (policy, op, size) -> us per op


def sample(samples: Samples, what: tuple[str, str, int], calls: Callable[[], object], ops: int) -> None:
    samples.setdefault(what, []).append(timed_us(calls, ops))


def measure(policies: Sequence[str], sizes: Sequence[int], ops: int, batch: int, repeat: int) -> Samples:
    # Every size is timed in the same repetition, one after the other, so a noisy moment
    # on the machine hits all of them alike instead of one size.
    samples: Samples = {}
    rng = random.Random(0)
    fresh = Keys()
    lookups = ops * batch
    floors = {size: Floor(size, fresh) for size in sizes}
    for _ in range(repeat):
        for size, floor in floors.items():
            sample(samples, (FLOOR, LOOKUP, size), floor.lookups(lookups, rng), lookups)
        for size, floor in floors.items():
            sample(samples, (FLOOR, LOAD, size), floor.loads(ops, batch, rng), ops)
    floors.clear()
    for policy in policies:
        pools = {size: Pool(policy, size, batch, fresh, rng) for size in sizes}
        for _ in range(repeat):
            for size, pool in pools.items():
                sample(samples, (policy, LOOKUP, size), pool.lookups(lookups, rng), lookups)
            for size, pool in pools.items():
                sample(samples, (policy, LOAD, size), pool.loads(ops, rng), ops)
            for size, pool in pools.items():
                sample(samples, (policy, STORE, size), pool.stores(ops), ops)
        # Fresh pools: the stores above evicted the keys first in line.
        pools = {size: Pool(policy, size, batch, fresh, rng) for size in sizes}
        pinned = {size: pool.pin_oldest(PINNED_FRACTION) for size, pool in pools.items()}
        for _ in range(repeat):
            for size, pool in pools.items():
                sample(samples, (policy, STORE_PAST_PINS, size), pool.stores(ops), ops)
        for size, pool in pools.items():
            pool.manager.complete_load(pinned[size])
        pools.clear()
        gc.collect()
    return samples


def rows(samples: Samples, sizes: Sequence[int], batch: int) -> list[Row]:
    small, large = min(sizes), max(sizes)
    out: list[Row] = []
    for (policy, op, size), times in samples.items():
        base = statistics.median(samples[(policy, op, small)])
        med = statistics.median(times)
        ratio = med / base
        graded = size == large and policy != FLOOR
        subject = f"memory floor (plain OrderedDict) {op}" if policy == FLOOR else f"manager {policy} {op}"
        out.append(
            Row(
                figure=f"{subject}, {size:,} chunks",
                unit="us/call" if op == LOOKUP else f"us/call of {batch} keys",
                median=round(med, 3),
                min=round(min(times), 3),
                max=round(max(times), 3),
                baseline=f"the same at {small:,} chunks",
                ratio=round(ratio, 3),
                goal=f"<= {FLAT_GOAL} (flat from {small:,} to {large:,})" if graded else "",
                met=ratio <= FLAT_GOAL if graded else True,
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer operations and repetitions")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument(
        "--sizes", default="1000,10000,100000", help="pool sizes in chunks (default %(default)s)"
    )
    parser.add_argument("--policies", default="lru,arc", help="cache policies (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="keys per store/load call (default 16)")
    parser.add_argument("--ops", type=int, help="calls per repetition (default 500, --quick 200)")
    parser.add_argument("--repeat", type=int, help="repetitions; the median is shown (default 15, --quick 5)")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ops = args.ops or (200 if args.quick else 500)
    repeat = args.repeat or (5 if args.quick else 15)
    table = rows(measure(args.policies.split(","), sizes, ops, args.batch, repeat), sizes, args.batch)
    medians = f"medians in {table[0].unit.split(' of')[0]}; lookups are one key, the rest one call per group"
    return report(table, value="median", digits=3, notes=[medians], json_path=args.json)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_manager", interrupted="nothing to clean: it holds no file or mapping"))
