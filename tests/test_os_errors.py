"""Failed OS calls reachable from the public API end in typed errors, hold nothing and leave a
store that reopens as it was (an audit of 2026-12-06: every ``os``, ``open``, ``mmap``,
``shutil`` and LMDB call made by a public operation, failed in turn). Failures are injected at
the call, as root cannot be denied access by file modes; where a real condition exists for root
(a path component that is a file, a symlink loop, an over-long name), it is used instead."""

from __future__ import annotations

import errno
import mmap
import os

import lmdb
import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group, store_files_held
from mwpstore import Authority, StorageFailed, limits
from mwpstore.agent_store import AgentStore


def _refuse(code: int):
    def refused(*args: object, **kwargs: object) -> object:
        raise OSError(code, os.strerror(code))

    return refused


@pytest.mark.parametrize("reader", ["read", "subscribe"])
def test_a_segment_that_cannot_be_mapped_is_storage_failed(tmp_path, monkeypatch, reader):
    """A read maps each segment it needs on first use; mmap fails with ENOMEM once the process's
    maps run out (vm.max_map_count, RLIMIT_AS). The read ends in STORAGE_FAILED naming the
    segment, the handle reads and writes once maps are available, and the store reopens whole."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    with Authority.open(path) as authority:
        monkeypatch.setattr(mmap, "mmap", _refuse(errno.ENOMEM))
        with pytest.raises(StorageFailed) as caught:
            if reader == "read":
                authority.read(GROUP)
            else:
                authority.subscribe(GROUP).poll(0)
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.ENOMEM and caught.value.detail["path"].endswith(".seg")
        assert [event.seq for event in authority.read(GROUP)] == [1, 2]
        authority.accept(mission_create("m-2"))
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == 3 and authority.verify().ok


@pytest.mark.parametrize("call", ["listdir", "unlink", "fsync"])
def test_an_audit_log_whose_removal_fails_after_its_deletion_is_durable_is_removed_by_the_reopen(tmp_path, monkeypatch, call):
    """``audit.delete`` removes the Group's audit log once its Event is durable. When that removal
    fails (EIO, EROFS after a remount), the caller gets STORAGE_FAILED, not a bare OSError; the
    handle refuses writes, holds nothing after close, and the reopen removes the file; the
    Command, sent again unchanged, answers its receipt."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        record = authority.archive(GROUP, actor=OWNER, action_id="archive-1")
        audit = os.path.join(path, record.audit_location)
        real = getattr(os, call)

        def failing(target: object, *args: object, **kwargs: object) -> object:
            # the removal goes through the directory's descriptor: a listing of it, or a name in it
            dir_fd = kwargs.get("dir_fd")
            if isinstance(target, int):
                where = os.readlink(f"/proc/self/fd/{target}")
            elif dir_fd is not None:
                where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fspath(target))  # type: ignore[arg-type]
            else:
                where = os.fspath(target)  # type: ignore[arg-type]
            if call == "fsync" or where.startswith(os.path.dirname(audit)):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(target, *args, **kwargs)

        monkeypatch.setattr(os, call, failing)
        with pytest.raises(StorageFailed) as caught:
            authority.delete_audit_log(GROUP, actor=OWNER, action_id="delete-1", basis="legal")
        monkeypatch.undo()
        assert caught.value.detail["group"] == GROUP and caught.value.detail["errno"] == errno.EIO
        with pytest.raises(StorageFailed):
            authority.accept(group_create("g-2"))
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert not os.path.exists(audit)
        receipt = authority.delete_audit_log(GROUP, actor=OWNER, action_id="delete-1", basis="legal")
        assert receipt.kind == "audit.delete" and authority.head(GROUP)[0] == receipt.seq
        assert authority.verify().ok


def _fail_directory_syncs(monkeypatch: pytest.MonkeyPatch, directory: str) -> None:
    """os.fsync fails (EIO) on a descriptor of ``directory``; every other fsync works."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(directory):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_key_rotation_whose_directory_sync_fails_is_storage_failed(tmp_path, monkeypatch):
    """A rotation syncs ``keys/`` before it writes the retired public key; a failure there was a
    bare OSError. It is STORAGE_FAILED, the old key still signs, and the rotation can be run again."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.rotate_signing_key()  # keys/retired/ exists: the next rotation syncs keys/ first
        old = authority.signing_key.key_id
        _fail_directory_syncs(monkeypatch, os.path.join(path, "keys"))
        with pytest.raises(StorageFailed) as caught:
            authority.rotate_signing_key()
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.EIO
        assert authority.signing_key.key_id == old
        new = authority.rotate_signing_key().key_id
        assert new != old and authority.snapshot(GROUP)
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert authority.signing_key.key_id == new and authority.verify().ok


def test_dropping_a_retired_key_whose_directory_sync_fails_is_storage_failed(tmp_path, monkeypatch):
    """The removal of ``keys/retired/<id>.pub`` is synced in its directory; a failure there was a
    bare OSError."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        old = authority.signing_key.key_id
        authority.rotate_signing_key()
        _fail_directory_syncs(monkeypatch, os.path.join(path, "keys", "retired"))
        with pytest.raises(StorageFailed) as caught:
            authority.drop_retired_key(old)
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.EIO
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert authority.verify().ok


def test_an_audit_log_whose_file_object_cannot_be_made_closes_its_descriptor(tmp_path, monkeypatch):
    """``archive()`` opens the audit log's temporary file, then wraps the descriptor in a file
    object; when that fails (ENOMEM, EIO from its fstat), the descriptor was left open, holding
    the removed temporary file for as long as the process lived."""
    from mwpstore import audit_log

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        monkeypatch.setattr(audit_log, "open", _refuse(errno.ENOMEM), raising=False)
        with pytest.raises(StorageFailed):
            authority.archive(GROUP, actor=OWNER, action_id="archive-1")
        monkeypatch.undo()
        assert [name for name in store_files_held(path) if "/archive/" in name] == []
        record = authority.archive(GROUP, actor=OWNER, action_id="archive-1")  # called again, it completes
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert authority.archive_record(GROUP) == record and authority.verify().ok


class _FailingReads:
    """A file object whose reads fail (EIO, a bad sector) from the ``fail_at``-th on."""

    def __init__(self, handle: object, fail_at: int, reads: list[int]) -> None:
        self._handle, self._fail_at, self._reads = handle, fail_at, reads

    def read(self, *args: object) -> bytes:
        self._reads.append(1)
        if len(self._reads) > self._fail_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self._handle.read(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._handle, name)

    def __enter__(self) -> _FailingReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("phase", ["header", "records"])
def test_an_audit_log_read_that_fails_is_storage_failed(tmp_path, monkeypatch, phase):
    """A read error (EIO) inside an audit log escaped ``read_audit_log`` bare, from the call (its
    header and frame walk) or from its iterator (the chunks), and out of ``verify()``. It is
    STORAGE_FAILED naming the file, and ``verify()`` lists it as a problem of that file."""
    from mwpstore import audit_log

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        for number in range(3):
            authority.accept(mission_create(f"m-{number}"))
        record = authority.archive(GROUP, actor=OWNER, action_id="archive-1")
    audit = os.path.join(path, record.audit_location)
    provider = audit_log.FileKeyProvider(os.path.join(path, "keys", "orgs"))
    real = audit_log.open_regular
    reads: list[int] = []
    monkeypatch.setattr(audit_log, "open_regular", lambda name: _FailingReads(real(name), 10**9, reads))
    records = audit_log.read_audit_log(audit, key_provider=provider, org=record.org, group=GROUP)
    opened = len(reads)  # the reads of the call itself; the iterator reads the chunks
    assert len(list(records)) == 5 and len(reads) > opened
    reads.clear()
    fail_at = 0 if phase == "header" else opened
    monkeypatch.setattr(audit_log, "open_regular", lambda name: _FailingReads(real(name), fail_at, reads))
    with pytest.raises(StorageFailed) as caught:
        list(audit_log.read_audit_log(audit, key_provider=provider, org=record.org, group=GROUP))
    assert caught.value.detail["errno"] == errno.EIO and audit in caught.value.message
    reads.clear()
    with Authority.open(path) as authority:
        problems = authority.verify().problems
    monkeypatch.undo()
    assert len(problems) == 1 and problems[0].startswith(f"audit log {record.audit_location}: STORAGE_FAILED")
    assert store_files_held(path) == []


def test_a_verify_whose_scratch_index_cannot_be_made_is_storage_failed(tmp_path, monkeypatch):
    """verify() builds a scratch index beside the store; when its directory cannot be made
    (ENOSPC, EIO), the OSError escaped bare. It is STORAGE_FAILED (the check could not run), no
    scratch directory stays, and the handle goes on working."""
    from mwpstore import index as index_module

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        monkeypatch.setattr(index_module.os, "makedirs", _refuse(errno.ENOSPC))
        with pytest.raises(StorageFailed) as caught:
            authority.verify()
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.ENOSPC
        assert [name for name in os.listdir(path) if name.startswith("index.verify-")] == []
        authority.accept(mission_create("m-1"))
        assert authority.verify().ok
    assert store_files_held(path) == []


def test_a_compaction_whose_final_measurement_fails_is_storage_failed_and_complete(tmp_path, monkeypatch):
    """After its switch, compact() measures the new log for its report; a failure of that
    directory scan escaped bare, after the compaction had completed. It is STORAGE_FAILED saying
    so, the handle keeps working on the compacted log, and the store reopens whole."""
    path = str(tmp_path / "s")
    log_directory = os.path.join(os.path.realpath(path), "log")
    with open_with_group(path) as authority:
        receipt = authority.accept(mission_create("m-1"))
        authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal")
        real = os.scandir
        scans: list[str] = []

        def scandir(directory: str | int = ".") -> object:
            if isinstance(directory, str) and os.path.realpath(directory) == log_directory:
                scans.append(directory)
                if len(scans) == 2:  # the first scan measures the log before the copy
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(directory)

        monkeypatch.setattr(os, "scandir", scandir)
        with pytest.raises(StorageFailed) as caught:
            authority.compact()
        monkeypatch.undo()
        assert caught.value.detail["errno"] == errno.EIO and "complete" in caught.value.message
        assert authority.compact().payloads_removed == 0  # the first one removed the payload
        authority.accept(mission_create("m-2"))
    assert store_files_held(path) == []
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] == 4 and authority.verify().ok


def test_a_full_lmdb_reader_table_is_storage_failed_naming_the_limit_not_corruption(tmp_path, monkeypatch):
    """As many reads at once as an environment has slots (its own threads', other processes'
    views) is no damage: it was CORRUPTION telling the caller to rebuild a sound index."""
    monkeypatch.setattr(limits, "LMDB_READERS_MAX", 4)  # read when each environment is opened
    authority = open_with_group(str(tmp_path / "store"))
    agent = AgentStore.open(str(tmp_path / "agent"))
    try:
        reads = {
            "head": lambda: authority.head(GROUP),
            "accept": lambda: authority.accept(mission_create("m-1")),  # its duplicate check reads
            "expire_leases": lambda: authority.expire_leases(GROUP),
            "agent groups": agent.groups,
        }
        for name, read in reads.items():
            env = agent._tables.env if name.startswith("agent") else authority.index.env
            held = []
            with pytest.raises(lmdb.ReadersFullError):  # every slot the handle's own reads left free
                while len(held) < 8:
                    held.append(env.begin())
            try:
                with pytest.raises(StorageFailed) as caught:
                    read()
            finally:
                for txn in held:
                    txn.abort()
                held.clear()  # an aborted transaction keeps its slot until it is freed
            assert caught.value.detail == {"reason": "readers_full", "limit": 4}, name
            assert "limits.LMDB_READERS_MAX" in caught.value.message
            read()  # a slot free again: the handle was not failed
        assert authority.head(GROUP)[0] == 2
    finally:
        agent.close()
        authority.close()
