"""Durations as operators type them: ``30s``, ``5m``, ``2h``, ``1d``, ``1h30m``, ``90``.

A bare number is seconds. Units may be combined from largest to smallest, each at most
once (``1d12h``, ``2m30s``); fractions are allowed (``1.5h``). A duration is never
negative and never longer than ``MAX_DURATION_S`` (366 days): every duration here is a
wait, a grace or an age, and past that it is a typo; far past it ``time.sleep`` and
deadline arithmetic overflow. The error names the option it came from, so the CLI can
print one line.
"""

from __future__ import annotations

import math
import re

from kvoffload.errors import ConfigError

_UNITS: dict[str, float] = {
    "w": 7 * 86400.0,
    "d": 86400.0,
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 0.001,
}
_ORDER = ("w", "d", "h", "m", "s", "ms")
_TERM = re.compile(r"(?P<value>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<unit>ms|[wdhms])")
_BARE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
EXAMPLES = "250ms, 30s, 5m, 2h, 1d, 1h30m or a number of seconds"
#: A year (a leap one): the longest grace, age, settle or timeout anyone means.
MAX_DURATION_S = 366 * 86400.0
_MAX_TEXT = "366d"


def parse_duration(text: str, *, option: str = "duration") -> float:
    """Seconds in ``text``; ``ConfigError(option, ...)`` when it is not a duration."""
    spec = text.strip().lower().replace(" ", "")
    if _BARE.fullmatch(spec):
        return _bounded(float(spec), text, option)
    if not spec:
        raise ConfigError(option, "empty duration", fix=f"use {EXAMPLES}")
    total = 0.0
    pos = 0
    last_rank = -1
    for m in _TERM.finditer(spec):
        if m.start() != pos:
            break
        rank = _ORDER.index(m.group("unit"))
        if rank <= last_rank:
            raise ConfigError(
                option,
                f"{text!r}: units must go from largest to smallest, each once",
                fix=f"use {EXAMPLES}",
            )
        last_rank = rank
        total += float(m.group("value")) * _UNITS[m.group("unit")]
        pos = m.end()
    if pos != len(spec):
        raise ConfigError(option, f"{text!r} is not a duration", fix=f"use {EXAMPLES}")
    return _bounded(total, text, option)


def _bounded(seconds: float, text: str, option: str) -> float:
    if not math.isfinite(seconds):
        raise ConfigError(option, f"{text!r} is not a finite duration", fix=f"use {EXAMPLES}")
    if seconds > MAX_DURATION_S:
        raise ConfigError(option, f"{text!r} is more than 366 days", fix=f"use at most {_MAX_TEXT}")
    return seconds
