"""Differential tests: the C reader and the pure-Python reference reader
(mwpstore/segment_reference.py) must agree on every log, damaged or not — the same records at
the same positions, or the same Corruption (reason, segment, offset)."""

from __future__ import annotations

import os
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from segment_readers import c_read_recovered, reference_read
from mwpstore._segment_log_c import lib
from mwpstore.limits import SEGMENT_BYTES_MIN
from mwpstore.segment_log import SegmentLog
from mwpstore.segment_reference import crc32c

CASES = int(os.environ.get("MWPSTORE_REFERENCE_CASES", "160"))


@given(st.binary(max_size=300), st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_crc32c_agrees_with_the_c_implementations(data, seed):
    assert crc32c(data, seed) == lib.sl_crc32c(seed, data, len(data)) == lib.sl_crc32c_portable(seed, data, len(data))


def test_crc32c_reference_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def _write_log(directory: str, rng: random.Random) -> None:
    with SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN) as log:
        for _ in range(rng.choice((0, 1, 5, 40, 90))):
            log.append([rng.randbytes(rng.choice((0, 3, 8, 60, 1000, 4000))) for _ in range(rng.choice((1, 2, 5)))])


def _damage(directory: str, rng: random.Random) -> str:
    names = sorted(name for name in os.listdir(directory) if name.endswith(".seg"))
    path = os.path.join(directory, rng.choice(names))
    with open(path, "rb") as file:
        content = bytearray(file.read())
    used = len(content.rstrip(b"\x00")) or 64
    kind = rng.choice(("flip", "flip", "flip_tail", "zero", "garble", "truncate", "remove", "none"))
    at = rng.randrange(0, used)
    if kind == "flip":
        content[at] ^= 1 << rng.randrange(8)
    elif kind == "flip_tail":  # inside the last few hundred bytes: the torn-tail logic
        at = max(0, used - rng.randrange(1, 400))
        content[at] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        content[at : at + rng.choice((1, 8, 100, 512))] = bytes(len(content[at : at + 100]))
    elif kind == "garble":
        span = rng.choice((1, 16, 300))
        content[at : at + span] = rng.randbytes(len(content[at : at + span]))
    elif kind == "truncate":
        del content[at:]
    elif kind == "remove" and len(names) > 1:
        os.unlink(path)
        return kind
    with open(path, "wb") as file:
        file.write(content)
    return kind


def test_readers_agree_on_intact_logs(scratch):
    rng = random.Random(41)
    for case in range(12):
        directory = os.path.join(scratch, str(case))
        _write_log(directory, rng)
        c_result, reference_result = c_read_recovered(directory, batch_records=7), reference_read(directory)
        assert c_result[0] == "records"
        assert c_result == reference_result


def test_readers_agree_on_damaged_logs(scratch):
    rng = random.Random(42)
    kinds: dict[tuple[str, str], int] = {}
    for case in range(CASES):
        directory = os.path.join(scratch, str(case))
        _write_log(directory, rng)
        kind = _damage(directory, rng)
        c_result, reference_result = c_read_recovered(directory, batch_records=7), reference_read(directory)
        assert c_result == reference_result, f"case {case} ({kind})"
        kinds[(kind, c_result[0])] = kinds.get((kind, c_result[0]), 0) + 1
        shutil.rmtree(directory)
    # The draw covered both outcomes.
    assert sum(n for (_, outcome), n in kinds.items() if outcome == "corruption") > CASES // 5
    assert sum(n for (_, outcome), n in kinds.items() if outcome == "records") > CASES // 10


def test_readers_agree_on_two_flipped_bits_in_the_last_commit_record(scratch):
    """docs/format/segment.md: a last commit record within 2 flipped bits of the expected one is
    commit_damaged, not a torn tail. The random damage above flips single bits or garbles whole
    bytes, so the bound itself (2, not 1) is drawn here: pairs of bits of the last commit frame,
    in both readers."""
    rng = random.Random(43)
    source = os.path.join(scratch, "source")
    with SegmentLog.open(source, segment_bytes=SEGMENT_BYTES_MIN) as log:
        log.append([b"first group"])
        last = log.append([b"last group", b"x" * 50])
    path = os.path.join(source, sorted(os.listdir(source))[0])
    assert path.endswith(".seg")
    commit = lib.SL_SEGMENT_HEADER_BYTES + last[-1] + (16 + 50 + 7) // 8 * 8
    bits = range(commit * 8, (commit + 32) * 8)
    target = os.path.join(scratch, "target")
    for first_bit, second_bit in [tuple(rng.sample(bits, 2)) for _ in range(40)]:
        shutil.copytree(source, target)
        with open(os.path.join(target, os.path.basename(path)), "r+b") as file:
            content = bytearray(file.read())
            for bit in (first_bit, second_bit):
                content[bit // 8] ^= 1 << (bit % 8)
            file.seek(0)
            file.write(content)
        c_result, reference_result = c_read_recovered(target), reference_read(target)
        assert c_result[:2] == ("corruption", "commit_damaged")
        assert reference_result == c_result
        shutil.rmtree(target)
