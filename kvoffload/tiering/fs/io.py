"""Block files: batched copies between the primary view and one file per block.

A block is ``block_size`` bytes at ``offset`` in the primary view (viewed as flat bytes).

Stores are atomic: the bytes go to a temporary file beside the target, opened
``O_EXCL`` under a random name, and are ``os.replace``-d onto the block's name, so a
reader on any host sees the whole block or no file. File names are content hashes, so a
block already in place is never rewritten, and losing the publish race to another writer
(some shared filesystems refuse the rename with ``EEXIST``) is a success: the winner
wrote the same bytes.

Loads read the whole block (looping over partial reads; only end-of-file ends one
early). A file whose size is not the block size fails the load. When it is shorter, it is
provably corrupt (stores are atomic) and is removed, but only if the name still points at
the file that was read: a writer that replaced it meanwhile published a good block, which
stays. A longer file is another layout's block: it fails the load and stays. Any other
error (a missing file, a transient ``ELOOP`` or ``EIO``) leaves the file alone, since
removing it would turn a passing fault into lost data.

``O_DIRECT`` (bypassing the page cache) is used when the caller asks, which it does only
once ``probe_o_direct`` has shown the directory takes it and the view is aligned for it.

Every failure is a ``TierIOError`` naming the file; a failed batched load says in
``num_succeeded`` how many blocks it loaded before the failing one, so the tier can keep
them. kvoffload has no C extension for these loops: ``_HAS_FSIO_C`` is always False and
exists for callers that ask.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Sequence

from kvoffload.errors import ConfigError, TierIOError

log = logging.getLogger(__name__)

#: Linux only; 0 elsewhere, which disables direct I/O.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
#: The alignment direct I/O needs of buffers, offsets and lengths (a page covers every device).
DIRECT_IO_ALIGNMENT = mmap.PAGESIZE
_HAS_FSIO_C = False


def _tmp_name(path: str) -> str:
    # Random, not pid/thread based: writers on other hosts share the directory.
    return f"{path}.{secrets.token_hex(8)}.tmp"


def probe_o_direct(directory: str) -> bool:
    """Whether ``O_DIRECT`` writes and reads work in ``directory``.

    Some filesystems (overlayfs under a container's ``/tmp``, older tmpfs, some NFS) refuse
    it with ``EINVAL``; probing once lets the tier fall back to buffered I/O instead of
    failing every block.
    """
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".o_direct_probe.{secrets.token_hex(8)}")
    # An anonymous mapping is page-aligned, as direct I/O needs.
    page = mmap.mmap(-1, DIRECT_IO_ALIGNMENT)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        try:
            os.readv(fd, [page])
        finally:
            os.close(fd)
    except OSError as e:
        log.debug("O_DIRECT probe in %s failed: %r", directory, e)
        return False
    else:
        return True
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def _check_offsets(view: memoryview, offsets: Sequence[int], block_size: int) -> None:
    # A slice past the end silently clips; refuse before anything is read or written.
    total = view.nbytes
    for offset in offsets:
        if offset < 0 or offset + block_size > total:
            raise ConfigError(
                "chunk_ids",
                f"block at byte {offset} (size {block_size}) is outside the primary view ({total} bytes)",
            )


def _store_block(path: str, block: memoryview, use_o_direct: bool) -> None:
    if os.path.exists(path):
        return  # content-addressed: the bytes there are these bytes
    tmp = _tmp_name(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | (O_DIRECT if use_o_direct else 0), 0o644)
        try:
            done = 0
            while done < len(block):
                with block[done:] as rest:
                    written = os.write(fd, rest)
                if written <= 0:
                    raise TierIOError(tmp, f"write stopped at {done} of {len(block)} bytes")
                done += written
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except FileExistsError:
            os.remove(tmp)  # another writer published the same block first
    except BaseException as e:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        except OSError as cleanup:
            log.warning("cannot remove temporary block file %s: %r", tmp, cleanup)
        if isinstance(e, OSError) and not isinstance(e, TierIOError):
            raise TierIOError(path, f"cannot store the block: {e.strerror or e}", errno=e.errno) from e
        raise


def _remove_if_same_file(path: str, read: os.stat_result) -> None:
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (read.st_dev, read.st_ino):
            os.remove(path)
        else:
            log.info("%s was replaced while it was read; the new file stays", path)
    except FileNotFoundError:
        pass
    except OSError as e:
        # Never let this hide the short read that the caller is about to report.
        log.warning("cannot remove corrupt block file %s: %r", path, e)


def _load_block(path: str, block: memoryview, use_o_direct: bool) -> None:
    size = len(block)
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if use_o_direct else 0))
    except OSError as e:
        raise TierIOError(path, f"cannot open the block: {e.strerror or e}", errno=e.errno) from e
    try:
        info = os.fstat(fd)
        if info.st_size > size:
            raise TierIOError(
                path,
                f"holds {info.st_size} bytes, not the block size {size}: another layout wrote it",
                fix="give engines with different KV layouts different root_dir values",
            )
        done = 0
        while done < size:
            with block[done:] as rest:
                got = os.readv(fd, [rest])
            if got == 0:
                break
            done += got
    except TierIOError:
        raise
    except OSError as e:
        raise TierIOError(path, f"cannot read the block: {e.strerror or e}", errno=e.errno) from e
    finally:
        os.close(fd)
    if done < size:
        _remove_if_same_file(path, info)
        raise TierIOError(path, f"short read: {done} of {size} bytes; the corrupt file was removed")


def batch_store_block(
    paths: Sequence[str],
    view: memoryview,
    offsets: Sequence[int],
    block_size: int,
    use_o_direct: bool = True,
) -> None:
    """Store block ``i`` (``block_size`` bytes at ``offsets[i]`` in ``view``) as ``paths[i]``.

    Stops at the first failure, which it raises.
    """
    _check_offsets(view, offsets, block_size)
    with view.cast("B") as flat:
        for path, offset in zip(paths, offsets, strict=True):
            with flat[offset : offset + block_size] as block:
                _store_block(path, block, use_o_direct)


def batch_load_block(
    paths: Sequence[str],
    view: memoryview,
    offsets: Sequence[int],
    block_size: int,
    use_o_direct: bool = True,
) -> None:
    """Load ``paths[i]`` into the ``block_size`` bytes at ``offsets[i]`` in ``view``.

    Stops at the first failure and raises it, with ``num_succeeded`` set to the number of
    blocks loaded before it.
    """
    _check_offsets(view, offsets, block_size)
    with view.cast("B") as flat:
        for i, (path, offset) in enumerate(zip(paths, offsets, strict=True)):
            try:
                with flat[offset : offset + block_size] as block:
                    _load_block(path, block, use_o_direct)
            except TierIOError as e:
                e.num_succeeded = i
                raise
