"""The work-model mix from 16 threads with group commit, with the SQLite peer in the same run.

Reproduce the committed results (``bench/results/work_model.json``) with::

    python bench/bench_work_model.py            # full sizes, 5 rounds
    python bench/bench_work_model.py --quick    # small sizes, 3 rounds

or everything at once with ``python bench/run_all.py [--quick]``.

The mix, per WorkItem (one worker thread drives each WorkItem from start to end, one Command at a
time, each its own durable commit): ``workitem.claim``, ``workitem.start``, ``lease.renew`` × 3,
``workitem.checkpoint``, then — the checkpoint released the lease (MWP-WRK-014) — ``workitem.claim``,
``workitem.start``, ``workitem.submit``: 9 transitions. Claims and renewals carry their expected
revision (compare-and-set). Leases are long enough never to lapse during a round, so every
Command is accepted and all of them can be built before the clock starts. Setup (the Group, 16
worker Memberships, a Mission, the WorkItems) is not timed.

Subjects: ``mwpstore`` (``mwpstore.Authority``, ``sync=True``); ``sqlite_rules`` (the SQLite peer
of ``bench/peer_sqlite.py`` deciding with mwpstore's own rules, so it does the same work:
membership, fencing, CAS, effects on two aggregates). The peer's rule-free variant (subject
``sqlite``) is not a subject here: it derives the aggregate from the kind's prefix, so
``lease.renew`` would land on a ``lease:`` aggregate, and without rules there is no lease to
fence. Rates are transitions per second; ratios are mwpstore ÷ peer on medians. Target (issue 3):
≥ 40k transitions/s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the checkout on sys.path)
from harness import Bench, RoundContext, Target, argument_parser, progress, selected

import workload
from peer_sqlite import SqliteAuthority
from mwpstore.messages import Command
from mwpstore.work_keys import lease_id_for

GROUP = "g-work"
MISSION = "m-work"
THREADS = 16
SETUP_BATCH_COMMANDS = 500
CONTRACT = {
    "max_attempts": 10,
    "backoff_initial_ms": 100,
    "backoff_multiplier": 2,
    "backoff_max_ms": 10_000,
    "cost_limit": 1_000,
    "deadline_ms": None,
    "lease_ms": 3_600_000,
    "start_ms": 3_600_000,
}
MIX = ("claim", "start", "renew", "renew", "renew", "checkpoint", "claim", "start", "submit")


def load_authority() -> tuple[Any, str]:
    try:
        from mwpstore.authority import Authority
    except Exception as exc:  # ImportError, or the compiled segment log missing
        return None, f"{type(exc).__name__}: {exc}"
    return Authority, ""


def _command(actor: str, action: str, kind: str, target: str, body: dict[str, Any], revision: int | None = None) -> Command:
    return Command(actor=actor, action_id=action, group=GROUP, kind=kind, target=target, body=body,
                   expected_revision=revision)


def setup_commands(workitem_count: int) -> list[Command]:
    commands = [workload.group_create(GROUP)]
    commands += [
        _command(workload.OWNER, f"add-w{index}", "membership.add", f"w{index}", {"role": "worker"}, 0)
        for index in range(THREADS)
    ]
    commands.append(_command(workload.OWNER, "mission", "mission.create", MISSION,
                             {"title": "work", "cost_limit": 1_000_000, "approval_required": []}))
    commands += [
        _command(workload.OWNER, f"create-wi{index}", "workitem.create", f"wi{index}",
                 {"mission": MISSION, "priority": 0, "contract": CONTRACT})
        for index in range(workitem_count)
    ]
    return commands


def mix_commands(agent: str, workitem: str) -> list[Command]:
    """The 9 Commands of one WorkItem's mix; revisions and lease ids are known in advance."""
    commands = []
    revision = 1  # after workitem.create
    epoch = 0
    for step, name in enumerate(MIX):
        action = f"{workitem}-{step}"
        if name == "claim":
            epoch += 1
            commands.append(_command(agent, action, "workitem.claim", workitem, {"session_epoch": 1}, revision))
        else:
            fence = {"lease_id": lease_id_for(GROUP, workitem, epoch), "ownership_epoch": epoch}
            if name == "start":
                commands.append(_command(agent, action, "workitem.start", workitem, fence))
            elif name == "renew":
                commands.append(_command(agent, action, "lease.renew", workitem, fence, revision))
            elif name == "checkpoint":
                commands.append(_command(agent, action, "workitem.checkpoint", workitem, {**fence, "checkpoint": {"step": step}}))
            else:
                commands.append(_command(agent, action, "workitem.submit", workitem, {**fence, "submission": {"ok": True}}))
        revision += 1
    return commands


def work_mix(open_store: Callable[[Path], Any], workitem_count: int) -> Callable[[RoundContext], int]:
    def run(ctx: RoundContext) -> int:
        store = open_store(ctx.dir / "store")
        try:
            for batch in workload.batches(setup_commands(workitem_count), SETUP_BATCH_COMMANDS):
                results = store.accept_many(batch)
                failed = [result for result in results if not result.ok]
                if failed:
                    raise RuntimeError(f"setup rejected: {failed[0].error_code} {failed[0].message}")
            per_thread: list[list[Command]] = [[] for _ in range(THREADS)]
            for index in range(workitem_count):
                slot = index % THREADS
                per_thread[slot] += mix_commands(f"w{slot}", f"wi{index}")
            start = threading.Barrier(THREADS + 1)
            errors: list[BaseException] = []

            def worker(commands: list[Command]) -> None:
                try:
                    if hasattr(store, "_connection"):
                        store._connection()  # the SQLite peer's per-thread connection, opened untimed
                    start.wait()
                    for command in commands:
                        receipt = store.accept(command)
                        if not receipt.authoritative:
                            raise AssertionError(f"{command.kind} {command.target} was kept as Evidence")
                except BaseException as exc:  # reported after the join
                    errors.append(exc)
                    start.abort()

            threads = [threading.Thread(target=worker, args=(commands,)) for commands in per_thread]
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
            store.close()
        return workitem_count * len(MIX)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--subjects", default="mwpstore,sqlite_rules", help="comma-separated subjects to run")
    args = parser.parse_args(argv)
    wanted = set(args.subjects.split(","))
    workitem_count = 160 if args.quick else 800
    bench = Bench("work_model", quick=args.quick, rounds=args.rounds)
    authority_class, missing = load_authority()
    if authority_class is None:
        progress(f"mwpstore.Authority is not available here ({missing}): peers only")
    bench.facts["workitems"] = workitem_count
    bench.facts["mix"] = list(MIX)
    bench.facts["threads"] = THREADS

    if selected(args, "work_mix_threads"):
        subjects: dict[str, Any] = {}
        if "mwpstore" in wanted:
            subjects["mwpstore"] = (
                work_mix(lambda path: authority_class.open(path, sync=True), workitem_count) if authority_class else None
            )
        if "sqlite_rules" in wanted:
            subjects["sqlite_rules"] = work_mix(
                lambda path: SqliteAuthority.open(path, sync=True, rules=True), workitem_count
            )
        bench.row(
            "work_mix_threads",
            f"work-model mix (claim, start, renew ×3, checkpoint, claim, start, submit), {THREADS} threads, group commit",
            unit="transitions/s",
            size={"workitems": workitem_count, "transitions": workitem_count * len(MIX)},
            target=Target("≥ 40k transitions/s", value_min=40_000),
        ).compare(subjects)

    bench.finish(keep_data=args.keep_data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
