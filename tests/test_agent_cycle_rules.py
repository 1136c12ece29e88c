"""AgentStore apply-cycle rules pinned one by one: what a finished or failed local transaction
refuses, one transaction at a time (begin, abort, a failed begin or commit), the Group arguments
of the Cursor calls, apply_many's arguments and its bounded write cache, and the outbox's state
transitions."""

from __future__ import annotations

import threading

import lmdb
import msgspec
import pytest

from agent_store_support import workload
from mwpstore import agent_store
from mwpstore.agent_store import AgentStore, ApplyStatus, ProjectionFailed, ReconcileRequired
from mwpstore.errors import EventInvalid, InvalidCommand, InvalidState, LimitExceeded, StorageFailed, StoreClosed
from mwpstore.messages import Effect, encode_event

GROUP = "g-1"
BAD_GROUPS = ["", "bad group", "-lead", "g\x00x", 5, None]


class FailingProjection:
    name = "failing"

    def __init__(self, fail_seq):
        self.fail_seq = fail_seq

    def apply(self, view, event):
        view.put(f"e{event.seq}", b"x")
        if event.seq == self.fail_seq:
            raise RuntimeError("application projection failed")


@pytest.fixture
def events():
    return workload(GROUP, 30, seed=5)


@pytest.fixture
def agent(tmp_path):
    store = AgentStore.open(tmp_path / "agent")
    yield store
    store.close()


# -- a finished or failed local transaction -----------------------------------------------------


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_a_finished_transaction_refuses_apply_and_commit_with_store_closed(agent, events, end):
    """After commit or abort the transaction is finished: apply, apply_many and commit are
    ``StoreClosed`` (not an error of LMDB's finished transaction), and nothing more is written."""
    tx = agent.begin()
    tx.apply(events[0])
    getattr(tx, end)()
    for call in (lambda: tx.apply(events[1]), lambda: tx.apply_many(events[1:3]), tx.commit):
        with pytest.raises(StoreClosed):
            call()
    assert agent.head(GROUP).applied_seq == (1 if end == "commit" else 0)
    with agent.begin() as again:  # the store is free for the next transaction
        assert again.apply(events[1]) is (ApplyStatus.APPLIED if end == "commit" else ApplyStatus.BUFFERED)


def _reads(tx, group):
    return {
        "cursor": lambda: tx.cursor(group),
        "applied_seq": lambda: tx.applied_seq(group),
        "state": lambda: tx.state(group, f"group:{group}"),
        "revision": lambda: tx.revision(group, f"group:{group}"),
    }


def test_reads_of_a_finished_or_failed_transaction_are_refused_with_typed_errors(tmp_path, events):
    """``tx.cursor``, ``tx.applied_seq``, ``tx.state`` and ``tx.revision`` of a finished transaction
    are ``StoreClosed`` (they gave LMDB's own error for a Group the transaction had not read yet,
    and a stale answer for one it had); of a failed one ``ProjectionFailed``."""
    store = AgentStore.open(tmp_path / "a", projections=[FailingProjection(fail_seq=2)])
    for end in ("commit", "abort"):
        tx = store.begin()
        tx.apply(events[0])  # GROUP's head is read into the transaction; "g-2" is not
        getattr(tx, end)()
        for group in (GROUP, "g-2"):
            for name, read in _reads(tx, group).items():
                with pytest.raises(StoreClosed):
                    read()
    with pytest.raises(ProjectionFailed):
        with store.begin() as tx:
            with pytest.raises(RuntimeError):
                tx.apply(events[1])
            for name, read in _reads(tx, GROUP).items():
                with pytest.raises(ProjectionFailed):
                    read()
    assert store.head(GROUP).applied_seq == 1
    store.close()

def test_an_explicit_commit_of_a_failed_transaction_is_refused_and_writes_nothing(tmp_path, events):
    """A transaction in which an application projection failed can only abort: ``commit()``
    called by the block itself raises ``ProjectionFailed`` and commits none of the Events applied
    before the failure, nor the failed projection's partial writes."""
    store = AgentStore.open(tmp_path / "a", projections=[FailingProjection(fail_seq=2)])
    with pytest.raises(ProjectionFailed):
        with store.begin() as tx:
            tx.apply(events[0])
            with pytest.raises(RuntimeError):
                tx.apply(events[1])
            with pytest.raises(ProjectionFailed):
                tx.commit()
    assert store.head(GROUP).applied_seq == 0
    assert store.states(GROUP) == {}
    assert store.projection_items(GROUP, "failing") == []
    with store.begin() as tx:  # aborted: the store takes the next transaction
        assert tx.apply(events[0]) is ApplyStatus.APPLIED
    store.close()


def test_the_projection_failed_raised_at_the_end_of_the_block_names_the_failure(tmp_path, events):
    """A failure the block caught is raised at its end as ``ProjectionFailed`` whose reason is the
    failure's class name, chained to the failure itself."""
    store = AgentStore.open(tmp_path / "a", projections=[FailingProjection(fail_seq=1)])
    with pytest.raises(ProjectionFailed) as caught:
        with store.begin() as tx:
            try:
                tx.apply(events[0])
            except RuntimeError:
                pass
    assert caught.value.detail["reason"] == "RuntimeError"
    assert isinstance(caught.value.__cause__, RuntimeError)
    store.close()


def test_abort_is_idempotent_and_a_no_op_after_commit(agent, events):
    """``abort()`` ends the transaction once: called again, or after ``commit()``, it does nothing
    (the store's writer slot is not released twice, a commit is not undone)."""
    tx = agent.begin()
    tx.apply(events[0])
    tx.abort()
    tx.abort()
    tx = agent.begin()
    tx.apply(events[0])
    tx.commit()
    tx.abort()
    assert agent.head(GROUP).applied_seq == 1
    with agent.begin() as tx:
        assert tx.apply(events[1]) is ApplyStatus.APPLIED
    assert agent.head(GROUP).applied_seq == 2


def test_a_commit_that_fails_is_a_typed_error_and_releases_the_store(tmp_path, events):
    """A commit LMDB refuses (its map is full) raises ``LimitExceeded`` (field ``map_size``), not
    LMDB's own error; the transaction is aborted and the store takes the next one."""
    store = AgentStore.open(tmp_path / "a", map_size=256 * 1024, verify="trusted")
    history = workload(GROUP, 2000, seed=2, workitems=1000)
    with pytest.raises(LimitExceeded) as caught:
        with store.begin() as tx:
            for event in history:
                tx.apply(event)  # written at commit: the write-back cache holds it until then
    assert caught.value.detail["field"] == "map_size"
    assert store.head(GROUP).applied_seq == 0
    with store.begin() as tx:
        assert tx.apply(history[0]) is ApplyStatus.APPLIED
    store.close()


# -- one local transaction at a time -----------------------------------------------------------


def test_a_begin_that_lmdb_refuses_leaves_the_store_free_for_the_next_one(agent, events, monkeypatch):
    """A local transaction that cannot begin (LMDB fails) is ``StorageFailed``, and the thread is
    not left marked as holding a transaction: its next ``begin()`` works."""
    real = agent._tables.begin

    def failing(**kwargs):
        raise lmdb.Error("simulated")

    monkeypatch.setattr(agent._tables, "begin", failing)
    with pytest.raises(StorageFailed):
        agent.begin()
    monkeypatch.setattr(agent._tables, "begin", real)
    with agent.begin() as tx:
        assert tx.apply(events[0]) is ApplyStatus.APPLIED


class _WatchedLock:
    """A lock that reports when a thread starts waiting for it (the store's writer lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = threading.Event()

    def acquire(self, *args):
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            return self._lock.acquire(*args)
        return True

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_begin_that_waited_while_the_store_was_closed_is_store_closed(tmp_path, events):
    """A ``begin()`` that waits for another thread's transaction while ``close()`` is called gets
    ``StoreClosed`` once it may go on; it never gets a transaction of a closing store."""
    store = AgentStore.open(tmp_path / "a")
    lock = store._write_lock = _WatchedLock()
    holder = store.begin()
    results: list[object] = []

    def waiter() -> None:
        try:
            with store.begin() as tx:
                results.append(tx.apply(events[0]))
        except StoreClosed as exc:
            results.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert lock.waiting.wait(10)  # past its checks, waiting for the writer lock
    closer = threading.Thread(target=store.close)
    closer.start()
    while not store._closed:
        closer.join(0.01)
    holder.commit()
    thread.join(10)
    closer.join(10)
    assert not thread.is_alive() and not closer.is_alive()
    assert len(results) == 1 and isinstance(results[0], StoreClosed)
    again = AgentStore.open(tmp_path / "a")
    assert again.head(GROUP).applied_seq == 0
    again.close()


# -- the Group arguments of the Cursor calls ---------------------------------------------------


@pytest.mark.parametrize("group", BAD_GROUPS)
def test_head_cursor_and_ack_position_refuse_a_group_that_is_no_id(agent, group):
    for call in (agent.head, agent.cursor, agent.ack_position):
        with pytest.raises(InvalidCommand) as caught:
            call(group)
        assert caught.value.detail["field"] == "group"


@pytest.mark.parametrize("group", BAD_GROUPS)
def test_advance_cursor_refuses_a_group_that_is_no_id_and_writes_nothing(agent, group):
    with agent.begin() as tx:
        with pytest.raises(InvalidCommand) as caught:
            tx.advance_cursor(group)
        assert caught.value.detail["field"] == "group"
    assert agent.groups() == []


# -- apply_many ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["g-1:1", b"\x93", bytearray(b"\x93"), memoryview(b"\x93")], ids=["str", "bytes", "bytearray", "memoryview"])
def test_apply_many_refuses_a_str_or_bytes_as_its_batch(agent, events, batch):
    """A str or bytes is not a batch of Events (it would be taken apart into characters or ints):
    ``INVALID_COMMAND`` (field ``events``), also for the bytes of one encoded Event."""
    with agent.begin() as tx:
        for value in (batch, encode_event(events[0])):
            with pytest.raises(InvalidCommand) as caught:
                tx.apply_many(value)
            assert caught.value.detail["field"] == "events"
        assert tx.apply_many([encode_event(events[0])]) == [ApplyStatus.APPLIED]  # a list of bytes is a batch


@pytest.mark.parametrize("verify", ["full", "trusted"])
def test_apply_many_returns_with_its_write_cache_below_the_bound(tmp_path, monkeypatch, verify):
    """The write-back cache is flushed whenever it reaches ``_WRITE_CACHE_ENTRIES_MAX`` entries,
    also right after a C run that filled it: ``apply_many`` never returns holding more."""
    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 7)
    history = workload(GROUP, 40, seed=4)
    store = AgentStore.open(tmp_path / "a", verify=verify)
    with store.begin() as tx:
        start = 0
        for size in (5, 3, 8, 1, 6, 2, 9, 4, 2):
            tx.apply_many(history[start : start + size])
            start += size
            assert len(tx._state_writes) + len(tx._inbox_writes) < 7, start
        tx.advance_cursor(GROUP)
    assert store.cursor(GROUP) == start
    store.close()



def test_apply_returns_with_its_write_cache_below_the_bound(agent, monkeypatch):
    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 7)
    history = workload(GROUP, 30, seed=4)
    with agent.begin() as tx:
        for event in history:
            assert tx.apply(event) is ApplyStatus.APPLIED
            assert len(tx._state_writes) + len(tx._inbox_writes) < 7, event.seq
    assert agent.head(GROUP).applied_seq == 30 and agent.inbox_seqs(GROUP) == list(range(1, 31))

# -- prune and the per-Group listings ------------------------------------------------------------


@pytest.mark.parametrize("group", BAD_GROUPS)
def test_prune_inbox_refuses_a_group_that_is_no_id(agent, group):
    with pytest.raises(InvalidCommand) as caught:
        agent.prune_inbox(group)
    assert caught.value.detail["field"] == "group"


def test_a_groups_buffered_and_inbox_seqs_hold_none_of_a_group_its_id_prefixes(agent):
    """``buffered_seqs("g-1")`` and ``inbox_seqs("g-1")`` read g-1's key range only: not g-10's,
    whose keys start with the same characters."""
    first, second = workload("g-1", 6, seed=1), workload("g-10", 9, seed=2)
    with agent.begin() as tx:
        tx.apply_many(first[:2] + second[:3] + [first[4], second[7]])
    assert agent.inbox_seqs("g-1") == [1, 2] and agent.buffered_seqs("g-1") == [5]
    assert agent.inbox_seqs("g-10") == [1, 2, 3] and agent.buffered_seqs("g-10") == [8]


# -- the outbox ----------------------------------------------------------------------------------


def _record(tx, group=GROUP, operation="notify", **fields):
    return tx.record_intent(group, mission="m1", workitem="wi-1", ownership_epoch=3, operation=operation, **fields)


def test_an_intent_keeps_its_request_and_the_clock_readings_of_each_transition(tmp_path):
    """The intent is recorded with its request (what the side effect sends) and the clock's reading
    as ``recorded_at_ms`` and ``updated_at_ms``; each later transition (dispatched, uncertain,
    reconciled, done) sets ``updated_at_ms`` to the reading of its own commit."""
    now = [1_000]
    store = AgentStore.open(tmp_path / "a", clock=lambda: now[0])
    with store.begin() as tx:
        intent = _record(tx, request={"to": "ops", "n": [1, 2]})
    assert store.intent(intent.key) == intent
    assert (intent.request, intent.recorded_at_ms, intent.updated_at_ms) == ({"to": "ops", "n": [1, 2]}, 1_000, 1_000)
    for at, step in (
        (2_000, lambda: store.mark_dispatched(intent.key)),
        (3_000, lambda: store.mark_uncertain(intent.key, "timeout")),
        (4_000, lambda: store.reconcile(intent.key, lambda _: None)),
        (5_000, lambda: store.mark_dispatched(intent.key)),
        (6_000, lambda: store.record_receipt(intent.key, {"ref": "r"})),
    ):
        now[0] = at
        changed = step()
        assert store.intent(intent.key) == changed
        assert (changed.recorded_at_ms, changed.updated_at_ms, changed.request) == (1_000, at, {"to": "ops", "n": [1, 2]})
    store.close()


@pytest.mark.parametrize("request_", [[1, 2], "ops", {"x": float("nan")}, {"x": {1: 2}}, {"x": "\udc80"}, {"x": 2**64}])
def test_an_intents_request_is_a_dict_of_canonical_content_or_nothing_is_recorded(agent, request_):
    with agent.begin() as tx:
        with pytest.raises(InvalidCommand) as caught:
            _record(tx, request=request_)
        assert caught.value.detail["field"].startswith("request")
        assert _record(tx, operation="other").request is None  # the transaction stays usable
    assert [intent.operation for intent in agent.intents()] == ["other"]


@pytest.mark.parametrize("group", BAD_GROUPS)
def test_record_intent_refuses_a_group_that_is_no_id(agent, group):
    with agent.begin() as tx:
        with pytest.raises(InvalidCommand) as caught:
            _record(tx, group=group)
        assert caught.value.detail["field"] == "group"
    assert agent.intents() == []


def test_record_intent_in_a_finished_or_failed_transaction_is_refused(tmp_path, events):
    store = AgentStore.open(tmp_path / "a", projections=[FailingProjection(fail_seq=1)])
    tx = store.begin()
    tx.commit()
    with pytest.raises(StoreClosed):
        _record(tx)
    with pytest.raises(ProjectionFailed):
        with store.begin() as tx:
            with pytest.raises(RuntimeError):
                tx.apply(events[0])
            with pytest.raises(ProjectionFailed):
                _record(tx)
    assert store.intents() == []
    store.close()


def test_intents_of_a_group_hold_none_of_a_group_its_id_prefixes(agent):
    with agent.begin() as tx:
        first = _record(tx, group="g-1")
        second = _record(tx, group="g-10", operation="page")
    assert agent.intents("g-1") == [first] and agent.intents("g-10") == [second]


@pytest.mark.parametrize("pending_only", ["no", 1, None])
def test_intents_refuses_a_pending_only_that_is_not_a_bool(agent, pending_only):
    """A truthy string would otherwise hide the DONE intents without saying why."""
    with agent.begin() as tx:
        intent = _record(tx)
    with pytest.raises(InvalidCommand) as caught:
        agent.intents(pending_only=pending_only)
    assert caught.value.detail["field"] == "pending_only"
    assert agent.intents(pending_only=False) == [intent]


@pytest.mark.parametrize("receipt", [[1], "ok", None, {"x": float("inf")}])
def test_a_receipt_is_a_dict_of_canonical_content_or_nothing_is_recorded(agent, receipt):
    with agent.begin() as tx:
        intent = _record(tx)
    agent.mark_dispatched(intent.key)
    with pytest.raises(InvalidCommand) as caught:
        agent.record_receipt(intent.key, receipt)
    assert caught.value.detail["field"].startswith("receipt")
    assert agent.intent(intent.key).state.value == "dispatched"


def test_a_receipt_clears_the_error_of_an_uncertain_dispatch_and_takes_an_intent(agent):
    """``record_receipt`` takes the key or the Intent itself; a DONE intent carries no error of the
    uncertain dispatch before it (the outcome is known now)."""
    with agent.begin() as tx:
        intent = _record(tx)
    agent.mark_dispatched(intent.key)
    uncertain = agent.mark_uncertain(intent.key, "TimeoutError: no answer")
    assert uncertain.error == "TimeoutError: no answer"
    done = agent.record_receipt(uncertain, {"ref": "r"})
    assert (done.state.value, done.receipt, done.error) == ("done", {"ref": "r"}, None)
    assert agent.intent(intent.key) == done


def test_a_refused_transition_names_the_intent_and_its_state_and_changes_nothing(agent):
    """Out-of-order transitions are refused with the intent's key and current state in the error:
    a second ``mark_dispatched`` (``RECONCILE_REQUIRED``), ``mark_uncertain`` of an intent not
    dispatched since it was recorded or reconciled (``INVALID_STATE``)."""
    with agent.begin() as tx:
        intent = _record(tx)
    with pytest.raises(InvalidState) as caught:
        agent.mark_uncertain(intent.key, "timeout")
    assert caught.value.detail["state"] == "intended"
    agent.mark_dispatched(intent.key)
    with pytest.raises(ReconcileRequired) as caught:
        agent.mark_dispatched(intent.key)
    assert caught.value.detail == {"key": intent.key, "state": "dispatched"}
    agent.mark_uncertain(intent.key, "timeout")
    reconciled = agent.reconcile(intent.key, lambda _: None)
    with pytest.raises(InvalidState) as caught:  # reconciled as not done: nothing is in flight
        agent.mark_uncertain(intent.key, "late timeout")
    assert caught.value.detail["state"] == "reconciled"
    assert agent.intent(intent.key) == reconciled


def test_a_lookup_that_finds_an_empty_receipt_settles_the_intent_as_done(agent):
    """Only None from ``lookup`` means "did not happen": an empty receipt ``{}`` is a receipt, and
    the intent is DONE with it (never RECONCILED, which would let it be dispatched again)."""
    with agent.begin() as tx:
        intent = _record(tx)
    agent.mark_dispatched(intent.key)
    agent.mark_uncertain(intent.key, "timeout")
    done = agent.reconcile(intent.key, lambda _: {})
    assert (done.state.value, done.receipt) == ("done", {})
    assert agent.dispatch(intent.key, lambda _: pytest.fail("dispatched again")) == {}


@pytest.mark.parametrize("call", ["reconcile", "dispatch"])
def test_reconcile_and_dispatch_of_an_unknown_intent_are_invalid_command(agent, call):
    with pytest.raises(InvalidCommand) as caught:
        getattr(agent, call)("0" * 64, lambda _: pytest.fail("called"))
    assert caught.value.detail["field"] == "intent_key"


def test_dispatch_takes_an_intent_and_hands_the_side_effect_the_dispatched_intent(agent):
    """``dispatch`` takes the key or the Intent; ``side_effect`` gets the intent as it is durably
    marked: DISPATCHED, its dispatch counted, with the same key on a retry."""
    with agent.begin() as tx:
        intent = _record(tx, request={"to": "ops"})
    seen = []

    def refuse(current):
        seen.append(current)
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        agent.dispatch(intent, refuse)
    assert agent.intent(intent.key).error == "ConnectionError: refused"  # the failure's class and text
    assert agent.reconcile(intent.key, lambda _: None).state.value == "reconciled"
    assert agent.dispatch(intent, lambda current: seen.append(current) or {"ref": "r"}) == {"ref": "r"}
    assert [(item.key, item.state.value, item.dispatches, item.request) for item in seen] == [
        (intent.key, "dispatched", 1, {"to": "ops"}), (intent.key, "dispatched", 2, {"to": "ops"})]
    assert agent.intent(intent.key).error is None and agent.intent(intent.key).dispatches == 2


# -- a write-back flush that fails ---------------------------------------------------------------


def _with_unstorable_state(event):
    """``event`` with an Effect state msgpack cannot store as a state (an int key): trusted mode
    lets it through until the write-back cache is flushed."""
    return msgspec.structs.replace(event, effects=[Effect(event.effects[0].aggregate, 1, {1: "x"})])


def test_a_flush_that_cannot_encode_a_state_leaves_the_transaction_only_abortable(tmp_path, monkeypatch):
    """When the write-back cache is flushed part-way (at its bound) and a state cannot be encoded,
    the inbox entries may already be written and the cached states are gone: the ``EventInvalid``
    can be caught, but the transaction can then only abort, and nothing of it is committed.
    ``deliver_batch`` ends its batch with that ``EventInvalid`` (finding 257), not with the failed
    transaction's ``PROJECTION_FAILED`` at the next Event."""
    from mwpstore.delivery import deliver_batch

    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 4)
    history = workload(GROUP, 8, seed=6)
    batch = [history[0], _with_unstorable_state(history[1]), *history[2:]]
    store = AgentStore.open(tmp_path / "a", verify="trusted")
    with pytest.raises(ProjectionFailed):
        with store.begin() as tx:
            tx.apply(batch[0])
            with pytest.raises(EventInvalid) as caught:
                tx.apply(batch[1])  # the cache reaches its bound: flushed here, not at commit
            assert caught.value.detail["reason"] == "state"
            with pytest.raises(ProjectionFailed):
                tx.apply(batch[2])
    with pytest.raises(EventInvalid) as caught:
        deliver_batch(store, GROUP, batch)
    assert caught.value.detail["reason"] == "state"
    assert store.head(GROUP).applied_seq == 0 and store.inbox_seqs(GROUP) == [] and store.projection_dump() == []
    store.close()
