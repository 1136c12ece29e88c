"""AgentStore apply and rebuild rates (DESIGN §8: apply with 1000 Events per durable local commit
≥ 200k Events/s).

Reproduce the committed results (``bench/results/agent_store.json``) with::

    python bench/bench_agent_store.py            # 100k Events, 5 rounds
    python bench/bench_agent_store.py --quick    # 20k Events, 3 rounds

The Events are made once (not timed) by the real work-model rules in memory (``MemoryGroup``): a
Group, Memberships, a Mission, then WorkItems created, claimed, started, checkpointed and renewed,
so most Events carry a full WorkItem state (and a claim also the Membership's) in their effects.

Rows (Events/s, higher is better):

- ``agent_apply_1000``: ``tx.apply_many`` of each run of 1000 Events (full validation, the checks
  of ``check_event`` made for the whole run in one C call: types, IDs, payload hash, chain link,
  hash), mirrored state, work queue, inbox, then ``advance_cursor`` and a durable commit (LMDB
  ``sync=True``) per run. ``mwpstore_trusted`` is the same with
  ``verify="trusted"`` (Events from an in-process Authority: types, IDs, sequence and chain link
  by comparison; no hash recomputation, no content walk). Peers in the same run:
  ``validate_only`` — the same Events through ``admit_event`` + ``check_event`` alone, no storage
  (the ceiling for any store that validates what it is delivered one Event per call);
  ``check_run_only`` — the same checks as ``apply_many`` makes them, in one call of
  ``mwpstore._apply_c.check_run`` over all the Events, no storage; ``sqlite`` — SQLite WAL with
  ``synchronous=FULL`` doing the same bookkeeping (inbox row, state upsert per effect, cursor row)
  on pre-validated Events, 1000 per transaction.
Each round also records ``events_per_cpu_second`` (Events per second of this process's CPU time),
which on a busy shared machine says more about the code than the wall-clock rate does. The
clock covers open, apply, commits and close; the projection digest that checks every round built
the same projection is taken after it stops (before 2026-12-03 it was inside the timed block,
about 150 ms per 100k Events).

- ``agent_rebuild``: delete the store and rebuild it from the Events through ``Delivery``
  (1000-Event reads from an in-memory source); the projection digest is checked after the clock
  stops.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec  # noqa: E402
from harness import Bench, RoundContext, Target, argument_parser, progress, selected  # noqa: E402

from mwpstore._apply_c import check_run  # noqa: E402
from mwpstore.agent_store import _CHECK_CONTEXT as CHECK_CONTEXT  # noqa: E402
from mwpstore.agent_store import AgentStore, admit_event  # noqa: E402
from mwpstore.delivery import Delivery, ListSource  # noqa: E402
from mwpstore.messages import ZERO_HASH, Command, Event, check_event  # noqa: E402
from mwpstore.registry import MemoryGroup  # noqa: E402

GROUP = "g-bench"
BATCH_EVENTS = 1000
MAP_BYTES = 4 * 1024 * 1024 * 1024
CONTRACT = {
    "max_attempts": 1000,
    "backoff_initial_ms": 100,
    "backoff_multiplier": 2,
    "backoff_max_ms": 1_000,
    "cost_limit": 1_000_000,
    "deadline_ms": None,
    "lease_ms": 10_000_000,
    "start_ms": 10_000_000,
}


def make_events(count: int) -> list[Event]:
    """A Group history of ``count`` Events produced by the work-model rules."""
    group = MemoryGroup(GROUP)
    clock = [1_000_000]
    actions = [0]

    def accept(actor: str, kind: str, target: str, body: dict, revision: int | None = None) -> Event:
        actions[0] += 1
        clock[0] += 1
        command = Command(actor=actor, action_id=f"a{actions[0]}", group=GROUP, kind=kind, target=target, body=body,
                          expected_revision=revision)
        return group.accept(command, now_ms=clock[0])

    accept("owner", "group.create", GROUP, {"org": "acme"})
    workers = [f"worker-{index}" for index in range(8)]
    for worker in workers:
        accept("owner", "membership.add", worker, {"role": "worker"}, group.revision(f"member:{worker}"))
    accept("owner", "mission.create", "m1", {"title": "bench", "cost_limit": 10**12, "approval_required": []})
    workitems = 0
    while len(group.events) < count:
        workitem = f"wi-{workitems}"
        workitems += 1
        accept("owner", "workitem.create", workitem, {"mission": "m1", "priority": workitems % 7, "contract": CONTRACT})
        worker = workers[workitems % len(workers)]
        session = group.get(f"member:{worker}")["session_epoch"]
        accept(worker, "workitem.claim", workitem, {"session_epoch": session}, group.revision(f"workitem:{workitem}"))
        lease = group.get(f"workitem:{workitem}")["lease"]
        fence = {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}
        accept(worker, "workitem.start", workitem, fence)
        accept(worker, "lease.renew", workitem, fence, group.revision(f"workitem:{workitem}"))
        accept(worker, "workitem.checkpoint", workitem, {**fence, "checkpoint": {"step": workitems}})
    return group.events[:count]


def apply_durably(path: Path, events: list[Event], verify: str = "full") -> None:
    agent = AgentStore.open(path, map_size=MAP_BYTES, verify=verify)
    try:
        for start in range(0, len(events), BATCH_EVENTS):
            with agent.begin() as tx:
                tx.apply_many(events[start : start + BATCH_EVENTS])
                tx.advance_cursor(GROUP)
        assert agent.cursor(GROUP) == len(events)
    finally:
        agent.close()


def projection_digest(path: Path) -> str:
    """The digest of the store's projections (after the clock stops: it reads the whole store)."""
    with AgentStore.open(path, map_size=MAP_BYTES) as agent:
        return agent.projection_digest()


def sqlite_bookkeeping(path: Path, events: list[Event]) -> None:
    encoder = msgspec.msgpack.Encoder(order="sorted")
    connection = sqlite3.connect(path / "agent.sqlite", isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE inbox (grp TEXT, seq INTEGER, hash BLOB, PRIMARY KEY (grp, seq)) WITHOUT ROWID")
    connection.execute("CREATE TABLE state (grp TEXT, aggregate TEXT, value BLOB, PRIMARY KEY (grp, aggregate)) WITHOUT ROWID")
    connection.execute("CREATE TABLE cursor (grp TEXT PRIMARY KEY, seq INTEGER, hash BLOB)")
    applied = 0
    for start in range(0, len(events), BATCH_EVENTS):
        connection.execute("BEGIN")
        for event in events[start : start + BATCH_EVENTS]:
            if event.seq != applied + 1:
                continue
            connection.execute("INSERT INTO inbox VALUES (?, ?, ?)", (event.group, event.seq, event.hash))
            for effect in event.effects:
                connection.execute(
                    "INSERT OR REPLACE INTO state VALUES (?, ?, ?)",
                    (event.group, effect.aggregate, encoder.encode((effect.revision, effect.state))),
                )
            applied = event.seq
        connection.execute("INSERT OR REPLACE INTO cursor VALUES (?, ?, ?)", (GROUP, applied, events[applied - 1].hash))
        connection.execute("COMMIT")
    connection.close()


@contextlib.contextmanager
def timed_with_cpu(ctx: RoundContext, count: int) -> Iterator[None]:
    """``ctx.timed()`` plus this process's CPU rate (Events per CPU second) as an extra figure:
    on a shared machine the wall-clock rate also counts time the process waited for a core."""
    cpu_start = time.process_time()
    with ctx.timed():
        yield
    cpu_seconds = time.process_time() - cpu_start
    ctx.extra["events_per_cpu_second"] = round(count / cpu_seconds) if cpu_seconds > 0 else None


def main() -> None:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=None, help="Events per round (default 100k, quick 20k)")
    args = parser.parse_args()
    count = args.events or (20_000 if args.quick else 100_000)
    bench = Bench("agent_store", quick=args.quick, rounds=args.rounds)
    progress(f"making {count} Events with the work-model rules")
    events = make_events(count)
    bench.facts.update(
        events=count,
        events_per_local_commit=BATCH_EVENTS,
        effects_per_event=round(sum(len(event.effects) for event in events) / count, 2),
        agent_lmdb="sync=True, metasync=True (one fsync per local commit)",
        sqlite_peer="WAL, synchronous=FULL, pre-validated Events, same bookkeeping",
    )
    size = {"events": count, "per_commit": BATCH_EVENTS}
    digests: set[str] = set()

    if selected(args, "agent_apply_1000"):

        def agent_apply(ctx: RoundContext) -> int:
            with timed_with_cpu(ctx, count):
                apply_durably(ctx.dir / "agent", events)
            digests.add(projection_digest(ctx.dir / "agent"))
            return count

        def agent_apply_trusted(ctx: RoundContext) -> int:
            with timed_with_cpu(ctx, count):
                apply_durably(ctx.dir / "agent", events, verify="trusted")
            digests.add(projection_digest(ctx.dir / "agent"))
            return count

        def validate_only(ctx: RoundContext) -> int:
            with timed_with_cpu(ctx, count):
                previous = None
                for event in events:
                    checked, _ = admit_event(event)
                    check_event(checked, expected_prev_hash=previous)
                    previous = checked.hash
            return count

        def check_run_only(ctx: RoundContext) -> int:
            with timed_with_cpu(ctx, count):
                end = check_run(events, 0, CHECK_CONTEXT, GROUP, 1, ZERO_HASH)
            if end != count:
                raise AssertionError(f"check_run passed {end} of {count} Events")
            return count

        def sqlite_peer(ctx: RoundContext) -> int:
            with timed_with_cpu(ctx, count):
                sqlite_bookkeeping(ctx.dir, events)
            return count

        row = bench.row(
            "agent_apply_1000", "AgentStore apply, 1000 Events per durable local commit", unit="Events/s",
            target=Target("≥ 200k Events/s", value_min=200_000), size=size,
        )
        row.compare(
            {"mwpstore": agent_apply, "mwpstore_trusted": agent_apply_trusted, "validate_only": validate_only,
             "check_run_only": check_run_only, "sqlite": sqlite_peer}
        )

    if selected(args, "agent_rebuild"):

        def rebuild(ctx: RoundContext) -> int:
            path = ctx.dir / "agent"
            apply_durably(path, events[:BATCH_EVENTS])  # a store with some state to delete
            source = ListSource(events)
            with timed_with_cpu(ctx, count):
                shutil.rmtree(path)
                agent = AgentStore.open(path, map_size=MAP_BYTES)
                Delivery(agent, source, batch_events=BATCH_EVENTS).catch_up(GROUP)
                agent.close()
            digests.add(projection_digest(path))
            return count

        row = bench.row("agent_rebuild", "AgentStore delete + rebuild from the Group's Events", unit="Events/s", size=size)
        row.compare({"mwpstore": rebuild})

    if len(digests) > 1:
        raise SystemExit(f"projection digests differ between rounds: {sorted(digests)}")
    bench.facts["projection_digest"] = next(iter(digests), None)
    bench.finish()


if __name__ == "__main__":
    main()
