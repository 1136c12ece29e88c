"""Child process for the read-only segment log tests: a writer that appends while a test reads.

Usage: python segment_writer_child.py DIRECTORY SEGMENT_BYTES RECORDS

Opens the log in DIRECTORY with SEGMENT_BYTES segments (64 KiB rolls over and seals every few
dozen groups), prints ``READY``, then appends groups of 1 to 4 records until RECORDS records are
written or a line arrives on standard input; closes the log, prints ``DONE <records written>``
and exits at the next line on standard input. Record
``i`` is ``record_bytes(i)``, so a reader can check every record it is served.
"""

from __future__ import annotations

import random
import select
import sys


def record_bytes(index: int) -> bytes:
    """Record ``index``: its number, then a filler whose byte and length (up to 12 KB, so that a
    group of four often fills most of a 64 KiB segment) follow from it."""
    return b"%d:" % index + bytes([index % 251]) * (index * 7919 % 12000)


def main() -> None:
    from mwpstore.segment_log import SegmentLog

    directory, segment_bytes, records = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(records)
    written = 0
    with SegmentLog.open(directory, segment_bytes=segment_bytes) as log:
        print("READY", flush=True)
        while written < records and not select.select([sys.stdin], [], [], 0)[0]:
            count = min(rng.randint(1, 4), records - written)
            log.append([record_bytes(index) for index in range(written, written + count)])
            written += count
    print(f"DONE {written}", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
