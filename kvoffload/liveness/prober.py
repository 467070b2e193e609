"""Probe region files in a forked child while the caller walks ``/proc``: a scan on two cores.

A scan has two heavy passes that do not depend on each other: opening every region file
(owner record, write lease, lock) and reading every process's fds and maps. Each is a
long run of syscalls with a little Python between them, so on one core they run one
after the other. With a second core, a child process probes while the parent walks.

Safety, which matters more than the time saved:

* The parent's ``/proc`` walk skips the child (``Probing.pids``): the child's probe fds,
  leases and flocks are the scan's own, not a holder's. Whatever the parent itself held
  when it forked is still seen, through the parent's own entry.
* A child that fails in any way (killed, an exception, a short or unreadable result) gives
  no answer at all: the parent then probes every file itself, after its walk, exactly as
  the serial path does. A verdict never rests on a half result.
* The child never returns into the caller's code: it leaves through ``os._exit`` whatever
  happens, so no ``finally`` or ``atexit`` of the caller runs twice. If the caller is
  interrupted, the child is killed and reaped before the exception goes on.
* The child's write leases are guarded like the parent's (``guard``): it shares the
  parent's watchdog through the inherited table and claims a slot of its own right after
  the fork. A child stopped while an engine waits on its lease is SIGKILLed; that is a
  failed child like any other, and the parent probes every file itself.
* fork only from a single-threaded process (another thread could hold a lock the child
  would need), with at least two CPUs to run on, and for at least ``PARALLEL_MIN`` files;
  otherwise the probes run in the caller, after the walk.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from kvoffload.liveness import guard

T = TypeVar("T")
R = TypeVar("R")

#: Below this many files a fork (about 2 ms) and the result's trip through a pipe cost more
#: than probing them after the walk (about 20 µs a file).
PARALLEL_MIN = 512


def parallel_possible() -> bool:
    """True where a forked child can probe beside us: one thread, two CPUs, ``fork``."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


class Probing(Generic[T, R]):
    """Results of ``probe`` for every item: from the child when it ran, else computed here."""

    def __init__(
        self, items: Sequence[T], probe: Callable[[T], R], child: int | None, pipe: int | None
    ) -> None:
        self._items = items
        self._probe = probe
        self._child = child
        self._pipe = pipe
        #: Processes the caller's ``/proc`` walk must not count as holders.
        self.pids: frozenset[int] = frozenset() if child is None else frozenset({child})
        #: True when the results came from the child.
        self.parallel = False

    def results(self) -> list[R]:
        answer = self._collect()
        if answer is not None:
            self.parallel = True
            return answer
        return [self._probe(item) for item in self._items]

    def _collect(self) -> list[R] | None:
        if self._child is None or self._pipe is None:
            return None
        chunks = []
        try:
            while chunk := os.read(self._pipe, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self._pipe)
            self._pipe = None
        _, status = os.waitpid(self._child, 0)
        self._child = None
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            return None
        import pickle

        try:
            answer = pickle.loads(b"".join(chunks))
        except Exception:
            return None
        if not isinstance(answer, list) or len(answer) != len(self._items):
            return None
        return answer

    def _stop(self) -> None:
        """Kill and reap a child still running (the caller was interrupted)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._child, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._child, 0)
            self._child = None


@contextlib.contextmanager
def start(
    items: Sequence[T], probe: Callable[[T], R], *, parallel: bool | None = None
) -> Iterator[Probing[T, R]]:
    """Start probing ``items``: in a child now (see the module docstring), or in ``results()``.

    ``parallel`` forces the choice (tests, ``--jobs``-like callers); None decides from the
    process and the number of items.
    """
    if parallel is None:
        parallel = len(items) >= PARALLEL_MIN and parallel_possible()
    if not parallel:
        yield Probing(items, probe, None, None)
        return
    import pickle

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's lines report to no coverage file
        code = 1
        try:
            os.close(read_end)
            guard.adopt()
            data = pickle.dumps([probe(item) for item in items], pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view) :]
            code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    os.close(write_end)
    probing: Probing[T, R] = Probing(items, probe, child, read_end)
    try:
        yield probing
    finally:
        probing._stop()
