"""The fs tier's I/O threads: two queues (loads, stores) served by two groups of threads.

Read threads take from the load queue first and write threads from the store queue
first; either falls back to the other queue when its own is empty. Promotions (a request
waits for them) therefore never queue behind a backlog of cascades, and no thread idles
while there is work of either kind.

A job is one or more tasks (callables). It is finished when its last task returns, and
failed if any task raised; each finished job is reported once by ``get_finished``, with
the time its tasks spent running. The pool keeps the tier's promise that every job
submitted is reported: a job enqueued after ``shutdown``, or still queued when it came,
is reported as failed instead of vanishing (vLLM drops those and resets its in-flight
count to keep ``wait_idle`` from hanging).

``shutdown`` lets a task that is running finish (a task copies into or out of the
primary view, and half a copy corrupts one side) and joins every thread, so once it
returns no task can touch the view again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self

from kvoffload.errors import ConfigError
from kvoffload.tiering.base import JobId

log = logging.getLogger(__name__)

Task = Callable[[], object]
#: A finished job as ``get_finished`` reports it: (job id, success, seconds its tasks ran).
FinishedJob = tuple[JobId, bool, float]


class JobState:
    """How far one job's tasks have got. Its counters are guarded by the pool's lock."""

    __slots__ = ("job_id", "remaining", "success", "transfer_time")

    def __init__(self, job_id: JobId, n_tasks: int) -> None:
        self.job_id = job_id
        self.remaining = n_tasks
        self.success = True
        self.transfer_time = 0.0

    def task_done(self, success: bool, transfer_time: float) -> bool:
        """Count one task; True when it was the job's last."""
        self.remaining -= 1
        self.success = self.success and success
        self.transfer_time += transfer_time
        return self.remaining == 0


class DualQueueThreadPool:
    """``n_read_threads`` load-first and ``n_write_threads`` store-first threads over two queues."""

    def __init__(
        self,
        n_read_threads: int,
        n_write_threads: int,
        thread_name_prefix: str = "kvoffload_fs",
    ) -> None:
        for name, value in (("n_read_threads", n_read_threads), ("n_write_threads", n_write_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        if n_read_threads + n_write_threads == 0:
            raise ConfigError(
                "n_read_threads",
                "with no read and no write threads no job would ever run",
                fix="set n_read_threads or n_write_threads to at least 1",
            )
        self._load_q: deque[tuple[Task, JobState]] = deque()
        self._store_q: deque[tuple[Task, JobState]] = deque()
        self._finished_q: deque[FinishedJob] = deque()
        # One lock for the queues, the job counters and the in-flight count: a task is
        # short next to the I/O it does, so one lock costs nothing and leaves no ordering.
        self._condition = threading.Condition(threading.Lock())
        self._inflight_jobs = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        try:
            for load_first, count, tag in ((True, n_read_threads, "l"), (False, n_write_threads, "s")):
                for i in range(count):
                    thread = threading.Thread(
                        target=self._worker,
                        args=(load_first,),
                        name=f"{thread_name_prefix}_{tag}{i}",
                        daemon=True,
                    )
                    thread.start()
                    self._threads.append(thread)
        except BaseException:
            self.shutdown()  # the threads that did start
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- the tier's side

    def enqueue_load(self, job_id: JobId, n_tasks: int, tasks: Iterable[Task]) -> None:
        """Queue a job's tasks where read threads look first."""
        self._enqueue(self._load_q, job_id, n_tasks, tasks)

    def enqueue_store(self, job_id: JobId, n_tasks: int, tasks: Iterable[Task]) -> None:
        """Queue a job's tasks where write threads look first."""
        self._enqueue(self._store_q, job_id, n_tasks, tasks)

    def get_finished(self) -> list[FinishedJob]:
        """The jobs finished since the last call, oldest first."""
        with self._condition:
            finished = list(self._finished_q)
            self._finished_q.clear()
        return finished

    def has_inflight_jobs(self) -> bool:
        with self._condition:
            return self._inflight_jobs > 0

    def wait_idle(self) -> None:
        """Block until every job enqueued so far has finished (its result may still be unread)."""
        with self._condition:
            self._condition.wait_for(lambda: self._inflight_jobs == 0)

    def shutdown(self, wait: bool = True) -> None:
        """Cancel what is queued (reported as failed), stop the threads; ``wait`` joins them. Idempotent."""
        with self._condition:
            self._stop = True
            cancelled = [*self._load_q, *self._store_q]
            self._load_q.clear()
            self._store_q.clear()
            for _, state in cancelled:
                if state.task_done(False, 0.0):
                    self._finish(state)
            self._condition.notify_all()
        if cancelled:
            log.warning("fs tier pool shut down with %d queued tasks; their jobs fail", len(cancelled))
        if wait:
            current = threading.current_thread()
            for thread in self._threads:
                if thread is not current:
                    thread.join()

    close = shutdown

    # ----------------------------------------------------------------- internals

    def _enqueue(
        self, target: deque[tuple[Task, JobState]], job_id: JobId, n_tasks: int, tasks: Iterable[Task]
    ) -> None:
        todo = list(tasks)
        if len(todo) != n_tasks:
            raise ConfigError("n_tasks", f"job {job_id} says {n_tasks} tasks but has {len(todo)}")
        state = JobState(job_id, len(todo))
        with self._condition:
            self._inflight_jobs += 1
            if not todo or self._stop:
                # Nothing to run, or nobody left to run it: finished now, failed if stopped.
                state.success = not self._stop
                self._finish(state)
                return
            target.extend((task, state) for task in todo)
            self._condition.notify(len(todo))

    def _finish(self, state: JobState) -> None:
        # Called with the lock held.
        self._finished_q.append((state.job_id, state.success, state.transfer_time))
        self._inflight_jobs -= 1
        self._condition.notify_all()

    def _worker(self, load_first: bool) -> None:
        own, other = (self._load_q, self._store_q) if load_first else (self._store_q, self._load_q)
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._stop or bool(own) or bool(other))
                if self._stop:
                    return
                task, state = own.popleft() if own else other.popleft()
            started = time.monotonic()
            try:
                task()
            except Exception as e:
                ok = False
                log.warning("fs tier job %s: block I/O failed: %s", state.job_id, e)
            else:
                ok = True
            elapsed = time.monotonic() - started
            with self._condition:
                if state.task_done(ok, elapsed):
                    self._finish(state)
