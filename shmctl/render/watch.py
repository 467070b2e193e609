"""``shmctl watch``'s output: one JSON line per event on stdout, and ``/metrics`` over HTTP.

Events are the library's event dataclasses, written as ``{"event", "time", "root",
"pod_uid", ...}`` on one line each (``watch-event.schema.json``); stdout carries nothing else,
so a log shipper can parse every line. Fields that are dataclasses (``root_replaced``'s
identities) are objects; paths are strings, any byte in them that is not UTF-8 written as its
``\\udcXX`` escape (``shmctl.render.json_text``, the escaping of ``scan --json`` too). Lines
are UTF-8 bytes whatever the locale or ``PYTHONIOENCODING`` says. A write that fails (the
reader went away) is not the agent's end: the events stop, the passes and the metrics go on.

``WatchMetrics`` keeps the latest numbers of every root (never a scan's entries) and the reap
counters; the HTTP thread builds a fresh ``Exposition`` from them per scrape, under a lock the
pass loop takes only to record a finished pass. Series of vanished roots are dropped with
their state, and past ``top_roots`` roots the rest are folded into ``root="other"``, so a
scrape stays bounded however many pods come and go (docs/agent-memory.md).

``/healthz`` answers 200 ``ok`` while the loop is alive and has finished a pass within three
intervals, 503 otherwise. ``/metrics`` is prometheus-client's WSGI app (HEAD, gzip,
OpenMetrics). The server (``shmctl.render.http``) is one selector thread and a bounded
pool, with a connection cap and timeouts (docs/watch-http.md): no client can take the fds or
threads the scan needs. The pass loop stays in the main thread, where leases are safe
(``lease``).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from kvoffload.liveness import lease
from kvoffload.liveness.events import Event, PassReport, RootPass
from kvoffload.liveness.roots import pod_uid_of
from shmctl.render import http, json_text, to_jsonable, warning_line, write_utf8
from shmctl.render.metrics import (
    DEFAULT_TOP_ENGINES,
    DEFAULT_TOP_ROOTS,
    OTHER_ROOTS,
    Exposition,
    ReapCounters,
    RootNumbers,
    RootSeries,
    label_text,
    rank_roots,
)

LISTEN_EXAMPLE = "127.0.0.1:9477"


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


class WatchMetrics:
    """The latest numbers of every watched root, as one exposition per scrape.

    A root is kept as ``RootSeries`` (numbers, never a scan's entries), so this holds a few
    hundred bytes per root whatever its files. A scrape names the ``top_roots`` roots whose
    orphans pin most memory and folds the others into ``root="other"`` (``add_watched``): its
    size is bounded however many roots the node has. The reap counters of a root count from
    when it was first seen; while a root is folded its removals count in ``root="other"``'s
    counters instead, so that every exported counter only ever grows.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        top_engines: int = DEFAULT_TOP_ENGINES,
        top_roots: int = DEFAULT_TOP_ROOTS,
        reaping: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        if top_roots < 0:
            raise ConfigError("--top-roots", f"must not be negative, got {top_roots}")
        self._lock = threading.Lock()
        self._latest: dict[Path, RootSeries] = {}
        #: Every root's removals since it was first seen, by label (exported while it is named).
        self._counters = ReapCounters()
        #: Removals in roots that were folded when they happened (``root="other"``'s counters).
        self._other_files = 0
        self._other_bytes = 0
        self._named: frozenset[str] = frozenset()
        self._top_engines = top_engines
        self._top_roots = top_roots
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
                series = self._series(result)
                if series is not None:
                    self._latest[result.root] = series
            self._named = rank_roots(self._latest.values(), self._top_roots)
            for result in report.roots:
                label = label_text(str(result.root))
                files = len(result.reaped.removed) if result.reaped is not None else 0
                freed = result.reaped.freed_bytes if result.reaped is not None else 0
                if files or self._reaping:
                    self._counters.add(label, files, freed)
                if label not in self._named:
                    self._other_files += files
                    self._other_bytes += freed
            self._passes += 1
            self._roots = report.matched
            self._pass_seconds = report.seconds
            self._last_pass_done = self._monotonic()

    def _series(self, result: RootPass) -> RootSeries | None:
        label = label_text(str(result.root))
        pod_uid = pod_uid_of(label) or ""
        if result.report is not None and result.usage is not None:
            numbers = RootNumbers.of_watch(
                result.report, result.usage, scan_seconds=result.scan_seconds, top_engines=self._top_engines
            )
            return RootSeries(label, pod_uid, result.attempted_at, result.last_success, numbers=numbers)
        if result.error is None:
            return None
        problem = result.error.message.removeprefix(f"{result.error.root}: ")
        return RootSeries(label, pod_uid, result.attempted_at, result.last_success, error=problem)

    @property
    def series_roots(self) -> tuple[Path, ...]:
        """Every root that has series now, named or folded into ``root="other"``."""
        with self._lock:
            return tuple(self._latest)

    def text(self) -> bytes:
        with self._lock:
            exposition = Exposition(top_engines=self._top_engines, pod_uid_label=True)
            exposition.add_lease_break_time(lease.break_time_s())
            exposition.add_watched(tuple(self._latest.values()), self._named)
            exposition.add_reaps(self._exported_counters())
            exposition.add_watch(
                up=self.alive, passes=self._passes, roots=self._roots, pass_seconds=self._pass_seconds
            )
            return exposition.text()

    def _exported_counters(self) -> ReapCounters:
        named = self._named
        counters = ReapCounters(
            {label: n for label, n in self._counters.files.items() if label in named},
            {label: n for label, n in self._counters.resident_bytes.items() if label in named},
        )
        folded = len(self._latest) > len(named)
        if self._other_files or (folded and self._reaping):
            counters.add(OTHER_ROOTS, self._other_files, self._other_bytes)
        return counters

    def healthy(self) -> bool:
        """Alive, and a pass finished within three intervals (at least a second: a busy loop)."""
        with self._lock:
            done = self._last_pass_done
        if not self.alive or done is None:
            return False
        return self._monotonic() - done <= 3 * max(self._interval_s, 1.0)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` (every address) as a bind address.

    The host ``""`` (``:PORT``) and ``"::"`` (``[::]:PORT``) are every address, IPv4 included
    (``listening_socket``). A ``ConfigError`` naming ``--listen`` for anything else.
    """
    fix = f"pass HOST:PORT, e.g. --listen {LISTEN_EXAMPLE} (every address: :9477; IPv6: [::1]:9477)"
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
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


class _Scrape:
    """The agent's current exposition as metric families, for prometheus-client's encoders.

    ``WatchMetrics.text()`` is parsed back into families so that the client's own
    exposition (text 0.0.4 or 1.0.0, OpenMetrics, gzip, ``name[]``) writes every answer.
    """

    def __init__(self, metrics: WatchMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return text_string_to_metric_families(self._metrics.text().decode("utf-8"))


def agent_app(metrics: WatchMetrics) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
    """The WSGI app of ``--listen``: ``/metrics`` (prometheus-client's), ``/healthz``, 404 elsewhere."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(metrics))
    exposition = make_wsgi_app(registry)
    text = [("Content-Type", "text/plain; charset=utf-8")]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ["PATH_INFO"]
        if path == "/metrics":
            answer: list[bytes] = exposition(environ, start_response)
            return answer
        if path == "/healthz":
            if metrics.healthy():
                start_response("200 OK", text)
                return [b"ok\n"]
            start_response("503 Service Unavailable", text)
            return [b"no pass finished within three intervals\n"]
        start_response("404 Not Found", text)
        return [b"not found: try /metrics or /healthz\n"]

    return app


@contextlib.contextmanager
def serving(listen: str, metrics: WatchMetrics) -> Iterator[tuple[str, int]]:
    """Serve ``/metrics`` and ``/healthz`` on ``listen`` from a daemon thread; yields the bound address.

    The socket is bound before the first pass, so a bad address or a port in use is a usage
    error (exit 2) before anything is scanned or removed. The server's limits are
    ``shmctl.render.http``'s (docs/watch-http.md).
    """
    host, port = parse_listen(listen)
    try:
        sock = http.listening_socket(host, port)
    except socket.gaierror as e:
        raise ConfigError(
            "--listen",
            f"{listen!r}: cannot resolve {host!r} ({e.strerror})",
            fix=f"use an address, e.g. {LISTEN_EXAMPLE}",
        ) from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                "--listen",
                f"{listen}: address already in use",
                fix="pick another port, or stop what listens there",
            ) from None
        raise ConfigError(
            "--listen", f"{listen}: cannot listen ({e.strerror or e})", fix=_listen_fix(e.errno)
        ) from None
    server = http.Server(
        sock,
        agent_app(metrics),
        heavy=lambda path: path == "/metrics",
        log=warning_line,
    )
    with http.serving(server):
        yield server.address


def _listen_fix(code: int | None) -> str:
    """The fix for the errno bind() gave: a port below 1024 is a privilege, not an address."""
    if code in (errno.EACCES, errno.EPERM):
        return "a port below 1024 needs CAP_NET_BIND_SERVICE (or root): pick a port from 1024 up, e.g. :9477"
    if code == errno.EADDRNOTAVAIL:
        return f"that address is not this host's: use one of its addresses, e.g. {LISTEN_EXAMPLE}"
    if code == errno.EAFNOSUPPORT:
        return "this host has no such address family (IPv6 off?): use an IPv4 address, e.g. 0.0.0.0:9477"
    return f"use a local address and a free port, e.g. {LISTEN_EXAMPLE}"
