"""Child process for kill -9 tests: 8+ threads accept Commands and print each receipt.

Usage: python authority_child.py PATH RUN_ID THREADS

A line ``OK <action_id> <seq> <kind> <target> <expected_revision>`` is printed (and flushed) only
after ``accept`` returned, so every printed line is an acknowledged result the parent can demand.
"""

from __future__ import annotations

import random
import sys
import threading

from authority_helpers import GROUP, group_create, mission_create, mission_update
from mwpstore import Authority, MwpError

path, run_id, thread_count = sys.argv[1], sys.argv[2], int(sys.argv[3])
authority = Authority.open(path)
try:
    authority.accept(group_create())
except MwpError:
    pass
print_lock = threading.Lock()


def work(thread_index: int) -> None:
    rng = random.Random(f"{run_id}-{thread_index}")
    counter = 0
    while True:
        counter += 1
        action = f"{run_id}-{thread_index}-{counter}"
        mission = f"m-{thread_index}-{rng.randrange(4)}"
        try:
            if rng.random() < 0.5:
                command = mission_create(f"{mission}-{run_id}-{counter}", action_id=action)
            else:
                revision, state = authority.state(GROUP, f"mission:{mission}")
                if state is None:
                    command = mission_create(mission, action_id=action)
                else:
                    command = mission_update(mission, revision, f"title {action}", action_id=action)
            if rng.random() < 0.2:
                results = authority.accept_many([command, mission_create(f"{mission}-b-{action}", action_id=action + "-b")])
                receipts = [result.receipt for result in results if result.ok]
            else:
                receipts = [authority.accept(command)]
        except MwpError:
            continue
        with print_lock:
            for receipt in receipts:
                print(f"OK {receipt.action_id} {receipt.seq} {receipt.event_id}", flush=True)


threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(thread_count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
