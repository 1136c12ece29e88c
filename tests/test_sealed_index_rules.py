"""Rules of the sealed LMDB layer, the authority's index and the built-in kinds that no other file
pins: the bounds of a sealed read, the order check of a range (built from entries moved inside
the file, as a damaged page moves them), the errors a read path translates, the index's value
decoders and key layout, and each refusal and default of group.* and mission.*.
"""

from __future__ import annotations

import os
import struct

import lmdb
import msgspec
import pytest

from authority_helpers import GROUP, mission_create, open_with_group
from mwpstore import Corruption, limits
from mwpstore._sealed import KEY_SHOWN_BYTES, typed_damage
from mwpstore.errors import GroupArchived, InvalidCommand, InvalidState, NotFound
from mwpstore.index import Index, seal, unseal
from test_work_model import h, new_harness  # noqa: F401  (fixtures)
from work_model_support import GROUP as WM_GROUP
from work_model_support import Harness

# -- sealed reads ----------------------------------------------------------------------------------


def test_an_error_shows_at_most_the_first_bytes_of_a_damaged_key():
    """A damaged key can be any length: the error names only its first KEY_SHOWN_BYTES."""
    key = b"k" * (KEY_SHOWN_BYTES + 100)
    with pytest.raises(Corruption) as caught:
        unseal(b"states", key, b"not a sealed value")
    assert caught.value.detail["key"] == "k" * KEY_SHOWN_BYTES
    assert repr(b"k" * (KEY_SHOWN_BYTES + 1)) not in caught.value.message


def test_a_sealed_value_longer_than_any_lmdb_value_is_corruption_even_with_a_sound_seal():
    """The length bound comes before the seal: a damaged length must not be read past."""
    longest = b"x" * limits.LMDB_VALUE_BYTES_MAX
    assert bytes(unseal(b"states", b"k", seal(b"states", b"k", longest))) == longest
    with pytest.raises(Corruption) as caught:
        unseal(b"states", b"k", seal(b"states", b"k", longest + b"x"))
    assert caught.value.detail["reason"] == "index_checksum"


# -- ranges over entries a damaged page reordered --------------------------------------------------

_PREFIX = b"g\x00"


def _index_of(directory: str, entries: dict[bytes, bytes]) -> None:
    """A new index whose states hold ``entries``, written in one transaction (so each entry's
    node is in the file once)."""
    index = Index(directory, map_size=1 << 22)
    with index.begin(write=True) as txn:
        for key, value in entries.items():
            index.put(txn, b"states", key, value)
    index.close()


def _replace_in_file(directory: str, changes: list[tuple[bytes, bytes]]) -> None:
    """Replace byte strings (each found exactly once, same length) in the closed index's file."""
    path = os.path.join(directory, "data.mdb")
    with open(path, "rb") as handle:
        data = handle.read()
    changed = bytearray(data)
    for old, new in changes:  # all found in the file as it was: a swap is two changes
        assert data.count(old) == 1 and len(old) == len(new)
        at = data.index(old)
        changed[at : at + len(old)] = new
    with open(path, "r+b") as handle:
        handle.write(changed)


def _node(key: bytes, value: bytes) -> bytes:
    """A states entry's key and sealed value as they lie next to each other in a leaf node."""
    return key + seal(b"states", key, value)


def _range(directory: str, start: bytes | None = None) -> list[bytes]:
    index = Index(directory, map_size=1 << 22)
    try:
        with index.begin() as txn:
            return [key for key, _ in index.range(txn, b"states", _PREFIX, start)]
    finally:
        index.close()


@pytest.mark.parametrize("damage", ["two entries swapped", "an entry repeated"])
def test_a_range_over_keys_out_of_order_is_corruption(tmp_path, damage):
    """Keys must strictly increase along a range: two sound entries swapped, or one entry's node
    copied over its neighbour (each still passes its seal), is ``CORRUPTION``, not an answer. The
    swap is met first by the presence tree's check before the first entry is served (the first key
    of the range there, b, is not the first served, c): ``index_missing`` at b."""
    directory = str(tmp_path / "index")
    b, c, d = _PREFIX + b"b", _PREFIX + b"c", _PREFIX + b"d"
    _index_of(directory, {b: b"1", c: b"2", d: b"3"})
    assert _range(directory) == [b, c, d]
    if damage == "two entries swapped":
        _replace_in_file(directory, [(_node(b, b"1"), _node(c, b"2")), (_node(c, b"2"), _node(b, b"1"))])
    else:
        _replace_in_file(directory, [(_node(c, b"2"), _node(b, b"1"))])
    with pytest.raises(Corruption) as caught:
        _range(directory)
    expected = ("index_missing", b) if damage == "two entries swapped" else ("index_order", b)
    assert (caught.value.detail["reason"], caught.value.detail["key"].encode()) == expected
    assert caught.value.detail["database"] == "states"


def test_a_range_whose_start_is_also_the_entry_before_it_is_corruption(tmp_path):
    """The entry before where a range starts must sort strictly before the start: a copy of the
    start's own entry there (the search landed on the second of two equal keys) is damage."""
    directory = str(tmp_path / "index")
    b, c, d = _PREFIX + b"b", _PREFIX + b"c", _PREFIX + b"d"
    _index_of(directory, {b: b"1", c: b"2", d: b"3"})
    _replace_in_file(directory, [(_node(c, b"2"), _node(b, b"1"))])  # b, b, d: the search lands on the second b
    with pytest.raises(Corruption) as caught:
        _range(directory, start=b)
    assert caught.value.detail["reason"] == "index_order"


@pytest.mark.parametrize("others", [[], [b"a\x00x"]], ids=["the range's entry is the only one", "another Group's entry before it"])
def test_a_range_emptied_by_a_damaged_key_is_corruption_not_an_empty_answer(tmp_path, others):
    """A flipped bit in a key can move a range's entries before its start, so that nothing is left
    at or after it and the search finds no entry at all: the last entry must still be checked
    (here ``g`` becomes ``e``, and the damaged key fails its seal)."""
    directory = str(tmp_path / "index")
    keys = {key: str(number).encode() for number, key in enumerate([*others, _PREFIX + b"b"])}
    _index_of(directory, keys)
    assert _range(directory) == [_PREFIX + b"b"]
    victim = _PREFIX + b"b"
    _replace_in_file(directory, [(_node(victim, keys[victim]), b"e" + _node(victim, keys[victim])[1:])])
    with pytest.raises(Corruption) as caught:
        _range(directory)
    assert caught.value.detail["reason"] == "index_checksum" and caught.value.detail["database"] == "states"


def test_a_range_past_the_last_entry_checks_that_the_last_entry_sorts_before_it(tmp_path):
    """A sound last entry that sorts at or after the range's start, where the search found
    nothing, is a damaged page (the search and the entries disagree): ``CORRUPTION``, reason
    ``index_order``. A range after every entry of a sound index is simply empty."""
    directory = str(tmp_path / "index")
    b, c = _PREFIX + b"b", _PREFIX + b"c"
    _index_of(directory, {b: b"1", c: b"2"})
    assert _range(directory, start=_PREFIX + b"d") == []
    index = Index(directory, map_size=1 << 22)
    try:
        with index.begin() as txn:
            real = txn.cursor(db=index.dbs[b"states"])

            class Lost:  # the search misses every entry, the walk from the end finds c
                def __getattr__(self, name):
                    return getattr(real, name)

                def set_range(self, start):
                    return False

            txn_proxy = type("T", (), {"cursor": lambda self, db: Lost()})()
            for start in (b, c):  # the last entry after the start, or the start itself
                with pytest.raises(Corruption) as caught:
                    list(index.range(txn_proxy, b"states", _PREFIX, start))
                assert caught.value.detail["reason"] == "index_order"
    finally:
        index.close()


def _last_below(directory: str, bound: bytes) -> bytes | None:
    index = Index(directory, map_size=1 << 22)
    try:
        with index.begin() as txn:
            found = index.last_below(txn, b"states", _PREFIX, bound)
            return None if found is None else found[0]
    finally:
        index.close()


@pytest.mark.parametrize("damage", ["the entry searched for fails its seal", "the entry before is a copy of it", "the entry before sorts after it"])
def test_a_search_for_the_last_entry_below_a_bound_checks_both_entries_it_reads(tmp_path, damage):
    """last_below (the replay floor's search) answers from two entries: the one the search lands
    on, at or after the bound, and the one before it. Each must pass its seal and sort on its own
    side of the bound: one damaged or moved in the file is CORRUPTION, not another entry's answer."""
    directory = str(tmp_path / "index")
    b, c, d, e = _PREFIX + b"b", _PREFIX + b"c", _PREFIX + b"d", _PREFIX + b"e"
    _index_of(directory, {b: b"1", c: b"2", d: b"3"})
    assert (_last_below(directory, c), _last_below(directory, e), _last_below(directory, b)) == (b, d, None)
    if damage == "the entry searched for fails its seal":
        broken = bytearray(_node(c, b"2"))
        broken[-1] ^= 0x01
        _replace_in_file(directory, [(_node(c, b"2"), bytes(broken))])
    elif damage == "the entry before is a copy of it":
        _replace_in_file(directory, [(_node(b, b"1"), _node(c, b"1"))])  # c, c, d: the search lands on the second c
    else:
        _replace_in_file(directory, [(_node(b, b"1"), _node(e, b"1"))])  # e, c, d
    with pytest.raises(Corruption) as caught:
        _last_below(directory, c)
    reason = "index_checksum" if damage == "the entry searched for fails its seal" else "index_order"
    assert caught.value.detail["reason"] == reason


def _index_of_several_leaves(directory: str) -> tuple[dict[bytes, bytes], bytes]:
    """An index whose states hold 200 entries over several leaf pages, and the first key of a leaf
    (after the first), which is in the file twice: in its node and as the branch key to it."""
    entries = {_PREFIX + b"%04d" % (10 * n): b"v" * 40 for n in range(200)}
    index = Index(directory, map_size=1 << 22)
    with index.begin(write=True) as txn:  # appended: each split leaves no stale copy of a node behind
        txn.cursor(db=index.dbs[b"states"]).putmulti([(key, seal(b"states", key, value)) for key, value in entries.items()], append=True)
    index.close()
    with open(os.path.join(directory, "data.mdb"), "rb") as handle:
        data = handle.read()
    return entries, next(key for key in list(entries)[1:] if data.count(key) == 2)


def test_a_search_that_lands_below_its_bound_is_corruption(tmp_path):
    """A search goes down the branch keys: with the first entry of a leaf moved below the branch
    key that leads to it (a damaged page), a search for a bound between the two lands on that
    entry, which sorts before the bound. That is damage, not the entry before the bound."""
    directory = str(tmp_path / "index")
    entries, first = _index_of_several_leaves(directory)
    number = int(first[len(_PREFIX):])
    moved, bound = _PREFIX + b"%04d" % (number - 5), _PREFIX + b"%04d" % (number - 3)
    assert _last_below(directory, bound) == _PREFIX + b"%04d" % (number - 10)
    _replace_in_file(directory, [(_node(first, b"v" * 40), _node(moved, b"v" * 40))])
    with pytest.raises(Corruption) as caught:
        _last_below(directory, bound)
    assert caught.value.detail["reason"] == "index_order"


@pytest.mark.parametrize("read", ["a range from a start", "a deletion of a prefix"])
def test_a_search_a_raised_branch_key_sent_to_the_leaf_before_is_corruption(tmp_path, read):
    """With the branch key to a leaf raised past every key, a search for a key of that leaf goes
    to the leaf before, runs off its end, and LMDB lands on the first entry of the next leaf
    without comparing it: one that sorts before the start. A range served it and the entries after
    it (more than asked for; a range by prefix would have ended at once, empty), and a deletion of
    the prefix of the next entry deleted nothing and said so."""
    directory = str(tmp_path / "index")
    _, first = _index_of_several_leaves(directory)
    number = int(first[len(_PREFIX):])
    start, following = _PREFIX + b"%04d" % (number + 5), _PREFIX + b"%04d" % (number + 10)
    path = os.path.join(directory, "data.mdb")
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    node = _node(first, b"v" * 40)
    [branch] = [at for at in range(len(data)) if data.startswith(first, at) and not data.startswith(node, at)]
    data[branch : branch + len(first)] = _PREFIX + b"9999"
    with open(path, "wb") as handle:
        handle.write(data)
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                if read == "a range from a start":
                    list(index.range(txn, b"states", _PREFIX, start))
                else:
                    index.delete_range(txn, b"states", following)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_order", first.decode())
    finally:
        index.close()


# -- deleting ranges -------------------------------------------------------------------------------


def test_delete_range_counts_what_it_deleted_and_keeps_the_rest(tmp_path):
    index = Index(str(tmp_path / "index"), map_size=1 << 22)
    try:
        kept = [b"f\x00z", b"g\x01a", b"h\x00a"]
        with index.begin(write=True) as txn:
            for key in [_PREFIX + b"a", _PREFIX + b"b", _PREFIX + b"c", *kept]:
                index.put(txn, b"states", key, b"v")
        with index.begin(write=True) as txn:
            assert index.delete_range(txn, b"states", _PREFIX) == 3
            assert index.delete_range(txn, b"states", _PREFIX) == 0
        with index.begin() as txn:
            assert index.get(txn, b"states", _PREFIX + b"b") is None  # its presence went too
            assert [key for key, _ in index.range(txn, b"states", b"")] == kept
    finally:
        index.close()


@pytest.mark.parametrize(
    ("moved_to", "reached", "survivor"),
    [(b"e\x00b", "c", "a"), (b"g\x01b", "a", "c")],
    ids=["a key moved before the search's landing point", "a key that ends the walk early"],
)
def test_delete_range_over_a_damaged_key_is_corruption_not_a_survivor(tmp_path, moved_to, reached, survivor):
    """A damaged key inside the range either makes the search land past the first entries (g\x00b
    moved to e\x00b: the search lands on c) or ends the walk early (moved to g\x01b): the walk
    deleted what it reached and said so, and the entry it never reached (``survivor``) was left
    for a later get to serve as if sound. The entries that bound the walk are checked as a range
    checks them: ``CORRUPTION``, and nothing is deleted."""
    directory = str(tmp_path / "index")
    entries = {_PREFIX + name: value for name, value in ((b"a", b"1"), (b"b", b"2"), (b"c", b"3"))}
    _index_of(directory, entries)
    victim = _PREFIX + b"b"
    _replace_in_file(directory, [(_node(victim, entries[victim]), moved_to + _node(victim, entries[victim])[len(moved_to) :])])
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.delete_range(txn, b"states", _PREFIX)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_checksum", moved_to.decode())
        with index.begin() as txn:
            assert bytes(index.get(txn, b"states", _PREFIX + reached.encode())) == entries[_PREFIX + reached.encode()]
    finally:
        index.close()


@pytest.mark.parametrize(
    ("entries", "moved", "damaged"),
    [
        ({_PREFIX + b"a": b"v", _PREFIX + b"b": b"v", b"g\x02c": b"v", b"g\x02d": b"v"}, b"g\x02c", b"g\x00c"),
        ({b"e\x00x": b"1", _PREFIX + b"b": b"2", _PREFIX + b"c": b"3"}, b"e\x00x", b"g\x00x"),
    ],
    ids=["the next prefix's first key, moved after the prefix's entries", "the key before the prefix, moved where the search lands"],
)
def test_delete_range_checks_the_seal_of_each_entry_it_deletes(tmp_path, entries, moved, damaged):
    """A bit flipped in another prefix's key moves that entry into the prefix being deleted: after
    its own entries (g\x02c -> g\x00c), or first in the page, where the search lands and no entry
    before it is checked (e\x00x -> g\x00x). The walk deleted it with them, unreported, and a
    range over its own prefix then answered without it (g\x02d alone). Each entry the walk deletes
    must pass its seal: ``CORRUPTION``, nothing is deleted, and the damage is still reported to
    the moved entry's own prefix."""
    directory = str(tmp_path / "index")
    _index_of(directory, entries)
    _replace_in_file(directory, [(_node(moved, entries[moved]), damaged + _node(moved, entries[moved])[len(damaged) :])])
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.delete_range(txn, b"states", _PREFIX)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_checksum", damaged.decode())
        with index.begin() as txn:
            for key, value in entries.items():
                if key.startswith(_PREFIX):
                    assert bytes(index.get(txn, b"states", key)) == value
            with pytest.raises(Corruption):
                list(index.range(txn, b"states", moved[:2]))
    finally:
        index.close()


@pytest.mark.parametrize("damage", ["two entries swapped", "an entry repeated"])
def test_delete_range_over_keys_out_of_order_is_corruption_not_a_deletion(tmp_path, damage):
    """The deletion's walk checks the order of the entries it deletes as a range checks them:
    two sound entries swapped (c met before b), or one entry's node copied over its neighbour (b
    twice), each still passing its seal, is ``CORRUPTION`` (``index_order`` at the second), and
    nothing is deleted."""
    directory = str(tmp_path / "index")
    a, b, c, d = _PREFIX + b"a", _PREFIX + b"b", _PREFIX + b"c", _PREFIX + b"d"
    _index_of(directory, {a: b"1", b: b"2", c: b"3", d: b"4"})
    if damage == "two entries swapped":
        _replace_in_file(directory, [(_node(b, b"2"), _node(c, b"3")), (_node(c, b"3"), _node(b, b"2"))])
    else:
        _replace_in_file(directory, [(_node(c, b"3"), _node(b, b"2"))])
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.delete_range(txn, b"states", _PREFIX)
        assert (caught.value.detail["reason"], caught.value.detail["key"].encode()) == ("index_order", b)
        with index.begin() as txn:
            assert bytes(index.get(txn, b"states", a)) == b"1" and bytes(index.get(txn, b"states", d)) == b"4"
    finally:
        index.close()


def _move_entry(index: Index, source: bytes, target: bytes) -> bytes:
    """Move the ``states`` entry at ``source`` under ``target``, as a flipped key leaves it (still
    in key order, its seal still the source key's); returns the moved sealed bytes."""
    with index.begin(write=True) as txn:
        stored = bytes(txn.get(source, db=index.dbs[b"states"]))
        assert txn.delete(source, db=index.dbs[b"states"])
        txn.put(target, stored, db=index.dbs[b"states"])
    return stored


def _index_with_b_moved_under_c(directory: str) -> tuple[Index, tuple[bytes, ...], bytes]:
    """An index whose ``states`` held a, b and d, with b's entry moved under c (see
    :func:`_move_entry`): the index (the caller closes it), the four keys, the moved bytes."""
    a, b, c, d = _PREFIX + b"a", _PREFIX + b"b", _PREFIX + b"c", _PREFIX + b"d"
    _index_of(directory, {a: b"1", b: b"2", d: b"4"})
    index = Index(directory, map_size=1 << 22)
    return index, (a, b, c, d), _move_entry(index, b, c)


@pytest.mark.parametrize("new", [None, "the created keys"])
def test_a_key_written_for_the_first_time_over_an_entry_damage_moved_there_is_corruption(tmp_path, new):
    """A redo or a rebuild writes each aggregate's state without reading it first, recording
    presence for those at revision 1 (``new``). b's entry moved by damage onto c's key (still in
    key order), then c created: the write erased the moved entry, and a range of the Group
    answered a, c, d without b and no error (b's presence entry remained; a range checks presence
    at its ends only). As many keys must gain an entry as gain their presence entry:
    ``CORRUPTION`` (``index_order``); the caller's transaction aborts."""
    index, (a, b, c, d), stored = _index_with_b_moved_under_c(str(tmp_path / "index"))
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.put_many(txn, b"states", [(a, b"1+"), (c, b"3")], None if new is None else [c])
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("index_order", "states")
        with index.begin() as txn:
            assert bytes(txn.get(c, db=index.dbs[b"states"])) == stored  # nothing written over it
    finally:
        index.close()


def test_a_fresh_write_over_an_entry_damage_moved_there_names_the_key(tmp_path):
    """``fresh`` in a database with presence entries, every key new to both: the moved entry is
    found by its key (its seal fails there), as ``fresh`` promises, not only counted."""
    directory = str(tmp_path / "index")
    b, c = _PREFIX + b"b", _PREFIX + b"c"
    _index_of(directory, {b: b"2"})
    index = Index(directory, map_size=1 << 22)
    try:
        stored = _move_entry(index, b, c)
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.put_many(txn, b"states", [(c, b"3")], fresh=True)
        assert caught.value.detail.get("key") == c.decode()
    finally:
        index.close()


@pytest.mark.parametrize("new", [None, "the created keys"])
@pytest.mark.parametrize("count", [1, 2], ids=["one key", "two keys"])
def test_a_write_of_new_keys_only_over_an_entry_damage_moved_there_is_corruption(tmp_path, new, count):
    """As above, with every key written gaining its presence entry (a commit's new receipt, a new
    aggregate's first state), which ``put_many_sealed`` writes without overwriting and counts
    without ``stat`` (one key: with ``Transaction.put``, without a cursor): c created over b's
    moved entry is ``CORRUPTION`` (``index_order``), the moved entry is not written over, and a
    write of keys that are all new is written whole."""
    index, (a, b, c, d), stored = _index_with_b_moved_under_c(str(tmp_path / "index"))
    try:
        others = [(_PREFIX + b"e", b"5")][: count - 1]
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                items = [(c, b"3"), *others]
                index.put_many(txn, b"states", items, None if new is None else [key for key, _ in items])
        assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("index_order", "states")
        with index.begin() as txn:
            assert bytes(txn.get(c, db=index.dbs[b"states"])) == stored  # nothing written over it
            assert all(txn.get(key, db=index.dbs[b"states"]) is None for key, _ in others)
        written = [(_PREFIX + b"f", b"6"), (_PREFIX + b"g", b"7")][:count]
        with index.begin(write=True) as txn:
            index.put_many(txn, b"states", written, None if new is None else [key for key, _ in written])
        with index.begin() as txn:
            assert [(key, bytes(index.get(txn, b"states", key))) for key, _ in written] == written
    finally:
        index.close()


def test_a_key_written_again_whose_entry_alone_was_gone_is_written_not_refused(tmp_path):
    """The other way the count can differ: a key whose entry was gone while its presence entry
    stayed (as a deletion over a damaged presence page leaves it, in an open without the
    structural check) gains an entry without gaining presence. Writing it again is no moved
    entry erased: it is written, as before."""
    directory = str(tmp_path / "index")
    a, b, c = _PREFIX + b"a", _PREFIX + b"b", _PREFIX + b"c"
    _index_of(directory, {a: b"1", b: b"2"})
    index = Index(directory, map_size=1 << 22)
    try:
        with index.begin(write=True) as txn:
            assert txn.delete(b, db=index.dbs[b"states"])  # its presence entry stays
        with index.begin(write=True) as txn:
            index.put_many(txn, b"states", [(b, b"2"), (c, b"3")])
        with index.begin() as txn:
            assert [(key, bytes(value)) for key, value in index.range(txn, b"states", _PREFIX)] == [(a, b"1"), (b, b"2"), (c, b"3")]
    finally:
        index.close()


def test_delete_range_whose_entries_damage_moved_before_it_checks_the_last_entry(tmp_path):
    """With the prefix's only entry moved before it by a flipped bit (g -> e), the search finds no
    entry at or after the prefix: the walk must still check the database's last entry, or the
    deletion says 0 and succeeds over the damage. ``CORRUPTION`` (``index_checksum``)."""
    directory = str(tmp_path / "index")
    victim = _PREFIX + b"b"
    _index_of(directory, {b"a\x00x": b"1", victim: b"2"})
    _replace_in_file(directory, [(_node(victim, b"2"), b"e" + _node(victim, b"2")[1:])])
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                index.delete_range(txn, b"states", _PREFIX)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_checksum", "e\x00b")
    finally:
        index.close()


@pytest.mark.parametrize("found", [True, False], ids=["the entry before the landing point", "the last entry, where the search found none"])
def test_delete_range_refuses_a_bounding_entry_before_it_that_equals_the_prefix(tmp_path, found):
    """A key equal to the prefix starts with it: a search that skipped it (a damaged branch) would
    leave it behind, sound, if the entry before the walk were only required not to sort after the
    prefix. It must sort strictly before it: ``CORRUPTION`` (``index_order``), nothing deleted."""
    directory = str(tmp_path / "index")
    entries = {b"f\x00z": b"1", _PREFIX: b"2", **({_PREFIX + b"a": b"3"} if found else {})}
    _index_of(directory, entries)
    index = Index(directory, map_size=1 << 22)
    try:
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                real = txn.cursor(db=index.dbs[b"states"])

                class Skipping:  # the search passes over the entry equal to the prefix
                    def __getattr__(self, name):
                        return getattr(real, name)

                    def set_range(self, key):
                        return real.set_range(key + b"a") if found else False

                txn_proxy = type("T", (), {"cursor": lambda self, db: Skipping()})()
                index.delete_range(txn_proxy, b"states", _PREFIX)
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_order", _PREFIX.decode())
        with index.begin() as txn:
            assert [key for key, _ in index.range(txn, b"states", b"")] == list(entries)
    finally:
        index.close()


# -- read paths translate what damage raises ---------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        lmdb.CorruptedError("damaged page"),
        msgspec.DecodeError("truncated"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        struct.error("unpack requires a buffer of 8 bytes"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_read_path_turns_what_damage_raises_into_corruption_naming_the_store_and_remedy(error):
    @typed_damage("test store", "rebuild it", "test_damage")
    def read() -> None:
        raise error

    with pytest.raises(Corruption) as caught:
        read()
    assert caught.value.detail["reason"] == "test_damage"
    assert caught.value.message.startswith("the test store is damaged") and caught.value.message.endswith("; rebuild it")


def test_a_read_path_given_its_own_errors_lets_every_other_error_through():
    @typed_damage("test store", "rebuild it", "test_damage", (lmdb.Error,))
    def run(error: BaseException) -> None:
        raise error

    with pytest.raises(struct.error):
        run(struct.error("raised by application code"))
    with pytest.raises(Corruption):
        run(lmdb.CorruptedError("damaged page"))


def test_an_application_projection_raising_a_decode_error_is_not_reported_as_damage(tmp_path):
    """A transaction runs application code: what a projection raises, even a struct.error, is
    that error, not ``CORRUPTION`` of the agent store."""
    from agent_store_support import workload
    from mwpstore.agent_store import AgentStore
    from test_agent_store import FailingProjection

    agent = AgentStore.open(tmp_path / "agent", projections=[FailingProjection(fail_seq=1, error=struct.error)])
    try:
        with pytest.raises(struct.error):
            with agent.begin() as tx:
                tx.apply(workload(GROUP, 3)[0])
        assert agent.head(GROUP).applied_seq == 0
    finally:
        agent.close()


# -- the index's layout and values -----------------------------------------------------------------


def test_an_ack_is_kept_under_consumer_then_group(tmp_path):
    """docs/format/index.md: ``acks`` is keyed consumer ``\\0`` group."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.ack("bob", GROUP, 1)
        with authority.index.begin() as txn:
            assert bytes(authority.index.get(txn, b"acks", b"bob\x00" + GROUP.encode())) == (1).to_bytes(8, "big")
            assert authority.index.get(txn, b"acks", GROUP.encode() + b"\x00bob") is None


def test_a_state_value_round_trips_with_its_revision_and_a_deleted_state_is_none():
    from mwpstore.index import decode_state, encode_state

    assert decode_state(encode_state(7, {"a": [1, "b"]})) == (7, {"a": [1, "b"]})
    assert encode_state(3, None) == (3).to_bytes(8, "big")
    assert decode_state(encode_state(3, None)) == (3, None)


@pytest.mark.parametrize(
    "value",
    [
        b"\x00" * 7,  # shorter than its revision
        b"\x00" * 7 + b"\x01" + b"\xc1",  # 0xc1 is never msgpack
        b"\x00" * 7 + b"\x01" + b"\x81\xa1a",  # a map cut short
        b"\x00" * 7 + b"\x01" + msgspec.msgpack.encode([1, 2]),  # not a map
        b"\x00" * 7 + b"\x01" + msgspec.msgpack.encode({1: "a"}),  # a key that is no string
    ],
    ids=["short", "not msgpack", "truncated", "a list", "an int key"],
)
def test_an_undecodable_state_value_is_the_index_state_corruption(value):
    from mwpstore.index import decode_state

    with pytest.raises(Corruption) as caught:
        decode_state(value)
    assert caught.value.detail["reason"] == "index_state"


def test_a_sealed_state_that_is_not_a_map_is_corruption_not_an_answer(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(mission_create("m-1"))
        key = GROUP.encode() + b"\x00mission:m-1"
        with authority.index.begin(write=True) as txn:
            authority.index.put(txn, b"states", key, (1).to_bytes(8, "big") + msgspec.msgpack.encode(["open"]), new=False)
        with pytest.raises(Corruption) as caught:
            authority.state(GROUP, "mission:m-1")
        assert caught.value.detail["reason"] == "index_state"


def test_an_index_refused_for_a_lost_database_holds_none_of_its_files(tmp_path):
    """Refusing an environment that lost some of its databases closes it again: nothing of it
    stays open or mapped in this process (the store's open reports the damage and runs no more)."""
    from authority_helpers import store_files_held
    from mwpstore.index import DATABASE_NAMES

    directory = str(tmp_path / "index")
    Index(directory, map_size=1 << 22).close()
    env = lmdb.open(directory, max_dbs=len(DATABASE_NAMES) + 2)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"acks", txn=txn), delete=True)
    env.close()
    assert store_files_held(directory) == []
    with pytest.raises(Corruption) as caught:
        Index(directory, map_size=1 << 22)
    assert caught.value.detail["reason"] == "missing_database"
    assert store_files_held(directory) == []


def test_iterate_refuses_a_value_longer_than_any_sealed_value_before_reading_it(tmp_path):
    from mwpstore.index import SEAL_BYTES

    index = Index(str(tmp_path / "index"), map_size=1 << 26)
    try:
        longest = limits.LMDB_VALUE_BYTES_MAX + SEAL_BYTES
        with index.begin(write=True) as txn:
            txn.put(b"a", b"x" * longest, db=index.dbs[b"events"])
        assert [(key, len(value)) for key, value in index.iterate(b"events")] == [(b"a", longest)]
        with index.begin(write=True) as txn:
            txn.put(b"b", b"x" * (longest + 1), db=index.dbs[b"events"])
        with pytest.raises(Corruption) as caught:
            list(index.iterate(b"events"))
        assert caught.value.detail["reason"] == "index_checksum" and caught.value.detail["key"] == "b"
    finally:
        index.close()


def test_a_key_written_in_one_database_is_absent_not_lost_in_every_other(tmp_path):
    """Each database confirms its misses against presence under a tag byte of its own: a key
    written in one database is never taken for a lost entry of another."""
    from mwpstore.index import PRESENCE_TAGS

    index = Index(str(tmp_path / "index"), map_size=1 << 22)
    try:
        key = b"g-1\x00mission:m-1"
        for written in PRESENCE_TAGS:
            with index.begin(write=True) as txn:
                index.put(txn, written, key, b"v")
                for other in PRESENCE_TAGS:
                    if other != written:
                        assert index.get(txn, other, key) is None, (written, other)
                txn.abort()
    finally:
        index.close()


@pytest.mark.parametrize("digest", [bytes(32), b"\xff" * 31 + b"\x00"], ids=["zeros", "ending in zero"])
def test_a_head_round_trips_whatever_its_hash_ends_with(digest):
    from mwpstore.index import decode_head, encode_head

    assert decode_head(encode_head(5, digest)) == (5, digest)
    assert decode_head(None) == (0, bytes(32))


def test_pending_writes_are_written_once_so_a_later_direct_write_is_kept(tmp_path):
    """``flush`` empties what it wrote: a second flush must not write an earlier value again
    over one written since (later writes to a key win)."""
    from mwpstore.index import PendingWrites

    index = Index(str(tmp_path / "index"), map_size=1 << 22)
    try:
        writes = PendingWrites()
        with index.begin(write=True) as txn:
            writes.put(b"states", b"k", b"first")
            writes.flush(index, txn)
            index.put(txn, b"states", b"k", b"second", new=False)
            writes.put(b"receipts", b"r", b"other")
            writes.flush(index, txn)
            assert bytes(index.get(txn, b"states", b"k")) == b"second"
            assert bytes(index.get(txn, b"receipts", b"r")) == b"other"
    finally:
        index.close()


# -- the built-in kinds ----------------------------------------------------------------------------

@pytest.mark.parametrize("title", ["", 5, None], ids=["empty", "an int", "null"])
def test_a_mission_title_must_be_a_non_empty_string(h: Harness, title):
    h.reject(InvalidCommand, "owner", "mission.create", "m2", {"title": title, "cost_limit": 1}, field="body.title")
    h.reject(InvalidCommand, "owner", "mission.update", "m1", {"title": title}, cas=True, field="body.title")


def test_a_mission_is_not_created_without_a_title(h: Harness):
    h.reject(InvalidCommand, "owner", "mission.create", "m2", {"cost_limit": 1}, field="body.title")


@pytest.mark.parametrize("approvals", [[""], ["publish", ""], ["publish", 1], "publish", {"publish": 1}],
                         ids=["an empty name", "an empty name among others", "a number among names", "a string", "a map"])
def test_a_missions_approval_list_is_a_list_of_non_empty_names(h: Harness, approvals):
    h.reject(InvalidCommand, "owner", "mission.create", "m2", {"title": "t", "approval_required": approvals},
             field="body.approval_required")


def test_a_missions_approval_names_are_no_longer_than_an_approval_can_name(h: Harness):
    """approval.request takes an operation of at most 128 characters: a Mission listing a longer
    name would gate an operation no Approval could ever approve, so the Mission is refused."""
    h.reject(InvalidCommand, "owner", "mission.create", "m2", {"title": "t", "approval_required": ["p" * 129]},
             field="body.approval_required")
    h.reject(InvalidCommand, "owner", "mission.update", "m1", {"approval_required": ["publish", "p" * 129]}, cas=True,
             field="body.approval_required")
    h.accept("owner", "mission.create", "m2", {"title": "t", "approval_required": ["p" * 128]})
    assert h.get("mission:m2")["approval_required"] == ["p" * 128]


def test_the_first_unknown_field_in_name_order_is_the_one_named(h: Harness):
    h.reject(InvalidCommand, "owner", "mission.create", "m2", {"title": "t", "zeta": 1, "alpha": 2}, field="body.alpha")


@pytest.mark.parametrize(
    ("kind", "target", "body"),
    [
        ("group.create", None, {"org": "org1", "extra": 1}),
        ("group.archive", WM_GROUP, {"extra": 1}),
        ("mission.close", "m1", {"extra": 1}),
    ],
)
def test_a_group_or_mission_command_with_an_unknown_field_is_refused(new_harness, kind, target, body):
    h = new_harness()
    if kind != "group.create":
        h.setup()
    h.reject(InvalidCommand, "owner", kind, target or WM_GROUP, body, field="body.extra")


@pytest.mark.parametrize("org", ["", "a b", "-org", "o" * (limits.ID_CHARS_MAX + 1), 5])
def test_a_groups_organization_must_be_an_id(new_harness, org):
    new_harness().reject(InvalidCommand, "owner", "group.create", WM_GROUP, {"org": org}, field="body.org")


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ([], "body.policy"),
        ("", "body.policy"),
        ({"retention": 1}, "body.policy"),
        ({"audit_retention_days": -1}, "body.policy.audit_retention_days"),
        ({"replay_window_events": True}, "body.policy.replay_window_events"),
        ({"replay_window_events": 1.5}, "body.policy.replay_window_events"),
    ],
    ids=["a list", "a string", "an unknown field", "negative", "a boolean", "a float"],
)
def test_a_group_policy_is_a_map_of_known_non_negative_integers(new_harness, policy, field):
    new_harness().reject(InvalidCommand, "owner", "group.create", WM_GROUP, {"org": "org1", "policy": policy}, field=field)


def test_a_public_key_of_an_odd_number_of_hex_digits_is_refused(new_harness):
    from test_work_model_bounds import VALID_KEY

    new_harness().reject(InvalidCommand, "owner", "group.create", WM_GROUP, {"org": "org1", "public_key": VALID_KEY + "0"},
                         field="body.public_key")


def test_a_group_records_its_creation_time_and_its_creators_public_key(new_harness):
    from test_work_model_bounds import VALID_KEY

    h = new_harness()
    h.accept("owner", "group.create", WM_GROUP, {"org": "org1", "public_key": VALID_KEY.upper()})
    assert h.get(f"group:{WM_GROUP}")["created_at_ms"] == h.now_ms
    assert h.get("member:owner")["public_key"] == VALID_KEY.lower()


def test_group_archive_must_target_the_group_itself(h: Harness):
    h.reject(InvalidCommand, "owner", "group.archive", "g9", {}, field="target")


@pytest.mark.parametrize("kind", ["group.archive", "mission.close"])
@pytest.mark.parametrize("reason", ["", 5, "r" * 1025], ids=["empty", "an int", "too long"])
def test_a_reason_must_be_a_non_empty_string_when_given(h: Harness, kind, reason):
    target = WM_GROUP if kind == "group.archive" else "m1"
    h.reject(InvalidCommand, "owner", kind, target, {"reason": reason}, field="body.reason")


def test_updating_a_mission_that_does_not_exist_is_not_found_naming_the_target(h: Harness):
    h.reject(NotFound, "owner", "mission.update", "m9", {"title": "t"}, cas=True, field="target")


def test_a_closed_mission_refusal_names_its_state(h: Harness):
    h.accept("owner", "mission.close", "m1", {})
    error = h.reject(InvalidState, "owner", "mission.update", "m1", {"title": "t"}, cas=True)
    assert error.detail["state"] == "closed"


def test_a_mission_of_an_archived_group_cannot_be_closed(h: Harness):
    h.accept("owner", "group.archive", WM_GROUP, {})
    h.reject(GroupArchived, "owner", "mission.close", "m1", {})


@pytest.mark.parametrize(("kind", "target", "key"), [("group.archive", WM_GROUP, f"group:{WM_GROUP}"),
                                                      ("mission.close", "m1", "mission:m1")])
def test_archive_and_close_write_new_states_and_never_change_the_ones_they_read(h: Harness, kind, target, key):
    before = h.get(key)
    status = before["status"]
    h.accept("owner", kind, target, {})
    assert before["status"] == status and h.get(key)["status"] != status


class _LandingBelow:
    """A write transaction whose cursors' first search over ``states`` lands on ``landing``, as
    LMDB does when a raised branch key sends the search to the leaf before and it runs off that
    leaf's end: onto the next leaf's first entry, without comparing it."""

    def __init__(self, txn, states, landing: bytes) -> None:
        self._txn, self._states, self._landing = txn, states, landing

    def __getattr__(self, name):
        return getattr(self._txn, name)

    def cursor(self, db=None):
        cursor = self._txn.cursor(db=db)
        if db is not self._states:
            return cursor
        landing = self._landing

        class Cursor:
            def __getattr__(self, name):
                return getattr(cursor, name)

            def set_range(self, key):
                return cursor.set_range(landing)

        return Cursor()


def test_delete_range_from_a_start_whose_search_lands_on_an_entry_of_the_prefix_below_it_is_corruption(tmp_path):
    """A deletion from a start inside the prefix (``prune_inbox`` deletes from the pruned sequence
    up to the Cursor) whose search lands below the start, on a sound entry of the same prefix,
    would delete that entry and count it. The first entry deleted must sort at or after the start:
    ``CORRUPTION`` (``index_order``), and the transaction is aborted by the caller."""
    index = Index(str(tmp_path / "index"), map_size=1 << 22)
    try:
        with index.begin(write=True) as txn:
            for name in (b"a", b"b", b"c", b"d"):
                index.put(txn, b"states", _PREFIX + name, b"v")
        with pytest.raises(Corruption) as caught:
            with index.begin(write=True) as txn:
                landed = _LandingBelow(txn, index.dbs[b"states"], _PREFIX + b"b")
                index.delete_range(landed, b"states", _PREFIX, _PREFIX + b"c", _PREFIX + b"d")
        assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("index_order", "g\x00b")
        with index.begin(write=True) as txn:  # the same deletion, searched as LMDB searches a sound tree
            assert index.delete_range(txn, b"states", _PREFIX, _PREFIX + b"c", _PREFIX + b"d") == 2
        with index.begin() as txn:
            assert [bytes(key) for key, _ in index.range(txn, b"states", _PREFIX)] == [_PREFIX + b"a", _PREFIX + b"b"]
    finally:
        index.close()
