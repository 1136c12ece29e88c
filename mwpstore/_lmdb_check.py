"""The structural check of an LMDB data file, run before LMDB maps it (``csrc/lmdb_check.c``).

LMDB trusts the pages of its file. A single flipped bit in a page offset, a node's size or a
page number can make LMDB, or the binding (which touches every page of a value it returns),
read past the end of the file: the process dies with SIGBUS instead of getting an error. The
stores' seals cannot help there, because the crash happens inside LMDB before a value reaches
them. This check walks every page reachable from the meta page LMDB would use and verifies
what LMDB relies on when it reads; a file that passes is safe to hand to LMDB, and the seals
then check the content. See docs/format/index.md, "Structural check".
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from typing import Any, NoReturn

from mwpstore._lmdb_check_c import ffi, lib
from mwpstore import limits
from mwpstore.errors import Corruption, InvalidCommand, StorageFailed

__all__ = ["LmdbCheck", "check_before_open", "check_lmdb_file", "check_meta_pages", "check_option"]

_REASONS = {
    lib.LC_REASON_FILE_SHORT: "file_short",
    lib.LC_REASON_META: "meta",
    lib.LC_REASON_PAGE_SIZE: "page_size",
    lib.LC_REASON_PAGE_RANGE: "page_range",
    lib.LC_REASON_PAGE_NUMBER: "page_number",
    lib.LC_REASON_PAGE_FLAGS: "page_flags",
    lib.LC_REASON_PAGE_BOUNDS: "page_bounds",
    lib.LC_REASON_NODE_BOUNDS: "node_bounds",
    lib.LC_REASON_NODE_FLAGS: "node_flags",
    lib.LC_REASON_OVERFLOW: "overflow",
    lib.LC_REASON_DATABASE: "database",
    lib.LC_REASON_DEPTH: "depth",
    lib.LC_REASON_PAGE_TWICE: "page_twice",
    lib.LC_REASON_FREE_LIST: "free_list",
    lib.LC_REASON_BRANCH_EMPTY: "branch_empty",
    lib.LC_REASON_PAGE_LOST: "page_lost",
    lib.LC_REASON_NODE_LAYOUT: "node_layout",
    lib.LC_REASON_KEY_ORDER: "key_order",
}

_PAGE_BYTES_MIN = 512
"""LMDB's smallest page size: a file shorter than two such pages holds no two meta pages."""


@dataclasses.dataclass(frozen=True)
class LmdbCheck:
    """What a passed check saw."""

    file_bytes: int
    page_bytes: int
    pages_in_use: int
    pages_free: int


def check_lmdb_file(path: str, *, label: str, remedy: str) -> LmdbCheck:
    """Check the LMDB data file at ``path`` (a ``data.mdb``). ``Corruption`` (reason
    ``lmdb_structure``, with the check that failed, the page and the offending value) when it
    would not be safe to hand to LMDB; ``StorageFailed`` when it cannot be read."""
    result = ffi.new("struct lc_result *")
    rc = lib.lc_check_file(os.fsencode(path), result)
    if rc != lib.LC_OK:
        _raise_for(rc, result, path, label, remedy)
    return LmdbCheck(int(result.file_bytes), int(result.page_bytes), int(result.pages_in_use), int(result.pages_free))


def check_meta_pages(path: str, *, label: str, remedy: str) -> None:
    """The part of :func:`check_lmdb_file` that reads only the two meta pages (``lc_check_meta_pages``
    in C: the walk's own meta rules, at most the file's first 64 KiB whatever its size), run at
    every open that does not walk the file: both metas sound (page number, ``P_META``, magic,
    version, database flags, a page size LMDB accepts), their transaction ids consecutive with the
    newer one on its parity's page, and the last page the picked one names within reach of the
    file's end. A bit flipped in a transaction id makes LMDB pick the older meta: it would open
    the snapshot one commit behind, consistent and sealed, and every answer would be one commit old
    without an error. Damage is ``Corruption`` (reason ``lmdb_structure``, check ``meta``,
    ``page_size``, ``database`` or ``file_short``), as from the walk; a file too short for both
    metas is left to the open (LMDB's own errors)."""
    result = ffi.new("struct lc_result *")
    rc = lib.lc_check_meta_pages(os.fsencode(path), result)
    if rc == lib.LC_OK or (rc == lib.LC_E_DAMAGED and _shorter_than_two_metas(result)):
        return
    _raise_for(rc, result, path, label, remedy)


def _shorter_than_two_metas(result: Any) -> bool:
    """Whether a ``file_short`` verdict is about the file's size (shorter than two meta pages of
    the page size it names, or than two of the smallest when that is unreadable), not about the
    last page the picked meta names."""
    page_bytes = int(result.page_bytes) or _PAGE_BYTES_MIN
    return result.reason == lib.LC_REASON_FILE_SHORT and int(result.file_bytes) < 2 * page_bytes


def _raise_for(rc: int, result: Any, path: str, label: str, remedy: str) -> NoReturn:
    """The typed error of a failed check: damage, no memory, or a file that cannot be read."""
    if rc == lib.LC_E_DAMAGED:
        check = _REASONS.get(result.reason, str(result.reason))
        raise Corruption(
            f"the {label}'s LMDB file is damaged: check {check} failed on page {result.page} "
            f"(value {result.value}); {remedy}",
            reason="lmdb_structure", check=check, path=path, page=int(result.page), value=int(result.value),
        )
    if rc == lib.LC_E_NO_MEMORY:
        raise MemoryError(f"checking the {label}'s LMDB file {path}")
    error = int(result.sys_errno)
    raise StorageFailed(f"cannot read the {label}'s LMDB file {path}: {os.strerror(error)}", errno=error, path=path)


def check_option(check: object) -> None:
    """``InvalidCommand`` unless ``check`` is a valid ``check_lmdb`` option of an open."""
    if check is not None and type(check) is not bool:  # 0 == False and 1 == True, but 0 checked every file
        raise InvalidCommand("check_lmdb must be True, False or None (check files up to the size limit)", field="check_lmdb")


def check_map_size(map_size: object) -> None:
    """``InvalidCommand`` unless ``map_size`` is a valid LMDB map size of an open (an int of bytes)."""
    if type(map_size) is not int or not 0 < map_size <= limits.INT_ABS_MAX:
        raise InvalidCommand(f"map_size must be an int of bytes in 1..{limits.INT_ABS_MAX}", field="map_size")


def refuse_linked_files(directory: str, *, label: str) -> None:
    """``StorageFailed`` naming the file if ``data.mdb`` or ``lock.mdb`` in ``directory`` is a
    symbolic link or anything but a regular file. LMDB opens both with ``O_CREAT`` and follows
    links: through a link to a name outside the store it made that file there and wrote the
    environment (or its reader table) into it. A missing file, or one that cannot be looked at,
    is left to the open."""
    for name in ("data.mdb", "lock.mdb"):
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            raise StorageFailed(
                f"the {label}'s LMDB file {path} is a symbolic link; LMDB would write the file it names: remove it",
                errno=errno.ELOOP,
                path=path,
            )
        if not stat.S_ISREG(mode):
            raise StorageFailed(f"the {label}'s LMDB file {path} is not a regular file", errno=errno.EINVAL, path=path)


def check_before_open(directory: str, check: bool | None, *, label: str, remedy: str) -> LmdbCheck | None:
    """The check an open makes before LMDB maps ``directory``'s data file: always with ``check``
    true, never with false, and with None (the default) when the file is at most
    ``limits.LMDB_CHECK_AT_OPEN_BYTES_MAX`` bytes. None when not checked (or no file yet)."""
    check_option(check)
    refuse_linked_files(directory, label=label)
    path = os.path.join(directory, "data.mdb")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageFailed(f"cannot read the {label}'s LMDB file {path}: {exc.strerror}", errno=exc.errno, path=path) from None
    if not stat.S_ISREG(info.st_mode):
        # LMDB would open a FIFO and wait on it for ever, holding the interpreter lock.
        raise StorageFailed(f"the {label}'s LMDB file {path} is not a regular file", errno=errno.EINVAL, path=path)
    size = info.st_size
    if size == 0:
        # LMDB creates the file, then writes both meta pages in one write: a crash in between
        # leaves it empty, and LMDB sets an empty file up as a new environment.
        return None
    if check is False or (check is None and size > limits.LMDB_CHECK_AT_OPEN_BYTES_MAX):
        check_meta_pages(path, label=label, remedy=remedy)  # two reads: the walk's meta rules
        return None
    return check_lmdb_file(path, label=label, remedy=remedy)
