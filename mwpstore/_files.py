"""Durable file helpers for snapshots, audit logs and key files.

Every file these modules create is written under a temporary name in the target directory,
fsynced, moved into place and followed by a directory fsync (DESIGN.md §4 "Files"), so a crash
leaves either the old file or the complete new one. Secret files (signing keys, Organization
keys) are created with mode 0600 and published with ``link`` instead of ``rename`` so two
processes creating the same key at once never replace each other's key: the loser reads the
winner's file. Reading a secret file refuses anything but a regular file owned by this user with
no group or other permission bits and the exact expected size; the directory a secret is written
into must be this user's and no symbolic link, and is made 0700.

A store writes its files below its own directory through :class:`Directory`: descriptors opened
from the store's directory down one name at a time with ``O_NOFOLLOW`` (:func:`open_below`), and
every file made, renamed, read or removed relative to the last one (``dir_fd``). A check of a path
followed by a write to the same path could be raced: a symbolic link put in place of a directory
between the two sent the write wherever it pointed. Through the descriptors there is nothing to
race: a link met on the way is refused, and once a directory is open nothing done to its path
changes where the files go.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator

from . import failpoints
from .errors import InvalidCommand, KeyFileInvalid, MwpError, StorageFailed, translate  # noqa: F401


def store_path(path: object) -> str:
    """A path given from outside (a store, a file), as a ``str``; ``InvalidCommand`` (field ``path``)
    for anything else: another type, bytes, an empty string, a NUL or a lone surrogate."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if type(text) is not str or not text or "\x00" in text or not _utf8(text):
        raise InvalidCommand("path must be a non-empty str (or os.PathLike of one) without NUL, encodable as UTF-8", field="path")
    return text


def _utf8(text: str) -> bool:
    """Whether UTF-8 encodes ``text``: LMDB takes only such paths, so a surrogate (a file name
    that is not UTF-8, as ``os.listdir`` escapes it) is refused before anything is created."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Directory:
    """A directory held open by its descriptor ``fd``, and ``path``, the path it was reached by (for
    messages, and for :func:`fsync_directory`'s callers, which record paths: ``os.fspath`` gives
    it). The ``*_at`` helpers make, rename, read and remove names relative to ``fd``: what is done
    to ``path`` meanwhile (a symbolic link put in place of this directory or of one above it)
    changes nothing about where they act. A context manager: leaving it closes ``fd``."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def __fspath__(self) -> str:
        return self.path

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_directory(path: str, *, context: str = "") -> Directory:
    """``path`` (a directory the caller names: it may be reached through symbolic links) as a
    :class:`Directory`; ``StorageFailed`` if it cannot be opened."""
    path = os.path.abspath(store_path(path))
    try:
        return Directory(os.open(path, _DIRECTORY_FLAGS), path)
    except OSError as exc:
        raise translate(exc, context=context or f"opening {path}") from None


@contextlib.contextmanager
def open_directory_if_any(path: str) -> Iterator[Directory | None]:
    """:func:`open_directory`, or None if ``path`` does not exist."""
    path = os.path.abspath(store_path(path))
    try:
        directory = Directory(os.open(path, _DIRECTORY_FLAGS), path)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise translate(exc, context=f"opening {path}") from None
    with directory:
        yield directory


def open_below(
    root: str,
    relative: str,
    *,
    mode: int = 0o755,
    create: bool = True,
    private: bool = False,
    private_root: bool = False,
    sync: bool = False,
    keys: bool | None = None,
) -> Directory:
    """``<root>/<relative>`` as a :class:`Directory`, reached from ``root`` one name at a time with
    ``O_NOFOLLOW`` (:func:`open_child`, which says what each option does). ``root`` itself is the
    caller's path and may be reached through links; with ``create`` it is made (``mode``) if
    missing, and with ``private_root`` it is checked and made private as the directories below.
    A name ``.`` or ``..`` in ``relative`` is ``InvalidCommand`` (field ``relative``) before
    anything is opened: the walk never leaves the directories below ``root``."""
    root = os.path.abspath(store_path(root))
    names = relative.split("/") if relative else []
    for name in names:
        _check_name(name, relative)
    try:
        current: Directory | None = Directory(os.open(root, _DIRECTORY_FLAGS), root)
    except FileNotFoundError:
        if not create:
            raise  # the caller says what a missing directory means
        current = None
    except OSError as exc:
        raise translate(exc, context=f"opening {root}") from None
    if current is None:
        makedirs_durable(root, mode)
        current = open_directory(root)
    try:
        if private_root:
            _check_private(current)
        for name in names:
            child = open_child(
                current, name, mode=mode, create=create, private=private, sync=sync, keys=keys, wanted=os.path.join(root, relative)
            )
            # the child held first: an interrupt as the parent's close returns must find it in
            # ``current``, for the handler below to close, not only in this loop's variable
            current, parent = child, current
            parent.close()
        return current
    except BaseException:
        current.close()
        raise


def open_child(
    parent: Directory,
    name: str,
    *,
    mode: int = 0o755,
    create: bool = True,
    private: bool = False,
    sync: bool = False,
    keys: bool | None = None,
    wanted: str | None = None,
) -> Directory:
    """The directory ``name`` in ``parent``, opened ``O_DIRECTORY | O_NOFOLLOW`` relative to it.

    With ``create``, a missing one is made (``mode``) and its entry synced in ``parent`` (without,
    a missing one is ``FileNotFoundError``, for the caller to say what that means); with
    ``sync``, one found in place is synced in ``parent`` too (a process killed between its
    ``mkdir`` and that sync may have left it in the page cache only). A symbolic link there is
    ``StorageFailed`` (``errno`` ``ELOOP``, ``detail`` ``path`` the link); a file there is
    ``StorageFailed`` (``EEXIST``) naming it. With ``private`` the directory must be this user's
    (else ``KeyFileInvalid`` reason ``owner``) and is set to 0700 through its descriptor if it
    grants anything to group or others. With ``keys`` (the default: ``private``) a link or a
    file there is ``KeyFileInvalid`` (reason ``type``) instead. ``name`` ``.`` or ``..`` is
    ``InvalidCommand`` (field ``relative``)."""
    _check_name(name, name)
    keys = private if keys is None else keys
    path = parent.join(name)
    made = False
    while True:
        try:
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent.fd)
            break
        except FileNotFoundError as exc:
            if not create:
                raise  # the caller says what a missing directory means
            if made:
                raise translate(exc, context=f"opening {path}") from None
            try:
                os.mkdir(name, mode, dir_fd=parent.fd)
            except FileExistsError:
                pass  # made meanwhile, or a dangling link: the open says which
            except OSError as exc:
                raise translate(exc, context=f"creating {path}") from None
            made = True
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise _not_a_directory(parent, name, keys=keys, wanted=wanted or path) from None
            raise translate(exc, context=f"opening {path}") from None
    child = Directory(fd, path)
    try:
        if private:
            _check_private(child)
        if made or sync:
            fsync_directory(parent)
    except BaseException:
        child.close()
        raise
    return child


def _check_name(name: str, relative: str) -> None:
    """``InvalidCommand`` (field ``relative``) for ``.`` or ``..`` among the names walked down:
    the walk goes from the store down only, and either would open a directory at or above the
    one it stands in."""
    if name in (".", ".."):
        raise InvalidCommand(f"{relative!r}: a directory below the store is named without '.' or '..'", field="relative")


def _not_a_directory(parent: Directory, name: str, *, keys: bool, wanted: str) -> MwpError:
    """What to raise for ``name`` in ``parent`` found to be no directory (a link, or anything else)."""
    path = parent.join(name)
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=parent.fd, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if keys:
        what = "a symbolic link" if link else "not a directory"
        return KeyFileInvalid(f"key directory {path} is {what}; refusing it", path=path, reason="type")
    if link:
        return StorageFailed(
            f"{path} is a symbolic link; the store's files are written only inside the store: put the directory there",
            errno=errno.ELOOP,
            path=path,
        )
    return StorageFailed(f"cannot create {wanted}: {path} exists and is not a directory", errno=errno.EEXIST, path=path)


def _check_private(directory: Directory) -> None:
    """``directory`` this user's (else ``KeyFileInvalid`` reason ``owner``), and set to 0700
    through its descriptor if it grants anything to group or others."""
    try:
        info = os.fstat(directory.fd)
        if info.st_uid != os.geteuid():
            raise KeyFileInvalid(f"key directory {directory.path} is owned by another user", path=directory.path, reason="owner")
        if info.st_mode & 0o077:
            os.fchmod(directory.fd, 0o700)
    except OSError as exc:
        raise translate(exc, context=f"making {directory.path} private") from None


def fsync_directory(directory: str | Directory) -> None:
    """fsync a directory so that a rename, link or unlink inside it is durable; ``StorageFailed``
    if it cannot be opened or synced. A :class:`Directory` is synced through its descriptor."""
    try:
        fsync_directory_raw(directory)
    except OSError as exc:
        raise translate(exc, context=f"syncing the directory {directory}") from None


def fsync_directory_raw(directory: str | Directory) -> None:
    """:func:`fsync_directory` with the ``OSError`` as it is, for a caller that handles or types
    it itself (the log's clean marker, compaction's steps, the index's rebuild)."""
    if isinstance(directory, Directory):
        os.fsync(directory.fd)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)  # O_CLOEXEC: Python adds it to every open
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(8)}.tmp"


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_file_atomic(path: str, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename over ``path``, dir fsync.
    The directory is the caller's path (it may be reached through links): :func:`write_file_at`.

    Raises ``StorageFailed`` on any I/O error; the temporary file is removed on any failure,
    an interrupt included.
    """
    path = store_path(path)
    _check_data(data)
    parent, name = os.path.split(os.path.abspath(path))
    with open_directory(parent, context=f"writing {path}") as directory:
        write_file_at(directory, name, data, mode=mode)


def write_file_at(directory: Directory, name: str, data: bytes, *, mode: int = 0o600) -> None:
    """:func:`write_file_atomic` of ``name`` in ``directory``, every step relative to its
    descriptor: the temporary name created ``O_CREAT | O_EXCL | O_NOFOLLOW``, renamed over
    ``name`` and the directory synced, all in the directory opened."""
    _check_data(data)
    temp = _temp_name(name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory.fd)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        failpoints.hit("files.before_rename")
        os.replace(temp, name, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
        fsync_directory(directory)
    except BaseException as exc:
        _remove_quietly(directory, temp)  # an interrupt too: the contents may be a secret (a rotated key's seed)
        if isinstance(exc, OSError):
            raise translate(exc, context=f"writing {directory.join(name)}") from None
        raise


def _check_data(data: object) -> None:
    """File contents are bytes: checked before a temporary file exists, so nothing is left behind."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidCommand(f"file contents must be bytes, not {type(data).__name__}", field="data")


def _remove_quietly(directory: Directory, name: str) -> None:
    try:
        os.unlink(name, dir_fd=directory.fd)
    except OSError:
        pass


def makedirs_durable(
    directory: str, mode: int = 0o755, *, sync_directory: Callable[[str], None] | None = None, root: str | None = None
) -> None:
    """Create ``directory`` and any missing parents, fsyncing each parent after a creation.

    ``os.makedirs`` alone is not enough before an atomic write: after a power loss the new
    directory entry itself may be gone, taking the renamed file with it. ``sync_directory``
    replaces :func:`fsync_directory` (the segment log syncs through its I/O seam). A path that
    exists and is no directory is ``StorageFailed`` (``EEXIST``).

    With ``root`` (an ancestor of ``directory``), the directories below it that already exist
    are synced in their parents too, top down: one found in place may be in the page cache only,
    made by a process killed between its ``mkdir`` and its parent's fsync.
    """
    sync = fsync_directory if sync_directory is None else sync_directory
    directory = store_path(directory)
    directory = os.path.abspath(directory)
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    found = []  # existing directories below root, deepest first
    if root is not None:
        top = os.path.abspath(store_path(root))
        while directory != top and directory.startswith(top.rstrip(os.sep) + os.sep):
            found.append(directory)
            directory = os.path.dirname(directory)
    path = directory
    try:
        for path in reversed(found):
            sync(os.path.dirname(path))
        for path in reversed(missing):
            try:
                os.mkdir(path, mode)
            except FileExistsError as exc:
                if not os.path.isdir(path):
                    # A file (or a dangling link) where a directory of the path should be: say so,
                    # rather than the bare "File exists" of mkdir.
                    raise StorageFailed(
                        f"cannot create {missing[0]}: {path} exists and is not a directory", errno=exc.errno, path=path
                    ) from None
            sync(os.path.dirname(path))
    except OSError as exc:
        raise translate(exc, context=f"creating {path}") from None


def take_lock_file(path: str, locked: Callable[[], MwpError], *, what: str) -> int:
    """Open ``path`` (created if missing) and take its exclusive flock without waiting; the
    descriptor, which holds the lock until it is closed. ``locked()`` is raised when another
    descriptor holds the lock (``EWOULDBLOCK``); any other failure of the open or the flock
    (``ENOLCK`` on a network filesystem, ``EACCES``, ``EROFS``, ``ENOTDIR``…) is
    ``StorageFailed`` naming ``what``, never "locked", which would send the operator looking for
    another process. Whatever ends the call, an interrupt as flock returns included, a
    descriptor not returned is closed: unknown to the caller, it would hold the lock for as long
    as the process lives. A symbolic link or anything but a regular file at ``path`` is
    ``StorageFailed`` too: the lock is never taken on, or created at, a file outside the store."""
    import fcntl

    try:
        # Never through a symbolic link (O_CREAT would make the file it names, outside the store),
        # and never waiting on a FIFO.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageFailed(f"cannot open {what} {path}: it is a symbolic link; remove it", errno=exc.errno, path=path) from None
        raise StorageFailed(f"cannot open {what} {path}: {exc}", errno=exc.errno, path=path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageFailed(f"cannot use {what} {path}: it is not a regular file; remove it", errno=errno.EINVAL, path=path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            raise locked() from None
        if isinstance(exc, OSError):
            raise StorageFailed(f"cannot lock {what} {path}: {exc}", errno=exc.errno, path=path) from None
        raise
    return fd


def create_secret_at(directory: Directory, name: str, data: bytes) -> bool:
    """Publish ``data`` as ``name`` in ``directory`` (mode 0600) unless a file is already there.

    Returns True if this call created the file, False if another one was there first (the caller
    then reads that one). Temp file, fsync, ``link`` (never replaces), unlink temp, dir fsync, each
    relative to the directory's descriptor.
    """
    _check_data(data)
    temp = _temp_name(name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory.fd)
        try:
            os.fchmod(fd, 0o600)  # the umask may have removed bits, never added: make it exact
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, name, src_dir_fd=directory.fd, dst_dir_fd=directory.fd, follow_symlinks=False)
            created = True
        except FileExistsError:
            created = False
        os.unlink(temp, dir_fd=directory.fd)
        fsync_directory(directory)
        return created
    except BaseException as exc:
        _remove_quietly(directory, temp)  # an interrupt too: a copy of a secret must not outlive the call
        if isinstance(exc, OSError):
            raise translate(exc, context=f"creating {directory.join(name)}") from None
        raise


def remove_with_temp_copies_at(directory: Directory, name: str) -> bool:
    """Delete ``name`` in ``directory`` and the temporary copies :func:`create_secret_at` may have
    left of it (a kill between its ``link`` and its ``unlink``), durably and through the
    directory's descriptor. True if anything was removed."""
    return _remove_durably(directory, name, keep=False)


def remove_temp_copies_at(directory: Directory, name: str) -> bool:
    """Delete, durably and through the descriptor of ``directory``, the temporary files a killed
    :func:`write_file_at` or :func:`create_secret_at` of ``name`` left beside it, and not ``name``
    itself. Only for a directory this process alone writes (a store's, under its lock): another
    writer's file in mid-write would go too. True if anything was removed."""
    return _remove_durably(directory, name, keep=True)


def _remove_durably(directory: Directory, name: str, *, keep: bool) -> bool:
    temps = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{16}}\.tmp")
    try:
        victims = [] if keep else [name]
        victims += [entry for entry in os.listdir(directory.fd) if temps.fullmatch(entry)]
    except OSError as exc:
        raise translate(exc, context=f"removing {directory.join(name)}") from None
    # a directory under a temporary file's name is no write of ours: left alone
    return remove_names_at(directory, victims, directories_ok=keep)


def remove_names_at(directory: Directory, names: Iterable[str], *, directories_ok: bool = False) -> bool:
    """Unlink each of ``names`` in ``directory`` through its descriptor (one already gone is
    skipped; with ``directories_ok`` a directory under one of them is left alone), then sync the
    directory if anything went; True if anything did. ``StorageFailed`` on any other failure."""
    removed = False
    try:
        for name in dict.fromkeys(names):
            try:
                os.unlink(name, dir_fd=directory.fd)
                removed = True
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                if not directories_ok:
                    raise
        if removed:
            fsync_directory(directory)
        return removed
    except OSError as exc:
        raise translate(exc, context=f"removing from {directory.path}") from None


def open_regular_fd(path: str, *, directory: Directory | None = None, follow: bool = True) -> int:
    """A read-only descriptor of ``path`` if it is a regular file; ``OSError`` (``EINVAL``) if it is
    a FIFO, device or socket, ``IsADirectoryError`` for a directory. The open does not block: a
    FIFO left under a file's name must not make a reader wait for a writer. With ``directory``,
    ``path`` is a name in it, opened relative to its descriptor and never through a symbolic link
    (``ELOOP``); without ``follow``, a symbolic link at ``path`` itself is ``ELOOP`` too."""
    path = store_path(path)
    if directory is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    else:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=directory.fd)
        path = directory.join(path)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str, *, directory: Directory | None = None) -> io.BufferedReader:
    """:func:`open_regular_fd` as a binary file object."""
    fd = open_regular_fd(path, directory=directory)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_secret_at(directory: Directory, name: str, size: int) -> bytes | None:
    """Read the secret file ``name`` of ``directory``, of exactly ``size`` bytes; None if it does
    not exist.

    Raises ``KeyFileInvalid`` if it is a symbolic link or not a regular file, is not owned by this
    user, grants any permission to group or others, or has the wrong size.
    """
    path = directory.join(name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory.fd)  # a FIFO must not block
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyFileInvalid(f"key file {path} is a symbolic link; refusing it", path=path, reason="type") from None
        raise translate(exc, context=f"opening {path}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileInvalid(f"key file {path} is not a regular file", path=path, reason="type")
        if info.st_uid != os.geteuid():
            raise KeyFileInvalid(f"key file {path} is owned by another user", path=path, reason="owner")
        if info.st_mode & 0o077:
            raise KeyFileInvalid(
                f"key file {path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be readable by its owner only"
                f" (chmod 600 {path})",
                path=path,
                reason="mode",
                mode=stat.S_IMODE(info.st_mode),
            )
        if info.st_size != size:
            raise KeyFileInvalid(
                f"key file {path} holds {info.st_size} bytes, not {size}; it is damaged or not a key",
                path=path,
                reason="size",
                size=info.st_size,
            )
        data = os.read(fd, size + 1)
        if len(data) != size:
            raise KeyFileInvalid(f"key file {path} changed size while being read", path=path, reason="size")
        return data
    except MwpError:
        raise
    except OSError as exc:
        raise translate(exc, context=f"reading {path}") from None
    finally:
        os.close(fd)


def read_file_capped(
    path: str, bytes_max: int, *, missing_ok: bool = False, directory: Directory | None = None
) -> bytes | None:
    """Read a whole file if it holds at most ``bytes_max`` bytes; None if it is larger.

    With ``missing_ok``, a missing file also reads as None; otherwise it raises ``StorageFailed``.
    With ``directory``, ``path`` is a name in it, read through its descriptor and never through a
    symbolic link (``StorageFailed``, ``errno`` ``ELOOP``, ``detail`` ``path`` the link).
    """
    path = store_path(path)
    shown = path if directory is None else directory.join(path)
    try:
        with open_regular(path, directory=directory) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > bytes_max:
                return None
            data = handle.read(bytes_max + 1)
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise translate(exc, context=f"reading {shown}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and directory is not None:
            raise StorageFailed(
                f"{shown} is a symbolic link; the store reads its own files only", errno=errno.ELOOP, path=shown
            ) from None
        raise translate(exc, context=f"reading {shown}") from None
    if len(data) > bytes_max:
        return None
    return data
