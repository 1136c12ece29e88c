"""The protocol's messages: Command (in), Event (the accepted fact), Receipt (the answer).

An Event is stored in the segment log as one record (``encode_event``) and is the unit of replay
and delivery. It carries its ``effects``: the new state of every aggregate the transition changed,
so redo, rebuild and agent-side mirrors apply state without re-running the rules (see
``docs/design-decisions.md``). The per-Group hash chain commits to the previous Event's hash, to the
header fields, to the effects and to the payload's hash (not the payload), so a redacted Event
(payload removed, ``body`` None) still verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import blake3
import msgspec

from . import canonical, limits
from .errors import Corruption, EventInvalid, InvalidCommand, LimitExceeded, MwpError, error_from_code

HASH_BYTES = 32
ZERO_HASH = b"\x00" * HASH_BYTES

# The C yes/no checks; on no, the canonical.check_* functions raise the typed error.
_id_ok = canonical.id_ok
_kind_ok = canonical.kind_ok
_content_ok = canonical.content_ok


class Command(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request to change one Group. ``target`` names the aggregate (its type comes from ``kind``)."""

    actor: str
    action_id: str
    group: str
    kind: str
    target: str
    body: dict[str, Any] = msgspec.field(default_factory=dict)
    expected_revision: int | None = None
    signature: bytes | None = None


class Effect(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One aggregate's new state after a transition (``state`` None: the aggregate is gone)."""

    aggregate: str
    revision: int
    state: dict[str, Any] | None


class Event(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An accepted, immutable fact with its Group sequence and its aggregate's revision."""

    group: str
    seq: int
    event_id: str
    kind: str
    aggregate: str
    revision: int
    actor: str
    action_id: str
    content_hash: bytes
    accepted_at_ms: int
    authoritative: bool
    body: dict[str, Any] | None
    effects: list[Effect]
    payload_hash: bytes
    prev_hash: bytes
    hash: bytes

    @property
    def redacted(self) -> bool:
        return self.body is None


class Receipt(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The answer to an accepted Command; derived from its Event, so it is identical after rebuild.

    ``authoritative`` is False when the Command was kept only as Evidence (e.g. a late result
    under a lease that is no longer current): its Event exists, but it changed no state.
    """

    event_id: str
    group: str
    seq: int
    kind: str
    aggregate: str
    revision: int
    actor: str
    action_id: str
    content_hash: bytes
    accepted_at_ms: int
    authoritative: bool
    event_hash: bytes


class AcceptResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """One Command's outcome in ``accept_many``: a receipt, or a typed rejection."""

    receipt: Receipt | None = None
    error_code: str | None = None
    message: str | None = None
    detail: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.receipt is not None

    @property
    def error(self) -> MwpError | None:
        if self.error_code is None:
            return None
        return error_from_code(self.error_code, self.message or "", self.detail)

    def unwrap(self) -> Receipt:
        """Return the receipt or raise the typed rejection."""
        if self.receipt is None:
            error = self.error
            assert error is not None
            raise error
        return self.receipt

    @classmethod
    def failed(cls, error: MwpError) -> AcceptResult:
        return cls(error_code=error.code, message=error.message, detail=_plain_detail(error.detail))


def _plain_detail(detail: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in detail.items() if isinstance(value, (str, int, float, bool, type(None)))}


# -- Canonical Command content ------------------------------------------------------------------


def command_content(command: Command) -> dict[str, Any]:
    """The signed and hashed content of a Command: every field except the signature."""
    return {
        "action_id": command.action_id,
        "actor": command.actor,
        "body": command.body,
        "expected_revision": command.expected_revision,
        "group": command.group,
        "kind": command.kind,
        "target": command.target,
    }


def check_command(command: object) -> Command:
    """Validate a Command from outside; return it or raise ``InvalidCommand`` naming the field."""
    if not isinstance(command, Command):
        raise InvalidCommand("expected a mwpstore.Command", field="command")
    if not (
        _id_ok(command.actor)
        and _id_ok(command.action_id)
        and _id_ok(command.group)
        and _kind_ok(command.kind)
        and _id_ok(command.target)
    ):  # one is wrong: check them in order, so the error names the first
        canonical.check_id(command.actor, "actor")
        canonical.check_id(command.action_id, "action_id")
        canonical.check_id(command.group, "group")
        canonical.check_kind(command.kind)
        canonical.check_id(command.target, "target")
    if type(command.body) is not dict:
        raise InvalidCommand("body must be a dict with string keys", field="body")
    if not _content_ok(command.body):
        canonical.check_content(command.body)
    revision = command.expected_revision
    if revision is not None and (type(revision) is not int or not 0 <= revision <= limits.INT_ABS_MAX):
        raise InvalidCommand("expected_revision must be a non-negative integer or None", field="expected_revision")
    signature = command.signature
    if signature is not None and (type(signature) is not bytes or len(signature) != limits.SIGNATURE_BYTES):
        raise InvalidCommand(f"signature must be {limits.SIGNATURE_BYTES} bytes", field="signature")
    return command


def command_bytes(command: Command) -> bytes:
    """Canonical bytes of a checked Command's content; what is hashed for idempotency and signed."""
    data = canonical.canonical_bytes(command_content(command))
    if len(data) > limits.BODY_BYTES_MAX:
        raise LimitExceeded(f"the Command encodes to more than {limits.BODY_BYTES_MAX} bytes", field="body")
    return data


# -- Event encoding and hashing -----------------------------------------------------------------

_EVENT_ENCODER = msgspec.msgpack.Encoder()
_EVENT_DECODER = msgspec.msgpack.Decoder(Event)
_RECEIPT_DECODER = msgspec.msgpack.Decoder(Receipt)
_EFFECTS_ENCODER = msgspec.msgpack.Encoder(order="sorted")


HASHING = (
    _EFFECTS_ENCODER.encode_into,
    canonical.canonical_bytes,
    blake3.blake3,
    canonical.DOMAIN_PAYLOAD,
    canonical.DOMAIN_EVENT,
)
"""The calls that ``payload_hash_of`` and ``event_hash_of_fields`` make, as bound C callables
(encode sorted msgpack, here into a buffer; canonical bytes; the blake3 hasher) and the two domain
prefixes: what ``mwpstore._apply_c.check_run`` computes Event hashes (and from their parts an
Event's encoded size) with."""


encode_event: Callable[[Event], bytes] = _EVENT_ENCODER.encode
"""An Event's bytes as the log stores them (after its tag): the encoder's own method, so that each
Event an accept makes pays no Python frame for it."""


DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
"""What decoding stored or received bytes can raise: msgspec's errors, and ``RecursionError`` for
a value nested deeper than its decoder goes (an Effect's state, a receipt's extra field)."""


def decode_event(data: bytes | memoryview) -> Event:
    """Decode an Event from bytes; raises ``EventInvalid`` for bytes that are not an Event."""
    try:
        return _EVENT_DECODER.decode(data)
    except DECODE_ERRORS as exc:
        raise EventInvalid(f"bytes are not an Event: {exc}", reason="decode") from None


def decode_logged_event(position: int, record: bytes | memoryview) -> Event:
    """The Event of the log record at ``position`` (its tag byte first). Bytes the log's checksum
    let through that are no Event are damage: ``CORRUPTION`` (reason ``decode``) naming the
    record, not ``EventInvalid``, which is the error of a delivered Event."""
    try:
        return decode_event(memoryview(record)[1:])
    except EventInvalid as exc:
        raise Corruption(f"log record at {position} is not an Event: {exc.message}", offset=position, reason="decode") from None


def decode_events(records: Iterable[bytes]) -> list[Event]:
    """``decode_event`` of each record (an Event record without its tag byte, as a read hands it
    over), as one list: the same checks and errors, without a Python call per Event."""
    try:
        return list(map(_EVENT_DECODER.decode, records))
    except DECODE_ERRORS as exc:
        raise EventInvalid(f"bytes are not an Event: {exc}", reason="decode") from None


encode_receipt: Callable[[Receipt], bytes] = _EVENT_ENCODER.encode
"""A Receipt's bytes as the index stores them (after the content hash): the encoder's own method."""


decode_receipt: Callable[[bytes | memoryview], Receipt] = _RECEIPT_DECODER.decode
"""A stored receipt's bytes decoded (msgspec's ``DecodeError`` or ``ValidationError`` if they are
no Receipt): the decoder's own method, so that a replay's lookup pays no Python frame for it."""


def payload_hash_of(body: dict[str, Any] | None) -> bytes:
    return canonical.payload_hash(canonical.canonical_bytes(body))


def event_hash(
    *,
    group: str,
    seq: int,
    event_id: str,
    kind: str,
    aggregate: str,
    revision: int,
    actor: str,
    action_id: str,
    content_hash: bytes,
    accepted_at_ms: int,
    authoritative: bool,
    effects: list[Effect],
    payload_hash: bytes,
    prev_hash: bytes,
) -> bytes:
    """The chain hash of one Event: commits to the previous hash, header, effects and payload hash."""
    return event_hash_of_fields(
        (group, seq, event_id, kind, aggregate, revision, actor, action_id, content_hash, accepted_at_ms, authoritative),
        effects,
        payload_hash,
        prev_hash,
    )


def event_hash_of_fields(
    header: tuple[str, int, str, str, str, int, str, str, bytes, int, bool],
    effects: list[Effect],
    payload_hash: bytes,
    prev_hash: bytes,
) -> bytes:
    """``event_hash`` with the header fields as one tuple, in the order of the hashed header:
    (group, seq, event_id, kind, aggregate, revision, actor, action_id, content_hash,
    accepted_at_ms, authoritative)."""
    encode = _EFFECTS_ENCODER.encode
    hash_bytes = canonical.hash_bytes
    return hash_bytes(canonical.DOMAIN_EVENT, prev_hash, encode(header), hash_bytes(encode(effects)), payload_hash)


def recompute_event_hash(event: Event) -> bytes:
    return event_hash_of_fields(
        (
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
            event.authoritative,
        ),
        event.effects,
        event.payload_hash,
        event.prev_hash,
    )


def make_event_id(group: str, seq: int) -> str:
    """Event IDs are derived from Group and sequence; ':' never occurs in an ID, so they are unique."""
    return f"{group}:{seq}"


def receipt_for(event: Event) -> Receipt:
    return Receipt(
        event_id=event.event_id,
        group=event.group,
        seq=event.seq,
        kind=event.kind,
        aggregate=event.aggregate,
        revision=event.revision,
        actor=event.actor,
        action_id=event.action_id,
        content_hash=event.content_hash,
        accepted_at_ms=event.accepted_at_ms,
        authoritative=event.authoritative,
        event_hash=event.hash,
    )


def check_event(event: object, *, expected_prev_hash: bytes | None = None) -> Event:
    """Validate an Event from outside (delivery, files): shape, IDs, derived ID, hashes.

    Raises ``EventInvalid`` naming what failed. ``expected_prev_hash`` (when known) checks the
    chain link to the previous Event of the same Group.
    """
    if not isinstance(event, Event):
        raise EventInvalid("expected a mwpstore.Event", reason="type")
    if not (_id_ok(event.group) and _id_ok(event.actor) and _id_ok(event.action_id) and _kind_ok(event.kind)):
        try:  # one is wrong: check them in order, so the error names the first
            canonical.check_id(event.group, "group")
            canonical.check_id(event.actor, "actor")
            canonical.check_id(event.action_id, "action_id")
            canonical.check_kind(event.kind)
        except InvalidCommand as exc:
            raise EventInvalid(f"Event field invalid: {exc.message}", reason="field", field=exc.field) from None
    if type(event.seq) is not int or not 1 <= event.seq <= limits.INT_ABS_MAX:
        raise EventInvalid("Event seq must be an integer from 1 to 2**63 - 1", reason="seq")
    if event.event_id != make_event_id(event.group, event.seq):
        raise EventInvalid("Event ID does not match its Group and sequence", reason="event_id")
    content_hash, payload_hash, prev_hash, digest = event.content_hash, event.payload_hash, event.prev_hash, event.hash
    if not (
        type(content_hash) is bytes
        and len(content_hash) == HASH_BYTES
        and type(payload_hash) is bytes
        and len(payload_hash) == HASH_BYTES
        and type(prev_hash) is bytes
        and len(prev_hash) == HASH_BYTES
        and type(digest) is bytes
        and len(digest) == HASH_BYTES
    ):
        for name in ("content_hash", "payload_hash", "prev_hash", "hash"):  # name the first one wrong
            value = getattr(event, name)
            if type(value) is not bytes or len(value) != HASH_BYTES:
                raise EventInvalid(f"Event {name} must be {HASH_BYTES} bytes", reason=name)
    body = event.body
    if body is not None:
        if not _content_ok(body):
            try:
                canonical.check_content(body)
            except InvalidCommand as exc:
                raise EventInvalid(f"Event body invalid: {exc.message}", reason="body") from None
        if payload_hash_of(body) != payload_hash:
            raise EventInvalid("Event body does not match its payload hash", reason="payload_hash")
    for effect in event.effects:
        revision = effect.revision
        if type(effect.aggregate) is not str or type(revision) is not int or revision < 1:
            raise EventInvalid("Event effect malformed", reason="effects")
        state = effect.state
        if state is not None and not _content_ok(state):
            try:
                canonical.check_content(state, "effects")
            except InvalidCommand as exc:
                raise EventInvalid(f"Event effect invalid: {exc.message}", reason="effects") from None
    if expected_prev_hash is not None and prev_hash != expected_prev_hash:
        raise EventInvalid("Event does not link to the previous Event's hash", reason="prev_hash")
    if recompute_event_hash(event) != digest:
        raise EventInvalid("Event hash does not verify", reason="hash")
    return event
