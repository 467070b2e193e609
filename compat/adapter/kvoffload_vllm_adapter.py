"""Load kvoffload under vLLM's module names, so vLLM's own tests run against it.

`make vllm-compat` puts this folder on PYTHONPATH for the kvoffload run; `sitecustomize.py` beside
it installs the finder at interpreter start, so children started by spawn or forkserver see the
same names as the test process.

The mapping is a plain rename: `vllm.v1.kv_offload.<path>` is `kvoffload.<path>`, except for the
few modules kvoffload keeps elsewhere (listed in RENAMED). The name and the kvoffload module are
one object, so a test that patches `vllm.v1.kv_offload.cpu.shared_offload_region.X` patches what
kvoffload runs. A vLLM module kvoffload lacks fails to import: vLLM's own copy is never loaded in
its place. Everything outside `vllm.v1.kv_offload` comes from vLLM's source tree unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

PREFIX = "vllm.v1.kv_offload"

# vLLM module (relative to PREFIX) -> kvoffload module, where the path is not the same.
RENAMED: dict[str, str] = {
    "": "kvoffload",
}


def kvoffload_name(vllm_name: str) -> str:
    """The kvoffload module that stands for `vllm_name` (a module under PREFIX)."""
    rest = vllm_name[len(PREFIX) :].lstrip(".")
    return RENAMED.get(rest) or f"kvoffload.{rest}"


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """The kvoffload module ran when it was imported under its own name."""


class KvoffloadAsVllm(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        name = kvoffload_name(fullname)
        found = importlib.util.find_spec(name)
        if found is None:
            raise ModuleNotFoundError(f"kvoffload has no {name} for vLLM's {fullname}", name=fullname)
        spec = importlib.machinery.ModuleSpec(
            fullname, _Alias(name), is_package=found.submodule_search_locations is not None
        )
        if found.submodule_search_locations is not None:
            spec.submodule_search_locations = list(found.submodule_search_locations)
        return spec


def install() -> None:
    if not any(isinstance(f, KvoffloadAsVllm) for f in sys.meta_path):
        sys.meta_path.insert(0, KvoffloadAsVllm())
