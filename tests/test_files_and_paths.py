"""Files on disk and paths from outside: the temp name of the clean-close marker, bounds checked
before copying, directories made durable, typed errors for hostile paths and contents (a review
of 2026-12-03)."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group
from mwpstore import Authority, _files
from mwpstore.audit_log import FileKeyProvider, read_audit_log_header
from mwpstore.errors import InvalidCommand, LimitExceeded, StorageFailed
from mwpstore.limits import GROUP_BYTES_MAX, RECORD_BYTES_MAX
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from mwpstore.snapshot import SIGNING_KEY_NAME, SigningKey, read_snapshot_file, retired_public_keys, write_snapshot_file


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
        with pytest.raises(InvalidCommand), _files.open_directory(str(tmp_path)) as directory:
            _files.create_secret_at(directory, "k.key", contents)
    assert os.listdir(tmp_path) == [] or os.listdir(tmp_path) == ["bounds-log"]


def test_reading_an_audit_log_header_that_is_not_a_file_is_storage_failed(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("missing", "fifo", "dir"):
        with pytest.raises(StorageFailed):
            read_audit_log_header(str(tmp_path / name))


def test_directories_for_snapshots_and_keys_are_created_durably(tmp_path, synced_directories):
    with open_with_group(str(tmp_path / "store")) as authority:
        ref = authority.snapshot(GROUP)
    store = os.path.abspath(str(tmp_path / "store"))
    created = [os.path.join(store, "keys"), os.path.join(store, "snapshots"), os.path.dirname(os.path.join(store, ref.location))]
    for directory in created:  # each new directory's parent was fsynced after it was made
        assert os.path.dirname(directory) in synced_directories, directory


def test_a_handle_remembers_a_bounded_number_of_durable_directories(tmp_path, monkeypatch, synced_directories):
    """One snapshots/<group> per Group ever snapshotted stayed in the handle's memory for its
    life; past the bound they are forgotten, and a directory forgotten is synced again when used."""
    from mwpstore import authority as authority_module

    monkeypatch.setattr(authority_module, "_DURABLE_DIRECTORIES_MAX", 20, raising=False)
    store = os.path.abspath(str(tmp_path / "store"))
    groups = [f"g-many-{number}" for number in range(60)]
    with open_with_group(store) as authority:
        authority.snapshot(GROUP)
        authority.accept_many([group_create(group) for group in groups])
        for group in groups:
            authority.snapshot(group)
            assert len(authority._durable_directories) <= 20
        authority.accept(mission_create("m-1"))
        del synced_directories[:]
        authority.snapshot(GROUP)  # its directory was forgotten: synced in its parent again
    assert os.path.join(store, "snapshots") in synced_directories


@pytest.mark.parametrize("kind", ["authority", "agent store"])
def test_a_new_store_directory_is_made_durable_in_its_parent(tmp_path, synced_directories, kind):
    """Opening a store in a directory that does not exist yet creates it and every missing parent.
    Each new entry must be synced in its parent: with a bare ``os.makedirs`` only the store's own
    contents were synced, so a power loss could take the store directory's entry, and every
    acknowledged Command or applied Event in it, along."""
    from mwpstore import Authority
    from mwpstore.agent_store import AgentStore

    store = tmp_path / "a" / "b" / "store"
    (Authority.open if kind == "authority" else AgentStore.open)(str(store)).close()
    for created in (store, store.parent, store.parent.parent):
        assert str(created.parent) in synced_directories, f"{created} was created but {created.parent} never synced"


def record_directory_syncs(monkeypatch) -> list[tuple[tuple[int, int], list[str]]]:
    """Every directory passed to ``os.fsync``: its ``(st_dev, st_ino)`` and the names it held at
    that moment (an entry is durable once its directory is synced after it was made)."""
    seen: list[tuple[tuple[int, int], list[str]]] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            seen.append(((info.st_dev, info.st_ino), sorted(os.listdir(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


@pytest.mark.parametrize("reopened", [False, True])
def test_an_agent_stores_lmdb_files_are_made_durable_in_their_directories(tmp_path, monkeypatch, reopened):
    """LMDB syncs the data file at every commit, never the directories that name it: the open
    must sync ``data.mdb`` in ``lmdb/`` and ``lmdb/`` in the store's directory, or a power loss
    can take the whole environment, with every Cursor it ACKed and every outbox intent it held
    durable before a dispatch, and the next open makes an empty store there. A reopen syncs them
    (and the store's own entry) too: an earlier open that died between making an entry and
    syncing it left a store that looks whole."""
    from mwpstore.agent_store import AgentStore

    store = tmp_path / "agent"
    if reopened:
        AgentStore.open(str(store)).close()
    synced = record_directory_syncs(monkeypatch)
    AgentStore.open(str(store)).close()
    for directory, name in ((store / "lmdb", "data.mdb"), (store, "lmdb"), (store, "agent.lock"), (tmp_path, "agent")):
        assert any(seen == _identity(directory) and name in names for seen, names in synced), (
            f"{name} was never synced in {directory}"
        )


@pytest.mark.parametrize("kind", ["authority", "agent store"])
def test_an_empty_store_directory_found_in_place_is_synced_in_its_parent(tmp_path, synced_directories, kind):
    """A process killed between creating a new store's directory and fsyncing its parent leaves
    an empty directory that may be in the page cache only. The next open, which makes a store
    there, syncs the parent as if it had made the directory itself: otherwise a power loss could
    take the directory, and every acknowledged Command or applied Event in it, along."""
    from mwpstore import Authority
    from mwpstore.agent_store import AgentStore

    store = tmp_path / "store"
    store.mkdir()  # as the killed process left it
    (Authority.open if kind == "authority" else AgentStore.open)(str(store)).close()
    assert str(tmp_path) in synced_directories, f"{store} was found in place but {tmp_path} never synced"


# -- The durable file helpers, one promise each ----------------------------------------------------


@pytest.fixture
def fsynced(monkeypatch) -> list[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every descriptor passed to ``os.fsync`` (still synced), in order."""
    seen: list[tuple[int, int]] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        info = os.fstat(fd)
        seen.append((info.st_dev, info.st_ino))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def _identity(path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def test_fsync_directory_fsyncs_the_directory_itself(tmp_path, fsynced):
    """``fsync_directory`` is what makes a rename, link or unlink durable: it must hand the
    directory's descriptor to ``fsync``, not merely open and close it."""
    _files.fsync_directory(str(tmp_path))
    assert fsynced == [_identity(tmp_path)]


@pytest.mark.parametrize("write", ["atomic", "secret"])
def test_file_contents_are_fsynced_before_publishing_and_the_directory_after(tmp_path, fsynced, synced_directories, write):
    """``write_file_atomic`` and ``create_secret_at`` fsync the file's own descriptor (the
    published name keeps the inode, so its identity is among the synced ones) and then fsync the
    directory holding the new name."""
    directory = tmp_path / "d"
    directory.mkdir()
    path = directory / "f"
    if write == "atomic":
        _files.write_file_atomic(str(path), b"contents")
    else:
        with _files.open_directory(str(directory)) as held:
            assert _files.create_secret_at(held, "f", b"contents") is True
    assert path.read_bytes() == b"contents"
    assert _identity(path) in fsynced, "the file's data was never fsynced"
    assert str(directory) in synced_directories, "the directory holding the new name was never fsynced"
    assert os.listdir(directory) == ["f"]


@pytest.mark.parametrize("write", ["atomic", "secret"])
def test_short_writes_are_continued_until_every_byte_is_written(tmp_path, monkeypatch, write):
    """``os.write`` may write fewer bytes than asked (a signal, a nearly full disk): the helpers
    loop until everything is written instead of publishing a truncated file."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    path = tmp_path / "f"
    contents = bytes(range(40))
    if write == "atomic":
        _files.write_file_atomic(str(path), contents)
    else:
        with _files.open_directory(str(tmp_path)) as directory:
            _files.create_secret_at(directory, "f", contents)
    monkeypatch.undo()
    assert path.read_bytes() == contents


@pytest.mark.parametrize("write", ["atomic", "secret"])
def test_the_temporary_file_lives_beside_the_target(tmp_path, monkeypatch, write):
    """The temporary name is in the target's own directory (same file system, so the final
    rename or link is atomic, and ``remove_with_temp_copies_at`` finds a copy left there), whatever
    the working directory is."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    monkeypatch.chdir(elsewhere)
    published: list[tuple[str, tuple[int, int]]] = []  # the temporary name and the directory it is in
    real_replace, real_link = os.replace, os.link

    def publishing(real):
        def call(src, dst, **where):
            held = os.fstat(where["src_dir_fd"]) if "src_dir_fd" in where else os.stat(os.path.dirname(os.path.abspath(src)))
            published.append((os.path.basename(src), (held.st_dev, held.st_ino)))
            return real(src, dst, **where)

        return call

    monkeypatch.setattr(os, "replace", publishing(real_replace))
    monkeypatch.setattr(os, "link", publishing(real_link))
    if write == "atomic":
        _files.write_file_atomic(str(target / "f"), b"x")
    else:
        with _files.open_directory(str(target)) as directory:
            _files.create_secret_at(directory, "f", b"x")
    monkeypatch.undo()
    assert len(published) == 1 and published[0][0].startswith(".f.") and published[0][1] == _identity(target)
    assert os.listdir(elsewhere) == []


def test_a_failed_atomic_write_is_storage_failed_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """An I/O error while publishing is reported (``StorageFailed``), never swallowed, and the
    temporary copy is removed."""
    import errno

    directory = tmp_path / "d"
    directory.mkdir()

    def failing(src, dst, **where):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(StorageFailed):
        _files.write_file_atomic(str(directory / "f"), b"contents")
    monkeypatch.undo()
    assert os.listdir(directory) == []


def test_makedirs_durable_refuses_a_file_in_place_of_the_directory(tmp_path):
    """A path that exists and is no directory is ``StorageFailed`` (``EEXIST``), not taken for a
    directory that was just created."""
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(StorageFailed):
        _files.makedirs_durable(str(tmp_path / "plain"))
    with pytest.raises(StorageFailed):
        _files.open_below(str(tmp_path), "plain", private=True)
    assert (tmp_path / "plain").read_bytes() == b"x"


@pytest.mark.parametrize("opener", ["authority", "agent_store"])
def test_a_store_path_under_a_file_names_the_file_in_the_way(tmp_path, opener):
    """A store directory asked for under a regular file: ``StorageFailed`` that says which path
    component is a file, not mkdir's bare "File exists" about it."""
    from mwpstore import AgentStore, Authority

    (tmp_path / "plain").write_bytes(b"x")
    wanted = str(tmp_path / "plain" / "store")
    with pytest.raises(StorageFailed) as raised:
        (Authority if opener == "authority" else AgentStore).open(wanted)
    assert f"{tmp_path / 'plain'} exists and is not a directory" in raised.value.message
    assert raised.value.detail["errno"] == errno.EEXIST
    assert (tmp_path / "plain").read_bytes() == b"x"


def test_a_secret_file_is_mode_0600_whatever_the_umask(tmp_path):
    """A umask may remove bits from the mode ``open`` is given: ``create_secret_at`` sets 0600
    exactly, so an owner-only umask such as 0o277 still leaves the owner able to write it."""
    import stat

    previous = os.umask(0o277)
    try:
        with _files.open_directory(str(tmp_path)) as directory:
            _files.create_secret_at(directory, "k.key", b"k" * 32)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "k.key").st_mode) == 0o600


def test_under_umask_0_nothing_a_store_makes_is_writable_by_others_and_no_secret_is_readable(tmp_path):
    """The modes mwpstore asks for are the only limit under umask 0: every file and directory of an
    authority (after snapshots, a rotation, an archive, an Organization key rotation, a rebuild and
    a compaction) and of an AgentStore is writable by its owner only, and everything under
    ``keys/`` but the public key is private. ``index/`` was made with ``os.makedirs``' default
    0777, so any local user could replace the index's files."""
    from mwpstore import AgentStore, Authority

    previous = os.umask(0)
    try:
        with open_with_group(str(tmp_path / "s")) as authority:
            authority.accept(mission_create("m-1"))
            authority.snapshot(GROUP)
            authority.rotate_signing_key()
            authority.accept(mission_create("m-2"))
            authority.snapshot(GROUP)
            authority.archive(GROUP, actor=OWNER, action_id="archive")
            FileKeyProvider(str(tmp_path / "s" / "keys" / "orgs")).rotate("acme")
            authority.rebuild()
            authority.compact()
        Authority.open(str(tmp_path / "s")).close()
        AgentStore.open(str(tmp_path / "agent")).close()
    finally:
        os.umask(previous)
    found = {}
    for top in ("s", "agent"):
        for directory, names, files in os.walk(tmp_path / top):
            for name in [".", *names, *files]:
                path = os.path.normpath(os.path.join(directory, name))
                found[os.path.relpath(path, tmp_path)] = stat.S_IMODE(os.lstat(path).st_mode)
    assert {"s/index", "s/log", "s/keys/orgs/acme", "s/keys/retired", "s/snapshots/g-1", "agent/lmdb"} <= set(found)
    assert {path: oct(mode) for path, mode in found.items() if mode & 0o022} == {}
    assert {path: oct(mode) for path, mode in found.items() if path.startswith("s/keys") and mode & 0o077} == {"s/keys/snapshot-signing.pub": "0o644"}


@pytest.mark.parametrize(
    ("opener", "name"),
    [("authority", "data.mdb"), ("authority", "lock.mdb"), ("view", "lock.mdb"), ("agent", "data.mdb"), ("agent", "lock.mdb")],
)
def test_an_lmdb_file_that_is_a_symbolic_link_is_never_written_through(tmp_path, opener, name):
    """LMDB opens ``data.mdb`` and ``lock.mdb`` with O_CREAT, following links: through a dangling
    link it made the file it named, outside the store, and wrote the environment or its reader
    table there. An AgentStore and a read-only view refuse such a link with STORAGE_FAILED naming
    it; the writer's open judges its index unusable and rebuilds it in place of the link."""
    from mwpstore import AgentStore, Authority

    path = str(tmp_path / "s")
    if opener == "agent":
        AgentStore.open(path).close()
        directory = os.path.join(path, "lmdb")
    else:
        with open_with_group(path):
            pass
        directory = os.path.join(path, "index")
    outside = tmp_path / "outside"
    target = os.path.join(directory, name)
    os.remove(target)
    os.symlink(outside, target)
    if opener == "authority":
        with Authority.open(path) as authority:
            assert authority.open_report.mode == "rebuild" and authority.head(GROUP)[0] == 1
        assert not os.path.islink(target)
    else:
        with pytest.raises(StorageFailed) as caught:
            AgentStore.open(path) if opener == "agent" else Authority.open(path, readonly=True)
        assert caught.value.detail["path"] == target and "symbolic link" in caught.value.message
    assert not os.path.lexists(outside)


_OPEN_IN_A_CHILD = """
import json, sys
from mwpstore import AgentStore, Authority, MwpError
try:
    (AgentStore.open(sys.argv[1]) if sys.argv[2] == "agent" else Authority.open(sys.argv[1], readonly=True)).close()
    print(json.dumps(None))
except MwpError as exc:
    print(json.dumps([exc.code, exc.message, exc.detail.get("path")]))
"""


@pytest.mark.parametrize(("opener", "name"), [("view", "data.mdb"), ("view", "lock.mdb"), ("agent", "lock.mdb")])
def test_an_lmdb_file_that_is_a_fifo_is_refused_naming_it(tmp_path, opener, name):
    """A FIFO in place of an LMDB file: a read-only view hung opening ``data.mdb`` (in LMDB's C
    code, beyond an interrupt), and ``lock.mdb`` was LMDB's bare "Illegal seek". It is
    STORAGE_FAILED naming the file, at once. Opened in a child process, which a hang cannot
    keep: the test fails instead."""
    from mwpstore import AgentStore

    path = str(tmp_path / "s")
    if opener == "agent":
        AgentStore.open(path).close()
    else:
        with open_with_group(path):
            pass
    target = os.path.join(path, "lmdb" if opener == "agent" else "index", name)
    os.remove(target)
    os.mkfifo(target)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run([sys.executable, "-c", _OPEN_IN_A_CHILD, path, opener], cwd=repo, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    code, message, named = json.loads(child.stdout)
    assert code == "STORAGE_FAILED" and named == target and "not a regular file" in message


@pytest.mark.parametrize("directory", ["snapshots", "snapshots/g-1", "archive", "archive/g-1"])
def test_a_store_directory_that_is_a_symbolic_link_is_not_written_through(tmp_path, directory):
    """``snapshots/<group>/`` and ``archive/<group>/`` (or their parents) found as a symbolic link,
    put there after the open: the snapshot, or the audit log, was written wherever it pointed,
    outside the store. It is STORAGE_FAILED naming the link, nothing is written there, the handle
    goes on accepting, and once the link is gone the same call completes."""
    path = str(tmp_path / "s")
    outside = tmp_path / "outside"
    outside.mkdir()
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.snapshot(GROUP)  # snapshots/g-1 made (and cached as durable) by this handle
        authority.accept(mission_create("m-2"))
        link = os.path.join(path, directory)
        if os.path.isdir(link):
            os.rename(link, tmp_path / "moved")
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(outside, link)
        call = authority.snapshot if directory.startswith("snapshots") else lambda group: authority.archive(group, actor=OWNER, action_id="archive")
        with pytest.raises(StorageFailed) as caught:
            call(GROUP)
        assert caught.value.detail["path"] == link and os.listdir(outside) == []
        authority.accept(group_create("g-2"))  # g-1 is archived already when archive() fails
        os.remove(link)
        if os.path.isdir(tmp_path / "moved"):
            os.rename(tmp_path / "moved", link)
        call(GROUP)
        assert os.listdir(outside) == [] and authority.verify().ok


def test_removing_a_secret_removes_only_its_own_temporary_copies_and_syncs(tmp_path, synced_directories):
    """``remove_with_temp_copies_at`` deletes the file and ``.<name>.<16 hex>.tmp`` copies, durably
    (the directory is fsynced), and nothing else: not a name that merely starts like a copy, nor
    one where the dots of the file's name are other characters."""
    directory = tmp_path / "d"
    directory.mkdir()
    name = "k1.key"
    (directory / name).write_bytes(b"k")
    (directory / f".{name}.0123456789abcdef.tmp").write_bytes(b"k")
    keep = [f".{name}.0123456789abcdef.tmpx", ".k1Xkey.0123456789abcdef.tmp", f".{name}.0123456789abcdef.tmp.bak"]
    for other in keep:
        (directory / other).write_bytes(b"not a copy")
    with _files.open_directory(str(directory)) as held:
        assert _files.remove_with_temp_copies_at(held, name) is True
        assert sorted(os.listdir(directory)) == sorted(keep)
        assert str(directory) in synced_directories
        assert _files.remove_with_temp_copies_at(held, name) is False
        (directory / name).mkdir()  # a directory under the file's own name is no file to delete: said so
        with pytest.raises(StorageFailed) as caught:
            _files.remove_with_temp_copies_at(held, name)
    assert caught.value.detail["errno"] == errno.EISDIR and (directory / name).is_dir()


def test_open_regular_fd_names_a_directory_and_leaks_no_descriptor(tmp_path):
    """A directory is ``IsADirectoryError`` and a FIFO ``OSError`` (``EINVAL``); either way the
    descriptor opened to look at it is closed again."""
    import errno

    os.mkfifo(tmp_path / "fifo")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(IsADirectoryError):
            _files.open_regular_fd(str(tmp_path))
        with pytest.raises(OSError) as caught:
            _files.open_regular_fd(str(tmp_path / "fifo"))
        assert caught.value.errno == errno.EINVAL
    assert len(os.listdir("/proc/self/fd")) < before + 20


def test_a_key_file_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    """The owner check: a key file whose owner is not this process's user is ``KeyFileInvalid``
    with reason ``owner`` (shown by letting the process claim another user id)."""
    from mwpstore.errors import KeyFileInvalid

    with _files.open_directory(str(tmp_path)) as directory:
        _files.create_secret_at(directory, "k.key", b"k" * 32)
        assert _files.read_secret_at(directory, "k.key", 32) == b"k" * 32
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)
        with pytest.raises(KeyFileInvalid) as caught:
            _files.read_secret_at(directory, "k.key", 32)
    assert caught.value.detail["reason"] == "owner"


def test_a_key_file_too_large_names_its_size(tmp_path):
    """A key file with more bytes than a key is refused up front, with its size in the error."""
    from mwpstore.errors import KeyFileInvalid

    with _files.open_directory(str(tmp_path)) as directory:
        _files.create_secret_at(directory, "k.key", b"k" * 33)
        with pytest.raises(KeyFileInvalid) as caught:
            _files.read_secret_at(directory, "k.key", 32)
    assert caught.value.detail["reason"] == "size" and caught.value.detail["size"] == 33


def test_a_file_growing_between_stat_and_read_is_not_taken_truncated(tmp_path, monkeypatch):
    """The reads ask for one byte more than the size seen by ``fstat``: a file that grew meanwhile
    (shown by an ``fstat`` reporting the old size) is refused, not returned cut to size."""
    from mwpstore.errors import KeyFileInvalid

    directory = _files.open_directory(str(tmp_path))
    _files.create_secret_at(directory, "k.key", b"k" * 33)
    capped = tmp_path / "c"
    capped.write_bytes(b"c" * 11)
    real_fstat = os.fstat

    def stale(fd):
        info = real_fstat(fd)
        return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, info.st_uid, info.st_gid, info.st_size - 1,
                               info.st_atime, info.st_mtime, info.st_ctime))

    monkeypatch.setattr(os, "fstat", stale)
    with directory, pytest.raises(KeyFileInvalid) as caught:
        _files.read_secret_at(directory, "k.key", 32)
    assert caught.value.detail["reason"] == "size"
    assert _files.read_file_capped(str(capped), 10) is None


def test_read_file_capped_bounds_and_missing_files(tmp_path):
    """At most ``bytes_max`` bytes are read whole (exactly ``bytes_max`` included); a larger file
    reads as None; a missing file is None only with ``missing_ok``, ``StorageFailed`` otherwise."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert _files.read_file_capped(str(path), 10) == b"x" * 10
    assert _files.read_file_capped(str(path), 9) is None
    assert _files.read_file_capped(str(tmp_path / "missing"), 10, missing_ok=True) is None
    with pytest.raises(StorageFailed):
        _files.read_file_capped(str(tmp_path / "missing"), 10)


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
            with _files.open_directory(str(directory)) as held:
                _files.create_secret_at(held, "f", b"secret seed")
    monkeypatch.undo()
    assert os.listdir(directory) == []


def test_snapshot_and_archive_files_are_durable_before_the_records_that_name_them_are_logged(tmp_path, fsynced, monkeypatch):
    """A snapshot reference (``S``) and an archive record (``R``) reach the log only after the
    files they name are durable: the file's data fsynced and its directory fsynced after the
    rename. Logged first, a crash could leave a durable reference to a missing file, and an
    archive record lets compaction drop the Group's Events from the log."""
    from mwpstore import Command

    appended: list[tuple[int, bytes]] = []  # (fsyncs so far, tags of the appended records)
    real_append = SegmentLog.append
    monkeypatch.setattr(SegmentLog, "append", lambda log, records: (appended.append((len(fsynced), b"".join(bytes(memoryview(r)[:1]) for r in records))), real_append(log, records))[1])
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(Command(actor="owner", action_id="m", group=GROUP, kind="mission.create", target="m", body={"title": "t", "cost_limit": 1}))
        ref = authority.snapshot(GROUP)
        authority.accept(Command(actor="owner", action_id="m2", group=GROUP, kind="mission.create", target="m2", body={"title": "t", "cost_limit": 1}))
        record = authority.archive(GROUP, actor="owner", action_id="archive")
        files = {
            b"S": [os.path.join(authority.path, ref.location), os.path.join(authority.path, record.final_snapshot.location)],
            b"R": [os.path.join(authority.path, record.audit_location)],
        }
    for tag, paths in files.items():
        logged = [(syncs, tags) for syncs, tags in appended if tag in tags]
        assert len(logged) == len(paths)
        for (syncs, _), path in zip(logged, paths):
            before = fsynced[:syncs]
            assert _identity(path) in before, f"{path} was not fsynced before its {tag!r} record was logged"
            last = len(before) - 1 - before[::-1].index(_identity(path))
            assert _identity(os.path.dirname(path)) in before[last + 1 :], f"the directory of {path} was not fsynced after it"


def test_a_store_directory_whose_sync_failed_is_synced_by_the_next_call(tmp_path, monkeypatch):
    """The handle syncs each store directory once, and notes it as durable only once that worked:
    after a failed sync (here of ``snapshots/``, for the ``snapshots/<group>`` a killed process left
    in place) the next snapshot syncs it before its S record is logged."""
    from mwpstore import Command

    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(Command(actor="owner", action_id="m", group=GROUP, kind="mission.create", target="m", body={"title": "t", "cost_limit": 1}))
        authority.signing_key
        os.makedirs(os.path.join(authority.path, "snapshots", GROUP))  # as a killed process left it
        real = _files.fsync_directory
        synced: list[str] = []

        def failing(directory: str) -> None:
            raise StorageFailed(f"cannot sync {directory}")

        monkeypatch.setattr(_files, "fsync_directory", failing)
        with pytest.raises(StorageFailed):
            authority.snapshot(GROUP)
        monkeypatch.setattr(_files, "fsync_directory", lambda directory: (synced.append(os.path.abspath(directory)), real(directory))[1])
        authority.snapshot(GROUP)
        assert os.path.join(authority.path, "snapshots") in synced  # where snapshots/<group>'s entry is


@pytest.mark.parametrize(
    "left", ["snapshots", f"snapshots/{GROUP}", "archive", f"archive/{GROUP}", "keys", "keys/orgs", "keys/orgs/acme"]
)
def test_a_store_directory_found_in_place_is_made_durable_before_a_record_names_a_file_in_it(tmp_path, fsynced, monkeypatch, left):
    """A process killed between creating a store directory and fsyncing its parent leaves the
    directory in the page cache only; the next process (same boot) finds it in place. A snapshot,
    key or audit log written into it is durable in it, but a power loss could still take the
    directory's own entry, and the file with it, while the log keeps the record naming the file.
    So every directory on the way from the store down is synced in its parent (whether this
    process made it or found it) before the S or R record is logged."""
    from mwpstore import Command
    from mwpstore.audit_log import FileKeyProvider

    appended: list[tuple[int, bytes]] = []  # (fsyncs so far, tags of the appended records)
    real_append = SegmentLog.append
    monkeypatch.setattr(SegmentLog, "append", lambda log, records: (appended.append((len(fsynced), b"".join(bytes(memoryview(r)[:1]) for r in records))), real_append(log, records))[1])
    with open_with_group(str(tmp_path / "store")) as authority:
        # Everything else the snapshot and the archive need is made first, durably, so that no
        # creation of a sibling syncs the store directory by chance.
        for other in ("keys", f"snapshots/{GROUP}", f"archive/{GROUP}"):
            if other.split("/")[0] != left.split("/")[0]:
                _files.makedirs_durable(os.path.join(authority.path, other), 0o700)
        if not left.startswith("keys"):
            authority.signing_key
            FileKeyProvider(os.path.join(authority.path, "keys", "orgs")).current_key("acme")
        os.makedirs(os.path.join(authority.path, left), mode=0o700)  # as a killed process left it
        start = len(fsynced)
        authority.accept(Command(actor="owner", action_id="m", group=GROUP, kind="mission.create", target="m", body={"title": "t", "cost_limit": 1}))
        authority.snapshot(GROUP)
        authority.archive(GROUP, actor="owner", action_id="archive")
        store = authority.path
    tag = b"R" if left.startswith(("archive", "keys/orgs")) else b"S"
    syncs = next(syncs for syncs, tags in appended if tag in tags)
    path = os.path.join(store, left)
    while path != store:  # each directory found in place, and each above it, synced in its parent
        assert _identity(os.path.dirname(path)) in fsynced[start:syncs], f"{os.path.dirname(path)} was never synced before the {tag!r} record"
        path = os.path.dirname(path)


# -- A symbolic link put in place between a check and the write (2026-12-07) -----------------------


def swap_for_a_link_at_the_first_write(monkeypatch, store: str, relative: str, outside, temporary: str) -> list[str]:
    """At the first ``os.open`` that creates a file whose name matches ``temporary`` (the regex of a
    write's temporary name), move ``<store>/<relative>`` aside to ``<relative>.moved`` and put a
    symbolic link to ``outside`` in its place: after every check the store made of the directory,
    before anything is written in it. ``outside`` gets the directories the moved one holds (so a
    write by path finds its way there). Returns the directories swapped (one, once it happened)."""
    import re

    real_open = os.open
    swapped: list[str] = []

    def opening(path, flags, mode=0o777, *, dir_fd=None):
        if not swapped and flags & os.O_CREAT and re.fullmatch(temporary, os.path.basename(os.fspath(path))):
            directory = os.path.join(store, relative)
            os.rename(directory, directory + ".moved")
            for below, _, _ in os.walk(directory + ".moved"):
                os.makedirs(os.path.join(outside, os.path.relpath(below, directory + ".moved")), exist_ok=True)
            os.symlink(outside, directory)
            swapped.append(directory)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", opening)
    return swapped


def files_below(directory) -> list[str]:
    return sorted(os.path.join(below, name) for below, _, names in os.walk(directory) for name in names)


_TEMP = r"\.{}\.[0-9a-f]{{16}}\.tmp"


@pytest.mark.parametrize("relative", ["snapshots", f"snapshots/{GROUP}"])
def test_a_snapshot_directory_replaced_by_a_link_after_its_check_is_not_written_through(tmp_path, monkeypatch, relative):
    """Finding 160's check looked at ``snapshots/<group>`` and the write went by path: a link put
    there between the two received the snapshot. The write now goes through the directory the
    check opened: the snapshot lands in the store's own directory (moved aside here), never in
    the one the link names."""
    outside = tmp_path / "outside"
    outside.mkdir()
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        authority.snapshot(GROUP)
        authority.accept(mission_create("m-2"))
        swapped = swap_for_a_link_at_the_first_write(monkeypatch, authority.path, relative, outside, _TEMP.format(r"\d{20}\.snap"))
        ref = authority.snapshot(GROUP)
        monkeypatch.undo()
        assert swapped and files_below(outside) == []
        moved = os.path.join(authority.path, relative + ".moved", os.path.relpath(ref.location, relative))
        assert read_snapshot_file(moved) and not os.path.lexists(os.path.join(outside, os.path.basename(ref.location)))


@pytest.mark.parametrize(
    ("relative", "written"),
    [("archive", "audit log"), (f"archive/{GROUP}", "audit log"), ("keys/orgs", "org key"), ("keys/orgs/acme", "org key")],
)
def test_an_archive_directory_replaced_by_a_link_after_its_check_is_not_written_through(tmp_path, monkeypatch, relative, written):
    """As for snapshots: ``archive/<group>`` replaced by a link after the archive checked it
    received the encrypted audit log; ``keys/orgs/<org>`` (finding 158), or ``keys/orgs``, which
    the store's key provider followed, received the Organization's key. Every file is now made
    through the directories opened from the store down, and nothing reaches the directory the link
    names (the archive then fails, at its check of the file by path or at the next key read,
    and removes what it wrote, in the store)."""
    from mwpstore import MwpError

    outside = tmp_path / "outside"
    outside.mkdir()
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        authority.signing_key
        os.makedirs(os.path.join(authority.path, "archive", GROUP))
        os.makedirs(os.path.join(authority.path, "keys", "orgs", "acme"), mode=0o700)
        temporary = _TEMP.format(r"audit-\d{20}\.log" if written == "audit log" else r"[0-9a-f]{16}\.key")
        swapped = swap_for_a_link_at_the_first_write(monkeypatch, authority.path, relative, outside, temporary)
        try:
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        except MwpError:
            pass
        monkeypatch.undo()
        assert swapped and files_below(outside) == []


@pytest.mark.parametrize(("relative", "call"), [("keys", "create"), ("keys", "rotate"), ("keys/retired", "retire")])
def test_a_key_directory_replaced_by_a_link_after_its_check_is_not_written_through(tmp_path, monkeypatch, relative, call):
    """``keys/`` (finding 158) was checked, then the seed, the rotated seed or the retired public
    key written by path: a link put in place of ``keys/`` or ``keys/retired/`` between the two
    received the secret. They are now written through the directories the check opened."""
    outside = tmp_path / "outside"
    outside.mkdir()
    with open_with_group(str(tmp_path / "s")) as authority:
        keys = os.path.join(authority.path, "keys")
        if call == "create":
            os.mkdir(keys, 0o700)
            name = _TEMP.format(r"snapshot-signing\.key")
        else:
            authority.rotate_signing_key()  # the key, and keys/retired with a key in it
            name = _TEMP.format(r"snapshot-signing\.key" if call == "rotate" else r"[0-9a-f]+\.pub")
        swapped = swap_for_a_link_at_the_first_write(monkeypatch, authority.path, relative, outside, name)
        if call == "create":
            key = authority.signing_key
        else:
            key = authority.rotate_signing_key(retire=call == "retire")
        monkeypatch.undo()
        assert swapped and files_below(outside) == []
        if call != "retire":
            with open(os.path.join(authority.path, "keys.moved", "snapshot-signing.key"), "rb") as handle:
                assert SigningKey.from_seed(handle.read()).key_id == key.key_id


def test_a_file_key_provider_org_directory_replaced_by_a_link_after_its_check_is_not_written_through(tmp_path, monkeypatch):
    """``FileKeyProvider.rotate`` checked ``<directory>/<org>`` and wrote the key and ``CURRENT``
    by path: a link put there in between received both."""
    provider = FileKeyProvider(str(tmp_path / "org-keys"))
    provider.current_key("acme")
    outside = tmp_path / "outside"
    outside.mkdir()
    swapped = swap_for_a_link_at_the_first_write(monkeypatch, str(tmp_path / "org-keys"), "acme", outside, _TEMP.format(r"[0-9a-f]{16}\.key"))
    key_id = provider.rotate("acme")
    monkeypatch.undo()
    assert swapped and files_below(outside) == []
    moved = tmp_path / "org-keys" / "acme.moved"
    assert (moved / f"{key_id}.key").stat().st_size == 32 and (moved / "CURRENT").read_bytes() == key_id.encode()


@pytest.mark.parametrize("linked", ["directory", "file"])
def test_a_snapshot_is_never_reserved_through_a_link_below_the_store(tmp_path, linked):
    """``read_snapshot`` re-serves the store's own files (to agents restoring, to ``verify``): a
    link put in place of ``snapshots/<group>`` made it serve whatever the link named. It is
    ``STORAGE_FAILED`` (``ELOOP``) naming the link in its message and in ``detail`` ``path``; so
    is a link in place of the snapshot file."""
    import shutil

    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        ref = authority.snapshot(GROUP)
        directory = os.path.join(authority.path, "snapshots", GROUP)
        if linked == "file":
            directory = os.path.join(authority.path, ref.location)
        shutil.move(directory, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", directory)
        with pytest.raises(StorageFailed) as caught:
            authority.read_snapshot(ref)
        assert caught.value.detail["errno"] == errno.ELOOP and directory in str(caught.value)
        assert caught.value.detail["path"] == directory


def test_shred_never_deletes_through_a_link_in_place_of_the_org_directory(tmp_path):
    """``shred`` deleted by path: with ``<org>/`` a link, it deleted the key file of that name
    wherever the link pointed, and answered True. It is ``KEY_FILE_INVALID`` (``type``) and
    nothing is deleted."""
    from mwpstore.errors import KeyFileInvalid

    provider = FileKeyProvider(str(tmp_path / "org-keys"))
    key_id, _ = provider.current_key("acme")
    os.rename(tmp_path / "org-keys" / "acme", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "org-keys" / "acme")
    with pytest.raises(KeyFileInvalid) as caught:
        provider.shred("acme", key_id)
    assert caught.value.detail["reason"] == "type"
    assert (tmp_path / "elsewhere" / f"{key_id}.key").stat().st_size == 32


@pytest.mark.parametrize("removal", ["audit log", "unrecorded snapshot", "signing key copy"])
def test_a_removal_never_deletes_through_a_link_below_the_store(tmp_path, removal):
    """The deletion of an audit log (``audit.delete``), the open's sweep of unrecorded snapshot
    files and its sweep of the signing key's temporary copies deleted by path: with
    ``archive/<group>``, ``snapshots/<group>`` or ``keys`` a link, they deleted the files of those
    names wherever it pointed. They go through descriptors opened from the store down: the files
    the link names stay."""
    import shutil

    from mwpstore import MwpError

    path = str(tmp_path / "s")
    if removal == "signing key copy":
        with open_with_group(path) as authority:
            authority.signing_key  # noqa: B018 - makes keys/
        elsewhere = tmp_path / "elsewhere"
        os.rename(os.path.join(path, "keys"), elsewhere)
        os.symlink(elsewhere, os.path.join(path, "keys"))
        (elsewhere / f".{SIGNING_KEY_NAME}.key.{'0' * 16}.tmp").write_bytes(b"another writer's seed in mid-write")
        kept = files_below(elsewhere)
        Authority.open(path).close()  # its sweep of what a killed rotation left
        assert files_below(elsewhere) == kept
        return
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        if removal == "audit log":
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        else:
            authority.snapshot(GROUP)
        relative = f"archive/{GROUP}" if removal == "audit log" else f"snapshots/{GROUP}"
        directory = os.path.join(path, relative)
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(directory, elsewhere)
        if removal == "unrecorded snapshot":
            (elsewhere / f"{99:020d}.snap").write_bytes(b"no record names this name")
        os.rename(directory, tmp_path / "moved")
        os.symlink(elsewhere, directory)
        kept = files_below(elsewhere)
        if removal == "audit log":
            try:  # the Event is durable; the removal refused: STORAGE_FAILED, reopen (it is not done through the link then either)
                authority.delete_audit_log(GROUP, actor=OWNER, action_id="delete", basis="legal")
            except MwpError as exc:
                assert exc.detail["errno"] == errno.ELOOP and exc.detail["path"] == directory
        else:
            authority._sweep_unrecorded_snapshots()  # what an open after a crash runs
        assert files_below(elsewhere) == kept


def test_key_directories_made_through_their_own_paths_are_created_durably(tmp_path, synced_directories):
    """A key directory a caller names (``SigningKey.load_or_create``'s, a ``FileKeyProvider``'s
    ``<org>/``) made where its parent already exists is synced in that parent: a key created in
    it must survive a power loss, which may otherwise take the new directory and the key with it."""
    (tmp_path / "k").mkdir()
    SigningKey.load_or_create(str(tmp_path / "k" / "keys"))
    provider = FileKeyProvider(str(tmp_path / "org-keys"))
    provider.current_key("acme")
    assert str(tmp_path / "k") in synced_directories
    assert str(tmp_path / "org-keys") in synced_directories


@pytest.mark.parametrize("refusal", ["link", "file", "owner"])
def test_a_refusal_on_the_way_down_holds_no_directory_open(tmp_path, refusal):
    """A directory met on the way from the store down that is refused (a link, a file, another
    user's key directory) closes every descriptor opened above it: the refusal, repeated, holds
    nothing open."""
    from mwpstore import MwpError

    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        authority.snapshot(GROUP)
        keys = tmp_path / "s" / "keys"
        if refusal == "link":
            os.rename(keys, tmp_path / "moved")
            os.symlink(tmp_path / "moved", keys)
        elif refusal == "file":
            os.rename(keys, tmp_path / "moved")
            keys.write_bytes(b"")
        else:
            if os.geteuid() != 0:
                pytest.skip("giving a directory to another user needs root")
            os.chown(keys, 65534, 65534)
        held = len(os.listdir("/proc/self/fd"))  # counted: the store holds its own directory open already
        for _ in range(3):
            with pytest.raises(MwpError):
                authority.rotate_signing_key()
        assert len(os.listdir("/proc/self/fd")) == held


@pytest.mark.parametrize("interrupted", [1, 2], ids=["first-parent", "second-parent"])
def test_an_interrupt_as_a_parent_directory_closes_on_the_way_down_holds_nothing_open(tmp_path, monkeypatch, interrupted):
    """``open_below`` closes each directory once its child is open. An interrupt arriving as that
    close returns (the descriptor closed, then KeyboardInterrupt) closes the child too: it used to
    be left open, known only to the loop, for as long as the process lived."""
    from authority_helpers import store_files_held

    (tmp_path / "root" / "a" / "b").mkdir(parents=True)
    real_close = os.close
    closes = []

    def close(fd: int) -> None:
        real_close(fd)
        closes.append(fd)
        if len(closes) == interrupted:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(KeyboardInterrupt):
        _files.open_below(str(tmp_path / "root"), "a/b", create=False)
    monkeypatch.undo()
    assert store_files_held(str(tmp_path / "root")) == []


@pytest.mark.parametrize("relative", [".", "..", "a/..", "a/../..", "./a", "a/."])
def test_the_walk_down_refuses_a_name_that_is_no_step_down(tmp_path, relative):
    """``open_below`` walks from its root down only: a name ``.`` or ``..`` (it used to open the
    directory it stood in, or walk up to its parent) is ``InvalidCommand`` (field ``relative``),
    before anything is opened or made; ``open_child`` given one refuses it the same way."""
    from authority_helpers import store_files_held

    base = tmp_path / "base"  # tmp_path holds the autouse fixture's log
    root = base / "root"
    (root / "a").mkdir(parents=True)
    for create in (True, False):
        with pytest.raises(InvalidCommand) as caught:
            _files.open_below(str(base / "new"), relative, create=create)
        assert caught.value.detail["field"] == "relative"
        with pytest.raises(InvalidCommand):
            _files.open_below(str(root), relative, create=create)
    with _files.open_directory(str(root)) as held:
        for name in (".", ".."):
            with pytest.raises(InvalidCommand):
                _files.open_child(held, name)
    assert os.listdir(base) == ["root"] and os.listdir(root) == ["a"]
    assert store_files_held(str(base)) == []


def test_a_store_whose_archive_directory_is_a_link_opens_and_deletes_nothing_through_it(tmp_path):
    """The open's finishing of audit-log deletions passes over ``archive/`` as a symbolic link
    (left for an open once it is a directory again): the store opens, and what the link names,
    an audit log whose ``audit.delete`` is durable included, stays."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.archive(GROUP, actor=OWNER, action_id="archive")
        authority.accept(group_create("g-2"))
    archive = os.path.join(path, "archive")
    os.rename(archive, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", archive)
    kept = files_below(tmp_path / "elsewhere")
    with Authority.open(path) as authority:
        assert authority.head("g-2")[0] == 1
    assert files_below(tmp_path / "elsewhere") == kept


def test_a_public_key_file_that_is_a_link_is_replaced_never_written_through(tmp_path):
    """``<name>.pub`` as a symbolic link is neither read nor written through: the rename that
    rewrites it replaces the link, and the file it named is unchanged."""
    keys = tmp_path / "keys"
    key = SigningKey.load_or_create(str(keys))
    outside = tmp_path / "outside.pub"
    outside.write_bytes(b"not this store's key\n")
    os.remove(keys / "snapshot-signing.pub")
    os.symlink(outside, keys / "snapshot-signing.pub")
    assert SigningKey.load_or_create(str(keys)).public_key == key.public_key
    assert not (keys / "snapshot-signing.pub").is_symlink()
    assert (keys / "snapshot-signing.pub").read_bytes() == key.public_key.hex().encode() + b"\n"
    assert outside.read_bytes() == b"not this store's key\n"


@pytest.mark.parametrize("obstacle", ["other owner", "mode 0777"])
def test_a_file_key_provider_org_directory_found_in_place_is_used_only_if_private(tmp_path, obstacle):
    """A provider of one's own checks ``<org>/`` as a store checks its key directories before a
    key is written in it: another user's is ``KEY_FILE_INVALID`` (``owner``) with nothing
    written; one of this user's with group or other bits is made 0700."""
    if obstacle == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    from mwpstore.errors import KeyFileInvalid

    org = tmp_path / "org-keys" / "acme"
    org.mkdir(parents=True)
    provider = FileKeyProvider(str(tmp_path / "org-keys"))
    if obstacle == "mode 0777":
        org.chmod(0o777)
        provider.rotate("acme")
        assert stat.S_IMODE(org.stat().st_mode) == 0o700
        return
    os.chown(org, 65534, 65534)
    with pytest.raises(KeyFileInvalid) as caught:
        provider.rotate("acme")
    assert caught.value.detail["reason"] == "owner" and caught.value.detail["path"] == str(org)
    assert os.listdir(org) == []


@pytest.mark.parametrize("removal", ["open's sweep", "failed snapshot"])
def test_an_unrecorded_snapshot_file_is_removed_durably(tmp_path, fsynced, removal):
    """A snapshot file no record names, removed by the open's sweep or by the ``snapshot`` whose
    note was refused, is removed with its directory synced after the unlink: else a power loss
    brings it back, for the next sweep to find again."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        directory = tmp_path / "s" / "snapshots" / GROUP
        if removal == "open's sweep":
            authority.snapshot(GROUP)
            unrecorded = directory / f"{99:020d}.snap"
            unrecorded.write_bytes(b"no record names this name")
            del fsynced[:]
            authority._sweep_unrecorded_snapshots()
        else:
            unrecorded = directory / f"{2:020d}.snap"

            def refused(*_: object) -> None:
                del fsynced[:]  # the file is written and synced: what follows is the removal's
                raise LimitExceeded("refused before it reached the log", field="note")

            authority._log_note = refused
            with pytest.raises(LimitExceeded):
                authority.snapshot(GROUP)
        assert not unrecorded.exists() and _identity(directory) in fsynced
