"""The authority: atomic acceptance transactions over a segment log with an LMDB index.

One accepted Command is one Event record in the segment log (the commit point) and one LMDB
transaction that reflects it (states, heads, receipts, indexes). Many threads call ``accept``; a
leader gathers the waiting Commands, decides them in order against the uncommitted state, writes
their Events with one log append (one write, one fdatasync), commits LMDB once, and wakes every
caller with its own receipt or rejection (group commit). See ``docs/recovery.md`` for what open()
does after a crash or a power loss.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import re
import struct
import tempfile
import threading
import time
from threading import get_ident
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lmdb
import msgspec

from . import _fork, _gc, _index_c, canonical, failpoints, limits
from .errors import (
    ActionIdCollision,
    Corruption,
    CursorTooOld,
    EventInvalid,
    InvalidCommand,
    InvalidState,
    LimitExceeded,
    MwpError,
    NotFound,
    Rejection,
    SequenceGap,
    StorageFailed,
    StoreClosed,
    StoreLocked,
    StoreNotFound,
    translate,
)
from ._files import (
    Directory,
    makedirs_durable,
    open_below,
    open_child,
    remove_names_at,
    remove_temp_copies_at,
    store_path,
    take_lock_file,
    write_file_at,
)
from ._files import fsync_directory_raw as _fsync_directory  # a module name the tests replace
from ._lmdb_check import check_before_open, check_lmdb_file, check_map_size, check_option
from ._sealed import DAMAGE_ERRORS, KEY_SHOWN_BYTES, LMDB_DAMAGE_ERRORS, LMDB_FILE_DAMAGE_ERRORS, damage_of, lmdb_cause, typed_damage
from .index import (
    INDEX_FORMAT,
    Index,
    PendingWrites,
    ack_key,
    decode_head,
    decode_state,
    encode_head,
    encode_state,
    event_key,
    read_u64,
    receipt_key,
    remove_index,
    state_key,
    u64,
)
from .messages import (
    DECODE_ERRORS,
    HASH_BYTES,
    ZERO_HASH,
    AcceptResult,
    Command,
    Effect,
    Event,
    Receipt,
    check_command,
    command_bytes,
    decode_events,
    decode_logged_event,
    decode_receipt,
    encode_event,
    encode_receipt,
    payload_hash_of,
    receipt_for,
    recompute_event_hash,
)
# audit_log and tempfile load with this module, not at a call's first use: an import is I/O (a
# process out of file descriptors fails it with a bare OSError), and the store's files are all
# opened where their errors are typed.
from .audit_log import FileKeyProvider, current_org_key, verify_audit_log_against_snapshot, write_audit_log
from .registry import ENGINE_ACTOR, run_transition
from .segment_log import COMMIT_FRAME_BYTES, RecordBatch, SegmentLog, check_segment_bytes, framed_bytes, group_bytes_max
from .snapshot import (
    KEY_ID_CHARS,
    SIGNING_KEY_NAME,
    Keyring,
    SigningKey,
    SnapshotRef,
    check_snapshot_ref,
    create_snapshot,
    drop_retired_key,
    read_snapshot_file,
    retired_public_keys,
    snapshot_ref,
    verify_snapshot,
)

EVENT_TAG = b"E"
ACK_TAG = b"A"
SNAPSHOT_TAG = b"S"
ARCHIVE_TAG = b"R"
RECEIPT_TAG = b"P"  # a permanent receipt kept when compaction dropped its Event
GROUP_TAG = b"G"  # what stays of a compacted archived Group: head, Group aggregate, Memberships
_RECEIPT_DECODER = msgspec.msgpack.Decoder(tuple[str, str, bytes, bytes])
_GROUP_DECODER = msgspec.msgpack.Decoder(tuple[str, int, bytes, list[Effect]])
# The first form, written by compaction up to 0.1.0 (before a5cb9be): the Group aggregate only,
# as (group, seq, chain hash, revision, state). Read as the one Effect it kept.
_GROUP_DECODER_FIRST = msgspec.msgpack.Decoder(tuple[str, int, bytes, int, dict[str, Any]])
_NOTE_ENCODER = msgspec.msgpack.Encoder(order="sorted")


class ArchiveRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What archival produced for a Group: its signed final snapshot and its encrypted audit log."""

    org: str
    group: str
    final_snapshot: SnapshotRef
    audit_location: str
    audit_file_hash: str
    audit_bytes: int
    audit_key_id: str
    audit_chunks: int
    events: int
    last_seq: int
    archived_at_ms: int
_ACK_ENCODER = msgspec.msgpack.Encoder()
_ACK_DECODER = msgspec.msgpack.Decoder(tuple[str, str, int])
REDO_COMMIT_RECORDS = 50_000
REDO_HEADS_CACHED_MAX = 100_000
"""Group heads redo keeps in memory across its commits (a Group met again is read back from the index)."""


_F = TypeVar("_F", bound=Callable[..., Any])


_INDEX_DAMAGE = ("index", "run `mwpstore rebuild` to regenerate it from the log", "index")
_damage_typed = typed_damage(*_INDEX_DAMAGE)
_READ_ERRORS = DAMAGE_ERRORS + (SystemError,)  # SystemError: the binding's, around an LMDB error (damage_of)


def _file_problem(what: str, exc: MwpError) -> str:
    """A ``verify()`` problem line for a file that failed its check: the error's code, its
    ``check`` in parentheses when it names one, and its message."""
    check = exc.detail.get("check")
    return f"{what}: {exc.code}{f' ({check})' if check else ''} {exc.message}"


def _index_errors_typed(method: _F) -> _F:
    """For the methods that read the index: while one runs, ``close()`` waits before it closes
    the index (a value read with ``buffers=True`` points into its map, so closing it under a
    reader was a false ``CORRUPTION`` or a crash); a call after ``close()`` is ``StoreClosed``.
    The key changes (``rotate_signing_key``, ``drop_retired_key``) use it too: once ``close()``
    has released the store, another process may open it and sign with the key files it finds.
    What a damaged index can raise is translated into ``CORRUPTION`` (as ``typed_damage`` does,
    in the same frame: these are the read and duplicate-accept paths)."""

    @functools.wraps(method)
    def reading(self: Authority, *args: Any, **kwargs: Any) -> Any:
        # The reader registers before it looks at _closed, and close() sets _closed before it
        # waits for the registry to empty: a read either sees the store closed or is waited for.
        # list.append and list.remove are atomic, so a read takes no lock. The append is inside
        # the try: CPython raises a signal's exception (KeyboardInterrupt) as a call returns, and
        # one raised as append returns must still unregister (close() would wait for it forever).
        if self._closed:  # not registered at all: readers retrying after close() never hold it up
            raise StoreClosed("the authority is closed; open it again")
        if self._fork_generation != _fork.generation:
            raise StoreClosed(f"the authority: {_fork.FORKED_MESSAGE}")
        reader = get_ident()
        readers = self._readers
        try:
            readers.append(reader)
            if self._closed:
                raise StoreClosed("the authority is closed; open it again")
            return method(self, *args, **kwargs)
        except MwpError:
            raise
        except _READ_ERRORS as exc:
            raise damage_of(*_INDEX_DAMAGE, exc) from None
        finally:
            readers.remove(reader)
            if self._retired:  # handles a compaction or rebuild replaced: this read may have been their last
                self._release_retired()

    return reading  # type: ignore[return-value]


def default_clock() -> int:
    """Wall-clock milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


def _log_id_text(value: bytes | memoryview) -> str:
    """The log id a ``meta`` entry names, as the log's own is shown; a value of another size (no
    id this engine writes: any length, from outside) as hex, its first 16 bytes only."""
    if len(value) == 8:
        return str(read_u64(value))
    shown = bytes(value[:_LOG_ID_SHOWN_BYTES]).hex()
    return shown if len(value) <= _LOG_ID_SHOWN_BYTES else f"{shown}… of {len(value)} bytes"


_LOG_ID_SHOWN_BYTES = 16


def _untrusted_index(log: SegmentLog, log_id: bytes | memoryview | None, position: int, *, restarted: bool) -> str | None:
    """Why an index whose ``meta`` names ``log_id`` and ``position`` cannot be taken as ``log``'s
    (None if it can): the judgement of docs/recovery.md, step 4, for the writer's open (which
    rebuilds) and a read-only view (which refuses). ``restarted``: not closed cleanly before a
    machine restart. A log id tells first; an index of an older build names none."""
    if log_id is not None and bytes(log_id) != u64(log.log_id):
        # Built from another log: one a compaction replaced since, or another store's. Its
        # positions name records of that log, whatever its own position says.
        return f"the index belongs to another log (log id {_log_id_text(log_id)}, the log's is {log.log_id})"
    if restarted:
        return "the machine restarted since the index was last written without a clean close"
    if not log.start <= position <= log.end:
        return f"index position {position} is outside the log [{log.start}, {log.end}]"
    if not _group_ends_at(log, position):
        # The same log id, but not this log's history: a copy of the index taken ahead of a log
        # that was restored from an older copy (or cut) and has grown since. Its redo would
        # start inside a record.
        return f"index position {position} is not where a group of the log ends"
    return None


def _group_ends_at(log: SegmentLog, position: int) -> bool:
    """``log.group_ends_at(position)``; True when the segment it reads is damaged or unreadable:
    that is the log's damage, which reads, redo and ``verify`` find and report as before."""
    try:
        return log.group_ends_at(position)
    except (Corruption, StorageFailed):
        return True


def current_boot_id() -> str:
    """The kernel's boot id (tells a process crash from a reboot). Tests may override it."""
    override = os.environ.get("MWPSTORE_BOOT_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return "unknown"


class _OwnedLock:
    """A lock that knows the thread holding it. The calls that take it run the application's
    code while they hold it (the clock, a key provider); called back from there, such a call
    would wait for the lock its own thread holds, for ever: it is ``InvalidCommand`` (field the
    call's name) instead."""

    def __init__(self, calls: str, callbacks: str) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None
        self._calls = calls
        self._callbacks = callbacks

    def refuse_holder(self, what: str) -> None:
        """``InvalidCommand`` (field ``what``) when this thread holds the lock."""
        if self._holder == get_ident():
            raise InvalidCommand(
                f"{what}() was called from inside a callback ({self._callbacks}) of a running {self._calls} of this "
                "authority; call it after that returns",
                field=what,
            )

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        self.refuse_holder(what)
        with self._lock:
            try:
                self._holder = get_ident()
                yield
            finally:
                self._holder = None


# -- Requests handed to the commit leader ----------------------------------------------------------


class _Request:
    __slots__ = ("command", "data", "content_hash", "trusted", "ack", "note", "receipt", "error", "ack_result")

    def __init__(
        self,
        command: Command | None,
        data: bytes = b"",
        content_hash: bytes = b"",
        trusted: bool = False,
        ack: tuple[str, str, int] | None = None,
        note: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.command = command
        self.note = note  # (tag, index key, encoded value): a reference logged and indexed as is
        self.data = data
        self.content_hash = content_hash
        self.trusted = trusted
        self.ack = ack
        self.receipt: Receipt | None = None
        self.error: MwpError | None = None
        self.ack_result = 0


class _Withdrawn(BaseException):
    """Raised by a commit interrupted before its batch reached the log (carries the interrupt)."""

    def __init__(self, interrupt: BaseException) -> None:
        super().__init__(interrupt)
        self.interrupt = interrupt


class _Unit:
    """Requests that must share one durable commit (one ``accept`` or one ``accept_many``)."""

    __slots__ = ("requests", "done", "gate", "wake_next")

    def __init__(self, requests: list[_Request]) -> None:
        self.requests = requests
        self.done = False
        # Held from the start; released once, by whoever wakes this unit's caller: because the
        # unit is done, or because leadership passes to it. Each caller sleeps on its own gate,
        # so a commit wakes exactly the callers it answered and the next leader.
        self.gate = threading.Lock()
        self.gate.acquire()
        # The next answered unit whose caller this unit's caller wakes (see Authority._lead).
        self.wake_next: _Unit | None = None


class _GroupView:
    """A StateView of one Group: the batch's uncommitted changes over the LMDB write transaction."""

    __slots__ = ("_batch", "_prefix")

    def __init__(self, batch: _Batch, group: str) -> None:
        self._batch = batch
        self._prefix = group.encode() + b"\x00"

    def _read(self, key: str) -> tuple[int, dict[str, Any] | None]:
        """The revision and state at ``key`` read from the index, kept for the rest of the batch
        (``get`` and ``revision`` look in the batch first, without a call of their own)."""
        batch = self._batch
        full_key = self._prefix + key.encode()
        value = batch.index.get(batch.txn, b"states", full_key)
        entry = (0, None) if value is None else decode_state(value)
        batch.states[full_key] = entry
        return entry

    def get(self, key: str) -> dict[str, Any] | None:
        return (self._batch.states.get(self._prefix + key.encode()) or self._read(key))[1]

    def revision(self, key: str) -> int:
        return (self._batch.states.get(self._prefix + key.encode()) or self._read(key))[0]


class _Batch:
    """One commit's decisions: what its Commands read and wrote, and its log group. Made once
    per commit: a plain class with slots (a dataclass with eight ``default_factory`` fields cost
    1.7 µs to make, a third of it calling the factories)."""

    __slots__ = ("index", "txn", "states", "dirty_states", "created_states", "heads", "receipts", "acks", "notes", "records",
                 "events", "record_bytes", "group_bytes", "group_room")

    def __init__(self, index: Index, txn: lmdb.Transaction, group_room: int = limits.GROUP_BYTES_MAX) -> None:
        self.index = index
        self.txn = txn
        self.states: dict[bytes, tuple[int, dict[str, Any] | None]] = {}
        self.dirty_states: dict[bytes, bytes] = {}
        # The state keys written at revision 1 in this batch: their presence entries (a key can
        # reach revision 2 in the same batch, so the final revision does not say it).
        self.created_states: set[bytes] = set()
        self.heads: dict[str, tuple[int, bytes]] = {}
        self.receipts: dict[bytes, tuple[bytes, Receipt, bytes]] = {}
        self.acks: dict[bytes, int] = {}
        self.notes: list[tuple[bytes, bytes, bytes]] = []
        self.records: list[bytes] = []
        self.events: list[Event] = []
        self.record_bytes = 0  # the records' payload bytes: at most limits.GROUP_BYTES_MAX per commit
        # What the records take in a segment, framed, with the commit frame: a log group must fit
        # an empty segment (segment_log.group_bytes_max), which with small segments is the
        # tighter bound.
        self.group_bytes = COMMIT_FRAME_BYTES
        self.group_room = group_room

    def room_for(self, record: bytes, framed: int) -> bool:
        """Whether ``record`` (``framed`` bytes in a segment) still fits this commit's log group."""
        return self.record_bytes + len(record) <= limits.GROUP_BYTES_MAX and self.group_bytes + framed <= self.group_room

    def add_record(self, record: bytes, framed: int) -> None:
        self.records.append(record)
        self.record_bytes += len(record)
        self.group_bytes += framed

    def head(self, group: str) -> tuple[int, bytes]:
        head = self.heads.get(group)
        if head is None:
            head = self.index.head(self.txn, group)
        return head


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked and found. ``problems`` is empty when everything holds."""

    records: int
    events: int
    groups: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class OpenReport:
    """How open() brought the index level with the log."""

    mode: str  # "clean", "redo" or "rebuild"
    reason: str
    redo_records: int


@dataclass
class _LeaseWatch:
    """The WorkItems of one Group whose state holds a lease, so a lease sweep reads those alone.

    Made at the Group's first sweep on a handle, from a scan of all its WorkItems; every commit
    after that keeps it (``Authority._note_leases``). While the scan runs (``held`` None), the
    commits record what they changed in ``changes``, applied over the scan's result when it ends:
    a commit the scan's read did not see is not lost."""

    held: set[str] | None = None
    changes: dict[str, bool] = field(default_factory=dict)  # WorkItem id -> holds a lease now


class Authority:
    """The authoritative store: ``accept``, ``read``, ``subscribe``, ``ack``, ``verify``, ``rebuild``.

    Open with :meth:`open`. One writer process per directory (``STORE_LOCKED`` otherwise); any
    number of threads may call every method concurrently. ``open(path, readonly=True)`` is a
    read-only view beside that writer, in any other process (see :meth:`open`).
    """

    def __init__(self) -> None:  # use Authority.open
        raise TypeError("use Authority.open(path, ...)")

    # The log and the index are swapped together (compaction, rebuild): readers that need both
    # take ``self._pair`` once, so positions always come from the index that matches the log.
    _pair: tuple[SegmentLog, Index | None]
    path: str
    open_report: OpenReport
    _clock: Callable[[], int]
    _sync: bool
    _map_size: int
    _check_lmdb: bool | None
    _segment_bytes: int
    _closed: bool
    _failure: MwpError | None
    _queue: deque[_Unit]
    _lock: threading.Lock
    _wake: threading.Condition
    _leader: bool
    _exclusive_waiting: int
    _published: threading.Condition
    _published_waiting: int  # the wait_for calls inside _published (its lock held to change it)
    _last_ms: int
    _signing_key: SigningKey | None
    _key_lock: threading.Lock  # guards _signing_key and _key_changes
    _key_changes: int  # counts rotations begun and ended: a key read from the file across one is stale
    _durable_directories: set[str]
    _snapshot_lock: _OwnedLock  # one snapshot, or key change, at a time
    _unsettled_snapshots: list[tuple[str, int, str, str | None]]  # (group, seq, location, the one named before) of snapshots an interrupt ended: close() decides
    _closed_cleanly: bool  # the store was closed cleanly before this open (nothing for the open to sweep)
    _archive_lock: _OwnedLock  # one archive() at a time: each Group's record is logged once
    _retired: list[tuple[set[int], list[Any]]]  # replaced handles, with the threads whose reads may still use them
    _retire_lock: threading.Lock  # one release of replaced handles at a time (readers' and close())
    _lease_watches: dict[str, _LeaseWatch]  # by Group: the leased WorkItems, for the lease sweep
    _lease_lock: threading.Lock  # guards _lease_watches and each watch in it
    _lock_fd: int
    _readers: list[int]  # the thread of each index read in flight, which close() waits for
    _closing: threading.Lock  # makes "not closed yet, close now" one step for concurrent close() calls
    _committer: int | None  # the thread holding the commit role (a leader, or rebuild/compact/verify's _exclusive)
    _fork_generation: int  # the process this handle belongs to (mwpstore._fork): none other may use it
    _readonly: bool  # a read-only view (open(readonly=True)): no lock, no recovery, no write
    _store_key: tuple[int, int] | None  # (device, inode) of the directory this handle writes, in _WRITERS_HERE

    @property
    def log(self) -> SegmentLog:
        return self._pair[0]

    @property
    def index(self) -> Index:
        index = self._pair[1]
        assert index is not None
        return index

    # -- opening and closing ---------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], int] | None = None,
        sync: bool = True,
        segment_bytes: int = limits.SEGMENT_BYTES_DEFAULT,
        map_size: int = limits.LMDB_MAP_BYTES_DEFAULT,
        progress: Callable[[int, int], None] | None = None,
        check_lmdb: bool | None = None,
        create: bool = True,
        readonly: bool = False,
    ) -> Authority:
        """Open (creating on first use) the authority stored under ``path``.

        ``create=False`` opens only an existing store: ``StoreNotFound``, with nothing written,
        when ``path`` holds none. A store whose log is gone while its index or keys remain is
        ``Corruption`` (reason ``log_missing``), never a new empty history.

        ``sync=False`` is a bulk-load mode: commits are not durable until :meth:`sync` or close.
        ``progress(done, total)`` is called while redoing or rebuilding the index.
        ``check_lmdb``: check the index's LMDB file structure before LMDB maps it (True always,
        False never, None when the file is at most ``limits.LMDB_CHECK_AT_OPEN_BYTES_MAX``
        bytes; the two meta pages always); a damaged index is rebuilt from the log
        (``open_report.reason`` says so).

        ``readonly=True`` opens a read-only view of an existing store, beside the process that
        holds it open for writing (or with none): it takes no lock, runs no recovery and writes
        nothing (LMDB's reader table in ``index/lock.mdb`` aside, which is how LMDB lets readers
        of other processes in). The view is the store as it was at this call: ``read``, ``head``,
        ``state``, ``replay_floor`` and the other reads answer from one LMDB read transaction,
        whose every position is in the log opened after it, so it shows only durable Events; open
        a new view to see later ones. Every method that writes raises ``InvalidState`` (reason
        ``readonly``). A store that needs what only a writer does first (no index yet, an index of
        another format or from before a restart that was not closed cleanly, a compaction or a
        rebuild switching files) is ``InvalidState`` (reason ``recovery_needed``); no store at
        ``path`` is ``StoreNotFound``. In a process that holds the same store open for writing it
        is ``InvalidCommand``: LMDB must not open one environment twice in a process (closing the
        second would drop the first's locks). ``sync``, ``segment_bytes``, ``progress``,
        ``check_lmdb`` and ``create`` do not apply (the LMDB structure check would race the
        writer's commits; the writer checked the file when it opened it).
        """
        # Every option is checked before anything is created: a directory left with a lock file
        # holds a store as far as the next open (create=False too) is concerned.
        check_option(check_lmdb)  # here: a bad option must not pass for a damaged index below
        if type(create) is not bool:
            raise InvalidCommand("create must be True or False", field="create")
        if type(sync) is not bool:  # None or 0 would have meant the bulk-load mode, not durable
            raise InvalidCommand("sync must be True or False", field="sync")
        if type(readonly) is not bool:  # a truthy non-bool must not decide between writing and not
            raise InvalidCommand("readonly must be True or False", field="readonly")
        check_map_size(map_size)
        check_segment_bytes(segment_bytes)
        progress = checked_progress(progress)
        if clock is not None and not callable(clock):
            raise InvalidCommand("clock must be a callable returning int milliseconds, or None", field="clock")
        self = object.__new__(cls)
        self._fork_generation = _fork.generation
        # Absolute from here on: the store's files (snapshots, keys, archives, a rebuilt index) are
        # found from self.path, and a relative one would follow the process's later chdir.
        self.path = os.path.abspath(store_path(path))
        self._clock = clock or default_clock
        self._sync = sync
        self._map_size = map_size
        self._check_lmdb = check_lmdb
        self._closed = False
        self._failure = None
        self._queue = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._readers = []
        self._closing = threading.Lock()
        self._committer = None
        self._leader = False
        self._exclusive_waiting = 0
        self._published = threading.Condition(threading.Lock())
        self._published_waiting = 0
        self._last_ms = 0
        self._signing_key = None
        self._key_lock = threading.Lock()
        self._key_changes = 0
        self._durable_directories = set()
        self._snapshot_lock = _OwnedLock("snapshot, rotate_signing_key or drop_retired_key", "the clock")
        self._unsettled_snapshots = []
        self._closed_cleanly = True
        self._archive_lock = _OwnedLock("archive", "the key provider, the clock")
        self._segment_bytes = segment_bytes
        self._retired = []
        self._retire_lock = threading.Lock()
        self._lease_watches = {}
        self._lease_lock = threading.Lock()
        self._readonly = readonly
        self._store_key = None
        _refuse_agent_store(self.path)
        if readonly:
            if not _holds_store(self.path):
                raise StoreNotFound(f"no store at {self.path!r}", path=self.path)
            self._lock_fd = -1
            self._open_view()
            return self
        if not _holds_store(self.path):
            if not create:
                raise StoreNotFound(f"no store at {self.path!r}", path=self.path)
            # Each new directory's entry synced in its parent: with a bare makedirs a power loss
            # could take the store directory, and every acknowledged Command in it, along. One
            # found in place (empty: a process killed before its parent's fsync) is synced too.
            makedirs_durable(self.path, root=os.path.dirname(self.path))
        self._lock_fd = _lock_store(self.path)
        try:
            # Registered as this process's writer from the lock on, not once open: a read-only
            # view asked for meanwhile (from the open's own progress callable) would open the
            # index LMDB environment the recovery holds (LMDB's "already open", reported as
            # StorageFailed) or wait for the rebuild to end, where it is InvalidCommand at once.
            self._store_key = _directory_key(self.path)
            if self._store_key is not None:
                _WRITERS_HERE[self._store_key] = self._fork_generation
            from .compaction import finish_compaction, recover_interrupted_compaction

            force_rebuild = recover_interrupted_compaction(self.path)
            _check_log_present(self.path)
            self._pair = (SegmentLog.open(os.path.join(self.path, "log"), segment_bytes=segment_bytes, sync=sync), None)
            try:
                if force_rebuild:
                    remove_index(self._index_dir())
                self.open_report = self._open_index(progress)
                if force_rebuild:  # the new log read whole into the index: the old one can go
                    finish_compaction(self.path)
                self._finish_audit_deletions()
                if not self._closed_cleanly:
                    self._sweep_unrecorded_snapshots()
                # A kill inside rotate_signing_key between writing the new seed and renaming it
                # leaves the seed in a temporary file: a secret that never became the key. The lock
                # makes this process the only writer of keys/, so such a file is a dead write's.
                # A sweep that cannot run (keys/ unreadable, or no directory) does not stop the
                # open: the key's own use reports that, and the next open sweeps again.
                # keys/ opened from the store down, never through a link: a link there (refused
                # by the key's first use) must not have files deleted wherever it points.
                with contextlib.suppress(MwpError, FileNotFoundError):
                    with open_below(self.path, "keys", create=False, keys=True) as keys:
                        remove_temp_copies_at(keys, f"{SIGNING_KEY_NAME}.key")
            except BaseException:
                index = self._pair[1]
                if index is not None:
                    with contextlib.suppress(Exception):
                        index.close()
                with contextlib.suppress(Exception):
                    self.log.close()
                raise
        except (OSError, lmdb.Error) as exc:
            self._unregister_writer()
            os.close(self._lock_fd)
            raise translate(exc, context=f"opening {self.path}") from None
        except BaseException:
            self._unregister_writer()
            os.close(self._lock_fd)
            raise
        return self

    def _unregister_writer(self) -> None:
        if self._store_key is not None:
            _WRITERS_HERE.pop(self._store_key, None)

    def _open_view(self) -> None:
        """Open the index, then the log, read-only (see :meth:`open`); retried while a compaction
        or a rebuild by the writer switches files under the open."""
        key = _directory_key(self.path)
        if key is not None and _WRITERS_HERE.get(key) == _fork.generation:
            raise InvalidCommand(
                f"this process holds {self.path!r} open for writing: read through that handle "
                "(a read-only view is for other processes)",
                field="readonly",
                path=self.path,
            )
        deadline = time.monotonic() + _VIEW_OPEN_SECONDS
        while True:
            try:
                self._pair = self._view_pair()
                break
            except _Switched:
                if time.monotonic() >= deadline:
                    raise self._needs_writer("keeps switching its index or log (a compaction or rebuild is running)") from None
                time.sleep(0.01)
            except (OSError, lmdb.Error) as exc:
                raise translate(exc, context=f"opening {self.path} read-only") from None
        self.open_report = OpenReport(mode="readonly", reason="read-only view: nothing recovered or written", redo_records=0)

    def _view_pair(self) -> tuple[SegmentLog, Index]:
        """A log and an index that agree: the index's read transaction begins before the log is
        opened, so the log holds every record it names (the writer commits LMDB only after the
        log's fdatasync). ``_Switched`` when the files changed meanwhile (compaction: marker, log,
        then index; rebuild: the index): the index opened may not belong to the log opened."""
        from .compaction import MARKER

        marker = os.path.join(self.path, MARKER)
        index_file = os.path.join(self._index_dir(), "data.mdb")
        if os.path.exists(marker):
            raise self._needs_writer("has a compaction switching its log (running, or interrupted)")
        before = _file_key(index_file)
        if before is None:
            if os.path.isdir(self._index_dir(".rebuild")):  # a rebuild between its two renames, or before them
                raise _Switched()
            # A log that lost its segments beside keys/ is the writer's verdict (Corruption,
            # log_missing), not advice to open for writing; unless a compaction or a rebuild
            # switched files meanwhile.
            try:
                _check_log_present(self.path)
            except Corruption:
                if os.path.exists(marker) or _file_key(index_file) is not None:
                    raise _Switched() from None
                raise
            raise self._needs_writer("has no index yet")
        try:
            index = _IndexView(self._index_dir(), map_size=self._map_size)
        except Corruption as exc:
            if exc.detail.get("reason") != "format":
                raise
            raise self._needs_writer(f"has an index of another format ({exc.detail['format']!r})") from None
        try:
            with index.begin() as txn:
                fmt = index.get(txn, b"meta", b"format")
                meta_boot = bytes(index.get(txn, b"meta", b"boot_id") or b"").decode("ascii", "replace")
                clean = index.get(txn, b"meta", b"clean") == b"1"
                position = index.log_position(txn)
                log_id = index.get(txn, b"meta", b"log_id")
                index.check_meta(txn)
            if fmt != INDEX_FORMAT:
                raise self._needs_writer("has an index of another format")
            if meta_boot != current_boot_id() and not clean:
                raise self._needs_writer("was not closed cleanly before the machine restarted")
            # Read up to the index's position only: past it the writer may be writing a group, or
            # sealing and trimming the segment under the view's map.
            try:
                _check_log_present(self.path)  # no segments beside this index: Corruption, log_missing, as the writer says
                log = SegmentLog.open(os.path.join(self.path, "log"), readonly=True, known_end=position)
            except (Corruption, StorageFailed):
                # A compaction switching the log directory under this open (it writes its marker
                # first and replaces the index before removing it): the files read by name may be
                # two logs' (segment_replaced), or gone. Not damage: open again.
                if os.path.exists(marker) or _file_key(index_file) != before:
                    raise _Switched() from None
                raise
            try:
                if os.path.exists(marker) or _file_key(index_file) != before:
                    raise _Switched()
                verdict = _untrusted_index(log, log_id, position, restarted=False)  # a restart was refused above
                if verdict is not None:
                    raise self._needs_writer(f"cannot read its index until a writer rebuilds it: {verdict}")
            except BaseException:
                log.close()
                raise
        except BaseException:
            index.close()
            raise
        return log, index

    def _needs_writer(self, why: str) -> InvalidState:
        return InvalidState(
            f"the store at {self.path!r} {why}: it can be read read-only once a process has opened it "
            "for writing (an application, or `mwpstore inspect`)",
            reason="recovery_needed",
            path=self.path,
        )

    def _refuse_readonly(self, what: str, why: str = "this authority was opened read-only; open it without readonly=True to write") -> None:
        """``InvalidState`` (reason ``readonly``) for a method a read-only view cannot serve."""
        if self._readonly:
            raise InvalidState(f"{what}: {why}", reason="readonly", field="readonly")

    def _index_dir(self, suffix: str = "") -> str:
        return os.path.join(self.path, "index" + suffix)

    def _open_index(self, progress: Callable[[int, int], None] | None) -> OpenReport:
        for leftover in (".rebuild", ".old", ".verify"):
            remove_index(self._index_dir(leftover))
        for name in os.listdir(self.path):
            if name.startswith("index.verify-"):
                remove_index(os.path.join(self.path, name))
        boot_id = current_boot_id()
        mode, reason, index = "rebuild", "no index yet", None
        if os.path.exists(os.path.join(self._index_dir(), "data.mdb")):
            mode, reason, index = self._judge_index(boot_id)
        redo = 0
        if index is None:

            def install() -> None:
                self._pair = (self.log, Index(self._index_dir(), map_size=self._map_size))

            self._build_index(self._index_dir(), progress, install=install)
        else:
            self._pair = (self.log, index)
            redo = self._redo(index, progress)
            if redo:
                mode = "redo"
        index = self.index
        with index.begin(write=True) as txn:
            # "1" only after a clean close (a rebuilt index has none): a snapshot's or a note's
            # failure may have left files the open sweeps (see _sweep_unrecorded_snapshots).
            self._closed_cleanly = index.get(txn, b"meta", b"clean") == b"1"
            index.put(txn, b"meta", b"boot_id", boot_id.encode())
            index.put(txn, b"meta", b"clean", b"0")
            index.put(txn, b"meta", b"format", INDEX_FORMAT)
            # An index an older build wrote has no log id and was trusted as before: from here on
            # it names the log it was judged against (a rebuilt one names it already).
            index.put(txn, b"meta", b"log_id", u64(self.log.log_id))
            last_ms = index.meta_u64(txn, b"last_ms")
        self.index.sync()
        self._last_ms = 0 if last_ms is None else last_ms
        return OpenReport(mode=mode, reason=reason, redo_records=redo)

    def _judge_index(self, boot_id: str) -> tuple[str, str, Index | None]:
        """Decide whether the LMDB index can be trusted (then redo: the open index is returned)
        or must be rebuilt (None)."""
        try:
            check_before_open(self._index_dir(), self._check_lmdb, label="index", remedy=Index.remedy)
        except MwpError as exc:
            page = f" on page {exc.detail['page']}" if "page" in exc.detail else ""
            return "rebuild", f"index damaged ({exc.code}: {exc.detail.get('check', exc.message)}{page})", None
        try:
            index = Index(self._index_dir(), map_size=self._map_size)
        except MwpError as exc:
            if exc.detail.get("reason") == "format":
                return "rebuild", "index format differs", None
            return "rebuild", f"index unreadable ({exc.code})", None
        try:
            with index.begin() as txn:
                fmt = index.get(txn, b"meta", b"format")
                if fmt != INDEX_FORMAT:
                    index.close()
                    return "rebuild", "index format differs", None
                meta_boot = bytes(index.get(txn, b"meta", b"boot_id") or b"").decode("ascii", "replace")
                clean = index.get(txn, b"meta", b"clean") == b"1"
                position = index.log_position(txn)
                log_id = index.get(txn, b"meta", b"log_id")
                index.meta_u64(txn, b"last_ms")  # read by the open and the redo: a damaged one is judged here
                index.check_meta(txn)  # a damaged key hides its entry: "absent" above is not enough
        except lmdb.Error as exc:
            index.close()
            return "rebuild", f"index unreadable ({type(exc).__name__})", None
        except Corruption as exc:  # a damaged meta entry: the index cannot say what it reflects
            index.close()
            return "rebuild", f"index unreadable ({exc.code}: {exc.message})", None
        except BaseException:  # an interrupt, or an error judging it: the handle does not hold it yet
            with contextlib.suppress(Exception):
                index.close()
            raise
        verdict = _untrusted_index(self.log, log_id, position, restarted=meta_boot != boot_id and not clean)
        if verdict is not None:
            index.close()
            return "rebuild", verdict, None
        return "clean", "index trusted", index

    def _build_index(
        self,
        directory: str,
        progress: Callable[[int, int], None] | None,
        log: SegmentLog | None = None,
        *,
        install: Callable[[], None],
    ) -> int:
        """Build a fresh index from the whole log into ``directory`` (crash-safe: temp dir + rename),
        and switch to it with ``install``: until that has returned, the index in use (if any) is
        the one put aside under ``index.old/``, and a failure puts it back."""
        log = log or self.log
        temp = directory + ".rebuild"
        old = directory + ".old"
        remove_index(temp)
        # Left by a switch whose removal of the replaced index failed: no longer in use (a failure
        # that could not put the index in use back refused writes, and no rebuild runs then).
        remove_index(old)
        try:
            index = Index(temp, map_size=self._map_size)
            try:
                with index.begin(write=True) as txn:
                    index.put(txn, b"meta", b"format", INDEX_FORMAT)
                    index.put(txn, b"meta", b"log_id", u64(log.log_id))
                    index.put(txn, b"meta", b"log_position", u64(log.start))
                    # This boot's, as install() writes again: a read-only view (another process)
                    # that opens the index once it has its name, before install() ran, must not
                    # take an index without a boot id for one not closed before a restart.
                    index.put(txn, b"meta", b"boot_id", current_boot_id().encode())
                    index.put(txn, b"meta", b"clean", b"0")
                count = self._redo(index, progress, failpoint="authority.mid_rebuild", log=log)
                index.sync()
            except lmdb.Error as exc:
                raise translate(exc, context=f"writing the index {temp}") from None
            finally:
                index.close()
            if os.path.exists(directory):
                os.rename(directory, old)
            os.rename(temp, directory)
            _fsync_directory(os.path.dirname(directory))
            install()
        except BaseException:
            # Undone, as far as it can be: the index in use back under its name (a failure, or an
            # interrupt, between the two renames left no index/; one after them, in the directory's
            # sync or the switch, left the copy there, not in use, and the index in use under
            # index.old/, which the next open deletes and where every later rebuild stopped), and
            # the copy gone. What else stays is removed by the next rebuild or open.
            try:
                if os.path.isdir(old):
                    if os.path.exists(directory):
                        os.rename(directory, temp)
                    os.rename(old, directory)
                remove_index(temp)
            except (OSError, MwpError) as exc:
                if os.path.isdir(old):  # the index in use is not under its name: refuse writes
                    self._failure = StorageFailed(
                        f"a failed index rebuild could not put the index in use back under {directory} "
                        f"({exc}); reopen the authority: the open rebuilds the index",
                        reason="rebuild_interrupted",
                    )
            raise
        # The replaced index is no longer in use; a failure to remove it leaves it to the next
        # rebuild or open (the new index is in use and complete either way).
        with contextlib.suppress(OSError, MwpError):
            remove_index(old)
        return count

    def _redo(
        self,
        index: Index,
        progress: Callable[[int, int], None] | None,
        failpoint: str = "authority.mid_redo",
        log: SegmentLog | None = None,
    ) -> int:
        """Apply every log record past the index's position to the index. Returns the count."""
        log = log or self.log
        with index.begin() as txn:
            start = index.log_position(txn)
        end = log.end
        if start >= end:
            return 0
        done = 0
        txn = index.begin(write=True)
        heads: dict[str, tuple[int, bytes]] = {}
        flushed: dict[str, tuple[int, bytes]] = {}  # the heads as the index holds them now
        writes = PendingWrites()
        pending = 0
        last_ms = [0]
        try:
            begun = start
            for batch in _gc_paused_iter(log.scan(start, end=end)):
                positions, records = batch.positions, batch.records
                # A commit along the way records a position where a group ends, as every other
                # writer of the index does (the open rebuilds an index whose position is none): a
                # batch ends after records_max records, mostly inside a group or before its commit
                # frame, so the commit goes after the last group that ends in this batch.
                cut = len(positions)
                found = _last_group_end(batch, begun) if pending + cut >= REDO_COMMIT_RECORDS else None
                begun = batch.next_position
                if found is not None:
                    cut, at = found
                if cut:
                    whole = cut == len(positions)  # the common case: no copy of the batch's lists
                    _index_records(index, txn, writes, heads, positions if whole else positions[:cut],
                                   records if whole else records[:cut], last_ms)
                    writes.flush(index, txn)
                if found is not None:
                    _flush_heads(index, txn, heads, flushed)
                    index.put(txn, b"meta", b"log_position", u64(at))
                    # the time goes with the position: a redo that resumes past these records
                    # (nothing past them when this commit reached the end) never reads them again
                    _keep_last_ms(index, txn, last_ms[0])
                    txn.commit()
                    # Each commit writes only the heads that moved since the last one, and the
                    # heads kept are bounded: a log of many Groups neither writes every head seen
                    # so far at every commit nor holds every Group's head in memory.
                    if len(heads) > REDO_HEADS_CACHED_MAX:
                        heads.clear()
                    flushed = dict(heads)
                    failpoints.hit(failpoint)
                    txn = index.begin(write=True)
                    pending = -cut
                    if progress:
                        progress(at - start, end - start)
                if cut < len(positions):
                    _index_records(index, txn, writes, heads, positions[cut:], records[cut:], last_ms)
                    writes.flush(index, txn)
                done += len(positions)
                pending += len(positions)
            _flush_heads(index, txn, heads, flushed)
            index.put(txn, b"meta", b"log_position", u64(end))
            _keep_last_ms(index, txn, last_ms[0])
            txn.commit()
        except lmdb.Error as exc:
            # A commit that cannot write (EIO, ENOSPC, a file size limit) is an I/O failure, not
            # damage; translate() still makes LMDB's own damage errors CORRUPTION.
            txn.abort()
            raise translate(exc, context=f"writing the index {index.directory}") from None
        except BaseException:
            txn.abort()
            raise
        if progress:
            progress(end - start, end - start)
        return done

    def close(self) -> None:
        """Finish in-flight commits, mark the index clean and durable, release the store.

        Idempotent. A close() interrupted while it waits (``KeyboardInterrupt``) leaves the store
        closed to new work; calling close() again finishes releasing it. In a child forked from
        the process that opened it, close() only retires this copy of the handle: the parent's
        store is not synced, marked clean or unlocked, and no lock is taken (one held by a parent
        thread at the fork would never be released here). The child's copies of the lock
        descriptors (``authority.lock``, ``log/LOCK``) are closed: kept, they would hold the
        parent's flocks, and the store would stay locked after the parent closes it for as long as
        the child lives."""
        if self._fork_generation != _fork.generation:
            self._closed = True
            self._release_in_child()
            return
        if get_ident() in self._readers:
            # e.g. from a progress or key-provider callback: it would wait for its own read
            raise InvalidCommand("close() was called from inside a read of this authority; close it after the call returns", field="close")
        self._refuse_inside_commit("close")  # it would wait for the commit role its own thread holds
        with self._closing:  # held to the end: a concurrent close() returns once this one has
            self._closed = True  # from here no new read or commit starts (StoreClosed)
            if self._readonly:
                self._close_view()
            elif self._lock_fd >= 0:
                self._release()

    def _release_in_child(self) -> None:
        """close() in a forked child: drop the inherited descriptors that hold a lock. No lock of
        this handle is taken (a parent thread may have held one at the fork), and the LMDB
        environment is left alone (closing it would clear the parent's reader slots in the lock
        table they share; LMDB forbids using it across fork())."""
        fd, self._lock_fd = self._lock_fd, -1  # first: a second close() must not close a reused number
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)  # the parent's own descriptor keeps the flock
        logs = [handle for _, handles in self._retired for handle in handles if isinstance(handle, SegmentLog)]
        for log in [self._pair[0], *logs]:
            with contextlib.suppress(Exception):
                log.close()  # in a child this only drops its copies (see SegmentLog.close)

    def _release(self) -> None:
        with self._lock:
            while self._leader or self._queue:
                self._wake.wait(0.05)
        with self._published:
            self._published.notify_all()
        while self._readers:  # reads already running finish before their index is closed
            time.sleep(0.001)
        error: MwpError | None = None
        try:
            if self._failure is None:
                # No commit runs from here: a note an interrupt left queued was logged, or never will be.
                for group, seq, location, before in self._unsettled_snapshots:
                    self._discard_unrecorded_snapshot(group, seq, location, before)
                self._unsettled_snapshots = []
                if not self._sync:
                    self.log.sync()
                with self.index.begin(write=True) as txn:
                    self.index.put(txn, b"meta", b"clean", b"1")
                self.index.sync()
        except MwpError as exc:
            error = exc
        except (OSError, lmdb.Error) as exc:  # not marked clean: the next open redoes or rebuilds
            error = translate(exc, context="closing the authority")
        finally:
            with self._retire_lock:  # after a reader's release under way, which closes what it took
                retired = [handle for _, handles in self._retired for handle in handles]
                self._retired = []
            for handle in [self.index, self.log, *retired]:
                try:
                    handle.close()
                except MwpError as exc:
                    error = error or exc
                except (OSError, lmdb.Error) as exc:
                    error = error or translate(exc, context="closing the authority")
            self._unregister_writer()
            # The number taken first: from os.close on it may be any later open file's, and an
            # interrupt (KeyboardInterrupt) as os.close returns must not leave it for a second
            # close() to close again.
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)
        if error is not None:
            raise error

    def _close_view(self) -> None:
        """A read-only view's close: its reads finish, then its handles close (nothing to sync)."""
        while self._readers:
            time.sleep(0.001)
        log, index = self._pair
        self._pair = (log, None)
        if index is None:  # closed already
            return
        try:
            index.close()
        finally:
            log.close()

    def __enter__(self) -> Authority:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self) -> None:
        """Make everything accepted so far durable (needed only with ``sync=False``)."""
        self._check_writable("sync")
        self.log.sync()

    # -- accepting -------------------------------------------------------------------------------

    def accept(self, command: Command) -> Receipt:
        """Accept one Command atomically; return its receipt (the original one on a replay).

        Raises the typed rejection (nothing changed) or ``StorageFailed``.
        """
        self._check_writable("accept")
        data, content_hash = self._checked(command)
        # A replay is answered here, before a _Request is made for a commit it will not join.
        receipt = self._lookup_receipt(command, content_hash)
        if receipt is not None:
            return receipt
        return self._commit_one(_Request(command, data, content_hash))

    def _commit_one(self, request: _Request) -> Receipt:
        """The receipt of one prepared request that no receipt answered, committed on its own
        unit (or the request's rejection, raised)."""
        self._submit(_Unit([request]))
        if request.error is not None:
            raise request.error
        assert request.receipt is not None
        return request.receipt

    def accept_many(self, commands: Sequence[Command]) -> list[AcceptResult]:
        """Accept Commands in order with one durable commit; one result per Command.

        A rejected Command leaves no trace and does not disturb the others.
        """
        self._check_writable("accept_many")
        if isinstance(commands, (str, bytes)) or not isinstance(commands, Sequence):
            raise InvalidCommand("accept_many takes a sequence of Commands", field="commands")
        # One copy, taken first and bounded: the caller's list may grow while this call runs
        # (another thread appending to it), and a Sequence's len() need not be what iterating it
        # yields. Counted by len(), the results had no slot for a Command decided past it: an
        # IndexError after the commit had accepted it, and more Commands than the bound.
        try:
            commands = list(itertools.islice(commands, limits.ACCEPT_MANY_COMMANDS_MAX + 1))
        except Exception as exc:
            raise InvalidCommand(
                f"accept_many could not read its sequence of Commands: {type(exc).__name__}: {exc}"[:300], field="commands"
            ) from exc
        if len(commands) > limits.ACCEPT_MANY_COMMANDS_MAX:
            raise LimitExceeded(
                f"accept_many takes at most {limits.ACCEPT_MANY_COMMANDS_MAX} Commands", field="commands"
            )
        results: list[AcceptResult | None] = [None] * len(commands)
        requests: list[_Request] = []
        slots: list[int] = []
        for slot, command in enumerate(commands):
            try:
                data, content_hash = self._checked(command)  # as _prepare, without its frame
                requests.append(_Request(command, data, content_hash))
                slots.append(slot)
            except MwpError as exc:
                results[slot] = AcceptResult.failed(exc)
        if requests:
            self._submit(_Unit(requests))
        for slot, request in zip(slots, requests):
            if request.error is not None:
                results[slot] = AcceptResult.failed(request.error)
            else:
                results[slot] = AcceptResult(receipt=request.receipt)
        return [result for result in results if result is not None]

    def _prepare(self, command: Command, *, trusted: bool = False) -> _Request:
        data, content_hash = self._checked(command, trusted)
        return _Request(command, data, content_hash, trusted)

    def _checked(self, command: Command, trusted: bool = False) -> tuple[bytes, bytes]:
        """The Command checked (``check_command``; the engine's actor only when ``trusted``):
        its canonical content bytes and their content hash."""
        check_command(command)
        if command.actor == ENGINE_ACTOR and not trusted:
            raise InvalidCommand(f"actor {ENGINE_ACTOR!r} is reserved for the engine", field="actor")
        data = command_bytes(command)
        return data, canonical.content_hash(data)

    @_index_errors_typed
    def _lookup_receipt(self, command: Command, content_hash: bytes) -> Receipt | None:
        """Fast path for replays: the stored receipt, without joining a commit (the caller
        passed ``_check_writable`` and ``_checked``)."""
        index = self._pair[1]
        assert index is not None  # as the index property, without its frame
        txn = index.begin()
        try:
            value = index.get(txn, b"receipts", receipt_key(command.actor, command.action_id))
        finally:
            # A read transaction has nothing to commit: abort() ends it as `with`'s commit() would,
            # without the __exit__ call (about 1.6k of a replay's 53k instructions, callgrind).
            txn.abort()
        if value is None:
            return None
        stored_hash, receipt = _stored_receipt(value)
        if stored_hash != content_hash:
            raise _collision(command)
        return receipt

    def _check_writable(self, what: str) -> None:
        """The gate of every method that writes, called once where it is entered: ``StoreClosed``
        (closed, or a forked child), ``InvalidState`` on a read-only view, ``InvalidCommand`` from
        inside a callback of this thread's running commit (it would wait for itself), and
        ``StorageFailed`` once a storage failure refuses writes. ``what`` names the method.

        The common case (none of them) is one test; the checks that word the error run, in this
        order, only when it fails: every replay answered from its receipt passes here, and four
        calls cost it more than one test does."""
        if (
            self._closed
            or self._fork_generation != _fork.generation
            or self._readonly
            or self._committer == get_ident()
            or self._failure is not None
        ):
            self._check_closed()
            self._refuse_readonly(what)
            self._refuse_inside_commit(what)
            self._check_not_failed()

    def _check_open(self) -> None:
        """``_check_closed``, and ``StorageFailed`` once a storage failure refuses writes."""
        self._check_closed()
        self._check_not_failed()

    def _check_not_failed(self) -> None:
        if self._failure is not None:
            raise self._refusal()

    def _refusal(self) -> StorageFailed:
        """The refusal of a write once ``self._failure`` is set, carrying the failure's facts: a
        failed commit's (its ``cause``, an errno), or the code of damage found inside a commit as
        ``cause`` (``CORRUPTION``, ``reason`` ``index``), which a reopen with the structural check
        rebuilds and one without it meets again: a caller tells the two from the detail."""
        failure = self._failure
        assert failure is not None
        detail = dict(failure.detail) if isinstance(failure, StorageFailed) else {**failure.detail, "cause": failure.code}
        return StorageFailed(f"the authority refuses writes after a storage failure ({failure.message}); reopen it", **detail)

    def _check_closed(self) -> None:
        """``StoreClosed`` after close() or in a forked child; unlike ``_check_open``, a handle
        that refuses writes after a storage failure passes (reads and keys still work)."""
        if self._closed:
            raise StoreClosed("the authority is closed; open it again")
        if self._fork_generation != _fork.generation:
            raise StoreClosed(f"the authority: {_fork.FORKED_MESSAGE}")

    def _refuse_inside_commit(self, what: str) -> None:
        """``InvalidCommand`` (field ``what``) when this thread holds the commit role: called back
        from a running commit, rebuild or compaction (a ``progress`` or ``clock`` callable), the
        call would wait for the role its own thread holds, forever."""
        if self._committer == get_ident():
            raise InvalidCommand(
                f"{what}() was called from inside a callback (progress, clock) of a running commit, rebuild or "
                "compaction of this authority; call it after that returns",
                field=what,
            )

    def _submit(self, unit: _Unit) -> None:
        """Queue a unit; lead if no commit is running, else sleep until the unit is committed or
        leadership is handed to it; return once the unit is committed.

        A leader commits batches from the front of the queue until its own unit is done, then
        wakes the callers it answered and hands leadership to the first unit still queued (or
        gives it up when none is, or when ``_exclusive`` is waiting for it).

        A caller interrupted while it sleeps (KeyboardInterrupt in the main thread) withdraws its
        unit if no commit has taken it yet. Otherwise it still does its part before raising: if
        leadership was handed to it, it leads; if a commit took its unit, it waits for that
        commit and wakes the next answered caller. So neither the leader role nor a wake-up is
        ever lost with the interrupted thread.
        """
        # The caller passed _check_writable: closed, forked (before self._lock, which a parent
        # thread may have held at a fork), read-only, inside a commit, failed. A failure since is
        # answered by _commit, a close since under the lock below.
        for request in unit.requests:
            _decide_on_what_was_hashed(request)
        with self._lock:
            if self._closed:
                raise StoreClosed("the authority is closed; open it again")
            self._queue.append(unit)
            lead = not self._leader and not self._exclusive_waiting
            if lead:
                self._leader = True
        interrupted: BaseException | None = None
        if not lead:
            try:
                unit.gate.acquire()
            except BaseException as exc:
                with self._lock:  # a queued unit's gate is opened only under this lock
                    woken = unit.gate.acquire(blocking=False)
                    if not woken and unit in self._queue:
                        self._queue.remove(unit)  # nothing of it was written, nothing will be
                        raise
                if not woken:  # a running commit took it: its wake-up is on the way
                    _acquire_through_interrupts(unit.gate)
                interrupted = exc
            if unit.done:
                if unit.wake_next is not None:
                    unit.wake_next.gate.release()
                if interrupted is not None:
                    raise interrupted
                return
        self._lead(unit)
        if interrupted is not None:
            raise interrupted

    def _lead(self, unit: _Unit) -> None:
        """Commit batches until ``unit`` is done; then pass the role on and wake the answered callers.

        The answered callers are woken in a chain: the leader wakes the first, and each woken
        caller wakes the next before it returns. Woken all at once, they fought over the GIL: with
        16 threads that cost about a fifth of the CPU per Command (docs/design-decisions.md).
        """
        answered: list[_Unit] = []
        self._committer = get_ident()
        try:
            while not unit.done:
                with self._lock:
                    units = self._take_units()
                withdrawn = False
                try:
                    self._commit(units)
                except _Withdrawn as withdrawal:
                    # An interrupt (KeyboardInterrupt) before the batch reached the log: nothing of
                    # it was written, so its other units go back to the front of the queue to be
                    # decided again by the next leader, and this caller's own is withdrawn.
                    withdrawn = True
                    raise withdrawal.interrupt from None
                finally:
                    with self._lock:
                        if withdrawn:
                            self._queue.extendleft(reversed([taken for taken in units if taken is not unit]))
                            if unit in self._queue:
                                self._queue.remove(unit)
                            unit.done = True
                        else:
                            for taken in units:
                                taken.done = True
                            answered.extend(units)
        finally:
            self._committer = None
            others = [taken for taken in answered if taken is not unit]
            for taken, following in zip(others, others[1:]):
                taken.wake_next = following
            with self._lock:
                self._pass_leadership()
                if others:
                    others[0].gate.release()

    def _pass_leadership(self) -> None:
        """Hand the leader role to the first queued unit, or give it up (``self._lock`` held)."""
        following = self._queue[0] if self._queue and not self._exclusive_waiting else None
        if following is None:
            self._leader = False
            if self._exclusive_waiting or self._closed:
                # close() (_closed set before it waits) and _exclusive() (counted while it waits)
                # wait for this, no one else: the Condition's notify_all is three Python calls
                self._wake.notify_all()
        else:
            following.gate.release()  # its caller leads now (the role never lapses)

    def _take_units(self) -> list[_Unit]:
        units = [self._queue.popleft()]
        count = len(units[0].requests)
        while self._queue and count + len(self._queue[0].requests) <= limits.COMMIT_BATCH_COMMANDS_MAX:
            unit = self._queue.popleft()
            count += len(unit.requests)
            units.append(unit)
        return units

    def _commit(self, units: list[_Unit]) -> None:
        """The leader's work: decide, append with one log commit, index, publish."""
        requests = [request for unit in units for request in unit.requests]
        if self._failure is not None:
            error = self._refusal()
            for request in requests:
                request.error = error
            return
        if len(requests) == 1:
            # The pause is for bulk work: a commit of one Command leaves too few objects alive for
            # the collector to run inside it (none ran in 5,000 single accepts, paused or not),
            # and the pause itself cost 19k of an accept's 465k instructions.
            self._commit_batch(requests)
            return
        with _gc.paused():
            self._commit_batch(requests)

    def _commit_batch(self, requests: list[_Request]) -> None:
        index = self.index
        try:
            txn = index.begin(write=True)
        except lmdb.Error as exc:
            self._failure = translate(exc, context="beginning an index transaction")
            self._fail_all(requests, self._failure)
            return
        batch = _Batch(index=index, txn=txn, group_room=group_bytes_max(self._segment_bytes))
        # Every request whose answer depends on this batch reaching the disk: new Events, notes,
        # ACKs, duplicates answered from a receipt decided earlier in this same batch, and
        # rejections decided over its earlier Events (see _decide).
        pending: list[_Request] = []
        appending = False
        try:
            now_ms = self._now()
            for request in requests:
                if request.note is not None:
                    record = request.note[0] + request.note[2]
                    framed = framed_bytes(len(record))
                    if not batch.room_for(record, framed):
                        request.error = _commit_full(batch, "call it again")
                        continue
                    batch.notes.append(request.note)
                    batch.add_record(record, framed)
                    pending.append(request)
                    continue
                if request.ack is not None:
                    self._decide_ack(batch, request)
                    if request.error is None:
                        pending.append(request)
                    continue
                if self._decide(batch, request, now_ms):
                    pending.append(request)
            if batch.records:
                failpoints.hit("authority.before_log_append")
                appending = True
                positions = self.log.append(batch.records)
                failpoints.hit("authority.after_log_sync")
                self._write_batch(batch, positions)
                index.put(txn, b"meta", b"log_position", u64(self.log.end))
                if batch.events:  # the last acceptance time: of an Event, as redo and rebuild take it
                    index.put(txn, b"meta", b"last_ms", u64(now_ms))
            txn.commit()
            if batch.events:  # a batch of refusals, ACKs or notes accepted nothing: no stamp to keep
                self._last_ms = now_ms
            # Kept after the commit, inside this try: whatever cuts it short fails the handle
            # (below), so no sweep trusts a watch that missed a commit.
            if self._lease_watches and batch.events:
                self._note_leases(batch.events)
        except BaseException as exc:
            _abort_quietly(txn)
            if not appending and not isinstance(exc, Exception):
                # interrupted before anything reached the log: no request keeps an answer
                # decided against this batch; _lead puts them back to be decided again
                for request in requests:
                    request.receipt = None
                    request.error = None
                raise _Withdrawn(exc) from None
            damage = None if appending else lmdb_cause(exc)
            if isinstance(exc, MwpError) and not isinstance(exc, (StorageFailed, Corruption)):
                error: MwpError = exc  # refused before anything reached the disk (e.g. a limit)
            elif isinstance(exc, MwpError):
                error = self._failure = exc
            elif isinstance(damage, LMDB_DAMAGE_ERRORS):
                # An index read of the batch (a receipt, a head, an ACK, the Event a head must not
                # be behind) met what only a damaged file gives, before anything reached the log:
                # the index's damage and its remedy, not a failure that a reopen or a retry mends.
                # Writes are refused, as after any damage found inside a commit.
                error = self._failure = damage_of(*_INDEX_DAMAGE, damage)
            else:
                # The log may already hold the batch: refuse writes; reopening redoes the index.
                # The cause is the LMDB error's, not that of the binding's SystemError around it.
                cause = translate(lmdb_cause(exc) or exc, context="committing a batch") if isinstance(exc, Exception) else None
                # the cause's facts go along: an errno, or field map_size for an index map found full
                error = self._failure = StorageFailed(
                    f"the commit failed ({cause.message if cause else type(exc).__name__}); reopen the authority",
                    **({"cause": cause.code, **cause.detail} if cause else {}),
                )
            self._fail_all(pending, error)
            # and every request the failure left unanswered (the one that raised, those after it)
            self._fail_all([request for request in requests if request.receipt is None and request.error is None], error)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like: every caller was answered, now propagate
            return
        failpoints.hit("authority.after_index_commit")
        deleted = [event.group for event in batch.events if event.kind == "audit.delete" and event.authoritative]
        if deleted and not self._sync:
            # Bulk mode defers the log's fdatasync, but a removal is durable at once: the Event
            # that orders it is made durable first. If that fails the file stays, and the next
            # open removes it if the Event survived (_finish_audit_deletions).
            try:
                self.log.sync()
            except MwpError as exc:
                self._failure = exc
                raise
        for group in deleted:
            try:
                self._remove_audit_log(group)
            except Exception as exc:
                # The Event is durable, the file is not gone: the handle refuses writes, and the
                # reopen it asks for removes the file (_finish_audit_deletions). The deletion's
                # callers are told; every other answer of the batch stands.
                cause = translate(exc, context=f"removing the audit log of {group}")
                error = self._failure = StorageFailed(
                    f"the audit.delete of {group} is durable, but its audit log could not be removed "
                    f"({cause.message}); reopen the authority, which removes it",
                    group=group,
                    **{"cause": cause.code, **cause.detail},
                )
                self._fail_all(
                    [r for r in requests if r.receipt is not None and r.receipt.kind == "audit.delete" and r.receipt.group == group],
                    error,
                )
        # Only a wait_for in progress needs waking: counted before its first look at the head,
        # so one that this reads as absent looks after the index commit above and sees it. The
        # Condition's notify_all is five Python calls with its lock (about 3k instructions).
        if (batch.events or batch.acks) and self._published_waiting:
            with self._published:
                self._published.notify_all()

    def _now(self) -> int:
        """The clock's reading, checked (an int of milliseconds: ``InvalidCommand``, field
        ``clock``, before anything is written otherwise), never before the last acceptance time."""
        return max(canonical.clock_reading(self._clock), self._last_ms)

    def _fail_all(self, requests: Iterable[_Request], error: MwpError) -> None:
        for request in requests:
            request.receipt = None
            request.error = error

    def _decide(self, batch: _Batch, request: _Request, now_ms: int) -> bool:
        """Decide one Command into the batch. True: its answer depends on this batch's commit (a
        new Event, a receipt decided earlier in the batch, a rejection that rests on the batch)."""
        command = request.command
        assert command is not None
        key = receipt_key(command.actor, command.action_id)
        stored = batch.receipts.get(key)
        receipt: Receipt | None
        if stored is not None:
            content_hash, receipt, _ = stored
        else:
            value = batch.index.get(batch.txn, b"receipts", key)
            content_hash, receipt = (b"", None) if value is None else _stored_receipt(value)
        if receipt is not None:
            if content_hash != request.content_hash:
                request.error = _collision(command)
            else:
                request.receipt = receipt
            return stored is not None  # a receipt from this batch is only as durable as the batch
        seq, head_hash = batch.head(command.group)
        # A rejection decided over earlier Events of this batch in the Group (the aggregate it
        # found, the revision it compared, the Event it would redact) is only as durable as the
        # batch: when the commit fails, the Command is refused with it.
        rests_on_batch = command.group in batch.heads
        view = _GroupView(batch, command.group)
        try:
            event = run_transition(
                view,
                command,
                seq=seq + 1,
                now_ms=now_ms,
                prev_hash=head_hash,
                content_hash=request.content_hash,
                data=request.data,
                trusted=request.trusted,
            )
        except MwpError as exc:
            request.error = exc
            return rests_on_batch
        except Exception as exc:  # a bug in a kind's decide/evolve must not take the batch down
            cause = lmdb_cause(exc)
            if isinstance(cause, LMDB_DAMAGE_ERRORS):
                # The rules read states through the index: its damage, not a bug. LMDB refuses
                # the rest of a transaction that met it (MDB_BAD_TXN), so the whole batch fails
                # here, before the log append: decided on, the Commands before this one would
                # reach the log and then fail at the index's commit.
                raise damage_of(*_INDEX_DAMAGE, cause) from None
            if cause is not None:  # another LMDB error under the rules: answered as the index's
                request.error = damage_of(*_INDEX_DAMAGE, cause)
            else:
                request.error = MwpError(f"internal error deciding {command.kind}: {type(exc).__name__}: {exc}")
            return rests_on_batch
        # What event.redact's pure decide cannot see, asked only once decide has accepted it (the
        # actor may redact, the Group is live, the target is an existing sequence).
        if command.kind == "event.redact" and not self._redactable(batch, command):
            request.error = InvalidCommand("a tombstone (event.redact or audit.delete) is never itself redacted", field="target")
            return rests_on_batch
        record = EVENT_TAG + encode_event(event)
        if len(record) > limits.RECORD_BYTES_MAX:
            request.error = LimitExceeded(
                f"the Event would be {len(record)} bytes, more than {limits.RECORD_BYTES_MAX}", field="body"
            )
            return False
        framed = framed_bytes(len(record))
        if COMMIT_FRAME_BYTES + framed > batch.group_room:
            # No log group of this store's segments holds it, in any commit.
            request.error = LimitExceeded(
                f"the Event would take {framed} bytes of a log segment, more than a segment of "
                f"{self._segment_bytes} bytes holds; open the store with a larger segment_bytes",
                field="body",
            )
            return False
        if not batch.room_for(record, framed):
            # One commit is one log group, at most GROUP_BYTES_MAX bytes and what fits an empty
            # segment: this Command alone is refused (nothing of it is written) instead of the
            # whole batch failing at the append.
            request.error = _commit_full(batch)
            return False
        receipt = receipt_for(event)
        prefix = command.group.encode() + b"\x00"
        for effect in event.effects:
            full_key = prefix + effect.aggregate.encode()
            batch.states[full_key] = (effect.revision, effect.state)
            batch.dirty_states[full_key] = encode_state(effect.revision, effect.state)
            if effect.revision == 1:
                batch.created_states.add(full_key)
        batch.heads[command.group] = (event.seq, event.hash)
        batch.receipts[key] = (request.content_hash, receipt, encode_receipt(receipt))
        batch.add_record(record, framed)
        batch.events.append(event)
        request.receipt = receipt
        return True

    def _redactable(self, batch: _Batch, command: Command) -> bool:
        """What ``event.redact``'s pure decide cannot see: whether the named Event is a tombstone."""
        from .redaction import TOMBSTONE_KINDS

        if not command.target.isdigit():
            return True  # decide rejects the target with its own message
        for event in batch.events:  # decided earlier in this batch
            if event.group == command.group and event.seq == int(command.target):
                return event.kind not in TOMBSTONE_KINDS
        target = int(command.target)
        position = batch.index.get_u64(batch.txn, b"events", event_key(command.group, target))
        if position is None:
            if target <= batch.head(command.group)[0]:
                raise Corruption(f"the index lost Event {command.group}:{target}; run `mwpstore rebuild`", reason="index_missing")
            return True  # no such Event: decide rejects it
        return decode_logged_event(position, self.log.read(position)).kind not in TOMBSTONE_KINDS

    def _decide_ack(self, batch: _Batch, request: _Request) -> None:
        assert request.ack is not None
        consumer, group, cursor = request.ack
        head_seq, _ = batch.head(group)
        if cursor > head_seq:
            request.error = SequenceGap(
                f"cannot ACK {cursor}: the head of group {group!r} is {head_seq}", cursor=cursor, head=head_seq
            )
            return
        key = ack_key(consumer, group)
        previous = batch.acks.get(key)
        if previous is None:
            previous = batch.index.get_u64(batch.txn, b"acks", key) or 0
        if cursor <= previous:
            # Nothing to write: ACKs never move backwards. The request stays an ACK: a batch
            # withdrawn before its log append is decided again by the next leader.
            request.ack_result = previous
            return
        record = ACK_TAG + _ACK_ENCODER.encode((consumer, group, cursor))
        framed = framed_bytes(len(record))
        if not batch.room_for(record, framed):
            request.error = _commit_full(batch, "ack again")
            return
        batch.acks[key] = cursor
        batch.add_record(record, framed)
        request.ack_result = cursor

    def _write_batch(self, batch: _Batch, positions: list[int]) -> None:
        index, txn = batch.index, batch.txn
        event_positions = [position for position, record in zip(positions, batch.records) if record[:1] == EVENT_TAG]
        index.put_many(
            txn, b"events", [(event_key(event.group, event.seq), u64(position)) for event, position in zip(batch.events, event_positions)]
        )
        # Presence is recorded once per key: an aggregate's revision 1 (also when a later Event of
        # the batch took it further), a Group's first Event.
        created = batch.created_states
        index.put_many(txn, b"states", list(batch.dirty_states.items()), [key for key in batch.dirty_states if key in created])
        index.put_many(
            txn,
            b"heads",
            [(group.encode(), encode_head(seq, digest)) for group, (seq, digest) in batch.heads.items()],
            [event.group.encode() for event in batch.events if event.seq == 1],
        )
        index.put_many(txn, b"receipts", [(key, content_hash + encoded) for key, (content_hash, _, encoded) in batch.receipts.items()])
        if batch.acks:
            index.put_many(txn, b"acks", [(key, u64(cursor)) for key, cursor in batch.acks.items()])
        for tag, key, value in batch.notes:
            index.put(txn, _note_database(tag), key, value)

    # -- the engine's own Commands ----------------------------------------------------------------

    def accept_trusted(self, command: Command) -> Receipt:
        """Accept a Command the engine issues itself (``system_only`` kinds such as ``lease.expire``)."""
        self._check_writable("accept_trusted")
        data, content_hash = self._checked(command, trusted=True)
        receipt = self._lookup_receipt(command, content_hash)
        if receipt is not None:
            return receipt
        return self._commit_one(_Request(command, data, content_hash, True))

    @_index_errors_typed
    def expire_leases(self, group: str, *, now_ms: int | None = None) -> list[Receipt]:
        """The lease sweep: a ``lease.expire`` Event for every lapsed lease in ``group``.

        ``now_ms`` (default: the engine's clock) only chooses which leases to try; each
        ``lease.expire`` is decided at the engine clock's time, so a lease still live by that clock
        is passed over (with ``now_ms`` in the future, nothing may be expired).

        The Commands go in together, as ``accept_many`` takes them (one durable commit for up
        to ``limits.ACCEPT_MANY_COMMANDS_MAX``), each decided on its own: one refused (renewed,
        released or taken over meanwhile) leaves no trace and does not disturb the others. One
        that met a full commit goes into the next.

        The Group's first sweep on this handle reads every WorkItem; later ones read only those
        whose state holds a lease (``_leased_states``)."""
        from . import work_model

        self._check_writable("expire_leases")
        canonical.check_id(group, "group")
        now = self._now() if now_ms is None else canonical.check_time_ms(now_ms, "now_ms")
        states = self._leased_states(group)
        requests = []
        for workitem in work_model.lapsed_workitems(states.items(), now):
            lease_id = states[workitem]["lease"]["lease_id"]
            command = Command(
                actor=ENGINE_ACTOR,
                action_id=f"expire.{lease_id}",
                group=group,
                kind="lease.expire",
                target=workitem,
                body={"lease_id": lease_id},
            )
            requests.append(self._prepare(command, trusted=True))
        receipts: list[Receipt | None] = [None] * len(requests)
        pending = list(enumerate(requests))
        while pending:
            chunk, pending = pending[: limits.ACCEPT_MANY_COMMANDS_MAX], pending[limits.ACCEPT_MANY_COMMANDS_MAX :]
            self._submit(_Unit([request for _, request in chunk]))
            full = []
            for slot, request in chunk:
                error, request.error = request.error, None
                if error is None:
                    receipts[slot] = request.receipt
                elif isinstance(error, LimitExceeded) and error.detail.get("field") == "commands":
                    full.append((slot, request))  # met a commit already full: into a later one
                elif not isinstance(error, Rejection):
                    raise error
                # any other rejection: renewed, released or taken over since the read
            pending = full + pending
        return [receipt for receipt in receipts if receipt is not None]

    def _leased_states(self, group: str) -> dict[str, dict[str, Any]]:
        """The states of ``group``'s WorkItems that may hold a lease, by WorkItem id in id order:
        those of its watch once one is made, else (the Group's first sweep on this handle, or a
        sweep beside that one) every WorkItem's, from a scan that makes the watch."""
        fresh = _LeaseWatch()  # made here: once it is in the watches, the try below owns it
        watches: dict[str, _LeaseWatch] = {}
        try:
            with self._lease_lock:
                watches = self._lease_watches
                watch = watches.get(group)
                held = None if watch is None or watch.held is None else sorted(watch.held)
                if watch is None:
                    watch = watches[group] = fresh
            if held is not None:
                index = self.index
                states = {}
                with index.begin() as txn:
                    for workitem in held:
                        value = index.get(txn, b"states", state_key(group, f"workitem:{workitem}"))
                        state = None if value is None else decode_state(value)[1]
                        if state is not None:
                            states[workitem] = state
                return states
            # The watch is registered before this read begins: every commit this read misses
            # records its change in the watch.
            items = self.aggregates(group, prefix="workitem:")
            states = {key.partition(":")[2]: state for key, _, state in items if state is not None}
            if watch is fresh:
                with self._lease_lock:
                    found = {workitem for workitem, state in states.items() if state.get("lease") is not None}
                    for workitem, leased in watch.changes.items():
                        if leased:
                            found.add(workitem)
                        else:
                            found.discard(workitem)
                    watch.held, watch.changes = found, {}
                    if not states and not found and watches.get(group) is watch:
                        # No WorkItem to watch (a Group without any yet, or none at all): kept, one
                        # watch per name ever swept would pile up for the handle's life.
                        del watches[group]
            return states
        except BaseException:
            # A scan that made the watch and did not finish it (a failed read, an interrupt
            # anywhere in it): dropped, or every later sweep would read every WorkItem, and every
            # commit add to its changes, for the life of the handle. The next sweep makes it again.
            if fresh.held is None:
                with self._lease_lock:
                    if watches.get(group) is fresh:
                        del watches[group]
            raise

    def _note_leases(self, events: list[Event]) -> None:
        """Keep the lease watches (``_leased_states``) up to date with a committed batch."""
        with self._lease_lock:
            for event in events:
                watch = self._lease_watches.get(event.group)
                if watch is None:
                    continue
                if event.kind == "group.archive":  # no WorkItem of it changes again: nothing to watch
                    del self._lease_watches[event.group]
                    continue
                for effect in event.effects:
                    if effect.aggregate.startswith("workitem:"):
                        workitem = effect.aggregate[len("workitem:") :]
                        leased = effect.state is not None and effect.state.get("lease") is not None
                        if watch.held is None:
                            watch.changes[workitem] = leased
                        elif leased:
                            watch.held.add(workitem)
                        else:
                            watch.held.discard(workitem)

    # -- reading ---------------------------------------------------------------------------------

    @_index_errors_typed
    def head(self, group: str) -> tuple[int, bytes]:
        """(sequence, chain hash) of the Group's last Event; (0, zero hash) for an unknown Group."""
        canonical.check_id(group, "group")
        index = self.index
        with index.begin() as txn:
            return index.head(txn, group)

    @_index_errors_typed
    def groups(self) -> list[str]:
        """The IDs of every Group this store holds, sorted (byte order: IDs are ASCII)."""
        index = self.index
        with index.begin() as txn:
            return [key.decode() for key, _ in index.range(txn, b"heads", b"")]

    @_index_errors_typed
    def state(self, group: str, aggregate: str) -> tuple[int, dict[str, Any] | None]:
        """(revision, state) of one aggregate (``"workitem:wi-3"``); (0, None) if it never existed."""
        canonical.check_id(group, "group")
        canonical.check_aggregate_key(aggregate, "aggregate")
        index = self.index
        with index.begin() as txn:
            value = index.get(txn, b"states", state_key(group, aggregate))
            return (0, None) if value is None else decode_state(value)

    @_index_errors_typed
    def aggregates(self, group: str, *, prefix: str = "") -> list[tuple[str, int, dict[str, Any] | None]]:
        """Every aggregate of a Group (optionally of one type prefix) as (key, revision, state)."""
        canonical.check_id(group, "group")
        canonical.check_aggregate_key(prefix, "prefix", empty=True)
        start = state_key(group, prefix)
        out = []
        index = self.index
        with index.begin() as txn:
            for key, value in index.range(txn, b"states", start):
                revision, state = decode_state(value)
                out.append((key[len(group) + 1 :].decode(), revision, state))
        return out

    @_index_errors_typed
    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[Event]:
        """Events of ``group`` with sequence > ``after``, in order, at most ``limit``.

        Raises ``CursorTooOld`` (carrying a snapshot reference) when ``after`` is below the
        Group's replay floor.
        """
        canonical.check_id(group, "group")
        _check_after(after)
        if type(limit) is not int or not 1 <= limit <= limits.READ_LIMIT_MAX:
            raise InvalidCommand(f"limit must be 1..{limits.READ_LIMIT_MAX}", field="limit")
        # One pair for the floor and the Events: a compaction that switches the log and the index
        # meanwhile drops an archived Group's Events from the new pair, whose floor says so; the
        # pair taken here stays open until this read ends (_install_index).
        pair = self._pair
        assert pair[1] is not None
        floor, reference = self._replay_floor(group, pair[1])
        if after < floor:
            assert reference is not None
            raise CursorTooOld(
                f"cursor {after} of group {group!r} is below the replay floor {floor}; "
                "restore from the snapshot reference, then read after its sequence",
                group=group,
                cursor=after,
                floor=floor,
                snapshot_ref=reference.to_dict(),
            )
        return self._read_events(group, after, limit, pair)

    def _read_events(self, group: str, after: int, limit: int, pair: tuple[SegmentLog, Index | None] | None = None) -> list[Event]:
        """Decoded Events with tombstones applied: a redacted Event keeps everything but its body.
        Read from ``pair`` (default: the current one), records and tombstones alike."""
        pair = pair or self._pair
        with _gc.paused():
            try:
                events = decode_events(self._read_bodies(group, after, limit, pair))
            except EventInvalid as exc:  # bytes the log's checksum let through: damage, not a delivery
                raise Corruption(f"a record of group {group} after seq {after} is not an Event: {exc.message}", reason="decode") from None
        for offset, event in enumerate(events):  # the index pointed at these records: check it was right
            if event.group != group or event.seq != after + 1 + offset:
                raise Corruption(
                    f"the index points {group}:{after + 1 + offset} at the record of {event.event_id}; "
                    "run `mwpstore rebuild`",
                    reason="index",
                )
        if events:
            events = self._apply_tombstones(group, events, pair)
        return events

    @_index_errors_typed
    def _apply_tombstones(self, group: str, events: list[Event], pair: tuple[SegmentLog, Index | None]) -> list[Event]:
        index = pair[1]
        assert index is not None
        out = []
        with index.begin() as txn:
            value = index.get(txn, b"states", state_key(group, f"group:{group}"))
            group_state = None if value is None else decode_state(value)[1]
            if group_state is None or not group_state.get("tombstones"):
                return events
            for event in events:
                if event.body is not None and index.get(txn, b"states", state_key(group, f"tombstone:{event.seq}")) is not None:
                    event = msgspec.structs.replace(event, body=None)
                out.append(event)
        return out

    @_index_errors_typed
    def _read_bodies(self, group: str, after: int, limit: int, pair: tuple[SegmentLog, Index | None] | None = None) -> list[bytes]:
        """The Event records of ``group`` after ``after`` (at most ``limit``) without their tag
        byte, which is checked: what ``decode_events`` takes. From ``pair`` (default: the current one)."""
        log, index = pair or self._pair
        assert index is not None
        positions: list[int] = []
        prefix = group.encode() + b"\x00"
        with index.begin() as txn:
            head = index.head(txn, group)[0]
            wanted = min(head - after, limit)
            if wanted >= _SCAN_READ_MIN:
                # The common case, a Group's Events written one after another: the log between the
                # first and the last wanted Event holds exactly them. Two lookups instead of one
                # per Event; the caller checks each record's Group and sequence when it decodes.
                first = index.get(txn, b"events", event_key(group, after + 1))
                last = index.get(txn, b"events", event_key(group, after + wanted))
                if first is not None and last is not None:
                    bodies = _event_bodies_between(log, read_u64(first), read_u64(last), wanted)
                    if bodies is not None and len(bodies) == wanted:
                        return bodies
            for _, value in index.range(txn, b"events", prefix, event_key(group, after + 1)):
                positions.append(read_u64(value))
                if len(positions) >= limit:
                    break
            if len(positions) < limit:  # the range ended: it must have reached the Group's head
                if after + len(positions) < head:
                    raise Corruption(
                        f"the index lost Events of group {group} after {after + len(positions)} (head {head}); run `mwpstore rebuild`",
                        reason="index_missing",
                    )
        bodies = []
        for offset, record in enumerate(_records_at(log, positions)):
            if record[:1] != EVENT_TAG:
                raise Corruption(
                    f"the index points {group}:{after + 1 + offset} at a log record that is not an Event; "
                    "run `mwpstore rebuild`",
                    reason="index",
                )
            bodies.append(record[1:])
        return bodies

    # -- snapshots and retention -----------------------------------------------------------------

    @property
    def signing_key(self) -> SigningKey:
        """The store's Ed25519 snapshot key, generated on first use under ``<path>/keys``."""
        self._check_closed()  # a closed handle no longer holds the store: it creates no key file there
        self._refuse_readonly("signing_key")  # it creates the key on first use
        while True:
            with self._key_lock:
                if self._signing_key is not None:
                    return self._signing_key
                changes = self._key_changes
            with self._store_directory("keys", private=True) as keys:
                key = SigningKey.load_or_create(keys)
            with self._key_lock:
                # A rotation that began or ended while the file was read may have replaced the key
                # read (the old one, dropped as compromised with retire=False): read it again.
                # Only a handle still without a key takes it, never over the rotation's new key.
                if self._key_changes == changes:
                    if self._signing_key is None:
                        self._signing_key = key
                    return self._signing_key

    def _store_directory(self, relative: str, *, private: bool = False) -> Directory:
        """``<path>/<relative>``, created if missing, opened from the store's directory one name at
        a time with ``O_NOFOLLOW`` (the store's own path may be reached through links): a symbolic
        link on the way is ``StorageFailed`` (``ELOOP``), or for ``keys/`` and below, private,
        ``KeyFileInvalid``; the files of the call are written through the descriptor returned
        (the caller closes it), so a link put there after this check is never followed. Every
        directory from the store down is synced in its parent: a directory a killed process left
        in place may not be durable yet, and a record logged next must not name a file whose
        directory a power loss can take. Synced once per handle (a directory this process made
        durable stays so)."""
        sync = relative not in self._durable_directories
        directory = open_below(self.path, relative, mode=0o700 if private else 0o755, private=private, sync=sync)
        if sync:
            if len(self._durable_directories) >= _DURABLE_DIRECTORIES_MAX:
                # One per Group ever snapshotted or archived: forgotten (each checked and synced
                # once more at its next use), or it would grow for the handle's whole life.
                self._durable_directories.clear()
            self._durable_directories.add(relative)
        return directory

    def keyring(self) -> Keyring:
        """A keyring trusting this store's snapshot key and the keys it retired
        (``rotate_signing_key``); add others as needed."""
        self._check_closed()
        self._refuse_readonly("keyring")  # through signing_key, it creates the key on first use
        signing_key = self.signing_key
        with self._store_directory("keys", private=True) as keys:
            return Keyring([signing_key.public_key, *retired_public_keys(keys)])

    @_index_errors_typed  # registered like a read: close() waits for the key files to be changed
    def rotate_signing_key(self, *, retire: bool = True) -> SigningKey:
        """Sign snapshots with a new key from now on; return it.

        With ``retire`` (the default) the old public key stays trusted by :meth:`keyring` (and so
        by ``verify``), under ``keys/retired/``: what it signed keeps verifying, nothing is signed
        with it again. ``retire=False`` is for a compromised key: it is dropped, and snapshots it
        signed no longer verify here (take new ones). Give verifiers the new public key
        (``keys/snapshot-signing.pub``) before the next snapshot reaches them.
        """
        if type(retire) is not bool:  # a falsy non-bool (None, 0) would have dropped the old key
            raise InvalidCommand("retire must be True or False", field="retire")
        self._check_writable("rotate_signing_key")
        with self._snapshot_lock.held("rotate_signing_key"):  # no snapshot is signed while the key changes
            with self._key_lock:
                self._signing_key = None  # whatever happens below, the next use reads the key file
                self._key_changes += 1  # a key file read from now on may be the old key
            key: SigningKey | None = None
            try:
                with self._store_directory("keys", private=True) as keys:
                    key = SigningKey.rotate(keys, retire=retire)
                return key
            finally:
                with self._key_lock:
                    self._key_changes += 1  # and one read before this may be too
                    self._signing_key = key  # None after a failure: the next use reads the key file

    @_index_errors_typed  # as rotate_signing_key: close() waits for it
    def drop_retired_key(self, key_id: str) -> None:
        """Stop trusting a retired snapshot key (``rotate_signing_key``) that was compromised after
        it was retired: :meth:`keyring` and ``verify`` no longer accept what it signed. Take new
        snapshots of the Groups whose latest snapshot it signed (:meth:`snapshot` signs one at the
        same sequence with the current key), so agents behind their replay floor can restore; a
        Group archived and compacted keeps its final snapshot, which is never re-signed.
        ``NotFound`` when no such key is retired."""
        self._check_writable("drop_retired_key")
        with self._snapshot_lock.held("drop_retired_key"):
            with self._store_directory("keys", private=True) as keys:
                drop_retired_key(keys, key_id)

    @_index_errors_typed
    def snapshot(self, group: str) -> SnapshotRef:
        """Write a signed snapshot of ``group`` at its current head; return its reference.

        The snapshot file is durable before its reference is logged, and the reference is what
        moves the Group's replay floor (see :meth:`replay_floor`). A Group archived and compacted
        is ``InvalidState`` (state ``compacted``) unless its head already has a reference signed
        with the current key (its final snapshot's): its index no longer holds its state.
        """
        canonical.check_id(group, "group")
        self._check_writable("snapshot")  # before its file is written
        with self._snapshot_lock.held("snapshot"):  # one snapshot at a time: a sequence's file is written once
            return self._snapshot(group)

    def _snapshot(self, group: str) -> SnapshotRef:
        index = self.index
        with index.begin() as txn:  # one read transaction: head and states agree
            seq, head_hash = index.head(txn, group)
            if seq == 0:
                raise NotFound(f"group {group!r} does not exist", field="group")
            existing = index.get(txn, b"snapshots", event_key(group, seq))
            if existing is not None:
                ref = _decode_note(existing, SnapshotRef)
                if ref.key_id == self.signing_key.key_id:  # already signed with the current key: reuse it
                    return ref
            value = index.get(txn, b"states", state_key(group, f"group:{group}"))
            if value is not None and (decode_state(value)[1] or {}).get("compacted"):
                # Its index keeps only the Group aggregate and the Memberships: signed, they would
                # claim a state at the head that the Group never had (its Missions, WorkItems,
                # tombstones gone). Its state is in its final snapshot and audit log.
                raise InvalidState(
                    f"group {group!r} is archived and compacted: its state is in its final snapshot and audit log, "
                    "and no new snapshot of it can be taken",
                    state="compacted",
                )
            prefix = group.encode() + b"\x00"
            aggregates = []
            for key, value in index.range(txn, b"states", prefix):
                revision, state = decode_state(value)
                aggregates.append((key[len(prefix):].decode(), revision, state))
        group_state = next(state for key, _, state in aggregates if key == f"group:{group}")
        assert group_state is not None
        data = create_snapshot(
            org=group_state["org"],
            group=group,
            seq=seq,
            head_hash=head_hash,
            aggregates=aggregates,
            signer=self.signing_key,
            created_at_ms=self._now(),
        )
        # A sequence signed before with another key (rotated, or dropped as compromised) gets a
        # second file named after the new key; the reference to it replaces the old one.
        location = _snapshot_location(group, seq, None if existing is None else self.signing_key.key_id)
        before = None if existing is None else _decode_note(existing, SnapshotRef).location
        try:
            # the reference logged next must not outlive the directory: synced in its parent
            with self._store_directory(os.path.dirname(location)) as directory:
                write_file_at(directory, os.path.basename(location), data, mode=0o600)
            ref = snapshot_ref(data, location=location)
            self._log_note(SNAPSHOT_TAG, event_key(group, seq), _NOTE_ENCODER.encode(ref))
        except Exception:
            # The note's commit has ended, or never began (a close() under way, a full commit):
            # unless it logged the note, no record names this file, nor ever will.
            self._discard_unrecorded_snapshot(group, seq, location, before)
            raise
        except BaseException:
            # An interrupt (KeyboardInterrupt) can leave the note queued for a later commit:
            # close() decides, once no commit can run.
            self._unsettled_snapshots.append((group, seq, location, before))
            raise
        return ref

    def _discard_unrecorded_snapshot(self, group: str, seq: int, location: str, before: str | None) -> None:
        """Remove the file a failed :meth:`snapshot` wrote at ``location`` if the index still names
        what it named at ``(group, seq)`` before (``before``, None for nothing), once the commit of
        its note has ended: the note was not logged. A logged note would have replaced ``before``
        for good (the first reference names the file without a suffix, each later one a file named
        after a newer key). The index naming a third file says that a later snapshot re-signed
        the sequence (close() decides after an interrupt, and snapshots may run meanwhile): the
        note may have been logged and replaced since, and the file is kept, as the open's sweep
        keeps every file at a sequence that has a reference. Kept too when a storage failure may
        have logged the note without indexing it (the next open sweeps, the store not being closed
        cleanly), and when the index cannot be read."""
        with contextlib.suppress(Exception):
            if self._failure is not None:
                return
            index = self.index
            with index.begin() as txn:
                value = index.get(txn, b"snapshots", event_key(group, seq))
                named = None if value is None else _decode_note(value, SnapshotRef).location
            if named == before:
                with open_below(self.path, os.path.dirname(location), create=False) as directory:
                    _discard_unrecorded(directory, os.path.basename(location))

    def _log_note(self, tag: bytes, key: bytes, value: bytes) -> None:
        request = _Request(None, note=(tag, key, value))
        self._submit(_Unit([request]))
        if request.error is not None:
            raise request.error

    @_index_errors_typed
    def snapshots(self, group: str) -> list[SnapshotRef]:
        """References of every snapshot taken of ``group``, oldest first."""
        canonical.check_id(group, "group")
        prefix = group.encode() + b"\x00"
        out = []
        index = self.index
        with index.begin() as txn:
            for _, value in index.range(txn, b"snapshots", prefix):
                out.append(_decode_note(value, SnapshotRef))
        return out

    def read_snapshot(self, ref: SnapshotRef | dict[str, Any]) -> bytes:
        """The bytes a reference names (as a ``SnapshotRef`` or the dict ``CursorTooOld`` carries);
        not yet verified: verify with ``snapshot.verify_snapshot``."""
        self._check_closed()
        if not isinstance(ref, SnapshotRef):
            ref = SnapshotRef.from_dict(ref)
        canonical.check_id(ref.group, "group")
        if type(ref.seq) is not int or not 1 <= ref.seq <= limits.INT_ABS_MAX:
            raise InvalidCommand("snapshot reference names an impossible sequence", field="seq")
        # only the two names this store gives its files (the key id is checked before it is used)
        expected = {_snapshot_location(ref.group, ref.seq, None)}
        if _KEY_ID.fullmatch(ref.key_id):
            expected.add(_snapshot_location(ref.group, ref.seq, ref.key_id))
        if ref.location not in expected:
            raise InvalidCommand("snapshot reference names an unexpected location", field="location")
        # never through a symbolic link below the store: the bytes re-served are the store's own
        try:
            directory = open_below(self.path, os.path.dirname(ref.location), create=False)
        except FileNotFoundError as exc:
            raise translate(exc, context=f"reading {os.path.join(self.path, ref.location)}") from None
        with directory:
            return read_snapshot_file(os.path.basename(ref.location), directory=directory)

    @_index_errors_typed
    def archive(
        self,
        group: str,
        *,
        actor: str,
        action_id: str,
        reason: str = "",
        key_provider: Any = None,
    ) -> ArchiveRecord:
        """Archive ``group`` (MWP-MSN-009): accept ``group.archive``, then write the signed final
        snapshot and the encrypted audit log of its complete history, and log the record of both.

        Safe to call again after a crash part-way (the Command is idempotent and the files are
        rewritten); returns the existing record once archival has completed. Calls from several
        threads run one at a time, so a second call for the same Group returns the first's record.
        ``key_provider`` supplies the Organization's audit-log key (default: a
        ``FileKeyProvider`` under ``<path>/keys/orgs``).
        """
        self._check_writable("archive")
        self._snapshot_lock.refuse_holder("archive")  # its snapshot would be refused after group.archive
        with self._archive_lock.held("archive"):
            # Two archive() calls for one Group would both write its audit log (with different
            # nonces) and both log a record: the record logged last need not name the file left.
            return self._archive(group, actor=actor, action_id=action_id, reason=reason, key_provider=key_provider)

    def _org_keys(self, key_provider: Any) -> Any:
        """The Organizations' audit-log keys: ``key_provider``, or the store's own files under
        ``keys/orgs`` when it is None (only None: any other object is the caller's provider)."""
        return key_provider if key_provider is not None else FileKeyProvider._in_store(self.path, "keys/orgs")

    def _archive(self, group: str, *, actor: str, action_id: str, reason: str, key_provider: Any) -> ArchiveRecord:
        existing = self.archive_record(group)
        if existing is not None:
            return existing
        _, group_state = self.state(group, f"group:{group}")
        if group_state is not None and group_state.get("audit_log") == "deleted":
            # an accepted audit.delete (e.g. a legal order) before archival finished: the history
            # it ordered deleted is not written out again
            raise InvalidState(f"the audit log of group {group!r} was deleted (audit.delete); it is not written again", state="deleted")
        provider = self._org_keys(key_provider)
        if group_state is not None:  # a provider that cannot give the Organization's key fails here, before group.archive
            if key_provider is None:  # the store's own key files: their directories durable before a key is made or used
                self._store_directory(f"keys/orgs/{group_state['org']}", private=True).close()
            current_org_key(provider, group_state["org"])
        if group_state is None or group_state.get("status") != "archived":
            self.accept(Command(actor=actor, action_id=action_id, group=group, kind="group.archive", target=group, body={"reason": reason} if reason else {}))
        final = self.snapshot(group)
        location = f"archive/{group}/audit-{final.seq:020d}.log"
        # the record logged last must not outlive the directory; the file is written through it
        with self._store_directory(f"archive/{group}") as directory:
            return self._write_archive(group, final, location, provider, directory)

    def _write_archive(self, group: str, final: SnapshotRef, location: str, provider: Any, directory: Directory) -> ArchiveRecord:
        path = os.path.join(self.path, location)

        def write_and_check() -> Any:
            info = write_audit_log(
                path, org=final.org, group=group, events=self._event_payloads(group, final.seq), key_provider=provider, directory=directory
            )
            # Compaction deletes the Group's history once the archive record exists: check first that
            # the audit log is complete, authentic and ends exactly in the signed final snapshot.
            verified = verify_snapshot(self.read_snapshot(final), keyring=self.keyring(), org=final.org, group=group)
            verify_audit_log_against_snapshot(path, verified, provider)
            return info

        def deleted_meanwhile() -> InvalidState | None:
            _, state_now = self.state(group, f"group:{group}")
            if state_now is not None and state_now.get("audit_log") == "deleted":
                return InvalidState(f"the audit log of group {group!r} was deleted (audit.delete) while it was written", state="deleted")
            return None

        try:
            try:
                info = _typed_call(write_and_check, "writing the audit log")
            except MwpError:
                # An audit.delete accepted meanwhile removes what archive/<group>/ holds: the
                # temporary file before its rename, or the file being checked. The missing file
                # is then its doing, not a storage failure: say so.
                refusal = deleted_meanwhile()
                if refusal is not None:
                    raise refusal from None
                raise
            refusal = deleted_meanwhile()
            if refusal is not None:
                # audit.delete was accepted while the file was written: its removal may have
                # listed archive/<group>/ before the file was there, so the file goes here
                raise refusal
        except BaseException:
            # A file that failed its check, or whose deletion was ordered meanwhile, is no
            # archive: remove it (a retry writes it again, unless it was deleted).
            _discard_unrecorded(directory, os.path.basename(location))
            raise
        file_hash = info.file_hash
        record = ArchiveRecord(
            org=final.org,
            group=group,
            final_snapshot=final,
            audit_location=location,
            audit_file_hash=file_hash,
            audit_bytes=info.bytes,
            audit_key_id=info.key_id,
            audit_chunks=info.chunks,
            events=info.events,
            last_seq=info.last_seq,
            archived_at_ms=self._now(),
        )
        try:
            self._log_note(ARCHIVE_TAG, group.encode(), _NOTE_ENCODER.encode(record))
        except LimitExceeded:
            # Refused before anything reached the log (a full commit): no record names the
            # file; a retry writes it again.
            _discard_unrecorded(directory, os.path.basename(location))
            raise
        return record

    @_index_errors_typed
    def archive_record(self, group: str) -> ArchiveRecord | None:
        canonical.check_id(group, "group")
        index = self.index
        with index.begin() as txn:
            value = index.get(txn, b"archives", group.encode())
            return None if value is None else _decode_note(value, ArchiveRecord)

    def _event_payloads(self, group: str, last_seq: int) -> Iterator[bytes]:
        """Encoded Events 1..last_seq of ``group``, as every read sees them (tombstones applied)."""
        after = 0
        while after < last_seq:
            events = self._read_events(group, after, min(10_000, last_seq - after))
            if not events:
                raise Corruption(f"group {group} has no Event after {after} below its head {last_seq}", reason="missing")
            for event in events:
                yield encode_event(event)
            after = events[-1].seq

    def redact(self, group: str, seq: int, *, actor: str, action_id: str, reason: str) -> Receipt:
        """Accept ``event.redact`` for Event ``seq``: from now on every read returns it without
        its payload; compaction removes the payload from disk."""
        self._check_writable("redact")
        return self.accept(Command(actor=actor, action_id=action_id, group=group, kind="event.redact", target=str(seq), body={"reason": reason}))

    def delete_audit_log(self, group: str, *, actor: str, action_id: str, reason: str = "", basis: str = "retention") -> Receipt:
        """Accept ``audit.delete`` for an archived Group (``basis`` "retention": the Organization's
        retention has passed; "legal": a legal deletion). The file is deleted once the Event is
        durable — by whatever path the Command was accepted — and again at open if a crash came
        between the two."""
        self._check_writable("delete_audit_log")
        body: dict[str, Any] = {"basis": basis}
        if reason:
            body["reason"] = reason
        return self.accept(Command(actor=actor, action_id=action_id, group=group, kind="audit.delete", target=group, body=body))

    def _remove_audit_log(self, group: str) -> None:
        """Delete the Group's audit log: the file its archive record names, and any other history
        under ``archive/<group>/`` (an archive interrupted after writing its file and before logging
        its record, or the temporary file of one interrupted while writing)."""
        # Not through archive_record(): after a commit this runs in the commit role, which close()
        # waits for, having already turned new reads away (StoreClosed after the Event is durable).
        index = self.index
        with index.begin() as txn:
            value = index.get(txn, b"archives", group.encode())
            record = None if value is None else _decode_note(value, ArchiveRecord)
        try:
            # from the store down never through a link: only the store's own files are deleted
            opened = open_below(self.path, f"archive/{group}", create=False)
        except FileNotFoundError:
            return
        with opened:
            names = [] if record is None or os.path.dirname(record.audit_location) != f"archive/{group}" else [os.path.basename(record.audit_location)]
            names += [name for name in os.listdir(opened.fd) if _AUDIT_FILE.fullmatch(name)]
            remove_names_at(opened, names)

    def _sweep_unrecorded_snapshots(self) -> None:
        """At an open after a close that was not clean (a crash, a storage failure): delete the
        snapshot files no record names, nor ever will, and the temporary files of snapshot
        writes that never finished. The index holds every record of the log by now, and under the
        store's lock no snapshot is being written. A file at a sequence the index has no snapshot
        at was never named; every file at a sequence it has one for is kept, the first one
        (every later reference there replaced a reference, not a file) and those named after a key
        (one a read-only view may still name, or one no record named: the index cannot say). A
        sweep that cannot run does not stop the open (the next open that is not clean runs it
        again)."""
        try:
            # from the store down never through a link: only the store's own files are deleted
            root = open_below(self.path, "snapshots", create=False)
        except (OSError, MwpError):
            return
        with root:
            try:
                groups = [name for name in os.listdir(root.fd) if canonical.id_ok(name)]
            except OSError:
                return
            for group in groups:
                with contextlib.suppress(OSError, MwpError, lmdb.Error):
                    with open_child(root, group, create=False) as directory:
                        self._sweep_unrecorded_in(group, directory)

    def _sweep_unrecorded_in(self, group: str, directory: Directory) -> None:
        """:meth:`_sweep_unrecorded_snapshots` of one Group's directory, through its descriptor."""
        index = self.index
        names = os.listdir(directory.fd)
        removed = False
        for name in names:
            temp = _SNAPSHOT_TEMP.fullmatch(name)
            match = _SNAPSHOT_FILE.fullmatch(name if temp is None else temp.group(1))
            if match is None or not 1 <= int(match.group(1)) <= limits.INT_ABS_MAX:
                continue  # no name snapshot() gives
            if temp is None:
                with index.begin() as txn:
                    if index.get(txn, b"snapshots", event_key(group, int(match.group(1)))) is not None:
                        continue
            os.unlink(name, dir_fd=directory.fd)
            removed = True
        if removed:
            _fsync_directory(directory)

    def _finish_audit_deletions(self) -> None:
        """Delete audit logs whose ``audit.delete`` is durable but whose file a crash left behind,
        then their emptied directories. Whatever a Group's audit log leaves is under
        ``archive/<group>/`` (the file its record names, and those of an archive that never logged
        its record), so only the directories there are looked at: a deletion finished once is not
        looked at again at every open. Nothing is deleted through a symbolic link: ``archive/``
        as a link is left for an open once it is a directory again, a link below it is
        ``STORAGE_FAILED`` naming it."""
        try:
            root = open_below(self.path, "archive", create=False)
        except FileNotFoundError:
            return
        except StorageFailed as exc:
            if exc.detail.get("errno") == errno.ELOOP:
                return
            raise
        with root:
            groups = sorted(name for name in os.listdir(root.fd) if canonical.id_ok(name))
            emptied = False
            for group in groups:
                _, state = self.state(group, f"group:{group}")
                if state is not None and state.get("audit_deleted_at_ms") is not None:
                    self._remove_audit_log(group)
                    with contextlib.suppress(OSError):  # not empty (a file of no name archive() gives): kept
                        os.rmdir(group, dir_fd=root.fd)
                        emptied = True
            if emptied:
                with contextlib.suppress(OSError):  # back after a power loss, it is emptied again
                    _fsync_directory(root)

    def compact(self, progress: Callable[[int, int], None] | None = None) -> Any:
        """Rewrite the log without redacted payloads and archived Groups' Events; see ``compaction``."""
        from .compaction import compact

        return compact(self, progress)  # which passes _check_writable("compact") first

    @_index_errors_typed
    def replay_floor(self, group: str) -> tuple[int, SnapshotRef | None]:
        """(floor, snapshot): reads with a Cursor below ``floor`` get ``CURSOR_TOO_OLD``.

        With the Group policy ``replay_window_events`` = W > 0, the floor is the newest snapshot
        whose sequence is at most head − W (0 while there is none: the floor moves only to where a
        signed snapshot can take over). The reference offered is the newest snapshot.
        """
        canonical.check_id(group, "group")
        return self._replay_floor(group, self.index)

    def _replay_floor(self, group: str, index: Index) -> tuple[int, SnapshotRef | None]:
        """``replay_floor`` from one read transaction of ``index``: state, record, snapshots
        and head agree (taken one by one, a compaction or a commit could come between them)."""
        with index.begin() as txn:
            value = index.get(txn, b"states", state_key(group, f"group:{group}"))
            state = None if value is None else decode_state(value)[1]
            if state is not None and state.get("compacted"):
                value = index.get(txn, b"archives", group.encode())
                if value is None:  # a rebuild refuses such a log (_index_record): this index is not the log's
                    raise Corruption(
                        f"group {group} is compacted but the index holds no archive record for it; run `mwpstore rebuild`",
                        reason="index_missing",
                    )
                record = _decode_note(value, ArchiveRecord)
                # Its Events up to the final snapshot live in the audit log now; later ones (an
                # audit.delete tombstone) are still in the log, read after the snapshot's sequence.
                return record.final_snapshot.seq, record.final_snapshot
            window = 0 if state is None else int(state.get("policy", {}).get("replay_window_events", 0))
            if window <= 0:
                return 0, None
            # Two searches, not a range over every snapshot of the Group (read() asks this at
            # every call): the newest snapshot, and the newest at most head - window. Snapshot
            # keys are group \0 seq (u64 BE), so key order is sequence order, and
            # group \1 sorts after every one of them and before any other Group's keys (IDs are
            # letters, digits and _.@+=-, all above \x01).
            prefix = group.encode() + b"\x00"
            newest = index.last_below(txn, b"snapshots", prefix, group.encode() + b"\x01")
            if newest is None:
                return 0, None
            head = index.head(txn, group)[0]
            if head - window < 1:
                return 0, None
            eligible = index.last_below(txn, b"snapshots", prefix, event_key(group, head - window + 1))
            if eligible is None:
                return 0, None
            floor = _decode_note(eligible[1], SnapshotRef).seq
            reference = _decode_note(newest[1], SnapshotRef)
        return floor, reference

    def subscribe(self, group: str, after: int = 0) -> Subscription:
        """A live feed of ``group``'s Events after ``after``; see :class:`Subscription`."""
        self._check_closed()  # before the arguments, as every other method
        canonical.check_id(group, "group")
        _check_after(after)
        self._refuse_readonly("subscribe", _VIEW_NEVER_CHANGES)
        return Subscription(self, group, after)

    def ack(self, consumer: str, group: str, cursor: int) -> int:
        """Record ``consumer``'s highest contiguous durable Cursor for ``group``; return the stored one.

        ACKs never move backwards and never exceed the Group's head (``SEQUENCE_GAP``); they are
        durable (logged) and never delete history.
        """
        self._check_writable("ack")
        canonical.check_id(consumer, "consumer")
        canonical.check_id(group, "group")
        if type(cursor) is not int or cursor < 0:
            raise InvalidCommand("cursor must be a non-negative integer", field="cursor")
        request = _Request(None, ack=(consumer, group, cursor))
        self._submit(_Unit([request]))
        if request.error is not None:
            raise request.error
        return request.ack_result

    @_index_errors_typed
    def acked(self, consumer: str, group: str) -> int:
        canonical.check_id(consumer, "consumer")
        canonical.check_id(group, "group")
        index = self.index
        with index.begin() as txn:
            return index.get_u64(txn, b"acks", ack_key(consumer, group)) or 0

    @_damage_typed
    def wait_for(self, group: str, after: int, timeout: float | None) -> bool:
        """Block until ``group``'s head passes ``after`` (True) or the timeout ends (False);
        ``StoreClosed`` if the authority is closed (before or while it waits)."""
        # before the arguments, as every other method, and before self._published, which a
        # parent thread may have held at a fork
        self._check_closed()
        canonical.check_id(group, "group")
        if type(after) is not int or after < 0:
            raise InvalidCommand("after must be a non-negative integer", field="after")
        if timeout is not None and (type(timeout) not in (int, float) or not 0 <= timeout <= threading.TIMEOUT_MAX):
            raise InvalidCommand(f"timeout must be None or a number of seconds in 0..{threading.TIMEOUT_MAX:g}", field="timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._refuse_readonly("wait_for", _VIEW_NEVER_CHANGES)
        with self._published:
            self._published_waiting += 1  # before the first look at the head (see _commit_batch)
            try:
                while True:
                    if self.head(group)[0] > after:
                        return True
                    if self._closed:  # close() began after head() read: closed while waiting, as head() would say
                        raise StoreClosed("the authority is closed; open it again")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    # From a callback of this thread's running commit, rebuild or compaction (the
                    # clock, a progress callable) no commit can publish until that call returns:
                    # the wait would last its whole timeout, or for ever, and hold every writer up.
                    self._refuse_inside_commit("wait_for")
                    self._published.wait(remaining)
            finally:
                self._published_waiting -= 1

    # -- checking and rebuilding -----------------------------------------------------------------

    @_index_errors_typed
    def verify(self, progress: Callable[[int, int], None] | None = None, *, key_provider: Any = None) -> VerifyReport:
        """Check every frame, every Group's hash chain (tombstoned Events included: a redacted
        payload keeps its hash), that every Event without its payload has a tombstone, that the
        index equals a rebuild, every snapshot against the store's key, and every kept audit log
        against its Group's signed final snapshot (``key_provider`` as for :meth:`archive`)."""
        progress = checked_progress(progress)
        if key_provider is not None and not callable(getattr(key_provider, "key_for", None)):
            # Checked before anything runs, whether or not the store keeps an audit log for it to
            # read: an object that is no provider would otherwise escape as its AttributeError.
            raise InvalidCommand("key_provider must have key_for(org, key_id), as audit_log.FileKeyProvider has", field="key_provider")
        self._refuse_readonly("verify")  # it builds a scratch index in the store's directory
        self._refuse_inside_commit("verify")  # its comparison waits for the commit role
        log, index = self._pair  # one consistent pair, even if a compaction swaps them meanwhile
        assert index is not None
        problems: list[str] = []
        heads: dict[str, tuple[int, bytes]] = {}
        without_payload: list[tuple[str, int, int]] = []
        records = events = 0
        end = log.end
        try:
            for batch in log.scan(log.start, end=end):
                for position, record in zip(batch.positions, batch.records):
                    records += 1
                    tag = bytes(record[:1])
                    if tag == GROUP_TAG:
                        group, seq, digest, _ = _decode_group_record(position, record)
                        heads[group] = (seq, digest)
                        continue
                    if tag != EVENT_TAG:
                        continue
                    events += 1
                    event = decode_logged_event(position, record)
                    seq, previous = heads.get(event.group, (0, ZERO_HASH))
                    if event.seq != seq + 1 or event.prev_hash != previous:
                        problems.append(f"chain break in group {event.group} at seq {event.seq} (position {position})")
                    if recompute_event_hash(event) != event.hash:
                        problems.append(f"hash mismatch in group {event.group} at seq {event.seq} (position {position})")
                    if event.body is not None and payload_hash_of(event.body) != event.payload_hash:
                        problems.append(f"payload hash mismatch in group {event.group} at seq {event.seq}")
                    if event.body is None:  # the chain cannot tell a redaction from a payload dropped
                        without_payload.append((event.group, event.seq, position))
                    heads[event.group] = (event.seq, event.hash)
                if progress:
                    progress(batch.next_position - log.start, end - log.start)
        except _ProgressRaised:
            raise  # the caller's own callable failed: nothing was found about the store
        except MwpError as exc:
            problems.append(f"{exc.code}: {exc.message}")
            return VerifyReport(records, events, len(heads), problems)
        # A scratch directory that cannot be made (a read-only store directory) is StorageFailed
        # out of verify: the check cannot run, which says nothing about the store.
        scratch = self._scratch_directory("index.verify-")
        sound: bool | None = None  # whether the live index passed its structural check (None: not checked)
        try:
            found, sound = self._compare_with_rebuild(log, index, scratch)
            problems.extend(found)
        except (StoreClosed, StorageFailed):
            # close() began (it waits for this read, but no longer lends it the commit role), or
            # the scratch index or a file could not be read or written (out of descriptors, a
            # file size limit, EIO): the check could not run, which says nothing about the store
            raise
        except MwpError as exc:  # the log cannot even be indexed (e.g. a chain break): the scan above names why
            problems.append(f"rebuilding an index from the log to compare: {exc.code}: {exc.message}")
        if sound is None:  # the comparison stopped before its check: the lookups below read the live index too
            with self._exclusive():
                problem = _index_structure_problem(self.index)
            sound = problem is None
            if problem is not None:
                problems.append(problem)
        if not sound:
            # LMDB must not walk a damaged page (it can kill the process: SIGBUS, or an assertion of
            # its own): what only the index can name (tombstones, snapshots, audit logs) waits
            problems.append("tombstones, snapshots and audit logs: not checked, as the index failed its structural check; "
                            "run `mwpstore rebuild`, then verify again")
            return VerifyReport(records, events, len(heads), problems)
        try:
            for group, seq, position in without_payload:
                if self.state(group, f"tombstone:{seq}")[1] is None:
                    problems.append(
                        f"payload of group {group} seq {seq} is missing and no tombstone redacts it (position {position})"
                    )
        except StoreClosed:
            raise
        except MwpError as exc:  # the index cannot answer: the comparison above says why
            problems.append(f"looking up tombstones: {exc.code}: {exc.message}")
        try:
            problems.extend(self._verify_files(key_provider))
        except StoreClosed:
            raise
        except MwpError as exc:  # the index cannot even list the files: the comparison above says why
            problems.append(f"listing snapshots and audit logs: {exc.code}: {exc.message}")
        return VerifyReport(records, events, len(heads), problems)

    def _verify_files(self, key_provider: Any) -> list[str]:
        """Snapshots and audit logs: each problem names the file and the failed check."""
        problems = []
        keyrings: list[Keyring] = []  # taken at the first file to check: a store with none gets no key

        def keyring_(again: bool = False) -> Keyring:
            if not keyrings or again:
                keyrings[:] = [self.keyring()]
            return keyrings[0]

        def verified(data: bytes, group: str, org: str) -> Any:
            try:
                return verify_snapshot(data, keyring=keyring_(), group=group, org=org)
            except MwpError as exc:
                if exc.detail.get("check") != "key":
                    raise
                # signed by a key the store trusts only since the keyring was taken (a rotation
                # meanwhile): what the store's keyring says now decides
                return verify_snapshot(data, keyring=keyring_(again=True), group=group, org=org)

        def audit_log_deleted(group: str) -> bool:
            _, state = self.state(group, f"group:{group}")
            return state is not None and state.get("audit_deleted_at_ms") is not None

        provider = self._org_keys(key_provider)
        for group in self.groups():
            for ref in self.snapshots(group):
                try:
                    data = self.read_snapshot(ref)
                    check_snapshot_ref(data, ref)
                    verified(data, group, ref.org)
                except MwpError as exc:
                    problems.append(_file_problem(f"snapshot {ref.location}", exc))
            record = self.archive_record(group)
            if record is None:
                continue
            if audit_log_deleted(group):
                continue  # deleted by an accepted audit.delete: nothing to check
            path = os.path.join(self.path, record.audit_location)
            # An audit.delete accepted after the look above removes the file (before this looks for
            # it, or while it is read): asked again, it explains a file missing or cut short.
            if not os.path.exists(path):
                if not audit_log_deleted(group):
                    problems.append(f"audit log {record.audit_location}: missing (no accepted audit.delete explains it)")
                continue
            try:
                final = verified(self.read_snapshot(record.final_snapshot), group, record.org)
                verify_audit_log_against_snapshot(path, final, provider)
            except StoreClosed:
                raise  # close() began: it says nothing about the file (a snapshot's StoreClosed reaches the next read)
            except MwpError as exc:
                if not audit_log_deleted(group):
                    problems.append(_file_problem(f"audit log {record.audit_location}", exc))
        return problems

    def _scratch_directory(self, prefix: str) -> str:
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=self.path)
        except OSError as exc:
            raise translate(exc, context=f"creating a scratch directory in {self.path}") from None

    def _compare_with_rebuild(self, log: SegmentLog, index: Index, temp: str) -> tuple[list[str], bool]:
        """Rebuild an index from ``log`` into the scratch directory ``temp`` (removed afterwards)
        and compare it with ``index``: the problems, and whether the live index passed the
        structural check (False: it was not read)."""
        try:
            fresh = Index(temp, map_size=self._map_size)
        except BaseException:
            _remove_scratch(temp)
            raise
        problems = []
        try:
            try:
                with fresh.begin(write=True) as txn:
                    fresh.put(txn, b"meta", b"log_position", u64(log.start))
            except lmdb.Error as exc:  # the scratch index cannot be written: an I/O failure, not damage
                raise translate(exc, context=f"writing the index {temp}") from None
            self._redo(fresh, None, log=log)
            with self._exclusive():  # hold commits off while comparing
                self._redo(fresh, None, log=log)  # what was committed meanwhile (if the pair is live)
                live_log, live_index = self._pair
                if live_log is log and live_index is not None:
                    # a rebuild() meanwhile replaced the index (not the log): commits since went to
                    # the new one, which is the one to compare
                    index = live_index
                problem = _index_structure_problem(index)  # before reading the live index
                if problem is not None:
                    return [problem], False
                for name in (b"events", b"heads", b"states", b"receipts", b"acks", b"snapshots", b"archives", b"presence"):
                    try:
                        for live, rebuilt in itertools.zip_longest(index.iterate(name), fresh.iterate(name)):
                            if live != rebuilt:
                                where = (live or rebuilt or (b"", b""))[0][:KEY_SHOWN_BYTES]
                                problems.append(
                                    f"index database {name.decode()} differs from a rebuild from the log at key {where!r}"
                                )
                                break
                    except MwpError as exc:
                        problems.append(f"index database {name.decode()}: {exc.code}: {exc.message}")
        finally:
            fresh.close()
            _remove_scratch(temp)
        return problems, True

    def rebuild(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Regenerate the index from the log (crash-safe); return the number of records applied.

        Commits wait meanwhile; readers keep using the previous index until the new one is in place.
        """
        progress = checked_progress(progress)
        self._check_writable("rebuild")
        with self._exclusive():
            try:
                count = self._build_index(self._index_dir(), progress, install=self._install_index)
            except (OSError, lmdb.Error) as exc:  # e.g. index.rebuild/ cannot be created in a read-only directory
                raise translate(exc, context="rebuilding the index") from None
            return count

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the commit leader role: no commit runs until the block ends (its callers passed
        ``_check_writable``, or, for ``verify``, refused a read-only view and a call from inside a
        commit).

        Whatever ends the call (the block's end, ``StoreClosed``, an interrupt such as
        ``KeyboardInterrupt`` while it waits for the role), the role is handed on to the callers
        queued meanwhile, or given up: a commit that ended while this waited gave the role up for
        this call, and its queued callers, and close(), wait for whoever holds it."""
        me = get_ident()
        try:
            with self._lock:
                self._exclusive_waiting += 1
                try:
                    while self._leader:
                        self._wake.wait(0.01)
                finally:
                    self._exclusive_waiting -= 1
                if self._closed:  # closed while this waited for the running commit
                    raise StoreClosed("the authority is closed; open it again")
                self._committer = me  # first: from here on the finally below knows the role is this call's
                self._leader = True
            yield
        finally:
            with self._lock:
                # This call's role, or one given up for it (the leader flag down while it waited):
                # hand it to the callers queued behind the last commit, or give it up (and wake
                # close()). A role some other caller holds (interrupted while it still waited) stays.
                if self._committer == me or not self._leader:
                    self._committer = None
                    self._leader = True
                    self._pass_leadership()

    def _install_index(self, log: SegmentLog | None = None) -> None:
        """Open the freshly built index and switch to it (with ``log`` when the log changes too);
        the old handles stay valid for reads that began before the switch and are closed as soon as
        none of those is running (``_release_retired``)."""
        index = Index(self._index_dir(), map_size=self._map_size)
        try:
            with index.begin(write=True) as txn:
                index.put(txn, b"meta", b"boot_id", current_boot_id().encode())
                index.put(txn, b"meta", b"clean", b"0")
            index.sync()
        except BaseException:
            # Not installed: closed here, not left to the error's traceback (which a failed
            # compaction keeps in _failure), or it would stay open beside the next open of index/.
            with contextlib.suppress(Exception):
                index.close()
            raise
        old_log, old_index = self._pair
        self._pair = (log or old_log, index)
        with self._lease_lock:
            self._lease_watches = {}  # rebuilt from the new index at each Group's next sweep
        replaced: list[Any] = [old_index]
        if log is not None:
            old_log.detach()  # log/ is the new log's now: the old handle's close must not write there
            replaced.append(old_log)
        # A read takes the pair once, after it registers: only the reads registered now can be
        # using the old handles. They are closed as soon as each of those threads has been seen
        # outside any read (below, and at the end of every read), so the replaced files' space
        # (a compaction's redacted payloads among them) is given back then, not at close().
        with self._retire_lock:
            self._retired.append((set(self._readers), replaced))
        self._release_retired()

    def _release_retired(self) -> None:
        """Close the replaced handles that no read in flight can be using any more. Never raises
        (it runs at the end of reads): what closing them reports concerns files no longer the
        store's, which are gone once their descriptors and maps are."""
        with self._retire_lock:
            if not self._retired:
                return
            present = set(self._readers)  # one atomic copy: the threads inside a read now
            kept = []
            for waiting, handles in self._retired:
                waiting &= present  # a thread seen outside every read has finished the read it had
                if waiting:
                    kept.append((waiting, handles))
                    continue
                for handle in handles:
                    with contextlib.suppress(MwpError, OSError, lmdb.Error):
                        handle.close()
            self._retired = kept

    @_index_errors_typed
    def info(self) -> dict[str, Any]:
        """Facts for ``mwpstore inspect``: groups, heads, segments, sizes."""
        groups = {}
        index = self.index
        with index.begin() as txn:
            for key, value in index.range(txn, b"heads", b""):
                seq, digest = decode_head(value)
                groups[key.decode()] = {"seq": seq, "head_hash": digest.hex()}
        return {
            "path": self.path,
            "log_start": self.log.start,
            "log_end": self.log.end,
            "segments": [
                {
                    "first_position": segment.first_position,
                    "path": segment.path,
                    "size_bytes": segment.size_bytes,
                    "used_bytes": segment.used_bytes,
                    "sealed": segment.sealed,
                }
                for segment in self.log.segments()
            ],
            "groups": groups,
            "open": {"mode": self.open_report.mode, "reason": self.open_report.reason, "redo_records": self.open_report.redo_records},
        }


def _index_structure_problem(index: Index) -> str | None:
    """The structural check of ``index``'s file as a ``verify()`` problem; None when it passes.
    Run with commits held off (a commit changes the file under the check), before LMDB reads the
    index: LMDB itself must not walk a damaged page. ``StorageFailed`` (the file could not be
    read, e.g. no descriptor left) passes: nothing was found in it."""
    try:
        check_lmdb_file(os.path.join(index.directory, "data.mdb"), label="index", remedy=Index.remedy)
    except StorageFailed:
        raise
    except MwpError as exc:
        return f"index: {exc.code}: {exc.message}"
    return None


class Subscription:
    """Iterate a Group's Events as they are accepted. ``poll(timeout)`` returns the next batch."""

    def __init__(self, authority: Authority, group: str, after: int, batch: int = 1000) -> None:
        self._authority = authority
        self.group = group
        self.cursor = after
        self._batch = batch
        self._closed = False

    def poll(self, timeout: float | None = None) -> list[Event]:
        """Events after the cursor (waiting up to ``timeout`` seconds for some); advances the cursor.

        ``StoreClosed`` if the subscription is closed, or the authority is closed before the poll or
        while it waits (iterating the subscription then just ends)."""
        if self._closed:
            raise StoreClosed("the subscription is closed")
        events = self._authority.read(self.group, after=self.cursor, limit=self._batch)
        if not events and self._authority.wait_for(self.group, self.cursor, timeout):
            events = self._authority.read(self.group, after=self.cursor, limit=self._batch)
        if events:
            self.cursor = events[-1].seq
        return events

    def __iter__(self) -> Iterator[Event]:
        while not self._closed:
            try:
                events = self.poll(timeout=0.5)
            except StoreClosed:
                return
            yield from events

    def close(self) -> None:
        self._closed = True


# -- helpers shared by commit, redo and verify ---------------------------------------------------


def _check_after(after: object) -> None:
    if type(after) is not int or not 0 <= after <= limits.INT_ABS_MAX:
        raise InvalidCommand(f"after must be an integer in 0..{limits.INT_ABS_MAX}", field="after")


class _ProgressRaised(InvalidCommand):
    """What a ``progress`` callable raised, typed (see :func:`checked_progress`); a class of its
    own so that ``verify`` passes it on instead of listing it as a problem of the store."""


def checked_progress(progress: object) -> Callable[[int, int], None] | None:
    """``progress`` checked (a callable or None, else ``InvalidCommand``) and wrapped so that what
    it raises reaches the caller typed, as the clock's and the key provider's errors do:
    ``InvalidCommand`` with field ``progress`` and the callable's own exception as its
    ``__cause__`` (a caller that raises to cancel finds it there). Without the wrapper its
    ``OSError`` became ``StorageFailed``, a failure of the store's own, and its ``ValueError``
    passed raw or became an "unexpected error", depending on the call. What is no ``Exception``
    (``KeyboardInterrupt``) passes unchanged. The operation undoes its partial work first, as
    for any failure."""
    if progress is None:
        return None
    if not callable(progress):
        raise InvalidCommand("progress must be a callable(done, total) or None", field="progress")

    def report(done: int, total: int) -> None:
        try:
            progress(done, total)
        except Exception as exc:
            message = f"the progress callable raised {type(exc).__name__}: {exc}"[:300]
            raise _ProgressRaised(message, field="progress") from exc

    return report


def _acquire_through_interrupts(gate: threading.Lock) -> None:
    """Wait for ``gate`` even if interrupted again (the caller re-raises the first interrupt)."""
    while True:
        try:
            gate.acquire()
            return
        except BaseException:
            continue


class _HashedBody(msgspec.Struct):
    """The body of a Command's canonical content (JSON: docs/format/canonical.md); decoding only it
    skips building the other fields' strings and the outer dict."""

    body: dict[str, Any]


_BODY_DECODER = msgspec.json.Decoder(_HashedBody)


def _decide_on_what_was_hashed(request: _Request) -> None:
    """Give the request a Command whose body is decoded from its canonical bytes: the caller's
    body is a dict it may still change (from another thread, or a clock that is called back),
    and the Event must carry exactly the content its receipt's hash is of. Done where a Command
    goes to a commit, so a replay answered from its receipt pays nothing."""
    command = request.command
    if command is not None and command.body is not None and request.data:
        body = _BODY_DECODER.decode(request.data).body
        request.command = msgspec.structs.replace(command, body=body)


def _abort_quietly(txn: lmdb.Transaction) -> None:
    try:
        txn.abort()
    except lmdb.Error:
        pass  # the environment is already failing; the commit is refused either way


def _typed_call(call: Callable[[], Any], what: str) -> Any:
    """``call()``, with anything but an ``MwpError`` it raises translated (the audit log's writing
    and checks type their own errors and a key provider's; this is the net under them)."""
    try:
        return call()
    except MwpError:
        raise
    except Exception as exc:
        raise translate(exc, context=what) from None


_KEY_ID = re.compile(f"[0-9a-f]{{{KEY_ID_CHARS}}}")
_AUDIT_FILE = re.compile(r"audit-[0-9]{20}\.log|\.audit-[0-9]{20}\.log\.[0-9a-f]{16}\.tmp")
"""Names of the files ``archive()`` writes under ``archive/<group>/``: the audit log, and the
temporary name ``write_audit_log`` gives it until it is complete."""


_SNAPSHOT_FILE = re.compile(f"([0-9]{{20}})(?:-[0-9a-f]{{{KEY_ID_CHARS}}})?\\.snap")
"""Names of the files ``snapshot()`` writes under ``snapshots/<group>/`` (see ``_snapshot_location``)."""
_SNAPSHOT_TEMP = re.compile(r"\.(.+)\.[0-9a-f]{16}\.tmp")
"""The temporary name ``write_file_atomic`` gives a file until it is complete (the name inside)."""


def _snapshot_location(group: str, seq: int, key_id: str | None) -> str:
    """Where a snapshot of ``group`` at ``seq`` is kept: the first one signed at that sequence
    without a suffix, a later one (signed with another key) with its key id."""
    suffix = "" if key_id is None else f"-{key_id}"
    return f"snapshots/{group}/{seq:020d}{suffix}.snap"


def _stored_receipt(value: bytes | memoryview) -> tuple[bytes, Receipt]:
    """(content hash, receipt) from a receipts value; the two copies of the hash must agree, so a
    damaged value is ``CORRUPTION``, never a false collision or a wrong receipt."""
    content_hash = bytes(value[:32])
    try:
        receipt = decode_receipt(value[32:])
    except DECODE_ERRORS as exc:
        raise Corruption(f"a stored receipt is undecodable ({exc}); run `mwpstore rebuild`", reason="index") from None
    if receipt.content_hash != content_hash:
        raise Corruption("a stored receipt disagrees with its own content hash; run `mwpstore rebuild`", reason="index")
    return content_hash, receipt


# Why subscribe and wait_for refuse on a view rather than wait: a view answers from the one read
# transaction it began at open, so the Events they would wait for never appear in it.
_VIEW_NEVER_CHANGES = (
    "a read-only view is a snapshot of the store as it was when it opened and never sees later Events; "
    "open a new view to see them (as `mwpstore tail -f` does)"
)


def _commit_full(batch: _Batch, again: str = "accept the Command again") -> LimitExceeded:
    """The refusal of a request whose record would take the commit's log group past its bound
    (``limits.GROUP_BYTES_MAX``, or what an empty segment holds): retryable, it goes into a
    later commit (docs/api.md, "The per-commit byte cap")."""
    return LimitExceeded(
        f"this commit already holds {batch.record_bytes} bytes of records, as much as one log group takes; {again}",
        field="commands",
    )


def _collision(command: Command) -> ActionIdCollision:
    return ActionIdCollision(
        f"action {command.action_id!r} of {command.actor!r} was already accepted with different content; "
        "use a new Action ID for new content",
        actor=command.actor,
        action_id=command.action_id,
    )


def _last_group_end(batch: RecordBatch, begun: int) -> tuple[int, int] | None:
    """How many of ``batch``'s records (a scan's, which went on from ``begun``) come before the
    last position within it where a group ends, and that position; None if there is none (a batch
    inside one group). A group ends where a record's frame is followed by a commit frame (and maybe
    a seal) rather than by the next record, or the batch's end; the batch's first record starts a
    group when the scan read a commit frame before it."""
    positions, records = batch.positions, batch.records
    following = batch.next_position
    for count in range(len(positions), -1, -1):
        frame_end = positions[count - 1] + framed_bytes(len(records[count - 1])) if count else begun
        if frame_end != following:
            return count, following
        if count:
            following = positions[count - 1]
    return None


def _keep_last_ms(index: Index, txn: lmdb.Transaction, last_ms: int) -> None:
    """Raise the index's last acceptance time (``meta`` ``last_ms``) to ``last_ms``, the newest
    time of the records a redo indexed so far; never lower it (records without a time bring 0)."""
    previous = index.meta_u64(txn, b"last_ms")
    index.put(txn, b"meta", b"last_ms", u64(max(last_ms, 0 if previous is None else previous)))


def _index_records(
    index: Index,
    txn: lmdb.Transaction,
    writes: PendingWrites,
    heads: dict[str, tuple[int, bytes]],
    positions: list[int],
    records: list[bytes],
    last_ms: list[int],
) -> None:
    """``_index_record`` for every record of a scan batch: the C module indexes the plain Events
    and hands back each record it leaves (another tag, a Group's first head to load, damage) to
    be applied here, one at a time, in order."""
    seeds = (index.seed(b"events"), index.seed(b"states"), index.seed(b"receipts"))
    sinks = (writes.items, writes.new)
    count = len(records)
    at = 0
    while at < count:
        at, latest_ms = _index_c.index_events(records, positions, at, heads, sinks, seeds)
        if latest_ms > last_ms[0]:
            last_ms[0] = latest_ms
        if at < count:
            _index_record(index, txn, writes, heads, positions[at], records[at], last_ms)
            at += 1


def _index_record(
    index: Index,
    txn: lmdb.Transaction,
    writes: PendingWrites,
    heads: dict[str, tuple[int, bytes]],
    position: int,
    record: bytes | memoryview,
    last_ms: list[int],
) -> None:
    """Apply one log record to the index: gathered in ``writes``, flushed into ``txn`` by the caller
    (redo and rebuild). Heads are kept in ``heads``; ``txn`` is read only for a Group's head and, at a
    compacted Group's record, for its archive record."""
    tag = bytes(record[:1])
    if tag == EVENT_TAG:
        event = decode_logged_event(position, record)
        head = heads.get(event.group)
        if head is None:
            # The Group names the head's key: an ID first (an empty or 512-byte name was an
            # untyped lmdb.BadValsizeError out of redo), then the head read.
            _check_record_values(position, [], [], [], [event.group])
            head = decode_head(index.get(txn, b"heads", event.group.encode()))
        if event.seq != head[0] + 1 or event.prev_hash != head[1]:
            raise Corruption(
                f"log record at {position} breaks group {event.group}'s chain (seq {event.seq} after {head[0]})",
                offset=position,
                reason="chain",
            )
        _check_record_values(position, [event.hash, event.content_hash], [event.accepted_at_ms], event.effects,
                             [event.group, event.actor, event.action_id])
        group = event.group
        writes.put(b"events", event_key(group, event.seq), u64(position))
        for effect in event.effects:  # presence once per key: at its revision 1
            writes.put(b"states", state_key(group, effect.aggregate), encode_state(effect.revision, effect.state), effect.revision == 1)
        receipt = receipt_for(event)
        writes.put(b"receipts", receipt_key(event.actor, event.action_id), event.content_hash + encode_receipt(receipt))
        heads[group] = (event.seq, event.hash)
        if event.accepted_at_ms > last_ms[0]:
            last_ms[0] = event.accepted_at_ms
    elif tag in (SNAPSHOT_TAG, ARCHIVE_TAG):
        value = bytes(record[1:])
        try:
            if tag == SNAPSHOT_TAG:
                ref = msgspec.msgpack.decode(value, type=SnapshotRef)
                _check_record_values(position, [], [ref.seq], [], [ref.group])
                key = event_key(ref.group, ref.seq)
            else:
                archived = msgspec.msgpack.decode(value, type=ArchiveRecord).group
                _check_record_values(position, [], [], [], [archived])
                key = archived.encode()
        except DECODE_ERRORS as exc:
            raise Corruption(f"log record at {position} is not a valid reference: {exc}", offset=position, reason="decode") from None
        writes.put(_note_database(tag), key, value)
    elif tag == RECEIPT_TAG:
        try:
            actor, action_id, content_hash, encoded = _RECEIPT_DECODER.decode(memoryview(record)[1:])
        except DECODE_ERRORS as exc:
            raise Corruption(f"log record at {position} is not a receipt: {exc}", offset=position, reason="decode") from None
        _check_record_values(position, [content_hash], [], [], [actor, action_id])
        writes.put(b"receipts", receipt_key(actor, action_id), content_hash + encoded)
    elif tag == GROUP_TAG:
        group, seq, digest, kept = _decode_group_record(position, record)
        key = group.encode()
        if key not in writes.archived and index.get(txn, b"archives", key) is None:
            # compaction writes one only for a Group whose archive record the log holds before it:
            # without that record no read of the Group could be served
            raise Corruption(
                f"log record at {position} compacts group {group}, which has no archive record before it",
                offset=position,
                reason="decode",
            )
        heads[group] = (seq, digest)
        # The Group's last Event, group.archive, left the log with the others: its time is the
        # Group aggregate's archived_at_ms, and the last acceptance time must not fall below it.
        # _decode_group_record let through exactly one Effect of the Group aggregate, and its state
        # a dict (the decoder's type: a dict or None; the check: not None)
        [marked] = [effect.state for effect in kept if effect.aggregate == f"group:{group}"]
        archived_ms = marked.get("archived_at_ms")  # type: ignore[union-attr]
        if type(archived_ms) is int and last_ms[0] < archived_ms <= limits.TIME_MS_MAX:
            last_ms[0] = archived_ms
        for effect in kept:  # the first record of these keys in a compacted log
            writes.put(b"states", state_key(group, effect.aggregate), encode_state(effect.revision, effect.state))
    elif tag == ACK_TAG:
        try:
            consumer, group, cursor = _ACK_DECODER.decode(memoryview(record)[1:])
        except DECODE_ERRORS as exc:
            raise Corruption(f"log record at {position} is not an ACK: {exc}", offset=position, reason="decode") from None
        _check_record_values(position, [], [cursor], [], [consumer, group])
        writes.put(b"acks", ack_key(consumer, group), u64(cursor))
    else:
        raise Corruption(f"log record at {position} has unknown tag {tag!r}", offset=position, reason="tag")


def _decode_group_record(position: int, record: bytes | memoryview) -> tuple[str, int, bytes, list[Effect]]:
    """A compacted Group's record (``G``): its Group, head sequence, chain hash and kept Effects,
    in either form (the first form kept the Group aggregate alone); ``CORRUPTION`` (``decode``)
    for anything else."""
    body = memoryview(record)[1:]
    try:
        try:
            group, seq, digest, kept = _GROUP_DECODER.decode(body)
        except msgspec.ValidationError:
            group, seq, digest, revision, state = _GROUP_DECODER_FIRST.decode(body)
            kept = [Effect(f"group:{group}", revision, state)]
    except DECODE_ERRORS as exc:
        raise Corruption(f"log record at {position} is not a Group remainder: {exc}", offset=position, reason="decode") from None
    _check_record_values(position, [digest], [seq], kept, [group])
    # What compaction writes, in either form: the Group aggregate marked compacted (readers take
    # the Group's Events from its archive then), and the Memberships. Anything else read as one
    # left a Group the readers could not serve (a bare AssertionError, or "run rebuild" forever).
    aggregates = [effect.aggregate for effect in kept]
    marked = [effect for effect in kept if effect.aggregate == f"group:{group}" and effect.state is not None]
    if (
        len(marked) != 1
        or marked[0].state.get("compacted") is not True  # type: ignore[union-attr]
        or len(set(aggregates)) != len(aggregates)
        or not all(key == f"group:{group}" or key.startswith("member:") for key in aggregates)
    ):
        raise Corruption(
            f"log record at {position} is not a Group remainder compaction writes (group {group}: the Group "
            "aggregate marked compacted and its Memberships)",
            offset=position,
            reason="decode",
        )
    return group, seq, digest, kept


def _check_record_values(
    position: int, digests: list[bytes], numbers: list[int], effects: list[Effect], ids: list[str]
) -> None:
    """``CORRUPTION`` (``decode``) for values a well-framed record cannot hold: a hash (chain or
    content) that is not 32 bytes, a number outside the index's unsigned 64 bits, an effect
    revision below 1, an ID that is not one (index keys join IDs with ``\\x00``)."""
    for value in ids:
        if not canonical.id_ok(value):
            raise Corruption(f"log record at {position} holds an invalid ID {value[:80]!r}", offset=position, reason="decode")
    for digest in digests:
        if len(digest) != HASH_BYTES:
            raise Corruption(f"log record at {position} holds a {len(digest)}-byte hash", offset=position, reason="decode")
    for number in numbers:
        if not 0 <= number < _U64_END:
            raise Corruption(f"log record at {position} holds {number}, outside 0..2**64-1", offset=position, reason="decode")
    for effect in effects:
        if not 1 <= effect.revision < _U64_END:
            raise Corruption(
                f"log record at {position} gives {effect.aggregate} revision {effect.revision}", offset=position, reason="decode"
            )


_U64_END = 1 << 64
_SCAN_READ_MIN = 8
"""Fewer records than this are read one by one (a scan between them does not pay for itself)."""


def _records_between(log: SegmentLog, first: int, last: int, most: int) -> tuple[list[int], list[bytes]] | None:
    """Positions and records from ``first`` to ``last`` inclusive, in one framed, checksummed
    scan; None as soon as there are more than ``most`` of them."""
    positions: list[int] = []
    records: list[bytes] = []
    if last < first:
        return positions, records
    for batch in log.scan(first, end=last + 1, batch_records=min(most + 1, 4096)):
        positions.extend(batch.positions)
        records.extend(batch.records)
        if len(records) > most:
            return None
    return positions, records


def _event_bodies_between(log: SegmentLog, first: int, last: int, most: int) -> list[bytes] | None:
    """The records from ``first`` to ``last`` inclusive without their tag bytes, in one framed,
    checksummed scan; None as soon as there are more than ``most`` of them or one is not an
    Event (the caller then reads the positions the index names, and says which one is not)."""
    bodies: list[bytes] = []
    if last < first:
        return bodies
    for batch in log.scan(first, end=last + 1, batch_records=min(most + 1, 4096), split_tags=True):
        if batch.tags != EVENT_TAG * len(batch.records):
            return None
        bodies.extend(batch.records)
        if len(bodies) > most:
            return None
    return bodies


def _records_at(log: SegmentLog, positions: list[int]) -> list[bytes]:
    """The records at ``positions`` (ascending). One scan over the range when the Group's records
    lie close together in the log (the common case); reads one by one when other Groups' records
    dominate the range."""
    if len(positions) < _SCAN_READ_MIN:
        return [log.read(position) for position in positions]
    between = _records_between(log, positions[0], positions[-1], 4 * len(positions))
    if between is None:
        return [log.read(position) for position in positions]
    wanted = set(positions)
    found = [record for position, record in zip(*between) if position in wanted]
    if len(found) != len(positions):
        raise Corruption(f"the index names {len(positions)} records but the log holds {len(found)} of them", reason="index")
    return found


def _gc_paused_iter(batches: Iterable[Any]) -> Iterator[Any]:
    """Yield from ``batches`` with the cyclic collector paused while each batch is processed."""
    for batch in batches:
        with _gc.paused():
            yield batch


def _note_database(tag: bytes) -> bytes:
    return b"snapshots" if tag == SNAPSHOT_TAG else b"archives"


_Note = TypeVar("_Note", SnapshotRef, ArchiveRecord)


def _decode_note(value: bytes | memoryview, kind: type[_Note]) -> _Note:
    try:
        return msgspec.msgpack.decode(value, type=kind)
    except DECODE_ERRORS as exc:
        raise Corruption(f"an index {kind.__name__} is undecodable ({exc}); run `mwpstore rebuild`", reason="index") from None


def _flush_heads(
    index: Index, txn: lmdb.Transaction, heads: dict[str, tuple[int, bytes]], flushed: dict[str, tuple[int, bytes]]
) -> None:
    """Write the heads that differ from what ``flushed`` says the index holds. A head that moves
    is a new tuple (here and in ``_index_c``), so an unchanged one is the same object."""
    for group, head in heads.items():
        written = flushed.get(group)
        if written is not head:
            index.put(txn, b"heads", group.encode(), encode_head(*head), new=written is None)


_STORE_DIRECTORIES = ("log", "log.compact", "index", "keys")
"""What an authority's directory holds once it was ever opened (``log.compact``: a compaction in
flight), beside its lock file."""


def _holds_store(path: str) -> bool:
    try:
        return os.path.isfile(os.path.join(path, "authority.lock")) or any(
            os.path.isdir(os.path.join(path, name)) for name in _STORE_DIRECTORIES
        )
    except (TypeError, ValueError):  # e.g. a NUL in the path: open itself reports it below
        return False


def _refuse_agent_store(path: str) -> None:
    """An AgentStore's directory is not an authority: opening it as one would put a log and an
    index beside the agent's LMDB (``InvalidCommand``, field ``path``; nothing is written)."""
    if _holds_store(path):
        return  # an authority's directory, whatever else lies in it
    found = []
    if os.path.isfile(os.path.join(path, "agent.lock")):
        found.append("agent.lock")
    if os.path.isfile(os.path.join(path, "lmdb", "data.mdb")):
        found.append("lmdb/")
    if found:
        raise InvalidCommand(
            f"{path!r} holds an AgentStore ({', '.join(found)}), not an authority; open it with AgentStore.open, "
            "or give the authority a directory of its own",
            field="path",
            path=path,
        )


def _check_log_present(path: str) -> None:
    """A store that has an index or keys but no log segment lost its history (a deleted or
    unmounted ``log/``): refuse, instead of starting an empty log and rebuilding the index to it."""
    log = os.path.join(path, "log")
    try:
        segments = [name for name in os.listdir(log) if name.endswith(".seg")]
    except FileNotFoundError:
        segments = []
    if segments:
        return
    leftovers = [name for name in ("index", "keys") if os.path.isdir(os.path.join(path, name))]
    if leftovers:
        raise Corruption(
            f"the store at {path!r} has {' and '.join(leftovers)} but no log: its history is missing. "
            "Restore log/ from a backup (or the volume that holds it); to start a new store, use an empty directory",
            reason="log_missing",
            path=path,
        )


def _remove_scratch(directory: str) -> None:
    """Remove verify's scratch index. One that cannot be removed now is left in place: the next
    open deletes every ``index.verify-*``, and what verify reports is about the store (or the
    failure that ended it), not about its scratch copy."""
    with contextlib.suppress(MwpError):
        remove_index(directory)


def _lock_store(path: str) -> int:
    """Take the store's writer lock (``<path>/authority.lock``); ``StoreLocked`` if another holds it,
    ``StorageFailed`` if it cannot be taken at all."""
    return take_lock_file(
        os.path.join(path, "authority.lock"),
        lambda: StoreLocked(f"{path} is open in another process or handle; close it first", path=path),
        what="the store lock",
    )


def _discard_unrecorded(directory: Directory, name: str) -> None:
    """Remove, durably, the file ``name`` of ``directory`` written for a record that was never
    logged (a snapshot's or an audit log), through the directory's descriptor. A
    failure to remove it is not raised over the error that made it unrecorded: a file no record
    names is only clutter, never read as part of the store."""
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=directory.fd)
        os.fsync(directory.fd)


# -- read-only views -------------------------------------------------------------------------------

_WRITERS_HERE: dict[tuple[int, int], int] = {}
"""(device, inode) of each store directory this process holds open for writing, with the fork
generation that opened it: a read-only view of one of them is refused (see ``Authority.open``)."""
# The directories one handle remembers as durable (_store_directory): snapshots/<group>,
# archive/<group>, keys/orgs/<org>, one per Group or Organization it wrote a file for.
_DURABLE_DIRECTORIES_MAX = 4096

_VIEW_OPEN_SECONDS = 2.0
"""How long a read-only open retries while the writer switches files under it."""


class _Switched(Exception):
    """The index or the log was replaced while a read-only view opened them: try again."""


class _IndexView(Index):
    """A read-only index that answers every read from one LMDB read transaction, begun at open.

    The log is opened after that transaction began, so every position it names is in the log;
    a transaction begun later could name records appended since. Its reads take turns (an LMDB
    transaction serves one thread at a time); a nested read in the same thread shares it."""

    def __init__(self, directory: str, *, map_size: int) -> None:
        super().__init__(directory, map_size=map_size, readonly=True)
        self._turn = threading.RLock()
        # The first damage a read met, as "Type: message": LMDB refuses the rest of a transaction
        # in which a damaged page was met (BadTxnError), and the view has no other transaction.
        self.damage: str | None = None
        try:
            self._txn = self.env.begin(buffers=True)
        except BaseException:
            self.env.close()
            raise

    def begin(self, *, write: bool = False) -> Any:
        if write:
            raise InvalidState("the index of a read-only view cannot be written", reason="readonly", field="readonly")
        return _SharedTransaction(self)

    def close(self) -> None:
        try:
            self._txn.abort()
        finally:
            self.env.close()


class _SharedTransaction:
    """``with index.begin() as txn`` for :class:`_IndexView`: the view's transaction, for one
    thread at a time, neither committed nor aborted at the block's end.

    A read that LMDB refuses because an earlier read of the view met a damaged page
    (``BadTxnError``) is answered with that damage, which is what a caller can act on."""

    __slots__ = ("_view",)

    def __init__(self, view: _IndexView) -> None:
        self._view = view

    def __enter__(self) -> lmdb.Transaction:
        self._view._turn.acquire()
        return self._view._txn

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        view = self._view
        try:
            cause = None if exc is None else lmdb_cause(exc)
            if isinstance(cause, lmdb.BadTxnError) and view.damage is not None:
                raise Corruption(
                    f"the index is damaged ({view.damage}, met by an earlier read of this read-only view, "
                    f"after which LMDB refuses its reads); {Index.remedy}",
                    reason="index",
                ) from None
            if isinstance(cause, LMDB_FILE_DAMAGE_ERRORS) and view.damage is None:
                view.damage = f"{type(cause).__name__}: {cause}"
        finally:
            view._turn.release()


def _directory_key(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return status.st_dev, status.st_ino


def _file_key(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, None when it is missing: a file replaced by rename gets another."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino
