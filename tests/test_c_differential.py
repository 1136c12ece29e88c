"""Differential tests: every C fast path against the Python definition of the same behaviour, on
adversarial inputs the other suites rarely make.

- the segment log (csrc/segment_log.c through mwpstore/segment_log.py) against the reference
  reader (mwpstore/segment_reference.py) on logs built frame by frame, with frames whose
  checksums hold but which say the wrong thing (kind, length, position, commit, seal, header
  fields), and on hostile file names; on the logs the reference reads whole, read(), scans from
  each record and verify() agree with it too, and with a clean-close marker the log serves the
  reference's records or refuses what it refuses;
- canonical content and IDs (csrc/canonical_check.c) against ``canonical._content_ok`` and the
  ID and kind patterns, on every number edge, str/int/float/dict/list subclasses, bytes, tuples,
  lone surrogates, non-str keys, nesting at the depth bound and sizes at the item and string
  bounds; what C accepts must also pass ``check_content`` and encode;
- snapshot rows (``rows_check`` in csrc/canonical_check.c) against ``snapshot._row_problems``, on
  keys and revisions of every type and order;
- index entries of Event records (csrc/index_records.c) against ``authority._index_record`` on
  Events with edge values, fields of any type, every msgpack width, Ext values, repeated map keys,
  cut and extended records and other tags;
- the AgentStore's runs (csrc/agent_apply.c): ``check_run`` ends where ``_fully_valid_run`` ends,
  and the trusted ``run`` never takes an Event that ``admit_trusted_event`` (with the sequence and
  link apply() checks) refuses, writing what ``_apply_next`` writes, on Events with fields of any
  type (resealed, so that the field checks decide), subclasses, and arguments of every type;
- the LMDB structural check (csrc/lmdb_check.c), whose definition is LMDB itself: every damaged
  copy it passes, LMDB reads to the end without a crash.

Each section also keeps the reproducer of every disagreement it found, as a named test. The
generated tests are derandomized (the same examples on every run; the examples change when a
test's code does, so a found case is also kept with ``@example``) and sized to run in seconds.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from collections import OrderedDict
from collections.abc import Hashable
from decimal import Decimal
from enum import IntEnum

import msgspec

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent_store_support import workload
from segment_readers import c_read, c_read_recovered, files_of, reference_read, scratch_directory
from mwpstore import _canonical_c, _index_c, agent_store, limits, segment_reference
from mwpstore._apply_c import check_run
from mwpstore.agent_store import _CHECK_CONTEXT, _fully_valid_run, admit_trusted_event
from mwpstore.canonical import _ID_PATTERN, _KIND_PATTERN, _content_ok, canonical_bytes, check_content, check_id, check_kind
from mwpstore.canonical import id_ok, kind_ok
from mwpstore.errors import Corruption, EventInvalid, InvalidCommand
from mwpstore.index import Index
from mwpstore.messages import ZERO_HASH, Effect, Event, encode_event, payload_hash_of, recompute_event_hash
from mwpstore.torture import index_bytes, index_meaning, index_paths
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from mwpstore.segment_reference import crc32c

_DIFFERENTIAL = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def differential(max_examples: int) -> settings:
    """The settings of a generated test here: the same examples on every run, no deadline."""
    return settings(_DIFFERENTIAL, max_examples=max_examples)


# == the segment log: C reader against the reference reader =======================================

LOG_ID = 0x0102030405060708
SEGMENT_BYTES = 65536
RECORD, COMMIT, SEAL = 1, 2, 3


def _seed(log_id: int) -> int:
    return crc32c(struct.pack("<Q", log_id))


def _header(first: int, *, log_id: int = LOG_ID, version: int = 1, header_bytes: int = 64,
            segment_bytes: int = SEGMENT_BYTES, reserved: bytes = bytes(20)) -> bytes:
    body = b"MWPSEG\r\n" + struct.pack("<IIQQQ", version, header_bytes, log_id, first, segment_bytes) + reserved
    return body + struct.pack("<I", crc32c(body))


def _frame(kind: int, payload: bytes, position: int, *, log_id: int = LOG_ID) -> bytes:
    """A frame whose checksum holds (whatever it says)."""
    size = (16 + len(payload) + 7) // 8 * 8
    body = struct.pack("<IQ", kind << 28 | len(payload), position) + payload + bytes(size - 16 - len(payload))
    return struct.pack("<I", crc32c(body, _seed(log_id))) + body


def _commit(position: int, start: int, count: int, group_checksum: int) -> bytes:
    return _frame(COMMIT, struct.pack("<QII", start, count, group_checksum), position)


def _seal(position: int, first: int) -> bytes:
    return _frame(SEAL, struct.pack("<QQ", first, position), position)


def _group(position: int, payloads: list[bytes]) -> tuple[bytes, int]:
    """A whole commit group from ``position``; its bytes and the position after it."""
    out, group_checksum, start = b"", _seed(LOG_ID), position
    for payload in payloads:
        frame = _frame(RECORD, payload, position)
        out += frame
        position += len(frame)
        group_checksum = crc32c(frame[:4], group_checksum)
    return out + _commit(position, start, len(payloads), group_checksum), position + 32


def _write(directory: str, first: int, data: bytes, *, full: bool) -> str:
    path = os.path.join(directory, f"{first:020d}.seg")
    with open(path, "wb") as file:
        file.write(data + (bytes(SEGMENT_BYTES - len(data)) if full and len(data) < SEGMENT_BYTES else b""))
    return path


# One item of a segment's content, drawn below:
#   ("group", payload sizes, commit change)   a commit group, its commit frame changed or not
#   ("frame", kind, payload size, shift)      one frame whose checksum holds, of any kind and
#                                             length, naming its own position moved by ``shift``
#   ("gap", words)                            8-byte words of zeros
COMMIT_CHANGES = ("none", "none", "none", "start", "count_up", "count_zero", "checksum", "missing", "kind_seal")
items = st.one_of(
    st.tuples(st.just("group"), st.lists(st.sampled_from([0, 1, 7, 8, 9, 16, 100]), min_size=1, max_size=4),
              st.sampled_from(COMMIT_CHANGES)),
    st.tuples(st.just("frame"), st.integers(0, 15), st.sampled_from([0, 1, 8, 15, 16, 17, 24]), st.sampled_from([0, 0, 8, -8])),
    st.tuples(st.just("gap"), st.integers(1, 5)),
)
SEAL_CHANGES = ("none", "none", "first", "next", "position", "missing", "group_open")
# A segment is often empty: the log's end then lies where the segment before it is sealed.
segments = st.lists(st.tuples(st.just([]) | st.lists(items, max_size=5), st.sampled_from(SEAL_CHANGES)), min_size=1, max_size=3)
DAMAGE = st.one_of(
    st.just(None),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.integers(0, 10**6)),
    st.tuples(st.just("zero"), st.integers(0, 10**6), st.sampled_from([1, 8, 16, 32])),
)


def _content(position: int, content: list) -> tuple[bytes, int]:
    """The frames of ``content`` from ``position``; their bytes and the position after them."""
    out = b""
    for item in content:
        if item[0] == "group":
            _, sizes, change = item
            payloads = [bytes([len(out) % 251]) * size for size in sizes]
            frames, end = _group(position, payloads)
            body = frames[:-32]
            start, count, group_checksum = struct.unpack_from("<QII", frames, len(frames) - 16)
            commit = {
                "none": frames[-32:],
                "start": _commit(end - 32, start + 8, count, group_checksum),
                "count_up": _commit(end - 32, start, count + 1, group_checksum),
                "count_zero": _commit(end - 32, start, 0, group_checksum),
                "checksum": _commit(end - 32, start, count, group_checksum ^ 1),
                "missing": b"",
                "kind_seal": _frame(SEAL, frames[-16:], end - 32),
            }[change]
            out += body + commit
            position = end - 32 + len(commit)
        elif item[0] == "frame":
            _, kind, size, shift = item
            frame = _frame(kind, bytes([kind]) * size, max(0, position + shift))
            out += frame
            position += len(frame)
        else:
            out += bytes(8 * item[1])
            position += 8 * item[1]
    return out, position


def _build(directory: str, layout: list, damage) -> None:
    first, paths = 0, []
    for index, (content, seal_change) in enumerate(layout):
        data, position = _content(first, content)
        last = index == len(layout) - 1
        if not last or seal_change == "group_open":
            if seal_change == "group_open":  # a record whose group the seal cuts off
                frame = _frame(RECORD, b"open", position)
                data, position = data + frame, position + len(frame)
            seal = {
                "first": _frame(SEAL, struct.pack("<QQ", first + 8, position), position),
                "next": _frame(SEAL, struct.pack("<QQ", first, position + 8), position),
                "position": _frame(SEAL, struct.pack("<QQ", first, position), position + 8),
                "missing": b"",
            }.get(seal_change, _seal(position, first))
            data += seal
        paths.append(_write(directory, first, _header(first) + data, full=last))
        first = position
    if damage is not None:
        path = paths[damage[1] % len(paths)]
        with open(path, "rb") as file:
            raw = bytearray(file.read())
        used = max(len(raw.rstrip(b"\x00")), 64)
        at = damage[1] % used
        if damage[0] == "flip":
            raw[at] ^= 1 << damage[2]
        elif damage[0] == "cut":
            del raw[at:]
        else:
            raw[at : at + damage[2]] = bytes(len(raw[at : at + damage[2]]))
        with open(path, "wb") as file:
            file.write(raw)


@differential(250)
@given(layout=segments, damage=DAMAGE)
@example(layout=[([], "group_open"), ([], "none")], damage=None)  # the draw that found the open group
def test_readers_agree_on_logs_built_frame_by_frame(layout, damage):
    """Frames that verify but do not belong (the checksum cannot tell), on their own or with
    damage that breaks a checksum: both readers serve the same records or raise the same
    Corruption (reason, segment, offset)."""
    directory = scratch_directory("mwpstore-differential-")
    try:
        _build(directory, layout, damage)
        expected = reference_read(directory)
        assert c_read_recovered(directory) == expected
        if expected[0] == "records":
            _assert_reads_agree(directory, expected[1], expected[2])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _assert_reads_agree(directory: str, records: list[tuple[int, bytes]], end: int) -> None:
    """On a log the reference reads whole: read() serves exactly the reference's records at their
    positions (no payload here looks like a frame), a scan from each record position serves the
    rest, and verify() counts them all."""
    served = dict(records)
    with SegmentLog.open(directory, readonly=True) as log:
        assert log.verify() == len(records)
        for position in range(0, end, 8):
            if position in served:
                assert log.read(position) == served[position]
            else:
                with pytest.raises(InvalidCommand):
                    log.read(position)
        for index, (position, _) in enumerate(records[:6]):
            tail = [(p, bytes(r)) for batch in log.scan(position, batch_records=2) for p, r in zip(batch.positions, batch.records)]
            assert tail == records[index:]


@differential(150)
@given(layout=segments, damage=DAMAGE)
def test_after_a_clean_close_the_log_serves_what_the_reference_reads_or_refuses(layout, damage):
    """The same logs with a clean-close marker that vouches for the segment files and names the
    end recovery finds in the last segment: open then takes the sealed segments on the marker's
    word and checks each when a scan first maps it. The records served are the reference's; a log
    the reference refuses is refused (Corruption; which damage is named first may differ, since
    the sealed segments are checked in the order the scan reaches them)."""
    directory = scratch_directory("mwpstore-differential-")
    try:
        _build(directory, layout, damage)
        expected = reference_read(directory)
        firsts = sorted(int(name[:20]) for name in os.listdir(directory) if name.endswith(".seg"))
        with open(os.path.join(directory, f"{firsts[-1]:020d}.seg"), "rb") as file:
            last = file.read()
        try:
            end = segment_reference.recover(last, segment_reference.decode_header(last[:64])).end_position
        except segment_reference._Damage:
            return  # no end a close could have recorded
        listed = zlib.crc32(struct.pack(f"<{len(firsts)}Q", *firsts))
        body = struct.pack("<8sQQQQI", b"MWPCLEN2", LOG_ID, firsts[-1], end, len(firsts), listed)
        with open(os.path.join(directory, CLEAN_FILE_NAME), "wb") as file:
            file.write(body + struct.pack("<I", zlib.crc32(body)))
        served = c_read(directory)
        assert served == expected if expected[0] == "records" else served[0] == "corruption"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@differential(100)
@given(layout=segments, damage=DAMAGE)
def test_a_writer_recovers_what_the_reference_reads_and_changes_nothing_it_refuses(layout, damage):
    """Opened for writing (the torn tail cut, a sealed last segment followed by a new one), the
    log serves the reference's records from the reference's end; a log the reference refuses at
    open is refused with the same Corruption and left byte for byte as it was."""
    directory = scratch_directory("mwpstore-differential-")
    try:
        _build(directory, layout, damage)
        _assert_the_writer_recovers(directory, reference_read(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _assert_the_writer_recovers(directory: str, expected: tuple) -> None:
    """A writer's open of ``directory`` serves ``expected`` (the reference's reading) from its
    recovered end, or refuses with the same Corruption and leaves every file as it was."""
    before = files_of(directory)
    try:
        log = SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES)
    except Corruption as exc:
        assert ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"]) == expected
        assert files_of(directory) == before
        return
    with log:
        try:
            records = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
            served = ("records", records, log.end)
        except Corruption as exc:  # damage in a sealed segment, found by the scan that reaches it
            served = ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"])
    assert served == expected


@differential(150)
@given(layout=segments, damage=DAMAGE)
def test_readers_agree_on_logs_a_bulk_mode_writer_had_open(layout, damage):
    """The same logs with the bulk-mode file (BULK) beside them, as a bulk-mode writer's crash
    leaves it: only a damaged group's own commit frame or a seal proves its write, and zeros where
    a group would start are the end whatever follows. A read-only open serves the reference's
    records or raises its Corruption; a writer's open recovers the same records, or refuses with
    the same Corruption and leaves every file (BULK too) as it was."""
    directory = scratch_directory("mwpstore-differential-")
    try:
        _build(directory, layout, damage)
        with open(os.path.join(directory, segment_reference.BULK_FILE_NAME), "wb"):
            pass
        expected = reference_read(directory)
        assert c_read_recovered(directory) == expected
        _assert_the_writer_recovers(directory, expected)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


HEADER_FORGERIES = {
    "version": dict(version=2),
    "version_zero": dict(version=0),  # below the format's version, not only above it
    "header_bytes": dict(header_bytes=65),
    "segment_bytes_small": dict(segment_bytes=4096),
    "segment_bytes_unaligned": dict(segment_bytes=SEGMENT_BYTES + 8),
    "segment_bytes_huge": dict(segment_bytes=2**40),
    "segment_bytes_largest": dict(segment_bytes=limits.SEGMENT_BYTES_MAX),  # valid: the bound is inclusive
    "reserved": dict(reserved=bytes(19) + b"\x01"),
    "reserved_first": dict(reserved=b"\x01" + bytes(19)),
    "other_log": dict(log_id=LOG_ID + 1),
}


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("forgery", sorted(HEADER_FORGERIES))
def test_readers_agree_on_headers_whose_checksum_holds(scratch, forgery, which):
    group, position = _group(0, [b"one", b"two"])
    firsts = [0, position]
    datas = [group + _seal(position, 0), _group(position, [b"three"])[0]]
    for index, (first, data) in enumerate(zip(firsts, datas)):
        fields = HEADER_FORGERIES[forgery] if index == which else {}
        _write(scratch, first, _header(first, **fields) + data, full=index == 1)
    assert c_read_recovered(scratch) == reference_read(scratch)


def test_a_first_position_that_is_not_aligned_or_past_every_position(scratch):
    for first in (4, 2**63):
        for name in os.listdir(scratch):
            os.remove(os.path.join(scratch, name))
        with open(os.path.join(scratch, f"{0:020d}.seg"), "wb") as file:
            file.write(_header(first) + bytes(SEGMENT_BYTES - 64))
        result = c_read_recovered(scratch)
        assert result == reference_read(scratch) and result[:2] == ("corruption", "header_field")


# -- reproducers of the disagreements found ------------------------------------------------------


def _sealed_log_with_a_record_over_its_seal(directory: str, *, later_group: bool) -> int:
    """Segment 0 holds one record frame whose payload ends with the seal's bytes: the seal where
    segment 1 begins verifies, and so does the record frame running over it, but the record is
    in no commit group. Returns the position of the seal."""
    seal_at = 4096
    record = _frame(RECORD, bytes(seal_at - 16) + _seal(seal_at, 0), 0)
    assert len(record) == seal_at + 32
    _write(directory, 0, _header(0) + record, full=False)
    later = _group(seal_at, [b"later"])[0] if later_group else b""
    _write(directory, seal_at, _header(seal_at) + later, full=True)
    return seal_at


@pytest.mark.parametrize("later_group", [False, True], ids=["log_ends_at_the_seal", "log_goes_on"])
def test_a_record_frame_running_over_a_seal_is_never_served(scratch, later_group):
    """Found here: the C scan served the record (no commit names it) when the log ended where the
    seal is, and otherwise named offset 0 where the reference names the segment's end. The
    sealed segment's frames must lead to its seal: a scan now reads that segment on to where it
    fails, as the reference reads it (unexpected_end at the end of its bytes)."""
    seal_at = _sealed_log_with_a_record_over_its_seal(scratch, later_group=later_group)
    expected = ("corruption", "unexpected_end", os.path.join(scratch, f"{0:020d}.seg"), 64 + seal_at + 32)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


def test_a_record_frame_running_over_a_seal_is_never_served_after_a_clean_close(scratch):
    """The same after a (forged) clean close: the sealed segment is taken on the marker's word at
    open, and checked when the scan maps it; the scan still refuses the record."""
    seal_at = _sealed_log_with_a_record_over_its_seal(scratch, later_group=False)
    body = struct.pack("<8sQQQQI", b"MWPCLEN2", LOG_ID, seal_at, seal_at, 2, zlib.crc32(struct.pack("<2Q", 0, seal_at)))
    with open(os.path.join(scratch, CLEAN_FILE_NAME), "wb") as file:
        file.write(body + struct.pack("<I", zlib.crc32(body)))
    with SegmentLog.open(scratch, readonly=True) as log:
        assert log.end == seal_at
        with pytest.raises(Corruption) as caught:
            list(log.scan(0))
        assert caught.value.detail["reason"] == "unexpected_end"
        with pytest.raises(Corruption):
            log.verify()


@pytest.mark.parametrize("clean_marker", [False, True])
def test_a_record_whose_group_a_seal_cuts_off_is_never_served(scratch, clean_marker):
    """Found here (the frame-by-frame draw, minimised): a record frame, then the seal, no commit;
    the next segment empty. The C scan stopped at the log's end, where the seal lies, without
    reading it, and served the record; the reference names the seal that cuts the group."""
    record = _frame(RECORD, b"open", 0)
    seal_at = len(record)
    path = _write(scratch, 0, _header(0) + record + _seal(seal_at, 0), full=False)
    _write(scratch, seal_at, _header(seal_at), full=True)
    expected = ("corruption", "seal_mismatch", path, 64 + seal_at)
    assert reference_read(scratch) == expected
    if not clean_marker:
        assert c_read_recovered(scratch) == expected
        return
    body = struct.pack("<8sQQQQI", b"MWPCLEN2", LOG_ID, seal_at, seal_at, 2, zlib.crc32(struct.pack("<2Q", 0, seal_at)))
    with open(os.path.join(scratch, CLEAN_FILE_NAME), "wb") as file:
        file.write(body + struct.pack("<I", zlib.crc32(body)))
    assert c_read(scratch) == expected


@pytest.mark.parametrize("later", [False, True], ids=["only_its_own_commit_after", "a_later_group_after"])
def test_zeros_at_a_group_start_are_judged_alike_by_both_readers(scratch, later):
    """Zeros over the first frame header of a group: followed only by that group's own intact
    commit frame they are a torn last write, cut (the log ends before the group); followed by a
    later group's commit frame they are group_damaged. Both readers say so."""
    with SegmentLog.open(scratch, segment_bytes=SEGMENT_BYTES) as log:
        ends = []
        for record in (b"a" * 100, b"b" * 100, b"c" * 100):
            log.append([record])
            ends.append(log.end)
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))
    zeroed = ends[1 if later else 2] - (ends[1] - ends[0])  # the start of the group that ends there
    with open(os.path.join(scratch, f"{0:020d}.seg"), "r+b") as file:
        file.seek(64 + zeroed)
        file.write(bytes(16))
    expected = reference_read(scratch)
    if later:
        assert expected == ("corruption", "group_damaged", os.path.join(scratch, f"{0:020d}.seg"), 64 + zeroed)
    else:
        assert expected[0] == "records" and expected[2] == ends[1]
    assert c_read_recovered(scratch) == expected


@pytest.mark.parametrize("sealed", [False, True], ids=["active_segment", "sealed_segment"])
def test_a_commit_of_no_records_is_commit_mismatch_in_both_readers(scratch, sealed):
    """A commit frame that names itself as its group's start, with a count of zero and the
    checksum of no frames: intact, and what an empty group would end with, but the format has
    none (a group is 1 to 65536 records). Nothing tested the lower bound: recovery and scans that
    took such a commit as a group served the log as valid, where the reference refuses it."""
    group, position = _group(0, [b"one"])
    empty = _commit(position, position, 0, _seed(LOG_ID))
    later, end = _group(position + 32, [b"two"])
    if sealed:
        path = _write(scratch, 0, _header(0) + group + empty + later + _seal(end, 0), full=False)
        _write(scratch, end, _header(end), full=True)
    else:
        path = _write(scratch, 0, _header(0) + group + empty + later, full=True)
    expected = ("corruption", "commit_mismatch", path, 64 + position)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


@pytest.mark.parametrize("sealed", [False, True], ids=["active_segment", "sealed_segment"])
def test_a_commit_naming_another_group_start_is_commit_mismatch_in_both_readers(scratch, sealed):
    """A commit frame whose count and group checksum are its group's, and whose frame checksum
    holds, but whose group start is 8 bytes off. The group checksum alone already ties the commit
    to its records (their checksums cover their positions), so only the start field is wrong;
    the format requires it to match, and the reference refuses it. The frame-by-frame draw has
    this change, but its fixed examples passed with a C reader that ignored the field."""
    first, position = _group(0, [b"one"])
    frames, end = _group(position, [b"two", b"three"])
    start, count, group_checksum = struct.unpack_from("<QII", frames, len(frames) - 16)
    assert start == position
    changed = frames[:-32] + _commit(end - 32, start + 8, count, group_checksum)
    later, after = _group(end, [b"four"])
    if sealed:
        path = _write(scratch, 0, _header(0) + first + changed + later + _seal(after, 0), full=False)
        _write(scratch, after, _header(after), full=True)
    else:
        path = _write(scratch, 0, _header(0) + first + changed + later, full=True)
    expected = ("corruption", "commit_mismatch", path, 64 + end - 32)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


@pytest.mark.parametrize("sealed", [False, True], ids=["active_segment", "sealed_segment"])
def test_a_group_of_more_records_than_the_bound_is_group_too_many_in_both_readers(sealed):
    """GROUP_RECORDS_MAX + 1 empty record frames under a commit that counts them all, in a 2 MiB
    segment: every frame and the commit verify, but no writer makes such a group. Only the
    bound refuses it, and no test reached the bound, so recovery or a scan without it passed."""
    directory = scratch_directory()
    try:
        count = limits.GROUP_RECORDS_MAX + 1
        frames, group_checksum = [], _seed(LOG_ID)
        for index in range(count):
            frame = _frame(RECORD, b"", 16 * index)
            frames.append(frame)
            group_checksum = crc32c(frame[:4], group_checksum)
        end = 16 * count + 32
        body = b"".join(frames) + _commit(16 * count, 0, count, group_checksum)
        segment_bytes = 2 * 1024 * 1024
        if sealed:
            path = _write(directory, 0, _header(0, segment_bytes=segment_bytes) + body + _seal(end, 0), full=False)
            _write(directory, end, _header(end), full=True)
        else:
            path = _write(directory, 0, _header(0, segment_bytes=segment_bytes) + body, full=False)
        expected = ("corruption", "group_too_many", path, 64 + 16 * limits.GROUP_RECORDS_MAX)
        assert reference_read(directory) == expected
        assert c_read_recovered(directory) == expected
        if not sealed:  # the open's recovery refuses it, before any scan: a writer never appends after it
            with pytest.raises(Corruption) as caught:
                SegmentLog.open(directory, readonly=True)
            assert caught.value.detail["reason"] == "group_too_many"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("name", [f"{0:020d}.seg\n", "\u0660" * 20 + ".seg", "\uff10" * 20 + ".seg", f"{0:020d}.seg.x"])
def test_a_file_named_almost_like_a_segment_is_ignored_by_both_readers(scratch, name):
    """Found here: "\\d{20}\\.seg$" took a name ending in a newline, or spelled with other
    digits, as segment 0; the C side then opened the name the number makes (another file, or
    none: StorageFailed) while the reference read the file itself. docs/format/segment.md: such
    names are "anything else", ignored by both."""
    group, end = _group(0, [b"kept"])
    _write(scratch, 0, _header(0) + group, full=True)
    with open(os.path.join(scratch, name), "wb") as file:
        file.write(_header(0) + _group(0, [b"stray"])[0])
    assert c_read_recovered(scratch) == reference_read(scratch) == ("records", [(0, b"kept")], end)
    os.remove(os.path.join(scratch, f"{0:020d}.seg"))
    assert c_read_recovered(scratch) == reference_read(scratch) == ("records", [], 0)


@pytest.mark.parametrize("number", [2**63, 99999999999999999992], ids=["first_past_max", "largest_name"])
@pytest.mark.parametrize("content", [b"", _header(0), _header(2**63)], ids=["empty", "header_of_0", "header_past_max"])
def test_a_segment_named_past_every_position_is_segment_name_in_both_readers(scratch, content, number):
    """Found here: for a name above 2**63 - 1 the reference decoded the file first (header_short,
    header_field, or segment_name at offset 24), where the C side refuses the name itself
    (docs/format/segment.md: segment_name). 2**63 is the first such name."""
    group, _ = _group(0, [b"kept"])
    _write(scratch, 0, _header(0) + group, full=True)
    name = os.path.join(scratch, f"{number:020d}.seg")
    with open(name, "wb") as file:
        file.write(content)
    expected = ("corruption", "segment_name", name, 0)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected



def test_a_segment_whose_header_names_another_position_is_segment_name_in_both_readers(scratch):
    """The name and the header's first position must agree: segment 0 whose header says 4096
    (aligned, checksum holding) is segment_name at the header's field (offset 24)."""
    group, _ = _group(4096, [b"misplaced"])
    path = _write(scratch, 0, _header(4096) + group, full=True)
    expected = ("corruption", "segment_name", path, 24)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


def test_a_record_of_the_largest_length_is_served_by_both_readers():
    """RECORD_BYTES_MAX is a record's largest length, not the first refused (frame_length is
    for lengths above it): one group of one such record, in a 32 MiB segment."""
    directory = scratch_directory()
    try:
        with SegmentLog.open(directory, segment_bytes=2 * limits.RECORD_BYTES_MAX) as log:
            log.append([b"\x5a" * limits.RECORD_BYTES_MAX])
        os.remove(os.path.join(directory, CLEAN_FILE_NAME))
        expected = reference_read(directory)
        assert expected[0] == "records" and [len(record) for _, record in expected[1]] == [limits.RECORD_BYTES_MAX]
        assert c_read_recovered(directory) == expected
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _log_with_a_damaged_group_then_a_later_one(directory: str, *, own_commit: bool, cut_after: bool) -> tuple[str, int, int]:
    """Three groups in segment 0; the second's record frame damaged (and its commit frame too,
    unless ``own_commit``); the third intact. With ``cut_after`` the file ends right after the
    third group's commit frame (its last 32 bytes). Returns the path, the second group's start
    and the first's records' end position."""
    first, second_start = _group(0, [b"first"])
    second, third_start = _group(second_start, [b"second"])
    third, end = _group(third_start, [b"third"])
    damaged = bytearray(second)
    damaged[20] ^= 0x01  # inside the record frame's payload: its checksum fails
    if not own_commit:
        damaged[-32:] = bytes(32)
    data = _header(0) + first + bytes(damaged) + third
    path = os.path.join(directory, f"{0:020d}.seg")
    with open(path, "wb") as file:
        file.write(data if cut_after else data + bytes(SEGMENT_BYTES - len(data)))
    return path, second_start, end


@pytest.mark.parametrize("bulk", [False, True], ids=["one_by_one", "bulk_mode"])
def test_a_damaged_group_that_only_a_later_commit_follows_is_damage_unless_in_bulk_mode(scratch, bulk):
    """docs/format/segment.md: a later group's intact commit proves the damaged group was written
    (group_damaged); in bulk mode (BULK present) only the damaged group's own commit counts, so
    the damage is a torn tail and cut. The random draws rarely build a damaged group whose own
    commit is gone while a later one stands."""
    path, second_start, _ = _log_with_a_damaged_group_then_a_later_one(scratch, own_commit=False, cut_after=False)
    if bulk:
        with open(os.path.join(scratch, segment_reference.BULK_FILE_NAME), "wb"):
            pass
        expected = ("records", [(0, b"first")], second_start)
    else:
        expected = ("corruption", "group_damaged", path, 64 + second_start)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


def test_a_commit_that_ends_where_the_segment_s_bytes_end_still_proves_the_write(scratch):
    """The proof of a completed write may be the last 32 bytes of the file: a damaged group whose
    only later commit frame ends exactly at the file's end is group_damaged, not a torn tail."""
    path, second_start, end = _log_with_a_damaged_group_then_a_later_one(scratch, own_commit=False, cut_after=True)
    assert os.path.getsize(path) == 64 + end
    expected = ("corruption", "group_damaged", path, 64 + second_start)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


def test_a_seal_at_the_last_position_a_segment_holds_is_read_by_both_readers(scratch):
    """A segment of S bytes holds positions up to S - 64 - 32, the seal's 32 bytes then ending at
    the file's end: a group filling the segment up to there, sealed, and a next segment."""
    room = SEGMENT_BYTES - 64 - 32  # where the seal goes
    payload = b"\x11" * (room - 32 - 16)  # one record frame and its commit frame fill the room
    group, seal_at = _group(0, [payload])
    assert seal_at == room
    _write(scratch, 0, _header(0) + group + _seal(seal_at, 0), full=False)
    later, end = _group(seal_at, [b"next"])
    _write(scratch, seal_at, _header(seal_at) + later, full=True)
    expected = ("records", [(0, payload), (seal_at, b"next")], end)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


def test_bytes_past_a_segment_s_size_are_not_read_by_either_reader(scratch):
    """The header's segment_bytes bounds what is read of the file: a commit frame written past
    it (the file grown beyond its size) proves nothing about the zeros before it, and is no
    group of the log."""
    group, end = _group(0, [b"kept"])
    data = _header(0) + group
    data += bytes(SEGMENT_BYTES - len(data))
    data += _group(SEGMENT_BYTES - 64, [b"past the end"])[0]
    _write(scratch, 0, data, full=False)
    expected = ("records", [(0, b"kept")], end)
    assert reference_read(scratch) == expected
    assert c_read_recovered(scratch) == expected


# == canonical content and IDs: _canonical_c against canonical._content_ok and the ID patterns ====


class _Str(str):
    pass


class _Int(int):
    pass


class _Float(float):
    pass


class _Dict(dict):
    pass


class _List(list):
    pass


class _Level(IntEnum):
    ONE = 1


INT_EDGES = [0, 1, -1, 2**31, 2**32, 2**63 - 2, 2**63 - 1, 2**63, 2**63 + 1, -(2**63) + 1, -(2**63), -(2**63) - 1,
             2**64 - 1, 2**64, -(2**64), 10**40, -(10**40)]
FLOAT_EDGES = [0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308, float("inf"), float("-inf"), float("nan"), 2.0**63, 1e-300]
SURROGATES = ["\ud800", "a\udfff", "\udbff\udc00", "\udc00x", "ok\ud83d"]
ODD_VALUES = [
    _Str("s"), _Int(1), _Float(1.5), _Dict(a=1), _List([1]), _Level.ONE, OrderedDict(a=1), b"bytes", bytearray(b"x"),
    memoryview(b"m"), frozenset(), {1, 2}, (1, 2), (), complex(1, 2), object, Decimal("1.5"), range(3),
]
canonical_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(INT_EDGES), st.integers(), st.sampled_from(FLOAT_EDGES), st.floats(),
    st.text(max_size=6), st.sampled_from(SURROGATES), st.sampled_from(ODD_VALUES),
)
canonical_keys = st.one_of(
    st.text(max_size=5), st.sampled_from(SURROGATES), st.sampled_from([_Str("k"), 1, 1.0, True, None, (1,), b"k", ""]),
)


def _containers(inner):
    return st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(canonical_keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(_Dict),
    )


canonical_values = st.recursive(canonical_scalars, _containers, max_leaves=25)


@st.composite
def nested_values(draw):
    """A leaf wrapped in 28 to 36 levels of dicts, lists and tuples (the depth bound is 32)."""
    value = draw(canonical_values)
    for wrapper in draw(st.lists(st.sampled_from(["dict", "list", "tuple", "wide"]), min_size=28, max_size=36)):
        if wrapper == "dict":
            value = {"k": value}
        elif wrapper == "list":
            value = [value]
        elif wrapper == "tuple":
            value = (value,)
        else:
            value = {"a": 1, "b": "s", "c": value}
    return value


def _python_content_ok(value) -> bool:
    return _content_ok(value, 0, [limits.BODY_ITEMS_MAX])


def _assert_content_paths_agree(value) -> None:
    answer = _canonical_c.content_ok(value)
    assert answer is _python_content_ok(value)
    if answer:
        check_content(value)  # accepted: no error, and the encoder can encode it
        encoded = canonical_bytes(value)
        assert canonical_bytes(msgspec.json.decode(encoded)) == encoded  # canonical bytes are a fixed point
    else:
        with pytest.raises(InvalidCommand):  # the precise walk names it (LimitExceeded is one too)
            check_content(value)


@differential(200)
@given(canonical_values)
def test_content_check_agrees_with_its_python_definition(value):
    _assert_content_paths_agree(value)


@differential(100)
@given(nested_values())
def test_content_check_agrees_at_the_depth_bound(value):
    _assert_content_paths_agree(value)


_BIG = "x" * limits.STRING_BYTES_MAX
_WIDE = [
    "x" * limits.STRING_BYTES_MAX, "x" * (limits.STRING_BYTES_MAX + 1), "\u00e9" * limits.STRING_BYTES_MAX,
    "\U0001f600" * (limits.STRING_BYTES_MAX // 4), _BIG[:-1] + "\ud800",
    {_BIG: 1}, {_BIG + "x": 1}, {"k": _BIG + "x"},
    [0] * (limits.BODY_ITEMS_MAX - 1), [0] * limits.BODY_ITEMS_MAX,
    {str(index): "v" for index in range(limits.BODY_ITEMS_MAX - 1)},
    {str(index): "v" for index in range(limits.BODY_ITEMS_MAX)},
    [{"a": "b"}] * (limits.BODY_ITEMS_MAX // 2), [{"a": "b"}] * (limits.BODY_ITEMS_MAX // 2 - 1) + [{}],
    {"a": [[0] * (limits.BODY_ITEMS_MAX - 3)]}, {"a": [[0] * (limits.BODY_ITEMS_MAX - 2)]},
    ((0,) * (limits.BODY_ITEMS_MAX - 1),), {"t": (None,) * (limits.BODY_ITEMS_MAX - 2), "u": "s"},
]


@pytest.mark.parametrize("index", range(len(_WIDE)))
def test_content_check_agrees_at_the_size_bounds(index):
    """Strings at the character bound (in 1- to 4-byte characters, one with a lone surrogate at
    its end), and the item budget met by values, by dict entries and by tuples."""
    _assert_content_paths_agree(_WIDE[index])


def test_content_check_budget_counts_shared_values_each_time():
    """One list object put many times counts each time it occurs: the walk is of the value,
    not of the objects."""
    shared = [0] * 1000
    value = [shared] * (limits.BODY_ITEMS_MAX // 1001)
    _assert_content_paths_agree(value)
    _assert_content_paths_agree(value + [shared])


ID_ALPHABET = "aZ09_.@+=-:/\\ \x00\n\t\u00e9\u0660\uff10\u212a\u0131\U0001f600"
ids = st.one_of(
    st.text(alphabet=ID_ALPHABET, max_size=8),
    st.sampled_from(["x" * 128, "x" * 129, "a" * 64, "a" * 65, "a.b" * 21 + "a", "a.b" * 21 + "ab", "a\n", "a\n\n",
                     "workitem.claim", "a..b", "a.", ".a", "_", "-", "@a", "a@", "9.9"] + SURROGATES),
    st.builds(_Str, st.text(alphabet="ab", max_size=3)),
    st.sampled_from([None, 1, 1.5, b"abc", ["a"], ("a",), True]),
)


@differential(400)
@given(ids)
def test_id_and_kind_checks_agree_with_the_patterns(value):
    """The C checks equal the documented patterns (canonical._ID_PATTERN, _KIND_PATTERN, their
    bounds), and check_id / check_kind raise InvalidCommand exactly when the C check says no."""
    _assert_id_and_kind_checks_agree(value)


@pytest.mark.parametrize("char", [chr(code) for code in range(128)] + ["\u00e9", "\u212a", "\u0660", "\U0001f600"])
def test_id_and_kind_checks_agree_with_the_patterns_on_every_character(char):
    """Each ASCII character (and a few beyond) alone, after and before a valid character, and at
    the start of a kind's second part: the ends of every range ('A', 'Z', 'a', 'z', '0', '9') and
    their neighbours included, which drawn IDs may miss."""
    for value in (char, "x" + char, char + "x", "a." + char):
        _assert_id_and_kind_checks_agree(value)


def _assert_id_and_kind_checks_agree(value) -> None:
    is_str = type(value) is str
    id_ok = is_str and 0 < len(value) <= limits.ID_CHARS_MAX and _ID_PATTERN.match(value) is not None
    kind_ok = is_str and 0 < len(value) <= limits.KIND_CHARS_MAX and _KIND_PATTERN.match(value) is not None
    assert _canonical_c.id_ok(value) is id_ok
    assert _canonical_c.kind_ok(value) is kind_ok
    for check, ok in ((lambda v: check_id(v, "x"), id_ok), (check_kind, kind_ok)):
        if ok:
            assert check(value) is value
        else:
            with pytest.raises(InvalidCommand):
                check(value)


@pytest.mark.parametrize("function", ["content_ok", "id_ok", "kind_ok"])
def test_canonical_checks_take_exactly_one_argument_of_any_type(function):
    check = getattr(_canonical_c, function)
    for value in ODD_VALUES + [None, 0, "", "a"]:
        assert check(value) in (True, False)
    with pytest.raises(TypeError):
        check()
    with pytest.raises(TypeError):
        check("a", "b")


# == snapshot rows: _canonical_c.rows_check against snapshot._row_problems =========================


class _StrKey(str):
    pass


class _IntRevision(int):
    pass


_ROW_KEYS = st.one_of(
    st.sampled_from(["", "a", "b", "ab", "b", "\u00e9", "\U0001f600", "a\x00", "workitem:wi-1", "workitem:wi-2"]),
    st.text(max_size=4),
    st.builds(_StrKey, st.sampled_from(["a", "b"])),
    st.sampled_from([None, 1, b"a", 1.5]),
)
_ROW_REVISIONS = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([2**63, 2**64 + 1, -(2**70), True, False, 1.0, 0.5, None, "1", _IntRevision(2), _IntRevision(0)]),
)
_ROWS = st.lists(st.tuples(_ROW_KEYS, _ROW_REVISIONS, st.none()), max_size=8)


@differential(400)
@given(rows=_ROWS, as_effects=st.booleans())
@example(rows=[("b", 1, None), ("a", 1, None)], as_effects=False)
@example(rows=[("a", 1, None), ("a", 2, None)], as_effects=True)
@example(rows=[("", 0, None), (1, True, None)], as_effects=False)
def test_snapshot_row_check_agrees_with_its_python_definition(rows, as_effects):
    """Keys of every type and order (str subclasses, code points beyond the BMP, NUL), revisions
    at every edge (bool, float, int subclasses, beyond 64 bits): the one C pass reports exactly the
    problems the Python definition finds, as Effects and as tuples."""
    from mwpstore.snapshot import _row_problems

    items = [Effect(*row) for row in rows] if as_effects else list(rows)
    assert _canonical_c.rows_check(items, as_effects) == _row_problems(items, as_effects)


def test_snapshot_row_check_refuses_rows_that_are_no_3_tuples():
    for rows in ([("a", 1)], [["a", 1, None]], [("a", 1, None, None)]):
        with pytest.raises(TypeError):
            _canonical_c.rows_check(rows, False)
    with pytest.raises(AttributeError):
        _canonical_c.rows_check([("a", 1, None)], True)


# == index entries of Event records: _index_c against authority._index_record =====================


def _pack(value, widths: random.Random) -> bytes:
    """msgpack of ``value`` in an encoding drawn from ``widths``: the shortest form or any longer
    one a decoder also takes (an int in a wider or signed form, a str, bytes, array or map with a
    wider length, a float as float32 when it is exact); msgspec Ext values as ext types."""
    wide = widths.random() < 0.3
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if type(value) is int:
        forms = []
        if 0 <= value <= 0x7F or -32 <= value < 0:
            forms.append(struct.pack("b", value) if value < 0 else bytes([value]))
        for tag, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q"), (0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
            try:
                forms.append(bytes([tag]) + struct.pack(fmt, value))
            except struct.error:
                pass
        return widths.choice(forms) if wide else min(forms, key=len)
    if type(value) is float:
        if wide and abs(value) < 3e38 and struct.unpack(">f", struct.pack(">f", value))[0] == value:
            return b"\xca" + struct.pack(">f", value)
        return b"\xcb" + struct.pack(">d", value)
    if type(value) is str:
        data = value.encode("utf-8", "surrogatepass")
        return _length(len(data), 0xA0, 31, (0xD9, 0xDA, 0xDB), wide, widths) + data
    if type(value) is bytes:
        return _length(len(value), None, 0, (0xC4, 0xC5, 0xC6), wide, widths) + value
    if type(value) in (list, tuple):
        return _length(len(value), 0x90, 15, (None, 0xDC, 0xDD), wide, widths) + b"".join(_pack(item, widths) for item in value)
    if type(value) is dict:
        return _length(len(value), 0x80, 15, (None, 0xDE, 0xDF), wide, widths) + b"".join(
            _pack(key, widths) + _pack(item, widths) for key, item in value.items()
        )
    if type(value) is _DupMap:
        return _length(len(value.items), 0x80, 15, (None, 0xDE, 0xDF), wide, widths) + b"".join(
            _pack(key, widths) + _pack(item, widths) for key, item in value.items
        )
    if type(value) is msgspec.msgpack.Ext:
        return b"\xc7" + bytes([len(value.data), value.code & 0xFF]) + value.data
    raise TypeError(type(value))


def _length(count: int, fix: int | None, fix_max: int, tags: tuple, wide: bool, widths: random.Random) -> bytes:
    forms = []
    if fix is not None and count <= fix_max:
        forms.append(bytes([fix | count]))
    for tag, fmt in zip(tags, (">B", ">H", ">I")):
        if tag is not None and count < 1 << (8 * struct.calcsize(fmt)):
            forms.append(bytes([tag]) + struct.pack(fmt, count))
    return widths.choice(forms) if wide else forms[0]


class _DupMap:
    """A msgpack map with the entries given, repeated keys included."""

    def __init__(self, items: list) -> None:
        self.items = items


state_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from([n for n in INT_EDGES if -(2**63) <= n < 2**64]), st.integers(-(2**63), 2**64 - 1), st.sampled_from(FLOAT_EDGES),
    st.floats(), st.text(max_size=6), st.binary(max_size=4),
)
state_values = st.recursive(
    state_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
states = st.none() | st.dictionaries(st.text(max_size=4), state_values, max_size=4)
ODD_FIELD_VALUES = [
    None, True, 0, -1, 2**63 - 1, 2**63, 2**64 - 1, 1.5, "", "g-1", "-x", "a" * 129, "\ud800", b"", b"\x00" * 32, b"\x00" * 33,
    [], {}, {"k": 1}, {1: 2}, msgspec.msgpack.Ext(1, b"x"), msgspec.msgpack.Ext(-1, b"\x00" * 4),
    _DupMap([("a", 1), ("a", 2)]), [["a:1", 1, None, 5]], [["a:1", 1]],
]


@st.composite
def event_records(draw):
    """One Group's records: Events linked by their hashes (as redo checks them, not recomputed),
    some fields drawn from the edges or replaced by a value of any type, each record encoded
    with a drawn choice of msgpack widths; some records cut, extended or given another tag."""
    count = draw(st.integers(1, 4))
    group = draw(st.sampled_from(["g-1", "G_x.y@z+w=v-u", "a" * 128]))
    seq = draw(st.sampled_from([1, 1, 2, 1000, 2**32, 2**63 - 5, 1, 2**64 - 5]))
    prev = bytes(32)
    heads = {group: (seq - 1, prev)} if draw(st.integers(0, 9)) != 5 else {}
    records = []
    for number in range(count):
        this = seq + number
        effects = [
            [draw(st.sampled_from(["a:1", "workitem:wi-1", "x", "", "k\x00y", "\u00e9:\U0001f600"])),
             draw(st.sampled_from([1, 1, 2, 7, 1, 2**63 - 1, 1, 2**63, 2, 2**64 - 1])), draw(states)]
            for _ in range(draw(st.integers(0, 3)))
        ]
        digest = bytes([number + 1]) * 32
        fields = [
            group, this, f"{group}:{this}", draw(st.sampled_from(["workitem.claim", "k", "\u00e9"])),
            draw(st.sampled_from(["workitem:wi-1", "", "x" * 300])), draw(st.sampled_from([0, 1, 5, 2**63 - 1, 3, 2**64 - 1])),
            draw(st.sampled_from(["owner", "o" * 128, "a@b"])), draw(st.sampled_from(["a-1", "x.y", "A_9"])), bytes(range(32)),
            draw(st.sampled_from([0, 1_700_000_000_000, 7, 2**63 - 1, 9, 2**64 - 1])), draw(st.booleans()),
            draw(st.none() | st.dictionaries(st.text(max_size=4), state_values, max_size=3)), effects, bytes(32), prev, digest,
        ]
        if draw(st.integers(0, 4)) == 0:  # one field of any type
            fields[draw(st.integers(0, 15))] = draw(st.sampled_from(ODD_FIELD_VALUES) | state_values)
        if draw(st.integers(0, 9)) == 0:
            fields.append(draw(state_scalars))
        record = b"E" + _pack(fields, random.Random(draw(st.integers(0, 2**32))))
        shape = draw(st.integers(0, 19))
        if shape == 0:
            record = record[: draw(st.integers(0, len(record) - 1))]
        elif shape == 1:
            record += b"\xc0"
        elif shape == 2:
            record = draw(st.sampled_from([b"A", b"R", b"G", b"S", b"X", b""])) + record[1:]
        records.append(record)
        prev = digest if draw(st.integers(0, 9)) else bytes(32)
    return records, heads


@pytest.fixture(scope="module")
def empty_index(tmp_path_factory):
    index = Index(str(tmp_path_factory.mktemp("index")), map_size=64 * 1024 * 1024)
    yield index
    index.close()


@differential(150)
@given(event_records())
def test_index_entries_agree_with_the_python_reference(empty_index, drawn):
    """What redo indexes (C for the plain Events, the reference for each record C hands back)
    means what the reference alone indexes, or both raise the same Corruption (reason, offset).
    C copies a record's own msgpack where the reference re-encodes it, so bytes may differ only
    for non-shortest encodings."""
    records, heads = drawn
    python, c = index_paths(empty_index, records, heads)
    assert index_meaning(c) == index_meaning(python)


@differential(80)
@given(event_records())
def test_shortest_encodings_index_byte_for_byte(empty_index, drawn):
    """Records as the engine writes them (msgspec's shortest forms): the same bytes either way."""
    records, heads = drawn
    plain = []
    for record in records:
        try:
            plain.append(record[:1] + msgspec.msgpack.encode(msgspec.msgpack.decode(record[1:])))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
            plain.append(record)
    python, c = index_paths(empty_index, plain, heads)
    assert index_bytes(c) == index_bytes(python)


def _plain_event(**changes) -> bytes:
    fields = dict(group="g-1", seq=1, event_id="g-1:1", kind="k", aggregate="a:1", revision=0, actor="owner",
                  action_id="a-1", content_hash=bytes(32), accepted_at_ms=0, authoritative=True, body=None, effects=[],
                  payload_hash=bytes(32), prev_hash=bytes(32), hash=b"\x01" * 32)
    fields.update(changes)
    return b"E" + encode_event(Event(**fields))


@pytest.mark.parametrize("group", ["", "a/b", "g" * 600])
@pytest.mark.parametrize("seq", [1, 2])
def test_an_event_whose_group_is_no_id_is_corruption_before_its_head_is_read(empty_index, group, seq):
    """Found here: a record whose Group was "" made the reference read the head under an empty
    key, and redo raised lmdb.BadValsizeError instead of the typed CORRUPTION (C hands such a
    record to the reference, so both paths raised it). The Group is checked first now."""
    records = [_plain_event(group=group, seq=seq, event_id=f"{group}:{seq}")]
    python, c = index_paths(empty_index, records)
    assert python == c == ("Corruption", "decode", 0)


# == the AgentStore's runs: _apply_c against admit_trusted_event / _fully_valid_run ================


class _Event(Event):
    pass


class _Effect(Effect):
    pass


AGENT_GROUP = "g-1"
AGENT_EVENTS = workload(AGENT_GROUP, 10, seed=11)
EVENT_FIELDS = [name for name in Event.__struct_fields__]
ODD_AGGREGATES = ["a:1", "workitem:w1", "k" * 65 + ":x", "k:" + "x" * 129, "k" * 100 + ":" + "x" * 150, "a:b:c", "A:1",
                  "a:.x", "a:", ":x", "a", "", "a:\ud800", _Str("a:1"), 7, None]
any_value = st.one_of(
    st.sampled_from(ODD_VALUES + INT_EDGES + FLOAT_EDGES + SURROGATES + ODD_AGGREGATES),
    st.sampled_from([True, False, None, b"", b"\x00" * 31, b"\x00" * 32, b"\x00" * 33, "g-1", "g-1:5", "g-2", ""]),
    st.builds(bytes, st.binary(min_size=32, max_size=32)),
    canonical_values,
)
effects_values = st.lists(
    st.one_of(
        st.builds(Effect, st.sampled_from(ODD_AGGREGATES), st.sampled_from([1, 0, -1, 2**63, True, 1.0, "1"]),
                  st.none() | canonical_values),
        st.builds(_Effect, st.just("a:1"), st.just(1), st.none()),
        st.sampled_from([("a:1", 1, None), ["a:1", 1, None], None]),
    ),
    max_size=3,
) | st.sampled_from([(), None, "a:1"])


def _reseal(event):
    """``event`` with its payload hash and hash recomputed where they can be at all."""
    try:
        event = msgspec.structs.replace(event, payload_hash=payload_hash_of(event.body))
    except Exception:
        pass
    try:
        event = msgspec.structs.replace(event, hash=recompute_event_hash(event))
    except Exception:
        pass
    return event


@st.composite
def spoiled_runs(draw):
    """A Group's chain with one Event's fields replaced by values of any type (then resealed, so
    that only the checks of the fields reach a verdict), or the Event replaced by another type."""
    events = list(AGENT_EVENTS)
    at = draw(st.integers(0, len(events) - 1))
    event = events[at]
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(EVENT_FIELDS))
        value = draw(effects_values if name == "effects" else any_value)
        event = msgspec.structs.replace(event, **{name: value})
    how = draw(st.integers(0, 9))
    if how < 7:
        event = _reseal(event)
    elif how == 7:
        event = _Event(*(getattr(event, name) for name in EVENT_FIELDS))
    elif how == 8:
        event = encode_event(AGENT_EVENTS[at])
    events[at] = event
    return events


def _python_trusted_run(events, start, group, seq, prev_hash):
    """The Events of events[start:] that apply() in trusted mode applies as the next ones of
    ``group`` (seq, prev_hash on), and the writes of _apply_next for them."""
    inbox, states = {}, {}
    prefix = group.encode() + b"\x00"
    index = start
    for event in events[start:]:
        if type(event) is not Event:
            break
        try:
            admit_trusted_event(event)
        except EventInvalid:
            break
        if event.group != group or event.seq != seq or event.prev_hash != prev_hash:
            break
        inbox[prefix + event.seq.to_bytes(8, "big")] = event.hash
        for effect in event.effects:
            states[prefix + effect.aggregate.encode()] = (effect.revision, effect.state)
        prev_hash, seq, index = event.hash, seq + 1, index + 1
    return index, inbox, states


def _c_run(events, start, group, seq, prev_hash):
    inbox: dict = {}
    states: dict = {}
    stop = agent_store._apply_run(events, start, agent_store._RUN_CONTEXT, group, group.encode() + b"\x00", seq, prev_hash,
                                  inbox, states, 1 << 30)
    return stop, inbox, states


@differential(250)
@given(spoiled_runs())
def test_check_run_ends_where_its_python_definition_ends(events):
    c_end = check_run(events, 0, _CHECK_CONTEXT, AGENT_GROUP, 1, ZERO_HASH)
    assert c_end == _fully_valid_run(events, 0, AGENT_GROUP, 1, ZERO_HASH)


@differential(250)
@given(spoiled_runs())
def test_the_trusted_c_run_takes_only_what_apply_takes_and_writes_the_same(events):
    """C may leave an Event to apply() that apply() would take (a key only the Python rule
    accepts); it must never take one apply() refuses, and what it takes it writes the same."""
    stop, inbox, states = _c_run(events, 0, AGENT_GROUP, 1, ZERO_HASH)
    py_stop, py_inbox, py_states = _python_trusted_run(events, 0, AGENT_GROUP, 1, ZERO_HASH)
    assert stop <= py_stop
    taken = _python_trusted_run(events[:stop], 0, AGENT_GROUP, 1, ZERO_HASH)
    assert (inbox, states) == taken[1:]
    if stop < py_stop:  # only a key the C rule is stricter on
        aggregates = [effect.aggregate for effect in events[stop].effects]
        assert any(not (kind_ok(a.partition(":")[0]) and id_ok(a.partition(":")[2])) for a in aggregates)


def test_check_run_and_run_survive_arguments_of_every_type():
    """Each argument replaced by a value of another type: a typed error or an answer, never a
    crash (the earlier tests cover the shapes; these are the values in between)."""
    events = list(AGENT_EVENTS)
    run_args = [events, 1, agent_store._RUN_CONTEXT, AGENT_GROUP, b"g-1\x00", 2, events[0].hash, {}, {}, 100]
    check_args = [events, 1, _CHECK_CONTEXT, AGENT_GROUP, 2, events[0].hash]
    odd = ODD_VALUES + [None, -1, 2**63, 2**64, -(2**63), "", "\ud800", b"", [], (), {}, set(), 1.5, True]
    for function, good in ((agent_store._apply_run, run_args), (check_run, check_args)):
        for position in range(len(good)):
            for value in odd:
                arguments = list(good)
                arguments[position] = value
                if position in (7, 8) and function is agent_store._apply_run:
                    arguments[position] = value if type(value) is not dict else {}
                try:
                    result = function(*arguments)
                except (TypeError, ValueError, OverflowError, SystemError) as exc:
                    assert not isinstance(exc, SystemError), (position, value, exc)
                else:
                    assert type(result) is int and 0 <= result <= len(events)


# == the LMDB structural check: what it passes, LMDB reads without crashing =======================

# The check (csrc/lmdb_check.c) has no Python twin: its definition is LMDB itself, which trusts
# every page it reads. A file the check passes must be one LMDB (and the binding, which touches
# every page of a value it returns) reads to the end without a crash; what it reads may be wrong
# (the stores' seals catch that). The child process reads each damaged copy the check passed; a
# SIGBUS or SIGSEGV there fails the test with the copy's seed.
_LMDB_CHILD = textwrap.dedent(
    """
    import os, random, sys, lmdb
    sys.path[:0] = sys.argv[3:]
    from test_lmdb_check import PAGE, _reachable
    from mwpstore._lmdb_check import check_lmdb_file
    from mwpstore.errors import Corruption
    source, count = sys.argv[1], int(sys.argv[2])
    data = open(source, "rb").read()
    pages = sorted(_reachable(data)) + [0, 1]
    target = os.path.join(os.path.dirname(os.path.dirname(source)), "damaged")
    os.makedirs(target, exist_ok=True)
    passed = refused = 0
    for seed in range(count):
        rng = random.Random(seed)
        damaged = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            at = rng.choice(pages) * PAGE + rng.randrange(PAGE if rng.random() < 0.7 else 64)
            if rng.random() < 0.8:
                damaged[at] ^= 1 << rng.randrange(8)
            else:
                damaged[at] = rng.choice((0, 0xFF, rng.randrange(256)))
        with open(os.path.join(target, "data.mdb"), "wb") as handle:
            handle.write(damaged)
        try:
            check_lmdb_file(os.path.join(target, "data.mdb"), label="test", remedy="-")
        except Corruption:
            refused += 1
            continue
        print("reading", seed, flush=True)
        try:
            env = lmdb.open(target, readonly=True, lock=False, max_dbs=8, map_size=1 << 26)
            try:
                with env.begin() as txn:
                    names = [bytes(key) for key, _ in txn.cursor()]
                for name in names:
                    with env.begin() as txn:
                        db = env.open_db(name, txn=txn, create=False)
                        for key, value in txn.cursor(db=db):
                            bytes(key), bytes(value)
            finally:
                env.close()
        except lmdb.Error:
            pass
        passed += 1
    print("done", passed, refused, flush=True)
    """
)


def test_what_the_lmdb_check_passes_lmdb_reads_without_crashing(tmp_path):
    from test_lmdb_check import _sample_env

    source = _sample_env(str(tmp_path / "env"))
    tests_directory = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", _LMDB_CHILD, source, "200", tests_directory, os.path.dirname(tests_directory)],
        capture_output=True, text=True, timeout=300,
    )
    lines = child.stdout.splitlines()
    assert child.returncode == 0, f"the child died ({child.returncode}) on copy {lines[-1:]}: {child.stderr[-2000:]}"
    done = lines[-1].split()
    assert done[0] == "done"
    passed, refused = int(done[1]), int(done[2])
    assert passed >= 40 and refused >= 20  # both outcomes occur: the draw reaches what the check reads


def test_index_c_survives_arguments_of_every_type():
    """index_events, seal, seal_items, seal_sorted and unseal with each argument replaced by a value of another
    type: a typed error or an answer, never a crash, and nothing appended on an error before the
    first record."""
    records = [_plain_event()]
    odd = ODD_VALUES + [None, -1, 2**32, 2**64, -(2**63), "", "\ud800", b"", [], (), {}, set(), 1.5, True, [b"x"], [1]]

    def sinks():
        return ({b"events": [], b"states": [], b"receipts": []}, {b"states": [], b"receipts": []})

    good = [records, [0], 0, {"g-1": (0, bytes(32))}, sinks(), (1, 2, 3)]
    for position in range(len(good)):
        for value in odd:
            arguments = [list(records), [0], 0, {"g-1": (0, bytes(32))}, sinks(), (1, 2, 3)]
            arguments[position] = value
            try:
                stop, last_ms = _index_c.index_events(*arguments)
            except (TypeError, ValueError, OverflowError, KeyError) as exc:
                assert not isinstance(exc, SystemError)
            else:
                assert 0 <= stop <= len(arguments[0]) and last_ms >= 0
    for value in odd:
        for arguments in ([value, b"v", 1], [b"k", value, 1], [b"k", b"v", value]):
            try:
                assert type(_index_c.seal(*arguments)) is bytes
            except (TypeError, ValueError, OverflowError):
                pass
        for arguments in ([value, b"k", 1, 100], [b"vvvvvvvv", value, 1, 100], [b"vvvvvvvv", b"k", value, 100],
                          [b"vvvvvvvv", b"k", 1, value]):
            try:
                result = _index_c.unseal(*arguments)
                assert result is None or type(result) is bytes
            except (TypeError, ValueError, OverflowError):
                pass
        for arguments in ([value, 1], [[value], 1], [[(b"k", value)], 1], [[(b"k", b"v")], value]):
            try:
                assert type(_index_c.seal_items(*arguments)) is list
            except (TypeError, ValueError, OverflowError):
                pass
        for arguments in ([value, 1], [{value: b"v"}, 1] if isinstance(value, Hashable) else [{}, value],
                          [{b"k": value}, 1], [{b"k": b"v"}, value], [{b"k": b"v"}, 1, value]):
            try:
                assert type(_index_c.seal_sorted(*arguments)) is list
            except (TypeError, ValueError, OverflowError):
                pass


def test_the_segment_log_reads_refuse_values_of_every_type(scratch):
    group, _ = _group(0, [b"kept"])
    _write(scratch, 0, _header(0) + group, full=True)
    with SegmentLog.open(scratch, readonly=True) as log:
        for value in ODD_VALUES + [None, -1, 2**64, -(2**63), 4, 8, 10**30, "", "0", 1.0, True]:
            for call in (lambda: log.read(value), lambda: list(log.scan(value)), lambda: list(log.scan(0, end=value)),
                         lambda: list(log.scan(0, batch_records=value))):
                try:
                    call()
                except (InvalidCommand, Corruption):
                    pass
