"""What ``shmctl watch --listen`` serves, and where: the agent's WSGI app and its socket.

``/healthz`` answers 200 ``ok`` while the loop is alive and has finished a pass within three
intervals, 503 otherwise. ``/metrics`` is prometheus-client's WSGI app (HEAD, gzip,
OpenMetrics) over ``WatchMetrics`` (``shmctl.serve.state``). The server
(``shmctl.serve.server``) is one selector thread and a bounded pool, with a connection cap
and timeouts (docs/watch-http.md): no client can take the fds or threads the scan needs. The
pass loop stays in the main thread, where leases are safe (``lease``).

The socket is bound before the first pass: a bad ``--listen`` address, or a port that cannot
be had, is a ``ConfigError`` naming ``--listen`` (exit 2) before anything is scanned.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from shmctl.render import warning_line
from shmctl.serve import server as http
from shmctl.serve.state import WatchMetrics

LISTEN_EXAMPLE = "127.0.0.1:9477"


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
    ``shmctl.serve.server``'s (docs/watch-http.md).
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
