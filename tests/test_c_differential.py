"""Differential tests: every C fast path against the Python definition of the same behaviour, on
adversarial inputs the other suites rarely make.

- the segment log (csrc/segment_log.c through mwpstore/segment_log.py) against the reference
  reader (mwpstore/segment_reference.py) on logs built frame by frame, with frames whose
  checksums hold but which say the wrong thing (kind, length, position, commit, seal, header
  fields), and on hostile file names;

Each section also keeps the reproducer of every disagreement it found, as a named test. The
generated tests are derandomized (the same examples on every run) and sized to run in seconds.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mwpstore.errors import Corruption
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from mwpstore.segment_reference import crc32c, read_log

_DIFFERENTIAL = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def differential(max_examples: int) -> settings:
    """The settings of a generated test here: the same examples on every run, no deadline."""
    return settings(_DIFFERENTIAL, max_examples=max_examples)


# == the segment log: C reader against the reference reader =======================================

LOG_ID = 0x0102030405060708
SEGMENT_BYTES = 65536
RECORD, COMMIT, SEAL = 1, 2, 3


@pytest.fixture
def scratch():
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="mwpstore-differential-", dir=root)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


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


def c_reader(directory: str):
    """What the C log serves to a reader (after the scan that recovery makes: no clean marker)."""
    marker = os.path.join(directory, CLEAN_FILE_NAME)
    if os.path.exists(marker):
        os.remove(marker)
    return _c_read(directory)


def _c_read(directory: str):
    try:
        with SegmentLog.open(directory, readonly=True) as log:
            records = [(p, bytes(r)) for batch in log.scan(0, batch_records=3) for p, r in zip(batch.positions, batch.records)]
            return ("records", records, log.end)
    except Corruption as exc:
        return ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"])


def reference_reader(directory: str):
    try:
        log = read_log(directory)
        return ("records", log.records, log.end)
    except Corruption as exc:
        return ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"])


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
segments = st.lists(st.tuples(st.lists(items, max_size=5), st.sampled_from(SEAL_CHANGES)), min_size=1, max_size=3)
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
def test_readers_agree_on_logs_built_frame_by_frame(layout, damage):
    """Frames that verify but do not belong (the checksum cannot tell), on their own or with
    damage that breaks a checksum: both readers serve the same records or raise the same
    Corruption (reason, segment, offset)."""
    directory = tempfile.mkdtemp(prefix="mwpstore-differential-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        _build(directory, layout, damage)
        assert c_reader(directory) == reference_reader(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


HEADER_FORGERIES = {
    "version": dict(version=2),
    "header_bytes": dict(header_bytes=65),
    "segment_bytes_small": dict(segment_bytes=4096),
    "segment_bytes_unaligned": dict(segment_bytes=SEGMENT_BYTES + 8),
    "segment_bytes_huge": dict(segment_bytes=2**40),
    "reserved": dict(reserved=bytes(19) + b"\x01"),
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
    assert c_reader(scratch) == reference_reader(scratch)


def test_a_first_position_that_is_not_aligned_or_past_every_position(scratch):
    for first in (4, 2**63):
        for name in os.listdir(scratch):
            os.remove(os.path.join(scratch, name))
        with open(os.path.join(scratch, f"{0:020d}.seg"), "wb") as file:
            file.write(_header(first) + bytes(SEGMENT_BYTES - 64))
        result = c_reader(scratch)
        assert result == reference_reader(scratch) and result[:2] == ("corruption", "header_field")


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
    assert reference_reader(scratch) == expected
    assert c_reader(scratch) == expected


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
    assert reference_reader(scratch) == expected
    if not clean_marker:
        assert c_reader(scratch) == expected
        return
    body = struct.pack("<8sQQQQI", b"MWPCLEN2", LOG_ID, seal_at, seal_at, 2, zlib.crc32(struct.pack("<2Q", 0, seal_at)))
    with open(os.path.join(scratch, CLEAN_FILE_NAME), "wb") as file:
        file.write(body + struct.pack("<I", zlib.crc32(body)))
    assert _c_read(scratch) == expected


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
    assert c_reader(scratch) == reference_reader(scratch) == ("records", [(0, b"kept")], end)
    os.remove(os.path.join(scratch, f"{0:020d}.seg"))
    assert c_reader(scratch) == reference_reader(scratch) == ("records", [], 0)


@pytest.mark.parametrize("content", [b"", _header(0), _header(2**63)], ids=["empty", "header_of_0", "header_past_max"])
def test_a_segment_named_past_every_position_is_segment_name_in_both_readers(scratch, content):
    """Found here: for a name above 2**63 - 1 the reference decoded the file first (header_short,
    header_field, or segment_name at offset 24), where the C side refuses the name itself
    (docs/format/segment.md: segment_name)."""
    group, _ = _group(0, [b"kept"])
    _write(scratch, 0, _header(0) + group, full=True)
    name = os.path.join(scratch, "99999999999999999992.seg")
    with open(name, "wb") as file:
        file.write(content)
    expected = ("corruption", "segment_name", name, 0)
    assert reference_reader(scratch) == expected
    assert c_reader(scratch) == expected
