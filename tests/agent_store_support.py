"""Helpers for the AgentStore and delivery tests: hash-chained Groups of Events made by hand.

``ChainBuilder`` makes valid Events with arbitrary effects (the hash chain and revisions are
computed like the authority's), so the agent side can be tested without the work-model rules.
``workload`` makes a deterministic mix of WorkItem, Mission and Membership transitions.
"""

from __future__ import annotations

import os
import random
import signal
import struct
from typing import Any

from mwpstore.messages import ZERO_HASH, Effect, Event, event_hash, make_event_id, payload_hash_of


class ChainBuilder:
    """One Group's hash chain; ``event(...)`` appends and returns the next Event."""

    def __init__(self, group: str, start_ms: int = 1_000) -> None:
        self.group = group
        self.events: list[Event] = []
        self.revisions: dict[str, int] = {}
        self.states: dict[str, dict[str, Any] | None] = {}
        self.now_ms = start_ms

    @property
    def head_hash(self) -> bytes:
        return self.events[-1].hash if self.events else ZERO_HASH

    def event(
        self,
        kind: str,
        aggregate: str,
        changes: dict[str, dict[str, Any] | None],
        body: dict[str, Any] | None = None,
        *,
        actor: str = "owner",
        authoritative: bool = True,
    ) -> Event:
        seq = len(self.events) + 1
        self.now_ms += 7
        body = {} if body is None else body
        effects = []
        if authoritative:
            for key in sorted(changes):
                revision = self.revisions.get(key, 0) + 1
                self.revisions[key] = revision
                self.states[key] = changes[key]
                effects.append(Effect(key, revision, changes[key]))
        revision = self.revisions.get(aggregate, 0)
        fields = dict(
            group=self.group,
            seq=seq,
            event_id=make_event_id(self.group, seq),
            kind=kind,
            aggregate=aggregate,
            revision=revision,
            actor=actor,
            action_id=f"act-{seq}",
            content_hash=bytes(32),
            accepted_at_ms=self.now_ms,
            authoritative=authoritative,
            effects=effects,
            payload_hash=payload_hash_of(body),
            prev_hash=self.head_hash,
        )
        event = Event(body=body, hash=event_hash(**fields), **fields)
        self.events.append(event)
        return event


def workitem_state(
    mission: str,
    state: str,
    *,
    priority: int = 0,
    not_before_ms: int = 0,
    attempt: int = 0,
    ownership_epoch: int = 0,
    lease: dict[str, Any] | None = None,
    checkpoint: Any = None,
) -> dict[str, Any]:
    return {
        "mission": mission,
        "state": state,
        "priority": priority,
        "not_before_ms": not_before_ms,
        "attempt": attempt,
        "ownership_epoch": ownership_epoch,
        "lease": lease,
        "checkpoint": checkpoint,
        "required_resolution": None,
        "cost_spent": 0,
        "contract": {"max_attempts": 3, "lease_ms": 60_000, "start_ms": 10_000},
    }


def lease_record(agent: str, ownership_epoch: int, *, session_epoch: int = 1, now_ms: int = 0) -> dict[str, Any]:
    return {
        "lease_id": f"lease-{agent}-{ownership_epoch}",
        "agent": agent,
        "session_epoch": session_epoch,
        "ownership_epoch": ownership_epoch,
        "granted_at_ms": now_ms,
        "start_by_ms": now_ms + 10_000,
        "expires_at_ms": now_ms + 60_000,
    }


def workload(group: str, count: int, *, seed: int = 1, workitems: int = 12) -> list[Event]:
    """A deterministic Group history of ``count`` Events: a Group, a Mission, Memberships and
    WorkItems moving through queued → leased → queued / blocked / submitted."""
    rng = random.Random(seed)
    chain = ChainBuilder(group)
    chain.event("group.create", f"group:{group}", {f"group:{group}": {"org": "org-1", "status": "active"},
                                                  "member:owner": {"role": "owner", "session_epoch": 1, "status": "active"}},
                {"org": "org-1"})
    chain.event("mission.create", "mission:m1", {"mission:m1": {"title": "m", "status": "open", "cost_spent": 0}},
                {"title": "m"})
    agents = ["agent-a", "agent-b"]
    for agent in agents:
        chain.event("membership.add", f"member:{agent}",
                    {f"member:{agent}": {"role": "worker", "session_epoch": 1, "status": "active"}}, {"role": "worker"})
    while len(chain.events) < count:
        index = rng.randrange(workitems)
        key = f"workitem:w{index}"
        current = chain.states.get(key)
        if current is None:
            state = workitem_state("m1", "queued", priority=rng.randrange(-2, 5), not_before_ms=rng.choice([0, 0, 5_000]))
            chain.event("workitem.create", key, {key: state}, {"priority": state["priority"]})
            continue
        new = dict(current)
        if current["state"] == "queued":
            agent = rng.choice(agents)
            new.update(state="leased", attempt=current["attempt"] + 1, ownership_epoch=current["ownership_epoch"] + 1)
            new["lease"] = lease_record(agent, new["ownership_epoch"], now_ms=chain.now_ms)
            kind = "workitem.claim"
        elif current["state"] == "leased":
            choice = rng.random()
            if choice < 0.4:
                new.update(state="queued", lease=None, checkpoint={"step": rng.randrange(100)})
                kind = "workitem.checkpoint"
            elif choice < 0.6:
                new.update(state="blocked", lease=None)
                kind = "workitem.block"
            elif choice < 0.8:
                new.update(state="submitted", lease=None)
                kind = "workitem.submit"
            else:
                new.update(state="queued", lease=None, not_before_ms=chain.now_ms + 100)
                kind = "workitem.fail"
        elif current["state"] == "blocked":
            new.update(state="queued")
            kind = "workitem.resolve"
        else:
            new.update(state="queued", priority=current["priority"] + 1)
            kind = "workitem.reopen"
        chain.event(kind, key, {key: new}, {"n": len(chain.events)})
    return chain.events


class CountingProjection:
    """An application projection that counts how often each Event reached it: an Event applied
    twice shows a count of 2. It also keeps the last state of each WorkItem it saw."""

    name = "counter"

    def apply(self, view, event):
        key = f"seen:{event.seq:08d}"
        seen = view.get(key)
        view.put(key, struct.pack(">Q", (0 if seen is None else struct.unpack(">Q", seen)[0]) + 1))
        total = view.get("total")
        view.put("total", struct.pack(">Q", (0 if total is None else struct.unpack(">Q", total)[0]) + 1))
        if event.kind.startswith("workitem."):
            state = view.state(event.aggregate)
            view.put(f"last:{event.aggregate}", (state or {}).get("state", "gone").encode())


class RestoringProjection:
    """An application projection with a ``restore`` hook: it notes the snapshot's sequence, and
    SIGKILLs the process there when ``kill_in_restore`` is set (the Group is then cleared and the
    snapshot's aggregates written in the restoring transaction, nothing of it committed)."""

    name = "restoring"
    kill_in_restore = False

    def apply(self, view, event):
        view.put("last", str(event.seq).encode())

    def restore(self, view, snapshot):
        view.put("restored-at", str(snapshot.seq).encode())
        if self.kill_in_restore:
            os.kill(os.getpid(), signal.SIGKILL)


def seen_counts(agent, group: str) -> dict[int, int]:
    """seq -> how many times ``CountingProjection`` saw it."""
    counts = {}
    for key, value in agent.projection_items(group, "counter"):
        if key.startswith(b"seen:"):
            counts[int(key[5:])] = struct.unpack(">Q", value)[0]
    return counts


def apply_all(agent, events, advance=True):
    """Apply ``events`` one by one in one local transaction; advance each Group's Cursor unless
    ``advance`` is False. Returns the statuses."""
    with agent.begin() as tx:
        statuses = [tx.apply(event) for event in events]
        if advance:
            for group in {event.group for event in events}:
                tx.advance_cursor(group)
    return statuses


def interrupt_once_at(monkeypatch: Any, point: str) -> None:
    """Raise KeyboardInterrupt the first time ``failpoints.hit(point)`` is reached (where a
    signal's exception could be raised between two calls); later hits run as usual."""
    from mwpstore import failpoints

    original = failpoints.hit
    armed = [True]

    def hit(name: str) -> None:
        if name == point and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        original(name)

    monkeypatch.setattr(failpoints, "hit", hit)
