"""kill -9 at every step of the apply cycle: after reopening, no Event was applied twice to any
projection, the Cursor is contiguous, and catching up gives the clean store's projections.

A child process delivers two Groups through a misbehaving transport (duplicates, reordering, drops,
replays) and records an outbox intent in each local transaction; ``MWPSTORE_FAILPOINT`` makes it
SIGKILL itself at the named step of the cycle (on its n-th hit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from agent_store_support import CountingProjection, RestoringProjection, seen_counts, workload
from mwpstore.agent_store import AgentStore
from mwpstore.delivery import Delivery, ListSource

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GROUPS = {"g-1": 90, "g-2": 40}

CHILD = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from agent_store_support import CountingProjection, workload
    from mwpstore.agent_store import AgentStore
    from mwpstore.delivery import FaultyTransport, ListSource, deliver_batch

    events = {{group: workload(group, count, seed=len(group) + count) for group, count in {groups!r}.items()}}
    source = FaultyTransport(ListSource([e for history in events.values() for e in history]),
                             seed=7, drop=0.15, duplicate=0.2, reorder=0.5, disconnect=0.0, replay=4)
    agent = AgentStore.open({path!r}, projections=[CountingProjection()])
    for round_number in range(400):
        progressed = False
        for group, history in events.items():
            cursor = agent.cursor(group)
            if cursor >= len(history):
                continue
            progressed = True
            batch = source.read(group, after=cursor, limit=9)
            with agent.begin() as tx:
                for event in batch:
                    tx.apply(event)
                tx.record_intent(group, mission="m-" + group, workitem="w%d" % (round_number % 5), ownership_epoch=1,
                                 operation="notify-%d" % round_number)
                tx.advance_cursor(group)
        if not progressed:
            break
    agent.close()
    """
)

STEPS = [
    ("agent.begin", 5),
    ("agent.after_dedupe", 3),
    ("agent.after_sequence", 17),
    ("agent.after_builtin_projection", 23),
    ("agent.after_projection", 40),
    ("agent.after_buffer", 4),
    ("agent.after_intent", 6),
    ("agent.after_cursor", 9),
    ("agent.before_commit", 11),
    ("agent.after_commit", 13),
]


def run_child(path: str, failpoint: str | None) -> int:
    env = dict(os.environ)
    env.pop("MWPSTORE_FAILPOINT", None)
    if failpoint is not None:
        env["MWPSTORE_FAILPOINT"] = failpoint
    script = CHILD.format(root=ROOT, tests=TESTS, groups=GROUPS, path=path)
    completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    if completed.returncode not in (0, -9):
        raise AssertionError(completed.stderr.decode())
    return completed.returncode


def histories():
    return {group: workload(group, count, seed=len(group) + count) for group, count in GROUPS.items()}


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("clean") / "agent")
    agent = AgentStore.open(path, projections=[CountingProjection()])
    source = ListSource([event for history in histories().values() for event in history])
    for group in GROUPS:
        Delivery(agent, source).catch_up(group)
    digest = agent.projection_digest()
    agent.close()
    return digest


def check_invariants(agent: AgentStore) -> None:
    for group in GROUPS:
        head = agent.head(group)
        assert head.cursor <= head.applied_seq
        inbox = agent.inbox_seqs(group)
        assert inbox == list(range(1, head.applied_seq + 1)), "inbox holds exactly the contiguous applied Events"
        counts = seen_counts(agent, group)
        assert set(counts) == set(range(1, head.applied_seq + 1))
        assert set(counts.values()) <= {1}, "an Event reached a projection twice"
        assert all(seq > head.applied_seq + 1 for seq in agent.buffered_seqs(group))


@pytest.mark.parametrize("failpoint,nth", STEPS, ids=[name for name, _ in STEPS])
def test_kill_at_step_then_reopen_and_catch_up(tmp_path, clean_digest, failpoint, nth):
    path = str(tmp_path / "agent")
    assert run_child(path, f"{failpoint}:{nth}") == -9, "the fail point was never reached"
    agent = AgentStore.open(path, projections=[CountingProjection()])
    check_invariants(agent)
    intents_before = {intent.key for intent in agent.intents()}
    agent.close()
    # A second life, killed again later in its run, then a clean finish.
    assert run_child(path, f"{failpoint}:{nth + 5}") in (0, -9)
    assert run_child(path, None) == 0
    agent = AgentStore.open(path, projections=[CountingProjection()])
    check_invariants(agent)
    assert intents_before <= {intent.key for intent in agent.intents()}
    source = ListSource([event for history in histories().values() for event in history])
    for group in GROUPS:
        Delivery(agent, source).catch_up(group)
    check_invariants(agent)
    assert agent.projection_digest() == clean_digest
    agent.close()


def test_uninterrupted_child_matches_clean_delivery(tmp_path, clean_digest):
    path = str(tmp_path / "agent")
    assert run_child(path, None) == 0
    agent = AgentStore.open(path, projections=[CountingProjection()])
    check_invariants(agent)
    assert agent.projection_digest() == clean_digest
    agent.close()


# -- a restore from a snapshot, killed part-way ---------------------------------------------------

RESTORE_CHILD = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from types import SimpleNamespace
    from agent_store_support import CountingProjection, RestoringProjection, workload
    from mwpstore.agent_store import AgentStore
    from mwpstore.messages import Effect

    RestoringProjection.kill_in_restore = {kill_in_restore!r}
    events = workload("g-1", 60, seed=3)
    states = {{}}
    for event in events[:{seq}]:
        for effect in event.effects:
            states[effect.aggregate] = (effect.revision, effect.state)
    snapshot = SimpleNamespace(org="org-1", group="g-1", seq={seq}, head_hash=events[{seq} - 1].hash,
                               aggregates=[Effect(key, *value) for key, value in sorted(states.items())])
    agent = AgentStore.open({path!r}, projections=[RestoringProjection(), CountingProjection()])
    agent.restore_verified(snapshot, group="g-1")
    agent.close()
    """
)


def _restoring_store(path: str) -> AgentStore:
    return AgentStore.open(path, projections=[RestoringProjection(), CountingProjection()])


def _whole_state(agent: AgentStore) -> tuple:
    head = agent.head("g-1")
    return (head, agent.projection_dump(), agent.inbox_seqs("g-1"), agent.buffered_seqs("g-1"),
            agent.projection_items("g-1", "restoring"), agent.projection_items("g-1", "counter"), agent.intents())


@pytest.mark.parametrize("kill", ["agent.begin", "restore_hook", "agent.before_commit"])
def test_a_restore_killed_part_way_leaves_the_store_as_it_was(tmp_path, kill):
    """A restore replaces the Group's state, queue, inbox and projections and moves its head, all in
    one local commit: killed anywhere before that commit returns (its transaction begun, the Group
    cleared and the snapshot's aggregates written while a projection's restore hook runs, the heads
    written), the reopened store is the one before the restore, whole, never a half-restored Group
    that would pass for restored; run again to its end, it is restored."""
    path = str(tmp_path / "agent")
    events = workload("g-1", 60, seed=3)
    agent = _restoring_store(path)
    with agent.begin() as tx:
        for event in events[:10] + events[40:42]:  # applied up to 10, two buffered beyond the gap
            tx.apply(event)
        tx.advance_cursor("g-1")
        tx.record_intent("g-1", mission="m1", workitem="w1", ownership_epoch=1, operation="notify")
    before = _whole_state(agent)
    agent.close()
    env = dict(os.environ)
    env.pop("MWPSTORE_FAILPOINT", None)
    if kill != "restore_hook":
        env["MWPSTORE_FAILPOINT"] = kill
    for kill_in_hook, expected in ((kill == "restore_hook", -9), (False, 0)):
        if expected == 0:
            env.pop("MWPSTORE_FAILPOINT", None)
        script = RESTORE_CHILD.format(root=ROOT, tests=TESTS, path=path, seq=30, kill_in_restore=kill_in_hook)
        completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
        assert completed.returncode == expected, completed.stderr.decode()
        agent = _restoring_store(path)
        if expected == -9:
            assert _whole_state(agent) == before
        else:
            head = agent.head("g-1")
            assert (head.applied_seq, head.cursor, head.floor_seq, head.applied_hash) == (30, 30, 30, events[29].hash)
            assert agent.inbox_seqs("g-1") == [] and agent.buffered_seqs("g-1") == [41, 42]
            assert agent.projection_items("g-1", "restoring") == [(b"restored-at", b"30")]
            assert agent.projection_items("g-1", "counter") == [] and agent.intents() == before[-1]
        agent.close()
