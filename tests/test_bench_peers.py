"""Smoke tests of the benchmark harness and peers (``bench/``): correctness only, tiny sizes.

Nothing here measures or asserts speed; the benchmarks do that in ``bench/`` and report medians.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import msgspec
import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import harness  # noqa: E402
import run_all  # noqa: E402
import workload  # noqa: E402
from peer_eventsourcing import EventsourcingPeer, RevisionConflict  # noqa: E402
from peer_sqlite import SqliteAuthority  # noqa: E402

from mwpstore.errors import ActionIdCollision, NotAMember, RevisionMismatch  # noqa: E402
from mwpstore.messages import Command, check_event, encode_receipt  # noqa: E402

GROUP = "g-test"


def _clock() -> int:
    return 1_700_000_000_000


@pytest.fixture(params=[False, True], ids=["sqlite", "sqlite_rules"])
def sqlite_store(request: pytest.FixtureRequest, tmp_path: Path):
    store = SqliteAuthority.open(tmp_path / "sqlite", clock=_clock, rules=request.param)
    store.accept(workload.group_create(GROUP))
    yield store
    store.close()


# -- SQLite peer -----------------------------------------------------------------------------------


def test_sqlite_peer_is_durable_wal_full(tmp_path: Path) -> None:
    with SqliteAuthority.open(tmp_path / "s") as store:
        settings = store.settings()
    assert settings["journal_mode"] == "wal"
    assert settings["synchronous"] == "FULL"


def test_sqlite_peer_duplicate_returns_identical_receipt(sqlite_store: SqliteAuthority) -> None:
    command = workload.mission_create(GROUP, 1)
    first = sqlite_store.accept(command)
    again = sqlite_store.accept(command)
    assert again == first
    assert encode_receipt(again) == encode_receipt(first)
    assert sqlite_store.head(GROUP) == 2  # nothing appended by the replay


def test_sqlite_peer_detects_action_id_collision(sqlite_store: SqliteAuthority) -> None:
    command = workload.mission_create(GROUP, 1)
    sqlite_store.accept(command)
    changed = msgspec.structs.replace(command, body={"title": "other", "cost_limit": 100})
    with pytest.raises(ActionIdCollision):
        sqlite_store.accept(changed)
    assert sqlite_store.head(GROUP) == 2


def test_sqlite_peer_rejects_a_revision_mismatch_with_the_current_revision(sqlite_store: SqliteAuthority) -> None:
    sqlite_store.accept(workload.mission_create(GROUP, 1))
    assert sqlite_store.accept(workload.mission_update(GROUP, 1, 1)).revision == 2
    with pytest.raises(RevisionMismatch) as raised:
        sqlite_store.accept(
            Command(
                actor="owner", action_id="stale", group=GROUP, kind="mission.update", target="m1",
                body={"cost_limit": 7}, expected_revision=1,
            )
        )
    assert raised.value.current_revision == 2
    assert sqlite_store.head(GROUP) == 3


def test_sqlite_peer_accept_many_rejection_leaves_no_trace(sqlite_store: SqliteAuthority) -> None:
    commands = [
        workload.mission_create(GROUP, 1),
        workload.mission_update(GROUP, 9, 5),  # wrong revision (0): rejected
        workload.mission_create(GROUP, 2),
        workload.mission_create(GROUP, 1),  # duplicate inside the batch: the same receipt
    ]
    results = sqlite_store.accept_many(commands)
    assert [result.ok for result in results] == [True, False, True, True]
    assert results[1].error_code == "REVISION_MISMATCH"
    assert results[3].receipt == results[0].receipt
    assert [event.seq for event in sqlite_store.read(GROUP)] == [1, 2, 3]


def test_sqlite_peer_events_chain_and_decode(sqlite_store: SqliteAuthority) -> None:
    sqlite_store.accept_many(workload.mission_creates(GROUP, 5))
    events = sqlite_store.read(GROUP, after=0, limit=100)
    assert [event.seq for event in events] == list(range(1, 7))
    previous = events[0].prev_hash
    for event in events:
        check_event(event, expected_prev_hash=previous)
        previous = event.hash
    assert sqlite_store.read(GROUP, after=4, limit=1)[0].seq == 5


def test_sqlite_peer_same_command_from_two_threads_appends_once(sqlite_store: SqliteAuthority) -> None:
    command = workload.mission_create(GROUP, 1)
    receipts = []
    start = threading.Barrier(2)

    def send() -> None:
        start.wait()
        receipts.append(sqlite_store.accept(command))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(receipts) == 2 and receipts[0] == receipts[1]
    assert sqlite_store.head(GROUP) == 2


def test_sqlite_peer_threads_accept_everything(tmp_path: Path) -> None:
    with SqliteAuthority.open(tmp_path / "s", writer_lock=False) as store:
        store.accept(workload.group_create(GROUP))
        parts = workload.split(workload.mission_creates(GROUP, 40), 4)
        threads = [threading.Thread(target=lambda part=part: [store.accept(c) for c in part]) for part in parts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [event.seq for event in store.read(GROUP, limit=100)] == list(range(1, 42))


def test_sqlite_rules_variant_runs_mwpstore_rules(tmp_path: Path) -> None:
    with SqliteAuthority.open(tmp_path / "s", rules=True) as store:
        store.accept(workload.group_create(GROUP))
        stranger = Command(
            actor="stranger", action_id="a1", group=GROUP, kind="mission.create", target="m1",
            body={"title": "t", "cost_limit": 1},
        )
        with pytest.raises(NotAMember):
            store.accept(stranger)


def test_sqlite_peer_redo_reproduces_the_store(sqlite_store: SqliteAuthority, tmp_path: Path) -> None:
    sqlite_store.accept_many(workload.mission_creates(GROUP, 7))
    events = sqlite_store.read(GROUP, limit=100)
    with SqliteAuthority.open(tmp_path / "redo") as target:
        assert target.redo(iter(events), batch_events=3) == 8
        assert target.read(GROUP, limit=100) == events
        duplicate = target.accept(workload.mission_create(GROUP, 3))
        assert duplicate == sqlite_store.accept(workload.mission_create(GROUP, 3))


# -- eventsourcing peer ----------------------------------------------------------------------------


def test_eventsourcing_peer_create_update_read(tmp_path: Path) -> None:
    with EventsourcingPeer.open(tmp_path / "es") as peer:
        assert peer.settings()["journal_mode"] == "wal"
        peer.create(workload.mission_create(GROUP, 1))
        peer.create_many(workload.mission_creates(GROUP, 3, start=2))
        assert peer.update(workload.mission_update(GROUP, 1, 1)) == 2
        with pytest.raises(RevisionConflict):
            peer.update(workload.mission_update(GROUP, 1, 1))
        assert peer.get(GROUP, "m1").cost_limit == 101
        events, last = peer.read_positions(0, 100)
        assert len(events) == 5 and last == 5
        assert len(peer.read(after=4, limit=100)) == 1


# -- harness -------------------------------------------------------------------------------------


def test_work_root_is_never_a_memory_filesystem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MWPSTORE_BENCH_DIR", raising=False)
    root = harness.choose_work_root()
    assert harness.mount_of(root)["fstype"] not in {"tmpfs", "ramfs"}


def test_harness_rows_medians_ratios_and_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MWPSTORE_BENCH_DIR", str(tmp_path / "work"))
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    bench = harness.Bench("smoke", rounds=3, command="python smoke")
    seen_dirs: list[Path] = []

    def fast(ctx: harness.RoundContext) -> int:
        assert ctx.dir.is_dir() and not any(ctx.dir.iterdir())
        seen_dirs.append(ctx.dir)
        with ctx.timed():
            sum(range(1000))
        ctx.extra["note"] = 1
        return 100

    def broken(ctx: harness.RoundContext) -> int:
        raise RuntimeError("boom")

    row = bench.row(
        "r", "a row", unit="ops/s", target=harness.Target("≥ 0.5× peer", ratio_min={"peer": 0.5}), primary="mine"
    )
    row.compare({"mine": fast, "peer": fast, "broken": broken, "absent": None})
    assert len(row.measurements["mine"].values) == 3
    assert len(set(seen_dirs)) == 6  # a fresh directory every round
    assert set(row.ratios()) == {"mine/peer"}
    assert row.verdict()[0] in (True, False)
    assert "broken" in row.errors and any("absent" in note for note in row.notes)
    memory = bench.row("m", "memory", unit="MiB", target=harness.Target("≤ 10", value_max=10))
    memory.measure("mwpstore", lambda ctx: 3.0)
    assert memory.verdict() == (True, [])
    result = bench.finish()
    written = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert written["rows"][1]["subjects"]["mwpstore"]["median"] == 3.0
    assert written["machine"]["cores"] >= 1 and written["machine"]["data_filesystem"]
    assert result["rows"][0]["ratios"]
    table = (tmp_path / "results" / "smoke.md").read_text()
    assert "| a row" in table and "met" in table
    assert not bench.run_dir.exists()


def test_target_needs_its_subjects() -> None:
    target = harness.Target("≥ 2× sqlite", value_min=10, ratio_min={"sqlite": 2})
    assert target.evaluate("mwpstore", {"mwpstore": 30, "sqlite": 10}) == (True, [])
    met, reasons = target.evaluate("mwpstore", {"mwpstore": 15, "sqlite": 10})
    assert met is False and reasons
    assert target.evaluate("mwpstore", {"mwpstore": 30})[0] is None


def test_run_all_renders_a_report_from_results() -> None:
    result = {
        "name": "x",
        "quick": True,
        "rounds": 3,
        "machine": {"cpu_model": "cpu", "cores": 2, "libraries": {"msgspec": "0"}},
        "rows": [
            {
                "key": "k", "title": "durable accept", "unit": "Commands/s", "primary": "mwpstore", "size": {},
                "subjects": {
                    "mwpstore": {"median": 3000.0, "min": 1.0, "max": 4.0},
                    "sqlite": {"median": 1000.0, "min": 1.0, "max": 2.0},
                },
                "ratios": {"mwpstore/sqlite": 3.0},
                "target": {"text": "≥ 1.5× SQLite", "ratio_min": {"sqlite": 1.5}},
                "met": True,
            }
        ],
    }
    report = run_all.render_report({"quick": True, "results": {"x": result, "other": {"foo": 1}}, "modules": []})
    assert "python bench/run_all.py --quick" in report
    assert "| durable accept | 3.00k Commands/s | sqlite: 1.00k Commands/s | 3.00× | ≥ 1.5× SQLite | met |" in report
    assert "not in the harness format" in report


def test_quick_runs_never_touch_the_committed_results() -> None:
    full, quick = run_all.Paths(False), run_all.Paths(True)
    assert quick.results == harness.results_dir(True) != harness.results_dir(False) == full.results
    assert full.report.name == "benchmarks.md" and full.report.parent.name == "docs"
    assert quick.report.parent == quick.results and quick.summary.parent == quick.results
