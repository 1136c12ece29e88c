"""The SQLite peer: mwpstore's acceptance transaction done by SQLite (stdlib ``sqlite3``, WAL, FULL).

It computes the same canonical bytes and content hashes as mwpstore
(``mwpstore.messages.command_bytes``, ``mwpstore.canonical.content_hash``), the same payload hash
and blake3 chain hash (``mwpstore.messages.event_hash``), and stores the result in four tables.
Two variants: by default (subject ``sqlite``) the transaction below with a plain revision check
and "new state = old state updated with the body" (the transaction DESIGN §8's baselines
measured); with ``rules=True`` (subject ``sqlite_rules``) it decides each Command with mwpstore's
own rules (``mwpstore.registry.run_transition``: membership, existence, field checks, evolve),
which is exactly mwpstore's work and costs about 40 µs of Python per Command. One acceptance is
one SQLite transaction:

1. receipt lookup by (actor, action_id): same content hash → the stored receipt, byte for byte,
   nothing written; a different hash → ``ACTION_ID_COLLISION``;
2. the Group head (sequence and hash) and the aggregate states the rules read, revision check
   against ``expected_revision`` (``REVISION_MISMATCH``);
3. insert the Event row (sequence = head + 1, blake3 chain hash over the previous Event's hash),
   upsert every changed aggregate with its new revision, insert the receipt, move the head;
4. ``COMMIT`` (WAL with ``synchronous=FULL``: one fsync of the WAL per commit).

The acceptance time is taken as mwpstore takes it: the clock's reading, refused unless an int of
milliseconds in 0..``TIME_MS_MAX``, and never before the last acceptance time (a clock that steps
back does not move Events, leases or not-before times back).

A rejected Command is refused before anything is written. A duplicate is first looked up outside
any write transaction (a plain read), as mwpstore does. Threads each get their own connection;
writers take SQLite's write lock up front (``BEGIN IMMEDIATE``) with a busy timeout, and a
transaction that still finds the database locked is retried and counted in ``retries``. Within
one process the writers also queue on a Python lock first (``writer_lock=True``, the default):
with 16 threads on this machine that is faster than leaving them to SQLite's busy handler, which
sleeps in steps of milliseconds, so the peer runs its better variant. ``accept_many`` decides its
Commands against the transaction's own uncommitted state and moves each Group head once.

The Event row keeps the header fields as columns, the body and the effects as msgpack; ``read``
decodes rows back into ``mwpstore.messages.Event`` objects, the type mwpstore's ``read`` returns.

This is a benchmark peer, not part of the engine.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

import harness  # noqa: F401  (puts the checkout on sys.path)
from mwpstore.canonical import clock_reading, content_hash
from mwpstore.errors import ActionIdCollision, MwpError, Rejection, RevisionMismatch
from mwpstore.messages import (
    ZERO_HASH,
    AcceptResult,
    Command,
    Effect,
    Event,
    Receipt,
    check_command,
    command_bytes,
    decode_receipt,
    encode_receipt,
    event_hash,
    make_event_id,
    payload_hash_of,
    receipt_for,
)
from mwpstore.registry import run_transition

DATABASE_NAME = "authority.sqlite3"
BUSY_TIMEOUT_SECONDS = 30.0
RETRIES_MAX = 1000

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS events (
        grp TEXT NOT NULL, seq INTEGER NOT NULL, event_id TEXT NOT NULL, kind TEXT NOT NULL,
        aggregate TEXT NOT NULL, revision INTEGER NOT NULL, actor TEXT NOT NULL, action_id TEXT NOT NULL,
        content_hash BLOB NOT NULL, accepted_at_ms INTEGER NOT NULL, authoritative INTEGER NOT NULL,
        body BLOB, effects BLOB NOT NULL, payload_hash BLOB NOT NULL, prev_hash BLOB NOT NULL,
        hash BLOB NOT NULL,
        PRIMARY KEY (grp, seq)) WITHOUT ROWID""",
    "CREATE UNIQUE INDEX IF NOT EXISTS events_by_id ON events (event_id)",
    """CREATE TABLE IF NOT EXISTS aggregates (
        grp TEXT NOT NULL, key TEXT NOT NULL, revision INTEGER NOT NULL, state BLOB,
        PRIMARY KEY (grp, key)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS receipts (
        actor TEXT NOT NULL, action_id TEXT NOT NULL, content_hash BLOB NOT NULL, receipt BLOB NOT NULL,
        PRIMARY KEY (actor, action_id)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS heads (
        grp TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash BLOB NOT NULL) WITHOUT ROWID""",
]

_SELECT_RECEIPT = "SELECT content_hash, receipt FROM receipts WHERE actor = ? AND action_id = ?"
_SELECT_AGGREGATE = "SELECT revision, state FROM aggregates WHERE grp = ? AND key = ?"
_SELECT_HEAD = "SELECT seq, hash FROM heads WHERE grp = ?"
_SELECT_LAST_MS = "SELECT max(accepted_at_ms) FROM events"
_INSERT_EVENT = "INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
_UPSERT_AGGREGATE = "INSERT OR REPLACE INTO aggregates VALUES (?,?,?,?)"
_INSERT_RECEIPT = "INSERT INTO receipts VALUES (?,?,?,?)"
_UPSERT_HEAD = "INSERT OR REPLACE INTO heads VALUES (?,?,?)"
_SELECT_EVENTS = (
    "SELECT grp, seq, event_id, kind, aggregate, revision, actor, action_id, content_hash, accepted_at_ms,"
    " authoritative, body, effects, payload_hash, prev_hash, hash FROM events"
    " WHERE grp = ? AND seq > ? ORDER BY seq LIMIT ?"
)

_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(dict[str, Any])
_BODY_DECODER = msgspec.msgpack.Decoder(dict[str, Any] | None)
_EFFECTS_DECODER = msgspec.msgpack.Decoder(list[Effect])


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class _SqlView:
    """The rules' read access (``StateView``) to one Group's aggregates inside the open transaction."""

    __slots__ = ("_cursor", "_group", "_cache")

    def __init__(self, cursor: sqlite3.Cursor, group: str) -> None:
        self._cursor = cursor
        self._group = group
        self._cache: dict[str, tuple[int, dict[str, Any] | None]] = {}

    def _load(self, key: str) -> tuple[int, dict[str, Any] | None]:
        cached = self._cache.get(key)
        if cached is None:
            row = self._cursor.execute(_SELECT_AGGREGATE, (self._group, key)).fetchone()
            if row is None:
                cached = (0, None)
            else:
                cached = (row[0], None if row[1] is None else _STATE_DECODER.decode(row[1]))
            self._cache[key] = cached
        return cached

    def get(self, key: str) -> dict[str, Any] | None:
        return self._load(key)[1]

    def revision(self, key: str) -> int:
        return self._load(key)[0]

    def apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            self._cache[effect.aggregate] = (effect.revision, effect.state)


class _GroupState:
    """One Group's head and state view inside an open transaction."""

    __slots__ = ("view", "head_seq", "head_hash")

    def __init__(self, view: _SqlView, head_seq: int, head_hash: bytes) -> None:
        self.view = view
        self.head_seq = head_seq
        self.head_hash = head_hash


class SqliteAuthority:
    """mwpstore's ``accept`` / ``accept_many`` / ``read`` done by SQLite, for the benchmarks."""

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], int] | None = None,
        sync: bool = True,
        rules: bool = False,
        writer_lock: bool = True,
    ) -> None:
        path = Path(path)
        if path.suffix == "":
            path.mkdir(parents=True, exist_ok=True)
            path = path / DATABASE_NAME
        self.path = path
        self._clock = clock or (lambda: time.time_ns() // 1_000_000)
        self._synchronous = "FULL" if sync else "OFF"
        self.rules = rules
        self._writer = threading.Lock() if writer_lock else None
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.retries = 0
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA:
            connection.execute(statement)
        connection.execute("COMMIT")
        self._last_ms = connection.execute(_SELECT_LAST_MS).fetchone()[0] or 0

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        clock: Callable[[], int] | None = None,
        sync: bool = True,
        rules: bool = False,
        writer_lock: bool = True,
    ) -> SqliteAuthority:
        return cls(path, clock=clock, sync=sync, rules=rules, writer_lock=writer_lock)

    # -- connections ---------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            connection.execute(f"PRAGMA synchronous={self._synchronous}")
            synchronous = connection.execute("PRAGMA synchronous").fetchone()[0]
            assert mode == "wal" and synchronous == (2 if self._synchronous == "FULL" else 0), (mode, synchronous)
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection

    def settings(self) -> dict[str, Any]:
        """The durability settings actually in force (for the results file)."""
        connection = self._connection()
        return {
            "journal_mode": connection.execute("PRAGMA journal_mode").fetchone()[0],
            "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[
                connection.execute("PRAGMA synchronous").fetchone()[0]
            ],
            "busy_timeout_ms": connection.execute("PRAGMA busy_timeout").fetchone()[0],
            "sqlite_version": sqlite3.sqlite_version,
        }

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()
        self._local = threading.local()

    def __enter__(self) -> SqliteAuthority:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- accept --------------------------------------------------------------------------------

    def accept(self, command: Command) -> Receipt:
        """Accept one Command in its own durable transaction; the original receipt on a replay."""
        check_command(command)
        data = command_bytes(command)
        digest = content_hash(data)
        connection = self._connection()
        cursor = connection.cursor()
        replayed = _stored_receipt(cursor, command, digest)
        if replayed is not None:
            return replayed
        with self._writing():
            return self._accept_one(connection, cursor, command, data, digest)

    def _writing(self) -> Any:
        return self._writer if self._writer is not None else contextlib.nullcontext()

    def _accept_one(
        self, connection: sqlite3.Connection, cursor: sqlite3.Cursor, command: Command, data: bytes, digest: bytes
    ) -> Receipt:
        for _attempt in range(RETRIES_MAX):
            try:
                cursor.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                self._count_retry()
                continue
            try:
                receipt = self._accept_in(cursor, command, data, digest, self._now())
                cursor.execute("COMMIT")
                return receipt
            except sqlite3.OperationalError as exc:
                _rollback(connection)
                if not _is_busy(exc):
                    raise
                self._count_retry()
            except BaseException:
                _rollback(connection)
                raise
        raise MwpError(f"SQLite stayed locked through {RETRIES_MAX} retries")

    def accept_many(self, commands: list[Command]) -> list[AcceptResult]:
        """Accept Commands in one durable transaction; a result (receipt or rejection) for each."""
        prepared: list[tuple[Command, bytes, bytes] | MwpError] = []
        for command in commands:
            try:
                check_command(command)
                data = command_bytes(command)
                prepared.append((command, data, content_hash(data)))
            except MwpError as exc:
                prepared.append(exc)
        connection = self._connection()
        cursor = connection.cursor()
        with self._writing():
            return self._accept_batch(connection, cursor, prepared)

    def _accept_batch(
        self,
        connection: sqlite3.Connection,
        cursor: sqlite3.Cursor,
        prepared: list[tuple[Command, bytes, bytes] | MwpError],
    ) -> list[AcceptResult]:
        for _attempt in range(RETRIES_MAX):
            try:
                cursor.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                self._count_retry()
                continue
            try:
                now_ms = self._now()
                batch: dict[str, _GroupState] = {}
                results = []
                for item in prepared:
                    if isinstance(item, MwpError):
                        results.append(AcceptResult.failed(item))
                        continue
                    try:
                        receipt = self._accept_in(cursor, item[0], item[1], item[2], now_ms, batch)
                    except Rejection as exc:
                        results.append(AcceptResult.failed(exc))
                    else:
                        results.append(AcceptResult(receipt=receipt))
                for group, state in batch.items():  # heads once per transaction
                    cursor.execute(_UPSERT_HEAD, (group, state.head_seq, state.head_hash))
                cursor.execute("COMMIT")
                return results
            except sqlite3.OperationalError as exc:
                _rollback(connection)
                if not _is_busy(exc):
                    raise
                self._count_retry()
            except BaseException:
                _rollback(connection)
                raise
        raise MwpError(f"SQLite stayed locked through {RETRIES_MAX} retries")

    def _accept_in(
        self,
        cursor: sqlite3.Cursor,
        command: Command,
        data: bytes,
        digest: bytes,
        now_ms: int,
        batch: dict[str, _GroupState] | None = None,
    ) -> Receipt:
        """The acceptance transaction's body; raises a ``Rejection`` before writing anything.

        ``batch`` carries what this transaction already read or wrote per Group (head, aggregate
        states), so the Commands of one ``accept_many`` are decided against the uncommitted state
        without reading it back, as mwpstore's commit leader does.
        """
        replayed = _stored_receipt(cursor, command, digest)
        if replayed is not None:
            return replayed
        group = command.group
        state = batch.get(group) if batch is not None else None
        if state is None:
            head = cursor.execute(_SELECT_HEAD, (group,)).fetchone()
            state = _GroupState(_SqlView(cursor, group), *(head if head is not None else (0, ZERO_HASH)))
            if batch is not None:
                batch[group] = state
        transition = run_transition if self.rules else lean_transition
        event = transition(
            state.view,
            command,
            seq=state.head_seq + 1,
            now_ms=now_ms,
            prev_hash=state.head_hash,
            content_hash=digest,
            data=data,
        )
        receipt = receipt_for(event)
        cursor.execute(_INSERT_EVENT, _event_row(event))
        for effect in event.effects:
            encoded = None if effect.state is None else _ENCODER.encode(effect.state)
            cursor.execute(_UPSERT_AGGREGATE, (group, effect.aggregate, effect.revision, encoded))
        cursor.execute(_INSERT_RECEIPT, (command.actor, command.action_id, digest, encode_receipt(receipt)))
        if batch is None:
            cursor.execute(_UPSERT_HEAD, (group, event.seq, event.hash))
        state.view.apply(event.effects)
        state.head_seq, state.head_hash = event.seq, event.hash
        return receipt

    def _now(self) -> int:
        """The acceptance time, as mwpstore's commit takes it: the clock's reading checked
        (``InvalidCommand``, field ``clock``, for anything but int milliseconds in
        0..``TIME_MS_MAX``) and never before the last acceptance time. Called inside the write
        transaction, which orders writers; a transaction rolled back afterwards leaves the time
        raised, as a rejected batch does in mwpstore."""
        now_ms = max(clock_reading(self._clock), self._last_ms)
        self._last_ms = now_ms
        return now_ms

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    # -- read and redo -------------------------------------------------------------------------

    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[Event]:
        """Events of ``group`` with sequence > ``after``, in order, decoded into ``Event`` objects."""
        rows = self._connection().execute(_SELECT_EVENTS, (group, after, limit)).fetchall()
        return [_event_from_row(row) for row in rows]

    def head(self, group: str) -> int:
        row = self._connection().execute(_SELECT_HEAD, (group,)).fetchone()
        return 0 if row is None else row[0]

    def redo(self, events: Iterable[Event], *, batch_events: int = 10_000) -> int:
        """Re-apply already-decided Events (as a recovery would): rows, aggregates, receipts, heads.

        The Events' effects are applied as they are (no rules run); ``batch_events`` per durable
        transaction. Returns the number of Events applied.
        """
        connection = self._connection()
        applied = 0
        batch: list[Event] = []
        for event in events:
            batch.append(event)
            if len(batch) >= batch_events:
                applied += self._redo_batch(connection, batch)
                batch = []
        if batch:
            applied += self._redo_batch(connection, batch)
        return applied

    def _redo_batch(self, connection: sqlite3.Connection, events: list[Event]) -> int:
        heads: dict[str, tuple[int, bytes]] = {}
        aggregates = []
        receipts = []
        for event in events:
            for effect in event.effects:
                state = None if effect.state is None else _ENCODER.encode(effect.state)
                aggregates.append((event.group, effect.aggregate, effect.revision, state))
            receipts.append((event.actor, event.action_id, event.content_hash, encode_receipt(receipt_for(event))))
            heads[event.group] = (event.seq, event.hash)
            self._last_ms = max(self._last_ms, event.accepted_at_ms)
        with self._writing():
            self._redo_transaction(connection, events, aggregates, receipts, heads)
        return len(events)

    def _redo_transaction(
        self,
        connection: sqlite3.Connection,
        events: list[Event],
        aggregates: list[tuple[Any, ...]],
        receipts: list[tuple[Any, ...]],
        heads: dict[str, tuple[int, bytes]],
    ) -> None:
        connection.execute("BEGIN IMMEDIATE")
        try:
            connection.executemany(_INSERT_EVENT, [_event_row(event) for event in events])
            connection.executemany(_UPSERT_AGGREGATE, aggregates)
            connection.executemany(_INSERT_RECEIPT, receipts)
            connection.executemany(_UPSERT_HEAD, [(group, seq, digest) for group, (seq, digest) in heads.items()])
            connection.execute("COMMIT")
        except BaseException:
            _rollback(connection)
            raise


def lean_transition(
    view: _SqlView,
    command: Command,
    *,
    seq: int,
    now_ms: int,
    prev_hash: bytes,
    content_hash: bytes,
    data: bytes | None = None,
) -> Event:
    """The acceptance transaction without the rules of kinds: revision check, new state, chain hash.

    The aggregate is ``<kind's first word>:<target>``; its new state is the old one updated with the
    Command's body. No membership, existence or field checks (``rules=True`` runs mwpstore's).
    """
    aggregate = f"{command.kind.partition('.')[0]}:{command.target}"
    current = view.revision(aggregate)
    if command.expected_revision is not None and command.expected_revision != current:
        raise RevisionMismatch(
            f"{aggregate} is at revision {current}, not {command.expected_revision}",
            current_revision=current,
            aggregate=aggregate,
        )
    body = command.body
    previous = view.get(aggregate)
    state = {**previous, **body} if previous is not None else dict(body)
    effects = [Effect(aggregate, current + 1, state)]
    payload = payload_hash_of(body)
    event_id = make_event_id(command.group, seq)
    digest = event_hash(
        group=command.group,
        seq=seq,
        event_id=event_id,
        kind=command.kind,
        aggregate=aggregate,
        revision=current + 1,
        actor=command.actor,
        action_id=command.action_id,
        content_hash=content_hash,
        accepted_at_ms=now_ms,
        authoritative=True,
        effects=effects,
        payload_hash=payload,
        prev_hash=prev_hash,
    )
    return Event(
        command.group,
        seq,
        event_id,
        command.kind,
        aggregate,
        current + 1,
        command.actor,
        command.action_id,
        content_hash,
        now_ms,
        True,
        body,
        effects,
        payload,
        prev_hash,
        digest,
    )


def _stored_receipt(cursor: sqlite3.Cursor, command: Command, digest: bytes) -> Receipt | None:
    row = cursor.execute(_SELECT_RECEIPT, (command.actor, command.action_id)).fetchone()
    if row is None:
        return None
    if row[0] != digest:
        raise ActionIdCollision(
            f"action {command.action_id!r} of {command.actor!r} was already accepted with different content",
            actor=command.actor,
            action_id=command.action_id,
        )
    return decode_receipt(row[1])


def _event_row(event: Event) -> tuple[Any, ...]:
    return (
        event.group,
        event.seq,
        event.event_id,
        event.kind,
        event.aggregate,
        event.revision,
        event.actor,
        event.action_id,
        event.content_hash,
        event.accepted_at_ms,
        int(event.authoritative),
        None if event.body is None else _ENCODER.encode(event.body),
        _ENCODER.encode(event.effects),
        event.payload_hash,
        event.prev_hash,
        event.hash,
    )


def _event_from_row(row: tuple[Any, ...]) -> Event:
    return Event(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        row[9],
        bool(row[10]),
        None if row[11] is None else _BODY_DECODER.decode(row[11]),
        _EFFECTS_DECODER.decode(row[12]),
        row[13],
        row[14],
        row[15],
    )


def _rollback(connection: sqlite3.Connection) -> None:
    if connection.in_transaction:
        connection.execute("ROLLBACK")
