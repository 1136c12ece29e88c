"""The segment log: an append-only, checksummed, group-committed log — the engine's commit point.

The format and the recovery rules are in ``docs/format/segment.md``; the C core that encodes,
parses, recovers and writes is in ``csrc/``. This module owns what is easier in Python: the
directory, the lock file, which segment is which, memory maps for readers, and turning C status
codes into the typed errors of :mod:`mwpstore.errors`.

Usage::

    with SegmentLog.open("data/log") as log:
        positions = log.append([b"first", b"second"])     # one group: one write, one fdatasync
        assert log.read(positions[1]) == b"second"
        for batch in log.scan(0):                          # framing and checksums checked in C,
            for position, record in zip(batch.positions, batch.records):   # a batch per call
                ...

Threads: one thread at a time appends (appends are serialized by a lock anyway); any number of
threads may read or scan at the same time and see only whole committed groups.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import functools
import mmap
import os
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from mwpstore import _fork
from mwpstore._files import makedirs_durable, open_regular_fd, store_path, take_lock_file

# The directory fsync for the clean-close marker, outside the I/O seam: the marker only ever saves
# a scan, so a simulated power loss that forgets it loses nothing. A module name the tests replace.
from mwpstore._files import fsync_directory_raw as _fsync_directory
from mwpstore._index_c import record_bytes as _record_bytes
from mwpstore._segment_log_c import ffi, lib
from mwpstore.errors import (
    Corruption,
    InvalidCommand,
    LimitExceeded,
    MwpError,
    StorageFailed,
    StoreClosed,
    StoreLocked,
)
from mwpstore.limits import (
    GROUP_BYTES_MAX,
    GROUP_RECORDS_MAX,
    RECORD_BYTES_MAX,
    SCAN_BATCH_RECORDS_MAX,
    SEGMENT_BYTES_DEFAULT,
    SEGMENT_BYTES_MAX,
    SEGMENT_BYTES_MIN,
    SEGMENT_MAPS_MAX,
)

__all__ = ["RecordBatch", "SegmentInfo", "SegmentLog", "segment_file_name"]

LOCK_FILE_NAME = "LOCK"
CLEAN_FILE_NAME = "CLEAN"
"""Written at a clean close: the durable end, so the next open need not scan the active segment.
Removed (durably) before the first append after an open; see docs/format/segment.md."""
BULK_FILE_NAME = "BULK"
"""Present while a bulk-mode writer (``sync=False``) has the log open, and after a crash until a
writer's open has recovered the log: groups were not synced one by one, so a later group may be
on disk while an earlier one is not, and recovery takes only a group's own commit frame or a seal
as proof that a damaged group's write completed. Without it, any later intact commit frame is
proof too (docs/format/segment.md, "Bulk mode")."""
_CLEAN = struct.Struct("<8sQQQ")  # magic, log id, active segment's first position, end
_CLEAN_MAGIC = b"MWPCLEAN"
# The marker since 2026-12-03 adds what the close saw of the segment files: their count and a
# CRC-32 of their first positions; it lets open take the sealed segments on its word.
_CLEAN_LIST = struct.Struct("<8sQQQQI")  # magic, log id, active first position, end, count, names CRC
_CLEAN_LIST_MAGIC = b"MWPCLEN2"
_CLEAN_ZERO_CHECK_BYTES = 64 * 1024  # after a clean close the bytes after the end are zero: checked
# ASCII digits and nothing after the suffix: the segment is opened by the name its number makes,
# so "\d" (any Unicode digit) or "$" (which also matches before a final newline) would number a
# file that is not the one opened (docs/format/segment.md: anything else is ignored).
_SEGMENT_NAME = re.compile(r"([0-9]{20})\.seg\Z")
_TEMPORARY_NAME = re.compile(r"([0-9]{20})\.seg\.tmp\Z")
_CLEAN_TEMPORARY_NAME = re.compile(r"CLEAN(\.[0-9a-f]{16})?\.tmp\Z")  # a clean-close marker a crash left unrenamed
_HEADER_BYTES = lib.SL_SEGMENT_HEADER_BYTES
_ALIGN_BYTES = lib.SL_FRAME_ALIGN_BYTES
_SEAL_BYTES = lib.SL_SEAL_FRAME_BYTES
COMMIT_FRAME_BYTES = lib.SL_COMMIT_FRAME_BYTES
_PAGE_BYTES = mmap.PAGESIZE
# The most records an append's kept arrays grow to (an authority commit holds at most
# limits.COMMIT_BATCH_COMMANDS_MAX): 48 KiB per handle at most; a larger group gets its own.
_APPEND_BUFFER_RECORDS = 4096
_HEADER_NAMES = struct.Struct("<QQ")  # log id, first position: adjacent in the header
assert lib.SL_HEADER_OFFSET_FIRST_POSITION == lib.SL_HEADER_OFFSET_LOG_ID + 8

# C reason codes -> the stable ``reason`` strings carried by Corruption errors.
REASONS: dict[int, str] = {
    lib.SL_REASON_NONE: "none",
    lib.SL_REASON_HEADER_SHORT: "header_short",
    lib.SL_REASON_HEADER_MAGIC: "header_magic",
    lib.SL_REASON_HEADER_VERSION: "header_version",
    lib.SL_REASON_HEADER_CHECKSUM: "header_checksum",
    lib.SL_REASON_HEADER_FIELD: "header_field",
    lib.SL_REASON_FRAME_TRUNCATED: "frame_truncated",
    lib.SL_REASON_FRAME_KIND: "frame_kind",
    lib.SL_REASON_FRAME_LENGTH: "frame_length",
    lib.SL_REASON_FRAME_POSITION: "frame_position",
    lib.SL_REASON_FRAME_CHECKSUM: "frame_checksum",
    lib.SL_REASON_COMMIT_MISMATCH: "commit_mismatch",
    lib.SL_REASON_COMMIT_DAMAGED: "commit_damaged",
    lib.SL_REASON_GROUP_DAMAGED: "group_damaged",
    lib.SL_REASON_SEAL_MISMATCH: "seal_mismatch",
    lib.SL_REASON_SEAL_MISSING: "seal_missing",
    lib.SL_REASON_DATA_AFTER_SEAL: "data_after_seal",
    lib.SL_REASON_UNEXPECTED_END: "unexpected_end",
    lib.SL_REASON_RECORD_TOO_LARGE: "record_too_large",
    lib.SL_REASON_GROUP_TOO_LARGE: "group_too_large",
    lib.SL_REASON_GROUP_TOO_MANY: "group_too_many",
    lib.SL_REASON_SEGMENT_BYTES: "segment_bytes",
    lib.SL_REASON_NOT_A_RECORD: "not_a_record",
    lib.SL_REASON_PATH_TOO_LONG: "path_too_long",
}


_COMMIT_FRAME = struct.Struct("<IIQQII")  # checksum, length|kind, position, group start, count, group crc
_COMMIT_KIND = 2


def _commit_frame_ends_at(frame: bytes, tail: int, end: int, log_id: int) -> bool:
    """True if ``frame``, the bytes of a segment before file offset ``tail``, is an intact commit
    frame (docs/format/segment.md, kind 2) ending exactly at position ``end``."""
    if tail - _COMMIT_FRAME.size < _HEADER_BYTES or len(frame) != _COMMIT_FRAME.size:
        return False
    checksum, length_kind, position, _, count, _ = _COMMIT_FRAME.unpack(frame)
    if length_kind != (_COMMIT_KIND << 28) | 16 or position != end - _COMMIT_FRAME.size or count < 1:
        return False
    seed = log_id.to_bytes(8, "little")
    return int(lib.sl_crc32c(0, seed + frame[4:], 8 + len(frame) - 4)) == checksum


def framed_bytes(record_bytes: int) -> int:
    """What a record of ``record_bytes`` takes in a segment, with its frame and padding."""
    return int(lib.sl_frame_bytes(record_bytes))


def group_bytes_max(segment_bytes: int) -> int:
    """The largest group (its records' framed bytes and its commit frame) that a log with
    ``segment_bytes`` segments takes: what fits an empty segment with room for its seal.
    A writer batching many records per group flushes before it would pass this."""
    return segment_bytes - _HEADER_BYTES - _SEAL_BYTES


def check_segment_bytes(segment_bytes: object) -> int:
    """``segment_bytes`` if it is an int multiple of 4096 within the bounds; ``InvalidCommand``
    (``LimitExceeded`` for the bounds), field ``segment_bytes``, otherwise."""
    if type(segment_bytes) is not int or segment_bytes % 4096 != 0:
        raise InvalidCommand("segment_bytes must be an int multiple of 4096.", field="segment_bytes")
    if not SEGMENT_BYTES_MIN <= segment_bytes <= SEGMENT_BYTES_MAX:
        raise LimitExceeded(
            f"segment_bytes must be between {SEGMENT_BYTES_MIN} and {SEGMENT_BYTES_MAX} (got {segment_bytes}).",
            field="segment_bytes",
        )
    return segment_bytes


def segment_file_name(first_position: int) -> str:
    """The file name of the segment whose first frame is at ``first_position``."""
    return f"{first_position:020d}.seg"


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """One segment file as the log sees it now."""

    first_position: int
    path: str
    size_bytes: int  # the file's size (preallocated size while active)
    used_bytes: int  # header plus committed frames (plus the seal once sealed)
    sealed: bool


class RecordBatch:
    """Records from one C call of a scan.

    ``records[i]`` is the record at ``positions[i]`` as ``bytes``, copied out of the segment's
    read-only memory map after C checked the whole batch. They are the caller's to keep (after the
    next batch, after close): making the batch's bytes in one C call (``_index_c.record_bytes``)
    costs less than a ``memoryview`` per record, and bytes pin no mapping. ``next_position`` is where
    a scan continuing after this batch starts.

    From a scan with ``split_tags=True``, ``records[i]`` is the record without its first byte and
    ``tags`` holds those first bytes, one per record (an empty record has none, so ``tags`` is
    then shorter than ``records``): a caller that decodes the rest needs no slice per record.
    Otherwise ``tags`` is None.
    """

    __slots__ = ("positions", "records", "next_position", "tags")

    def __init__(self, positions: list[int], records: list[bytes], next_position: int, tags: bytes | None = None) -> None:
        self.positions = positions
        self.records = records
        self.next_position = next_position
        self.tags = tags

    def __len__(self) -> int:
        return len(self.positions)

    def __repr__(self) -> str:
        first = self.positions[0] if self.positions else None
        return f"RecordBatch(records={len(self)}, first_position={first}, next_position={self.next_position})"


class _Segment:
    """A segment file: its decoded header, how much of it is committed, and a lazy read map.

    ``header`` is None for a sealed segment that open took on the word of a clean close (see
    ``SegmentLog._vouched_segments``): its header and seal are checked when it is first mapped."""

    __slots__ = ("first_position", "path", "header", "sealed", "sealed_used_bytes", "_view", "_lock")

    def __init__(self, path: str, header: Any, first_position: int | None = None) -> None:
        self.first_position: int = header.first_position if header is not None else first_position
        self.path = path
        self.header = header  # struct sl_header *, or None until checked
        self.sealed = False
        self.sealed_used_bytes = 0
        # (C pointer, mmap), or None: one attribute, so a reader takes both in one step while
        # another thread unmaps (two, a reader could see the map present, then gone).
        self._view: tuple[Any, mmap.mmap] | None = None
        self._lock = threading.Lock()

    def mapping(self) -> tuple[Any, mmap.mmap]:
        """(C pointer, mmap) of the whole file, read-only, mapped on first use; ``StorageFailed``
        if the file cannot be opened, is not a regular file (a FIFO there must not block) or
        cannot be mapped. A segment whose header was read is mapped only if the file is still that
        header's (``_check_same_file``: ``Corruption`` segment_replaced otherwise): a handle maps
        by name, and beside a compaction the name may by then be the new log's file, whose frames
        would fail their checksums under this header's log id."""
        view = self._view
        if view is None:
            with self._lock:
                view = self._view
                if view is None:
                    fd = _open_segment_fd(self.path)
                    try:
                        for attempt in range(8):
                            size = os.fstat(fd).st_size
                            try:
                                mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
                                break
                            except ValueError:  # the writer trimmed the file (seal) between fstat and mmap
                                if attempt == 7:
                                    raise
                    except OSError as exc:  # ENOMEM once the process's maps run out (vm.max_map_count, RLIMIT_AS)
                        raise _unreadable_segment(self.path, exc.errno or errno.EIO) from None
                    finally:
                        os.close(fd)
                    if mapped is None:
                        raise Corruption(
                            f"segment {self.path} is empty; it should begin with a header.",
                            segment=self.path, offset=0, position=self.first_position, reason="header_short",
                        )
                    if self.header is not None:
                        try:
                            _check_same_file(mapped[:_HEADER_BYTES], self)
                        except Corruption:
                            mapped.close()
                            raise
                    view = self._view = (ffi.from_buffer("uint8_t[]", mapped), mapped)
        return view

    def forget_map(self) -> None:
        """Drop the map without the segment's lock (a forked child's copy, where no other thread
        runs): it is unmapped once nothing else refers to it."""
        self._view = None

    def mapped_bytes(self) -> int:
        view = self._view
        return len(view[1]) if view is not None else 0

    def file_size(self) -> int:
        """The size of the file this handle reads: its map's (``fstat`` of the descriptor the map
        keeps), else the file's under its name. Beside a compaction the name may by then be the
        new log's file, or nothing, while a read-only handle goes on reading the file it mapped."""
        view = self._view
        if view is not None:
            with contextlib.suppress(ValueError, OSError):  # unmapped meanwhile: by name, below
                return view[1].size()
        return os.stat(self.path).st_size

    def unmap(self) -> None:
        with self._lock:
            view, self._view = self._view, None
            if view is not None:
                mapped = view[1]
                del view  # and the C pointer with it: only a reader's own hold may keep the map
                try:
                    mapped.close()
                except BufferError:
                    pass  # a scan in another thread still uses it: the map goes with it


_RECOVERY_READ_BYTES = 1 << 20  # a read-only recovery reads the last segment in pieces from this size
_READONLY_RECOVERY_ATTEMPTS = 16  # readings of it before damage that keeps moving is reported
_RELEASE_BYTES = 8 << 20  # a long scan hands mapped pages back every this many bytes


def _release_pages(mapped: mmap.mmap, start: int, stop: int) -> int:
    """Drop this process's mapping of [start, stop) (page-aligned down); return the new start."""
    start = start - start % _PAGE_BYTES
    stop = stop - stop % _PAGE_BYTES if stop < len(mapped) else len(mapped)
    if stop > start:
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)
        except (ValueError, OSError):  # closed meanwhile, or not supported here
            return start
    return max(start, stop - stop % _PAGE_BYTES)


@dataclasses.dataclass(frozen=True)
class _CleanMarker:
    """What a clean close recorded (docs/format/segment.md, "The clean-close marker")."""

    log_id: int
    first_position: int  # the active segment's
    end: int
    listed: tuple[int, int] | None  # (segment count, CRC-32 of their first positions); None in the first form


def _first_positions_crc(first_positions: Sequence[int]) -> int:
    """CRC-32 of the segments' first positions (u64 little-endian each, in order)."""
    return zlib.crc32(struct.pack(f"<{len(first_positions)}Q", *first_positions))


def _clean_end(marker: _CleanMarker, segment: _Segment) -> int | None:
    """The end a clean close recorded, if the marker fits the active segment: its log id and
    first position, its full size, zeros after the end (nothing written since), and an intact
    commit frame ending exactly there. None otherwise: the open then scans, as after a crash."""
    header = segment.header
    first_position, end = marker.first_position, marker.end
    if marker.log_id != header.log_id or first_position != segment.first_position:
        return None
    # Read with pread, not through a map: beside a live writer (a read-only open) the window after
    # the end may be the tail of a segment the writer seals and trims meanwhile, and a trimmed page
    # read through a map is a SIGBUS; pread just returns fewer bytes.
    try:
        fd = open_regular_fd(segment.path, follow=False)
    except OSError:
        return None  # mapping() will say why, when something reads the segment
    try:
        size = os.fstat(fd).st_size
        if size != header.segment_bytes or end < first_position or _HEADER_BYTES + end - first_position > size:
            return None
        tail = _HEADER_BYTES + end - first_position
        start = max(tail - _COMMIT_FRAME.size, 0)
        raw = _pread_all(fd, tail + _CLEAN_ZERO_CHECK_BYTES - start, start)
    except OSError:
        return None  # unread: the open then scans the segment, and that read says why it fails
    finally:
        os.close(fd)
    window = raw[tail - start :]
    if window.count(0) != len(window) or len(window) < min(_CLEAN_ZERO_CHECK_BYTES, size - tail):
        return None  # written to (or trimmed) after the clean close
    if end > first_position and not _commit_frame_ends_at(raw[: tail - start], tail, end, int(header.log_id)):
        return None  # the last group's commit record is not intact: recovery will say why
    return end


def _judge_after_end(data: Any, data_bytes: int, header: Any, end_offset: int, first_nonzero: int, fault: Any) -> int:
    """sl_check_after_end from the frame slot holding the first byte that is not zero after a
    clean end at ``end_offset`` (the writer's open and a read-only one judge alike)."""
    return int(lib.sl_check_after_end(data, data_bytes, header, end_offset, first_nonzero & ~(_ALIGN_BYTES - 1), fault))


def _sl_recover_with(bulk: int, data: Any, data_bytes: int, header: Any, out: Any, fault: Any) -> int:
    """sl_recover with its ``bulk`` argument bound, called like sl_recover_readonly."""
    return int(lib.sl_recover(data, data_bytes, header, bulk, out, fault))


def _writer_holds_lock(directory: str) -> bool:
    """Does a writer hold the log in ``directory`` now (its flock on ``LOCK``)? Read from
    ``/proc/locks``, so that the check takes no lock itself: a read-only open must never make a
    writer's open fail with StoreLocked. True when it cannot tell (no ``/proc``: the rules for a
    live writer are the safe ones); False when there is no ``LOCK`` (no writer ever opened it)."""
    try:
        status = os.stat(os.path.join(directory, LOCK_FILE_NAME))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return True
    # /proc/locks names a file by its file system's device, which stat() gives, except where a
    # file system gives each subvolume a device of its own (btrfs): mountinfo has the other.
    devices = {(os.major(status.st_dev), os.minor(status.st_dev)), _mount_device(directory)}
    keys = {f"{major:02x}:{minor:02x}:{status.st_ino}" for major, minor in devices - {None}}
    # "1: FLOCK  ADVISORY  WRITE 8067 fe:00:2146869 0 EOF"; a waiter's line has "->" second
    return any(
        len(fields) > 5 and fields[1] == "FLOCK" and fields[5] in keys for fields in map(str.split, text.splitlines())
    )


def _mount_device(path: str) -> tuple[int, int] | None:
    """(major, minor) of the file system mounted where ``path`` is, as ``/proc/self/mountinfo``
    gives it (the device ``/proc/locks`` names its files by); None when it cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
        target = os.path.realpath(path)
    except (OSError, ValueError):
        return None
    # A line: mount id, parent id, major:minor, root, mount point, options..., e.g.
    # "61 1 0:52 /home /srv/data rw - btrfs /dev/sdb1 rw"; the mount point has space, tab,
    # newline and backslash as octal escapes (\040).
    mounts: list[tuple[str, str, str, tuple[int, int]]] = []  # id, parent id, point, device
    for fields in map(str.split, text.splitlines()):
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        major, _, minor = fields[2].partition(":")
        if major.isdigit() and minor.isdigit():
            mounts.append((fields[0], fields[1], point, (int(major), int(minor))))
    # Walk the mount tree down the path, as a path lookup does: from the root, each step goes to a
    # child mount that covers the path. Of a mount's children, the one on the shortest point is
    # the visible one (a deeper sibling was mounted first and is hidden under it, else it would be
    # the shallower one's child), and of equal ones the latest; a mount stacked on its parent's
    # point is that parent's child, so the walk ends on the top of the stack.
    ids = {mount_id for mount_id, _, _, _ in mounts}
    covering = [mount for mount in mounts if target == mount[2] or target.startswith(mount[2].rstrip("/") + "/")]
    roots = [mount for mount in covering if mount[1] not in ids]
    if not roots:
        return None
    current = roots[-1]
    seen = {current[0]}  # a mount met again (a cycle in a damaged or forged listing) ends the walk
    while children := [mount for mount in covering if mount[1] == current[0] and mount[0] not in seen]:
        shortest = min(len(point) for _, _, point, _ in children)
        current = [mount for mount in children if len(mount[2]) == shortest][-1]
        seen.add(current[0])
    return current[3]


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes of ``fd`` from ``offset``: fewer only where the file ends."""
    parts, got = [], 0
    while got < length:
        part = os.pread(fd, length - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _misnamed_segment(path: str, header_first_position: int, number: int) -> Corruption:
    return Corruption(
        f"segment {path} says it starts at position {header_first_position}, "
        "but its name says otherwise: it was renamed or misplaced.",
        segment=path, offset=lib.SL_HEADER_OFFSET_FIRST_POSITION, position=number, reason="segment_name",
    )


def _foreign_segment(path: str, first_position: int) -> Corruption:
    return Corruption(
        f"segment {path} belongs to another log (log id differs).",
        segment=path, offset=lib.SL_HEADER_OFFSET_LOG_ID, position=first_position, reason="log_id_mismatch",
    )


def _unsealed_segment(path: str, next_first_position: int, fault: Any) -> Corruption:
    return Corruption(
        f"segment {path} does not end with a seal at the position where the next segment "
        f"begins ({next_first_position}): a segment is missing or this one is damaged.",
        segment=path, offset=int(fault.offset), position=next_first_position, reason="segment_missing",
    )


def _check_same_file(header: bytes, segment: _Segment) -> None:
    """``Corruption`` unless ``header`` (the first bytes of the file now at ``segment.path``) names
    the log id and first position of the header read from that path earlier in this open. A
    read-only open beside a writer reads a segment by name more than once (its header, then its
    bytes): a compaction's switch between the two puts another log's file under the name, whose
    frames fail their checksums under this header; beside a live writer the recovery would take
    that for a group in flight and serve a log that ends before it (docs/format/segment.md)."""
    expected = (int(segment.header.log_id), segment.first_position)
    if len(header) < _HEADER_BYTES or _HEADER_NAMES.unpack_from(header, lib.SL_HEADER_OFFSET_LOG_ID) != expected:
        raise Corruption(
            f"segment {segment.path} is not the file this open read its header from: the log was "
            "replaced meanwhile (a compaction); open it again.",
            segment=segment.path, offset=lib.SL_HEADER_OFFSET_LOG_ID, position=segment.first_position,
            reason="segment_replaced",
        )


def _check_position(value: Any, field: str) -> int:
    if type(value) is not int:
        raise InvalidCommand(f"{field} must be an int, not {type(value).__name__}.", field=field)
    if value < 0:
        raise InvalidCommand(f"{field} must not be negative (got {value}).", field=field, position=value)
    return value


class SegmentLog:
    """An append-only log in one directory. Create with :meth:`SegmentLog.open`."""

    def __init__(self, _token: object = None) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError("use SegmentLog.open(directory, ...)")
        self._closed = True
        self._handle: Any = None
        self._lock_fd = -1
        self._segments: tuple[_Segment, ...] = ()
        self._end = 0
        self._write_lock = threading.Lock()
        # The C structs and arrays of an append, made once per handle and used under _write_lock
        # (four ffi.new and their frees were a fifth of a one-record append's Python cost). The
        # arrays grow with the largest group up to _APPEND_BUFFER_RECORDS records; a larger group
        # gets arrays of its own. The C calls clear the fault and fill the state on every call.
        self._append_fault: Any = None
        self._append_state: Any = None
        self._append_lengths: Any = None
        self._append_positions: Any = None
        self._append_room = 0
        self._failed = False
        self._clean_marker = False
        self._log_id = 0
        self._seed = 0  # where every frame checksum of this log starts (from the log id)
        self._marker_lists_segments = False  # the CLEAN on disk has the segment list (not the first form)
        self._detached = False  # detach(): the directory holds another log now; close() leaves it alone
        self._bulk_written = False  # BULK is in the directory (read at open; see BULK_FILE_NAME)
        self._known_end: int | None = None  # open(known_end=): where a read-only recovery stops reading
        self._fork_generation = _fork.generation  # the process it is used in (mwpstore._fork)
        # The sealed segments mapped, least recently read first (_mapped): bounded, or a handle
        # that has read its whole log once keeps a map and a descriptor per segment for its life.
        # Not once the maps hold the files (hold_files): a map dropped then would be made again
        # from the name, which may by then be another file.
        self._mapped_sealed: dict[_Segment, None] = {}
        self._maps_lock = threading.Lock()
        self._holding = False

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = SEGMENT_BYTES_DEFAULT,
        sync: bool = True,
        readonly: bool = False,
        io: Any = None,
        known_end: int | None = None,
    ) -> SegmentLog:
        """Open (creating if missing, unless ``readonly``) the log in ``directory``.

        Recovery runs here: a torn tail that was never acknowledged is cut off (not when
        ``readonly``); damage anywhere else raises :class:`Corruption` naming the segment, the
        offset and the reason, and nothing is changed. ``sync=False`` is bulk-load mode: groups
        are written but not fdatasync'ed, so they are not durable until :meth:`sync` or
        :meth:`close` returns. ``readonly`` takes no lock and never writes; it may run beside a
        live writer (another process) that appends, seals and trims segments: its recovery reads
        the last segment with pread (a map of it could be trimmed under it), it serves only whole
        checked groups up to the end of a commit frame it saw whole, and while a writer holds the
        log a last group without its whole commit frame is taken for one in flight, not damage
        (docs/format/segment.md); it maps every segment as it opens, so that it keeps reading the
        files it found when a compaction replaces the directory. ``io`` replaces the file operations (tests pass a recorder from
        :mod:`mwpstore.io_seam`).

        ``known_end`` (with ``readonly`` only): a position where a group the writer has written
        ends, such as a read-only view's index position. Recovery then reads the active segment
        only up to it, and the log ends there: the bytes past it may be a group the writer is still
        writing (which can look like damage), or the tail of a segment it is about to seal and
        trim (reading a trimmed page through the map is a SIGBUS). Damage before it is still
        ``Corruption``; a log that ends before it is opened with its own end. A clean-close marker
        that fits still gives the log its end, past ``known_end`` or not: the writer removes it
        before its first append, so nothing past that end is in flight.
        """
        try:
            directory = store_path(directory)
        except InvalidCommand:
            raise InvalidCommand("directory must be a non-empty str path without NUL.", field="directory") from None
        check_segment_bytes(segment_bytes)
        if io is not None and not hasattr(io, "io_struct"):
            raise InvalidCommand("io must come from mwpstore.io_seam (or be None).", field="io")
        if known_end is not None and (not readonly or type(known_end) is not int or known_end < 0):
            raise InvalidCommand("known_end must be None, or a position (an int >= 0) with readonly=True.", field="known_end")
        self = cls(_OPEN_TOKEN)
        self._known_end = known_end
        self._directory = os.path.abspath(os.fspath(directory))
        self._readonly = bool(readonly)
        self._sync = bool(sync)
        self._segment_bytes = segment_bytes
        self._io_owner = io
        self._io = lib.sl_io_default() if io is None else io.io_struct
        self._closed = False
        try:
            self._open_directory()
            self._load_segments()
            if self._readonly:
                self.hold_files()
        except BaseException:
            self._close_quietly()
            raise
        return self

    def hold_files(self, *, every: bool = False) -> None:
        """Map every segment now, and keep every map until :meth:`close` (a read-only open; the
        writer's log before a compaction switches its directory): the maps keep the files this
        handle reads, which a later read would otherwise open by name. Beside a live writer the
        name may by then be another file: a compaction renames the log directory away, puts a new
        log with new segments in its place, and deletes the old one (docs/format/segment.md). A
        file that cannot be mapped (not a regular file, empty, or gone from its name: the switch is
        between its two renames) is left to the first read that needs it, which says why, as
        before: a clean open reads no sealed segment. That read maps it by name, and ``mapping``
        checks the file is still the one whose header was read (``segment_replaced`` if not), as it
        does here, where a mismatch is raised at once. With ``every`` (the switch, whose segments
        the writer made) the first that cannot be mapped (no descriptor left: each map holds one)
        is raised instead: left unmapped, a read still running on this log would map the new log's
        file of that name, or none."""
        with self._maps_lock:
            self._holding = True  # from here on _note_mapped unmaps nothing
            self._mapped_sealed.clear()
        for segment in self._segments:
            try:
                segment.mapping()  # a vouched one's header is checked on these bytes at its first read
            except StorageFailed:
                if every:
                    raise
            except Corruption as exc:
                if every or exc.detail.get("reason") == "segment_replaced":
                    raise

    def _open_directory(self) -> None:
        directory = self._directory
        if self._readonly:
            if not os.path.isdir(directory):
                raise StorageFailed(f"there is no log at {directory}.", errno=errno.ENOENT, path=directory)
            return
        # each new directory (the log's and any missing parent) is an entry of its parent: synced
        # there, through the I/O seam so that a simulated power loss sees it
        makedirs_durable(directory, sync_directory=lambda parent: self._call(lib.sl_sync_directory, self._io, os.fsencode(parent)))
        fd = take_lock_file(
            os.path.join(directory, LOCK_FILE_NAME),
            lambda: StoreLocked(
                f"another writer holds the log at {directory}; close it first, or open with readonly=True.",
                path=directory,
            ),
            what="the log's lock file",
        )
        self._lock_fd = fd

    def _load_segments(self) -> None:
        directory = self._directory
        try:
            names = os.listdir(directory)
        except OSError as exc:
            raise StorageFailed(f"cannot list {directory}: {exc}", errno=exc.errno) from exc
        if not self._readonly:
            for name in sorted(names):
                if _TEMPORARY_NAME.match(name):  # a creation that never reached its rename
                    path = os.path.join(directory, name)
                    self._call(lib.sl_remove_file, self._io, os.fsencode(directory), os.fsencode(path))
                elif _CLEAN_TEMPORARY_NAME.match(name):
                    with contextlib.suppress(OSError):  # only ever a leftover: never read
                        os.unlink(os.path.join(directory, name))
        numbered = sorted((int(m.group(1)), name) for name in names if (m := _SEGMENT_NAME.match(name)))
        self._bulk_written = BULK_FILE_NAME in names
        marker = self._read_clean_marker()
        segments, clean_end = None, None
        if marker is not None:
            segments = self._vouched_segments(directory, numbered, marker)
            clean_end = _clean_end(marker, segments[-1]) if segments is not None else None
            if clean_end is None:  # the active segment is not as the close left it: read everything
                segments = None
        if segments is None:
            segments = self._inspected_segments(directory, numbered)
            clean_end = _clean_end(marker, segments[-1]) if marker is not None and segments else None
            if self._known_end is not None and clean_end is None:
                # the segments the writer started after the known end: not scanned, not served (their
                # headers and seals were checked with the others')
                segments = [segment for segment in segments if segment.first_position <= self._known_end] or segments[:1]
        self._segments = tuple(segments)
        scanned_unsynced = False
        if segments:
            self._log_id = int(segments[-1].header.log_id)
            self._seed = int(segments[-1].header.seed)
            if clean_end is not None:  # closed cleanly and untouched since: the end is known, nothing to scan
                self._end = clean_end
                self._clean_marker = True
                self._marker_lists_segments = marker is not None and marker.listed is not None
            else:
                scanned_unsynced = self._recover_last()
        if not self._readonly:
            active = self._segments[-1]
            handle = ffi.new("struct sl_log **")
            self._call(
                lib.sl_log_open, self._io, os.fsencode(directory), active.header, self._end, self._segment_bytes,
                1 if self._sync else 0, handle, segment=active,
            )
            self._handle = handle[0]
            self._append_fault = ffi.new("struct sl_fault *")
            self._append_state = ffi.new("struct sl_log_state *")
            if not self._sync:
                self._mark_bulk()
            else:
                if scanned_unsynced:
                    # A writer died, and the groups the scan found may be in the page cache only:
                    # one it wrote and never synced (its fdatasync not reached or failed), or a
                    # bulk-mode writer's, reaching the disk in any order. Synced before anything of
                    # them is served or indexed, and before BULK goes.
                    self._call(lib.sl_log_sync, self._handle, segment=active)
                if self._bulk_written:  # from here on every group is synced before the next is written
                    self._unmark_bulk()

    def _mark_bulk(self) -> None:
        """A bulk-mode writer: the BULK file durable before its first append."""
        if self._bulk_written:
            return
        path = os.path.join(self._directory, BULK_FILE_NAME)
        self._call(lib.sl_create_empty_file, self._io, os.fsencode(self._directory), os.fsencode(path))
        self._bulk_written = True

    def _unmark_bulk(self) -> None:
        """Every group is durable (recovered, or synced by a bulk-mode close): BULK goes, durably.
        A failure is ``StorageFailed`` (a directory that cannot be synced is a failing disk); BULK
        may then stay, and the next open recovers under the bulk-mode rules, which is safe."""
        path = os.path.join(self._directory, BULK_FILE_NAME)
        self._call(lib.sl_remove_file, self._io, os.fsencode(self._directory), os.fsencode(path))
        self._bulk_written = False

    def _inspected_segments(self, directory: str, numbered: list[tuple[int, str]]) -> list[_Segment]:
        """Every segment's header and seal read and checked (after a crash, or without a marker
        that vouches for the sealed segments); a new log gets its first segment."""
        segments, seals = self._inspect_all(directory, numbered)
        if not segments:
            if not self._readonly:
                log_id = int.from_bytes(os.urandom(8), "little") >> 1
                self._create_segment(log_id, 0)
                segments = [self._load_header(os.path.join(directory, segment_file_name(0)), 0)]
        if segments and segments[0].first_position != 0:
            raise Corruption(
                f"the log in {directory} starts at segment {segments[0].path}, not at position 0: "
                "earlier segments are missing.",
                segment=segments[0].path, offset=0, position=0, reason="segment_missing",
            )
        for earlier, later, seal in zip(segments, segments[1:], seals):
            if later.header.log_id != earlier.header.log_id:
                raise _foreign_segment(later.path, later.first_position)
            self._check_sealed(earlier, later.first_position, seal)
        return segments

    def _vouched_segments(self, directory: str, numbered: list[tuple[int, str]], marker: _CleanMarker) -> list[_Segment] | None:
        """The segments as a clean close left them, reading only the active one's header; None
        unless the marker lists exactly the segment files present (count and first positions).

        The sealed segments are then taken on the marker's word, with their header unread
        (``header`` None): ``_mapped`` checks header and seal, as the inspecting open does,
        before any of their bytes is used. So a clean open costs the same whatever the number
        of segments; damage to a sealed segment after a clean close is found by the first read,
        scan or ``verify()`` that reaches it, like damage inside its records always was."""
        if (
            marker.listed is None
            or len(numbered) < 2
            or numbered[0][0] != 0
            or numbered[-1][0] != marker.first_position  # the largest: no name past the positions a log has
            or marker.listed != (len(numbered), _first_positions_crc([number for number, _ in numbered]))
        ):
            return None
        active = self._inspect_all(directory, numbered[-1:])[0][0]
        if active.header.log_id != marker.log_id:
            return None
        prefix = os.path.join(directory, "")
        segments = []
        for (number, name), (following, _) in zip(numbered, numbered[1:]):
            segment = _Segment(prefix + name, None, number)
            segment.sealed = True
            segment.sealed_used_bytes = _HEADER_BYTES + following - number + _SEAL_BYTES
            segments.append(segment)
        segments.append(active)
        return segments

    def _mapped(self, segment: _Segment) -> tuple[Any, mmap.mmap]:
        """``segment.mapping()``; the first time for a segment taken on a clean close's word, its
        header and seal are checked on the mapped bytes (the inspecting open's checks and errors)."""
        data, mapped = segment.mapping()
        if segment.sealed:
            self._note_mapped(segment)
        if segment.header is None:
            header = ffi.new("struct sl_header *")
            status = ffi.new("int *")
            seal_fault, fault = self._fault(), self._fault()
            next_first_position = segment.first_position + segment.sealed_used_bytes - _HEADER_BYTES - _SEAL_BYTES
            rc = lib.sl_segment_check_mapped(data, len(mapped), next_first_position, header, status, seal_fault, fault)
            if rc != lib.SL_OK:
                raise self._error(rc, fault, path=segment.path, position=segment.first_position)
            if header.first_position != segment.first_position:
                raise _misnamed_segment(segment.path, int(header.first_position), segment.first_position)
            if header.log_id != self._log_id:
                raise _foreign_segment(segment.path, segment.first_position)
            if status[0] != lib.SL_OK:
                raise _unsealed_segment(segment.path, next_first_position, seal_fault)
            segment.header = header
        return data, mapped

    def _note_mapped(self, segment: _Segment) -> None:
        """Mark a sealed segment read last; unmap the least recently read beyond
        ``SEGMENT_MAPS_MAX``. A read still using one keeps its map until it lets go (``unmap``),
        and one read again is mapped again."""
        with self._maps_lock:
            if self._holding:
                return
            recent = self._mapped_sealed
            recent.pop(segment, None)
            recent[segment] = None
            while len(recent) > SEGMENT_MAPS_MAX:  # unmapped under the lock: hold_files waits for it
                oldest = next(iter(recent))
                del recent[oldest]
                oldest.unmap()

    def _note_sealed(self, segment: _Segment) -> None:
        """Count a segment the writer just sealed among the maps ``SEGMENT_MAPS_MAX`` bounds, if
        a read mapped it while it was active: ``_mapped`` counts only segments sealed when read,
        so a reader following the log's tail left every segment it read mapped, with its
        descriptor, for the handle's life. (A read that maps it after ``sealed`` is set counts it
        there; one that mapped it before is seen here.)"""
        if segment.mapped_bytes():
            self._note_mapped(segment)

    def _load_header(self, path: str, number: int) -> _Segment:
        directory, name = os.path.split(path)
        return self._inspect_all(directory, [(number, name)])[0][0]

    def _inspect_all(self, directory: str, numbered: list[tuple[int, str]]) -> tuple[list[_Segment], list[tuple[int, Any, int]]]:
        """The segments ``numbered`` (ascending (first position, file name)) with their headers
        checked, and for each but the last, (seal status, seal fault, file size) of the seal
        expected where the next begins. One C call reads every header and seal (no mapping);
        errors are raised segment by segment, in order."""
        numbers = [number for number, _ in numbered]
        # 20 digits can name a position no header may hold (even past u64): inspect the segments
        # before the first such name, then refuse it.
        count = next((index for index, number in enumerate(numbers) if number > lib.SL_FIRST_POSITION_MAX), len(numbers))
        headers = ffi.new("struct sl_header[]", count)
        file_bytes = ffi.new("uint64_t[]", count)
        seal_status = ffi.new("int[]", count)
        seal_faults = ffi.new("struct sl_fault[]", count)
        stopped_at = ffi.new("uint32_t *")
        fault = self._fault()
        rc = lib.sl_segments_inspect(
            os.fsencode(directory), numbers[:count], count, headers, file_bytes, seal_status, seal_faults, stopped_at, fault
        )
        segments: list[_Segment] = []
        seals: list[tuple[int, Any, int]] = []
        prefix = os.path.join(directory, "")
        for index in range(count if rc == lib.SL_OK else int(stopped_at[0])):
            number, name = numbered[index]
            path = prefix + name
            if headers[index].first_position != number:
                raise _misnamed_segment(path, int(headers[index].first_position), number)
            header = ffi.new("struct sl_header *")
            header[0] = headers[index]
            segments.append(_Segment(path, header))
            status = int(seal_status[index])
            seal_fault = None
            if status != lib.SL_OK:
                seal_fault = self._fault()
                seal_fault[0] = seal_faults[index]
            seals.append((status, seal_fault, int(file_bytes[index])))
        if rc != lib.SL_OK:
            number, name = numbered[int(stopped_at[0])]
            path = prefix + name
            if rc == lib.SL_E_IO:
                raise _unreadable_segment(path, int(fault.sys_errno))
            raise self._error(rc, fault, path=path, position=number)
        if count < len(numbered):
            path = prefix + numbered[count][1]
            raise Corruption(
                f"segment {path} is named after a position no log reaches: it was renamed or misplaced.",
                segment=path, offset=0, position=numbered[count][0], reason="segment_name",
            )
        return segments, seals

    def _check_sealed(self, segment: _Segment, next_first_position: int, seal: tuple[int, Any, int]) -> None:
        status, fault, file_bytes = seal
        if status != lib.SL_OK:
            raise _unsealed_segment(segment.path, next_first_position, fault)
        segment.sealed = True
        segment.sealed_used_bytes = _HEADER_BYTES + next_first_position - segment.first_position + _SEAL_BYTES
        if file_bytes > segment.sealed_used_bytes and not self._readonly:
            # Sealed, but the crash came before its trim was durable: trim it now.
            segment.unmap()
            self._call(
                lib.sl_segment_truncate, self._io, os.fsencode(segment.path), segment.sealed_used_bytes, 0, segment=segment
            )

    def _recover_last(self) -> bool:
        """Find the end of the active segment by scanning it (after a crash, or without a marker
        that fits); cut off a torn tail that was never acknowledged (not when read-only). True
        when the writer's open must still sync what the scan found: groups, and no repair (a
        repair's truncate syncs the file; a seal was synced before it was trimmed; an empty
        segment was synced when it was created)."""
        segment = self._segments[-1]
        if self._readonly:
            recovery = self._recover_readonly(segment)
            self._end = int(recovery.end_position)
            if recovery.sealed:
                segment.sealed = True
                segment.sealed_used_bytes = int(recovery.used_bytes)
            return False
        data, mapped = segment.mapping()
        size = len(mapped)
        recovery = ffi.new("struct sl_recovery *")
        fault = self._fault()
        rc = lib.sl_recover(data, size, segment.header, 1 if self._bulk_written else 0, recovery, fault)
        if rc != lib.SL_OK:
            raise self._error(rc, fault, segment=segment)
        self._end = int(recovery.end_position)
        used = int(recovery.used_bytes)
        segment_bytes = int(segment.header.segment_bytes)
        if recovery.sealed:
            segment.sealed = True
            segment.sealed_used_bytes = used
            if size > used:
                segment.unmap()
                self._call(lib.sl_segment_truncate, self._io, os.fsencode(segment.path), used, 0, segment=segment)
            self._create_segment(int(segment.header.log_id), self._end)
            path = os.path.join(self._directory, segment_file_name(self._end))
            self._segments = self._segments + (self._load_header(path, self._end),)
            return False
        needs_repair = bool(recovery.torn) or size < segment_bytes
        if not recovery.torn:
            # Bytes after the end must be zero, so no stale frame can ever look committed.
            found = ffi.new("uint64_t *")
            fd = os.open(segment.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._call(lib.sl_find_nonzero, fd, used, size, found, segment=segment)
            finally:
                os.close(fd)
            if found[0] < size:
                if not self._bulk_written:
                    # what is not zero after the clean end may be groups a zeroed block cut off
                    rc = _judge_after_end(data, size, segment.header, used, found[0], fault)
                    if rc != lib.SL_OK:
                        raise self._error(rc, fault, segment=segment)
                needs_repair = True
        if needs_repair:
            segment.unmap()
            self._call(lib.sl_segment_truncate, self._io, os.fsencode(segment.path), used, segment_bytes, segment=segment)
        return not needs_repair and self._end > segment.first_position  # groups found, none synced by a repair

    def _recover_readonly(self, segment: _Segment) -> Any:
        """The recovery (``struct sl_recovery``) of the last segment for a read-only open, which
        may run beside a live writer: its bytes are read with pread, never through a map.

        The writer may be copying a group in (any prefix of its bytes visible, in any order within
        a page), and may seal the segment and trim the file to just past the seal at any moment:
        a map read of a trimmed page is a SIGBUS, where pread returns fewer bytes. The file is read
        from its start in growing pieces until the walk over the groups stops at a clean end (a
        zero frame header where a group would begin) or a seal, or the file (or ``known_end``)
        ends: the end is then where the last whole group's commit frame ends.

        With ``known_end`` every byte before it is written already, and sl_recover's rules apply,
        with the judgement of the bytes after a clean end (up to ``known_end``), as for the writer's
        open. Without it, while a writer holds the log (``_writer_holds_lock``),
        ``sl_recover_readonly`` takes a group that does not end in its commit frame for one in
        flight (not there) unless an intact commit frame or seal follows it; with no writer, the
        writer's rules apply (a damaged last group is reported, as the writer's open would).
        Either way damage is reported only when a second reading, by the same rules and made after
        the first, finds it at the same offset: the bytes the first reading saw before the later
        intact frame may be older than it (a page read before the writer copied into it, the next
        one after), but a write is copied in file order, so by the second reading everything
        before that frame is written; and a writer that started after the check (the rules were
        the writer's) has been seen by the check before the second reading.

        Why the reads through a map afterwards are safe: they stop at the end found here (the
        end of a commit frame, or the seal), and the writer never cuts a segment below its own
        end: sealing trims to just past the seal, written at the writer's end, and a writer's open
        cuts a torn tail only after the last whole group, never a group a reader saw whole."""
        known_end = self._known_end
        limit = int(segment.header.segment_bytes)
        if known_end is not None:  # nothing past it is read (see open)
            limit = min(limit, _HEADER_BYTES + max(known_end - segment.first_position, 0))
        fd = _open_segment_fd(segment.path)
        try:
            try:
                header = _pread_all(fd, _HEADER_BYTES, 0)
            except OSError as exc:
                raise _unreadable_segment(segment.path, exc.errno or errno.EIO) from None
            _check_same_file(header, segment)
            seen = None
            for _ in range(_READONLY_RECOVERY_ATTEMPTS):
                live = known_end is None and _writer_holds_lock(self._directory)
                recover = lib.sl_recover_readonly if live else functools.partial(_sl_recover_with, 1 if self._bulk_written else 0)
                rc, recovery, fault = self._read_and_recover(fd, segment, limit, recover)
                if rc == lib.SL_OK and not live and not self._bulk_written:
                    rc, fault = self._check_readonly_after_end(fd, segment, limit, recovery)
                if rc == lib.SL_OK:
                    return recovery
                if rc != lib.SL_E_CORRUPT or known_end is not None:
                    break
                damage = (live, int(fault.reason), int(fault.offset))
                if damage == seen:
                    break  # the same damage, by the same rules, in a reading made after the first: real
                seen = damage
        finally:
            os.close(fd)
        raise self._error(rc, fault, segment=segment)

    @staticmethod
    def _check_readonly_after_end(fd: int, segment: _Segment, limit: int, recovery: Any) -> tuple[int, Any]:
        """sl_check_after_end for a read-only open that found a clean end by the writer's rules (no
        writer, or before ``known_end``, which ``limit`` then stops at): the bytes after it are read
        only where the file holds any that are not zero. (rc, fault)"""
        fault = ffi.new("struct sl_fault *")
        if recovery.sealed or recovery.torn:
            return lib.SL_OK, fault
        used = int(recovery.used_bytes)
        found = ffi.new("uint64_t *")
        rc = lib.sl_find_nonzero(fd, used, limit, found, fault)
        if rc != lib.SL_OK:
            raise _unreadable_segment(segment.path, int(fault.sys_errno) or errno.EIO)
        if found[0] >= limit:
            return lib.SL_OK, fault
        try:
            data = _pread_all(fd, limit, 0)
        except OSError as exc:
            raise _unreadable_segment(segment.path, exc.errno or errno.EIO) from None
        buffer = ffi.from_buffer("uint8_t[]", data)
        try:
            rc = _judge_after_end(buffer, len(data), segment.header, used, found[0], fault)
        finally:
            ffi.release(buffer)
        return rc, fault

    @staticmethod
    def _read_and_recover(fd: int, segment: _Segment, limit: int, recover: Any) -> tuple[int, Any, Any]:
        """One reading of the segment for ``_recover_readonly``: (rc, recovery, fault)."""
        recovery = ffi.new("struct sl_recovery *")
        fault = ffi.new("struct sl_fault *")
        data = bytearray()
        want = min(limit, _RECOVERY_READ_BYTES)
        while True:
            try:
                data += _pread_all(fd, want - len(data), len(data))
            except OSError as exc:
                raise _unreadable_segment(segment.path, exc.errno or errno.EIO) from None
            got = len(data)
            buffer = ffi.from_buffer("uint8_t[]", data if got else bytearray(1))
            try:
                rc = recover(buffer, got, segment.header, recovery, fault)
            finally:
                ffi.release(buffer)
            clean_end = not recovery.torn and int(recovery.used_bytes) + lib.SL_FRAME_HEADER_BYTES <= got
            if rc != lib.SL_OK or recovery.sealed or clean_end or got < want or want >= limit:
                return rc, recovery, fault
            want = min(limit, want * 4)

    def _read_clean_marker(self) -> _CleanMarker | None:
        """The clean close's marker, if present, intact and of a known form; None otherwise (the
        open then reads every segment and scans the active one, as after a crash)."""
        path = os.path.join(self._directory, CLEAN_FILE_NAME)
        try:
            # never through a symbolic link: a marker is trusted to skip the scan, and this log
            # only ever renames a file of its own to the name
            with os.fdopen(open_regular_fd(path, follow=False), "rb") as file:
                raw = file.read(_CLEAN_LIST.size + 8)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ELOOP):
                return None  # a FIFO, device, socket or link: not a marker this log wrote; scan instead
            raise StorageFailed(f"cannot read {path}: {exc}", errno=exc.errno) from exc
        body, check = raw[:-4], raw[-4:]
        if len(body) not in (_CLEAN.size, _CLEAN_LIST.size) or zlib.crc32(body) != int.from_bytes(check, "little"):
            return None  # damaged or foreign: recover by scanning, as after a crash
        if len(body) == _CLEAN.size:  # the first form: the end only
            magic, log_id, first_position, end = _CLEAN.unpack(body)
            return _CleanMarker(log_id, first_position, end, None) if magic == _CLEAN_MAGIC else None
        magic, log_id, first_position, end, count, names_crc = _CLEAN_LIST.unpack(body)
        return _CleanMarker(log_id, first_position, end, (count, names_crc)) if magic == _CLEAN_LIST_MAGIC else None

    def _write_clean_marker(self) -> None:
        """Record the durable end after a clean close (temp file, fsync, rename, directory fsync)."""
        segment = self._segments[-1]
        if segment.sealed:
            return
        first_positions = [each.first_position for each in self._segments]
        body = _CLEAN_LIST.pack(
            _CLEAN_LIST_MAGIC, self._log_id, segment.first_position, self._end, len(first_positions),
            _first_positions_crc(first_positions),
        )
        path = os.path.join(self._directory, CLEAN_FILE_NAME)
        # a fresh name, created exclusively and never through a link: whatever else lies in the
        # directory (a FIFO, a symlink) is neither waited on nor written through
        temporary = f"{path}.{secrets.token_hex(8)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                os.write(fd, body + zlib.crc32(body).to_bytes(4, "little"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _fsync_directory(self._directory)

    def _drop_clean_marker(self) -> None:
        """Before the first append after an open: the recorded end is about to go stale."""
        path = os.path.join(self._directory, CLEAN_FILE_NAME)
        try:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            _fsync_directory(self._directory)
        except OSError as exc:
            self._failed = True
            raise StorageFailed(f"cannot remove {path}: {exc}; reopen the log", errno=exc.errno) from exc
        self._clean_marker = False

    def _create_segment(self, log_id: int, first_position: int) -> None:
        self._call(lib.sl_segment_create, self._io, os.fsencode(self._directory), log_id, first_position, self._segment_bytes)

    # -- errors: the one place that turns C status codes into typed errors ----------------------

    @staticmethod
    def _fault() -> Any:
        return ffi.new("struct sl_fault *")

    def _call(self, function: Any, *arguments: Any, segment: _Segment | None = None) -> None:
        """Call a C function whose last parameter is a struct sl_fault *; raise its typed error."""
        fault = ffi.new("struct sl_fault *")
        rc = function(*arguments, fault)
        if rc != lib.SL_OK:
            raise self._error(rc, fault, segment=segment)

    def _error(
        self, rc: int, fault: Any, *, segment: _Segment | None = None, path: str | None = None, position: int | None = None
    ) -> Exception:
        where = path if path is not None else (segment.path if segment is not None else self._directory)
        reason = REASONS.get(int(fault.reason), f"reason_{int(fault.reason)}")
        if rc == lib.SL_E_CORRUPT:
            at = int(fault.position) if position is None else position
            return Corruption(
                f"segment {where} is damaged at offset {int(fault.offset)} (position {at}): {reason}. "
                "Nothing was truncated; restore the file or rebuild from a replica.",
                segment=where, offset=int(fault.offset), position=at, reason=reason,
            )
        if rc == lib.SL_E_IO:
            code = int(fault.sys_errno)
            return StorageFailed(
                f"I/O failed on {where}: {os.strerror(code) if code else 'unknown error'}. "
                "The handle refuses writes; close and reopen the log to recover.",
                errno=code, path=where,
            )
        if rc == lib.SL_E_FAILED:
            return StorageFailed(
                "an earlier I/O failure left this handle refusing writes; close and reopen the log.", path=where
            )
        if rc == lib.SL_E_LIMIT:
            return LimitExceeded(f"a log bound was exceeded: {reason}.", field=reason)
        if rc == lib.SL_E_NOT_RECORD:
            return self._not_a_record(int(fault.position))
        if rc == lib.SL_E_NO_MEMORY:
            return StorageFailed("out of memory in the segment log.", errno=errno.ENOMEM)
        return InvalidCommand(f"the segment log rejected the call ({reason}).", field=reason)

    # -- properties ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the segment log is closed; open it again.")
        if self._fork_generation != _fork.generation:
            raise StoreClosed(f"the segment log: {_fork.FORKED_MESSAGE}.")

    @property
    def start(self) -> int:
        """The first position still present (0: this version never drops old segments)."""
        self._check_open()
        return self._segments[0].first_position if self._segments else 0

    @property
    def end(self) -> int:
        """The position just after the last committed group: the next record's position."""
        self._check_open()
        return self._end

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def log_id(self) -> int:
        """A random number fixed when the log was created, stored in every segment header."""
        self._check_open()
        return self._log_id

    # -- writing ------------------------------------------------------------------------------

    def append(self, records: Sequence[bytes | bytearray | memoryview]) -> list[int]:
        """Append ``records`` as one commit group and return each record's position.

        One write and (unless bulk mode) one fdatasync; readers see all the records or none.
        """
        self._check_open()
        if self._readonly:
            raise InvalidCommand("the log was opened readonly=True; it cannot append.", field="readonly")
        if isinstance(records, (bytes, bytearray, memoryview, str)):
            raise InvalidCommand("append takes a sequence of records, not a single bytes object.", field="records")
        try:
            count = len(records)
        except TypeError:
            raise InvalidCommand("records must be a sequence (list or tuple) of bytes.", field="records") from None
        if count == 0:
            return []
        if count > GROUP_RECORDS_MAX:
            raise LimitExceeded(f"a group holds at most {GROUP_RECORDS_MAX} records (got {count}).", field="records")
        try:
            lengths = list(map(len, records))
            longest, total = max(lengths), sum(lengths)  # each taken once
            # the bounds before the join, which would copy all of it (a memoryview of wide items
            # counts items here, fewer than its bytes: the checks after the join catch that one)
            if longest <= RECORD_BYTES_MAX and total > GROUP_BYTES_MAX:
                raise LimitExceeded(f"a group holds at most {GROUP_BYTES_MAX} bytes (got {total}).", field="records")
            blob = b"".join(records) if longest <= RECORD_BYTES_MAX else b""
        except TypeError:
            raise InvalidCommand("every record must be bytes, bytearray or memoryview.", field="records") from None
        if blob and len(blob) != total:  # e.g. a memoryview whose items are wider than a byte
            lengths = [memoryview(record).nbytes for record in records]
            longest = max(lengths)
        if longest > RECORD_BYTES_MAX:
            raise LimitExceeded(
                f"a record holds at most {RECORD_BYTES_MAX} bytes (record {lengths.index(longest)} has {longest}).",
                field="record", index=lengths.index(longest),
            )
        if len(blob) > GROUP_BYTES_MAX:
            raise LimitExceeded(f"a group holds at most {GROUP_BYTES_MAX} bytes (got {len(blob)}).", field="records")
        with self._write_lock:
            self._check_open()
            if self._failed:  # also one the C writer does not know of (the marker's removal): never retried
                raise self._error(lib.SL_E_FAILED, ffi.new("struct sl_fault *"), segment=self._segments[-1])
            if self._clean_marker:
                self._drop_clean_marker()
            if count <= self._append_room:
                lengths_c, positions_c = self._append_lengths, self._append_positions
                lengths_c[0:count] = lengths
            elif count <= _APPEND_BUFFER_RECORDS:
                lengths_c = self._append_lengths = ffi.new("uint32_t[]", lengths)
                positions_c = self._append_positions = ffi.new("uint64_t[]", count)
                self._append_room = count
            else:
                lengths_c, positions_c = ffi.new("uint32_t[]", lengths), ffi.new("uint64_t[]", count)
            fault, state = self._append_fault, self._append_state
            rc = lib.sl_log_append_state(self._handle, blob, len(blob), lengths_c, count, positions_c, fault, state)
            self._observe_writer(state)
            if rc != lib.SL_OK:
                raise self._error(rc, fault, segment=self._segments[-1])
            return ffi.unpack(positions_c, count)

    def _observe_writer(self, state: Any) -> None:
        """Publish what the C writer did, from the ``struct sl_log_state`` its append filled
        (``_write_lock`` held): first a seal or a new segment, then the new end."""
        self._failed = bool(state.failed)
        active = self._segments[-1]
        first_position, end = int(state.first_position), int(state.end_position)
        if first_position != active.first_position:  # rolled over: the seal ends where the new segment starts
            active.sealed_used_bytes = _HEADER_BYTES + first_position - active.first_position + _SEAL_BYTES
            active.sealed = True
            self._note_sealed(active)
            path = os.path.join(self._directory, segment_file_name(first_position))
            self._segments = self._segments + (self._load_header(path, first_position),)
        elif state.sealed and not active.sealed:  # sealed, then creating the next segment failed
            active.sealed_used_bytes = _HEADER_BYTES + end - active.first_position + _SEAL_BYTES
            active.sealed = True
            self._note_sealed(active)
        elif int(state.segment_bytes) != int(active.header.segment_bytes):
            # The empty active segment was too small for the group and the writer replaced it
            # with a larger one under the same name: a map of the old file would show nothing of
            # the group, and its header the old size.
            active.unmap()
            self._segments = self._segments[:-1] + (self._load_header(active.path, first_position),)
        self._end = end

    def sync(self) -> None:
        """Make every appended group durable (what bulk mode defers). No-op when read-only."""
        self._check_open()
        if self._readonly:
            return
        fault = ffi.new("struct sl_fault *")
        with self._write_lock:
            self._check_open()
            rc = lib.sl_log_sync(self._handle, fault)
            if rc != lib.SL_OK:
                self._failed = True
                raise self._error(rc, fault, segment=self._segments[-1])

    # -- reading ------------------------------------------------------------------------------

    def _segment_index(self, segments: tuple[_Segment, ...], position: int) -> int:
        firsts = [segment.first_position for segment in segments]
        return bisect.bisect_right(firsts, position) - 1

    @staticmethod
    def _readable_bytes(segment: _Segment, end: int) -> int:
        # What a read, scan or verify may touch of the segment's map: below the end a recovery
        # found (the end of a commit frame) or the seal. The writer never trims a segment below
        # its own end, so a read-only handle beside it never touches a page cut off the file.
        if segment.sealed:
            return segment.sealed_used_bytes
        return _HEADER_BYTES + max(0, end - segment.first_position)

    def read(self, position: int) -> bytes:
        """The record that starts at ``position`` (as returned by append or scan)."""
        self._check_open()
        _check_position(position, "position")
        end, segments = self._end, self._segments
        if position >= end or position % _ALIGN_BYTES != 0 or not segments or position < segments[0].first_position:
            raise InvalidCommand(
                f"position {position} is not the start of a committed record (the log holds [{self.start}, {end})).",
                field="position", position=position,
            )
        segment = segments[self._segment_index(segments, position)]
        data, mapped = self._mapped(segment)
        offset = ffi.new("uint64_t *")
        length = ffi.new("uint32_t *")
        fault = ffi.new("struct sl_fault *")
        readable = min(self._readable_bytes(segment, end), len(mapped))
        rc = lib.sl_read_record(data, readable, segment.header, position, offset, length, fault)
        if rc != lib.SL_OK:
            error = self._error(rc, fault, segment=segment)
            if rc == lib.SL_E_CORRUPT:
                self._walk_to(segment, position, end)  # raises the first damage it meets, if any
                error = self._not_a_record(position)
            raise error
        return mapped[offset[0] : offset[0] + length[0]]

    def group_ends_at(self, position: int) -> bool:
        """True if ``position`` is the log's start or where an intact commit frame ends, up to the
        log's end: a position an index built from this log can have reached. An index that names
        another is not this log's (docs/recovery.md, step 4)."""
        self._check_open()
        _check_position(position, "position")
        end, segments = self._end, self._segments
        if not segments or position in (segments[0].first_position, end):
            return True  # the end is a group's: the recovery that found it ends only after one
        if position < segments[0].first_position or position > end or position % _ALIGN_BYTES != 0:
            return False
        segment = segments[self._segment_index(segments, position - 1)]  # a sealed one's last group ends at its seal
        _, mapped = self._mapped(segment)
        tail = _HEADER_BYTES + position - segment.first_position
        if tail > min(self._readable_bytes(segment, end), len(mapped)):
            return False
        frame = bytes(mapped[max(tail - COMMIT_FRAME_BYTES, 0) : tail])
        return _commit_frame_ends_at(frame, tail, position, self._log_id)

    @staticmethod
    def _not_a_record(position: int) -> InvalidCommand:
        return InvalidCommand(
            f"position {position} is not the start of a record in this log.", field="position", position=position
        )

    def _walk_to(self, segment: _Segment, position: int, end: int) -> None:
        """Walk the frames of ``segment`` from its start up to ``position`` (an error path only).

        A frame that names a position but fails its checksum is either damage or bytes inside a
        record that happen to look like a header; walking from a known frame start tells them
        apart. Raises :class:`Corruption` if the walk meets damage before ``position``.
        """
        for _ in self._scan(segment.first_position, min(end, position + _ALIGN_BYTES), end, SCAN_BATCH_RECORDS_MAX):
            pass

    def scan(
        self, start: int = 0, *, end: int | None = None, batch_records: int = 4096, split_tags: bool = False
    ) -> Iterator[RecordBatch]:
        """Batches of the committed records with ``start <= position < end``.

        ``start`` is a record position (or a segment's first position, or ``log.end``);
        ``end`` defaults to the log's end when the scan is created. Each batch is framed and
        checksummed by one C call over the read-only memory map. ``split_tags``: each record's
        first byte goes to the batch's ``tags`` instead (see :class:`RecordBatch`).
        """
        self._check_open()
        _check_position(start, "start")
        if type(batch_records) is not int:
            raise InvalidCommand("batch_records must be an int.", field="batch_records")
        if not 1 <= batch_records <= SCAN_BATCH_RECORDS_MAX:
            raise LimitExceeded(
                f"batch_records must be between 1 and {SCAN_BATCH_RECORDS_MAX} (got {batch_records}).",
                field="batch_records",
            )
        if type(split_tags) is not bool:
            raise InvalidCommand("split_tags must be True or False.", field="split_tags")
        log_end, segments = self._end, self._segments
        stop = log_end if end is None else _check_position(end, "end")
        if stop > log_end:
            raise InvalidCommand(f"end {stop} is past the log's end {log_end}.", field="end", position=stop)
        if start % _ALIGN_BYTES != 0 or start > log_end or (segments and start < segments[0].first_position):
            raise InvalidCommand(
                f"start {start} is not a record position in this log.", field="start", position=start
            )
        return self._scan(start, stop, log_end, batch_records, split_tags)

    def _scan(self, start: int, stop: int, log_end: int, batch_records: int, split_tags: bool = False) -> Iterator[RecordBatch]:
        if start >= stop:
            return
        segments = self._segments
        index = self._segment_index(segments, start)
        state = ffi.new("struct sl_scan_state *")
        positions_c = ffi.new("uint64_t[]", batch_records)
        starts_c = ffi.new("uint64_t[]", batch_records)
        stops_c = ffi.new("uint64_t[]", batch_records)
        count_c = ffi.new("uint32_t *")
        fault = ffi.new("struct sl_fault *")
        segment = segments[index]
        state.position = start
        state.group_known = 1 if start == segment.first_position else 0
        state.group_start = start
        state.group_checksum = self._seed
        unpack, buffer = ffi.unpack, ffi.buffer
        released = 0  # pages of the current segment's map before this offset were handed back
        mapped = None
        try:
            while True:
                self._check_open()
                data, mapped = self._mapped(segment)
                readable = min(self._readable_bytes(segment, log_end), len(mapped))
                rc = lib.sl_scan(data, readable, segment.header, stop, batch_records, state,
                                 positions_c, starts_c, stops_c, count_c, fault)
                if rc != lib.SL_OK:
                    if rc == lib.SL_E_CORRUPT and not state.group_known and int(state.position) == start:
                        self._walk_to(segment, start, log_end)  # damage, or a start inside a record?
                        raise self._not_a_record(start)
                    raise self._error(rc, fault, segment=segment)
                count = count_c[0]
                if segment.sealed and not state.sealed and self._past_seal(segment, state):
                    raise self._damage_at_seal(segment, data, readable, state, batch_records)
                if count:
                    # One C call makes every record's bytes from where sl_scan found them (a
                    # struct format built per batch and one unpack_from cost about 800
                    # instructions per record, slicing each one more; this about 150).
                    first = starts_c[0]
                    records = _record_bytes(mapped, buffer(starts_c, 8 * count), buffer(stops_c, 8 * count), split_tags)
                    if split_tags:  # (rest of each record, tag bytes)
                        yield RecordBatch(unpack(positions_c, count), records[0], int(state.position), records[1])
                    else:
                        yield RecordBatch(unpack(positions_c, count), records, int(state.position))
                    # Keep the resident set bounded on long scans: drop the mapped pages already
                    # passed (only from this process's page tables; touching them maps them back).
                    if first - released >= _RELEASE_BYTES:
                        released = _release_pages(mapped, released, first)
                if state.position >= stop:
                    return
                if state.sealed:
                    segments = self._segments
                    index += 1
                    if index >= len(segments) or segments[index].first_position != state.position:
                        raise Corruption(
                            f"segment {segment.path} is sealed but no segment starts at {int(state.position)}.",
                            segment=segment.path, offset=0, position=int(state.position), reason="segment_missing",
                        )
                    _release_pages(mapped, released, len(mapped))
                    segment, released = segments[index], 0
                    state.sealed = 0
                    state.group_known = 1
                    state.group_start = state.position
                    state.group_records = 0
                    state.group_checksum = self._seed
                elif count == 0:
                    raise self._unexpected_end(segment, int(state.position))
        finally:
            if mapped is not None and released:  # a long scan: hand back the pages it passed
                _release_pages(mapped, released, _HEADER_BYTES + int(state.position) - segment.first_position)

    @staticmethod
    def _seal_position(segment: _Segment) -> int:
        """Where a sealed segment's seal is (the next segment's first position)."""
        return segment.first_position + segment.sealed_used_bytes - _HEADER_BYTES - _SEAL_BYTES

    @staticmethod
    def _unexpected_end(segment: _Segment, position: int) -> Corruption:
        return Corruption(
            f"segment {segment.path} ends at position {position} before the committed end.",
            segment=segment.path, offset=_HEADER_BYTES + position - segment.first_position, position=position,
            reason="unexpected_end",
        )

    @classmethod
    def _past_seal(cls, segment: _Segment, state: Any) -> bool:
        """Has a scan of the sealed ``segment`` that stopped short of reading the seal (its end
        at or before the seal's position) gone over the seal, or reached it inside a group?

        Either way the records it read are in no group closed before the seal, and none may be
        served: a frame (valid on its own) that runs over the spot where the seal was found, or
        a group the seal cuts off. Open checked only the seal frame itself, so a scan that ends
        where the seal lies (the log's end, when the active segment is empty) must check this."""
        seal_position = cls._seal_position(segment)
        position = int(state.position)
        return position > seal_position or (position == seal_position and state.group_records != 0)

    def _damage_at_seal(self, segment: _Segment, data: Any, readable: int, state: Any, batch_records: int) -> Exception:
        """The error of a sealed segment whose frames do not lead to its seal (``_past_seal``):
        the frames from the scan's position are read to the segment's end, which is where they
        fail (a seal that cuts a group, a frame cut by the end, or nothing more), as the strict
        reading of a sealed segment (verify(), the reference reader) reports it."""
        positions_c, starts_c, stops_c = (ffi.new("uint64_t[]", batch_records) for _ in range(3))
        count_c, fault = ffi.new("uint32_t *"), self._fault()
        while True:
            rc = lib.sl_scan(data, readable, segment.header, 2**64 - 1, batch_records, state,
                             positions_c, starts_c, stops_c, count_c, fault)
            if rc == lib.SL_E_CORRUPT:
                return self._error(rc, fault, segment=segment)
            if rc != lib.SL_OK or count_c[0] == 0 or state.sealed:
                return self._unexpected_end(segment, int(state.position))

    def segments(self) -> list[SegmentInfo]:
        """The segment files, oldest first."""
        self._check_open()
        end, infos = self._end, []
        for segment in self._segments:
            try:
                size = segment.file_size()
            except OSError as exc:
                raise StorageFailed(f"cannot stat {segment.path}: {exc}", errno=exc.errno) from exc
            infos.append(
                SegmentInfo(segment.first_position, segment.path, size, self._readable_bytes(segment, end), segment.sealed)
            )
        return infos

    def verify(self) -> int:
        """Check every byte of every segment (headers, frames, groups, seals); return the record count.

        Raises :class:`Corruption` at the first damage. Reads only; safe alongside appends.
        """
        self._check_open()
        end, segments = self._end, self._segments
        records = 0
        fault = ffi.new("struct sl_fault *")
        for segment in segments:
            if segment.sealed:
                data, mapped = self._mapped(segment)
                end_c = ffi.new("uint64_t *")
                rc = lib.sl_verify_sealed(data, min(len(mapped), segment.sealed_used_bytes), segment.header, end_c, fault)
                if rc != lib.SL_OK:
                    raise self._error(rc, fault, segment=segment)
        for batch in self._scan(segments[0].first_position if segments else 0, end, end, SCAN_BATCH_RECORDS_MAX):
            records += len(batch)
        return records

    # -- closing ------------------------------------------------------------------------------

    def detach(self) -> None:
        """The log's directory now holds another log (a compaction switched it while this handle
        stays open for the readers still using it): from here on nothing is written there by name,
        so ``close()`` neither writes a clean-close marker nor removes ``BULK`` — both would be the
        other log's. Its maps and descriptors keep serving reads of this log's files."""
        self._detached = True

    def close(self) -> None:
        """Release the lock and the maps. Idempotent. Groups appended in bulk mode are synced first.

        In a child forked from the process that opened the log it only drops this copy of the
        handle: no sync, no clean marker (the parent goes on writing), and the lock stays with the
        parent (its descriptor holds the flock)."""
        if self._closed:
            return
        if self._fork_generation != _fork.generation:  # before _write_lock: a parent thread may have held it at fork
            self._close_quietly(in_child=True)
            return
        with self._write_lock:
            if self._closed:
                return
            error: Exception | None = None
            if self._handle is not None and not self._sync and not self._failed:
                fault = ffi.new("struct sl_fault *")
                rc = lib.sl_log_sync(self._handle, fault)
                if rc != lib.SL_OK:
                    error = self._error(rc, fault)
            if self._handle is not None and not self._sync and not self._failed and error is None and not self._detached:
                try:
                    self._unmark_bulk()  # everything is synced: the next open recovers by the usual rules
                except MwpError as exc:
                    error = exc
            current = self._clean_marker and self._marker_lists_segments
            if self._handle is not None and not self._failed and error is None and not current and not self._detached:
                try:
                    self._write_clean_marker()
                except (OSError, MwpError):
                    pass  # no marker: the next open scans, as after a crash
            self._close_quietly()
        if error is not None:
            raise error

    def _close_quietly(self, *, in_child: bool = False) -> None:
        self._closed = True
        if self._handle is not None:
            lib.sl_log_close(self._handle)
            self._handle = None
        for segment in self._segments:
            if in_child:  # a parent thread may have held the segment's lock at the fork: not taken
                segment.forget_map()
            else:
                segment.unmap()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = -1

    def __enter__(self) -> SegmentLog:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self._close_quietly()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"end={self._end}"
        return f"SegmentLog({getattr(self, '_directory', '?')!r}, {state})"


_OPEN_TOKEN = object()


def _unreadable_segment(path: str, code: int) -> StorageFailed:
    return StorageFailed(f"cannot read segment {path}: {os.strerror(code)}", errno=code, path=path)


def _open_segment_fd(path: str) -> int:
    """A descriptor of the segment file at ``path`` (a regular file only: a FIFO must not block;
    never through a symbolic link, as the writer's own opens in ``csrc/segment_log.c``);
    ``StorageFailed`` naming the file if it cannot be opened."""
    try:
        return open_regular_fd(path, follow=False)
    except OSError as exc:
        raise _unreadable_segment(path, exc.errno or errno.EIO) from None
