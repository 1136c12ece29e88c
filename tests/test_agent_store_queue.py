"""The AgentStore's work queue against the real work-model rules: it lists a WorkItem exactly when
the authority would take a claim of it at that time, as far as the WorkItem's own state decides.

The Group is driven by ``MemoryGroup`` through the test harness; its Events reach the AgentStore
through ``tx.apply``, as they would through delivery.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_store_support import ChainBuilder, workitem_state
from authority_helpers import record_unseals
from mwpstore.agent_store import AgentStore
from mwpstore.errors import AttemptsExhausted, BudgetExceeded, DeadlinePassed, InvalidState
from mwpstore.registry import ENGINE_ACTOR
from mwpstore.work_model import lapse_reason
from work_model_support import CONTRACT, GROUP, Harness


@pytest.fixture
def agent(tmp_path):
    store = AgentStore.open(tmp_path / "agent")
    yield store
    store.close()


def sync(harness: Harness, agent: AgentStore) -> None:
    with agent.begin() as tx:
        for event in harness.group.events[agent.head(GROUP).applied_seq :]:
            tx.apply(event)
        tx.advance_cursor(GROUP)


def listed(agent: AgentStore, now_ms: int) -> list[str]:
    return [entry.workitem for entry in agent.work_queue(GROUP, now_ms)]


def claimable(harness: Harness, workitem: str) -> bool:
    """Whether the authority takes a claim of ``workitem`` now (the claim is not kept)."""
    before = len(harness.group.events)
    try:
        harness.claim("w2", workitem)
    except (AttemptsExhausted, BudgetExceeded, DeadlinePassed, InvalidState):
        return False
    assert len(harness.group.events) == before + 1
    return True


def test_work_that_no_claim_can_take_is_not_listed(agent):
    """Attempts used up (after a checkpoint, and after a lapse swept by ``lease.expire``), cost
    budget spent, deadline passed: each WorkItem is queued, and each claim of it is refused.
    Listed, every agent reading the queue would try it and be refused, round after round."""
    h = Harness().setup(workitems=())
    h.create_workitem("ready")
    h.create_workitem("checkpointed", contract={**CONTRACT, "max_attempts": 1})
    h.create_workitem("lapsed", contract={**CONTRACT, "max_attempts": 1})
    h.create_workitem("spent")
    deadline_ms = h.now_ms + 5_000
    h.create_workitem("deadline", contract={**CONTRACT, "deadline_ms": deadline_ms})
    h.claim_and_start("w1", "checkpointed")
    h.accept("w1", "workitem.checkpoint", "checkpointed", {**h.fence("checkpointed"), "checkpoint": {"step": 1}})
    h.claim_and_start("w1", "spent")
    h.accept("w1", "workitem.charge", "spent", {**h.fence("spent"), "cost": CONTRACT["cost_limit"]})
    h.accept("w1", "workitem.checkpoint", "spent", {**h.fence("spent"), "checkpoint": {"step": 1}})
    lease = h.claim_and_start("w1", "lapsed")
    h.advance(CONTRACT["lease_ms"] + 1)
    h.accept(ENGINE_ACTOR, "lease.expire", "lapsed", {"lease_id": lease["lease_id"]})
    assert {name: state["state"] for name, state in h.workitem_states()} == dict.fromkeys(
        ["checkpointed", "deadline", "lapsed", "ready", "spent"], "queued"
    )
    sync(h, agent)
    assert listed(agent, h.now_ms) == ["deadline", "ready"]
    assert [name for name in ("checkpointed", "lapsed", "spent") if claimable(h, name)] == []

    assert listed(agent, deadline_ms - 1) == ["deadline", "ready"]
    h.now_ms = deadline_ms  # the deadline comes: from then on no claim, and not listed
    assert listed(agent, deadline_ms) == ["ready"]
    assert not claimable(h, "deadline")
    assert claimable(h, "ready")


def test_leased_work_whose_lease_lapsed_is_listed_only_once_lease_expire_arrives(agent):
    """The queue changes only with Events (docs/agent-store.md, "Work queue"): a lapsed lease
    leaves its WorkItem unlisted, though a claim would take it over, until the sweep's
    ``lease.expire`` reaches the mirror."""
    h = Harness().setup(workitems=("wi1",))
    lease = h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])
    sync(h, agent)
    assert listed(agent, h.now_ms) == []
    assert lapse_reason(h.lease("wi1"), h.now_ms) == "expired"  # a claim by w2 would take it over
    h.accept(ENGINE_ACTOR, "lease.expire", "wi1", {"lease_id": lease["lease_id"]})
    sync(h, agent)
    assert listed(agent, h.now_ms) == ["wi1"]


def test_work_of_a_closed_mission_is_not_listed(agent):
    h = Harness().setup(workitems=("wi1", "wi2"))
    h.accept("owner", "mission.create", "m2", {"title": "two", "cost_limit": 100, "approval_required": []})
    h.accept("owner", "workitem.create", "other", {"mission": "m2", "contract": dict(CONTRACT)})
    sync(h, agent)
    assert listed(agent, h.now_ms) == ["other", "wi1", "wi2"]
    h.accept("owner", "mission.close", "m1", {})
    sync(h, agent)
    assert listed(agent, h.now_ms) == ["other"]
    assert not claimable(h, "wi1") and claimable(h, "other")


def test_a_queue_entry_whose_state_proves_nothing_stays_listed(agent):
    """Only evidence removes an entry: a contract without the fields, or fields that are no ints,
    or a Mission the mirror does not hold, leave the WorkItem listed as before."""
    chain = ChainBuilder(GROUP)
    odd = workitem_state("m1", "queued", attempt=5)  # the support's contract has max_attempts 3
    odd["contract"] = {"max_attempts": "3", "cost_limit": None, "deadline_ms": 1.5}
    plain = workitem_state("m1", "queued", attempt=2)
    plain.pop("contract")
    used = workitem_state("m1", "queued", attempt=3)
    for name, state in (("odd", odd), ("plain", plain), ("used", used)):
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": state})
    with agent.begin() as tx:
        for event in chain.events:
            tx.apply(event)
        tx.advance_cursor(GROUP)
    assert listed(agent, 10**12) == ["odd", "plain"]


def test_the_queue_steps_past_a_run_of_deferred_work_by_searching_for_the_next_priority(agent, monkeypatch):
    """work_queue(limit=) read every deferred entry (not-before still to come) of the Group, as
    its keys order by priority first: 10,000 deferred entries before 10 ready ones cost about 17 ms
    a call. Within a priority the keys run by not-before, so past the first few deferred entries
    the rest of that priority is deferred too: the scan searches for the next priority. What it
    lists is unchanged, at every time; short deferred runs (one entry of each priority) are
    stepped over as before."""
    from mwpstore import agent_store as agent_store_module

    chain = ChainBuilder(GROUP)
    ready, later = 1_000, 5_000
    items: list[tuple[str, int, int]] = [("first", 9, 0)]
    items += [(f"d9-{i:03d}", 9, later + i) for i in range(150)]  # a long deferred run
    items += [(f"short-{p}", p, later) for p in (8, 7, 6)]  # deferred runs of one entry each
    items += [("mid", 5, 0), ("mid-later", 5, ready)]
    items += [(f"d5-{i:03d}", 5, later + i) for i in range(150)]
    items += [("last", 1, 0)]
    for name, priority, not_before_ms in items:
        state = workitem_state("m1", "queued", priority=priority, not_before_ms=not_before_ms)
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": state})
    neighbour = ChainBuilder(GROUP + "x")  # its keys sort right after the Group's own
    neighbour.event("workitem.create", "workitem:x", {"workitem:x": workitem_state("m1", "queued", priority=0, not_before_ms=0)})
    with agent.begin() as tx:
        for event in chain.events + neighbour.events:
            tx.apply(event)
        tx.advance_cursor(GROUP)
        tx.advance_cursor(neighbour.group)

    unsealed = record_unseals(monkeypatch, agent_store_module._Tables, b"queue")

    def expected(now_ms: int) -> list[str]:
        ordered = sorted(items, key=lambda item: (-item[1], item[2], item[0]))
        return [name for name, _, not_before_ms in ordered if not_before_ms <= now_ms]

    for now_ms in (0, ready, later, later + 75, later + 10_000):
        for limit in (None, 1, 3, 400):
            unsealed.clear()
            assert [entry.workitem for entry in agent.work_queue(GROUP, now_ms, limit=limit)] == expected(now_ms)[:limit]
    unsealed.clear()
    assert listed(agent, ready) == ["first", "mid", "mid-later", "last"]
    assert len(unsealed) < 60, len(unsealed)  # 44; all 308 entries were read before


_EXTREME = 2**63 - 1
_queue_groups = itertools.count(1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=st.lists(
        st.tuples(
            st.sampled_from([-_EXTREME, -_EXTREME + 1, 0, 1, _EXTREME - 1, _EXTREME]),
            st.sampled_from([-_EXTREME, 0, 5, 10, _EXTREME]),
        ),
        max_size=16,
    ),
    now_ms=st.sampled_from([0, 4, 5, 10, 2**62]),
    limit=st.none() | st.integers(1, 8),
    steps=st.integers(1, 3),
)
def test_the_queue_lists_what_a_full_scan_lists_in_its_order(agent, items, now_ms, limit, steps):
    """The search past a deferred run against a plain scan of every entry: same entries, same
    order, at every time (ties of priority and not-before, the extreme priorities whose next
    priority the search computes, a not-before equal to now), with any limit and with searches
    begun after one, two or three deferred entries."""
    from mwpstore import agent_store as agent_store_module

    group = f"q{next(_queue_groups)}-"
    chain = ChainBuilder(group)
    named = [(f"w{i:02d}", priority, not_before_ms) for i, (priority, not_before_ms) in enumerate(items)]
    for name, priority, not_before_ms in named:
        state = workitem_state("m1", "queued", priority=priority, not_before_ms=not_before_ms)
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": state})
    neighbour = ChainBuilder(group + "x")  # its keys sort right after the Group's own
    neighbour.event("workitem.create", "workitem:x", {"workitem:x": workitem_state("m1", "queued")})
    with agent.begin() as tx:
        for event in chain.events + neighbour.events:
            tx.apply(event)
        tx.advance_cursor(group)
        tx.advance_cursor(neighbour.group)
    ordered = sorted(named, key=lambda item: (-item[1], item[2], item[0]))
    expected = [(name, priority, not_before_ms) for name, priority, not_before_ms in ordered if not_before_ms <= now_ms]
    saved = agent_store_module._QUEUE_DEFERRED_STEPS
    agent_store_module._QUEUE_DEFERRED_STEPS = steps
    try:
        listed_now = agent.work_queue(group, now_ms, limit=limit)
    finally:
        agent_store_module._QUEUE_DEFERRED_STEPS = saved
    assert [(entry.workitem, entry.priority, entry.not_before_ms) for entry in listed_now] == expected[:limit]
