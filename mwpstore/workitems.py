"""WorkItem kinds: create, claim, start, renew, checkpoint, publish, block, resolve, submit, fail,
reassign, cancel, charge, and the engine's ``lease.expire`` sweep.

A WorkItem is the aggregate ``workitem:<id>``. Its state is read by other components (the
AgentStore's work queue), so the field names are an interface; see ``docs/work-model.md``::

    mission              Mission id
    state                queued | leased | blocked | submitted | failed | cancelled
    priority             int, higher first
    not_before_ms        int: not claimable before this time (backoff, scheduling)
    attempt              int: claims so far (each claim is one attempt)
    ownership_epoch      int: raised by every claim; 0 before the first
    lease                the current Execution Lease (see ``leases``) or None
    checkpoint           the latest checkpoint (JSON-like) or None
    required_resolution  str while blocked, else None
    cost_spent           int cost units charged so far
    contract             the Work Contract (see ``contracts``)
    publications         int: publications accepted so far
    submission           {result, lease_id, ownership_epoch, attempt, agent, submitted_at_ms} or None
    progress             the latest progress reported with a charge, or None
    failure              the reason of the latest failure, or None
    created_at_ms        acceptance time of workitem.create

``state == "leased"`` exactly when ``lease`` is not None. Results (checkpoint, publish, block,
submit, fail, charge) must name the current live lease; one that names an earlier lease is kept as
Evidence: its own Event with ``authoritative=False`` and ``body.evidence`` saying why, and no state
change (MWP-WRK-013, MWP-WRK-019).
"""

from __future__ import annotations

from typing import Any

from . import canonical, limits
from .approvals import require_approval
from .contracts import backoff_ms, parse_contract
from .errors import (
    AlreadyExists,
    AttemptsExhausted,
    BudgetExceeded,
    DeadlinePassed,
    InvalidCommand,
    InvalidState,
    LeaseMismatch,
    NotFound,
    NotReady,
    StaleSessionEpoch,
)
from .kinds import body_int, body_str, check_unknown_fields, mission_key
from .leases import (
    Changes,
    drop_lease,
    fence_result,
    grant_lease,
    lapse_reason,
    lease_is_live,
    named_lease,
    new_lease,
    require_held_lease,
    require_state,
    time_after,
    workitem_id_of,
    workitem_key,
)
from .messages import Command, Event
from .registry import Context, Decision, KindSpec, StateView, register
from .work_keys import attempt_key

WORKER = frozenset({"worker"})
OWNER = frozenset({"owner"})

LEASE_FIELDS = {"lease_id", "ownership_epoch"}


def _workitem(view: StateView, workitem_id: str) -> dict[str, Any]:
    item = view.get(workitem_key(workitem_id))
    if item is None:
        raise NotFound(f"workitem {workitem_id!r} does not exist", field="target")
    return item


def _required_content(command: Command, name: str) -> Any:
    value = command.body.get(name)
    if value is None:
        raise InvalidCommand(f"body.{name} is required (any JSON-like value but null)", field=f"body.{name}")
    return value


def _optional_id(command: Command, name: str) -> str | None:
    value = command.body.get(name)
    if value is None:
        return None
    return canonical.check_id(value, f"body.{name}")


def _reason(command: Command) -> str:
    return body_str(command, "reason", required=False) or ""


def _result(
    view: StateView, command: Command, context: Context, body: dict[str, Any]
) -> tuple[dict[str, Any], Decision | None]:
    """Fence a result Command whose ``body`` is already validated.

    Returns the WorkItem and, when the Command names a lease that is no longer current, the
    Evidence decision to return as is.
    """
    item = _workitem(view, command.target)
    lease_id, epoch = named_lease(context.group, command.target, command.body)
    body["lease_id"] = lease_id
    body["ownership_epoch"] = epoch
    reason = fence_result(item, actor=command.actor, ownership_epoch=epoch, now_ms=context.now_ms)
    if reason is None:
        return item, None
    current = item["lease"]
    evidence = dict(body)
    evidence["evidence"] = {
        "reason": reason,
        "current_ownership_epoch": item["ownership_epoch"],
        "current_lease_id": None if current is None else current["lease_id"],
    }
    return item, Decision(evidence, authoritative=False)


# -- workitem.create ----------------------------------------------------------------------------


def _decide_create(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"mission", "priority", "contract", "not_before_ms"})
    mission_id = body_str(command, "mission")
    assert mission_id is not None
    canonical.check_id(mission_id, "body.mission")
    priority = body_int(command, "priority", minimum=-limits.INT_ABS_MAX, default=0)
    not_before = body_int(command, "not_before_ms", default=0)
    contract = parse_contract(command.body.get("contract"))
    if view.get(workitem_key(command.target)) is not None:
        raise AlreadyExists(f"workitem {command.target!r} already exists", field="target")
    mission = view.get(mission_key(mission_id))
    if mission is None:
        raise NotFound(f"mission {mission_id!r} does not exist", field="body.mission")
    if mission["status"] != "open":
        raise InvalidState(f"mission {mission_id!r} is {mission['status']}", state=mission["status"])
    deadline_ms = contract["deadline_ms"]
    if deadline_ms is not None and deadline_ms <= context.now_ms:
        raise DeadlinePassed("body.contract.deadline_ms is already past", field="body.contract.deadline_ms")
    if deadline_ms is not None and not_before >= deadline_ms:
        # no claim at or after the deadline: work first ready then could never be claimed (the
        # rule retry_outcome applies to a failure's retry)
        raise DeadlinePassed(
            f"body.not_before_ms ({not_before}) is not before the deadline ({deadline_ms}): no claim could take it",
            field="body.not_before_ms",
            deadline_ms=deadline_ms,
        )
    return Decision({"mission": mission_id, "priority": priority, "not_before_ms": not_before, "contract": contract})


def _evolve_create(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    return {
        event.aggregate: {
            "mission": body["mission"],
            "state": "queued",
            "priority": body["priority"],
            "not_before_ms": body["not_before_ms"],
            "attempt": 0,
            "ownership_epoch": 0,
            "lease": None,
            "checkpoint": None,
            "required_resolution": None,
            "cost_spent": 0,
            "contract": body["contract"],
            "publications": 0,
            "submission": None,
            "progress": None,
            "failure": None,
            "created_at_ms": event.accepted_at_ms,
        }
    }


# -- what ends a WorkItem's chances (claim, failure, and the AgentStore's work queue) -----------


def attempts_used_up(item: dict[str, Any]) -> bool:
    """Every attempt the Work Contract allows is used (each claim is one)."""
    attempt, most = item.get("attempt"), _contract_field(item, "max_attempts")
    return type(attempt) is int and type(most) is int and attempt >= most


def budget_spent(item: dict[str, Any]) -> bool:
    """The WorkItem's cost budget is spent (``cost_spent >= cost_limit``)."""
    spent, limit = item.get("cost_spent"), _contract_field(item, "cost_limit")
    return type(spent) is int and type(limit) is int and spent >= limit


def deadline_passed(item: dict[str, Any], now_ms: int) -> bool:
    """The Work Contract's deadline, if it has one, is at or before ``now_ms``."""
    deadline_ms = _contract_field(item, "deadline_ms")
    return type(deadline_ms) is int and now_ms >= deadline_ms


def claim_refused(item: dict[str, Any], now_ms: int) -> bool:
    """Whether any claim of ``item`` at ``now_ms`` is refused whoever makes it: deadline passed,
    attempts used up, budget spent (``_decide_claim``'s checks on the WorkItem alone). Used by the
    AgentStore's work queue on mirrored states, so a field that is missing or not an int proves
    nothing (False); the authority's states always have them."""
    return deadline_passed(item, now_ms) or attempts_used_up(item) or budget_spent(item)


def _contract_field(item: dict[str, Any], name: str) -> Any:
    contract = item.get("contract")
    return contract.get(name) if type(contract) is dict else None


# -- workitem.claim (compare-and-set: first ownership) ------------------------------------------


def _decide_claim(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"session_epoch"})
    session_epoch = body_int(command, "session_epoch", minimum=1)
    assert session_epoch is not None
    item = _workitem(view, command.target)
    member = context.member
    assert member is not None
    if session_epoch != member["session_epoch"]:
        raise StaleSessionEpoch(
            f"session epoch {session_epoch} is not your current one ({member['session_epoch']})",
            current_session_epoch=member["session_epoch"],
        )
    now = context.now_ms
    previous = item["lease"]
    if item["state"] == "leased":
        assert previous is not None
        if lease_is_live(previous, now):
            raise InvalidState(
                "the WorkItem is leased and its lease is live; claim it after the lease lapses", state="leased"
            )
    else:
        require_state(item, ("queued",), command.kind)
    mission = view.get(mission_key(item["mission"]))
    if mission is None or mission["status"] != "open":
        raise InvalidState(f"mission {item['mission']!r} is not open", state="mission_closed")
    contract = item["contract"]
    if deadline_passed(item, now):
        raise DeadlinePassed(
            f"the WorkItem's deadline ({contract['deadline_ms']}) has passed", deadline_ms=contract["deadline_ms"]
        )
    if attempts_used_up(item):
        raise AttemptsExhausted(
            f"all {contract['max_attempts']} attempts are used", attempt=item["attempt"]
        )
    if budget_spent(item):
        raise BudgetExceeded("the WorkItem's cost budget is spent", scope="workitem", cost_spent=item["cost_spent"])
    if now < item["not_before_ms"]:
        raise NotReady(f"the WorkItem is not ready before {item['not_before_ms']}", not_before_ms=item["not_before_ms"])
    epoch = item["ownership_epoch"] + 1
    attempt = item["attempt"] + 1
    lease = new_lease(
        context.group,
        command.target,
        agent=command.actor,
        session_epoch=session_epoch,
        ownership_epoch=epoch,
        now_ms=now,
        contract=contract,
    )
    return Decision(
        {
            "session_epoch": session_epoch,
            "ownership_epoch": epoch,
            "attempt": attempt,
            "attempt_key": attempt_key(item["mission"], command.target, attempt),
            "lease": lease,
            "replaced_lease_id": None if previous is None else previous["lease_id"],
        }
    )


def _evolve_claim(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = grant_lease(changes, workitem_id_of(event.aggregate), body["lease"])
    item["state"] = "leased"
    item["ownership_epoch"] = body["ownership_epoch"]
    item["attempt"] = body["attempt"]
    return changes.states


# -- workitem.start and lease.renew (rejected, not Evidence, when the lease is not current) -----


def _decide_start(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS)
    item = _workitem(view, command.target)
    lease_id, epoch = named_lease(context.group, command.target, command.body)
    lease = require_held_lease(item, actor=command.actor, ownership_epoch=epoch, now_ms=context.now_ms)
    if lease["started"]:
        raise InvalidState("the lease is already started", state="started")
    return Decision({"lease_id": lease_id, "ownership_epoch": epoch})


def _evolve_start(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    item = dict(view.get(event.aggregate) or {})
    item["lease"] = {**item["lease"], "started": True}
    return {event.aggregate: item}


def _decide_renew(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS)
    item = _workitem(view, command.target)
    lease_id, epoch = named_lease(context.group, command.target, command.body)
    require_held_lease(item, actor=command.actor, ownership_epoch=epoch, now_ms=context.now_ms)
    expires_at = time_after(context.now_ms, item["contract"]["lease_ms"])
    return Decision({"lease_id": lease_id, "ownership_epoch": epoch, "expires_at_ms": expires_at})


def _evolve_renew(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    item = dict(view.get(event.aggregate) or {})
    item["lease"] = {**item["lease"], "expires_at_ms": body["expires_at_ms"]}
    return {event.aggregate: item}


# -- Results under the lease: checkpoint, publish, block, submit, fail, charge -----------------


def _decide_checkpoint(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS | {"checkpoint"})
    body = {"checkpoint": _required_content(command, "checkpoint")}
    _, evidence = _result(view, command, context, body)
    return evidence or Decision(body)


def _evolve_checkpoint(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # released: resumable from the checkpoint
    item["state"] = "queued"
    item["not_before_ms"] = event.accepted_at_ms
    item["checkpoint"] = body["checkpoint"]
    return changes.states


def _gated_result(
    view: StateView, command: Command, context: Context, field: str, operation: str
) -> tuple[dict[str, Any], dict[str, Any], Decision | None]:
    """A result (``publish``/``submit``) that the Mission may gate behind an approved Approval.

    Returns the WorkItem, the Event body so far and, when the named lease is not current, the
    Evidence decision to return as is; raises ``APPROVAL_REQUIRED`` when the gate is closed.
    """
    check_unknown_fields(command, LEASE_FIELDS | {field, "approval"})
    body: dict[str, Any] = {field: _required_content(command, field)}
    approval = _optional_id(command, "approval")
    if approval is not None:
        body["approval"] = approval
    item, evidence = _result(view, command, context, body)
    if evidence is None:
        mission = view.get(mission_key(item["mission"]))
        assert mission is not None
        require_approval(view, mission, command.target, operation, approval)
    return item, body, evidence


def _decide_publish(view: StateView, command: Command, context: Context) -> Decision:
    item, body, evidence = _gated_result(view, command, context, "publication", "publish")
    if evidence is not None:
        return evidence
    body["publication_number"] = item["publications"] + 1
    return Decision(body)


def _evolve_publish(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    item = dict(view.get(event.aggregate) or {})
    item["publications"] = item["publications"] + 1
    return {event.aggregate: item}


def _decide_block(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS | {"checkpoint", "required_resolution"})
    body = {
        "checkpoint": _required_content(command, "checkpoint"),
        "required_resolution": body_str(command, "required_resolution", max_chars=4096),
    }
    _, evidence = _result(view, command, context, body)
    return evidence or Decision(body)


def _evolve_block(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # released: the slot is free
    item["state"] = "blocked"
    item["checkpoint"] = body["checkpoint"]
    item["required_resolution"] = body["required_resolution"]
    return changes.states


def _decide_submit(view: StateView, command: Command, context: Context) -> Decision:
    item, body, evidence = _gated_result(view, command, context, "submission", "submit")
    if evidence is not None:
        return evidence
    body["attempt"] = item["attempt"]
    return Decision(body)


def _evolve_submit(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # released
    item["state"] = "submitted"
    item["submission"] = {
        "result": body["submission"],
        "lease_id": body["lease_id"],
        "ownership_epoch": body["ownership_epoch"],
        "attempt": body["attempt"],
        "agent": event.actor,
        "submitted_at_ms": event.accepted_at_ms,
    }
    return changes.states


def retry_outcome(item: dict[str, Any], now_ms: int, *, retryable: bool = True) -> tuple[str, int | None]:
    """What a failure of the current attempt leads to: ("queued", not_before_ms) or ("failed", None).

    Queued again only while the Work Contract allows another try: an attempt left, cost budget
    left, and the retry's not-before time still before the deadline (MWP-WRK-018).
    """
    contract = item["contract"]
    if not retryable or attempts_used_up(item) or budget_spent(item):
        return "failed", None
    not_before = time_after(now_ms, backoff_ms(contract, max(item["attempt"], 1)))
    if contract["deadline_ms"] is not None and not_before >= contract["deadline_ms"]:
        return "failed", None
    return "queued", not_before


def _decide_fail(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS | {"reason", "retryable"})
    retryable = command.body.get("retryable", True)
    if type(retryable) is not bool:
        raise InvalidCommand("body.retryable must be true or false", field="body.retryable")
    body: dict[str, Any] = {"reason": body_str(command, "reason", max_chars=4096), "retryable": retryable}
    item, evidence = _result(view, command, context, body)
    if evidence is not None:
        return evidence
    outcome, not_before = retry_outcome(item, context.now_ms, retryable=retryable)
    body["attempt"] = item["attempt"]
    body["attempt_key"] = attempt_key(item["mission"], command.target, item["attempt"])
    body["outcome"] = outcome
    body["not_before_ms"] = not_before
    return Decision(body)


def _evolve_fail(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # revoked
    item["state"] = body["outcome"]
    item["failure"] = body["reason"]
    if body["outcome"] == "queued":
        item["not_before_ms"] = body["not_before_ms"]
    return changes.states


def _decide_charge(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, LEASE_FIELDS | {"cost", "progress"})
    body: dict[str, Any] = {"cost": body_int(command, "cost"), "progress": command.body.get("progress")}
    item, evidence = _result(view, command, context, body)
    if evidence is not None:
        return evidence
    cost = body["cost"]
    limit = item["contract"]["cost_limit"]
    if item["cost_spent"] + cost > limit:
        raise BudgetExceeded(
            f"charging {cost} would take the WorkItem to {item['cost_spent'] + cost}, over its limit {limit}; "
            "nothing was recorded",
            scope="workitem",
            cost_spent=item["cost_spent"],
            cost_limit=limit,
        )
    mission = view.get(mission_key(item["mission"]))
    assert mission is not None
    if mission["cost_spent"] + cost > mission["cost_limit"]:
        raise BudgetExceeded(
            f"charging {cost} would take mission {item['mission']!r} to {mission['cost_spent'] + cost}, over its "
            f"limit {mission['cost_limit']}; nothing was recorded",
            scope="mission",
            cost_spent=mission["cost_spent"],
            cost_limit=mission["cost_limit"],
        )
    return Decision(body)


def _evolve_charge(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    body = event.body or {}
    changes = Changes(view)
    item = changes.edit(event.aggregate)
    assert item is not None
    item["cost_spent"] = item["cost_spent"] + body["cost"]
    if body["progress"] is not None:
        item["progress"] = body["progress"]
    mission = changes.edit(mission_key(item["mission"]))
    assert mission is not None
    mission["cost_spent"] = mission["cost_spent"] + body["cost"]
    return changes.states


# -- Owner transitions: resolve, reassign, cancel -----------------------------------------------


def _decide_resolve(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"resolution"})
    resolution = body_str(command, "resolution", required=False, max_chars=4096) or ""
    item = _workitem(view, command.target)
    require_state(item, ("blocked",), command.kind)
    return Decision({"resolution": resolution, "required_resolution": item["required_resolution"]})


def _evolve_resolve(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    item = dict(view.get(event.aggregate) or {})
    item["state"] = "queued"
    item["not_before_ms"] = event.accepted_at_ms
    item["required_resolution"] = None
    return {event.aggregate: item}


def _revoked(item: dict[str, Any]) -> dict[str, Any] | None:
    lease = item["lease"]
    return None if lease is None else {"lease_id": lease["lease_id"], "agent": lease["agent"]}


def _decide_reassign(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason"})
    reason = _reason(command)
    item = _workitem(view, command.target)
    require_state(item, ("leased",), command.kind)
    return Decision({"reason": reason, "revoked_lease": _revoked(item)})


def _evolve_reassign(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # revoked
    item["state"] = "queued"
    item["not_before_ms"] = event.accepted_at_ms
    return changes.states


def _decide_cancel(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"reason"})
    reason = _reason(command)
    item = _workitem(view, command.target)
    require_state(item, ("queued", "leased", "blocked"), command.kind)
    return Decision({"reason": reason, "revoked_lease": _revoked(item)})


def _evolve_cancel(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))  # revoked
    item["state"] = "cancelled"
    return changes.states


# -- lease.expire (the engine's sweep) -----------------------------------------------------------


def _decide_expire(view: StateView, command: Command, context: Context) -> Decision:
    check_unknown_fields(command, {"lease_id"})
    named = command.body.get("lease_id")
    if named is not None and (type(named) is not str or not named):
        raise InvalidCommand("body.lease_id must be a lease id string", field="body.lease_id")
    item = _workitem(view, command.target)
    lease = item["lease"]
    if lease is None:
        raise InvalidState("the WorkItem holds no lease", state=item["state"])
    if named is not None and named != lease["lease_id"]:
        raise LeaseMismatch("the named lease is no longer the WorkItem's lease", current_lease_id=lease["lease_id"])
    reason = lapse_reason(lease, context.now_ms)
    if reason is None:
        raise InvalidState("the lease is live; nothing to expire", state="leased")
    return Decision(
        {
            "lease_id": lease["lease_id"],
            "agent": lease["agent"],
            "ownership_epoch": lease["ownership_epoch"],
            "reason": reason,
        }
    )


def _evolve_expire(view: StateView, event: Event) -> dict[str, dict[str, Any] | None]:
    changes = Changes(view)
    item = drop_lease(changes, workitem_id_of(event.aggregate))
    item["state"] = "queued"
    item["not_before_ms"] = event.accepted_at_ms
    return changes.states


def _workitem_kind(kind: str, decide: Any, evolve: Any, roles: frozenset[str] | None, **options: Any) -> None:
    register(KindSpec(kind, "workitem", decide, evolve, roles=roles, **options))


_workitem_kind("workitem.create", _decide_create, _evolve_create, OWNER)
_workitem_kind("workitem.claim", _decide_claim, _evolve_claim, WORKER, compare_and_set=True)
_workitem_kind("workitem.start", _decide_start, _evolve_start, WORKER)
_workitem_kind("lease.renew", _decide_renew, _evolve_renew, WORKER, compare_and_set=True)
_workitem_kind("workitem.checkpoint", _decide_checkpoint, _evolve_checkpoint, WORKER)
_workitem_kind("workitem.publish", _decide_publish, _evolve_publish, WORKER)
_workitem_kind("workitem.block", _decide_block, _evolve_block, WORKER)
_workitem_kind("workitem.resolve", _decide_resolve, _evolve_resolve, OWNER)
_workitem_kind("workitem.submit", _decide_submit, _evolve_submit, WORKER)
_workitem_kind("workitem.fail", _decide_fail, _evolve_fail, WORKER)
_workitem_kind("workitem.reassign", _decide_reassign, _evolve_reassign, OWNER)
_workitem_kind("workitem.cancel", _decide_cancel, _evolve_cancel, OWNER)
_workitem_kind("workitem.charge", _decide_charge, _evolve_charge, WORKER)
_workitem_kind("lease.expire", _decide_expire, _evolve_expire, None, system_only=True)
