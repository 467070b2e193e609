"""``shmctl watch``'s events: one JSON line per event on stdout.

Events are the library's event dataclasses, written as ``{"event", "time", "root",
"pod_uid", ...}`` on one line each (``watch-event.schema.json``); stdout carries nothing else,
so a log shipper can parse every line. Fields that are dataclasses (``root_replaced``'s
identities) are objects; paths are strings, any byte in them that is not UTF-8 written as its
``\\udcXX`` escape (``shmctl.render.json_text``, the escaping of ``scan --json`` too). Lines
are UTF-8 bytes whatever the locale or ``PYTHONIOENCODING`` says. A write that fails (the
reader went away) is not the agent's end: the events stop, the passes and the metrics go on.

The agent's ``/metrics`` and ``/healthz`` (its numbers, its app, its server) are
``shmctl.serve``'s; the exposition they serve is ``shmctl.render.metrics``'s.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from kvoffload.liveness.events import Event
from shmctl.render import json_text, to_jsonable, warning_line, write_utf8

#: Moved to shmctl.serve.agent and shmctl.serve.state; kept here for one release (issue #29).
from shmctl.serve.agent import LISTEN_EXAMPLE, agent_app, parse_listen, serving
from shmctl.serve.state import WatchMetrics

__all__ = [
    "LISTEN_EXAMPLE",
    "EventWriter",
    "WatchMetrics",
    "agent_app",
    "event_document",
    "parse_listen",
    "serving",
]


def event_document(event: Event) -> dict[str, Any]:
    """The JSON object of one event: its kind first, then its fields."""
    fields = to_jsonable(event)
    return {"event": type(event).event, **fields}


class EventWriter:
    """Writes events as JSON lines to ``stream`` (stdout); stops quietly if the reader left.

    Each line is ``json_text`` written by ``write_utf8``: the escaping ``scan --json`` uses
    (a byte of a name that is not UTF-8 as ``\\udcXX``), as UTF-8 bytes whatever the stream's
    encoding, so no name and no locale can stop the stream.
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream
        self.broken = False

    def __call__(self, event: Event) -> None:
        if self.broken:
            return
        stream = self._stream or sys.stdout
        line = json_text(event_document(event)) + "\n"
        try:
            write_utf8(line, stream)
        except (OSError, ValueError, AttributeError) as e:
            # No reader, a closed stream, a full disk, or none at all: metrics still tell the
            # story and the loop must go on, but the operator hears once why events stopped.
            self.broken = True
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            warning_line(f"stdout: {why}: no more events are written there; /metrics goes on")
