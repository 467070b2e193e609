"""JSON documents and tables written as their rows are produced, never held whole.

``scan --json`` of 100,000 files is a document of about 100 MB; encoded at once, with the report
it comes from, it held 261 MiB. Here a document is written field by field (``JsonDocument``):
a report's small fields as ``json_text`` writes them, and a long list a batch at a time, either
straight to stdout (``scan``'s entries, the one list of its document) or, where several long
lists are produced together (``reap``'s removed, kept, ...), into an unlinked temporary file per
list (``JsonSpill``) that is copied out in the document's order at the end. The text is the
text ``json_text`` writes for the whole document, compact or indented, byte for byte: the same
encoders, the same escapes (valid UTF-8 for any byte of a name).

A table's rows are sorted and aligned over every row, so they wait too (``RowSpill``): each
row's cells in a temporary file, and in memory only its sort key and where it lies (about
250 bytes a row, against about 700 for the row itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any, Protocol

from shmctl.render import Column, json_text, printable, write_rows

__all__ = ["BytesOut", "JsonDocument", "JsonSpill", "RowSpill", "stdout_bytes"]


class BytesOut(Protocol):
    """Where a document's bytes go."""

    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


class _Decoded:
    """A text stream with no binary buffer (a test's ``StringIO``), taking the UTF-8 bytes."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def write(self, data: bytes, /) -> int:
        self.out.write(data.decode("utf-8"))
        return len(data)

    def flush(self) -> None:
        self.out.flush()


def stdout_bytes() -> BytesOut:
    """Where JSON bytes go: stdout's binary buffer (UTF-8 whatever the locale: ``write_utf8``'s
    rule), what the text layer holds flushed first."""
    out = sys.stdout
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        return _Decoded(out)
    out.flush()
    written: BytesOut = buffer
    return written


def _temporary() -> IO[bytes]:
    """An unlinked temporary file (``TMPDIR``, else ``/tmp``): nothing is left behind, even on a kill.

    Where no directory is writable (a container's read-only root, as the DaemonSet runs
    ``kubectl exec`` into), the rows wait in memory instead: the output is the same, only the
    command's memory grows with the root again.
    """
    import tempfile  # only where rows or lists are long enough to wait: a few ms of imports

    try:
        return tempfile.TemporaryFile(prefix="shmctl-")
    except OSError:
        import io

        return io.BytesIO()


def _array_items(items: Sequence[Any], *, pretty: bool) -> str:
    """The items of a JSON array as ``json_text`` writes them inside a document's field: the
    array's text without its brackets (indented, they sit two levels deep)."""
    text = json_text(list(items), pretty=pretty)
    if not pretty:
        return text[1:-1]
    lines = text.split("\n")[1:-1]
    return "\n".join(["  " + line for line in lines])


class JsonSpill:
    """One long JSON array of a document, written a batch at a time to an unlinked temporary
    file, and copied into the document when its turn comes (``JsonDocument.spilled``)."""

    def __init__(self, *, pretty: bool) -> None:
        self.pretty = pretty
        self.count = 0
        self._file: IO[bytes] | None = None

    def add(self, items: Sequence[Any]) -> None:
        if not items:
            return
        if self._file is None:
            self._file = _temporary()
        elif self.count:
            self._file.write(b",\n" if self.pretty else b",")
        self._file.write(_array_items(items, pretty=self.pretty).encode("utf-8"))
        self.count += len(items)

    def chunks(self) -> Iterator[bytes]:
        if self._file is None:
            return
        self._file.seek(0)
        while chunk := self._file.read(1 << 20):
            yield chunk

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JsonDocument:
    """A JSON object written to ``out`` field by field, in the order the fields are given:
    the text ``json_text`` writes for the whole object (``pretty``: indented by two)."""

    def __init__(self, out: BytesOut, *, pretty: bool) -> None:
        self.out = out
        self.pretty = pretty
        self._fields = 0
        self._items = 0

    def _key(self, name: str) -> None:
        if self.pretty:
            lead = "{\n" if not self._fields else ",\n"
            self.out.write(f'{lead}  "{name}": '.encode())
        else:
            lead = "{" if not self._fields else ","
            self.out.write(f'{lead}"{name}":'.encode())
        self._fields += 1

    def field(self, name: str, value: Any) -> None:
        self._key(name)
        text = json_text(value, pretty=self.pretty)
        if self.pretty:
            text = text.replace("\n", "\n  ")
        self.out.write(text.encode("utf-8"))

    def fields(self, document: Any, names: Sequence[str]) -> None:
        """``names`` of ``document`` (a dataclass), each as ``field`` writes it."""
        for name in names:
            self.field(name, getattr(document, name))

    def begin_list(self, name: str) -> None:
        self._key(name)
        self.out.write(b"[")
        self._items = 0

    def items(self, items: Sequence[Any]) -> None:
        """A batch of the open list's items (``begin_list``)."""
        if not items:
            return
        lead = (b"\n" if not self._items else b",\n") if self.pretty else (b"" if not self._items else b",")
        self.out.write(lead + _array_items(items, pretty=self.pretty).encode("utf-8"))
        self._items += len(items)

    def end_list(self) -> None:
        self.out.write(b"\n  ]" if self.pretty and self._items else b"]")

    def spilled(self, name: str, spill: JsonSpill) -> None:
        """A list written earlier into ``spill``, copied in as the field ``name``."""
        self.begin_list(name)
        if spill.count:
            self.out.write(b"\n" if self.pretty else b"")
            for chunk in spill.chunks():
                self.out.write(chunk)
            self._items = spill.count
        self.end_list()

    def close(self) -> None:
        self.out.write(b"\n}\n" if self.pretty and self._fields else b"}\n")
        self.out.flush()


#: Rows a table holds in memory as they are (their texts: about 700 bytes each) before they go
#: to its temporary file: most tables never touch the disk.
HELD_ROWS = 8192


class RowSpill:
    """Table rows as they come, written out sorted and aligned once all are in (``write``).

    ``cap`` rows are shown (0: all): with a cap only the ``cap`` best rows are kept (trimmed as
    they come), and ``hidden`` counts the rest. Without one, rows past ``HELD_ROWS`` wait in an
    unlinked temporary file, only their sort keys in memory. Cells are escaped as
    ``write_table`` escapes them.
    """

    def __init__(self, columns: Sequence[Column], *, cap: int = 0) -> None:
        self.columns = tuple(columns)
        self.cap = cap
        self.rows = 0
        self.widths = [len(c.header) for c in self.columns]
        #: Rows in memory: (key, the first cell's style, the cells' texts).
        self._held: list[tuple[tuple[Any, ...], str | None, list[str]]] = []
        #: Rows in the file: (*key, offset, length).
        self._keys: list[tuple[Any, ...]] = []
        self._file: IO[bytes] | None = None
        self._end = 0

    def add(self, key: tuple[Any, ...], cells: Sequence[str], style: str | None) -> None:
        """One row: its sort key, its cells (in ``columns`` order) and its first cell's style."""
        texts = [printable(c, escape_backslash=False) for c in cells]
        if not self.cap:
            widths = self.widths
            for i, text in enumerate(texts):
                widths[i] = max(widths[i], len(text))
        self._held.append((key, style, texts))
        self.rows += 1
        if len(self._held) >= HELD_ROWS + self.cap:
            self._settle()

    def _settle(self) -> None:
        """The rows held: with a cap, only the best ``cap`` of them stay; else into the file."""
        if self.cap:
            self._held.sort(key=_first)
            del self._held[self.cap :]
            return
        if self._file is None:
            self._file = _temporary()
        chunk = []
        for key, style, texts in self._held:
            data = "\0".join([style or "", *texts]).encode("utf-8")
            chunk.append(data)
            self._keys.append((*key, self._end, len(data)))
            self._end += len(data)
        self._file.write(b"".join(chunk))
        self._held = []

    @property
    def hidden(self) -> int:
        return self.rows - self.shown

    @property
    def shown(self) -> int:
        return min(self.rows, self.cap) if self.cap else self.rows

    def _read(self, offset: int, length: int) -> tuple[list[str], list[str | None]]:
        assert self._file is not None
        if hasattr(self._file, "getbuffer"):  # held in memory (``_temporary``)
            data = bytes(self._file.getbuffer()[offset : offset + length])
        else:
            data = os.pread(self._file.fileno(), length, offset)
        fields = data.decode("utf-8").split("\0")
        return fields[1:], _styles(fields[0] or None, len(fields) - 1)

    def write(self, *, headers: bool, stream: IO[str] | None = None) -> None:
        """The rows shown, sorted by their keys, under the columns' headers."""
        if not self.rows:
            return
        if self._file is None:
            self._held.sort(key=_first)
            held = self._held[: self.shown]
            widths = self.widths
            if self.cap:
                widths = [max([w] + [len(texts[i]) for _, _, texts in held]) for i, w in enumerate(widths)]
            rows = ((texts, _styles(style, len(texts))) for _, style, texts in held)
            write_rows(self.columns, rows, widths, headers=headers, stream=stream)
            return
        self._settle()
        self._file.flush()
        self._keys.sort()
        spilled = (self._read(k[-2], k[-1]) for k in self._keys)
        write_rows(self.columns, spilled, self.widths, headers=headers, stream=stream)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._keys = []
        self._held = []


def _first(row: tuple[tuple[Any, ...], str | None, list[str]]) -> tuple[Any, ...]:
    return row[0]


def _styles(first: str | None, cells: int) -> list[str | None]:
    return [first] + [None] * (cells - 1)
