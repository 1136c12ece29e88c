"""The canonical rules at their exact bounds: which typed error a refusal is, the field it names,
and the values one step inside each bound that must still pass. (The agreement of the C checks
with their Python definitions is in test_canonical.py and test_c_differential.py.)"""

from __future__ import annotations

import pathlib

import msgspec
import pytest
from agent_store_support import ChainBuilder

from mwpstore import Command, EventInvalid, InvalidCommand, LimitExceeded, limits
from mwpstore.canonical import check_aggregate_key, check_content, content_hash
from mwpstore.messages import (
    AcceptResult,
    Effect,
    Event,
    check_command,
    check_event,
    command_bytes,
    decode_event,
    decode_events,
    recompute_event_hash,
)

NAN = float("nan")


def _in_dicts(leaf: object, keys: list[str]) -> dict:
    """``leaf`` under the dicts of ``keys``, outermost first: ``{"a": {"b": leaf}}``."""
    for key in reversed(keys):
        leaf = {key: leaf}
    return leaf  # type: ignore[return-value]


def _refusal(value: object, field: str = "body") -> InvalidCommand:
    with pytest.raises(InvalidCommand) as raised:
        check_content(value, field)
    return raised.value


# -- Which error: a bound passed is LIMIT_EXCEEDED; a value with no canonical form is INVALID_COMMAND


@pytest.mark.parametrize(
    ("value", "error"),
    [
        pytest.param({"x": 2**63}, InvalidCommand, id="int-above-64-bits"),
        pytest.param({"x": -(2**63)}, InvalidCommand, id="int-below-64-bits"),
        pytest.param({"x": NAN}, InvalidCommand, id="nan"),
        pytest.param({"x": b"raw"}, InvalidCommand, id="bytes"),
        pytest.param({"x": "\ud800"}, InvalidCommand, id="lone-surrogate"),
        pytest.param({"x": "y" * (limits.STRING_BYTES_MAX + 1)}, LimitExceeded, id="string-one-over"),
        pytest.param({"x": _in_dicts(1, ["k"] * limits.BODY_DEPTH_MAX)}, LimitExceeded, id="depth-one-over"),
        pytest.param({"x": [0] * limits.BODY_ITEMS_MAX}, LimitExceeded, id="items-one-over"),
    ],
)
def test_a_refusal_is_exactly_the_error_of_its_rule(value, error):
    """LimitExceeded is an InvalidCommand, so ``pytest.raises(InvalidCommand)`` alone cannot tell
    them apart: the class (and so the code a client sees) is checked exactly."""
    refused = _refusal(value)
    assert type(refused) is error
    assert refused.field.startswith("body.x")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(_in_dicts(NAN, ["k"] * limits.BODY_DEPTH_MAX), id="nan-at-the-deepest-level"),
        pytest.param([0] * (limits.BODY_ITEMS_MAX - 2) + [NAN], id="nan-as-the-last-value-allowed"),
    ],
)
def test_content_exactly_at_the_depth_and_item_bounds_is_refused_for_its_own_fault(value):
    """A value at the deepest level allowed, or content of exactly BODY_ITEMS_MAX values, is within
    the bounds: when it is refused, it is for the NaN (INVALID_COMMAND), not for a bound."""
    assert type(_refusal(value)) is InvalidCommand


@pytest.mark.parametrize(
    ("keys", "field"),
    [
        (["a"], "body.a"),
        (["a", "b", "c", "d"], "body.a.b.c.d"),
        (["a", "b", "c", "d", "e"], "body.a.b.c.d"),
        (["a", "b", "c", "d", "e", "f"], "body.a.b.c.d"),
    ],
)
def test_the_field_names_the_path_of_keys_down_to_four_levels(keys, field):
    """The field is the path to the bad value, one key per level for the first four levels (so a
    field name stays short whatever the nesting)."""
    assert _refusal(_in_dicts(NAN, keys)).field == field


# -- Aggregate keys: a kind, ':' and an ID at most ------------------------------------------------

AGGREGATE_KEY_CHARS_MAX = limits.KIND_CHARS_MAX + 1 + limits.ID_CHARS_MAX


class _Text(str):
    pass


def test_an_aggregate_key_may_be_as_long_as_the_longest_kind_and_id():
    longest = "k" * limits.KIND_CHARS_MAX + ":" + "i" * limits.ID_CHARS_MAX
    assert len(longest) == AGGREGATE_KEY_CHARS_MAX
    assert check_aggregate_key(longest, "aggregate") is longest
    with pytest.raises(InvalidCommand) as raised:
        check_aggregate_key(longest + "i", "aggregate")
    assert raised.value.field == "aggregate"


def test_an_aggregate_key_is_an_exact_str():
    """As for IDs, a str subclass (which may redefine comparison or encoding) is refused."""
    with pytest.raises(InvalidCommand) as raised:
        check_aggregate_key(_Text("mission:m-1"), "key")
    assert raised.value.field == "key"


# -- Commands: the content hash covers every field but the signature; bounds inclusive -----------

_FIELDS = dict(actor="alice", action_id="a-1", group="g-1", kind="mission.create", target="m-1", body={"n": 1})


def _command(**changes: object) -> Command:
    return Command(**{**_FIELDS, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"actor": "bob"},
        {"action_id": "a-2"},
        {"group": "g-2"},
        {"kind": "mission.update"},
        {"target": "m-2"},
        {"target": "g-1"},  # the target spelled like the Group is still its own field
        {"body": {"n": 2}},
        {"body": {"n": 1.0}},
        {"body": {"n": True}},
        {"body": {"n": "1"}},
        {"expected_revision": 0},
    ],
)
def test_changing_any_one_field_of_a_command_changes_its_content_hash(changes):
    """Two Commands are "the same Command" exactly when their content hashes are equal, so every
    field but the signature is in the hashed bytes, under its own name."""
    assert content_hash(command_bytes(_command(**changes))) != content_hash(command_bytes(_command()))


def test_an_expected_revision_from_zero_to_int_abs_max_is_accepted():
    for revision in (0, limits.INT_ABS_MAX):
        assert check_command(_command(expected_revision=revision)).expected_revision == revision
    with pytest.raises(InvalidCommand) as raised:
        check_command(_command(expected_revision=limits.INT_ABS_MAX + 1))
    assert raised.value.field == "expected_revision"


@pytest.mark.parametrize(
    "signature",
    [bytes(limits.SIGNATURE_BYTES - 1), bytes(limits.SIGNATURE_BYTES + 1), bytearray(limits.SIGNATURE_BYTES),
     memoryview(bytes(limits.SIGNATURE_BYTES))],
    ids=["one-short", "one-over", "bytearray", "memoryview"],
)
def test_a_signature_is_exactly_signature_bytes_of_bytes(signature):
    check_command(_command(signature=bytes(limits.SIGNATURE_BYTES)))
    with pytest.raises(InvalidCommand) as raised:
        check_command(_command(signature=signature))
    assert raised.value.field == "signature"


# -- Events from outside: check_event ------------------------------------------------------------


def _genuine_event() -> Event:
    chain = ChainBuilder("g-1")
    return chain.event("group.create", "group:g-1", {"group:g-1": {"org": "acme"}}, {"org": "acme"})


def _event(**changes: object) -> Event:
    """The genuine first Event with ``changes``, its hash recomputed so that only they are wrong."""
    changed = msgspec.structs.replace(_genuine_event(), **changes)
    return msgspec.structs.replace(changed, hash=recompute_event_hash(changed))


def _event_refusal(event: Event) -> EventInvalid:
    with pytest.raises(EventInvalid) as raised:
        check_event(event)
    return raised.value


def test_a_genuine_event_passes_check_event():
    event = _genuine_event()
    assert check_event(event) is event


@pytest.mark.parametrize("value", [None, {"group": "g-1"}, ("g-1", 1), b"\x90"])
def test_check_event_refuses_what_is_no_event_with_a_typed_error(value):
    assert _event_refusal(value).detail["reason"] == "type"


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"group": "../x", "event_id": "../x:1"}, "group"), ({"actor": "a/b"}, "actor"), ({"action_id": ""}, "action_id"),
     ({"kind": "Group.Create"}, "kind")],
)
def test_an_event_field_that_is_no_id_or_kind_is_refused_naming_it(changes, field):
    refused = _event_refusal(_event(**changes))
    assert (refused.detail["reason"], refused.detail["field"]) == ("field", field)


@pytest.mark.parametrize("seq", [0, -1, limits.INT_ABS_MAX + 1, True, 1.0])
def test_an_event_sequence_is_from_one_to_int_abs_max(seq):
    assert check_event(_event(seq=limits.INT_ABS_MAX, event_id=f"g-1:{limits.INT_ABS_MAX}")).seq == limits.INT_ABS_MAX
    assert _event_refusal(_event(seq=seq, event_id=f"g-1:{seq}")).detail["reason"] == "seq"


@pytest.mark.parametrize("name", ["content_hash", "payload_hash", "prev_hash", "hash"])
def test_every_hash_of_an_event_is_exactly_32_bytes(name):
    """A hash one byte short is refused even when the Event hash is computed over it."""
    short = bytes(31)
    if name == "hash":
        event = msgspec.structs.replace(_genuine_event(), hash=short)
    else:
        event = _event(**{name: short})
    assert _event_refusal(event).detail["reason"] == name


def test_of_several_malformed_hashes_the_first_in_field_order_is_named():
    event = _event(content_hash=bytes(31), payload_hash=bytes(31), prev_hash=bytes(31))
    assert _event_refusal(event).detail["reason"] == "content_hash"


@pytest.mark.parametrize(
    "effect",
    [Effect(7, 1, {}), Effect("group:g-1", 0, {}), Effect("group:g-1", True, {}), Effect("group:g-1", 1, {"x": float("nan")})],
    ids=["aggregate-not-str", "revision-zero", "revision-bool", "state-nan"],
)
def test_a_malformed_effect_is_refused_by_check_event(effect):
    assert _event_refusal(_event(effects=[effect])).detail["reason"] == "effects"


@pytest.mark.parametrize("decode", [decode_event, lambda data: decode_events([data])[0]], ids=["one", "many"])
@pytest.mark.parametrize(
    "data",
    [b"\xc1", msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode({"group": "g-1"}), b""],
    ids=["not-msgpack", "array-of-the-wrong-shape", "map", "empty"],
)
def test_bytes_that_are_no_event_are_event_invalid_whatever_the_decoder_says(decode, data):
    """Bad msgpack and well-formed msgpack of the wrong shape alike (msgspec's DecodeError and
    ValidationError) are EVENT_INVALID, reason decode: no msgspec error reaches the caller."""
    with pytest.raises(EventInvalid) as raised:
        decode(data)
    assert raised.value.detail["reason"] == "decode"


# -- The bounds docs/format/canonical.md states are the code's ------------------------------------

_CANONICAL_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "format" / "canonical.md"


def test_the_canonical_format_page_states_the_id_and_kind_lengths_of_the_code():
    """The page's bounds written as a number before their name in parentheses are checked with
    every page's (tests/test_docs.py); the ID and kind lengths it states as plain numbers."""
    text = " ".join(_CANONICAL_PAGE.read_text().split())
    assert f"1 to {limits.ID_CHARS_MAX} characters" in text
    assert f"at most {limits.KIND_CHARS_MAX} characters" in text


def test_an_accept_result_keeps_every_plain_detail_of_its_error():
    """A rejection in accept_many carries its error's detail values of plain types (str, int,
    float, bool, None) and drops only the others, so ``result.error`` rebuilds the same facts."""
    error = InvalidCommand("refused", field="body", length=7, ratio=1.5, flag=False, missing=None, thing=object())
    rebuilt = AcceptResult.failed(error).error
    assert type(rebuilt) is InvalidCommand
    assert rebuilt.detail == {"field": "body", "length": 7, "ratio": 1.5, "flag": False, "missing": None}
