"""The ``shmctl_reap`` vLLM plugin: a restarting engine removes its dead predecessors' regions.

For engines started without shmctl's wrapper (Ray, KServe, a bare ``vllm serve``): installed
with shmctl, it is a ``vllm.general_plugins`` entry point, and vLLM calls ``register`` in every
process it starts (the client or API server first, from ``EngineArgs`` or its argument parser,
then each EngineCore and Worker), before any region exists. docs/vllm-engine.md, "The plugin".

Invariants:

* Off unless ``SHMCTL_VLLM_REAP=1`` exactly: installing a package never starts removing files.
  ``0``, unset or empty is off and silent; any other value is off with one warning naming the
  variable. Nothing but this module is imported while off.
* Once per engine start, not once per process: the first process marks the start in its
  environment (``SHMCTL_VLLM_REAP_DONE``: its pid and start time), and a process whose
  ancestor (or itself) made that mark does nothing. vLLM spawns the EngineCore and the
  Workers after the client called us, so they inherit the mark; a process that does not
  inherit it (a Ray worker) reaps again, which is safe: only a region the write lease proves
  nobody holds is removed.
* Removal is ``reap``'s, and only ``reap``'s: the same scan, the same proofs, the same grace.
* It never raises: a plugin that raises stops the engine, and a failure to reap must never
  do that. Every failure is one warning on vLLM's logger and the engine starts anyway (if its
  root is full, the engine's own error says so).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.liveness.reap import ReapReport
    from kvoffload.liveness.scan import ScanOptions

__all__ = [
    "DEFAULT_GRACE",
    "DONE_ENV",
    "ENABLE_ENV",
    "FAMILIES_ENV",
    "GRACE_ENV",
    "LOGGER_NAME",
    "ROOT_ENV",
    "families_from_env",
    "register",
    "scan_options",
    "summary_line",
]

ENABLE_ENV = "SHMCTL_VLLM_REAP"
ROOT_ENV = "SHMCTL_ROOT"
GRACE_ENV = "SHMCTL_GRACE"
FAMILIES_ENV = "SHMCTL_FAMILIES"
#: The mark of an engine start already handled: ``PID:START_TICKS`` of the process that did.
DONE_ENV = "SHMCTL_VLLM_REAP_DONE"
#: Under ``vllm``, so that vLLM's own handler (logger ``vllm``, which does not propagate)
#: prints it with the engine's other lines; a logger named after this module would not be.
LOGGER_NAME = "vllm.shmctl_reap"
#: ``shmctl reap``'s own default (``scan.DEFAULT_GRACE_S``), not the wrapper's ``0s``: the
#: wrapper runs in the engine's container before its engine, where nothing else can be
#: starting; a plugin runs wherever vLLM does, the host's /dev/shm of a Ray node or a bare
#: ``vllm serve`` included, beside engines that may be starting right now.
DEFAULT_GRACE = "30s"
#: The families of files ``reap`` knows (issue #30's contract); ``all`` is every one.
#: An ancestor chain longer than this is not walked further (a loop in a fake /proc).
_MAX_ANCESTORS = 64
_NAMES_SHOWN = 3


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``, name ``shmctl_reap``). Never raises."""
    log = _logger()
    try:
        reap_once(os.environ, log)
    except Exception as e:  # a plugin that raises would stop the engine
        log.warning("shmctl_reap: %s: %s; nothing more done, the engine starts anyway", type(e).__name__, e)


def reap_once(
    env: MutableMapping[str, str],
    log: logging.Logger,
    *,
    proc_root: Path = Path("/proc"),
) -> ReapReport | None:
    """What ``register`` does with ``env`` (``os.environ``, where the mark is set for the
    processes started after); the report, or None where nothing was reaped (off, already
    done, or a failure, logged)."""
    value = env.get(ENABLE_ENV, "")
    if value in ("", "0") or _handled(env.get(DONE_ENV), proc_root):
        return None
    _mark(env, proc_root)
    if value != "1":
        log.warning(
            "shmctl_reap: %s=%r is not 0 or 1: the plugin is off (fix: %s=1 to remove dead "
            "engines' regions at start, or unset it)",
            ENABLE_ENV,
            value,
            ENABLE_ENV,
        )
        return None
    from kvoffload.errors import KvOffloadError
    from kvoffload.liveness import watchdog
    from kvoffload.liveness.reap import reap

    root = env.get(ROOT_ENV) or "/dev/shm"
    try:
        options = scan_options(
            env.get(GRACE_ENV) or DEFAULT_GRACE, families_from_env(env.get(FAMILIES_ENV), log)
        )
        started = time.monotonic()
        try:
            report = reap(root, options)
        finally:
            # The client lives as long as the engine: its lease watchdog must not.
            watchdog.stop()
    except KvOffloadError as e:
        log.warning("shmctl_reap: %s; nothing removed, the engine starts anyway", e)
        return None
    log.info("%s", summary_line(report, options.grace_s, time.monotonic() - started))
    if report.failed:
        reasons = Counter(e.reason for e in report.failed)
        log.warning(
            "shmctl_reap: %d dead file(s) in %s could not be removed: %s; the engine starts anyway",
            len(report.failed),
            root,
            "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common()),
        )
    return report


def families_from_env(text: str | None, log: logging.Logger) -> frozenset[str]:
    """``SHMCTL_FAMILIES`` (names separated by spaces, ``all`` for every one) as a set of
    families, always with ``offload``: the plugin exists to free the dead engine's region, as
    the wrapper does with the same variable. An unknown name is left out, with a warning: a
    typo must make the plugin remove less, never more."""
    from kvoffload.shm.families import ALL, ALL_WORD, DEFAULT, FAMILY_NAMES

    names = (text or "").split()
    unknown = sorted({n for n in names if n not in FAMILY_NAMES and n != ALL_WORD})
    if unknown:
        log.warning(
            "shmctl_reap: %s: unknown famil%s %s left out (fix: use %s or %s)",
            FAMILIES_ENV,
            "y" if len(unknown) == 1 else "ies",
            " ".join(unknown),
            ", ".join(FAMILY_NAMES),
            ALL_WORD,
        )
    if ALL_WORD in names:
        return ALL
    return DEFAULT | frozenset(n for n in names if n in FAMILY_NAMES)


def scan_options(grace: str, families: frozenset[str]) -> ScanOptions:
    """The ``ScanOptions`` the plugin reaps by: ``grace`` (a duration, ``SHMCTL_GRACE``) and
    ``families`` (``SHMCTL_FAMILIES``)."""
    from kvoffload.durations import parse_duration
    from kvoffload.liveness.scan import ScanOptions

    return ScanOptions(grace_s=parse_duration(grace, option=GRACE_ENV), families=families)


def summary_line(report: ReapReport, grace_s: float, seconds: float) -> str:
    """One line: what was removed and freed, what was kept and why, how long it took."""
    removed = len(report.removed)
    engines = sorted({e.engine_id for e in report.removed})
    shown = ", ".join(engines[:_NAMES_SHOWN]) + (
        f" and {len(engines) - _NAMES_SHOWN} more" if len(engines) > _NAMES_SHOWN else ""
    )
    head = (
        f"shmctl_reap: {report.root}: removed {removed} file(s) of {len(engines)} dead engine(s) "
        f"({shown}), freed {_amount(report.freed_bytes)}"
        if removed
        else f"shmctl_reap: {report.root}: nothing to remove"
    )
    summary = report.summary
    kept: list[str] = []
    if summary.live:
        kept.append(f"{summary.live} live")
    if summary.starting:
        wait = summary.starting_last_removable_in_s
        kept.append(
            f"{summary.starting} starting (changed within the {grace_s:g}s grace period"
            + (f", removable in {wait:.0f}s)" if wait is not None else ")")
        )
    if report.unknown:
        first = report.unknown[0].reason
        kept.append(f"{len(report.unknown)} unknown ({first})")
    left = len(report.other_users_left)
    if left:
        kept.append(f"{left} of other users (shmctl reap --all-users removes them)")
    failed = {id(e) for e in report.failed}
    if failed:
        kept.append(f"{len(failed)} failed ({report.failed[0].reason})")
    rechecked = [e for e in report.kept if id(e) not in failed]
    if rechecked:
        kept.append(f"{len(rechecked)} by reap's checks before removal ({rechecked[0].reason})")
    tail = f"; kept {', '.join(kept)}" if kept else ""
    return f"{head}{tail} ({seconds:.3f}s)"


def _amount(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _logger() -> logging.Logger:
    """vLLM's logger where vLLM runs (it is already imported: it called us); else stdlib's."""
    if "vllm" in sys.modules:
        try:
            vllm_logger = importlib.import_module("vllm.logger")
            found = vllm_logger.init_logger(LOGGER_NAME)
            if not logging.getLogger("vllm").handlers:
                _configure_vllm_logging(vllm_logger)
            if isinstance(found, logging.Logger):
                return found
        except Exception:  # an older or newer vLLM without them: the plain logger of that name
            pass
    return logging.getLogger(LOGGER_NAME)


def _configure_vllm_logging(vllm_logger: Any) -> None:
    """Set vLLM's logging up as vLLM is about to, from the same environment.

    vLLM 0.32 configures its logging after the client loads the plugins (``LLM()`` and
    ``vllm serve`` both do it once their arguments are parsed): until then the ``vllm`` logger
    has no handler and an info line would be lost. vLLM's own default (``LoggingConfig()``:
    ``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``, ``VLLM_LOGGING_CONFIG_PATH``) is what it
    applies then; a different one given on its command line replaces it, as it would anyway.
    With ``VLLM_CONFIGURE_LOGGING=0`` nothing is configured: the application's logging has it.
    """
    configure = getattr(vllm_logger, "configure_logging_if_needed", None)
    if configure is None:
        return
    configure(importlib.import_module("vllm.config.logging").LoggingConfig())


def _handled(mark: str | None, proc_root: Path) -> bool:
    """Whether ``mark`` names this process or one of its ancestors (same pid, same start)."""
    if not mark:
        return False
    from kvoffload import procfs

    pid_text, _, ticks_text = mark.partition(":")
    try:
        marked = (int(pid_text), int(ticks_text))
    except ValueError:
        return False
    pid = os.getpid()
    for _ in range(_MAX_ANCESTORS):
        try:
            stat = procfs.read_stat(pid, proc_root)
        except (OSError, ValueError, IndexError):
            return False
        if (stat.pid, stat.start_ticks) == marked:
            return True
        if stat.ppid <= 0:
            return False
        pid = stat.ppid
    return False


def _mark(env: MutableMapping[str, str], proc_root: Path) -> None:
    from kvoffload import procfs

    try:
        stat = procfs.read_stat(os.getpid(), proc_root)
    except (OSError, ValueError, IndexError):
        return
    env[DONE_ENV] = f"{stat.pid}:{stat.start_ticks}"
