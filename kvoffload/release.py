"""Release steps that never hide the error in flight, and a journal of what they did.

Cleanup after a failed init must run every step even when one fails, log the failure,
and let the original exception reach the caller. ``Journal.quietly`` is that step; the
journal keeps the order and outcome, which ``shmctl init`` reports to the operator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReleaseStep:
    what: str
    ok: bool
    error: str | None = None
    at: float = 0.0


@dataclass(slots=True)
class Journal:
    steps: list[ReleaseStep] = field(default_factory=list)

    def quietly(self, what: str, fn: Callable[[], object]) -> bool:
        """Run one release step; log and record a failure instead of raising it.

        The step is recorded before it runs, so steps it performs inside (a region's own
        cleanup) follow it in the journal, in the order they happened.
        """
        index = len(self.steps)
        self.steps.append(ReleaseStep(what, True, None, time.time()))
        try:
            fn()
        except Exception as e:
            log.exception("release step failed: %s", what)
            self.steps[index] = ReleaseStep(what, False, f"{type(e).__name__}: {e}", self.steps[index].at)
            return False
        return True

    def record(self, what: str, error: BaseException | None = None) -> None:
        text = None if error is None else f"{type(error).__name__}: {error}"
        self.steps.append(ReleaseStep(what, error is None, text, time.time()))


def release_all(steps: Iterable[tuple[str, Callable[[], object]]], *, journal: Journal | None = None) -> None:
    """Run every release step even when one fails; raise the first failure at the end.

    Each failure is logged as it happens (and journaled, with a journal); the later ones are
    attached to the first as notes, so the caller sees one exception that lists everything
    that went wrong. ``BaseException`` is caught too: a Ctrl-C in the middle of a shutdown
    still releases the rest before it propagates.
    """
    errors: list[BaseException] = []
    for what, step in steps:
        try:
            step()
        except BaseException as e:
            log.exception("release step failed: %s", what)
            if journal is not None:
                journal.record(what, e)
            errors.append(e)
        else:
            if journal is not None:
                journal.record(what)
    if errors:
        for extra in errors[1:]:
            errors[0].add_note(f"also failed while releasing: {extra!r}")
        raise errors[0]
