"""Group and Mission kinds: ``group.create``, ``group.archive``, ``mission.create|update|close``.

Pure decide/evolve pairs (see ``registry``). ``decide`` validates the body and the current state and
returns the Event payload; ``evolve`` returns new state dicts (it never mutates what it reads).
"""

from __future__ import annotations

from typing import Any

from . import canonical
from .errors import AlreadyExists, InvalidCommand, InvalidState, NotFound
from .messages import Command, Event
from .registry import (
    Context,
    Decision,
    KindSpec,
    StateView,
    aggregate_key,
    group_key,
    member_key,
    public_key_is_usable,
    register,
)


OPERATION_CHARS_MAX = 128  # an Approval's operation name, and each name a Mission's approval_required lists


def body_str(command: Command, name: str, *, required: bool = True, max_chars: int = 1024) -> str | None:
    value = command.body.get(name)
    if value is None and not required:
        return None
    if type(value) is not str or not value or len(value) > max_chars:
        raise InvalidCommand(f"body.{name} must be a non-empty string of at most {max_chars} characters", field=f"body.{name}")
    return value


def body_int(command: Command, name: str, *, required: bool = True, minimum: int = 0, default: int | None = None) -> int | None:
    value = command.body.get(name, default)
    if value is None and not required:
        return None
    if type(value) is not int or value < minimum:
        raise InvalidCommand(f"body.{name} must be an integer >= {minimum}", field=f"body.{name}")
    return value


def body_str_list(command: Command, name: str, *, max_chars: int) -> list[str]:
    value = command.body.get(name, [])
    # A loop, not any() over a generator: mission.create calls this for every Mission, most often
    # with no list, and the generator (a closure over max_chars) cost more than the check itself.
    if type(value) is list:
        for item in value:
            if type(item) is not str or not item or len(item) > max_chars:
                break
        else:
            return sorted(set(value))
    raise InvalidCommand(
        f"body.{name} must be a list of non-empty strings of at most {max_chars} characters", field=f"body.{name}"
    )


def check_unknown_fields(command: Command, allowed: set[str]) -> None:
    if allowed.issuperset(command.body):
        return
    unknown = set(command.body) - allowed
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidCommand(f"body.{name} is not a field of {command.kind}", field=f"body.{name}")


# -- group.create ---------------------------------------------------------------------------------

_GROUP_POLICY_FIELDS = {"replay_window_events", "audit_retention_days"}
"""``replay_window_events``: online replay keeps at least this many recent Events (0: all);
``audit_retention_days``: how long an archived Group's audit log is kept (0: forever)."""


def _decide_group_create(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"org", "policy", "public_key"})
    if command.target != command.group:
        raise InvalidCommand("group.create must target the Group itself", field="target")
    if view.get(group_key(command.group)) is not None:
        raise AlreadyExists(f"group {command.group!r} already exists", field="group")
    org = body_str(command, "org")
    canonical.check_id(org, "body.org")
    policy = command.body.get("policy", {})
    if type(policy) is not dict or set(policy) - _GROUP_POLICY_FIELDS:
        raise InvalidCommand(f"body.policy may hold only {sorted(_GROUP_POLICY_FIELDS)}", field="body.policy")
    for name, value in policy.items():
        if type(value) is not int or value < 0:
            raise InvalidCommand(f"body.policy.{name} must be a non-negative integer", field=f"body.policy.{name}")
    body: dict[str, Any] = {"org": org, "policy": dict(sorted(policy.items()))}
    public_key = command.body.get("public_key")
    if public_key is not None:
        body["public_key"] = check_public_key_hex(public_key)
    return Decision(body)


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def check_public_key_hex(value: object) -> str:
    """Check a member's Ed25519 public key given as hex; return it in lowercase.

    Exactly 64 hex digits (either case; nothing else, not even whitespace, which
    ``bytes.fromhex`` would skip), encoding a point that can authenticate signatures: the
    canonical encoding of a curve point of order greater than 8 (see
    ``registry.public_key_is_usable``).
    """
    if type(value) is not str or len(value) != 64 or not _HEX_DIGITS.issuperset(value):
        raise InvalidCommand("a public key is 32 bytes as 64 hex digits (0-9, a-f)", field="body.public_key")
    if not public_key_is_usable(bytes.fromhex(value)):
        raise InvalidCommand(
            "the public key is not usable: it must be the canonical encoding of an Ed25519 curve point of "
            "order greater than 8 (a small-order key would accept forged signatures)",
            field="body.public_key",
        )
    return value.lower()


def _evolve_group_create(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    member: dict[str, Any] = {
        "role": "owner",
        "session_epoch": 1,
        "status": "active",
        "leases": [],
    }
    if "public_key" in body:
        member["public_key"] = body["public_key"]
    return {
        group_key(event.group): {
            "org": body["org"],
            "status": "active",
            "policy": body["policy"],
            "created_at_ms": event.accepted_at_ms,
        },
        member_key(event.actor): member,
    }


# -- group.archive --------------------------------------------------------------------------------


def _decide_group_archive(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason"})
    if command.target != command.group:
        raise InvalidCommand("group.archive must target the Group itself", field="target")
    reason = body_str(command, "reason", required=False) or ""
    return Decision({"reason": reason})


def _evolve_group_archive(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    key = group_key(event.group)
    state = dict(view.get(key) or {})
    state["status"] = "archived"
    state["archived_at_ms"] = event.accepted_at_ms
    return {key: state}


# -- missions -------------------------------------------------------------------------------------


def mission_key(mission: str) -> str:
    return aggregate_key("mission", mission)


def _mission_fields(command: Command, *, creating: bool) -> dict[str, Any]:
    check_unknown_fields(command, {"title", "cost_limit", "approval_required"})
    fields: dict[str, Any] = {}
    if creating or "title" in command.body:
        fields["title"] = body_str(command, "title")
    if creating or "cost_limit" in command.body:
        fields["cost_limit"] = body_int(command, "cost_limit", default=None if not creating else 0)
    if creating or "approval_required" in command.body:
        # at most what approval.request takes as an operation: a longer name could never be approved
        fields["approval_required"] = body_str_list(command, "approval_required", max_chars=OPERATION_CHARS_MAX)
    return fields


def _decide_mission_create(view: StateView, command: Command, context: Context) -> Decision:
    if view.get(mission_key(command.target)) is not None:
        raise AlreadyExists(f"mission {command.target!r} already exists", field="target")
    return Decision(_mission_fields(command, creating=True))


def _evolve_mission_create(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    return {
        event.aggregate: {
            "title": body["title"],
            "cost_limit": body["cost_limit"],
            "cost_spent": 0,
            "approval_required": body["approval_required"],
            "status": "open",
        }
    }


def open_mission(view: StateView, mission: str) -> dict[str, Any]:
    state = view.get(mission_key(mission))
    if state is None:
        raise NotFound(f"mission {mission!r} does not exist", field="target")
    if state["status"] != "open":
        raise InvalidState(f"mission {mission!r} is {state['status']}", state=state["status"])
    return state


def _decide_mission_update(view: StateView, command: Command, context: Context) -> Decision:
    state = open_mission(view, command.target)
    fields = _mission_fields(command, creating=False)
    if not fields:
        raise InvalidCommand("mission.update needs at least one of title, cost_limit, approval_required", field="body")
    if "cost_limit" in fields and fields["cost_limit"] < state["cost_spent"]:
        raise InvalidCommand("cost_limit cannot drop below what the mission already spent", field="body.cost_limit")
    return Decision(fields)


def _evolve_mission_update(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    state = dict(view.get(event.aggregate) or {})
    state.update(event.body or {})
    return {event.aggregate: state}


def _decide_mission_close(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason"})
    open_mission(view, command.target)
    return Decision({"reason": body_str(command, "reason", required=False) or ""})


def _evolve_mission_close(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    state = dict(view.get(event.aggregate) or {})
    state["status"] = "closed"
    return {event.aggregate: state}


register(
    KindSpec(
        "group.create", "group", _decide_group_create, _evolve_group_create, roles=None, creates_group=True
    )
)
register(KindSpec("group.archive", "group", _decide_group_archive, _evolve_group_archive))
register(KindSpec("mission.create", "mission", _decide_mission_create, _evolve_mission_create))
register(
    KindSpec("mission.update", "mission", _decide_mission_update, _evolve_mission_update, compare_and_set=True)
)
register(KindSpec("mission.close", "mission", _decide_mission_close, _evolve_mission_close))
