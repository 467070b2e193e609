"""Probe region files in a forked child while the caller walks ``/proc``: a scan on two cores.

A scan has two heavy passes that do not depend on each other: opening every region file
(owner record, write lease, lock) and reading every process's fds and maps. Each is a
long run of syscalls with a little Python between them, so on one core they run one
after the other. With a second core, a child process probes while the parent walks, and
the parent, its walk done, probes beside the child until no file is left: the probes
are about three times the walk, so a child alone would leave the parent waiting.

The items are split into runs of ``RUN`` (or more, for a huge root) and each run is
claimed once: its number is read from a pipe that holds every run's number before the
fork. A pipe read of four bytes takes four bytes or none, and each process reads whole
numbers only, so no run is probed twice (two probes of one file at once would break each
other's lease) and no run is skipped.

Safety, which matters more than the time saved:

* The parent's ``/proc`` walk skips the child (``Probing.pids``): the child's probe fds,
  leases and flocks are the scan's own, not a holder's. Whatever the parent itself held
  when it forked is still seen, through the parent's own entry.
* A child that fails in any way (killed, an exception, a short or unreadable result) gives
  no answer at all: the parent then probes every file it has not probed itself, after the
  child is reaped, exactly as the serial path does. A verdict never rests on a half result.
* The child never returns into the caller's code: it leaves through ``os._exit`` whatever
  happens, so no ``finally`` or ``atexit`` of the caller runs twice. If the caller is
  interrupted, the child is killed and reaped before the exception goes on.
* The child's write leases are guarded like the parent's (``watchdog``): it shares the
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
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from kvoffload.liveness import watchdog

T = TypeVar("T")
R = TypeVar("R")

#: Below this many files a fork (about 2 ms) and the result's trip through a pipe cost more
#: than probing them after the walk (about 20 µs a file).
PARALLEL_MIN = 512
#: Items per claimed run: a claim (one pipe read) is noise next to 128 probes (2-3 ms), and
#: the two processes finish within one run of each other.
RUN = 128
#: Run numbers written to the claims pipe before the fork: they must fit its buffer, or the
#: write would block with no reader yet. A pipe holds at least one page (4 KiB, what Linux
#: gives a user past ``fs.pipe-user-pages-soft``): 1,024 numbers of four bytes.
_MAX_RUNS = 1024
_CLAIM = struct.Struct("!I")


def parallel_possible() -> bool:
    """True where a forked child can probe beside us: one thread, two CPUs, ``fork``."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


def _runs(count: int) -> list[range]:
    """``range(count)`` in at most ``_MAX_RUNS`` consecutive runs of ``RUN`` or more."""
    size = max(RUN, -(-count // _MAX_RUNS))
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def _claim(claims: int) -> int | None:
    """The next unclaimed run's number, or None when every run is taken."""
    data = os.read(claims, _CLAIM.size)
    if len(data) != _CLAIM.size:  # end of file (a short read cannot happen: see the docstring)
        return None
    return int(_CLAIM.unpack(data)[0])


class Probing(Generic[T, R]):
    """Results of ``probe`` for every item: runs the child probed, the rest probed here."""

    def __init__(
        self,
        items: Sequence[T],
        probe: Callable[[T], R],
        child: int | None,
        pipe: int | None,
        claims: int | None = None,
    ) -> None:
        self._items = items
        self._probe = probe
        self._child = child
        self._pipe = pipe
        self._claims = claims
        self._runs = _runs(len(items))
        #: Processes the caller's ``/proc`` walk must not count as holders.
        self.pids: frozenset[int] = frozenset() if child is None else frozenset({child})
        #: True when the child's answer was used (for the runs it claimed).
        self.parallel = False

    def results(self) -> list[R]:
        """Every item's result, in order. Call it after the walk: the parent probes here."""
        done: dict[int, list[R]] = {}
        if self._claims is not None:
            try:
                while (run := _claim(self._claims)) is not None:
                    done[run] = [self._probe(self._items[i]) for i in self._runs[run]]
            finally:
                os.close(self._claims)
                self._claims = None
        answer = self._collect()
        if answer is not None and not answer.keys() & done.keys():
            self.parallel = bool(answer)
            done.update(answer)
        # Runs the child claimed but did not answer for (it failed): probed here, the child
        # being reaped, so never twice at once.
        out: list[R] = []
        for number, span in enumerate(self._runs):
            results = done.get(number)
            if results is None or len(results) != len(span):
                results = [self._probe(self._items[i]) for i in span]
            out.extend(results)
        return out

    def _collect(self) -> dict[int, list[R]] | None:
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
        if not isinstance(answer, dict) or not all(
            isinstance(k, int) and 0 <= k < len(self._runs) and isinstance(v, list) for k, v in answer.items()
        ):
            return None
        return answer

    def _stop(self) -> None:
        """Kill and reap a child still running (the caller was interrupted)."""
        for name in ("_pipe", "_claims"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
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

    runs = _runs(len(items))
    claims, claims_w = os.pipe()
    try:
        os.write(claims_w, b"".join(_CLAIM.pack(n) for n in range(len(runs))))
    finally:
        os.close(claims_w)  # once drained, a claim reads end of file in both processes
    child = None
    with contextlib.suppress(OSError):  # no fd or process left: every probe after the walk
        read_end, write_end = os.pipe()
        try:
            child = os.fork()
        finally:
            if child is None:
                os.close(read_end)
                os.close(write_end)
    if child is None:
        os.close(claims)
        yield Probing(items, probe, None, None)
        return
    if child == 0:  # pragma: no cover - the child's lines report to no coverage file
        code = 1
        try:
            os.close(read_end)
            watchdog.adopt()
            done = {}
            with watchdog.batched():  # one lease after another: Ctrl-Z deferred between them
                while (run := _claim(claims)) is not None:
                    done[run] = [probe(items[i]) for i in runs[run]]
            data = pickle.dumps(done, pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view) :]
            code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    os.close(write_end)
    probing: Probing[T, R] = Probing(items, probe, child, read_end, claims)
    try:
        yield probing
    finally:
        probing._stop()
