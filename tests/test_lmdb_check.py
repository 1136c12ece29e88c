"""The structural check of LMDB files (csrc/lmdb_check.c): healthy files pass, each kind of
damage LMDB would trip over is named, and the stores run it before LMDB maps their files.

LMDB trusts its pages: one damaged node size makes it (and the binding, which touches every page
of a value it returns) read past the end of the file, and the process dies with SIGBUS. The last
tests show that crash with the check turned off and the typed error with it on.
"""

from __future__ import annotations

import errno
import os
import random
import struct
import subprocess
import sys
import textwrap

import lmdb
import pytest

from agent_store_support import CountingProjection, workload
from authority_helpers import GROUP, mission_create, open_with_group
from mwpstore import Authority, Corruption, limits
from mwpstore._lmdb_check import check_before_open, check_lmdb_file
from mwpstore.agent_store import AgentStore
from mwpstore.errors import InvalidCommand

PAGE = 4096
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02


# -- a small reader of the layout, to aim damage at reachable pages -----------------------------


def _meta(data: bytes) -> tuple[int, int, int]:
    """(free root, main root, last page) of the meta LMDB would use."""
    picked = max((0, 1), key=lambda n: (struct.unpack_from("<Q", data, n * PAGE + 144)[0], -n))
    base = picked * PAGE
    free_root, main_root = (struct.unpack_from("<Q", data, base + off + 40)[0] for off in (40, 88))
    return free_root, main_root, struct.unpack_from("<Q", data, base + 136)[0]


def _meta_pages(data_file) -> tuple[bytearray, int, list[int]]:
    """The file's bytes (to damage), its page size, and the transaction ids of meta pages 0 and 1."""
    data = bytearray(data_file.read_bytes())
    page = struct.unpack_from("<I", data, 40)[0]
    return data, page, [struct.unpack_from("<Q", data, number * page + 144)[0] for number in (0, 1)]


def _nodes(data: bytes, page: int):
    base = page * PAGE
    lower = struct.unpack_from("<H", data, base + 12)[0]
    for i in range((lower - 16) // 2):
        offset = struct.unpack_from("<H", data, base + 16 + 2 * i)[0]
        lo, hi, flags, key_bytes = struct.unpack_from("<HHHH", data, base + offset)
        yield base + offset, lo, hi, flags, key_bytes


def _reachable(data: bytes, *, named_only: bool = False) -> dict[int, int]:
    """Page number -> page flags, for every page reachable from the used meta (overflow pages
    by their first page); with ``named_only``, the pages of named databases only."""
    found: dict[int, int] = {}
    free_root, main_root, _ = _meta(data)
    pending = [(root, False) for root in (free_root, main_root) if root != 2**64 - 1]
    while pending:
        page, named = pending.pop()
        flags = struct.unpack_from("<H", data, page * PAGE + 10)[0]
        if named or not named_only:
            found[page] = flags
        for at, lo, hi, node_flags, key_bytes in _nodes(data, page):
            if flags == P_BRANCH:
                pending.append((lo | hi << 16 | node_flags << 32, named))
            elif node_flags & F_BIGDATA:
                if named or not named_only:
                    found[struct.unpack_from("<Q", data, at + 8 + key_bytes)[0]] = P_OVERFLOW
            elif node_flags & F_SUBDATA:
                root = struct.unpack_from("<Q", data, at + 8 + key_bytes + 40)[0]
                if root != 2**64 - 1:
                    pending.append((root, True))
    return found


def _sample_env(path: str) -> str:
    """An LMDB environment like the stores' (named databases, values on overflow pages, pages
    freed by deletes); returns its data file."""
    env = lmdb.open(path, max_dbs=4, map_size=1 << 26)
    small, large = env.open_db(b"small"), env.open_db(b"large")
    with env.begin(write=True) as txn:
        for i in range(2000):
            txn.put(b"k%06d" % i, b"v" * (i % 90), db=small)
        for i in range(20):
            txn.put(b"big%02d" % i, bytes([i]) * (5000 + 700 * i), db=large)
    with env.begin(write=True) as txn:
        for i in range(0, 2000, 3):
            txn.delete(b"k%06d" % i, db=small)
        txn.delete(b"big03", db=large)
    env.close()
    return os.path.join(path, "data.mdb")


def _damaged_copy(tmp_path, source: str, change) -> str:
    data = bytearray(open(source, "rb").read())
    change(data)
    target = tmp_path / "damaged"
    target.mkdir(exist_ok=True)
    path = str(target / "data.mdb")
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def _check_fails(path: str, check: str) -> Corruption:
    with pytest.raises(Corruption) as caught:
        check_lmdb_file(path, label="test", remedy="rebuild it")
    assert caught.value.detail["reason"] == "lmdb_structure"
    assert caught.value.detail["check"] == check, caught.value.message
    return caught.value


# -- healthy files ------------------------------------------------------------------------------


def test_healthy_files_pass_with_every_page_accounted(tmp_path):
    path = _sample_env(str(tmp_path / "env"))
    result = check_lmdb_file(path, label="test", remedy="-")
    data = open(path, "rb").read()
    _, _, last_page = _meta(data)
    reachable = _reachable(data)
    overflow = sum(1 for flags in reachable.values() if flags == P_OVERFLOW)
    assert overflow >= 19 and result.pages_free > 0
    # in use + free + the two metas: every page LMDB has handed out, none twice
    assert result.pages_in_use + result.pages_free + 2 == last_page + 1
    assert result.page_bytes == PAGE and result.file_bytes == len(data)


def test_an_empty_environment_passes(tmp_path):
    lmdb.open(str(tmp_path / "env"), map_size=1 << 20).close()
    result = check_lmdb_file(str(tmp_path / "env" / "data.mdb"), label="test", remedy="-")
    assert result.pages_in_use == 0


def test_the_stores_files_pass(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(300)])
    assert check_lmdb_file(str(tmp_path / "store" / "index" / "data.mdb"), label="index", remedy="-").pages_in_use > 10
    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for event in workload(GROUP, 200, seed=3):
                tx.apply(event)
            tx.advance_cursor(GROUP)
    assert check_lmdb_file(str(tmp_path / "agent" / "lmdb" / "data.mdb"), label="agent", remedy="-").pages_in_use > 5


# -- each kind of damage ------------------------------------------------------------------------


@pytest.fixture
def sample(tmp_path):
    return _sample_env(str(tmp_path / "env"))


def _first(data, kind: int) -> int:
    """The lowest-numbered page of that kind in a named database."""
    return min(page for page, flags in _reachable(bytes(data), named_only=True).items() if flags == kind)


def test_a_meta_page_without_its_magic(tmp_path, sample):
    _check_fails(_damaged_copy(tmp_path, sample, lambda d: d.__setitem__(16, d[16] ^ 0x01)), "meta")


def test_an_impossible_page_size(tmp_path, sample):
    _check_fails(_damaged_copy(tmp_path, sample, lambda d: struct.pack_into("<I", d, 40, 4096 + 512)), "page_size")


def test_a_meta_naming_pages_far_past_the_end_of_the_file(tmp_path, sample):
    def change(d):
        for meta in (0, 1):
            struct.pack_into("<Q", d, meta * PAGE + 136, 1 << 40)
    _check_fails(_damaged_copy(tmp_path, sample, change), "file_short")


def test_a_leaf_node_whose_data_runs_off_its_page(tmp_path, sample):
    """The damage behind the SIGBUS the torture suite found: a node's data size made huge."""
    def change(d):
        page = _first(d, P_LEAF)
        at, lo, hi, flags, key_bytes = next(node for node in _nodes(bytes(d), page) if not node[3] & (F_BIGDATA | F_SUBDATA))
        struct.pack_into("<H", d, at + 2, hi | 0x2000)
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_bounds")


def test_a_node_offset_outside_its_page_area(tmp_path, sample):
    def change(d):
        page = _first(d, P_LEAF)
        struct.pack_into("<H", d, page * PAGE + 16, 12)  # points into the header
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_bounds")


def _leaf_with_nodes(d, count: int) -> int:
    return next(page for page, flags in _reachable(bytes(d), named_only=True).items()
                if flags == P_LEAF and sum(1 for _ in _nodes(bytes(d), page)) >= count)


@pytest.mark.parametrize(
    "damage, check",
    [("lower inside the header", "page_bounds"), ("lower one offset past upper", "page_bounds"),
     ("a branch without entries", "branch_empty")],
)
def test_page_bounds_that_name_no_sound_node_area(tmp_path, sample, damage, check):
    """A page's `lower` and `upper` bound its offsets and nodes: below the header the offsets
    start inside it, past `upper` the last offset is read from a node, and a branch whose area
    is empty (`lower` at the header, `upper` at the page's end) leads nowhere."""
    def change(d):
        page = _first(d, P_BRANCH if check == "branch_empty" else P_LEAF)
        upper = struct.unpack_from("<H", d, page * PAGE + 14)[0]
        lower, upper = {"lower inside the header": (14, upper), "lower one offset past upper": (upper + 2, upper),
                        "a branch without entries": (16, PAGE)}[damage]
        struct.pack_into("<HH", d, page * PAGE + 12, lower, upper)
    _check_fails(_damaged_copy(tmp_path, sample, change), check)


def test_a_leaf_whose_lower_bound_lost_its_last_offsets(tmp_path, sample):
    """A flipped bit in `lower` (the corruption suite's seed 75, on an AgentStore): four offsets
    fewer, the page still looks sound, and a range read would skip four entries without an error.
    Their nodes still take up the node area, which the offsets left must account for."""
    def change(d):
        page = _leaf_with_nodes(d, 5)
        lower = struct.unpack_from("<H", d, page * PAGE + 12)[0]
        struct.pack_into("<H", d, page * PAGE + 12, lower - 8)
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_layout")


def test_two_offsets_naming_the_same_node(tmp_path, sample):
    def change(d):
        page = _leaf_with_nodes(d, 2)
        first = struct.unpack_from("<H", d, page * PAGE + 16)[0]
        struct.pack_into("<H", d, page * PAGE + 18, first)
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_layout")


def test_a_node_whose_key_grew_into_its_neighbour(tmp_path, sample):
    def change(d):
        page = _leaf_with_nodes(d, 2)
        at, lo, hi, flags, key_bytes = next(_nodes(bytes(d), page))
        struct.pack_into("<H", d, at + 6, key_bytes + 2)
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_layout")


def _node_bytes(lo: int, hi: int, flags: int, key_bytes: int) -> int:
    """What a leaf node takes in its page: header, key, data (or an overflow page number), even."""
    size = 8 + key_bytes + (8 if flags & F_BIGDATA else lo | hi << 16)
    return size + (size & 1)


def test_a_node_that_covers_its_neighbour(tmp_path, sample):
    """The nodes still fill the page from `upper` to its end, but one of them now spans its
    neighbour too: the offset naming the neighbour points inside another node."""
    def change(d):
        page = _leaf_with_nodes(d, 2)
        nodes = sorted(_nodes(bytes(d), page))  # by place in the page
        for (at, lo, hi, flags, key_bytes), (next_at, *next_node) in zip(nodes, nodes[1:]):
            if next_at == at + _node_bytes(lo, hi, flags, key_bytes):
                struct.pack_into("<H", d, at + 6, key_bytes + _node_bytes(*next_node))
                return
        raise AssertionError("no two neighbouring nodes")
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_layout")


def test_a_node_moved_to_an_odd_offset(tmp_path, sample):
    """LMDB keeps nodes at even offsets; a node of odd size moved up one byte (its offset with it)
    still ends where its rounded size says, so only the offset's parity tells."""
    def change(d):
        page = _leaf_with_nodes(d, 2)
        for index, (at, lo, hi, flags, key_bytes) in enumerate(_nodes(bytes(d), page)):
            size = 8 + key_bytes + (lo | hi << 16)
            if not flags & F_BIGDATA and size % 2:
                d[at + 1 : at + 1 + size] = bytes(d[at : at + size])
                struct.pack_into("<H", d, page * PAGE + 16 + 2 * index, at - page * PAGE + 1)  # `at` is in the file
                return
        raise AssertionError("no node of odd size")
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_layout")


def _key(data, at: int, key_bytes: int) -> bytes:
    return bytes(data[at + 8 : at + 8 + key_bytes])


def _first_key_below(data, page: int) -> bytes:
    """The smallest key of the subtree rooted at ``page``."""
    while True:
        nodes = list(_nodes(bytes(data), page))
        at, lo, hi, flags, key_bytes = nodes[0]
        if struct.unpack_from("<H", data, page * PAGE + 10)[0] != P_BRANCH:
            return _key(data, at, key_bytes)
        page = lo | hi << 16 | flags << 32


def _branch_key_equal_to_its_childs_first(d):
    """(offset of a branch key, its size) where the key is its child's first key: one more at its
    last byte and that child holds a key below its parent's bound."""
    for page, flags in _reachable(bytes(d), named_only=True).items():
        if flags != P_BRANCH:
            continue
        for index, (at, lo, hi, node_flags, key_bytes) in enumerate(_nodes(bytes(d), page)):
            key = _key(d, at, key_bytes)
            if index > 0 and key and key[-1] < 0xFF and key == _first_key_below(d, lo | hi << 16 | node_flags << 32):
                return at + 8, key_bytes
    raise AssertionError("no such branch key in the sample")


def test_a_branch_key_above_its_childs_first_key(tmp_path, sample):
    """The page is sound and its keys ascend, but a search for the child's first key now goes one
    child to the left: a range from there skips a leaf without an error (measured on an
    AgentStore: 1 in 400 flips of branch-key bits answered wrongly before this check)."""
    def change(d):
        at, key_bytes = _branch_key_equal_to_its_childs_first(d)
        d[at + key_bytes - 1] += 1
    _check_fails(_damaged_copy(tmp_path, sample, change), "key_order")


@pytest.mark.parametrize("where", ["first child, equal", "second-to-last child, above"])
def test_a_leafs_last_key_at_or_above_the_next_separator(tmp_path, sample, where):
    """Every key under a branch entry sorts below the next entry's key: a search for that key
    goes to the next child, so a leaf holding it (or one above it) has entries no search finds."""
    def change(d):
        for page, flags in _reachable(bytes(d), named_only=True).items():
            nodes = list(_nodes(bytes(d), page))
            if flags != P_BRANCH or len(nodes) < 3:
                continue
            index = 0 if where.startswith("first") else len(nodes) - 2
            at, lo, hi, node_flags, _ = nodes[index]
            child = lo | hi << 16 | node_flags << 32
            next_at, *_, next_bytes = nodes[index + 1]
            separator = bytearray(_key(d, next_at, next_bytes))
            last_at, *_, last_bytes = list(_nodes(bytes(d), child))[-1]
            if struct.unpack_from("<H", d, child * PAGE + 10)[0] != P_LEAF or last_bytes != len(separator):
                continue
            if where.endswith("above"):
                separator[-1] += 1
            d[last_at + 8 : last_at + 8 + last_bytes] = separator
            return
        raise AssertionError("no branch of three leaves")
    _check_fails(_damaged_copy(tmp_path, sample, change), "key_order")


def test_a_branch_child_number_past_two_to_the_32(tmp_path, sample):
    """A branch entry's child page number has 48 bits, the top 16 in the node's flags field."""
    def change(d):
        at, *_ = next(_nodes(bytes(d), _first(d, P_BRANCH)))
        struct.pack_into("<H", d, at + 4, 1)
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_range")


@pytest.mark.parametrize("order", ["below", "equal"])
def test_keys_out_of_order_in_a_leaf(tmp_path, sample, order):
    """Keys strictly ascend: a key below the one before it, or equal to it, is out of order."""
    def change(d):
        page = _leaf_with_nodes(d, 3)
        (before_at, _, _, _, before_bytes), (at, lo, hi, flags, key_bytes) = list(_nodes(bytes(d), page))[:2]
        if order == "below":
            d[at + 8 : at + 8 + key_bytes] = b"\x00" * key_bytes
        else:
            assert before_bytes == key_bytes
            d[at + 8 : at + 8 + key_bytes] = d[before_at + 8 : before_at + 8 + key_bytes]
    _check_fails(_damaged_copy(tmp_path, sample, change), "key_order")


def test_random_stores_built_by_lmdb_always_pass(tmp_path):
    """The layout and key-order rules hold for whatever LMDB writes: puts of many sizes, overwrites
    with other sizes, deletes and emptied databases, over several transactions (trees several
    levels deep, free lists of several records)."""
    rng = random.Random(11)
    for number in range(12):
        path = str(tmp_path / f"env-{number}")
        env = lmdb.open(path, max_dbs=8, map_size=1 << 27)
        dbs = [env.open_db(b"db%d" % index) for index in range(rng.randint(1, 5))]
        keys: list[list[bytes]] = [[] for _ in dbs]
        for _ in range(rng.randint(2, 12)):
            with env.begin(write=True) as txn:
                for _ in range(rng.randint(1, 200)):
                    index = rng.randrange(len(dbs))
                    roll = rng.random()
                    if roll < 0.6 or not keys[index]:
                        key = rng.randbytes(rng.choice((1, 8, 40, 300)))
                        txn.put(key, rng.randbytes(rng.choice((0, 1, 33, 1000, 2500, 9000))), db=dbs[index])
                        keys[index].append(key)
                    elif roll < 0.8:
                        txn.put(rng.choice(keys[index]), rng.randbytes(rng.choice((0, 5, 700, 3000))), db=dbs[index])
                    else:
                        txn.delete(keys[index].pop(rng.randrange(len(keys[index]))), db=dbs[index])
                if rng.random() < 0.1:
                    index = rng.randrange(len(dbs))
                    txn.drop(dbs[index], delete=False)
                    keys[index] = []
        env.close()
        check_lmdb_file(os.path.join(path, "data.mdb"), label="test", remedy="-")


def _overflow_node(d):
    """(offset of a leaf node holding its value on overflow pages, its first overflow page)."""
    for page, flags in _reachable(bytes(d)).items():
        if flags != P_LEAF:
            continue
        for at, lo, hi, node_flags, key_bytes in _nodes(bytes(d), page):
            if node_flags & F_BIGDATA:
                return at, struct.unpack_from("<Q", d, at + 8 + key_bytes)[0]
    raise AssertionError("no overflow value")


def test_an_overflow_value_longer_than_its_extent(tmp_path, sample):
    def change(d):
        at, _ = _overflow_node(d)
        hi = struct.unpack_from("<H", d, at + 2)[0]
        struct.pack_into("<H", d, at + 2, hi + 4)  # 256 KiB more than it has
    _check_fails(_damaged_copy(tmp_path, sample, change), "overflow")


@pytest.mark.parametrize("damage", ["a value a few bytes past its extent", "an extent whose first page is a leaf"])
def test_an_overflow_extent_that_does_not_hold_its_value(tmp_path, sample, damage):
    """An extent's pages hold the value after the first page's header: a size within a header's
    length of the extent's end already runs past it, and a first page that is no overflow page
    is not one."""
    def change(d):
        at, first = _overflow_node(d)
        if damage == "an extent whose first page is a leaf":
            struct.pack_into("<H", d, first * PAGE + 10, P_LEAF)
        else:
            pages = struct.unpack_from("<I", d, first * PAGE + 12)[0]
            size = pages * PAGE - 16 + 8
            struct.pack_into("<HH", d, at, size & 0xFFFF, size >> 16)
    _check_fails(_damaged_copy(tmp_path, sample, change), "overflow")


@pytest.mark.parametrize("flag", [0x04, 0x02], ids=["duplicates", "a database inside a named one"])
def test_a_leaf_node_flag_lmdb_would_read_differently(tmp_path, sample, flag):
    """mwpstore's databases hold plain values: a node flagged as holding duplicates, or (in a
    named database) another database, would make LMDB read its data as a tree."""
    def change(d):
        page = _first(d, P_LEAF)
        at, lo, hi, flags, key_bytes = next(node for node in _nodes(bytes(d), page) if not node[3])
        struct.pack_into("<H", d, at + 4, flag)
    _check_fails(_damaged_copy(tmp_path, sample, change), "node_flags")


def test_a_page_marked_dirty(tmp_path, sample):
    """LMDB would write into a page it believes dirty, through a read-only map."""
    def change(d):
        page = _first(d, P_LEAF)
        struct.pack_into("<H", d, page * PAGE + 10, P_LEAF | 0x10)
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_flags")


def test_a_page_that_does_not_carry_its_number(tmp_path, sample):
    def change(d):
        page = _first(d, P_LEAF)
        struct.pack_into("<Q", d, page * PAGE, page + 1)
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_number")


def test_a_branch_pointing_back_up_the_tree(tmp_path, sample):
    def change(d):
        page = _first(d, P_BRANCH)
        at, *_ = next(_nodes(bytes(d), page))
        struct.pack_into("<HHH", d, at, page & 0xFFFF, page >> 16 & 0xFFFF, 0)
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_twice")


def test_a_free_list_naming_a_page_in_use(tmp_path, sample):
    def change(d):
        free_root, _, _ = _meta(bytes(d))
        in_use = _first(d, P_LEAF)
        at, lo, hi, flags, key_bytes = next(_nodes(bytes(d), free_root))
        count_at = at + 8 + key_bytes
        assert not flags & F_BIGDATA and struct.unpack_from("<Q", d, count_at)[0] >= 1
        struct.pack_into("<Q", d, count_at + 8, in_use)
    _check_fails(_damaged_copy(tmp_path, sample, change), "free_list")


def _free_record(d) -> tuple[int, int]:
    """(offset of the count, data size) of the free database's first record (inline, two pages or more)."""
    free_root, _, _ = _meta(bytes(d))
    at, lo, hi, flags, key_bytes = next(_nodes(bytes(d), free_root))
    count_at = at + 8 + key_bytes
    assert not flags & F_BIGDATA and struct.unpack_from("<Q", d, count_at)[0] >= 2
    return count_at, lo | hi << 16


@pytest.mark.parametrize("damage", ["a meta page", "a page twice", "a count past the record"])
def test_a_free_list_that_lmdb_would_hand_out_wrongly(tmp_path, sample, damage):
    """LMDB reuses free pages: a meta page listed free would be overwritten by a commit, a page
    listed twice handed out twice, a count past the record read from what follows it."""
    wanted = {}

    def change(d):
        count_at, size = _free_record(d)
        if damage == "a meta page":
            struct.pack_into("<Q", d, count_at + 8, 1)
        elif damage == "a page twice":
            struct.pack_into("<Q", d, count_at + 16, struct.unpack_from("<Q", d, count_at + 8)[0])
        else:
            assert struct.unpack_from("<Q", d, count_at)[0] == size // 8 - 1
            struct.pack_into("<Q", d, count_at, size // 8)
            wanted["value"] = size // 8
    error = _check_fails(_damaged_copy(tmp_path, sample, change), "free_list")
    if wanted:
        assert error.detail["value"] == wanted["value"]


def test_a_named_database_with_a_flag(tmp_path, sample):
    """Integer keys would make LMDB read 8 bytes of every key, whatever its size."""
    def change(d):
        _, main_root, _ = _meta(bytes(d))
        at, lo, hi, flags, key_bytes = next(node for node in _nodes(bytes(d), main_root) if node[3] & F_SUBDATA)
        struct.pack_into("<H", d, at + 8 + key_bytes + 4, 0x08)
    _check_fails(_damaged_copy(tmp_path, sample, change), "database")


def test_a_database_record_one_byte_longer(tmp_path, sample):
    """A named database's record is 48 bytes; with a name of odd length the node's rounding
    leaves room for one more, so the nodes still fill the page and only the size tells."""
    def change(d):
        _, main_root, _ = _meta(bytes(d))
        at, lo, hi, flags, key_bytes = next(node for node in _nodes(bytes(d), main_root) if node[3] & F_SUBDATA and node[4] % 2)
        assert lo | hi << 16 == 48
        struct.pack_into("<H", d, at, 49)
    _check_fails(_damaged_copy(tmp_path, sample, change), "database")


@pytest.mark.parametrize("key_bytes", [4, 16])
def test_a_free_list_key_of_the_wrong_size(tmp_path, sample, key_bytes):
    """LMDB reads 8 bytes of every free-list key, whatever its size: any other size is refused
    as such (the value is the key's size), before the node's layout is looked at."""
    def change(d):
        free_root, _, _ = _meta(bytes(d))
        at, *_ = next(_nodes(bytes(d), free_root))
        struct.pack_into("<H", d, at + 6, key_bytes)
    error = _check_fails(_damaged_copy(tmp_path, sample, change), "node_bounds")
    assert error.detail["value"] == key_bytes


@pytest.mark.parametrize("step", [8, 3, "swapped"], ids=["parity of the other page", "right parity, not the next id", "ids swapped"])
def test_a_transaction_id_that_would_pick_the_older_meta(tmp_path, sample, step):
    """LMDB opens the meta with the higher id: the older snapshot, consistent and sealed. At
    rest the two ids are consecutive, the newer on its parity's page: damage breaks one or both
    (two ids swapped stay consecutive, on the wrong pages)."""
    def change(d):
        ids = [struct.unpack_from("<Q", d, meta * PAGE + 144)[0] for meta in (0, 1)]
        older = ids.index(min(ids))
        if step == "swapped":
            for meta in (0, 1):
                struct.pack_into("<Q", d, meta * PAGE + 144, ids[1 - meta])
        else:
            struct.pack_into("<Q", d, older * PAGE + 144, max(ids) + step)
    _check_fails(_damaged_copy(tmp_path, sample, change), "meta")


def test_a_page_size_that_differs_in_the_meta_lmdb_picks(tmp_path, sample):
    """LMDB takes the page size from meta 0, then uses the newer meta: when that is meta 1 its
    own page size must agree (here meta 1 is made the newer one, with the next id)."""
    def change(d):
        ids = [struct.unpack_from("<Q", d, meta * PAGE + 144)[0] for meta in (0, 1)]
        if ids[1] < ids[0]:
            struct.pack_into("<Q", d, PAGE + 144, ids[0] + 1)
        struct.pack_into("<I", d, PAGE + 40, 2 * PAGE)
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_size")


def test_a_free_database_without_integer_keys(tmp_path, sample):
    """The free database's keys are transaction ids LMDB compares as integers: without the flag
    it would compare them byte by byte, in another order."""
    def change(d):
        for meta in (0, 1):
            struct.pack_into("<H", d, meta * PAGE + 40 + 4, 0)
    _check_fails(_damaged_copy(tmp_path, sample, change), "database")


def test_a_root_that_lands_on_its_own_child_cuts_the_tree_short(tmp_path, sample):
    """The rest of the tree is neither in use nor free: a range would silently miss it."""
    def change(d):
        _, main_root, _ = _meta(bytes(d))
        for at, lo, hi, flags, key_bytes in _nodes(bytes(d), main_root):
            record = at + 8 + key_bytes
            root = struct.unpack_from("<Q", d, record + 40)[0]
            if flags & F_SUBDATA and root != 2**64 - 1 and struct.unpack_from("<H", d, root * PAGE + 10)[0] == P_BRANCH:
                child_at, child_lo, child_hi, child_flags, _ = next(_nodes(bytes(d), root))
                struct.pack_into("<Q", d, record + 40, child_lo | child_hi << 16 | child_flags << 32)
                return
        raise AssertionError("no database with a branch root")
    _check_fails(_damaged_copy(tmp_path, sample, change), "page_lost")


def _tree_depth(data, page: int) -> int:
    depth = 1
    while struct.unpack_from("<H", data, page * PAGE + 10)[0] == P_BRANCH:
        at, lo, hi, flags, key_bytes = next(_nodes(bytes(data), page))
        page, depth = lo | hi << 16 | flags << 32, depth + 1
    return depth


@pytest.mark.parametrize("depth", [32, 33])
def test_a_tree_deeper_than_lmdbs_cursor_stack(tmp_path, sample, depth):
    """LMDB's cursors hold 32 pages: a named database's root moved down under a chain of new
    single-entry branch pages (sound pages, appended to the file) until its leaves sit at
    ``depth``. 32 levels are a sound tree; 33 cannot be walked."""
    data = bytearray(open(sample, "rb").read())
    _, main_root, last_page = _meta(bytes(data))
    at, lo, hi, flags, key_bytes = next(node for node in _nodes(bytes(data), main_root) if node[3] & F_SUBDATA)
    root_at = at + 8 + key_bytes + 40
    root = struct.unpack_from("<Q", data, root_at)[0]
    added = depth - _tree_depth(data, root)
    assert added > 0 and len(data) == (last_page + 1) * PAGE
    for number in range(added):  # page last_page + 1 + number points at the next one; the last at the old root
        page = last_page + 1 + number
        child = root if number == added - 1 else page + 1
        branch = bytearray(PAGE)
        struct.pack_into("<QHHHH", branch, 0, page, 0, P_BRANCH, 16 + 2, PAGE - 8)
        struct.pack_into("<H", branch, 16, PAGE - 8)
        struct.pack_into("<HHHH", branch, PAGE - 8, child & 0xFFFF, child >> 16 & 0xFFFF, child >> 32, 0)
        data += branch
    struct.pack_into("<Q", data, root_at, last_page + 1)
    picked = max((0, 1), key=lambda n: (struct.unpack_from("<Q", data, n * PAGE + 144)[0], -n))
    struct.pack_into("<Q", data, picked * PAGE + 136, last_page + added)
    path = _damaged_copy(tmp_path, sample, lambda d: d.__setitem__(slice(None), data))
    if depth <= 32:
        assert check_lmdb_file(path, label="test", remedy="-").pages_in_use >= added
    else:
        _check_fails(path, "depth")


def test_a_file_cut_short(tmp_path, sample):
    data = open(sample, "rb").read()
    last_used = max(_reachable(data))
    path = _damaged_copy(tmp_path, sample, lambda d: d.__delitem__(slice(last_used * PAGE, None)))
    error = _check_fails(path, "file_short")
    assert error.detail["value"] >= 2


def test_a_missing_file_is_storage_failed_not_a_crash(tmp_path):
    from mwpstore.errors import StorageFailed

    with pytest.raises(StorageFailed):
        check_lmdb_file(str(tmp_path / "nothing" / "data.mdb"), label="test", remedy="-")


def test_random_bit_flips_never_crash_the_checker(tmp_path, sample):
    """Every flip either passes (it hit bytes LMDB does not rely on) or is named; none crashes
    the checker. Pages reachable are flipped more often: they are what the check reads."""
    data = open(sample, "rb").read()
    pages = sorted(_reachable(data)) + [0, 1]
    rng = random.Random(7)
    named = passed = 0
    for _ in range(400):
        page = rng.choice(pages)
        offset = page * PAGE + rng.randrange(PAGE)
        bit = rng.randrange(8)
        path = _damaged_copy(tmp_path, sample, lambda d: d.__setitem__(offset, d[offset] ^ (1 << bit)))
        try:
            check_lmdb_file(path, label="test", remedy="-")
            passed += 1
        except Corruption as exc:
            assert exc.detail["reason"] == "lmdb_structure" and isinstance(exc.detail["page"], int)
            named += 1
    assert named >= 5 and passed >= 100  # both outcomes occur: the check is neither blind nor paranoid


# -- the stores run it --------------------------------------------------------------------------

_READ_ALL = textwrap.dedent(
    """
    import sys
    from mwpstore.agent_store import AgentStore
    from mwpstore.errors import MwpError
    check = {"on": None, "off": False}[sys.argv[2]]
    try:
        with AgentStore.open(sys.argv[1], check_lmdb=check) as agent:
            agent.projection_dump()
    except MwpError as exc:
        print("typed", exc.code, exc.detail.get("reason"))
    else:
        print("read")
    """
)


class _BlobProjection:
    """Keeps one value larger than a page, so LMDB stores it on overflow pages."""

    name = "blob"

    def apply(self, view, event):
        view.put("blob", bytes([event.seq % 251]) * 9000)


def _agent_with_damaged_overflow_value(tmp_path) -> str:
    """An AgentStore whose overflow value claims about 2 GiB: the damage a flipped node offset
    produced in the torture suite (a node read from the wrong place, sizing a value far past the
    end of the file, which the binding then touched page by page)."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[_BlobProjection()]) as agent:
        with agent.begin() as tx:
            for event in workload(GROUP, 20, seed=4):
                tx.apply(event)
            tx.advance_cursor(GROUP)
    data_path = path / "lmdb" / "data.mdb"
    data = bytearray(data_path.read_bytes())
    for page, flags in _reachable(bytes(data), named_only=True).items():
        if flags != P_LEAF:
            continue
        for at, lo, hi, node_flags, key_bytes in _nodes(bytes(data), page):
            if node_flags & F_BIGDATA:
                struct.pack_into("<H", data, at + 2, 0x7FFF)
                data_path.write_bytes(bytes(data))
                return str(path)
    raise AssertionError("no overflow value")


def _run_child(path: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _READ_ALL, path, mode], capture_output=True, text=True, timeout=120)


def test_without_the_check_lmdb_kills_the_process_with_it_the_error_is_typed(tmp_path):
    path = _agent_with_damaged_overflow_value(tmp_path)
    unchecked = _run_child(path, "off")
    assert unchecked.returncode < 0, (unchecked.returncode, unchecked.stdout, unchecked.stderr[-400:])  # killed by a signal
    checked = _run_child(path, "on")
    assert checked.returncode == 0, checked.stderr[-800:]
    assert checked.stdout.split() == ["typed", "CORRUPTION", "lmdb_structure"]


def test_a_structurally_damaged_index_is_rebuilt_from_the_log_at_open(tmp_path):
    store = str(tmp_path / "store")
    with open_with_group(store) as authority:
        commands = [mission_create(f"m-{i}") for i in range(200)]
        receipts = authority.accept_many(commands)
        expected = authority.state(GROUP, "mission:m-7")
    data_path = os.path.join(store, "index", "data.mdb")
    data = bytearray(open(data_path, "rb").read())
    page = _first(data, P_LEAF)
    struct.pack_into("<H", data, page * PAGE + 16, 12)
    open(data_path, "wb").write(bytes(data))
    with Authority.open(store) as authority:
        assert authority.open_report.mode == "rebuild"
        assert "node_bounds" in authority.open_report.reason
        assert authority.open_report.reason.endswith(f" on page {page})")  # where the damage is
        assert authority.state(GROUP, "mission:m-7") == expected
        assert authority.accept(commands[7]) == receipts[7].unwrap()  # receipts survived
        assert authority.verify().ok


def test_verify_checks_the_structure_before_it_reads_the_live_index(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(200)])
        data_path = os.path.join(authority.index.directory, "data.mdb")
        data = bytearray(open(data_path, "rb").read())
        page = _first(data, P_LEAF)
        with open(data_path, "r+b") as handle:  # the file changes under the open map, as damage would
            handle.seek(page * PAGE + 16)
            handle.write(struct.pack("<H", 12))
        report = authority.verify()
        assert not report.ok and any("lmdb_structure" in problem or "node_bounds" in problem for problem in report.problems)


def test_an_empty_file_left_by_a_crash_while_creating_is_a_new_store(tmp_path):
    """Found by the crash suite (seed 8): killed between creating data.mdb and writing its meta
    pages, a new AgentStore left an empty file, and the check refused it at every reopen."""
    (tmp_path / "agent" / "lmdb").mkdir(parents=True)
    (tmp_path / "agent" / "lmdb" / "data.mdb").write_bytes(b"")
    with AgentStore.open(tmp_path / "agent", projections=[CountingProjection()], check_lmdb=True) as agent:
        assert agent.groups() == []
        with agent.begin() as tx:
            for event in workload(GROUP, 10, seed=2):
                tx.apply(event)
            tx.advance_cursor(GROUP)
    store = tmp_path / "store"
    with open_with_group(str(store)):
        pass
    (store / "index" / "data.mdb").write_bytes(b"")
    with Authority.open(str(store), check_lmdb=True) as authority:
        assert authority.open_report.mode == "rebuild" and authority.verify().ok


def test_the_open_policy(tmp_path, monkeypatch):
    path = _sample_env(str(tmp_path / "env"))
    directory = os.path.dirname(path)
    assert check_before_open(directory, None, label="t", remedy="-") is not None
    assert check_before_open(directory, False, label="t", remedy="-") is None
    monkeypatch.setattr(limits, "LMDB_CHECK_AT_OPEN_BYTES_MAX", os.path.getsize(path))
    assert check_before_open(directory, None, label="t", remedy="-") is not None  # at the limit: checked
    monkeypatch.setattr(limits, "LMDB_CHECK_AT_OPEN_BYTES_MAX", os.path.getsize(path) - 1)
    assert check_before_open(directory, None, label="t", remedy="-") is None  # above the limit: not by default
    assert check_before_open(directory, True, label="t", remedy="-") is not None  # unless asked
    assert check_before_open(str(tmp_path / "new"), True, label="t", remedy="-") is None  # no file yet
    with pytest.raises(InvalidCommand):
        check_before_open(directory, "yes", label="t", remedy="-")  # type: ignore[arg-type]
    with pytest.raises(InvalidCommand):
        AgentStore.open(tmp_path / "agent", check_lmdb="always")  # type: ignore[arg-type]
    with pytest.raises(InvalidCommand):  # refused, not taken for a damaged index and rebuilt
        Authority.open(str(tmp_path / "store"), check_lmdb="always")  # type: ignore[arg-type]


def test_a_fifo_in_place_of_data_mdb_is_refused_before_lmdb_waits_on_it(tmp_path):
    # LMDB would wait on the FIFO for ever with the interpreter lock held, so the check runs in
    # a child process that must finish: the authority rebuilds its index, the AgentStore refuses.
    script = textwrap.dedent(
        f"""
        import os
        from mwpstore import Authority
        from mwpstore.agent_store import AgentStore
        from mwpstore.errors import StorageFailed
        root = {str(tmp_path)!r}
        Authority.open(os.path.join(root, "s")).close()
        AgentStore.open(os.path.join(root, "a")).close()
        for data in (os.path.join(root, "s", "index", "data.mdb"), os.path.join(root, "a", "lmdb", "data.mdb")):
            os.unlink(data)
            os.mkfifo(data)
        authority = Authority.open(os.path.join(root, "s"))
        print(authority.open_report.mode)
        authority.close()
        try:
            AgentStore.open(os.path.join(root, "a"))
        except StorageFailed as exc:
            print(exc.detail["errno"], exc.detail["path"].endswith("data.mdb"))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["rebuild", str(errno.EINVAL), "True"]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_the_check_refuses_what_is_no_regular_file_without_waiting(tmp_path, kind):
    # The open paths stat the file first; the check itself must not hang on a FIFO put there
    # after that stat (a blocking open of a FIFO waits for a writer for ever).
    path = tmp_path / "data.mdb"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    code = textwrap.dedent(
        f"""
        from mwpstore._lmdb_check import check_lmdb_file
        from mwpstore.errors import StorageFailed
        try:
            check_lmdb_file({str(path)!r}, label="index", remedy="rebuild")
        except StorageFailed as exc:
            print(exc.detail["errno"])
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == (errno.EISDIR if kind == "directory" else errno.EINVAL)


@pytest.mark.parametrize("check", [False, None], ids=["check_lmdb=False", "a file over the size bound"])
def test_a_flipped_transaction_id_is_corruption_where_the_pages_are_not_walked(tmp_path, monkeypatch, check):
    """A bit flipped in the older meta page's transaction id makes LMDB pick that meta: the store
    one commit behind, consistent and sealed. The structural check refuses it, but it did not run
    with ``check_lmdb=False`` or for a file over its size bound, and the AgentStore answered from
    the older snapshot without an error (its last local transaction, here an outbox intent,
    gone). The two meta pages are now checked at every open (two reads)."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for event in workload(GROUP, 5, seed=5):
                tx.apply(event)
            tx.advance_cursor(GROUP)
        with agent.begin() as tx:
            tx.record_intent(GROUP, mission="m", workitem="wi", ownership_epoch=1, operation="notify")
    data_file = path / "lmdb" / "data.mdb"
    data, page, ids = _meta_pages(data_file)
    older = 0 if ids[0] < ids[1] else 1
    data[older * page + 144 + 1] ^= 0b1  # its id grows by 256: now the higher one
    data_file.write_bytes(bytes(data))
    if check is None:
        monkeypatch.setattr(limits, "LMDB_CHECK_AT_OPEN_BYTES_MAX", len(data) - 1)
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, projections=[CountingProjection()], check_lmdb=check)
    assert (caught.value.detail["reason"], caught.value.detail["check"], caught.value.detail["page"]) == (
        "lmdb_structure", "meta", older)
    with pytest.raises(Corruption) as walked:
        AgentStore.open(path, projections=[CountingProjection()], check_lmdb=True)
    assert walked.value.detail["check"] == "meta"  # the walk's verdict, the same


def test_the_meta_pages_check_passes_every_sound_store_and_a_new_one(tmp_path):
    """The meta check that runs without the walk raises nothing on a store at rest after each of
    its first commits (ids 0/1, 1/2, 2/3 ...: both parities), nor on an index."""
    path = tmp_path / "agent"
    for number in range(4):
        with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False) as agent:
            with agent.begin() as tx:
                tx.record_intent(GROUP, mission="m", workitem=f"wi{number}", ownership_epoch=1, operation="notify")
        with AgentStore.open(path, check_lmdb=False) as agent:
            assert len(agent.intents()) == number + 1
        AgentStore.open(path, check_lmdb=True).close()
    store = str(tmp_path / "store")
    with open_with_group(store) as authority:
        authority.accept(mission_create("m-1"))
    with Authority.open(store, check_lmdb=False) as authority:
        assert authority.open_report.mode != "rebuild" and authority.head(GROUP)[0] == 2


@pytest.mark.parametrize("damage", ["page number", "main database flags", "newest id on the other parity's page"])
def test_each_meta_page_rule_holds_where_the_pages_are_not_walked(tmp_path, damage):
    """The meta check that runs without the walk applies each of the walk's meta rules, not only
    the ids' distance: a meta page that names another page number, a main database with flags, or
    consecutive ids whose newer one lies on the other parity's page (two changes: no one bit does
    it) is ``CORRUPTION`` with ``check_lmdb=False``, as the walk finds it."""
    path = tmp_path / "agent"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            tx.record_intent(GROUP, mission="m", workitem="wi", ownership_epoch=1, operation="notify")
    data_file = path / "lmdb" / "data.mdb"
    data, page, ids = _meta_pages(data_file)
    newest = 0 if ids[0] > ids[1] else 1
    if damage == "page number":
        struct.pack_into("<Q", data, 1 * page, 0)
        expected = ("meta", 1)
    elif damage == "main database flags":
        struct.pack_into("<H", data, 0 * page + 88 + 4, 0x08)
        expected = ("database", 0)
    else:
        high = max(ids)
        struct.pack_into("<Q", data, newest * page + 144, high - 1)
        struct.pack_into("<Q", data, (1 - newest) * page + 144, high)
        expected = ("meta", 1 - newest)
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, projections=[CountingProjection()], check_lmdb=False)
    assert (caught.value.detail["reason"], caught.value.detail["check"], caught.value.detail["page"]) == ("lmdb_structure", *expected)


def _set_meta(d, number: int, offset: int, fmt: str, value: int) -> None:
    struct.pack_into(fmt, d, number * PAGE + offset, value)


def _ids(d) -> list[int]:
    return [struct.unpack_from("<Q", d, number * PAGE + 144)[0] for number in (0, 1)]


def _make_meta_1_newest(d) -> None:
    """Meta 1 the newer one, with the next id (a sound pair): the sample's newest is meta 0."""
    _set_meta(d, 1, 144, "<Q", max(_ids(d)) + 1)


_META_RULES = {
    # name: (damage, check, meta page named); the sample's newest meta is page 0, and each rule is
    # met on its own: removing it from check_metas or check_meta in C fails its case
    "page size out of range": (lambda d: _set_meta(d, 0, 40, "<I", 256), "page_size", 0),
    "page size not a power of two": (lambda d: _set_meta(d, 0, 40, "<I", PAGE + 512), "page_size", 0),
    "page size over 32 KiB": (lambda d: _set_meta(d, 0, 40, "<I", 1 << 16), "page_size", 0),
    "page number of meta 1": (lambda d: _set_meta(d, 1, 0, "<Q", 0), "meta", 1),
    "page flags of meta 0": (lambda d: _set_meta(d, 0, 10, "<H", 0x08 | 0x10), "meta", 0),
    "magic of meta 1": (lambda d: _set_meta(d, 1, 16, "<I", 0xBEEFC0DF), "meta", 1),
    "version of meta 0": (lambda d: _set_meta(d, 0, 20, "<I", 2), "meta", 0),
    "main database flags of meta 1": (lambda d: _set_meta(d, 1, 88 + 4, "<H", 0x08), "database", 1),
    "free database flags of meta 0": (lambda d: _set_meta(d, 0, 40 + 4, "<H", 0), "database", 0),
    "ids two apart": (lambda d: _set_meta(d, 1, 144, "<Q", max(_ids(d)) - 2), "meta", 0),
    "ids swapped: the newer on the other parity's page": (
        lambda d: [_set_meta(d, number, 144, "<Q", id) for number, id in enumerate(reversed(_ids(d)))], "meta", 1),
    "newer id read as the older one's predecessor": (
        lambda d: _set_meta(d, 0, 144, "<Q", min(_ids(d)) - 1), "meta", 0),
    "page size of the picked meta 1": (
        lambda d: (_make_meta_1_newest(d), _set_meta(d, 1, 40, "<I", 2 * PAGE)), "page_size", 1),
    "last page below the metas": (lambda d: _set_meta(d, 0, 136, "<Q", 0), "file_short", 0),
    "last page far past the end": (lambda d: _set_meta(d, 0, 136, "<Q", 1 << 40), "file_short", 0),
}


@pytest.mark.parametrize("rule", list(_META_RULES))
def test_each_meta_rule_gives_the_walks_verdict_where_only_the_metas_are_read(tmp_path, sample, rule):
    """``check_meta_pages`` (``lc_check_meta_pages`` in C) applies the walk's meta stage itself, the
    same C code: each rule, met alone, is the walk's ``CORRUPTION`` with the same check, page and
    value."""
    from mwpstore._lmdb_check import check_meta_pages

    change, check, page = _META_RULES[rule]
    path = _damaged_copy(tmp_path, sample, change)
    walked = _check_fails(path, check)
    with pytest.raises(Corruption) as caught:
        check_meta_pages(path, label="test", remedy="rebuild it")
    assert caught.value.detail == walked.detail
    assert (caught.value.detail["reason"], caught.value.detail["check"], caught.value.detail["page"]) == (
        "lmdb_structure", check, page)


def test_the_meta_pages_of_a_sound_file_and_of_a_new_environment_pass(tmp_path, sample):
    """Sound metas pass, both orders of the newer one; a new environment's two ids are both 0."""
    from mwpstore._lmdb_check import check_meta_pages

    check_meta_pages(sample, label="test", remedy="-")
    check_meta_pages(_damaged_copy(tmp_path, sample, _make_meta_1_newest), label="test", remedy="-")
    lmdb.open(str(tmp_path / "new"), map_size=1 << 20).close()
    check_meta_pages(str(tmp_path / "new" / "data.mdb"), label="test", remedy="-")


@pytest.mark.parametrize("size", [30, PAGE + 100], ids=["shorter than a meta's page size field", "meta 1 cut short"])
def test_a_file_too_short_for_two_metas_is_left_to_lmdbs_open_where_only_the_metas_are_read(tmp_path, sample, size):
    """The walk calls it ``file_short``; the opens that read only the metas leave it to LMDB's open,
    which refuses it with its own error (and the index is rebuilt), as before the check was in C."""
    from mwpstore._lmdb_check import check_meta_pages

    path = _damaged_copy(tmp_path, sample, lambda d: d.__delitem__(slice(size, None)))
    _check_fails(path, "file_short")
    assert check_meta_pages(path, label="test", remedy="-") is None


@pytest.mark.parametrize("kind", ["directory", "missing"])
def test_a_meta_pages_check_that_cannot_read_the_file_is_storage_failed(tmp_path, kind):
    from mwpstore._lmdb_check import check_meta_pages
    from mwpstore.errors import StorageFailed

    path = tmp_path / "data.mdb"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(StorageFailed) as caught:
        check_meta_pages(str(path), label="index", remedy="-")
    assert caught.value.detail["errno"] == (errno.EISDIR if kind == "directory" else errno.ENOENT)
    assert caught.value.detail["path"] == str(path)


@pytest.mark.parametrize("bit", [24, 45])
def test_a_flipped_last_page_number_is_corruption_not_a_full_map_where_the_pages_are_not_walked(tmp_path, bit):
    """A bit flipped in the last page number of the meta LMDB picks, opened without the walk: LMDB
    grew its map to the pages named, so the store opened and every write was ``LIMIT_EXCEEDED``
    ("reopen with a larger map size"), or, for a high bit, the open was ``STORAGE_FAILED``
    (ENOMEM). The meta stage's own rule (the last page within 2^20 pages of the file's end) now
    runs without the walk too."""
    path = tmp_path / "agent"
    with AgentStore.open(path) as agent:
        with agent.begin() as tx:
            tx.record_intent(GROUP, mission="m", workitem="wi", ownership_epoch=1, operation="notify")
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    newest = 0 if _ids(data)[0] > _ids(data)[1] else 1
    data[newest * PAGE + 136 + bit // 8] ^= 1 << (bit % 8)
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        with AgentStore.open(path, check_lmdb=False) as agent:
            with agent.begin() as tx:
                tx.record_intent(GROUP, mission="m", workitem="wi-2", ownership_epoch=1, operation="notify")
    assert (caught.value.detail["reason"], caught.value.detail["check"], caught.value.detail["page"]) == (
        "lmdb_structure", "file_short", newest)


# -- the flip the meta rules cannot see: the older meta's id read as the next one -------------------


def _intents_store(path, commits: int) -> None:
    """An AgentStore whose last ``commits`` local transactions each recorded one outbox intent."""
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        with agent.begin() as tx:
            for event in workload(GROUP, 5, seed=5):
                tx.apply(event)
            tx.advance_cursor(GROUP)
        for number in range(commits):
            with agent.begin() as tx:
                tx.record_intent(GROUP, mission="m", workitem=f"wi-{number}", ownership_epoch=1, operation="notify")


def _older_meta_read_as_next(data_file) -> tuple[int, int]:
    """Give the older meta page the id after the newer one's (T−1 → T+1: one bit, bit 1, when T−1
    has it clear); both ids stay consecutive, the new newest on its parity's page, so every meta
    rule passes and LMDB picks it. Returns (that page, T+1)."""
    data = bytearray(data_file.read_bytes())
    ids = _ids(data)
    older = ids.index(min(ids))
    _set_meta(data, older, 144, "<Q", max(ids) + 1)
    data_file.write_bytes(bytes(data))
    return older, max(ids) + 1


@pytest.mark.parametrize("commits", [3, 4], ids=["older meta on one page", "on the other"])
@pytest.mark.parametrize("check", [True, False], ids=["walked", "metas only"])
def test_an_agent_store_whose_older_meta_reads_as_the_next_is_corruption_not_one_commit_behind(tmp_path, commits, check):
    """The meta rules pass a pair of ids that stay consecutive, and the walk passes the older
    snapshot (it is sound): LMDB opened it and the store answered one commit behind, its last
    outbox intent gone without an error. Every write transaction now records its own id, which
    the open compares with the picked meta's: ``CORRUPTION`` (``lmdb_structure``, check
    ``snapshot``), nothing written."""
    path = tmp_path / "agent"
    _intents_store(path, commits)
    data_file = path / "lmdb" / "data.mdb"
    page, picked = _older_meta_read_as_next(data_file)
    check_lmdb_file(str(data_file), label="agent", remedy="-")  # the structure is sound
    damaged = data_file.read_bytes()
    with pytest.raises(Corruption) as caught:
        with AgentStore.open(path, check_lmdb=check) as agent:
            assert len(agent.intents()) == commits  # what the old code got wrong: commits - 1
    detail = caught.value.detail
    assert (detail["reason"], detail["check"], detail["page"], detail["value"], detail["recorded"]) == (
        "lmdb_structure", "snapshot", page, picked, picked - 2)
    assert data_file.read_bytes() == damaged


def test_an_empty_local_transaction_still_commits_nothing(tmp_path):
    """The id is put with a transaction's first write, not at its commit: a transaction that writes
    nothing (here a batch of duplicates, and an empty one) leaves LMDB's id where it was."""
    from mwpstore.delivery import deliver_batch

    path = tmp_path / "agent"
    events = workload(GROUP, 8, seed=4)
    with AgentStore.open(path) as agent:
        deliver_batch(agent, GROUP, events)
        before = agent._env.info()["last_txnid"]
        deliver_batch(agent, GROUP, events)
        with agent.begin():
            pass
        assert agent._env.info()["last_txnid"] == before
    with AgentStore.open(path) as agent:
        assert agent._env.info()["last_txnid"] == before and agent.cursor(GROUP) == 8


def test_every_write_of_the_agent_stores_tables_records_the_transaction_id():
    """SealedTables' methods that write are each wrapped in the AgentStore's tables, so that every
    write transaction puts its id; a new writer there must be wrapped too (or an AgentStore written
    through it would be refused at its next open)."""
    import inspect

    from mwpstore._sealed import SealedTables
    from mwpstore.agent_store import _Tables

    readers = {"begin", "get", "get_many", "last_below", "range", "seed", "unseal"}
    public = {name for name, _ in inspect.getmembers(SealedTables, inspect.isfunction) if not name.startswith("_")}
    writers = public - readers - {"put_many"}  # put_many writes through put_many_sealed
    assert writers == {"put", "put_many_sealed", "delete", "delete_range"}
    assert all(name in vars(_Tables) for name in writers)
    assert "put_many" not in vars(SealedTables) or "put_many_sealed" in inspect.getsource(SealedTables.put_many)


def test_the_recorded_id_follows_every_kind_of_write(tmp_path):
    """Reopened after each kind of write (applies, an intent and its receipt, a prune, a reset,
    each with the walk), a sound store opens, and a flip after the last is caught."""
    from mwpstore.delivery import deliver_batch

    path = tmp_path / "agent"
    events = workload(GROUP, 30, seed=6)
    steps = [
        lambda agent: deliver_batch(agent, GROUP, events[:20]),
        lambda agent: agent.record_receipt(_intent(agent), {"status": "ok"}),
        lambda agent: agent.prune_inbox(GROUP),
        lambda agent: deliver_batch(agent, GROUP, events[20:]),
        lambda agent: agent.reset_group(GROUP),
    ]
    for step in steps:
        with AgentStore.open(path, projections=[CountingProjection()], check_lmdb=True) as agent:
            step(agent)
    with AgentStore.open(path) as agent:
        assert agent.cursor(GROUP) == 0 and agent.states(GROUP) == {}
    _older_meta_read_as_next(path / "lmdb" / "data.mdb")
    with pytest.raises(Corruption, match="snapshot it leads to"):
        AgentStore.open(path)


def _raw_meta(path, change) -> None:
    """Change the store's ``meta`` database with plain LMDB writes (no id recorded)."""
    env = lmdb.open(str(path / "lmdb"), max_dbs=20)
    with env.begin(write=True) as txn:
        change(txn, env.open_db(b"meta", txn=txn, create=False))
    env.close()


def test_a_store_of_format_2_is_upgraded_by_its_first_open_and_refused_by_a_build_of_format_2(tmp_path):
    """Format 2 recorded no transaction id: its first open records it and writes format 3 (the
    intents as they were), and the flip is caught from there on. A build of format 2 refuses
    format 3 (reason ``format``), whose commits it would make without the id (its stored id would
    then lag, and read as damage here)."""
    from mwpstore._sealed import check_stored_format
    from mwpstore.index import seal

    path = tmp_path / "agent"
    _intents_store(path, 2)
    _raw_meta(path, lambda txn, meta: (txn.put(b"format", seal(b"meta", b"format", b"2"), db=meta),
                                       txn.delete(b"txnid", db=meta)))
    with AgentStore.open(path) as agent:
        assert len(agent.intents()) == 2
        with agent.begin() as tx:
            tx.record_intent(GROUP, mission="m", workitem="wi-new", ownership_epoch=1, operation="notify")
        with pytest.raises(Corruption) as refused:  # what a build of format 2 checks first
            check_stored_format(agent._env, b"2", label="agent store", remedy="-")
        assert refused.value.detail == {"reason": "format", "format": "3"}
    _older_meta_read_as_next(path / "lmdb" / "data.mdb")
    with pytest.raises(Corruption, match="snapshot it leads to"):
        AgentStore.open(path)


def test_a_store_of_format_3_without_its_recorded_id_is_corruption(tmp_path):
    path = tmp_path / "agent"
    _intents_store(path, 1)
    _raw_meta(path, lambda txn, meta: txn.delete(b"txnid", db=meta))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path)
    assert (caught.value.detail["reason"], caught.value.detail["key"]) == ("agent_missing", "txnid")


def _intent(agent) -> str:
    with agent.begin() as tx:
        return tx.record_intent(GROUP, mission="m", workitem="wi", ownership_epoch=1, operation="notify").key


def test_a_compacting_copy_of_an_agent_store_opens(tmp_path):
    """``mdb_copy -c`` (``env.copy(compact=True)``) writes the newest snapshot under transaction 1:
    the id recorded in it is higher than the meta's, which no flip makes (the id is sealed), so it
    is recorded anew, and the copy answers as the store did."""
    path = tmp_path / "agent"
    _intents_store(path, 3)
    copy = tmp_path / "copy"
    (copy / "lmdb").mkdir(parents=True)
    env = lmdb.open(str(path / "lmdb"), max_dbs=20)
    env.copy(str(copy / "lmdb"), compact=True)
    env.close()
    for _ in range(2):
        with AgentStore.open(copy) as agent:
            assert len(agent.intents()) == 3 and agent._env.info()["last_txnid"] == 2


def test_an_index_whose_older_meta_reads_as_the_next_redoes_the_commit_it_lacks(tmp_path):
    """The same flip in the index's file (T−1 read as T+1) is harmless there: the index records
    the log position it reflects in the same transaction, so the older snapshot LMDB opens is
    redone from the log. After a crash (the files as the last commit left them) the last commit's
    record is redone; after a clean close the older snapshot is the last data commit (the close's
    own commit only marks it clean). Either way the answers are the log's."""
    import shutil

    store = tmp_path / "store"
    authority = open_with_group(str(store))
    for number in range(4):
        authority.accept(mission_create(f"m-{number}"))
    head = authority.head(GROUP)
    shutil.copytree(store, tmp_path / "crashed", ignore=shutil.ignore_patterns("*.lock"))
    authority.close()
    for name, mode, redone in (("crashed", "redo", 1), ("store", "clean", 0)):
        _older_meta_read_as_next(tmp_path / name / "index" / "data.mdb")
        with Authority.open(str(tmp_path / name)) as reopened:
            assert (reopened.open_report.mode, reopened.open_report.redo_records) == (mode, redone)
            assert reopened.head(GROUP) == head and reopened.verify().ok


@pytest.mark.parametrize("commits", [3, 4], ids=["newer meta on one page", "on the other"])
@pytest.mark.parametrize("check", [True, False], ids=["walked", "metas only"])
def test_a_newer_meta_whose_id_reads_as_the_older_ones_predecessor_is_corruption_not_one_commit_behind(tmp_path, commits, check):
    """The other consecutive flip (T read as T−2: one bit, bit 1, when T has it set): LMDB picks
    the sound older meta, and the store answered one commit behind, its last outbox intent gone
    without an error (the id recorded in that snapshot is its own, so the open's comparison cannot
    see it). The newer meta's free database names transaction T, above the id it now carries:
    ``CORRUPTION`` (``lmdb_structure``, check ``meta``, that page), with or without the walk."""
    path = tmp_path / "agent"
    _intents_store(path, commits)
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    ids = _ids(data)
    newer = ids.index(max(ids))
    _set_meta(data, newer, 144, "<Q", min(ids) - 1)
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        with AgentStore.open(path, check_lmdb=check) as agent:
            assert len(agent.intents()) == commits  # what the old code got wrong: commits - 1
    detail = caught.value.detail
    assert (detail["reason"], detail["check"], detail["page"]) == ("lmdb_structure", "meta", newer)
    assert detail["value"] in (max(ids), max(ids) - 1)  # the newest free-list record's transaction


def test_a_newer_meta_read_as_the_older_ones_predecessor_is_found_down_a_free_database_with_branches(tmp_path):
    """The newer meta's free database several pages deep (records kept by a reader while 600
    transactions freed pages) and far past the first 64 KiB, which the metas-only check reads
    from the file page by page: its last key is found down the last children, in the walk and
    without it, and a sound file passes."""
    from mwpstore._lmdb_check import check_meta_pages

    directory = str(tmp_path / "env")
    env = lmdb.open(directory, max_dbs=2, map_size=1 << 28, sync=False)
    db = env.open_db(b"d")
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"k%06d" % i, b"v" * 100, db=db)
    reader = env.begin()
    for number in range(600):
        with env.begin(write=True) as txn:
            txn.put(b"k%06d" % (number * 5 % 3000), b"w" * 100, db=db)
    reader.abort()
    env.close()
    sound = os.path.join(directory, "data.mdb")
    data = open(sound, "rb").read()
    ids = _ids(data)
    newer = ids.index(max(ids))
    free_root = struct.unpack_from("<Q", data, newer * PAGE + 40 + 40)[0]
    assert struct.unpack_from("<H", data, free_root * PAGE + 10)[0] == P_BRANCH and free_root * PAGE > 1 << 16
    check_meta_pages(sound, label="test", remedy="-")
    check_lmdb_file(sound, label="test", remedy="-")
    damaged = _damaged_copy(tmp_path, sound, lambda d: _set_meta(d, newer, 144, "<Q", min(ids) - 1))
    walked = _check_fails(damaged, "meta")
    with pytest.raises(Corruption) as caught:
        check_meta_pages(damaged, label="test", remedy="rebuild it")
    assert caught.value.detail == walked.detail and (walked.detail["page"], walked.detail["value"]) == (newer, max(ids))


def _older_free_leaf(d) -> tuple[int, int]:
    """(page, offset of its last node) of the older meta's free database, a single leaf in the
    sample (that meta is page 1)."""
    root = struct.unpack_from("<Q", d, 1 * PAGE + 40 + 40)[0]
    assert _ids(d)[1] < _ids(d)[0] and struct.unpack_from("<H", d, root * PAGE + 10)[0] == P_LEAF
    lower = struct.unpack_from("<H", d, root * PAGE + 12)[0]
    return root, struct.unpack_from("<H", d, root * PAGE + lower - 2)[0]


def _older_free_last_key(d, key: int, *, key_bytes: int = 8, page_number: int | None = None, flags: int = P_LEAF) -> None:
    page, offset = _older_free_leaf(d)
    struct.pack_into("<Q", d, page * PAGE + offset + 8, key)
    struct.pack_into("<H", d, page * PAGE + offset + 6, key_bytes)
    struct.pack_into("<QxxH", d, page * PAGE, page if page_number is None else page_number, flags)


@pytest.mark.parametrize("damage", ["page number", "page flags", "key size"])
def test_the_older_metas_free_database_is_not_judged_where_its_page_is_unsound(tmp_path, sample, damage):
    """LMDB does not read the older meta's trees; the rule on its free database's last key judges
    only a sound path to it (else a damaged free page there, never read, would refuse the file)."""
    from mwpstore._lmdb_check import check_meta_pages

    newest = max(_ids(open(sample, "rb").read()))
    options = {"page number": {"page_number": 7}, "page flags": {"flags": P_BRANCH | 0x08}, "key size": {"key_bytes": 4}}

    def change(d):
        page, offset = _older_free_leaf(d)
        _older_free_last_key(d, newest + 100, **options[damage])
        if damage == "page flags":  # read as a branch, its last node would lead to the newer meta's free leaf
            struct.pack_into("<HHH", d, page * PAGE + offset, _meta(bytes(d))[0], 0, 0)

    path = _damaged_copy(tmp_path, sample, change)
    check_meta_pages(path, label="test", remedy="-")
    check_lmdb_file(path, label="test", remedy="-")


def test_a_free_list_record_at_the_newer_id_under_the_older_meta_is_damage(tmp_path, sample):
    """The rule is the older meta's own id, not the newer one's: a free-list record of the newest
    transaction in the older snapshot (what the newer meta's id read as the one below the older's
    leaves when that transaction freed nothing) is damage."""
    from mwpstore._lmdb_check import check_meta_pages

    newest = max(_ids(open(sample, "rb").read()))
    path = _damaged_copy(tmp_path, sample, lambda d: _older_free_last_key(d, newest))
    walked = _check_fails(path, "meta")
    with pytest.raises(Corruption) as caught:
        check_meta_pages(path, label="test", remedy="-")
    assert caught.value.detail["check"] == "meta" and (walked.detail["page"], walked.detail["value"]) == (1, newest)


@pytest.mark.parametrize("write", ["put", "put_many", "delete", "delete_range"])
def test_a_write_transaction_of_one_kind_of_write_alone_records_its_id(tmp_path, write):
    """Each of the tables' writes records the id when it is a transaction's only kind of write
    (the local transactions of today also put a Group head, but a later one may only delete):
    the store reopens without a false ``snapshot`` alarm, and the write is there."""
    from mwpstore.agent_store import _prefix

    path = tmp_path / "agent"
    _intents_store(path, 1)
    prefix = _prefix(GROUP) + CountingProjection.name.encode() + b"\x00"
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        tables = agent._tables
        rows = len(agent.projection_items(GROUP, CountingProjection.name))
        intent = agent.intents()[0]
        with tables.begin(write=True) as txn:
            if write == "put":
                tables.put(txn, b"projection", prefix + b"new", b"v")
            elif write == "put_many":
                tables.put_many(txn, b"projection", [(prefix + b"new", b"v")])
            elif write == "delete":
                assert tables.delete(txn, b"outbox", _prefix(GROUP) + intent.key.encode())
            else:
                assert tables.delete_range(txn, b"projection", prefix) == rows > 0
    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        changed = {"put": (rows + 1, 1), "put_many": (rows + 1, 1), "delete": (rows, 0), "delete_range": (0, 1)}[write]
        assert (len(agent.projection_items(GROUP, CountingProjection.name)), len(agent.intents())) == changed


def test_a_main_root_that_lands_on_another_trees_leaf_is_corruption_not_an_empty_store(tmp_path):
    """The main database's root in the picked meta turned into the number of a leaf of another
    database (bit 3 of page 2 is page 10, for one), opened without the walk: LMDB read that leaf
    as the main database, none of the store's databases was in it, and the open took the
    environment for a new one: it answered as an empty store (no Group, no intent) and wrote the
    databases' records into that leaf. A main database with other keys is now ``CORRUPTION``
    (``missing_database``), nothing written."""
    path = tmp_path / "agent"
    _intents_store(path, 2)
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    newest = _ids(data).index(max(_ids(data)))
    _, main_root, _ = _meta(bytes(data))
    leaf = min(page for page, flags in _reachable(bytes(data), named_only=True).items() if flags == P_LEAF and page != main_root)
    struct.pack_into("<Q", data, newest * PAGE + 88 + 40, leaf)
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        with AgentStore.open(path, check_lmdb=False) as agent:
            assert (agent.groups(), len(agent.intents())) == ([GROUP], 2)  # what the old code got wrong: [], 0
    assert caught.value.detail["reason"] == "missing_database"
    assert data_file.read_bytes() == bytes(data)
    with pytest.raises(Corruption) as walked:
        AgentStore.open(path, check_lmdb=True)
    assert walked.value.detail["reason"] == "lmdb_structure"


def test_a_main_database_of_the_creation_commit_is_corruption_not_an_empty_store(tmp_path):
    """The main database's leaf written back as the creation commit left it (a lost write of the
    page: every database record empty), opened without the walk: the records are sound, the
    names all there, and ``meta`` empty, so the open took the store for a new one, wrote its
    format and answered as an empty store (no Group, no intent). A store whose picked meta is past
    the creation's commit and has no format is ``CORRUPTION`` (``agent_missing``), nothing written;
    the walk refuses the file (its pages are lost)."""
    path = tmp_path / "agent"
    _intents_store(path, 2)
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    _, main_root, _ = _meta(bytes(data))
    for at, _, _, flags, key_bytes in _nodes(bytes(data), main_root):
        assert flags == F_SUBDATA
        struct.pack_into("<6Q", data, at + 8 + key_bytes, 0, 0, 0, 0, 0, 2**64 - 1)  # an empty database's record
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        with AgentStore.open(path, check_lmdb=False) as agent:
            assert (agent.groups(), len(agent.intents())) == ([GROUP], 2)  # what the old code got wrong: [], 0
    assert caught.value.detail["reason"] == "agent_missing" and caught.value.detail["key"] == "format"
    assert data_file.read_bytes() == bytes(data)
    with pytest.raises(Corruption) as walked:
        AgentStore.open(path, check_lmdb=True)
    assert walked.value.detail["reason"] == "lmdb_structure"


def test_a_main_root_lost_in_the_picked_meta_is_corruption_with_nothing_written(tmp_path):
    """The picked meta page's main database record read back empty (root ``P_INVALID``), opened
    without the walk: every database is missing from an empty main database, which only a new
    environment has. The open created them in a commit of its own, over the other meta page (the
    sound one, one commit older), and only then found no format: refused, but the file's one way
    back was gone. Every database missing after a commit is ``CORRUPTION`` (``missing_database``)
    before any write."""
    path = tmp_path / "agent"
    _intents_store(path, 2)
    data_file = path / "lmdb" / "data.mdb"
    data, _, txnids = _meta_pages(data_file)
    picked = txnids.index(max(txnids))
    struct.pack_into("<IHH5Q", data, picked * PAGE + 88, 0, 0, 0, 0, 0, 0, 0, 2**64 - 1)  # an empty main database
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, check_lmdb=False)
    assert caught.value.detail["reason"] == "missing_database"
    assert data_file.read_bytes() == bytes(data)


def test_a_main_database_of_the_creation_commit_under_the_formats_commit_is_corruption(tmp_path):
    """As above, at the first commit past the creation: a store opened once and closed (its format's
    commit, LMDB id 2), whose main leaf went back to the creation's."""
    path = tmp_path / "agent"
    AgentStore.open(path).close()  # the creation (LMDB id 1) and the format (id 2), nothing after
    data_file = path / "lmdb" / "data.mdb"
    data, _, txnids = _meta_pages(data_file)
    assert max(txnids) == 2
    _, main_root, _ = _meta(bytes(data))
    for at, _, _, flags, key_bytes in _nodes(bytes(data), main_root):
        struct.pack_into("<6Q", data, at + 8 + key_bytes, 0, 0, 0, 0, 0, 2**64 - 1)  # an empty database's record
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, check_lmdb=False).close()
    assert caught.value.detail["reason"] == "agent_missing"
    assert data_file.read_bytes() == bytes(data)


def test_a_new_store_and_one_whose_first_open_stopped_after_the_creation_open_as_new(tmp_path):
    """The creation's commit alone (a crash before the format's) is still a new store: the rule
    above counts from it."""
    from mwpstore.agent_store import _DATABASES

    path = tmp_path / "agent"
    os.makedirs(path / "lmdb")
    environment = lmdb.open(str(path / "lmdb"), max_dbs=32, subdir=True)
    with environment.begin(write=True) as txn:  # as open_databases creates them: one commit
        for name in _DATABASES:
            environment.open_db(name, txn=txn)
    assert environment.info()["last_txnid"] == 1
    environment.close()
    with AgentStore.open(path, check_lmdb=True) as agent:
        assert agent.groups() == []
    with AgentStore.open(path, check_lmdb=False) as agent:
        assert agent.groups() == []


def test_an_lmdb_error_of_a_damaged_page_at_an_agent_stores_open_names_the_agent_store(tmp_path):
    """The main root turned into a meta page's number, opened without the walk: LMDB's "Located page
    was wrong type" was typed with the index's words ("the LMDB index is damaged … Run `mwpstore
    rebuild`", a command that cannot help an AgentStore); it is the AgentStore's ``CORRUPTION``
    (reason ``agent``) with its remedy, as inside a local transaction."""
    path = tmp_path / "agent"
    _intents_store(path, 1)
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    newest = _ids(data).index(max(_ids(data)))
    struct.pack_into("<Q", data, newest * PAGE + 88 + 40, 0)
    data_file.write_bytes(bytes(data))
    with pytest.raises(Corruption) as caught:
        AgentStore.open(path, check_lmdb=False)
    assert caught.value.detail["reason"] == "agent" and "CorruptedError" in caught.value.message
    assert "agent store" in caught.value.message and "mwpstore rebuild" not in caught.value.message
