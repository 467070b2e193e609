"""Pre-faulting a shared mapping on threads: the engine under ``SharedOffloadRegion.populate``.

The region decides what one participant pre-faults (the whole region, its ``populate_shard``
share, or a worker's slot of every row); this module plans the walk over those ranges and runs
it. The walk runs on ``populate_threads`` threads (default: the CPUs this process may use,
shared among the expected participants, capped), each walking one contiguous piece in steps
with libc's ``madvise`` (``kvoffload.syscalls``), which lets go of the GIL (CPython's
``mmap.madvise`` does not); a thread that is done takes the last steps of the others' pieces,
so a thread the scheduler holds back does not hold up the walk. On 4 KiB pages of a one-file
region each step is allocated with ``fallocate(FALLOC_FL_KEEP_SIZE)`` first (bytes and size
kept): the faults then only zero and map. On a region of several files a ranked worker starts
its walk at its own fraction of the rows, as vLLM does, so workers (and their threads) fault
different files at once: the kernel serialises page-cache inserts per file. On one file of 4 KiB
pages every worker starts at row 0, as in vLLM: the slots are disjoint and the file's lock is
shared anyway. On a tmpfs with huge pages (``kvoffload.shm.mounts``) the ranges are widened to
whole huge pages (the kernel allocates nothing smaller there, so a worker's slot means the huge
pages around it; workers start at their own fraction of the rows there too, as their widened
ranges overlap), and on a ``huge=advise`` mount the mapping is ``MADV_HUGEPAGE``'d first.

Pages are faulted with ``MADV_POPULATE_WRITE`` (Linux >= 5.14), probed once per mapping; where
the kernel lacks it (EINVAL), by rewriting one byte per page with itself, which keeps what a
peer wrote there already.

Invariants: a fault never changes a byte of the mapping or the file's size; a thread that
fails stops the others, and the first error is raised once every thread has returned, so the
mapping is never unmapped under a running fault; progress is reported from the calling thread
only.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload import syscalls
from kvoffload.cpu.segments import Segment
from kvoffload.errors import ConfigError

#: The region's own logger, as before the pre-fault had a module of its own: init reports each
#: participant's log records with their logger's name, and operators' logging configs name it.
log = logging.getLogger("kvoffload.cpu.shared_offload_region")

PAGESIZE = mmap.PAGESIZE
#: Bytes per step of a populate walk: the most a thread faults before it reports progress and
#: looks for a stop, and what a thread that is done takes from another's piece. Small enough
#: that the walk's last step is short (16 MiB of 4 KiB pages: ~15 ms), big enough that the
#: steps cost nothing next to the faults (64 per GiB).
POPULATE_STEP = 16 << 20
#: A default thread is started only for at least this many bytes to pre-fault.
_MIN_THREAD_BYTES = 64 << 20
#: The default thread count's ceiling. Past a few threads the faults of one tmpfs file
#: contend for its page cache and the memory bandwidth is shared anyway.
DEFAULT_MAX_POPULATE_THREADS = 8
MAX_POPULATE_THREADS = 256
_PROGRESS_INTERVAL_S = 0.1
#: fallocate's answers for a filesystem (or a mode) it does not support: faults allocate then.
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})

Range = tuple[int, int]
Progress = Callable[[int, int], None]
PopulateWrite = Callable[[mmap.mmap, int, int], object]


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ----------------------------------------------------------------- faulting pages in


def madvise_populate_write(mm: mmap.mmap, offset: int, length: int) -> None:
    """Fault ``length`` bytes of ``mm`` from ``offset`` in, writable, with MADV_POPULATE_WRITE.

    Through libc rather than ``mm.madvise``: ctypes lets go of the GIL for the call, so the
    threads of one participant fault in parallel.
    """
    syscalls.madvise(syscalls.address_of(mm) + offset, length, syscalls.MADV_POPULATE_WRITE)


def touch_populate_write(mm: mmap.mmap, offset: int, length: int) -> None:
    """Fault pages in by rewriting one byte per page with itself (content preserved).

    A peer may already have written KV data there, so the page keeps its bytes. A plain loop
    through a memoryview: the page faults cost ~30x the loop (256 MiB on tmpfs: ~260 ms either
    way, the loop alone 8 ms), so numpy would buy nothing here but a 73 MB dependency on the
    CLI's install. One byte at a time keeps the read-to-write window per page short.
    """
    with memoryview(mm) as view:
        for at in range(offset, offset + length, PAGESIZE):
            view[at] = view[at]


def probe_populate_write(mm: mmap.mmap, populate_write: PopulateWrite = madvise_populate_write) -> bool:
    """Does MADV_POPULATE_WRITE work on ``mm`` (Linux >= 5.14)? Faults its first page in.

    False on EINVAL, the kernel's answer for an advice it lacks; any other error is real and
    propagates. ``shmctl doctor`` asks the same on a page of its own. ``populate_write`` is
    the call probed: the region passes vLLM's name for it, which a test may have replaced.
    """
    try:
        populate_write(mm, 0, PAGESIZE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def advise_huge_pages(mm: mmap.mmap, length: int, path: Path) -> None:
    """``MADV_HUGEPAGE`` the first ``length`` bytes of ``mm``, the file at ``path``; a refusal is logged."""
    try:
        syscalls.madvise(syscalls.address_of(mm), length, syscalls.MADV_HUGEPAGE)
    except OSError as e:
        log.info("MADV_HUGEPAGE on %s refused (%s); pre-faulting 4 KiB pages", path, e)


def _allocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's pages in ``[offset, offset + length)``: its bytes and size stay as they are.

    ``fallocate(FALLOC_FL_KEEP_SIZE)``: data already there is kept, holes become zeroed pages,
    and a file that shrank meanwhile is not grown back (its walk fails as it would without).
    """
    syscalls.fallocate(fd, syscalls.FALLOC_FL_KEEP_SIZE, offset, length)


# ----------------------------------------------------------------- planning the walk


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge sorted, page-aligned (start, end) ranges that touch or overlap."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def widen_to_huge_pages(ranges: Iterable[Range], segments: Sequence[Segment], huge: int) -> list[Range]:
    """Sorted ``ranges`` grown to the huge pages that hold them, merged.

    Huge pages are aligned within each file, so a range is cut at segment boundaries and
    widened to multiples of ``huge`` from its segment's start, never past the segment's end
    (a file's tail shorter than a huge page stays in small pages).
    """
    bounds = [(seg.offset, seg.offset + seg.length) for seg in segments]
    widened: list[Range] = []
    index = 0  # both are sorted: one pass, however many rows and files
    for start, end in ranges:
        while index < len(bounds) and bounds[index][1] <= start:
            index += 1
        j = index
        while j < len(bounds) and bounds[j][0] < end:
            seg_start, seg_end = bounds[j]
            first = seg_start + (max(start, seg_start) - seg_start) // huge * huge
            last = min(seg_end, seg_start + round_up(min(end, seg_end) - seg_start, huge))
            if widened and first <= widened[-1][1]:
                if last > widened[-1][1]:
                    widened[-1] = (widened[-1][0], last)
            else:
                widened.append((first, last))
            j += 1
    return widened


def rotate(ranges: Sequence[Range], at: int) -> list[Range]:
    """The walk over sorted ``ranges`` that starts at byte ``at`` and wraps around to the start."""
    head: list[Range] = []
    tail: list[Range] = []
    for start, end in ranges:
        if end <= at:
            tail.append((start, end))
        elif start >= at:
            head.append((start, end))
        else:
            head.append((at, end))
            tail.append((start, at))
    return head + tail


def split_walk(walk: Sequence[Range], parts: int, granule: int = PAGESIZE) -> list[list[Range]]:
    """``walk`` cut into at most ``parts`` consecutive pieces of nearly equal bytes.

    The cuts fall every ``share`` bytes into the walk, ``share`` a multiple of ``granule``: on a
    walk of whole huge pages no two threads fault one huge page. Empty pieces are dropped.
    """
    total = sum(end - start for start, end in walk)
    share = max(granule, round_up(-(-total // max(1, parts)), granule))
    pieces: list[list[Range]] = []
    current: list[Range] = []
    room = share
    for start, end in walk:
        offset = start
        while offset < end:
            if room == 0 and len(pieces) < parts - 1:
                pieces.append(current)
                current, room = [], share
            last = len(pieces) >= parts - 1
            take = end - offset if last else min(end - offset, room)
            current.append((offset, offset + take))
            offset += take
            room = max(0, room - take)
    pieces.append(current)
    return [piece for piece in pieces if piece]


def default_populate_threads(todo: int, participants: int | None = None, cpus: int | None = None) -> int:
    """Threads for pre-faulting ``todo`` bytes: this process's CPUs, shared among the
    ``participants`` that pre-fault at the same time, capped, and one per at least 64 MiB."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    share = max(1, cpus // max(1, participants or 1))
    return max(1, min(DEFAULT_MAX_POPULATE_THREADS, share, todo // _MIN_THREAD_BYTES))


def check_populate_threads(value: object) -> int | None:
    """``value`` if it is None (the default) or a thread count in 1..``MAX_POPULATE_THREADS``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_POPULATE_THREADS:
        raise ConfigError(
            "populate_threads",
            f"{value!r} is not a thread count in 1..{MAX_POPULATE_THREADS}",
            fix="leave it unset for one per CPU this process may use, shared among the participants",
        )
    return value


@dataclass(frozen=True, slots=True)
class PrefaultPlan:
    """What one participant pre-faults, in the order it walks it, and on how many threads."""

    walk: tuple[Range, ...]
    threads: int
    #: What no two threads split: a page, or on a mount of huge pages a huge page.
    granule: int


def plan_prefault(
    ranges: Iterable[Range],
    segments: Sequence[Segment],
    *,
    huge_page: int | None,
    threads: int | None,
    touch: bool,
    participants: int | None,
    start_at: Callable[[int], int] | None = None,
) -> PrefaultPlan:
    """The walk over sorted ``ranges`` of the region of ``segments``, and its thread count.

    ``huge_page``: the huge page size where the mount gives huge pages, None on 4 KiB pages.
    ``threads``: the count asked for; None for the default. ``touch``: the per-page touch.
    ``start_at(threads)``: the byte the walk starts at, for a walk cut in that many pieces;
    None starts at the front.
    """
    granule = PAGESIZE
    if huge_page is not None:
        # The kernel allocates whole huge pages here: faulting a slot's 4 KiB allocates the
        # 2 MiB around it anyway, so walk those, once each, instead of one call per row.
        granule = huge_page
        ranges = widen_to_huge_pages(ranges, segments, granule)
    kept = [(start, end) for start, end in ranges if end > start]
    todo = sum(end - start for start, end in kept)
    if touch:
        count = 1  # the per-page touch holds the GIL: threads would only take turns
    elif threads is not None:
        count = threads
    else:
        count = default_populate_threads(todo, participants)
    walk = kept
    if start_at is not None:
        walk = rotate(kept, start_at(count) // granule * granule)
    return PrefaultPlan(tuple(walk), count, granule)


def reserve_before_faults(populate: bool | str, huge_pages: str, threads: int) -> bool:
    """Reserve with posix_fallocate before sizing, when that costs nothing and defeats nothing.

    Single-threaded, fallocate and then faulting is faster than faulting alone on 4 KiB pages
    (it allocates in bulk), and a root that fills up meanwhile fails with ENOSPC before any
    joiner maps the file. But fallocate holds the file's lock and runs on one CPU, while
    faults from several threads allocate in parallel: with threads it is the bottleneck. And
    fallocate allocates without a mapping, so on ``huge=advise`` (no MADV_HUGEPAGE reaches it)
    and on ``huge=within_size`` of kernels that judge a fallocate by the file's size before
    it (0 at that point) it allocates small pages, which populate then keeps: it would defeat
    the huge pages it was meant to prepare. ``huge=always`` gives it huge pages on any kernel.
    """
    if not populate:
        return False  # stay sparse like vLLM
    if huge_pages == "always":
        return True
    return huge_pages == "never" and threads <= 1


def allocate_each_step(huge_pages: str, files: int, reserved: bool) -> bool:
    """Allocate each step's pages with fallocate before faulting them, where that is cheaper.

    On 4 KiB pages a fault that finds its page allocated only zeroes and maps it, and
    fallocate allocates in bulk, without page tables: the two cost about a tenth less CPU
    than faulting alone (bench/bench_region.py's profile). Per step rather than the whole
    file first, so the threads' faults run while another step is allocated: fallocate
    holds the file's lock, faults do not. Not where the creator ``reserved`` the whole file
    already, not on a region of several files (one descriptor here), and not on huge pages,
    where fallocate may allocate small pages that the faults would then keep (see
    ``reserve_before_faults``).
    """
    if huge_pages != "never" or files > 1:
        return False
    return not reserved


# ----------------------------------------------------------------- running the walk


def cut_steps(piece: Sequence[Range], step: int) -> list[list[Range]]:
    """``piece`` as consecutive steps of at most ``step`` bytes each, in walk order.

    A range longer than a step is cut every ``step`` bytes from its own start (so on a walk of
    whole huge pages, with ``step`` a multiple of one, every cut falls between huge pages);
    shorter ranges (a worker's slot of each row) are gathered into one step until it is full.
    """
    steps: list[list[Range]] = []
    current: list[Range] = []
    room = step
    for start, end in piece:
        offset = start
        while offset < end:
            if room < step and end - offset > room:
                steps.append(current)  # a range that does not fit begins a step of its own
                current, room = [], step
            take = min(end - offset, room)
            current.append((offset, offset + take))
            offset += take
            room -= take
            if room == 0:
                steps.append(current)
                current, room = [], step
    if current:
        steps.append(current)
    return steps


def prefault_walk(
    mm: mmap.mmap,
    walk: Sequence[Range],
    write: PopulateWrite,
    *,
    path: Path,
    touch: bool = False,
    threads: int = 1,
    granule: int = PAGESIZE,
    allocate_fd: int | None = None,
    progress: Progress | None = None,
) -> None:
    """Fault ``walk`` of ``mm`` (the file at ``path``) in with ``write``, on ``threads`` threads.

    ``touch``: ``write`` is the per-page touch, which holds the GIL: one thread walks it all.
    ``allocate_fd``: the file to allocate each step of with fallocate first; the first refusal
    (a filesystem or mode without it) turns that off for every thread. A failure names
    ``path``, what failed and the bytes it failed on.
    """
    pieces = [list(walk)] if touch else split_walk(walk, threads, granule)
    how = "per-page touch" if touch else "MADV_POPULATE_WRITE"
    allocate = [allocate_fd]  # a list: the first refusal turns it off for all

    def fault(offset: int, length: int) -> None:
        fd = allocate[0]
        if fd is not None:
            try:
                _allocate(fd, offset, length)
            except OSError as e:
                if e.errno not in _NO_FALLOCATE:
                    raise OSError(
                        e.errno,
                        f"{e.strerror} (fallocate of bytes {offset}..{offset + length})",
                        str(path),
                    ) from None
                allocate[0] = None
        try:
            write(mm, offset, length)
        except OSError as e:
            raise OSError(
                e.errno, f"{e.strerror} ({how} of bytes {offset}..{offset + length})", str(path)
            ) from None

    prefault(pieces, fault, progress, granule=granule)


def prefault(
    pieces: Sequence[Sequence[Range]],
    fault: Callable[[int, int], None],
    progress: Progress | None = None,
    *,
    granule: int = PAGESIZE,
) -> None:
    """Run ``fault(offset, length)`` over every piece in steps, one thread per piece.

    A single piece runs on the calling thread. Each thread walks its own piece from the front;
    one that is done takes the last step of the piece with the most steps left, and so on until
    none is left. The scheduler may hold a thread back (another process on its CPU): the walk
    then waits for the step that thread is in, not for the rest of its piece. Steps are cut on
    ``granule`` boundaries, so no two threads fault one huge page.

    Progress ``(done, total)`` is reported from the calling thread only (a callback need not be
    thread-safe), at most every 0.1 s and once at the end, however many small ranges there are.
    The first exception of any thread stops the others at their next step and is raised once
    all of them have returned; so is one that interrupts the caller (Ctrl-C) while it waits.
    """
    step = round_up(POPULATE_STEP, granule)
    queues = [cut_steps(piece, step) for piece in pieces]
    # queues[i][fronts[i]:backs[i]] is what piece i has left: its thread takes from the front,
    # the others from the back. Taking holds the lock for a few list operations per step.
    fronts = [0] * len(queues)
    backs = [len(queue) for queue in queues]
    total = sum(end - start for piece in pieces for start, end in piece)
    counters = [0] * len(pieces)  # one slot per thread: no lock needed to count
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()
    last = {"done": -1, "at": 0.0}

    def report(final: bool = False) -> None:
        done = sum(counters)
        now = time.monotonic()
        if progress is None or done == last["done"] or not (final or now >= last["at"]):
            return
        last["done"], last["at"] = done, now + _PROGRESS_INTERVAL_S
        progress(done, total)

    def take(index: int) -> list[Range] | None:
        with lock:
            if fronts[index] < backs[index]:
                fronts[index] += 1
                return queues[index][fronts[index] - 1]
            victim = max(range(len(queues)), key=lambda i: backs[i] - fronts[i])
            if fronts[victim] < backs[victim]:
                backs[victim] -= 1
                return queues[victim][backs[victim]]
            return None

    def walk(index: int, inline: bool) -> None:
        while not stop.is_set() and (ranges := take(index)) is not None:
            for start, end in ranges:
                if stop.is_set():
                    return
                fault(start, end - start)
                counters[index] += end - start
                if inline:
                    report()

    def guarded(index: int) -> None:
        try:
            walk(index, inline=False)
        except BaseException as e:
            with lock:
                errors.append(e)
            stop.set()

    if len(pieces) <= 1:
        if pieces:
            walk(0, inline=True)
        report(final=True)
        return
    started: list[threading.Thread] = []
    try:
        for index in range(len(pieces)):
            thread = threading.Thread(
                target=guarded, args=(index,), name=f"kvoffload-populate-{index}", daemon=True
            )
            thread.start()
            started.append(thread)
        for thread in started:
            while thread.is_alive():
                thread.join(_PROGRESS_INTERVAL_S)
                if not stop.is_set():
                    report()
    finally:
        # Also on our own interruption: no thread may still fault when the caller unmaps.
        stop.set()
        for thread in started:
            thread.join()
    if errors:
        raise errors[0]
    report(final=True)
