"""mwpstore: an embedded, single-node storage engine for the Mission Work Protocol.

The public names are re-exported here; everything else is private by default.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ActionIdCollision,
    ApprovalRequired,
    AttemptsExhausted,
    BudgetExceeded,
    Corruption,
    CursorTooOld,
    DeadlinePassed,
    EventInvalid,
    GroupArchived,
    InvalidCommand,
    LeaseExpired,
    LeaseMismatch,
    LimitExceeded,
    MwpError,
    NotAMember,
    Rejection,
    RevisionMismatch,
    SequenceGap,
    SnapshotInvalid,
    StaleOwnershipEpoch,
    StorageFailed,
    StoreClosed,
    StoreLocked,
    Unauthorized,
)
from .messages import AcceptResult, Command, Effect, Event, Receipt

if TYPE_CHECKING:
    from .authority import Authority, OpenReport, Subscription, VerifyReport

# Storage classes load on first use, so that the pure parts (messages, rules) import without the
# compiled segment log.
_LAZY = {
    "Authority": "authority",
    "OpenReport": "authority",
    "Subscription": "authority",
    "VerifyReport": "authority",
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
    "ApprovalRequired",
    "AttemptsExhausted",
    "Authority",
    "BudgetExceeded",
    "Command",
    "Corruption",
    "CursorTooOld",
    "DeadlinePassed",
    "Effect",
    "Event",
    "EventInvalid",
    "GroupArchived",
    "InvalidCommand",
    "LeaseExpired",
    "LeaseMismatch",
    "LimitExceeded",
    "MwpError",
    "NotAMember",
    "OpenReport",
    "Receipt",
    "Rejection",
    "RevisionMismatch",
    "SequenceGap",
    "SnapshotInvalid",
    "StaleOwnershipEpoch",
    "StorageFailed",
    "StoreClosed",
    "StoreLocked",
    "Subscription",
    "Unauthorized",
    "VerifyReport",
    "__version__",
]
