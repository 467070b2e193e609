"""Pinning memory that already exists (the shared region's mapping) for DMA, as vLLM does.

The region is mapped by several processes, so it cannot come from the accelerator's pinned
allocator; it is registered after the fact with ``cudaHostRegister``. Pinning only makes
copies faster: where registration is unavailable (no CUDA runtime, another platform, a
refusal) ``host_register`` returns False and transfers stay correct, just pageable.

The CUDA runtime is reached through ctypes and loaded once, on first use: importing this
module (the region does, and the CLI imports the region) loads neither torch nor CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path

from kvoffload.platforms import current_platform

log = logging.getLogger(__name__)


def _find_cudart() -> str:
    """The CUDA runtime this process already loaded (torch's), else the system's."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.rsplit(" ", 1)[-1]
            if "libcudart" in Path(path).name:
                return path
    except OSError:
        pass
    return ctypes.util.find_library("cudart") or "libcudart.so"


class CudaRTLibrary:
    """The three CUDA runtime calls host registration needs. Raises OSError without a runtime."""

    def __init__(self, path: str | None = None) -> None:
        lib = ctypes.CDLL(path or _find_cudart())
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_int

    # CUDA's names, as vLLM's wrapper spells them.
    def cudaHostRegister(self, ptr: int, size: int, flags: int = 0) -> int:
        return int(self._register(ptr, size, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._unregister(ptr))

    def cudaGetLastError(self) -> int:
        """Read and clear the runtime's sticky error, so a refusal does not fail the next call."""
        return int(self._last_error())


@functools.cache
def _get_cudart() -> CudaRTLibrary:
    return CudaRTLibrary()


def _load_cudart() -> CudaRTLibrary | None:
    try:
        return _get_cudart()
    except (AssertionError, AttributeError, OSError):
        log.warning("Could not load the CUDA runtime for host registration; the region stays pageable")
        return None


def host_register(ptr: int, num_bytes: int) -> bool:
    """Pin ``num_bytes`` of host memory at ``ptr``. True if it was (``host_unregister`` undoes it)."""
    if not ptr or num_bytes <= 0:
        return False
    if not current_platform.is_cuda_alike():
        log.info("Host registration is not available here; KV offload copies use pageable memory")
        return False
    cudart = _load_cudart()
    if cudart is None:
        return False
    result = cudart.cudaHostRegister(ptr, num_bytes)
    if result != 0:
        cudart.cudaGetLastError()
        log.warning("cudaHostRegister failed (code %d); copies stay correct but slower (pageable)", result)
        return False
    return True


def host_unregister(ptr: int) -> None:
    """Undo ``host_register`` of the range that starts at ``ptr``."""
    if not ptr or not current_platform.is_cuda_alike():
        return
    cudart = _load_cudart()
    if cudart is None:
        return
    result = cudart.cudaHostUnregister(ptr)
    if result != 0:
        cudart.cudaGetLastError()
        log.warning("cudaHostUnregister failed (code %d)", result)
