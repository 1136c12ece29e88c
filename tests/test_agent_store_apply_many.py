"""``apply_many`` in trusted mode takes plain in-order runs in C (``mwpstore._apply_c``): it must
give exactly what a loop of ``apply`` gives — statuses, errors at the same Events, projections,
buffers and Cursors — whatever the delivery schedule."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_store_support import ChainBuilder, workload
from mwpstore import _apply_c, _canonical_c, agent_store
from mwpstore.agent_store import AgentStore, ApplyStatus
from mwpstore.errors import EventInvalid, MwpError, ProjectionFailed
from mwpstore.messages import Effect, Event, recompute_event_hash

GROUPS = ("g-1", "g-2")
EVENTS = {group: workload(group, 40, seed=index + 5) for index, group in enumerate(GROUPS)}


def _rehash(event: Event, **changes) -> Event:
    changed = msgspec.structs.replace(event, **changes)
    return msgspec.structs.replace(changed, hash=recompute_event_hash(changed))


class _SubEffect(Effect):
    pass


def _spoiled(event: Event, how: int) -> Event:
    """A malformed copy of ``event`` (trusted mode refuses all but ``how == 8``; the schedules
    below draw from the first 14)."""
    if how == 0:
        return msgspec.structs.replace(event, seq=str(event.seq))
    if how == 1:
        return msgspec.structs.replace(event, event_id=f"{event.group}:{event.seq + 1}")
    if how == 2:
        return msgspec.structs.replace(event, prev_hash=bytes(32))
    if how == 3:
        return msgspec.structs.replace(event, effects=[Effect("no-colon", 1, {})])
    if how == 4:
        return msgspec.structs.replace(event, authoritative=1)
    if how == 5:
        return msgspec.structs.replace(event, effects=[("workitem:x", 1, None)])
    if how == 6:
        return msgspec.structs.replace(event, body=[1])
    if how == 7:
        return msgspec.structs.replace(event, event_id=f"{event.group};{event.seq}")
    if how == 9:
        return msgspec.structs.replace(event, effects=[Effect("workitem:x", 1, [1])])  # a state that is no dict
    if how == 10:
        return msgspec.structs.replace(event, hash=event.hash[:31])
    if how == 11:  # the right Event ID with one more digit
        return msgspec.structs.replace(event, event_id=f"{event.group}:{event.seq}0")
    if how == 12:  # the link to the right previous hash, but for its last byte
        return msgspec.structs.replace(event, prev_hash=event.prev_hash[:31] + bytes([event.prev_hash[31] ^ 1]))
    if how == 13:  # the same effects, as instances of a subclass of Effect
        return msgspec.structs.replace(event, effects=[_SubEffect(e.aggregate, e.revision, e.state) for e in event.effects])
    if how == 14:  # each field the C run checks the type of, of another type
        return msgspec.structs.replace(event, revision=True)
    if how == 15:
        return msgspec.structs.replace(event, accepted_at_ms=str(event.accepted_at_ms))
    if how == 16:
        return msgspec.structs.replace(event, kind=None)
    if how == 17:
        return msgspec.structs.replace(event, aggregate=None)
    if how == 18:
        return msgspec.structs.replace(event, effects=tuple(event.effects))
    # the same hash over a changed body: only full validation (the payload hash) refuses it
    return msgspec.structs.replace(event, body={"forged": True})


@st.composite
def schedules(draw):
    """Delivery of both Groups' Events: interleaved, with duplicates, reorders, gaps and spoiled
    copies, cut into local transactions."""
    items = []
    for group in GROUPS:
        events = EVENTS[group]
        count = draw(st.integers(1, len(events)))
        items.extend(("ok", event) for event in events[:count])
    items = draw(st.permutations(items)) if draw(st.booleans()) else sorted(items, key=lambda item: item[1].seq)
    extra = draw(st.lists(st.tuples(st.integers(0, len(items)), st.sampled_from(GROUPS), st.integers(0, 39), st.integers(-1, 13)), max_size=8))
    for position, group, seq_index, how in extra:
        event = EVENTS[group][seq_index]
        items.insert(position, ("ok", event) if how < 0 else ("spoiled", _spoiled(event, how)))
    cuts = sorted(draw(st.lists(st.integers(0, len(items)), max_size=4)))
    chunks, start = [], 0
    for cut in cuts + [len(items)]:
        chunks.append(items[start:cut])
        start = cut
    return chunks


def _assert_same_as_one_by_one(agent, path, events, verify="trusted", apply=None):
    """``agent`` holds what applying ``events`` with ``apply`` one by one in a fresh store gives."""
    reference = AgentStore.open(path, verify=verify)
    with reference.begin() as tx:
        for event in events:
            (apply or agent_store.AgentTransaction.apply)(tx, event)
        tx.advance_cursor(events[0].group)
    assert agent.projection_dump() == reference.projection_dump()
    agent.close()
    reference.close()


def _outcome(call, event_or_events):
    try:
        return call(event_or_events)
    except MwpError as exc:
        return type(exc).__name__


def _run_one_by_one(path, chunks, verify="trusted"):
    outcomes = []
    agent = AgentStore.open(path, verify=verify)
    for chunk in chunks:
        with agent.begin() as tx:
            outcomes.extend(_outcome(tx.apply, event) for _, event in chunk)
            for group in GROUPS:
                tx.advance_cursor(group)
    return agent, outcomes


def _run_many(path, chunks, verify="trusted"):
    """apply_many over the runs between the Events that may raise, each of which goes alone."""
    outcomes = []
    agent = AgentStore.open(path, verify=verify)
    for chunk in chunks:
        with agent.begin() as tx:
            run: list[Event] = []
            for kind, event in chunk + [("end", None)]:
                if kind == "ok":
                    run.append(event)
                    continue
                if run:
                    outcomes.extend(tx.apply_many(run))
                    run = []
                if event is not None:
                    result = _outcome(tx.apply_many, [event])
                    outcomes.extend(result if isinstance(result, list) else [result])
            for group in GROUPS:
                tx.advance_cursor(group)
    return agent, outcomes


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=schedules(), verify=st.sampled_from(["trusted", "full"]))
def test_apply_many_equals_apply_one_by_one(tmp_path_factory, chunks, verify):
    base = tmp_path_factory.mktemp("many")
    one, one_outcomes = _run_one_by_one(base / "one", chunks, verify)
    many, many_outcomes = _run_many(base / "many", chunks, verify)
    try:
        assert many_outcomes == one_outcomes
        assert many.projection_dump() == one.projection_dump()
        for group in GROUPS:
            assert many.head(group) == one.head(group)
            assert many.buffered_seqs(group) == one.buffered_seqs(group)
            assert many.inbox_seqs(group) == one.inbox_seqs(group)
    finally:
        one.close()
        many.close()


def test_apply_many_takes_in_order_runs_without_calling_apply(tmp_path, monkeypatch):
    events = EVENTS["g-1"]
    calls = []
    original = agent_store.AgentTransaction.apply
    monkeypatch.setattr(agent_store.AgentTransaction, "apply", lambda self, event: calls.append(event) or original(self, event))
    agent = AgentStore.open(tmp_path / "a", verify="trusted")
    with agent.begin() as tx:
        assert tx.apply_many(events) == [ApplyStatus.APPLIED] * len(events)
        tx.advance_cursor("g-1")
    assert calls == [events[0]]  # the first one loads the head; the C run took the rest
    _assert_same_as_one_by_one(agent, tmp_path / "r", events, apply=original)


def test_an_aggregate_key_the_c_run_refuses_is_left_to_apply_which_refuses_it_too(tmp_path, monkeypatch):
    """The C run bounds an aggregate key's type as a kind (kind_ok) and leaves a key it does not
    take to apply(), which applies the same rule: the Event is refused, whichever path sees it.
    (apply() once bounded only the whole key, and took this one.)"""
    chain = ChainBuilder("g-3")
    chain.event("group.create", "group:g-3", {"group:g-3": {"org": "o"}})
    chain.event("mission.create", "mission:m1", {"mission:m1": {"n": 1}})
    long_type = "k" * 100 + ":x"
    chain.event("custom.kind", long_type, {long_type: {"n": 2}})
    calls = []
    original = agent_store.AgentTransaction.apply
    monkeypatch.setattr(agent_store.AgentTransaction, "apply", lambda self, event: calls.append(event.seq) or original(self, event))
    with AgentStore.open(tmp_path / "a", verify="trusted") as agent:
        with agent.begin() as tx:
            with pytest.raises(EventInvalid) as caught:
                tx.apply_many(chain.events)
            tx.advance_cursor("g-3")
        assert caught.value.detail["reason"] == "effects"
        assert calls == [1, 3]  # a new Group's first Event is apply()'s; the C run took 2 and stopped before 3
        # the transaction commits what came before the refused Event, and nothing of it
        assert agent.states("g-3") == {"group:g-3": {"org": "o"}, "mission:m1": {"n": 1}}
        assert agent.cursor("g-3") == 2


def test_apply_many_flushes_when_the_write_cache_fills(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 7)
    flushes = []
    original = agent_store.AgentTransaction._flush
    monkeypatch.setattr(agent_store.AgentTransaction, "_flush", lambda self: flushes.append(1) or original(self))
    agent = AgentStore.open(tmp_path / "a", verify="trusted")
    with agent.begin() as tx:
        tx.apply_many(EVENTS["g-1"])
        tx.advance_cursor("g-1")
    assert len(flushes) > 5
    _assert_same_as_one_by_one(agent, tmp_path / "r", EVENTS["g-1"])


def test_an_error_inside_the_c_run_leaves_the_transaction_only_abortable(tmp_path, monkeypatch):
    def failing(value):
        raise MemoryError("simulated")

    agent_store._CHECKED_AGGREGATES.clear()  # so the run must check a new aggregate key
    monkeypatch.setattr(agent_store, "_RUN_CONTEXT", (Event, Effect, agent_store._CHECKED_AGGREGATES, 10, failing, _canonical_c.id_ok, msgspec.structs.astuple))
    agent = AgentStore.open(tmp_path / "a", verify="trusted")
    with pytest.raises(ProjectionFailed):
        with agent.begin() as tx:
            with pytest.raises(MemoryError):
                tx.apply_many(EVENTS["g-1"])
            with pytest.raises(ProjectionFailed):
                tx.apply(EVENTS["g-1"][1])
    assert agent.cursor("g-1") == 0 and agent.projection_dump() == []  # nothing was committed
    agent.close()


def test_the_c_run_refuses_malformed_arguments():
    events = EVENTS["g-1"]
    context = (Event, Effect, set(), 10, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple)
    good = [events, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 100]
    assert _apply_c.run(*good) == len(events)
    for position, bad in [(0, tuple(events)), (2, context[:6]), (2, (*context[:6], None)), (3, b"g-1"), (6, b"short"), (7, []), (9, "100")]:
        arguments = list(good)
        arguments[position] = bad
        with pytest.raises(TypeError):
            _apply_c.run(*arguments)
    with pytest.raises(TypeError):  # refused before any Event is looked at, with none to take
        _apply_c.run(events, len(events), (*context[:6], None), "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 100)
    with pytest.raises(ValueError):
        _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 0, events[0].hash, {}, {}, 100)
    with pytest.raises(TypeError):
        _apply_c.run(events)


def test_the_c_run_survives_predicates_that_change_its_list():
    events = list(EVENTS["g-1"])

    def clearing(value):
        events.clear()  # drops the list's references to the Events being checked
        return True

    context = (Event, Effect, set(), 10, clearing, _canonical_c.id_ok, msgspec.structs.astuple)
    inbox: dict = {}
    # The Event being checked is held by the run; the list ends early: it stops there.
    assert _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 2, EVENTS["g-1"][0].hash, inbox, {}, 100) == 2
    assert list(inbox.values()) == [EVENTS["g-1"][1].hash]


def test_the_c_run_stops_at_the_first_event_apply_must_decide():
    events = EVENTS["g-1"]
    context = (Event, Effect, set(), 10, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple)
    for how in [*range(8), *range(9, 19)]:
        spoiled = events[:5] + [_spoiled(events[5], how)] + events[6:]
        inbox: dict = {}
        states: dict = {}
        assert _apply_c.run(spoiled, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, inbox, states, 10_000) == 5, how
        assert sorted(inbox) == [b"g-1\x00" + seq.to_bytes(8, "big") for seq in range(2, 6)]
    other_group = events[:3] + [msgspec.structs.replace(events[3], group="g-2")]
    assert _apply_c.run(other_group, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 100) == 3
    assert _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 3, events[0].hash, {}, {}, 100) == 1  # not the next seq


def test_an_aggregate_key_the_c_run_refuses_is_not_remembered_as_checked(tmp_path):
    """The C run shares the set of aggregate keys already found valid with apply(): a key it
    refuses must not land there, or apply() would take it as checked afterwards."""
    events = EVENTS["g-1"]
    for index, key in enumerate(("A:1", "a:", ":x", "a:.x")):
        agent_store._CHECKED_AGGREGATES.discard(key)
        bad = msgspec.structs.replace(events[2], effects=[Effect(key, 1, {})])
        with AgentStore.open(tmp_path / f"a{index}", verify="trusted") as agent:
            with agent.begin() as tx:
                with pytest.raises(EventInvalid):
                    tx.apply_many(events[:2] + [bad])  # the C run takes events[1], refuses bad
                assert tx.applied_seq("g-1") == 2
            assert key not in agent_store._CHECKED_AGGREGATES
            with agent.begin() as tx:
                with pytest.raises(EventInvalid):
                    tx.apply(bad)
            assert agent.head("g-1").applied_seq == 2


def test_the_c_run_stops_right_after_the_event_that_fills_the_write_cache():
    events = EVENTS["g-1"]
    context = (Event, Effect, set(), 10, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple)
    filled: set[bytes] = set()  # the cache entries after each Event from events[1] on
    sizes = []
    for event in events[1:8]:
        filled.add(b"inbox" + event.seq.to_bytes(8, "big"))
        filled.update(effect.aggregate.encode() for effect in event.effects)
        sizes.append(len(filled))
    for taken, size in enumerate(sizes, start=1):
        stop = _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, size)
        assert stop == 1 + taken, (taken, size)


def test_full_verification_checks_each_event_of_a_run_before_the_c_run_takes_it(tmp_path):
    events = EVENTS["g-1"]
    forged = msgspec.structs.replace(events[3], body={"forged": True})  # only full verification sees it
    agent = AgentStore.open(tmp_path / "a")
    with agent.begin() as tx:
        with pytest.raises(EventInvalid) as caught:
            tx.apply_many(events[:3] + [forged] + events[4:])
        assert caught.value.detail["reason"] == "payload_hash"
        assert tx.applied_seq("g-1") == 3  # the Events before it stay applied, as in a loop
        assert tx.apply_many(events[3:]) == [ApplyStatus.APPLIED] * (len(events) - 3)
        tx.advance_cursor("g-1")
    _assert_same_as_one_by_one(agent, tmp_path / "r", events, verify="full")


def test_with_an_application_projection_apply_many_is_a_loop_of_apply(tmp_path, monkeypatch):
    from agent_store_support import CountingProjection

    calls = []
    original = agent_store.AgentTransaction.apply
    monkeypatch.setattr(agent_store.AgentTransaction, "apply", lambda self, event: calls.append(event) or original(self, event))
    agent = AgentStore.open(tmp_path / "a", projections=[CountingProjection()], verify="trusted")
    with agent.begin() as tx:
        tx.apply_many(EVENTS["g-1"])
        tx.advance_cursor("g-1")
    assert calls == EVENTS["g-1"]  # every Event reaches the projection through apply
    agent.close()


def test_deliver_batch_ends_the_batch_on_a_state_that_cannot_be_stored(tmp_path, monkeypatch):
    """Trusted mode finds a state that cannot be stored when the write cache is flushed, which
    may be in the middle of a batch, and the flush fails the transaction. ``deliver_batch`` took
    that ``EventInvalid`` for one Event's rejection: it counted it, skipped an Event and went on,
    and the next apply met the failed transaction (``PROJECTION_FAILED``). A rejection that has
    failed the transaction ends the batch with its own error; nothing is applied. (Delivered as
    bytes, such an Event is refused on its own when it is decoded, before it is applied.)"""
    from mwpstore.delivery import DeliveryStats, deliver_batch

    monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 4)  # a flush every few Events
    events = workload("g-1", 12, seed=5)  # Event 3's aggregate (a Membership) is written once
    events[2] = msgspec.structs.replace(events[2], effects=[Effect(events[2].effects[0].aggregate, 1, {1: "x"})])
    with AgentStore.open(tmp_path / "a", verify="trusted") as agent:
        stats = DeliveryStats()
        with pytest.raises(EventInvalid) as caught:
            deliver_batch(agent, "g-1", events, stats)
        assert caught.value.detail["reason"] == "state"
        assert (stats.rejected, agent.cursor("g-1"), agent.projection_dump()) == (0, 0, [])
        assert deliver_batch(agent, "g-1", workload("g-1", 12, seed=5)) == 12  # the store takes the next batch


def test_trusted_mode_refuses_unstorable_content_with_a_typed_error_and_commits_nothing(tmp_path):
    """Trusted mode does not walk content; what cannot be stored is still a typed error, found
    when the state is encoded (at the latest when the transaction commits), never half-written."""
    events = EVENTS["g-1"]
    state_with_int_key = msgspec.structs.replace(events[1], effects=[Effect(events[1].effects[0].aggregate, 1, {1: "x"})])
    agent = AgentStore.open(tmp_path / "a", verify="trusted")
    for apply in ("apply", "apply_many"):
        with pytest.raises(EventInvalid) as caught:
            with agent.begin() as tx:
                call = tx.apply if apply == "apply" else (lambda event: tx.apply_many([event]))
                call(events[0])
                call(state_with_int_key)
        assert caught.value.detail["reason"] == "state"
        assert agent.cursor("g-1") == 0 and agent.projection_dump() == []
    # Beyond a gap, encoded to be buffered: bytes that would not encode, or not decode back as an Event.
    not_content = msgspec.structs.replace(events[5], body={"s": object()})
    int_key_body = msgspec.structs.replace(events[6], body={1: "x"})
    with agent.begin() as tx:
        for event, reason in ((not_content, "type"), (int_key_body, "decode")):
            with pytest.raises(EventInvalid) as caught:
                tx.apply(event)
            assert caught.value.detail["reason"] == reason
        assert tx.apply_many(events[:3]) == [ApplyStatus.APPLIED] * 3  # the transaction stays usable
        tx.advance_cursor("g-1")
    assert agent.cursor("g-1") == 3 and agent.buffered_seqs("g-1") == []
    agent.close()


@pytest.mark.parametrize("verify", ["trusted", "full"])
def test_deliver_batch_through_apply_many_counts_and_skips_rejected_events_like_one_by_one(tmp_path, verify):
    from mwpstore.delivery import DeliveryStats, deliver_batch

    events = EVENTS["g-1"]
    batch = events[:4] + [_spoiled(events[4], 2)] + events[4:9] + events[2:3] + [_spoiled(events[9], 8)] + events[11:15]
    batch += [_spoiled(events[15], 0), events[9], events[10]]
    agent = AgentStore.open(tmp_path / "a", verify=verify)
    stats = DeliveryStats()
    cursor = deliver_batch(agent, "g-1", batch, stats)
    reference = AgentStore.open(tmp_path / "r", verify=verify)
    expected = DeliveryStats()
    with reference.begin() as tx:
        for event in batch:
            expected.received += 1
            try:
                expected.add(tx.apply(event))
            except EventInvalid as exc:
                expected.rejected += 1
                expected.rejections.append(exc)
        expected_cursor = tx.advance_cursor("g-1")
    assert (cursor, stats.received, stats.applied, stats.duplicates, stats.buffered, stats.rejected) == (
        expected_cursor, expected.received, expected.applied, expected.duplicates, expected.buffered, expected.rejected)
    assert [type(exc) for exc in stats.rejections] == [type(exc) for exc in expected.rejections]
    assert stats.rejected == (3 if verify == "full" else 2) and cursor == 15
    assert agent.projection_dump() == reference.projection_dump()
    assert agent.buffered_seqs("g-1") == reference.buffered_seqs("g-1")
    agent.close()
    reference.close()


def test_a_batch_of_many_groups_hands_each_run_only_its_own_events(tmp_path, monkeypatch):
    """With full validation each run handed to the C ``run`` is the Events ``check_run`` passed,
    not a copy of the batch from its start to the run's end: over a batch of many Groups (many
    short runs) those copies made apply_many quadratic in the batch's length."""
    groups = [f"g-{n}" for n in range(300)]
    histories = [workload(group, 3, seed=7) for group in groups]
    events = [event for history in histories for event in history]
    per_group = len(histories[0])
    assert all(len(history) == per_group >= 3 for history in histories)
    handed = []
    run = agent_store._apply_run

    def measured_run(events_, start, *args):  # type: ignore[no-untyped-def]
        handed.append(len(events_))  # what the list handed holds, not what is taken from it
        return run(events_, start, *args)

    monkeypatch.setattr(agent_store, "_apply_run", measured_run)
    with AgentStore.open(str(tmp_path / "agent")) as agent:
        assert agent.verify == "full"
        with agent.begin() as tx:
            assert tx.apply_many(events) == [ApplyStatus.APPLIED] * len(events)
        assert [agent.head(group).applied_seq for group in groups] == [per_group] * len(groups)
    assert len(handed) == len(groups)  # one run per Group: its Events after the first
    assert sum(handed) == (per_group - 1) * len(groups)  # before: each run also held every later Event


def test_the_c_run_reads_each_events_fields_with_one_astuple_call():
    """The run reads an Event's fields by position from one astuple call (the F_ order of
    csrc/agent_apply.c): a result that is not a tuple of 16 makes apply() decide that Event, an
    error of the call propagates."""
    events = EVENTS["g-1"]
    calls = []

    def astuple_of(wrong_at=None, wrong=None):
        def astuple(event):
            calls.append(event.seq)
            fields = msgspec.structs.astuple(event)
            if event.seq == wrong_at:
                if isinstance(wrong, BaseException):
                    raise wrong
                return wrong(fields)
            return fields

        return (Event, Effect, set(), 10, _canonical_c.kind_ok, _canonical_c.id_ok, astuple)

    assert Event.__struct_fields__[12] == "effects" and Event.__struct_fields__[15] == "hash"
    assert _apply_c.run(events, 1, astuple_of(), "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 10_000) == len(events)
    assert calls == [event.seq for event in events[1:]]
    for wrong in (lambda fields: fields[:-1], lambda fields: (*fields, None), list):
        assert _apply_c.run(events, 1, astuple_of(4, wrong), "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 10_000) == 3
    with pytest.raises(MemoryError):
        _apply_c.run(events, 1, astuple_of(4, MemoryError()), "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 10_000)


@pytest.mark.parametrize("count", [1, 7, 8, 9, 20])
def test_the_c_run_writes_every_effect_of_an_event_with_many(count):
    """The checks keep the aggregate and state of an Event's first effects (AA_EFFECTS_HELD, 8) for
    the writes, which read the others again: every effect is written, in order (a later effect of
    the same aggregate is the one kept), and an Event whose last effect fails a check writes
    nothing and holds nothing (the run stops before it)."""
    events = list(EVENTS["g-1"][:3])
    effects = [Effect(f"workitem:e{index % 5 if index >= 10 else index}", index + 1, {"n": index} if index % 3 else None)
               for index in range(count)]
    events[1] = msgspec.structs.replace(events[1], effects=effects)
    events[2] = msgspec.structs.replace(events[2], prev_hash=events[1].hash)
    context = (Event, Effect, set(), 10, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple)
    states: dict = {}
    assert _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, {}, states, 10_000) == 3
    expected = {b"g-1\x00" + effect.aggregate.encode(): (effect.revision, effect.state) for effect in effects}
    expected.update({b"g-1\x00" + effect.aggregate.encode(): (effect.revision, effect.state) for effect in events[2].effects})
    assert states == expected
    for effect in effects:
        assert states[b"g-1\x00" + effect.aggregate.encode()][1] is expected[b"g-1\x00" + effect.aggregate.encode()][1]
    spoiled = [*events[:1], msgspec.structs.replace(events[1], effects=[*effects, Effect("workitem:z", 1, [1])])]
    states = {}
    inbox: dict = {}
    assert _apply_c.run(spoiled, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, inbox, states, 10_000) == 1
    assert inbox == {} and states == {}
