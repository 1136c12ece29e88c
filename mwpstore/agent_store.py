"""The AgentStore: an agent's local, rebuildable copy of the Groups it follows (MWP-FND-023).

It applies delivered Events into projections with at-least-once delivery in mind (MWP-WRK-029):
each Event is deduplicated by its Event ID, each Group is applied strictly in sequence, later
Events are buffered durably, and the durable Cursor never moves over a gap. Everything here can be
deleted and rebuilt from the Groups' Events; nothing in it is authoritative.

The apply cycle has visible boundaries (see ``docs/agent-store.md``)::

    with agent.begin() as tx:             # begin local transaction (one LMDB write transaction)
        tx.apply(event)                   # dedupe → next contiguous seq? → projections + queue
        tx.record_intent(...)             # outbox intent, durable with this commit
        tx.advance_cursor(group)          # Cursor := highest contiguous applied seq
    # commit (LMDB syncs) on a clean exit, abort on an exception
    agent.record_receipt(key, receipt)    # its own commit, after the external call

Its own LMDB environment holds one sub-database per concern; every key starts with the Group ID
and a NUL byte (IDs never contain NUL), so one Group's data is one key range.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import blake3
import lmdb
import msgspec

from . import _canonical_c, _files, _fork, canonical, failpoints, limits
from ._apply_c import check_run as _check_run
from ._apply_c import run as _apply_run
from ._files import makedirs_durable, store_path
from ._index_c import seal_sorted as _seal_sorted
from ._lmdb_check import check_before_open, check_map_size, check_option
from ._sealed import (
    KEY_SHOWN_BYTES,
    LMDB_DAMAGE_ERRORS,
    SealedTables,
    check_stored_format,
    damage_of,
    lmdb_cause,
    open_databases,
    shown_format,
    typed_damage,
)
from .errors import ReconcileRequired, ProjectionFailed  # noqa: F401  (defined with the other errors; re-exported here)
from .errors import (
    Corruption,
    EventInvalid,
    InvalidCommand,
    InvalidState,
    LimitExceeded,
    MwpError,
    SnapshotInvalid,
    StoreClosed,
    StoreLocked,
    translate,
)
from .messages import DECODE_ERRORS, HASHING, ZERO_HASH, Effect, Event, check_event, decode_event, encode_event
from .workitems import claim_refused

FORMAT_VERSION = 3
"""3: format 2 (sealed values, presence) with ``meta`` ``txnid``. A store of format 2 is upgraded
by its first open, which records the id; builds of format 2 refuse a store of format 3, whose
commits they would make without the id."""

_FORMAT_UPGRADED_AT_OPEN = b"2"

BUFFERED_EVENTS_MAX = 100_000
"""Bound on Events buffered beyond a gap, per Group; more is refused with ``LIMIT_EXCEEDED``."""

PROJECTION_KEY_BYTES_MAX = 256
"""Bound on an application projection's own key (LMDB keys are at most 511 bytes in all)."""

AGGREGATE_CHARS_MAX = limits.AGGREGATE_CHARS_MAX
"""Bound on an aggregate key an Event brings in: the one ``AgentStore.aggregate`` and ``state``
take (``canonical.check_aggregate_key``)."""

_FAILPOINT_ARMED = failpoints.armed().startswith("agent.")
"""Whether an ``agent.*`` fail point is armed in this process (read once, like ``failpoints``)."""

_WRITE_CACHE_ENTRIES_MAX = 200_000
"""A local transaction's write-back cache is flushed into LMDB when it holds this many entries."""

VERIFY_MODES = frozenset({"full", "trusted"})

_DATABASES = (
    b"meta",  # format version; the LMDB id of the last write transaction
    b"heads",  # group -> GroupHead
    b"inbox",  # group NUL seq -> event hash (applied Event IDs; pruned at or below the Cursor)
    b"buffer",  # group NUL seq -> encoded Event (beyond a gap)
    b"state",  # group NUL aggregate -> [revision, state]
    b"queue",  # group NUL priority-key not-before-key workitem -> b""
    b"queue_index",  # group NUL workitem -> its queue key suffix
    b"projection",  # group NUL projection name NUL key -> value
    b"outbox",  # group NUL idempotency key -> Intent
    b"intent_group",  # idempotency key -> group
    b"offline",  # group NUL b"C" seq -> BufferedCommand; group NUL b"S" -> outage record
    b"presence",  # tag byte + key of the databases below -> b"" (misses are checked against it)
)
# Every value is sealed (``mwpstore._sealed``). A miss in these databases is checked against
# ``presence``; the inbox's misses are checked against the Group head (it holds exactly the
# unpruned applied range), the queue is only ever read as ranges, meta only at open.
_PRESENCE_TAGS = {
    b"heads": b"h",
    b"buffer": b"b",
    b"state": b"s",
    b"queue_index": b"q",
    b"projection": b"p",
    b"outbox": b"o",
    b"intent_group": b"i",
    b"offline": b"f",
}

_DIGEST_DATABASES = (b"state", b"queue", b"queue_index", b"projection")

_TXNID_KEY = b"txnid"
"""The key in ``meta`` of the LMDB id of the last write transaction (see ``_Tables.record_txnid``)."""
_CREATION_TXNID = 1
"""The LMDB id of a new store's first commit, which creates its databases (the format is written by
the next)."""

_STATE_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_STATE_DECODER = msgspec.msgpack.Decoder(tuple[int, dict[str, Any] | None])
_INT64 = 2**63


class ApplyStatus(enum.Enum):
    """What ``tx.apply`` did with one delivered Event."""

    APPLIED = "applied"  # it was the next in sequence (buffered successors may have followed)
    DUPLICATE = "duplicate"  # already applied or already buffered: ignored
    BUFFERED = "buffered"  # beyond a gap: kept durably until the gap is filled


class GroupHead(msgspec.Struct, array_like=True):
    """Per-Group bookkeeping. ``cursor <= applied_seq`` always; nothing is applied past a gap."""

    applied_seq: int = 0
    applied_hash: bytes = ZERO_HASH
    cursor: int = 0
    pruned_seq: int = 0
    floor_seq: int = 0
    buffered: int = 0


_HEAD_ENCODER = msgspec.msgpack.Encoder()
_HEAD_DECODER = msgspec.msgpack.Decoder(GroupHead)


class QueueEntry(msgspec.Struct, frozen=True):
    """One ready WorkItem in a Group's work queue."""

    workitem: str
    priority: int
    not_before_ms: int


class IntentState(str, enum.Enum):
    INTENDED = "intended"  # durable, not yet handed to the outside world
    DISPATCHED = "dispatched"  # handed over; outcome unknown until a receipt is recorded
    UNCERTAIN = "uncertain"  # the call failed in a way that does not say whether it happened
    RECONCILED = "reconciled"  # a lookup said it did not happen: safe to dispatch again
    DONE = "done"  # the external receipt is recorded


class Intent(msgspec.Struct, frozen=True, kw_only=True):
    """An outbox intent for one external side effect (MWP-WRK-031)."""

    key: str
    group: str
    mission: str
    workitem: str
    ownership_epoch: int
    operation: str
    request: dict[str, Any] | None = None
    state: IntentState = IntentState.INTENDED
    dispatches: int = 0
    receipt: dict[str, Any] | None = None
    error: str | None = None
    recorded_at_ms: int = 0
    updated_at_ms: int = 0


_INTENT_ENCODER = msgspec.msgpack.Encoder()
_INTENT_DECODER = msgspec.msgpack.Decoder(Intent)




class Projection(Protocol):
    """An application projection: ``apply`` writes through ``view`` only (the local transaction).

    An optional ``restore(view, snapshot)`` is called when the Group is restored from a snapshot;
    without it the projection starts empty after the snapshot sequence.
    """

    name: str

    def apply(self, view: ProjectionView, event: Event) -> None: ...


class Clock(Protocol):
    def __call__(self) -> int: ...


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


# -- keys ----------------------------------------------------------------------------------------


def _prefix(group: str) -> bytes:
    return group.encode() + b"\x00"


def _seq_key(group: str, seq: int) -> bytes:
    return group.encode() + b"\x00" + seq.to_bytes(8, "big")


def _sortable_u64(value: int) -> bytes:
    return (value + _INT64).to_bytes(8, "big")


_QUEUE_DEFERRED_STEPS = 16
"""Deferred entries of one priority ``work_queue`` steps over before it searches for the next."""


def _queue_suffix(workitem: str, priority: int, not_before_ms: int) -> bytes:
    # priority descending, then not-before ascending, then WorkItem ID.
    return (_INT64 - 1 - priority).to_bytes(8, "big") + _sortable_u64(not_before_ms) + workitem.encode()


def _check_group(group: object) -> str:
    return canonical.check_id(group, "group")


# Strings already found valid (bounded): checking an ID is a regex match, and the same Group and
# aggregate keys recur in almost every Event.
_CHECKED_AGGREGATES: set[str] = set()
_CHECKED_GROUPS: set[str] = set()
_CHECKED_AGGREGATES_MAX = 100_000


# What mwpstore._apply_c.run needs besides the Events (csrc/agent_apply.c).
_RUN_CONTEXT = (
    Event, Effect, _CHECKED_AGGREGATES, _CHECKED_AGGREGATES_MAX, _canonical_c.kind_ok, _canonical_c.id_ok, msgspec.structs.astuple,
)


def _check_aggregate(aggregate: object) -> None:
    if type(aggregate) is str and aggregate in _CHECKED_AGGREGATES:
        return
    _check_aggregate_slow(aggregate)
    if len(_CHECKED_AGGREGATES) >= _CHECKED_AGGREGATES_MAX:
        _CHECKED_AGGREGATES.clear()
    _CHECKED_AGGREGATES.add(aggregate)  # type: ignore[arg-type]


def _check_aggregate_slow(aggregate: object) -> None:
    if type(aggregate) is not str or not 0 < len(aggregate) <= AGGREGATE_CHARS_MAX:
        raise EventInvalid("Event effect names no valid aggregate", reason="effects")
    # Each part bounded on its own (kind_ok, id_ok), as the C run checks them: a key of a longer
    # type would be stored yet refused when read by key.
    kind, sep, ident = aggregate.partition(":")
    if not sep or not canonical.kind_ok(kind) or not canonical.id_ok(ident):
        raise EventInvalid(f"Event effect aggregate {aggregate[:80]!r} is not '<type>:<id>'", reason="effects")


# What mwpstore._apply_c.check_run needs besides the Events (csrc/agent_apply.c): it does what
# _fully_valid_run does, with these calls.
_CHECK_CONTEXT = (
    Event,
    Effect,
    _CHECKED_AGGREGATES,
    _check_aggregate,
    *HASHING,
    _canonical_c.content_ok,
    _canonical_c.id_ok,
    _canonical_c.kind_ok,
    limits.EVENT_BYTES_MAX,
    msgspec.structs.astuple,
)


def _check_shape(event: Event) -> None:
    """Type checks that ``check_event`` leaves to the decoder (an Event object built in-process)."""
    if (
        type(event.seq) is not int
        or type(event.hash) is not bytes
        or type(event.kind) is not str
        or type(event.aggregate) is not str
        or type(event.revision) is not int
        or type(event.accepted_at_ms) is not int
        or type(event.authoritative) is not bool
        or (event.body is not None and type(event.body) is not dict)
        or type(event.effects) is not list
    ):
        raise EventInvalid("Event fields have the wrong types", reason="type")
    if type(event.group) is not str or event.group not in _CHECKED_GROUPS:
        try:
            canonical.check_id(event.group, "group")
        except InvalidCommand as exc:
            raise EventInvalid(f"Event group invalid: {exc.message}", reason="field", field="group") from None
        if len(_CHECKED_GROUPS) >= _CHECKED_AGGREGATES_MAX:
            _CHECKED_GROUPS.clear()
        _CHECKED_GROUPS.add(event.group)
    for effect in event.effects:
        if type(effect) is not Effect:
            raise EventInvalid("Event effects must be Effect values", reason="effects")
        _check_aggregate(effect.aggregate)
        if effect.state is not None and type(effect.state) is not dict:
            raise EventInvalid("an Effect's state must be a dict or None", reason="effects")


_ENCODE_ERRORS = (msgspec.EncodeError, TypeError, ValueError, OverflowError, RecursionError)
"""What encoding content that was never checked can raise (e.g. a dict with int keys, a set)."""


def _encoded(event: Event) -> bytes:
    """The bytes of an Event object; ``EventInvalid`` if it cannot be encoded, ``LimitExceeded``
    if they are more than ``EVENT_BYTES_MAX``."""
    try:
        data = encode_event(event)
    except _ENCODE_ERRORS as exc:
        raise EventInvalid(f"Event cannot be encoded: {exc}", reason="type") from None
    if len(data) > limits.EVENT_BYTES_MAX:
        raise LimitExceeded(f"a delivered Event is larger than {limits.EVENT_BYTES_MAX} bytes", field="event")
    return data


def admit_event(event: Event | bytes | bytearray | memoryview) -> tuple[Event, bytes]:
    """Check a delivered Event's type, shape and size (no hash checks); return it and its bytes.

    Raises ``EventInvalid`` or ``LimitExceeded``; never writes anything.
    """
    if isinstance(event, (bytes, bytearray, memoryview)):
        if len(event) > limits.EVENT_BYTES_MAX:
            raise LimitExceeded(f"a delivered Event is larger than {limits.EVENT_BYTES_MAX} bytes", field="event")
        data = bytes(event)
        event = decode_event(data)
    elif type(event) is Event:
        data = _encoded(event)
    else:
        raise EventInvalid("expected a mwpstore.Event or its encoded bytes", reason="type")
    _check_shape(event)
    return event, data


def admit_trusted_event(event: object) -> Event:
    """The checks of ``verify="trusted"``: an Event object of the right types whose IDs and
    aggregate keys are safe to use as store keys. No hashing and no content walk."""
    if type(event) is not Event:
        if isinstance(event, (bytes, bytearray, memoryview)):
            return admit_event(event)[0]
        raise EventInvalid("expected a mwpstore.Event or its encoded bytes", reason="type")
    _check_shape(event)
    seq = event.seq
    if type(seq) is not int or not 1 <= seq <= limits.INT_ABS_MAX or event.event_id != f"{event.group}:{seq}":
        raise EventInvalid("Event ID does not match its Group and a sequence from 1 to 2**63 - 1", reason="event_id")
    if type(event.prev_hash) is not bytes or len(event.hash) != 32 or len(event.prev_hash) != 32:
        raise EventInvalid("Event hashes must be 32 bytes", reason="hash")
    return event


# -- the store -----------------------------------------------------------------------------------


class _Tables(SealedTables):
    """The AgentStore's LMDB databases, read and written sealed."""

    label = "agent store"
    reason = "agent"
    remedy = "delete the agent store and rebuild it from the authority (its Events, or a verified snapshot)"

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        # A store of format 1 lacks presence: refused as format 1 (reason format), not as damage.
        # Its outbox intents are in no Event: they are settled with the build that wrote them.
        try:
            check_stored_format(
                env,
                str(FORMAT_VERSION).encode(),
                label="agent store",
                remedy="settle its outbox with the build that wrote it (intents are in no Event), then " + self.remedy,
            )
        except Corruption as exc:
            if exc.detail.get("format") != _FORMAT_UPGRADED_AT_OPEN.decode():
                raise  # format 2 is upgraded by the open (AgentStore._check_format)
        dbs = open_databases(env, _DATABASES, label="agent store", remedy=self.remedy)
        self._seal_tables(dbs, dbs[b"presence"], _PRESENCE_TAGS)
        self._recorded: lmdb.Transaction | None = None  # the write transaction whose id is put

    # Every write transaction that writes anything also puts its own LMDB transaction id in
    # ``meta`` (``_TXNID_KEY``), so the snapshot LMDB opens names the transaction that wrote it,
    # which the open compares with the id of the meta page LMDB picked (AgentStore._check_snapshot).
    # A write transaction that writes nothing commits nothing (LMDB writes no meta page and the id
    # does not advance), so the id is put with the first write, not at every commit. Each of
    # SealedTables' writes comes through here (tests/test_lmdb_check.py checks the list).

    def record_txnid(self, txn: lmdb.Transaction) -> None:
        """Put ``txn``'s own id (8 bytes big-endian) in ``meta``, once per write transaction."""
        if self._recorded is not txn:
            SealedTables.put(self, txn, b"meta", _TXNID_KEY, txn.id().to_bytes(8, "big"))
            self._recorded = txn

    def put(self, txn: lmdb.Transaction, name: bytes, key: bytes, value: bytes, new: bool = True) -> None:
        self.record_txnid(txn)
        super().put(txn, name, key, value, new)

    def put_many_sealed(self, txn: lmdb.Transaction, name: bytes, items: list[tuple[bytes, bytes]], new: list[bytes] | None = None,
                        *, fresh: bool = False) -> None:
        self.record_txnid(txn)
        super().put_many_sealed(txn, name, items, new, fresh=fresh)

    def delete(self, txn: lmdb.Transaction, name: bytes, key: bytes) -> bool:
        self.record_txnid(txn)
        return super().delete(txn, name, key)

    def delete_range(self, txn: lmdb.Transaction, name: bytes, prefix: bytes, start: bytes | None = None,
                     last: bytes | None = None) -> int:
        self.record_txnid(txn)
        return super().delete_range(txn, name, prefix, start, last)


_F = TypeVar("_F", bound=Callable[..., Any])

_damage_typed = typed_damage("agent store", _Tables.remedy, "agent")
"""Read paths of the AgentStore: damaged LMDB pages or bytes are ``CORRUPTION``, never foreign."""


def _transaction_error(exc: Exception, context: str) -> MwpError:
    """The typed error of a foreign one inside a local transaction: LMDB's errors of damaged pages
    (also when the binding wraps one in ``SystemError``) are ``CORRUPTION`` of the agent store
    (reason ``agent``), its other errors and the rest as :func:`translate` types them (a full map
    is ``LIMIT_EXCEEDED``, a failed disk ``STORAGE_FAILED``)."""
    cause = lmdb_cause(exc)
    if isinstance(cause, LMDB_DAMAGE_ERRORS):
        return damage_of("agent store", _Tables.remedy, "agent", cause)
    return translate(cause or exc, context=context)


def _lmdb_damage_typed(method: _F) -> _F:
    """The calls of a local transaction, some of which run application code (a projection's
    errors pass unchanged): only LMDB's own errors are translated, as ``_transaction_error`` types
    them, at the call (its reads too: a caller that catches ``MwpError`` inside the block never
    meets LMDB's own error, e.g. ``CursorFullError`` from a damaged page). A full map met
    while an Event is applied was the store's damage, whose remedy (delete the store, rebuild it)
    cannot help: it is ``LIMIT_EXCEEDED`` (field ``map_size``), as at the commit.

    LMDB refuses every later operation of a transaction in which one failed (``MDB_BAD_TXN``,
    which reads as damage), so the transaction is failed too: a caller that catches the error
    (``apply`` documents ``LIMIT_EXCEEDED`` for a malformed Event, after which it goes on) is
    then told it can only abort, not that the store is damaged. A ``ProjectionView``'s calls (an
    application projection's reads and writes) are typed the same way, inline: they are called a
    few times an Event, and a wrapper's call added 7.7% to the instructions of a full-check
    ``apply_many`` with a projection that makes four to six of them an Event."""

    @functools.wraps(method)
    def wrapper(self: AgentTransaction, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (lmdb.Error, SystemError) as exc:  # SystemError: the binding's, around an LMDB error
            raise _failing(self, exc) from None

    return wrapper  # type: ignore[return-value]


def _failing(tx: AgentTransaction, exc: Exception) -> MwpError:
    """The typed error of an LMDB error ``exc`` met inside ``tx`` (``_transaction_error``), with
    which ``tx`` is failed; ``exc`` itself, raised unchanged, when it is not LMDB's (a
    ``SystemError`` of another cause)."""
    if lmdb_cause(exc) is None:
        raise exc
    error = _transaction_error(exc, "in a local transaction")
    # typed also where the error had already failed it (a projection's write, a flush): the
    # transaction's refusals then name LimitExceeded, not MapFullError
    tx._failed = error
    return error



def _options_tuple(value: object, field: str) -> tuple[Any, ...]:
    """A list or tuple option (keys, projections) as a tuple; ``InvalidCommand`` for anything else:
    a str or bytes would be taken apart into characters or ints, a set or a dict has no order of
    its own to apply projections in, and a generator would be used up by a failed open."""
    if not isinstance(value, (list, tuple)):
        raise InvalidCommand(f"{field} must be a list or tuple, not {type(value).__name__}", field=field)
    return tuple(value)


_AUTHORITY_FILES = ("authority.lock", "log", "index")
"""What an authority's directory holds: an AgentStore is never opened beside them."""


def _refuse_authority(path: str) -> None:
    """An authority's directory is not an AgentStore: opening it as one would put ``agent.lock``
    and ``lmdb/`` beside the authority's log (``InvalidCommand``, field ``path``; nothing written)."""
    found = [name for name in _AUTHORITY_FILES if os.path.lexists(os.path.join(path, name))]
    if found:
        raise InvalidCommand(
            f"{path!r} holds an authority ({', '.join(found)}), not an AgentStore; give the agent store a directory of its own",
            field="path",
            path=path,
        )


def _sync_store_entries(path: str) -> None:
    """Make the names of the store's files durable: ``data.mdb`` in ``lmdb/``, ``lmdb/`` and
    ``agent.lock`` in the store's directory, and that directory in its parent.

    LMDB syncs the data file at each commit, never a directory: without this a power loss could
    take the whole environment, with the Cursors it ACKed and the outbox intents that were durable
    before their dispatch, and the next open would make an empty store in its place. Done at every
    open, before anything is read or committed: an earlier open that died between making these
    entries and syncing them left a store that looks whole."""
    lmdb_directory = os.path.join(path, "lmdb")
    for directory in (lmdb_directory, path, os.path.dirname(os.path.abspath(path))):
        _files.fsync_directory(directory)


def _keyring_of(trusted_keys: tuple[Any, ...]) -> Any:
    """The ``Keyring`` of an AgentStore's ``trusted_keys``: a caller's keyring as is, or one built
    from raw Ed25519 public keys (each checked: ``INVALID_COMMAND``, field ``public_key``)."""
    from .snapshot import Keyring  # imported late, as restore's verify_snapshot is

    if len(trusted_keys) == 1 and isinstance(trusted_keys[0], Keyring):
        return trusted_keys[0]
    return Keyring(trusted_keys)


class AgentStore:
    """One agent's local store. Open with :meth:`open`; one process writes (a lock file)."""

    def __init__(
        self,
        path: str,
        env: lmdb.Environment,
        lock_fd: int,
        projections: Sequence[Projection],
        trusted_keys: Sequence[Any],
        clock: Callable[[], int],
        verify: str = "full",
    ) -> None:
        self.path = path
        self.verify = verify
        self._env = env
        self._lock_fd = lock_fd
        self._fork_generation = _fork.generation  # the process this handle belongs to: none other may use it
        self._tables = _Tables(env)
        self._projections = tuple(projections)
        self.trusted_keys = tuple(trusted_keys)
        self._clock = clock
        self._write_lock = threading.Lock()
        self._writer: int | None = None
        self._closed = False
        self._gate = threading.Condition(threading.Lock())  # guards _readers: reads in flight, which close() waits for
        self._readers = 0
        # Intent keys whose side effect a ``dispatch`` of this handle is running: added in the
        # commit that marks the intent DISPATCHED, removed once its outcome is committed.
        self._dispatching: set[str] = set()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        projections: Sequence[Projection] = (),
        trusted_keys: Sequence[Any] = (),
        map_size: int = limits.AGENT_LMDB_MAP_BYTES_DEFAULT,
        clock: Callable[[], int] = _wall_clock_ms,
        verify: str = "full",
        check_lmdb: bool | None = None,
    ) -> AgentStore:
        """Open (creating on first use) the store in directory ``path``.

        ``verify="full"`` (the default) checks every delivered Event completely (``check_event``:
        types, IDs, canonical content, payload hash, chain hash and link). ``verify="trusted"`` is
        for Events read from an in-process ``Authority`` (validated when accepted, read back from
        its checksummed log): it checks types, IDs, sequence and the chain link by comparing
        ``prev_hash`` with the applied head, but does not recompute hashes or re-walk content.
        Before LMDB maps the store's file, its page structure is checked (``check_lmdb``: True
        always, False never, None when the file is at most ``limits.LMDB_CHECK_AT_OPEN_BYTES_MAX``
        bytes; the two meta pages always): a damaged file gives ``Corruption`` (reason
        ``lmdb_structure``) instead of a crash inside LMDB or the previous commit's snapshot.
        Raises ``StoreLocked`` when another handle (any process) has it open.
        """
        # every option is checked before anything is created
        if type(verify) is not str or verify not in VERIFY_MODES:
            raise InvalidCommand(f"verify must be one of {sorted(VERIFY_MODES)}", field="verify")
        if not callable(clock):
            raise InvalidCommand("clock must be a callable returning int milliseconds", field="clock")
        check_map_size(map_size)
        check_option(check_lmdb)
        path = store_path(path)
        trusted_keys = _options_tuple(trusted_keys, "trusted_keys")
        _keyring_of(trusted_keys)  # every key is checked at open, not at the first restore
        projections = _options_tuple(projections, "projections")
        for projection in projections:
            if not callable(getattr(projection, "apply", None)):
                raise InvalidCommand("a projection has a name and an apply(view, event) method", field="projections")
        names = [getattr(projection, "name", None) for projection in projections]
        for name in names:
            canonical.check_id(name, "projection name")
        if len(set(names)) != len(names):
            raise InvalidCommand("projection names must be distinct", field="projections")
        _refuse_authority(path)
        makedirs_durable(path)  # a new directory's entry synced in its parent, or a power loss can take it
        lock_fd = _files.take_lock_file(
            os.path.join(path, "agent.lock"),
            lambda: StoreLocked(f"the agent store at {path} is open in another handle or process; close it first"),
            what="the agent store lock",
        )
        try:
            check_before_open(os.path.join(path, "lmdb"), check_lmdb, label="agent store", remedy=_Tables.remedy)
            env = lmdb.open(
                os.path.join(path, "lmdb"),
                map_size=map_size,
                max_dbs=len(_DATABASES) + 1,
                max_readers=limits.LMDB_READERS_MAX,
                sync=True,
                metasync=True,
                subdir=True,
                readahead=False,
            )
            _sync_store_entries(path)
            store = cls(path, env, lock_fd, projections, trusted_keys, clock, verify)
            store._check_format()
        except BaseException as exc:
            if "env" in locals():
                env.close()
            os.close(lock_fd)
            if isinstance(exc, MwpError):
                raise
            if isinstance(exc, Exception):  # LMDB's errors of damaged pages are the agent store's CORRUPTION
                raise _transaction_error(exc, "opening the agent store") from None
            raise
        return store

    @_damage_typed
    def _check_format(self) -> None:
        tables = self._tables
        with tables.begin(write=True) as txn:
            # A value that fails its seal is damage (CORRUPTION, reason agent_checksum): a store of
            # format 1, which stored it plain, was refused before the databases were opened
            # (check_stored_format, in _Tables).
            stored = tables.get(txn, b"meta", b"format")
            picked = txn.id() - 1  # the id of the meta page LMDB picked: a write transaction's is the next
            if stored is None and picked > _CREATION_TXNID:
                # Past the creation's commit, the format is there (the next commit wrote it):
                # without it the main database is an older commit's (a lost write of its page,
                # read without the walk: the empty databases of the creation, or roots of a
                # snapshot before the format), or the key is damaged; the store would open as new.
                raise Corruption(f"the agent store lost its format entry; {tables.remedy}",
                                 reason="agent_missing", database="meta", key="format")
            if stored is None or bytes(stored) == _FORMAT_UPGRADED_AT_OPEN:
                # a new store, or one of format 2, whose snapshot records no transaction id: the
                # write of the format records this transaction's
                tables.put(txn, b"meta", b"format", str(FORMAT_VERSION).encode())
            elif bytes(stored) != str(FORMAT_VERSION).encode():
                raise Corruption(
                    f"agent store format {shown_format(bytes(stored))!r} is not {FORMAT_VERSION}; delete the directory and rebuild it",
                    reason="format",
                )
            else:
                self._check_snapshot(txn, picked)

    def _check_snapshot(self, txn: lmdb.Transaction, picked: int) -> None:
        """``CORRUPTION`` (reason ``lmdb_structure``, check ``snapshot``) when the snapshot LMDB
        opened was written by an older transaction than the meta page it picked says (``picked``,
        that page's id): a bit flipped
        in the older meta page's transaction id (T−1 read as T+1) keeps the two ids consecutive,
        which the structural check cannot tell from a sound pair, and LMDB opens that older
        snapshot, one commit behind, consistent and sealed. An id recorded above the meta's is
        a compacting copy's (``mdb_copy -c`` numbers transactions from 1 again): it is recorded
        anew, in this transaction."""
        tables = self._tables
        stored = tables.get(txn, b"meta", _TXNID_KEY)  # sealed: a damaged id fails its seal
        if stored is None:  # written with the format, and never deleted
            raise Corruption(f"the agent store lost its recorded transaction id; {tables.remedy}",
                             reason="agent_missing", database="meta", key=_TXNID_KEY.decode())
        recorded = int.from_bytes(stored, "big")
        if recorded < picked:
            data = os.path.join(self.path, "lmdb", "data.mdb")
            raise Corruption(
                f"the agent store's LMDB file is damaged: its meta page {picked % 2} says transaction {picked}, "
                f"but the snapshot it leads to was written by transaction {recorded} (the commits after it "
                f"would be missing without an error); {tables.remedy}",
                reason="lmdb_structure", check="snapshot", path=data, page=picked % 2, value=picked, recorded=recorded,
            )
        if recorded != picked:
            tables.record_txnid(txn)

    def close(self) -> None:
        """Close the store once the reads and the local transaction in flight have ended (their
        values may point into LMDB's map); every later call is ``StoreClosed``. Idempotent: a
        close() interrupted while it waits (``KeyboardInterrupt``) is finished by the next one.
        In a child forked from the process that opened it, close() only retires this copy: the
        parent's environment is not closed (LMDB forbids using it across fork()) and no lock is
        taken (one a parent thread held at the fork would never be released here). The child's copy
        of the ``agent.lock`` descriptor is closed: kept, it would hold the parent's flock, and the
        store would stay locked after the parent closes it for as long as the child lives."""
        if self._fork_generation != _fork.generation:
            self._closed = True
            fd, self._lock_fd = self._lock_fd, -1  # first: a second close() must not close a reused number
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)  # the parent's own descriptor keeps the flock
            return
        with self._gate:
            if self._lock_fd < 0:
                return  # released already
            if self._writer == threading.get_ident():
                raise InvalidCommand("a local transaction is open in this thread: end it before close()", field="close")
            self._closed = True
            while self._readers:
                self._gate.wait(0.05)
        with self._write_lock:  # a transaction open in another thread commits or aborts first
            if self._lock_fd >= 0:  # not released meanwhile by a concurrent close()
                self._env.close()
                # the number taken first: from os.close on it may be any later open file's, and
                # an interrupt as os.close returns must not leave it for the next close() to close
                fd, self._lock_fd = self._lock_fd, -1
                os.close(fd)

    def __enter__(self) -> AgentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_open(self) -> None:
        """Raise ``StoreClosed`` if this handle is closed, or belongs to the process it was forked
        from; otherwise do nothing. For a caller that works elsewhere before it uses the store
        (``delivery.rebuild_group`` reads the source and calls the snapshot callback first)."""
        if self._closed:
            raise StoreClosed("the agent store is closed; open it again")
        if self._fork_generation != _fork.generation:
            raise StoreClosed(f"the agent store: {_fork.FORKED_MESSAGE}")

    # -- transactions ------------------------------------------------------------------------

    def begin(self) -> AgentTransaction:
        """Begin a local transaction: ``with agent.begin() as tx:`` commits on a clean exit."""
        self.check_open()
        if self._writer == threading.get_ident():
            raise InvalidCommand("a local transaction is already open in this thread", field="begin")
        self._write_lock.acquire()
        if self._closed:  # closed while this waited for another thread's transaction
            self._write_lock.release()
            raise StoreClosed("the agent store is closed; open it again")
        txn = None
        try:
            self._writer = threading.get_ident()
            txn = self._tables.begin(write=True)
            failpoints.hit("agent.begin")
            return AgentTransaction(self, txn)
        except BaseException as exc:
            # an interrupt (KeyboardInterrupt) too: the caller never got the transaction to end,
            # and the write lock it holds would refuse every later begin() and close()
            if txn is not None:
                with contextlib.suppress(lmdb.Error):
                    txn.abort()
            self._writer = None
            self._write_lock.release()
            if isinstance(exc, Exception) and not isinstance(exc, MwpError):
                raise translate(exc, context="beginning a local transaction") from None
            raise

    def _end(self) -> None:
        self._writer = None
        self._write_lock.release()

    @contextlib.contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction that ``close()`` waits for."""
        if self._fork_generation != _fork.generation:  # before the gate: a parent thread may have held it at the fork
            raise StoreClosed(f"the agent store: {_fork.FORKED_MESSAGE}")
        with self._gate:
            if self._closed:
                raise StoreClosed("the agent store is closed; open it again")
            self._readers += 1
        try:
            with self._tables.begin() as txn:
                yield txn
        finally:
            with self._gate:
                self._readers -= 1
                if not self._readers:
                    self._gate.notify_all()

    # -- reads -------------------------------------------------------------------------------

    @_damage_typed
    def head(self, group: str) -> GroupHead:
        _check_group(group)
        with self._read() as txn:
            return _load_head(self._tables, txn, group)

    def cursor(self, group: str) -> int:
        """The durable Cursor: every Event of ``group`` up to it is applied; none after a gap."""
        return self.head(group).cursor

    def ack_position(self, group: str) -> int:
        """What to ACK (MWP-WRK-030): the highest contiguous durable Cursor."""
        return self.cursor(group)

    @_damage_typed
    def groups(self) -> list[str]:
        with self._read() as txn:
            return [key.decode() for key, _ in self._tables.range(txn, b"heads", b"")]

    def state(self, group: str, key: str) -> dict[str, Any] | None:
        """The mirrored authoritative state of aggregate ``key`` (e.g. ``workitem:wi-3``)."""
        return self.aggregate(group, key)[1]

    def revision(self, group: str, key: str) -> int:
        return self.aggregate(group, key)[0]

    @_damage_typed
    def aggregate(self, group: str, key: str) -> tuple[int, dict[str, Any] | None]:
        _check_group(group)
        canonical.check_aggregate_key(key, "key")
        with self._read() as txn:
            data = self._tables.get(txn, b"state", _prefix(group) + key.encode())
            if data is None:
                return 0, None
            return _STATE_DECODER.decode(data)

    @_damage_typed
    def _aggregates(self, group: str, keys: Sequence[str]) -> list[tuple[int, dict[str, Any] | None]]:
        """``aggregate`` of each key, all from one read transaction: one commit's mirror, which a
        delivery thread cannot change between two of them (``OfflineGuard.rebase``)."""
        _check_group(group)
        for key in keys:
            canonical.check_aggregate_key(key, "key")
        with self._read() as txn:
            found: list[tuple[int, dict[str, Any] | None]] = []
            for key in keys:
                data = self._tables.get(txn, b"state", _prefix(group) + key.encode())
                found.append((0, None) if data is None else _STATE_DECODER.decode(data))
            return found

    @_damage_typed
    def states(self, group: str) -> dict[str, dict[str, Any]]:
        """Every live aggregate of ``group`` (key → state)."""
        _check_group(group)
        prefix = _prefix(group)
        result: dict[str, dict[str, Any]] = {}
        with self._read() as txn:
            for key, value in self._tables.range(txn, b"state", prefix):
                state = _STATE_DECODER.decode(value)[1]
                if state is not None:
                    result[key[len(prefix) :].decode()] = state
        return result

    @_damage_typed
    def work_queue(self, group: str, now_ms: int, *, limit: int | None = None) -> list[QueueEntry]:
        """Ready WorkItems of ``group`` at ``now_ms``: priority desc, not-before asc, then ID.

        Ready means a claim at ``now_ms`` would not be refused for the WorkItem's own sake: it is
        queued, its not-before time has come, and the mirrored state shows no reason the authority
        would refuse a claim — attempts used up, cost budget spent, deadline passed, Mission no
        longer open (docs/agent-store.md, "Work queue"). The last three are read from the mirror
        here, not kept in the queue's keys: the deadline depends on ``now_ms``, and the queue
        stays what it was (its keys, and so the projection digest, are unchanged).
        """
        _check_group(group)
        canonical.check_time_ms(now_ms, "now_ms")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise InvalidCommand("limit must be None or an int >= 1", field="limit")
        prefix = _prefix(group)
        result: list[QueueEntry] = []
        missions: dict[str, bool] = {}  # Mission ID -> open, read once per call
        tables = self._tables
        with self._read() as txn:

            def mission_open(mission: object) -> bool:
                if type(mission) is not str:
                    return True
                if mission not in missions:
                    data = tables.get(txn, b"state", prefix + b"mission:" + mission.encode())
                    state = None if data is None else _STATE_DECODER.decode(data)[1]
                    missions[mission] = state is None or state.get("status", "open") == "open"
                return missions[mission]

            # Within a priority the keys run by not-before: past the first deferred entry, the
            # rest of that priority is deferred too. They are stepped over, and after a few of
            # them the scan searches its way to the next priority instead (a search costs about
            # what a few steps do): a long deferred run costs a search, not a step per entry.
            start: bytes | None = None
            while True:
                deferred: bytes | None = None  # the priority bytes of the deferred run being stepped over
                stepped = 0
                for key, _ in tables.range(txn, b"queue", prefix, start):
                    suffix = key[len(prefix) :]
                    if deferred is not None:
                        if suffix[:8] == deferred:
                            stepped += 1
                            if stepped < _QUEUE_DEFERRED_STEPS:
                                continue
                            break
                        deferred = None
                    not_before_ms = int.from_bytes(suffix[8:16], "big") - _INT64
                    if not_before_ms > now_ms:
                        deferred, stepped = suffix[:8], 0
                        continue
                    workitem = bytes(suffix[16:]).decode()
                    data = tables.get(txn, b"state", prefix + b"workitem:" + suffix[16:])
                    state = None if data is None else _STATE_DECODER.decode(data)[1]
                    if state is not None and (claim_refused(state, now_ms) or not mission_open(state.get("mission"))):
                        continue
                    priority = _INT64 - 1 - int.from_bytes(suffix[:8], "big")
                    result.append(QueueEntry(workitem, priority, not_before_ms))
                    if limit is not None and len(result) >= limit:
                        return result
                else:
                    return result
                following = int.from_bytes(deferred, "big") + 1  # the next priority's first key
                if following >> 64:
                    return result
                start = prefix + following.to_bytes(8, "big")

    def checkpoint(self, group: str, workitem: str) -> Any:
        """The latest checkpoint of a WorkItem, as mirrored from the Group."""
        state = self.state(group, f"workitem:{workitem}")
        return None if state is None else state.get("checkpoint")

    @_damage_typed
    def projection_get(self, group: str, name: str, key: str | bytes) -> bytes | None:
        """Read one key of an application projection."""
        _check_group(group)
        canonical.check_id(name, "name")
        with self._read() as txn:
            value = self._tables.get(txn, b"projection", _projection_key(group, name, key))
            return None if value is None else bytes(value)

    @_damage_typed
    def projection_items(self, group: str, name: str) -> list[tuple[bytes, bytes]]:
        _check_group(group)
        canonical.check_id(name, "name")
        prefix = _prefix(group) + name.encode() + b"\x00"
        with self._read() as txn:
            return [(key[len(prefix) :], bytes(value)) for key, value in self._tables.range(txn, b"projection", prefix)]

    @_damage_typed
    def buffered_seqs(self, group: str) -> list[int]:
        _check_group(group)
        prefix = _prefix(group)
        with self._read() as txn:
            return [int.from_bytes(key[len(prefix) :], "big") for key, _ in self._tables.range(txn, b"buffer", prefix)]

    @_damage_typed
    def inbox_seqs(self, group: str) -> list[int]:
        _check_group(group)
        prefix = _prefix(group)
        with self._read() as txn:
            return [int.from_bytes(key[len(prefix) :], "big") for key, _ in self._tables.range(txn, b"inbox", prefix)]

    @_damage_typed
    def _offline_read(self, key: bytes) -> bytes | None:
        with self._read() as txn:
            value = self._tables.get(txn, b"offline", key)
            return None if value is None else bytes(value)

    @_damage_typed
    def _offline_read_range(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        with self._read() as txn:
            return [(key, bytes(value)) for key, value in self._tables.range(txn, b"offline", prefix)]

    # -- rebuild comparison --------------------------------------------------------------------

    @_damage_typed
    def projection_dump(self, group: str | None = None) -> list[tuple[str, bytes, bytes]]:
        """Every projection entry as (database, key, value) in key order, plus each Group's
        (applied seq, head hash, Cursor). Equal dumps mean byte-identical projections."""
        if group is not None:
            _check_group(group)
        with self._read() as txn:
            return list(self._projection_rows(txn, group))

    def _projection_rows(self, txn: lmdb.Transaction, group: str | None) -> Iterator[tuple[str, bytes, bytes]]:
        """The rows of :meth:`projection_dump`, one at a time from ``txn``."""
        tables = self._tables
        if group is None:
            heads: Iterable[tuple[bytes, bytes]] = tables.range(txn, b"heads", b"")
        else:  # one lookup: a range over every Group's head to find it cost one unseal per Group
            key = group.encode()
            value = tables.get(txn, b"heads", key)
            heads = () if value is None else ((key, value),)
        for key, value in heads:
            head = _decode_head(key, value)
            if head.applied_seq == 0 and head.cursor == 0:
                # nothing applied (Events only buffered, or the Group reset): the record is delivery
                # bookkeeping, and the Group's projections are those of a Group never seen
                continue
            yield ("heads", key, _STATE_ENCODER.encode([head.applied_seq, head.applied_hash, head.cursor]))
        prefix = b"" if group is None else _prefix(group)
        for name in _DIGEST_DATABASES:
            for key, value in tables.range(txn, name, prefix):
                yield (name.decode(), key, bytes(value))

    @_damage_typed
    def projection_digest(self, group: str | None = None) -> str:
        """A blake3 digest of :meth:`projection_dump` (hex), hashed row by row as they are read
        (the dump of a whole store is not built in memory)."""
        if group is not None:
            _check_group(group)
        hasher = blake3.blake3(b"mwpstore/agent-projection/v1\x00")
        with self._read() as txn:
            for name, key, value in self._projection_rows(txn, group):
                for part in (name.encode(), key, value):
                    hasher.update(len(part).to_bytes(8, "big"))
                    hasher.update(part)
        return hasher.hexdigest()

    # -- ACK cleanup -----------------------------------------------------------------------------

    def prune_inbox(self, group: str) -> int:
        """Delete inbox entries at or below the durable Cursor (delivery cleanup only; MWP-WRK-030).

        Returns how many were removed. Projections, buffered Events and the Cursor are untouched;
        an Event replayed after pruning is still recognised as a duplicate by its sequence.
        """
        with self.begin() as tx:
            return tx._prune_inbox(group)

    # -- Group reset and snapshot restore -------------------------------------------------------

    def reset_group(self, group: str) -> None:
        """Forget everything about ``group`` (projections, inbox, buffer, Cursor) to rebuild it."""
        with self.begin() as tx:
            tx._clear_group(group, keep_buffer_after=None)

    def restore(self, data: bytes, *, group: str, org: str | None = None, high_water_seq: int = 0) -> int:
        """Restore ``group`` from signed snapshot bytes; replay then continues strictly after it.

        ``snapshot.verify_snapshot`` checks size, format, key (this store's ``trusted_keys``),
        signature, hash, version, the Organization and Group binding and that the snapshot does not
        roll the Group back below what is applied here, nor below ``high_water_seq`` when that is
        higher (``Delivery`` passes the replay floor of the ``CURSOR_TOO_OLD`` it recovers from: an
        older snapshot cannot take the Cursor past it). Nothing is written unless every check
        passes; then projections of the Group are replaced in one local commit and the Cursor is
        the snapshot's sequence. Returns that sequence.
        """
        return self._restore(data, group=group, org=org, high_water_seq=high_water_seq, replace=False)

    def _restore(self, data: bytes, *, group: str, org: str | None, high_water_seq: int, replace: bool) -> int:
        """``restore``; with ``replace`` (``delivery.rebuild_group``) the snapshot replaces the Group
        whatever is applied here, as a reset and a restore in one local commit: a refused snapshot
        leaves the Group as it was."""
        self.check_open()
        from .snapshot import verify_snapshot

        _check_group(group)
        if type(high_water_seq) is not int or not 0 <= high_water_seq <= limits.INT_ABS_MAX:
            raise InvalidCommand(f"high_water_seq must be an integer in 0..{limits.INT_ABS_MAX}", field="high_water_seq")
        keyring = _keyring_of(self.trusted_keys)
        if org is None:
            mirrored = self.state(group, f"group:{group}")
            org = None if mirrored is None else mirrored.get("org")
            if org is None:
                raise InvalidCommand(
                    f"the Organization of group {group!r} is not known here: pass org= to bind the snapshot",
                    field="org",
                )
        applied = 0 if replace else self.head(group).applied_seq
        verified = verify_snapshot(data, keyring=keyring, org=org, group=group, high_water_seq=max(applied, high_water_seq))
        return self._restore_verified(verified, group=group, org=org, replace=replace)

    def restore_verified(self, snapshot: Any, *, group: str, org: str | None = None) -> int:
        """Restore from an already verified snapshot (``group``, ``org``, ``seq``, ``head_hash``,
        ``aggregates``: a list or tuple of ``Effect``). Checks the binding and that it does not roll
        the Group back."""
        return self._restore_verified(snapshot, group=group, org=org, replace=False)

    def _restore_verified(self, snapshot: Any, *, group: str, org: str | None, replace: bool) -> int:
        _check_group(group)
        if not all(hasattr(snapshot, name) for name in ("group", "org", "seq", "head_hash", "aggregates")):
            raise SnapshotInvalid("a snapshot has group, org, seq, head_hash and aggregates", check="schema")
        if snapshot.group != group:
            raise SnapshotInvalid(f"snapshot is of group {snapshot.group!r}, not {group!r}", check="binding")
        seq = snapshot.seq
        if type(seq) is not int or not 0 <= seq <= limits.INT_ABS_MAX:
            raise SnapshotInvalid("snapshot sequence is not an integer from 0 to 2**63 - 1", check="sequence")
        if type(snapshot.head_hash) is not bytes or len(snapshot.head_hash) != len(ZERO_HASH):
            raise SnapshotInvalid(f"snapshot head hash is not {len(ZERO_HASH)} bytes", check="schema")
        if snapshot.org is not None and (type(snapshot.org) is not str or not canonical.id_ok(snapshot.org)):
            raise SnapshotInvalid("snapshot organization is not an ID", check="schema")
        if type(snapshot.aggregates) not in (list, tuple):
            # read twice (checked, then written): a one-shot iterator would be used up by the checks
            raise SnapshotInvalid("snapshot aggregates must be a list or tuple of Effect values", check="schema")
        with self.begin() as tx:
            head = tx._head(group)
            mirrored_group = tx._get_state(group, f"group:{group}")
            known_org = mirrored_group[1].get("org") if mirrored_group is not None and mirrored_group[1] else None
            for expected in (org, known_org):
                if expected is not None and snapshot.org != expected:
                    raise SnapshotInvalid(
                        f"snapshot is bound to organization {snapshot.org!r}, not {expected!r}", check="binding"
                    )
            if seq < head.applied_seq and not replace:
                raise SnapshotInvalid(
                    f"snapshot at seq {seq} would roll group {group!r} back from seq {head.applied_seq}",
                    check="sequence",
                )
            if seq == head.applied_seq and seq > 0 and snapshot.head_hash != head.applied_hash and not replace:
                raise SnapshotInvalid("snapshot head hash differs from the applied Event at its sequence", check="hash")
            for effect in snapshot.aggregates:
                if type(effect) is not Effect:
                    raise SnapshotInvalid("snapshot aggregates must be Effect values", check="schema")
                try:
                    _check_aggregate(effect.aggregate)
                except EventInvalid:
                    raise SnapshotInvalid("snapshot names an invalid aggregate", check="schema") from None
                if type(effect.revision) is not int or not 1 <= effect.revision <= limits.INT_ABS_MAX:
                    raise SnapshotInvalid(f"aggregate {effect.aggregate} has an impossible revision", check="schema")
                if effect.state is not None and (type(effect.state) is not dict or not canonical.content_ok(effect.state)):
                    raise SnapshotInvalid(f"aggregate {effect.aggregate} holds a state that is not JSON-like content", check="schema")
            tx._clear_group(group, keep_buffer_after=None if replace else seq)
            tx._restore_aggregates(group, snapshot.aggregates)
            head = tx._head(group)
            head.applied_seq = head.cursor = head.floor_seq = head.pruned_seq = seq
            head.applied_hash = snapshot.head_hash
            tx._dirty.add(group)
            for projection in self._projections:
                restore = getattr(projection, "restore", None)
                if restore is not None:
                    tx._run_projection(restore, group, projection.name, snapshot)
            tx._drain(group)
        return seq

    # -- outbox --------------------------------------------------------------------------------

    @_damage_typed
    def intent(self, key: str) -> Intent | None:
        with self._read() as txn:
            return _load_intent(self._tables, txn, key)

    @_damage_typed
    def intents(self, group: str | None = None, *, pending_only: bool = False) -> list[Intent]:
        """Outbox intents (of one Group or all), oldest key order."""
        if type(pending_only) is not bool:  # a truthy string or list would have filtered silently
            raise InvalidCommand("pending_only must be True or False", field="pending_only")
        prefix = b"" if group is None else _prefix(_check_group(group))
        with self._read() as txn:
            found = [_INTENT_DECODER.decode(value) for _, value in self._tables.range(txn, b"outbox", prefix)]
        if pending_only:
            found = [intent for intent in found if intent.state != IntentState.DONE]
        return found

    def _now_ms(self) -> int:
        """The clock's reading, checked: an int of milliseconds (``InvalidCommand``, field
        ``clock``, otherwise), so that nothing stored holds a float or a wrapped time."""
        return canonical.clock_reading(self._clock)

    def record_receipt(self, intent_key: str | Intent, receipt: dict[str, Any]) -> Intent:
        """Record the external receipt of an intent, in its own local commit."""
        key = intent_key.key if isinstance(intent_key, Intent) else intent_key
        if type(receipt) is not dict:
            raise InvalidCommand("a receipt is a dict", field="receipt")
        receipt = canonical.content_copy(receipt, "receipt")
        with self.begin() as tx:
            intent = tx._require_intent(key)
            if intent.state == IntentState.DONE:
                return intent
            updated = msgspec.structs.replace(
                intent, state=IntentState.DONE, receipt=receipt, error=None, updated_at_ms=self._now_ms()
            )
            tx._put_intent(updated)
        failpoints.hit("agent.after_receipt")
        return updated

    def mark_dispatched(self, intent_key: str) -> Intent:
        """Durably note that an intent is about to be handed to the outside world."""
        return self._mark_dispatched(intent_key, running=False)

    def _mark_dispatched(self, intent_key: str, *, running: bool) -> Intent:
        """``mark_dispatched``; with ``running``, the intent is noted as dispatching in this
        handle within the same commit (``dispatch``, which runs the side effect next)."""
        marked = False
        try:
            with self.begin() as tx:
                intent = tx._require_intent(intent_key)
                if intent.state not in (IntentState.INTENDED, IntentState.RECONCILED):
                    advice = (
                        "its receipt is recorded: the side effect happened, do not dispatch it again"
                        if intent.state == IntentState.DONE
                        else "reconcile it before any retry"
                    )
                    raise ReconcileRequired(
                        f"intent {intent_key} is {intent.state.value}; {advice}",
                        key=intent_key,
                        state=intent.state.value,
                    )
                updated = msgspec.structs.replace(
                    intent, state=IntentState.DISPATCHED, dispatches=intent.dispatches + 1, updated_at_ms=self._now_ms()
                )
                tx._put_intent(updated)
                if running:  # under the write lock: a reconcile's commit sees it with the DISPATCHED state
                    marked = True  # first: an interrupt as add() returns still leaves with it removed
                    self._dispatching.add(intent_key)
        except BaseException:
            # The commit failed, or an interrupt came after it: the side effect never runs, so
            # the intent is not one this handle's dispatch is running (a reconcile settles it).
            # No other dispatch of this handle runs it: the state was INTENDED or RECONCILED.
            if marked:
                self._dispatching.discard(intent_key)
            raise
        return updated

    def mark_uncertain(self, intent_key: str, error: str) -> Intent:
        """Durably note that a dispatch's outcome is unknown (``error`` says why, first 1000
        characters kept): the intent must be reconciled before any retry."""
        if type(error) is not str:
            raise InvalidCommand("error must be a str", field="error")
        with self.begin() as tx:
            intent = tx._require_intent(intent_key)
            if intent.state == IntentState.DONE:
                return intent  # its receipt is recorded: the outcome is known
            if intent.state not in (IntentState.DISPATCHED, IntentState.UNCERTAIN):
                raise InvalidState(
                    f"intent {intent_key} is {intent.state.value}: only a dispatched intent can have an unknown outcome",
                    state=intent.state.value,
                )
            updated = msgspec.structs.replace(
                intent, state=IntentState.UNCERTAIN, error=error[:1000], updated_at_ms=self._now_ms()
            )
            tx._put_intent(updated)
        return updated

    def reconcile(self, intent_key: str, lookup: Callable[[Intent], dict[str, Any] | None]) -> Intent:
        """Settle an intent whose outcome is unknown with ``lookup(intent)`` (the caller asks the
        outside world by idempotency key): a receipt → recorded (DONE); None → RECONCILED (it did
        not happen; dispatching again reuses the same key). An intent whose side effect this
        handle's ``dispatch`` is running in another thread is returned unchanged on None."""
        _check_callable(lookup, "lookup")
        intent = self.intent(intent_key)
        if intent is None:
            raise InvalidCommand(f"no outbox intent {intent_key}", field="intent_key")
        if intent.state in (IntentState.DONE, IntentState.INTENDED, IntentState.RECONCILED):
            return intent
        receipt = lookup(intent)
        if receipt is not None:
            return self.record_receipt(intent_key, receipt)
        with self.begin() as tx:
            current = tx._require_intent(intent_key)
            if current != intent or intent_key in self._dispatching:
                # changed while the lookup ran (another thread recorded a receipt, or reconciled
                # and dispatched it again): this lookup's "not found" is older than that and must
                # not undo it. Or its side effect is running in this handle's dispatch, in
                # another thread: not found yet says nothing about a call still on its way
                return current
            updated = msgspec.structs.replace(current, state=IntentState.RECONCILED, updated_at_ms=self._now_ms())
            tx._put_intent(updated)
        return updated

    def dispatch(
        self,
        intent_key: str | Intent,
        side_effect: Callable[[Intent], dict[str, Any]],
        *,
        lookup: Callable[[Intent], dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """Perform an intent's side effect at most once per known outcome; return its receipt.

        ``side_effect(intent)`` does the external call with ``intent.key`` as its idempotency key
        and returns the receipt. A DONE intent returns its receipt without calling. A DISPATCHED or
        UNCERTAIN intent (a crash or an ambiguous failure) is first reconciled with ``lookup``;
        without one, ``ReconcileRequired`` is raised. If ``side_effect`` raises, the intent is
        marked UNCERTAIN and the exception propagates.
        """
        # checked before anything is written: called, a side effect that is no callable raised
        # TypeError, and the intent was left UNCERTAIN (to reconcile) for a call never made
        _check_callable(side_effect, "side_effect")
        if lookup is not None:
            _check_callable(lookup, "lookup")
        key = intent_key.key if isinstance(intent_key, Intent) else intent_key
        intent = self.intent(key)
        if intent is None:
            raise InvalidCommand(f"no outbox intent {key}", field="intent_key")
        if intent.state == IntentState.DONE:
            assert intent.receipt is not None
            return intent.receipt
        if intent.state in (IntentState.DISPATCHED, IntentState.UNCERTAIN):
            if lookup is None:
                raise ReconcileRequired(
                    f"intent {key} is {intent.state.value}: reconcile it with a lookup before any retry",
                    key=key,
                    state=intent.state.value,
                )
            intent = self.reconcile(key, lookup)
            if intent.state == IntentState.DONE:
                assert intent.receipt is not None
                return intent.receipt
        intent = self._mark_dispatched(key, running=True)
        try:
            failpoints.hit("agent.after_mark_dispatched")
            try:
                receipt = side_effect(intent)
            except BaseException as exc:
                self.mark_uncertain(key, f"{type(exc).__name__}: {exc}")
                raise
            failpoints.hit("agent.after_dispatch")
            # the receipt recorded, which is another one when a reconcile (another thread's, or
            # the side effect's own) recorded one first: later calls answer that one, so this does
            recorded = self.record_receipt(key, receipt).receipt
        finally:  # its outcome is committed (or the commit failed: reconcile it)
            self._dispatching.discard(key)
        assert recorded is not None
        return recorded


def _check_callable(function: object, field: str) -> None:
    """``InvalidCommand`` naming ``field`` unless ``function`` can be called (with the intent)."""
    if not callable(function):
        raise InvalidCommand(f"{field} must be a callable taking the intent, not {type(function).__name__}", field=field)


class ProjectionView:
    """What an application projection may touch: its own keys of one Group, in the local
    transaction, plus read access to the mirrored authoritative state."""

    __slots__ = ("_txn", "_tables", "_tx", "_prefix", "group", "name")

    def __init__(self, tx: AgentTransaction, group: str, name: str) -> None:
        self._tx = tx
        self._txn = tx._txn
        self._tables = tx._tables
        self._prefix = _prefix(group) + name.encode() + b"\x00"
        self.group = group
        self.name = name

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _projection_key_bytes(key)

    def _live_txn(self) -> lmdb.Transaction:
        """The local transaction's LMDB transaction, once the view may still use it: only in the
        thread that began it (LMDB's write transaction is that thread's), and only while it is
        neither ended (``StoreClosed``) nor failed (``ProjectionFailed``). A view kept by a
        projection past its call is refused there, not left to reach a finished transaction."""
        tx = self._tx
        if tx._done or tx._failed is not None or threading.get_ident() != tx._thread:
            tx._check_usable()
        return self._txn

    # Each call types LMDB's errors as ``_lmdb_damage_typed`` does, inline: a projection meets
    # ``CORRUPTION`` (or the other typed errors), never LMDB's own, and the transaction is failed.

    def get(self, key: str | bytes) -> bytes | None:
        try:
            value = self._tables.get(self._live_txn(), b"projection", self._key(key))
        except (lmdb.Error, SystemError) as exc:
            raise _failing(self._tx, exc) from None
        return None if value is None else bytes(value)

    def put(self, key: str | bytes, value: bytes) -> None:
        if type(value) is not bytes:
            raise InvalidCommand("projection values are bytes", field="value")
        if len(value) > limits.LMDB_VALUE_BYTES_MAX:
            raise LimitExceeded(f"projection values are at most {limits.LMDB_VALUE_BYTES_MAX} bytes", field="value")
        try:
            self._tables.put(self._live_txn(), b"projection", self._key(key), value)
        except (lmdb.Error, SystemError) as exc:
            raise _failing(self._tx, exc) from None

    def delete(self, key: str | bytes) -> bool:
        try:
            return self._tables.delete(self._live_txn(), b"projection", self._key(key))
        except (lmdb.Error, SystemError) as exc:
            raise _failing(self._tx, exc) from None

    def items(self, prefix: str | bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        rows = iter(self._tables.range(self._live_txn(), b"projection", self._key(prefix)))
        while True:
            self._live_txn()  # before each step: the transaction may have ended since the last one
            try:
                row = next(rows, None)  # the range reads LMDB only as it is stepped
            except (lmdb.Error, SystemError) as exc:
                raise _failing(self._tx, exc) from None
            if row is None:
                return
            yield row[0][len(self._prefix) :], bytes(row[1])

    def state(self, aggregate: str) -> dict[str, Any] | None:
        """The mirrored authoritative state (already updated by the Event being applied)."""
        self._live_txn()
        try:
            found = self._tx._get_state(self.group, aggregate)
        except (lmdb.Error, SystemError) as exc:
            raise _failing(self._tx, exc) from None
        return None if found is None else found[1]


def _projection_key_bytes(key: object) -> bytes:
    """A projection key as bytes: ``str`` (UTF-8) or ``bytes`` of at most ``PROJECTION_KEY_BYTES_MAX``."""
    try:
        raw = key.encode() if type(key) is str else key
    except UnicodeEncodeError:
        raise InvalidCommand("a projection key str must be encodable as UTF-8", field="key") from None
    if type(raw) is not bytes or len(raw) > PROJECTION_KEY_BYTES_MAX:
        raise LimitExceeded(f"projection keys are str or bytes of at most {PROJECTION_KEY_BYTES_MAX} bytes", field="key")
    return raw


def _projection_key(group: str, name: str, key: str | bytes) -> bytes:
    return _prefix(group) + name.encode() + b"\x00" + _projection_key_bytes(key)


class AgentTransaction:
    """One local transaction (one LMDB write transaction). Use as a context manager."""

    def __init__(self, store: AgentStore, txn: lmdb.Transaction) -> None:
        self._store = store
        self._txn = txn
        self._tables = store._tables
        self._thread = threading.get_ident()  # LMDB's write transaction belongs to the thread that began it
        self._heads: dict[str, GroupHead] = {}
        self._dirty: set[str] = set()
        self._done = False
        self._failed: BaseException | None = None
        self._full = store.verify == "full"
        # Write-back caches, flushed (sorted, coalesced) before commit and before range operations:
        # Events of one batch touch the same aggregates again and again, and only the last state
        # of each needs writing. Reads inside the transaction look here first.
        self._state_writes: dict[bytes, tuple[int, dict[str, Any] | None]] = {}
        self._inbox_writes: dict[bytes, bytes] = {}
        self._prefixes: dict[str, bytes] = {}

    def __enter__(self) -> AgentTransaction:
        return self

    def __del__(self) -> None:
        # A transaction dropped without being ended: an interrupt (KeyboardInterrupt) that CPython
        # raised as ``with``'s __enter__ or __exit__ began, so that no code of the block ended it.
        # Its write lock would refuse every later begin() and close(). Ended here only in the
        # thread that began it (LMDB's write transaction is that thread's), where the last
        # reference to such a transaction goes as the interrupt unwinds the caller's frame.
        if not getattr(self, "_done", True) and threading.get_ident() == self._thread:
            with contextlib.suppress(Exception):
                self.abort()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and self._failed is None:
            self.commit()
        else:
            self.abort()
            if exc_type is None and self._failed is not None:
                raise ProjectionFailed(
                    f"the local transaction was aborted: {self._failed!r}", reason=type(self._failed).__name__
                ) from self._failed
            if isinstance(exc, Exception) and lmdb_cause(exc) is not None:  # no MwpError has an LMDB cause
                # LMDB failed inside the block (a write over a damaged page: reset_group, prune_inbox,
                # an intent, an OfflineGuard record): typed, as a read's error is; nothing was written
                raise _transaction_error(exc, "in a local transaction") from None

    # -- the boundaries ------------------------------------------------------------------------

    def commit(self) -> None:
        """Write the Group heads and commit durably (LMDB syncs before returning)."""
        self._check_usable()
        try:
            self._flush()
            for group in self._dirty:
                self._tables.put(self._txn, b"heads", group.encode(), _HEAD_ENCODER.encode(self._heads[group]))
            failpoints.hit("agent.before_commit")
            self._txn.commit()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, Exception):
                raise _transaction_error(exc, "committing a local transaction") from None
            raise
        self._done = True
        self._store._end()
        failpoints.hit("agent.after_commit")

    def abort(self) -> None:
        if self._done:
            return
        self._check_thread()
        self._done = True
        try:
            self._txn.abort()
        finally:
            self._store._end()

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            # LMDB ties the write transaction (and its writer lock) to the thread that began it:
            # ended in another thread, the lock stays held and every later local transaction hangs
            raise InvalidCommand(
                "a local transaction is used and ended only by the thread that began it", field="thread"
            )

    def _check_usable(self) -> None:
        self._check_thread()
        if self._done:
            raise StoreClosed("this local transaction is finished; begin a new one")
        if self._failed is not None:
            raise ProjectionFailed(
                f"this local transaction failed part-way ({type(self._failed).__name__}, e.g. in an application "
                "projection): it can only abort",
                reason=type(self._failed).__name__,
            )

    @_lmdb_damage_typed
    def apply(self, event: Event | bytes) -> ApplyStatus:
        """Apply one delivered Event (an ``Event`` or its encoded bytes).

        The next Event in the Group's sequence is applied (then any buffered successors); an Event
        already applied or buffered is a DUPLICATE; a later one is BUFFERED. A malformed Event
        raises ``EventInvalid``/``LimitExceeded`` before anything is written, so the transaction
        stays usable. An application projection that raises aborts the whole transaction, and so
        does an LMDB error (a full map is ``LimitExceeded`` too, field ``map_size``).
        """
        if self._done or self._failed is not None or threading.get_ident() != self._thread:
            self._check_usable()
        if self._full:
            event, data = admit_event(event)
        else:
            event, data = admit_trusted_event(event), None
        group = event.group
        head = self._heads.get(group) or self._head(group)
        seq = event.seq
        if seq <= head.applied_seq:
            # Cheap checks only: nothing of a duplicate is written, but it must still be well-formed.
            if seq < 1 or event.event_id != f"{group}:{seq}":
                raise EventInvalid("Event ID does not match its Group and a positive sequence", reason="event_id")
            stored = None
            if seq > head.pruned_seq:  # the inbox holds every applied, unpruned sequence
                key = _seq_key(group, seq)
                stored = self._inbox_writes.get(key) or self._tables.get(self._txn, b"inbox", key)
                if stored is None:
                    raise Corruption(
                        f"the agent store's inbox lost {group}:{seq}; {self._tables.remedy}",
                        reason="agent_missing",
                        database="inbox",
                    )
            if stored is not None and stored != event.hash:
                raise EventInvalid(
                    f"Event {event.event_id} differs from the one already applied", reason="conflict", event_id=event.event_id
                )
            if _FAILPOINT_ARMED:
                failpoints.hit("agent.after_dedupe")
            return ApplyStatus.DUPLICATE
        if seq == head.applied_seq + 1:
            self._check_link(event, head.applied_hash)
            if _FAILPOINT_ARMED:
                failpoints.hit("agent.after_sequence")
            self._apply_next(head, event)
            if head.buffered:
                self._drain(group)
            return ApplyStatus.APPLIED
        if self._full:
            check_event(event)
        else:  # unwalked content: what is buffered must come back as this Event when the gap fills
            data = _encoded(event)
            decode_event(data)
        key = _seq_key(group, seq)
        buffered = self._tables.get(self._txn, b"buffer", key)
        if buffered is not None:
            if decode_event(buffered).hash == event.hash:
                return ApplyStatus.DUPLICATE
        elif head.buffered >= BUFFERED_EVENTS_MAX:
            raise LimitExceeded(
                f"group {group!r} already buffers {BUFFERED_EVENTS_MAX} Events beyond a gap", field="event"
            )
        else:
            head.buffered += 1
        assert data is not None
        # A second, different Event for a buffered seq replaces the first: only the chain link
        # checked when the gap is filled can tell which is genuine.
        self._tables.put(self._txn, b"buffer", key, data)
        self._dirty.add(group)
        failpoints.hit("agent.after_buffer")
        return ApplyStatus.BUFFERED

    def _check_link(self, event: Event, prev_hash: bytes) -> None:
        if self._full:
            check_event(event, expected_prev_hash=prev_hash)
        elif event.prev_hash != prev_hash:
            raise EventInvalid("Event does not link to the previous Event's hash", reason="prev_hash")

    @_lmdb_damage_typed
    def apply_many(self, events: Iterable[Event | bytes]) -> list[ApplyStatus]:
        """``apply`` each Event in order: the same statuses, writes and errors (an error leaves
        the Events before it applied in this transaction, as a loop of ``apply`` would).

        Without application projections, the Events that plainly follow one that ``apply``
        applied (the next sequence of the same Group, well-typed, linked) are taken by one C call,
        ``mwpstore._apply_c.run``, which makes the same checks and writes; with full validation
        they are first checked as ``apply`` checks them (``admit_event``, ``check_event``) by
        another C call, ``mwpstore._apply_c.check_run``. Every other Event goes through ``apply``."""
        statuses: list[ApplyStatus] = []
        if type(events) is not list:
            if isinstance(events, (str, bytes, bytearray, memoryview)) or not isinstance(events, Iterable):
                raise InvalidCommand("apply_many takes an iterable of Events (or their bytes)", field="events")
            events = list(events)
        self._apply_into(events, statuses)
        return statuses

    def _apply_into(self, events: list[Event | bytes], statuses: list[ApplyStatus]) -> None:
        """``apply_many``, appending each status to ``statuses`` as it is known: when an Event
        raises, ``statuses`` holds those of the Events before it (``deliver_batch`` skips it)."""
        if self._store._projections or _FAILPOINT_ARMED:
            for event in events:
                statuses.append(self.apply(event))
            return
        index, count = 0, len(events)
        while index < count:
            previous = events[index]
            status = self.apply(previous)
            statuses.append(status)
            index += 1
            if status is not ApplyStatus.APPLIED or index == count or type(previous) is not Event:
                continue
            group = previous.group
            head = self._heads[group]
            if head.buffered:
                continue  # apply() decides what a buffered Event's arrival means
            run, offset = events, 0
            if self._full:
                end = _check_run(events, index, _CHECK_CONTEXT, group, head.applied_seq + 1, head.applied_hash)
                if end == index:
                    continue
                # Only the checked Events, and only them: a copy of events[:end] at every run
                # made a batch of many Groups (many short runs) quadratic in its length.
                run, offset = events[index:end], index
            try:
                stop = offset + _apply_run(
                    run, index - offset, _RUN_CONTEXT, group, self._prefixes[group], head.applied_seq + 1, head.applied_hash,
                    self._inbox_writes, self._state_writes, _WRITE_CACHE_ENTRIES_MAX,
                )
            except BaseException as exc:  # Events may be written past the head: only abort is left
                self._failed = exc
                raise
            if stop > index:
                last = cast(Event, events[stop - 1])  # the run took it: an Event
                head.applied_seq = last.seq
                head.applied_hash = last.hash
                statuses.extend([ApplyStatus.APPLIED] * (stop - index))
                index = stop
                if len(self._state_writes) + len(self._inbox_writes) >= _WRITE_CACHE_ENTRIES_MAX:
                    self._flush()

    @_lmdb_damage_typed
    def advance_cursor(self, group: str) -> int:
        """Move the durable Cursor to the highest contiguous applied seq (never over a gap)."""
        self._check_usable()
        head = self._head(_check_group(group))
        if head.cursor != head.applied_seq:
            head.cursor = head.applied_seq
            self._dirty.add(group)
        failpoints.hit("agent.after_cursor")
        return head.cursor

    @_lmdb_damage_typed
    def cursor(self, group: str) -> int:
        self._check_usable()
        return self._head(_check_group(group)).cursor

    @_lmdb_damage_typed
    def applied_seq(self, group: str) -> int:
        self._check_usable()
        return self._head(_check_group(group)).applied_seq

    @_lmdb_damage_typed
    def record_intent(
        self,
        group: str,
        *,
        mission: str,
        workitem: str,
        ownership_epoch: int,
        operation: str,
        request: dict[str, Any] | None = None,
    ) -> Intent:
        """Record an outbox intent in this transaction (durable with its commit, before dispatch).

        The key is ``work_keys.external_idempotency_key(mission, workitem, ownership_epoch,
        operation)``: recording the same operation again returns the existing intent, so a retry
        never mints a new key.
        """
        self._check_usable()
        from .work_keys import external_idempotency_key

        _check_group(group)
        key = external_idempotency_key(mission, workitem, ownership_epoch, operation)
        existing = self._get_intent(key)
        if existing is not None:
            if existing.group != group:
                raise InvalidCommand(f"intent {key} belongs to group {existing.group!r}", field="group")
            return existing
        if request is not None:
            if type(request) is not dict:
                raise InvalidCommand("an intent's request is a dict", field="request")
            request = canonical.content_copy(request, "request")
        now = self._store._now_ms()
        intent = Intent(
            key=key,
            group=group,
            mission=mission,
            workitem=workitem,
            ownership_epoch=ownership_epoch,
            operation=operation,
            request=request,
            recorded_at_ms=now,
            updated_at_ms=now,
        )
        self._put_intent(intent)
        failpoints.hit("agent.after_intent")
        return intent

    # -- reads inside the transaction -------------------------------------------------------------
    # Like every call of a finished (``StoreClosed``) or failed (``ProjectionFailed``) transaction,
    # they are refused: its LMDB transaction is gone, or its writes stopped part-way.

    @_lmdb_damage_typed
    def state(self, group: str, key: str) -> dict[str, Any] | None:
        self._check_usable()
        found = self._get_state(_check_group(group), canonical.check_aggregate_key(key, "key"))
        return None if found is None else found[1]

    @_lmdb_damage_typed
    def revision(self, group: str, key: str) -> int:
        self._check_usable()
        found = self._get_state(_check_group(group), canonical.check_aggregate_key(key, "key"))
        return 0 if found is None else found[0]

    # -- internals -------------------------------------------------------------------------------

    def _head(self, group: str) -> GroupHead:
        head = self._heads.get(group)
        if head is None:
            head = _load_head(self._tables, self._txn, group)
            self._heads[group] = head
        return head

    def _get_state(self, group: str, aggregate: str) -> tuple[int, dict[str, Any] | None] | None:
        key = _prefix(group) + aggregate.encode()
        pending = self._state_writes.get(key)
        if pending is not None:
            return pending
        data = self._tables.get(self._txn, b"state", key)
        if data is None:
            return None
        try:  # application projections read it through ProjectionView.state: no decorator translates
            return _STATE_DECODER.decode(data)
        except DECODE_ERRORS:
            raise Corruption(
                f"the agent store holds a state it cannot read at {bytes(key[:KEY_SHOWN_BYTES])!r}; {self._tables.remedy}",
                reason="agent",
                database="state",
            ) from None

    def _apply_next(self, head: GroupHead, event: Event) -> None:
        group = event.group
        prefix = self._prefixes.get(group)
        if prefix is None:
            prefix = self._prefixes[group] = _prefix(group)
        self._inbox_writes[prefix + event.seq.to_bytes(8, "big")] = event.hash
        state_writes = self._state_writes
        for effect in event.effects:
            state_writes[prefix + effect.aggregate.encode()] = (effect.revision, effect.state)
        if _FAILPOINT_ARMED:
            failpoints.hit("agent.after_builtin_projection")
        for projection in self._store._projections:
            self._run_projection(projection.apply, group, projection.name, event)
        if _FAILPOINT_ARMED:
            failpoints.hit("agent.after_projection")
        head.applied_seq = event.seq
        head.applied_hash = event.hash
        self._dirty.add(group)
        if len(state_writes) + len(self._inbox_writes) >= _WRITE_CACHE_ENTRIES_MAX:
            self._flush()

    def _run_projection(self, function: Callable[[ProjectionView, Any], None], group: str, name: str, arg: Any) -> None:
        view = ProjectionView(self, group, name)
        try:
            function(view, arg)
        except BaseException as exc:
            self._failed = exc
            raise

    def _put_aggregate(self, prefix: bytes, aggregate: str, revision: int, state: dict[str, Any] | None) -> None:
        self._state_writes[prefix + aggregate.encode()] = (revision, state)
        if len(self._state_writes) + len(self._inbox_writes) >= _WRITE_CACHE_ENTRIES_MAX:
            self._flush()

    def _flush(self) -> None:
        """Write the cached inbox and state changes in key order, then the work queue.

        Whatever escapes part-way (an LMDB error, an interrupt such as ``KeyboardInterrupt``)
        fails the transaction: the caches are emptied before their entries are written, so a
        commit after it, the block having caught the error, would record Events as applied
        without their states or work queue entries."""
        try:
            self._flush_caches()
        except BaseException as exc:
            if self._failed is None:
                self._failed = exc
            raise

    def _flush_caches(self) -> None:
        txn, tables = self._txn, self._tables
        # The caches are sorted, encoded and sealed by one C call each (``_index_c.seal_sorted``):
        # the same (key, sealed value) list as ``put_many`` makes of the sorted items.
        if self._inbox_writes:
            # every key is new (the inbox holds exactly the applied, unpruned range): one that exists
            # is another entry's key moved there by damage, which an overwrite would erase
            tables.put_many_sealed(txn, b"inbox", _seal_sorted(self._inbox_writes, tables.seed(b"inbox")), fresh=True)
            self._inbox_writes.clear()
        writes = self._state_writes
        if not writes:
            return
        self._state_writes = {}
        try:
            values = _seal_sorted(writes, tables.seed(b"state"), _STATE_ENCODER.encode)
        except _ENCODE_ERRORS as exc:  # only verify="trusted" lets unchecked content this far
            self._failed = EventInvalid(
                f"an Effect's state cannot be stored ({exc}); verify='trusted' does not check content, "
                "so this local transaction can only abort",
                reason="state",
            )
            raise self._failed from None
        tables.put_many_sealed(txn, b"state", values)
        # The work queue follows the last state of each WorkItem written in this transaction:
        # old entries are deleted one by one, new ones written in two batches (a WorkItem's new
        # queue key is never another's old one: the key ends with the WorkItem ID).
        queue: list[tuple[bytes, bytes]] = []
        queue_index: list[tuple[bytes, bytes]] = []
        indexed: list[bytes] = []  # queue_index keys written for the first time (their presence)
        workitems: list[tuple[bytes, int]] = []
        for key, _ in values:
            separator = key.index(b"\x00") + 1
            if key.startswith(b"workitem:", separator):
                workitems.append((key, separator))
        index_keys = [key[:separator] + key[separator + 9 :] for key, separator in workitems]
        # their entries read together (one LMDB call, and one for the presence of those not found)
        olds = tables.get_many(txn, b"queue_index", index_keys)
        for (key, separator), index_key, old in zip(workitems, index_keys, olds):
            new = _queue_suffix_for(key[separator + 9 :].decode(), writes[key][1])
            if old == new:
                continue
            if old is not None:
                tables.delete(txn, b"queue", key[:separator] + old)
            if new is None:
                tables.delete(txn, b"queue_index", index_key)
                continue
            queue.append((key[:separator] + new, b""))
            queue_index.append((index_key, new))
            if old is None:
                indexed.append(index_key)
        if queue:
            queue.sort()
            # every key is new (it ends with its WorkItem's ID, whose only entry, the old one, is
            # deleted above): one that exists is another entry's key moved there by damage, which an
            # overwrite would erase, and the queue keeps no presence entries to miss it
            tables.put_many(txn, b"queue", queue, fresh=True)
            tables.put_many(txn, b"queue_index", queue_index, indexed)  # in key order, as ``values``

    def _drain(self, group: str) -> None:
        """Apply buffered Events that have become contiguous; drop one whose chain link fails."""
        head = self._head(group)
        while head.buffered:
            key = _seq_key(group, head.applied_seq + 1)
            data = self._tables.get(self._txn, b"buffer", key)
            if data is None:
                return
            data = bytes(data)
            self._tables.delete(self._txn, b"buffer", key)
            head.buffered -= 1
            self._dirty.add(group)
            try:
                event = decode_event(data)
                self._check_link(event, head.applied_hash)
            except EventInvalid:
                return  # a forged or conflicting buffered Event: dropped; the gap stays open
            self._apply_next(head, event)

    def _prune_inbox(self, group: str) -> int:
        self._flush()
        head = self._head(_check_group(group))
        count = 0
        if head.cursor > head.pruned_seq:
            # checked as a deletion of a Group's entries is: the entries that bound it and each one
            # it deletes (a damaged key that ended the raw walk early made the count short)
            count = self._tables.delete_range(self._txn, b"inbox", _prefix(group), _seq_key(group, head.pruned_seq + 1),
                                              _seq_key(group, head.cursor))
        if head.pruned_seq != head.cursor and head.cursor > head.pruned_seq:
            head.pruned_seq = head.cursor
            self._dirty.add(group)
        return count

    def _clear_group(self, group: str, keep_buffer_after: int | None) -> None:
        _check_group(group)
        self._flush()
        prefix = _prefix(group)
        tables = self._tables
        for name in (b"inbox", b"state", b"queue", b"queue_index", b"projection"):
            tables.delete_range(self._txn, name, prefix)
        head = GroupHead()
        if keep_buffer_after is None:
            tables.delete_range(self._txn, b"buffer", prefix)
        else:
            for key, _ in list(tables.range(self._txn, b"buffer", prefix)):
                if int.from_bytes(key[len(prefix) :], "big") <= keep_buffer_after:
                    tables.delete(self._txn, b"buffer", key)
                else:
                    head.buffered += 1
        self._heads[group] = head
        self._dirty.add(group)

    def _restore_aggregates(self, group: str, aggregates: Iterable[Effect]) -> None:
        prefix = _prefix(group)
        for effect in aggregates:
            self._put_aggregate(prefix, effect.aggregate, effect.revision, effect.state)

    def _get_intent(self, key: str) -> Intent | None:
        return _load_intent(self._tables, self._txn, key)

    def _require_intent(self, key: str) -> Intent:
        intent = self._get_intent(key)
        if intent is None:
            raise InvalidCommand(f"no outbox intent {key}", field="intent_key")
        return intent

    def _put_intent(self, intent: Intent) -> None:
        self._tables.put(self._txn, b"outbox", _prefix(intent.group) + intent.key.encode(), _INTENT_ENCODER.encode(intent))
        self._tables.put(self._txn, b"intent_group", intent.key.encode(), intent.group.encode())

    # offline records (used by ``mwpstore.offline``)

    def _offline_get(self, key: bytes) -> bytes | None:
        value = self._tables.get(self._txn, b"offline", key)
        return None if value is None else bytes(value)

    def _offline_put(self, key: bytes, value: bytes) -> None:
        self._check_usable()
        self._tables.put(self._txn, b"offline", key, value)

    def _offline_delete(self, key: bytes) -> None:
        self._tables.delete(self._txn, b"offline", key)

    def _offline_range(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return [(key, bytes(value)) for key, value in self._tables.range(self._txn, b"offline", prefix)]


def _fully_valid_run(events: list[Any], start: int, group: str, seq: int, prev_hash: bytes) -> int:
    """The end of the run of ``events[start:]`` that pass full validation (``admit_event`` and
    ``check_event`` with the chain link) as ``group``'s Events from ``seq`` on. The first one that
    does not is left where it is: ``apply`` validates it again and raises what it raises.

    ``apply_many`` calls the C version, ``mwpstore._apply_c.check_run``; this is its definition,
    which tests and the fuzz target ``agent_check_run`` compare it with."""
    index = start
    for event in itertools.islice(events, start, None):
        if type(event) is not Event or event.group != group or event.seq != seq:
            break
        try:
            admit_event(event)
            check_event(event, expected_prev_hash=prev_hash)
        except Exception:
            break
        prev_hash = event.hash
        seq += 1
        index += 1
    return index


def _queue_suffix_for(workitem: str, state: dict[str, Any] | None) -> bytes | None:
    """The queue key suffix of a WorkItem that is ready to be claimed, else None."""
    if state is None or state.get("state") != "queued":
        return None
    priority = state.get("priority", 0)
    not_before_ms = state.get("not_before_ms") or 0
    if type(priority) is not int or type(not_before_ms) is not int:
        return None
    if not -_INT64 < priority < _INT64 or not -_INT64 <= not_before_ms < _INT64:
        return None
    return _queue_suffix(workitem, priority, not_before_ms)


def _load_head(tables: _Tables, txn: lmdb.Transaction, group: str) -> GroupHead:
    data = tables.get(txn, b"heads", group.encode())
    return GroupHead() if data is None else _decode_head(group.encode(), data)


def _decode_head(key: bytes, data: bytes) -> GroupHead:
    """A stored Group head, checked: a head that does not decode, or breaks what every head this
    store writes keeps (``floor_seq <= pruned_seq <= cursor <= applied_seq`` from 0 to 2**63 - 1,
    a 32-byte hash, a buffered count from 0), is ``CORRUPTION``. A seal is only a CRC: a head
    written by something else could otherwise report a Cursor beyond what is applied, or reach
    the apply cycle as a foreign error."""
    try:
        head = _HEAD_DECODER.decode(data)
    except DECODE_ERRORS:
        head = None
    if (
        head is None
        or not 0 <= head.floor_seq <= head.pruned_seq <= head.cursor <= head.applied_seq <= limits.INT_ABS_MAX
        or len(head.applied_hash) != len(ZERO_HASH)
        or head.buffered < 0
    ):
        raise Corruption(
            f"the agent store holds an impossible head for group {bytes(key[:KEY_SHOWN_BYTES])!r}; {_Tables.remedy}",
            reason="agent",
            database="heads",
        )
    return head


def _load_intent(tables: _Tables, txn: lmdb.Transaction, key: str) -> Intent | None:
    if type(key) is not str or not 0 < len(key) <= limits.ID_CHARS_MAX or not key.isascii():
        # keys are hex (work_keys): anything else names no intent, and a lone surrogate would not encode
        raise InvalidCommand("an intent key is a non-empty ASCII string", field="intent_key")
    group = tables.get(txn, b"intent_group", key.encode())
    if group is None:
        return None
    data = tables.get(txn, b"outbox", bytes(group) + b"\x00" + key.encode())
    if data is None:  # the outbox and its key map are written together: one without the other is damage
        raise Corruption(f"the agent store's outbox lost intent {key!r}; {tables.remedy}", reason="agent_missing", database="outbox")
    try:  # checked here, not by the callers' decorators: the outbox's transactions read it too
        intent = _INTENT_DECODER.decode(data)
    except DECODE_ERRORS:
        intent = None
    if intent is None or intent.key != key or intent.group.encode() != bytes(group):
        raise Corruption(f"the agent store holds an impossible outbox intent {key!r}; {tables.remedy}", reason="agent", database="outbox")
    return intent


__all__ = [
    "AgentStore",
    "AgentTransaction",
    "ApplyStatus",
    "GroupHead",
    "Intent",
    "IntentState",
    "Projection",
    "ProjectionFailed",
    "ProjectionView",
    "QueueEntry",
    "ReconcileRequired",
    "admit_event",
]
