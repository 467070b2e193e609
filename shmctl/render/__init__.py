"""Everything that turns library reports into text. Commands never format output themselves.

Rules: data goes to stdout, diagnostics to stderr; ``--json`` prints one JSON document
built from the report dataclass; tables are rich on a terminal and plain text (no
colour, no box drawing) when stdout is not a TTY or ``NO_COLOR`` is set.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def to_jsonable(value: Any) -> Any:
    """Serialise report dataclasses (and what they hold) to JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def emit_json(document: Any) -> None:
    text = json.dumps(to_jsonable(document), indent=2, ensure_ascii=False)
    # A file name that is not UTF-8 reaches us as lone surrogates (os.listdir's surrogateescape),
    # which no stdout can encode. "\udcff" is their JSON escape: json.loads gives the name back.
    sys.stdout.write(text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n")
    sys.stdout.flush()


def printable(text: str, *, escape_backslash: bool = True) -> str:
    """``text`` with control characters, invisible formatting and undecodable bytes escaped.

    File names in the shm root are chosen by whoever created them: a newline or tab in a name
    would forge lines and columns in plain output, an ESC would drive the operator's terminal.
    Backslashes are escaped too (by default), so every escaped text stands for one name only.
    """
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and (c != "\\" or not escape_backslash) else c.encode("unicode_escape").decode()
        for c in text
    )


def plain_output() -> bool:
    """True when output should be plain text: not a terminal, NO_COLOR, or TERM=dumb."""
    return not sys.stdout.isatty() or bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"


def console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    plain = plain_output()
    return Console(
        stderr=stderr,
        no_color=plain,
        highlight=False,
        soft_wrap=plain,
        force_terminal=None if not plain else False,
    )


def human_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def error_line(message: str) -> None:
    """One line on stderr, no traceback: ``shmctl: error: <what> (fix: <how>)``."""
    sys.stderr.write(f"shmctl: error: {printable(message, escape_backslash=False)}\n")
    sys.stderr.flush()


def warning_line(message: str, *, note: bool = False) -> None:
    """One line on stderr: ``warning`` when something was kept or unproven, ``note`` for information."""
    kind = "note" if note else "warning"
    sys.stderr.write(f"shmctl: {kind}: {printable(message, escape_backslash=False)}\n")
    sys.stderr.flush()
