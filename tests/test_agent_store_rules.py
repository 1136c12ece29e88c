"""AgentStore rules pinned one by one: what the built-in projection writes, the work queue's keys
and answers, application projections and their registration, the apply cycle's type checks, the
Cursor, and what the projection dump and digest cover."""

from __future__ import annotations

import msgspec
import pytest

from agent_store_support import ChainBuilder, apply_all, workitem_state, workload
from mwpstore import limits
from mwpstore.agent_store import AGGREGATE_CHARS_MAX, PROJECTION_KEY_BYTES_MAX, AgentStore, ApplyStatus, ProjectionFailed, QueueEntry
from mwpstore.errors import EventInvalid, InvalidCommand, LimitExceeded, StoreClosed
from mwpstore.messages import Effect, Event, recompute_event_hash

GROUP = "g-1"


@pytest.fixture
def agent(tmp_path):
    store = AgentStore.open(tmp_path / "agent")
    yield store
    store.close()


def _rehash(event: Event, **changes) -> Event:
    changed = msgspec.structs.replace(event, **changes)
    return msgspec.structs.replace(changed, hash=recompute_event_hash(changed))


def queued(**fields) -> dict:
    return {**workitem_state("m1", "queued"), **fields}


def listed(agent, now_ms=10**12, group=GROUP):
    return [entry.workitem for entry in agent.work_queue(group, now_ms)]


# -- the built-in projection ------------------------------------------------------------------


def test_each_effect_is_mirrored_with_its_own_revision_and_state(agent):
    """An Event's effects are written as they are: every aggregate it names with the effect's own
    revision (not the Event's), and None for a removed aggregate, whose revision stays known."""
    chain = ChainBuilder(GROUP)
    chain.event("mission.create", "mission:m1", {"mission:m1": {"status": "open"}})
    chain.event("mission.update", "mission:m1", {"mission:m1": {"status": "open", "n": 1}})
    event = chain.event(
        "workitem.create",
        "workitem:w1",
        {"workitem:w1": queued(), "mission:m1": {"status": "open", "n": 2}, "approval:a1": {"state": "pending"}},
    )
    assert [(effect.aggregate, effect.revision) for effect in event.effects] == [
        ("approval:a1", 1), ("mission:m1", 3), ("workitem:w1", 1)]
    assert event.revision == 1  # the Event's own aggregate's revision differs from the Mission's
    chain.event("approval.drop", "approval:a1", {"approval:a1": None})
    apply_all(agent, chain.events)
    assert agent.aggregate(GROUP, "mission:m1") == (3, {"status": "open", "n": 2})
    assert agent.aggregate(GROUP, "workitem:w1") == (1, queued())
    assert agent.aggregate(GROUP, "approval:a1") == (2, None)
    assert agent.aggregate(GROUP, "approval:never") == (0, None)
    assert agent.revision(GROUP, "approval:never") == 0
    # states() lists live aggregates only: a removed one is not there
    assert agent.states(GROUP) == {"mission:m1": {"status": "open", "n": 2}, "workitem:w1": queued()}


def test_reads_inside_the_transaction_and_projections_see_the_event_being_applied(tmp_path):
    """``ProjectionView.state`` is the mirror already updated by the Event being applied, and the
    transaction's own reads see every Event applied earlier in it (before anything is flushed)."""
    seen = []

    class Watching:
        name = "watching"

        def apply(self, view, event):
            seen.append((event.seq, view.state(event.aggregate)))

    chain = ChainBuilder(GROUP)
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": queued()})
    chain.event("workitem.block", "workitem:w1", {"workitem:w1": workitem_state("m1", "blocked")})
    chain.event("workitem.drop", "workitem:w1", {"workitem:w1": None})
    with AgentStore.open(tmp_path / "a", projections=[Watching()]) as agent:
        with agent.begin() as tx:
            tx.apply(chain.events[0])
            assert tx.state(GROUP, "workitem:w1") == queued() and tx.revision(GROUP, "workitem:w1") == 1
            tx.apply(chain.events[1])
            assert tx.state(GROUP, "workitem:w1")["state"] == "blocked" and tx.revision(GROUP, "workitem:w1") == 2
            tx.apply(chain.events[2])
            assert tx.state(GROUP, "workitem:w1") is None and tx.revision(GROUP, "workitem:w1") == 3
        assert seen == [(1, queued()), (2, workitem_state("m1", "blocked")), (3, None)]


# -- the work queue ---------------------------------------------------------------------------


def _queue_rows(agent, group=GROUP):
    return [(name, key) for name, key, _ in agent.projection_dump(group) if name in ("queue", "queue_index")]


def test_a_workitem_that_leaves_the_queue_leaves_no_queue_key_behind(agent):
    """Leased, blocked, removed: the WorkItem's queue entry and its queue index entry both go,
    so the dump (and digest) equals that of a store that never queued it."""
    chain = ChainBuilder(GROUP)
    for name in ("w1", "w2", "w3"):
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": queued()})
    apply_all(agent, chain.events)
    assert len(_queue_rows(agent)) == 6
    chain.event("workitem.claim", "workitem:w1", {"workitem:w1": workitem_state("m1", "leased", ownership_epoch=1)})
    chain.event("workitem.block", "workitem:w2", {"workitem:w2": workitem_state("m1", "blocked")})
    chain.event("workitem.drop", "workitem:w3", {"workitem:w3": None})
    apply_all(agent, chain.events[3:])
    assert listed(agent) == [] and _queue_rows(agent) == []
    chain.event("workitem.resolve", "workitem:w2", {"workitem:w2": queued(priority=4)})
    apply_all(agent, chain.events[6:])
    assert listed(agent) == ["w2"]
    assert [name for name, _ in _queue_rows(agent)] == ["queue", "queue_index"]


def test_queue_entries_report_the_priority_and_not_before_time_stored(agent):
    chain = ChainBuilder(GROUP)
    specs = {"w1": (7, 300), "w2": (-4, -50), "w3": (0, 0), "w4": (limits.INT_ABS_MAX, 1), "w5": (-limits.INT_ABS_MAX, 2)}
    for name, (priority, not_before) in specs.items():
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": queued(priority=priority, not_before_ms=not_before)})
    apply_all(agent, chain.events)
    assert agent.work_queue(GROUP, 1_000) == [
        QueueEntry("w4", limits.INT_ABS_MAX, 1), QueueEntry("w1", 7, 300), QueueEntry("w3", 0, 0),
        QueueEntry("w2", -4, -50), QueueEntry("w5", -limits.INT_ABS_MAX, 2),
    ]


def test_missing_priority_and_not_before_count_as_zero(agent):
    """A queued WorkItem without ``priority`` ranks as priority 0 and one without (or with a None)
    ``not_before_ms`` is ready at once."""
    chain = ChainBuilder(GROUP)
    no_priority = queued()
    del no_priority["priority"]
    no_not_before = queued(priority=0)
    del no_not_before["not_before_ms"]
    chain.event("workitem.create", "workitem:a", {"workitem:a": no_priority})
    chain.event("workitem.create", "workitem:b", {"workitem:b": no_not_before})
    chain.event("workitem.create", "workitem:c", {"workitem:c": queued(not_before_ms=None)})
    chain.event("workitem.create", "workitem:d", {"workitem:d": queued(priority=1)})
    chain.event("workitem.create", "workitem:e", {"workitem:e": queued(priority=-1)})
    apply_all(agent, chain.events)
    assert agent.work_queue(GROUP, 0) == [
        QueueEntry("d", 1, 0), QueueEntry("a", 0, 0), QueueEntry("b", 0, 0), QueueEntry("c", 0, 0), QueueEntry("e", -1, 0)]


def test_a_priority_or_not_before_that_is_no_64_bit_int_is_no_queue_entry(tmp_path):
    """Content a trusted delivery did not walk may hold anything: a priority or not-before time
    that is not an int (a bool, a float, a str) or is outside -(2**63 - 1)..2**63 - 1 (priority) or
    -2**63..2**63 - 1 (not-before) gives no queue entry, and the commit succeeds (no key overflows
    its 8 bytes). Smaller ints cannot be encoded at all."""
    odd = {
        "bool": dict(priority=True), "float": dict(priority=1.0), "str": dict(priority="1"),
        "p_high": dict(priority=2**63), "p_low": dict(priority=-(2**63)),
        "nb_high": dict(not_before_ms=2**63),
        "nb_float": dict(not_before_ms=1.5), "nb_bool": dict(not_before_ms=True),
    }
    chain = ChainBuilder(GROUP)
    for name, fields in odd.items():
        state = queued(**fields)
        chain.event("workitem.create", f"workitem:{name}", {f"workitem:{name}": state}, body={})
    chain.event("workitem.create", "workitem:edge", {"workitem:edge": queued(not_before_ms=-(2**63))})
    with AgentStore.open(tmp_path / "a", verify="trusted") as agent:
        for event in chain.events:
            with agent.begin() as tx:
                assert tx.apply(event) is ApplyStatus.APPLIED
                tx.advance_cursor(GROUP)
        assert agent.cursor(GROUP) == len(chain.events)
        assert agent.work_queue(GROUP, 0) == [QueueEntry("edge", 0, -(2**63))]
        assert [key for name, key in _queue_rows(agent) if name == "queue_index"] == [b"g-1\x00edge"]


@pytest.mark.parametrize("limit", [0, -1, True, 1.0, "1"])
def test_a_work_queue_limit_that_is_no_count_from_one_is_refused(agent, limit):
    chain = ChainBuilder(GROUP)
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": queued()})
    apply_all(agent, chain.events)
    with pytest.raises(InvalidCommand) as caught:
        agent.work_queue(GROUP, 0, limit=limit)
    assert caught.value.detail["field"] == "limit"


def test_a_workitem_without_a_mission_or_of_a_mission_without_status_stays_listed(agent):
    """Only a Mission whose mirrored status is something else than ``open`` takes its work out
    of the queue: no Mission named, a Mission the mirror does not hold, or one without a status
    field prove nothing."""
    chain = ChainBuilder(GROUP)
    chain.event("mission.create", "mission:bare", {"mission:bare": {"title": "no status"}})
    chain.event("mission.create", "mission:shut", {"mission:shut": {"status": "closed"}})
    no_mission = queued()
    del no_mission["mission"]
    chain.event("workitem.create", "workitem:a", {"workitem:a": no_mission})
    chain.event("workitem.create", "workitem:b", {"workitem:b": queued(mission="bare")})
    chain.event("workitem.create", "workitem:c", {"workitem:c": queued(mission="unknown")})
    chain.event("workitem.create", "workitem:d", {"workitem:d": queued(mission="shut")})
    chain.event("workitem.create", "workitem:e", {"workitem:e": queued(mission=7)})
    apply_all(agent, chain.events)
    assert listed(agent) == ["a", "b", "c", "e"]


def test_only_workitem_aggregates_are_queued(agent):
    """A queued-looking state under another kind (even one that starts with ``workitem``) is no
    queue entry."""
    chain = ChainBuilder(GROUP)
    for aggregate in ("workitems:w1", "workitem_x:w2", "workitem.sub:w3", "task:w4", "workitem:w5"):
        chain.event("custom.create", aggregate, {aggregate: queued()})
    apply_all(agent, chain.events)
    assert listed(agent) == ["w5"]
    assert [key for name, key in _queue_rows(agent) if name == "queue_index"] == [b"g-1\x00w5"]


def test_each_group_has_its_own_queue_and_mission_states(agent):
    """The same WorkItem and Mission IDs in two Groups (one a prefix of the other's ID): each
    Group's queue lists its own, read against its own mirror."""
    first, second = ChainBuilder("g-1"), ChainBuilder("g-10")
    first.event("mission.create", "mission:m1", {"mission:m1": {"status": "closed"}})
    second.event("mission.create", "mission:m1", {"mission:m1": {"status": "open"}})
    for chain, priority in ((first, 1), (second, 2)):
        chain.event("workitem.create", "workitem:w1", {"workitem:w1": queued(priority=priority)})
        chain.event("workitem.create", "workitem:w2", {"workitem:w2": queued(priority=priority, mission="m2")})
    apply_all(agent, first.events + second.events)
    assert agent.work_queue("g-1", 0) == [QueueEntry("w2", 1, 0)]
    assert agent.work_queue("g-10", 0) == [QueueEntry("w1", 2, 0), QueueEntry("w2", 2, 0)]
    first.event("workitem.claim", "workitem:w2", {"workitem:w2": workitem_state("m2", "leased")})
    apply_all(agent, first.events[3:])
    assert listed(agent, 0, "g-1") == [] and listed(agent, 0, "g-10") == ["w1", "w2"]


# -- application projections ------------------------------------------------------------------


class Scripted:
    """An application projection that runs ``script(view, event)``."""

    def __init__(self, name, script):
        self.name = name
        self.script = script

    def apply(self, view, event):
        self.script(view, event)


def test_a_projection_view_reads_writes_deletes_and_lists_its_own_keys(tmp_path):
    """``delete`` removes the key (True if it was there), ``items(prefix)`` lists the keys under
    ``prefix`` only, as the projection's own keys (without the Group and name), in key order."""
    answers = {}

    def script(view, event):
        if event.seq == 1:
            for key in ("a1", "a2", "b1", b"a\xff"):
                view.put(key, b"v-" + (key if type(key) is bytes else key.encode()))
        elif event.seq == 2:
            answers["deleted"] = (view.delete("a2"), view.delete("a2"), view.delete("none"))
            answers["a"] = list(view.items("a"))
            answers["all"] = list(view.items())
            answers["get"] = (view.get("a1"), view.get("a2"), view.get(b"a\xff"))

    events = workload(GROUP, 2)
    with AgentStore.open(tmp_path / "a", projections=[Scripted("p", script), Scripted("other", lambda view, event: view.put("a0", b"o"))]) as agent:
        apply_all(agent, events)
        assert answers["deleted"] == (True, False, False)
        assert answers["a"] == [(b"a1", b"v-a1"), (b"a\xff", b"v-a\xff")]
        assert answers["all"] == [(b"a1", b"v-a1"), (b"a\xff", b"v-a\xff"), (b"b1", b"v-b1")]
        assert answers["get"] == (b"v-a1", None, b"v-a\xff")
        assert agent.projection_items(GROUP, "p") == answers["all"]
        assert agent.projection_get(GROUP, "p", "a2") is None


@pytest.mark.parametrize("value", [bytearray(b"v"), memoryview(b"v"), "v", None, 1])
def test_a_projection_value_that_is_not_bytes_is_refused(tmp_path, value):
    events = workload(GROUP, 1)
    with AgentStore.open(tmp_path / "a", projections=[Scripted("p", lambda view, event: view.put("k", value))]) as agent:
        with pytest.raises(InvalidCommand) as caught:
            with agent.begin() as tx:
                tx.apply(events[0])
        assert caught.value.detail["field"] == "value"
        assert agent.head(GROUP).applied_seq == 0 and agent.projection_items(GROUP, "p") == []


def test_projection_keys_and_values_are_bounded_exactly(tmp_path):
    """A key of ``PROJECTION_KEY_BYTES_MAX`` bytes and a value of ``LMDB_VALUE_BYTES_MAX`` bytes are
    stored; one byte more of either, or a key that is neither str nor bytes, is refused
    (``LIMIT_EXCEEDED``, fields ``key`` and ``value``) and nothing of the transaction is kept."""
    events = workload(GROUP, 1)
    longest_key = "k" * PROJECTION_KEY_BYTES_MAX
    largest = b"v" * limits.LMDB_VALUE_BYTES_MAX

    def fits(view, event):
        view.put(longest_key, largest)
        view.put(b"\x00" * PROJECTION_KEY_BYTES_MAX, b"")

    with AgentStore.open(tmp_path / "fits", projections=[Scripted("p", fits)]) as agent:
        apply_all(agent, events)
        assert agent.projection_get(GROUP, "p", longest_key) == largest
        assert len(agent.projection_items(GROUP, "p")) == 2
    for index, (put, field) in enumerate([
        (lambda view: view.put(longest_key + "k", b""), "key"),
        (lambda view: view.put("é" * (PROJECTION_KEY_BYTES_MAX // 2) + "k", b""), "key"),
        (lambda view: view.put(7, b""), "key"),
        (lambda view: view.get(bytearray(b"k")), "key"),
        (lambda view: view.put("k", largest + b"v"), "value"),
    ]):
        with AgentStore.open(tmp_path / f"over{index}", projections=[Scripted("p", lambda view, event: put(view))]) as agent:
            with pytest.raises(LimitExceeded) as caught:
                with agent.begin() as tx:
                    tx.apply(events[0])
            assert caught.value.detail["field"] == field
            assert agent.head(GROUP).applied_seq == 0 and agent.projection_items(GROUP, "p") == []


class _NoApply:
    name = "p"
    apply = "not callable"


@pytest.mark.parametrize(
    "projections",
    [
        [_NoApply()],
        [Scripted(None, print)],
        [Scripted("", print)],
        [Scripted("a\x00b", print)],
        [Scripted("a/b", print)],
        [Scripted(7, print)],
        [Scripted("p", print), Scripted("q", print), Scripted("p", print)],
    ],
    ids=["apply_not_callable", "name_none", "name_empty", "name_nul", "name_path", "name_int", "names_repeat"],
)
def test_projections_that_cannot_be_registered_are_refused_before_anything_is_written(tmp_path, projections):
    path = tmp_path / "agent"
    with pytest.raises(InvalidCommand):
        AgentStore.open(path, projections=projections)
    assert not path.exists()


# -- the apply cycle's checks -------------------------------------------------------------------


class _SubEvent(Event):
    pass


class _SubEffect(Effect):
    pass


def _ill_typed(event: Event, how: str):
    if how == "event_subclass":
        return _SubEvent(*(getattr(event, name) for name in Event.__struct_fields__))
    if how == "effect_subclass":
        return _rehash(event, effects=[_SubEffect(effect.aggregate, effect.revision, effect.state) for effect in event.effects])
    changes = {
        "revision_str": dict(revision=str(event.revision)),
        "revision_bool": dict(revision=True),
        "accepted_at_str": dict(accepted_at_ms=str(event.accepted_at_ms)),
        "accepted_at_float": dict(accepted_at_ms=float(event.accepted_at_ms)),
        "kind_int": dict(kind=7),
        "aggregate_int": dict(aggregate=7),
        "body_list": dict(body=[1]),
        "effects_tuple": dict(effects=tuple(event.effects)),
        "effect_state_list": dict(effects=[Effect(event.effects[0].aggregate, event.effects[0].revision, [1])]),
    }[how]
    return _rehash(event, **changes)


ILL_TYPED = ["event_subclass", "effect_subclass", "revision_str", "revision_bool", "accepted_at_str", "accepted_at_float",
             "kind_int", "aggregate_int", "body_list", "effects_tuple", "effect_state_list"]


@pytest.mark.parametrize("verify", ["full", "trusted"])
@pytest.mark.parametrize("how", ILL_TYPED)
def test_an_event_with_a_field_of_the_wrong_type_is_refused_before_anything_is_written(tmp_path, verify, how):
    """Each field must have exactly its type (an Event and its Effects exactly those classes),
    even where the hash covers the wrong value (resealed here): ``EVENT_INVALID``, nothing written,
    the transaction usable; as the next Event and as a later one."""
    events = workload(GROUP, 3)[:3]
    with AgentStore.open(tmp_path / "a", verify=verify) as agent:
        apply_all(agent, events[:1])
        before = agent.projection_dump()
        for position in (1, 2):  # the next Event, and one beyond a gap
            bad = _ill_typed(events[position], how)
            with agent.begin() as tx:
                with pytest.raises(EventInvalid):
                    tx.apply(bad)
                tx.advance_cursor(GROUP)
            assert agent.projection_dump() == before and agent.buffered_seqs(GROUP) == []
        assert apply_all(agent, events[1:]) == [ApplyStatus.APPLIED] * 2


def test_an_aggregate_key_is_bounded_as_the_readers_bound_it(tmp_path):
    """``<kind>:<id>`` with a valid kind and a valid ID, each within its own bound, is taken; a
    type one character longer than a kind may be is ``EVENT_INVALID`` (reason ``effects``) in
    both modes, whatever the whole key's length. Before, apply bounded only the whole key (257
    characters), so a key with a longer type was stored, listed by ``states()``, and refused
    when read by key (``AgentStore.aggregate`` takes at most ``AGGREGATE_CHARS_MAX``)."""
    longest = "k" * limits.KIND_CHARS_MAX + ":" + "x" * limits.ID_CHARS_MAX
    assert len(longest) == AGGREGATE_CHARS_MAX
    long_type = "k" * (limits.KIND_CHARS_MAX + 1) + ":x"
    for verify in ("full", "trusted"):
        for refused in ("k" + longest, long_type):
            over = ChainBuilder(GROUP)
            over.event("custom.kind", refused, {refused: {"n": 1}})
            with AgentStore.open(tmp_path / f"{verify}-over-{len(refused)}", verify=verify) as agent:
                with agent.begin() as tx:
                    with pytest.raises(EventInvalid) as caught:
                        tx.apply(over.events[0])
                assert caught.value.detail["reason"] == "effects"
                assert agent.projection_dump() == []
        chain = ChainBuilder(GROUP)
        chain.event("custom.kind", longest, {longest: {"n": 1}})
        with AgentStore.open(tmp_path / verify, verify=verify) as agent:
            apply_all(agent, chain.events)
            assert agent.states(GROUP) == {longest: {"n": 1}}
            assert agent.aggregate(GROUP, longest) == (1, {"n": 1})  # every stored key reads back


@pytest.mark.parametrize("name", ["seq_zero", "seq_2_63", "prev_hash_short", "prev_hash_str", "hash_long"])
def test_trusted_mode_refuses_impossible_sequences_and_hashes(tmp_path, name):
    """``verify="trusted"`` walks no content, but a sequence outside 1..2**63 - 1 (with its
    matching Event ID) or a hash that is not 32 bytes is still ``EVENT_INVALID``, as the next
    Event and beyond a gap (never buffered)."""
    events = workload(GROUP, 3)[:3]
    spoil = {
        "seq_zero": lambda event: msgspec.structs.replace(event, seq=0, event_id=f"{GROUP}:0"),
        "seq_2_63": lambda event: msgspec.structs.replace(event, seq=2**63, event_id=f"{GROUP}:{2**63}"),
        "prev_hash_short": lambda event: msgspec.structs.replace(event, prev_hash=event.prev_hash[:31]),
        "prev_hash_str": lambda event: msgspec.structs.replace(event, prev_hash="0" * 32),
        "hash_long": lambda event: msgspec.structs.replace(event, hash=event.hash + b"x"),
    }[name]
    with AgentStore.open(tmp_path / "a", verify="trusted") as agent:
        for event in (events[0], events[2]):
            with agent.begin() as tx:
                with pytest.raises(EventInvalid):
                    tx.apply(spoil(event))
            assert agent.buffered_seqs(GROUP) == [] and agent.head(GROUP).applied_seq == 0
        assert apply_all(agent, events) == [ApplyStatus.APPLIED] * 3


# -- the Cursor -------------------------------------------------------------------------------


def test_the_transaction_reports_its_own_cursor_and_applied_sequence(agent):
    events = workload(GROUP, 5)[:5]
    apply_all(agent, events[:2])
    with agent.begin() as tx:
        for event in events[2:5]:
            tx.apply(event)
        assert (tx.cursor(GROUP), tx.applied_seq(GROUP)) == (2, 5)
        assert tx.advance_cursor(GROUP) == 5
        assert (tx.cursor(GROUP), tx.applied_seq(GROUP)) == (5, 5)
        assert (tx.cursor("g-other"), tx.applied_seq("g-other")) == (0, 0)


def test_advance_cursor_in_a_finished_or_failed_transaction_is_refused(tmp_path):
    events = workload(GROUP, 3)[:3]

    def script(view, event):
        if event.seq == 3:
            raise RuntimeError("projection failed")

    with AgentStore.open(tmp_path / "a", projections=[Scripted("p", script)]) as agent:
        with agent.begin() as tx:
            tx.apply(events[0])
        with pytest.raises(StoreClosed):
            tx.advance_cursor(GROUP)
        assert agent.cursor(GROUP) == 0
        with pytest.raises(ProjectionFailed):
            with agent.begin() as tx:
                tx.apply(events[1])
                with pytest.raises(RuntimeError):
                    tx.apply(events[2])
                with pytest.raises(ProjectionFailed):
                    tx.advance_cursor(GROUP)
        assert agent.cursor(GROUP) == 0 and agent.head(GROUP).applied_seq == 1


# -- the projection dump and digest, reset --------------------------------------------------------


def test_the_dump_covers_the_mirror_queue_and_projections_and_each_groups_cursor(tmp_path):
    """The dump holds heads (applied seq, head hash, Cursor), mirrored states, queue, queue index
    and application projections; the inbox, the buffer and the outbox are bookkeeping and not in
    it: pruning, buffering a later Event or recording an intent leaves the digest as it was."""
    chain = ChainBuilder(GROUP)
    chain.event("mission.create", "mission:m1", {"mission:m1": {"status": "open"}})
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": queued()})
    chain.event("workitem.create", "workitem:w2", {"workitem:w2": queued()})
    chain.event("workitem.create", "workitem:w3", {"workitem:w3": queued()})
    projections = [Scripted("p", lambda view, event: view.put(f"e{event.seq}", b"x"))]
    with AgentStore.open(tmp_path / "a", projections=projections) as one, AgentStore.open(tmp_path / "b", projections=projections) as two:
        apply_all(one, chain.events[:3])
        apply_all(two, chain.events[:3], advance=False)
        assert {name for name, _, _ in one.projection_dump()} == {"heads", "state", "queue", "queue_index", "projection"}
        assert one.projection_dump() != two.projection_dump()  # the Cursors differ
        assert one.projection_digest() != two.projection_digest()
        with two.begin() as tx:
            tx.advance_cursor(GROUP)
        assert one.projection_dump() == two.projection_dump() and one.projection_digest() == two.projection_digest()
        digest = one.projection_digest()
        assert one.prune_inbox(GROUP) == 3 and one.inbox_seqs(GROUP) == []
        with one.begin() as tx:
            tx.apply(_rehash(chain.events[3], seq=5, event_id=f"{GROUP}:5"))  # beyond a gap: buffered
            tx.record_intent(GROUP, mission="m1", workitem="w1", ownership_epoch=1, operation="notify")
        assert one.buffered_seqs(GROUP) == [5] and len(one.intents()) == 1
        assert one.projection_digest() == digest


def test_the_digest_tells_apart_dumps_that_differ_only_in_where_a_part_ends(tmp_path):
    """Each part of each row is framed by its length: a key and value split differently, or the
    same key and value in another database, give another digest."""
    events = workload(GROUP, 1)
    digests = []
    for index, (key, value) in enumerate([(b"ab", b"c"), (b"a", b"bc")]):
        with AgentStore.open(tmp_path / f"a{index}", projections=[Scripted("p", lambda view, event, k=key, v=value: view.put(k, v))]) as agent:
            apply_all(agent, events)
            digests.append(agent.projection_digest())
    assert digests[0] != digests[1]
    with AgentStore.open(tmp_path / "rows") as agent:
        rows = {}
        for name in ("state", "projection"):
            agent._projection_rows = lambda txn, group, name=name: iter([(name, b"g-1\x00k", b"v")])  # what the digest hashes
            rows[name] = agent.projection_digest()
        assert rows["state"] != rows["projection"]


def test_a_groups_dump_holds_only_that_group_even_beside_a_group_whose_id_extends_it(agent):
    first, second = workload("g-1", 12, seed=1), workload("g-10", 12, seed=2)
    apply_all(agent, first)
    dump, digest = agent.projection_dump("g-1"), agent.projection_digest("g-1")
    apply_all(agent, second)
    assert agent.projection_dump("g-1") == dump and agent.projection_digest("g-1") == digest
    assert all(key.startswith(b"g-1\x00") or (name == "heads" and key == b"g-1") for name, key, _ in dump)


def test_reset_group_forgets_everything_of_the_group_and_nothing_of_another(agent):
    events = workload(GROUP, 10)
    other = workload("g-2", 6)
    apply_all(agent, events[:6] + events[7:9] + other)
    other_dump = agent.projection_dump("g-2")
    agent.reset_group(GROUP)
    assert agent.inbox_seqs(GROUP) == [] and agent.buffered_seqs(GROUP) == []
    assert agent.projection_dump(GROUP) == []  # as a Group never seen: its head of zeros is no row
    assert agent.head(GROUP).applied_seq == 0 and agent.head(GROUP).cursor == 0
    assert agent.projection_dump("g-2") == other_dump and agent.inbox_seqs("g-2") == list(range(1, 7))
