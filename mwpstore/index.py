"""The authority's LMDB index: derived state and lookups, all rebuildable from the segment log.

Layout (``docs/format/index.md``): one LMDB environment, these named databases; ``\\x00``
separates key parts (IDs never contain it).

| database     | key                              | value                                   |
|--------------|----------------------------------|-----------------------------------------|
| ``meta``     | ``log_position``                 | u64 BE: log end this index reflects     |
|              | ``boot_id``                      | kernel boot id of the last writer       |
|              | ``clean``                        | ``1`` after a clean close, else ``0``   |
|              | ``format``                       | index format version                    |
| ``events``   | group ``\\0`` seq (u64 BE)       | u64 BE log position of the Event record |
| ``heads``    | group                            | seq u64 BE + chain hash (32)            |
| ``states``   | group ``\\0`` aggregate key      | revision u64 BE + msgpack state         |
| ``receipts`` | actor ``\\0`` action id          | content hash (32) + msgpack Receipt     |
| ``acks``     | consumer ``\\0`` group           | cursor u64 BE                           |
| ``snapshots``| group ``\\0`` seq (u64 BE)       | msgpack SnapshotRef of a signed snapshot|
| ``archives`` | group                            | msgpack ArchiveRecord (final snapshot + audit log) |
| ``presence`` | tag byte + key of a lookup database | empty                                   |

The index never runs ahead of the log: the log group is durable before the LMDB transaction that
reflects it commits, and every commit records the log position it reflects.

Every value above is stored **sealed**: followed by a CRC-32 over the database's name, the key and
the value, so a damaged value, or a value reached under a damaged key, is ``CORRUPTION`` instead of
a wrong answer. A lookup that finds nothing asks ``presence`` (a second B-tree, so one damaged page
cannot hide an entry from both) whether the key was ever written: if it was, the miss is
``CORRUPTION`` too, never "absent". Keys are never deleted, so presence only grows.
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import lmdb
import msgspec

from .errors import Corruption, translate
from .messages import HASH_BYTES, ZERO_HASH

INDEX_FORMAT = b"2"
DATABASE_NAMES = (b"meta", b"events", b"heads", b"states", b"receipts", b"acks", b"snapshots", b"archives", b"presence")
# Databases whose misses are confirmed against ``presence`` (one tag byte each). Events need no
# presence entry: a Group's head says which sequences must exist.
PRESENCE_TAGS = {b"heads": b"h", b"states": b"s", b"receipts": b"r", b"acks": b"a", b"snapshots": b"n", b"archives": b"v"}
SEAL_BYTES = 4
_SEEDS = {name: zlib.crc32(name) for name in DATABASE_NAMES}
_CHECK = struct.Struct("<I")
_unpack_check = _CHECK.unpack_from
_pack_check = _CHECK.pack
_crc32 = zlib.crc32
_U64 = struct.Struct(">Q")
_STATE_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(dict[str, Any])


def seal(name: bytes, key: bytes, value: bytes) -> bytes:
    """``value`` followed by its CRC-32 over the database name, ``key`` and ``value``."""
    return value + _pack_check(_crc32(value, _crc32(key, _SEEDS[name])))


def unseal(name: bytes, key: bytes | memoryview, stored: bytes | memoryview) -> bytes | memoryview:
    """The value inside a sealed entry; ``Corruption`` naming the database and key if it fails."""
    size = len(stored) - SEAL_BYTES
    if size >= 0:
        body = stored[:size]
        if _unpack_check(stored, size)[0] == _crc32(body, _crc32(key, _SEEDS[name])):
            return body
    raise Corruption(
            f"index database {name.decode()} has a damaged entry at key {bytes(key)!r}; run `mwpstore rebuild`",
            reason="index_checksum",
            database=name.decode(),
            key=bytes(key).decode("utf-8", "replace"),
        )


def _out_of_order(name: bytes, key: bytes | memoryview) -> Corruption:
    return Corruption(
        f"index database {name.decode()} is out of key order at {bytes(key)!r}; run `mwpstore rebuild`",
        reason="index_order",
        database=name.decode(),
        key=bytes(key).decode("utf-8", "replace"),
    )


def u64(value: int) -> bytes:
    return _U64.pack(value)


def read_u64(data: bytes | memoryview, offset: int = 0) -> int:
    return _U64.unpack_from(data, offset)[0]


def event_key(group: str, seq: int) -> bytes:
    return group.encode() + b"\x00" + _U64.pack(seq)


def state_key(group: str, aggregate: str) -> bytes:
    return group.encode() + b"\x00" + aggregate.encode()


def receipt_key(actor: str, action_id: str) -> bytes:
    return actor.encode() + b"\x00" + action_id.encode()


def ack_key(consumer: str, group: str) -> bytes:
    return consumer.encode() + b"\x00" + group.encode()


def encode_state(revision: int, state: dict[str, Any] | None) -> bytes:
    return _U64.pack(revision) + (b"" if state is None else _STATE_ENCODER.encode(state))


def decode_state(data: bytes | memoryview) -> tuple[int, dict[str, Any] | None]:
    if len(data) < 8:
        raise Corruption("index state value is shorter than its revision field", reason="index_state")
    revision = _U64.unpack_from(data, 0)[0]
    if len(data) == 8:
        return revision, None
    try:
        return revision, _STATE_DECODER.decode(data[8:])
    except msgspec.DecodeError as exc:
        raise Corruption(f"index state value undecodable: {exc}", reason="index_state") from None


def encode_head(seq: int, digest: bytes) -> bytes:
    return _U64.pack(seq) + digest


def decode_head(data: bytes | memoryview | None) -> tuple[int, bytes]:
    if data is None:
        return 0, ZERO_HASH
    if len(data) != 8 + HASH_BYTES:
        raise Corruption("index head value has the wrong length", reason="index_head")
    return _U64.unpack_from(data, 0)[0], bytes(data[8:])


class Index:
    """An open LMDB environment with the authority's named databases."""

    def __init__(self, directory: str, *, map_size: int, readonly: bool = False) -> None:
        self.directory = directory
        try:
            if not readonly:
                os.makedirs(directory, exist_ok=True)
            self.env = lmdb.open(
                directory,
                map_size=map_size,
                max_dbs=len(DATABASE_NAMES) + 2,
                max_readers=512,
                sync=False,
                metasync=False,
                readahead=False,
                readonly=readonly,
                lock=True,
            )
            self.dbs: dict[bytes, Any] = {}
            for name in DATABASE_NAMES:
                if readonly:
                    with self.env.begin() as txn:
                        self.dbs[name] = self.env.open_db(name, txn=txn, create=False)
                else:
                    self.dbs[name] = self.env.open_db(name)
        except lmdb.Error as exc:
            raise translate(exc, context=f"opening index {directory}") from None
        self.meta = self.dbs[b"meta"]
        self.events = self.dbs[b"events"]
        self.heads = self.dbs[b"heads"]
        self.states = self.dbs[b"states"]
        self.receipts = self.dbs[b"receipts"]
        self.acks = self.dbs[b"acks"]
        self.snapshots = self.dbs[b"snapshots"]
        self.archives = self.dbs[b"archives"]
        self.presence = self.dbs[b"presence"]

    def close(self) -> None:
        self.env.close()

    def sync(self) -> None:
        self.env.sync(True)

    def log_position(self, txn: lmdb.Transaction) -> int:
        value = self.get(txn, b"meta", b"log_position")
        return 0 if value is None else read_u64(value)

    # -- sealed access: every read and write of a value goes through these -----------------------

    def get(self, txn: lmdb.Transaction, name: bytes, key: bytes) -> bytes | memoryview | None:
        """The value at ``key`` (checked), or None if it was never written (checked too)."""
        stored = txn.get(key, db=self.dbs[name])
        if stored is None:
            tag = PRESENCE_TAGS.get(name)
            if tag is not None and txn.get(tag + key, db=self.presence) is not None:
                raise Corruption(
                    f"index database {name.decode()} lost the entry at key {key!r}; run `mwpstore rebuild`",
                    reason="index_missing",
                    database=name.decode(),
                    key=key.decode("utf-8", "replace"),
                )
            return None
        return unseal(name, key, stored)

    def put(self, txn: lmdb.Transaction, name: bytes, key: bytes, value: bytes) -> None:
        txn.put(key, seal(name, key, value), db=self.dbs[name])
        tag = PRESENCE_TAGS.get(name)
        if tag is not None:
            txn.put(tag + key, b"", db=self.presence)

    def put_many(self, txn: lmdb.Transaction, name: bytes, items: list[tuple[bytes, bytes]], new: list[bytes] | None = None) -> None:
        """Write ``items``; record presence for the keys in ``new`` (default: every key). A caller
        that knows a key was written before (a later revision, a Group's next head) leaves it out."""
        seed = _SEEDS[name]
        txn.cursor(db=self.dbs[name]).putmulti([(key, value + _pack_check(_crc32(value, _crc32(key, seed)))) for key, value in items])
        tag = PRESENCE_TAGS.get(name)
        if tag is not None:
            keys = [key for key, _ in items] if new is None else new
            if keys:
                txn.cursor(db=self.presence).putmulti([(tag + key, b"") for key in keys])

    def range(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes | memoryview]]:
        """(key, checked value) pairs whose key starts with ``prefix``, from ``start`` (default:
        the prefix itself), in key order."""
        start = prefix if start is None else start
        cursor = txn.cursor(db=self.dbs[name])
        if not cursor.set_range(start):
            return
        # A damaged branch key can send the descent past the first entries of the range: the
        # entry before the landing point must sort before ``start``.
        if cursor.prev():
            if bytes(cursor.key()) >= start:
                raise _out_of_order(name, cursor.key())
            cursor.next()
        previous = b""
        for key, stored in cursor:
            key = bytes(key)
            if key <= previous:
                raise _out_of_order(name, key)
            if not key.startswith(prefix):
                # The entry that ends the range must be sound too: a damaged key that merely
                # fell outside the prefix would otherwise end the range early, silently.
                unseal(name, key, stored)
                return
            previous = key
            yield key, unseal(name, key, stored)

    def iterate(self, name: bytes) -> Iterator[tuple[bytes, bytes]]:
        """All raw (key, sealed value) pairs of one database, in key order (a read transaction)."""
        with self.env.begin(db=self.dbs[name], buffers=False) as txn:
            yield from txn.cursor().iternext(keys=True, values=True)


class PendingWrites:
    """Index writes gathered over many log records and written with one ``putmulti`` per
    database (redo and rebuild); later writes to a key win, as they would one by one."""

    __slots__ = ("items", "new")

    def __init__(self) -> None:
        self.items: dict[bytes, list[tuple[bytes, bytes]]] = {name: [] for name in DATABASE_NAMES if name != b"presence"}
        self.new: dict[bytes, list[bytes]] = {name: [] for name in PRESENCE_TAGS}

    def put(self, name: bytes, key: bytes, value: bytes, new: bool = True) -> None:
        self.items[name].append((key, value))
        if new and name in PRESENCE_TAGS:
            self.new[name].append(key)

    def flush(self, index: Index, txn: lmdb.Transaction) -> None:
        for name, items in self.items.items():
            if items:
                index.put_many(txn, name, items, self.new.get(name, []))
                items.clear()
        for keys in self.new.values():
            keys.clear()


def remove_index(directory: str) -> None:
    if os.path.isdir(directory):
        shutil.rmtree(directory)
