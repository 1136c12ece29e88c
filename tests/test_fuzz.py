"""Fuzzing every decoder and entry point that takes outside bytes: only typed errors, no hang.

Property-based tests (hypothesis) run in CI against one shared context; the suite's short run
adds seeded mutations and, when atheris is installed (``pip install 'mwpstore[fuzz]'``), a
coverage-guided run; without atheris that part is skipped and the result says so.
"""

from __future__ import annotations

import subprocess

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mwpstore import torture
from mwpstore.authority import EVENT_TAG
from mwpstore.errors import MwpError
from mwpstore.messages import Command, Effect, check_command, decode_event, encode_event

FUZZ_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    fuzz_context = torture.FuzzContext(str(tmp_path_factory.mktemp("fuzz")))
    yield fuzz_context
    fuzz_context.close()


def _only_typed_errors(target: str, data: bytes, context: torture.FuzzContext) -> None:
    try:
        with torture._Watchdog(torture.FUZZ_INPUT_SECONDS_MAX):
            torture.fuzz_one(target, data, context)
    except MwpError:
        pass


@pytest.mark.parametrize("target", torture.FUZZ_TARGETS)
def test_mutated_samples_give_only_typed_errors(context, target):
    samples = context.samples[target]

    @FUZZ_SETTINGS
    @given(st.sampled_from(samples), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
           st.integers(0, 1 << 16))
    def check(sample, edits, cut):
        buffer = bytearray(sample)
        for at, value in edits:
            if buffer:
                buffer[at % len(buffer)] = value
        _only_typed_errors(target, bytes(buffer[: max(cut, 1)]) if cut % 3 == 0 else bytes(buffer), context)

    check()


@pytest.mark.parametrize("target", torture.FUZZ_TARGETS)
def test_arbitrary_bytes_give_only_typed_errors(context, target):
    @FUZZ_SETTINGS
    @given(st.binary(max_size=2048))
    def check(data):
        _only_typed_errors(target, data, context)

    check()


JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text() | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), children, max_size=4),
    max_leaves=20,
)


@FUZZ_SETTINGS
@given(st.fixed_dictionaries({}, optional={name: JSON_LIKE for name in
                                           ("actor", "action_id", "group", "kind", "target", "body", "expected_revision", "signature")}))
def test_commands_with_fields_of_any_type_are_rejected_with_typed_errors(fields):
    values = {name: None for name in ("actor", "action_id", "group", "kind", "target")}
    values.update(fields)
    try:
        check_command(Command(**values))
    except MwpError:
        pass


def test_command_from_fuzzed_bytes_reaches_the_authority(context):
    command = torture._command_from_bytes(msgspec.msgpack.encode({"actor": 5, "group": "../x", "kind": "mission.create"}))
    with pytest.raises(MwpError):
        context.authority.accept(command)


def test_a_modified_snapshot_that_verified_would_be_a_violation(context):
    findings = torture.Findings()
    torture._run_input("snapshot", context.samples["snapshot"][0], context, findings, {})
    assert findings.count == 0  # the genuine sample verifies and is no violation
    import mwpstore.snapshot as snapshot_module

    real = snapshot_module.verify_snapshot
    snapshot_module.verify_snapshot = lambda data, **options: None  # a verifier that accepts anything
    try:
        torture._run_input("snapshot", context.samples["snapshot"][0][:-1] + b"\x00", context, findings, {})
    finally:
        snapshot_module.verify_snapshot = real
    assert findings.count == 1 and "modified snapshot bytes verified" in findings.messages[0]


def test_a_nan_both_index_paths_keep_is_no_disagreement(context):
    """Reliability finding 16: a coverage-guided run reported IndexPathsDisagree for a forged
    record whose state held a NaN. C and Python indexed it alike; the comparison used ==, and a
    NaN never equals itself. Meaning is now compared with floats by their bits."""
    last = decode_event(context.events[-1])
    effect = last.effects[0]
    for value in (float("nan"), 1.0):
        forged = msgspec.structs.replace(
            last, effects=[Effect(effect.aggregate, effect.revision, {**effect.state, "cost_spent": value})]
        )
        _only_typed_errors("index_record", encode_event(forged), context)
    python, with_c = torture.index_paths(context.index, [EVENT_TAG + event for event in context.events])
    meaning = torture.index_meaning(python)
    assert meaning == torture.index_meaning(with_c)
    assert torture._comparable({"a": 1}) != torture._comparable({"a": 1.0}) != torture._comparable({"a": True})
    assert torture._comparable([float("nan")]) == torture._comparable([float("nan")])


def test_a_hang_is_a_violation(context, monkeypatch):
    findings = torture.Findings()
    monkeypatch.setattr(torture, "FUZZ_INPUT_SECONDS_MAX", 0.2)

    def slow(target, data, fuzz_context):
        import time

        time.sleep(5)

    monkeypatch.setattr(torture, "fuzz_one", slow)
    torture._run_input("event_bytes", b"", context, findings, {})
    assert findings.count == 1 and "hang" in findings.messages[0]


def test_fuzz_short_run():
    result = torture.run_fuzz(count=900, seed=1)
    assert result["iterations"] > 0
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:3])
    assert result["details"]["hypothesis"]



class _SteppingClock:
    """``time`` for the torture module with a monotonic clock that moves 10 ms at every reading:
    the time budget is then checked without measuring how fast this machine runs."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.first: float | None = None

    def monotonic(self) -> float:
        self.now += 0.01
        if self.first is None:
            self.first = self.now
        return self.now

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def test_a_time_budget_bounds_the_fuzz_run(monkeypatch, capsys):
    """`torture --suite fuzz --seconds 2` ran about 10 s: the atheris child got its share as
    libFuzzer's -max_total_time, in whole seconds (at least 1, run to 2) counted from libFuzzer's
    start, after seconds of instrumented imports, and each phase started its own clock. Now the
    budget ends at a fixed time from the start, set-up included: no input starts after it, and the
    atheris child is given that end (it stops at it, or is stopped)."""
    seconds = 3.0
    clock = _SteppingClock()
    monkeypatch.setattr(torture, "time", clock)
    monkeypatch.setattr(torture, "atheris_available", lambda: True)
    started_at: list[float] = []
    run_input = torture._run_input

    def timed_input(*args, **kwargs):
        started_at.append(clock.now)
        return run_input(*args, **kwargs)

    given_until: list[float | None] = []

    def atheris(context, runs, limit, seed, findings, *, until=None):
        given_until.append(until)
        return 0

    monkeypatch.setattr(torture, "_run_input", timed_input)
    monkeypatch.setattr(torture, "_run_atheris", atheris)
    result = torture.run_fuzz(seconds=seconds, seed=3)
    assert clock.first is not None
    budget_end = clock.first + seconds
    assert started_at, "no input ran"
    assert max(started_at) < budget_end, (max(started_at) - budget_end, len(started_at))
    assert given_until == [budget_end]  # atheris has what is left, and ends with the budget
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:3])
    capsys.readouterr()


def test_an_input_generated_again_after_the_budget_ended_is_no_finding():
    """Hypothesis can generate an input a second time. Once the budget is spent the second try
    ends in ``_BudgetSpent`` where the first ran, and hypothesis raises ``FlakyFailure`` holding
    it (a 1,200 s fuzz run stopped on that, reported as a violation). That is the budget's end;
    a group holding anything else is still raised."""
    from hypothesis.errors import FlakyFailure

    def spent() -> None:
        raise FlakyFailure("Inconsistent results from replaying a test case!", [torture._BudgetSpent()])

    def found() -> None:
        raise FlakyFailure("Inconsistent results from replaying a test case!", [torture._BudgetSpent(), ValueError("x")])

    torture._until_budget_spent(spent)
    with pytest.raises(FlakyFailure) as caught:
        torture._until_budget_spent(found)
    assert any(isinstance(exc, ValueError) for exc in caught.value.exceptions)


def test_fuzz_without_atheris_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torture, "atheris_available", lambda: False)
    result = torture.run_fuzz(count=60, seed=2)
    assert result["violations"] == 0
    assert not result["details"]["atheris"]
    assert "atheris is not installed" in capsys.readouterr().err


def test_an_atheris_failure_is_reported_with_its_exception_and_input(monkeypatch, tmp_path):
    # atheris prints the target's Python exception on stdout and libFuzzer writes the failing
    # input into the working directory: the finding must carry both (a finding that shows only
    # libFuzzer's "fuzz target exited" cannot be reproduced).
    samples = {target: [b"sample"] for target in torture.FUZZ_TARGETS}
    context = type("Context", (), {"root": str(tmp_path), "samples": samples})()

    def fake_run(args, **kwargs):
        with open(f"{kwargs['cwd']}/crash-0123abcd", "wb") as handle:
            handle.write(bytes([torture.FUZZ_TARGETS.index("snapshot")]) + b"\xffbad")
        return subprocess.CompletedProcess(
            args, 77, stdout=" === Uncaught Python exception: ===\nValueError: an untyped error\n",
            stderr="==1== ERROR: libFuzzer: fuzz target exited\n",
        )

    monkeypatch.setattr(torture.subprocess, "run", fake_run)
    findings = torture.Findings()
    torture._run_atheris(context, runs=10, seconds=1, seed=1, findings=findings)
    assert findings.count == 1
    message = findings.messages[0]
    assert "ValueError: an untyped error" in message
    assert "fuzz target exited" in message
    assert f"(crash-0123abcd, target snapshot, 5 bytes, hex): {torture.FUZZ_TARGETS.index('snapshot'):02x}ff626164" in message
