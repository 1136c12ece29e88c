"""Benchmark of the C segment log against plain Python logs, measured side by side in one run.

    python bench/bench_segment_log.py            # full sizes; writes bench/results/segment_log.json
    python bench/bench_segment_log.py --quick    # small sizes, 3 rounds (a quick look; CI runs no benchmarks)

Rows (issue 2 targets):

- ``durable_single``: one 256-byte record per durable commit, against a plain ``os.write`` +
  ``os.fdatasync`` loop on a growing file (target ≥ 1.3×: the log's segments are preallocated, so
  its fdatasync has no size metadata to flush).
- ``group_100``: 100 msgpack-encoded records per commit, against a plain Python framed log
  (length + CRC-32C + msgpack via msgspec, one write and one fdatasync per 100 records;
  target ≥ 2×). A third subject, ``io_floor``, writes the same encoded bytes unframed into a file
  zero-filled and synced before timing: what the disk allows for these bytes at best.
- ``scan_views``: records per second scanned as raw record views (target ≥ 5M/s).
- ``scan_memory``: growth of the resident set while scanning 10M records (1M with --quick),
  measured in a child process (target: bounded, ≤ 64 MiB over the baseline).

The two commit rows alternate the subjects commit by commit and time each commit (see
``paired``), so bursts of disk latency from neighbours on a shared machine hit all alike; the
scan rows run on a fixture built once (not timed). The committed ``bench/results/segment_log.json``
comes from the first command above.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import Bench, RoundContext, Target, argument_parser, progress, reset_peak_rss, rss_mib, selected

import msgspec

from mwpstore.segment_log import SegmentLog

RECORD_BYTES = 256
SCAN_RECORD_BYTES = 100
RSS_GROWTH_MAX_MIB = 64

try:  # a C CRC-32C for the Python peer, so the comparison is not against a slow pure-Python CRC
    from crc32c import crc32c as _peer_crc32c

    PEER_CRC = "crc32c package (hardware CRC-32C)"
except ImportError:  # pragma: no cover - depends on the environment
    import zlib

    _peer_crc32c = zlib.crc32
    PEER_CRC = "zlib.crc32 (the crc32c package is not installed; same cost class)"


def _records(count: int, size: int) -> list[bytes]:
    pool = [os.urandom(size) for _ in range(min(count, 1024))]
    return [pool[i % len(pool)] for i in range(count)]


def _events(count: int) -> list[dict]:
    # Event-like dicts whose msgpack encoding is about RECORD_BYTES long.
    filler = "x" * (RECORD_BYTES - 90)
    return [
        {"group": "g-1", "seq": i, "kind": "workitem.claim", "actor": "agent-7", "action": f"a-{i}", "body": filler}
        for i in range(count)
    ]


# -- commits: measured in pairs --------------------------------------------------------------
#
# On a shared machine, fdatasync latency comes in bursts lasting seconds, longer than a round.
# So the commit rows alternate the two subjects commit by commit inside each round (the order
# swapped every step) and time each commit: both see the same bursts. A round's value is
# operations / total time spent in that subject's commits; the row reports the median round.


def single_mwpstore(directory: Path, count: int):
    records = _records(count, RECORD_BYTES)
    log = SegmentLog.open(directory / "log")  # creates and preallocates the segment: not timed
    append = log.append
    return (lambda i: append([records[i]])), log.close


def single_plain(directory: Path, count: int):
    records = _records(count, RECORD_BYTES)
    fd = os.open(directory / "plain.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    write, fdatasync = os.write, os.fdatasync

    def step(i: int) -> None:
        write(fd, records[i])
        fdatasync(fd)

    return step, lambda: os.close(fd)


def group_mwpstore(directory: Path, count: int):
    events = _events(count * 100)
    encode = msgspec.msgpack.Encoder().encode
    log = SegmentLog.open(directory / "log")

    def step(i: int) -> None:
        log.append([encode(event) for event in events[i * 100 : i * 100 + 100]])

    return step, log.close


def group_plain(directory: Path, count: int):
    events = _events(count * 100)
    encode = msgspec.msgpack.Encoder().encode
    pack, crc = struct.Struct("<II").pack, _peer_crc32c
    fd = os.open(directory / "framed.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def step(i: int) -> None:
        frames = []
        for event in events[i * 100 : i * 100 + 100]:
            payload = encode(event)
            frames.append(pack(len(payload), crc(payload)))
            frames.append(payload)
        os.write(fd, b"".join(frames))
        os.fdatasync(fd)

    return step, lambda: os.close(fd)


def group_floor(directory: Path, count: int):
    """The disk's floor for the same bytes: the 100 encoded records joined, one ``os.pwrite`` at
    the next offset and one ``os.fdatasync``, into a file whose blocks were all written (zeros)
    and synced before timing. No framing, no checksums, and the zero-filling is free here (a log
    must pay it somewhere): no log can commit these bytes faster on this file system."""
    events = _events(count * 100)
    encode = msgspec.msgpack.Encoder().encode
    fd = os.open(directory / "floor.log", os.O_WRONLY | os.O_CREAT, 0o644)
    zeros = bytes(1 << 20)
    size = (count * 100 * (RECORD_BYTES + 64) // len(zeros) + 1) * len(zeros)
    for offset in range(0, size, len(zeros)):
        os.pwrite(fd, zeros, offset)
    os.fsync(fd)
    at = [0]

    def step(i: int) -> None:
        data = b"".join([encode(event) for event in events[i * 100 : i * 100 + 100]])
        os.pwrite(fd, data, at[0])
        os.fdatasync(fd)
        at[0] += len(data)

    return step, lambda: os.close(fd)


def paired(bench: Bench, row, subjects: dict, steps: int, per_step: int) -> None:
    """Run the subjects' steps alternately (the order rotated every step), timing each; record
    ops/s per round for each."""
    names = list(subjects)
    rates: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for round_index in range(bench.rounds):
        with bench.fresh_dir(f"{row.key}-r{round_index}") as directory:
            made = {}
            for name in names:
                (directory / name).mkdir()
                made[name] = subjects[name](directory / name, steps)
            spent = dict.fromkeys(names, 0.0)
            for i in range(steps):
                shift = i % len(names)
                for name in names[shift:] + names[:shift]:
                    step = made[name][0]
                    t0 = clock()
                    step(i)
                    spent[name] += clock() - t0
            for _, close in made.values():
                close()
        for name in names:
            rates[name].append(steps * per_step / spent[name])
        progress(
            f"  {row.key} round {round_index + 1}/{bench.rounds}: "
            + ", ".join(f"{name} {harness.format_number(rates[name][-1])}" for name in names)
            + f" {row.unit}"
        )
    for name, values in rates.items():
        row.record(name, values, note="commits alternated with the other subjects', each timed")


# -- scans --------------------------------------------------------------------------------------


def build_scan_fixture(directory: Path, count: int) -> None:
    records = _records(10_000, SCAN_RECORD_BYTES)
    with SegmentLog.open(directory, sync=False) as log:
        for start in range(0, count, 10_000):
            log.append(records[: min(10_000, count - start)])


def scan_mwpstore(directory: Path, count: int):
    def run(ctx: RoundContext) -> int:
        log = SegmentLog.open(directory, readonly=True)
        seen = 0
        with ctx.timed():
            for batch in log.scan(0, batch_records=4096):
                seen += len(batch.records)
        log.close()
        assert seen == count, (seen, count)
        return seen

    return run


def scan_child(directory: str) -> None:
    """Run in a child process: the resident set before and at its peak during a full scan."""
    log = SegmentLog.open(directory, readonly=True)
    baseline, _ = rss_mib()
    reset = reset_peak_rss()
    started = time.perf_counter()
    seen = 0
    for batch in log.scan(0):
        seen += len(batch.records)
    seconds = time.perf_counter() - started
    _, peak = rss_mib()
    log.close()
    print(json.dumps({"baseline_mib": baseline, "peak_mib": peak, "records": seen, "seconds": seconds, "peak_reset": reset}))


def scan_memory(row, directory: Path, count: int, rounds: int) -> None:
    growths, details = [], []
    for round_index in range(rounds):
        out = subprocess.run(
            [sys.executable, __file__, "--scan-child", str(directory)], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["records"] == count
        growth = result["peak_mib"] - result["baseline_mib"]
        growths.append(growth)
        details.append(result)
        progress(f"  scan_memory round {round_index + 1}/{rounds}: +{growth:.1f} MiB over {result['baseline_mib']:.1f} MiB")
    row.record("mwpstore", growths, extra={"children": details})


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--scan-child":
        scan_child(sys.argv[2])
        return
    args = argument_parser("segment log against plain Python logs").parse_args()
    # Short rounds, many of them: disk latency on a shared machine comes in bursts, and the
    # median of interleaved rounds is what survives them.
    bench = Bench("segment_log", quick=args.quick, rounds=args.rounds or (3 if args.quick else 9))
    single_count = 500 if args.quick else 1500
    group_count = 20_000 if args.quick else 100_000
    scan_count = 1_000_000 if args.quick else 10_000_000
    bench.facts.update(
        {
            "record_bytes": RECORD_BYTES,
            "scan_record_bytes": SCAN_RECORD_BYTES,
            "peer_crc": PEER_CRC,
            "segment_bytes": 64 * 1024 * 1024,
            "mwpstore_durability": "one pwrite + one fdatasync per commit group, preallocated segments",
            "plain_durability": "os.write + os.fdatasync on a growing O_APPEND file",
        }
    )
    if selected(args, "durable_single"):
        row = bench.row(
            "durable_single", "durable single-record commits (256 B)", unit="commits/s",
            target=Target("≥ 1.3× plain write+fdatasync", ratio_min={"plain_fdatasync": 1.3}),
            size={"commits": single_count},
        )
        paired(bench, row, {"mwpstore": single_mwpstore, "plain_fdatasync": single_plain}, single_count, 1)
    if selected(args, "group_100"):
        row = bench.row(
            "group_100", "100 records per commit (msgpack, ≈256 B)", unit="records/s",
            target=Target("≥ 2× plain Python framed log", ratio_min={"plain_framed": 2.0}),
            size={"records": group_count},
        )
        paired(
            bench, row, {"mwpstore": group_mwpstore, "plain_framed": group_plain, "io_floor": group_floor},
            group_count // 100, 100,
        )
    if selected(args, "scan"):
        fixture = bench.fixture_dir("scan")
        progress(f"building the scan fixture: {scan_count:,} records of {SCAN_RECORD_BYTES} B")
        build_scan_fixture(fixture, scan_count)
        if selected(args, "scan_views"):
            bench.row(
                "scan_views", "scan as raw record views", unit="records/s",
                target=Target("≥ 5M records/s", value_min=5_000_000), size={"records": scan_count},
            ).measure("mwpstore", scan_mwpstore(fixture, scan_count))
        if selected(args, "scan_memory"):
            row = bench.row(
                "scan_memory", "RSS growth while scanning", unit="MiB",
                target=Target(f"bounded: ≤ {RSS_GROWTH_MAX_MIB} MiB over the baseline", value_max=RSS_GROWTH_MAX_MIB),
                size={"records": scan_count},
            )
            scan_memory(row, fixture, scan_count, bench.rounds)
    bench.finish(keep_data=args.keep_data)


if __name__ == "__main__":
    main()
