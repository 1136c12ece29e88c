"""More rule tests for the work model: the time bounds, fences, orders and bodies that
``tests/test_work_model.py`` leaves open, one named test per rule (``docs/work-model.md``).

The fixtures ``h`` and ``new_harness`` are the ones of ``tests/test_work_model.py`` (in memory).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mwpstore import index as index_module, limits
from mwpstore.errors import (
    ApprovalRequired,
    AttemptsExhausted,
    BudgetExceeded,
    DeadlinePassed,
    InvalidCommand,
    LeaseExpired,
    LeaseMismatch,
    MwpError,
    NotReady,
    StaleOwnershipEpoch,
    StaleSessionEpoch,
    StorageFailed,
    Unauthorized,
)
from mwpstore.messages import Command
from mwpstore.registry import ENGINE_ACTOR
from mwpstore.work_model import lapse_reason, lease_id_for

from authority_helpers import record_unseals
from test_work_model import RESULT_BODIES, h, new_harness  # noqa: F401  (fixtures)
from test_work_model_durable import DurableHarness
from work_model_support import CONTRACT, GROUP, Harness, fence_of

# -- Lapse reasons and the details of lease rejections --------------------------------------------


def test_a_never_started_lease_past_both_bounds_lapsed_by_start_missed(h: Harness) -> None:
    """An unstarted lease lapsed at its start-by time; found after its expiry too (a late sweep,
    a late start or renewal), it is still reported as ``start_missed``, the bound it missed first."""
    lease = h.claim("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])  # past start_by_ms (200) and expires_at_ms (1000)
    assert lapse_reason(lease, h.now_ms) == "start_missed"
    for kind, cas in (("workitem.start", False), ("lease.renew", True)):
        error = h.reject(LeaseExpired, "w1", kind, "wi1", fence_of(lease), cas=cas)
        assert error.detail["reason"] == "start_missed"
    event = h.accept(ENGINE_ACTOR, "lease.expire", "wi1", {"lease_id": lease["lease_id"]})
    assert event.body is not None and event.body["reason"] == "start_missed"


def test_lease_expired_names_the_reason_and_the_leases_expiry(h: Harness) -> None:
    lease = h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])
    error = h.reject(LeaseExpired, "w1", "lease.renew", "wi1", fence_of(lease), cas=True)
    assert (error.detail["reason"], error.detail["expires_at_ms"]) == ("expired", lease["expires_at_ms"])
    assert lease["expires_at_ms"] != lease["start_by_ms"]


def test_stale_ownership_epoch_names_the_workitems_current_epoch(h: Harness) -> None:
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    h.claim("w1", "wi1")
    for kind, cas in (("workitem.start", False), ("lease.renew", True)):
        error = h.reject(StaleOwnershipEpoch, "w1", kind, "wi1", fence_of(old), cas=cas)
        assert error.detail["current_ownership_epoch"] == 2


# -- Naming a lease ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES) + ["workitem.start", "lease.renew"])
def test_ownership_epoch_zero_names_no_lease_and_is_invalid(h: Harness, kind: str) -> None:
    """Epoch 0 is a WorkItem's epoch before its first claim: no lease ever had it, so a Command
    naming it is malformed (``INVALID_COMMAND``), not a late result kept as Evidence."""
    body = {"lease_id": lease_id_for(GROUP, "wi1", 0), "ownership_epoch": 0, **RESULT_BODIES.get(kind, {})}
    h.reject(InvalidCommand, "w1", kind, "wi1", body, cas=kind == "lease.renew", field="body.ownership_epoch")


@pytest.mark.parametrize("started", [False, True])
def test_start_and_renew_naming_an_epoch_never_granted_are_lease_mismatch(h: Harness, started: bool) -> None:
    """Even while the actor holds the WorkItem's live lease, a start or renewal naming a later
    epoch (with its matching lease id) names no lease that exists: ``LEASE_MISMATCH``."""
    h.claim("w1", "wi1")
    if started:
        h.start("w1", "wi1")
    following = {"lease_id": lease_id_for(GROUP, "wi1", 2), "ownership_epoch": 2}
    if not started:
        h.reject(LeaseMismatch, "w1", "workitem.start", "wi1", following)
    h.reject(LeaseMismatch, "w1", "lease.renew", "wi1", following, cas=True)


def test_a_members_leases_are_listed_sorted(h: Harness) -> None:
    h.create_workitem("wi2")
    h.create_workitem("wi0")
    for workitem in ("wi2", "wi0", "wi1"):
        h.claim("w1", workitem)
    assert h.member("w1")["leases"] == ["wi0", "wi1", "wi2"]


# -- workitem.create ----------------------------------------------------------------------------------


def test_workitem_priority_may_be_negative_down_to_the_content_bound(h: Harness) -> None:
    for workitem, priority in (("wi8", -5), ("wi9", -limits.INT_ABS_MAX)):
        h.accept("owner", "workitem.create", workitem, {"mission": "m1", "priority": priority, "contract": CONTRACT})
        assert h.item(workitem)["priority"] == priority
    h.reject(InvalidCommand, "owner", "workitem.create", "wi7",
             {"mission": "m1", "priority": -limits.INT_ABS_MAX - 1, "contract": CONTRACT}, field="body.priority")


def test_a_workitem_created_with_not_before_is_not_claimable_before_it(h: Harness) -> None:
    ready_at = h.now_ms + 500
    h.accept("owner", "workitem.create", "wi9", {"mission": "m1", "not_before_ms": ready_at, "contract": CONTRACT})
    assert h.item("wi9")["not_before_ms"] == ready_at
    h.advance(499)
    error = h.reject(NotReady, "w1", "workitem.claim", "wi9", {"session_epoch": 1}, cas=True)
    assert error.detail["not_before_ms"] == ready_at
    h.advance(1)
    assert h.claim("w1", "wi9")["granted_at_ms"] == ready_at


def test_a_workitem_records_when_it_was_created(h: Harness) -> None:
    h.advance(7)
    h.create_workitem("wi9")
    assert h.item("wi9")["created_at_ms"] == h.now_ms


# -- The order of a claim's checks: terminal reasons first -------------------------------------------


def test_claim_reports_a_passed_deadline_before_not_ready(h: Harness) -> None:
    # Since workitem.create refuses a not-before time at or after the deadline, only a WorkItem
    # created before that rule can be both: its stored state is written here as such an Event left it.
    body = {"mission": "m1", "not_before_ms": h.now_ms + 50, "contract": {**CONTRACT, "deadline_ms": h.now_ms + 100}}
    h.accept("owner", "workitem.create", "wi9", body)
    h.group.states["workitem:wi9"]["not_before_ms"] = h.now_ms + 1_000
    h.advance(100)
    h.reject(DeadlinePassed, "w1", "workitem.claim", "wi9", {"session_epoch": 1}, cas=True)


@pytest.mark.parametrize("slack", [0, -1], ids=["on_the_deadline", "after_it"])
def test_a_workitem_first_ready_at_or_after_its_deadline_is_refused_at_create(h: Harness, slack: int) -> None:
    """No claim at or after the deadline: work first ready then could never be claimed, and a
    claim before the deadline would answer NOT_READY ("later") for it."""
    deadline_ms = h.now_ms + 100
    body = {"mission": "m1", "not_before_ms": deadline_ms - slack, "contract": {**CONTRACT, "deadline_ms": deadline_ms}}
    error = h.reject(DeadlinePassed, "owner", "workitem.create", "wi9", body, field="body.not_before_ms")
    assert error.detail["deadline_ms"] == deadline_ms


def test_a_workitem_ready_a_millisecond_before_its_deadline_is_claimable_then(h: Harness) -> None:
    deadline_ms = h.now_ms + 100
    body = {"mission": "m1", "not_before_ms": deadline_ms - 1, "contract": {**CONTRACT, "deadline_ms": deadline_ms}}
    h.accept("owner", "workitem.create", "wi9", body)
    h.advance(98)
    h.reject(NotReady, "w1", "workitem.claim", "wi9", {"session_epoch": 1}, cas=True)
    h.advance(1)
    assert h.claim("w1", "wi9")["granted_at_ms"] == deadline_ms - 1


def test_claim_checks_deadline_then_attempts_then_budget(new_harness: Callable[[], Harness]) -> None:
    h = new_harness()
    h.setup(contract={**CONTRACT, "max_attempts": 1, "deadline_ms": h.now_ms + 500})
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": CONTRACT["cost_limit"]})
    h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1})
    h.reject(AttemptsExhausted, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.advance(500)
    h.reject(DeadlinePassed, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


# -- Result bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, False, "", {}, []], ids=repr)
def test_a_result_may_carry_any_content_but_null(h: Harness, value: Any) -> None:
    """``checkpoint``, ``publication`` and ``submission`` are "any value but null": a falsy value
    is a value."""
    h.claim_and_start("w1", "wi1")
    assert h.accept("w1", "workitem.publish", "wi1", {**h.fence("wi1"), "publication": value}).authoritative
    h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": value})
    assert h.item("wi1")["checkpoint"] == value
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": value})
    assert h.item("wi1")["submission"]["result"] == value


def test_required_resolution_may_be_4096_characters(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.block", "wi1",
             {**h.fence("wi1"), "checkpoint": 1, "required_resolution": "x" * 4097}, field="body.required_resolution")
    h.accept("w1", "workitem.block", "wi1", {**h.fence("wi1"), "checkpoint": 1, "required_resolution": "x" * 4096})
    assert h.item("wi1")["required_resolution"] == "x" * 4096


def test_budget_exceeded_names_what_was_spent_before_and_the_limit(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(mission_cost_limit=60, workitems=("wi1", "wi2"))
    h.claim_and_start("w1", "wi1")
    h.claim_and_start("w2", "wi2")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 45})
    error = h.reject(BudgetExceeded, "w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 6})
    assert {name: error.detail[name] for name in ("scope", "cost_spent", "cost_limit")} == {
        "scope": "workitem", "cost_spent": 45, "cost_limit": CONTRACT["cost_limit"],
    }
    error = h.reject(BudgetExceeded, "w2", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 16})
    assert {name: error.detail[name] for name in ("scope", "cost_spent", "cost_limit")} == {
        "scope": "mission", "cost_spent": 45, "cost_limit": 60,
    }


@pytest.mark.parametrize("kind", ["workitem.reassign", "workitem.cancel"])
def test_reassign_and_cancel_name_the_lease_they_revoke(h: Harness, kind: str) -> None:
    lease = h.claim_and_start("w1", "wi1")
    event = h.accept("owner", kind, "wi1", {"reason": "rebalance"})
    assert event.body == {"reason": "rebalance", "revoked_lease": {"lease_id": lease["lease_id"], "agent": "w1"}}


# -- Work Contract bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["lease_ms", "start_ms"])
def test_lease_and_start_durations_are_at_least_one_millisecond(h: Harness, field: str) -> None:
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9", {"mission": "m1", "contract": {**CONTRACT, field: 0}},
             field=f"body.contract.{field}")
    h.accept("owner", "workitem.create", "wi9", {"mission": "m1", "contract": {**CONTRACT, field: 1}})
    assert h.item("wi9")["contract"][field] == 1


def test_a_negative_deadline_is_an_invalid_contract_not_a_passed_deadline(h: Harness) -> None:
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9",
             {"mission": "m1", "contract": {**CONTRACT, "deadline_ms": -1}}, field="body.contract.deadline_ms")


def test_an_integer_backoff_multiplier_may_be_the_term_bound(h: Harness) -> None:
    bound = limits.BACKOFF_MULTIPLIER_TERM_MAX
    h.accept("owner", "workitem.create", "wi9",
             {"mission": "m1", "contract": {**CONTRACT, "backoff_multiplier": bound}})
    assert h.item("wi9")["contract"]["backoff_multiplier"] == bound


def test_a_zero_initial_backoff_retries_at_once(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(contract={**CONTRACT, "backoff_initial_ms": 0, "backoff_max_ms": 0})
    assert h.item("wi1")["contract"]["backoff_initial_ms"] == 0
    h.claim_and_start("w1", "wi1")
    event = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
    assert event.body is not None and (event.body["outcome"], event.body["not_before_ms"]) == ("queued", h.now_ms)
    h.claim("w1", "wi1")


def test_a_contract_may_leave_out_the_deadline(h: Harness) -> None:
    """``deadline_ms`` is the one optional contract field: left out, the WorkItem has no deadline."""
    contract = {name: value for name, value in CONTRACT.items() if name != "deadline_ms"}
    h.accept("owner", "workitem.create", "wi9", {"mission": "m1", "contract": contract})
    assert h.item("wi9")["contract"]["deadline_ms"] is None


def test_a_cost_limit_may_be_the_largest_content_integer(h: Harness) -> None:
    contract = {**CONTRACT, "cost_limit": limits.INT_ABS_MAX}
    h.accept("owner", "workitem.create", "wi9", {"mission": "m1", "contract": contract})
    assert h.item("wi9")["contract"]["cost_limit"] == limits.INT_ABS_MAX


# -- Approvals ------------------------------------------------------------------------------------------


def test_an_approval_records_who_asked_who_decided_when_and_why(h: Harness) -> None:
    h.advance(3)
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit", "reason": "ready"})
    requested_at = h.now_ms
    assert h.get("approval:ap1") == {
        "workitem": "wi1", "operation": "submit", "state": "pending", "requested_by": "w1",
        "requested_at_ms": requested_at, "reason": "ready", "decided_by": None, "decided_at_ms": None,
        "decision_reason": None,
    }
    h.advance(4)
    h.accept("a1", "approval.decide", "ap1", {"decision": "rejected", "reason": "not yet"}, cas=True)
    assert h.get("approval:ap1") == {
        "workitem": "wi1", "operation": "submit", "state": "rejected", "requested_by": "w1",
        "requested_at_ms": requested_at, "reason": "ready", "decided_by": "a1", "decided_at_ms": h.now_ms,
        "decision_reason": "not yet",
    }


def test_approval_required_names_the_operation_and_the_approval_named(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(approval_required=("submit",))
    h.claim_and_start("w1", "wi1")
    body = {**h.fence("wi1"), "submission": 1}
    error = h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", body)
    assert error.detail["operation"] == "submit" and "approval" not in error.detail
    error = h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap9"})
    assert (error.detail["operation"], error.detail["approval"]) == ("submit", "ap9")
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    error = h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap1"})
    assert (error.detail["operation"], error.detail["approval"], error.detail["approval_state"]) == (
        "submit", "ap1", "pending",
    )


@pytest.mark.parametrize("kind", ["workitem.publish", "workitem.submit"])
def test_an_approval_named_where_the_mission_needs_none_is_not_checked(h: Harness, kind: str) -> None:
    """The gate applies only to operations the Mission lists; elsewhere ``body.approval`` is
    recorded as given, whatever that Approval's state (or existence)."""
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.claim_and_start("w1", "wi1")
    for approval in ("ap1", "ap9"):
        event = h.accept("w1", kind, "wi1", {**h.fence("wi1"), **RESULT_BODIES[kind], "approval": approval})
        assert event.authoritative and event.body is not None and event.body["approval"] == approval
        if kind == "workitem.submit":
            break


def test_an_approval_operation_name_may_be_128_characters(h: Harness) -> None:
    h.reject(InvalidCommand, "w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "o" * 129},
             field="body.operation")
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "o" * 128})
    approval = h.get("approval:ap1")
    assert approval is not None and approval["operation"] == "o" * 128


# -- Memberships and sessions ------------------------------------------------------------------------


def test_session_replace_naming_an_earlier_session_is_stale(h: Harness) -> None:
    h.accept("w1", "session.replace", "w1", {"session_epoch": 1})
    error = h.reject(StaleSessionEpoch, "w1", "session.replace", "w1", {"session_epoch": 1})
    assert error.detail["current_session_epoch"] == 2
    h.accept("w1", "session.replace", "w1", {"session_epoch": 2})
    assert h.member("w1")["session_epoch"] == 3


@pytest.mark.parametrize("role", ["approver", "observer", "worker"])
def test_an_owner_cannot_give_itself_any_other_role(h: Harness, role: str) -> None:
    h.reject(InvalidCommand, "owner", "membership.change", "owner", {"role": role}, cas=True, field="target")
    h.accept("owner", "membership.change", "owner", {"role": "owner"}, cas=True)


@pytest.mark.parametrize("role", ["approver", "observer", "owner"])
def test_a_worker_given_another_role_holds_that_role(h: Harness, role: str) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("owner", "membership.change", "w1", {"role": role}, cas=True)
    assert h.member("w1")["role"] == role
    h.reject(Unauthorized, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


# -- Groups and Missions -------------------------------------------------------------------------------


def test_a_group_policy_of_zero_means_keep_everything_and_is_accepted(new_harness: Callable[[], Harness]) -> None:
    h = new_harness()
    policy = {"audit_retention_days": 0, "replay_window_events": 0}
    h.accept("owner", "group.create", GROUP, {"org": "org1", "policy": policy})
    group = h.get(f"group:{GROUP}")
    assert group is not None and group["policy"] == policy


def test_group_create_must_target_the_group_itself(new_harness: Callable[[], Harness]) -> None:
    h = new_harness()
    h.reject(InvalidCommand, "owner", "group.create", "g9", {"org": "org1"}, field="target")
    h.accept("owner", "group.create", GROUP, {"org": "org1"})


def test_a_missions_approval_list_is_stored_sorted_without_repeats(h: Harness) -> None:
    h.accept("owner", "mission.create", "m2",
             {"title": "two", "cost_limit": 10, "approval_required": ["submit", "publish", "submit"]})
    assert h.mission("m2")["approval_required"] == ["publish", "submit"]
    h.accept("owner", "mission.update", "m2", {"approval_required": ["submit", "deploy", "deploy"]}, cas=True)
    assert h.mission("m2")["approval_required"] == ["deploy", "submit"]


def test_a_mission_created_without_a_budget_may_be_charged_nothing(h: Harness) -> None:
    """``cost_limit`` left out of ``mission.create`` is 0 (docs/work-model.md): a budget of nothing,
    so a charge of 0 is taken and any other is BUDGET_EXCEEDED for the Mission; an update that
    gives it a budget lets the charge through."""
    h.accept("owner", "mission.create", "m2", {"title": "two"})
    assert (h.mission("m2")["cost_limit"], h.mission("m2")["approval_required"]) == (0, [])
    h.accept("owner", "workitem.create", "wi2", {"mission": "m2", "contract": CONTRACT})
    h.claim_and_start("w1", "wi2")
    h.accept("w1", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 0})
    error = h.reject(BudgetExceeded, "w1", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 1})
    assert (error.detail["scope"], error.detail["cost_limit"]) == ("mission", 0)
    h.accept("owner", "mission.update", "m2", {"cost_limit": 5}, cas=True)
    h.accept("w1", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 1})
    assert h.mission("m2")["cost_spent"] == 1


def test_a_mission_update_must_change_something(h: Harness) -> None:
    h.reject(InvalidCommand, "owner", "mission.update", "m1", {}, cas=True, field="body")


def test_an_archived_group_records_when_it_was_archived(h: Harness) -> None:
    h.advance(11)
    h.accept("owner", "group.archive", GROUP, {"reason": "done"})
    group = h.get(f"group:{GROUP}")
    assert group is not None and (group["status"], group["archived_at_ms"]) == ("archived", h.now_ms)


@pytest.mark.parametrize("actor", ["a1", "o1", "w1"])
def test_only_an_owner_may_archive_the_group(h: Harness, actor: str) -> None:
    h.reject(Unauthorized, actor, "group.archive", GROUP, {})


# -- The engine's lease sweep (through the Authority) ---------------------------------------------------


def test_the_sweep_expires_a_second_lapse_of_the_same_workitem(tmp_path: Path) -> None:
    """Each sweep Command is named after the lease it expires, so a later lease of the same
    WorkItem that lapses too is expired again, not taken for a replay of the first sweep."""
    h = DurableHarness(tmp_path / "store")
    h.setup()
    for epoch in (1, 2):
        h.claim("w1", "wi1")
        h.advance(CONTRACT["start_ms"])
        [receipt] = h.authority.expire_leases(GROUP)
        assert receipt.kind == "lease.expire" and receipt.authoritative
        item = h.item("wi1")
        assert (item["state"], item["lease"], item["ownership_epoch"]) == ("queued", None, epoch)
    h.close()


def test_the_sweep_tries_the_leases_lapsed_at_the_time_it_is_given(tmp_path: Path) -> None:
    h = DurableHarness(tmp_path / "store")
    h.setup()
    lease = h.claim("w1", "wi1")
    h.advance(CONTRACT["start_ms"])
    assert h.authority.expire_leases(GROUP, now_ms=lease["start_by_ms"] - 1) == []
    assert h.item("wi1")["lease"] == lease
    assert [receipt.aggregate for receipt in h.authority.expire_leases(GROUP, now_ms=h.now_ms)] == ["workitem:wi1"]
    h.close()


def _swept_states(h: DurableHarness, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(the WorkItems one sweep expired, the WorkItem states it read to choose them)."""
    chosen_from: list[bytes] = []
    leased_states = h.authority._leased_states

    def recording(group: str) -> dict[str, Any]:
        unsealed = record_unseals(monkeypatch, index_module.Index, b"states")
        try:
            return leased_states(group)
        finally:
            chosen_from.extend(unsealed)
            monkeypatch.undo()  # this recording, and this wrapper: the Commands' reads are not counted

    monkeypatch.setattr(h.authority, "_leased_states", recording)
    receipts = h.authority.expire_leases(GROUP)
    prefix = f"{GROUP}\x00workitem:".encode()
    return [receipt.aggregate.partition(":")[2] for receipt in receipts], [key[len(prefix) :].decode() for key in chosen_from if key.startswith(prefix)]


def test_after_its_first_sweep_a_group_s_sweeps_read_only_the_workitems_that_hold_a_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first sweep of a Group on a handle reads every WorkItem; the handle then keeps the set
    of those holding a lease through every commit, and later sweeps read those alone."""
    everything = sorted(f"wi{number}" for number in range(1, 21))  # in key order
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=tuple(everything))
    h.claim("w1", "wi3")
    assert _swept_states(h, monkeypatch) == ([], everything)
    assert _swept_states(h, monkeypatch) == ([], ["wi3"])
    h.claim("w2", "wi7")  # leased after the first sweep: kept by the commit
    h.claim_and_start("w1", "wi12")
    assert _swept_states(h, monkeypatch) == ([], ["wi12", "wi3", "wi7"])
    h.accept("w1", "workitem.checkpoint", "wi12", {**h.fence("wi12"), "checkpoint": 1})  # released
    h.advance(CONTRACT["start_ms"])
    assert _swept_states(h, monkeypatch) == (["wi3", "wi7"], ["wi3", "wi7"])
    assert _swept_states(h, monkeypatch) == ([], [])  # the sweep's own Commands dropped the leases
    h.authority.rebuild()  # a new index: the next sweep scans it again
    assert _swept_states(h, monkeypatch) == ([], everything)
    h.close()


@pytest.mark.parametrize("change", ["claim", "release", "claim, then a sweep beside"])
def test_a_lease_change_committed_while_a_group_s_first_sweep_reads_is_kept_for_the_later_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A commit the first sweep's read does not see records its change in the set being made: a
    lease granted then is expired by a later sweep, and one released then is not read again. A
    sweep beside the first (it scans too) leaves the set to the sweep making it: had it finished
    the set, the first sweep's older read would then replace it, without the change."""
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    if change == "release":
        h.claim_and_start("w1", "wi1")
    scan = h.authority.aggregates
    scans: list[str] = []

    def scan_then_change(group: str, *, prefix: str = "") -> list[Any]:
        items = scan(group, prefix=prefix)
        scans.append(group)
        if len(scans) > 1:  # the sweep beside
            return items
        if change == "release":
            h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1})
        else:
            h.claim("w1", "wi2")
        if change == "claim, then a sweep beside":
            assert h.authority.expire_leases(GROUP) == []
        return items

    monkeypatch.setattr(h.authority, "aggregates", scan_then_change)
    assert h.authority.expire_leases(GROUP) == []
    monkeypatch.undo()
    h.advance(CONTRACT["start_ms"])
    if change == "release":
        assert _swept_states(h, monkeypatch) == ([], [])
    else:
        assert _swept_states(h, monkeypatch) == (["wi2"], ["wi2"])
    h.close()


class _InterruptedAfter:
    """The scan's result, whose iteration ends in KeyboardInterrupt (Ctrl-C while the sweep reads
    what the scan returned)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __iter__(self) -> Any:
        yield from self._items
        raise KeyboardInterrupt


@pytest.mark.parametrize("failure", ["the scan fails", "interrupted after the scan", "a later sweep's read fails"])
def test_a_group_s_first_sweep_that_fails_leaves_the_next_one_to_make_the_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A first sweep cut short, by its scan's failure or an interrupt while it reads what the scan
    returned, leaves no half-made set: the next sweep makes it (an interrupted one stayed unmade,
    so every later sweep read every WorkItem for the life of the handle). A later sweep whose read
    fails leaves the set made before it in place."""
    from mwpstore import authority as authority_module

    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    h.claim("w1", "wi2")
    scan = h.authority.aggregates

    def failing_scan(group: str, *, prefix: str = "") -> Any:
        if failure == "the scan fails":
            raise StorageFailed("injected: the scan could not read the index")
        return _InterruptedAfter(scan(group, prefix=prefix))

    def failing_decode(value: Any) -> Any:
        raise StorageFailed("injected: a leased WorkItem's state could not be read")

    if failure == "a later sweep's read fails":
        assert _swept_states(h, monkeypatch) == ([], ["wi1", "wi2"])
        monkeypatch.setattr(authority_module, "decode_state", failing_decode)
    else:
        monkeypatch.setattr(h.authority, "aggregates", failing_scan)
    with pytest.raises(KeyboardInterrupt if failure == "interrupted after the scan" else StorageFailed):
        h.authority.expire_leases(GROUP)
    monkeypatch.undo()
    if failure != "a later sweep's read fails":
        assert _swept_states(h, monkeypatch) == ([], ["wi1", "wi2"])
    assert _swept_states(h, monkeypatch) == ([], ["wi2"])
    h.close()


def test_a_commit_cut_short_after_its_index_commit_fails_the_handle_so_no_sweep_trusts_the_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt between a commit's index commit and its update of the leased sets: the claim
    is durable but the set missed it, so the handle refuses writes (a sweep among them) until it
    is reopened, and the reopened handle expires the lease."""
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    assert h.authority.expire_leases(GROUP) == []  # the set is made: no lease

    def interrupted(events: list[Any]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(h.authority, "_note_leases", interrupted)
    with pytest.raises(KeyboardInterrupt):
        h.claim("w1", "wi2")
    monkeypatch.undo()
    with pytest.raises(StorageFailed):
        h.authority.expire_leases(GROUP)
    h.reopen()
    h.advance(CONTRACT["start_ms"])
    assert _swept_states(h, monkeypatch) == (["wi2"], ["wi1", "wi2"])
    h.close()


def test_the_leased_set_matches_a_full_scan_after_threads_claim_release_and_sweep_at_once(tmp_path: Path) -> None:
    """Four workers claim, start, renew and checkpoint their WorkItems while a fifth thread moves
    the clock and sweeps, over and over: afterwards the handle's set of leased WorkItems is the
    one a scan of every WorkItem gives, and a sweep past every lease leaves none."""
    workers = ("w1", "w2", "w3", "w4")
    contract = {**CONTRACT, "max_attempts": limits.WORK_ATTEMPTS_MAX, "start_ms": 3, "lease_ms": 8}
    h = DurableHarness(tmp_path / "store")
    h.setup(workers=workers, workitems=tuple(f"wi{number}" for number in range(12)), contract=contract)
    authority = h.authority
    sessions = {worker: h.member(worker)["session_epoch"] for worker in workers}
    done = threading.Event()

    def work(worker: str, workitems: list[str], seed: int) -> None:
        chooser = random.Random(seed)
        for step in range(150):
            workitem = chooser.choice(workitems)
            revision, state = authority.state(GROUP, f"workitem:{workitem}")
            lease = state["lease"] if state is not None else None
            if lease is None:
                kind, body, expected = "workitem.claim", {"session_epoch": sessions[worker]}, revision
            else:
                kind = chooser.choice(("workitem.start", "lease.renew", "workitem.checkpoint"))
                body, expected = fence_of(lease), revision if kind == "lease.renew" else None
                if kind == "workitem.checkpoint":
                    body["checkpoint"] = step
            command = Command(actor=worker, action_id=f"{worker}-{step}", group=GROUP, kind=kind, target=workitem,
                              body=body, expected_revision=expected)
            with contextlib.suppress(MwpError):  # raced, lapsed or not this worker's: all expected here
                authority.accept(command)

    def sweep() -> None:
        while not done.is_set():
            h.now_ms += 2
            authority.expire_leases(GROUP)

    sweeper = threading.Thread(target=sweep)
    threads = [threading.Thread(target=work, args=(worker, [f"wi{number}" for number in range(index, 12, 4)], index))
               for index, worker in enumerate(workers)]
    sweeper.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    sweeper.join()
    scanned = {key.partition(":")[2] for key, _, state in authority.aggregates(GROUP, prefix="workitem:")
               if state is not None and state["lease"] is not None}
    assert authority._lease_watches[GROUP].held == scanned
    h.advance(1_000)
    assert sorted(receipt.aggregate.partition(":")[2] for receipt in authority.expire_leases(GROUP)) == sorted(scanned)
    assert all(state["lease"] is None for _, _, state in authority.aggregates(GROUP, prefix="workitem:"))
    h.close()


# -- Rules the stateful machine finds only by search, pinned by name ---------------------------------


def test_another_agents_lapsed_lease_is_a_mismatch_not_evidence(h: Harness) -> None:
    """The fence looks at who holds the current lease before whether it lapsed: another agent's
    current lease is never the actor's late result."""
    h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])
    h.reject(LeaseMismatch, "w2", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1})


def test_a_renewal_before_the_start_is_accepted_and_does_not_start_the_lease(h: Harness) -> None:
    lease = h.claim("w1", "wi1")
    h.advance(10)
    h.accept("w1", "lease.renew", "wi1", fence_of(lease), cas=True)
    assert h.lease("wi1")["started"] is False
    h.advance(CONTRACT["start_ms"] - 10)
    error = h.reject(LeaseExpired, "w1", "workitem.start", "wi1", fence_of(lease))
    assert error.detail["reason"] == "start_missed"


@pytest.mark.parametrize("kind", ["workitem.checkpoint", "workitem.reassign"])
def test_work_released_or_reassigned_is_ready_at_once(h: Harness, kind: str) -> None:
    h.claim_and_start("w1", "wi1")
    h.advance(25)
    if kind == "workitem.checkpoint":
        h.accept("w1", kind, "wi1", {**h.fence("wi1"), "checkpoint": 1})
    else:
        h.accept("owner", kind, "wi1", {})
    assert h.item("wi1")["not_before_ms"] == h.now_ms


def test_a_terminal_failure_keeps_the_not_before_time(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    before = h.item("wi1")["not_before_ms"]
    h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "bad input", "retryable": False})
    item = h.item("wi1")
    assert (item["state"], item["not_before_ms"]) == ("failed", before)


def test_a_charge_of_zero_is_accepted(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 0, "progress": {"rows": 1}})
    assert (h.item("wi1")["cost_spent"], h.item("wi1")["progress"]) == (0, {"rows": 1})


def test_a_late_charge_over_the_budget_is_evidence_not_a_rejection(h: Harness) -> None:
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    h.evidence("w1", "workitem.charge", "wi1", {**fence_of(old), "cost": CONTRACT["cost_limit"] + 1},
               reason="lease_released")
