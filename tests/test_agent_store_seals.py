"""The AgentStore never answers from a damaged LMDB file: sealed values, presence-checked misses,
checked ranges, and no silently re-created database.

Each test damages the store the way a flipped bit can (a value changed, an entry a lookup no
longer finds, a key moved out of order, a database renamed) and checks the answer is
``CORRUPTION`` — and that ordinary deletes (projection keys, a group reset) never raise a false
alarm.
"""

from __future__ import annotations

import os

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_store_support import CountingProjection, workload
from authority_helpers import loop_database_root, raising, set_database_flag, store_bytes
from mwpstore.agent_store import AgentStore, GroupHead
from mwpstore.errors import Corruption

GROUP = "g-1"
_CURSOR_DELETE = "<method 'delete' of 'Cursor' objects>"  # what the binding's SystemError names


@pytest.fixture
def events():
    return workload(GROUP, 30, seed=5)


def _filled(path, events):
    agent = AgentStore.open(path, projections=[CountingProjection()])
    with agent.begin() as tx:
        for event in events:
            tx.apply(event)
        tx.advance_cursor(GROUP)
    return agent


def _raw(agent, name: bytes):
    return agent._tables.dbs[name]


def _some_state_key(agent) -> bytes:
    with agent._env.begin() as txn:
        return next(key for key, _ in agent._tables.range(txn, b"state", GROUP.encode() + b"\x00"))


def test_a_changed_state_value_fails_its_seal(tmp_path, events):
    with _filled(tmp_path / "agent", events) as agent:
        key = _some_state_key(agent)
        with agent._env.begin(write=True) as txn:
            stored = bytearray(txn.get(key, db=_raw(agent, b"state")))
            stored[3] ^= 0x10
            txn.put(key, bytes(stored), db=_raw(agent, b"state"))
        aggregate = key.split(b"\x00", 1)[1].decode()
        with pytest.raises(Corruption) as caught:
            agent.state(GROUP, aggregate)
        assert caught.value.detail["reason"] == "agent_checksum"
        with pytest.raises(Corruption):
            agent.states(GROUP)


def test_a_lost_head_is_corruption_not_a_new_group(tmp_path, events):
    """A head that vanished would make the Group look new: every Event applied again."""
    with _filled(tmp_path / "agent", events) as agent:
        with agent._env.begin(write=True) as txn:
            txn.delete(GROUP.encode(), db=_raw(agent, b"heads"))
        with pytest.raises(Corruption) as caught:
            agent.head(GROUP)
        assert caught.value.detail["reason"] == "agent_missing"
        with pytest.raises(Corruption):
            with agent.begin() as tx:
                tx.apply(events[0])


def test_a_lost_inbox_entry_is_corruption_when_its_event_is_redelivered(tmp_path, events):
    with _filled(tmp_path / "agent", events) as agent:
        with agent._env.begin(write=True) as txn:
            txn.delete(GROUP.encode() + b"\x00" + (5).to_bytes(8, "big"), db=_raw(agent, b"inbox"))
        with pytest.raises(Corruption):
            with agent.begin() as tx:
                tx.apply(events[4])
        with agent.begin() as tx:  # other duplicates are still just duplicates
            assert tx.apply(events[5]).value == "duplicate"


def test_a_lost_projection_entry_is_corruption(tmp_path, events):
    with _filled(tmp_path / "agent", events) as agent:
        key = agent.projection_items(GROUP, CountingProjection.name)[0][0]
        with agent._env.begin(write=True) as txn:
            full = GROUP.encode() + b"\x00" + CountingProjection.name.encode() + b"\x00" + key
            assert txn.delete(full, db=_raw(agent, b"projection"))
        with pytest.raises(Corruption):
            agent.projection_get(GROUP, CountingProjection.name, key)


def test_a_damaged_key_just_before_a_range_is_corruption(tmp_path, events):
    """The search can land past a range's first entries when the key before them is damaged."""
    with _filled(tmp_path / "agent", events) as agent:
        prefix = GROUP.encode() + b"\x00" + CountingProjection.name.encode() + b"\x00"
        items = agent.projection_items(GROUP, CountingProjection.name)
        victim = prefix + items[1][0]
        moved = victim.replace(b"counter", b"countdr") if b"counter" in victim else victim[:-1]
        with agent._env.begin(write=True) as txn:
            stored = txn.get(victim, db=_raw(agent, b"projection"))
            txn.delete(victim, db=_raw(agent, b"projection"))
            txn.put(moved, stored, db=_raw(agent, b"projection"))  # same sealed value, changed key
        with pytest.raises(Corruption):
            agent.projection_items(GROUP, CountingProjection.name)


def test_a_renamed_database_is_corruption_at_open_not_a_new_empty_one(tmp_path, events):
    path = tmp_path / "agent"
    _filled(path, events).close()
    env = lmdb.open(str(path / "lmdb"), max_dbs=20)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"heads", txn=txn), delete=True)
    env.close()
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, projections=[CountingProjection()])
    assert caught.value.detail["reason"] == "missing_database"
    AgentStore.open(tmp_path / "fresh").close()  # a new store still creates its databases


def test_a_kill_while_a_new_store_creates_its_databases_leaves_none_of_them(tmp_path, events):
    """Found by the crash suite (seed 7): the databases were created one transaction each, so a
    kill in between left some, and every later open refused the store as damaged."""
    import os
    import subprocess
    import sys

    path = tmp_path / "agent"
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from mwpstore.agent_store import AgentStore; AgentStore.open(sys.argv[1])", str(path)],
        env=dict(os.environ, MWPSTORE_FAILPOINT="lmdb.databases_created"), capture_output=True, text=True, timeout=60,
    )
    assert child.returncode == -9, child.stderr[-500:]  # killed at the fail point
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:  # a new store again
        assert agent.groups() == []
        with agent.begin() as tx:
            for event in events:
                tx.apply(event)
            tx.advance_cursor(GROUP)
        assert agent.head(GROUP).applied_seq == len(events)


@pytest.mark.parametrize("presence", [True, False], ids=["with presence", "as 0.1.0 wrote it, without presence"])
def test_a_store_of_the_unsealed_format_is_refused_with_a_typed_error(tmp_path, events, presence):
    """Format 1 (0.1.0) had no presence database: such a store was refused as damaged
    (missing_database) before its format was read (finding C3). Refused, it is left as it was
    but for LMDB's reader table."""
    path = tmp_path / "agent"
    agent = _filled(path, events)
    with agent._env.begin(write=True) as txn:
        txn.put(b"format", b"1", db=_raw(agent, b"meta"))
        if not presence:
            txn.drop(_raw(agent, b"presence"), delete=True)
    agent.close()
    before = store_bytes(str(path), leave_out=("lmdb/lock.mdb",))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path)
    assert caught.value.detail["reason"] == "format" and caught.value.detail["format"] == "1"
    assert store_bytes(str(path), leave_out=("lmdb/lock.mdb",)) == before


@pytest.mark.parametrize("stored", ["the format, its seal damaged", "the format unsealed", "format 2 unsealed"])
def test_a_damaged_format_entry_is_refused_as_damage_not_as_another_format(tmp_path, events, stored):
    """A format entry that fails its seal and is not 0.1.0's plain format is damage (reason
    agent_checksum). A damaged seal was refused as "format" with four garbage bytes for a name
    (and advice to settle the outbox with the build that wrote it), and an unsealed ``2``, which
    no build writes, opened as if it were sound."""
    from mwpstore.agent_store import FORMAT_VERSION
    from mwpstore.index import seal

    path = tmp_path / "agent"
    agent = _filled(path, events)
    current = str(FORMAT_VERSION).encode()
    sealed = seal(b"meta", b"format", current)
    value = {"the format, its seal damaged": sealed[:-1] + bytes([sealed[-1] ^ 1]), "the format unsealed": current,
             "format 2 unsealed": b"2"}[stored]
    with agent._env.begin(write=True) as txn:
        assert bytes(txn.get(b"format", db=_raw(agent, b"meta"))) == sealed
        txn.put(b"format", value, db=_raw(agent, b"meta"))
    agent.close()
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path)
    assert caught.value.detail["reason"] == "agent_checksum" and caught.value.detail["key"] == "format"


def test_deletes_and_resets_leave_no_false_alarm(tmp_path, events):
    class Scratch:
        name = "scratch"

        def apply(self, view, event):
            view.put(f"k{event.seq}", b"v")
            if event.seq > 1:
                assert view.delete(f"k{event.seq - 1}")

    agent = AgentStore.open(tmp_path / "agent", projections=[Scratch()])
    with agent:
        with agent.begin() as tx:
            for event in events:
                tx.apply(event)
        assert agent.projection_get(GROUP, "scratch", "k1") is None  # deleted: absent, not damage
        assert [key for key, _ in agent.projection_items(GROUP, "scratch")] == [f"k{len(events)}".encode()]
        agent.reset_group(GROUP)
        assert agent.head(GROUP).applied_seq == 0 and agent.states(GROUP) == {}
        assert agent.projection_get(GROUP, "scratch", f"k{len(events)}") is None
        with agent.begin() as tx:  # and the Group applies again from the start
            for event in events:
                tx.apply(event)
        assert agent.head(GROUP).applied_seq == len(events)


def test_a_projection_value_longer_than_any_sealed_read_accepts_is_refused_before_disk(tmp_path, events):
    """Reads refuse a value longer than ``limits.LMDB_VALUE_BYTES_MAX`` as damage, so a write of
    one is refused first (``LIMIT_EXCEEDED``) and nothing of its transaction is committed."""
    from mwpstore import limits
    from mwpstore.errors import LimitExceeded

    class Big:
        name = "big"

        def apply(self, view, event):
            view.put("v", b"x" * (limits.LMDB_VALUE_BYTES_MAX + 1))

    with AgentStore.open(tmp_path / "agent", projections=[Big()]) as agent:
        with pytest.raises(LimitExceeded):
            with agent.begin() as tx:
                tx.apply(events[0])
        assert agent.head(GROUP).applied_seq == 0 and agent.projection_get(GROUP, "big", "v") is None


@pytest.mark.parametrize(
    "head",
    [
        b"\x93\x01\x02",  # not a head at all
        GroupHead(applied_seq=5, cursor=9),  # a Cursor beyond what is applied
        GroupHead(applied_seq=-5, cursor=-5),
        GroupHead(applied_seq=2**63, cursor=2**63),
        GroupHead(applied_seq=5, cursor=5, pruned_seq=7),
        GroupHead(applied_seq=5, cursor=5, floor_seq=6, pruned_seq=5),
        GroupHead(applied_seq=5, applied_hash=b"x", cursor=5),
        GroupHead(applied_seq=5, cursor=5, buffered=-1),
    ],
    ids=["undecodable", "cursor_past_applied", "negative", "past_2_63", "pruned_past_cursor", "floor_past_pruned",
         "short_hash", "negative_buffered"],
)
def test_an_impossible_head_under_a_sound_seal_is_corruption_on_every_path(tmp_path, events, head):
    """A seal is a CRC, not a signature: a head rewritten with a matching seal must still never be
    an answer (a Cursor to ACK beyond what is applied) nor reach the apply cycle, where it raised
    msgspec's and int's own errors."""
    from mwpstore.agent_store import _HEAD_ENCODER

    with _filled(tmp_path / "agent", events) as agent:
        value = head if type(head) is bytes else _HEAD_ENCODER.encode(head)
        with agent._tables.begin(write=True) as txn:
            agent._tables.put(txn, b"heads", GROUP.encode(), value, new=False)
        calls = [lambda: agent.head(GROUP), lambda: agent.cursor(GROUP), lambda: agent.ack_position(GROUP),
                 agent.projection_dump, lambda: agent.prune_inbox(GROUP)]
        for call in calls:
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "agent"
        for step in (lambda tx: tx.apply(events[3]), lambda tx: tx.apply(events[-1]), lambda tx: tx.advance_cursor(GROUP)):
            with pytest.raises(Corruption):
                with agent.begin() as tx:
                    step(tx)
        with agent._env.begin() as txn:  # nothing was written over it
            assert agent._tables.unseal(b"heads", GROUP.encode(), txn.get(GROUP.encode(), db=_raw(agent, b"heads"))) == value


def test_a_lost_queue_index_entry_is_corruption_when_its_workitem_moves(tmp_path):
    """The queue index says which queue entry a WorkItem has: lost, the entry would stay in the
    queue after the WorkItem is leased. Its miss is checked against ``presence``."""
    from agent_store_support import ChainBuilder, lease_record, workitem_state

    chain = ChainBuilder(GROUP)
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": workitem_state("m1", "queued")})
    leased = workitem_state("m1", "leased", ownership_epoch=1, lease=lease_record("a", 1))
    chain.event("workitem.claim", "workitem:w1", {"workitem:w1": leased})
    with AgentStore.open(tmp_path / "agent") as agent:
        with agent.begin() as tx:
            tx.apply(chain.events[0])
        with agent._env.begin(write=True) as txn:
            assert txn.delete(GROUP.encode() + b"\x00w1", db=_raw(agent, b"queue_index"))
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(chain.events[1])
        assert caught.value.detail["reason"] == "agent_missing"
        assert agent.head(GROUP).applied_seq == 1  # nothing of the transaction was committed


def test_a_lost_outbox_entry_is_corruption_not_a_fresh_intent(tmp_path, events):
    """An intent whose outbox entry (and its presence) vanished while its key map stayed must not
    read as absent: recorded again it would be a fresh INTENDED intent, dispatched once more."""
    with _filled(tmp_path / "agent", events) as agent:
        def record():
            with agent.begin() as tx:
                return tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="pay")

        intent = record()
        agent.mark_dispatched(intent.key)
        entry = GROUP.encode() + b"\x00" + intent.key.encode()
        with agent._env.begin(write=True) as txn:
            assert txn.delete(entry, db=_raw(agent, b"outbox"))
            assert txn.delete(b"o" + entry, db=agent._tables.presence)
        calls = []
        for call in (lambda: agent.intent(intent.key), record, lambda: agent.dispatch(intent.key, calls.append)):
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "agent_missing"
        assert calls == []


def test_an_intent_whose_group_letter_flipped_is_corruption_not_an_empty_outbox(tmp_path, events):
    """Found by the corruption suite (seed 305): one bit flipped in the Group of the outbox's only
    entry moved it before every range over the outbox, so ``intents(group)`` answered ``[]``."""
    path = tmp_path / "agent"
    with _filled(path, events) as agent:
        with agent.begin() as tx:
            intent = tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="pay")
        assert agent.intents(GROUP) == [intent]
        entry = GROUP.encode() + b"\x00" + intent.key.encode()
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    spots = [spot for spot in range(len(data)) if data.startswith(entry, spot)]
    assert len(spots) == 2  # the outbox entry, and its presence tag b"o" + entry
    at = next(spot for spot in spots if data[spot - 1] != ord("o"))
    data[at] ^= 0b10  # g -> e: the key now sorts before "g-1"
    data_file.write_bytes(bytes(data))
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        for call in (lambda: agent.intents(GROUP), lambda: agent.intents(GROUP, pending_only=True)):
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "agent_checksum"


def test_a_reset_over_a_state_key_moved_by_damage_is_corruption_not_a_state_left_behind(tmp_path, events):
    """A bit flipped in the Group of a state's key (g -> e) inside the Group's states made the
    reset's deletion start after it, so the states before it were neither deleted nor reported:
    after ``reset_group``, ``aggregate`` still answered the Group's old ``group:g-1``. Reachable
    where the open's structural check does not run (``check_lmdb=False``, or a file over its
    size bound); now the reset is ``CORRUPTION`` and deletes nothing."""
    path = tmp_path / "agent"
    with _filled(path, events) as agent:
        second = GROUP.encode() + b"\x00member:agent-a"
        assert _some_state_key(agent) < second and agent.aggregate(GROUP, "member:agent-a")[0] > 0
        cursor = agent.head(GROUP).cursor
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    spots = [spot for spot in range(len(data)) if data.startswith(second, spot) and data[spot - 1] != ord("s")]
    assert len(spots) == 1  # the state entry (its presence entry is b"s" + key)
    data[spots[0]] ^= 0b10
    data_file.write_bytes(bytes(data))
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        with pytest.raises(Corruption) as caught:
            agent.reset_group(GROUP)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_checksum", "e" + second[1:].decode())
        assert agent.head(GROUP).cursor == cursor


@pytest.mark.parametrize("deletion", ["reset_group", "prune_inbox"])
def test_a_deletion_over_another_groups_inbox_key_moved_by_damage_is_corruption_not_a_lost_entry(tmp_path, deletion):
    """A bit flipped in the Group of g-3's first inbox key (g-3 -> g-1) put it right after g-1's
    entries: ``reset_group("g-1")`` and ``prune_inbox("g-1")`` deleted it with them (the prune said
    11 for 10 entries), unreported, and ``inbox_seqs("g-3")`` then answered 2..10 without an error,
    where before the deletion it said ``CORRUPTION``. Each entry a deletion reaches must pass its
    seal: the deletion is ``CORRUPTION`` and deletes nothing, and the damage stays reported."""
    path = tmp_path / "agent"
    agent = AgentStore.open(path, projections=[CountingProjection()])
    with agent:
        for group in ("g-1", "g-3"):
            with agent.begin() as tx:
                for event in workload(group, 10, seed=5):
                    tx.apply(event)
                tx.advance_cursor(group)
        assert agent.inbox_seqs("g-3") == list(range(1, 11))
    moved = b"g-3\x00" + (1).to_bytes(8, "big")
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    [spot] = [spot for spot in range(len(data)) if data.startswith(moved, spot)]
    data[spot + 2] ^= 0b10  # "3" -> "1"
    data_file.write_bytes(bytes(data))
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        head = agent.head("g-1")
        with pytest.raises(Corruption) as caught:
            getattr(agent, deletion)("g-1")
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_checksum", "g-1\x00" + moved[4:].decode())
        assert agent.head("g-1") == head
        with pytest.raises(Corruption):
            agent.inbox_seqs("g-3")


def test_a_prune_whose_search_a_raised_branch_key_sent_to_the_leaf_before_is_corruption(tmp_path):
    """g-0's 300 inbox entries and g-1's 10 span several leaves; the last leaf starts inside g-0's
    entries and holds g-1's. With the branch key to that leaf raised past g-1's keys (a damaged
    branch page), the search for g-1's first entry goes to the leaf before, runs off its end, and
    LMDB lands on the last leaf's first entry, g-0's, without comparing it. ``prune_inbox("g-1")``
    deleted from there: 34 entries, g-0's last 24 among them, sound and unreported, and
    ``inbox_seqs("g-0")`` then answered 276 entries without an error. The entry the search lands
    on must sort at or after the start: ``CORRUPTION`` (``agent_order``), nothing pruned, and g-1's
    own range still reports the damage."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:  # one transaction: no stale copy of a page in the file
            for group, count in (("g-0", 300), ("g-1", 10)):
                for event in workload(group, count, seed=5):
                    tx.apply(event)
                tx.advance_cursor(group)
        with agent._env.begin() as txn:
            nodes = {bytes(key): bytes(key) + bytes(value) for key, value in txn.cursor(db=_raw(agent, b"inbox"))}
        head = agent.head("g-1")
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())

    def branches(key: bytes) -> list[int]:  # where the key lies without its node's value after it
        return [spot for spot in range(len(data)) if data.startswith(key, spot) and not data.startswith(nodes[key], spot)]

    first = max(key for key in nodes if key.startswith(b"g-0\x00") and branches(key))
    assert first > min(nodes) and max(nodes).startswith(b"g-1\x00")
    spots = branches(first)
    assert spots
    # Every copy of the branch key: a freed page that still holds an older copy of the branch
    # page is never read, so changing it too changes nothing (one copy only, in most runs).
    for branch in spots:
        data[branch : branch + 3] = b"g-9"  # past every key of g-1
    data_file.write_bytes(bytes(data))
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        with pytest.raises(Corruption) as caught:
            agent.prune_inbox("g-1")
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_order", first.decode())
        assert agent.head("g-1") == head
        assert agent.inbox_seqs("g-0") == list(range(1, 301))
        with pytest.raises(Corruption):  # g-1's own range meets the damage as the prune did
            agent.inbox_seqs("g-1")


def test_an_unreadable_intent_or_state_under_a_sound_seal_is_corruption_in_transactions_too(tmp_path, events):
    """Values rewritten with a matching seal that do not decode (or name another intent, or another
    Group than the one they are filed under) were typed on the read paths only: the outbox's own
    transactions and a projection reading the mirrored state got msgspec's errors."""
    import msgspec

    from mwpstore.agent_store import _INTENT_ENCODER

    class Reader:
        name = "reader"

        def apply(self, view, event):
            view.state("group:g-1")

    path = tmp_path / "agent"
    with _filled(path, events) as agent:
        def record():
            with agent.begin() as tx:
                return tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="pay")

        intent = record()
        other = msgspec.structs.replace(intent, key="k-" + "0" * 60)
        other_group = msgspec.structs.replace(intent, group="g-2")
        entry = GROUP.encode() + b"\x00" + intent.key.encode()
        for value in (b"\x91\x01", _INTENT_ENCODER.encode(other), _INTENT_ENCODER.encode(other_group)):
            with agent._tables.begin(write=True) as txn:
                agent._tables.put(txn, b"outbox", entry, value, new=False)
            calls = [lambda: agent.intent(intent.key), record, lambda: agent.mark_dispatched(intent.key),
                     lambda: agent.record_receipt(intent.key, {"ok": True}), lambda: agent.dispatch(intent.key, lambda i: {})]
            for call in calls:
                with pytest.raises(Corruption) as caught:
                    call()
                assert caught.value.detail["reason"] == "agent"
        with agent._tables.begin(write=True) as txn:
            agent._tables.put(txn, b"state", GROUP.encode() + b"\x00group:g-1", b"\x91\x01", new=False)
        with agent.begin() as tx:
            with pytest.raises(Corruption):
                tx.state(GROUP, "group:g-1")
    more = workload(GROUP, len(events) + 1, seed=5)[-1]
    with AgentStore.open(path, projections=[CountingProjection(), Reader()]) as agent:
        with pytest.raises(Corruption):
            with agent.begin() as tx:
                tx.apply(more)
        assert agent.head(GROUP).applied_seq == len(events)


def test_a_sealed_format_of_any_length_is_quoted_in_part(tmp_path, events):
    """A sealed format of another value and any length (outside input) is refused as another
    format, quoting its first 16 bytes and its size: a 1 MiB one made a message and a detail of
    1 MiB each."""
    path = tmp_path / "agent"
    agent = _filled(path, events)
    with agent._env.begin(write=True) as txn:
        agent._tables.put(txn, b"meta", b"format", b"7" * (1 << 20))
    agent.close()
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path)
    assert caught.value.detail["reason"] == "format" and caught.value.detail["format"] == "7777777777777777… of 1048576 bytes"
    assert len(caught.value.message) < 400


def test_a_state_nested_past_the_decoders_depth_is_corruption(tmp_path, events):
    """A sealed state whose msgpack nests deeper than msgspec's recursion limit is CORRUPTION
    (reason ``agent``) for ``state`` and ``states``, as other undecodable bytes are: it was a bare
    ``RecursionError``."""
    path = tmp_path / "agent"
    agent = _filled(path, events)
    key = next(iter(agent.states(GROUP)))
    with agent._env.begin(write=True) as txn:
        agent._tables.put(txn, b"state", GROUP.encode() + b"\x00" + key.encode(), b"\x92\x01\x81\xa1a" + b"\x91" * 100_000 + b"\xc0", new=False)
    for read in (lambda: agent.state(GROUP, key), lambda: agent.states(GROUP)):
        with pytest.raises(Corruption) as caught:
            read()
        assert caught.value.detail["reason"] == "agent"
    agent.close()


def test_a_state_head_or_intent_nested_past_the_decoders_depth_is_corruption_inside_a_transaction(tmp_path, events):
    """Inside a local transaction no decorator types what a decoder raises (a projection's own
    errors pass there): the mirrored state, the Group head and an outbox intent are decoded by
    functions that type their own errors, RecursionError included."""
    import msgspec

    from mwpstore.agent_store import _INTENT_ENCODER

    nested = b"\x91" * 100_000 + b"\xc0"
    path = tmp_path / "agent"
    with _filled(path, events) as agent:
        with agent.begin() as tx:
            intent = tx.record_intent(GROUP, mission="m1", workitem="wi-1", ownership_epoch=1, operation="pay")
        head = msgspec.msgpack.encode(agent.head(GROUP))  # an array: one more element, nested
        encoded = _INTENT_ENCODER.encode(intent)  # a map: one more field, {"x": [[[...]]]}, which decoding skips
        record_again = {"mission": "m1", "workitem": "wi-1", "ownership_epoch": 1, "operation": "pay"}
        tables = agent._tables
        for name, key, value, call in [
            (b"state", GROUP.encode() + b"\x00group:g-1", b"\x92\x01\x81\xa1a" + nested, lambda tx: tx.state(GROUP, "group:g-1")),
            (b"heads", GROUP.encode(), bytes([head[0] + 1]) + head[1:] + nested, lambda tx: tx.advance_cursor(GROUP)),
            (b"outbox", GROUP.encode() + b"\x00" + intent.key.encode(), bytes([encoded[0] + 1]) + encoded[1:] + b"\xa1x" + nested,
             lambda tx: tx.record_intent(GROUP, **record_again)),
        ]:
            with tables.begin(write=True) as txn:
                stored = bytes(tables.get(txn, name, key))
                tables.put(txn, name, key, value, new=False)
            with pytest.raises(Corruption) as caught:
                with agent.begin() as tx:
                    call(tx)
            assert caught.value.detail["reason"] == "agent", name
            with tables.begin(write=True) as txn:
                tables.put(txn, name, key, stored, new=False)


# -- writes over keys that damage moved (found by the exhaustive LMDB sweep, torture lmdb-sweep) --


def _two_groups(path, groups):
    agent = AgentStore.open(path, projections=[CountingProjection()])
    with agent.begin() as tx:
        for group in groups:
            for event in workload(group, 8, seed=5):
                tx.apply(event)
            tx.advance_cursor(group)
    return agent


def _flip_in_live_key(path, key: bytes, at: int, bit: int) -> None:
    """Flip ``bit`` of byte ``at`` of ``key`` where the file holds it as a node's key in a page
    LMDB uses (not a stale copy on a free page, not inside a presence key)."""
    from mwpstore import torture

    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    spots = [spot for start, end in torture.lmdb_page_spans(str(data_file)) for spot in range(start, end)
             if data.startswith(key, spot) and int.from_bytes(data[spot - 2:spot], "little") == len(key)]
    assert len(spots) == 1, spots
    data[spots[0] + at] ^= 1 << bit
    data_file.write_bytes(bytes(data))


def test_a_reset_that_would_erase_an_entry_damage_moved_in_from_another_group_is_corruption(tmp_path):
    """One bit flipped in the Group of ``g-2``'s last projection key made it a ``g-3`` key, right
    before ``g-3``'s entries. ``reset_group("g-3")`` checked only the entries bounding its walk,
    erased that entry with ``g-3``'s, and succeeded; ``projection_items("g-2")``, ``CORRUPTION``
    before the reset, then answered 12 entries of 13 without an error. The deletion now checks the
    seal and key order of each entry it deletes: ``CORRUPTION``, and the transaction deletes
    nothing. Reachable where the open's structural check does not run."""
    path = tmp_path / "agent"
    with _two_groups(path, ["g-2", "g-3"]) as agent:
        items = agent.projection_items("g-2", CountingProjection.name)
        assert len(items) == 13
    _flip_in_live_key(path, b"g-2\x00counter\x00" + items[-1][0], 2, 0)
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        with pytest.raises(Corruption):
            agent.projection_items("g-2", CountingProjection.name)
        with pytest.raises(Corruption) as caught:
            agent.reset_group("g-3")
        assert caught.value.detail["reason"] == "agent_checksum"
        assert caught.value.detail["key"] == "g-3\x00counter\x00" + items[-1][0].decode()
        assert agent.head("g-3").applied_seq == 8
        with pytest.raises(Corruption):
            agent.projection_items("g-2", CountingProjection.name)


def test_a_prune_whose_last_inbox_key_damage_moved_past_the_group_is_corruption_not_a_short_count(tmp_path):
    """With one bit flipped in the Group of the inbox's last key (``g-2`` -> ``g/2``: still in key
    order, so the open's structural check passes it), ``prune_inbox("g-2")`` deleted the other
    entries with a raw cursor, checked nothing, and answered 7 where 8 entries were pruned. It now
    deletes as a deletion of a Group's entries does: the entry that ends its walk must be sound."""
    path = tmp_path / "agent"
    with _two_groups(path, ["g-1", "g-2"]) as agent:
        assert agent.inbox_seqs("g-2") == list(range(1, 9))
    _flip_in_live_key(path, b"g-2\x00" + (8).to_bytes(8, "big"), 1, 1)
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:  # the structural check runs
        with pytest.raises(Corruption) as caught:
            agent.prune_inbox("g-2")
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent_checksum", "inbox")
        assert agent.head("g-2").pruned_seq == 0
        with pytest.raises(Corruption):
            agent.inbox_seqs("g-2")  # nothing was deleted: the damage is still reported


@pytest.mark.parametrize("wrapped", [False, True], ids=["an LMDB error", "an LMDB error inside SystemError"])
@pytest.mark.parametrize("write", ["reset_group", "prune_inbox", "record_receipt", "service_unreachable"])
def test_an_lmdb_error_inside_a_local_transaction_is_corruption_not_a_bare_lmdb_error(tmp_path, monkeypatch, write, wrapped):
    """A write over a damaged page (the exhaustive sweep, with the open's structural check off:
    e.g. ``reset_group`` raised ``lmdb.CorruptedError`` "Located page was wrong type",
    ``PageNotFoundError``, ``BadTxnError`` after one of them, and the binding's ``SystemError``
    "returned a result with an exception set" from ``Cursor.delete``) let LMDB's error out of
    the local transaction bare: only reads and ``apply`` were typed. LMDB's errors inside a local
    transaction are now ``CORRUPTION`` (reason ``agent``), and nothing is written."""
    from mwpstore import _sealed
    from mwpstore.offline import OfflineGuard

    path = tmp_path / "agent"
    with _two_groups(path, [GROUP]) as agent:
        with agent.begin() as tx:
            key = tx.record_intent(GROUP, mission="m", workitem="wi", ownership_epoch=1, operation="notify").key
    calls = {
        "reset_group": lambda agent: agent.reset_group(GROUP),
        "prune_inbox": lambda agent: agent.prune_inbox(GROUP),
        "record_receipt": lambda agent: agent.record_receipt(key, {"id": "r"}),
        "service_unreachable": lambda agent: OfflineGuard(agent, GROUP, "w1", grace_ms=1).service_unreachable(5),
    }

    failing = raising(lmdb.CorruptedError("mdb_cursor_del: MDB_CORRUPTED: Located page was wrong type"), wrapped, _CURSOR_DELETE)

    real_put = _sealed.SealedTables.put
    monkeypatch.setattr(_sealed, "_delete_prefix", failing)
    monkeypatch.setattr(_sealed.SealedTables, "put", lambda self, txn, name, *rest, **options: (
        failing() if name in (b"outbox", b"offline") else real_put(self, txn, name, *rest, **options)))
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        before = agent.projection_digest(), agent.head(GROUP), agent.intents()
        with pytest.raises(Corruption) as caught:
            calls[write](agent)
        assert caught.value.detail["reason"] == "agent"
        assert "CorruptedError" in caught.value.message
        assert (agent.projection_digest(), agent.head(GROUP), agent.intents()) == before


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside SystemError"])
@pytest.mark.parametrize("error", ["CorruptedError", "PageNotFoundError", "InvalidError", "BadTxnError", "BadValsizeError",
                                   "BadDbiError", "IncompatibleError", "CursorFullError", "PageFullError", "MapFullError",
                                   "DiskError"])
def test_each_lmdb_error_inside_a_local_transaction_is_typed_as_damage_or_as_translate_types_it(tmp_path, monkeypatch, error, wrapped):
    """Every LMDB error that damaged pages give (``LMDB_DAMAGE_ERRORS``) is ``CORRUPTION``
    (reason ``agent``, naming the error) inside a local transaction and at its commit, bare or
    wrapped by the binding in ``SystemError``; LMDB's other errors are typed as ``translate``
    types them (a full map ``LIMIT_EXCEEDED``, a disk error ``STORAGE_FAILED``), from the LMDB
    error, not from the ``SystemError`` around it. Nothing is written."""
    from mwpstore import _sealed, failpoints
    from mwpstore.errors import LimitExceeded, StorageFailed

    expected = {"MapFullError": LimitExceeded, "DiskError": StorageFailed}.get(error, Corruption)
    path = tmp_path / "agent"
    with _two_groups(path, [GROUP]) as agent:
        before = agent.projection_digest(), agent.head(GROUP)
        monkeypatch.setattr(_sealed, "_delete_prefix", raising(getattr(lmdb, error)("injected"), wrapped, _CURSOR_DELETE))
        with pytest.raises(expected) as caught:
            agent.reset_group(GROUP)
        monkeypatch.undo()
        hit = failpoints.hit
        monkeypatch.setattr(failpoints, "hit", lambda name: (
            raising(getattr(lmdb, error)("injected"), wrapped, _CURSOR_DELETE)() if name == "agent.before_commit" else hit(name)))
        with pytest.raises(expected) as at_commit:
            with agent.begin() as tx:
                tx.advance_cursor(GROUP)
                tx._dirty.add(GROUP)
        monkeypatch.undo()
        for raised in (caught.value, at_commit.value):
            assert type(raised) is expected
            if expected is Corruption:
                assert raised.detail["reason"] == "agent" and error in raised.message
        assert (agent.projection_digest(), agent.head(GROUP)) == before


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside SystemError"])
@pytest.mark.parametrize("error", ["CorruptedError", "PageNotFoundError", "InvalidError", "BadTxnError", "BadValsizeError",
                                   "BadDbiError", "IncompatibleError", "CursorFullError", "PageFullError", "MapFullError",
                                   "DiskError", "Error"])
def test_each_lmdb_error_inside_apply_advance_cursor_and_apply_many_is_typed_as_at_the_commit(tmp_path, monkeypatch, error, wrapped):
    """``apply``, ``apply_many`` and ``advance_cursor`` made every LMDB error they met the store's
    damage (``CORRUPTION``, "delete the agent store and rebuild it"), a full map and a failed disk
    among them, where the same error at the commit was ``LIMIT_EXCEEDED`` or ``STORAGE_FAILED``.
    They type it as the rest of a local transaction does: the errors that damaged pages give are
    ``CORRUPTION`` (reason ``agent``), the others as ``translate`` types them. Nothing is written."""
    from mwpstore import agent_store
    from mwpstore.errors import LimitExceeded, ProjectionFailed, StorageFailed

    expected = {"MapFullError": LimitExceeded, "DiskError": StorageFailed, "Error": StorageFailed}.get(error, Corruption)
    events = workload("g-2", 3, seed=3)
    path = tmp_path / "agent"
    with _two_groups(path, [GROUP]) as agent:
        before = agent.projection_digest(), agent.head(GROUP)
        monkeypatch.setattr(agent_store, "_load_head", raising(getattr(lmdb, error)("injected"), wrapped, _CURSOR_DELETE))
        calls = {
            "apply": lambda tx: tx.apply(events[0]),
            "apply_many": lambda tx: tx.apply_many(events),
            "advance_cursor": lambda tx: tx.advance_cursor("g-2"),
        }
        for name, call in calls.items():
            with pytest.raises(expected) as caught:
                with agent.begin() as tx:
                    call(tx)
            assert type(caught.value) is expected, name
            if expected is Corruption:
                assert caught.value.detail["reason"] == "agent" and error in caught.value.message
            elif expected is LimitExceeded:
                assert caught.value.detail["field"] == "map_size"
            # caught inside the block, the error is the same (each of the three types it itself)
            # and the transaction is failed: LMDB refuses the rest of it, so the block's end aborts
            with pytest.raises(ProjectionFailed) as ended:
                with agent.begin() as tx:
                    with pytest.raises(expected):
                        call(tx)
            assert ended.value.detail["reason"] == expected.__name__, name
        monkeypatch.undo()
        assert (agent.projection_digest(), agent.head(GROUP)) == before
        assert agent.groups() == [GROUP]


def test_a_system_error_without_an_lmdb_cause_out_of_apply_passes_unchanged(tmp_path, monkeypatch):
    """Only a ``SystemError`` the binding raised around an LMDB error is typed by ``apply``,
    ``apply_many`` and ``advance_cursor``: any other passes unchanged (a bug, as a projection's
    errors pass), and the transaction is not marked failed by it."""
    from mwpstore import agent_store

    events = workload("g-2", 3, seed=3)
    with _two_groups(tmp_path / "agent", [GROUP]) as agent:
        monkeypatch.setattr(agent_store, "_load_head", raising(SystemError("not LMDB's"), False))
        for call in (lambda tx: tx.apply(events[0]), lambda tx: tx.apply_many(events), lambda tx: tx.advance_cursor("g-2")):
            with pytest.raises(SystemError, match="not LMDB's"):
                with agent.begin() as tx:
                    with pytest.raises(SystemError, match="not LMDB's"):
                        call(tx)
                    assert tx._failed is None
                    raise SystemError("not LMDB's")  # the block ends by it: aborted, nothing written
        monkeypatch.undo()


def test_a_full_map_met_by_apply_many_s_own_flush_is_limit_exceeded_inside_the_block(tmp_path, monkeypatch):
    """``apply_many`` writes its caches itself once a run fills them (``_WRITE_CACHE_ENTRIES_MAX``
    entries), outside any ``apply``: a full map met there is ``LIMIT_EXCEEDED`` (field
    ``map_size``) to a caller inside the block too, and the transaction can only abort."""
    from mwpstore import agent_store
    from mwpstore.errors import LimitExceeded, ProjectionFailed

    events = workload(GROUP, 200, seed=2)
    with AgentStore.open(tmp_path / "agent") as agent:
        monkeypatch.setattr(agent_store, "_WRITE_CACHE_ENTRIES_MAX", 50)
        monkeypatch.setattr(agent_store._Tables, "put_many", raising(lmdb.MapFullError("injected"), False))
        with pytest.raises(ProjectionFailed) as ended:
            with agent.begin() as tx:
                with pytest.raises(LimitExceeded) as caught:
                    tx.apply_many(events)
                assert caught.value.detail["field"] == "map_size"
        assert ended.value.detail["reason"] == "LimitExceeded"
        monkeypatch.undo()
        assert agent.head(GROUP).applied_seq == 0


def test_a_full_map_met_while_events_are_applied_is_limit_exceeded_not_damage(tmp_path):
    """With full checks and a projection, ``apply`` writes as it goes, so a map too small for a
    batch fills inside ``apply``: that was ``CORRUPTION`` ("the agent store is damaged
    (MapFullError ...); delete the agent store and rebuild it"), a remedy that would meet the same
    full map. It is ``LIMIT_EXCEEDED`` (field ``map_size``), as when the commit fills the map; the
    store is unchanged and takes the next transaction."""
    from mwpstore.errors import LimitExceeded

    events = workload(GROUP, 3000, seed=1)
    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()], map_size=256 * 1024) as agent:
        with pytest.raises(LimitExceeded) as caught:
            with agent.begin() as tx:
                for event in events:
                    tx.apply(event)
        assert caught.value.detail["field"] == "map_size" and "larger map size" in caught.value.message
        assert agent.head(GROUP).applied_seq == 0
        with agent.begin() as tx:
            tx.apply(events[0])
        assert agent.head(GROUP).applied_seq == 1


def test_a_full_map_caught_inside_the_block_leaves_a_failed_transaction_not_damage(tmp_path):
    """A full map met where ``apply`` writes a buffered Event (no projection, so nothing else
    marks the transaction failed) is ``LIMIT_EXCEEDED``, the error ``apply`` documents for a
    malformed Event after which the transaction stays usable. LMDB refuses the rest of that
    transaction (``MDB_BAD_TXN``): a caller that caught it and went on was told the store is
    damaged (``CORRUPTION``, "delete the agent store and rebuild it") by the next ``apply``, by
    ``advance_cursor`` and by the commit at the block's end. The transaction is failed: each is
    ``PROJECTION_FAILED`` naming the ``LimitExceeded``, nothing is written, and the store takes
    the next transaction."""
    from mwpstore.errors import LimitExceeded, ProjectionFailed

    events = workload(GROUP, 3000, seed=1)
    with AgentStore.open(tmp_path / "agent", map_size=256 * 1024) as agent:
        with pytest.raises(ProjectionFailed) as ended:
            with agent.begin() as tx:
                with pytest.raises(LimitExceeded) as caught:
                    for event in reversed(events[1:]):  # each one buffered, beyond the gap at 1
                        tx.apply(event)
                assert caught.value.detail["field"] == "map_size"
                for call in (lambda: tx.apply(events[0]), lambda: tx.advance_cursor(GROUP)):
                    with pytest.raises(ProjectionFailed) as refused:
                        call()
                    assert refused.value.detail["reason"] == "LimitExceeded"
        assert ended.value.detail["reason"] == "LimitExceeded"
        assert isinstance(ended.value.__cause__, LimitExceeded)
        assert agent.head(GROUP).applied_seq == 0 and agent.head(GROUP).buffered == 0
        with agent.begin() as tx:
            tx.apply(events[0])
        assert agent.head(GROUP).applied_seq == 1


def test_a_full_map_met_by_a_projection_s_write_fails_the_transaction_naming_limit_exceeded(tmp_path):
    """A full map met by a projection's write fails the transaction there (``_run_projection``)
    with the LMDB error itself; the refusals after it name the typed error (``LimitExceeded``),
    as ``apply`` raised it, not ``MapFullError``."""
    from mwpstore.errors import LimitExceeded, ProjectionFailed

    events = workload(GROUP, 3000, seed=1)
    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()], map_size=256 * 1024) as agent:
        with pytest.raises(ProjectionFailed) as ended:
            with agent.begin() as tx:
                with pytest.raises(LimitExceeded):
                    for event in events:
                        tx.apply(event)
                with pytest.raises(ProjectionFailed) as refused:
                    tx.advance_cursor(GROUP)
                assert refused.value.detail["reason"] == "LimitExceeded"
        assert ended.value.detail["reason"] == "LimitExceeded"
        assert agent.head(GROUP).applied_seq == 0


@pytest.mark.parametrize("given", ["events", "bytes"])
def test_an_event_limit_exceeded_other_than_a_full_map_is_still_a_rejected_event(tmp_path, monkeypatch, given):
    """Only a full map (field ``map_size``) ends a ``deliver_batch``: any other ``LIMIT_EXCEEDED``
    out of ``apply`` is the Event's fault, counted as rejected, and the rest of the batch applies."""
    from mwpstore.agent_store import AgentTransaction
    from mwpstore.delivery import DeliveryStats, deliver_batch
    from mwpstore.errors import LimitExceeded
    from mwpstore.messages import encode_event

    events = workload(GROUP, 5, seed=1)
    batch = events if given == "events" else [encode_event(event) for event in events]
    original = AgentTransaction.apply

    def apply(self, event):
        if event is batch[1] or (type(event) is not bytes and event.seq == 2):
            raise LimitExceeded("the Event is too large", field="body")
        return original(self, event)

    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()]) as agent:
        monkeypatch.setattr(AgentTransaction, "apply", apply)
        stats = DeliveryStats()
        deliver_batch(agent, GROUP, batch, stats)
        assert stats.rejected == 1 and stats.rejections[0].detail == {"field": "body"}
        assert agent.head(GROUP).applied_seq == 1 and agent.head(GROUP).buffered == 3


@pytest.mark.parametrize("given", ["events", "bytes"])
def test_a_full_map_met_by_deliver_batch_is_limit_exceeded_not_a_rejected_event(tmp_path, given):
    """``deliver_batch`` counts an Event that ``apply`` refuses with ``LIMIT_EXCEEDED`` as rejected
    and goes on with the next. Once ``apply`` typed a full map as ``LIMIT_EXCEEDED`` (field
    ``map_size``), that map was counted as the Event's fault: the Event skipped, its
    ``LimitExceeded`` in ``stats.rejections``, and the next Event met the failed transaction
    (``PROJECTION_FAILED``, "MapFullError, e.g. in an application projection"); before that it
    was ``CORRUPTION``. A full map ends the batch, ``LIMIT_EXCEEDED`` with nothing applied and no
    Event counted as rejected, for a batch of Events (``apply_many``) and of their bytes (one
    ``apply`` each)."""
    from mwpstore.delivery import DeliveryStats, deliver_batch
    from mwpstore.errors import LimitExceeded
    from mwpstore.messages import encode_event

    events = workload(GROUP, 3000, seed=1)
    batch = events if given == "events" else [encode_event(event) for event in events]
    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()], map_size=256 * 1024) as agent:
        stats = DeliveryStats()
        with pytest.raises(LimitExceeded) as caught:
            deliver_batch(agent, GROUP, batch, stats)
        assert caught.value.detail["field"] == "map_size"
        assert (stats.rejected, stats.rejections) == (0, [])
        assert agent.head(GROUP).applied_seq == 0
        assert deliver_batch(agent, GROUP, batch[:10]) == 10


def test_an_applied_event_whose_inbox_key_damage_already_holds_is_corruption_not_an_overwrite(tmp_path):
    """One bit flipped in the sequence of a Group's last inbox key (4 read as 5) keeps the file in
    key order, so the open's structural check passes it. Applying Event 5 then wrote its inbox
    entry over the damaged one: the damage was gone, and with it Event 4's entry, so
    ``inbox_seqs`` answered [1, 2, 3, 5] without an error. A new inbox entry is now written
    without overwriting: an existing key is ``CORRUPTION`` and the transaction writes nothing."""
    events = workload(GROUP, 6, seed=5)
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for event in events[:4]:
                tx.apply(event)
            tx.advance_cursor(GROUP)
    _flip_in_live_key(path, GROUP.encode() + b"\x00" + (4).to_bytes(8, "big"), 11, 0)
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:  # the structural check runs
        with pytest.raises(Corruption):
            agent.inbox_seqs(GROUP)
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(events[4])
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent_checksum", "inbox")
        assert agent.head(GROUP).applied_seq == 4
        with pytest.raises(Corruption):
            agent.inbox_seqs(GROUP)


def test_applied_events_whose_second_inbox_key_damage_already_holds_are_corruption_naming_that_key(tmp_path):
    """The no-overwrite write of several inbox entries at once: Event 4's key flipped to 6 (bit
    1 of its sequence; still in key order), then Events 5 and 6 applied in one transaction. The
    entry written for 5 is sound and the caller's own; the error names the key that already held
    another entry, 6, by its failed seal."""
    events = workload(GROUP, 6, seed=5)
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            tx.apply_many(events[:4])
    _flip_in_live_key(path, GROUP.encode() + b"\x00" + (4).to_bytes(8, "big"), 11, 1)
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:  # the structural check runs
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply_many(events[4:6])
        seq_6 = GROUP + "\x00" + (6).to_bytes(8, "big").decode()
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_checksum", seq_6)
        assert agent.head(GROUP).applied_seq == 4


def _lost_intent_is_missing(agent: AgentStore, group: str, key: str, *, other: str) -> None:
    """Delete ``group``'s outbox entry of ``key`` from the values' tree (its presence entry kept, as
    a damaged key moved away leaves it): ``intents(group)`` is ``CORRUPTION`` (``agent_missing``,
    naming the key), and ``other``'s intents still answer."""
    lost = group.encode() + b"\x00" + key.encode()
    with agent._env.begin(write=True) as txn:
        assert txn.delete(lost, db=_raw(agent, b"outbox"))
    with pytest.raises(Corruption) as caught:
        agent.intents(group)
    assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_missing", lost.decode())
    assert [intent.group for intent in agent.intents(other)] == [other]

def test_a_range_past_the_last_entry_of_the_database_whose_entries_were_lost_is_corruption_not_empty(tmp_path):
    """The presence check of a range that finds no entry at or after its start: the last Group's
    only outbox entry lost from the values' tree (its presence kept, as a damaged key moved away
    leaves it), so that the search for ``g-3`` finds nothing and the database's last entry is
    g-2's, sound and before it. ``intents("g-3")`` is ``CORRUPTION`` (``agent_missing``), not []."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            tx.record_intent("g-2", mission="m", workitem="wi2", ownership_epoch=1, operation="bill")
            key = tx.record_intent("g-3", mission="m", workitem="wi3", ownership_epoch=1, operation="page").key
        _lost_intent_is_missing(agent, "g-3", key, other="g-2")


def test_a_range_whose_last_entry_a_later_write_hid_is_corruption_not_an_empty_answer(tmp_path):
    """One bit flipped in the Group of the outbox's last key (``g-2`` -> ``o-2``) keeps the file in
    key order (the open's structural check passes it); ``intents("g-2")`` meets it as the entry
    that ends the range and fails its seal. A later ``record_intent`` in ``g-3`` puts a sound key
    between the two, and ``intents("g-2")`` then answered [] without an error. A range over a
    database with presence entries now asks the presence tree whether a key of the range lies
    before the first entry it served or after the last: ``CORRUPTION`` (``agent_missing``)."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            tx.record_intent("g-1", mission="m", workitem="wi1", ownership_epoch=1, operation="notify")
            key = tx.record_intent("g-2", mission="m", workitem="wi2", ownership_epoch=1, operation="bill").key
    _flip_in_live_key(path, b"g-2\x00" + key.encode(), 0, 3)
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:  # the structural check runs
        with pytest.raises(Corruption):
            agent.intents("g-2")
        with agent.begin() as tx:
            tx.record_intent("g-3", mission="m", workitem="wi3", ownership_epoch=1, operation="page")
        with pytest.raises(Corruption) as caught:
            agent.intents("g-2")
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_missing", "g-2\x00" + key)
        assert [intent.group for intent in agent.intents("g-1")] == ["g-1"]  # a sound range still answers


@pytest.mark.parametrize("change", ["delete the first row read", "put a row before the first"])
def test_a_projection_that_writes_to_the_rows_it_is_reading_is_served_not_corruption(tmp_path, change):
    """A projection may write to the rows of its own ``view.items(prefix)`` while it reads them (a
    ``ProjectionView`` is bound to the local transaction): deleting the row it has just read, or
    putting one before the first. The range's check that the presence tree holds no key of the
    range before its first entry ran when the range ended, after those writes, and the apply was
    ``CORRUPTION`` ("lost the entry" at the next row, or at the new one). It runs before the first
    entry is served now."""

    class Rewriting:
        name = "rows"

        def apply(self, view, event):
            if event.seq == 1:
                for row in (b"a1", b"a2", b"a3"):
                    view.put(row, b"x")
            elif event.seq == 2:
                for row, _ in view.items(b"a"):
                    if change == "delete the first row read" and row == b"a1":
                        view.delete(row)
                    elif change == "put a row before the first" and row == b"a3":
                        view.put(b"a0", b"y")

    events = workload(GROUP, 2, seed=3)[:2]
    with AgentStore.open(tmp_path / "agent", projections=[Rewriting()]) as agent:
        for event in events:
            with agent.begin() as tx:
                tx.apply(event)
        rows = [row for row, _ in agent.projection_items(GROUP, "rows")]
        assert rows == ([b"a2", b"a3"] if change == "delete the first row read" else [b"a0", b"a1", b"a2", b"a3"])
        assert agent.head(GROUP).applied_seq == 2


def test_a_range_whose_last_entry_is_lost_while_the_next_group_follows_is_corruption_not_a_short_answer(tmp_path):
    """The presence tree's check after the last entry a range served: g-2's second outbox entry
    lost from the values' tree (its presence kept, as a damaged key moved away would leave it),
    with g-3's entry after it, ended ``intents("g-2")`` at g-3's sound key with one intent of
    two; it is ``CORRUPTION`` (``agent_missing``, naming the lost key)."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            first = tx.record_intent("g-2", mission="m", workitem="wi1", ownership_epoch=1, operation="bill").key
            second = tx.record_intent("g-2", mission="m", workitem="wi2", ownership_epoch=1, operation="bill").key
            tx.record_intent("g-3", mission="m", workitem="wi3", ownership_epoch=1, operation="page")
        _lost_intent_is_missing(agent, "g-2", max(first, second), other="g-3")


def test_a_queued_workitem_whose_queue_key_damage_moved_onto_a_new_one_is_corruption_not_dropped(tmp_path):
    """One bit flipped in the WorkItem ID at the end of w1's queue key (``w1`` read as ``w3``)
    keeps the file in key order, so the open's structural check passes it, and ``work_queue``
    meets it and fails its seal. Queueing w3 then wrote w3's queue entry over it: the damage was
    gone, and w1's entry with it, so ``work_queue`` answered [w3] without an error while w1 was
    still queued (the queue keeps no presence entries to miss it). Every queue key written is new
    (it ends with its WorkItem's ID, whose old entry is deleted first), so it is now written
    without overwriting: ``CORRUPTION`` and the transaction writes nothing."""
    from agent_store_support import ChainBuilder, workitem_state
    from mwpstore.agent_store import _queue_suffix

    chain = ChainBuilder(GROUP)
    chain.event("group.create", f"group:{GROUP}", {f"group:{GROUP}": {"org": "org-1", "status": "active"}}, {"org": "org-1"})
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": workitem_state("m1", "queued")})
    chain.event("workitem.create", "workitem:w3", {"workitem:w3": workitem_state("m1", "queued")})
    path = tmp_path / "agent"
    with AgentStore.open(path) as agent:
        with agent.begin() as tx:
            tx.apply_many(chain.events[:2])
        assert [entry.workitem for entry in agent.work_queue(GROUP, 10**6)] == ["w1"]
    key = GROUP.encode() + b"\x00" + _queue_suffix("w1", 0, 0)
    _flip_in_live_key(path, key, len(key) - 1, 1)  # "1" (0x31) -> "3" (0x33)
    with AgentStore.open(path) as agent:  # the structural check runs
        with pytest.raises(Corruption):
            agent.work_queue(GROUP, 10**6)
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(chain.events[2])
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent_checksum", "queue")
        assert agent.head(GROUP).applied_seq == 2
        with pytest.raises(Corruption):
            agent.work_queue(GROUP, 10**6)  # nothing was written over it: still reported


def test_a_new_aggregate_written_over_a_state_key_damage_moved_there_is_corruption_not_a_state_lost_from_the_range(tmp_path):
    """One bit flipped in the last byte of ``mission:m1``'s state key (read as ``mission:m3``, no
    key between them) keeps the file in key order. Creating ``mission:m3`` then wrote its state
    over the moved entry: ``state("mission:m1")`` said ``CORRUPTION`` (its presence entry
    remained), but ``states(GROUP)``, whose range checks presence only at its ends, answered
    without m1 and no error. Every key that gains its presence entry in a write must gain its
    entry too; one fewer is ``CORRUPTION`` and the transaction writes nothing."""
    from agent_store_support import ChainBuilder, workitem_state

    chain = ChainBuilder(GROUP)
    chain.event("group.create", f"group:{GROUP}", {f"group:{GROUP}": {"org": "org-1", "status": "active"}}, {"org": "org-1"})
    chain.event("mission.create", "mission:m1", {"mission:m1": {"title": "a", "status": "open", "cost_spent": 0}})
    chain.event("workitem.create", "workitem:w1", {"workitem:w1": workitem_state("m1", "blocked")})
    chain.event("mission.create", "mission:m3", {"mission:m3": {"title": "c", "status": "open", "cost_spent": 0}})
    path = tmp_path / "agent"
    with AgentStore.open(path) as agent:
        with agent.begin() as tx:
            tx.apply_many(chain.events[:3])
        assert sorted(agent.states(GROUP)) == ["group:g-1", "mission:m1", "workitem:w1"]
    key = GROUP.encode() + b"\x00mission:m1"
    _flip_in_live_key(path, key, len(key) - 1, 1)
    with AgentStore.open(path) as agent:  # the structural check runs
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(chain.events[3])
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent_order", "state")
        assert agent.head(GROUP).applied_seq == 3
        with pytest.raises(Corruption):
            agent.states(GROUP)  # the moved entry is still there, and still reported


def test_a_new_intent_written_over_an_outbox_key_damage_moved_there_is_corruption_not_an_intent_lost_from_the_range(tmp_path):
    """The single write's form of the test above: another intent's outbox entry moved by damage
    onto the outbox key of an intent recorded next (its key map ``intent_group`` does not hold
    that key yet, so nothing reads the outbox entry first). The write erased the moved entry, and
    ``intents(GROUP)`` answered without that intent, no error. An entry found under a key written
    for the first time must pass its seal: it fails it, ``CORRUPTION``; nothing is written."""
    from mwpstore.work_keys import external_idempotency_key

    path = tmp_path / "agent"
    with AgentStore.open(path) as agent:
        with agent.begin() as tx:
            keys = sorted(tx.record_intent(GROUP, mission="m", workitem=f"wi{n}", ownership_epoch=1, operation="bill").key
                          for n in range(4))
        moved = keys[1]  # inside the range: its ends' presence checks do not meet it
        recorded = external_idempotency_key("m", "wi9", 1, "bill")
        prefix = GROUP.encode() + b"\x00"
        outbox = _raw(agent, b"outbox")
        with agent._env.begin(write=True) as txn:  # as a flipped key leaves it: the entry, under another key
            stored = txn.get(prefix + moved.encode(), db=outbox)
            assert txn.delete(prefix + moved.encode(), db=outbox)
            txn.put(prefix + recorded.encode(), stored, db=outbox)
        with pytest.raises(Corruption):
            agent.intents(GROUP)
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.record_intent(GROUP, mission="m", workitem="wi9", ownership_epoch=1, operation="bill")
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_checksum", GROUP + "\x00" + recorded)
        with pytest.raises(Corruption):
            agent.intents(GROUP)
        assert agent.intent(recorded) is None


def test_a_sound_entry_whose_presence_entry_alone_was_lost_is_written_again_not_refused(tmp_path, events):
    """The check of a key written for the first time is its entry's seal: a Group head whose
    presence entry alone was lost passes it, so the next commit writes both again, as before."""
    with _filled(tmp_path / "agent", events[:5]) as agent:
        with agent._env.begin(write=True) as txn:
            assert txn.delete(agent._tables.tags[b"heads"] + GROUP.encode(), db=agent._tables.presence)
        with agent.begin() as tx:
            assert tx.apply(events[5]).name == "APPLIED"
        with agent._env.begin() as txn:
            assert txn.get(agent._tables.tags[b"heads"] + GROUP.encode(), db=agent._tables.presence) == b""
        assert agent.head(GROUP).applied_seq == 6


class _RowsDeletingAnAbsentOne:
    """Puts a row per Event (a1, a2, a3, then a5) and, at Event 5, deletes a4, which it never
    wrote: an application's "delete it if it is there"."""

    name = "rows"

    def apply(self, view, event):
        if event.seq == 5:
            view.delete("a4")
        else:
            view.put("a5" if event.seq == 4 else f"a{event.seq}", b"v")


def test_a_deletion_of_a_key_damage_moved_another_entry_onto_is_corruption_not_an_erased_entry(tmp_path):
    """Row a3's entry moved by damage onto the key a4 (in key order), which the projection deletes
    though it never wrote it. The deletion of one key deleted without reading: it erased the moved
    entry unseen, and ``projection_items`` then answered a1, a2, a5 without an error (a3's presence
    entry remained, but a range checks presence at its ends only). The entry is now unsealed
    before it is deleted: ``CORRUPTION`` (``agent_checksum`` at a4), nothing written."""
    events = workload(GROUP, 5, seed=5)
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[_RowsDeletingAnAbsentOne()]) as agent:
        with agent.begin() as tx:
            tx.apply_many(events[:4])
        assert [key for key, _ in agent.projection_items(GROUP, "rows")] == [b"a1", b"a2", b"a3", b"a5"]
        prefix = GROUP.encode() + b"\x00rows\x00"
        projection = _raw(agent, b"projection")
        with agent._env.begin(write=True) as txn:  # as a flipped key leaves it: the entry, under another key
            stored = txn.get(prefix + b"a3", db=projection)
            assert txn.delete(prefix + b"a3", db=projection)
            txn.put(prefix + b"a4", stored, db=projection)
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(events[4])
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_checksum", (prefix + b"a4").decode())
        assert agent.head(GROUP).applied_seq == 4
        with pytest.raises(Corruption):
            agent.projection_items(GROUP, "rows")


def test_a_deletion_of_one_key_says_whether_its_entry_existed(tmp_path, events):
    """``ProjectionView.delete`` answers True for a row it deleted and False for one that was not
    there (the seal check before the deletion changes neither); the row and its presence go."""
    answers = []

    class Rows:
        name = "rows"

        def apply(self, view, event):
            if event.seq == 1:
                view.put("a", b"v")
            elif event.seq == 2:
                answers.extend([view.delete("a"), view.delete("a"), view.delete("never")])

    with AgentStore.open(tmp_path / "agent", projections=[Rows()]) as agent:
        with agent.begin() as tx:
            tx.apply_many(events[:2])
        assert answers == [True, False, False]
        assert agent.projection_items(GROUP, "rows") == [] and agent.projection_get(GROUP, "rows", "a") is None


@pytest.mark.parametrize("flag", [0x04, 0x08], ids=["dupsort", "integerkey"])
def test_a_database_record_given_flags_is_corruption_at_open_not_writes_that_add_duplicates(tmp_path, events, flag):
    """Found by the all-bits damage sweep (an index's `acks` and `heads` records with a bit of
    their flags flipped to ``MDB_DUPSORT``, opened without the structural walk: a later write
    added a duplicate instead of replacing, and the answers went wrong). Every database is created
    with no flags, so any flag at open is CORRUPTION (``database_flags``), before any write."""
    path = tmp_path / "agent"
    _filled(path, events).close()
    assert set_database_flag(str(path / "lmdb"), b"heads", flag) >= 1
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False)
    assert caught.value.detail["reason"] == "database_flags"


def test_a_write_into_a_database_whose_branch_pages_loop_is_corruption_not_a_storage_failure(tmp_path):
    """A cycle of damaged branch pages (the inbox's root naming itself as each child), in an open
    without the structural walk: the commit's write searched until LMDB's cursor stack was full
    (``CursorFullError``, an internal error of LMDB), which was ``STORAGE_FAILED`` ("LMDB failed"),
    an answer that retrying or reopening never changes. It is the store's damage: ``CORRUPTION``
    (reason ``agent``) with the remedy, and nothing is applied."""
    events = workload(GROUP, 400, seed=5)
    path = tmp_path / "agent"
    with _filled(path, events[:300]) as agent:
        head = agent.head(GROUP)
    loop_database_root(str(path / "lmdb"), b"inbox")
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                for event in events[300:]:
                    tx.apply(event)
                tx.advance_cursor(GROUP)
        assert caught.value.detail["reason"] == "agent"
        assert "CursorFullError" in caught.value.message
        assert agent.head(GROUP) == head


# -- every write of the AgentStore against a looped root of each database ------------------------


def _looped_copy(source: str, tmp_path, database: bytes) -> str:
    """A copy of the AgentStore at ``source`` whose ``database`` has a cycle of damaged branch
    pages at its root (``loop_database_root``): its path."""
    import shutil

    path = str(tmp_path / "agent")
    shutil.copytree(source, path)
    loop_database_root(os.path.join(path, "lmdb"), database)
    return path


def _probe_answer(agent: AgentStore, call):
    """``call()``'s answer in ``agent``, a store with a looped database: ("ok", its result), or
    (the error's code, None). A ``CORRUPTION`` must name the cycle (reason ``agent``) and leave
    nothing committed."""
    from mwpstore.errors import MwpError

    before = agent._tables.env.info()["last_txnid"]
    try:
        return "ok", call()
    except MwpError as exc:
        if isinstance(exc, Corruption):
            assert exc.detail["reason"] == "agent" and "CursorFullError" in exc.message, exc.message
            assert agent._tables.env.info()["last_txnid"] == before  # nothing committed
        return exc.code, None


_PROBED_GROUPS = 150
_PROBED_DATABASES = ["heads", "inbox", "buffer", "state", "queue", "queue_index", "projection", "outbox", "intent_group",
                     "offline", "presence"]
# By database, the writes answered CORRUPTION; every other write answers as over a sound store
# (mark_uncertain of an intent never dispatched: INVALID_STATE).
_PROBE_DAMAGE = {
    "heads": "apply_next apply_duplicate apply_many_new apply_new_group advance_cursor deliver_batch reset_group "
             "restore_verified rebuild_group prune_inbox",
    "inbox": "apply_next apply_duplicate apply_many_new apply_new_group deliver_batch reset_group restore_verified "
             "rebuild_group prune_inbox",
    "buffer": "apply_next deliver_batch reset_group restore_verified rebuild_group",
    "state": "apply_next apply_many_new apply_new_group deliver_batch reset_group restore_verified rebuild_group",
    "queue": "apply_next apply_many_new deliver_batch reset_group restore_verified rebuild_group",
    "queue_index": "apply_next apply_many_new deliver_batch reset_group restore_verified rebuild_group",
    "projection": "apply_next apply_many_new apply_new_group deliver_batch reset_group restore_verified rebuild_group",
    "outbox": "record_intent mark_dispatched record_receipt mark_uncertain reconcile dispatch",
    "intent_group": "record_intent mark_dispatched record_receipt mark_uncertain reconcile dispatch",
    "offline": "service_unreachable",
    "presence": "apply_next apply_many_new apply_new_group record_intent deliver_batch reset_group restore_verified "
                "rebuild_group prune_inbox mark_dispatched record_receipt dispatch service_unreachable",
}


@pytest.fixture(scope="module")
def probe_store(tmp_path_factory):
    """An AgentStore in which every database but ``meta`` has a branch page as its root: 150
    Groups of 20 Events each (the last buffered, the one before it missing), an outbox intent and
    an outage in each. Returns its path, the Groups' histories (and one of a Group never applied,
    g-new) and the intents' keys."""
    from mwpstore.offline import OfflineGuard

    path = str(tmp_path_factory.mktemp("probe") / "agent")
    histories = {f"g-{i}": workload(f"g-{i}", 20, seed=i) for i in range(1, _PROBED_GROUPS + 1)}
    histories["g-new"] = workload("g-new", 6, seed=999)
    keys = {}
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for number in range(1, _PROBED_GROUPS + 1):
                group = f"g-{number}"
                for event in histories[group][:-2]:
                    tx.apply(event)
                tx.advance_cursor(group)
                tx.apply(histories[group][-1])  # buffered behind the missing one
                keys[group] = tx.record_intent(group, mission=f"m{number}", workitem="w1", ownership_epoch=1, operation="notify").key
        for number in range(1, _PROBED_GROUPS + 1):
            OfflineGuard(agent, f"g-{number}", "agent-a", grace_ms=60_000).service_unreachable(1_000)
    return path, histories, keys


def _probe_write(agent, write, histories, keys):
    from types import SimpleNamespace

    from mwpstore.delivery import ListSource, deliver_batch, rebuild_group
    from mwpstore.messages import Effect
    from mwpstore.offline import OfflineGuard

    def in_transaction(call):
        with agent.begin() as tx:
            return call(tx)

    g1 = histories["g-1"]
    snapshot = SimpleNamespace(group="g-2", org="org-1", seq=40, head_hash=b"\x01" * 32,
                               aggregates=[Effect(aggregate="group:g-2", revision=1, state={"org": "org-1", "status": "active"})])
    calls = {
        "apply_next": lambda: in_transaction(lambda tx: (tx.apply(g1[-2]), tx.advance_cursor("g-1"))),
        "apply_duplicate": lambda: in_transaction(lambda tx: tx.apply(g1[0])),
        "apply_many_new": lambda: in_transaction(lambda tx: tx.apply_many(histories["g-new"])),
        "apply_new_group": lambda: in_transaction(lambda tx: (tx.apply(histories["g-new"][0]), tx.advance_cursor("g-new"))),
        "advance_cursor": lambda: in_transaction(lambda tx: tx.advance_cursor("g-2")),
        "record_intent": lambda: in_transaction(
            lambda tx: tx.record_intent("g-3", mission="m-new", workitem="w9", ownership_epoch=1, operation="page")),
        "deliver_batch": lambda: deliver_batch(agent, "g-1", [g1[-2]]),
        "reset_group": lambda: agent.reset_group("g-2"),
        "restore_verified": lambda: agent.restore_verified(snapshot, group="g-2"),
        "rebuild_group": lambda: rebuild_group(agent, ListSource(histories["g-2"]), "g-2"),
        "prune_inbox": lambda: agent.prune_inbox("g-1"),
        "mark_dispatched": lambda: agent.mark_dispatched(keys["g-1"]),
        "record_receipt": lambda: agent.record_receipt(keys["g-1"], {"id": "r-1"}),
        "mark_uncertain": lambda: agent.mark_uncertain(keys["g-1"], "lost"),
        "reconcile": lambda: agent.reconcile(keys["g-1"], lambda intent: None),
        "dispatch": lambda: agent.dispatch(keys["g-1"], lambda intent: {"id": "r-1"}),
        "service_unreachable": lambda: OfflineGuard(agent, "g-new", "agent-a", grace_ms=1).service_unreachable(2_000),
    }
    return calls[write]()


_PROBED_WRITES = ["apply_next", "apply_duplicate", "apply_many_new", "apply_new_group", "advance_cursor", "record_intent",
                  "deliver_batch", "reset_group", "restore_verified", "rebuild_group", "prune_inbox", "mark_dispatched",
                  "record_receipt", "mark_uncertain", "reconcile", "dispatch", "service_unreachable"]


@pytest.mark.parametrize("write", _PROBED_WRITES)
@pytest.mark.parametrize("database", _PROBED_DATABASES)
def test_each_write_of_the_agent_store_over_a_looped_database_is_answered_as_damage(tmp_path, probe_store, database, write):
    """Each write of the AgentStore's API (a local transaction's apply, apply_many,
    advance_cursor and record_intent, delivery's batch and rebuild, a reset, a restore, the
    outbox's steps, an outage), in a store opened without the structural walk whose ``database``
    has a cycle of damaged branch pages: the write's own answer, or ``CORRUPTION`` (reason
    ``agent``) with nothing written; never ``STORAGE_FAILED``, an untyped error or a foreign one."""
    source, histories, keys = probe_store
    path = _looped_copy(source, tmp_path, database.encode())
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        answer, _ = _probe_answer(agent, lambda: _probe_write(agent, write, histories, keys))
    expected = "CORRUPTION" if write in _PROBE_DAMAGE[database].split() else "INVALID_STATE" if write == "mark_uncertain" else "ok"
    assert answer == expected


@pytest.mark.parametrize("call", ["get", "items", "put", "delete"])
def test_a_projection_s_call_over_a_looped_database_is_corruption_at_the_call(tmp_path, probe_store, call):
    """An application projection's ``view.get``, ``view.items``, ``view.put`` and ``view.delete``
    over a cycle of damaged branch pages (the ``projection`` database's) raised LMDB's own
    ``CursorFullError`` into the projection's code (typed only once it left ``apply``): a
    projection that catches ``MwpError`` met a foreign error. Each is ``CORRUPTION`` (reason
    ``agent``) at the call, and nothing is committed."""
    class Probing:
        name = "counter"

        def __init__(self) -> None:
            self.met: list[BaseException] = []

        def apply(self, view, event):
            try:
                {"get": lambda: view.get("total"), "items": lambda: list(view.items()),
                 "put": lambda: view.put("total", b"\x00" * 8), "delete": lambda: view.delete("total")}[call]()
            except Exception as exc:
                self.met.append(exc)
                raise

    source, histories, _ = probe_store
    path = _looped_copy(source, tmp_path, b"projection")
    projection = Probing()
    with AgentStore.open(path, projections=[projection], check_lmdb=False) as agent:
        before = agent._tables.env.info()["last_txnid"]
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                tx.apply(histories["g-1"][-2])
        assert caught.value is projection.met[0]
        assert len(projection.met) == 1 and isinstance(projection.met[0], Corruption), projection.met
        assert projection.met[0].detail["reason"] == "agent" and "CursorFullError" in projection.met[0].message
        assert agent._tables.env.info()["last_txnid"] == before


# -- every read of the AgentStore, and the OfflineGuard, against a looped root of each database -----

_PROBED_READS = ["head", "head_unknown", "cursor", "ack_position", "groups", "state", "state_missing", "revision", "aggregate",
                 "states", "work_queue", "checkpoint", "projection_get", "projection_items", "buffered_seqs", "inbox_seqs",
                 "projection_dump", "projection_dump_all", "projection_digest", "projection_digest_all", "intent",
                 "intent_unknown", "intents", "intents_all", "intents_pending", "tx_cursor", "tx_applied_seq", "tx_state",
                 "tx_revision", "outage", "offline"]
_DUMPS = "projection_dump projection_dump_all projection_digest projection_digest_all"
# By database, the reads answered CORRUPTION; every other read answers as over a sound store.
_READ_DAMAGE = {
    "heads": f"head head_unknown cursor ack_position groups {_DUMPS} tx_cursor tx_applied_seq",
    "inbox": "inbox_seqs",
    "buffer": "buffered_seqs",
    "state": f"state state_missing revision aggregate states work_queue checkpoint {_DUMPS} tx_state tx_revision",
    "queue": f"work_queue {_DUMPS}",
    "queue_index": _DUMPS,
    "projection": f"projection_get projection_items {_DUMPS}",
    "outbox": "intent intents intents_all intents_pending",
    "intent_group": "intent intent_unknown",
    "offline": "outage offline",
    "presence": f"head_unknown groups state_missing states projection_items buffered_seqs {_DUMPS} intent_unknown intents "
                "intents_all intents_pending",
}


def _probe_read(agent, read, keys):
    from mwpstore.errors import MwpError
    from mwpstore.offline import OfflineGuard

    def in_transaction(call):
        with agent.begin() as tx:
            try:
                return call(tx)
            except MwpError:
                raise
            except Exception as exc:  # at the call, not only out of the block
                raise AssertionError(f"a foreign error inside the block: {exc!r}") from exc

    guard = OfflineGuard(agent, "g-1", "agent-a", grace_ms=60_000)
    calls = {
        "head": lambda: agent.head("g-1"),
        "head_unknown": lambda: agent.head("g-none"),
        "cursor": lambda: agent.cursor("g-1"),
        "ack_position": lambda: agent.ack_position("g-1"),
        "groups": lambda: agent.groups(),
        "state": lambda: agent.state("g-1", "mission:m1"),
        "state_missing": lambda: agent.state("g-1", "mission:m-none"),
        "revision": lambda: agent.revision("g-1", "mission:m1"),
        "aggregate": lambda: agent.aggregate("g-1", "mission:m1"),
        "states": lambda: agent.states("g-1"),
        "work_queue": lambda: agent.work_queue("g-1", 10**9),
        "checkpoint": lambda: agent.checkpoint("g-1", "w1"),
        "projection_get": lambda: agent.projection_get("g-1", "counter", "total"),
        "projection_items": lambda: agent.projection_items("g-1", "counter"),
        "buffered_seqs": lambda: agent.buffered_seqs("g-1"),
        "inbox_seqs": lambda: agent.inbox_seqs("g-1"),
        "projection_dump": lambda: agent.projection_dump("g-1"),
        "projection_dump_all": lambda: agent.projection_dump(),
        "projection_digest": lambda: agent.projection_digest("g-1"),
        "projection_digest_all": lambda: agent.projection_digest(),
        "intent": lambda: agent.intent(keys["g-1"]),
        "intent_unknown": lambda: agent.intent("x" * 64),
        "intents": lambda: agent.intents("g-1"),
        "intents_all": lambda: agent.intents(),
        "intents_pending": lambda: agent.intents(pending_only=True),
        "tx_cursor": lambda: in_transaction(lambda tx: tx.cursor("g-1")),
        "tx_applied_seq": lambda: in_transaction(lambda tx: tx.applied_seq("g-1")),
        "tx_state": lambda: in_transaction(lambda tx: tx.state("g-1", "mission:m1")),
        "tx_revision": lambda: in_transaction(lambda tx: tx.revision("g-1", "mission:m1")),
        "outage": lambda: guard.outage(),
        "offline": lambda: guard.offline,
    }
    return calls[read]()


@pytest.mark.parametrize("read", _PROBED_READS)
@pytest.mark.parametrize("database", _PROBED_DATABASES)
def test_each_read_of_the_agent_store_over_a_looped_database_is_answered_as_damage(tmp_path, probe_store, database, read):
    """Each public read of the AgentStore (heads and Cursors, the mirror, the work queue,
    projections and their dump and digest, buffered and inbox sequences, the outbox, the reads of
    a local transaction, an outage), in a store opened without the structural walk whose
    ``database`` has a cycle of damaged branch pages: the read's own answer, or ``CORRUPTION``
    (reason ``agent``) at the call; never an untyped or foreign error, and nothing committed."""
    source, _, keys = probe_store
    path = _looped_copy(source, tmp_path, database.encode())
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        before = agent._tables.env.info()["last_txnid"]
        answer, _ = _probe_answer(agent, lambda: _probe_read(agent, read, keys))
        assert agent._tables.env.info()["last_txnid"] == before  # a read commits nothing, answered or not
    assert answer == ("CORRUPTION" if read in _READ_DAMAGE[database].split() else "ok")


_OFFLINE_GROUP = "g1"  # the work model's Group: its rules give agent w1 a started lease on wi1


@pytest.fixture(scope="module")
def offline_probe_store(probe_store, tmp_path_factory):
    """The store of ``probe_store`` with the work model's Group g1 (agent w1 holds a started lease
    on wi1; wi2 is queued), whose service is unreachable, and two Commands of w1 buffered (the
    second with an expected revision). Returns its path, the buffered records, a third Command not
    buffered, w1's signing key, and the time of the outage."""
    import shutil

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mwpstore.messages import Command
    from mwpstore.offline import OfflineGuard, sign_command
    from work_model_support import Harness

    source, _, _ = probe_store
    path = str(tmp_path_factory.mktemp("offline-probe") / "agent")
    shutil.copytree(source, path)
    key = Ed25519PrivateKey.generate()
    harness = Harness(_OFFLINE_GROUP)
    harness.signing_keys["w1"] = key
    harness.accept("owner", "group.create", _OFFLINE_GROUP, {"org": "org1"})
    harness.accept("owner", "membership.add", "w1", {"role": "worker", "public_key": key.public_key().public_bytes_raw().hex()},
                   cas=True)
    harness.accept("owner", "mission.create", "m1", {"title": "one", "cost_limit": 1_000, "approval_required": []})
    harness.create_workitem("wi1")
    harness.create_workitem("wi2")
    harness.claim_and_start("w1", "wi1")
    now, fence, revision = harness.now_ms, harness.fence("wi1"), harness.revision("workitem:wi1")

    def checkpoint(action: str, step: int, expected_revision: int | None = None) -> Command:
        return sign_command(Command(actor="w1", action_id=action, group=_OFFLINE_GROUP, kind="workitem.checkpoint", target="wi1",
                                    body={**fence, "checkpoint": {"step": step}}, expected_revision=expected_revision), key)

    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for event in harness.events():
                tx.apply(event)
            tx.advance_cursor(_OFFLINE_GROUP)
        guard = OfflineGuard(agent, _OFFLINE_GROUP, "w1", grace_ms=60_000)
        guard.service_unreachable(now)
        guard.buffer(checkpoint("c-1", 1), now_ms=now + 1, reversible=True)
        guard.buffer(checkpoint("c-2", 2, revision), now_ms=now + 2, reversible=True)
        records = guard.buffered()
    harness.close()
    return path, records, checkpoint("c-3", 3), key, now


_PROBED_GUARD_CALLS = ["permit", "permit_new_work", "buffer", "buffered", "rebase", "reconnect", "reconnect_rejected"]
# By database, the OfflineGuard's calls answered CORRUPTION; every other answers as over a sound
# store (permit_new_work: OFFLINE_REFUSED, reason new_work).
_GUARD_DAMAGE = {
    "state": "permit permit_new_work buffer rebase reconnect reconnect_rejected",
    "offline": "permit permit_new_work buffer buffered reconnect reconnect_rejected",
    "presence": "buffer buffered reconnect reconnect_rejected",
}


@pytest.mark.parametrize("call", _PROBED_GUARD_CALLS)
@pytest.mark.parametrize("database", _PROBED_DATABASES)
def test_each_call_of_the_offline_guard_over_a_looped_database_is_answered_as_damage(tmp_path, offline_probe_store, database, call):
    """Each call of the ``OfflineGuard`` that reads or writes the AgentStore (``permit``,
    ``buffer``, ``buffered``, ``rebase``, ``reconnect`` with a submit that answers a receipt and
    one that rejects), in a store opened without the structural walk whose ``database`` has a
    cycle of damaged branch pages: the call's own answer, or ``CORRUPTION`` (reason ``agent``)
    with nothing committed; never an untyped or foreign error."""
    from mwpstore.errors import RevisionMismatch
    from mwpstore.offline import BufferedState, OfflineGuard

    source, records, command, key, now = offline_probe_store
    path = _looped_copy(source, tmp_path, database.encode())

    def reject(rebased):
        raise RevisionMismatch("refused by the probe's authority", expected=0, actual=1)

    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        guard = OfflineGuard(agent, _OFFLINE_GROUP, "w1", grace_ms=60_000)
        calls = {
            "permit": lambda: guard.permit("wi1", now_ms=now + 3, reversible=True),
            "permit_new_work": lambda: guard.permit("wi2", now_ms=now + 3, reversible=True),
            "buffer": lambda: guard.buffer(command, now_ms=now + 3, reversible=True),
            "buffered": lambda: guard.buffered(),
            "rebase": lambda: guard.rebase(records[1], key),
            "reconnect": lambda: guard.reconnect(lambda rebased: {"seq": 9}, signing_key=key),
            "reconnect_rejected": lambda: guard.reconnect(reject, signing_key=key),
        }
        answer, outcome = _probe_answer(agent, calls[call])
        if answer == "ok" and call.startswith("reconnect"):
            state = BufferedState.SUBMITTED if call == "reconnect" else BufferedState.REJECTED
            assert [item.state for item in outcome] == [state, state] and not guard.offline
    expected = "CORRUPTION" if call in _GUARD_DAMAGE.get(database, "").split() else "OFFLINE_REFUSED" if call == "permit_new_work" else "ok"
    assert answer == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.lists(st.binary(min_size=1, max_size=12), max_size=12, unique=True),
       asked=st.lists(st.binary(min_size=1, max_size=12), max_size=12, unique=True),
       damage=st.lists(st.tuples(st.integers(min_value=0, max_value=20), st.sampled_from(["lose", "spoil"])), max_size=3))
def test_get_many_answers_and_refuses_as_get_does_key_by_key(tmp_path_factory, stored, asked, damage):
    """``SealedTables.get_many`` (a commit's reads of its WorkItems' queue index entries) gives
    what ``get`` gives for each key, in order, and refuses with the error of the first key that
    ``get`` refuses: an entry lost while its presence entry stayed, or one that fails its seal."""
    path = tmp_path_factory.mktemp("get-many") / "agent"
    prefix = GROUP.encode() + b"\x00"
    keys = [prefix + key for key in stored]
    with AgentStore.open(path) as agent:
        tables = agent._tables
        with agent._env.begin(write=True, buffers=True) as txn:
            tables.put_many(txn, b"queue_index", [(key, b"v" + key) for key in sorted(keys)])
            for at, how in damage:
                if keys:
                    key = keys[at % len(keys)]
                    if how == "lose":
                        txn.delete(key, db=_raw(agent, b"queue_index"))
                    else:
                        txn.put(key, b"spoiled!", db=_raw(agent, b"queue_index"))
        wanted = [prefix + key for key in asked] + keys[::2]
        wanted = list(dict.fromkeys(wanted))
        with agent._env.begin(write=True, buffers=True) as txn:
            expected: list = []
            error = None
            for key in wanted:
                try:
                    expected.append(tables.get(txn, b"queue_index", key))
                except Corruption as exc:
                    error = exc.detail
                    break
            if error is None:
                assert tables.get_many(txn, b"queue_index", wanted) == expected
            else:
                with pytest.raises(Corruption) as caught:
                    tables.get_many(txn, b"queue_index", wanted)
                assert caught.value.detail == error


@pytest.mark.parametrize("database,call", [("heads", "cursor"), ("heads", "applied_seq"), ("state", "state"), ("state", "revision"),
                                           ("outbox", "record_intent")])
def test_a_read_inside_a_local_transaction_over_a_looped_database_is_corruption_at_the_call(tmp_path, probe_store, database, call):
    """``tx.cursor``, ``tx.applied_seq``, ``tx.state``, ``tx.revision`` and ``tx.record_intent``
    over a cycle of damaged branch pages raised LMDB's own ``CursorFullError`` to the caller
    inside the block (typed only at the block's end): a caller that catches ``MwpError`` there met
    a foreign error, while ``apply`` and ``advance_cursor`` in the same transaction answer
    ``CORRUPTION``. Each answers ``CORRUPTION`` (reason ``agent``) at the call, the transaction
    can only abort, and nothing is committed."""
    from mwpstore.errors import ProjectionFailed

    source, _, _ = probe_store
    path = _looped_copy(source, tmp_path, database.encode())
    calls = {
        "cursor": lambda tx: tx.cursor("g-1"),
        "applied_seq": lambda tx: tx.applied_seq("g-1"),
        "state": lambda tx: tx.state("g-1", "mission:m1"),
        "revision": lambda tx: tx.revision("g-1", "mission:m1"),
        "record_intent": lambda tx: tx.record_intent("g-3", mission="m-new", workitem="w9", ownership_epoch=1, operation="page"),
    }
    with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
        before = agent._tables.env.info()["last_txnid"]
        with pytest.raises(Corruption) as caught:
            with agent.begin() as tx:
                calls[call](tx)
        assert caught.value.detail["reason"] == "agent" and "CursorFullError" in caught.value.message
        with pytest.raises(ProjectionFailed) as failed:  # caught inside the block: the transaction can only abort
            with agent.begin() as tx:
                with pytest.raises(Corruption):
                    calls[call](tx)
                tx.advance_cursor("g-2")
        assert failed.value.detail["reason"] == "Corruption"
        assert agent._tables.env.info()["last_txnid"] == before


def _arming_projection(tables_type, call, error, monkeypatch):
    """A projection that makes ``call`` (``get``, ``items``, ``put``, ``delete`` or ``state``) of
    its view, and only that call, raise ``error()`` from LMDB's side (the tables' read or write of
    the ``projection`` database, or the transaction's read of a state), catches what it meets and
    keeps it in ``met``, and returns normally."""
    from mwpstore.agent_store import AgentTransaction

    class Swallowing:
        name = "counter"

        def __init__(self) -> None:
            self.met: list[BaseException] = []
            self.armed = False

        def apply(self, view, event):
            self.armed = True
            try:
                {"get": lambda: view.get("total"), "items": lambda: list(view.items()),
                 "put": lambda: view.put("total", b"\x00" * 8), "delete": lambda: view.delete("total"),
                 "state": lambda: view.state("mission:m1")}[call]()
            except BaseException as exc:  # kept, not raised: the transaction must know by itself
                self.met.append(exc)
            finally:
                self.armed = False

    projection = Swallowing()

    def patched(owner, name, projection_only):
        real = getattr(owner, name)

        def method(self, *args, **kwargs):
            if projection.armed and (not projection_only or args[1] == b"projection"):
                if name == "range":
                    return (error() for _ in [0])  # a range reads LMDB only as it is stepped
                error()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(owner, name, method)

    if call == "state":
        patched(AgentTransaction, "_get_state", False)
    else:
        patched(tables_type, {"items": "range"}.get(call, call), True)
    return projection


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside SystemError"])
@pytest.mark.parametrize("call", ["get", "items", "put", "delete", "state"])
def test_an_lmdb_error_of_a_projection_s_view_call_is_corruption_at_the_call_and_fails_the_transaction(
        tmp_path, monkeypatch, call, wrapped):
    """Each call of a ``ProjectionView`` (``get``, ``items``, ``put``, ``delete``, ``state``)
    types LMDB's error of a damaged page at the call, bare or inside the binding's
    ``SystemError``: the projection meets ``CORRUPTION`` (reason ``agent``, naming the LMDB
    error), and the local transaction is failed with it even when the projection catches it and
    returns, so the block's end is ``PROJECTION_FAILED`` naming ``Corruption`` and nothing is
    committed (finding 258)."""
    from mwpstore.errors import ProjectionFailed

    path = tmp_path / "agent"
    with _two_groups(path, [GROUP]) as agent:
        pass
    events = workload(GROUP, 10, seed=5)
    failing = raising(lmdb.CursorFullError("mdb_cursor_next: MDB_CURSOR_FULL: Internal error - cursor stack limit reached"),
                      wrapped, _CURSOR_DELETE)
    with AgentStore.open(path, projections=[]) as agent:
        projection = _arming_projection(type(agent._tables), call, failing, monkeypatch)
    with AgentStore.open(path, projections=[projection]) as agent:
        before = agent._tables.env.info()["last_txnid"]
        with pytest.raises(ProjectionFailed) as ended:
            with agent.begin() as tx:
                tx.apply(events[8])
        assert len(projection.met) == 1 and type(projection.met[0]) is Corruption, projection.met
        assert projection.met[0].detail["reason"] == "agent" and "CursorFullError" in projection.met[0].message
        assert ended.value.detail["reason"] == "Corruption"
        assert agent._tables.env.info()["last_txnid"] == before
        assert agent.head(GROUP).applied_seq == 8


@pytest.mark.parametrize("call", ["view_get", "view_delete", "tx_state", "tx_cursor"])
def test_a_system_error_not_of_lmdb_at_a_transaction_s_call_passes_unchanged(tmp_path, monkeypatch, call):
    """Only LMDB's own errors are typed at a local transaction's call and a projection's view
    call (``_failing``): a ``SystemError`` of another cause is raised unchanged, the very object,
    not translated into an ``MwpError``."""
    from mwpstore.agent_store import AgentTransaction

    path = tmp_path / "agent"
    with _two_groups(path, [GROUP]) as agent:
        pass
    foreign = SystemError("a foreign SystemError, no LMDB error behind it")

    def failing(*args, **kwargs):
        raise foreign

    if call.startswith("view_"):
        with AgentStore.open(path, projections=[]) as agent:
            projection = _arming_projection(type(agent._tables), call[5:], failing, monkeypatch)
        with AgentStore.open(path, projections=[projection]) as agent:
            with agent.begin() as tx:
                tx.apply(workload(GROUP, 10, seed=5)[8])
        assert len(projection.met) == 1 and projection.met[0] is foreign, projection.met
        return
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        if call == "tx_state":
            monkeypatch.setattr(AgentTransaction, "_get_state", failing)
        else:
            monkeypatch.setattr(AgentTransaction, "_head", failing)
        with pytest.raises(SystemError) as caught:
            with agent.begin() as tx:
                tx.state(GROUP, "mission:m1") if call == "tx_state" else tx.cursor(GROUP)
        assert caught.value is foreign
