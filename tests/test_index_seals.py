"""The index never answers from damage: sealed values, presence-checked misses, checked ranges.

Each test damages the LMDB index of an open, trusted store the way a flipped bit can (a value
changed, a key moved so a lookup misses, a damaged key ending a range) and checks that the answer
is ``CORRUPTION`` — never a wrong state, a second Event for a replayed Command, or a short read.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import zlib

import lmdb
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from authority_helpers import (
    GROUP,
    OWNER,
    FakeClock,
    group_create,
    in_a_forked_child,
    loop_database_root,
    mission_create,
    open_with_group,
    raising,
    rewrite_log_records,
    set_database_flag,
    store_bytes,
)
from mwpstore import Authority, Command, Corruption, InvalidState, MwpError, Rejection, StorageFailed, _index_c, limits
from mwpstore.index import INDEX_FORMAT, encode_head, event_key, receipt_key, seal, state_key, unseal


def _raw(authority: Authority, name: bytes):
    return authority.index.dbs[name]


def test_a_changed_value_fails_its_seal(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        key = state_key(GROUP, "mission:m-1")
        with authority.index.env.begin(write=True) as txn:
            stored = bytearray(txn.get(key, db=_raw(authority, b"states")))
            stored[10] ^= 0x01
            txn.put(key, bytes(stored), db=_raw(authority, b"states"))
        with pytest.raises(Corruption) as caught:
            authority.state(GROUP, "mission:m-1")
        assert caught.value.detail["reason"] == "index_checksum" and caught.value.detail["database"] == "states"


def test_a_value_under_another_key_fails_its_seal(tmp_path):
    """The seal covers the key: a well-formed value reached under the wrong key is damage."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create("m-1"), mission_create("m-2")])
        with authority.index.env.begin(write=True) as txn:
            other = txn.get(state_key(GROUP, "mission:m-2"), db=_raw(authority, b"states"))
            txn.put(state_key(GROUP, "mission:m-1"), other, db=_raw(authority, b"states"))
        with pytest.raises(Corruption):
            authority.state(GROUP, "mission:m-1")


def test_a_lost_receipt_never_lets_a_replay_append_a_second_event(tmp_path):
    command = mission_create("m-1", action_id="act-1")
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(command)
        head = authority.head(GROUP)
        with authority.index.env.begin(write=True) as txn:  # as if a damaged key hid the entry
            assert txn.delete(receipt_key(command.actor, command.action_id), db=_raw(authority, b"receipts"))
        with pytest.raises(Corruption) as caught:
            authority.accept(command)
        assert caught.value.detail["reason"] == "index_missing"
    with Authority.open(str(tmp_path / "store")) as reopened:  # clean close: trusted, still refused
        with pytest.raises(Corruption):
            reopened.accept(command)
        reopened.rebuild()
        assert reopened.accept(command).seq == head[0] and reopened.head(GROUP) == head


def test_a_lost_state_is_corruption_not_a_fresh_aggregate(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        with authority.index.env.begin(write=True) as txn:
            txn.delete(state_key(GROUP, "mission:m-1"), db=_raw(authority, b"states"))
        with pytest.raises(Corruption):
            authority.state(GROUP, "mission:m-1")
        with pytest.raises(Corruption):  # mission.create would otherwise succeed a second time
            authority.accept(mission_create("m-1", action_id="again"))


def test_a_lost_head_is_corruption_not_an_empty_group(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        with authority.index.env.begin(write=True) as txn:
            txn.delete(GROUP.encode(), db=_raw(authority, b"heads"))
        with pytest.raises(Corruption):
            authority.head(GROUP)
        assert authority.head("g-never") == (0, bytes(32))  # a real miss is still a miss


def _put_head(authority: Authority, head: tuple[int, bytes]) -> None:
    """Put ``head`` back under the Group's key, sealed as a commit of the time wrote it (what a
    lost write of the ``heads`` page leaves), in a write transaction of its own."""
    with authority.index.env.begin(write=True) as txn:
        txn.put(GROUP.encode(), seal(b"heads", GROUP.encode(), encode_head(*head)), db=_raw(authority, b"heads"))


def _raises_index_head(read) -> None:
    """``read()`` meets the head behind its Events: ``CORRUPTION``, reason ``index_head``."""
    with pytest.raises(Corruption) as caught:
        read()
    assert caught.value.detail["reason"] == "index_head"


def test_a_head_written_back_from_an_older_commit_is_corruption_not_a_sequence_the_log_holds(tmp_path):
    """A lost write of the ``heads`` page leaves the page an older commit wrote: its entries are
    sound and sealed, so the structural check and the seals pass it, and the Group's head was
    Event 1 of 4. ``head`` answered it, ``read`` stopped there, and the next Command was accepted
    as Event 2 a second time: a chain break in the log, which no rebuild can read past. The Event
    after the head is indexed: ``CORRUPTION``, and the log is left as it was."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        first = authority.head(GROUP)
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])
        head = authority.head(GROUP)
        _put_head(authority, first)  # the sealed entry of the older commit
    with Authority.open(path, check_lmdb=True) as authority:
        assert authority.open_report.mode == "clean"
        calls = (authority.head, authority.read, authority.snapshot, lambda group: authority.accept(mission_create("m-new")))
        for call in (functools.partial(call, GROUP) for call in calls):
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "index_head" and caught.value.detail["database"] == "heads"
        assert not any("chain" in problem for problem in authority.verify().problems)
    with Authority.open(path) as authority:
        authority.rebuild()
        assert authority.head(GROUP) == head and authority.verify().ok


def test_a_replay_floor_over_a_head_written_back_is_corruption(tmp_path):
    """``replay_floor`` reads the head once the Group has a window and a snapshot: an older head
    moved the floor back (the window counted from it)."""
    with Authority.open(str(tmp_path / "store")) as authority:
        policy = {"replay_window_events": 2}
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP,
                                 body={"org": "acme", "policy": policy}))
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
        before = authority.head(GROUP)
        authority.snapshot(GROUP)
        authority.accept_many([mission_create(f"n-{i}") for i in range(3)])
        assert authority.replay_floor(GROUP)[0] == 6
        _put_head(authority, before)
        _raises_index_head(lambda: authority.replay_floor(GROUP))


def test_a_head_one_event_behind_is_corruption(tmp_path):
    """The ``heads`` page of the commit just before the last: the head is one Event behind, and
    the Event after it is the Group's last, the only one the lookup may find."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(2)])
        before = authority.head(GROUP)
        authority.accept(mission_create("m-last"))
        _put_head(authority, before)
        _raises_index_head(lambda: authority.head(GROUP))


def test_a_group_whose_head_and_its_presence_entry_are_lost_is_corruption_not_a_new_group(tmp_path):
    """Both pages written back from before the Group's first Event (two lost writes): its head
    reads as absent, and the presence tree, which would tell a lost entry, has no entry either.
    The Group's Event 1 is indexed: ``CORRUPTION``, not a Group at 0 whose next Event is 1 again."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        with authority.index.env.begin(write=True) as txn:
            assert txn.delete(GROUP.encode(), db=_raw(authority, b"heads"))
            assert txn.delete(b"h" + GROUP.encode(), db=_raw(authority, b"presence"))
        for call in (lambda: authority.head(GROUP), lambda: authority.accept(mission_create("m-2"))):
            _raises_index_head(call)


def test_a_lost_last_event_entry_is_corruption_not_a_short_read(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])
        with authority.index.env.begin(write=True) as txn:
            txn.delete(event_key(GROUP, 4), db=_raw(authority, b"events"))
        with pytest.raises(Corruption):
            authority.read(GROUP)
        assert [event.seq for event in authority.read(GROUP, limit=3)] == [1, 2, 3]


def test_a_damaged_key_that_ends_a_range_is_corruption(tmp_path):
    """A flipped key byte can move an entry just past its Group's prefix; the range must not
    simply stop there as if the Group had no more aggregates."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        key = state_key(GROUP, "mission:m-1")
        moved = GROUP.encode() + b"\x01" + key[len(GROUP) + 1 :]
        with authority.index.env.begin(write=True) as txn:
            stored = txn.get(key, db=_raw(authority, b"states"))
            txn.delete(key, db=_raw(authority, b"states"))
            txn.put(moved, stored, db=_raw(authority, b"states"))
        with pytest.raises(Corruption):
            authority.aggregates(GROUP)
        with pytest.raises(Corruption):
            authority.snapshot(GROUP)  # never a signed snapshot that is missing an aggregate


def test_verify_reports_damage_instead_of_raising(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        with authority.index.env.begin(write=True) as txn:
            txn.put(GROUP.encode(), b"garbage", db=_raw(authority, b"heads"))
        report = authority.verify()
        assert not report.ok and any("heads" in problem for problem in report.problems)


@pytest.mark.parametrize(
    "written",
    ["format 1 (unsealed)", "format 1 as 0.1.0 wrote it (no presence)", "a later format (sealed)", "a later format (sealed), without presence"],
)
def test_an_index_of_another_format_is_rebuilt_at_open(tmp_path, written):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        head = authority.head(GROUP)
    authority = Authority.open(path)
    with authority.index.env.begin(write=True) as txn:
        later = written.startswith("a later format")
        if not later:
            txn.put(b"format", b"1", db=authority.index.dbs[b"meta"])
        else:  # its seal holds: the format itself must decide
            authority.index.put(txn, b"meta", b"format", b"4")
        if written.endswith("presence)"):
            txn.drop(authority.index.dbs[b"presence"], delete=True)
    authority.close()
    if written != "format 1 (unsealed)":
        # A view asks for a writer's open first, naming the format, and changes no file but
        # LMDB's reader table (finding C2: it was STORAGE_FAILED, MDB_NOTFOUND, for 0.1.0's index).
        before = store_bytes(path, leave_out=("index/lock.mdb",))
        with pytest.raises(InvalidState) as caught:
            Authority.open(path, readonly=True)
        assert caught.value.detail["reason"] == "recovery_needed"
        assert f"index of another format ({'4' if later else '1'!r})" in caught.value.message  # read before the databases
        assert store_bytes(path, leave_out=("index/lock.mdb",)) == before
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "rebuild" and reopened.head(GROUP) == head
        if written != "format 1 (unsealed)":  # not "index unreadable": the index is only old
            assert reopened.open_report.reason == "index format differs"
        with reopened.index.env.begin() as txn:
            assert reopened.index.get(txn, b"meta", b"format") == INDEX_FORMAT


@pytest.mark.parametrize(
    "stored", ["format 2, its seal damaged", "format 2 unsealed", "a short value that is no format", "digits as long as a sealed value"]
)
def test_a_damaged_format_entry_is_damage_not_another_format(tmp_path, stored):
    """A format entry that fails its seal and is not spelled as a plain format (ASCII digits,
    shorter than a seal: 0.1.0's ``1``) is damage: a view says CORRUPTION (index_checksum), as
    for any damaged meta entry, and the writer rebuilds the index as unreadable. It was read as
    "another format" named by its garbage bytes (a view: recovery_needed; the writer: index
    format differs). Plain ``2``, the current format unsealed, was never written: damage too."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        head = authority.head(GROUP)
    sealed = seal(b"meta", b"format", INDEX_FORMAT)
    value = {
        "format 2, its seal damaged": sealed[:-1] + bytes([sealed[-1] ^ 1]),
        "format 2 unsealed": INDEX_FORMAT,
        "a short value that is no format": b"\x01",
        "digits as long as a sealed value": b"21111",  # a plain format is shorter than a seal
    }[stored]
    authority = Authority.open(path)
    with authority.index.env.begin(write=True) as txn:
        txn.put(b"format", value, db=authority.index.dbs[b"meta"])
    authority.close()
    with pytest.raises(Corruption) as caught:
        Authority.open(path, readonly=True)
    assert caught.value.detail == {"reason": "index_checksum", "database": "meta", "key": "format"}
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "rebuild" and reopened.head(GROUP) == head
        assert reopened.open_report.reason.startswith("index unreadable (CORRUPTION: index database meta has a damaged entry")


@pytest.mark.parametrize("key", [b"boot_id", b"last_ms", b"log_id"])
def test_a_meta_entry_whose_key_damage_hid_is_rebuilt_not_read_as_absent(tmp_path, key):
    """A bit flipped in a ``meta`` key that keeps key order (``last_ms`` read as ``last_mq``) left
    a file the structural check passes, and the open read the entry as absent: no ``last_ms``, so
    an Event accepted after the clock went back was stamped earlier than the one before it; no
    ``log_id``, so the index was trusted as an older build's without the question whether it is
    this log's. Now the open reads every ``meta`` entry (``boot_id``: the first), the one under the
    damaged key fails its seal, the writer rebuilds the index and a view says ``CORRUPTION``."""
    path = str(tmp_path / "store")
    clock = FakeClock(2_000_000)
    with open_with_group(path, clock=clock) as authority:
        authority.accept(mission_create("m-1"))
    authority = Authority.open(path, clock=clock)
    with authority.index.env.begin(write=True) as txn:
        meta = authority.index.dbs[b"meta"]
        value = txn.get(key, db=meta)
        assert txn.delete(key, db=meta)
        damaged = key[:-1] + bytes([key[-1] ^ 0x02])  # its last byte's bit 1: still between its neighbours
        txn.put(damaged, value, db=meta)
    authority.close()
    with pytest.raises(Corruption) as caught:
        Authority.open(path, readonly=True)
    assert caught.value.detail == {"reason": "index_checksum", "database": "meta", "key": damaged.decode()}
    clock.now_ms = 1_000_000  # the clock went back
    with Authority.open(path, clock=clock) as reopened:
        assert reopened.open_report.mode == "rebuild"
        assert reopened.open_report.reason.startswith(
            f"index unreadable (CORRUPTION: index database meta has a damaged entry at key {damaged!r}")
        reopened.accept(mission_create("m-2"))
        assert [event.accepted_at_ms for event in reopened.read(GROUP)] == [2_000_000, 2_000_000, 2_000_000]
        with reopened.index.env.begin() as txn:
            assert reopened.index.get(txn, b"meta", key) is not None


def test_a_view_of_an_index_lmdb_finds_damaged_while_its_format_is_read_is_corruption(tmp_path):
    """Only a refusal by format makes a view ask for a writer's open first: LMDB's own verdict on
    a damaged page, met while the format is read, stays CORRUPTION. (The view runs no structure
    check before LMDB maps the file: the writer's open does, and rebuilds.)"""
    import struct

    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    node = struct.pack("<HHHH", 5, 0, 0, 6) + b"format" + seal(b"meta", b"format", INDEX_FORMAT)
    file = os.path.join(path, "index", "data.mdb")
    with open(file, "rb") as handle:
        data = handle.read()
    assert node in data
    with open(file, "wb") as handle:  # every copy of the entry's node declares a 1 GiB value
        handle.write(data.replace(node, struct.pack("<HHHH", 5, 0x4000, 0, 6) + node[8:]))
    with pytest.raises(Corruption) as caught:
        Authority.open(path, readonly=True)
    assert caught.value.detail["reason"] != "format"


def test_seal_round_trip_and_bounds():
    sealed = seal(b"states", b"k", b"value")
    assert bytes(unseal(b"states", b"k", sealed)) == b"value"
    for bad in (b"", b"abc", sealed[:-1], b"x" + sealed[1:]):
        with pytest.raises(Corruption):
            unseal(b"states", b"k", bad)
    with pytest.raises(Corruption):
        unseal(b"receipts", b"k", sealed)  # the database name is sealed in too


@given(name=st.sampled_from([b"states", b"receipts", b"heads"]), key=st.binary(max_size=300),
       value=st.binary(max_size=3000), flip=st.integers(min_value=0))
def test_the_c_seal_check_agrees_with_zlib(name, key, value, flip):
    """``_index_c.seal`` / ``seal_items`` (every sealed write) and ``unseal`` (every sealed read)
    compute zlib's CRC-32 (slicing by eight, so every length modulo 8 and every byte position
    matters): a sound entry gives its value back, in bytes
    or in a memoryview like LMDB's; one flipped bit, a value over the bound, a stored length below
    the seal's, or another database's seed gives None."""
    seed = zlib.crc32(name)
    stored = value + zlib.crc32(value, zlib.crc32(key, seed)).to_bytes(4, "little")
    assert stored == seal(name, key, value) == _index_c.seal(memoryview(key), bytearray(value), seed)
    assert _index_c.seal_items([(key, value), (b"k", b"")], seed) == [(key, stored), (b"k", seal(name, b"k", b""))]
    assert _index_c.unseal(stored, key, seed, limits.LMDB_VALUE_BYTES_MAX) == value
    assert _index_c.unseal(memoryview(stored), memoryview(key), seed, len(value)) == value
    damaged = bytearray(stored)
    damaged[flip % len(damaged)] ^= 1 << (flip % 8)
    assert _index_c.unseal(bytes(damaged), key, seed, limits.LMDB_VALUE_BYTES_MAX) is None
    if key:
        moved = bytearray(key)
        moved[flip % len(moved)] ^= 1 << (flip % 8)
        assert _index_c.unseal(stored, bytes(moved), seed, limits.LMDB_VALUE_BYTES_MAX) is None
    assert _index_c.unseal(stored, key, zlib.crc32(b"other"), limits.LMDB_VALUE_BYTES_MAX) is None
    if value:
        assert _index_c.unseal(stored, key, seed, len(value) - 1) is None
    assert _index_c.unseal(stored[:3], key, seed, limits.LMDB_VALUE_BYTES_MAX) is None


_STATES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(deadline=None)
@given(writes=st.dictionaries(st.binary(max_size=40), st.tuples(st.integers(min_value=1, max_value=2**40), _STATES),
                              max_size=30),
       seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_seal_sorted_is_seal_items_of_the_sorted_encoded_items(writes, seed):
    """``_index_c.seal_sorted`` (an AgentStore commit's inbox and states) gives what ``put_many``
    wrote before it: ``seal_items`` of the items sorted by key, each value encoded first when an
    encoder is given; the dict is left as it was."""
    encode = msgspec.msgpack.Encoder(order="sorted").encode
    before = dict(writes)
    assert _index_c.seal_sorted(writes, seed, encode) == _index_c.seal_items(
        [(key, encode(value)) for key, value in sorted(writes.items())], seed)
    raw = {key: encode(value) for key, value in writes.items()}
    expected = _index_c.seal_items(sorted(raw.items()), seed)
    assert _index_c.seal_sorted(raw, seed) == _index_c.seal_sorted(raw, seed, None) == expected
    # added in key order (as an inbox's keys are) and in reverse
    assert _index_c.seal_sorted(dict(sorted(raw.items())), seed) == _index_c.seal_sorted(dict(sorted(raw.items(), reverse=True)), seed) == expected
    assert writes == before


def test_seal_sorted_refuses_what_is_not_a_dict_of_bytes_and_passes_on_the_encoders_error():
    for args in (([(b"k", b"v")], 0), ({"k": b"v"}, 0), ({b"k": b"v", 1: b"w"}, 0), ({b"k": None}, 0),
                 ({b"k": b"v"}, -1), ({b"k": b"v"}, 2**32), ({b"k": b"v"},), ({b"k": b"v"}, 0, "encode"),
                 ({b"k": b"v"}, 0, len), ({b"k": b"v"}, 0, None, None)):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            _index_c.seal_sorted(*args)
    with pytest.raises(TypeError):
        _index_c.seal_sorted({b"k": (1, {"x": object()})}, 0, msgspec.msgpack.Encoder(order="sorted").encode)
    assert _index_c.seal_sorted({}, 0, len) == []


def test_seal_sorted_holds_each_key_and_value_while_the_encoder_changes_the_dict():
    """``encode`` may be Python code: one that empties the dict leaves the key and value it was
    given intact, and the next key, gone, is a RuntimeError."""
    writes: dict = {}

    def encode(value: object) -> bytes:
        writes.clear()
        return bytes(repr(value), "ascii") * 20

    writes.update({b"a": [1] * 50, b"b": [2] * 50})
    with pytest.raises(RuntimeError):
        _index_c.seal_sorted(writes, 5, encode)
    writes.update({b"a": [1] * 50})
    assert _index_c.seal_sorted(writes, 5, encode) == _index_c.seal_items([(b"a", repr([1] * 50).encode() * 20)], 5)


def test_the_c_seal_functions_refuse_wrong_arguments():
    for args in ((b"x" * 8, b"k", -1, 10), (b"x" * 8, b"k", 2**32, 10), (b"x" * 8, b"k", 0, -1), ("text", b"k", 0, 10),
                 (b"x" * 8, b"k", 0)):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            _index_c.unseal(*args)
    for args in ((b"k", "text", 0), (b"k", b"v", 2**32), (b"k", b"v")):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            _index_c.seal(*args)
    for args in (([(b"k", b"v", b"x")], 0), ([b"kv"], 0), ((b"k", b"v"), 0), ([(b"k", None)], 0), ([(b"k", b"v")], -1)):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            _index_c.seal_items(*args)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="a buffer written in Python (__buffer__) needs Python 3.12")
def test_seal_items_holds_each_pair_while_python_code_changes_the_list():
    """Taking a key's buffer can run Python code (__buffer__, PEP 688) that empties the list:
    seal_items held neither the pair nor the list's length, so it copied a freed value and then
    read a NULL pair (AddressSanitizer on Python 3.12 reported the read of freed memory). Now it
    holds the pair, and the shorter list is an IndexError."""
    items: list = []

    class Key:
        def __buffer__(self, flags: int) -> memoryview:
            items.clear()
            return memoryview(b"key")

    items.extend([(Key(), bytes(range(50)) * 3), (b"k2", b"v2")])
    with pytest.raises(IndexError):
        _index_c.seal_items(items, 5)


def test_presence_survives_rebuild_for_keys_written_many_times(tmp_path):
    """Presence is written once per key (at revision 1, a Group's first Event); a rebuild from the
    log must record it again, also for aggregates now at a later revision."""
    from authority_helpers import mission_update

    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        authority.accept(mission_update("m-1", 1, "second"))
        authority.accept(mission_update("m-1", 2, "third"))
        authority.rebuild()
        assert authority.state(GROUP, "mission:m-1")[0] == 3
        with authority.index.env.begin(write=True) as txn:
            txn.delete(state_key(GROUP, "mission:m-1"), db=_raw(authority, b"states"))
            txn.delete(GROUP.encode(), db=_raw(authority, b"heads"))
        with pytest.raises(Corruption):
            authority.state(GROUP, "mission:m-1")
        with pytest.raises(Corruption):
            authority.head(GROUP)


def test_an_aggregate_created_and_updated_in_one_commit_keeps_its_presence(tmp_path):
    """An aggregate created and taken to revision 2 by two Commands of one commit has its presence
    entry like any other: a range of the Group's aggregates over it and a later one is their
    answer, not CORRUPTION ("lost the entry" at the later key), ``verify`` finds the index as a
    rebuild writes it (it reported "presence differs"), and its lost entry is CORRUPTION, not
    absent."""
    from authority_helpers import mission_update

    with open_with_group(str(tmp_path / "store")) as authority:
        results = authority.accept_many([mission_create("m-1", action_id="c-1"), mission_update("m-1", 1, "second", action_id="u-1")])
        assert [result.receipt.revision for result in results] == [1, 2]
        authority.accept(mission_create("m-2"))
        assert [(name, revision) for name, revision, _ in authority.aggregates(GROUP, prefix="mission:")] == [
            ("mission:m-1", 2),
            ("mission:m-2", 1),
        ]
        report = authority.verify()  # the presence tree as a rebuild from the log writes it
        assert report.ok, report.problems
        with authority.index.env.begin(write=True) as txn:
            txn.delete(state_key(GROUP, "mission:m-1"), db=_raw(authority, b"states"))
        with pytest.raises(Corruption) as caught:
            authority.state(GROUP, "mission:m-1")
        assert caught.value.detail["reason"] == "index_missing"


def test_an_index_of_format_2_is_rebuilt_so_an_aggregate_it_wrote_without_presence_gets_it(tmp_path):
    """Builds before format 3 gave no presence entry to an aggregate that one commit created and
    took past revision 1, and a range over a Group's aggregates checks the presence tree at its
    ends: such an index, healthy otherwise, answered CORRUPTION. Format 3 says the entries are
    there: an index of format 2 is rebuilt at the writer's open, and the range is its answer."""
    from authority_helpers import mission_update

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create("m-1", action_id="c-1"), mission_update("m-1", 1, "second", action_id="u-1")])
        authority.accept(mission_create("m-2"))
        presence = authority.index.dbs[b"presence"]
        with authority.index.env.begin(write=True) as txn:  # as format 2 wrote it
            tag = authority.index.tags[b"states"]
            assert txn.delete(tag + state_key(GROUP, "mission:m-1"), db=presence)
            authority.index.put(txn, b"meta", b"format", b"2")
        with pytest.raises(Corruption):
            list(authority.aggregates(GROUP, prefix="mission:"))
    with Authority.open(path) as reopened:
        assert (reopened.open_report.mode, reopened.open_report.reason) == ("rebuild", "index format differs")
        assert [(name, revision) for name, revision, _ in reopened.aggregates(GROUP, prefix="mission:")] == [
            ("mission:m-1", 2),
            ("mission:m-2", 1),
        ]


@pytest.mark.parametrize("kept", [1, 8])
def test_an_index_that_lost_some_of_its_databases_is_corruption_not_refilled(tmp_path, kept):
    """An environment that holds some of the index's databases is an index that lost the others
    (a damaged main database renamed them): refused, whether one or all but one remain, never
    filled up with new empty ones."""
    import lmdb

    from mwpstore.index import DATABASE_NAMES, Index

    directory = str(tmp_path / "index")
    Index(directory, map_size=1 << 24).close()
    env = lmdb.open(directory, max_dbs=len(DATABASE_NAMES) + 2)
    with env.begin(write=True) as txn:
        for name in DATABASE_NAMES[kept:]:
            txn.drop(env.open_db(name, txn=txn), delete=True)
    env.close()
    with pytest.raises(Corruption) as caught:
        Index(directory, map_size=1 << 24)
    assert caught.value.detail["reason"] == "missing_database"


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_sealed_head_of_the_wrong_length_is_corruption(tmp_path, extra):
    """A head is a sequence and a 32-byte hash: a sealed value one byte shorter or longer (a bug
    that wrote it, not a flipped bit) is CORRUPTION, not a head with a 31- or 33-byte hash."""
    from mwpstore.index import encode_head

    with open_with_group(str(tmp_path / "store")) as authority:
        seq, digest = authority.head(GROUP)
        value = encode_head(seq, digest)
        with authority.index.begin(write=True) as txn:
            authority.index.put(txn, b"heads", GROUP.encode(), value[:-1] if extra < 0 else value + b"\x00", new=False)
        _raises_index_head(lambda: authority.head(GROUP))


def test_a_sealed_format_of_any_length_is_quoted_in_part(tmp_path):
    """A sealed ``meta`` ``format`` is outside input of any length (up to LMDB's value size): the
    errors quote its first 16 bytes and its size. A 1 MiB format made the index's open error a
    message and a detail of 1 MiB each, and a view's refusal quoted all of it again."""
    from mwpstore._sealed import shown_format

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        head = authority.head(GROUP)
        with authority.index.begin(write=True) as txn:
            authority.index.put(txn, b"meta", b"format", b"9" * (1 << 20))
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and len(refused.value.message) < 400
    assert "another format ('9999999999999999… of 1048576 bytes')" in refused.value.message
    assert shown_format(b"3" * 16) == "3" * 16 and shown_format(b"3" * 17) == "3" * 16 + "… of 17 bytes"  # the bound
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "rebuild" and reopened.open_report.reason == "index format differs"
        assert reopened.head(GROUP) == head


_NESTED = b"\x91" * 100_000 + b"\xc0"  # an array in an array ..., past any decoder's recursion depth


def _receipt_with_a_nested_extra_field(authority, command):
    with authority.index.begin() as txn:
        value = bytes(authority.index.get(txn, b"receipts", receipt_key(command.actor, command.action_id)))
    assert value[32] & 0xF0 == 0x90  # the Receipt: an array of fewer than 15 fields, after the content hash
    return value[:32] + bytes([value[32] + 1]) + value[33:] + _NESTED  # one field more, which decoding skips by walking it


@pytest.mark.parametrize("table", ["receipts", "states"])
def test_an_index_value_nested_past_the_decoders_depth_is_corruption(tmp_path, table):
    """A sealed value whose msgpack nests deeper than msgspec's recursion limit (a receipt with an
    extra, skipped field of 100,000 levels; a state) is CORRUPTION (reason ``index``, ``index_state``): it was a
    bare ``RecursionError`` from a replay's receipt lookup and from ``state``. The replay's read
    transaction ends on that path too: more failures than LMDB has reader slots leave the store
    answering."""
    command = mission_create("m-1", action_id="act-1")
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(command)
        with authority.index.begin(write=True) as txn:
            if table == "receipts":
                value = _receipt_with_a_nested_extra_field(authority, command)
                authority.index.put(txn, b"receipts", receipt_key(command.actor, command.action_id), value, new=False)
            else:
                authority.index.put(txn, b"states", state_key(GROUP, "mission:m-1"), (1).to_bytes(8, "big") + b"\x81\xa1a" + _NESTED, new=False)
        for _ in range(limits.LMDB_READERS_MAX + 8 if table == "receipts" else 1):
            with pytest.raises(Corruption) as caught:
                authority.accept(command) if table == "receipts" else authority.state(GROUP, "mission:m-1")
            assert caught.value.detail["reason"] == ("index" if table == "receipts" else "index_state")
        assert authority.accept(mission_create("m-2")).seq == 3


@pytest.mark.parametrize("call", ["accept_many", "accept_trusted"])
def test_a_receipt_nested_past_the_decoders_depth_is_corruption_inside_a_commit_too(tmp_path, call):
    """``accept_many`` and ``accept_trusted`` have no receipt lookup before the commit: the
    commit's own decision reads the stored receipt, and a nested one is CORRUPTION there too, not
    a RecursionError reported as an unexpected storage failure."""
    command = mission_create("m-1", action_id="act-1")
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(command)
        with authority.index.begin(write=True) as txn:
            value = _receipt_with_a_nested_extra_field(authority, command)
            authority.index.put(txn, b"receipts", receipt_key(command.actor, command.action_id), value, new=False)
        if call == "accept_many":
            [result] = authority.accept_many([command])
            assert (result.error_code, result.detail) == ("CORRUPTION", {"reason": "index"})
        else:
            with pytest.raises(Corruption) as caught:
                authority.accept_trusted(command)
            assert caught.value.detail == {"reason": "index"}


def _a_log_with_an_event_record_nested_too_deep(path: str) -> int:
    """A store at ``path`` whose log holds, checksummed, an Event (group GROUP, seq 3) whose Effect
    state nests past the decoder's depth, and its index trusted; the record's position."""
    from authority_helpers import mission_update, rewrite_log_records

    title = "t" * 1024  # the longest title: its msgpack (3 + 1024 bytes) becomes 1026 arrays and a nil
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.accept(mission_update("m-1", 1, title))
    packed = b"\xda\x04\x00" + title.encode()
    records = rewrite_log_records(path, lambda position, record: record.replace(packed, b"\x91" * 1026 + b"\xc0"))
    return next(position for position, record in records if packed in record)


def test_an_event_record_nested_past_the_decoders_depth_is_corruption_for_a_rebuild(tmp_path):
    """An Event record in the log (checksummed, so written so) whose Effect state nests past the
    decoder's depth: a rebuild stops with CORRUPTION (``decode``) naming the record, and so does
    ``read`` (a record the log's checksum let through is damage, not a delivered Event that
    failed validation); both were a bare ``RecursionError``."""
    from mwpstore import EventInvalid
    from mwpstore.messages import decode_event

    path = str(tmp_path / "store")
    position = _a_log_with_an_event_record_nested_too_deep(path)
    with pytest.raises(EventInvalid):
        decode_event(_NESTED)
    with Authority.open(path) as authority:
        with pytest.raises(Corruption) as caught:
            authority.read(GROUP)
        assert caught.value.detail["reason"] == "decode"
        head = authority.head(GROUP)
        with pytest.raises(Corruption) as caught:  # is the Event a tombstone? Its record is read to tell
            authority.redact(GROUP, 3, actor=OWNER, action_id="redact-1", reason="r")
        assert caught.value.detail == {"offset": position, "reason": "decode"}
    with Authority.open(path) as authority:
        assert authority.head(GROUP) == head  # the refused redaction wrote nothing
        with pytest.raises(Corruption) as caught:
            authority.rebuild()
        assert caught.value.detail == {"offset": position, "reason": "decode"}


def test_a_compaction_and_verify_over_an_undecodable_event_record_say_corruption_not_event_invalid(tmp_path):
    """A compaction reads every Event record of the log, and ``verify`` checks each: an Event
    record the log's checksum let through that does not decode was ``EVENT_INVALID`` out of
    ``compact()`` and an ``EVENT_INVALID`` problem in the report, the error of a delivered Event,
    where redo, rebuild and ``read`` say ``CORRUPTION`` (``decode``) naming the record."""
    path = str(tmp_path / "store")
    position = _a_log_with_an_event_record_nested_too_deep(path)
    with Authority.open(path) as authority:
        head = authority.head(GROUP)
        with pytest.raises(Corruption) as caught:
            authority.compact()
        assert caught.value.detail == {"offset": position, "reason": "decode"}
        [problem] = authority.verify().problems
        assert problem.startswith(f"CORRUPTION: log record at {position} is not an Event")
    with Authority.open(path) as authority:
        assert authority.head(GROUP) == head  # the refused compaction switched nothing


@pytest.mark.parametrize("size", [3, 9])
@pytest.mark.parametrize("database", ["acks", "events"])
def test_a_u64_index_value_of_another_size_is_corruption_on_reads_and_in_a_commit(tmp_path, database, size):
    """An ACK's cursor and an Event's log position are u64 values: one of another size under a
    sound seal (outside input, as for meta's in finding 209) was read as its first 8 bytes by
    ``acked`` and by an ACK or a redaction, or, shorter, failed inside the commit as a bare
    ``struct.error``, reported as an unexpected ``STORAGE_FAILED``. Now each is ``CORRUPTION``
    (reason ``index``), and the commit writes nothing."""
    from mwpstore.index import ack_key

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        seq = authority.head(GROUP)[0]
        authority.ack("c-1", GROUP, seq - 1)
        key = ack_key("c-1", GROUP) if database == "acks" else event_key(GROUP, seq)
        with authority.index.begin(write=True) as txn:
            stored = bytes(authority.index.get(txn, database.encode(), key))
            authority.index.put(txn, database.encode(), key, (stored + stored)[:size], new=False)
        calls = [lambda: authority.redact(GROUP, seq, actor=OWNER, action_id="redact-1", reason="r")]
        if database == "acks":
            calls = [lambda: authority.acked("c-1", GROUP), lambda: authority.ack("c-1", GROUP, seq)]
        for call in calls:
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail == {"reason": "index"}
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == seq  # the refused commit wrote nothing


def test_a_stored_receipt_whose_two_content_hashes_disagree_is_corruption_not_its_receipt(tmp_path):
    """A receipts value holds the content hash twice (before the Receipt, and in it): a value
    whose copies differ under a sound seal is CORRUPTION on a replay whose Command has the first
    one's hash, never the Receipt it holds (nor a collision for the other)."""
    import msgspec

    from mwpstore.messages import encode_receipt

    command = mission_create("m-1", action_id="act-1")
    with open_with_group(str(tmp_path / "store")) as authority:
        receipt = authority.accept(command)
        other = msgspec.structs.replace(receipt, content_hash=bytes(32))
        with authority.index.begin(write=True) as txn:
            value = receipt.content_hash + encode_receipt(other)
            authority.index.put(txn, b"receipts", receipt_key(command.actor, command.action_id), value, new=False)
        with pytest.raises(Corruption) as caught:
            authority.accept(command)
        assert caught.value.detail["reason"] == "index"


def test_an_index_database_record_given_dupsort_is_rebuilt_at_open_not_written_with_duplicates(tmp_path):
    """Found by the all-bits damage sweep (bit 2 of the `acks` and `heads` records' flags, in an
    open without the structural walk: the next commit added a second head for the Group instead of
    replacing the first, and `head` answered one Event behind). The flag makes the index
    CORRUPTION (``database_flags``) at open, which the writer's open rebuilds from the log."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        head = authority.head(GROUP)
    assert set_database_flag(os.path.join(path, "index"), b"heads", 0x04) >= 1
    with Authority.open(path, check_lmdb=False) as reopened:
        assert reopened.open_report.mode == "rebuild"
        assert reopened.open_report.reason == "index unreadable (CORRUPTION)"
        assert reopened.head(GROUP) == head
        reopened.accept(mission_create("m-flag"))
        assert reopened.head(GROUP)[0] == head[0] + 1
        assert reopened.verify().ok


@pytest.mark.parametrize("name, flag", [(b"states", 0x02), (b"heads", 0x04), (b"events", 0x08)], ids=["reverse_key", "dupsort", "integerkey"])
def test_a_read_only_view_of_an_index_whose_database_record_gained_a_flag_is_corruption(tmp_path, name, flag):
    """A view does not walk the file (the walk would race the writer), so until it read the
    databases' flags it answered from a database searched by another key order: ``states`` under
    MDB_REVERSEKEY said "lost the entry" of every Mission, the others answered from trees whose
    flags no writer would keep. It is CORRUPTION (``database_flags``) at the view's open, as at
    the writer's."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-flag"))
    assert set_database_flag(os.path.join(path, "index"), name, flag) >= 1
    with pytest.raises(Corruption) as caught:
        Authority.open(path, readonly=True)
    assert caught.value.detail["reason"] == "database_flags"
    assert name.decode() in caught.value.message


def _looped_index(path: str, name: bytes) -> None:
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m{i}") for i in range(300)])
    loop_database_root(os.path.join(path, "index"), name)


def test_a_state_read_by_the_rules_in_a_looping_index_is_corruption_not_an_internal_error(tmp_path):
    """A cycle of damaged branch pages in ``states`` (an open without the structural walk): the
    rules' read of the new Mission's state raised ``CursorFullError`` inside ``decide``, which was
    answered as a bug in the kind ("internal error deciding mission.create", code ``MWP_ERROR``).
    It is the index's damage: ``CORRUPTION`` (reason ``index``) naming the remedy."""
    path = str(tmp_path / "store")
    _looped_index(path, b"states")
    with Authority.open(path, check_lmdb=False) as authority:
        with pytest.raises(Corruption) as caught:
            authority.accept(mission_create("m-new"))
        assert caught.value.detail["reason"] == "index"
        assert "CursorFullError" in caught.value.message and "mwpstore rebuild" in caught.value.message


def test_a_state_read_under_decide_that_the_binding_left_as_system_error_is_corruption(tmp_path, monkeypatch):
    """The binding raises ``SystemError`` with the LMDB error as its cause where a damaged page
    makes a call return with an error set (``lmdb_cause``): under ``decide`` that too is the
    index's damage, not an internal error of the kind."""
    from mwpstore.index import Index

    read = Index.get

    def damaged(self, txn, name, key):
        if name == b"states":
            raise SystemError("returned a result with an exception set") from lmdb.CorruptedError("damaged page")
        return read(self, txn, name, key)

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(Index, "get", damaged)
        with pytest.raises(Corruption) as caught:
            authority.accept(mission_create("m-new"))
        assert caught.value.detail["reason"] == "index" and "CorruptedError" in caught.value.message


def test_an_accept_into_a_looping_events_database_is_corruption_before_the_log(tmp_path):
    """The same cycle in ``events``: the commit's write failed after the log held the batch, with
    the cause ``STORAGE_FAILED`` ("LMDB failed"), then ``CORRUPTION``. A Group's head is now
    checked against ``events`` (the Event after it must not be indexed), so the accept meets the
    cycle while it decides, before anything reaches the log: the index's damage (``CORRUPTION``,
    reason ``index``, naming the remedy), no longer ``STORAGE_FAILED`` asking for a reopen. Writes
    are refused after it, naming the damage. A checked open rebuilds the index from the log, whose
    head is unchanged."""
    path = str(tmp_path / "store")
    _looped_index(path, b"events")
    with Authority.open(path, check_lmdb=False) as authority:
        with pytest.raises(Corruption) as caught:
            authority.accept(mission_create("m-new"))
        assert caught.value.detail["reason"] == "index" and "mwpstore rebuild" in caught.value.message
        with pytest.raises(StorageFailed) as refused:
            authority.accept(mission_create("m-other"))
        assert "CursorFullError" in refused.value.message and "mwpstore rebuild" in refused.value.message
    with Authority.open(path, check_lmdb=True) as authority:
        assert authority.open_report.mode == "rebuild"
        assert authority.head(GROUP)[0] == 301  # the Group's creation and 300 Missions: nothing appended
        assert authority.verify().ok


def _looped_groups(path: str, name: bytes, *, last_child_only: bool = False) -> str:
    """A store of 150 Groups (g-1 to g-150) and 300 Missions in g-1, with ``name``'s root looped
    (enough of each Group-keyed database for its root to be a branch page); its log's end."""
    with Authority.open(path) as authority:
        authority.accept_many([group_create(f"g-{i}") for i in range(1, 151)])
        authority.accept_many([mission_create(f"m{i}") for i in range(300)])
        end = authority.log.end
    loop_database_root(os.path.join(path, "index"), name, last_child_only=last_child_only)
    return end


@pytest.mark.parametrize("write", ["accept", "accept_many", "ack"])
def test_a_head_read_in_a_commit_from_a_looping_heads_database_is_corruption_not_a_storage_failure(tmp_path, write):
    """``_Batch.head`` (the decision's read of ``heads``, and of ``events`` since the check of a
    head against its Events) ran outside the rules' try: its ``CursorFullError`` went to the
    commit's own handler and came back ``STORAGE_FAILED`` ("the commit failed (...); reopen the
    authority"), though nothing had reached the log and no reopen mends the file. It is the
    index's damage, ``CORRUPTION`` (reason ``index``) with the remedy, for an accept, a batch and an
    ACK alike; the log is unchanged."""
    path = str(tmp_path / "store")
    end = _looped_groups(path, b"heads")
    with Authority.open(path, check_lmdb=False) as authority:
        calls = {
            "accept": lambda: authority.accept(mission_create("m-new")),
            "accept_many": lambda: _raise_first(authority.accept_many([mission_create("m-new"), mission_create("m-next")])),
            "ack": lambda: authority.ack("c-1", GROUP, 1),
        }
        with pytest.raises(Corruption) as caught:
            calls[write]()
        assert caught.value.detail["reason"] == "index" and "CursorFullError" in caught.value.message
        assert "mwpstore rebuild" in caught.value.message
        assert authority.log.end == end


def _raise_first(results):
    for result in results:
        if result.error is not None:
            raise result.error
    return results


def test_a_receipt_read_in_a_commit_from_a_looping_receipts_database_is_corruption(tmp_path):
    """``accept`` looks its receipt up before it joins a commit (a read path, already
    ``CORRUPTION``); ``accept_many`` and the lease sweep do not, and the commit's own lookup met
    the cycle outside the rules' try: every Command of the batch was ``STORAGE_FAILED``. Each is
    the index's damage now."""
    path = str(tmp_path / "store")
    _looped_groups(path, b"receipts")
    with Authority.open(path, check_lmdb=False) as authority:
        results = authority.accept_many([mission_create("m-new"), mission_create("m-next")])
        assert [result.error.code for result in results] == ["CORRUPTION", "CORRUPTION"]
        assert all(result.error.detail["reason"] == "index" for result in results)


def test_an_ack_whose_read_meets_a_looping_acks_database_is_corruption(tmp_path):
    """``_decide_ack`` reads the stored ACK inside the commit, before the log append: a cycle in
    ``acks`` was ``STORAGE_FAILED``, now ``CORRUPTION``."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        for number in range(150):
            authority.ack(f"c-{number}", GROUP, 1)
        end = authority.log.end
    loop_database_root(os.path.join(path, "index"), b"acks")
    with Authority.open(path, check_lmdb=False) as authority:
        with pytest.raises(Corruption) as caught:
            authority.ack("c-0", GROUP, 1)
        assert caught.value.detail["reason"] == "index"
        assert authority.log.end == end


def test_a_batch_whose_rules_meet_damage_appends_none_of_its_commands(tmp_path):
    """Only the keys past the last separator of ``states`` loop (g-99's). In one batch, a Mission
    of g-1 was decided and a Mission of g-99 met the cycle under the rules (``CORRUPTION`` for it
    alone); LMDB refuses the rest of a transaction that met such an error, so the batch's Event
    of g-1 reached the log and its index write failed: ``STORAGE_FAILED`` for g-1's caller, the
    handle failed with "MDB_BAD_TXN", and the Event in the log for the next rebuild. The damage met
    under the rules now fails the whole batch before the log append: both Commands are the index's
    damage, the log is unchanged, and a rebuild finds g-1 where it was."""
    path = str(tmp_path / "store")
    end = _looped_groups(path, b"states", last_child_only=True)
    with Authority.open(path, check_lmdb=False) as authority:
        assert authority.state(GROUP, "mission:m1")[0] == 1  # g-1's keys are read as before
        results = authority.accept_many([mission_create("m-good"), mission_create("m-bad", group="g-99")])
        assert [result.error.code if result.error else "ok" for result in results] == ["CORRUPTION", "CORRUPTION"]
        assert authority.log.end == end
        with pytest.raises(StorageFailed) as refused:
            authority.accept(mission_create("m-later"))
        assert "MDB_BAD_TXN" not in refused.value.message and "CursorFullError" in refused.value.message
    with Authority.open(path, check_lmdb=True) as authority:
        assert authority.open_report.mode == "rebuild"
        assert authority.head(GROUP)[0] == 301


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside SystemError"])
@pytest.mark.parametrize("error", ["CorruptedError", "PageNotFoundError", "InvalidError", "BadTxnError", "BadValsizeError",
                                   "BadDbiError", "IncompatibleError", "CursorFullError", "PageFullError", "MapFullError",
                                   "ReadersFullError", "DiskError", "Error"])
def test_each_lmdb_error_of_a_commit_s_read_before_the_log_is_typed_as_damage_or_as_before(tmp_path, monkeypatch, error, wrapped):
    """A commit's read of a Group's head before the log append: the errors that damaged pages give
    (``LMDB_DAMAGE_ERRORS``, bare or wrapped by the binding in ``SystemError``) are the index's
    damage (``CORRUPTION``, reason ``index``) and refuse later writes naming it; LMDB's other errors
    (a full map, a full reader table, a disk error) keep the commit's failure, ``STORAGE_FAILED``
    with the translated cause. Nothing reaches the log either way."""
    from mwpstore import _sealed
    from mwpstore.index import Index

    damage = isinstance(getattr(lmdb, error)("x"), _sealed.LMDB_DAMAGE_ERRORS)
    cause = {"MapFullError": "LIMIT_EXCEEDED"}.get(error, "STORAGE_FAILED")
    with open_with_group(str(tmp_path / "store")) as authority:
        end = authority.log.end
        failing = raising(getattr(lmdb, error)("injected"), wrapped)
        monkeypatch.setattr(Index, "head", lambda self, txn, group: failing())
        with pytest.raises(Corruption if damage else StorageFailed) as caught:
            authority.accept(mission_create("m-new"))
        monkeypatch.undo()
        if damage:
            assert caught.value.detail["reason"] == "index" and error in caught.value.message
        else:
            assert caught.value.detail["cause"] == cause and "reopen the authority" in caught.value.message
        assert authority.log.end == end
        with pytest.raises(StorageFailed) as refused:
            authority.accept(mission_create("m-later"))
        assert caught.value.message in refused.value.message
        # the refusal carries the failure's facts: the damage's code as its cause, or the failed
        # commit's own cause (a caller tells a damaged index from a failed disk without the message)
        if damage:
            assert refused.value.detail == {**caught.value.detail, "cause": "CORRUPTION"}
        else:
            assert refused.value.detail == caught.value.detail


def test_a_caller_queued_behind_a_batch_that_met_damage_is_refused_with_its_facts(tmp_path, monkeypatch):
    """A caller whose Command was queued while the leader's batch met damage before the log append
    is answered by the next leader's ``_commit``, not by the check made before queueing: its
    refusal carries the same facts as a later caller's (``cause`` ``CORRUPTION``, ``reason``
    ``index``); it named no cause. Nothing of either Command reaches the log."""
    import threading
    import time

    from mwpstore.index import Index

    original = Index.head
    other: list[BaseException] = []

    def background() -> None:
        try:
            authority.accept(mission_create("m-other"))
        except BaseException as exc:  # the answer under test
            other.append(exc)

    thread = threading.Thread(target=background)

    def head(self, txn, group):
        if authority._committer == threading.get_ident() and not thread.is_alive() and not other:
            # the leader's read inside its commit: the other caller queues behind it first
            thread.start()
            deadline = time.monotonic() + 10
            while not authority._queue and time.monotonic() < deadline:
                time.sleep(0.001)
            raise lmdb.CursorFullError("injected")
        return original(self, txn, group)

    with open_with_group(str(tmp_path / "store")) as authority:
        end = authority.log.end
        monkeypatch.setattr(Index, "head", head)
        with pytest.raises(Corruption) as caught:
            authority.accept(mission_create("m-main"))
        thread.join(10)
        monkeypatch.undo()
        assert caught.value.detail == {"reason": "index"}
        assert len(other) == 1 and isinstance(other[0], StorageFailed)
        assert other[0].detail == {"reason": "index", "cause": "CORRUPTION"}
        assert caught.value.message in other[0].message
        assert authority.log.end == end


@pytest.mark.parametrize("error", ["DiskError", "Error"])
def test_an_lmdb_error_other_than_damage_under_the_rules_answers_its_command_only(tmp_path, monkeypatch, error):
    """Finding 254 fails the whole batch only for the errors damaged pages give: another LMDB error
    met while a Command is decided (a failed disk, LMDB's base error) answers that Command as the
    index's (``CORRUPTION``), and the batch's other Commands go on (finding 252, left as it is)."""
    from mwpstore.index import Index

    original = Index.get

    def get(self, txn, name, key):
        if name == b"states" and b"m-bad" in bytes(key):
            raise getattr(lmdb, error)("injected")
        return original(self, txn, name, key)

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(Index, "get", get)
        results = authority.accept_many([mission_create("m-good"), mission_create("m-bad")])
        monkeypatch.undo()
        assert results[0].error is None and results[1].error.code == "CORRUPTION"
        assert authority.state(GROUP, "mission:m-good")[0] == 1
        assert authority.accept(mission_create("m-later")).seq > 0


# -- every write of the authority against a looped root of each database ----------------------------

_PROBE_SEGMENT_BYTES = 1024 * 1024  # each case copies the store: not a 64 MiB segment each time
_PROBED_DATABASES = ["heads", "events", "states", "receipts", "acks", "snapshots", "archives", "presence"]
_PROBED_WRITES = ["accept", "accept_replay", "accept_many", "accept_many_replay", "accept_trusted", "accept_new_group", "ack",
                  "ack_new", "snapshot", "snapshot_taken", "archive", "archive_done", "redact", "delete_audit_log",
                  "expire_leases", "compact", "rebuild"]


@pytest.fixture(scope="module")
def probe_stores(tmp_path_factory):
    """Two stores in which every database a write reads, but ``meta``, has a branch page as its root:
    150 Groups, 300 Missions in g-1, 150 consumers' ACKs, 40 snapshots, and Group g1 of the work
    model with a lease that lapsed; the first also has 20 archived Groups (g-42 to g-61). An open
    reads the state of every archived Group (``_finish_audit_deletions``), so ``states`` is looped
    in the second. Returns both paths and a replayed Command."""
    from test_work_model_durable import DurableHarness
    from work_model_support import CONTRACT, Harness

    class SmallSegments(DurableHarness):
        def __init__(self, path: str) -> None:
            Harness.__init__(self)
            self.path, self.sync = path, False
            self.authority = Authority.open(path, clock=self.clock, sync=False, segment_bytes=_PROBE_SEGMENT_BYTES)

    base = tmp_path_factory.mktemp("probe")
    replay = mission_create("m0")
    stores = {}
    for name, archived in (("archived", True), ("plain", False)):
        path = str(base / name)
        harness = SmallSegments(path)
        harness.setup(workitems=("wi1",))
        harness.claim("w1", "wi1")
        harness.advance(CONTRACT["start_ms"])  # not started in time: lapsed at any later clock
        harness.authority.close()
        with Authority.open(path, sync=False, segment_bytes=_PROBE_SEGMENT_BYTES) as authority:
            authority.accept_many([group_create(f"g-{i}") for i in range(1, 151)])
            authority.accept_many([replay] + [mission_create(f"m{i}") for i in range(1, 300)])
            for number in range(150):
                authority.ack(f"c-{number}", GROUP, 1)
            for number in range(2, 42):
                authority.snapshot(f"g-{number}")
            if archived:
                for number in range(42, 62):
                    authority.archive(f"g-{number}", actor=OWNER, action_id=f"archive-{number}")
        stores[name] = path
    return stores, replay


def _probe_write(authority: Authority, write: str, replay: Command):
    calls = {
        "accept": lambda: authority.accept(mission_create("m-new")),
        "accept_replay": lambda: authority.accept(replay),
        "accept_many": lambda: authority.accept_many([mission_create("m-new"), mission_create("m-next")]),
        "accept_many_replay": lambda: authority.accept_many([replay]),
        "accept_trusted": lambda: authority.accept_trusted(mission_create("m-trusted")),
        "accept_new_group": lambda: authority.accept(group_create("g-new")),
        "ack": lambda: authority.ack("c-0", GROUP, 2),
        "ack_new": lambda: authority.ack("c-new", GROUP, 1),
        "snapshot": lambda: authority.snapshot(GROUP),
        "snapshot_taken": lambda: authority.snapshot("g-2"),
        "archive": lambda: authority.archive("g-100", actor=OWNER, action_id="archive-new"),
        "archive_done": lambda: authority.archive("g-42", actor=OWNER, action_id="archive-42"),
        "redact": lambda: authority.redact(GROUP, 5, actor=OWNER, action_id="redact-new", reason="probe"),
        "delete_audit_log": lambda: authority.delete_audit_log("g-43", actor=OWNER, action_id="delete-new", basis="legal"),
        "expire_leases": lambda: authority.expire_leases("g1"),
        "compact": lambda: authority.compact(),
        "rebuild": lambda: authority.rebuild(),
    }
    return calls[write]()


# The answers of the probe below: by database, the writes answered CORRUPTION; every other write
# answers as over a sound index, but two whose damage is met after the log holds their Event
# (STORAGE_FAILED, cause CORRUPTION): the ACK's presence entry written into the cycle, and the
# audit.delete whose audit log's record cannot be read to remove the file.
_PROBE_DAMAGE = {
    "heads": "accept accept_many accept_new_group accept_trusted ack ack_new archive compact delete_audit_log expire_leases redact snapshot snapshot_taken",
    "events": "accept accept_many accept_new_group accept_trusted ack ack_new archive compact delete_audit_log expire_leases redact snapshot snapshot_taken",
    "states": "accept accept_many accept_new_group accept_trusted archive archive_done compact delete_audit_log expire_leases redact snapshot",
    "receipts": "accept accept_many accept_many_replay accept_new_group accept_replay accept_trusted archive delete_audit_log expire_leases redact",
    "acks": "ack ack_new",
    "snapshots": "archive snapshot snapshot_taken",
    "archives": "archive archive_done compact",
    "presence": "accept accept_many accept_new_group accept_trusted ack_new archive compact delete_audit_log expire_leases redact snapshot",
}
_PROBE_AFTER_THE_LOG = {("presence", "ack"), ("archives", "delete_audit_log")}


@pytest.mark.parametrize("write", _PROBED_WRITES)
@pytest.mark.parametrize("database", _PROBED_DATABASES)
def test_each_write_of_the_authority_over_a_looped_database_is_answered_as_damage(tmp_path, probe_stores, database, write):
    """Each public write of the authority, in a store opened without the structural walk whose
    ``database`` has a cycle of damaged branch pages: the answer is the write's own (an answer, a
    rejection) or the index's damage (``CORRUPTION``), never a foreign error, and
    ``STORAGE_FAILED`` only once the log holds the batch (its cause then ``CORRUPTION``). A handle
    that refuses writes afterwards names the damage as its failure, unless the log grew."""
    stores, replay = probe_stores
    path = str(tmp_path / "store")
    shutil.copytree(stores["plain" if database == "states" else "archived"], path)
    loop_database_root(os.path.join(path, "index"), database.encode())
    with Authority.open(path, check_lmdb=False, segment_bytes=_PROBE_SEGMENT_BYTES) as authority:
        end = authority.log.end
        try:
            outcome = _probe_write(authority, write, replay)
            errors = [result.error for result in outcome if result.error is not None] if isinstance(outcome, list) and write.startswith("accept") else []
        except MwpError as exc:
            errors = [exc]
        grew = authority.log.end != end
        failure = authority._failure
    answers = sorted({"-" if isinstance(error, Rejection) else error.code for error in errors}) or ["ok"]
    for error in errors:
        if isinstance(error, StorageFailed):
            assert grew and error.detail.get("cause") == "CORRUPTION", (answers, error.message)
        else:
            assert isinstance(error, (Rejection, Corruption)), (answers, error.message)
    assert failure is None or isinstance(failure, Corruption) or grew, failure.message
    if (database, write) in _PROBE_AFTER_THE_LOG:
        expected = ["STORAGE_FAILED"]
    else:
        expected = ["CORRUPTION"] if write in _PROBE_DAMAGE[database].split() else ["ok"]
    assert answers == expected, [error.message for error in errors]


# -- every read of the authority against a looped root of each database -----------------------------

_PROBED_READS = ["head", "head_unknown", "groups", "state", "state_missing", "aggregates", "read", "read_cursor",
                 "read_below_floor", "snapshots", "read_snapshot", "archive_record", "archive_record_none", "replay_floor",
                 "replay_floor_window", "acked", "acked_none", "subscribe_poll", "wait_for", "info", "verify"]
_VIEW_REFUSES = {"subscribe_poll", "wait_for", "verify"}  # a read-only view: INVALID_STATE, reason readonly


@pytest.fixture(scope="module")
def read_probe_stores(probe_stores, tmp_path_factory):
    """The two stores of ``probe_stores``, copied, each with a Group g-window of
    ``replay_window_events`` 2 whose replay floor a snapshot moved to 6 (9 Events). Returns the
    paths and, by store, the references of g-2's first snapshot."""
    stores, _ = probe_stores
    base = tmp_path_factory.mktemp("read-probe")
    copies, refs = {}, {}
    for name, source in stores.items():
        path = str(base / name)
        shutil.copytree(source, path)
        with Authority.open(path, sync=False, segment_bytes=_PROBE_SEGMENT_BYTES) as authority:
            authority.accept(Command(actor=OWNER, action_id="g-window", group="g-window", kind="group.create", target="g-window",
                                     body={"org": "acme", "policy": {"replay_window_events": 2}}))
            authority.accept_many([mission_create(f"w-{i}", group="g-window") for i in range(5)])
            authority.snapshot("g-window")
            authority.accept_many([mission_create(f"x-{i}", group="g-window") for i in range(3)])
            assert authority.replay_floor("g-window")[0] == 6
            refs[name] = authority.snapshots("g-2")[0]
        copies[name] = path
    return copies, refs


def _probe_read(authority: Authority, read: str, ref):
    def poll():
        subscription = authority.subscribe(GROUP, after=290)
        try:
            return subscription.poll(timeout=0)
        finally:
            subscription.close()

    calls = {
        "head": lambda: authority.head(GROUP),
        "head_unknown": lambda: authority.head("g-none"),
        "groups": lambda: authority.groups(),
        "state": lambda: authority.state(GROUP, "mission:m1"),
        "state_missing": lambda: authority.state(GROUP, "mission:m-none"),
        "aggregates": lambda: authority.aggregates(GROUP, prefix="mission:"),
        "read": lambda: authority.read(GROUP),
        "read_cursor": lambda: authority.read(GROUP, after=250, limit=20),
        "read_below_floor": lambda: authority.read("g-window", after=2),
        "snapshots": lambda: authority.snapshots("g-2"),
        "read_snapshot": lambda: authority.read_snapshot(ref),
        "archive_record": lambda: authority.archive_record("g-42"),
        "archive_record_none": lambda: authority.archive_record("g-100"),
        "replay_floor": lambda: authority.replay_floor(GROUP),
        "replay_floor_window": lambda: authority.replay_floor("g-window"),
        "acked": lambda: authority.acked("c-0", GROUP),
        "acked_none": lambda: authority.acked("c-new", GROUP),
        "subscribe_poll": poll,
        "wait_for": lambda: authority.wait_for(GROUP, 1, 0),
        "info": lambda: authority.info(),
        "verify": lambda: authority.verify(),
    }
    return calls[read]()


# The answers of the probe below: by database, the reads answered CORRUPTION; every other read
# answers as over a sound index (read_below_floor: CURSOR_TOO_OLD), and verify reports the damage
# (the structural check it runs names the cycle) without raising.
_READ_DAMAGE = {
    "heads": "head head_unknown groups read read_cursor read_below_floor replay_floor_window subscribe_poll wait_for info",
    "events": "head head_unknown read read_cursor read_below_floor replay_floor_window subscribe_poll wait_for",
    "states": "state state_missing aggregates read read_cursor read_below_floor replay_floor replay_floor_window subscribe_poll",
    "receipts": "",
    "acks": "acked acked_none",
    "snapshots": "read_below_floor snapshots replay_floor_window",
    "archives": "archive_record archive_record_none",
    "presence": "head_unknown groups state_missing aggregates snapshots archive_record_none acked_none info",
}


@pytest.fixture(scope="module")
def looped_views(read_probe_stores, tmp_path_factory):
    """One copy of the read probe's store per database, that database looped, shared by the
    read-only views (which write nothing)."""
    stores, _ = read_probe_stores
    base = tmp_path_factory.mktemp("looped-views")
    paths = {}
    for database in _PROBED_DATABASES:
        path = str(base / database)
        shutil.copytree(stores["plain" if database == "states" else "archived"], path)
        loop_database_root(os.path.join(path, "index"), database.encode())
        paths[database] = path
    return paths


@pytest.mark.parametrize("how", ["writer", "view"])
@pytest.mark.parametrize("read", _PROBED_READS)
@pytest.mark.parametrize("database", _PROBED_DATABASES)
def test_each_read_of_the_authority_over_a_looped_database_is_answered_as_damage(tmp_path, read_probe_stores, looped_views,
                                                                                database, read, how):
    """Each public read of the authority, in a store opened without the structural walk (and in a
    read-only view of it, a fresh one for each read) whose ``database`` has a cycle of damaged
    branch pages: the read's own answer or ``CORRUPTION`` (reason ``index``), never a foreign
    error, and the same answer from the writer and the view; ``verify`` reports the damage."""
    from mwpstore import CursorTooOld

    stores, refs = read_probe_stores
    store = "plain" if database == "states" else "archived"
    if how == "writer":
        path = str(tmp_path / "store")
        shutil.copytree(stores[store], path)
        loop_database_root(os.path.join(path, "index"), database.encode())
        authority = Authority.open(path, check_lmdb=False, segment_bytes=_PROBE_SEGMENT_BYTES)
    else:
        authority = Authority.open(looped_views[database], readonly=True)
    with authority:
        end = authority.log.end
        try:
            outcome = _probe_read(authority, read, refs[store])
            answer = "ok"
        except CursorTooOld:
            answer = "CURSOR_TOO_OLD"
        except MwpError as exc:
            answer = exc.code
            if isinstance(exc, Corruption):
                assert exc.detail["reason"] == "index" and "CursorFullError" in exc.message, exc.message
            else:
                assert how == "view" and read in _VIEW_REFUSES and isinstance(exc, InvalidState), exc.message
                assert exc.detail["reason"] == "readonly"
        assert authority.log.end == end and authority._failure is None  # a read writes nothing
    if how == "view" and read in _VIEW_REFUSES:
        assert answer == "INVALID_STATE"
    elif read == "verify":
        assert answer == "ok" and not outcome.ok
        assert any("CORRUPTION" in problem and "page_twice" in problem for problem in outcome.problems), outcome.problems
    else:
        expected = "CORRUPTION" if read in _READ_DAMAGE[database].split() else "CURSOR_TOO_OLD" if read == "read_below_floor" else "ok"
        assert answer == expected


def test_a_view_s_read_after_one_that_met_damage_names_that_damage(looped_views):
    """A read-only view answers every read from one LMDB transaction, which LMDB refuses to read
    further once a read met a damaged page (``BadTxnError``). A later read of the view, of a sound
    database too, was ``CORRUPTION`` naming only ``BadTxnError`` ("Transaction must abort"): it
    names the damage met first, and that an earlier read of the view met it."""
    with Authority.open(looped_views["heads"], readonly=True) as view:
        with pytest.raises(Corruption, match="CursorFullError") as first:
            view.head(GROUP)
        assert "earlier read" not in first.value.message
        for _ in range(2):  # the states are sound; the transaction is not
            with pytest.raises(Corruption) as later:
                view.state(GROUP, f"group:{GROUP}")
            assert later.value.detail["reason"] == "index"
            assert "CursorFullError" in later.value.message and "earlier read of this read-only view" in later.value.message, later.value.message
            assert "BadTxnError" not in later.value.message
    with Authority.open(looped_views["heads"], readonly=True) as view:  # a new view has a new transaction
        assert view.state(GROUP, f"group:{GROUP}")[0] == 1


@pytest.mark.parametrize("database", ["heads", "snapshots"])
def test_verify_reads_no_more_of_an_index_that_failed_its_structural_check(tmp_path, read_probe_stores, database):
    """A store opened without the structural walk whose ``database`` loops only at its root's
    last child (keys before the last separator read as before): ``verify()``'s structural check
    names the damage, and verify then went on to look up tombstones, snapshots and audit logs in
    that index, whose range over the Groups (or a Group's snapshots) ran into the cycle and
    LMDB's own assertion (``IS_LEAF(mp)`` in ``mdb_cursor_next``) aborted the process. It reports
    the damage and that those lookups wait for a rebuild, and reads no more of the index."""
    stores, _ = read_probe_stores
    path = str(tmp_path / "store")
    shutil.copytree(stores["archived"], path)
    loop_database_root(os.path.join(path, "index"), database.encode(), last_child_only=True)

    def verify() -> None:
        with Authority.open(path, check_lmdb=False, segment_bytes=_PROBE_SEGMENT_BYTES) as authority:
            problems = authority.verify().problems
        assert problems[0].startswith("index: CORRUPTION: ") and "page_twice" in problems[0], problems
        assert problems[1:] == ["tombstones, snapshots and audit logs: not checked, as the index failed its structural "
                                "check; run `mwpstore rebuild`, then verify again"], problems

    assert in_a_forked_child([verify]) == ["ok"]


def test_verify_checks_the_structure_of_an_index_it_could_not_compare_before_it_reads_it(tmp_path):
    """The log holds a record a rebuild cannot index (an ACK's tag changed), so the comparison
    with a rebuild stops before its structural check of the live index; verify then looked up
    tombstones, snapshots and audit logs in that index unchecked, and a cycle at the last child of
    the ``heads`` root aborted the process inside LMDB. The live index is checked first: its damage
    is reported, beside the rebuild's, and it is read no further."""
    path = str(tmp_path / "store")
    with Authority.open(path, sync=False) as authority:  # a record an append: rewritten one by one below
        for number in range(1, 151):
            authority.accept(group_create(f"g-{number}"))
        authority.ack("c-0", GROUP, 1)
    rewrite_log_records(path, lambda position, record: b"Z" + record[1:] if record[:1] == b"A" else record)
    loop_database_root(os.path.join(path, "index"), b"heads", last_child_only=True)

    def verify() -> None:
        with Authority.open(path, check_lmdb=False) as authority:
            problems = authority.verify().problems
        assert [problem[:47] for problem in problems] == [
            "rebuilding an index from the log to compare: CO", "index: CORRUPTION: the index's LMDB file is dam",
            "tombstones, snapshots and audit logs: not check"], problems

    assert in_a_forked_child([verify]) == ["ok"]


def _view_with_injected_errors(monkeypatch, errors: list):
    """Patch the read-only view's index reads (``_IndexView.get``) to raise ``errors`` one a read,
    in order, then read as before; the list is consumed as the reads go."""
    from mwpstore import authority as authority_module

    real = authority_module._IndexView.get

    def get(self, txn, name, key):
        if errors:
            error = errors.pop(0)
            error()
        return real(self, txn, name, key)

    monkeypatch.setattr(authority_module._IndexView, "get", get)


@pytest.mark.parametrize("met,named", [
    (["CursorFullError", "CorruptedError", "BadTxnError"], "CursorFullError"),
    (["wrapped CursorFullError", "BadTxnError"], "CursorFullError"),
    (["BadTxnError"], None),
    (["BadTxnError", "BadTxnError"], None),
    (["BadValsizeError", "BadTxnError"], None),
], ids=["the first of two", "inside SystemError", "no damage before", "BadTxnError twice", "not a file's damage"])
def test_a_view_s_later_bad_txn_names_the_first_file_damage_its_reads_met_and_only_that(tmp_path, monkeypatch, met, named):
    """A read-only view keeps the first of LMDB's errors that only a damaged file gives
    (``errors.LMDB_FILE_DAMAGE``; also one the binding raised inside ``SystemError``, which the
    view's read itself lets out as it is) that a read met, and
    answers a later ``BadTxnError`` with that one, not the latest. With none met (nothing at all,
    or only ``BadTxnError`` or another error), the ``BadTxnError`` is ``CORRUPTION`` naming itself
    and no earlier read (finding 261)."""
    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    errors = [raising(getattr(lmdb, name.split()[-1])("injected"), name.startswith("wrapped")) for name in met]
    with Authority.open(path, readonly=True) as view:
        _view_with_injected_errors(monkeypatch, errors)
        answers = []
        for _ in met:
            with pytest.raises(Exception) as caught:  # the reads before the last: what each is, is not the point here
                view.state(GROUP, f"group:{GROUP}")
            answers.append(caught.value)
        assert view.state(GROUP, f"group:{GROUP}")[0] == 1  # the injected errors spent; the transaction is sound
    last = answers[-1]
    assert type(last) is Corruption and last.detail["reason"] == "index", last
    if named is None:
        assert "BadTxnError" in last.message and "earlier read" not in last.message, last.message
    else:
        assert f"{named}: " in last.message and "earlier read of this read-only view" in last.message, last.message
        assert "CorruptedError" not in last.message and "BadTxnError" not in last.message, last.message


def test_a_view_s_read_that_met_damage_leaves_the_view_to_other_threads(tmp_path, monkeypatch):
    """A read of a read-only view that met damage (and a later read answered with that damage)
    gives the view's transaction back: a read from another thread is served, not left waiting for
    a turn the failed read kept (finding 261's ``_SharedTransaction``)."""
    import threading

    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    with Authority.open(path, readonly=True) as view:
        _view_with_injected_errors(monkeypatch, [raising(lmdb.CursorFullError("injected"), False),
                                                       raising(lmdb.BadTxnError("injected"), False)])
        for _ in range(2):
            with pytest.raises(Corruption):
                view.state(GROUP, f"group:{GROUP}")
        answers: list = []
        other = threading.Thread(target=lambda: answers.append(view.state(GROUP, f"group:{GROUP}")[0]), daemon=True)
        other.start()
        other.join(timeout=20)
        waiting = other.is_alive()
        while waiting and view.index._turn._is_owned():  # give the turn back, so the view closes
            view.index._turn.release()
        other.join(timeout=20)
        assert not waiting and answers == [1], answers


def test_verify_checks_the_index_s_structure_with_commits_held_off_also_when_the_comparison_stopped(tmp_path, monkeypatch):
    """The structural check reads the index file, which a commit changes under it: verify runs it
    holding the commit role, in the comparison with a rebuild and, when that comparison stopped
    before its check (a log record a rebuild cannot index), in verify itself (finding 259)."""
    from threading import get_ident

    from mwpstore import authority as authority_module

    path = str(tmp_path / "store")
    with Authority.open(path, sync=False) as authority:
        authority.accept(group_create(GROUP))
        authority.ack("c-0", GROUP, 1)
    rewrite_log_records(path, lambda position, record: b"Z" + record[1:] if record[:1] == b"A" else record)
    real = authority_module._index_structure_problem
    held: list = []

    def checked(index):
        held.append(authority._leader and authority._committer == get_ident())
        return real(index)

    monkeypatch.setattr(authority_module, "_index_structure_problem", checked)
    with Authority.open(path) as authority:
        problems = authority.verify().problems
    assert [problem[:47] for problem in problems] == ["rebuilding an index from the log to compare: CO"], problems
    assert held == [True], held


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside SystemError"])
def test_a_read_of_the_authority_types_an_lmdb_error_the_binding_wrapped_as_damage(tmp_path, monkeypatch, wrapped):
    """py-lmdb raises some LMDB errors inside a ``SystemError`` ("... returned a result with an
    exception set"): a read of the authority (``state``, ``head``) answers the LMDB error inside it
    as the bare one, ``CORRUPTION`` (reason ``index``) naming it; it let the ``SystemError`` out. A
    ``SystemError`` of another cause passes unchanged."""
    from mwpstore import _sealed
    from mwpstore.index import Index

    with open_with_group(str(tmp_path / "store")) as authority:
        for method, call in (("get", lambda: authority.state(GROUP, "mission:m1")), ("head", lambda: authority.head(GROUP))):
            monkeypatch.setattr(Index, method, raising(lmdb.CorruptedError("injected"), wrapped))
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "index" and "CorruptedError" in caught.value.message
            monkeypatch.setattr(Index, method, raising(SystemError("another cause"), False))
            with pytest.raises(SystemError, match="another cause"):
                call()
            monkeypatch.undo()
        assert authority.head(GROUP)[0] == 1

    # the decorator of the other read paths (typed_damage) answers the same way
    @_sealed.typed_damage("test store", "rebuild it", "test")
    def read(error):
        raise error

    for wrapped_error in (raising(lmdb.PageNotFoundError("injected"), True), raising(SystemError("another cause"), False)):
        try:
            wrapped_error()
        except BaseException as exc:
            error = exc
        if isinstance(error.__cause__, lmdb.Error):
            with pytest.raises(Corruption, match="PageNotFoundError"):
                read(error)
        else:
            with pytest.raises(SystemError, match="another cause"):
                read(error)
