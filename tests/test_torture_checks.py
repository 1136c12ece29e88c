"""The torture harness's checks, each shown to report a hand-built bad state.

A check that can be switched off with no test failing would let a long torture run report
0 violations while the engine is broken. These tests call the judging code of each suite
directly (``mwpstore.torture``) with a state that is wrong in one way — a gap, a chain break,
an Event applied twice, an ACK ahead of its Cursor, a damaged file reported as intact, a reader
refusal outside a compaction, two fuzz paths that disagree — and assert the check says so; most
build that state by hand (small stand-ins for an Authority or an AgentStore, scripted judges),
so no suite is run. The short runs of the suites are in ``test_torture.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from mwpstore import torture
from mwpstore.authority import Authority
from mwpstore.errors import Corruption, EventInvalid, InvalidState, StorageFailed
from mwpstore.messages import ZERO_HASH
from test_torture import _reader_fixture, _store_with_receipts

# -- stand-ins: an Authority and an AgentStore whose every answer the test decides --------------------


def _hash(group: str, seq: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{group}:{seq}:{salt}".encode()).digest()


def _event(group: str, seq: int, prev: bytes, *, action: str | None = None, effects: list[tuple[str, int, Any]] | None = None,
           salt: str = "") -> SimpleNamespace:
    action = action or (f"create-{group}" if seq == 1 else f"{group}-a{seq}")
    if effects is None:
        effects = [(f"mission:m{seq}", 1, {"title": f"t{seq}"})]
    return SimpleNamespace(group=group, seq=seq, prev_hash=prev, hash=_hash(group, seq, salt), action_id=action,
                           event_id=f"{group}:{seq}", effects=[SimpleNamespace(aggregate=a, revision=r, state=s) for a, r, s in effects])


def _chain(group: str, count: int) -> list[SimpleNamespace]:
    events, previous = [], ZERO_HASH
    for seq in range(1, count + 1):
        events.append(_event(group, seq, previous))
        previous = events[-1].hash
    return events


class _Stored:
    """What check_authority and check_agent ask an Authority, answered from hand-built Events:
    consistent until a test breaks one part."""

    def __init__(self, events: dict[str, list[SimpleNamespace]]) -> None:
        self.events = events
        self.heads = {group: (len(items), items[-1].hash if items else ZERO_HASH) for group, items in events.items()}
        self.index: dict[str, dict[str, tuple[int, Any]]] = {}
        for group, items in events.items():
            folded: dict[str, tuple[int, Any]] = {}
            for event in items:
                for effect in event.effects:
                    folded[effect.aggregate] = (effect.revision, effect.state)
            self.index[group] = folded
        self.problems: list[str] = []
        self.acks: dict[tuple[str, str], int] = {}
        self.page = 10_000

    def groups(self) -> list[str]:
        return list(self.events)

    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[SimpleNamespace]:
        return [event for event in self.events[group] if event.seq > after][: min(limit, self.page)]

    def head(self, group: str) -> tuple[int, bytes]:
        return self.heads[group]

    def aggregates(self, group: str) -> list[tuple[str, int, Any]]:
        return [(key, revision, state) for key, (revision, state) in sorted(self.index[group].items())]

    def verify(self) -> SimpleNamespace:
        return SimpleNamespace(problems=list(self.problems), ok=not self.problems)

    def acked(self, consumer: str, group: str) -> int:
        return self.acks.get((consumer, group), 0)


def _stored(**counts: int) -> _Stored:
    return _Stored({group: _chain(group, count) for group, count in (counts or {"g-1": 5, "g-2": 3}).items()})


def _oracle_of(store: _Stored, *, attempted: bool = True) -> torture.Acknowledged:
    oracle = torture.Acknowledged()
    for items in store.events.values():
        for event in items:
            oracle.add_receipt(event.action_id, event.group, event.seq, event.event_id)
            if attempted:
                oracle.attempted.add(event.action_id)
    return oracle


class _Agent:
    """What check_agent asks an AgentStore: a consistent follower of ``store`` up to ``applied``."""

    def __init__(self, store: _Stored, applied: dict[str, int]) -> None:
        self.heads: dict[str, SimpleNamespace] = {}
        self.inbox: dict[str, list[int]] = {}
        self.counts: dict[str, dict[int, int]] = {}
        self.buffered: dict[str, list[int]] = {}
        self.mirror: dict[str, dict[str, Any]] = {}
        for group, seq in applied.items():
            events = store.events[group]
            self.heads[group] = SimpleNamespace(cursor=seq, applied_seq=seq, applied_hash=events[seq - 1].hash if seq else ZERO_HASH,
                                                pruned_seq=0, floor_seq=0)
            self.inbox[group] = list(range(1, seq + 1))
            self.counts[group] = {number: 1 for number in range(1, seq + 1)}
            self.buffered[group] = []
            states: dict[str, Any] = {}
            for event in events[:seq]:
                for effect in event.effects:
                    states[effect.aggregate] = effect.state
            self.mirror[group] = {key: state for key, state in states.items() if state is not None}

    def groups(self) -> list[str]:
        return list(self.heads)

    def head(self, group: str) -> SimpleNamespace:
        return self.heads[group]

    def inbox_seqs(self, group: str) -> list[int]:
        return list(self.inbox[group])

    def projection_items(self, group: str, name: str) -> list[tuple[bytes, bytes]]:
        assert name == torture.CountingProjection.name
        return [(f"seen:{seq:012d}".encode(), str(count).encode()) for seq, count in sorted(self.counts[group].items())]

    def buffered_seqs(self, group: str) -> list[int]:
        return list(self.buffered[group])

    def states(self, group: str) -> dict[str, Any]:
        return dict(self.mirror[group])


# -- budgets, findings, results ---------------------------------------------------------------------


def test_a_count_budget_runs_exactly_its_count():
    budget = torture.Budget(3, None, 10)
    assert [budget.more(done) for done in range(5)] == [True, True, True, False, False]
    assert torture.Budget(None, None, 2).count == 2  # neither given: the short run's count


def test_a_time_budget_runs_until_its_seconds_are_spent(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(torture, "time", SimpleNamespace(monotonic=lambda: now[0]))
    budget = torture.Budget(None, 5.0, 12)
    assert budget.count is None  # the seconds, not the default count
    assert budget.more(0) and budget.more(10_000)
    now[0] = 104.9
    assert budget.more(50)
    now[0] = 105.0
    assert not budget.more(50)
    assert torture.Budget(7, 5.0, 12).more(6) and not torture.Budget(7, 5.0, 12).more(7)  # the count wins


def test_findings_count_every_violation_and_describe_the_first_ones():
    findings = torture.Findings()
    for number in range(60):
        findings.add(f"kill {number} (random, seed 1): group g-1: chain break at seq {number}")
    assert findings.count == 60
    assert len(findings.messages) == torture.VIOLATION_MESSAGES_MAX and findings.messages[0].startswith("kill 0 ")
    assert findings.kinds == {"group g-#: chain break at seq #": 60}
    result = torture._result("crash", 1, 9, 0.0, findings, {"kills": 9})
    assert result["violations"] == 60 and result["iterations"] == 9
    assert result["details"]["violation_kinds"] == {"group g-#: chain break at seq #": 60}
    assert result["details"]["violation_messages"] == findings.messages and result["details"]["kills"] == 9


def test_findings_keep_counting_the_kinds_they_know_once_full():
    findings = torture.Findings()
    for number in range(torture.VIOLATION_MESSAGES_MAX):
        findings.add("problem " + "x" * (number + 1))
    findings.add("problem x")
    findings.add("a new kind, past the limit")
    assert len(findings.kinds) == torture.VIOLATION_MESSAGES_MAX and findings.kinds["problem x"] == 2
    assert "a new kind, past the limit" not in findings.kinds and findings.count == 52


# -- check_authority and read_group ----------------------------------------------------------------


def test_the_stand_in_store_passes_every_check_until_it_is_broken():
    store = _stored()
    assert torture.check_authority(store, _oracle_of(store)) == []
    agent = _Agent(store, {"g-1": 5, "g-2": 2})
    assert torture.check_agent(agent, store, consumer="c") == []


def test_read_group_reads_a_group_longer_than_one_page():
    store = _stored(**{"g-1": 25, "g-2": 1})
    store.page = 10  # the store answers at most 10 Events a read, as a real one answers its limit
    assert [event.seq for event in torture.read_group(store, "g-1")] == list(range(1, 26))
    assert torture.check_authority(store, _oracle_of(store)) == []


def test_the_authority_check_catches_a_gap_in_a_group():
    store = _stored()
    del store.events["g-1"][2]  # seq 3 gone; the head still says 5
    problems = torture.check_authority(store, torture.Acknowledged(), full_verify=False)
    assert any("group g-1: sequences are not 1..5 (got 4 Events)" == problem for problem in problems), problems


def test_the_authority_check_catches_a_chain_break():
    store = _stored()
    store.events["g-2"][2].prev_hash = _hash("g-2", 2, "another")
    problems = torture.check_authority(store, torture.Acknowledged(), full_verify=False)
    assert problems[0] == "group g-2: chain break at seq 3", problems  # (the fold stops there too)


def test_the_authority_check_catches_a_head_that_is_not_the_last_event():
    store = _stored()
    store.heads["g-1"] = (5, _hash("g-1", 5, "another"))
    problems = torture.check_authority(store, torture.Acknowledged(), full_verify=False)
    assert problems == ["group g-1: head hash differs from the last Event's hash"], problems


def test_the_authority_check_catches_a_receipt_whose_event_id_changed():
    store = _stored()
    oracle = _oracle_of(store)
    group, seq, _ = oracle.receipts["g-1-a3"]
    oracle.receipts["g-1-a3"] = (group, seq, "g-1:another")  # same place, another Event
    problems = torture.check_authority(store, oracle, full_verify=False)
    assert problems == ["acknowledged action g-1-a3 moved: was g-1/3, now g-1/3"], problems


def test_the_authority_check_spares_group_creations_from_the_phantom_check():
    """The ``create-`` actions come from ensure_groups, which a child may run before it says what
    it tried: they are never phantoms; any other unsubmitted action is."""
    store = _stored()
    oracle = _oracle_of(store)
    oracle.attempted -= {"create-g-1", "create-g-2"}
    assert torture.check_authority(store, oracle, full_verify=False) == []
    oracle.attempted.discard("g-2-a2")
    assert torture.check_authority(store, oracle, full_verify=False) == [
        "group g-2: Event 2 has action g-2-a2 that was never submitted"]


def test_the_authority_check_covers_every_group_the_store_has():
    store = _Stored({"g-1": _chain("g-1", 2), "g-2": _chain("g-2", 2), "g-3": _chain("g-3", 4)})
    del store.events["g-3"][1]
    problems = torture.check_authority(store, torture.Acknowledged(), full_verify=False)
    assert any(problem.startswith("group g-3: sequences are not 1..4") for problem in problems), problems


def test_the_authority_check_reports_verify_s_problems():
    store = _stored()
    store.problems = ["index entry differs from a rebuild"]
    assert torture.check_authority(store, torture.Acknowledged()) == ["verify: index entry differs from a rebuild"]
    assert torture.check_authority(store, torture.Acknowledged(), full_verify=False) == []


class _SnapshotsAs:
    """A real Authority whose snapshot listing and reading a test replaces."""

    def __init__(self, authority: Authority, refs: list[Any], data: bytes) -> None:
        self._authority, self._refs, self._data = authority, refs, data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._authority, name)

    def snapshots(self, group: str) -> list[Any]:
        return [ref for ref in self._refs if ref.group == group]

    def read_snapshot(self, ref: Any) -> bytes:
        return self._data


def test_the_authority_check_catches_an_acknowledged_snapshot_that_is_not_listed(tmp_path):
    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        ref = authority.snapshot("g-1")
        oracle.snapshots.add((ref.group, ref.seq))
        assert torture.check_authority(authority, oracle, full_verify=False) == []
        problems = torture.check_authority(_SnapshotsAs(authority, [], b""), oracle, full_verify=False)
    assert problems == [f"acknowledged snapshot g-1@{ref.seq} is not listed"], problems


def test_the_authority_check_catches_snapshot_bytes_the_reference_does_not_name(tmp_path):
    """Another valid snapshot of the same Group verifies: only the reference's size and hash tell
    the bytes are not the ones acknowledged."""
    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        first = authority.snapshot("g-1")
        other = authority.read_snapshot(first)
        authority.accept(torture._mission_create("g-1", "m-later", "a-later"))
        ref = authority.snapshot("g-1")
        oracle.snapshots.add((ref.group, ref.seq))
        problems = torture.check_authority(_SnapshotsAs(authority, [ref], other), oracle, full_verify=False)
    assert len(problems) == 1 and problems[0].startswith(f"acknowledged snapshot g-1@{ref.seq} does not verify"), problems


def test_the_authority_check_catches_a_snapshot_that_matches_its_reference_but_does_not_verify(tmp_path):
    import blake3

    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        ref = authority.snapshot("g-1")
        oracle.snapshots.add((ref.group, ref.seq))
        damaged = bytearray(authority.read_snapshot(ref))
        damaged[len(damaged) // 2] ^= 0x10
        forged = type(ref)(**{**ref.to_dict(), "file_hash": blake3.blake3(bytes(damaged)).hexdigest()})
        problems = torture.check_authority(_SnapshotsAs(authority, [forged], bytes(damaged)), oracle, full_verify=False)
    assert len(problems) == 1 and problems[0].startswith(f"acknowledged snapshot g-1@{ref.seq} does not verify"), problems


def test_the_crash_suite_checks_against_what_the_child_said_and_tried(monkeypatch):
    """The oracle a killed child's store is checked against holds exactly the receipts and
    snapshots it acknowledged, and every action it tried (with none, the phantom check is off);
    a torn or unknown line adds nothing. (The child's lines are given: no child runs.)"""
    lines = ["READY", "TRY k0-0-1", "OK k0-0-1 g-1 2 g-1:2", "TRY k0-1-1 k0-1-1-b", "OK k0-1-1-b g-2 2 g-2:2",
             "SNAP g-1 2", "COMPACTED", "OK k0-1-1 g-1"]
    monkeypatch.setattr(torture, "_kill_child", lambda *arguments: (lines, "random", False, ""))
    oracles: list[torture.Acknowledged] = []
    monkeypatch.setattr(torture, "check_authority", lambda authority, oracle, **options: oracles.append(copy.deepcopy(oracle)) or [])
    result = torture.run_crash(count=1, seed=2)
    assert result["violations"] == 0, result["details"]["violation_messages"]
    [oracle] = oracles
    assert oracle.receipts == {"k0-0-1": ("g-1", 2, "g-1:2"), "k0-1-1-b": ("g-2", 2, "g-2:2")}
    assert oracle.snapshots == {("g-1", 2)}
    assert oracle.attempted == {"k0-0-1", "k0-1-1", "k0-1-1-b"}
    assert result["details"]["acknowledged_results"] == 2 and result["details"]["compactions_completed"] == 1


def test_an_index_that_fails_its_structural_check_after_a_kill_is_a_violation(monkeypatch):
    """A kill leaves LMDB's file whole (the page cache survives it): a reopen that finds the index
    damaged is a wrong check or damage the engine caused, never an expected recovery."""
    from mwpstore.authority import OpenReport

    monkeypatch.setattr(torture, "_kill_child", lambda *arguments: (["READY"], "random", False, ""))
    real_open = Authority.open.__func__

    def open_damaged(cls, path, **options):
        authority = real_open(cls, path, **options)
        authority.open_report = OpenReport(mode="rebuild", reason="index damaged: planted", redo_records=0)
        return authority

    monkeypatch.setattr(Authority, "open", classmethod(open_damaged))
    result = torture.run_crash(count=1, seed=2)
    messages = result["details"]["violation_messages"]
    assert len(messages) == 1 and "the index failed its structural check after a kill: index damaged: planted" in messages[0], messages


@pytest.mark.parametrize("error, expected", [
    (Corruption("a segment's seal differs", reason="seal"), "reopen failed: CORRUPTION"),
    (KeyError("heads"), "reopen raised a foreign error: KeyError"),
])
def test_a_store_that_does_not_reopen_after_a_kill_is_a_violation(monkeypatch, error, expected):
    def refuse(path, **options):
        raise error

    monkeypatch.setattr(torture, "_kill_child", lambda *arguments: (["READY"], "random", False, ""))
    monkeypatch.setattr(Authority, "open", refuse)
    result = torture.run_crash(count=1, seed=2)
    messages = result["details"]["violation_messages"]
    assert len(messages) == 1 and messages[0].startswith("kill 1 (random, seed 2): " + expected), messages


# -- check_agent ----------------------------------------------------------------------------------


def _agent_problems(change, applied: dict[str, int] | None = None, consumer: str | None = None) -> list[str]:
    store = _stored()
    agent = _Agent(store, applied or {"g-1": 4})
    change(store, agent)
    return torture.check_agent(agent, store, consumer=consumer)


def test_the_agent_check_catches_an_agent_ahead_of_the_authority():
    def ahead(store: _Stored, agent: _Agent) -> None:
        del store.events["g-1"][3:]  # the authority holds 3 Events; the agent applied 4

    assert _agent_problems(ahead) == ["agent group g-1: cursor 4, applied 4, authority head 3"]


def test_the_agent_check_catches_a_cursor_past_what_was_applied():
    def past(store: _Stored, agent: _Agent) -> None:
        agent.heads["g-1"].cursor = 5

    assert _agent_problems(past) == ["agent group g-1: cursor 5, applied 4, authority head 5"]


def test_the_agent_check_catches_a_wrong_event_applied():
    def wrong(store: _Stored, agent: _Agent) -> None:
        agent.heads["g-1"].applied_hash = _hash("g-1", 4, "a forged Event")

    assert _agent_problems(wrong) == ["agent group g-1: applied head hash differs from the authority's Event 4"]


def test_the_agent_check_catches_an_inbox_with_a_hole():
    def hole(store: _Stored, agent: _Agent) -> None:
        agent.inbox["g-1"].remove(2)

    assert _agent_problems(hole) == ["agent group g-1: inbox is not the contiguous applied range (3 entries, applied 4)"]


def test_the_agent_check_catches_an_applied_event_the_projection_never_saw():
    def missed(store: _Stored, agent: _Agent) -> None:
        del agent.counts["g-1"][3]

    assert _agent_problems(missed) == ["agent group g-1: projection counts wrong (twice [], missing [3], beyond applied [])"]

    def beyond(store: _Stored, agent: _Agent) -> None:
        agent.counts["g-1"][5] = 1

    assert _agent_problems(beyond) == ["agent group g-1: projection counts wrong (twice [], missing [], beyond applied [5])"]


def test_the_agent_check_catches_a_buffered_event_that_is_next_in_line():
    """Event applied+1 in the buffer: it should have been applied, not kept waiting for a gap."""
    def next_in_line(store: _Stored, agent: _Agent) -> None:
        agent.buffered["g-1"] = [5]

    assert _agent_problems(next_in_line) == ["agent group g-1: a buffered Event is not beyond the gap"]

    def beyond_the_gap(store: _Stored, agent: _Agent) -> None:
        agent.buffered["g-1"] = [6]

    assert _agent_problems(beyond_the_gap) == []


def test_the_agent_check_catches_a_mirrored_state_unlike_the_authority_s():
    def stale(store: _Stored, agent: _Agent) -> None:
        agent.mirror["g-1"]["mission:m2"] = {"title": "stale"}

    assert _agent_problems(stale) == ["agent group g-1: mirrored states differ from the authority's Events 1..4"]


def test_the_agent_check_expects_no_mirror_of_a_deleted_aggregate():
    """An Effect whose state is None ends an aggregate: the mirror holds live aggregates only."""
    store = _stored()
    events = store.events["g-1"]
    events[2].effects.append(SimpleNamespace(aggregate="mission:m1", revision=2, state=None))
    store.index = _Stored(store.events).index
    agent = _Agent(store, {"g-1": 4})
    assert "mission:m1" not in agent.states("g-1")
    assert torture.check_agent(agent, store) == []


def test_the_agent_check_catches_an_ack_above_the_durable_cursor():
    def acked(store: _Stored, agent: _Agent) -> None:
        agent.heads["g-1"].cursor = 3
        store.acks[("agent-0", "g-1")] = 4

    assert _agent_problems(acked, consumer="agent-0") == ["agent group g-1: the authority holds ACK 4 above the durable Cursor 3"]

    def level(store: _Stored, agent: _Agent) -> None:
        store.acks[("agent-0", "g-1")] = 4

    assert _agent_problems(level, consumer="agent-0") == []


# -- power: the oracle at a crash point, and the check of a recovered state ------------------------


def test_the_power_oracle_holds_exactly_the_marks_before_the_crash_point():
    receipt = ("a-1", "g-1", 2, "g-1:2")
    operations = [("write", 0, b"x"), ("sync", 0), ("mark", "receipt", receipt), ("mark", "ack", ("agent-p", "g-1", 2)),
                  ("write", 1, b"y"), ("mark", "ack", ("agent-p", "g-2", 1))]
    attempted = {"a-1", "a-2"}
    for crash_at, receipts, acks in ((2, {}, {}), (3, {"a-1": receipt[1:]}, {}),
                                     (4, {"a-1": receipt[1:]}, {("agent-p", "g-1"): 2}),
                                     (6, {"a-1": receipt[1:]}, {("agent-p", "g-1"): 2, ("agent-p", "g-2"): 1})):
        oracle, found = torture._oracle_before(operations, crash_at, attempted)
        assert (oracle.receipts, found) == (receipts, acks), crash_at
        assert oracle.attempted == attempted  # the phantom check runs on power states too


def _power_target(tmp_path) -> str:
    target = str(tmp_path / "state")
    with Authority.open(target, segment_bytes=torture.POWER_SEGMENT_BYTES) as authority:
        torture.ensure_groups(authority)
        authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
    return target


def test_the_power_check_catches_a_lost_acknowledged_receipt(tmp_path):
    target = _power_target(tmp_path)
    oracle = torture.Acknowledged()
    oracle.add_receipt("a-gone", "g-1", 3, "g-1:3")
    problems, _ = torture._check_power_state(target, oracle, {}, "boot-p", False, {})
    assert problems == ["acknowledged action a-gone (group g-1 seq 3) is lost"], problems


def test_the_power_check_catches_a_recovered_store_that_does_not_append(tmp_path, monkeypatch):
    target = _power_target(tmp_path)
    monkeypatch.setattr(Authority, "accept", lambda self, command: None)  # takes the write, writes nothing
    problems, _ = torture._check_power_state(target, torture.Acknowledged(), {}, "boot-p", False, {})
    assert problems == ["the recovered store did not append"], problems


@pytest.mark.parametrize("error, expected", [
    (Corruption("the log is damaged", reason="frame_checksum"), "open after power loss failed: CORRUPTION: the log is damaged"),
    (KeyError("heads"), "open after power loss raised a foreign error: KeyError: 'heads'"),
])
def test_a_power_state_that_does_not_open_is_a_violation(tmp_path, monkeypatch, error, expected):
    target = _power_target(tmp_path)

    def refuse(path, **options):
        raise error

    monkeypatch.setattr(Authority, "open", refuse)
    problems, _ = torture._check_power_state(target, torture.Acknowledged(), {}, "boot-p", False, {})
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# -- disk: the judge of a run's lines, the reopen ---------------------------------------------------


def test_the_disk_judge_builds_the_oracle_from_the_lines():
    lines = ["TRY d1 d1-b", "OK d1 g-1 2 g-1:2 0 0", "SNAP g-2 1 0 0", "ACK agent-d g-1 2 0 0", "CLOSED"]
    oracle, problems = torture._judge_disk_lines(lines, [])
    assert problems == []
    assert oracle.receipts == {"d1": ("g-1", 2, "g-1:2")}
    assert oracle.snapshots == {("g-2", 1)}
    assert oracle.attempted == {"d1", "d1-b"}


@pytest.mark.parametrize("line", ["FOREIGN OSError 0 0", "OPENFOREIGN PanicError: boom", "CLOSEFOREIGN OSError: boom"])
def test_the_disk_judge_flags_every_foreign_error(line):
    _, problems = torture._judge_disk_lines(["OK create-g-1 g-1 1 g-1:1 0 0", line], [])
    assert problems == [f"a foreign (untyped) error escaped: {line}"]


def test_the_disk_judge_flags_an_ack_that_met_a_failure_or_came_after_one():
    _, problems = torture._judge_disk_lines(["ACK agent-d g-1 2 0 1"], ["/s/log/00000000000000000000.seg"])
    assert problems == ["acknowledged although the call met an injected failure: ACK agent-d g-1 2 0 1"]
    lines = ["FAIL STORAGE_FAILED 0 1", "ACK agent-d g-1 2 1 1", "SNAP g-1 2 1 1"]
    _, problems = torture._judge_disk_lines(lines, ["/s/log/00000000000000000000.seg"])
    assert problems == [f"acknowledged after a failed log sync/write (retry-then-acknowledge): {line}" for line in lines[1:]]
    # a fault injected outside any call (the counts moved between two lines): a later failure is
    # the store refusing after it, and a success after that is still a retry-then-acknowledge
    lines = ["OK d1 g-1 2 g-1:2 0 0", "FAIL STORAGE_FAILED 1 1", "OK d2 g-1 3 g-1:3 1 1"]
    _, problems = torture._judge_disk_lines(lines, ["/s/log/00000000000000000000.seg"])
    assert problems == [f"acknowledged after a failed log sync/write (retry-then-acknowledge): {lines[2]}"]


def test_the_disk_judge_allows_success_after_a_failure_outside_the_log():
    """Only a failed log write or sync forbids every later acknowledgement (the log cannot tell
    what reached the disk); a failed index or snapshot sync may be retried."""
    lines = ["FAIL STORAGE_FAILED 0 1", "OK d2 g-1 3 g-1:3 1 1"]
    assert torture._judge_disk_lines(lines, ["/s/index/data.mdb"])[1] == []
    assert torture._judge_disk_lines(lines, ["/s/log/00000000000000000000.seg"])[1] != []
    # the store's own log directory decides, not "/log" anywhere in the path (a scratch root under /var/log)
    assert torture._judge_disk_lines(lines, ["/var/log/t/s/index/data.mdb"])[1] == []
    assert torture._judge_disk_lines(lines, ["/var/log/t/s/log/00000000000000000000.seg"])[1] != []
    assert torture._judge_disk_lines(lines, ["/var/log/t/s/log"])[1] != []  # the seam's cases name the directory


def test_a_short_write_is_forgiven_only_on_a_success():
    for line in ("OK d1 g-1 2 g-1:2 0 1", "SNAP g-1 2 0 1", "ACK agent-d g-1 2 0 1"):
        forgiven = torture._forgive_short(line)
        assert forgiven == line[: -len("0 1")] + "1 1"
        assert torture._judge_disk_lines([forgiven], [])[1] == []
    assert torture._forgive_short("FAIL STORAGE_FAILED 0 1") == "FAIL STORAGE_FAILED 0 1"


def test_the_disk_reopen_runs_the_full_verify(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    _store_with_receipts(path)[0].close()
    report = SimpleNamespace(problems=["an index entry differs from the log"], ok=False)
    monkeypatch.setattr(Authority, "verify", lambda self: report)
    assert torture._reopen_and_check(path, torture.Acknowledged(), "boot-d") == ["verify: an index entry differs from the log"]


@pytest.mark.parametrize("error, expected", [
    (StorageFailed("the index cannot be read", reason="io"), "reopen after the disk failure failed: STORAGE_FAILED"),
    (OSError(5, "Input/output error"), "reopen raised a foreign error: OSError"),
])
def test_a_disk_store_that_does_not_reopen_is_a_violation(tmp_path, monkeypatch, error, expected):
    def refuse(path, **options):
        raise error

    monkeypatch.setattr(Authority, "open", refuse)
    problems = torture._reopen_and_check(str(tmp_path / "store"), torture.Acknowledged(), "boot-d")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# -- corruption: the log judge, each family's verdict, the LMDB judges -----------------------------


@pytest.fixture
def small_log(tmp_path) -> tuple[str, list[tuple[int, bytes]]]:
    from mwpstore.segment_log import SegmentLog

    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=64 * 1024) as log:
        log.append([b"one", b"two"])
        log.append([b"three"])
        original = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
    return directory, original


def test_the_log_judge_wants_corruption_to_name_segment_and_offset(small_log, monkeypatch):
    from mwpstore.segment_log import SegmentLog

    directory, original = small_log
    for detail, expected in (({"segment": "0.seg", "offset": 64}, ""), ({"segment": "0.seg"}, "without segment and offset"),
                             ({"offset": 64}, "without segment and offset"), ({}, "without segment and offset")):
        def damaged(self, detail=detail):
            raise Corruption("a frame checksum differs", **detail)

        monkeypatch.setattr(SegmentLog, "verify", damaged)
        outcome, violation = torture._judge_log(directory, original, must_keep_all=True)
        assert outcome == "detected" and (expected in violation if expected else violation == ""), (detail, violation)


def test_the_log_judge_runs_verify_after_the_scan(small_log, monkeypatch):
    """Damage only verify() finds (the scan served every record) is detected, never intact."""
    from mwpstore.segment_log import SegmentLog

    directory, original = small_log

    def damaged(self):
        raise Corruption("a sealed segment's seal differs", segment="0.seg", offset=0)

    monkeypatch.setattr(SegmentLog, "verify", damaged)
    assert torture._judge_log(directory, original, must_keep_all=True) == ("detected", "")


@pytest.mark.parametrize("error, outcome, violation", [
    (StorageFailed("read failed"), "detected", ""),
    (InvalidState("not open", reason="closed"), "detected", "a typed error that is not CORRUPTION: INVALID_STATE: not open"),
    (IndexError("list index out of range"), "foreign", "foreign error IndexError: list index out of range"),
])
def test_the_log_judge_tells_typed_errors_from_others(small_log, monkeypatch, error, outcome, violation):
    from mwpstore.segment_log import SegmentLog

    directory, original = small_log

    def fail(self):
        raise error

    monkeypatch.setattr(SegmentLog, "verify", fail)
    assert torture._judge_log(directory, original, must_keep_all=False) == (outcome, violation)


@pytest.fixture(scope="module")
def corruption_fixture(tmp_path_factory) -> Any:
    return torture._build_fixture(str(tmp_path_factory.mktemp("corruption")), random.Random(3))


def test_each_log_family_is_judged_with_its_own_rule(corruption_fixture, tmp_path, monkeypatch):
    """A cut, zeroed or garbled tail may read as a torn write (a correct prefix passes); a single
    flipped bit, a damaged block before the tail and any flip in a sealed segment or a header
    must be reported: a prefix there is a violation. Missing or reordered files may end early."""
    asked: list[bool] = []

    def spy(directory, original, *, must_keep_all):
        asked.append(must_keep_all)
        return "intact", ""

    monkeypatch.setattr(torture, "_judge_log", spy)
    expected = {"tail_cut": False, "tail_zero": False, "tail_garble": False, "tail_flip": True, "active_block": True,
                "sealed_flip": True, "header_flip": True, "segment_files": False}
    rng, sweep = random.Random(5), {}
    for number, (family, keep_all) in enumerate(expected.items()):
        work = str(tmp_path / str(number))
        os.makedirs(work)
        asked.clear()
        torture._corruption_case(family, corruption_fixture, rng, work, sweep)
        assert asked == [keep_all], family


def test_a_flipped_snapshot_that_verifies_is_a_violation(corruption_fixture, tmp_path, monkeypatch):
    import mwpstore.snapshot as snapshot_module

    monkeypatch.setattr(snapshot_module, "verify_snapshot", lambda data, **options: None)
    outcome, violation = torture._corruption_case("snapshot_flip", corruption_fixture, random.Random(1), str(tmp_path), {})
    assert outcome == "accepted" and "verified" in violation

    def untyped(data, **options):
        raise ValueError("bad length")

    monkeypatch.setattr(snapshot_module, "verify_snapshot", untyped)
    outcome, violation = torture._corruption_case("snapshot_flip", corruption_fixture, random.Random(1), str(tmp_path), {})
    assert outcome == "foreign" and "ValueError: bad length" in violation


def test_a_flipped_audit_log_read_without_error_or_wrongly_is_a_violation(corruption_fixture, tmp_path, monkeypatch):
    import mwpstore.audit_log as audit_module

    fixture = corruption_fixture
    monkeypatch.setattr(audit_module, "read_audit_log", lambda path, **options: iter(fixture.audit_records))
    for number in range(1, 5):
        os.makedirs(tmp_path / str(number))
    outcome, violation = torture._corruption_case("audit_flip", fixture, random.Random(1), str(tmp_path / "1"), {})
    assert outcome == "accepted" and "read without error" in violation

    def wrong_then_refused(path, **options):
        yield b"a record nobody wrote"
        raise Corruption("chunk MAC differs", check="mac")

    monkeypatch.setattr(audit_module, "read_audit_log", wrong_then_refused)
    outcome, violation = torture._corruption_case("audit_flip", fixture, random.Random(1), str(tmp_path / "2"), {})
    assert outcome == "wrong" and "records before the error differ" in violation

    def right_then_refused(path, **options):
        yield fixture.audit_records[0]
        raise Corruption("chunk MAC differs", check="mac")

    monkeypatch.setattr(audit_module, "read_audit_log", right_then_refused)
    assert torture._corruption_case("audit_flip", fixture, random.Random(1), str(tmp_path / "3"), {}) == ("rejected:mac", "")

    def untyped(path, **options):
        raise ValueError("bad length")

    monkeypatch.setattr(audit_module, "read_audit_log", untyped)
    outcome, violation = torture._corruption_case("audit_flip", fixture, random.Random(1), str(tmp_path / "4"), {})
    assert outcome == "foreign" and "ValueError: bad length" in violation


def _printed_cases(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"done"' in line]


def test_the_flip_loop_flips_the_bit_and_reports_each_judge_s_verdict(tmp_path, capsys):
    fixture = tmp_path / "fixture"
    fixture.mkdir()
    (fixture / "data.mdb").write_bytes(bytes(16))
    (fixture / "lock.mdb").write_bytes(b"lock")
    seen: list[tuple[bytes, bool]] = []
    verdicts = iter([("no_effect", ""), ("wrong", "answered wrongly")])

    def judge(target: str, offset: int, bit: int) -> tuple[str, str]:
        seen.append((open(os.path.join(target, "data.mdb"), "rb").read(), os.path.exists(os.path.join(target, "lock.mdb"))))
        if offset == 9:
            raise KeyError("page")
        if offset == 10:
            raise Corruption("a page checksum differs")
        return next(verdicts)

    torture._flip_cases([[3, 1], [15, 7], [9, 0], [10, 0]], str(fixture), str(tmp_path / "work"), "data.mdb", ("lock.mdb",), judge)
    flipped3, flipped15 = bytearray(16), bytearray(16)
    flipped3[3], flipped15[15] = 2, 128
    assert seen[:2] == [(bytes(flipped3), False), (bytes(flipped15), False)]
    done = _printed_cases(capsys)
    assert [(case["outcome"], case["violation"]) for case in done] == [
        ("no_effect", ""), ("wrong", "answered wrongly"), ("foreign", "LMDB flip at 9 bit 0: KeyError: 'page'"),
        ("typed_error:CORRUPTION", "")]


class _Opened:
    def __init__(self, mode: str, verify_problems: list[str]) -> None:
        self.open_report = SimpleNamespace(mode=mode)
        self._problems = verify_problems
        self.rebuilt = False

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def verify(self) -> SimpleNamespace:
        return SimpleNamespace(problems=list(self._problems), ok=not self._problems)

    def rebuild(self) -> None:
        self.rebuilt = True


@pytest.mark.parametrize("mode, reads, verify, after_rebuild, outcome, violation", [
    ("rebuild", [], [], [], "rebuilt_at_open", ""),
    ("rebuild", [], ["x"], [], "rebuilt_at_open", "rebuilt index is wrong"),
    ("rebuild", ["lost"], [], [], "rebuilt_at_open", "rebuilt index is wrong"),
    ("clean", [], [], [], "no_effect", ""),
    ("clean", [], ["x"], [], "found_by_verify", ""),
    ("clean", ["lost"], ["x"], [], "wrong_reads_until_verify", "reads served wrong data"),
    ("clean", ["lost"], ["x"], ["lost"], "wrong_reads_until_verify", "and rebuild() did not restore it"),
    ("clean", ["lost"], [], [], "wrong", "silently wrong data"),
])
def test_the_lmdb_flip_judge(tmp_path, monkeypatch, capsys, mode, reads, verify, after_rebuild, outcome, violation):
    """Reads that answer wrongly are a violation whether verify() notices or not; a rebuilt index
    must be right; a flip that changes nothing, or that verify() alone finds, is not."""
    store = tmp_path / "store"
    (store / "index").mkdir(parents=True)
    (store / "index" / "data.mdb").write_bytes(bytes(64))
    (tmp_path / "cases.json").write_text("[[5, 2]]")
    (tmp_path / "oracle.json").write_text(json.dumps({"receipts": {"a-1": ["g-1", 2, "g-1:2"]}, "snapshots": []}))
    opened = _Opened(mode, verify)
    monkeypatch.setattr(Authority, "open", lambda path, **options: opened)
    checked: list[dict[str, Any]] = []

    def check_authority(authority, oracle, *, full_verify=True):
        checked.append(dict(oracle.receipts))
        return after_rebuild if opened.rebuilt else reads

    monkeypatch.setattr(torture, "check_authority", check_authority)
    torture.corruption_lmdb_child([str(store), str(tmp_path / "work"), str(tmp_path / "cases.json"), str(tmp_path / "oracle.json"), "boot"])
    [case] = _printed_cases(capsys)
    assert case["outcome"] == outcome and (violation in case["violation"] if violation else case["violation"] == ""), case
    assert checked[0] == {"a-1": ("g-1", 2, "g-1:2")}


def test_the_agent_lmdb_flip_judge_flags_a_store_that_answers_differently(tmp_path, monkeypatch, capsys):
    from mwpstore.agent_store import AgentStore

    agent = tmp_path / "agent"
    (agent / "lmdb").mkdir(parents=True)
    (agent / "lmdb" / "data.mdb").write_bytes(bytes(64))
    (tmp_path / "cases.json").write_text("[[1, 0], [2, 0]]")
    (tmp_path / "expected.json").write_text(json.dumps({"read": '{"groups": ["g-1"]}', "written": '{"groups": ["g-2"]}'}))
    # the first copy: its reads, its reads after the write and once reopened; the second: its reads
    answers = iter(['{"groups": ["g-1"]}', '{"groups": ["g-2"]}', '{"groups": ["g-2"]}', '{"groups": []}'])

    class Opened:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(AgentStore, "open", lambda path, **options: Opened())
    monkeypatch.setattr(torture, "agent_answers", lambda agent: next(answers))
    monkeypatch.setattr(torture, "_agent_flip_write", lambda agent: None)
    torture.corruption_agent_lmdb_child([str(agent), str(tmp_path / "work"), str(tmp_path / "cases.json"), str(tmp_path / "expected.json")])
    done = _printed_cases(capsys)
    assert [case["outcome"] for case in done] == ["no_effect", "wrong"]
    assert done[0]["violation"] == "" and "answered differently without an error" in done[1]["violation"]


def test_an_lmdb_flip_that_kills_the_child_is_a_violation_and_the_batch_goes_on(tmp_path, monkeypatch):
    fixture = SimpleNamespace(oracle=torture.Acknowledged(), store=str(tmp_path / "store"), boot="boot",
                              agent=str(tmp_path / "agent"), agent_dump="{}")
    runs: list[list[list[int]]] = []

    def child(command, **options):
        with open(command[-3]) as handle:  # CASES_JSON (FIXTURE_STORE WORK_DIR CASES_JSON ORACLE_JSON BOOT)
            cases = json.load(handle)
        runs.append(cases)
        assert len(runs) < 5, "the batch does not move past the case that killed its child"
        lines = []
        for number, (offset, bit) in enumerate(cases):
            lines.append(json.dumps({"start": number}))
            if offset == 20:  # this flip takes the process down
                return subprocess.CompletedProcess(command, -11, "\n".join(lines), "Fatal Python error: Segmentation fault")
            lines.append(json.dumps({"done": number, "offset": offset, "outcome": "no_effect", "violation": ""}))
        return subprocess.CompletedProcess(command, 0, "\n".join(lines), "")

    monkeypatch.setattr(torture.subprocess, "run", child)
    os.makedirs(tmp_path / "work")
    outcomes = torture._run_lmdb_batch(fixture, [(10, 0), (20, 1), (30, 2)], str(tmp_path / "work"))
    assert [outcome for outcome, _ in outcomes] == ["no_effect", "interpreter_crash", "no_effect"]
    assert "LMDB flip at 20 bit 1 killed the process (exit -11)" in outcomes[1][1]
    assert runs == [[[10, 0], [20, 1], [30, 2]], [[30, 2]]]


# -- concurrency: what a reader child saw, and how it ended -----------------------------------------


def test_the_reader_check_reports_what_the_reader_itself_found_wrong(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        document["problems"] = ["view of g-1: Event 3 of g-1 after 1 (chained)"]
        assert torture.check_reader(document, final, []) == ["reader check failed: view of g-1: Event 3 of g-1 after 1 (chained)"]


def test_the_reader_check_catches_a_view_whose_first_event_differs(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        document["views"].append({"t": [5.0, 6.0], "heads": {"g-2": [1, "00" * 32]}})
        problems = torture.check_reader(document, final, [])
    assert len(problems) == 1 and problems[0].startswith("a view showed g-2 Event 1 with hash 0000"), problems


def test_the_reader_check_catches_a_bare_log_longer_than_the_final_log(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        seen = document["logs"][0]
        longer = dict(seen, records=seen["records"] + 1, samples=[])
        problems = torture.check_reader(dict(document, logs=[longer]), final, [])
    assert f"a bare log open served {seen['records'] + 1} records; the final log holds {seen['records']}" in problems, problems


def test_the_reader_check_catches_a_log_id_the_store_never_had(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        seen = document["logs"][0]
        foreign = dict(seen, log_id=seen["log_id"] + 1)
        problems = torture.check_reader(dict(document, logs=[foreign]), final, [])
        assert problems == [f"a bare log open read log id {seen['log_id'] + 1}, which the store never had"]
        # an earlier log of the store (a compaction made the final one): its records, not its positions, count
        final.log_ids.add(seen["log_id"] + 1)
        moved = dict(foreign, samples=[[ordinal, position + 8, digest] for ordinal, position, digest in seen["samples"]])
        assert torture.check_reader(dict(document, logs=[moved]), final, []) == []


def test_the_reader_check_catches_a_bare_log_that_shrank(tmp_path):
    import random as random_module

    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        authority.accept(torture._mission_create("g-2", "m-more", "a-more"))
        longer = torture._read_log_once(str(tmp_path / "store"), random_module.Random(2), [])
        final = torture.FinalStore.of(authority, set())
        shorter = document["logs"][0]
        assert torture.check_reader(dict(document, logs=[shorter, longer]), final, []) == []
        problems = torture.check_reader(dict(document, logs=[longer, shorter]), final, [])
    assert problems == [f"a bare log open served {shorter['records']} records after an earlier one served {longer['records']}"]


def test_the_reader_check_catches_a_bare_log_whose_end_hides_records(tmp_path):
    """Same log: every record below the end the open saw must have been served."""
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        authority.accept(torture._mission_create("g-2", "m-more", "a-more"))
        final = torture.FinalStore.of(authority, set())
        seen = document["logs"][0]
        assert torture.check_reader(document, final, []) == []
        past = dict(seen, end=final.log_positions[-1] + 1)
        problems = torture.check_reader(dict(document, logs=[past]), final, [])
    assert len(problems) == 1 and problems[0].startswith(f"a bare log open ended at {past['end']} with {seen['records']} records"), problems


def _refusal(kind: str, code: str, reason: str | None, t: tuple[float, float]) -> dict[str, Any]:
    return {"kind": kind, "t": list(t), "code": code, "reason": reason, "message": "refused"}


@pytest.mark.parametrize("refusal, expected", [
    (_refusal("view-reader", "INVALID_STATE", "recovery_needed", (10.0, 10.1)), True),  # inside the window
    (_refusal("view-reader", "INVALID_STATE", "recovery_needed", (9.0, 10.0)), True),  # ends as it starts
    (_refusal("view-reader", "INVALID_STATE", "recovery_needed", (10.9, 12.0)), True),  # starts before it ends
    (_refusal("view-reader", "INVALID_STATE", "recovery_needed", (8.0, 9.9)), False),  # before it
    (_refusal("view-reader", "INVALID_STATE", "recovery_needed", (11.5, 12.0)), False),  # after it
    (_refusal("view-reader", "CORRUPTION", "recovery_needed", (10.2, 10.3)), False),
    (_refusal("view-reader", "STORAGE_FAILED", None, (10.2, 10.3)), False),
    (_refusal("log-reader", "STORAGE_FAILED", None, (10.2, 10.3)), True),
    (_refusal("log-reader", "STORAGE_FAILED", None, (12.0, 12.3)), False),
    (_refusal("log-reader", "CORRUPTION", "log_id_mismatch", (10.2, 10.3)), True),
    (_refusal("log-reader", "INVALID_STATE", "segment_replaced", (10.2, 10.3)), False),
    (_refusal("log-reader", "INVALID_STATE", "recovery_needed", (10.2, 10.3)), False),
])
def test_a_reader_refusal_is_expected_only_in_a_compaction_window_and_of_its_kind(refusal, expected):
    assert torture._expected_refusal(refusal, [(10.0, 11.0)]) is expected


def test_a_reader_refusal_after_a_compaction_is_a_violation(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        late = _refusal("view-reader", "INVALID_STATE", "recovery_needed", (20.0, 20.5))
        problems = torture.check_reader(dict(document, refusals=[late]), final, [(10.0, 11.0)])
    assert problems == ["view-reader refused with INVALID_STATE (recovery_needed) while the writer was appending: refused"]


def test_a_reader_document_that_is_not_an_object_is_a_violation(tmp_path):
    output = tmp_path / "reader.json"
    output.write_text("[]")
    assert torture.judge_reader_exit(0, "", str(output)) == (None, "left a document that is not an object")
    output.write_text('{"views": []}')
    assert torture.judge_reader_exit(0, "", str(output)) == ({"views": []}, "")
    output.write_text('{"views": [')
    assert torture.judge_reader_exit(0, "", str(output))[1].startswith("left no readable document (JSONDecodeError")


# -- fuzz: each target's verdict, the two-path comparisons -------------------------------------------


@pytest.fixture(scope="module")
def fuzz_context(tmp_path_factory):
    context = torture.FuzzContext(str(tmp_path_factory.mktemp("fuzz")))
    yield context
    context.close()


def test_a_modified_audit_log_that_reads_is_a_violation(fuzz_context, monkeypatch):
    import mwpstore.audit_log as audit_module

    sample = fuzz_context.samples["audit_log"][0]
    monkeypatch.setattr(audit_module, "read_audit_log", lambda path, **options: iter([b"record"]))
    torture.fuzz_one("audit_log", sample, fuzz_context)  # the genuine bytes: no violation
    with pytest.raises(torture.AcceptedForgery, match="modified audit log bytes read without error"):
        torture.fuzz_one("audit_log", sample[:-1] + bytes([sample[-1] ^ 1]), fuzz_context)


def test_index_paths_that_disagree_are_a_violation(fuzz_context, monkeypatch):
    record = fuzz_context.samples["index_record"][0]
    monkeypatch.setattr(torture, "index_paths", lambda index, records: (("Corruption", "frame", 8), ("Corruption", "frame", 16)))
    with pytest.raises(torture.IndexPathsDisagree, match="index a"):
        torture.fuzz_one("index_record", record, fuzz_context)
    monkeypatch.setattr(torture, "index_paths", lambda index, records: (("Corruption", "frame", 8), ("Corruption", "frame", 8)))
    with pytest.raises(Corruption):  # both refused it alike: a typed error, counted as such
        torture.fuzz_one("index_record", record, fuzz_context)


def test_an_index_entry_that_does_not_read_back_is_a_violation(fuzz_context, monkeypatch):
    def undecodable(outcome):
        raise Corruption("a sealed entry does not decode", reason="seal")

    monkeypatch.setattr(torture, "index_meaning", undecodable)
    with pytest.raises(torture.IndexPathsDisagree, match="does not decode"):
        torture.fuzz_one("index_record", fuzz_context.samples["index_record"][0], fuzz_context)


@pytest.mark.parametrize("target", ["agent_apply_many", "agent_check_run"])
def test_apply_paths_that_disagree_are_a_violation(fuzz_context, monkeypatch, target):
    monkeypatch.setattr(torture, "check_run_paths", lambda events: None)
    monkeypatch.setattr(torture, "apply_outcome", lambda store, events, use_many: ([use_many], None, ()))
    with pytest.raises(torture.ApplyPathsDisagree):
        torture.fuzz_one(target, fuzz_context.samples[target][0], fuzz_context)
    monkeypatch.setattr(torture, "apply_outcome", lambda store, events, use_many: ([], None, ()))
    torture.fuzz_one(target, fuzz_context.samples[target][0], fuzz_context)


def test_check_run_ending_elsewhere_than_its_definition_is_a_violation(fuzz_context, monkeypatch):
    monkeypatch.setattr(torture, "check_run_paths", lambda events: (3, 4))
    with pytest.raises(torture.ApplyPathsDisagree, match="end .* at 3 and 4"):
        torture.fuzz_one("agent_check_run", fuzz_context.samples["agent_check_run"][0], fuzz_context)


def test_check_run_paths_compares_the_c_check_with_its_python_definition(fuzz_context, monkeypatch):
    from mwpstore import agent_store
    from mwpstore.messages import decode_event

    events = [decode_event(data) for data in fuzz_context.events[:6]]
    assert torture.check_run_paths(events) == (6, 6)
    monkeypatch.setattr(agent_store, "_fully_valid_run", lambda *arguments: 2)
    assert torture.check_run_paths(events) == (6, 2)


def test_a_recursion_error_in_a_fuzzed_call_is_a_violation(fuzz_context, monkeypatch):
    def deep(target, data, context):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(torture, "fuzz_one", deep)
    findings = torture.Findings()
    torture._run_input("event_bytes", b"\x91" * 8, fuzz_context, findings, {})
    assert findings.count == 1 and "RecursionError" in findings.messages[0]


def test_apply_outcome_holds_the_heads_the_entries_and_the_error(fuzz_context, monkeypatch):
    from mwpstore.agent_store import AgentTransaction
    from mwpstore.messages import decode_event

    events = [decode_event(data) for data in fuzz_context.events[:4]]
    store = fuzz_context.full[0]
    statuses, error, (heads, entries, failed) = torture.apply_outcome(store, events, False)
    assert error is None and not failed and len(statuses) == 4
    assert heads == [("g-1", 4, events[-1].hash, 0, 0)]
    tables = dict(entries)
    assert len(tables[b"inbox"]) == 4 and len(tables[b"state"]) > 0  # what commit would write, flushed
    assert torture.apply_outcome(store, events[:3], False) != torture.apply_outcome(store, events, False)
    assert torture.apply_outcome(store, events, True) == torture.apply_outcome(store, events, False)

    def refuse(self, events):
        raise EventInvalid("refused by apply_many", reason="probe")

    monkeypatch.setattr(AgentTransaction, "apply_many", refuse)
    assert torture.apply_outcome(store, events, True)[:2] == (None, ("EventInvalid", "probe"))
    assert torture.apply_outcome(store, events, False)[1] is None  # the loop of apply() never calls it


def test_index_paths_runs_the_c_path_and_keeps_where_it_failed(fuzz_context, monkeypatch):
    from mwpstore import authority as authority_module

    records = [b"E" + event for event in fuzz_context.events[:3]]
    python, with_c = torture.index_paths(fuzz_context.index, records)
    assert torture.index_meaning(python) == torture.index_meaning(with_c)

    def c_fails(index, txn, writes, known, positions, records, last_ms):
        raise Corruption("a record does not decode", reason="record", offset=16)

    monkeypatch.setattr(authority_module, "_index_records", c_fails)
    python, with_c = torture.index_paths(fuzz_context.index, records)
    assert with_c == ("Corruption", "record", 16) and python != with_c

    def c_fails_elsewhere(index, txn, writes, known, positions, records, last_ms):
        raise Corruption("a record does not decode", reason="record", offset=8)

    monkeypatch.setattr(authority_module, "_index_records", c_fails_elsewhere)
    assert torture.index_paths(fuzz_context.index, records)[1] != with_c


def test_index_meaning_compares_every_part_of_an_outcome(fuzz_context):
    records = [b"E" + event for event in fuzz_context.events[:3]]
    python, _ = torture.index_paths(fuzz_context.index, records)
    writes, heads, last_ms = python
    meaning = torture.index_meaning(python)
    assert meaning == torture.index_meaning((writes, dict(heads), last_ms))
    group = next(iter(heads))
    assert torture.index_meaning((writes, {**heads, group: "another head"}, last_ms)) != meaning
    assert torture.index_meaning((writes, heads, last_ms + 1)) != meaning
    more = copy.deepcopy(writes)
    more.new[next(iter(more.new))].append(b"an entry not written before")
    assert torture.index_meaning((more, heads, last_ms)) != meaning


def test_comparable_tells_an_integer_from_a_boolean():
    assert torture._comparable(1) != torture._comparable(True)
    assert torture._comparable({"a": [0]}) != torture._comparable({"a": [False]})
    assert torture._comparable({"a": [1, 2.5]}) == torture._comparable({"a": [1, 2.5]})
