"""Which accelerator this process runs next to, asked the way vLLM asks ``current_platform``.

The specs decide from it where a worker's CPU buffer lives (vLLM maps the shared region
only on CUDA, not ROCm, and XPU). Every answer is computed on first use and kept: torch is
imported only then, so importing a spec (the CLI does, on every Tab press) stays cheap, and
a process without torch simply has no accelerator.

``current_platform`` is one object for the whole library, so a test that replaces
``current_platform.is_cuda_alike`` changes the answer for every module that asks.
"""

from __future__ import annotations

import os
from functools import cached_property
from importlib.util import find_spec


class Platform:
    """The accelerator torch sees in this process (none when torch is not installed)."""

    @cached_property
    def _torch_answers(self) -> tuple[bool, bool, bool]:
        try:
            import torch
        except ImportError:
            return False, False, False
        cuda = bool(torch.cuda.is_available())
        rocm = cuda and getattr(torch.version, "hip", None) is not None
        xpu_module = getattr(torch, "xpu", None)
        xpu = bool(xpu_module is not None and xpu_module.is_available())
        return cuda, rocm, xpu

    def is_cuda_alike(self) -> bool:
        """CUDA or ROCm: the platforms torch drives through ``torch.cuda``."""
        return self._torch_answers[0]

    def is_rocm(self) -> bool:
        return self._torch_answers[1]

    def is_xpu(self) -> bool:
        return self._torch_answers[2]

    def is_pin_memory_available(self) -> bool:
        """Whether host memory can be pinned for the accelerator's DMA (vLLM's ``PIN_MEMORY``)."""
        return self.is_cuda_alike() or self.is_xpu()

    def has_triton(self) -> bool:
        """vLLM's ``HAS_TRITON``: Triton is installed and exactly one GPU driver of it is active.

        Where ``CUDA_VISIBLE_DEVICES`` (``HIP_VISIBLE_DEVICES`` on ROCm) is set but empty, as Ray
        sets it while an actor starts, the drivers are not counted: they may become active
        later. Asking imports Triton, so it is asked only when something needs the answer.
        """
        return self._triton_answer

    @cached_property
    def _triton_answer(self) -> bool:
        if find_spec("triton") is None:
            return False
        try:
            from triton.backends import backends  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            return False
        # Triton's CPU backend reports itself active everywhere; vLLM (and Triton) skip it.
        active = [
            b.driver for name, b in backends.items() if name != "cpu" and b.driver and b.driver.is_active()
        ]
        visible = os.environ.get("HIP_VISIBLE_DEVICES" if self.is_rocm() else "CUDA_VISIBLE_DEVICES")
        return (visible is not None and not visible.strip()) or len(active) == 1


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
