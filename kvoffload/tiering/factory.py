"""``SecondaryTierFactory``: builds secondary tiers from their ``secondary_tiers`` entries.

An entry is a JSON object: ``type`` picks the class, either a registered name
(``example``, ``fs``; ``p2p`` and ``obj``, vLLM's own code hosted, see ``tiering/hosted``;
or one added with ``register_tier``) or, with ``module_path``, a
class of that name in that module, so an out-of-tree tier needs no registration at all.
``backpressure`` (optional) picks a detector: ``{"backpressure_cls": ..., "policy_cls":
..., <detector options>}``, short class names meaning those of ``tiering/backpressure``.
Every other key is a constructor option of the tier class.

Registered tiers are imported only when first used, so naming the ``fs`` tier costs
nothing to a deployment that only runs the example tier, and a registered tier whose
module is missing fails where it is configured, not at import.

Where kvoffload is stricter than vLLM: options are checked against the constructor before
it runs, so a typo is a ``ConfigError`` naming ``secondary_tiers[i].<key>`` instead of a
``TypeError`` from deep in a tier; the errors vLLM raises keep vLLM's types too
(``ValueError``, ``ModuleNotFoundError``, ``AssertionError``), so callers written for
either catch them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.errors import ConfigError
from kvoffload.tiering.base import SecondaryTierManager

if TYPE_CHECKING:
    from kvoffload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

_BACKPRESSURE_MODULE = "kvoffload.tiering.backpressure"

# Set by the tiering spec, never by a tier's configuration.
_RESERVED_OPTIONS = frozenset({"offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"})


class TierModuleNotFoundError(ConfigError, ModuleNotFoundError):
    """A tier's ``module_path`` (or a back-pressure class's module) does not import."""


class NotASecondaryTierError(ConfigError, AssertionError):
    """``module_path`` names something that is not a ``SecondaryTierManager`` subclass."""


def _where(index: int) -> str:
    return f"secondary_tiers[{index}]"


def _import_module(module_path: str, key: str) -> Any:
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        raise TierModuleNotFoundError(key, f"cannot import {module_path!r}: {e}") from e
    except TypeError as e:  # a relative name such as ".x"
        raise ConfigError(key, f"cannot import {module_path!r}: {e}") from e


def _import_class(name: str, key: str) -> type:
    """A class by dotted path, or by its bare name in ``tiering/backpressure``."""
    module_path, _, class_name = name.rpartition(".")
    module = _import_module(module_path or _BACKPRESSURE_MODULE, key)
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise ConfigError(key, f"{module.__name__} has no class {class_name!r}")
    return found


class SecondaryTierFactory:
    """The registry of secondary tier types; see the module docstring for the entry format."""

    #: tier type -> a loader returning its class (imported on first use).
    _registry: ClassVar[dict[str, Callable[[], type[SecondaryTierManager]]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Make ``type: tier_type`` build ``module_path.class_name``."""
        if tier_type in cls._registry:
            raise ConfigError("type", f"Tier '{tier_type}' is already registered.")

        def load() -> type[SecondaryTierManager]:
            tier_cls: type[SecondaryTierManager] = getattr(
                _import_module(module_path, f"type {tier_type!r}"), class_name
            )
            return tier_cls

        cls._registry[tier_type] = load

    @classmethod
    def get_tier_class(cls, tier_config: Mapping[str, Any], *, index: int = 0) -> type[SecondaryTierManager]:
        """The class entry ``index`` of ``secondary_tiers`` names."""
        where = _where(index)
        if not isinstance(tier_config, Mapping):
            raise ConfigError(where, f"must be an object, got {type(tier_config).__name__}")
        tier_type = tier_config.get("type")
        if not tier_type:
            raise ConfigError(
                f"{where}.type",
                "Secondary tier configuration must include 'type'",
                fix=f"set type to one of {', '.join(cls._registry)}, or a class name with module_path",
            )
        if not isinstance(tier_type, str):
            raise ConfigError(f"{where}.type", f"must be a string, got {tier_type!r}")
        if tier_type in cls._registry:
            return cls._registry[tier_type]()
        module_path = tier_config.get("module_path")
        if module_path is None:
            raise ConfigError(
                f"{where}.type",
                f"Unknown secondary tier type {tier_type!r} (registered: {', '.join(cls._registry)}); "
                "for an out-of-tree tier, also set 'module_path'",
            )
        if not isinstance(module_path, str):
            raise ConfigError(f"{where}.module_path", f"must be a string, got {module_path!r}")
        log.warning("Loading out-of-tree secondary tier %r from %r", tier_type, module_path)
        tier_cls = getattr(_import_module(module_path, f"{where}.module_path"), tier_type, None)
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise NotASecondaryTierError(
                f"{where}.type",
                f"{module_path}.{tier_type} is not a SecondaryTierManager subclass",
                fix=f"define class {tier_type}(SecondaryTierManager) in {module_path}",
            )
        return tier_cls

    @classmethod
    def create_secondary_tier(
        cls,
        tier_config: Mapping[str, Any],
        primary_kv_view: memoryview,
        offloading_spec: Any,
        *,
        index: int = 0,
    ) -> SecondaryTierManager:
        """Build entry ``index`` of ``secondary_tiers`` over the primary tier's view."""
        where = _where(index)
        tier_cls = cls.get_tier_class(tier_config, index=index)
        options = dict(tier_config)
        tier_type = str(options.pop("type"))
        options.pop("module_path", None)
        locality = options.get("locality")
        detector = cls._build_detector(options.pop("backpressure", None), tier_type, locality, where)
        takes_detector = cls._check_options(tier_cls, options, where)
        if detector is not None and not takes_detector:
            raise ConfigError(
                f"{where}.backpressure", f"secondary tier {tier_cls.__name__} takes no backpressure_detector"
            )
        if takes_detector:
            options["backpressure_detector"] = detector
        try:
            return tier_cls(
                offloading_spec=offloading_spec,
                primary_kv_view=primary_kv_view,
                tier_type=tier_type,
                **options,
            )
        except ConfigError as e:
            if e.key.startswith(where):
                raise
            raise ConfigError(f"{where}.{e.key}", e.message.removeprefix(f"{e.key}: "), fix=e.fix) from e

    @staticmethod
    def _build_detector(
        config: object, tier_type: str, locality: object, where: str
    ) -> BackpressureDetector | None:
        if config is None:
            return None
        key = f"{where}.backpressure"
        if not isinstance(config, Mapping):
            raise ConfigError(key, f"must be an object, got {type(config).__name__}")
        options = dict(config)
        detector_name = options.pop("backpressure_cls", None)
        if not isinstance(detector_name, str) or not detector_name:
            raise ConfigError(
                f"{key}.backpressure_cls",
                "backpressure config must include 'backpressure_cls'",
                fix="e.g. EMABackpressureDetector",
            )
        from kvoffload.tiering.backpressure import BackpressureDetector, BackpressurePolicy

        policy_name = options.pop("policy_cls", None)
        policy = None
        if policy_name:
            policy_cls = _import_class(str(policy_name), f"{key}.policy_cls")
            if not issubclass(policy_cls, BackpressurePolicy):
                raise ConfigError(f"{key}.policy_cls", f"{policy_name} is not a BackpressurePolicy")
            policy = policy_cls()
        detector_cls = _import_class(detector_name, f"{key}.backpressure_cls")
        if not issubclass(detector_cls, BackpressureDetector):
            raise ConfigError(f"{key}.backpressure_cls", f"{detector_name} is not a BackpressureDetector")
        defaults = detector_cls.default_config(
            tier_type, locality=locality if isinstance(locality, str) else None
        )
        for name, value in (defaults or {}).items():
            options.setdefault(name, value)
        try:
            detector: BackpressureDetector = detector_cls(policy=policy, **options)
        except (TypeError, ValueError) as e:
            raise ConfigError(key, str(e)) from e
        return detector

    @staticmethod
    def _check_options(
        tier_cls: type[SecondaryTierManager], options: Mapping[str, object], where: str
    ) -> bool:
        """Refuse unknown, reserved or missing options; True if the class takes a detector."""
        params = inspect.signature(tier_cls).parameters
        clashing = sorted(_RESERVED_OPTIONS & set(options))
        if clashing:
            raise ConfigError(
                f"{where}.{clashing[0]}", "is set by the tiering spec, not the tier configuration"
            )
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        settable = [
            p.name
            for p in params.values()
            if p.name not in _RESERVED_OPTIONS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        unknown = [] if takes_any else sorted(set(options) - set(settable))
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]}",
                f"unknown option for secondary tier {tier_cls.__name__}",
                fix="accepted options: " + (", ".join(settable) or "none"),
            )
        missing = [p.name for p in params.values() if p.name in settable and p.default is p.empty]
        missing = [name for name in missing if name not in options]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}", f"required by secondary tier {tier_cls.__name__}")
        return takes_any or "backpressure_detector" in params


SecondaryTierFactory.register_tier(
    "example", "kvoffload.tiering.example.manager", "ExampleSecondaryTierManager"
)
SecondaryTierFactory.register_tier("fs", "kvoffload.tiering.fs.manager", "FileSystemTierManager")
# vLLM's own tier code, hosted on kvoffload's base (kvoffload.tiering.hosted): they need vLLM
# installed, which the factory says where such a tier is configured, and nowhere else.
SecondaryTierFactory.register_tier("p2p", "kvoffload.tiering.p2p.manager", "P2PSecondaryTierManager")
SecondaryTierFactory.register_tier("obj", "kvoffload.tiering.obj.manager", "ObjectStoreSecondaryTierManager")
