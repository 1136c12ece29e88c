"""Tombstones (MWP-MSN-009): ``event.redact`` and ``audit.delete`` as accepted, auditable transitions.

Both are pure decide/evolve pairs like every other kind; the engine does the physical work.

``event.redact`` (owner; target = the redacted sequence as a decimal string; body ``{reason}``, and
    optionally ``seq``, which must then equal the target) records a tombstone for an earlier Event of
    the Group: aggregate ``tombstone:<seq>`` with the redacted Event's ID and sequence, the reason,
    the actor and the time, and a count ``tombstones`` in the Group's state (so readers know whether
    any tombstone must be applied). The Event's payload is ``{seq, reason}``. The redacted Event keeps
    its ID, sequence and hash; the engine removes its payload from every read (``body`` None, the
    payload hash kept, so the hash chain still verifies) and compaction removes it physically. A
    sequence is redacted at most once (``ALREADY_EXISTS``).

    What ``decide`` cannot see, the engine checks before accepting (it knows the log):
    ``seq`` names an accepted Event (``1 ≤ seq ≤ head``), and that Event is not itself a tombstone
    (``event.redact`` or ``audit.delete``: the record of a deletion is never deleted).

``audit.delete`` (owner; target = the Group; body ``{reason, basis}``, both optional: reason "",
    basis "retention") records that an archived Group's encrypted audit log is deleted: ``basis``
    ``"retention"`` requires the Organization's
    retention (``policy.audit_retention_days`` > 0) to have expired since ``archived_at_ms``;
    ``"legal"`` is a legal deletion, allowed at any time and recorded as such. The engine deletes
    the file (or its Organization key) only after this Event is durable.
"""

from __future__ import annotations

from typing import Any

from .errors import AlreadyExists, InvalidCommand, InvalidState
from .kinds import body_str, check_unknown_fields
from .leases import time_after
from .messages import Command, Event, make_event_id
from .registry import Context, Decision, KindSpec, StateView, aggregate_key, group_key, register

REASON_CHARS_MAX = 1024
DAY_MS = 86_400_000
TOMBSTONE_KINDS = frozenset({"event.redact", "audit.delete"})
"""Kinds whose Events must never be redacted themselves (the engine enforces it)."""
DELETE_BASES = ("legal", "retention")


def tombstone_key(seq: int) -> str:
    return aggregate_key("tombstone", str(seq))


# -- event.redact -----------------------------------------------------------------------------------


def _redacted_seq(command: Command) -> int:
    target = command.target
    if not target.isdigit() or target.startswith("0") or len(target) > 19:
        raise InvalidCommand("event.redact targets the redacted sequence, e.g. target '17'", field="target")
    seq = int(target)
    if "seq" in command.body and (type(command.body["seq"]) is not int or command.body["seq"] != seq):
        raise InvalidCommand("body.seq must equal the target sequence", field="body.seq")
    return seq


def _decide_event_redact(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"seq", "reason"})
    seq = _redacted_seq(command)
    reason = body_str(command, "reason", max_chars=REASON_CHARS_MAX)
    if context.seq and seq >= context.seq:
        raise InvalidCommand(f"there is no Event {seq} to redact: the Group's next sequence is {context.seq}", field="target")
    if view.get(tombstone_key(seq)) is not None:
        raise AlreadyExists(f"Event {seq} of group {command.group!r} is already redacted", field="body.seq", seq=seq)
    return Decision({"seq": seq, "reason": reason})


def _evolve_event_redact(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    seq = body["seq"]
    group = dict(view.get(group_key(event.group)) or {})
    group["tombstones"] = int(group.get("tombstones", 0)) + 1
    return {
        group_key(event.group): group,
        tombstone_key(seq): {
            "event_id": make_event_id(event.group, seq),
            "seq": seq,
            "reason": body["reason"],
            "actor": event.actor,
            "redacted_at_ms": event.accepted_at_ms,
            "tombstone_seq": event.seq,
        }
    }


def redacted_sequences(view_items: Any) -> list[int]:
    """Sorted redacted sequences from ``(key, revision, state)`` triples (e.g. snapshot aggregates)."""
    out = []
    for item in view_items:
        key, _, state = item if isinstance(item, tuple) else (item.aggregate, item.revision, item.state)
        if key.startswith("tombstone:") and state is not None:
            out.append(int(state["seq"]))
    return sorted(out)


# -- audit.delete ------------------------------------------------------------------------------------


def _decide_audit_delete(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason", "basis"})
    if command.target != command.group:
        raise InvalidCommand("audit.delete must target the Group itself", field="target")
    reason = body_str(command, "reason", required=False, max_chars=REASON_CHARS_MAX) or ""
    basis = command.body.get("basis", "retention")
    if basis not in DELETE_BASES:
        raise InvalidCommand(f"body.basis must be one of {list(DELETE_BASES)}", field="body.basis")
    group = view.get(group_key(command.group)) or {}
    if group.get("status") != "archived":
        raise InvalidState("only an archived Group's audit log can be deleted", state=group.get("status"))
    if group.get("audit_log") == "deleted":
        raise InvalidState("the audit log is already deleted", state="deleted")
    if basis == "retention":
        days = int(group.get("policy", {}).get("audit_retention_days", 0))
        if days <= 0:
            raise InvalidState("the Organization keeps this audit log forever (audit_retention_days 0)", state="retained")
        # saturated as lease times are (leases.time_after): the policy's days are any non-negative
        # integer, and an end past 2**63 - 1 would make the rejection's detail unencodable
        expires_ms = time_after(int(group.get("archived_at_ms", 0)), days * DAY_MS)
        if context.now_ms < expires_ms:
            raise InvalidState(
                f"the audit log is retained until {expires_ms} (ms since the epoch)", state="retained", expires_ms=expires_ms
            )
    return Decision({"reason": reason, "basis": basis})


def _evolve_audit_delete(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    key = group_key(event.group)
    state = dict(view.get(key) or {})
    body = event.body or {}
    state["audit_log"] = "deleted"
    state["audit_deleted_at_ms"] = event.accepted_at_ms
    state["audit_deleted_basis"] = body["basis"]
    return {key: state}


EVENT_REDACT = register(KindSpec("event.redact", "tombstone", _decide_event_redact, _evolve_event_redact))
AUDIT_DELETE = register(
    KindSpec("audit.delete", "group", _decide_audit_delete, _evolve_audit_delete, allowed_when_archived=True)
)

__all__ = [
    "AUDIT_DELETE",
    "DELETE_BASES",
    "EVENT_REDACT",
    "TOMBSTONE_KINDS",
    "redacted_sequences",
    "tombstone_key",
]
