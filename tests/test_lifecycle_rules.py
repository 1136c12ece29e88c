"""The authority's and the AgentStore's lifecycle: what open() checks and chooses, what a failed
open leaves held, what close() releases (rules pinned by a mutation round over open/close)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time

import pytest

from authority_helpers import GROUP, group_create, in_a_forked_child, mission_create, open_with_group, store_files_held
from mwpstore import Authority, Corruption, InvalidCommand, MwpError, StorageFailed, StoreLocked, StoreNotFound
from mwpstore.index import Index
from test_authority import _run_child as run_python_child

CHILD = """
import os, sys
from authority_helpers import group_create, mission_create
from mwpstore import Authority
a = Authority.open({path!r})
if a.head("g-1")[0] == 0:
    a.accept(group_create())
for i in range(3):
    a.accept(mission_create(f"m-{{i}}-{{os.getpid()}}"))
{end}
"""


def _run_child(path: str, end: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_python_child(path, CHILD.format(path=path, end=end), env_extra)


def test_a_failed_open_releases_the_lock_and_every_file_it_opened(tmp_path):
    """An open that fails after it took the lock (an I/O error, a progress callable that raises
    mid-redo) closes the lock file, the log and the index it opened: nothing of the store stays
    held by this process, and the next open in the same process is not STORE_LOCKED."""
    path = str(tmp_path / "store")
    # the log's last commit dies after its fdatasync, before the index commit: the next open redoes it
    result = _run_child(path, "", {"MWPSTORE_FAILPOINT": "authority.after_log_sync:4"})
    assert result.returncode == -9, result.stderr

    def progress(done: int, total: int) -> None:
        raise RuntimeError("cancelled")

    with pytest.raises(InvalidCommand) as caught:
        Authority.open(path, progress=progress)  # raised in the redo, with the index open
    assert caught.value.field == "progress"
    assert store_files_held(path) == []
    with Authority.open(path) as authority:  # not STORE_LOCKED
        assert authority.head(GROUP)[0] == 4
    log = os.path.join(path, "log")
    os.rename(log, str(tmp_path / "log-aside"))
    with open(log, "wb"):  # a file where the log directory belongs: OSError once the lock is taken
        pass
    with pytest.raises(StorageFailed):
        Authority.open(path)
    assert store_files_held(path) == []
    os.remove(log)
    os.rename(str(tmp_path / "log-aside"), log)
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == 4 and authority.verify().ok


def test_an_open_after_a_crash_on_another_boot_rebuilds_even_if_the_close_before_was_clean(tmp_path, monkeypatch):
    """open() marks the index not clean until its own close: a store closed cleanly, opened again,
    then lost with the machine (no close) must be rebuilt on the next boot, not trusted on the
    strength of the earlier clean close."""
    path = str(tmp_path / "store")
    result = _run_child(path, "a.close()", {"MWPSTORE_BOOT_ID": "boot-1"})
    assert result.returncode == 0, result.stderr
    result = _run_child(path, "os._exit(0)", {"MWPSTORE_BOOT_ID": "boot-1"})  # no close this time
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("MWPSTORE_BOOT_ID", "boot-2")
    with Authority.open(path) as authority:
        assert (authority.open_report.mode, authority.head(GROUP)[0]) == ("rebuild", 7)
        assert "restarted" in authority.open_report.reason


def test_a_store_opened_in_a_forked_child_is_usable_there(tmp_path):
    """A handle belongs to the process that opened it: one opened after a fork, in the child, works
    in the child (only a handle that crossed the fork is refused), and the child's own handle is
    refused in a grandchild forked from it in turn."""
    path = str(tmp_path / "child-store")

    def use() -> None:
        with Authority.open(path) as authority:
            authority.accept(group_create())
            authority.accept(mission_create("m-1"))
            assert authority.head(GROUP)[0] == 2
            assert in_a_forked_child([lambda: authority.accept(mission_create("m-2"))]) == ["StoreClosed"]
            assert authority.head(GROUP)[0] == 2

    assert in_a_forked_child([use]) == ["ok"]
    with Authority.open(path, create=False) as authority:
        assert authority.head(GROUP)[0] == 2


@pytest.mark.parametrize("keep", ["authority.lock", "log", "log.compact", "index", "keys"])
def test_a_directory_holding_any_part_of_a_store_is_a_store(tmp_path, keep):
    """Whatever part of a store is left (a first open that made only its lock file, a log without
    its index, an index or keys whose log is gone, a compaction's log.compact), the directory is
    a store to every later open: create=False opens it or reports the damage, and a read-only
    open never says STORE_NOT_FOUND."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.signing_key  # keys/ too
    os.makedirs(os.path.join(path, "log.compact"))
    for name in os.listdir(path):
        if name != keep:
            full = os.path.join(path, name)
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)
    with pytest.raises(MwpError) as caught:
        Authority.open(path, readonly=True)
    assert not isinstance(caught.value, StoreNotFound)
    if keep in ("index", "keys"):  # a view gives the writer's verdict, not advice to open for writing
        assert isinstance(caught.value, Corruption) and caught.value.detail["reason"] == "log_missing"
        with pytest.raises(Corruption) as caught:
            Authority.open(path, create=False)
        assert caught.value.detail["reason"] == "log_missing" and caught.value.detail["path"] == path
        assert sorted(os.listdir(path)) == ["authority.lock", keep]  # no new empty log
        return
    with Authority.open(path, create=False) as authority:
        assert authority.head(GROUP)[0] == (2 if keep == "log" else 0)
        assert authority.verify().ok


def test_a_directory_holding_an_authority_lock_and_an_agent_lock_opens_as_the_authority(tmp_path):
    path = tmp_path / "store"
    path.mkdir()
    (path / "authority.lock").write_bytes(b"")
    (path / "agent.lock").write_bytes(b"")
    with Authority.open(str(path), create=False) as authority:
        authority.accept(group_create())
    assert sorted(os.listdir(path)) == ["agent.lock", "authority.lock", "index", "log"]


def test_reopening_a_store_that_never_accepted_anything_trusts_its_index(tmp_path):
    """An empty store's index is at log position 0, the log's start: inside the log, so a clean
    reopen keeps it (mode clean), as for any other store."""
    path = str(tmp_path / "store")
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild" and authority.open_report.reason == "no index yet"
    with Authority.open(path) as authority:
        assert (authority.open_report.mode, authority.open_report.reason) == ("clean", "index trusted")
        assert authority.open_report.redo_records == 0


def test_open_makes_the_not_clean_mark_durable_before_any_commit_and_close_the_clean_one(tmp_path, monkeypatch):
    """The index records clean=0 at open and syncs it before the first commit can change the
    index (a power loss must not leave the earlier close's clean=1 standing over newer writes);
    close() syncs the index after it marked it clean=1."""
    path = str(tmp_path / "store")
    open_with_group(path).close()
    seen: list[bytes] = []
    real_sync = Index.sync

    def sync(self, *args, **kwargs):
        with self.begin() as txn:
            seen.append(bytes(self.get(txn, b"meta", b"clean") or b""))
        return real_sync(self, *args, **kwargs)

    monkeypatch.setattr(Index, "sync", sync)
    authority = Authority.open(path)
    assert seen == [b"0"]
    authority.accept(mission_create("m-1"))
    authority.close()
    assert seen[-1] == b"1"


@pytest.mark.parametrize("left", ["agent.lock", "lmdb"])
def test_open_refuses_a_directory_with_either_mark_of_an_agent_store(tmp_path, left):
    """agent.lock alone (an AgentStore's first open that died before LMDB made its file) or lmdb/
    alone (its lock file removed) is an AgentStore's directory still: refused, nothing written."""
    from mwpstore.agent_store import AgentStore

    path = tmp_path / "agent"
    AgentStore.open(str(path)).close()
    for name in os.listdir(path):
        if name != left:
            full = path / name
            shutil.rmtree(full) if full.is_dir() else full.unlink()
    for create in (True, False):
        with pytest.raises(InvalidCommand) as caught:
            Authority.open(str(path), create=create)
        assert caught.value.field == "path" and caught.value.detail["path"] == str(path)
    assert os.listdir(path) == [left]


def test_an_index_file_lmdb_cannot_open_is_rebuilt_when_the_structure_check_is_off(tmp_path):
    """check_lmdb=False skips the structure check's walk of the pages, not its check of the two
    meta pages nor the judgement: an index with no valid meta page is rebuilt from the log, and
    open says why."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    data = os.path.join(path, "index", "data.mdb")
    size = os.path.getsize(data)
    with open(data, "wb") as handle:
        handle.write(b"\x5a" * size)
    with Authority.open(path, check_lmdb=False) as authority:
        assert authority.open_report.mode == "rebuild"
        assert authority.open_report.reason == "index damaged (CORRUPTION: page_size on page 0)"
        assert authority.head(GROUP)[0] == 2 and authority.verify().ok


# -- the AgentStore's own open and close -----------------------------------------------------------


def test_an_agent_store_open_refused_by_another_handle_or_by_damage_keeps_nothing_of_it_held(tmp_path):
    """STORE_LOCKED, and an open that fails once it took the lock (a damaged LMDB file, a store of
    another format), leave no descriptor or map of the store behind: the holder's close() is the
    only thing between the next open and the store."""
    from mwpstore.agent_store import AgentStore

    path = tmp_path / "agent"
    holder = AgentStore.open(str(path))
    held = store_files_held(str(path))
    with pytest.raises(StoreLocked):
        AgentStore.open(str(path))
    assert store_files_held(str(path)) == held
    with holder._env.begin(write=True) as txn:  # a store of another format: refused after LMDB opened
        txn.put(b"format", b"1", db=holder._tables.dbs[b"meta"])
    holder.close()
    with pytest.raises(Corruption) as caught:
        AgentStore.open(str(path))
    assert caught.value.detail["reason"] == "format"
    assert store_files_held(str(path)) == []
    data = path / "lmdb" / "data.mdb"
    data.write_bytes(b"\x5a" * data.stat().st_size)  # refused by the structure check, before LMDB
    with pytest.raises(Corruption):
        AgentStore.open(str(path), check_lmdb=True)
    assert store_files_held(str(path)) == []
    shutil.rmtree(path / "lmdb")
    AgentStore.open(str(path)).close()  # not STORE_LOCKED: nothing of the failed opens holds the lock


def test_an_agent_store_commits_durably(tmp_path):
    """The agent's LMDB environment syncs its data and meta pages at each commit: an applied Event
    and its Cursor survive a power loss (the store has no log to redo them from)."""
    from mwpstore.agent_store import AgentStore

    with AgentStore.open(str(tmp_path / "agent")) as agent:
        flags = agent._env.flags()
        assert flags["sync"] and flags["metasync"]


def test_without_a_clock_events_are_stamped_with_wall_clock_milliseconds(tmp_path):
    from mwpstore.authority import default_clock

    before = time.time_ns() // 1_000_000
    reading = default_clock()
    with Authority.open(str(tmp_path / "store")) as authority:
        authority.accept(group_create())
        stamped = authority.read(GROUP)[0].accepted_at_ms
    after = time.time_ns() // 1_000_000
    assert type(reading) is int and before <= reading <= after
    assert before <= stamped <= after


def _descriptors_on(path: str) -> int:
    """How many of this process's descriptors name ``path`` (Linux /proc)."""
    real = os.path.realpath(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == real
        except OSError:
            continue
    return count


def test_a_second_open_refused_by_the_lock_touches_nothing_of_the_running_writer(tmp_path):
    """The writer lock is taken before anything else of the store is looked at: a second open
    (this process or another) must not run recovery under the writer, whose compaction may be
    copying the log into log.compact/ at that moment (recovery removes an unmarked copy)."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        copy = os.path.join(path, "log.compact")
        os.makedirs(copy)  # as the writer's compaction has it while it copies
        with open(os.path.join(copy, "00000000000000000000.seg"), "wb") as handle:
            handle.write(b"\x00" * 4096)
        before = sorted(os.listdir(path))
        held = _descriptors_on(os.path.join(path, "authority.lock"))
        with pytest.raises(StoreLocked) as caught:
            Authority.open(path)
        assert caught.value.detail["path"] == path
        assert sorted(os.listdir(path)) == before
        assert _descriptors_on(os.path.join(path, "authority.lock")) == held == 1  # the writer's own
        assert os.listdir(copy) == ["00000000000000000000.seg"]
        shutil.rmtree(copy)
        assert authority.head(GROUP)[0] == 1


def test_a_lock_file_that_cannot_be_opened_is_storage_failed(tmp_path):
    path = tmp_path / "store"
    (path / "authority.lock").mkdir(parents=True)  # a directory where the lock file belongs
    with pytest.raises(StorageFailed) as caught:
        Authority.open(str(path))
    assert caught.value.detail["errno"] == errno.EISDIR
    assert os.listdir(path) == ["authority.lock"]


def test_an_index_that_never_recorded_a_clean_close_or_a_boot_is_rebuilt(tmp_path):
    """An index built and renamed into place by an open that died before it marked it (no
    clean, no boot_id in its meta) cannot say it was closed cleanly on this boot: rebuilt."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.env.begin(write=True) as txn:
        for key in (b"clean", b"boot_id"):
            assert txn.delete(key, db=index.dbs[b"meta"])
    index.close()
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild" and "restarted" in authority.open_report.reason
        assert authority.head(GROUP)[0] == 2 and authority.verify().ok


def test_closing_a_bulk_mode_store_syncs_its_log_before_marking_the_index_clean(tmp_path, monkeypatch):
    """sync=False defers durability to sync() or close(): close() fdatasyncs the log, and does so
    before the index is marked clean (an index clean over a log that is not durable would be
    trusted after a power loss)."""
    from mwpstore.segment_log import SegmentLog

    calls: list[str] = []
    real_log_sync, real_index_sync = SegmentLog.sync, Index.sync
    monkeypatch.setattr(SegmentLog, "sync", lambda self, *a, **k: (calls.append("log"), real_log_sync(self, *a, **k))[1])
    monkeypatch.setattr(Index, "sync", lambda self, *a, **k: (calls.append("index"), real_index_sync(self, *a, **k))[1])
    authority = Authority.open(str(tmp_path / "store"), sync=False)
    authority.accept(group_create())
    calls.clear()
    authority.close()
    assert calls == ["log", "index"]


def test_a_close_whose_index_sync_fails_raises_it_and_still_releases_the_store(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    authority = open_with_group(path)

    def failing(self, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Index, "sync", failing)
    with pytest.raises(StorageFailed) as caught:
        authority.close()
    assert caught.value.detail["errno"] == errno.EIO
    monkeypatch.undo()
    assert store_files_held(path) == []
    with Authority.open(path) as reopened:  # released: not STORE_LOCKED
        assert reopened.head(GROUP)[0] == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_close_in_a_forked_child_lets_the_parent_release_the_store(tmp_path):
    """A child forked while the parent holds an authority and an AgentStore inherits the lock
    descriptors (authority.lock, log/LOCK, agent.lock), and with them the flocks. close() in the
    child retires its copy: it must drop those descriptors, or the parent's close() leaves the
    stores locked (StoreLocked at every reopen) for as long as the child lives."""
    from mwpstore import AgentStore

    store, agent_path = str(tmp_path / "store"), str(tmp_path / "agent")
    authority = open_with_group(store)
    agent = AgentStore.open(agent_path)
    closed_read, closed_write = os.pipe()
    exit_read, exit_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: close its copies, then live on until told to exit
        code = 0
        try:
            numbers = [authority._lock_fd, authority.log._lock_fd, agent._lock_fd]
            authority.close()
            agent.close()
            # The numbers closed are free for any later file: here each holds one. A second
            # close() must close nothing (before, it closed those files again).
            later = os.open(os.devnull, os.O_RDONLY)
            for number in numbers:
                os.dup2(later, number)
            authority.close()
            agent.close()
            for number in numbers:
                os.fstat(number)  # still open: EBADF if a second close() closed it
        except BaseException:  # noqa: BLE001 - reported through the exit status
            code = 1
        os.write(closed_write, b"x")
        os.read(exit_read, 1)
        os._exit(code)
    try:
        assert os.read(closed_read, 1) == b"x"
        authority.close()
        agent.close()
        with Authority.open(store, create=False) as reopened:  # StoreLocked while the child held the lock
            assert reopened.head(GROUP)[0] == 1
        AgentStore.open(agent_path).close()
    finally:
        os.write(exit_write, b"x")
        _, status = os.waitpid(pid, 0)
        for fd in (closed_read, closed_write, exit_read, exit_write):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_close_in_a_forked_child_takes_no_lock_a_parent_thread_held_at_the_fork(tmp_path):
    """A segment's map lock held at the fork (by a read mapping it in another thread, here by
    this one) stays held in the child, where no thread will ever release it: the child's close()
    drops its copies of the maps without taking it, and returns, holding no file of the log."""
    path = str(tmp_path / "s")
    authority = open_with_group(path)
    assert authority.read(GROUP)  # the segment is mapped
    segment = authority.log._segments[-1]

    def nothing_of_the_log_held() -> None:
        assert store_files_held(os.path.join(path, "log")) == []

    with segment._lock:
        outcome = in_a_forked_child([authority.close, nothing_of_the_log_held], timeout=10)
    assert outcome == ["ok", "ok"]  # "hung" when close() waited for the lock
    authority.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's open files from /proc")
@pytest.mark.parametrize("error", ["typed", "lmdb"])
@pytest.mark.parametrize("operation", ["rebuild", "compact"])
def test_an_index_whose_installation_fails_is_closed(tmp_path, monkeypatch, operation, error):
    """rebuild() and compaction open the index they built, mark it not clean and sync it before
    they switch to it. When that sync fails the handle keeps its old index, and the new one must
    be closed there: left to the error's traceback, it stayed open (two LMDB environments of one
    file in the process: closing the stray one drops the other's locks) as long as the error
    lived, which for a compaction is the handle's life (its refusal of later writes holds it).
    The error is ``StorageFailed`` whether the sync raised it or LMDB's own error (``lmdb``)."""
    import lmdb

    path = str(tmp_path / "s")
    authority = open_with_group(path)
    real_sync = Index.sync
    syncs = []

    def sync(index: Index) -> None:
        syncs.append(index.directory)
        if len(syncs) == 2:  # the first syncs the built index.rebuild/, the second the installed index/
            if error == "lmdb":
                raise lmdb.Error("mdb_env_sync: Input/output error")
            raise StorageFailed("cannot sync the index", errno=errno.EIO)
        real_sync(index)

    monkeypatch.setattr(Index, "sync", sync)
    with pytest.raises(StorageFailed) as caught:
        getattr(authority, operation)()
    monkeypatch.setattr(Index, "sync", real_sync)
    assert syncs[1] == os.path.join(path, "index")
    with contextlib.suppress(MwpError):
        authority.close()
    assert caught.value is not None  # the error is still held here, as an application may hold it
    assert store_files_held(path) == []
    with Authority.open(path) as reopened:
        assert reopened.head(GROUP)[0] == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's open files from /proc")
def test_an_open_interrupted_while_it_judges_the_index_holds_nothing(tmp_path, monkeypatch):
    """open() opens the index to judge it before the handle holds it: an interrupt (Ctrl-C) or an
    error that judgement does not expect must close it there, or it stays open for as long as
    the error lives (in the traceback), beside the next open of the same index."""
    path = str(tmp_path / "s")
    with open_with_group(path):
        pass

    def interrupted(index: Index, txn: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(Index, "log_position", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        Authority.open(path)
    monkeypatch.undo()
    assert caught.value is not None  # the error is still held here
    assert store_files_held(path) == []
    with Authority.open(path) as reopened:
        assert reopened.head(GROUP)[0] == 1


@pytest.mark.parametrize("lock", ["authority.lock", "log/LOCK", "agent.lock"])
def test_an_open_interrupted_as_it_takes_its_lock_holds_nothing(tmp_path, monkeypatch, lock):
    """CPython raises a signal's exception (KeyboardInterrupt) as a call returns: right after
    the flock that took the store's lock (``authority.lock``, the log's ``LOCK``, an AgentStore's
    ``agent.lock``). The open must close that descriptor on the way out, or its flock stays held
    for as long as the process lives and every later open of the store here is STORE_LOCKED."""
    import fcntl

    from mwpstore.agent_store import AgentStore

    path = str(tmp_path / "s")
    opener = (lambda: AgentStore.open(path)) if lock == "agent.lock" else (lambda: Authority.open(path))
    opener().close()
    real = fcntl.flock
    armed = [True]

    def flock(fd: int, operation: int) -> None:
        real(fd, operation)
        if armed[0] and os.readlink(f"/proc/self/fd/{fd}") == os.path.join(os.path.realpath(path), lock):
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(KeyboardInterrupt):
        opener()
    monkeypatch.undo()
    assert not armed[0]
    assert store_files_held(path) == []
    opener().close()  # not STORE_LOCKED


@pytest.mark.parametrize("new", [False, True], ids=["existing", "new"])
@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EIO])
@pytest.mark.parametrize("lock", ["authority.lock", "log/LOCK", "agent.lock"])
def test_a_lock_that_cannot_be_taken_at_all_is_storage_failed_not_store_locked(tmp_path, monkeypatch, lock, code, new):
    """flock fails for reasons other than another holder: ENOLCK on a network filesystem without
    lock support, EIO. STORE_LOCKED would send the operator looking for a process that does not
    exist; the open ends in STORAGE_FAILED with the errno, holds nothing, and once flock works
    the store opens as it was (a new one opens empty)."""
    import fcntl

    from mwpstore.agent_store import AgentStore

    path = str(tmp_path / "s")
    agent = lock == "agent.lock"
    if not new:
        if agent:
            AgentStore.open(path).close()
        else:
            with open_with_group(path):
                pass
    real = fcntl.flock
    refused = []

    def flock(fd: int, operation: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == os.path.join(os.path.realpath(path), lock):
            refused.append(fd)
            raise OSError(code, os.strerror(code))
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(StorageFailed) as caught:
        AgentStore.open(path) if agent else Authority.open(path)
    monkeypatch.undo()
    assert refused and caught.value.code == "STORAGE_FAILED" and caught.value.detail["errno"] == code
    assert store_files_held(path) == []
    if agent:
        AgentStore.open(path).close()
    else:
        with Authority.open(path) as reopened:
            assert reopened.head(GROUP)[0] == (0 if new else 1)
            assert reopened.verify().ok


@pytest.mark.parametrize("obstacle", ["symlink", "fifo"])
@pytest.mark.parametrize("lock", ["authority.lock", "log/LOCK", "agent.lock"])
def test_a_lock_file_that_is_a_symbolic_link_or_a_fifo_is_refused(tmp_path, lock, obstacle):
    """A lock file is opened with O_CREAT: through a symbolic link to a name outside the store,
    the open made that file there and locked it. A link, and a FIFO, are STORAGE_FAILED naming the
    lock file; nothing is made outside, the open holds nothing, and once the obstacle is gone the
    store opens as it was."""
    from mwpstore.agent_store import AgentStore

    path = str(tmp_path / "s")
    agent = lock == "agent.lock"
    opener = (lambda: AgentStore.open(path)) if agent else (lambda: Authority.open(path))
    if agent:
        AgentStore.open(path).close()
    else:
        with open_with_group(path):
            pass
    target = os.path.join(path, lock)
    outside = tmp_path / "outside"
    os.remove(target)
    if obstacle == "symlink":
        os.symlink(outside, target)
    else:
        os.mkfifo(target)
    with pytest.raises(StorageFailed) as caught:
        opener()
    assert caught.value.detail["path"] == target and target in caught.value.message
    assert ("a symbolic link" if obstacle == "symlink" else "not a regular file") in caught.value.message  # says what is there
    assert not os.path.lexists(outside)
    assert store_files_held(path) == []
    os.remove(target)
    with opener() as reopened:
        assert agent or (reopened.head(GROUP)[0] == 1 and reopened.verify().ok)


@pytest.mark.parametrize("lock", ["authority.lock", "agent.lock"])
def test_a_close_interrupted_as_it_closes_its_lock_never_closes_that_number_again(tmp_path, monkeypatch, lock):
    """CPython raises a signal's exception (KeyboardInterrupt) as a call returns: right after
    close() closed the store's lock descriptor. The number is free from then on, and any file
    opened later may get it: a second close() must not close it again (it would close that file,
    e.g. another store's lock, releasing its flock)."""
    from mwpstore.agent_store import AgentStore

    path = str(tmp_path / "s")
    handle = AgentStore.open(path) if lock == "agent.lock" else Authority.open(path)
    number = handle._lock_fd
    real = os.close
    armed = [True]

    def close(fd: int) -> None:
        interrupt = armed[0] and fd == number
        real(fd)
        if interrupt:
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(KeyboardInterrupt):
        handle.close()
    monkeypatch.undo()
    assert not armed[0]
    other = os.open(str(tmp_path / "other"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if other != number:
            os.dup2(other, number)  # a file opened later that got the freed number
        handle.close()  # finishes nothing more, and leaves that file alone
        os.fstat(number)  # still open
    finally:
        os.close(other)
        if other != number:
            os.close(number)
    assert store_files_held(path) == []
