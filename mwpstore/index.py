"""The authority's LMDB index: derived state and lookups, all rebuildable from the segment log.

Layout (``docs/format/index.md``): one LMDB environment, these named databases; ``\\x00``
separates key parts (IDs never contain it).

| database     | key                              | value                                   |
|--------------|----------------------------------|-----------------------------------------|
| ``meta``     | ``log_position``                 | u64 BE: log end this index reflects     |
|              | ``boot_id``                      | kernel boot id of the last writer       |
|              | ``clean``                        | ``1`` after a clean close, else ``0``   |
|              | ``format``                       | index format version                    |
|              | ``log_id``                       | u64 BE: id of the log it was built from |
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
from collections.abc import Iterator
from typing import Any

import lmdb
import msgspec

from . import limits
from ._sealed import KEY_SHOWN_BYTES, SEAL_BYTES, SealedTables, check_database_flags, check_stored_format, open_databases, seal  # noqa: F401  (seal, SEAL_BYTES: part of this module's API)
from ._lmdb_check import refuse_linked_files
from .errors import Corruption, translate
from .messages import DECODE_ERRORS, HASH_BYTES, ZERO_HASH

INDEX_FORMAT = b"3"
DATABASE_NAMES = (b"meta", b"events", b"heads", b"states", b"receipts", b"acks", b"snapshots", b"archives", b"presence")
# Databases whose misses are confirmed against ``presence`` (one tag byte each). Events need no
# presence entry: a Group's head says which sequences must exist.
PRESENCE_TAGS = {b"heads": b"h", b"states": b"s", b"receipts": b"r", b"acks": b"a", b"snapshots": b"n", b"archives": b"v"}
_U64 = struct.Struct(">Q")
_STATE_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(dict[str, Any])


def unseal(name: bytes, key: bytes | memoryview, stored: bytes | memoryview) -> bytes:
    """The value inside a sealed index entry (``Corruption`` if it fails), without an open index."""
    return _UNSEALER.unseal(name, key, stored)


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
    except DECODE_ERRORS as exc:
        raise Corruption(f"index state value undecodable: {exc}", reason="index_state") from None


def encode_head(seq: int, digest: bytes) -> bytes:
    return _U64.pack(seq) + digest


def decode_head(data: bytes | memoryview | None) -> tuple[int, bytes]:
    if data is None:
        return 0, ZERO_HASH
    if len(data) != 8 + HASH_BYTES:
        raise Corruption("index head value has the wrong length", reason="index_head")
    return _U64.unpack_from(data, 0)[0], bytes(data[8:])


class Index(SealedTables):
    """An open LMDB environment with the authority's named databases, read and written sealed."""

    label = "index"
    reason = "index"
    remedy = "run `mwpstore rebuild`"

    def __init__(self, directory: str, *, map_size: int, readonly: bool = False) -> None:
        self.directory = directory
        try:
            if not readonly:
                os.makedirs(directory, mode=0o755, exist_ok=True)  # as the store's other directories: 0777 under umask 0
            # The writer's open ran check_before_open (and this check) on this directory just
            # before; a read-only view, a rebuild's and verify's scratch index open only here.
            refuse_linked_files(directory, label=self.label)
            self.env = lmdb.open(
                directory,
                map_size=map_size,
                max_dbs=len(DATABASE_NAMES) + 2,
                max_readers=limits.LMDB_READERS_MAX,
                sync=False,
                metasync=False,
                readahead=False,
                readonly=readonly,
                lock=True,
            )
            self.dbs: dict[bytes, Any] = {}
            try:
                # The slots of reader processes that died (see begin) are cleared at every open too:
                # a view opened while the writer is idle would otherwise find the table full of them.
                self.env.reader_check()
                # An index of format 1 (0.1.0) lacks presence: CORRUPTION, reason format (the
                # writer rebuilds it, a read-only view asks for a writer's open first).
                check_stored_format(self.env, INDEX_FORMAT, label="index", remedy=self.remedy)
                if readonly:
                    # Opened without a transaction of ours: a handle opened inside a read
                    # transaction that ends without a commit is closed with it, and every later
                    # read through it fails with EINVAL.
                    for name in DATABASE_NAMES:
                        self.dbs[name] = self.env.open_db(name, create=False)
                    # A view never walks the file (the walk would race the writer's commits), so
                    # a flag that damage set in a database's record is found here, as the
                    # writer's open finds it: reads under MDB_INTEGERKEY or MDB_REVERSEKEY
                    # search by another key order.
                    check_database_flags(self.env, self.dbs, label="index", remedy=self.remedy)
                else:
                    self.dbs = open_databases(self.env, DATABASE_NAMES, label="index", remedy=self.remedy)
            except BaseException:
                self.env.close()
                raise
        except (lmdb.Error, OSError) as exc:  # OSError: the directory cannot be made (EIO, ENOSPC, EROFS)
            raise translate(exc, context=f"opening index {directory}") from None
        self._seal_tables(self.dbs, self.dbs[b"presence"], PRESENCE_TAGS)

    def begin(self, *, write: bool = False) -> lmdb.Transaction:
        if write:
            # A process that dies inside a read (a read-only view holds one for its whole life, so
            # a killed `mwpstore tail` does) leaves its slot in lock.mdb's reader table, and LMDB
            # clears such slots only when asked. Each one pins the pages of its snapshot: no page
            # freed after it could be used again (every page a commit rewrote was a new one, so
            # the index grew until its map was full), and max_readers of them left no slot for any
            # read. Cleared before every write: one lock test per other process in the table.
            self.env.reader_check()
        return self.env.begin(write=write, buffers=True)  # as SealedTables.begin, without its frame

    def close(self) -> None:
        self.env.close()

    def sync(self) -> None:
        self.env.sync(True)

    def log_position(self, txn: lmdb.Transaction) -> int:
        """The log position this index reflects (``meta`` ``log_position``); ``CORRUPTION`` when
        it has none, as no index this engine writes lacks it (its first commit holds it)."""
        position = self.meta_u64(txn, b"log_position")
        if position is None:
            raise Corruption(f"the index's meta has no log_position; {self.remedy}", reason="index")
        return position

    def head(self, txn: lmdb.Transaction, group: str) -> tuple[int, bytes]:
        """(sequence, chain hash) of the Group's last Event (``heads``); (0, zero hash) for an
        unknown Group. ``CORRUPTION`` (``index_head``) when ``events`` holds the Event after it:
        a ``heads`` page written back from an older transaction (a lost write) holds sound entries
        under sound seals, and its head, behind the Group's Events, hid them from reads and gave
        the next Event a sequence the log already held (a chain break in the log). One lookup."""
        head = decode_head(self.get(txn, b"heads", group.encode()))
        if txn.get(event_key(group, head[0] + 1), None, self.dbs[b"events"]) is not None:  # positional: see SealedTables.get
            raise self._damage("head", b"heads", group.encode(), f"is behind its Events (Event {head[0] + 1} is indexed)")
        return head

    def check_meta(self, txn: lmdb.Transaction) -> None:
        """``CORRUPTION`` unless every ``meta`` entry (a handful) passes its seal, read whole when
        an open judges the index. ``meta`` keeps no presence entries: a bit flipped in one of its
        keys (``last_ms`` read as ``last_mq``, still in key order) hid the entry, and the open read
        "absent": no ``last_ms`` (the next Event stamped with a clock that had gone back), no
        ``log_id`` (the index taken as an older build's, not asked whether it is the log's). The
        seal covers the key, so the entry under the damaged key fails it."""
        for _ in self.range(txn, b"meta", b""):
            pass

    def meta_u64(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """A u64 ``meta`` entry (``log_position``, ``last_ms``), or None if absent (see :meth:`get_u64`)."""
        return self.get_u64(txn, b"meta", key)

    def get_u64(self, txn: lmdb.Transaction, name: bytes, key: bytes) -> int | None:
        """A u64 value (a ``meta`` position or time, an Event's log position, an ACK's cursor), or
        None if absent; ``CORRUPTION`` (reason ``index``) for a value of another size under a sound
        seal (outside input: a wrong size must not be read as a number, nor fail as a bare
        ``struct.error``, which a commit reports as an unexpected storage failure)."""
        value = self.get(txn, name, key)
        if value is None:
            return None
        if len(value) != 8:
            shown = key.decode("utf-8", "replace") if name == b"meta" else repr(bytes(key[:KEY_SHOWN_BYTES]))
            raise Corruption(f"the index's {name.decode()} {shown} is {len(value)} bytes, not a u64; {self.remedy}", reason="index")
        return read_u64(value)

    def iterate(self, name: bytes) -> Iterator[tuple[bytes, bytes]]:
        """All raw (key, sealed value) pairs of one database, in key order (a read transaction);
        a value longer than any sealed value can be is ``CORRUPTION`` before it is read."""
        with self.begin() as txn:
            for key, value in txn.cursor(db=self.dbs[name]).iternext(keys=True, values=True):
                if len(value) > limits.LMDB_VALUE_BYTES_MAX + SEAL_BYTES:
                    raise self._damage("checksum", name, key, "has an entry of impossible length")
                yield bytes(key), bytes(value)


class PendingWrites:
    """Index writes gathered over many log records and written with one ``putmulti`` per
    database (redo and rebuild); later writes to a key win, as they would one by one.

    ``items`` holds (key, sealed value) per database and ``new`` the keys that need a presence
    entry: the layout ``mwpstore._index_c.index_events`` appends to as well. ``archived`` holds the
    keys of the archive records not flushed yet, so that a compacted Group's record can ask whether
    its archive record came before it without a walk of ``items``."""

    __slots__ = ("items", "new", "archived")

    def __init__(self) -> None:
        self.items: dict[bytes, list[tuple[bytes, bytes]]] = {name: [] for name in DATABASE_NAMES if name != b"presence"}
        self.new: dict[bytes, list[bytes]] = {name: [] for name in PRESENCE_TAGS}
        self.archived: set[bytes] = set()

    def put(self, name: bytes, key: bytes, value: bytes, new: bool = True) -> None:
        self.items[name].append((key, seal(name, key, value)))
        if new and name in PRESENCE_TAGS:
            self.new[name].append(key)
        if name == b"archives":
            self.archived.add(key)

    def flush(self, index: Index, txn: lmdb.Transaction) -> None:
        for name, items in self.items.items():
            if items:
                index.put_many_sealed(txn, name, items, self.new.get(name, []))
                items.clear()
        for keys in self.new.values():
            keys.clear()
        self.archived.clear()


class _Unsealer(SealedTables):
    label, reason, remedy = Index.label, Index.reason, Index.remedy

    def __init__(self) -> None:
        self._seal_tables({name: None for name in DATABASE_NAMES}, None, {})


_UNSEALER = _Unsealer()


def remove_index(directory: str) -> None:
    """Delete an index directory if it is there; ``StorageFailed`` when it cannot be (an I/O
    error, or no file descriptor left for the walk)."""
    try:
        if os.path.isdir(directory):
            shutil.rmtree(directory)
    except OSError as exc:
        raise translate(exc, context=f"removing {directory}") from None
