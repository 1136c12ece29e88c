"""Readers in other processes, stepped through every maintenance step of the writer.

The writer (this process) is stopped at each point of a maintenance step: the fail points
(``mwpstore/failpoints.py``) the step passes (compaction, rebuild, redo, snapshot, archive,
redaction, ``audit.delete``, key rotation, an accept that rolls the log over), the renames and
removals of the index switch, the compaction and the audit log, and each file operation of the C
log (through ``io_seam.RecordingIO``) for a rollover and for a writer's open that cuts a torn tail.
While it waits, a child process (``cross_process_reader.py``) runs the readers from outside to
completion: a read-only view, a bare read-only ``SegmentLog``, ``mwpstore tail``, and the snapshot
and audit-log files read and verified. Then the writer finishes the step, and each reader must
have served a prefix of the store's history (the same hash at each sequence; a bare log's records
those of the log of its log id, at the same positions) or refused with a reason the docs allow at
that moment; a fresh reader after the step serves the whole of it. The reverse too: a reader
stopped mid-read (after a page, or in its open between mapping two segment files) while the writer
runs a whole step, then resumed.

CI runs ``tail`` and the file reads at a subset of the points (the view and the bare log at every
one) and a subset of a rollover's file operations; ``MWPSTORE_CROSS_PROCESS_STEPS=all`` runs every
reader at every point and every file operation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import blake3
import msgspec
import pytest

from authority_helpers import GROUP, OWNER, group_create, in_a_forked_child, mission_create
from mwpstore import Authority, authority as authority_module, failpoints, limits
from mwpstore.io_seam import RecordingIO
from mwpstore.segment_log import SegmentLog
from segment_readers import scratch_directory

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "cross_process_reader.py")
FULL = os.environ.get("MWPSTORE_CROSS_PROCESS_STEPS", "") == "all"
WAIT = 60  # seconds a pause or a reader waits before the test fails instead of hanging
ARCHIVED = "g-2"  # archived (and compacted away) during the steps that need one
SIDE = "g-3"
ALL = "view,log,tail,files"
QUICK = "view,log"

# What a reader may answer instead of serving, and where the docs allow it.
# docs/api.md, "Reading from another process": a view finds a compaction marker (COMPACT-SWITCH)
# and is refused at once; files swapped while it opens (index/ replaced) make it retry for up to
# two seconds before it gives up the same way: INVALID_STATE, reason recovery_needed.
VIEW_SWITCHING = {("INVALID_STATE", "recovery_needed")}
# docs/format/segment.md, "read-only open beside a live writer": a bare open that meets a
# compaction's switch is refused, never served: a file read by name again that is another log's
# (segment_replaced; log_id_mismatch for one taken on a clean close's word), or a file gone from
# its name (STORAGE_FAILED).
LOG_SWITCHING = {("CORRUPTION", "segment_replaced"), ("CORRUPTION", "log_id_mismatch"), ("STORAGE_FAILED", None)}


def _digest(record: bytes | memoryview) -> str:
    return blake3.blake3(record).hexdigest(length=16)


def _mission(number: int, group: str = GROUP) -> Any:
    """About 1 KB: a 64 KiB segment rolls over every 50 or so."""
    command = mission_create(f"m-{number}", group=group, action_id=f"a-{group}-{number}")
    return msgspec.structs.replace(command, body={**command.body, "title": "x" * 1000})


class History:
    """What the writer's store held, gathered before and after a step: each Group's Event hashes
    by sequence (a compaction drops an archived Group's from the log, not from its history), and
    each log generation's records by log id."""

    def __init__(self) -> None:
        self.hashes: dict[str, list[str]] = {}
        self.logs: dict[int, list[list[Any]]] = {}
        self.final = 0  # the log id gathered last

    def gather(self, authority: Authority) -> None:
        for group in authority.groups():
            floor = authority.replay_floor(group)[0]
            known = self.hashes.setdefault(group, [])
            after = max(floor, len(known))
            while batch := authority.read(group, after=after, limit=1000):
                known.extend(event.hash.hex() for event in batch)
                after = batch[-1].seq
        log = authority.log
        self.final = log.log_id
        self.logs[log.log_id] = [[p, _digest(r)] for batch in log.scan(log.start) for p, r in zip(batch.positions, batch.records)]


class Pause:
    """The writer thread stops at the ``count``-th time it reaches ``point`` until ``go`` is set."""

    def __init__(self, point: str, count: int = 1) -> None:
        self.point, self.remaining = point, count
        self.reached, self.go = threading.Event(), threading.Event()
        self.writer: int | None = None

    def at(self, point: str) -> None:
        if point != self.point or threading.get_ident() != self.writer:
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.reached.set()
            assert self.go.wait(WAIT), f"the writer waited at {point} for more than {WAIT} s"


def run_reader(store: str, kinds: str, where: str = "") -> subprocess.Popen[str]:
    command = [sys.executable, READER, store, kinds] + ([where] if where else [])
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=HERE, env={**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})


def reader_lines(child: subprocess.Popen[str]) -> list[dict[str, Any]]:
    try:
        out, err = child.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"a reader did not finish within {WAIT} s: {out[-2000:]} {err[-2000:]}")
    assert child.returncode == 0, f"the reader exited with {child.returncode}: {err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def read_from_outside(store: str, kinds: str) -> list[dict[str, Any]]:
    return reader_lines(run_reader(store, kinds))


def problems_in(lines: list[dict[str, Any]], history: History, allowed: dict[str, set[Any]], *, whole: History | None = None) -> list[str]:
    """What the readers' lines show wrong against ``history``: anything raised untyped, a refusal
    not in ``allowed`` (by reader kind), anything served that is not the history's (a prefix;
    with ``whole``, all of it: the final store's every Group and its log's every record)."""
    problems = []
    for line in lines:
        kind = line["kind"]
        if "error" in line:
            problems.append(f"{kind} raised: {line['error']}")
            continue
        if "refused" in line:
            code, reason, message = line["refused"]
            if (code, reason) not in allowed.get(kind, set()) and (code, None) not in allowed.get(kind, set()):
                problems.append(f"{kind} refused with {code} ({reason}): {message}")
            continue
        served = line["served"]
        if kind == "view":
            for group, (floor, hashes) in served.items():
                known = history.hashes.get(group, [])
                if hashes != known[floor:floor + len(hashes)]:
                    problems.append(f"view served {group} {floor + 1}..{floor + len(hashes)} unlike its history ({len(known)} Events)")
                elif whole is not None and floor + len(hashes) != len(known):
                    problems.append(f"a view after the step served {group} up to {floor + len(hashes)} of {len(known)}")
            if whole is not None and sorted(served) != sorted(history.hashes):
                problems.append(f"a view after the step served Groups {sorted(served)}, the store has {sorted(history.hashes)}")
        elif kind == "log":
            generation = history.logs.get(served["log_id"])
            records = served["records"]
            if generation is None:
                problems.append(f"the bare log served log id {served['log_id']}, which the store never had")
            elif records != generation[:len(records)]:
                problems.append(f"the bare log served {len(records)} records that are not the first of log {served['log_id']}")
            elif whole is not None and (served["log_id"] != whole.final or records != generation):
                problems.append(f"the bare log after the step served {len(records)} records of log {served['log_id']}, "
                                f"not the {len(whole.logs[whole.final])} of the final log {whole.final}")
        elif kind == "tail":
            for group, events in served.items():
                if isinstance(events, dict):
                    refusal = tuple(events.get("refused", ("", "")))[:2]
                    # a Group whose snapshot directory holds no file yet: not created in the view
                    if refusal not in allowed.get("view", set()) and not (refusal[0] == "NOT_FOUND" and group not in history.hashes):
                        problems.append(f"tail of {group} failed: {events}")
                    continue
                known = history.hashes.get(group, [])
                if any(seq > len(known) or known[seq - 1] != digest for seq, digest in events):
                    problems.append(f"tail served {group} Events unlike its history: {events[:3]}...")
                elif [seq for seq, _ in events] != list(range(events[0][0], events[0][0] + len(events))) if events else False:
                    problems.append(f"tail served {group} Events not contiguous")
        elif kind == "files":
            for name, outcome in served.items():
                if "served" not in outcome:
                    problems.append(f"{name}: {outcome}")
    return problems


# -- the steps: each prepares the store and runs the step in the writer thread ---------------------


@contextlib.contextmanager
def paused_writer(monkeypatch, pause: Pause) -> Iterator[None]:
    """Route the fail points, and the index switch's and the compaction's renames, to ``pause``."""
    real_hit, real_rename, real_replace = failpoints.hit, os.rename, os.replace

    def hit(name: str) -> None:
        pause.at(name)
        real_hit(name)

    def rename(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        real_rename(source, target, *args, **kwargs)
        name = os.path.basename(os.fspath(target))
        pause.at(f"rename:{name.split('-')[0] + '-' if name.startswith('audit-') else name}")

    monkeypatch.setattr(failpoints, "hit", hit)
    def replace(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        real_replace(source, target, *args, **kwargs)
        name = os.path.basename(os.fspath(target))
        pause.at(f"replace:{name.split('-')[0] + '-' if name.startswith('audit-') else name}")

    def remover(real: Callable[..., Any], verb: str) -> Callable[..., Any]:
        def remove(target: Any, *args: Any, **kwargs: Any) -> None:
            name = os.path.basename(os.fspath(target))
            pause.at(f"{verb}:{name.split('-')[0] + '-' if name.startswith('audit-') else name}")  # before: still there
            real(target, *args, **kwargs)

        return remove

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "remove", remover(os.remove, "remove"))
    monkeypatch.setattr(os, "unlink", remover(os.unlink, "unlink"))
    monkeypatch.setattr(authority_module, "REDO_COMMIT_RECORDS", 10)  # the rebuild's and redo's commits come every 10 records
    yield


def _paused_step(monkeypatch, pause: Pause, run: Callable[[], Any], meanwhile: Callable[[], Any]) -> tuple[Any, Any]:
    """Run the step ``run`` in a writer thread; once it waits at ``pause``'s point, ``meanwhile()``;
    then let it finish. (What ``meanwhile`` returned, what the step returned.)"""
    outcome: list[Any] = []

    def writer() -> None:
        pause.writer = threading.get_ident()
        try:
            outcome.append(run())
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)
        pause.reached.set()  # also when the step ended without reaching the point: said below

    with paused_writer(monkeypatch, pause):
        thread = threading.Thread(target=writer, name="writer")
        thread.start()
        try:
            assert pause.reached.wait(WAIT), f"the writer never reached {pause.point}"
            assert not outcome, f"the step ended before {pause.point}: {outcome}"
            seen = meanwhile()
        finally:
            pause.go.set()
            thread.join(WAIT)
    assert not thread.is_alive()
    assert not isinstance(outcome[0], BaseException), outcome
    return seen, outcome[0]


def make_store(path: str, reopened: bool = False) -> Authority:
    """Three Groups, 120 missions across them (several segments), a snapshot of one. ``reopened``:
    then closed cleanly and opened again, its log's clean-close marker still there."""
    authority = Authority.open(path, segment_bytes=limits.SEGMENT_BYTES_MIN)
    for group in (GROUP, ARCHIVED, SIDE):
        authority.accept(group_create(group))
    for number in range(1, 121):
        authority.accept(_mission(number, group=(GROUP, ARCHIVED, SIDE)[number % 3]))
    authority.snapshot(SIDE)
    if reopened:
        authority.close()
        authority = Authority.open(path, segment_bytes=limits.SEGMENT_BYTES_MIN)
    return authority


def step_compact(authority: Authority) -> Callable[[], Any]:
    authority.redact(GROUP, 3, actor=OWNER, action_id="redact-3", reason="test")
    authority.archive(ARCHIVED, actor=OWNER, action_id="archive-2")
    return authority.compact


def step_compact_after_reopen(authority: Authority) -> Callable[[], Any]:
    """A compaction of a store reopened after a clean close, nothing appended since: its log's
    clean-close marker (``CLEAN``) is still there for a bare reader to take sealed segments on."""
    assert os.path.exists(os.path.join(authority.path, "log", "CLEAN"))
    return authority.compact


def step_rebuild(authority: Authority) -> Callable[[], Any]:
    return authority.rebuild


def step_snapshot(authority: Authority) -> Callable[[], Any]:
    return lambda: authority.snapshot(GROUP)


def step_archive(authority: Authority) -> Callable[[], Any]:
    return lambda: authority.archive(ARCHIVED, actor=OWNER, action_id="archive-2")


def step_redact(authority: Authority) -> Callable[[], Any]:
    return lambda: authority.redact(GROUP, 4, actor=OWNER, action_id="redact-4", reason="test")


def step_audit_delete(authority: Authority) -> Callable[[], Any]:
    authority.archive(ARCHIVED, actor=OWNER, action_id="archive-2")
    return lambda: authority.delete_audit_log(ARCHIVED, actor=OWNER, action_id="delete-2", basis="legal")


def step_rotate(authority: Authority) -> Callable[[], Any]:
    authority.signing_key  # noqa: B018 - the key made before the rotation
    return lambda: authority.rotate_signing_key(retire=True)


def step_accept_rollover(authority: Authority) -> Callable[[], Any]:
    """An accept whose append seals the active segment and starts the next one."""
    start = len(authority.log.segments())
    number = 1000
    while authority.log.segments()[-1].used_bytes + 4 * 1200 < limits.SEGMENT_BYTES_MIN:  # the next few roll over
        number += 1
        authority.accept(_mission(number))
    assert len(authority.log.segments()) == start

    def accept() -> None:
        nonlocal number
        while len(authority.log.segments()) == start:
            number += 1
            authority.accept(_mission(number))

    return accept


STEPS: dict[str, Callable[[Authority], Callable[[], Any]]] = {
    "compact": step_compact, "compact-after-reopen": step_compact_after_reopen, "rebuild": step_rebuild, "snapshot": step_snapshot, "archive": step_archive,
    "redact": step_redact, "audit.delete": step_audit_delete, "rotate": step_rotate, "rollover": step_accept_rollover,
}

# A compaction's points: (pause point, readers in CI, the refusals allowed by reader kind). Run on
# a store with a redaction and an archived Group (``compact``) and, where the readers' outcomes
# may differ, on one reopened after a clean close (``compact-after-reopen``).
COMPACTION = [
    ("compaction.copy", ALL, {}),
    ("compaction.marked", ALL, {"view": VIEW_SWITCHING}),
    ("compaction.half_switched", ALL, {"view": VIEW_SWITCHING, "log": LOG_SWITCHING}),
    ("compaction.switched", ALL, {"view": VIEW_SWITCHING}),
    ("authority.mid_rebuild", QUICK, {"view": VIEW_SWITCHING}),
    ("rename:index.old", QUICK, {"view": VIEW_SWITCHING}),
    ("compaction.indexed", ALL, {"view": VIEW_SWITCHING}),
    ("remove:COMPACT-SWITCH", QUICK, {"view": VIEW_SWITCHING}),
]
# (step, pause point, hit count, readers in CI, the refusals allowed by reader kind)
POINTS: list[tuple[str, str, int, str, dict[str, set[Any]]]] = [
    *[("compact", point, 1, kinds, allowed) for point, kinds, allowed in COMPACTION],
    *[("compact-after-reopen", point, 1, kinds, allowed) for point, kinds, allowed in COMPACTION
      if point not in ("authority.mid_rebuild", "rename:index.old")],
    ("rebuild", "authority.mid_rebuild", 1, ALL, {}),
    ("rebuild", "rename:index.old", 1, QUICK, {"view": VIEW_SWITCHING}),
    ("rebuild", "rename:index", 1, QUICK, {}),
    ("snapshot", "files.before_rename", 1, ALL, {}),
    ("snapshot", "authority.after_log_sync", 1, ALL, {}),
    ("archive", "authority.after_log_sync", 1, QUICK, {}),
    ("archive", "files.before_rename", 1, ALL, {}),
    ("archive", "authority.after_log_sync", 2, QUICK, {}),
    ("archive", "replace:audit-", 1, ALL, {}),
    ("archive", "authority.after_log_sync", 3, ALL, {}),
    ("redact", "authority.after_log_sync", 1, ALL, {}),
    ("redact", "authority.after_index_commit", 1, QUICK, {}),
    ("audit.delete", "authority.after_log_sync", 1, ALL, {}),
    ("audit.delete", "authority.after_index_commit", 1, ALL, {}),
    ("audit.delete", "unlink:audit-", 1, ALL, {}),
    ("rotate", "keys.after_retire", 1, ALL, {}),
    ("rotate", "files.before_rename", 1, ALL, {}),
    ("rotate", "files.before_rename", 2, ALL, {}),
    ("rollover", "authority.after_log_sync", 1, ALL, {}),
]


def _case_id(case: tuple[Any, ...]) -> str:
    return f"{case[0]}@{case[1]}#{case[2]}"


@contextlib.contextmanager
def prepared(step: str) -> Iterator[tuple[str, Authority, History, Callable[[], Any]]]:
    """A new store (:func:`make_store`) prepared for ``step``: its directory, the writer, the
    history gathered so far and the step to run; closed and removed at the end."""
    store = scratch_directory("mwpstore-cross-")
    authority = make_store(store, reopened=step.endswith("after-reopen"))
    try:
        history = History()
        run = STEPS[step](authority)
        history.gather(authority)
        yield store, authority, history, run
    finally:
        authority.close()
        shutil.rmtree(store, ignore_errors=True)


@pytest.mark.parametrize("case", POINTS, ids=_case_id)
def test_a_reader_from_outside_at_a_maintenance_step_serves_a_prefix_or_a_refusal_the_docs_allow(monkeypatch, case):
    step, point, count, kinds, allowed = case
    kinds = ALL if FULL else kinds
    with prepared(step) as (store, authority, history, run):
        lines, _ = _paused_step(monkeypatch, Pause(point, count), run, lambda: read_from_outside(store, kinds))
        history.gather(authority)
        assert problems_in(lines, history, allowed) == []
        assert problems_in(read_from_outside(store, kinds), history, {}, whole=history) == []


class PausingIO(RecordingIO):
    """The C log's file operations (``io_seam``), each numbered from ``start()`` on and reported to
    the pause after it is done (``io:<n>``, with its kind): a pause inside ``sl_log_append``."""

    def __init__(self) -> None:
        super().__init__()
        self.pause: Pause | None = None
        self.done = 0
        self.kinds: list[str] = []

    def start(self, pause: Pause) -> None:
        self.pause, self.done, self.kinds = pause, 0, []

    def _after(self, kind: str) -> None:
        if self.pause is not None and threading.get_ident() == self.pause.writer:
            self.done += 1
            self.kinds.append(kind)
            self.pause.at(f"io:{self.done}")


def _reporting(kind: str) -> Callable[..., Any]:
    def operation(self: PausingIO, *args: Any) -> Any:
        result = getattr(RecordingIO, kind)(self, *args)
        self._after(kind)
        return result

    return operation


for _kind in ("create_file", "open_file", "close_file", "write_at", "sync_file_data", "truncate_file", "allocate_file", "rename_file",
              "remove_file", "sync_directory"):
    setattr(PausingIO, _kind, _reporting(_kind))


def _rollover(store: str) -> tuple[Authority | None, Callable[[], Any]]:
    authority = make_store(store)
    return authority, step_accept_rollover(authority)


def _open_repairing_the_tail(store: str) -> tuple[Authority | None, Callable[[], Any]]:
    """A store whose last segment has bytes that are not zero after its end (a group torn by a
    crash), closed without its clean-close marker: the writer's open trims and zeroes them."""
    authority = make_store(store)
    active = authority.log.segments()[-1]
    authority.close()
    os.remove(os.path.join(store, "log", "CLEAN"))
    with open(active.path, "r+b") as segment:
        segment.seek(active.used_bytes)
        segment.write(b"\xff" * 100)
    return None, lambda: Authority.open(store, segment_bytes=limits.SEGMENT_BYTES_MIN)


def _selected(kinds: list[str]) -> list[int]:
    """The operations (numbered from 1) to stop after, but the first (stopped at already): all of
    them, or in CI those that change a file's size or name, a segment's seal and the last."""
    seal = kinds.index("truncate_file") - 2 if "create_file" in kinds else -1  # written, synced, then the trim
    return [number for number, kind in enumerate(kinds, 1) if number > 1 and (
        FULL or kind in ("truncate_file", "create_file", "rename_file") or number in (seal + 1, len(kinds)))]


@pytest.mark.parametrize("scenario", [_rollover, _open_repairing_the_tail], ids=["rollover", "open-repairing-the-tail"])
def test_a_reader_from_outside_at_each_file_operation_of_the_c_log_serves_a_prefix(monkeypatch, scenario):
    """The writer stops after each file operation the C log makes (``PausingIO``) for an accept
    whose append seals the active segment and starts the next (the seal's write, its sync, the
    trim, the next segment's creation, its header, the group, ...), or for a writer's open that
    cuts a torn tail; in CI after those of :func:`_selected`. A view and a bare log read meanwhile
    from another process serve a prefix of the final history; none refuses."""
    real_open = SegmentLog.open.__func__
    ios: list[PausingIO] = []
    armed: list[Pause] = []

    def open_log(cls: type, directory: str, **options: Any) -> SegmentLog:
        if not options.get("readonly"):
            ios.append(PausingIO())
            if armed:
                ios[-1].start(armed[0])
            options["io"] = ios[-1]
        return real_open(cls, directory, **options)

    monkeypatch.setattr(SegmentLog, "open", classmethod(open_log))
    pending, kinds = [1], None
    while pending:
        operation = pending.pop(0)
        store = scratch_directory("mwpstore-cross-")
        armed.clear()
        authority, run = scenario(store)
        try:
            history = History()
            if authority is not None:
                history.gather(authority)
            pause = Pause(f"io:{operation}")
            armed.append(pause)
            ios[-1].start(pause)
            lines, outcome = _paused_step(monkeypatch, pause, run, lambda: read_from_outside(store, QUICK))
            authority = authority or outcome
            if kinds is None:
                kinds = ios[-1].kinds
                pending = _selected(kinds)
            history.gather(authority)
            assert problems_in(lines, history, {}) == [], (operation, kinds[operation - 1])
            assert problems_in(read_from_outside(store, QUICK), history, {}, whole=history) == []
        finally:
            if authority is not None:
                authority.close()
            shutil.rmtree(store, ignore_errors=True)
    assert {"truncate_file", "sync_file_data"} <= set(kinds), kinds
    assert scenario is not _rollover or {"write_at", "create_file", "rename_file"} <= set(kinds), kinds


# -- the reverse: a reader stopped mid-read while the writer runs a whole step ----------------------

REVERSE = [
    # (reader, where it stops, the step, the refusals allowed)
    ("view", "page", "compact", {}),
    ("log", "page", "compact", {}),
    ("view", "map", "compact", {}),
    ("log", "map", "compact", {"log": LOG_SWITCHING}),
    ("log", "map", "compact-after-reopen", {"log": LOG_SWITCHING}),
    ("log", "page", "compact-after-reopen", {}),
    ("view", "map", "compact-after-reopen", {}),
    ("log", "map", "rebuild", {}),
    ("view", "page", "rebuild", {}),
    ("view", "map", "rebuild", {}),
    ("log", "map", "rollover", {}),
    ("view", "map", "rollover", {}),
    ("log", "lastmap", "rollover", {}),  # the writer seals and trims the segment before it is mapped
    ("view", "lastmap", "rollover", {}),
    ("log", "lastmap", "compact", {"log": LOG_SWITCHING}),
    ("view", "page", "archive", {}),
    ("log", "page", "redact", {}),
]


@pytest.mark.parametrize("case", REVERSE, ids=lambda case: f"{case[0]}-at-{case[1]}-{case[2]}")
def test_a_reader_from_outside_stopped_mid_read_across_a_whole_step_serves_a_prefix(case):
    """The reader stops after its first page (batch), or in its open between mapping the log's
    first segment file and its next, or before it maps the active segment; the writer runs the
    whole step; the reader goes on and must
    serve a prefix of the history (a bare log: of the log it opened) or refuse as the docs allow
    (a bare open that met a compaction's switch)."""
    kind, where, step, allowed = case
    with prepared(step) as (store, authority, history, run):
        assert len(authority.log.segments()) > 1  # a second segment file to stop before
        child = run_reader(store, kind, where)
        try:
            assert child.stdout.readline().strip() == "PAUSED"
            run()
            child.stdin.write("go\n")
            child.stdin.flush()
        except BaseException:
            child.kill()
            raise
        lines = reader_lines(child)
        history.gather(authority)
        assert [line["kind"] for line in lines] == [kind]
        assert problems_in(lines, history, allowed) == []
        assert problems_in(read_from_outside(store, QUICK), history, {}, whole=history) == []


def _killed_after_log_sync(store: str) -> None:
    """A writer killed after its log's sync, before its index commit: the next open redoes."""
    commands = [_mission(number) for number in range(200, 300)]

    def accept_and_die() -> None:
        with Authority.open(store, segment_bytes=limits.SEGMENT_BYTES_MIN) as writer:
            writer.accept_many(commands)

    assert in_a_forked_child([accept_and_die], kill=("authority.after_log_sync", 1)) == ["killed"]


def _index_removed(store: str) -> None:
    """No index: the next open rebuilds it."""
    shutil.rmtree(os.path.join(store, "index"))


def _compaction_killed_between_its_renames(store: str) -> None:
    """A compaction killed between its two renames (``ARCHIVED`` archived before: its Events
    dropped): no ``log/``; the next open finishes it."""

    def compact_and_die() -> None:
        with Authority.open(store, segment_bytes=limits.SEGMENT_BYTES_MIN) as writer:
            writer.compact()

    assert in_a_forked_child([compact_and_die], kill=("compaction.half_switched", 1)) == ["killed"]
    assert not os.path.exists(os.path.join(store, "log"))


OPENS = [
    # (what the store needs, its preparation, the open's mode, pause point, refusals allowed)
    # the compaction's marker there: a view is refused (docs/api.md); a bare open finds no log
    # (STORAGE_FAILED) until the open renames log.compact to log
    ("compaction", _compaction_killed_between_its_renames, "rebuild", "rename:log", {"view": VIEW_SWITCHING}),
    ("compaction", _compaction_killed_between_its_renames, "rebuild", "authority.mid_rebuild", {"view": VIEW_SWITCHING}),
    ("compaction", _compaction_killed_between_its_renames, "rebuild", "remove:COMPACT-SWITCH", {"view": VIEW_SWITCHING}),
    ("redo", _killed_after_log_sync, "redo", "authority.mid_redo", {}),
    # no index yet: docs/api.md, a view of a store "that needs what only a writer does at open"
    ("rebuild", _index_removed, "rebuild", "authority.mid_rebuild", {"view": VIEW_SWITCHING}),
    ("rebuild", _index_removed, "rebuild", "rename:index", {}),
]


@pytest.mark.parametrize("case", OPENS, ids=lambda case: f"{case[0]}@{case[3]}")
def test_a_reader_from_outside_during_a_writers_recovering_open_serves_a_prefix(monkeypatch, case):
    """The writer's open redoes the records past its index (a writer killed after its log's sync:
    100 missions in one ``accept_many``, the last commits of it), committing every 10 records
    (``authority.mid_redo``), or rebuilds a missing index; a reader from outside while it stops
    serves a prefix of the history or refuses as the docs allow, and after it serves all of it."""
    need, prepare, mode, point, allowed = case
    store = scratch_directory("mwpstore-cross-")
    try:
        history = History()
        with make_store(store) as authority:
            if need == "compaction":
                authority.archive(ARCHIVED, actor=OWNER, action_id="archive-2")
            history.gather(authority)  # the history of what the compaction drops
        prepare(store)
        lines, authority = _paused_step(monkeypatch, Pause(point), lambda: Authority.open(store, segment_bytes=limits.SEGMENT_BYTES_MIN),
                                        lambda: read_from_outside(store, ALL if FULL or point == "authority.mid_redo" else QUICK))
        with authority:
            assert authority.open_report.mode == mode
            assert mode != "redo" or authority.open_report.redo_records > 10
            history.gather(authority)
            assert problems_in(lines, history, allowed) == []
            assert problems_in(read_from_outside(store, ALL), history, {}, whole=history) == []
    finally:
        shutil.rmtree(store, ignore_errors=True)
