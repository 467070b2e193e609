"""``shmctl init`` as a library: init's rehearsal of an engine's offload bring-up.

* ``plan(config) -> InitPlan``: files, slot layout, tiers, stages and a capacity
  pre-flight of the root; allocates nothing.
* ``bring_up(BringUpRequest(config, ...)) -> InitReport``: world_size worker processes and
  a scheduler process in vLLM's order, an optional store/load round trip, a fault at a
  chosen stage, a graceful teardown and a residue check.
* ``bring_up_vllm(BringUpRequest(config, ...), model=...) -> InitReport``: the same
  rehearsal with a real vLLM engine (``vllm.LLM`` with kvoffload's spec) as participants.
* ``run_matrix(config, ...) -> MatrixReport``: every stage x every mode, one bring-up per
  cell with fresh participant processes, crash cells followed by a scan and a reap.

The rooms, what both bring-ups share first:

* ``plan``: what a bring-up would allocate and run, and whether the root has room;
* ``faultplan``: which fault runs in which participant (``--fail-at``, ``--fail-mode``,
  ``--rank``, ``--seed``), and the no-op markers that tell which stages each one passed;
* ``inputs``: vLLM's ``--kv-transfer-config`` (inline or from a file) and the geometry;
* ``request``: ``BringUpRequest``, what a caller asks of either bring-up, checked against
  the plan before anything starts; ``LiveEngine``, what ``--hold`` hands out;
* ``report``: the reports' frozen dataclasses (serialised as the JSON) and ``judge``, the
  ``BringUpOutcome`` of a run; ``residue``: what a run left behind (files in the root,
  region handles, threads and sockets);
* ``rehearsal``: ``Rehearsal``, the state, the hold and the report assembly of one run;
* ``kvoffload_engine``: the rehearsal in kvoffload's own processes (``--engine kvoffload``),
  each running ``participant``'s body; ``matrix``: the fault matrix over it;
* ``vllm_engine``: the rehearsal with a real vLLM engine (``--engine vllm``);
  ``vllm_inputs``: what that refuses and what the engine is given; ``vllm_evidence``: what
  the parent learns from the engine's processes (the fault journal, ``/proc``).

What a vLLM engine itself loads (its specs, their translation, the child that runs
``vllm.LLM``) stays in ``kvoffload.vllm_engine``: users' configs name that path.
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
