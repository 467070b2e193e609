"""Which of vLLM's tests ran kvoffload code: a probe for `make vllm-compat`'s kvoffload run.

Some of vLLM's tests check only vLLM's own connector code (a parser of its extra config, say):
they pass on kvoffload whatever kvoffload does, and must not count as kvoffload's passes. The
harness counts a test as kvoffload's only if a kvoffload function ran while it ran.

How: a global trace function that sees only function calls (``call`` events; it asks for no line
events) and, in each thread, removes itself at the first frame whose code lives under
``$KVOFFLOAD_PROBE_ROOT``, so a test pays for it only until kvoffload code first runs. Module
bodies do not count: importing a module is not running it. A hit is one line, the test's pytest
node id, appended to ``$KVOFFLOAD_PROBE_OUT``:

* in the test process, where pytest loads this module as a plugin (``-p kvoffload_probe``) and
  it follows each test from ``pytest_runtest_logstart`` to ``pytest_runtest_logfinish``
  (setup, call and teardown), in every thread started meanwhile;
* in the processes a test starts: the test's id is in ``$KVOFFLOAD_PROBE_TEST`` while it runs,
  so a spawned or forkserver child (whose ``sitecustomize`` calls ``install_from_env``) records
  its hits under it, and a forked child inherits the probe itself.

Threads that were already running when a test started and had stopped tracing are not followed
again: a hit there is missed, which can only move a pass to "vLLM-only", never the reverse.
Nothing here imports pytest or kvoffload: ``sitecustomize`` loads it in every interpreter.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType

OUT_ENV = "KVOFFLOAD_PROBE_OUT"
ROOT_ENV = "KVOFFLOAD_PROBE_ROOT"
TEST_ENV = "KVOFFLOAD_PROBE_TEST"


class Probe:
    """Records, once per test and process, that code under ``root`` ran during test ``test``."""

    def __init__(self, out: str, root: str) -> None:
        self.out = out
        self.root = root
        self.test: str | None = None
        self.hit = True  # nothing to look for until a test starts

    def trace(self, frame: FrameType, event: str, arg: object) -> None:
        if self.hit:  # this test is recorded (or none runs): stop paying in this thread
            sys.settrace(None)
            return
        code = frame.f_code
        if code.co_filename.startswith(self.root) and code.co_name != "<module>":
            self.record()
            sys.settrace(None)

    def record(self) -> None:
        self.hit = True
        if self.test is None:
            return
        # One write to an O_APPEND file: lines from several processes never interleave.
        fd = os.open(self.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (self.test + "\n").encode())
        finally:
            os.close(fd)

    def start(self, test: str) -> None:
        self.test = test
        self.hit = False
        threading.settrace(self.trace)
        sys.settrace(self.trace)

    def stop(self) -> None:
        self.test = None
        self.hit = True
        sys.settrace(None)


_probe: Probe | None = None


def _from_env() -> Probe | None:
    global _probe
    out, root = os.environ.get(OUT_ENV), os.environ.get(ROOT_ENV)
    if _probe is None and out and root:
        _probe = Probe(out, root)
    return _probe


def install_from_env() -> None:
    """In a process a test started: record hits under the test id it inherited."""
    test = os.environ.get(TEST_ENV)
    probe = _from_env()
    if probe is not None and test:
        probe.start(test)


# ----------------------------------------------------------------- the pytest plugin


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    probe = _from_env()
    if probe is not None:
        os.environ[TEST_ENV] = nodeid
        probe.start(nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    probe = _from_env()
    if probe is not None:
        probe.stop()
        os.environ.pop(TEST_ENV, None)
