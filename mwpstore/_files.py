"""Durable file helpers for snapshots, audit logs and key files.

Every file these modules create is written under a temporary name in the target directory,
fsynced, moved into place and followed by a directory fsync (DESIGN.md §4 "Files"), so a crash
leaves either the old file or the complete new one. Secret files (signing keys, Organization
keys) are created with mode 0600 and published with ``link`` instead of ``rename`` so two
processes creating the same key at once never replace each other's key: the loser reads the
winner's file. Reading a secret file refuses anything but a regular file owned by this user with
no group or other permission bits and the exact expected size; the directory a secret is written
into must be this user's and no symbolic link, and is made 0700 (``ensure_private_directory``).
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import stat
from collections.abc import Callable

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


def fsync_directory(directory: str) -> None:
    """fsync a directory so that a rename, link or unlink inside it is durable; ``StorageFailed``
    if it cannot be opened or synced."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise translate(exc, context=f"syncing the directory {directory}") from None


def _temp_path(path: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_file_atomic(path: str, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename over ``path``, dir fsync.

    Raises ``StorageFailed`` on any I/O error; the temporary file is removed on any failure,
    an interrupt included.
    """
    path = store_path(path)
    _check_data(data)
    temp = _temp_path(path)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        failpoints.hit("files.before_rename")
        os.replace(temp, path)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException as exc:
        _remove_quietly(temp)  # an interrupt too: the contents may be a secret (a rotated key's seed)
        if isinstance(exc, OSError):
            raise translate(exc, context=f"writing {path}") from None
        raise


def _check_data(data: object) -> None:
    """File contents are bytes: checked before a temporary file exists, so nothing is left behind."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidCommand(f"file contents must be bytes, not {type(data).__name__}", field="data")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
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


def refuse_links_below(root: str, relative: str) -> None:
    """``StorageFailed`` (``errno`` ``ELOOP``, ``path``) if a directory of ``relative`` under
    ``root`` (``snapshots``, ``snapshots/<group>``…) is a symbolic link: the files written there
    would go wherever it points, outside the store. Components missing are made later, as
    directories. ``root`` itself may be reached through links."""
    path = os.path.abspath(store_path(root))
    for part in relative.split("/"):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return  # missing, or in the way (a file): makedirs_durable makes it or names what is in the way
        if stat.S_ISLNK(mode):
            raise StorageFailed(
                f"{path} is a symbolic link; the store's files are written only inside {root}: put the directory there",
                errno=errno.ELOOP,
                path=path,
            )


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


def ensure_private_directory(
    directory: str, *, top: str | None = None, follow_top: bool = False, root: str | None = None
) -> None:
    """Create ``directory`` (mode 0700) if missing, durably (its parent fsynced: a key created
    in it must survive a power loss; with ``root``, see :func:`makedirs_durable`), and make sure
    it is private: it and, with ``top`` (an ancestor), every directory from ``top`` down to it
    must be a directory of this user's, not a symbolic link (a key would be written wherever it
    points), else ``KeyFileInvalid`` (reason ``type`` or ``owner``) naming it, checked before
    anything is made in it. One found with group or other permission bits (made by hand, or by
    an older build) is set to 0700: its files are secrets, and their names say which keys the
    store holds. With ``follow_top``, ``top`` itself may be reached through a symbolic link (a
    directory the caller was given, as a store's own path may be): what it names is checked."""
    directory = os.path.abspath(store_path(directory))
    chain = [directory]
    if top is not None:
        top = os.path.abspath(store_path(top))
        while chain[-1] != top and chain[-1].startswith(top.rstrip(os.sep) + os.sep):
            chain.append(os.path.dirname(chain[-1]))
    chain.reverse()
    followed = top if follow_top else None
    for path in chain:
        if not (os.path.exists if path == followed else os.path.lexists)(path):
            break  # made below, mode 0700
        _make_private(path, follow=path == followed)
    makedirs_durable(directory, 0o700, root=root)
    for path in chain:
        _make_private(path, follow=path == followed)


def _make_private(path: str, *, follow: bool = False) -> None:
    """``path`` opened without following a link (unless ``follow``), checked (a directory, this
    user's) and set to 0700 through the descriptor if it grants anything to group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise KeyFileInvalid(f"key directory {path} is {what}; refusing it", path=path, reason="type") from None
        raise translate(exc, context=f"opening {path}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise KeyFileInvalid(f"key directory {path} is owned by another user", path=path, reason="owner")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except OSError as exc:
        raise translate(exc, context=f"making {path} private") from None
    finally:
        os.close(fd)


def create_secret_file(path: str, data: bytes) -> bool:
    """Publish ``data`` at ``path`` (mode 0600) unless a file is already there.

    Returns True if this call created the file, False if another one was there first (the caller
    then reads that one). Temp file, fsync, ``link`` (never replaces), unlink temp, dir fsync.
    """
    path = store_path(path)
    _check_data(data)
    temp = _temp_path(path)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask may have removed bits, never added: make it exact
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
            created = True
        except FileExistsError:
            created = False
        os.unlink(temp)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
        return created
    except BaseException as exc:
        _remove_quietly(temp)  # an interrupt too: a copy of a secret must not outlive the call
        if isinstance(exc, OSError):
            raise translate(exc, context=f"creating {path}") from None
        raise


def remove_with_temp_copies(path: str) -> bool:
    """Delete ``path`` and the temporary copies ``create_secret_file`` may have left of it (a kill
    between its ``link`` and its ``unlink``), durably. True if anything was removed."""
    return _remove_durably(path, keep=False)


def remove_temp_copies(path: str) -> bool:
    """Delete, durably, the temporary files a killed ``write_file_atomic`` or ``create_secret_file``
    of ``path`` left beside it, and not ``path`` itself. Only for a directory this process alone
    writes (a store's, under its lock): another writer's file in mid-write would go too. True if
    anything was removed; a missing directory has none."""
    return _remove_durably(path, keep=True)


def _remove_durably(path: str, *, keep: bool) -> bool:
    path = store_path(path)
    directory, name = os.path.split(os.path.abspath(path))
    temps = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{16}}\.tmp")
    try:
        try:
            entries = os.listdir(directory)
        except FileNotFoundError:
            if keep:
                return False
            raise
        victims = [] if keep else [path]
        victims += [os.path.join(directory, entry) for entry in entries if temps.fullmatch(entry)]
        removed = False
        for victim in victims:
            try:
                os.unlink(victim)
                removed = True
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                if not keep:
                    raise
                # a directory under a temporary file's name is no write of ours: left alone
        if removed:
            fsync_directory(directory)
        return removed
    except OSError as exc:
        raise translate(exc, context=f"removing {path}") from None


def open_regular_fd(path: str) -> int:
    """A read-only descriptor of ``path`` if it is a regular file; ``OSError`` (``EINVAL``) if it is
    a FIFO, device or socket, ``IsADirectoryError`` for a directory. The open does not block: a
    FIFO left under a file's name must not make a reader wait for a writer."""
    path = store_path(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
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


def open_regular(path: str) -> io.BufferedReader:
    """:func:`open_regular_fd` as a binary file object."""
    fd = open_regular_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_secret_file(path: str, size: int) -> bytes | None:
    """Read a secret file of exactly ``size`` bytes; None if it does not exist.

    Raises ``KeyFileInvalid`` if it is not a regular file, is not owned by this user, grants any
    permission to group or others, or has the wrong size.
    """
    path = store_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
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


def read_file_capped(path: str, bytes_max: int, *, missing_ok: bool = False) -> bytes | None:
    """Read a whole file if it holds at most ``bytes_max`` bytes; None if it is larger.

    With ``missing_ok``, a missing file also reads as None; otherwise it raises ``StorageFailed``.
    """
    path = store_path(path)
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > bytes_max:
                return None
            data = handle.read(bytes_max + 1)
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise translate(exc, context=f"reading {path}") from None
    except OSError as exc:
        raise translate(exc, context=f"reading {path}") from None
    if len(data) > bytes_max:
        return None
    return data
