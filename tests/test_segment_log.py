"""The segment log through its Python API: round trip, rollover, reopen, readers during appends,
locking, closing, and hostile inputs (typed errors, never a crash)."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mwpstore.errors import Corruption, InvalidCommand, LimitExceeded, StorageFailed, StoreClosed, StoreLocked
from mwpstore.io_seam import RecordingIO, crash_state, write_crash_state
from mwpstore.limits import GROUP_RECORDS_MAX, RECORD_BYTES_MAX, SCAN_BATCH_RECORDS_MAX, SEGMENT_BYTES_MIN
from blocking import outcome_within
from segment_readers import directory_switched_at_open
from mwpstore._segment_log_c import ffi, lib
from mwpstore.segment_log import CLEAN_FILE_NAME, RecordBatch, SegmentInfo, SegmentLog, segment_file_name

SMALL = SEGMENT_BYTES_MIN  # 64 KiB segments roll over quickly


def scan_all(log: SegmentLog, start: int = 0, **kwargs: object) -> list[tuple[int, bytes]]:
    return [(p, bytes(r)) for batch in log.scan(start, **kwargs) for p, r in zip(batch.positions, batch.records)]


def random_groups(rng: random.Random, count: int, sizes: tuple[int, ...] = (0, 1, 7, 8, 9, 100, 700, 2000)) -> list[list[bytes]]:
    return [[rng.randbytes(rng.choice(sizes)) for _ in range(rng.choice((1, 1, 2, 3, 8, 20)))] for _ in range(count)]


def test_new_log_is_empty(tmp_path):
    with SegmentLog.open(tmp_path / "log") as log:
        assert (log.start, log.end) == (0, 0)
        assert scan_all(log) == []
        assert [s.first_position for s in log.segments()] == [0]
        assert log.verify() == 0


def test_round_trip_positions_and_bytes(tmp_path):
    rng = random.Random(1)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        written = []
        for group in random_groups(rng, 50):
            end_before = log.end
            positions = log.append(group)
            assert positions[0] == end_before
            assert positions == sorted(set(positions))
            written += list(zip(positions, group))
        assert all(position % 8 == 0 for position, _ in written)
        for position, record in written:
            assert log.read(position) == record
        assert scan_all(log) == written
        assert log.verify() == len(written)


def test_append_accepts_bytes_like_records(tmp_path):
    import array

    with SegmentLog.open(tmp_path) as log:
        wide = memoryview(array.array("I", [1, 2, 3]))
        positions = log.append([b"a", bytearray(b"bc"), memoryview(b"def"), wide])
        assert [log.read(p) for p in positions] == [b"a", b"bc", b"def", wide.tobytes()]


def test_empty_append_writes_nothing(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        assert log.append([]) == []
        assert log.end == 0


def _maps_of(directory: object) -> int:
    """The process's maps of files under ``directory``."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"{directory}/" in line)


def test_a_log_keeps_a_bounded_number_of_sealed_segments_mapped(tmp_path, monkeypatch):
    """Each sealed segment a read touched stayed mapped, with its descriptor (mmap keeps a copy),
    for the handle's life: a process that read a long log once held one per segment. Past the
    bound the least recently read are unmapped; reads of them, and a scan whose segment was
    unmapped while it was suspended, map them again."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 2, raising=False)
    rng = random.Random(5)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        written = []
        for group in random_groups(rng, 300):
            written += list(zip(log.append(group), group))
        assert len(log.segments()) >= 6
        descriptors = len(os.listdir("/proc/self/fd"))
        suspended = log.scan(0, batch_records=5)
        first = next(suspended)
        assert scan_all(log) == written
        assert [log.read(position) for position, _ in written] == [record for _, record in written]
        # at most the bound, the active segment and the one the suspended scan still holds
        assert _maps_of(tmp_path) <= 4
        assert len(os.listdir("/proc/self/fd")) - descriptors <= 4
        rest = [(p, bytes(r)) for batch in suspended for p, r in zip(batch.positions, batch.records)]
        assert list(zip(first.positions, map(bytes, first.records))) + rest == written


def test_the_sealed_segments_a_log_unmaps_are_the_least_recently_read(tmp_path, monkeypatch):
    """With room for two maps, reading sealed segments A, B, A, C unmaps B: A was read after it."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 2)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        while len(log.segments()) < 4:
            log.append([b"x" * 2000] * 8)
        sealed = [info.first_position for info in log.segments()[:3]]
        for first in (sealed[0], sealed[1], sealed[0], sealed[2]):
            log.read(first)
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if str(tmp_path) in line}
        assert {os.path.basename(name) for name in mapped} >= {segment_file_name(sealed[0]), segment_file_name(sealed[2])}
        assert segment_file_name(sealed[1]) not in {os.path.basename(name) for name in mapped}


def test_segments_read_while_active_count_among_the_bounded_maps_once_sealed(tmp_path, monkeypatch):
    """A read maps the active segment too, and only segments sealed when read were counted against
    the bound: a reader following the log's tail (each record read as it is appended) left every
    segment it read mapped, with its descriptor, once the writer sealed it: 12 maps for 12
    segments with room for 2. The writer counts a mapped segment when it seals it."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 2)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        descriptors = len(os.listdir("/proc/self/fd"))
        written = []
        while len(log.segments()) < 12:
            [position] = log.append([b"x" * 2000])
            assert log.read(position) == b"x" * 2000
            written.append(position)
        assert _maps_of(tmp_path) <= 2 + 1  # the bound and the active segment
        assert len(os.listdir("/proc/self/fd")) - descriptors <= 2 + 1
        assert [log.read(position) for position in written] == [b"x" * 2000] * len(written)


def test_a_segment_read_while_active_counts_among_the_bounded_maps_when_its_successor_could_not_be_made(tmp_path, monkeypatch):
    """The other way a segment becomes sealed under a reader: the writer seals it, then fails to
    create the next segment (the handle fails; its segments stay readable). A segment read while
    it was active is counted then too, so the bound still holds: with room for one map, the
    sealed segment read before it is unmapped, and it is the one map of the log."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 1)
    recorder = RecordingIO()
    record = bytes(SMALL // 3)
    with SegmentLog.open(tmp_path / "log", segment_bytes=SMALL, io=recorder) as log:
        older = log.append([record]) + log.append([record])
        [active] = log.append([record])  # rolls over: the first segment sealed
        assert len(log.segments()) == 2
        assert log.read(older[0]) == record  # the sealed segment: counted, mapped
        assert log.read(active) == record  # the active segment: mapped, not counted yet
        assert _maps_of(tmp_path / "log") == 2
        log.append([record])
        recorder.fail_sync_at = recorder.sync_calls + 3  # the group, the seal, the trim; then the new segment
        with pytest.raises(StorageFailed):
            log.append([record])
        assert recorder.failures == 1
        assert [info.sealed for info in log.segments()] == [True, True]
        assert _maps_of(tmp_path / "log") == 1
        assert [segment.first_position for segment in log._mapped_sealed] == [log.segments()[1].first_position]
        assert log.read(active) == record and log.read(older[0]) == record


def test_reads_from_many_threads_beside_appends_read_every_record_right_with_few_maps(tmp_path, monkeypatch):
    """Sealed segments are unmapped and mapped again while other threads read and scan them
    (segment_log.SEGMENT_MAPS_MAX, here 2), beside appends that roll the log over and a read-only
    view of the same log: every record any of them reads is the one written there."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 2)
    rng = random.Random(11)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL, sync=False) as log:
        written: dict[int, bytes] = {}
        for group in random_groups(rng, 150, sizes=(0, 9, 300, 1200)):
            written.update(zip(log.append(group), group))
        assert len(log.segments()) >= 6
        stop = threading.Event()
        failures: list[BaseException] = []
        checked = [0]

        def reader(handle: SegmentLog, seed: int) -> None:
            mine = random.Random(seed)
            try:
                while not stop.is_set() or checked[0] < 200:
                    end = handle.end  # a view's stays where it opened
                    known = dict(written)  # only what an append has returned
                    positions = sorted(position for position in known if position < end)
                    if mine.random() < 0.5:
                        start = mine.choice(positions[: len(positions) // 2])
                        for batch in handle.scan(start, end=end, batch_records=mine.choice((1, 7, 64))):
                            for position, record in zip(batch.positions, batch.records):
                                assert bytes(record) == known[position], position
                                checked[0] += 1
                    else:
                        for position in mine.sample(positions, 40):
                            assert handle.read(position) == known[position], position
                            checked[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
                stop.set()

        with SegmentLog.open(tmp_path, readonly=True) as view:
            threads = [threading.Thread(target=reader, args=(log, seed)) for seed in range(3)]
            threads.append(threading.Thread(target=reader, args=(view, 99)))
            for thread in threads:
                thread.start()
            try:
                for group in random_groups(rng, 150, sizes=(0, 9, 300, 1200)):
                    positions = log.append(group)
                    written.update(zip(positions, group))
                    if failures:
                        break
            finally:
                stop.set()
                for thread in threads:
                    thread.join(60)
        assert not failures, failures[0]
        assert checked[0] >= 200
        assert scan_all(log) == sorted(written.items())
        assert _maps_of(tmp_path) <= 2 + 1  # the bound and the active segment, once every read is done


def test_a_read_that_found_its_segment_mapped_reads_it_when_another_thread_unmaps_it(tmp_path, monkeypatch):
    """A segment is mapped at its first read and unmapped when it is the least recently read
    beyond the bound. A read that had found the map present and was then overtaken by the unmap
    raised a bare ``AssertionError`` (without ``-O``: a ``TypeError``, the map gone): the map and
    its C pointer were two attributes, read one after the other. Now they are one, taken once.
    The reading thread is held (``sys.settrace``) right after the first line of
    ``_Segment.mapping``, while the main thread's read of another sealed segment unmaps its one
    (room for one map)."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 1)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        while len(log.segments()) < 3:
            log.append([b"x" * 2000] * 8)
        first, second = [info.first_position for info in log.segments()[:2]]
        assert log.read(first) == b"x" * 2000  # mapped
        held, go = threading.Event(), threading.Event()
        mapping = segment_log._Segment.mapping.__code__

        def trace(frame, event, arg):
            if frame.f_code is not mapping:
                return None
            lines = [0]

            def in_mapping(frame, event, arg):
                if event == "line":
                    lines[0] += 1
                    if lines[0] == 2:  # the first line has run: the map was looked up
                        held.set()
                        go.wait(10)
                return in_mapping

            return in_mapping

        outcome: list[object] = []

        def reader() -> None:
            sys.settrace(trace)
            try:
                outcome.append(log.read(first))
            except BaseException as exc:  # noqa: BLE001 - the assertion below shows it
                outcome.append(exc)
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=reader)
        thread.start()
        assert held.wait(10)
        assert log.read(second) == b"x" * 2000  # unmaps the first segment
        go.set()
        thread.join(60)
        assert outcome == [b"x" * 2000]


def test_rollover_seals_segments_and_keeps_positions_contiguous(tmp_path):
    rng = random.Random(2)
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        written = []
        for group in random_groups(rng, 150):
            written += list(zip(log.append(group), group))
        infos = log.segments()
        assert len(infos) >= 3
        assert all(isinstance(info, SegmentInfo) for info in infos)
        assert [info.sealed for info in infos] == [True] * (len(infos) - 1) + [False]
        for earlier, later in zip(infos, infos[1:]):
            # A sealed segment is trimmed to its seal; the next one starts where the seal ends.
            assert earlier.size_bytes == earlier.used_bytes
            assert later.first_position == earlier.first_position + earlier.used_bytes - 64 - 32
            assert os.path.basename(later.path) == segment_file_name(later.first_position)
        assert infos[-1].size_bytes == SMALL
        # The active segment is used up to the end only, not to its preallocated size.
        assert infos[-1].used_bytes == 64 + log.end - infos[-1].first_position < SMALL
        assert scan_all(log) == written
        # Scans starting at every record position, in small batches, across segment boundaries.
        for index in range(0, len(written), 37):
            assert scan_all(log, written[index][0], batch_records=5) == written[index:]


def test_group_never_spans_segments(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        log.append([b"x" * 40_000])
        positions = log.append([b"y" * 30_000])  # does not fit the rest: a new segment
        assert positions == [log.segments()[1].first_position]


def test_group_larger_than_a_segment_is_limit_exceeded(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        with pytest.raises(LimitExceeded):
            log.append([b"z" * (SMALL - 64)])
        with pytest.raises(LimitExceeded):
            log.append([b"z" * 30_000, b"z" * 30_000, b"z" * 30_000])
        assert log.end == 0
        log.append([b"still fine"])


def test_the_fit_of_a_group_at_its_edges(tmp_path):
    """A group must fit with room left for the seal (header 64 bytes, a record frame 16 bytes and
    its payload rounded up to 8, a commit frame 32, a seal 32). In an empty segment: a group that
    leaves exactly the seal's room is accepted, one 8 bytes larger is LimitExceeded. In an active
    segment with groups: a group that leaves exactly the seal's room is written there, not after
    a rollover; the next group rolls over, and the seal fills the segment to its last byte."""
    with SegmentLog.open(tmp_path / "empty", segment_bytes=SMALL) as log:
        with pytest.raises(LimitExceeded):
            log.append([bytes(SMALL - 64 - 16 - 32 - 32 + 8)])
        assert log.end == 0
        log.append([bytes(SMALL - 64 - 16 - 32 - 32)])
        assert [(info.used_bytes, info.sealed) for info in log.segments()] == [(SMALL - 32, False)]
    with SegmentLog.open(tmp_path / "active", segment_bytes=SMALL) as log:
        log.append([b"a"])  # 24 + 32 bytes
        log.append([bytes(SMALL - 64 - 56 - 16 - 32 - 32)])
        assert [(info.used_bytes, info.sealed) for info in log.segments()] == [(SMALL - 32, False)]
        log.append([b"b"])
        infos = log.segments()
        assert [(info.size_bytes, info.used_bytes, info.sealed) for info in infos[:1]] == [(SMALL, SMALL, True)]
        assert infos[1].first_position == SMALL - 64 - 32 == log.end - 56


def test_a_group_reaching_unwritten_space_is_written_with_zeros_ahead(tmp_path):
    """Zero ahead (docs/format/segment.md): a group that reaches space not written since the open
    goes out in its one pwrite together with 1 MiB of zeros after it (up to the segment's end at
    most), so later groups overwrite zeros instead of converting unwritten extents in their
    fdatasync. A group inside space already zeroed is written alone."""
    mib = 1024 * 1024
    recorder = RecordingIO()
    path = tmp_path / "log"
    log = SegmentLog.open(path, segment_bytes=4 * mib, io=recorder)

    def written(records: list[bytes]) -> tuple[int, int]:
        group = sum(8 * ((16 + len(record) + 7) // 8) for record in records) + 32
        start = len(recorder.operations)
        log.append(records)
        [(_, _, offset, data)] = [operation for operation in recorder.operations[start:] if operation[0] == "write"]
        assert data[group:] == bytes(len(data) - group)
        return offset, len(data) - group  # where the group went, and the zeros after it

    assert written([b"a"]) == (64, mib)  # 24 + 32 bytes, the first group of the segment
    assert written([b"b"]) == (120, 0)
    log.close()
    log = SegmentLog.open(path, segment_bytes=4 * mib, io=recorder)  # zeroed space is counted from the open
    assert written([b"c"]) == (176, mib)
    assert written([bytes(mib - 40)]) == (232, mib)  # ends 8 bytes past the zeroed space
    assert written([bytes(2 * mib - 48)]) == (mib + 240, 4 * mib - (3 * mib + 240))  # up to the end only
    log.close()


def test_reopen_sees_everything(tmp_path):
    rng = random.Random(3)
    written = []
    for round_number in range(4):
        with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
            assert scan_all(log) == written
            for group in random_groups(rng, 30):
                written += list(zip(log.append(group), group))
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert scan_all(log) == written
        assert log.end == written[-1][0] + 8 * ((16 + len(written[-1][1]) + 7) // 8) + 32


def test_reopen_with_another_segment_size_keeps_old_segments(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        first = [log.append([b"a" * 1000])[0] for _ in range(100)]
    with SegmentLog.open(tmp_path, segment_bytes=2 * SMALL) as log:
        second = [log.append([b"b" * 1000])[0] for _ in range(200)]
        assert [log.read(p) for p in first] == [b"a" * 1000] * 100
        assert [log.read(p) for p in second] == [b"b" * 1000] * 200
        assert log.segments()[-1].size_bytes == 2 * SMALL


def test_segments_give_each_files_size_whether_mapped_before_its_seal_or_never_mapped(tmp_path):
    """segments() takes a mapped segment's size from the file its map keeps (fstat), not from the
    map's length: a segment mapped while it was active (at its preallocated size) and trimmed to
    its seal since is given at its trimmed size, in the writer and in a read-only log. A segment
    not mapped (a clean reopen maps none) is given by its name."""

    def on_disk(log: SegmentLog) -> list[int]:
        return [os.stat(info.path).st_size for info in log.segments()]

    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        log.append([b"a" * 1000])
        with SegmentLog.open(tmp_path, readonly=True) as reader:
            assert scan_all(reader) and log.read(0) == b"a" * 1000  # both map the active segment
            while len(log.segments()) < 3:
                log.append([b"b" * 1000])
            sealed = os.stat(log.segments()[0].path).st_size
            assert sealed < SMALL
            assert [info.size_bytes for info in reader.segments()] == [sealed]
            assert [info.size_bytes for info in log.segments()] == on_disk(log) == [sealed, *on_disk(log)[1:-1], SMALL]
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        assert _maps_of(tmp_path) == 0
        assert [info.size_bytes for info in log.segments()] == on_disk(log) == [sealed, *on_disk(log)[1:-1], SMALL]


@pytest.mark.parametrize("error", [ValueError("mmap closed or invalid"), OSError(errno.EIO, "fstat")], ids=["closed", "fstat-failed"])
def test_a_segment_whose_map_was_closed_meanwhile_is_given_its_size_by_name(tmp_path, error):
    """Another thread may unmap a segment (unmap(), the bounded set of maps) while segments() asks
    its map for the size: a closed map raises ValueError. The size then comes from the name, and
    nothing untyped escapes segments()."""

    class Unmapped:
        def size(self) -> int:
            raise error

    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        log.append([b"a" * 1000])
        assert log.read(0) == b"a" * 1000
        segment = log._segments[0]
        view = segment._view
        segment._view = (view[0], Unmapped())
        try:
            assert [info.size_bytes for info in log.segments()] == [SMALL]
        finally:
            segment._view = view


def test_a_read_only_view_gives_the_size_of_the_file_it_mapped_not_of_the_name(tmp_path):
    """A read-only view maps every segment as it opens and reads those files (beside a compaction
    the names may by then be another log's files). ``segments()`` gives each one's size from its
    map, not from whatever file now has its name: a sealed segment's name replaced by a file of
    another size does not change what the view says of it."""
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        while len(log.segments()) < 3:
            log.append([b"x" * 2000] * 8)
        with SegmentLog.open(tmp_path, readonly=True) as view:
            before = [info.size_bytes for info in view.segments()]
            path = view.segments()[0].path
            with open(path + ".new", "wb") as other:
                other.write(b"\0" * 4096)
            os.replace(path + ".new", path)
            assert [info.size_bytes for info in view.segments()] == before
            assert before[0] != 4096


def test_group_ends_at_names_every_group_end_and_nothing_else_across_sealed_segments(tmp_path):
    """What the open asks of an index's position (docs/recovery.md, step 4): the log's start and
    each group's end are, a sealed segment's last one (its seal's position) too; a record's start
    inside a group, a frame's inside and past the end are not; after a clean reopen as well."""
    rng = random.Random(5)
    ends, starts = [0], []
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        for group in random_groups(rng, 120):
            starts += log.append(group)
            ends.append(log.end)
        assert len(log.segments()) >= 3
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        assert all(log.group_ends_at(end) for end in ends)
        assert {info.first_position for info in log.segments()} <= set(ends)
        inside = [start for start in starts if start not in ends] + [ends[-1] - 8, ends[-1] + 8, ends[-1] + 64, 3]
        assert not any(log.group_ends_at(position) for position in inside)
        for wrong in (-8, 8.0, None):
            with pytest.raises(InvalidCommand):
                log.group_ends_at(wrong)


def test_an_empty_active_segment_too_small_for_a_group_is_replaced_not_sealed(tmp_path):
    """A log reopened with larger segments whose active segment is still empty, given a group only
    the larger size holds: the writer sealed the empty segment, then created its successor under
    the same name (a seal takes no position) and renamed it over the sealed file. The handle's
    map and header were of the old file, so the acknowledged group read as "not a record" until
    a reopen, and a crash between the two steps left a segment sealed at its own first position.
    Now the empty segment is replaced by a larger one under its name, which the handle maps."""
    directory = tmp_path / "log"
    SegmentLog.open(directory, segment_bytes=SMALL).close()
    record = b"r" * (SMALL + 1000)
    recorder = RecordingIO(directory=str(directory))
    with SegmentLog.open(directory, segment_bytes=4 * SMALL, io=recorder) as log:
        recorder.mark("begin")
        assert log.append([record]) == [0]
        recorder.mark("acknowledged")
        assert log.read(0) == record
        assert scan_all(log) == [(0, record)]
        assert [(info.first_position, info.size_bytes, info.sealed) for info in log.segments()] == [(0, 4 * SMALL, False)]
        assert log.verify() == 1
    operations = recorder.operations
    acknowledged_at = operations.index(("mark", "acknowledged", None))
    for crash_at in range(operations.index(("mark", "begin", None)), len(operations) + 1):
        target = tmp_path / f"crash-{crash_at}"
        write_crash_state(crash_state(operations, crash_at, random.Random(crash_at)), str(directory), str(target))
        with SegmentLog.open(target, segment_bytes=4 * SMALL) as reopened:
            assert [info.first_position for info in reopened.segments()] == [0]
            found = scan_all(reopened)
            assert found == [(0, record)] if crash_at > acknowledged_at else found in ([], [(0, record)])
            end = reopened.end
            assert reopened.append([b"next"]) == [end]
            assert reopened.read(end) == b"next"


def test_close_in_bulk_mode_makes_every_group_durable(tmp_path):
    """Bulk mode defers the groups' fdatasync; close() is their acknowledgement, as sync() would
    be. Whatever a power cut right after the close keeps or drops of what was never synced, every
    group is there."""
    directory = tmp_path / "log"
    recorder = RecordingIO()
    with SegmentLog.open(directory, segment_bytes=SMALL, sync=False, io=recorder) as log:
        written = [(position, record) for record in (b"one", b"two" * 100, b"three") for position in log.append([record])]
    operations = recorder.operations
    for seed in range(20):
        target = tmp_path / f"crash-{seed}"
        write_crash_state(crash_state(operations, len(operations), random.Random(seed)), str(directory), str(target))
        with SegmentLog.open(target, segment_bytes=SMALL, readonly=True) as reopened:
            assert scan_all(reopened) == written


def test_the_bulk_mark_is_created_once_and_an_existing_one_is_kept(tmp_path):
    """sl_create_empty_file makes BULK an empty file, durably, and closes what it opened; a file
    already there under that name is success and is left as it is (only the name counts)."""
    directory = str(tmp_path)
    path = os.path.join(directory, "BULK")
    fault = ffi.new("struct sl_fault *")
    descriptors = sorted(os.listdir("/proc/self/fd"))
    assert lib.sl_create_empty_file(lib.sl_io_default(), os.fsencode(directory), os.fsencode(path), fault) == lib.SL_OK
    assert os.path.getsize(path) == 0
    assert sorted(os.listdir("/proc/self/fd")) == descriptors  # the new file's descriptor is closed
    with open(path, "wb") as file:
        file.write(b"left by someone")
    assert lib.sl_create_empty_file(lib.sl_io_default(), os.fsencode(directory), os.fsencode(path), fault) == lib.SL_OK
    with open(path, "rb") as file:
        assert file.read() == b"left by someone"


def test_a_handle_whose_sync_failed_closes_without_a_clean_marker(tmp_path):
    """The marker stands for a clean close (docs/format/segment.md: no failed sync, everything
    durable): a handle whose sync failed closes without writing one, and the next open scans."""
    recorder = RecordingIO()
    with SegmentLog.open(tmp_path / "log", sync=False, io=recorder) as log:
        log.append([b"one"])
        recorder.fail_sync_at = recorder.sync_calls
        with pytest.raises(StorageFailed):
            log.sync()
    assert recorder.failures == 1
    assert not os.path.exists(tmp_path / "log" / CLEAN_FILE_NAME)


@pytest.mark.parametrize("failed", ["sync", "close"])
def test_a_bulk_mode_handle_whose_sync_failed_leaves_the_bulk_mark(tmp_path, failed):
    """BULK goes only once every group is durable: after a failed sync (a call to sync(), or the
    one close() makes), groups may not be on disk while later ones are, so the next open must
    still recover under the bulk-mode rules."""
    recorder = RecordingIO()
    log = SegmentLog.open(tmp_path / "log", sync=False, io=recorder)
    log.append([b"one"])
    fail_the_next_sync(log, recorder, failed)
    assert os.path.exists(tmp_path / "log" / "BULK")


def fail_the_next_sync(log: SegmentLog, recorder: RecordingIO, failed: str) -> None:
    """Make the next sync of the bulk-mode ``log`` (written through ``recorder``) fail and close
    the log: ``failed`` "sync" fails a call to sync(), "close" the sync close() makes."""
    recorder.fail_sync_at = recorder.sync_calls
    if failed == "sync":
        with pytest.raises(StorageFailed):
            log.sync()
        log.close()
    else:
        with pytest.raises(StorageFailed):
            log.close()
    assert recorder.failures == 1


def test_scan_end_and_next_position(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        positions = [log.append([bytes([i]) * i])[0] for i in range(1, 20)]
        batches = list(log.scan(positions[3], end=positions[10], batch_records=3))
        assert all(isinstance(batch, RecordBatch) for batch in batches)
        assert [p for batch in batches for p in batch.positions] == positions[3:10]
        assert [len(batch) for batch in batches] == [3, 3, 1]
        # next_position resumes exactly where the batch stopped.
        resumed = scan_all(log, batches[0].next_position)
        assert [p for p, _ in resumed] == positions[6:]
        assert list(log.scan(log.end)) == []


def test_scanned_records_are_bytes_the_caller_keeps(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        log.append([b"first", b"second", b"third"])
        iterator = log.scan(0, batch_records=1)
        kept = next(iterator).records[0]
        next(iterator)
        assert type(kept) is bytes
    assert kept == b"first"


def test_a_scan_with_split_tags_hands_each_first_byte_apart(tmp_path):
    """split_tags: each record without its first byte, the first bytes in ``tags``; an empty
    record has no first byte, so ``tags`` is then shorter than ``records`` (a caller that
    compares the tags with what it expects sees it)."""
    with SegmentLog.open(tmp_path) as log:
        log.append([b"Efirst", b"A", b"Xthird"])
        log.append([b"", b"Elast"])
        (whole,) = list(log.scan(0))
        (split,) = list(log.scan(0, split_tags=True))
        assert whole.tags is None
        assert split.positions == whole.positions and split.next_position == whole.next_position
        assert split.records == [b"first", b"", b"third", b"", b"last"]
        assert split.tags == b"EAXE"
        assert all(type(record) is bytes for record in split.records)
        with pytest.raises(InvalidCommand) as caught:
            log.scan(0, split_tags=1)
        assert caught.value.field == "split_tags"


def test_record_bytes_copies_each_record_and_reads_nothing_outside_the_data():
    """``_index_c.record_bytes``, what a scan's batches are made with: record i is
    data[starts[i]:stops[i]] as bytes (with ``split_tags``, its first byte in the tags and the
    rest in the list; an empty record gives b"" and no tag); an offset outside the data, a stop
    before its start, or arrays of two lengths are ValueError before anything is copied."""
    import struct

    from mwpstore._index_c import record_bytes

    data = b"..Efirst...A.Xthird..Elast"

    def offsets(values: list[int]) -> bytes:
        return struct.pack(f"={len(values)}Q", *values)

    starts, stops = [2, 11, 13, 20, 21], [8, 12, 19, 20, 26]
    assert record_bytes(data, offsets(starts), offsets(stops), False) == [data[a:b] for a, b in zip(starts, stops)]
    records, tags = record_bytes(memoryview(data), offsets(starts), offsets(stops), True)
    assert records == [b"first", b"", b"third", b"", b"last"] and tags == b"EAXE"
    assert all(type(record) is bytes for record in records)
    assert record_bytes(data, b"", b"", True) == ([], b"") and record_bytes(data, b"", b"", False) == []
    assert record_bytes(data, offsets([0]), offsets([len(data)]), False) == [data]
    for bad_starts, bad_stops in (([0], [len(data) + 1]), ([5], [4]), ([2**64 - 1], [2**64 - 1]), ([0, 1], [1])):
        with pytest.raises(ValueError):
            record_bytes(data, offsets(bad_starts), offsets(bad_stops), True)
    with pytest.raises(ValueError):
        record_bytes(data, offsets([0])[:7], offsets([0])[:7], False)


def test_a_new_log_directory_is_made_durable_in_its_parent(tmp_path):
    """The directory a new log creates is an entry of its parent: without a sync of the parent, a
    power cut can take the directory, and every acknowledged group in it, away. The crash model
    does not see directories as entries, so the order of the calls is what is checked: the
    parent is synced before the first segment is created in the new directory."""
    recorder = RecordingIO()
    with SegmentLog.open(tmp_path / "a" / "log", io=recorder) as log:
        log.append([b"first"])
    operations = recorder.operations
    first_create = next(index for index, operation in enumerate(operations) if operation[0] == "create")
    assert ("dirsync", str(tmp_path / "a")) in operations[:first_create]


def test_a_group_whose_sync_failed_is_never_visible_to_readers(tmp_path):
    """The end a failed append publishes is the end before it: readers of the same handle never
    see a group whose fdatasync failed (its bytes may be in the page cache, never on disk)."""
    recorder = RecordingIO()
    with SegmentLog.open(tmp_path / "log", io=recorder) as log:
        kept = log.append([b"kept"])
        end = log.end
        recorder.fail_sync_at = recorder.sync_calls
        with pytest.raises(StorageFailed):
            log.append([b"failed"])
        assert recorder.failures == 1
        assert log.end == end
        assert scan_all(log) == [(kept[0], b"kept")]
        with pytest.raises(InvalidCommand):
            log.read(end)


def test_a_segment_sealed_before_its_successor_failed_is_reported_sealed(tmp_path):
    """A rollover whose seal is durable but whose next segment cannot be made fails the handle;
    the segment it sealed is sealed all the same. The failed handle reports it so (sealed, used
    up to the end of its seal, trimmed there), as the next open finds it."""
    recorder = RecordingIO()
    record = bytes(SMALL // 3)
    with SegmentLog.open(tmp_path / "log", segment_bytes=SMALL, io=recorder) as log:
        positions = log.append([record]) + log.append([record])
        end = log.end
        recorder.fail_sync_at = recorder.sync_calls + 3  # the groups, the seal, the trim; then the new segment
        with pytest.raises(StorageFailed):
            log.append([record])
        assert recorder.failures == 1 and log.end == end
        [info] = log.segments()
        used = lib.SL_SEGMENT_HEADER_BYTES + end + lib.SL_SEAL_FRAME_BYTES
        assert (info.sealed, info.used_bytes, info.size_bytes) == (True, used, used)
        assert scan_all(log) == [(position, record) for position in positions]
    with SegmentLog.open(tmp_path / "log", segment_bytes=SMALL) as log:
        assert log.segments()[0] == info
        assert scan_all(log) == [(position, record) for position in positions]


def test_every_directory_a_new_log_creates_is_made_durable_in_its_parent(tmp_path):
    """A log opened where several directories are missing creates each of them; each is an entry
    of its own parent, so each parent is synced before the first segment is created. A sync of
    the log directory's parent alone leaves the directories above it to a power cut, and the log
    with them."""
    recorder = RecordingIO()
    with SegmentLog.open(tmp_path / "a" / "b" / "log", io=recorder) as log:
        log.append([b"first"])
    operations = recorder.operations
    first_create = next(index for index, operation in enumerate(operations) if operation[0] == "create")
    synced = [operation[1] for operation in operations[:first_create] if operation[0] == "dirsync"]
    assert synced == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]


def test_readonly_does_not_lock_or_write(tmp_path):
    with SegmentLog.open(tmp_path) as writer:
        writer.append([b"one"])
        with SegmentLog.open(tmp_path, readonly=True) as reader:
            assert scan_all(reader) == [(0, b"one")]
            with pytest.raises(InvalidCommand):
                reader.append([b"two"])
            reader.sync()


def test_known_end_is_a_position_for_a_readonly_open_only(tmp_path):
    with SegmentLog.open(tmp_path) as writer:
        writer.append([b"one"])
        end = writer.end
        writer.append([b"two"])
        for options in ({"known_end": end}, {"readonly": True, "known_end": -1}, {"readonly": True, "known_end": True}):
            with pytest.raises(InvalidCommand) as refused:
                SegmentLog.open(tmp_path, **options)
            assert refused.value.detail["field"] == "known_end"
        with SegmentLog.open(tmp_path, readonly=True, known_end=end) as reader:
            assert reader.end == end and scan_all(reader) == [(0, b"one")]


def test_a_readonly_open_keeps_reading_the_files_it_opened_after_its_directory_is_replaced(tmp_path):
    """What a compaction does to a log beside a reader: the directory renamed away, a new log of
    other records (another log id) under the old name, the old directory deleted. The reader
    opened its sealed segments by name at their first read: it got the new log's files (their
    frame checksums fail: CORRUPTION) or no file (STORAGE_FAILED)."""
    import shutil

    directory, old, rng = str(tmp_path / "log"), str(tmp_path / "log.old"), random.Random(7)
    with SegmentLog.open(directory, segment_bytes=SMALL) as writer:
        for group in random_groups(rng, 150, sizes=(700, 2000)):
            writer.append(group)
        expected = scan_all(writer)
        assert len(writer.segments()) > 2
    with SegmentLog.open(directory, readonly=True) as reader:
        os.rename(directory, old)
        with SegmentLog.open(directory, segment_bytes=SMALL) as replacement:
            for group in random_groups(rng, 150, sizes=(700, 2000)):
                replacement.append(group)
        shutil.rmtree(old)
        assert scan_all(reader) == expected
        assert [bytes(reader.read(position)) for position, _ in expected] == [record for _, record in expected]
        assert reader.verify() == len(expected)


def test_a_readonly_open_whose_directory_is_replaced_while_it_opens_is_corruption_not_an_empty_log(tmp_path, monkeypatch):
    """The directory is replaced (as by a compaction) after the open read the last segment's header
    and before it read the segment's bytes, and a writer holds the new log: the recovery read the
    new log's file with the old header, whose log id seeds the frame checksums, took its first
    group for one in flight and served a log of no records. Each read of a file by name now checks
    that its header is the one the open read there."""
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory) as first:
        for index in range(20):
            first.append([b"first %d" % index])
    os.remove(os.path.join(directory, CLEAN_FILE_NAME))  # the open recovers the segment (reads it by name)
    with directory_switched_at_open(monkeypatch, directory) as writers:  # a live writer holds the new log
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True).close()
        assert caught.value.detail["reason"] == "segment_replaced"
        monkeypatch.undo()
        with SegmentLog.open(directory, readonly=True) as reader:  # opened again: the new log, whole
            assert scan_all(reader) == scan_all(writers[0])


def test_readonly_on_missing_directory_is_storage_failed(tmp_path):
    with pytest.raises(StorageFailed):
        SegmentLog.open(tmp_path / "absent", readonly=True)
    assert not (tmp_path / "absent").exists()


def test_second_writer_is_store_locked(tmp_path):
    with SegmentLog.open(tmp_path):
        with pytest.raises(StoreLocked) as caught:
            SegmentLog.open(tmp_path)
        assert caught.value.code == "STORE_LOCKED"
    SegmentLog.open(tmp_path).close()  # the lock went with the first handle


def test_second_writer_in_another_process_is_store_locked(tmp_path):
    program = (
        "import sys\n"
        "from mwpstore.segment_log import SegmentLog\n"
        "from mwpstore.errors import StoreLocked\n"
        "try:\n"
        "    SegmentLog.open(sys.argv[1])\n"
        "except StoreLocked:\n"
        "    sys.exit(7)\n"
    )
    with SegmentLog.open(tmp_path):
        result = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True)
        assert result.returncode == 7, result.stderr
    result = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True)
    assert result.returncode == 0, result.stderr


def test_every_call_after_close_is_store_closed(tmp_path):
    log = SegmentLog.open(tmp_path)
    position = log.append([b"x"])[0]
    pending_scan = log.scan(0)
    log.close()
    log.close()  # idempotent
    for call in (
        lambda: log.append([b"y"]),
        lambda: log.read(position),
        lambda: log.scan(0),
        lambda: next(pending_scan),
        lambda: log.segments(),
        lambda: log.sync(),
        lambda: log.verify(),
        lambda: log.start,
        lambda: log.end,
    ):
        with pytest.raises(StoreClosed):
            call()


@pytest.mark.parametrize(
    "records",
    [b"bytes, not a list", "text", bytearray(b"x"), 17, None, [b"ok", "text"], [b"ok", 5], [None], (x for x in [b"gen"])],
)
def test_hostile_records_are_invalid_command(tmp_path, records):
    with SegmentLog.open(tmp_path) as log:
        with pytest.raises(InvalidCommand):
            log.append(records)
        assert log.end == 0
        log.append([b"the log still works"])


def test_oversize_inputs_are_limit_exceeded(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        with pytest.raises(LimitExceeded):
            log.append([bytes(RECORD_BYTES_MAX + 1)])
        with pytest.raises(LimitExceeded):
            log.append([b""] * (GROUP_RECORDS_MAX + 1))
        with pytest.raises(LimitExceeded):
            log.scan(0, batch_records=SCAN_BATCH_RECORDS_MAX + 1)
        with pytest.raises(LimitExceeded):
            log.scan(0, batch_records=0)
        assert log.end == 0
        position = log.append([bytes(RECORD_BYTES_MAX)])[0]  # exactly at the bound is fine
        assert len(log.read(position)) == RECORD_BYTES_MAX


@pytest.mark.parametrize("segment_bytes", [0, 4096, SEGMENT_BYTES_MIN + 1, 2**40, -65536, 65536.0, True, "65536"])
def test_bad_segment_bytes_are_rejected(tmp_path, segment_bytes):
    with pytest.raises((InvalidCommand, LimitExceeded)):
        SegmentLog.open(tmp_path, segment_bytes=segment_bytes)


def test_bad_positions_are_typed_errors(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        positions = log.append([b"a" * 100, b"b" * 5])
        for bad in (-8, -1, 1, 3, positions[0] + 8, positions[0] + 16, positions[1] + 8, log.end, log.end + 8, 2**64, 2**80):
            with pytest.raises(InvalidCommand):
                log.read(bad)
        for bad in (1.0, "0", None, True, b"\x00"):
            with pytest.raises(InvalidCommand):
                log.read(bad)
        # The commit record that ends the group is not a record either.
        with pytest.raises(InvalidCommand):
            log.read(log.end - 32)
        for bad in (-8, 4, positions[0] + 24, log.end + 8):
            with pytest.raises(InvalidCommand):
                list(log.scan(bad))
        with pytest.raises(InvalidCommand):
            log.scan(0, end=log.end + 8)
        with pytest.raises(InvalidCommand):
            log.scan(0, batch_records="10")


def test_payload_that_imitates_a_frame_is_not_a_record_start(tmp_path):
    # A record whose bytes look like a frame header for the position inside it: without the
    # log's id in the checksum it would pass; with it, it cannot be forged without the id.
    import struct

    with SegmentLog.open(tmp_path) as log:
        end = log.end
        inner_position = end + 16
        fake = struct.pack("<IIQ", 0, (1 << 28) | 8, inner_position) + b"12345678"
        log.append([fake])
        with pytest.raises(InvalidCommand):
            log.read(inner_position)


def test_concurrent_readers_see_only_whole_groups(tmp_path):
    rng = random.Random(4)
    groups = random_groups(rng, 300, sizes=(0, 10, 300, 1200))
    with SegmentLog.open(tmp_path, segment_bytes=SMALL, sync=False) as log:
        group_ends: list[int] = []
        ends_lock = threading.Lock()
        stop = threading.Event()
        failures: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    end = log.end
                    got = scan_all(log, end=end)
                    # Every record seen belongs to a group the writer finished, and all of it.
                    # (The writer notes the end just after append returns: wait for the note.)
                    for _ in range(10_000):
                        with ends_lock:
                            known = list(group_ends)
                        if end == 0 or end in known or (known and known[-1] > end):
                            break
                        stop.wait(0.001)
                    assert end in known or end == 0
                    expected = [(p, r) for group, positions in written[: known.index(end) + 1 if end else 0] for p, r in zip(positions, group)]
                    assert got == expected
                    if got:
                        position, record = got[len(got) // 2]
                        assert log.read(position) == record
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)

        written: list[tuple[list[bytes], list[int]]] = []
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            for group in groups:
                positions = log.append(group)
                written.append((group, positions))
                with ends_lock:
                    group_ends.append(log.end)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert not failures, failures[0]
        assert len(log.segments()) > 2


def test_bulk_mode_is_durable_after_sync_and_close(tmp_path):
    with SegmentLog.open(tmp_path, sync=False) as log:
        positions = log.append([b"bulk"] * 1000)
        log.sync()
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert [log.read(p) for p in positions[:3]] == [b"bulk"] * 3


def test_foreign_files_in_the_directory_are_ignored(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        log.append([b"x"])
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "123.seg").write_bytes(b"not a segment name")
    with SegmentLog.open(tmp_path) as log:
        assert scan_all(log) == [(0, b"x")]


def test_leftover_temporary_segment_is_removed(tmp_path):
    with SegmentLog.open(tmp_path) as log:
        log.append([b"x"])
    leftover = tmp_path / (segment_file_name(4096) + ".tmp")
    leftover.write_bytes(b"half-made")
    with SegmentLog.open(tmp_path, readonly=True) as log:  # it may be the writer's segment in the making
        assert leftover.exists()
        assert scan_all(log) == [(0, b"x")]
    with SegmentLog.open(tmp_path) as log:
        assert not leftover.exists()
        assert scan_all(log) == [(0, b"x")]


def test_readonly_open_of_an_empty_directory_creates_no_segment(tmp_path):
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert log.end == 0 and scan_all(log) == []
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("closed", [True, False], ids=["clean close", "after a crash"])
def test_a_readonly_open_whose_read_of_the_last_segment_fails_is_storage_failed(tmp_path, monkeypatch, closed):
    """A read-only open reads the last segment with pread (its clean-close check and its
    recovery): an I/O error there is StorageFailed naming the segment, never a raw OSError."""
    log = SegmentLog.open(tmp_path)
    log.append([b"r" * 100])
    last = log.segments()[-1].path
    if closed:
        log.close()
    try:
        def failing_pread(fd, length, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "pread", failing_pread)
        with pytest.raises(StorageFailed) as caught:
            SegmentLog.open(tmp_path, readonly=True)
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.EIO and caught.value.detail["path"] == last
    finally:
        log.close()


def test_misnamed_segment_is_corruption(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        for _ in range(100):
            log.append([b"q" * 1000])
        infos = log.segments()
    os.rename(infos[1].path, os.path.join(tmp_path, segment_file_name(infos[1].first_position + 8)))
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(tmp_path, readonly=True)
    assert caught.value.detail["reason"] in ("segment_name", "segment_missing")


def test_missing_middle_segment_is_corruption(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        for _ in range(150):
            log.append([b"q" * 1000])
        infos = log.segments()
    assert len(infos) >= 3
    os.unlink(infos[1].path)
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(tmp_path, readonly=readonly)
        assert caught.value.detail["reason"] == "segment_missing"
        assert caught.value.detail["segment"] == infos[0].path


def test_missing_first_segment_is_corruption(tmp_path):
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        for _ in range(100):
            log.append([b"q" * 1000])
        infos = log.segments()
    os.unlink(infos[0].path)
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(tmp_path)
    assert caught.value.detail["reason"] == "segment_missing"


def test_segment_from_another_log_is_corruption(tmp_path):
    for name in ("a", "b"):
        with SegmentLog.open(tmp_path / name, segment_bytes=SMALL) as log:
            for _ in range(100):
                log.append([b"q" * 1000])
    second = SegmentLog.open(tmp_path / "b", readonly=True)
    infos = second.segments()
    second.close()
    os.replace(infos[1].path, str(tmp_path / "a" / os.path.basename(infos[1].path)))
    with pytest.raises(Corruption):
        SegmentLog.open(tmp_path / "a", readonly=True)


def _three_segments(tmp_path) -> tuple[list[SegmentInfo], list[tuple[int, bytes]]]:
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        for index in range(150):
            log.append([bytes([index % 251]) * 1000])
        infos = log.segments()
        written = scan_all(log)
    assert len(infos) >= 3 and all(info.sealed for info in infos[:-1])
    return infos, written


def _damage_found(directory, readonly: bool, clean: bool) -> Exception | None:
    """The error a damaged sealed segment raises, and when: ``clean`` (the CLEAN marker of the last
    close kept) must open and raise at the first scan, which maps every segment; otherwise (as
    after a crash) open itself reads every header and seal and raises. None if neither raised."""
    if not clean and os.path.exists(os.path.join(directory, CLEAN_FILE_NAME)):
        os.remove(os.path.join(directory, CLEAN_FILE_NAME))
    try:
        log = SegmentLog.open(directory, readonly=readonly)
    except (Corruption, StorageFailed) as exc:
        assert not clean, f"a clean open read a sealed segment: {exc}"
        return exc
    with log:
        assert clean, "open after a crash must read every sealed header and seal"
        try:
            scan_all(log)
        except (Corruption, StorageFailed) as exc:
            return exc
    return None


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_damaged_seal_of_a_sealed_segment_is_corruption(tmp_path, clean):
    # Open after a crash reads each sealed segment's header and seal without mapping it; after a
    # clean close the first mapping checks them. Either way a flipped bit in the seal is found,
    # named by segment and file offset, before any record of the segment is returned.
    infos, _ = _three_segments(tmp_path)
    seal_offset = infos[0].used_bytes - lib.SL_SEAL_FRAME_BYTES
    with open(infos[0].path, "r+b") as file:
        file.seek(seal_offset + 20)
        byte = file.read(1)[0]
        file.seek(seal_offset + 20)
        file.write(bytes([byte ^ 0x10]))
    for readonly in (True, False):
        error = _damage_found(tmp_path, readonly, clean)
        assert isinstance(error, Corruption)
        assert error.detail["reason"] == "segment_missing"
        assert error.detail["segment"] == infos[0].path
        assert error.detail["offset"] == seal_offset


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_damaged_headers_are_reported_for_the_first_damaged_segment(tmp_path, clean):
    infos, _ = _three_segments(tmp_path)
    for info in infos[1:3]:
        with open(info.path, "r+b") as file:
            file.write(b"XXXX")  # the magic
    if clean:  # the active segment's header is read at every open: damage only the sealed one
        infos, _ = _three_segments(tmp_path / "again")
        with open(infos[1].path, "r+b") as file:
            file.write(b"XXXX")
    error = _damage_found(tmp_path / "again" if clean else tmp_path, True, clean)
    assert isinstance(error, Corruption)
    assert error.detail["segment"] == infos[1].path
    assert error.detail["reason"] == "header_magic"


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_unreadable_segment_is_storage_failed(tmp_path, clean):
    infos, _ = _three_segments(tmp_path)
    os.unlink(infos[1].path)
    os.mkdir(infos[1].path)  # opens, but every read fails (EISDIR)
    error = _damage_found(tmp_path, True, clean)
    assert isinstance(error, StorageFailed)
    assert error.detail["path"] == infos[1].path
    assert error.detail["errno"] == errno.EISDIR


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_fifo_under_a_segment_name_is_storage_failed_without_blocking(tmp_path, clean):
    infos, _ = _three_segments(tmp_path)
    os.unlink(infos[1].path)
    os.mkfifo(infos[1].path)  # opening it for reading would wait for a writer for ever
    error = outcome_within(10, lambda: _damage_found(tmp_path, True, clean))
    assert isinstance(error, StorageFailed)
    assert error.detail["path"] == infos[1].path
    assert error.detail["errno"] == errno.EINVAL


def test_a_clean_open_reads_no_sealed_segment(tmp_path):
    """After a clean close, open reads the active segment only: a sealed segment whose header
    and seal are damaged beyond use still opens, and is refused by its first read (by position,
    by a scan from it, or by verify), never served."""
    infos, written = _three_segments(tmp_path)
    with open(infos[0].path, "r+b") as file:
        file.write(b"\0" * lib.SL_SEGMENT_HEADER_BYTES)
    later = [(position, record) for position, record in written if position >= infos[1].first_position]
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert log.end > written[-1][0]
        assert scan_all(log, infos[1].first_position) == later  # other segments are unaffected
        for read in (lambda: log.read(0), lambda: scan_all(log), log.verify):
            with pytest.raises(Corruption) as caught:
                read()
            assert caught.value.detail["segment"] == infos[0].path
            assert caught.value.detail["reason"] == "header_magic"


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_sealed_segments_swapped_under_each_other_s_names_are_corruption(tmp_path, clean):
    """Two sealed segment files exchanged: the names, and so the marker's list, are unchanged,
    so after a clean close open takes them on its word; the first mapping then finds a header
    whose first position is not the name's (after a crash, open finds it)."""
    infos, _ = _three_segments(tmp_path)
    first, second = infos[0].path, infos[1].path
    os.rename(first, first + ".swap")
    os.rename(second, first)
    os.rename(first + ".swap", second)
    error = _damage_found(tmp_path, True, clean)
    assert isinstance(error, Corruption)
    assert error.detail["reason"] == "segment_name"
    assert error.detail["segment"] == first


@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_a_sealed_segment_of_another_log_under_the_same_name_is_corruption(tmp_path, clean):
    """Another log written alike has segments with the same names, sizes and seals; only the log
    id tells one of its sealed segments from this log's. Put in place of this log's, the marker's
    list still matches: the first mapping refuses it after a clean close, the open after a crash
    (log_id_mismatch)."""
    infos, _ = _three_segments(tmp_path / "log")
    others, _ = _three_segments(tmp_path / "other")
    assert [(info.first_position, info.used_bytes) for info in others] == [(info.first_position, info.used_bytes) for info in infos]
    os.replace(others[1].path, infos[1].path)
    error = _damage_found(tmp_path / "log", True, clean)
    assert isinstance(error, Corruption)
    assert (error.detail["segment"], error.detail["reason"]) == (infos[1].path, "log_id_mismatch")


@pytest.mark.parametrize("size, reason", [(0, "header_short"), (40, "header_short"), (None, "segment_missing")])
@pytest.mark.parametrize("clean", [True, False], ids=["clean_close", "crash"])
def test_a_sealed_segment_cut_short_is_corruption(tmp_path, size, reason, clean):
    """A sealed segment shortened after the close (empty, inside its header, or before its seal)
    is refused whichever open ran: at open after a crash, at the first mapping after a clean
    close (the seal frame is looked for where the next segment begins, past the file's end)."""
    infos, _ = _three_segments(tmp_path)
    os.truncate(infos[1].path, infos[1].used_bytes // 2 if size is None else size)
    error = _damage_found(tmp_path, True, clean)
    assert isinstance(error, Corruption)
    assert error.detail["segment"] == infos[1].path
    assert error.detail["reason"] == reason


@pytest.mark.parametrize("change", ["missing", "extra", "renamed"])
def test_a_clean_open_notices_segment_files_the_close_did_not_leave(tmp_path, change):
    """The marker lists the segment files (count and first positions): a sealed segment missing,
    added or renamed since the close makes the open read every header and seal, as after a crash,
    and raise what that finds."""
    infos, _ = _three_segments(tmp_path)
    if change == "missing":
        os.unlink(infos[1].path)
        expected = "segment_missing"
    elif change == "extra":
        extra = os.path.join(tmp_path, segment_file_name(infos[1].first_position + 4096))
        with open(infos[1].path, "rb") as source, open(extra, "wb") as target:
            target.write(source.read())
        expected = "segment_name"
    else:
        os.rename(infos[1].path, os.path.join(tmp_path, segment_file_name(infos[1].first_position + 4096)))
        expected = "segment_name"
    with pytest.raises(Corruption) as caught:
        SegmentLog.open(tmp_path, readonly=True)
    assert caught.value.detail["reason"] == expected


def test_fifo_as_the_clean_marker_is_ignored_without_blocking(tmp_path):
    _, written = _three_segments(tmp_path)
    marker = tmp_path / CLEAN_FILE_NAME
    marker.unlink()
    os.mkfifo(marker)

    def reopen_and_scan() -> list[tuple[int, bytes]]:
        with SegmentLog.open(tmp_path) as log:  # recovers by scanning, as after a crash
            return scan_all(log)

    assert outcome_within(10, reopen_and_scan) == written


def test_a_clean_marker_that_is_a_symbolic_link_is_not_trusted(tmp_path, monkeypatch):
    """The marker lets an open skip the scan of the active segment: it is trusted as this log's
    own. A symbolic link at its name (to a copy of the real marker, here) was read through and
    trusted; it is passed over like a FIFO, and the open scans."""
    _, written = _three_segments(tmp_path)
    marker = tmp_path / CLEAN_FILE_NAME
    os.rename(marker, tmp_path.parent / "copied-marker")
    os.symlink(tmp_path.parent / "copied-marker", marker)
    scans: list[bool] = []
    real = SegmentLog._recover_last
    monkeypatch.setattr(SegmentLog, "_recover_last", lambda log: (scans.append(True), real(log))[1])
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert scan_all(log) == written
    assert scans == [True]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_segment_that_is_a_symbolic_link_is_refused_and_never_written_through(tmp_path, readonly):
    """A symbolic link at the active segment's name: the writer's C open (``O_RDWR``) followed it,
    and appends went into the file it named, outside the log. The segment opens (C and Python)
    use ``O_NOFOLLOW``: it is ``STORAGE_FAILED`` (``ELOOP``), and the file the link names is
    unchanged."""
    directory = tmp_path / "log"
    infos, _ = _three_segments(directory)
    active = infos[-1].path
    os.remove(directory / CLEAN_FILE_NAME)  # as after a crash: every segment is opened
    outside = tmp_path / "outside.seg"
    os.rename(active, outside)
    os.symlink(outside, active)
    before = outside.read_bytes()
    refused = None
    try:
        with SegmentLog.open(directory, readonly=readonly) as log:
            scan_all(log) if readonly else log.append([b"x" * 100])
    except StorageFailed as exc:
        refused = exc
    assert outside.read_bytes() == before
    assert refused is not None and refused.detail["errno"] == errno.ELOOP


def test_sealed_segment_left_untrimmed_is_trimmed_by_the_writer(tmp_path):
    # The state a crash leaves after a seal whose trim was not yet durable: zeros past the seal,
    # and no CLEAN marker (the first append after an open removes it).
    infos, written = _three_segments(tmp_path)
    os.remove(tmp_path / CLEAN_FILE_NAME)
    with open(infos[0].path, "r+b") as file:
        file.truncate(SMALL)
    with SegmentLog.open(tmp_path, readonly=True) as log:
        assert scan_all(log) == written
    assert os.path.getsize(infos[0].path) == SMALL  # a reader changes nothing
    with SegmentLog.open(tmp_path) as log:
        assert scan_all(log) == written
    assert os.path.getsize(infos[0].path) == infos[0].used_bytes


@pytest.mark.parametrize("name", ["99999999999999999999", f"{2**64 - 1:020d}", f"{lib.SL_FIRST_POSITION_MAX + 1:020d}"])
def test_segment_named_past_every_position_is_corruption(tmp_path, name):
    # 20 digits can name a position no header may hold (even past u64): refused as misnamed, not
    # an overflow, and never passed to C (2**64-1 would read as "no seal to check").
    infos, _ = _three_segments(tmp_path)
    stray = tmp_path / f"{name}.seg"
    stray.write_bytes(open(infos[0].path, "rb").read())
    for readonly in (True, False):
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(tmp_path, readonly=readonly)
        assert caught.value.detail["reason"] == "segment_name"
        assert caught.value.detail["segment"] == str(stray)


def test_a_directory_as_the_clean_marker_is_storage_failed(tmp_path):
    # Only a FIFO, device or socket is passed over as "not a marker"; a directory there is an
    # error, as it was before the non-blocking open.
    _three_segments(tmp_path)
    marker = tmp_path / CLEAN_FILE_NAME
    marker.unlink()
    marker.mkdir()
    with pytest.raises(StorageFailed) as caught:
        SegmentLog.open(tmp_path, readonly=True)
    assert caught.value.detail["errno"] == errno.EISDIR


def test_reopen_after_seal_without_next_segment(tmp_path):
    # The state a crash leaves between sealing a segment and creating the next one.
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        written = []
        for _ in range(100):
            written += list(zip(log.append([b"s" * 1000]), [b"s" * 1000]))
        last = log.segments()[-1]
    os.unlink(last.path)
    kept = [(p, r) for p, r in written if p < last.first_position]
    with SegmentLog.open(tmp_path, readonly=True) as reader:
        assert reader.end == last.first_position
        assert scan_all(reader) == kept
        assert reader.segments()[-1].sealed  # what `mwpstore inspect` reports
    with SegmentLog.open(tmp_path, segment_bytes=SMALL) as log:
        assert log.end == last.first_position
        assert scan_all(log) == kept
        assert log.append([b"after"]) == [last.first_position]
        assert log.segments()[-1].first_position == last.first_position


# -- a stateful test against a model: appends, reopens and power cuts in any order ------------



class SegmentLogMachine(RuleBasedStateMachine):
    """The log against a list of acknowledged groups. A power cut keeps every acknowledged group."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.root = tempfile.mkdtemp(prefix="mwpstore-machine-", dir=root)
        self.generation = 0
        self.directory = os.path.join(self.root, "0")
        self.recorder = RecordingIO()
        self.log = SegmentLog.open(self.directory, segment_bytes=SMALL, io=self.recorder)
        self.model: list[tuple[int, bytes]] = []

    @rule(group=st.lists(st.binary(max_size=3000), min_size=1, max_size=6))
    def append(self, group: list[bytes]) -> None:
        end = self.log.end
        positions = self.log.append(group)
        assert positions[0] >= end and positions == sorted(positions)
        self.model += list(zip(positions, group))

    @rule(big=st.integers(20_000, 60_000))
    def append_big(self, big: int) -> None:
        self.append([bytes([big % 251]) * big])

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self.log = SegmentLog.open(self.directory, segment_bytes=SMALL, io=self.recorder)

    @rule(seed=st.integers(0, 2**32 - 1))
    def power_cut(self, seed: int) -> None:
        import random

        state = crash_state(self.recorder.operations, len(self.recorder.operations), random.Random(seed))
        self.log.close()
        self.generation += 1
        target = os.path.join(self.root, str(self.generation))
        write_crash_state(state, self.directory, target)
        self.directory = target
        self.recorder = RecordingIO(directory=target)
        self.log = SegmentLog.open(self.directory, segment_bytes=SMALL, io=self.recorder)

    @invariant()
    def matches_the_model(self) -> None:
        assert scan_all(self.log) == self.model
        if self.model:
            position, record = self.model[len(self.model) // 3]
            assert self.log.read(position) == record

    def teardown(self) -> None:
        import shutil

        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


SegmentLogMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
test_segment_log_state_machine = SegmentLogMachine.TestCase


@given(
    groups=st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=6), max_size=25),
    batch_records=st.integers(1, 40),
    start_index=st.integers(0, 200),
)
@settings(max_examples=60, deadline=None)
def test_scan_round_trip_property(groups, batch_records, start_index):
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="mwpstore-property-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        with SegmentLog.open(directory, segment_bytes=SMALL, sync=False) as log:
            written = [pair for group in groups for pair in zip(log.append(group), group)]
            start = written[start_index % len(written)][0] if written else 0
            expected = [pair for pair in written if pair[0] >= start]
            batches = list(log.scan(start, batch_records=batch_records))
            assert all(1 <= len(batch) <= batch_records for batch in batches)
            assert [pair for batch in batches for pair in zip(batch.positions, batch.records)] == expected
            assert all(batch.next_position > batch.positions[-1] for batch in batches)
            assert all(log.read(position) == record for position, record in expected[:5])
            split = list(log.scan(start, batch_records=batch_records, split_tags=True))
            assert [(batch.positions, batch.records, batch.tags, batch.next_position) for batch in split] == [
                (batch.positions, [record[1:] for record in batch.records], b"".join(record[:1] for record in batch.records), batch.next_position)
                for batch in batches
            ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_c_writer_refuses_an_end_that_wraps_past_the_segment(tmp_path):
    """sl_log_open checked the end as 64 + (end - first) + 32 <= segment bytes, which wraps for
    an end just below 2**64: it was accepted as the segment's start, and an append then wrote its
    group over the header. Now the distance is checked without the sum (SL_E_ARGUMENT), and so
    are the header fields a decoded header has."""
    directory = os.fsencode(tmp_path)
    fault = ffi.new("struct sl_fault *")
    assert lib.sl_segment_create(lib.sl_io_default(), directory, 7, 0, SMALL, fault) == lib.SL_OK
    with open(tmp_path / segment_file_name(0), "rb") as file:
        raw = file.read(lib.SL_SEGMENT_HEADER_BYTES)
    header = ffi.new("struct sl_header *")
    assert lib.sl_header_decode(raw, len(raw), header, fault) == lib.SL_OK
    handle = ffi.new("struct sl_log **")
    ends = [0, 8, SMALL - 96, SMALL - 88, 2**64 - 64, 2**64 - 96, 2**64 - 8]
    results = []
    for end in ends:
        results.append(lib.sl_log_open(lib.sl_io_default(), directory, header, end, SMALL, 1, handle, fault))
        if results[-1] == lib.SL_OK:
            lib.sl_log_close(handle[0])
    assert results == [lib.SL_OK] * 3 + [lib.SL_E_ARGUMENT] * 4
    for field, value in [("segment_bytes", 4096), ("first_position", 4), ("first_position", 2**63)]:
        damaged = ffi.new("struct sl_header *", header[0])
        setattr(damaged, field, value)
        end = damaged.first_position + 8 * (damaged.first_position % 8 == 0)
        assert lib.sl_log_open(lib.sl_io_default(), directory, damaged, end, SMALL, 1, handle, fault) == lib.SL_E_ARGUMENT
    with open(tmp_path / segment_file_name(0), "rb") as file:
        assert file.read(lib.SL_SEGMENT_HEADER_BYTES) == raw


def test_a_forked_childs_close_drops_its_copies_of_the_maps(tmp_path):
    """A child's close() does not take the segments' locks (a parent thread may have held one at
    the fork) but still drops each segment's map: the child's copies of the parent's maps go
    with it, and their descriptors, instead of living as long as the child keeps the handle."""
    directory = str(tmp_path / "log")
    log = SegmentLog.open(directory, segment_bytes=SMALL)
    while len(log.segments()) < 4:
        log.append([b"x" * 2000] * 8)
    for info in log.segments():
        log.read(info.first_position)
    assert _maps_of(directory) == 4
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:
        log.close()
        os.write(writing, str(_maps_of(directory)).encode())
        os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        maps = pipe.read().decode()
    os.waitpid(pid, 0)
    log.close()
    assert maps == "0"


def test_a_log_handle_does_not_cross_fork(tmp_path):
    """A forked child's append landed where the parent appends next (the parent then wrote over
    a group the child had been told was durable), and its close() wrote the clean marker while
    the parent went on writing."""
    directory = str(tmp_path / "log")
    log = SegmentLog.open(directory)
    log.append([b"before"])
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcomes = []
        for call in (lambda: log.append([b"child"]), lambda: log.read(0), lambda: log.sync(), log.close):
            try:
                call()
                outcomes.append("ok")
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                outcomes.append(type(exc).__name__)
        os.write(writing, ",".join(outcomes).encode())
        os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        outcomes = pipe.read().decode().split(",")
    os.waitpid(pid, 0)
    assert outcomes == ["StoreClosed", "StoreClosed", "StoreClosed", "ok"]
    assert not os.path.exists(os.path.join(directory, CLEAN_FILE_NAME))
    with pytest.raises(StoreLocked):  # the child's close() left the parent's lock alone
        SegmentLog.open(directory)
    log.append([b"after"])
    log.close()
    with SegmentLog.open(directory) as reopened:
        assert [bytes(record) for batch in reopened.scan() for record in batch.records] == [b"before", b"after"]
        assert reopened.verify() == 2
