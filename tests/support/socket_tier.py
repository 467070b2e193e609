"""``SocketTier``: an out-of-tree secondary tier that owns what vLLM's p2p and object tiers own.

Configured by ``module_path`` (``{"type": "SocketTier", "module_path": "tests.support.socket_tier"}``),
as a hosted tier is, it binds a listening TCP socket on the loopback (a control plane)
and runs a thread that serves it (a poll loop), so the cleanup contract for a tier with a
thread and a socket is tested without vLLM. Its jobs finish at once; it stores nothing.

``leak=True`` makes ``shutdown`` forget both, so a test can show the residue check
catches a tier that does.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

from kvoffload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob

THREAD_NAME = "socket-tier-control"
_POLL_S = 0.05


class SocketTier(SecondaryTierManager):
    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        leak: bool = False,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._leak = leak
        self._finished: list[JobResult] = []
        self._stop = threading.Event()
        with ExitStack() as undo:
            self._listener = socket.create_server(("127.0.0.1", 0))
            undo.callback(self._listener.close)
            self.port = self._listener.getsockname()[1]
            self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
            self._thread.start()
            undo.callback(self._thread.join)
            undo.callback(self._stop.set)
            undo.pop_all()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                if selector.select(_POLL_S):
                    peer, _ = self._listener.accept()
                    peer.close()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._finished.append(JobResult(job_metadata.job_id, success=True))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._finished.append(JobResult(job_metadata.job_id, success=False))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def drain_jobs(self) -> None:
        return None

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        if self._leak:
            return
        self._stop.set()
        self._thread.join()
        self._listener.close()
