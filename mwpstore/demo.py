"""``mwpstore demo``: an end-to-end run of the engine with a report of what was checked.

A Mission with WorkItems; worker agents in threads, each with its own AgentStore fed by a
delivery from the authority, claiming (compare-and-set), starting, renewing, publishing, charging
and submitting; one agent that stops mid-lease (it never renews again), its lease lapsing, the
engine's sweep expiring it and another agent taking over from its checkpoint; the stopped agent's
late result kept as Evidence; a duplicate Command answered with its original receipt and a changed
one refused with ``ACTION_ID_COLLISION``; an approval gate; an AgentStore catching up through a
transport that duplicates, reorders, drops and disconnects; a far-behind agent restored from a
signed snapshot after ``CURSOR_TOO_OLD``; the Group archived with a final snapshot and an
encrypted audit log; ``verify`` and a reopen at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._files import store_path
from .agent_store import AgentStore
from .authority import Authority
from .delivery import Delivery, FaultyTransport
from .errors import ActionIdCollision, ApprovalRequired, InvalidCommand, MwpError, Rejection, translate
from .messages import Command, encode_receipt
from .snapshot import check_snapshot_ref

MARKER = ".mwpstore-demo"
GROUP = "demo-group"
ORG = "demo-org"
OWNER = "owner"
APPROVER = "approver"
MISSION = "mission-1"
CONTRACT = {
    "max_attempts": 3,
    "backoff_initial_ms": 50,
    "backoff_multiplier": 2,
    "backoff_max_ms": 1000,
    "cost_limit": 10,
    "lease_ms": 5000,
    "start_ms": 3000,
}
SHORT_LEASE_CONTRACT = {**CONTRACT, "lease_ms": 600, "start_ms": 600}


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        return bool(ok)

    def count(self, name: str, amount: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def next(self) -> int:
        with self._lock:
            self._value += 1
            return self._value


def _prepare_directory(directory: str) -> None:
    """Empty (or create) the demo's directory. What cannot be a demo directory is refused as bad
    input (``INVALID_COMMAND``, field ``directory``) before anything is written or deleted: a
    path that is not a directory, a directory the demo did not create (it would delete it), or a
    symbolic link (the demo deletes what it names, never what a link leads to)."""
    if os.path.islink(directory.rstrip(os.sep) or directory):  # "link/" names the link too
        raise InvalidCommand(f"{directory} is a symbolic link; give the demo directory itself", field="directory")
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise InvalidCommand(f"{directory} exists and is not a directory", field="directory")
        if os.listdir(directory) and not os.path.exists(os.path.join(directory, MARKER)):
            raise InvalidCommand(
                f"{directory} is not empty and is not a demo directory; choose another (mwpstore demo DIR)", field="directory"
            )
        try:
            shutil.rmtree(directory)
        except OSError as exc:
            raise translate(exc, context=f"emptying {directory}") from exc
    parent = os.path.dirname(os.path.abspath(directory))
    if _existing_ancestor_is_a_file(parent):
        raise InvalidCommand(f"{directory}: a part of its path is a file, not a directory", field="directory")
    try:
        os.makedirs(directory)
        with open(os.path.join(directory, MARKER), "w", encoding="utf-8") as handle:
            handle.write("created by `mwpstore demo`; deleted and recreated on every run\n")
    except OSError as exc:
        raise translate(exc, context=f"creating {directory}") from exc


def _existing_ancestor_is_a_file(path: str) -> bool:
    """Whether the nearest existing ancestor of ``path`` (itself included) is not a directory."""
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return not os.path.isdir(path)


class _Agent:
    """A worker: its own AgentStore, delivery from the authority, and the Commands it sends."""

    def __init__(self, name: str, authority: Authority, directory: str, counter: _Counter) -> None:
        self.name = name
        self.authority = authority
        self.store = AgentStore.open(os.path.join(directory, "agents", name))
        self.delivery = Delivery(self.store, authority, consumer=name)
        self.counter = counter
        self.session_epoch = 1

    def command(self, kind: str, target: str, body: dict[str, Any], expected_revision: int | None = None) -> Command:
        return Command(
            actor=self.name,
            action_id=f"{self.name}-{self.counter.next()}",
            group=GROUP,
            kind=kind,
            target=target,
            body=body,
            expected_revision=expected_revision,
        )

    def claim(self, workitem: str) -> dict[str, Any] | None:
        """Claim (compare-and-set on the revision this agent's projection has); the new lease or None."""
        revision = self.store.revision(GROUP, f"workitem:{workitem}")
        try:
            self.authority.accept(self.command("workitem.claim", workitem, {"session_epoch": self.session_epoch}, revision))
        except Rejection:
            return None
        _, state = self.authority.state(GROUP, f"workitem:{workitem}")
        assert state is not None
        return state["lease"]

    def lease_body(self, lease: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"], **extra}

    def close(self) -> None:
        self.store.close()


def _work(agent: _Agent, report: Report, lock: threading.Lock, stop: threading.Event, rng: random.Random) -> None:
    """A worker thread's body. An error ends the worker as a failed check that carries it, in the
    report (and its --json document), rather than as a traceback on standard error beside a
    report that only counts the WorkItems left over."""
    try:
        _work_until_done(agent, report, lock, stop, rng)
    except Exception as exc:
        error = translate(exc, context=agent.name)
        with lock:
            report.check(f"{agent.name} worked to the end without an error", False, f"{error.code}: {error.message}")


def _work_until_done(agent: _Agent, report: Report, lock: threading.Lock, stop: threading.Event, rng: random.Random) -> None:
    """Claim, start, renew ×3, publish, charge, submit — until no ready WorkItem is left."""
    idle_rounds = 0
    stale = True
    while not stop.is_set() and idle_rounds < 50:
        if stale:  # catch up (one durable local commit) only when the local view proved stale
            agent.delivery.catch_up(GROUP)
        queue = [entry.workitem for entry in agent.store.work_queue(GROUP, agent.authority._clock(), limit=64)]
        queue = [workitem for workitem in queue if not workitem.startswith("special")]
        if not queue:
            idle_rounds += 1
            stale = True
            time.sleep(0.02)
            continue
        idle_rounds = 0
        workitem = rng.choice(queue)
        lease = agent.claim(workitem)
        if lease is None:
            stale = True
            with lock:
                report.count("claims lost to another agent (compare-and-set)")
            continue
        stale = False
        key = f"workitem:{workitem}"
        accept = agent.authority.accept
        accept(agent.command("workitem.start", workitem, agent.lease_body(lease)))
        for _ in range(3):
            revision, _ = agent.authority.state(GROUP, key)
            accept(agent.command("lease.renew", workitem, agent.lease_body(lease), revision))
        accept(agent.command("workitem.publish", workitem, agent.lease_body(lease, publication={"partial": workitem})))
        accept(agent.command("workitem.charge", workitem, agent.lease_body(lease, cost=1, progress={"done": 100})))
        receipt = accept(agent.command("workitem.submit", workitem, agent.lease_body(lease, submission={"result": f"{workitem} by {agent.name}"})))
        with lock:
            report.count("WorkItems submitted")
            report.count(f"submitted by {agent.name}")
            if not receipt.authoritative:
                report.count("unexpected evidence")


def run_demo(directory: str, *, agents: int = 4, workitems: int = 200, json_output: bool = False) -> dict[str, Any]:
    # Out-of-range sizes are refused before anything is written (the command line's exit 2).
    for name, value, low, high in (("agents", agents, 2, 16), ("workitems", workitems, 10, 100_000)):
        if type(value) is not int or not low <= value <= high:
            raise InvalidCommand(f"{name} must be a whole number in {low}..{high} (got {value!r})", field=name)
    directory = store_path(directory)  # a path the stores would refuse is refused before the directory is made
    _prepare_directory(directory)
    report = Report()
    counter = _Counter()
    started = time.perf_counter()
    authority = Authority.open(os.path.join(directory, "authority"))
    team: list[_Agent] = []
    try:
        _scenario(authority, directory, agents, workitems, report, counter, team)
    except MwpError as exc:
        report.check("the scenario ran to its end", False, f"{exc.code}: {exc.message}")
    finally:
        for agent in team:
            agent.close()
        authority.close()
    with Authority.open(os.path.join(directory, "authority")) as reopened:
        report.check("reopen after close is clean (no redo, no rebuild)", reopened.open_report.mode == "clean", reopened.open_report.mode)
        report.counts["Events in the log"] = reopened.head(GROUP)[0]
    report.figures["total seconds"] = time.perf_counter() - started
    document = {
        "ok": report.ok,
        "directory": directory,
        "checks": [{"name": name, "ok": ok, "detail": detail} for name, ok, detail in report.checks],
        "counts": report.counts,
        "figures": report.figures,
    }
    if json_output:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        _print_report(report, directory)
    return document


def _scenario(
    authority: Authority, directory: str, agent_count: int, workitems: int, report: Report, counter: _Counter, team: list[_Agent]
) -> None:
    owner_ids = iter(range(1, 10**9))

    def owner(kind: str, target: str, body: dict[str, Any], expected_revision: int | None = None, actor: str = OWNER) -> Command:
        return Command(actor=actor, action_id=f"{actor}-{next(owner_ids)}", group=GROUP, kind=kind, target=target, body=body, expected_revision=expected_revision)

    # -- the Group, its members, the Mission and its WorkItems --------------------------------------
    authority.accept(owner("group.create", GROUP, {"org": ORG, "policy": {"replay_window_events": 100}}))
    names = [f"agent-{i}" for i in range(1, agent_count + 1)] + ["agent-crash"]
    setup = [owner("membership.add", name, {"role": "worker"}, 0) for name in names]
    setup.append(owner("membership.add", APPROVER, {"role": "approver"}, 0))
    setup.append(owner("mission.create", MISSION, {"title": "Demo mission", "cost_limit": workitems * 10 + 100}))
    setup.append(owner("mission.create", "mission-gated", {"title": "Needs approval", "cost_limit": 100, "approval_required": ["submit"]}))
    items = [owner("workitem.create", f"wi-{i:05d}", {"mission": MISSION, "priority": i % 5, "contract": CONTRACT}) for i in range(workitems)]
    items.append(owner("workitem.create", "special-1", {"mission": MISSION, "priority": 9, "contract": SHORT_LEASE_CONTRACT}))
    items.append(owner("workitem.create", "special-gated", {"mission": "mission-gated", "priority": 9, "contract": CONTRACT}))
    results = authority.accept_many(setup + items)
    report.check("setup accepted in one accept_many", all(result.ok for result in results), f"{sum(r.ok for r in results)}/{len(results)}")
    team.extend(_Agent(name, authority, directory, counter) for name in names)
    crash = team[-1]
    workers = team[:-1]
    for agent in team:
        agent.delivery.catch_up(GROUP)

    # -- an agent that stops mid-lease, and a takeover from its checkpoint (MWP-WRK-019) -----------
    lease = crash.claim("special-1")
    assert lease is not None
    authority.accept(crash.command("workitem.start", "special-1", crash.lease_body(lease)))
    authority.accept(crash.command("workitem.checkpoint", "special-1", crash.lease_body(lease, checkpoint={"step": 3, "of": 5})))
    crash.delivery.catch_up(GROUP)
    stale_lease = crash.claim("special-1")  # resumes from its own checkpoint under ownership epoch 2 ...
    assert stale_lease is not None
    authority.accept(crash.command("workitem.start", "special-1", crash.lease_body(stale_lease)))
    report.count("agents stopped mid-lease")  # ... and stops here: no renewal, no result

    # -- the workers, in threads, with group commit ---------------------------------------------------
    lock = threading.Lock()
    stop = threading.Event()
    work_started = time.perf_counter()
    head_before = authority.head(GROUP)[0]
    threads = [threading.Thread(target=_work, args=(agent, report, lock, stop, random.Random(i)), name=agent.name) for i, agent in enumerate(workers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        # Interrupted (Ctrl-C): the workers finish the WorkItem in hand and stop before the stores
        # they use are closed; closed under them, each would end in a StoreClosed traceback.
        stop.set()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join()
        raise
    seconds = time.perf_counter() - work_started
    transitions = authority.head(GROUP)[0] - head_before
    report.figures["work phase transitions per second"] = transitions / seconds if seconds else 0.0
    report.counts["work phase transitions"] = transitions
    submitted = sum(1 for _, _, state in authority.aggregates(GROUP, prefix="workitem:wi-") if state and state["state"] == "submitted")
    counted = report.counts.get("WorkItems submitted", 0)
    report.check(
        "every WorkItem was submitted exactly once",
        submitted == workitems and counted == workitems,
        f"{submitted}/{workitems} in the store, {counted} submissions counted by the workers",
    )
    report.check("no submission was demoted to Evidence by accident", report.counts.get("unexpected evidence", 0) == 0)

    # the stopped agent's lease lapses; the engine's sweep expires it; a worker takes over
    deadline = time.monotonic() + 5
    expired: list[Any] = []
    while not expired and time.monotonic() < deadline:
        time.sleep(0.1)
        expired = authority.expire_leases(GROUP)
    report.check("the lapsed lease was expired by the engine's sweep (lease.expire Event)", len(expired) == 1 and expired[0].kind == "lease.expire")
    taker = workers[0]
    taker.delivery.catch_up(GROUP)
    new_lease = taker.claim("special-1")
    _, state = authority.state(GROUP, "workitem:special-1")
    report.check(
        "a new owner claimed under a higher ownership epoch and resumed from the checkpoint",
        new_lease is not None and state is not None and new_lease["ownership_epoch"] == 3 and state["checkpoint"] == {"step": 3, "of": 5},
        f"epoch {None if new_lease is None else new_lease['ownership_epoch']}",
    )
    assert new_lease is not None
    authority.accept(taker.command("workitem.start", "special-1", taker.lease_body(new_lease)))
    authority.accept(taker.command("workitem.submit", "special-1", taker.lease_body(new_lease, submission={"result": "finished from the checkpoint"})))
    late = authority.accept(crash.command("workitem.submit", "special-1", crash.lease_body(stale_lease, submission={"result": "late"})))
    _, state = authority.state(GROUP, "workitem:special-1")
    report.check(
        "the stopped agent's late result was kept as non-authoritative Evidence",
        not late.authoritative and state is not None and state["submission"]["agent"] == taker.name,
        f"receipt authoritative={late.authoritative}",
    )
    report.count("Evidence Events", 1 if not late.authoritative else 0)

    # -- the approval gate ----------------------------------------------------------------------------
    gated = taker.claim("special-gated")
    assert gated is not None
    authority.accept(taker.command("workitem.start", "special-gated", taker.lease_body(gated)))
    try:
        authority.accept(taker.command("workitem.submit", "special-gated", taker.lease_body(gated, submission={"result": "x"})))
        refused = False
    except ApprovalRequired:
        refused = True
    authority.accept(taker.command("approval.request", "approval-1", {"workitem": "special-gated", "operation": "submit"}))
    authority.accept(owner("approval.decide", "approval-1", {"decision": "approved"}, 1, actor=APPROVER))
    receipt = authority.accept(taker.command("workitem.submit", "special-gated", taker.lease_body(gated, submission={"result": "approved"}, approval="approval-1")))
    report.check("a gated submission needed an approved Approval (APPROVAL_REQUIRED, then accepted)", refused and receipt.authoritative)

    # -- idempotency (MWP-EVT-003) ---------------------------------------------------------------------
    command = owner("mission.create", "mission-idem", {"title": "once", "cost_limit": 1})
    first = authority.accept(command)
    head = authority.head(GROUP)[0]
    again = authority.accept(command)
    report.check("a duplicate Command returned its original receipt byte for byte and appended nothing", encode_receipt(first) == encode_receipt(again) and authority.head(GROUP)[0] == head)
    try:
        authority.accept(Command(actor=command.actor, action_id=command.action_id, group=GROUP, kind="mission.create", target="mission-idem", body={"title": "changed", "cost_limit": 1}))
        collided = False
    except ActionIdCollision:
        collided = True
    report.check("a changed Command under the same Action ID was refused with ACTION_ID_COLLISION", collided)

    # -- delivery through a faulty transport (MWP-WRK-029, -030) ---------------------------------------
    for agent in team:
        agent.delivery.catch_up(GROUP)
    clean = AgentStore.open(os.path.join(directory, "agents", "observer-clean"))
    noisy = AgentStore.open(os.path.join(directory, "agents", "observer-noisy"))
    try:
        Delivery(clean, authority, consumer="observer-clean").catch_up(GROUP)
        transport = FaultyTransport(authority, seed=7, drop=0.1, duplicate=0.2, reorder=0.5, disconnect=0.05, replay=5)
        noisy_delivery = Delivery(noisy, transport, consumer="observer-noisy", batch_events=200)
        noisy_delivery.catch_up(GROUP, rounds_max=100_000)
        report.counts["duplicate deliveries ignored"] = noisy_delivery.stats.duplicates
        report.counts["out-of-order Events buffered"] = noisy_delivery.stats.buffered
        report.check(
            "an AgentStore fed duplicates, reordering, drops and disconnects ends equal to clean in-order delivery",
            noisy.states(GROUP) == clean.states(GROUP) and noisy.cursor(GROUP) == clean.cursor(GROUP) == authority.head(GROUP)[0],
            f"cursor {noisy.cursor(GROUP)}",
        )
        report.check("ACK recorded the highest contiguous cursor", authority.acked("observer-noisy", GROUP) == noisy.cursor(GROUP))

        # -- a far-behind agent: CURSOR_TOO_OLD, restore from a signed snapshot, continue ---------------
        ref = authority.snapshot(GROUP)
        authority.accept_many([owner("mission.create", f"mission-late-{i}", {"title": "after the snapshot", "cost_limit": 1}) for i in range(120)])
        behind = AgentStore.open(os.path.join(directory, "agents", "far-behind"), trusted_keys=[authority.signing_key.public_key])
        try:
            refs_seen = []

            def fetch(error: Any) -> bytes:
                from .snapshot import SnapshotRef

                reference = SnapshotRef.from_dict(error.snapshot_ref)
                refs_seen.append(reference)
                data = authority.read_snapshot(reference)
                check_snapshot_ref(data, reference)
                return data

            far = Delivery(behind, authority, consumer="far-behind", restore_snapshot=fetch, org=ORG)
            far.catch_up(GROUP)
            Delivery(clean, authority, consumer="observer-clean").catch_up(GROUP)
            report.check(
                "a far-behind agent got CURSOR_TOO_OLD, restored the signed snapshot and replayed strictly after it",
                refs_seen == [ref] and far.stats.restores == 1 and behind.states(GROUP) == clean.states(GROUP),
                f"snapshot at seq {ref.seq}",
            )
        finally:
            behind.close()
    finally:
        clean.close()
        noisy.close()

    # -- archive (MWP-MSN-009) and verify --------------------------------------------------------------
    from .audit_log import FileKeyProvider, verify_audit_log_against_snapshot
    from .snapshot import verify_snapshot

    record = authority.archive(GROUP, actor=OWNER, action_id="archive-demo-group", reason="demo finished")
    final = verify_snapshot(authority.read_snapshot(record.final_snapshot), keyring=authority.keyring(), group=GROUP, org=ORG)
    info = verify_audit_log_against_snapshot(os.path.join(authority.path, record.audit_location), final, FileKeyProvider(os.path.join(authority.path, "keys", "orgs")))
    report.check("archive: signed final snapshot + encrypted audit log of the complete history verify together", info.last_seq == final.seq == authority.head(GROUP)[0], f"{info.events} Events, {info.chunks} chunk(s)")
    try:
        authority.accept(owner("mission.create", "too-late", {"title": "x", "cost_limit": 1}))
        archived_refuses = False
    except MwpError as exc:
        archived_refuses = exc.code == "GROUP_ARCHIVED"
    report.check("the archived Group refuses Commands (GROUP_ARCHIVED)", archived_refuses)
    verification = authority.verify()
    report.check("verify: frames, hash chains and index equal to a rebuild", verification.ok, "; ".join(verification.problems[:3]))


def _print_report(report: Report, directory: str) -> None:
    print(f"mwpstore demo — data in {directory}")
    print()
    for name, ok, detail in report.checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}" + (f"  ({detail})" if detail else ""))
    print()
    for name, count in sorted(report.counts.items()):
        print(f"  {name:<52} {count}")
    for name, figure in sorted(report.figures.items()):
        print(f"  {name:<52} {figure:,.1f}")
    print()
    passed = sum(ok for _, ok, _ in report.checks)
    print(f"{passed}/{len(report.checks)} checks passed" + ("" if report.ok else " — FAILED"))
