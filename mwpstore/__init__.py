"""mwpstore: an embedded, single-node storage engine for the Mission Work Protocol.

The public names are re-exported here; everything else is private by default.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ActionIdCollision,
    AlreadyExists,
    ApprovalRequired,
    ArchiveInvalid,
    AttemptsExhausted,
    BudgetExceeded,
    Corruption,
    CursorTooOld,
    DeadlinePassed,
    EventInvalid,
    GroupArchived,
    InvalidCommand,
    InvalidState,
    KeyFileInvalid,
    LeaseExpired,
    LeaseMismatch,
    LimitExceeded,
    MwpError,
    NotAMember,
    NotFound,
    NotReady,
    OfflineRefused,
    ProjectionFailed,
    ReconcileRequired,
    Rejection,
    RevisionMismatch,
    SequenceGap,
    SignatureInvalid,
    SnapshotInvalid,
    StaleOwnershipEpoch,
    StaleSessionEpoch,
    StorageFailed,
    StoreClosed,
    StoreLocked,
    StoreNotFound,
    TransportDisconnected,
    Unauthorized,
    UnknownKind,
)
from .messages import AcceptResult, Command, Effect, Event, Receipt

from .registry import MemoryGroup
from .work_keys import attempt_key, external_idempotency_key

if TYPE_CHECKING:
    from .agent_store import AgentStore, ApplyStatus
    from .authority import ArchiveRecord, Authority, OpenReport, Subscription, VerifyReport
    from .compaction import CompactionReport
    from .delivery import Delivery, FaultyTransport
    from .offline import OfflineGuard
    from .snapshot import Keyring, SigningKey, SnapshotRef, VerifiedSnapshot, verify_snapshot

# Storage classes load on first use, so that the pure parts (messages, rules) import without the
# compiled segment log.
_LAZY = {
    "AgentStore": "agent_store",
    "ApplyStatus": "agent_store",
    "ArchiveRecord": "authority",
    "Authority": "authority",
    "CompactionReport": "compaction",
    "Delivery": "delivery",
    "FaultyTransport": "delivery",
    "OfflineGuard": "offline",
    "Keyring": "snapshot",
    "OpenReport": "authority",
    "SigningKey": "snapshot",
    "SnapshotRef": "snapshot",
    "Subscription": "authority",
    "VerifiedSnapshot": "snapshot",
    "VerifyReport": "authority",
    "verify_snapshot": "snapshot",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mwpstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AcceptResult",
    "ActionIdCollision",
    "AgentStore",
    "AlreadyExists",
    "ApplyStatus",
    "ApprovalRequired",
    "ArchiveInvalid",
    "ArchiveRecord",
    "AttemptsExhausted",
    "Authority",
    "BudgetExceeded",
    "Command",
    "CompactionReport",
    "Corruption",
    "CursorTooOld",
    "DeadlinePassed",
    "Delivery",
    "Effect",
    "Event",
    "EventInvalid",
    "FaultyTransport",
    "GroupArchived",
    "InvalidCommand",
    "InvalidState",
    "KeyFileInvalid",
    "Keyring",
    "LeaseExpired",
    "LeaseMismatch",
    "LimitExceeded",
    "MemoryGroup",
    "MwpError",
    "NotAMember",
    "NotFound",
    "NotReady",
    "OfflineGuard",
    "OfflineRefused",
    "OpenReport",
    "ProjectionFailed",
    "Receipt",
    "ReconcileRequired",
    "Rejection",
    "RevisionMismatch",
    "SequenceGap",
    "SignatureInvalid",
    "SigningKey",
    "SnapshotInvalid",
    "SnapshotRef",
    "StaleOwnershipEpoch",
    "StaleSessionEpoch",
    "StorageFailed",
    "StoreClosed",
    "StoreLocked",
    "StoreNotFound",
    "Subscription",
    "TransportDisconnected",
    "Unauthorized",
    "UnknownKind",
    "VerifiedSnapshot",
    "VerifyReport",
    "__version__",
    "attempt_key",
    "external_idempotency_key",
    "verify_snapshot",
]
