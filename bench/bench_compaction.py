"""Compaction rate (MB/s of log rewritten) against the raw copy rate of the same segment files.

Reproduce the committed results (``bench/results/compaction.json``) with::

    python bench/bench_compaction.py            # 100k Events, 5 rounds
    python bench/bench_compaction.py --quick    # 20k Events, 3 rounds

Each round builds a store (not timed): an active Group with redacted Events and an archived Group
whose audit log is durable; then ``Authority.compact()`` is timed (copy of every record with the
redacted payloads removed and the archived Events replaced by receipts, the switch, the index
rebuild), and compared with a plain copy + ``fsync`` of the used bytes of the same segment files:
the floor for any rewrite that must be durable. Rates are the log's used bytes (before compaction)
per second, for both subjects.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, RoundContext, argument_parser, progress  # noqa: E402

from mwpstore import Authority, Command  # noqa: E402


def build_store(path: str, events: int) -> list[tuple[str, int]]:
    """A store with two Groups of ``events`` // 2 Events each; returns (segment file, used bytes)."""
    with Authority.open(path, sync=False) as authority:
        for group in ("active", "archived"):
            authority.accept(Command(actor="owner", action_id=f"create-{group}", group=group, kind="group.create", target=group, body={"org": "acme"}))
            half = events // 2
            for start in range(0, half, 1000):
                commands = [
                    Command(actor="owner", action_id=f"{group}-{i}", group=group, kind="mission.create", target=f"m-{i}", body={"title": f"mission {i} " + "x" * 64, "cost_limit": 10})
                    for i in range(start, min(half, start + 1000))
                ]
                authority.accept_many(commands)
        for seq in range(2, events // 2, 50):
            authority.redact("active", seq, actor="owner", action_id=f"redact-{seq}", reason="bench")
        authority.archive("archived", actor="owner", action_id="archive", reason="bench")
        authority.sync()
        return [(segment.path, segment.used_bytes) for segment in authority.log.segments()]


def main() -> None:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=None, help="Events in the store (default 100k, quick 20k)")
    args = parser.parse_args()
    events = args.events or (20_000 if args.quick else 100_000)
    bench = Bench("compaction", quick=args.quick, rounds=args.rounds or (3 if args.quick else 5))

    def compact(ctx: RoundContext) -> float:
        path = str(ctx.dir / "store")
        progress(f"building a store of {events} Events")
        size = sum(used for _, used in build_store(path, events))
        with Authority.open(path) as authority:
            with ctx.timed():
                report = authority.compact()
        ctx.extra.update(payloads_removed=report.payloads_removed, events_dropped=report.events_dropped, bytes_before=report.bytes_before, bytes_after=report.bytes_after)
        return size / 1e6

    def raw_copy(ctx: RoundContext) -> float:
        path = str(ctx.dir / "store")
        segments = build_store(path, events)
        target = os.path.join(path, "copy")
        os.makedirs(target)
        with ctx.timed():
            for source, used in segments:
                with open(source, "rb") as reader, open(os.path.join(target, os.path.basename(source)), "wb") as writer:
                    writer.write(reader.read(used))
                    writer.flush()
                    os.fsync(writer.fileno())
        return sum(used for _, used in segments) / 1e6

    row = bench.row(
        "compaction_rate",
        "compaction rate against a raw copy (+ fsync) of the same segment files",
        unit="MB/s",
        target=None,
        size={"events": events},
    )
    row.compare({"mwpstore": compact, "raw_copy": raw_copy})
    bench.finish()


if __name__ == "__main__":
    main()
