"""Back-pressure for cascades: stop copying into a secondary tier that cannot keep up.

A ``BackpressureDetector`` watches how long a tier's stores take (and whether they fail)
and says when the tier is under pressure; its ``BackpressurePolicy`` decides which
cascades to drop then, and counts what it dropped. The tiering manager asks
``should_store`` before each cascade, and feeds every finished store back through
``update`` or ``on_store_failed``. Dropping a cascade loses nothing: the chunk stays in
the primary tier, it just does not also reach the slow one.

The EMA detector measures seconds per MiB, so jobs of any size compare; its default
water marks (vLLM's) are per storage kind: local NVMe, or a network file system/object
store. A tier entry chooses a detector with ``"backpressure": {"backpressure_cls": ...}``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any


class BackpressurePolicy(ABC):
    """What to do with a store while the detector reports pressure."""

    @abstractmethod
    def should_store(self, detector: BackpressureDetector) -> bool: ...

    @abstractmethod
    def on_store_skipped(self, num_blocks: int) -> None: ...

    @abstractmethod
    def pop_stores_dropped(self) -> tuple[int, int]:
        """``(stores, blocks)`` dropped since the last call; resets both."""

    @abstractmethod
    def reset(self) -> None: ...


class DropAccountingPolicy(BackpressurePolicy):
    """Counts dropped stores and blocks, the same way for every policy built on it."""

    def __init__(self) -> None:
        self._stores_dropped = 0
        self._blocks_dropped = 0

    def on_store_skipped(self, num_blocks: int) -> None:
        self._stores_dropped += 1
        self._blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        dropped = (self._stores_dropped, self._blocks_dropped)
        self._stores_dropped = self._blocks_dropped = 0
        return dropped

    def reset(self) -> None:
        self._stores_dropped = self._blocks_dropped = 0


class DropStorePolicy(DropAccountingPolicy):
    """Drop every store while the tier is under pressure."""

    def should_store(self, detector: BackpressureDetector) -> bool:
        return not detector.is_under_pressure()


class ThrottledDropPolicy(DropAccountingPolicy):
    """Drop a share of stores that grows with how far the EMA is over the high mark.

    The share is ``overshoot / ramp_factor`` (capped at 1), where ``overshoot`` is the
    EMA's excess over the high mark relative to it; the default ramp drops nothing at the
    mark and everything at three times it. Fractions accumulate across decisions, so a
    share of 0.3 drops three stores in ten rather than none: a moderately slow tier keeps
    being filled, a badly congested one is left alone.
    """

    def __init__(self, ramp_factor: float = 2.0) -> None:
        super().__init__()
        self._ramp_factor = ramp_factor
        self._drop_accumulator = 0.0

    def should_store(self, detector: BackpressureDetector) -> bool:
        if not isinstance(detector, EMABackpressureDetector):
            raise TypeError("ThrottledDropPolicy needs an EMABackpressureDetector (it reads the EMA)")
        if not detector.is_under_pressure():
            return True
        high = detector._high
        if high <= 0:
            return False
        share = min(1.0, max(0.0, detector.store_latency_ema - high) / high / self._ramp_factor)
        if share <= 0:
            return True
        if share >= 1.0:
            return False
        self._drop_accumulator += share
        if self._drop_accumulator < 1.0:
            return True
        self._drop_accumulator -= 1.0
        return False

    def reset(self) -> None:
        super().reset()
        self._drop_accumulator = 0.0


class BackpressureDetector(ABC):
    """Turns store completions into a pressure verdict; ``policy`` acts on it."""

    def __init__(self, policy: BackpressurePolicy | None = None) -> None:
        self._policy = policy if policy is not None else ThrottledDropPolicy()

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    @abstractmethod
    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None: ...

    def on_store_failed(self) -> None:
        """A store finished with ``success=False``; ignored unless a detector counts failures."""
        return None

    @abstractmethod
    def is_under_pressure(self) -> bool: ...

    @abstractmethod
    def reset(self) -> None: ...

    def update(self, submit_time: float, num_bytes: int) -> None:
        """A store submitted at ``submit_time`` (``time.monotonic()``) wrote ``num_bytes``."""
        if num_bytes > 0:
            self.on_store_completed(time.monotonic() - submit_time, num_bytes)

    def should_store(self, num_blocks: int) -> bool:
        """Ask the policy; a refusal is counted as ``num_blocks`` dropped."""
        if self._policy.should_store(self):
            return True
        self._policy.on_store_skipped(num_blocks)
        return False

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any] | None:
        """Constructor defaults for a tier of ``tier_type`` (``locality``: ``"LOCAL"``/``"REMOTE"``)."""
        return None

    @property
    def stats(self) -> dict[str, float]:
        return {}


class EMABackpressureDetector(BackpressureDetector):
    """An exponential moving average of store latency, in seconds per MiB.

    * warm-up: the first ``warmup_completions`` stores only seed the EMA (their mean),
      so a cold start never reads as pressure;
    * pressure starts when the EMA rises over ``high_water_s`` and ends when it falls
      under ``low_water_s`` (the gap keeps it from flapping);
    * with no completions (every store dropped), the EMA halves every
      ``decay_half_life_s``, so pressure always ends eventually;
    * for ``cooldown_s`` after pressure ends every other store is dropped, so the
      backlog does not re-congest the tier at once;
    * ``failure_threshold`` consecutive failed stores (a full disk) count as pressure;
    * after a run of fast stores the tier is "healthy" and the policy is skipped.
    """

    _MIB = 1 << 20

    DEFAULT_ALPHA = 0.15
    DEFAULT_WARMUP_COMPLETIONS = 10
    DEFAULT_DECAY_HALF_LIFE_S = 2.0
    DEFAULT_COOLDOWN_S = 1.0
    DEFAULT_FAILURE_THRESHOLD = 3
    # Fast completions in a row before the policy is bypassed.
    _HEALTHY_THRESHOLD = 10
    # Failure-driven pressure sets the EMA this far over the high mark: far enough that
    # the throttled policy drops everything until the decay lets a probe store through.
    _FAILURE_EMA_FACTOR = 4.0

    LOCAL_HIGH_WATER_S = 0.010
    LOCAL_LOW_WATER_S = 0.002
    NETWORK_HIGH_WATER_S = 0.050
    NETWORK_LOW_WATER_S = 0.010

    _NETWORK_TIER_TYPES = frozenset({"obj"})
    # Tiers whose store failures mean the medium is unwell (not one request's problem).
    _STORAGE_TIER_TYPES = frozenset({"fs", "obj"})

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any]:
        remote = locality is not None and locality.upper() == "REMOTE"
        if remote or tier_type in cls._NETWORK_TIER_TYPES:
            config: dict[str, Any] = {
                "high_water_s": cls.NETWORK_HIGH_WATER_S,
                "low_water_s": cls.NETWORK_LOW_WATER_S,
            }
        else:
            config = {"high_water_s": cls.LOCAL_HIGH_WATER_S, "low_water_s": cls.LOCAL_LOW_WATER_S}
        if tier_type in cls._STORAGE_TIER_TYPES:
            config["failure_threshold"] = cls.DEFAULT_FAILURE_THRESHOLD
        return config

    def __init__(
        self,
        high_water_s: float,
        low_water_s: float,
        alpha: float = DEFAULT_ALPHA,
        warmup_completions: int = DEFAULT_WARMUP_COMPLETIONS,
        decay_half_life_s: float = DEFAULT_DECAY_HALF_LIFE_S,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        failure_threshold: int | None = None,
        policy: BackpressurePolicy | None = None,
    ) -> None:
        super().__init__(policy=policy)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if low_water_s > high_water_s:
            raise ValueError(f"low_water_s ({low_water_s}) must be <= high_water_s ({high_water_s})")
        if failure_threshold is not None and failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._alpha = alpha
        self._high = high_water_s
        self._low = low_water_s
        self._warmup_completions = warmup_completions
        self._decay_half_life_s = decay_half_life_s
        self._cooldown_s = cooldown_s
        self._failure_threshold = failure_threshold
        self._warmup_samples: list[float] = []
        self._clear()

    def _clear(self) -> None:
        self._ema = 0.0
        self._under_pressure = False
        self._completions = 0
        self._warmup_samples.clear()
        self._last_update = 0.0  # time.monotonic() of the last EMA change, for the decay
        self._healthy_streak = 0
        self._pressure_cleared_at = 0.0  # 0: no cooldown running
        self._cooldown_count = 0
        self._consecutive_failures = 0
        # Failure-driven pressure may begin during warm-up and must be able to decay then.
        self._failure_tripped = False

    def _decay_while_idle(self) -> None:
        now = time.monotonic()
        idle = now - self._last_update
        if idle > 0 and self._decay_half_life_s > 0:
            self._ema *= 0.5 ** (idle / self._decay_half_life_s)
            self._last_update = now

    def _end_pressure(self, now: float) -> None:
        self._under_pressure = False
        self._failure_tripped = False
        self._pressure_cleared_at = now
        self._cooldown_count = 0

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        now = time.monotonic()
        sample = elapsed_s / (num_bytes / self._MIB)
        self._consecutive_failures = 0
        self._completions += 1
        if self._completions <= self._warmup_completions:
            self._warmup_samples.append(sample)
            if self._completions == self._warmup_completions:
                self._ema = sum(self._warmup_samples) / len(self._warmup_samples)
                self._last_update = now
            return
        self._ema = self._alpha * sample + (1 - self._alpha) * self._ema
        self._last_update = now
        if self._ema > self._high:
            self._under_pressure = True
            self._pressure_cleared_at = 0.0
            self._healthy_streak = 0
        elif self._ema < self._low:
            if self._under_pressure:
                self._pressure_cleared_at = now
                self._cooldown_count = 0
            self._under_pressure = False
            self._failure_tripped = False
            self._healthy_streak += 1
        else:
            self._healthy_streak = 0

    def on_store_failed(self) -> None:
        if self._failure_threshold is None:
            return
        self._consecutive_failures += 1
        self._healthy_streak = 0
        if self._consecutive_failures < self._failure_threshold:
            return
        self._ema = max(self._ema, self._high * self._FAILURE_EMA_FACTOR)
        self._last_update = time.monotonic()
        self._under_pressure = True
        self._failure_tripped = True
        self._pressure_cleared_at = 0.0

    def is_under_pressure(self) -> bool:
        warmed_up = self._completions >= self._warmup_completions
        if self._under_pressure and (warmed_up or self._failure_tripped):
            self._decay_while_idle()
            if self._ema < self._low:
                self._end_pressure(time.monotonic())
        return self._under_pressure

    def is_healthy(self) -> bool:
        """A run of fast stores and no pressure: ``should_store`` skips the policy."""
        return not self._under_pressure and self._healthy_streak >= self._HEALTHY_THRESHOLD

    def should_store(self, num_blocks: int) -> bool:
        under_pressure = self.is_under_pressure()
        if self.is_healthy():
            return True
        cooling = (
            not under_pressure
            and self._pressure_cleared_at > 0
            and time.monotonic() - self._pressure_cleared_at < self._cooldown_s
        )
        if cooling:
            self._cooldown_count += 1
            if self._cooldown_count % 2 == 0:
                self._policy.on_store_skipped(num_blocks)
                return False
        return super().should_store(num_blocks)

    def reset(self) -> None:
        self._clear()
        self._policy.reset()

    @property
    def store_latency_ema(self) -> float:
        return self._ema

    @store_latency_ema.setter
    def store_latency_ema(self, value: float) -> None:
        self._ema = value

    @property
    def stats(self) -> dict[str, float]:
        return {"store_latency_ema": self._ema, "consecutive_store_failures": self._consecutive_failures}
