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
