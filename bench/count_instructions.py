"""Instructions per operation on the hot paths, counted by callgrind: the same paths, counted the
same way, every time.

On a shared 2-core machine wall-clock rates cannot tell two builds apart; instruction counts can.
Run from the checkout (about 6 minutes per repeat with every path)::

    python bench/count_instructions.py                      # every path once
    python bench/count_instructions.py --repeat 3 --json counts.json
    python bench/count_instructions.py --only accept --only read
    python bench/count_instructions.py --no-valgrind        # each driver once, tiny sizes, no counts

How a path is counted: its store is prepared outside valgrind (not counted), copied afresh for
each run, then a driver process opens it, builds the same inputs for both runs, does ``warmup``
untimed operations and then ``short`` or ``long`` measured ones, all under ``valgrind
--tool=callgrind`` with ``PYTHONHASHSEED=0`` and collection on from the start. The figure is
(instructions of the long run − of the short run) / (long − short): the interpreter's start, the
imports, the open, the inputs and the warm-up are the same in both runs and cancel. Callgrind's
total is read from the ``summary:`` line of its output file.

Paths (``sync=False``, LMDB maps of 1 GiB: the default map fails under valgrind):

- ``accept``: ``mission.create``, one ``accept`` per commit (per Command);
- ``accept_many_8``, ``accept_many_100``: ``accept_many`` of 8 and of 100 (per Command);
- ``accept_duplicate``: ``accept`` of Commands already accepted: receipt replays (per Command);
- ``read``: ``read`` in pages of 1,000 of a populated Group (per decoded Event);
- ``redo``: the open of a store whose index lags its log (per record redone);
- ``agent_apply``, ``agent_apply_trusted``: AgentStore ``apply_many`` of 1,000 Events per commit
  with ``advance_cursor``, full validation and ``verify="trusted"`` (per Event);
- ``work_mix``: the work-model mix of ``bench_work_model.py`` through ``accept``, one thread
  (per transition).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the checkout on sys.path first)

import bench_agent_store
import bench_work_model
import workload

GROUP = "g-count"
MAP_BYTES = 1024 * 1024 * 1024
PAGE_EVENTS = 1000
AGENT_BATCH = bench_agent_store.BATCH_EVENTS


def _authority(path: Path) -> Any:
    from mwpstore.authority import Authority

    return Authority.open(path, sync=False, map_size=MAP_BYTES)


def _populate(path: Path, count: int, *, behind: Path | None = None) -> None:
    """A store holding ``group.create`` and ``count`` ``mission.create`` Events. With ``behind``,
    the index as it was after the ``group.create`` is kept there (for a redo)."""
    store = _authority(path)
    store.accept(workload.group_create(GROUP))
    if behind is not None:
        store.close()
        shutil.copytree(path / "index", behind)
        store = _authority(path)
    for commands in workload.batches(workload.mission_creates(GROUP, count), 1000):
        if not all(result.ok for result in store.accept_many(commands)):
            raise AssertionError("populating: a Command was rejected")
    store.close()


# -- Paths: prepare (not counted) and drive (counted) --------------------------------------------
#
# ``prepare(dir, total, ops)`` writes what the driver starts from; ``total`` is the largest
# warm-up + operations of the run, ``ops`` this run's. ``drive(dir, total, warmup, ops)`` does the
# work and returns facts the checks (and the test) read.


def prepare_group(directory: Path, total: int, ops: int) -> None:
    store = _authority(directory / "store")
    store.accept(workload.group_create(GROUP))
    store.close()


def drive_accept(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
    store = _authority(directory / "store")
    commands = workload.mission_creates(GROUP, total)
    for command in commands[: warmup + ops]:
        store.accept(command)
    head = store.head(GROUP)[0]
    store.close()
    return {"events": head - 1, "expected": warmup + ops}


def drive_accept_many(batch: int) -> Callable[[Path, int, int, int], dict[str, Any]]:
    def drive(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
        store = _authority(directory / "store")
        commands = workload.mission_creates(GROUP, total)
        for part in workload.batches(commands[: warmup + ops], batch):
            if not all(result.ok for result in store.accept_many(part)):
                raise AssertionError("accept_many rejected a Command")
        head = store.head(GROUP)[0]
        store.close()
        return {"events": head - 1, "expected": warmup + ops}

    return drive


def prepare_populated(directory: Path, total: int, ops: int) -> None:
    _populate(directory / "store", total)


def drive_duplicate(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
    store = _authority(directory / "store")
    commands = workload.mission_creates(GROUP, total)
    head = store.head(GROUP)[0]
    replays = 0
    for command in commands[: warmup + ops]:
        replays += store.accept(command).seq <= head
    after = store.head(GROUP)[0]
    store.close()
    return {"replays": replays, "expected": warmup + ops, "appended": after - head}


def drive_read(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
    """Reads ``warmup`` Events from the start, then ``ops`` more (pages of 1,000)."""
    store = _authority(directory / "store")
    after = 0
    read = 0
    while read < warmup + ops:
        events = store.read(GROUP, after=after, limit=min(PAGE_EVENTS, warmup + ops - read))
        if not events:
            break
        read += len(events)
        after = events[-1].seq
    store.close()
    return {"events": read, "expected": warmup + ops}


def prepare_redo(directory: Path, total: int, ops: int) -> None:
    """A store whose index lags its log by ``ops`` records (the index of after its first Event)."""
    path = directory / "store"
    _populate(path, ops, behind=directory / "behind")
    shutil.rmtree(path / "index")
    shutil.copytree(directory / "behind", path / "index")


def drive_redo(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
    store = _authority(directory / "store")
    report = store.open_report
    store.close()
    return {"mode": report.mode, "redo_records": report.redo_records, "expected": ops}


def prepare_agent(directory: Path, total: int, ops: int) -> None:
    events = bench_agent_store.make_events(total)
    (directory / "events.pickle").write_bytes(pickle.dumps(events))


def drive_agent(verify: str) -> Callable[[Path, int, int, int], dict[str, Any]]:
    def drive(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
        from mwpstore.agent_store import AgentStore

        events = pickle.loads((directory / "events.pickle").read_bytes())
        agent = AgentStore.open(directory / "agent", map_size=MAP_BYTES, verify=verify)
        for start in range(0, warmup + ops, AGENT_BATCH):
            with agent.begin() as tx:
                tx.apply_many(events[start : min(start + AGENT_BATCH, warmup + ops)])
                tx.advance_cursor(bench_agent_store.GROUP)
        cursor = agent.cursor(bench_agent_store.GROUP)
        agent.close()
        return {"events": cursor, "expected": warmup + ops}

    return drive


def prepare_work(directory: Path, total: int, ops: int) -> None:
    from mwpstore.authority import Authority

    store = Authority.open(directory / "store", sync=False, map_size=MAP_BYTES)
    for batch in workload.batches(bench_work_model.setup_commands(total), bench_work_model.SETUP_BATCH_COMMANDS):
        if not all(result.ok for result in store.accept_many(batch)):
            raise AssertionError("work-model setup rejected a Command")
    store.close()


def drive_work(directory: Path, total: int, warmup: int, ops: int) -> dict[str, Any]:
    """``warmup`` + ``ops`` WorkItems through the 9 transitions of the mix, one ``accept`` each."""
    from mwpstore.authority import Authority

    store = Authority.open(directory / "store", sync=False, map_size=MAP_BYTES)
    threads = bench_work_model.THREADS
    commands = [
        bench_work_model.mix_commands(f"w{index % threads}", f"wi{index}") for index in range(total)
    ]
    head = store.head(bench_work_model.GROUP)[0]
    for mix in commands[: warmup + ops]:
        for command in mix:
            if not store.accept(command).authoritative:
                raise AssertionError(f"{command.kind} {command.target} was kept as Evidence")
    appended = store.head(bench_work_model.GROUP)[0] - head
    store.close()
    return {"events": appended, "expected": (warmup + ops) * len(bench_work_model.MIX)}


@dataclass(frozen=True)
class Counted:
    name: str
    unit: str  # what one operation of the figure is
    prepare: Callable[[Path, int, int], None]
    drive: Callable[[Path, int, int, int], dict[str, Any]]
    warmup: int
    short: int
    long: int
    tiny: int  # operations of a --no-valgrind run (warm-up 0)
    per: int = 1  # units per operation (transitions per WorkItem)


PATHS = [
    Counted("accept", "Command", prepare_group, drive_accept, 200, 500, 2500, 20),
    Counted("accept_many_8", "Command", prepare_group, drive_accept_many(8), 200, 400, 2000, 24),
    Counted("accept_many_100", "Command", prepare_group, drive_accept_many(100), 500, 1000, 5000, 200),
    Counted("accept_duplicate", "Command", prepare_populated, drive_duplicate, 200, 500, 2500, 20),
    Counted("read", "Event", prepare_populated, drive_read, 1000, 2000, 10000, 1500),
    Counted("redo", "record", prepare_redo, drive_redo, 0, 2000, 10000, 50),
    Counted("agent_apply", "Event", prepare_agent, drive_agent("full"), 1000, 1000, 5000, 1500),
    Counted("agent_apply_trusted", "Event", prepare_agent, drive_agent("trusted"), 1000, 1000, 5000, 1500),
    Counted("work_mix", "transition", prepare_work, drive_work, 10, 50, 250, 3, per=len(bench_work_model.MIX)),
]
BY_NAME = {path.name: path for path in PATHS}


def check(path: Counted, facts: dict[str, Any]) -> None:
    """The driver did the operations it claims: the Events exist, the replays were replays."""
    if path.name == "redo":
        ok = facts["mode"] == "redo" and facts["redo_records"] == facts["expected"]
    elif path.name == "accept_duplicate":
        ok = facts["replays"] == facts["expected"] and facts["appended"] == 0
    else:
        ok = facts["events"] == facts["expected"]
    if not ok:
        raise SystemExit(f"{path.name}: the driver did not do what it claims: {facts}")


# -- Running -------------------------------------------------------------------------------------


def run_driver(path: Counted, directory: Path, total: int, warmup: int, ops: int, *, valgrind: bool) -> tuple[int | None, dict[str, Any]]:
    """One driver process on a fresh copy of the prepared directory: (instructions, facts)."""
    command = [sys.executable, os.path.abspath(__file__), "--driver", path.name, "--dir", str(directory),
               "--total", str(total), "--warmup", str(warmup), "--ops", str(ops)]
    out_file = directory / "callgrind.out"
    if valgrind:
        command = ["valgrind", "--tool=callgrind", "--collect-atstart=yes", f"--callgrind-out-file={out_file}"] + command
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{path.name}: the driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    check(path, facts)
    if not valgrind:
        return None, facts
    for line in out_file.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]), facts
    raise SystemExit(f"{path.name}: no summary line in callgrind's output")


def prepared(path: Counted, root: Path, total: int, ops: int) -> Path:
    directory = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=root))
    path.prepare(directory, total, ops)
    return directory


def fresh_copy(source: Path, root: Path) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    shutil.rmtree(directory)
    shutil.copytree(source, directory)
    return directory


def count(path: Counted, root: Path) -> float:
    """Instructions per unit: the difference of the long and the short run."""
    total = path.warmup + path.long
    results = []
    sources = {}
    for ops in (path.short, path.long):
        # Redo's store depends on the run's length; every other path starts from one store.
        key = ops if path.name == "redo" else 0
        if key not in sources:
            sources[key] = prepared(path, root, total, ops)
        directory = fresh_copy(sources[key], root)
        instructions, _ = run_driver(path, directory, total, path.warmup, ops, valgrind=True)
        shutil.rmtree(directory)
        results.append(instructions)
    for source in sources.values():
        shutil.rmtree(source)
    return (results[1] - results[0]) / ((path.long - path.short) * path.per)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], choices=sorted(BY_NAME), help="count only this path (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="count each path K times; report the median and the spread")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--no-valgrind", action="store_true", help="run each driver once at a tiny size, without valgrind, and check it")
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ops", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.driver:  # the process callgrind counts
        facts = BY_NAME[args.driver].drive(args.dir, args.total, args.warmup, args.ops)
        print(json.dumps(facts))
        return 0

    paths = [BY_NAME[name] for name in args.only] if args.only else PATHS
    if not args.no_valgrind and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind); --no-valgrind runs the drivers without counting")
    result: dict[str, Any] = {"mode": "no-valgrind" if args.no_valgrind else "callgrind", "paths": {}}
    root = Path(tempfile.mkdtemp(prefix="mwpstore-counts-"))
    try:
        for path in paths:
            if args.no_valgrind:
                directory = prepared(path, root, path.tiny, path.tiny)
                _, facts = run_driver(path, directory, path.tiny, 0, path.tiny, valgrind=False)
                result["paths"][path.name] = {"ops": path.tiny, "facts": facts}
                print(f"{path.name}: {path.tiny} ops, checked {facts}")
                continue
            counts = []
            for _ in range(args.repeat):
                counts.append(count(path, root))
                harness.progress(f"{path.name}: {counts[-1]:,.0f} instructions per {path.unit}")
            result["paths"][path.name] = {
                "unit": path.unit,
                "median": statistics.median(counts),
                "min": min(counts),
                "max": max(counts),
                "counts": counts,
                "sizes": {"warmup": path.warmup, "short": path.short, "long": path.long},
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    if not args.no_valgrind:
        print(f"| path | instructions per operation (median of {args.repeat}) | min … max |")
        print("|---|---:|---:|")
        for name, row in result["paths"].items():
            print(f"| {name} | {row['median'] / 1000:.1f}k per {row['unit']} | {row['min'] / 1000:.1f}k … {row['max'] / 1000:.1f}k |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
