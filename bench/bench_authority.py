"""The Authority's rows of DESIGN §8, with the SQLite and eventsourcing peers in the same run.

Reproduce the committed results (``bench/results/authority.json``) with::

    python bench/bench_authority.py            # full sizes, 5 rounds (9 for fsync-bound rows); ≈ 10 minutes
    python bench/bench_authority.py --quick    # small sizes, 3 rounds (5 for fsync-bound rows); ≈ 1 minute

or everything at once with ``python bench/run_all.py [--quick]``. DESIGN §8 names a 10M-Event store
for the clean-open, growth and memory rows; the full run uses 1M to stay within its time budget,
and ``bench/results/authority_10m.json`` comes from::

    python bench/bench_authority.py --results-name authority_10m --large-events 10000000 \
        --subjects mwpstore --only open_clean --only growth --only read_memory

Subjects: ``mwpstore`` (``mwpstore.Authority``, durable: ``sync=True``); ``sqlite`` (the
acceptance transaction in SQLite, WAL + ``synchronous=FULL``, ``bench/peer_sqlite.py``; the peer
DESIGN §8's ratios are taken against); ``sqlite_rules`` (the same, deciding with mwpstore's own
rules, i.e. exactly mwpstore's work); ``eventsourcing`` (the library on SQLite, create + save of
an aggregate per Command; it keeps no receipts, sequences or hash chains, so it does less).

Every subject accepts the same Commands (``bench/workload.py``): a ``group.create``, then
``mission.create`` with distinct targets, or ``mission.update`` with ``expected_revision``.
Write rows start from an empty store in a fresh directory each round; read rows share a store
populated once per run (populating is not timed). Rates are Commands (or Events, or records) per
second; ratios are mwpstore ÷ peer on medians. The machine is shared: quote medians.

Rows that need something this checkout lacks (e.g. ``mwpstore.Authority`` before it lands) are
reported as not available instead of failing the run.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the checkout on sys.path first)
from harness import (
    Bench,
    RoundContext,
    Target,
    argument_parser,
    progress,
    reset_peak_rss,
    rss_mib,
    rss_parts_mib,
    selected,
)

import workload
from peer_eventsourcing import EventsourcingPeer
from peer_sqlite import SqliteAuthority

GROUP = "g-bench"
READ_PAGE_EVENTS = 10_000
POPULATE_BATCH_COMMANDS = 1000
BEHIND_INDEX = "index-behind"


def load_authority() -> tuple[Any, str]:
    """``mwpstore.Authority`` if this checkout can open one, else (None, why not)."""
    try:
        from mwpstore.authority import Authority
    except Exception as exc:  # ImportError, or the compiled segment log missing
        return None, f"{type(exc).__name__}: {exc}"
    return Authority, ""


# -- Sizes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    single: int
    threads: int
    thread_count: int
    many: int
    many_batch: int
    duplicate: int
    update: int
    read: int
    redo: int
    large: int
    growth: int
    heavy_rounds: int
    eventsourcing_read: int = 200_000  # the library populates at ≈ 8k/s here: a smaller store

    @classmethod
    def for_run(cls, quick: bool, large: int | None) -> Sizes:
        if quick:
            sizes = cls(300, 1600, 16, 5000, 100, 5000, 300, 50_000, 50_000, 50_000, 5000, 2, 50_000)
        else:
            sizes = cls(1000, 4000, 16, 20_000, 100, 20_000, 1000, 1_000_000, 1_000_000, 1_000_000, 20_000, 3)
        if large is not None:
            sizes = cls(**{**sizes.__dict__, "large": large})
        return sizes


# -- Subjects: one small adapter per store -------------------------------------------------------


class Adapter:
    """The operations the rows need, over one store type."""

    name = ""
    bulk_sync = False  # open fixtures with durability off while populating (not timed)

    def open(self, path: Path, *, sync: bool = True) -> Any:
        raise NotImplementedError

    def close(self, store: Any) -> None:
        store.close()

    def setup_group(self, store: Any, group: str) -> None:
        store.accept(workload.group_create(group))

    def accept(self, store: Any, command: Any) -> Any:
        return store.accept(command)

    def accept_many(self, store: Any, commands: Sequence[Any]) -> None:
        results = store.accept_many(commands)
        if not all(result.ok for result in results):
            failed = next(result for result in results if not result.ok)
            raise RuntimeError(f"{self.name}: accept_many rejected a Command: {failed.error_code} {failed.message}")

    def read_all(self, store: Any, group: str, on_page: Callable[[], None] | None = None) -> int:
        count = 0
        after = 0
        while True:
            events = store.read(group, after=after, limit=READ_PAGE_EVENTS)
            if not events:
                return count
            count += len(events)
            after = events[-1].seq
            if on_page is not None:
                on_page()

    def warm_thread(self, store: Any) -> None:
        """Per-thread setup done before the clock starts (e.g. a connection)."""


class MwpstoreAdapter(Adapter):
    name = "mwpstore"

    def __init__(self, authority_class: Any) -> None:
        self.authority_class = authority_class

    def open(self, path: Path, *, sync: bool = True) -> Any:
        return self.authority_class.open(path, sync=sync)


class SqliteAdapter(Adapter):
    def __init__(self, *, rules: bool) -> None:
        self.rules = rules
        self.name = "sqlite_rules" if rules else "sqlite"

    def open(self, path: Path, *, sync: bool = True) -> Any:
        return SqliteAuthority.open(path, sync=sync, rules=self.rules)

    def warm_thread(self, store: Any) -> None:
        store._connection()


class EventsourcingAdapter(Adapter):
    name = "eventsourcing"

    def open(self, path: Path, *, sync: bool = True) -> Any:
        return EventsourcingPeer.open(path)

    def setup_group(self, store: Any, group: str) -> None:
        """The library has no Groups."""

    def accept(self, store: Any, command: Any) -> Any:
        if command.kind == "mission.create":
            return store.create(command)
        if command.kind == "mission.update":
            return store.update(command)
        raise ValueError(f"the eventsourcing peer does not model {command.kind}")

    def accept_many(self, store: Any, commands: Sequence[Any]) -> None:
        store.create_many(commands)

    def read_all(self, store: Any, group: str, on_page: Callable[[], None] | None = None) -> int:
        count = 0
        after = 0
        while True:
            events, after = store.read_positions(after, READ_PAGE_EVENTS)
            if not events:
                return count
            count += len(events)
            if on_page is not None:
                on_page()


# -- Row functions ------------------------------------------------------------------------------


def accept_single(adapter: Adapter, count: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        store = adapter.open(ctx.dir / "store")
        try:
            adapter.setup_group(store, GROUP)
            commands = workload.mission_creates(GROUP, count)
            with ctx.timed():
                for command in commands:
                    adapter.accept(store, command)
        finally:
            adapter.close(store)
        return count

    return run


def accept_threads(adapter: Adapter, count: int, thread_count: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        store = adapter.open(ctx.dir / "store")
        try:
            adapter.setup_group(store, GROUP)
            parts = workload.split(workload.mission_creates(GROUP, count), thread_count)
            start = threading.Barrier(thread_count + 1)
            errors: list[BaseException] = []

            def worker(commands: list[Any]) -> None:
                try:
                    adapter.warm_thread(store)
                    start.wait()
                    for command in commands:
                        adapter.accept(store, command)
                except BaseException as exc:  # reported after the join
                    errors.append(exc)
                    start.abort()

            threads = [threading.Thread(target=worker, args=(part,)) for part in parts]
            for thread in threads:
                thread.start()
            with ctx.timed():
                try:
                    start.wait()
                except threading.BrokenBarrierError:
                    pass
                for thread in threads:
                    thread.join()
            if errors:
                raise errors[0]
            if hasattr(store, "retries"):
                ctx.extra["retries"] = store.retries
        finally:
            adapter.close(store)
        return count

    return run


def accept_batches(adapter: Adapter, count: int, batch: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        store = adapter.open(ctx.dir / "store")
        try:
            adapter.setup_group(store, GROUP)
            batches = list(workload.batches(workload.mission_creates(GROUP, count), batch))
            with ctx.timed():
                for commands in batches:
                    adapter.accept_many(store, commands)
        finally:
            adapter.close(store)
        return count

    return run


def accept_updates(adapter: Adapter, count: int) -> Callable[[RoundContext], int]:
    """``mission.update`` with an expected revision, one commit each, on Missions created in setup."""

    def run(ctx: RoundContext) -> int:
        store = adapter.open(ctx.dir / "store")
        try:
            adapter.setup_group(store, GROUP)
            for commands in workload.batches(workload.mission_creates(GROUP, count), POPULATE_BATCH_COMMANDS):
                adapter.accept_many(store, commands)
            updates = [workload.mission_update(GROUP, index, 1) for index in range(count)]
            with ctx.timed():
                for command in updates:
                    adapter.accept(store, command)
        finally:
            adapter.close(store)
        return count

    return run


class Fixtures:
    """Stores populated once per run and shared by the rows that only read them."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.paths: dict[tuple[str, int], Path] = {}

    def populated(self, adapter: Adapter, count: int) -> Path:
        """A store holding ``group.create`` + ``count`` ``mission.create`` Events (made on first use)."""
        key = (adapter.name, count)
        if key in self.paths:
            return self.paths[key]
        path = self.bench.fixture_dir(f"{adapter.name}-{count}") / "store"
        progress(f"  populating {adapter.name} with {count:,} Events (not timed)")
        started = time.perf_counter()
        store = adapter.open(path, sync=False)
        try:
            adapter.setup_group(store, GROUP)
            if isinstance(adapter, MwpstoreAdapter):
                # Keep the index as it is now, before the bulk: MwpstoreCrash puts it back later.
                adapter.close(store)
                shutil.copytree(path / "index", path.parent / BEHIND_INDEX)
                store = adapter.open(path, sync=False)
            done = 0
            while done < count:
                size = min(POPULATE_BATCH_COMMANDS, count - done)
                adapter.accept_many(store, workload.mission_creates(GROUP, size, start=done))
                done += size
                if done % 200_000 == 0:
                    progress(f"    {done:,}/{count:,}")
        finally:
            adapter.close(store)
        progress(f"  populated {adapter.name}: {count / (time.perf_counter() - started):,.0f} Commands/s")
        self.paths[key] = path
        return path


def replay_duplicates(adapter: Adapter, fixtures: Fixtures, count: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        path = fixtures.populated(adapter, count)
        store = adapter.open(path)
        try:
            commands = workload.mission_creates(GROUP, count)
            first = adapter.accept(store, commands[0])
            with ctx.timed():
                for command in commands:
                    adapter.accept(store, command)
            if adapter.accept(store, commands[0]) != first:
                raise AssertionError(f"{adapter.name}: a replay returned a different receipt")
        finally:
            adapter.close(store)
        return count

    return run


def read_decoded(adapter: Adapter, fixtures: Fixtures, count: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        ctx.extra["store_events"] = count
        path = fixtures.populated(adapter, count)
        store = adapter.open(path)
        try:
            with ctx.timed():
                read = adapter.read_all(store, GROUP)
        finally:
            adapter.close(store)
        expected = count if isinstance(adapter, EventsourcingAdapter) else count + 1
        if read != expected:
            raise AssertionError(f"{adapter.name}: read {read} Events, expected {expected}")
        return read

    return run


def read_memory(adapter: Adapter, fixtures: Fixtures, count: int) -> Callable[[RoundContext], float]:
    """Peak growth of anonymous resident memory (MiB) while reading every Event, page by page.

    Sampled after every page of 10,000 Events (``RssAnon``): the heap, which is what would grow
    without bound. Mapped file pages (mmapped segments, LMDB) also count in RSS but are page cache
    the kernel reclaims under pressure; their peak and the whole-RSS peak (``VmHWM``) go to extras.
    """

    def run(ctx: RoundContext) -> float:
        path = fixtures.populated(adapter, count)
        store = adapter.open(path)
        try:
            before = rss_parts_mib()
            peak = dict(before)
            hwm_reset = reset_peak_rss()

            def sample() -> None:
                for kind, value in rss_parts_mib().items():
                    if value > peak[kind]:
                        peak[kind] = value

            read = adapter.read_all(store, GROUP, on_page=sample)
            _, high_water = rss_mib()
        finally:
            adapter.close(store)
        ctx.extra["events_read"] = read
        ctx.extra["file_backed_growth_mib"] = round(peak["file"] - before["file"], 1)
        if hwm_reset:
            ctx.extra["rss_peak_growth_mib"] = round(high_water - before["total"], 1)
        return max(0.0, peak["anon"] - before["anon"])

    return run


def sqlite_redo(fixtures: Fixtures, count: int) -> Callable[[RoundContext], int]:
    """Re-apply ``count`` already-decided Events through SQLite (10,000 per transaction)."""
    source_adapter = SqliteAdapter(rules=False)

    def run(ctx: RoundContext) -> int:
        source = SqliteAuthority.open(fixtures.populated(source_adapter, count))
        target = SqliteAuthority.open(ctx.dir / "redo")
        applied = 0
        try:
            after = 0
            while True:
                events = source.read(GROUP, after=after, limit=READ_PAGE_EVENTS)  # not timed
                if not events:
                    break
                after = events[-1].seq
                with ctx.timed():
                    applied += target.redo(events, batch_events=READ_PAGE_EVENTS)
        finally:
            source.close()
            target.close()
        return applied

    return run


class MwpstoreCrash:
    """An mwpstore store whose index lags its log by ``count`` records, as after a crash.

    The populated fixture (:class:`Fixtures`) keeps a copy of its index taken right after the
    ``group.create``; each round puts that copy back, so the open must redo exactly ``count`` log
    records (``open_report.mode == "redo"``) and leaves the store as it was. With one LMDB commit
    per log group the engine itself never lags by more than one group after a crash; the old
    index stands for "LMDB is behind" at a size that makes redo's throughput measurable.
    """

    def __init__(self, fixtures: Fixtures, adapter: MwpstoreAdapter, count: int) -> None:
        self.fixtures = fixtures
        self.adapter = adapter
        self.count = count

    def open_with_redo(self) -> Callable[[RoundContext], int]:
        def run(ctx: RoundContext) -> int:
            base = self.fixtures.populated(self.adapter, self.count)
            shutil.rmtree(base / "index")
            shutil.copytree(base.parent / BEHIND_INDEX, base / "index")
            with ctx.timed():
                auth = self.adapter.open(base)
            report = auth.open_report
            auth.close()
            if report.mode != "redo" or report.redo_records != self.count:
                raise AssertionError(f"expected a redo of {self.count} records, got {report}")
            return report.redo_records

        return run


def open_store(adapter: Adapter, path_of: Callable[[], Path]) -> Callable[[RoundContext], int]:
    """Time to open an existing, cleanly closed store (closing is not timed).

    Before its first round the store is opened and closed once, untimed, after ``os.sync()``: a
    store populated seconds earlier still has gigabytes in writeback, and the first opens then
    measured the disk draining (5.9 ms, then 3.4 ms, then about 1.2 ms for a 10M-Event store)."""
    settled: list[bool] = []

    def run(ctx: RoundContext) -> int:
        path = path_of()
        if not settled:
            os.sync()
            adapter.close(adapter.open(path))
            settled.append(True)
        with ctx.timed():
            store = adapter.open(path)
        report = getattr(store, "open_report", None)
        adapter.close(store)
        if report is not None and report.mode != "clean":
            raise AssertionError(f"a clean open expected, got {report}")
        return 1

    return run


def empty_store(bench: Bench, adapter: Adapter) -> Callable[[], Path]:
    made: list[Path] = []

    def path() -> Path:
        if not made:
            directory = bench.fixture_dir(f"{adapter.name}-empty") / "store"
            store = adapter.open(directory)
            adapter.setup_group(store, GROUP)
            adapter.close(store)
            made.append(directory)
        return made[0]

    return path


def accept_on_store(adapter: Adapter, path_of: Callable[[], Path], count: int, batch: int) -> Callable[[RoundContext], int]:
    """``accept_many`` of ``batch`` on an existing store (new Mission targets each round)."""
    rounds_done = [0]

    def run(ctx: RoundContext) -> int:
        path = path_of()
        store = adapter.open(path)
        try:
            prefix = f"grow{rounds_done[0]}-"
            rounds_done[0] += 1
            batches = list(workload.batches(workload.mission_creates(GROUP, count, prefix=prefix), batch))
            with ctx.timed():
                for commands in batches:
                    adapter.accept_many(store, commands)
        finally:
            adapter.close(store)
        return count

    return run


# -- The run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--large-events", type=int, default=None, help="size of the large store (open, growth, memory rows)")
    parser.add_argument(
        "--subjects", default="mwpstore,sqlite,sqlite_rules,eventsourcing", help="comma-separated subjects to run"
    )
    parser.add_argument(
        "--results-name", default="authority", help="write bench/results/NAME.json (e.g. authority_10m for a --large-events run)"
    )
    args = parser.parse_args(argv)
    sizes = Sizes.for_run(args.quick, args.large_events)
    wanted = set(args.subjects.split(","))
    bench = Bench(args.results_name, quick=args.quick, rounds=args.rounds)
    heavy_rounds = min(bench.rounds, sizes.heavy_rounds)
    # Rows bound by fsync latency swing most with a neighbour's disk traffic: more, interleaved rounds.
    sync_rounds = args.rounds or (5 if args.quick else 9)

    authority_class, missing = load_authority()
    if authority_class is None:
        progress(f"mwpstore.Authority is not available here ({missing}): peers only")
    mwpstore = MwpstoreAdapter(authority_class) if authority_class is not None and "mwpstore" in wanted else None
    sqlite = SqliteAdapter(rules=False) if "sqlite" in wanted else None
    sqlite_rules = SqliteAdapter(rules=True) if "sqlite_rules" in wanted else None
    eventsourcing = EventsourcingAdapter() if "eventsourcing" in wanted else None
    fixtures = Fixtures(bench)

    bench.facts["sizes"] = sizes.__dict__
    bench.facts["mwpstore"] = {"available": authority_class is not None, "why_not": missing}
    with bench.fresh_dir("settings") as directory:
        with SqliteAuthority.open(directory / "sqlite") as store:
            bench.facts["sqlite"] = store.settings()
        with EventsourcingPeer.open(directory / "eventsourcing") as peer:
            bench.facts["eventsourcing"] = peer.settings()

    def subjects(factory: Callable[[Adapter], Callable[[RoundContext], Any]], *adapters: Adapter | None) -> dict[str, Any]:
        names = ["mwpstore", "sqlite", "sqlite_rules", "eventsourcing"]
        chosen = {adapter.name: adapter for adapter in adapters if adapter is not None}
        result: dict[str, Any] = {}
        for name in names:
            if name in chosen:
                result[name] = factory(chosen[name])
            elif name == "mwpstore" and "mwpstore" in wanted:
                result[name] = None  # reported as not available
        return result

    if selected(args, "accept_single"):
        bench.row(
            "accept_single", "durable accept, 1 thread, one commit each", unit="Commands/s",
            size={"commands": sizes.single},
            target=Target("≥ 1.5× SQLite FULL doing the same work", ratio_min={"sqlite": 1.5}),
        ).compare(
            subjects(lambda a: accept_single(a, sizes.single), mwpstore, sqlite, sqlite_rules, eventsourcing),
            rounds=sync_rounds,
        )

    if selected(args, "accept_threads"):
        bench.row(
            "accept_threads", f"durable accept, {sizes.thread_count} threads, group commit", unit="Commands/s",
            size={"commands": sizes.threads},
            target=Target("≥ 60k Commands/s and ≥ 10× SQLite FULL with 16 threads", value_min=60_000, ratio_min={"sqlite": 10}),
        ).compare(
            subjects(lambda a: accept_threads(a, sizes.threads, sizes.thread_count), mwpstore, sqlite, sqlite_rules, eventsourcing),
            rounds=sync_rounds,
        )

    if selected(args, "accept_many"):
        bench.row(
            "accept_many", f"accept_many, {sizes.many_batch} per commit", unit="Commands/s",
            size={"commands": sizes.many},
            target=Target("≥ 100k Commands/s and ≥ 3× SQLite FULL 100 per transaction", value_min=100_000, ratio_min={"sqlite": 3}),
        ).compare(
            subjects(lambda a: accept_batches(a, sizes.many, sizes.many_batch), mwpstore, sqlite, sqlite_rules, eventsourcing)
        )

    if selected(args, "accept_duplicate"):
        bench.row(
            "accept_duplicate", "duplicate accept (receipt replay)", unit="Commands/s",
            size={"commands": sizes.duplicate},
            target=Target("≥ 300k/s and ≥ 2× SQLite", value_min=300_000, ratio_min={"sqlite": 2}),
        ).compare(subjects(lambda a: replay_duplicates(a, fixtures, sizes.duplicate), mwpstore, sqlite))

    if selected(args, "accept_update"):
        bench.row(
            "accept_update", "durable update with expected revision, 1 thread, one commit each", unit="Commands/s",
            size={"commands": sizes.update},
        ).compare(
            subjects(lambda a: accept_updates(a, sizes.update), mwpstore, sqlite, sqlite_rules, eventsourcing),
            rounds=sync_rounds,
        )

    if selected(args, "read_decoded"):
        read_row = bench.row(
            "read_decoded", "read, decoded Events", unit="Events/s", size={"events": sizes.read},
            target=Target("≥ 2M Events/s and ≥ 5× SQLite's decoded read", value_min=2_000_000, ratio_min={"sqlite": 5}),
        )
        read_row.compare(
            subjects(
                lambda a: read_decoded(a, fixtures, sizes.eventsourcing_read if a is eventsourcing else sizes.read),
                mwpstore,
                sqlite,
                eventsourcing,
            ),
            rounds=heavy_rounds,
        )
        if eventsourcing is not None and sizes.eventsourcing_read != sizes.read:
            read_row.notes.append(f"eventsourcing reads a store of {sizes.eventsourcing_read:,} Events (it populates slowly)")

    if selected(args, "redo"):
        crash = MwpstoreCrash(fixtures, mwpstore, sizes.redo) if mwpstore is not None else None
        bench.row(
            "redo", "open after a crash: records redone", unit="records/s", size={"records": sizes.redo},
            target=Target("≥ 500k records/s and ≥ 2× re-applying the same Events through SQLite", value_min=500_000, ratio_min={"sqlite": 2}),
        ).compare(
            {
                **({"mwpstore": crash.open_with_redo() if crash else None} if "mwpstore" in wanted else {}),
                **({"sqlite": sqlite_redo(fixtures, sizes.redo)} if sqlite is not None else {}),
            },
            rounds=heavy_rounds,
        )

    large_store = (lambda: fixtures.populated(mwpstore, sizes.large)) if mwpstore is not None else None
    if selected(args, "open_clean"):
        bench.row(
            "open_clean", "clean open: large store vs empty store", unit="ms", primary="mwpstore_large",
            size={"events": sizes.large},
            target=Target("within 1.5× of an empty store's open (no scan)", ratio_max={"mwpstore_empty": 1.5}),
        ).compare(
            {
                "mwpstore_large": open_store(mwpstore, large_store) if mwpstore and large_store else None,
                "mwpstore_empty": open_store(mwpstore, empty_store(bench, mwpstore)) if mwpstore else None,
            },
            rounds=sync_rounds,
        )

    if selected(args, "growth"):
        bench.row(
            "growth", f"accept cost at a large store vs empty (accept_many of {sizes.many_batch})", unit="Commands/s",
            primary="mwpstore_large", size={"events": sizes.large, "commands": sizes.growth},
            target=Target("accept cost within 1.2× of an empty store", ratio_min={"mwpstore_empty": 1 / 1.2}),
        ).compare(
            {
                "mwpstore_large": accept_on_store(mwpstore, large_store, sizes.growth, sizes.many_batch) if mwpstore and large_store else None,
                "mwpstore_empty": accept_batches(mwpstore, sizes.growth, sizes.many_batch) if mwpstore else None,
            },
            rounds=sync_rounds,
        )

    if selected(args, "read_memory"):
        bench.row(
            "read_memory", "peak heap (anonymous RSS) growth while reading every Event", unit="MiB",
            size={"events": sizes.large},
            target=Target("memory bounded: ≤ 256 MiB whatever the store size", value_max=256),
        ).compare(
            {
                "mwpstore": read_memory(mwpstore, fixtures, sizes.large) if mwpstore else None,
                **({"sqlite": read_memory(sqlite, fixtures, sizes.large)} if sqlite is not None else {}),
            },
            rounds=min(2, heavy_rounds),
        )

    bench.finish(keep_data=args.keep_data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
