"""Tombstones (event.redact, audit.delete) and compaction (MWP-MSN-009)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest

from blocking import Caller
from authority_helpers import GROUP, OWNER, FakeClock, group_create, mission_create, open_with_group, store_files_held
from mwpstore import Authority, Command, CursorTooOld, InvalidCommand
from mwpstore.compaction import MARKER
from mwpstore.errors import AlreadyExists, GroupArchived, InvalidState, MwpError, StorageFailed, Unauthorized
from mwpstore.messages import check_event, encode_receipt
from mwpstore.segment_log import SegmentLog, segment_file_name
from mwpstore.snapshot import SnapshotRef

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "top-secret-payload-4711"


def secret_command(group: str = GROUP) -> Command:
    """A Command whose payload holds the secret but whose transition keeps none of it in state."""
    return Command(actor=OWNER, action_id="secret", group=group, kind="mission.close", target="m-s", body={"reason": SECRET})


def open_mission(authority: Authority, group: str = GROUP) -> None:
    authority.accept(Command(actor=OWNER, action_id=f"open-m-s-{group}", group=group, kind="mission.create", target="m-s", body={"title": "t", "cost_limit": 1}))


def _fill(authority: Authority, group: str = GROUP, count: int = 10, start: int = 0) -> list:
    return [r.unwrap() for r in authority.accept_many([mission_create(f"m-{group}-{i}", group=group) for i in range(start, start + count)])]


def _log_bytes(path: str) -> bytes:
    log = os.path.join(path, "log")
    return b"".join(open(os.path.join(log, name), "rb").read() for name in sorted(os.listdir(log)) if name.endswith(".seg") or name[0].isdigit())


def test_msn_009_redaction_keeps_id_sequence_and_chain_and_hides_payload(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        _fill(authority)
        tombstone = authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal request")
        assert tombstone.seq == 14 and tombstone.aggregate == f"tombstone:{receipt.seq}"
        events = authority.read(GROUP)
        assert [event.seq for event in events] == list(range(1, 15))  # nothing renumbered
        redacted = events[receipt.seq - 1]
        assert redacted.body is None and redacted.event_id == receipt.event_id and redacted.hash == receipt.event_hash
        previous = events[receipt.seq - 2].hash
        check_event(redacted, expected_prev_hash=previous)  # the chain still verifies
        assert authority.verify().ok
        with pytest.raises(AlreadyExists):
            authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-2", reason="again")
        with pytest.raises(InvalidCommand):
            authority.redact(GROUP, 99, actor=OWNER, action_id="redact-3", reason="future")
        # idempotency still answers with the original receipt
        again = authority.accept(secret_command())
        assert encode_receipt(again) == encode_receipt(receipt)
        with pytest.raises(InvalidCommand):  # the record of a deletion is never deleted
            authority.redact(GROUP, tombstone.seq, actor=OWNER, action_id="redact-4", reason="hide the tombstone")


def test_a_refused_redaction_of_a_tombstone_leaves_no_trace(tmp_path):
    """Redacting a tombstone is refused before anything is written: no Event, no state, no
    receipt (asking again is refused again), alone or inside a batch that accepts the others."""
    with open_with_group(str(tmp_path / "s")) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        tombstone = authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal")
        head = authority.head(GROUP)
        for _ in range(2):
            with pytest.raises(InvalidCommand):
                authority.redact(GROUP, tombstone.seq, actor=OWNER, action_id="redact-2", reason="hide the tombstone")
            assert authority.head(GROUP) == head
        assert authority.state(GROUP, f"tombstone:{tombstone.seq}") == (0, None)
        hide = Command(actor=OWNER, action_id="redact-3", group=GROUP, kind="event.redact", target=str(tombstone.seq), body={"reason": "again"})
        results = authority.accept_many([hide, mission_create("m-after")])
        assert [result.ok for result in results] == [False, True]
        assert isinstance(results[0].error, InvalidCommand)
        assert authority.head(GROUP)[0] == head[0] + 1 and results[1].unwrap().seq == head[0] + 1
        assert [event.kind for event in authority.read(GROUP, after=head[0])] == ["mission.create"]
        assert authority.verify().ok


def test_redaction_needs_the_owner(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(Command(actor=OWNER, action_id="add", group=GROUP, kind="membership.add", target="w", body={"role": "worker"}, expected_revision=0))
        with pytest.raises(Unauthorized):
            authority.redact(GROUP, 1, actor="w", action_id="r", reason="x")


def test_compaction_removes_redacted_payloads_from_disk_and_keeps_everything_else(tmp_path):
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        _fill(authority)
        authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal")
        before = [(e.seq, e.event_id, e.hash) for e in authority.read(GROUP)]
        assert SECRET.encode() in _log_bytes(path)
        report = authority.compact()
        assert report.payloads_removed == 1 and report.events_dropped == 0
        assert SECRET.encode() not in _log_bytes(path)
        assert [(e.seq, e.event_id, e.hash) for e in authority.read(GROUP)] == before
        assert authority.verify().ok
        again = authority.accept(secret_command())
        assert encode_receipt(again) == encode_receipt(receipt)
        authority.accept(mission_create("after-compaction"))
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == 15 and authority.verify().ok


def _held_bytes(path: str) -> bytes:
    """Everything the files under ``path`` that this process holds open contain, removed ones too
    (read through /proc/self/fd: what is still on the disk until the descriptor is closed)."""
    contents = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith(path):
                with open(f"/proc/self/fd/{name}", "rb") as handle:
                    contents.append(handle.read())
    return b"".join(contents)


def _fill_in_commits(authority: Authority, count: int, start: int = 0) -> None:
    for first in range(start, start + count, 50):  # a 64 KiB segment's group holds fewer than 300
        _fill(authority, count=min(50, start + count - first), start=first)


def _small_segments(path: str) -> Authority:
    authority = Authority.open(path, segment_bytes=64 * 1024)
    authority.accept(group_create(GROUP))
    return authority


def _reader_paused_on_its_second_segment(authority: Authority, monkeypatch: pytest.MonkeyPatch) -> tuple[Caller, threading.Event]:
    """A full read of GROUP in its own thread, stopped as it goes to read its second segment; set
    the event returned to let it go on."""
    from mwpstore import segment_log

    paused, resume = threading.Event(), threading.Event()
    mapped = segment_log.SegmentLog._mapped
    reader_calls = []

    def pausing(log, segment):  # the read, on its second segment, waits for the compaction
        if threading.current_thread().name == "reader":
            reader_calls.append(segment)
            if len(reader_calls) == 2:
                paused.set()
                resume.wait(30)
        return mapped(log, segment)

    monkeypatch.setattr(segment_log.SegmentLog, "_mapped", pausing)
    reader = Caller(lambda: authority.read(GROUP, limit=10_000), name="reader")
    assert paused.wait(30)
    return reader, resume


def test_a_read_running_across_a_compaction_reads_the_old_logs_files(tmp_path, monkeypatch):
    """A log keeps few sealed segments mapped (segment_log.SEGMENT_MAPS_MAX) and maps one again
    from its name when read; across a compaction the name is the new log's file: the old log holds
    every file before the switch, so a read still running on it goes on reading its own."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 1)
    with _small_segments(str(tmp_path / "s")) as authority:
        _fill_in_commits(authority, 1500)
        assert len(authority.log.segments()) >= 4
        expected = authority.read(GROUP, limit=10_000)
        reader, resume = _reader_paused_on_its_second_segment(authority, monkeypatch)
        authority.compact()
        resume.set()
        assert reader.outcome() == expected
        assert authority.read(GROUP, limit=10_000) == expected


def test_a_compaction_that_cannot_hold_the_old_logs_files_switches_nothing(tmp_path, monkeypatch):
    """The old log's files are held (mapped) just before the switch; one that cannot be (no
    descriptor left: each map keeps one) was left to be mapped again from its name, the new log's
    file by then, by a read still running on the old log. The compaction now fails there, before
    the switch: the read goes on over the old log, and the reopen finishes the compaction."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 1)
    path = str(tmp_path / "s")
    with _small_segments(path) as authority:
        _fill_in_commits(authority, 1500)
        expected = authority.read(GROUP, limit=10_000)
        reader, resume = _reader_paused_on_its_second_segment(authority, monkeypatch)
        hold_files, real_open = segment_log.SegmentLog.hold_files, segment_log.open_regular_fd
        holding = threading.Event()
        victim = os.sep + segment_file_name(authority.log.segments()[2].first_position)

        def open_fd(name: str, **options: object) -> int:
            if holding.is_set() and name.endswith(victim):
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(name, **options)

        def hold(log, *args, **kwargs):
            holding.set()
            try:
                return hold_files(log, *args, **kwargs)
            finally:
                holding.clear()

        monkeypatch.setattr(segment_log, "open_regular_fd", open_fd)
        monkeypatch.setattr(segment_log.SegmentLog, "hold_files", hold)
        try:
            compaction = Caller(authority.compact).outcome()
        finally:
            resume.set()
        assert reader.outcome() == expected
        assert isinstance(compaction, StorageFailed) and compaction.detail["reason"] == "compaction_interrupted", compaction
        assert os.strerror(errno.EMFILE) in compaction.message
    with Authority.open(path) as authority:
        assert not os.path.exists(os.path.join(path, "log.compact"))
        assert authority.read(GROUP, limit=10_000) == expected


def test_reads_from_many_threads_across_appends_and_compactions_read_every_event_right(tmp_path, monkeypatch):
    """Reads in several threads, with few sealed segments mapped at once (SEGMENT_MAPS_MAX 2: maps
    dropped and made again under them), beside appends that roll the log over and two compactions
    that switch it: every read answers events the final log holds, each where it is there."""
    from mwpstore import segment_log

    monkeypatch.setattr(segment_log, "SEGMENT_MAPS_MAX", 2)
    with _small_segments(str(tmp_path / "s")) as authority:
        _fill_in_commits(authority, 600)
        assert len(authority.log.segments()) >= 3
        stop = threading.Event()
        answers: list[list] = []

        def reader() -> object:
            while not stop.is_set():
                answers.append([(e.seq, e.hash) for e in authority.read(GROUP, limit=10_000)])
            return None

        readers = [Caller(reader, name=f"reader-{n}") for n in range(3)]
        try:
            for round_ in range(2):
                _fill_in_commits(authority, 300, start=600 + 300 * round_)
                authority.compact()
        finally:
            stop.set()
        assert [caller.outcome() for caller in readers] == [None] * 3
        final = [(e.seq, e.hash) for e in authority.read(GROUP, limit=10_000)]
        assert len(final) == 1201 and len(answers) >= 3
        for answer in answers:
            assert answer == final[: len(answer)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's open files from /proc")
def test_compaction_and_rebuild_give_back_the_replaced_files_at_once(tmp_path):
    """The log and index a compaction or rebuild replaced are closed as soon as no read uses them,
    not when the authority closes: before, every compaction kept the old segments and index open
    and mapped (removed files whose space was never given back, a redacted payload among their
    bytes) and their descriptors added up for as long as the store stayed open."""
    path = str(tmp_path / "s")
    with _small_segments(path) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        _fill_in_commits(authority, 300)
        assert len(authority.read(GROUP, limit=1000)) == 303  # every segment mapped by a read
        authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal")
        assert SECRET.encode() in _held_bytes(path)
        held_before = len(store_files_held(path))
        for round in range(3):
            authority.compact()
            authority.rebuild()
            held = store_files_held(path)
            assert not [name for name in held if name.endswith("(deleted)") or ".old" in name], held
            assert SECRET.encode() not in _held_bytes(path)
            assert len(held) <= held_before + 2, held  # nothing piles up from round to round
            _fill(authority, count=5, start=1000 + 5 * round)
        assert len(authority.read(GROUP, limit=1000)) == 319 and authority.verify().ok


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's open files from /proc")
def test_a_read_in_flight_keeps_the_replaced_files_until_it_ends(tmp_path, monkeypatch):
    """A read that took the log and index before a compaction switched them finishes on them (they
    stay open meanwhile); the first moment no read from before the switch is running, they close."""
    import mwpstore.authority as authority_module

    path = str(tmp_path / "s")
    original = authority_module._event_bodies_between
    inside, go_on = threading.Event(), threading.Event()
    results: list = []

    def held_up(log, first, last, count):  # the read has its pair: hold it there once
        if not inside.is_set():
            inside.set()
            assert go_on.wait(30)
        return original(log, first, last, count)

    with _small_segments(path) as authority:
        _fill_in_commits(authority, 300)
        expected = [(event.seq, event.hash) for event in authority.read(GROUP, limit=1000)]
        monkeypatch.setattr(authority_module, "_event_bodies_between", held_up)
        reader = threading.Thread(target=lambda: results.append(authority.read(GROUP, limit=1000)))
        reader.start()
        assert inside.wait(30)
        authority.compact()
        assert authority._retired  # the held-up read may still need them
        assert [name for name in store_files_held(path) if name.endswith("(deleted)")]
        assert authority.read(GROUP, after=299, limit=10)[-1].seq == 301  # another read uses the new log
        go_on.set()
        reader.join(30)
        assert [(event.seq, event.hash) for event in results[0]] == expected  # served whole from the old log
        assert not authority._retired
        assert not [name for name in store_files_held(path) if name.endswith("(deleted)")]
        assert authority.verify().ok


@pytest.mark.parametrize("target, actor, group", [("0", "mallory", "nope"), ("0", OWNER, GROUP), ("00", "mallory", GROUP)])
def test_a_redaction_of_no_event_is_a_rejection_and_the_handle_keeps_writing(tmp_path, target, actor, group):
    with open_with_group(str(tmp_path / "s")) as authority:
        hostile = Command(actor=actor, action_id="r-0", group=group, kind="event.redact", target=target, body={"reason": "x"})
        results = authority.accept_many([hostile, mission_create("m-after")])
        assert results[0].error_code in {"NOT_FOUND", "NOT_A_MEMBER", "INVALID_COMMAND"}
        assert results[1].ok  # the rest of the batch is untouched
        assert authority.accept(mission_create("m-later")).seq == 3  # and the handle still writes


def test_redacting_an_archived_and_compacted_event_is_group_archived_not_index_damage(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 2)
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert authority.compact().events_dropped > 0
        with pytest.raises(GroupArchived):
            authority.redact(GROUP, 2, actor=OWNER, action_id="r-late", reason="pii")
        authority.accept(group_create("other"))  # the handle still writes


@pytest.mark.parametrize("stray_kind", ["directory", "dangling symlink"])
def test_a_stray_log_old_stops_compaction_before_it_changes_anything(tmp_path, stray_kind):
    """A symbolic link to nothing is in the way too: the switch's rename of log/ onto it fails
    after the marker, and the open that finishes the switch would meet it again."""
    with open_with_group(str(tmp_path / "s")) as authority:
        stray = os.path.join(authority.path, "log.old")
        if stray_kind == "directory":
            os.makedirs(os.path.join(stray, "copy"))
        else:
            os.symlink(str(tmp_path / "gone"), stray)
        with pytest.raises(StorageFailed) as caught:
            authority.compact()
        assert caught.value.detail["reason"] == "compaction_obstacle"
        assert not os.path.exists(os.path.join(authority.path, MARKER))
        assert not os.path.exists(os.path.join(authority.path, "log.compact"))
        if stray_kind == "directory":
            assert os.listdir(stray) == ["copy"]  # the operator's directory is left alone
        else:
            assert os.readlink(stray) == str(tmp_path / "gone")
        assert authority.accept(mission_create("m-after")).seq == 2  # and the handle writes


def test_a_failure_while_copying_leaves_the_store_as_it_was(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)

        append = SegmentLog.append

        def full_disk(log, records, *args, **kwargs):
            if log is not authority.log:  # the compacted copy's
                raise OSError(28, "No space left on device")
            return append(log, records, *args, **kwargs)

        SegmentLog.append = full_disk  # type: ignore[method-assign]
        try:
            with pytest.raises(StorageFailed):
                authority.compact()
        finally:
            SegmentLog.append = append  # type: ignore[method-assign]
        assert not os.path.exists(os.path.join(authority.path, "log.compact"))
        assert authority.accept(mission_create("m-after")).seq == 5
        with pytest.raises(InvalidCommand):
            authority.compact(progress=5)
        assert authority.verify().ok


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["enospc", "interrupt"])
def test_a_failure_after_the_switch_point_refuses_writes_until_reopen_finishes_it(tmp_path, monkeypatch, failure):
    """An interrupt (KeyboardInterrupt) after the marker is raised as it is, and refuses writes
    all the same: the next open finishes the switch whatever stopped it."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        receipts = _fill(authority, GROUP, 3)

        def full_disk(*args, **kwargs):
            raise failure

        monkeypatch.setattr(Authority, "_build_index", full_disk)
        with pytest.raises(KeyboardInterrupt if isinstance(failure, KeyboardInterrupt) else StorageFailed) as caught:
            authority.compact()
        if isinstance(failure, OSError):
            assert caught.value.detail["reason"] == "compaction_interrupted"
        # the next open deletes the old log: nothing more may be acknowledged on it
        with pytest.raises(StorageFailed):
            authority.accept(mission_create("m-lost"))
        monkeypatch.undo()
    with Authority.open(path) as authority:  # open finishes the switch; every acknowledged Event is there
        assert authority.open_report.mode == "rebuild"
        assert not os.path.exists(os.path.join(path, MARKER)) and not os.path.exists(os.path.join(path, "log.old"))
        assert authority.head(GROUP)[0] == 4
        assert [event.event_id for event in authority.read(GROUP)][1:] == [receipt.event_id for receipt in receipts]
        assert authority.verify().ok


def test_compaction_drops_archived_group_events_keeps_receipts_and_never_touches_active_groups(tmp_path):
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(group_create("active"))
        kept = _fill(authority, "active", 5)
        dropped = _fill(authority, GROUP, 5)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive", reason="done")
        active_before = authority.read("active")
        report = authority.compact()
        assert report.groups_compacted == [GROUP] and report.events_dropped == 7
        assert authority.read("active") == active_before  # an active Group's history is never removed
        with pytest.raises(CursorTooOld) as caught:
            authority.read(GROUP)
        assert SnapshotRef.from_dict(caught.value.snapshot_ref) == record.final_snapshot
        assert authority.read(GROUP, after=record.last_seq) == []
        with pytest.raises(GroupArchived):
            authority.accept(mission_create("late"))
        for receipt, command_index in zip(dropped, range(5)):
            replay = authority.accept(Command(actor=OWNER, action_id=receipt.action_id, group=GROUP, kind="mission.create", target=f"m-{GROUP}-{command_index}", body={"title": f"mission m-{GROUP}-{command_index}", "cost_limit": 100}))
            assert encode_receipt(replay) == encode_receipt(receipt)
        assert authority.verify().ok
        assert authority.compact().events_dropped == 0  # nothing left to drop
        del kept


def test_archived_group_without_durable_audit_log_keeps_its_history(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        os.remove(os.path.join(authority.path, record.audit_location))
        assert authority.compact().events_dropped == 0
        assert len(authority.read(GROUP)) == 5


def test_archived_group_whose_audit_log_differs_from_its_record_keeps_its_history(tmp_path):
    # Same size, one byte changed: the audit log is not the one the archive record hashed, so it
    # cannot stand in for the Events compaction would drop.
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        audit = os.path.join(authority.path, record.audit_location)
        data = bytearray(open(audit, "rb").read())
        data[-1] ^= 0x01
        with open(audit, "wb") as handle:
            handle.write(bytes(data))
        assert os.path.getsize(audit) == record.audit_bytes
        report = authority.compact()
        assert report.groups_compacted == [] and report.events_dropped == 0
        assert len(authority.read(GROUP)) == 5


def test_a_second_compaction_leaves_an_already_compacted_group_alone(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert authority.compact().groups_compacted == [GROUP]
        again = authority.compact()
        assert again.groups_compacted == [] and again.events_dropped == 0
        assert again.records_after == again.records_before  # no second Group remainder record
        assert authority.verify().ok


def test_audit_log_deletion_is_an_accepted_transition_after_retention(tmp_path):
    clock = FakeClock()
    with Authority.open(str(tmp_path / "s"), clock=clock) as authority:
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body={"org": "acme", "policy": {"audit_retention_days": 30}}))
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        audit = os.path.join(authority.path, record.audit_location)
        with pytest.raises(InvalidState):
            authority.delete_audit_log(GROUP, actor=OWNER, action_id="del-early")
        assert os.path.exists(audit)
        clock.advance(31 * 86_400_000)
        receipt = authority.delete_audit_log(GROUP, actor=OWNER, action_id="del")
        assert receipt.kind == "audit.delete" and not os.path.exists(audit)
        assert authority.read(GROUP)[-1].kind == "audit.delete"  # auditable


@pytest.mark.parametrize("after", ["reopen", "rebuild", "killed"])
def test_the_last_acceptance_time_survives_a_compaction_that_drops_the_newest_event(tmp_path, after):
    """The store's newest Event is an archived Group's group.archive; compaction drops it. A clock
    that steps back then still stamps no Event before it: after a reopen, a rebuild, or an open
    that finishes a compaction killed after its switch (it once stamped the clock's reading: the
    last acceptance time came from the Events left in the log alone)."""
    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "s")
    with open_with_group(path, clock=clock) as authority:
        authority.accept(group_create("archived"))
        clock.advance(1_000)
        record = authority.archive("archived", actor=OWNER, action_id="archive")
        if after == "killed":
            env = dict(os.environ, MWPSTORE_FAILPOINT="compaction.switched", PYTHONPATH=REPO)
            authority.close()
            result = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True, timeout=120)
            assert result.returncode == -9, result.stderr
        else:
            assert authority.compact().groups_compacted == ["archived"]
            if after == "rebuild":
                authority.rebuild()
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back
    with Authority.open(path, clock=clock) as authority:
        assert authority.open_report.mode == ("rebuild" if after == "killed" else "clean")
        assert authority.state("archived", "group:archived")[1]["compacted"] is True
        assert authority.accept(mission_create("m-1")).accepted_at_ms == record.archived_at_ms == 1_700_000_001_000


def test_the_last_acceptance_time_after_a_compaction_is_the_newest_of_the_log_and_the_group_records(tmp_path):
    """Several Groups compacted, archived in any order, with a live Group's Event after them: the
    rebuilt last acceptance time is the newest of them all, whichever record holds it (the log's
    Event, or a G record written after it), and a second compaction, whose log already ends in G
    records, keeps it."""
    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "s")
    with open_with_group(path, clock=clock) as authority:
        for group in ("b-side", "a-side"):
            authority.accept(group_create(group))
        for group, step in (("b-side", 1_000), ("a-side", 1_000)):  # a-side archived last, compacted first
            clock.advance(step)
            authority.archive(group, actor=OWNER, action_id=f"archive-{group}")
        clock.advance(1_000)
        newest = authority.accept(mission_create("m-1")).accepted_at_ms  # in the log, before the G records
        assert sorted(authority.compact().groups_compacted) == ["a-side", "b-side"]
        authority.rebuild()
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back
    with Authority.open(path, clock=clock) as authority:
        assert authority.accept(mission_create("m-2")).accepted_at_ms == newest
        authority.compact()
        authority.rebuild()
    with Authority.open(path, clock=clock) as authority:
        assert authority.accept(mission_create("m-3")).accepted_at_ms == newest


@pytest.mark.parametrize(
    "archived_at",
    [None, True, 1_700_000_009_000.0, -1, 2**62 + 1, 2**64 - 1, "1700000009000", 1_700_000_009_000, 2**62],
    ids=["missing", "bool", "float", "negative", "past TIME_MS_MAX", "u64 max", "str", "a time", "TIME_MS_MAX"],
)
def test_a_group_records_archived_at_ms_counts_only_as_a_time(tmp_path, archived_at):
    """A ``G`` record's Group aggregate whose archived_at_ms is missing or not an int in
    0..TIME_MS_MAX (not one compaction writes) leaves the last acceptance time to the other
    records at redo and rebuild, and the store opens; a time there raises it."""
    import msgspec

    from mwpstore.authority import GROUP_TAG
    from mwpstore.messages import Effect

    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "s")
    with open_with_group(path, clock=clock) as authority:
        authority.accept(group_create("archived"))
        clock.advance(1_000)
        authority.archive("archived", actor=OWNER, action_id="archive")
        authority.compact()
        seq, digest = authority.head("archived")
        _, state = authority.state("archived", "group:archived")
    state = {key: value for key, value in state.items() if key != "archived_at_ms"}
    if archived_at is not None:
        state["archived_at_ms"] = archived_at
    with SegmentLog.open(os.path.join(path, "log")) as log:
        log.append([GROUP_TAG + msgspec.msgpack.encode(("archived", seq, digest, [Effect("group:archived", 9, state)]))])
    last = archived_at if type(archived_at) is int and 1_700_000_009_000 <= archived_at <= 2**62 else 1_700_000_001_000
    shutil.copytree(path, path + "-rebuilt")
    shutil.rmtree(os.path.join(path + "-rebuilt", "index"))
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back
    for how, store in (("redo", path), ("rebuild", path + "-rebuilt")):
        with Authority.open(store, clock=clock) as authority:
            assert authority.open_report.mode == how
            assert authority.accept(mission_create(f"m-{how}")).accepted_at_ms == last


CHILD = """
import sys
from mwpstore import Authority
authority = Authority.open(sys.argv[1])
authority.compact()
"""


@pytest.mark.parametrize("step", ["compaction.copy", "compaction.marked", "compaction.half_switched", "compaction.switched", "compaction.indexed"])
def test_kill_9_at_every_compaction_step_loses_nothing(tmp_path, step):
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(group_create("active"))
        open_mission(authority, "active")
        receipt = authority.accept(secret_command("active"))
        _fill(authority, "active", 30)
        _fill(authority, GROUP, 30)
        authority.redact("active", receipt.seq, actor=OWNER, action_id="redact", reason="legal")
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        expected = [(e.seq, e.hash) for e in authority.read("active", limit=1000)]
        receipts = {r.action_id: encode_receipt(r) for r in _fill(authority, "active", 3, start=100)}
        expected += [(e.seq, e.hash) for e in authority.read("active", after=expected[-1][0])]
    env = dict(os.environ, MWPSTORE_FAILPOINT=step, PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    with Authority.open(path) as authority:
        assert [(e.seq, e.hash) for e in authority.read("active", limit=1000)] == expected
        assert authority.verify().ok
        assert not os.path.exists(os.path.join(path, "log.compact")) and not os.path.exists(os.path.join(path, MARKER))
        authority.compact()  # and a compaction after the crash completes
        assert [(e.seq, e.hash) for e in authority.read("active", limit=1000)] == expected
        for action, encoded in receipts.items():
            events = [e for e in authority.read("active", limit=1000) if e.action_id == action]
            assert len(events) == 1
        assert SECRET.encode() not in _log_bytes(path)
        assert authority.verify().ok


def test_reader_iterating_during_compaction_sees_correct_data(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(group_create("active"))
        _fill(authority, "active", 400)
        expected = [(e.seq, e.hash) for e in authority.read("active", limit=1000)]
        seen: list[tuple[int, bytes]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader() -> None:
            try:
                while not stop.is_set():
                    cursor = 0
                    batch_seen = []
                    while True:
                        events = authority.read("active", after=cursor, limit=7)
                        if not events:
                            break
                        batch_seen.extend((e.seq, e.hash) for e in events)
                        cursor = events[-1].seq
                    assert batch_seen == expected
                    seen.extend(batch_seen[:1])
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        for _ in range(3):
            authority.compact()
        stop.set()
        thread.join(timeout=30)
        assert not errors, errors
        assert seen


def test_audit_log_deletion_after_compaction_and_legal_basis_deletes_the_file(tmp_path):
    clock = FakeClock()
    with Authority.open(str(tmp_path / "s"), clock=clock) as authority:
        for group in ("g-ret", "g-legal"):
            authority.accept(Command(actor=OWNER, action_id=f"g-{group}", group=group, kind="group.create", target=group, body={"org": "acme", "policy": {"audit_retention_days": 1}}))
        records = {group: authority.archive(group, actor=OWNER, action_id=f"archive-{group}") for group in ("g-ret", "g-legal")}
        authority.compact()
        clock.advance(2 * 86_400_000)
        authority.delete_audit_log("g-ret", actor=OWNER, action_id="del-ret")
        assert not os.path.exists(os.path.join(authority.path, records["g-ret"].audit_location))
        # a legal deletion accepted through plain accept() deletes the file too
        authority.accept(Command(actor=OWNER, action_id="del-legal", group="g-legal", kind="audit.delete", target="g-legal", body={"basis": "legal", "reason": "court order"}))
        assert not os.path.exists(os.path.join(authority.path, records["g-legal"].audit_location))
        assert authority.verify().ok


def test_an_event_after_the_final_snapshot_of_a_compacted_group_is_readable_after_it(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 2)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        authority.compact()
        deletion = authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        assert deletion.seq == record.final_snapshot.seq + 1
        floor, ref = authority.replay_floor(GROUP)
        assert (floor, ref) == (record.final_snapshot.seq, record.final_snapshot)
        with pytest.raises(CursorTooOld):
            authority.read(GROUP, after=floor - 1)
        # restoring the offered snapshot and reading strictly after it reaches the tombstone
        assert [event.seq for event in authority.read(GROUP, after=ref.seq)] == [deletion.seq]


def test_no_snapshot_of_a_compacted_group_signs_the_state_compaction_left(tmp_path):
    """A compacted Group's index keeps only its Group aggregate and Memberships: a snapshot taken
    from it (at its head under a newer key, or at the head an audit.delete moved) would sign a
    state the Group never had, its Missions gone. Refused, nothing written; the final snapshot,
    signed with the current key, is still the answer at its own head."""
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 2)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        authority.compact()
        assert authority.snapshot(GROUP) == record.final_snapshot
        authority.rotate_signing_key()
        directory = os.path.join(authority.path, "snapshots", GROUP)
        files = sorted(os.listdir(directory))
        with pytest.raises(InvalidState) as caught:
            authority.snapshot(GROUP)  # at the final snapshot's sequence, under the new key
        assert caught.value.detail["state"] == "compacted"
        authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        with pytest.raises(InvalidState):
            authority.snapshot(GROUP)  # at the head the deletion moved
        assert sorted(os.listdir(directory)) == files
        assert authority.snapshots(GROUP) == [record.final_snapshot]
        assert authority.verify().ok


def test_a_snapshot_signed_before_compaction_is_still_served_after_it_and_a_rebuild(tmp_path):
    """A rotation between archive() and compact() lets snapshot() sign the archived Group at its
    head with the new key while its index still holds its whole state: after compaction, and after
    an index rebuilt from the compacted log, that reference is the answer at the head, the final
    snapshot the one CURSOR_TOO_OLD offers, and another rotation (retire=False) is refused."""
    from mwpstore.snapshot import verify_snapshot

    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 2)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        authority.rotate_signing_key()
        resigned = authority.snapshot(GROUP)
        assert resigned.seq == record.final_snapshot.seq and resigned.key_id != record.final_snapshot.key_id
        whole = verify_snapshot(authority.read_snapshot(resigned), keyring=authority.keyring(), group=GROUP)
        assert any(effect.aggregate.startswith("mission:") for effect in whole.aggregates)
        authority.compact()
        for _ in ("compacted", "rebuilt"):
            assert authority.snapshot(GROUP) == resigned
            with pytest.raises(CursorTooOld) as caught:
                authority.read(GROUP, after=0)
            assert caught.value.snapshot_ref == record.final_snapshot.to_dict()
            authority.rebuild()
        authority.rotate_signing_key(retire=False)
        with pytest.raises(InvalidState) as refused:
            authority.snapshot(GROUP)
        assert refused.value.detail["state"] == "compacted" and authority.snapshots(GROUP)[-1] == resigned


def test_an_accepted_audit_log_deletion_is_not_undone_by_finishing_the_archive(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 2)
        # group.archive accepted directly (or an archive() that stopped part-way), then a legal deletion
        authority.accept(Command(actor=OWNER, action_id="archive", group=GROUP, kind="group.archive", target=GROUP, body={}))
        authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        with pytest.raises(InvalidState):
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert authority.archive_record(GROUP) is None
        assert not os.path.exists(os.path.join(authority.path, "archive", GROUP))


def test_archive_checks_the_key_provider_before_it_archives_the_group(tmp_path):
    class UnknownOrganization:
        def current_key(self, org):
            raise KeyError(org)

        def key_for(self, org, key_id):
            raise KeyError(org)

    class Unreachable(UnknownOrganization):
        def current_key(self, org):
            raise ConnectionError("kms unreachable")

    class Malformed(UnknownOrganization):
        def current_key(self, org):
            return ("not a key id", bytes(32))

    with open_with_group(str(tmp_path / "s")) as authority:
        # a falsy one is no provider either; a malformed answer is found before, not after, group.archive
        for provider in (UnknownOrganization(), Unreachable(), Malformed(), object(), 0, ""):
            with pytest.raises(InvalidCommand) as caught:
                authority.archive(GROUP, actor=OWNER, action_id="archive", key_provider=provider)
            assert caught.value.detail["field"] == "key_provider"
        _, state = authority.state(GROUP, f"group:{GROUP}")
        assert state["status"] != "archived"  # still live: nothing was accepted
        assert authority.archive(GROUP, actor=OWNER, action_id="archive").group == GROUP


def test_audit_log_deletion_interrupted_after_commit_is_finished_at_open(tmp_path):
    path = str(tmp_path / "s")
    with Authority.open(path) as authority:
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body={"org": "acme"}))
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
    code = (
        "import sys\nfrom mwpstore import Authority, Command\n"
        "a = Authority.open(sys.argv[1])\n"
        f"a.accept(Command(actor='{OWNER}', action_id='del', group='{GROUP}', kind='audit.delete', target='{GROUP}', body={{'basis': 'legal'}}))\n"
    )
    env = dict(os.environ, MWPSTORE_FAILPOINT="authority.after_index_commit", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    audit = os.path.join(path, record.audit_location)
    assert os.path.exists(audit)  # the Event is durable, the file not yet deleted
    with Authority.open(path):
        assert not os.path.exists(audit)


def test_an_open_looks_again_only_at_audit_log_directories_that_are_still_there(tmp_path, monkeypatch):
    """Every open listed the directory of every deleted audit log again (and looked up its Group),
    for as long as the store lived: 200 of them took about 3 ms of each open. A deletion the open
    finds finished leaves no directory behind, and later opens do not look at it; a kept audit log,
    and a directory holding a file archive() never writes, stay."""
    from mwpstore import authority as authority_module

    path = str(tmp_path / "s")
    with Authority.open(path) as authority:
        for group in ("g-deleted", "g-stray", "g-kept"):
            authority.accept(Command(actor=OWNER, action_id=f"c-{group}", group=group, kind="group.create", target=group, body={"org": "acme"}))
            authority.archive(group, actor=OWNER, action_id=f"archive-{group}")
        stray = os.path.join(path, "archive", "g-stray", "notes.txt")
        with open(stray, "w") as handle:
            handle.write("an operator's file")
        for group in ("g-deleted", "g-stray"):
            authority.delete_audit_log(group, actor=OWNER, action_id=f"del-{group}", basis="legal")
    assert sorted(os.listdir(os.path.join(path, "archive"))) == ["g-deleted", "g-kept", "g-stray"]
    looked_at: list[str] = []
    remove = authority_module.Authority._remove_audit_log
    monkeypatch.setattr(authority_module.Authority, "_remove_audit_log", lambda self, group: looked_at.append(group) or remove(self, group))
    with Authority.open(path) as authority:
        assert looked_at == ["g-deleted", "g-stray"]
        assert authority.verify().ok
    assert sorted(os.listdir(os.path.join(path, "archive"))) == ["g-kept", "g-stray"]
    assert os.listdir(os.path.join(path, "archive", "g-stray")) == ["notes.txt"]
    assert len(os.listdir(os.path.join(path, "archive", "g-kept"))) == 1
    looked_at.clear()
    with Authority.open(path) as authority:
        assert looked_at == ["g-stray"]  # the directory is still there: looked at again
        assert authority.verify().ok


def test_verify_covers_snapshots_audit_logs_and_tombstoned_chains(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact", reason="legal")
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert authority.verify().ok  # redacted chain, snapshot and audit log all verify
        audit = os.path.join(authority.path, record.audit_location)
        data = bytearray(open(audit, "rb").read())
        data[len(data) // 2] ^= 0x20
        os.chmod(audit, 0o600)
        with open(audit, "wb") as handle:
            handle.write(bytes(data))
        problems = authority.verify().problems
        assert len(problems) == 1 and problems[0].startswith(f"audit log {record.audit_location}: ARCHIVE_INVALID")
        os.remove(audit)
        assert "missing" in authority.verify().problems[0]

def _killed_at(failpoint: str, path: str, call: str) -> None:
    """Run ``Authority.open(path).<call>`` in a child that the fail point kills (SIGKILL)."""
    code = f"import sys\nfrom mwpstore import Authority\nAuthority.open(sys.argv[1]).{call}\n"
    env = dict(os.environ, MWPSTORE_FAILPOINT=failpoint, PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr



@pytest.mark.parametrize("killed_after_commit", [False, True])
def test_a_legal_deletion_removes_an_audit_log_whose_archive_record_was_never_logged(tmp_path, killed_after_commit):
    """archive() publishes the audit log, then logs its record. Killed between the two, the
    Group is archived with its history on disk and no record naming the file; a legal deletion
    must still remove it, on commit or, when killed right after the commit, at the next open."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        _fill(authority, GROUP, 3)
    # the third commit of archive(): group.archive, the final snapshot's reference, the record
    _killed_at("authority.before_log_append:3", path, f"archive('{GROUP}', actor='{OWNER}', action_id='archive')")
    directory = os.path.join(path, "archive", GROUP)
    assert [name for name in os.listdir(directory) if name.endswith(".log")]  # the history is on disk
    if killed_after_commit:
        _killed_at(
            "authority.after_index_commit", path,
            f"delete_audit_log('{GROUP}', actor='{OWNER}', action_id='del', basis='legal')",
        )
    with Authority.open(path) as authority:
        assert authority.archive_record(GROUP) is None
        if not killed_after_commit:
            authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        assert authority.read(GROUP)[-1].kind == "audit.delete"
        # emptied by the commit, or found so by the open, which removes the directory then
        assert os.listdir(directory) == [] if not killed_after_commit else not os.path.exists(directory)
        assert authority.verify().ok


def test_an_archive_whose_check_fails_leaves_no_audit_log_behind(tmp_path):
    from mwpstore.audit_log import FileKeyProvider

    class ForgetfulProvider(FileKeyProvider):
        """Hands out the current key for writing, then cannot find it again for the check."""

        forget = False

        def current_key(self, org):
            self.forget = False
            key = super().current_key(org)
            self.forget = True
            return key

        def key_for(self, org, key_id):
            if self.forget:
                raise KeyError(key_id)
            return super().key_for(org, key_id)

    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        provider = ForgetfulProvider(os.path.join(authority.path, "keys", "orgs"))
        with pytest.raises(MwpError):
            authority.archive(GROUP, actor=OWNER, action_id="archive", key_provider=provider)
        assert authority.archive_record(GROUP) is None
        assert os.listdir(os.path.join(authority.path, "archive", GROUP)) == []


def test_a_legal_deletion_accepted_while_archive_writes_leaves_no_audit_log(tmp_path):
    """audit.delete can be accepted once group.archive is, while archive() is still writing the
    audit log (another thread; here the key provider stands for it). The deletion removes what
    archive/<group>/ holds when it commits, which is not yet the file: archive() must not publish
    it afterwards."""
    from mwpstore.audit_log import FileKeyProvider

    class DeletingProvider(FileKeyProvider):
        """Accepts the legal deletion when write_audit_log asks for the key (before its file exists)."""

        calls = 0

        def current_key(self, org):
            self.calls += 1
            if self.calls == 2:
                authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
            return super().current_key(org)

    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        provider = DeletingProvider(os.path.join(authority.path, "keys", "orgs"))
        with pytest.raises(InvalidState):
            authority.archive(GROUP, actor=OWNER, action_id="archive", key_provider=provider)
        assert provider.calls == 2
        assert authority.read(GROUP)[-1].kind == "audit.delete"
        assert authority.archive_record(GROUP) is None
        assert os.listdir(os.path.join(authority.path, "archive", GROUP)) == []
        assert authority.verify().ok


def test_two_threads_archiving_one_group_log_one_record_naming_the_file_left(tmp_path):
    """Each archive() writes the audit log with fresh nonces. Run side by side for one Group, both
    would write the file and log a record, and the record logged last need not name the file that
    stayed. The provider holds the first caller (up to a second) until the second one arrives."""
    from mwpstore.audit_log import FileKeyProvider

    meeting = threading.Barrier(2)

    class MeetingProvider(FileKeyProvider):
        def current_key(self, org):
            with contextlib.suppress(threading.BrokenBarrierError):
                meeting.wait(timeout=1.0)  # the first caller waits here for the second one
            return super().current_key(org)

    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        provider = MeetingProvider(os.path.join(authority.path, "keys", "orgs"))
        records: list = []
        errors: list = []

        def archive(action_id: str) -> None:
            try:
                records.append(authority.archive(GROUP, actor=OWNER, action_id=action_id, key_provider=provider))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=archive, args=(f"archive-{i}",)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [] and len(records) == 2
        assert records[0] == records[1] == authority.archive_record(GROUP)
        assert [event.kind for event in authority.read(GROUP)].count("group.archive") == 1
        assert authority.verify().ok
        assert authority.compact().groups_compacted == [GROUP]  # the record names the file left


def test_compaction_hashes_audit_logs_in_bounded_memory(tmp_path):
    """Compaction checks each archived Group's audit log against its record before dropping the
    Group's Events. A file of another size is not the one the record names and is not read; the
    one that is read is hashed piece by piece, never loaded whole."""
    import tracemalloc

    with open_with_group(str(tmp_path / "s")) as authority:
        _fill(authority, GROUP, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        audit = os.path.join(authority.path, record.audit_location)
        os.truncate(audit, 256 * 1024 * 1024)  # extended, sparse: no disk space used
        tracemalloc.start()
        try:
            report = authority.compact()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert report.events_dropped == 0  # not the recorded file: the history stays in the log
        assert peak < 32 * 1024 * 1024


def test_verify_reports_a_payload_removed_from_the_log_without_a_tombstone(tmp_path, monkeypatch):
    """The chain commits to a payload's hash only, so a log rewritten with a payload dropped keeps
    a valid chain; verify must still say that no tombstone accounts for the missing payload."""
    from mwpstore import compaction

    with open_with_group(str(tmp_path / "s")) as authority:
        open_mission(authority)
        receipt = authority.accept(secret_command())
        _fill(authority, GROUP, 2)
        # a rewrite of the log that drops Event `receipt.seq`'s payload, with no event.redact
        monkeypatch.setattr(compaction, "_redacted_seqs", lambda authority: {GROUP: {receipt.seq}})
        authority.compact()
        assert authority.read(GROUP)[receipt.seq - 1].body is None
        problems = authority.verify().problems
        assert len(problems) == 1 and f"seq {receipt.seq}" in problems[0] and "tombstone" in problems[0]


def test_compaction_of_a_store_with_small_segments_writes_groups_that_fit_them(tmp_path):
    """The copy batches many records a group; with segments smaller than a batch it asked the log
    for a group no segment could hold (``LIMIT_EXCEEDED``, ``group_too_large``), and a store
    opened with small segments could never be compacted."""
    with Authority.open(str(tmp_path / "s"), segment_bytes=64 * 1024) as authority:
        authority.accept(group_create(GROUP))
        for first in range(0, 400, 100):
            authority.accept_many([mission_create(f"m-{number}") for number in range(first, first + 100)])
        events = authority.read(GROUP, after=0, limit=1000)
        report = authority.compact()
        assert report.records_after == report.records_before == 401
        assert len(authority.log.segments()) > 1  # the copy spans segments, as the original did
        assert authority.read(GROUP, after=0, limit=1000) == events
        assert authority.verify().ok


class _FirstFormGroupRecords:
    """compaction's encoder writing a compacted Group's record as 0.1.0 did (before a5cb9be):
    (group, seq, chain hash, revision, state) of the Group aggregate alone."""

    def __init__(self, encoder):
        self._encoder = encoder

    def encode(self, value):
        if len(value) == 4 and isinstance(value[3], list):
            group, seq, digest, kept = value
            (aggregate,) = [effect for effect in kept if effect.aggregate == f"group:{group}"]
            value = (group, seq, digest, aggregate.revision, aggregate.state)
        return self._encoder.encode(value)


def test_a_compacted_group_record_of_the_first_form_is_read(tmp_path, monkeypatch):
    """A store 0.1.0 compacted: its Group records kept the Group aggregate alone, in five fields.
    Every open that rebuilt the index from such a log was CORRUPTION (decode), so no later build
    could open the store at all (found opening a store 0.1.0 wrote, finding C1)."""
    from mwpstore import compaction

    path = str(tmp_path / "s")
    monkeypatch.setattr(compaction, "_ENCODER", _FirstFormGroupRecords(compaction._ENCODER))
    with open_with_group(path) as authority:
        authority.accept(group_create("active"))
        _fill(authority, "active", 3)
        _fill(authority, GROUP, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive", reason="done")
        archived_revision, archived_state = authority.state(GROUP, f"group:{GROUP}")
        assert authority.compact().groups_compacted == [GROUP]
        head, group_state = authority.head(GROUP), authority.state(GROUP, f"group:{GROUP}")
        # the record's revision and state, as the Group aggregate had them, marked compacted
        assert group_state == (archived_revision, {**archived_state, "compacted": True}) and archived_revision > 1
        active = authority.read("active")
    monkeypatch.undo()
    shutil.rmtree(os.path.join(path, "index"))
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "rebuild"
        assert reopened.head(GROUP) == head and reopened.head(GROUP)[0] == record.last_seq
        assert reopened.state(GROUP, f"group:{GROUP}") == group_state and group_state[1]["compacted"] is True
        assert reopened.read("active") == active
        with pytest.raises(GroupArchived):
            reopened.accept(mission_create("late"))
        report = reopened.verify()
        assert report.ok, report.problems


def _hostile_group_record(form: str) -> tuple[object, ...]:
    """The fields of a Group record (``G``) for a Group "ghost" that no compaction wrote."""
    from mwpstore.messages import Effect

    digest = b"\x01" * 32
    return {
        "first form, not marked compacted": ("ghost", 3, digest, 1, {"status": "archived"}),
        "second form, no Group aggregate": ("ghost", 3, digest, [Effect("member:o", 1, {"role": "owner"})]),
        "second form, the Group aggregate removed": ("ghost", 3, digest, [Effect("group:ghost", 1, None)]),
        "second form, a WorkItem kept": (
            "ghost", 3, digest, [Effect("group:ghost", 1, {"compacted": True}), Effect("workitem:w", 1, {"lease": None})]
        ),
        "second form, the Group aggregate twice": (
            "ghost", 3, digest, [Effect("group:ghost", 1, {"compacted": True}), Effect("group:ghost", 2, {"compacted": True})]
        ),
        "first form, no archive record before it": ("ghost", 3, digest, 1, {"status": "archived", "compacted": True}),
        "second form, a Membership twice": (
            "ghost", 3, digest, [Effect("group:ghost", 1, {"compacted": True}), Effect("member:o", 1, {}), Effect("member:o", 2, {})]
        ),
        "first form, revision 0": ("ghost", 3, digest, 0, {"status": "archived", "compacted": True}),
        "second form, a 31-byte chain hash": ("ghost", 3, digest[:31], [Effect("group:ghost", 1, {"compacted": True})]),
    }[form]


@pytest.mark.parametrize(
    ("form", "why"),
    [
        ("first form, not marked compacted", "not a Group remainder compaction writes"),
        ("second form, no Group aggregate", "not a Group remainder compaction writes"),
        ("second form, the Group aggregate removed", "not a Group remainder compaction writes"),
        ("second form, a WorkItem kept", "not a Group remainder compaction writes"),
        ("second form, the Group aggregate twice", "not a Group remainder compaction writes"),
        ("second form, a Membership twice", "not a Group remainder compaction writes"),
        ("first form, no archive record before it", "which has no archive record before it"),
        ("first form, revision 0", "gives group:ghost revision 0"),
        ("second form, a 31-byte chain hash", "holds a 31-byte hash"),
    ],
)
def test_a_group_record_no_compaction_wrote_is_corruption_at_rebuild(tmp_path, form, why):
    """A ``G`` record that decodes (either form) but is not what compaction writes (the Group
    aggregate marked compacted, its Memberships, after the Group's archive record) is CORRUPTION
    (decode) at the rebuild and in verify, not a Group the reads cannot serve: such a store
    opened, and ``read`` of the Group was a bare AssertionError (no archive record) or "the index
    lost Events ...; run rebuild" (not marked compacted), which no rebuild cures."""
    import msgspec

    from mwpstore.authority import GROUP_TAG
    from mwpstore.errors import Corruption

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    with SegmentLog.open(os.path.join(path, "log")) as log:
        (position,) = log.append([GROUP_TAG + msgspec.msgpack.encode(_hostile_group_record(form))])
    shutil.rmtree(os.path.join(path, "index"))
    with pytest.raises(Corruption) as caught:
        Authority.open(path)
    assert caught.value.detail == {"offset": position, "reason": "decode"}
    assert why in caught.value.message


def test_a_compacted_group_whose_archive_record_the_index_lost_is_corruption(tmp_path):
    """An index that says a Group is compacted but holds no archive record for it (its entry and
    presence gone, as a rebuild from another log leaves it) answers CORRUPTION, not a bare
    AssertionError, from read and replay_floor."""
    from mwpstore.errors import Corruption

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        _fill(authority, GROUP, 2)
        authority.archive(GROUP, actor=OWNER, action_id="archive", reason="done")
        authority.compact()
        with authority.index.begin(write=True) as txn:
            assert authority.index.delete(txn, b"archives", GROUP.encode())
        for call in (lambda: authority.read(GROUP), lambda: authority.replay_floor(GROUP)):
            with pytest.raises(Corruption) as caught:
                call()
            assert caught.value.detail["reason"] == "index_missing"
