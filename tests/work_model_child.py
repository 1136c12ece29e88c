"""Child process for the work-model kill -9 test: a mixed work-model load from several threads.

Usage: python work_model_child.py PATH RUN_ID THREADS

Thread 0 is the owner (creates WorkItems, reassigns, resolves) and runs the lease sweep; the other
threads are workers ``w1..wN`` that claim, start, renew, charge, publish, checkpoint, block,
submit, fail, replace their sessions and send late results under leases they held before (which
become Evidence). The clock is the real one, with short leases, so leases lapse and get taken over.

A line ``OK <action_id> <seq> <event_id>`` is printed (and flushed) only after ``accept`` returned,
the format ``tests/test_authority_crash.py`` parses.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

from authority_helpers import GROUP, OWNER, group_create
from mwpstore import Authority, Command, MwpError

CONTRACT = {
    "max_attempts": 6,
    "backoff_initial_ms": 5,
    "backoff_multiplier": 2,
    "backoff_max_ms": 50,
    "cost_limit": 40,
    "deadline_ms": None,
    "lease_ms": 120,
    "start_ms": 40,
}
MISSION = "m-load"
MISSION_COST_LIMIT = 10**9

path, run_id, thread_count = sys.argv[1], sys.argv[2], int(sys.argv[3])
authority = Authority.open(path)
print_lock = threading.Lock()


def report(receipts: list[Any]) -> None:
    with print_lock:
        for receipt in receipts:
            print(f"OK {receipt.action_id} {receipt.seq} {receipt.event_id}", flush=True)


def accept(command: Command) -> None:
    try:
        receipt = authority.accept(command)
    except MwpError:
        return
    report([receipt])


def command(actor: str, action: str, kind: str, target: str, body: dict[str, Any], revision: int | None = None) -> Command:
    return Command(actor=actor, action_id=action, group=GROUP, kind=kind, target=target, body=body,
                   expected_revision=revision)


def setup() -> None:
    """Idempotent: the same action ids and content return the original receipts on a later run."""
    accept(group_create())
    for index in range(1, thread_count):
        accept(command(OWNER, f"add-w{index}", "membership.add", f"w{index}", {"role": "worker"}, 0))
    accept(command(OWNER, "mission-load", "mission.create", MISSION,
                   {"title": "load", "cost_limit": MISSION_COST_LIMIT, "approval_required": []}))


def workitems() -> list[tuple[str, int, dict[str, Any]]]:
    return [
        (key.partition(":")[2], revision, state)
        for key, revision, state in authority.aggregates(GROUP, prefix="workitem:")
        if state is not None
    ]


def owner_loop() -> None:
    rng = random.Random(f"{run_id}-owner")
    counter = 0
    while True:
        counter += 1
        action = f"{run_id}-o-{counter}"
        items = workitems()
        open_items = [item for item in items if item[2]["state"] in ("queued", "leased")]
        choice = rng.random()
        if len(open_items) < 12:
            body = {"mission": MISSION, "priority": rng.randrange(5), "contract": CONTRACT}
            accept(command(OWNER, action, "workitem.create", f"wi-{run_id}-{counter}", body))
        elif choice < 0.3:
            try:
                report(authority.expire_leases(GROUP))
            except MwpError:
                pass
        elif choice < 0.5:
            blocked = [item for item in items if item[2]["state"] == "blocked"]
            if blocked:
                accept(command(OWNER, action, "workitem.resolve", rng.choice(blocked)[0], {}))
        elif choice < 0.55:
            leased = [item for item in items if item[2]["state"] == "leased"]
            if leased:
                accept(command(OWNER, action, "workitem.reassign", rng.choice(leased)[0], {}))


def lease_body(lease: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"], **extra}


def worker_loop(index: int) -> None:
    agent = f"w{index}"
    rng = random.Random(f"{run_id}-{agent}")
    held: list[tuple[str, dict[str, Any]]] = []  # leases this worker was granted, for late results
    counter = 0
    while True:
        counter += 1
        action = f"{run_id}-{agent}-{counter}"
        _, member = authority.state(GROUP, f"member:{agent}")
        if member is None:
            continue
        mine = [item for item in workitems() if item[2]["lease"] and item[2]["lease"]["agent"] == agent]
        choice = rng.random()
        if choice < 0.02:
            accept(command(agent, action, "session.replace", agent, {"session_epoch": member["session_epoch"]}))
        elif choice < 0.1 and held:
            workitem, lease = rng.choice(held)
            accept(command(agent, action, "workitem.submit", workitem, lease_body(lease, submission={"late": action})))
        elif mine and choice < 0.75:
            workitem, revision, state = rng.choice(mine)
            lease = state["lease"]
            step = rng.random()
            if not lease["started"]:
                accept(command(agent, action, "workitem.start", workitem, lease_body(lease)))
            elif step < 0.25:
                accept(command(agent, action, "lease.renew", workitem, lease_body(lease), revision))
            elif step < 0.5:
                accept(command(agent, action, "workitem.charge", workitem,
                               lease_body(lease, cost=rng.randrange(12), progress={"at": action})))
            elif step < 0.6:
                accept(command(agent, action, "workitem.publish", workitem, lease_body(lease, publication=action)))
            elif step < 0.72:
                accept(command(agent, action, "workitem.checkpoint", workitem, lease_body(lease, checkpoint=action)))
            elif step < 0.78:
                accept(command(agent, action, "workitem.block", workitem,
                               lease_body(lease, checkpoint=action, required_resolution="input")))
            elif step < 0.9:
                accept(command(agent, action, "workitem.submit", workitem, lease_body(lease, submission=action)))
            else:
                accept(command(agent, action, "workitem.fail", workitem, lease_body(lease, reason="flaky")))
        else:
            claimable = [item for item in workitems() if item[2]["state"] in ("queued", "leased")]
            if claimable:
                workitem, revision, _ = rng.choice(claimable)
                accept(command(agent, action, "workitem.claim", workitem, {"session_epoch": member["session_epoch"]},
                               revision))
                _, claimed = authority.state(GROUP, f"workitem:{workitem}")
                if claimed is not None and claimed["lease"] and claimed["lease"]["agent"] == agent:
                    held.append((workitem, claimed["lease"]))
                    del held[:-8]


setup()
threads = [threading.Thread(target=owner_loop, daemon=True)]
threads += [threading.Thread(target=worker_loop, args=(index,), daemon=True) for index in range(1, thread_count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
