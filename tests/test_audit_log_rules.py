"""The audit log's rules read from docs/format/archive.md and checked from outside the code.

``test_audit_log.py`` checks that the reader refuses what was tampered with. These tests check what
that cannot show: that each chunk is sealed exactly as the format says (file key, nonce, associated
data) and no nonce repeats; that the writer publishes a durable file and stays within the format's
bounds; that the reader names the check a malformed header or frame fails, before any key or tag;
that a log sealed correctly by whoever holds the Organization key, but holding a record stream the
writer never makes, is still refused; and what archive() and the command line check on top.
"""

from __future__ import annotations

import json
import os
import struct

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from authority_helpers import GROUP, OWNER, mission_create, open_with_group
from mwpstore import audit_log, limits
from mwpstore._files import KeyFileInvalid
from mwpstore.audit_log import FileKeyProvider, write_audit_log
from mwpstore.errors import ArchiveInvalid, InvalidCommand
from mwpstore.messages import Effect
from mwpstore.snapshot import aggregates_from, create_snapshot, write_snapshot_file
from test_audit_log import CHUNK, SIGNER, check_of, chunk_spans, encoded, log, memory, provider, rewrite  # noqa: F401 (fixtures)
from test_files_and_paths import _identity, fsynced  # noqa: F401 (fixture)


def documented_open(data: bytes, org_key: bytes) -> tuple[list[bytes], list[bytes]]:
    """Decrypt a log with nothing but the format page: ``(records, nonces)``."""
    header_length, chunk_bytes = struct.unpack_from("<HI", data, 10)
    salt, nonce_prefix = data[16:32], data[32:39]
    header = data[:header_length]
    file_key = blake3.blake3(org_key + salt, derive_key_context="mwpstore 2026 audit-log file key v1").digest()
    cipher = AESGCM(file_key)
    plaintext, nonces, offset, index = b"", [], header_length, 0
    while offset < len(data):
        frame = data[offset : offset + 8]
        sealed_bytes, flags = struct.unpack_from("<IB", frame)
        final = flags & 1
        assert final or sealed_bytes == chunk_bytes + 16
        nonce = nonce_prefix + struct.pack(">I", index) + bytes([final])
        ad = b"mwpstore/audit-chunk/v1\0" + blake3.blake3(header).digest() + struct.pack(">Q", index) + frame
        plaintext += cipher.decrypt(nonce, data[offset + 8 : offset + 8 + sealed_bytes], ad)
        nonces.append(nonce)
        offset += 8 + sealed_bytes
        index += 1
        if final:
            assert offset == len(data)
    records, position = [], 0
    while position < len(plaintext):
        (length,) = struct.unpack_from("<I", plaintext, position)
        records.append(plaintext[position + 4 : position + 4 + length])
        position += 4 + length
    return records, nonces


def test_a_log_decrypts_by_the_documented_construction_alone(tmp_path, provider, memory):
    """File key, nonce (prefix, chunk index, final flag) and associated data (header hash, index,
    frame) as the format page gives them: a writer that left any of them out would still read
    back through its own reader, but not here, and the nonces of one file must all differ."""
    path = str(tmp_path / "g1.audit")
    write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    data = open(path, "rb").read()
    key_id, org_key = provider.current_key("acme")
    assert data[48 : 48 + 16].decode("ascii") == key_id
    records, nonces = documented_open(data, org_key)
    assert records == encoded(memory)
    assert len(nonces) > 5 and len(set(nonces)) == len(nonces)


def test_every_log_gets_its_own_salt_and_nonce_prefix(tmp_path, provider, memory):
    """The same history written twice under the same Organization key: a fixed salt would give
    both files one file key and the same nonces (a repeated key and nonce breaks AES-GCM); the
    random nonce prefix is the second guard."""
    headers = []
    for name in ("a.audit", "b.audit"):
        path = str(tmp_path / name)
        write_audit_log(path, org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
        headers.append(open(path, "rb").read(48))
    salts = {header[16:32] for header in headers}
    prefixes = {header[32:39] for header in headers}
    assert len(salts) == 2 and bytes(16) not in salts
    assert len(prefixes) == 2 and bytes(7) not in prefixes


def test_a_history_fills_the_last_chunk_the_nonce_allows_and_not_one_more(tmp_path, provider, memory, monkeypatch):
    """The chunk index is a 32-bit field of the nonce: at most CHUNKS_MAX chunks (made small
    here), the last of them included; one more is refused before a file appears."""
    events = encoded(memory)
    total = sum(4 + len(event) for event in events)
    monkeypatch.setattr(audit_log, "CHUNKS_MAX", 3)
    fits = str(tmp_path / "fits.audit")
    info = write_audit_log(fits, org="acme", group="g1", events=events, key_provider=provider, chunk_bytes=-(-total // 3))
    assert info.chunks == 3
    assert list(audit_log.read_audit_log(fits, key_provider=provider, org="acme", group="g1")) == events
    too_many = str(tmp_path / "too-many.audit")
    with pytest.raises(InvalidCommand):
        write_audit_log(too_many, org="acme", group="g1", events=events, key_provider=provider, chunk_bytes=-(-total // 4))  # four chunks
    assert sorted(os.listdir(tmp_path)) == ["fits.audit", "org-keys"]


def test_the_log_is_fsynced_before_its_name_appears_and_its_directory_after(tmp_path, provider, memory, monkeypatch, fsynced, synced_directories):
    from mwpstore import _files

    monkeypatch.setattr(audit_log, "fsync_directory", _files.fsync_directory)  # the recording one
    path = tmp_path / "archive" / "g1.audit"
    write_audit_log(str(path), org="acme", group="g1", events=encoded(memory), key_provider=provider, chunk_bytes=CHUNK)
    assert _identity(path) in fsynced, "the log's data was never fsynced"
    assert synced_directories[-1] == str(path.parent), "the directory holding the new name was not fsynced last"


def sealed_by_hand(path: str, provider, plaintexts: list[bytes], *, chunk_bytes: int, salt: bytes = b"", nonce_prefix: bytes = b"") -> None:
    """A log sealed correctly under the Organization key with whatever plaintext chunks the key
    holder chose (the writer never makes these), the last one final."""
    key_id, org_key = provider.current_key("acme")
    salt, nonce_prefix = salt or os.urandom(16), nonce_prefix or os.urandom(7)
    header = audit_log._encode_header(
        chunk_bytes=chunk_bytes, salt=salt, nonce_prefix=nonce_prefix, key_id=key_id, org="acme", group="g1"
    )
    sealer = audit_log._Sealer(audit_log._parse_header(header), AESGCM(audit_log._file_key(org_key, salt)))
    chunks = [sealer.seal(text, final=index == len(plaintexts) - 1) for index, text in enumerate(plaintexts)]
    with open(path, "r+b" if os.path.exists(path) else "wb") as handle:  # in place: the same inode
        handle.write(header + b"".join(chunks))


def framed(record: bytes) -> bytes:
    return struct.pack("<I", len(record)) + record


@pytest.mark.parametrize("tail", ["record_cut_short", "empty_record"])
def test_an_authentic_log_whose_records_do_not_parse_is_refused(tmp_path, provider, memory, tail):
    """Every chunk authenticates, but the record stream is one the writer never makes: it ends
    inside a record, or holds a record of length 0. Neither yields a partial or empty record."""
    first, second = encoded(memory)[:2]
    plaintext = framed(first) + (framed(second)[:10] if tail == "record_cut_short" else struct.pack("<I", 0))
    path = str(tmp_path / "crafted.audit")
    sealed_by_hand(path, provider, [plaintext], chunk_bytes=len(plaintext))
    records = []
    with pytest.raises(ArchiveInvalid) as caught:
        records.extend(audit_log.read_audit_log(path, key_provider=provider, org="acme", group="g1"))
    assert caught.value.detail["check"] == "format"
    assert records == ([first] if tail == "record_cut_short" else [])  # a bad length fails its whole chunk


def test_a_log_rewritten_in_place_after_its_walk_never_ends_early(tmp_path, provider):
    """``read_audit_log`` walks the frames first and finds chunk 1 final. If the file is then
    rewritten in place with a longer log under the same header, chunk 1 is no longer final: the
    reader must refuse it, not end cleanly after a history cut short."""
    record = framed(b"r" * 20_000)  # chunks larger than the reader's buffer: it reads the file again
    salt, nonce_prefix = os.urandom(16), os.urandom(7)
    path = str(tmp_path / "swapped.audit")
    sealed_by_hand(path, provider, [record] * 2, chunk_bytes=len(record), salt=salt, nonce_prefix=nonce_prefix)
    records = audit_log.read_audit_log(path, key_provider=provider, org="acme", group="g1")
    sealed_by_hand(path, provider, [record] * 4, chunk_bytes=len(record), salt=salt, nonce_prefix=nonce_prefix)
    with pytest.raises(ArchiveInvalid) as caught:
        list(records)
    assert caught.value.detail["check"] == "format" and caught.value.detail["chunk"] == 1


def _at(offset: int, value: bytes):
    return lambda data: data[:offset] + value + data[offset + len(value) :]


@pytest.mark.parametrize(
    "change, check",
    [
        (_at(8, struct.pack("<H", 2)), "version"),
        (_at(44, b"\x01"), "format"),  # reserved
        (_at(12, struct.pack("<I", 0)), "size"),  # chunk size 0
        (_at(12, struct.pack("<I", limits.AUDIT_CHUNK_BYTES_MAX - audit_log.TAG_BYTES + 1)), "size"),
        (_at(48, b"ABCDEF0123456789"), "format"),  # key id not lowercase hex
        (_at(64, b"-cme"), "format"),  # an Organization that is no ID
        (_at(68, b"g/"), "format"),  # a Group that is no ID
    ],
    ids=["version", "reserved", "chunk_size_zero", "chunk_size_above_cap", "key_id", "org", "group"],
)
def test_a_header_field_out_of_the_format_is_refused_by_the_header_check_before_any_key_or_tag(log, provider, change, check):
    """The header is parsed before any key is asked for or any chunk opened: a field outside the
    format names its own check, not the binding, key or tag check that would refuse it later."""
    data = open(log, "rb").read()
    assert data[64:70] == b"acmeg1"
    rewrite(log, change(data))
    assert check_of(log, provider) == check


def _frame(which: int, *, length_by: int = 0, length: int | None = None, flags: int | None = None, reserved: bytes | None = None):
    """Rewrite chunk ``which``'s frame (its length changed by ``length_by`` or to ``length``, its
    body cut or padded to match so the chunks after it still line up): what the structure walk
    must refuse before it decrypts anything."""

    change_by = length_by

    def change(data: bytes) -> bytes:
        _, spans = chunk_spans(data)
        start, end = spans[which]
        old_length, old_flags, old_reserved = audit_log._FRAME.unpack_from(data, start)
        length_by = change_by if length is None else length - old_length
        frame = audit_log._FRAME.pack(
            old_length + length_by, old_flags if flags is None else flags, old_reserved if reserved is None else reserved
        )
        body = data[start + 8 : end]
        body = body[:length_by] if length_by < 0 else body + b"\0" * length_by
        return data[:start] + frame + body + data[end:]

    return change


@pytest.mark.parametrize(
    "change",
    [
        _frame(0, reserved=b"\0\x01\0"),
        _frame(0, flags=0x02),
        _frame(0, length_by=-1),  # a short chunk that is not final
        _frame(-1, length=audit_log.TAG_BYTES - 1),  # a final chunk shorter than its tag
        _frame(-1, length_by=CHUNK),  # a final chunk longer than a full one
    ],
    ids=["reserved", "unknown_flag", "short_non_final", "final_below_tag", "final_above_full"],
)
def test_a_frame_out_of_the_format_is_refused_by_the_walk_not_by_a_tag(log, provider, change):
    data = open(log, "rb").read()
    rewrite(log, change(data))
    assert check_of(log, provider) == "format"


def test_archive_refuses_an_audit_log_that_does_not_replay_to_its_final_snapshot(tmp_path, monkeypatch):
    """Compaction drops an archived Group's history once the archive record exists, so archive()
    checks first that folding the log's Events gives the signed final snapshot's aggregates. A
    snapshot built from states that drifted from the log (here: one aggregate more) fails that
    check, and nothing is left or recorded."""
    from mwpstore import authority as authority_module

    real = authority_module.create_snapshot

    def drifted(**arguments):
        return real(**{**arguments, "aggregates": [*arguments["aggregates"], ("zz:drift", 1, {"x": 1})]})

    monkeypatch.setattr(authority_module, "create_snapshot", drifted)
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        with pytest.raises(ArchiveInvalid) as caught:
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        assert caught.value.detail["check"] == "state"
        assert authority.archive_record(GROUP) is None
        assert os.listdir(os.path.join(authority.path, "archive", GROUP)) == []


def test_the_command_line_binds_the_expected_group_and_replays_unless_told_not_to(tmp_path, log, memory, capsys):
    """``verify --org/--group`` hold the snapshot to that Organization and Group, and the log is
    replayed against the snapshot's aggregates unless ``--no-replay`` says otherwise."""
    drifted = [*aggregates_from(memory.states, memory.revisions), Effect("zz:drift", 1, {"x": 1})]
    snapshot = str(tmp_path / "g1.snap")
    write_snapshot_file(snapshot, create_snapshot(
        org="acme", group="g1", seq=len(memory.events), head_hash=memory.head_hash, aggregates=drifted, signer=SIGNER, created_at_ms=1,
    ))
    common = ["verify", log, "--snapshot", snapshot, "--keys", str(tmp_path / "org-keys"), "--trust", SIGNER.public_key.hex()]

    def run(*extra: str) -> tuple[int, dict]:
        code = audit_log.main([*common, *extra])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    code, report = run()
    assert code == 1 and report["code"] == "ARCHIVE_INVALID" and report["detail"]["check"] == "state"
    code, report = run("--no-replay")
    assert code == 0 and report["ok"] and report["replayed"] is False
    for option, value in (("--org", "other"), ("--group", "g2")):
        code, report = run("--no-replay", option, value)
        assert code == 1 and report["code"] == "SNAPSHOT_INVALID" and report["detail"]["check"] == "binding"


def test_a_record_longer_than_an_event_can_be_is_refused_in_its_own_chunk(tmp_path, provider):
    """A length above EVENT_BYTES_MAX fails the chunk that holds it, at once: the reader never
    buffers the rest of the file waiting for a record no Event could fill."""
    chunk = struct.pack("<I", limits.EVENT_BYTES_MAX + 1) + b"x" * 60
    path = str(tmp_path / "long-record.audit")
    sealed_by_hand(path, provider, [chunk] * 3, chunk_bytes=len(chunk))
    with pytest.raises(ArchiveInvalid) as caught:
        list(audit_log.read_audit_log(path, key_provider=provider, org="acme", group="g1"))
    assert caught.value.detail["check"] == "format" and caught.value.detail["chunk"] == 0


@pytest.mark.parametrize("content", [b"../other-org/0011223344556677", b"0011223344556677-x", b""])
def test_a_current_file_that_names_no_key_id_is_refused_as_such(tmp_path, content):
    provider = FileKeyProvider(str(tmp_path))
    provider.current_key("acme")
    (tmp_path / "acme" / "CURRENT").write_bytes(content)
    with pytest.raises(KeyFileInvalid) as caught:
        provider.current_key("acme")
    assert caught.value.detail["reason"] == "current"
