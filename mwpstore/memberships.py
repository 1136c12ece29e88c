"""Membership kinds: ``membership.add|change|remove`` (owner) and ``session.replace`` (the agent).

A Membership is the aggregate ``member:<agent id>``::

    role           owner | worker | approver | observer
    session_epoch  int >= 1; a claim must name it (STALE_SESSION_EPOCH otherwise)
    status         active | removed   (a removed Membership is kept: its revision keeps counting)
    leases         sorted ids of the WorkItems whose current lease names this agent
    public_key     optional, 64 hex characters: the agent's Ed25519 key; its Commands must be signed

Membership changes are compare-and-set (MWP-EVT-007): ``expected_revision`` is required (0 to add
an agent never seen before). An owner cannot remove or demote itself, so a Group always keeps an
owner: every removal is issued by an owner who stays one.
"""

from __future__ import annotations

from typing import Any

from .errors import AlreadyExists, InvalidCommand, InvalidState, NotFound, StaleSessionEpoch, Unauthorized
from .kinds import body_int, body_str, check_public_key_hex, check_unknown_fields
from .leases import Changes, revoke_agent_leases
from .messages import Command, Event
from .registry import Context, Decision, KindSpec, StateView, member_key, register

ROLES = ("approver", "observer", "owner", "worker")
ALL_ROLES = frozenset(ROLES)


def _role(command: Command) -> str:
    role = command.body.get("role")
    if role not in ROLES:
        raise InvalidCommand(f"body.role must be one of {', '.join(ROLES)}", field="body.role")
    assert isinstance(role, str)
    return role


def _existing(view: StateView, key: str, target: str) -> dict[str, Any]:
    member = view.get(key)
    if member is None or member["status"] != "active":
        raise NotFound(f"{target!r} is not an active member of this Group", field="target")
    return member


# -- membership.add -----------------------------------------------------------------------------


def _decide_add(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"role", "public_key"})
    body: dict[str, Any] = {"role": _role(command)}
    if command.body.get("public_key") is not None:
        body["public_key"] = check_public_key_hex(command.body["public_key"])
    existing = view.get(member_key(command.target))
    if existing is not None and existing["status"] == "active":
        raise AlreadyExists(f"{command.target!r} is already a member; use membership.change", field="target")
    return Decision(body)


def _evolve_add(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    previous = view.get(event.aggregate)
    member: dict[str, Any] = {
        "role": body["role"],
        # A re-added agent keeps counting sessions, so a process from before its removal stays stale.
        "session_epoch": previous["session_epoch"] if previous is not None else 1,
        "status": "active",
        "leases": [],
    }
    if "public_key" in body:
        member["public_key"] = body["public_key"]
    return {event.aggregate: member}


# -- membership.change --------------------------------------------------------------------------


def _decide_change(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"role", "public_key"})
    member = _existing(view, member_key(command.target), command.target)
    body: dict[str, Any] = {}
    if "role" in command.body:
        body["role"] = _role(command)
    if "public_key" in command.body:
        key = command.body["public_key"]
        body["public_key"] = None if key is None else check_public_key_hex(key)
    if not body:
        raise InvalidCommand("membership.change needs role or public_key", field="body")
    if command.target == command.actor and body.get("role", "owner") != "owner":
        raise InvalidCommand("an owner cannot demote itself; ask another owner", field="target")
    if member["role"] == "worker" and body.get("role", "worker") != "worker":
        body["revoked_workitems"] = list(member["leases"])
    return Decision(body)


def _evolve_change(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    if "revoked_workitems" in body:
        # No longer a worker: its leases are revoked (it could not report under them any more).
        revoke_agent_leases(changes, event.aggregate.split(":", 1)[1], event.accepted_at_ms)
    member = changes.edit(event.aggregate)
    assert member is not None
    if "role" in body:
        member["role"] = body["role"]
    if "public_key" in body:
        if body["public_key"] is None:
            member.pop("public_key", None)
        else:
            member["public_key"] = body["public_key"]
    return changes.states


# -- membership.remove --------------------------------------------------------------------------


def _decide_remove(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason"})
    member = _existing(view, member_key(command.target), command.target)
    if command.target == command.actor:
        raise InvalidCommand("an owner cannot remove itself; ask another owner", field="target")
    reason = body_str(command, "reason", required=False) or ""
    return Decision({"reason": reason, "revoked_workitems": list(member["leases"])})


def _evolve_remove(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    changes = Changes(view)
    revoke_agent_leases(changes, event.aggregate.split(":", 1)[1], event.accepted_at_ms)
    member = changes.edit(event.aggregate)
    assert member is not None
    member["status"] = "removed"
    member["session_epoch"] = member["session_epoch"] + 1  # the removed agent's session is over
    return changes.states


# -- session.replace ----------------------------------------------------------------------------


def _decide_session_replace(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"session_epoch"})
    if command.target != command.actor:
        raise Unauthorized("session.replace must target the actor's own Membership", field="target")
    member = context.member
    assert member is not None
    current = member["session_epoch"]
    named = body_int(command, "session_epoch", required=False, minimum=1)
    if named is not None and named != current:
        raise StaleSessionEpoch(
            f"session epoch {named} is not the current one ({current})", current_session_epoch=current
        )
    return Decision(
        {"session_epoch": current, "new_session_epoch": current + 1, "revoked_workitems": list(member["leases"])}
    )


def _evolve_session_replace(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    revoke_agent_leases(changes, event.actor, event.accepted_at_ms)
    member = changes.edit(event.aggregate)
    assert member is not None
    member["session_epoch"] = body["new_session_epoch"]
    return changes.states


register(KindSpec("membership.add", "member", _decide_add, _evolve_add, compare_and_set=True))
register(KindSpec("membership.change", "member", _decide_change, _evolve_change, compare_and_set=True))
register(KindSpec("membership.remove", "member", _decide_remove, _evolve_remove, compare_and_set=True))
register(
    KindSpec("session.replace", "member", _decide_session_replace, _evolve_session_replace, roles=ALL_ROLES)
)
