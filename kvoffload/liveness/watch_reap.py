"""What ``shmctl watch --reap`` does in one root's turn of a pass: settle dead parks, remove.

The agent judges a root as a stream and nominates; ``Watcher`` decides what goes (a region
orphaned with the very same files in the last pass too). A ``RootReaper`` does the going,
with the library's own protocol: what dead reapers left parked is settled as ``reap``
settles it (``settle_parked``), and nominated regions are handed to ``reap``'s removal
(``remove_regions``) in batches of about ``REMOVAL_BATCH_FILES`` files, each proven dead again
under its lease before it is unlinked. Every outcome is told as an event (``removed``,
``removal_failed``, ``kept_unknown``, ``parked``, ``park_removed``) and counted in the root's
``Tally`` as the pass leaves it. Nothing is held past the batch at hand.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvoffload.liveness import park
from kvoffload.liveness.events import Event, KeptUnknown, ParkedSettled, ParkRemoved, RemovalFailed, Removed
from kvoffload.liveness.park import ParkView
from kvoffload.liveness.park.settle import settle_parked
from kvoffload.liveness.removal import MAX_BATCH_FILES, Outcome, remove_regions
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.scan import ScanOptions, ScanStream, Status
from kvoffload.liveness.tally import Tally

__all__ = ["REMOVAL_BATCH_FILES", "RootReaper", "by_engine", "region_key"]

#: Files handed to the removal at once: whole regions, about ``reap``'s own batch.
REMOVAL_BATCH_FILES = MAX_BATCH_FILES


class RootReaper:
    """The agent's removal in one root for one pass: the root's stream (its ``dir_fd``), its
    tally, and where the events go.

    ``remover`` is whose regions may go: the agent's uid, or None for every user's
    (``all_users``, ``--all-users``: then another uid's dead parks are adopted too).
    """

    def __init__(
        self,
        root: Path,
        pod_uid: str | None,
        stream: ScanStream,
        tally: Tally,
        *,
        options: ScanOptions,
        remover: int | None,
        emit: Callable[[Event], None],
        clock: Callable[[], float] = time.time,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.root = root
        self.pod_uid = pod_uid
        self.stream = stream
        self.tally = tally
        self.options = options
        self._remover = remover
        self._emit = emit
        self._clock = clock
        self._should_stop = should_stop

    def remove(self, regions: list[tuple[ScanEntry, ...]], orphaned: set[bytes]) -> None:
        """Remove nominated regions (``reap``'s protocol) and count what the removal kept; a region
        kept as it was (still ``orphaned``, the agent stopping, say) goes into ``orphaned``."""
        # ``reap`` itself would scan the whole root again and hold every entry of it; its
        # removal takes the regions this stream has just judged, each proven dead again.
        done = remove_regions(
            self.stream.dir_fd,
            [list(r) for r in regions],
            self.options.proc_root,
            self.options.assume_not_holding,
            self._should_stop,
        )
        self._tell_removed(done.removed)
        self._tell_failed(done.failed)
        for engine_id, entries in by_engine(_still_there(self.stream.dir_fd, done.kept)).items():
            if all(e.status is Status.ORPHANED for e in entries):
                orphaned.add(region_key(entries))  # kept as it was (stopped, say): next pass
            # The proof can find what the scan could not see (a file that cannot be opened now).
            unknown = [e for e in entries if e.status is Status.UNKNOWN]
            if unknown:
                self._emit(
                    KeptUnknown(
                        self._clock(),
                        self.root,
                        self.pod_uid,
                        engine_id=engine_id,
                        bytes=sum(e.resident_bytes for e in unknown),
                        files=len(unknown),
                        reason=unknown[0].reason,
                    )
                )
            self.tally.count(entries)

    def settle(self, parks: tuple[ParkView, ...], parked: tuple[ScanEntry, ...]) -> None:
        """Settle what dead reapers left parked, as ``reap`` does before it removes anything."""
        dead = tuple(e for e in parked if e.parked is not None and not e.parked.reaper_running)
        done = Outcome()
        with park.ParkDir(self.stream.dir_fd, proc_root=self.options.proc_root) as parking:
            settle_parked(
                self.stream.dir_fd,
                dead,
                parks=[p for p in parks if p.running is False],
                parking=parking,
                adopter=park.Adopter(os.geteuid(), self._remover is None),
                remove_engines=lambda engine_id: True,
                remove_others=self._remover is None,
                use_lease=self.stream.lease_enabled,
                outcome=done,
            )
        conflicts = [e for e in done.kept if e.status is Status.PARKED]
        for action, settled in (("restored", done.restored), ("conflict", conflicts)):
            for engine_id, entries in by_engine(settled).items():
                self._emit(
                    ParkedSettled(
                        self._clock(),
                        self.root,
                        self.pod_uid,
                        engine_id=engine_id,
                        action=action,
                        bytes=sum(e.resident_bytes for e in entries),
                        files=len(entries),
                        reason=entries[0].reason,
                    )
                )
        for name in done.parks_removed:
            self._emit(ParkRemoved(self._clock(), self.root, self.pod_uid, name=name))
        self.tally.restored += len(done.restored)
        self.tally.conflicts += len(conflicts)
        self.tally.settled = True
        self._tell_removed(done.removed)
        self._tell_failed(done.failed)
        # Given back, a file is at its name again; a conflict waits parked; the rest as judged.
        left = [e for e in parked if e.parked is None or e.parked.reaper_running]
        for entries in by_engine([*done.restored, *conflicts, *left]).values():
            self.tally.count(entries)

    def _tell_failed(self, failed: Sequence[ScanEntry]) -> None:
        """``kept_unknown`` is for evidence; a file the agent failed on is told as ``removal_failed``."""
        for engine_id, entries in by_engine(failed).items():
            self._emit(
                RemovalFailed(
                    self._clock(),
                    self.root,
                    self.pod_uid,
                    engine_id=engine_id,
                    bytes=sum(e.resident_bytes for e in entries),
                    files=len(entries),
                    reason=entries[0].reason,
                )
            )

    def _tell_removed(self, removed: list[ScanEntry]) -> None:
        for engine_id, entries in by_engine(removed).items():
            freed = sum(e.resident_bytes for e in entries)
            self._emit(
                Removed(
                    self._clock(),
                    self.root,
                    self.pod_uid,
                    engine_id=engine_id,
                    bytes=freed,
                    files=len(entries),
                )
            )
            self.tally.remove(entries)


def by_engine(entries: Iterable[ScanEntry]) -> dict[str, list[ScanEntry]]:
    groups: dict[str, list[ScanEntry]] = {}
    for e in entries:
        groups.setdefault(e.engine_id, []).append(e)
    return groups


def region_key(entries: Sequence[ScanEntry]) -> bytes:
    """A region in one bytes object: its engine id, NUL, and its files' ``(st_dev, st_ino)``
    sorted. Equal keys: the same engine with exactly the same files (no id holds a NUL)."""
    identities = sorted(e.identity for e in entries)
    packed = struct.pack(f"<{2 * len(identities)}Q", *itertools.chain.from_iterable(identities))
    return entries[0].engine_id.encode("utf-8", "surrogatepass") + b"\0" + packed


def _still_there(dir_fd: int, kept: list[ScanEntry]) -> list[ScanEntry]:
    """The kept entries whose file is still at its name (a file someone else removed meanwhile is
    not counted); a parked conflict waits in its park directory, and is."""
    there = []
    for e in kept:
        if e.status is Status.PARKED:
            there.append(e)
            continue
        try:
            st = os.stat(e.name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == e.identity:
            there.append(e)
    return there
