"""AgentStore: the apply cycle, the gap-safe Cursor, ACK cleanup, projections, rebuild, restore."""

from __future__ import annotations

import os
import shutil
import struct
from types import SimpleNamespace

import msgspec
import pytest

from agent_store_support import ChainBuilder, CountingProjection, apply_all, interrupt_once_at, lease_record, workitem_state, workload
from authority_helpers import record_unseals
from mwpstore import limits
from mwpstore.agent_store import AgentStore, ApplyStatus, ProjectionFailed
from mwpstore.delivery import ListSource, rebuild_group, Delivery
from mwpstore.errors import EventInvalid, InvalidCommand, LimitExceeded, SnapshotInvalid, StoreClosed, StoreLocked
from mwpstore.messages import Effect, Event, encode_event, event_hash, recompute_event_hash

GROUP = "g-1"


class FailingProjection:
    name = "failing"

    def __init__(self, fail_seq, error=RuntimeError):
        self.fail_seq = fail_seq
        self.error = error

    def apply(self, view, event):
        view.put(f"e{event.seq}", b"x")
        if event.seq == self.fail_seq:
            raise self.error("application projection failed")


class _Stop(BaseException):
    """Not an Exception: what a KeyboardInterrupt or SystemExit is."""


@pytest.fixture
def events():
    return workload(GROUP, 60, seed=3)


@pytest.fixture
def store(tmp_path):
    agent = AgentStore.open(tmp_path / "agent", projections=[CountingProjection()])
    yield agent
    agent.close()


def test_in_order_events_apply_and_cursor_advances(store, events):
    statuses = apply_all(store, events)
    assert statuses == [ApplyStatus.APPLIED] * len(events)
    assert store.cursor(GROUP) == len(events)
    assert store.ack_position(GROUP) == len(events)
    assert store.state(GROUP, f"group:{GROUP}")["org"] == "org-1"


def test_duplicate_event_id_is_ignored(store, events):
    apply_all(store, events[:10])
    before = store.projection_digest()
    assert apply_all(store, events[:10]) == [ApplyStatus.DUPLICATE] * 10
    assert store.projection_digest() == before
    assert store.projection_get(GROUP, "counter", "total") == struct.pack(">Q", 10)


def test_later_event_is_buffered_and_cursor_stays_below_the_gap(store, events):
    """MWP-WRK-029: a later Event is buffered; the Cursor never moves over the gap."""
    statuses = apply_all(store, [events[0], events[1], events[3], events[4]])
    assert statuses == [ApplyStatus.APPLIED, ApplyStatus.APPLIED, ApplyStatus.BUFFERED, ApplyStatus.BUFFERED]
    assert store.cursor(GROUP) == 2
    assert store.buffered_seqs(GROUP) == [4, 5]
    assert store.head(GROUP).applied_seq == 2


def test_filling_the_gap_drains_buffered_events(store, events):
    apply_all(store, [events[0], events[2], events[3], events[5]])
    assert apply_all(store, [events[1]]) == [ApplyStatus.APPLIED]
    assert store.cursor(GROUP) == 4
    assert store.buffered_seqs(GROUP) == [6]


def test_buffered_duplicate_is_reported_as_duplicate(store, events):
    apply_all(store, [events[4]])
    assert apply_all(store, [events[4]]) == [ApplyStatus.DUPLICATE]
    assert store.head(GROUP).buffered == 1


def test_a_second_different_event_for_a_buffered_sequence_replaces_the_first(store, events):
    """A forgery buffered first (self-consistent, linked to nothing) does not shut out the genuine
    Event delivered after it for the same sequence: the later one replaces it, the count stays one,
    and when the gap fills the genuine Event applies."""
    forged = _rehash(events[2], prev_hash=bytes(32))
    assert apply_all(store, [events[0], forged]) == [ApplyStatus.APPLIED, ApplyStatus.BUFFERED]
    assert apply_all(store, [events[2]]) == [ApplyStatus.BUFFERED]
    assert store.buffered_seqs(GROUP) == [3] and store.head(GROUP).buffered == 1
    assert apply_all(store, [events[1]]) == [ApplyStatus.APPLIED]
    assert store.cursor(GROUP) == 3 and store.head(GROUP).applied_hash == events[2].hash
    assert store.buffered_seqs(GROUP) == []


def test_ack_position_is_the_durable_cursor_not_the_applied_sequence(store, events):
    """What to ACK is the Cursor: Events applied in a commit that did not advance it are not
    ACKed yet."""
    apply_all(store, events[:4])
    apply_all(store, events[4:9], advance=False)
    assert store.head(GROUP).applied_seq == 9
    assert store.ack_position(GROUP) == store.cursor(GROUP) == 4


def test_advance_cursor_is_a_separate_call(store, events, tmp_path):
    apply_all(store, events[:5], advance=False)
    assert store.cursor(GROUP) == 0
    assert store.head(GROUP).applied_seq == 5
    with store.begin() as tx:
        assert tx.advance_cursor(GROUP) == 5
    assert store.cursor(GROUP) == 5


def test_exception_in_the_block_aborts_everything(store, events):
    with pytest.raises(RuntimeError):
        with store.begin() as tx:
            for event in events[:5]:
                tx.apply(event)
            tx.advance_cursor(GROUP)
            raise RuntimeError("caller failed")
    assert store.cursor(GROUP) == 0
    assert store.states(GROUP) == {}
    assert store.projection_items(GROUP, "counter") == []


def test_application_projection_exception_aborts_the_whole_transaction(tmp_path, events):
    agent = AgentStore.open(tmp_path / "a", projections=[CountingProjection(), FailingProjection(fail_seq=4)])
    with pytest.raises(RuntimeError, match="application projection failed"):
        with agent.begin() as tx:
            for event in events[:6]:
                tx.apply(event)
            tx.advance_cursor(GROUP)
    assert agent.cursor(GROUP) == 0
    assert agent.states(GROUP) == {}
    assert agent.projection_items(GROUP, "counter") == []
    assert agent.projection_items(GROUP, "failing") == []
    agent.close()


@pytest.mark.parametrize("error", [RuntimeError, _Stop])
def test_caught_projection_exception_still_aborts_the_transaction(tmp_path, events, error):
    """Also a BaseException (not an Exception) that the block catches: the transaction is failed."""
    agent = AgentStore.open(tmp_path / "a", projections=[FailingProjection(fail_seq=2, error=error)])
    with pytest.raises(ProjectionFailed):
        with agent.begin() as tx:
            tx.apply(events[0])
            try:
                tx.apply(events[1])
            except error:
                pass
    assert agent.head(GROUP).applied_seq == 0
    assert agent.projection_items(GROUP, "failing") == []
    agent.close()


def test_projection_writes_are_scoped_to_group_and_name(store):
    first = workload("g-a", 8, seed=1)
    second = workload("g-b", 8, seed=2)
    apply_all(store, first + second)
    assert store.projection_get("g-a", "counter", "total") == struct.pack(">Q", 8)
    assert store.projection_get("g-b", "counter", "total") == struct.pack(">Q", 8)
    assert store.projection_get("g-a", "other", "total") is None
    assert store.projection_items("g-a", "count") == []  # a name that is a prefix of another's reads none of its keys


def test_groups_have_distinct_cursors_and_buffers(store):
    """MWP-WRK-008: each Group has its own Cursor, buffer, inbox and state."""
    first = workload("g-a", 10, seed=1)
    second = workload("g-b", 10, seed=2)
    apply_all(store, first + second[:3] + second[5:])
    assert store.cursor("g-a") == 10
    assert store.cursor("g-b") == 3
    assert store.buffered_seqs("g-a") == []
    assert store.buffered_seqs("g-b") == list(range(6, 11))
    assert sorted(store.groups()) == ["g-a", "g-b"]


# -- ACK and inbox cleanup --------------------------------------------------------------------


def test_prune_inbox_removes_only_entries_at_or_below_the_cursor(store, events):
    """MWP-WRK-030: ACK cleanup prunes the inbox at or below the Cursor and nothing else."""
    apply_all(store, events[:10])
    apply_all(store, events[10:12], advance=False)
    states_before = store.states(GROUP)
    assert store.prune_inbox(GROUP) == 10
    assert store.inbox_seqs(GROUP) == [11, 12]
    assert store.states(GROUP) == states_before
    assert store.cursor(GROUP) == 10


def test_replay_after_prune_is_still_a_duplicate(store, events):
    apply_all(store, events[:10])
    store.prune_inbox(GROUP)
    digest = store.projection_digest()
    assert apply_all(store, events[:10]) == [ApplyStatus.DUPLICATE] * 10
    assert store.projection_digest() == digest


def test_prune_keeps_buffered_events(store, events):
    apply_all(store, events[:3] + events[5:7])
    store.prune_inbox(GROUP)
    assert store.buffered_seqs(GROUP) == [6, 7]
    apply_all(store, events[3:5])
    assert store.cursor(GROUP) == 7


# -- work queue -------------------------------------------------------------------------------


def test_work_queue_orders_by_priority_then_not_before_then_id(store):
    chain = ChainBuilder(GROUP)
    specs = [("w-c", 1, 0), ("w-a", 5, 200), ("w-b", 5, 100), ("w-d", 5, 100), ("w-e", -3, 0), ("w-f", 1, 9_000)]
    for workitem, priority, not_before in specs:
        key = f"workitem:{workitem}"
        chain.event("workitem.create", key, {key: workitem_state("m1", "queued", priority=priority, not_before_ms=not_before)})
    apply_all(store, chain.events)
    queue = store.work_queue(GROUP, now_ms=1_000)
    assert [entry.workitem for entry in queue] == ["w-b", "w-d", "w-a", "w-c", "w-e"]
    assert [entry.workitem for entry in store.work_queue(GROUP, now_ms=10_000)][-3:] == ["w-c", "w-f", "w-e"]
    assert [entry.workitem for entry in store.work_queue(GROUP, now_ms=150)] == ["w-b", "w-d", "w-c", "w-e"]


def test_leased_and_terminal_workitems_leave_the_queue(store):
    chain = ChainBuilder(GROUP)
    key = "workitem:w1"
    chain.event("workitem.create", key, {key: workitem_state("m1", "queued")})
    chain.event("workitem.create", "workitem:w2", {"workitem:w2": workitem_state("m1", "queued")})
    chain.event("workitem.claim", key, {key: workitem_state("m1", "leased", ownership_epoch=1, lease=lease_record("a", 1))})
    apply_all(store, chain.events)
    assert [entry.workitem for entry in store.work_queue(GROUP, 10**12)] == ["w2"]
    chain.event("workitem.checkpoint", key, {key: workitem_state("m1", "queued", checkpoint={"step": 3})})
    chain.event("workitem.cancel", "workitem:w2", {"workitem:w2": workitem_state("m1", "cancelled")})
    apply_all(store, chain.events[3:])
    assert [entry.workitem for entry in store.work_queue(GROUP, 10**12)] == ["w1"]
    assert store.checkpoint(GROUP, "w1") == {"step": 3}


def test_blocked_and_submitted_workitems_are_not_ready_and_come_back_when_queued(store):
    """The queue holds exactly the WorkItems whose state is ``queued``: a blocked or submitted one
    leaves it and a resolve (queued again) brings it back."""
    chain = ChainBuilder(GROUP)
    for name in ("w1", "w2", "w3"):
        key = f"workitem:{name}"
        chain.event("workitem.create", key, {key: workitem_state("m1", "queued")})
    chain.event("workitem.block", "workitem:w1", {"workitem:w1": workitem_state("m1", "blocked")})
    chain.event("workitem.submit", "workitem:w2", {"workitem:w2": workitem_state("m1", "submitted")})
    apply_all(store, chain.events)
    assert [entry.workitem for entry in store.work_queue(GROUP, 10**12)] == ["w3"]
    chain.event("workitem.resolve", "workitem:w1", {"workitem:w1": workitem_state("m1", "queued")})
    apply_all(store, chain.events[5:])
    assert [entry.workitem for entry in store.work_queue(GROUP, 10**12)] == ["w1", "w3"]


def test_work_queue_is_ready_from_not_before_on_and_returns_exactly_limit_entries(store):
    chain = ChainBuilder(GROUP)
    for name, priority in (("w1", 3), ("w2", 2), ("w3", 1)):
        key = f"workitem:{name}"
        chain.event("workitem.create", key, {key: workitem_state("m1", "queued", priority=priority, not_before_ms=5_000)})
    apply_all(store, chain.events)
    assert store.work_queue(GROUP, 4_999) == []
    assert [entry.workitem for entry in store.work_queue(GROUP, 5_000)] == ["w1", "w2", "w3"]
    assert [entry.workitem for entry in store.work_queue(GROUP, 5_000, limit=2)] == ["w1", "w2"]
    assert [entry.workitem for entry in store.work_queue(GROUP, 5_000, limit=1)] == ["w1"]


def test_removed_aggregate_leaves_the_queue(store):
    chain = ChainBuilder(GROUP)
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": workitem_state("m1", "queued")})
    chain.event("workitem.drop", "workitem:w1", {"workitem:w1": None})
    apply_all(store, chain.events)
    assert store.work_queue(GROUP, 10**12) == []
    assert store.state(GROUP, "workitem:w1") is None
    assert store.revision(GROUP, "workitem:w1") == 2


# -- hostile delivered Events -------------------------------------------------------------------


def _rehash(event: Event, **changes) -> Event:
    changed = msgspec.structs.replace(event, **changes)
    return msgspec.structs.replace(changed, hash=recompute_event_hash(changed))


def hostile_events(events):
    first = events[0]
    second = events[1]
    yield "bad hash", msgspec.structs.replace(first, hash=bytes(32)), EventInvalid
    yield "wrong event id", _rehash(first, event_id=f"{GROUP}:7"), EventInvalid
    yield "tampered body", msgspec.structs.replace(first, body={"org": "evil"}), EventInvalid
    yield "tampered effect", msgspec.structs.replace(first, effects=[Effect("group:g-1", 1, {"org": "evil"})]), EventInvalid
    yield "seq as string", msgspec.structs.replace(first, seq="1"), EventInvalid
    yield "seq zero", _rehash(first, seq=0, event_id=f"{GROUP}:0"), EventInvalid
    yield "authoritative as int", msgspec.structs.replace(first, authoritative=1), EventInvalid
    yield "effects not a list", msgspec.structs.replace(first, effects="x"), EventInvalid
    yield "effect not an Effect", msgspec.structs.replace(first, effects=[("a", 1, None)]), EventInvalid
    yield "effect aggregate with NUL", _rehash(first, effects=[Effect("group:g\x00x", 1, {})]), EventInvalid
    yield "effect aggregate not typed", _rehash(first, effects=[Effect("nocolon", 1, {})]), EventInvalid
    yield "body is a list", msgspec.structs.replace(first, body=[1]), EventInvalid
    yield "group is a path", _rehash(first, group="../x", event_id="../x:1"), EventInvalid
    yield "hash too short", msgspec.structs.replace(first, hash=b"x"), EventInvalid
    yield "not an Event", {"group": GROUP}, EventInvalid
    yield "garbage bytes", b"\x93\x01\x02\x03", EventInvalid
    yield "oversize bytes", b"\x00" * (limits.EVENT_BYTES_MAX + 1), LimitExceeded
    big = {f"k{index}": "x" * limits.STRING_BYTES_MAX for index in range(limits.EVENT_BYTES_MAX // limits.STRING_BYTES_MAX + 1)}
    yield "oversize body", _rehash(first, body=big), LimitExceeded
    yield "broken chain link", _rehash(second, prev_hash=bytes(32)), EventInvalid


@pytest.mark.parametrize("name", [name for name, _, _ in hostile_events(workload(GROUP, 3))])
def test_hostile_event_is_rejected_and_nothing_is_written(store, events, name):
    hostile = {entry[0]: entry for entry in hostile_events(events)}[name]
    _, event, error = hostile
    if name == "broken chain link":
        apply_all(store, events[:1])
    before = store.projection_dump()
    with store.begin() as tx:
        with pytest.raises(error):
            tx.apply(event)
        tx.advance_cursor(GROUP)
    assert store.projection_dump() == before
    assert store.buffered_seqs(GROUP) == []
    with store.begin() as tx:  # the transaction stays usable after a rejected Event
        with pytest.raises(error):
            tx.apply(event)
        assert tx.apply(events[0]) in (ApplyStatus.APPLIED, ApplyStatus.DUPLICATE)
        tx.advance_cursor(GROUP)
    reference = AgentStore.open(store.path + "-ref", projections=[CountingProjection()])
    apply_all(reference, events[:1])
    assert store.projection_dump() == reference.projection_dump()
    reference.close()
    shutil.rmtree(store.path + "-ref")


def test_conflicting_duplicate_is_rejected(store, events):
    apply_all(store, events[:3])
    forged = _rehash(events[1], accepted_at_ms=events[1].accepted_at_ms + 1)
    with store.begin() as tx:
        with pytest.raises(EventInvalid) as info:
            tx.apply(forged)
    assert info.value.detail["reason"] == "conflict"


def test_forged_buffered_event_is_dropped_when_the_gap_fills(store, events):
    forged = _rehash(events[2], prev_hash=bytes(32))
    apply_all(store, [events[0], forged, events[3]])
    assert store.buffered_seqs(GROUP) == [3, 4]
    apply_all(store, [events[1]])
    assert store.cursor(GROUP) == 2  # forged seq 3 dropped, the gap stays open
    assert store.buffered_seqs(GROUP) == [4]
    apply_all(store, [events[2]])
    assert store.cursor(GROUP) == 4


def test_a_later_event_that_fails_full_validation_is_refused_not_buffered(store, events):
    """Beyond a gap only the chain link waits for the gap to fill: every other check of
    ``check_event`` is made at once, so a forged later Event is EVENT_INVALID, never buffered."""
    apply_all(store, events[:2])
    genuine = events[5]
    forged = [msgspec.structs.replace(genuine, hash=bytes(32)),
              msgspec.structs.replace(genuine, body={"n": -1}),
              msgspec.structs.replace(genuine, effects=[Effect("workitem:w0", 1, {"state": "queued"})])]
    for event in forged:
        with store.begin() as tx:
            with pytest.raises(EventInvalid):
                tx.apply(event)
    assert store.buffered_seqs(GROUP) == [] and store.head(GROUP).buffered == 0
    assert apply_all(store, [genuine]) == [ApplyStatus.BUFFERED]


def test_the_buffer_bound_refuses_exactly_one_more_event_and_writes_nothing(store, events, monkeypatch):
    from mwpstore import agent_store

    monkeypatch.setattr(agent_store, "BUFFERED_EVENTS_MAX", 3)
    apply_all(store, events[:1])
    assert apply_all(store, events[2:5]) == [ApplyStatus.BUFFERED] * 3
    with store.begin() as tx:
        with pytest.raises(LimitExceeded):
            tx.apply(events[5])
        assert tx.apply(events[3]) is ApplyStatus.DUPLICATE  # a buffered one still counts as seen
    assert store.buffered_seqs(GROUP) == [3, 4, 5] and store.head(GROUP).buffered == 3
    assert apply_all(store, events[1:2] + events[5:6]) == [ApplyStatus.APPLIED, ApplyStatus.APPLIED]
    assert store.cursor(GROUP) == 6 and store.buffered_seqs(GROUP) == []


def test_a_redelivered_event_with_a_wrong_event_id_is_refused(store, events):
    """A duplicate is not written, but it must still be well-formed: a copy of an applied Event
    whose Event ID names another sequence is EVENT_INVALID, before and after the inbox is pruned."""
    apply_all(store, events[:5])
    wrong = msgspec.structs.replace(events[2], event_id=f"{GROUP}:9")  # the hash as delivered before
    for prune in (False, True):
        if prune:
            store.prune_inbox(GROUP)
        with store.begin() as tx:
            with pytest.raises(EventInvalid) as caught:
                tx.apply(wrong)
        assert caught.value.detail["reason"] == "event_id"


def test_event_bytes_are_accepted(store, events):
    with store.begin() as tx:
        assert [tx.apply(encode_event(event)) for event in events[:3]] == [ApplyStatus.APPLIED] * 3


# -- lock, close -----------------------------------------------------------------------------


def test_second_open_is_store_locked(tmp_path):
    agent = AgentStore.open(tmp_path / "a")
    with pytest.raises(StoreLocked):
        AgentStore.open(tmp_path / "a")
    agent.close()
    AgentStore.open(tmp_path / "a").close()


@pytest.mark.parametrize("path", [123, b"/tmp/agent", "", "agent\x00x"])
def test_open_refuses_a_path_that_is_not_a_text_path(path):
    with pytest.raises(InvalidCommand) as caught:
        AgentStore.open(path)
    assert caught.value.detail["field"] == "path"


@pytest.mark.parametrize(
    "option, value",
    [
        ("map_size", "64"),
        ("map_size", -1),
        ("map_size", 1.5),
        ("map_size", True),
        ("map_size", 2**64),
        ("projections", None),
        ("projections", 5),
        ("trusted_keys", None),
        ("trusted_keys", 5),
        ("trusted_keys", b"k" * 32),
        ("trusted_keys", {b"k" * 32}),  # a set: documented as a list or tuple, as the message says
        ("projections", (projection for projection in ())),
        ("verify", []),
        ("verify", None),
        ("check_lmdb", "yes"),
        ("check_lmdb", 0),  # equal to False, but it checked the file at every open, as True does
        ("check_lmdb", 1),
        ("clock", 5),
        ("clock", None),  # the wall clock is the default; None is no clock
    ],
)
def test_open_refuses_a_bad_option_before_anything_is_written(tmp_path, option, value):
    """A bad option raised LMDB's or Python's own error (MWP_ERROR) after the directory, its lock
    and lmdb/ existed, took map_size=True as 1 byte, and took a key's bytes apart into ints."""
    path = tmp_path / "agent"
    with pytest.raises(InvalidCommand) as caught:
        AgentStore.open(path, **{option: value})
    assert caught.value.detail["field"] == option
    assert not path.exists()


@pytest.mark.parametrize("leftover", ["authority.lock", "log", "index"])
def test_open_refuses_an_authoritys_directory(tmp_path, leftover):
    """An AgentStore opened on an authority's directory put agent.lock and lmdb/ beside its log."""
    from mwpstore import Authority

    authority_dir = tmp_path / "authority"
    Authority.open(authority_dir).close()
    with pytest.raises(InvalidCommand) as caught:
        AgentStore.open(authority_dir)
    assert caught.value.detail["field"] == "path"
    assert sorted(os.listdir(authority_dir)) == ["authority.lock", "index", "log"]
    only = tmp_path / "only"
    only.mkdir()
    if leftover == "authority.lock":
        (only / leftover).touch()
    else:
        (only / leftover).mkdir()
    with pytest.raises(InvalidCommand):
        AgentStore.open(only)
    assert sorted(os.listdir(only)) == [leftover]


def test_intent_keys_and_operations_utf8_cannot_encode_are_invalid_command(store):
    """A lone surrogate in an intent key or operation raised UnicodeEncodeError."""
    for call in (
        lambda: store.intent("\ud800"),
        lambda: store.mark_dispatched("\udcff"),
        lambda: store.record_receipt("\udcff", {}),
    ):
        with pytest.raises(InvalidCommand) as caught:
            call()
        assert caught.value.detail["field"] == "intent_key"
    with store.begin() as tx:
        with pytest.raises(InvalidCommand) as caught:
            tx.record_intent(GROUP, mission="m", workitem="w", ownership_epoch=1, operation="\udcff")
        assert caught.value.detail["field"] == "operation_id"
    assert store.intents() == []


def test_a_handle_used_in_a_forked_child_is_store_closed_and_the_store_stays_intact(tmp_path, events):
    """A child forked after the open applied and committed into the parent's LMDB environment and
    closed it, which LMDB forbids across fork()."""
    from authority_helpers import in_a_forked_child

    agent = AgentStore.open(tmp_path / "a")
    apply_all(agent, events[:1])

    def child_applies() -> None:
        with agent.begin() as tx:
            tx.apply(events[1])

    outcomes = in_a_forked_child([child_applies, lambda: agent.head(GROUP), lambda: agent.cursor(GROUP), agent.check_open,
                                  agent.close])
    assert outcomes == ["StoreClosed"] * 4 + ["ok"]  # close() in the child touches nothing
    assert agent.head(GROUP).applied_seq == 1
    apply_all(agent, events[1:3])
    assert agent.head(GROUP).applied_seq == agent.cursor(GROUP) == 3
    with agent.begin() as tx:  # forked while this thread's transaction is open: close() in the child still returns at once
        tx.apply(events[3])
        assert in_a_forked_child([agent.close]) == ["ok"]
    assert agent.head(GROUP).applied_seq == 4
    agent.close()
    with AgentStore.open(tmp_path / "a") as again:
        assert again.head(GROUP).applied_seq == 4


def test_closed_store_refuses_use(tmp_path, events):
    agent = AgentStore.open(tmp_path / "a")
    assert agent.check_open() is None
    agent.close()
    with pytest.raises(StoreClosed):
        agent.check_open()
    with pytest.raises(StoreClosed):
        agent.begin()
    with pytest.raises(StoreClosed):
        agent.cursor(GROUP)


def test_reopen_keeps_cursor_buffer_and_state(tmp_path, events):
    agent = AgentStore.open(tmp_path / "a")
    apply_all(agent, events[:5] + events[7:9])
    digest = agent.projection_digest()
    agent.close()
    agent = AgentStore.open(tmp_path / "a")
    assert agent.cursor(GROUP) == 5
    assert agent.buffered_seqs(GROUP) == [8, 9]
    assert agent.projection_digest() == digest
    agent.close()


# -- rebuild ----------------------------------------------------------------------------------


def test_delete_and_rebuild_gives_byte_identical_projections(tmp_path):
    """MWP-FND-023: the store holds nothing authoritative; deleted, it rebuilds byte for byte."""
    histories = workload("g-a", 120, seed=5) + workload("g-b", 80, seed=6)
    source = ListSource(histories)
    agent = AgentStore.open(tmp_path / "a", projections=[CountingProjection()])
    for group in ("g-a", "g-b"):
        Delivery(agent, source, batch_events=17).catch_up(group)
    dump = agent.projection_dump()
    digest = agent.projection_digest()
    agent.close()
    shutil.rmtree(tmp_path / "a")
    rebuilt = AgentStore.open(tmp_path / "a", projections=[CountingProjection()])
    for group in ("g-b", "g-a"):
        Delivery(rebuilt, source, batch_events=1000).catch_up(group)
    assert rebuilt.projection_dump() == dump
    assert rebuilt.projection_digest() == digest
    rebuilt.close()


def test_reset_group_and_rebuild_from_source(store):
    events = workload(GROUP, 50, seed=9)
    other = workload("g-x", 10, seed=1)
    apply_all(store, events + other)
    digest = store.projection_digest()
    other_digest = store.projection_digest("g-x")
    store.reset_group(GROUP)
    assert store.cursor(GROUP) == 0 and store.states(GROUP) == {}
    assert store.projection_digest("g-x") == other_digest
    assert rebuild_group(store, ListSource(events), GROUP) == 50
    assert store.projection_digest() == digest


def test_a_group_with_nothing_applied_adds_nothing_to_the_projection_digest(tmp_path):
    """Inbox and buffer are delivery bookkeeping: a Group whose Events are only buffered (beyond
    a gap), or that was reset, has the dump and digest of a Group the store never saw. Its head
    record of zeros (kept for the buffered count) was a row of the dump, so the digest told a
    store that had buffered an Event from one rebuilt to the same Cursor."""
    events = workload(GROUP, 10, seed=4)
    agent = AgentStore.open(tmp_path / "a", projections=[CountingProjection()])
    fresh = AgentStore.open(tmp_path / "b", projections=[CountingProjection()])
    apply_all(agent, events[3:6])  # beyond the gap at 1: buffered, nothing applied
    assert agent.buffered_seqs(GROUP) == [4, 5, 6] and agent.cursor(GROUP) == 0
    for group in (GROUP, None):
        assert agent.projection_dump(group) == fresh.projection_dump(group) == []
        assert agent.projection_digest(group) == fresh.projection_digest(group)
    apply_all(agent, events, advance=False)  # applied, Cursor 0: the Group's row names both
    head = agent.head(GROUP)
    assert head.applied_seq == 10 and head.cursor == 0
    assert ("heads", GROUP.encode(), msgspec.msgpack.encode([10, head.applied_hash, 0])) in agent.projection_dump(GROUP)
    assert agent.projection_digest() != fresh.projection_digest()
    agent.reset_group(GROUP)
    assert agent.projection_dump() == [] and agent.projection_digest() == fresh.projection_digest()
    agent.close()
    fresh.close()


# -- restore from a verified snapshot -----------------------------------------------------------


def _snapshot_at(events, seq, *, org="org-1", group=GROUP):
    states: dict[str, tuple[int, dict | None]] = {}
    for event in events[:seq]:
        for effect in event.effects:
            states[effect.aggregate] = (effect.revision, effect.state)
    aggregates = [Effect(key, revision, state) for key, (revision, state) in sorted(states.items())]
    return SimpleNamespace(org=org, group=group, seq=seq, head_hash=events[seq - 1].hash, aggregates=aggregates)


def test_restore_then_continue_strictly_after_the_snapshot(tmp_path, events):
    full = AgentStore.open(tmp_path / "full")
    apply_all(full, events)
    agent = AgentStore.open(tmp_path / "a")
    assert agent.restore_verified(_snapshot_at(events, 30), group=GROUP) == 30
    assert agent.cursor(GROUP) == 30
    assert apply_all(agent, events[25:30]) == [ApplyStatus.DUPLICATE] * 5
    apply_all(agent, events[30:])
    assert agent.states(GROUP) == full.states(GROUP)
    assert agent.work_queue(GROUP, 10**12) == full.work_queue(GROUP, 10**12)
    assert agent.cursor(GROUP) == len(events)
    full.close()
    agent.close()


def test_restore_chain_link_is_checked_after_the_snapshot(tmp_path, events):
    agent = AgentStore.open(tmp_path / "a")
    agent.restore_verified(_snapshot_at(events, 10), group=GROUP)
    with agent.begin() as tx:
        with pytest.raises(EventInvalid):
            tx.apply(_rehash(events[10], prev_hash=bytes(32)))
    agent.close()


def test_restore_refuses_rollback_and_wrong_binding_without_writing(store, events):
    apply_all(store, events[:20])
    digest = store.projection_digest()
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(_snapshot_at(events, 10), group=GROUP)
    assert info.value.check == "sequence"
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(_snapshot_at(events, 30, org="org-2"), group=GROUP)
    assert info.value.check == "binding"
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(_snapshot_at(events, 30), group="g-other")
    assert info.value.check == "binding"
    bad_hash = _snapshot_at(events, 20)
    bad_hash.head_hash = bytes(32)
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(bad_hash, group=GROUP)
    assert info.value.check == "hash"
    assert store.projection_digest() == digest


def test_restore_verified_refuses_aggregates_it_could_read_only_once(store, events):
    """The aggregates are checked, then written: a one-shot iterator was used up by the checks and
    restored none of them, with the Cursor at the snapshot's sequence."""
    snapshot = _snapshot_at(events, 20)
    digest = store.projection_digest()
    for one_shot in (iter(snapshot.aggregates), (effect for effect in snapshot.aggregates)):
        with pytest.raises(SnapshotInvalid) as info:
            store.restore_verified(SimpleNamespace(**{**vars(snapshot), "aggregates": one_shot}), group=GROUP)
        assert info.value.check == "schema"
    assert store.projection_digest() == digest and store.cursor(GROUP) == 0
    store.restore_verified(SimpleNamespace(**{**vars(snapshot), "aggregates": tuple(snapshot.aggregates)}), group=GROUP)
    full = AgentStore.open(store.path + "-full")
    apply_all(full, events[:20])
    assert store.states(GROUP) == full.states(GROUP) and store.cursor(GROUP) == 20
    full.close()
    shutil.rmtree(store.path + "-full")


def test_the_buffered_count_in_the_head_follows_the_buffer(tmp_path, events):
    """``head.buffered`` decides whether a drain runs, the buffer bound and the C runs: it must
    count exactly the Events in the buffer after buffering, draining, a dropped forgery, a restore
    and a reset."""
    agent = AgentStore.open(tmp_path / "a")

    def consistent():
        assert agent.head(GROUP).buffered == len(agent.buffered_seqs(GROUP))

    forged = _rehash(events[7], prev_hash=bytes(32))  # seq 8, linked to nothing
    apply_all(agent, [events[0]] + events[2:6] + [forged] + events[8:10])
    assert agent.buffered_seqs(GROUP) == [3, 4, 5, 6, 8, 9, 10]
    consistent()
    apply_all(agent, [events[1]])  # drains 3..6
    assert agent.buffered_seqs(GROUP) == [8, 9, 10]
    consistent()
    apply_all(agent, [events[6]])  # 7 applied; the forged 8 is dropped, the gap stays
    assert agent.buffered_seqs(GROUP) == [9, 10] and agent.head(GROUP).applied_seq == 7
    consistent()
    apply_all(agent, events[12:14])
    agent.restore_verified(_snapshot_at(events, 12), group=GROUP)  # drops 9, 10; drains 13, 14
    assert agent.head(GROUP).applied_seq == 14
    consistent()
    apply_all(agent, [events[20]])
    consistent()
    agent.reset_group(GROUP)
    consistent()
    assert agent.head(GROUP).buffered == 0
    agent.close()


def test_restore_drops_a_buffered_event_at_the_snapshot_sequence(tmp_path, events):
    """The snapshot covers its own sequence: a buffered Event there is dropped with the ones
    below it, and only those after it stay buffered."""
    agent = AgentStore.open(tmp_path / "a")
    apply_all(agent, events[:3] + events[29:31] + events[32:33])
    assert agent.buffered_seqs(GROUP) == [30, 31, 33]
    agent.restore_verified(_snapshot_at(events, 30), group=GROUP)
    assert agent.buffered_seqs(GROUP) == [33]
    assert agent.head(GROUP).applied_seq == 31 and agent.head(GROUP).buffered == 1
    apply_all(agent, events[31:])
    assert agent.cursor(GROUP) == len(events) and agent.buffered_seqs(GROUP) == []
    agent.close()


def test_restore_refuses_a_snapshot_below_the_applied_sequence_even_above_the_cursor(store, events):
    """What is applied (not only what the Cursor covers) is never rolled back."""
    apply_all(store, events[:10])
    apply_all(store, events[10:20], advance=False)
    assert store.cursor(GROUP) == 10 and store.head(GROUP).applied_seq == 20
    dump = store.projection_dump()
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(_snapshot_at(events, 15), group=GROUP)
    assert info.value.check == "sequence"
    assert store.projection_dump() == dump and store.inbox_seqs(GROUP) == list(range(1, 21))


def test_restore_verified_refuses_a_snapshot_one_below_the_applied_sequence(store, events):
    """The rollback bound is exact: a snapshot one sequence below what is applied is refused
    (``sequence``) and changes nothing; one at the applied sequence with its head hash is taken."""
    apply_all(store, events[:20])
    dump = store.projection_dump()
    with pytest.raises(SnapshotInvalid) as info:
        store.restore_verified(_snapshot_at(events, 19), group=GROUP)
    assert info.value.check == "sequence"
    assert store.projection_dump() == dump and store.head(GROUP).applied_seq == 20
    assert store.restore_verified(_snapshot_at(events, 20), group=GROUP) == 20
    assert store.cursor(GROUP) == 20 and store.head(GROUP).floor_seq == 20


def test_restore_runs_an_application_projections_restore_hook(tmp_path, events):
    """An application projection with ``restore(view, snapshot)`` is called on a restore, inside
    the restoring commit and with a view of the Group (what it writes is there afterwards); one
    without it starts empty for the Group."""

    class Restoring:
        name = "restoring"
        calls: list = []

        def apply(self, view, event):
            view.put(f"e{event.seq}", b"x")

        def restore(self, view, snapshot):
            Restoring.calls.append(snapshot.seq)
            view.put("restored-at", str(snapshot.seq).encode())

    agent = AgentStore.open(tmp_path / "a", projections=[Restoring(), CountingProjection()])
    apply_all(agent, events[:5])
    agent.restore_verified(_snapshot_at(events, 30), group=GROUP)
    assert Restoring.calls == [30]
    assert agent.projection_items(GROUP, "restoring") == [(b"restored-at", b"30")]
    assert agent.projection_items(GROUP, "counter") == []
    apply_all(agent, events[30:32])
    assert agent.projection_get(GROUP, "restoring", "e31") == b"x"
    agent.close()


def test_restore_keeps_buffered_events_after_the_snapshot(tmp_path, events):
    agent = AgentStore.open(tmp_path / "a")
    apply_all(agent, events[:3] + events[30:33])
    agent.restore_verified(_snapshot_at(events, 30), group=GROUP)
    assert agent.cursor(GROUP) == 30
    assert agent.head(GROUP).applied_seq == 33
    with agent.begin() as tx:
        assert tx.advance_cursor(GROUP) == 33
    agent.close()


def test_restore_from_signed_snapshot_bytes(tmp_path, events):
    from mwpstore.snapshot import SigningKey, create_snapshot

    signer = SigningKey.generate()
    view = _snapshot_at(events, 25)
    data = create_snapshot(
        org="org-1", group=GROUP, seq=25, head_hash=view.head_hash, aggregates=view.aggregates, signer=signer,
        created_at_ms=1,
    )
    untrusted = AgentStore.open(tmp_path / "u")
    with pytest.raises(SnapshotInvalid) as info:
        untrusted.restore(data, group=GROUP, org="org-1")
    assert info.value.check == "key"
    assert untrusted.cursor(GROUP) == 0
    untrusted.close()
    agent = AgentStore.open(tmp_path / "a", trusted_keys=[signer.public_key])
    with pytest.raises(InvalidCommand):
        agent.restore(data, group=GROUP)  # the Organization is not known locally yet
    assert agent.restore(data, group=GROUP, org="org-1") == 25
    with pytest.raises(SnapshotInvalid):
        agent.restore(data, group=GROUP, org="org-9")
    tampered = bytearray(data)
    tampered[-3] ^= 1
    with pytest.raises(SnapshotInvalid):
        agent.restore(bytes(tampered), group=GROUP)
    apply_all(agent, events[25:])
    assert agent.cursor(GROUP) == len(events)
    agent.close()


# -- verify="trusted" (Events from an in-process Authority) --------------------------------------


@pytest.mark.parametrize(
    "name", ["wrong event id", "seq as string", "effects not a list", "effect aggregate with NUL", "group is a path",
             "not an Event", "garbage bytes", "broken chain link", "authoritative as int", "hash too short"],
)
def test_trusted_mode_still_rejects_malformed_events(tmp_path, events, name):
    agent = AgentStore.open(tmp_path / "a", verify="trusted")
    _, event, _ = {entry[0]: entry for entry in hostile_events(events)}[name]
    if name == "broken chain link":
        apply_all(agent, events[:1])
    before = agent.projection_dump()
    with agent.begin() as tx:
        with pytest.raises(EventInvalid):
            tx.apply(event)
    assert agent.projection_dump() == before
    agent.close()


def test_trusted_mode_builds_the_same_projection(tmp_path, events):
    full = AgentStore.open(tmp_path / "full", projections=[CountingProjection()])
    trusted = AgentStore.open(tmp_path / "trusted", projections=[CountingProjection()], verify="trusted")
    apply_all(full, events)
    shuffled = events[30:] + events[:30]
    apply_all(trusted, shuffled)
    assert trusted.projection_dump() == full.projection_dump()
    full.close()
    trusted.close()


def test_unknown_verify_mode_is_refused(tmp_path):
    from mwpstore.errors import InvalidCommand

    with pytest.raises(InvalidCommand):
        AgentStore.open(tmp_path / "a", verify="none")


def test_another_process_cannot_open_the_store(tmp_path):
    import subprocess
    import sys
    import os

    agent = AgentStore.open(tmp_path / "a")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from mwpstore.agent_store import AgentStore\n"
        "from mwpstore.errors import StoreLocked\n"
        f"try:\n    AgentStore.open({str(tmp_path / 'a')!r})\nexcept StoreLocked:\n    sys.exit(3)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 3
    agent.close()


def test_nested_begin_in_one_thread_is_refused(store):
    with store.begin():
        with pytest.raises(InvalidCommand):
            store.begin()


@pytest.mark.parametrize("call", ["apply", "record_intent", "advance_cursor", "commit", "abort"])
def test_a_local_transaction_is_refused_in_another_thread_than_the_one_that_began_it(store, events, call):
    """LMDB's write transaction, and the writer lock it holds, belong to the thread that began it.
    Committed or aborted from another thread, the lock stayed held by the first thread, and every
    later local transaction of another thread waited for it for ever. Any call of the local
    transaction from another thread is ``INVALID_COMMAND`` (field ``thread``), and the thread that
    began it can still use and end it."""
    import threading

    calls = {
        "apply": lambda tx: tx.apply(events[0]),
        "record_intent": lambda tx: tx.record_intent(
            GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="notify"
        ),
        "advance_cursor": lambda tx: tx.advance_cursor(GROUP),
        "commit": lambda tx: tx.commit(),
        "abort": lambda tx: tx.abort(),
    }
    tx = store.begin()
    outcome: dict = {}

    def other_thread() -> None:
        try:
            calls[call](tx)
        except BaseException as exc:  # reported to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), InvalidCommand) and outcome["error"].detail["field"] == "thread"
    assert tx.apply(events[0]) is ApplyStatus.APPLIED  # still this thread's, and usable
    tx.advance_cursor(GROUP)
    tx.commit()

    def next_transaction() -> None:
        with store.begin() as later:
            outcome["next"] = later.apply(events[1])

    thread = threading.Thread(target=next_transaction, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and outcome["next"] is ApplyStatus.APPLIED
    assert store.cursor(GROUP) == 1 and store.head(GROUP).applied_seq == 2


def test_a_close_interrupted_while_it_waits_for_a_read_is_finished_by_the_next_close(tmp_path, events, sigint_raises):
    """close() waits for the reads in flight. A KeyboardInterrupt in that wait left the store closed
    to new work but still locked and mapped, and every later close() returned at once."""
    import threading

    from authority_helpers import close_interrupted_while_it_waits

    agent = AgentStore.open(tmp_path / "a")
    with agent.begin() as tx:
        tx.apply(events[0])
    inside, leave = threading.Event(), threading.Event()

    def reader() -> None:
        with agent._read():  # a read in flight (what head(), cursor() and the others hold)
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    assert inside.wait(30)
    close_interrupted_while_it_waits(agent.close, lambda: agent.cursor(GROUP), lambda: AgentStore.open(tmp_path / "a"))
    leave.set()
    thread.join(30)
    assert not thread.is_alive()
    agent.close()
    agent.close()  # idempotent
    again = AgentStore.open(tmp_path / "a")
    assert again.head(GROUP).applied_seq == 1
    again.close()


def test_close_waits_for_a_transaction_in_another_thread_and_refuses_inside_its_own(tmp_path, events):
    import threading

    agent = AgentStore.open(tmp_path / "a")
    opened, finish = threading.Event(), threading.Event()
    applied: list[object] = []

    def writer() -> None:
        with agent.begin() as tx:
            opened.set()
            finish.wait(10)
            applied.append(tx.apply(events[0]))

    thread = threading.Thread(target=writer)
    thread.start()
    assert opened.wait(10)
    closer = threading.Thread(target=agent.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the map stays open under the transaction
    finish.set()
    thread.join(10)
    closer.join(10)
    assert not closer.is_alive() and applied == [ApplyStatus.APPLIED]
    with pytest.raises(StoreClosed):
        agent.cursor(GROUP)
    with pytest.raises(StoreClosed):
        agent.begin()
    again = AgentStore.open(tmp_path / "a")
    assert again.cursor(GROUP) == 0 and again.head(GROUP).applied_seq == 1  # the transaction committed
    with again.begin():
        with pytest.raises(InvalidCommand):
            again.close()
    again.close()


def test_a_begin_that_waited_for_the_write_lock_while_the_store_closed_is_store_closed(tmp_path):
    """``begin`` checks that the store is open, then waits for the write lock (another thread's
    local transaction, or ``close`` itself). If ``close`` took the lock first and closed the
    environment, the waiting ``begin`` must find the store closed when it gets the lock:
    ``STORE_CLOSED``, never a transaction begun on a closed LMDB environment."""
    agent = AgentStore.open(tmp_path / "a")
    waiter = _close_while_another_thread_waits_at_the_write_lock(agent, lambda: agent.begin().abort())
    assert isinstance(waiter.get("error"), StoreClosed), waiter


def test_two_closes_at_once_release_the_store_once(tmp_path):
    """Two threads close one handle at once. Both pass the first check (not released yet) before
    either takes the write lock; the one that gets the lock second must find the store released
    and return, not close the environment and the lock file's descriptor a second time (the
    number may already belong to another open file)."""
    agent = AgentStore.open(tmp_path / "a")
    second = _close_while_another_thread_waits_at_the_write_lock(agent, agent.close)
    assert second == {"done": True}, second
    again = AgentStore.open(tmp_path / "a")  # released: the lock can be taken again
    again.close()


def _close_while_another_thread_waits_at_the_write_lock(agent: AgentStore, call) -> dict:
    """Run ``call`` in another thread, hold it where it reaches the handle's write lock, close the
    handle meanwhile, then let it go on; its outcome: ``{"done": True}`` or ``{"error": exc}``."""
    import threading

    real_lock = agent._write_lock
    at_the_lock, closed = threading.Event(), threading.Event()
    outcome: dict = {}

    class LockSeenWaiting:  # the other thread reaches the lock, and waits there until close() is done
        def acquire(self, *args):
            if threading.current_thread() is thread:
                at_the_lock.set()
                assert closed.wait(30)
            return real_lock.acquire(*args)

        def release(self):
            real_lock.release()

        def __enter__(self):
            return self.acquire()

        def __exit__(self, *exc):
            self.release()

    def run():
        try:
            call()
            outcome["done"] = True
        except BaseException as exc:  # reported to the main thread
            outcome["error"] = exc

    agent._write_lock = LockSeenWaiting()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert at_the_lock.wait(30)
        agent.close()
    finally:
        closed.set()
        thread.join(30)
    assert not thread.is_alive()
    return outcome


@pytest.mark.parametrize("key", [b"short", bytes(32), "00" * 32, 7], ids=["short", "small_order", "hex_text", "int"])
def test_a_trusted_key_that_is_no_usable_public_key_is_refused_at_open(tmp_path, key):
    with pytest.raises(InvalidCommand) as caught:
        AgentStore.open(tmp_path / "a", trusted_keys=[key])
    assert caught.value.detail["field"] == "public_key"
    assert not (tmp_path / "a").exists()  # refused before anything was created


def test_an_interrupt_inside_begin_releases_the_local_transaction(tmp_path, monkeypatch):
    """KeyboardInterrupt inside begin(), once its LMDB write transaction has begun (here at the
    fail point agent.begin), before the caller holds the transaction: the transaction is
    aborted and the store's write lock released. Before, every later begin() in the thread was
    refused as a transaction already open, close() too, and the store stayed locked for every
    later open in the process. The LMDB transaction is aborted by begin() itself, not when the
    last reference to it goes: a caller that keeps the exception (a log of it, say) keeps
    begin()'s frame, and LMDB's writer lock with it, which a transaction in another thread then
    waits for for good."""
    import threading

    path = tmp_path / "a"
    agent = AgentStore.open(path)
    interrupt_once_at(monkeypatch, "agent.begin")
    with pytest.raises(KeyboardInterrupt) as caught:  # kept until the end of the test
        agent.begin()
    assert agent._writer is None and not agent._write_lock.locked()

    def other_thread() -> None:
        with agent.begin() as tx:
            tx.record_intent("g-1", mission="m1", workitem="wi-1", ownership_epoch=1, operation="notify")

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()  # it had the writer lock
    with agent.begin() as tx:  # the handle keeps working in this thread too
        tx.record_intent("g-1", mission="m1", workitem="wi-2", ownership_epoch=1, operation="notify")
    agent.close()
    with AgentStore.open(path) as again:
        assert len(again.intents()) == 2
    assert caught.value is not None


def test_a_local_transaction_that_lmdb_cannot_begin_is_storage_failed_and_holds_nothing(tmp_path, monkeypatch):
    """An LMDB error beginning the write transaction (here: no reader slot left) is the typed
    STORAGE_FAILED, never the foreign error, and the store's write lock is released with it."""
    import lmdb

    from mwpstore.errors import StorageFailed

    agent = AgentStore.open(tmp_path / "a")
    real_begin = agent._tables.begin
    armed = [True]

    def begin(*args, **kwargs):  # type: ignore[no-untyped-def]
        if armed[0]:
            armed[0] = False
            raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")
        return real_begin(*args, **kwargs)

    monkeypatch.setattr(agent._tables, "begin", begin)
    with pytest.raises(StorageFailed):
        agent.begin()
    assert agent._writer is None and not agent._write_lock.locked()
    with agent.begin() as tx:
        tx.record_intent("g-1", mission="m1", workitem="wi-1", ownership_epoch=1, operation="notify")
    agent.close()


def test_an_interrupt_inside_a_cache_flush_fails_the_transaction(tmp_path, events, monkeypatch):
    """apply() writes its cached inbox and states into the transaction once the caches are full.
    An interrupt (KeyboardInterrupt) in that flush, after the cache was emptied and before its
    states were written, caught by the block, must leave the transaction able only to abort: a
    commit would have recorded the Events as applied without their states."""
    from mwpstore import agent_store

    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 4)
    real = agent_store._STATE_ENCODER
    armed = [False]

    class InterruptedEncoder:
        def encode(self, value):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt  # as encode returns: the cached states are no longer cached
            return real.encode(value)

    monkeypatch.setattr(agent_store, "_STATE_ENCODER", InterruptedEncoder())
    agent = AgentStore.open(tmp_path / "a")
    interrupted = False
    with pytest.raises(ProjectionFailed):
        with agent.begin() as tx:
            for event in events[:6]:
                armed[0] = not interrupted
                try:
                    tx.apply(event)
                except KeyboardInterrupt:
                    interrupted = True
                    break
    assert interrupted
    assert agent.head(GROUP).applied_seq == 0 and agent.states(GROUP) == {}
    monkeypatch.undo()
    apply_all(agent, events[:6])  # the handle keeps working
    with AgentStore.open(tmp_path / "b") as reference:
        apply_all(reference, events[:6])
        assert agent.states(GROUP) == reference.states(GROUP) != {}
    agent.close()


def test_a_local_transaction_lost_to_an_interrupt_before_its_block_ends_with_it(tmp_path, monkeypatch):
    """CPython raises a signal's exception (KeyboardInterrupt) as a Python function starts: here
    ``__enter__`` of ``with agent.begin() as tx``, after begin() returned. The block never runs
    and never ends the transaction; dropped by everyone, it must release the store's write lock,
    or every later begin() and close() in the thread is refused and the store stays locked."""
    from mwpstore.agent_store import AgentTransaction

    path = tmp_path / "a"
    agent = AgentStore.open(path)
    real = AgentTransaction.__enter__
    armed = [True]

    def enter(self):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(AgentTransaction, "__enter__", enter)
    with pytest.raises(KeyboardInterrupt):
        with agent.begin():
            pass
    with agent.begin() as tx:  # the handle keeps working
        tx.record_intent("g-1", mission="m1", workitem="wi-1", ownership_epoch=1, operation="notify")
    agent.close()
    with AgentStore.open(path) as again:
        assert len(again.intents()) == 1


def test_a_projection_digest_reads_one_group_head_and_never_holds_the_whole_dump(tmp_path, monkeypatch):
    """An agent following many Groups: the digest of one Group looks up that Group's head instead
    of unsealing every Group's head to find it, and the digest of the whole store hashes the rows
    as it reads them instead of building the dump (every entry of the store) in memory first.
    Both digests stay what the dump says."""
    import tracemalloc

    import blake3

    from mwpstore import _sealed

    groups = [f"g-{n}" for n in range(1000)]
    with AgentStore.open(tmp_path / "a") as agent:
        with agent.begin() as tx:
            tx.apply_many([event for group in groups for event in workload(group, 3, seed=3)])

        def digest_of(rows):  # type: ignore[no-untyped-def]
            hasher = blake3.blake3(b"mwpstore/agent-projection/v1\x00")
            for row in rows:
                for part in (row[0].encode(), row[1], row[2]):
                    hasher.update(len(part).to_bytes(8, "big"))
                    hasher.update(part)
            return hasher.hexdigest()

        dump = agent.projection_dump()
        assert agent.projection_digest() == digest_of(dump)
        assert agent.projection_dump("g-500") == [row for row in dump if row[1].startswith(b"g-500\x00") or row[1] == b"g-500"]
        assert agent.projection_digest("g-500") == digest_of(agent.projection_dump("g-500"))
        assert agent.projection_dump("g-none") == []

        heads = record_unseals(monkeypatch, _sealed.SealedTables, b"heads")
        agent.projection_digest("g-500")
        assert heads == [b"g-500"]  # before: all 1,000 heads
        monkeypatch.undo()

        dump_bytes = sum(len(row[1]) + len(row[2]) for row in dump)
        del dump
        tracemalloc.start()
        try:
            agent.projection_digest()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < dump_bytes // 4  # before: the dump itself, several times its bytes


def test_a_projection_view_kept_past_its_call_is_refused_not_used_on_a_finished_transaction(tmp_path, events):
    """An application projection that keeps its ``ProjectionView``: used from another thread
    while the local transaction runs, it is ``InvalidCommand`` (field ``thread``: LMDB's write
    transaction belongs to the thread that began it); used once the transaction has ended, every
    method is ``StoreClosed``. Before, the view went on to the finished LMDB transaction."""
    import threading

    kept = []

    class Keeping:
        name = "keeping"

        def apply(self, view, event):
            view.put(f"seen:{event.seq}", b"1")
            kept.append(view)

    agent = AgentStore.open(tmp_path / "agent", projections=[Keeping()])
    try:
        other: list[BaseException] = []
        with agent.begin() as tx:
            tx.apply(events[0])
            view = kept[0]
            assert view.get("seen:1") == b"1" and list(view.items("seen:")) == [(b"seen:1", b"1")]
            worker = threading.Thread(target=lambda: other.append(pytest.raises(InvalidCommand, view.get, "seen:1").value))
            worker.start()
            worker.join(30)
            rows = view.items()
            assert next(rows) == (b"seen:1", b"1")
            tx.advance_cursor(GROUP)
        assert other and other[0].detail["field"] == "thread"
        for use in (lambda: view.get("seen:1"), lambda: view.put("x", b"y"), lambda: view.delete("seen:1"),
                    lambda: list(view.items()), lambda: view.state(f"group:{GROUP}"), lambda: next(rows)):
            with pytest.raises(StoreClosed):
                use()
        assert agent.projection_get(GROUP, "keeping", "seen:1") == b"1"
        assert agent.projection_get(GROUP, "keeping", "x") is None
    finally:
        agent.close()


@pytest.mark.parametrize("method", ["projection_dump", "projection_digest"])
def test_a_projection_digest_checks_its_group_and_types_damage_as_the_dump_does(tmp_path, events, monkeypatch, method):
    """The digest reads the rows itself (not through projection_dump): a Group that is no ID is
    INVALID_COMMAND before anything is read, and what a damaged page raises while the rows are
    read is CORRUPTION, never a foreign error."""
    import lmdb

    from mwpstore.errors import Corruption

    with AgentStore.open(tmp_path / "a") as agent:
        apply_all(agent, events[:3])
        for bad in ("", "g 1", "g-1\x00", 5):
            with pytest.raises(InvalidCommand) as refused:
                getattr(agent, method)(bad)
            assert refused.value.detail["field"] == "group"

        def damaged(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED")

        monkeypatch.setattr(agent._tables, "range", damaged)
        for group in (None, GROUP):
            with pytest.raises(Corruption):
                getattr(agent, method)(group)
