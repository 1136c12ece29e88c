"""The C indexing of Event records (mwpstore._index_c, used by redo and rebuild) against the
Python reference (authority._index_record): the same index entries, heads and errors.

``torture.index_paths`` runs both on the same records: the reference alone, and what redo runs
(C for the plain Events, the reference for every record C hands back). The fuzz suite's
``index_record`` target does the same on mutated records.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mwpstore import Command, _index_c, limits
from mwpstore.authority import ACK_TAG, ARCHIVE_TAG, EVENT_TAG, GROUP_TAG, RECEIPT_TAG, SNAPSHOT_TAG
from mwpstore.index import Index, PendingWrites
from mwpstore.messages import Effect, Event, encode_event
from mwpstore.registry import MemoryGroup
from mwpstore.torture import index_bytes, index_meaning, index_paths
from test_index_seals import _NESTED

MAP_BYTES = 64 * 1024 * 1024
CONTRACT = {
    "max_attempts": 3,
    "backoff_initial_ms": 100,
    "backoff_multiplier": 2,
    "backoff_max_ms": 1_000,
    "cost_limit": 1_000,
    "deadline_ms": None,
    "lease_ms": 60_000,
    "start_ms": 60_000,
}


def _history(group_name: str, workitems: int) -> list[Event]:
    """A Group's Events made by the real rules: Memberships, a Mission, WorkItems worked on."""
    group = MemoryGroup(group_name)
    clock = [1_700_000_000_000]
    actions = [0]

    def accept(actor: str, kind: str, target: str, body: dict[str, Any], revision: int | None = None) -> None:
        actions[0] += 1
        clock[0] += 7
        command = Command(actor=actor, action_id=f"a{actions[0]}", group=group_name, kind=kind, target=target,
                          body=body, expected_revision=revision)
        group.accept(command, now_ms=clock[0])

    accept("owner", "group.create", group_name, {"org": "acme"})
    accept("owner", "membership.add", "worker", {"role": "worker"}, 0)
    accept("owner", "mission.create", "m1", {"title": "t" * 40, "cost_limit": 10**9, "approval_required": []})
    for index in range(workitems):
        workitem = f"wi-{index}"
        accept("owner", "workitem.create", workitem, {"mission": "m1", "priority": index % 5, "contract": CONTRACT})
        session = group.get("member:worker")["session_epoch"]
        accept("worker", "workitem.claim", workitem, {"session_epoch": session}, group.revision(f"workitem:{workitem}"))
        lease = group.get(f"workitem:{workitem}")["lease"]
        fence = {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}
        accept("worker", "workitem.start", workitem, fence)
        accept("worker", "workitem.checkpoint", workitem, {**fence, "checkpoint": {"step": index, "note": "n" * index}})
    return group.events


def _extend(events: list[Event], *, effects: list[Effect], body: dict[str, Any] | None = None, authoritative: bool = True) -> Event:
    """An Event appended to ``events``' chain with the given effects (no rules: redo checks links)."""
    last = events[-1]
    seq = last.seq + 1
    event = msgspec.structs.replace(
        last, seq=seq, event_id=f"{last.group}:{seq}", action_id=f"x{seq}", body=body, effects=effects,
        authoritative=authoritative, prev_hash=last.hash, hash=bytes([seq % 256]) * 32, accepted_at_ms=last.accepted_at_ms + 1,
    )
    events.append(event)
    return event


def _records(events: list[Event]) -> list[bytes]:
    return [EVENT_TAG + encode_event(event) for event in events]


@pytest.fixture
def index(tmp_path):
    index = Index(str(tmp_path / "index"), map_size=MAP_BYTES)
    yield index
    index.close()


def _both(index: Index, records: list[bytes], heads: dict[str, tuple[int, bytes]] | None = None):
    """(Python's result or error, the C path's result or error)."""
    return index_paths(index, records, heads)


def test_c_bounds_are_the_limits():
    assert _index_c.ID_CHARS_MAX == limits.ID_CHARS_MAX


def test_rule_histories_index_byte_for_byte_like_python(index):
    """Two Groups' interleaved work-model histories: the same entries, in the same order (so
    C's seals are zlib's CRC-32, as the reader checks them)."""
    first, second = _history("g-a", 12), _history("g-b", 9)
    events = [event for pair in zip(first, second) for event in pair] + first[len(second):] + second[len(first):]
    records = _records(events)
    python, c = _both(index, records)
    assert not isinstance(python[0], str)
    assert index_bytes(c) == index_bytes(python)
    assert python[0].items[b"states"] and python[0].new[b"receipts"]  # the history really made entries
    assert c[1]["g-a"] == (first[-1].seq, first[-1].hash)


def test_shapes_the_rules_rarely_make(index):
    """Deleted aggregates, Evidence (no effects), a redacted body, every string and int width."""
    events = _history("g-1", 1)
    _extend(events, effects=[Effect("workitem:gone", 3, None)])
    _extend(events, effects=[], body={"late": True}, authoritative=False)
    _extend(events, effects=[Effect("a:1", 1, {"s": "x" * 31, "m": "y" * 32, "l": "z" * 300, "xl": "w" * 70_000})])
    _extend(events, effects=[Effect("a:2", 1, {"i": [0, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, -1, -32, -33, -129, -(2**63)]})])
    _extend(events, effects=[Effect("a:3", 2, {"f": [0.5, -1e300, float("inf")], "n": None, "b": [True, False], "d": {"e": {"f": []}}})])
    _extend(events, effects=[Effect(f"k:{index}", 1, {"v": index}) for index in range(300)])  # more than C takes at once
    _extend(events, effects=[Effect("u:ü", 1, {"ключ": "値", "emoji": "\U0001f600"})], body=None)
    python, c = _both(index, _records(events))
    assert index_bytes(c) == index_bytes(python)


def test_c_indexes_every_width_the_engine_writes_in_one_call(index):
    """Strings, binaries, integers, arrays and maps of every msgpack width the engine writes are
    C's to index: a reader that misreads one width hands every such record back to Python, whose
    entries are the same, so only the stop shows it (redo would run at Python's speed)."""
    events = _history("g-1", 1)
    _extend(events, effects=[Effect("workitem:gone", 3, None)])
    _extend(events, effects=[], body={"late": True}, authoritative=False)
    _extend(events, effects=[Effect("a:1", 1, {"s": "x" * 31, "m": "y" * 32, "l": "z" * 300, "xl": "w" * 70_000})])
    _extend(events, effects=[Effect("a:2", 1, {"i": [0, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, -1, -32, -33, -129, -(2**63)]})])
    _extend(events, effects=[Effect("a:3", 2, {"f": [0.5, -1e300], "n": None, "b": [True, False], "d": {"e": {"f": []}}})])
    _extend(events, effects=[Effect("a:4", 1, {"list": list(range(20)), "long": list(range(70_000)), "map": {f"k{n}": n for n in range(20)},
                                               "bin": b"\x00" * 300})])
    _extend(events, effects=[Effect(f"k:{index}", 1, {"v": index}) for index in range(40)])  # an array16 of effects
    _extend(events, effects=[Effect("u:\u00fc", 1, {"\u043a\u043b\u044e\u0447": "\u5024", "emoji": "\U0001f600"})], body=None)
    records = _records(events)
    writes = PendingWrites()
    heads = {"g-1": (events[0].seq, events[0].hash)}
    stop, last_ms = _index_c.index_events(records, list(range(0, 8 * len(records), 8)), 1, heads, (writes.items, writes.new), (1, 2, 3))
    assert stop == len(records)
    assert last_ms == events[-1].accepted_at_ms and heads["g-1"] == (events[-1].seq, events[-1].hash)
    python, c = _both(index, records)
    assert index_bytes(c) == index_bytes(python)


@pytest.mark.parametrize("calls", ["one C call", "two C calls"])
def test_the_last_acceptance_time_is_the_largest_not_the_last(index, calls):
    """Redo keeps the largest acceptance time it saw (the next one is never before it): C's
    answer is the reference's even for a log whose times do not ascend, within one C call and
    across the calls of one batch (an ACK after the largest is handed back, a second call takes
    the rest)."""
    events = _history("g-1", 1)
    events[2] = msgspec.structs.replace(events[2], accepted_at_ms=events[-1].accepted_at_ms + 1_000)
    records = _records(events)
    if calls == "two C calls":
        records.insert(3, ACK_TAG + msgspec.msgpack.encode(("consumer", "g-1", 1)))
    python, c = _both(index, records)
    assert python[2] == c[2] == events[2].accepted_at_ms


def test_c_hands_back_what_it_does_not_handle(index):
    """Other tags, a Group without a known head, an extension type, depth past C's limit: C stops
    at that record (leaving it untouched) and the combined result is Python's."""
    events = _history("g-1", 2)
    ext = _extend(events, effects=[Effect("a:x", 1, {"ext": msgspec.msgpack.Ext(5, b"raw")})])
    deep: Any = []
    for _ in range(70):
        deep = [deep]
    deep_event = _extend(events, effects=[Effect("a:deep", 1, {"d": deep})])
    records = _records(events)
    ack = ACK_TAG + msgspec.msgpack.encode(("consumer", "g-1", 1))
    records.insert(3, ack)
    stops = []
    heads: dict[str, tuple[int, bytes]] = {}
    writes = PendingWrites()
    at = 0
    while at < len(records):
        at, _ = _index_c.index_events(records, list(range(len(records))), at, heads, (writes.items, writes.new), (1, 2, 3))
        stops.append(at)
        if at < len(records):
            # what redo would do: Python applies this record; here only the head is carried on
            if records[at][:1] == EVENT_TAG:
                event = msgspec.msgpack.decode(records[at][1:], type=Event)
                heads[event.group] = (event.seq, event.hash)
            at += 1
    ext_at = events.index(ext) + 1  # the ACK sits before it
    deep_at = events.index(deep_event) + 1
    assert deep_at == len(records) - 1
    assert stops == [0, 3, ext_at, deep_at]  # no head yet, the ACK, the Ext, the depth
    python, c = _both(index, records)
    assert index_bytes(c) == index_bytes(python)


def test_a_head_c_cannot_read_is_left_to_python():
    records = _records(_history("g-1", 1))
    writes = PendingWrites()
    for head in [(-5, b"\x00" * 32), ("1", b"\x00" * 32), (1, "not bytes"), (2**64, b"\x00" * 32)]:
        stop, _ = _index_c.index_events(records, [0] * len(records), 1, {"g-1": head}, (writes.items, writes.new), (1, 2, 3))
        assert stop == 1
    assert not any(writes.items.values())


@pytest.mark.parametrize("seed", [2**32, 2**32 + 1, -1, 2**64])
def test_a_seed_that_is_no_crc32_is_refused_before_anything_is_written(seed):
    """A database seed is a CRC-32: one past 32 bits (or below 0) is refused, not wrapped into
    another seed that would seal every entry under the wrong database."""
    events = _history("g-1", 2)
    records = _records(events)
    writes = PendingWrites()
    heads = {"g-1": (events[0].seq, events[0].hash)}
    for at in range(3):
        seeds = [1, 2, 3]
        seeds[at] = seed
        with pytest.raises((ValueError, OverflowError)):
            _index_c.index_events(records, [0] * len(records), 1, heads, (writes.items, writes.new), tuple(seeds))
    assert not any(writes.items.values()) and heads["g-1"] == (events[0].seq, events[0].hash)


def test_damage_is_the_same_corruption_either_way(index):
    events = _history("g-1", 2)
    records = _records(events)
    gap = records[:4] + records[5:]
    assert _both(index, gap)[0] == _both(index, gap)[1] == ("Corruption", "chain", 32)
    torn = records[:5] + [records[5][:-3]] + records[6:]
    python, c = _both(index, torn)
    assert python == c and python[:2] == ("Corruption", "decode")
    longer = records[:5] + [records[5] + b"\xc0"] + records[6:]  # a whole Event, then a byte more
    python, c = _both(index, longer)
    assert python == c == ("Corruption", "decode", 40)
    marker = _extend(events, effects=[Effect("a:1", 1, {"s": "MARKER"})])
    bad_utf8 = _records(events)
    bad_utf8[-1] = bad_utf8[-1].replace(b"MARKER", b"MA\xed\xa0\x80R")  # a surrogate: not UTF-8
    python, c = _both(index, bad_utf8)
    assert python == c and python[:2] == ("Corruption", "decode"), marker


@pytest.mark.parametrize("forgery", ["prev hash", "repeated seq", "skipped seq", "prev hash of a record C hands back", "prev hash one byte short"])
def test_a_chain_that_does_not_link_is_the_same_corruption_either_way(index, forgery):
    """An Event must carry its Group head's next sequence and that head's hash. C hands back the
    record that does not link, so Python's check is the one that decides, for the chain's first
    record after a head read from the index and for every record C does not parse."""
    events = _history("g-1", 2)
    last = events[-1]
    if forgery == "prev hash":
        events[-1] = msgspec.structs.replace(last, prev_hash=b"\x07" * 32)
    elif forgery == "repeated seq":  # linked by hash to the head, but the head's own sequence
        events[-1] = msgspec.structs.replace(last, seq=last.seq - 1, event_id=f"g-1:{last.seq - 1}")
    elif forgery == "skipped seq":  # linked by hash to the head, one sequence too far
        events[-1] = msgspec.structs.replace(last, seq=last.seq + 1, event_id=f"g-1:{last.seq + 1}")
    elif forgery == "prev hash of a record C hands back":
        events[-1] = msgspec.structs.replace(last, prev_hash=b"\x07" * 32,
                                             effects=[Effect("a:x", 1, {"ext": msgspec.msgpack.Ext(5, b"raw")})])
    else:  # 31 bytes, then the next field's header (0xC4): a 32-byte comparison would match the head
        head_hash = b"\x11" * 31 + b"\xc4"
        events[-2] = msgspec.structs.replace(events[-2], hash=head_hash)
        events[-1] = msgspec.structs.replace(last, prev_hash=head_hash[:31])
    records = _records(events)
    offset = (len(records) - 1) * 8
    assert _both(index, records) == (("Corruption", "chain", offset),) * 2
    heads = {"g-1": (events[-2].seq, events[-2].hash)}  # the head as a redo would read it from the index
    assert _both(index, records[-1:], heads) == (("Corruption", "chain", 0),) * 2


@pytest.mark.parametrize(
    "bad",
    [b"MARK\xc0\xaf", b"MARK\xc1\xbf", b"MAR\xe0\x80\xaf", b"MA\xf0\x80\x80\xaf", b"MA\xf4\x90\x80\x80", b"MARK\xf5\x80",
     b"MARKE\xc3", b"MARKE\xe2", b"MARKE\x80", b"MARK\xe2\x28"],
    ids=["overlong 2 bytes", "overlong C1", "overlong 3 bytes", "overlong 4 bytes", "above U+10FFFF", "F5 lead",
         "cut at the end", "3-byte lead cut at the end", "lone continuation", "bad continuation"],
)
def test_invalid_utf8_in_a_state_is_the_same_corruption_either_way(index, bad):
    """What Python's decoder refuses C refuses too, whatever follows the string: here the next
    key's header (0xA1, a continuation byte's value) follows it, so a check that looked one byte
    past the string would take a sequence cut at its end for a whole one."""
    events = _history("g-1", 1)
    _extend(events, effects=[Effect("a:1", 1, {"s": "MARKER", "k": 1})])
    records = _records(events)
    assert records[-1].count(b"MARKER\xa1k") == 1
    records[-1] = records[-1].replace(b"MARKER", bad)
    python, c = _both(index, records)
    assert python == c and python[:2] == ("Corruption", "decode")


@pytest.mark.parametrize("field", ["payload hash", "group", "state string"])
def test_a_length_running_past_the_record_is_never_followed(index, field):
    """A damaged length byte can declare gigabytes in a record of a few hundred bytes: C hands
    the record back without reading past its end (a reader that followed the length would read
    four gigabytes past it), and Python's decode makes it CORRUPTION."""
    events = _history("g-1", 1)
    _extend(events, effects=[Effect("a:1", 1, {"s": "MARKER"})])
    records = _records(events)
    last = events[-1]
    old, new = {
        "payload hash": (b"\xc4\x20" + last.payload_hash, b"\xc6\xff\xff\xff\xf0" + last.payload_hash),
        "group": (b"\xa3g-1", b"\xdb\xff\xff\xff\xf0g-1"),
        "state string": (b"\xa6MARKER", b"\xdb\xff\xff\xff\xf0MARKER"),
    }[field]
    assert records[-1].count(old) == 1
    records[-1] = records[-1].replace(old, new)
    writes = PendingWrites()
    heads = {"g-1": (events[-2].seq, events[-2].hash)}
    stop, _ = _index_c.index_events(records, [0] * len(records), len(records) - 1, heads, (writes.items, writes.new), (1, 2, 3))
    assert stop == len(records) - 1 and not any(writes.items.values())
    python, c = _both(index, records)
    assert python == c and python[:2] == ("Corruption", "decode")


@pytest.mark.parametrize(
    "forgery",
    [
        {"effects": [Effect("a:1", -3, {"v": 1})]},
        {"effects": [Effect("a:1", 0, None)]},
        {"accepted_at_ms": -1},
        {"hash": b"\x01" * 31},
        {"content_hash": b"\x02" * 49},
        {"actor": "own\x00er"},
        {"action_id": "-a"},
        {"actor": "o" * 129},
        {"accepted_at_ms": -100},
        {"accepted_at_ms": -100_000},
        {"effects": [Effect("a:1", -40_000, {"v": 1})]},
        {"authoritative": None},
        {"effects": [Effect("a:1", 1, {1: "x"})]},
    ],
    ids=["negative revision", "revision 0", "negative time", "short hash", "long content hash", "NUL in actor",
         "action id starting with -", "actor too long", "negative int8 time", "negative int32 time",
         "negative int16 revision", "nil for a bool", "int key in a state"],
)
def test_impossible_values_are_corruption_either_way(index, forgery):
    """Values a well-framed record cannot hold (the fuzz suite found the first one raising
    struct.error out of redo): CORRUPTION, reason decode, from both paths."""
    events = _history("g-1", 1)
    events[-1] = msgspec.structs.replace(events[-1], **forgery)
    python, c = _both(index, _records(events))
    assert python == c == ("Corruption", "decode", (len(events) - 1) * 8)


@pytest.mark.parametrize(
    "record",
    [
        ACK_TAG + msgspec.msgpack.encode(("con\x00sumer", "g-1", 1)),
        ACK_TAG + msgspec.msgpack.encode(("consumer", "g-1", -1)),
        RECEIPT_TAG + msgspec.msgpack.encode(("owner", "a-1", b"\x01" * 49, b"")),
        RECEIPT_TAG + msgspec.msgpack.encode(("-owner", "a-1", b"\x01" * 32, b"")),
        GROUP_TAG + msgspec.msgpack.encode(("g-1", -1, b"\x01" * 32, [])),
        GROUP_TAG + msgspec.msgpack.encode(("g-1", 5, b"\x01" * 31, [])),
        GROUP_TAG + msgspec.msgpack.encode(("g-1", 5, b"\x01" * 32, [Effect("group:g-1", 0, None)])),
        # nested past the decoder's depth, where decoding goes down: a state (its nil replaced),
        # and a field of a note that decoding skips, {"x": [[[...]]]}
        GROUP_TAG + msgspec.msgpack.encode(("g-1", 5, b"\x01" * 32, [Effect("group:g-1", 1, {"a": None})]))[:-1] + _NESTED,
        SNAPSHOT_TAG + b"\x81\xa1x" + _NESTED,
        ARCHIVE_TAG + b"\x81\xa1x" + _NESTED,
    ],
    ids=["ACK consumer", "ACK cursor", "receipt hash", "receipt actor", "Group seq", "Group hash", "Group revision",
         "Group state nested", "snapshot note nested", "archive note nested"],
)
def test_impossible_values_in_other_records_are_corruption(index, record):
    """The records compaction and ACKs write are held to the same rules as Events."""
    python, c = _both(index, [record])
    assert python == c == ("Corruption", "decode", 0)


# The index stays empty (nothing is written to it): sharing it between examples is sound.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_damaged_records_mean_the_same_either_way(index, data):
    """Bytes changed anywhere in a history: both paths raise the same CORRUPTION, or both index
    and the entries mean the same (C copies a forged non-minimal encoding where Python
    re-encodes it, so bytes may differ only there)."""
    events = _history("g-1", 2)
    _extend(events, effects=[Effect("a:1", 1, {"s": "text", "i": [1, 300, -5], "f": 1.5, "m": {"k": None}})])
    records = _records(events)
    for _ in range(data.draw(st.integers(1, 3))):
        which = data.draw(st.integers(0, len(records) - 1))
        record = bytearray(records[which])
        spot = data.draw(st.integers(1, len(record) - 1))
        record[spot] = data.draw(st.integers(0, 255))
        records[which] = bytes(record)
    python, c = _both(index, records)
    assert index_meaning(c) == index_meaning(python)


class _HeadSeq(int):
    """A head's sequence number whose release runs Python code: it empties the list of records."""

    records: list[bytes] = []

    def __del__(self) -> None:
        self.records.clear()


def test_records_released_while_indexed_are_not_read_after_release():
    """index_events replaces a Group's head while the record that moved it is still being
    indexed; releasing the old head can run Python code (here it empties ``records``, dropping
    the record's bytes). The entries are still those of the record, and the shorter list ends
    the call (before the fix: a read of freed memory, then a NULL record, a segfault)."""
    events = _history("g-1", 1)
    expected_writes = PendingWrites()
    records = _records(events)
    heads = {"g-1": (events[0].seq, events[0].hash)}
    _index_c.index_events(records[:2], [0, 8], 1, heads, (expected_writes.items, expected_writes.new), (1, 2, 3))

    _HeadSeq.records = records = _records(events)  # fresh bytes, held only by the list
    writes = PendingWrites()
    heads = {"g-1": (_HeadSeq(events[0].seq), events[0].hash)}  # the only reference to the old head
    stop, _ = _index_c.index_events(records, list(range(0, 8 * len(records), 8)), 1, heads, (writes.items, writes.new),
                                    (1, 2, 3))
    assert records == [] and stop == 2
    assert writes.items == expected_writes.items and writes.new == expected_writes.new
    assert heads["g-1"] == (events[1].seq, events[1].hash)
