"""Non-blocking existence checks for a secondary tier: ask this step, know by a later one.

A tier whose lookup touches storage (a ``stat`` on a network mount, an object-store
``HEAD``) cannot answer on the scheduler thread. It composes an ``AsyncLookupManager``
and implements ``batch_lookup``; the manager runs that on its own thread and caches the
verdicts per key.

One step of the scheduler, as the tier delegates it:

* ``lookup(key, ctx)``: ``None`` (not known yet: the tier answers ``RETRY``), then
  ``True``/``False`` once the probe has come back. A key is probed once however many
  requests ask for it, and only again after every request that asked has finished.
* ``flush()`` (the tier's ``on_schedule_end``): the keys first asked this step go to the
  worker as one batch, so the probe overlaps the model's forward pass.
* ``cleanup(req_id)`` (the tier's ``on_request_finished``): the request's references go;
  a verdict nobody references is dropped, unless its probe is still out, in which case a
  later request may still share it and the result is dropped when it arrives unclaimed.

Threads: the verdict table, the per-request index and the step's batch belong to the
caller, who always holds the tiering manager's lock; the worker sees only the two
queues. Every probe carries a generation number, so the result of a probe for a key that
was dropped and asked again is recognised as stale and ignored. Results are applied at
the first lookup after a flush (and at the flush and at shutdown): one poll of the queue
per step rather than per key.

A failed promotion calls ``mark_miss``: the cached ``True`` becomes ``False`` so the
request cannot re-issue a load that is bound to fail (vLLM #49176), without a new probe.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvoffload.base import OffloadKey, ReqContext

log = logging.getLogger(__name__)

#: A step's probes as the worker gets them: (key, the request that asked first, generation).
ProbeBatch = list[tuple[OffloadKey, ReqContext, int]]
#: What the worker hands back: (key, generation, found).
VerdictBatch = list[tuple[OffloadKey, int, bool]]


class LookupPhase(enum.Enum):
    PENDING = enum.auto()  # asked this step, not yet flushed to the worker
    IN_FLIGHT = enum.auto()  # with the worker
    RESOLVED = enum.auto()  # the verdict is known


@dataclass(slots=True)
class LookupState:
    """One key's probe: its generation, where it is, the verdict, who asked."""

    generation: int
    phase: LookupPhase = LookupPhase.PENDING
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)


class AsyncLookupManager(ABC):
    """Caches ``batch_lookup`` verdicts per key; probes run on one worker thread."""

    def __init__(self, tier_type: str) -> None:
        self._tier_type = tier_type
        self._lookup_state: dict[OffloadKey, LookupState] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._next_generation = 0
        self._lookup_batch: ProbeBatch = []
        # None in the probe queue stops the worker; FIFO, so the probes before it run first.
        self._lookup_queue: queue.SimpleQueue[ProbeBatch | None] = queue.SimpleQueue()
        self._pending_results: queue.SimpleQueue[VerdictBatch] = queue.SimpleQueue()
        self._need_to_drain = False
        self._stopped = False
        self._thread = threading.Thread(
            target=self._worker, name=f"kvoffload_lookup_{tier_type}", daemon=True
        )
        self._thread.start()

    @abstractmethod
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Whether each of ``keys`` is in the tier, in order. Runs on the worker thread.

        It may block on storage; it must not touch the primary tier or scheduler state. An
        exception fails the whole batch (every key reads as absent).
        """

    # ----------------------------------------------------------------- caller's side

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """The cached verdict for ``key``; ``None`` while it is being found out."""
        if self._need_to_drain:
            self._need_to_drain = False
            self.drain_results()
        state = self._lookup_state.get(key)
        if state is None:
            state = LookupState(generation=self._next_generation)
            self._next_generation += 1
            self._lookup_state[key] = state
            self._lookup_batch.append((key, req_context, state.generation))
        state.request_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        return state.result

    def flush(self) -> None:
        """Send this step's new keys to the worker as one batch (and apply results that came)."""
        self.drain_results()
        self._need_to_drain = True
        batch, self._lookup_batch = self._lookup_batch, []
        sent: ProbeBatch = []
        for key, req_context, generation in batch:
            state = self._lookup_state.get(key)
            if state is None or state.generation != generation:
                continue  # every request that asked finished before the probe went out
            assert state.phase is LookupPhase.PENDING, f"{key!r} was flushed twice"
            state.phase = LookupPhase.IN_FLIGHT
            sent.append((key, req_context, generation))
        if sent:
            self._lookup_queue.put(sent)

    def drain_results(self) -> None:
        """Apply every verdict the worker has handed back."""
        while True:
            try:
                verdicts = self._pending_results.get_nowait()
            except queue.Empty:
                return
            for key, generation, found in verdicts:
                state = self._lookup_state.get(key)
                if state is None or state.generation != generation:
                    continue  # stale: the key was dropped and asked again since
                if not state.request_ids:
                    del self._lookup_state[key]  # nobody is waiting for it any more
                    continue
                # A key is probed once per generation; a second verdict would mean a
                # corrected miss (mark_miss) could be overwritten back to True.
                assert state.phase is LookupPhase.IN_FLIGHT, f"{key!r}: a verdict for a probe not sent"
                assert state.result is None, f"{key!r}: a second verdict for generation {generation}"
                state.result = found
                state.phase = LookupPhase.RESOLVED

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """Make the known verdicts of ``keys`` False, after a load of them failed.

        A key whose current probe is still pending or out is left alone: its own verdict
        is on the way, and that probe is newer than the failed load.
        """
        for key in keys:
            state = self._lookup_state.get(key)
            if state is not None and state.phase is LookupPhase.RESOLVED:
                state.result = False

    def cleanup(self, req_id: str) -> None:
        """Forget request ``req_id``; a verdict nobody else references goes with it."""
        for key in self._req_keys.pop(req_id, ()):
            state = self._lookup_state[key]
            state.request_ids.discard(req_id)
            if not state.request_ids and state.phase is not LookupPhase.IN_FLIGHT:
                del self._lookup_state[key]

    def shutdown(self) -> None:
        """Stop the worker once the probes already sent have run, and apply their verdicts."""
        if not self._stopped:
            self._stopped = True
            self._lookup_queue.put(None)
        self._thread.join()
        self.drain_results()

    # ----------------------------------------------------------------- worker thread

    def _worker(self) -> None:
        while (probes := self._lookup_queue.get()) is not None:
            # batch_lookup takes one request's context, so a step's batch is split per request.
            by_request: dict[str, tuple[ReqContext, list[tuple[OffloadKey, int]]]] = {}
            for key, req_context, generation in probes:
                by_request.setdefault(req_context.req_id, (req_context, []))[1].append((key, generation))
            verdicts: VerdictBatch = []
            for req_context, entries in by_request.values():
                keys = [key for key, _ in entries]
                try:
                    found = list(self.batch_lookup(keys, req_context))
                except Exception as e:
                    log.warning(
                        "tier %s: lookup of %d keys failed, taking them as absent: %r",
                        self._tier_type,
                        len(keys),
                        e,
                    )
                    found = [False] * len(keys)
                if len(found) != len(keys):
                    log.warning(
                        "tier %s: batch_lookup gave %d answers for %d keys; the rest read as absent",
                        self._tier_type,
                        len(found),
                        len(keys),
                    )
                    found = (found + [False] * len(keys))[: len(keys)]
                verdicts.extend(
                    (key, generation, bool(hit))
                    for (key, generation), hit in zip(entries, found, strict=True)
                )
            if verdicts:
                self._pending_results.put(verdicts)
