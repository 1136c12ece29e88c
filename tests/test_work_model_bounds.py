"""Bounds on what the work model accepts from a Command: members' public keys and Work Contract
durations, and the typed error of ``backoff_ms`` for a bad attempt number.

- A public key must be exactly 64 hex digits naming a curve point that can authenticate
  anything: the canonical encoding of an Ed25519 point of order greater than 8. The curve
  arithmetic used to derive the test points is written here independently of
  ``mwpstore.registry`` (a different addition law and square root), so the two check each other.
- A Work Contract's durations are at most ``limits.WORK_DURATION_MS_MAX``, and times derived from
  a duration saturate instead of leaving the 64-bit content range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from mwpstore import Authority, Command, limits
from mwpstore.errors import InvalidCommand, MwpError, SignatureInvalid
from mwpstore.kinds import check_public_key_hex
from mwpstore.leases import time_after
from mwpstore.registry import public_key_is_usable, verify_signature
from mwpstore.work_model import backoff_ms, parse_contract

from authority_helpers import FakeClock
from work_model_support import CONTRACT, GROUP, Harness

# -- An independent model of the curve (affine coordinates, general addition law) ---------------

P = 2**255 - 19
D = -121665 * pow(121666, -1, P) % P
GROUP_ORDER = 2**252 + 27742317777372353535851937790883648493  # the prime L; the curve has 8 * L points
IDENTITY = (0, 1)
Point = tuple[int, int]


def _add(first: Point, second: Point) -> Point:
    (x1, y1), (x2, y2) = first, second
    product = D * x1 * x2 * y1 * y2 % P
    return (
        (x1 * y2 + y1 * x2) * pow(1 + product, -1, P) % P,
        (y1 * y2 + x1 * x2) * pow(1 - product, -1, P) % P,
    )


def _multiply(scalar: int, point: Point) -> Point:
    result = IDENTITY
    while scalar:
        if scalar & 1:
            result = _add(result, point)
        point = _add(point, point)
        scalar >>= 1
    return result


def _square_root(value: int) -> int | None:
    """A square root modulo P (P = 5 mod 8), or None when ``value`` is not a square."""
    root = pow(value, (P + 3) // 8, P)
    if root * root % P != value % P:
        root = root * pow(2, (P - 1) // 4, P) % P
    return root if root * root % P == value % P else None


def _point_with_y(y: int) -> Point | None:
    """The curve point with this y and an even x, or None when there is none."""
    x = _square_root((y * y - 1) * pow(D * y * y + 1, -1, P) % P)
    if x is None:
        return None
    return (P - x if x % 2 else x), y


def _encode(point: Point) -> bytes:
    x, y = point
    return (y | (x % 2) << 255).to_bytes(32, "little")


def _order_8_point() -> Point:
    """L * Q for a curve point Q, chosen so that the result has order exactly 8."""
    for y in range(2, 1000):
        point = _point_with_y(y)
        if point is None:
            continue
        torsion = _multiply(GROUP_ORDER, point)
        if _multiply(4, torsion) != IDENTITY:
            return torsion
    raise AssertionError("no point with an order-8 component among the first y values")


ORDER_8 = _order_8_point()
SMALL_ORDER_POINTS = [_multiply(k, ORDER_8) for k in range(8)]


def _public_bytes(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


VALID_KEY = _public_bytes(Ed25519PrivateKey.generate()).hex()
IDENTITY_KEY = "01" + "00" * 31
FORGED_SIGNATURE = bytes([1]) + bytes(31) + bytes(32)  # R = identity, S = 0: no private key involved


def test_the_derived_small_order_points_are_the_eight_torsion_points() -> None:
    assert len(set(SMALL_ORDER_POINTS)) == 8
    assert IDENTITY in SMALL_ORDER_POINTS and (0, P - 1) in SMALL_ORDER_POINTS  # orders 1 and 2
    assert sum(1 for _, y in SMALL_ORDER_POINTS if y == 0) == 2  # the two points of order 4
    for x, y in SMALL_ORDER_POINTS:
        assert (-x * x + y * y - 1 - D * x * x * y * y) % P == 0
        assert _multiply(8, (x, y)) == IDENTITY


@pytest.mark.parametrize("multiple", range(8))
def test_small_order_public_key_is_refused(multiple: int) -> None:
    encoded = _encode(SMALL_ORDER_POINTS[multiple])
    assert public_key_is_usable(encoded) is False
    with pytest.raises(InvalidCommand) as caught:
        check_public_key_hex(encoded.hex())
    assert caught.value.detail["field"] == "body.public_key"


def test_negative_zero_encodings_are_refused() -> None:
    """x = 0 with the sign bit set: a second spelling of the identity and of (0, -1)."""
    for y in (1, P - 1):
        encoded = (y | 1 << 255).to_bytes(32, "little")
        assert public_key_is_usable(encoded) is False
        with pytest.raises(InvalidCommand):
            check_public_key_hex(encoded.hex())


def test_non_canonical_encodings_are_refused() -> None:
    """y >= p is refused even where y - p is the y of a point of large order."""
    reduced_to_large_order = 0
    for y in range(P, 2**255):
        point = _point_with_y(y - P)
        if point is not None and _multiply(8, point) != IDENTITY:
            reduced_to_large_order += 1
        for sign in (0, 1):
            encoded = (y | sign << 255).to_bytes(32, "little")
            assert public_key_is_usable(encoded) is False, y - P
            with pytest.raises(InvalidCommand):
                check_public_key_hex(encoded.hex())
    assert reduced_to_large_order > 0


def test_an_encoding_of_no_curve_point_is_refused() -> None:
    y = next(y for y in range(2, 1000) if _point_with_y(y) is None)
    assert public_key_is_usable(y.to_bytes(32, "little")) is False
    with pytest.raises(InvalidCommand):
        check_public_key_hex(y.to_bytes(32, "little").hex())


def test_generated_public_keys_and_their_negations_are_accepted() -> None:
    for _ in range(200):
        encoded = _public_bytes(Ed25519PrivateKey.generate())
        assert public_key_is_usable(encoded)
        assert check_public_key_hex(encoded.hex()) == encoded.hex()
        negated = bytes(encoded[:31]) + bytes([encoded[31] ^ 0x80])  # -P: same y, the other x
        assert public_key_is_usable(negated)


def test_a_point_of_large_order_with_a_small_order_component_is_accepted() -> None:
    """Only the eight small-order points are refused; P + T (order 8 * L) still authenticates."""
    key = _point_with_y(int.from_bytes(bytes.fromhex(VALID_KEY), "little") & ((1 << 255) - 1))
    assert key is not None
    assert public_key_is_usable(_encode(_add(key, ORDER_8)))


def test_verify_signature_refuses_a_small_order_key() -> None:
    """A key stored before membership.add refused them: the forged signature must not verify."""
    with pytest.raises(SignatureInvalid):
        verify_signature(bytes.fromhex(IDENTITY_KEY), b"any message at all", FORGED_SIGNATURE)


def test_membership_add_and_change_refuse_a_small_order_key() -> None:
    h = Harness().setup()
    for multiple in range(8):
        key = _encode(SMALL_ORDER_POINTS[multiple]).hex()
        h.reject(InvalidCommand, "owner", "membership.add", "w9", {"role": "worker", "public_key": key}, cas=True,
                 field="body.public_key")
        h.reject(InvalidCommand, "owner", "membership.change", "w1", {"public_key": key}, cas=True,
                 field="body.public_key")


def test_group_create_refuses_a_small_order_key(tmp_path: Path) -> None:
    with Authority.open(str(tmp_path), clock=FakeClock(), sync=False) as authority:
        command = Command(actor="owner", action_id="c1", group=GROUP, kind="group.create", target=GROUP,
                          body={"org": "o", "public_key": IDENTITY_KEY})
        with pytest.raises(InvalidCommand) as caught:
            authority.accept(command)
        assert caught.value.detail["field"] == "body.public_key"
        assert authority.head(GROUP)[0] == 0


def test_forged_signature_for_a_stored_small_order_key_is_refused() -> None:
    """A Membership written by an older version with the identity as its key stays fenced."""
    h = Harness().setup()
    h.group.states["member:w1"] = {**h.member("w1"), "public_key": IDENTITY_KEY}
    forged = msgspec.structs.replace(h.command("w1", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True),
                                     signature=FORGED_SIGNATURE)
    h.reject_command(SignatureInvalid, forged, field="signature")


# -- Public keys are exactly 64 hex digits ------------------------------------------------------

BAD_KEY_TEXTS = {
    "spaces": " " * 64,
    "tabs": "\t" * 64,
    "62 digits and spaces": VALID_KEY[:62] + "  ",
    "leading space": " " + VALID_KEY[:62] + " ",
    "newline inside": VALID_KEY[:30] + "\n" + VALID_KEY[31:],
    "trailing newline": VALID_KEY[:63] + "\n",
    "0x prefix": "0x" + VALID_KEY[2:],
    "not a hex digit": VALID_KEY[:63] + "g",
    "fullwidth digit": VALID_KEY[:63] + "\uff11",
    "63 digits": VALID_KEY[:63],
    "66 digits": VALID_KEY + "00",
    "empty": "",
}


@pytest.mark.parametrize("text", BAD_KEY_TEXTS.values(), ids=BAD_KEY_TEXTS.keys())
def test_public_key_that_is_not_64_hex_digits_is_refused(text: str) -> None:
    h = Harness().setup()
    h.reject(InvalidCommand, "owner", "membership.add", "w9", {"role": "worker", "public_key": text}, cas=True,
             field="body.public_key")
    fresh = Harness()
    fresh.reject(InvalidCommand, "owner", "group.create", GROUP, {"org": "o", "public_key": text},
                 field="body.public_key")


@pytest.mark.parametrize("value", [b"\x01" * 32, 5, ["ab"] * 32], ids=["bytes", "int", "list"])
def test_public_key_that_is_not_a_string_is_refused(value: Any) -> None:
    with pytest.raises(InvalidCommand):
        check_public_key_hex(value)


def test_public_key_in_uppercase_is_stored_in_lowercase_and_verifies() -> None:
    h = Harness().setup(workers=())
    private_key = Ed25519PrivateKey.generate()
    public_hex = _public_bytes(private_key).hex()
    h.accept("owner", "membership.add", "w3", {"role": "worker", "public_key": public_hex.upper()}, cas=True)
    assert h.member("w3")["public_key"] == public_hex
    h.signing_keys["w3"] = private_key
    assert h.accept("w3", "session.replace", "w3").authoritative


# -- Work Contract durations --------------------------------------------------------------------

DURATION_FIELDS = ("lease_ms", "start_ms", "backoff_initial_ms", "backoff_max_ms")
DURATION_MAX = limits.WORK_DURATION_MS_MAX


def _contract_with(field: str, value: int) -> dict[str, Any]:
    contract = dict(CONTRACT, **{field: value})
    if field == "backoff_initial_ms":
        contract["backoff_max_ms"] = max(value, contract["backoff_max_ms"])
    return contract


def test_duration_bound_is_a_century_and_fits_after_any_acceptance_time() -> None:
    assert DURATION_MAX == 36_525 * 24 * 60 * 60 * 1000  # 36,525 days: 100 years of 365.25 days
    assert limits.TIME_MS_MAX + DURATION_MAX <= limits.INT_ABS_MAX  # the Authority's clock bound


@pytest.mark.parametrize("field", DURATION_FIELDS)
@pytest.mark.parametrize("value", [DURATION_MAX + 1, limits.INT_ABS_MAX], ids=["bound+1", "2**63-1"])
def test_contract_duration_above_the_bound_is_refused_at_create(field: str, value: int) -> None:
    h = Harness().setup(workitems=())
    h.reject(InvalidCommand, "owner", "workitem.create", "wi9", {"mission": "m1", "contract": _contract_with(field, value)},
             field=f"body.contract.{field}")


@pytest.mark.parametrize("field", DURATION_FIELDS)
def test_contract_duration_at_the_bound_is_accepted(field: str) -> None:
    assert parse_contract(_contract_with(field, DURATION_MAX))[field] == DURATION_MAX


def test_contract_at_the_bound_can_be_claimed_renewed_and_failed(tmp_path: Path) -> None:
    """bug1's scenario through the Authority, with every duration at its largest allowed value."""
    clock = FakeClock()
    contract = dict(CONTRACT, **{field: DURATION_MAX for field in DURATION_FIELDS})
    actions = iter(range(1, 100))

    def command(actor: str, kind: str, target: str, body: dict[str, Any], revision: int | None = None) -> Command:
        return Command(actor=actor, action_id=f"a{next(actions)}", group=GROUP, kind=kind, target=target, body=body,
                       expected_revision=revision)

    with Authority.open(str(tmp_path), clock=clock, sync=False) as authority:
        authority.accept(command("owner", "group.create", GROUP, {"org": "o"}))
        authority.accept(command("owner", "membership.add", "w1", {"role": "worker"}, 0))
        authority.accept(command("owner", "mission.create", "m1", {"title": "t", "cost_limit": 100}))
        authority.accept(command("owner", "workitem.create", "wi1", {"mission": "m1", "contract": contract}))
        authority.accept(command("w1", "workitem.claim", "wi1", {"session_epoch": 1}, 1))
        lease = authority.state(GROUP, "workitem:wi1")[1]["lease"]
        assert lease["expires_at_ms"] == lease["start_by_ms"] == clock.now_ms + DURATION_MAX
        fence = {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}
        authority.accept(command("w1", "workitem.start", "wi1", fence))
        clock.advance(1)
        revision = authority.state(GROUP, "workitem:wi1")[0]
        authority.accept(command("w1", "lease.renew", "wi1", fence, revision))
        assert authority.state(GROUP, "workitem:wi1")[1]["lease"]["expires_at_ms"] == clock.now_ms + DURATION_MAX
        receipt = authority.accept(command("w1", "workitem.fail", "wi1", dict(fence, reason="tool crashed")))
        assert receipt.authoritative
        item = authority.state(GROUP, "workitem:wi1")[1]
        assert item["state"] == "queued" and item["not_before_ms"] == clock.now_ms + DURATION_MAX


def test_times_derived_from_a_contract_stored_before_the_bound_saturate() -> None:
    """A WorkItem accepted by an older version with durations of 2**63 - 1 can still be claimed,
    renewed and failed: the derived times stop at the largest content integer."""
    h = Harness().setup()
    huge = dict(CONTRACT, **{field: limits.INT_ABS_MAX for field in DURATION_FIELDS})
    h.group.states["workitem:wi1"] = {**h.item("wi1"), "contract": huge}
    lease = h.claim("w1", "wi1")
    assert lease["expires_at_ms"] == lease["start_by_ms"] == limits.INT_ABS_MAX
    h.start("w1", "wi1")
    h.accept("w1", "lease.renew", "wi1", h.fence("wi1"), cas=True)
    assert h.lease("wi1")["expires_at_ms"] == limits.INT_ABS_MAX
    event = h.accept("w1", "workitem.fail", "wi1", dict(h.fence("wi1"), reason="tool crashed"))
    assert event.authoritative and event.body is not None
    assert event.body["outcome"] == "queued" and event.body["not_before_ms"] == limits.INT_ABS_MAX


@pytest.mark.parametrize(
    ("now_ms", "duration_ms", "expected"),
    [
        (1_000, 500, 1_500),
        (limits.INT_ABS_MAX - 1, 1, limits.INT_ABS_MAX),
        (limits.INT_ABS_MAX - 1, 2, limits.INT_ABS_MAX),
        (limits.INT_ABS_MAX, limits.INT_ABS_MAX, limits.INT_ABS_MAX),
    ],
)
def test_time_after_saturates_at_the_content_bound(now_ms: int, duration_ms: int, expected: int) -> None:
    assert time_after(now_ms, duration_ms) == expected


# -- backoff_ms raises a typed error ------------------------------------------------------------


@pytest.mark.parametrize("attempt", [0, -1, True, 1.5, "1", None])
def test_backoff_for_an_attempt_below_one_or_not_an_int_is_invalid_command(attempt: Any) -> None:
    with pytest.raises(MwpError) as caught:
        backoff_ms(parse_contract(CONTRACT), attempt)
    assert type(caught.value) is InvalidCommand
    assert caught.value.detail["field"] == "attempt"

