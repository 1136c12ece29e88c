"""Stateful property test: several agents issue random work-model Commands against a reference model.

The reference model below is written from ``WORK_MODEL.md`` alone (it shares no code with
``mwpstore.workitems``): it predicts each Command's outcome (accepted, kept as Evidence, or the
rejection code) and the resulting WorkItem fields. After every step the real state must match the
model and these invariants must hold:

- at most one current lease per WorkItem, and a Membership lists exactly the leases it holds;
- ownership epochs strictly increase with every claim and never go down;
- every authoritative checkpoint or submission named the lease that was current (and live) at its
  acceptance (MWP-WRK-013, MWP-WRK-019);
- no WorkItem gets a second authoritative submission;
- budgets (WorkItem and Mission) and attempt limits are never exceeded (MWP-WRK-018, -022);
- re-applying every Event's effects to a fresh MemoryGroup gives the same state (checked at the end
  of each run), and the Events form a valid hash chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mwpstore.errors import MwpError
from mwpstore.messages import ZERO_HASH, check_event
from mwpstore.registry import ENGINE_ACTOR, MemoryGroup
from mwpstore.work_model import lapsed_workitems, lease_id_for

from work_model_support import CONTRACT, GROUP, START_MS, Harness

AGENTS = ("w1", "w2", "w3")
WORKITEMS = ("wi1", "wi2", "wi3")
MAX_ATTEMPTS = 3
COST_LIMIT = 30
MISSION_COST_LIMIT = 70
LEASE_MS = 1_000
START_WINDOW_MS = 200
DEADLINE_MS = {"wi1": None, "wi2": None, "wi3": START_MS + 4_000}
RESULT_KINDS = ("workitem.checkpoint", "workitem.block", "workitem.submit", "workitem.fail", "workitem.charge",
                "workitem.publish")


# -- The reference model -------------------------------------------------------------------------


@dataclass
class ModelLease:
    agent: str
    session: int
    epoch: int
    granted: int
    start_by: int
    expires: int
    started: bool = False

    def live(self, now: int) -> bool:
        return now < self.expires and (self.started or now < self.start_by)


@dataclass
class ModelItem:
    state: str = "queued"
    epoch: int = 0
    attempt: int = 0
    lease: ModelLease | None = None
    cost: int = 0
    not_before: int = 0
    submissions: int = 0
    publications: int = 0


def model_backoff(attempt: int) -> int:
    return min(100 * 2 ** (attempt - 1), 1_000)


@dataclass
class Model:
    now: int = START_MS
    sessions: dict[str, int] = field(default_factory=lambda: {agent: 1 for agent in AGENTS})
    items: dict[str, ModelItem] = field(default_factory=lambda: {wi: ModelItem() for wi in WORKITEMS})
    mission_cost: int = 0

    def release(self, wi: str, state: str, not_before: int | None = None) -> None:
        item = self.items[wi]
        item.lease = None
        item.state = state
        if not_before is not None:
            item.not_before = not_before

    def claim(self, agent: str, wi: str, session: int) -> str:
        item = self.items[wi]
        if session != self.sessions[agent]:
            return "STALE_SESSION_EPOCH"
        if item.state == "leased":
            assert item.lease is not None
            if item.lease.live(self.now):
                return "INVALID_STATE"
        elif item.state != "queued":
            return "INVALID_STATE"
        deadline = DEADLINE_MS[wi]
        if deadline is not None and self.now >= deadline:
            return "DEADLINE_PASSED"
        if item.attempt >= MAX_ATTEMPTS:
            return "ATTEMPTS_EXHAUSTED"
        if item.cost >= COST_LIMIT:
            return "BUDGET_EXCEEDED"
        if self.now < item.not_before:
            return "NOT_READY"
        item.epoch += 1
        item.attempt += 1
        item.state = "leased"
        item.lease = ModelLease(agent, session, item.epoch, self.now, self.now + START_WINDOW_MS, self.now + LEASE_MS)
        return "ok"

    def held(self, agent: str, wi: str, epoch: int) -> str | None:
        """The rejection for start/renew, or None when ``agent`` holds the live lease of ``epoch``."""
        item = self.items[wi]
        if epoch < item.epoch:
            return "STALE_OWNERSHIP_EPOCH"
        if epoch > item.epoch or item.lease is None or item.lease.agent != agent:
            return "LEASE_MISMATCH"
        if not item.lease.live(self.now):
            return "LEASE_EXPIRED"
        return None

    def start(self, agent: str, wi: str, epoch: int) -> str:
        problem = self.held(agent, wi, epoch)
        if problem is not None:
            return problem
        lease = self.items[wi].lease
        assert lease is not None
        if lease.started:
            return "INVALID_STATE"
        lease.started = True
        return "ok"

    def renew(self, agent: str, wi: str, epoch: int) -> str:
        problem = self.held(agent, wi, epoch)
        if problem is not None:
            return problem
        lease = self.items[wi].lease
        assert lease is not None
        lease.expires = self.now + LEASE_MS
        return "ok"

    def result(self, kind: str, agent: str, wi: str, epoch: int, cost: int) -> str:
        item = self.items[wi]
        if epoch > item.epoch:
            return "LEASE_MISMATCH"
        if epoch < item.epoch or item.lease is None:
            return "evidence"
        if item.lease.agent != agent:
            return "LEASE_MISMATCH"
        if not item.lease.live(self.now):
            return "evidence"
        if kind == "workitem.checkpoint":
            self.release(wi, "queued", self.now)
        elif kind == "workitem.block":
            self.release(wi, "blocked")
        elif kind == "workitem.submit":
            item.submissions += 1
            self.release(wi, "submitted")
        elif kind == "workitem.publish":
            item.publications += 1
        elif kind == "workitem.fail":
            retry_at = self.now + model_backoff(item.attempt)
            deadline = DEADLINE_MS[wi]
            if item.attempt >= MAX_ATTEMPTS or item.cost >= COST_LIMIT or (deadline is not None and retry_at >= deadline):
                self.release(wi, "failed")
            else:
                self.release(wi, "queued", retry_at)
        elif kind == "workitem.charge":
            if item.cost + cost > COST_LIMIT or self.mission_cost + cost > MISSION_COST_LIMIT:
                return "BUDGET_EXCEEDED"
            item.cost += cost
            self.mission_cost += cost
        return "ok"

    def replace_session(self, agent: str) -> None:
        self.sessions[agent] += 1
        for wi, item in self.items.items():
            if item.lease is not None and item.lease.agent == agent:
                self.release(wi, "queued", self.now)

    def sweep(self) -> list[str]:
        lapsed = [wi for wi, item in self.items.items() if item.lease is not None and not item.lease.live(self.now)]
        for wi in lapsed:
            self.release(wi, "queued", self.now)
        return lapsed


# -- The machine ---------------------------------------------------------------------------------


class WorkModelMachine(RuleBasedStateMachine):
    def make_harness(self) -> Harness:
        """The backend under test (``tests/test_work_model_durable.py`` swaps in the Authority)."""
        return Harness()

    def __init__(self) -> None:
        super().__init__()
        contracts = {
            wi: {
                **CONTRACT,
                "max_attempts": MAX_ATTEMPTS,
                "cost_limit": COST_LIMIT,
                "lease_ms": LEASE_MS,
                "start_ms": START_WINDOW_MS,
                "deadline_ms": DEADLINE_MS[wi],
            }
            for wi in WORKITEMS
        }
        self.h = self.make_harness().setup(workers=AGENTS, mission_cost_limit=MISSION_COST_LIMIT, workitems=())
        for wi in WORKITEMS:
            self.h.create_workitem(wi, contract=contracts[wi])
        self.model = Model(now=self.h.now_ms)
        self.fences: dict[str, list[tuple[str, int]]] = {wi: [] for wi in WORKITEMS}  # (agent, epoch) granted
        self.claimed_epochs: dict[str, list[int]] = {wi: [] for wi in WORKITEMS}
        self.authoritative_submissions: dict[str, int] = {wi: 0 for wi in WORKITEMS}

    # -- driving ---------------------------------------------------------------------------------

    def outcome(self, actor: str, kind: str, target: str, body: dict[str, Any], *, revision: int | None = None,
                cas: bool = False) -> tuple[str, Any]:
        try:
            accepted = self.h.accept(actor, kind, target, body, revision=revision, cas=cas)
        except MwpError as error:
            event(f"{kind}: {error.code}")
            return error.code, None
        outcome = "ok" if accepted.authoritative else "evidence"
        event(f"{kind}: {outcome}")
        return outcome, accepted

    def fence_body(self, wi: str, epoch: int) -> dict[str, Any]:
        return {"lease_id": lease_id_for(GROUP, wi, epoch), "ownership_epoch": epoch}

    # -- rules -------------------------------------------------------------------------------------

    @rule(agent=st.sampled_from(AGENTS), wi=st.sampled_from(WORKITEMS), start=st.booleans(),
          stale_session=st.integers(0, 4))
    def claim(self, agent: str, wi: str, start: bool, stale_session: int) -> None:
        current = self.model.sessions[agent]
        session = current - 1 if stale_session == 0 and current > 1 else current
        before_epoch = self.h.item(wi)["ownership_epoch"]
        expected = self.model.claim(agent, wi, session)
        actual, _ = self.outcome(agent, "workitem.claim", wi, {"session_epoch": session}, cas=True)
        assert actual == expected, (actual, expected)
        if actual != "ok":
            return
        epoch = self.h.item(wi)["ownership_epoch"]
        assert epoch > before_epoch
        self.claimed_epochs[wi].append(epoch)
        self.fences[wi].append((agent, epoch))
        if start:
            assert self.model.start(agent, wi, epoch) == "ok"
            assert self.outcome(agent, "workitem.start", wi, self.fence_body(wi, epoch))[0] == "ok"

    @rule(data=st.data(), wi=st.sampled_from(WORKITEMS), renew=st.booleans())
    def start_or_renew(self, data: st.DataObject, wi: str, renew: bool) -> None:
        if not self.fences[wi]:
            return
        latest = data.draw(st.integers(0, 3)) > 0
        agent, epoch = self.fences[wi][-1] if latest else data.draw(st.sampled_from(self.fences[wi]))
        if renew:
            expected = self.model.renew(agent, wi, epoch)
            actual, _ = self.outcome(agent, "lease.renew", wi, self.fence_body(wi, epoch), cas=True)
        else:
            expected = self.model.start(agent, wi, epoch)
            actual, _ = self.outcome(agent, "workitem.start", wi, self.fence_body(wi, epoch))
        assert actual == expected, (actual, expected)

    def issue_result(self, kind: str, actor: str, wi: str, epoch: int, cost: int) -> None:
        body = self.fence_body(wi, epoch)
        fields: dict[str, dict[str, Any]] = {
            "workitem.checkpoint": {"checkpoint": {"epoch": epoch}},
            "workitem.block": {"checkpoint": {"epoch": epoch}, "required_resolution": "input"},
            "workitem.submit": {"submission": {"by": actor, "epoch": epoch}},
            "workitem.fail": {"reason": "random failure"},
            "workitem.charge": {"cost": cost, "progress": {"epoch": epoch}},
            "workitem.publish": {"publication": {"epoch": epoch}},
        }
        body.update(fields[kind])
        lease_before = self.h.item(wi)["lease"]
        now = self.h.now_ms
        expected = self.model.result(kind, actor, wi, epoch, cost)
        actual, _ = self.outcome(actor, kind, wi, body)
        assert actual == expected, (kind, actual, expected)
        if actual == "ok" and kind in ("workitem.checkpoint", "workitem.submit", "workitem.block"):
            # the authoritative result named the lease current and live at its acceptance
            assert lease_before is not None and lease_before["lease_id"] == body["lease_id"]
            assert lease_before["agent"] == actor
            assert now < lease_before["expires_at_ms"]
            assert lease_before["started"] or now < lease_before["start_by_ms"]
        if actual == "ok" and kind == "workitem.submit":
            self.authoritative_submissions[wi] += 1

    @rule(data=st.data(), kind=st.sampled_from(RESULT_KINDS + ("workitem.charge", "workitem.charge")),
          cost=st.sampled_from((0, 1, 5, 10, 14, 16, 20, 30)))
    def result_by_the_holder(self, data: st.DataObject, kind: str, cost: int) -> None:
        leased = [wi for wi, item in self.model.items.items() if item.lease is not None]
        if leased:
            wi = data.draw(st.sampled_from(leased))
            lease = self.model.items[wi].lease
            assert lease is not None
            self.issue_result(kind, lease.agent, wi, lease.epoch, cost)

    @rule(data=st.data(), wi=st.sampled_from(WORKITEMS), kind=st.sampled_from(RESULT_KINDS), cost=st.sampled_from((0, 1, 5, 10, 14, 16, 20, 30)),
          other_actor=st.sampled_from((None, None) + AGENTS))
    def late_or_foreign_result(self, data: st.DataObject, wi: str, kind: str, cost: int, other_actor: str | None) -> None:
        if self.fences[wi]:
            agent, epoch = data.draw(st.sampled_from(self.fences[wi]))
            self.issue_result(kind, other_actor or agent, wi, epoch, cost)

    @rule(milliseconds=st.sampled_from((1, 50, 150, START_WINDOW_MS, 600, LEASE_MS, 2_500)))
    def advance_clock(self, milliseconds: int) -> None:
        self.h.advance(milliseconds)
        self.model.now = self.h.now_ms

    @rule()
    def sweep(self) -> None:
        expected = self.model.sweep()
        items = [(wi, self.h.item(wi)) for wi in WORKITEMS]
        lapsed = lapsed_workitems(items, self.h.now_ms)
        assert lapsed == expected
        for wi in lapsed:
            lease_id = dict(items)[wi]["lease"]["lease_id"]
            actual, accepted = self.outcome(ENGINE_ACTOR, "lease.expire", wi, {"lease_id": lease_id})
            assert actual == "ok" and accepted.kind == "lease.expire"

    @rule(choice=st.sampled_from(("session.replace", "workitem.resolve", "workitem.resolve", "workitem.reassign")),
          agent=st.sampled_from(AGENTS), wi=st.sampled_from(WORKITEMS))
    def less_often(self, choice: str, agent: str, wi: str) -> None:
        """Session replacements and owner requeues (one rule, so they come less often)."""
        if choice == "session.replace":
            self.model.replace_session(agent)
            previous = self.model.sessions[agent] - 1
            assert self.outcome(agent, "session.replace", agent, {"session_epoch": previous})[0] == "ok"
            return
        item = self.model.items[wi]
        wanted = "leased" if choice == "workitem.reassign" else "blocked"
        expected = "ok" if item.state == wanted else "INVALID_STATE"
        if expected == "ok":
            self.model.release(wi, "queued", self.model.now)
        actual, _ = self.outcome("owner", choice, wi, {})
        assert actual == expected

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def real_state_matches_the_model(self) -> None:
        for wi, expected in self.model.items.items():
            item = self.h.item(wi)
            assert (item["state"], item["ownership_epoch"], item["attempt"], item["cost_spent"], item["not_before_ms"]) == (
                expected.state, expected.epoch, expected.attempt, expected.cost, expected.not_before,
            ), (wi, item, expected)
            assert item["publications"] == expected.publications
            lease = item["lease"]
            if expected.lease is None:
                assert lease is None
            else:
                m = expected.lease
                assert lease is not None
                assert (lease["agent"], lease["session_epoch"], lease["ownership_epoch"], lease["granted_at_ms"],
                        lease["start_by_ms"], lease["expires_at_ms"], lease["started"]) == (
                    m.agent, m.session, m.epoch, m.granted, m.start_by, m.expires, m.started,
                )
        assert self.h.mission()["cost_spent"] == self.model.mission_cost
        for agent in AGENTS:
            assert self.h.member(agent)["session_epoch"] == self.model.sessions[agent]

    @invariant()
    def at_most_one_current_lease_per_workitem(self) -> None:
        holders: dict[str, list[str]] = {wi: [] for wi in WORKITEMS}
        for agent in AGENTS:
            for wi in self.h.member(agent)["leases"]:
                holders[wi].append(agent)
        for wi in WORKITEMS:
            item = self.h.item(wi)
            assert (item["lease"] is not None) == (item["state"] == "leased")
            assert holders[wi] == ([] if item["lease"] is None else [item["lease"]["agent"]])
            if item["lease"] is not None:
                assert item["lease"]["ownership_epoch"] == item["ownership_epoch"]
                assert item["lease"]["lease_id"] == lease_id_for(GROUP, wi, item["ownership_epoch"])

    @invariant()
    def ownership_epochs_strictly_increase(self) -> None:
        for wi, epochs in self.claimed_epochs.items():
            assert all(a < b for a, b in zip(epochs, epochs[1:]))
            assert self.h.item(wi)["ownership_epoch"] == (epochs[-1] if epochs else 0)

    @invariant()
    def budgets_attempts_and_submissions_stay_within_limits(self) -> None:
        for wi in WORKITEMS:
            item = self.h.item(wi)
            assert item["cost_spent"] <= COST_LIMIT
            assert item["attempt"] <= MAX_ATTEMPTS
            assert self.authoritative_submissions[wi] <= 1
            assert (item["submission"] is not None) == (self.authoritative_submissions[wi] == 1)
        assert self.h.mission()["cost_spent"] <= MISSION_COST_LIMIT

    def teardown(self) -> None:
        try:
            self.check_rebuild()
        finally:
            self.h.close()

    def check_rebuild(self) -> None:
        """State after a rebuild from the log equals state before."""
        fresh = MemoryGroup(GROUP)
        previous = ZERO_HASH
        for accepted in self.h.events():
            check_event(accepted, expected_prev_hash=previous)
            previous = accepted.hash
            fresh.apply(accepted)
        assert (fresh.states, fresh.revisions) == self.h.states()


WorkModelMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestWorkModelMachine = WorkModelMachine.TestCase
