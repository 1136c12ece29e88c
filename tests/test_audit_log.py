"""Encrypted audit logs: round trip, Organization keys, tampering, reordering, truncation, splicing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys

import blake3
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from authority_helpers import store_files_held
from blocking import outcome_within
from mwpstore._files import KeyFileInvalid, makedirs_durable
from mwpstore import limits
from mwpstore.audit_log import (
    FRAME_BYTES,
    TAG_BYTES,
    _FRAME,
    _HEADER,
    AuditLogInfo,
    FileKeyProvider,
    read_audit_log,
    read_audit_log_header,
    read_audit_log_header_checked,
    verify_audit_log_against_snapshot,
    write_audit_log,
)
from mwpstore.errors import ArchiveInvalid, InvalidCommand, StorageFailed
from mwpstore.messages import ZERO_HASH, Command, encode_event, recompute_event_hash
from mwpstore.registry import MemoryGroup
from mwpstore.snapshot import Keyring, SigningKey, aggregates_from, create_snapshot, verify_snapshot

SIGNER = SigningKey.from_seed(bytes(range(32)))
KEYRING = Keyring([SIGNER.public_key])
CHUNK = 256


def make_group(group: str = "g1", org: str = "acme", missions: int = 30, title_chars: int = 20) -> MemoryGroup:
    memory = MemoryGroup(group)
    memory.accept(
        Command(actor="alice", action_id="a0", group=group, kind="group.create", target=group, body={"org": org}),
        now_ms=1000,
    )
    for index in range(missions):
        memory.accept(
            Command(
                actor="alice",
                action_id=f"m{index}",
                group=group,
                kind="mission.create",
                target=f"mission-{index}",
                body={"title": f"{index}" + "x" * title_chars},
            ),
            now_ms=1001 + index,
        )
    if missions:
        memory.accept(
            Command(
                actor="alice",
                action_id="close",
                group=group,
                kind="mission.close",
                target="mission-0",
                body={"reason": "done"},
            ),
            now_ms=5000,
        )
    return memory


def encoded(memory: MemoryGroup) -> list[bytes]:
    return [encode_event(event) for event in memory.events]


def final_snapshot(memory: MemoryGroup, org: str = "acme", **overrides):
    arguments = dict(
        org=org,
        group=memory.group,
        seq=len(memory.events),
        head_hash=memory.head_hash,
        aggregates=aggregates_from(memory.states, memory.revisions),
        signer=SIGNER,
        created_at_ms=9000,
    )
    arguments.update(overrides)
    return verify_snapshot(create_snapshot(**arguments), keyring=KEYRING)


def chunk_spans(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """The header length and each chunk's (start, end) byte span, frame included."""
    header_length = _HEADER.unpack_from(data)[2]
    spans = []
    offset = header_length
    while offset < len(data):
        length = _FRAME.unpack_from(data, offset)[0]
        spans.append((offset, offset + FRAME_BYTES + length))
        offset += FRAME_BYTES + length
    return header_length, spans


def read_all(path: str, provider, org: str = "acme", group: str = "g1") -> list[bytes]:
    return list(read_audit_log(path, key_provider=provider, org=org, group=group))


def check_of(path: str, provider, **kwargs) -> str:
    with pytest.raises(ArchiveInvalid) as info:
        read_all(path, provider, **kwargs)
    assert info.value.code == "ARCHIVE_INVALID"
    return info.value.detail["check"]


@pytest.fixture
def provider(tmp_path) -> FileKeyProvider:
    return FileKeyProvider(str(tmp_path / "org-keys"))


@pytest.fixture(scope="module")
def memory() -> MemoryGroup:
    return make_group()


@pytest.fixture
def log(tmp_path, provider, memory) -> str:
    path = str(tmp_path / "g1.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    return path


def rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


# -- round trip -----------------------------------------------------------------------------------------


def test_round_trip(tmp_path, provider, memory):
    path = str(tmp_path / "g1.audit")
    info = write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    assert read_all(path, provider) == encoded(memory)
    assert info.events == len(memory.events) == info.last_seq
    assert info.head_hash == memory.head_hash
    assert info.bytes == os.path.getsize(path)
    assert info.file_hash == blake3.blake3(open(path, "rb").read()).hexdigest()
    assert info.chunks == len(chunk_spans(open(path, "rb").read())[1]) > 5
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert set(os.listdir(tmp_path)) == {"g1.audit", "org-keys"}  # no temporary file left
    assert read_audit_log_header(path)["group"] == "g1"


def test_an_audit_log_given_by_path_makes_its_missing_directories_durably(tmp_path, provider, memory, synced_directories):
    """``write_audit_log`` without a directory opened makes the missing directories of ``path``,
    each synced in its parent, before the file is written."""
    path = tmp_path / "a" / "b" / "g1.audit"
    write_audit_log(str(path), org="acme", group="g1", events=encoded(memory), key_provider=provider)
    assert read_all(str(path), provider) == encoded(memory)
    assert str(tmp_path) in synced_directories and str(tmp_path / "a") in synced_directories


def test_ciphertext_does_not_show_the_plaintext(log, memory):
    data = open(log, "rb").read()
    assert b"mission-1" not in data and b"alice" not in data


def test_default_chunk_size_round_trip(tmp_path, provider, memory):
    path = str(tmp_path / "g1.audit")
    info = write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider)
    assert info.chunks == 1
    assert read_all(path, provider) == encoded(memory)


def test_empty_history_is_one_final_chunk(tmp_path, provider):
    path = str(tmp_path / "empty.audit")
    info = write_audit_log(path, org="acme", group="g1", events=[], key_provider=provider)
    assert (info.chunks, info.events, info.last_seq, info.head_hash) == (1, 0, 0, ZERO_HASH)
    assert read_all(path, provider) == []


def test_event_larger_than_a_chunk_spans_chunks(tmp_path, provider):
    memory = make_group(missions=2, title_chars=1000)
    path = str(tmp_path / "big.audit")
    info = write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=64)
    assert info.chunks > 30
    assert read_all(path, provider) == encoded(memory)


def test_exact_multiple_of_the_chunk_size_ends_with_a_full_final_chunk(tmp_path, provider, memory):
    events = encoded(memory)
    total = sum(4 + len(event) for event in events)
    for parts in (1, 2, 3, 4, 5, 7):
        if total % parts:
            continue
        path = str(tmp_path / f"exact{parts}.audit")
        info = write_audit_log(path, org="acme", group="g1", events=events, key_provider=provider, chunk_bytes=total // parts)
        assert info.chunks == parts
        assert read_all(path, provider) == events


def test_writer_refuses_events_of_another_group_or_out_of_order(tmp_path, provider, memory):
    events = encoded(memory)
    other = encoded(make_group("g2", missions=1))
    for bad in ([events[1]], events[:2] + events[3:], events[:2] + [other[2]], [b"not an event"], ["str"]):
        with pytest.raises(InvalidCommand):
            write_audit_log(str(tmp_path / "x.audit"), org="acme", group="g1", events=bad, key_provider=provider)
    assert not os.path.exists(tmp_path / "x.audit")
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


def test_makedirs_durable_creates_missing_parents(tmp_path):
    target = tmp_path / "archive" / "g1" / "deep"
    makedirs_durable(str(target))
    makedirs_durable(str(target))  # existing: nothing to do
    assert target.is_dir()


def test_writer_refuses_bad_ids_and_chunk_sizes_outside_the_format(tmp_path, provider):
    with pytest.raises(InvalidCommand):
        write_audit_log(str(tmp_path / "x"), org="../acme", group="g1", events=[], key_provider=provider)
    with pytest.raises(InvalidCommand):
        write_audit_log(str(tmp_path / "x"), org="acme", group="g1", events=[], key_provider=provider, chunk_bytes=0)
    largest = limits.AUDIT_CHUNK_BYTES_MAX - TAG_BYTES  # a sealed chunk must fit the reader's cap
    with pytest.raises(InvalidCommand):
        write_audit_log(str(tmp_path / "x"), org="acme", group="g1", events=[], key_provider=provider, chunk_bytes=largest + 1)
    assert not os.path.exists(tmp_path / "x")
    write_audit_log(str(tmp_path / "x"), org="acme", group="g1", events=[], key_provider=provider, chunk_bytes=largest)
    assert read_all(str(tmp_path / "x"), provider) == []


# -- Organization keys ----------------------------------------------------------------------------------


def test_file_key_provider_creates_one_owner_only_key(tmp_path):
    provider = FileKeyProvider(str(tmp_path))
    key_id, key = provider.current_key("acme")
    assert provider.current_key("acme") == (key_id, key)
    assert len(key) == 32 and provider.key_for("acme", key_id) == key
    key_file = tmp_path / "acme" / f"{key_id}.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "acme").st_mode) == 0o700
    assert provider.current_key("other-org")[1] != key



def test_a_file_key_provider_may_be_given_its_directory_through_a_symbolic_link(tmp_path):
    """The provider's own directory is the caller's choice, as a store's path is: reached through
    a link (keys kept on another volume), it is used, checked and made 0700 where it is. Only the
    directories below it, which the provider makes, are refused as links."""
    target = tmp_path / "volume" / "org-keys"
    target.mkdir(parents=True, mode=0o755)
    target.chmod(0o755)
    os.symlink(target, tmp_path / "org-keys")
    for given, first in ((str(tmp_path / "org-keys"), "current_key"), (str(tmp_path / "org-keys") + os.sep, "rotate")):
        target.chmod(0o750)  # group bits only: they go too
        provider = FileKeyProvider(given)
        getattr(provider, first)(f"first-by-{first}")  # an Organization's first key, made each way
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
        key_id, key = provider.current_key("acme")
        assert provider.rotate("acme") != key_id and provider.key_for("acme", key_id) == key
    assert os.path.isfile(target / "acme" / "CURRENT")
    os.symlink(tmp_path / "volume", target / "linked-org")
    with pytest.raises(KeyFileInvalid) as caught:
        FileKeyProvider(str(tmp_path / "org-keys")).current_key("linked-org")
    assert caught.value.detail["reason"] == "type" and caught.value.detail["path"] == str(tmp_path / "org-keys" / "linked-org")
    assert sorted(os.listdir(tmp_path / "volume")) == ["org-keys"]

def test_file_key_provider_refuses_loose_permissions_and_bad_size(tmp_path):
    provider = FileKeyProvider(str(tmp_path))
    key_id, _ = provider.current_key("acme")
    key_file = tmp_path / "acme" / f"{key_id}.key"
    os.chmod(key_file, 0o644)
    with pytest.raises(KeyFileInvalid):
        provider.current_key("acme")
    os.chmod(key_file, 0o600)
    with open(key_file, "ab") as handle:
        handle.write(b"!")
    with pytest.raises(KeyFileInvalid):
        provider.key_for("acme", key_id)


def test_file_key_provider_unknown_key_and_path_like_org(tmp_path):
    provider = FileKeyProvider(str(tmp_path))
    with pytest.raises(KeyError):
        provider.key_for("acme", "00" * 8)
    with pytest.raises(KeyError):
        provider.key_for("acme", "../../etc/passwd")
    provider.current_key("acme")
    other_id, _ = provider.current_key("other-org")
    for path_like in (f"../other-org/{other_id}", f"{other_id}\n"):  # another Organization's key file, a near key id
        with pytest.raises(KeyError):
            provider.key_for("acme", path_like)
    with pytest.raises(InvalidCommand):
        provider.current_key("../escape")


def test_a_shredded_current_key_is_a_typed_error_and_rotation_recovers(tmp_path, memory):
    """Crypto-shredding the current key leaves CURRENT naming a file that is gone: writing a new
    audit log must say so (KEY_FILE_INVALID), not escape as a bare KeyError."""
    provider = FileKeyProvider(str(tmp_path / "keys"))
    key_id, _ = provider.current_key("acme")
    os.remove(tmp_path / "keys" / "acme" / f"{key_id}.key")
    with pytest.raises(KeyFileInvalid) as caught:
        provider.current_key("acme")
    assert caught.value.detail["reason"] == "missing"
    path = str(tmp_path / "g1.audit")
    with pytest.raises(KeyFileInvalid):
        write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider)
    assert not os.path.exists(path)
    provider.rotate("acme")
    assert write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider).events == len(memory.events)


def test_shred_deletes_the_key_and_the_copies_an_interrupted_write_left(tmp_path, provider, memory, log):
    key_id = read_audit_log_header(log)["key_id"]
    directory = tmp_path / "org-keys" / "acme"
    key_file = directory / f"{key_id}.key"
    # What a kill between create_secret_at's link and its unlink leaves: a second 0600 copy.
    leftover = directory / f".{key_id}.key.0123456789abcdef.tmp"
    leftover.write_bytes(key_file.read_bytes())
    unrelated = directory / ".ffffffffffffffff.key.0123456789abcdef.tmp"
    unrelated.write_bytes(b"x")
    assert provider.shred("acme", key_id) is True
    assert not key_file.exists() and not leftover.exists() and unrelated.exists()
    assert store_files_held(str(directory)) == []  # the descriptor it held across the deletion is closed
    with pytest.raises(KeyError):
        provider.key_for("acme", key_id)
    with pytest.raises(ArchiveInvalid):
        read_all(log, provider)
    assert provider.shred("acme", key_id) is False  # nothing left to delete
    with pytest.raises(KeyFileInvalid) as caught:  # it was the current key: rotate before the next log
        provider.current_key("acme")
    assert caught.value.detail["reason"] == "missing"


def test_shred_refuses_a_key_file_with_another_hard_link_and_deletes_nothing(tmp_path, provider, log):
    """A hard link to the key file from elsewhere keeps the key when its name in the store is
    deleted: shred answered True and every audit log under the key still decrypted. It is
    ``KEY_FILE_INVALID`` (reason ``links``) with nothing deleted; the link a killed key write left
    (its temporary copy) is no such link, and once the other one is gone the shred goes through."""
    key_id = read_audit_log_header(log)["key_id"]
    directory = tmp_path / "org-keys" / "acme"
    key_file = directory / f"{key_id}.key"
    leftover = directory / f".{key_id}.key.0123456789abcdef.tmp"
    os.link(key_file, leftover)  # as create_secret_at killed between its link and its unlink left it
    elsewhere = tmp_path / "copy-of-the-key"
    os.link(key_file, elsewhere)
    with pytest.raises(KeyFileInvalid) as caught:
        provider.shred("acme", key_id)
    assert caught.value.detail["reason"] == "links" and caught.value.detail["links"] == 1
    assert caught.value.detail["path"] == str(key_file) and key_file.exists() and leftover.exists()
    assert read_all(log, provider)  # still readable: nothing was shredded
    os.remove(elsewhere)
    assert provider.shred("acme", key_id) is True
    assert not key_file.exists() and not leftover.exists()
    with pytest.raises(ArchiveInvalid):
        read_all(log, provider)


def test_shred_says_so_when_a_hard_link_made_during_it_keeps_the_key(tmp_path, provider, log, monkeypatch):
    """A link made after shred's look at the key file (a backup tool running meanwhile) kept the
    key, and shred answered True. The file's own link count, read once its name is gone, now says
    so: ``KEY_FILE_INVALID`` (reason ``links``), the key still readable through that link."""
    import mwpstore.audit_log as audit_log

    key_id = read_audit_log_header(log)["key_id"]
    key_file = tmp_path / "org-keys" / "acme" / f"{key_id}.key"
    key = provider.key_for("acme", key_id)
    elsewhere = tmp_path / "linked-meanwhile"
    remove = audit_log.remove_with_temp_copies_at

    def linked_meanwhile(directory, name):
        os.link(directory.join(name), elsewhere)
        return remove(directory, name)

    monkeypatch.setattr(audit_log, "remove_with_temp_copies_at", linked_meanwhile)
    with pytest.raises(KeyFileInvalid) as caught:
        provider.shred("acme", key_id)
    assert caught.value.detail["reason"] == "links" and caught.value.detail["links"] == 1
    assert caught.value.detail["path"] == str(key_file) and not key_file.exists()
    assert elsewhere.read_bytes() == key
    monkeypatch.undo()
    os.remove(elsewhere)
    assert provider.shred("acme", key_id) is False  # nothing left to delete, and nothing said kept

def test_shred_interrupted_as_it_checks_the_key_file_holds_no_descriptor_of_it(tmp_path, provider, log, monkeypatch):
    """An interrupt (KeyboardInterrupt) while shred looks at the key file it holds open across
    the deletion closes that descriptor: kept, it would keep the key readable for as long as the
    process lives. Nothing is deleted, and the shred, run again, goes through."""
    key_id = read_audit_log_header(log)["key_id"]
    key_file = tmp_path / "org-keys" / "acme" / f"{key_id}.key"
    real = os.fstat

    def interrupted(fd: int) -> os.stat_result:
        if os.readlink(f"/proc/self/fd/{fd}") == str(key_file):
            raise KeyboardInterrupt
        return real(fd)

    monkeypatch.setattr(os, "fstat", interrupted)
    with pytest.raises(KeyboardInterrupt):
        provider.shred("acme", key_id)
    monkeypatch.undo()
    assert store_files_held(str(tmp_path)) == [] and key_file.exists()
    assert provider.shred("acme", key_id) is True and not key_file.exists()


@pytest.mark.parametrize("call, code", [("open", errno.EMFILE), ("open", errno.EIO), ("fstat", errno.EIO)])
def test_shred_that_cannot_hold_the_key_file_open_deletes_nothing(tmp_path, provider, log, monkeypatch, call, code):
    """The key file held open across the deletion is what tells a hard link made meanwhile. An
    open or fstat of it that fails for another reason than "no such file" (too many open files,
    an I/O error) is ``StorageFailed`` before anything is deleted: it used to be taken as no key
    file, so the shred deleted the key and said True without that check. Run again, it goes
    through."""
    key_id = read_audit_log_header(log)["key_id"]
    key_file = tmp_path / "org-keys" / "acme" / f"{key_id}.key"
    real = getattr(os, call)

    def failing(*args, **kwargs):
        if call == "open" and args[0] == key_file.name or call == "fstat" and os.readlink(f"/proc/self/fd/{args[0]}") == str(key_file):
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(StorageFailed) as caught:
        provider.shred("acme", key_id)
    monkeypatch.undo()
    assert caught.value.detail["errno"] == code
    assert store_files_held(str(tmp_path)) == [] and provider.key_for("acme", key_id)
    assert provider.shred("acme", key_id) is True and not key_file.exists()


@pytest.mark.parametrize("what", ["link", "socket", "EACCES", "EPERM"])
def test_shred_removes_a_name_it_cannot_hold_as_a_key_file(tmp_path, provider, monkeypatch, what):
    """What at a key's name gives no key file to hold across the deletion (a symbolic link, a
    socket, or an open refused by permissions) is removed like any file there, and the shred says
    True: a link goes and what it names stays."""
    import socket

    provider.current_key("acme")
    directory = tmp_path / "org-keys" / "acme"
    name = f"{'ab' * 8}.key"
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_bytes(b"k" * 32)
    held = None
    if what == "link":
        os.symlink(elsewhere, directory / name)
    elif what == "socket":
        monkeypatch.chdir(directory)  # a socket's path is bounded (108 bytes): bound by its name here
        held = socket.socket(socket.AF_UNIX)
        held.bind(name)
    else:
        os.link(elsewhere, directory / name)
        os.remove(elsewhere)
        real = os.open
        code = getattr(errno, what)

        def refused(path, flags, *args, **kwargs):
            if path == name and "dir_fd" in kwargs:
                raise OSError(code, os.strerror(code))
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refused)
    try:
        assert provider.shred("acme", "ab" * 8) is True
    finally:
        if held is not None:
            held.close()
    monkeypatch.undo()
    assert not os.path.lexists(directory / name)
    assert elsewhere.exists() == (what in ("link", "socket"))


def test_shred_does_not_wait_on_a_fifo_at_a_keys_name(tmp_path, provider):
    """Holding the key file open across the deletion must not wait: a FIFO at the key's name (no
    key) is removed as any other file there, at once."""
    provider.current_key("acme")
    fifo = tmp_path / "org-keys" / "acme" / f"{'ab' * 8}.key"
    os.mkfifo(fifo)
    try:
        outcome = outcome_within(10, lambda: provider.shred("acme", "ab" * 8))
    finally:
        with contextlib.suppress(OSError):  # lets an open waiting for a writer go on
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome is True and not os.path.lexists(fifo)

@pytest.mark.parametrize("key_id", ["../../etc/passwd", "00" * 9, "AB" * 8, 7, None])
def test_shred_refuses_what_is_not_a_key_id(provider, key_id):
    provider.current_key("acme")
    with pytest.raises(InvalidCommand) as caught:
        provider.shred("acme", key_id)
    assert caught.value.detail["field"] == "key_id"


def test_an_interrupted_key_write_leaves_no_copy_of_the_key(tmp_path, monkeypatch):
    from mwpstore import _files

    def interrupted(source, target, **where):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files.os, "link", interrupted)
    provider = FileKeyProvider(str(tmp_path / "keys"))
    with pytest.raises(KeyboardInterrupt):
        provider.current_key("acme")
    monkeypatch.undo()
    assert [name for name in os.listdir(tmp_path / "keys" / "acme") if name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    "answer",
    [None, ("00" * 8,), (b"0011223344556677", bytes(32)), (7, bytes(32)), ("00" * 8, "k" * 32), "0" * 48],
    ids=["none", "one_item", "bytes_key_id", "int_key_id", "str_key", "string"],
)
def test_writer_refuses_a_malformed_key_provider_answer(tmp_path, answer):
    class Malformed:
        def current_key(self, org):
            return answer

        def key_for(self, org, key_id):
            raise KeyError(key_id)

    path = str(tmp_path / "g1.audit")
    with pytest.raises(InvalidCommand) as caught:
        write_audit_log(path, org="acme", group="g1", events=[], key_provider=Malformed())
    assert caught.value.detail["field"] == "key_provider"
    assert os.listdir(tmp_path) == []


class RaisingProvider(FileKeyProvider):
    """The files' keys, until told to fail: then each call raises what an application's key
    store might (a lost connection to a KMS), or one of the engine's own errors."""

    failure: Exception | None = None

    def current_key(self, org):
        if self.failure is not None:
            raise self.failure
        return super().current_key(org)

    def key_for(self, org, key_id):
        if self.failure is not None:
            raise self.failure
        return super().key_for(org, key_id)


@pytest.mark.parametrize("failure", [ConnectionError("kms unreachable"), RuntimeError("hsm busy"), AttributeError("no key")], ids=repr)
def test_what_a_key_provider_raises_reaches_the_caller_as_an_invalid_command(tmp_path, memory, failure):
    """Writing and reading an audit log call the application's provider: whatever it raises,
    but KeyError for an unknown key id, is InvalidCommand naming key_provider (an error that leaves
    the API is an MwpError), the writer leaves no file, and the reader fails before any record."""
    provider = RaisingProvider(str(tmp_path / "org-keys"))
    path = str(tmp_path / "g1.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    provider.failure = failure
    with pytest.raises(InvalidCommand) as reading:
        read_audit_log(path, key_provider=provider, org="acme", group="g1")
    with pytest.raises(InvalidCommand) as writing:
        write_audit_log(str(tmp_path / "other.audit"), org="acme", group="g1", events=encoded(memory), key_provider=provider)
    for refused, call in ((reading, "key_for"), (writing, "current_key")):
        assert refused.value.detail["field"] == "key_provider"
        assert f"the key provider's {call} raised {type(failure).__name__}: " in refused.value.message
    assert sorted(os.listdir(tmp_path)) == ["g1.audit", "org-keys"]


def test_the_engines_own_error_from_a_key_provider_passes_unchanged(tmp_path, memory):
    """A provider built on the engine's pieces may raise their typed errors (a key file refused):
    those reach the caller as they are, not rewrapped as the provider's failure."""
    provider = RaisingProvider(str(tmp_path / "org-keys"))
    path = str(tmp_path / "g1.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    provider.failure = KeyFileInvalid("the key file is readable by others", path=path, reason="mode")
    for call in (
        lambda: read_audit_log(path, key_provider=provider, org="acme", group="g1"),
        lambda: write_audit_log(str(tmp_path / "other.audit"), org="acme", group="g1", events=[], key_provider=provider),
    ):
        with pytest.raises(KeyFileInvalid) as refused:
            call()
        assert refused.value is provider.failure


def test_rotation_keeps_old_logs_readable(tmp_path, provider, memory):
    old_path = str(tmp_path / "old.audit")
    old = write_audit_log(old_path, org="acme", group="g1", events=encoded(memory), key_provider=provider)
    new_key_id = provider.rotate("acme")
    new_path = str(tmp_path / "new.audit")
    new = write_audit_log(new_path, org="acme", group="g1", events=encoded(memory), key_provider=provider)
    assert new.key_id == new_key_id != old.key_id
    assert read_all(old_path, provider) == read_all(new_path, provider) == encoded(memory)


def test_missing_or_foreign_key_is_refused(log, tmp_path, provider):
    stranger = FileKeyProvider(str(tmp_path / "stranger-keys"))
    stranger.current_key("acme")
    assert check_of(log, stranger) == "key"
    key_id = read_audit_log_header(log)["key_id"]
    os.unlink(tmp_path / "org-keys" / "acme" / f"{key_id}.key")  # crypto-shredding
    assert check_of(log, provider) == "key"


    class WrongLength:  # an application's provider answering with an AES-128 key, or a str
        def __init__(self, key):
            self.key = key

        def key_for(self, org, key_id):
            return self.key

    for key in (bytes(16), "k" * 32):
        assert check_of(log, WrongLength(key)) == "key"


def test_same_key_id_with_other_key_material_fails_tag(log, tmp_path, provider):
    key_id = read_audit_log_header(log)["key_id"]
    key_file = tmp_path / "org-keys" / "acme" / f"{key_id}.key"
    os.chmod(key_file, 0o600)
    rewrite(str(key_file), b"\x00" * 32)
    assert check_of(log, provider) == "tag"


# -- tampering -----------------------------------------------------------------------------------------


def test_every_byte_flip_is_refused(tmp_path, provider):
    memory = make_group(missions=4, title_chars=4)
    path = str(tmp_path / "small.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=200)
    original = open(path, "rb").read()
    checks: dict[str, int] = {}
    for offset in range(len(original)):
        data = bytearray(original)
        data[offset] ^= 1 << (offset % 8)
        flipped = f"{path}.{offset}"
        rewrite(flipped, bytes(data))
        with pytest.raises(ArchiveInvalid) as info:
            read_all(flipped, provider)
        os.unlink(flipped)
        checks[info.value.detail["check"]] = checks.get(info.value.detail["check"], 0) + 1
    assert "tag" in checks and sum(checks.values()) == len(original)
    assert set(checks) <= {"tag", "format", "version", "binding", "key", "size", "truncated", "appended"}


def test_bit_flip_in_a_middle_chunk_is_tag(log):
    data = bytearray(open(log, "rb").read())
    _, spans = chunk_spans(bytes(data))
    start, end = spans[len(spans) // 2]
    data[(start + end) // 2] ^= 0x40
    rewrite(log, bytes(data))
    with pytest.raises(ArchiveInvalid) as info:
        read_all(log, FileKeyProvider(os.path.join(os.path.dirname(log), "org-keys")))
    assert info.value.detail["check"] == "tag" and info.value.detail["chunk"] == len(spans) // 2


def test_reordered_chunks_are_refused(log, provider):
    data = open(log, "rb").read()
    header_length, spans = chunk_spans(data)
    pieces = [data[start:end] for start, end in spans]
    pieces[1], pieces[2] = pieces[2], pieces[1]
    rewrite(log, data[:header_length] + b"".join(pieces))
    assert check_of(log, provider) == "tag"


def test_dropped_middle_chunk_is_refused(log, provider):
    data = open(log, "rb").read()
    header_length, spans = chunk_spans(data)
    pieces = [data[start:end] for start, end in spans]
    del pieces[2]
    rewrite(log, data[:header_length] + b"".join(pieces))
    assert check_of(log, provider) == "tag"


def test_duplicated_chunk_is_refused(log, provider):
    data = open(log, "rb").read()
    header_length, spans = chunk_spans(data)
    pieces = [data[start:end] for start, end in spans]
    pieces.insert(1, pieces[1])
    rewrite(log, data[:header_length] + b"".join(pieces))
    assert check_of(log, provider) == "tag"


def test_dropped_final_chunk_is_truncated_before_any_record(log, provider):
    data = open(log, "rb").read()
    _, spans = chunk_spans(data)
    rewrite(log, data[: spans[-1][0]])
    with pytest.raises(ArchiveInvalid) as info:
        read_audit_log(log, key_provider=provider, org="acme", group="g1")  # raises before iterating
    assert info.value.detail["check"] == "truncated"


def test_final_flag_forged_on_an_earlier_chunk_is_tag(log, provider):
    data = bytearray(open(log, "rb").read())
    _, spans = chunk_spans(bytes(data))
    start, _ = spans[-2]
    data[start + 4] |= 0x01  # the flag is in the associated data and the nonce
    rewrite(log, bytes(data[: spans[-2][1]]))  # and the real final chunk dropped
    assert check_of(log, provider) == "tag"


def test_every_truncation_is_refused_before_any_record(log, provider):
    data = open(log, "rb").read()
    for length in range(len(data)):
        path = f"{log}.{length}"  # a fresh file each time: truncating in place makes ext4 flush
        rewrite(path, data[:length])
        with pytest.raises(ArchiveInvalid) as info:
            read_audit_log(path, key_provider=provider, org="acme", group="g1")
        assert info.value.detail["check"] == "truncated", length
        os.unlink(path)


@pytest.mark.parametrize("extra", [b"\x00", b"garbage" * 10, None])
def test_appended_data_is_refused(log, provider, extra):
    data = open(log, "rb").read()
    if extra is None:  # a whole valid chunk appended after the final one
        _, spans = chunk_spans(data)
        extra = data[spans[0][0] : spans[0][1]]
    rewrite(log, data + extra)
    assert check_of(log, provider) == "appended"


def test_chunk_spliced_from_another_groups_log_is_refused(log, tmp_path, provider):
    other_path = str(tmp_path / "g2.audit")
    write_audit_log(
        other_path, org="acme", group="g2", events=encoded(make_group("g2")), key_provider=provider, chunk_bytes=CHUNK
    )
    data, other = open(log, "rb").read(), open(other_path, "rb").read()
    header_length, spans = chunk_spans(data)
    _, other_spans = chunk_spans(other)
    pieces = [data[start:end] for start, end in spans]
    pieces[1] = other[other_spans[1][0] : other_spans[1][1]]
    rewrite(log, data[:header_length] + b"".join(pieces))
    assert check_of(log, provider) == "tag"
    # Another group's header in front of this log's chunks: refused by binding, or by the tag.
    other_header_length = chunk_spans(other)[0]
    rewrite(log, other[:other_header_length] + data[header_length:])
    assert check_of(log, provider) == "binding"
    assert check_of(log, provider, group="g2") == "tag"


def test_chunk_spliced_from_another_log_of_the_same_group_is_refused(log, tmp_path, provider, memory):
    twin_path = str(tmp_path / "twin.audit")
    write_audit_log(twin_path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    data, twin = open(log, "rb").read(), open(twin_path, "rb").read()
    header_length, spans = chunk_spans(data)
    pieces = [data[start:end] for start, end in spans]
    pieces[0] = twin[spans[0][0] : spans[0][1]]  # same position, same length, other file key
    rewrite(log, data[:header_length] + b"".join(pieces))
    assert check_of(log, provider) == "tag"


def test_reading_another_groups_log_is_binding(log, provider):
    assert check_of(log, provider, group="g2") == "binding"
    assert check_of(log, provider, org="other") == "binding"


def test_not_an_audit_log(tmp_path, provider):
    path = str(tmp_path / "x")
    rewrite(path, b"hello, world" * 10)
    assert check_of(path, provider) == "format"


# -- verification against the final snapshot ---------------------------------------------------------


def test_verify_against_final_snapshot(log, provider, memory):
    info = verify_audit_log_against_snapshot(log, final_snapshot(memory), provider)
    assert isinstance(info, AuditLogInfo)
    assert (info.events, info.last_seq, info.head_hash) == (len(memory.events), len(memory.events), memory.head_hash)


def test_verify_empty_log_against_sequence_zero_snapshot(tmp_path, provider):
    path = str(tmp_path / "empty.audit")
    write_audit_log(path, org="acme", group="g1", events=[], key_provider=provider)
    snapshot = final_snapshot(MemoryGroup("g1"))
    assert verify_audit_log_against_snapshot(path, snapshot, provider).events == 0


def test_snapshot_at_another_sequence_is_refused(tmp_path, log, provider, memory):
    shorter = MemoryGroup("g1")
    for event in memory.events[:-1]:
        shorter.apply(event)
    with pytest.raises(ArchiveInvalid) as info:
        verify_audit_log_against_snapshot(log, final_snapshot(shorter), provider)
    assert info.value.detail["check"] == "snapshot"
    path = str(tmp_path / "short.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(shorter), key_provider=provider)
    with pytest.raises(ArchiveInvalid) as info:
        verify_audit_log_against_snapshot(path, final_snapshot(memory), provider)
    assert info.value.detail["check"] == "snapshot"


def test_snapshot_with_other_state_is_refused_by_replay(log, provider, memory):
    states = dict(memory.states)
    states["mission:mission-1"] = {**states["mission:mission-1"], "title": "rewritten"}
    snapshot = final_snapshot(memory, aggregates=aggregates_from(states, memory.revisions))
    with pytest.raises(ArchiveInvalid) as info:
        verify_audit_log_against_snapshot(log, snapshot, provider)
    assert info.value.detail["check"] == "state"
    assert verify_audit_log_against_snapshot(log, snapshot, provider, replay=False).events == len(memory.events)


def test_snapshot_of_another_organization_is_binding(log, provider, memory):
    with pytest.raises(ArchiveInvalid) as info:
        verify_audit_log_against_snapshot(log, final_snapshot(memory, org="other"), provider)
    assert info.value.detail["check"] == "binding"


@pytest.mark.parametrize("rehashed", [False, True], ids=["own_hash_wrong", "link_to_the_next_broken"])
def test_event_with_broken_chain_is_refused(tmp_path, provider, memory, rehashed):
    events = list(memory.events)
    events[3] = msgspec.structs.replace(events[3], accepted_at_ms=events[3].accepted_at_ms + 1)  # hash no longer verifies
    if rehashed:  # its own hash made right again: only the next Event's link to it is wrong
        events[3] = msgspec.structs.replace(events[3], hash=recompute_event_hash(events[3]))
    path = str(tmp_path / "forged.audit")
    write_audit_log(path, org="acme", group="g1", events=[encode_event(e) for e in events], key_provider=provider)
    with pytest.raises(ArchiveInvalid) as info:
        verify_audit_log_against_snapshot(path, final_snapshot(memory), provider)
    assert info.value.detail["check"] == "event" and info.value.detail["seq"] == (5 if rehashed else 4)


def redacted_group() -> MemoryGroup:
    """A Group whose Event 3 was redacted by an accepted ``event.redact``."""
    memory = make_group(missions=4)
    memory.accept(
        Command(actor="alice", action_id="redact-3", group="g1", kind="event.redact", target="3", body={"reason": "legal"}),
        now_ms=6000,
    )
    return memory


def write_events(path: str, events, provider) -> None:
    write_audit_log(path, org="acme", group="g1", events=[encode_event(e) for e in events], key_provider=provider)


def test_redacted_event_still_verifies(tmp_path, provider):
    memory = redacted_group()
    events = list(memory.events)
    events[2] = msgspec.structs.replace(events[2], body=None)  # as reads return it: payload gone, payload hash kept
    path = str(tmp_path / "redacted.audit")
    write_events(path, events, provider)
    assert verify_audit_log_against_snapshot(path, final_snapshot(memory), provider).events == len(events)


def test_a_payload_removed_without_a_tombstone_is_refused(tmp_path, provider, memory):
    """The hash chain commits to a payload's hash, not to the payload, so whoever holds the
    Organization key could re-encrypt the log with a payload dropped and the chain would still
    verify. Removing a payload is legal only through an accepted event.redact, whose tombstone
    the signed final snapshot holds."""
    events = list(memory.events)
    events[2] = msgspec.structs.replace(events[2], body=None)
    path = str(tmp_path / "stripped.audit")
    write_events(path, events, provider)
    for replay in (True, False):
        with pytest.raises(ArchiveInvalid) as caught:
            verify_audit_log_against_snapshot(path, final_snapshot(memory), provider, replay=replay)
        assert caught.value.detail["check"] == "tombstone" and caught.value.detail["seq"] == 3


def test_a_redacted_payload_still_in_the_log_is_refused(tmp_path, provider):
    memory = redacted_group()
    path = str(tmp_path / "unredacted.audit")
    write_events(path, memory.events, provider)  # Event 3 still carries the payload its tombstone removed
    with pytest.raises(ArchiveInvalid) as caught:
        verify_audit_log_against_snapshot(path, final_snapshot(memory), provider)
    assert caught.value.detail["check"] == "tombstone" and caught.value.detail["seq"] == 3


# -- command line ----------------------------------------------------------------------------------------


def run_cli(*arguments: str) -> tuple[int, dict]:
    result = subprocess.run(
        [sys.executable, "-m", "mwpstore.audit_log", *arguments], capture_output=True, text=True, timeout=60
    )
    lines = result.stdout.strip().splitlines()
    return result.returncode, json.loads(lines[-1]) if lines else {}


def test_command_line_verify_and_dump(tmp_path, log, memory):
    from mwpstore.snapshot import write_snapshot_file

    key_directory = tmp_path / "signing"
    signer = SigningKey.load_or_create(str(key_directory))
    snapshot_path = str(tmp_path / "g1.snap")
    write_snapshot_file(
        snapshot_path,
        create_snapshot(
            org="acme",
            group="g1",
            seq=len(memory.events),
            head_hash=memory.head_hash,
            aggregates=aggregates_from(memory.states, memory.revisions),
            signer=signer,
            created_at_ms=9000,
        ),
    )
    keys = str(tmp_path / "org-keys")
    code, report = run_cli("verify", log, "--snapshot", snapshot_path, "--keys", keys, "--trust", str(key_directory / "snapshot-signing.pub"))
    assert code == 0 and report["ok"] and report["events"] == len(memory.events)
    assert report["head_hash"] == memory.head_hash.hex()
    # the verifier computes no file hash: the document printed "file_hash": "", which a script
    # comparing it with an archive record's audit_file_hash would take for a different file
    assert "file_hash" not in report
    code, report = run_cli("verify", log, "--snapshot", snapshot_path, "--keys", keys, "--trust", SIGNER.public_key.hex())
    assert code == 1 and report["code"] == "SNAPSHOT_INVALID" and report["detail"]["check"] == "key"
    data = bytearray(open(log, "rb").read())
    data[-3] ^= 1
    rewrite(log, bytes(data))
    code, report = run_cli("verify", log, "--snapshot", snapshot_path, "--keys", keys, "--trust", signer.public_key.hex())
    assert code == 1 and report["code"] == "ARCHIVE_INVALID" and report["detail"]["check"] == "tag"
    data[-3] ^= 1
    rewrite(log, bytes(data))
    result = subprocess.run(
        [sys.executable, "-m", "mwpstore.audit_log", "dump", log, "--keys", keys, "--org", "acme", "--group", "g1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    dumped = [json.loads(line) for line in result.stdout.splitlines()]
    assert [event["seq"] for event in dumped] == list(range(1, len(memory.events) + 1))
    assert dumped[-1]["hash"] == memory.head_hash.hex()


# -- properties -----------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(titles=st.lists(st.integers(1, 600), max_size=12), chunk_bytes=st.integers(1, 2048))
def test_property_round_trip_any_chunk_size(tmp_path_factory, titles, chunk_bytes):
    directory = tmp_path_factory.mktemp("prop")
    provider = FileKeyProvider(str(directory / "keys"))
    memory = MemoryGroup("g1")
    memory.accept(
        Command(actor="alice", action_id="a0", group="g1", kind="group.create", target="g1", body={"org": "acme"}),
        now_ms=1,
    )
    for index, chars in enumerate(titles):
        memory.accept(
            Command(actor="alice", action_id=f"m{index}", group="g1", kind="mission.create", target=f"m{index}", body={"title": "t" * chars}),
            now_ms=2 + index,
        )
    path = str(directory / "p.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=chunk_bytes)
    assert read_all(path, provider) == encoded(memory)
    assert verify_audit_log_against_snapshot(path, final_snapshot(memory), provider).events == len(memory.events)


def test_fifo_in_place_of_an_audit_log_is_refused_without_blocking(tmp_path, provider):
    path = tmp_path / "g-1.audit"
    os.mkfifo(path)  # opening it for reading would wait for a writer for ever
    for read in (
        lambda: list(read_audit_log(str(path), key_provider=provider, org="acme", group="g-1")),
        lambda: read_audit_log_header_checked(str(path)),
    ):
        error = outcome_within(10, read)
        assert isinstance(error, StorageFailed), error
        assert error.detail.get("errno") == errno.EINVAL


def test_a_header_relabelled_to_another_group_fails_every_chunk_tag(log, provider):
    # The file key depends only on the org key and the salt, so a Group name rewritten in the
    # header (same length) still yields the same key: only the header hash in every chunk's
    # associated data stops the relabelled log from reading as g2's history.
    data = bytearray(open(log, "rb").read())
    header_length = chunk_spans(bytes(data))[0]
    at = bytes(data[:header_length]).rindex(b"g1")
    data[at : at + 2] = b"g2"
    rewrite(log, bytes(data))
    assert read_audit_log_header(log)["group"] == "g2"
    assert check_of(log, provider, group="g2") == "tag"


def test_a_snapshot_with_another_head_hash_at_the_same_sequence_is_refused(log, provider, memory):
    # Same seq and same aggregates (replay agrees), another head: not the history the log holds.
    snapshot = final_snapshot(memory, head_hash=bytes(32))
    for replay in (True, False):
        with pytest.raises(ArchiveInvalid) as info:
            verify_audit_log_against_snapshot(log, snapshot, provider, replay=replay)
        assert info.value.detail["check"] == "snapshot"


def test_a_current_file_that_is_a_symbolic_link_is_refused_naming_it(tmp_path, provider):
    """``CURRENT`` is read through the Organization directory's descriptor, never through a link:
    one put in its place is ``STORAGE_FAILED`` (``ELOOP``) with ``detail`` ``path`` naming it, as
    operations.md says, and the key it would have named is not used."""
    provider.current_key("acme")
    current = tmp_path / "org-keys" / "acme" / "CURRENT"
    os.rename(current, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", current)
    with pytest.raises(StorageFailed) as caught:
        provider.current_key("acme")
    assert caught.value.detail["errno"] == errno.ELOOP and caught.value.detail["path"] == str(current)
