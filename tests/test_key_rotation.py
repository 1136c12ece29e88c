"""Rotating the snapshot signing key: what the old key signed keeps verifying, nothing is signed
with it again, a crash mid-rotation leaves a usable key, and the retired keys are checked like the
key itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from authority_helpers import GROUP, OWNER, mission_create, open_with_group
from mwpstore import Authority, Command, InvalidCommand, MwpError
from mwpstore._files import KeyFileInvalid
from mwpstore.snapshot import RETIRED_DIRECTORY, SigningKey, key_id_of, retired_public_keys, verify_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _keys(authority: Authority) -> str:
    return os.path.join(authority.path, "keys")


def _pub_file(directory: str) -> bytes:
    with open(os.path.join(directory, "snapshot-signing.pub"), "rb") as handle:
        return handle.read()


def test_rotation_keeps_old_snapshots_and_archives_verifying_and_signs_new_ones_with_the_new_key(tmp_path):
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(Command(actor=OWNER, action_id="g2", group="g-2", kind="group.create", target="g-2", body={"org": "acme"}))
        authority.accept(mission_create("m-1"))
        old_ref = authority.snapshot(GROUP)
        record = authority.archive("g-2", actor=OWNER, action_id="archive")
        old = authority.signing_key
        assert old_ref.key_id == old.key_id == record.final_snapshot.key_id

        new = authority.rotate_signing_key()

        assert new.key_id != old.key_id and authority.signing_key is new
        assert _pub_file(_keys(authority)) == new.public_key.hex().encode() + b"\n"
        assert retired_public_keys(_keys(authority)) == [old.public_key]
        assert set(authority.keyring().key_ids) == {old.key_id, new.key_id}
        authority.accept(mission_create("m-2"))
        new_ref = authority.snapshot(GROUP)
        assert new_ref.key_id == new.key_id
        for ref in (old_ref, new_ref):
            assert verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), group=GROUP).seq == ref.seq
        assert authority.verify().ok  # the old snapshot and the archive's final snapshot still verify
    with Authority.open(path) as authority:  # both keys are on disk, nothing lives only in memory
        assert authority.signing_key.key_id == new.key_id
        assert set(authority.keyring().key_ids) == {old.key_id, new.key_id}
        assert authority.verify().ok


def test_rotation_without_retiring_drops_the_old_key_and_verify_names_what_it_signed(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(Command(actor=OWNER, action_id="g2", group="g-2", kind="group.create", target="g-2", body={"org": "acme"}))
        authority.accept(mission_create("m-1"))
        old_ref = authority.snapshot(GROUP)
        record = authority.archive("g-2", actor=OWNER, action_id="archive")
        old = authority.signing_key
        new = authority.rotate_signing_key(retire=False)
        assert authority.keyring().key_ids == [new.key_id]
        assert retired_public_keys(_keys(authority)) == []
        problems = sorted(authority.verify().problems)
        assert len(problems) == 3, problems  # the Group's snapshot, the archive's final snapshot, its audit log
        assert problems[0].startswith(f"audit log {record.audit_location}: SNAPSHOT_INVALID (key)")
        assert problems[1].startswith(f"snapshot {old_ref.location}: SNAPSHOT_INVALID (key)")
        assert problems[2].startswith(f"snapshot {record.final_snapshot.location}: SNAPSHOT_INVALID (key)")
        authority.accept(mission_create("m-2"))
        assert authority.snapshot(GROUP).key_id == new.key_id != old.key_id


def test_a_retired_key_found_compromised_later_can_be_dropped(tmp_path):
    """A key retired by a rotation stays trusted; once it turns out compromised, dropping it makes
    what it signed fail ``verify`` (and any keyring from the store), durably; a new snapshot at the
    same head is signed with the current key."""
    from mwpstore.errors import NotFound, SnapshotInvalid, StoreClosed

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        old_ref = authority.snapshot(GROUP)
        old = authority.signing_key
        new = authority.rotate_signing_key()
        assert sorted(authority.keyring().key_ids) == sorted([old.key_id, new.key_id]) and authority.verify().ok
        for bad in ("", "XYZ", old.key_id.upper(), old.key_id + "0", "../" + old.key_id[3:], 5, None):
            with pytest.raises(InvalidCommand):
                authority.drop_retired_key(bad)
        with pytest.raises(NotFound):
            authority.drop_retired_key(new.key_id)  # the current key is not retired
        authority.drop_retired_key(old.key_id)
        assert authority.keyring().key_ids == [new.key_id]
        with pytest.raises(SnapshotInvalid):
            verify_snapshot(authority.read_snapshot(old_ref), keyring=authority.keyring(), group=GROUP)
        problems = authority.verify().problems
        assert len(problems) == 1 and problems[0].startswith(f"snapshot {old_ref.location}: SNAPSHOT_INVALID (key)")
        with pytest.raises(NotFound):
            authority.drop_retired_key(old.key_id)
        ref = authority.snapshot(GROUP)
        assert ref.seq == old_ref.seq and ref.key_id == new.key_id
    with Authority.open(path) as authority:
        assert authority.keyring().key_ids == [new.key_id]
        assert retired_public_keys(_keys(authority)) == []
    with pytest.raises(StoreClosed):
        authority.drop_retired_key(new.key_id)


@pytest.mark.parametrize("retire", [True, False])
def test_a_snapshot_at_an_unchanged_head_is_signed_again_with_the_new_key(tmp_path, retire):
    with open_with_group(str(tmp_path / "s")) as authority:
        old_ref = authority.snapshot(GROUP)
        new = authority.rotate_signing_key(retire=retire)
        ref = authority.snapshot(GROUP)  # the head has not moved since the old key signed it
        assert ref.seq == old_ref.seq and ref.key_id == new.key_id and ref.location != old_ref.location
        verified = verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), group=GROUP)
        assert verified.seq == ref.seq
        assert authority.snapshots(GROUP) == [ref] and authority.snapshot(GROUP) == ref  # reused from now on
        if retire:  # the old file is still there and still verifies with the retired key
            verify_snapshot(authority.read_snapshot(old_ref), keyring=authority.keyring(), group=GROUP)
        authority.rebuild()
        assert authority.snapshots(GROUP) == [ref]
        # a reference naming any other file, or a key id that is not one, is refused
        for location in (ref.location.replace(new.key_id, "0" * 16), "snapshots/g-1/../../keys/x.snap"):
            with pytest.raises(InvalidCommand):
                authority.read_snapshot({**ref.to_dict(), "location": location})
        with pytest.raises(InvalidCommand):
            authority.read_snapshot({**ref.to_dict(), "key_id": "../../keys", "location": "snapshots/g-1/00000000000000000001-../../keys.snap"})


def test_rotating_twice_trusts_every_retired_key(tmp_path):
    directory = str(tmp_path / "keys")
    first = SigningKey.load_or_create(directory)
    second = SigningKey.rotate(directory)
    third = SigningKey.rotate(directory)
    assert len({first.key_id, second.key_id, third.key_id}) == 3
    assert sorted(retired_public_keys(directory)) == sorted([first.public_key, second.public_key])
    assert SigningKey.load_or_create(directory).key_id == third.key_id
    assert oct(os.stat(os.path.join(directory, RETIRED_DIRECTORY)).st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("first_use", ["signing_key", "rotate_signing_key", "archive"])
def test_the_directories_an_authority_makes_for_its_keys_are_private(tmp_path, first_use):
    """``keys/`` (the snapshot signing key's seed) and ``keys/orgs/<org>/`` (an Organization's
    audit-log keys) are made mode 0700, whichever call makes them first: the files in them are
    secrets (0600), and their names say which keys the store holds."""
    with open_with_group(str(tmp_path / "s")) as authority:
        if first_use == "signing_key":
            authority.signing_key
        elif first_use == "rotate_signing_key":
            authority.rotate_signing_key()
        else:
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        made = ["keys"] + (["keys/orgs", f"keys/orgs/{authority.state(GROUP, f'group:{GROUP}')[1]['org']}"] if first_use == "archive" else [])
        for relative in made:
            assert oct(os.stat(os.path.join(authority.path, relative)).st_mode & 0o777) == "0o700", relative


def _make_key_directory_used(authority: Authority, directory: str) -> None:
    """The first call that writes a key into ``directory`` (relative to the store)."""
    if directory == "keys":
        authority.signing_key  # noqa: B018
    elif directory == "keys/retired":
        authority.rotate_signing_key()
    else:
        authority.archive(GROUP, actor=OWNER, action_id="archive")


@pytest.mark.parametrize("obstacle", ["symlink", "other owner", "mode 0777"])
@pytest.mark.parametrize("directory", ["keys", "keys/retired", "keys/orgs", "keys/orgs/acme"])
def test_a_key_directory_found_in_place_is_used_only_if_it_is_private(tmp_path, directory, obstacle):
    """A key directory that is already there when a key is written into it: a symbolic link (the
    seed, or an Organization's key, was written wherever it pointed, outside the store) or one
    owned by another user is ``KEY_FILE_INVALID`` naming it, with nothing written; one of this
    user's with group or other permission bits is made 0700 before any key is written in it."""
    if obstacle == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        if directory == "keys/retired":
            authority.signing_key  # noqa: B018 - keys/ made and checked as the store makes it
    target = os.path.join(path, directory)
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    if obstacle == "symlink":
        os.symlink(outside, target)
    else:
        os.mkdir(target, 0o700)
        if obstacle == "other owner":
            os.chown(target, 65534, 65534)
        else:
            os.chmod(target, 0o777)
    with Authority.open(path) as authority:
        if obstacle == "mode 0777":
            _make_key_directory_used(authority, directory)
            assert oct(os.stat(target).st_mode & 0o777) == "0o700"
            assert authority.verify().ok
            return
        with pytest.raises(KeyFileInvalid) as caught:
            _make_key_directory_used(authority, directory)
    assert caught.value.detail["path"] == target and caught.value.detail["reason"] == ("type" if obstacle == "symlink" else "owner")
    assert os.listdir(outside) == []
    assert obstacle == "symlink" or os.listdir(target) == []


def test_an_organizations_key_is_not_written_through_a_link_at_keys(tmp_path):
    """keys/ is the top of the chain an Organization's key directory is checked along, and is
    checked as a link too (only a key provider's own directory, given by its caller, may be
    reached through one): a link there, the archive's key is refused with nothing written."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    os.symlink(outside, os.path.join(path, "keys"))
    with Authority.open(path) as authority:
        with pytest.raises(KeyFileInvalid) as caught:
            _make_key_directory_used(authority, "keys/orgs/acme")
    assert caught.value.detail["path"] == os.path.join(path, "keys") and caught.value.detail["reason"] == "type"
    assert not os.path.exists(outside / "orgs")


CHILD_ROTATE = """
import sys
from mwpstore import Authority
with Authority.open(sys.argv[1]) as authority:
    print(authority.signing_key.key_id, flush=True)
    authority.rotate_signing_key()
"""


def _rotation_killed_at(path: str, failpoint: str):
    """A snapshot signed, then a child process's rotation killed at ``failpoint``: (the snapshot's
    reference, the key id the child signed with)."""
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        ref = authority.snapshot(GROUP)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO, MWPSTORE_FAILPOINT=failpoint)
    result = subprocess.run([sys.executable, "-c", CHILD_ROTATE, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    return ref, result.stdout.split()[0]


def test_a_crash_after_retiring_leaves_the_old_key_current_and_rotation_can_run_again(tmp_path):
    path = str(tmp_path / "s")
    ref, old_id = _rotation_killed_at(path, "keys.after_retire")
    with Authority.open(path) as authority:
        assert authority.signing_key.key_id == old_id == ref.key_id  # not replaced: still signs
        assert authority.keyring().key_ids == [old_id]  # retired and current: the same key, trusted once
        assert authority.verify().ok
        new = authority.rotate_signing_key()
        assert set(authority.keyring().key_ids) == {old_id, new.key_id}
        assert authority.verify().ok


def test_the_seed_a_rotation_killed_before_its_rename_left_is_removed_at_the_next_open(tmp_path):
    """The second atomic write of a rotation is the new seed (the first retires the old public
    key): killed after writing it and before the rename, the seed stays in a temporary file, a
    secret that never became the key. The next open removes it; the old key is still current."""
    path = str(tmp_path / "s")
    ref, old_id = _rotation_killed_at(path, "files.before_rename:2")
    keys = os.path.join(path, "keys")
    left = [name for name in os.listdir(keys) if name.startswith(".snapshot-signing.key.") and name.endswith(".tmp")]
    assert len(left) == 1  # the kill came in that window
    with Authority.open(path) as authority:
        assert sorted(os.listdir(keys)) == [RETIRED_DIRECTORY, "snapshot-signing.key", "snapshot-signing.pub"]
        assert authority.signing_key.key_id == old_id == ref.key_id
        assert authority.verify().ok


def test_only_temporary_files_of_the_signing_key_are_removed_at_open(tmp_path, synced_directories):
    """What open removes is exactly ``.snapshot-signing.key.<16 hex>.tmp``, durably (``keys/``
    synced after): other names beside it stay, and a directory under that name is no write of the
    store's and is left alone."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.signing_key  # noqa: B018 - creates keys/
    keys = os.path.join(path, "keys")
    kept = [".snapshot-signing.key.0123456789abcdeg.tmp", ".snapshot-signing.key.0123456789abcde.tmp",
            ".snapshot-signing.pub.0123456789abcdef.tmp", "snapshot-signing.key.0123456789abcdef.tmp"]
    for name in kept:
        with open(os.path.join(keys, name), "wb") as file:
            file.write(b"x")
    os.mkdir(os.path.join(keys, ".snapshot-signing.key.fedcba9876543210.tmp"))
    removed = os.path.join(keys, ".snapshot-signing.key.0123456789abcdef.tmp")
    with open(removed, "wb") as file:
        file.write(b"s" * 32)
    # a copy's name held by a link to a file outside, or by a FIFO: the name goes, what a link
    # names stays, and nothing waits on the FIFO
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the store's")
    as_link = os.path.join(keys, ".snapshot-signing.key.1111111111111111.tmp")
    os.symlink(outside, as_link)
    as_fifo = os.path.join(keys, ".snapshot-signing.key.2222222222222222.tmp")
    os.mkfifo(as_fifo)
    synced_directories.clear()
    with Authority.open(path):
        assert not any(os.path.lexists(name) for name in (removed, as_link, as_fifo))
        assert outside.read_bytes() == b"not the store's"
        assert os.path.abspath(keys) in synced_directories
        assert all(os.path.exists(os.path.join(keys, name)) for name in kept)
        assert os.path.isdir(os.path.join(keys, ".snapshot-signing.key.fedcba9876543210.tmp"))


@pytest.mark.parametrize("obstacle", ["fifo", "file"])
def test_a_fifo_or_a_file_in_place_of_the_key_directory_is_left_to_the_keys_use(tmp_path, obstacle):
    """The open's sweep of the signing key's temporary copies passes over ``keys/`` that is a FIFO
    or a file (it neither waits on the FIFO nor removes anything): the open goes through, and the
    key's first use refuses it (``KEY_FILE_INVALID`` reason ``type``, naming ``keys``)."""
    from blocking import outcome_within

    path = str(tmp_path / "s")
    open_with_group(path).close()
    keys = os.path.join(path, "keys")
    if obstacle == "fifo":
        os.mkfifo(keys)
    else:
        with open(keys, "wb") as file:
            file.write(b"x")
    authority = outcome_within(10, lambda: Authority.open(path))
    with authority:
        with pytest.raises(KeyFileInvalid) as caught:
            authority.rotate_signing_key()
    assert caught.value.detail["reason"] == "type" and caught.value.detail["path"] == keys
    assert not os.path.isdir(keys)


def test_a_keys_path_that_is_no_directory_does_not_stop_the_open(tmp_path):
    """The sweep of killed key writes is housekeeping: a ``keys`` that is a file opens as it did
    before the sweep existed, and the key's first use reports it."""
    path = str(tmp_path / "s")
    with open_with_group(path):
        pass
    with open(os.path.join(path, "keys"), "wb") as file:
        file.write(b"not a directory")
    with Authority.open(path) as authority:
        assert authority.head(GROUP)[0] >= 1
        with pytest.raises(MwpError):
            authority.signing_key  # noqa: B018


def _retired_dir_with_one_key(tmp_path) -> tuple[str, str, SigningKey]:
    directory = str(tmp_path / "keys")
    old = SigningKey.load_or_create(directory)
    SigningKey.rotate(directory)
    retired = os.path.join(directory, RETIRED_DIRECTORY)
    return directory, os.path.join(retired, f"{old.key_id}.pub"), old


def test_a_retired_key_file_is_checked_like_the_key_itself(tmp_path):
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    assert retired_public_keys(directory) == [old.public_key]

    os.chmod(path, 0o644)  # anyone who can widen the mode could have changed the key
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "mode"
    os.chmod(path, 0o600)

    other = SigningKey.generate()  # a key under another key's name
    with open(path, "wb") as handle:
        handle.write(other.public_key.hex().encode() + b"\n")
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "content"

    os.remove(path)
    os.symlink(os.path.join(directory, "snapshot-signing.pub"), path)
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "type"


def test_stray_files_in_the_retired_directory_are_refused_but_interrupted_writes_are_skipped(tmp_path):
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    retired = os.path.dirname(path)
    with open(os.path.join(retired, f".{old.key_id}.pub.0123456789abcdef.tmp"), "wb") as handle:
        handle.write(b"half")  # what a crash during write_file_atomic leaves
    assert retired_public_keys(directory) == [old.public_key]
    with open(os.path.join(retired, "notes.txt"), "wb") as handle:
        handle.write(b"x")
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "name"


def test_a_retired_file_with_bytes_that_are_not_a_key_is_refused(tmp_path):
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    with open(path, "wb") as handle:
        handle.write(b"z" * 64 + b"\n")
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "content"
    with open(path, "wb") as handle:
        handle.write(b"ab" * 40)  # the wrong size
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "size"
    assert key_id_of(old.public_key) == os.path.basename(path)[:16]


def test_a_retired_file_holding_a_small_order_key_is_refused(tmp_path):
    """A key for which one fixed signature verifies everything is never trusted, even when its
    file is well-formed and named by its key id."""
    directory, path, _ = _retired_dir_with_one_key(tmp_path)
    identity = (1).to_bytes(32, "little")
    os.remove(path)
    forged = os.path.join(os.path.dirname(path), f"{key_id_of(identity)}.pub")
    with open(os.open(forged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write(identity.hex().encode() + b"\n")
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "content"


def test_rotating_a_closed_authority_is_refused(tmp_path):
    authority = open_with_group(str(tmp_path / "s"))
    authority.close()
    with pytest.raises(Exception) as caught:
        authority.rotate_signing_key()
    assert caught.value.code == "STORE_CLOSED"


# -- The retired-key trust store, one promise each --------------------------------------------------


def test_rotation_syncs_the_key_directory_before_replacing_the_key(tmp_path, synced_directories, monkeypatch):
    """A ``retired/`` directory left by a crash between its ``mkdir`` and the sync of its parent is
    made durable by the next rotation before the key file is replaced: otherwise a power loss
    could keep the new key and lose the directory holding the retired one."""
    directory = str(tmp_path / "keys")
    SigningKey.load_or_create(directory)
    os.mkdir(os.path.join(directory, RETIRED_DIRECTORY), 0o700)
    synced_directories.clear()
    real_replace = os.replace

    def recording(src, dst, **where):
        synced_directories.append(f"replace {os.path.basename(dst)}")
        real_replace(src, dst, **where)

    monkeypatch.setattr(os, "replace", recording)
    SigningKey.rotate(directory)
    replaced = synced_directories.index("replace snapshot-signing.key")
    assert os.path.abspath(directory) in synced_directories[:replaced]


def test_dropping_a_retired_key_syncs_the_retired_directory(tmp_path, synced_directories):
    """``drop_retired_key`` deletes durably: the ``retired/`` directory is fsynced after the unlink."""
    from mwpstore.snapshot import drop_retired_key

    directory, path, old = _retired_dir_with_one_key(tmp_path)
    synced_directories.clear()
    drop_retired_key(directory, old.key_id)
    assert not os.path.exists(path)
    assert os.path.dirname(os.path.abspath(path)) in synced_directories


def test_a_retired_directory_that_is_a_symbolic_link_is_refused(tmp_path):
    """``retired/`` itself must not be a symbolic link: the trust store would be read from
    wherever it points."""
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    retired = os.path.dirname(path)
    elsewhere = str(tmp_path / "elsewhere")
    os.rename(retired, elsewhere)
    os.symlink(elsewhere, retired)
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "type"


@pytest.mark.parametrize("stray", ["notes.tmp", ".hidden", "{key_id}-copy.pub", "{key_id}.pub.pub", "{key_id}.PUB"])
def test_only_interrupted_writes_are_skipped_in_the_retired_directory(tmp_path, stray):
    """Only ``.<name>.tmp`` files are skipped; a name that only ends in ``.tmp`` or only starts
    with a dot, or a ``.pub`` file not named exactly ``<key id>.pub`` (even holding that key), is
    refused (reason ``name``)."""
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    with open(path, "rb") as handle:
        line = handle.read()
    name = stray.format(key_id=old.key_id)
    with open(os.open(os.path.join(os.path.dirname(path), name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write(line)
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "name"


def test_a_retired_key_in_uppercase_hex_is_refused(tmp_path):
    """A retired file holds exactly the 65 bytes ``rotate`` writes (lowercase hex, newline): the
    same key spelled in uppercase is refused (reason ``content``)."""
    directory, path, old = _retired_dir_with_one_key(tmp_path)
    with open(path, "wb") as handle:
        handle.write(old.public_key.hex().upper().encode() + b"\n")
    with pytest.raises(KeyFileInvalid) as caught:
        retired_public_keys(directory)
    assert caught.value.detail["reason"] == "content"


def test_retired_keys_are_listed_by_key_id_and_one_removed_meanwhile_is_skipped(tmp_path, monkeypatch):
    """``retired_public_keys`` lists the keys in key-id order; a file removed between the listing
    and its read is skipped and the others are still returned."""
    from mwpstore import snapshot as snapshot_module

    directory = str(tmp_path / "keys")
    keys = [SigningKey.load_or_create(directory)]
    for _ in range(3):
        SigningKey.rotate(directory)
        keys.append(SigningKey.load_or_create(directory))
    retired = sorted(keys[:3], key=lambda key: key.key_id)
    assert retired_public_keys(directory) == [key.public_key for key in retired]

    real = snapshot_module.read_secret_at
    first = os.path.join(directory, RETIRED_DIRECTORY, f"{retired[0].key_id}.pub")
    monkeypatch.setattr(
        snapshot_module, "read_secret_at", lambda retired, name, size: None if retired.join(name) == first else real(retired, name, size)
    )
    assert retired_public_keys(directory) == [key.public_key for key in retired[1:]]


def test_a_rotation_that_fails_after_replacing_the_key_never_signs_with_the_old_one(tmp_path, monkeypatch):
    """If ``rotate_signing_key`` fails after the new seed replaced the key file (here: rewriting
    ``snapshot-signing.pub`` fails), the Authority does not keep signing with the old key it had
    cached: the next use reads the key file, so snapshots are signed with the new key."""
    from mwpstore import snapshot as snapshot_module
    from mwpstore.errors import StorageFailed

    with open_with_group(str(tmp_path / "s")) as authority:
        old = authority.signing_key
        real = snapshot_module.write_file_at

        def failing(directory, name, data, *, mode=0o600):
            if name == "snapshot-signing.pub":
                raise StorageFailed("injected")
            return real(directory, name, data, mode=mode)

        monkeypatch.setattr(snapshot_module, "write_file_at", failing)
        with pytest.raises(StorageFailed):
            authority.rotate_signing_key()
        monkeypatch.undo()
        with open(os.path.join(_keys(authority), "snapshot-signing.key"), "rb") as handle:
            on_disk = SigningKey.from_seed(handle.read())
        assert on_disk.key_id != old.key_id
        assert authority.signing_key.key_id == on_disk.key_id
        assert authority.snapshot(GROUP).key_id == on_disk.key_id
