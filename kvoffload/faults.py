"""Named fault points and the fault grammar.

Every step of init and cleanup calls ``point(name)``. With nothing configured that is
one dict truthiness test (zero cost when unset). Configured, a point runs an action:

    [p%][cnt*]action[(arg)][->more]

``p%`` fires with probability p (seeded, so runs are reproducible), ``cnt*`` fires at
most cnt times, ``->`` chains a fallback term that is tried when the one before did
not fire (fail-rs/gofail/fail(9) share this grammar). Actions:

    off                 nothing
    raise[(message)]    raise InjectedFault
    oserror(ERRNO)      raise OSError(ERRNO), by number or name: oserror(14), oserror(ENOSPC)
    crash               SIGKILL this process: no cleanup code runs (an OOM kill)
    sleep(ms)           sleep, then go on

Configuration comes from the API (``configure``/``cfg``) or the environment variable
``KVOFFLOAD_FAILPOINTS="secondary=raise;region.populate=oserror(14)"`` (seed in
``KVOFFLOAD_FAILPOINTS_SEED``). ``KVOFFLOAD_FAILPOINTS_JOURNAL=FILE`` makes every process
that reads the variable append one JSON line to FILE the first time each point fires in it,
and every time a point raises or crashes (written before the action runs, so a crash is on
record): how ``shmctl init --engine vllm`` learns which engine process passed which stage
and where its fault fired, from processes vLLM starts. Unknown point names are rejected with the list: a
typo must not silently test nothing. The registry below is data: the CLI, docs,
completions and the matrix tests all read it, so a new point is tested the day it
is added.
"""

from __future__ import annotations

import errno as errno_mod
import math
import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvoffload.errors import FaultSpecError, InjectedFault

ENV_VAR = "KVOFFLOAD_FAILPOINTS"
SEED_ENV_VAR = "KVOFFLOAD_FAILPOINTS_SEED"
JOURNAL_ENV_VAR = "KVOFFLOAD_FAILPOINTS_JOURNAL"


@dataclass(frozen=True, slots=True)
class FaultPoint:
    name: str
    phase: str  # "init" or "cleanup"
    description: str
    #: Reached only where a secondary tier of this type is configured (a hosted tier's stage).
    tier: str | None = None


#: Every point, in the order init reaches them (cleanup points last).
REGISTRY: tuple[FaultPoint, ...] = (
    FaultPoint("validate", "init", "after the configuration is parsed, before any resource exists"),
    FaultPoint("region.open", "init", "before the region file is created (O_EXCL) or joined"),
    FaultPoint("region.space", "init", "creator: before the free-space check of the shm root"),
    FaultPoint("region.truncate", "init", "creator: before segment files and then the base file are sized"),
    FaultPoint("region.mmap", "init", "before the region is mapped MAP_SHARED"),
    FaultPoint("region.attach", "init", "before this participant joins the attach ledger / barrier"),
    FaultPoint("region.populate", "init", "before pages are pre-faulted (MADV_POPULATE_WRITE)"),
    FaultPoint("worker", "init", "worker side: before the offloading worker is constructed over its region"),
    FaultPoint("scheduler.region", "init", "tiering scheduler: before the whole-region mapping is created"),
    FaultPoint("primary", "init", "tiering scheduler: before the primary (CPU) tier is built"),
    FaultPoint(
        "secondary", "init", "tiering scheduler: before any secondary tier is built (secondary.N: the N-th)"
    ),
    FaultPoint(
        "secondary.p2p.data", "init", "p2p tier: before its data plane (NIXL transport) is created", "p2p"
    ),
    FaultPoint(
        "secondary.p2p.control",
        "init",
        "p2p tier: before its control plane binds its ZMQ socket (the data plane is up)",
        "p2p",
    ),
    FaultPoint(
        "secondary.obj.probe",
        "init",
        "object tier: before it probes the store (its NIXL agent and OBJ backend are up)",
        "obj",
    ),
    FaultPoint(
        "secondary.obj.lookup",
        "init",
        "object tier: before its lookup thread starts (its memory is registered with NIXL)",
        "obj",
    ),
    FaultPoint("manager", "init", "scheduler: before the offloading manager is built over the tiers"),
    FaultPoint(
        "cleanup.secondary",
        "cleanup",
        "a secondary tier's shutdown reports failure; the tier is still shut down (.N: the N-th)",
    ),
    FaultPoint(
        "cleanup.secondary.p2p.control",
        "cleanup",
        "p2p tier: closing its control plane reports failure; its data plane is still closed",
        "p2p",
    ),
    FaultPoint(
        "cleanup.secondary.obj.lookup",
        "cleanup",
        "object tier: stopping its lookup thread reports failure; its NIXL handles are still released",
        "obj",
    ),
    FaultPoint(
        "cleanup.primary", "cleanup", "the primary tier's shutdown reports failure; it is still released"
    ),
    FaultPoint(
        "cleanup.worker", "cleanup", "the worker fails while stopping transfers; its region is still released"
    ),
    FaultPoint(
        "cleanup.region", "cleanup", "a region's cleanup reports failure; the release still completes"
    ),
)

_BY_NAME = {p.name: p for p in REGISTRY}
#: Points that take an index suffix: ``secondary.2`` fires only at the third tier.
INDEXED = frozenset({"secondary", "cleanup.secondary"})
_INDEXED_NAME = re.compile(r"(?P<base>secondary|cleanup\.secondary)\.(?P<index>[0-9]+)")


def names() -> list[str]:
    return [p.name for p in REGISTRY]


def validate_name(name: str) -> str:
    """Return ``name`` if it is a registered point (or ``secondary.N``), else raise."""
    if name in _BY_NAME or _INDEXED_NAME.fullmatch(name):
        return name
    raise FaultSpecError(
        "fault point", f"unknown point {name!r}", fix="choose one of: " + ", ".join(names()) + ", secondary.N"
    )


_TERM = re.compile(
    r"""\s*(?:(?P<pct>[0-9]+(?:\.[0-9]+)?)%)?
        (?:(?P<cnt>[0-9]+)\*)?
        (?P<action>[a-z]+)
        (?:\((?P<arg>[^()]*)\))?\s*""",
    re.VERBOSE,
)
_ACTIONS = ("off", "raise", "oserror", "crash", "sleep")


@dataclass(slots=True)
class Term:
    action: str
    arg: str | None = None
    probability: float | None = None  # 0..1
    count: int | None = None  # remaining firings; None = unlimited
    errno: int | None = None
    sleep_ms: float | None = None


#: Linux errno values are 1..4095 (MAX_ERRNO). A bad one must fail at parse time, not when the
#: point fires (os.strerror overflows past a C int, deep inside the code under test).
_MAX_ERRNO = 4095
_ERRNO_NUMBER = re.compile(r"[0-9]+")


def _parse_errno(text: str) -> int:
    text = text.strip()
    if _ERRNO_NUMBER.fullmatch(text):  # ASCII only: str.isdigit() also takes '²'
        value: object = int(text)
    else:
        value = getattr(errno_mod, text.upper(), None)
    if not isinstance(value, int):
        raise FaultSpecError(
            "fault action", f"unknown errno {text!r}", fix="use a number or a name like ENOSPC"
        )
    if not 1 <= value <= _MAX_ERRNO:
        raise FaultSpecError(
            "fault action",
            f"errno {value} is outside 1..{_MAX_ERRNO}",
            fix="use a number or a name like ENOSPC",
        )
    return value


def parse_actions(spec: str) -> list[Term]:
    """Parse ``[p%][cnt*]action[(arg)][->...]`` into terms; raise FaultSpecError if malformed."""
    terms: list[Term] = []
    for raw in spec.split("->"):
        m = _TERM.fullmatch(raw)
        if m is None:
            raise FaultSpecError(
                "fault action",
                f"cannot parse {raw!r}",
                fix="write [p%][cnt*]action[(arg)], e.g. 50%1*oserror(EFAULT)",
            )
        action, arg = m.group("action"), m.group("arg")
        if action not in _ACTIONS:
            raise FaultSpecError(
                "fault action", f"unknown action {action!r}", fix="use one of: " + ", ".join(_ACTIONS)
            )
        term = Term(action=action, arg=arg)
        if m.group("pct") is not None:
            pct = float(m.group("pct"))
            if pct > 100:
                raise FaultSpecError("fault action", f"probability {pct}% is over 100%")
            term.probability = pct / 100
        if m.group("cnt") is not None:
            term.count = int(m.group("cnt"))
        if action == "oserror":
            if not arg:
                raise FaultSpecError(
                    "fault action", "oserror needs an errno", fix="write oserror(14) or oserror(ENOSPC)"
                )
            term.errno = _parse_errno(arg)
        elif action == "sleep":
            try:
                term.sleep_ms = float(arg or "")
            except ValueError:
                raise FaultSpecError("fault action", f"sleep needs milliseconds, got {arg!r}") from None
            if not math.isfinite(term.sleep_ms) or term.sleep_ms < 0:
                raise FaultSpecError(
                    "fault action", f"sleep needs a finite, non-negative number of milliseconds, got {arg!r}"
                )
        elif arg is not None and action in ("off", "crash"):
            raise FaultSpecError("fault action", f"{action} takes no argument")
        terms.append(term)
    return terms


def parse_config(text: str) -> dict[str, list[Term]]:
    """Parse ``name=actions;name2=actions`` (the environment variable's format)."""
    config: dict[str, list[Term]] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, sep, actions = item.partition("=")
        if not sep:
            raise FaultSpecError(
                ENV_VAR, f"{item!r} has no '='", fix="write name=action, e.g. secondary=raise"
            )
        config[validate_name(name.strip())] = parse_actions(actions)
    return config


@dataclass(slots=True)
class _State:
    points: dict[str, list[Term]] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    hits: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()
#: ``KVOFFLOAD_FAILPOINTS_JOURNAL``: where firings are recorded, or None.
_journal: str | None = None
#: Fast path: empty means no point is configured, and ``point`` returns at once.
_active: dict[str, list[Term]] = {}


def configure(config: Mapping[str, str] | str | None, *, seed: int | None = None) -> None:
    """Replace the whole configuration; ``None`` or ``""`` turns every point off."""
    global _active
    if config is None:
        parsed: dict[str, list[Term]] = {}
    elif isinstance(config, str):
        parsed = parse_config(config)
    else:
        parsed = {validate_name(k): parse_actions(v) for k, v in config.items()}
    with _state.lock:
        _state.points = parsed
        _state.rng = random.Random(seed)
        _state.hits = {}
        _active = parsed


def cfg(name: str, actions: str) -> None:
    """Configure one point, keeping the others."""
    global _active
    terms = parse_actions(actions)
    with _state.lock:
        _state.points = {**_state.points, validate_name(name): terms}
        _active = _state.points


def remove(name: str) -> None:
    global _active
    with _state.lock:
        _state.points = {k: v for k, v in _state.points.items() if k != name}
        _active = _state.points


def configured() -> dict[str, str]:
    """The points configured now, for reports."""
    return {name: "->".join(_format_term(t) for t in terms) for name, terms in _state.points.items()}


def hits() -> dict[str, int]:
    """How many times each configured point fired (an action other than off ran)."""
    return dict(_state.hits)


def _format_term(t: Term) -> str:
    prefix = (f"{t.probability * 100:g}%" if t.probability is not None else "") + (
        f"{t.count}*" if t.count is not None else ""
    )
    return f"{prefix}{t.action}" + (f"({t.arg})" if t.arg is not None else "")


def configure_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Load ``KVOFFLOAD_FAILPOINTS`` (its seed and its journal); unset leaves every point off."""
    global _journal
    _journal = environ.get(JOURNAL_ENV_VAR) or None
    text = environ.get(ENV_VAR, "")
    seed_text = environ.get(SEED_ENV_VAR)
    try:
        seed = int(seed_text) if seed_text else None
    except ValueError:
        raise FaultSpecError(SEED_ENV_VAR, f"{seed_text!r} is not an integer") from None
    configure(text or None, seed=seed)


@contextmanager
def scenario(config: Mapping[str, str] | str | None, *, seed: int | None = None) -> Iterator[None]:
    """Configure points for the duration of a block, then turn them all off."""
    configure(config, seed=seed)
    try:
        yield
    finally:
        configure(None)


def point(name: str, index: int | None = None) -> None:
    """Evaluate fault point ``name`` (and ``name.index`` for indexed points)."""
    if not _active:
        return
    if _env_error is not None:
        raise _env_error
    if index is not None:
        _fire(f"{name}.{index}")
    _fire(name)


def _fire(name: str) -> None:
    terms = _active.get(name)
    if not terms:
        return
    with _state.lock:
        chosen: Term | None = None
        for term in terms:
            if term.count is not None and term.count <= 0:
                continue
            if term.probability is not None and _state.rng.random() >= term.probability:
                continue
            if term.count is not None:
                term.count -= 1
            chosen = term
            break
        if chosen is None or chosen.action == "off":
            return
        _state.hits[name] = _state.hits.get(name, 0) + 1
        first = _state.hits[name] == 1
    if _journal is not None and (first or chosen.action in ("raise", "oserror", "crash")):
        _record(_journal, name, chosen)
    _run(name, chosen)


def _record(path: str, name: str, term: Term) -> None:
    """One line in the journal; a journal that cannot be written never changes the outcome."""
    import json

    try:
        with open("/proc/self/cmdline", "rb") as f:
            title = f.read(200).split(b"\0")[0].decode(errors="replace")
    except OSError:
        title = ""
    line = {"point": name, "action": _format_term(term), "pid": os.getpid(), "title": title, "t": time.time()}
    data = (json.dumps(line) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, data)  # one write under PIPE_BUF with O_APPEND: lines of processes never interleave
    except OSError:
        pass
    finally:
        os.close(fd)


def _run(name: str, term: Term) -> None:
    if term.action == "raise":
        raise InjectedFault(name, term.arg or None)
    if term.action == "oserror":
        assert term.errno is not None
        raise OSError(term.errno, f"{os.strerror(term.errno)} (injected at {name})")
    if term.action == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous only in theory; never return from a crash
    if term.action == "sleep":
        assert term.sleep_ms is not None
        time.sleep(term.sleep_ms / 1000)


# A malformed environment variable must not break ``import kvoffload`` (shmctl scan has
# nothing to do with faults); it is raised by the first point that runs instead.
_env_error: FaultSpecError | None = None
try:
    configure_from_env()
except FaultSpecError as _e:
    _env_error = _e
    _active = {"<invalid KVOFFLOAD_FAILPOINTS>": []}
