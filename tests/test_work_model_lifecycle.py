"""The work-model state machine of ``tests/test_work_model_stateful.py`` on a durable Authority
that is closed and reopened, rebuilt, verified, snapshotted, compacted and killed between the
work-model steps.

The machine is ``DurableWorkModelMachine`` (claims, starts, renewals, checkpoints, blocks,
submissions, failures, charges, late and foreign results, clock jumps, sweeps, session
replacement, resolve, reassign, against the reference model), plus ``workitem.cancel``,
Approvals (the Mission gates ``workitem.publish`` behind one: ``APPROVAL_REQUIRED`` until the one
it names is approved) and these rules:

- close and reopen, the clock moved or not while the store is closed (leases keep their deadlines,
  the clock carries on);
- the clock stepping back: every new Event is stamped with the clock's reading but never before
  the last Event's time (of any Group), whatever reopens, rebuilds and compactions came between;
- a kill armed for the next Command: another process opens the store, accepts it and dies at a fail
  point of its commit (or exits without closing); the store is reopened (redo) and the Command sent
  again answers its receipt if it was durable, or is decided now;
- a lease sweep, a snapshot or a compaction in another process that dies part-way, then a reopen;
- ``rebuild()``, ``snapshot()`` (its aggregates are the Group's state), ``compact()``;
- redaction of an earlier Event of the Group, whose payload the next compaction removes;
- a side Group with a small work cycle of its own (a claim, a reassignment, a late submission kept
  as Evidence), archived here or by another process killed part-way, and dropped by the next
  compaction, so that receipts of Evidence of a compacted Group are replayed too;
- a replay of any earlier Command, and a collision of its Action ID with another Command.

After every step, on top of the work-model invariants: every receipt ever returned (the sweep's
``lease.expire`` ones too) is returned again byte for byte, and ``verify()`` is clean. Every
maintenance step leaves the Group's aggregates and Events as they were.

``MWPSTORE_WORK_LIFECYCLE_EXAMPLES`` and ``MWPSTORE_WORK_LIFECYCLE_STEPS`` lengthen the run, e.g.
``MWPSTORE_WORK_LIFECYCLE_EXAMPLES=1000 MWPSTORE_WORK_LIFECYCLE_STEPS=80 python -m pytest
tests/test_work_model_lifecycle.py --timeout=0 --hypothesis-show-statistics``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from authority_helpers import ARCHIVE_KILLS, COMMIT_KILLS, COMPACTION_STEPS, in_a_forked_child
from mwpstore import ActionIdCollision, Authority
from mwpstore.messages import Command, Event, encode_receipt, receipt_for
from mwpstore.registry import ENGINE_ACTOR
from mwpstore.snapshot import verify_snapshot
from mwpstore.work_model import lease_id_for
from test_work_model_durable import DurableHarness, DurableWorkModelMachine
from test_work_model_stateful import AGENTS, WORKITEMS, Model
from work_model_support import CONTRACT, GROUP, START_MS, Harness

EXAMPLES = int(os.environ.get("MWPSTORE_WORK_LIFECYCLE_EXAMPLES", "15"))
STEPS = int(os.environ.get("MWPSTORE_WORK_LIFECYCLE_STEPS", "40"))

OWNER = "owner"


class ApprovalModel(Model):
    """The reference model with the Mission's approval gate on ``workitem.publish``: a publication
    under the current live lease needs an approved Approval of ``publish`` on its WorkItem, and the
    machine names the newest one requested for it (WORK_MODEL.md, docs/work-model.md)."""

    approvals: dict[str, tuple[str, str]]  # Approval id -> (WorkItem, state), in request order

    def named_approval(self, wi: str) -> str | None:
        named = [approval for approval, (workitem, _) in self.approvals.items() if workitem == wi]
        return named[-1] if named else None

    def result(self, kind: str, agent: str, wi: str, epoch: int, cost: int) -> str:
        item = self.items[wi]
        current = epoch == item.epoch and item.lease is not None and item.lease.agent == agent and item.lease.live(self.now)
        if kind == "workitem.publish" and current:  # Evidence and fence refusals come before the gate
            named = self.named_approval(wi)
            if named is None or self.approvals[named][1] != "approved":
                return "APPROVAL_REQUIRED"
        return super().result(kind, agent, wi, epoch, cost)


class LifecycleHarness(DurableHarness):
    """A DurableHarness that keeps every receipt it was given, and can accept its next Command in
    another process that dies at a fail point first."""

    def __init__(self, path: str) -> None:
        # The clock may step back; ``now_ms`` is then the time the next Event must be accepted at:
        # the clock's reading, never before the last acceptance time (of any Event in the store).
        self.clock_ms = START_MS
        self.last_event_ms = 0
        super().__init__(path)
        self.sent: dict[tuple[str, str], tuple[Command, bytes]] = {}
        self.kill_next: list[tuple[str, int] | None] = []  # one entry: the kill armed for the next Command
        self.died: tuple[str, tuple[str, int] | None, int, int] | None = None

    def clock(self) -> int:
        return self.clock_ms

    def setup(self, **settings: Any) -> Harness:
        """The Group of the work-model machine, its Mission gating ``publish`` behind an Approval."""
        return super().setup(**settings, approval_required=("publish",))

    def advance(self, milliseconds: int) -> None:
        self.clock_ms += milliseconds
        self.now_ms = max(self.clock_ms, self.last_event_ms)

    def stamped(self, receipt: Any) -> Any:
        """Check the new Event's acceptance time: the clock's reading or the last one's."""
        assert receipt.accepted_at_ms == self.now_ms, (receipt, self.clock_ms, self.last_event_ms)
        self.last_event_ms = receipt.accepted_at_ms
        return receipt

    def send(self, command: Command) -> Any:
        """Accept ``command`` (trusted when the engine issues it) and keep its receipt."""
        accept = self.authority.accept_trusted if command.actor == ENGINE_ACTOR else self.authority.accept
        receipt = self.stamped(accept(command))
        self.sent[(command.actor, command.action_id)] = (command, encode_receipt(receipt))
        return receipt

    def again(self, key: tuple[str, str]) -> bytes:
        command, _ = self.sent[key]
        accept = self.authority.accept_trusted if command.actor == ENGINE_ACTOR else self.authority.accept
        return encode_receipt(accept(command))

    def accept_command(self, command: Command) -> Event:
        if self.kill_next:
            self.die_accepting(command, self.kill_next.pop())
        receipt = self.send(command)
        [accepted] = self.authority.read(self.group_id, after=receipt.seq - 1, limit=1)
        assert receipt_for(accepted) == receipt
        return accepted

    def in_a_dying_child(self, work: Any, kill: tuple[str, int] | None) -> str:
        """Close the store, run ``work(authority)`` in another process that opens it and dies at
        ``kill`` (or exits without closing), and reopen it here."""
        self.authority.close()
        path, clock = self.path, self.clock
        [outcome] = in_a_forked_child([lambda: work(Authority.open(path, clock=clock, sync=False))], kill=kill)
        self.authority = Authority.open(self.path, clock=self.clock, sync=False)
        return outcome

    def die_accepting(self, command: Command, kill: tuple[str, int] | None) -> None:
        """Another process accepts ``command`` and dies at ``kill``; ``died`` says what it got
        (``"ok"``, its refusal's class name or ``"killed"``), the kill, the head before it and
        the Events it left."""
        head = self.authority.head(self.group_id)[0]
        trusted = command.actor == ENGINE_ACTOR
        outcome = self.in_a_dying_child(lambda a: (a.accept_trusted if trusted else a.accept)(command), kill)
        assert self.authority.open_report.mode in ("clean", "redo")
        event(f"killed accepting at {kill}: {outcome}")
        self.died = (outcome, kill, head, self.authority.head(self.group_id)[0] - head)


class WorkModelLifecycleMachine(DurableWorkModelMachine):
    def __init__(self) -> None:
        self.side_groups: list[str] = []  # archived, in archive order
        self.compacted_groups: set[str] = set()
        self.redacted: set[int] = set()
        self.payloads_on_disk = 0  # redacted payloads no compaction removed yet
        self.counter = 0
        super().__init__()
        self.model = ApprovalModel(now=self.model.now)
        self.model.approvals = {}

    def make_harness(self) -> Harness:
        self.directory = tempfile.mkdtemp(prefix="mwp-work-lifecycle-")
        return LifecycleHarness(self.directory)

    @property
    def lh(self) -> LifecycleHarness:
        assert isinstance(self.h, LifecycleHarness)
        return self.h

    def _action(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    def observed(self) -> tuple[Any, ...]:
        """What no maintenance step may change: the Group's aggregates, head and Events."""
        return self.h.states(), self.lh.authority.head(GROUP), self.h.events()

    # -- the work model, recorded -------------------------------------------------------------

    def outcome(self, actor: str, kind: str, target: str, body: dict[str, Any], *, revision: int | None = None,
                cas: bool = False) -> tuple[str, Any]:
        self.lh.died = None
        if kind == "workitem.publish":
            named = self.model.named_approval(target)
            body = body if named is None else {**body, "approval": named}
        actual, accepted = super().outcome(actor, kind, target, body, revision=revision, cas=cas)
        if self.lh.died is not None:
            self.check_the_dead_child(actual)
        return actual, accepted

    def check_the_dead_child(self, actual: str) -> None:
        """The Command the dead child accepted was decided there as here, and is in the log once."""
        outcome, kill, head, written = self.lh.died
        now = self.lh.authority.head(GROUP)[0]
        if actual not in ("ok", "evidence"):  # refused (nothing written), there as here
            assert outcome != "ok" and (written, now) == (0, head), self.lh.died
            return
        assert outcome in ("ok", "killed"), self.lh.died
        if outcome == "ok":  # the child had its receipt: durable, and this was that receipt again
            assert written == 1
        elif kill == ("authority.before_log_append", 1):
            assert written == 0
        assert written in (0, 1) and now == head + 1, self.lh.died

    @rule(data=st.data(), decide=st.booleans())
    def approval(self, data: st.DataObject, decide: bool) -> None:
        """A worker requests an Approval of ``publish`` on a WorkItem, or the approver decides one."""
        approvals = self.model.approvals
        if not decide or not approvals:
            agent, wi = data.draw(st.sampled_from(AGENTS), label="agent"), data.draw(st.sampled_from(WORKITEMS), label="wi")
            approval = f"ap-{len(approvals) + 1}"
            actual, _ = self.outcome(agent, "approval.request", approval, {"workitem": wi, "operation": "publish"})
            assert actual == "ok", actual
            approvals[approval] = (wi, "pending")
            return
        approval = data.draw(st.sampled_from(sorted(approvals)), label="approval")
        decision = data.draw(st.sampled_from(("approved", "approved", "rejected")), label="decision")
        wi, state = approvals[approval]
        expected = "ok" if state == "pending" else "INVALID_STATE"
        actual, _ = self.outcome("a1", "approval.decide", approval, {"decision": decision}, cas=True)
        assert actual == expected, (actual, expected)
        if actual == "ok":
            approvals[approval] = (wi, decision)

    @rule(milliseconds=st.sampled_from((1, 150, 1_000, 5_000)))
    def clock_steps_back(self, milliseconds: int) -> None:
        """The clock steps back (acceptance times do not, below the last one)."""
        self.h.advance(-milliseconds)
        self.model.now = self.h.now_ms

    @rule()
    def sweep(self) -> None:
        """The engine's sweep; its receipts replay as the ``lease.expire`` Commands it issued."""
        expected = self.model.sweep()
        leases = {wi: self.h.item(wi)["lease"] for wi in expected}
        receipts = self.lh.authority.expire_leases(GROUP)
        assert [receipt.aggregate for receipt in receipts] == [f"workitem:{wi}" for wi in expected]
        for wi, receipt in zip(expected, receipts):
            self.lh.stamped(receipt)
            command = self.expire_command(wi, leases[wi]["lease_id"])
            self.lh.sent[(command.actor, command.action_id)] = (command, encode_receipt(receipt))

    @staticmethod
    def expire_command(wi: str, lease_id: str) -> Command:
        return Command(actor=ENGINE_ACTOR, action_id=f"expire.{lease_id}", group=GROUP, kind="lease.expire",
                       target=wi, body={"lease_id": lease_id})

    @rule(choice=st.sampled_from(("session.replace", "workitem.resolve", "workitem.resolve", "workitem.reassign", "workitem.cancel")),
          agent=st.sampled_from(AGENTS), wi=st.sampled_from(WORKITEMS))
    def less_often(self, choice: str, agent: str, wi: str) -> None:
        """Session replacements, owner requeues and cancellations (one rule, so they come less often)."""
        if choice == "workitem.cancel":
            self.cancel(wi)
        else:
            DurableWorkModelMachine.less_often(self, choice, agent, wi)

    def cancel(self, wi: str) -> None:
        item = self.model.items[wi]
        expected = "INVALID_STATE" if item.state in ("submitted", "failed", "cancelled") else "ok"
        if expected == "ok":
            self.model.release(wi, "cancelled")
        actual, _ = self.outcome(OWNER, "workitem.cancel", wi, {"reason": "not needed"})
        assert actual == expected, (actual, expected)

    # -- kills in another process ---------------------------------------------------------------

    @rule(what=st.sampled_from(("the next Command", "the next Command", "a sweep", "a snapshot", "a compaction")),
          data=st.data())
    def kill_another_process(self, what: str, data: st.DataObject) -> None:
        """Another process does ``what`` and dies at a fail point (or exits without closing)."""
        if what == "the next Command":  # accepted first by the process that dies
            self.lh.kill_next[:] = [data.draw(st.sampled_from(COMMIT_KILLS), label="kill")]
        elif what == "a sweep":
            self.kill_a_sweep(data.draw(st.sampled_from(COMMIT_KILLS), label="kill"))
        elif what == "a snapshot":
            self.kill_a_snapshot(data.draw(st.sampled_from(COMMIT_KILLS[1:3]), label="kill"))  # its note's commit
        else:
            self.kill_a_compaction(data.draw(st.sampled_from(COMPACTION_STEPS), label="step"))

    def kill_a_sweep(self, kill: tuple[str, int] | None) -> None:
        """Another process sweeps and dies; the sweep's Commands sent again here answer their
        receipts if they were durable (all of them: one commit), or are accepted now."""
        lapsed = [wi for wi, item in self.model.items.items() if item.lease is not None and not item.lease.live(self.model.now)]
        commands = [self.expire_command(wi, self.h.item(wi)["lease"]["lease_id"]) for wi in lapsed]
        head = self.lh.authority.head(GROUP)[0]
        outcome = self.lh.in_a_dying_child(lambda authority: authority.expire_leases(GROUP), kill)
        assert self.lh.authority.open_report.mode in ("clean", "redo")
        written = self.lh.authority.head(GROUP)[0] - head
        event(f"killed sweeping at {kill}: {outcome}")
        assert written in ((0,) if kill == ("authority.before_log_append", 1) or not lapsed else (0, len(lapsed)))
        if outcome == "ok":
            assert written == len(lapsed)
        assert self.model.sweep() == lapsed
        for command in commands:
            receipt = self.lh.send(command)
            assert receipt.authoritative and receipt.kind == "lease.expire"
        assert self.lh.authority.head(GROUP)[0] == head + len(lapsed)

    def kill_a_snapshot(self, kill: tuple[str, int]) -> None:
        before = self.observed()
        head, key_id = self.lh.authority.head(GROUP)[0], self.lh.authority.signing_key.key_id
        signed = any((ref.seq, ref.key_id) == (head, key_id) for ref in self.lh.authority.snapshots(GROUP))
        outcome = self.lh.in_a_dying_child(lambda authority: authority.snapshot(GROUP), kill)
        assert outcome == ("ok" if signed else "killed")  # signed already at this head: nothing written
        assert self.lh.authority.open_report.mode in ("clean", "redo")
        event(f"killed snapshotting at {kill}")
        assert self.observed() == before

    def kill_a_compaction(self, step: str) -> None:
        before = self.observed()
        dropped = [g for g in self.side_groups if g not in self.compacted_groups]
        outcome = self.lh.in_a_dying_child(lambda authority: authority.compact(), (f"compaction.{step}", 1))
        assert outcome == "killed"
        event(f"killed compacting at {step}")
        if step == "copy":  # before the marker: the old log is the truth
            assert self.lh.authority.open_report.mode in ("clean", "redo")
        else:  # the open finished the switch
            assert self.lh.authority.open_report.mode == "rebuild"
            self.compacted_groups.update(dropped)
            self.payloads_on_disk = 0
        assert self.observed() == before

    # -- maintenance here -----------------------------------------------------------------------

    @rule(step=st.sampled_from(("reopen", "rebuild", "snapshot", "compact", "redact")), data=st.data())
    def maintain(self, step: str, data: st.DataObject) -> None:
        if step == "reopen":
            self.reopen(data.draw(st.sampled_from((0, 0, 150, 1_000, 5_000)), label="closed for"))
        elif step == "redact":
            self.redact(data)
        else:
            getattr(self, step)()

    def reopen(self, closed_for: int) -> None:
        """Close, let the clock run while closed (leases lapse meanwhile), reopen."""
        before = self.observed()
        self.lh.close()
        self.h.advance(closed_for)
        self.model.now = self.h.now_ms
        self.lh.authority = Authority.open(self.lh.path, clock=self.lh.clock, sync=False)
        assert self.lh.authority.open_report.mode == "clean"
        assert self.observed() == before

    def rebuild(self) -> None:
        before = self.observed()
        records = self.lh.authority.verify().records
        assert self.lh.authority.rebuild() == records
        assert self.observed() == before

    def snapshot(self) -> None:
        before = self.observed()
        ref = self.lh.authority.snapshot(GROUP)
        assert ref.seq == self.lh.authority.head(GROUP)[0]
        verified = verify_snapshot(self.lh.authority.read_snapshot(ref), keyring=self.lh.authority.keyring(), org="org1", group=GROUP)
        assert [(a.aggregate, a.revision, a.state) for a in verified.aggregates] == self.lh.authority.aggregates(GROUP)
        assert self.observed() == before

    def compact(self) -> None:
        before = self.observed()
        dropped = [g for g in self.side_groups if g not in self.compacted_groups]
        report = self.lh.authority.compact()
        event(f"compacted ({len(dropped)} side Groups, {self.payloads_on_disk} payloads)")
        assert report.groups_compacted == sorted(dropped)
        assert report.payloads_removed == self.payloads_on_disk
        self.compacted_groups.update(dropped)
        self.payloads_on_disk = 0
        assert self.observed() == before

    def redact(self, data: st.DataObject) -> None:
        """Redact an earlier Event: a tombstone Event, no other change to the Group's state."""
        head = self.lh.authority.head(GROUP)[0]
        tombstones = {event.seq for event in self.h.events() if event.kind == "event.redact"}
        candidates = [seq for seq in range(1, head + 1) if seq not in tombstones and seq not in self.redacted]
        if not candidates:
            return
        seq = data.draw(st.sampled_from(candidates), label="seq")
        states, _ = self.h.states()
        action_id = self._action("redact")
        receipt = self.lh.stamped(self.lh.authority.redact(GROUP, seq, actor=OWNER, action_id=action_id, reason="personal data"))
        command = Command(actor=OWNER, action_id=action_id, group=GROUP, kind="event.redact", target=str(seq),
                          body={"reason": "personal data"})
        self.lh.sent[(OWNER, action_id)] = (command, encode_receipt(receipt))
        self.redacted.add(seq)
        self.payloads_on_disk += 1
        after, _ = self.h.states()
        assert {key: state for key, state in after.items() if not key.startswith("tombstone:") and not key.startswith("group:")} == {
            key: state for key, state in states.items() if not key.startswith("tombstone:") and not key.startswith("group:")
        }
        [redacted] = self.lh.authority.read(GROUP, after=seq - 1, limit=1)
        assert redacted.redacted and redacted.body is None

    @rule(kill=st.sampled_from([None, None, *ARCHIVE_KILLS]))
    def archive_a_side_group(self, kill: tuple[str, int] | None) -> None:
        """A side Group with a work cycle of its own (a claim left leased, a late submission kept
        as Evidence), archived here or by another process that dies part-way (finished here)."""
        before = self.observed()
        group = f"g-side-{len(self.side_groups) + 1}"
        worker = "w1"

        def send(actor: str, kind: str, target: str, body: dict[str, Any], revision: int | None = None) -> Any:
            command = Command(actor=actor, action_id=self._action("side"), group=group, kind=kind, target=target,
                              body=body, expected_revision=revision)
            return self.lh.send(command)

        def claim() -> dict[str, Any]:
            send(worker, "workitem.claim", "wi", {"session_epoch": 1}, self.lh.authority.state(group, "workitem:wi")[0])
            epoch = self.lh.authority.state(group, "workitem:wi")[1]["ownership_epoch"]
            return {"lease_id": lease_id_for(group, "wi", epoch), "ownership_epoch": epoch}

        send(OWNER, "group.create", group, {"org": "org1"})
        send(OWNER, "membership.add", worker, {"role": "worker"}, 0)
        send(OWNER, "mission.create", "m", {"title": "side", "cost_limit": 10})
        send(OWNER, "workitem.create", "wi", {"mission": "m", "contract": dict(CONTRACT)})
        first = claim()
        send(worker, "workitem.start", "wi", first)
        send(OWNER, "workitem.reassign", "wi", {})
        late = send(worker, "workitem.submit", "wi", {**first, "submission": "late"})
        assert not late.authoritative
        claim()
        action_id = self._action("archive")
        if kill is not None:
            outcome = self.lh.in_a_dying_child(lambda authority: authority.archive(group, actor=OWNER, action_id=action_id), kill)
            assert outcome == "killed"
            event(f"killed archiving at {kill}")
        record = self.lh.authority.archive(group, actor=OWNER, action_id=action_id)
        assert record.last_seq == self.lh.authority.head(group)[0]
        send_archive = Command(actor=OWNER, action_id=action_id, group=group, kind="group.archive", target=group, body={})
        receipt = self.lh.send(send_archive)  # answered by its receipt
        assert receipt.seq == record.last_seq
        self.side_groups.append(group)
        assert self.observed() == before

    # -- replays and collisions -----------------------------------------------------------------

    @precondition(lambda self: self.lh.sent)
    @rule(collide=st.booleans(), data=st.data())
    def replay_or_collide(self, collide: bool, data: st.DataObject) -> None:
        (self.collide if collide else self.replay)(data)

    def replay(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.lh.sent)), label="key")
        before = self.observed()
        assert self.lh.again(key) == self.lh.sent[key][1]
        assert self.observed() == before

    def collide(self, data: st.DataObject) -> None:
        """The Action ID of an earlier Command on another Command: of another kind, with another
        expected revision, or for another Group."""
        key = data.draw(st.sampled_from(sorted(self.lh.sent)), label="key")
        how = data.draw(st.sampled_from(("kind", "revision", "group")), label="changed")
        sent, _ = self.lh.sent[key]
        if how == "kind":
            command = msgspec.structs.replace(sent, kind="workitem.cancel", target="wi1", body={"reason": "a collision"},
                                              expected_revision=None, group=GROUP)
        elif how == "revision":
            command = msgspec.structs.replace(sent, expected_revision=(sent.expected_revision or 0) + 1_000)
        else:
            command = msgspec.structs.replace(sent, group=GROUP if sent.group != GROUP else (self.side_groups or ["g-none"])[-1])
        event(f"collision: {how}")
        before = self.observed()
        accept = self.lh.authority.accept_trusted if sent.actor == ENGINE_ACTOR else self.lh.authority.accept
        with pytest.raises(ActionIdCollision) as caught:
            accept(command)
        assert caught.value.detail == {"actor": sent.actor, "action_id": sent.action_id}
        assert self.observed() == before

    # -- what holds after every step --------------------------------------------------------------

    @invariant()
    def every_receipt_replays(self) -> None:
        for key, (_, receipt) in self.lh.sent.items():
            assert self.lh.again(key) == receipt, key

    @invariant()
    def verify_is_clean(self) -> None:
        report = self.lh.authority.verify()
        assert report.ok and report.problems == [], report.problems


WorkModelLifecycleMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestWorkModelLifecycleMachine = WorkModelLifecycleMachine.TestCase
