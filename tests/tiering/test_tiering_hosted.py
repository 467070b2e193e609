"""Hosted tiers (vLLM's p2p and object tiers) and the cleanup contract for tiers that own
threads and sockets.

vLLM's p2p and object tiers run on kvoffload's tiering base as vLLM's own code, hosted
(``kvoffload.tiering.hosted``). This file specifies:

* the hosting itself, on a small stand-in vLLM tree each test writes: a hosted module is
  vLLM's file under kvoffload's name, its kv_offload imports are kvoffload's, the factory
  builds it by its registered type, and vLLM's tree is only read; without vLLM the
  packages and the factory say what is missing;
* PR #51227's cleanup contract for a ``module_path`` tier that binds a socket and runs a
  thread (``tests/support/socket_tier.py``): at every init and cleanup point of the plan, in this
  process and in real bring-ups and a fault matrix, nothing is left: no file, no thread,
  no socket;
* the same contract for vLLM's real p2p and object tiers, where vLLM is importable (NIXL
  stood in for, as vLLM's own tests do); skipped with the reason where it is not
  (kvoffload's own venv has no vLLM).
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock, patch

import pytest

import kvoffload.tiering
from kvoffload import faults
from kvoffload.bringup import BringUpOutcome, BringUpRequest, bring_up, run_matrix
from kvoffload.bringup.plan import plan_stages
from kvoffload.bringup.residue import Footprint, left_running
from kvoffload.errors import InjectedFault
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.tiering import hosted_wrappers
from kvoffload.tiering.base import SecondaryTierManager
from kvoffload.tiering.factory import SecondaryTierFactory, TierModuleNotFoundError
from kvoffload.tiering.hosted import HOSTED, HostedTierFinder, is_hosted
from kvoffload.tiering.spec import TieringOffloadingSpec
from tests.support import socket_tier

torch = pytest.importorskip("torch")

TIERING = "TieringOffloadingSpec"
KV_BYTES_PER_BLOCK = PAGESIZE // 2
SOCKET_TIER = {"type": "SocketTier", "module_path": "tests.support.socket_tier"}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def make_config(
    engine_id: str, root: Path, tiers: list[dict[str, Any]], *, world_size: int = 1
) -> OffloadingSettings:
    extra = {"spec_name": TIERING, "cpu_bytes_to_use": 8 * PAGESIZE, "blocks_per_chunk": 2}
    return OffloadingSettings.from_kv_transfer_config(
        json.dumps(
            {"engine_id": engine_id, "kv_connector_extra_config": {**extra, "secondary_tiers": tiers}}
        ),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        world_size=world_size,
        root=root,
    )


def kv_caches() -> list[Any]:
    return [torch.zeros((16, KV_BYTES_PER_BLOCK), dtype=torch.int8)]


@contextmanager
def engine(config: OffloadingSettings) -> Iterator[dict[str, Any]]:
    """A worker then the scheduler, in vLLM's order (``up()``); everything built goes at the end."""
    built: dict[str, Any] = {}

    def up() -> None:
        built["worker"] = TieringOffloadingSpec.from_settings(config.for_rank(0)).create_worker(kv_caches())
        built["manager"] = TieringOffloadingSpec.from_settings(config).get_manager()

    built["up"] = up
    try:
        yield built
    finally:
        faults.configure(None)
        if "manager" in built:
            built["manager"].shutdown()
        if "worker" in built:
            built["worker"].shutdown()


@pytest.fixture
def footprint() -> Footprint:
    """This process's threads and sockets before the test built anything."""
    return Footprint.now()


# ----------------------------------------------------------------- hosting, on a stand-in vLLM

_STAND_IN_MANAGER = '''
    """Stands in for vLLM's p2p manager: kv_offload names, a relative import, a vLLM-only one."""
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    from .wire import PROTOCOL
    from vllm.version_stub import VLLM_ONLY


    class P2PSecondaryTierManager(ExampleSecondaryTierManager):
        protocol = PROTOCOL
        vllm_only = VLLM_ONLY
'''


def _forget_hosted() -> None:
    for name in [n for n in sys.modules if is_hosted(n) or n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    for package in HOSTED:
        if hasattr(kvoffload.tiering, package.rsplit(".", 1)[-1]):
            delattr(kvoffload.tiering, package.rsplit(".", 1)[-1])
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HostedTierFinder)]


@pytest.fixture
def stand_in_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A minimal ``vllm`` tree first on sys.path: a p2p package with a manager, and one module
    outside kv_offload. Every hosted module is forgotten afterwards."""
    if "vllm" in sys.modules:
        pytest.skip("the real vLLM is imported in this process; a stand-in cannot replace it")
    package = tmp_path / "vllm"
    p2p = package / "v1" / "kv_offload" / "tiering" / "p2p"
    p2p.mkdir(parents=True)
    for folder in (package, package / "v1", package / "v1" / "kv_offload", p2p.parent):
        (folder / "__init__.py").write_text("")
    (package / "version_stub.py").write_text("VLLM_ONLY = 'from vllm itself'\n")
    (p2p / "__init__.py").write_text("FROM_VLLMS_INIT = True\n")
    (p2p / "wire.py").write_text("PROTOCOL = 'p2p/1'\n")
    (p2p / "manager.py").write_text(textwrap.dedent(_STAND_IN_MANAGER))
    (p2p / "plain.py").write_text("import vllm.v1.kv_offload.base\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _forget_hosted()
    try:
        yield package
    finally:
        _forget_hosted()


def test_a_hosted_module_is_vllms_file_under_kvoffloads_name(stand_in_vllm: Path) -> None:
    manager = importlib.import_module("kvoffload.tiering.p2p.manager")
    assert manager.__file__ == str(stand_in_vllm / "v1/kv_offload/tiering/p2p/manager.py")
    assert manager.P2PSecondaryTierManager.protocol == "p2p/1"
    assert manager.P2PSecondaryTierManager.vllm_only == "from vllm itself"
    assert importlib.import_module("kvoffload.tiering.p2p").FROM_VLLMS_INIT is True


def test_a_hosted_tier_is_built_on_kvoffloads_base_classes(stand_in_vllm: Path) -> None:
    from kvoffload.tiering.example.manager import ExampleSecondaryTierManager

    manager = importlib.import_module("kvoffload.tiering.p2p.manager")
    assert manager.SecondaryTierManager is SecondaryTierManager
    assert issubclass(manager.P2PSecondaryTierManager, ExampleSecondaryTierManager)
    assert "vllm.v1.kv_offload.tiering.base" not in sys.modules


def test_the_factory_builds_a_hosted_tier_by_its_registered_type(stand_in_vllm: Path) -> None:
    tier_cls = SecondaryTierFactory.get_tier_class({"type": "p2p"})
    assert tier_cls.__module__ == "kvoffload.tiering.p2p.manager"
    assert tier_cls.__name__ == "P2PSecondaryTierManager"


def test_hosted_code_may_not_bind_vllms_own_kv_offload_modules(stand_in_vllm: Path) -> None:
    with pytest.raises(ImportError, match=r"may only from-import kv_offload names"):
        importlib.import_module("kvoffload.tiering.p2p.plain")


def test_hosting_writes_nothing_into_vllms_tree(stand_in_vllm: Path) -> None:
    before = sorted(stand_in_vllm.rglob("*"))
    importlib.import_module("kvoffload.tiering.p2p.manager")
    assert sorted(stand_in_vllm.rglob("*")) == before


def test_a_tree_without_the_tier_says_which_folder_is_missing(stand_in_vllm: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match=r"has no v1/kv_offload/tiering/obj; install vllm==0\.33"):
        importlib.import_module("kvoffload.tiering.obj")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable here")
@pytest.mark.parametrize("tier_type", ["p2p", "obj"])
def test_without_vllm_a_hosted_tier_type_says_what_to_install(tier_type: str) -> None:
    with pytest.raises(TierModuleNotFoundError, match=r"vLLM 0\.33's own code, hosted by kvoffload") as info:
        SecondaryTierFactory.get_tier_class({"type": tier_type})
    assert "vLLM is not installed; install vllm==0.33.*" in str(info.value)
    assert not any(is_hosted(name) for name in sys.modules)


# ----------------------------------------------------------------- guards, on a stand-in transport


class _Transport:
    """Stands in for vLLM's ZmqTransport: binds a socket and starts a thread, then may fail."""

    def __init__(self, fail: bool = False) -> None:
        self.closed = False
        self._router = socket.socket()
        self._router.bind(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._io = threading.Thread(target=self._stop.wait, name="stand-in-io", daemon=True)
        self._io.start()
        if fail:
            raise OSError(errno.EADDRINUSE, "Address already in use")

    def close(self) -> None:
        self.closed = True
        self._stop.set()
        self._io.join()
        self._router.close()


def _undo_transport(transport: _Transport) -> None:
    transport.close()


def guarded_transport(**spec: Any) -> type[_Transport]:
    """A fresh subclass whose ``__init__`` and ``close`` carry the guards ``spec`` asks for."""
    init = hosted_wrappers.Guard(
        "GuardedTransport", "__init__", point=spec.get("point"), undo=spec.get("undo")
    )
    close = hosted_wrappers.Guard("GuardedTransport", "close", cleanup_point=spec.get("cleanup_point"))
    methods = {
        "__init__": hosted_wrappers.guard(_Transport.__init__, init),
        "close": hosted_wrappers.guard(_Transport.close, close),
    }
    cls: type[_Transport] = type("GuardedTransport", (_Transport,), methods)
    return cls


def test_a_guarded_constructor_releases_what_it_built_and_raises_the_original_error(
    footprint: Footprint,
) -> None:
    cls = guarded_transport(undo=_undo_transport)
    with pytest.raises(OSError, match="Address already in use") as info:
        cls(fail=True)
    assert info.value.errno == errno.EADDRINUSE
    assert left_running(footprint) == ()
    # Not vacuous: the same constructor unguarded leaves its thread and its socket.
    partial = _Transport.__new__(_Transport)
    with pytest.raises(OSError, match="Address already in use"):
        _Transport.__init__(partial, fail=True)
    assert len(left_running(footprint, grace_s=0)) == 2
    partial.close()
    assert left_running(footprint) == ()


def test_an_init_point_fails_its_stage_before_anything_is_built(footprint: Footprint) -> None:
    cls = guarded_transport(point="secondary.p2p.control", undo=_undo_transport)
    with faults.scenario({"secondary.p2p.control": "oserror(EADDRINUSE)"}):
        with pytest.raises(OSError, match=r"injected at secondary\.p2p\.control"):
            cls()
        assert faults.hits() == {"secondary.p2p.control": 1}
    assert left_running(footprint, grace_s=0) == ()
    cls().close()  # with nothing configured, the guard changes nothing


def test_a_cleanup_point_reports_its_failure_after_the_step_ran(footprint: Footprint) -> None:
    transport = guarded_transport(cleanup_point="cleanup.secondary.p2p.control")()
    with faults.scenario({"cleanup.secondary.p2p.control": "raise"}), pytest.raises(InjectedFault):
        transport.close()
    assert transport.closed
    assert left_running(footprint) == ()


def test_guards_refuse_a_hosted_module_without_the_class_they_were_written_for() -> None:
    module = types.ModuleType("kvoffload.tiering.p2p.control.zmq")
    with pytest.raises(ImportError, match=r"has no class ZmqTransport: .* \(vLLM 0\.33\)"):
        hosted_wrappers.apply(module)


def test_guards_wrap_each_method_once_and_keep_vllms_function_as_wrapped() -> None:
    module = types.ModuleType("kvoffload.tiering.p2p.control.zmq")
    transport: Any = type("ZmqTransport", (_Transport,), {})
    module.__dict__["ZmqTransport"] = transport
    hosted_wrappers.apply(module)
    first = transport.__init__
    hosted_wrappers.apply(module)
    assert transport.__init__ is first
    assert first.__wrapped__ is _Transport.__init__
    # An inherited method gets its guard on the subclass; the base keeps its own.
    assert _Transport.close is not transport.close
    assert transport.close.__wrapped__ is _Transport.close


def test_every_point_a_guard_fires_is_registered_for_its_tier() -> None:
    registered = {p.name: p.tier for p in faults.REGISTRY}
    for module, specs in hosted_wrappers.GUARDS.items():
        tier = module.split(".")[2]
        for spec in specs:
            for name in (spec.point, spec.cleanup_point):
                if name is not None:
                    assert registered.get(name) == tier, (module, spec)
    assert {t for t in registered.values() if t} == {"p2p", "obj"}


# ----------------------------------------------------------------- a tier with a thread and a socket


def socket_tier_config(engine_id: str, root: Path, **options: Any) -> OffloadingSettings:
    return make_config(engine_id, root, [{**SOCKET_TIER, **options}, {"type": "example"}])


def stages_of(config: OffloadingSettings, phase: str) -> list[str]:
    return [s.name for s in plan_stages(config) if s.phase == phase]


_LISTED = socket_tier_config("listing", Path("/dev/shm"))
INIT_STAGES = stages_of(_LISTED, "init")
CLEANUP_STAGES = stages_of(_LISTED, "cleanup")


def test_the_socket_tier_really_holds_a_thread_and_a_socket_while_up(
    engine_id: str, root: Path, footprint: Footprint
) -> None:
    """The residue check is not vacuous: it sees what the tier holds until it is shut down."""
    with engine(socket_tier_config(engine_id, root)) as built:
        built["up"]()
        tier = built["manager"].secondary_tiers[0]
        assert isinstance(tier, socket_tier.SocketTier)
        assert left_running(footprint, grace_s=0) == (
            f"thread {socket_tier.THREAD_NAME!r} (daemon)",
            *(f"fd {s}" for s in sorted(Footprint.now().handles - footprint.handles)),
        )
        with socket.create_connection(("127.0.0.1", tier.port)):
            pass
    assert left_running(footprint) == ()


def test_a_tier_that_keeps_its_thread_and_socket_is_caught(
    engine_id: str, root: Path, footprint: Footprint
) -> None:
    with engine(socket_tier_config(engine_id, root, leak=True)) as built:
        built["up"]()
        tier = built["manager"].secondary_tiers[0]
    left = left_running(footprint, grace_s=0.1)
    tier._leak = False
    tier.shutdown()
    assert left[0] == f"thread {socket_tier.THREAD_NAME!r} (daemon)"
    # Its listening socket, and the epoll its thread's selector polls.
    assert sorted(item.split("[")[0] for item in left[1:]) == ["fd anon_inode:", "fd socket:"]


@pytest.mark.parametrize("point", INIT_STAGES)
def test_a_failure_at_any_init_point_leaves_no_thread_and_no_socket(
    engine_id: str, root: Path, footprint: Footprint, point: str
) -> None:
    with engine(socket_tier_config(engine_id, root)) as built:
        faults.configure({point: "raise"})
        with pytest.raises(InjectedFault) as info:
            built["up"]()
        assert info.value.point == point
        assert "manager" not in built
        assert left_running(footprint, grace_s=0.1) == ()
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("cleanup_point", CLEANUP_STAGES)
@pytest.mark.parametrize("point", ["secondary.1", "manager"])
def test_a_failing_release_step_still_stops_the_tiers_thread_and_socket(
    engine_id: str, root: Path, footprint: Footprint, point: str, cleanup_point: str
) -> None:
    """The socket tier is up when ``point`` fails, and its release runs while ``cleanup_point`` fails."""
    with engine(socket_tier_config(engine_id, root)) as built:
        faults.configure({point: "raise", cleanup_point: "raise"})
        with pytest.raises(InjectedFault) as info:
            built["up"]()
        assert info.value.point == point
        assert left_running(footprint, grace_s=0.1) == ()


def test_a_bring_up_with_the_socket_tier_leaves_nothing(engine_id: str, root: Path) -> None:
    report = bring_up(BringUpRequest(socket_tier_config(engine_id, root)))
    assert report.verdict == BringUpOutcome.OK, report.errors
    assert not any("thread and socket" in s.what for s in report.cleanup)


def test_a_bring_up_whose_tier_keeps_its_thread_and_socket_is_leaked(engine_id: str, root: Path) -> None:
    report = bring_up(BringUpRequest(socket_tier_config(engine_id, root, leak=True)))
    assert report.verdict == BringUpOutcome.LEAKED
    assert not report.residue
    [step] = [s for s in report.cleanup if s.what == "stop every thread and socket started since init"]
    assert step.participant == "scheduler"
    assert not step.ok
    assert step.error is not None
    assert f"thread {socket_tier.THREAD_NAME!r}" in step.error
    assert "fd socket:[" in step.error


def test_the_fault_matrix_over_the_socket_tiers_points_leaves_nothing(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, [SOCKET_TIER])
    report = run_matrix(
        config,
        stages=("secondary.0", "manager", "cleanup.secondary.0"),
        modes=("raise", "cleanup-raise"),
    )
    assert [(c.stage, c.mode, c.verdict) for c in report.cells] == [
        (stage, mode, BringUpOutcome.CONTRACT_HELD)
        for stage in ("secondary.0", "manager", "cleanup.secondary.0")
        for mode in ("raise", "cleanup-raise")
    ]
    assert report.leaked == 0


# ----------------------------------------------------------------- vLLM's own tiers, where vLLM is


# `make vllm-hosted` sets KVOFFLOAD_REQUIRE_VLLM: there a missing vLLM fails these tests.
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM and not os.environ.get("KVOFFLOAD_REQUIRE_VLLM"),
    reason="vLLM is not importable (kvoffload's venv has none)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nixl_stood_in() -> Iterator[list[MagicMock]]:
    """NIXL is a native library absent here: its agent is a MagicMock, as in vLLM's own tests.

    Yields the agents (the p2p tier's, the object tier's), so a test can check that every
    registration and prepared list NIXL handed out was given back.
    """
    nixl = importlib.import_module("kvoffload.tiering.p2p.data.nixl")
    obj = importlib.import_module("kvoffload.tiering.obj.manager")
    p2p_agent, obj_agent = MagicMock(), MagicMock()
    with ExitStack() as stack:
        stack.enter_context(patch.object(nixl, "_NixlAgent", MagicMock(return_value=p2p_agent)))
        stack.enter_context(patch.object(nixl, "_NixlAgentConfig", MagicMock()))
        stack.enter_context(patch.object(obj, "nixl_agent", MagicMock(return_value=obj_agent)))
        stack.enter_context(patch.object(obj, "nixl_agent_config", MagicMock()))
        yield [p2p_agent, obj_agent]


def nixl_given_back(agents: list[MagicMock]) -> list[str]:
    """What a NIXL agent handed out and was not given back: registrations and prepared lists."""
    owed = []
    for agent in agents:
        for took, gave in (
            ("register_memory", "deregister_memory"),
            ("prep_xfer_dlist", "release_dlist_handle"),
        ):
            if getattr(agent, took).call_count != getattr(agent, gave).call_count:
                owed.append(
                    f"{took} x{getattr(agent, took).call_count}, {gave} x{getattr(agent, gave).call_count}"
                )
    return owed


def vllm_tiers(which: str) -> list[dict[str, Any]]:
    p2p = {"type": "p2p", "host": "127.0.0.1", "port": free_port()}
    obj = {"type": "obj", "store_config": {"bucket": "kv", "endpoint_override": "127.0.0.1:9"}}
    choices: dict[str, list[dict[str, Any]]] = {"p2p": [p2p], "obj": [obj], "both": [p2p, obj]}
    return choices[which]


@needs_vllm
@pytest.mark.parametrize("which", ["p2p", "obj", "both"])
def test_vllms_tiers_are_built_and_driven_by_kvoffloads_manager(
    engine_id: str, root: Path, footprint: Footprint, which: str
) -> None:
    with nixl_stood_in(), engine(make_config(engine_id, root, vllm_tiers(which))) as built:
        built["up"]()
        tiers = built["manager"].secondary_tiers
        assert [t.tier_type for t in tiers] == (["p2p", "obj"] if which == "both" else [which])
        assert all(isinstance(t, SecondaryTierManager) and is_hosted(type(t).__module__) for t in tiers)
        held = left_running(footprint, grace_s=0)
        # What each tier holds while up, so the check after the shutdown is not vacuous.
        if which in ("p2p", "both"):
            assert any(h.startswith("fd socket:[") for h in held), held
        if which in ("obj", "both"):
            assert any(h.startswith("thread ") for h in held), held
    assert left_running(footprint) == ()


def _failure_cases() -> Iterator[Any]:
    tier_points = {p.name: p.tier for p in faults.REGISTRY if p.tier is not None}
    for which in ("p2p", "obj", "both"):
        kinds = {"p2p", "obj"} if which == "both" else {which}
        points = ["secondary.0", "manager", "cleanup.secondary.0"]
        points += [name for name, tier in tier_points.items() if tier in kinds]
        for point in points:
            yield pytest.param(which, point, id=f"{which}-{point}")


@needs_vllm
@pytest.mark.parametrize(("which", "point"), list(_failure_cases()))
def test_vllms_tiers_leave_no_thread_no_socket_and_no_nixl_handle_after_a_failure(
    engine_id: str, root: Path, footprint: Footprint, which: str, point: str
) -> None:
    """At every stage of the tiers' own creation and shutdown, as at kvoffload's points."""
    with nixl_stood_in() as agents, engine(make_config(engine_id, root, vllm_tiers(which))) as built:
        faults.configure({"manager" if point.startswith("cleanup") else point: "raise", point: "raise"})
        with pytest.raises(InjectedFault) as info:
            built["up"]()
        assert info.value.point == ("manager" if point.startswith("cleanup") else point)
        assert faults.hits().get(point) == 1  # the point was reached, not configured in vain
        assert left_running(footprint) == ()
        assert nixl_given_back(agents) == []
    assert list(root.iterdir()) == []


@needs_vllm
def test_a_p2p_tier_whose_port_is_taken_fails_and_leaves_nothing(
    engine_id: str, root: Path, footprint: Footprint
) -> None:
    """vLLM 0.33 leaks here: ZmqTransport's context (an I/O thread) and the data plane already up."""
    zmq = pytest.importorskip("zmq")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tier = {"type": "p2p", "host": "127.0.0.1", "port": port}
        before = Footprint.now()
        with nixl_stood_in() as agents, engine(make_config(engine_id, root, [tier])) as built:
            with pytest.raises(zmq.ZMQError, match="Address already in use"):
                built["up"]()
            assert left_running(before) == ()
            assert nixl_given_back(agents) == []
            # Not vacuous: vLLM's own constructor, unguarded, keeps the context (native I/O
            # threads, and the eventfds and epoll they poll).
            zmq_transport = importlib.import_module("kvoffload.tiering.p2p.control.zmq").ZmqTransport
            partial = zmq_transport.__new__(zmq_transport)
            with pytest.raises(zmq.ZMQError, match="Address already in use"):
                zmq_transport.__init__.__wrapped__(partial, f"127.0.0.1:{port}", "127.0.0.1", port)
            assert left_running(before, grace_s=0.2) != ()
            partial._router.close(linger=0)
            partial._zmq_ctx.destroy(linger=0)
    assert left_running(footprint) == ()
    assert list(root.iterdir()) == []


@needs_vllm
def test_a_p2p_shutdown_whose_control_plane_fails_still_closes_its_data_plane(
    engine_id: str, root: Path, footprint: Footprint
) -> None:
    """vLLM 0.33's shutdown stops at the error; the guard closes what it had not reached."""
    with nixl_stood_in() as agents, engine(make_config(engine_id, root, vllm_tiers("p2p"))) as built:
        built["up"]()
        [tier] = built["manager"].secondary_tiers
        faults.configure({"cleanup.secondary.p2p.control": "raise"})
        with pytest.raises(InjectedFault):
            tier.shutdown()
        assert tier._data.available is False  # closed: its agent is gone
        assert nixl_given_back(agents) == []
        faults.configure(None)
    assert left_running(footprint) == ()


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(900)  # ten real bring-ups, each importing vLLM's tier in its participants
def test_the_fault_matrix_over_vllms_p2p_tier_leaves_nothing(engine_id: str, root: Path) -> None:
    """Real bring-ups (worker and scheduler processes) with vLLM's p2p tier: a real ZMQ socket
    and context; NIXL is absent here, so its data plane stays unavailable, as vLLM allows."""
    config = make_config(engine_id, root, vllm_tiers("p2p"))
    stages = (
        "secondary.0",
        "secondary.p2p.data",
        "secondary.p2p.control",
        "manager",
        "cleanup.secondary.p2p.control",
    )
    report = run_matrix(config, stages=stages, modes=("raise", "cleanup-raise"))
    assert [(c.stage, c.mode, c.verdict) for c in report.cells] == [
        (stage, mode, BringUpOutcome.CONTRACT_HELD) for stage in stages for mode in ("raise", "cleanup-raise")
    ]
    assert report.leaked == 0
    assert list(root.iterdir()) == []


@needs_vllm
@pytest.mark.timeout(600)  # a bring-up whose participants import vLLM, under whatever load
@pytest.mark.parametrize(
    "point", ["secondary.p2p.data", "secondary.p2p.control", "cleanup.secondary.p2p.control"]
)
def test_shmctl_init_fails_a_real_bring_up_at_each_p2p_point_and_leaves_nothing(
    engine_id: str, root: Path, point: str
) -> None:
    """The command operators run, in vLLM's own venv (typer 0.29 there): the original error,
    the contract held, nothing in the root. (The object tier needs NIXL to be built at all.)"""
    tiers = [{"type": "p2p", "host": "127.0.0.1", "port": free_port()}]
    config = {
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "spec_name": TIERING,
            "cpu_bytes_to_use": 8 * PAGESIZE,
            "secondary_tiers": tiers,
        },
    }
    argv = [
        "init",
        "--kv-transfer-config",
        json.dumps(config),
        "--kv-bytes-per-block",
        str(KV_BYTES_PER_BLOCK),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", *argv, "--root", str(root), "--fail-at", point, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["verdict"], report["fault"]["fired_in"]) == ("contract-held", ["scheduler"])
    assert (report["error"]["injected"], report["error"]["point"]) == (True, point)
    assert list(root.iterdir()) == []


def test_event_fds_count_where_tiers_run_and_not_in_a_worker() -> None:
    """A ZMQ context shows only as eventfds and an epoll; a worker's CUDA runtime may keep such
    fds for the life of the process, so a worker's footprint counts sockets only."""
    scheduler, worker = Footprint.now(), Footprint.now(event_fds=False)
    fd = os.eventfd(0)
    try:
        assert left_running(scheduler, grace_s=0) == (f"fd anon_inode:[eventfd] (fd {fd})",)
        assert left_running(worker, grace_s=0) == ()
    finally:
        os.close(fd)
    assert left_running(scheduler, grace_s=0) == ()
