"""The canonical rules at their exact bounds: which typed error a refusal is, the field it names,
and the values one step inside each bound that must still pass. (The agreement of the C checks
with their Python definitions is in test_canonical.py and test_c_differential.py.)"""

from __future__ import annotations

import pytest

from mwpstore import Command, InvalidCommand, LimitExceeded, limits
from mwpstore.canonical import check_aggregate_key, check_content

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
