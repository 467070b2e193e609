"""SharedOffloadRegion: the CPU KV-offload region in the shm root, as vLLM 0.33 lays it out.

One engine maps one region, ``{root}/vllm_offload_{engine_id}.mmap`` (plus segment files
``.mmap.1 ...`` for large regions, split as ``kvoffload.cpu.segments`` says), shared by every
worker and by the tiering scheduler. Rows are chunks; a worker of rank r owns bytes
``[r * cpu_page_size, (r+1) * cpu_page_size)`` of every row; the scheduler side (``rank=None``)
maps the whole region.

What we keep from vLLM, byte for byte: the names (the class's constructor, attributes and
methods, and the module's helpers ``_wait_for_file_size``, ``check_shm_free_space``,
``_get_populate_write_fn``, ``_madvise_populate_write``, ``_fallback_populate_write`` and
``_MIN_SEGMENT_BYTES``, looked up at call time so a test can replace them), the sizing, creator
election by ``O_CREAT|O_EXCL`` with mode 0600, segment files sized before the base file, joiners
waiting for the base file's size, MAP_SHARED, pre-faulting with MADV_POPULATE_WRITE probed once
per mapping (EINVAL falls back to a byte-preserving per-page touch), the barrier (the creator
unlinks the path once every worker has mapped it; a participant that fails still arrives at
every barrier it owes), creator-only unlink, and host registration undone at cleanup.

What we add, because vLLM leaks (issues #51579, #54002, #57303):

* Liveness that tools can read from the kernel: every participant holds
  ``flock(LOCK_SH)`` on the base file for as long as it maps it, and the creator stores
  an owner record (pid, start time, boot id) as an xattr. A region nobody holds can be
  proven dead with one ``LOCK_EX|LOCK_NB``; the lock dies with its holder, even on SIGKILL.
* No leak after startup: participants join an attach ledger (one OFD byte-range lock
  per participant, far beyond the data, independent of flock). The participant that
  sees every expected participant attached unlinks the path. Nobody unlinks before
  the last expected participant has attached, so a late participant can never create a
  second, disconnected file (the split-brain vLLM #57313 ran into). ``lifetime="vllm"``
  keeps vLLM 0.33's behaviour (path kept until the creator's graceful cleanup).
* Every unlink checks that the name still refers to the inode we created, so an old
  generation never deletes a newer engine's file that reuses the name (vLLM #57422).
* A failure anywhere in construction releases everything acquired so far, in reverse
  order, and re-raises the original exception; a release step that fails is logged.

Pre-faulting (``populate``) covers what vLLM's participant covers: the whole region, its
``populate_shard`` share, or a worker's slot of every row. The region decides which, and
whether the creator reserves the files first; ``kvoffload.cpu.prefault`` plans the walk
(threads, huge pages, where each worker starts) and runs it. A fault that fails because the
root filled up is raised as ``InsufficientSpaceError``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvoffload import faults, syscalls
from kvoffload.cpu.host_register import host_unregister
from kvoffload.cpu.prefault import (
    PopulateWrite,
    Progress,
    Range,
    advise_huge_pages,
    allocate_each_step,
    check_populate_threads,
    madvise_populate_write,
    merge_ranges,
    plan_prefault,
    prefault_walk,
    probe_populate_write,
    reserve_before_faults,
    round_up,
    touch_populate_write,
)
from kvoffload.cpu.segments import MIN_SEGMENT_BYTES, plan_segments
from kvoffload.errors import (
    ConfigError,
    CreatorFailedError,
    InsufficientSpaceError,
    JoinTimeoutError,
    RegionError,
    RegionReleasedError,
    RootError,
    ViewOverflowError,
)
from kvoffload.release import Journal, release_all
from kvoffload.shm import mounts, names
from kvoffload.shm.names import DEFAULT_ROOT
from kvoffload.shm.owner import OwnerRecord, read_owner, write_owner

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PAGESIZE = mmap.PAGESIZE
#: vLLM's name for the minimum segment size (``kvoffload.cpu.segments``), read when a region
#: is made: a test that replaces it here changes how the next region is split.
_MIN_SEGMENT_BYTES = MIN_SEGMENT_BYTES
#: Byte-range locks of the attach ledger live here, far past any data offset.
LEDGER_OFFSET = 1 << 62
_FLOCK_STRUCT = "hhqqi4x"  # struct flock on 64-bit Linux: type, whence, start, len, pid

Lifetime = Literal["kvoffload", "vllm"]

#: vLLM's names for the two ways to pre-fault (``kvoffload.cpu.prefault``), looked up at call
#: time: a test that replaces one here changes what the next region does.
_madvise_populate_write: PopulateWrite = madvise_populate_write
_fallback_populate_write: PopulateWrite = touch_populate_write


def _get_populate_write_fn(mm: mmap.mmap) -> PopulateWrite:
    """How to pre-fault ``mm``: MADV_POPULATE_WRITE where it works (Linux >= 5.14), else the touch.

    Probed on the mapping's first page, once per mapping.
    """
    if probe_populate_write(mm, _madvise_populate_write):
        return _madvise_populate_write
    log.warning("MADV_POPULATE_WRITE is not supported; falling back to per-page writes (slower start)")
    return _fallback_populate_write


def _wait_for_file_size(
    fd: int,
    expected_size: int,
    timeout: float = 30.0,
    *,
    poll_interval: float = 0.005,
    path: Path | str | None = None,
) -> None:
    """Wait until the file open at ``fd`` has ``expected_size`` bytes (its creator sized it).

    Fails fast with ``CreatorFailedError`` (a ``RuntimeError``) when the file was unlinked
    meanwhile (the creator gave up and removed it) or when a kvoffload creator died before
    sizing it (its owner record is there but nobody holds the liveness lock); a vLLM creator
    keeps no lock, so only the ``timeout`` (``JoinTimeoutError``, a ``TimeoutError``) tells.
    """
    where = path if path is not None else f"/proc/self/fd/{fd}"
    deadline = time.monotonic() + timeout
    next_probe = 0.0
    while True:
        st = os.fstat(fd)
        if st.st_size >= expected_size:
            return
        if st.st_nlink == 0:
            raise CreatorFailedError(
                where,
                "the region's creator failed during initialization: it removed the file before sizing it",
            )
        now = time.monotonic()
        if now >= next_probe:
            next_probe = now + 0.05
            _fail_if_creator_died(fd, where)
        if now >= deadline:
            raise JoinTimeoutError(
                where,
                f"timed out after {timeout:g}s waiting for the region to reach {expected_size} bytes "
                f"(it has {st.st_size})",
                fix="check that the creating process is alive; `shmctl scan` shows the file's holders",
            )
        time.sleep(poll_interval)


def _fail_if_creator_died(fd: int, where: Path | str) -> None:
    """A kvoffload creator holds LOCK_SH from its first instant; none held means it died."""
    record = read_owner(fd)
    if record is None:
        return  # a vLLM creator keeps no lock: only the timeout can tell
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
    raise CreatorFailedError(
        where,
        f"the region's creator failed: it (pid {record.pid}) died before sizing the region",
        fix=f"`shmctl reap --engine {record.engine_id}` removes the orphan; then start again",
    )


def check_shm_free_space(
    required_bytes: int,
    shm_path: Path | str = DEFAULT_ROOT,
    *,
    allocation_name: str = "the CPU KV offload region",
) -> None:
    """Raise ``InsufficientSpaceError`` if the filesystem of ``shm_path`` has less free than needed.

    ``shm_path`` is any path on the shm mount; the region passes its own file, so the check
    is of the filesystem the file is really on (a bind mount or a per-pod emptyDir included).
    """
    vfs = os.statvfs(shm_path)
    free = vfs.f_bavail * vfs.f_frsize
    if required_bytes > free:
        log.info("Not enough space for %s: %d bytes needed, %d free", allocation_name, required_bytes, free)
        raise InsufficientSpaceError(shm_path, required_bytes, free)


class SharedOffloadRegion:
    """The shared CPU KV-offload region of one engine (see the module docstring).

    ``rank=None`` maps the whole region (scheduler side); ``rank=r`` is worker slot r.
    ``participant``/``participants`` enable the attach ledger: this is participant
    ``participant`` of ``participants`` expected; with ``lifetime="kvoffload"`` the path is
    unlinked once all of them have attached.

    vLLM's attributes are here under vLLM's names (``mmap_path``, ``mmap_obj``, ``fd``,
    ``total_size_bytes``, ``_row_stride``, ``_segments``, ``_creator``, ``_base``, ``is_pinned``,
    ``pinned_addresses``), since vLLM's worker code and tests read them.
    """

    BLOCK_SIZE_ALIGNMENT = PAGESIZE

    def __init__(
        self,
        engine_id: str,
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        barrier: Callable[[], object] | None = None,
        *,
        creator_memory_check: Callable[[int], object] | None = None,
        populate_shard: tuple[int, int] | None = None,
        num_segments: int = 1,
        root: Path | str = DEFAULT_ROOT,
        participant: int | None = None,
        participants: int | None = None,
        lifetime: Lifetime = "kvoffload",
        join_timeout_s: float = 30.0,
        poll_interval_s: float = 0.005,
        min_segment_bytes: int | None = None,
        populate: bool | Literal["madvise", "touch"] = True,
        populate_threads: int | None = None,
        reserve: bool | None = None,
        progress: Progress | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.engine_id = names.validate_engine_id(engine_id)
        self._validate(
            num_chunks, rank, kv_bytes_per_chunk, cpu_page_size, populate_shard, participant, participants
        )
        threads = check_populate_threads(populate_threads)
        if lifetime not in ("kvoffload", "vllm"):
            raise ConfigError("lifetime", f"{lifetime!r} is neither 'kvoffload' nor 'vllm'")
        self.num_chunks = num_chunks
        self.rank = rank
        self.page_size = PAGESIZE
        self._row_stride = kv_bytes_per_chunk
        self.cpu_page_size = cpu_page_size
        self.total_size_bytes = num_chunks * kv_bytes_per_chunk
        self.root = Path(root)
        self.lifetime: Lifetime = lifetime
        self.participant = participant
        self.participants = participants
        if min_segment_bytes is None:
            min_segment_bytes = _MIN_SEGMENT_BYTES  # vLLM's name, looked up now (see above)
        self.segments = plan_segments(
            engine_id, num_chunks, kv_bytes_per_chunk, num_segments, min_segment_bytes
        )
        self.path = self.root / self.segments[0].name
        self.mmap_path = str(self.path)
        #: (path, offset, length) of every file, as vLLM lists them.
        self._segments = [(str(self.root / seg.name), seg.offset, seg.length) for seg in self.segments]
        #: Did this participant create the files? (``_creator``: does it still own their names?)
        self.creator = False
        self.unlinked = False
        self.populated_with: str | None = None
        #: How the root's mount backs the files: "never" (4 KiB pages), "always", "within_size", "advise".
        self.mount = mounts.root_mount(self.root)
        self.huge_pages = self.mount.huge_pages if self.mount is not None else "never"
        #: What this participant pre-faults, in the order it walks it (empty without populate).
        self.populate_walk: tuple[Range, ...] = ()
        #: Threads the pre-fault runs on (0 without populate).
        self.populate_threads = 0
        self._granule = PAGESIZE
        if populate:
            self._plan_populate(populate_shard, threads, populate)
        if reserve is None:
            reserve = reserve_before_faults(populate, self.huge_pages, self.populate_threads)
        self._reserve = reserve

        self._dir_fd = -1
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._identities: dict[str, tuple[int, int]] = {}  # name -> (st_dev, st_ino) we created
        self._base_tensor: torch.Tensor | None = None
        self._views: list[Any] = []
        #: Host registrations (``cudaHostRegister``) that cleanup undoes, last first.
        self.is_pinned = False
        self.pinned_addresses: list[int] = []
        self._worker_offset = 0 if rank is None else rank * cpu_page_size
        self._canonical_offset = 0
        self._released = False
        #: Every release step (init unwind and cleanup) in order, with its outcome.
        self.journal = journal if journal is not None else Journal()
        self._barrier = barrier
        self._barriers_owed = 0 if barrier is None else (2 if populate_shard is not None else 1)

        with ExitStack() as undo:
            # LIFO: peers waiting at our barrier are released last, after our own undo.
            undo.callback(self._release_owed_barriers)
            self._open(undo, creator_memory_check, join_timeout_s, poll_interval_s)
            faults.point("region.mmap")
            self._map(undo)
            faults.point("region.attach")
            self._attach()
            if populate:
                faults.point("region.populate")
                self._populate(progress, None if populate is True else populate)
            if populate_shard is not None and self._barrier is not None:
                self._call_barrier()
            undo.pop_all()

    # ----------------------------------------------------------------- validation

    @staticmethod
    def _validate(
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        populate_shard: tuple[int, int] | None,
        participant: int | None,
        participants: int | None,
    ) -> None:
        if num_chunks <= 0:
            raise ConfigError(
                "num_chunks", f"must be positive, got {num_chunks}", fix="raise cpu_bytes_to_use"
            )
        if kv_bytes_per_chunk <= 0 or kv_bytes_per_chunk % PAGESIZE:
            raise ConfigError(
                "kv_bytes_per_chunk",
                f"{kv_bytes_per_chunk} is not a positive multiple of the page size {PAGESIZE}",
            )
        if cpu_page_size <= 0 or cpu_page_size > kv_bytes_per_chunk:
            raise ConfigError("cpu_page_size", f"{cpu_page_size} is outside 1..{kv_bytes_per_chunk}")
        if rank is not None and (rank < 0 or (rank + 1) * cpu_page_size > kv_bytes_per_chunk):
            raise ConfigError("rank", f"worker slot {rank} does not fit a row of {kv_bytes_per_chunk} bytes")
        if populate_shard is not None and not 0 <= populate_shard[0] < populate_shard[1]:
            raise ConfigError("populate_shard", f"{populate_shard} is not (index, count) with index < count")
        if (participant is None) != (participants is None):
            raise ConfigError("participants", "participant and participants go together")
        if participant is not None and participants is not None and not 0 <= participant < participants:
            raise ConfigError("participant", f"{participant} is outside 0..{participants - 1}")

    # ----------------------------------------------------------------- open/size

    def _open(
        self,
        undo: ExitStack,
        memory_check: Callable[[int], object] | None,
        join_timeout_s: float,
        poll_interval_s: float,
    ) -> None:
        try:
            self._dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RootError(self.root, "does not exist", fix="create it or pass another root") from None
        except NotADirectoryError:
            raise RootError(self.root, "is not a directory", fix="pass the shm mount point") from None
        undo.callback(self.journal.quietly, f"close root fd of {self.path.name}", self._close_dir_fd)
        base = self.segments[0]
        faults.point("region.open")
        # The election can lose a race with a creator that fails and unlinks between our
        # EEXIST and our open; try again rather than report a spurious failure.
        for _attempt in range(3):
            try:
                self._fd = os.open(
                    base.name,
                    os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=self._dir_fd,
                )
                self.creator = True
                break
            except FileExistsError:
                pass
            try:
                self._fd = os.open(base.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
                break
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._join_error(e) from None
        else:
            raise CreatorFailedError(self.path, "the file kept vanishing between create and join")
        undo.callback(self.journal.quietly, f"close fd of {self.path.name}", self._close_fd)
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError(self.path, "is not a regular file", fix="remove it; it was not made by vLLM")
        self._identities[base.name] = (st.st_dev, st.st_ino)
        if self.creator:
            # From here on an unwind removes what we created (inode-checked).
            undo.callback(self.journal.quietly, f"unlink {self.path.name} (creator)", self._unlink_created)
            # Hold the liveness lock before anything can observe the file, then say who we are.
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            write_owner(self._fd, OwnerRecord.for_current_process(self.engine_id))
            self._size_as_creator(memory_check)
        else:
            _wait_for_file_size(
                self._fd, base.length, join_timeout_s, poll_interval=poll_interval_s, path=self.path
            )
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            if os.fstat(self._fd).st_nlink == 0:
                raise CreatorFailedError(self.path, "was removed while this participant joined")

    def _join_error(self, error: OSError) -> RegionError:
        """Why an existing entry at the region's name cannot be joined, with the fix."""
        if error.errno == errno.ELOOP:
            return RegionError(self.path, "is a symbolic link; refusing to follow it", fix="remove the link")
        if error.errno == errno.EISDIR:
            return RegionError(self.path, "is a directory, not a region file", fix="remove or rename it")
        if error.errno in (errno.EACCES, errno.EPERM):
            return RegionError(
                self.path,
                "exists and belongs to someone else (permission denied)",
                fix="`sudo shmctl scan --json` shows whose it is (uid); pick another engine_id or remove it",
            )
        return RegionError(self.path, f"cannot be joined: {error.strerror}")

    def _size_as_creator(self, memory_check: Callable[[int], object] | None) -> None:
        faults.point("region.space")
        if memory_check is not None:
            memory_check(self.total_bytes)
        check_shm_free_space(
            self.total_bytes, self.path, allocation_name=f"CPU KV offload shared region in {self.root}"
        )
        vfs = os.fstatvfs(self._fd)
        free = vfs.f_bavail * vfs.f_frsize
        faults.point("region.truncate")
        # Joiners wait for the base file, so it is sized last: once it has its size,
        # every segment file exists with its own.
        for seg in self.segments[1:]:
            fd = os.open(
                seg.name,
                os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=self._dir_fd,
            )
            try:
                st = os.fstat(fd)
                self._identities[seg.name] = (st.st_dev, st.st_ino)
                self._size_file(fd, seg.length, free)
            finally:
                os.close(fd)
        self._size_file(self._fd, self.segments[0].length, free)
        log.info("Created mmap file %s (%.2f GB)", self.path, self.total_bytes / 1e9)

    def _size_file(self, fd: int, length: int, free: int) -> None:
        if not self._reserve:
            os.ftruncate(fd, length)
            return
        # A root that fills up meanwhile fails here with ENOSPC, before any joiner maps the
        # file, instead of in the middle of populate (vLLM #54002). See _should_reserve for when.
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise InsufficientSpaceError(self.path, self.total_bytes, free) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, length)

    # ----------------------------------------------------------------- map/attach

    def _map(self, undo: ExitStack) -> None:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if len(self.segments) == 1:
            self._mm = mmap.mmap(self._fd, self.total_bytes, flags=mmap.MAP_SHARED, prot=prot)
            undo.callback(self.journal.quietly, f"unmap {self.path.name}", self._close_mapping)
            return
        # Several files, one contiguous address range: reserve it anonymously, then map
        # each segment file over its part (MAP_FIXED), as vLLM does.
        self._mm = mmap.mmap(-1, self.total_bytes, flags=mmap.MAP_PRIVATE, prot=prot)
        undo.callback(self.journal.quietly, f"unmap {self.path.name}", self._close_mapping)
        base_addr = syscalls.address_of(self._mm)
        for seg in self.segments:
            if seg.index == 0:
                fd = self._fd
            else:
                fd = os.open(seg.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
                st = os.fstat(fd)
                self._identities.setdefault(seg.name, (st.st_dev, st.st_ino))
            try:
                syscalls.mmap_fixed(base_addr + seg.offset, seg.length, prot, mmap.MAP_SHARED, fd, 0)
            except OSError as e:
                raise OSError(e.errno, f"mmap of {seg.name} failed: {e.strerror}") from None
            finally:
                if fd != self._fd:
                    os.close(fd)

    def _attach(self) -> None:
        if self._barrier is not None:
            self._call_barrier()
            if self.creator:
                self._unlink_created()
        if self.participant is None or self.participants is None:
            return
        try:
            self._ledger_lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, self.participant)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RegionError(
                self.path,
                f"participant slot {self.participant} is already attached by another process",
                fix="each worker needs its own rank; is a second engine using the same engine_id?",
            ) from None
        if self.lifetime == "kvoffload" and self.attached_participants() >= self.participants:
            # Everyone expected has mapped it: nobody else will open this name again.
            self._unlink_created(any_participant=True)

    @staticmethod
    def _ledger_lock(fd: int, cmd: int, kind: int, slot: int) -> int:
        packed = struct.pack(_FLOCK_STRUCT, kind, os.SEEK_SET, LEDGER_OFFSET + slot, 1, 0)
        result = fcntl.fcntl(fd, cmd, packed)
        return int(struct.unpack(_FLOCK_STRUCT, result)[0])

    def attached_participants(self) -> int:
        """How many ledger slots are held now, by any process (ours included)."""
        if self.participants is None or self._fd < 0:
            return 0
        count = 0
        for slot in range(self.participants):
            if slot == self.participant:
                count += 1
                continue
            if self._ledger_lock(self._fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, slot) != fcntl.F_UNLCK:
                count += 1
        return count

    def _call_barrier(self) -> None:
        assert self._barrier is not None
        self._barriers_owed -= 1
        self._barrier()

    def _release_owed_barriers(self) -> None:
        # Peers block in the barrier until we arrive; a failed participant still arrives.
        while self._barriers_owed > 0 and self._barrier is not None:
            self._barriers_owed -= 1
            self.journal.quietly("release peers at the barrier", self._barrier)

    # ----------------------------------------------------------------- populate

    def _first_walk_row(self, walkers: int = 1) -> int:
        """The row worker ``rank``'s walk starts at: its own fraction of the rows, as in vLLM.

        ``walkers`` threads per worker cut the walk in as many pieces, so the fraction is of
        workers times threads: every thread of every worker starts somewhere else.
        """
        assert self.rank is not None
        slots = max(1, self._row_stride // self.cpu_page_size)
        return self.rank * self.num_chunks // (slots * max(1, walkers))

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        """This worker's slot of every row as page-aligned ``(offset, length)``, in walk order.

        On a region of several files the walk starts at the worker's own fraction of the rows
        and wraps around (vLLM's order), so workers start on different files.
        """
        if self.rank is None:
            raise RegionError(self.mmap_path, "the scheduler-side region has no worker slot")
        first = self._first_walk_row() if len(self._segments) > 1 else 0
        lo = self.rank * self.cpu_page_size
        for i in range(self.num_chunks):
            row = (first + i) % self.num_chunks
            start = row * self._row_stride + lo
            aligned = start - start % self.page_size
            yield aligned, round_up(start + self.cpu_page_size, self.page_size) - aligned

    def slot_ranges(self) -> list[tuple[int, int]]:
        """Page-aligned (start, end) byte ranges this worker's slots cover, sorted and merged."""
        return merge_ranges(sorted((at, at + length) for at, length in self.iter_worker_slot_ranges()))

    def _plan_populate(
        self, shard: tuple[int, int] | None, threads: int | None, populate: bool | str
    ) -> None:
        """What this participant pre-faults, in which order, on how many threads."""
        if shard is not None:
            share = round_up(-(-self.total_bytes // shard[1]), PAGESIZE)
            start = min(self.total_bytes, shard[0] * share)
            ranges = [(start, min(self.total_bytes, start + share))]
        elif self.rank is not None:
            ranges = self.slot_ranges()
        else:
            ranges = [(0, self.total_bytes)]
        huge_page = mounts.huge_page_size() if self.huge_pages != "never" else None

        def start_at(walkers: int) -> int:
            return self._first_walk_row(walkers) * self.row_stride

        # Start on other files than the other workers (page-cache inserts are serialised per
        # file); on huge pages, also on other huge pages: widened slots of workers overlap.
        rotated = (
            shard is None and self.rank is not None and (len(self.segments) > 1 or self.huge_pages != "never")
        )
        plan = plan_prefault(
            ranges,
            self.segments,
            huge_page=huge_page,
            threads=threads,
            touch=populate == "touch",
            participants=self.participants,
            start_at=start_at if rotated else None,
        )
        self.populate_walk, self.populate_threads, self._granule = plan.walk, plan.threads, plan.granule

    def _populate(self, progress: Progress | None, method: str | None) -> None:
        assert self._mm is not None
        if self.huge_pages == "advise":
            # huge=advise gives huge pages only to mappings that ask, and only faults after it.
            advise_huge_pages(self._mm, self.total_bytes, self.path)
        try:
            self._populate_with(progress, method)
        except OSError as e:
            space = self._space_error(e)
            if space is None:
                raise
            raise space from e

    def _populate_with(self, progress: Progress | None, method: str | None) -> None:
        assert self._mm is not None
        mm = self._mm
        # Module globals, looked up now: a caller (or vLLM's tests) may have replaced them.
        if method is None:
            write = _get_populate_write_fn(mm)
        else:
            write = _madvise_populate_write if method == "madvise" else _fallback_populate_write
        touch = write is _fallback_populate_write
        self.populated_with = "touch" if touch else "madvise"
        if touch:
            self.populate_threads = 1  # the per-page touch holds the GIL: threads would take turns
        allocate = allocate_each_step(self.huge_pages, len(self.segments), self.creator and self._reserve)
        prefault_walk(
            mm,
            self.populate_walk,
            write,
            path=self.path,
            touch=touch,
            threads=self.populate_threads,
            granule=self._granule,
            allocate_fd=self._fd if allocate else None,
            progress=progress,
        )

    def _space_error(self, error: OSError) -> InsufficientSpaceError | None:
        """The space error a fault really is when the root filled up (vLLM #54002's EFAULT)."""
        if error.errno not in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC) or self._fd < 0:
            return None
        vfs = os.fstatvfs(self._fd)
        free = vfs.f_bavail * vfs.f_frsize
        if free >= self.total_bytes - self._resident_bytes():
            return None
        return InsufficientSpaceError(self.path, self.total_bytes, free)

    def _resident_bytes(self) -> int:
        resident = 0
        for name in self._identities:
            with contextlib.suppress(OSError):
                resident += os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_blocks * 512
        return resident

    # ----------------------------------------------------------------- views

    @property
    def base_tensor(self) -> torch.Tensor:
        base = self._base
        if base is None:
            raise RegionReleasedError(self.path, "Shared offload region has been released.")
        return base

    @property
    def _base(self) -> torch.Tensor | None:
        """The whole mapping as one int8 tensor (vLLM's attribute); None once released.

        Made on first use, so a region that moves no KV data (the CLI, a scan's probe) never
        imports torch.
        """
        if self._base_tensor is None and not self._released and self._mm is not None:
            import torch

            # Through a memoryview, so the mapping stays exported (mmap.close() refuses) while any
            # tensor view lives: torch.frombuffer on the mmap itself takes no export.
            self._base_tensor = torch.frombuffer(memoryview(self._mm), dtype=torch.int8)
        return self._base_tensor

    @_base.setter
    def _base(self, tensor: torch.Tensor | None) -> None:
        self._base_tensor = tensor

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next ``(num_chunks, tensor_page_size)`` slice of this worker's slot in every row."""
        import torch

        if self.rank is None:
            raise RegionError(self.path, "the scheduler-side region has no worker slot")
        end = self.rank * self.cpu_page_size + self.cpu_page_size
        if self._worker_offset + tensor_page_size > end:
            raise ViewOverflowError(
                self.path,
                f"Worker offset {self._worker_offset} + {tensor_page_size} exceeds worker area end {end}",
            )
        view = torch.as_strided(
            self.base_tensor, (self.num_chunks, tensor_page_size), (self.row_stride, 1), self._worker_offset
        )
        self._worker_offset += tensor_page_size
        self._views.append(view)
        return view

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next slice from the row start, the same bytes for every worker (canonical layout)."""
        import torch

        if self._canonical_offset + tensor_page_size > self.row_stride:
            raise ViewOverflowError(
                self.path,
                f"canonical offset {self._canonical_offset} + {tensor_page_size} exceeds the row stride "
                f"{self.row_stride}",
            )
        view = torch.as_strided(
            self.base_tensor,
            (self.num_chunks, tensor_page_size),
            (self.row_stride, 1),
            self._canonical_offset,
        )
        self._canonical_offset += tensor_page_size
        self._views.append(view)
        return view

    def create_kv_memoryview(self) -> memoryview:
        """The region as ``(num_chunks, row_stride)`` int8 rows (vLLM's format); chunk c is ``view[c]``."""
        if self._released or self._mm is None:
            raise RegionReleasedError(self.path, "Shared offload region has been released.")
        view = memoryview(self._mm).cast("b", (self.num_chunks, self.row_stride))
        self._views.append(view)
        return view

    # ----------------------------------------------------------------- release

    @property
    def closed(self) -> bool:
        return self._released

    @property
    def fd(self) -> int | None:
        """The base file's descriptor; None once cleanup closed it."""
        return self._fd if self._fd >= 0 else None

    @property
    def mmap_obj(self) -> mmap.mmap | None:
        """The mapping; None once unmapped (cleanup keeps it while buffers are still exported)."""
        return self._mm

    @property
    def _creator(self) -> bool:
        """Does this participant still own the files' names (vLLM's flag)? False once unlinked."""
        return self.creator and not self.unlinked

    @property
    def row_stride(self) -> int:
        return self._row_stride

    @property
    def total_bytes(self) -> int:
        return self.total_size_bytes

    @property
    def identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the base file as this participant opened it."""
        if self._fd < 0:
            return None
        st = os.fstat(self._fd)
        return (st.st_dev, st.st_ino)

    def cleanup(self) -> None:
        """Release views, the mapping, the fd and (creator only, same inode) the files. Idempotent.

        Every step runs even if an earlier one fails; the first failure is raised at the end.
        """
        if self._released:
            return
        self._released = True
        name = self.path.name
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.is_pinned:
            steps.append((f"unregister pinned host memory of {name}", self._unpin))
        steps += [
            (f"unmap {name}", self._unmap_reporting_faults),
            (f"close fd of {name}", self._close_fd),
        ]
        if self.creator and not self.unlinked and self._names_still_ours():
            steps.append((f"unlink {name} (creator)", self._unlink_created))
        steps.append((f"close root fd of {name}", self._close_dir_fd))
        release_all(steps, journal=self.journal)

    def _unpin(self) -> None:
        """Undo every host registration, last first, before the memory can be unmapped."""
        if not self.is_pinned:
            return
        addresses = list(self.pinned_addresses) or [self._base_address()]
        self.pinned_addresses.clear()
        self.is_pinned = False
        failures: list[BaseException] = []
        for address in reversed(addresses):
            try:
                host_unregister(address)
            except Exception as e:  # every registration is undone, whichever fails
                log.warning("host_unregister(%#x) of %s failed: %s", address, self.path, e)
                failures.append(e)
        if failures:
            raise failures[0]

    def _base_address(self) -> int:
        if self._base_tensor is not None:
            return int(self._base_tensor.data_ptr())
        return syscalls.address_of(self._mm) if self._mm is not None else 0

    def _unmap_reporting_faults(self) -> None:
        # Fault point ``cleanup.region``: the step reports a failure, the unmap still happens.
        try:
            faults.point("cleanup.region")
        finally:
            self._close_mapping()

    def _close_mapping(self) -> None:
        # Views hold exports of the buffer; drop ours first or close() raises BufferError.
        # Pop rather than iterate: a loop variable would keep the last view (and with it the
        # export) alive in this frame while we close.
        while self._views:
            view = self._views.pop()
            if isinstance(view, memoryview):
                view.release()
            del view
        self._base = None
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError:
            # The last views may be garbage in a reference cycle (an exception's traceback
            # during a failed shutdown); collect it once before deciding they are really alive.
            gc.collect()
            try:
                self._mm.close()
            except BufferError:
                # Someone still exports the buffer: unmapping would leave it dangling.
                log.warning("Keeping %s mapped: buffers are still exported to native users", self.path)
                return
        self._mm = None

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _close_dir_fd(self) -> None:
        if self._dir_fd >= 0:
            fd, self._dir_fd = self._dir_fd, -1
            os.close(fd)

    def _unlink_created(self, any_participant: bool = False) -> None:
        """Remove the region's files if the names still refer to the inodes this region maps.

        Only the creator unlinks at cleanup; ``any_participant`` is the ledger's unlink by
        whoever sees the last expected participant attach.
        """
        if self.unlinked or self._dir_fd < 0 or not (self.creator or any_participant):
            return
        for name, ident in self._identities.items():
            self._unlink_if_same(name, ident)
        self.unlinked = True

    def _names_still_ours(self) -> bool:
        """Does any name still refer to an inode we created? (The ledger may have unlinked them.)"""
        for name, ident in self._identities.items():
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                return True
        return False

    def _unlink_if_same(self, name: str, ident: tuple[int, int]) -> None:
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != ident:
            # A newer engine reused the name; its file is not ours to delete.
            log.warning("Not unlinking %s: it now names another file (inode %d)", name, st.st_ino)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)
        log.info("Unlinked mmap file %s", self.root / name)

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        side = "scheduler" if self.rank is None else f"rank {self.rank}"
        return f"SharedOffloadRegion({self.path}, {side}, {self.total_bytes} bytes, creator={self.creator})"


#: Moved to kvoffload.cpu.prefault and kvoffload.cpu.segments; kept here for one release (issue
#: #29), as are the moved names imported above for the region's own use (Progress, Range,
#: PopulateWrite, merge_ranges, check_populate_threads, probe_populate_write, plan_segments,
#: MIN_SEGMENT_BYTES).
from kvoffload.cpu.prefault import (  # noqa: E402, F401
    DEFAULT_MAX_POPULATE_THREADS,
    MAX_POPULATE_THREADS,
    cut_steps,
    default_populate_threads,
    prefault,
    rotate,
    split_walk,
    widen_to_huge_pages,
)
from kvoffload.cpu.segments import Segment  # noqa: E402, F401
