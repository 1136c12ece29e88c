"""Simulated power loss and failed fsyncs through the I/O seam (mwpstore/io_seam.py).

A workload runs once against a recorder; then many crash states are drawn from the recording
(each: a crash point, which unsynced writes survive, where they tear, which directory changes
survive) and each is opened with recovery. Invariants, for every state:

- every group acknowledged before the crash point is present, at the positions returned;
- what is visible is an exact prefix of the attempted groups, whole groups only;
- no false corruption alarm (opening never raises);
- the recovered log takes new appends.

The default run checks 2,400 crash states. The long run (the figure in docs/format/segment.md):

    MWPSTORE_POWER_LOSS_STATES=100000 python -m pytest tests/test_segment_power_loss.py
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile

import pytest

from mwpstore.errors import StorageFailed
from mwpstore.io_seam import SECTOR_BYTES, RecordingIO, crash_state, write_crash_state
from mwpstore.limits import SEGMENT_BYTES_MIN
from mwpstore.segment_log import SegmentLog

STATES_TOTAL = int(os.environ.get("MWPSTORE_POWER_LOSS_STATES", "2400"))
WORKLOADS = [  # (seed, sync, groups)
    (11, True, 70),
    (12, True, 70),
    (13, False, 70),
    (14, True, 40),
]
STATES_PER_WORKLOAD = max(1, STATES_TOTAL // len(WORKLOADS))


def _scratch_root() -> str:
    # Crash states are many small directories; tmpfs keeps the recovery's fsyncs cheap.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _run_workload(directory: str, seed: int, sync: bool, group_count: int):
    """Append random groups, marking begin/ack of each; reopen now and then. Returns groups."""
    rng = random.Random(seed)
    recorder = RecordingIO()
    groups: list[tuple[list[int], list[bytes]]] = []
    log = SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN, sync=sync, io=recorder)
    for index in range(group_count):
        records = [
            rng.randbytes(rng.choice((0, 1, 13, 200, 511, 512, 900, 3000, 7000)))
            for _ in range(rng.choice((1, 1, 2, 3, 6, 12)))
        ]
        recorder.mark("begin", index)
        positions = log.append(records)
        groups.append((positions, records))
        if sync:
            recorder.mark("ack", index)
        elif rng.random() < 0.15:
            log.sync()
            recorder.mark("ack", index)  # in bulk mode, sync() is the acknowledgement
        if rng.random() < 0.05:
            log.close()
            recorder.mark("reopen")
            log = SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN, sync=sync, io=recorder)
    log.close()
    if not sync:
        recorder.mark("ack", group_count - 1)  # close() syncs
    return recorder, groups


def _check_state(directory: str, groups, acknowledged: int, begun: int, rng: random.Random) -> None:
    with SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN) as log:
        seen = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
        expected: list[tuple[int, bytes]] = []
        whole = 0
        while len(expected) < len(seen) and whole < begun:
            positions, records = groups[whole]
            expected += list(zip(positions, records))
            whole += 1
        assert seen == expected, "visible records are not a prefix of whole groups"
        assert whole >= acknowledged, f"acknowledged group {whole} lost (acknowledged {acknowledged})"
        if rng.random() < 0.2:
            position = log.append([b"after recovery"])[0]
            assert log.read(position) == b"after recovery"
    if rng.random() < 0.1:
        with SegmentLog.open(directory, readonly=True) as log:
            assert log.verify() >= len(seen)


@pytest.mark.parametrize("seed,sync,group_count", WORKLOADS)
def test_power_loss_keeps_acknowledged_groups(tmp_path, seed, sync, group_count):
    source = str(tmp_path / "log")
    recorder, groups = _run_workload(source, seed, sync, group_count)
    operations = recorder.operations
    # Where each group began and was acknowledged, as indexes into the operation list.
    begin_at = {value: i for i, (kind, *rest) in enumerate(operations) if kind == "mark" and rest[0] == "begin" for value in [rest[1]]}
    ack_at = {value: i for i, (kind, *rest) in enumerate(operations) if kind == "mark" and rest[0] == "ack" for value in [rest[1]]}
    rng = random.Random(seed * 1000 + 7)
    # Half the crash points fall right after a write, where tears and partial groups happen.
    after_write = [i + 1 for i, operation in enumerate(operations) if operation[0] == "write"]
    scratch = tempfile.mkdtemp(prefix="mwpstore-power-loss-", dir=_scratch_root())
    try:
        for state_number in range(STATES_PER_WORKLOAD):
            crash_at = rng.choice(after_write) if rng.random() < 0.5 else rng.randint(0, len(operations))
            state = crash_state(operations, crash_at, rng)
            target = os.path.join(scratch, str(state_number))
            write_crash_state(state, source, target)
            acknowledged = max((g + 1 for g, at in ack_at.items() if at < crash_at), default=0)
            begun = max((g + 1 for g, at in begin_at.items() if at < crash_at), default=0)
            try:
                _check_state(target, groups, acknowledged, begun, rng)
            except BaseException as exc:
                raise AssertionError(f"crash state {state_number} (crash at operation {crash_at}) failed: {exc!r}") from exc
            shutil.rmtree(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_power_loss_during_recovery_is_recoverable(tmp_path):
    """Crash while recovery itself truncates a torn tail: opening again still keeps every ack."""
    source = str(tmp_path / "log")
    recorder, groups = _run_workload(source, 21, True, 40)
    operations = recorder.operations
    ack_at = {rest[1]: i for i, (kind, *rest) in enumerate(operations) if kind == "mark" and rest[0] == "ack"}
    begin_at = {rest[1]: i for i, (kind, *rest) in enumerate(operations) if kind == "mark" and rest[0] == "begin"}
    rng = random.Random(2101)
    checked = 0
    scratch = tempfile.mkdtemp(prefix="mwpstore-power-loss-", dir=_scratch_root())
    try:
        _recovery_states(operations, groups, ack_at, begin_at, source, scratch, rng)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _recovery_states(operations, groups, ack_at, begin_at, source, scratch, rng) -> None:
    checked = 0
    for state_number in range(max(100, STATES_TOTAL // 6)):
        crash_at = rng.randint(0, len(operations))
        first = os.path.join(scratch, f"first-{state_number}")
        write_crash_state(crash_state(operations, crash_at, rng), source, first)
        acknowledged = max((g + 1 for g, at in ack_at.items() if at < crash_at), default=0)
        begun = max((g + 1 for g, at in begin_at.items() if at < crash_at), default=0)
        recovery_recorder = RecordingIO(directory=first)
        SegmentLog.open(first, segment_bytes=SEGMENT_BYTES_MIN, io=recovery_recorder).close()
        if any(op[0] in ("write", "truncate", "allocate", "create", "remove") for op in recovery_recorder.operations):
            checked += 1
            for second_number in range(5):
                second_at = rng.randint(0, len(recovery_recorder.operations))
                second = os.path.join(scratch, f"second-{state_number}-{second_number}")
                write_crash_state(crash_state(recovery_recorder.operations, second_at, rng), first, second)
                _check_state(second, groups, acknowledged, begun, rng)
                shutil.rmtree(second)
        shutil.rmtree(first)
    assert checked > 10  # the draw really exercised recoveries that write


def _eio_workload(directory: str, sync: bool, fail_at: int | None):
    """25 groups through a recorder that fails the fail_at-th sync. Returns what happened."""
    recorder = RecordingIO(fail_sync_at=fail_at)
    rng = random.Random(31)
    acknowledged: list[tuple[list[int], list[bytes]]] = []
    attempted: list[list[bytes]] = []
    failed = False
    try:
        log = SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN, sync=sync, io=recorder)
    except StorageFailed as exc:
        assert exc.detail["errno"] == errno.EIO
        return recorder, acknowledged, attempted, True
    for _ in range(25):
        records = [rng.randbytes(rng.choice((10, 3000, 9000))) for _ in range(rng.choice((1, 3)))]
        attempted.append(records)
        try:
            positions = log.append(records)
            if not sync:
                log.sync()
        except StorageFailed as exc:
            assert not failed or "earlier I/O failure" in exc.message
            failed = True
            continue
        assert not failed, "a write was acknowledged after a failed fsync"
        acknowledged.append((positions, records))
    if failed:
        with pytest.raises(StorageFailed):
            log.append([b"refused"])
        with pytest.raises(StorageFailed):
            log.sync()
    try:
        log.close()
    except StorageFailed:
        assert not sync and not failed  # bulk mode: close() syncs, and that sync failed
        failed = True
    return recorder, acknowledged, attempted, failed


@pytest.mark.parametrize("sync", [True, False])
def test_fsync_failure_is_never_acknowledged(tmp_path, sync):
    """EIO at each sync point in turn: the call fails, later writes refuse, nothing after is acked."""
    recorder, _, _, failed = _eio_workload(str(tmp_path / "count"), sync, None)
    total = recorder.sync_calls
    assert not failed and total > (25 if sync else 3)
    for fail_at in range(total):
        directory = str(tmp_path / f"fail-{fail_at}")
        recorder, acknowledged, attempted, failed = _eio_workload(directory, sync, fail_at)
        assert recorder.failures == 1 and failed
        if not os.path.isdir(directory):
            continue
        # Reopen from disk with real I/O: every acknowledged group is there, in order.
        with SegmentLog.open(directory, segment_bytes=SEGMENT_BYTES_MIN) as reopened:
            seen = [(p, bytes(r)) for batch in reopened.scan(0) for p, r in zip(batch.positions, batch.records)]
            expected = [(p, r) for positions, records in acknowledged for p, r in zip(positions, records)]
            assert seen[: len(expected)] == expected
            # Only the group whose sync failed may follow (its pages may have reached the disk).
            extra = [record for _, record in seen[len(expected):]]
            unacknowledged = attempted[len(acknowledged):]
            assert extra == [] or extra == (unacknowledged[0] if unacknowledged else None)


def test_the_crash_model_loses_only_what_was_not_made_durable(tmp_path):
    """The recorder's crash states themselves: every test above is only as strict as they are. A
    model that never dropped, tore or forgot anything unsynced would pass a log that skipped its
    fsyncs; one that lost synced data would raise false alarms. Two files, one written and made
    durable (data and name), one written only; many draws of the state after the last call."""
    recorder = RecordingIO()
    durable, pending = str(tmp_path / "durable"), str(tmp_path / "pending")
    data = bytes(range(256)) * 8  # four sectors
    _, durable_fd = recorder.create_file(durable)
    recorder.write_at(durable_fd, data, 0)
    recorder.sync_file_data(durable_fd, False)
    recorder.sync_directory(str(tmp_path))
    _, pending_fd = recorder.create_file(pending)
    recorder.write_at(pending_fd, data, 0)
    recorder.sync_file_data(durable_fd, True)  # a sync of the other file makes nothing of this one durable
    outcomes = set()
    for seed in range(300):
        state = crash_state(recorder.operations, len(recorder.operations), random.Random(seed))
        assert state[durable] == data
        content = state.get(pending)
        if content is None:
            outcomes.add("name lost")
        elif content == data:
            outcomes.add("kept")
        elif content == b"":
            outcomes.add("dropped")
        else:
            # whole sectors of the write, then zeros, garbage or the old (empty) content
            assert len(content) == len(data)
            assert any(content[:cut] == data[:cut] and content[cut:] != data[cut:] for cut in range(0, len(data), SECTOR_BYTES))
            outcomes.add("torn")
    assert outcomes == {"name lost", "kept", "dropped", "torn"}
    for descriptor in (durable_fd, pending_fd):
        recorder.close_file(descriptor)


def _draws(operations, crash_at=None, count=300):
    """The crash states of ``operations`` drawn with seeds 0..count-1."""
    at = len(operations) if crash_at is None else crash_at
    return [crash_state(operations, at, random.Random(seed)) for seed in range(count)]


def test_a_torn_write_keeps_whole_sectors_and_leaves_the_rest_zero_garbage_or_as_it_was(tmp_path):
    """A write torn by the power loss reached the disk up to some sector boundary inside it (not
    only at its start), and the rest is zeros, garbage or the bytes that were there before: a model
    that tore only at the start, or only into zeros, would never show a reader half a record over
    old bytes."""
    recorder = RecordingIO()
    path = str(tmp_path / "f")
    old, new = b"\xaa" * (4 * SECTOR_BYTES), b"\xbb" * (4 * SECTOR_BYTES)
    _, fd = recorder.create_file(path)
    recorder.write_at(fd, old, 0)
    recorder.sync_file_data(fd, False)
    recorder.sync_directory(str(tmp_path))
    recorder.write_at(fd, new, 0)
    recorder.close_file(fd)
    rests = set()
    for state in _draws(recorder.operations, count=600):
        content = state[path]
        if content in (old, new):
            continue
        kept = len(content) - len(content.lstrip(b"\xbb"))
        assert kept % SECTOR_BYTES == 0 and 0 <= kept < len(new) and len(content) == len(new)
        rest = content[kept:]
        kind = "old" if rest == old[kept:] else "zero" if rest == bytes(len(rest)) else "garbage"
        rests.add((kind, 0 < kept))
    assert rests == {("old", True), ("zero", False), ("zero", True), ("garbage", False), ("garbage", True)}  # ("old", False): dropped


def test_a_name_is_durable_once_its_directory_is_synced_and_only_then(tmp_path):
    """Creations, renames and removals not yet synced in their directory may each be undone, in
    order (a prefix of them survives); those synced never are."""
    directory = str(tmp_path)
    recorder = RecordingIO()
    first, second, temporary, final = (str(tmp_path / name) for name in ("first", "second", "temporary", "final"))
    for path in (first, temporary):
        _, fd = recorder.create_file(path)
        recorder.write_at(fd, b"x", 0)
        recorder.sync_file_data(fd, False)
        recorder.close_file(fd)
    recorder.sync_directory(directory)
    synced = len(recorder.operations)
    _, fd = recorder.create_file(second)
    recorder.close_file(fd)
    recorder.rename_file(temporary, final)
    recorder.remove_file(first)
    names = {tuple(sorted(os.path.basename(path) for path in state)) for state in _draws(recorder.operations)}
    assert names == {("first", "temporary"), ("first", "second", "temporary"), ("final", "first", "second"), ("final", "second")}
    recorder.sync_directory(directory)
    assert {tuple(sorted(state)) for state in _draws(recorder.operations)} == {(final, second)}
    assert {tuple(sorted(state)) for state in _draws(recorder.operations, crash_at=synced)} == {(first, temporary)}


def test_a_synced_truncation_or_allocation_is_durable(tmp_path):
    """Made on the real file as well as in the recording, like every recorded call."""
    recorder = RecordingIO()
    path = str(tmp_path / "f")
    _, fd = recorder.create_file(path)
    recorder.sync_directory(str(tmp_path))
    recorder.write_at(fd, b"a" * 100, 0)
    recorder.truncate_file(fd, 40)
    recorder.sync_file_data(fd, False)
    shrunk = len(recorder.operations)
    recorder.allocate_file(fd, 4096)
    recorder.sync_file_data(fd, True)
    grown = len(recorder.operations)
    recorder.allocate_file(fd, 100)  # never shrinks a file
    recorder.sync_file_data(fd, False)
    recorder.close_file(fd)
    with open(path, "rb") as file:  # the recorder did each call on the real file too
        assert file.read() == b"a" * 40 + bytes(4096 - 40)
    assert {state[path] for state in _draws(recorder.operations, crash_at=shrunk, count=20)} == {b"a" * 40}
    expected = b"a" * 40 + bytes(4096 - 40)
    assert {state[path] for state in _draws(recorder.operations, crash_at=grown, count=20)} == {expected}
    assert {state[path] for state in _draws(recorder.operations, count=20)} == {expected}


def test_files_there_before_recording_began_are_durable_with_their_content(tmp_path):
    """Given ``directory``, the recorder takes its files as durable; a file it first meets when
    it is removed is also taken as durable first, so that a crash may undo the removal."""
    (tmp_path / "listed").write_bytes(b"listed content")
    recorder = RecordingIO(directory=str(tmp_path))
    (tmp_path / "unseen").write_bytes(b"unseen content")  # there before the recorded calls began
    listed, unseen = str(tmp_path / "listed"), str(tmp_path / "unseen")
    assert crash_state(recorder.operations, 0, random.Random(1)) == {listed: b"listed content"}
    recorder.remove_file(unseen)
    states = _draws(recorder.operations)
    assert {state.get(unseen) for state in states} == {b"unseen content", None}
    assert all(state[listed] == b"listed content" for state in states)


def test_a_failed_sync_returns_the_chosen_errno_once(tmp_path):
    """``fail_sync_at`` counts data, file and directory syncs alike; the chosen call alone fails,
    with ``fail_errno``, and is not recorded as a sync."""
    directory, path = str(tmp_path), str(tmp_path / "f")
    recorder = RecordingIO(fail_sync_at=1, fail_errno=errno.ENOSPC)
    _, fd = recorder.create_file(path)
    assert recorder.sync_directory(directory) == 0
    assert recorder.sync_file_data(fd, False) == -errno.ENOSPC
    assert recorder.sync_file_data(fd, True) == 0 and recorder.sync_directory(directory) == 0
    assert recorder.failures == 1 and recorder.sync_calls == 4
    assert recorder.operations == [("create", path, 0), ("dirsync", directory), ("sync", 0), ("dirsync", directory)]
    recorder.close_file(fd)
    recorder = RecordingIO(fail_sync_at=0, fail_errno=errno.EROFS)
    assert recorder.sync_directory(directory) == -errno.EROFS and recorder.failures == 1
    with pytest.raises(StorageFailed) as failed:
        SegmentLog.open(str(tmp_path / "log"), segment_bytes=SEGMENT_BYTES_MIN, io=RecordingIO(fail_sync_at=0, fail_errno=errno.ENOSPC))
    assert failed.value.detail["errno"] == errno.ENOSPC


def test_an_os_error_in_a_recorded_call_reaches_the_log_with_its_errno(tmp_path):
    """The seam's callbacks return an OSError's own errno to the C log (EIO only for an error
    without one), as the real I/O does: a full disk stays ENOSPC in the StorageFailed."""

    class FullDisk(RecordingIO):
        def allocate_file(self, fd: int, length: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageFailed) as failed:
        SegmentLog.open(str(tmp_path / "log"), segment_bytes=SEGMENT_BYTES_MIN, io=FullDisk())
    assert failed.value.detail["errno"] == errno.ENOSPC


def test_a_crash_state_is_written_only_below_its_target(tmp_path):
    """Paths of the state outside the recorded directory are left out, never written beside the
    target (where they would land on real files)."""
    source, target, outside = tmp_path / "source", tmp_path / "target", tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_bytes(b"real file")
    write_crash_state({str(source / "kept"): b"crash state", str(outside / "file"): b"from the crash"}, str(source), str(target))
    assert os.listdir(target) == ["kept"] and (target / "kept").read_bytes() == b"crash state"
    assert (outside / "file").read_bytes() == b"real file"
