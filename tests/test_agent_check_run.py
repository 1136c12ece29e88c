"""``apply_many`` with full validation checks each run of Events in C (``mwpstore._apply_c.check_run``)
before the C run applies it. ``check_run`` must stop exactly where its Python definition,
``agent_store._fully_valid_run`` (``admit_event`` + ``check_event`` with the chain link), stops:
further would apply an Event that full validation refuses, earlier only costs speed. Each spoiled
Event below is resealed (its payload hash and hash recomputed) so that only the one check under
test can refuse it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_store_support import workload
from mwpstore import agent_store, limits
from mwpstore._apply_c import check_run, msgpack_size
from mwpstore.agent_store import _CHECK_CONTEXT, AgentStore, ApplyStatus, _fully_valid_run
from mwpstore.messages import ZERO_HASH, Effect, Event, encode_event, payload_hash_of, recompute_event_hash

GROUP = "g-1"
EVENTS = workload(GROUP, 40, seed=3)
SPOILED_AT = 6


def _resealed(event, **changes):
    """``event`` with ``changes``, then its payload hash and hash made right for what it holds
    (each only where it can be computed at all)."""
    changed = msgspec.structs.replace(event, **changes)
    if "payload_hash" not in changes and type(changed.body) is dict:
        try:
            changed = msgspec.structs.replace(changed, payload_hash=payload_hash_of(changed.body))
        except (TypeError, ValueError, msgspec.EncodeError):
            pass
    if "hash" not in changes:
        try:
            changed = msgspec.structs.replace(changed, hash=recompute_event_hash(changed))
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            pass
    return changed


def _both(events, start=0, seq=1, prev=ZERO_HASH, group=GROUP):
    return check_run(events, start, _CHECK_CONTEXT, group, seq, prev), _fully_valid_run(events, start, group, seq, prev)


def _nested(depth):
    value = {}
    for _ in range(depth):
        value = {"d": value}
    return value


def _state(event, **changes):
    first = event.effects[0]
    return [Effect(first.aggregate, first.revision, {**(first.state or {}), **changes}), *event.effects[1:]]


SPOILERS = {
    "body_nan": lambda e: _resealed(e, body={"x": float("nan")}),
    "body_int_key": lambda e: _resealed(e, body={1: "a"}),
    "body_too_deep": lambda e: _resealed(e, body=_nested(limits.BODY_DEPTH_MAX + 2)),
    "body_list": lambda e: _resealed(e, body=[1, 2]),
    "body_changed_payload_hash_kept": lambda e: _resealed(e, body={"forged": True}, payload_hash=e.payload_hash),
    "state_nan": lambda e: _resealed(e, effects=_state(e, x=float("inf"))),
    "state_list": lambda e: _resealed(e, effects=[Effect(e.effects[0].aggregate, 1, [1])]),
    "state_int_too_big": lambda e: _resealed(e, effects=_state(e, x=2**64)),
    "effect_revision_zero": lambda e: _resealed(e, effects=[Effect(e.effects[0].aggregate, 0, None)]),
    "effect_revision_bool": lambda e: _resealed(e, effects=[Effect(e.effects[0].aggregate, True, None)]),
    "effect_aggregate_no_colon": lambda e: _resealed(e, effects=[Effect("workitem", 1, None)]),
    "effect_aggregate_bad_id": lambda e: _resealed(e, effects=[Effect("workitem:a b", 1, None)]),
    "effect_not_an_effect": lambda e: _resealed(e, effects=[(e.effects[0].aggregate, 1, None)]),
    "effects_tuple": lambda e: _resealed(e, effects=tuple(e.effects)),
    "actor_invalid": lambda e: _resealed(e, actor="not an id"),
    "actor_empty": lambda e: _resealed(e, actor=""),
    "action_id_too_long": lambda e: _resealed(e, action_id="a" * (limits.ID_CHARS_MAX + 1)),
    "kind_invalid": lambda e: _resealed(e, kind="Bad Kind"),
    "kind_not_str": lambda e: _resealed(e, kind=7),
    "aggregate_not_str": lambda e: _resealed(e, aggregate=None),
    "revision_not_int": lambda e: _resealed(e, revision=1.0),
    "accepted_at_float": lambda e: _resealed(e, accepted_at_ms=1.5),
    "accepted_at_unencodable": lambda e: _resealed(e, accepted_at_ms=2**70),
    "authoritative_int": lambda e: _resealed(e, authoritative=1),
    "content_hash_short": lambda e: _resealed(e, content_hash=e.content_hash[:31]),
    "payload_hash_str": lambda e: _resealed(e, payload_hash="x" * 32),
    "hash_wrong": lambda e: _resealed(e, hash=bytes(32)),
    "prev_hash_unlinked": lambda e: _resealed(e, prev_hash=bytes(32)),
    "seq_bool": lambda e: _resealed(e, seq=True),
    "seq_skips": lambda e: _resealed(e, seq=e.seq + 1, event_id=f"{e.group}:{e.seq + 1}"),
    "event_id_wrong": lambda e: _resealed(e, event_id=f"{e.group}:{e.seq}0"),
    "other_group": lambda e: _resealed(e, group="g-2", event_id=f"g-2:{e.seq}"),
    "not_an_event": lambda e: encode_event(e),
}


def test_a_genuine_history_passes_whole_from_its_start_and_from_its_middle():
    assert _both(EVENTS) == (len(EVENTS), len(EVENTS))
    assert _both(EVENTS, 10, 11, EVENTS[9].hash) == (len(EVENTS), len(EVENTS))
    assert _both(EVENTS, len(EVENTS), len(EVENTS) + 1, EVENTS[-1].hash) == (len(EVENTS), len(EVENTS))
    assert _both(EVENTS, 10, 12, EVENTS[9].hash) == (10, 10)  # not the next sequence
    assert _both(EVENTS, 10, 11, EVENTS[8].hash) == (10, 10)  # not linked to the given hash


@pytest.mark.parametrize("name", sorted(SPOILERS))
def test_check_run_stops_at_the_same_event_as_the_python_definition(name):
    spoiled = SPOILERS[name](EVENTS[SPOILED_AT])
    events = [*EVENTS[:SPOILED_AT], spoiled, *EVENTS[SPOILED_AT + 1 :]]
    assert _both(events) == (SPOILED_AT, SPOILED_AT)


def _padded_to(event, size):
    """``event`` with its body padded (strings within the string limit) so that its encoding is
    exactly ``size`` bytes."""
    chunk = limits.STRING_BYTES_MAX // 2

    def padded(total):
        pieces = ["p" * chunk] * (total // chunk) + ["p" * (total % chunk)]
        return _resealed(event, body={**(event.body or {}), "pad": pieces})

    total = 0
    for _ in range(4):  # lengths' own headers change with them: settle in a few steps
        total += size - len(encode_event(padded(total)))
    result = padded(total)
    assert len(encode_event(result)) == size
    return result


@pytest.mark.parametrize("over", [0, 1])
def test_the_size_limit_is_met_at_exactly_the_same_byte(over):
    """check_run adds an Event's size up from the parts it hashes; encode_event is the definition."""
    event = _padded_to(EVENTS[SPOILED_AT], limits.EVENT_BYTES_MAX + over)
    events = [*EVENTS[:SPOILED_AT], event]
    expected = SPOILED_AT + 1 - over
    assert _both(events) == (expected, expected)


def test_sizes_add_up_for_events_with_and_without_a_body():
    redacted = _resealed(EVENTS[SPOILED_AT], body=None)
    event = _padded_to(redacted, limits.EVENT_BYTES_MAX)  # a body again, at the limit
    assert _both([*EVENTS[:SPOILED_AT], redacted]) == (SPOILED_AT + 1, SPOILED_AT + 1)
    assert _both([*EVENTS[:SPOILED_AT], event]) == (SPOILED_AT + 1, SPOILED_AT + 1)


def _context_with(check_aggregate):
    context = list(_CHECK_CONTEXT)
    context[2] = set()  # no key is known valid: every aggregate goes to check_aggregate
    context[3] = check_aggregate
    return tuple(context)


def test_an_exception_in_a_check_ends_the_run_and_anything_else_propagates():
    def refuse(aggregate):
        raise ValueError(aggregate)

    def interrupt(aggregate):
        raise KeyboardInterrupt

    assert check_run(EVENTS, 0, _context_with(refuse), GROUP, 1, ZERO_HASH) == 0
    with pytest.raises(KeyboardInterrupt):
        check_run(EVENTS, 0, _context_with(interrupt), GROUP, 1, ZERO_HASH)


def test_a_hasher_that_cannot_be_made_ends_the_run_at_its_start_and_anything_else_propagates():
    """check_run makes one blake3 hasher for the run (reset after each hash) before its first
    Event: a failure to make it ends the run where it starts, as a failed call within it would."""

    def hasher_of(error):
        def make(*data):
            raise error

        context = list(_CHECK_CONTEXT)
        context[6] = make
        return tuple(context)

    assert check_run(EVENTS, 3, hasher_of(MemoryError()), GROUP, 4, EVENTS[2].hash) == 3
    with pytest.raises(KeyboardInterrupt):
        check_run(EVENTS, 3, hasher_of(KeyboardInterrupt()), GROUP, 4, EVENTS[2].hash)


class _Calls:
    """A context whose encoder, blake3 hasher and astuple wrap the real ones and log each call
    (with the index of the Event being checked), raising ``error`` at call number ``fail_at``."""

    def __init__(self, events, fail_at=0, error=None, astuple_result=None):
        self.log, self.fail_at, self.error, self.failed_in = [], fail_at, error, None
        index_of = {id(event): index for index, event in enumerate(events)}
        self.checking = None
        real = list(_CHECK_CONTEXT)
        encoder, blake3, fields_of = real[4], real[6], real[13]
        calls = self

        class Hasher:
            def __init__(self):
                calls.call("blake3")
                self.real = blake3()

            def update(self, data):
                calls.call("update")
                self.real.update(data)
                return self

            def digest(self):
                calls.call("digest")
                return self.real.digest()

            def reset(self):
                calls.call("reset")
                self.real.reset()

        def encode_into(value, buffer, offset):
            calls.call("encode_into")
            return encoder(value, buffer, offset)

        def astuple(event):
            self.checking = index_of[id(event)]
            self.call("astuple")
            fields = fields_of(event)
            return fields if astuple_result is None else astuple_result(self.checking, fields)

        real[4], real[6], real[13] = encode_into, Hasher, astuple
        self.context = tuple(real)

    def call(self, name):
        self.log.append(name)
        if len(self.log) == self.fail_at:
            self.failed_in = self.checking
            raise self.error


def test_each_hash_is_fed_once_read_and_reset_and_each_call_that_fails_ends_the_run_at_its_event():
    """check_run's one hasher per run: every hash is one update, a digest and a reset, so none
    starts from a state fed before. A call that raises an Exception at any point (the hasher
    made, fed, read or reset, the encoder, astuple) ends the run at the Event being checked (at
    its start if no Event was yet), as a failed check ends _fully_valid_run; anything else
    propagates."""
    events = EVENTS[:6]
    clean = _Calls(events)
    assert check_run(events, 0, clean.context, GROUP, 1, ZERO_HASH) == len(events)
    hashing = " ".join(name for name in clean.log if name in ("update", "digest", "reset"))
    assert hashing == " ".join(["update digest reset"] * (2 * len(events) + sum(e.body is not None for e in events)))
    for fail_at in range(1, len(clean.log) + 1):
        failing = _Calls(events, fail_at, MemoryError())
        end = check_run(events, 0, failing.context, GROUP, 1, ZERO_HASH)
        assert end == (failing.failed_in or 0), (fail_at, failing.log[-1])
        with pytest.raises(KeyboardInterrupt):
            check_run(events, 0, _Calls(events, fail_at, KeyboardInterrupt()).context, GROUP, 1, ZERO_HASH)


@pytest.mark.parametrize("wrong", [lambda fields: fields[:-1], lambda fields: (*fields, None), list])
def test_fields_of_the_wrong_shape_end_the_run_at_that_event(wrong):
    """check_run reads the 16 fields by position, so a result of astuple that is not a tuple of
    16 ends the run there (an Event's type is checked exactly, so msgspec's never is)."""
    calls = _Calls(EVENTS, astuple_result=lambda index, fields: wrong(fields) if index == SPOILED_AT else fields)
    assert check_run(EVENTS, 0, calls.context, GROUP, 1, ZERO_HASH) == SPOILED_AT


def test_check_run_reads_the_fields_in_the_order_of_the_event_struct():
    """check_run reads an Event's fields by position from one msgspec.structs.astuple call (the
    F_ names of csrc/agent_apply.c), the first 11 being the hashed header."""
    assert Event.__struct_fields__ == (
        "group", "seq", "event_id", "kind", "aggregate", "revision", "actor", "action_id", "content_hash",
        "accepted_at_ms", "authoritative", "body", "effects", "payload_hash", "prev_hash", "hash",
    )


def test_check_run_refuses_arguments_of_the_wrong_shape():
    with pytest.raises(TypeError):
        check_run(EVENTS, 0, _CHECK_CONTEXT[:-1], GROUP, 1, ZERO_HASH)
    with pytest.raises(TypeError):
        check_run(tuple(EVENTS), 0, _CHECK_CONTEXT, GROUP, 1, ZERO_HASH)
    with pytest.raises(TypeError):
        check_run(EVENTS, 0, _CHECK_CONTEXT, GROUP, 1, ZERO_HASH[:31])
    with pytest.raises(ValueError):
        check_run(EVENTS, 0, _CHECK_CONTEXT, GROUP, 0, ZERO_HASH)


def test_full_mode_apply_many_hands_a_clean_batch_to_the_c_runs(tmp_path, monkeypatch):
    """One apply() for the first Event, then check_run and the C run take the rest."""
    applied, checked = [], []
    original_apply, original_check = agent_store.AgentTransaction.apply, agent_store._check_run

    def counting_apply(self, event):
        applied.append(event)
        return original_apply(self, event)

    def counting_check(*args):
        end = original_check(*args)
        checked.append((args[1], end))
        return end

    monkeypatch.setattr(agent_store.AgentTransaction, "apply", counting_apply)
    monkeypatch.setattr(agent_store, "_check_run", counting_check)
    with AgentStore.open(tmp_path / "a") as agent:
        with agent.begin() as tx:
            assert tx.apply_many(EVENTS) == [ApplyStatus.APPLIED] * len(EVENTS)
            tx.advance_cursor(GROUP)
        assert agent.cursor(GROUP) == len(EVENTS)
    assert len(applied) == 1 and checked == [(1, len(EVENTS))]


# -- sequences at the end of what the C runs count with (a long long) -----------------------------

TOP = 2**63 - 1  # the last sequence a C run takes; it stops after it instead of wrapping around


def _chain_from(seq, prev_hash, count, *, last_seq=None):
    """``count`` resealed Events of GROUP from ``seq`` on, linked from ``prev_hash``; the last one
    numbered ``last_seq`` (with an Event ID of that number's digits) if given."""
    out = []
    for offset in range(count):
        number = seq + offset if last_seq is None or offset < count - 1 else last_seq
        event_id = f"{GROUP}:{number}" if number > 0 else f"{GROUP}:("  # what a wrapped C counter prints
        out.append(_resealed(EVENTS[offset + 1], seq=number, event_id=event_id, prev_hash=prev_hash))
        prev_hash = out[-1].hash
    return out


def test_no_run_counts_past_the_largest_sequence_a_long_long_holds():
    events = _chain_from(TOP, ZERO_HASH, 2, last_seq=-(2**63))
    assert _both(events, 0, TOP, ZERO_HASH) == (1, 1)
    assert agent_store._apply_run(events, 0, agent_store._RUN_CONTEXT, GROUP, b"g-1\x00", TOP, ZERO_HASH, {}, {}, 10_000) == 1


def test_a_next_sequence_beyond_a_long_long_takes_nothing_and_raises_nothing():
    """Nor does apply(): a sequence above 2**63 - 1 is refused in either mode, as in a snapshot."""
    events = _chain_from(TOP + 1, ZERO_HASH, 2)
    assert _both(events, 0, TOP + 1, ZERO_HASH) == (0, 0)
    assert agent_store._apply_run(events, 0, agent_store._RUN_CONTEXT, GROUP, b"g-1\x00", TOP + 1, ZERO_HASH, {}, {}, 10) == 0
    with pytest.raises(agent_store.EventInvalid) as caught:
        agent_store.admit_trusted_event(events[0])
    assert caught.value.detail["reason"] == "event_id"


def test_a_snapshot_sequence_above_2_63_is_refused_before_anything_is_written(tmp_path):
    """Before, 2**64 failed at commit with msgspec's OverflowError inside an untyped MWP_ERROR."""
    from types import SimpleNamespace

    with AgentStore.open(tmp_path / "a") as agent:
        for seq in (TOP + 1, 2**64, -1):
            snapshot = SimpleNamespace(group=GROUP, org=None, seq=seq, head_hash=bytes(32), aggregates=[])
            with pytest.raises(agent_store.SnapshotInvalid) as caught:
                agent.restore_verified(snapshot, group=GROUP)
            assert caught.value.detail["check"] == "sequence"
        assert agent.groups() == [] and agent.cursor(GROUP) == 0


def test_a_negative_start_or_a_sequence_below_one_is_an_argument_error():
    for start, seq in ((-1, 1), (0, 0), (0, -(2**70))):
        with pytest.raises(ValueError):
            check_run(EVENTS, start, _CHECK_CONTEXT, GROUP, seq, ZERO_HASH)
        with pytest.raises(ValueError):
            agent_store._apply_run(EVENTS, start, agent_store._RUN_CONTEXT, GROUP, b"g-1\x00", seq, ZERO_HASH, {}, {}, 10)


@pytest.mark.parametrize("verify", ["full", "trusted"])
def test_apply_many_near_the_largest_sequence_equals_a_loop_of_apply(tmp_path, verify):
    """A Group restored from a snapshot just below 2**63: the batch's last Event would follow
    2**63 - 1 as a C counter wrapped around would number it, and apply() refuses it."""
    from types import SimpleNamespace

    head_hash = bytes(range(32))
    snapshot = SimpleNamespace(group=GROUP, org=None, seq=TOP - 3, head_hash=head_hash, aggregates=[])
    events = _chain_from(TOP - 2, head_hash, 4, last_seq=-(2**63))
    outcomes = []
    for name in ("many", "loop"):
        with AgentStore.open(tmp_path / name, verify=verify) as agent:
            agent.restore_verified(snapshot, group=GROUP)
            with agent.begin() as tx:
                with pytest.raises(agent_store.EventInvalid) as caught:
                    if name == "many":
                        tx.apply_many(events)
                    else:
                        for event in events:
                            tx.apply(event)
                tx.advance_cursor(GROUP)
            outcomes.append((caught.value.detail.get("reason"), agent.cursor(GROUP), agent.inbox_seqs(GROUP)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == TOP and outcomes[0][2] == [TOP - 2, TOP - 1, TOP]


def test_every_effect_passes_the_shape_checks_before_any_is_checked_for_content():
    """As in Python, where _check_shape (aggregate keys) runs before check_event (revisions,
    states): with a key check that is Python code, the order is observable."""
    event = next(event for event in EVENTS if len(event.effects) >= 2)
    calls = []

    def check_aggregate(aggregate):
        calls.append("aggregate")
        agent_store._check_aggregate(aggregate)

    def content_ok(value):
        calls.append("content")
        return agent_store._canonical_c.content_ok(value)

    context = list(_context_with(check_aggregate))
    context[9] = content_ok
    assert check_run([event], 0, tuple(context), GROUP, event.seq, event.prev_hash) == 1
    states = sum(effect.state is not None for effect in event.effects)
    assert calls[: len(event.effects)] == ["aggregate"] * len(event.effects)
    assert calls.count("content") == states + (event.body is not None) and "aggregate" not in calls[len(event.effects) :]


_SORTED_ENCODE = msgspec.msgpack.Encoder(order="sorted").encode


def _width_boundaries():
    """Values at each msgpack width boundary (msgspec writes the smallest form): ints, strs
    (code points and UTF-8 bytes apart), bins, arrays (lists and tuples) and maps."""
    values = []
    for edge in (0, 0x7F, 0xFF, 0xFFFF, 0xFFFFFFFF, 2**63 - 1):
        values += [edge - 1, edge, edge + 1] if edge < 2**63 - 1 else [edge - 1, edge]
    for edge in (-32, -0x80, -0x8000, -0x80000000, -(2**63)):
        values += [edge + 1, edge, edge - 1] if edge > -(2**63) else [edge + 1, edge]
    for length in (0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536):
        values += ["s" * length, "é" * length, b"b" * length, [None] * length, (0,) * length,
                   {f"k{index}": index for index in range(length)}]
    return values + [None, True, False, 0.0, -1.5, float("inf"), float("nan")]


@pytest.mark.parametrize("value", _width_boundaries(), ids=lambda value: f"{type(value).__name__}-{len(_SORTED_ENCODE(value))}")
def test_msgpack_size_is_the_encoders_length_at_every_width_boundary(value):
    """check_run adds a body's length up with msgpack_size instead of encoding it: it must be the
    length of the sorted encoder's msgpack, byte for byte."""
    assert msgpack_size(value) == len(_SORTED_ENCODE(value))
    assert msgpack_size({"body": [value, {"again": value}]}) == len(_SORTED_ENCODE({"body": [value, {"again": value}]}))


_sizable_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text() | st.binary()
    | st.sampled_from(["", "é" * 16, "\U0001f600" * 8, "s" * 31, "s" * 32, 127, 128, -32, -33, 255, 256])
)
_sizable = st.recursive(
    _sizable_scalars,
    lambda inner: st.lists(inner, max_size=20) | st.lists(inner, max_size=17).map(tuple)
    | st.dictionaries(st.text(max_size=8), inner, max_size=20),
    max_leaves=60,
)
_odd_scalars = st.sampled_from(
    [2**63, 2**64 - 1, 2**64, -(2**63) - 1, "\ud800", bytearray(b"x"), set(), frozenset({1}), 1j, msgspec.msgpack.Ext(1, b"x")]
)
_odd = st.recursive(
    _sizable_scalars | _odd_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(value=_sizable)
def test_msgpack_size_is_the_encoders_length_of_any_value_content_may_hold(value):
    assert msgpack_size(value) == len(_SORTED_ENCODE(value))


@settings(max_examples=300, deadline=None)
@given(value=_odd)
def test_msgpack_size_of_anything_else_is_none_or_the_encoders_length(value):
    """Where msgpack_size cannot tell (a type content never holds, an int beyond 64 bits, a str
    without UTF-8), it answers None and check_run encodes the body instead."""
    size = msgpack_size(value)
    try:
        expected = len(_SORTED_ENCODE(value))
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
        expected = None
    assert size is None or size == expected


class _Int(int):
    pass


class _Str(str):
    pass


class _Float(float):
    pass


def _cycle() -> list:
    cycle: list = []
    cycle.append(cycle)
    return cycle


def _dict_cycle() -> dict:
    cycle: dict = {}
    cycle["k"] = cycle
    return cycle


@pytest.mark.parametrize("value", [_Int(3), _Str("s"), _Float(1.5), {"k": _Int(3)}, [_Str("s")], {_Str("k"): 1},
                                   _cycle(), {"k": _cycle()}, _dict_cycle(), "\ud800", ["\ud800"], {"\ud800": 1}, {"k": "\ud800"}],
                         ids=["int subclass", "str subclass", "float subclass", "in a dict", "in a list", "subclass key",
                              "cycle", "cycle inside", "dict cycle", "surrogate", "surrogate in a list", "surrogate key",
                              "surrogate value"])
def test_msgpack_size_of_a_subclass_a_cycle_or_a_lone_surrogate_is_none(value):
    """Exact types only (the encoder refuses an int or str subclass, which content_ok never lets
    through), a bounded depth (a list that holds itself is None, not a walk that never ends), and
    a str with no UTF-8 is None with no error left set (the caller encodes that body)."""
    assert msgpack_size(value) is None


def test_a_body_msgpack_size_cannot_tell_is_encoded_for_its_size():
    """Past content_ok no body is one msgpack_size cannot tell; with a content check that lets an
    int above 2**63 through, check_run measures the body by encoding it (one more encode_into)."""
    event = _resealed(EVENTS[SPOILED_AT], body={**EVENTS[SPOILED_AT].body, "big": 2**64 - 1})
    events = [*EVENTS[:SPOILED_AT], event]
    counts = []
    for body_event in (EVENTS[SPOILED_AT], event):
        calls = _Calls([*EVENTS[:SPOILED_AT], body_event])
        context = list(calls.context)
        context[9] = lambda value: True
        assert check_run([*EVENTS[:SPOILED_AT], body_event], 0, tuple(context), GROUP, 1, ZERO_HASH) == SPOILED_AT + 1
        counts.append(calls.log.count("encode_into"))
    assert counts[1] == counts[0] + 1
    assert msgpack_size(event.body) is None and len(events) == SPOILED_AT + 1
