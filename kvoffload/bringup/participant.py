"""The body of one participant process of a bring-up: a worker or the scheduler.

A worker does what a vLLM worker does with CPU offload: construct the spec, allocate its
KV cache (CUDA tensors when a GPU is present, CPU tensors otherwise), ``create_worker``
(map its slot of the region), and later ``shutdown``. The scheduler constructs the spec
and calls ``get_manager`` (the tiering spec maps the whole region there). Each step is
reported to the parent as a ``StageResult``; the fault points it passed are read from the
marker hit counts (see ``faultplan``).

Protocol over the pipe, child -> parent: ``("stage", StageResult)``, ``("progress",
stage, done, total)``, ``("ready", detail)`` or ``("failed",)`` once init ends, then
``("roundtrip-done",)`` and finally ``("released", steps, hits, held, left_running)``. Parent -> child:
``("roundtrip",)`` and ``("shutdown",)``. A closed pipe (the parent died) means
shutdown: a participant never outlives its orchestrator holding a region.

After its release a participant also checks that the threads and sockets it started since
it began have gone (a secondary tier's control socket and pool threads are no file in the
root); what is still there a moment later is reported as a failed release step and makes
the bring-up ``leaked``.

SIGINT is ignored: Ctrl-C reaches the whole process group, and the parent alone decides
how to tear down (gracefully, in vLLM's order).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from kvoffload import faults
from kvoffload.bringup.plan import SCHEDULER, WORKER
from kvoffload.bringup.report import CleanupStep, ErrorInfo, LogLine, StageResult
from kvoffload.bringup.residue import Footprint, held_handles, left_running
from kvoffload.errors import KvOffloadError
from kvoffload.release import Journal, ReleaseStep
from kvoffload.settings import OffloadingSettings

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ParticipantArgs:
    name: str
    role: str  # WORKER or SCHEDULER
    rank: int | None
    config: OffloadingSettings
    failpoints: str | None
    seed: int | None
    barrier_timeout_s: float
    #: Test-only: exit without releasing anything (the residue check must catch it).
    skip_release: bool = False


class _StageFailed(Exception):
    pass


def main(conn: Connection, args: ParticipantArgs, barrier: Any | None) -> None:
    """Process entry point (importable, so the forkserver and spawn start methods work)."""
    # Ctrl-C reaches the whole foreground process group, and a service stop (SIGTERM) or a closed
    # terminal (SIGHUP) the whole cgroup or session: the parent hears it and asks each
    # participant to shut down in vLLM's order. One killed by the signal itself would leave
    # its share of the region unreleased and read as a crash.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    faults.configure(args.failpoints, seed=args.seed)
    child = _Participant(conn, args, barrier)
    _forward_logs(child)
    child.run()


class _PipeLogHandler(logging.Handler):
    """Warnings and errors go to the parent as one line each, not to the terminal's stderr."""

    def __init__(self, child: _Participant) -> None:
        super().__init__(logging.WARNING)
        self.child = child

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message += f" ({type(error).__name__}: {error})"
        line = LogLine(self.child.args.name, record.levelname, record.name, message, time.time())
        self.child.send("log", line)


def _forward_logs(child: _Participant) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_PipeLogHandler(child))
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)


class _Participant:
    def __init__(self, conn: Connection, args: ParticipantArgs, barrier: Any | None) -> None:
        # Before anything of the bring-up exists: what is new after the release was left running.
        # Sockets and threads everywhere; event fds (a ZMQ context's, say) only where tiers run.
        self.footprint = Footprint.now(event_fds=args.role == SCHEDULER)
        self.conn = conn
        self.args = args
        self.barrier = barrier
        self.journal = Journal()
        self.spec: Any = None
        self.kv_caches: list[Any] = []
        self.worker: Any = None
        self.manager: Any = None
        self._stage_name = ""
        self._populated = 0

    # ----------------------------------------------------------------- protocol

    def send(self, *message: object) -> None:
        # A gone parent is no reason to stop: the participant still releases what it holds.
        with contextlib.suppress(BrokenPipeError, EOFError, OSError):
            self.conn.send(message)

    def run(self) -> None:
        try:
            if self.args.role == WORKER:
                self._init_worker()
            else:
                self._init_scheduler()
        except _StageFailed:
            self.send("failed")
        else:
            self.send("ready", self._detail())
        while True:
            try:
                command = self.conn.recv()
            except (EOFError, OSError):
                command = ("shutdown",)
            if command[0] == "roundtrip":
                with contextlib.suppress(_StageFailed):
                    self._stage("roundtrip", self._roundtrip, nbytes=int)
                self.send("roundtrip-done")
            elif command[0] == "shutdown":
                self._release()
                return

    # ----------------------------------------------------------------- stages

    def _stage(
        self,
        name: str,
        fn: Callable[[], T],
        *,
        nbytes: Callable[[T], int] | None = None,
        detail: Callable[[T], str | None] | None = None,
    ) -> T:
        self._stage_name = name
        self._populated = 0
        before = faults.hits()
        started = time.monotonic()
        try:
            result = fn()
        except Exception as e:
            error = ErrorInfo.of(e, self.args.name, name)
            self._report(name, started, before, nbytes=self._populated, error=error)
            raise _StageFailed from e
        self._report(
            name,
            started,
            before,
            nbytes=nbytes(result) if nbytes else self._populated,
            detail=detail(result) if detail else None,
        )
        return result

    def _report(
        self,
        name: str,
        started: float,
        hits_before: dict[str, int],
        *,
        nbytes: int = 0,
        detail: str | None = None,
        error: ErrorInfo | None = None,
    ) -> None:
        after = faults.hits()
        passed = tuple(p for p, n in after.items() if n > hits_before.get(p, 0))
        if error is not None and error.point and error.point not in passed:
            passed = (*passed, error.point)
        self.send(
            "stage",
            StageResult(
                name=name,
                participant=self.args.name,
                pid=os.getpid(),
                started_s=started,
                seconds=time.monotonic() - started,
                bytes=nbytes,
                result="ok" if error is None else "failed",
                detail=detail,
                points=passed,
                error=error,
            ),
        )

    def _on_progress(self, done: int, total: int) -> None:
        self._populated = done
        self.send("progress", self._stage_name, done, total)

    def _spec_class(self) -> Any:
        if self.args.config.is_tiering:
            from kvoffload.tiering.spec import TieringOffloadingSpec

            return TieringOffloadingSpec
        from kvoffload.cpu.spec import CPUOffloadingSpec

        return CPUOffloadingSpec

    def _barrier_call(self) -> Callable[[], object] | None:
        barrier, timeout = self.barrier, self.args.barrier_timeout_s
        if barrier is None:
            return None
        return lambda: barrier.wait(timeout)

    def _init_worker(self) -> None:
        cls = self._spec_class()
        self.spec = self._stage(
            "validate",
            lambda: cls.from_settings(
                self.args.config,
                barrier=self._barrier_call(),
                progress=self._on_progress,
                journal=self.journal,
            ),
        )
        self.kv_caches = self._stage(
            "kv_cache", self._allocate_kv_cache, nbytes=_tensor_bytes, detail=_device_of
        )
        self.worker = self._stage(
            "create_worker", lambda: self.spec.create_worker(self.kv_caches), detail=self._region_role
        )

    def _init_scheduler(self) -> None:
        cls = self._spec_class()
        self.spec = self._stage(
            "validate",
            lambda: cls.from_settings(self.args.config, progress=self._on_progress, journal=self.journal),
        )
        self.manager = self._stage("get_manager", self.spec.get_manager, detail=self._manager_detail)

    def _region_role(self, _: object) -> str:
        # Only the creator reaches region.space; its marker says which side of the election we were on.
        return "created the region" if faults.hits().get("region.space") else "joined the region"

    def _manager_detail(self, manager: object) -> str:
        tiers = getattr(manager, "secondary_tiers", None)
        kind = type(manager).__name__
        return kind if tiers is None else f"{kind}, {len(tiers)} secondary tier(s)"

    def _detail(self) -> str | None:
        return _device_of(self.kv_caches) if self.kv_caches else None

    def _allocate_kv_cache(self) -> list[Any]:
        """Two tensors (K and V) of the worker's bytes per block, or one for an odd size.

        Two blocks per chunk's worth: the round trip stores the first and loads into the second.
        """
        try:
            import torch
        except ImportError:
            raise KvOffloadError(
                "torch is not installed: a worker needs it for its KV cache",
                fix="pip install 'shmctl[torch]' (scan, reap and --dry-run work without it)",
            ) from None

        per_block = self.args.config.worker_kv_bytes_per_block
        blocks = 2 * self.args.config.blocks_per_chunk
        device = "cpu"
        if torch.cuda.is_available():
            device = f"cuda:{(self.args.rank or 0) % torch.cuda.device_count()}"
        parts = [per_block // 2, per_block - per_block // 2] if per_block % 2 == 0 else [per_block]
        return [torch.zeros((blocks, page), dtype=torch.int8, device=device) for page in parts]

    def _roundtrip(self) -> int:
        """Store one chunk's blocks to the region, load them back into other blocks, compare."""
        import torch

        from kvoffload.base import GPULoadStoreSpec
        from kvoffload.cpu.common import CPULoadStoreSpec

        worker, n, rank = self.worker, self.args.config.blocks_per_chunk, self.args.rank or 0
        if worker is None:
            raise KvOffloadError("no worker to run the round trip through")
        chunk = rank % self.spec.num_chunks
        for i, t in enumerate(self.kv_caches):
            pattern = (torch.arange(t[:n].numel(), dtype=torch.int64) * 7 + 31 * rank + i) % 251 - 125
            t[:n].copy_(pattern.to(torch.int8).view(t[:n].shape))
            t[n:].zero_()
        src, dst = GPULoadStoreSpec(range(n)), CPULoadStoreSpec([chunk])
        _run_job(worker, worker.submit_store, 1, src, dst)
        _run_job(worker, worker.submit_load, 2, dst, GPULoadStoreSpec(range(n, 2 * n)))
        for i, t in enumerate(self.kv_caches):
            if not torch.equal(t[:n], t[n : 2 * n]):
                raise KvOffloadError(f"round trip through chunk {chunk} changed the bytes of tensor {i}")
        return 2 * n * int(worker.bytes_per_block)

    # ----------------------------------------------------------------- release

    def _release(self) -> None:
        """Shut down what this participant holds, in the spec's own order; report every step."""
        held = self.worker if self.args.role == WORKER else self.manager
        if held is not None:
            what = "worker.shutdown()" if self.args.role == WORKER else "manager.shutdown()"
            if self.args.skip_release:
                self.journal.record(f"{what} skipped (test switch: the release is missing)", _Skipped())
            else:
                # Recorded ahead of the steps it runs (region cleanup journals into the same list).
                at = len(self.journal.steps)
                start = time.time()
                try:
                    self._stage("shutdown", held.shutdown)
                except _StageFailed as e:
                    cause = e.__cause__
                    self.journal.steps.insert(
                        at, ReleaseStep(what, False, f"{type(cause).__name__}: {cause}", start)
                    )
                else:
                    self.journal.steps.insert(at, ReleaseStep(what, True, None, start))
        self.kv_caches.clear()
        left = left_running(self.footprint)
        if left:
            what, error = "stop every thread and socket started since init", "still open: " + ", ".join(left)
            self.journal.steps.append(ReleaseStep(what, False, error, time.time()))
        steps = tuple(CleanupStep(self.args.name, s.what, s.ok, s.error, s.at) for s in self.journal.steps)
        held = tuple(held_handles(self.args.name, self.args.config.engine_id))
        self.send("released", steps, faults.hits(), held, left)


class _Skipped(Exception):
    def __str__(self) -> str:
        return "not released on purpose (KVOFFLOAD_INIT_SKIP_RELEASE)"


def _run_job(worker: Any, submit: Callable[[int, Any, Any], bool], job_id: int, src: Any, dst: Any) -> None:
    if not submit(job_id, src, dst):
        raise KvOffloadError(f"the worker refused job {job_id}")
    worker.wait({job_id})
    results = {r.job_id: r for r in worker.get_finished()}
    if job_id not in results or not results[job_id].success:
        raise KvOffloadError(f"round-trip job {job_id} failed")


def _tensor_bytes(tensors: list[Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


def _device_of(tensors: list[Any]) -> str | None:
    return str(tensors[0].device) if tensors else None


__all__ = ["SCHEDULER", "WORKER", "ParticipantArgs", "main"]
