"""The recovery of a read-only segment log open (``SegmentLog.open(readonly=True)``), which may run
beside a live writer in another process (docs/format/segment.md, "Opening and the torn tail").

- the last segment is read with pread in growing pieces, to its end however long it is;
- with ``known_end`` nothing past it is read, and damage before it is reported by the writer's rules;
- while a writer holds the log's flock (seen in /proc/locks) a last group without an intact commit
  frame or seal after it is in flight; a later intact frame proves the damage;
- damage is reported only when a second reading, by the same rules, finds it at the same offset;
- the probe for a writer counts only a flock on this log's LOCK file.

A writer is simulated by holding the flock through a separate open file description of ``LOCK``,
and a reading that sees a page before the writer copied into it by changing the bytes one reading
gets (``_pread_all``), so that nothing here depends on timing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import zlib
from collections.abc import Iterator

import pytest

from mwpstore import segment_log
from mwpstore.errors import Corruption, StorageFailed
from mwpstore.segment_log import _HEADER_BYTES, CLEAN_FILE_NAME, COMMIT_FRAME_BYTES, LOCK_FILE_NAME, SegmentLog, framed_bytes

SMALL = 65536


@contextlib.contextmanager
def writer_lock(directory: str) -> Iterator[None]:
    """The flock a writer holds on the log, from another open file description of ``LOCK``."""
    fd = os.open(os.path.join(directory, LOCK_FILE_NAME), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def build(directory: str, groups: list[list[bytes]], segment_bytes: int = SMALL) -> tuple[list[int], str]:
    """Write ``groups``, close, and remove the clean-close marker (a writer that has appended since
    its open has none): the end after each group, and the active segment's path."""
    ends = []
    with SegmentLog.open(directory, segment_bytes=segment_bytes) as log:
        for group in groups:
            log.append(group)
            ends.append(log.end)
        active = log.segments()[-1]
    assert active.first_position == 0
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    return ends, active.path


def records_of(log: SegmentLog) -> list[bytes]:
    return [bytes(record) for batch in log.scan(0) for record in batch.records]


def commit_offset(end: int) -> int:
    """The file offset of the commit frame of the group that ends at ``end`` (first segment)."""
    return _HEADER_BYTES + end - COMMIT_FRAME_BYTES


def flip(path: str, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ mask]))


def overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def preads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (offset, length) of every os.pread from now on, in order."""
    reads: list[tuple[int, int]] = []
    real_pread = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        reads.append((offset, length))
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", pread)
    return reads


class Readings:
    """Stands in for ``_pread_all``: reading ``k`` (counted at each read from offset 0) gets the
    file's bytes with ``changes[k]`` ((offset, bytes), ...) put over them, as a reading that met a
    page before the writer copied into it would; readings past the list get the file as it is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, changes: list[list[tuple[int, bytes]]]) -> None:
        self.changes = changes
        self.count = 0
        self._real = segment_log._pread_all
        monkeypatch.setattr(segment_log, "_pread_all", self)

    def __call__(self, fd: int, length: int, offset: int) -> bytes:
        if offset == 0 and length <= _HEADER_BYTES:
            return self._real(fd, length, offset)  # the check that the file is the one opened
        if offset == 0:
            self.count += 1
        data = bytearray(self._real(fd, length, offset))
        for at, replacement in self.changes[self.count - 1] if self.count <= len(self.changes) else ():
            for index, byte in enumerate(replacement):
                if offset <= at + index < offset + len(data):
                    data[at + index - offset] = byte
        return bytes(data)


def four_groups(directory: str) -> tuple[list[int], str]:
    return build(directory, [[b"a" * 100], [b"b" * 100, b"bb" * 50], [b"c" * 100], [b"d" * 100]])


# -- reading the last segment in pieces ----------------------------------------------------------


@pytest.mark.parametrize("writer", [False, True], ids=["no writer", "writer holds the log"])
def test_a_last_segment_longer_than_the_first_piece_is_read_to_its_end(tmp_path, writer):
    """The recovery reads 1 MiB, then four times more each time, until it finds where the groups
    end. Here a group ends exactly where the first piece does (no room there to see a zero frame
    header: not the end) and a later one is cut by the second piece's end (torn in that reading):
    both readings must go on, and the open serves every group."""
    directory = str(tmp_path)
    piece_end = segment_log._RECOVERY_READ_BYTES - _HEADER_BYTES  # the position at the first piece's end
    group_bytes = framed_bytes(65536) + COMMIT_FRAME_BYTES
    head, rest = divmod(piece_end, group_bytes)
    last_bytes = rest - COMMIT_FRAME_BYTES - framed_bytes(0)
    assert last_bytes > 0 and framed_bytes(last_bytes) + COMMIT_FRAME_BYTES == rest
    groups = [[bytes([index]) * 65536] for index in range(head)] + [[b"x" * last_bytes]]
    groups += [[bytes([index]) * 65536] for index in range(52)]
    ends, _ = build(directory, groups, segment_bytes=8 << 20)
    assert piece_end in ends
    second_piece_end = 4 * segment_log._RECOVERY_READ_BYTES - _HEADER_BYTES
    assert any(before < second_piece_end < after for before, after in zip(ends, ends[1:]))
    with writer_lock(directory) if writer else contextlib.nullcontext():
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-1]
            assert records_of(log) == [record for group in groups for record in group]


def test_a_zeroed_block_reaching_past_the_first_piece_is_judged_on_the_whole_segment(tmp_path):
    """With no writer, the bytes after a clean end are judged where they are not zero, to the
    segment's end: zeros from a group inside the first piece to past its end, whole groups after
    them, are the corruption the writer's open reports, not the log's end."""
    directory = str(tmp_path)
    groups = [[bytes([index]) * 65536] for index in range(30)]
    ends, path = build(directory, groups, segment_bytes=4 << 20)
    start, stop = _HEADER_BYTES + ends[7], _HEADER_BYTES + ends[20]
    assert start < segment_log._RECOVERY_READ_BYTES < stop
    overwrite(path, start, bytes(stop - start))
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=readonly)
        assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", start)


@pytest.mark.parametrize("writer", [False, True], ids=["no writer", "writer holds the log"])
def test_the_recovery_stops_reading_at_the_clean_end(tmp_path, monkeypatch, writer):
    """Zeros where the next group would begin end the reading: a log that ends early in a large
    segment is read in one piece, not to the segment's end (which the writer may be trimming)."""
    directory = str(tmp_path)
    ends, _ = build(directory, [[b"a" * 100], [b"b" * 100]], segment_bytes=8 << 20)
    reads = preads(monkeypatch)
    with writer_lock(directory) if writer else contextlib.nullcontext():
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-1]
    # after the check that the file is still the one whose header the open read
    assert reads == [(0, _HEADER_BYTES), (0, segment_log._RECOVERY_READ_BYTES)]


# -- known_end -----------------------------------------------------------------------------------


def test_a_read_only_open_with_known_end_reads_nothing_past_it(tmp_path, monkeypatch):
    """Past ``known_end`` the writer may be copying a group in, or about to trim the segment: the
    recovery's reads stop at it (here the bytes past it would be damage), and the log ends there."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    known_end = ends[1]
    overwrite(path, _HEADER_BYTES + known_end + 40, b"\xff" * 8)  # inside the next group's record
    reads = preads(monkeypatch)
    with writer_lock(directory):
        with SegmentLog.open(directory, readonly=True, known_end=known_end) as log:
            assert reads and max(offset + length for offset, length in reads) == _HEADER_BYTES + known_end
            assert log.end == known_end
            assert records_of(log) == [b"a" * 100, b"b" * 100, b"bb" * 50]


def test_damage_in_the_last_group_before_known_end_is_corruption_beside_a_writer(tmp_path):
    """Every byte before ``known_end`` is written already: the writer's rules apply to it even
    while the writer holds the log, so a commit frame one bit away from its group's is damage
    (the rules for a group in flight would drop the group silently)."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    flip(path, commit_offset(ends[1]) + COMMIT_FRAME_BYTES - 1)
    with writer_lock(directory):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True, known_end=ends[1])
        assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("commit_damaged", commit_offset(ends[1]))
        assert caught.value.detail["segment"] == path


@pytest.mark.parametrize("writer", [False, True], ids=["no writer", "writer holds the log"])
def test_zeros_over_a_group_before_known_end_with_whole_groups_after_them_are_corruption(tmp_path, writer):
    """Every byte before ``known_end`` is written, so the writer's rules apply up to it, including
    the judgement of what follows a clean end: zeros over a group followed by a later group's
    intact commit frame, all before ``known_end``, are group_damaged, as the writer's open reports
    them. (The open served a log that ended at the zeros, and a view of the store then asked for
    a writer's recovery, which found the corruption.)"""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    overwrite(path, _HEADER_BYTES + ends[0], bytes(ends[1] - ends[0]))
    with writer_lock(directory) if writer else contextlib.nullcontext():
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True, known_end=ends[3])
    assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", _HEADER_BYTES + ends[0])
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(directory)
    assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", _HEADER_BYTES + ends[0])


def test_a_damaged_group_whose_commit_frame_ends_at_known_end_is_corruption(tmp_path):
    """The intact commit frame that proves a damaged group's write completed may be the last bytes
    the recovery reads (it ends at ``known_end``): it still counts."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    flip(path, _HEADER_BYTES + ends[0] + 20)  # the first record of the second group
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(directory, readonly=True, known_end=ends[1])
    assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", _HEADER_BYTES + ends[0])


def test_known_end_at_a_rollover_keeps_the_segment_that_starts_there(tmp_path):
    """A segment whose first position is ``known_end`` was started at it, not after it: it stays in
    the log (empty up to there), and the segment before it is the sealed one it is."""
    directory = str(tmp_path)
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        while len(log.segments()) < 2:  # the group that rolls over lies past known_end
            known_end = log.end
            log.append([b"r" * 1000])
        assert log.segments()[-1].first_position == known_end < log.end
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    with SegmentLog.open(directory, readonly=True, known_end=known_end) as log:
        infos = log.segments()
        assert [info.first_position for info in infos][-1] == known_end and infos[-2].sealed
        assert log.end == known_end and list(log.scan(known_end)) == []
        assert log.verify() == len(records_of(log))



@pytest.mark.parametrize("before_rollover", [0, 1], ids=["at an earlier group's end", "inside the last group's commit frame"])
def test_segments_started_after_known_end_are_left_out(tmp_path, before_rollover):
    """Segments the writer started after ``known_end`` are neither scanned nor served: the log
    ends at ``known_end`` (or at the last whole group before it, when it is no group's end),
    never at a later segment's start."""
    directory = str(tmp_path)
    ends = []
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        while len(log.segments()) < 3:
            log.append([b"r" * 1000])
            ends.append(log.end)
        rollover = log.segments()[1].first_position
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    before = [end for end in ends if end < rollover]
    known_end, expected = (before[-2], before[-2]) if before_rollover == 0 else (rollover - 1, before[-1])
    with SegmentLog.open(directory, readonly=True, known_end=known_end) as log:
        assert log.end == expected
        assert [info.first_position for info in log.segments()] == [0]
        assert len(records_of(log)) == len([end for end in ends if end <= expected])



def test_known_end_before_a_clean_close_s_end_serves_the_log_the_close_left(tmp_path):
    """A clean-close marker that fits vouches for the log's end (a writer removes it before its
    first append, so nothing past that end is in flight): the open takes the marker's end even
    past ``known_end``, with every segment up to it. Here the marker is of the first form (no
    segment list), which makes the open read every segment's header and seal first."""
    directory = str(tmp_path)
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        while len(log.segments()) < 3:
            log.append([b"r" * 1000])
        known_end, end, log_id = log.segments()[1].first_position - 1, log.end, log.log_id
        active = log.segments()[-1].first_position
    body = segment_log._CLEAN.pack(segment_log._CLEAN_MAGIC, log_id, active, end)
    with open(os.path.join(directory, CLEAN_FILE_NAME), "wb") as marker:
        marker.write(body + zlib.crc32(body).to_bytes(4, "little"))
    with SegmentLog.open(directory, readonly=True, known_end=known_end) as log:
        assert log.end == end and len(log.segments()) == 3
        assert records_of(log) == [b"r" * 1000] * log.verify()


# -- a writer holds the log: groups in flight, and damage proven by a later intact frame ----------


def test_a_damaged_commit_frame_followed_by_a_whole_group_is_corruption_beside_a_writer(tmp_path):
    """A live writer copies its groups in file order: an intact commit frame of any later group
    proves the write of an earlier one completed, so a commit frame missing before it is damage.
    With no writer the writer's rules apply, and they say the same: each group is written only
    after the one before it is durable. Only in a log a bulk-mode writer had open (BULK) does a
    later group prove nothing (a power cut can keep it and lose an earlier one), so the log ends
    before the damaged group, as the writer's open would cut it."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    overwrite(path, commit_offset(ends[1]), bytes(COMMIT_FRAME_BYTES))
    expected = ("group_damaged", commit_offset(ends[1]))
    with writer_lock(directory):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True)
        assert (caught.value.detail["reason"], caught.value.detail["offset"]) == expected
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(directory, readonly=True)
    assert (caught.value.detail["reason"], caught.value.detail["offset"]) == expected
    with open(os.path.join(directory, segment_log.BULK_FILE_NAME), "wb"):
        pass
    with SegmentLog.open(directory, readonly=True) as log:
        assert log.end == ends[0]


@pytest.mark.parametrize("where", ["tmp_path", "scratch"])
def test_the_writer_is_seen_on_every_file_system(tmp_path, scratch, where):
    """/proc/locks names the device with two hex digits at least (``00:2e`` on tmpfs): the probe
    must write the key the same way, or a writer on such a device is never seen and a group in
    flight becomes CORRUPTION."""
    directory = str(tmp_path) if where == "tmp_path" else scratch
    ends, path = four_groups(directory)
    flip(path, commit_offset(ends[-1]) + COMMIT_FRAME_BYTES - 1)  # its last byte not copied yet
    with writer_lock(directory):
        assert segment_log._writer_holds_lock(directory)
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-2]
    assert not segment_log._writer_holds_lock(directory)
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(directory, readonly=True)
    assert caught.value.detail["reason"] == "commit_damaged"


def test_a_posix_lock_on_the_lock_file_is_not_a_writer(tmp_path):
    """A writer holds the log with flock; another kind of lock on LOCK (a POSIX record lock, shown
    in /proc/locks too) is no writer's: the writer's rules apply to the last group."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    flip(path, commit_offset(ends[-1]) + COMMIT_FRAME_BYTES - 1)
    fd = os.open(os.path.join(directory, LOCK_FILE_NAME), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not segment_log._writer_holds_lock(directory)
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True)
        assert caught.value.detail["reason"] == "commit_damaged"
    finally:
        os.close(fd)


# -- two readings --------------------------------------------------------------------------------


def test_damage_only_one_reading_saw_is_not_reported(tmp_path, monkeypatch):
    """The first reading met the second group's page before the writer copied into it, and a
    later group's page after: damage, proven by that later commit frame. The second reading finds
    the group whole: the log is served to its end."""
    directory = str(tmp_path)
    ends, _ = four_groups(directory)
    readings = Readings(monkeypatch, [[(_HEADER_BYTES + ends[0] + 16, bytes(8))]])
    with writer_lock(directory):
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-1] and len(records_of(log)) == 5
    assert readings.count == 2


def test_damage_found_at_different_offsets_by_two_readings_is_read_again(tmp_path, monkeypatch):
    """Two readings that each find damage, but not at the same offset, prove nothing: a third
    reading is made, and here it finds the log whole."""
    directory = str(tmp_path)
    ends, _ = four_groups(directory)
    Readings(monkeypatch, [[(_HEADER_BYTES + ends[0] + 16, bytes(8))], [(_HEADER_BYTES + ends[1] + 16, bytes(8))]])
    with writer_lock(directory):
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-1]


def test_damage_of_another_kind_at_the_same_offset_is_read_again(tmp_path, monkeypatch):
    """The first reading finds the second group's commit frame one bit off (commit_damaged), the
    second finds it not yet copied (group_damaged, at the same offset): not the same damage, so
    a third reading is made, and here it finds the log whole."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    offset = commit_offset(ends[1])
    with open(path, "rb") as file:
        file.seek(offset)
        frame = file.read(COMMIT_FRAME_BYTES)
    one_bit_off = frame[:-1] + bytes([frame[-1] ^ 0x01])
    Readings(monkeypatch, [[(offset, one_bit_off)], [(offset, bytes(COMMIT_FRAME_BYTES))]])
    with writer_lock(directory):
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.end == ends[-1]


def test_damage_found_under_other_rules_is_read_again(tmp_path, monkeypatch):
    """The rules are chosen for each reading (is a writer holding the log now?): the same damage
    found once by the rules for a live writer and once by the writer's own is not found twice by
    the same rules, so a third reading is made, and here it finds the log whole."""
    directory = str(tmp_path)
    ends, _ = four_groups(directory)
    answers = iter([True, False, False])
    monkeypatch.setattr(segment_log, "_writer_holds_lock", lambda directory: next(answers))
    stale = [(_HEADER_BYTES + ends[0] + 16, bytes(8))]
    readings = Readings(monkeypatch, [stale, stale])
    with SegmentLog.open(directory, readonly=True) as log:
        assert log.end == ends[-1]
    assert readings.count == 3


def test_the_same_damage_found_by_two_readings_is_corruption(tmp_path, monkeypatch):
    """Damage found again by the next reading, same rules, same offset, same reason, is
    reported, after exactly two readings."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    flip(path, _HEADER_BYTES + ends[0] + 20)
    readings = Readings(monkeypatch, [])
    with writer_lock(directory):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True)
    assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", _HEADER_BYTES + ends[0])
    assert caught.value.detail["segment"] == path
    assert readings.count == 2


# -- the probe for a writer ------------------------------------------------------------------------


def test_the_probe_counts_only_a_flock_on_this_log_s_lock_file(tmp_path, monkeypatch):
    """The probe reads /proc/locks: a FLOCK line whose device and inode are those of ``LOCK``
    is a writer; a lock on a file with the same inode on another device, one on another inode of
    the device, and a POSIX lock on ``LOCK`` itself are not."""
    directory = str(tmp_path)
    build(directory, [[b"one"]])
    status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    major, minor, inode = os.major(status.st_dev), os.minor(status.st_dev), status.st_ino
    ours = f"{major:02x}:{minor:02x}:{inode}"
    others = [f"{major + 1:02x}:{minor:02x}:{inode}", f"{major:02x}:{minor + 1:02x}:{inode}", f"{major:02x}:{minor:02x}:{inode + 1}"]
    lines = [f"{number}: FLOCK  ADVISORY  WRITE 4242 {key} 0 EOF" for number, key in enumerate(others, 1)]
    lines.append(f"9: POSIX  ADVISORY  WRITE 4243 {ours} 0 EOF")
    real_open = open

    def fake_open(path, *arguments, **keywords):
        if path == "/proc/locks":
            return io.StringIO(text)
        return real_open(path, *arguments, **keywords)

    monkeypatch.setattr(segment_log, "open", fake_open, raising=False)
    text = "\n".join(lines) + "\n"
    assert not segment_log._writer_holds_lock(directory)
    text += f"10: FLOCK  ADVISORY  WRITE 4244 {ours} 0 EOF\n"
    assert segment_log._writer_holds_lock(directory)


def test_the_probe_assumes_a_writer_when_it_cannot_tell(tmp_path, monkeypatch):
    """No LOCK file: no writer ever opened the log. LOCK that cannot be looked at (a symlink loop),
    or /proc/locks that cannot be read: a writer is assumed (its rules are the safe ones)."""
    directory = str(tmp_path)
    assert not segment_log._writer_holds_lock(directory)
    os.symlink(LOCK_FILE_NAME, os.path.join(directory, LOCK_FILE_NAME))
    assert segment_log._writer_holds_lock(directory)
    os.remove(os.path.join(directory, LOCK_FILE_NAME))
    build(directory, [[b"one"]])
    assert not segment_log._writer_holds_lock(directory)

    def no_proc(path, *arguments, **keywords):
        raise FileNotFoundError(path)

    monkeypatch.setattr(segment_log, "open", no_proc, raising=False)
    assert segment_log._writer_holds_lock(directory)


def _fake_proc(monkeypatch, files: dict[str, str | None]) -> None:
    """segment_log's ``open`` answers these /proc files with the given text (None: unreadable)."""
    real_open = open

    def fake_open(path, *arguments, **keywords):
        if path in files:
            if files[path] is None:
                raise PermissionError(path)
            return io.StringIO(files[path])
        return real_open(path, *arguments, **keywords)

    monkeypatch.setattr(segment_log, "open", fake_open, raising=False)


def test_the_probe_sees_a_writer_named_by_its_mount_s_device(tmp_path, monkeypatch):
    """Where stat() gives a file another device than its file system's (btrfs gives each subvolume
    one of its own), /proc/locks names the file by the file system's device, which
    /proc/self/mountinfo gives for the mount the file is under: the deepest such mount, mount
    points read with their octal escapes, a mount point that is only a prefix of the name not
    counting."""
    directory = str(tmp_path / "log dir" / "segments")
    build(directory, [[b"one"]])
    status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    inode = status.st_ino
    assert (os.major(status.st_dev), os.minor(status.st_dev)) not in {(0, 901), (0, 902), (0, 903)}
    parent = os.path.realpath(str(tmp_path))
    mounts = (
        "20 1 0:901 / / rw - ext4 /dev/vda rw\n"
        f"61 20 0:902 /sub {parent}/log\\040dir rw - btrfs /dev/vdb rw\n"  # the log's: an escaped space
        f"62 61 0:903 /other {parent}/log\\040dir/seg rw - btrfs /dev/vdb rw\n"  # deeper, but only a prefix of the name
    )

    def holds(lock_device: str) -> bool:
        locks = f"1: FLOCK  ADVISORY  WRITE 4242 {lock_device}:{inode} 0 EOF\n"
        _fake_proc(monkeypatch, {"/proc/locks": locks, "/proc/self/mountinfo": mounts})
        return segment_log._writer_holds_lock(directory)

    assert holds("00:386")  # 0:902
    assert not holds("00:385")  # 0:901, the root's: a deeper mount covers the log
    assert not holds("00:387")  # 0:903: .../seg is no parent of .../segments


def test_the_probe_without_mountinfo_goes_by_the_stat_device(tmp_path, monkeypatch):
    directory = str(tmp_path)
    build(directory, [[b"one"]])
    status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    ours = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    other = f"{os.major(status.st_dev) + 1:02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for key, seen in ((ours, True), (other, False)):
        _fake_proc(monkeypatch, {"/proc/locks": f"1: FLOCK  ADVISORY  WRITE 4242 {key} 0 EOF\n", "/proc/self/mountinfo": None})
        assert segment_log._writer_holds_lock(directory) is seen


# -- reading with pread ----------------------------------------------------------------------------


def test_pread_all_reads_on_after_a_short_read(tmp_path, monkeypatch):
    """pread may return fewer bytes than asked before the file's end: the rest is read from where
    it stopped, and never more than asked; fewer only where the file ends."""
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * 4)
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, length, offset: real_pread(fd, min(length, 7), offset))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert segment_log._pread_all(fd, 100, 10) == (bytes(range(256)) * 4)[10:110]
        assert segment_log._pread_all(fd, 100, 1000) == (bytes(range(256)) * 4)[1000:]
    finally:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.EOVERFLOW])
def test_a_failed_read_of_the_last_segment_is_storage_failed_with_its_errno(tmp_path, monkeypatch, code):
    """The recovery's pread failing is StorageFailed naming the segment, with the error's own
    errno (an operator tells a failing disk, EIO, from a stale network file, ESTALE)."""
    directory = str(tmp_path)
    _, path = four_groups(directory)

    def failing_pread(fd, length, offset):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pread", failing_pread)
    with pytest.raises(StorageFailed) as caught:
        SegmentLog.open(directory, readonly=True)
    assert (caught.value.detail["errno"], caught.value.detail["path"]) == (code, path)


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_read_only_open_leaves_no_descriptor_open(tmp_path):
    """The recovery's descriptor of the last segment is closed whatever the open's outcome: the log
    served, CORRUPTION, or StorageFailed."""
    directory = str(tmp_path)
    ends, path = four_groups(directory)
    before = _descriptors()
    with SegmentLog.open(directory, readonly=True) as log:
        assert log.end == ends[-1]
    assert _descriptors() == before
    flip(path, _HEADER_BYTES + ends[0] + 20)
    with pytest.raises(Corruption):
        SegmentLog.open(directory, readonly=True)
    assert _descriptors() == before
