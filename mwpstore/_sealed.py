"""Sealed LMDB databases: damage in an LMDB file is ``CORRUPTION``, never an answer.

LMDB keeps no checksums. Both of mwpstore's LMDB stores (the authority's index and an
AgentStore) read and write their values only through :class:`SealedTables`:

- every value is stored followed by a 4-byte CRC-32 (zlib's, little-endian) over the database's
  name, the key and the value, so a changed value, or a sound value reached under a changed key,
  fails its seal;
- a lookup that finds nothing asks a second B-tree, ``presence`` (one tag byte + the key, empty
  value), whether the key exists; a damaged page cannot hide an entry from both trees, so the miss
  of an existing key is ``CORRUPTION`` instead of "absent";
- a range checks that the entry before its start sorts before it (a damaged branch key cannot skip
  the first entries), that keys strictly increase, and that the entry ending the range is sound (a
  damaged key that fell outside the prefix cannot end the range early); with presence entries, that
  none of its keys lies before the first entry it served or after the last;
- a deletion of a range checks the same, and each entry it deletes before deleting it (an entry
  of another key that damage moved into the range cannot be erased with it).

The format is in ``docs/format/index.md`` ("Seals and presence").
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import lmdb
import msgspec

from . import failpoints, limits
from ._index_c import seal as _seal
from ._index_c import seal_items as _seal_items
from ._index_c import unseal as _unseal
from .errors import LMDB_FILE_DAMAGE, Corruption, MwpError, translate

_F = TypeVar("_F", bound=Callable[..., Any])

SEAL_BYTES = 4
KEY_SHOWN_BYTES = 200
"""At most this much of a key goes into an error message."""
FORMAT_SHOWN_BYTES = 16
"""At most this much of a stored format goes into an error message (see :func:`shown_format`)."""
_crc32 = zlib.crc32


def seal(name: bytes, key: bytes, value: bytes) -> bytes:
    """``value`` followed by its CRC-32 over the database name, ``key`` and ``value`` (computed in
    C, ``_index_c.seal``; tests/test_index_seals.py checks it against zlib)."""
    return _seal(key, value, _crc32(name))


class SealedTables:
    """Sealed get, put, delete and range over named databases (see the module docstring).

    ``tags`` maps each database whose misses are confirmed against ``presence`` to its tag byte;
    the other databases are sealed only (their callers check misses another way). ``label``,
    ``reason`` and ``remedy`` word the errors: "<label> database states has a damaged entry ...",
    ``reason`` "<reason>_checksum" / "_missing" / "_order".
    """

    label = "store"
    reason = "store"
    remedy = "rebuild it"

    env: lmdb.Environment

    def _seal_tables(self, dbs: dict[bytes, Any], presence: Any, tags: dict[bytes, bytes]) -> None:
        self.dbs = dbs
        self.presence = presence
        self.tags = tags
        self._seeds = {name: _crc32(name) for name in dbs}

    # -- errors ----------------------------------------------------------------------------------

    def _damage(self, kind: str, name: bytes, key: bytes | memoryview, what: str) -> Corruption:
        shown = bytes(key[:KEY_SHOWN_BYTES])  # a damaged key can be any length
        return Corruption(
            f"{self.label} database {name.decode()} {what} at key {shown!r}; {self.remedy}",
            reason=f"{self.reason}_{kind}",
            database=name.decode(),
            key=shown.decode("utf-8", "replace"),
        )

    def begin(self, *, write: bool = False) -> lmdb.Transaction:
        """A transaction for sealed access: values stay views into the map until their length
        is checked (a damaged length must not make LMDB copy past the end of the file)."""
        return self.env.begin(write=write, buffers=True)

    def unseal(self, name: bytes, key: bytes | memoryview, stored: bytes | memoryview) -> bytes:
        """The value inside a sealed entry, as bytes; ``Corruption`` naming the database and key
        if its length is impossible or its seal fails (checked in C: ``_index_c.unseal``)."""
        body = _unseal(stored, key, self._seeds[name], limits.LMDB_VALUE_BYTES_MAX)
        if body is None:
            raise self._damage("checksum", name, key, "has a damaged entry")
        return body

    # -- access ----------------------------------------------------------------------------------

    def get(self, txn: lmdb.Transaction, name: bytes, key: bytes) -> bytes | None:
        """The value at ``key`` (checked), or None if it does not exist (checked too)."""
        # get(key, default, db) and put(key, value, dupdata, overwrite, append, db) are called
        # positionally on the paths every commit takes: py-lmdb parses keyword arguments through
        # the call's dict, 0.6k–0.7k instructions of a one-key get's 3.6k or put's 3.4k (callgrind).
        stored = txn.get(key, None, self.dbs[name])
        if stored is None:
            tag = self.tags.get(name)
            if tag is not None and txn.get(tag + key, None, self.presence) is not None:
                raise self._damage("missing", name, key, "lost the entry")
            return None
        # unseal's check and error without its frame: every sealed lookup (a replay's receipt,
        # a decision's states) comes through here.
        body = _unseal(stored, key, self._seeds[name], limits.LMDB_VALUE_BYTES_MAX)
        if body is None:
            raise self._damage("checksum", name, key, "has a damaged entry")
        return body

    def get_many(self, txn: lmdb.Transaction, name: bytes, keys: list[bytes]) -> list[bytes | None]:
        """:meth:`get` of each key, in one LMDB cursor call (``getmulti``) for the entries and one
        for the presence entries of the keys not found, instead of two calls per key. The same
        answers and the same error: the first key in ``keys`` that :meth:`get` would refuse (a miss
        with a presence entry, or an entry that fails its seal) is the one named."""
        found = txn.cursor(db=self.dbs[name]).getmulti(keys)  # in the order of ``keys``, misses left out
        stored: list[Any] = []
        missing: list[bytes] = []
        position = 0
        for key in keys:
            if position < len(found) and found[position][0] == key:
                stored.append(found[position][1])
                position += 1
            else:
                stored.append(None)
                missing.append(key)
        lost: set[bytes] = set()
        tag = self.tags.get(name)
        if missing and tag is not None:
            lost = {bytes(key[len(tag):]) for key, _ in txn.cursor(db=self.presence).getmulti([tag + key for key in missing])}
        values: list[bytes | None] = []
        for key, entry in zip(keys, stored):
            if entry is None:
                if key in lost:
                    raise self._damage("missing", name, key, "lost the entry")
                values.append(None)
            else:
                values.append(self.unseal(name, key, entry))
        return values

    def put(self, txn: lmdb.Transaction, name: bytes, key: bytes, value: bytes, new: bool = True) -> None:
        """Write one entry; ``new=False`` when the key is known to exist already (presence kept).
        In a database with presence entries, an entry found under a key written for the first
        time (no presence entry yet) must pass its seal: one that fails it is another key's entry
        that damage moved onto this one, and the overwrite would erase it and its damage, leaving
        a range over its own key's Group to answer without it (``CORRUPTION`` instead). A sound
        one is the key's own, whose presence entry alone was lost: written again, as before."""
        sealed = _seal(key, value, self._seeds[name])
        db = self.dbs[name]
        tag = self.tags.get(name)
        if tag is not None and new and txn.put(tag + key, b"", True, False, False, self.presence):  # overwrite=False
            if txn.put(key, sealed, True, False, False, db):  # overwrite=False
                return
            self.unseal(name, key, txn.get(key, db=db))
        txn.put(key, sealed, True, True, False, db)  # (positional: see get)

    def put_many(self, txn: lmdb.Transaction, name: bytes, items: list[tuple[bytes, bytes]], new: list[bytes] | None = None,
                 *, fresh: bool = False) -> None:
        """Write ``items``; record presence for the keys in ``new`` (default: every key). A caller
        that knows a key was written before (a later revision, a Group's next head) leaves it out.
        ``fresh``: no key may exist yet; one that does is ``CORRUPTION`` (see
        :meth:`put_many_sealed`)."""
        self.put_many_sealed(txn, name, _seal_items(items, self._seeds[name]), new, fresh=fresh)

    def seed(self, name: bytes) -> int:
        """The CRC-32 of a database's name: where the seal of its entries starts."""
        return self._seeds[name]

    def put_many_sealed(self, txn: lmdb.Transaction, name: bytes, items: list[tuple[bytes, bytes]], new: list[bytes] | None = None,
                        *, fresh: bool = False) -> None:
        """``put_many`` of values already sealed for ``name`` (by :func:`seal`). With ``fresh``, a
        key that exists already is not overwritten but ``CORRUPTION``: where every key written is
        new (an AgentStore's inbox entry of a newly applied Event), an existing one is an entry
        whose key damage moved there, and overwriting it would erase that entry and its damage
        without a trace. Without ``fresh``, in a database with presence entries, at least as many
        keys must gain an entry as gain their presence entry: a key written for the first time
        over an entry that damage moved there is ``CORRUPTION`` too (the transaction must abort:
        the entry is overwritten)."""
        db = self.dbs[name]
        tag = self.tags.get(name)
        created = 0  # keys that gain their presence entry here: written for the first time
        if tag is not None:
            keys = [key for key, _ in items] if new is None else new
            if len(keys) == 1:  # as putmulti counts it, without a cursor (a commit's one new key)
                created = int(txn.put(tag + keys[0], b"", True, False, False, self.presence))  # overwrite=False (see get)
            elif keys:
                _, created = txn.cursor(db=self.presence).putmulti([(tag + key, b"") for key in keys], overwrite=False)
        # At least as many keys must gain an entry as gain their presence entry (the keys of
        # ``new`` are the new ones, the others exist): fewer is a key written for the first time
        # over another key's entry that damage moved onto it, now erased (see :meth:`put`), or a
        # key whose presence entry alone was lost; damage either way. Counted (the database's
        # entries before and after), not searched per key, so the key is not known. More is a
        # key whose entry was gone while its presence entry stayed (a deletion over a damaged
        # presence page left it): written again, as before.
        if created == len(items) and not fresh:
            # Every key gained its presence entry (a commit's new receipts, a new aggregate's first
            # state): each must gain an entry, so none may exist, and the items are written as
            # ``fresh`` writes them. The count of the keys added is the entries gained, without
            # the two ``stat`` calls (a dict of six fields each, about 7.7k instructions).
            if len(items) == 1:
                added = int(txn.put(items[0][0], items[0][1], True, False, False, db))  # overwrite=False (see get)
            else:
                _, added = txn.cursor(db=db).putmulti(items, overwrite=False)
            if added < created:
                raise self._moved_under_new_key(name)
            return
        counted = txn.stat(db)["entries"] if created and not fresh else None
        _, added = txn.cursor(db=db).putmulti(items, overwrite=not fresh)
        if fresh and added != len(items):
            for key, sealed in items:
                stored = txn.get(key, db=db)
                if stored is not None and bytes(stored) != sealed:
                    self.unseal(name, key, stored)  # a moved entry fails its seal here
                    raise self._damage("order", name, key, "already holds an entry where a new one goes")
            raise self._damage("order", name, items[0][0], "already holds an entry where a new one goes")
        if counted is not None and txn.stat(db)["entries"] - counted < created:
            raise self._moved_under_new_key(name)

    def _moved_under_new_key(self, name: bytes) -> Corruption:
        """What :meth:`put_many_sealed` raises when fewer keys gained an entry than gained their
        presence entry."""
        return Corruption(
            f"{self.label} database {name.decode()} held an entry under a key written for the first time "
            f"(another key's that damage moved there, or its own without its presence entry); {self.remedy}",
            reason=f"{self.reason}_order",
            database=name.decode(),
        )

    def delete(self, txn: lmdb.Transaction, name: bytes, key: bytes) -> bool:
        """Delete one entry and its presence; True if it existed. The entry must pass its seal
        first, as each entry of :meth:`delete_range` does: a caller may delete a key it never
        wrote (a projection's "delete if there"), and an entry there is another key's that damage
        moved onto it, which the deletion would erase unseen (its own Group's ranges then
        answered without it). One search, as before: the cursor deletes where it found it."""
        tag = self.tags.get(name)
        if tag is not None:
            txn.delete(tag + key, db=self.presence)
        cursor = txn.cursor(db=self.dbs[name])
        if not cursor.set_key(key):
            return False
        self.unseal(name, key, cursor.value())
        return bool(cursor.delete())

    def delete_range(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, start: bytes | None = None,
                     last: bytes | None = None) -> int:
        """Delete every entry whose key starts with ``prefix`` (and their presence), from ``start``
        (default: the prefix) up to ``last`` included (default: the prefix's end); the count.
        Everything the walk reads is checked as :meth:`range` checks it: the entries that bound
        it (a damaged key before the first entry or at the end would otherwise stop it early,
        silently, and leave sound entries for later reads to serve), and each entry it deletes,
        sound and in key order (an entry of another key that damage moved into the range would
        otherwise be erased, silently, and missing from later reads of its own range). On
        ``CORRUPTION`` the caller's transaction must abort: part of the range may be deleted."""
        start = prefix if start is None else start

        def bound(key: bytes, stored: Any, before: bool) -> None:
            self.unseal(name, key, stored)
            if (key >= start) if before else (key < prefix if last is None else key <= last):
                raise self._damage("order", name, key, "is out of key order")

        def entry(key: bytes, stored: Any, previous: bytes) -> None:
            self.unseal(name, key, stored)
            # the first below the start: a damaged branch key sent the search to the leaf before
            if key <= previous or key < start:
                raise self._damage("order", name, key, "is out of key order")

        count = _delete_prefix(txn, self.dbs[name], prefix, bound, entry, start, last)
        tag = self.tags.get(name)
        if tag is not None:
            _delete_prefix(txn, self.presence, tag + prefix, start=tag + start, last=None if last is None else tag + last)
        return count

    def range(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, checked value) pairs whose key starts with ``prefix``, from ``start`` (default:
        the prefix itself), in key order."""
        start = prefix if start is None else start
        cursor = txn.cursor(db=self.dbs[name])
        if not cursor.set_range(start):
            # Nothing at or after ``start``: a range that is empty only because a damaged key moved
            # its entries before ``start`` would otherwise be an answer. The database's last entry
            # must be sound and sort before ``start``.
            if cursor.last():
                last = bytes(cursor.key())
                self.unseal(name, last, cursor.value())
                if last >= start:
                    raise self._damage("order", name, last, "is out of key order")
            self._range_start(txn, name, prefix, start, None)
            return
        # A branch key raised by damage sends the search to the leaf before the right one; LMDB
        # runs off its end and lands on the next leaf's first entry without comparing it, which
        # can sort before ``start``: served, it would add entries before the start, or end a
        # range at once as an entry outside its prefix.
        landed = bytes(cursor.key())
        if landed < start:
            raise self._damage("order", name, landed, "is out of key order")
        # A damaged key (in a branch, or the entry just before) can make the search land past the
        # first entries of the range: the entry before the landing point must be sound and sort
        # before ``start``.
        if cursor.prev():
            before = bytes(cursor.key())
            self.unseal(name, before, cursor.value())
            if before >= start:
                raise self._damage("order", name, before, "is out of key order")
            cursor.next()
        previous = b""
        first = None
        unseal = self.unseal
        for key, stored in cursor:
            key = bytes(key)
            if key <= previous:
                raise self._damage("order", name, key, "is out of key order")
            if not key.startswith(prefix):
                # The entry that ends the range must be sound too: a damaged key that merely
                # fell outside the prefix would otherwise end the range early, silently.
                unseal(name, key, stored)
                break
            if first is None:
                # before the first entry is served: the caller may write to the range between
                # entries (a projection deleting the row it just read), which moves its start
                first = key
                self._range_start(txn, name, prefix, start, first)
            previous = key
            yield key, unseal(name, key, stored)
        if first is None:
            self._range_start(txn, name, prefix, start, None)
        else:
            self._range_end(txn, name, prefix, previous)

    def _range_start(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, start: bytes, first: bytes | None) -> None:
        """For a database with presence entries: none of the range's keys lies before ``first``,
        the first entry it serves (None: it serves none), checked before that entry is served
        (the caller may write to the range between entries: a projection deleting the row it has
        just read). With :meth:`_range_end`: a damaged key at either end of a range, in key order
        (so the structural check passes the file), fails its seal while it is the range's
        neighbour; a later write that puts a sound entry between them (another Group's new key)
        hid it from the range, which then answered without it. One search of the presence tree."""
        tag = self.tags.get(name)
        if tag is None:
            return
        cursor = txn.cursor(db=self.presence)
        if cursor.set_range(tag + start):
            found = bytes(cursor.key())
            if found.startswith(tag + prefix) and (first is None or found != tag + first):
                raise self._damage("missing", name, found[1:], "lost the entry")

    def _range_end(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, last: bytes) -> None:
        """For a database with presence entries: none of the range's keys lies after ``last``,
        the last entry it served (see :meth:`_range_start`). One search of the presence tree."""
        tag = self.tags.get(name)
        if tag is None:
            return
        cursor = txn.cursor(db=self.presence)
        if cursor.set_range(tag + last + b"\x00"):
            found = bytes(cursor.key())
            if found.startswith(tag + prefix):
                raise self._damage("missing", name, found[1:], "lost the entry")

    def last_below(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, bound: bytes) -> tuple[bytes, bytes] | None:
        """The last (key, checked value) whose key starts with ``prefix`` and sorts before
        ``bound``, or None: one search instead of a range over every entry before it. As in
        :meth:`range`, the entry the search lands on must be sound and sort at or after
        ``bound``, and the one taken must be sound and sort before it (a damaged branch key
        cannot make it answer with another entry)."""
        cursor = txn.cursor(db=self.dbs[name])
        if cursor.set_range(bound):
            after = bytes(cursor.key())
            self.unseal(name, after, cursor.value())
            if after < bound:
                raise self._damage("order", name, after, "is out of key order")
            found = cursor.prev()
        else:
            found = cursor.last()
        if not found:
            return None
        key = bytes(cursor.key())
        value = self.unseal(name, key, cursor.value())
        if key >= bound:
            raise self._damage("order", name, key, "is out of key order")
        if not key.startswith(prefix):
            return None
        return key, value


def check_stored_format(env: lmdb.Environment, expected: bytes, *, label: str, remedy: str) -> None:
    """``CORRUPTION`` (reason ``format``) for an environment whose ``meta`` database records
    another format than ``expected``, checked before its other databases are opened: a store of an
    older format may lack databases this one has (format 1 had no ``presence``), and it must be
    refused as what it is, not as damage. Format 1 stored its format plain (``b"1"``), later
    formats sealed. A value that fails its seal is a plain format only when it is spelled as one
    (ASCII digits, shorter than a seal, so no sealed value can be it); anything else is damage,
    left to the sealed read that follows to name (a damaged format 2 was reported as "format
    '2...'" of four garbage bytes, and the writer rebuilt it as "index format differs"). Nothing is
    checked without a ``meta`` database or a format in it (a new environment, or damage that the
    opening names)."""
    with env.begin() as txn:
        if txn.get(b"meta") is None:
            return
    meta = env.open_db(b"meta", create=False)
    with env.begin(buffers=True) as txn:  # a view until its length is checked, as SealedTables reads
        raw = txn.get(b"format", db=meta)
        if raw is None:
            return
        value = _unseal(raw, b"format", _crc32(b"meta"), limits.LMDB_VALUE_BYTES_MAX)
        plain = None if value is not None or len(raw) >= SEAL_BYTES else bytes(raw)
    if value is None:
        if plain is None or not plain.isdigit():  # bytes.isdigit: ASCII digits only
            return
        value = plain
    if value != expected:
        shown = shown_format(value)
        raise Corruption(f"the {label} is format {shown!r}, not {expected.decode()!r}; {remedy}", reason="format", format=shown)


def shown_format(value: bytes) -> str:
    """A stored format as an error quotes it: outside input of any length (a sealed value may be
    as long as LMDB allows), so its first ``FORMAT_SHOWN_BYTES`` bytes and its size when longer."""
    shown = value[:FORMAT_SHOWN_BYTES].decode("ascii", "replace")
    return shown if len(value) <= FORMAT_SHOWN_BYTES else f"{shown}… of {len(value)} bytes"


def open_databases(env: lmdb.Environment, names: Iterable[bytes], *, label: str, remedy: str) -> dict[bytes, Any]:
    """Open the named databases, creating them only in a new environment.

    A damaged record in LMDB's main database can change a database's name; opening it by name
    would then silently create a new, empty one. So in an environment that already holds some of
    ``names``, a missing one is ``CORRUPTION``; so are all of them missing from a main database
    that holds other keys (a damaged root in the meta page, opened without the structural walk,
    that lands on a page of another tree: the store would open empty, and the creation would
    write into that tree), and all of them missing from an empty main database that a commit
    already wrote (the first commit creates them: a main root lost in the picked meta page, opened
    without the walk, where the creation's commit would overwrite the other, sound meta page). A
    new environment (no commit yet) gets all of them in one write transaction: a crash while
    creating them leaves none, never some.
    """
    names = list(names)
    with env.begin() as txn:
        existing = {bytes(key) for key, _ in txn.cursor()}
    missing = [name for name in names if name not in existing]
    if missing and (len(missing) < len(names) or existing or env.info()["last_txnid"] > 0):
        raise Corruption(
            f"the {label} lacks its database(s) {b', '.join(missing).decode('utf-8', 'replace')}; {remedy}",
            reason="missing_database",
        )
    if not missing:
        dbs = {name: env.open_db(name, create=False) for name in names}
        check_database_flags(env, dbs, label=label, remedy=remedy)
        return dbs
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name, txn=txn) for name in names}
        failpoints.hit("lmdb.databases_created")
    return dbs


def check_database_flags(env: lmdb.Environment, dbs: dict[bytes, Any], *, label: str, remedy: str) -> None:
    """Every database is created with no flags. LMDB takes a database's flags from its record in
    the main database, so a flipped bit there (``MDB_DUPSORT``, ``MDB_INTEGERKEY``, ...) would make
    later writes add duplicates instead of replacing, or compare keys as integers: ``CORRUPTION``
    (``database_flags``) at open, before any write. The structural walk refuses such a record too;
    this is for the opens that do not walk the file (every read-only view among them)."""
    with env.begin() as txn:
        for name, db in dbs.items():
            flags = db.flags(txn)
            if any(flags.values()):
                set_flags = ", ".join(sorted(flag for flag, on in flags.items() if on))
                raise Corruption(
                    f"the {label}'s database {name.decode('utf-8', 'replace')} carries flags it was not created with ({set_flags}); {remedy}",
                    reason="database_flags",
                )


DAMAGE_ERRORS = (lmdb.Error, msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, struct.error)
"""What damaged LMDB pages or stored bytes can raise on a read path (``RecursionError``: a value
nested deeper than its decoder goes)."""


def typed_damage(label: str, remedy: str, reason: str, errors: tuple[type[BaseException], ...] = DAMAGE_ERRORS) -> Callable[[_F], _F]:
    """A decorator for read paths: what damaged LMDB pages or bytes can raise (by default LMDB,
    decode and struct errors) becomes ``CORRUPTION`` naming the store and the remedy, never a
    foreign error."""

    caught = errors + (SystemError,)  # SystemError: the binding's, around an LMDB error (damage_of)

    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except MwpError:
                raise
            except caught as exc:
                raise damage_of(label, remedy, reason, exc) from None

        return wrapper  # type: ignore[return-value]

    return decorate


LMDB_FILE_DAMAGE_ERRORS = tuple(getattr(lmdb, name) for name in LMDB_FILE_DAMAGE)
"""The LMDB errors that only a damaged file gives (``errors.LMDB_FILE_DAMAGE``, as classes)."""

LMDB_DAMAGE_ERRORS = LMDB_FILE_DAMAGE_ERRORS + (
    lmdb.BadTxnError, lmdb.BadValsizeError, lmdb.BadDbiError, lmdb.IncompatibleError)
"""The LMDB errors that damaged pages give: those ``translate`` makes ``CORRUPTION``
(``errors.LMDB_FILE_DAMAGE``), and those the exhaustive damage sweep met in writes (``BadTxnError``:
an operation after one of them failed inside LMDB, which then refuses the rest of the transaction;
``BadDbiError`` and ``IncompatibleError``: a damaged record of a named database)."""


def lmdb_cause(exc: BaseException) -> lmdb.Error | None:
    """The LMDB error behind ``exc``: itself, or the one that the binding left set when it raised
    ``SystemError`` ("returned a result with an exception set", seen from ``Cursor.delete`` on a
    damaged page); None for any other error."""
    if isinstance(exc, lmdb.Error):
        return exc
    if isinstance(exc, SystemError) and isinstance(exc.__cause__, lmdb.Error):
        return exc.__cause__
    return None


def damage_of(label: str, remedy: str, reason: str, exc: BaseException) -> MwpError:
    """The ``CORRUPTION`` that a foreign error met on a read path of ``label`` stands for; a full
    reader table is none (``StorageFailed``, reason ``readers_full``: the read may be retried). A
    ``SystemError`` stands for the LMDB error the binding wrapped in it (``lmdb_cause``); one of
    another cause is raised unchanged."""
    if isinstance(exc, SystemError):
        cause = lmdb_cause(exc)
        if cause is None:
            raise exc
        exc = cause
    if isinstance(exc, lmdb.ReadersFullError):
        return translate(exc, context=f"reading the {label}")
    return Corruption(f"the {label} is damaged ({type(exc).__name__}: {exc}); {remedy}", reason=reason)


def _delete_prefix(txn: lmdb.Transaction, db: Any, prefix: bytes, bound: Callable[[bytes, Any, bool], None] | None = None,
                   entry: Callable[[bytes, Any, bytes], None] | None = None, start: bytes | None = None,
                   last: bytes | None = None) -> int:
    """Delete the entries whose key starts with ``prefix``, from ``start`` (default: the prefix)
    up to ``last`` included (default: none after the prefix); the count. ``bound(key, value,
    before)``, when given, checks each entry that bounds the walk: the one before where the search
    landed (or the database's last entry, when it landed nowhere), ``before`` True, and the one
    that ends the walk (the landing point itself, when it is outside the range). ``entry(key,
    value, previous key)``, when given, checks each entry before it is deleted."""
    cursor = txn.cursor(db=db)
    count = 0
    if not cursor.set_range(prefix if start is None else start):
        if bound is not None and cursor.last():
            bound(bytes(cursor.key()), cursor.value(), True)
        return 0
    if bound is not None:
        if cursor.prev():
            bound(bytes(cursor.key()), cursor.value(), True)
            cursor.next()
        else:  # it landed on the first entry: a failed prev leaves the cursor nowhere
            cursor.first()
    previous = b""
    while True:
        key = bytes(cursor.key())
        if not key.startswith(prefix) or (last is not None and key > last):
            if bound is not None:
                bound(key, cursor.value(), False)
            break
        if entry is not None:
            entry(key, cursor.value(), previous)
            previous = key
        if not cursor.delete():  # the cursor moves to the next entry
            break
        count += 1
        if not cursor.key():  # deleted the last entry of the database
            break
    return count
