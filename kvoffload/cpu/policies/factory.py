"""Cache policies by name: the built-in ones, registered ones, and out-of-tree ones by module path.

A registered name maps to a loader, so naming a policy imports nothing until it is
used. An unregistered name with ``cache_policy_module_path`` is imported from that
module, so a project can bring its own policy without registering it anywhere. Every
failure is a ``ConfigError`` (a ``ValueError``) naming the setting at fault, raised when
the manager is built rather than at the first eviction.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import ClassVar

from kvoffload.cpu.policies.base import CachePolicy
from kvoffload.errors import ConfigError

log = logging.getLogger(__name__)

#: The names ``eviction_policy`` accepts without a module path.
KNOWN_POLICIES = ("lru", "arc")


def _import_policy(module_path: str, class_name: str, setting: str) -> type[CachePolicy]:
    try:
        module = importlib.import_module(module_path)
    except (ImportError, TypeError) as e:  # TypeError: a relative name such as ".x"
        raise ConfigError(
            "cache_policy_module_path",
            f"cannot import {module_path!r}: {e}",
            fix="name an importable module that defines the policy class",
        ) from e
    policy_cls = getattr(module, class_name, None)
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
        raise ConfigError(
            setting,
            f"{module_path}.{class_name} is not a CachePolicy subclass",
            fix=f"define class {class_name}(kvoffload.cpu.policies.base.CachePolicy) in {module_path}",
        )
    return policy_cls


class CachePolicyFactory:
    """Resolves ``eviction_policy`` (and ``cache_policy_module_path``) to a policy class."""

    _registry: ClassVar[dict[str, Callable[[], type[CachePolicy]]]] = {}

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` stand for ``module_path.class_name``, imported on first use."""
        if name in cls._registry:
            raise ConfigError("eviction_policy", f"cache policy {name!r} is already registered")

        def load() -> type[CachePolicy]:
            return _import_policy(module_path, class_name, "eviction_policy")

        cls._registry[name] = load

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type[CachePolicy]:
        """The class ``name`` is registered as, or else class ``name`` of ``module_path``."""
        load = cls._registry.get(name)
        if load is not None:
            return load()
        if not module_path:
            raise ConfigError(
                "eviction_policy",
                f"Unknown cache policy {name!r}; registered: {', '.join(cls._registry)}",
                fix="for an out-of-tree policy also set cache_policy_module_path",
            )
        log.warning(
            "Loading out-of-tree cache policy %s from %s (an experimental interface)", name, module_path
        )
        return _import_policy(module_path, name, "eviction_policy")


CachePolicyFactory.register_cache_policy("lru", "kvoffload.cpu.policies.lru", "LRUCachePolicy")
CachePolicyFactory.register_cache_policy("arc", "kvoffload.cpu.policies.arc", "ARCCachePolicy")
