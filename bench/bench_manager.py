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
of a ratio the machine itself charges.

The "kvoffload vs vLLM 0.33 manager" rows put kvoffload's manager next to vLLM 0.33's own
``CPUOffloadingManager`` at the largest pool size, each per policy and per call. They run in a
child process started with the interpreter of the venv ``make vllm-compat`` builds (vLLM's
source on PYTHONPATH), where both managers import; without that venv they are skipped, with the
reason on stderr. Both pools are filled alike, then serve the same requests, one after the other
(which of them goes first alternates), as vLLM's offloading scheduler drives a manager, each call
with the request's ``ReqContext`` and every key's end token recorded on it:
``on_new_request``; ``lookup`` of each key of the request's hit prefix and of its first new key
(a miss ends the scan); ``prepare_load`` and ``complete_load`` of the hits; ``prepare_store`` of
``--batch`` new keys into the full pool (evicting as many) and ``complete_store`` of them;
``on_request_finished``. Every answer of one manager must equal the other's (lookup results,
chunk ids, keys stored and evicted), or the script fails. Each row is kvoffload's median cost
per call over the repetitions divided by vLLM's (the row above it), goal <= 0.5. A cProfile of
kvoffload's manager on each operation, its top lines by own time, follows on stderr.

Nothing is written except ``--json``.

    .venv/bin/python bench/bench_manager.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from figures import Row, compared, entry, profile_path, read_json, reference, report, write_json

from kvoffload.base import LookupResult, OffloadKey, ReqContext, get_offload_block_hash, make_offload_key
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.policies import ChunkStatus

FLAT_GOAL = 1.5
PINNED_FRACTION = 0.01
LOOKUP = "lookup"
LOAD = "touch+prepare_load+complete_load"
STORE = "store+complete (evicting)"
STORE_PAST_PINS = "store+complete (evicting past 1% pinned)"
FLOOR = "floor"

REPO = Path(__file__).resolve().parent.parent
#: What ``make vllm-compat`` builds: vLLM 0.33's source tree and a venv that imports it.
VLLM_COMPAT = REPO / "build" / "vllm-compat"
VLLM_SOURCE = VLLM_COMPAT / "vllm-0.33.0"
VLLM_PYTHON = VLLM_COMPAT / "venv" / "bin" / "python"
#: Written last by the venv's build: without it the venv is half made.
VLLM_VENV_DONE = VLLM_COMPAT / "venv" / ".requirements.sha256"
VS_VLLM_GOAL = 0.5
#: Tokens per chunk, for the end token the scheduler records for each key of a request.
TOKENS_PER_CHUNK = 256
PROFILE_LINES = 8


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


# ---------------------------------------------------------------- side by side with vLLM 0.33

LOOKUP_KEY = "lookup"
REQUEST_ENDS = "on_new_request+on_request_finished"
VsSamples = dict[tuple[str, str, str], list[float]]  # (policy, manager, row) -> us per call


@dataclass(slots=True)
class Side:
    """One manager under test, with its own library's request context and key maker."""

    name: str
    manager: Any
    context: Callable[[str], Any]
    make_key: Callable[[bytes, int], bytes]


@dataclass(slots=True)
class Request:
    """One request as one side sees it: its context, its keys, and the store it was granted."""

    context: Any
    hits: list[bytes]
    new: list[bytes]
    probes: list[bytes]  # what the scheduler looks up: the hit prefix, then the first miss
    store: Any = None


def make_request(side: Side, req_id: str, hits: Sequence[bytes], new: Sequence[bytes]) -> Request:
    # Keys are made for each side, as the scheduler makes them for each request, so neither
    # manager finds a hash the other already computed.
    context = side.context(req_id)
    hit_keys = [side.make_key(h, 0) for h in hits]
    new_keys = [side.make_key(h, 0) for h in new]
    for position, k in enumerate(hit_keys + new_keys, 1):
        context.set_offload_key_position(k, position * TOKENS_PER_CHUNK)
    return Request(context, hit_keys, new_keys, hit_keys + new_keys[:1])


def on_new_request(manager: Any, r: Request) -> object:
    return manager.on_new_request(r.context)


def lookup(manager: Any, r: Request) -> object:
    return [manager.lookup(k, r.context) for k in r.probes]


def prepare_load(manager: Any, r: Request) -> object:
    return manager.prepare_load(r.hits, r.context) if r.hits else None


def complete_load(manager: Any, r: Request) -> object:
    return manager.complete_load(r.hits, r.context) if r.hits else None


def prepare_store(manager: Any, r: Request) -> object:
    r.store = manager.prepare_store(r.new, r.context) if r.new else None
    return r.store


def complete_store(manager: Any, r: Request) -> object:
    return manager.complete_store(r.store.keys_to_store, r.context) if r.store else None


def on_request_finished(manager: Any, r: Request) -> object:
    return manager.on_request_finished(r.context)


Call = Callable[[Any, Request], object]
#: One request's calls in the scheduler's order, each with the row that times it.
CALLS: tuple[tuple[str, Call], ...] = (
    (REQUEST_ENDS, on_new_request),
    (LOOKUP_KEY, lookup),
    ("prepare_load", prepare_load),
    ("complete_load", complete_load),
    ("prepare_store (evicting)", prepare_store),
    ("complete_store", complete_store),
    (REQUEST_ENDS, on_request_finished),
)
VS_ROWS = tuple(dict.fromkeys(row for row, _ in CALLS))


def comparable(answer: Any) -> object:
    """A call's answer as plain values, the same for either library's types."""
    if answer is None:
        return None
    if isinstance(answer, list):  # lookups
        return tuple(result.name for result in answer)
    if hasattr(answer, "keys_to_store"):
        spec = tuple(answer.store_spec.block_ids.tolist())
        return tuple(answer.keys_to_store), spec, tuple(answer.evicted_keys)
    if hasattr(answer, "block_ids"):
        return tuple(answer.block_ids.tolist())
    return answer.policy.value  # on_new_request's RequestOffloadingContext


def serve(
    side: Side, r: Request, spent: dict[str, int], profiles: dict[str, cProfile.Profile] | None
) -> dict[str, object]:
    """Make one request's calls, adding each one's nanoseconds to its row; the answers by call."""
    answers: dict[str, object] = {}
    manager = side.manager
    clock = time.perf_counter_ns
    for row, call in CALLS:
        if profiles is not None:
            profiles[row].enable()
        start = clock()
        answer = call(manager, r)
        spent[row] += clock() - start
        if profiles is not None:
            profiles[row].disable()
        answers[call.__name__] = comparable(answer)
    return answers


class Resident:
    """The block hashes both pools hold, for drawing a request's hits at random."""

    def __init__(self) -> None:
        self.hashes: list[bytes] = []
        self._index: dict[bytes, int] = {}

    def add(self, h: bytes) -> None:
        self._index[h] = len(self.hashes)
        self.hashes.append(h)

    def remove(self, h: bytes) -> None:
        i = self._index.pop(h)
        last = self.hashes.pop()
        if i < len(self.hashes):
            self.hashes[i] = last
            self._index[last] = i


class Duel:
    """Two managers served the same requests; each answer of one must equal the other's."""

    def __init__(self, policy: str, sides: Sequence[Side], batch: int) -> None:
        self.policy = policy
        self.sides = sides
        self.batch = batch
        self.resident = Resident()
        self.rng = random.Random(0)
        self._next_hash = 0
        self.served = 0

    def fresh(self, n: int) -> list[bytes]:
        first, self._next_hash = self._next_hash, self._next_hash + n
        return [i.to_bytes(32, "big") for i in range(first, first + n)]

    def request(
        self,
        hits: Sequence[bytes],
        new: Sequence[bytes],
        spent: dict[str, dict[str, int]],
        profiles: dict[str, cProfile.Profile] | None = None,
    ) -> None:
        self.served += 1
        # Each goes first every other request, so neither always finds the other's cache lines.
        order = self.sides if self.served % 2 else self.sides[::-1]
        answers = {}
        for side in order:
            r = make_request(side, f"req-{self.served}", hits, new)
            answers[side.name] = serve(side, r, spent[side.name], profiles if side is self.sides[0] else None)
        ours, theirs = (answers[side.name] for side in self.sides)
        for call, answer in ours.items():
            if answer != theirs[call]:
                raise RuntimeError(
                    f"{self.policy} request {self.served}: {call} answered {answer!r} "
                    f"on {self.sides[0].name} and {theirs[call]!r} on {self.sides[1].name}"
                )
        stored = cast("tuple[list[OffloadKey], object, list[OffloadKey]] | None", ours["prepare_store"])
        if new and (stored is None or len(stored[0]) != len(new)):
            raise RuntimeError(f"{self.policy} request {self.served}: the store was refused: {stored!r}")
        if stored is not None:
            keys_to_store, _, evicted = stored
            for k in evicted:
                self.resident.remove(get_offload_block_hash(k))
            for k in keys_to_store:
                self.resident.add(get_offload_block_hash(k))

    def fill(self, num_chunks: int, reuse_half: bool) -> None:
        """Both pools full of ready keys; with ``reuse_half`` half of them read once more (ARC's T2)."""
        scratch = {side.name: dict.fromkeys(VS_ROWS, 0) for side in self.sides}
        while len(self.resident.hashes) < num_chunks:
            self.request([], self.fresh(min(self.batch, num_chunks - len(self.resident.hashes))), scratch)
        if reuse_half:
            reused = self.rng.sample(self.resident.hashes, num_chunks // 2)
            for start in range(0, len(reused), self.batch):
                self.request(reused[start : start + self.batch], [], scratch)

    def timed(
        self, requests: int, profiles: dict[str, cProfile.Profile] | None = None
    ) -> dict[str, dict[str, int]]:
        """Nanoseconds each side spent per row over ``requests`` requests of ``batch`` hits and new keys."""
        spent = {side.name: dict.fromkeys(VS_ROWS, 0) for side in self.sides}
        for _ in range(requests):
            self.request(
                self.rng.sample(self.resident.hashes, self.batch), self.fresh(self.batch), spent, profiles
            )
        return spent


def measure_vs_vllm(
    policies: Sequence[str], num_chunks: int, batch: int, requests: int, repeat: int
) -> tuple[VsSamples, list[str]]:
    """Run in the vLLM venv: both managers, interleaved request by request, and a profile of ours."""
    from vllm.v1.kv_offload.base import ReqContext as VllmReqContext  # type: ignore[import-not-found]
    from vllm.v1.kv_offload.base import make_offload_key as make_vllm_key
    from vllm.v1.kv_offload.cpu.manager import (  # type: ignore[import-not-found]
        CPUOffloadingManager as VllmManager,
    )

    calls_per_request = {row: 1 for row in VS_ROWS} | {LOOKUP_KEY: batch + 1}
    samples: VsSamples = {}
    profile: list[str] = []
    for policy in policies:
        sides = (
            Side(
                "kvoffload",
                CPUOffloadingManager(num_chunks, cache_policy=policy),
                ReqContext,
                make_offload_key,
            ),
            Side("vLLM", VllmManager(num_chunks, cache_policy=policy), VllmReqContext, make_vllm_key),
        )
        duel = Duel(policy, sides, batch)
        duel.fill(num_chunks, reuse_half=policy == "arc")
        # Out of the collector's sight: a full collection walking both pools would otherwise
        # land on whichever call happened to trigger it.
        gc.collect()
        gc.freeze()
        for _ in range(repeat):
            gc.collect()
            spent = duel.timed(requests)
            for side in sides:
                for row, ns in spent[side.name].items():
                    us = ns / (requests * calls_per_request[row]) / 1e3
                    samples.setdefault((policy, side.name, row), []).append(us)
        profiles = {row: cProfile.Profile() for row in VS_ROWS}
        duel.timed(requests, profiles)
        profile += profile_lines(f"kvoffload {policy}, {num_chunks:,} chunks", profiles, requests)
        gc.unfreeze()
        del duel, sides
        gc.collect()
    return samples, profile


def profile_lines(what: str, profiles: dict[str, cProfile.Profile], requests: int) -> list[str]:
    """Each row's top functions by own time: where the next round should start."""
    found = []
    for row, profile in profiles.items():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(PROFILE_LINES)
        lines = out.getvalue().splitlines()
        header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        found.append(f"{what}, {row}, {requests} requests (cProfile, by own time):")
        found += [f"  {line.replace(str(REPO) + os.sep, '')}" for line in lines[header:] if line.strip()]
    return found


def vs_vllm_rows(samples: VsSamples, batch: int, num_chunks: int) -> list[Row]:
    out: list[Row] = []
    for policy in dict.fromkeys(p for p, _, _ in samples):
        for row in VS_ROWS:
            unit = (
                "us/call"
                if row == LOOKUP_KEY
                else "us/request"
                if row == REQUEST_ENDS
                else f"us/call of {batch} keys"
            )
            theirs = samples[(policy, "vLLM", row)]
            what = f"{policy} {row}, {num_chunks:,} chunks"
            out.append(reference(f"vLLM 0.33 manager, {what}", unit, theirs))
            out.append(
                compared(
                    f"kvoffload vs vLLM 0.33 manager, {what}",
                    unit,
                    samples[(policy, "kvoffload", row)],
                    baseline="vLLM 0.33's manager, the same calls in the same run",
                    base=statistics.median(theirs),
                    at_most=VS_VLLM_GOAL,
                )
            )
    return out


def against_vllm(
    policies: Sequence[str], num_chunks: int, batch: int, requests: int, repeat: int
) -> tuple[list[Row], list[str]]:
    """The side-by-side rows and their profile, from a child in vLLM's venv; none (the reason
    on stderr) without it."""
    missing = next((p for p in (VLLM_PYTHON, VLLM_VENV_DONE, VLLM_SOURCE) if not p.exists()), None)
    if missing is not None:
        print(
            f"note: kvoffload vs vLLM 0.33 manager rows skipped: no {missing} (`make vllm-compat` builds it)",
            file=sys.stderr,
        )
        return [], []
    with tempfile.TemporaryDirectory(prefix="manager-vs-vllm-") as tmp:
        rows_file = Path(tmp) / "rows.json"
        argv = [
            str(VLLM_PYTHON),
            str(Path(__file__).resolve()),
            "--vllm-side",
            "--json",
            str(rows_file),
            "--policies",
            ",".join(policies),
            "--sizes",
            str(num_chunks),
            "--batch",
            str(batch),
            "--requests",
            str(requests),
            "--repeat",
            str(repeat),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(VLLM_SOURCE)]),
            "VLLM_TARGET_DEVICE": "cpu",
            # vLLM's source tree is make vllm-compat's: nothing is written into it.
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        done = subprocess.run(argv, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the side-by-side run in vLLM's venv failed (exit {done.returncode})")
        return read_json(rows_file), profile_path(rows_file).read_text().splitlines()


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
    parser.add_argument(
        "--requests", type=int, help="requests per repetition against vLLM (default 300, --quick 100)"
    )
    parser.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_side and not args.json:
        parser.error("--vllm-side writes its rows to --json FILE")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ops = args.ops or (200 if args.quick else 500)
    repeat = args.repeat or (5 if args.quick else 15)
    policies = args.policies.split(",")
    requests = args.requests or (100 if args.quick else 300)
    if args.vllm_side:
        # The child: only the side-by-side rows, for the parent to merge.
        samples, profile = measure_vs_vllm(policies, max(sizes), args.batch, requests, repeat)
        table = vs_vllm_rows(samples, args.batch, max(sizes))
        write_json(table, args.json)
        profile_path(args.json).write_text("".join(f"{line}\n" for line in profile))
        return 0
    table = rows(measure(policies, sizes, ops, args.batch, repeat), sizes, args.batch)
    vs_vllm, profile = against_vllm(policies, max(sizes), args.batch, requests, repeat)
    table += vs_vllm
    medians = f"medians in {table[0].unit.split(' of')[0]}; lookups are one key, the rest one call per group"
    return report(table, value="median", digits=3, notes=[medians], json_path=args.json, profile=profile)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_manager", interrupted="nothing to clean: it holds no file or mapping"))
