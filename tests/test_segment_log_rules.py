"""Rules of the segment log's Python side (mwpstore/segment_log.py) that each refuse damage or a
wrong state with a typed error, or keep an acknowledged group readable: each test builds exactly
the situation its rule is for (docs/format/segment.md).
"""

from __future__ import annotations

import os
import random
import struct
import zlib

import pytest
from segment_readers import directory_switched_at_open
from test_readonly_recovery import _fake_proc, build

from mwpstore import segment_log
from mwpstore.errors import Corruption, LimitExceeded, StorageFailed
from mwpstore.io_seam import RecordingIO, crash_state, write_crash_state
from mwpstore.limits import GROUP_RECORDS_MAX, SEGMENT_BYTES_MIN
from mwpstore.segment_log import BULK_FILE_NAME, CLEAN_FILE_NAME, LOCK_FILE_NAME, SegmentLog, segment_file_name
from test_segment_log import fail_the_next_sync, scan_all

SMALL = SEGMENT_BYTES_MIN

# -- the probe for a writer ------------------------------------------------------------------------


def _probe_with_mounts(monkeypatch, directory: str, mounts: str, lock_device: str) -> bool:
    """The probe's answer when /proc/self/mountinfo reads ``mounts`` and /proc/locks holds one
    flock on the log's LOCK named by ``lock_device``."""
    inode = os.stat(os.path.join(directory, LOCK_FILE_NAME)).st_ino
    locks = f"1: FLOCK  ADVISORY  WRITE 4242 {lock_device}:{inode} 0 EOF\n"
    _fake_proc(monkeypatch, {"/proc/locks": locks, "/proc/self/mountinfo": mounts})
    return segment_log._writer_holds_lock(directory)


# Mount listings under which the log's files are on 0:903 and 0:902 is hidden ({parent} is the
# directory the log's directory is in).
HIDDEN_MOUNTS = {
    # two file systems mounted on the same point: the later one, the earlier one's child, hides it
    "stacked on one point": (
        "61 20 0:902 / {parent} rw - btrfs /dev/vdb rw\n"
        "62 61 0:903 / {parent} rw - btrfs /dev/vdc rw\n"
    ),
    # one on the log's directory first, then one on its parent: the second is the root's child,
    # not the first one's, and hides it, though the hidden mount is deeper
    "a later one on a parent": (
        "61 20 0:902 / {parent}/log rw - btrfs /dev/vdb rw\n"
        "62 20 0:903 / {parent} rw - btrfs /dev/vdc rw\n"
        "63 62 0:904 / {parent}/logs rw - btrfs /dev/vdd rw\n"  # a child, but only a prefix of the name
    ),
}


@pytest.mark.parametrize("layout", sorted(HIDDEN_MOUNTS))
def test_the_probe_takes_the_device_of_the_mount_a_path_lookup_reaches(tmp_path, monkeypatch, layout):
    """/proc/locks names the log's files by the device of the mount they are on: the one a walk
    of the mount tree down the path reaches, not a mount hidden under it."""
    directory = str(tmp_path / "log")
    build(directory, [[b"one"]])
    status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    assert (os.major(status.st_dev), os.minor(status.st_dev)) not in {(0, 902), (0, 903)}
    mounts = "20 1 0:901 / / rw - ext4 /dev/vda rw\n" + HIDDEN_MOUNTS[layout].format(parent=os.path.realpath(str(tmp_path)))
    assert _probe_with_mounts(monkeypatch, directory, mounts, "00:387")  # 0:903
    assert not _probe_with_mounts(monkeypatch, directory, mounts, "00:386")  # 0:902, hidden


def test_the_probe_ends_a_walk_over_a_listing_whose_parents_form_a_cycle(tmp_path, monkeypatch):
    """A listing no kernel writes (two mounts each the other's parent, no root) gives no device:
    the probe goes by the stat device alone and does not loop."""
    directory = str(tmp_path / "log")
    build(directory, [[b"one"]])
    status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    ours = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}"
    mounts = "20 21 0:901 / / rw - ext4 /dev/vda rw\n21 20 0:902 / / rw - ext4 /dev/vdb rw\n"
    assert _probe_with_mounts(monkeypatch, directory, mounts, ours)
    assert not _probe_with_mounts(monkeypatch, directory, mounts, "00:386")



# -- a read-only open meets a compaction's switch --------------------------------------------------


def _several_segments(directory: str) -> None:
    """A log of four segments or more, closed, without its clean-close marker (an open reads every
    header and recovers the last segment from its bytes)."""
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        for index in range(80):
            log.append([bytes([index]) * 3000])
        assert len(log.segments()) >= 4
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))


def test_a_sealed_segment_replaced_before_a_read_only_open_maps_it_is_segment_replaced(tmp_path, monkeypatch):
    """The open read every header and recovered the last segment; then a compaction's switch put
    a new log under the directory's name before the open mapped the sealed segments. Mapped, a
    sealed segment is the new log's file under the old header: CORRUPTION segment_replaced at open
    (on which a view opens again), never a log whose reads fail later on frame checksums."""
    directory = str(tmp_path / "log")
    _several_segments(directory)
    # the second file opened by name: the first map of a sealed segment, after the last one's recovery
    with directory_switched_at_open(monkeypatch, directory, at_open=2, segment_bytes=SMALL):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True).close()
    assert caught.value.detail["reason"] == "segment_replaced"
    assert caught.value.detail["segment"] == os.path.join(directory, segment_file_name(0))


def test_a_sealed_segment_of_this_log_moved_under_another_s_name_before_it_is_mapped_is_segment_replaced(tmp_path, monkeypatch):
    """The file a read-only open maps must be the one whose header it read there: the log id and
    the first position. Two sealed segments of the same log swapped after the open read their
    headers and before it mapped them: the second is refused (segment_replaced), not served under
    the header of the file that was there."""
    directory = str(tmp_path / "log")
    _several_segments(directory)
    names = sorted(name for name in os.listdir(directory) if name.endswith(".seg"))
    second, third = (os.path.join(directory, name) for name in names[1:3])
    real, calls = segment_log._open_segment_fd, []

    def open_segment_fd(path):
        calls.append(path)
        if path == second and calls.count(path) == 1:  # its first map, after every header was read
            os.rename(second, second + ".swap")
            os.rename(third, second)
            os.rename(second + ".swap", third)
        return real(path)

    monkeypatch.setattr(segment_log, "_open_segment_fd", open_segment_fd)
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(directory, readonly=True).close()
    assert (caught.value.detail["reason"], caught.value.detail["segment"]) == ("segment_replaced", second)

def test_a_sealed_segment_that_cannot_be_mapped_leaves_the_others_held(tmp_path):
    """A read-only open maps every segment as it opens; one that cannot be mapped (here emptied
    after a clean close, which the open takes on the close's word) is left to the read that needs
    it, and the segments after it are still mapped: after a compaction's switch their records
    are read from the files the open found."""
    import shutil

    directory, old = str(tmp_path / "log"), str(tmp_path / "log.old")
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        positions = [log.append([bytes([index]) * 3000])[0] for index in range(80)]
        segments = log.segments()
    assert len(segments) >= 4
    os.truncate(segments[1].path, 0)
    start, stop = segments[2].first_position, segments[3].first_position
    later = [(index, position) for index, position in enumerate(positions) if start <= position < stop]
    with SegmentLog.open(directory, readonly=True) as reader:
        os.rename(directory, old)
        with SegmentLog.open(directory, segment_bytes=SMALL) as replacement:
            replacement.append([b"new"])
        shutil.rmtree(old)
        assert [bytes(reader.read(position)) for _, position in later] == [bytes([index]) * 3000 for index, _ in later]
        with pytest.raises(StorageFailed):  # the one it could not map: read by name, gone
            reader.read(segments[1].first_position)


@pytest.mark.parametrize("segments", ["one", "several"])
def test_a_segment_first_mapped_after_a_switch_is_segment_replaced_not_damaged(tmp_path, monkeypatch, segments):
    """A read-only open read every header and the last segment's bytes; it then mapped the
    segments between a compaction's two renames (no file had their names, so each was left to the
    read that needs it), and the new log took the directory's name. The first scan mapped segment
    0 by name: the new log's file, whose frames it checked under the old header's log id and
    called damaged at the first frame (CORRUPTION frame_checksum). Every map of a segment whose
    header the open read is now checked against that header: segment_replaced, and the map is not
    kept, so a read after it is refused the same way."""
    directory = str(tmp_path / "log")
    if segments == "one":
        build(directory, [[b"old %d" % index] for index in range(20)])
    else:
        _several_segments(directory)
    # files taken by name: 1, the last segment's recovery; 2, the open's map of segment 0, in the
    # gap; 3, the next one (a map of the open's, or the scan's of segment 0) completes the switch
    with directory_switched_at_open(monkeypatch, directory, at_open=2, complete_at=3, segment_bytes=SMALL):
        with SegmentLog.open(directory, readonly=True) as reader:
            with pytest.raises(Corruption) as caught:
                scan_all(reader)
            with pytest.raises(Corruption) as again:
                reader.read(0)
    for error in (caught.value, again.value):
        assert (error.detail["reason"], error.detail["segment"]) == ("segment_replaced", os.path.join(directory, segment_file_name(0)))


# -- the clean-close marker -------------------------------------------------------------------------


def _marker(directory: str) -> bytes:
    with open(os.path.join(directory, CLEAN_FILE_NAME), "rb") as file:
        return file.read()


def _put_marker(directory: str, marker: bytes) -> None:
    with open(os.path.join(directory, CLEAN_FILE_NAME), "wb") as file:
        file.write(marker)


def test_a_clean_close_marker_of_another_log_never_gives_the_log_its_end(tmp_path):
    """A marker whose log id is another log's (a retired handle's, written over a compaction's
    new log) but whose first position and end fit this log: an end where a commit frame ends,
    and 64 KiB of zeros after it, which here are a zeroed block over an acknowledged group with
    a whole group after it. Taken, the log would end there and the groups after it would be lost
    without a word; the open scans instead and finds the damage."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=1 << 20) as log:
        log.append([b"first"])
        end = log.end
    marker = bytearray(_marker(directory))
    with SegmentLog.open(directory, segment_bytes=1 << 20) as log:
        log.append([b"z" * 40000, b"z" * 40000])  # the group the zeroed block covers
        after = log.end
        log.append([b"last"])
        path = log.segments()[-1].path
    with open(path, "r+b") as file:
        file.seek(segment_log._HEADER_BYTES + end)
        file.write(bytes(after - end))
    struct.pack_into("<Q", marker, 8, struct.unpack_from("<Q", marker, 8)[0] ^ 1)  # another log's id
    marker[-4:] = zlib.crc32(bytes(marker[:-4])).to_bytes(4, "little")
    _put_marker(directory, bytes(marker))
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=readonly).close()
        assert (caught.value.detail["reason"], caught.value.detail["offset"]) == ("group_damaged", segment_log._HEADER_BYTES + end)


def test_a_clean_close_after_an_open_on_a_marker_of_the_first_form_writes_the_second(tmp_path):
    """A marker of the first form (MWPCLEAN: no segment list) gives the end, but the next open
    still reads every sealed segment's header; a close of a log opened on one writes the marker
    with the list, even with nothing appended."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        for index in range(40):
            log.append([bytes([index]) * 3000])
        end = log.end
    _, log_id, first_position, marker_end, _, _ = segment_log._CLEAN_LIST.unpack(_marker(directory)[:-4])
    body = segment_log._CLEAN.pack(segment_log._CLEAN_MAGIC, log_id, first_position, marker_end)
    _put_marker(directory, body + zlib.crc32(body).to_bytes(4, "little"))
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        assert log.end == end
    assert _marker(directory)[:8] == segment_log._CLEAN_LIST_MAGIC


def test_the_clean_close_marker_s_removal_is_synced_before_the_first_append(tmp_path, monkeypatch):
    """The first append after a clean open removes the marker and syncs the directory before it
    writes: the marker's end is about to go stale."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory) as log:
        log.append([b"one"])
    synced = []
    real_sync = segment_log._fsync_directory

    def fsync_directory(path):
        synced.append((path, os.path.exists(os.path.join(path, CLEAN_FILE_NAME))))
        real_sync(path)

    monkeypatch.setattr(segment_log, "_fsync_directory", fsync_directory)
    with SegmentLog.open(directory) as log:
        assert synced == []
        log.append([b"two"])
        assert synced == [(directory, False)]


def test_an_append_after_the_marker_s_removal_failed_is_refused_and_the_close_writes_no_marker(tmp_path, monkeypatch):
    """A failed removal of the clean-close marker fails the handle as a failed write does
    (docs/format/segment.md: every later write raises StorageFailed until a reopen, nothing is
    retried): the next append is refused even once the directory would sync again, and the close
    leaves no marker to vouch for an end this handle never made durable."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory) as log:
        log.append([b"one"])
    real_sync = segment_log._fsync_directory

    def failing(path):
        raise OSError(5, "Input/output error")

    log = SegmentLog.open(directory)
    try:
        monkeypatch.setattr(segment_log, "_fsync_directory", failing)
        with pytest.raises(StorageFailed):
            log.append([b"two"])
        monkeypatch.setattr(segment_log, "_fsync_directory", real_sync)
        with pytest.raises(StorageFailed):
            log.append([b"three"])
    finally:
        log.close()
    assert not os.path.exists(os.path.join(directory, CLEAN_FILE_NAME))
    with SegmentLog.open(directory) as log:
        assert [record for _, record in scan_all(log)] == [b"one"]


@pytest.mark.parametrize("change", ["shortened", "lengthened"])
def test_a_clean_close_marker_never_gives_the_end_of_an_active_segment_no_longer_of_its_size(tmp_path, change):
    """The marker vouches for the active segment as the close left it, preallocated to its full
    size. Shortened since (yet past the end and the 64 KiB of zeros after it) or lengthened
    (bytes written past its size), the file is not that one: the open scans, and the repair gives
    it its size back. Taken on the marker's word, a shortened file stayed short, and the writer's
    map of it, made at the first read, never reached the groups appended past the cut (each read
    as no record)."""
    directory, segment_bytes = str(tmp_path / "log"), 1 << 20
    with SegmentLog.open(directory, segment_bytes=segment_bytes) as log:
        first = log.append([b"first"])[0]
        path = log.segments()[-1].path
        cut = segment_log._HEADER_BYTES + log.end + 2 * segment_log._CLEAN_ZERO_CHECK_BYTES
    if change == "shortened":
        os.truncate(path, cut)
    else:
        with open(path, "ab") as file:
            file.write(b"written after the close")
    with SegmentLog.open(directory, segment_bytes=segment_bytes) as log:
        assert os.path.getsize(path) == segment_bytes
        assert bytes(log.read(first)) == b"first"
        positions = [log.append([bytes([index]) * 3000])[0] for index in range(60)]
        assert segment_log._HEADER_BYTES + positions[-1] > cut
        assert [bytes(log.read(position)) for position in positions] == [bytes([index]) * 3000 for index in range(60)]


def test_the_clean_close_marker_is_synced_under_its_temporary_name_before_the_rename(tmp_path, monkeypatch):
    """The marker is written outside the I/O seam, so no simulated power loss sees it: its whole
    body is synced under the temporary name, then renamed to CLEAN, then the directory is synced.
    Renamed first, a power cut could leave a CLEAN of fewer bytes (or none) under the name."""
    directory = os.path.realpath(str(tmp_path / "log"))
    log = SegmentLog.open(directory)
    log.append([b"one"])
    calls = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append(("fsync", path, os.fstat(fd).st_size if path != directory else None))
        real_fsync(fd)

    def rename(source, target):
        calls.append(("rename", source, target))
        real_rename(source, target)

    monkeypatch.setattr(segment_log.os, "fsync", fsync)
    monkeypatch.setattr(segment_log.os, "rename", rename)
    log.close()
    temporary = calls[0][1]
    assert temporary.startswith(os.path.join(directory, CLEAN_FILE_NAME + "."))
    assert calls == [
        ("fsync", temporary, segment_log._CLEAN_LIST.size + 4),
        ("rename", temporary, os.path.join(directory, CLEAN_FILE_NAME)),
        ("fsync", directory, None),
    ]


@pytest.mark.parametrize("failed", ["sync", "close"])
def test_a_bulk_mode_handle_whose_sync_failed_leaves_no_marker_to_vouch_for_its_end(tmp_path, failed):
    """A failed sync (a call to sync(), or the one close() makes) leaves groups that may not be on
    disk, in any order, under the handle's end. A clean-close marker would vouch for that end: a
    power cut that kept the last group and lost the one before would give a log ending after
    zeros. Without one, the next open scans by the bulk-mode rules (BULK stays) and the log
    ends where the lost group began, the groups synced before it whole."""
    directory = str(tmp_path / "log")
    recorder = RecordingIO()
    log = SegmentLog.open(directory, sync=False, io=recorder)
    durable = log.append([b"durable"])[0]
    log.sync()
    lost, last = log.append([b"lost"])[0], log.append([b"last"])[0]
    fail_the_next_sync(log, recorder, failed)
    assert not os.path.exists(os.path.join(directory, CLEAN_FILE_NAME))
    with open(os.path.join(directory, segment_file_name(0)), "r+b") as file:  # the write the power cut took
        file.seek(segment_log._HEADER_BYTES + lost)
        file.write(bytes(last - lost))
    with SegmentLog.open(directory) as log:
        assert (log.end, scan_all(log)) == (lost, [(durable, b"durable")])


# -- bulk mode and a compaction ---------------------------------------------------------------------


def test_a_detached_bulk_mode_handle_leaves_the_bulk_mark_at_close(tmp_path):
    """detach(): the directory holds another log now (a compaction's switch), whose BULK mark
    is not this handle's to remove, nor its clean-close marker to write."""
    directory = str(tmp_path / "log")
    log = SegmentLog.open(directory, sync=False)
    log.append([b"one"])
    log.detach()
    log.close()
    assert os.path.exists(os.path.join(directory, BULK_FILE_NAME))
    assert not os.path.exists(os.path.join(directory, CLEAN_FILE_NAME))


def test_a_sync_mode_open_makes_a_dead_bulk_mode_writer_s_groups_durable_before_it_removes_bulk(tmp_path):
    """A bulk-mode writer killed with groups not synced: in the same boot the page cache still
    holds them, and a sync-mode open recovers them all. BULK may go only once they are on the
    disk: a power cut before their writeback can keep a later group and lose an earlier one, which
    the bulk-mode rules cut as a torn tail, but the usual rules report as group_damaged (the log
    refused), and the marker of the open's close would give an end past the lost group. Whenever
    the power is cut during that open and close, the log opens to the synced group and a prefix
    of the others."""
    directory = str(tmp_path / "log")
    recorder = RecordingIO()
    log = SegmentLog.open(directory, segment_bytes=SMALL, sync=False, io=recorder)
    log.append([b"durable"])
    log.sync()
    records = [b"durable"] + [bytes([index]) * 5000 for index in range(1, 7)]
    for record in records[1:]:
        log.append([record])
    log._close_quietly()  # killed: no sync, no marker, BULK stays
    reopened_at = len(recorder.operations)
    with SegmentLog.open(directory, segment_bytes=SMALL, io=recorder) as log:
        assert [record for _, record in scan_all(log)] == records
    assert not os.path.exists(os.path.join(directory, BULK_FILE_NAME))
    marker = _marker(directory)
    for crash_at in range(reopened_at, len(recorder.operations) + 1):
        for seed in range(10):
            target = str(tmp_path / f"cut-{crash_at}-{seed}")
            write_crash_state(crash_state(recorder.operations, crash_at, random.Random(seed)), directory, target)
            if crash_at == len(recorder.operations):  # after the close: its marker, synced outside the seam
                _put_marker(target, marker)
            with SegmentLog.open(target) as log:
                served = [record for _, record in scan_all(log)]
            assert served == records[: max(len(served), 1)], (crash_at, seed)


def test_a_sync_mode_open_after_a_crash_makes_what_its_scan_found_durable_before_it_returns(tmp_path):
    """A writer that died after writing a group and before its fdatasync returned (here the sync
    fails; a kill between the two leaves the same files) leaves the group in the page cache only.
    The next open, in the same boot, finds it whole and serves it (and the Authority indexes it
    at once): it must be on the disk before the open returns, or a power cut before the next
    append's sync takes away a group that was already read."""
    directory = str(tmp_path / "log")
    recorder = RecordingIO()
    log = SegmentLog.open(directory, segment_bytes=SMALL, io=recorder)
    log.append([b"durable"])
    recorder.fail_sync_at = recorder.sync_calls  # the next sync: the one of the group below
    with pytest.raises(StorageFailed):
        log.append([b"written, never synced"])
    log._close_quietly()  # the writer dies
    recorder.fail_sync_at = None
    log = SegmentLog.open(directory, segment_bytes=SMALL, io=recorder)
    try:
        served = [record for _, record in scan_all(log)]
        opened = len(recorder.operations)
    finally:
        log._close_quietly()  # the power goes before any append or close
    assert served == [b"durable", b"written, never synced"]
    for seed in range(20):
        target = str(tmp_path / f"cut-{seed}")
        write_crash_state(crash_state(recorder.operations, opened, random.Random(seed)), directory, target)
        with SegmentLog.open(target) as log:
            assert [record for _, record in scan_all(log)] == served, seed


# -- names and the sealed tail ----------------------------------------------------------------------


@pytest.mark.parametrize("name", [segment_file_name(0) + "\n", "\u0660" * 20 + ".seg"], ids=["newline", "unicode_digits"])
def test_a_file_named_almost_like_a_segment_is_ignored(tmp_path, name):
    """A segment name is 20 ASCII digits then .seg and nothing after: a name with a final newline,
    or of other Unicode digits, would be numbered like a segment the log opens by its own name."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory) as log:
        log.append([b"one"])
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    with open(os.path.join(directory, name), "wb") as file:
        file.write(b"not a segment")
    for readonly in (True, False):
        with SegmentLog.open(directory, readonly=readonly) as log:
            assert scan_all(log) == [(0, b"one")]
    assert os.path.exists(os.path.join(directory, name))


def test_a_last_sealed_segment_left_untrimmed_is_trimmed_by_the_writer_s_open(tmp_path):
    """A crash after the seal, before its trim was durable and before the next segment existed:
    the writer's open cuts the file to just past the seal, as it does for any sealed segment."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        for _ in range(100):
            log.append([b"s" * 1000])
        sealed, last = log.segments()[-2:]
    os.unlink(last.path)
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    os.truncate(sealed.path, SMALL)  # the seal's trim never reached the disk
    with SegmentLog.open(directory, readonly=True):
        assert os.path.getsize(sealed.path) == SMALL  # a reader changes nothing
    with SegmentLog.open(directory, segment_bytes=SMALL) as log:
        assert log.end == last.first_position
        assert os.path.getsize(sealed.path) == sealed.used_bytes


# -- the bounds of a group ------------------------------------------------------------------------


def test_a_group_of_one_record_too_many_is_refused_by_its_field_before_anything_is_written(tmp_path):
    """GROUP_RECORDS_MAX + 1 records: LimitExceeded naming ``records`` (the argument), from the
    check before the join; the C writer's own refusal would name its reason instead."""
    with SegmentLog.open(str(tmp_path / "log")) as log:
        with pytest.raises(LimitExceeded) as refused:
            log.append([b""] * (GROUP_RECORDS_MAX + 1))
        assert refused.value.detail["field"] == "records"
        assert log.end == 0
        assert len(log.append([b""] * GROUP_RECORDS_MAX)) == GROUP_RECORDS_MAX
