"""Stateful property test: one durable AgentStore across its whole lifecycle, fed by an Authority.

An in-process ``Authority`` (temporary directory, a clock the test moves) runs the work-model
rules over two Groups (``g2`` with a replay window): WorkItems created, claimed, started, renewed,
checkpointed, blocked and resolved, submitted, failed, late results kept as Evidence, sessions
replaced, clock jumps and the lease sweep. Its Events reach one durable ``AgentStore`` (the agent
is member ``w1``) through ``Delivery`` (from the authority, or over a ``FaultyTransport``: drops,
duplicates, reordering, disconnects, replays; restoring from the authority's snapshot on
``CURSOR_TOO_OLD``) and through ``tx.apply`` / ``tx.apply_many`` batches of random picks, some
forged (well-formed, not linked to the history), with and without advancing the Cursor, as
``Event`` objects or their bytes. Interleaved with that: ACK and inbox pruning, an application
projection that raises part-way through a transaction or a restore, the outbox (intents,
dispatches whose side effect succeeds, fails or leaves its outcome unknown, marks, reconciles,
retries), the ``OfflineGuard`` (outage, buffered Commands allowed and refused, reconnect with
rebase and re-sign, leases revoked meanwhile), close + reopen in either ``verify`` mode, delete +
rebuild from the authority, ``reset_group`` + rebuild, and restore from the authority's signed
snapshot (with Events buffered beyond it, or refused as a rollback).

The model is plain Python: per Group, delivery simulated Event by Event (applied sequence,
Cursor, pruned and floor sequences, what is buffered and whether it is forged); the outbox
intents with their states and the outside service's effects; the offline records. After every
step:

- the head, inbox and buffer are the model's (the Cursor never passes a gap, equals the applied
  sequence after an advance, and nothing is applied past a gap);
- every projection entry (mirrored state, work queue, queue index, application projections) is
  byte for byte that of a reference store that applied the authority's Events in order from the
  same origin (the Group's start, or the same snapshot) up to the same sequence, and both answer
  ``work_queue`` alike;
- the counting projection saw each Event after the origin exactly once;
- every intent keeps its key, its state is the model's, no key had two effects outside, and no
  side effect ran for an intent whose outcome was unknown before it was reconciled.

``compare_with_fresh_store`` checks that a store built from nothing but the Events mirrors the
same state and queue as the agent, whatever snapshot it was restored from; ``read_work_queue``
that the queue lists exactly the queued WorkItems a claim would be accepted for.

The default run is small; run longer with ``MWPSTORE_STATEFUL_EXAMPLES=500
MWPSTORE_STATEFUL_STEPS=100``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, settings
from hypothesis import event as tally
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agent_store_support import CountingProjection, seen_counts
from authority_helpers import FakeClock
from mwpstore import Authority
from mwpstore.agent_store import AgentStore, IntentState
from mwpstore.delivery import Delivery, FaultyTransport, rebuild_group
from mwpstore.errors import (
    CursorTooOld,
    EventInvalid,
    InvalidCommand,
    InvalidState,
    LeaseMismatch,
    OfflineRefused,
    ProjectionFailed,
    ReconcileRequired,
    Rejection,
    SnapshotInvalid,
    TransportDisconnected,
)
from mwpstore.messages import Command, Event, command_bytes, encode_event, event_hash
from mwpstore.offline import NEVER_OFFLINE_KINDS, BufferedState, OfflineGuard, derive_action_id, sign_command
from mwpstore.registry import MemoryGroup, verify_signature
from mwpstore.snapshot import SnapshotRef
from mwpstore.work_keys import external_idempotency_key
from test_work_model_durable import DurableHarness
from work_model_support import CONTRACT, START_MS, fence_of

AGENT = "w1"
OTHER = "w2"
ACTORS = (AGENT, OTHER)
GROUPS = ("g1", "g2")
WORKITEMS = ("wi1", "wi2", "wi3")
CONSUMER = "agent-w1"
ORG = "org1"
GRACE_MS = 400
WINDOW = 8  # g2's replay window: reads below its newest snapshot at most head - 8 are CURSOR_TOO_OLD
MAP_BYTES = 64 * 1024 * 1024
EXAMPLES = int(os.environ.get("MWPSTORE_STATEFUL_EXAMPLES", "12"))
STEPS = int(os.environ.get("MWPSTORE_STATEFUL_STEPS", "40"))
CHECKS: Counter[str] = Counter()  # steps checked in this process (for a long run's report)


class Boom(Exception):
    """What the flaky application projection raises."""


class FlakyProjection:
    """An application projection that notes each Event's kind (and a snapshot restore), and
    raises at the ``countdown``-th call once armed."""

    name = "flaky"

    def __init__(self) -> None:
        self.countdown: int | None = None

    def apply(self, view, event):
        view.put(f"kind:{event.seq:08d}", event.kind.encode())
        self.tick(event.event_id)

    def restore(self, view, snapshot):
        view.put("restored-at", str(snapshot.seq).encode())
        self.tick(f"the restore at {snapshot.seq}")

    def tick(self, where: str) -> None:
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown <= 0:
                self.countdown = None
                raise Boom(f"projection fails at {where}")


class GroupDriver(DurableHarness):
    """The work-model harness for one Group of an Authority shared with the other Group (and its
    clock): ``DurableHarness`` without an Authority of its own."""

    def __init__(self, authority: Authority, clock: FakeClock, group: str, signing_keys: dict[str, Any]) -> None:
        self.group_id = group
        self.authority = authority
        self.fake_clock = clock
        self.signing_keys = signing_keys
        self.history: list[Event] = []
        self._actions = GROUPS.index(group) * 1_000_000  # Action IDs are the actor's, over every Group

    @property
    def now_ms(self) -> int:
        return self.fake_clock.now_ms

    def attempt(self, actor: str, kind: str, target: str, body: dict[str, Any] | None = None, *, cas: bool = False):
        """Accept the Command if the rules allow it; a typed rejection is a normal outcome."""
        try:
            return self.accept(actor, kind, target, body, cas=cas)
        except Rejection:
            return None

    def head_seq(self) -> int:
        return self.authority.head(self.group_id)[0]

    def accept_command(self, command: Command) -> Event:
        event = super().accept_command(command)
        self.refresh()
        return event

    def refresh(self) -> list[Event]:
        """Every Event of the Group so far, read as they come: a Group with a replay window no
        longer serves those below its floor."""
        while len(self.history) < self.head_seq():
            self.history += self.authority.read(self.group_id, after=len(self.history), limit=1000)
        return self.history

    def more_events(self, count: int) -> None:
        """``count`` more Events (Mission title updates), whatever the WorkItems' states."""
        for _ in range(count):
            self.accept("owner", "mission.update", "m1", {"title": f"title {self.head_seq()}"}, cas=True)


class SideEffectFailed(Exception):
    pass


class Outside:
    """The outside service an intent's side effect reaches. It does not deduplicate: every call
    that gets through takes effect, with a receipt of its own. ``lookup`` answers the latest."""

    def __init__(self) -> None:
        self.receipts: dict[str, list[dict[str, Any]]] = {}
        self.calls: list[str] = []

    def perform(self, key: str) -> dict[str, Any]:
        receipts = self.receipts.setdefault(key, [])
        receipts.append({"done": key[:16], "n": len(receipts)})
        return receipts[-1]

    def latest(self, key: str) -> dict[str, Any] | None:
        receipts = self.receipts.get(key)
        return receipts[-1] if receipts else None

    def lookup(self, intent) -> dict[str, Any] | None:
        return self.latest(intent.key)


def without_heads(rows: list[tuple[str, bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """A projection dump's entries without its head rows (applied seq, hash and Cursor)."""
    return [row for row in rows if row[0] != "heads"]


def forged(event: Event) -> Event:
    """A well-formed Event for the same sequence that does not link to the Group's history (its
    ``prev_hash`` is another): buffered beyond a gap, dropped when the gap fills, refused when it
    is next, a conflict while the inbox holds the genuine one."""
    fields = msgspec.structs.asdict(event)
    del fields["body"], fields["hash"]
    fields["prev_hash"] = bytes(byte ^ 0x5A for byte in event.prev_hash)
    return Event(body=event.body, hash=event_hash(**fields), **fields)


@dataclass
class GroupModel:
    """What the agent store should hold of one Group: delivery is simulated Event by Event."""

    applied: int = 0
    cursor: int = 0
    pruned: int = 0
    floor: int = 0
    buffer: dict[int, bool] = field(default_factory=dict)  # seq -> the buffered Event is forged

    def copy(self) -> GroupModel:
        return GroupModel(self.applied, self.cursor, self.pruned, self.floor, dict(self.buffer))

    def deliver(self, seq: int, is_forged: bool) -> str:
        """One delivered Event: ``applied``, ``duplicate``, ``buffered`` or ``invalid``."""
        if seq <= self.applied:
            return "invalid" if is_forged and seq > self.pruned else "duplicate"
        if seq == self.applied + 1:
            if is_forged:
                return "invalid"
            self.applied = seq
            self.drain()
            return "applied"
        if self.buffer.get(seq) is is_forged:
            return "duplicate"
        self.buffer[seq] = is_forged
        return "buffered"

    def drain(self) -> None:
        while self.buffer:
            is_forged = self.buffer.pop(self.applied + 1, None)
            if is_forged is None or is_forged:
                return  # a gap, or a buffered Event that does not link: dropped, the gap stays
            self.applied += 1

    def restored(self, seq: int) -> None:
        self.applied = self.cursor = self.pruned = self.floor = seq
        self.buffer = {later: is_forged for later, is_forged in self.buffer.items() if later > seq}
        self.drain()


class AgentLifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="mwp-agentlife-")
        self.clock = FakeClock(START_MS)
        self.authority = Authority.open(os.path.join(self.directory, "authority"), clock=self.clock, sync=False)
        self.key = Ed25519PrivateKey.generate()
        self.public_key = self.key.public_key().public_bytes_raw()
        keys = {AGENT: self.key}
        self.drivers = {group: GroupDriver(self.authority, self.clock, group, keys) for group in GROUPS}
        for driver in self.drivers.values():
            policy = {"replay_window_events": WINDOW} if driver.group_id == "g2" else {}
            driver.accept("owner", "group.create", driver.group_id, {"org": ORG, "policy": policy})
            driver.accept("owner", "membership.add", AGENT, {"role": "worker", "public_key": self.public_key.hex()}, cas=True)
            driver.accept("owner", "membership.add", OTHER, {"role": "worker"}, cas=True)
            driver.accept("owner", "mission.create", "m1", {"title": "one", "cost_limit": 1_000, "approval_required": []})
            driver.create_workitem("wi1")
            driver.create_workitem("wi2", priority=1)
            driver.claim_and_start(AGENT, "wi1")
        self.agent: AgentStore | None = None
        self.reference: AgentStore | None = None
        self.with_projections = False
        self.verify = "full"
        self.flaky = FlakyProjection()
        # the model
        self.model = {group: GroupModel() for group in GROUPS}
        self.intents: dict[str, dict[str, Any]] = {}
        self.outside = Outside()
        self.lifetimes: Counter[str] = Counter()  # intent key -> how many stores recorded it
        self.offline = {group: False for group in GROUPS}
        self.records: dict[str, list[BufferedState]] = {group: [] for group in GROUPS}
        self.leases_seen: dict[tuple[str, str], list[dict[str, Any]]] = {}

    # -- set-up and teardown --------------------------------------------------------------------

    def projections(self) -> list[Any]:
        return [CountingProjection(), self.flaky] if self.with_projections else []

    def open_agent(self) -> AgentStore:
        return AgentStore.open(
            os.path.join(self.directory, "agent"), projections=self.projections(), verify=self.verify,
            trusted_keys=[self.authority.signing_key.public_key], map_size=MAP_BYTES, clock=self.clock,
        )

    @initialize(with_projections=st.booleans(), verify=st.sampled_from(["full", "trusted"]))
    def open_stores(self, with_projections: bool, verify: str) -> None:
        self.with_projections = with_projections
        self.verify = verify
        self.agent = self.open_agent()
        reference_projections = [CountingProjection(), FlakyProjection()] if with_projections else []
        self.reference = AgentStore.open(
            os.path.join(self.directory, "reference"), projections=reference_projections, verify="trusted",
            trusted_keys=[self.authority.signing_key.public_key], map_size=MAP_BYTES,
        )

    def teardown(self) -> None:
        for store in (self.agent, self.reference):
            if store is not None:
                store.close()
        self.authority.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def guard(self, group: str) -> OfflineGuard:
        assert self.agent is not None
        return OfflineGuard(self.agent, group, AGENT, grace_ms=GRACE_MS)

    def events(self, group: str, after: int = 0, until: int | None = None) -> list[Event]:
        history = self.drivers[group].refresh()
        return history[after:until]

    # -- model updates --------------------------------------------------------------------------

    def delivered(self, group: str, seqs: list[int], *, advance: bool) -> None:
        """A committed transaction delivered the genuine Events ``seqs`` of ``group``, in order."""
        model = self.model[group]
        for seq in seqs:
            model.deliver(seq, False)
        if advance:
            model.cursor = model.applied

    def deliver(self, group: str, source: Any = None, *, whole: bool = True, batch: int = 1000,
                consumer: str | None = None, rebuild: bool = False) -> None:
        """Deliver ``group`` through ``Delivery`` from ``source`` (the authority by default), which
        restores from the authority's snapshot on CURSOR_TOO_OLD; the model follows what each
        round did: a read (one local commit), a refusal below the floor, a restore. With
        ``rebuild``, through ``rebuild_group`` (the model already forgot the Group): its first read
        only tells whether the Group starts at a replay floor, and a snapshot then replaces the
        Group in one local commit."""
        assert self.agent is not None
        driver = self.drivers[group]
        rounds: list[tuple[Any, ...]] = []

        class Recording:
            def read(self, group_: str, after: int = 0, limit: int = 1000) -> list[Event]:
                driver.refresh()
                try:
                    events = list((source or driver.authority).read(group_, after=after, limit=limit))
                except CursorTooOld as exc:
                    rounds.append(("too old", exc.detail["floor"]))
                    raise
                rounds.append(("read", [event.seq for event in events]))
                return events

            def ack(self, consumer_: str, group_: str, cursor: int) -> int:
                return driver.authority.ack(consumer_, group_, cursor)

        def fetch(error: CursorTooOld) -> bytes:
            ref = SnapshotRef.from_dict(error.snapshot_ref)
            data = driver.authority.read_snapshot(ref)
            rounds.append(("restore", data, ref.seq))
            return data

        delivery = Delivery(self.agent, Recording(), consumer=consumer, batch_events=batch, restore_snapshot=fetch,
                            org=ORG)
        if rebuild:
            rebuild_group(self.agent, Recording(), group, batch_events=batch, restore_snapshot=fetch, org=ORG)
            if rounds.pop(0)[0] == "too old":  # the read before the reset or the restore: nothing of it is applied
                tally("rebuilt from a snapshot")
        else:
            try:
                delivery.catch_up(group) if whole else delivery.pull_once(group)
            except TransportDisconnected:
                assert not whole
        model = self.model[group]
        for round_ in rounds:
            if round_[0] == "read":
                self.delivered(group, round_[1], advance=True)
            elif round_[0] == "too old":
                floor = round_[1]
                if model.cursor < floor <= model.applied:  # applied past the floor: no restore
                    model.cursor = model.applied
                tally("cursor too old")
            else:
                self.restored(group, round_[1], round_[2])
                tally("restored by Delivery")
        if whole:
            assert model.applied == driver.head_seq()

    def restored(self, group: str, data: bytes, seq: int) -> None:
        """The agent restored ``group`` from the snapshot ``data`` at ``seq``; so does the
        reference."""
        assert self.reference is not None
        self.model[group].restored(seq)
        self.reference.reset_group(group)
        self.reference.restore(data, group=group, org=ORG)

    def rebuild(self, group: str) -> None:
        """Forget ``group`` and deliver it again from the authority (``rebuild_group``; for the
        Group with a replay window, with the callback that fetches the authority's snapshot)."""
        assert self.agent is not None and self.reference is not None
        self.model[group] = GroupModel()
        self.reference.reset_group(group)
        if group == "g2":
            self.deliver(group, batch=5, rebuild=True)
        else:
            rebuild_group(self.agent, self.authority, group, batch_events=5)
            self.delivered(group, list(range(1, self.drivers[group].head_seq() + 1)), advance=True)

    # -- the authority: work-model transitions ---------------------------------------------------

    @rule(group=st.sampled_from(GROUPS), workitem=st.sampled_from(WORKITEMS), priority=st.integers(-1, 2))
    def create_workitem(self, group: str, workitem: str, priority: int) -> None:
        driver = self.drivers[group]
        if driver.get(f"workitem:{workitem}") is None:
            driver.create_workitem(workitem, priority=priority)

    @rule(group=st.sampled_from(GROUPS), actor=st.sampled_from(ACTORS), workitem=st.sampled_from(WORKITEMS))
    def claim(self, group: str, actor: str, workitem: str) -> None:
        driver = self.drivers[group]
        if driver.get(f"workitem:{workitem}") is None:
            return
        session_epoch = driver.member(actor)["session_epoch"]
        driver.attempt(actor, "workitem.claim", workitem, {"session_epoch": session_epoch}, cas=True)
        self.note_lease(group, workitem)

    def note_lease(self, group: str, workitem: str) -> None:
        lease = (self.drivers[group].get(f"workitem:{workitem}") or {}).get("lease")
        seen = self.leases_seen.setdefault((group, workitem), [])
        if lease and all(lease["lease_id"] != earlier["lease_id"] for earlier in seen):
            seen.append(lease)

    def stale_lease(self, group: str, workitem: str) -> dict[str, Any] | None:
        """A lease the WorkItem had before its current one (or its only one)."""
        seen = self.leases_seen.get((group, workitem), [])
        return seen[-2] if len(seen) > 1 else (seen[0] if seen else None)

    @rule(
        group=st.sampled_from(GROUPS),
        workitem=st.sampled_from(WORKITEMS),
        operation=st.sampled_from(["start", "renew", "checkpoint", "block", "submit", "fail"]),
        stale=st.booleans(),
    )
    def lease_operation(self, group: str, workitem: str, operation: str, stale: bool) -> None:
        """The lease holder (or, with ``stale``, the holder of an earlier lease: a late result kept
        as Evidence) acts on its WorkItem."""
        driver = self.drivers[group]
        state = driver.get(f"workitem:{workitem}")
        if state is None:
            return
        self.note_lease(group, workitem)
        lease = self.stale_lease(group, workitem) if stale else state.get("lease")
        if not lease:
            return
        actor, fence = lease["agent"], fence_of(lease)
        n = driver.head_seq()
        if operation == "start":
            driver.attempt(actor, "workitem.start", workitem, fence)
        elif operation == "renew":
            driver.attempt(actor, "lease.renew", workitem, fence, cas=True)
        elif operation == "checkpoint":
            driver.attempt(actor, "workitem.checkpoint", workitem, {**fence, "checkpoint": {"n": n}})
        elif operation == "block":
            driver.attempt(actor, "workitem.block", workitem,
                           {**fence, "checkpoint": {"n": n}, "required_resolution": "key"})
        elif operation == "submit":
            driver.attempt(actor, "workitem.submit", workitem, {**fence, "submission": {"n": n}})
        else:
            driver.attempt(actor, "workitem.fail", workitem, {**fence, "reason": "flaky"})

    @rule(group=st.sampled_from(GROUPS), workitem=st.sampled_from(WORKITEMS))
    def resolve(self, group: str, workitem: str) -> None:
        self.drivers[group].attempt("owner", "workitem.resolve", workitem, {"resolution": "given"})

    @rule(group=st.sampled_from(GROUPS), actor=st.sampled_from(ACTORS))
    def replace_session(self, group: str, actor: str) -> None:
        driver = self.drivers[group]
        driver.attempt(actor, "session.replace", actor, {"session_epoch": driver.member(actor)["session_epoch"]})

    @rule(milliseconds=st.sampled_from([10, 150, 250, 1_100]))
    def advance_clock(self, milliseconds: int) -> None:
        self.clock.advance(milliseconds)

    @rule(group=st.sampled_from(GROUPS))
    def expire_leases(self, group: str) -> None:
        self.authority.expire_leases(group)
        self.drivers[group].refresh()

    # -- delivery -------------------------------------------------------------------------------

    @rule(
        group=st.sampled_from(GROUPS),
        seed=st.integers(0, 2**16),
        drop=st.sampled_from([0.0, 0.2, 0.5]),
        duplicate=st.sampled_from([0.0, 0.3]),
        reorder=st.sampled_from([0.0, 0.5, 1.0]),
        disconnect=st.sampled_from([0.0, 0.2]),
        replay=st.integers(0, 5),
        batch=st.integers(1, 7),
        whole=st.booleans(),
    )
    def deliver_through_faulty_transport(
        self, group, seed, drop, duplicate, reorder, disconnect, replay, batch, whole
    ) -> None:
        transport = FaultyTransport(self.authority, seed=seed, drop=drop, duplicate=duplicate, reorder=reorder,
                                    disconnect=disconnect, replay=replay)
        self.deliver(group, transport, whole=whole, batch=batch, consumer=CONSUMER)

    @rule(
        more=st.integers(0, 3),
        ahead=st.sampled_from([None, 0, 1, 3]),
        replay=st.sampled_from([None, 0, 4]),
        seed=st.integers(0, 2**16),
    )
    def fall_behind_the_replay_floor(self, more: int, ahead: int | None, replay: int | None, seed: int) -> None:
        """g2's authority snapshots its head and moves on past its replay window, so that a read
        from the agent's Cursor may be CURSOR_TOO_OLD. With ``ahead``, the agent first applied
        up to ``ahead`` Events past the floor without advancing its Cursor; then it catches up,
        from the authority or (``replay``) through a transport that replays Events."""
        group = "g2"
        driver = self.drivers[group]
        floor = self.authority.snapshot(group).seq
        driver.more_events(WINDOW + more)
        assert self.authority.replay_floor(group)[0] == floor
        if ahead is not None and floor + ahead > self.model[group].applied:
            self.apply_batch(group, [(pick, False) for pick in range(1, floor + ahead - self.model[group].applied + 1)],
                             True, False, False)
        source = None if replay is None else FaultyTransport(self.authority, seed=seed, drop=0.0, duplicate=0.2,
                                                             reorder=0.5, disconnect=0.0, replay=replay)
        self.deliver(group, source, batch=4)

    @rule(
        group=st.sampled_from(GROUPS),
        picks=st.lists(st.tuples(st.integers(-3, 8), st.sampled_from([False, False, False, True])), max_size=12),
        many=st.booleans(),
        advance=st.booleans(),
        as_bytes=st.booleans(),
        whole=st.booleans(),
    )
    def apply_batch(
        self, group: str, picks: list[tuple[int, bool]], many: bool, advance: bool, as_bytes: bool, whole: bool = False
    ) -> None:
        """A batch of Events near the applied sequence (some before it: duplicates; some beyond a
        gap: buffered; some forged: refused, or buffered and dropped when the gap fills), in the
        picked order, through ``apply`` or ``apply_many``: each refused Event alone, or with
        ``whole`` the batch given to ``apply_many`` again after each refused Event."""
        assert self.agent is not None
        head = self.drivers[group].head_seq()
        base = self.model[group].applied
        chosen = [(base + pick, is_forged) for pick, is_forged in picks if 1 <= base + pick <= head]
        if not chosen:
            return
        by_seq = {event.seq: event for event in self.events(group, min(seq for seq, _ in chosen) - 1,
                                                           max(seq for seq, _ in chosen))}
        model = self.model[group].copy()
        expected, applied_after = [], []
        for seq, is_forged in chosen:
            expected.append(model.deliver(seq, is_forged))
            applied_after.append(model.applied)
        batch: list[Any] = [forged(by_seq[seq]) if is_forged else by_seq[seq] for seq, is_forged in chosen]
        if as_bytes:
            batch = [encode_event(event) for event in batch]
        statuses: list[str] = []
        with self.agent.begin() as tx:
            start = 0
            while start < len(batch):
                if many and whole:  # refused Events inside the batch: apply_many stops at the first
                    try:
                        statuses += [status.value for status in tx.apply_many(batch[start:])]
                        break
                    except EventInvalid:
                        end = expected.index("invalid", start)
                        assert tx.applied_seq(group) == applied_after[end]  # the Events before it stay applied
                        statuses += expected[start:end] + ["invalid"]
                        start = end + 1
                        continue
                if expected[start] == "invalid":
                    with pytest.raises(EventInvalid):
                        tx.apply(batch[start])
                    statuses.append("invalid")
                    start += 1
                    continue
                end = expected.index("invalid", start) if "invalid" in expected[start:] else len(batch)
                if many:
                    found = tx.apply_many(batch[start:end])
                else:
                    found = [tx.apply(event) for event in batch[start:end]]
                statuses += [status.value for status in found]
                start = end
            if advance:
                tx.advance_cursor(group)
        assert statuses == expected, (chosen, statuses, expected)
        if advance:
            model.cursor = model.applied
        self.model[group] = model
        tally(f"batch with {sum(1 for _, is_forged in chosen if is_forged)} forged")

    @rule(group=st.sampled_from(GROUPS), ack=st.booleans())
    def prune_inbox(self, group: str, ack: bool) -> None:
        assert self.agent is not None
        cursor = self.agent.ack_position(group)
        model = self.model[group]
        assert cursor == model.cursor
        if ack and cursor:
            assert self.authority.ack(CONSUMER, group, cursor) >= cursor
        removed = self.agent.prune_inbox(group)
        assert removed == max(0, model.cursor - model.pruned)
        model.pruned = max(model.pruned, model.cursor)

    @rule(group=st.sampled_from(GROUPS), limit=st.integers(1, 3), later=st.sampled_from([0, 300, 5_000]),
          catch_up=st.booleans(), prepare=st.sampled_from([None, None, "fail", "lapse"]))
    def read_work_queue(self, group: str, limit: int, later: int, catch_up: bool, prepare: str | None) -> None:
        """The queue, against the rules: with ``prepare``, each leased WorkItem first fails
        (queued again after a backoff), or w2 claims ``wi2`` and lets its start window lapse
        until its attempts are used up."""
        assert self.agent is not None and self.reference is not None
        driver = self.drivers[group]
        if prepare == "fail":
            for workitem in WORKITEMS:
                lease = (driver.get(f"workitem:{workitem}") or {}).get("lease")
                if lease:
                    driver.attempt(lease["agent"], "workitem.fail", workitem, {**fence_of(lease), "reason": "flaky"})
        elif prepare == "lapse":
            for _ in range(CONTRACT["max_attempts"]):
                self.claim(group, OTHER, "wi2")
                self.clock.advance(CONTRACT["start_ms"] + 1)
                self.expire_leases(group)
        if catch_up:
            self.deliver(group)
            self.projections_equal_the_reference()  # the reference follows
        now = self.clock.now_ms + later
        whole = self.agent.work_queue(group, now)
        assert self.agent.work_queue(group, now, limit=limit) == whole[:limit]
        assert whole == self.reference.work_queue(group, now)
        # Listed exactly when a claim at ``now`` would be accepted: the Group as of the agent's
        # applied sequence, in memory, asked for a claim of each queued WorkItem by w2.
        listed = {entry.workitem for entry in whole}
        replica = MemoryGroup(group)
        for item in self.events(group, 0, self.model[group].applied):
            replica.apply(item)
        for key, state in sorted(replica.states.items()):
            if not key.startswith("workitem:") or state["state"] != "queued":
                continue
            workitem = key.split(":", 1)[1]
            CHECKS["queued WorkItems tried"] += 1
            trial = copy.deepcopy(replica)
            claim = Command(actor=OTHER, action_id="queue-check", group=group, kind="workitem.claim", target=workitem,
                            body={"session_epoch": trial.get(f"member:{OTHER}")["session_epoch"]},
                            expected_revision=trial.revision(key))
            try:
                trial.accept(claim, now_ms=now)
                claimable = True
            except Rejection as exc:
                claimable = False
                tally(f"queue leaves out: {exc.code}")
                CHECKS[f"queue leaves out: {exc.code}"] += 1
            assert (workitem in listed) == claimable, (workitem, state, now)
        assert listed <= {key.split(":", 1)[1] for key, state in replica.states.items()
                          if key.startswith("workitem:") and state["state"] == "queued"}

    @precondition(lambda self: self.with_projections)
    @rule(
        group=st.sampled_from(GROUPS),
        countdown=st.integers(1, 4),
        many=st.booleans(),
        caught=st.booleans(),
        intent=st.booleans(),
    )
    def projection_fails(self, group: str, countdown: int, many: bool, caught: bool, intent: bool) -> None:
        """An application projection raises part-way through a transaction that applied Events,
        buffered one, recorded an intent and advanced the Cursor: nothing of it is committed."""
        assert self.agent is not None
        pending = self.drivers[group].head_seq() - self.model[group].applied
        self.drivers[group].more_events(max(0, 2 - pending))
        events = self.events(group, self.model[group].applied)
        countdown = min(countdown, len(events))  # the projection sees each of them once
        before = self.store_picture()
        batch = events[1:2] + events  # one beyond the gap first (buffered), then all in order
        self.flaky.countdown = countdown
        try:
            with pytest.raises((Boom, ProjectionFailed)) as raised:
                with self.agent.begin() as tx:
                    if intent:
                        tx.record_intent(group, mission="m1", workitem="wi-doomed", ownership_epoch=1, operation="never")
                    try:
                        if many:
                            tx.apply_many(batch)
                        else:
                            for event in batch:
                                tx.apply(event)
                    except Boom:
                        if not caught:
                            raise
                    tx.advance_cursor(group)
        finally:
            self.flaky.countdown = None
        assert type(raised.value) is (ProjectionFailed if caught else Boom)
        tally("projection failed part-way")
        assert self.store_picture() == before, "an aborted local transaction left something behind"

    def store_picture(self) -> Any:
        assert self.agent is not None
        return (
            self.agent.projection_dump(),
            [(group, self.agent.head(group), self.agent.inbox_seqs(group), self.agent.buffered_seqs(group))
             for group in GROUPS],
            self.agent.intents(),
        )

    # -- the outbox -----------------------------------------------------------------------------

    @rule(
        group=st.sampled_from(GROUPS),
        workitem=st.sampled_from(WORKITEMS),
        epoch=st.integers(0, 2),
        operation=st.sampled_from(["notify", "charge-card"]),
        n=st.integers(0, 3),
    )
    def record_intent(self, group: str, workitem: str, epoch: int, operation: str, n: int) -> None:
        assert self.agent is not None
        key = external_idempotency_key("m1", workitem, epoch, operation)
        known = self.intents.get(key)
        if known is not None and known["group"] != group:
            with pytest.raises(InvalidCommand):
                with self.agent.begin() as tx:
                    tx.record_intent(group, mission="m1", workitem=workitem, ownership_epoch=epoch,
                                     operation=operation, request={"n": n})
            return
        with self.agent.begin() as tx:
            intent = tx.record_intent(group, mission="m1", workitem=workitem, ownership_epoch=epoch,
                                      operation=operation, request={"n": n})
        assert intent.key == key
        if known is None:
            self.lifetimes[key] += 1
            self.intents[key] = {"group": group, "state": IntentState.INTENDED, "request": {"n": n},
                                 "dispatches": 0, "receipt": None}
        assert intent.request == self.intents[key]["request"]
        assert intent.state == self.intents[key]["state"]

    def pick_intent(self, index: int) -> str:
        """One of the intents the model knows (one recorded now if there is none)."""
        if not self.intents:
            self.record_intent(GROUPS[index % 2], WORKITEMS[index % 3], index % 2, "notify", index)
        keys = sorted(self.intents)
        return keys[index % len(keys)]

    @rule(index=st.integers(0, 20), outcome=st.sampled_from(["ok", "fails", "uncertain"]), with_lookup=st.booleans())
    def dispatch(self, index: int, outcome: str, with_lookup: bool) -> None:
        assert self.agent is not None
        key = self.pick_intent(index)
        model = self.intents[key]
        calls = len(self.outside.calls)

        def side_effect(intent):
            assert intent.key == key
            self.outside.calls.append(key)
            assert self.agent.intent(key).state == IntentState.DISPATCHED  # marked before the call
            if outcome == "fails":
                raise SideEffectFailed("refused before it did anything")
            receipt = self.outside.perform(key)
            if outcome == "uncertain":
                raise SideEffectFailed("timed out after the request was sent")
            return receipt

        lookup = self.outside.lookup if with_lookup else None
        state = model["state"]
        if state == IntentState.DONE:
            assert self.agent.dispatch(key, side_effect, lookup=lookup) == model["receipt"]
            assert len(self.outside.calls) == calls
            return
        if state in (IntentState.DISPATCHED, IntentState.UNCERTAIN):
            if not with_lookup:
                with pytest.raises(ReconcileRequired):
                    self.agent.dispatch(key, side_effect)
                assert len(self.outside.calls) == calls, "an uncertain intent was retried before reconcile"
                return
            found = self.outside.latest(key)
            if found is not None:
                assert self.agent.dispatch(key, side_effect, lookup=lookup) == found
                assert len(self.outside.calls) == calls
                model.update(state=IntentState.DONE, receipt=found)
                return
        if outcome == "ok":
            receipt = self.agent.dispatch(key, side_effect, lookup=lookup)
            assert receipt == self.outside.latest(key)
            model.update(state=IntentState.DONE, receipt=receipt)
        else:
            with pytest.raises(SideEffectFailed):
                self.agent.dispatch(key, side_effect, lookup=lookup)
            model.update(state=IntentState.UNCERTAIN)
        model["dispatches"] += 1
        tally(f"dispatch called: {outcome}")
        assert len(self.outside.calls) == calls + 1

    @rule(index=st.integers(0, 20))
    def reconcile(self, index: int) -> None:
        assert self.agent is not None
        key = self.pick_intent(index)
        model = self.intents[key]
        intent = self.agent.reconcile(key, self.outside.lookup)
        if model["state"] in (IntentState.DISPATCHED, IntentState.UNCERTAIN):
            found = self.outside.latest(key)
            if found is None:
                model["state"] = IntentState.RECONCILED
            else:
                model.update(state=IntentState.DONE, receipt=found)
        assert intent.state == model["state"]

    @rule(index=st.integers(0, 20))
    def mark_dispatched_then_lose_track(self, index: int) -> None:
        """The application marks an intent dispatched and then dies before any outcome (its call
        may or may not have gone out)."""
        assert self.agent is not None
        key = self.pick_intent(index)
        model = self.intents[key]
        if model["state"] in (IntentState.INTENDED, IntentState.RECONCILED):
            self.agent.mark_dispatched(key)
            model["state"] = IntentState.DISPATCHED
            model["dispatches"] += 1
        else:
            with pytest.raises(ReconcileRequired):
                self.agent.mark_dispatched(key)

    @rule(index=st.integers(0, 20))
    def mark_uncertain(self, index: int) -> None:
        assert self.agent is not None
        key = self.pick_intent(index)
        model = self.intents[key]
        if model["state"] in (IntentState.INTENDED, IntentState.RECONCILED):
            with pytest.raises(InvalidState):
                self.agent.mark_uncertain(key, "lost")
            return
        intent = self.agent.mark_uncertain(key, "lost")
        if model["state"] != IntentState.DONE:
            model["state"] = IntentState.UNCERTAIN
        assert intent.state == model["state"]

    # -- offline --------------------------------------------------------------------------------

    @rule(group=st.sampled_from(GROUPS))
    def service_unreachable(self, group: str) -> None:
        guard = self.guard(group)
        guard.service_unreachable(self.clock.now_ms)
        self.offline[group] = True
        assert guard.offline

    @rule(
        group=st.sampled_from(GROUPS),
        workitem=st.sampled_from(WORKITEMS),
        kind=st.sampled_from(["workitem.checkpoint", "lease.renew", "workitem.block", "workitem.submit",
                              "workitem.claim"]),
        reversible=st.booleans(),
        visible=st.booleans(),
        stale=st.booleans(),
        later=st.sampled_from([0, 50, 500]),
        prepare=st.booleans(),
    )
    def buffer_command(self, group, workitem, kind, reversible, visible, stale, later, prepare) -> None:
        """``w1`` buffers a Command on a WorkItem, fenced with the lease the agent's mirror shows
        (or, with ``stale``, one the authority saw earlier). With ``prepare`` the agent first
        catches up and then loses the service."""
        assert self.agent is not None
        guard = self.guard(group)
        if prepare:  # a Command the guard should allow, on a WorkItem w1 holds if there is one
            self.deliver(group)
            self.service_unreachable(group)
            kind = kind if kind in ("workitem.checkpoint", "lease.renew") else "workitem.checkpoint"
            reversible, visible, later = True, False, 0
            held = [wi for wi in WORKITEMS if ((self.agent.state(group, f"workitem:{wi}") or {}).get("lease") or {})
                    .get("agent") == AGENT]
            workitem = held[0] if held else workitem
        mirrored = self.agent.state(group, f"workitem:{workitem}")
        lease = self.stale_lease(group, workitem) if stale else (mirrored or {}).get("lease")
        body: dict[str, Any] = fence_of(lease) if lease else {"lease_id": "none", "ownership_epoch": 0}
        cas = kind == "lease.renew"
        if kind == "workitem.checkpoint":
            body["checkpoint"] = {"offline": len(self.records[group])}
        elif kind == "workitem.block":
            body.update(checkpoint={"offline": 1}, required_resolution="key")
        elif kind == "workitem.submit":
            body["submission"] = {"offline": 1}
        elif kind == "workitem.claim":
            body = {"session_epoch": 1}
        revision = self.agent.revision(group, f"workitem:{workitem}") if cas else None
        command = sign_command(
            Command(actor=AGENT, action_id=f"off-{group}-{len(self.records[group])}-{self.clock.now_ms}", group=group,
                    kind=kind, target=workitem, body=body, expected_revision=revision),
            self.key,
        )
        count = len(guard.buffered())
        try:
            record = guard.buffer(command, now_ms=self.clock.now_ms + later, reversible=reversible, externally_visible=visible)
        except OfflineRefused as exc:
            reason = exc.detail.get("reason")
            tally(f"buffer refused: {reason}")
            if not self.offline[group]:
                assert reason in ("online", "no_current_lease")
            elif kind in NEVER_OFFLINE_KINDS:
                assert reason == "kind"
            elif visible:
                assert reason == "externally_visible"
            elif not reversible:
                assert reason == "irreversible"
            assert len(guard.buffered()) == count
            return
        assert self.offline[group] and reversible and not visible and kind not in NEVER_OFFLINE_KINDS
        held = mirrored["lease"]
        assert held["agent"] == AGENT and (record.binding.lease_id, record.binding.ownership_epoch) == (
            held["lease_id"], held["ownership_epoch"])
        assert record.command == command and record.state is BufferedState.BUFFERED
        outage = guard.outage()
        assert outage is not None
        deadline = min(outage.since_ms + GRACE_MS, held["expires_at_ms"])
        assert record.binding.grace_deadline_ms == deadline and self.clock.now_ms + later < deadline
        assert held.get("started") and record.binding.session_epoch == held["session_epoch"]
        self.records[group].append(BufferedState.BUFFERED)
        tally("buffer stored")
        assert len(guard.buffered()) == count + 1

    @rule(
        group=st.sampled_from(GROUPS),
        meanwhile=st.sampled_from(["nothing", "session", "lapse", "checkpoint"]),
        lost=st.sampled_from([None, None, "request", "answer"]),
        buffer_first=st.sampled_from([None, "workitem.checkpoint", "lease.renew"]),
    )
    def reconnect(self, group: str, meanwhile: str, lost: str | None, buffer_first: str | None) -> None:
        """Reconnect: each pending record is checked against the mirror right after its ``sync``
        (a full catch-up), then refused, or rebased, re-signed and submitted; one rebased by an
        earlier reconnect is sent as it was stored. Before it, the authority may have revoked
        ``w1``'s leases (a session replaced, leases lapsed and swept) or ``w1`` checkpointed its
        WorkItem through another path. With ``lost``, the connection drops at the first send,
        before the authority got the Command or after it accepted it: the reconnect raises, the
        record stays rebased, and the outage stands. With ``buffer_first``, a Command of that kind
        is buffered first (as ``buffer_command`` with ``prepare``)."""
        assert self.agent is not None
        guard = self.guard(group)
        driver = self.drivers[group]
        if buffer_first is not None:
            self.buffer_command(group, "wi1", buffer_first, True, False, False, 0, True)
        if meanwhile == "session":
            self.replace_session(group, AGENT)
        elif meanwhile == "lapse":
            self.clock.advance(CONTRACT["lease_ms"] + 1)
            self.expire_leases(group)
        elif meanwhile == "checkpoint":
            for workitem in WORKITEMS:
                lease = (driver.get(f"workitem:{workitem}") or {}).get("lease")
                if lease and lease["agent"] == AGENT:
                    driver.attempt(AGENT, "workitem.checkpoint", workitem, {**fence_of(lease), "checkpoint": {"online": 1}})
        pending = [record for record in guard.buffered() if record.state in (BufferedState.BUFFERED, BufferedState.REBASED)]
        leases: list[Any] = []
        submitted: list[Command] = []

        def sync() -> None:
            self.deliver(group)
            record = pending[len(leases)]
            leases.append((driver.get(f"workitem:{record.binding.workitem}") or {}).get("lease"))

        def submit(command: Command):
            submitted.append(command)
            try:
                if lost == "request" and len(submitted) == 1:
                    raise TransportDisconnected("the connection dropped before the Command got through")
                receipt = self.authority.accept(command)
                if lost == "answer" and len(submitted) == 1:
                    raise TransportDisconnected("the connection dropped before the receipt came back")
                return receipt
            finally:
                driver.refresh()

        try:
            outcomes = guard.reconnect(submit, signing_key=self.key, sync=sync)
        except TransportDisconnected:
            assert lost is not None and len(submitted) == 1
            outcomes = None
        if outcomes is not None:
            assert [outcome.number for outcome in outcomes] == [record.number for record in pending]
            assert len(leases) == len(pending)
        sent = iter(submitted)
        stored = {record.number: record for record in guard.buffered()}
        for record, lease, outcome in zip(pending, leases, outcomes or [None] * len(leases)):
            binding = record.binding
            current = (lease is not None and lease["agent"] == AGENT and lease["lease_id"] == binding.lease_id
                       and lease["ownership_epoch"] == binding.ownership_epoch)
            now = stored[record.number]
            if record.state is BufferedState.BUFFERED and not current:
                assert now.state is BufferedState.REFUSED and now.error_code == LeaseMismatch.code, now
                tally("reconnect: refused")
                continue
            command = next(sent)
            if outcome is None:  # the send that was lost: stored as rebased, sent again next time
                assert now.state is BufferedState.REBASED and now.rebased == command
                tally(f"reconnect: lost the {lost}")
                break
            tally(f"reconnect: {outcome.state.value}" + (" (resent)" if record.state is BufferedState.REBASED else ""))
            assert outcome.state in (BufferedState.SUBMITTED, BufferedState.REJECTED), outcome
            assert now.state is outcome.state
            if record.state is BufferedState.REBASED:
                assert command == record.rebased  # never rebased twice
                continue
            verify_signature(self.public_key, command_bytes(command), command.signature)
            original = record.command
            if command.expected_revision != original.expected_revision:
                assert command.action_id == derive_action_id(original.action_id,
                                                             {"expected_revision": command.expected_revision})
            else:
                assert command.action_id == original.action_id
            assert command.body == original.body
        assert next(sent, None) is None
        self.records[group] = [record.state for record in guard.buffered()]
        if outcomes is None:
            assert guard.offline
            return
        assert not {BufferedState.BUFFERED, BufferedState.REBASED} & set(self.records[group])
        self.offline[group] = False
        assert not guard.offline

    # -- lifecycle ------------------------------------------------------------------------------

    @rule(verify=st.sampled_from(["full", "trusted"]))
    def close_and_reopen(self, verify: str) -> None:
        assert self.agent is not None
        self.agent.close()
        self.verify = verify
        self.agent = self.open_agent()

    @rule(verify=st.sampled_from(["full", "trusted"]))
    def delete_and_rebuild(self, verify: str) -> None:
        """The store's directory is deleted and every Group rebuilt from the authority: its own
        records (the outbox, the offline guard's) are gone with it."""
        assert self.agent is not None
        self.agent.close()
        shutil.rmtree(os.path.join(self.directory, "agent"))
        self.verify = verify
        self.agent = self.open_agent()
        for group in GROUPS:
            self.rebuild(group)
            self.offline[group] = False
            self.records[group] = []
        self.intents.clear()

    @rule(group=st.sampled_from(GROUPS))
    def reset_and_rebuild_group(self, group: str) -> None:
        self.rebuild(group)

    @rule(group=st.sampled_from(GROUPS), later=st.integers(0, 3), beyond=st.lists(st.integers(2, 4), max_size=3),
          stale=st.booleans(), hook_fails=st.booleans(), name_org=st.booleans(), forge=st.booleans())
    def restore_from_snapshot(
        self, group: str, later: int, beyond: list[int], stale: bool, hook_fails: bool, name_org: bool, forge: bool
    ) -> None:
        """Restore the Group from the authority's signed snapshot; delivery goes on after its
        sequence. ``later`` Events follow the snapshot, of which those ``beyond`` it by 2 or more
        are delivered first (buffered; with ``forge``, the first of them forged). With ``stale``
        the agent applied everything before the restore: the snapshot would roll it back and is
        refused, with nothing written. With ``hook_fails`` the application projection's restore
        hook raises first: that restore is aborted, with nothing written."""
        assert self.agent is not None and self.reference is not None
        driver = self.drivers[group]
        ref = self.authority.snapshot(group)
        data = self.authority.read_snapshot(ref)
        driver.more_events(later)
        model = self.model[group]
        if stale and later:
            self.apply_batch(group, [(pick, False) for pick in range(1, driver.head_seq() - model.applied + 1)],
                             True, True, False)
        else:
            self.apply_batch(group, [(ref.seq + pick - model.applied, forge and pick == min(beyond))
                                     for pick in beyond if pick <= later], True, False, False)
        model = self.model[group]
        if ref.seq < model.applied:
            before = self.store_picture()
            with pytest.raises(SnapshotInvalid):
                self.agent.restore(data, group=group)
            assert self.store_picture() == before
            tally("stale snapshot refused")
            return
        org = ORG if name_org or self.agent.state(group, f"group:{group}") is None else None
        if hook_fails and self.with_projections:
            before = self.store_picture()
            self.flaky.countdown = 1
            try:
                with pytest.raises(Boom):
                    self.agent.restore(data, group=group, org=org)
            finally:
                self.flaky.countdown = None
            assert self.store_picture() == before
            tally("restore hook failed")
        assert self.agent.restore(data, group=group, org=org) == ref.seq
        self.restored(group, data, ref.seq)
        tally(f"restored with {len(model.buffer)} buffered after it")

    @rule()
    def compare_with_fresh_store(self) -> None:
        """A store built from nothing but the authority's Events, up to the agent's applied
        sequences, mirrors the same state and work queue (restored Groups included)."""
        assert self.agent is not None
        path = os.path.join(self.directory, "fresh")
        with AgentStore.open(path, verify="trusted", map_size=MAP_BYTES) as fresh:
            with fresh.begin() as tx:
                for group in GROUPS:
                    tx.apply_many(self.events(group, 0, self.model[group].applied))
                    tx.advance_cursor(group)
            for group in GROUPS:
                mine = [row for row in without_heads(self.agent.projection_dump(group)) if row[0] != "projection"]
                assert [row for row in without_heads(fresh.projection_dump(group)) if row[0] != "projection"] == mine
        shutil.rmtree(path)

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def heads_follow_the_model(self) -> None:
        if self.agent is None:
            return
        CHECKS["steps"] += 1
        for group in GROUPS:
            head, model = self.agent.head(group), self.model[group]
            assert (head.applied_seq, head.cursor, head.pruned_seq, head.floor_seq) == (
                model.applied, model.cursor, model.pruned, model.floor), (group, head, model)
            assert head.cursor <= head.applied_seq
            assert self.agent.buffered_seqs(group) == sorted(model.buffer), (group, model)
            assert head.buffered == len(model.buffer)
            assert self.agent.inbox_seqs(group) == list(range(model.pruned + 1, model.applied + 1))
            if head.applied_seq > model.floor:
                [last] = self.events(group, head.applied_seq - 1, head.applied_seq)
                assert head.applied_hash == last.hash

    @invariant()
    def projections_equal_the_reference(self) -> None:
        if self.agent is None or self.reference is None:
            return
        for group in GROUPS:
            reference_applied = self.reference.head(group).applied_seq
            model = self.model[group]
            assert reference_applied <= model.applied
            with self.reference.begin() as tx:
                tx.apply_many(self.events(group, reference_applied, model.applied))
                tx.advance_cursor(group)
            assert without_heads(self.agent.projection_dump(group)) == without_heads(self.reference.projection_dump(group))
            mine, theirs = self.agent.head(group), self.reference.head(group)
            assert (mine.applied_seq, mine.applied_hash) == (theirs.applied_seq, theirs.applied_hash)
            if mine.cursor == mine.applied_seq and theirs.cursor == theirs.applied_seq:  # the dump's heads hold it
                assert self.agent.projection_digest(group) == self.reference.projection_digest(group)
            for now in (self.clock.now_ms, self.clock.now_ms + 10_000):
                assert self.agent.work_queue(group, now) == self.reference.work_queue(group, now)
            if self.with_projections:
                counts = seen_counts(self.agent, group)
                assert set(counts) == set(range(model.floor + 1, model.applied + 1))
                assert set(counts.values()) <= {1}, "an Event reached an application projection twice"

    @invariant()
    def outbox_follows_the_model(self) -> None:
        if self.agent is None:
            return
        stored = {intent.key: intent for intent in self.agent.intents()}
        assert set(stored) == set(self.intents)
        for key, model in self.intents.items():
            intent = stored[key]
            assert intent.key == key and intent.group == model["group"]
            assert (intent.state, intent.dispatches) == (model["state"], model["dispatches"]), key
            if model["state"] == IntentState.DONE:
                assert intent.receipt == model["receipt"]
        for key, receipts in self.outside.receipts.items():
            # once per store that recorded it: a deleted store forgot what it sent out (docs)
            assert len(receipts) <= self.lifetimes[key], "a side effect took effect twice for one key"
        for group in GROUPS:
            assert [intent.key for intent in self.agent.intents(group)] == sorted(
                key for key, model in self.intents.items() if model["group"] == group)
        pending = {intent.key for intent in self.agent.intents(pending_only=True)}
        assert pending == {key for key, model in self.intents.items() if model["state"] != IntentState.DONE}

    @invariant()
    def offline_records_follow_the_model(self) -> None:
        if self.agent is None:
            return
        for group in GROUPS:
            guard = self.guard(group)
            assert guard.offline == self.offline[group]
            assert [record.state for record in guard.buffered()] == self.records[group]


AgentLifecycleMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAgentLifecycle = AgentLifecycleMachine.TestCase
