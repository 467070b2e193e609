"""The bring-up's old module paths keep importing every public name for one release (issue #29).

``kvoffload.engine.*`` and ``kvoffload.vllm_engine.bringup`` moved into ``kvoffload.bringup``,
``kvoffload.tiering.guards`` became ``kvoffload.tiering.hosted_wrappers``, and the bring-up's
``Verdict`` became ``BringUpOutcome``. Users' imports of the old paths must keep working, quietly
(the suite turns warnings into errors), and give the very objects of the new home; the two
bring-ups' old signatures (the request's fields as keywords) still run a bring-up.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from kvoffload.bringup import BringUpOutcome
from kvoffload.config import PAGESIZE, OffloadingSettings
from kvoffload.errors import ConfigError

#: old module -> the modules its public names now live in.
MOVED = {
    "kvoffload.engine": ("kvoffload.bringup",),
    "kvoffload.engine.plan": ("kvoffload.bringup.plan",),
    "kvoffload.engine.faultplan": ("kvoffload.bringup.faultplan",),
    "kvoffload.engine.inputs": ("kvoffload.bringup.inputs", "kvoffload.config"),
    "kvoffload.engine.participant": ("kvoffload.bringup.participant",),
    "kvoffload.engine.matrix": ("kvoffload.bringup.matrix",),
    "kvoffload.engine.report": ("kvoffload.bringup.report", "kvoffload.bringup.residue"),
    "kvoffload.engine.bringup": ("kvoffload.bringup.kvoffload_engine", "kvoffload.bringup.request"),
    "kvoffload.vllm_engine.bringup": (
        "kvoffload.bringup.vllm_engine",
        "kvoffload.bringup.vllm_inputs",
        "kvoffload.bringup.vllm_evidence",
        "kvoffload.bringup.request",
    ),
    "kvoffload.tiering.guards": ("kvoffload.tiering.hosted_wrappers",),
}
#: Names whose old form differs from the new one on purpose: the old signatures and the old name.
KEPT_OLD = {"bring_up", "bring_up_vllm", "Verdict"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_gives_every_public_name_from_its_new_home(old: str) -> None:
    module = importlib.import_module(old)
    homes = [importlib.import_module(name) for name in MOVED[old]]
    assert module.__all__
    for name in module.__all__:
        value = getattr(module, name)
        if name in KEPT_OLD:
            continue
        assert any(getattr(home, name, None) is value for home in homes), f"{old}.{name}"


def test_the_bring_ups_verdict_is_now_bring_up_outcome() -> None:
    from kvoffload.engine import Verdict
    from kvoffload.engine.report import Verdict as ReportVerdict

    assert Verdict is ReportVerdict is BringUpOutcome


def config(tmp_path: Path) -> OffloadingSettings:
    return OffloadingSettings.from_kv_transfer_config(
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}},
        worker_kv_bytes_per_block=4 * PAGESIZE,
        root=tmp_path,
    )


def test_the_old_bring_up_signature_hands_its_keywords_to_the_request(tmp_path: Path) -> None:
    """A target without a fault is refused by the request's own check, before anything starts."""
    from kvoffload.engine import bring_up

    with pytest.raises(ConfigError, match="--rank: aims a fault, so it needs --fail-at"):
        bring_up(config(tmp_path), target_rank=0, progress=None, start_method="spawn")
    assert list(tmp_path.iterdir()) == []


def test_the_old_vllm_bring_up_signature_hands_its_keywords_to_the_request(tmp_path: Path) -> None:
    from kvoffload.vllm_engine.bringup import bring_up_vllm

    with pytest.raises(ConfigError, match="--timeout: must be positive, got -1"):
        bring_up_vllm(config(tmp_path), model=tmp_path, idle_timeout_s=-1, command=["false"])
    assert list(tmp_path.iterdir()) == []
