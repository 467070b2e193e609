"""Which fault runs in which participant of a bring-up, in the fault grammar of ``faults``.

``--fail-mode`` values and what they become at the chosen stage:

    raise           raise                an InjectedFault
    oserror:ERRNO   oserror(ERRNO)       OSError(ERRNO), by number or name (oserror:EFAULT)
    crash           crash                SIGKILL; the parent then SIGKILLs every other
                                         participant, as an OOM kill of the container does
    cleanup-raise   raise, and raise at every cleanup.* point, so release steps fail too
                    while the contract (nothing left behind) must still hold

Any mode may carry a ``P%`` prefix (``50%raise``): it fires with probability P, drawn
from a generator seeded with ``--seed`` (one is chosen and reported when none is given,
so every run can be replayed).

The fault goes to every participant that reaches the stage, or only to worker ``R``
(``--rank R``) or the scheduler (``--rank scheduler``). Each participant also gets a
no-op marker (``sleep(0)``) at every other stage of the plan; the hit counts of those
markers tell the parent which stages each participant passed, which the report lists.
"""

from __future__ import annotations

import errno as errno_mod
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvoffload import faults
from kvoffload.bringup.plan import SCHEDULER, TIER_POINTS, TIERING_ONLY, WORKER, InitPlan, PlanStage
from kvoffload.errors import ConfigError

MODE_KINDS = ("raise", "oserror", "crash", "cleanup-raise")
#: The modes whose failure runs the library's own unwind (everything but crash).
RAISE_KINDS = ("raise", "oserror", "cleanup-raise")
MARKER = "sleep(0)"
#: Every bring-up's cleanup points; a hosted tier's own are armed where the plan reaches them.
CLEANUP_POINTS = tuple(p.name for p in faults.REGISTRY if p.phase == "cleanup" and p.tier is None)
MODE_HELP = "raise, oserror:ERRNO (oserror:EFAULT, oserror:28), crash or cleanup-raise, optionally P% first"

#: ``None``: every participant; an int: that worker; ``"scheduler"``: the scheduler.
Target = int | Literal["scheduler"] | None

_MODE = re.compile(r"(?:(?P<pct>[0-9]+(?:\.[0-9]+)?)%)?(?P<kind>[a-z-]+)(?::(?P<arg>[A-Za-z0-9]+))?")


@dataclass(frozen=True, slots=True)
class FailMode:
    kind: str
    errno: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> FailMode:
        m = _MODE.fullmatch(text.strip())
        if m is None or m.group("kind") not in MODE_KINDS:
            raise ConfigError("--fail-mode", f"unknown mode {text!r}", fix=f"use {MODE_HELP}")
        kind, arg = m.group("kind"), m.group("arg")
        number: int | None = None
        if kind == "oserror":
            if arg is None:
                raise ConfigError(
                    "--fail-mode", "oserror needs an errno", fix="write oserror:EFAULT or oserror:14"
                )
            number = int(arg) if re.fullmatch(r"[0-9]+", arg) else getattr(errno_mod, arg.upper(), None)
            if not isinstance(number, int):
                raise ConfigError(
                    "--fail-mode", f"unknown errno {arg!r}", fix="use a number or a name like ENOSPC"
                )
        elif arg is not None:
            raise ConfigError("--fail-mode", f"{kind} takes no argument, got {arg!r}", fix=f"use {MODE_HELP}")
        percent = None
        if m.group("pct") is not None:
            percent = float(m.group("pct"))
            if percent > 100:
                raise ConfigError("--fail-mode", f"probability {percent:g}% is over 100%")
        mode = cls(kind, number, percent)
        faults.parse_actions(mode.action)  # the grammar's own checks (errno range, ...) apply too
        return mode

    @property
    def raises(self) -> bool:
        return self.kind in RAISE_KINDS

    @property
    def action(self) -> str:
        """The stage's action in the fault grammar."""
        prefix = "" if self.percent is None else f"{self.percent:g}%"
        if self.kind == "oserror":
            return f"{prefix}oserror({self.errno})"
        return prefix + ("crash" if self.kind == "crash" else "raise")

    def __str__(self) -> str:
        prefix = "" if self.percent is None else f"{self.percent:g}%"
        if self.kind == "oserror" and self.errno is not None:
            return f"{prefix}oserror:{errno_mod.errorcode.get(self.errno, str(self.errno))}"
        return prefix + self.kind


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The fault of one bring-up: what is injected, where, and each participant's configuration."""

    stages: tuple[str, ...]
    mode: FailMode
    target: Target
    seed: int | None
    #: The injected configuration (no markers), as ``KVOFFLOAD_FAILPOINTS`` would spell it.
    failpoints: str
    #: Participants that carry it.
    targeted: tuple[str, ...]
    #: Full configuration per participant, markers included.
    per_participant: dict[str, str]

    @property
    def target_name(self) -> str:
        if self.target is None:
            return "every participant"
        return SCHEDULER if self.target == SCHEDULER else f"{WORKER} {self.target}"


def parse_target(text: str | None) -> Target:
    """``--rank``: a worker rank or ``scheduler``."""
    if text is None:
        return None
    text = text.strip()
    if text == "scheduler":
        return "scheduler"
    if re.fullmatch(r"[0-9]+", text):  # ASCII only: '²'.isdigit() is true, int('²') is not
        return int(text)
    raise ConfigError("--rank", f"{text!r} is neither a worker rank nor 'scheduler'")


def markers_only(plan: InitPlan) -> dict[str, str]:
    """The configuration of a bring-up without a fault: markers in every participant."""
    text = ";".join(f"{s.name}={MARKER}" for s in plan.stages)
    return {name: text for name in plan.participants}


def build_fault_plan(
    plan: InitPlan,
    fail_at: Sequence[str],
    mode: FailMode | str = "raise",
    target: Target = None,
    seed: int | None = None,
) -> FaultPlan | None:
    """Check ``fail_at`` against the plan and the target; ``None`` when nothing is injected.

    Raises ``ConfigError`` (exit 2) for an unknown point, a point this spec does not
    reach, or a target that never runs it: a typo must not silently test nothing.
    """
    if isinstance(mode, str):
        mode = FailMode.parse(mode)
    if isinstance(target, int) and not 0 <= target < plan.world_size:
        raise ConfigError("--rank", f"{target} is outside 0..{plan.world_size - 1}")
    if not fail_at:
        return None
    stages = tuple(dict.fromkeys(s.strip() for s in fail_at))
    for name in stages:
        _check_stage(plan, name, target)
    if mode.percent is not None and seed is None:
        seed = random.SystemRandom().randrange(1 << 31)  # chosen here so the report can replay it
    injected: dict[str, str] = dict.fromkeys(stages, mode.action)
    if mode.kind == "cleanup-raise":
        tiers_own = [s.name for s in plan.stages if s.phase == "cleanup" and s.name in TIER_POINTS]
        for point in (*CLEANUP_POINTS, *tiers_own):
            injected.setdefault(point, "raise")
    failpoints = ";".join(f"{k}={v}" for k, v in injected.items())
    faults.parse_config(failpoints)  # the grammar and the registry agree, or fail here
    markers = [f"{s.name}={MARKER}" for s in plan.stages if s.name not in injected]
    targeted = _targeted(plan, target)
    per_participant = {
        name: ";".join(
            [*markers, failpoints] if name in targeted else [f"{s.name}={MARKER}" for s in plan.stages]
        )
        for name in plan.participants
    }
    return FaultPlan(stages, mode, target, seed, failpoints, targeted, per_participant)


def _targeted(plan: InitPlan, target: Target) -> tuple[str, ...]:
    if target is None:
        return plan.participants
    return (SCHEDULER,) if target == SCHEDULER else (f"{WORKER} {target}",)


def _check_stage(plan: InitPlan, name: str, target: Target) -> PlanStage:
    faults.validate_name(name)
    stage = plan.stage(name)
    if stage is None and name in faults.INDEXED:
        stage = plan.stage(f"{name}.0")
    if stage is None:
        base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
        tier = next((p.tier for p in faults.REGISTRY if p.name == base), None)
        if base in TIERING_ONLY and plan.spec != "TieringOffloadingSpec":
            why = "it runs only with TieringOffloadingSpec"
        elif tier is not None:
            why = f"it runs only in a {tier} secondary tier, and none is configured"
        elif base in faults.INDEXED:
            why = f"{len(plan.tiers) - 1 if plan.tiers else 0} secondary tier(s) are configured"
        else:
            why = "it never runs here"
        raise ConfigError(
            "--fail-at",
            f"{name} is not a stage of this bring-up ({plan.spec}: {why})",
            fix="stages here: " + ", ".join(s.name for s in plan.stages),
        )
    side = None if target is None else (SCHEDULER if target == SCHEDULER else WORKER)
    if side is not None and side not in stage.sides:
        raise ConfigError(
            "--rank",
            f"{name} runs only in the {' and '.join(stage.sides)}, never in {_side_name(target)}",
            fix="drop --rank, or aim at " + (" or ".join(_aim(s) for s in stage.sides)),
        )
    return stage


def _side_name(target: Target) -> str:
    return SCHEDULER if target == SCHEDULER else f"{WORKER} {target}"


def _aim(side: str) -> str:
    return "--rank scheduler" if side == SCHEDULER else "--rank R (a worker)"
