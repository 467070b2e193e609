"""The ``--listen`` server's old place: it is ``shmctl.serve.server`` now (``render`` only formats)."""

#: Moved to shmctl.serve.server; kept here for one release (issue #29).
from shmctl.serve.server import (
    ACCEPT_PAUSE_S,
    BACKLOG,
    LOG_INTERVAL_S,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    READ_TIMEOUT_S,
    SCRAPE_WORKERS,
    WRITE_TIMEOUT_S,
    RateLimitedLog,
    Server,
    WSGIApp,
    connection_limit,
    listening_socket,
    serving,
)

__all__ = [
    "ACCEPT_PAUSE_S",
    "BACKLOG",
    "LOG_INTERVAL_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "READ_TIMEOUT_S",
    "SCRAPE_WORKERS",
    "WRITE_TIMEOUT_S",
    "RateLimitedLog",
    "Server",
    "WSGIApp",
    "connection_limit",
    "listening_socket",
    "serving",
]
