"""kvoffload.syscalls: the libc calls Python does not wrap, each failing as ``os``'s calls do.

Here beside the mount lookup, its first user outside the region (``fstatfs``); the region's
calls (``madvise``, ``fallocate``, ``mmap`` at a fixed address) are exercised on real files by
tests/cpu as well. Files live in ``tmp_path``; every mapping is closed before the test ends.
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import syscalls
from kvoffload.shm import mounts
from tests.support.procs import REPO


def test_importing_the_module_does_not_import_ctypes() -> None:
    # `shmctl --help` and every Tab press must not pay for ctypes; it comes with the first call.
    code = "import sys, kvoffload.syscalls; print('ctypes' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "False\n"


def test_the_filesystem_type_of_a_bad_fd_is_an_os_error_and_unknown_to_the_mount_lookup() -> None:
    with pytest.raises(OSError, match="Bad file descriptor") as info:
        syscalls.fstatfs_type(-1)
    assert info.value.errno == errno.EBADF
    assert mounts.filesystem_magic(-1) is None


def test_dev_shm_is_a_tmpfs_by_its_magic_number() -> None:
    fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert syscalls.fstatfs_type(fd) == mounts.TMPFS_MAGIC
        assert mounts.memory_filesystem(fd) == "tmpfs"
    finally:
        os.close(fd)


def test_an_advice_the_kernel_does_not_know_fails_with_einval_and_no_file_name() -> None:
    with mmap.mmap(-1, mmap.PAGESIZE) as mm, pytest.raises(OSError, match="Invalid argument") as info:
        syscalls.madvise(syscalls.address_of(mm), mmap.PAGESIZE, 0x7FFF)
    assert (info.value.errno, info.value.filename) == (errno.EINVAL, None)


def test_fallocate_keeping_the_size_allocates_without_growing_the_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"kept")
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            syscalls.fallocate(fd, syscalls.FALLOC_FL_KEEP_SIZE, 0, 1 << 20)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            pytest.skip(f"{tmp_path}'s filesystem has no fallocate")
        st = os.fstat(fd)
        assert (st.st_size, st.st_blocks * 512 >= 1 << 20) == (4, True)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"kept"


def test_a_file_mapped_at_a_fixed_address_replaces_the_reservation_there(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"F" * mmap.PAGESIZE)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(-1, 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=prot) as reserved:
            address = syscalls.address_of(reserved) + mmap.PAGESIZE
            syscalls.mmap_fixed(address, mmap.PAGESIZE, prot, mmap.MAP_SHARED, fd, 0)
            assert reserved[mmap.PAGESIZE : mmap.PAGESIZE + 2] == b"FF"
            assert reserved[0:1] == b"\0"
    finally:
        os.close(fd)
