"""What a caller asks of a bring-up, whoever runs its stages: one ``BringUpRequest``.

Both bring-ups, kvoffload's own participant processes (``kvoffload_engine.bring_up``) and a
real vLLM engine (``vllm_engine.bring_up_vllm``), take the same request: the engine's
settings, the fault to inject (stages, mode, target, seed), whether to store and load one
chunk, whether to hold the engine up, and how long a silent participant is waited for. What
only one of them needs stays a keyword of that bring-up (ours: a progress callback, the
test-only skip-release switch, the start method; a vLLM engine's: the model, the start and
settle timeouts, a stand-in command).

``plan_fault`` checks a request against its plan before any process starts: a stage that is
unknown or never runs here, a target that never reaches it, or a target without a fault is
a ``ConfigError`` (exit 2), never a bring-up that silently tests nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.bringup.faultplan import FailMode, FaultPlan, Target, build_fault_plan
from kvoffload.bringup.plan import InitPlan, plan
from kvoffload.errors import ConfigError
from kvoffload.settings import OffloadingSettings

#: How long a participant awaited by the parent may send nothing before it is killed.
DEFAULT_IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class LiveEngine:
    """The engine while ``--hold`` keeps it up: who runs it and which files are visible now."""

    engine_id: str
    root: Path
    pids: dict[str, int]
    files: tuple[Path, ...]
    path_lifetime: str


@dataclass(frozen=True, slots=True)
class BringUpRequest:
    """One bring-up as the caller asks for it (``shmctl init``'s options, parsed)."""

    config: OffloadingSettings
    #: The stages to inject the fault at (``--fail-at``); empty: no fault.
    fail_at: Sequence[str] = ()
    fail_mode: FailMode | str = "raise"
    #: Every participant that reaches the stage, one worker rank, or ``"scheduler"``.
    target_rank: Target = None
    #: Seeds a ``P%`` mode; one is chosen (and reported) when a ``P%`` mode has none.
    seed: int | None = None
    #: Store one chunk through the region and load it back once the engine is up.
    roundtrip: bool = True
    #: Called with the live engine once it is up (and the round trip is done); the engine then
    #: stays up for ``hold_s`` seconds, or until Ctrl-C when ``hold_s`` is None.
    hold: Callable[[LiveEngine], None] | None = None
    hold_s: float | None = None
    #: A participant the parent waits on that sends nothing for this long is SIGKILLed.
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def plan_fault(self) -> tuple[InitPlan, FaultPlan | None]:
        """The plan of this engine and the fault to inject (None: none); allocates nothing.

        Raises ``ConfigError`` for a fault the plan refuses, or a target without a fault.
        """
        the_plan = plan(self.config)
        fault = build_fault_plan(the_plan, self.fail_at, self.fail_mode, self.target_rank, self.seed)
        if fault is None and isinstance(self.target_rank, int | str):
            raise ConfigError("--rank", "aims a fault, so it needs --fail-at")
        return the_plan, fault
