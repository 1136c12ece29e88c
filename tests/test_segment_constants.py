"""The numbers of the segment format agree everywhere they are written down: the C header
(csrc/segment_format.h), mwpstore/limits.py, the pure-Python reference reader, and
docs/format/segment.md. Also the CRC-32C test vectors for both C code paths."""

from __future__ import annotations

import os
import re
import struct

import pytest

from mwpstore import limits
from mwpstore import segment_reference as reference
from mwpstore._segment_log_c import ffi, lib

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "format", "segment.md")


@pytest.mark.parametrize(
    "name",
    [
        "SEGMENT_BYTES_DEFAULT",
        "SEGMENT_BYTES_MIN",
        "SEGMENT_BYTES_MAX",
        "RECORD_BYTES_MAX",
        "GROUP_RECORDS_MAX",
        "GROUP_BYTES_MAX",
        "SCAN_BATCH_RECORDS_MAX",
    ],
)
def test_c_bounds_match_limits_py(name):
    assert getattr(lib, "SL_" + name) == getattr(limits, name)


def test_reference_reader_uses_the_c_layout():
    pairs = {
        "SEGMENT_HEADER_BYTES": "SL_SEGMENT_HEADER_BYTES",
        "FRAME_HEADER_BYTES": "SL_FRAME_HEADER_BYTES",
        "FRAME_ALIGN_BYTES": "SL_FRAME_ALIGN_BYTES",
        "LENGTH_BITS": "SL_FRAME_LENGTH_BITS",
        "FORMAT_VERSION": "SL_FORMAT_VERSION",
        "KIND_RECORD": "SL_KIND_RECORD",
        "KIND_COMMIT": "SL_KIND_COMMIT",
        "KIND_SEAL": "SL_KIND_SEAL",
        "COMMIT_FRAME_BYTES": "SL_COMMIT_FRAME_BYTES",
        "SEAL_FRAME_BYTES": "SL_SEAL_FRAME_BYTES",
        "PAYLOAD_BYTES_CONTROL": "SL_COMMIT_PAYLOAD_BYTES",
        "COMMIT_DAMAGE_BITS_MAX": "SL_COMMIT_DAMAGE_BITS_MAX",
        "RECORD_BYTES_MAX": "SL_RECORD_BYTES_MAX",
        "GROUP_RECORDS_MAX": "SL_GROUP_RECORDS_MAX",
        "SEGMENT_BYTES_MIN": "SL_SEGMENT_BYTES_MIN",
        "SEGMENT_BYTES_MAX": "SL_SEGMENT_BYTES_MAX",
        "FIRST_POSITION_MAX": "SL_FIRST_POSITION_MAX",
    }
    for python_name, c_name in pairs.items():
        assert getattr(reference, python_name) == getattr(lib, c_name), python_name
    assert lib.SL_SEAL_PAYLOAD_BYTES == reference.PAYLOAD_BYTES_CONTROL


def test_header_layout_matches_the_documented_offsets():
    out = ffi.new("uint8_t[64]")
    assert lib.sl_header_encode(0x1122334455667788, 4096, 65536, out, 64) == lib.SL_OK
    raw = bytes(ffi.buffer(out, 64))
    magic, version, header_bytes, log_id, first, segment_bytes = struct.unpack_from("<8sIIQQQ", raw)
    assert magic == reference.MAGIC == b"MWPSEG\r\n"
    assert (version, header_bytes, log_id, first, segment_bytes) == (1, 64, 0x1122334455667788, 4096, 65536)
    assert raw[40:60] == bytes(20)
    assert struct.unpack_from("<I", raw, 60)[0] == reference.crc32c(raw[:60])
    assert (lib.SL_HEADER_OFFSET_LOG_ID, lib.SL_HEADER_OFFSET_FIRST_POSITION, lib.SL_HEADER_OFFSET_CHECKSUM) == (16, 24, 60)
    decoded = reference.decode_header(raw)
    assert (decoded.log_id, decoded.first_position, decoded.segment_bytes) == (0x1122334455667788, 4096, 65536)


@pytest.mark.parametrize("length,expected", [(0, 16), (1, 24), (8, 24), (9, 32), (16, 32), (17, 40)])
def test_frame_sizes_are_aligned(length, expected):
    assert lib.sl_frame_bytes(length) == reference.frame_bytes(length) == expected


@pytest.mark.parametrize(
    "data,expected",
    [
        (b"", 0x00000000),
        (b"123456789", 0xE3069283),
        (bytes(32), 0x8A9136AA),
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
        (bytes(range(31, -1, -1)), 0x113FDB5C),
    ],
)
def test_crc32c_vectors_on_both_code_paths(data, expected):
    assert lib.sl_crc32c(0, data, len(data)) == expected
    assert lib.sl_crc32c_portable(0, data, len(data)) == expected


def test_crc32c_paths_agree_on_unaligned_slices():
    data = bytes((i * 131 + 7) & 0xFF for i in range(4099))
    for start in range(9):
        for length in (0, 1, 7, 8, 9, 31, 32, 33, 100, 4000):
            piece = data[start : start + length]
            assert lib.sl_crc32c(0, piece, len(piece)) == lib.sl_crc32c_portable(0, piece, len(piece))


def test_hardware_crc_is_used_where_the_cpu_has_it():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " sse4_2" in flags and os.uname().machine == "x86_64":
        assert lib.sl_crc32c_hardware() == 1
    else:
        assert lib.sl_crc32c_hardware() in (0, 1)


def test_format_doc_states_the_same_numbers():
    text = open(DOC, encoding="utf-8").read()
    # The offset tables in the doc: "| 60 | 4 | header checksum" style rows.
    rows = {m.group(3).strip(): (int(m.group(1)), int(m.group(2))) for m in re.finditer(r"^\| (\d+) \| (\d+) \| ([^|]+)\|", text, re.M)}
    assert rows["magic"] == (0, 8)
    assert rows["version"] == (lib.SL_HEADER_OFFSET_VERSION, 4)
    assert rows["log id"] == (lib.SL_HEADER_OFFSET_LOG_ID, 8)
    assert rows["first position"] == (lib.SL_HEADER_OFFSET_FIRST_POSITION, 8)
    assert rows["segment bytes"] == (lib.SL_HEADER_OFFSET_SEGMENT_BYTES, 8)
    assert rows["header checksum"] == (lib.SL_HEADER_OFFSET_CHECKSUM, 4)
    assert rows["frame checksum"] == (0, 4)
    assert rows["length and kind"] == (4, 4)
    assert rows["frame position"] == (8, 8)
    for name in ("RECORD_BYTES_MAX", "GROUP_RECORDS_MAX", "GROUP_BYTES_MAX", "SEGMENT_BYTES_DEFAULT"):
        assert f"`{name}` = {getattr(limits, name)}" in text, name
