"""Typed errors: one base class with a stable ``code`` and a message that says what to do.

Every error that leaves the public API is an ``MwpError``. Foreign errors (lmdb, msgspec,
cryptography, OSError) are translated in one place, :func:`translate`, so callers never have to
catch a library's exception types.
"""

from __future__ import annotations

import errno
from typing import Any


class MwpError(Exception):
    """Base class. ``code`` is stable across versions; ``detail`` carries structured facts."""

    code: str = "MWP_ERROR"

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = detail

    def __reduce__(self) -> tuple[Any, ...]:
        if self.code != type(self).code:  # a code error_from_code did not know: kept on the instance
            return (error_from_code, (self.code, self.message, self.detail))
        return (_rebuild_error, (type(self), self.message, self.detail))

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "detail": self.detail}


def _rebuild_error(cls: type[MwpError], message: str, detail: dict[str, Any]) -> MwpError:
    """An error of ``cls`` with exactly this message and detail, whatever the detail's keys (one
    named ``message`` or ``self`` cannot pass through ``__init__``'s keyword arguments)."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.message = message
    error.detail = dict(detail)
    return error


# -- Command rejections (the Command changed nothing) -------------------------------------------


class Rejection(MwpError):
    """A Command was refused by a rule; nothing was appended or changed."""

    code = "REJECTED"


class ActionIdCollision(Rejection):
    code = "ACTION_ID_COLLISION"


class RevisionMismatch(Rejection):
    code = "REVISION_MISMATCH"

    @property
    def current_revision(self) -> int:
        return int(self.detail["current_revision"])


class InvalidCommand(Rejection):
    code = "INVALID_COMMAND"

    @property
    def field(self) -> str:
        return str(self.detail.get("field", ""))


class LimitExceeded(InvalidCommand):
    code = "LIMIT_EXCEEDED"


class UnknownKind(InvalidCommand):
    code = "UNKNOWN_KIND"


class NotFound(Rejection):
    code = "NOT_FOUND"


class AlreadyExists(Rejection):
    code = "ALREADY_EXISTS"


class InvalidState(Rejection):
    """The aggregate is not in a state that allows this transition."""

    code = "INVALID_STATE"


class NotAMember(Rejection):
    code = "NOT_A_MEMBER"


class Unauthorized(Rejection):
    code = "UNAUTHORIZED"


class SignatureInvalid(Rejection):
    code = "SIGNATURE_INVALID"


class GroupArchived(Rejection):
    code = "GROUP_ARCHIVED"


class LeaseMismatch(Rejection):
    code = "LEASE_MISMATCH"


class StaleOwnershipEpoch(Rejection):
    code = "STALE_OWNERSHIP_EPOCH"


class StaleSessionEpoch(Rejection):
    code = "STALE_SESSION_EPOCH"


class LeaseExpired(Rejection):
    code = "LEASE_EXPIRED"


class ApprovalRequired(Rejection):
    code = "APPROVAL_REQUIRED"


class BudgetExceeded(Rejection):
    code = "BUDGET_EXCEEDED"


class AttemptsExhausted(Rejection):
    code = "ATTEMPTS_EXHAUSTED"


class DeadlinePassed(Rejection):
    code = "DEADLINE_PASSED"


class NotReady(Rejection):
    """The WorkItem is queued but its not-before time has not come."""

    code = "NOT_READY"


# -- Replay and delivery -----------------------------------------------------------------------


class CursorTooOld(MwpError):
    """The Cursor is below the Group's replay floor; restore from ``snapshot_ref`` first."""

    code = "CURSOR_TOO_OLD"

    @property
    def snapshot_ref(self) -> Any:
        return self.detail.get("snapshot_ref")


class SequenceGap(MwpError):
    code = "SEQUENCE_GAP"


class EventInvalid(MwpError):
    """A delivered Event failed validation (shape, IDs, hash chain)."""

    code = "EVENT_INVALID"


class SnapshotInvalid(MwpError):
    """A snapshot failed verification; ``check`` names the failed check."""

    code = "SNAPSHOT_INVALID"

    @property
    def check(self) -> str:
        return str(self.detail.get("check", ""))


class ArchiveInvalid(MwpError):
    code = "ARCHIVE_INVALID"


# -- The agent side -------------------------------------------------------------------------------


class ReconcileRequired(MwpError):
    """An outbox intent's outcome is uncertain: reconcile it (a lookup) before any retry."""

    code = "RECONCILE_REQUIRED"


class ProjectionFailed(MwpError):
    """An application projection raised while applying an Event; the local transaction aborted."""

    code = "PROJECTION_FAILED"


class OfflineRefused(MwpError):
    """The offline guard refused an operation; ``reason`` says which rule (MWP-WRK-020)."""

    code = "OFFLINE_REFUSED"


class TransportDisconnected(MwpError):
    """The connection to the Group service dropped; reconnect and resume from the durable Cursor."""

    code = "TRANSPORT_DISCONNECTED"


# -- Storage ------------------------------------------------------------------------------------


class Corruption(MwpError):
    """Damage found on disk that is not a torn, never-acknowledged tail. Nothing was truncated."""

    code = "CORRUPTION"


class StorageFailed(MwpError):
    """An I/O error (e.g. a failed fsync). The handle refuses writes; reopen to recover."""

    code = "STORAGE_FAILED"


class KeyFileInvalid(StorageFailed):
    """A key file exists but cannot be trusted (permissions, owner, type or size); it was not used.

    Fix the file (``chmod 600``, restore it from a backup) or move it away to have a new key generated.
    """

    code = "KEY_FILE_INVALID"


class StoreLocked(MwpError):
    code = "STORE_LOCKED"


class StoreClosed(MwpError):
    code = "STORE_CLOSED"


class StoreNotFound(MwpError):
    """``open(..., create=False)`` found no store at the path; nothing was created there."""

    code = "STORE_NOT_FOUND"


ERROR_CLASSES: dict[str, type[MwpError]] = {
    cls.code: cls
    for cls in [
        MwpError,
        Rejection,
        ActionIdCollision,
        RevisionMismatch,
        InvalidCommand,
        LimitExceeded,
        UnknownKind,
        NotFound,
        AlreadyExists,
        InvalidState,
        NotAMember,
        Unauthorized,
        SignatureInvalid,
        GroupArchived,
        LeaseMismatch,
        StaleOwnershipEpoch,
        StaleSessionEpoch,
        LeaseExpired,
        ApprovalRequired,
        BudgetExceeded,
        AttemptsExhausted,
        DeadlinePassed,
        NotReady,
        CursorTooOld,
        SequenceGap,
        EventInvalid,
        SnapshotInvalid,
        ArchiveInvalid,
        ReconcileRequired,
        ProjectionFailed,
        OfflineRefused,
        TransportDisconnected,
        Corruption,
        StorageFailed,
        KeyFileInvalid,
        StoreLocked,
        StoreClosed,
        StoreNotFound,
    ]
}


def error_from_code(code: str, message: str, detail: dict[str, Any] | None = None) -> MwpError:
    """Rebuild a typed error from its stable code (e.g. from an ``AcceptResult``). ``detail`` may
    hold any text keys. ``InvalidCommand`` (``field`` ``code``, ``message`` or ``detail``) when the
    parts cannot make an error: a code or message that is not a str, a detail that is not a
    mapping with str keys."""
    if type(code) is not str:
        raise InvalidCommand("an error code is a str", field="code")
    if type(message) is not str:
        raise InvalidCommand("an error message is a str", field="message")
    if detail is None:
        detail = {}
    if not isinstance(detail, dict):
        raise InvalidCommand("an error's detail is a dict with str keys", field="detail")
    try:
        # a plain copy, checked and used: a dict subclass's keys() or __iter__ may name keys its
        # items do not hold (a KeyError from here), or change between the check and the use
        detail = dict(detail)
    except Exception:
        raise InvalidCommand("an error's detail is a dict with str keys that can be read", field="detail") from None
    if not all(type(key) is str for key in detail):
        raise InvalidCommand("an error's detail is a dict with str keys", field="detail")
    cls = ERROR_CLASSES.get(code, MwpError)
    error = _rebuild_error(cls, message, detail)
    if cls is MwpError:
        error.code = code
    return error


LMDB_FILE_DAMAGE = ("CorruptedError", "PageNotFoundError", "InvalidError", "CursorFullError", "PageFullError")
"""The LMDB binding's errors (by name: this module imports no lmdb at load) that only a damaged file
gives, which :func:`translate` makes ``CORRUPTION``. ``CursorFullError``: a search that never
reached a leaf (a cycle of damaged branch pages); ``PageFullError``: a node that did not fit a page
LMDB sized itself. ``_sealed.LMDB_DAMAGE_ERRORS`` adds the errors damage gives inside a write."""


def translate(exc: BaseException, *, context: str = "") -> MwpError:
    """Translate a foreign exception into an ``MwpError``. The one place that knows foreign types."""
    if isinstance(exc, MwpError):
        return exc
    where = f" ({context})" if context else ""
    import lmdb  # local import: this module must stay importable without the environment
    import msgspec

    from . import limits

    if isinstance(exc, tuple(getattr(lmdb, name) for name in LMDB_FILE_DAMAGE)):
        return Corruption(
            f"the LMDB index is damaged{where}: {exc}. Run `mwpstore rebuild` to regenerate it from the log.",
            reason=type(exc).__name__,
        )
    if isinstance(exc, lmdb.ReadersFullError):  # no damage: as many reads as it has slots, now
        return StorageFailed(
            f"all {limits.LMDB_READERS_MAX} reader slots of the LMDB environment are taken{where} "
            "(limits.LMDB_READERS_MAX reads at once: this process's, and for an authority's index "
            "those of other processes' read-only views too); retry when fewer run.",
            reason="readers_full",
            limit=limits.LMDB_READERS_MAX,
        )
    if isinstance(exc, lmdb.MapFullError):
        return LimitExceeded(f"the LMDB map is full{where}; reopen with a larger map size.", field="map_size")
    if isinstance(exc, lmdb.Error):
        return StorageFailed(f"LMDB failed{where}: {exc}", reason=type(exc).__name__)
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        return Corruption(f"undecodable bytes{where}: {exc}", reason="decode")
    if isinstance(exc, msgspec.EncodeError):
        return InvalidCommand(f"content cannot be encoded{where}: {exc}", field="body")
    try:
        from cryptography.exceptions import InvalidSignature, InvalidTag
    except ImportError:  # pragma: no cover - cryptography is a hard dependency
        InvalidSignature = InvalidTag = ()  # type: ignore[assignment,misc]
    if isinstance(exc, InvalidSignature):
        return SignatureInvalid(f"signature does not verify{where}")
    if isinstance(exc, InvalidTag):
        return ArchiveInvalid(f"authenticated decryption failed{where}", check="tag")
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFailed(f"no space left on device{where}: {exc}", errno=exc.errno)
        return StorageFailed(f"I/O error{where}: {exc}", errno=exc.errno)
    return MwpError(f"unexpected error{where}: {type(exc).__name__}: {exc}", reason=type(exc).__name__)


__all__ = [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, MwpError)] + [
    "ERROR_CLASSES",
    "error_from_code",
    "translate",
]
