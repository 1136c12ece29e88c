"""Approval kinds: ``approval.request`` (worker) and ``approval.decide`` (approver, compare-and-set).

An Approval is the aggregate ``approval:<id>`` (the id is chosen by the requester)::

    workitem        the WorkItem the operation belongs to
    operation       the operation's name, e.g. "submit" or "publish"
    state           pending | approved | rejected
    requested_by    agent id;  requested_at_ms
    decided_by      agent id or None;  decided_at_ms  int or None
    reason          the requester's reason;  decision_reason  the approver's

A Mission lists in ``approval_required`` the operations that need one. The engine enforces it for
``workitem.submit`` ("submit") and ``workitem.publish`` ("publish"): the Command names an approved
Approval of that operation on that WorkItem in ``body.approval``, else ``APPROVAL_REQUIRED``.
Other operation names are recorded the same way for agents to check before their own side effects.
"""

from __future__ import annotations

from typing import Any

from . import canonical
from .errors import AlreadyExists, ApprovalRequired, InvalidCommand, InvalidState, NotFound
from .kinds import OPERATION_CHARS_MAX, body_str, check_unknown_fields
from .leases import workitem_key
from .messages import Command, Event
from .registry import Context, Decision, KindSpec, StateView, aggregate_key, register

APPROVAL_DECISIONS = ("approved", "rejected")


def approval_key(approval_id: str) -> str:
    return aggregate_key("approval", approval_id)


def require_approval(
    view: StateView, mission: dict[str, Any], workitem_id: str, operation: str, approval_id: str | None
) -> None:
    """Raise ``ApprovalRequired`` unless the Mission does not ask for one or ``approval_id`` grants it."""
    if operation not in mission["approval_required"]:
        return
    if approval_id is None:
        raise ApprovalRequired(
            f"the Mission requires an approved Approval for {operation!r}: request one with approval.request "
            "and name it in body.approval",
            operation=operation,
        )
    approval = view.get(approval_key(approval_id))
    if approval is None or approval["workitem"] != workitem_id or approval["operation"] != operation:
        raise ApprovalRequired(
            f"approval {approval_id!r} is not an Approval of {operation!r} on {workitem_id!r}",
            operation=operation,
            approval=approval_id,
        )
    if approval["state"] != "approved":
        raise ApprovalRequired(
            f"approval {approval_id!r} is {approval['state']}, not approved",
            operation=operation,
            approval=approval_id,
            approval_state=approval["state"],
        )


def _decide_request(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"workitem", "operation", "reason"})
    workitem = body_str(command, "workitem")
    assert workitem is not None
    canonical.check_id(workitem, "body.workitem")
    operation = body_str(command, "operation", max_chars=OPERATION_CHARS_MAX)
    reason = body_str(command, "reason", required=False) or ""
    if view.get(approval_key(command.target)) is not None:
        raise AlreadyExists(f"approval {command.target!r} already exists", field="target")
    if view.get(workitem_key(workitem)) is None:
        raise NotFound(f"workitem {workitem!r} does not exist", field="body.workitem")
    return Decision({"workitem": workitem, "operation": operation, "reason": reason})


def _evolve_request(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    return {
        event.aggregate: {
            "workitem": body["workitem"],
            "operation": body["operation"],
            "state": "pending",
            "requested_by": event.actor,
            "requested_at_ms": event.accepted_at_ms,
            "reason": body["reason"],
            "decided_by": None,
            "decided_at_ms": None,
            "decision_reason": None,
        }
    }


def _decide_decide(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"decision", "reason"})
    decision = command.body.get("decision")
    if decision not in APPROVAL_DECISIONS:
        raise InvalidCommand("body.decision must be 'approved' or 'rejected'", field="body.decision")
    reason = body_str(command, "reason", required=False) or ""
    approval = view.get(approval_key(command.target))
    if approval is None:
        raise NotFound(f"approval {command.target!r} does not exist", field="target")
    if approval["state"] != "pending":
        raise InvalidState(f"approval {command.target!r} is already {approval['state']}", state=approval["state"])
    return Decision({"decision": decision, "reason": reason})


def _evolve_decide(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    approval = dict(view.get(event.aggregate) or {})
    approval["state"] = body["decision"]
    approval["decided_by"] = event.actor
    approval["decided_at_ms"] = event.accepted_at_ms
    approval["decision_reason"] = body["reason"]
    return {event.aggregate: approval}


register(KindSpec("approval.request", "approval", _decide_request, _evolve_request, roles=frozenset({"worker"})))
register(
    KindSpec(
        "approval.decide", "approval", _decide_decide, _evolve_decide, roles=frozenset({"approver"}), compare_and_set=True
    )
)
