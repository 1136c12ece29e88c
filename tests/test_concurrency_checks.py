"""The concurrency suite's own checks, each shown a store that misbehaves in one way.

A concurrency round (``mwpstore torture --suite concurrency``) checks what its threads see as
they go: reads in sequence order along an intact chain, subscribers in order, a ``verify`` that
finds nothing under load, one receipt for the same action from two threads, agents that catch up,
reader children that start and end well, subscribers that end with the close. A long run that
reports 0 violations means something only if each of those checks can fail: here each one is
handed a wrong answer, from one thread kind of one short round, and must report it.
"""

from __future__ import annotations

import threading
import types

import msgspec

from mwpstore import torture
from mwpstore.agent_store import AgentStore
from mwpstore.authority import Authority, Subscription
from mwpstore.delivery import Delivery

THREAD_KINDS = ("writer", "same_action", "reader", "acker", "snapshotter", "verifier", "compactor", "agent",
                *(f"subscriber-{group}" for group in torture.GROUPS))


def run_round(monkeypatch, keep: tuple[str, ...], seed: int) -> list[str]:
    """One round of one second with only the thread kinds in ``keep`` (and reader children only
    when a reader kind is kept); the violation messages."""
    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 1.0)
    skip = tuple(kind for kind in (*THREAD_KINDS, *torture.READER_KINDS) if kind not in keep)
    result = torture.run_concurrency(count=1, seed=seed, skip=skip)
    return result["details"]["violation_messages"]


def in_thread(kind: str) -> bool:
    """Is the calling thread one of the round's threads of this kind (named round-<seed>-<kind>-<i>)?"""
    return f"-{kind}-" in threading.current_thread().name


def test_a_read_that_skips_an_event_is_a_violation(monkeypatch):
    real = Authority.read

    def read(self, group, *arguments, **options):
        events = real(self, group, *arguments, **options)
        return events[1:] if in_thread("reader") and len(events) >= 2 else events

    monkeypatch.setattr(Authority, "read", read)
    messages = run_round(monkeypatch, ("writer", "reader"), seed=11)
    assert any("returned sequences" in message for message in messages), messages[:3]


def test_a_read_whose_chain_is_broken_is_a_violation(monkeypatch):
    real = Authority.read

    def read(self, group, *arguments, **options):
        events = real(self, group, *arguments, **options)
        if in_thread("reader") and len(events) >= 2:
            events = [events[0], msgspec.structs.replace(events[1], prev_hash=bytes(32)), *events[2:]]
        return events

    monkeypatch.setattr(Authority, "read", read)
    messages = run_round(monkeypatch, ("writer", "reader"), seed=12)
    assert any("returned a broken chain" in message for message in messages), messages[:3]
    assert not any("returned sequences" in message for message in messages)


def test_a_subscriber_that_misses_an_event_is_a_violation_at_once_and_at_the_end(monkeypatch):
    """Seq 2 of the first Group never reaches its subscriber: the poll that skips it is reported,
    and so is, after the reopen, the subscriber's history compared with the whole Group."""
    real, dropped = Subscription.poll, []

    def poll(self, timeout=None):
        events = real(self, timeout=timeout)
        if in_thread(f"subscriber-{torture.GROUPS[0]}") and not dropped and any(event.seq == 2 for event in events):
            dropped.append(2)
            events = [event for event in events if event.seq != 2]
        return events

    monkeypatch.setattr(Subscription, "poll", poll)
    messages = run_round(monkeypatch, ("writer", f"subscriber-{torture.GROUPS[0]}"), seed=13)
    assert dropped
    assert any(f"subscriber of {torture.GROUPS[0]} got seq 3 after 1" in message for message in messages), messages[:3]
    assert any(f"subscriber of {torture.GROUPS[0]} saw a gap or a repeat" in message for message in messages), messages[:3]


def test_a_verify_that_finds_a_problem_under_load_is_a_violation(monkeypatch):
    real = Authority.verify

    def verify(self, *arguments, **options):
        report = real(self, *arguments, **options)
        if in_thread("verifier"):
            return types.SimpleNamespace(ok=False, problems=["planted: an index entry differs"])
        return report

    monkeypatch.setattr(Authority, "verify", verify)
    messages = run_round(monkeypatch, ("writer", "verifier"), seed=14)
    assert any("verify() during load" in message and "planted" in message for message in messages), messages[:3]


def test_two_threads_given_different_receipts_for_the_same_action_is_a_violation(monkeypatch):
    real = Authority.accept

    def accept(self, command, *arguments, **options):
        receipt = real(self, command, *arguments, **options)
        if in_thread("same_action") and threading.current_thread().name.endswith("-1"):
            return msgspec.structs.replace(receipt, accepted_at_ms=receipt.accepted_at_ms + 1)
        return receipt

    monkeypatch.setattr(Authority, "accept", accept)
    messages = run_round(monkeypatch, ("same_action",), seed=15)
    assert any("from two threads got different receipts" in message for message in messages), messages[:3]


def test_an_agent_left_behind_the_heads_is_a_violation(monkeypatch):
    """No agent thread pulls during the round, and the final catch-up does nothing: the agents'
    Cursors stay below the heads the writers reached."""
    monkeypatch.setattr(Delivery, "catch_up", lambda self, group, **options: 0)
    messages = run_round(monkeypatch, ("writer",), seed=16)
    assert any("agent-0 did not catch up to the heads" in message for message in messages), messages[:3]
    assert any("agent-1 did not catch up to the heads" in message for message in messages), messages[:3]


def test_a_reader_child_that_does_not_start_is_a_violation(monkeypatch):
    monkeypatch.setattr(torture._ReaderChild, "wait_ready", lambda self: False)
    messages = run_round(monkeypatch, ("writer", "view-reader"), seed=17)
    assert any("reader-0 did not start" in message for message in messages), messages[:3]
    assert any("reader-1 did not start" in message for message in messages), messages[:3]


def test_a_reader_child_that_ends_badly_is_a_violation(monkeypatch):
    real = torture._ReaderChild.stop

    def stop(self):
        real(self)
        return None, "exited with 3: planted"

    monkeypatch.setattr(torture._ReaderChild, "stop", stop)
    messages = run_round(monkeypatch, ("writer", "view-reader"), seed=18)
    assert any("reader-0 exited with 3: planted" in message for message in messages), messages[:3]


def test_a_subscriber_that_the_close_does_not_stop_is_a_deadlock(monkeypatch):
    """Once the round is over a subscriber waits in poll() until the close stops it; one that
    still waits the watchdog's time after the close is reported, and the round does not hang."""
    release = threading.Event()
    real = Subscription.poll

    def poll(self, timeout=None):
        if timeout is None and in_thread(f"subscriber-{torture.GROUPS[0]}"):
            release.wait(60)  # deaf to the close
            return []
        return real(self, timeout=timeout)

    monkeypatch.setattr(torture, "CONCURRENCY_WATCHDOG_SECONDS", 1.0)
    monkeypatch.setattr(Subscription, "poll", poll)
    try:
        messages = run_round(monkeypatch, ("writer", f"subscriber-{torture.GROUPS[0]}"), seed=19)
    finally:
        release.set()
    assert any("a subscriber still waits in poll()" in message for message in messages), messages[:3]


def test_what_the_agent_check_finds_after_the_round_is_reported_with_the_agent(monkeypatch):
    """After the round each agent catches up and is checked against the authority
    (``check_agent``); what that finds is a violation of the round, named after the agent."""
    real = torture.check_agent

    def check_agent(agent, authority, *, consumer):
        assert isinstance(agent, AgentStore)
        return [*real(agent, authority, consumer=consumer), "planted agent finding"]

    monkeypatch.setattr(torture, "check_agent", check_agent)
    messages = run_round(monkeypatch, ("writer", "agent"), seed=20)
    assert any("agent-0: planted agent finding" in message for message in messages), messages[:3]
    assert any("agent-1: planted agent finding" in message for message in messages), messages[:3]
