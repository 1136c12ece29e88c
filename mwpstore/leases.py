"""Execution Leases: the record inside a WorkItem, its lifetime, and the fence every result passes.

A lease (MWP-WRK-013) binds an Agent and its Session Epoch to one WorkItem at one Ownership
Epoch, with a stable id and two time bounds::

    lease_id         lease_id_for(group, workitem, ownership_epoch): 32 hex characters
    agent            the claimer's agent id
    session_epoch    the claimer's session epoch at the claim
    ownership_epoch  the WorkItem's ownership epoch granted by the claim
    granted_at_ms    acceptance time of the claim
    start_by_ms      granted_at_ms + contract.start_ms: workitem.start must come before this
    expires_at_ms    granted_at_ms (or the last renewal) + contract.lease_ms
    started          whether workitem.start was accepted

Each sum is taken with :func:`time_after`, which saturates at the largest content integer.

A lease is *live* at time t when ``t < expires_at_ms`` and (``started`` or ``t < start_by_ms``);
otherwise it has *lapsed* (MWP-WRK-019). A lapsed lease stays in the WorkItem until a new claim
replaces it or the engine's ``lease.expire`` sweep removes it, but nothing it names counts any more.

This module also keeps the Membership side in step: a Membership's ``leases`` lists the WorkItems
whose current lease names that agent, so revoking a session's leases is a get by key, not a scan.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import limits
from .errors import InvalidCommand, InvalidState, LeaseExpired, LeaseMismatch, StaleOwnershipEpoch
from .registry import StateView, aggregate_key, member_key
from .work_keys import lease_id_for


def workitem_key(workitem_id: str) -> str:
    return aggregate_key("workitem", workitem_id)


def workitem_id_of(key: str) -> str:
    return key.split(":", 1)[1]


def time_after(now_ms: int, duration_ms: int) -> int:
    """``now_ms + duration_ms``, saturated at ``limits.INT_ABS_MAX`` so it always fits an Event.

    Contract durations are bounded (``limits.WORK_DURATION_MS_MAX``), so this saturates only for
    an acceptance time within that much of the end of the range, or for a contract accepted
    before the bound existed. Either way the exact sum lies past any acceptance time a real
    clock gives, and so does the saturated value.
    """
    return min(now_ms + duration_ms, limits.INT_ABS_MAX)


def new_lease(
    group: str, workitem_id: str, *, agent: str, session_epoch: int, ownership_epoch: int, now_ms: int, contract: dict[str, Any]
) -> dict[str, Any]:
    return {
        "lease_id": lease_id_for(group, workitem_id, ownership_epoch),
        "agent": agent,
        "session_epoch": session_epoch,
        "ownership_epoch": ownership_epoch,
        "granted_at_ms": now_ms,
        "start_by_ms": time_after(now_ms, contract["start_ms"]),
        "expires_at_ms": time_after(now_ms, contract["lease_ms"]),
        "started": False,
    }


def lease_is_live(lease: dict[str, Any] | None, now_ms: int) -> bool:
    if lease is None:
        return False
    if now_ms >= lease["expires_at_ms"]:
        return False
    return bool(lease["started"]) or now_ms < lease["start_by_ms"]


def lapse_reason(lease: dict[str, Any], now_ms: int) -> str | None:
    """Why ``lease`` has lapsed at ``now_ms`` ("start_missed" or "expired"), or None if it is live."""
    if not lease["started"] and now_ms >= lease["start_by_ms"]:
        return "start_missed"
    if now_ms >= lease["expires_at_ms"]:
        return "expired"
    return None


def lapsed_workitems(items: Iterable[tuple[str, dict[str, Any]]], now_ms: int) -> list[str]:
    """The ids of the WorkItems in ``items`` whose lease has lapsed at ``now_ms``, in input order.

    ``items`` are ``(workitem id, WorkItem state)`` pairs; the engine's sweep issues one
    ``lease.expire`` per returned id. Items without a lease are skipped.
    """
    return [
        workitem_id
        for workitem_id, state in items
        if state is not None and state.get("lease") is not None and lapse_reason(state["lease"], now_ms) is not None
    ]


# -- Naming a lease in a Command ----------------------------------------------------------------


def named_lease(group: str, workitem_id: str, body: dict[str, Any]) -> tuple[str, int]:
    """Read ``lease_id`` and ``ownership_epoch`` from a body; they must belong together."""
    lease_id = body.get("lease_id")
    if type(lease_id) is not str or not lease_id or len(lease_id) > 64:
        raise InvalidCommand("body.lease_id must name the Execution Lease (its id string)", field="body.lease_id")
    epoch = body.get("ownership_epoch")
    if type(epoch) is not int or epoch < 1:
        raise InvalidCommand("body.ownership_epoch must be an integer >= 1", field="body.ownership_epoch")
    if lease_id != lease_id_for(group, workitem_id, epoch):
        raise InvalidCommand(
            f"body.lease_id is not the lease of ownership epoch {epoch} of {workitem_id!r}", field="body.lease_id"
        )
    return lease_id, epoch


def fence_result(state: dict[str, Any], *, actor: str, ownership_epoch: int, now_ms: int) -> str | None:
    """The fence for results (checkpoint, publish, block, submit, fail, charge).

    Returns None when the Command names the live lease the actor holds, so it is authoritative.
    Returns the reason it is only Evidence when it names a lease that *was* current once: an
    older ownership epoch, a lease since released or revoked, or a lease that has lapsed.
    Raises ``LeaseMismatch`` when it cannot be a late result at all: an epoch the WorkItem never
    reached, or the current lease of another agent.
    """
    current_epoch = state["ownership_epoch"]
    lease = state["lease"]
    if ownership_epoch > current_epoch:
        raise LeaseMismatch(
            f"ownership epoch {ownership_epoch} was never granted (current: {current_epoch})",
            current_ownership_epoch=current_epoch,
        )
    if ownership_epoch < current_epoch:
        return "stale_ownership_epoch"
    if lease is None:
        return "lease_released"
    if lease["agent"] != actor:
        raise LeaseMismatch("the named lease is held by another agent", current_ownership_epoch=current_epoch)
    if not lease_is_live(lease, now_ms):
        return "lease_expired"
    return None


def require_held_lease(state: dict[str, Any], *, actor: str, ownership_epoch: int, now_ms: int) -> dict[str, Any]:
    """The fence for start and renew: return the live lease the actor holds, or reject."""
    current_epoch = state["ownership_epoch"]
    lease = state["lease"]
    if ownership_epoch < current_epoch:
        raise StaleOwnershipEpoch(
            f"ownership epoch {ownership_epoch} is stale; the WorkItem is at {current_epoch}",
            current_ownership_epoch=current_epoch,
        )
    if ownership_epoch > current_epoch or lease is None or lease["agent"] != actor:
        raise LeaseMismatch(
            "the named lease is not the WorkItem's current lease held by you", current_ownership_epoch=current_epoch
        )
    reason = lapse_reason(lease, now_ms)
    if reason is not None:
        raise LeaseExpired(
            f"the lease lapsed ({reason}); claim the WorkItem again", reason=reason, expires_at_ms=lease["expires_at_ms"]
        )
    return lease


def require_state(state: dict[str, Any], allowed: tuple[str, ...], kind: str) -> None:
    if state["state"] not in allowed:
        raise InvalidState(
            f"{kind} needs a WorkItem that is {' or '.join(allowed)}; it is {state['state']}", state=state["state"]
        )


# -- Writing changes (used by evolve; never mutates what the view returned) ---------------------


class Changes:
    """The new states one transition produces, copied from the view on first edit.

    Values read from the view are copied one level deep; nested values (lease, lists) are
    replaced, never mutated, by the helpers below.
    """

    def __init__(self, view: StateView) -> None:
        self._view = view
        self.states: dict[str, dict[str, Any] | None] = {}

    def edit(self, key: str) -> dict[str, Any] | None:
        if key not in self.states:
            current = self._view.get(key)
            self.states[key] = None if current is None else dict(current)
        return self.states[key]

    def put(self, key: str, state: dict[str, Any]) -> None:
        self.states[key] = state


def _member_leases(changes: Changes, agent: str, workitem_id: str, *, holding: bool) -> None:
    member = changes.edit(member_key(agent))
    if member is None:
        return
    leases = [item for item in member.get("leases", []) if item != workitem_id]
    if holding:
        leases.append(workitem_id)
        leases.sort()
    member["leases"] = leases


def grant_lease(changes: Changes, workitem_id: str, lease: dict[str, Any]) -> dict[str, Any]:
    """Make ``lease`` the WorkItem's current lease (dropping any lapsed one it replaces)."""
    item = drop_lease(changes, workitem_id)
    item["lease"] = lease
    _member_leases(changes, lease["agent"], workitem_id, holding=True)
    return item


def drop_lease(changes: Changes, workitem_id: str) -> dict[str, Any]:
    """Release or revoke the WorkItem's lease (if any); the caller sets the new WorkItem state."""
    item = changes.edit(workitem_key(workitem_id))
    assert item is not None
    previous = item["lease"]
    if previous is not None:
        _member_leases(changes, previous["agent"], workitem_id, holding=False)
    item["lease"] = None
    return item


def revoke_agent_leases(changes: Changes, agent: str, now_ms: int) -> list[str]:
    """Revoke every lease ``agent`` holds; that work returns to queued, ready now (MWP-WRK-014)."""
    member = changes.edit(member_key(agent))
    if member is None:
        return []
    revoked = list(member.get("leases", []))
    for workitem_id in revoked:
        item = drop_lease(changes, workitem_id)
        item["state"] = "queued"
        item["not_before_ms"] = now_ms
    member["leases"] = []
    return revoked
