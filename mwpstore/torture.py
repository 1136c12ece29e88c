"""The reliability suites behind ``mwpstore torture`` (``docs/reliability.md``).

Each suite runs for a count of iterations or a time budget, from a seed, and returns a result
dict ``{suite, seed, iterations, duration_s, violations, details}``; ``violations`` counts broken
invariants (each one is described in ``details["violation_messages"]``, first ones first).

- ``crash``       kill -9 of a child process (writer threads, AgentStores applying, snapshots) at
                  random moments and at the named fail points; after each kill the store is
                  reopened and checked against the oracle of acknowledged results.
- ``power``       simulated power loss: the log's I/O seam records every write and sync
                  (:mod:`mwpstore.io_seam`), crash states are drawn from the recording, the LMDB
                  index is deleted or rolled back to an image taken at a synced point, and the
                  machine's boot id changes; some recoveries are themselves cut by a second loss;
                  every second workload runs in bulk mode (``sync=False``).
- ``corruption``  every byte offset of the last frames cut, zeroed and garbled; single bit flips
                  in sealed segments, segment headers, the LMDB file, snapshots and audit logs;
                  missing, duplicated and reordered segment files.
- ``disk``        EIO at each sync point (once, and from then on), ENOSPC and short writes, through
                  an ``LD_PRELOAD`` library built from ``tests/native/fail_sync.c`` and through
                  the I/O seam's recorder.
- ``fuzz``        every decoder and entry point that takes outside bytes: seeded mutations,
                  hypothesis (when installed) and coverage-guided atheris (when installed).
- ``concurrency`` many threads mixing accept, read, subscribe, ack, snapshot, verify, compaction
                  and AgentStore delivery under a watchdog, with reader processes beside them
                  (read-only views and bare read-only logs) whose every read must be a prefix of
                  the final store.

The invariant checks (:func:`check_authority`, :func:`check_agent`) are public so that tests can
show they fail on a store that lost an acknowledged result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from .errors import Corruption, MwpError

SUITES = ("crash", "power", "corruption", "disk", "fuzz", "concurrency")
OPTIONAL_SUITES = ("lmdb-sweep",)
"""Suites that run only when named (``--suite lmdb-sweep``): not part of the default run."""
DEFAULT_COUNTS = {"crash": 12, "power": 400, "corruption": 600, "disk": 15, "fuzz": 2000, "concurrency": 2}
"""The short run of each suite (what CI and ``mwpstore torture`` without ``--count`` do)."""

GROUPS = ("g-1", "g-2")
OWNER = "owner"
ORG = "acme"
VIOLATION_MESSAGES_MAX = 50
BOOT_ID_ENV = "MWPSTORE_BOOT_ID"
FAILPOINT_ENV = "MWPSTORE_FAILPOINT"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Progress = Callable[[int, int], None]


# -- budgets, results, scratch space ---------------------------------------------------------------


class Budget:
    """A count of iterations or a time budget (whichever was given; the count wins if both)."""

    def __init__(self, count: int | None, seconds: float | None, default_count: int) -> None:
        self.count = count if count is not None else (None if seconds is not None else default_count)
        self.seconds = seconds
        self.started = time.monotonic()

    def more(self, done: int) -> bool:
        if self.count is not None:
            return done < self.count
        return time.monotonic() - self.started < float(self.seconds or 0)

    def report(self, done: int, progress: Progress | None) -> None:
        if progress is None:
            return
        if self.count is not None:
            progress(done, self.count)
        else:
            total = int(float(self.seconds or 0) * 1000)
            progress(min(total, int((time.monotonic() - self.started) * 1000)), total)


class Findings:
    """Violations found by a suite: counted, and the first ones described."""

    def __init__(self) -> None:
        self.count = 0
        self.messages: list[str] = []
        self.kinds: dict[str, int] = {}  # message shape (digits dropped) -> count

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < VIOLATION_MESSAGES_MAX:
            self.messages.append(message)
        shape = re.sub(r"[0-9a-f]{8,}|\d+", "#", message.split("\n")[0])
        shape = shape.split("): ", 1)[-1][:120]
        if shape in self.kinds or len(self.kinds) < VIOLATION_MESSAGES_MAX:
            self.kinds[shape] = self.kinds.get(shape, 0) + 1

    def extend(self, messages: list[str], context: str = "") -> None:
        for message in messages:
            self.add(f"{context}{message}")


def _result(suite: str, seed: int, iterations: int, started: float, findings: Findings, details: dict[str, Any]) -> dict[str, Any]:
    details = dict(details)
    details["violation_kinds"] = findings.kinds
    details["violation_messages"] = findings.messages
    return {
        "suite": suite,
        "seed": seed,
        "iterations": iterations,
        "duration_s": round(time.monotonic() - started, 3),
        "violations": findings.count,
        "details": details,
    }


def scratch_root() -> str:
    """Where the suites put their stores: tmpfs when there is one (cheap fsyncs), else the temp dir."""
    override = os.environ.get("MWPSTORE_TORTURE_DIR")
    if override:
        os.makedirs(override, exist_ok=True)
        return override
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


@contextlib.contextmanager
def _scratch(prefix: str) -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix=f"mwpstore-{prefix}-", dir=scratch_root())
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _boot_id(value: str) -> Iterator[None]:
    """Run with the kernel boot id the engine sees set to ``value`` (a "reboot" when it changes)."""
    previous = os.environ.get(BOOT_ID_ENV)
    os.environ[BOOT_ID_ENV] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BOOT_ID_ENV, None)
        else:
            os.environ[BOOT_ID_ENV] = previous


def _describe(exc: BaseException) -> str:
    if isinstance(exc, MwpError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


# -- the workload ------------------------------------------------------------------------------------


def group_create_command(group: str) -> Any:
    from .messages import Command

    return Command(actor=OWNER, action_id=f"create-{group}", group=group, kind="group.create", target=group, body={"org": ORG})


def _mission_create(group: str, mission: str, action_id: str) -> Any:
    from .messages import Command

    return Command(actor=OWNER, action_id=action_id, group=group, kind="mission.create", target=mission,
                   body={"title": f"mission {mission}", "cost_limit": 100})


def _mission_update(group: str, mission: str, revision: int, title: str, action_id: str) -> Any:
    from .messages import Command

    return Command(actor=OWNER, action_id=action_id, group=group, kind="mission.update", target=mission,
                   body={"title": title}, expected_revision=revision)


def workload_commands(authority: Any, rng: random.Random, action: str) -> list[Any]:
    """One or two Commands of the load mix: new Missions, and compare-and-set updates of a few
    hot ones (so concurrent writers collide on revisions and some Commands are rejected)."""
    group = rng.choice(GROUPS)
    hot = f"hot-{rng.randrange(4)}"
    if rng.random() < 0.45:
        command = _mission_create(group, f"m-{action}", action)
    else:
        revision, state = authority.state(group, f"mission:{hot}")
        if state is None:
            command = _mission_create(group, hot, action)
        else:
            command = _mission_update(group, hot, revision, f"title {action}", action)
    commands = [command]
    if rng.random() < 0.2:
        commands.append(_mission_create(rng.choice(GROUPS), f"m-{action}-b", f"{action}-b"))
    return commands


def ensure_groups(authority: Any) -> None:
    for group in GROUPS:
        try:
            authority.accept(group_create_command(group))
        except MwpError:
            pass


class CountingProjection:
    """An application projection that counts how often each Event reached it (2 = applied twice)."""

    name = "counter"

    def apply(self, view: Any, event: Any) -> None:
        key = f"seen:{event.seq:012d}"
        seen = view.get(key)
        view.put(key, str(1 if seen is None else int(seen) + 1).encode())


# -- invariant checks (public: tests show they can fail) -------------------------------------------


@dataclasses.dataclass
class Acknowledged:
    """The oracle: every result a caller was told about (and may therefore rely on)."""

    receipts: dict[str, tuple[str, int, str]] = dataclasses.field(default_factory=dict)  # action -> (group, seq, event id)
    snapshots: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # (group, seq)
    attempted: set[str] = dataclasses.field(default_factory=set)  # every action id ever submitted (when known)

    def add_receipt(self, action: str, group: str, seq: int, event_id: str) -> None:
        self.receipts[action] = (group, seq, event_id)


def read_group(authority: Any, group: str) -> list[Any]:
    events: list[Any] = []
    after = 0
    while True:
        batch = authority.read(group, after=after, limit=10_000)
        if not batch:
            return events
        events.extend(batch)
        after = batch[-1].seq


def check_authority(authority: Any, oracle: Acknowledged, *, full_verify: bool = True) -> list[str]:
    """Every invariant of an open Authority against the oracle; returns the violations found.

    - each Group's Events are contiguous from 1 to its head, hash-chained;
    - every acknowledged receipt is there, at the same sequence with the same Event ID;
    - no phantom: every Event's action was submitted (when the oracle knows the submissions);
    - no partial transition: the index's aggregate states and revisions equal the fold of the
      logged Events' effects, and each head equals the last Event;
    - every acknowledged snapshot is listed, readable and verifies;
    - ``verify()`` (all frames, hash chains, index equal to a rebuild) when ``full_verify``.
    """
    from .messages import ZERO_HASH

    problems: list[str] = []
    by_action: dict[str, Any] = {}
    for group in authority.groups() if hasattr(authority, "groups") else GROUPS:
        events = read_group(authority, group)
        seqs = [event.seq for event in events]
        head_seq, head_hash = authority.head(group)
        if seqs != list(range(1, head_seq + 1)):
            problems.append(f"group {group}: sequences are not 1..{head_seq} (got {len(seqs)} Events)")
        previous = ZERO_HASH
        folded: dict[str, tuple[int, Any]] = {}
        for event in events:
            if event.prev_hash != previous:
                problems.append(f"group {group}: chain break at seq {event.seq}")
                break
            previous = event.hash
            by_action[event.action_id] = event
            if oracle.attempted and event.action_id not in oracle.attempted and not event.action_id.startswith("create-"):
                problems.append(f"group {group}: Event {event.seq} has action {event.action_id} that was never submitted")
            for effect in event.effects:
                folded[effect.aggregate] = (effect.revision, effect.state)
        if events and head_hash != events[-1].hash:
            problems.append(f"group {group}: head hash differs from the last Event's hash")
        indexed = {key: (revision, state) for key, revision, state in authority.aggregates(group)}
        if indexed != folded:
            differing = sorted(key for key in set(indexed) | set(folded) if indexed.get(key) != folded.get(key))[:5]
            problems.append(f"group {group}: partial transition: index states differ from the logged effects at {differing}")
    for action, (group, seq, event_id) in oracle.receipts.items():
        event = by_action.get(action)
        if event is None:
            problems.append(f"acknowledged action {action} (group {group} seq {seq}) is lost")
        elif (event.group, event.seq, event.event_id) != (group, seq, event_id):
            problems.append(f"acknowledged action {action} moved: was {group}/{seq}, now {event.group}/{event.seq}")
    if oracle.snapshots:
        from .snapshot import check_snapshot_ref, verify_snapshot

        keyring = authority.keyring()
        listed = {(ref.group, ref.seq): ref for group in GROUPS for ref in authority.snapshots(group)}
        for group, seq in sorted(oracle.snapshots):
            ref = listed.get((group, seq))
            if ref is None:
                problems.append(f"acknowledged snapshot {group}@{seq} is not listed")
                continue
            try:
                data = authority.read_snapshot(ref)
                check_snapshot_ref(data, ref)  # the bytes are the ones the reference names
                verify_snapshot(data, keyring=keyring, org=ORG, group=group)
            except MwpError as exc:
                problems.append(f"acknowledged snapshot {group}@{seq} does not verify: {_describe(exc)}")
    if full_verify:
        report = authority.verify()
        problems.extend(f"verify: {problem}" for problem in report.problems)
    return problems


def check_agent(agent: Any, authority: Any, consumer: str | None = None, *, counted: bool = True) -> list[str]:
    """An AgentStore against the authority it follows; returns the violations found.

    Per Group: Cursor <= applied <= the authority's head; the applied head hash is the
    authority's Event at that sequence (no wrong Event applied); the inbox holds exactly the
    applied, unpruned sequences and (``counted``: the agent runs ``CountingProjection``) the
    projection saw each applied Event exactly once (no Cursor past a gap, no double apply);
    buffered Events lie beyond the gap; the mirrored states equal the fold of the authority's
    Events up to the applied sequence; the authority's ACK for this consumer is not ahead of the
    durable Cursor.
    """
    problems: list[str] = []
    for group in agent.groups():
        where = f"agent group {group}"
        try:
            head = agent.head(group)
        except Corruption as exc:  # a head the store could never have written (a Cursor past what is applied)
            problems.append(f"{where}: the store refuses its head: {exc}")
            continue
        events = read_group(authority, group)
        if not head.cursor <= head.applied_seq <= len(events):
            problems.append(f"{where}: cursor {head.cursor}, applied {head.applied_seq}, authority head {len(events)}")
            continue
        if head.applied_seq and events[head.applied_seq - 1].hash != head.applied_hash:
            problems.append(f"{where}: applied head hash differs from the authority's Event {head.applied_seq}")
        inbox = agent.inbox_seqs(group)
        if inbox != list(range(head.pruned_seq + 1, head.applied_seq + 1)):
            problems.append(f"{where}: inbox is not the contiguous applied range ({len(inbox)} entries, applied {head.applied_seq})")
        counts: dict[int, int] = {}
        for key, value in agent.projection_items(group, CountingProjection.name):
            if key.startswith(b"seen:"):
                counts[int(key[5:])] = int(value)
        floor = head.floor_seq
        expected = {seq: 1 for seq in range(floor + 1, head.applied_seq + 1)}
        if counted and counts != expected:
            twice = sorted(seq for seq, count in counts.items() if count != 1)[:5]
            missing = sorted(set(expected) - set(counts))[:5]
            extra = sorted(set(counts) - set(expected))[:5]
            problems.append(f"{where}: projection counts wrong (twice {twice}, missing {missing}, beyond applied {extra})")
        if any(seq <= head.applied_seq + 1 for seq in agent.buffered_seqs(group)):
            problems.append(f"{where}: a buffered Event is not beyond the gap")
        folded: dict[str, Any] = {}
        for event in events[: head.applied_seq]:
            for effect in event.effects:
                folded[effect.aggregate] = effect.state
        folded = {key: state for key, state in folded.items() if state is not None}
        if floor == 0 and agent.states(group) != folded:
            problems.append(f"{where}: mirrored states differ from the authority's Events 1..{head.applied_seq}")
        if consumer is not None and authority.acked(consumer, group) > head.cursor:
            problems.append(f"{where}: the authority holds ACK {authority.acked(consumer, group)} above the durable Cursor {head.cursor}")
    return problems


# -- crash: kill -9 under load ---------------------------------------------------------------------

AUTHORITY_FAILPOINTS = (
    "authority.before_log_append",  # decided, nothing written (mid group commit)
    "authority.after_log_sync",  # log durable, LMDB not committed: redo on open
    "authority.after_index_commit",  # both committed, callers not woken
    "authority.mid_redo",
    "authority.mid_rebuild",
    "compaction.copy",  # mid compaction: the new log written, not yet marked complete
    "compaction.marked",
    "compaction.half_switched",
    "compaction.switched",
    "compaction.indexed",
    "lmdb.databases_created",  # a new index or AgentStore: its databases made, not yet committed
)
AGENT_FAILPOINTS = (
    "agent.begin",
    "agent.after_dedupe",
    "agent.after_sequence",
    "agent.after_builtin_projection",
    "agent.after_projection",
    "agent.after_buffer",
    "agent.after_cursor",
    "agent.before_commit",
    "agent.after_commit",
)
CRASH_WRITER_THREADS = 6
CRASH_AGENTS = 3
CRASH_C_RUN_AGENTS = {1: "trusted", 2: "full"}
"""These agents (index: verify mode) run without an application projection, so their batches take
``apply_many``'s C runs (with full validation after ``check_run``); agent 0 counts each applied
Event in a projection."""
CRASH_KILLS_PER_STORE = 25
"""A fresh store every so many kills keeps the cost of each full check bounded."""


def crash_agent(path: str, index: int) -> Any:
    """Open crash agent ``index`` the way the crash child runs it."""
    from .agent_store import AgentStore

    verify = CRASH_C_RUN_AGENTS.get(index)
    if verify is not None:
        return AgentStore.open(path, verify=verify)
    return AgentStore.open(path, projections=[CountingProjection()])


def _python_command(function: str, *arguments: str) -> list[str]:
    script = f"import sys; sys.path.insert(0, {REPO_ROOT!r}); from mwpstore.torture import {function}; {function}(sys.argv[1:])"
    return [sys.executable, "-c", script, *arguments]


def crash_child(argv: list[str]) -> None:
    """The process the crash suite kills: ``PATH AGENT_ROOT RUN_ID THREADS AGENTS``.

    Writer threads accept Commands and print ``OK action group seq event_id`` after each
    acknowledgement; one thread takes snapshots (``SNAP group seq``), another compacts the log
    now and then; agent threads pull both
    Groups through a misbehaving transport into their AgentStores and ACK their Cursors.
    """
    from .authority import Authority
    from .delivery import Delivery, FaultyTransport, TransportDisconnected

    path, agent_root, run_id, thread_count, agent_count = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    authority = Authority.open(path)
    ensure_groups(authority)
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    say("READY")

    def write(index: int) -> None:
        rng = random.Random(f"{run_id}-{index}")
        counter = 0
        while True:
            counter += 1
            action = f"{run_id}-{index}-{counter}"
            try:
                commands = workload_commands(authority, rng, action)
                say("TRY " + " ".join(command.action_id for command in commands))
                if len(commands) == 1:
                    receipts = [authority.accept(commands[0])]
                else:
                    receipts = [result.unwrap() for result in authority.accept_many(commands) if result.ok]
            except MwpError:
                continue
            for receipt in receipts:
                say(f"OK {receipt.action_id} {receipt.group} {receipt.seq} {receipt.event_id}")
            if index == 0 and counter % 40 == 0:
                try:
                    ref = authority.snapshot(rng.choice(GROUPS))
                    say(f"SNAP {ref.group} {ref.seq}")
                except MwpError:
                    pass
            if index == 1 and counter % 25 == 0 and hasattr(authority, "compact"):
                try:
                    authority.compact()
                    say("COMPACTED")
                except MwpError:
                    pass

    def deliver(index: int) -> None:
        agent = crash_agent(os.path.join(agent_root, f"agent-{index}"), index)
        transport = FaultyTransport(authority, seed=hash((run_id, index)) & 0xFFFF, drop=0.1, duplicate=0.15,
                                    reorder=0.4, disconnect=0.02, replay=3)
        delivery = Delivery(agent, transport, consumer=f"agent-{index}", batch_events=7 + 5 * index)
        while True:
            for group in GROUPS:
                try:
                    if delivery.pull_once(group) == 0:
                        time.sleep(0.005)
                except TransportDisconnected:
                    continue

    threads = [threading.Thread(target=write, args=(i,), daemon=True) for i in range(thread_count)]
    threads += [threading.Thread(target=deliver, args=(i,), daemon=True) for i in range(agent_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class _LineReader(threading.Thread):
    """Collects a child's complete output lines (a torn last line was never a whole statement)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines: list[str] = []
        self.ready = threading.Event()

    def run(self) -> None:
        for line in iter(self.stream.readline, ""):
            if not line.endswith("\n"):
                break
            self.lines.append(line[:-1])
            if line == "READY\n":
                self.ready.set()


def _kill_child(path: str, agent_root: str, run_id: str, rng: random.Random, env: dict[str, str]) -> tuple[list[str], str, bool, str]:
    """Start the child, kill it (fail point, or SIGKILL at a random moment); return its lines,
    how it was killed, whether it died on its own (a fail point fired) and stderr on failure."""
    mode = "random"
    child_env = dict(env)
    child_env.pop(FAILPOINT_ENV, None)
    choice = rng.random()
    if choice < 0.35:
        name = rng.choice(AUTHORITY_FAILPOINTS + AGENT_FAILPOINTS)
        rare = name.startswith("compaction.") or name.endswith(("mid_redo", "mid_rebuild"))
        child_env[FAILPOINT_ENV] = f"{name}:{rng.randrange(1, 3) if rare else rng.randrange(1, 60)}"
        mode = name
    elif choice < 0.45:
        mode = "during_open"
    command = _python_command("crash_child", path, agent_root, run_id, str(CRASH_WRITER_THREADS), str(CRASH_AGENTS))
    # Standard error goes to a file: only the reader thread may read standard output, or lines
    # (the oracle) would be lost to whoever else reads the pipe.
    errors = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=errors, text=True)
    reader = _LineReader(child.stdout)
    reader.start()
    if mode == "during_open":
        time.sleep(rng.uniform(0.05, 0.6))
    else:
        waited = time.monotonic() + 60
        while not reader.ready.wait(timeout=0.02) and child.poll() is None and time.monotonic() < waited:
            pass
        time.sleep(rng.uniform(0.02, 0.6))
    died_alone = child.poll() is not None
    if not died_alone:
        child.send_signal(signal.SIGKILL)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    reader.join(timeout=60)
    child.stdout.close()
    errors.seek(0)
    stderr = errors.read()
    errors.close()
    failure = ""
    if reader.is_alive():
        failure = "the child's output was not read to its end"
    if child.returncode != -signal.SIGKILL:
        failure = f"child exited with {child.returncode}: {stderr[-1500:]}"
    return reader.lines, mode, died_alone, failure


def run_crash(count: int | None = None, seconds: float | None = None, seed: int = 1,
              progress: Progress | None = None, *, verify_every: int = 1) -> dict[str, Any]:
    """kill -9 under load; after every kill reopen and check every invariant.

    ``verify_every``: the full ``verify()`` (index equal to a rebuild) runs after every k-th kill;
    the other checks run after every kill.
    """
    from .authority import Authority

    started = time.monotonic()
    budget = Budget(count, seconds, DEFAULT_COUNTS["crash"])
    rng = random.Random(seed)
    findings = Findings()
    modes: dict[str, int] = {}
    fired: dict[str, int] = {}
    open_modes: dict[str, int] = {}
    acknowledged_total = events_checked = verifies = reboots = agent_applied = compactions = 0
    kills = 0
    boot = f"torture-boot-{seed}-0"
    with _scratch("crash") as root:
        store = agent_root = ""
        oracle = Acknowledged()
        while budget.more(kills):
            if kills % CRASH_KILLS_PER_STORE == 0:
                store = os.path.join(root, f"store-{kills}")
                agent_root = os.path.join(root, f"agents-{kills}")
                shutil.rmtree(os.path.join(root, f"store-{kills - CRASH_KILLS_PER_STORE}"), ignore_errors=True)
                shutil.rmtree(os.path.join(root, f"agents-{kills - CRASH_KILLS_PER_STORE}"), ignore_errors=True)
                os.makedirs(agent_root)
                oracle = Acknowledged()
            run_id = f"k{kills}"
            env = dict(os.environ, **{BOOT_ID_ENV: boot})
            lines, mode, died_alone, failure = _kill_child(store, agent_root, run_id, rng, env)
            kills += 1
            modes[mode] = modes.get(mode, 0) + 1
            if died_alone and mode not in ("random", "during_open"):
                fired[mode] = fired.get(mode, 0) + 1
            if failure:
                findings.add(f"kill {kills} ({mode}): {failure}")
            for line in lines:
                parts = line.split()
                if parts[0] == "OK" and len(parts) == 5:
                    oracle.add_receipt(parts[1], parts[2], int(parts[3]), parts[4])
                    acknowledged_total += 1
                elif parts[0] == "TRY":
                    oracle.attempted.update(parts[1:])
                elif parts[0] == "SNAP" and len(parts) == 3:
                    oracle.snapshots.add((parts[1], int(parts[2])))
                elif parts[0] == "COMPACTED":
                    compactions += 1
            if rng.random() < 0.1:  # the machine "restarted": the index is rebuilt, not redone
                reboots += 1
                boot = f"torture-boot-{seed}-{kills}"
            full = kills % verify_every == 0 or not budget.more(kills)
            try:
                with _boot_id(boot), Authority.open(store) as authority:
                    open_modes[authority.open_report.mode] = open_modes.get(authority.open_report.mode, 0) + 1
                    problems = check_authority(authority, oracle, full_verify=full)
                    if authority.open_report.reason.startswith("index damaged"):
                        # A kill leaves LMDB's file whole (the page cache survives it): a failed
                        # structural check here is a wrong check, or damage the engine caused.
                        problems.append(f"the index failed its structural check after a kill: {authority.open_report.reason}")
                    verifies += int(full)
                    events_checked += sum(authority.head(group)[0] for group in GROUPS)
                    for index in range(CRASH_AGENTS):
                        agent_path = os.path.join(agent_root, f"agent-{index}")
                        if not os.path.isdir(agent_path):
                            continue
                        with crash_agent(agent_path, index) as agent:
                            problems += check_agent(agent, authority, consumer=f"agent-{index}", counted=index not in CRASH_C_RUN_AGENTS)
                            agent_applied += sum(agent.head(group).applied_seq for group in agent.groups())
            except MwpError as exc:
                problems = [f"reopen failed: {_describe(exc)}"]
            except Exception as exc:
                problems = [f"reopen raised a foreign error: {_describe(exc)}\n{traceback.format_exc()[-1500:]}"]
            findings.extend(problems, f"kill {kills} ({mode}, seed {seed}): ")
            budget.report(kills, progress)
    return _result("crash", seed, kills, started, findings, {
        "kills": kills,
        "acknowledged_results": acknowledged_total,
        "events_checked": events_checked,
        "agent_events_checked": agent_applied,
        "full_verifies": verifies,
        "reboots_simulated": reboots,
        "compactions_completed": compactions,
        "kill_modes": modes,
        "fail_points_fired": fired,
        "reopen_modes": open_modes,
        "writer_threads": CRASH_WRITER_THREADS,
        "agent_stores": CRASH_AGENTS,
    })



# -- power: simulated power loss through the I/O seam, with LMDB losing unsynced pages -------------


@contextlib.contextmanager
def recorded_log(recorder: Any) -> Iterator[None]:
    """Make every Authority opened inside the block do its log I/O through ``recorder``.

    ``Authority.open`` takes no ``io`` argument, so the suite swaps the name the authority module
    opens its log with. Not thread-safe against other Authorities opening at the same moment.
    """
    from . import authority as authority_module

    original = authority_module.SegmentLog

    class _RecordedSegmentLog:
        @staticmethod
        def open(directory: Any, **options: Any) -> Any:
            options.setdefault("io", recorder)
            return original.open(directory, **options)

    authority_module.SegmentLog = _RecordedSegmentLog  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        authority_module.SegmentLog = original  # type: ignore[misc]


def _read_tree(directory: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and name != "lock.mdb":
                with open(path, "rb") as handle:
                    files[name] = handle.read()
    return files


def _write_tree(directory: str, files: dict[str, bytes]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(content)


@dataclasses.dataclass
class _PowerRecording:
    operations: list[tuple[Any, ...]]
    images: list[tuple[int, dict[str, bytes]]]  # (operation index, index files) at synced points
    attempted: set[str]


POWER_SEGMENT_BYTES = 64 * 1024
POWER_WORKLOAD_STEPS = 90
POWER_STATES_PER_WORKLOAD = 250


def _power_workload(source: str, rng: random.Random, steps: int, *, bulk: bool = False) -> _PowerRecording:
    """Run accepts, ACKs and clean reopens against a recorder; mark every acknowledgement and
    keep images of the LMDB index taken when everything it reflects was synced.

    ``bulk``: the store runs in bulk mode (``sync=False``), where a result is promised only once a
    later ``sync()`` or clean close has returned: the marks of the results since the last one are
    written after it. Index images are then also taken between syncs (an index ahead of the
    log's durable end, as LMDB's own writes may reach the disk before the log's)."""
    from .authority import Authority
    from .io_seam import RecordingIO

    recorder = RecordingIO()
    images: list[tuple[int, dict[str, bytes]]] = []
    attempted: set[str] = set()
    index_dir = os.path.join(source, "index")
    unsynced: list[tuple[str, tuple[Any, ...]]] = []  # bulk mode: results not yet promised

    def image() -> None:
        images.append((len(recorder.operations), _read_tree(index_dir)))

    def promise(kind: str, value: tuple[Any, ...]) -> None:
        if bulk:
            unsynced.append((kind, value))
        else:
            recorder.mark(kind, value)

    def synced() -> None:  # a sync() or clean close returned: every result before it is promised
        for kind, value in unsynced:
            recorder.mark(kind, value)
        unsynced.clear()

    with _boot_id(f"power-workload-{rng.random()}"), recorded_log(recorder):
        authority = Authority.open(source, segment_bytes=POWER_SEGMENT_BYTES, sync=not bulk)
        for group in GROUPS:
            receipt = authority.accept(group_create_command(group))
            promise("receipt", (receipt.action_id, receipt.group, receipt.seq, receipt.event_id))
        if bulk:
            authority.sync()
            synced()
        image()
        for step in range(steps):
            choice = rng.random()
            if choice < 0.05:
                authority.close()  # a clean close: the index is synced and marked clean
                synced()
                image()
                authority = Authority.open(source, segment_bytes=POWER_SEGMENT_BYTES, sync=not bulk)
                image()
            elif choice < 0.12:
                group = rng.choice(GROUPS)
                cursor = rng.randint(0, authority.head(group)[0])
                stored = authority.ack("agent-p", group, cursor)
                promise("ack", ("agent-p", group, stored))
            elif bulk and choice < 0.22:
                authority.sync()
                synced()
            else:
                commands = workload_commands(authority, rng, f"p{step}")
                attempted.update(command.action_id for command in commands)
                recorder.mark("begin", [command.action_id for command in commands])
                try:
                    if len(commands) == 1:
                        receipts = [authority.accept(commands[0])]
                    else:
                        receipts = [result.unwrap() for result in authority.accept_many(commands) if result.ok]
                except MwpError:
                    receipts = []
                for receipt in receipts:
                    promise("receipt", (receipt.action_id, receipt.group, receipt.seq, receipt.event_id))
            if rng.random() < 0.25:
                image()
        authority.close()
        synced()
    return _PowerRecording(recorder.operations, images, attempted)


def _oracle_before(operations: list[tuple[Any, ...]], crash_at: int, attempted: set[str]) -> tuple[Acknowledged, dict[tuple[str, str], int]]:
    oracle = Acknowledged(attempted=attempted)
    acks: dict[tuple[str, str], int] = {}
    for operation in operations[:crash_at]:
        if operation[0] != "mark":
            continue
        if operation[1] == "receipt":
            oracle.add_receipt(*operation[2])
        elif operation[1] == "ack":
            consumer, group, cursor = operation[2]
            acks[(consumer, group)] = max(acks.get((consumer, group), 0), cursor)
    return oracle, acks


def _check_power_state(target: str, oracle: Acknowledged, acks: dict[tuple[str, str], int], boot: str,
                       full_verify: bool, modes: dict[str, int], recorder: Any = None, *,
                       sync: bool = True) -> tuple[list[str], int]:
    """Open a crash state after a "reboot" and check it; returns (problems, operations recorded
    while opening, when a recorder is given). ``sync=False`` opens it as a bulk-mode writer."""
    from .authority import Authority

    opened_at = 0
    try:
        with _boot_id(boot), (recorded_log(recorder) if recorder is not None else contextlib.nullcontext()):
            authority = Authority.open(target, segment_bytes=POWER_SEGMENT_BYTES, sync=sync)
            opened_at = len(recorder.operations) if recorder is not None else 0
            try:
                modes[authority.open_report.mode] = modes.get(authority.open_report.mode, 0) + 1
                problems = check_authority(authority, oracle, full_verify=full_verify)
                for (consumer, group), cursor in acks.items():
                    if authority.acked(consumer, group) < cursor:
                        problems.append(f"acknowledged ACK {consumer}/{group}={cursor} lost")
                receipt_before = authority.log.end
                ensure_groups(authority)
                authority.accept(_mission_create(GROUPS[0], "after-recovery", "after-recovery"))  # it takes writes
                if authority.log.end <= receipt_before:
                    problems.append("the recovered store did not append")
                try:  # and the log still reads whole with that group after what recovery kept
                    authority.log.verify()
                except MwpError as exc:
                    problems.append(f"the log does not read back after the post-recovery write: {_describe(exc)}")
            finally:
                authority.close()
    except MwpError as exc:
        return [f"open after power loss failed: {_describe(exc)}"], opened_at
    except Exception as exc:
        return [f"open after power loss raised a foreign error: {_describe(exc)}\n{traceback.format_exc()[-1500:]}"], opened_at
    return problems, opened_at


def run_power(count: int | None = None, seconds: float | None = None, seed: int = 1,
              progress: Progress | None = None, *, verify_every: int = 1) -> dict[str, Any]:
    """Simulated power loss: crash states of the log from the I/O seam's recording, the index
    deleted or rolled back to an earlier synced image, a new boot id; one in six recoveries is
    itself cut by a second power loss and recovered again. Every second workload runs in bulk mode
    (``sync=False``), where only what a ``sync()`` or clean close covered is promised, and half
    of its crash states are opened by a bulk-mode writer again."""
    from .io_seam import RecordingIO, crash_state, write_crash_state

    started = time.monotonic()
    budget = Budget(count, seconds, DEFAULT_COUNTS["power"])
    rng = random.Random(seed)
    findings = Findings()
    states = workloads = second_losses = bulk_states = 0
    index_choices: dict[str, int] = {}
    modes: dict[str, int] = {}
    acknowledged_checked = 0
    with _scratch("power") as root:
        recording: _PowerRecording | None = None
        source = ""
        bulk = False
        while budget.more(states):
            if recording is None or states // POWER_STATES_PER_WORKLOAD >= workloads:
                source = os.path.join(root, f"source-{workloads}")
                shutil.rmtree(os.path.join(root, f"source-{workloads - 1}"), ignore_errors=True)
                bulk = workloads % 2 == 1
                recording = _power_workload(source, random.Random(rng.random()), POWER_WORKLOAD_STEPS, bulk=bulk)
                workloads += 1
            operations = recording.operations
            crash_at = rng.randint(0, len(operations))
            oracle, acks = _oracle_before(operations, crash_at, recording.attempted)
            target = os.path.join(root, f"state-{states}")
            write_crash_state(crash_state(operations, crash_at, rng), os.path.join(source, "log"), os.path.join(target, "log"))
            candidates = [files for at, files in recording.images if at <= crash_at]
            draw = rng.random()
            if not candidates or draw < 0.25:
                choice = "deleted"
            elif draw < 0.6:
                choice = "earlier_image"
                _write_tree(os.path.join(target, "index"), rng.choice(candidates))
            else:
                choice = "last_synced_image"
                _write_tree(os.path.join(target, "index"), candidates[-1])
            index_choices[choice] = index_choices.get(choice, 0) + 1
            full = states % verify_every == 0
            second = rng.random() < 1 / 6
            recorder = RecordingIO(directory=os.path.join(target, "log")) if second else None
            index_before = _read_tree(os.path.join(target, "index")) if second else {}
            reopen_sync = not (bulk and rng.random() < 0.5)
            problems, opened_at = _check_power_state(target, oracle, acks, f"power-{seed}-{states}", full, modes, recorder,
                                                     sync=reopen_sync)
            states += 1
            bulk_states += bulk
            acknowledged_checked += len(oracle.receipts)
            findings.extend(problems, f"state {states} (seed {seed}, crash at operation {crash_at}, index {choice}"
                                      f"{', bulk mode' if bulk else ''}): ")
            if second and recorder is not None and not problems:
                # The recovery itself loses power part-way; the next boot must recover again.
                second_at = rng.randint(0, opened_at)
                again = os.path.join(root, f"state-{states}-again")
                write_crash_state(crash_state(recorder.operations, second_at, rng), os.path.join(target, "log"),
                                  os.path.join(again, "log"))
                pick = rng.choice(("deleted", "before_recovery", "partial_rebuild"))
                if pick == "before_recovery" and index_before:
                    _write_tree(os.path.join(again, "index"), index_before)
                elif pick == "partial_rebuild":  # what a crash mid-rebuild leaves behind
                    _write_tree(os.path.join(again, "index.rebuild"), {"data.mdb": rng.randbytes(8192)})
                    if index_before:
                        _write_tree(os.path.join(again, "index"), index_before)
                problems, _ = _check_power_state(again, oracle, acks, f"power-{seed}-{states}-again", full, modes,
                                                 sync=reopen_sync)
                states += 1
                bulk_states += bulk
                second_losses += 1
                findings.extend(problems, f"state {states} (second loss during recovery at operation {second_at}, {pick}): ")
                shutil.rmtree(again, ignore_errors=True)
            shutil.rmtree(target, ignore_errors=True)
            budget.report(states, progress)
    return _result("power", seed, states, started, findings, {
        "crash_states": states,
        "workloads": workloads,
        "bulk_mode_states": bulk_states,
        "operations_per_workload": len(recording.operations) if recording else 0,
        "losses_during_recovery": second_losses,
        "index_after_loss": index_choices,
        "reopen_modes": modes,
        "acknowledged_results_checked": acknowledged_checked,
        "full_verify_every": verify_every,
    })



# -- corruption: cut, zeroed and garbled tails; bit flips; missing, duplicated, reordered files -----

CORRUPTION_FAMILIES = (
    "tail_cut", "tail_zero", "tail_garble", "tail_flip", "active_block", "sealed_flip", "header_flip",
    "segment_files", "snapshot_flip", "audit_flip", "lmdb_flip", "agent_lmdb_flip",
)
ACTIVE_BYTES_MIN = 16 * 1024
"""The fixture's active segment holds at least this much, so a damaged block has groups after it."""
TAIL_RECORDS = 3
"""The sweep covers every byte of the last frames: the last few records and their commit frame."""
LMDB_BATCH = 5
TAIL_OFFSETS_PER_TURN = 8
CORRUPTION_SCHEDULE = ("tail_cut", "tail_zero", "tail_garble", "tail_flip") * 3 + (
    "active_block", "sealed_flip", "header_flip", "segment_files", "snapshot_flip", "audit_flip", "lmdb_flip",
    "agent_lmdb_flip")
"""One turn of the round robin: the tail sweep gets most cases (8 offsets a turn); an LMDB turn
(the authority's index or an AgentStore's file) is a batch of 5 in a child. A cycle is 112 cases;
every tail offset is covered after (tail region bytes / 8) cycles."""


@dataclasses.dataclass
class _Fixture:
    root: str
    store: str
    records: list[tuple[int, bytes]]  # every record of the log, in order
    segments: list[tuple[str, int, int, bool]]  # (file name, first position, used bytes, sealed)
    tail_region: tuple[int, int]  # byte range of the last frames in the last segment
    snapshot: bytes
    snapshot_group: str
    audit_path: str
    audit_records: list[bytes]
    keys: str
    boot: str
    oracle: Acknowledged
    agent: str  # an AgentStore that applied both Groups, cleanly closed
    agent_dump: str  # everything its read API answers (``agent_answers``)
    agent_dump_written: str  # the same after ``_agent_flip_write`` on a copy of it


def _build_fixture(root: str, rng: random.Random) -> _Fixture:
    """A store with several sealed segments, snapshots and an audit log; everything acknowledged."""
    from .audit_log import FileKeyProvider, read_audit_log, write_audit_log
    from .authority import Authority
    from .segment_log import SegmentLog
    from ._segment_log_c import lib

    store = os.path.join(root, "fixture")
    boot = f"corruption-{rng.random()}"
    oracle = Acknowledged()
    with _boot_id(boot):
        authority = Authority.open(store, segment_bytes=POWER_SEGMENT_BYTES)
        ensure_groups(authority)
        step = 0
        # four segments, the active one with groups enough for active_block's damage before its tail
        while len(authority.log.segments()) < 4 or authority.log.segments()[-1].used_bytes < ACTIVE_BYTES_MIN:
            step += 1
            commands = workload_commands(authority, rng, f"c{step}")
            results = authority.accept_many(commands)
            for result in results:
                if result.ok:
                    receipt = result.unwrap()
                    oracle.add_receipt(receipt.action_id, receipt.group, receipt.seq, receipt.event_id)
        ref = authority.snapshot(GROUPS[0])
        oracle.snapshots.add((ref.group, ref.seq))
        snapshot = authority.read_snapshot(ref)
        events = authority._read_bodies(GROUPS[1], 0, 100_000)
        agent_path = os.path.join(root, "agent")
        agent_dump = _build_agent_fixture(agent_path, authority)
        authority.close()
    agent_dump_written = _agent_written_dump(agent_path, os.path.join(root, "agent-written"))
    keys = os.path.join(root, "org-keys")
    audit_path = os.path.join(root, "audit.log")
    provider = FileKeyProvider(keys)
    write_audit_log(audit_path, org=ORG, group=GROUPS[1], events=events, key_provider=provider, chunk_bytes=4096)
    audit_records = list(read_audit_log(audit_path, key_provider=provider, org=ORG, group=GROUPS[1]))
    with SegmentLog.open(os.path.join(store, "log"), readonly=True) as log:
        records = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
        infos = log.segments()
    segments = [(os.path.basename(info.path), info.first_position, info.used_bytes, info.sealed) for info in infos]
    _, last_first, last_used, _ = segments[-1]
    tail_start = lib.SL_SEGMENT_HEADER_BYTES + max(0, records[-TAIL_RECORDS][0] - last_first)
    return _Fixture(root, store, records, segments, (tail_start, last_used), snapshot, GROUPS[0], audit_path,
                    audit_records, keys, boot, oracle, agent_path, agent_dump, agent_dump_written)


def _build_agent_fixture(path: str, authority: Any) -> str:
    """An AgentStore following both Groups (pruned inbox, an outbox intent, a buffered Event)."""
    from .agent_store import AgentStore
    from .delivery import Delivery

    with AgentStore.open(path, projections=[CountingProjection()]) as agent:
        for group in GROUPS:
            Delivery(agent, authority).catch_up(group)
        agent.prune_inbox(GROUPS[0])
        with agent.begin() as tx:
            tx.record_intent(GROUPS[1], mission="m-fixture", workitem="wi-fixture", ownership_epoch=1, operation="notify")
        return agent_answers(agent)


AGENT_FLIP_NOW_MS = 3_000_000
"""The clock of the AgentStore the ``agent_lmdb_flip`` family writes to (its intent's times)."""


def _agent_flip_clock() -> int:
    return AGENT_FLIP_NOW_MS


def _agent_flip_write(agent: Any) -> None:
    """The write every ``agent_lmdb_flip`` case makes after its reads: an outbox intent in the
    first Group (puts into the outbox, its group index and presence) and a reset of the second
    (a deletion across every database of a Group), two local transactions."""
    with agent.begin() as tx:
        tx.record_intent(GROUPS[0], mission="m-flip", workitem="wi-flip", ownership_epoch=1, operation="notify")
    agent.reset_group(GROUPS[1])


def _agent_written_dump(fixture_agent: str, target: str) -> str:
    """``agent_answers`` of a copy of the AgentStore fixture after ``_agent_flip_write``."""
    from .agent_store import AgentStore

    shutil.copytree(fixture_agent, target, ignore=shutil.ignore_patterns("lock.mdb", "agent.lock"))
    with AgentStore.open(target, projections=[CountingProjection()], clock=_agent_flip_clock) as agent:
        _agent_flip_write(agent)
        return agent_answers(agent)


def agent_answers(agent: Any) -> str:
    """Everything an AgentStore's read API answers, as one JSON text (two equal texts: the same
    store as far as any caller can tell)."""
    answers: dict[str, Any] = {"groups": agent.groups()}
    for group in answers["groups"]:
        head = agent.head(group)
        answers[group] = {
            "head": [head.applied_seq, head.applied_hash.hex(), head.cursor, head.pruned_seq, head.floor_seq, head.buffered],
            "states": agent.states(group),
            "inbox": agent.inbox_seqs(group),
            "buffer": agent.buffered_seqs(group),
            "projection": [[key.hex(), value.hex()] for key, value in agent.projection_items(group, CountingProjection.name)],
            "queue": [[entry.workitem, entry.priority, entry.not_before_ms] for entry in agent.work_queue(group, 2**62)],
            "intents": [repr(intent) for intent in agent.intents(group)],
            "dump": [[name, key.hex(), value.hex()] for name, key, value in agent.projection_dump(group)],
        }
    return json.dumps(answers, sort_keys=True, default=repr)


def _copy_log(fixture: _Fixture, target: str) -> str:
    log = os.path.join(target, "log")
    shutil.copytree(os.path.join(fixture.store, "log"), log)
    lock = os.path.join(log, "LOCK")
    if os.path.exists(lock):
        os.remove(lock)
    return log


def _mutate_file(path: str, offset: int, change: Callable[[bytearray, int], None]) -> None:
    with open(path, "r+b") as handle:
        content = bytearray(handle.read())
        change(content, offset)
        handle.seek(0)
        handle.truncate()
        handle.write(content)


def _judge_log(directory: str, original: list[tuple[int, bytes]], *, must_keep_all: bool) -> tuple[str, str]:
    """Open (with recovery) and read a damaged log. Returns (outcome, violation or "").

    Outcomes: ``detected`` (a typed Corruption naming segment and offset), ``prefix`` (some tail
    records gone, the rest exact), ``intact`` (everything exact, e.g. a flip in padding);
    ``wrong`` and ``foreign`` are violations, and so is ``prefix`` when ``must_keep_all``.
    """
    from .errors import Corruption
    from .segment_log import SegmentLog

    try:
        with SegmentLog.open(directory, segment_bytes=POWER_SEGMENT_BYTES) as log:
            seen = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
            log.verify()
    except Corruption as exc:
        if "segment" not in exc.detail or "offset" not in exc.detail:
            return "detected", f"Corruption without segment and offset: {exc.detail}"
        return "detected", ""
    except MwpError as exc:
        return "detected", f"a typed error that is not CORRUPTION: {_describe(exc)}" if exc.code != "STORAGE_FAILED" else ""
    except Exception as exc:
        return "foreign", f"foreign error {_describe(exc)}"
    if seen == original:
        return "intact", ""
    if seen == original[: len(seen)]:
        return "prefix", ("damage inside committed data passed silently for a torn tail "
                          f"({len(original) - len(seen)} records dropped)") if must_keep_all else ""
    return "wrong", "the log returned records that differ from what was written"


def _maybe_as_after_a_crash(log: str, rng: random.Random) -> bool:
    """Half the copies as after a crash: without the clean close's marker, open reads every sealed
    header and seal and walks the active segment itself; with it, reads and scans find damage."""
    from .segment_log import CLEAN_FILE_NAME

    crashed = rng.random() < 0.5
    if crashed:
        os.remove(os.path.join(log, CLEAN_FILE_NAME))
    return crashed


def _corruption_case(family: str, fixture: _Fixture, rng: random.Random, work: str, sweep: dict[str, list[int]]) -> tuple[str, str]:
    """One damaged copy of one family; returns (outcome, violation or "")."""
    from ._segment_log_c import lib

    if family in ("tail_cut", "tail_zero", "tail_garble", "tail_flip"):
        offsets = sweep.setdefault(family, [])
        if not offsets:
            offsets.extend(range(*fixture.tail_region))
            rng.shuffle(offsets)
        offset = offsets.pop()
        log = _copy_log(fixture, work)
        name = fixture.segments[-1][0]
        path = os.path.join(log, name)
        if family == "tail_cut":
            os.truncate(path, offset)
        elif family == "tail_zero":
            _mutate_file(path, offset, lambda content, at: content.__setitem__(slice(at, fixture.tail_region[1]), bytes(fixture.tail_region[1] - at)))
        elif family == "tail_garble":
            _mutate_file(path, offset, lambda content, at: content.__setitem__(at, (content[at] + rng.randrange(1, 256)) % 256))
        else:
            bit = rng.randrange(8)
            _mutate_file(path, offset, lambda content, at: content.__setitem__(at, content[at] ^ (1 << bit)))
        # A cut, a zeroed tail or a garbled byte may read as a torn write (a correct prefix is
        # enough); a single flipped bit inside committed frames must be reported (DESIGN.md §4).
        outcome, violation = _judge_log(log, fixture.records, must_keep_all=family == "tail_flip")
        where = f"{name} offset {offset} (tail {fixture.tail_region[0]}..{fixture.tail_region[1]})"
        return outcome, f"{where}: {violation}" if violation else ""
    if family == "active_block":
        # A block zeroed or garbled inside the active segment's committed groups, before its last
        # records (so intact groups follow it): never a clean end or a torn tail, whatever group
        # boundary it covers. The fixture's last group is a snapshot's reference (one record),
        # so the block never reaches the start of the last group, where zeros
        # followed only by that group's own commit frame are cut as a torn write.
        name, _, _, _ = fixture.segments[-1]
        start_min, start_max = lib.SL_SEGMENT_HEADER_BYTES, fixture.tail_region[0]
        length = rng.choice((16, 64, 512, 4096))
        if start_max - start_min < length:
            length = max(8, (start_max - start_min) // 8 * 8)
        if start_max - start_min < length:
            return "skipped", ""
        offset = start_min + rng.randrange((start_max - start_min - length) // 8 + 1) * 8
        zeroed = rng.random() < 0.5
        log = _copy_log(fixture, work)
        filler = bytes(length) if zeroed else bytes(rng.randrange(256) for _ in range(length))
        _mutate_file(os.path.join(log, name), offset, lambda content, at: content.__setitem__(slice(at, at + length), filler))
        crashed = _maybe_as_after_a_crash(log, rng)
        outcome, violation = _judge_log(log, fixture.records, must_keep_all=True)
        where = f"{name} offset {offset}, {length} bytes {'zeroed' if zeroed else 'garbled'}{' (no CLEAN marker)' if crashed else ''}"
        return outcome, f"{where}: {violation}" if violation else ""
    if family in ("sealed_flip", "header_flip"):
        log = _copy_log(fixture, work)
        if family == "sealed_flip":
            name, _, used, _ = rng.choice([segment for segment in fixture.segments if segment[3]])
            offset = rng.randrange(lib.SL_SEGMENT_HEADER_BYTES, used)
        else:
            name = rng.choice(fixture.segments)[0]
            offset = rng.randrange(lib.SL_SEGMENT_HEADER_BYTES)
        bit = rng.randrange(8)
        _mutate_file(os.path.join(log, name), offset, lambda content, at: content.__setitem__(at, content[at] ^ (1 << bit)))
        crashed = _maybe_as_after_a_crash(log, rng)
        outcome, violation = _judge_log(log, fixture.records, must_keep_all=True)
        where = f"{name} offset {offset} bit {bit}{' (no CLEAN marker)' if crashed else ''}"
        return outcome, f"{where}: {violation}" if violation else ""
    if family == "segment_files":
        log = _copy_log(fixture, work)
        names = [segment[0] for segment in fixture.segments]
        kind = rng.choice(("missing", "duplicated", "reordered"))
        if kind == "missing":
            os.remove(os.path.join(log, rng.choice(names)))
        elif kind == "duplicated":
            from .segment_log import segment_file_name

            source = rng.choice(names)
            # A copy under another segment's name, or under a new name past the end.
            target = rng.choice([name for name in names if name != source] + [segment_file_name(fixture.records[-1][0] + 4096)])
            shutil.copyfile(os.path.join(log, source), os.path.join(log, target))
        else:
            first, second = rng.sample(names, 2)
            os.rename(os.path.join(log, first), os.path.join(log, "swap"))
            os.rename(os.path.join(log, second), os.path.join(log, first))
            os.rename(os.path.join(log, "swap"), os.path.join(log, second))
        return _judge_log(log, fixture.records, must_keep_all=False)
    if family == "snapshot_flip":
        from .errors import SnapshotInvalid
        from .snapshot import Keyring, SigningKey, verify_snapshot

        data = bytearray(fixture.snapshot)
        offset = rng.randrange(len(data))
        data[offset] ^= 1 << rng.randrange(8)
        keyring = Keyring([SigningKey.load_or_create(os.path.join(fixture.store, "keys")).public_key])
        try:
            verify_snapshot(bytes(data), keyring=keyring, org=ORG, group=fixture.snapshot_group)
        except SnapshotInvalid as exc:
            return f"rejected:{exc.check}", ""
        except Exception as exc:
            return "foreign", f"snapshot bit flip at {offset}: {_describe(exc)}"
        return "accepted", f"a snapshot with a flipped bit at offset {offset} verified"
    if family == "audit_flip":
        from .audit_log import FileKeyProvider, read_audit_log

        path = os.path.join(work, "audit.log")
        shutil.copyfile(fixture.audit_path, path)
        offset = rng.randrange(os.path.getsize(path))
        bit = rng.randrange(8)
        _mutate_file(path, offset, lambda content, at: content.__setitem__(at, content[at] ^ (1 << bit)))
        records: list[bytes] = []
        try:
            for record in read_audit_log(path, key_provider=FileKeyProvider(fixture.keys), org=ORG, group=GROUPS[1]):
                records.append(record)
        except MwpError as exc:
            if records != fixture.audit_records[: len(records)]:
                return "wrong", f"audit log flip at {offset}: records before the error differ"
            return f"rejected:{exc.detail.get('check', exc.code)}", ""
        except Exception as exc:
            return "foreign", f"audit log flip at {offset}: {_describe(exc)}"
        return "accepted", f"an audit log with a flipped bit at offset {offset} was read without error"
    raise AssertionError(family)


def _flip_cases(cases: list[list[int]], fixture: str, work: str, data_file: str, ignore: tuple[str, ...],
                judge: Callable[[str, int, int], tuple[str, str]]) -> None:
    """The LMDB-flip child's loop: for each (offset, bit), a fresh copy of ``fixture`` with that bit
    of ``data_file`` flipped, judged by ``judge(copy, offset, bit)`` -> (outcome, violation); a typed
    error is an outcome of its own, a foreign one a violation. One JSON line when a case starts
    and one when it is done, so the parent can tell which case a crash happened in."""
    for number, (offset, bit) in enumerate(cases):
        print(json.dumps({"start": number}), flush=True)
        target = os.path.join(work, f"case-{number}")
        shutil.rmtree(target, ignore_errors=True)  # left by a child that died on a case
        shutil.copytree(fixture, target, ignore=shutil.ignore_patterns(*ignore))
        _mutate_file(os.path.join(target, data_file), offset, lambda content, at: content.__setitem__(at, content[at] ^ (1 << bit)))
        try:
            outcome, violation = judge(target, offset, bit)
        except MwpError as exc:
            outcome, violation = f"typed_error:{exc.code}", ""
        except Exception as exc:
            outcome, violation = "foreign", f"LMDB flip at {offset} bit {bit}: {_describe(exc)}"
        shutil.rmtree(target, ignore_errors=True)
        print(json.dumps({"done": number, "offset": offset, "outcome": outcome, "violation": violation}), flush=True)


def corruption_lmdb_child(argv: list[str]) -> None:
    """Check LMDB bit flips in isolation (a damaged B-tree may take the process down):
    ``FIXTURE_STORE WORK_DIR CASES_JSON ORACLE_JSON BOOT``; prints one JSON line per case."""
    from .authority import Authority

    fixture_store, work, cases_path, oracle_path, boot = argv
    with open(cases_path) as handle:
        cases = json.load(handle)
    with open(oracle_path) as handle:
        saved = json.load(handle)
    oracle = Acknowledged(receipts={key: tuple(value) for key, value in saved["receipts"].items()},
                          snapshots={tuple(item) for item in saved["snapshots"]})

    def judge(target: str, offset: int, bit: int) -> tuple[str, str]:
        with _boot_id(boot), Authority.open(target) as authority:
            mode = authority.open_report.mode
            problems = check_authority(authority, oracle, full_verify=False)
            report = authority.verify()
            if mode == "rebuild":
                if problems or not report.ok:
                    return "rebuilt_at_open", f"rebuilt index is wrong: {(problems + report.problems)[:2]}"
                return "rebuilt_at_open", ""
            if not problems:
                # no_effect: the flip hit a byte no answer depends on
                return ("no_effect" if report.ok else "found_by_verify"), ""
            if not report.ok:
                # Reads answered wrongly without an error; only verify() noticed. Counted.
                violation = f"reads served wrong data after an LMDB flip at {offset} until verify(): {problems[:2]}"
                authority.rebuild()
                if check_authority(authority, oracle, full_verify=True):
                    violation += "; and rebuild() did not restore it"
                return "wrong_reads_until_verify", violation
            return "wrong", f"silently wrong data after an LMDB flip at {offset}: {problems[:2]}"

    _flip_cases(cases, fixture_store, work, os.path.join("index", "data.mdb"), ("LOCK", "lock.mdb"), judge)


def corruption_agent_lmdb_child(argv: list[str]) -> None:
    """Check bit flips in an AgentStore's LMDB file in isolation: ``FIXTURE_AGENT WORK_DIR
    CASES_JSON EXPECTED_JSON``; prints one JSON line per case. Each damaged copy answers every read
    as the undamaged store does; then it takes ``_agent_flip_write`` and answers as the undamaged
    store did after it, also once reopened, or refuses the write with ``CORRUPTION`` (any other
    error there is a violation: damage is named as damage)."""
    from .agent_store import AgentStore

    fixture_agent, work, cases_path, expected_path = argv
    with open(cases_path) as handle:
        cases = json.load(handle)
    with open(expected_path) as handle:
        expected = json.load(handle)

    def judge(target: str, offset: int, bit: int) -> tuple[str, str]:
        flip = f"an AgentStore with a flipped bit at {offset} (bit {bit})"
        with AgentStore.open(target, projections=[CountingProjection()], clock=_agent_flip_clock) as agent:
            if agent_answers(agent) != expected["read"]:
                return "wrong", f"{flip} answered differently without an error"
            try:
                _agent_flip_write(agent)
            except MwpError as exc:
                if exc.code == "CORRUPTION":
                    return "write_refused:CORRUPTION", ""
                return "write_refused_untyped", f"{flip} refused the write with {exc.code}, not CORRUPTION: {_describe(exc)}"
            if agent_answers(agent) != expected["written"]:
                return "wrong", f"{flip} answered differently after the write without an error"
        with AgentStore.open(target, projections=[CountingProjection()], clock=_agent_flip_clock) as agent:
            if agent_answers(agent) != expected["written"]:
                return "wrong", f"{flip} answered differently once reopened after the write, without an error"
        return "no_effect", ""

    _flip_cases(cases, fixture_agent, work, os.path.join("lmdb", "data.mdb"), ("lock.mdb", "agent.lock"), judge)


def _lmdb_used_bytes(directory: str) -> int:
    """Bytes of an LMDB data file up to its last used page: flips go where the data is, not into
    whatever unused space the file may have after it."""
    import lmdb

    env = lmdb.open(directory, readonly=True, lock=False, max_dbs=32)
    try:
        return int((env.info()["last_pgno"] + 1) * env.stat()["psize"])
    finally:
        env.close()


def _run_lmdb_batch(fixture: _Fixture, cases: list[tuple[int, int]], work: str, *, agent: bool = False) -> list[tuple[str, str]]:
    """Run LMDB flip cases (the authority's index, or with ``agent`` the AgentStore's file) in a
    child; a child that dies on a case counts that case as a crash."""
    oracle_path = os.path.join(work, "oracle.json")
    with open(oracle_path, "w") as handle:
        if agent:
            json.dump({"read": fixture.agent_dump, "written": fixture.agent_dump_written}, handle)
        else:
            json.dump({"receipts": fixture.oracle.receipts, "snapshots": sorted(fixture.oracle.snapshots)}, handle)
    outcomes: list[tuple[str, str]] = []
    remaining = list(cases)
    while remaining:
        cases_path = os.path.join(work, "cases.json")
        with open(cases_path, "w") as handle:
            json.dump(remaining, handle)
        if agent:
            command = _python_command("corruption_agent_lmdb_child", fixture.agent, work, cases_path, oracle_path)
        else:
            command = _python_command("corruption_lmdb_child", fixture.store, work, cases_path, oracle_path, fixture.boot)
        child = subprocess.run(command, capture_output=True, text=True, timeout=600)
        done = 0
        for line in child.stdout.splitlines():
            item = json.loads(line)
            if "done" in item:
                outcomes.append((item["outcome"], item["violation"]))
                done += 1
        if done < len(remaining):  # the child died inside case `done`
            offset, bit = remaining[done]
            outcomes.append(("interpreter_crash", f"LMDB flip at {offset} bit {bit} killed the process "
                                                  f"(exit {child.returncode}): {child.stderr[-800:]}"))
            done += 1
        remaining = remaining[done:]
    return outcomes


def run_corruption(count: int | None = None, seconds: float | None = None, seed: int = 1,
                   progress: Progress | None = None, *, families: tuple[str, ...] = CORRUPTION_FAMILIES) -> dict[str, Any]:
    """Damage copies of a store, one case at a time, round-robin over the families."""
    schedule = [family for family in CORRUPTION_SCHEDULE if family in families]
    if not schedule:
        raise ValueError(f"no corruption family among {families}")
    started = time.monotonic()
    budget = Budget(count, seconds, DEFAULT_COUNTS["corruption"])
    rng = random.Random(seed)
    findings = Findings()
    outcomes: dict[str, dict[str, int]] = {family: {} for family in CORRUPTION_FAMILIES if family in families}
    sweep: dict[str, list[int]] = {}
    cases = 0
    with _scratch("corruption") as root:
        fixture = _build_fixture(root, rng)
        tail_bytes = fixture.tail_region[1] - fixture.tail_region[0]
        turn = 0
        while budget.more(cases):
            family = schedule[turn % len(schedule)]
            turn += 1
            work = os.path.join(root, f"case-{turn}")
            os.makedirs(work)
            try:
                if family in ("lmdb_flip", "agent_lmdb_flip"):
                    agent = family == "agent_lmdb_flip"
                    data = os.path.join(fixture.agent, "lmdb") if agent else os.path.join(fixture.store, "index")
                    size = _lmdb_used_bytes(data)
                    batch = [(rng.randrange(size), rng.randrange(8)) for _ in range(LMDB_BATCH)]
                    results = _run_lmdb_batch(fixture, batch, work, agent=agent)
                elif family.startswith("tail_"):
                    results = []
                    for number in range(TAIL_OFFSETS_PER_TURN):
                        case_dir = os.path.join(work, str(number))
                        os.makedirs(case_dir)
                        results.append(_corruption_case(family, fixture, rng, case_dir, sweep))
                        shutil.rmtree(case_dir, ignore_errors=True)
                else:
                    results = [_corruption_case(family, fixture, rng, work, sweep)]
            except Exception as exc:
                results = [("foreign", f"harness error: {_describe(exc)}\n{traceback.format_exc()[-1200:]}")]
            for outcome, violation in results:
                cases += 1
                outcomes[family][outcome] = outcomes[family].get(outcome, 0) + 1
                if violation:
                    findings.add(f"{family} (seed {seed}): {violation}")
            shutil.rmtree(work, ignore_errors=True)
            budget.report(cases, progress)
    swept = {family: min(sum(outcomes[family].values()), tail_bytes) for family in ("tail_cut", "tail_zero", "tail_garble", "tail_flip") if family in outcomes}
    return _result("corruption", seed, cases, started, findings, {
        "cases": cases,
        "outcomes": outcomes,
        "tail_sweep_bytes": tail_bytes,
        "tail_offsets_covered": swept,
        "segments": len(fixture.segments),
        "records": len(fixture.records),
    })



# -- lmdb-sweep: every byte of every used page of two small LMDB files, damaged ----------------------
#
# The corruption suite's LMDB families flip random bits; this suite flips every byte of every page
# LMDB can reach in two small, deterministic stores (an AgentStore and an authority's index), or
# damages each such page whole (zeros, garbage, another page's bytes, an older image's page), and
# for each damaged copy runs the whole read surface and a set of writes, with the open's structural
# check on and off. Each answer must equal the undamaged store's (after the same writes) or be a
# typed error (``MwpError``); anything else is a violation naming the file, offset and bit (or
# page, its role and the damage) and call.

SWEEP_STORES = ("agent", "index")
SWEEP_CHECKS = (True, False)
SWEEP_DAMAGES = ("bits", "pages")
"""What a case damages: one bit of one byte (``bits``), or one whole page (``pages``)."""
SWEEP_PAGE_DAMAGES = ("zero", "garble", "other", "stale")
"""How a page is damaged: read back as zeros, as seeded garbage, as another used page of the file (a
misdirected write), or as the same page of an older image of the file (a lost write)."""
SWEEP_IMAGES = ("early", "middle")
"""The older images of each swept file the fixture builders keep: after an early commit and after
a middle one."""
SWEEP_TIMEOUT_S = 60
"""A case (one damaged copy, both checks) that runs longer than this is a hang."""
SWEEP_CHUNK = 60
"""Cases per child process."""
SWEEP_AGENT_ID = "w1"
SWEEP_NOW_MS = 2_000_000
_SWEEP_KEY = bytes(range(1, 33))
"""The Ed25519 seed of the swept AgentStore's member (fixed: the fixture is the same every run)."""


def _sweep_clock() -> int:
    return SWEEP_NOW_MS


def _sweep_clock_back() -> int:
    """The swept index's clock after its fixture was written: gone back, so that an Event accepted
    on a copy that lost its ``last_ms`` is stamped earlier than the undamaged store stamps it."""
    return SWEEP_NOW_MS - 1000


def _sweep_groups() -> dict[str, Any]:
    """The swept AgentStore's three Groups, made by the work-model rules in memory (no disk, no
    randomness): g-1 with a started WorkItem held by w1 (leased, for the offline guard), g-2 with a
    gap (its last Event arrives first and is buffered), g-3 small (pruned, reset and rebuilt)."""
    import msgspec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from .messages import Command, command_bytes
    from .registry import MemoryGroup, aggregate_key, kind_spec

    key = Ed25519PrivateKey.from_private_bytes(_SWEEP_KEY)
    public = key.public_key().public_bytes_raw().hex()
    contract = {"max_attempts": 3, "backoff_initial_ms": 100, "backoff_multiplier": 2, "backoff_max_ms": 1_000,
                "cost_limit": 50, "deadline_ms": None, "lease_ms": 600_000, "start_ms": 200_000}
    groups: dict[str, Any] = {}
    for name in ("g-1", "g-2", "g-3"):
        group = MemoryGroup(name)
        actions = iter(range(1, 1000))

        def accept(actor: str, kind: str, target: str, body: dict[str, Any], *, cas: bool = False) -> None:
            revision = group.revision(aggregate_key(kind_spec(kind).aggregate_type, target)) if cas else None
            command = Command(actor=actor, action_id=f"{name}-a{next(actions)}", group=name, kind=kind, target=target,
                              body=body, expected_revision=revision)
            if actor == SWEEP_AGENT_ID:
                command = msgspec.structs.replace(command, signature=key.sign(command_bytes(command)))
            group.accept(command, now_ms=SWEEP_NOW_MS - 1000 + len(group.events))

        accept(OWNER, "group.create", name, {"org": ORG})
        if name == "g-3":
            accept(OWNER, "mission.create", "m-3", {"title": "three", "cost_limit": 10, "approval_required": []})
        else:
            accept(OWNER, "membership.add", SWEEP_AGENT_ID, {"role": "worker", "public_key": public}, cas=True)
            accept(OWNER, "mission.create", "m1", {"title": "one", "cost_limit": 1_000, "approval_required": []})
            for workitem, priority in (("wi1", 0), ("wi2", 5)):
                accept(OWNER, "workitem.create", workitem, {"mission": "m1", "priority": priority, "contract": contract})
            if name == "g-1":
                member = group.get(f"member:{SWEEP_AGENT_ID}")
                assert member is not None
                accept(SWEEP_AGENT_ID, "workitem.claim", "wi1", {"session_epoch": member["session_epoch"]}, cas=True)
                item = group.get("workitem:wi1")
                assert item is not None
                lease = item["lease"]
                accept(SWEEP_AGENT_ID, "workitem.start", "wi1",
                       {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]})
            else:
                accept(OWNER, "mission.update", "m1", {"title": "one, renamed"}, cas=True)
        groups[name] = group
    groups["key"] = key
    return groups


def _sweep_build_agent(path: str, images: str | None = None) -> None:
    """The swept AgentStore: states of 3 Groups, a work queue, inbox entries (g-3's pruned), a
    buffered Event (g-2's last, before the one before it), two outbox intents (one with a receipt)
    and an OfflineGuard's outage and buffered Command (g-1). ``images``: a directory that gets
    copies of ``data.mdb`` after an early commit and a middle one (:data:`SWEEP_IMAGES`)."""
    import msgspec

    from .agent_store import AgentStore
    from .messages import Command, command_bytes
    from .offline import OfflineGuard

    groups = _sweep_groups()
    with AgentStore.open(path, projections=[CountingProjection()], clock=_sweep_clock) as agent:
        with agent.begin() as tx:
            for name in ("g-1", "g-3"):
                for event in groups[name].events:
                    tx.apply(event)
                tx.advance_cursor(name)
            events = groups["g-2"].events
            for event in events[:-2]:
                tx.apply(event)
            tx.advance_cursor("g-2")
            tx.apply(events[-1])  # out of order: buffered until events[-2] arrives
            tx.record_intent("g-1", mission="m1", workitem="wi1", ownership_epoch=1, operation="notify",
                             request={"to": "ops"})
            tx.record_intent("g-2", mission="m1", workitem="wi2", ownership_epoch=1, operation="bill")
        _sweep_keep_image(images, "early", os.path.join(path, _sweep_data_file("agent")))
        agent.prune_inbox("g-3")
        agent.record_receipt(agent.intents("g-2")[0].key, {"id": "r-1"})
        _sweep_keep_image(images, "middle", os.path.join(path, _sweep_data_file("agent")))
        guard = OfflineGuard(agent, "g-1", SWEEP_AGENT_ID, grace_ms=60_000)
        guard.service_unreachable(SWEEP_NOW_MS)
        lease = groups["g-1"].get("workitem:wi1")["lease"]
        command = Command(actor=SWEEP_AGENT_ID, action_id="offline-1", group="g-1", kind="workitem.checkpoint",
                          target="wi1", body={"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"],
                                              "checkpoint": {"step": 1}})
        command = msgspec.structs.replace(command, signature=groups["key"].sign(command_bytes(command)))
        guard.buffer(command, now_ms=SWEEP_NOW_MS + 1, reversible=True)


def _sweep_agent_reads(agent: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Every read of the AgentStore's API over every Group and key the fixture holds (and one of
    each that it does not)."""
    from functools import partial

    from .offline import OfflineGuard

    calls: list[tuple[str, Callable[[], Any]]] = [("groups", agent.groups)]
    for group in ("g-1", "g-2", "g-3", "g-9"):
        guard = OfflineGuard(agent, group, SWEEP_AGENT_ID, grace_ms=60_000)
        calls += [
            (f"head {group}", partial(agent.head, group)),
            (f"cursor {group}", partial(agent.cursor, group)),
            (f"ack_position {group}", partial(agent.ack_position, group)),
            (f"states {group}", partial(agent.states, group)),
            (f"inbox_seqs {group}", partial(agent.inbox_seqs, group)),
            (f"buffered_seqs {group}", partial(agent.buffered_seqs, group)),
            (f"work_queue {group}", partial(agent.work_queue, group, 2**62)),
            (f"work_queue {group} limit 1", partial(agent.work_queue, group, 2**62, limit=1)),
            (f"projection_items {group}", partial(agent.projection_items, group, CountingProjection.name)),
            (f"projection_dump {group}", partial(agent.projection_dump, group)),
            (f"projection_digest {group}", partial(agent.projection_digest, group)),
            (f"intents {group}", partial(agent.intents, group)),
            (f"outage {group}", guard.outage),
            (f"buffered {group}", guard.buffered),
        ]
        for key in ("group:" + group, f"member:{SWEEP_AGENT_ID}", "mission:m1", "mission:m-3", "workitem:wi1",
                    "workitem:wi2", "workitem:wi9"):
            calls.append((f"aggregate {group} {key}", partial(agent.aggregate, group, key)))
        for workitem in ("wi1", "wi2"):
            calls.append((f"checkpoint {group} {workitem}", partial(agent.checkpoint, group, workitem)))
        for seq in (1, 3, 99):
            key = f"seen:{seq:012d}"
            calls.append((f"projection_get {group} {key}", partial(agent.projection_get, group, CountingProjection.name, key)))
    calls += [
        ("intents", agent.intents),
        ("intents pending", partial(agent.intents, pending_only=True)),
        ("projection_dump", agent.projection_dump),
        ("projection_digest", agent.projection_digest),
    ]
    return calls


def _sweep_agent_writes(agent: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The writes run on each damaged AgentStore, in order, each followed by every read."""
    from .offline import OfflineGuard

    groups = _sweep_groups()
    g2 = groups["g-2"].events
    intent_keys: dict[str, str] = {}

    def intent_key(group: str) -> str:
        # the key is computed, not read: a damaged outbox must not choose the key the write uses
        from .work_keys import external_idempotency_key

        mission, workitem, operation = {"g-1": ("m1", "wi1", "notify"), "g-2": ("m1", "wi2", "bill")}[group]
        return intent_keys.setdefault(group, external_idempotency_key(mission, workitem, 1, operation))

    def apply_next() -> Any:
        with agent.begin() as tx:
            status = tx.apply(g2[-2])
            cursor = tx.advance_cursor("g-2")
        return [status.name, cursor]

    def rebuild_g3() -> Any:
        with agent.begin() as tx:
            statuses = [tx.apply(event).name for event in groups["g-3"].events]
            cursor = tx.advance_cursor("g-3")
        return [statuses, cursor]

    def new_intent() -> Any:
        with agent.begin() as tx:
            return tx.record_intent("g-3", mission="m-3", workitem="wi3", ownership_epoch=1, operation="page")

    return [
        ("apply the next Event of g-2", apply_next),
        # two writes, each one transaction: a write the judge finds refused must have changed nothing
        ("reset_group g-3", lambda: agent.reset_group("g-3")),
        ("rebuild g-3", rebuild_g3),
        ("prune_inbox g-1", lambda: agent.prune_inbox("g-1")),
        ("prune_inbox g-2", lambda: agent.prune_inbox("g-2")),
        ("mark_dispatched g-1", lambda: agent.mark_dispatched(intent_key("g-1"))),
        ("record_receipt g-1", lambda: agent.record_receipt(intent_key("g-1"), {"id": "r-2"})),
        ("record_intent g-3", new_intent),
        ("service_unreachable g-2", lambda: OfflineGuard(agent, "g-2", SWEEP_AGENT_ID, grace_ms=1).service_unreachable(SWEEP_NOW_MS)),
        ("reset_group g-1", lambda: agent.reset_group("g-1")),
    ]


def _sweep_build_index(root: str, images: str | None = None) -> None:
    """The swept authority: three Groups of a few Missions each, receipts, ACKs of two consumers.
    ``images`` as for :func:`_sweep_build_agent`."""
    from .authority import Authority

    with Authority.open(os.path.join(root, "store"), clock=_sweep_clock) as authority:
        data = os.path.join(root, _sweep_data_file("index"))
        for group in ("g-1", "g-2", "g-3"):
            authority.accept(group_create_command(group))
        _sweep_keep_image(images, "early", data)
        for number in range(3):
            for group in ("g-1", "g-2"):
                authority.accept(_mission_create(group, f"m-{number}", f"{group}-m{number}"))
        _sweep_keep_image(images, "middle", data)
        authority.accept(_mission_update("g-1", "m-0", 1, "renamed", "g-1-u0"))
        authority.ack("c-1", "g-1", 3)
        authority.ack("c-1", "g-2", 2)
        authority.ack("c-2", "g-1", 1)


def _sweep_index_reads(authority: Any) -> list[tuple[str, Callable[[], Any]]]:
    from functools import partial

    def events(group: str, after: int = 0, limit: int = 1000) -> list[str]:
        return [repr(event) for event in authority.read(group, after=after, limit=limit)]

    calls: list[tuple[str, Callable[[], Any]]] = [("groups", authority.groups)]
    for group in ("g-1", "g-2", "g-3", "g-9"):
        calls += [
            (f"head {group}", partial(authority.head, group)),
            (f"read {group}", partial(events, group)),
            (f"read {group} after 2", partial(events, group, 2, 2)),
            (f"aggregates {group}", partial(authority.aggregates, group)),
            (f"aggregates {group} mission", partial(authority.aggregates, group, prefix="mission:")),
            (f"replay_floor {group}", partial(authority.replay_floor, group)),
        ]
        for key in ("group:" + group, "mission:m-0", "mission:m-2", "mission:m-9"):
            calls.append((f"state {group} {key}", partial(authority.state, group, key)))
        for consumer in ("c-1", "c-2", "c-9"):
            calls.append((f"acked {consumer} {group}", partial(authority.acked, consumer, group)))
    return calls


def _sweep_index_writes(authority: Any) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("accept a duplicate", lambda: authority.accept(_mission_create("g-1", "m-1", "g-1-m1"))),
        ("accept a duplicate of an update", lambda: authority.accept(_mission_update("g-1", "m-0", 1, "renamed", "g-1-u0"))),
        ("accept a new Command", lambda: authority.accept(_mission_create("g-2", "m-7", "g-2-m7"))),
        ("accept a compare-and-set", lambda: authority.accept(_mission_update("g-2", "m-1", 1, "again", "g-2-u1"))),
        ("ack c-1 g-1", lambda: authority.ack("c-1", "g-1", 4)),
        ("ack c-2 g-2", lambda: authority.ack("c-2", "g-2", 1)),
        ("ack c-1 g-2 backwards", lambda: authority.ack("c-1", "g-2", 1)),
    ]


def _sweep_answer(call: Callable[[], Any]) -> tuple[str, str]:
    """(kind, text) of one call: ("ok", its answer), ("typed", the error code) or ("foreign", the
    error). A typed error's message is not compared: damage may word it any way."""
    try:
        value = call()
    except MwpError as exc:
        return "typed", exc.code
    except Exception as exc:
        return "foreign", _describe(exc)
    return "ok", json.dumps(value, sort_keys=True, default=repr)


@contextlib.contextmanager
def _sweep_open(kind: str, directory: str, check: bool) -> Iterator[Any]:
    if kind == "agent":
        from .agent_store import AgentStore

        with AgentStore.open(directory, projections=[CountingProjection()], clock=_sweep_clock, check_lmdb=check) as agent:
            yield agent
    else:
        from .authority import Authority

        with _boot_id("lmdb-sweep"), Authority.open(os.path.join(directory, "store"), clock=_sweep_clock_back,
                                                   check_lmdb=check) as authority:
            yield authority


def _sweep_session(kind: str, directory: str, check: bool, skip: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Open the store at ``directory``, read everything, then run each write (but those in
    ``skip``, whose reads are taken to be the reads before them), reading everything after each:
    {"open": answer, "reads": [[(name, answer)...] before and after each write], "writes": [(name,
    answer)], "applied": indexes of the writes that succeeded}."""
    reads_of = _sweep_agent_reads if kind == "agent" else _sweep_index_reads
    writes_of = _sweep_agent_writes if kind == "agent" else _sweep_index_writes
    session: dict[str, Any] = {"open": ("ok", ""), "reads": [], "writes": [], "applied": []}
    try:
        with _sweep_open(kind, directory, check) as store:
            if kind == "index" and store.open_report.mode == "rebuild":
                session["rebuilt"] = store.open_report.reason  # the open found the damage: allowed
            reads = reads_of(store)
            session["reads"].append([(name, _sweep_answer(call)) for name, call in reads])
            for number, (name, write) in enumerate(writes_of(store)):
                if number in skip:  # refused on the damaged copy: nothing may have changed
                    session["writes"].append((name, ("skipped", "")))
                    session["reads"].append(session["reads"][-1])
                    continue
                answer = _sweep_answer(write)
                session["writes"].append((name, answer))
                if answer[0] == "ok":
                    session["applied"].append(number)
                session["reads"].append([(read_name, _sweep_answer(call)) for read_name, call in reads])
    except MwpError as exc:
        session["open"] = ("typed", exc.code)
    except Exception as exc:
        session["open"] = ("foreign", _describe(exc))
    return session


class _SweepOracle:
    """The undamaged store's sessions, one for each set of writes that a damaged copy let through
    (a write refused with a typed error is skipped in the oracle's session), made on demand."""

    def __init__(self, kind: str, fixture: str, work: str) -> None:
        self.kind = kind
        self.fixture = fixture
        self.work = work
        self.sessions: dict[frozenset[int], dict[str, Any]] = {}
        self.writes = len((_sweep_agent_writes if kind == "agent" else _sweep_index_writes)(None))

    def session(self, skip: frozenset[int]) -> dict[str, Any]:
        if skip not in self.sessions:
            target = os.path.join(self.work, "oracle")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(self.fixture, target, ignore=shutil.ignore_patterns(*_SWEEP_IGNORE))
            self.sessions[skip] = _sweep_session(self.kind, target, True, skip)
            shutil.rmtree(target, ignore_errors=True)
        return self.sessions[skip]


_SWEEP_IGNORE = ("lock.mdb", "agent.lock", "LOCK")


def _sweep_judge(session: dict[str, Any], oracle: _SweepOracle) -> list[str]:
    """The violations of one damaged session against the oracle's session of the same writes."""
    if session["open"][0] == "foreign":
        return [f"open: {session['open'][1]}"]
    if session["open"][0] == "typed":
        return []
    skip = frozenset(range(oracle.writes)) - frozenset(session["applied"])
    expected = oracle.session(skip)
    problems: list[str] = []
    after = "before any write"
    for step, reads in enumerate(session["reads"]):
        if step:
            name, answer = session["writes"][step - 1]
            after = f"after {name!r}"
            want = expected["writes"][step - 1][1]
            if answer[0] == "foreign":
                problems.append(f"write {name!r}: {answer[1]}")
            elif answer[0] == "ok" and tuple(answer) != tuple(want):
                problems.append(f"write {name!r} answered {answer[1][:300]}, not {want[1][:300]}")
        for (name, answer), (_, want) in zip(reads, expected["reads"][step]):
            if answer[0] == "foreign":
                problems.append(f"{name} ({after}): {answer[1]}")
            elif answer[0] == "ok" and tuple(answer) != tuple(want):
                problems.append(f"{name} ({after}) answered {answer[1][:300]}, not {want[1][:300]}")
    return problems


def lmdb_roots(data: bytes) -> tuple[int, dict[str, int]]:
    """An LMDB data file's page size and the root page of each of its trees as the newer meta page
    names them: ``free``, ``main`` and every named database (its record in the main tree, found by
    walking that tree); an empty tree's root is 2**64 - 1. The meta page (LMDB 0.9, 64-bit): a
    16-byte page header, then magic u32, version u32, address u64, map size u64, two MDB_db records
    of 48 bytes (free list, main; the root is at 40), last page u64, txn id u64; the free list's
    record's md_pad holds the page size."""
    page_size = struct.unpack_from("<I", data, 16 + 24)[0]
    metas = [struct.unpack_from("<Q", data, page * page_size + 16 + 128)[0] for page in (0, 1)]
    base = (0 if metas[0] >= metas[1] else 1) * page_size + 16 + 24
    roots = {"free": struct.unpack_from("<Q", data, base + 40)[0], "main": struct.unpack_from("<Q", data, base + 48 + 40)[0]}
    pending, seen = [roots["main"]], set()
    while pending:
        page = pending.pop()
        if page == 0xFFFFFFFFFFFFFFFF or page in seen or (page + 1) * page_size > len(data):
            continue
        seen.add(page)
        at = page * page_size
        flags, lower = struct.unpack_from("<HH", data, at + 10)
        for pointer in range(16, lower, 2):
            node = at + struct.unpack_from("<H", data, at + pointer)[0]
            lo, hi, node_flags, key_size = struct.unpack_from("<HHHH", data, node)
            if flags & 0x01:
                pending.append(lo | hi << 16 | node_flags << 32)
            elif node_flags & 0x02:  # a named database's record
                name = data[node + 8:node + 8 + key_size].decode("ascii", "replace")
                roots[name] = struct.unpack_from("<Q", data, node + 8 + key_size + 40)[0]
    return page_size, roots


def lmdb_byte_roles(path: str) -> list[tuple[int, int, str]]:
    """The byte spans of an LMDB data file that LMDB reads, each with its role: ``meta`` (both meta
    pages' headers and metas), ``header`` (a page's 16-byte header), ``offsets`` (its node
    offsets), ``node`` (a node's 8-byte header), ``key``, ``value`` (inline, or a branch node's
    child page number: ``node``), ``overflow`` (pages of a value stored apart); every page
    reachable from the newer meta (the free list's tree, the main tree, each named database's
    tree), without the free gap inside each page (between its offsets and its nodes, which LMDB
    never reads). Sorted (start, end, role)."""
    with open(path, "rb") as handle:
        data = handle.read()
    meta_bytes = 16 + 136  # a meta page's header and meta (see lmdb_roots)
    page_size, trees = lmdb_roots(data)
    spans = [(0, meta_bytes, "meta"), (page_size, page_size + meta_bytes, "meta")]
    roots = [trees["free"], trees["main"]]
    named: list[int] = []
    seen: set[int] = set()

    def walk(page: int, main: bool) -> None:
        if page == 0xFFFFFFFFFFFFFFFF or page in seen or (page + 1) * page_size > len(data):
            return
        seen.add(page)
        at = page * page_size
        flags, lower, upper = struct.unpack_from("<HHH", data, at + 10)
        if flags & 0x04:  # an overflow page on its own: covered by the leaf that points at it
            return
        spans.append((at, at + 16, "header"))
        spans.append((at + 16, at + lower, "offsets"))
        for pointer in range(16, lower, 2):
            node = at + struct.unpack_from("<H", data, at + pointer)[0]
            lo, hi, node_flags, key_size = struct.unpack_from("<HHHH", data, node)
            spans.append((node, node + 8, "node"))
            spans.append((node + 8, node + 8 + key_size, "key"))
            if flags & 0x01:  # branch: the child's page number is in lo, hi and flags
                walk(lo | hi << 16 | node_flags << 32, main)
            elif node_flags & 0x01:  # a value in overflow pages
                spans.append((node + 8 + key_size, node + 8 + key_size + 8, "value"))
                first = struct.unpack_from("<Q", data, node + 8 + key_size)[0]
                pages = struct.unpack_from("<I", data, first * page_size + 12)[0]
                spans.append((first * page_size, (first + pages) * page_size, "overflow"))
            else:
                size = lo | hi << 16
                spans.append((node + 8 + key_size, node + 8 + key_size + size, "value"))
                if main and node_flags & 0x02:  # a named database's record: its root is its last field
                    named.append(struct.unpack_from("<Q", data, node + 8 + key_size + 40)[0])
        # the node area from upper to the page's end, padding between nodes included
        covered = sorted((start, end) for start, end, _ in spans if at + upper <= start < at + page_size)
        mark = at + upper
        for start, end in covered:
            if start > mark:
                spans.append((mark, start, "node"))
            mark = max(mark, end)
        if mark < at + page_size:
            spans.append((mark, at + page_size, "node"))

    walk(roots[0], False)
    walk(roots[1], True)
    for root in named:
        walk(root, False)
    return sorted(span for span in spans if span[1] > span[0])


def lmdb_page_spans(path: str) -> list[tuple[int, int]]:
    """The byte spans of :func:`lmdb_byte_roles`, merged: sorted (start, end) pairs."""
    merged: list[tuple[int, int]] = []
    for start, end, _ in lmdb_byte_roles(path):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def sweep_cases(kind: str, fixture: str, bits: str = "all") -> list[tuple[int, int]]:
    """Every (offset, bit) the sweep flips in ``kind``'s data file: every byte of
    :func:`lmdb_page_spans`, each of its 8 bits (``bits="all"``) or one bit per byte, rotating
    with the offset (``bits="rotating"``)."""
    spans = lmdb_page_spans(os.path.join(fixture, _sweep_data_file(kind)))
    offsets = [offset for start, end in spans for offset in range(start, end)]
    if bits == "all":
        return [(offset, bit) for offset in offsets for bit in range(8)]
    return [(offset, offset % 8) for offset in offsets]


def _sweep_data_file(kind: str) -> str:
    return os.path.join("lmdb", "data.mdb") if kind == "agent" else os.path.join("store", "index", "data.mdb")


def _sweep_images(fixture: str) -> str:
    """Where the older images of ``fixture``'s data file are kept (beside it, not copied with it)."""
    return fixture + "-images"


def _sweep_keep_image(images: str | None, name: str, data: str) -> None:
    if images is not None:
        os.makedirs(images, exist_ok=True)
        shutil.copyfile(data, os.path.join(images, name + ".mdb"))


def lmdb_page_roles(path: str) -> dict[int, str]:
    """Each page of :func:`lmdb_byte_roles` with its role: ``meta``, or the tree it belongs to
    (``free``, ``main`` or the named database's name) and its kind (``branch``, ``leaf``,
    ``overflow``), e.g. ``"states leaf"``."""
    with open(path, "rb") as handle:
        data = handle.read()
    page_size, roots = lmdb_roots(data)
    roles = {0: "meta", 1: "meta"}

    def walk(page: int, tree: str) -> None:
        if page == 0xFFFFFFFFFFFFFFFF or page in roles or (page + 1) * page_size > len(data):
            return
        at = page * page_size
        flags, lower = struct.unpack_from("<HH", data, at + 10)
        roles[page] = f"{tree} {'branch' if flags & 0x01 else 'leaf'}"
        for pointer in range(16, lower, 2):
            node = at + struct.unpack_from("<H", data, at + pointer)[0]
            lo, hi, node_flags, key_size = struct.unpack_from("<HHHH", data, node)
            if flags & 0x01:
                walk(lo | hi << 16 | node_flags << 32, tree)
            elif node_flags & 0x01:  # a value in overflow pages
                first = struct.unpack_from("<Q", data, node + 8 + key_size)[0]
                count = struct.unpack_from("<I", data, first * page_size + 12)[0]
                for number in range(first, first + count):
                    roles[number] = f"{tree} overflow"

    for tree, root in roots.items():  # free, main, then the named databases
        walk(root, tree)
    return dict(sorted(roles.items()))


def sweep_page_cases(kind: str, fixture: str) -> list[tuple[int, str]]:
    """Every (page, damage) the page sweep makes of ``kind``'s data file, over every page of
    :func:`lmdb_page_roles`: ``zero``, ``garble``, ``other N`` (page N's bytes: the next used page,
    and the first used page after it of another tree, of the same kind where there is one) and
    ``stale IMAGE`` (the page's bytes in an older image, :data:`SWEEP_IMAGES`, where the page
    existed then and differs)."""
    path = os.path.join(fixture, _sweep_data_file(kind))
    roles = lmdb_page_roles(path)
    with open(path, "rb") as handle:
        data = handle.read()
    page_size = struct.unpack_from("<I", data, 16 + 24)[0]
    used = list(roles)
    images: dict[str, bytes] = {}
    for name in SWEEP_IMAGES:
        image_path = os.path.join(_sweep_images(fixture), name + ".mdb")
        if os.path.exists(image_path):
            with open(image_path, "rb") as handle:
                images[name] = handle.read()
    cases: list[tuple[int, str]] = []
    for at, page in enumerate(used):
        cases += [(page, "zero"), (page, "garble")]
        after = used[at + 1:] + used[:at]
        sources = [after[0]]
        tree, _, kind_of_page = roles[page].partition(" ")
        if roles[page] != "meta":  # a meta page's role is "meta" alone; the AgentStore's database `meta` has "meta leaf"
            others = [number for number in after if roles[number] != "meta" and roles[number].partition(" ")[0] != tree]
            alike = [number for number in others if roles[number].partition(" ")[2] == kind_of_page]
            if alike or others:
                sources.append((alike or others)[0])
        cases += [(page, f"other {source}") for source in dict.fromkeys(sources)]
        current = data[page * page_size:(page + 1) * page_size]
        for name, image in images.items():
            old = image[page * page_size:(page + 1) * page_size]
            if len(old) == page_size and old != current:
                cases.append((page, f"stale {name}"))
    return cases


def _sweep_damage_page(path: str, fixture: str, page: int, damage: str) -> None:
    """Damage one page of the data file at ``path`` (a copy of ``fixture``'s) as ``damage`` says."""
    with open(path, "r+b") as handle:
        content = bytearray(handle.read())
        page_size = struct.unpack_from("<I", content, 16 + 24)[0]
        how, _, argument = damage.partition(" ")
        if how == "zero":
            replacement = bytes(page_size)
        elif how == "garble":
            replacement = random.Random(f"garble {page}").randbytes(page_size)
        elif how == "other":
            source = int(argument)
            replacement = bytes(content[source * page_size:(source + 1) * page_size])
        elif how == "stale":
            with open(os.path.join(_sweep_images(fixture), argument + ".mdb"), "rb") as image:
                image.seek(page * page_size)
                replacement = image.read(page_size)
        else:
            raise ValueError(f"unknown page damage {damage!r}")
        assert len(replacement) == page_size
        content[page * page_size:(page + 1) * page_size] = replacement
        handle.seek(0)
        handle.write(content)


def _flip_bit(content: bytearray, at: int, *, bit: int) -> None:
    content[at] ^= 1 << bit


def _sweep_case_fields(first: int, second: int | str) -> dict[str, Any]:
    """A case's fields in its record: ``offset`` and ``bit``, or ``page`` and ``damage``."""
    return {"page": first, "damage": second} if isinstance(second, str) else {"offset": first, "bit": second}


def _sweep_case_text(first: int, second: int | str) -> str:
    return f"page {first} {second}" if isinstance(second, str) else f"offset {first} bit {second}"


def lmdb_sweep_child(argv: list[str]) -> None:
    """Run sweep cases in isolation (a damaged B-tree may take the process down or hang it):
    ``KIND FIXTURE WORK_DIR CASES_JSON``, each case ``[offset, bit, check]`` or ``[page, damage,
    check]`` (:func:`sweep_page_cases`); one JSON line when a case starts and one when it ends."""
    kind, fixture, work, cases_path = argv
    with open(cases_path) as handle:
        cases = json.load(handle)
    oracle = _SweepOracle(kind, fixture, work)
    data_file = _sweep_data_file(kind)
    for number, (first, second, check) in enumerate(cases):
        print(json.dumps({"start": number}), flush=True)
        target = os.path.join(work, f"case-{number}")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(fixture, target, ignore=shutil.ignore_patterns(*_SWEEP_IGNORE))
        if isinstance(second, str):
            _sweep_damage_page(os.path.join(target, data_file), fixture, first, second)
        else:
            _mutate_file(os.path.join(target, data_file), first, functools.partial(_flip_bit, bit=second))
        session = _sweep_session(kind, target, check)
        shutil.rmtree(target, ignore_errors=True)
        found = _sweep_judge(session, oracle)
        label = "checked" if check else "unchecked"
        problems = [f"{kind} {data_file} {_sweep_case_text(first, second)} ({label} open): {problem}" for problem in found]
        if found:
            outcome = "violation"
        elif session["open"][0] == "typed":
            outcome = f"refused_at_open:{session['open'][1]}"
        elif "rebuilt" in session:
            outcome = "rebuilt_at_open"
        elif any(answer[0] == "typed" for reads in session["reads"] for _, answer in reads) or \
                any(answer[0] == "typed" for _, answer in session["writes"]):
            outcome = "typed_error"
        else:
            outcome = "no_effect"
        print(json.dumps({"done": number, **_sweep_case_fields(first, second), "check": check, "outcome": outcome,
                          "problems": problems}), flush=True)


def _sweep_chunk(kind: str, fixture: str, work: str, cases: list[tuple[int, int | str, bool]]) -> list[dict[str, Any]]:
    """Run ``cases`` in children, one after another: a child that dies or hangs on a case counts
    that case (``interpreter_crash`` / ``hang``) and the next child goes on after it."""
    results: list[dict[str, Any]] = []
    remaining = list(cases)
    os.makedirs(work, exist_ok=True)
    while remaining:
        cases_path = os.path.join(work, "cases.json")
        with open(cases_path, "w") as handle:
            json.dump(remaining, handle)
        command = _python_command("lmdb_sweep_child", kind, fixture, work, cases_path)
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S * len(remaining))
            stdout, stderr, died = child.stdout, child.stderr, f"exit {child.returncode}"
            outcome = "interpreter_crash"
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            died, outcome = "hung", "hang"
        done = 0
        for line in stdout.splitlines():
            item = json.loads(line)
            if "done" in item:
                results.append(item)
                done += 1
        if done < len(remaining):
            first, second, check = remaining[done]
            label = "checked" if check else "unchecked"
            results.append({**_sweep_case_fields(first, second), "check": check, "outcome": outcome,
                            "problems": [f"{kind} {_sweep_data_file(kind)} {_sweep_case_text(first, second)} ({label} open): "
                                         f"the process {died}: {stderr[-800:]}"]})
            done += 1
        remaining = remaining[done:]
    return results


def run_lmdb_sweep(count: int | None = None, seconds: float | None = None, seed: int = 1,
                   progress: Progress | None = None, *, stores: tuple[str, ...] = SWEEP_STORES, bits: str = "rotating",
                   offsets: list[int] | None = None, stride: int = 1, workers: int = 1,
                   record: str | None = None, damage: str = "bits", pages: list[int] | None = None) -> dict[str, Any]:
    """The exhaustive LMDB damage sweep (``docs/reliability.md``, "lmdb-sweep"): every byte of
    every used page of each store's data file, each bit (``bits``), in order; or with
    ``damage="pages"``, every used page, each damaged whole in each way of
    :func:`sweep_page_cases` (zeros, garbage, another page's bytes, an older image's). ``count`` or
    ``seconds`` stop it early (a slice; the cases are in order, ``seed`` is unused: the sweep is
    the same every run); ``offsets`` keeps only those byte offsets (``pages`` those page numbers),
    ``stride`` every stride-th case (a spread slice, as CI runs); ``workers`` children at a time;
    ``record`` a file that gets one JSON line per case (store, offset and bit or page and damage,
    the role of the byte or page, check, outcome, problems).

    A case is one damaged copy opened one way (with the structural check, or without). A violation
    is a wrong answer, a foreign error or a hang; so is a crash of the process in an open with the
    structural check. A crash without it (``interpreter_crash`` under ``unchecked``) is counted
    but is no violation: it is what the check exists for (docs/format/index.md, "Structural
    check"), and a file over its size bound is opened so by default."""
    import bisect
    from concurrent.futures import ThreadPoolExecutor

    if damage not in SWEEP_DAMAGES:
        raise ValueError(f"damage {damage!r}: choose from {list(SWEEP_DAMAGES)}")
    started = time.monotonic()
    findings = Findings()
    outcomes: dict[str, dict[str, dict[str, int]]] = {}
    by_role: dict[str, int] = {}
    figures: dict[str, Any] = {}
    roles: dict[str, list[tuple[int, int, str]]] = {}
    page_roles: dict[str, dict[int, str]] = {}
    done = 0

    def role_of(kind: str, item: dict[str, Any]) -> str:
        if "page" in item:
            return page_roles[kind].get(item["page"], "?")
        spans = roles[kind]
        at = bisect.bisect_right(spans, (item["offset"], float("inf"), "")) - 1
        return spans[at][2] if at >= 0 and spans[at][0] <= item["offset"] < spans[at][1] else "?"

    with _scratch("lmdb-sweep") as root:
        plan: list[tuple[str, str, tuple[int, int | str]]] = []
        for kind in stores:
            fixture = os.path.join(root, f"fixture-{kind}")
            if kind == "agent":
                _sweep_build_agent(fixture, _sweep_images(fixture))
            else:
                with _boot_id("lmdb-sweep"):
                    _sweep_build_index(fixture, _sweep_images(fixture))
            for name in _SWEEP_IGNORE:
                for place in (os.path.join(fixture, name), os.path.join(fixture, "lmdb", name),
                              os.path.join(fixture, "store", "index", name)):
                    if os.path.exists(place):
                        os.remove(place)
            data = os.path.join(fixture, _sweep_data_file(kind))
            roles[kind] = lmdb_byte_roles(data)
            page_roles[kind] = lmdb_page_roles(data)
            cases: list[tuple[int, int | str]]
            if damage == "pages":
                cases = list(sweep_page_cases(kind, fixture))
                wanted = None if pages is None else set(pages)
            else:
                cases = list(sweep_cases(kind, fixture, bits))
                wanted = None if offsets is None else set(offsets)
            if wanted is not None:
                cases = [case for case in cases if case[0] in wanted]
            cases = cases[::stride]
            figures[kind] = {"file_bytes": os.path.getsize(data), "cases": len(cases)}
            if damage == "pages":
                figures[kind]["swept_pages"] = len({page for page, _ in cases})
            else:
                figures[kind]["swept_bytes"] = len({offset for offset, _ in cases})
            outcomes[kind] = {}
            plan += [(kind, fixture, case) for case in cases]
        budget = Budget(count, seconds, len(plan) * len(SWEEP_CHECKS))
        chunks: list[tuple[str, str, list[tuple[int, int | str, bool]]]] = []
        for kind in stores:
            mine = [(fixture, (first, second, check)) for k, fixture, (first, second) in plan if k == kind
                    for check in SWEEP_CHECKS]
            for at in range(0, len(mine), SWEEP_CHUNK):
                chunks.append((kind, mine[0][0], [case for _, case in mine[at:at + SWEEP_CHUNK]]))
        lock = threading.Lock()

        def run(number: int) -> None:
            nonlocal done
            kind, fixture, cases = chunks[number]
            with lock:
                if not budget.more(done):
                    return
                cases = cases[:max(0, budget.count - done)] if budget.count is not None else cases
            results = _sweep_chunk(kind, fixture, os.path.join(root, f"work-{number}"), cases)
            shutil.rmtree(os.path.join(root, f"work-{number}"), ignore_errors=True)
            with lock:
                for item in results:
                    done += 1
                    mode = "checked" if item["check"] else "unchecked"
                    item["role"] = role_of(kind, item)
                    tally = outcomes[kind].setdefault(mode, {})
                    tally[item["outcome"]] = tally.get(item["outcome"], 0) + 1
                    if item["outcome"] == "interpreter_crash" and not item["check"]:
                        continue  # the documented limit of an open without the structural check
                    if item["problems"]:
                        # one violation per damaged copy and open; its first problem described
                        place = f"{kind} {mode} {item['role']}"
                        if "damage" in item:
                            place += " " + item["damage"].partition(" ")[0]
                        by_role[place] = by_role.get(place, 0) + 1
                        more = len(item["problems"]) - 1
                        findings.add(f"[{item['role']}] " + item["problems"][0] + (f" (and {more} more)" if more else ""))
                if record is not None:
                    with open(record, "a") as handle:
                        for item in results:
                            handle.write(json.dumps({"store": kind, **item}) + "\n")
                budget.report(done, progress)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(run, range(len(chunks))))
    details: dict[str, Any] = {"cases": done, "damage": damage, "stores": figures, "outcomes": outcomes,
                               "violations_by_role": by_role}
    if damage == "bits":
        details["bits"] = bits
    return _result("lmdb-sweep", seed, done, started, findings, details)


# -- disk: failed fsyncs, ENOSPC and short writes --------------------------------------------------

FAIL_SYNC_SOURCE = os.path.join(REPO_ROOT, "tests", "native", "fail_sync.c")
DISK_STEPS = 30
DISK_MODES = ("sync_once", "sync_from", "enospc", "short_write", "seam_sync")


def preload(library: str) -> str:
    """``LD_PRELOAD`` for a child that loads ``library``: after what this process's environment
    preloads already (a sanitizer build's runtime, which must stay first in the list)."""
    inherited = os.environ.get("LD_PRELOAD", "")
    return f"{inherited}:{library}" if inherited else library


def build_fail_sync_library(directory: str) -> str:
    """Compile ``tests/native/fail_sync.c`` into ``directory``; returns the library's path."""
    if not os.path.exists(FAIL_SYNC_SOURCE):
        raise FileNotFoundError(f"{FAIL_SYNC_SOURCE} is missing (the disk suite runs from a source checkout)")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) to build the fault-injection library")
    library = os.path.join(directory, "fail_sync.so")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o", library, FAIL_SYNC_SOURCE, "-ldl"],
                   check=True, capture_output=True, text=True)
    return library


def _disk_workload(authority: Any, rng: random.Random, say: Callable[[str], None], faults: Callable[[], int]) -> None:
    """The deterministic single-threaded workload of the disk suite; prints each outcome with
    the count of injected faults before and after the call."""
    for step in range(DISK_STEPS):
        before = faults()
        choice = rng.random()
        try:
            if choice < 0.1:
                ref = authority.snapshot(rng.choice(GROUPS))
                say(f"SNAP {ref.group} {ref.seq} {before} {faults()}")
                continue
            if choice < 0.2:
                group = rng.choice(GROUPS)
                stored = authority.ack("agent-d", group, authority.head(group)[0])
                say(f"ACK agent-d {group} {stored} {before} {faults()}")
                continue
            commands = workload_commands(authority, rng, f"d{step}")
            say("TRY " + " ".join(command.action_id for command in commands))
            if len(commands) == 1:
                receipts = [authority.accept(commands[0])]
            else:
                receipts = [result.unwrap() for result in authority.accept_many(commands) if result.ok]
            after = faults()
            for receipt in receipts:
                say(f"OK {receipt.action_id} {receipt.group} {receipt.seq} {receipt.event_id} {before} {after}")
        except MwpError as exc:
            say(f"FAIL {exc.code} {before} {faults()}")
        except Exception as exc:
            say(f"FOREIGN {type(exc).__name__} {before} {faults()}")


def disk_child(argv: list[str]) -> None:
    """The workload under the LD_PRELOAD library: ``PATH SEED``."""
    import ctypes

    from .authority import Authority

    path, seed = argv[0], int(argv[1])
    injected = ctypes.CDLL(None).mwpstore_faults_injected
    injected.restype = ctypes.c_long

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        authority = Authority.open(path)
    except MwpError as exc:
        say(f"OPENFAIL {exc.code} {injected()}")
        return
    except Exception as exc:
        say(f"OPENFOREIGN {type(exc).__name__}: {exc}")
        return
    for group in GROUPS:
        before = injected()
        try:
            receipt = authority.accept(group_create_command(group))
            say(f"OK {receipt.action_id} {receipt.group} {receipt.seq} {receipt.event_id} {before} {injected()}")
        except MwpError as exc:
            say(f"FAIL {exc.code} {before} {injected()}")
        except Exception as exc:
            say(f"FOREIGN {type(exc).__name__} {before} {injected()}")
    _disk_workload(authority, random.Random(seed), say, injected)
    try:
        authority.close()
        say("CLOSED")
    except MwpError as exc:
        say(f"CLOSEFAIL {exc.code}")
    except Exception as exc:
        say(f"CLOSEFOREIGN {type(exc).__name__}: {exc}")


def _judge_disk_lines(lines: list[str], fault_paths: list[str]) -> tuple[Acknowledged, list[str]]:
    """The oracle from a run's lines, and the violations visible in them: a call that saw an
    injected failed sync or ENOSPC yet succeeded; any success after a failure on the log."""
    oracle = Acknowledged()
    problems: list[str] = []
    log_failed = False
    # a segment file (<store>/log/<name>) or the log directory itself (the I/O seam's cases)
    first_fault_on_log = bool(fault_paths) and "log" in (
        os.path.basename(fault_paths[0]),
        os.path.basename(os.path.dirname(fault_paths[0])),
    )
    for line in lines:
        parts = line.split()
        kind = parts[0]
        if kind == "TRY":
            oracle.attempted.update(parts[1:])
            continue
        if kind in ("OPENFOREIGN", "CLOSEFOREIGN", "FOREIGN"):
            problems.append(f"a foreign (untyped) error escaped: {line}")
            continue
        if kind in ("OK", "SNAP", "ACK"):
            before, after = int(parts[-2]), int(parts[-1])
            if after > before:
                problems.append(f"acknowledged although the call met an injected failure: {line}")
            if log_failed:
                problems.append(f"acknowledged after a failed log sync/write (retry-then-acknowledge): {line}")
            if kind == "OK":
                oracle.add_receipt(parts[1], parts[2], int(parts[3]), parts[4])
            elif kind == "SNAP":
                oracle.snapshots.add((parts[1], int(parts[2])))
        elif kind == "FAIL":
            if int(parts[-1]) > 0 and first_fault_on_log:
                log_failed = True
    return oracle, problems


def _reopen_and_check(path: str, oracle: Acknowledged, boot: str) -> list[str]:
    from .authority import Authority

    try:
        with _boot_id(boot), Authority.open(path) as authority:
            return check_authority(authority, oracle, full_verify=True)
    except MwpError as exc:
        return [f"reopen after the disk failure failed: {_describe(exc)}"]
    except Exception as exc:
        return [f"reopen raised a foreign error: {_describe(exc)}"]


def _seam_case(path: str, fail_at: int, seed: int, boot: str) -> tuple[list[str], int]:
    """The same workload in-process with the log's syncs going through the recorder, the
    ``fail_at``-th one failing with EIO, in a store at ``path`` that is removed afterwards (each
    holds a 64 MiB segment). Returns (violations, sync calls seen)."""
    try:
        return _seam_case_in(path, fail_at, seed, boot)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _seam_case_in(path: str, fail_at: int, seed: int, boot: str) -> tuple[list[str], int]:
    from .authority import Authority
    from .io_seam import RecordingIO

    recorder = RecordingIO(fail_sync_at=fail_at)
    lines: list[str] = []
    with _boot_id(boot), recorded_log(recorder):
        try:
            authority = Authority.open(path)
        except MwpError as exc:
            lines.append(f"OPENFAIL {exc.code} {recorder.failures}")
            authority = None
        if authority is not None:
            for group in GROUPS:
                before = recorder.failures
                try:
                    receipt = authority.accept(group_create_command(group))
                    lines.append(f"OK {receipt.action_id} {receipt.group} {receipt.seq} {receipt.event_id} {before} {recorder.failures}")
                except MwpError as exc:
                    lines.append(f"FAIL {exc.code} {before} {recorder.failures}")
            _disk_workload(authority, random.Random(seed), lines.append, lambda: recorder.failures)
            try:
                authority.close()
            except MwpError:
                pass
    oracle, problems = _judge_disk_lines(lines, [os.path.join(path, "log")] if recorder.failures else [])
    return problems + _reopen_and_check(path, oracle, boot), recorder.sync_calls


def run_disk(count: int | None = None, seconds: float | None = None, seed: int = 1,
             progress: Progress | None = None, *, modes: tuple[str, ...] = DISK_MODES, scope: str = "store") -> dict[str, Any]:
    """Failed fsyncs (once and persistent), ENOSPC and short writes at every point of a workload.

    ``scope``: ``store`` counts and fails calls on every file of the store (log, LMDB index,
    snapshots, keys); ``log`` only on the segment log's files.
    """
    if scope not in ("store", "log"):
        raise ValueError("scope must be 'store' or 'log'")
    chosen = [mode for mode in DISK_MODES if mode in modes]
    started = time.monotonic()
    budget = Budget(count, seconds, DEFAULT_COUNTS["disk"])
    findings = Findings()
    cases: dict[str, dict[str, int]] = {mode: {"cases": 0, "faults_injected": 0} for mode in DISK_MODES if mode in modes}
    iterations = 0
    boot = f"disk-{seed}"
    with _scratch("disk") as root:
        library = build_fail_sync_library(root)

        def run_child(env_extra: dict[str, str], number: int) -> tuple[str, list[str], list[str]]:
            path = os.path.join(root, f"store-{number}")
            fault_log = os.path.join(root, f"faults-{number}.log")
            filtered = path if scope == "store" else os.path.join(path, "log") + os.sep
            env = dict(os.environ, LD_PRELOAD=preload(library), MWPSTORE_FAULT_PATH=filtered, MWPSTORE_FAULT_LOG=fault_log,
                       **{BOOT_ID_ENV: boot}, **env_extra)
            env.pop(FAILPOINT_ENV, None)
            child = subprocess.run(_python_command("disk_child", path, str(seed)), env=env, capture_output=True,
                                   text=True, timeout=300)
            if child.returncode != 0:
                findings.add(f"disk child {env_extra} exited with {child.returncode}: {child.stderr[-800:]}")
            calls = []
            if os.path.exists(fault_log):
                with open(fault_log) as handle:
                    calls = handle.read().splitlines()
                os.remove(fault_log)
            return path, child.stdout.splitlines(), calls

        # A clean run counts the sync and write calls: the points to fail.
        counted, _, calls = run_child({}, -1)
        shutil.rmtree(counted, ignore_errors=True)
        sync_points = sum(1 for call in calls if call.split()[0] in ("fsync", "fdatasync"))
        write_points = sum(1 for call in calls if call.split()[0] in ("write", "pwrite"))
        _, seam_syncs = _seam_case(os.path.join(root, "seam-count"), -1, seed, boot)
        sweep = {mode: 0 for mode in DISK_MODES}
        points = {"sync_once": sync_points, "sync_from": sync_points, "enospc": write_points,
                  "short_write": write_points, "seam_sync": seam_syncs}
        rng = random.Random(seed)
        # Each mode visits its points in a seeded order, every point once before any repeats.
        orders = {mode: rng.sample(range(1, max(1, points[mode]) + 1), max(1, points[mode])) for mode in DISK_MODES}
        while budget.more(iterations):
            mode = chosen[iterations % len(chosen)]
            sweep[mode] += 1
            point = orders[mode][(sweep[mode] - 1) % len(orders[mode])]
            iterations += 1
            cases[mode]["cases"] += 1
            if mode == "seam_sync":
                problems, _ = _seam_case(os.path.join(root, f"seam-{iterations}"), point - 1, seed, boot)
                cases[mode]["faults_injected"] += 1
            else:
                variable = {"sync_once": "MWPSTORE_FAIL_SYNC_AT", "sync_from": "MWPSTORE_FAIL_SYNC_FROM",
                            "enospc": "MWPSTORE_ENOSPC_WRITE_AT", "short_write": "MWPSTORE_SHORT_WRITE_AT"}[mode]
                path, lines, calls = run_child({variable: str(point)}, iterations)
                fault_paths = [call.split(maxsplit=3)[3] if len(call.split()) > 3 else "" for call in calls
                               if (call.split()[0] in ("fsync", "fdatasync") and call.split()[2] == str(-errno.EIO))
                               or call.split()[0] in ("write", "pwrite") and call.split()[2] == str(-errno.ENOSPC)
                               or call.split()[0].endswith("-short")]
                cases[mode]["faults_injected"] += len(fault_paths)
                if mode == "short_write":
                    fault_paths = []  # a short write may be completed by the caller: success is allowed
                    lines = [_forgive_short(line) for line in lines]
                oracle, problems = _judge_disk_lines(lines, fault_paths)
                problems += _reopen_and_check(path, oracle, boot)
                shutil.rmtree(path, ignore_errors=True)
            findings.extend(problems, f"{mode} at point {point} (seed {seed}): ")
            budget.report(iterations, progress)
    return _result("disk", seed, iterations, started, findings, {
        "sync_points": sync_points,
        "write_points": write_points,
        "seam_sync_points": seam_syncs,
        "cases": cases,
        "points_covered": {mode: min(sweep[mode], max(1, points[mode])) for mode in chosen},
        "scope": scope,
        "library": os.path.relpath(FAIL_SYNC_SOURCE, REPO_ROOT),
    })


def _forgive_short(line: str) -> str:
    """Short writes are allowed to be retried to completion: drop the fault counts from a success."""
    parts = line.split()
    if parts and parts[0] in ("OK", "SNAP", "ACK"):
        parts[-2] = parts[-1]
    return " ".join(parts)



# -- fuzz: every decoder and entry point that takes outside bytes ----------------------------------

FUZZ_TARGETS = ("segment_file", "event_bytes", "command", "agent_delivery", "snapshot", "audit_log", "agent_lmdb_file",
                "index_record", "agent_apply_many", "agent_check_run")
FUZZ_INPUT_SECONDS_MAX = 5.0
"""An input that takes longer than this is a hang (a violation)."""
FUZZ_INPUT_BYTES_MAX = 1 << 16


class AcceptedForgery(Exception):
    """Modified signed or authenticated bytes passed verification (a violation, never expected)."""


class IndexPathsDisagree(Exception):
    """The C indexing of a log record and the Python reference disagreed (a violation)."""


class ApplyPathsDisagree(Exception):
    """``apply_many`` (its C run) and a loop of ``apply`` disagreed on the same Events (a violation)."""


class FuzzHang(Exception):
    """Raised by the watchdog alarm inside a fuzzed call that ran too long."""


class FuzzContext:
    """Valid samples of every input kind (the seeds mutations start from) and the objects the
    entry points need: a keyring, an Organization key provider, an Authority and an AgentStore."""

    def __init__(self, root: str) -> None:
        from .agent_store import AgentStore
        from .audit_log import FileKeyProvider, write_audit_log
        from .authority import Authority
        from .segment_log import SegmentLog

        self.root = root
        self.counter = 0
        with _boot_id("fuzz"):
            self.authority = Authority.open(os.path.join(root, "authority"), sync=False, segment_bytes=POWER_SEGMENT_BYTES)
        ensure_groups(self.authority)
        rng = random.Random(7)
        for step in range(30):
            self.authority.accept_many(workload_commands(self.authority, rng, f"f{step}"))
        ref = self.authority.snapshot(GROUPS[0])
        self.keyring = self.authority.keyring()
        snapshot = self.authority.read_snapshot(ref)
        events = self.authority._read_bodies(GROUPS[1], 0, 1000)
        self.events = self.authority._read_bodies(GROUPS[0], 0, 1000)
        self.provider = FileKeyProvider(os.path.join(root, "org-keys"))
        audit = os.path.join(root, "audit.log")
        write_audit_log(audit, org=ORG, group=GROUPS[1], events=events, key_provider=self.provider, chunk_bytes=2048)
        with open(audit, "rb") as handle:
            audit_bytes = handle.read()
        log_dir = os.path.join(root, "small-log")
        with SegmentLog.open(log_dir, segment_bytes=POWER_SEGMENT_BYTES) as log:
            for index in range(12):
                log.append([rng.randbytes(rng.choice((0, 5, 100, 700))) for _ in range(rng.choice((1, 2, 3)))])
            used = log.segments()[-1].used_bytes
        with open(os.path.join(log_dir, "00000000000000000000.seg"), "rb") as handle:
            segment = handle.read()
        self.agent = AgentStore.open(os.path.join(root, "agent"), projections=[CountingProjection()], trusted_keys=[self.keyring])
        from .index import Index

        self.index = Index(os.path.join(root, "index-scratch"), map_size=1 << 26)  # never written: heads load as empty
        # Two trusted stores without projections, never committed to: apply_many against apply.
        self.trusted = tuple(AgentStore.open(os.path.join(root, f"trusted-{path}"), verify="trusted") for path in ("loop", "many"))
        # And two with full validation: apply_many's check_run and C run against apply.
        self.full = tuple(AgentStore.open(os.path.join(root, f"full-{path}")) for path in ("loop", "many"))
        sample_agent = os.path.join(root, "agent-sample")
        with AgentStore.open(sample_agent, projections=[CountingProjection()], trusted_keys=[self.keyring]) as agent:
            with agent.begin() as tx:
                for event in self.events[:12]:
                    tx.apply(event)
                tx.advance_cursor(GROUPS[0])
        with open(os.path.join(sample_agent, "lmdb", "data.mdb"), "rb") as handle:
            agent_file = handle.read()
        commands = [msgspec_command(command) for command in workload_commands(self.authority, rng, "seed-a")]
        self.samples: dict[str, list[bytes]] = {
            "segment_file": [segment[:used], segment[: used + 512], segment],
            "event_bytes": self.events[:8],
            "command": commands,
            "agent_delivery": self.events[:8],
            "snapshot": [snapshot],
            "audit_log": [audit_bytes],
            "agent_lmdb_file": [agent_file],
            "index_record": [self.events[-1]],  # the record after the others: the chain links
            "agent_apply_many": [_events_sample(self.events[:10]), _events_sample(self.events[:3] + self.events[2:7])],
            "agent_check_run": [_events_sample(self.events[:10]), _events_sample(self.events[:3] + self.events[2:7])],
        }

    def scratch_path(self, name: str) -> str:
        self.counter += 1
        return os.path.join(self.root, "inputs", f"{self.counter}-{name}")

    def close(self) -> None:
        for store in (*self.trusted, *self.full):
            store.close()
        self.agent.close()
        self.index.close()
        self.authority.close()


def msgspec_command(command: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(command)


def _command_from_bytes(data: bytes) -> Any:
    """A Command whose fields come from fuzzed bytes: msgpack decoded without a schema, so any
    field may hold any type (the entry point must check every one)."""
    import msgspec

    from .messages import Command

    try:
        fields = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError):
        fields = None
    if not isinstance(fields, dict):
        fields = {"actor": data[:16].decode("latin-1"), "action_id": data.hex()[:40], "group": GROUPS[0],
                  "kind": "mission.create", "target": data[16:40].decode("utf-8", "replace"), "body": {"title": data[40:80].decode("latin-1")}}
    names = ("actor", "action_id", "group", "kind", "target", "body", "expected_revision", "signature")
    values = {name: fields[name] for name in names if name in fields}
    for name in names[:5]:
        values.setdefault(name, None)
    return Command(**values)  # msgspec does not check types on construction: the entry point must


def fuzz_one(target: str, data: bytes, context: FuzzContext) -> None:
    """Feed one input to one entry point. Returns normally or raises ``MwpError``: anything else
    (and a hang) is a violation for the caller to count."""
    if target == "segment_file":
        from .segment_log import SegmentLog

        directory = context.scratch_path("log")
        os.makedirs(directory)
        with open(os.path.join(directory, "00000000000000000000.seg"), "wb") as handle:
            handle.write(data)
        try:
            for readonly in (True, False):
                with SegmentLog.open(directory, segment_bytes=POWER_SEGMENT_BYTES, readonly=readonly) as log:
                    for batch in log.scan(0):
                        for position in batch.positions[:3]:
                            log.read(position)
                    log.verify()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    elif target == "event_bytes":
        from .messages import check_event, decode_event

        check_event(decode_event(data))
    elif target == "command":
        from .messages import check_command, command_bytes

        command = _command_from_bytes(data)
        check_command(command)
        command_bytes(command)
        context.authority.accept(command)
    elif target == "agent_delivery":
        from .messages import decode_event

        with context.agent.begin() as tx:
            try:
                tx.apply(data)
            except MwpError:
                pass
            try:
                event = decode_event(data)
            except MwpError:
                return
            tx.apply(event)
    elif target == "snapshot":
        from .snapshot import verify_snapshot

        verify_snapshot(data, keyring=context.keyring, org=ORG, group=GROUPS[0])
        if data not in context.samples["snapshot"]:
            raise AcceptedForgery(f"modified snapshot bytes verified ({len(data)} bytes)")
    elif target == "audit_log":
        from .audit_log import read_audit_log

        path = context.scratch_path("audit")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
        try:
            records = list(read_audit_log(path, key_provider=context.provider, org=ORG, group=GROUPS[1]))
        finally:
            os.remove(path)
        if data not in context.samples["audit_log"]:
            raise AcceptedForgery(f"modified audit log bytes read without error ({len(records)} records)")
    elif target == "agent_lmdb_file":
        from .agent_store import AgentStore

        # Laid over the sample, so the file keeps its length and most pages stay where LMDB
        # expects them: the damage then reaches the page walk instead of ending at the first page.
        sample = context.samples["agent_lmdb_file"][0]
        directory = context.scratch_path("agent")
        os.makedirs(os.path.join(directory, "lmdb"))
        with open(os.path.join(directory, "lmdb", "data.mdb"), "wb") as handle:
            handle.write(bytes(data[: len(sample)]) + sample[len(data) :])
        try:
            with AgentStore.open(directory, projections=[CountingProjection()], trusted_keys=[context.keyring], check_lmdb=True) as agent:
                agent_answers(agent)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    elif target == "index_record":
        from .authority import EVENT_TAG

        records = [EVENT_TAG + event for event in context.events[:-1]] + [EVENT_TAG + bytes(data)]
        python, with_c = index_paths(context.index, records)
        try:
            same = index_meaning(python) == index_meaning(with_c)
        except MwpError as exc:  # an entry either path wrote does not read back
            raise IndexPathsDisagree(f"an indexed entry does not decode: {exc.message}") from None
        if not same:
            raise IndexPathsDisagree(f"C and Python index a {len(data)}-byte record differently")
        if isinstance(python[0], str):  # both refused it: counted as the typed error it is
            from .errors import Corruption

            raise Corruption(f"index_record refused ({python[1]})", reason=python[1])
    elif target == "agent_apply_many":
        events = _events_from(data)
        loop, many = (apply_outcome(store, events, use_many) for store, use_many in zip(context.trusted, (False, True)))
        if loop != many:
            raise ApplyPathsDisagree(f"apply_many and a loop of apply differ on {len(events)} Events: {many[:2]} vs {loop[:2]}")
        if loop[1] is not None:  # both refused the same Event: counted as the typed error it is
            from .errors import EventInvalid

            raise EventInvalid(f"agent_apply_many refused ({loop[1]})", reason="fuzz")
    elif target == "agent_check_run":
        events = _events_from(data)
        if len(data) % 2 == 0:  # half the inputs get hashes that verify: the other checks are reached
            events = _resealed_chain(events)
        ends = check_run_paths(events)
        if ends is not None and ends[0] != ends[1]:
            raise ApplyPathsDisagree(f"check_run and its Python definition end {len(events)} Events at {ends[0]} and {ends[1]}")
        loop, many = (apply_outcome(store, events, use_many) for store, use_many in zip(context.full, (False, True)))
        if loop != many:
            raise ApplyPathsDisagree(f"full apply_many and a loop of apply differ on {len(events)} Events: {many[:2]} vs {loop[:2]}")
        if loop[1] is not None:
            from .errors import EventInvalid

            raise EventInvalid(f"agent_check_run refused ({loop[1]})", reason="fuzz")
    else:
        raise AssertionError(target)


def _events_sample(encoded_events: list[bytes]) -> bytes:
    """A msgpack array of Events (each an array of its 16 fields): the agent_apply_many seed form."""
    import msgspec

    from .messages import decode_event

    return msgspec.msgpack.encode([decode_event(data) for data in encoded_events])


def _events_from(data: bytes) -> list[Any]:
    """Event objects built from a msgpack array of 16-field arrays with whatever values decode
    (msgspec does not check a Struct's field types when it is built in code: the checks under test
    must). Items of another shape stay as they are (apply refuses them)."""
    import msgspec

    from .errors import EventInvalid
    from .messages import Effect, Event

    try:
        items = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise EventInvalid(f"not msgpack: {exc}", reason="fuzz") from None
    if not isinstance(items, list):
        raise EventInvalid("not an array of Events", reason="fuzz")
    events: list[Any] = []
    for item in items[:64]:
        if isinstance(item, list) and len(item) == 16:
            effects = item[12]
            if isinstance(effects, list):
                effects = [Effect(*effect) if isinstance(effect, list) and len(effect) == 3 else effect for effect in effects]
            item = Event(*item[:12], effects, *item[13:])
        events.append(item)
    return events


def _resealed_chain(events: list[Any]) -> list[Any]:
    """``events`` with each Event object's payload hash, link to the Event object before it, and
    hash made right for what it holds, wherever they can be computed: so that fuzzed content,
    IDs and types meet the checks behind the hash checks."""
    import msgspec

    from .messages import Event, payload_hash_of, recompute_event_hash

    out: list[Any] = []
    previous: bytes | None = None
    for event in events:
        if type(event) is Event:
            try:
                if previous is not None:
                    event = msgspec.structs.replace(event, prev_hash=previous)
                if type(event.body) is dict:
                    event = msgspec.structs.replace(event, payload_hash=payload_hash_of(event.body))
                event = msgspec.structs.replace(event, hash=recompute_event_hash(event))
            except Exception:  # noqa: BLE001 — content that does not hash stays as it is
                pass
            previous = event.hash if type(event.hash) is bytes else None
        out.append(event)
    return out


def check_run_paths(events: list[Any]) -> tuple[int, int] | None:
    """Where ``mwpstore._apply_c.check_run`` and its definition ``agent_store._fully_valid_run``
    end a run of ``events`` taken as the Events of the first one's Group from its sequence on;
    None when the first is no Event of a valid Group (apply_many runs check_run only after apply()
    took an Event of that Group)."""
    from . import canonical
    from ._apply_c import check_run
    from .agent_store import _CHECK_CONTEXT, _fully_valid_run
    from .messages import Event

    first = events[0] if events else None
    if type(first) is not Event or type(first.group) is not str or not canonical.id_ok(first.group):
        return None
    seq = first.seq if type(first.seq) is int and 1 <= first.seq < 2**62 else 1
    prev = first.prev_hash if type(first.prev_hash) is bytes and len(first.prev_hash) == 32 else bytes(32)
    return (check_run(events, 0, _CHECK_CONTEXT, first.group, seq, prev), _fully_valid_run(events, 0, first.group, seq, prev))


def apply_outcome(store: Any, events: list[Any], use_many: bool) -> tuple[Any, Any, Any]:
    """(statuses, error, every entry the transaction holds) after applying ``events`` in one
    local transaction that is then aborted: with ``apply_many``, or ``apply`` one by one up to the
    first error."""
    statuses: list[Any] | None = []
    error = None
    tx = store.begin()
    try:
        try:
            if use_many:
                statuses = tx.apply_many(events)
            else:
                for event in events:
                    statuses.append(tx.apply(event))
        except MwpError as exc:
            statuses, error = None, (type(exc).__name__, exc.detail.get("reason"))
        try:
            tx._flush()  # what commit would write first (trusted mode meets unchecked content here)
        except MwpError as exc:
            statuses, error = None, ("flush", type(exc).__name__, exc.detail.get("reason"))
        heads = sorted((group, head.applied_seq, head.applied_hash, head.cursor, head.buffered) for group, head in tx._heads.items())
        entries = [
            (name, [(bytes(key), bytes(value)) for key, value in tx._txn.cursor(db=db)])
            for name, db in sorted(tx._tables.dbs.items())
        ]
        return statuses, error, (heads, entries, tx._failed is not None)
    finally:
        tx.abort()


IndexOutcome = Any
"""What indexing records gave: (PendingWrites, heads, last acceptance time), or the error as
("Corruption", reason, offset)."""


def index_paths(index: Any, records: list[bytes], heads: dict[str, tuple[int, bytes]] | None = None) -> tuple[IndexOutcome, IndexOutcome]:
    """Index ``records`` (at positions 0, 8, 16, ...) twice, nothing committed: with
    ``authority._index_record`` alone (the reference), and as redo does (``mwpstore._index_c``,
    then the reference for what C hands back). ``index`` only answers heads not in ``heads``."""
    from .authority import _index_record, _index_records
    from .errors import Corruption
    from .index import PendingWrites

    outcomes = []
    for use_c in (False, True):
        writes, known, last_ms = PendingWrites(), dict(heads or {}), [0]
        positions = [number * 8 for number in range(len(records))]
        txn = index.begin(write=True)
        try:
            if use_c:
                _index_records(index, txn, writes, known, positions, records, last_ms)
            else:
                for position, record in zip(positions, records):
                    _index_record(index, txn, writes, known, position, record, last_ms)
            outcomes.append((writes, known, last_ms[0]))
        except Corruption as exc:
            outcomes.append(("Corruption", exc.detail.get("reason"), exc.detail.get("offset")))
        finally:
            txn.abort()
    return outcomes[0], outcomes[1]


def index_bytes(outcome: IndexOutcome) -> Any:
    """An outcome's entries exactly as they would be written."""
    if isinstance(outcome[0], str):
        return outcome
    writes, heads, last_ms = outcome
    return writes.items, writes.new, heads, last_ms


def _comparable(value: Any) -> Any:
    """``value`` with every float replaced by its type and bits, so that equality is meaning: a
    NaN (which a forged record may hold) equals itself, and 1.0 never equals 1."""
    if type(value) is float:
        return ("float", struct.pack("<d", value))
    if type(value) is dict:
        return {key: _comparable(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_comparable(item) for item in value)
    if type(value) in (int, bool):
        return (type(value).__name__, value)
    return value


def index_meaning(outcome: IndexOutcome) -> Any:
    """What an outcome's entries say (unsealed and decoded, floats by their bits): C copies a
    record's msgpack where Python re-encodes it, so a forged non-minimal encoding may differ in
    bytes, never in meaning."""
    from .authority import _stored_receipt
    from .index import decode_state, unseal

    if isinstance(outcome[0], str):
        return outcome
    writes, heads, last_ms = outcome
    decoded = {}
    for name, items in writes.items.items():
        values = []
        for key, stored in items:
            value: Any = unseal(name, key, stored)
            if name == b"states":
                value = _comparable(decode_state(value))
            elif name == b"receipts":
                value = _stored_receipt(value)  # as the engine reads it back
            values.append((key, value))
        decoded[name] = values
    return decoded, writes.new, heads, last_ms


def mutate(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    """1 to 4 random edits: bit flips, byte sets, inserts, deletions, cuts, splices, repeats."""
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(8)
        at = rng.randrange(len(buffer) + 1)
        if choice == 0 and buffer:
            at = min(at, len(buffer) - 1)
            buffer[at] ^= 1 << rng.randrange(8)
        elif choice == 1 and buffer:
            at = min(at, len(buffer) - 1)
            buffer[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif choice == 2:
            buffer[at:at] = rng.randbytes(rng.choice((1, 2, 4, 8, 64)))
        elif choice == 3 and buffer:
            del buffer[at : at + rng.choice((1, 2, 4, 8, 64))]
        elif choice == 4:
            del buffer[at:]
        elif choice == 5 and others:
            other = rng.choice(others)
            cut = rng.randrange(len(other) + 1)
            buffer[at:] = other[cut:]
        elif choice == 6 and buffer:
            piece = bytes(buffer[at : at + rng.choice((4, 16, 64))])
            buffer[at:at] = piece * rng.randint(1, 4)
        else:
            buffer = bytearray(rng.randbytes(rng.randrange(0, 256))) if rng.random() < 0.1 else buffer
    return bytes(buffer[:FUZZ_INPUT_BYTES_MAX])


class _Watchdog:
    """A per-input time bound (SIGALRM; only in the main thread, else unbounded)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    def __enter__(self) -> _Watchdog:
        if self.usable:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def _fire(self, signum: int, frame: Any) -> None:
        raise FuzzHang(f"an input took more than {self.seconds} s")

    def __exit__(self, *exc: object) -> None:
        if self.usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def _run_input(target: str, data: bytes, context: FuzzContext, findings: Findings, tally: dict[str, int]) -> None:
    try:
        with _Watchdog(FUZZ_INPUT_SECONDS_MAX):
            fuzz_one(target, data, context)
        tally["accepted"] = tally.get("accepted", 0) + 1
    except MwpError as exc:
        tally[exc.code] = tally.get(exc.code, 0) + 1
    except FuzzHang as exc:
        findings.add(f"{target}: hang: {exc} (input {data[:64].hex()}..., {len(data)} bytes)")
    except RecursionError as exc:
        findings.add(f"{target}: RecursionError {exc} (input {len(data)} bytes)")
    except Exception as exc:
        findings.add(f"{target}: untyped {_describe(exc)} (input {data[:96].hex()}, {len(data)} bytes)\n"
                     f"{traceback.format_exc()[-800:]}")


class _BudgetSpent(Exception):
    """Ends a hypothesis drive when its share of a time budget is used up."""


def _hypothesis_inputs(target: str, samples: list[bytes], examples: int, seed: int, run: Callable[[bytes], None],
                       deadline: float | None = None) -> int:
    """Drive ``run`` with hypothesis-generated inputs (mutated samples and raw bytes), at most
    ``examples`` of them and (when given) until the monotonic ``deadline``. Returns the number
    of inputs run, or -1 when hypothesis is not installed."""
    try:
        import hypothesis
        from hypothesis import strategies as st
    except ImportError:
        return -1
    edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from(("set", "xor", "insert", "cut"))), max_size=6)
    raw = st.binary(max_size=512)
    done = [0]

    def build(sample: bytes, changes: list[tuple[int, int, str]]) -> bytes:
        buffer = bytearray(sample)
        for at, value, how in changes:
            at = at % (len(buffer) + 1)
            if how == "insert":
                buffer[at:at] = bytes([value])
            elif how == "cut":
                del buffer[at:]
            elif buffer:
                at = min(at, len(buffer) - 1)
                buffer[at] = value if how == "set" else buffer[at] ^ (value or 1)
        return bytes(buffer)

    @hypothesis.settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.seed(seed)
    @hypothesis.given(st.one_of(st.tuples(st.sampled_from(samples), edits).map(lambda pair: build(*pair)), raw))
    def drive(data: bytes) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise _BudgetSpent
        done[0] += 1
        run(data)

    _until_budget_spent(drive)
    return done[0]


def _until_budget_spent(drive: Callable[[], None]) -> None:
    """Run a hypothesis drive that ends by raising ``_BudgetSpent``. An input hypothesis generates
    a second time after the deadline ran the first time and is skipped now, and hypothesis reports
    that as a ``FlakyFailure`` holding the ``_BudgetSpent``: the budget's end too, not a finding
    (it stopped a 1,200 s fuzz run at seed 156). A group holding anything else is raised."""
    try:
        drive()
    except _BudgetSpent:
        pass
    except BaseExceptionGroup as group:
        _spent, rest = group.split(_BudgetSpent)
        if rest is not None:
            raise


ATHERIS_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
deadline = {deadline!r}  # the wall-clock end of a time budget (None with a count of runs)
runs = [0]

def stop_at_the_deadline():
    # libFuzzer's -max_total_time counts whole seconds from its own start, after the instrumented
    # imports below: it alone would overrun a time budget by seconds.
    if deadline is not None and time.time() >= deadline:
        sys.stderr.write(f"Done {{runs[0]}} runs (the time budget ended)\\n")
        sys.stderr.flush()
        os._exit(0)

import atheris
with atheris.instrument_imports():
    import mwpstore.messages, mwpstore.segment_log, mwpstore.snapshot, mwpstore.audit_log, mwpstore.agent_store, mwpstore.canonical, mwpstore._lmdb_check, mwpstore.authority
from mwpstore.errors import MwpError
from mwpstore.torture import FUZZ_TARGETS, FuzzContext, fuzz_one
context = FuzzContext({work!r})
stop_at_the_deadline()

def test(data):
    stop_at_the_deadline()
    runs[0] += 1
    if not data:
        return
    try:
        fuzz_one(FUZZ_TARGETS[data[0] % len(FUZZ_TARGETS)], data[1:], context)
    except MwpError:
        pass

atheris.Setup([sys.argv[0], "-runs={runs}", "-seed={seed}", "-timeout={timeout}", "-max_len={max_len}",
               "-max_total_time={seconds}", {corpus!r}], test)
atheris.Fuzz()
"""
ATHERIS_STOP_SECONDS = 1.0
"""How long past the end of a time budget the atheris child may take to stop before it is killed
(it stops by itself at its first input after the end; this covers a child still importing)."""


def atheris_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("atheris") is not None
    except (ImportError, ValueError):
        return False


def _run_atheris(context: FuzzContext, runs: int, seconds: int, seed: int, findings: Findings,
                 until: float | None = None) -> int:
    """Coverage-guided fuzzing of every target in one child (libFuzzer exits the process when
    done): an input's first byte chooses the target, the rest is the target's bytes. ``until``
    (monotonic) ends a time budget: the child stops at its first input after it, and is killed
    if it is still starting ``ATHERIS_STOP_SECONDS`` later."""
    work = tempfile.mkdtemp(prefix="atheris-", dir=context.root)
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    for number, target in enumerate(FUZZ_TARGETS):
        for index, sample in enumerate(context.samples[target]):
            with open(os.path.join(corpus, f"seed-{target}-{index}"), "wb") as handle:
                handle.write(bytes([number]) + sample)
    deadline = None if until is None else time.time() + (until - time.monotonic())
    script = ATHERIS_SCRIPT.format(root=REPO_ROOT, work=os.path.join(work, "context"), runs=runs, deadline=deadline,
                                   seed=seed + 1, timeout=int(FUZZ_INPUT_SECONDS_MAX) + 1, max_len=FUZZ_INPUT_BYTES_MAX,
                                   seconds=max(1, seconds), corpus=corpus)
    os.makedirs(os.path.join(work, "context"))
    wait = seconds + 300 if until is None else max(0.0, until - time.monotonic()) + ATHERIS_STOP_SECONDS
    try:
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=work,
                               timeout=wait, env=dict(os.environ, **{BOOT_ID_ENV: "fuzz"}))
    except subprocess.TimeoutExpired as stopped:
        if until is None:
            raise
        # Killed at the end of the budget (still importing): whatever it ran counts, no verdict.
        output = stopped.stderr or ""
        child = subprocess.CompletedProcess(stopped.cmd, 0, "", output.decode(errors="replace") if isinstance(output, bytes) else output)
    done = 0
    for line in child.stderr.splitlines():
        if line.startswith("Done ") and " runs " in line:
            done = int(line.split()[1])
        elif line.startswith("#"):
            try:
                done = max(done, int(line[1:].split()[0]))
            except (ValueError, IndexError):
                pass
    if child.returncode != 0:
        # atheris prints a target's uncaught Python exception on stdout, libFuzzer its verdict on
        # stderr; the input that failed is the artifact libFuzzer wrote into ``work``.
        failing = ""
        for name in sorted(os.listdir(work)):
            if name.startswith(("crash-", "timeout-", "oom-", "leak-")):
                with open(os.path.join(work, name), "rb") as handle:
                    data = handle.read()
                target = FUZZ_TARGETS[data[0] % len(FUZZ_TARGETS)] if data else "none"
                failing = f"\ninput ({name}, target {target}, {len(data)} bytes, hex): {data[:4096].hex()}"
                break
        findings.add(
            f"atheris found a failure (exit {child.returncode}):\n{child.stdout[-3000:]}\n{child.stderr[-1500:]}{failing}"
        )
    shutil.rmtree(work, ignore_errors=True)
    return done


def run_fuzz(count: int | None = None, seconds: float | None = None, seed: int = 1,
             progress: Progress | None = None) -> dict[str, Any]:
    """Seeded mutations and hypothesis for every target; atheris too when it is installed.

    With a count, each target gets an equal share: half seeded mutations, half hypothesis, and
    (with atheris) as many coverage-guided runs again. With a time budget the same shares of time,
    the set-up included: the run ends within ``seconds`` plus the input running at the end (a hang
    is cut at ``FUZZ_INPUT_SECONDS_MAX``) and the time to stop the atheris child
    (``ATHERIS_STOP_SECONDS``) and clean up.
    """
    started = time.monotonic()
    total = count if count is not None else (None if seconds is not None else DEFAULT_COUNTS["fuzz"])
    budget_end = None if total is not None else started + float(seconds or 0)
    findings = Findings()
    tallies: dict[str, dict[str, dict[str, int]]] = {}
    inputs = 0
    rng = random.Random(seed)
    has_atheris = atheris_available()
    hypothesis_missing = False
    atheris_runs = 0
    with _scratch("fuzz") as root:
        context = FuzzContext(root)
        try:
            split = 3 if has_atheris else 2
            # With a time budget every phase ends at a fixed point of it (what a phase overran,
            # the next ones give back), and atheris has what is left of it.
            phases_started = time.monotonic()
            share_seconds = 0.0 if budget_end is None else max(0.0, budget_end - phases_started) / len(FUZZ_TARGETS) / split
            for number, target in enumerate(FUZZ_TARGETS):
                tally = tallies.setdefault(target, {"mutation": {}, "hypothesis": {}})
                samples = context.samples[target]
                per_target = None if total is None else max(2, total // len(FUZZ_TARGETS) * 2 // split)
                deadline = phases_started + (2 * number + 1) * share_seconds
                done = 0
                while (done < per_target // 2) if per_target is not None else time.monotonic() < deadline:
                    _run_input(target, mutate(rng.choice(samples), rng, samples), context, findings, tally["mutation"])
                    done += 1
                inputs += done
                examples = (per_target - per_target // 2) if per_target is not None else 10**9
                stop_at = None if per_target is not None else phases_started + (2 * number + 2) * share_seconds
                if stop_at is not None and time.monotonic() >= stop_at:
                    ran = 0  # its share is spent already: not even hypothesis's start-up
                else:
                    ran = _hypothesis_inputs(target, samples, examples, seed + number,
                                             lambda data: _run_input(target, data, context, findings, tally["hypothesis"]),
                                             deadline=stop_at)
                if ran < 0:
                    hypothesis_missing = True
                else:
                    inputs += ran
                if progress:
                    progress(number + 1, len(FUZZ_TARGETS) + int(has_atheris))
            if has_atheris and (budget_end is None or time.monotonic() < budget_end):
                runs = max(1, total // split) if total is not None else 100_000_000
                limit = int(share_seconds * len(FUZZ_TARGETS)) if total is None else 900
                atheris_runs = _run_atheris(context, runs, limit, seed, findings, until=budget_end)
                inputs += atheris_runs
            if has_atheris and progress:
                progress(len(FUZZ_TARGETS) + 1, len(FUZZ_TARGETS) + 1)
        finally:
            context.close()
    notes = []
    if not has_atheris:
        notes.append("atheris is not installed: coverage-guided fuzzing skipped (pip install 'mwpstore[fuzz]')")
    if hypothesis_missing:
        notes.append("hypothesis is not installed: property-based inputs skipped (pip install 'mwpstore[test]')")
    if has_atheris and budget_end is not None and atheris_runs == 0:
        notes.append("atheris ran no input: its share of the time budget ended while it was starting "
                     "(its instrumented imports take seconds); give more --seconds")
    for note in notes:
        print(f"fuzz: {note}", file=sys.stderr)
    return _result("fuzz", seed, inputs, started, findings, {
        "inputs": inputs,
        "targets": list(FUZZ_TARGETS),
        "outcomes": tallies,
        "atheris": has_atheris,
        "atheris_runs": atheris_runs,
        "hypothesis": not hypothesis_missing,
        "input_seconds_max": FUZZ_INPUT_SECONDS_MAX,
        "notes": notes,
    })



# -- concurrency readers: other processes reading beside the writer --------------------------------

READER_KINDS = ("view-reader", "log-reader")
"""What a reader child opens in turn: a read-only view of the store, and a bare read-only log."""
READER_CHILDREN = 2
READER_READY_SECONDS = 60.0
READER_STOP_SECONDS = 60.0
READER_LOG_SAMPLES = 8
"""Records of each bare log open read again by position, and reported with their position."""
CONCURRENCY_SMALL_SEGMENT_BYTES = 64 * 1024
"""Segments of the concurrency rounds (but every fourth seed's): the writer seals one and rolls
over every few dozen commits, under the readers' opens."""


def _record_digest(record: bytes | memoryview) -> bytes:
    import blake3

    return blake3.blake3(record).digest(length=16)


def _read_view_once(path: str, rng: random.Random, problems: list[str]) -> dict[str, Any]:
    """Open a read-only view, read every Group in pages and check it; what it showed, per Group
    ``[head seq, hash at that seq]``."""
    from .authority import Authority
    from .messages import ZERO_HASH

    heads: dict[str, list[Any]] = {}
    with Authority.open(path, readonly=True) as view:
        for group in GROUPS:
            page = rng.choice((7, 100, 1000))
            after, previous = 0, ZERO_HASH
            while batch := view.read(group, after=after, limit=page):
                for event in batch:
                    if event.group != group or event.seq != after + 1 or event.prev_hash != previous:
                        problems.append(f"view of {group}: Event {event.seq} of {event.group} after {after} "
                                        f"({'chained' if event.prev_hash == previous else 'chain broken'})")
                        return {"heads": heads}
                    after, previous = event.seq, event.hash
            head_seq, head_hash = view.head(group)
            if (head_seq, head_hash) != (after, previous if after else head_hash):
                problems.append(f"view of {group}: read Events 1..{after}, but its head is {head_seq}")
            heads[group] = [after, previous.hex()]
    return {"heads": heads}


def _read_log_once(path: str, rng: random.Random, problems: list[str]) -> dict[str, Any]:
    """Open the store's log bare and read-only, scan every record and read some again by position;
    what it showed: its log id, end, record count, a digest of all its records in order, and
    samples ``[ordinal, position, record digest]``."""
    import blake3

    from .segment_log import SegmentLog

    digests: list[bytes] = []
    positions: list[int] = []
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        log_id, end = log.log_id, log.end
        for batch in log.scan(log.start, batch_records=rng.choice((1, 64, 4096))):
            positions.extend(batch.positions)
            digests.extend(_record_digest(record) for record in batch.records)
        chosen = sorted(rng.sample(range(len(positions)), min(READER_LOG_SAMPLES, len(positions))))
        if positions and len(positions) - 1 not in chosen:
            chosen.append(len(positions) - 1)
        for ordinal in chosen:
            if _record_digest(log.read(positions[ordinal])) != digests[ordinal]:
                problems.append(f"bare log: read({positions[ordinal]}) differs from the record the scan served there")
    whole = blake3.blake3()
    for digest in digests:
        whole.update(digest)
    return {
        "log_id": log_id,
        "end": end,
        "records": len(digests),
        "digest": whole.hexdigest(),
        "samples": [[ordinal, positions[ordinal], digests[ordinal].hex()] for ordinal in chosen],
    }


def concurrency_reader_child(argv: list[str]) -> None:
    """A reader beside the concurrency round's writer: ``STORE OUTPUT SEED KINDS``.

    Prints ``READY``, then until its standard input ends (and at least once) opens, in turn, each of ``KINDS``
    (comma-separated :data:`READER_KINDS`): a read-only view, read whole and checked (each Group's
    Events contiguous from 1, hash-chained, ending at the view's head), and a bare read-only
    ``SegmentLog`` of the store's log, scanned whole. Each open is noted with its
    ``time.monotonic()`` interval (one clock for every process of the machine) and what it showed
    (:func:`_read_view_once`, :func:`_read_log_once`); each refusal with its code and reason. At
    the end it writes all of it as JSON to ``OUTPUT`` (a temporary name, then a rename).
    """
    path, output, seed, kinds = argv[0], argv[1], argv[2], argv[3].split(",")
    done = threading.Event()

    def watch_input() -> None:
        for _ in sys.stdin:
            pass
        done.set()

    threading.Thread(target=watch_input, daemon=True).start()
    rng = random.Random(f"reader-{seed}")
    document: dict[str, Any] = {"views": [], "logs": [], "refusals": [], "errors": [], "problems": []}
    print("READY", flush=True)
    turn = 0
    while turn < len(kinds) or not done.is_set():  # each kind at least once
        kind = kinds[turn % len(kinds)]
        turn += 1
        started = time.monotonic()
        try:
            if kind == "view-reader":
                seen = _read_view_once(path, rng, document["problems"])
                document["views"].append({"t": [started, time.monotonic()], **seen})
            else:
                seen = _read_log_once(path, rng, document["problems"])
                document["logs"].append({"t": [started, time.monotonic()], **seen})
        except MwpError as exc:
            document["refusals"].append({"kind": kind, "t": [started, time.monotonic()], "code": exc.code,
                                         "reason": exc.detail.get("reason"), "message": exc.message[:400]})
        except Exception as exc:
            document["errors"].append({"kind": kind, "t": [started, time.monotonic()],
                                       "error": f"{_describe(exc)}\n{traceback.format_exc()[-1500:]}"})
        time.sleep(0.002)  # lets the writer's threads in on a loaded machine
    temporary = output + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(document, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(temporary, output)


@dataclasses.dataclass
class FinalStore:
    """What the round's store holds once it is closed and reopened, for :func:`check_reader`."""

    event_hashes: dict[str, list[bytes]]  # group -> the hash of each Event, seq 1 first
    log_positions: list[int]  # every record of the log, in order
    log_digests: list[bytes]  # _record_digest of each
    log_id: int
    log_ids: set[int]  # the log ids the store had during the round (each compaction makes a new log)

    @classmethod
    def of(cls, authority: Any, log_ids: set[int]) -> FinalStore:
        positions: list[int] = []
        digests: list[bytes] = []
        log = authority.log
        for batch in log.scan(log.start):
            positions.extend(batch.positions)
            digests.extend(_record_digest(record) for record in batch.records)
        hashes = {group: [event.hash for event in read_group(authority, group)] for group in GROUPS}
        return cls(hashes, positions, digests, log.log_id, set(log_ids) | {log.log_id})


def _overlaps(interval: list[float], spans: list[tuple[float, float]]) -> bool:
    return any(interval[0] <= stop and start <= interval[1] for start, stop in spans)


_SWITCHED_LOG = {("CORRUPTION", "segment_replaced"), ("CORRUPTION", "log_id_mismatch")}
"""What a bare read-only open says when a compaction switches the log directory while it opens:
a file it read by name again is another log's (docs/format/segment.md)."""


def _expected_refusal(refusal: dict[str, Any], compactions: list[tuple[float, float]]) -> bool:
    """A refusal the reader may meet: only while a compaction switched the store's files under
    it. A view says so (``INVALID_STATE``, reason ``recovery_needed``); a bare log open knows
    nothing of compactions: its directory is replaced under it (``_SWITCHED_LOG``), or gone for a
    moment (``STORAGE_FAILED``)."""
    if not _overlaps(refusal["t"], compactions):
        return False
    if refusal["kind"] == "view-reader":
        return refusal["code"] == "INVALID_STATE" and refusal["reason"] == "recovery_needed"
    return refusal["code"] == "STORAGE_FAILED" or (refusal["code"], refusal["reason"]) in _SWITCHED_LOG


def check_reader(document: dict[str, Any], final: FinalStore, compactions: list[tuple[float, float]]) -> list[str]:
    """What one reader child saw (:func:`concurrency_reader_child`'s document) against the final
    store; returns the violations found.

    - whatever it raised or found wrong while reading, and every refusal (``CORRUPTION``,
      ``STORAGE_FAILED``, anything typed) but those a compaction in flight explains
      (:func:`_expected_refusal`);
    - each view showed a prefix of each Group: its head's seq is in the final store, with the same
      Event hash (the chain the reader checked makes that the whole prefix);
    - each bare log open showed a prefix of the log: as many records as it served, the final log's
      first ones with the same digests (a compaction keeps every record, in order, when nothing is
      redacted or archived, as in these rounds); the log id of a log the store had; and when it is
      the final log's, each sampled record at the same position and exactly the final records
      below its end;
    - what a reader saw never shrank from one open to its next.
    """
    import bisect

    import blake3

    problems = [f"reader check failed: {problem}" for problem in document.get("problems", [])]
    problems += [f"reader raised ({error['kind']}): {error['error']}" for error in document.get("errors", [])]
    for refusal in document.get("refusals", []):
        if not _expected_refusal(refusal, compactions):
            during = "during a compaction" if _overlaps(refusal["t"], compactions) else "while the writer was appending"
            problems.append(f"{refusal['kind']} refused with {refusal['code']} ({refusal['reason']}) {during}: {refusal['message']}")
    previous: dict[str, int] = {}
    for view in document.get("views", []):
        for group, (seq, digest) in view["heads"].items():
            hashes = final.event_hashes.get(group, [])
            if seq > len(hashes):
                problems.append(f"a view showed {group} up to {seq}; the final store ends at {len(hashes)}")
            elif seq and hashes[seq - 1].hex() != digest:
                problems.append(f"a view showed {group} Event {seq} with hash {digest[:16]}...; the final store's is {hashes[seq - 1].hex()[:16]}...")
            if seq < previous.get(group, 0):
                problems.append(f"a view showed {group} up to {seq} after an earlier one showed {previous[group]}")
            previous[group] = max(seq, previous.get(group, 0))
    logs = document.get("logs", [])
    whole, counted = blake3.blake3(), 0
    for seen in sorted(logs, key=lambda seen: seen["records"]):  # the digests of the final log's prefixes, in one pass
        records = seen["records"]
        if records > len(final.log_digests):
            problems.append(f"a bare log open served {records} records; the final log holds {len(final.log_digests)}")
            continue
        for digest in final.log_digests[counted:records]:
            whole.update(digest)
        counted = max(counted, records)
        if whole.hexdigest() != seen["digest"]:
            problems.append(f"a bare log open served {records} records that are not the final log's first {records}")
    most = 0
    for seen in logs:
        if seen["log_id"] not in final.log_ids:
            problems.append(f"a bare log open read log id {seen['log_id']}, which the store never had")
        if seen["records"] < most:
            problems.append(f"a bare log open served {seen['records']} records after an earlier one served {most}")
        most = max(most, seen["records"])
        same_log = seen["log_id"] == final.log_id
        for ordinal, position, digest in seen["samples"]:
            if ordinal >= len(final.log_digests) or final.log_digests[ordinal].hex() != digest:
                problems.append(f"a bare log open served record {ordinal} (position {position}) unlike the final log's")
            elif same_log and final.log_positions[ordinal] != position:
                problems.append(f"a bare log open served record {ordinal} at position {position}; the final log has it at {final.log_positions[ordinal]}")
        if same_log and bisect.bisect_left(final.log_positions, seen["end"]) != seen["records"]:
            problems.append(f"a bare log open ended at {seen['end']} with {seen['records']} records; the final log "
                            f"holds {bisect.bisect_left(final.log_positions, seen['end'])} below that end")
    return problems


def judge_reader_exit(returncode: int | None, stderr: str, output: str) -> tuple[dict[str, Any] | None, str]:
    """(document, "") for a reader child that stopped when told and wrote its document; (None,
    the violation) for one killed by a signal, that exited otherwise or whose document is missing
    or unreadable."""
    if returncode is None:
        return None, f"did not stop within {READER_STOP_SECONDS:.0f} s of being told to"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return None, f"died of signal {name}: {stderr[-1500:]}"
    if returncode != 0:
        return None, f"exited with {returncode}: {stderr[-1500:]}"
    try:
        with open(output, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as exc:
        return None, f"left no readable document ({type(exc).__name__}: {exc})"
    if not isinstance(document, dict):
        return None, "left a document that is not an object"
    return document, ""


class _ReaderChild:
    """One reader child process of a concurrency round, and how it is started and stopped."""

    def __init__(self, store: str, output: str, seed: str, kinds: list[str]) -> None:
        self.output = output
        self.errors = tempfile.TemporaryFile(mode="w+")
        command = _python_command("concurrency_reader_child", store, output, seed, ",".join(kinds))
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True)
        self.lines = _LineReader(self.process.stdout)
        self.lines.start()

    def wait_ready(self) -> bool:
        waited = time.monotonic() + READER_READY_SECONDS
        while not self.lines.ready.wait(timeout=0.02):
            if self.process.poll() is not None or time.monotonic() > waited:
                return False
        return True

    def stop(self) -> tuple[dict[str, Any] | None, str]:
        """Tell it to stop (its standard input ends), wait; (document, violation)."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=READER_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            return judge_reader_exit(None, "", self.output)
        self.errors.seek(0)
        stderr = self.errors.read()
        self.errors.close()
        return judge_reader_exit(self.process.returncode, stderr, self.output)

    def kill(self) -> None:
        """End it at once if it still runs (a round that stopped early); idempotent."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]
        self.errors.close()


# -- concurrency: many threads, every operation, a watchdog ----------------------------------------

CONCURRENCY_ROUND_SECONDS = 4.0
CONCURRENCY_WATCHDOG_SECONDS = 60.0
"""A round whose threads have not all finished this long after it should have is a deadlock."""


def _concurrency_round(path: str, round_seconds: float, seed: int, findings: Findings, ops: dict[str, int],
                       skipped: set[str]) -> None:
    from .agent_store import AgentStore
    from .authority import Authority
    from .delivery import Delivery
    from .errors import Rejection, StoreClosed
    from .limits import SEGMENT_BYTES_DEFAULT
    from .snapshot import verify_snapshot

    context = f"round {os.path.basename(path)} (seed {seed}): "
    store = os.path.join(path, "authority")
    segment_bytes = SEGMENT_BYTES_DEFAULT if seed % 4 == 3 else CONCURRENCY_SMALL_SEGMENT_BYTES
    authority = Authority.open(store, segment_bytes=segment_bytes)
    ensure_groups(authority)
    oracle = Acknowledged()
    # Reentrant: a check made under the lock reports what it finds through problem(), which takes
    # it too (a plain Lock hung the acker, and then the watchdog's report, on the first violation).
    lock = threading.RLock()
    stop = threading.Event()
    duplicates: dict[str, list[Any]] = {}
    seen_by_subscriber: dict[str, list[int]] = {group: [] for group in GROUPS}
    agents = [AgentStore.open(os.path.join(path, f"agent-{index}"), projections=[CountingProjection()]) for index in range(2)]
    compactions: list[tuple[float, float]] = []  # time.monotonic() spans, which the reader children share
    log_ids = {authority.log.log_id}
    rollovers: list[tuple[float, float]] = []  # a new segment appeared between these two moments

    def count(name: str, amount: int = 1) -> None:
        with lock:
            ops[name] = ops.get(name, 0) + amount

    def problem(message: str, *, wait: float = -1) -> None:
        """Record a finding; with ``wait`` (the watchdog's report) give up on the lock after that
        many seconds, since a stuck thread may hold it, and record the finding all the same."""
        locked = lock.acquire(timeout=wait)
        try:
            findings.add(context + message + ("" if locked else " (the harness lock was held by a stuck thread)"))
        finally:
            if locked:
                lock.release()

    def guarded(name: str, body: Callable[[random.Random], None], index: int) -> Callable[[], None]:
        until_stopped = name.startswith("subscriber-")  # past the deadline too: the round's close stops it

        def run() -> None:
            rng = random.Random(f"{seed}-{name}-{index}")
            try:
                while not stop.is_set() and (until_stopped or time.monotonic() < deadline):
                    body(rng)
            except StoreClosed as exc:
                if stop.is_set():  # the round closed the authority under a poll: the end, expected
                    count("stopped_by_close")
                    return
                problem(f"{name}-{index} raised {_describe(exc)} before the round closed the authority\n{traceback.format_exc()[-1200:]}")
            except Exception as exc:
                problem(f"{name}-{index} raised {_describe(exc)}\n{traceback.format_exc()[-1200:]}")
        return run

    counters = {"write": 0}

    def write(rng: random.Random) -> None:
        with lock:
            counters["write"] += 1
            action = f"w{counters['write']}"
        commands = workload_commands(authority, rng, action)
        with lock:
            oracle.attempted.update(command.action_id for command in commands)
        try:
            if len(commands) == 1:
                receipts = [authority.accept(commands[0])]
            else:
                receipts = [result.unwrap() for result in authority.accept_many(commands) if result.ok]
        except Rejection:
            count("rejected")
            return
        with lock:
            for receipt in receipts:
                oracle.add_receipt(receipt.action_id, receipt.group, receipt.seq, receipt.event_id)
        count("accepted", len(receipts))

    def same_action(rng: random.Random) -> None:
        # Two threads submit the very same Commands: each must get the one original receipt.
        number = rng.randrange(40)
        command = _mission_create(GROUPS[number % 2], f"dup-{number}", f"dup-{number}")
        with lock:
            oracle.attempted.add(command.action_id)
        receipt = authority.accept(command)
        with lock:
            duplicates.setdefault(command.action_id, []).append(receipt)
        count("same_action")
        time.sleep(0.001)

    def read(rng: random.Random) -> None:
        group = rng.choice(GROUPS)
        head = authority.head(group)[0]
        after = rng.randint(0, max(0, head))
        events = authority.read(group, after=after, limit=rng.choice((1, 10, 1000)))
        expected = list(range(after + 1, after + 1 + len(events)))
        if [event.seq for event in events] != expected:
            problem(f"read({group}, after={after}) returned sequences {[e.seq for e in events][:5]}...")
        for previous, event in zip(events, events[1:]):
            if event.prev_hash != previous.hash:
                problem(f"read({group}) returned a broken chain at {event.seq}")
        count("read")

    def subscribe(group: str) -> Callable[[random.Random], None]:
        subscription = authority.subscribe(group, after=0)

        def body(rng: random.Random) -> None:
            # Past the deadline no timeout: once the writers stop, only the round's close ends that poll.
            events = subscription.poll(timeout=None if time.monotonic() >= deadline else rng.choice((None, 0.05, 0.5)))
            seen = seen_by_subscriber[group]
            for event in events:
                if event.seq != (seen[-1] if seen else 0) + 1:
                    problem(f"subscriber of {group} got seq {event.seq} after {seen[-1] if seen else 0}")
                seen.append(event.seq)
            count("subscribe_events", len(events))
        return body

    acked: dict[str, int] = {}

    def ack(rng: random.Random) -> None:
        group = rng.choice(GROUPS)
        cursor = rng.randint(0, authority.head(group)[0])
        stored = authority.ack("consumer-c", group, cursor)
        with lock:
            previous = acked.get(group, 0)
            if stored < previous or stored < cursor:
                problem(f"ack({group}, {cursor}) returned {stored} after {previous}")
            acked[group] = max(previous, stored)
        count("ack")

    def snapshot(rng: random.Random) -> None:
        group = rng.choice(GROUPS)
        ref = authority.snapshot(group)
        verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), org=ORG, group=group)
        with lock:
            oracle.snapshots.add((ref.group, ref.seq))
        count("snapshot")
        time.sleep(0.2)

    def verify(rng: random.Random) -> None:
        report = authority.verify()
        if not report.ok:
            problem(f"verify() during load: {report.problems[:3]}")
        count("verify")
        time.sleep(0.3)

    def compact(rng: random.Random) -> None:
        started = time.monotonic()
        try:
            authority.compact()
        finally:  # the readers' refusals in this span are the compaction's
            with lock:
                compactions.append((started, time.monotonic()))
        with lock:
            log_ids.add(authority.log.log_id)
        count("compact")
        time.sleep(0.5)

    def deliver(index: int) -> Callable[[random.Random], None]:
        delivery = Delivery(agents[index], authority, consumer=f"agent-{index}", batch_events=5 + 20 * index)

        def body(rng: random.Random) -> None:
            for group in GROUPS:
                count("delivered", max(0, delivery.pull_once(group)))
        return body

    def watch_segments() -> None:
        """Note each rollover of the writer's log (a new segment file), with when it happened."""
        log_id, segments, looked = None, 0, time.monotonic()
        while not stop.is_set() and time.monotonic() < deadline:
            log = authority._pair[0]  # the writer's handle, read without a lock: a tuple swapped whole
            now, current = time.monotonic(), len(log._segments)
            if log._log_id != log_id:  # a compaction's new log: its segments are its copy's, not rollovers
                log_id, segments = log._log_id, current
            elif current > segments:
                with lock:
                    rollovers.extend([(looked, now)] * (current - segments))
                segments = current
            looked = now
            time.sleep(0.005)

    reader_kinds = [kind for kind in READER_KINDS if kind not in skipped]
    readers = [
        _ReaderChild(store, os.path.join(path, f"reader-{index}.json"), f"{seed}-{index}", reader_kinds[index:] + reader_kinds[:index])
        for index in range(READER_CHILDREN if reader_kinds else 0)
    ]
    try:
        for index, reader in enumerate(readers):  # reading before the load starts: the round overlaps them whole
            if not reader.wait_ready():
                problem(f"reader-{index} did not start")
        deadline = time.monotonic() + round_seconds
        plan: list[tuple[str, Callable[[random.Random], None], int]] = []
        plan += [("writer", write, index) for index in range(6)]
        plan += [("same_action", same_action, index) for index in range(2)]
        plan += [("reader", read, index) for index in range(2)]
        plan += [(f"subscriber-{group}", subscribe(group), 0) for group in GROUPS]
        plan += [("acker", ack, 0), ("snapshotter", snapshot, 0), ("verifier", verify, 0), ("compactor", compact, 0)]
        plan += [("agent", deliver(index), index) for index in range(2)]
        plan = [entry for entry in plan if entry[0] not in skipped]
        threads = [threading.Thread(target=guarded(name, body, index), name=f"round-{seed}-{name}-{index}", daemon=True)
                   for name, body, index in plan]
        watcher = threading.Thread(target=watch_segments, name=f"round-{seed}-segments", daemon=True)
        for thread in [*threads, watcher]:
            thread.start()
        watchdog = time.monotonic() + round_seconds + CONCURRENCY_WATCHDOG_SECONDS
        subscribers = [thread for thread in threads if "-subscriber-" in thread.name]  # the round's close stops them
        waited = [thread for thread in [*threads, watcher] if thread not in subscribers]
        for thread in waited:
            thread.join(timeout=max(0.0, watchdog - time.monotonic()))
        stop.set()
        stuck = [thread for thread in waited if thread.is_alive()]
        if stuck:
            frames = sys._current_frames()
            stacks = "".join(
                f"\n--- {thread.name}:\n" + "".join(traceback.format_stack(frames[thread.ident])[-6:])
                for thread in stuck if thread.ident in frames
            )
            problem(f"deadlock: {len(stuck)} thread(s) still running {CONCURRENCY_WATCHDOG_SECONDS:.0f} s after the round ended{stacks[-4000:]}",
                    wait=5.0)
            return  # the store is left open: closing it could hang on the same lock
        ops["threads"] = len(threads)
        ops["segment_rollovers"] = ops.get("segment_rollovers", 0) + len(rollovers)
        documents = []
        for index, reader in enumerate(readers):
            document, failure = reader.stop()
            if failure:
                problem(f"reader-{index} {failure}")
            documents.append(document)
    finally:
        for reader in readers:
            reader.kill()
    try:
        for action, receipts in duplicates.items():
            if any(receipt != receipts[0] for receipt in receipts):
                problem(f"the same action {action} from two threads got different receipts")
        for index, agent in enumerate(agents):
            delivery = Delivery(agent, authority, consumer=f"agent-{index}")
            for group in GROUPS:
                delivery.catch_up(group)
            findings.extend(check_agent(agent, authority, consumer=f"agent-{index}"), context + f"agent-{index}: ")
            if any(agent.cursor(group) != authority.head(group)[0] for group in GROUPS):
                problem(f"agent-{index} did not catch up to the heads")
            agent.close()
        findings.extend(check_authority(authority, oracle, full_verify=True), context)
    finally:  # what a subscriber still waits in poll() for meets the close: StoreClosed, and it stops
        authority.close()
    watchdog = time.monotonic() + CONCURRENCY_WATCHDOG_SECONDS
    for thread in subscribers:
        thread.join(timeout=max(0.0, watchdog - time.monotonic()))
    if any(thread.is_alive() for thread in subscribers):
        problem(f"deadlock: a subscriber still waits in poll() {CONCURRENCY_WATCHDOG_SECONDS:.0f} s after the authority closed")
        return
    with _boot_id("concurrency-reopen"), Authority.open(store, segment_bytes=segment_bytes) as reopened:
        findings.extend(check_authority(reopened, oracle, full_verify=True), context + "after reopen: ")
        for group in GROUPS:  # each subscriber saw exactly 1..head, in order, up to where it stopped
            seen = seen_by_subscriber[group]
            rest = reopened.read(group, after=seen[-1] if seen else 0, limit=100_000)
            if seen + [event.seq for event in rest] != list(range(1, reopened.head(group)[0] + 1)):
                problem(f"subscriber of {group} saw a gap or a repeat")
        if readers:
            final = FinalStore.of(reopened, log_ids)
            for index, document in enumerate(documents):
                if document is None:
                    continue
                findings.extend(check_reader(document, final, compactions), context + f"reader-{index}: ")
                opens = document["views"] + document["logs"]
                count("view_reader_opens", len(document["views"]))
                count("log_reader_opens", len(document["logs"]))
                count("reader_refusals_during_compaction", sum(_expected_refusal(refusal, compactions) for refusal in document["refusals"]))
                count("reader_opens_across_rollover", sum(_overlaps(seen["t"], rollovers) for seen in opens))
                count("reader_opens_across_compaction", sum(_overlaps(seen["t"], compactions) for seen in opens))


def run_concurrency(count: int | None = None, seconds: float | None = None, seed: int = 1,
                    progress: Progress | None = None, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rounds of 18 threads mixing every operation; each round checked, with a watchdog.

    Beside the threads, :data:`READER_CHILDREN` processes read the store as other processes do
    (:func:`concurrency_reader_child`: read-only views and bare read-only logs, opened again and
    again), and what they saw must be a prefix of the final store (:func:`check_reader`). Most
    rounds use 64 KiB segments, so the writer seals one and rolls over under the readers' opens;
    ``operations`` counts the rollovers and the reader opens that spanned one.

    ``skip`` leaves out thread kinds (``writer``, ``same_action``, ``reader``, ``acker``,
    ``snapshotter``, ``verifier``, ``compactor``, ``agent``, ``subscriber-<group>``) and reader
    kinds (``view-reader``, ``log-reader``; both: no reader child), to bisect
    a failure; the environment variable ``MWPSTORE_CONCURRENCY_SKIP`` (comma-separated) does the
    same from the command line.
    """
    skipped = set(skip) | set(filter(None, os.environ.get("MWPSTORE_CONCURRENCY_SKIP", "").split(",")))
    started = time.monotonic()
    budget = Budget(count, seconds, DEFAULT_COUNTS["concurrency"])
    findings = Findings()
    ops: dict[str, int] = {}
    rounds = 0
    round_seconds = CONCURRENCY_ROUND_SECONDS if seconds is None else min(30.0, max(CONCURRENCY_ROUND_SECONDS, seconds / 10))
    with _scratch("concurrency") as root:
        while budget.more(rounds):
            path = os.path.join(root, f"round-{rounds}")
            try:
                _concurrency_round(path, round_seconds, seed + rounds, findings, ops, skipped)
            except Exception as exc:
                findings.add(f"round {rounds}: {_describe(exc)}\n{traceback.format_exc()[-1500:]}")
            rounds += 1
            shutil.rmtree(path, ignore_errors=True)
            budget.report(rounds, progress)
    return _result("concurrency", seed, rounds, started, findings, {
        "rounds": rounds,
        "round_seconds": round_seconds,
        "watchdog_seconds": CONCURRENCY_WATCHDOG_SECONDS,
        "operations": ops,
        "skipped": sorted(skipped),
    })

# -- the command -------------------------------------------------------------------------------------


def _suite_functions() -> dict[str, Callable[..., dict[str, Any]]]:
    return {
        "crash": run_crash,
        "power": run_power,
        "corruption": run_corruption,
        "disk": run_disk,
        "fuzz": run_fuzz,
        "concurrency": run_concurrency,
        "lmdb-sweep": run_lmdb_sweep,
    }


def run_suite(name: str, *, count: int | None = None, seconds: float | None = None, seed: int = 1,
              progress: Progress | None = None) -> dict[str, Any]:
    """Run one suite by name; an unexpected exception inside it counts as a violation."""
    started = time.monotonic()
    options: dict[str, Any] = {}
    verify_every = os.environ.get("MWPSTORE_VERIFY_EVERY")
    if verify_every and name in ("crash", "power"):
        options["verify_every"] = max(1, int(verify_every))
    if name == "lmdb-sweep":
        options["bits"] = os.environ.get("MWPSTORE_SWEEP_BITS", "rotating")
        options["damage"] = os.environ.get("MWPSTORE_SWEEP_DAMAGE", "bits")
        if options["damage"] not in SWEEP_DAMAGES:
            raise ValueError(f"MWPSTORE_SWEEP_DAMAGE={options['damage']!r}: choose from {list(SWEEP_DAMAGES)}")
        options["workers"] = max(1, int(os.environ.get("MWPSTORE_SWEEP_WORKERS", "1")))
        stores = os.environ.get("MWPSTORE_SWEEP_STORES")
        if stores:
            options["stores"] = tuple(store.strip() for store in stores.split(",") if store.strip())
            unknown = [store for store in options["stores"] if store not in SWEEP_STORES]
            if unknown or not options["stores"]:
                raise ValueError(f"MWPSTORE_SWEEP_STORES={stores!r}: choose from {list(SWEEP_STORES)}")
        options["record"] = os.environ.get("MWPSTORE_SWEEP_RECORD") or None
    try:
        return _suite_functions()[name](count=count, seconds=seconds, seed=seed, progress=progress, **options)
    except Exception as exc:  # the harness itself failed: report it, never pass silently
        findings = Findings()
        findings.add(f"suite {name} stopped: {_describe(exc)}\n{traceback.format_exc()[-3000:]}")
        return _result(name, seed, 0, started, findings, {})


def run_torture(args: Any) -> int:
    """``mwpstore torture``: run the chosen suites, print their figures, exit 1 on any violation."""
    from .cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, Progress as ProgressBar, print_table

    names = args.suite or list(SUITES)
    unknown = [name for name in names if name not in SUITES + OPTIONAL_SUITES]
    if unknown:
        print(f"unknown suite(s) {unknown}; choose from {list(SUITES + OPTIONAL_SUITES)}", file=sys.stderr)
        return EXIT_USAGE
    if (args.count is not None and args.count < 1) or (args.seconds is not None and args.seconds <= 0):
        print("--count must be positive and --seconds above zero", file=sys.stderr)
        return EXIT_USAGE
    results = []
    for name in names:
        if not args.json:
            short = f"{DEFAULT_COUNTS[name]} iterations (short run)" if name in DEFAULT_COUNTS else "every case"
            budget = f"{args.count} iterations" if args.count else (f"{args.seconds:g} s" if args.seconds else short)
            print(f"suite {name}: {budget}, seed {args.seed}", file=sys.stderr, flush=True)
        result = run_suite(name, count=args.count, seconds=args.seconds, seed=args.seed, progress=ProgressBar(name))
        results.append(result)
        if not args.json:
            _print_result(result)
    total = sum(result["violations"] for result in results)
    if args.json:
        print(json.dumps({"results": results, "violations": total}, indent=2, sort_keys=True, default=str))
    else:
        print()
        print_table([(r["suite"], r["seed"], r["iterations"], f"{r['duration_s']:.1f}", r["violations"]) for r in results],
                    ["suite", "seed", "iterations", "seconds", "violations"])
        print("\nall invariants held" if total == 0 else f"\n{total} violation(s): see the messages above")
    return EXIT_OK if total == 0 else EXIT_CHECK_FAILED


def _print_result(result: dict[str, Any]) -> None:
    print(f"== {result['suite']}: {result['iterations']} iterations in {result['duration_s']:.1f} s, "
          f"seed {result['seed']}, violations {result['violations']}")
    for key, value in result["details"].items():
        if key in ("violation_messages", "violation_kinds"):
            continue
        print(f"   {key}: {json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value}")
    for message in result["details"].get("violation_messages", []):
        print(f"   VIOLATION: {message}")
    sys.stdout.flush()


if __name__ == "__main__":  # pragma: no cover - `python -m mwpstore.torture` runs like `mwpstore torture`
    from .cli import main as _main

    sys.exit(_main(["torture", *sys.argv[1:]]))
