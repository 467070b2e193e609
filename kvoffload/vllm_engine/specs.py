"""kvoffload's CPU and tiering specs as vLLM out-of-tree specs (``spec_module_path`` here).

Imported by a vLLM engine's connector, in the scheduler process and in every worker; it imports
vLLM, so nothing else in kvoffload imports it. Each class subclasses vLLM's ``OffloadingSpec``
(vLLM's factory checks it) and holds kvoffload's spec of the same name, built from the engine's
config with ``translate.to_kvoffload_config``; the manager and the worker it hands the engine
are kvoffload's, behind ``translate.EngineManager`` and ``translate.EngineWorker``.

Where the region lives: on a CUDA-alike or XPU platform kvoffload's spec decides as vLLM does
(the shared region on CUDA and XPU, private buffers on ROCm). Elsewhere (vLLM's CPU platform,
where vLLM 0.32's own spec refuses to start) the shared region is mapped anyway and the worker
moves blocks between it and the host KV cache with host memory copies.

Init failures keep kvoffload's contract: whatever kvoffload's ``get_manager`` or
``create_worker`` acquired is released before the original exception reaches the engine,
which then fails to start with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    OffloadingManager as _VllmManager,
)
from vllm.v1.kv_offload.base import (
    OffloadingSpec as _VllmSpec,
)
from vllm.v1.kv_offload.base import (
    OffloadingWorker as _VllmWorker,
)

from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.tiering.spec import TieringOffloadingSpec
from kvoffload.vllm_engine.translate import (
    EngineManager,
    EngineTypes,
    EngineWorker,
    region_lifetime,
    region_root,
    shared_region_choice,
    to_engine_metrics,
    to_kvoffload_caches,
    to_kvoffload_config,
)

TYPES = EngineTypes.from_vllm()


class _Manager(EngineManager, _VllmManager):  # type: ignore[misc]
    """``EngineManager`` that is also a vLLM ``OffloadingManager``."""


class _Worker(EngineWorker, _VllmWorker):  # type: ignore[misc]
    """``EngineWorker`` that is also a vLLM ``OffloadingWorker``."""


class _KvoffloadSpec(_VllmSpec):  # type: ignore[misc]
    kvoffload_spec: ClassVar[type[CPUOffloadingSpec]]

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, Any]:
        return to_engine_metrics(cls.kvoffload_spec.build_metric_definitions(extra_config), TYPES)

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        return cls.kvoffload_spec.config_info_keys(extra_config)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: kvoffload's spec, which does the work.
        self.spec = self.kvoffload_spec(
            to_kvoffload_config(config),
            shared_region=shared_region_choice(),
            lifetime=region_lifetime(config.extra_config),
            root=region_root(config.extra_config),
        )
        self.replicated_layout = self.spec.replicated_layout
        self._engine_manager: _Manager | None = None
        self._engine_worker: _Worker | None = None

    def get_manager(self) -> _Manager:
        if self._engine_manager is None:
            self._engine_manager = _Manager(self.spec.get_manager(), TYPES)
        return self._engine_manager

    def create_worker(self, kv_caches: Any) -> _Worker:
        return _Worker(self.spec.create_worker(to_kvoffload_caches(kv_caches)), TYPES)

    def get_worker(self, kv_caches: Any) -> _Worker:
        if self._engine_worker is None:
            self._engine_worker = self.create_worker(kv_caches)
        return self._engine_worker


class KvoffloadCPUOffloadingSpec(_KvoffloadSpec):
    """kvoffload's ``CPUOffloadingSpec`` in a vLLM engine."""

    kvoffload_spec = CPUOffloadingSpec


class KvoffloadTieringOffloadingSpec(_KvoffloadSpec):
    """kvoffload's ``TieringOffloadingSpec`` in a vLLM engine."""

    kvoffload_spec = TieringOffloadingSpec


__all__ = ["TYPES", "KvoffloadCPUOffloadingSpec", "KvoffloadTieringOffloadingSpec"]
