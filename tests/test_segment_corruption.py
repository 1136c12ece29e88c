"""Damage on disk: torn tails are cut, everything else is a typed Corruption error.

- every byte offset of the last frames cut, zeroed and garbled: a valid prefix of whole groups
  or Corruption, never a wrong record;
- every single bit flip inside the last acknowledged group: Corruption (not a torn tail);
- single bit flips in sealed segments and in segment headers: 100% detected.

Set MWPSTORE_BIT_FLIPS_ALL=1 to flip every bit of a sealed segment instead of a sample.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import zlib

import pytest

from mwpstore._segment_log_c import ffi, lib
from mwpstore.errors import Corruption
from mwpstore.limits import SEGMENT_BYTES_MIN
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from segment_readers import files_of

SMALL = SEGMENT_BYTES_MIN
HEADER = lib.SL_SEGMENT_HEADER_BYTES
ALL_FLIPS = os.environ.get("MWPSTORE_BIT_FLIPS_ALL") == "1"


def frame_bytes(length: int) -> int:
    return (16 + length + 7) // 8 * 8


def build(directory: str, groups: list[list[bytes]], segment_bytes: int = SMALL) -> list[list[tuple[int, bytes]]]:
    with SegmentLog.open(directory, segment_bytes=segment_bytes) as log:
        return [list(zip(log.append(group), group)) for group in groups]


def visible(directory: str, readonly: bool = True) -> list[tuple[int, bytes]]:
    with SegmentLog.open(directory, segment_bytes=SMALL, readonly=readonly) as log:
        return [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]


def assert_prefix_of_whole_groups(seen: list[tuple[int, bytes]], groups: list[list[tuple[int, bytes]]]) -> None:
    expected: list[tuple[int, bytes]] = []
    for group in groups:
        if len(expected) >= len(seen):
            break
        expected += group
    assert seen == expected


def outcome(directory: str, groups, readonly: bool = True) -> str:
    """'prefix:<n records>' or 'corruption'; anything else fails the test."""
    try:
        seen = visible(directory, readonly)
    except Corruption as exc:
        assert exc.code == "CORRUPTION" and {"segment", "offset", "reason"} <= set(exc.detail)
        return "corruption"
    assert_prefix_of_whole_groups(seen, groups)
    return f"prefix:{len(seen)}"


def segment_paths(directory: str) -> list[str]:
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".seg"))


def damage(path: str, offset: int, data: bytes | None = None, truncate: bool = False) -> None:
    with open(path, "r+b") as file:
        if truncate:
            file.truncate(offset)
        else:
            file.seek(offset)
            file.write(data)


def flip(path: str, bit: int) -> None:
    with open(path, "r+b") as file:
        file.seek(bit // 8)
        byte = file.read(1)[0]
        file.seek(bit // 8)
        file.write(bytes([byte ^ (1 << (bit % 8))]))


def test_torn_tail_is_truncated(scratch):
    groups = build(scratch, [[b"kept"], [b"also kept", b"x" * 100]])
    path = segment_paths(scratch)[0]
    end = groups[-1][-1][0] + frame_bytes(100) + 32
    # A third group whose write tore: its first frame made it, the rest did not.
    with SegmentLog.open(scratch) as log:
        assert log.end == end
    torn = struct.pack("<IIQ", 0x12345678, (1 << 28) | 200, end) + bytes(100)
    damage(path, HEADER + end, torn)
    assert visible(scratch) == [r for g in groups for r in g]  # readonly: cut in memory only
    with open(path, "rb") as file:
        assert file.read()[HEADER + end : HEADER + end + 4] == torn[:4]
    assert visible(scratch, readonly=False) == [r for g in groups for r in g]
    with open(path, "rb") as file:
        content = file.read()
    assert content[HEADER + end :] == bytes(len(content) - HEADER - end)  # zeroed, full size
    assert len(content) == SMALL


def test_a_torn_group_is_cut_from_its_start_not_from_its_damage(scratch):
    """A torn group whose first record frame reached the disk whole: the cut starts at the group,
    so that record is zeroed too. A cut at the damaged frame would leave it behind the end, where
    every open finds the group torn again and a clean close's marker is never trusted (it wants
    zeros after the end)."""
    groups = build(scratch, [[b"kept"]])
    path = segment_paths(scratch)[0]
    end = frame_bytes(4) + 32
    with open(path, "rb") as file:
        content = file.read()
    whole_record = content[HEADER : HEADER + frame_bytes(4)]  # an intact record frame, moved to the end
    record = whole_record[:8] + struct.pack("<Q", end) + whole_record[16:]
    record = struct.pack("<I", _frame_checksum(record, content)) + record[4:]
    damage(path, HEADER + end, record + struct.pack("<IIQ", 0x12345678, (1 << 28) | 8, end + len(record)))
    assert visible(scratch, readonly=False) == groups[0]
    with open(path, "rb") as file:
        content = file.read()
    assert content[HEADER + end :] == bytes(SMALL - HEADER - end)
    with SegmentLog.open(scratch, segment_bytes=SMALL) as log:
        assert log.end == end


def _frame_checksum(frame: bytes, segment: bytes) -> int:
    """The frame checksum (docs/format/segment.md): CRC-32C of the log id bytes, then the frame
    from byte 4, for the log whose segment header is at the start of ``segment``."""
    return lib.sl_crc32c(0, segment[16:24] + frame[4:], 8 + len(frame) - 4)


def test_zeroed_preallocated_space_is_end_of_log(scratch):
    groups = build(scratch, [[b"a"], [b"b"]])
    with open(segment_paths(scratch)[0], "rb") as file:
        assert file.read()[HEADER + 2 * 64 :] == bytes(SMALL - HEADER - 128)
    assert visible(scratch, readonly=False) == [r for g in groups for r in g]


def test_stale_bytes_after_the_end_are_zeroed_on_open(scratch):
    # Bulk mode may leave a later group on disk after an earlier one was lost: never resurrect it.
    groups = build(scratch, [[b"a"]])
    path = segment_paths(scratch)[0]
    with open(path, "rb") as file:
        group = file.read()[HEADER : HEADER + 64]
    damage(path, HEADER + 64 + 4096, group)  # a complete-looking group far after a zero gap
    assert visible(scratch, readonly=False) == groups[0]
    with open(path, "rb") as file:
        assert file.read()[HEADER + 64 :] == bytes(SMALL - HEADER - 64)


@pytest.mark.parametrize("mode", ["cut", "zero_rest", "zero_byte", "garble_rest", "garble_byte"])
def test_every_offset_of_the_last_frames_gives_prefix_or_corruption(scratch, mode):
    rng = random.Random(zlib.crc32(mode.encode()))
    source = os.path.join(scratch, "source")
    groups = build(source, [[rng.randbytes(300), rng.randbytes(5)], [rng.randbytes(700)], [rng.randbytes(40), rng.randbytes(9)]])
    path = segment_paths(source)[0]
    # The last two groups: the last three record frames and two commit records.
    first = groups[1][0][0]
    last = groups[2][-1][0] + frame_bytes(9) + 32
    with open(path, "rb") as file:
        original = file.read()
    outcomes: dict[str, int] = {}
    tear_alarms: list[int] = []
    target = os.path.join(scratch, "target")
    for position in range(first, last):
        offset = HEADER + position
        os.makedirs(target)
        damaged = os.path.join(target, os.path.basename(path))
        shutil.copyfile(path, damaged)
        if mode == "cut":
            damage(damaged, offset, truncate=True)
        elif mode == "zero_rest":
            damage(damaged, offset, bytes(HEADER + last - offset))
        elif mode == "zero_byte":
            damage(damaged, offset, b"\x00")
        elif mode == "garble_rest":
            damage(damaged, offset, rng.randbytes(HEADER + last - offset))
        else:
            damage(damaged, offset, bytes([original[offset] ^ rng.randrange(1, 256)]))
        result = outcome(target, groups)
        outcomes[result] = outcomes.get(result, 0) + 1
        if result == "corruption" and offset % 512 == 0 and mode in ("cut", "zero_rest", "garble_rest"):
            tear_alarms.append(offset)
        if result != "corruption" and rng.random() < 0.1:
            assert outcome(target, groups, readonly=False) == result  # the writer's open agrees
        shutil.rmtree(target)
    if mode in ("zero_byte", "garble_byte"):
        # A changed byte inside a complete group is damage, and is reported as such, except in
        # a commit record where the change looks like a tear at a sector boundary (there the
        # group is dropped: see "Torn tail" in docs/format/segment.md).
        changed = sum(1 for p in range(first, last) if mode == "garble_byte" or original[HEADER + p] != 0)
        assert outcomes.get("corruption", 0) >= 0.85 * changed, outcomes
    else:
        # From a sector boundary on, this is exactly what a torn write leaves: never an alarm.
        assert not tear_alarms, tear_alarms


def test_every_bit_flip_in_the_last_acknowledged_group_is_corruption(scratch):
    source = os.path.join(scratch, "source")
    groups = build(source, [[b"first group"], [b"last group, record one", b"and record two" * 3]])
    path = segment_paths(source)[0]
    first = groups[1][0][0]
    last = groups[1][-1][0] + frame_bytes(len(b"and record two" * 3)) + 32
    target = os.path.join(scratch, "target")
    for bit in range((HEADER + first) * 8, (HEADER + last) * 8):
        os.makedirs(target)
        damaged = os.path.join(target, os.path.basename(path))
        shutil.copyfile(path, damaged)
        flip(damaged, bit)
        assert outcome(target, groups) == "corruption", f"bit {bit} (byte {bit // 8 - HEADER - first} of the group)"
        if bit % 97 == 0:
            assert outcome(target, groups, readonly=False) == "corruption"
            with open(damaged, "rb") as file:
                assert len(file.read()) == SMALL  # nothing was truncated
        shutil.rmtree(target)


def test_two_bit_flips_in_the_last_commit_record_are_commit_damaged(scratch):
    """docs/format/segment.md: a commit record within 2 flipped bits of the expected one is
    corruption. Only single flips were tested, so a bound of 1 would have passed while dropping
    an acknowledged group with two flipped bits in its commit record as a torn tail."""
    rng = random.Random(8)
    source = os.path.join(scratch, "source")
    groups = build(source, [[b"first group"], [b"last group", b"x" * 50]])
    path = segment_paths(source)[0]
    commit = HEADER + groups[1][-1][0] + frame_bytes(50)
    bits = range(commit * 8, (commit + 32) * 8)
    pairs = [tuple(rng.sample(bits, 2)) for _ in range(150)] + [(bit, bit + 1) for bit in bits[:-1:9]]
    target = os.path.join(scratch, "target")
    for first_bit, second_bit in pairs:
        os.makedirs(target)
        damaged = os.path.join(target, os.path.basename(path))
        shutil.copyfile(path, damaged)
        flip(damaged, first_bit)
        flip(damaged, second_bit)
        with pytest.raises(Corruption) as caught:
            visible(target)
        assert caught.value.detail["reason"] == "commit_damaged", (first_bit - commit * 8, second_bit - commit * 8)
        shutil.rmtree(target)
    os.makedirs(target)
    damaged = os.path.join(target, os.path.basename(path))
    shutil.copyfile(path, damaged)
    flip(damaged, commit * 8 + 3)
    flip(damaged, commit * 8 + 200)
    assert outcome(target, groups, readonly=False) == "corruption"
    with open(damaged, "rb") as file:
        assert len(file.read()) == SMALL  # nothing was truncated


def test_damage_before_the_seal_of_a_last_sealed_segment_is_corruption(scratch):
    """A crash between sealing a segment and creating the next leaves the sealed segment last, its
    file ending right after the seal. Damage in its last group is followed by that intact seal,
    which proves the write completed: group_damaged, never a torn tail cut off together with the
    seal. Here the damage is the group's commit record itself (8 bits), so only the seal tells.
    The search for a completed write has to reach a frame that ends where the file ends; one
    that stopped a frame short took the damage as a tear and the writer cut the segment."""
    source = os.path.join(scratch, "source")
    groups = build(source, [[bytes([index]) * 900] for index in range(80)])
    paths = segment_paths(source)
    assert len(paths) >= 2
    os.remove(paths[-1])
    os.remove(os.path.join(source, CLEAN_FILE_NAME))
    with open(paths[-2], "rb") as file:
        original = file.read()
    first = int(os.path.basename(paths[-2])[:20])
    seal_position = first + len(original) - HEADER - 32
    last_record = HEADER + max(p for g in groups for p, _ in g if p < seal_position) - first
    assert last_record + frame_bytes(900) + 32 == len(original) - 32  # the last group, then the seal
    commit = last_record + frame_bytes(900)
    for readonly in (True, False):
        # Eight bits of the commit record: no intact commit follows, only the seal.
        damage(paths[-2], commit + 20, bytes([original[commit + 20] ^ 0xFF]))
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(source, segment_bytes=SMALL, readonly=readonly)
        assert caught.value.detail["reason"] == "group_damaged"
        with open(paths[-2], "rb") as file:
            assert len(file.read()) == len(original)  # nothing was cut


def test_a_commit_frame_in_the_place_of_a_seal_is_not_a_seal(scratch):
    """A sealed segment's last frame must be a seal. A commit frame there whose payload holds the
    seal's two positions, with a checksum that holds, matches a seal field by field: only its kind
    tells it apart. The open that inspects every segment and the first mapping of a segment a
    clean close vouched for both check that frame, and both report the segment that should have
    been sealed there (segment_missing, at the frame's offset)."""
    source = os.path.join(scratch, "source")
    build(source, [[bytes([index]) * 900] for index in range(80)])
    paths = segment_paths(source)
    assert len(paths) >= 2
    with open(paths[0], "rb") as file:
        content = file.read()
    seal = content[-32:]
    assert struct.unpack_from("<I", seal, 4)[0] >> 28 == 3
    forged = seal[:4] + struct.pack("<I", (2 << 28) | 16) + seal[8:]
    forged = struct.pack("<I", _frame_checksum(forged, content)) + forged[4:]
    damage(paths[0], len(content) - 32, forged)
    with pytest.raises(Corruption) as caught:  # vouched by the clean marker: found at first mapping
        with SegmentLog.open(source, segment_bytes=SMALL, readonly=True) as log:
            for _ in log.scan(0):
                pass
    detail = caught.value.detail
    assert (detail["segment"], detail["offset"], detail["reason"]) == (paths[0], len(content) - 32, "segment_missing")
    os.remove(os.path.join(source, CLEAN_FILE_NAME))
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(source, segment_bytes=SMALL, readonly=readonly)
        detail = caught.value.detail
    assert (detail["segment"], detail["offset"], detail["reason"]) == (paths[0], len(content) - 32, "segment_missing")


def test_bit_flip_before_tail_is_corruption(scratch):
    rng = random.Random(5)
    source = os.path.join(scratch, "source")
    groups = build(source, [[rng.randbytes(100)] for _ in range(20)])
    path = segment_paths(source)[0]
    end = groups[-1][-1][0] + frame_bytes(100) + 32
    target = os.path.join(scratch, "target")
    for bit in rng.sample(range(HEADER * 8, (HEADER + end) * 8), 300):
        os.makedirs(target)
        damaged = os.path.join(target, os.path.basename(path))
        shutil.copyfile(path, damaged)
        flip(damaged, bit)
        assert outcome(target, groups) == "corruption"
        shutil.rmtree(target)


def sealed_segment(directory: str) -> tuple[str, bytes, list]:
    rng = random.Random(6)
    groups = build(directory, [[rng.randbytes(rng.choice((0, 5, 100, 900))) for _ in range(rng.choice((1, 3)))] for _ in range(150)])
    paths = segment_paths(directory)
    assert len(paths) >= 2
    with open(paths[0], "rb") as file:
        return paths[0], file.read(), groups


def test_every_sampled_bit_flip_in_a_sealed_segment_is_detected_by_the_c_verifier(scratch):
    path, content, _ = sealed_segment(scratch)
    header = ffi.new("struct sl_header *")
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_header_decode(content, len(content), header, fault) == lib.SL_OK
    end = ffi.new("uint64_t *")
    assert lib.sl_verify_sealed(content, len(content), header, end, fault) == lib.SL_OK
    # Every bit of every frame header, commit and seal record, plus a sample of payload bits.
    structural: list[int] = []
    offset = HEADER
    while offset < len(content):
        length_kind = struct.unpack_from("<I", content, offset + 4)[0]
        size = frame_bytes(length_kind & ((1 << 28) - 1))
        kind = length_kind >> 28
        structural += range(offset * 8, (offset + (size if kind != 1 else 16)) * 8)
        offset += size
    assert offset == len(content)
    rng = random.Random(7)
    bits = range(HEADER * 8, len(content) * 8) if ALL_FLIPS else sorted(set(structural) | set(rng.sample(range(HEADER * 8, len(content) * 8), 4000)))
    buffer = bytearray(content)
    pointer = ffi.from_buffer("uint8_t[]", buffer)
    missed = []
    for bit in bits:
        buffer[bit // 8] ^= 1 << (bit % 8)
        if lib.sl_verify_sealed(pointer, len(buffer), header, end, fault) != lib.SL_E_CORRUPT:
            missed.append(bit)
        buffer[bit // 8] ^= 1 << (bit % 8)
    assert missed == [], f"{len(missed)} of {len(bits)} flips undetected"


def test_a_sealed_segment_without_its_seal_fails_the_c_verifier(scratch):
    """Cut right before its seal, a sealed segment ends cleanly after its last commit: a recovery
    finds nothing torn, and only the missing seal tells that bytes are gone. The verifier of
    sealed segments refuses it (seal_missing at the offset where the seal belongs)."""
    path, content, _ = sealed_segment(scratch)
    header = ffi.new("struct sl_header *")
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_header_decode(content, len(content), header, fault) == lib.SL_OK
    end = ffi.new("uint64_t *")
    unsealed = content[:-32]
    assert lib.sl_verify_sealed(unsealed, len(unsealed), header, end, fault) == lib.SL_E_CORRUPT
    assert (fault.reason, fault.offset) == (lib.SL_REASON_SEAL_MISSING, len(unsealed))


def test_bit_flips_in_a_sealed_segment_are_detected_through_the_api(scratch):
    source = os.path.join(scratch, "source")
    path, content, groups = sealed_segment(source)
    rng = random.Random(8)
    target = os.path.join(scratch, "target")
    for bit in rng.sample(range(HEADER * 8, len(content) * 8), 150):
        shutil.copytree(source, target)
        damaged = os.path.join(target, os.path.basename(path))
        flip(damaged, bit)
        with pytest.raises(Corruption):
            with SegmentLog.open(target, readonly=True) as log:
                log.verify()
        # A scan that reaches the damage reports it too, naming the segment.
        with pytest.raises(Corruption) as caught:
            with SegmentLog.open(target, readonly=True) as log:
                for _ in log.scan(0):
                    pass
        assert caught.value.detail["segment"] == damaged
        shutil.rmtree(target)


def test_every_bit_flip_in_every_segment_header_is_detected(scratch):
    source = os.path.join(scratch, "source")
    sealed_segment(source)
    paths = segment_paths(source)
    target = os.path.join(scratch, "target")
    for index in (0, len(paths) - 1):  # a sealed segment and the active one
        for bit in range(HEADER * 8):
            for clean in (True, False):
                shutil.copytree(source, target)
                flip(os.path.join(target, os.path.basename(paths[index])), bit)
                if not clean:  # as after a crash: open reads every header
                    os.remove(os.path.join(target, CLEAN_FILE_NAME))
                for readonly in (True, False):
                    with pytest.raises(Corruption) as caught:
                        # After a clean close, open reads only the active segment's header; a
                        # sealed one's is checked when first mapped (here by the scan).
                        with SegmentLog.open(target, readonly=readonly) as log:
                            assert clean and index == 0, "a damaged header must be refused at open here"
                            for _ in log.scan(0):
                                pass
                    assert caught.value.detail["reason"].startswith(("header_", "segment_", "log_id"))
                shutil.rmtree(target)


def test_newer_format_version_is_refused_by_name(scratch):
    build(scratch, [[b"x"]])
    path = segment_paths(scratch)[0]
    with open(path, "rb") as file:
        header = bytearray(file.read(HEADER))
    struct.pack_into("<I", header, 8, 2)
    struct.pack_into("<I", header, 60, lib.sl_crc32c(0, bytes(header), 60))
    damage(path, 0, bytes(header))
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(scratch)
    assert caught.value.detail["reason"] == "header_version"


def test_wrong_magic_is_refused_by_name(scratch):
    build(scratch, [[b"x"]])
    damage(segment_paths(scratch)[0], 0, b"NOTASEG!")
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(scratch, readonly=True)
    assert caught.value.detail["reason"] == "header_magic"


def test_damage_is_never_truncated_by_the_writer(scratch):
    groups = build(scratch, [[b"one"], [b"two"], [b"three"]])
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))  # as after a crash: open scans the active segment
    path = segment_paths(scratch)[0]
    flip(path, (HEADER + groups[0][0][0] + 20) * 8)  # inside the first record's payload
    with open(path, "rb") as file:
        before = file.read()
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(scratch)
    assert caught.value.detail["offset"] == HEADER + groups[0][0][0]
    with open(path, "rb") as file:
        assert file.read() == before


def test_clean_open_does_not_scan_but_damage_is_still_never_served_or_truncated(scratch):
    groups = build(scratch, [[b"one"], [b"two"], [b"three"]])
    assert os.path.exists(os.path.join(scratch, CLEAN_FILE_NAME))
    path = segment_paths(scratch)[0]
    damaged = groups[2][0][0]
    flip(path, (HEADER + damaged + 20) * 8)  # inside the last acknowledged group
    with open(path, "rb") as file:
        before = file.read()
    with SegmentLog.open(scratch) as log:  # the end is known from the clean close: no scan
        assert log.end == groups[2][0][0] + frame_bytes(5) + 32
        assert log.read(groups[0][0][0]) == b"one"
        with pytest.raises(Corruption):
            log.read(damaged)
        with pytest.raises(Corruption):
            list(log.scan(0))
    with open(path, "rb") as file:
        assert file.read() == before  # nothing truncated
    with SegmentLog.open(scratch) as log:  # appending drops the marker first ...
        log.append([b"four"])
        assert not os.path.exists(os.path.join(scratch, CLEAN_FILE_NAME))
    assert os.path.exists(os.path.join(scratch, CLEAN_FILE_NAME))  # ... and a clean close writes it again


def test_a_clean_marker_whose_end_has_no_commit_is_not_trusted(scratch):
    """The active segment put back from an earlier copy after a clean close: the marker's end lies
    past the copy's last group, where there are only zeros. Zeros after the end do not make the
    marker fit; a commit frame must end there too. A log that took the marker's end would append
    after a gap of zeros, which the next recovery reads as the end of the log: every group after
    the gap would be cut as a torn tail."""
    groups = build(scratch, [[b"one"], [b"two"]])
    path = segment_paths(scratch)[0]
    with open(path, "rb") as file:
        earlier = file.read()
    with SegmentLog.open(scratch, segment_bytes=SMALL) as log:
        log.append([b"three"])
    damage(path, 0, earlier)
    with SegmentLog.open(scratch, segment_bytes=SMALL) as log:
        assert log.end == groups[1][0][0] + frame_bytes(3) + 32
        groups.append(list(zip(log.append([b"four"]), [b"four"])))
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))  # as after a crash: the open scans
    assert visible(scratch) == [record for group in groups for record in group]


def test_a_damaged_or_foreign_clean_marker_means_a_full_recovery(scratch):
    groups = build(scratch, [[b"one"], [b"two"]])
    marker = os.path.join(scratch, CLEAN_FILE_NAME)
    with open(marker, "r+b") as file:
        data = bytearray(file.read())
        data[20] ^= 1  # the recorded end, now wrong: its checksum no longer matches
        file.seek(0)
        file.write(bytes(data))
    with SegmentLog.open(scratch) as log:
        assert [bytes(r) for batch in log.scan(0) for r in batch.records] == [b"one", b"two"]
        assert log.end == groups[1][0][0] + frame_bytes(3) + 32


def test_damaged_record_read_by_position_is_corruption(scratch):
    with SegmentLog.open(scratch, segment_bytes=SMALL) as log:
        positions = [log.append([b"r" * 1000])[0] for _ in range(100)]
        sealed_position = positions[3]
        path = log.segments()[0].path
    flip(path, (HEADER + sealed_position + 40) * 8)
    with SegmentLog.open(scratch, readonly=True) as log:
        with pytest.raises(Corruption) as caught:
            log.read(sealed_position)
        assert caught.value.detail["segment"] == path
        assert log.read(positions[2]) == b"r" * 1000
        assert log.read(positions[-1]) == b"r" * 1000


def _exact_copy(data: bytes):
    """``data`` in a C array of exactly its length: under AddressSanitizer (docs/reliability.md,
    "Sanitizers") a read past its end is reported, where a memory map or a bytes object (one
    terminating NUL more) would let it pass."""
    copy = ffi.new("uint8_t[]", max(1, len(data)))
    ffi.memmove(copy, data, len(data))
    return copy


def test_the_c_readers_stay_inside_damaged_buffers(scratch):
    """The readers of mapped segments (header, recovery, seal checks, record reads, scans) on
    damaged and cut segments, each in a buffer of exactly its length. Every answer is one of
    the documented codes; the sanitizer job is what sees a read past the buffer."""
    path, sealed, _ = sealed_segment(scratch)
    with open(segment_paths(scratch)[-1], "rb") as file:
        active = file.read()
    header = ffi.new("struct sl_header *")
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_header_decode(sealed, len(sealed), header, fault) == lib.SL_OK
    seal_position = header.first_position + len(sealed) - HEADER - lib.SL_SEAL_FRAME_BYTES
    starts = []
    offset = HEADER
    while offset < len(sealed):
        starts.append(offset)
        offset += frame_bytes(struct.unpack_from("<I", sealed, offset + 4)[0] & ((1 << 28) - 1))
    codes = {lib.SL_OK, lib.SL_E_CORRUPT, lib.SL_E_NOT_RECORD, lib.SL_E_ARGUMENT}
    recovery = ffi.new("struct sl_recovery *")
    decoded = ffi.new("struct sl_header *")
    status = ffi.new("int *")
    seal_fault = ffi.new("struct sl_fault *")
    end = ffi.new("uint64_t *")
    record_offset = ffi.new("uint64_t *")
    record_length = ffi.new("uint32_t *")
    state = ffi.new("struct sl_scan_state *")
    batch = 7
    positions, begins, stops = (ffi.new("uint64_t[]", batch) for _ in range(3))
    count = ffi.new("uint32_t *")
    rng = random.Random(11)
    for case in range(2000):
        content = bytearray(sealed if case % 4 else active[: rng.choice(starts) + 200])
        for _ in range(rng.choice((0, 1, 1, 2, 5))):  # flipped bits, most in frame headers
            spot = rng.choice(starts) + rng.randrange(16) if rng.random() < 0.7 else rng.randrange(len(content))
            if spot < len(content):
                content[spot] ^= 1 << rng.randrange(8)
        cut = rng.choice(starts) + rng.choice((-9, -1, 0, 1, 3, 8, 15, 16, 17, 31))
        size = len(content) if rng.random() < 0.3 else max(0, min(len(content), cut))
        data = _exact_copy(bytes(content[:size]))
        assert lib.sl_header_decode(data, size, decoded, fault) in codes
        assert lib.sl_recover(data, size, header, case % 2, recovery, fault) in codes
        assert lib.sl_verify_sealed(data, size, header, end, fault) in codes
        near = seal_position + rng.choice((-16, -8, 0, 8, 4096))
        assert lib.sl_segment_check_mapped(data, size, near, decoded, status, seal_fault, fault) in codes
        for start in rng.sample(starts, 5) + [rng.randrange(len(sealed))]:
            position = header.first_position + start - HEADER
            assert lib.sl_read_record(data, size, header, position, record_offset, record_length, fault) in codes
            state.position, state.group_known, state.group_records, state.sealed = position, 0, 0, 0
            state.group_start, state.group_checksum = position, header.seed
            for _ in range(3):
                rc = lib.sl_scan(data, size, header, 2**63, batch, state, positions, begins, stops, count, fault)
                assert rc in codes
                if rc != lib.SL_OK or count[0] == 0:
                    break
                assert all(begins[i] <= stops[i] <= size for i in range(count[0]))


# -- damage in the middle of the active segment, before intact groups ----------------------------


def _four_groups(scratch: str, sync: bool = True):
    """Four groups of one 100-byte record each; returns the groups and each group's file offset."""
    records = [bytes([65 + index]) * 100 for index in range(4)]
    with SegmentLog.open(scratch, segment_bytes=SMALL, sync=sync) as log:
        groups = [list(zip(log.append([record]), [record])) for record in records]
    return groups, [HEADER + group[0][0] for group in groups]


@pytest.mark.parametrize("short", [False, True], ids=["full_size", "file_cut_after_the_last_group"])
@pytest.mark.parametrize("zeroed", ["group", "records_and_commit_garbled"])
def test_damage_over_a_whole_group_before_intact_groups_is_corruption_not_a_clean_end(scratch, zeroed, short):
    """A zeroed block over the second of four durable groups (its record and commit frame): the
    walk found zeros where a group starts, took them for the clean end, and the writer's open
    zeroed the two intact groups after them, which had been acknowledged; a garbled group whose
    own commit frame was damaged too was cut the same way. An intact commit frame at its own
    position after the damage proves those groups were written (each only after the one before
    was durable): it is corruption, and nothing is changed."""
    groups, offsets = _four_groups(scratch)
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))  # as after a crash: the walk runs
    path = segment_paths(scratch)[0]
    length = offsets[2] - offsets[1]
    damage(path, offsets[1], bytes(length) if zeroed == "group" else bytes([0x5A]) * length)
    if short:  # a file shorter than its segment size is repaired too: the same judgement first
        os.truncate(path, offsets[3] + length)
    before = files_of(scratch)
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            visible(scratch, readonly=readonly)
        assert caught.value.detail["reason"] == "group_damaged"
        assert caught.value.detail["offset"] == offsets[1] and caught.value.detail["segment"] == path
        assert files_of(scratch) == before


def test_a_later_commit_frame_that_is_the_first_byte_not_zero_after_the_end_is_seen(scratch):
    """Zeros from the second group's start through the third group's record, the third group's
    commit frame intact and nothing but zeros after it: the first byte that is not zero after the
    clean end is that commit frame's own first byte, and the judgement starts there, not one
    alignment step past it (which would find no commit frame and cut an acknowledged group)."""
    _, offsets = _four_groups(scratch)
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))
    path = segment_paths(scratch)[0]
    third_commit = offsets[2] + frame_bytes(100)
    damage(path, offsets[1], bytes(third_commit - offsets[1]))
    damage(path, third_commit + lib.SL_COMMIT_FRAME_BYTES, bytes(SMALL - third_commit - lib.SL_COMMIT_FRAME_BYTES))
    before = files_of(scratch)
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            visible(scratch, readonly=readonly)
        assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", offsets[1])
        assert files_of(scratch) == before


@pytest.mark.parametrize("zeroed", ["group", "records_and_commit_garbled"])
def test_a_log_a_bulk_mode_writer_had_open_cuts_such_damage_as_a_torn_tail(scratch, zeroed):
    """In bulk mode groups are not synced one by one, so after a power loss a later group may be on
    disk and an earlier one not (read back as zeros): while BULK is there, only a group's own
    commit frame or a seal proves it, and the open cuts back to the last whole group as the
    documented bulk-mode loss. A writer's open without bulk mode then removes BULK, so the strict
    rules hold from there on."""
    groups, offsets = _four_groups(scratch, sync=False)
    assert not os.path.exists(os.path.join(scratch, "BULK"))  # a bulk-mode close syncs, then removes it
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))
    with open(os.path.join(scratch, "BULK"), "wb"):  # as after a crash of a bulk-mode writer
        pass
    length = offsets[2] - offsets[1]
    damage(segment_paths(scratch)[0], offsets[1], bytes(length) if zeroed == "group" else bytes([0x5A]) * length)
    assert visible(scratch) == groups[0]  # read-only: the same rules, nothing changed
    assert os.path.exists(os.path.join(scratch, "BULK"))
    assert visible(scratch, readonly=False) == groups[0]
    assert not os.path.exists(os.path.join(scratch, "BULK"))


def test_bulk_mode_marks_the_log_while_open_and_a_crash_leaves_the_mark(scratch):
    log = SegmentLog.open(scratch, segment_bytes=SMALL, sync=False)
    assert os.path.exists(os.path.join(scratch, "BULK"))  # durable before the first append
    log.append([b"one"])
    log._close_quietly()  # a crash: no sync, no marker, BULK stays
    assert os.path.exists(os.path.join(scratch, "BULK"))
    with SegmentLog.open(scratch, segment_bytes=SMALL, sync=False) as reopened:  # still bulk: kept
        assert os.path.exists(os.path.join(scratch, "BULK"))
        reopened.append([b"two"])
    assert not os.path.exists(os.path.join(scratch, "BULK"))
    with SegmentLog.open(scratch, segment_bytes=SMALL) as synced:
        assert [bytes(r) for batch in synced.scan(0) for r in batch.records][-1] == b"two"
    assert not os.path.exists(os.path.join(scratch, "BULK"))


def test_the_judgement_after_a_clean_end_never_looks_before_it(scratch):
    """sl_check_after_end takes candidates only from one alignment step past the end, whatever
    from_offset says: the commit frames of the groups before the end name other groups than the
    one that would start there, and would be taken for a later group's."""
    _, offsets = _four_groups(scratch)
    with open(segment_paths(scratch)[0], "rb") as file:
        content = bytearray(file.read())
    content[offsets[3] : offsets[3] + 16] = bytes(16)  # the last group's start, its own commit after it
    header = ffi.new("struct sl_header *")
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_header_decode(bytes(content), len(content), header, fault) == lib.SL_OK
    for start in (0, HEADER, offsets[0], offsets[3]):
        assert lib.sl_check_after_end(bytes(content), len(content), header, offsets[3], start, fault) == lib.SL_OK


def test_a_last_group_whose_start_is_zero_and_whose_own_commit_is_intact_is_cut_as_a_torn_write(scratch):
    """Zeros at the start of the last group, its own commit frame intact, nothing after it: the
    shape of a last write whose later page reached the disk before its first one. Only a later
    group's commit frame (or a seal) proves a zeroed group durable, so this one is cut as a torn
    tail, as before; the groups before it stay."""
    groups, offsets = _four_groups(scratch)
    os.remove(os.path.join(scratch, CLEAN_FILE_NAME))
    damage(segment_paths(scratch)[0], offsets[3], bytes(16))  # the last group's first frame header
    expected = [record for group in groups[:3] for record in group]
    assert visible(scratch) == expected
    assert visible(scratch, readonly=False) == expected


def test_what_follows_a_clean_end_is_judged_by_which_commit_frames_come_after(scratch):
    """sl_check_after_end on the bytes of four groups: zeros over the second group are damage
    when the third group's commit frame follows, but not when only the zeroed group's own commit
    frame is left; and bytes that are no longer zero at the end (a writer appended there since
    a read-only reading saw the end) are nothing to judge."""
    _, offsets = _four_groups(scratch)
    with open(segment_paths(scratch)[0], "rb") as file:
        content = bytearray(file.read())
    header = ffi.new("struct sl_header *")
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_header_decode(bytes(content), len(content), header, fault) == lib.SL_OK

    def judge(data: bytearray, end: int, start: int) -> tuple[int, int]:
        rc = lib.sl_check_after_end(bytes(data), len(data), header, end, start, fault)
        return rc, fault.reason if rc != lib.SL_OK else 0

    second = offsets[2] - offsets[1]
    zeroed = bytearray(content)
    zeroed[offsets[1] : offsets[2]] = bytes(second)
    assert judge(zeroed, offsets[1], offsets[1] + 8) == (lib.SL_E_CORRUPT, lib.SL_REASON_GROUP_DAMAGED)
    assert fault.offset == offsets[1]
    assert judge(content, offsets[1], offsets[1] + 8) == (lib.SL_OK, 0)  # a frame at the end: not a clean end
    last = bytearray(content)
    last[offsets[3] : offsets[3] + 16] = bytes(16)  # the last group's start, its own commit after it
    assert judge(last, offsets[3], offsets[3] + 16) == (lib.SL_OK, 0)
    only_own = bytearray(zeroed)
    only_own[offsets[2] :] = bytes(len(only_own) - offsets[2])  # nothing after the zeroed group's own commit
    only_own[offsets[1] + 16 : offsets[2]] = content[offsets[1] + 16 : offsets[2]]
    assert judge(only_own, offsets[1], offsets[1] + 16) == (lib.SL_OK, 0)
