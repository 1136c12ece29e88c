"""Bounded outage recovery on the agent side (MWP-WRK-020, MWP-WRK-021).

While the Group service is unreachable an agent may only go on with work it already holds a lease
for, that is reversible, and only until a grace deadline. :class:`OfflineGuard` enforces that
against the AgentStore's mirror of the Group, and buffers the Commands such work produces durably,
each with its offline binding (WorkItem, lease id, ownership epoch, session epoch, grace deadline,
reversible). On reconnect every buffered Command is, in order:

1. checked against the current projection: if the lease it was bound to is no longer the
   WorkItem's current lease held by this agent (revoked, reassigned, expired and re-queued,
   cancelled), it is refused (``LEASE_MISMATCH``) and reported, never resubmitted as authoritative;
2. rebased onto the current session fields: ``session_epoch``, ``lease_id`` and
   ``ownership_epoch`` in the body (where present) and ``expected_revision`` (where present), from
   the projection;
3. given a new Action ID exactly when one of those fields changed (freshness or fencing changed,
   MWP-EXT-005): ``derive_action_id(old, changed fields)``, deterministic, so a crash during
   reconnect re-derives the same ID and the authority's idempotency returns the original receipt;
4. re-signed with the agent's Ed25519 key over ``command_bytes``;
5. stored as rebased (durable) before it is submitted, so a retry resends the very same bytes.

The caller brings the projection up to date (``sync``, e.g. a delivery catch-up) before each
rebase, since a resubmitted Command changes the revision the next one must name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import blake3
import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import canonical, limits
from .agent_store import AgentStore, _Tables
from .errors import OfflineRefused  # noqa: F401  (defined with the other errors; re-exported here)
from .errors import Corruption, InvalidCommand, LeaseMismatch, MwpError, Rejection
from .leases import lease_is_live
from .messages import DECODE_ERRORS, Command, check_command, command_bytes
from .registry import aggregate_key, kind_spec

DOMAIN_REBASE = b"mwpstore/rebase-action/v1\x00"

NEVER_OFFLINE_KINDS = frozenset({"workitem.claim", "workitem.start", "workitem.submit", "workitem.publish", "approval.request"})
"""Kinds refused while offline whatever the caller says: new work (a claim, or starting a claimed
WorkItem), or visible outside the agent."""

REBASED_BODY_FIELDS = ("session_epoch", "lease_id", "ownership_epoch")



class BufferedState(str, enum.Enum):
    BUFFERED = "buffered"  # written offline, not yet rebased
    REBASED = "rebased"  # rebased and re-signed; durable before submission
    SUBMITTED = "submitted"  # the authority answered with a receipt
    REFUSED = "refused"  # its lease was revoked meanwhile: not resubmitted
    REJECTED = "rejected"  # the authority rejected the rebased Command


class OfflineBinding(msgspec.Struct, frozen=True, kw_only=True):
    """What an offline Command was bound to when the agent wrote it (MWP-WRK-021)."""

    workitem: str
    lease_id: str
    ownership_epoch: int
    session_epoch: int
    grace_deadline_ms: int
    reversible: bool


class BufferedCommand(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    group: str
    command: Command
    binding: OfflineBinding
    buffered_at_ms: int
    state: BufferedState = BufferedState.BUFFERED
    rebased: Command | None = None
    error_code: str | None = None
    message: str | None = None
    receipt: Any = None


class Outage(msgspec.Struct, frozen=True, kw_only=True):
    since_ms: int
    grace_ms: int


class ReconnectOutcome(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    state: BufferedState
    command: Command
    error: str | None = None
    receipt: Any = None


_PENDING = frozenset({BufferedState.BUFFERED, BufferedState.REBASED})
"""States of a buffered Command that ``reconnect`` has still to send."""

_BUFFERED_ENCODER = msgspec.msgpack.Encoder()
_BUFFERED_DECODER = msgspec.msgpack.Decoder(BufferedCommand)
_OUTAGE_DECODER = msgspec.msgpack.Decoder(Outage)


def _decode(decoder: msgspec.msgpack.Decoder[Any], key: bytes, data: bytes) -> Any:
    """A stored offline record (an outage or a buffered Command) decoded; ``CORRUPTION`` for one
    that passed its seal but does not decode (the AgentStore's read paths type only what they
    decode themselves, and these records are decoded here)."""
    try:
        return decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise Corruption(
            f"the agent store holds an offline record it cannot read at {key[:200]!r} ({type(exc).__name__}); {_Tables.remedy}",
            reason="agent",
            database="offline",
        ) from None


def derive_action_id(old_action_id: str, changed: dict[str, Any]) -> str:
    """The Action ID of a rebased Command: a pure function of the old ID and the changed fields."""
    data = canonical.canonical_bytes({"action_id": old_action_id, "changed": changed})
    return "rb-" + blake3.blake3(DOMAIN_REBASE + data).hexdigest()[:40]


def sign_command(command: Command, signing_key: Ed25519PrivateKey) -> Command:
    """Return ``command`` signed with Ed25519 over its canonical bytes."""
    _check_signing_key(signing_key)
    unsigned = msgspec.structs.replace(command, signature=None)
    return msgspec.structs.replace(unsigned, signature=signing_key.sign(command_bytes(unsigned)))


def _check_signing_key(signing_key: object) -> None:
    if not isinstance(signing_key, Ed25519PrivateKey):
        raise InvalidCommand(f"signing_key must be an Ed25519PrivateKey, not {type(signing_key).__name__}", field="signing_key")


def _outage_key(group: str) -> bytes:
    return group.encode() + b"\x00S"


def _command_key(group: str, number: int) -> bytes:
    return group.encode() + b"\x00C" + number.to_bytes(8, "big")


class OfflineGuard:
    """The outage rules for one agent in one Group, backed by the agent's store."""

    def __init__(self, agent: AgentStore, group: str, agent_id: str, *, grace_ms: int) -> None:
        canonical.check_id(group, "group")
        canonical.check_id(agent_id, "agent_id")
        if type(grace_ms) is not int or not 0 <= grace_ms <= limits.WORK_DURATION_MS_MAX:
            raise InvalidCommand(f"grace_ms must be an integer in 0..{limits.WORK_DURATION_MS_MAX}", field="grace_ms")
        self.agent = agent
        self.group = group
        self.agent_id = agent_id
        self.grace_ms = grace_ms

    # -- reachability ---------------------------------------------------------------------------

    def service_unreachable(self, now_ms: int) -> None:
        """Note (durably) that the Group service became unreachable at ``now_ms``."""
        canonical.check_time_ms(now_ms, "now_ms")  # stored: a float here would make the outage unreadable
        with self.agent.begin() as tx:
            if tx._offline_get(_outage_key(self.group)) is None:
                tx._offline_put(
                    _outage_key(self.group), _BUFFERED_ENCODER.encode(Outage(since_ms=now_ms, grace_ms=self.grace_ms))
                )

    def outage(self) -> Outage | None:
        key = _outage_key(self.group)
        data = self.agent._offline_read(key)
        return None if data is None else _decode(_OUTAGE_DECODER, key, data)

    @property
    def offline(self) -> bool:
        return self.outage() is not None

    # -- the guard ------------------------------------------------------------------------------

    def permit(
        self, workitem: str, *, now_ms: int, reversible: bool, externally_visible: bool = False, kind: str | None = None
    ) -> OfflineBinding | None:
        """Check an operation on ``workitem``; return its offline binding, or None when online.

        Online this only insists on a live lease held by this agent for irreversible or
        externally visible operations (the authority enforces the rest). Offline it allows only
        reversible, not externally visible work on a WorkItem this agent already holds a live
        lease for, before the grace deadline; anything else raises ``OfflineRefused``.
        """
        canonical.check_time_ms(now_ms, "now_ms")
        # the binding stores ``reversible`` as a bool: anything else would be written and then
        # fail to decode, making every buffered record of the Group unreadable
        for name, flag in (("reversible", reversible), ("externally_visible", externally_visible)):
            if type(flag) is not bool:
                raise InvalidCommand(f"{name} must be a bool", field=name)
        if kind is not None and type(kind) is not str:
            raise InvalidCommand("kind must be a str or None", field="kind")
        outage = self.outage()
        lease = self._held_lease(workitem)
        if outage is None:
            if (not reversible or externally_visible) and (lease is None or not lease_is_live(lease, now_ms)):
                raise OfflineRefused(
                    f"an irreversible or externally visible operation on {workitem!r} needs a current lease",
                    reason="no_current_lease",
                )
            return None
        if kind in NEVER_OFFLINE_KINDS:
            raise OfflineRefused(f"{kind} is not allowed while the Group service is unreachable", reason="kind")
        if externally_visible:
            raise OfflineRefused(
                "externally visible operations wait for reconnection and reconciliation", reason="externally_visible"
            )
        if not reversible:
            raise OfflineRefused("irreversible operations wait for reconnection and reconciliation", reason="irreversible")
        if lease is None:
            raise OfflineRefused(
                f"no lease on {workitem!r}: new work does not start while the Group service is unreachable",
                reason="new_work",
            )
        if not lease["started"]:
            # claimed but never started: not active work, and its start deadline may lapse unseen
            raise OfflineRefused(
                f"the lease on {workitem!r} was never started: new work does not start while the Group service is unreachable",
                reason="new_work",
            )
        deadline = min(outage.since_ms + outage.grace_ms, lease["expires_at_ms"])
        if now_ms >= deadline:
            raise OfflineRefused(f"the offline grace period for {workitem!r} ended at {deadline}", reason="grace_expired")
        return OfflineBinding(
            workitem=workitem,
            lease_id=lease["lease_id"],
            ownership_epoch=lease["ownership_epoch"],
            session_epoch=lease["session_epoch"],
            grace_deadline_ms=deadline,
            reversible=reversible,
        )

    def buffer(self, command: Command, *, now_ms: int, reversible: bool, externally_visible: bool = False) -> BufferedCommand:
        """Check ``command`` with the guard and store it durably with its offline binding."""
        check_command(command)
        # what is stored is what was checked: the caller's body is a dict another thread may
        # change meanwhile, and a body changed into what no check allows would be refused by
        # every later reconnect's rebase (its Command checked again), the outage never ending
        command = msgspec.structs.replace(command, body=canonical.content_copy(command.body, "body"))
        if command.group != self.group or command.actor != self.agent_id:
            raise InvalidCommand("a buffered Command must be this agent's, in this Group", field="command")
        binding = self.permit(
            command.target, now_ms=now_ms, reversible=reversible, externally_visible=externally_visible, kind=command.kind
        )
        if binding is None:
            raise OfflineRefused("the Group service is reachable: submit the Command directly", reason="online")
        fence = {"lease_id": binding.lease_id, "ownership_epoch": binding.ownership_epoch, "session_epoch": binding.session_epoch}
        for name in REBASED_BODY_FIELDS:
            if name in command.body and command.body[name] != fence[name]:
                # written for another lease (a late result of an earlier attempt): rebasing would
                # move it onto the current lease and make it authoritative
                raise OfflineRefused(
                    f"body.{name} is {command.body[name]!r}, but the lease held offline has {fence[name]!r}; "
                    "a Command for another lease is not buffered",
                    reason="fence",
                )
        with self.agent.begin() as tx:
            if tx._offline_get(_outage_key(self.group)) is None:
                # a reconnect ended the outage after the guard's check: it found no Command left
                # and will not come back for this one
                raise OfflineRefused("the Group service is reachable again: submit the Command directly", reason="online")
            existing = tx._offline_range(self.group.encode() + b"\x00C")
            number = 1 + (int.from_bytes(existing[-1][0][-8:], "big") if existing else 0)
            record = BufferedCommand(number=number, group=self.group, command=command, binding=binding, buffered_at_ms=now_ms)
            tx._offline_put(_command_key(self.group, number), _BUFFERED_ENCODER.encode(record))
        return record

    def buffered(self) -> list[BufferedCommand]:
        rows = self.agent._offline_read_range(self.group.encode() + b"\x00C")
        return [_decode(_BUFFERED_DECODER, key, value) for key, value in rows]

    # -- reconnect ------------------------------------------------------------------------------

    def rebase(self, record: BufferedCommand, signing_key: Ed25519PrivateKey) -> Command:
        """Rebase one buffered Command onto the current projection and re-sign it.

        Raises ``LeaseMismatch`` when the lease it was bound to was revoked meanwhile. The lease,
        the member's session and the revision it is rebased onto are read from one snapshot of
        the mirror: read one by one, a revocation applied between them by the delivery thread
        would give a Command checked against the old lease but naming the revocation's revision,
        which the authority's compare-and-set lets through.
        """
        binding = record.binding
        command = record.command
        keys = [f"workitem:{binding.workitem}", f"member:{self.agent_id}"]
        if command.expected_revision is not None:
            keys.append(aggregate_key(kind_spec(command.kind).aggregate_type, command.target))
        found = self.agent._aggregates(self.group, keys)
        lease = _lease_held_by(found[0][1], self.agent_id)
        if lease is None or lease["lease_id"] != binding.lease_id or lease["ownership_epoch"] != binding.ownership_epoch:
            raise LeaseMismatch(
                f"the lease {binding.lease_id} on {binding.workitem!r} was revoked while offline; "
                "the buffered Command is not resubmitted as authoritative work",
                lease_id=binding.lease_id,
                workitem=binding.workitem,
            )
        member = found[1][1] or {}
        current = {"session_epoch": member.get("session_epoch", lease["session_epoch"]),
                   "lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}
        for name in REBASED_BODY_FIELDS:
            # buffer() stores only Commands whose fence is the bound lease's, and that lease is
            # current: a difference here (a record buffered before buffer() checked) names
            # another lease, and moving it onto this one would make a late result authoritative
            if name in command.body and command.body[name] != current[name]:
                raise LeaseMismatch(
                    f"the buffered Command's body.{name} names another lease than {binding.lease_id}; it is not resubmitted",
                    lease_id=binding.lease_id,
                    workitem=binding.workitem,
                )
        changed: dict[str, Any] = {}
        expected_revision = command.expected_revision
        if expected_revision is not None:
            revision = found[2][0]
            if revision != expected_revision:
                expected_revision = revision
                changed["expected_revision"] = revision
        action_id = command.action_id if not changed else derive_action_id(command.action_id, changed)
        rebased = msgspec.structs.replace(command, expected_revision=expected_revision, action_id=action_id, signature=None)
        return sign_command(check_command(rebased), signing_key)

    def reconnect(
        self,
        submit: Callable[[Command], Any],
        *,
        signing_key: Ed25519PrivateKey,
        sync: Callable[[], Any] | None = None,
    ) -> list[ReconnectOutcome]:
        """Resubmit the buffered Commands in order: rebase, re-sign, store, submit.

        ``submit(command)`` sends one Command to the authority and returns its receipt (or raises
        a typed rejection); ``sync()`` brings the AgentStore up to date first. A transport error
        from ``submit`` propagates: the outage is kept and a later call resends the stored bytes.
        """
        # checked before the first record is touched: called, a submit that is no callable raised
        # TypeError with its record already stored REBASED, a wrong key AttributeError
        if not callable(submit):
            raise InvalidCommand("submit must be a callable(command) returning the receipt", field="submit")
        if sync is not None and not callable(sync):
            raise InvalidCommand("sync must be a callable() or None", field="sync")
        _check_signing_key(signing_key)
        outcomes: list[ReconnectOutcome] = []
        while True:
            for record in self.buffered():
                if record.state in _PENDING:
                    outcomes.append(self._resubmit(record, submit, signing_key, sync))
            # The outage ends only in a commit that finds no Command left to send: one buffered
            # meanwhile (the outage still stood) is sent by this call, never left behind.
            with self.agent.begin() as tx:
                left = any(
                    _decode(_BUFFERED_DECODER, key, value).state in _PENDING
                    for key, value in tx._offline_range(self.group.encode() + b"\x00C")
                )
                if not left:
                    tx._offline_delete(_outage_key(self.group))
            if not left:
                return outcomes

    def _resubmit(
        self,
        record: BufferedCommand,
        submit: Callable[[Command], Any],
        signing_key: Ed25519PrivateKey,
        sync: Callable[[], Any] | None,
    ) -> ReconnectOutcome:
        """Rebase, store and submit one buffered Command (``reconnect``'s step); its outcome.

        Another thread's ``reconnect`` may hold the same record: every step is stored only if the
        record is still in the state this one read (``_store``), and otherwise this one goes on
        from what was stored. A record the other call rebased is sent with its stored bytes,
        never rebased again (by then the Group may have moved, and a second rebase would derive
        another Action ID for the same Command)."""
        if sync is not None:
            sync()
        if record.state is BufferedState.BUFFERED:
            try:
                rebased = self.rebase(record, signing_key)
            except LeaseMismatch as exc:
                record = self._store(record, state=BufferedState.REFUSED, error_code=exc.code, message=exc.message)
            else:
                record = self._store(record, state=BufferedState.REBASED, rebased=rebased)
            if record.state is not BufferedState.REBASED:
                return _outcome(record)  # refused here, or settled by another reconnect meanwhile
        command = record.rebased
        assert command is not None
        try:
            receipt = submit(command)
        except Rejection as exc:
            return _outcome(self._store(record, state=BufferedState.REJECTED, error_code=exc.code, message=exc.message))
        try:
            plain = msgspec.to_builtins(receipt) if receipt is not None else None
            _BUFFERED_ENCODER.encode(plain)  # what _store writes: a surrogate or a huge int fails there
        except (TypeError, ValueError, OverflowError) as exc:
            # the Command was sent: the record stays REBASED, and the next reconnect resends its
            # stored bytes (the authority's idempotency answers the original receipt)
            raise InvalidCommand(
                f"submit returned a receipt that cannot be stored ({type(exc).__name__}: {exc}); "
                "reconnect again to resend the Command"[:400],
                field="submit",
            ) from None
        return _outcome(self._store(record, state=BufferedState.SUBMITTED, receipt=plain))

    # -- internals ------------------------------------------------------------------------------

    def _store(self, record: BufferedCommand, **changes: Any) -> BufferedCommand:
        """Store ``record`` with ``changes`` if the stored record is still in ``record``'s state,
        in one local commit; return what is stored after it. A record's state only moves on, so
        a different state means another ``reconnect`` took this step (or a later one) meanwhile:
        its record is kept and returned."""
        updated = msgspec.structs.replace(record, **changes)
        key = _command_key(self.group, record.number)
        with self.agent.begin() as tx:
            data = tx._offline_get(key)
            current = None if data is None else _decode(_BUFFERED_DECODER, key, data)
            if current is not None and current.state is not record.state:
                return current
            tx._offline_put(key, _BUFFERED_ENCODER.encode(updated))
        return updated

    def _held_lease(self, workitem: str) -> dict[str, Any] | None:
        """The WorkItem's current lease if this agent holds it (per the projection), else None."""
        return _lease_held_by(self.agent.state(self.group, f"workitem:{workitem}"), self.agent_id)


def _lease_held_by(state: dict[str, Any] | None, agent_id: str) -> dict[str, Any] | None:
    """The current lease in a WorkItem's mirrored ``state`` if ``agent_id`` holds it, else None.

    The mirror keeps a lease as the Events carried it; one without ``started`` is taken as
    started, so the returned copy always has the field that ``lease_is_live`` reads.
    """
    if state is None or state.get("state") != "leased":
        return None
    lease = state.get("lease")
    if not lease or lease.get("agent") != agent_id:
        return None
    return {**lease, "started": lease.get("started", True)}


def _outcome(record: BufferedCommand) -> ReconnectOutcome:
    """What ``reconnect`` reports for a record in the state it was left in."""
    error = record.error_code if record.state in (BufferedState.REFUSED, BufferedState.REJECTED) else None
    command = record.rebased if record.rebased is not None else record.command
    return ReconnectOutcome(number=record.number, state=record.state, command=command, error=error, receipt=record.receipt)


__all__ = [
    "BufferedCommand",
    "BufferedState",
    "OfflineBinding",
    "OfflineGuard",
    "OfflineRefused",
    "Outage",
    "ReconnectOutcome",
    "derive_action_id",
    "sign_command",
]
