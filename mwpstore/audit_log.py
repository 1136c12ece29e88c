"""Encrypted audit logs: a Group's complete Event history, sealed at archival (``docs/format/archive.md``).

The file is a header and a sequence of AES-256-GCM chunks. The plaintext is the stream of encoded
Events, each prefixed by its length, cut into chunks of ``chunk_bytes`` (the last one shorter and
flagged final). Every chunk is sealed under a key derived for this file alone, with a nonce made of
a per-file random prefix, the chunk index and the final flag, and associated data binding the hash
of the whole header (magic, version, Organization, Group, key id, salt, nonce prefix, chunk size),
the chunk index and the chunk's frame (its length and final flag). So:

- a flipped bit anywhere (header, frame or ciphertext) fails a tag (``check="tag"``);
- chunks swapped, dropped or duplicated change an index and fail a tag;
- a chunk from another log (another Group, Organization or just another file) has another file key;
- a log that stops before a chunk flagged final is ``truncated``; bytes after it are ``appended``.

Keys come from an Organization ``KeyProvider``; ``FileKeyProvider`` keeps them in 0600 files.

Command line (documented in ``docs/format/archive.md``)::

    python -m mwpstore.audit_log verify PATH --snapshot SNAP --keys DIR --trust PUBLIC_KEY
    python -m mwpstore.audit_log dump PATH --keys DIR --org ORG --group GROUP
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import struct
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any, Protocol

import blake3
import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import canonical, limits
from ._files import (
    Directory,
    KeyFileInvalid,
    create_secret_at,
    fsync_directory,
    makedirs_durable,
    open_below,
    open_directory,
    open_regular,
    read_file_capped,
    read_secret_at,
    remove_with_temp_copies_at,
    store_path,
    write_file_at,
)
from .errors import ArchiveInvalid, EventInvalid, InvalidCommand, MwpError, translate
from .messages import ZERO_HASH, Event, check_event, decode_event
from .redaction import tombstone_key
from .registry import apply_effects
from .snapshot import VerifiedSnapshot

# -- Format constants (docs/format/archive.md, "Layout") ------------------------------------------

MAGIC = b"MWPAUDT\x00"
FORMAT_VERSION = 1
KEY_BYTES = 32
TAG_BYTES = 16
SALT_BYTES = 16
NONCE_PREFIX_BYTES = 7
HEADER_FIXED_BYTES = 48
FRAME_BYTES = 8
RECORD_LENGTH_BYTES = 4
CHUNKS_MAX = 2**32 - 1
"""The chunk index is a 32-bit field of the nonce."""
DOMAIN_FILE_KEY = "mwpstore 2026 audit-log file key v1"
"""blake3 ``derive_key`` context: file key = derive(DOMAIN_FILE_KEY, org key || salt)."""
DOMAIN_CHUNK = b"mwpstore/audit-chunk/v1\x00"
"""First bytes of every chunk's associated data."""

_HEADER = struct.Struct("<8sHHI16s7sBBB6s")  # magic, version, header length, chunk bytes, salt, nonce prefix, k, o, g, reserved
assert _HEADER.size == HEADER_FIXED_BYTES
_FRAME = struct.Struct("<IB3s")  # ciphertext length, flags, reserved
assert _FRAME.size == FRAME_BYTES
_RECORD_LENGTH = struct.Struct("<I")
_FLAG_FINAL = 0x01

_KEY_ID_PATTERN = re.compile(r"[0-9a-f]{16}\Z")


# -- Keys --------------------------------------------------------------------------------------------


class KeyProvider(Protocol):
    """An Organization's audit-log keys. ``key_for`` raises ``KeyError`` for an unknown key id;
    anything else either call raises, but the engine's own errors, reaches the caller as
    ``InvalidCommand`` naming ``key_provider``."""

    def key_for(self, org: str, key_id: str) -> bytes: ...

    def current_key(self, org: str) -> tuple[str, bytes]: ...


def current_org_key(key_provider: KeyProvider, org: str) -> tuple[str, bytes]:
    """``key_provider.current_key(org)``, checked: a (key id, 32-byte key) pair, or
    ``InvalidCommand`` naming ``key_provider`` (a malformed answer, or anything but the engine's
    own errors raised by the call, ``KeyError`` for an unknown Organization included)."""
    try:
        answer = key_provider.current_key(org)
    except MwpError:
        raise
    except Exception as exc:
        raise _provider_failed("current_key", exc) from None
    if type(answer) is not tuple or len(answer) != 2:
        raise InvalidCommand("the key provider's current_key must return (key id, key)", field="key_provider")
    key_id, org_key = answer
    if type(key_id) is not str or _KEY_ID_PATTERN.match(key_id) is None or type(org_key) is not bytes or len(org_key) != KEY_BYTES:
        raise InvalidCommand("the key provider returned a malformed key", field="key_provider")
    return key_id, org_key


def _provider_failed(call: str, exc: Exception) -> InvalidCommand:
    """What an application's key provider raised, other than ``KeyError`` for an unknown key id
    and the engine's own errors, as ``InvalidCommand`` naming ``key_provider``."""
    return InvalidCommand(f"the key provider's {call} raised {type(exc).__name__}: {exc}"[:400], field="key_provider")


class FileKeyProvider:
    """Organization keys in files: ``<directory>/<org>/<key id>.key`` (32 bytes, mode 0600).

    ``<directory>/<org>/CURRENT`` names the key new audit logs use. The first ``current_key`` call
    for an Organization creates its key; ``rotate`` creates a new current key and keeps the old ones
    so older logs still decrypt. Deleting an old key file makes its logs unreadable (crypto-shredding).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._root, self._below = directory, ""

    @classmethod
    def _in_store(cls, store: str, relative: str) -> FileKeyProvider:
        """The provider of a store's own keys, ``<store>/<relative>``: every directory from the
        store down is opened never through a symbolic link (the store's path itself may be)."""
        provider = cls(os.path.join(store, relative))
        provider._root, provider._below = store, relative
        return provider

    def _org_directory(self, org: str) -> str:
        canonical.check_id(org, "org")
        return os.path.join(self.directory, org)

    def _open_org(self, org: str, *, create: bool) -> Directory:
        """``<directory>/<org>``, reached from the provider's directory (or, for a store's own, from
        the store) with ``O_NOFOLLOW`` at each name below it; every key file is then read, made or
        removed through its descriptor, so a link put in place of a directory on the way after
        this open changes nothing. With ``create`` (before a key is written) each directory is
        made 0700 if missing and must be this user's (``KeyFileInvalid``); without, a missing one
        is ``FileNotFoundError`` and a link or a file on the way is ``KeyFileInvalid`` (``type``)."""
        canonical.check_id(org, "org")
        relative = f"{self._below}/{org}" if self._below else org
        return open_below(
            self._root, relative, mode=0o700, create=create, private=create, private_root=create and not self._below, keys=True
        )

    def key_for(self, org: str, key_id: str) -> bytes:
        if type(key_id) is not str or _KEY_ID_PATTERN.match(key_id) is None:
            raise KeyError(key_id)
        try:
            directory = self._open_org(org, create=False)
        except FileNotFoundError:
            raise KeyError(key_id) from None
        with directory:
            key = read_secret_at(directory, f"{key_id}.key", KEY_BYTES)
        if key is None:
            raise KeyError(key_id)
        return key

    def current_key(self, org: str) -> tuple[str, bytes]:
        try:
            with self._open_org(org, create=False) as directory:
                current = self._read_current(directory)
        except FileNotFoundError:
            current = None
        if current is None:
            with self._open_org(org, create=True) as directory:
                key_id = self._new_key(directory)
                create_secret_at(directory, "CURRENT", key_id.encode("ascii"))  # first one wins
                current = self._read_current(directory)
                assert current is not None
        try:
            return current, self.key_for(org, current)
        except KeyError:  # its file was deleted (crypto-shredded): no new log is written under it
            directory_path = self._org_directory(org)
            path = os.path.join(directory_path, f"{current}.key")
            raise KeyFileInvalid(
                f"{directory_path}/CURRENT names key {current}, whose file {path} is gone; rotate to a new current key",
                path=path,
                reason="missing",
            ) from None

    def rotate(self, org: str) -> str:
        """Create a new key and make it current; returns its key id. Old keys stay readable."""
        with self._open_org(org, create=True) as directory:
            key_id = self._new_key(directory)
            write_file_at(directory, "CURRENT", key_id.encode("ascii"), mode=0o600)
        return key_id

    def shred(self, org: str, key_id: str) -> bool:
        """Crypto-shred key ``key_id`` of ``org``: delete its file, and any temporary copy of it
        that an interrupted write left beside it, durably. Every audit log encrypted under it is
        unreadable from then on. True if anything was deleted. Shredding the current key leaves
        ``current_key`` failing with ``KEY_FILE_INVALID`` (``missing``) until ``rotate``."""
        if type(key_id) is not str or _KEY_ID_PATTERN.match(key_id) is None:
            raise InvalidCommand("key_id must be a key id (16 lowercase hex digits)", field="key_id")
        path = os.path.join(self._org_directory(org), f"{key_id}.key")
        try:
            directory = self._open_org(org, create=False)
        except FileNotFoundError as exc:
            raise translate(exc, context=f"shredding {path}") from None
        with directory:
            name = f"{key_id}.key"
            _refuse_other_links(directory, name)
            # Held open across the deletion: a hard link made after the check (a backup tool running
            # meanwhile) keeps the key, and only the file's own link count, read once its names here
            # are gone, can say so.
            held = _open_key_file(directory, name)
            try:
                removed = remove_with_temp_copies_at(directory, name)
                info = None if held is None else os.fstat(held)
            except OSError as exc:
                raise translate(exc, context=f"shredding {path}") from None
            finally:
                if held is not None:
                    os.close(held)
        if info is not None and info.st_nlink:
            raise KeyFileInvalid(
                f"key file {path} was deleted, but {info.st_nlink} hard link(s) made to it during the shred keep "
                f"the key readable: remove them (find <mount> -xdev -inum {info.st_ino})",
                path=path,
                reason="links",
                links=info.st_nlink,
            )
        return removed

    @staticmethod
    def _new_key(directory: Directory) -> str:
        key_id = secrets.token_hex(8)
        create_secret_at(directory, f"{key_id}.key", secrets.token_bytes(KEY_BYTES))
        return key_id

    @staticmethod
    def _read_current(directory: Directory) -> str | None:
        data = read_file_capped("CURRENT", 64, missing_ok=True, directory=directory)
        if data is None:
            return None
        key_id = data.decode("ascii", "replace").strip()
        if _KEY_ID_PATTERN.match(key_id) is None:
            raise KeyFileInvalid(f"{directory.path}/CURRENT does not name a key id", path=directory.path, reason="current")
        return key_id


_NO_KEY_FILE_TO_HOLD = (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EPERM)
"""What the open of a key's name says when there is no key file to hold: missing, a link, a
socket, or a file this user may not read."""


def _open_key_file(directory: Directory, name: str) -> int | None:
    """A descriptor of the regular file ``name`` in ``directory``, never through a link and never
    waiting; None when there is none (missing, a link, anything else). Any other failure (``EIO``,
    ``EMFILE``…) is ``StorageFailed``: taken as no file, it let the shred delete the key and
    report it gone without the check for links made meanwhile that the descriptor serves."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory.fd)
    except OSError as exc:
        if exc.errno in _NO_KEY_FILE_TO_HOLD:
            return None
        raise translate(exc, context=f"shredding {directory.join(name)}") from None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except BaseException as exc:
        os.close(fd)  # an interrupt too: a descriptor of the key held past the shred would keep it readable
        if isinstance(exc, OSError):
            raise translate(exc, context=f"shredding {directory.join(name)}") from None
        raise
    os.close(fd)
    return None


def _refuse_other_links(directory: Directory, name: str) -> None:
    """``KeyFileInvalid`` (reason ``links``) if a name outside its own temporary copies links to the
    key file ``name`` of ``directory``: deleting it would leave the key readable through it, and
    shredding would report a key destroyed that is not."""
    path = directory.join(name)
    try:
        info = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
        copies = 0
        for entry in os.listdir(directory.fd):
            if re.fullmatch(rf"\.{re.escape(name)}\.[0-9a-f]{{16}}\.tmp", entry):
                with contextlib.suppress(FileNotFoundError):
                    other = os.stat(entry, dir_fd=directory.fd, follow_symlinks=False)
                    copies += (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise translate(exc, context=f"looking at {path}") from None
    others = info.st_nlink - 1 - copies
    if stat.S_ISREG(info.st_mode) and others > 0:
        raise KeyFileInvalid(
            f"key file {path} has {others} other hard link(s); shredding it would leave "
            f"the key readable through them: remove them first (find <mount> -xdev -samefile {path}), nothing was deleted",
            path=path,
            reason="links",
            links=others,
        )


# -- Results -----------------------------------------------------------------------------------------


class AuditLogInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an audit log holds: written by ``write_audit_log``, checked by the verifier."""

    path: str
    org: str
    group: str
    key_id: str
    chunks: int
    events: int
    bytes: int
    last_seq: int
    head_hash: bytes
    file_hash: str = ""
    """blake3 of the whole file, hex (set by ``write_audit_log``, computed while writing)."""


class _Header(msgspec.Struct, frozen=True):
    raw: bytes
    version: int
    chunk_bytes: int
    salt: bytes
    nonce_prefix: bytes
    key_id: str
    org: str
    group: str


# -- Shared sealing -----------------------------------------------------------------------------------


def _fail(check: str, message: str, **detail: Any) -> ArchiveInvalid:
    return ArchiveInvalid(f"audit log rejected ({check}): {message}", check=check, **detail)


def _file_key(org_key: bytes, salt: bytes) -> bytes:
    return blake3.blake3(org_key + salt, derive_key_context=DOMAIN_FILE_KEY).digest()


def _nonce(header: _Header, index: int, final: bool) -> bytes:
    return header.nonce_prefix + struct.pack(">IB", index, 1 if final else 0)


def _associated_data(header_hash: bytes, index: int, frame: bytes) -> bytes:
    return DOMAIN_CHUNK + header_hash + struct.pack(">Q", index) + frame


def _encode_header(
    *, chunk_bytes: int, salt: bytes, nonce_prefix: bytes, key_id: str, org: str, group: str
) -> bytes:
    names = [key_id.encode("ascii"), org.encode("ascii"), group.encode("ascii")]
    total = HEADER_FIXED_BYTES + sum(len(name) for name in names)
    fixed = _HEADER.pack(
        MAGIC, FORMAT_VERSION, total, chunk_bytes, salt, nonce_prefix, *(len(name) for name in names), b"\x00" * 6
    )
    return fixed + b"".join(names)


# -- Writing -------------------------------------------------------------------------------------------


def _write_sealed(
    directory: Directory,
    name: str,
    header_raw: bytes,
    sealer: _Sealer,
    events: Iterable[bytes],
    group: str,
    chunk_bytes: int,
    path: str,
) -> tuple[int, int, bytes, int, str]:
    """The audit log's bytes into ``name`` of ``directory`` under a fresh temporary name
    (``O_CREAT | O_EXCL | O_NOFOLLOW``), synced and renamed into place, every step through the
    directory's descriptor; (Events, last seq, head hash, bytes, file hash)."""
    temp = f".{name}.{secrets.token_hex(8)}.tmp"
    count, last_seq, head_hash = 0, 0, ZERO_HASH
    file_hasher = blake3.blake3()
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory.fd)
        try:
            handle = open(fd, "wb")
        except BaseException:
            os.close(fd)  # not yet the file object's to close (an interrupt as open() returns aside)
            raise
        with handle:

            def emit(piece: bytes) -> None:
                file_hasher.update(piece)
                handle.write(piece)

            emit(header_raw)
            pending = bytearray()
            for data in events:
                event = _checked_input_event(data, group, last_seq + 1)
                pending += _RECORD_LENGTH.pack(len(data))
                pending += data
                count, last_seq, head_hash = count + 1, event.seq, event.hash
                while len(pending) > chunk_bytes:  # keep a remainder for the final chunk
                    emit(sealer.seal(bytes(pending[:chunk_bytes]), final=False))
                    del pending[:chunk_bytes]
            emit(sealer.seal(bytes(pending), final=True))
            handle.flush()
            os.fsync(handle.fileno())
            size = handle.tell()
        os.replace(temp, name, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
        fsync_directory(directory)
    except BaseException as exc:
        try:
            os.unlink(temp, dir_fd=directory.fd)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise translate(exc, context=f"writing audit log {path}") from None
        raise
    return count, last_seq, head_hash, size, file_hasher.hexdigest()


def write_audit_log(
    path: str,
    *,
    org: str,
    group: str,
    events: Iterable[bytes],
    key_provider: KeyProvider,
    chunk_bytes: int = limits.AUDIT_CHUNK_BYTES,
    directory: Directory | None = None,
) -> AuditLogInfo:
    """Encrypt ``events`` (encoded Events of ``group``, seqs 1, 2, ... in order) into ``path``.

    The file appears atomically (temp file, fsync, rename, directory fsync) with mode 0600, and
    only once complete; missing parent directories are created durably. Raises ``InvalidCommand``
    for Events of another Group or out of order. ``directory``, the directory of ``path`` already
    open (a store's ``archive/<group>/``), is written through its descriptor and nothing is made.
    """
    canonical.check_id(org, "org")
    canonical.check_id(group, "group")
    if type(chunk_bytes) is not int or not 1 <= chunk_bytes <= limits.AUDIT_CHUNK_BYTES_MAX - TAG_BYTES:
        raise InvalidCommand(f"chunk_bytes must be 1..{limits.AUDIT_CHUNK_BYTES_MAX - TAG_BYTES}", field="chunk_bytes")
    key_id, org_key = current_org_key(key_provider, org)
    salt = secrets.token_bytes(SALT_BYTES)
    header_raw = _encode_header(
        chunk_bytes=chunk_bytes,
        salt=salt,
        nonce_prefix=secrets.token_bytes(NONCE_PREFIX_BYTES),
        key_id=key_id,
        org=org,
        group=group,
    )
    header = _parse_header(header_raw)
    sealer = _Sealer(header, AESGCM(_file_key(org_key, salt)))
    with contextlib.ExitStack() as stack:
        if directory is None:
            parent = os.path.dirname(os.path.abspath(store_path(path)))
            makedirs_durable(parent)
            directory = stack.enter_context(open_directory(parent, context=f"writing audit log {path}"))
        count, last_seq, head_hash, size, file_hash = _write_sealed(
            directory, os.path.basename(path), header_raw, sealer, events, group, chunk_bytes, path
        )
    return AuditLogInfo(
        path=path,
        org=org,
        group=group,
        key_id=key_id,
        chunks=sealer.index,
        events=count,
        bytes=size,
        last_seq=last_seq,
        head_hash=head_hash,
        file_hash=file_hash,
    )


def _checked_input_event(data: object, group: str, expected_seq: int) -> Event:
    if type(data) is not bytes or not data or len(data) > limits.EVENT_BYTES_MAX:
        raise InvalidCommand(f"events must be encoded Events of 1..{limits.EVENT_BYTES_MAX} bytes", field="events")
    try:
        event = decode_event(data)
    except EventInvalid as exc:
        raise InvalidCommand(f"not an encoded Event: {exc.message}", field="events") from None
    if event.group != group or event.seq != expected_seq:
        raise InvalidCommand(
            f"the audit log of {group!r} needs its Events in order from seq 1; got {event.group!r} seq {event.seq}"
            f" where seq {expected_seq} was due",
            field="events",
        )
    return event


class _Sealer:
    def __init__(self, header: _Header, cipher: AESGCM) -> None:
        self.header = header
        self.header_hash = blake3.blake3(header.raw).digest()
        self.cipher = cipher
        self.index = 0

    def seal(self, plaintext: bytes, *, final: bool) -> bytes:
        if self.index >= CHUNKS_MAX:
            raise InvalidCommand("the history needs more chunks than the nonce allows; raise chunk_bytes", field="events")
        frame = _FRAME.pack(len(plaintext) + TAG_BYTES, _FLAG_FINAL if final else 0, b"\x00\x00\x00")
        aad = _associated_data(self.header_hash, self.index, frame)
        sealed = self.cipher.encrypt(_nonce(self.header, self.index, final), plaintext, aad)
        self.index += 1
        return frame + sealed


# -- Reading -------------------------------------------------------------------------------------------


def _parse_header(raw: bytes) -> _Header:
    magic, version, total, chunk_bytes, salt, nonce_prefix, k, o, g, reserved = _HEADER.unpack_from(raw)
    if magic != MAGIC or reserved != b"\x00" * 6:
        raise _fail("format", "not a mwpstore audit log (bad magic or reserved bytes)")
    if version != FORMAT_VERSION:
        raise _fail("version", f"format version {version} is not {FORMAT_VERSION}")
    if total != HEADER_FIXED_BYTES + k + o + g or len(raw) != total:
        raise _fail("format", "header lengths do not add up")
    if not 1 <= chunk_bytes <= limits.AUDIT_CHUNK_BYTES_MAX - TAG_BYTES:
        raise _fail("size", f"chunk size {chunk_bytes} is outside 1..{limits.AUDIT_CHUNK_BYTES_MAX - TAG_BYTES}")
    names = []
    offset = HEADER_FIXED_BYTES
    for length in (k, o, g):
        try:
            names.append(raw[offset : offset + length].decode("ascii"))
        except UnicodeDecodeError:
            raise _fail("format", "header names are not ASCII") from None
        offset += length
    key_id, org, group = names
    if _KEY_ID_PATTERN.match(key_id) is None:
        raise _fail("format", "header key id is malformed")
    for name, value in (("org", org), ("group", group)):
        try:
            canonical.check_id(value, name)
        except InvalidCommand as exc:
            raise _fail("format", f"header {name}: {exc.message}") from None
    return _Header(raw, version, chunk_bytes, salt, nonce_prefix, key_id, org, group)


def _read_exact(handle: IO[bytes], size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise _fail("truncated", f"the file ends inside a {size}-byte field")
    return data


def _read_header(handle: IO[bytes]) -> _Header:
    fixed = handle.read(HEADER_FIXED_BYTES)
    if len(fixed) < HEADER_FIXED_BYTES:
        if fixed and not MAGIC.startswith(fixed[: len(MAGIC)]):
            raise _fail("format", "not a mwpstore audit log")
        raise _fail("truncated", "the file ends inside the header")
    magic, version, total, *_ = _HEADER.unpack_from(fixed)
    if magic != MAGIC:
        raise _fail("format", "not a mwpstore audit log (bad magic)")
    if total < HEADER_FIXED_BYTES or total > HEADER_FIXED_BYTES + 3 * 255:
        raise _fail("format", "header length is impossible")
    return _parse_header(fixed + _read_exact(handle, total - HEADER_FIXED_BYTES))


def _walk_frames(handle: IO[bytes], header: _Header, file_bytes: int) -> int:
    """Check the chunk structure without decrypting; returns the number of chunks.

    Finds truncation and appended data before any record is released to the caller.
    """
    offset = len(header.raw)
    index = 0
    while True:
        if offset == file_bytes:
            raise _fail("truncated", f"the log ends after {index} chunks without a final chunk", chunk=index)
        if file_bytes - offset < FRAME_BYTES:
            raise _fail("truncated", f"the log ends inside the frame of chunk {index}", chunk=index)
        handle.seek(offset)
        length, flags = _check_frame(handle.read(FRAME_BYTES), header, index)
        offset += FRAME_BYTES + length
        if offset > file_bytes:
            raise _fail("truncated", f"the log ends inside chunk {index}", chunk=index)
        index += 1
        if flags & _FLAG_FINAL:
            if offset != file_bytes:
                raise _fail("appended", f"{file_bytes - offset} bytes follow the final chunk", chunk=index)
            return index


def _check_frame(frame: bytes, header: _Header, index: int) -> tuple[int, int]:
    length, flags, reserved = _FRAME.unpack(frame)
    if flags & ~_FLAG_FINAL or reserved != b"\x00\x00\x00":
        raise _fail("format", f"chunk {index} has unknown flags", chunk=index)
    if length > limits.AUDIT_CHUNK_BYTES_MAX:
        raise _fail("size", f"chunk {index} claims {length} bytes", chunk=index)
    if flags & _FLAG_FINAL:
        if not TAG_BYTES <= length <= header.chunk_bytes + TAG_BYTES:
            raise _fail("format", f"final chunk {index} has an impossible length", chunk=index)
    elif length != header.chunk_bytes + TAG_BYTES:
        raise _fail("format", f"chunk {index} is not a full chunk but is not final", chunk=index)
    if index >= CHUNKS_MAX:
        raise _fail("size", "too many chunks", chunk=index)
    return length, flags


def read_audit_log(path: str, *, key_provider: KeyProvider, org: str, group: str) -> Iterator[bytes]:
    """Decrypt and verify an audit log; iterate its records (encoded Events) in order.

    The header, Organization and Group binding, key and chunk structure (final chunk present,
    nothing appended) are checked before this returns. Each chunk is authenticated before any of
    its records is yielded; a chunk that fails raises ``ArchiveInvalid`` from the iterator, after
    the records of the chunks before it, which are authentic. A caller that must act on the whole
    log or nothing collects it first (``verify_audit_log_against_snapshot`` does).
    """
    try:
        handle = open_regular(path)
    except OSError as exc:
        raise translate(exc, context=f"opening audit log {path}") from None
    try:
        file_bytes = os.fstat(handle.fileno()).st_size
        header = _read_header(handle)
        if header.org != org or header.group != group:
            raise _fail("binding", f"the log is for {header.org}/{header.group}, not {org}/{group}")
        try:
            org_key = key_provider.key_for(org, header.key_id)
        except KeyError:
            raise _fail("key", f"organization {org!r} has no key {header.key_id!r}") from None
        except MwpError:
            raise
        except Exception as exc:
            raise _provider_failed("key_for", exc) from None
        if type(org_key) is not bytes or len(org_key) != KEY_BYTES:
            raise _fail("key", f"key {header.key_id!r} is not {KEY_BYTES} bytes")
        chunks = _walk_frames(handle, header, file_bytes)
        handle.seek(len(header.raw))
    except BaseException as exc:
        handle.close()
        if isinstance(exc, OSError):  # EIO from a bad sector, as the header or the frames are read
            raise translate(exc, context=f"reading audit log {path}") from None
        raise
    return _records(handle, header, AESGCM(_file_key(org_key, header.salt)), chunks, path)


def _records(handle: IO[bytes], header: _Header, cipher: AESGCM, chunks: int, path: str) -> Iterator[bytes]:
    try:
        yield from _chunk_records(handle, header, cipher, chunks)
    except OSError as exc:
        raise translate(exc, context=f"reading audit log {path}") from None
    finally:
        handle.close()


def _chunk_records(handle: IO[bytes], header: _Header, cipher: AESGCM, chunks: int) -> Iterator[bytes]:
    header_hash = blake3.blake3(header.raw).digest()
    pending = bytearray()
    for index in range(chunks):
        frame = _read_exact(handle, FRAME_BYTES)
        length, flags = _check_frame(frame, header, index)
        final = bool(flags & _FLAG_FINAL)
        if final != (index == chunks - 1):
            raise _fail("format", f"chunk {index} changed while being read", chunk=index)
        sealed = _read_exact(handle, length)
        try:
            plaintext = cipher.decrypt(_nonce(header, index, final), sealed, _associated_data(header_hash, index, frame))
        except InvalidTag:
            raise _fail(
                "tag", f"chunk {index} does not authenticate (tampered, reordered or from another log)", chunk=index
            ) from None
        pending += plaintext
        records, consumed = _split_records(pending, index)
        del pending[:consumed]
        yield from records
    if pending:
        raise _fail("format", "the final chunk ends inside a record")


def _split_records(buffer: bytearray, index: int) -> tuple[list[bytes], int]:
    records = []
    offset = 0
    view = memoryview(buffer)
    try:
        while len(buffer) - offset >= RECORD_LENGTH_BYTES:
            (length,) = _RECORD_LENGTH.unpack_from(buffer, offset)
            if length == 0 or length > limits.EVENT_BYTES_MAX:
                raise _fail("format", f"record length {length} in chunk {index} is impossible", chunk=index)
            end = offset + RECORD_LENGTH_BYTES + length
            if end > len(buffer):
                break
            records.append(bytes(view[offset + RECORD_LENGTH_BYTES : end]))
            offset = end
    finally:
        view.release()
    return records, offset


def read_audit_log_header(path: str) -> dict[str, Any]:
    """The unauthenticated header fields (org, group, key id, chunk size), for tools and errors."""
    try:
        with open_regular(path) as handle:
            header = _read_header(handle)
    except OSError as exc:
        raise translate(exc, context=f"reading audit log {path}") from None
    return {"org": header.org, "group": header.group, "key_id": header.key_id, "chunk_bytes": header.chunk_bytes}


# -- Verification against the final snapshot ---------------------------------------------------------


def verify_audit_log_against_snapshot(
    path: str, snapshot: VerifiedSnapshot, key_provider: KeyProvider, *, replay: bool = True
) -> AuditLogInfo:
    """Check that the audit log is the complete, authentic history that ends in ``snapshot``.

    Every chunk authenticates; every record is an Event of the snapshot's Group that verifies and
    links to the previous one's hash (from the zero hash); seqs run 1, 2, ... without a gap; an
    Event lacks its payload exactly when the snapshot holds a tombstone for its sequence (the hash
    chain commits to the payload's hash, not to the payload, so only this catches a payload
    removed without ``event.redact``); the last Event's seq and hash are the snapshot's seq and
    head hash. With ``replay``, folding every Event's effects reproduces the snapshot's aggregates
    exactly. Raises ``ArchiveInvalid``.
    """
    header = read_audit_log_header_checked(path)
    redacted = _tombstoned_sequences(snapshot.aggregates)
    states: dict[str, dict[str, Any]] = {}
    revisions: dict[str, int] = {}
    previous = ZERO_HASH
    count = 0
    for data in read_audit_log(path, key_provider=key_provider, org=snapshot.org, group=snapshot.group):
        try:
            event = check_event(decode_event(data), expected_prev_hash=previous)
        except EventInvalid as exc:
            raise _fail("event", f"record {count + 1}: {exc.message}", seq=count + 1) from None
        except RecursionError:
            raise _fail("event", f"record {count + 1} nests too deeply to decode", seq=count + 1) from None
        if event.group != snapshot.group:
            raise _fail("binding", f"record {count + 1} is an Event of group {event.group!r}", seq=event.seq)
        if event.seq != count + 1:
            raise _fail("sequence", f"Event seq {event.seq} where {count + 1} was due", seq=event.seq)
        if (event.body is None) != (event.seq in redacted):
            raise _fail(
                "tombstone",
                f"Event {event.seq} has no payload and the final snapshot holds no tombstone for it"
                if event.body is None
                else f"Event {event.seq} was redacted (the final snapshot holds its tombstone) but still has its payload",
                seq=event.seq,
            )
        if replay:
            apply_effects(states, revisions, event.effects)
        previous = event.hash
        count += 1
    if count != snapshot.seq or previous != snapshot.head_hash:
        raise _fail(
            "snapshot",
            f"the log ends at seq {count} (head {previous.hex()[:16]}), the snapshot is at seq {snapshot.seq}"
            f" (head {snapshot.head_hash.hex()[:16]})",
        )
    if replay and (states, revisions) != snapshot.states_and_revisions():
        raise _fail("state", "replaying the log does not reproduce the snapshot's aggregates")
    return AuditLogInfo(
        path=path,
        org=snapshot.org,
        group=snapshot.group,
        key_id=header["key_id"],
        chunks=header["chunks"],
        events=count,
        bytes=header["bytes"],
        last_seq=count,
        head_hash=previous,
    )


def _tombstoned_sequences(aggregates: Iterable[Any]) -> set[int]:
    """The sequences the snapshot's ``tombstone:<seq>`` aggregates redact."""
    out = set()
    for effect in aggregates:
        seq = effect.aggregate[len(_TOMBSTONE_PREFIX) :]
        if effect.aggregate.startswith(_TOMBSTONE_PREFIX) and effect.state is not None and seq.isascii() and seq.isdigit():
            out.add(int(seq))
    return out


_TOMBSTONE_PREFIX = tombstone_key(0)[:-1]


def read_audit_log_header_checked(path: str) -> dict[str, Any]:
    """Header fields plus the chunk count and file size, after the structural walk."""
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            header = _read_header(handle)
            chunks = _walk_frames(handle, header, size)
    except OSError as exc:
        raise translate(exc, context=f"reading audit log {path}") from None
    return {"org": header.org, "group": header.group, "key_id": header.key_id, "chunks": chunks, "bytes": size}


# -- Command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m mwpstore.audit_log verify|dump ...``; prints one JSON object; exit 0 ok, 1 invalid, 2 usage."""
    import argparse

    from .snapshot import Keyring, read_snapshot_file, verify_snapshot

    parser = argparse.ArgumentParser(prog="python -m mwpstore.audit_log", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="verify an audit log against the Group's signed final snapshot")
    verify.add_argument("path", help="the audit log file")
    verify.add_argument("--snapshot", required=True, help="the signed final snapshot file")
    verify.add_argument("--keys", required=True, help="the Organization key directory (FileKeyProvider)")
    verify.add_argument(
        "--trust",
        action="append",
        required=True,
        help="a trusted snapshot public key: 64 hex characters or a .pub file (repeatable)",
    )
    verify.add_argument("--org", help="expected Organization (default: the snapshot's)")
    verify.add_argument("--group", help="expected Group (default: the snapshot's)")
    verify.add_argument("--no-replay", action="store_true", help="skip re-applying effects against the snapshot")
    dump = commands.add_parser("dump", help="decrypt an audit log and print its Events as JSON lines")
    dump.add_argument("path")
    dump.add_argument("--keys", required=True)
    dump.add_argument("--org", required=True)
    dump.add_argument("--group", required=True)
    arguments = parser.parse_args(argv)
    encoder = msgspec.json.Encoder(order="sorted")
    out = sys.stdout.buffer
    try:
        provider = FileKeyProvider(arguments.keys)
        if arguments.command == "dump":
            for data in read_audit_log(arguments.path, key_provider=provider, org=arguments.org, group=arguments.group):
                out.write(encoder.encode(_event_json(decode_event(data))) + b"\n")
            return 0
        keyring = Keyring()
        for trusted in arguments.trust:
            if re.fullmatch(r"[0-9a-fA-F]{64}", trusted):
                keyring.add(bytes.fromhex(trusted))
            else:
                keyring.add_file(trusted)
        snapshot = verify_snapshot(
            read_snapshot_file(arguments.snapshot), keyring=keyring, org=arguments.org, group=arguments.group
        )
        info = verify_audit_log_against_snapshot(
            arguments.path, snapshot, provider, replay=not arguments.no_replay
        )
    except MwpError as exc:
        out.write(encoder.encode({"ok": False, **exc.to_dict()}) + b"\n")
        return 1
    report = msgspec.to_builtins(info)
    report["head_hash"] = info.head_hash.hex()
    if not report.get("file_hash"):  # only write_audit_log computes it: no empty stand-in
        report.pop("file_hash", None)
    out.write(encoder.encode({"ok": True, "replayed": not arguments.no_replay, **report}) + b"\n")
    return 0


def _event_json(event: Event) -> dict[str, Any]:
    value = msgspec.to_builtins(msgspec.structs.asdict(event))
    for name in ("content_hash", "payload_hash", "prev_hash", "hash"):
        value[name] = getattr(event, name).hex()
    value["effects"] = [{"aggregate": e.aggregate, "revision": e.revision, "state": e.state} for e in event.effects]
    return value


if __name__ == "__main__":
    sys.exit(main())
