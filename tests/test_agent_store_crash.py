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

from agent_store_support import CountingProjection, seen_counts, workload
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
