"""Signed snapshots of one Group's authoritative state at a sequence (``docs/format/snapshot.md``).

A snapshot file is a fixed 40-byte prefix, a canonical JSON header, an Ed25519 signature over a
domain tag and the exact header bytes, and the state: every aggregate of the Group as a sorted
list of ``Effect(aggregate, revision, state)`` encoded with msgpack (sorted map keys). The header
commits to the state by its blake3 hash and length, so one signature covers everything.

``verify_snapshot`` is the only way to turn bytes into a ``VerifiedSnapshot``. It fails closed, in
this order, raising ``SnapshotInvalid`` whose ``check`` names the failed step:

1. ``size``      the file and its declared lengths are within the caps and add up exactly
                 (truncated and appended files fail here), before anything is parsed;
2. ``format``    the magic and reserved prefix bytes (nothing else is parsed yet);
3. ``key``       the key id in the prefix names a key in the verifier's ``Keyring``;
4. ``signature`` Ed25519 over ``DOMAIN_SNAPSHOT + header bytes`` verifies with that key; then the
                 header must be canonical JSON (``format``) and name the same key id (``key``);
5. ``hash``      the state's length and blake3 hash equal the header's;
6. ``version``   format and schema versions are ones this code reads;
7. ``binding``   the Organization and Group are the ones the caller expects;
8. ``sequence``  the sequence is not below the caller's high-water mark (no rollback);
9. ``format``    the state decodes to strictly sorted, well-formed aggregates.

Nothing is returned unless every step passed.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import operator
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import blake3
import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import _canonical_c, canonical, failpoints, limits
from ._files import (
    Directory,
    KeyFileInvalid,
    create_secret_at,
    fsync_directory,
    makedirs_durable,
    open_below,
    open_child,
    open_directory_if_any,
    read_file_capped,
    read_secret_at,
    store_path,
    write_file_at,
    write_file_atomic,
)
from .errors import InvalidCommand, LimitExceeded, NotFound, SnapshotInvalid, StorageFailed, translate
from .messages import HASH_BYTES, Effect
from .registry import public_key_is_usable

# -- Format constants (docs/format/snapshot.md, "Layout") ------------------------------------------

MAGIC = b"MWPSNAP\x00"
FORMAT_VERSION = 1
"""Version of the file layout and header fields."""
SCHEMA_VERSION = 1
"""Version of the aggregate state schema (the work model's state dicts)."""
KEY_ID_CHARS = 16
"""A key id is the first 8 bytes of blake3(raw public key), as 16 lowercase hex characters."""
PREFIX_BYTES = 8 + 2 + 2 + 4 + 8 + KEY_ID_CHARS  # magic, version, reserved, header length, state length, key id
SIGNATURE_BYTES = limits.SIGNATURE_BYTES
SNAPSHOT_FILE_BYTES_MAX = (
    PREFIX_BYTES + limits.SNAPSHOT_HEADER_BYTES_MAX + SIGNATURE_BYTES + limits.SNAPSHOT_STATE_BYTES_MAX
)
DOMAIN_SNAPSHOT = b"mwpstore/snapshot/v1\x00"
"""Signed bytes are ``DOMAIN_SNAPSHOT + header bytes``: a snapshot signature can never be replayed
as the signature of a Command or anything else the same key might sign."""

_PREFIX = struct.Struct("<8sHHIQ16s")
assert _PREFIX.size == PREFIX_BYTES

_SEED_BYTES = 32


# -- Header and result types -----------------------------------------------------------------------


class SnapshotHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The signed header. Hashes are lowercase hex so the header reads as plain JSON."""

    format_version: int
    schema_version: int
    org: str
    group: str
    seq: int
    head_hash: str
    state_hash: str
    state_bytes: int
    aggregates: int
    created_at_ms: int
    key_id: str


class VerifiedSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot that passed every check of ``verify_snapshot``; the only way to obtain one."""

    org: str
    group: str
    seq: int
    head_hash: bytes
    aggregates: list[Effect]
    key_id: str
    created_at_ms: int

    def states_and_revisions(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """The aggregates as ``(states, revisions)``; a deleted aggregate keeps only its revision."""
        states: dict[str, dict[str, Any]] = {}
        revisions: dict[str, int] = {}
        for effect in self.aggregates:
            revisions[effect.aggregate] = effect.revision
            if effect.state is not None:
                states[effect.aggregate] = effect.state
        return states, revisions


class SnapshotRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where to fetch a signed snapshot and how to recognise it: what ``CURSOR_TOO_OLD`` carries.

    ``location`` is a path relative to the store (or an opaque id the server resolves);
    ``file_hash`` is blake3 of the whole file, hex. The reference is a hint, not a proof: the
    fetched bytes are checked against ``file_hash`` and then fully verified.
    """

    org: str
    group: str
    seq: int
    location: str
    file_hash: str
    file_bytes: int
    key_id: str

    def to_dict(self) -> dict[str, Any]:
        fields: dict[str, Any] = msgspec.to_builtins(self)
        return fields

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> SnapshotRef:
        if not isinstance(value, Mapping):
            raise SnapshotInvalid(f"not a snapshot reference: a {type(value).__name__}, not a mapping", check="format")
        try:
            # any error of the caller's mapping too (a Mapping whose keys() names a key its
            # __getitem__ does not have): a malformed reference, not a KeyError from here
            return msgspec.convert(dict(value), cls)
        except Exception as exc:
            raise SnapshotInvalid(f"not a snapshot reference: {type(exc).__name__}: {exc}"[:300], check="format") from None


# -- Keys --------------------------------------------------------------------------------------------


def key_id_of(public_key: bytes) -> str:
    """The key id of a raw 32-byte Ed25519 public key."""
    return blake3.blake3(public_key).hexdigest()[:KEY_ID_CHARS]


class Keyring:
    """The public keys a verifier trusts, by key id. Holding several at once allows rotation:
    trust the new key, start signing with it, stop trusting the old one once its snapshots expire."""

    def __init__(self, public_keys: Iterable[bytes] = ()) -> None:
        self._keys: dict[str, tuple[bytes, Ed25519PublicKey]] = {}
        if isinstance(public_keys, (str, bytes, bytearray, memoryview)) or not isinstance(public_keys, Iterable):
            # one key's bytes would iterate as ints: a list of keys is asked for
            raise InvalidCommand("public_keys must be an iterable of 32-byte public keys (a list, not one key)", field="public_keys")
        for public_key in public_keys:
            self.add(public_key)

    def add(self, public_key: bytes) -> str:
        """Trust ``public_key`` (32 raw bytes); returns its key id."""
        if type(public_key) is not bytes or len(public_key) != limits.PUBLIC_KEY_BYTES:
            raise InvalidCommand(f"a public key is {limits.PUBLIC_KEY_BYTES} raw bytes", field="public_key")
        try:
            loaded = Ed25519PublicKey.from_public_bytes(public_key)
        except ValueError:
            raise InvalidCommand("not an Ed25519 public key", field="public_key") from None
        if not public_key_is_usable(public_key):
            # Ed25519 verification accepts small-order keys, and for those one fixed signature
            # verifies every header: trusting one would let anyone sign any snapshot.
            raise InvalidCommand(
                "not a usable Ed25519 public key (small order or not a canonical curve point)", field="public_key"
            )
        key_id = key_id_of(public_key)
        self._keys[key_id] = (public_key, loaded)
        return key_id

    def add_file(self, path: str) -> str:
        """Trust the public key in ``path`` (64 hex characters, as written by ``SigningKey``)."""
        data = read_file_capped(path, 4096)
        try:
            public_key = bytes.fromhex((data or b"").decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise InvalidCommand(f"{path} does not hold a hex public key", field="public_key") from None
        return self.add(public_key)

    def remove(self, key_id: str) -> None:
        if type(key_id) is str:  # key ids are text: anything else names no key here
            self._keys.pop(key_id, None)

    def public_key(self, key_id: str) -> bytes | None:
        entry = self._keys.get(key_id) if type(key_id) is str else None
        return entry[0] if entry else None

    def _verifier(self, key_id: str) -> Ed25519PublicKey | None:
        entry = self._keys.get(key_id)
        return entry[1] if entry else None

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return type(key_id) is str and key_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)


SIGNING_KEY_NAME = "snapshot-signing"
"""A store's signing key file is ``keys/<this>.key``, its public key ``keys/<this>.pub``."""


class SigningKey:
    """An Ed25519 key that signs snapshots. ``load_or_create`` keeps it in a 0600 file."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes_raw()
        self.key_id: str = key_id_of(self.public_key)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        if type(seed) is not bytes or len(seed) != _SEED_BYTES:
            raise InvalidCommand(f"a signing key seed is {_SEED_BYTES} bytes", field="seed")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, directory: str | Directory, *, name: str = SIGNING_KEY_NAME) -> SigningKey:
        """Load ``directory/<name>.key``, generating it on first use.

        The key file holds the raw 32-byte seed, mode 0600, created atomically and never replaced
        (two processes racing both end up with the same key). A key file with group or other
        permission bits, another owner, or the wrong size raises ``KeyFileInvalid``. The public
        key is also written to ``<name>.pub`` (hex) for verifiers to trust. ``directory`` (made
        0700 if missing) must be this user's and no symbolic link; every file is read and written
        through its descriptor (a store passes its ``keys/`` already open).
        """
        canonical.check_id(name, "name")
        with _key_directory(directory) as keys:
            return cls._load_or_create_at(keys, name)

    @classmethod
    def _load_or_create_at(cls, keys: Directory, name: str) -> SigningKey:
        seed = read_secret_at(keys, f"{name}.key", _SEED_BYTES)
        if seed is None:
            fresh = Ed25519PrivateKey.generate().private_bytes_raw()
            create_secret_at(keys, f"{name}.key", fresh)
            seed = read_secret_at(keys, f"{name}.key", _SEED_BYTES)  # ours, or the one a racing process linked first
            if seed is None:
                path = keys.join(f"{name}.key")
                raise KeyFileInvalid(f"key file {path} vanished while being created", path=path, reason="missing")
        key = cls.from_seed(seed)
        expected = key.public_key.hex().encode("ascii") + b"\n"
        if _read_public_key_file(keys, f"{name}.pub") != expected:
            write_file_at(keys, f"{name}.pub", expected, mode=0o644)
        return key

    @classmethod
    def rotate(cls, directory: str | Directory, *, retire: bool = True, name: str = SIGNING_KEY_NAME) -> SigningKey:
        """Replace ``directory/<name>.key`` with a new key; return the new key.

        With ``retire`` (the default) the old public key is first written, durably, to
        ``directory/retired/<key id>.pub``: ``retired_public_keys`` reads it back, so a store goes
        on verifying what the old key signed, and nothing signs with it again. ``retire=False``
        drops the old key altogether (it was compromised). The old seed is gone either way.

        Each step is atomic: a crash leaves the old key current (retired or not yet), or the new
        one current with the old one retired; ``rotate`` can simply be run again.
        """
        if type(retire) is not bool:  # a falsy non-bool (None, 0) would have dropped the old key
            raise InvalidCommand("retire must be True or False", field="retire")
        canonical.check_id(name, "name")
        with _key_directory(directory) as keys:
            current = cls.load_or_create(keys, name=name)
            if retire:
                # synced in keys/ even when found in place: the retired key must outlive a power loss
                with open_child(keys, RETIRED_DIRECTORY, mode=0o700, private=True, sync=True) as retired:
                    write_file_at(retired, f"{current.key_id}.pub", _public_line(current.public_key), mode=0o600)
            failpoints.hit("keys.after_retire")
            fresh = Ed25519PrivateKey.generate().private_bytes_raw()
            write_file_at(keys, f"{name}.key", fresh, mode=0o600)
            return cls.load_or_create(keys, name=name)  # also rewrites <name>.pub

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)


RETIRED_DIRECTORY = "retired"
"""Under a key directory: the public keys a store retired, one ``<key id>.pub`` file each."""

_RETIRED_NAME = re.compile(r"[0-9a-f]{%d}\.pub" % KEY_ID_CHARS)


def _public_line(public_key: bytes) -> bytes:
    return public_key.hex().encode("ascii") + b"\n"


@contextlib.contextmanager
def _key_directory(directory: str | Directory) -> Iterator[Directory]:
    """``directory`` as given (a :class:`Directory` a store opened), or opened from its parent:
    the key directory itself never through a symbolic link, made 0700 if missing, and private."""
    if isinstance(directory, Directory):
        yield directory
        return
    path = os.path.abspath(store_path(directory))
    with open_below(os.path.dirname(path), os.path.basename(path), mode=0o700, private=True) as opened:
        yield opened


def _read_public_key_file(keys: Directory, name: str) -> bytes | None:
    """What ``<name>.pub`` holds, None if missing or a symbolic link (replaced by the rename that
    rewrites it; nothing is read or written through it)."""
    try:
        return read_file_capped(name, 4096, missing_ok=True, directory=keys)
    except StorageFailed as exc:
        if exc.detail.get("errno") == errno.ELOOP:
            return None
        raise


def drop_retired_key(directory: str | Directory, key_id: str) -> None:
    """Stop trusting the retired public key ``key_id`` (found compromised after it was retired):
    delete ``directory/retired/<key id>.pub``, durably. What it signed no longer verifies with
    ``retired_public_keys``' keys; take new snapshots of the Groups it signed.

    ``InvalidCommand`` (``key_id``) for a string that is no key id, ``NotFound`` when no such key
    is retired (the current key is not: rotate it with ``retire=False`` instead).
    """
    if type(key_id) is not str or _RETIRED_NAME.fullmatch(f"{key_id}.pub") is None:
        raise InvalidCommand(f"a key id is {KEY_ID_CHARS} lowercase hex characters", field="key_id")
    name = f"{key_id}.pub"
    with _existing_retired(directory) as retired:
        if retired is None:
            raise NotFound(f"no retired key {key_id} under {os.path.join(store_path(directory), RETIRED_DIRECTORY)}", field="key_id")
        try:
            os.unlink(name, dir_fd=retired.fd)
        except FileNotFoundError:
            raise NotFound(f"no retired key {key_id} under {retired.path}", field="key_id") from None
        except OSError as exc:
            raise translate(exc, context=f"removing {retired.join(name)}") from None
        fsync_directory(retired)


@contextlib.contextmanager
def _existing_retired(directory: str | Directory) -> Iterator[Directory | None]:
    """``directory/retired`` opened never through a symbolic link (``KeyFileInvalid``, reason
    ``type``), or None if it (or ``directory``) does not exist."""
    try:
        with contextlib.ExitStack() as stack:
            keys = directory if isinstance(directory, Directory) else stack.enter_context(open_directory_if_any(directory))
            if keys is None:
                yield None
                return
            try:
                retired = stack.enter_context(open_child(keys, RETIRED_DIRECTORY, create=False, keys=True))
            except FileNotFoundError:
                yield None
                return
            yield retired
    except OSError as exc:
        raise translate(exc, context=f"opening {os.path.join(os.fspath(directory), RETIRED_DIRECTORY)}") from None


def retired_public_keys(directory: str | Directory) -> list[bytes]:
    """The public keys retired under ``directory/retired`` (by ``SigningKey.rotate``), by key id.

    The files are trusted like the key itself: each must be a regular file owned by this user with
    mode 0600, named by the key id of the public key it holds. Anything else there (except an
    interrupted write's temporary file) raises ``KeyFileInvalid``: a trust store is never read past
    a file it cannot account for.
    """
    with _existing_retired(directory) as retired:
        if retired is None:
            return []
        try:
            names = sorted(os.listdir(retired.fd))
        except OSError as exc:
            raise translate(exc, context=f"listing {retired.path}") from None
        keys = []
        for entry in names:
            if entry.startswith(".") and entry.endswith(".tmp"):
                continue  # a write that was interrupted before its rename: not a key
            path = retired.join(entry)
            if _RETIRED_NAME.fullmatch(entry) is None:
                raise KeyFileInvalid(f"{path} is not a retired public key (<key id>.pub); move it away", path=path, reason="name")
            data = read_secret_at(retired, entry, len(_public_line(bytes(limits.PUBLIC_KEY_BYTES))))
            if data is None:
                continue  # removed meanwhile
            try:
                public_key = bytes.fromhex(data.decode("ascii"))
                Ed25519PublicKey.from_public_bytes(public_key)
            except ValueError:  # UnicodeDecodeError is a ValueError
                public_key = b""
            if not public_key_is_usable(public_key):
                public_key = b""  # a small-order key authenticates nothing (see Keyring.add)
            if key_id_of(public_key) != entry[:KEY_ID_CHARS] or data != _public_line(public_key):
                raise KeyFileInvalid(f"{path} does not hold the public key its name says", path=path, reason="content")
            keys.append(public_key)
        return keys


# -- Encoding -----------------------------------------------------------------------------------------

_HEADER_ENCODER = msgspec.json.Encoder(order="sorted")
_STATE_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_STATE_DECODER = msgspec.msgpack.Decoder(list[Effect])


def header_bytes(header: SnapshotHeader) -> bytes:
    """The canonical bytes of a header: the one function whose output is signed."""
    return _HEADER_ENCODER.encode(header)


def encode_state(aggregates: list[Effect] | list[tuple[str, int, dict[str, Any] | None]]) -> bytes:
    """Canonical state bytes of aggregates already sorted by key (Effects or 3-tuples: same bytes)."""
    return _STATE_ENCODER.encode(aggregates)


def aggregates_from(states: Mapping[str, dict[str, Any]], revisions: Mapping[str, int]) -> list[Effect]:
    """Sorted aggregates from an engine's ``states`` and ``revisions`` (e.g. a ``MemoryGroup``).

    An aggregate with a revision but no state (deleted) is kept with state None, so a restore
    continues its revisions where the Group left them.
    """
    return [Effect(key, revisions[key], states.get(key)) for key in sorted(revisions)]


_AGGREGATE = operator.attrgetter("aggregate")
_REVISION = operator.attrgetter("revision")

_ROW_GETTERS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    Effect: (_AGGREGATE, _REVISION),
    tuple: (operator.itemgetter(0), operator.itemgetter(1)),
}

# What ``_row_problems`` (and ``_canonical_c.rows_check``, its C twin) report, or-ed together.
ROW_KEY_TYPE = 1  # a key that is not a str
ROW_UNORDERED = 2  # two neighbouring str keys not strictly increasing
ROW_FIRST_EMPTY = 4  # the first key is ""
ROW_REVISION_TYPE = 8  # a revision that is not an int (bool included)
ROW_REVISION_LOW = 16  # an int revision below 1


def _row_problems(items: list[Any], by_attribute: bool) -> int:
    """Every kind of problem in snapshot rows, in one report: the definition of
    ``_canonical_c.rows_check``, which ``_checked_aggregates`` calls (tests compare the two)."""
    key_of, revision_of = _ROW_GETTERS[Effect if by_attribute else tuple]
    keys = list(map(key_of, items))
    revisions = list(map(revision_of, items))
    problems = 0
    if any(type(key) is not str for key in keys):
        problems |= ROW_KEY_TYPE
    if any(type(a) is str and type(b) is str and not a < b for a, b in zip(keys, keys[1:])):
        problems |= ROW_UNORDERED
    if keys and keys[0] == "":
        problems |= ROW_FIRST_EMPTY
    if any(type(revision) is not int for revision in revisions):
        problems |= ROW_REVISION_TYPE
    if any(type(revision) is int and revision < 1 for revision in revisions):
        problems |= ROW_REVISION_LOW
    return problems


def _checked_aggregates(
    aggregates: Iterable[Effect | tuple[str, int, dict[str, Any] | None]],
) -> list[Effect] | list[tuple[str, int, dict[str, Any] | None]]:
    """The aggregates sorted by key, after checking keys and revisions.

    Rows stay ``Effect``s or ``(key, revision, state)`` tuples as given (both encode to the same
    3-element array), so an index scan's tuples are never copied into new objects. Keys and
    revisions are checked in one C pass (``_canonical_c.rows_check``): creating a snapshot of 100k
    aggregates spends its time encoding, not checking (``bench/bench_snapshot.py``).
    """
    items: list[Any] = list(aggregates)
    kinds = set(map(type, items))
    by_attribute = kinds != {tuple} or bool(set(map(len, items)) - {3})
    if by_attribute and kinds != {Effect}:
        try:
            items = [item if type(item) is Effect else Effect(*item) for item in items]
        except TypeError:
            raise InvalidCommand("aggregates are Effects or (key, revision, state) tuples", field="aggregates") from None
    problems = _canonical_c.rows_check(items, by_attribute)
    if problems & ROW_KEY_TYPE:
        raise InvalidCommand("aggregate keys must be strings", field="aggregates")
    if problems & ROW_UNORDERED:
        items.sort(key=_ROW_GETTERS[Effect if by_attribute else tuple][0])  # engines usually hand them over sorted
        problems = _canonical_c.rows_check(items, by_attribute)
        if problems & ROW_UNORDERED:
            raise InvalidCommand("aggregate keys must be unique", field="aggregates")
    if problems & ROW_FIRST_EMPTY:
        raise InvalidCommand("aggregate keys must be non-empty", field="aggregates")
    if problems & ROW_REVISION_TYPE:
        raise InvalidCommand("aggregate revisions must be integers", field="aggregates")
    if problems & ROW_REVISION_LOW:
        raise InvalidCommand("every aggregate needs a revision >= 1", field="aggregates")
    # States are not type-checked row by row here (a pass that costs as much as all the checks
    # above): they come from the engine's typed index. A state that is not a dict or None is a
    # programmer error; the snapshot then fails verify_snapshot's typed decode (check "format").
    return items


def create_snapshot(
    *,
    org: str,
    group: str,
    seq: int,
    head_hash: bytes,
    aggregates: Iterable[Effect | tuple[str, int, dict[str, Any] | None]],
    signer: SigningKey,
    created_at_ms: int,
) -> bytes:
    """Build and sign the snapshot of ``group`` at ``seq`` whose chain head is ``head_hash``.

    ``aggregates`` are ``Effect``s or ``(key, revision, state)`` tuples, in any order (they are
    sorted). A state is a dict, None (a deleted aggregate) or ``msgspec.Raw`` holding the state's
    canonical msgpack (map keys sorted at every depth, as ``encode_state`` writes them): an index
    that stores states in that form hands them over without decoding, and the snapshot bytes are
    identical. Returns the file bytes; write them with ``write_snapshot_file``.
    """
    canonical.check_id(org, "org")
    canonical.check_id(group, "group")
    if type(seq) is not int or not 0 <= seq <= limits.INT_ABS_MAX:
        raise InvalidCommand("seq must be a non-negative integer", field="seq")
    if type(head_hash) is not bytes or len(head_hash) != HASH_BYTES:
        raise InvalidCommand(f"head_hash must be {HASH_BYTES} bytes", field="head_hash")
    if type(created_at_ms) is not int or not 0 <= created_at_ms <= limits.INT_ABS_MAX:
        raise InvalidCommand("created_at_ms must be a non-negative integer", field="created_at_ms")
    items = _checked_aggregates(aggregates)
    try:
        state = encode_state(items)
    except (msgspec.EncodeError, TypeError, OverflowError) as exc:
        raise InvalidCommand(f"aggregate state cannot be encoded: {exc}", field="aggregates") from None
    if len(state) > limits.SNAPSHOT_STATE_BYTES_MAX:
        raise LimitExceeded(
            f"the state encodes to {len(state)} bytes, above {limits.SNAPSHOT_STATE_BYTES_MAX}", field="aggregates"
        )
    header = SnapshotHeader(
        format_version=FORMAT_VERSION,
        schema_version=SCHEMA_VERSION,
        org=org,
        group=group,
        seq=seq,
        head_hash=head_hash.hex(),
        state_hash=blake3.blake3(state).hexdigest(),
        state_bytes=len(state),
        aggregates=len(items),
        created_at_ms=created_at_ms,
        key_id=signer.key_id,
    )
    encoded = header_bytes(header)
    if len(encoded) > limits.SNAPSHOT_HEADER_BYTES_MAX:
        raise LimitExceeded("the snapshot header is too large", field="header")
    signature = signer.sign(DOMAIN_SNAPSHOT + encoded)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(encoded), len(state), signer.key_id.encode("ascii"))
    return b"".join((prefix, encoded, signature, state))


# -- Verification ---------------------------------------------------------------------------------


def _fail(check: str, message: str) -> SnapshotInvalid:
    return SnapshotInvalid(f"snapshot rejected ({check}): {message}", check=check)


def _is_hex(value: object, chars: int) -> bool:
    if type(value) is not str or len(value) != chars:
        return False
    return all(c in "0123456789abcdef" for c in value)


def verify_snapshot(
    data: bytes | bytearray | memoryview,
    *,
    keyring: Keyring,
    org: str | None = None,
    group: str | None = None,
    high_water_seq: int = 0,
) -> VerifiedSnapshot:
    """Verify snapshot bytes completely (see the module docstring for the order of checks).

    ``org``/``group`` (when given) must match the header; ``high_water_seq`` is the highest
    sequence the caller already holds for this Group: an older snapshot is a rollback.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail("format", f"snapshot data must be bytes, not {type(data).__name__}")
    if not isinstance(keyring, Keyring):
        raise InvalidCommand("keyring must be a mwpstore.Keyring", field="keyring")
    if type(high_water_seq) is not int or high_water_seq < 0:
        raise InvalidCommand("high_water_seq must be a non-negative int", field="high_water_seq")
    view = memoryview(data)
    # 1. size: caps before parsing anything but the fixed-width lengths.
    if len(view) > SNAPSHOT_FILE_BYTES_MAX:
        raise _fail("size", f"{len(view)} bytes is above the {SNAPSHOT_FILE_BYTES_MAX}-byte cap")
    if len(view) < PREFIX_BYTES:
        raise _fail("size", f"{len(view)} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, prefix_version, reserved, header_length, state_length, raw_key_id = _PREFIX.unpack_from(view)
    if header_length == 0 or header_length > limits.SNAPSHOT_HEADER_BYTES_MAX:
        raise _fail("size", f"header length {header_length} is outside 1..{limits.SNAPSHOT_HEADER_BYTES_MAX}")
    if state_length > limits.SNAPSHOT_STATE_BYTES_MAX:
        raise _fail("size", f"state length {state_length} is above {limits.SNAPSHOT_STATE_BYTES_MAX}")
    expected_length = PREFIX_BYTES + header_length + SIGNATURE_BYTES + state_length
    if len(view) != expected_length:
        raise _fail("size", f"the lengths add up to {expected_length} bytes but the file has {len(view)}")
    # 2. format: identification bytes only.
    if magic != MAGIC or reserved != 0:
        raise _fail("format", "not a mwpstore snapshot (bad magic or reserved bytes)")
    # 3. key: the prefix names the key; only a trusted one is used.
    key_id = raw_key_id.decode("ascii", "replace")
    verifier = keyring._verifier(key_id)
    if verifier is None:
        raise _fail("key", f"key id {key_id!r} is not in the keyring")
    # 4. signature over the exact header bytes.
    header_end = PREFIX_BYTES + header_length
    header_raw = bytes(view[PREFIX_BYTES:header_end])
    signature = bytes(view[header_end : header_end + SIGNATURE_BYTES])
    try:
        verifier.verify(signature, DOMAIN_SNAPSHOT + header_raw)
    except InvalidSignature:
        raise _fail("signature", f"the header signature does not verify with key {key_id}") from None
    try:
        fields = msgspec.json.decode(header_raw)
    except (msgspec.DecodeError, RecursionError):
        raise _fail("format", "the signed header is not JSON") from None
    if type(fields) is not dict or canonical.canonical_bytes(fields) != header_raw:
        raise _fail("format", "the signed header is not in canonical form")
    if fields.get("key_id") != key_id:
        raise _fail("key", "the signed header names another key id than the prefix")
    # 5. hash and length of the state.
    state = view[expected_length - state_length :]
    declared_hash, declared_length = fields.get("state_hash"), fields.get("state_bytes")
    if type(declared_length) is not int or declared_length != state_length:
        raise _fail("hash", f"the header declares {declared_length!r} state bytes, the file holds {state_length}")
    if not _is_hex(declared_hash, 2 * HASH_BYTES) or blake3.blake3(state).hexdigest() != declared_hash:
        raise _fail("hash", "the state's blake3 hash differs from the signed header")
    # 6. versions.
    format_version, schema_version = fields.get("format_version"), fields.get("schema_version")
    if format_version != FORMAT_VERSION or prefix_version != FORMAT_VERSION:
        raise _fail("version", f"format version {format_version!r}/{prefix_version} is not {FORMAT_VERSION}")
    if schema_version != SCHEMA_VERSION:
        raise _fail("version", f"schema version {schema_version!r} is not {SCHEMA_VERSION}")
    try:
        header = msgspec.convert(fields, SnapshotHeader)
    except msgspec.ValidationError as exc:
        raise _fail("format", f"header fields: {exc}") from None
    _check_header_fields(header)
    # 7. binding.
    if org is not None and header.org != org:
        raise _fail("binding", f"snapshot is for organization {header.org!r}, not {org!r}")
    if group is not None and header.group != group:
        raise _fail("binding", f"snapshot is for group {header.group!r}, not {group!r}")
    # 8. sequence: no rollback below what the caller already holds.
    if header.seq < high_water_seq:
        raise _fail("sequence", f"snapshot sequence {header.seq} is below the high-water mark {high_water_seq}")
    # 9. the state itself.
    aggregates = _decode_state(state, header.aggregates)
    return VerifiedSnapshot(
        org=header.org,
        group=header.group,
        seq=header.seq,
        head_hash=bytes.fromhex(header.head_hash),
        aggregates=aggregates,
        key_id=key_id,
        created_at_ms=header.created_at_ms,
    )


def _check_header_fields(header: SnapshotHeader) -> None:
    for name in ("org", "group"):
        try:
            canonical.check_id(getattr(header, name), name)
        except InvalidCommand as exc:
            raise _fail("format", f"header {name}: {exc.message}") from None
    if not 0 <= header.seq <= limits.INT_ABS_MAX or not 0 <= header.created_at_ms <= limits.INT_ABS_MAX:
        raise _fail("format", "header seq and created_at_ms must be non-negative 64-bit integers")
    if not 0 <= header.aggregates <= header.state_bytes:
        raise _fail("format", "header aggregate count is impossible for the state length")
    if not _is_hex(header.head_hash, 2 * HASH_BYTES):
        raise _fail("format", "header head_hash must be 64 lowercase hex characters")


def _decode_state(state: memoryview, count: int) -> list[Effect]:
    # Decoding creates about ten objects per aggregate; the cyclic GC would walk them all again and
    # again while they are being built (4x the decode time at 100k aggregates). They hold no
    # cycles, so collection is paused for the decode and restored after.
    paused = gc.isenabled()
    gc.disable()
    try:
        aggregates = _STATE_DECODER.decode(state)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _fail("format", f"the state does not decode: {exc}") from None
    finally:
        if paused:
            gc.enable()
    if len(aggregates) != count:
        raise _fail("format", f"the state holds {len(aggregates)} aggregates, the header says {count}")
    problems = _canonical_c.rows_check(aggregates, True)  # keys str and revisions int, by the decoder's types
    if problems & (ROW_KEY_TYPE | ROW_UNORDERED | ROW_FIRST_EMPTY):
        raise _fail("format", "aggregate keys are not unique, non-empty and sorted")
    if problems & (ROW_REVISION_TYPE | ROW_REVISION_LOW):
        raise _fail("format", "every aggregate needs a revision >= 1")
    return aggregates


# -- Files and references -------------------------------------------------------------------------


def write_snapshot_file(path: str, data: bytes) -> None:
    """Write snapshot bytes to ``path`` atomically (temp file, fsync, rename, directory fsync).

    Missing parent directories are created durably (each new entry's parent fsynced).
    """
    path = store_path(path)
    makedirs_durable(os.path.dirname(os.path.abspath(path)))
    write_file_atomic(path, data, mode=0o600)


def read_snapshot_file(path: str, *, directory: Directory | None = None) -> bytes:
    """Read a snapshot file, refusing one above the size cap before reading it. With
    ``directory``, ``path`` is a name in it, read through its descriptor, never through a link."""
    data = read_file_capped(path, SNAPSHOT_FILE_BYTES_MAX, directory=directory)
    if data is None:
        raise _fail("size", f"{path} is larger than the {SNAPSHOT_FILE_BYTES_MAX}-byte cap")
    return data


def snapshot_ref(data: bytes, *, location: str) -> SnapshotRef:
    """A reference to snapshot bytes this process created (the header is read, not verified)."""
    _, _, _, header_length, _, raw_key_id = _PREFIX.unpack_from(data)
    header = msgspec.json.decode(data[PREFIX_BYTES : PREFIX_BYTES + header_length], type=SnapshotHeader)
    return SnapshotRef(
        org=header.org,
        group=header.group,
        seq=header.seq,
        location=location,
        file_hash=blake3.blake3(data).hexdigest(),
        file_bytes=len(data),
        key_id=raw_key_id.decode("ascii"),
    )


def check_snapshot_ref(data: bytes | memoryview, ref: SnapshotRef | Mapping[str, Any]) -> None:
    """Check fetched bytes against the reference that named them (size, then blake3 → ``hash``).
    ``ref`` is a ``SnapshotRef`` or the dict ``CURSOR_TOO_OLD`` carries; anything else, or data
    that is not bytes, is ``SnapshotInvalid`` (``format``).

    Run before ``verify_snapshot(data, group=ref.group, org=ref.org, ...)``; it does not replace it.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail("format", f"snapshot data must be bytes, not {type(data).__name__}")
    if not isinstance(ref, SnapshotRef):
        ref = SnapshotRef.from_dict(ref)
    if len(data) > SNAPSHOT_FILE_BYTES_MAX or len(data) != ref.file_bytes:
        raise _fail("size", f"{len(data)} bytes, the reference says {ref.file_bytes}")
    if blake3.blake3(data).hexdigest() != ref.file_hash:
        raise _fail("hash", "the file's blake3 hash differs from the snapshot reference")


__all__ = [
    "DOMAIN_SNAPSHOT",
    "FORMAT_VERSION",
    "KeyFileInvalid",
    "Keyring",
    "MAGIC",
    "SCHEMA_VERSION",
    "SigningKey",
    "SnapshotHeader",
    "SnapshotRef",
    "VerifiedSnapshot",
    "aggregates_from",
    "check_snapshot_ref",
    "create_snapshot",
    "header_bytes",
    "key_id_of",
    "read_snapshot_file",
    "snapshot_ref",
    "verify_snapshot",
    "write_snapshot_file",
]
