"""kvoffload's specs inside a real vLLM engine, as vLLM's out-of-tree offloading specs.

vLLM loads a spec it does not know by name from ``kv_connector_extra_config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvoffloadCPUOffloadingSpec",
                                   "spec_module_path": "kvoffload.vllm_engine.specs",
                                   "cpu_bytes_to_use": 8388608}}

(``KvoffloadTieringOffloadingSpec`` for the tiering spec). The names differ from kvoffload's
own class names on purpose: vLLM's factory looks ``CPUOffloadingSpec`` and
``TieringOffloadingSpec`` up in its registry first, and would load its own.

Layout. ``translate`` holds the version shims, pure and importable without vLLM (the suite
tests them without it): kvoffload's values become vLLM's at the connector's boundary, and
vLLM's become kvoffload's, because the connector compares enums by identity and checks
classes with ``isinstance``. ``specs`` imports vLLM and defines the two spec classes over
them; only an engine imports it.

What differs between vLLM 0.32 and 0.33 (kvoffload mirrors 0.33), as far as a spec sees it:

- 0.32's ``OffloadingManager`` has no ``lock()``, ``config_info()`` or ``on_reset_flushed()``,
  and its spec classes no ``config_info_keys``: the engine never calls them, and the shims
  forward them only where the engine's base class has them.
- 0.32's ``LoadStoreSpec`` has no ``medium()``; its ``GPULoadStoreSpec`` requires
  ``group_sizes`` and ``block_indices``. The shims convert by field, never by class.
- Both hand ``get_worker`` vLLM's ``CanonicalKVCaches`` and build the spec from vLLM's
  ``OffloadingConfig`` with the same fields kvoffload reads.
- 0.32's own CPU spec refuses every platform but CUDA-alike and XPU at engine start; kvoffload's
  spec maps the shared region on every platform (``shared_region=True`` on CPU), and its worker
  moves blocks with bounds-checked host copies where the KV cache is in host memory.
"""

from __future__ import annotations

#: ``spec_module_path`` of kvoffload's specs for a vLLM engine.
SPEC_MODULE_PATH = "kvoffload.vllm_engine.specs"
#: ``spec_name`` of each kvoffload spec, by kvoffload's own class name.
SPEC_NAMES = {
    "CPUOffloadingSpec": "KvoffloadCPUOffloadingSpec",
    "TieringOffloadingSpec": "KvoffloadTieringOffloadingSpec",
}

__all__ = ["SPEC_MODULE_PATH", "SPEC_NAMES"]
