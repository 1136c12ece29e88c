"""A stateful test of one durable authority across its whole lifecycle: Commands over three
Groups (Missions, a worker's Membership, WorkItems claimed and their leases swept) interleaved
with replays, collisions, ACKs, reads and subscriptions from any Cursor, snapshots, key rotation,
redaction, archival, audit-log deletion, compaction, rebuild and reopen, and with another
process that dies part-way through a commit, a compaction or an archive, against a plain model
of what must hold.

After every step: every receipt ever returned is returned again byte for byte; each Group's head,
replay floor, Events (from the floor, redacted payloads as tombstones say), aggregates, snapshot
references, archive record and ACKs equal the model's; the snapshot and audit-log files are the
ones the records name; and ``verify()`` reports no problem but those the docs promise (a snapshot
signed by a key dropped as compromised).

``MWPSTORE_LIFECYCLE_EXAMPLES`` and ``MWPSTORE_LIFECYCLE_STEPS`` lengthen the run, e.g.
``MWPSTORE_LIFECYCLE_EXAMPLES=2000 MWPSTORE_LIFECYCLE_STEPS=60 python -m pytest
tests/test_lifecycle_stateful.py --timeout=0 --hypothesis-show-statistics`` (``--timeout=0``: such
a run takes longer than the suite's per-test timeout).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from authority_helpers import (
    ARCHIVE_KILLS,
    COMMIT_KILLS,
    COMPACTION_STEPS,
    OWNER,
    SNAPSHOT_KILLS,
    FakeClock,
    group_create,
    in_a_forked_child,
    mission_create,
    mission_update,
)
from work_model_support import CONTRACT
from mwpstore import (
    ActionIdCollision,
    AlreadyExists,
    Authority,
    Command,
    CursorTooOld,
    GroupArchived,
    InvalidCommand,
    InvalidState,
    NotFound,
    Rejection,
    RevisionMismatch,
    SequenceGap,
    StoreClosed,
)
from mwpstore.audit_log import FileKeyProvider
from mwpstore.leases import lapse_reason
from mwpstore.messages import ZERO_HASH, Event, encode_receipt
from mwpstore.snapshot import SnapshotRef, check_snapshot_ref, verify_snapshot

EXAMPLES = int(os.environ.get("MWPSTORE_LIFECYCLE_EXAMPLES", "12"))
STEPS = int(os.environ.get("MWPSTORE_LIFECYCLE_STEPS", "30"))

POLICIES: dict[str, dict[str, int]] = {
    "g-a": {},
    "g-b": {"audit_retention_days": 1, "replay_window_events": 4},
    "g-c": {"replay_window_events": 2},
}
GROUPS = sorted(POLICIES)
GHOST = "g-z"  # never created
MISSIONS = ["m-1", "m-2"]
WORKITEMS = ["wi-1", "wi-2"]
CONSUMERS = ["c-1", "c-2"]
WORKER = "w-1"
DAY_MS = 86_400_000

KILLS = COMMIT_KILLS + SNAPSHOT_KILLS

groups = st.sampled_from(GROUPS)
any_group = st.sampled_from([*GROUPS, GHOST])
missions = st.sampled_from(MISSIONS)


@dataclass
class GroupModel:
    policy: dict[str, int]
    events: list[Event] = field(default_factory=list)
    aggregates: dict[str, tuple[int, Any]] = field(default_factory=dict)
    redacted: set[int] = field(default_factory=set)
    on_disk: set[int] = field(default_factory=set)  # redacted payloads no compaction removed yet
    tombstone_seqs: set[int] = field(default_factory=set)
    snapshots: dict[int, SnapshotRef] = field(default_factory=dict)
    record: Any = None
    archived: bool = False
    audit_deleted: bool = False
    compacted: bool = False

    @property
    def head(self) -> int:
        return len(self.events)

    def floor(self) -> tuple[int, SnapshotRef | None]:
        if self.compacted:
            return self.record.final_snapshot.seq, self.record.final_snapshot
        window = self.policy.get("replay_window_events", 0)
        if window <= 0 or not self.snapshots or self.head - window < 1:
            return 0, None
        eligible = [seq for seq in self.snapshots if seq <= self.head - window]
        if not eligible:
            return 0, None
        return max(eligible), self.snapshots[max(self.snapshots)]

    def visible(self, event: Event) -> Event:
        return msgspec.structs.replace(event, body=None) if event.seq in self.redacted else event

    def kept_aggregates(self) -> list[tuple[str, int, Any]]:
        """What ``aggregates()`` lists: after compaction, the Group aggregate (marked) and Memberships."""
        out = []
        for key, (revision, state) in sorted(self.aggregates.items()):
            if self.compacted and key.startswith("group:"):
                state = {**state, "compacted": True}
            elif self.compacted and not key.startswith("member:"):
                continue
            out.append((key, revision, state))
        return out


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="mwp-lifecycle-")
        self.clock = FakeClock()
        self.authority = Authority.open(self.directory, clock=self.clock)
        self.groups: dict[str, GroupModel] = {}
        self.sent: dict[tuple[str, str], tuple[Command, bytes]] = {}
        self.trusted: set[tuple[str, str]] = set()  # the engine's own Commands (lease.expire)
        self.acks: dict[tuple[str, str], int] = {}
        self.subscriptions: dict[str, Any] = {}
        self.dropped_keys: set[str] = set()
        self.retired_keys: list[str] = []
        self.org_key: str | None = None  # the Organization's current audit-log key, once rotated
        self.counter = 0

    # -- helpers -----------------------------------------------------------------------------

    def _action(self) -> str:
        self.counter += 1
        return f"l-{self.counter}"

    def _record(self, command: Command, receipt: Any) -> None:
        """Take the Event a Command was just accepted with into the model."""
        model = self.groups[command.group]
        seq = model.head + 1
        assert (receipt.seq, receipt.event_id, receipt.kind) == (seq, f"{command.group}:{seq}", command.kind)
        accepted = self.authority.read(command.group, after=seq - 1, limit=1)[0]
        assert accepted.hash == receipt.event_hash and accepted.action_id == command.action_id
        assert accepted.prev_hash == (model.events[-1].hash if model.events else ZERO_HASH)
        model.events.append(accepted)
        for effect in accepted.effects:
            model.aggregates[effect.aggregate] = (effect.revision, effect.state)
        self.sent[(command.actor, command.action_id)] = (command, encode_receipt(receipt))

    def _refused(self, error: type[Exception], call: Any) -> Exception:
        event(f"refused: {error.__name__}")
        heads = {group: self.authority.head(group) for group in self.groups}
        with pytest.raises(error) as caught:
            call()
        assert type(caught.value) is error, repr(caught.value)
        assert {group: self.authority.head(group) for group in self.groups} == heads
        return caught.value

    def _submit(self, command: Command, error: type[Exception] | None) -> None:
        if error is None:
            self._record(command, self.authority.accept(command))
        else:
            self._refused(error, lambda: self.authority.accept(command))

    def _gate(self, group: str) -> type[Exception] | None:
        """The refusal every Command but group.create meets before its kind's rules (group.create
        meets only the archived one: it makes the Group that does not exist yet)."""
        if group not in self.groups:
            return NotFound
        if self.groups[group].archived:
            return GroupArchived
        return None

    @staticmethod
    def _open(mission: dict[str, Any] | None) -> type[Exception] | None:
        """The refusal a Command that needs an open Mission meets, if any."""
        return NotFound if mission is None else (InvalidState if mission["status"] != "open" else None)

    # -- Commands ----------------------------------------------------------------------------

    @initialize(created=st.sets(groups, min_size=1), staffed=st.sets(groups))
    def create_groups(self, created: set[str], staffed: set[str]) -> None:
        """Some Groups, some of them with a Mission, a worker and a WorkItem to claim (a chain of
        rules the machine would rarely draw in order)."""
        for group in sorted(created):
            self.create_group(group)
            if group in staffed:
                self.create_mission(group, "m-1")
                self.add_or_remove_worker(group, stale=False)
                self.create_workitem(group, WORKITEMS[0])

    @rule(group=groups)
    def create_group(self, group: str) -> None:
        policy = POLICIES[group]
        command = group_create(group, action_id=self._action())
        if policy:
            command = msgspec.structs.replace(command, body={"org": "acme", "policy": policy})
        if group in self.groups:
            self._submit(command, GroupArchived if self.groups[group].archived else AlreadyExists)
            return
        self.groups[group] = GroupModel(policy=dict(policy))
        self._submit(command, None)

    @rule(group=any_group, mission=missions)
    def create_mission(self, group: str, mission: str) -> None:
        command = mission_create(mission, group=group, action_id=self._action())
        error = self._gate(group) or (AlreadyExists if f"mission:{mission}" in self.groups[group].aggregates else None)
        self._submit(command, error)

    @rule(group=groups, mission=missions, stale=st.booleans(), title=st.sampled_from(["t-1", "t-2", "t-3"]))
    def update_mission(self, group: str, mission: str, stale: bool, title: str) -> None:
        model = self.groups.get(group)
        revision, state = model.aggregates.get(f"mission:{mission}", (0, None)) if model else (0, None)
        command = mission_update(mission, revision + 1 if stale else revision, title, group=group, action_id=self._action())
        error = self._gate(group) or (RevisionMismatch if stale else self._open(state))
        self._submit(command, error)
        if error is None:
            assert self.groups[group].aggregates[f"mission:{mission}"] == (revision + 1, {**state, "title": title})

    @rule(group=groups, mission=missions)
    def close_mission(self, group: str, mission: str) -> None:
        command = Command(actor=OWNER, action_id=self._action(), group=group, kind="mission.close", target=mission, body={})
        error = self._gate(group) or self._open(self.groups[group].aggregates.get(f"mission:{mission}", (0, None))[1])
        self._submit(command, error)

    @rule(group=groups, stale=st.booleans())
    def add_or_remove_worker(self, group: str, stale: bool) -> None:
        model = self.groups.get(group)
        revision, member = model.aggregates.get(f"member:{WORKER}", (0, None)) if model else (0, None)
        active = member is not None and member["status"] == "active"
        kind, body = ("membership.remove", {}) if active else ("membership.add", {"role": "worker"})
        command = Command(actor=OWNER, action_id=self._action(), group=group, kind=kind, target=WORKER, body=body,
                          expected_revision=revision + 1 if stale else revision)
        self._submit(command, self._gate(group) or (RevisionMismatch if stale else None))

    @rule(group=groups, workitem=st.sampled_from(WORKITEMS))
    def create_workitem(self, group: str, workitem: str) -> None:
        command = Command(actor=OWNER, action_id=self._action(), group=group, kind="workitem.create", target=workitem,
                          body={"mission": "m-1", "priority": 0, "contract": dict(CONTRACT)})
        error = self._gate(group)
        if error is None:
            aggregates = self.groups[group].aggregates
            error = AlreadyExists if f"workitem:{workitem}" in aggregates else self._open(aggregates.get("mission:m-1", (0, None))[1])
        self._submit(command, error)

    @rule(group=groups, workitem=st.sampled_from(WORKITEMS))
    def claim(self, group: str, workitem: str) -> None:
        model = self.groups.get(group)
        revision, item = model.aggregates.get(f"workitem:{workitem}", (0, None)) if model else (0, None)
        member = model.aggregates.get(f"member:{WORKER}", (0, None))[1] if model else None
        epoch = member["session_epoch"] if member else 1
        command = Command(actor=WORKER, action_id=self._action(), group=group, kind="workitem.claim", target=workitem,
                          body={"session_epoch": epoch}, expected_revision=revision)
        mission = model.aggregates.get("mission:m-1", (0, None))[1] if model else None
        claimable = (
            self._gate(group) is None and item is not None and item["state"] == "queued" and item["attempt"] < CONTRACT["max_attempts"]
            and member is not None and member["status"] == "active" and mission is not None and mission["status"] == "open"
            and self.clock.now_ms >= item["not_before_ms"]
        )
        if claimable:
            self._submit(command, None)
            event("claimed")
            return
        event("claim decided by the engine")
        heads = {g: self.authority.head(g) for g in self.groups}
        try:
            receipt = self.authority.accept(command)
        except Rejection:  # the model does not predict every rule of a claim: refused, nothing written
            assert {g: self.authority.head(g) for g in self.groups} == heads
            return
        self._record(command, receipt)  # a lapsed lease taken over, say
        event("claimed (a lapsed lease)")

    @rule(group=any_group)
    def expire_leases(self, group: str) -> None:
        model = self.groups.get(group)
        expected = set()
        if model is not None and not model.archived:
            for key, (_, state) in model.aggregates.items():
                if key.startswith("workitem:") and state is not None and state.get("lease") is not None:
                    if lapse_reason(state["lease"], self.clock.now_ms) is not None:
                        expected.add(key)
        receipts = self.authority.expire_leases(group)
        assert {receipt.aggregate for receipt in receipts} == expected
        for receipt in receipts:
            event("lease expired")
            workitem = receipt.aggregate.split(":", 1)[1]
            lease_id = model.aggregates[receipt.aggregate][1]["lease"]["lease_id"]
            command = Command(actor="_engine", action_id=f"expire.{lease_id}", group=group, kind="lease.expire",
                              target=workitem, body={"lease_id": lease_id})
            self.trusted.add((command.actor, command.action_id))
            self._record(command, receipt)

    def _again(self, key: tuple[str, str]) -> bytes:
        command, _ = self.sent[key]
        accept = self.authority.accept_trusted if key in self.trusted else self.authority.accept
        return encode_receipt(accept(command))

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def replay(self, data: Any) -> None:
        key = data.draw(st.sampled_from(sorted(self.sent)))
        assert self._again(key) == self.sent[key][1]

    @precondition(lambda self: set(self.sent) - self.trusted)
    @rule(data=st.data())
    def collide(self, data: Any) -> None:
        actor, action_id = data.draw(st.sampled_from(sorted(set(self.sent) - self.trusted)))
        command = Command(actor=actor, action_id=action_id, group="g-a", kind="mission.create", target="m-other",
                          body={"title": "other", "cost_limit": 1})
        error = self._refused(ActionIdCollision, lambda: self.authority.accept(command))
        assert error.detail == {"actor": actor, "action_id": action_id}

    @rule(group=any_group, data=st.data())
    def accept_many(self, group: str, data: Any) -> None:
        """One commit of a new Mission, what rests on it (its redaction, its creation again, the
        redaction of that redaction), a repeat and a collision of earlier Commands."""
        model = self.groups.get(group)
        gate = self._gate(group)
        mission = f"m-b{self._action()}"
        create = mission_create(mission, group=group, action_id=self._action())
        plan: list[tuple[Command, Any]] = [(create, gate)]  # (Command, its refusal or None)
        seq = model.head + 1 if model else 1
        if data.draw(st.booleans(), label="redact it"):
            redaction = Command(actor=OWNER, action_id=self._action(), group=group, kind="event.redact", target=str(seq),
                                body={"reason": "in the same commit"})
            plan.append((redaction, gate))
            if data.draw(st.booleans(), label="redact the redaction"):
                plan.append((msgspec.structs.replace(redaction, action_id=self._action(), target=str(seq + 1)), gate or InvalidCommand))
        if data.draw(st.booleans(), label="create it again"):
            plan.append((mission_create(mission, group=group, action_id=self._action()), gate or AlreadyExists))
        keys = sorted(set(self.sent) - self.trusted)
        if keys and data.draw(st.booleans(), label="repeat one"):
            plan.append((self.sent[data.draw(st.sampled_from(keys))][0], "repeat"))
        if keys and data.draw(st.booleans(), label="collide with one"):
            actor, action_id = data.draw(st.sampled_from(keys))
            plan.append((Command(actor=actor, action_id=action_id, group="g-a", kind="mission.close", target="m-other"), ActionIdCollision))
        # The Mission's creation first; the rest in any order (only the redaction takes a sequence,
        # and the redaction of that redaction is refused before it or after it alike).
        order = data.draw(st.permutations(range(1, len(plan))), label="order of the rest")
        plan = [plan[0]] + [plan[i] for i in order]
        results = self.authority.accept_many([command for command, _ in plan])
        event(f"accept_many of {len(plan)}")
        for (command, expected), result in zip(plan, results):
            if expected == "repeat":
                assert result.ok and encode_receipt(result.receipt) == self.sent[(command.actor, command.action_id)][1]
            elif expected is not None:
                assert not result.ok and type(result.error) is expected, (command, result)
            else:
                assert result.ok, (command, result)
                self._record(command, result.receipt)
                if command.kind == "event.redact":
                    self.groups[group].redacted.add(int(command.target))
                    self.groups[group].on_disk.add(int(command.target))
                    self.groups[group].tombstone_seqs.add(self.groups[group].head)

    # -- reading, following, acknowledging -----------------------------------------------------

    @rule(group=any_group, data=st.data())
    def read(self, group: str, data: Any) -> None:
        model = self.groups.get(group) or GroupModel(policy={})
        after = data.draw(st.integers(0, model.head + 1), label="after")
        limit = data.draw(st.integers(1, 4), label="limit")
        floor, reference = model.floor()
        if after < floor:
            error = self._refused(CursorTooOld, lambda: self.authority.read(group, after=after, limit=limit))
            assert reference is not None and error.detail["snapshot_ref"] == reference.to_dict()
            assert SnapshotRef.from_dict(error.detail["snapshot_ref"]) == reference
            check_snapshot_ref(self.authority.read_snapshot(error.detail["snapshot_ref"]), reference)
            return
        expected = [model.visible(event) for event in model.events[after : after + limit]]
        assert self.authority.read(group, after=after, limit=limit) == expected

    @rule(group=any_group, data=st.data())
    def subscribe(self, group: str, data: Any) -> None:
        model = self.groups.get(group) or GroupModel(policy={})
        after = data.draw(st.integers(0, model.head + 1), label="after")
        self.subscriptions[group] = self.authority.subscribe(group, after=after)

    @precondition(lambda self: self.subscriptions)
    @rule(data=st.data())
    def poll(self, data: Any) -> None:
        group = data.draw(st.sampled_from(sorted(self.subscriptions)))
        subscription = self.subscriptions[group]
        model = self.groups.get(group) or GroupModel(policy={})
        cursor = subscription.cursor
        floor, reference = model.floor()
        if cursor < floor:
            error = self._refused(CursorTooOld, lambda: subscription.poll(timeout=0))
            assert reference is not None and error.detail["snapshot_ref"] == reference.to_dict()
            assert subscription.cursor == cursor
            return
        expected = [model.visible(event) for event in model.events[cursor:]]
        assert subscription.poll(timeout=0) == expected
        assert subscription.cursor == max(cursor, model.head) if expected else subscription.cursor == cursor

    @rule(consumer=st.sampled_from(CONSUMERS), group=any_group, data=st.data())
    def ack(self, consumer: str, group: str, data: Any) -> None:
        head = self.groups[group].head if group in self.groups else 0
        cursor = data.draw(st.integers(0, head + 2), label="cursor")
        previous = self.acks.get((consumer, group), 0)
        if cursor > head:
            error = self._refused(SequenceGap, lambda: self.authority.ack(consumer, group, cursor))
            assert (error.detail["cursor"], error.detail["head"]) == (cursor, head)
            return
        assert self.authority.ack(consumer, group, cursor) == max(previous, cursor)
        self.acks[(consumer, group)] = max(previous, cursor)

    # -- snapshots and keys ------------------------------------------------------------------

    @rule(group=any_group)
    def snapshot(self, group: str) -> None:
        if group not in self.groups:
            self._refused(NotFound, lambda: self.authority.snapshot(group))
            return
        model = self.groups[group]
        key_id = self.authority.signing_key.key_id
        before = model.snapshots.get(model.head)
        if model.compacted and (before is None or before.key_id != key_id):
            # its index keeps only the Group aggregate and Memberships: nothing true to sign
            error = self._refused(InvalidState, lambda: self.authority.snapshot(group))
            assert error.detail["state"] == "compacted"
            return
        ref = self.authority.snapshot(group)
        event(f"snapshot{' of a compacted Group' if model.compacted else ''}")
        assert (ref.group, ref.seq, ref.key_id) == (group, model.head, key_id)
        if before is not None and before.key_id == key_id:
            assert ref == before  # already signed with this key: the same reference
        model.snapshots[model.head] = ref
        verified = verify_snapshot(self.authority.read_snapshot(ref), keyring=self.authority.keyring(), org="acme", group=group)
        assert verified.head_hash == model.events[-1].hash
        assert [(a.aggregate, a.revision, a.state) for a in verified.aggregates] == [
            (key, revision, state) for key, (revision, state) in sorted(model.aggregates.items())
        ]

    @rule(retire=st.booleans())
    def rotate_signing_key(self, retire: bool) -> None:
        old = self.authority.signing_key.key_id
        new = self.authority.rotate_signing_key(retire=retire)
        assert new.key_id != old and self.authority.signing_key.key_id == new.key_id
        if retire:
            self.retired_keys.append(old)
        else:
            self.dropped_keys.add(old)

    @rule()
    def rotate_organization_key(self) -> None:
        """Audit logs written from now on use a new key of the Organization; older ones still
        decrypt with theirs (verify reads every kept one)."""
        self.org_key = FileKeyProvider(os.path.join(self.directory, "keys", "orgs")).rotate("acme")

    @precondition(lambda self: self.retired_keys)
    @rule()
    def drop_retired_key(self) -> None:
        key_id = self.retired_keys.pop(0)
        self.authority.drop_retired_key(key_id)
        self.dropped_keys.add(key_id)

    # -- redaction, archival, deletion -------------------------------------------------------

    @rule(group=any_group, data=st.data())
    def redact(self, group: str, data: Any) -> None:
        model = self.groups.get(group) or GroupModel(policy={})
        seq = data.draw(st.integers(1, model.head + 1), label="seq")
        action_id = self._action()
        command = Command(actor=OWNER, action_id=action_id, group=group, kind="event.redact", target=str(seq), body={"reason": "personal data"})
        error = self._gate(group)
        if error is None:
            if seq > model.head or seq in model.tombstone_seqs:
                error = InvalidCommand
            elif seq in model.redacted:
                error = AlreadyExists
        call = lambda: self.authority.redact(group, seq, actor=OWNER, action_id=action_id, reason="personal data")  # noqa: E731
        if error is not None:
            self._refused(error, call)
            return
        self._record(command, call())
        event("redacted")
        model.redacted.add(seq)
        model.on_disk.add(seq)
        model.tombstone_seqs.add(model.head)

    @rule(group=any_group, reason=st.sampled_from(["", "done"]))
    def archive(self, group: str, reason: str) -> None:
        action_id = self._action()
        call = lambda: self.authority.archive(group, actor=OWNER, action_id=action_id, reason=reason)  # noqa: E731
        if group not in self.groups:
            self._refused(NotFound, call)
            return
        model = self.groups[group]
        if model.record is not None:
            assert call() == model.record  # completed: the existing record, nothing accepted
            return
        if model.audit_deleted:  # group.archive accepted alone, then audit.delete: not written again
            error = self._refused(InvalidState, call)
            assert error.detail["state"] == "deleted"
            return
        if model.archived:  # group.archive accepted alone (an archive() cut short): finished now
            record = call()
            event("archive finished")
        else:
            record = call()
            event("archived")
            command = Command(actor=OWNER, action_id=action_id, group=group, kind="group.archive", target=group,
                              body={"reason": reason} if reason else {})
            self._record(command, self.authority.accept(command))  # answered by its receipt
            model.archived = True
        assert (record.group, record.last_seq, record.events, record.final_snapshot.seq) == (group, model.head, model.head, model.head)
        assert record.final_snapshot.key_id == self.authority.signing_key.key_id
        assert self.org_key in (None, record.audit_key_id)
        model.snapshots[model.head] = record.final_snapshot
        model.record = record

    @rule(group=groups, kill=st.sampled_from(ARCHIVE_KILLS))
    def crash_archiving(self, group: str, kill: tuple[str, int]) -> None:
        """Another process archives a live Group and dies part-way; archive() here finishes it."""
        if self._gate(group) is not None:
            return
        action_id = self._action()
        self.authority.close()
        self.subscriptions.clear()
        directory, clock = self.directory, self.clock
        work = lambda: Authority.open(directory, clock=clock).archive(group, actor=OWNER, action_id=action_id)  # noqa: E731
        assert in_a_forked_child([work], kill=kill) == ["killed"]
        self.authority = Authority.open(self.directory, clock=self.clock)
        event(f"killed archiving at {kill}")
        command = Command(actor=OWNER, action_id=action_id, group=group, kind="group.archive", target=group, body={})
        self._record(command, self.authority.accept(command))  # durable before the kill
        self.groups[group].archived = True
        self.archive(group, "")

    @rule(group=groups)
    def accept_group_archive(self, group: str) -> None:
        """``group.archive`` accepted on its own, as an archive() cut short after it leaves it."""
        command = Command(actor=OWNER, action_id=self._action(), group=group, kind="group.archive", target=group, body={})
        error = self._gate(group)
        self._submit(command, error)
        if error is None:
            self.groups[group].archived = True

    @rule(group=any_group, legal=st.booleans())
    def delete_audit_log(self, group: str, legal: bool) -> None:
        action_id = self._action()
        basis = "legal" if legal else "retention"
        call = lambda: self.authority.delete_audit_log(group, actor=OWNER, action_id=action_id, reason="over", basis=basis)  # noqa: E731
        model = self.groups.get(group)
        if model is None:
            self._refused(NotFound, call)
            return
        if not model.archived or model.audit_deleted:
            self._refused(InvalidState, call)
            return
        if not legal:
            days = model.policy.get("audit_retention_days", 0)
            archived_at = model.aggregates[f"group:{group}"][1]["archived_at_ms"]
            if days == 0 or self.clock.now_ms < archived_at + days * DAY_MS:
                error = self._refused(InvalidState, call)
                assert error.detail["state"] == "retained"
                return
        command = Command(actor=OWNER, action_id=action_id, group=group, kind="audit.delete", target=group,
                          body={"basis": basis, "reason": "over"})
        self._record(command, call())
        event(f"audit log deleted ({basis}{', compacted' if model.compacted else ''})")
        model.audit_deleted = True
        model.tombstone_seqs.add(model.head)
        if model.record is not None:
            assert not os.path.exists(os.path.join(self.directory, model.record.audit_location))

    @rule(milliseconds=st.sampled_from([150, 600, DAY_MS]))
    def advance_clock(self, milliseconds: int) -> None:
        self.clock.advance(milliseconds)  # past a lease's start or end, an audit log's retention

    # -- maintenance -------------------------------------------------------------------------

    @rule()
    def compact(self) -> None:
        dropped, payloads = self._compaction()
        report = self.authority.compact()
        event(f"compacted ({len(dropped)} archived Groups dropped, {payloads} payloads removed)")
        assert report.groups_compacted == dropped
        assert report.events_dropped == sum(self.groups[g].head for g in dropped)
        assert report.payloads_removed == payloads
        self._compacted(dropped)

    def _compaction(self) -> tuple[list[str], int]:
        """What a compaction now drops: the archived Groups whose audit log is kept, and the
        redacted payloads of the others still in the log."""
        dropped = sorted(g for g, model in self.groups.items() if model.record is not None and not model.audit_deleted and not model.compacted)
        return dropped, sum(len(model.on_disk) for g, model in self.groups.items() if g not in dropped)

    def _compacted(self, dropped: list[str]) -> None:
        for g, model in self.groups.items():
            model.on_disk.clear()
            model.compacted = model.compacted or g in dropped

    @rule(step=st.sampled_from(COMPACTION_STEPS))
    def crash_compacting(self, step: str) -> None:
        """Another process compacts the store and dies at a step: the next open finishes the
        switch (from the marker on) or drops the copy."""
        dropped, _ = self._compaction()
        self.authority.close()
        self.subscriptions.clear()
        directory = self.directory
        assert in_a_forked_child([lambda: Authority.open(directory).compact()], kill=(f"compaction.{step}", 1)) == ["killed"]
        self.authority = Authority.open(self.directory, clock=self.clock)
        event(f"killed compacting at {step}")
        if step == "copy":  # before the marker: the old log is the truth
            assert self.authority.open_report.mode in ("clean", "redo")
        else:
            assert self.authority.open_report.mode == "rebuild"
            self._compacted(dropped)

    @rule()
    def rebuild(self) -> None:
        records = self.authority.verify().records
        assert self.authority.rebuild() == records

    @rule()
    def reopen(self) -> None:
        self.authority.close()
        for subscription in self.subscriptions.values():
            with pytest.raises(StoreClosed):
                subscription.poll(timeout=0)
        self.subscriptions.clear()
        self.authority = Authority.open(self.directory, clock=self.clock)
        assert self.authority.open_report.mode == "clean"

    @rule(group=any_group, mission=missions, snapshot=st.booleans(), kill=st.sampled_from(KILLS))
    def crash(self, group: str, mission: str, snapshot: bool, kill: tuple[str, int] | None) -> None:
        """Another process opens the store, accepts a Command (and snapshots the Group), and dies
        without closing it, at a fail point or after; the next open redoes what its index lacks
        and removes a snapshot file no record names."""
        command = mission_create(mission, group=group, action_id=self._action())
        error = self._gate(group) or (AlreadyExists if f"mission:{mission}" in self.groups[group].aggregates else None)
        self.authority.close()
        self.subscriptions.clear()
        directory, clock = self.directory, self.clock

        def work() -> None:
            authority = Authority.open(directory, clock=clock)  # never closed: os._exit ends the child
            authority.accept(command)
            if snapshot:
                authority.snapshot(group)

        [outcome] = in_a_forked_child([work], kill=kill)
        killed_at = kill if outcome == "killed" else None
        if error is not None:  # refused; a commit without records still passes after_index_commit
            assert outcome in (error.__name__, "killed")
        else:
            assert outcome == ("ok" if kill is None or (kill[1] == 2 and not snapshot) else "killed")
        self.authority = Authority.open(self.directory, clock=self.clock)
        assert self.authority.open_report.mode in ("clean", "redo")  # the same boot: the index is trusted
        event(f"killed at {killed_at}" if killed_at else "exited without close")
        if error is None and killed_at != ("authority.before_log_append", 1):
            self._record(command, self.authority.accept(command))  # answered by its receipt
            model = self.groups[group]
            if snapshot and killed_at in (None, ("authority.after_log_sync", 2)):
                ref = self.authority.snapshots(group)[-1]
                assert (ref.seq, ref.key_id) == (model.head, self.authority.signing_key.key_id)
                model.snapshots[model.head] = ref

    # -- what holds after every step ---------------------------------------------------------

    @invariant()
    def every_receipt_replays(self) -> None:
        for key, (_, receipt) in self.sent.items():
            assert self._again(key) == receipt

    @invariant()
    def groups_match_the_model(self) -> None:
        assert self.authority.groups() == sorted(self.groups)
        for group, model in self.groups.items():
            assert self.authority.head(group) == (model.head, model.events[-1].hash)
            floor, reference = model.floor()
            assert self.authority.replay_floor(group) == (floor, reference)
            if reference is not None:  # what a reader below the floor is sent to fetch is there
                check_snapshot_ref(self.authority.read_snapshot(reference), reference)
            events = self.authority.read(group, after=floor, limit=100_000)
            assert events == [model.visible(event) for event in model.events[floor:]]
            assert [event.redacted for event in events] == [event.seq in model.redacted for event in events]
            assert self.authority.aggregates(group) == model.kept_aggregates()
            assert self.authority.snapshots(group) == [model.snapshots[seq] for seq in sorted(model.snapshots)]
            assert self.authority.archive_record(group) == model.record
        for (consumer, group), cursor in self.acks.items():
            assert self.authority.acked(consumer, group) == cursor

    @invariant()
    def files_match_the_records(self) -> None:
        """Every snapshot file is at a sequence a record names (the first file there stays when a
        newer key signs it again), and each named one is there; an archived Group's directory
        holds its audit log alone, and none once it is deleted."""
        for group, model in self.groups.items():
            directory = os.path.join(self.directory, "snapshots", group)
            names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
            named = {os.path.basename(ref.location) for ref in model.snapshots.values()}
            assert named <= names
            assert {int(name[:20]) for name in names} <= set(model.snapshots), names
            directory = os.path.join(self.directory, "archive", group)
            names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
            if model.audit_deleted:
                assert names == set()
            elif model.record is not None:
                assert names == {os.path.basename(model.record.audit_location)}

    @invariant()
    def verify_is_clean(self) -> None:
        # A snapshot signed by a key dropped as compromised no longer verifies (documented): those,
        # and the audit logs checked against such a final snapshot, are the only problems allowed.
        expected = set()
        for model in self.groups.values():
            expected |= {f"snapshot {ref.location}" for ref in model.snapshots.values() if ref.key_id in self.dropped_keys}
            if model.record is not None and not model.audit_deleted and model.record.final_snapshot.key_id in self.dropped_keys:
                expected.add(f"audit log {model.record.audit_location}")
        problems = self.authority.verify().problems
        assert {problem.split(":")[0] for problem in problems} == expected, problems
        assert len(problems) == len(expected), problems

    def teardown(self) -> None:
        self.authority.close()
        shutil.rmtree(self.directory, ignore_errors=True)


LifecycleMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLifecycleMachine = LifecycleMachine.TestCase
