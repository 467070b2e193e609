"""Everything that turns library reports into text. Commands never format output themselves.

Rules: data goes to stdout, diagnostics to stderr; ``--json`` prints one JSON document
built from the report dataclass: indented on a terminal, one line otherwise (journald and
log shippers see one event). Tables are the same columns and the same rows on a terminal
and in a pipe, aligned with spaces and never wrapped (a long reap command must paste as one
line); a terminal only adds colour, and ``NO_COLOR`` (no-color.org) or ``TERM=dumb`` takes
even that away.

Names come from whoever created a file (any user may create a region file), so no output
carries ``CONTROLS`` as themselves: text for people escapes them (and every other character
``str.isprintable`` rejects) visibly with ``printable``; JSON writes them as ``\\uXXXX``
escapes (``json_text``), which ``json.loads`` turns back into the exact name.

This package only formats; one module per command's output:

* ``audit``: the audit's summary, JSON report and JUnit XML (and which goes to which option);
* ``doctor``, ``faults``, ``init``, ``scan`` (scan and reap): tables and JSON of their reports;
* ``metrics``: the Prometheus exposition (stdout, or the textfile);
* ``watch``: the agent's events, one JSON line each;
* ``fixes``: the fix for a file shmctl could not write, true to the errno.

Serving is ``shmctl.serve``'s (the agent's HTTP), and writing a file whole or in place is
``shmctl.output_files``'s. ``http`` is a re-export of ``shmctl.serve.server``, kept for one
release (issue #29).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import json
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

#: Beyond C0, what acts on a terminal or on the text around it: DEL and C1 (CSI U+009B, NEL
#: U+0085), the bidirectional controls (U+061C, U+200E-F, U+202A-E, U+2066-9), the line and
#: paragraph separators U+2028-9, and lone surrogates: the undecodable bytes of a name
#: (``surrogateescape``), which UTF-8 cannot carry.
_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
#: The characters no output carries as themselves, C0 and ``_BEYOND_C0``, as the inside of a
#: regular-expression class (``f"[{CONTROLS}]"``).
CONTROLS = f"\x00-\x1f{_BEYOND_C0}"
#: The UTF-8 bytes every character of ``_BEYOND_C0`` begins with (``surrogatepass``).
_JSON_LEADS = (b"\x7f", b"\xc2", b"\xd8", b"\xe2\x80", b"\xe2\x81", b"\xed")


@functools.cache
def _json_raw() -> re.Pattern[str]:
    """Runs of what the JSON encoder writes as itself of ``CONTROLS``: it escapes C0 in a
    string, and outside strings C0 is only the newlines and spaces of an indent. Compiled on
    first use (a millisecond): shell completion runs shmctl on every Tab press."""
    return re.compile(f"[{_BEYOND_C0}]+")


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


_ENCODERS: dict[type, Callable[[Any], Any]] = {}


def _encoder_for(cls: type, value: Any) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value))
        get = operator.attrgetter(*names)
        if len(names) == 1:
            return lambda v: {names[0]: get(v)}
        return lambda v: dict(zip(names, get(v), strict=True))
    if isinstance(value, enum.Enum):
        return operator.attrgetter("value")
    if isinstance(value, PurePath):
        return str
    if isinstance(value, (set, frozenset)):
        return sorted
    raise TypeError(f"{cls.__name__} is not JSON serialisable")


def _encode_default(value: Any) -> Any:
    """What the C encoder cannot write itself: dataclasses, non-str enums, paths, sets.

    One converter per class, made on first sight: a dataclass becomes a dict through one
    ``attrgetter`` call; str and int enums (``Status``, ``Evidence``) and tuples are already
    JSON to the encoder. A 10,000-file scan makes no reflection call per field or object.
    """
    cls = type(value)
    encode = _ENCODERS.get(cls)
    if encode is None:
        encode = _ENCODERS[cls] = _encoder_for(cls, value)
    return encode(value)


def _orjson_default(value: Any) -> Any:
    # orjson writes dataclasses, enums, tuples and dicts itself; paths and sets come here.
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


@functools.cache
def _orjson() -> Any:
    """orjson's ``dumps``, or None where it is not installed (the standard library then)."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson.dumps


def dumps(document: Any, *, pretty: bool = False) -> str:
    """``document`` as JSON text: one line, or indented for a person.

    One line comes from orjson where it can write the document: a 10,000-file scan's report
    in 44 ms against the standard library's 263 ms, to the same JSON value (a test compares
    them on every report type). It refuses a name whose bytes are not UTF-8 (a lone
    surrogate from ``surrogateescape``) and integers past 64 bits; such a document, and
    every document where orjson is not installed, goes through the standard library, which
    writes those exactly. ``json_text`` escapes both outputs alike.
    """
    if pretty:
        return json.dumps(document, indent=2, ensure_ascii=False, default=_encode_default)
    fast = _orjson()
    if fast is not None:
        try:
            return str(fast(document, default=_orjson_default), "utf-8")
        except TypeError:  # orjson.JSONEncodeError: a surrogate, a huge int, an unknown type
            pass
    return standard_dumps(document)


def standard_dumps(document: Any) -> str:
    """One line of JSON from the standard library's C encoder: ``dumps`` where orjson cannot."""
    # Report documents are trees of frozen dataclasses and tuples: no cycle to look for (the
    # circular check was a third of the time of a 10,000-file scan's JSON).
    return json.dumps(
        document, separators=(",", ":"), ensure_ascii=False, default=_encode_default, check_circular=False
    )


def json_text(document: Any, *, pretty: bool = False) -> str:
    """``document`` as JSON with none of ``CONTROLS`` in it, and UTF-8 encodable.

    The one escaping of every JSON output (``scan --json``, ``reap --json``, ``init --json``,
    ``watch``'s events, ``audit --report``). The encoder escapes C0 itself; DEL, C1, the
    bidirectional controls, U+2028-9 and lone surrogates (a name's bytes that are not UTF-8,
    from ``os.listdir``'s surrogateescape) are written here as their ``\\uXXXX`` escapes, so
    a document shown on a terminal cannot drive it and JavaScript reads it as JSON does.
    ``json.loads`` gives every name back exactly, and ``os.fsencode`` its bytes. Every other
    character is written as itself (``café`` stays ``café``).

    One compiled pattern over the whole text, and only where it can match: an ASCII document
    with no DEL (almost every one) or one whose UTF-8 has none of those characters' lead bytes
    is returned as the encoder wrote it, so a 10,000-file scan pays 0.05 ms for the check
    (a few ms to encode a non-ASCII one), not the pattern's tens.
    """
    text = dumps(document, pretty=pretty)
    if text.isascii():
        return text if "\x7f" not in text else _json_raw().sub(_json_escapes, text)
    # A pattern over a wide string is slow next to memchr over its UTF-8 (50 ms against 10 on
    # a 10,000-file scan): look for the lead bytes of what it matches first (DEL; C1: C2;
    # U+061C: D8; U+200E-206F: E2 80-81; surrogates: ED), and run it only where one is.
    data = text.encode("utf-8", "surrogatepass")
    if any(lead in data for lead in _JSON_LEADS):
        return _json_raw().sub(_json_escapes, text)
    return text


def _json_escapes(run: re.Match[str]) -> str:
    # A surrogate pair cannot come from a file name (surrogateescape makes only U+DC80-DCFF),
    # so two escapes never read back as one character.
    return "".join([f"\\u{ord(c):04x}" for c in run.group()])


def write_utf8(text: str, stream: IO[str] | None = None) -> None:
    """``text`` as UTF-8 bytes on ``stream`` (stdout), whatever its encoding says.

    JSON is UTF-8 (RFC 8259): under ``LANG=C`` or ``PYTHONIOENCODING=ascii`` a text stream
    would refuse a pod's non-ASCII name, so the bytes go to its binary buffer. A stream with
    no buffer (``io.StringIO``) takes the text as it is.
    """
    out = sys.stdout if stream is None else stream
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        out.write(text)
        out.flush()
        return
    out.flush()  # what the text layer holds goes first
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def emit_json(document: Any) -> None:
    write_utf8(json_text(document, pretty=sys.stdout.isatty()) + "\n")


def printable(text: str, *, escape_backslash: bool = True) -> str:
    """``text`` with control characters, invisible formatting and undecodable bytes escaped.

    The one escaping of text shown to a person (tables, error and warning lines, audit and
    init reports, Prometheus label values): every character ``str.isprintable`` rejects is
    written as its Python escape (``\\x1b``, ``\\x9b``, ``\\u202e``, ``\\udcff``). That is
    every one of ``CONTROLS`` and the rest of Unicode's controls, format characters,
    separators but the space, and unassigned code points. File names in the shm root are
    chosen by whoever created them: a newline or tab in a name would forge lines and columns
    in plain output, an ESC or a C1 CSI would drive the operator's terminal (clear it, set its
    clipboard with OSC 52), a bidi override would show another name. Backslashes are escaped
    too (by default), so every escaped text stands for one name only. Idempotent with
    ``escape_backslash=False``: a sink may escape text that holds escaped names already.
    """
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and (c != "\\" or not escape_backslash) else c.encode("unicode_escape").decode()
        for c in text
    )


def token(text: str) -> str:
    """``printable(text)`` with spaces escaped too: one field for ``awk``, whatever the name."""
    return printable(text).replace(" ", "\\x20")


_color_mode = "auto"


def set_color_mode(mode: str) -> None:
    """``--color``: ``auto`` (the default), ``always`` or ``never``; set once, while options parse."""
    global _color_mode
    _color_mode = mode


def color_enabled(stream: IO[str] | None = None) -> bool:
    """Colour only for a terminal, and never under ``NO_COLOR`` (any value but empty) or ``TERM=dumb``.

    ``--color=always`` and ``--color=never`` decide alone: a flag typed for this one command
    outranks the environment (no-color.org), and ``always`` colours a pipe (``| less -R``).
    """
    if _color_mode != "auto":
        return _color_mode == "always"
    target = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(target, "isatty", None)
    return bool(isatty and isatty())


_SGR = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}


def styled(text: str, style: str | None, *, color: bool) -> str:
    """``text`` in ``style`` (words of ``_SGR``, e.g. ``"bold red"``) when colour is on."""
    if not color or not style:
        return text
    codes = ";".join(_SGR[word] for word in style.split())
    return f"\x1b[{codes}m{text}\x1b[0m"


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    right: bool = False


#: A table cell: its text, or its text and a style for terminals.
Cell = str | tuple[str, str | None]


def write_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[Cell]],
    *,
    headers: bool = True,
    stream: IO[str] | None = None,
) -> None:
    """Rows aligned under ``columns``, two spaces apart; the last column is never padded.

    The same bytes on a terminal and in a pipe (colour aside), so ``awk '$1 == "orphaned"'``
    works on what an operator saw. Cells are escaped (``printable``) here: a control
    character in a name cannot forge a row or a column.
    """
    texts: list[list[str]] = []
    styles: list[list[str | None]] = []
    for row in rows:
        texts.append([printable(c if isinstance(c, str) else c[0], escape_backslash=False) for c in row])
        styles.append([None if isinstance(c, str) else c[1] for c in row])
    head = [c.header for c in columns]
    widths = [max([len(h)] + [len(t[i]) for t in texts]) for i, h in enumerate(head)]
    write_rows(columns, zip(texts, styles, strict=True), widths, headers=headers, stream=stream)


def write_rows(
    columns: Sequence[Column],
    rows: Iterable[tuple[Sequence[str], Sequence[str | None]]],
    widths: Sequence[int],
    *,
    headers: bool = True,
    stream: IO[str] | None = None,
) -> None:
    """``write_table``'s lines for rows already escaped (their texts and styles), in columns of
    ``widths``: written as they come, in slices, so that a table of any length is never one string."""
    out = sys.stdout if stream is None else stream
    color = color_enabled(out)
    last = len(columns) - 1

    def line(cells: Sequence[str], cell_styles: Sequence[str | None]) -> str:
        parts = []
        for i, (text, column) in enumerate(zip(cells, columns, strict=True)):
            pad = " " * (widths[i] - len(text)) if i < last else ""
            shown = styled(text, cell_styles[i], color=color)
            parts.append(pad + shown if column.right else shown + pad)
        return "  ".join(parts).rstrip(" ")

    chunk = [line([c.header for c in columns], [None] * len(columns)) + "\n"] if headers else []
    for texts, cell_styles in rows:
        chunk.append(line(texts, cell_styles) + "\n")
        if len(chunk) >= 4096:
            out.write("".join(chunk))
            chunk = []
    out.write("".join(chunk))


def console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    class _Console(Console):
        # rich turns a closed pipe into SystemExit(1), which reads as "findings": hand it on as
        # the BrokenPipeError it is, for the app's one quiet exit 0.
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    stream = sys.stderr if stderr else sys.stdout
    terminal = bool(getattr(stream, "isatty", None) and stream.isatty()) and os.environ.get("TERM") != "dumb"
    color = color_enabled(stream)
    return _Console(
        stderr=stderr,
        no_color=not color,
        # `--color=always` in a pipe: colour, but still no cursor movement or live display.
        color_system="standard" if color and not terminal else "auto",
        highlight=False,
        soft_wrap=True,
        force_terminal=None if terminal else False,
    )


def size_text(n: int, *, exact: bool) -> str:
    """A size cell, one field for ``awk``: ``4.0KiB`` (as ``ls -h`` writes ``4.0K``), or the
    exact integer under ``--bytes``."""
    return str(n) if exact else human_bytes(n).replace(" ", "")


def amount_text(n: int, *, exact: bool) -> str:
    """A size in a sentence: ``1.0 MiB``, or ``1048576 bytes`` under ``--bytes``."""
    return f"{n} bytes" if exact else human_bytes(n)


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
