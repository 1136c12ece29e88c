"""Rules of the C extensions (csrc/) that no other test pinned: each test names the rule it keeps.

The segment log's readers are called through cffi on exact-length buffers (test_segment_corruption's
helpers); its writer's durability steps are read off the I/O seam's recorded calls
(mwpstore/io_seam.py), since a skipped sync changes nothing a process can see until the power fails.
"""

from __future__ import annotations

import struct

from mwpstore._segment_log_c import ffi, lib
from test_segment_corruption import HEADER, _exact_copy, build, segment_paths


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
