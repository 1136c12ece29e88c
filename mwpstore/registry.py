"""The registry of kinds and the pure transition pipeline.

A kind is a pure pair: ``decide(view, command, context) -> Decision`` (or raise a ``Rejection``)
and ``evolve(view, event) -> {aggregate key: new state | None}``. Neither writes anything; the
engine alone writes. :func:`run_transition` is the one pipeline that turns a Command into an Event
(generic checks, decide, evolve, revisions, hash chain); the authority's engine and the in-memory
:class:`MemoryGroup` used by rule tests both call it, so the rules are the same with or without disk.

Aggregate keys are ``"<type>:<id>"`` (``group:g-1``, ``member:agent-7``, ``workitem:wi-3``).
State values are plain JSON-like dicts; revisions are kept by the engine, not inside the state.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from . import _fork, canonical
from .errors import (
    GroupArchived,
    InvalidCommand,
    NotAMember,
    NotFound,
    RevisionMismatch,
    SignatureInvalid,
    Unauthorized,
    UnknownKind,
)
from .messages import (
    ZERO_HASH,
    Command,
    Effect,
    Event,
    command_bytes,
    event_hash_of_fields,
    make_event_id,
    payload_hash_of,
)

ENGINE_ACTOR = "_engine"
"""Actor of Commands the engine issues itself (e.g. the ``lease.expire`` sweep)."""


class StateView(Protocol):
    """Read access to one Group's aggregates as of the uncommitted head."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def revision(self, key: str) -> int: ...


class Context(msgspec.Struct, frozen=True):
    """What ``decide`` may know besides state and Command: the acceptance time, the actor's
    Membership, and the sequence the Event will get (so a kind can refer to earlier Events).

    A frozen msgspec Struct rather than a frozen dataclass: one is made per Command, and a frozen
    dataclass's ``__init__`` (an ``object.__setattr__`` call per field) cost about 0.75 us of it
    against 0.06 us (docs/performance.md, "accept_many of 100")."""

    group: str
    now_ms: int
    member: dict[str, Any] | None
    seq: int = 0


class Decision(NamedTuple):
    """The outcome of ``decide``: the Event's payload, and whether it changes state.

    ``authoritative=False`` records the Command as Evidence: its own Event, no state change.
    """

    body: dict[str, Any]
    authoritative: bool = True


Decide = Callable[[StateView, Command, Context], Decision]
Evolve = Callable[[StateView, Event], Mapping[str, dict[str, Any] | None]]


@dataclass(frozen=True, slots=True)
class KindSpec:
    """One kind of Command.

    ``roles`` None means any actor (only ``group.create``). ``compare_and_set`` kinds must carry an
    expected revision. ``system_only`` kinds are issued by the engine alone.
    """

    kind: str
    aggregate_type: str
    decide: Decide
    evolve: Evolve
    roles: frozenset[str] | None = frozenset({"owner"})
    compare_and_set: bool = False
    allowed_when_archived: bool = False
    system_only: bool = False
    creates_group: bool = False


REGISTRY: dict[str, KindSpec] = {}


def register(spec: KindSpec) -> KindSpec:
    registered = REGISTRY.get(spec.kind)
    assert registered is None or _of_a_failed_import(registered), f"kind {spec.kind} registered twice"
    canonical.check_kind(spec.kind)
    REGISTRY[spec.kind] = spec
    return spec


def _of_a_failed_import(spec: KindSpec) -> bool:
    """Whether ``spec`` was registered by a run of its module that is no longer the module: an
    import that failed part way (an interrupt, an error). Python forgets such a module and runs it
    again at the next import, which registers its kinds anew; refused, that import, and so every
    later ``kind_spec``, failed with "registered twice"."""
    defined_in = getattr(spec.decide, "__globals__", None)
    module = sys.modules.get(getattr(spec.decide, "__module__", None) or "")
    return defined_in is not None and getattr(module, "__dict__", None) is not defined_in


def kind_spec(kind: str) -> KindSpec:
    spec = REGISTRY.get(kind) if _KINDS_LOADED else None
    if spec is None:
        _load_kinds()
        spec = REGISTRY.get(kind)
    if spec is None:
        raise UnknownKind(f"unknown kind {kind!r}; known kinds: {', '.join(sorted(REGISTRY))}", field="kind")
    return spec


_KINDS_LOADED = False
_KINDS_LOADING = threading.RLock()
# A fork waits for a loading in another thread to end: the child has no such thread, and would
# wait forever for the lock it held (each Command of the child, whatever its kind). It waits
# through an interrupt too (_fork.wait_for).
os.register_at_fork(before=functools.partial(_fork.wait_for, _KINDS_LOADING), after_in_parent=_KINDS_LOADING.release,
                    after_in_child=_KINDS_LOADING.release)


def _load_kinds() -> None:
    """Import the modules that register kinds (once). ``_KINDS_LOADED`` is set only once they
    all are, under a lock: set before the imports, another thread's first ``kind_spec`` during
    them found the flag set and a kind not yet registered, and refused a valid Command as
    ``UNKNOWN_KIND``. (Reentrant: an import that asks for a kind meanwhile gets the modules in
    progress, as before.) A fork waits for a loading in progress (``os.register_at_fork`` above)."""
    global _KINDS_LOADED
    if _KINDS_LOADED:
        return
    with _KINDS_LOADING:
        if _KINDS_LOADED:
            return
        from . import kinds  # noqa: F401  (registers group.* and mission.*)
        from . import redaction  # noqa: F401  (registers event.redact and audit.delete)

        import importlib
        import importlib.util

        if importlib.util.find_spec(f"{__package__}.work_model") is not None:
            importlib.import_module(f"{__package__}.work_model")  # registers the work-model kinds
        _KINDS_LOADED = True


def aggregate_key(aggregate_type: str, target: str) -> str:
    return f"{aggregate_type}:{target}"


def group_key(group: str) -> str:
    return aggregate_key("group", group)


def member_key(agent: str) -> str:
    return aggregate_key("member", agent)


# -- Ed25519 public keys --------------------------------------------------------------------------
#
# The curve is -x^2 + y^2 = 1 + d*x^2*y^2 over the integers modulo p (RFC 8032, section 5.1). A
# public key is the point's y (255 bits, little-endian) with the parity of x in the top bit.

_CURVE_P = 2**255 - 19
_CURVE_D = -121665 * pow(121666, -1, _CURVE_P) % _CURVE_P
_SQRT_MINUS_ONE = pow(2, (_CURVE_P - 1) // 4, _CURVE_P)
_IDENTITY = (0, 1)


def _decode_point(encoded: bytes) -> tuple[int, int] | None:
    """The curve point ``encoded`` names, or None when it is not the canonical encoding of one.

    Decoding as in RFC 8032, section 5.1.3, except that a y at or above p is refused rather
    than reduced, so every point has exactly one accepted encoding.
    """
    if len(encoded) != 32:
        return None
    y = int.from_bytes(encoded, "little")
    x_is_odd = y >> 255
    y &= (1 << 255) - 1
    if y >= _CURVE_P:
        return None
    # x^2 = u / v; x = u * v^3 * (u * v^7)^((p - 5) / 8) is a square root of it when one exists.
    u = (y * y - 1) % _CURVE_P
    v = (_CURVE_D * y * y + 1) % _CURVE_P
    x = u * pow(v, 3, _CURVE_P) * pow(u * pow(v, 7, _CURVE_P), (_CURVE_P - 5) // 8, _CURVE_P) % _CURVE_P
    if v * x * x % _CURVE_P == -u % _CURVE_P:
        x = x * _SQRT_MINUS_ONE % _CURVE_P
    if v * x * x % _CURVE_P != u:
        return None  # u / v is not a square: no point has this y
    if x == 0 and x_is_odd:
        return None  # "negative zero": a second encoding of a point with x = 0
    if x % 2 != x_is_odd:
        x = _CURVE_P - x
    return x, y


def _double(point: tuple[int, int]) -> tuple[int, int]:
    """2 * point. The curve equation turns the addition law's denominators 1 +- d*x^2*y^2 into
    y^2 - x^2 and 2 - y^2 + x^2; neither is ever zero on this curve."""
    x, y = point
    xx, yy = x * x % _CURVE_P, y * y % _CURVE_P
    return (
        2 * x * y * pow((yy - xx) % _CURVE_P, -1, _CURVE_P) % _CURVE_P,
        (yy + xx) * pow((2 - yy + xx) % _CURVE_P, -1, _CURVE_P) % _CURVE_P,
    )


@lru_cache(maxsize=1024)
def public_key_is_usable(public_key: bytes) -> bool:
    """Whether ``public_key`` is the canonical encoding of a curve point of order greater than 8.

    The eight points of order 1, 2, 4 or 8 (identity included) must be refused: for such a key a
    signature with R of small order and S = 0 verifies for every message, so it authenticates
    nothing. ``8 * P`` is the identity exactly for those points.
    """
    point = _decode_point(public_key)
    if point is None:
        return False
    for _ in range(3):
        point = _double(point)
    return point != _IDENTITY


def verify_signature(public_key: bytes, data: bytes, signature: bytes | None) -> None:
    if signature is None:
        raise SignatureInvalid("this member registered a public key: its Commands must be signed", field="signature")
    if not public_key_is_usable(bytes(public_key)):
        # A key stored before membership.add refused such keys: no signature can be trusted.
        raise SignatureInvalid(
            "this member's public key is not a usable Ed25519 key (small order or not a canonical curve point); "
            "an owner must replace it (membership.change)",
            field="signature",
        )
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise SignatureInvalid("the Command's signature does not verify", field="signature") from None


def run_transition(
    view: StateView,
    command: Command,
    *,
    seq: int,
    now_ms: int,
    prev_hash: bytes,
    content_hash: bytes,
    data: bytes | None = None,
    trusted: bool = False,
) -> Event:
    """Decide one checked Command against ``view``; return its Event (with effects) or raise.

    ``data`` is the Command's canonical bytes (computed if not given); ``trusted`` marks a Command
    issued by the engine itself. It is needed for ``system_only`` kinds, and those alone skip the
    membership, role and signature checks: a trusted Command of any other kind is checked like
    one from outside.
    """
    spec = kind_spec(command.kind)
    group_state = view.get(group_key(command.group))
    if spec.creates_group:
        if group_state is not None and group_state.get("status") == "archived":
            # it exists, but "exists" is not the answer: an archived Group refuses every Command
            raise GroupArchived(f"group {command.group!r} is archived and accepts no Commands")
        member = None
    else:
        if group_state is None:
            raise NotFound(f"group {command.group!r} does not exist; create it with group.create", field="group")
        if group_state.get("status") == "archived" and not spec.allowed_when_archived:
            raise GroupArchived(f"group {command.group!r} is archived and accepts no Commands")
        if spec.system_only:
            if not trusted:
                raise Unauthorized(f"{command.kind} is issued by the engine only", kind=command.kind)
            member = None
        else:
            member = view.get(member_key(command.actor))
            if member is None or member.get("status") != "active":
                raise NotAMember(f"{command.actor!r} is not a member of group {command.group!r}", actor=command.actor)
            if spec.roles is not None and member.get("role") not in spec.roles:
                raise Unauthorized(
                    f"role {member.get('role')!r} may not issue {command.kind}", kind=command.kind, role=member.get("role")
                )
            public_key = member.get("public_key")
            if public_key:
                verify_signature(bytes.fromhex(public_key), data if data is not None else command_bytes(command), command.signature)

    key = aggregate_key(spec.aggregate_type, command.target)
    current = view.revision(key)
    if command.expected_revision is not None and command.expected_revision != current:
        raise RevisionMismatch(
            f"{key} is at revision {current}, not {command.expected_revision}; re-read and retry",
            current_revision=current,
            aggregate=key,
        )
    if spec.compare_and_set and command.expected_revision is None:
        raise InvalidCommand(f"{command.kind} is compare-and-set: give expected_revision", field="expected_revision")

    context = Context(command.group, now_ms, member, seq)
    decision = spec.decide(view, command, context)
    body = decision.body
    authoritative = decision.authoritative
    canonical.check_content(body, "event body")
    group = command.group
    # The draft is what ``evolve`` sees: the Event as decided, before its effects, new revision
    # and hashes are known. The accepted Event is the draft with those four fields filled in.
    # Both are made with positional fields, in Event's order: 16 keywords cost about 0.8 us more
    # per Event (docs/performance.md, "accept_many of 100").
    event_id = make_event_id(group, seq)
    actor, action_id, kind = command.actor, command.action_id, command.kind
    draft = Event(
        group, seq, event_id, kind, key, current, actor, action_id, content_hash, now_ms, authoritative, body, [],
        ZERO_HASH, prev_hash, ZERO_HASH,
    )
    effects: list[Effect] = []
    revision = current
    if authoritative:
        changes = spec.evolve(view, draft)
        for changed_key in sorted(changes):
            if changed_key == key:  # its revision was read above; evolve cannot change the view
                new_revision = revision = current + 1
            else:
                new_revision = view.revision(changed_key) + 1
            effects.append(Effect(changed_key, new_revision, changes[changed_key]))
    payload = payload_hash_of(body)
    digest = event_hash_of_fields(
        (group, seq, event_id, kind, key, revision, actor, action_id, content_hash, now_ms, authoritative),
        effects,
        payload,
        prev_hash,
    )
    return Event(
        group, seq, event_id, kind, key, revision, actor, action_id, content_hash, now_ms, authoritative, body, effects,
        payload, prev_hash, digest,
    )


# -- In-memory driver (for rule tests and reference models; no disk) ----------------------------


def _memory_key(key: object) -> str:
    """An aggregate key of ``MemoryGroup``'s reads: a str (a bytearray's lookup was a TypeError)."""
    if type(key) is not str:
        raise InvalidCommand(f"an aggregate key is a str, not {type(key).__name__}", field="key")
    return key


@dataclass
class MemoryGroup:
    """One Group's aggregates in memory, driven by the same pipeline as the engine.

    No idempotency receipts and no durability: it exists so rules can be tested as pure functions.
    """

    group: str
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    revisions: dict[str, int] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.states.get(_memory_key(key))

    def revision(self, key: str) -> int:
        return self.revisions.get(_memory_key(key), 0)

    @property
    def head_hash(self) -> bytes:
        return self.events[-1].hash if self.events else ZERO_HASH

    def accept(self, command: Command, *, now_ms: int, trusted: bool = False) -> Event:
        from .messages import check_command

        check_command(command)
        data = command_bytes(command)
        event = run_transition(
            self,
            command,
            seq=len(self.events) + 1,
            now_ms=now_ms,
            prev_hash=self.head_hash,
            content_hash=canonical.content_hash(data),
            data=data,
            trusted=trusted,
        )
        self.apply(event)
        return event

    def apply(self, event: Event) -> None:
        apply_effects(self.states, self.revisions, event.effects)
        self.events.append(event)


def apply_effects(
    states: dict[str, dict[str, Any]], revisions: dict[str, int], effects: Iterable[Effect]
) -> None:
    for effect in effects:
        revisions[effect.aggregate] = effect.revision
        if effect.state is None:
            states.pop(effect.aggregate, None)
        else:
            states[effect.aggregate] = effect.state
