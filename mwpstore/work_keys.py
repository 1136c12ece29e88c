"""Stable keys for work that leaves the Group: external idempotency keys and attempt keys.

Network delivery cannot give exactly-once external effects, so every tool operation carries a key
that names the logical operation, not the try: a receiver that has seen the key already did the
work (MWP-WRK-031). A key is a domain-separated blake3 hash over length-prefixed parts, so no two
different tuples of parts can produce the same hashed bytes (``("a", "bc")`` and ``("ab", "c")``
differ), and keys of different purposes never collide.

    external_idempotency_key(mission, workitem, ownership_epoch, operation)   MWP-WRK-031
    attempt_key(mission, workitem, attempt)                                    MWP-WRK-018

Both are pure: the same inputs always give the same 64-hex-character key, on any machine.
"""

from __future__ import annotations

import blake3

from . import limits
from .errors import InvalidCommand

DOMAIN_EXTERNAL_IDEMPOTENCY = b"mwpstore/external-idempotency/v1\x00"
DOMAIN_ATTEMPT = b"mwpstore/attempt/v1\x00"
DOMAIN_LEASE = b"mwpstore/lease/v1\x00"

LEASE_ID_BYTES = 16
"""A lease id is the first 16 bytes of its hash (32 hex characters): unique enough within a Group."""


def _text_part(value: object, field: str) -> bytes:
    if type(value) is not str or not value:
        raise InvalidCommand(f"{field} must be a non-empty string", field=field)
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 spelling, so no stable key
        raise InvalidCommand(f"{field} must be text UTF-8 can encode (no lone surrogate)", field=field) from None
    return len(data).to_bytes(8, "big") + data


def _count_part(value: object, field: str) -> bytes:
    if type(value) is not int or not 0 <= value <= limits.INT_ABS_MAX:
        raise InvalidCommand(f"{field} must be a non-negative 64-bit integer", field=field)
    return (8).to_bytes(8, "big") + value.to_bytes(8, "big")


def external_idempotency_key(mission_id: str, workitem_id: str, ownership_epoch: int, operation_id: str) -> str:
    """The idempotency key a tool operation carries to the outside world (MWP-WRK-031).

    Derived from Mission ID, WorkItem ID, Ownership Epoch and the logical operation id: a retry
    of the same operation by the same owner reuses the key; a new owner (higher epoch) gets a new
    one, so the receiver can tell a takeover's fresh attempt from a duplicate.
    """
    return blake3.blake3(
        DOMAIN_EXTERNAL_IDEMPOTENCY
        + _text_part(mission_id, "mission_id")
        + _text_part(workitem_id, "workitem_id")
        + _count_part(ownership_epoch, "ownership_epoch")
        + _text_part(operation_id, "operation_id")
    ).hexdigest()


def attempt_key(mission_id: str, workitem_id: str, attempt: int) -> str:
    """The stable key of one attempt at a WorkItem (MWP-WRK-018): same attempt, same key."""
    return blake3.blake3(
        DOMAIN_ATTEMPT
        + _text_part(mission_id, "mission_id")
        + _text_part(workitem_id, "workitem_id")
        + _count_part(attempt, "attempt")
    ).hexdigest()


def lease_id_for(group_id: str, workitem_id: str, ownership_epoch: int) -> str:
    """The stable id of the Execution Lease granted to ``workitem_id`` at ``ownership_epoch``.

    One ownership epoch has exactly one lease, so the id needs no randomness: anyone holding the
    WorkItem's state can recompute it, and a Command can be checked for naming an id and an epoch
    that do not belong together.
    """
    return (
        blake3.blake3(
            DOMAIN_LEASE
            + _text_part(group_id, "group_id")
            + _text_part(workitem_id, "workitem_id")
            + _count_part(ownership_epoch, "ownership_epoch")
        )
        .digest()[:LEASE_ID_BYTES]
        .hex()
    )
