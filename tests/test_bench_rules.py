"""Rules of the benchmark code (``bench/``) pinned by a mutation round: each peer does the work the
tables say it does, each row counts and times what it says, and the harness computes and reports
medians, ratios and verdicts correctly.

Nothing here measures or asserts speed: the harness's clock is replaced by a fake one where a test
needs exact figures, and the row functions run at tiny sizes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import bench_authority  # noqa: E402
import harness  # noqa: E402
import run_all  # noqa: E402
import workload  # noqa: E402
from bench_authority import EventsourcingAdapter, Fixtures, SqliteAdapter  # noqa: E402
from peer_eventsourcing import EventsourcingPeer, RevisionConflict, mission_id  # noqa: E402
from peer_sqlite import SqliteAuthority  # noqa: E402

from mwpstore import limits  # noqa: E402
from mwpstore.errors import ActionIdCollision, InvalidCommand, MwpError, RevisionMismatch  # noqa: E402
from mwpstore.messages import Command, Effect  # noqa: E402

GROUP = "g-test"


def _clock() -> int:
    return 1_700_000_000_000


# -- harness: a fake clock, so figures are exact -----------------------------------------------------


class FakeTime:
    """Stands in for the ``time`` module inside ``harness``: ``perf_counter`` reads ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setattr(harness, "time", clock)
    return clock


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[harness.Bench]:
    monkeypatch.setenv("MWPSTORE_BENCH_DIR", str(tmp_path / "work"))
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    made = harness.Bench("rules", rounds=4, command="python rules")
    yield made
    shutil.rmtree(made.run_dir, ignore_errors=True)


def _subject(clock: FakeTime, timed: list[float], *, count: int = 100, setup: float = 10.0, calls: list[int] | None = None):
    """A subject whose round ``i`` spends ``setup`` seconds untimed, then ``timed[i]`` seconds timed."""

    def run(ctx: harness.RoundContext) -> int:
        if calls is not None:
            calls.append(ctx.round)
        clock.now += setup
        with ctx.timed():
            clock.now += timed[ctx.round]
        return count

    return run


def test_a_rate_is_operations_over_the_timed_part_only(bench: harness.Bench, fake_time: FakeTime) -> None:
    row = bench.row("r", "rate", unit="ops/s")
    row.compare({"mwpstore": _subject(fake_time, [0.5, 0.5, 0.5, 0.5])})
    measurement = row.measurements["mwpstore"]
    assert measurement.values == [200.0] * 4  # 100 operations in 0.5 s, the 10 s of setup not counted
    assert measurement.counts == [100.0] * 4
    assert measurement.seconds == [0.5] * 4


def test_a_row_reports_the_median_of_its_rounds_with_min_max_and_every_round(bench: harness.Bench, fake_time: FakeTime) -> None:
    row = bench.row("r", "rate", unit="ops/s")
    row.compare({"mwpstore": _subject(fake_time, [10.0, 5.0, 2.5, 1.0])})  # 10, 20, 40, 100 ops/s
    assert row.medians() == {"mwpstore": 30.0}  # not the mean (42.5), the upper median (40) or the best (100)
    data = row.to_json()["subjects"]["mwpstore"]
    assert (data["median"], data["min"], data["max"]) == (30.0, 10.0, 100.0)
    assert data["rounds"] == [10.0, 20.0, 40.0, 100.0]
    assert data["operations"] == [100.0] * 4


def test_a_time_row_reports_the_timed_blocks_in_its_unit(bench: harness.Bench, fake_time: FakeTime) -> None:
    def twice(ctx: harness.RoundContext) -> int:
        with ctx.timed():
            fake_time.now += 0.25
        fake_time.now += 5.0  # between the blocks: not timed
        with ctx.timed():
            fake_time.now += 0.5
        return 1

    row = bench.row("t", "open", unit="ms")
    row.compare({"mwpstore": twice}, rounds=2)
    assert row.measurements["mwpstore"].values == [750.0, 750.0]  # both blocks, in milliseconds
    assert row.to_json()["lower_is_better"] is True
    assert bench.row("u", "rate", unit="ops/s").to_json()["lower_is_better"] is False


def test_an_explicit_rounds_overrides_the_bench_s(bench: harness.Bench, fake_time: FakeTime) -> None:
    row = bench.row("r", "rate", unit="ops/s")
    row.compare({"mwpstore": _subject(fake_time, [1.0, 1.0])}, rounds=2)
    assert len(row.measurements["mwpstore"].values) == 2


def test_ratios_are_primary_over_peer_on_medians_and_skip_a_zero_median(bench: harness.Bench, fake_time: FakeTime) -> None:
    row = bench.row("r", "rate", unit="ops/s")
    row.compare({"mwpstore": _subject(fake_time, [1.0] * 4, count=300), "sqlite": _subject(fake_time, [1.0] * 4, count=100),
                 "idle": _subject(fake_time, [1.0] * 4, count=0)})
    assert row.ratios() == {"mwpstore/sqlite": 3.0}


def test_round_extras_are_kept_per_round(bench: harness.Bench, fake_time: FakeTime) -> None:
    def subject(ctx: harness.RoundContext) -> int:
        ctx.extra["retries"] = ctx.round * 2
        return 1

    row = bench.row("r", "rate", unit="ops/s")
    row.compare({"sqlite": subject}, rounds=3)
    assert row.measurements["sqlite"].extra == {"retries": [0, 2, 4]}


def test_each_round_s_directory_is_removed_after_the_round(bench: harness.Bench, fake_time: FakeTime) -> None:
    seen: list[Path] = []

    def subject(ctx: harness.RoundContext) -> int:
        assert all(not directory.exists() for directory in seen)
        (ctx.dir / "data").write_text("x")
        seen.append(ctx.dir)
        return 1

    bench.row("r", "rate", unit="ops/s").compare({"sqlite": subject}, rounds=3)
    assert len(seen) == 3 and not any(directory.exists() for directory in seen)


def test_a_subject_that_fails_is_not_run_again_and_gets_no_ratio_or_verdict(bench: harness.Bench, fake_time: FakeTime) -> None:
    calls: list[int] = []
    good = _subject(fake_time, [1.0] * 4, count=300)
    peer_ok = _subject(fake_time, [1.0] * 4, count=100, calls=calls)

    def flaky(ctx: harness.RoundContext) -> int:
        if ctx.round == 1:
            raise RuntimeError("a replay returned a different receipt")
        return peer_ok(ctx)

    row = bench.row("r", "rate", unit="ops/s", target=harness.Target("≥ 1.5× SQLite", ratio_min={"sqlite": 1.5}))
    row.compare({"mwpstore": good, "sqlite": flaky})
    assert calls == [0]  # failed in round 1: rounds 2 and 3 are not run
    assert row.errors["sqlite"].startswith("RuntimeError")
    assert row.ratios() == {}  # one round before the failure is no figure to compare against
    met, reasons = row.verdict()
    assert met is None and reasons == ["sqlite not measured"]
    table = harness.markdown_table(bench.to_json())
    assert "| sqlite | failed: RuntimeError: a replay returned a different receipt |" in table
    assert "| n/a |" in table and "| met |" not in table


@pytest.mark.parametrize(
    ("target", "medians", "met"),
    [
        (harness.Target("≥ 10", value_min=10), {"m": 10.0}, True),  # the bound itself meets it
        (harness.Target("≥ 10", value_min=10), {"m": 9.0}, False),
        (harness.Target("≤ 10", value_max=10), {"m": 10.0}, True),
        (harness.Target("≤ 10", value_max=10), {"m": 11.0}, False),
        (harness.Target("≥ 1.5×", ratio_min={"p": 1.5}), {"m": 150.0, "p": 100.0}, True),
        (harness.Target("≥ 1.5×", ratio_min={"p": 1.5}), {"m": 140.0, "p": 100.0}, False),
        (harness.Target("≤ 1.5×", ratio_max={"p": 1.5}), {"m": 150.0, "p": 100.0}, True),
        (harness.Target("≤ 1.5×", ratio_max={"p": 1.5}), {"m": 160.0, "p": 100.0}, False),
        (harness.Target("≤ 1.5×", ratio_max={"p": 1.5}), {"m": 100.0, "p": 160.0}, True),
        (harness.Target("≤ 1.5×", ratio_max={"p": 1.5}), {"m": 150.0}, None),  # the peer not measured
        (harness.Target("≥ 1.5×", ratio_min={"p": 1.5}), {"m": 150.0, "p": 0.0}, None),  # no ratio to a zero
        (harness.Target("≥ 1.5×", ratio_min={"p": 1.5}), {"p": 1.0}, None),  # the primary not measured
    ],
)
def test_a_target_is_met_within_its_bounds_inclusive(target: harness.Target, medians: dict[str, float], met: bool | None) -> None:
    verdict, reasons = target.evaluate("m", medians)
    assert verdict is met
    assert bool(reasons) == (met is not True)


def test_a_verdict_that_cannot_be_decided_is_recorded_as_none(bench: harness.Bench, fake_time: FakeTime) -> None:
    row = bench.row("r", "rate", unit="ops/s", target=harness.Target("≥ 2× sqlite", ratio_min={"sqlite": 2}))
    row.compare({"mwpstore": _subject(fake_time, [1.0] * 4)})
    assert row.to_json()["met"] is None


def test_a_quick_run_writes_only_under_results_quick_and_logs_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MWPSTORE_BENCH_DIR", str(tmp_path / "work"))
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    log = tmp_path / "written.log"
    monkeypatch.setenv(harness.RESULTS_LOG_ENV, str(log))
    quick = harness.Bench("q", quick=True, command="python q --quick")
    assert quick.run_dir.parent == tmp_path / "work"  # MWPSTORE_BENCH_DIR is where the stores go
    assert quick.rounds == 3
    quick.row("r", "rate", unit="ops/s").measure("mwpstore", lambda ctx: 1)
    quick.finish()
    assert json.loads((tmp_path / "results" / "quick" / "q.json").read_text())["quick"] is True
    assert not (tmp_path / "results" / "q.json").exists()
    assert log.read_text() == "q.json\n"


def test_the_work_root_falls_back_when_tmp_is_on_another_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MWPSTORE_BENCH_DIR", raising=False)
    monkeypatch.setattr(harness, "REPO_ROOT", Path("/proc"))  # never the temp dir's device
    monkeypatch.setattr(harness, "WORK_DIR_FALLBACK", tmp_path / "fallback")
    assert harness.choose_work_root() == tmp_path / "fallback"


@pytest.mark.skipif(not Path("/proc/mounts").exists(), reason="needs /proc/mounts")
def test_mount_of_picks_the_longest_mount_point_holding_the_path() -> None:
    mount = harness.mount_of(Path("/proc/self"))
    assert (mount["mount_point"], mount["fstype"]) == ("/proc", "proc")


def test_every_row_is_selected_without_only() -> None:
    parser = harness.argument_parser("x")
    assert harness.selected(parser.parse_args([]), "accept_single")
    only = parser.parse_args(["--only", "read"])
    assert harness.selected(only, "read_decoded") and not harness.selected(only, "accept_single")


def test_format_number_keeps_the_magnitude() -> None:
    assert harness.format_number(1_500_000) == "1.50M"
    assert harness.format_number(25_000) == "25.0k"
    assert harness.format_number(1_500) == "1.50k"
    assert harness.format_number(0.5) == "0.500"


def _result(met: bool | None, errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": "x",
        "quick": False,
        "rows": [
            {
                "key": "k", "title": "durable accept", "unit": "Commands/s", "primary": "mwpstore", "size": {},
                "subjects": {
                    "sqlite": {"median": 1000.0, "min": 900.0, "max": 1100.0, "rounds": [900.0, 1000.0, 1100.0]},
                    "mwpstore": {"median": 1_500_000.0, "min": 1_200_000.0, "max": 1_800_000.0, "rounds": [1.0, 2.0, 3.0]},
                    "eventsourcing": {"median": 10.0, "min": 10.0, "max": 10.0, "rounds": [10.0]},
                },
                "ratios": {"mwpstore/sqlite": 1500.0, "mwpstore/eventsourcing": 150000.0},
                "target": {"text": "≥ 1.5× SQLite", "ratio_min": {"sqlite": 1.5}},
                "met": met,
                "notes": [],
                "errors": errors or {},
            }
        ],
    }


def test_the_table_puts_the_primary_first_and_each_ratio_on_its_peer_s_line() -> None:
    lines = harness.markdown_table(_result(False), heading=False).splitlines()[2:]
    assert lines == [
        "| durable accept | mwpstore | 1.50M Commands/s | 1.20M … 1.80M (3) |  | ≥ 1.5× SQLite | **not met** |",
        "|  | sqlite | 1.00k Commands/s | 900.0 … 1.10k (3) | 1500.00× |  |  |",
        "|  | eventsourcing | 10.0 Commands/s | 10.0 … 10.0 (1) | 150000.00× |  |  |",
    ]


def test_the_table_shows_a_failed_subject_as_failed() -> None:
    table = harness.markdown_table(_result(None, {"eventsourcing": "RuntimeError: boom"}), heading=False)
    assert "| eventsourcing | failed: RuntimeError: boom |" in table
    assert "10.0 Commands/s" not in table


# -- run_all: docs/benchmarks.md ---------------------------------------------------------------------


def test_the_report_says_not_met_and_lists_failed_modules() -> None:
    summary = {"quick": False, "results": {"x": _result(False)}, "modules": [
        {"module": "bench_authority.py", "returncode": 0}, {"module": "bench_snapshot.py", "returncode": 1},
    ]}
    report = run_all.render_report(summary)
    assert "| durable accept | 1.50M Commands/s | sqlite: 1.00k Commands/s | 1500.00× | ≥ 1.5× SQLite | **not met** |" in report
    assert "## Modules that failed in this run" in report
    assert "- `bench_snapshot.py`: exit 1" in report and "`bench_authority.py`: exit" not in report


def test_load_results_never_reads_the_summary_as_a_module_s_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(run_all, "results_dir", harness.results_dir)
    paths = run_all.Paths(True)
    paths.results.mkdir(parents=True)
    (paths.results / "x.json").write_text(json.dumps(_result(True)))
    paths.summary.write_text(json.dumps({"results": {}}))
    assert list(run_all.load_results(paths)) == ["x"]


# -- SQLite peer: the same acceptance transaction -------------------------------------------------


@pytest.fixture(params=[False, True], ids=["sqlite", "sqlite_rules"])
def sqlite_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqliteAuthority]:
    store = SqliteAuthority.open(tmp_path / "sqlite", clock=_clock, rules=request.param)
    store.accept(workload.group_create(GROUP))
    yield store
    store.close()


def _statements(store: SqliteAuthority) -> list[str]:
    """The SQL statements this thread's connection runs from now on, as SQLite traces them."""
    seen: list[str] = []
    store._connection().set_trace_callback(seen.append)
    return seen


def test_sqlite_rules_accepts_exactly_as_mwpstore_does(tmp_path: Path) -> None:
    from mwpstore.authority import Authority

    commands = [workload.group_create(GROUP), *workload.mission_creates(GROUP, 3), workload.mission_update(GROUP, 1, 1)]
    authority = Authority.open(tmp_path / "mwpstore", clock=_clock, sync=False)
    try:
        with SqliteAuthority.open(tmp_path / "sqlite", clock=_clock, rules=True) as peer:
            for command in commands:
                assert peer.accept(command) == authority.accept(command)
            assert peer.read(GROUP) == authority.read(GROUP)  # the same Events, hash chain included
    finally:
        authority.close()


class _WorkModelPair:
    """mwpstore and the ``sqlite_rules`` peer over one scripted clock: every Command goes to both,
    and each must give the same receipt or the same rejection."""

    def __init__(self, tmp_path: Path, now_ms: int) -> None:
        from mwpstore.authority import Authority

        self.now_ms = now_ms
        self.authority = Authority.open(tmp_path / "mwpstore", clock=lambda: self.now_ms, sync=False)
        self.peer = SqliteAuthority.open(tmp_path / "sqlite", clock=lambda: self.now_ms, rules=True)
        self._actions = 0

    def close(self) -> None:
        self.peer.close()
        self.authority.close()

    def send(self, actor: str, kind: str, target: str, body: dict[str, Any], *, cas: str | None = None) -> Any:
        """The outcome both gave: a Receipt, or (code, message, detail) of the rejection."""
        self._actions += 1
        revision = None if cas is None else self.authority.state(GROUP, cas)[0]
        command = Command(actor=actor, action_id=f"a{self._actions}", group=GROUP, kind=kind, target=target,
                          body=body, expected_revision=revision)
        outcomes = []
        for store in (self.authority, self.peer):
            try:
                outcomes.append(store.accept(command))
            except MwpError as exc:
                outcomes.append((exc.code, exc.message, exc.detail))
        assert outcomes[0] == outcomes[1], (kind, self.now_ms)
        return outcomes[0]

    def lease(self, workitem: str) -> dict[str, Any]:
        return self.authority.state(GROUP, f"workitem:{workitem}")[1]["lease"]

    def fence(self, workitem: str) -> dict[str, Any]:
        lease = self.lease(workitem)
        return {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}


def test_sqlite_rules_decides_the_work_model_as_mwpstore_does_at_each_boundary_millisecond(tmp_path: Path) -> None:
    """Start, renewal, a late result, a takeover, a retry's not-before time and the deadline, each
    asked at the last millisecond it allows and the first it does not, plus a clock that steps back
    and one that repeats: the peer must decide each as mwpstore does (same receipt, same rejection,
    the same Events)."""
    from work_model_support import CONTRACT

    start = 1_000_000
    pair = _WorkModelPair(tmp_path, start)
    try:
        pair.send("owner", "group.create", GROUP, {"org": "acme"})
        for worker in ("w1", "w2"):
            pair.send("owner", "membership.add", worker, {"role": "worker"}, cas=f"member:{worker}")
        pair.send("owner", "mission.create", "m1", {"title": "t", "cost_limit": 1_000})
        deadline = start + 5_000
        contract = {**CONTRACT, "deadline_ms": deadline}
        for workitem in ("wi1", "wi2"):
            pair.send("owner", "workitem.create", workitem, {"mission": "m1", "contract": contract})
        late = pair.send("owner", "workitem.create", "wi3", {"mission": "m1", "contract": contract, "not_before_ms": deadline})
        assert late[0] == "DEADLINE_PASSED"

        def claim(agent: str, workitem: str) -> Any:
            return pair.send(agent, "workitem.claim", workitem, {"session_epoch": 1}, cas=f"workitem:{workitem}")

        claim("w1", "wi1")
        claim("w2", "wi2")
        pair.now_ms = start + CONTRACT["start_ms"] - 1  # the last millisecond a start is taken
        assert pair.send("w1", "workitem.start", "wi1", pair.fence("wi1")).authoritative
        pair.now_ms += 1  # start_by_ms: too late
        assert pair.send("w2", "workitem.start", "wi2", pair.fence("wi2"))[0] == "LEASE_EXPIRED"
        pair.now_ms = start + CONTRACT["lease_ms"] - 1  # the last millisecond a renewal is taken
        pair.send("w1", "lease.renew", "wi1", pair.fence("wi1"), cas="workitem:wi1")
        expires = pair.now_ms + CONTRACT["lease_ms"]
        pair.now_ms = start + 500  # the clock steps back: the renewal is decided at the last time
        pair.send("w1", "lease.renew", "wi1", pair.fence("wi1"), cas="workitem:wi1")
        assert pair.lease("wi1")["expires_at_ms"] == expires
        pair.now_ms = expires  # the lease lapses: a result is Evidence, a takeover is taken
        fence = pair.fence("wi1")
        assert not pair.send("w1", "workitem.checkpoint", "wi1", {**fence, "checkpoint": 1}).authoritative
        assert claim("w2", "wi1").authoritative
        pair.send("w2", "workitem.start", "wi1", pair.fence("wi1"))  # the clock repeats its reading
        failed = pair.send("w2", "workitem.fail", "wi1", {**pair.fence("wi1"), "reason": "flaky"})
        assert failed.authoritative
        ready = pair.authority.state(GROUP, "workitem:wi1")[1]["not_before_ms"]
        pair.now_ms = ready - 1
        assert claim("w1", "wi1")[0] == "NOT_READY"
        pair.now_ms = ready
        assert claim("w1", "wi1").authoritative
        pair.now_ms = deadline - 1  # wi2's lease lapsed long ago: the last millisecond a claim is taken
        assert claim("w1", "wi2").authoritative
        pair.send("w1", "workitem.checkpoint", "wi2", {**pair.fence("wi2"), "checkpoint": 2})
        pair.now_ms = deadline
        assert claim("w2", "wi2")[0] == "DEADLINE_PASSED"
        assert pair.peer.read(GROUP) == pair.authority.read(GROUP)
    finally:
        pair.close()


@pytest.mark.parametrize("reading", [1.5e12, -1, limits.TIME_MS_MAX + 1, True], ids=repr)
def test_sqlite_peer_refuses_a_bad_clock_reading_as_mwpstore_does(tmp_path: Path, reading: Any) -> None:
    pair = _WorkModelPair(tmp_path, reading)
    try:
        refused = pair.send("owner", "group.create", GROUP, {"org": "acme"})
        assert refused[0] == "INVALID_COMMAND" and refused[2]["field"] == "clock"
        pair.now_ms = limits.TIME_MS_MAX
        assert pair.send("owner", "group.create", GROUP, {"org": "acme"}).accepted_at_ms == limits.TIME_MS_MAX
        assert pair.peer.read(GROUP) == pair.authority.read(GROUP)
    finally:
        pair.close()


def test_sqlite_peer_keeps_the_last_acceptance_time_across_a_reopen_and_a_redo(tmp_path: Path) -> None:
    """Reopened with a clock behind its latest Event, the peer accepts at that Event's time, as
    mwpstore does (its index keeps the last time); and so does a peer that took the Events by
    redo, as mwpstore's redo at open does."""
    late = 2_000_000
    pair = _WorkModelPair(tmp_path, late)
    try:
        pair.send("owner", "group.create", GROUP, {"org": "acme"})
    finally:
        pair.close()
    pair = _WorkModelPair(tmp_path, late - 1_000)  # the same two stores, reopened
    pair._actions = 1  # the action ids go on from the first handle's
    try:
        assert pair.send("owner", "mission.create", "m1", {"title": "t", "cost_limit": 1}).accepted_at_ms == late
        events = pair.authority.read(GROUP)
    finally:
        pair.close()
    with SqliteAuthority.open(tmp_path / "redone", clock=lambda: late - 1_000, rules=True) as redone:
        assert redone.redo(events) == len(events)
        command = Command(actor="owner", action_id="after-redo", group=GROUP, kind="mission.create", target="m2",
                          body={"title": "t", "cost_limit": 1})
        assert redone.accept(command).accepted_at_ms == late


def test_sqlite_lean_variant_updates_the_state_with_the_body_and_runs_no_rules(tmp_path: Path) -> None:
    with SqliteAuthority.open(tmp_path / "s", clock=_clock) as store:
        store.accept(workload.group_create(GROUP))
        store.accept(workload.mission_create(GROUP, 1))
        store.accept(workload.mission_update(GROUP, 1, 1))
        events = store.read(GROUP)
    assert events[0].effects == [Effect("group:g-test", 1, {"org": "acme"})]  # no member, no policy: no rules
    assert events[2].effects == [Effect("mission:m1", 2, {"title": "t", "cost_limit": 101})]


def test_sqlite_peer_refuses_an_invalid_command_before_anything(sqlite_store: SqliteAuthority) -> None:
    bad = msgspec.structs.replace(workload.mission_create(GROUP, 1), expected_revision=-1)
    with pytest.raises(InvalidCommand):
        sqlite_store.accept(bad)
    results = sqlite_store.accept_many([workload.mission_create(GROUP, 2), bad, workload.mission_create(GROUP, 3)])
    assert [result.ok for result in results] == [True, False, True]
    assert results[1].error_code == "INVALID_COMMAND"
    assert sqlite_store.head(GROUP) == 3


def test_sqlite_peer_rejections_name_the_action_and_the_aggregate(sqlite_store: SqliteAuthority) -> None:
    command = workload.mission_create(GROUP, 1)
    sqlite_store.accept(command)
    with pytest.raises(ActionIdCollision) as collision:
        sqlite_store.accept(msgspec.structs.replace(command, body={"title": "u", "cost_limit": 100}))
    assert collision.value.detail["actor"] == "owner"
    assert collision.value.detail["action_id"] == "m1.create"
    with pytest.raises(RevisionMismatch) as mismatch:
        sqlite_store.accept(workload.mission_update(GROUP, 1, 4))
    assert mismatch.value.detail["aggregate"] == "mission:m1"
    assert mismatch.value.current_revision == 1


def test_sqlite_peer_accepts_again_after_a_rejection(sqlite_store: SqliteAuthority) -> None:
    sqlite_store.accept(workload.mission_create(GROUP, 1))
    with pytest.raises(RevisionMismatch):
        sqlite_store.accept(workload.mission_update(GROUP, 1, 4))
    assert sqlite_store.accept(workload.mission_create(GROUP, 2)).seq == 3  # the rejection's transaction was ended
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            sqlite_store.accept(workload.mission_create(GROUP, 3))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert not errors and sqlite_store.head(GROUP) == 4


def test_sqlite_peer_replays_a_duplicate_with_one_read_and_no_write_transaction(sqlite_store: SqliteAuthority) -> None:
    command = workload.mission_create(GROUP, 1)
    sqlite_store.accept(command)
    seen = _statements(sqlite_store)
    sqlite_store.accept(command)
    assert len(seen) == 1 and seen[0].startswith("SELECT content_hash, receipt FROM receipts")


def test_sqlite_peer_accept_does_the_whole_transaction_and_commits(sqlite_store: SqliteAuthority) -> None:
    seen = _statements(sqlite_store)
    sqlite_store.accept(workload.mission_create(GROUP, 1))
    receipt_lookup = "SELECT content_hash, receipt FROM receipts"
    assert seen[0].startswith(receipt_lookup)  # the replay look-up, outside the transaction
    assert seen[1] == "BEGIN IMMEDIATE"
    assert seen[2].startswith(receipt_lookup)  # again, inside: another writer may have won the race
    writes = [statement.partition(" VALUES")[0] for statement in seen if statement.startswith("INSERT")]
    assert writes == [
        "INSERT INTO events",
        "INSERT OR REPLACE INTO aggregates",
        "INSERT INTO receipts",
        "INSERT OR REPLACE INTO heads",
    ]
    assert seen[-1] == "COMMIT"


def test_sqlite_peer_accept_many_moves_the_head_and_decides_on_its_own_writes(sqlite_store: SqliteAuthority) -> None:
    create = workload.mission_create(GROUP, 1)
    update = workload.mission_update(GROUP, 1, 1)  # sees the create of the same transaction (revision 1)
    results = sqlite_store.accept_many([create, update])
    assert [result.ok for result in results] == [True, True]
    assert sqlite_store.head(GROUP) == 3
    assert sqlite_store.accept(workload.mission_create(GROUP, 2)).seq == 4
    assert sqlite_store.read(GROUP)[2].revision == 2


def test_sqlite_peer_read_returns_at_most_limit_events(sqlite_store: SqliteAuthority) -> None:
    sqlite_store.accept_many(workload.mission_creates(GROUP, 4))
    assert [event.seq for event in sqlite_store.read(GROUP, after=1, limit=2)] == [2, 3]


def test_sqlite_peer_redo_restores_heads_and_aggregates_in_batches(sqlite_store: SqliteAuthority, tmp_path: Path) -> None:
    sqlite_store.accept_many(workload.mission_creates(GROUP, 5))
    events = sqlite_store.read(GROUP)
    with SqliteAuthority.open(tmp_path / "redo", clock=_clock, rules=sqlite_store.rules) as target:
        seen = _statements(target)
        assert target.redo(events, batch_events=2) == 6
        assert seen.count("COMMIT") == 3  # 2 + 2 + 2 Events
        assert target.head(GROUP) == 6
        assert target.accept(workload.mission_update(GROUP, 0, 1)).seq == 7  # revision 1 restored, head moved on
        assert target.read(GROUP, after=6)[0].prev_hash == events[-1].hash


# -- eventsourcing peer -----------------------------------------------------------------------------


def test_eventsourcing_peer_refuses_an_expected_revision_ahead_of_the_aggregate(tmp_path: Path) -> None:
    with EventsourcingPeer.open(tmp_path / "es") as peer:
        peer.create(workload.mission_create(GROUP, 1))
        with pytest.raises(RevisionConflict):
            peer.update(workload.mission_update(GROUP, 1, 5))
        assert peer.get(GROUP, "m1").cost_limit == 100


def test_eventsourcing_peer_keeps_the_same_target_in_two_groups_apart(tmp_path: Path) -> None:
    assert mission_id("g-a", "m1") != mission_id("g-b", "m1")
    with EventsourcingPeer.open(tmp_path / "es") as peer:
        peer.create(workload.mission_create("g-a", 1))
        peer.create(workload.mission_create("g-b", 1))
        assert len(peer.read()) == 2


# -- bench_authority's row functions: what each counts and times ------------------------------------


class Recorder(bench_authority.Adapter):
    """A store that records each operation and whether it ran inside the timed block."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, bool]] = []
        self.timing = False
        self.lock = threading.Lock()
        self.fail_on: str | None = None

    def _note(self, op: str, what: Any) -> None:
        with self.lock:
            self.calls.append((op, what, self.timing))
        if self.fail_on == op:
            raise RuntimeError(f"{op} failed")

    def open(self, path: Path, *, sync: bool = True) -> Any:
        self._note("open", path)
        return self

    def close(self, store: Any) -> None:
        self._note("close", None)

    def setup_group(self, store: Any, group: str) -> None:
        self._note("setup_group", group)

    def accept(self, store: Any, command: Any) -> Any:
        self._note("accept", command)
        return ("receipt", command.action_id)

    def accept_many(self, store: Any, commands: Any) -> None:
        self._note("accept_many", list(commands))

    def timed_calls(self, op: str) -> list[Any]:
        return [what for name, what, timing in self.calls if name == op and timing]


def _context(tmp_path: Path, adapter: Recorder | None = None) -> harness.RoundContext:
    class Context(harness.RoundContext):
        @contextlib.contextmanager
        def timed(self) -> Iterator[None]:
            if adapter is not None:
                adapter.timing = True
            try:
                with super().timed():
                    yield
            finally:
                if adapter is not None:
                    adapter.timing = False

    directory = tmp_path / "round"
    directory.mkdir(parents=True, exist_ok=True)
    return Context(dir=directory, round=0, quick=True)


def test_accept_single_times_one_accept_per_command_and_nothing_else(tmp_path: Path) -> None:
    adapter = Recorder()
    assert bench_authority.accept_single(adapter, 5)(_context(tmp_path, adapter)) == 5
    assert adapter.timed_calls("accept") == workload.mission_creates(bench_authority.GROUP, 5)
    assert [op for op, _, timing in adapter.calls if timing] == ["accept"] * 5  # setup and close outside
    assert adapter.calls[-1][0] == "close"


def test_accept_threads_accepts_every_command_once_and_reports_a_thread_s_failure(tmp_path: Path) -> None:
    adapter = Recorder()
    assert bench_authority.accept_threads(adapter, 12, 4)(_context(tmp_path, adapter)) == 12
    accepted = adapter.timed_calls("accept")
    assert sorted(command.action_id for command in accepted) == sorted(
        command.action_id for command in workload.mission_creates(bench_authority.GROUP, 12)
    )
    failing = Recorder()
    failing.fail_on = "accept"
    with pytest.raises(RuntimeError, match="accept failed"):
        bench_authority.accept_threads(failing, 8, 2)(_context(tmp_path, failing))


def test_accept_batches_commits_batches_of_the_row_s_size(tmp_path: Path) -> None:
    adapter = Recorder()
    assert bench_authority.accept_batches(adapter, 10, 4)(_context(tmp_path, adapter)) == 10
    assert [len(batch) for batch in adapter.timed_calls("accept_many")] == [4, 4, 2]


def test_accept_updates_times_updates_with_expected_revision_on_missions_made_before(tmp_path: Path) -> None:
    adapter = Recorder()
    assert bench_authority.accept_updates(adapter, 3)(_context(tmp_path, adapter)) == 3
    created = [what for op, what, timing in adapter.calls if op == "accept_many" and not timing]
    assert created == [workload.mission_creates(bench_authority.GROUP, 3)]
    updates = adapter.timed_calls("accept")
    assert [(c.kind, c.target, c.expected_revision) for c in updates] == [
        ("mission.update", f"m{index}", 1) for index in range(3)
    ]


@pytest.mark.parametrize("rules", [False, True], ids=["sqlite", "sqlite_rules"])
def test_the_sqlite_write_rows_leave_every_command_accepted(tmp_path: Path, rules: bool) -> None:
    adapter = SqliteAdapter(rules=rules)
    rows = {
        "single": (bench_authority.accept_single(adapter, 4), 5),
        "threads": (bench_authority.accept_threads(adapter, 8, 4), 9),
        "batches": (bench_authority.accept_batches(adapter, 7, 3), 8),
        "updates": (bench_authority.accept_updates(adapter, 3), 7),
    }
    for name, (run, head) in rows.items():
        ctx = _context(tmp_path / name)
        run(ctx)
        with SqliteAuthority.open(ctx.dir / "store") as store:
            assert store.head(bench_authority.GROUP) == head, name


def test_the_adapter_refuses_a_batch_with_a_rejected_command(tmp_path: Path) -> None:
    adapter = SqliteAdapter(rules=False)
    store = adapter.open(tmp_path / "s")
    try:
        adapter.setup_group(store, bench_authority.GROUP)
        with pytest.raises(RuntimeError, match="REVISION_MISMATCH"):
            adapter.accept_many(store, [workload.mission_update(bench_authority.GROUP, 1, 1)])
    finally:
        adapter.close(store)


@pytest.fixture
def fixtures(bench: harness.Bench, monkeypatch: pytest.MonkeyPatch) -> Fixtures:
    monkeypatch.setattr(bench_authority, "POPULATE_BATCH_COMMANDS", 2)
    return Fixtures(bench)


def test_fixtures_hold_exactly_their_size_one_per_adapter_and_size(fixtures: Fixtures) -> None:
    adapter = SqliteAdapter(rules=False)
    three, five = fixtures.populated(adapter, 3), fixtures.populated(adapter, 5)
    assert three != five and fixtures.populated(adapter, 3) == three
    for path, count in ((three, 3), (five, 5)):
        with SqliteAuthority.open(path) as store:
            events = store.read(bench_authority.GROUP)
        assert [event.aggregate for event in events[1:]] == [
            f"mission:m{index}" for index in range(count)
        ]


def test_replay_duplicates_times_a_replay_of_every_command_and_appends_nothing(fixtures: Fixtures, tmp_path: Path) -> None:
    adapter = SqliteAdapter(rules=False)
    ctx = _context(tmp_path)
    assert bench_authority.replay_duplicates(adapter, fixtures, 4)(ctx) == 4
    with SqliteAuthority.open(fixtures.populated(adapter, 4)) as store:
        assert store.head(bench_authority.GROUP) == 5
    recorder = Recorder()
    recorder_fixtures = SimpleNamespace(populated=lambda adapter, count: tmp_path / "unused")
    bench_authority.replay_duplicates(recorder, recorder_fixtures, 4)(_context(tmp_path, recorder))
    assert recorder.timed_calls("accept") == workload.mission_creates(bench_authority.GROUP, 4)


def test_replay_duplicates_fails_a_store_whose_replay_differs(tmp_path: Path) -> None:
    class Changing(Recorder):
        def accept(self, store: Any, command: Any) -> Any:
            super().accept(store, command)
            return len(self.calls)

    adapter = Changing()
    fixtures = SimpleNamespace(populated=lambda adapter, count: tmp_path / "unused")
    with pytest.raises(AssertionError, match="different receipt"):
        bench_authority.replay_duplicates(adapter, fixtures, 2)(_context(tmp_path, adapter))


def test_read_decoded_counts_every_event_of_each_peer(fixtures: Fixtures, tmp_path: Path) -> None:
    assert bench_authority.read_decoded(SqliteAdapter(rules=False), fixtures, 5)(_context(tmp_path)) == 6  # + group.create
    assert bench_authority.read_decoded(EventsourcingAdapter(), fixtures, 5)(_context(tmp_path)) == 5  # no Groups


def test_read_decoded_fails_a_store_that_reads_short(tmp_path: Path) -> None:
    class Short(Recorder):
        def read_all(self, store: Any, group: str, on_page: Any = None) -> int:
            return 3

    fixtures = SimpleNamespace(populated=lambda adapter, count: tmp_path / "unused")
    with pytest.raises(AssertionError, match="read 3 Events, expected 5"):
        bench_authority.read_decoded(Short(), fixtures, 4)(_context(tmp_path))


def test_read_memory_reports_the_peak_heap_growth_sampled_after_each_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = iter([
        {"anon": 100.0, "file": 50.0, "total": 200.0},  # before reading
        {"anon": 130.0, "file": 60.0, "total": 260.0},  # after page 1
        {"anon": 120.0, "file": 90.0, "total": 300.0},  # after page 2
    ])
    monkeypatch.setattr(bench_authority, "rss_parts_mib", lambda: next(samples))
    monkeypatch.setattr(bench_authority, "rss_mib", lambda: (0.0, 310.0))
    monkeypatch.setattr(bench_authority, "reset_peak_rss", lambda: True)

    class Pages(Recorder):
        def read_all(self, store: Any, group: str, on_page: Any = None) -> int:
            on_page()
            on_page()
            return 20

    fixtures = SimpleNamespace(populated=lambda adapter, count: tmp_path / "unused")
    ctx = _context(tmp_path)
    assert bench_authority.read_memory(Pages(), fixtures, 20)(ctx) == 30.0
    assert ctx.extra == {"events_read": 20, "file_backed_growth_mib": 40.0, "rss_peak_growth_mib": 110.0}


def test_sqlite_redo_counts_the_events_it_re_applied(fixtures: Fixtures, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    assert bench_authority.sqlite_redo(fixtures, 4)(ctx) == 5
    with SqliteAuthority.open(ctx.dir / "redo") as target:
        assert target.head(bench_authority.GROUP) == 5


def test_the_redo_row_fails_an_open_that_redid_another_number_of_records(tmp_path: Path) -> None:
    base = tmp_path / "fixture" / "store"
    (base / "index").mkdir(parents=True)
    (tmp_path / "fixture" / bench_authority.BEHIND_INDEX).mkdir()

    class Opens(Recorder):
        def open(self, path: Path, *, sync: bool = True) -> Any:
            return SimpleNamespace(open_report=SimpleNamespace(mode="redo", redo_records=3), close=lambda: None)

    fixtures = SimpleNamespace(populated=lambda adapter, count: base)
    crash = bench_authority.MwpstoreCrash(fixtures, Opens(), 4)
    with pytest.raises(AssertionError, match="expected a redo of 4 records"):
        crash.open_with_redo()(_context(tmp_path))


def test_the_clean_open_row_fails_an_open_that_was_not_clean(tmp_path: Path) -> None:
    class Opens(Recorder):
        def open(self, path: Path, *, sync: bool = True) -> Any:
            return SimpleNamespace(open_report=SimpleNamespace(mode="redo"))

    run = bench_authority.open_store(Opens(), lambda: tmp_path)
    with pytest.raises(AssertionError, match="a clean open expected"):
        run(_context(tmp_path))


def test_the_growth_row_appends_new_missions_every_round(tmp_path: Path) -> None:
    adapter = SqliteAdapter(rules=False)
    path = tmp_path / "large"
    store = adapter.open(path)
    adapter.setup_group(store, bench_authority.GROUP)
    adapter.close(store)
    run = bench_authority.accept_on_store(adapter, lambda: path, 4, 2)
    for round_index in range(2):
        assert run(_context(tmp_path)) == 4
        with SqliteAuthority.open(path) as check:
            assert check.head(bench_authority.GROUP) == 1 + 4 * (round_index + 1)  # no round replays another's


def test_the_eventsourcing_adapter_counts_events_across_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_authority, "READ_PAGE_EVENTS", 2)
    adapter = EventsourcingAdapter()
    store = adapter.open(tmp_path / "es")
    try:
        adapter.accept_many(store, workload.mission_creates(GROUP, 5))
        pages: list[int] = []
        assert adapter.read_all(store, GROUP, on_page=lambda: pages.append(1)) == 5
        assert len(pages) == 3
    finally:
        adapter.close(store)
