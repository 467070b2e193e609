"""``shmctl init`` as a library: plan a bring-up, run it in real processes, run a fault matrix.

* ``plan(config) -> InitPlan``: files, slot layout, tiers, stages and a capacity
  pre-flight of the root; allocates nothing.
* ``bring_up(config, ...) -> InitReport``: world_size worker processes and a scheduler
  process in vLLM's order, an optional store/load round trip, a fault at a chosen stage,
  a graceful teardown and a residue check.
* ``run_matrix(config, ...) -> MatrixReport``: every stage x every mode, one bring-up per
  cell with fresh participant processes, crash cells followed by a scan and a reap.

Submodules import lazily what they need (multiprocessing, torch), so importing this
package stays cheap.
"""

from kvoffload.bringup.faultplan import FailMode, Target, build_fault_plan, parse_target
from kvoffload.bringup.kvoffload_engine import SKIP_RELEASE_ENV, ProgressEvent, bring_up
from kvoffload.bringup.matrix import DEFAULT_MODES, run_matrix
from kvoffload.bringup.plan import InitPlan, plan
from kvoffload.bringup.report import BringUpOutcome, InitReport, MatrixCell, MatrixReport
from kvoffload.bringup.request import BringUpRequest, LiveEngine
from kvoffload.bringup.vllm_engine import bring_up_vllm

__all__ = [
    "DEFAULT_MODES",
    "SKIP_RELEASE_ENV",
    "BringUpOutcome",
    "BringUpRequest",
    "FailMode",
    "InitPlan",
    "InitReport",
    "LiveEngine",
    "MatrixCell",
    "MatrixReport",
    "ProgressEvent",
    "Target",
    "bring_up",
    "bring_up_vllm",
    "build_fault_plan",
    "parse_target",
    "plan",
    "run_matrix",
]
