"""A pure-Python reader of the segment format, written from ``docs/format/segment.md`` alone.

It shares no code with the C core and is slow on purpose (a table-driven CRC, one frame at a
time): it exists so tests can run the same bytes through both readers and require the same
records, or the same error at the same place (tests/test_segment_reference.py). It never writes;
it reads a log the way ``SegmentLog.open(directory, readonly=True)`` followed by a full scan does.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from mwpstore.errors import Corruption

__all__ = ["ReferenceLog", "crc32c", "read_log"]

# -- the format, as numbers (docs/format/segment.md) ---------------------------------------------
MAGIC = b"MWPSEG\r\n"
FORMAT_VERSION = 1
SEGMENT_HEADER_BYTES = 64
FRAME_HEADER_BYTES = 16
FRAME_ALIGN_BYTES = 8
LENGTH_BITS = 28
KIND_RECORD, KIND_COMMIT, KIND_SEAL = 1, 2, 3
COMMIT_FRAME_BYTES = 32
SEAL_FRAME_BYTES = 32
PAYLOAD_BYTES_CONTROL = 16
COMMIT_DAMAGE_BITS_MAX = 2
RECORD_BYTES_MAX = 16 * 1024 * 1024
GROUP_RECORDS_MAX = 65536
SEGMENT_BYTES_MIN = 64 * 1024
SEGMENT_BYTES_MAX = 1024 * 1024 * 1024
FIRST_POSITION_MAX = 2**63 - 1
_SEGMENT_NAME = re.compile(r"([0-9]{20})\.seg\Z")  # 20 ASCII digits, then ".seg" and nothing more
BULK_FILE_NAME = "BULK"  # in the log's directory while a bulk-mode writer has (or had, before a crash) the log open


def _make_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C, streaming like the C one: crc32c(b, crc32c(a)) == crc32c(a + b)."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def frame_bytes(length: int) -> int:
    return (FRAME_HEADER_BYTES + length + FRAME_ALIGN_BYTES - 1) // FRAME_ALIGN_BYTES * FRAME_ALIGN_BYTES


@dataclass
class _Header:
    log_id: int
    first_position: int
    segment_bytes: int
    seed: int


class _Damage(Exception):
    def __init__(self, reason: str, offset: int, position: int) -> None:
        super().__init__(reason)
        self.reason, self.offset, self.position = reason, offset, position


def decode_header(data: bytes) -> _Header:
    """The header's fields, or _Damage (checks in the documented order)."""
    if len(data) < SEGMENT_HEADER_BYTES:
        raise _Damage("header_short", 0, 0)
    if data[:8] != MAGIC:
        raise _Damage("header_magic", 0, 0)
    if struct.unpack_from("<I", data, 60)[0] != crc32c(data[:60]):
        raise _Damage("header_checksum", 60, 0)
    version, header_bytes, log_id, first, segment_bytes = struct.unpack_from("<IIQQQ", data, 8)
    if version != FORMAT_VERSION:
        raise _Damage("header_version", 8, 0)
    if (
        header_bytes != SEGMENT_HEADER_BYTES
        or not SEGMENT_BYTES_MIN <= segment_bytes <= SEGMENT_BYTES_MAX
        or segment_bytes % 4096
        or first % FRAME_ALIGN_BYTES
        or first > FIRST_POSITION_MAX
        or any(data[40:60])
    ):
        raise _Damage("header_field", 0, 0)
    return _Header(log_id, first, segment_bytes, crc32c(struct.pack("<Q", log_id)))


@dataclass
class _Frame:
    kind: int
    length: int
    checksum: int
    size: int
    payload: bytes


def _parse(data: bytes, limit: int, header: _Header, offset: int, position: int) -> tuple[str, _Frame | None, str, bool]:
    """('ok'|'end'|'bad', frame, reason, checksum_ok) for the frame expected at offset."""
    if offset >= limit:
        return "end", None, "", False
    if limit - offset < FRAME_HEADER_BYTES:
        return ("end", None, "", False) if not any(data[offset:limit]) else ("bad", None, "frame_truncated", False)
    if not any(data[offset : offset + FRAME_HEADER_BYTES]):
        return "end", None, "", False
    checksum, length_kind, frame_position = struct.unpack_from("<IIQ", data, offset)
    kind, length = length_kind >> LENGTH_BITS, length_kind & ((1 << LENGTH_BITS) - 1)
    if length > RECORD_BYTES_MAX:
        return "bad", None, "frame_length", False
    size = frame_bytes(length)
    if size > limit - offset:
        return "bad", None, "frame_truncated", False
    if crc32c(data[offset + 4 : offset + size], header.seed) != checksum:
        return "bad", None, "frame_checksum", False
    frame = _Frame(kind, length, checksum, size, data[offset + 16 : offset + 16 + length])
    if kind not in (KIND_RECORD, KIND_COMMIT, KIND_SEAL):
        return "bad", frame, "frame_kind", True
    if kind != KIND_RECORD and length != PAYLOAD_BYTES_CONTROL:
        return "bad", frame, "frame_length", True
    if frame_position != position:
        return "bad", frame, "frame_position", True
    return "ok", frame, "", True


def _commit_bytes(header: _Header, position: int, group_start: int, records: int, group_checksum: int) -> bytes:
    body = struct.pack("<IQQII", KIND_COMMIT << LENGTH_BITS | PAYLOAD_BYTES_CONTROL, position, group_start, records, group_checksum)
    return struct.pack("<I", crc32c(body, header.seed)) + body


def _commit_matches(frame: _Frame, group_start: int, records: int, group_checksum: int) -> bool:
    return records >= 1 and struct.unpack("<QII", frame.payload) == (group_start, records, group_checksum)


def _seal_matches(frame: _Frame, header: _Header, position: int) -> bool:
    return struct.unpack("<QQ", frame.payload) == (header.first_position, position)


def _offset(header: _Header, position: int) -> int:
    return SEGMENT_HEADER_BYTES + position - header.first_position


@dataclass
class _Recovery:
    end_position: int
    sealed: bool
    records: list[tuple[int, bytes]]


def recover(data: bytes, header: _Header, bulk: bool = False) -> _Recovery:
    """Find where the committed frames of a segment end ("Torn tail"), or raise _Damage.

    ``bulk``: the log's directory holds the bulk-mode file, and only a damaged group's own commit
    frame or a seal proves its write completed ("Bulk mode")."""
    limit = min(len(data), header.segment_bytes)
    position, records = header.first_position, []
    while True:
        group_start, group, group_checksum = position, [], header.seed
        while True:
            status, frame, reason, checksum_ok = _parse(data, limit, header, _offset(header, position), position)
            if status != "ok" or frame.kind != KIND_RECORD or len(group) == GROUP_RECORDS_MAX:
                break
            group.append((position, frame.payload))
            group_checksum = crc32c(struct.pack("<I", frame.checksum), group_checksum)
            position += frame.size
        offset = _offset(header, position)
        if status == "ok" and frame.kind == KIND_COMMIT:
            if not _commit_matches(frame, group_start, len(group), group_checksum):
                raise _Damage("commit_mismatch", offset, position)
            records += group
            position += COMMIT_FRAME_BYTES
            continue
        if status == "ok" and frame.kind == KIND_SEAL:
            if group or not _seal_matches(frame, header, position):
                raise _Damage("seal_mismatch", offset, position)
            return _Recovery(position, True, records)
        if status == "ok":
            raise _Damage("group_too_many", offset, position)
        if status == "end" and not group:
            # zeros where a group would start: the end, unless a later group's commit (or a seal) shows
            # that groups were written there
            if not bulk and _completed_write_follows(data, limit, header, offset + FRAME_ALIGN_BYTES, group_start, which="later"):
                raise _Damage("group_damaged", offset, position)
            return _Recovery(group_start, False, records)
        if status == "bad" and checksum_ok:
            raise _Damage(reason, offset, position)
        if group:
            expected = _commit_bytes(header, position, group_start, len(group), group_checksum)
            actual = data[offset : min(offset + COMMIT_FRAME_BYTES, limit)]
            distance = sum(bin(a ^ b).count("1") for a, b in zip(actual, expected)) + 8 * (COMMIT_FRAME_BYTES - len(actual))
            if distance <= COMMIT_DAMAGE_BITS_MAX:
                raise _Damage("commit_damaged", offset, position)
        if _completed_write_follows(data, limit, header, offset + FRAME_ALIGN_BYTES, group_start, which="own" if bulk else "any"):
            raise _Damage("group_damaged", offset, position)
        return _Recovery(group_start, False, records)


def _completed_write_follows(data: bytes, limit: int, header: _Header, start: int, group_start: int, *, which: str) -> bool:
    """An intact commit record at its own position ("own": naming group_start, "later": naming
    another group, "any") or an intact seal after ``start``."""
    candidate = (start + FRAME_ALIGN_BYTES - 1) // FRAME_ALIGN_BYTES * FRAME_ALIGN_BYTES
    while candidate + COMMIT_FRAME_BYTES <= limit:
        position = header.first_position + candidate - SEGMENT_HEADER_BYTES
        if struct.unpack_from("<Q", data, candidate + 8)[0] == position:
            status, frame, _, _ = _parse(data, limit, header, candidate, position)
            named = struct.unpack_from("<Q", frame.payload)[0] if status == "ok" and frame.kind == KIND_COMMIT else None
            if named is not None and (which == "any" or (which == "own") == (named == group_start)):
                return True
            if status == "ok" and frame.kind == KIND_SEAL and _seal_matches(frame, header, position):
                return True
        candidate += FRAME_ALIGN_BYTES
    return False


@dataclass
class ReferenceLog:
    records: list[tuple[int, bytes]]
    end: int


def _corruption(path: str, damage: _Damage, position: int | None = None) -> Corruption:
    return Corruption(
        f"segment {path} is damaged at offset {damage.offset}: {damage.reason}",
        segment=path, offset=damage.offset, position=damage.position if position is None else position,
        reason=damage.reason,
    )


def read_log(directory: str) -> ReferenceLog:
    """Every committed record of the log in ``directory``, or the Corruption a reader must raise."""
    directory = os.path.abspath(directory)
    numbered = sorted((int(m.group(1)), name) for name in os.listdir(directory) if (m := _SEGMENT_NAME.match(name)))
    segments: list[tuple[str, _Header, bytes]] = []
    for number, name in numbered:
        path = os.path.join(directory, name)
        if number > FIRST_POSITION_MAX:  # no header may hold it: misnamed, whatever the file holds
            raise Corruption("a segment name past every position", segment=path, offset=0, position=number, reason="segment_name")
        with open(path, "rb") as file:
            data = file.read()
        try:
            header = decode_header(data[:SEGMENT_HEADER_BYTES])
        except _Damage as damage:
            raise _corruption(path, damage, number) from None
        if header.first_position != number:
            raise Corruption("segment name and header disagree", segment=path, offset=24, position=number, reason="segment_name")
        segments.append((path, header, data))
    if not segments:
        return ReferenceLog([], 0)
    if segments[0][1].first_position != 0:
        raise Corruption("earlier segments are missing", segment=segments[0][0], offset=0, position=0, reason="segment_missing")
    for (path, header, data), (later_path, later, _) in zip(segments, segments[1:]):
        if later.log_id != header.log_id:
            raise Corruption("another log's segment", segment=later_path, offset=16, position=later.first_position, reason="log_id_mismatch")
        position = later.first_position
        offset = _offset(header, position)
        fits = header.first_position < position and position - header.first_position <= header.segment_bytes - SEGMENT_HEADER_BYTES - SEAL_FRAME_BYTES
        status, frame, _, _ = _parse(data, len(data), header, offset, position) if fits else ("bad", None, "", False)
        if status != "ok" or frame.kind != KIND_SEAL or not _seal_matches(frame, header, position):
            raise Corruption(
                "a segment is missing or damaged", segment=path, offset=offset if fits else 0, position=position, reason="segment_missing"
            )
    last_path, last_header, last_data = segments[-1]
    try:
        tail = recover(last_data, last_header, bulk=os.path.lexists(os.path.join(directory, BULK_FILE_NAME)))
    except _Damage as damage:
        raise _corruption(last_path, damage) from None
    records: list[tuple[int, bytes]] = []
    for (path, header, data), (_, later, _) in zip(segments, segments[1:]):
        try:
            records += _read_sealed(data[: _offset(header, later.first_position) + SEAL_FRAME_BYTES], header)
        except _Damage as damage:
            raise _corruption(path, damage) from None
    return ReferenceLog(records + tail.records, tail.end_position)


def _read_sealed(data: bytes, header: _Header) -> list[tuple[int, bytes]]:
    """A sealed segment read strictly from its start: any frame that fails is damage."""
    position, records = header.first_position, []
    group_start, group, group_checksum = position, 0, header.seed
    end_position = header.first_position + len(data) - SEGMENT_HEADER_BYTES
    while position < end_position:
        offset = _offset(header, position)
        status, frame, reason, _ = _parse(data, len(data), header, offset, position)
        if status != "ok":
            raise _Damage("unexpected_end" if status == "end" else reason, offset, position)
        if frame.kind == KIND_RECORD:
            if group == GROUP_RECORDS_MAX:
                raise _Damage("group_too_many", offset, position)
            records.append((position, frame.payload))
            group += 1
            group_checksum = crc32c(struct.pack("<I", frame.checksum), group_checksum)
        elif frame.kind == KIND_COMMIT:
            if not _commit_matches(frame, group_start, group, group_checksum):
                raise _Damage("commit_mismatch", offset, position)
            group_start, group, group_checksum = position + COMMIT_FRAME_BYTES, 0, header.seed
        else:
            if group or not _seal_matches(frame, header, position):
                raise _Damage("seal_mismatch", offset, position)
            return records
        position += frame.size
    raise _Damage("unexpected_end", _offset(header, position), position)  # pragma: no cover - the seal was checked
