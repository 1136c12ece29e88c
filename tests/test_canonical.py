"""Canonical bytes and content hashes: same logical content, same bytes; rules enforced."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mwpstore import Command, InvalidCommand, LimitExceeded
from mwpstore.canonical import canonical_bytes, check_content, check_id, content_hash
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


@pytest.mark.parametrize("good", ["g-1", "agent_7", "x.y", "a@b", "A" * 128, "_engine"])
def test_valid_ids(good):
    assert check_id(good, "group") == good


def test_signature_is_not_part_of_the_content():
    base = dict(actor="a", action_id="b", group="g", kind="mission.create", target="t", body={"x": 1})
    unsigned = Command(**base)
    signed = Command(**base, signature=b"\x01" * 64)
    check_command(signed)
    assert command_bytes(unsigned) == command_bytes(signed)
    assert command_bytes(Command(**{**base, "expected_revision": 3})) != command_bytes(unsigned)
