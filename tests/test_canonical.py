"""Canonical bytes and content hashes: same logical content, same bytes; rules enforced."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from enum import IntEnum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mwpstore import Command, InvalidCommand, LimitExceeded, _canonical_c, limits
from mwpstore.canonical import _content_ok, canonical_bytes, check_content, check_id, content_hash
from mwpstore.messages import check_command, command_bytes

scalars = st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
content = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=30)


def _shuffled(value):
    """The same logical content with every dict's insertion order shuffled."""
    if isinstance(value, dict):
        items = list(value.items())
        random.Random(len(items)).shuffle(items)
        return {key: _shuffled(item) for key, item in items}
    if isinstance(value, list):
        return [_shuffled(item) for item in value]
    return value


@given(st.dictionaries(st.text(max_size=8), content, max_size=6))
@settings(max_examples=300, deadline=None)
def test_key_order_does_not_change_bytes(body):
    check_content(body)
    assert canonical_bytes(_shuffled(body)) == canonical_bytes(body)


@given(content, content)
@settings(max_examples=300, deadline=None)
def test_different_content_never_same_hash(first, second):
    if first == second and type(first) is type(second) and repr(first) == repr(second):
        return
    if canonical_bytes(first) == canonical_bytes(second):
        # equal bytes are only allowed for equal JSON values (e.g. tuple vs list do not occur here)
        assert first == second
    else:
        assert content_hash(canonical_bytes(first)) != content_hash(canonical_bytes(second))


def test_int_and_float_are_different_content():
    assert canonical_bytes({"x": 1}) != canonical_bytes({"x": 1.0})


def test_unicode_is_kept_as_given_and_stable():
    composed, decomposed = "\u00e9", "e\u0301"
    assert canonical_bytes({"k": composed}) == '{"k":"\u00e9"}'.encode()
    assert canonical_bytes({"k": composed}) != canonical_bytes({"k": decomposed})
    assert canonical_bytes({"\u00e9": 1, "a": 2}) == '{"a":2,"\u00e9":1}'.encode()


def test_nested_keys_are_sorted_at_every_level():
    assert canonical_bytes({"b": {"y": 1, "x": [{"d": 1, "c": 2}]}, "a": None}) == b'{"a":null,"b":{"x":[{"c":2,"d":1}],"y":1}}'


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf])
def test_nan_and_infinity_are_refused(value):
    with pytest.raises(InvalidCommand):
        check_content({"x": [value]})


def test_non_string_keys_bytes_and_sets_are_refused():
    for bad in ({1: 2}, {"x": b"bytes"}, {"x": {1, 2}}, {"x": (1).__class__}):
        with pytest.raises(InvalidCommand):
            check_content(bad)


def test_content_copy_stores_only_content_checked_before_and_after_the_copy(monkeypatch):
    """``content_copy`` checks the caller's value, then the copy decoded from its bytes: a set
    (which the encoder writes as an array) is refused naming it, and a value changed between the
    check and the copy (another thread) into an int past the bound is refused, not stored."""
    from mwpstore import canonical

    with pytest.raises(InvalidCommand) as caught:
        canonical.content_copy({"x": {1, 2}}, "request")
    assert caught.value.detail["field"] == "request.x"
    check = canonical.check_content
    checked: list[object] = []

    def check_then_change(value, field="body"):
        check(value, field)
        if not checked:
            value["n"] = limits.INT_ABS_MAX + 1  # as another thread would, right after the check
        checked.append(value)

    monkeypatch.setattr(canonical, "check_content", check_then_change)
    with pytest.raises(InvalidCommand):
        canonical.content_copy({"n": 1}, "request")
    assert len(checked) == 1  # the copy's own check refused it

def test_depth_and_item_bounds():
    deep: list = []
    node = deep
    for _ in range(40):
        node.append([])
        node = node[0]
    with pytest.raises(LimitExceeded):
        check_content({"x": deep})
    with pytest.raises(LimitExceeded):
        check_content({"x": list(range(200_000))})


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "a\\b", "a:b", "a b", "a\x00", "é", "-x", "x" * 129])
def test_ids_are_bounded_printable_and_never_paths(bad):
    with pytest.raises(InvalidCommand):
        check_id(bad, "group")


@pytest.mark.parametrize("good", ["g-1", "agent_7", "x.y", "a@b", "A" * 128, "_engine", "zZ09+=", "9a"])
def test_valid_ids(good):
    assert check_id(good, "group") == good


def test_signature_is_not_part_of_the_content():
    base = dict(actor="a", action_id="b", group="g", kind="mission.create", target="t", body={"x": 1})
    unsigned = Command(**base)
    signed = Command(**base, signature=b"\x01" * 64)
    check_command(signed)
    assert command_bytes(unsigned) == command_bytes(signed)
    assert command_bytes(Command(**{**base, "expected_revision": 3})) != command_bytes(unsigned)


# -- The C fast checks (csrc/canonical_check.c) agree with the Python rules ----------------------

class _Level(IntEnum):
    LOW = 1


class _Text(str):
    pass


def _python_content_ok(value):
    return _content_ok(value, 0, [limits.BODY_ITEMS_MAX])


def _nested(leaf, levels, container):
    for _ in range(levels):
        leaf = {"k": leaf} if container is dict else [leaf]
    return leaf


@pytest.mark.parametrize("name", ["BODY_DEPTH_MAX", "BODY_ITEMS_MAX", "STRING_BYTES_MAX", "ID_CHARS_MAX", "KIND_CHARS_MAX", "INT_ABS_MAX"])
def test_c_bounds_match_limits_py(name):
    assert getattr(_canonical_c, name) == getattr(limits, name)


wild_scalars = scalars | st.floats() | st.integers() | st.binary(max_size=4) | st.sampled_from(
    [_Level.LOW, _Text("x"), (1, 2), (), OrderedDict(a=1), {1: 2}, {None: 1}, frozenset(), "x" * (limits.STRING_BYTES_MAX + 1)]
)
wild_content = st.recursive(
    wild_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@given(wild_content)
@settings(max_examples=500, deadline=None)
def test_c_content_check_agrees_with_python(value):
    assert _canonical_c.content_ok(value) is _python_content_ok(value)


@pytest.mark.parametrize(
    "value",
    [
        _nested("s", limits.BODY_DEPTH_MAX + 1, dict),  # a str right inside a dict at the deepest level
        _nested(7, limits.BODY_DEPTH_MAX + 1, dict),
        _nested(1.5, limits.BODY_DEPTH_MAX + 1, dict),
        _nested("s", limits.BODY_DEPTH_MAX + 1, list),
        _nested([], limits.BODY_DEPTH_MAX, list),
        _nested([], limits.BODY_DEPTH_MAX + 1, list),
        list(range(limits.BODY_ITEMS_MAX - 1)),
        list(range(limits.BODY_ITEMS_MAX)),
        {str(index): index for index in range(limits.BODY_ITEMS_MAX - 1)},
        {str(index): index for index in range(limits.BODY_ITEMS_MAX)},
        [2**63 - 1, -(2**63) + 1],
        [-(2**63)],
        {"a": 2**63},
        {"a": 2**64},
        {"a": -(2**70)},
        [float("nan")],
        {"a": float("-inf")},
        "x" * limits.STRING_BYTES_MAX,
        {"a": "x" * (limits.STRING_BYTES_MAX + 1)},
        "\ud800",
        {"\ud800": 1},
        {"a": "\udc00"},
        ["ok", "\udfff"],
        {"x" * (limits.STRING_BYTES_MAX + 1): 1},
        True,
        None,
    ],
)
def test_c_content_check_agrees_with_python_at_the_bounds(value):
    assert _canonical_c.content_ok(value) is _python_content_ok(value)


@pytest.mark.parametrize("value", ["\ud800", {"\ud800": 1}, {"a": "\udc00"}, ["ok", "\udfff"], {"a": {"b\udbff": "c"}}])
def test_a_lone_surrogate_is_not_canonical_content(value):
    """Canonical bytes are UTF-8, which has no encoding of a lone surrogate: refused up front,
    never a UnicodeEncodeError from the encoder later."""
    assert not _canonical_c.content_ok(value)
    with pytest.raises(InvalidCommand):
        check_content(value)


@pytest.mark.parametrize("leaf", ["s", 7, 1.5, True, None, []])
def test_the_depth_bound_is_the_same_for_every_kind_of_value(leaf):
    """A value one level below the deepest allowed is refused whatever it is (a str or int right
    inside a dict at the deepest level once slipped through the fast check)."""
    check_content(_nested(leaf, limits.BODY_DEPTH_MAX, dict))
    with pytest.raises(LimitExceeded):
        check_content(_nested(leaf, limits.BODY_DEPTH_MAX + 1, dict))


def test_c_content_check_stops_on_a_cycle():
    cycle: list = []
    cycle.append(cycle)
    assert _canonical_c.content_ok(cycle) is False
    with pytest.raises(LimitExceeded):
        check_content(cycle)


@pytest.mark.parametrize("revision", [1.0, 0.0, True, -1, 2**64, "1"])
def test_check_command_refuses_an_expected_revision_that_is_not_a_non_negative_int(revision):
    """A float equal to an integer (1.0) is not an integer: refused like any other non-int."""
    with pytest.raises(InvalidCommand) as raised:
        check_command(Command(actor="ok", action_id="a", group="g", kind="k", target="t", expected_revision=revision))
    assert raised.value.field == "expected_revision"
    check_command(Command(actor="ok", action_id="a", group="g", kind="k", target="t", expected_revision=1))


def test_check_command_names_the_first_bad_field():
    command = Command(actor="ok", action_id="-bad", group="a/b", kind="Bad", target="t")
    with pytest.raises(InvalidCommand) as raised:
        check_command(command)
    assert raised.value.field == "action_id"
    with pytest.raises(InvalidCommand) as raised:
        check_command(Command(actor="ok", action_id="a", group="g", kind="Bad", target="."))
    assert raised.value.field == "kind"
    with pytest.raises(LimitExceeded) as raised:
        check_command(Command(actor="ok", action_id="a", group="g", kind="k", target="t", body={"deep": _nested(1, 40, list)}))
    assert raised.value.field == "body.deep"


def test_a_time_in_ms_is_bounded_by_time_ms_max_inclusive():
    from mwpstore.canonical import check_time_ms

    assert check_time_ms(0, "now_ms") == 0
    assert check_time_ms(limits.TIME_MS_MAX, "now_ms") == limits.TIME_MS_MAX
    with pytest.raises(InvalidCommand) as raised:
        check_time_ms(limits.TIME_MS_MAX + 1, "now_ms")
    assert raised.value.field == "now_ms"


def test_command_bytes_are_capped_at_body_bytes_max_inclusive():
    def command(chars: int) -> Command:
        return Command(actor="ok", action_id="a", group="g", kind="k", target="t", body={"text": "x" * chars})

    overhead = len(command_bytes(command(0)))
    at_bound = command(limits.BODY_BYTES_MAX - overhead)
    assert len(command_bytes(at_bound)) == limits.BODY_BYTES_MAX
    with pytest.raises(LimitExceeded) as raised:
        command_bytes(command(limits.BODY_BYTES_MAX - overhead + 1))
    assert raised.value.field == "body"
