"""Rule tests for the work model, one named test per rule and per rejection, on ``MemoryGroup``.

Each rejection is checked to change nothing (``Harness.reject``); each late result to be kept as
Evidence with no state change (``Harness.evidence``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import blake3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given
from hypothesis import strategies as st

from mwpstore import work_model
from mwpstore.errors import (
    AlreadyExists,
    ApprovalRequired,
    AttemptsExhausted,
    BudgetExceeded,
    DeadlinePassed,
    GroupArchived,
    InvalidCommand,
    InvalidState,
    LeaseExpired,
    LeaseMismatch,
    NotAMember,
    NotFound,
    NotReady,
    RevisionMismatch,
    SignatureInvalid,
    StaleOwnershipEpoch,
    StaleSessionEpoch,
    Unauthorized,
)
from mwpstore.registry import ENGINE_ACTOR, kind_spec
from mwpstore.work_model import (
    attempt_key,
    backoff_ms,
    external_idempotency_key,
    lapsed_workitems,
    lease_id_for,
    parse_contract,
)

from work_model_support import CONTRACT, GROUP, Harness, fence_of

RESULT_BODIES: dict[str, dict[str, Any]] = {
    "workitem.checkpoint": {"checkpoint": {"step": 1}},
    "workitem.publish": {"publication": {"note": "hello"}},
    "workitem.block": {"checkpoint": {"step": 2}, "required_resolution": "need credentials"},
    "workitem.submit": {"submission": {"answer": 42}},
    "workitem.fail": {"reason": "tool crashed"},
    "workitem.charge": {"cost": 5, "progress": {"pages": 3}},
}


@pytest.fixture
def new_harness() -> Iterator[Callable[[], Harness]]:
    """Makes fresh Harnesses (in memory here; the durable test module overrides this fixture)."""
    made: list[Harness] = []

    def make() -> Harness:
        made.append(Harness())
        return made[-1]

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def h(new_harness: Callable[[], Harness]) -> Harness:
    return new_harness().setup()


# -- MWP-WRK-031 / MWP-WRK-018: keys --------------------------------------------------------------


def test_wrk_031_external_idempotency_key_is_stable() -> None:
    first = external_idempotency_key("m1", "wi1", 3, "send-email")
    assert first == external_idempotency_key("m1", "wi1", 3, "send-email")
    assert len(first) == 64 and int(first, 16) >= 0


def test_wrk_031_external_idempotency_key_changes_with_every_part() -> None:
    base = external_idempotency_key("m1", "wi1", 3, "send-email")
    assert external_idempotency_key("m2", "wi1", 3, "send-email") != base
    assert external_idempotency_key("m1", "wi2", 3, "send-email") != base
    assert external_idempotency_key("m1", "wi1", 4, "send-email") != base
    assert external_idempotency_key("m1", "wi1", 3, "send-sms") != base


def test_wrk_031_key_parts_are_length_prefixed() -> None:
    assert external_idempotency_key("ab", "c", 1, "op") != external_idempotency_key("a", "bc", 1, "op")
    assert attempt_key("ab", "c", 1) != attempt_key("a", "bc", 1)


def test_wrk_031_keys_are_domain_separated() -> None:
    assert attempt_key("m1", "wi1", 1) != external_idempotency_key("m1", "wi1", 1, "x")


def _documented_key(domain: bytes, *parts: str | int) -> str:
    """A key as docs/work-model.md specifies it, written here from the doc alone: blake3 over the
    domain tag and the parts, each text part as its UTF-8 length (8 bytes big-endian) and bytes,
    each integer part as 8 (8 bytes big-endian) and the value (8 bytes big-endian)."""
    data = domain
    for part in parts:
        if isinstance(part, str):
            encoded = part.encode("utf-8")
            data += len(encoded).to_bytes(8, "big") + encoded
        else:
            data += (8).to_bytes(8, "big") + part.to_bytes(8, "big")
    return blake3.blake3(data).hexdigest()


@pytest.mark.parametrize(
    "mission, workitem, number, text", [("m1", "wi1", 3, "send-email"), ("mé", "ü-2", 0, "ø")], ids=["ascii", "utf-8"]
)
def test_wrk_031_keys_are_the_documented_bytes(mission: str, workitem: str, number: int, text: str) -> None:
    # Agents keep these keys in their outboxes and receivers remember them: a key must never change
    # between versions, so its derivation is pinned to the documented bytes, not just to stability.
    assert external_idempotency_key(mission, workitem, number, text) == _documented_key(
        b"mwpstore/external-idempotency/v1\x00", mission, workitem, number, text
    )
    assert attempt_key(mission, workitem, number) == _documented_key(b"mwpstore/attempt/v1\x00", mission, workitem, number)
    assert lease_id_for(mission, workitem, number) == _documented_key(b"mwpstore/lease/v1\x00", mission, workitem, number)[:32]
    assert lease_id_for("g2", workitem, number) != lease_id_for(mission, workitem, number)


@pytest.mark.parametrize(
    "args, field",
    [
        (("", "wi1", 1, "op"), "mission_id"),
        (("m1", 7, 1, "op"), "workitem_id"),
        (("m1", "wi1", -1, "op"), "ownership_epoch"),
        (("m1", "wi1", True, "op"), "ownership_epoch"),
        (("m1", "wi1", 1, ""), "operation_id"),
    ],
)
def test_wrk_031_key_rejects_bad_parts(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(InvalidCommand) as caught:
        external_idempotency_key(*args)
    assert caught.value.field == field


@pytest.mark.parametrize(
    "function, args, field",
    [
        (attempt_key, ("m1", "", 1), "workitem_id"),
        (attempt_key, ("m1", "wi1", -1), "attempt"),
        (lease_id_for, ("", "wi1", 1), "group_id"),
        (lease_id_for, ("g1", "wi1", 1.0), "ownership_epoch"),
    ],
)
def test_attempt_and_lease_keys_reject_bad_parts_naming_the_parameter(function: Any, args: tuple[Any, ...], field: str) -> None:
    """docs/work-model.md: bad parts raise INVALID_COMMAND naming the parameter."""
    with pytest.raises(InvalidCommand) as caught:
        function(*args)
    assert caught.value.field == field


_part = st.text(min_size=1, max_size=8)


@given(_part, _part, st.integers(0, 2**63 - 1), _part, _part, _part, st.integers(0, 2**63 - 1), _part)
def test_wrk_031_distinct_inputs_give_distinct_keys(
    m1: str, w1: str, e1: int, o1: str, m2: str, w2: str, e2: int, o2: str
) -> None:
    same = (m1, w1, e1, o1) == (m2, w2, e2, o2)
    assert (external_idempotency_key(m1, w1, e1, o1) == external_idempotency_key(m2, w2, e2, o2)) == same


def test_wrk_018_attempt_key_is_stable_per_attempt() -> None:
    assert attempt_key("m1", "wi1", 2) == attempt_key("m1", "wi1", 2)
    assert attempt_key("m1", "wi1", 2) != attempt_key("m1", "wi1", 3)


def test_wrk_018_claim_and_fail_events_carry_the_attempt_key(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    claim = h.events()[-2]
    assert claim.kind == "workitem.claim"
    assert claim.body is not None and claim.body["attempt_key"] == attempt_key("m1", "wi1", 1)
    failure = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "x"})
    assert failure.body is not None and failure.body["attempt_key"] == attempt_key("m1", "wi1", 1)


# -- Work Contract and backoff ---------------------------------------------------------------------


def test_backoff_grows_by_the_multiplier_and_is_capped() -> None:
    contract = parse_contract(CONTRACT)
    assert [backoff_ms(contract, attempt) for attempt in range(1, 7)] == [100, 200, 400, 800, 1000, 1000]


def test_backoff_with_a_rational_multiplier_is_exact() -> None:
    contract = parse_contract({**CONTRACT, "backoff_multiplier": [3, 2], "backoff_max_ms": 10_000})
    assert contract["backoff_multiplier"] == [3, 2]
    assert [backoff_ms(contract, attempt) for attempt in range(1, 5)] == [100, 150, 225, 337]


def test_backoff_rational_multiplier_is_stored_reduced() -> None:
    assert parse_contract({**CONTRACT, "backoff_multiplier": [4, 2]})["backoff_multiplier"] == 2
    assert parse_contract({**CONTRACT, "backoff_multiplier": [6, 4]})["backoff_multiplier"] == [3, 2]
    assert parse_contract({**CONTRACT, "backoff_multiplier": [7, 7]})["backoff_multiplier"] == 1


def test_backoff_for_large_attempts_stays_bounded() -> None:
    contract = parse_contract(
        {**CONTRACT, "max_attempts": 1000, "backoff_multiplier": [1_000_000, 999_999], "backoff_max_ms": 10**12}
    )
    assert 100 <= backoff_ms(contract, 1000) <= 10**12
    assert backoff_ms(parse_contract({**CONTRACT, "backoff_multiplier": 1}), 50) == 100


def test_backoff_rejects_attempt_zero() -> None:
    with pytest.raises(InvalidCommand):
        backoff_ms(parse_contract(CONTRACT), 0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"backoff_multiplier": 1.5}, "body.contract.backoff_multiplier"),
        ({"backoff_multiplier": [2, 3]}, "body.contract.backoff_multiplier"),
        ({"backoff_multiplier": 0}, "body.contract.backoff_multiplier"),
        ({"max_attempts": 0}, "body.contract.max_attempts"),
        ({"max_attempts": 1001}, "body.contract.max_attempts"),
        ({"backoff_multiplier": [1_000_001, 2]}, "body.contract.backoff_multiplier"),
        ({"backoff_multiplier": 1_000_001}, "body.contract.backoff_multiplier"),
        ({"lease_ms": 1.0}, "body.contract.lease_ms"),
        ({"cost_limit": 0}, "body.contract.cost_limit"),
        ({"backoff_max_ms": 50}, "body.contract.backoff_max_ms"),
        ({"deadline_ms": "soon"}, "body.contract.deadline_ms"),
        ({"surprise": 1}, "body.contract.surprise"),
    ],
)
def test_workitem_create_rejects_a_bad_contract(h: Harness, change: dict[str, Any], field: str) -> None:
    body = {"mission": "m1", "priority": 0, "contract": {**CONTRACT, **change}}
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9", body, field=field)


def test_workitem_create_rejects_a_missing_contract_field(h: Harness) -> None:
    contract = dict(CONTRACT)
    del contract["start_ms"]
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9", {"mission": "m1", "contract": contract},
             field="body.contract.start_ms")


# -- Who may do what: NOT_A_MEMBER, UNAUTHORIZED -----------------------------------------------------


def test_not_a_member_cannot_issue_commands(h: Harness) -> None:
    h.reject(NotAMember, "stranger", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.reject(NotAMember, "stranger", "session.replace", "stranger")


@pytest.mark.parametrize(
    "actor, kind, target, body",
    [
        ("o1", "workitem.claim", "wi1", {"session_epoch": 1}),
        ("a1", "workitem.claim", "wi1", {"session_epoch": 1}),
        ("owner", "workitem.claim", "wi1", {"session_epoch": 1}),
        ("w1", "workitem.create", "wi9", {"mission": "m1", "contract": CONTRACT}),
        ("w1", "membership.add", "x1", {"role": "worker"}),
        ("w1", "workitem.cancel", "wi1", {}),
        ("w1", "approval.decide", "ap1", {"decision": "approved"}),
        ("a1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"}),
        ("o1", "workitem.resolve", "wi1", {}),
        ("owner", "workitem.charge", "wi1", {"lease_id": lease_id_for(GROUP, "wi1", 1), "ownership_epoch": 1, "cost": 1}),
        ("owner", "approval.decide", "ap1", {"decision": "approved"}),
        ("o1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"}),
    ],
)
def test_roles_limit_the_kinds_an_actor_may_issue(
    h: Harness, actor: str, kind: str, target: str, body: dict[str, Any]
) -> None:
    h.reject(Unauthorized, actor, kind, target, body, cas=kind_spec(kind).compare_and_set)


OWNER, WORKER = frozenset({"owner"}), frozenset({"worker"})
DOCUMENTED_ROLES: dict[str, frozenset[str] | None] = {
    "membership.add": OWNER,
    "membership.change": OWNER,
    "membership.remove": OWNER,
    "session.replace": frozenset({"owner", "worker", "approver", "observer"}),
    "workitem.create": OWNER,
    "workitem.claim": WORKER,
    "workitem.start": WORKER,
    "lease.renew": WORKER,
    "workitem.checkpoint": WORKER,
    "workitem.publish": WORKER,
    "workitem.block": WORKER,
    "workitem.resolve": OWNER,
    "workitem.submit": WORKER,
    "workitem.fail": WORKER,
    "workitem.reassign": OWNER,
    "workitem.cancel": OWNER,
    "workitem.charge": WORKER,
    "lease.expire": None,
    "approval.request": WORKER,
    "approval.decide": frozenset({"approver"}),
}


def test_roles_of_every_kind_are_the_documented_ones() -> None:
    """The roles table of docs/work-model.md: exact roles, not a hierarchy."""
    assert set(DOCUMENTED_ROLES) == set(work_model.WORK_MODEL_KINDS)
    for kind, roles in DOCUMENTED_ROLES.items():
        assert kind_spec(kind).roles == roles, kind
    assert kind_spec("lease.expire").system_only


@pytest.mark.parametrize("agent", ["a1", "o1", "owner", "w1"])
def test_every_role_may_replace_its_own_session(h: Harness, agent: str) -> None:
    before = h.member(agent)["session_epoch"]
    h.accept(agent, "session.replace", agent, {"session_epoch": before})
    assert h.member(agent)["session_epoch"] == before + 1


def test_lease_expire_is_issued_by_the_engine_only(h: Harness) -> None:
    h.claim("w1", "wi1")
    h.advance(10_000)
    h.reject(Unauthorized, "owner", "lease.expire", "wi1", {})
    h.reject(Unauthorized, "w1", "lease.expire", "wi1", {})


def test_archived_group_refuses_work_model_commands(h: Harness) -> None:
    h.accept("owner", "group.archive", GROUP, {})
    h.reject(GroupArchived, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_an_archived_group_refuses_every_kind_but_audit_delete(h: Harness) -> None:
    """group.archive: "then every Command gets GROUP_ARCHIVED" (WORK_MODEL.md), before the
    actor, its role, the expected revision or the body is looked at. audit.delete alone passes
    (it deletes an archived Group's audit log, so it needs one)."""
    from mwpstore.registry import REGISTRY

    h.claim("w1", "wi1")
    h.accept("owner", "group.archive", GROUP, {})
    kind_spec("group.create")  # every kind registered
    kinds = sorted(kind for kind in REGISTRY if kind != "audit.delete" and not kind.startswith("test."))
    assert {"workitem.claim", "session.replace", "lease.expire", "event.redact", "group.create"} <= set(kinds)
    for kind in kinds:
        actor = ENGINE_ACTOR if kind_spec(kind).system_only else "w1"
        h.reject(GroupArchived, actor, kind, GROUP if kind.startswith("group.") else "wi1", {}, revision=99)
    assert kind_spec("audit.delete").allowed_when_archived


def test_group_create_of_an_archived_group_is_group_archived(h: Harness) -> None:
    """Once archived, every Command gets GROUP_ARCHIVED (WORK_MODEL.md, group.archive), a
    group.create naming the Group too: the Group exists and is archived, which ALREADY_EXISTS
    did not say. An active Group's second group.create stays ALREADY_EXISTS."""
    h.reject(AlreadyExists, "stranger", "group.create", GROUP, {"org": "org1"})
    h.accept("owner", "group.archive", GROUP, {})
    for actor in ("owner", "stranger"):
        h.reject(GroupArchived, actor, "group.create", GROUP, {"org": "org1"})


# -- Signatures ------------------------------------------------------------------------------------


def _public_hex(private_key: Ed25519PrivateKey) -> str:
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def test_member_with_a_public_key_must_sign_its_commands(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(workers=())
    key = Ed25519PrivateKey.generate()
    h.accept("owner", "membership.add", "w3", {"role": "worker", "public_key": _public_hex(key)}, cas=True)
    unsigned = h.command("w3", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.reject_command(SignatureInvalid, unsigned, field="signature")
    h.signing_keys["w3"] = Ed25519PrivateKey.generate()  # the wrong key
    h.reject(SignatureInvalid, "w3", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.signing_keys["w3"] = key
    signed = h.command("w3", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    import msgspec

    tampered = msgspec.structs.replace(signed, body={"session_epoch": 2})
    h.reject_command(SignatureInvalid, tampered)
    assert h.accept_command(signed).authoritative


def test_membership_change_rotates_and_clears_the_public_key(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(workers=())
    old, new = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    h.accept("owner", "membership.add", "w3", {"role": "worker", "public_key": _public_hex(old)}, cas=True)
    h.accept("owner", "membership.change", "w3", {"public_key": _public_hex(new)}, cas=True)
    h.signing_keys["w3"] = old
    h.reject(SignatureInvalid, "w3", "session.replace", "w3")
    h.signing_keys["w3"] = new
    h.accept("w3", "session.replace", "w3")
    h.accept("owner", "membership.change", "w3", {"public_key": None}, cas=True)
    del h.signing_keys["w3"]
    assert "public_key" not in h.member("w3")
    h.accept("w3", "session.replace", "w3")



_SIGNED_FIELD_CHANGES = [
    ("action_id", "a-other"),
    ("actor", "w9"),
    ("group", "g-other"),
    ("kind", "workitem.start"),
    ("target", "wi9"),
    ("body", {"session_epoch": 2}),
    ("expected_revision", 4),
    ("expected_revision", None),
]


@pytest.mark.parametrize("field, value", _SIGNED_FIELD_CHANGES, ids=[f"{f}={v}" for f, v in _SIGNED_FIELD_CHANGES])
def test_a_command_signature_covers_every_field_but_the_signature(field: str, value: Any) -> None:
    """The signed bytes are the canonical bytes of every Command field except the signature: a
    signature made for one Command does not verify for the same Command with any one field
    changed (an intercepted signed claim cannot be replayed at another revision, target, kind,
    Group or actor)."""
    import msgspec

    from mwpstore.messages import Command, command_bytes
    from mwpstore.offline import sign_command
    from mwpstore.registry import verify_signature

    key = Ed25519PrivateKey.generate()
    public_key = key.public_key().public_bytes_raw()
    signed = sign_command(
        Command(actor="w3", action_id="a-1", group="g-1", kind="workitem.claim", target="wi1",
                body={"session_epoch": 1}, expected_revision=3),
        key,
    )
    verify_signature(public_key, command_bytes(signed), signed.signature)
    changed = msgspec.structs.replace(signed, **{field: value})
    with pytest.raises(SignatureInvalid):
        verify_signature(public_key, command_bytes(changed), changed.signature)


@pytest.mark.parametrize("field, value", [("target", "wi2"), ("expected_revision", 0), ("action_id", "replayed")])
def test_a_signed_command_with_a_field_changed_is_refused(new_harness: Callable[[], Harness], field: str, value: Any) -> None:
    """Through the Group: a member with a registered key has its signed claim refused
    (``SignatureInvalid``) once the target, the expected revision or the Action ID is changed
    after signing; the unchanged Command is accepted."""
    import msgspec

    h = new_harness().setup(workers=())
    key = Ed25519PrivateKey.generate()
    h.accept("owner", "membership.add", "w3", {"role": "worker", "public_key": _public_hex(key)}, cas=True)
    h.signing_keys["w3"] = key
    signed = h.command("w3", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.reject_command(SignatureInvalid, msgspec.structs.replace(signed, **{field: value}), field="signature")
    assert h.accept_command(signed).authoritative


@pytest.mark.parametrize("public_key", ["zz" * 32, " " + "ab" * 31 + "a", "01" + "00" * 31, "00" * 32, 7])
def test_membership_change_checks_the_new_public_key(h: Harness, public_key: Any) -> None:
    """``membership.change`` checks a new key like ``membership.add``: 64 hex digits of a usable
    Ed25519 point, else ``InvalidCommand`` (``body.public_key``) and nothing changes."""
    h.reject(InvalidCommand, "owner", "membership.change", "w1", {"public_key": public_key}, cas=True,
             field="body.public_key")


@pytest.mark.parametrize("kind", ["membership.add", "membership.change"])
def test_a_public_key_given_in_uppercase_is_stored_in_lowercase(new_harness: Callable[[], Harness], kind: str) -> None:
    """Member keys are stored in one spelling, lowercase hex, whatever case they were given in."""
    h = new_harness().setup(workers=("w1",))
    key = _public_hex(Ed25519PrivateKey.generate())
    target = "w3" if kind == "membership.add" else "w1"
    body = {"role": "worker", "public_key": key.upper()} if kind == "membership.add" else {"public_key": key.upper()}
    h.accept("owner", kind, target, body, cas=True)
    assert h.member(target)["public_key"] == key


# -- MWP-EVT-007: compare-and-set ---------------------------------------------------------------


def test_evt_007_compare_and_set_kinds() -> None:
    cas = {kind for kind in work_model.WORK_MODEL_KINDS if kind_spec(kind).compare_and_set}
    assert cas == {
        "workitem.claim",
        "lease.renew",
        "membership.add",
        "membership.change",
        "membership.remove",
        "approval.decide",
    }


def test_evt_007_claim_without_expected_revision_is_invalid(h: Harness) -> None:
    h.reject(InvalidCommand, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, field="expected_revision")


def test_evt_007_first_ownership_goes_to_one_claimer(h: Harness) -> None:
    revision = h.revision("workitem:wi1")
    first = h.command("w1", "workitem.claim", "wi1", {"session_epoch": 1}, revision=revision)
    second = h.command("w2", "workitem.claim", "wi1", {"session_epoch": 1}, revision=revision)
    h.accept_command(first)
    error = h.reject_command(RevisionMismatch, second)
    assert error.detail["current_revision"] == revision + 1
    assert h.lease("wi1")["agent"] == "w1"


def test_evt_007_lease_renew_is_compare_and_set(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "lease.renew", "wi1", h.fence("wi1"), field="expected_revision")
    stale = h.revision("workitem:wi1") - 1
    h.reject(RevisionMismatch, "w1", "lease.renew", "wi1", h.fence("wi1"), revision=stale)


def test_evt_007_membership_changes_are_compare_and_set(h: Harness) -> None:
    h.reject(InvalidCommand, "owner", "membership.add", "w9", {"role": "worker"}, field="expected_revision")
    h.reject(RevisionMismatch, "owner", "membership.add", "w9", {"role": "worker"}, revision=1)
    h.reject(RevisionMismatch, "owner", "membership.change", "w1", {"role": "observer"}, revision=0)
    h.reject(InvalidCommand, "owner", "membership.remove", "w1", {}, field="expected_revision")
    h.accept("owner", "membership.change", "w1", {"role": "observer"}, cas=True)


def test_evt_007_approval_decision_is_compare_and_set(h: Harness) -> None:
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.reject(InvalidCommand, "a1", "approval.decide", "ap1", {"decision": "approved"}, field="expected_revision")
    h.reject(RevisionMismatch, "a1", "approval.decide", "ap1", {"decision": "approved"}, revision=2)
    h.accept("a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)


def test_evt_007_every_aggregate_an_event_changes_gets_its_own_next_revision(h: Harness) -> None:
    # A revision is per aggregate and only ever counts up: a claim changes the WorkItem and its
    # holder's Membership, a charge the WorkItem and the Mission. Were a second aggregate given
    # the target's next revision, it could go back to a value a stale expected_revision names.
    for _ in range(5):
        h.accept("owner", "mission.update", "m1", {"title": "raised"}, cas=True)
    for _ in range(3):
        h.accept("owner", "membership.change", "w1", {"role": "worker"}, cas=True)
    before = {key: h.revision(key) for key in ("workitem:wi1", "member:w1", "mission:m1")}
    claim = h.accept("w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.start("w1", "wi1")
    charge = h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 1})
    assert {effect.aggregate: effect.revision for effect in claim.effects} == {
        "workitem:wi1": before["workitem:wi1"] + 1, "member:w1": before["member:w1"] + 1,
    }
    assert {effect.aggregate: effect.revision for effect in charge.effects} == {
        "workitem:wi1": before["workitem:wi1"] + 3, "mission:m1": before["mission:m1"] + 1,
    }
    assert h.revision("member:w1") == before["member:w1"] + 1 and h.revision("mission:m1") == before["mission:m1"] + 1


@pytest.mark.parametrize(
    "kind, body, field",
    [
        ("workitem.claim", {"session_epoch": True}, "body.session_epoch"),
        ("workitem.charge", {"lease_id": lease_id_for(GROUP, "wi1", 1), "ownership_epoch": True, "cost": 1},
         "body.ownership_epoch"),
        ("workitem.charge", {"lease_id": lease_id_for(GROUP, "wi1", 1), "ownership_epoch": 1, "cost": True}, "body.cost"),
        ("workitem.create", {"mission": "m1", "priority": True, "contract": CONTRACT}, "body.priority"),
        ("workitem.create", {"mission": "m1", "not_before_ms": False, "contract": CONTRACT}, "body.not_before_ms"),
        ("workitem.create", {"mission": "m1", "contract": {**CONTRACT, "max_attempts": True}}, "body.contract.max_attempts"),
    ],
)
def test_a_boolean_is_not_an_integer_field(h: Harness, kind: str, body: dict[str, Any], field: str) -> None:
    h.claim_and_start("w1", "wi1")
    actor = "owner" if kind == "workitem.create" else "w1"
    target = "wi9" if kind == "workitem.create" else "wi1"
    h.reject(InvalidCommand, actor, kind, target, body, cas=kind_spec(kind).compare_and_set, field=field)


# -- MWP-WRK-013: the Execution Lease and what must name it ---------------------------------------


def test_wrk_013_lease_binds_agent_session_epochs_and_time_bounds(h: Harness) -> None:
    lease = h.claim("w1", "wi1")
    assert lease == {
        "lease_id": lease_id_for(GROUP, "wi1", 1),
        "agent": "w1",
        "session_epoch": 1,
        "ownership_epoch": 1,
        "granted_at_ms": h.now_ms,
        "start_by_ms": h.now_ms + CONTRACT["start_ms"],
        "expires_at_ms": h.now_ms + CONTRACT["lease_ms"],
        "started": False,
    }
    item = h.item("wi1")
    assert (item["state"], item["attempt"], item["ownership_epoch"]) == ("leased", 1, 1)
    assert h.member("w1")["leases"] == ["wi1"]


def test_wrk_013_lease_id_is_stable_and_differs_per_epoch() -> None:
    assert lease_id_for(GROUP, "wi1", 1) == lease_id_for(GROUP, "wi1", 1)
    assert len({lease_id_for(GROUP, "wi1", 1), lease_id_for(GROUP, "wi1", 2), lease_id_for(GROUP, "wi2", 1)}) == 3


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES))
def test_wrk_013_result_naming_an_older_lease_is_evidence(h: Harness, kind: str) -> None:
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {"reason": "rebalance"})
    h.claim_and_start("w2", "wi1")
    event = h.evidence("w1", kind, "wi1", {**fence_of(old), **RESULT_BODIES[kind]}, reason="stale_ownership_epoch")
    assert event.body is not None
    assert event.body["evidence"]["current_ownership_epoch"] == 2
    assert event.body["evidence"]["current_lease_id"] == lease_id_for(GROUP, "wi1", 2)


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES))
def test_wrk_013_result_naming_a_released_lease_is_evidence(h: Harness, kind: str) -> None:
    lease = h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.checkpoint", "wi1", {**fence_of(lease), "checkpoint": {"step": 1}})
    h.evidence("w1", kind, "wi1", {**fence_of(lease), **RESULT_BODIES[kind]}, reason="lease_released")


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES))
def test_wrk_013_result_naming_the_current_lease_is_authoritative(h: Harness, kind: str) -> None:
    h.claim_and_start("w1", "wi1")
    event = h.accept("w1", kind, "wi1", {**h.fence("wi1"), **RESULT_BODIES[kind]})
    assert event.authoritative and event.effects


def test_wrk_013_checkpoint_must_name_current_lease(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.checkpoint", "wi1", {"checkpoint": 1}, field="body.lease_id")
    mismatched = {"lease_id": lease_id_for(GROUP, "wi1", 2), "ownership_epoch": 1, "checkpoint": 1}
    h.reject(InvalidCommand, "w1", "workitem.checkpoint", "wi1", mismatched, field="body.lease_id")
    future = {"lease_id": lease_id_for(GROUP, "wi1", 5), "ownership_epoch": 5, "checkpoint": 1}
    h.reject(LeaseMismatch, "w1", "workitem.checkpoint", "wi1", future)


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES))
def test_wrk_013_result_naming_the_next_epoch_is_a_mismatch(h: Harness, kind: str) -> None:
    # epoch current + 1 is the one the next claim would grant: never granted yet, so no late result
    h.claim_and_start("w1", "wi1")
    following = {"lease_id": lease_id_for(GROUP, "wi1", 2), "ownership_epoch": 2}
    h.reject(LeaseMismatch, "w1", kind, "wi1", {**following, **RESULT_BODIES[kind]})
    h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1})
    h.reject(LeaseMismatch, "w1", kind, "wi1", {**following, **RESULT_BODIES[kind]})


@pytest.mark.parametrize("kind", sorted(RESULT_BODIES))
def test_wrk_013_result_naming_an_older_lease_is_stale_even_when_no_lease_is_held(h: Harness, kind: str) -> None:
    # the fence's order: an older epoch is "stale_ownership_epoch" before "lease_released" is looked at
    old = h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.checkpoint", "wi1", {**fence_of(old), "checkpoint": 1})
    h.claim_and_start("w2", "wi1")
    h.accept("w2", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 2})
    event = h.evidence("w1", kind, "wi1", {**fence_of(old), **RESULT_BODIES[kind]}, reason="stale_ownership_epoch")
    assert event.body is not None
    assert event.body["evidence"] == {
        "reason": "stale_ownership_epoch", "current_ownership_epoch": 2, "current_lease_id": None,
    }


def test_wrk_013_another_agents_current_lease_is_a_mismatch(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(LeaseMismatch, "w2", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1})
    h.reject(LeaseMismatch, "w2", "workitem.start", "wi1", h.fence("wi1"))


def test_wrk_013_start_and_renew_with_a_stale_epoch_are_rejected(h: Harness) -> None:
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    h.claim("w1", "wi1")
    h.reject(StaleOwnershipEpoch, "w1", "workitem.start", "wi1", fence_of(old))
    h.reject(StaleOwnershipEpoch, "w1", "lease.renew", "wi1", fence_of(old), cas=True)


def test_wrk_013_start_and_renew_of_a_released_lease_are_lease_mismatch(h: Harness) -> None:
    lease = h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.checkpoint", "wi1", {**fence_of(lease), "checkpoint": 1})
    h.reject(LeaseMismatch, "w1", "lease.renew", "wi1", fence_of(lease), cas=True)
    h.reject(LeaseMismatch, "w1", "workitem.start", "wi1", fence_of(lease))


# -- MWP-WRK-014: release and revoke ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, state",
    [("workitem.checkpoint", "queued"), ("workitem.block", "blocked"), ("workitem.submit", "submitted")],
)
def test_wrk_014_checkpoint_block_and_submit_release_the_lease(h: Harness, kind: str, state: str) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", kind, "wi1", {**h.fence("wi1"), **RESULT_BODIES[kind]})
    item = h.item("wi1")
    assert (item["state"], item["lease"]) == (state, None)
    assert h.member("w1")["leases"] == []


def test_wrk_014_session_replace_revokes_every_lease_and_requeues(h: Harness) -> None:
    h.create_workitem("wi2")
    old1 = h.claim_and_start("w1", "wi1")
    h.claim("w1", "wi2")
    h.advance(10)
    event = h.accept("w1", "session.replace", "w1", {"session_epoch": 1})
    assert event.body == {"session_epoch": 1, "new_session_epoch": 2, "revoked_workitems": ["wi1", "wi2"]}
    for workitem in ("wi1", "wi2"):
        item = h.item(workitem)
        assert (item["state"], item["lease"], item["not_before_ms"]) == ("queued", None, h.now_ms)
    assert h.member("w1")["leases"] == [] and h.member("w1")["session_epoch"] == 2
    # the old session's results are Evidence; its claims are stale
    h.evidence("w1", "workitem.submit", "wi1", {**fence_of(old1), "submission": 1}, reason="lease_released")
    h.reject(StaleSessionEpoch, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    assert h.claim("w1", "wi1")["session_epoch"] == 2


def test_wrk_014_session_replace_rejections(h: Harness) -> None:
    h.reject(Unauthorized, "w1", "session.replace", "w2", {})
    h.reject(StaleSessionEpoch, "w1", "session.replace", "w1", {"session_epoch": 7})
    h.reject(InvalidCommand, "w1", "session.replace", "w1", {"epoch": 1}, field="body.epoch")


@pytest.mark.parametrize(
    "actor, kind, body, state",
    [
        ("owner", "workitem.reassign", {"reason": "rebalance"}, "queued"),
        ("owner", "workitem.cancel", {"reason": "not needed"}, "cancelled"),
        ("w1", "workitem.fail", {"reason": "x"}, "queued"),
    ],
)
def test_wrk_014_reassign_cancel_and_failure_revoke_the_lease(
    h: Harness, actor: str, kind: str, body: dict[str, Any], state: str
) -> None:
    h.claim_and_start("w1", "wi1")
    if kind == "workitem.fail":
        body = {**h.fence("wi1"), **body}
    h.accept(actor, kind, "wi1", body)
    item = h.item("wi1")
    assert (item["state"], item["lease"]) == (state, None)
    assert h.member("w1")["leases"] == []


def test_wrk_014_removing_a_member_revokes_its_leases(h: Harness) -> None:
    lease = h.claim_and_start("w1", "wi1")
    event = h.accept("owner", "membership.remove", "w1", {"reason": "left"}, cas=True)
    assert event.body == {"reason": "left", "revoked_workitems": ["wi1"]}
    assert h.item("wi1")["state"] == "queued" and h.item("wi1")["lease"] is None
    assert h.member("w1")["status"] == "removed"
    h.reject(NotAMember, "w1", "workitem.submit", "wi1", {**fence_of(lease), "submission": 1})
    # re-adding keeps counting sessions, so the old process stays stale
    h.accept("owner", "membership.add", "w1", {"role": "worker"}, cas=True)
    assert h.member("w1")["session_epoch"] == 2
    h.reject(StaleSessionEpoch, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_wrk_014_demoting_a_worker_revokes_its_leases(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("owner", "membership.change", "w1", {"role": "observer"}, cas=True)
    assert h.item("wi1")["lease"] is None and h.member("w1")["leases"] == []


@pytest.mark.parametrize("role", ["approver", "owner"])
def test_wrk_014_a_worker_given_any_other_role_loses_its_leases(h: Harness, role: str) -> None:
    lease = h.claim_and_start("w1", "wi1")
    event = h.accept("owner", "membership.change", "w1", {"role": role}, cas=True)
    assert event.body == {"role": role, "revoked_workitems": ["wi1"]}
    item = h.item("wi1")
    assert (item["state"], item["lease"], item["not_before_ms"]) == ("queued", None, h.now_ms)
    assert h.member("w1")["leases"] == []
    h.accept("owner", "membership.change", "w1", {"role": "worker"}, cas=True)
    h.evidence("w1", "workitem.submit", "wi1", {**fence_of(lease), "submission": 1}, reason="lease_released")


def test_wrk_014_changing_a_workers_key_keeps_its_leases(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup()
    lease = h.claim_and_start("w1", "wi1")
    key = Ed25519PrivateKey.generate()
    event = h.accept("owner", "membership.change", "w1", {"public_key": _public_hex(key)}, cas=True)
    assert event.body == {"public_key": _public_hex(key)}
    event = h.accept("owner", "membership.change", "w1", {"role": "worker"}, cas=True)
    assert event.body == {"role": "worker"}
    assert h.lease("wi1") == lease and h.member("w1")["leases"] == ["wi1"]
    h.signing_keys["w1"] = key
    assert h.accept("w1", "workitem.submit", "wi1", {**fence_of(lease), "submission": 1}).authoritative


# -- Membership rejections ------------------------------------------------------------------------


def test_membership_add_rejections(h: Harness) -> None:
    h.reject(AlreadyExists, "owner", "membership.add", "w1", {"role": "worker"}, cas=True, field="target")
    h.reject(InvalidCommand, "owner", "membership.add", "x1", {"role": "boss"}, cas=True, field="body.role")
    h.reject(InvalidCommand, "owner", "membership.add", "x1", {"role": "worker", "public_key": "zz"}, cas=True,
             field="body.public_key")
    h.reject(InvalidCommand, "owner", "membership.add", "x1", {"role": "worker", "x": 1}, cas=True, field="body.x")


def test_membership_change_rejections(h: Harness) -> None:
    h.reject(NotFound, "owner", "membership.change", "x1", {"role": "worker"}, cas=True, field="target")
    h.reject(InvalidCommand, "owner", "membership.change", "w1", {}, cas=True, field="body")
    h.reject(InvalidCommand, "owner", "membership.change", "owner", {"role": "worker"}, cas=True, field="target")


def test_membership_remove_rejections(h: Harness) -> None:
    h.reject(InvalidCommand, "owner", "membership.remove", "owner", {}, cas=True, field="target")
    h.reject(NotFound, "owner", "membership.remove", "x1", {}, cas=True, field="target")
    h.accept("owner", "membership.remove", "w1", {}, cas=True)
    h.reject(NotFound, "owner", "membership.remove", "w1", {}, cas=True, field="target")


# -- workitem.create / claim / start / renew rejections -------------------------------------------


def test_workitem_create_rejections(h: Harness) -> None:
    h.reject(AlreadyExists, "owner", "workitem.create", "wi1", {"mission": "m1", "contract": CONTRACT})
    h.reject(NotFound, "owner", "workitem.create", "wi9", {"mission": "m9", "contract": CONTRACT}, field="body.mission")
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9", {"mission": "m1", "priority": 1.5, "contract": CONTRACT},
             field="body.priority")
    late = {**CONTRACT, "deadline_ms": h.now_ms}
    h.reject(DeadlinePassed, "owner", "workitem.create", "wi9", {"mission": "m1", "contract": late})
    h.accept("owner", "mission.close", "m1", {})
    h.reject(InvalidState, "owner", "workitem.create", "wi9", {"mission": "m1", "contract": CONTRACT})


def test_workitem_create_state_fields(h: Harness) -> None:
    item = h.item("wi1")
    assert {key: item[key] for key in ("mission", "state", "priority", "attempt", "ownership_epoch", "lease")} == {
        "mission": "m1", "state": "queued", "priority": 0, "attempt": 0, "ownership_epoch": 0, "lease": None,
    }
    assert item["checkpoint"] is None and item["required_resolution"] is None and item["submission"] is None
    assert (item["cost_spent"], item["publications"], item["not_before_ms"]) == (0, 0, 0)
    assert item["contract"] == CONTRACT


def test_workitem_claim_rejections(h: Harness) -> None:
    h.reject(NotFound, "w1", "workitem.claim", "wi9", {"session_epoch": 1}, cas=True)
    h.reject(InvalidCommand, "w1", "workitem.claim", "wi1", {}, cas=True, field="body.session_epoch")
    h.reject(StaleSessionEpoch, "w1", "workitem.claim", "wi1", {"session_epoch": 2}, cas=True)
    h.claim("w1", "wi1")
    h.reject(InvalidState, "w2", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_workitem_claim_of_a_finished_item_is_invalid_state(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1})
    h.reject(InvalidState, "w2", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_workitem_claim_in_a_closed_mission_is_invalid_state(h: Harness) -> None:
    h.accept("owner", "mission.close", "m1", {})
    h.reject(InvalidState, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_workitem_start_rejections(h: Harness) -> None:
    h.claim("w1", "wi1")
    h.start("w1", "wi1")
    h.reject(InvalidState, "w1", "workitem.start", "wi1", h.fence("wi1"))


def test_workitem_start_after_start_by_is_lease_expired(h: Harness) -> None:
    h.claim("w1", "wi1")
    h.advance(CONTRACT["start_ms"])
    error = h.reject(LeaseExpired, "w1", "workitem.start", "wi1", h.fence("wi1"))
    assert error.detail["reason"] == "start_missed"


def test_lease_renew_extends_expiry(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.advance(900)
    h.accept("w1", "lease.renew", "wi1", h.fence("wi1"), cas=True)
    assert h.lease("wi1")["expires_at_ms"] == h.now_ms + CONTRACT["lease_ms"]
    h.advance(900)
    assert h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1}).authoritative


def test_lease_renew_after_expiry_is_lease_expired(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])
    error = h.reject(LeaseExpired, "w1", "lease.renew", "wi1", h.fence("wi1"), cas=True)
    assert error.detail["reason"] == "expired"


# -- MWP-WRK-017: blocked work ------------------------------------------------------------------------


def test_wrk_017_block_checkpoints_records_resolution_and_frees_the_slot(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.block", "wi1", {**h.fence("wi1"), "checkpoint": {"step": 4}, "required_resolution": "key"})
    item = h.item("wi1")
    assert (item["state"], item["checkpoint"], item["required_resolution"], item["lease"]) == (
        "blocked", {"step": 4}, "key", None,
    )
    assert h.member("w1")["leases"] == []
    h.reject(InvalidState, "w2", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.advance(5)
    event = h.accept("owner", "workitem.resolve", "wi1", {"resolution": "key provided"})
    assert event.body == {"resolution": "key provided", "required_resolution": "key"}
    item = h.item("wi1")
    assert (item["state"], item["required_resolution"], item["not_before_ms"]) == ("queued", None, h.now_ms)
    assert item["checkpoint"] == {"step": 4}
    assert h.claim("w2", "wi1")["ownership_epoch"] == 2


def test_wrk_017_block_needs_a_checkpoint_and_a_required_resolution(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.block", "wi1", {**h.fence("wi1"), "checkpoint": 1},
             field="body.required_resolution")
    h.reject(InvalidCommand, "w1", "workitem.block", "wi1", {**h.fence("wi1"), "required_resolution": "x"},
             field="body.checkpoint")


def test_wrk_017_resolve_rejections(h: Harness) -> None:
    h.reject(InvalidState, "owner", "workitem.resolve", "wi1", {})
    h.reject(NotFound, "owner", "workitem.resolve", "wi9", {})
    h.reject(Unauthorized, "w1", "workitem.resolve", "wi1", {})


# -- MWP-WRK-018: retries within the Work Contract -------------------------------------------------


def test_wrk_018_failure_requeues_after_the_backoff(h: Harness) -> None:
    for attempt, delay in [(1, 100), (2, 200)]:
        h.claim_and_start("w1", "wi1")
        event = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
        assert event.body is not None
        assert (event.body["outcome"], event.body["attempt"], event.body["not_before_ms"]) == (
            "queued", attempt, h.now_ms + delay,
        )
        item = h.item("wi1")
        assert (item["state"], item["not_before_ms"], item["failure"]) == ("queued", h.now_ms + delay, "flaky")
        h.reject(NotReady, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
        h.advance(delay)


def test_wrk_018_failure_of_the_last_attempt_is_terminal(h: Harness) -> None:
    for _ in range(CONTRACT["max_attempts"]):
        h.claim_and_start("w1", "wi1")
        h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
        h.advance(10_000)
    assert h.item("wi1")["state"] == "failed" and h.item("wi1")["attempt"] == CONTRACT["max_attempts"]


def test_wrk_018_claim_beyond_the_attempt_limit_is_refused(h: Harness) -> None:
    for _ in range(CONTRACT["max_attempts"]):
        h.claim_and_start("w1", "wi1")
        h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1})
    h.reject(AttemptsExhausted, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_wrk_018_failure_with_the_budget_spent_is_terminal(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": CONTRACT["cost_limit"]})
    h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
    assert h.item("wi1")["state"] == "failed"


def test_wrk_018_claim_with_the_budget_spent_is_refused(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": CONTRACT["cost_limit"]})
    h.accept("w1", "workitem.checkpoint", "wi1", {**h.fence("wi1"), "checkpoint": 1})
    h.reject(BudgetExceeded, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_wrk_018_failure_whose_retry_would_miss_the_deadline_is_terminal(new_harness: Callable[[], Harness]) -> None:
    h = new_harness()
    h.setup(contract={**CONTRACT, "deadline_ms": h.now_ms + 150})
    h.claim_and_start("w1", "wi1")
    h.advance(60)
    event = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
    assert event.body is not None and event.body["outcome"] == "failed"


@pytest.mark.parametrize("slack, outcome", [(1, "queued"), (0, "failed")])
def test_wrk_018_failure_whose_retry_falls_on_the_deadline_is_terminal(
    new_harness: Callable[[], Harness], slack: int, outcome: str
) -> None:
    # no claim at or after the deadline, so a retry whose not-before is the deadline could never run
    h = new_harness()
    h.setup(contract={**CONTRACT, "deadline_ms": h.now_ms + 150 + slack})
    h.claim_and_start("w1", "wi1")
    h.advance(50)  # the retry would be ready at now + backoff (100) = start + 150
    event = h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "flaky"})
    assert event.body is not None and event.body["outcome"] == outcome
    assert h.item("wi1")["state"] == outcome


def test_wrk_018_claim_after_the_deadline_is_refused(new_harness: Callable[[], Harness]) -> None:
    h = new_harness()
    h.setup(contract={**CONTRACT, "deadline_ms": h.now_ms + 500})
    h.advance(500)
    h.reject(DeadlinePassed, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_wrk_018_non_retryable_failure_is_terminal(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "x", "retryable": 0},
             field="body.retryable")
    h.reject(InvalidCommand, "w1", "workitem.fail", "wi1", h.fence("wi1"), field="body.reason")
    h.accept("w1", "workitem.fail", "wi1", {**h.fence("wi1"), "reason": "bad input", "retryable": False})
    assert h.item("wi1")["state"] == "failed"


# -- MWP-WRK-019: takeover after a missed start or renewal ------------------------------------------


def test_wrk_019_missed_start_lets_a_new_owner_take_over(h: Harness) -> None:
    old = h.claim("w1", "wi1")
    h.reject(InvalidState, "w2", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    h.advance(CONTRACT["start_ms"])
    event = h.accept("w2", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    assert event.body is not None and event.body["replaced_lease_id"] == old["lease_id"]
    new = h.lease("wi1")
    assert new["ownership_epoch"] == old["ownership_epoch"] + 1 and new["agent"] == "w2"
    assert h.member("w1")["leases"] == [] and h.member("w2")["leases"] == ["wi1"]


def test_wrk_019_missed_renewal_new_owner_resumes_from_checkpoint_late_results_are_evidence(h: Harness) -> None:
    first = h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.checkpoint", "wi1", {**fence_of(first), "checkpoint": {"page": 7}})
    second = h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])  # w1 misses its renewal
    third = h.claim_and_start("w2", "wi1")
    assert third["ownership_epoch"] == second["ownership_epoch"] + 1
    assert h.item("wi1")["checkpoint"] == {"page": 7}
    h.evidence("w1", "workitem.submit", "wi1", {**fence_of(second), "submission": "late"}, reason="stale_ownership_epoch")
    h.accept("w2", "workitem.submit", "wi1", {**fence_of(third), "submission": "on time"})
    assert h.item("wi1")["submission"]["result"] == "on time"
    assert h.item("wi1")["submission"]["ownership_epoch"] == third["ownership_epoch"]


def test_wrk_019_results_under_a_lapsed_lease_are_evidence_before_any_sweep(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.advance(CONTRACT["lease_ms"])
    h.evidence("w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1}, reason="lease_expired")
    h.evidence("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 1}, reason="lease_expired")


def test_evt_007_a_late_result_with_a_stale_expected_revision_is_rejected_not_evidence(h: Harness) -> None:
    # A result sent as a conditional write (expected_revision) whose condition no longer holds is
    # refused whole (MWP-EVT-007), even where the same result sent plainly would be Evidence.
    old = h.claim_and_start("w1", "wi1")
    seen = h.revision(h.key_of("workitem.submit", "wi1"))
    h.accept("owner", "workitem.reassign", "wi1", {"reason": "rebalance"})
    h.claim_and_start("w2", "wi1")
    late = {**fence_of(old), "submission": "late"}
    error = h.reject(RevisionMismatch, "w1", "workitem.submit", "wi1", late, revision=seen)
    assert error.detail["current_revision"] == h.revision(h.key_of("workitem.submit", "wi1")) != seen
    h.evidence("w1", "workitem.submit", "wi1", late, reason="stale_ownership_epoch")


def test_wrk_019_no_second_authoritative_submission(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    fence = h.fence("wi1")
    assert h.accept("w1", "workitem.submit", "wi1", {**fence, "submission": 1}).authoritative
    h.evidence("w1", "workitem.submit", "wi1", {**fence, "submission": 2}, reason="lease_released")
    assert h.item("wi1")["submission"]["result"] == 1


def test_wrk_019_lapsed_workitems_finds_missed_starts_and_expiries() -> None:
    lease = {"started": False, "start_by_ms": 100, "expires_at_ms": 500}
    items: list[tuple[str, dict[str, Any]]] = [
        ("a", {"lease": lease}),
        ("b", {"lease": {**lease, "started": True}}),
        ("c", {"lease": None}),
    ]
    assert lapsed_workitems(items, 99) == []
    assert lapsed_workitems(items, 100) == ["a"]
    assert lapsed_workitems(items, 500) == ["a", "b"]


def test_wrk_019_lease_expire_naming_a_lease_a_takeover_replaced_is_lease_mismatch(h: Harness) -> None:
    """The sweep against a concurrent claim: a lease.expire that names the lapsed lease another
    worker's claim has just replaced (same millisecond) is LEASE_MISMATCH and changes nothing; the
    new owner's live lease is not expirable (INVALID_STATE)."""
    lapsed = h.claim("w1", "wi1")
    h.advance(CONTRACT["start_ms"])
    assert lapsed_workitems(h.workitem_states(), h.now_ms) == ["wi1"]
    taken = h.claim("w2", "wi1")
    h.reject(LeaseMismatch, ENGINE_ACTOR, "lease.expire", "wi1", {"lease_id": lapsed["lease_id"]})
    h.reject(InvalidState, ENGINE_ACTOR, "lease.expire", "wi1", {})
    assert h.lease("wi1") == taken and h.member("w1")["leases"] == [] and h.member("w2")["leases"] == ["wi1"]


def test_wrk_019_lease_expire_sweep_requeues_lapsed_work(h: Harness) -> None:
    h.create_workitem("wi2")
    lease = h.claim("w1", "wi1")
    h.claim_and_start("w2", "wi2")
    assert lapsed_workitems(h.workitem_states(), h.now_ms) == []
    h.reject(InvalidState, ENGINE_ACTOR, "lease.expire", "wi1", {})
    h.advance(CONTRACT["start_ms"])
    assert lapsed_workitems(h.workitem_states(), h.now_ms) == ["wi1"]
    h.reject(LeaseMismatch, ENGINE_ACTOR, "lease.expire", "wi1", {"lease_id": lease_id_for(GROUP, "wi1", 9)})
    event = h.accept(ENGINE_ACTOR, "lease.expire", "wi1", {"lease_id": lease["lease_id"]})
    assert event.authoritative and event.body == {
        "lease_id": lease["lease_id"], "agent": "w1", "ownership_epoch": 1, "reason": "start_missed",
    }
    item = h.item("wi1")
    assert (item["state"], item["lease"], item["not_before_ms"]) == ("queued", None, h.now_ms)
    assert h.member("w1")["leases"] == []
    h.reject(InvalidState, ENGINE_ACTOR, "lease.expire", "wi1", {})
    h.reject(NotFound, ENGINE_ACTOR, "lease.expire", "wi9", {})


# -- MWP-WRK-022: reconciliation and its charge are one transition ---------------------------------


def test_wrk_022_charge_records_progress_and_cost_in_one_transition(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    event = h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 7, "progress": {"rows": 10}})
    assert sorted(effect.aggregate for effect in event.effects) == ["mission:m1", "workitem:wi1"]
    assert h.item("wi1")["cost_spent"] == 7 and h.item("wi1")["progress"] == {"rows": 10}
    assert h.mission()["cost_spent"] == 7
    assert h.lease("wi1")["agent"] == "w1"  # the lease is kept


def test_wrk_022_charge_without_progress_keeps_the_latest_progress(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 1, "progress": {"rows": 10}})
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 2})
    item = h.item("wi1")
    assert (item["cost_spent"], item["progress"]) == (3, {"rows": 10})


def test_wrk_022_mission_limit_cannot_drop_below_what_was_spent(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 40})
    h.reject(InvalidCommand, "owner", "mission.update", "m1", {"cost_limit": 39}, cas=True, field="body.cost_limit")
    h.accept("owner", "mission.update", "m1", {"cost_limit": 40}, cas=True)
    assert (h.mission()["cost_limit"], h.mission()["cost_spent"]) == (40, 40)
    h.reject(BudgetExceeded, "w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 1})


def test_closed_mission_is_neither_updated_nor_closed_again(h: Harness) -> None:
    h.accept("owner", "mission.close", "m1", {"reason": "done"})
    assert h.mission()["status"] == "closed"
    h.reject(InvalidState, "owner", "mission.update", "m1", {"title": "again"}, cas=True)
    h.reject(InvalidState, "owner", "mission.close", "m1", {})


def test_wrk_022_workitem_budget_overflow_rejects_charge_and_progress(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 45})
    error = h.reject(BudgetExceeded, "w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 6, "progress": 1})
    assert error.detail["scope"] == "workitem"
    assert h.item("wi1")["progress"] is None and h.mission()["cost_spent"] == 45


def test_wrk_022_mission_budget_overflow_rejects_charge_and_progress(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(mission_cost_limit=60, workitems=("wi1", "wi2"))
    h.claim_and_start("w1", "wi1")
    h.claim_and_start("w2", "wi2")
    h.accept("w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 40})
    error = h.reject(BudgetExceeded, "w2", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 21, "progress": 1})
    assert error.detail["scope"] == "mission"
    assert h.item("wi2")["cost_spent"] == 0 and h.item("wi2")["progress"] is None
    h.accept("w2", "workitem.charge", "wi2", {**h.fence("wi2"), "cost": 20})
    assert h.mission()["cost_spent"] == 60


def test_wrk_022_charge_rejections(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": -1}, field="body.cost")
    h.reject(InvalidCommand, "w1", "workitem.charge", "wi1", {**h.fence("wi1"), "cost": 1.5}, field="body.cost")
    h.reject(InvalidCommand, "w1", "workitem.charge", "wi1", {**h.fence("wi1")}, field="body.cost")


# -- Approvals ---------------------------------------------------------------------------------------


def test_approval_required_for_submit(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(approval_required=("submit",), workitems=("wi1", "wi2"))
    h.claim_and_start("w1", "wi1")
    body = {**h.fence("wi1"), "submission": 1}
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", body)
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap-missing"})
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit", "reason": "ready"})
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap1"})
    h.accept("w1", "approval.request", "ap2", {"workitem": "wi2", "operation": "submit"})
    h.accept("a1", "approval.decide", "ap2", {"decision": "approved"}, cas=True)
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap2"})
    h.accept("w1", "approval.request", "ap3", {"workitem": "wi1", "operation": "publish"})
    h.accept("a1", "approval.decide", "ap3", {"decision": "approved"}, cas=True)
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap3"})
    h.accept("a1", "approval.decide", "ap1", {"decision": "approved", "reason": "looks good"}, cas=True)
    assert h.accept("w1", "workitem.submit", "wi1", {**body, "approval": "ap1"}).authoritative


def test_approval_gate_is_read_when_the_result_is_decided(new_harness: Callable[[], Harness]) -> None:
    """The Mission's approval_required is read when the submission is decided, not at the claim:
    an operation that needs an Approval from a mission.update after the claim is refused
    (APPROVAL_REQUIRED) until an approved Approval is named, and one named while still pending
    does not pass."""
    h = new_harness().setup()
    h.claim_and_start("w1", "wi1")
    body = {**h.fence("wi1"), "submission": 1}
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.accept("owner", "mission.update", "m1", {"approval_required": ["submit"]}, cas=True)
    h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", body)
    error = h.reject(ApprovalRequired, "w1", "workitem.submit", "wi1", {**body, "approval": "ap1"})
    assert error.detail["approval_state"] == "pending"
    h.accept("a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)
    assert h.accept("w1", "workitem.submit", "wi1", {**body, "approval": "ap1"}).authoritative


def test_rejected_approval_does_not_allow_the_operation(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(approval_required=("publish",))
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "publish"})
    h.accept("a1", "approval.decide", "ap1", {"decision": "rejected"}, cas=True)
    error = h.reject(ApprovalRequired, "w1", "workitem.publish", "wi1",
                     {**h.fence("wi1"), "publication": 1, "approval": "ap1"})
    assert error.detail["approval_state"] == "rejected"


@pytest.mark.parametrize("kind", ["workitem.publish", "workitem.submit"])
def test_late_result_on_an_approval_gated_mission_is_evidence_without_an_approval(
    new_harness: Callable[[], Harness], kind: str
) -> None:
    # the fence comes first: a late result is kept as Evidence; the gate applies to authoritative ones
    h = new_harness().setup(approval_required=("publish", "submit"))
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {"reason": "rebalance"})
    h.claim_and_start("w2", "wi1")
    h.evidence("w1", kind, "wi1", {**fence_of(old), **RESULT_BODIES[kind]}, reason="stale_ownership_epoch")
    h.reject(ApprovalRequired, "w2", kind, "wi1", {**h.fence("wi1"), **RESULT_BODIES[kind]})


def test_approval_state_fields(h: Harness) -> None:
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    approval = h.get("approval:ap1")
    assert approval is not None
    assert (approval["workitem"], approval["operation"], approval["state"]) == ("wi1", "submit", "pending")
    h.accept("a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)
    approval = h.get("approval:ap1")
    assert approval is not None
    assert (approval["state"], approval["decided_by"]) == ("approved", "a1")


def test_approval_request_rejections(h: Harness) -> None:
    h.reject(NotFound, "w1", "approval.request", "ap1", {"workitem": "wi9", "operation": "submit"},
             field="body.workitem")
    h.reject(InvalidCommand, "w1", "approval.request", "ap1", {"workitem": "wi1"}, field="body.operation")
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.reject(AlreadyExists, "w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})


def test_approval_decide_rejections(h: Harness) -> None:
    h.reject(NotFound, "a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)
    h.accept("w1", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.reject(InvalidCommand, "a1", "approval.decide", "ap1", {"decision": "maybe"}, cas=True, field="body.decision")
    h.accept("a1", "approval.decide", "ap1", {"decision": "rejected"}, cas=True)
    h.reject(InvalidState, "a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)


# -- publish, submit, reassign, cancel ----------------------------------------------------------------


def test_publish_counts_and_keeps_the_lease(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    for number in (1, 2):
        event = h.accept("w1", "workitem.publish", "wi1", {**h.fence("wi1"), "publication": {"n": number}})
        assert event.body is not None and event.body["publication_number"] == number
    assert h.item("wi1")["publications"] == 2 and h.item("wi1")["state"] == "leased"


def test_result_rejections(h: Harness) -> None:
    h.reject(NotFound, "w1", "workitem.submit", "wi9", {"lease_id": "x", "ownership_epoch": 1, "submission": 1})
    h.claim_and_start("w1", "wi1")
    h.reject(InvalidCommand, "w1", "workitem.submit", "wi1", h.fence("wi1"), field="body.submission")
    h.reject(InvalidCommand, "w1", "workitem.publish", "wi1", h.fence("wi1"), field="body.publication")
    h.reject(InvalidCommand, "w1", "workitem.checkpoint", "wi1", h.fence("wi1"), field="body.checkpoint")
    h.reject(InvalidCommand, "w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1, "extra": 1},
             field="body.extra")
    h.reject(InvalidCommand, "w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1, "approval": "../x"},
             field="body.approval")


def test_submission_records_the_lease_it_was_made_under(h: Harness) -> None:
    lease = h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.submit", "wi1", {**fence_of(lease), "submission": {"answer": 42}})
    assert h.item("wi1")["submission"] == {
        "result": {"answer": 42},
        "lease_id": lease["lease_id"],
        "ownership_epoch": 1,
        "attempt": 1,
        "agent": "w1",
        "submitted_at_ms": h.now_ms,
    }


def test_reassign_rejections(h: Harness) -> None:
    h.reject(InvalidState, "owner", "workitem.reassign", "wi1", {})
    h.reject(NotFound, "owner", "workitem.reassign", "wi9", {})


def test_cancel_rejections(h: Harness) -> None:
    h.accept("owner", "workitem.cancel", "wi1", {})
    h.reject(InvalidState, "owner", "workitem.cancel", "wi1", {})
    h.reject(InvalidState, "w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)


def test_cancel_of_blocked_work(h: Harness) -> None:
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.block", "wi1", {**h.fence("wi1"), "checkpoint": {"step": 3}, "required_resolution": "key"})
    event = h.accept("owner", "workitem.cancel", "wi1", {"reason": "not needed"})
    assert event.body == {"reason": "not needed", "revoked_lease": None}
    item = h.item("wi1")
    assert (item["state"], item["lease"], item["checkpoint"]) == ("cancelled", None, {"step": 3})
    h.reject(InvalidState, "owner", "workitem.resolve", "wi1", {})


def test_cancel_of_submitted_or_failed_work_is_invalid_state(new_harness: Callable[[], Harness]) -> None:
    h = new_harness().setup(workitems=("wi1", "wi2"))
    h.claim_and_start("w1", "wi1")
    h.accept("w1", "workitem.submit", "wi1", {**h.fence("wi1"), "submission": 1})
    h.claim_and_start("w1", "wi2")
    h.accept("w1", "workitem.fail", "wi2", {**h.fence("wi2"), "reason": "bad input", "retryable": False})
    for workitem, state in (("wi1", "submitted"), ("wi2", "failed")):
        error = h.reject(InvalidState, "owner", "workitem.cancel", workitem, {})
        assert error.detail["state"] == state
