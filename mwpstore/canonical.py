"""Canonical bytes, content hashes and ID checks.

The bytes that are hashed or signed always come from this module. Canonical content is JSON
produced by one module-level msgspec encoder with sorted keys; before encoding, the content is
walked once to enforce the rules that JSON alone would not: string keys only, no NaN or Infinity,
integers within 64 bits, bounded depth, item count and size. See ``docs/format/canonical.md``.

The walk that accepts is done in C (``csrc/canonical_check.c``: yes or no, never an error); only
when it says no does the Python walk here run, to raise the typed error naming the field.
``_content_ok`` is the Python statement of the C check, kept as the reference the tests compare it to.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import blake3
import msgspec

from . import _canonical_c, limits
from .errors import InvalidCommand, LimitExceeded

_ENCODER = msgspec.json.Encoder(order="sorted")

# IDs are bounded, printable ASCII from a small alphabet, and never usable as a path: no '/',
# no '\\', no ':', not starting with '.', so "../x" or "." can never name a file or directory.
_ID_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]*\Z")
_KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*\Z")

DOMAIN_COMMAND = b"mwpstore/command/v1\x00"
DOMAIN_PAYLOAD = b"mwpstore/payload/v1\x00"
DOMAIN_EVENT = b"mwpstore/event/v1\x00"


# Yes/no, never raising: True exactly when check_id, check_kind, check_content accept the value.
id_ok = _canonical_c.id_ok
kind_ok = _canonical_c.kind_ok
content_ok = _canonical_c.content_ok


def check_time_ms(value: object, field: str) -> int:
    """Return ``value`` if it is milliseconds since the epoch as an ``int`` in
    0..``limits.TIME_MS_MAX``, else raise ``InvalidCommand`` naming ``field`` (a float from
    ``time.time() * 1000`` is refused here, before it can reach a stored Event)."""
    if type(value) is int and 0 <= value <= limits.TIME_MS_MAX:
        return value
    raise InvalidCommand(
        f"{field} must be an int of milliseconds in 0..{limits.TIME_MS_MAX}, not {type(value).__name__} {value!r}"[:300],
        field=field,
    )


def clock_reading(clock: Callable[[], object]) -> int:
    """Read an injected clock: its value checked by :func:`check_time_ms`, and a clock that
    raises an ``InvalidCommand`` (``field`` ``clock``) too, before anything is written with it."""
    try:
        reading = clock()
    except Exception as exc:
        raise InvalidCommand(f"the clock raised {type(exc).__name__}: {exc}"[:300], field="clock") from None
    return check_time_ms(reading, "clock")


def check_aggregate_key(value: object, field: str, *, empty: bool = False) -> str:
    """Return ``value`` if it can be an aggregate key (``"workitem:wi-3"``: a printable str of at
    most a kind's and an ID's length), or a prefix of one when ``empty``; else ``InvalidCommand``."""
    most = limits.AGGREGATE_CHARS_MAX
    if type(value) is not str or (not value and not empty) or len(value) > most or not value.isprintable():
        raise InvalidCommand(f"{field} must be a printable str of at most {most} characters", field=field)
    return value


def check_id(value: object, field: str) -> str:
    """Return ``value`` if it is a valid ID, else raise ``InvalidCommand`` naming ``field``."""
    if id_ok(value):
        return value  # type: ignore[return-value]
    if type(value) is not str:
        raise InvalidCommand(f"{field} must be a string ID", field=field)
    if not value or len(value) > limits.ID_CHARS_MAX:
        raise InvalidCommand(
            f"{field} must be 1..{limits.ID_CHARS_MAX} characters", field=field, length=len(value)
        )
    if _ID_PATTERN.match(value) is None:
        raise InvalidCommand(
            f"{field} may hold only letters, digits and _ . @ + = - and must not start with '.' or '-'",
            field=field,
        )
    return value


def check_kind(value: object, field: str = "kind") -> str:
    if kind_ok(value):
        return value  # type: ignore[return-value]
    if type(value) is not str or not value or len(value) > limits.KIND_CHARS_MAX:
        raise InvalidCommand(f"{field} must be a short dotted name like 'workitem.claim'", field=field)
    if _KIND_PATTERN.match(value) is None:
        raise InvalidCommand(f"{field} must be a dotted lowercase name like 'workitem.claim'", field=field)
    return value


def check_content(value: Any, field: str = "body") -> None:
    """Enforce the canonical-content rules on a JSON-like value (dict/list/str/int/float/bool/None)."""
    if content_ok(value):
        return
    # Slow path, only to name the offending field precisely in the error.
    _check_value(value, field, 0, [limits.BODY_ITEMS_MAX])
    raise AssertionError("content rejected by the fast check but accepted by the precise one")  # pragma: no cover


def _content_ok(value: Any, depth: int, budget: list[int]) -> bool:
    """The fast check in Python, the reference for ``_canonical_c.content_ok``: True when every
    rule holds (no field names are built on this path)."""
    if depth > limits.BODY_DEPTH_MAX:
        return False
    budget[0] -= 1
    if budget[0] < 0:
        return False
    kind = type(value)
    if kind is str:
        return _string_ok(value)
    if kind is int:
        return -limits.INT_ABS_MAX <= value <= limits.INT_ABS_MAX
    if kind is bool or value is None:
        return True
    if kind is dict:
        if value and depth >= limits.BODY_DEPTH_MAX:
            return False  # its items would lie deeper than the bound
        for key, item in value.items():
            if type(key) is not str or not _string_ok(key):
                return False
            item_kind = type(item)
            if item_kind is str:
                budget[0] -= 1
                if not _string_ok(item):
                    return False
            elif item_kind is int and item_kind is not bool:
                budget[0] -= 1
                if not -limits.INT_ABS_MAX <= item <= limits.INT_ABS_MAX:
                    return False
            elif not _content_ok(item, depth + 1, budget):
                return False
        return budget[0] >= 0
    if kind is list or kind is tuple:
        for item in value:
            if not _content_ok(item, depth + 1, budget):
                return False
        return True
    if kind is float:
        return math.isfinite(value)
    return False


def _string_ok(value: str) -> bool:
    """At most ``STRING_BYTES_MAX`` code points, and encodable as UTF-8 (no lone surrogate)."""
    if len(value) > limits.STRING_BYTES_MAX:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_value(value: Any, field: str, depth: int, budget: list[int]) -> None:
    if depth > limits.BODY_DEPTH_MAX:
        raise LimitExceeded(f"{field} nests deeper than {limits.BODY_DEPTH_MAX}", field=field)
    budget[0] -= 1
    if budget[0] < 0:
        raise LimitExceeded(f"{field} holds more than {limits.BODY_ITEMS_MAX} items", field=field)
    kind = type(value)
    if kind is str:
        if len(value) > limits.STRING_BYTES_MAX:
            raise LimitExceeded(f"a string in {field} is too long", field=field)
        if not _string_ok(value):
            raise InvalidCommand(f"a string in {field} holds a lone surrogate, which UTF-8 cannot encode", field=field)
        return
    if kind is bool or value is None:
        return
    if kind is int:
        if not -limits.INT_ABS_MAX <= value <= limits.INT_ABS_MAX:
            raise InvalidCommand(f"an integer in {field} does not fit in 64 bits", field=field)
        return
    if kind is float:
        if not math.isfinite(value):
            raise InvalidCommand(f"{field} holds NaN or Infinity, which have no canonical form", field=field)
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidCommand(f"{field} has a non-string key {key!r}", field=field)
            if not _string_ok(key):
                raise InvalidCommand(f"{field} has a key that is too long or not encodable as UTF-8", field=field)
            _check_value(item, f"{field}.{key}" if depth < 4 else field, depth + 1, budget)
        return
    if kind is list or kind is tuple:
        for item in value:
            _check_value(item, field, depth + 1, budget)
        return
    raise InvalidCommand(f"{field} holds a {kind.__name__}, which is not JSON-like content", field=field)


canonical_bytes: Callable[[Any], bytes] = _ENCODER.encode
"""The canonical bytes of already-checked JSON-like content (sorted keys, compact): the
encoder's own method, so that it costs no Python frame (and C can call it directly)."""


_COPY_DECODER = msgspec.json.Decoder()


def content_copy(value: Any, field: str) -> Any:
    """``value`` checked as content (:func:`check_content`) and copied: decoded from its canonical
    bytes, so that what is stored is what was checked. The caller's dict may still change while
    the call runs (another thread, or a clock the call reads), and a set or an unbounded int put
    in after the check reached the encoder. ``InvalidCommand`` naming ``field`` if the value
    changed into something that is not content between the check and the copy."""
    check_content(value, field)
    try:
        copy = _COPY_DECODER.decode(canonical_bytes(value))
    except Exception:
        raise InvalidCommand(f"{field} changed while it was read: it is no JSON-like content now", field=field) from None
    check_content(copy, field)
    return copy


def content_hash(data: bytes) -> bytes:
    return blake3.blake3(DOMAIN_COMMAND + data).digest()


def payload_hash(data: bytes) -> bytes:
    return blake3.blake3(DOMAIN_PAYLOAD + data).digest()


def hash_bytes(*parts: bytes) -> bytes:
    """blake3 of the parts one after the other (the same digest as hashing them joined)."""
    return blake3.blake3(b"".join(parts)).digest()
