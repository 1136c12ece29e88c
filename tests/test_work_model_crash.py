"""kill -9 during a mixed work-model load: the work-model invariants hold after every reopen.

Reuses the Authority's kill -9 harness (``_kill_once`` in ``tests/test_authority_crash.py``: start
the child, SIGKILL it at a random moment or at an armed fail point, collect the acknowledged
receipts) with ``tests/work_model_child.py`` as the child. After each kill the store is reopened
and checked: nothing acknowledged is lost, sequences are contiguous, and folding the log's Events
(their effects) gives exactly the state the index serves, on which these hold:

- at most one current lease per WorkItem, and Memberships list exactly the leases they hold;
- ownership epochs strictly increase from claim to claim;
- every authoritative checkpoint, block and submission named the lease that was current and live
  at its acceptance; no WorkItem has a second authoritative submission;
- WorkItem and Mission budgets and attempt limits are never exceeded.

Default: ``MWPSTORE_WORK_KILLS`` (5) kills. Longer: ``MWPSTORE_WORK_KILLS=300 python -m pytest
tests/test_work_model_crash.py``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

import test_authority_crash as harness
from authority_helpers import GROUP
from mwpstore import Authority
from mwpstore.messages import Event
from mwpstore.registry import MemoryGroup
from mwpstore.work_model import lease_is_live

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "work_model_child.py")


class LaterKills(random.Random):
    """The harness waits ``uniform(0.3, 0.9)`` s before the kill; the work-model child needs longer
    to import, open and set up, so give it an extra second of work before it dies."""

    def uniform(self, a: float, b: float) -> float:
        return super().uniform(a, b) + 1.0


def _read_all(authority: Authority) -> list[Event]:
    events: list[Event] = []
    while True:
        batch = authority.read(GROUP, after=len(events), limit=10_000)
        if not batch:
            return events
        events.extend(batch)


def check_work_model_log(events: list[Event]) -> MemoryGroup:
    """Fold the Events and check the work-model invariants along the way; return the folded Group."""
    folded = MemoryGroup(GROUP)
    epochs: dict[str, int] = {}
    submissions: dict[str, int] = {}
    for event in events:
        before: dict[str, Any] | None = folded.get(event.aggregate)
        if event.authoritative and event.kind in ("workitem.checkpoint", "workitem.block", "workitem.submit"):
            assert before is not None and before["lease"] is not None, event
            lease = before["lease"]
            assert event.body is not None
            assert lease["lease_id"] == event.body["lease_id"] and lease["agent"] == event.actor, event
            assert lease_is_live(lease, event.accepted_at_ms), event
        if event.authoritative and event.kind == "workitem.claim":
            assert event.body is not None
            epoch = event.body["ownership_epoch"]
            assert epoch > epochs.get(event.aggregate, 0), event
            epochs[event.aggregate] = epoch
        if event.authoritative and event.kind == "workitem.submit":
            submissions[event.aggregate] = submissions.get(event.aggregate, 0) + 1
            assert submissions[event.aggregate] == 1, event
        if not event.authoritative:
            assert event.effects == []
        folded.apply(event)
    holders: dict[str, str] = {}
    for key, state in folded.states.items():
        if key.startswith("member:"):
            for workitem in state.get("leases", []):
                assert workitem not in holders, f"two holders of {workitem}"
                holders[workitem] = key.partition(":")[2]
    for key, state in folded.states.items():
        if key.startswith("workitem:"):
            workitem = key.partition(":")[2]
            lease = state["lease"]
            assert (lease is not None) == (state["state"] == "leased")
            assert holders.get(workitem) == (None if lease is None else lease["agent"])
            assert state["attempt"] <= state["contract"]["max_attempts"]
            assert state["cost_spent"] <= state["contract"]["cost_limit"]
        if key.startswith("mission:"):
            assert state["cost_spent"] <= state["cost_limit"]
    return folded


def test_kill_9_during_a_work_model_load_keeps_the_invariants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "CHILD", CHILD)
    kills = int(os.environ.get("MWPSTORE_WORK_KILLS", "5"))
    rng = LaterKills(int(os.environ.get("MWPSTORE_SEED", "4321")))
    path = str(tmp_path / "store")
    acknowledged: dict[str, tuple[int, str]] = {}
    kinds: set[str] = set()
    for run in range(kills):
        for action, seq, event_id in harness._kill_once(path, run, rng):
            acknowledged[action] = (seq, event_id)
        with Authority.open(path) as authority:
            events = _read_all(authority)
            assert [event.seq for event in events] == list(range(1, len(events) + 1))
            by_action = {event.action_id: event for event in events}
            for action, (seq, event_id) in acknowledged.items():
                event = by_action.get(action)
                assert event is not None, f"acknowledged {action} lost after kill {run}"
                assert (event.seq, event.event_id) == (seq, event_id)
            folded = check_work_model_log(events)
            served = {key: (revision, state) for key, revision, state in authority.aggregates(GROUP)}
            assert served == {key: (folded.revisions[key], folded.states.get(key)) for key in folded.revisions}
            if run == kills - 1:
                report = authority.verify()
                assert report.ok, report.problems
            kinds.update(f"{event.kind}{'' if event.authoritative else '/evidence'}" for event in events)
    # the load really mixed the transitions
    assert {"workitem.claim", "workitem.start", "workitem.submit", "workitem.submit/evidence"} <= kinds, kinds
