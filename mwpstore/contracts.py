"""The Work Contract: the budgets a WorkItem runs within, and the retry backoff it implies.

A contract is stored inside the WorkItem's state as a plain dict (see ``docs/work-model.md``)::

    max_attempts        int >= 1      claims allowed in total (each claim is one attempt)
    backoff_initial_ms  int >= 0      delay before the retry after the first failed attempt
    backoff_multiplier  int >= 1, or [numerator, denominator] with numerator >= denominator >= 1
    backoff_max_ms      int >= backoff_initial_ms
    cost_limit          int >= 1      cost units the WorkItem may spend in total
    deadline_ms         int or None   no claim at or after this time; None: no deadline
    lease_ms            int >= 1      a lease expires this long after its grant or last renewal
    start_ms            int >= 1      a lease must be started this long after its grant

The four durations (``*_ms`` but the absolute ``deadline_ms``) are at most
``limits.WORK_DURATION_MS_MAX`` (100 years), so a time derived from one (acceptance time plus
duration) fits the 64-bit range of Event content.

Times and money are integers (milliseconds, cost units): no floats, so every replica computes the
same backoff to the millisecond. A rational multiplier is stored reduced, as an int when whole.
"""

from __future__ import annotations

from math import gcd
from typing import Any

from . import limits
from .errors import InvalidCommand

MAX_ATTEMPTS_MAX = limits.WORK_ATTEMPTS_MAX
"""Bound on ``max_attempts`` (it also bounds the exponent in :func:`backoff_ms`)."""

BACKOFF_MULTIPLIER_TERM_MAX = limits.BACKOFF_MULTIPLIER_TERM_MAX
"""Bound on a multiplier's integer or on each term of its rational form."""

DURATION_MS_MAX = limits.WORK_DURATION_MS_MAX
"""Bound on ``lease_ms``, ``start_ms``, ``backoff_initial_ms`` and ``backoff_max_ms``."""

CONTRACT_FIELDS = (
    "max_attempts",
    "backoff_initial_ms",
    "backoff_multiplier",
    "backoff_max_ms",
    "cost_limit",
    "deadline_ms",
    "lease_ms",
    "start_ms",
)


def _field_int(contract: dict[str, Any], name: str, minimum: int, maximum: int = limits.INT_ABS_MAX) -> int:
    value = contract.get(name)
    if type(value) is not int or not minimum <= value <= maximum:
        raise InvalidCommand(
            f"body.contract.{name} must be an integer in [{minimum}, {maximum}]", field=f"body.contract.{name}"
        )
    return value


def _multiplier(value: object) -> int | list[int]:
    field = "body.contract.backoff_multiplier"
    if type(value) is int:
        if not 1 <= value <= BACKOFF_MULTIPLIER_TERM_MAX:
            raise InvalidCommand(f"{field} must be an integer in [1, {BACKOFF_MULTIPLIER_TERM_MAX}]", field=field)
        return value
    if (
        type(value) is list
        and len(value) == 2
        and all(type(term) is int and 1 <= term <= BACKOFF_MULTIPLIER_TERM_MAX for term in value)
        and value[0] >= value[1]
    ):
        divisor = gcd(value[0], value[1])
        numerator, denominator = value[0] // divisor, value[1] // divisor
        return numerator if denominator == 1 else [numerator, denominator]
    raise InvalidCommand(
        f"{field} must be an integer >= 1 or [numerator, denominator] with numerator >= denominator >= 1 "
        "(a multiplier below 1 would shrink the backoff; floats are not allowed)",
        field=field,
    )


def parse_contract(value: object) -> dict[str, Any]:
    """Validate a Work Contract from a Command body; return its normalized form or raise."""
    if type(value) is not dict:
        raise InvalidCommand("body.contract must be a dict holding the Work Contract", field="body.contract")
    unknown = sorted(set(value) - set(CONTRACT_FIELDS))
    if unknown:
        raise InvalidCommand(f"body.contract.{unknown[0]} is not a Work Contract field", field=f"body.contract.{unknown[0]}")
    contract: dict[str, Any] = {
        "max_attempts": _field_int(value, "max_attempts", 1, MAX_ATTEMPTS_MAX),
        "backoff_initial_ms": _field_int(value, "backoff_initial_ms", 0, DURATION_MS_MAX),
        "backoff_multiplier": _multiplier(value.get("backoff_multiplier")),
        "backoff_max_ms": 0,
        "cost_limit": _field_int(value, "cost_limit", 1),
        "deadline_ms": None,
        "lease_ms": _field_int(value, "lease_ms", 1, DURATION_MS_MAX),
        "start_ms": _field_int(value, "start_ms", 1, DURATION_MS_MAX),
    }
    contract["backoff_max_ms"] = _field_int(value, "backoff_max_ms", contract["backoff_initial_ms"], DURATION_MS_MAX)
    if value.get("deadline_ms") is not None:
        contract["deadline_ms"] = _field_int(value, "deadline_ms", 0)
    return contract


def backoff_ms(contract: dict[str, Any], attempt: int) -> int:
    """The delay before the next try after attempt number ``attempt`` (1-based) failed.

    ``backoff_initial_ms * multiplier ** (attempt - 1)``, rounded down, capped at
    ``backoff_max_ms``. Exact integer arithmetic: the same contract and attempt give the same
    delay everywhere.
    """
    if type(attempt) is not int or attempt < 1:
        raise InvalidCommand(f"attempt must be an integer >= 1, not {attempt!r}", field="attempt")
    initial = contract["backoff_initial_ms"]
    ceiling = contract["backoff_max_ms"]
    multiplier = contract["backoff_multiplier"]
    numerator, denominator = (multiplier, 1) if type(multiplier) is int else (multiplier[0], multiplier[1])
    if initial == 0:
        return 0
    if numerator == denominator:
        return min(initial, ceiling)
    # initial * (n/d)**k >= ceiling  <=>  initial * n**k >= ceiling * d**k; stop as soon as it holds,
    # so the integers stay small even for large attempts.
    grown, shrunk = initial, 1
    for _ in range(attempt - 1):
        grown *= numerator
        shrunk *= denominator
        if grown >= ceiling * shrunk:
            return ceiling
    return min(grown // shrunk, ceiling)
