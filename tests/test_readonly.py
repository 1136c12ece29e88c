"""Read-only views (``Authority.open(readonly=True)``) and ``mwpstore tail`` beside a writer.

The writer is another process (``readonly_child.py``): LMDB refuses one environment opened twice
in a process, and the point is reading what another process writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from authority_helpers import GROUP, mission_create, open_with_group, store_files_held
from mwpstore import Authority, InvalidCommand, InvalidState, StoreNotFound, limits
from mwpstore.cli import EXIT_OK, EXIT_STORE_ERROR, EXIT_USAGE, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "readonly_child.py")
ENV = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO)


class Writer:
    """The child process that holds the store open for writing and accepts on request."""

    def __init__(self, path: str, segment_bytes: int = limits.SEGMENT_BYTES_DEFAULT) -> None:
        self.process = subprocess.Popen([sys.executable, CHILD, path, str(segment_bytes)], env=ENV, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.head = self._answer("READY")

    def _answer(self, word: str) -> int:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        assert line and line[0] == word, f"the writer answered {line}"
        return int(line[1])

    def do(self, instruction: str) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(instruction + "\n")
        self.process.stdin.flush()
        self.head = self._answer("DONE")
        return self.head

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=10)
        assert self.process.returncode == 0


@pytest.fixture
def writer(tmp_path) -> Iterator[tuple[str, Writer]]:
    path = str(tmp_path / "store")
    child = Writer(path)
    try:
        yield path, child
    finally:
        child.close()


def tail(path: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mwpstore", "tail", GROUP, "--store", path, "--json", *arguments],
                          env=ENV, capture_output=True, text=True, timeout=30)


class Follower:
    """``mwpstore tail -f`` in a process of its own, its output lines gathered as they come."""

    def __init__(self, path: str, timeout: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mwpstore", "tail", GROUP, "--store", path, "--json", "-f", "--timeout", str(timeout)],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.seqs: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.seqs.append(json.loads(line)[1])

    def wait_for(self, seq: int, seconds: float = 10) -> None:
        deadline = time.monotonic() + seconds
        while seq not in self.seqs:
            assert time.monotonic() < deadline, f"tail -f printed {self.seqs}, never {seq}"
            assert self.process.poll() is None or self._reader.is_alive(), f"tail -f ended: {self.process.stderr.read()}"  # type: ignore[union-attr]
            time.sleep(0.02)

    def finish(self) -> int:
        code = self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        return code


def test_tail_follow_prints_events_the_writer_accepts_meanwhile(writer):
    """`tail -f` opened the store for writing: beside the application that had it open it exited
    3 (STORE_LOCKED), and while it ran no other process could append, so it never printed a new
    Event."""
    path, child = writer
    follower = Follower(path, timeout=3)
    follower.wait_for(child.head)  # following before the Events below exist
    head = child.do("accept 3")
    follower.wait_for(head)
    assert follower.finish() == EXIT_OK
    assert follower.seqs == list(range(1, head + 1))  # each once, in order


def test_tail_works_while_another_process_holds_the_store(writer):
    path, child = writer
    head = child.do("accept 4")
    done = tail(path, "-n", "3")
    assert done.returncode == EXIT_OK, done.stderr
    assert [json.loads(line)[1] for line in done.stdout.splitlines()] == [head - 2, head - 1, head]


def test_a_view_is_the_store_as_it_was_when_it_opened(writer):
    path, child = writer
    with Authority.open(path, readonly=True) as view:
        head = view.head(GROUP)[0]
        later = child.do("accept 2")
        assert view.head(GROUP)[0] == head and [event.seq for event in view.read(GROUP)] == list(range(1, head + 1))
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == later
        assert [event.seq for event in view.read(GROUP)] == list(range(1, later + 1))


def test_tail_follow_continues_across_log_rollovers(tmp_path):
    """A view opened once knows the segments that existed then; each poll opens a new one."""
    path = str(tmp_path / "store")
    child = Writer(path, segment_bytes=limits.SEGMENT_BYTES_MIN)
    try:
        follower = Follower(path, timeout=3)
        follower.wait_for(child.head)
        segments = len(os.listdir(os.path.join(path, "log")))
        head = child.do("accept 120")  # about 1 KB each in 64 KiB segments
        assert len(os.listdir(os.path.join(path, "log"))) > segments
        follower.wait_for(head)
        assert follower.finish() == EXIT_OK
        assert follower.seqs == list(range(1, head + 1))
    finally:
        child.close()


def test_tail_follow_continues_across_a_compaction(writer):
    """A view opened once would keep reading the log and the index that the compaction replaced
    by rename; each poll opens a new one."""
    path, child = writer
    follower = Follower(path, timeout=3)
    child.do("accept 3")
    follower.wait_for(child.head)
    old_log = os.stat(os.path.join(path, "log")).st_ino
    child.do("compact")
    assert os.stat(os.path.join(path, "log")).st_ino != old_log
    head = child.do("accept 3")
    follower.wait_for(head)
    assert follower.finish() == EXIT_OK
    assert follower.seqs == list(range(1, head + 1))


def _all_events(view: Authority, group: str) -> list:
    events: list = []
    while batch := view.read(group, after=events[-1].seq if events else 0):
        events += batch
    return events


def test_views_opened_while_the_writer_appends_show_a_prefix_of_each_group(tmp_path):
    """The other tests open views between the writer's acknowledged commits. Here views open and
    read while the writer appends to the active segment, rolls it over and commits groups of
    several records: each view must open (its index names only records of the log it opened) and
    show each Group as Events 1..head, whole, chained and ending at the head's hash, never behind
    a view opened before it; the last one shows every acknowledged Event."""
    other = "g-2"  # readonly_child.py's second Group
    path = str(tmp_path / "store")
    child = Writer(path, segment_bytes=limits.SEGMENT_BYTES_MIN)
    try:
        streaming = threading.Thread(target=child.do, args=("stream 100",))
        streaming.start()
        seen = {GROUP: 0, other: 0}
        while True:
            writing = streaming.is_alive()  # before the open: the last view opens after the writer's answer
            with Authority.open(path, readonly=True) as view:
                for group in seen:
                    head, head_hash = view.head(group)
                    events = _all_events(view, group)
                    assert [event.seq for event in events] == list(range(1, head + 1)), group
                    assert head >= seen[group], f"{group}: a later view shows {head} Events, an earlier one {seen[group]}"
                    seen[group] = head
                    for earlier, event in zip(events, events[1:]):
                        assert event.group == group and event.prev_hash == earlier.hash
                        assert event.kind == "mission.create" and event.body["title"] == "x" * 1000
                    assert not events or events[-1].hash == head_hash
            if not writing:
                break
        streaming.join()
        assert seen == {GROUP: child.head, other: 1 + 100 * 2}  # child.head: the Group's head once the stream was durable
        assert child.head == 1 + 100 * 2
    finally:
        child.close()


def test_a_view_opened_before_a_compaction_reads_what_it_opened_after_the_switch(tmp_path):
    """The writer compacts while a view is open: the log directory the view opened is renamed away
    and deleted, and a new log (a new log id, other segment boundaries) takes its name. The view
    opened a segment file by its name at its first read of it: the new log's file there failed
    its frame checksums (CORRUPTION, frame_checksum), or no file had that name any more
    (STORAGE_FAILED). A read-only open now maps every segment as it opens."""
    path = str(tmp_path / "store")
    child = Writer(path, segment_bytes=limits.SEGMENT_BYTES_MIN)
    try:
        head = child.do("accept 150")  # about 1 KB each: a few 64 KiB segments
        with Authority.open(path, readonly=True) as view:
            assert len(os.listdir(os.path.join(path, "log"))) > 3
            log_before = os.stat(os.path.join(path, "log")).st_ino
            child.do("compact")
            later = child.do("accept 60")
            assert os.stat(os.path.join(path, "log")).st_ino != log_before
            events = _all_events(view, GROUP)
            assert [event.seq for event in events] == list(range(1, head + 1))
            assert all(event.prev_hash == earlier.hash for earlier, event in zip(events, events[1:]))
            assert events[-1].hash == view.head(GROUP)[1]
        with Authority.open(path, readonly=True) as view:
            assert [(event.seq, event.hash) for event in _all_events(view, GROUP)[:head]] == [(e.seq, e.hash) for e in events]
            assert view.head(GROUP)[0] == later
    finally:
        child.close()


@pytest.mark.parametrize("segment_bytes", [limits.SEGMENT_BYTES_DEFAULT, limits.SEGMENT_BYTES_MIN], ids=["name_reused", "name_gone"])
def test_a_view_whose_open_meets_a_compaction_switch_opens_again(tmp_path, monkeypatch, segment_bytes):
    """The writer compacts after the view's log open read the last segment's header by name and
    before it read the segment. With one segment the new log's file has that name (the open finds
    it is another log's: ``segment_replaced``); with many, the new log's segments begin elsewhere
    and no file has it (the open was refused with STORAGE_FAILED). A switch met inside the log
    open is a switch like one met after it: the view opens again."""
    import mwpstore.segment_log as module

    path = str(tmp_path / "store")
    child = Writer(path, segment_bytes=segment_bytes)
    try:
        head = child.do("accept 150")
        real, switched = module._open_segment_fd, []

        def open_segment_fd(segment_path):
            if not switched:
                child.do("compact")
                switched.append(os.path.exists(segment_path))
            return real(segment_path)

        monkeypatch.setattr(module, "_open_segment_fd", open_segment_fd)
        with Authority.open(path, readonly=True) as view:
            assert switched == [segment_bytes == limits.SEGMENT_BYTES_DEFAULT]
            events = _all_events(view, GROUP)
            assert [event.seq for event in events] == list(range(1, head + 1)) and events[-1].hash == view.head(GROUP)[1]
    finally:
        child.close()


def _contents(path: str) -> dict[str, tuple[int, int, str]]:
    """Every file under ``path``: (mode, mtime, content hash). LMDB's lock file holds its reader
    table, which readers of every process write by design: only its presence counts."""
    found = {}
    for directory, subdirectories, files in os.walk(path):
        for name in subdirectories + files:
            full = os.path.join(directory, name)
            status = os.lstat(full)
            relative = os.path.relpath(full, path)
            if name == "lock.mdb" or os.path.isdir(full):
                found[relative] = (status.st_mode, 0, "")
                continue
            with open(full, "rb") as handle:
                found[relative] = (status.st_mode, status.st_mtime_ns, hashlib.sha256(handle.read()).hexdigest())
    return found


def test_a_view_refuses_writes_and_leaves_the_store_unchanged(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.snapshot(GROUP)
    before = _contents(path)
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 2 and [event.seq for event in view.read(GROUP)] == [1, 2]
        assert view.state(GROUP, "mission:m-1")[0] == 1
        assert view.replay_floor(GROUP) == (0, None) and len(view.snapshots(GROUP)) == 1
        assert view.info()["open"]["mode"] == "readonly"
        writes = {
            "accept": lambda: view.accept(mission_create("m-2")),
            "accept_many": lambda: view.accept_many([mission_create("m-3")]),
            "ack": lambda: view.ack("consumer", GROUP, 1),
            "snapshot": lambda: view.snapshot(GROUP),
            "compact": lambda: view.compact(),
            "rebuild": lambda: view.rebuild(),
            "verify": lambda: view.verify(),
            "sync": lambda: view.sync(),
            "expire_leases": lambda: view.expire_leases(GROUP),
            "rotate_signing_key": lambda: view.rotate_signing_key(),
            "signing_key": lambda: view.signing_key,
            "keyring": lambda: view.keyring(),
            "redact": lambda: view.redact(GROUP, 2, actor="owner", action_id="r-1", reason="test"),
            "delete_audit_log": lambda: view.delete_audit_log(GROUP, actor="owner", action_id="d-1"),
            "archive": lambda: view.archive(GROUP, actor="owner", action_id="a-1"),
            "drop_retired_key": lambda: view.drop_retired_key("0" * 16),
            "accept_trusted": lambda: view.accept_trusted(mission_create("m-4")),
        }
        for what, write in writes.items():
            with pytest.raises(InvalidState) as refused:
                write()
            assert refused.value.detail["reason"] == "readonly" and what in refused.value.message
    assert _contents(path) == before


def test_a_view_of_a_directory_without_a_store_is_store_not_found(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(StoreNotFound):
            Authority.open(str(path), readonly=True)
    assert os.listdir(empty) == [] and not (tmp_path / "missing").exists()
    assert main(["tail", GROUP, "--store", str(empty), "--json"]) == EXIT_USAGE
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "STORE_NOT_FOUND"


def test_a_view_of_a_store_only_a_writer_can_recover_is_refused(tmp_path, capsys):
    """No index (removed, or never built), or an interrupted compaction: a view would read what
    recovery has not made consistent yet."""
    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    os.rename(os.path.join(path, "index"), os.path.join(path, "index.away"))
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and "no index" in refused.value.message
    os.rename(os.path.join(path, "index.away"), os.path.join(path, "index"))
    with open(os.path.join(path, "COMPACT-SWITCH"), "wb"):
        pass
    with pytest.raises(InvalidState) as refused:  # at once: running and interrupted look alike without the lock
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and "(running, or interrupted)" in refused.value.message
    assert main(["tail", GROUP, "--store", path, "-f", "--timeout", "0.2", "--json"]) == EXIT_STORE_ERROR
    assert json.loads(capsys.readouterr().out)["error"]["detail"]["reason"] == "recovery_needed"


def test_a_view_in_the_process_that_writes_the_store_is_refused(tmp_path):
    """LMDB must not open one environment twice in a process: the second's close would drop the
    first's locks."""
    path = str(tmp_path / "store")
    with open_with_group(path):
        with pytest.raises(InvalidCommand) as refused:
            Authority.open(path, readonly=True)
        assert refused.value.detail["field"] == "readonly"
    with Authority.open(path, readonly=True) as view:  # once the writer closed
        assert view.head(GROUP)[0] == 1


def test_a_view_asked_for_while_this_process_opens_the_store_for_writing_is_refused(tmp_path, monkeypatch):
    """The writer was registered in its process only once its open returned. A view asked for
    during the open's recovery (from its ``progress`` callable) waited two seconds for the rebuild
    and was then InvalidState (``recovery_needed``); during a redo it opened the index's LMDB
    environment the open held, and LMDB's "already open" came back as StorageFailed. It is the
    writer's process from the lock on: InvalidCommand (``readonly``) at once. An open that fails
    is no writer afterwards: a view opens."""
    import shutil

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    shutil.rmtree(os.path.join(path, "index"))  # the next open rebuilds it, calling progress
    outcomes: list[object] = []

    def progress(done: int, total: int) -> None:
        if not outcomes:
            try:
                Authority.open(path, readonly=True).close()
                outcomes.append("opened")
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                outcomes.append(exc)

    with Authority.open(path, progress=progress) as authority:
        assert authority.open_report.mode == "rebuild"
        # the writer's own refusal (not the view's InvalidState after its retries)
        assert isinstance(outcomes[0], InvalidCommand) and outcomes[0].detail["field"] == "readonly"
        assert authority.head(GROUP)[0] == 2 and authority.verify().ok

    def cancel(done: int, total: int) -> None:
        raise RuntimeError("cancelled")

    shutil.rmtree(os.path.join(path, "index"))
    with pytest.raises(InvalidCommand):
        Authority.open(path, progress=cancel)
    with pytest.raises(InvalidState) as refused:  # the failed open left no writer registered
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed"  # no index yet: not "this process writes it"
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild"
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 2

    from mwpstore import StorageFailed, compaction

    def failing(path: str) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(compaction, "recover_interrupted_compaction", failing)
    with pytest.raises(StorageFailed):  # an OS error after the lock: no writer left registered either
        Authority.open(path)
    monkeypatch.undo()
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 2


@pytest.mark.parametrize("meta", ["log_position", "log_position_one_past", "format"])
def test_a_view_of_an_index_ahead_of_the_log_or_of_another_format_is_refused(tmp_path, meta):
    """LMDB is never ahead of the log (DESIGN §3): an index that names a log position past the
    log's end (far, or by one), or has another format, is what a writer's open rebuilds. A view
    must not read it."""
    from mwpstore.index import INDEX_FORMAT, Index, u64
    from mwpstore.segment_log import SegmentLog

    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        end = log.end
    value = {"log_position": u64(10**12), "log_position_one_past": u64(end + 1), "format": INDEX_FORMAT + b"x"}[meta]
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.begin(write=True) as txn:  # sealed values: the rule, not a failed seal, must decide
        index.put(txn, b"meta", meta.removesuffix("_one_past").encode(), value)
    index.close()
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed"
    assert ("another format" if meta == "format" else "outside the log") in refused.value.message
    with Authority.open(path) as authority:  # the writer's open rebuilds it
        assert authority.open_report.mode == "rebuild"
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 1


@pytest.mark.parametrize("value", [1, "yes", None])
def test_readonly_must_be_a_bool(tmp_path, value):
    """A truthy non-bool must not decide between a view and a writer's open (which recovers and
    writes), nor a falsy one pass for a writer's."""
    path = str(tmp_path / "store")
    open_with_group(path).close()
    with pytest.raises(InvalidCommand) as refused:
        Authority.open(path, readonly=value)
    assert refused.value.detail["field"] == "readonly"


def test_a_view_that_opens_while_a_rebuild_renames_the_index_waits_for_the_new_one(tmp_path, monkeypatch):
    """Between a rebuild's renames there is no index/, only index.rebuild/: the open retries
    (for up to 2 s) instead of refusing a store that is only switching files; one that keeps
    switching past that is recovery_needed."""
    import mwpstore.authority as module

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    index, rebuilt = os.path.join(path, "index"), os.path.join(path, "index.rebuild")
    os.rename(index, rebuilt)
    pauses = []

    def sleep(seconds: float) -> None:  # the retry's pause: the rebuild's second rename lands meanwhile
        pauses.append(seconds)
        if os.path.isdir(rebuilt):
            os.rename(rebuilt, index)

    monkeypatch.setattr(time, "sleep", sleep)
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 2
    assert pauses  # it did wait
    os.rename(index, rebuilt)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the rename never comes
    monkeypatch.setattr(module, "_VIEW_OPEN_SECONDS", 0.0)
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and "keeps switching" in refused.value.message


@pytest.mark.parametrize("switch", ["index", "marker"])
def test_a_view_checks_after_opening_the_log_that_the_index_was_not_switched(tmp_path, monkeypatch, switch):
    """A rebuild that renames its index into place, or a compaction that starts, between the
    view's index and its log: the pair may not belong together. The view opens again (and reads
    the index now in place) or, for a compaction, refuses; it does not read the replaced index."""
    import shutil

    import mwpstore.authority as module

    path = str(tmp_path / "store")
    open_with_group(path).close()
    index = os.path.join(path, "index")
    older = str(tmp_path / "older-index")
    shutil.copytree(index, older)  # the index at head 1, closed cleanly
    with Authority.open(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.accept(mission_create("m-2"))
    real_open = module.SegmentLog.open
    opened = []

    def open_log(directory, **options):
        if not opened:
            if switch == "index":  # a new inode under index/data.mdb, as a rebuild's rename leaves
                shutil.copyfile(os.path.join(older, "data.mdb"), os.path.join(index, "data.mdb.new"))
                os.rename(os.path.join(index, "data.mdb.new"), os.path.join(index, "data.mdb"))
            else:
                open(os.path.join(path, "COMPACT-SWITCH"), "wb").close()
        opened.append(directory)
        return real_open(directory, **options)

    monkeypatch.setattr(module.SegmentLog, "open", staticmethod(open_log))
    if switch == "index":
        with Authority.open(path, readonly=True) as view:
            assert view.head(GROUP)[0] == 1  # the index in place now, not the one renamed away (head 3)
        assert len(opened) == 2
    else:
        with pytest.raises(InvalidState) as refused:
            Authority.open(path, readonly=True)
        assert refused.value.detail["reason"] == "recovery_needed" and "compaction" in refused.value.message


@pytest.mark.parametrize("index_there", [True, False], ids=["beside_an_index", "beside_keys_only"])
@pytest.mark.parametrize("switch", ["index", "marker"])
def test_a_view_that_finds_no_log_while_files_switch_opens_again_instead_of_reporting_it_lost(
    tmp_path, monkeypatch, switch, index_there
):
    """A log directory without segments beside an index or keys is lost history (``Corruption``,
    ``log_missing``, as the writer says), unless the view met it while the writer switched files:
    a compaction between its two renames (its marker is there), or the index replaced (or put in
    place) meanwhile. Then the view opens again: it reads the switched store, or refuses the
    compaction."""
    import shutil

    import mwpstore.authority as module

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.signing_key  # keys/ too
    log, index = os.path.join(path, "log"), os.path.join(path, "index")
    index_file = os.path.join(index, "data.mdb")
    if not index_there:
        os.rename(index, index + ".held")
    real_check, checks = module._check_log_present, []

    def check_log_present(store):
        checks.append(store)
        if len(checks) > 1:
            return real_check(store)
        os.rename(log, log + ".old")  # the log is away for the moment of this check
        if switch == "marker":
            open(os.path.join(path, "COMPACT-SWITCH"), "wb").close()
        elif index_there:  # a rebuild's rename: a new inode under the index's name
            shutil.copyfile(index_file, index_file + ".new")
            os.rename(index_file + ".new", index_file)
        else:  # the index put in place
            os.rename(index + ".held", index)
        try:
            return real_check(store)
        finally:
            if switch == "index":
                os.rename(log + ".old", log)  # back before the view looks again

    monkeypatch.setattr(module, "_check_log_present", check_log_present)
    if switch == "index":
        with Authority.open(path, readonly=True) as view:
            assert view.head(GROUP)[0] == 2
        assert len(checks) == 2
    else:
        with pytest.raises(InvalidState) as refused:
            Authority.open(path, readonly=True)
        assert refused.value.detail["reason"] == "recovery_needed" and "compaction" in refused.value.message


@pytest.mark.parametrize("clean", [False, True])
def test_a_view_refuses_an_index_left_unclean_before_a_restart(tmp_path, clean):
    """An index not closed cleanly under another boot may be ahead of what the log kept through
    the power loss: only a writer's open can redo or rebuild it. Closed cleanly, it is as good
    after a restart as before."""
    from mwpstore.index import Index

    path = str(tmp_path / "store")
    open_with_group(path).close()
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.begin(write=True) as txn:
        index.put(txn, b"meta", b"boot_id", b"a-boot-before-this-one")
        index.put(txn, b"meta", b"clean", b"1" if clean else b"0")
    index.close()
    if clean:
        with Authority.open(path, readonly=True) as view:
            assert view.head(GROUP)[0] == 1
        return
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and "restarted" in refused.value.message


def test_the_index_of_a_view_refuses_a_write_transaction(tmp_path):
    """``Authority.index`` is reachable: a write through a view's index must be refused there,
    not reach LMDB with the view's read transaction."""
    path = str(tmp_path / "store")
    open_with_group(path).close()
    with Authority.open(path, readonly=True) as view:
        with pytest.raises(InvalidState) as refused:
            view.index.begin(write=True)
        assert refused.value.detail["reason"] == "readonly"
        assert view.head(GROUP)[0] == 1


def test_closing_a_view_releases_its_files_and_can_be_repeated(tmp_path):
    """A view holds the index and the log open; once closed, none of the store's files (which a
    compaction by the writer replaces) stays open or mapped, and a second close does nothing."""
    from mwpstore import StoreClosed

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    view = Authority.open(path, readonly=True)
    assert [event.seq for event in view.read(GROUP)] == [1, 2]
    assert store_files_held(path)
    view.close()
    assert store_files_held(path) == []
    view.close()
    with pytest.raises(StoreClosed):
        view.head(GROUP)


def test_a_view_does_not_read_the_log_past_its_index_position(tmp_path):
    """Past the index's position the writer may be writing a group (its commit frame half copied
    looks like damage) or sealing and trimming the active segment (a trimmed page read through
    the view's map was a SIGBUS, killing the reader). The view's recovery scanned all of it: a
    group in flight made the open CORRUPTION. It reads the log up to the index's position only."""
    from mwpstore import Corruption
    from mwpstore.segment_log import _HEADER_BYTES, CLEAN_FILE_NAME, SegmentLog

    path = str(tmp_path / "store")
    open_with_group(path).close()
    log_directory = os.path.join(path, "log")
    with SegmentLog.open(log_directory) as log:  # a group past what the index names, as in flight
        indexed = log.end
        log.append([b"a group the writer is still writing"])
        end, active = log.end, log.segments()[-1]
    os.remove(os.path.join(log_directory, CLEAN_FILE_NAME))  # a writer that has appended since its open has none
    with open(active.path, "r+b") as segment:  # the commit frame's last byte not copied yet
        offset = _HEADER_BYTES + end - active.first_position - 1
        segment.seek(offset)
        byte = segment.read(1)[0]
        segment.seek(offset)
        segment.write(bytes([byte ^ 0x01]))
    with Authority.open(path, readonly=True) as view:
        assert view.head(GROUP)[0] == 1 and [event.seq for event in view.read(GROUP)] == [1]
    with pytest.raises(Corruption):  # a reader without the index's word sees damage
        SegmentLog.open(log_directory, readonly=True).close()
    with SegmentLog.open(log_directory, readonly=True, known_end=indexed) as log:
        assert log.end == indexed


def test_a_view_of_a_store_whose_index_is_no_directory_is_storage_failed(tmp_path):
    """What the open meets on the file system is typed like every storage error (exit 3 for
    `tail`), not an OSError from deep inside the open."""
    from mwpstore import StorageFailed

    path = str(tmp_path / "store")
    open_with_group(path).close()
    index = os.path.join(path, "index")
    for name in os.listdir(index):
        os.remove(os.path.join(index, name))
    os.rmdir(index)
    with open(index, "wb"):
        pass
    with pytest.raises(StorageFailed):
        Authority.open(path, readonly=True)


def test_closing_a_view_waits_for_a_read_in_flight(tmp_path, monkeypatch):
    """close() from another thread while a read is between the index and the log: the read's
    log access finishes on open files (the read may then stop with StoreClosed at its next step),
    then the view closes."""
    from mwpstore import StoreClosed

    import mwpstore.authority as module

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    view = Authority.open(path, readonly=True)
    inside, go_on = threading.Event(), threading.Event()
    real_records_at = module._records_at

    failures = []

    def records_at(log, positions):
        inside.set()
        go_on.wait(10)
        try:
            return real_records_at(log, positions)
        except BaseException as exc:
            failures.append(exc)
            raise

    monkeypatch.setattr(module, "_records_at", records_at)
    outcome = []

    def read():
        try:
            outcome.append([event.seq for event in view.read(GROUP)])
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert inside.wait(10)
    closer = threading.Thread(target=view.close)
    closer.start()
    closer.join(0.5)  # a close that does not wait is done by now; one that waits is not
    go_on.set()
    reader.join(10)
    closer.join(10)
    assert failures == [] and not closer.is_alive()
    assert outcome == [[1, 2]] or (len(outcome) == 1 and isinstance(outcome[0], StoreClosed))
    assert store_files_held(path) == []


def test_a_view_refuses_subscribe_and_wait_for_at_once(tmp_path):
    """A view answers from the read transaction it began at open, so it never sees a later Event:
    subscribe and wait_for on one waited for what could never come (a poll or wait_for without a
    timeout, for ever). They refuse at once, as a view's write methods do, and say to open a new
    view (as tail -f does)."""
    path = str(tmp_path / "store")
    open_with_group(path).close()
    with Authority.open(path, readonly=True) as view:
        head = view.head(GROUP)[0]
        for what, call in (("subscribe", lambda: view.subscribe(GROUP, after=head)),
                           ("wait_for", lambda: view.wait_for(GROUP, head, 0.01))):
            with pytest.raises(InvalidState) as refused:
                call()
            assert refused.value.detail["reason"] == "readonly", what
            assert refused.value.message.startswith(what) and "snapshot" in refused.value.message
            assert "open a new view" in refused.value.message
        assert [event.seq for event in view.read(GROUP)] == list(range(1, head + 1))  # reads still answer
        for call, field in ((lambda: view.wait_for(GROUP, -1, 0), "after"), (lambda: view.wait_for("bad id", 0, 0), "group"),
                            (lambda: view.subscribe(GROUP, after=-1), "after"), (lambda: view.subscribe("bad id"), "group")):
            with pytest.raises(InvalidCommand) as caught:  # the arguments are checked first, as everywhere
                call()
            assert caught.value.field == field


SEGMENT_WRITER = os.path.join(REPO, "tests", "segment_writer_child.py")
_SEAL_UNDER_THE_MAP = r'''
import mmap, sys
from mwpstore import segment_log
from mwpstore.segment_log import SegmentLog

writer = SegmentLog.open(sys.argv[1], segment_bytes=65536)
records = [b"record %d " % index + b"." * 1000 for index in range(20)]
positions = [writer.append([record])[0] for record in records]
real_mmap, sealed = mmap.mmap, []


class Mmap:
    """mmap, except that the first map made is followed at once by the writer's seal."""

    def __getattr__(self, name):
        return getattr(mmap, name)

    @staticmethod
    def mmap(*arguments, **keywords):
        mapped = real_mmap(*arguments, **keywords)
        if not sealed:  # a group the active segment cannot hold: seal, trim, next segment
            sealed.append(writer.append([b"y" * 50000]))
        return mapped


segment_log.mmap = Mmap()
with SegmentLog.open(sys.argv[1], readonly=True) as reader:
    assert [bytes(record) for batch in reader.scan(0) for record in batch.records] == records
    assert [reader.read(position) for position in positions] == records
    assert reader.end == positions[-1] + segment_log.framed_bytes(len(records[-1])) + segment_log.COMMIT_FRAME_BYTES
assert sealed and len(writer.segments()) == 2 and writer.segments()[0].sealed
print("SERVED", flush=True)
'''


def test_a_segment_sealed_under_a_read_only_open_never_kills_the_reader(tmp_path):
    """The writer seals the active segment (trimming its preallocated tail) right after a bare
    read-only open maps it. The open's recovery read the whole map, past the trim: a SIGBUS that
    killed the reading process. It now reads the last segment with pread, and maps a segment only
    for reads that stay below the end it found, which the writer never trims."""
    directory = str(tmp_path / "log")
    done = subprocess.run([sys.executable, "-c", _SEAL_UNDER_THE_MAP, directory], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "SERVED\n"), done.stderr


def test_a_group_in_flight_is_not_there_for_a_read_only_open_beside_a_writer(tmp_path):
    """While a writer holds the log, a last group whose commit frame is not whole may be one it is
    still copying in: a bare read-only open ends the log before it (it was CORRUPTION). Damage
    before a complete commit frame is still CORRUPTION, and with no writer the read-only open
    reports a damaged last group as the writer's open does."""
    from mwpstore import Corruption
    from mwpstore.segment_log import _HEADER_BYTES, SegmentLog

    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=65536) as writer:
        writer.append([b"first", b"group"])
        kept = writer.end
        writer.append([b"a group", b"in flight"])
        end, active = writer.end, writer.segments()[-1]
        with open(active.path, "r+b") as segment:  # the commit frame's last byte not copied yet
            segment.seek(_HEADER_BYTES + end - active.first_position - 1)
            last = segment.read(1)
            segment.seek(-1, os.SEEK_CUR)
            segment.write(bytes([last[0] ^ 0x01]))
        with SegmentLog.open(directory, readonly=True) as reader:
            assert reader.end == kept
            assert [bytes(record) for batch in reader.scan(0) for record in batch.records] == [b"first", b"group"]
        with open(active.path, "r+b") as segment:  # and a damaged record in the first group
            segment.seek(_HEADER_BYTES + 16)
            segment.write(b"F")
        with pytest.raises(Corruption) as caught:
            SegmentLog.open(directory, readonly=True)
        assert caught.value.detail["reason"] == "group_damaged"  # its own commit frame follows, intact
    with open(active.path, "r+b") as segment:
        segment.seek(_HEADER_BYTES + 16)
        segment.write(b"f")
    with pytest.raises(Corruption) as caught:  # no writer: the damaged last group is reported
        SegmentLog.open(directory, readonly=True)
    assert caught.value.detail["reason"] == "commit_damaged"


def _writer_groups(records: int) -> set[int]:
    """How many records the child writer has written after each of its groups (its rng's draws)."""
    import random

    rng, written, ends = random.Random(records), 0, {0}
    while written < records:
        written += min(rng.randint(1, 4), records - written)
        ends.add(written)
    return ends


def _check_served(log, group_ends: set[int], rounds: int) -> int:
    """Every record a read-only open serves (scan, and read at every position) is the child
    writer's record of that index, and they end where one of its groups ends."""
    from segment_writer_child import record_bytes

    positions = []
    for batch in log.scan(0, batch_records=97):
        for position, record in zip(batch.positions, batch.records):
            assert record == record_bytes(len(positions)), (rounds, position)
            positions.append(position)
    assert len(positions) in group_ends, (rounds, len(positions))
    for index in range(rounds % 5, len(positions), 5):
        assert log.read(positions[index]) == record_bytes(index)
    assert list(log.scan(log.end)) == []
    return len(positions)


def test_bare_read_only_opens_beside_a_writer_that_rolls_over_serve_whole_checked_groups(tmp_path):
    """A writer in another process appends groups to a log of 64 KiB segments (sealing and
    trimming one every few dozen groups) while this process opens the log read-only again and
    again without known_end, scans and reads all of it. Each open was at risk of a SIGBUS (the
    recovery read the active segment through a map the seal trimmed) or of CORRUPTION (a group
    half copied in); every open now serves a prefix of whole groups, each record as written."""
    from mwpstore.segment_log import SegmentLog

    directory, records = str(tmp_path / "log"), 3000
    group_ends = _writer_groups(records)
    writer = subprocess.Popen([sys.executable, SEGMENT_WRITER, directory, "65536", str(records)], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline() == "READY\n"
        seen, rounds = 0, 0
        while not select.select([writer.stdout], [], [], 0)[0]:  # until the writer is done
            with SegmentLog.open(directory, readonly=True) as log:
                served = _check_served(log, group_ends, rounds)
            assert served >= seen  # the writer's log only grows
            seen, rounds = served, rounds + 1
        done = writer.stdout.readline().split()
        assert done == ["DONE", str(records)]
        writer.stdin.write("quit\n")
        writer.stdin.flush()
        assert writer.wait(timeout=60) == 0
        written = records
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    with SegmentLog.open(directory, readonly=True) as log:
        assert _check_served(log, group_ends, rounds) == written
        assert log.verify() == written
    assert len(os.listdir(directory)) > 3  # it rolled over


def _view_killed_inside_its_read(path: str) -> int:
    """The pid of a process that opened a view of ``path`` (whose read lasts the view's life) and
    was killed with it open: its slot is left in ``index/lock.mdb``'s reader table."""
    code = "import sys\nfrom mwpstore import Authority\nview = Authority.open(sys.argv[1], readonly=True)\nprint('READY', flush=True)\nsys.stdin.read()\n"
    child = subprocess.Popen([sys.executable, "-c", code, path], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "READY\n"
    child.kill()
    child.wait(timeout=10)
    return child.pid


def _reader_pids(view_or_writer: Authority) -> set[int]:
    lines = view_or_writer.index.env.readers().splitlines()[1:]  # below the header "pid thread txnid"
    return {int(line.split()[0]) for line in lines if line.strip()}


def test_the_writer_clears_the_reader_slots_of_killed_views_at_its_next_commit(tmp_path):
    """Each slot left pinned its snapshot's pages, so every later commit grew the index by what it
    rewrote, and 512 of them (max_readers) left no slot for any read, the writer's own included."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    try:
        dead = {_view_killed_inside_its_read(path) for _ in range(3)}
        assert dead & _reader_pids(authority)  # LMDB left the last one there (each view's open clears those before)
        pages = authority.index.env.info()["last_pgno"]
        for number in range(60):
            authority.accept(mission_create(f"m-{number}"))
        assert not dead & _reader_pids(authority)
        # With a dead reader pinned, each commit's rewritten pages were new ones: hundreds of
        # pages more here (about 570) instead of a few dozen.
        assert authority.index.env.info()["last_pgno"] - pages < 100
    finally:
        authority.close()


def test_a_view_clears_the_reader_slots_of_killed_views_when_it_opens(writer):
    path, _ = writer  # idle: no commit of the writer clears them
    dead = {_view_killed_inside_its_read(path) for _ in range(3)}
    view = Authority.open(path, readonly=True)
    try:
        assert not dead & _reader_pids(view)
        assert view.head(GROUP)[0] == 1
    finally:
        view.close()
