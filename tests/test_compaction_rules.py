"""Compaction and redaction, one rule a test (MWP-MSN-009): the order and durability of the
switch and of its recovery, what a compaction keeps through a second one and a reopen, its report,
what it refuses to trust or to run on, and the engine's tombstone checks inside a batch.

Each rule here was found unpinned by a mutation round over compaction and redaction: the code
kept it, but no test failed when it was switched off."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import time

import msgspec
import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group, store_files_held
from blocking import outcome_within
from mwpstore import Authority, Command, compaction
from mwpstore.compaction import MARKER, finish_compaction, recover_interrupted_compaction
from mwpstore.errors import ActionIdCollision, Corruption, CursorTooOld, InvalidCommand, StorageFailed
from mwpstore.index import event_key
from mwpstore.messages import decode_event, encode_receipt
from mwpstore.segment_log import SegmentLog

_NAMES = ("log", "log.old", "log.compact", MARKER, MARKER + ".tmp")


@pytest.fixture
def steps(monkeypatch) -> list[tuple[str, ...]]:
    """What compaction and its recovery do to the store directory, in order: each rename, removal
    and fsync of the log directories and the marker, each directory sync, each fail point reached."""
    trace: list[tuple[str, ...]] = []
    real_rename, real_rmtree, real_remove, real_fsync = os.rename, shutil.rmtree, os.remove, os.fsync
    real_sync_directory, real_hit = compaction._fsync_directory, compaction.failpoints.hit

    def rename(source, target, *args, **kwargs):
        if os.path.basename(source) in _NAMES:
            trace.append(("rename", os.path.basename(source), os.path.basename(target)))
        return real_rename(source, target, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if os.path.basename(path) in _NAMES:
            trace.append(("rmtree", os.path.basename(path)))
        return real_rmtree(path, *args, **kwargs)

    def remove(path, *args, **kwargs):
        if os.path.basename(path) in _NAMES:
            trace.append(("remove", os.path.basename(path)))
        return real_remove(path, *args, **kwargs)

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name in _NAMES:
            trace.append(("fsync", name))
        return real_fsync(fd)

    def sync_directory(directory):
        trace.append(("sync directory", os.path.basename(directory)))
        return real_sync_directory(directory)

    def hit(name):
        if name.startswith("compaction."):
            trace.append(("at", name))
        return real_hit(name)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(os, "remove", remove)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(compaction, "_fsync_directory", sync_directory)
    monkeypatch.setattr(compaction.failpoints, "hit", hit)
    return trace


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced descriptors through /proc")
def test_each_compaction_step_is_durable_before_the_next_one_depends_on_it(tmp_path, steps):
    """The copy is synced before the marker names it complete; the marker's bytes before its name,
    and its name before the old log is moved; the switch before the index is built from the new
    log; log.old goes before the marker (a marker gone with log.old left would be a stray log.old
    that stops every later compaction), and both removals are synced."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([])
        steps.clear()
        authority.compact()
    assert steps == [
        ("fsync", "log.compact"),  # the copy's own directory, by the segment log
        ("sync directory", "s"),
        ("at", "compaction.copy"),
        ("fsync", MARKER + ".tmp"),
        ("rename", MARKER + ".tmp", MARKER),
        ("sync directory", "s"),
        ("at", "compaction.marked"),
        ("rename", "log", "log.old"),
        ("at", "compaction.half_switched"),
        ("rename", "log.compact", "log"),
        ("sync directory", "s"),
        ("at", "compaction.switched"),
        ("at", "compaction.indexed"),
        ("rmtree", "log.old"),
        ("remove", MARKER),
        ("sync directory", "s"),
    ]


def _interrupted(path: str, state: str) -> None:
    """Leave the store at ``path`` as a compaction interrupted at ``state`` leaves it (its
    log.compact a copy of the log: what a compaction with nothing to drop writes)."""
    with open_with_group(path) as authority:
        authority.accept_many([])
    log = os.path.join(path, "log")
    shutil.copytree(log, os.path.join(path, "log.compact"))
    if state == "copying":
        return
    with open(os.path.join(path, MARKER), "wb") as marker:
        marker.write(b"log.compact is complete\n")
    if state == "half switched":
        os.rename(log, os.path.join(path, "log.old"))
    elif state == "indexed":
        os.rename(log, os.path.join(path, "log.old"))
        os.rename(os.path.join(path, "log.compact"), log)


_FINISH = [("rmtree", "log.old"), ("remove", MARKER), ("sync directory", "s")]


@pytest.mark.parametrize(
    "state, rebuild, expected",
    [
        ("copying", False, [("rmtree", "log.compact"), ("sync directory", "s")]),
        ("marked", True, [("rename", "log", "log.old"), ("rename", "log.compact", "log"), ("sync directory", "s")]),
        ("half switched", True, [("rename", "log.compact", "log"), ("sync directory", "s")]),
        ("indexed", True, []),
    ],
)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced descriptors through /proc")
def test_recovery_of_an_interrupted_compaction_syncs_each_step_and_asks_for_a_rebuild_past_the_marker(tmp_path, steps, state, rebuild, expected):
    """Without the marker the copy is dropped and the old log kept; with it the switch is finished
    whatever step it reached, and the index (built from the old log, or never switched) must be
    rebuilt. Each change of the store directory is synced before the open goes on. log.old and
    the marker stay until finish_compaction, which the open calls once the new log is indexed,
    and which removes log.old before the marker."""
    path = str(tmp_path / "s")
    _interrupted(path, state)
    steps.clear()
    assert recover_interrupted_compaction(path) is rebuild
    assert steps == expected
    if rebuild:
        assert sorted(name for name in os.listdir(path) if name.startswith(("log", "COMPACT"))) == ["COMPACT-SWITCH", "log", "log.old"]
        steps.clear()
        finish_compaction(path)
        assert steps == _FINISH
    assert sorted(name for name in os.listdir(path) if name.startswith(("log", "COMPACT"))) == ["log"]


@pytest.mark.parametrize("state", ["marked", "half switched", "indexed"])
def test_an_interrupted_compaction_whose_new_log_fails_its_rebuild_keeps_the_old_log(tmp_path, state):
    """The open that finishes a switch removes log.old only once the index is built from the new
    log, as a compaction that runs to its end does: a new log found damaged then (here a byte of
    its record flipped) is refused as Corruption, and the old log is still there, whole, to be put
    back by hand; the next open refuses the same way and keeps it too."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    _interrupted(path, state)
    new_log = os.path.join(path, "log.compact" if state in ("marked", "half switched") else "log")
    old_log = os.path.join(path, "log.old" if state in ("half switched", "indexed") else "log")
    (segment,) = [os.path.join(new_log, name) for name in os.listdir(new_log) if name.endswith(".seg")]
    with open(segment, "r+b") as file:  # a byte of the mission.create record's body
        data = file.read()
        at = data.index(b"m-1")
        file.seek(at)
        file.write(b"M")
    kept = {name: open(os.path.join(old_log, name), "rb").read() for name in os.listdir(old_log)}
    for _ in range(2):
        with pytest.raises(Corruption):
            Authority.open(path)
        old = os.path.join(path, "log.old")
        assert {name: open(os.path.join(old, name), "rb").read() for name in os.listdir(old)} == kept
        assert os.path.exists(os.path.join(path, MARKER))
    shutil.rmtree(os.path.join(path, "log"))  # what an operator does: the old log back, the marker away
    os.rename(os.path.join(path, "log.old"), os.path.join(path, "log"))
    os.remove(os.path.join(path, MARKER))
    with Authority.open(path) as authority:
        assert authority.state(GROUP, "mission:m-1")[1] is not None


def _log_records(authority: Authority) -> int:
    log = authority.log
    return sum(len(batch.records) for batch in log.scan(log.start, end=log.end))


def _log_size(authority: Authority) -> int:
    log = os.path.join(authority.path, "log")
    return sum(entry.stat().st_size for entry in os.scandir(log) if entry.is_file())


def test_the_report_counts_what_the_compaction_read_wrote_removed_and_dropped(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        for group in ("g-2", "active"):
            authority.accept(group_create(group))
        authority.accept_many([mission_create(f"m-{n}", group=group) for group in (GROUP, "g-2", "active") for n in range(3)])
        secret = authority.accept(Command(actor=OWNER, action_id="s", group="active", kind="mission.close", target="m-0", body={"reason": "pii"}))
        authority.redact("active", secret.seq, actor=OWNER, action_id="r", reason="pii")
        for group in ("g-2", GROUP):
            authority.archive(group, actor=OWNER, action_id=f"archive-{group}")
        heads = {group: authority.head(group)[0] for group in (GROUP, "g-2")}
        records_before, bytes_before = _log_records(authority), _log_size(authority)
        report = authority.compact()
        assert (report.records_before, report.bytes_before) == (records_before, bytes_before)
        assert (report.records_after, report.bytes_after) == (_log_records(authority), _log_size(authority))
        # each dropped Event leaves its receipt (one record for one), and each Group one G record
        assert report.records_after == report.records_before + 2
        assert report.groups_compacted == [GROUP, "g-2"]  # both, in order
        assert report.events_dropped == sum(heads.values()) and report.payloads_removed == 1
        again = authority.compact()  # what the first one removed is not counted again
        assert (again.payloads_removed, again.events_dropped, again.groups_compacted) == (0, 0, [])
        assert again.records_before == again.records_after == report.records_after


def test_a_compaction_that_waited_for_a_commit_that_failed_changes_nothing(tmp_path, monkeypatch):
    """compact() passes the write gate, then waits for the running commit; when that commit fails
    (the handle refuses writes from then on) the compaction is refused too, with nothing written."""
    outcomes: dict[str, object] = {}
    held, go = threading.Event(), threading.Event()
    append = SegmentLog.append

    def run(name, call):
        try:
            outcomes[name] = call()
        except Exception as exc:  # noqa: BLE001 - checked below
            outcomes[name] = exc

    with open_with_group(str(tmp_path / "s")) as authority:

        def failing(log, records, *args, **kwargs):
            if log is not authority.log:
                return append(log, records, *args, **kwargs)
            held.set()
            assert go.wait(30)
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(SegmentLog, "append", failing)
        writer = threading.Thread(target=run, args=("accept", lambda: authority.accept(mission_create("m-lost"))))
        writer.start()
        assert held.wait(30)
        compactor = threading.Thread(target=run, args=("compact", authority.compact))
        compactor.start()
        deadline = time.monotonic() + 30
        while not authority._exclusive_waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        assert authority._exclusive_waiting  # compact() waits behind the commit
        go.set()
        writer.join(30)
        compactor.join(30)
        assert isinstance(outcomes["accept"], StorageFailed)
        assert isinstance(outcomes["compact"], StorageFailed)
        assert not [name for name in os.listdir(authority.path) if name.startswith(("log.", "COMPACT"))]


def _kept(authority: Authority, groups: tuple[str, ...]) -> dict[str, object]:
    """What a compaction must keep of each Group, as the reads show it (an archived Group's
    readable Events and floor change: its history moves to the audit log, checked apart)."""
    picture: dict[str, object] = {}
    for group in groups:
        picture[group] = [authority.head(group), authority.acked("consumer", group), authority.snapshots(group), authority.archive_record(group)]
        if authority.archive_record(group) is None:
            floor, reference = authority.replay_floor(group)
            picture[group] += [floor, reference, [(event.seq, event.hash, event.body) for event in authority.read(group, after=floor, limit=1000)]]
    return picture


def test_compaction_keeps_heads_acks_snapshots_receipts_and_tombstones_through_compactions_and_reopen(tmp_path):
    """Two active Groups (one with a redaction, one with a replay window and snapshots) and an
    archived one: after a compaction, a second one (which copies the first one's receipt and Group
    records), and a reopen, every head, ACK, snapshot reference, replay floor, archive record and
    readable Event is what it was, every Command's replay answers its original receipt byte for
    byte, and a changed body under a used Action ID is still a collision."""
    path = str(tmp_path / "s")
    window = Command(actor=OWNER, action_id="g-w", group="windowed", kind="group.create", target="windowed",
                     body={"org": "acme", "policy": {"replay_window_events": 2}})
    commands = [group_create("active"), window, *[mission_create(f"m-{n}", group=group, action_id=f"mc-{group}-{n}")
                                                  for group in (GROUP, "active", "windowed") for n in range(3)]]
    secret = Command(actor=OWNER, action_id="secret", group="active", kind="mission.close", target="m-0", body={"reason": "pii"})
    with open_with_group(path) as authority:
        receipts = {command.action_id: (command, encode_receipt(authority.accept(command))) for command in [*commands, secret]}
        for seq in (1, 3):  # the first Event of a Group, and another
            redaction = authority.redact("active", seq, actor=OWNER, action_id=f"redact-{seq}", reason="pii")
            receipts[f"redact-{seq}"] = (None, encode_receipt(redaction))
        for n in range(2):
            authority.snapshot("windowed")
            authority.accept(mission_create(f"later-{n}", group="windowed"))
        for group in ("active", "windowed", GROUP):
            authority.ack("consumer", group, 2)
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        groups = ("active", "windowed", GROUP)
        expected = _kept(authority, groups)
        assert expected["windowed"][4] > 0  # the window has moved the floor
        assert [event.seq for event in authority.read("active") if event.body is None] == [1, 3]
        assert authority.read(GROUP, limit=3)[2].body is not None  # the same sequence in another Group keeps it
        final = expected[GROUP][3].final_snapshot
        # of the archived Group, its Group aggregate (marked compacted) and its Memberships stay
        group_state = authority.state(GROUP, f"group:{GROUP}")
        members = authority.aggregates(GROUP, prefix="member:")
        assert members and len(authority.aggregates(GROUP)) > len(members) + 1
        for removed in (2, 0):  # the two redacted payloads leave the disk in the first one
            assert authority.compact().payloads_removed == removed
            assert _kept(authority, groups) == expected
            assert authority.aggregates(GROUP) == [(f"group:{GROUP}", group_state[0], {**group_state[1], "compacted": True}), *members]
            assert authority.replay_floor(GROUP) == (final.seq, final) and authority.read(GROUP, after=final.seq) == []
    with Authority.open(path) as authority:
        assert _kept(authority, groups) == expected
        for action_id, (command, encoded) in receipts.items():
            if command is not None:
                assert encode_receipt(authority.accept(command)) == encoded, action_id
        changed = receipts[f"mc-{GROUP}-0"][0]
        with pytest.raises(ActionIdCollision):
            authority.accept(msgspec.structs.replace(changed, body={"title": "other", "cost_limit": 1}))
        assert authority.verify().ok


def _archived_with_history(path: str, groups: tuple[str, ...] = (GROUP,)) -> Authority:
    authority = open_with_group(path)
    for group in groups:
        if group != GROUP:
            authority.accept(group_create(group))
        authority.accept_many([mission_create(f"m-{n}", group=group) for n in range(3)])
        authority.archive(group, actor=OWNER, action_id=f"archive-{group}")
    return authority


@pytest.mark.parametrize("replacement", ["directory", "fifo"])
def test_an_audit_log_that_is_not_a_regular_file_keeps_the_history_and_never_blocks(tmp_path, replacement):
    """Compaction reads each archived Group's audit log before it drops the Group's Events. In its
    place a directory (IsADirectoryError) or a FIFO (which a plain open would wait on for a writer
    for ever, holding every commit) is no durable audit log: the history stays in the log."""
    with _archived_with_history(str(tmp_path / "s")) as authority:
        audit = os.path.join(authority.path, authority.archive_record(GROUP).audit_location)
        os.remove(audit)
        os.mkdir(audit) if replacement == "directory" else os.mkfifo(audit)
        try:
            report = outcome_within(10, authority.compact)
        finally:
            with contextlib.suppress(OSError):  # a compaction blocked on the FIFO: let it go
                os.close(os.open(audit, os.O_WRONLY | os.O_NONBLOCK))
        assert (report.groups_compacted, report.events_dropped) == ([], 0)
        assert len(authority.read(GROUP)) == 5


def test_an_audit_log_is_hashed_in_pieces_and_one_of_another_size_is_never_read(tmp_path, monkeypatch):
    reads: dict[str, list[int]] = {}
    real_open = compaction.open_regular

    class Counted:
        def __init__(self, path):
            self.handle, self.reads = real_open(path), reads.setdefault(os.path.basename(os.path.dirname(path)), [])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def fileno(self):
            return self.handle.fileno()

        def read(self, size):
            self.reads.append(size)
            return self.handle.read(size)

    with _archived_with_history(str(tmp_path / "s"), (GROUP, "g-2")) as authority:
        with open(os.path.join(authority.path, authority.archive_record("g-2").audit_location), "ab") as grown:
            grown.write(b"\0")
        monkeypatch.setattr(compaction, "open_regular", Counted)
        assert authority.compact().groups_compacted == [GROUP]
    assert reads["g-2"] == []  # opened, its size compared, not read
    assert reads[GROUP] and set(reads[GROUP]) == {1024 * 1024}


def test_the_copy_is_written_in_bounded_groups(tmp_path, monkeypatch):
    """The copy holds at most FLUSH_RECORDS records (and FLUSH_BYTES bytes) before it writes them:
    a large log is never gathered in memory whole."""
    appended: list[int] = []
    append = SegmentLog.append
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{n}") for n in range(20)])

        def counted(log, records, *args, **kwargs):
            if log is not authority.log:
                appended.append(len(records))
            return append(log, records, *args, **kwargs)

        monkeypatch.setattr(SegmentLog, "append", counted)
        for name, bound, most in (("FLUSH_RECORDS", 3, 3), ("FLUSH_BYTES", 1, 1)):
            appended.clear()
            with monkeypatch.context() as patch:
                patch.setattr(compaction, name, bound)
                report = authority.compact()
            assert max(appended) == most and sum(appended) == report.records_after == 21, name


def test_a_leftover_log_compact_is_replaced_not_appended_to(tmp_path):
    """A log.compact that is already there when the copy starts (one whose removal failed) is
    removed first: appended to, the new log would hold its records twice."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{n}") for n in range(3)])
        events = authority.read(GROUP)
        shutil.copytree(os.path.join(authority.path, "log"), os.path.join(authority.path, "log.compact"))
        assert authority.compact().records_after == 4
        assert authority.read(GROUP) == events and authority.verify().ok


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's open files from /proc")
def test_a_new_log_whose_index_build_failed_is_closed(tmp_path, monkeypatch):
    """The switch opens the new log, then builds its index; when the build fails the handle never
    gets the new log, so the switch closes it itself (the next open finishes the switch)."""
    with open_with_group(str(tmp_path / "s")) as authority:

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Authority, "_build_index", full_disk)
        with pytest.raises(StorageFailed):
            authority.compact()
        log = os.path.join(os.path.realpath(authority.path), "log", "")
        assert not [name for name in store_files_held(authority.path) if name.startswith(log)]


def _redact(group: str, seq: int, action_id: str) -> Command:
    return Command(actor=OWNER, action_id=action_id, group=group, kind="event.redact", target=str(seq), body={"reason": "pii"})


@pytest.mark.parametrize("commit_fails", [False, True])
def test_a_tombstone_decided_earlier_in_the_batch_is_never_redacted_and_the_refusal_rests_on_the_batch(tmp_path, monkeypatch, commit_fails):
    """In one batch: a redaction (its tombstone is Event 4 of g-1), a redaction of that tombstone
    (refused: the record of a deletion is never deleted), and a redaction of g-2's Event 4, an
    ordinary Event at the same sequence in another Group (accepted). When the commit fails, the
    refusal, decided over an Event that never became durable, is the commit's failure too."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(group_create("g-2"))
        authority.accept_many([mission_create(f"m-{n}") for n in range(2)] + [mission_create(f"m-{n}", group="g-2") for n in range(4)])
        if commit_fails:
            monkeypatch.setattr(SegmentLog, "append", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        results = authority.accept_many([_redact(GROUP, 2, "r-1"), _redact(GROUP, 4, "r-2"), _redact("g-2", 4, "r-3")])
        if commit_fails:
            assert [type(result.error) for result in results] == [StorageFailed] * 3
            return
        assert [result.ok for result in results] == [True, False, True]
        assert isinstance(results[1].error, InvalidCommand) and results[0].unwrap().seq == 4
        assert [event.seq for event in authority.read("g-2") if event.body is None] == [4]


def test_an_audit_log_holds_redacted_events_without_their_payload(tmp_path):
    """archive() writes the history as every read sees it: a redacted payload never reaches the
    audit log, which outlives the compaction that removes it from the log."""
    from mwpstore.audit_log import FileKeyProvider, read_audit_log

    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{n}") for n in range(3)])
        authority.redact(GROUP, 2, actor=OWNER, action_id="redact", reason="pii")
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        provider = FileKeyProvider(os.path.join(authority.path, "keys", "orgs"))
        records = read_audit_log(os.path.join(authority.path, record.audit_location), key_provider=provider, org="acme", group=GROUP)
        events = [decode_event(data) for data in records]
        assert [event.seq for event in events if event.body is None] == [2]
        assert authority.verify().ok


def test_a_deleted_audit_log_is_gone_durably(tmp_path, synced_directories):
    """The removal of an audit log is synced in its directory, as every other removal the
    engine promises is."""
    synced = synced_directories
    with _archived_with_history(str(tmp_path / "s")) as authority:
        audit = os.path.join(authority.path, authority.archive_record(GROUP).audit_location)
        synced.clear()
        authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        assert not os.path.exists(audit) and os.path.dirname(audit) in synced


def test_a_redaction_of_the_head_whose_index_entry_is_lost_is_index_damage(tmp_path):
    """The engine looks the redacted Event up in the index; an Event at or below the head that the
    index does not hold is damage (rebuild), never a sequence to tombstone unseen."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{n}") for n in range(2)])
        head = authority.head(GROUP)[0]
        with authority.index.env.begin(write=True) as txn:
            assert txn.delete(event_key(GROUP, head), db=authority.index.dbs[b"events"])
        with pytest.raises(Corruption) as caught:
            authority.redact(GROUP, head, actor=OWNER, action_id="r", reason="pii")
        assert caught.value.detail["reason"] == "index_missing"
        assert authority.head(GROUP)[0] == head


def test_the_replay_floor_is_the_newest_eligible_snapshot_and_the_offer_the_newest_snapshot(tmp_path):
    """Window 2, snapshots at 3, 5 and 7, head 7: 3 and 5 are at most head - 2, so the floor is 5
    (not 3), and the snapshot offered is the newest one, at 7."""
    window = Command(actor=OWNER, action_id="g-w", group=GROUP, kind="group.create", target=GROUP,
                     body={"org": "acme", "policy": {"replay_window_events": 2}})
    with Authority.open(str(tmp_path / "s")) as authority:
        authority.accept(window)
        references = []
        for first in (0, 2, 4):
            authority.accept_many([mission_create(f"m-{n}") for n in range(first, first + 2)])
            references.append(authority.snapshot(GROUP))
        assert [reference.seq for reference in references] == [3, 5, 7]
        assert authority.replay_floor(GROUP) == (5, references[-1])
        with pytest.raises(CursorTooOld) as caught:
            authority.read(GROUP, after=4)
        assert caught.value.detail["floor"] == 5 and caught.value.snapshot_ref == references[-1].to_dict()
        assert [event.seq for event in authority.read(GROUP, after=5)] == [6, 7]


def test_a_changed_body_under_a_used_action_id_is_a_collision_in_a_batch_too(tmp_path):
    """accept_many decides every Command in the commit (no fast path): a changed body under an
    Action ID used earlier in the same batch, or kept only as a compacted Group's receipt, is
    ACTION_ID_COLLISION there too, and the unchanged Command still gets its receipt byte for byte."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(group_create("g-2"))
        first = mission_create("m-1", group="g-2", action_id="a-1")
        changed = msgspec.structs.replace(first, body={"title": "other", "cost_limit": 1})
        results = authority.accept_many([first, changed])
        assert results[0].ok and results[1].error_code == "ACTION_ID_COLLISION"
        authority.archive("g-2", actor=OWNER, action_id="archive")
        assert authority.compact().groups_compacted == ["g-2"]
        again = authority.accept_many([changed, first])
        assert again[0].error_code == "ACTION_ID_COLLISION"
        assert encode_receipt(again[1].unwrap()) == encode_receipt(results[0].unwrap())


def test_in_bulk_mode_the_audit_delete_is_made_durable_before_its_file_is_removed(tmp_path, monkeypatch):
    """``sync=False`` defers the log's fdatasync, but the removal of an audit log is durable at
    once (its directory is synced). Removed while its ``audit.delete`` was in the page cache only,
    a power loss would leave the Group's history, dropped from the log by compaction, in neither
    the log nor an archive, and no Event saying that it was ordered deleted (verify: "missing, no
    accepted audit.delete explains it"). The log is synced before the file goes."""
    steps: list[object] = []
    real_sync, real_unlink = SegmentLog.sync, os.unlink

    def unlinking(path, *, dir_fd=None):
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
        steps.append(os.path.join(where, path))
        return real_unlink(path, dir_fd=dir_fd)

    with Authority.open(str(tmp_path / "s"), sync=False) as authority:
        authority.accept(group_create())
        authority.accept_many([mission_create(f"m-{n}") for n in range(3)])
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert authority.compact().groups_compacted == [GROUP]  # the audit log holds the only copy
        audit = os.path.join(authority.path, authority.archive_record(GROUP).audit_location)
        monkeypatch.setattr(SegmentLog, "sync", lambda log: (steps.append("log synced"), real_sync(log))[1])
        monkeypatch.setattr(os, "unlink", unlinking)  # through the directory's descriptor
        authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        monkeypatch.undo()
        assert not os.path.exists(audit)
    assert audit in steps and "log synced" in steps[: steps.index(audit)], steps


def test_in_bulk_mode_an_audit_delete_whose_sync_fails_keeps_the_file_and_refuses_later_writes(tmp_path, monkeypatch):
    """When the sync that must precede the removal fails, the audit log is not removed (the
    Event ordering it may not be on disk) and the store refuses further writes until reopened."""
    import errno

    with Authority.open(str(tmp_path / "s"), sync=False) as authority:
        authority.accept(group_create())
        authority.accept_many([mission_create(f"m-{n}") for n in range(3)])
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        audit = os.path.join(authority.path, authority.archive_record(GROUP).audit_location)

        def failing(log):
            raise StorageFailed("injected", errno=errno.EIO)

        monkeypatch.setattr(SegmentLog, "sync", failing)
        with pytest.raises(StorageFailed):
            authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        monkeypatch.undo()
        assert os.path.exists(audit)
        with pytest.raises(StorageFailed):
            authority.accept(mission_create("m-late"))


@pytest.mark.parametrize("failure", ["EIO", "interrupt"])
def test_a_marker_whose_write_fails_leaves_no_temporary_file(tmp_path, monkeypatch, failure):
    """The marker is written to COMPACT-SWITCH.tmp, synced, then renamed. A write or sync that
    fails (or is interrupted: KeyboardInterrupt in a process that lives on) must not leave the
    temporary file behind: the handle's process only removes it at its next open."""
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(MARKER + ".tmp"):
            if failure == "interrupt":
                raise KeyboardInterrupt
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        old_log = os.stat(os.path.join(path, "log")).st_ino
        monkeypatch.setattr(os, "fsync", failing)
        with pytest.raises(KeyboardInterrupt if failure == "interrupt" else StorageFailed):
            authority.compact()
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert not os.path.exists(os.path.join(path, MARKER + ".tmp"))
        assert not os.path.exists(os.path.join(path, MARKER))
        assert os.stat(os.path.join(path, "log")).st_ino == old_log  # no switch without its marker


@pytest.mark.parametrize("obstacle", ["fifo", "symlink"])
def test_the_marker_is_not_written_through_what_lies_at_its_temporary_name(tmp_path, obstacle):
    """``COMPACT-SWITCH.tmp`` is a fixed name, cleared only at open. Something put there while the
    handle is open is no reason to wait (a FIFO: the marker's open for writing waited for a reader
    for good, holding the commit lock) or to write outside the store (a symbolic link: the file it
    names was truncated and overwritten with the marker)."""
    path = str(tmp_path / "s")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        temp = os.path.join(path, MARKER + ".tmp")
        if obstacle == "fifo":
            os.mkfifo(temp)
        else:
            os.symlink(outside, temp)
        try:
            report = outcome_within(10, authority.compact)
        finally:
            if os.path.lexists(temp) and stat.S_ISFIFO(os.lstat(temp).st_mode):
                os.close(os.open(temp, os.O_RDONLY | os.O_NONBLOCK))  # lets a writer waiting there go on
        assert isinstance(report, compaction.CompactionReport), report
        assert outside.read_bytes() == b"keep"
        assert not os.path.lexists(temp) and not os.path.exists(os.path.join(path, MARKER))
        authority.accept(mission_create("m-2"))
        assert authority.verify().ok


def test_a_fifo_put_at_the_markers_temporary_name_after_it_was_cleared_is_no_hang(tmp_path, monkeypatch):
    """What lies at ``COMPACT-SWITCH.tmp`` is removed before the marker is created, and the create
    is exclusive: a FIFO put there between the two (another process, as the clearing returns) ends
    the compaction with a typed error, not in a wait for a reader; the next open settles it."""
    path = str(tmp_path / "s")
    clear = compaction._remove_marker_temp
    calls: list[str] = []

    def cleared_then_a_fifo(directory: str) -> None:
        clear(directory)
        if not calls:
            os.mkfifo(os.path.join(directory, MARKER + ".tmp"))
        calls.append(directory)

    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        monkeypatch.setattr(compaction, "_remove_marker_temp", cleared_then_a_fifo)
        temp = os.path.join(path, MARKER + ".tmp")
        try:
            outcome = outcome_within(10, authority.compact)
        finally:
            if os.path.lexists(temp) and stat.S_ISFIFO(os.lstat(temp).st_mode):
                os.close(os.open(temp, os.O_RDONLY | os.O_NONBLOCK))  # lets a writer waiting there go on
        monkeypatch.undo()
        assert isinstance(outcome, StorageFailed), outcome
        assert not os.path.lexists(temp) and not os.path.exists(os.path.join(path, MARKER))
    with Authority.open(path) as authority:
        authority.accept(mission_create("m-2"))
        assert isinstance(authority.compact(), compaction.CompactionReport)
        assert authority.head(GROUP)[0] == 3 and authority.verify().ok

def test_open_removes_a_marker_temporary_file_a_crash_left(tmp_path):
    """A process killed between writing COMPACT-SWITCH.tmp and renaming it leaves the file; the
    marker was never complete (the copy is not committed), so the next open removes it with the
    unfinished log.compact/."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    with open(os.path.join(path, MARKER + ".tmp"), "wb") as handle:
        handle.write(b"log.compact is complete; finish the switch at open\n")
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == 2 and authority.open_report.mode == "clean"
    assert not os.path.exists(os.path.join(path, MARKER + ".tmp"))
