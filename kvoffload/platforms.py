"""Which accelerator this process runs next to, asked the way vLLM asks ``current_platform``.

The specs decide from it where a worker's CPU buffer lives (vLLM maps the shared region
only on CUDA, not ROCm, and XPU). Every answer is computed on first use and kept: torch is
imported only then, so importing a spec (the CLI does, on every Tab press) stays cheap, and
a process without torch simply has no accelerator.

``current_platform`` is one object for the whole library, so a test that replaces
``current_platform.is_cuda_alike`` changes the answer for every module that asks.
"""

from __future__ import annotations

from functools import cached_property


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


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
