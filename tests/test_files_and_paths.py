"""Files on disk and paths from outside: the temp name of the clean-close marker, bounds checked
before copying, directories made durable, typed errors for hostile paths and contents (a review
of 2026-12-03)."""

from __future__ import annotations

import os

import pytest

from authority_helpers import GROUP, open_with_group
from mwpstore import _files
from mwpstore.audit_log import read_audit_log_header
from mwpstore.errors import InvalidCommand, LimitExceeded, StorageFailed
from mwpstore.limits import GROUP_BYTES_MAX, RECORD_BYTES_MAX
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from mwpstore.snapshot import SigningKey, read_snapshot_file, retired_public_keys, write_snapshot_file


@pytest.mark.parametrize("obstacle", ["fifo", "symlink"])
def test_the_clean_close_marker_is_not_written_through_what_lies_at_an_old_temp_name(tmp_path, obstacle):
    directory = tmp_path / "log"
    log = SegmentLog.open(str(directory))
    log.append([b"x"])
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    stale = directory / (CLEAN_FILE_NAME + ".tmp")
    if obstacle == "fifo":
        os.mkfifo(stale)  # close() used to open it for writing and wait for a reader forever
    else:
        stale.symlink_to(outside)  # and to write through it
    log.close()
    assert outside.read_bytes() == b"keep"
    assert not (directory / CLEAN_FILE_NAME).is_symlink() and (directory / CLEAN_FILE_NAME).stat().st_size == 48
    SegmentLog.open(str(directory)).close()  # the next writable open clears the leftover
    assert not os.path.lexists(stale)


def test_a_file_named_almost_like_a_clean_marker_leftover_is_not_deleted(tmp_path):
    directory = tmp_path / "log"
    SegmentLog.open(str(directory)).close()
    for name in (CLEAN_FILE_NAME + ".tmp\n", CLEAN_FILE_NAME + ".0123456789abcdef.tmpx", "x" + CLEAN_FILE_NAME + ".tmp"):
        (directory / name).write_bytes(b"not ours")
    leftover = directory / (CLEAN_FILE_NAME + ".0123456789abcdef.tmp")
    leftover.write_bytes(b"ours")
    SegmentLog.open(str(directory)).close()
    assert not leftover.exists()
    assert sorted(name for name in os.listdir(directory) if name.endswith(("\n", "tmpx")) or name.startswith("x")) == sorted(
        [CLEAN_FILE_NAME + ".tmp\n", CLEAN_FILE_NAME + ".0123456789abcdef.tmpx", "x" + CLEAN_FILE_NAME + ".tmp"]
    )


def test_a_group_over_the_byte_bound_is_refused_before_it_is_copied():
    log_records = [memoryview(bytes(RECORD_BYTES_MAX))] * 65_536  # 1 TiB if joined
    with pytest.raises(LimitExceeded) as caught:
        SegmentLog.append(_OpenLog.instance, log_records)
    assert str(GROUP_BYTES_MAX) in caught.value.message


class _OpenLog:
    instance: SegmentLog


@pytest.fixture(autouse=True)
def _a_log(tmp_path):
    _OpenLog.instance = SegmentLog.open(str(tmp_path / "bounds-log"))
    yield
    _OpenLog.instance.close()


@pytest.mark.parametrize("path", [None, 5, b"/tmp/x", "", "a\x00b"])
def test_paths_from_outside_are_checked(tmp_path, path):
    for call in (
        lambda: SegmentLog.open(path),
        lambda: read_snapshot_file(path),
        lambda: write_snapshot_file(path, b"x"),
        lambda: SigningKey.load_or_create(path),
        lambda: retired_public_keys(path),
    ):
        with pytest.raises(InvalidCommand):
            call()


def test_file_contents_that_are_not_bytes_leave_no_temporary_file(tmp_path):
    for contents in ("text", None, 5):
        with pytest.raises(InvalidCommand):
            write_snapshot_file(str(tmp_path / "s.snap"), contents)
        with pytest.raises(InvalidCommand):
            _files.create_secret_file(str(tmp_path / "k.key"), contents)
    assert os.listdir(tmp_path) == [] or os.listdir(tmp_path) == ["bounds-log"]


def test_reading_an_audit_log_header_that_is_not_a_file_is_storage_failed(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("missing", "fifo", "dir"):
        with pytest.raises(StorageFailed):
            read_audit_log_header(str(tmp_path / name))


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The directories fsynced through ``_files.fsync_directory`` (still synced), in order."""
    paths: list[str] = []
    fsync_directory = _files.fsync_directory

    def recording(directory: str) -> None:
        paths.append(os.path.abspath(directory))
        fsync_directory(directory)

    monkeypatch.setattr(_files, "fsync_directory", recording)
    return paths


def test_directories_for_snapshots_and_keys_are_created_durably(tmp_path, synced):
    with open_with_group(str(tmp_path / "store")) as authority:
        ref = authority.snapshot(GROUP)
    store = os.path.abspath(str(tmp_path / "store"))
    created = [os.path.join(store, "keys"), os.path.join(store, "snapshots"), os.path.dirname(os.path.join(store, ref.location))]
    for directory in created:  # each new directory's parent was fsynced after it was made
        assert os.path.dirname(directory) in synced, directory


@pytest.mark.parametrize("kind", ["authority", "agent store"])
def test_a_new_store_directory_is_made_durable_in_its_parent(tmp_path, synced, kind):
    """Opening a store in a directory that does not exist yet creates it and every missing parent.
    Each new entry must be synced in its parent: with a bare ``os.makedirs`` only the store's own
    contents were synced, so a power loss could take the store directory's entry, and every
    acknowledged Command or applied Event in it, along."""
    from mwpstore import Authority
    from mwpstore.agent_store import AgentStore

    store = tmp_path / "a" / "b" / "store"
    (Authority.open if kind == "authority" else AgentStore.open)(str(store)).close()
    for created in (store, store.parent, store.parent.parent):
        assert str(created.parent) in synced, f"{created} was created but {created.parent} never synced"


@pytest.mark.parametrize("write", ["atomic", "secret"])
def test_an_interrupted_write_leaves_no_temporary_copy(tmp_path, monkeypatch, write):
    """An interrupt (``KeyboardInterrupt``, or any exception that is no ``OSError``) while the
    temporary file is being written removes it before propagating: ``write_file_atomic`` writes
    the new seed of a key rotation, and a copy of a secret must not outlive the call, nor a stray
    temporary file the writer of a snapshot."""
    directory = tmp_path / "d"
    directory.mkdir()

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if write == "atomic":
            _files.write_file_atomic(str(directory / "f"), b"secret seed")
        else:
            _files.create_secret_file(str(directory / "f"), b"secret seed")
    monkeypatch.undo()
    assert os.listdir(directory) == []
