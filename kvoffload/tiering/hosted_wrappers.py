"""Wrappers around the hosted tiers' methods (vLLM's p2p and object tiers): fault points at
their stages, and the release of what a failed stage held.

(No relation to liveness's lease watchdog: a ``Guard`` here is how one hosted method is
wrapped.)

The hosted tiers are vLLM's code, not ours (``kvoffload.tiering.hosted``), so their
stages cannot call ``faults.point`` and their open leaks cannot be fixed in their source.
Instead, as each hosted module is executed, the methods listed in ``GUARDS`` are wrapped
in place (the class stays vLLM's class; ``__wrapped__`` is vLLM's function):

* ``point``: a named fault point fires first (``secondary.p2p.data`` before the p2p tier's
  data plane is built, ...): a failure there is the failure of that stage;
* ``undo``: when the constructor raises, what it had already built is released before the
  error goes on (vLLM 0.33 leaks it: the p2p tier's data plane when its control socket
  cannot bind, the ZMQ context and its I/O thread when the bind itself fails, the object
  tier's memory registration when its lookup thread cannot start);
* ``finish``: when ``shutdown``/``close`` raises, the parts it had not reached yet are
  still released, then the error goes on (vLLM 0.33's p2p shutdown skips the data plane
  when closing the control plane raises);
* ``cleanup point``: a cleanup fault point that reports a failure after the step has run
  (``try: point finally: step``), as kvoffload's own cleanup points do.

With no fault configured a guard costs one dict test and a ``try``; on success it changes
nothing. A test that patches the method (``patch.object(Cls, "__init__")``) replaces the
guard with its patch, as it would replace vLLM's method.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import faults

#: The logger keeps the module's old name: it is what participants report in init's ``logs``
#: and what an operator's logging config names (moved from ``tiering/guards.py``, issue #29).
log = logging.getLogger("kvoffload.tiering.guards")

#: The marker set on a guarded function, so a module executed twice is guarded once.
_GUARDED = "__kvoffload_guard__"


@dataclass(frozen=True, slots=True)
class Guard:
    """How one method of a hosted class is wrapped."""

    cls: str
    method: str
    #: An init fault point fired before the method runs.
    point: str | None = None
    #: A cleanup fault point: fires, and the method still runs (``try: point finally: method``).
    cleanup_point: str | None = None
    #: Releases what a partial ``self`` holds when the method raises; the error goes on.
    undo: Callable[[Any], None] | None = None


def _release(owner: object, what: str, step: Callable[[], object]) -> None:
    """One best-effort release step of an unwind: a failure is logged, never raised over the error."""
    try:
        step()
    except Exception as e:  # the original error is the one that goes on
        log.warning("%s: releasing %s failed: %s: %s", type(owner).__name__, what, type(e).__name__, e)


def _close_attr(owner: object, attr: str, method: str = "close") -> None:
    part = getattr(owner, attr, None)
    if part is None:
        return
    # vLLM's own step, not its guard: an unwind must not fire the step's cleanup point again.
    fn = getattr(type(part), method)
    if getattr(fn, _GUARDED, None) is not None:
        fn = fn.__wrapped__
    _release(owner, attr, lambda: fn(part))


# ----------------------------------------------------------------- the p2p tier


def _undo_zmq_transport(transport: Any) -> None:
    """A ZmqTransport whose bind failed: its ROUTER socket and its context (an I/O thread)."""
    router = getattr(transport, "_router", None)
    if router is not None:
        _release(transport, "_router", lambda: router.close(linger=0))
    context = getattr(transport, "_zmq_ctx", None)
    if context is not None:
        _release(transport, "_zmq_ctx", lambda: context.destroy(linger=0))


def _undo_nixl_transport(transport: Any) -> None:
    """A NixlTransport that failed after its executor existed: ``close`` handles a partial one."""
    if getattr(transport, "_reg_executor", None) is not None:
        _release(transport, "data plane", transport.close)


def _undo_p2p_tier(tier: Any) -> None:
    """What a P2PSecondaryTierManager built before it failed: control plane, then data plane."""
    _close_attr(tier, "_control")
    _close_attr(tier, "_data")


# ----------------------------------------------------------------- the object tier


def _undo_obj_tier(tier: Any) -> None:
    """What an ObjectStoreSecondaryTierManager holds: lookup thread, DRAM handle, registration."""
    _close_attr(tier, "_lookup_manager", "shutdown")
    agent = getattr(tier, "_agent", None)
    if agent is None:
        return
    transfers: dict[Any, Any] = getattr(tier, "_transfers", None) or {}
    for job_id, entry in list(transfers.items()):
        what = f"transfer {job_id}"
        _release(tier, what, functools.partial(agent.release_xfer_handle, entry.xfer_handle))
        _release(tier, what, functools.partial(agent.release_dlist_handle, entry.obj_handle))
        _release(tier, what, functools.partial(agent.deregister_memory, entry.files_desc))
        del transfers[job_id]
    handle = getattr(tier, "_dram_prepped_handle", None)
    if handle is not None:
        _release(tier, "_dram_prepped_handle", lambda: agent.release_dlist_handle(handle))
        tier._dram_prepped_handle = None
    registration = getattr(tier, "_primary_reg", None)
    if registration is not None:
        _release(tier, "_primary_reg", lambda: agent.deregister_memory(registration))
        tier._primary_reg = None


#: hosted module -> the guards of its classes.
GUARDS: Mapping[str, tuple[Guard, ...]] = {
    "kvoffload.tiering.p2p.data.nixl": (
        Guard("NixlTransport", "__init__", point="secondary.p2p.data", undo=_undo_nixl_transport),
    ),
    "kvoffload.tiering.p2p.control.zmq": (
        Guard("ZmqTransport", "__init__", point="secondary.p2p.control", undo=_undo_zmq_transport),
        Guard("ZmqTransport", "close", cleanup_point="cleanup.secondary.p2p.control"),
    ),
    "kvoffload.tiering.p2p.manager": (
        Guard("P2PSecondaryTierManager", "__init__", undo=_undo_p2p_tier),
        Guard("P2PSecondaryTierManager", "shutdown", undo=_undo_p2p_tier),
    ),
    "kvoffload.tiering.obj.manager": (
        Guard("ObjectStoreSecondaryTierManager", "_probe_connectivity", point="secondary.obj.probe"),
        Guard("ObjAsyncLookupManager", "__init__", point="secondary.obj.lookup"),
        Guard("ObjAsyncLookupManager", "shutdown", cleanup_point="cleanup.secondary.obj.lookup"),
        Guard("ObjectStoreSecondaryTierManager", "__init__", undo=_undo_obj_tier),
        Guard("ObjectStoreSecondaryTierManager", "shutdown", undo=_undo_obj_tier),
    ),
}


def guard(fn: Callable[..., Any], spec: Guard) -> Callable[..., Any]:
    """``fn`` (a method of ``spec.cls``) wrapped as ``spec`` says."""

    @functools.wraps(fn)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if spec.point is not None:
            faults.point(spec.point)
        try:
            if spec.cleanup_point is None:
                return fn(self, *args, **kwargs)
            try:
                faults.point(spec.cleanup_point)
            finally:
                result = fn(self, *args, **kwargs)  # the step runs whatever the point did
            return result
        except BaseException:
            if spec.undo is not None:
                spec.undo(self)
            raise

    setattr(guarded, _GUARDED, spec)
    return guarded


def apply(module: types.ModuleType) -> None:
    """Wrap the methods ``GUARDS`` lists for ``module`` (a hosted module just executed)."""
    for spec in GUARDS.get(module.__name__, ()):
        cls = module.__dict__.get(spec.cls)
        if not isinstance(cls, type):
            raise ImportError(
                f"{module.__name__} has no class {spec.cls}: the hosted vLLM is not the one "
                "kvoffload's guards were written for (vLLM 0.33)",
                name=module.__name__,
            )
        # Wrap only what the class itself defines: an inherited method (the object tier's
        # lookup manager's ``shutdown`` is kvoffload's base's) gets its wrapper on the subclass.
        fn = getattr(cls, spec.method)
        if getattr(fn, _GUARDED, None) is not None and spec.method in cls.__dict__:
            continue
        setattr(cls, spec.method, guard(fn, spec))
