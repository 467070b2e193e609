"""The ``--listen`` server: a WSGI app served so that no client can take what the scan needs.

``shmctl watch`` runs as root on every GPU node, often listening on every address. Its pass
loop needs file descriptors (one per root being scanned, ``/proc``, leases) and the node's
memory budget; a scraper, a probe or an attacker must never take them. So:

* One thread (``shmctl-http``) runs a selector loop: it accepts, reads request heads and
  writes answers, all non-blocking. An idle, half-open or slow connection costs one fd and
  a few hundred bytes, never a thread.
* At most ``MAX_CONNECTIONS`` connections are open (fewer under a low ``RLIMIT_NOFILE``: an
  eighth of its soft limit). A new connection beyond that closes the one that has moved no
  byte for longest, so a flood of idle connections cannot lock a probe out; when every
  connection is busy being answered, new ones wait in the kernel's listen backlog.
* A request head must arrive whole within ``READ_TIMEOUT_S`` (of the connection opening or of
  the previous answer: the keep-alive idle limit too) and be at most ``MAX_HEAD_BYTES``; an
  answer must be taken within ``WRITE_TIMEOUT_S``. Requests with a body are not read: their
  connection is answered and closed.
* The app runs in a bounded pool: ``SCRAPE_WORKERS`` threads for the heavy paths
  (``/metrics``) and one for the rest, so ``/healthz`` never waits behind a scrape.
* ``HEAD`` is ``GET`` without the body (the app is called with ``GET``; ``Content-Length`` is
  the body's). Methods other than ``GET`` and ``HEAD`` are 405.
* Nothing a client does prints a traceback: a client that goes away mid-answer, a reset, or
  ``EMFILE`` on accept (accepting then pauses for ``ACCEPT_PAUSE_S``) is at most one line on
  stderr per kind per ``LOG_INTERVAL_S``, with a count of those not told.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import os
import queue
import re
import resource
import selectors
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: Open connections at most; fewer when an eighth of the soft RLIMIT_NOFILE is less (never under 4).
MAX_CONNECTIONS = 64
MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
SCRAPE_WORKERS = 2
LOG_INTERVAL_S = 60.0
#: How long accepting pauses when the process (or the system) is out of file descriptors.
ACCEPT_PAUSE_S = 0.5
#: The kernel's queue of connections not accepted yet: it costs the agent no fd. Deep enough
#: that a flood does not make the kernel drop a probe's SYN (retried only after a second).
BACKLOG = 1024
_ACCEPTS_PER_TURN = 256
_RECV_BYTES = 65536
_HEAD_END = re.compile(rb"\r?\n\r?\n")
#: Errors of accept(2) that say the process or the system is out of something, not the client.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: A connection its client left before it was accepted: nothing to do.
_CLIENT_LEFT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ETIMEDOUT})

_READING, _WORKING, _WRITING = "reading", "working", "writing"


def connection_limit(ceiling: int = MAX_CONNECTIONS) -> int:
    """``ceiling``, or an eighth of the soft ``RLIMIT_NOFILE`` if that is less (at least 4)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return ceiling
    return max(4, min(ceiling, soft // 8))


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port``; raises ``OSError`` (``socket.gaierror`` for a bad name).

    ``host`` ``""`` is every address: IPv6 and IPv4 on one socket where the host has IPv6,
    IPv4 alone where it has not. ``"::"`` is every address too, as in Go (Prometheus,
    node_exporter) and ``python -m http.server``; a v4-only listener is ``0.0.0.0``.
    """
    if host in ("", "::"):
        try:
            return _listen(socket.AF_INET6, ("::", port), dual_stack=True)
        except OSError as e:
            if host == "::" or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
        return _listen(socket.AF_INET, ("0.0.0.0", port), dual_stack=False)
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return _listen(family, sockaddr, dual_stack=False)


def _listen(family: socket.AddressFamily, address: Any, *, dual_stack: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class RateLimitedLog:
    """One line per kind per ``interval_s``; the lines not written are counted in the next one."""

    def __init__(self, write: Callable[[str], None], *, interval_s: float = LOG_INTERVAL_S) -> None:
        self._write = write
        self._interval_s = interval_s
        self._lock = threading.Lock()
        #: kind -> [when the next line may be written, lines held back since the last one]
        self._kinds: dict[str, list[float]] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._kinds.setdefault(kind, [now, 0])
            if now < state[0]:
                state[1] += 1
                return
            held = int(state[1])
            state[0], state[1] = now + self._interval_s, 0
        if held:
            message += f" ({held} more like it not shown)"
        with contextlib.suppress(OSError, ValueError):
            self._write(message)  # stderr gone: the server goes on regardless


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    #: Until when the current phase may last (the head arriving, the answer being taken).
    deadline: float
    #: When a byte last moved: the connection idle longest is closed first when the cap is hit.
    active: float
    state: str = _READING
    inbox: bytearray = field(default_factory=bytearray)
    #: How much of ``inbox`` holds no end of a head (searched already).
    searched: int = 0
    outbox: memoryview | None = None
    sent: int = 0
    keep_alive: bool = True
    #: The selector events it is registered for (0: not registered).
    events: int = 0


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: str
    version: str
    headers: http.client.HTTPMessage
    keep_alive: bool


class Server:
    """Serves ``app`` on ``sock`` (listening) from ``serve_forever`` until ``shutdown``.

    ``heavy(path)`` says which requests go to the scrape pool; the rest go to a pool of one.
    ``log(message)`` writes one diagnostic line (it is rate-limited here).
    """

    def __init__(
        self,
        sock: socket.socket,
        app: WSGIApp,
        *,
        heavy: Callable[[str], bool] = lambda path: True,
        log: Callable[[str], None],
        max_connections: int | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self._listener = sock
        self._listener.setblocking(False)
        self._app = app
        self._heavy = heavy
        self.log = RateLimitedLog(log)
        self.max_connections = connection_limit() if max_connections is None else max_connections
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        host, port = sock.getsockname()[:2]
        self._server_name, self._server_port = str(host), str(port)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._accepting = False
        self._resume_at: float | None = None
        self._connections: dict[int, _Connection] = {}
        self._answered: queue.SimpleQueue[tuple[_Connection, bytes]] = queue.SimpleQueue()
        self._pools = (
            ThreadPoolExecutor(SCRAPE_WORKERS, thread_name_prefix="shmctl-http-scrape"),
            ThreadPoolExecutor(1, thread_name_prefix="shmctl-http"),
        )
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._accept_again()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def connections(self) -> int:
        return len(self._connections)

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception as e:  # a bug here must not end /metrics and /healthz for good
                    self.log("loop", f"--listen: {type(e).__name__}: {e}")
                    time.sleep(0.05)
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop the loop (from another thread), then close every connection and the listener."""
        self._stop.set()
        self._wake()
        self._stopped.wait(5)
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for conn in list(self._connections.values()):
            self._close(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the loop -----------------------------------------------------------------------------

    def _turn(self) -> None:
        now = time.monotonic()
        timeout = 1.0
        for conn in self._connections.values():
            if conn.state != _WORKING:
                timeout = min(timeout, conn.deadline - now)
        if self._resume_at is not None:
            timeout = min(timeout, self._resume_at - now)
        for key, mask in self._selector.select(max(timeout, 0.0)):
            if key.fileobj is self._listener:
                self._accept()
            elif key.data is None:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            else:
                conn = key.data
                if conn.sock.fileno() < 0:
                    continue  # closed earlier in this turn
                if mask & selectors.EVENT_READ and conn.state == _READING:
                    self._read(conn)
                elif mask & selectors.EVENT_READ and conn.state == _WORKING:
                    self._check_gone(conn)
                elif mask & selectors.EVENT_WRITE and conn.state == _WRITING:
                    self._write(conn)
        while True:
            try:
                conn, answer = self._answered.get_nowait()
            except queue.Empty:
                break
            self._answer(conn, answer)
        now = time.monotonic()
        for conn in [c for c in self._connections.values() if c.state != _WORKING and c.deadline <= now]:
            if conn.state == _WRITING:
                self.log("aborted", "--listen: a client did not take its answer in time; closed")
            self._close(conn)
        if not self._accepting and (
            (self._resume_at is not None and now >= self._resume_at)
            or (self._resume_at is None and self.connections < self.max_connections)
        ):
            self._accept_again()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is awake already
            self._wake_w.send(b"\0")

    # --- accepting ----------------------------------------------------------------------------

    def _accept_again(self) -> None:
        self._resume_at = None
        if not self._accepting:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._accepting = True

    def _pause_accepting(self, until: float | None) -> None:
        """Leave new connections in the backlog: until ``until``, or until a connection closes."""
        self._resume_at = until
        if self._accepting:
            self._selector.unregister(self._listener)
            self._accepting = False

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            full = self.connections >= self.max_connections
            if full and self._stalest() is None:
                self._pause_accepting(None)  # every connection is being answered
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _CLIENT_LEFT:
                    continue
                reason = os.strerror(e.errno) if e.errno else str(e)
                self.log(
                    "accept", f"--listen: cannot accept a connection ({reason}); pausing {ACCEPT_PAUSE_S}s"
                )
                self._pause_accepting(time.monotonic() + ACCEPT_PAUSE_S)
                return
            if full:
                stalest = self._stalest()
                if stalest is not None:
                    self._close(stalest)
            self._open(sock)

    def _stalest(self) -> _Connection | None:
        """The connection that moved no byte for longest, of those not being answered now."""
        idle = [c for c in self._connections.values() if c.state != _WORKING]
        return min(idle, key=lambda c: c.active, default=None)

    def _open(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()  # reset already
            return
        now = time.monotonic()
        conn = _Connection(sock, deadline=now + self._read_timeout_s, active=now)
        self._connections[sock.fileno()] = conn
        self._listen_for(conn, selectors.EVENT_READ)

    def _listen_for(self, conn: _Connection, events: int) -> None:
        if events == conn.events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif not conn.events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Connection) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            conn.events = 0
        self._connections.pop(fd, None)
        conn.sock.close()
        conn.inbox.clear()
        conn.outbox = None

    # --- reading a request ----------------------------------------------------------------------

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)  # reset between requests: the client left, nothing was lost
            return
        if not data:
            self._close(conn)
            return
        conn.active = time.monotonic()
        conn.inbox += data
        self._next_request(conn)

    def _next_request(self, conn: _Connection) -> None:
        """Start answering the request whose head is in ``conn.inbox``, if it is all there."""
        if not conn.searched:
            # Blank lines before a request line are to be ignored (RFC 9112, 2.2); at once,
            # not line by line (a flood of them would cost a copy of the rest for each).
            del conn.inbox[: len(conn.inbox) - len(conn.inbox.lstrip(b"\r\n"))]
        # From where the last search stopped (less what may be half of the blank line): a
        # head sent a byte at a time is searched once, not once per byte.
        end = _HEAD_END.search(conn.inbox, max(0, conn.searched - 3), MAX_HEAD_BYTES + 4)
        if end is None:
            conn.searched = len(conn.inbox)
            if len(conn.inbox) > MAX_HEAD_BYTES:
                self._refuse(conn, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head over 8 KiB")
            return
        head = bytes(conn.inbox[: end.end()])
        del conn.inbox[: end.end()]
        conn.searched = 0
        request = _parse(head)
        if isinstance(request, tuple):
            self._refuse(conn, *request)
            return
        if request.method not in ("GET", "HEAD"):
            self._refuse(conn, HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method}: use GET or HEAD")
            return
        conn.keep_alive = request.keep_alive
        conn.state = _WORKING  # still listened to: a client that leaves is not worked for
        pool = self._pools[0] if self._heavy(request.path) else self._pools[1]
        try:
            pool.submit(self._call, conn, request)
        except RuntimeError:  # shutting down
            self._close(conn)

    def _check_gone(self, conn: _Connection) -> None:
        """A connection being answered became readable: its client left (end of file, reset),
        or it sent its next request already, which waits until this answer is out."""
        try:
            more = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            more = b""
        if more:
            self._listen_for(conn, 0)
        else:
            self._close(conn)  # its answer, if it is being made, is dropped when it comes

    def _refuse(self, conn: _Connection, status: HTTPStatus, reason: str) -> None:
        """Answer with an error and close: what follows the head cannot be trusted as a request."""
        conn.keep_alive = False
        body = f"{status.value} {status.phrase}: {reason}\n".encode()
        headers = [("Content-Type", "text/plain; charset=utf-8")]
        if status is HTTPStatus.METHOD_NOT_ALLOWED:
            headers.append(("Allow", "GET, HEAD"))
        self._answer(conn, _response(f"{status.value} {status.phrase}", headers, body, keep_alive=False))

    # --- answering --------------------------------------------------------------------------------

    def _call(self, conn: _Connection, request: _Request) -> None:
        """In a pool thread: the app's answer, handed to the loop."""
        if conn.sock.fileno() < 0:
            return  # its client left while it waited for a worker: no scrape for nobody
        try:
            status, headers, body = _run(self._app, self._environ(conn, request))
        except Exception as e:
            self.log("app", f"--listen: {request.path}: {type(e).__name__}: {e}")
            status, headers = "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")]
            body = b"500 Internal Server Error: see the agent's stderr\n"
        length = len(body)
        if request.method == "HEAD":
            body = b""
        answer = _response(status, headers, body, keep_alive=conn.keep_alive, length=length)
        self._answered.put((conn, answer))
        self._wake()

    def _environ(self, conn: _Connection, request: _Request) -> dict[str, Any]:
        environ: dict[str, Any] = {
            # HEAD is GET without the body: the app answers GET, the body is dropped here.
            "REQUEST_METHOD": "GET" if request.method == "HEAD" else request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query,
            "SERVER_NAME": self._server_name,
            "SERVER_PORT": self._server_port,
            "SERVER_PROTOCOL": request.version,
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers.items():
            if "_" in name:
                continue  # it would pass for a dash in the environ: a header a proxy did not check
            key = name.upper().replace("-", "_")
            key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ

    def _answer(self, conn: _Connection, answer: bytes) -> None:
        if conn.sock.fileno() < 0:
            return  # closed while it was answered (shutdown)
        now = time.monotonic()
        conn.state = _WRITING
        conn.outbox = memoryview(answer)
        conn.sent = 0
        conn.deadline = now + self._write_timeout_s
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        assert conn.outbox is not None
        try:
            conn.sent += conn.sock.send(conn.outbox[conn.sent :])
        except (BlockingIOError, InterruptedError):
            self._listen_for(conn, selectors.EVENT_WRITE)
            return
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e)
            self.log("aborted", f"--listen: a client went away before its answer was sent ({reason})")
            self._close(conn)
            return
        now = time.monotonic()
        conn.active = now
        if conn.sent < len(conn.outbox):
            self._listen_for(conn, selectors.EVENT_WRITE)
            return
        conn.outbox = None
        if not conn.keep_alive:
            self._close(conn)
            return
        conn.state = _READING
        conn.deadline = now + self._read_timeout_s
        self._listen_for(conn, selectors.EVENT_READ)
        if conn.inbox:
            self._next_request(conn)  # pipelined


def _parse(head: bytes) -> _Request | tuple[HTTPStatus, str]:
    """The request in ``head`` (its line and headers), or why it is refused."""
    line, _, rest = head.partition(b"\n")
    parts = line.rstrip(b"\r").decode("latin-1").split()
    if len(parts) != 3:
        return HTTPStatus.BAD_REQUEST, "malformed request line"
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        return HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"{version[:16]!r}: use HTTP/1.1"
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except (http.client.HTTPException, UnicodeError):
        return HTTPStatus.BAD_REQUEST, "malformed headers"
    if not target.startswith("/"):
        target = urllib.parse.urlsplit(target).path or "/"  # absolute-form
    raw_path, _, query = target.partition("?")
    tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",")}
    # A body is never read: its connection closes after the answer, not mistaken for a request.
    has_body = (
        headers.get("Transfer-Encoding") is not None or headers.get("Content-Length", "0").strip() != "0"
    )
    keep_alive = version == "HTTP/1.1" and "close" not in tokens and not has_body
    path = urllib.parse.unquote(raw_path, "latin-1")
    return _Request(method, path, query, version, headers, keep_alive)


def _run(app: WSGIApp, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Call ``app``; its status line, headers and body."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    written: list[bytes] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]:
        started[:] = [(status, headers)]
        return written.append

    result = app(environ, start_response)
    try:
        body = b"".join([*written, *result])
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    if not started:
        raise RuntimeError("the app did not start a response")
    status, headers = started[0]
    return status, headers, body


def _response(
    status: str, headers: list[tuple[str, str]], body: bytes, *, keep_alive: bool, length: int | None = None
) -> bytes:
    """The answer's bytes; ``length`` is the body's (a HEAD answer tells the length of a GET's)."""
    lines = [f"HTTP/1.1 {status}"]
    lines += [
        f"{name}: {value}"
        for name, value in headers
        if name.lower() not in ("connection", "transfer-encoding", "content-length")
    ]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@contextlib.contextmanager
def serving(server: Server) -> Iterator[Server]:
    """Run ``server`` on a daemon thread for the ``with`` block; everything is closed after it."""
    thread = threading.Thread(target=server.serve_forever, name="shmctl-http", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(5)
