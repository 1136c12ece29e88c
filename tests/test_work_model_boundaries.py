"""Every place that asks the same time question answers it the same way at every millisecond
around its bounds (docs/work-model.md, "Execution Lease" and "Work must be ready before its
deadline").

Is the lease live at ``now``? Asked by the claim (may it take the WorkItem over?), the fence of
results (authoritative or Evidence?), start and renew (taken or ``LEASE_EXPIRED``?), the sweep's
selection (``lapsed_workitems``) and ``lease.expire`` itself, and the offline guard (online: is
the lease current? offline: is the work still within its grace?). Is the work ready at ``now``?
Asked by the claim and by the AgentStore's ``work_queue``. Each question is asked on a copy of the
same Group, at the last millisecond before a bound, at the bound and just past it.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mwpstore import limits
from mwpstore.agent_store import AgentStore
from mwpstore.contracts import backoff_ms, parse_contract
from mwpstore.errors import DeadlinePassed, InvalidState, LeaseExpired, MwpError, NotReady, OfflineRefused
from mwpstore.offline import OfflineGuard
from mwpstore.registry import ENGINE_ACTOR, MemoryGroup
from mwpstore.work_model import lapse_reason, lapsed_workitems, lease_is_live
from mwpstore.workitems import claim_refused
from test_work_model_durable import DurableHarness
from work_model_support import CONTRACT, START_MS, Harness

_GROUPS = itertools.count()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    """One AgentStore for the module; each example mirrors its own Group into it."""
    store = AgentStore.open(tmp_path_factory.mktemp("boundaries") / "agent")
    yield store
    store.close()


def _mirror(agent: AgentStore, h: Harness) -> None:
    with agent.begin() as tx:
        for event in h.group.events[agent.head(h.group_id).applied_seq :]:
            tx.apply(event)
        tx.advance_cursor(h.group_id)


def _trial(h: Harness, now_ms: int) -> Harness:
    """A copy of ``h`` at ``now_ms`` whose Commands leave ``h`` as it is."""
    trial = copy.copy(h)
    group = h.group
    trial.group = MemoryGroup(group.group, copy.deepcopy(group.states), dict(group.revisions), list(group.events))
    trial.now_ms = now_ms
    return trial


def _taken(h: Harness, now_ms: int, actor: str, kind: str, body: dict[str, Any], *, cas: bool = False,
           refusal: type[MwpError]) -> bool:
    """Whether a copy of ``h`` takes the Command at ``now_ms`` as authoritative; False when it is
    refused with ``refusal`` or kept as Evidence (any other outcome fails the test)."""
    try:
        event = _trial(h, now_ms).accept(actor, kind, "wi1", body, cas=cas)
    except refusal:
        return False
    if not event.authoritative:
        assert event.body is not None and event.body["evidence"]["reason"] == "lease_expired"
    return event.authoritative


def _near(*bounds: int) -> list[int]:
    return sorted({moment + step for moment in bounds for step in (-1, 0, 1)})


# -- Is the lease live? -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    start_ms=st.integers(1, 40),
    lease_ms=st.integers(1, 40),
    started_after=st.none() | st.integers(0, 39),
    renewed_after=st.none() | st.integers(0, 79),
)
def test_every_place_that_asks_whether_a_lease_is_live_answers_alike_around_its_bounds(
    agent: AgentStore, start_ms: int, lease_ms: int, started_after: int | None, renewed_after: int | None
) -> None:
    h = Harness(group=f"g{next(_GROUPS)}").setup(contract={**CONTRACT, "start_ms": start_ms, "lease_ms": lease_ms})
    h.claim("w1", "wi1")
    if started_after is not None and started_after < start_ms and started_after < lease_ms:
        h.advance(started_after)
        h.start("w1", "wi1")
    if renewed_after is not None and lease_is_live(h.lease("wi1"), START_MS + renewed_after):
        h.now_ms = max(h.now_ms, START_MS + renewed_after)
        h.accept("w1", "lease.renew", "wi1", h.fence("wi1"), cas=True)
    lease = h.lease("wi1")
    fence = h.fence("wi1")
    _mirror(agent, h)
    guard = OfflineGuard(agent, h.group_id, "w1", grace_ms=limits.WORK_DURATION_MS_MAX)
    last_event_ms = h.now_ms
    for now in _near(lease["start_by_ms"], lease["expires_at_ms"]):
        if now < last_event_ms:
            continue  # an engine never decides before its last acceptance time
        live = now < lease["expires_at_ms"] and (lease["started"] or now < lease["start_by_ms"])  # the documented rule
        answers = {
            "lease_is_live": lease_is_live(lease, now),
            "lapse_reason": lapse_reason(lease, now) is None,
            "lapsed_workitems": lapsed_workitems(h.workitem_states(), now) == [],
            "lease.expire": not _taken(h, now, ENGINE_ACTOR, "lease.expire", {"lease_id": lease["lease_id"]},
                                       refusal=InvalidState),
            "claim by another": not _taken(h, now, "w2", "workitem.claim", {"session_epoch": 1}, cas=True,
                                           refusal=InvalidState),
            "renew": _taken(h, now, "w1", "lease.renew", fence, cas=True, refusal=LeaseExpired),
            "checkpoint": _taken(h, now, "w1", "workitem.checkpoint", {**fence, "checkpoint": 1}, refusal=LeaseExpired),
            "submit": _taken(h, now, "w1", "workitem.submit", {**fence, "submission": 1}, refusal=LeaseExpired),
            "guard online": _permitted(guard, now, reversible=False),
        }
        if not lease["started"]:
            answers["start"] = _taken(h, now, "w1", "workitem.start", fence, refusal=LeaseExpired)
        assert answers == dict.fromkeys(answers, live), (now, lease)
    if lease["started"]:
        # offline: started work goes on within the grace period, which ends with the lease at the latest
        guard.service_unreachable(last_event_ms)
        for now in _near(lease["expires_at_ms"]):
            if now >= last_event_ms:
                assert _permitted(guard, now, reversible=True) == (now < lease["expires_at_ms"]), (now, lease)


def _permitted(guard: OfflineGuard, now_ms: int, *, reversible: bool) -> bool:
    try:
        guard.permit("wi1", now_ms=now_ms, reversible=reversible)
    except OfflineRefused as refused:
        assert refused.detail["reason"] in ("no_current_lease", "grace_expired")
        return False
    return True


@pytest.mark.parametrize("before_the_lease", [True, False], ids=["grace_first", "lease_first"])
def test_offline_work_goes_on_until_the_millisecond_before_the_earlier_of_grace_and_lease(before_the_lease: bool,
                                                                                           agent: AgentStore) -> None:
    h = Harness(group=f"g{next(_GROUPS)}").setup()
    lease = h.claim_and_start("w1", "wi1")
    _mirror(agent, h)
    grace_ms = CONTRACT["lease_ms"] // 2 if before_the_lease else CONTRACT["lease_ms"] * 2
    guard = OfflineGuard(agent, h.group_id, "w1", grace_ms=grace_ms)
    guard.service_unreachable(h.now_ms)
    end = min(h.now_ms + grace_ms, lease["expires_at_ms"])
    assert guard.permit("wi1", now_ms=end - 1, reversible=True).grace_deadline_ms == end
    assert not _permitted(guard, end, reversible=True)


# -- Is the work ready? -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    ready_after=st.integers(0, 50),
    deadline_after=st.none() | st.integers(1, 60),
    retry=st.booleans(),
)
def test_the_claim_and_the_work_queue_agree_on_readiness_around_not_before_and_the_deadline(
    agent: AgentStore, ready_after: int, deadline_after: int | None, retry: bool
) -> None:
    """Ready at ``t`` when ``not_before_ms <= t < deadline_ms``: the claim takes the WorkItem
    exactly then, and the work queue lists it exactly then. ``retry``: the not-before time is a
    failure's backoff instead of the create's."""
    h = Harness(group=f"g{next(_GROUPS)}").setup(workitems=())
    deadline = None if deadline_after is None else START_MS + deadline_after
    contract = {**CONTRACT, "deadline_ms": deadline, "backoff_initial_ms": ready_after, "backoff_max_ms": 1_000}
    body: dict[str, Any] = {"mission": "m1", "contract": contract}
    if not retry:
        body["not_before_ms"] = START_MS + ready_after
    if not retry and deadline is not None and START_MS + ready_after >= deadline:
        h.reject(DeadlinePassed, "owner", "workitem.create", "wi1", body, field="body.not_before_ms")
        return
    h.accept("owner", "workitem.create", "wi1", body)
    if retry:
        h.claim_and_start("w1", "wi1")
        outcome = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"}).body["outcome"]
        # queued again exactly when some millisecond is left for a claim
        assert (outcome == "queued") == (deadline is None or START_MS + ready_after < deadline)
        if outcome == "failed":
            return
    item = h.item("wi1")
    not_before = item["not_before_ms"]
    _mirror(agent, h)
    for now in _near(not_before, *([] if deadline is None else [deadline])):
        if now < h.now_ms:
            continue
        ready = not_before <= now and (deadline is None or now < deadline)  # the documented rule
        answers = {
            "claim": _taken(h, now, "w2", "workitem.claim", {"session_epoch": 1}, cas=True,
                            refusal=(NotReady, DeadlinePassed)),
            "work_queue": [entry.workitem for entry in agent.work_queue(h.group_id, now)] == ["wi1"],
            "claim_refused and not_before": not claim_refused(item, now) and not_before <= now,
        }
        assert answers == dict.fromkeys(answers, ready), (now, not_before, deadline)


# -- The clock: stepping back, repeating, jumping to its bound ----------------------------------------


def test_a_clock_that_steps_back_repeats_or_jumps_to_its_bound_moves_no_lease_back_and_a_rebuild_agrees(
    tmp_path: Path,
) -> None:
    """Each Command is decided at the clock's reading but never before the last acceptance time,
    so a renewal after a step back does not shorten the lease, a lease granted at ``TIME_MS_MAX``
    ends a lease's length later (no saturation), and a rebuild from the log gives the same state."""
    h = DurableHarness(tmp_path / "store").setup()
    try:
        granted = h.claim_and_start("w1", "wi1")["granted_at_ms"]  # the clock repeats its reading
        h.now_ms = granted - 500  # steps back: decided at the last acceptance time
        h.accept("w1", "lease.renew", "wi1", h.fence("wi1"), cas=True)
        assert h.lease("wi1")["expires_at_ms"] == granted + CONTRACT["lease_ms"]
        assert h.authority.expire_leases(h.group_id) == []
        h.now_ms = limits.TIME_MS_MAX  # jumps to the end of the range: the lease lapsed
        lease = h.claim_and_start("w2", "wi1")
        assert (lease["granted_at_ms"], lease["expires_at_ms"]) == (limits.TIME_MS_MAX, limits.TIME_MS_MAX + CONTRACT["lease_ms"])
        h.now_ms = 0  # and back to the start of it
        h.accept("w2", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
        assert h.item("wi1")["not_before_ms"] == limits.TIME_MS_MAX + backoff_ms(CONTRACT, 2)
        times = [event.accepted_at_ms for event in h.events()]
        assert times == sorted(times) and times[-1] == limits.TIME_MS_MAX
        before = h.states()
        h.authority.rebuild()
        assert h.states() == before
        h.reopen()
        assert h.states() == before and h.authority.verify().ok
        assert h.accept("owner", "workitem.cancel", "wi1", {}).accepted_at_ms == limits.TIME_MS_MAX
    finally:
        h.close()


# -- Arithmetic: the backoff --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    initial=st.integers(0, limits.WORK_DURATION_MS_MAX),
    ceiling_above=st.integers(0, limits.WORK_DURATION_MS_MAX),
    terms=st.tuples(st.integers(1, limits.BACKOFF_MULTIPLIER_TERM_MAX), st.integers(1, limits.BACKOFF_MULTIPLIER_TERM_MAX))
    | st.sampled_from([(1, 1), (2, 1), (limits.BACKOFF_MULTIPLIER_TERM_MAX, 1),
                       (limits.BACKOFF_MULTIPLIER_TERM_MAX, limits.BACKOFF_MULTIPLIER_TERM_MAX - 1)]),
    attempt=st.integers(1, limits.WORK_ATTEMPTS_MAX) | st.sampled_from([1, 2, limits.WORK_ATTEMPTS_MAX]),
)
def test_the_backoff_is_the_exact_rational_product_rounded_down_and_capped_at_every_bound(
    initial: int, ceiling_above: int, terms: tuple[int, int], attempt: int
) -> None:
    from fractions import Fraction

    numerator, denominator = max(terms), min(terms)  # a multiplier is at least 1
    ceiling = min(initial + ceiling_above, limits.WORK_DURATION_MS_MAX)
    contract = parse_contract({**CONTRACT, "max_attempts": limits.WORK_ATTEMPTS_MAX, "backoff_initial_ms": initial,
                               "backoff_multiplier": [numerator, denominator], "backoff_max_ms": ceiling})
    exact = initial * Fraction(numerator, denominator) ** (attempt - 1)
    delay = backoff_ms(contract, attempt)
    assert delay == min(exact.__floor__(), ceiling)
    assert attempt == 1 or backoff_ms(contract, attempt - 1) <= delay  # never shrinks
