"""Tombstones as pure transitions: ``event.redact`` and ``audit.delete`` (``mwpstore/redaction.py``)."""

from __future__ import annotations

import msgspec
import pytest

import mwpstore.redaction  # noqa: F401  (registers the kinds even before the registry loads them)
from mwpstore.errors import AlreadyExists, GroupArchived, InvalidCommand, InvalidState, NotAMember, Unauthorized
from mwpstore import limits
from mwpstore.messages import AcceptResult, Command, check_event
from mwpstore.redaction import DAY_MS, redacted_sequences, tombstone_key
from mwpstore.registry import MemoryGroup


def command(kind: str, target: str, body: dict | None = None, *, actor: str = "alice", action: str | None = None) -> Command:
    return Command(actor=actor, action_id=action or f"{kind}-{target}", group="g1", kind=kind, target=target, body=body or {})


def make_group(policy: dict | None = None) -> MemoryGroup:
    memory = MemoryGroup("g1")
    memory.accept(command("group.create", "g1", {"org": "acme", "policy": policy or {}}), now_ms=1000)
    memory.accept(command("mission.create", "m1", {"title": "secret title"}), now_ms=1001)
    memory.accept(command("mission.create", "m2", {"title": "other"}), now_ms=1002)
    return memory


def test_redact_records_a_tombstone_and_keeps_the_chain():
    memory = make_group()
    event = memory.accept(command("event.redact", "2", {"reason": "personal data"}), now_ms=2000)
    assert event.kind == "event.redact" and event.body == {"seq": 2, "reason": "personal data"}
    tombstone = memory.states[tombstone_key(2)]
    assert tombstone == {
        "event_id": "g1:2",
        "seq": 2,
        "reason": "personal data",
        "actor": "alice",
        "redacted_at_ms": 2000,
        "tombstone_seq": 4,
    }
    assert memory.states["group:g1"]["tombstones"] == 1
    assert redacted_sequences((key, memory.revisions[key], state) for key, state in memory.states.items()) == [2]
    # What every read returns for the redacted Event: same ID, sequence and hash, no payload.
    redacted = msgspec.structs.replace(memory.events[1], body=None)
    previous = memory.events[0].hash
    for original in [memory.events[0], redacted, *memory.events[2:]]:
        check_event(original, expected_prev_hash=previous if original.seq > 1 else None)
        previous = original.hash
    assert redacted.event_id == "g1:2" and redacted.seq == 2 and redacted.redacted


def test_redact_accepts_a_matching_body_seq():
    memory = make_group()
    memory.accept(command("event.redact", "3", {"seq": 3, "reason": "r"}), now_ms=2000)
    assert tombstone_key(3) in memory.states


@pytest.mark.parametrize(
    "target, body",
    [
        ("0", {"reason": "r"}),
        ("02", {"reason": "r"}),
        ("g1", {"reason": "r"}),
        ("2", {"seq": 3, "reason": "r"}),
        ("2", {"seq": True, "reason": "r"}),
        ("1", {"seq": True, "reason": "r"}),  # equal to 1, but not an int sequence
        ("2", {"seq": 2.0, "reason": "r"}),
        ("2", {}),
        ("2", {"reason": ""}),
        ("2", {"reason": "r", "payload": "x"}),
        ("2", {"reason": "x" * 2000}),
    ],
)
def test_redact_refuses_malformed_commands(target, body):
    memory = make_group()
    with pytest.raises(InvalidCommand):
        memory.accept(command("event.redact", target, body), now_ms=2000)
    assert len(memory.events) == 3


@pytest.mark.parametrize("target", ["4", "5"])
def test_redact_refuses_its_own_and_later_sequences(target):
    # Head is 3: Event 4 would be the tombstone itself, 5 does not exist; neither is redactable.
    memory = make_group()
    with pytest.raises(InvalidCommand) as caught:
        memory.accept(command("event.redact", target, {"reason": "r"}), now_ms=2000)
    assert caught.value.field == "target"
    assert len(memory.events) == 3
    memory.accept(command("event.redact", "3", {"reason": "r"}), now_ms=2000)  # the head itself is redactable


def test_redact_twice_is_already_exists():
    memory = make_group()
    memory.accept(command("event.redact", "2", {"reason": "r"}, action="first"), now_ms=2000)
    with pytest.raises(AlreadyExists):
        memory.accept(command("event.redact", "2", {"reason": "again"}, action="second"), now_ms=2001)


def test_redact_is_owner_only():
    memory = make_group()
    memory.accept(
        Command(actor="alice", action_id="add-bob", group="g1", kind="membership.add", target="bob", body={"role": "worker"}, expected_revision=0),
        now_ms=1500,
    )
    with pytest.raises(Unauthorized):
        memory.accept(command("event.redact", "2", {"reason": "r"}, actor="bob"), now_ms=2000)
    with pytest.raises(NotAMember):
        memory.accept(command("event.redact", "2", {"reason": "r"}, actor="mallory"), now_ms=2000)


def test_redact_is_refused_once_archived():
    memory = make_group()
    memory.accept(command("group.archive", "g1"), now_ms=3000)
    with pytest.raises(GroupArchived):
        memory.accept(command("event.redact", "2", {"reason": "r"}), now_ms=3001)


# -- audit.delete -------------------------------------------------------------------------------------


def archived(policy: dict | None = None) -> MemoryGroup:
    memory = make_group(policy)
    memory.accept(command("group.archive", "g1"), now_ms=10_000)
    return memory


def test_audit_delete_needs_an_archived_group():
    memory = make_group({"audit_retention_days": 1})
    with pytest.raises(InvalidState):
        memory.accept(command("audit.delete", "g1", {"reason": "expired"}), now_ms=10_000 + 2 * DAY_MS)


def test_audit_delete_after_retention_expired():
    memory = archived({"audit_retention_days": 30})
    with pytest.raises(InvalidState) as info:
        memory.accept(command("audit.delete", "g1", {"reason": "expired"}), now_ms=10_000 + 30 * DAY_MS - 1)
    assert info.value.detail["expires_ms"] == 10_000 + 30 * DAY_MS
    event = memory.accept(command("audit.delete", "g1", {"reason": "expired"}), now_ms=10_000 + 30 * DAY_MS)
    assert event.body == {"reason": "expired", "basis": "retention"}
    group = memory.states["group:g1"]
    assert group["audit_log"] == "deleted" and group["audit_deleted_basis"] == "retention"
    with pytest.raises(InvalidState):
        memory.accept(command("audit.delete", "g1", {"basis": "legal"}, action="again"), now_ms=10_000 + 31 * DAY_MS)


def test_a_retention_too_long_to_end_in_the_64_bit_range_ends_at_its_bound():
    """``audit_retention_days`` may be any non-negative integer; the end of such a retention is
    reported saturated, as every time derived from a duration is, so the refusal stays encodable."""
    memory = archived({"audit_retention_days": limits.INT_ABS_MAX})
    with pytest.raises(InvalidState) as info:
        memory.accept(command("audit.delete", "g1", {"reason": "expired"}), now_ms=limits.TIME_MS_MAX)
    assert info.value.detail["expires_ms"] == limits.INT_ABS_MAX
    msgspec.msgpack.encode(AcceptResult.failed(info.value))


def test_audit_delete_when_retained_forever_needs_a_legal_basis():
    memory = archived()
    with pytest.raises(InvalidState):
        memory.accept(command("audit.delete", "g1"), now_ms=10_000 + 10_000 * DAY_MS)
    event = memory.accept(command("audit.delete", "g1", {"reason": "court order 17", "basis": "legal"}), now_ms=20_000)
    assert event.body == {"reason": "court order 17", "basis": "legal"}


@pytest.mark.parametrize("target, body", [("g2", {}), ("g1", {"basis": "whim"}), ("g1", {"extra": 1})])
def test_audit_delete_refuses_malformed_commands(target, body):
    memory = archived({"audit_retention_days": 1})
    with pytest.raises(InvalidCommand):
        memory.accept(command("audit.delete", target, body), now_ms=10_000 + 2 * DAY_MS)


def test_redacted_sequences_are_the_tombstones_present_in_order():
    """From any order of aggregates: only ``tombstone:<seq>`` keys count, one whose state is gone
    (None) does not, and the sequences come back sorted."""
    items = [
        ("tombstone:9", 1, {"seq": 9}),
        ("group:g1", 3, {"tombstones": 3}),
        ("tombstone:12", 2, None),
        ("tombstone:2", 1, {"seq": 2}),
    ]
    assert redacted_sequences(items) == [2, 9]
