"""Child process for the read-only tests: the writer that holds a store open meanwhile.

Usage: python readonly_child.py PATH [SEGMENT_BYTES]

Opens the store (with small segments, a few dozen Commands roll the log over), creates the Group and
prints ``READY <head>``. Then one instruction per line on standard input, each answered with
``DONE <head>`` once it is durable: ``accept N`` (N missions), ``stream N`` (N rounds without a
pause: a mission accepted alone, then three in one commit, across the Group and ``g-2``),
``compact``; ``quit`` closes the store and exits.
"""

from __future__ import annotations

import sys

import msgspec

from authority_helpers import GROUP, group_create, mission_create
from mwpstore import Authority, limits

segment_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else limits.SEGMENT_BYTES_DEFAULT
authority = Authority.open(sys.argv[1], segment_bytes=segment_bytes)
authority.accept(group_create())
print(f"READY {authority.head(GROUP)[0]}", flush=True)
OTHER = "g-2"
counter = 0


def mission(group: str = GROUP) -> msgspec.Struct:
    """About 1 KB: 64 KiB segments roll over every 50 or so."""
    global counter
    counter += 1
    command = mission_create(f"m-{counter}", group=group, action_id=f"child-{counter}")
    return msgspec.structs.replace(command, body={**command.body, "title": "x" * 1000})


for line in sys.stdin:
    words = line.split()
    if words[0] == "accept":
        for _ in range(int(words[1])):
            authority.accept(mission())
    elif words[0] == "stream":
        authority.accept(group_create(OTHER))  # a replay of the first on a later stream
        for _ in range(int(words[1])):
            authority.accept(mission())
            results = authority.accept_many([mission(OTHER), mission(), mission(OTHER)])
            assert all(result.ok for result in results), results
    elif words[0] == "compact":
        authority.compact()
    elif words[0] == "quit":
        break
    print(f"DONE {authority.head(GROUP)[0]}", flush=True)
authority.close()
