"""Rule tests for the one transition pipeline (``mwpstore/registry.py``) and the Event / Receipt
messages and hash chain (``mwpstore/messages.py``): the checks every Command kind goes through
before and after its ``decide`` / ``evolve`` (docs/work-model.md, top section and Roles;
docs/api.md, Commands, Events and receipts; docs/format/canonical.md)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from mwpstore import limits
from mwpstore.errors import AlreadyExists, EventInvalid, InvalidCommand, LimitExceeded, NotAMember, NotFound, Unauthorized
from mwpstore.messages import Effect, Event, check_event, receipt_for
from mwpstore.registry import ENGINE_ACTOR, apply_effects

from test_work_model import h, new_harness  # noqa: F401  (fixtures)
from work_model_support import GROUP, Harness

# -- Before decide: the Group, the actor ---------------------------------------------------------


def test_a_command_to_a_group_that_does_not_exist_is_not_found_naming_the_group() -> None:
    empty = Harness()
    error = empty.reject(NotFound, "owner", "mission.create", "m1", {"title": "t", "cost_limit": 1}, field="group")
    assert GROUP in error.message


@pytest.mark.parametrize("actor", ["owner", "stranger"])
def test_group_create_of_an_existing_group_is_already_exists_whoever_sends_it(h: Harness, actor: str) -> None:
    """``group.create`` skips the membership checks (there is no Membership before it): creating a
    Group that exists is ``ALREADY_EXISTS`` for its owner and for an agent that is no member alike."""
    h.reject(AlreadyExists, actor, "group.create", GROUP, {"org": "org2"}, field="group")


def test_a_trusted_command_of_a_member_kind_is_checked_like_any_other(h: Harness) -> None:
    """Trust exempts only the engine-only kinds from the actor checks (docs/api.md,
    ``accept_trusted``): the engine actor, which is no member, is ``NOT_A_MEMBER`` for any other
    kind, and a member's trusted Command still needs a role that may issue the kind."""
    h.reject(NotAMember, ENGINE_ACTOR, "workitem.cancel", "wi1", {})
    command = h.command("o1", "workitem.cancel", "wi1", {})
    before = h.snapshot()
    with pytest.raises(Unauthorized):
        h.group.accept(command, now_ms=h.now_ms, trusted=True)
    assert h.snapshot() == before


# -- Events: payload hash, redaction --------------------------------------------------------------


def test_check_event_compares_an_empty_body_with_the_payload_hash(h: Harness) -> None:
    """A present body is checked against ``payload_hash`` even when it is empty: an Event whose
    body was swapped for ``{}`` still has a valid chain hash (the chain commits to the payload
    hash, not the body), so only this check can refuse it."""
    event = h.events()[0]
    assert event.body
    check_event(event)
    emptied = msgspec.structs.replace(event, body={})
    with pytest.raises(EventInvalid) as caught:
        check_event(emptied)
    assert caught.value.detail["reason"] == "payload_hash"


def test_an_event_is_redacted_exactly_when_its_body_is_none(h: Harness) -> None:
    event: Event = h.events()[0]
    assert not event.redacted
    assert msgspec.structs.replace(event, body=None).redacted
    assert not msgspec.structs.replace(event, body={}).redacted


# -- After decide: the Event body, Evidence ------------------------------------------------------


def test_an_evidence_body_past_the_item_bound_is_refused_and_appends_nothing(h: Harness) -> None:
    """The pipeline checks the body ``decide`` built against the content bounds, not only the
    Command's: a late checkpoint whose body is at the item bound would become Evidence with the
    ``evidence`` record added, past the bound, so it is refused (``LIMIT_EXCEEDED``) and nothing
    is appended. One item fewer than that still fits and is kept as Evidence."""
    h.claim_and_start("w1", "wi1")
    fence = h.fence("wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    # Items: the body, the list and its entries, lease_id, ownership_epoch.
    at_bound = limits.BODY_ITEMS_MAX - 4
    h.reject(LimitExceeded, "w1", "workitem.checkpoint", "wi1", {"checkpoint": [0] * at_bound, **fence})
    # The evidence record adds itself and its three fields: four items.
    fits = limits.BODY_ITEMS_MAX - 8
    event = h.evidence("w1", "workitem.checkpoint", "wi1", {"checkpoint": [0] * fits, **fence})
    assert event.body is not None and len(event.body["checkpoint"]) == fits


def test_an_effect_without_state_removes_the_aggregate_and_keeps_its_revision() -> None:
    """``Effect.state`` None means the aggregate is gone: applying it drops the state and records
    the new revision (so the key's revisions keep counting), as for every other effect."""
    states: dict[str, dict[str, Any]] = {"mission:m1": {"title": "t"}, "mission:m2": {"title": "u"}}
    revisions = {"mission:m1": 3, "mission:m2": 1}
    apply_effects(states, revisions, [Effect("mission:m1", 4, None), Effect("mission:m2", 2, {"title": "v"})])
    assert states == {"mission:m2": {"title": "v"}}
    assert revisions == {"mission:m1": 4, "mission:m2": 2}


def test_an_events_effects_are_in_aggregate_key_order(h: Harness) -> None:
    """The chain hash commits to the effects array, so its order is fixed by the aggregates it
    names (sorted by key), not by the order in which a kind's ``evolve`` happened to build its
    changes: a claim changes ``workitem:wi1`` and ``member:w1`` and lists the Membership first."""
    h.claim("w1", "wi1")
    event = h.events()[-1]
    assert [effect.aggregate for effect in event.effects] == ["member:w1", "workitem:wi1"]
    for event in h.events():
        keys = [effect.aggregate for effect in event.effects]
        assert keys == sorted(keys), event.kind


@pytest.mark.parametrize(
    "change, field",
    [({"actor": "../w1"}, "actor"), ({"kind": "Workitem.Cancel"}, "kind"), ({"expected_revision": -1}, "expected_revision")],
)
def test_the_in_memory_group_validates_a_command_before_the_pipeline(h: Harness, change: dict[str, Any], field: str) -> None:
    """``MemoryGroup`` stands for the engine in rule tests, so it checks a Command as ``accept``
    does (``INVALID_COMMAND`` naming the field) before any rule runs, and nothing changes."""
    command = msgspec.structs.replace(h.command("owner", "workitem.cancel", "wi1", {}), **change)
    h.reject_command(InvalidCommand, command, field=field)


@pytest.mark.parametrize("key", [bytearray(b"workitem:wi1"), ["workitem:wi1"], b"workitem:wi1", None])
def test_the_in_memory_groups_reads_refuse_a_key_that_is_no_str(h: Harness, key: object) -> None:
    """``MemoryGroup.get`` and ``revision`` looked the key up in a dict: an unhashable one
    (bytearray, list) was a TypeError, and bytes quietly named nothing."""
    for read in (h.group.get, h.group.revision):
        with pytest.raises(InvalidCommand) as caught:
            read(key)
        assert caught.value.field == "key"
    assert h.group.revision("workitem:wi1") >= 1 and h.group.get("workitem:wi1") is not None


def test_the_chain_hash_commits_to_whether_an_event_is_evidence(h: Harness) -> None:
    """An Evidence Event (``authoritative`` False) verifies as it was accepted, and the same Event
    claiming to be authoritative does not: the flag is part of the hashed header."""
    h.claim_and_start("w1", "wi1")
    fence = h.fence("wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    evidence = h.evidence("w1", "workitem.checkpoint", "wi1", {"checkpoint": {"step": 1}, **fence})
    assert check_event(evidence) is evidence
    assert receipt_for(evidence).authoritative is False
    with pytest.raises(EventInvalid) as caught:
        check_event(msgspec.structs.replace(evidence, authoritative=True))
    assert caught.value.detail["reason"] == "hash"
