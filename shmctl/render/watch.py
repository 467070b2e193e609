"""``shmctl watch``'s output: one JSON line per event on stdout, and ``/metrics`` over HTTP.

Events are the library's event dataclasses, written as ``{"event", "time", "root",
"pod_uid", ...}`` on one line each (``watch-event.schema.json``); stdout carries nothing else,
so a log shipper can parse every line. Fields that are dataclasses (``root_replaced``'s
identities) are objects; paths are strings, any byte in them that is not UTF-8 written as its
``\\udcXX`` escape. A write that fails (the reader went away) is not the agent's end: the
events stop, the passes and the metrics go on.

``WatchMetrics`` keeps the latest pass of every root and the reap counters; the HTTP thread
builds a fresh ``Exposition`` from them per scrape, under a lock the pass loop takes only to
swap in a finished root. Series of vanished roots are dropped with their state, so the
label set stays as large as the node's current pods, however many come and go.

``/healthz`` answers 200 ``ok`` while the loop is alive and has finished a pass within three
intervals, 503 otherwise. The server is ``http.server``'s threading server on a daemon
thread: the pass loop stays in the main thread, where leases are safe (``lease``).
"""

from __future__ import annotations

import contextlib
import errno
import http.server
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from kvoffload.errors import ConfigError
from kvoffload.liveness import lease
from kvoffload.liveness.watch import Event, PassReport, RootPass
from shmctl.render import dumps, to_jsonable
from shmctl.render.metrics import Exposition, ReapCounters, label_text

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LISTEN_EXAMPLE = "127.0.0.1:9477"


def event_document(event: Event) -> dict[str, Any]:
    """The JSON object of one event: its kind first, then its fields."""
    fields = to_jsonable(event)
    return {"event": type(event).event, **fields}


class EventWriter:
    """Writes events as JSON lines to ``stream`` (stdout); stops quietly if the reader left."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream
        self.broken = False

    def __call__(self, event: Event) -> None:
        if self.broken:
            return
        stream = self._stream or sys.stdout
        # A name that is not UTF-8 (a pod volume, a path given with any bytes) reaches us as
        # lone surrogates, which no stdout can encode: written as their JSON escape (as
        # ``emit_json`` does), the line stays one valid JSON object and gives the name back.
        line = dumps(event_document(event)).encode("utf-8", "backslashreplace").decode("utf-8")
        try:
            stream.write(line + "\n")
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            # No reader (or a closed stream): metrics still tell the story; the loop must go on.
            self.broken = True


class WatchMetrics:
    """The latest state of every watched root, as one exposition per scrape."""

    def __init__(
        self,
        *,
        interval_s: float,
        top_engines: int = 10,
        reaping: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self._lock = threading.Lock()
        self._latest: dict[Path, RootPass] = {}
        self._counters = ReapCounters()
        self._top_engines = top_engines
        self._interval_s = interval_s
        #: With --reap every watched root has its counters, from 0: ``increase()`` then counts
        #: a root's first removal too (a series that starts at 1 would hide it).
        self._reaping = reaping
        self._monotonic = monotonic
        self._passes = 0
        self._roots = 0
        self._pass_seconds: float | None = None
        self._last_pass_done: float | None = None
        self.alive = True

    def record(self, report: PassReport) -> None:
        with self._lock:
            for root in report.vanished:
                self._latest.pop(root, None)
                self._counters.forget(root)
            for result in report.roots:
                self._latest[result.root] = result
                if result.reaped is not None:
                    self._counters.record(result.reaped)
                elif self._reaping:
                    label = label_text(str(result.root))
                    self._counters.files.setdefault(label, 0)
                    self._counters.resident_bytes.setdefault(label, 0)
            self._passes += 1
            self._roots = report.matched
            self._pass_seconds = report.seconds
            self._last_pass_done = self._monotonic()

    @property
    def series_roots(self) -> tuple[Path, ...]:
        with self._lock:
            return tuple(self._latest)

    def text(self) -> bytes:
        with self._lock:
            exposition = Exposition(top_engines=self._top_engines, pod_uid_label=True)
            exposition.add_lease_break_time(lease.break_time_s())
            for result in self._latest.values():
                if result.report is not None and result.usage is not None:
                    exposition.add_scan(result.report, result.usage, scan_seconds=result.scan_seconds)
                    exposition.add_region_sizes(result.report)
                elif result.error is not None:
                    exposition.add_failure(
                        result.root,
                        result.error,
                        attempted_at=result.attempted_at,
                        last_success=result.last_success,
                    )
            exposition.add_reaps(self._counters)
            exposition.add_watch(
                up=self.alive, passes=self._passes, roots=self._roots, pass_seconds=self._pass_seconds
            )
            return exposition.text()

    def healthy(self) -> bool:
        """Alive, and a pass finished within three intervals (at least a second: a busy loop)."""
        with self._lock:
            done = self._last_pass_done
        if not self.alive or done is None:
            return False
        return self._monotonic() - done <= 3 * max(self._interval_s, 1.0)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a bind address; a ``ConfigError`` naming ``--listen``."""
    fix = f"pass HOST:PORT, e.g. --listen {LISTEN_EXAMPLE} (IPv6: [::1]:9477)"
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError("--listen", f"{text!r} is not HOST:PORT", fix=fix)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ConfigError("--listen", f"{text!r}: port {port} is out of range", fix=fix)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError("--listen", f"{text!r}: {host!r} is not an IPv6 address", fix=fix) from None
    elif ":" in host:
        raise ConfigError("--listen", f"{text!r}: an IPv6 address goes in brackets", fix=fix)
    return host, port


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        metrics = self.server.metrics
        if path == "/metrics":
            self._send(200, metrics.text(), CONTENT_TYPE)
        elif path == "/healthz":
            if metrics.healthy():
                self._send(200, b"ok\n", "text/plain; charset=utf-8")
            else:
                self._send(503, b"no pass finished within three intervals\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics or /healthz\n", "text/plain; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # stdout is the event stream and stderr the agent's diagnostics: no access log.
        return


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, metrics: WatchMetrics) -> None:
        self.address_family = family
        self.metrics = metrics
        super().__init__(address, _Handler)


@contextlib.contextmanager
def serving(listen: str, metrics: WatchMetrics) -> Iterator[tuple[str, int]]:
    """Serve ``/metrics`` and ``/healthz`` on ``listen`` from a daemon thread; yields the bound address.

    The socket is bound before the first pass, so a bad address or a port in use is a usage
    error (exit 2) before anything is scanned or removed.
    """
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(
            "--listen",
            f"{listen!r}: cannot resolve {host!r} ({e.strerror})",
            fix=f"use an address, e.g. {LISTEN_EXAMPLE}",
        ) from None
    family, _, _, _, sockaddr = infos[0]
    try:
        server = _Server((str(sockaddr[0]), port), family, metrics)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                "--listen",
                f"{listen}: address already in use",
                fix="pick another port, or stop what listens there",
            ) from None
        raise ConfigError(
            "--listen",
            f"{listen}: cannot listen ({e.strerror or e})",
            fix=f"use a local address, e.g. {LISTEN_EXAMPLE}",
        ) from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        bound = server.server_address
        yield str(bound[0]), int(bound[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
