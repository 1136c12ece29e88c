"""The outbox (MWP-WRK-031): the intent is durable before dispatch, carries the stable
idempotency key, the receipt is recorded, an uncertain outcome is reconciled before any retry."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from agent_store_support import interrupt_once_at
from blocking import Caller

from mwpstore.agent_store import AgentStore, IntentState, ReconcileRequired
from mwpstore.errors import InvalidCommand, InvalidState
from mwpstore.work_keys import external_idempotency_key

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GROUP = "g-1"


class ExternalService:
    """A fake receiver that dedupes by idempotency key, like a well-behaved external API."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.done: dict[str, dict] = {}
        self.fail_next = False

    def call(self, intent):
        self.calls.append(intent.key)
        if self.fail_next:
            self.fail_next = False
            self.done[intent.key] = {"ok": True, "ref": f"r-{len(self.done)}"}  # it happened, the answer got lost
            raise TimeoutError("no answer")
        receipt = self.done.setdefault(intent.key, {"ok": True, "ref": f"r-{len(self.done)}"})
        return receipt

    def lookup(self, intent):
        return self.done.get(intent.key)


def record(agent, operation="notify", epoch=3):
    with agent.begin() as tx:
        return tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=epoch, operation=operation,
                                request={"to": "ops"})


def test_intent_carries_the_stable_idempotency_key(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    assert intent.key == external_idempotency_key("m1", "wi-1", 3, "notify")
    assert intent.state is IntentState.INTENDED
    again = record(agent)
    assert again.key == intent.key and len(agent.intents()) == 1
    assert record(agent, epoch=4).key != intent.key  # a new owner's attempt is a new operation
    agent.close()


def test_recording_an_intent_again_keeps_its_state_and_receipt(tmp_path):
    """A retry that records the same operation again gets the existing intent back: never a fresh
    INTENDED one that would forget a dispatch (and let it be dispatched again without reconcile)."""
    agent = AgentStore.open(tmp_path / "a")
    service = ExternalService()
    intent = record(agent)
    receipt = agent.dispatch(intent.key, service.call)
    again = record(agent)
    assert again.state is IntentState.DONE and again.receipt == receipt
    assert agent.intent(intent.key).state is IntentState.DONE and agent.intent(intent.key).receipt == receipt
    assert agent.dispatch(intent.key, service.call) == receipt and service.calls == [intent.key]
    other = record(agent, operation="page")
    agent.mark_dispatched(other.key)  # handed out; the process died before the answer
    assert record(agent, operation="page").state is IntentState.DISPATCHED
    with pytest.raises(ReconcileRequired):
        agent.dispatch(other.key, service.call)
    assert service.calls == [intent.key]
    agent.close()


@pytest.mark.parametrize("reading", [1_700_000_000_000.5, True, -5, 2**64])
def test_a_bad_clock_reading_stores_nothing(tmp_path, reading):
    clock = [reading]
    agent = AgentStore.open(tmp_path / "a", clock=lambda: clock[0])
    with pytest.raises(InvalidCommand) as caught:
        record(agent)
    assert caught.value.detail["field"] == "clock" and agent.intents() == []
    clock[0] = 1_700_000_000_000
    intent = record(agent)
    clock[0] = reading
    with pytest.raises(InvalidCommand):
        agent.mark_dispatched(intent.key)
    assert agent.intent(intent.key).state is IntentState.INTENDED  # unchanged
    with pytest.raises(InvalidCommand):
        agent.mark_uncertain(intent.key, 404)
    agent.close()
    with pytest.raises(InvalidCommand):
        AgentStore.open(tmp_path / "b", clock=1_700_000_000_000)


def test_only_a_dispatched_intent_can_be_marked_uncertain(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    with pytest.raises(InvalidState):  # never handed to the outside world: nothing is uncertain
        agent.mark_uncertain(intent.key, "timeout")
    agent.mark_dispatched(intent.key)
    assert agent.mark_uncertain(intent.key, "timeout").state is IntentState.UNCERTAIN
    assert agent.mark_uncertain(intent.key, "x" * 5000).error == "x" * 1000  # the first 1,000 characters kept
    agent.record_receipt(intent.key, {"id": 7})
    done = agent.mark_uncertain(intent.key, "late timeout")  # a recorded receipt stays recorded
    assert done.state is IntentState.DONE and done.receipt == {"id": 7}
    assert agent.intent(intent.key).state is IntentState.DONE
    agent.close()


def test_intent_is_only_durable_with_its_local_commit(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    with pytest.raises(RuntimeError):
        with agent.begin() as tx:
            tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="x")
            raise RuntimeError("abort")
    assert agent.intents() == []
    agent.close()


def test_dispatch_records_the_receipt_and_never_calls_twice(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    service = ExternalService()
    intent = record(agent)
    receipt = agent.dispatch(intent.key, service.call)
    assert agent.intent(intent.key).state is IntentState.DONE
    assert agent.intent(intent.key).receipt == receipt
    assert agent.dispatch(intent.key, service.call) == receipt
    assert service.calls == [intent.key]
    assert agent.intents(pending_only=True) == []
    agent.close()


@pytest.mark.parametrize("meanwhile", ["receipt recorded", "reconciled and dispatched again"])
def test_a_lookup_that_answers_late_does_not_undo_what_happened_meanwhile(tmp_path, meanwhile):
    """Two recoveries of one UNCERTAIN intent: the second's "not found" was asked before the first
    settled it, and must neither erase the first's receipt nor let the side effect run again."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    agent.mark_dispatched(intent.key)
    agent.mark_uncertain(intent.key, "timeout")
    calls = []

    def slow_lookup(_intent):
        # while this lookup is in flight, another thread settles the intent
        if meanwhile == "receipt recorded":
            agent.record_receipt(intent.key, {"ref": "first"})
        else:
            agent.reconcile(intent.key, lambda _: None)
            agent.mark_dispatched(intent.key)
        return None  # the answer this lookup got before that

    if meanwhile == "receipt recorded":
        assert agent.dispatch(intent.key, lambda i: calls.append(i) or {"ref": "second"}, lookup=slow_lookup) == {"ref": "first"}
        assert agent.intent(intent.key).receipt == {"ref": "first"}
    else:
        with pytest.raises(ReconcileRequired):  # the other recovery's dispatch is in flight
            agent.dispatch(intent.key, lambda i: calls.append(i) or {"ref": "second"}, lookup=slow_lookup)
        assert agent.intent(intent.key).state is IntentState.DISPATCHED
    assert calls == []  # this caller never called the side effect
    agent.close()


def test_record_receipt_is_its_own_call_and_a_second_receipt_never_replaces_the_first(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    agent.mark_dispatched(intent.key)
    done = agent.record_receipt(intent.key, {"ref": "ext-1"})
    assert done.state is IntentState.DONE and done.receipt == {"ref": "ext-1"}
    again = agent.record_receipt(intent.key, {"ref": "second"})
    assert again == done and agent.intent(intent.key).receipt == {"ref": "ext-1"}
    with pytest.raises(InvalidCommand):
        agent.record_receipt("no-such-key", {"ref": "x"})
    agent.close()


def test_uncertain_outcome_must_be_reconciled_before_retry(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    service = ExternalService()
    intent = record(agent)
    service.fail_next = True
    with pytest.raises(TimeoutError):
        agent.dispatch(intent.key, service.call)
    assert agent.intent(intent.key).state is IntentState.UNCERTAIN
    with pytest.raises(ReconcileRequired):
        agent.dispatch(intent.key, service.call)
    assert service.calls == [intent.key]
    receipt = agent.dispatch(intent.key, service.call, lookup=service.lookup)
    assert service.calls == [intent.key], "the lookup found it: no second call"
    assert receipt == service.done[intent.key]
    assert agent.intent(intent.key).state is IntentState.DONE
    agent.close()


@pytest.mark.parametrize("not_callable", [None, {"ok": True}, "send"], ids=["None", "dict", "str"])
def test_a_side_effect_or_lookup_that_is_no_callable_is_refused_before_anything_is_written(tmp_path, not_callable):
    """``dispatch`` called a ``side_effect`` that is no callable only after the commit that marks
    the intent DISPATCHED: the TypeError then marked it UNCERTAIN, to be reconciled, for a call
    that never went out. ``reconcile`` and a ``dispatch`` that reconciles let the TypeError of a
    ``lookup`` out. Each is now ``InvalidCommand`` naming the argument, the intent unchanged."""
    agent = AgentStore.open(tmp_path / "a")
    service = ExternalService()
    intended = record(agent, operation="intended")
    uncertain = record(agent, operation="uncertain")
    agent.mark_dispatched(uncertain.key)
    uncertain = agent.mark_uncertain(uncertain.key, "timeout")
    calls = [
        ("side_effect", lambda: agent.dispatch(intended.key, not_callable)),
        ("lookup", lambda: agent.dispatch(intended.key, service.call, lookup=not_callable)),
        ("lookup", lambda: agent.dispatch(uncertain.key, service.call, lookup=not_callable)),
        ("lookup", lambda: agent.reconcile(uncertain.key, not_callable)),
    ]
    if not_callable is None:
        calls.pop(1)  # no lookup: dispatch's default
        calls.pop(1)
    for field, call in calls:
        with pytest.raises(InvalidCommand) as caught:
            call()
        assert caught.value.field == field
    assert agent.intent(intended.key) == intended and agent.intent(uncertain.key) == uncertain
    assert service.calls == []
    assert agent.dispatch(intended.key, service.call) == service.done[intended.key]  # dispatched once, now
    agent.close()


def test_a_request_or_receipt_changed_during_the_call_is_stored_as_it_was_checked(tmp_path):
    """``record_intent`` and ``record_receipt`` checked the caller's dict, read the clock, then
    encoded the dict: changed meanwhile (by another thread, here by the clock), content the check
    never saw was stored (a set, as a list), and a value msgpack cannot encode was a bare
    TypeError. Each now stores a copy of what it checked, and returns that copy."""
    pending: list[dict] = []

    def clock() -> int:
        for value in pending:
            value["later"] = {1, 2}  # not content: a set
            value["to"] = "someone else"
        pending.clear()
        return 1_000

    agent = AgentStore.open(tmp_path / "a", clock=clock)
    request = {"to": "ops", "items": [1, 2]}
    with agent.begin() as tx:
        pending.append(request)
        intent = tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=3, operation="notify",
                                  request=request)
    assert intent.request == {"to": "ops", "items": [1, 2]} == agent.intent(intent.key).request
    agent.mark_dispatched(intent.key)
    receipt = {"ref": "r-1"}
    pending.append(receipt)
    done = agent.record_receipt(intent.key, receipt)
    assert done.receipt == {"ref": "r-1"} == agent.intent(intent.key).receipt
    assert receipt["later"] == {1, 2}  # the clock did change the caller's dict
    agent.close()


def test_reconcile_asks_nothing_about_an_intent_whose_outcome_is_known(tmp_path):
    """``reconcile`` settles only an unknown outcome: an INTENDED (never dispatched), RECONCILED or
    DONE intent is returned as it is, without calling ``lookup``."""
    agent = AgentStore.open(tmp_path / "a")
    asked = []

    def lookup(intent):
        asked.append(intent.key)
        return {"ref": "seen outside"}

    intended = record(agent, operation="intended")
    assert agent.reconcile(intended.key, lookup) == intended
    reconciled = record(agent, operation="reconciled")
    agent.mark_dispatched(reconciled.key)
    agent.mark_uncertain(reconciled.key, "timeout")
    reconciled = agent.reconcile(reconciled.key, lambda _: None)
    assert reconciled.state is IntentState.RECONCILED
    assert agent.reconcile(reconciled.key, lookup) == reconciled
    done = record(agent, operation="done")
    agent.mark_dispatched(done.key)
    done = agent.record_receipt(done.key, {"ref": "first"})
    assert agent.reconcile(done.key, lookup) == done
    assert asked == []
    assert [agent.intent(key).state for key in (intended.key, reconciled.key, done.key)] == [
        IntentState.INTENDED, IntentState.RECONCILED, IntentState.DONE]
    agent.close()


def test_pending_intents_are_every_one_without_a_receipt(tmp_path):
    """``intents(pending_only=True)`` is what is left to do after a restart: INTENDED, DISPATCHED,
    UNCERTAIN and RECONCILED (not happened: to be dispatched again) intents; only DONE is left out."""
    agent = AgentStore.open(tmp_path / "a")
    keys = {state: record(agent, operation=state.value).key for state in IntentState}
    for state in (IntentState.DISPATCHED, IntentState.UNCERTAIN, IntentState.RECONCILED, IntentState.DONE):
        agent.mark_dispatched(keys[state])
    for state in (IntentState.UNCERTAIN, IntentState.RECONCILED):
        agent.mark_uncertain(keys[state], "timeout")
    agent.reconcile(keys[IntentState.RECONCILED], lambda _: None)
    agent.record_receipt(keys[IntentState.DONE], {"ref": "r"})
    assert {intent.key: intent.state for intent in agent.intents()} == {key: state for state, key in keys.items()}
    pending = {intent.state for intent in agent.intents(GROUP, pending_only=True)}
    assert pending == {IntentState.INTENDED, IntentState.DISPATCHED, IntentState.UNCERTAIN, IntentState.RECONCILED}
    agent.close()


def test_reconciled_as_not_done_is_retried_with_the_same_key(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    service = ExternalService()
    intent = record(agent)

    def refuse(intent):
        service.calls.append(intent.key)
        raise ConnectionError("refused before anything happened")

    with pytest.raises(ConnectionError):
        agent.dispatch(intent.key, refuse)
    assert agent.reconcile(intent.key, service.lookup).state is IntentState.RECONCILED
    agent.dispatch(intent.key, service.call)
    assert service.calls == [intent.key, intent.key]
    assert agent.intent(intent.key).dispatches == 2
    assert agent.intent(intent.key).key == intent.key
    agent.close()


def test_the_same_key_in_another_group_is_refused_not_returned(tmp_path):
    """The idempotency key names one operation of one Group's WorkItem: recording it under
    another Group is a caller error, never that Group's intent handed back."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    with pytest.raises(InvalidCommand) as caught:
        with agent.begin() as tx:
            tx.record_intent("g-2", mission="m1", workitem="wi-1", ownership_epoch=3, operation="notify")
    assert caught.value.detail["field"] == "group"
    assert agent.intents("g-2") == [] and agent.intents(GROUP) == [intent]
    agent.close()


@pytest.mark.parametrize("state", ["dispatched", "uncertain", "done"])
def test_only_an_intended_or_reconciled_intent_can_be_marked_dispatched(tmp_path, state):
    """mark_dispatched is the gate before every external call: an intent whose last dispatch has
    an unknown outcome (or a recorded receipt) cannot pass it again without reconcile."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    agent.mark_dispatched(intent.key)
    if state == "uncertain":
        agent.mark_uncertain(intent.key, "timeout")
    elif state == "done":
        agent.record_receipt(intent.key, {"ref": "r-1"})
    before = agent.intent(intent.key)
    with pytest.raises(ReconcileRequired) as caught:
        agent.mark_dispatched(intent.key)
    assert agent.intent(intent.key) == before and before.dispatches == 1
    # a done intent needs no reconciling: the message says not to dispatch it again
    assert ("do not dispatch it again" in caught.value.message) == (state == "done")
    assert ("reconcile it" in caught.value.message) == (state != "done")
    agent.close()


def test_the_side_effect_runs_only_once_its_dispatch_is_committed(tmp_path):
    """``dispatch`` commits DISPATCHED (synced) before it calls the side effect, and records the
    receipt after it returns: while the call runs, what a restart would find is DISPATCHED (so it
    is reconciled, never dispatched blindly a second time), with its dispatch counted. The same
    holds for a dispatch again after a reconcile."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    found = []

    def side_effect(_intent):
        stored = agent.intent(intent.key)  # a read sees only what is committed
        found.append((stored.state, stored.dispatches, stored.receipt))
        if len(found) == 1:
            raise TimeoutError("no answer")
        return {"ref": "r-1"}

    with pytest.raises(TimeoutError):
        agent.dispatch(intent.key, side_effect)
    assert agent.dispatch(intent.key, side_effect, lookup=lambda _: None) == {"ref": "r-1"}
    assert found == [(IntentState.DISPATCHED, 1, None), (IntentState.DISPATCHED, 2, None)]
    assert agent.intent(intent.key).state is IntentState.DONE and agent.intent(intent.key).receipt == {"ref": "r-1"}
    agent.close()


def test_an_interrupt_during_the_side_effect_leaves_the_intent_uncertain(tmp_path):
    """Whatever ends the external call early (an exception or an interrupt) makes its outcome
    unknown: the intent is UNCERTAIN, with the reason, and the interrupt goes on."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)

    def interrupted(_intent):
        raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        agent.dispatch(intent.key, interrupted)
    stored = agent.intent(intent.key)
    assert stored.state is IntentState.UNCERTAIN and stored.error == "KeyboardInterrupt: stop"
    agent.close()


CHILD = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}]
    from mwpstore.agent_store import AgentStore
    agent = AgentStore.open({path!r})
    with agent.begin() as tx:
        intent = tx.record_intent("g-1", mission="m1", workitem="wi-1", ownership_epoch=2, operation="pay")
    calls = open({calls!r}, "a")
    def side_effect(intent):
        calls.write(intent.key + "\\n")
        calls.flush()
        return {{"paid": True}}
    agent.dispatch(intent.key, side_effect)
    """
)


def run_child(tmp_path, failpoint):
    env = dict(os.environ, MWPSTORE_FAILPOINT=failpoint)
    script = CHILD.format(root=ROOT, path=str(tmp_path / "a"), calls=str(tmp_path / "calls"))
    completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert completed.returncode == -9, completed.stderr.decode()


def test_crash_between_intent_and_dispatch_dispatches_once_after_restart(tmp_path):
    run_child(tmp_path, "agent.after_intent")  # killed inside the transaction: nothing durable
    agent = AgentStore.open(tmp_path / "a")
    assert agent.intents() == []
    agent.close()
    run_child(tmp_path, "agent.after_commit")  # killed right after the intent's commit, before dispatch
    assert not (tmp_path / "calls").exists()
    agent = AgentStore.open(tmp_path / "a")
    [intent] = agent.intents(pending_only=True)
    assert intent.state is IntentState.INTENDED
    service = ExternalService()
    agent.dispatch(intent.key, service.call)
    assert service.calls == [external_idempotency_key("m1", "wi-1", 2, "pay")]
    agent.close()


def test_crash_after_marking_dispatched_requires_reconcile(tmp_path):
    run_child(tmp_path, "agent.after_mark_dispatched")
    assert (tmp_path / "calls").read_text() == "", "the side effect ran before its intent was marked dispatched"
    agent = AgentStore.open(tmp_path / "a")
    [intent] = agent.intents(pending_only=True)
    assert intent.state is IntentState.DISPATCHED
    service = ExternalService()
    with pytest.raises(ReconcileRequired):
        agent.dispatch(intent.key, service.call)
    agent.dispatch(intent.key, service.call, lookup=service.lookup)  # lookup: not done -> one dispatch
    assert service.calls == [intent.key]
    agent.close()


def test_crash_after_the_external_call_finds_the_receipt_by_lookup(tmp_path):
    run_child(tmp_path, "agent.after_dispatch")
    calls = (tmp_path / "calls").read_text().split()
    agent = AgentStore.open(tmp_path / "a")
    [intent] = agent.intents(pending_only=True)
    assert calls == [intent.key]
    service = ExternalService()
    service.done[intent.key] = {"paid": True}
    assert agent.dispatch(intent.key, service.call, lookup=service.lookup) == {"paid": True}
    assert service.calls == []
    agent.close()


def test_crash_after_the_receipt_is_recorded_returns_it_without_calling_again(tmp_path):
    run_child(tmp_path, "agent.after_receipt")  # killed once the receipt's commit returned
    calls = (tmp_path / "calls").read_text().split()
    agent = AgentStore.open(tmp_path / "a")
    assert agent.intents(pending_only=True) == []
    [intent] = agent.intents()
    assert calls == [intent.key] and intent.state is IntentState.DONE and intent.receipt == {"paid": True}
    service = ExternalService()
    assert agent.dispatch(intent.key, service.call, lookup=service.lookup) == {"paid": True}
    assert service.calls == []
    agent.close()


def test_dispatch_returns_the_receipt_recorded_when_a_reconcile_recorded_one_during_the_call(tmp_path):
    """A reconcile that finds the receipt while the side effect runs (another thread's, here the
    side effect's own) records it first; dispatch's own record_receipt then keeps it, but dispatch
    returned what its side effect returned, and every later call answers the recorded one."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)

    def side_effect(dispatched):
        agent.record_receipt(dispatched.key, {"ref": "found by a lookup"})
        return {"ref": "returned by the call"}

    assert agent.dispatch(intent.key, side_effect) == {"ref": "found by a lookup"}
    assert agent.intent(intent.key).receipt == {"ref": "found by a lookup"}
    assert agent.dispatch(intent.key, side_effect) == {"ref": "found by a lookup"}  # DONE: not called again
    agent.close()


@pytest.mark.parametrize("how", ["dispatch with a lookup", "marked uncertain, then reconciled"])
def test_an_intent_whose_side_effect_runs_in_another_thread_is_not_reconciled_as_not_done(tmp_path, how):
    """A DISPATCHED intent is one to reconcile after a restart, not while its side effect still
    runs in another thread of this process: a lookup made meanwhile finds nothing (the call has
    not arrived yet), and "not found" would make it RECONCILED and let it run a second time. While
    this handle's dispatch runs it, the intent stays as it is and the second caller is told to
    reconcile (``RECONCILE_REQUIRED``) or gets it back unchanged."""
    import threading

    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    calls: list[str] = []
    running, finish = threading.Event(), threading.Event()

    def slow_call(dispatched):
        calls.append(dispatched.key)
        running.set()
        assert finish.wait(30)
        return {"ref": "first"}

    first = Caller(lambda: agent.dispatch(intent.key, slow_call))
    try:
        assert running.wait(30)
        if how == "dispatch with a lookup":
            with pytest.raises(ReconcileRequired) as caught:
                agent.dispatch(intent.key, lambda i: calls.append(i.key) or {"ref": "second"}, lookup=lambda i: None)
            assert caught.value.detail["state"] == "dispatched"
        else:  # code outside dispatch thought the call was its own and lost
            agent.mark_uncertain(intent.key, "timeout")
            assert agent.reconcile(intent.key, lambda i: None).state is IntentState.UNCERTAIN
            with pytest.raises(ReconcileRequired):
                agent.mark_dispatched(intent.key)
    finally:
        finish.set()
    assert first.outcome() == {"ref": "first"}
    assert calls == [intent.key]  # the side effect ran once
    done = agent.intent(intent.key)
    assert done.state is IntentState.DONE and done.receipt == {"ref": "first"} and done.dispatches == 1
    agent.close()


@pytest.mark.parametrize("outcome", ["returned", "raised"])
def test_an_intent_is_running_until_its_dispatch_has_committed_the_outcome(tmp_path, monkeypatch, outcome):
    """After the side effect returns (or raises) and before its receipt (or UNCERTAIN) is
    committed, the intent is still DISPATCHED and still this handle's running dispatch: another
    thread's dispatch whose lookup finds nothing yet must be told to reconcile, not make the
    intent RECONCILED and run the side effect a second time."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    calls: list[str] = []
    hooked = "record_receipt" if outcome == "returned" else "mark_uncertain"
    real = getattr(agent, hooked)
    second: list[object] = []

    def first_call(dispatched):
        calls.append("first")
        if outcome == "raised":
            raise RuntimeError("connection reset")
        return {"ref": "first"}

    def outcome_committed_after_another_thread_tried(*args):
        second.append(Caller(lambda: agent.dispatch(intent.key, lambda i: calls.append("second") or {"ref": "second"}, lookup=lambda i: None)).outcome())
        return real(*args)

    monkeypatch.setattr(agent, hooked, outcome_committed_after_another_thread_tried)
    if outcome == "returned":
        assert agent.dispatch(intent.key, first_call) == {"ref": "first"}
    else:
        with pytest.raises(RuntimeError):
            agent.dispatch(intent.key, first_call)
    assert isinstance(second[0], ReconcileRequired) and second[0].detail["state"] == "dispatched"
    assert calls == ["first"]
    expected = IntentState.DONE if outcome == "returned" else IntentState.UNCERTAIN
    assert agent.intent(intent.key).state is expected
    agent.close()


def test_an_interrupt_as_the_intent_joins_the_running_set_leaves_it_out(tmp_path):
    """KeyboardInterrupt as the intent is added to the handle's set of running dispatches (the
    commit marking it DISPATCHED is then aborted): the side effect never ran, and the intent must
    not stay in that set, where every later reconcile would leave it as it is."""

    class InterruptedOnAdd(set):
        def add(self, key):  # type: ignore[no-untyped-def]
            super().add(key)
            raise KeyboardInterrupt  # as add() returns

    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    calls: list[str] = []
    agent._dispatching = InterruptedOnAdd()
    with pytest.raises(KeyboardInterrupt):
        agent.dispatch(intent.key, lambda i: calls.append(i.key) or {"ref": "r-1"})
    assert calls == []
    agent.mark_dispatched(intent.key)  # as a dispatch of another handle or process would
    agent.mark_uncertain(intent.key, "timeout")
    assert agent.reconcile(intent.key, lambda _: None).state is IntentState.RECONCILED
    agent.close()


def test_two_dispatches_of_one_intended_intent_at_once_run_its_side_effect_once(tmp_path, monkeypatch):
    """Both read the intent INTENDED; the first marks it DISPATCHED and runs its side effect. The
    second decides again in the commit that would mark it, finds it DISPATCHED, and raises
    ``RECONCILE_REQUIRED``: marking it from what it read before would run the side effect twice."""
    import threading

    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    calls: list[str] = []
    second_read, first_running, second_done = threading.Event(), threading.Event(), threading.Event()
    real_begin = AgentStore.begin

    def begin_after_the_first_dispatch_runs(self):
        if threading.current_thread().name == "second dispatch" and not second_read.is_set():
            second_read.set()  # the second dispatch read INTENDED and is about to mark it
            assert first_running.wait(30)
        return real_begin(self)

    def first_call(dispatched):
        calls.append(dispatched.key)
        first_running.set()
        assert second_done.wait(30)
        return {"ref": "first"}

    def second_dispatch():
        try:
            return agent.dispatch(intent.key, lambda i: calls.append(i.key) or {"ref": "second"})
        finally:
            second_done.set()

    monkeypatch.setattr(AgentStore, "begin", begin_after_the_first_dispatch_runs)
    second = Caller(second_dispatch, name="second dispatch")
    try:
        assert second_read.wait(30)
        assert agent.dispatch(intent.key, first_call) == {"ref": "first"}
    finally:
        first_running.set()
    assert isinstance(second.outcome(), ReconcileRequired), second.outcome()
    assert calls == [intent.key]
    assert agent.intent(intent.key).dispatches == 1
    agent.close()


def test_an_interrupt_once_dispatched_is_committed_leaves_the_intent_to_reconcile(tmp_path, monkeypatch):
    """KeyboardInterrupt after the commit that marks the intent DISPATCHED, before the side
    effect runs: the side effect never ran, the intent is DISPATCHED as a kill there leaves it,
    and this handle reconciles it like any other: a lookup that finds nothing makes it
    RECONCILED, and a dispatch then runs the side effect. The handle must not go on taking the
    intent for one whose side effect it is running."""
    agent = AgentStore.open(tmp_path / "a")
    intent = record(agent)
    calls: list[str] = []
    interrupt_once_at(monkeypatch, "agent.after_commit")
    with pytest.raises(KeyboardInterrupt):
        agent.dispatch(intent.key, lambda i: calls.append(i.key) or {"ref": "r-1"})
    assert calls == []
    assert agent.intent(intent.key).state is IntentState.DISPATCHED
    assert agent._dispatching == set()
    assert agent.reconcile(intent.key, lambda _: None).state is IntentState.RECONCILED
    assert agent.dispatch(intent.key, lambda i: calls.append(i.key) or {"ref": "r-1"}) == {"ref": "r-1"}
    assert calls == [intent.key]
    agent.close()
