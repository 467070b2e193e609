"""OffloadingSpecFactory: from ``kv_connector_extra_config.spec_name`` to a spec class.

The registry maps a name to a loader, so naming a spec imports nothing until it is
chosen (the CLI never pays for torch this way). A name not in the registry is looked up
in ``spec_module_path``, vLLM's hook for out-of-tree specs; whatever is found there must
be an ``OffloadingSpec``, checked before it is instantiated.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kvoffload.base import OffloadingSpec
from kvoffload.config import OffloadingConfig
from kvoffload.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_SPEC_NAME = "CPUOffloadingSpec"


class OffloadingSpecFactory:
    _registry: ClassVar[dict[str, Callable[[], type[OffloadingSpec]]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` load ``class_name`` from ``module_path`` when a config first asks for it."""
        if name in cls._registry:
            raise ConfigError("spec_name", f"Connector '{name}' is already registered.")

        def load() -> type[OffloadingSpec]:
            return _spec_class(importlib.import_module(module_path), class_name, module_path)

        cls._registry[name] = load

    @classmethod
    def get_spec_cls(cls, extra_config: Mapping[str, Any]) -> type[OffloadingSpec]:
        spec_name = extra_config.get("spec_name", DEFAULT_SPEC_NAME)
        loader = cls._registry.get(spec_name)
        if loader is not None:
            return loader()
        module_path = extra_config.get("spec_module_path")
        if module_path is None:
            raise ConfigError(
                "kv_connector_extra_config.spec_name",
                f"Unsupported spec type: {spec_name}",
                fix="use " + " or ".join(cls._registry) + ", or name its module in spec_module_path",
            )
        log.warning("loading out-of-tree offloading spec %r from %r", spec_name, module_path)
        return _spec_class(importlib.import_module(module_path), spec_name, module_path)

    @classmethod
    def create_spec(cls, config: OffloadingConfig) -> OffloadingSpec:
        spec_cls = cls.get_spec_cls(config.extra_config)
        log.info("creating offloading spec %s", spec_cls.__name__)
        return spec_cls(config)


def _spec_class(module: object, name: str, module_path: str) -> type[OffloadingSpec]:
    found = getattr(module, name, None)
    if not (isinstance(found, type) and issubclass(found, OffloadingSpec)):
        raise ConfigError(
            "kv_connector_extra_config.spec_module_path",
            f"{module_path}.{name} is not an OffloadingSpec subclass",
            fix="name a module that defines the spec class",
        )
    return found


OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "kvoffload.cpu.spec", "CPUOffloadingSpec")
OffloadingSpecFactory.register_spec(
    "TieringOffloadingSpec", "kvoffload.tiering.spec", "TieringOffloadingSpec"
)
