"""The segment log's I/O seam, seen from Python: a recorder for power-loss and fault tests.

The C log does every mutating file operation through a ``struct sl_io`` (see
``csrc/segment_log.h``). :class:`RecordingIO` fills that table with Python callbacks that do the
real operation *and* write it down, so a test can afterwards ask :func:`crash_state` what a disk
could hold had the power failed before any given operation:

- whatever a file held when it was last synced (fdatasync or fsync) is kept;
- each later, unsynced operation on it is kept, dropped, or (a write) torn at a 512-byte
  boundary, the torn rest left zero, garbage, or as it was;
- names created, renamed or removed since the directory was last synced may be undone
  (a random prefix of those directory changes survives, as a journaling file system keeps them
  in order).

It can also fail chosen calls (``fail_sync_at``: the n-th sync returns EIO) to check that a
failed fsync is never followed by an acknowledgement. Not for production use: every call goes
through Python.
"""

from __future__ import annotations

import errno
import os
import random
from typing import Any

from mwpstore._segment_log_c import ffi, lib

__all__ = ["RecordingIO", "crash_state", "write_crash_state", "SECTOR_BYTES"]

SECTOR_BYTES = lib.SL_SECTOR_BYTES


class RecordingIO:
    """Real file I/O that records each mutating call (see the module docstring)."""

    def __init__(
        self, *, directory: str | None = None, fail_sync_at: int | None = None, fail_errno: int = errno.EIO
    ) -> None:
        """``directory``: files already there are recorded as durable before anything happens."""
        self.operations: list[tuple[Any, ...]] = []
        self.sync_calls = 0  # sync_data, sync_file and sync_directory calls so far
        self.fail_sync_at = fail_sync_at
        self.fail_errno = fail_errno
        self.failures = 0
        self._next_file_id = 0
        self._file_of_fd: dict[int, int] = {}
        self._file_of_path: dict[str, int] = {}
        self._handle = ffi.new_handle(self)
        table = ffi.new("struct sl_io *")
        table.context = self._handle
        table.create_file = lib.sl_py_create_file
        table.open_file = lib.sl_py_open_file
        table.close_file = lib.sl_py_close_file
        table.write_at = lib.sl_py_write_at
        table.sync_data = lib.sl_py_sync_data
        table.sync_file = lib.sl_py_sync_file
        table.truncate_file = lib.sl_py_truncate_file
        table.allocate_file = lib.sl_py_allocate_file
        table.rename_file = lib.sl_py_rename_file
        table.remove_file = lib.sl_py_remove_file
        table.sync_directory = lib.sl_py_sync_directory
        self.io_struct = table
        if directory is not None:
            for name in sorted(os.listdir(directory)):
                path = os.path.join(os.path.abspath(directory), name)
                if os.path.isfile(path):
                    self._file_for_path(path)

    def mark(self, label: str, value: Any = None) -> None:
        """Write a test's own note (e.g. "this group was acknowledged") into the operation list."""
        self.operations.append(("mark", label, value))

    # -- the callbacks' bodies (each returns 0 or a negative errno) -----------------------------

    def _file_for_path(self, path: str) -> int:
        file_id = self._file_of_path.get(path)
        if file_id is None:  # a file that existed before recording began: snapshot it as durable
            file_id = self._next_file_id
            self._next_file_id += 1
            with open(path, "rb") as file:
                content = file.read()
            self.operations.append(("existing", path, file_id, content))
            self._file_of_path[path] = file_id
        return file_id

    def _should_fail_sync(self) -> bool:
        index = self.sync_calls
        self.sync_calls += 1
        if self.fail_sync_at is not None and index == self.fail_sync_at:
            self.failures += 1
            return True
        return False

    def create_file(self, path: str) -> tuple[int, int]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        file_id = self._next_file_id
        self._next_file_id += 1
        self._file_of_path[path] = file_id
        self._file_of_fd[fd] = file_id
        self.operations.append(("create", path, file_id))
        return 0, fd

    def open_file(self, path: str) -> tuple[int, int]:
        file_id = self._file_for_path(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._file_of_fd[fd] = file_id
        return 0, fd

    def close_file(self, fd: int) -> int:
        self._file_of_fd.pop(fd, None)
        os.close(fd)
        return 0

    def write_at(self, fd: int, data: bytes, offset: int) -> int:
        os.pwrite(fd, data, offset)
        self.operations.append(("write", self._file_of_fd[fd], offset, data))
        return 0

    def sync_file_data(self, fd: int, full: bool) -> int:
        if self._should_fail_sync():
            return -self.fail_errno
        (os.fsync if full else os.fdatasync)(fd)
        self.operations.append(("sync", self._file_of_fd[fd]))
        return 0

    def truncate_file(self, fd: int, length: int) -> int:
        os.ftruncate(fd, length)
        self.operations.append(("truncate", self._file_of_fd[fd], length))
        return 0

    def allocate_file(self, fd: int, length: int) -> int:
        os.posix_fallocate(fd, 0, length)
        self.operations.append(("allocate", self._file_of_fd[fd], length))
        return 0

    def rename_file(self, from_path: str, to_path: str) -> int:
        os.rename(from_path, to_path)
        file_id = self._file_of_path.pop(from_path)
        self._file_of_path[to_path] = file_id
        self.operations.append(("rename", from_path, to_path))
        return 0

    def remove_file(self, path: str) -> int:
        self._file_for_path(path)
        os.unlink(path)
        self._file_of_path.pop(path, None)
        self.operations.append(("remove", path))
        return 0

    def sync_directory(self, path: str) -> int:
        if self._should_fail_sync():
            return -self.fail_errno
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.operations.append(("dirsync", path))
        return 0


def _recorder(context: Any) -> RecordingIO:
    return ffi.from_handle(context)


def _negative_errno(exc: OSError) -> int:
    return -(exc.errno or errno.EIO)


# The callbacks: translate C arguments, call the recorder, turn OSError into -errno. An exception
# of any other kind returns -EIO (the `error` value), never a false success.


@ffi.def_extern(error=-errno.EIO)
def sl_py_create_file(context: Any, path: Any, fd_out: Any) -> int:
    try:
        rc, fd = _recorder(context).create_file(os.fsdecode(ffi.string(path)))
    except OSError as exc:
        return _negative_errno(exc)
    fd_out[0] = fd
    return rc


@ffi.def_extern(error=-errno.EIO)
def sl_py_open_file(context: Any, path: Any, fd_out: Any) -> int:
    try:
        rc, fd = _recorder(context).open_file(os.fsdecode(ffi.string(path)))
    except OSError as exc:
        return _negative_errno(exc)
    fd_out[0] = fd
    return rc


@ffi.def_extern(error=-errno.EIO)
def sl_py_close_file(context: Any, fd: int) -> int:
    try:
        return _recorder(context).close_file(fd)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_write_at(context: Any, fd: int, data: Any, length: int, offset: int) -> int:
    try:
        return _recorder(context).write_at(fd, bytes(ffi.buffer(data, length)), offset)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_sync_data(context: Any, fd: int) -> int:
    try:
        return _recorder(context).sync_file_data(fd, False)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_sync_file(context: Any, fd: int) -> int:
    try:
        return _recorder(context).sync_file_data(fd, True)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_truncate_file(context: Any, fd: int, length: int) -> int:
    try:
        return _recorder(context).truncate_file(fd, length)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_allocate_file(context: Any, fd: int, length: int) -> int:
    try:
        return _recorder(context).allocate_file(fd, length)
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_rename_file(context: Any, from_path: Any, to_path: Any) -> int:
    try:
        return _recorder(context).rename_file(os.fsdecode(ffi.string(from_path)), os.fsdecode(ffi.string(to_path)))
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_remove_file(context: Any, path: Any) -> int:
    try:
        return _recorder(context).remove_file(os.fsdecode(ffi.string(path)))
    except OSError as exc:
        return _negative_errno(exc)


@ffi.def_extern(error=-errno.EIO)
def sl_py_sync_directory(context: Any, path: Any) -> int:
    try:
        return _recorder(context).sync_directory(os.fsdecode(ffi.string(path)))
    except OSError as exc:
        return _negative_errno(exc)


# -- power loss ---------------------------------------------------------------------------------


def _apply(content: bytearray, operation: tuple[Any, ...]) -> None:
    kind = operation[0]
    if kind == "write":
        _, _, offset, data = operation
        if len(content) < offset + len(data):
            content.extend(bytes(offset + len(data) - len(content)))
        content[offset : offset + len(data)] = data
    elif kind == "truncate":
        length = operation[2]
        if length < len(content):
            del content[length:]
        else:
            content.extend(bytes(length - len(content)))
    elif kind == "allocate":
        length = operation[2]
        if length > len(content):
            content.extend(bytes(length - len(content)))
    else:  # pragma: no cover - programmer error
        raise AssertionError(operation)


def _apply_unsynced(content: bytearray, operation: tuple[Any, ...], rng: random.Random) -> None:
    """An operation the disk may or may not have finished: keep, drop, or tear it."""
    choice = rng.random()
    if choice < 0.3:
        return  # dropped
    if operation[0] != "write" or choice < 0.6:
        _apply(content, operation)
        return
    _, file_id, offset, data = operation
    # Torn: the write's bytes up to some sector boundary reached the disk, the rest did not.
    boundaries = [b for b in range(offset - offset % SECTOR_BYTES, offset + len(data) + 1, SECTOR_BYTES) if b >= offset]
    cut = rng.choice(boundaries) if boundaries else offset
    kept = cut - offset
    rest_mode = rng.choice(("zero", "garbage", "old"))
    if rest_mode == "old":
        rest = bytes(content[offset + kept : offset + len(data)])
        rest += bytes(len(data) - kept - len(rest))
    elif rest_mode == "zero":
        rest = bytes(len(data) - kept)
    else:
        rest = rng.randbytes(len(data) - kept)
    _apply(content, ("write", file_id, offset, data[:kept] + rest))


def crash_state(operations: list[tuple[Any, ...]], crash_at: int, rng: random.Random) -> dict[str, bytes]:
    """What the files could hold if power failed just before ``operations[crash_at]``.

    Returns {path: content}. Each call draws one of the possible states with ``rng``.
    """
    durable: dict[int, bytearray] = {}
    pending: dict[int, list[tuple[Any, ...]]] = {}
    durable_names: dict[str, int] = {}
    pending_names: list[tuple[Any, ...]] = []
    live_names: dict[str, int] = {}
    for operation in operations:  # files that were there before recording began, whenever first seen
        if operation[0] == "existing":
            _, path, file_id, content = operation
            durable[file_id] = bytearray(content)
            pending[file_id] = []
            durable_names[path] = file_id
            live_names[path] = file_id
    for operation in operations[:crash_at]:
        kind = operation[0]
        if kind == "existing":
            pass
        elif kind == "create":
            _, path, file_id = operation
            durable[file_id] = bytearray()
            pending[file_id] = []
            live_names[path] = file_id
            pending_names.append(("link", path, file_id))
        elif kind in ("write", "truncate", "allocate"):
            pending[operation[1]].append(operation)
        elif kind == "sync":
            file_id = operation[1]
            for queued in pending[file_id]:
                _apply(durable[file_id], queued)
            pending[file_id] = []
        elif kind == "rename":
            _, from_path, to_path = operation
            live_names[to_path] = live_names.pop(from_path)
            pending_names.append(operation)
        elif kind == "remove":
            live_names.pop(operation[1], None)
            pending_names.append(operation)
        elif kind == "dirsync":
            _replay_names(durable_names, pending_names)
            pending_names = []
        elif kind == "mark":
            pass
        else:  # pragma: no cover - programmer error
            raise AssertionError(operation)
    names = dict(durable_names)
    _replay_names(names, pending_names[: rng.randint(0, len(pending_names))])
    state: dict[str, bytes] = {}
    for path, file_id in names.items():
        content = bytearray(durable[file_id])
        for operation in pending[file_id]:
            _apply_unsynced(content, operation, rng)
        state[path] = bytes(content)
    return state


def _replay_names(names: dict[str, int], changes: list[tuple[Any, ...]]) -> None:
    for change in changes:
        if change[0] == "link":
            names[change[1]] = change[2]
        elif change[0] == "rename":
            if change[1] in names:
                names[change[2]] = names.pop(change[1])
        elif change[0] == "remove":
            names.pop(change[1], None)


def write_crash_state(state: dict[str, bytes], source_directory: str, target_directory: str) -> None:
    """Write a :func:`crash_state` (paths under ``source_directory``) into ``target_directory``."""
    os.makedirs(target_directory, exist_ok=True)
    for path, content in state.items():
        relative = os.path.relpath(path, source_directory)
        if relative.startswith(".."):
            continue
        with open(os.path.join(target_directory, relative), "wb") as file:
            file.write(content)
