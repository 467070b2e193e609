"""Secondary tiers whose code is vLLM's own, hosted on kvoffload's tiering base.

vLLM 0.33's p2p tier (ZMQ control plane, peer sessions, NIXL data plane: about 5,900
lines) and its object-store tier (about 500) are not re-implemented here.
``kvoffload.tiering.p2p`` and ``kvoffload.tiering.obj`` are packages whose modules are
vLLM's source files, read from the installed ``vllm`` distribution and executed under
kvoffload's names, with every ``vllm.v1.kv_offload.<x>`` import in them bound to
``kvoffload.<x>``. So the tier classes subclass kvoffload's ``SecondaryTierManager``, key
with kvoffload's ``OffloadKey``, look up through kvoffload's ``AsyncLookupManager`` and are
built by kvoffload's factory and driven by kvoffload's ``TieringOffloadingManager``, under
its lock, poll thread and cleanup contract. Everything else they import (``vllm.envs``,
``vllm.logger``, ``vllm.distributed.nixl_utils``, ``zmq``, ``msgspec``) is vLLM's and its
dependencies', so these tiers need vLLM 0.33 installed. Without it, importing either
package is a ``ModuleNotFoundError`` that says so, and configuring ``type: p2p`` or
``type: obj`` is the factory's ``TierModuleNotFoundError``; nothing else changes.

Invariants:

* nothing looks for vLLM until a hosted package is imported (``import kvoffload`` and
  ``shmctl`` never do);
* a hosted module exists once, under kvoffload's name: vLLM's name for it (under
  ``compat/adapter``) is the same object, so a test's patch reaches what runs;
* a kv_offload name is only ever kvoffload's inside hosted code: a plain ``import
  vllm.v1.kv_offload.x`` (which would bind vLLM's copy through the ``vllm`` package) is
  refused at import instead of silently mixing the two;
* vLLM's tree is only read: no bytecode is written next to its sources;
* each hosted module is guarded as it is executed (``kvoffload.tiering.hosted_wrappers``): named
  fault points at the tiers' stages, and what a failed constructor or shutdown had built
  released (vLLM 0.33 leaks it).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.tiering import hosted_wrappers

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: The prefix of every module vLLM's tier code imports that kvoffload provides.
VLLM_PREFIX = "vllm.v1.kv_offload"
#: Hosted kvoffload package -> its directory relative to vLLM's ``vllm`` package.
HOSTED: Mapping[str, str] = {
    "kvoffload.tiering.p2p": "v1/kv_offload/tiering/p2p",
    "kvoffload.tiering.obj": "v1/kv_offload/tiering/obj",
}


def kvoffload_name(vllm_name: str) -> str:
    """The kvoffload module that stands for ``vllm_name`` (a module under ``VLLM_PREFIX``)."""
    return "kvoffload" + vllm_name[len(VLLM_PREFIX) :]


def is_hosted(module_name: str) -> bool:
    """Whether ``module_name`` is (or is inside) a hosted package: its code is vLLM's."""
    return any(module_name == p or module_name.startswith(p + ".") for p in HOSTED)


def vllm_package_dir() -> Path | None:
    """The installed ``vllm`` package's directory, found without importing it; None without vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def host(package: str) -> list[str]:
    """Make ``package`` (a key of ``HOSTED``) load vLLM's modules; its ``__path__``.

    Called by the hosted package's ``__init__``. Runs vLLM's ``__init__.py`` of that
    package in the package's namespace, so whatever it defines is there too.
    """
    vllm_dir = vllm_package_dir()
    source_dir = None if vllm_dir is None else vllm_dir / HOSTED[package]
    if source_dir is None or not source_dir.is_dir():
        tier = package.rsplit(".", 1)[-1]
        why = "vLLM is not installed" if vllm_dir is None else f"{vllm_dir} has no {HOSTED[package]}"
        raise ModuleNotFoundError(
            f"{package}: the {tier} tier is vLLM 0.33's own code, hosted by kvoffload, and {why}; "
            "install vllm==0.33.* to use it",
            name=package,
        )
    if not any(isinstance(f, HostedTierFinder) for f in sys.meta_path):
        # In front of the path finder, which would load vLLM's files without the import binding.
        sys.meta_path.insert(0, HostedTierFinder())
    module = sys.modules[package]
    init = source_dir / "__init__.py"
    if init.is_file():
        _run_hosted(module, init)
    return [str(source_dir)]


class HostedTierFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of the hosted packages in vLLM's tree; answers for nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package = next((p for p in HOSTED if fullname.startswith(p + ".")), None)
        if package is None:
            return None
        parent = sys.modules.get(package)
        roots = getattr(parent, "__path__", None)
        if not roots:
            return None
        base = Path(roots[0]).joinpath(*fullname[len(package) + 1 :].split("."))
        if (base / "__init__.py").is_file():
            origin, locations = base / "__init__.py", [str(base)]
        elif base.with_suffix(".py").is_file():
            origin, locations = base.with_suffix(".py"), None
        else:
            return None
        return importlib.util.spec_from_file_location(
            fullname,
            origin,
            loader=HostedSourceLoader(fullname, str(origin)),
            submodule_search_locations=locations,
        )


class HostedSourceLoader(importlib.machinery.SourceFileLoader):
    """vLLM's source file, executed with its kv_offload imports bound to kvoffload."""

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__builtins__"] = _HOSTED_BUILTINS
        super().exec_module(module)
        hosted_wrappers.apply(module)

    def set_data(self, path: str, data: Buffer, *, _mode: int = 0o666) -> None:
        """No bytecode cache: vLLM's tree is read, never written."""


def _run_hosted(module: types.ModuleType, source: Path) -> None:
    module.__dict__["__builtins__"] = _HOSTED_BUILTINS
    code = compile(source.read_bytes(), str(source), "exec", dont_inherit=True)
    exec(code, module.__dict__)


def _hosted_import(
    name: str,
    globals: Mapping[str, Any] | None = None,
    locals: Mapping[str, Any] | None = None,
    fromlist: Sequence[str] | None = (),
    level: int = 0,
) -> types.ModuleType:
    """``__import__`` for hosted code: ``vllm.v1.kv_offload.<x>`` is ``kvoffload.<x>``."""
    if level == 0 and (name == VLLM_PREFIX or name.startswith(VLLM_PREFIX + ".")):
        if not fromlist:
            raise ImportError(
                f"hosted vLLM code may only from-import kv_offload names, not `import {name}` "
                "(that would bind vLLM's own copy through the vllm package)",
                name=name,
            )
        return builtins.__import__(kvoffload_name(name), globals, locals, fromlist, 0)
    return builtins.__import__(name, globals, locals, fromlist, level)


#: The builtins of every hosted module: Python's, with the import binding above.
_HOSTED_BUILTINS: dict[str, Any] = {**vars(builtins), "__import__": _hosted_import}
