"""Compaction: rewrite the log so redacted payloads and archived Groups' Events are gone from disk.

What a compaction keeps, and what it drops (MWP-MSN-009):

- every Event of an active Group, in place and in order; a redacted Event is rewritten with its
  payload removed (``body`` None) — ID, sequence, payload hash and chain hash unchanged;
- for an archived Group whose audit log is durable (the file exists and its blake3 hash equals the
  archive record's): its Events are dropped; what stays is one ``G`` record (head sequence, head
  hash and the Group aggregate, so the Group still refuses Commands) and one ``P`` record per
  dropped Event holding its receipt (receipts are permanent: idempotency still answers with the
  original receipt);
- ACK, snapshot-reference, archive and earlier ``P``/``G`` records, unchanged.

Crash safety, step by step (each step is a named fail point ``compaction.<step>``):

1. ``copy``: write the new log in ``log.compact/`` (synced groups, directory synced);
2. ``marked``: write ``COMPACT-SWITCH`` atomically: from here the new log is complete;
3. ``switched``: rename ``log`` → ``log.old``, then ``log.compact`` → ``log``, directory sync;
4. ``indexed``: rebuild the index from the new log (itself crash-safe) and switch to it;
5. remove ``log.old`` and the marker, directory sync.

:func:`recover_interrupted_compaction` runs at open, before the log is opened: without the marker
an unfinished ``log.compact`` is deleted (the old log is intact); with it, the switch is completed,
the index is rebuilt from the new log, and only then are ``log.old`` and the marker removed
(:func:`finish_compaction`), as a compaction that runs to its end removes them only after step 4.

Reads in this process that began before the switch finish on the old log and index handles, which
stay valid until then; the old pair is closed as soon as no such read is running (at the switch
itself when none is). Commits wait while a compaction runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3
import msgspec

from . import failpoints
from ._files import fsync_directory_raw as _fsync_directory  # a module name the tests replace
from ._files import open_regular, write_all
from .errors import MwpError, StorageFailed, translate
from .messages import Effect, decode_logged_event, encode_event, encode_receipt, receipt_for
from .segment_log import COMMIT_FRAME_BYTES, SegmentLog, framed_bytes, group_bytes_max

if TYPE_CHECKING:
    from .authority import Authority

MARKER = "COMPACT-SWITCH"
_ENCODER = msgspec.msgpack.Encoder()
FLUSH_RECORDS = 4096
FLUSH_BYTES = 8 * 1024 * 1024
HASH_READ_BYTES = 1024 * 1024
"""An audit log is hashed in pieces of this size: its whole history is never in memory at once."""


@dataclass(frozen=True)
class CompactionReport:
    records_before: int
    records_after: int
    bytes_before: int
    bytes_after: int
    payloads_removed: int
    events_dropped: int
    groups_compacted: list[str]
    seconds: float


def _log_bytes(directory: str) -> int:
    total = 0
    for entry in os.scandir(directory):
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except FileNotFoundError:
            continue  # e.g. the CLEAN marker, removed by a commit that ran meanwhile
    return total


def recover_interrupted_compaction(path: str) -> bool:
    """Finish or undo the switch of a compaction that a crash interrupted. True: the index must be
    rebuilt from the new log, and then :func:`finish_compaction` called; ``log.old`` stays until
    then, so a new log that fails its rebuild leaves the old one on disk."""
    log, compacted, old = (os.path.join(path, name) for name in ("log", "log.compact", "log.old"))
    marker = os.path.join(path, MARKER)
    _remove_marker_temp(path)  # a marker write that never reached its rename: never read, only clutter
    if not os.path.exists(marker):
        if os.path.isdir(compacted):
            shutil.rmtree(compacted)  # unfinished copy: the old log is the truth
            _fsync_directory(path)
        return False
    if os.path.isdir(compacted):
        if os.path.isdir(log):
            os.rename(log, old)
        os.rename(compacted, log)
        _fsync_directory(path)
    return True


def finish_compaction(path: str) -> None:
    """Step 5, once the index is built from the new log: remove ``log.old``, then the marker (a
    marker gone with ``log.old`` left would leave a stray ``log.old`` that stops every later
    compaction), and sync the directory."""
    old = os.path.join(path, "log.old")
    if os.path.isdir(old):
        shutil.rmtree(old)
    os.remove(os.path.join(path, MARKER))
    _fsync_directory(path)


def compact(authority: Authority, progress: Callable[[int, int], None] | None = None) -> CompactionReport:
    """Compact ``authority``'s log (see the module docstring). Commits wait until it is done."""
    import time

    from .authority import checked_progress

    progress = checked_progress(progress)
    authority._check_writable("compact")
    started = time.perf_counter()
    path = authority.path
    with authority._exclusive():
        authority._check_open()  # a commit may have failed while this call waited
        obstacle = os.path.join(path, "log.old")
        if os.path.lexists(obstacle):
            raise StorageFailed(
                f"{obstacle} exists and is not this compaction's; move it away, then compact again (nothing was changed)",
                reason="compaction_obstacle",
                path=obstacle,
            )
        target = os.path.join(path, "log.compact")
        try:
            counts, bytes_before, archived = _copy(authority, target, progress)
        except BaseException as exc:
            # Before the marker the old log is the truth: drop the partial copy, keep the handle.
            shutil.rmtree(target, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, MwpError):  # an MwpError keeps its cause
                raise translate(exc, context="compacting: writing log.compact") from None
            raise
        try:
            _switch(authority, path, target)
        except BaseException as exc:
            # From the marker on, the next open finishes the switch (recover_interrupted_compaction)
            # and the old log is deleted then: this handle must acknowledge nothing more on it.
            cause = translate(exc, context="switching to the compacted log") if isinstance(exc, Exception) else None
            authority._failure = StorageFailed(
                f"compaction failed after its switch point ({cause.message if cause else type(exc).__name__}); "
                "reopen the authority: open() finishes the switch",
                reason="compaction_interrupted",
            )
            if isinstance(exc, Exception):
                raise authority._failure from None
            raise
    try:
        bytes_after = _log_bytes(os.path.join(path, "log"))
    except OSError as exc:
        raise translate(exc, context="measuring the compacted log (the compaction itself is complete)") from None
    return CompactionReport(
        records_before=counts["before"],
        records_after=counts["after"],
        bytes_before=bytes_before,
        bytes_after=bytes_after,
        payloads_removed=counts["payloads"],
        events_dropped=counts["dropped"],
        groups_compacted=sorted(archived),
        seconds=time.perf_counter() - started,
    )


def _copy(authority: Authority, target: str, progress: Callable[[int, int], None] | None) -> tuple[dict[str, int], int, set[str]]:
    """Step 1: write the compacted log into ``target``, synced. Returns (counts, bytes before,
    the archived Groups whose Events were dropped)."""
    from .authority import EVENT_TAG, GROUP_TAG, RECEIPT_TAG

    path = authority.path
    archived = _durable_archives(authority)
    redacted = _redacted_seqs(authority)
    old_log = authority.log
    bytes_before = _log_bytes(os.path.join(path, "log"))
    if os.path.isdir(target):
        shutil.rmtree(target)
    new_log = SegmentLog.open(target, segment_bytes=authority._segment_bytes, sync=True)
    # A group must fit an empty segment: with small segments, FLUSH_BYTES of records would not.
    group_room = group_bytes_max(authority._segment_bytes)
    pending: list[bytes] = []
    pending_bytes = 0
    pending_framed = COMMIT_FRAME_BYTES  # what the pending group takes in a segment
    counts = {"before": 0, "after": 0, "payloads": 0, "dropped": 0}

    def emit(record: bytes) -> None:
        nonlocal pending_bytes, pending_framed
        framed = framed_bytes(len(record))
        if pending and pending_framed + framed > group_room:
            flush()
        pending.append(record)
        pending_bytes += len(record)
        pending_framed += framed
        counts["after"] += 1
        if len(pending) >= FLUSH_RECORDS or pending_bytes >= FLUSH_BYTES:
            flush()

    def flush() -> None:
        nonlocal pending_bytes, pending_framed
        if pending:
            new_log.append(pending)
            pending.clear()
            pending_bytes = 0
            pending_framed = COMMIT_FRAME_BYTES

    try:
        start, end = old_log.start, old_log.end
        for batch in old_log.scan(start, end=end):
            for position, record in zip(batch.positions, batch.records):
                counts["before"] += 1
                data = bytes(record)
                if data[:1] != EVENT_TAG:
                    emit(data)
                    continue
                event = decode_logged_event(position, data)
                if event.group in archived:
                    receipt = receipt_for(event)
                    emit(RECEIPT_TAG + _ENCODER.encode((event.actor, event.action_id, event.content_hash, encode_receipt(receipt))))
                    counts["dropped"] += 1
                    continue
                if event.body is not None and event.seq in redacted.get(event.group, ()):
                    event = msgspec.structs.replace(event, body=None)
                    data = EVENT_TAG + encode_event(event)
                    counts["payloads"] += 1
                emit(data)
            if progress:
                progress(batch.next_position - start, max(1, end - start))
        for group in sorted(archived):
            seq, digest = authority.head(group)
            kept = [
                Effect(key, revision, {**(state or {}), "compacted": True} if key == f"group:{group}" else state)
                for key, revision, state in authority.aggregates(group)
                if key == f"group:{group}" or key.startswith("member:")
            ]
            emit(GROUP_TAG + _ENCODER.encode((group, seq, digest, kept)))
        flush()
        new_log.sync()
    finally:
        new_log.close()
    _fsync_directory(path)
    return counts, bytes_before, archived


def _switch(authority: Authority, path: str, target: str) -> None:
    """Steps 2 to 5: the marker (the commit point), the directory switch, the new index."""
    failpoints.hit("compaction.copy")
    _write_marker(path)
    failpoints.hit("compaction.marked")
    # Reads still running on the old log (and its retired handle) go on reading its files after
    # the switch: mapped now and kept so, as a bounded set of maps would map an unmapped one again
    # from its name, the new log's file by then. One that cannot be mapped fails the compaction
    # here, before the switch (the reopen finishes it), not those reads after it.
    authority.log.hold_files(every=True)
    os.rename(os.path.join(path, "log"), os.path.join(path, "log.old"))
    failpoints.hit("compaction.half_switched")
    os.rename(target, os.path.join(path, "log"))
    _fsync_directory(path)
    failpoints.hit("compaction.switched")
    new_log = SegmentLog.open(os.path.join(path, "log"), segment_bytes=authority._segment_bytes, sync=authority._sync)
    try:
        authority._build_index(authority._index_dir(), None, log=new_log, install=lambda: authority._install_index(log=new_log))
    except BaseException:
        with contextlib.suppress(Exception):  # not installed: the handle will not close it
            new_log.close()
        raise
    failpoints.hit("compaction.indexed")
    finish_compaction(path)


def _write_marker(path: str) -> None:
    marker = os.path.join(path, MARKER)
    temp = marker + ".tmp"
    try:
        # Whatever lies at the temporary name (a write killed before its rename, or a FIFO or a
        # symbolic link put there since the open) goes first; the file is then created exclusively
        # and never through a link, so nothing is waited on or written outside the store.
        _remove_marker_temp(path)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, b"log.compact is complete; finish the switch at open\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, marker)
    except BaseException:
        _remove_marker_temp(path)  # no marker: the copy is not committed, and nothing would remove it
        raise
    _fsync_directory(path)


def _remove_marker_temp(path: str) -> None:
    temp = os.path.join(path, MARKER + ".tmp")
    if os.path.lexists(temp):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _durable_archives(authority: Authority) -> set[str]:
    """Archived Groups whose audit log is on disk and matches its record, not yet compacted."""
    out = set()
    for group in authority.groups():
        record = authority.archive_record(group)
        if record is None:
            continue
        _, state = authority.state(group, f"group:{group}")
        if state is None or state.get("compacted"):
            continue
        audit = os.path.join(authority.path, record.audit_location)
        try:
            with open_regular(audit) as handle:
                if os.fstat(handle.fileno()).st_size != record.audit_bytes:
                    continue  # not the file the record names: not read at all
                hasher = blake3.blake3()
                while piece := handle.read(HASH_READ_BYTES):
                    hasher.update(piece)
        except OSError:
            continue  # no durable audit log: the Group's history stays
        if hasher.hexdigest() == record.audit_file_hash:
            out.add(group)
    return out


def _redacted_seqs(authority: Authority) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for group in authority.groups():
        for key, _, state in authority.aggregates(group, prefix="tombstone:"):
            if state is not None:
                out.setdefault(group, set()).add(int(state["seq"]))
    return out

