"""Rules of the C extensions (csrc/) that no other test pinned: each test names the rule it keeps.

The segment log's readers are called through cffi on exact-length buffers (test_segment_corruption's
helpers); its writer's durability steps are read off the I/O seam's recorded calls
(mwpstore/io_seam.py), since a skipped sync changes nothing a process can see until the power fails.
"""

from __future__ import annotations

import contextlib
import os
import struct

import lmdb
import msgspec
import pytest

from mwpstore import _apply_c, _canonical_c
from mwpstore._lmdb_check import check_lmdb_file
from mwpstore._segment_log_c import ffi, lib
from mwpstore.io_seam import RecordingIO
from mwpstore.limits import SEGMENT_BYTES_MIN
from mwpstore.messages import Effect, Event
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from test_segment_corruption import HEADER, _exact_copy, build, segment_paths
from test_agent_store_apply_many import EVENTS
from test_canonical import _python_content_ok
from test_index_records import _both, _history, _records, index
from test_lmdb_check import F_BIGDATA, P_LEAF, PAGE, _check_fails, _damaged_copy, _meta, _reachable, sample
from test_segment_power_loss import _run_workload


def _decoded_header(segment: bytes):
    header = ffi.new("struct sl_header *")
    assert lib.sl_header_decode(segment, len(segment), header, ffi.new("struct sl_fault *")) == lib.SL_OK
    return header


def test_a_record_frame_cut_by_the_end_of_the_buffer_is_named_truncated_not_read_past(scratch):
    """A frame longer than the bytes left is FRAME_TRUNCATED before any checksum is computed: the
    check must cover the whole frame, or the checksum would read past the buffer (by up to its
    padding) and the damage would be named a checksum mismatch."""
    payload = bytes(range(1, 65))  # 64 bytes, none zero: the frame's last 8 bytes are payload
    build(scratch, [[b"first"], [payload]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = file.read()
    header = _decoded_header(segment)
    start = HEADER + 16 + 8 + 32  # after the first group: one 24-byte record frame and its commit frame
    assert struct.unpack_from("<I", segment, start + 4)[0] & ((1 << 28) - 1) == len(payload)
    fault = ffi.new("struct sl_fault *")
    offset, length = ffi.new("uint64_t *"), ffi.new("uint32_t *")
    position = header.first_position + start - HEADER
    for missing in (1, 4, 8):
        size = start + 16 + len(payload) - missing
        data = _exact_copy(segment[:size])
        assert lib.sl_read_record(data, size, header, position, offset, length, fault) == lib.SL_E_CORRUPT
        assert fault.reason == lib.SL_REASON_FRAME_TRUNCATED, missing


def test_an_intact_frame_at_the_end_that_names_another_position_is_corruption_not_a_torn_tail(scratch):
    """Recovery cuts only what a torn write can leave. A frame whose checksum holds was written
    whole, so one that names another position (a copy of an earlier frame where the next group
    would start) was written wrong or moved: FRAME_POSITION corruption, in both recovery modes,
    never a tail to cut."""
    build(scratch, [[b"alpha" * 3], [b"beta" * 5]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = bytearray(file.read())
    header = _decoded_header(bytes(segment))
    first_frame = segment[HEADER : HEADER + 32]  # the first record frame: 16 + 15 bytes, padded
    end = HEADER + 32 + 32 + 40 + 32  # two groups: a record frame and a commit frame each
    assert segment[end : end + 64] == bytes(64)
    segment[end : end + 32] = first_frame
    data = _exact_copy(bytes(segment))
    recovery, fault = ffi.new("struct sl_recovery *"), ffi.new("struct sl_fault *")
    for bulk in (0, 1):
        assert lib.sl_recover(data, len(segment), header, bulk, recovery, fault) == lib.SL_E_CORRUPT
        assert (fault.reason, fault.offset) == (lib.SL_REASON_FRAME_POSITION, end)
    assert lib.sl_recover_readonly(data, len(segment), header, recovery, fault) == lib.SL_E_CORRUPT
    assert fault.reason == lib.SL_REASON_FRAME_POSITION


def test_bytes_after_a_seal_are_a_torn_tail_and_fail_the_sealed_verifier(scratch):
    """A sealed segment ends at its seal. sl_recover (the writer's) reports any byte that is not
    zero after the seal as torn, and sl_verify_sealed refuses such a segment as data_after_seal;
    zeros after the seal are neither."""
    from test_segment_corruption import sealed_segment

    _, sealed, _ = sealed_segment(scratch)
    header = _decoded_header(sealed)
    recovery, fault, end = ffi.new("struct sl_recovery *"), ffi.new("struct sl_fault *"), ffi.new("uint64_t *")
    for tail, torn in ((bytes(64), 0), (bytes(40) + b"\x01" + bytes(23), 1)):
        content = sealed + tail
        data = _exact_copy(content)
        assert lib.sl_recover(data, len(content), header, 0, recovery, fault) == lib.SL_OK
        assert (recovery.sealed, recovery.torn, recovery.used_bytes) == (1, torn, len(sealed))
        rc = lib.sl_verify_sealed(data, len(content), header, end, fault)
        if torn:
            assert (rc, fault.reason, fault.offset) == (lib.SL_E_CORRUPT, lib.SL_REASON_DATA_AFTER_SEAL, len(sealed))
        else:
            assert rc == lib.SL_OK and end[0] == header.first_position + len(sealed) - HEADER - lib.SL_SEAL_FRAME_BYTES


@contextlib.contextmanager
def _c_writer(directory: str, *, segment_bytes: int, sync: int):
    """The C writer of a new log (one segment at position 0) in ``directory``: (handle, fault)."""
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_segment_create(lib.sl_io_default(), directory.encode(), 9, 0, segment_bytes, fault) == lib.SL_OK
    with open(os.path.join(directory, "%020d.seg" % 0), "rb") as file:
        header = _decoded_header(file.read(HEADER))
    handle = ffi.new("struct sl_log **")
    assert lib.sl_log_open(lib.sl_io_default(), directory.encode(), header, 0, segment_bytes, sync, handle, fault) == lib.SL_OK
    try:
        yield handle[0], fault
    finally:
        lib.sl_log_close(handle[0])


def _commit_frame(header, offset: int, group_start: int) -> bytes:
    """An intact commit frame at file `offset` (its own position), naming a one-record group."""
    body = struct.pack("<IQQII", lib.SL_KIND_COMMIT << 28 | 16, header.first_position + offset - HEADER, group_start, 1, 0)
    return struct.pack("<I", lib.sl_crc32c(header.seed, body, len(body))) + body


def test_recovery_judges_a_segment_by_its_own_bytes_not_what_a_longer_file_holds_past_them(scratch):
    """Recovery walks [0, segment_bytes) of a segment, however long the file or buffer is: an
    intact commit frame past segment_bytes proves nothing, so a damaged last group stays a torn
    tail (a commit frame inside the segment would make it group_damaged)."""
    build(scratch, [[b"one" * 9], [b"two" * 9]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = bytearray(file.read())
    header = _decoded_header(bytes(segment))
    size = header.segment_bytes
    assert len(segment) == size
    last = HEADER + 48 + 32  # the second group's record frame (16 + 27 bytes, padded), after the first group
    segment[last + 20] ^= 0x10  # its checksum fails, and its commit frame never came: a torn write
    segment[last + 48 : last + 80] = bytes(32)
    recovery, fault = ffi.new("struct sl_recovery *"), ffi.new("struct sl_fault *")
    longer = bytes(segment) + _commit_frame(header, size, header.first_position + last - HEADER)
    assert lib.sl_recover(_exact_copy(longer), len(longer), header, 0, recovery, fault) == lib.SL_OK
    assert (recovery.torn, recovery.used_bytes, recovery.group_count) == (1, last, 1)
    inside = bytearray(segment)
    at = size - 4096
    inside[at : at + 32] = _commit_frame(header, at, header.first_position + last - HEADER)
    assert lib.sl_recover(_exact_copy(bytes(inside)), size, header, 0, recovery, fault) == lib.SL_E_CORRUPT
    assert fault.reason == lib.SL_REASON_GROUP_DAMAGED


def test_a_read_by_position_is_damage_only_where_a_frame_naming_it_fails_its_checksum(scratch):
    """sl_read_record at a position: a frame naming it whose checksum fails is corruption (its
    reason); an intact frame naming it that is no record (an unknown kind, written whole) means
    the position is not where a record starts, as for a commit frame: SL_E_NOT_RECORD."""
    build(scratch, [[b"kept" * 4], [b"odd" * 4]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = bytearray(file.read())
    header = _decoded_header(bytes(segment))
    at = HEADER + 32 + 32  # the second group's record frame
    position = header.first_position + at - HEADER
    fault = ffi.new("struct sl_fault *")
    offset, length = ffi.new("uint64_t *"), ffi.new("uint32_t *")

    def read(content: bytes) -> int:
        return lib.sl_read_record(_exact_copy(content), len(content), header, position, offset, length, fault)

    assert read(bytes(segment)) == lib.SL_OK and length[0] == 12
    body = struct.pack("<IQ", 5 << 28 | 12, position) + b"odd" * 4 + bytes(4)  # kind 5: no kind at all
    unknown = bytearray(segment)
    unknown[at : at + 32] = struct.pack("<I", lib.sl_crc32c(header.seed, body, len(body))) + body
    assert (read(bytes(unknown)), fault.reason) == (lib.SL_E_NOT_RECORD, lib.SL_REASON_NOT_A_RECORD)
    unknown[at] ^= 1  # the same frame, its checksum now failing: damage
    assert (read(bytes(unknown)), fault.reason) == (lib.SL_E_CORRUPT, lib.SL_REASON_FRAME_CHECKSUM)


def test_a_scan_batch_of_no_records_or_more_than_the_bound_is_refused_as_a_limit(scratch):
    """sl_scan takes 1..SL_SCAN_BATCH_RECORDS_MAX records a call: a batch of 0 would return
    nothing and move nothing, so a caller looping until the end would never get there."""
    build(scratch, [[b"a", b"b"]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = file.read()
    header = _decoded_header(segment)
    data = _exact_copy(segment)
    state, fault, count = ffi.new("struct sl_scan_state *"), ffi.new("struct sl_fault *"), ffi.new("uint32_t *")
    arrays = [ffi.new("uint64_t[]", 4) for _ in range(3)]
    for records_max, expected in ((0, lib.SL_E_LIMIT), (lib.SL_SCAN_BATCH_RECORDS_MAX + 1, lib.SL_E_LIMIT), (4, lib.SL_OK)):
        state.position, state.group_known, state.group_records, state.sealed = header.first_position, 1, 0, 0
        state.group_start, state.group_checksum = header.first_position, header.seed
        end = header.first_position + 24 + 24 + 32  # two record frames and the commit frame
        rc = lib.sl_scan(data, len(segment), header, end, records_max, state, *arrays, count, fault)
        assert rc == expected, records_max
    assert count[0] == 2


# -- the writer's durability steps, read off the I/O seam's recorded calls ----------------------

_SEAL_WORD = lib.SL_KIND_SEAL << 28 | lib.SL_SEAL_PAYLOAD_BYTES


def _durability_violations(operations) -> list[str]:
    """Walk recorded calls keeping which files have unsynced changes and whether the directory
    has unsynced name changes; list every point where the writer's rules are broken:

    - an acknowledgement (an "ack" mark), or the return of an open (an "opened" mark), while any
      file or name change is not durable;
    - a group or seal written (past the header) while a name change is not durable (a BULK mark,
      a new segment's name);
    - a seal written over groups that are not durable, or a sealed file cut to its seal before the
      seal is durable; a segment renamed into place before its header is durable;
    - a new segment created while an earlier segment's trim (or anything else) is not durable;
    - anything not durable once the last call (close) was made."""
    dirty: set[int] = set()
    names_pending = False
    problems = []
    for index, operation in enumerate(operations):
        kind = operation[0]
        if kind == "mark" and operation[1] in ("ack", "opened") and (dirty or names_pending):
            problems.append(f"{index}: ack {operation[2]} with {sorted(dirty)} unsynced, names pending {names_pending}")
        elif kind == "write":
            _, file_id, offset, data = operation
            if offset >= HEADER and names_pending:
                problems.append(f"{index}: write at {offset} of file {file_id} before a name change is durable")
            if len(data) == 32 and struct.unpack_from("<I", data, 4)[0] == _SEAL_WORD and file_id in dirty:
                problems.append(f"{index}: seal written over unsynced groups of file {file_id}")
            dirty.add(file_id)
        elif kind == "truncate":
            if operation[1] in dirty:
                problems.append(f"{index}: file {operation[1]} cut before what it holds is durable")
            dirty.add(operation[1])
        elif kind == "allocate":
            dirty.add(operation[1])
        elif kind == "sync":
            dirty.discard(operation[1])
        elif kind == "create":
            if dirty:
                problems.append(f"{index}: {operation[1]} created while files {sorted(dirty)} are not durable")
            names_pending = True
        elif kind == "rename":
            if dirty:
                problems.append(f"{index}: {operation[2]} renamed into place before its content is durable")
            names_pending = True
        elif kind == "remove":
            names_pending = True
        elif kind == "dirsync":
            names_pending = False
    if dirty or names_pending:
        problems.append(f"end: {sorted(dirty)} unsynced, names pending {names_pending}")
    return problems


@pytest.mark.parametrize("seed, sync, groups", [(11, True, 70), (13, False, 70)])
def test_every_write_the_log_acknowledges_or_builds_on_is_durable_first(tmp_path, seed, sync, groups):
    """The writer's order of durable steps (docs/format/segment.md, "Commit groups", "Seal and
    rollover"), on the recorded calls of the power-loss workload (groups of random sizes, several
    rollovers, reopens): no acknowledgement before its group and every name it needs are durable,
    a seal only over durable groups, a trim only of a durable seal, the next segment only after
    the sealed one's trim is durable, a new segment's name only after its header is. A skipped
    sync would show in a crash state only when the power fails at that step; here it shows
    always."""
    recorder, _ = _run_workload(str(tmp_path), seed, sync, groups)
    operations = recorder.operations
    assert sum(1 for op in operations if op[0] == "rename") >= 3  # rollovers happened
    assert _durability_violations(operations) == []
    for path in segment_paths(str(tmp_path))[:-1]:  # every sealed segment is cut just after its seal
        with open(path, "rb") as file:
            content = file.read()
        assert struct.unpack_from("<I", content, len(content) - 28)[0] == _SEAL_WORD, path


def test_a_torn_tail_cut_at_open_is_durable_before_the_open_returns(tmp_path):
    """Recovery cuts a torn tail durably before the open returns (docs/format/segment.md, "Opening
    and the torn tail": ftruncate, posix_fallocate back to full size, fsync; sl_segment_truncate),
    and the first group after it is acknowledged only once durable."""
    directory = str(tmp_path)
    with SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN) as log:
        log.append([b"kept" * 10])
        end = log.end
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    (segment,) = [name for name in os.listdir(directory) if name.endswith(".seg")]
    with open(os.path.join(directory, segment), "r+b") as file:
        file.seek(HEADER + end)
        file.write(b"\x7f" * 24)  # a write that never completed
    recorder = RecordingIO(directory=directory)
    with SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN, io=recorder) as log:
        recorder.mark("opened")
        assert log.end == end
        log.append([b"next"])
        recorder.mark("ack", 0)
    assert any(op[0] == "truncate" for op in recorder.operations)
    assert _durability_violations(recorder.operations) == []


def test_a_segment_is_created_over_a_temporary_file_a_crash_left(scratch):
    """sl_segment_create writes a new segment under "<name>.tmp" first; a leftover of that name
    (a crash during an earlier creation: it was never renamed) is removed and the creation goes
    on, instead of failing with EEXIST."""
    name = "%020d.seg" % 4096
    with open(os.path.join(scratch, name + ".tmp"), "wb") as file:
        file.write(b"half a header")
    fault = ffi.new("struct sl_fault *")
    rc = lib.sl_segment_create(lib.sl_io_default(), scratch.encode(), 7, 4096, SEGMENT_BYTES_MIN, fault)
    assert (rc, fault.sys_errno) == (lib.SL_OK, 0)
    assert sorted(os.listdir(scratch)) == [name]
    with open(os.path.join(scratch, name), "rb") as file:
        header = _decoded_header(file.read())
    assert (header.log_id, header.first_position, header.segment_bytes) == (7, 4096, SEGMENT_BYTES_MIN)


def test_the_c_writer_refuses_a_group_above_the_group_bytes_bound_even_where_it_would_fit(tmp_path):
    """sl_log_append's own bound: a group of more than SL_GROUP_BYTES_MAX payload bytes is
    group_too_large even in a segment it would fit (SegmentLog.append checks the bound first; the
    C writer does not rely on it). The segment (just big enough) is removed afterwards."""
    try:
        with _c_writer(str(tmp_path), segment_bytes=lib.SL_GROUP_BYTES_MAX + 4096, sync=0) as (handle, fault):
            lengths = [lib.SL_RECORD_BYTES_MAX] * 4 + [8]
            total = sum(lengths)
            assert total == lib.SL_GROUP_BYTES_MAX + 8
            data = ffi.new("uint8_t[]", total)
            positions = ffi.new("uint64_t[]", len(lengths))
            rc = lib.sl_log_append(handle, data, total, ffi.new("uint32_t[]", lengths), len(lengths), positions, fault)
            assert (rc, fault.reason) == (lib.SL_E_LIMIT, lib.SL_REASON_GROUP_TOO_LARGE)
    finally:
        os.remove(os.path.join(tmp_path, "%020d.seg" % 0))


def test_every_new_segment_after_a_rollover_gets_its_first_group_with_zeros_ahead(tmp_path):
    """Zero ahead (docs/format/segment.md) counts written space per segment: a segment the writer
    starts at a rollover has never been written past its header, so its first group goes out with
    zeros after it (here, 64 KiB segments: up to the segment's end), like the first group after
    an open (tests/test_segment_log.py checks that one)."""
    recorder = RecordingIO()
    with SegmentLog.open(str(tmp_path), segment_bytes=SEGMENT_BYTES_MIN, io=recorder) as log:
        for _ in range(200):
            log.append([bytes(700)])
    firsts = [op for op in recorder.operations if op[0] == "write" and op[2] == HEADER]
    assert len(firsts) >= 3  # the first segment and two started at rollovers
    for _, file_id, offset, data in firsts:
        assert offset + len(data) == SEGMENT_BYTES_MIN, file_id


# -- the LMDB structure check (csrc/lmdb_check.c), on test_lmdb_check's sample environment -------


def test_a_free_list_record_that_is_no_whole_number_of_page_numbers(tmp_path, sample):
    """A free-list record is a count and that many u64 page numbers: data whose size is not a
    multiple of 8 is free_list damage, even when the count fits inside it."""
    def change(d):
        free_root, _, _ = _meta(bytes(d))
        base = free_root * PAGE
        lower, upper = struct.unpack_from("<HH", d, base + 12)
        assert upper - lower >= 2
        slots = [(base + 16 + 2 * i, struct.unpack_from("<H", d, base + 16 + 2 * i)[0]) for i in range((lower - 16) // 2)]
        slot, offset = next((slot, offset) for slot, offset in slots if offset == upper)  # the lowest node
        lo, hi, flags, key_bytes = struct.unpack_from("<HHHH", d, base + offset)
        size = lo | hi << 16
        assert not flags & F_BIGDATA and size % 8 == 0
        node = bytes(d[base + offset + 8 : base + offset + 8 + key_bytes + size])
        # the node two bytes lower, its data two bytes longer: the page is still tiled exactly
        struct.pack_into("<HHHH", d, base + offset - 2, (size + 2) & 0xFFFF, (size + 2) >> 16, flags, key_bytes)
        d[base + offset + 6 : base + offset + 6 + len(node)] = node
        d[base + offset + 6 + len(node) : base + offset + 8 + len(node)] = bytes(2)
        struct.pack_into("<H", d, slot, offset - 2)
        struct.pack_into("<H", d, base + 14, upper - 2)

    _check_fails(_damaged_copy(tmp_path, sample, change), "free_list")


def test_a_meta_page_of_another_data_version_is_meta_damage(tmp_path, sample):
    """A meta page carries LMDB's data version (1) after its magic: another version is a file this
    check cannot read as LMDB 0.9 does, so it is refused as meta damage, like a wrong magic."""
    _check_fails(_damaged_copy(tmp_path, sample, lambda d: struct.pack_into("<I", d, 20, 2)), "meta")


def test_on_equal_transaction_ids_the_check_reads_meta_0_as_lmdb_does(tmp_path):
    """Before the first commit both meta pages hold transaction id 0 and LMDB uses meta 0: the
    check walks meta 0's trees, so whatever meta 1 names is not looked at."""
    lmdb.open(str(tmp_path / "env"), map_size=1 << 20).close()
    source = str(tmp_path / "env" / "data.mdb")
    data = open(source, "rb").read()
    assert struct.unpack_from("<QQ", data, 144)[0] == struct.unpack_from("<Q", data, PAGE + 144)[0] == 0
    path = _damaged_copy(tmp_path, source, lambda d: struct.pack_into("<Q", d, PAGE + 88 + 40, 7))  # meta 1's main root
    assert check_lmdb_file(path, label="test", remedy="-").pages_in_use == 0


def test_a_node_offset_in_the_free_gap_of_its_page_is_node_bounds(tmp_path, sample):
    """Node offsets point at or above `upper` (the nodes' area): one in the gap between the offset
    array and `upper` is node_bounds, named at that offset."""
    wanted = {}

    def change(d):
        page = next(page for page, flags in _reachable(bytes(d), named_only=True).items()
                    if flags == P_LEAF and struct.unpack_from("<HH", d, page * PAGE + 12)[1] - struct.unpack_from("<HH", d, page * PAGE + 12)[0] >= 16)
        lower, _ = struct.unpack_from("<HH", d, page * PAGE + 12)
        struct.pack_into("<H", d, page * PAGE + 16, lower + 8)
        d[page * PAGE + lower + 8 : page * PAGE + lower + 16] = bytes(8)  # an empty node there, were it read
        wanted["value"] = lower + 8

    error = _check_fails(_damaged_copy(tmp_path, sample, change), "node_bounds")
    assert error.detail["value"] == wanted["value"]


# -- canonical content (csrc/canonical_check.c) --------------------------------------------------


class _Text(str):
    """A str subclass: its __eq__ and __hash__ could be anything, so canonical content refuses it."""


def test_a_dict_key_must_be_an_exact_str_in_the_c_content_check():
    """canonical.check_content's rule for map keys is type(key) is str; the C check answers the
    same (False, so the Python check names the field) for a key of a str subclass, at the top and
    nested, while the same dicts with plain str keys pass."""
    for value in ({_Text("a"): 1}, {"outer": {_Text("a"): "x"}}, [{"ok": 1}, {_Text("k"): None}]):
        assert _canonical_c.content_ok(value) is False
        assert _python_content_ok(value) is False
    assert _canonical_c.content_ok({"outer": {"a": "x"}}) is True



# -- index entries of Event records (csrc/index_records.c), against the Python reference ---------


@pytest.mark.parametrize(
    "forgery",
    [{"effects": [Effect("a:1", 1, [1, 2])]}, {"effects": [Effect("a:1", 2, "text")]}, {"body": ["not", "a", "map"]}],
    ids=["a list for a state", "a str for a state", "a list for a body"],
)
def test_a_state_or_body_that_is_no_map_is_corruption_either_way(index, forgery):
    """An effect's state and an Event's body are a map or nil (msgspec decodes them as dict | None):
    a well-framed record holding anything else is CORRUPTION, reason decode, from both paths; the
    C path does not index it."""
    events = _history("g-1", 1)
    events[-1] = msgspec.structs.replace(events[-1], **forgery)
    python, c = _both(index, _records(events))
    assert python == c == ("Corruption", "decode", (len(events) - 1) * 8)


# -- the AgentStore's in-order apply runs (csrc/agent_apply.c) -----------------------------------


def test_the_c_run_remembers_checked_aggregate_keys_only_up_to_its_bound():
    """run() adds each aggregate key it validated to the shared set ``checked`` only while the set
    holds fewer than ``checked_max`` keys (agent_store bounds the set's memory the same way):
    keys past the bound are still checked and the Events taken, just not remembered."""
    events = EVENTS["g-1"]
    keys = {effect.aggregate for event in events[1:] for effect in event.effects}
    assert len(keys) >= 3
    for checked_max in (0, 2):
        checked: set[str] = set()
        context = (Event, Effect, checked, checked_max, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple)
        assert _apply_c.run(events, 1, context, "g-1", b"g-1\x00", 2, events[0].hash, {}, {}, 10_000) == len(events)
        assert len(checked) == checked_max and checked <= keys


@pytest.mark.parametrize("past_the_file, check", [(1 << 20, "file_short"), ((1 << 20) - 1, "page_lost")])
def test_the_meta_may_name_pages_up_to_a_bounded_distance_past_the_end_of_the_file(tmp_path, sample, past_the_file, check):
    """Pages LMDB allocated and freed in one transaction are never written, so the last page
    number may run past the file, by less than 2**20 pages: at 2**20 it is file_short (the bound
    also caps the check's bitmaps); just below, the pages past the file are walked as numbers
    (here neither in use nor free: page_lost)."""
    pages = os.path.getsize(sample) // PAGE

    def change(d):
        for meta in (0, 1):
            struct.pack_into("<Q", d, meta * PAGE + 136, pages + past_the_file)

    _check_fails(_damaged_copy(tmp_path, sample, change), check)


def test_the_c_writer_refuses_record_lengths_that_do_not_add_up_to_the_bytes_given(scratch):
    """sl_log_append's lengths must add up to data_bytes exactly, one byte more or less is
    SL_E_ARGUMENT with nothing written (and the handle still usable)."""
    with _c_writer(scratch, segment_bytes=SEGMENT_BYTES_MIN, sync=1) as (handle, fault):
        lengths, positions = ffi.new("uint32_t[]", [3, 4]), ffi.new("uint64_t[]", 2)
        data = ffi.new("uint8_t[]", b"abcdefgh")
        for data_bytes in (8, 6):
            assert lib.sl_log_append(handle, data, data_bytes, lengths, 2, positions, fault) == lib.SL_E_ARGUMENT
        assert lib.sl_log_append(handle, data, 7, lengths, 2, positions, fault) == lib.SL_OK
        assert list(positions) == [0, 24]


def test_a_scan_stops_at_the_end_of_the_bytes_it_was_given(scratch):
    """sl_scan reads only the bytes it is given: a buffer that ends after a whole group (a reader's
    map of a segment still being written) is scanned to there and the scan stops with SL_OK and
    the position at the buffer's end, however far the caller's stop position lies; the next call
    on a longer buffer goes on from there."""
    build(scratch, [[b"one", b"two"], [b"three"]])
    with open(segment_paths(scratch)[0], "rb") as file:
        segment = file.read()
    header = _decoded_header(segment)
    first_group = HEADER + 24 + 24 + 32
    state, fault, count = ffi.new("struct sl_scan_state *"), ffi.new("struct sl_fault *"), ffi.new("uint32_t *")
    arrays = [ffi.new("uint64_t[]", 8) for _ in range(3)]
    state.position, state.group_known, state.group_records, state.sealed = header.first_position, 1, 0, 0
    state.group_start, state.group_checksum = header.first_position, header.seed
    rc = lib.sl_scan(_exact_copy(segment[:first_group]), first_group, header, 2**63, 8, state, *arrays, count, fault)
    assert (rc, count[0], state.position) == (lib.SL_OK, 2, header.first_position + first_group - HEADER)
    second_group = first_group + 24 + 32
    rc = lib.sl_scan(_exact_copy(segment[:second_group]), second_group, header, 2**63, 8, state, *arrays, count, fault)
    assert (rc, count[0], state.position) == (lib.SL_OK, 1, header.first_position + second_group - HEADER)


def test_a_page_whose_lower_bound_ends_inside_an_offset_is_page_bounds(tmp_path, sample):
    """`lower` ends the array of u16 node offsets, so it lies an even number of bytes past the page
    header: an odd `lower` (one flipped low bit) is page_bounds, not read as one offset fewer."""
    def change(d):
        page = next(page for page, flags in _reachable(bytes(d), named_only=True).items() if flags == P_LEAF)
        lower, upper = struct.unpack_from("<HH", d, page * PAGE + 12)
        assert upper > lower + 1
        struct.pack_into("<H", d, page * PAGE + 12, lower + 1)

    _check_fails(_damaged_copy(tmp_path, sample, change), "page_bounds")


@pytest.mark.parametrize("field, offset, value", [("page number", 0, 5), ("page flags", 10, 0x02)])
def test_a_meta_page_that_does_not_carry_its_number_and_meta_flag_is_meta_damage(tmp_path, sample, field, offset, value):
    """Each meta page is marked as what it is: page number 0 or 1 in its header and the P_META
    flag (LMDB refuses a meta without it). Either one damaged, on meta 1, is meta damage."""
    def change(d):
        struct.pack_into("<Q" if offset == 0 else "<H", d, PAGE + offset, value)

    _check_fails(_damaged_copy(tmp_path, sample, change), "meta")
