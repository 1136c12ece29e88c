"""Shared builders for authority tests (not a test module)."""

from __future__ import annotations

import itertools
import json
import os
import struct
import sys
import zlib
from collections.abc import Callable

from mwpstore import Authority, Command
from mwpstore import _sealed

OWNER = "owner"
GROUP = "g-1"


class FakeClock:
    """An injectable clock in milliseconds that tests move by hand."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, milliseconds: int) -> None:
        self.now_ms += milliseconds


# Where ``in_a_forked_child(kill=...)`` can stop another process, as (fail point, hit) pairs.
COMMIT_KILLS: list[tuple[str, int] | None] = [
    None,  # the child exits without closing the store
    ("authority.before_log_append", 1),  # the Command's commit: nothing written
    ("authority.after_log_sync", 1),  # its log group durable, the index not committed
    ("authority.after_index_commit", 1),
]
SNAPSHOT_KILLS = [  # after one commit: the snapshot's note (its file written first)
    ("authority.before_log_append", 2),  # its file written, no record
    ("authority.after_log_sync", 2),  # the note durable, not indexed
]
COMPACTION_STEPS = ["copy", "marked", "half_switched", "switched", "indexed"]  # compaction.<step>
ARCHIVE_KILLS = [
    ("authority.after_log_sync", 1),  # group.archive durable
    ("authority.before_log_append", 2),  # the final snapshot's file written, not its record
    ("authority.after_log_sync", 2),
    ("authority.before_log_append", 3),  # the audit log written, not the archive record
    ("authority.after_log_sync", 3),
]


_counter = itertools.count(1)


def group_create(group: str = GROUP, actor: str = OWNER, org: str = "acme", action_id: str | None = None) -> Command:
    return Command(
        actor=actor,
        action_id=action_id or f"create-{group}",
        group=group,
        kind="group.create",
        target=group,
        body={"org": org},
    )


def mission_create(mission: str, group: str = GROUP, action_id: str | None = None, cost_limit: int = 100) -> Command:
    return Command(
        actor=OWNER,
        action_id=action_id or f"mc-{mission}-{next(_counter)}",
        group=group,
        kind="mission.create",
        target=mission,
        body={"title": f"mission {mission}", "cost_limit": cost_limit},
    )


def mission_update(mission: str, expected_revision: int | None, title: str, group: str = GROUP, action_id: str | None = None) -> Command:
    return Command(
        actor=OWNER,
        action_id=action_id or f"mu-{mission}-{next(_counter)}",
        group=group,
        kind="mission.update",
        target=mission,
        body={"title": title},
        expected_revision=expected_revision,
    )


def open_with_group(path: str, clock: Callable[[], int] | None = None, group: str = GROUP) -> Authority:
    authority = Authority.open(path, clock=clock)
    authority.accept(group_create(group))
    return authority


def record_bytes(path: str, commands: list[Command]) -> list[int]:
    """The record bytes of the Events ``commands`` make, accepted in one commit after the Group's
    creation on a new store at ``path`` with a fixed clock (as a test then accepts them again)."""
    from mwpstore.authority import EVENT_TAG
    from mwpstore.messages import encode_event

    with open_with_group(path, clock=FakeClock()) as authority:
        assert all(result.ok for result in authority.accept_many(commands))
        return [len(EVENT_TAG + encode_event(event)) for event in authority.read(GROUP, after=1)]


def in_a_forked_child(calls: list[Callable[[], object]], timeout: float = 60.0, kill: tuple[str, int] | None = None) -> list[str]:
    """Run each call in a forked child; return what each raised (its class name) or "ok".
    A child that has not finished after ``timeout`` seconds is killed: ``["hung"]``. ``kill``
    arms a fail point in the child (its name and the hit that fires, as ``MWPSTORE_FAILPOINT``
    says them): a child it killed is ``["killed"]``. The child never closes what it opened."""
    import select
    import signal

    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        if kill is not None:
            from mwpstore import failpoints

            failpoints._NAME, failpoints._REMAINING = kill
        outcomes = []
        for call in calls:
            try:
                call()
                outcomes.append("ok")
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                outcomes.append(type(exc).__name__)
        os.write(writing, json.dumps(outcomes).encode())
        os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        if not select.select([pipe], [], [], timeout)[0]:  # the child writes once, when done
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return ["hung"]
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else ["killed"]


def close_interrupted_while_it_waits(close: Callable[[], object], use: Callable[[], object], reopen: Callable[[], object]) -> None:
    """Interrupt ``close()`` (KeyboardInterrupt in the main thread, 0.2 s in: while it waits for a
    read in flight) and check the half-closed state: closed to ``use``, still locked to ``reopen``.
    Needs SIGINT to raise (the ``sigint_raises`` fixture)."""
    import _thread
    import threading

    import pytest

    from mwpstore.errors import StoreClosed, StoreLocked

    threading.Timer(0.2, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        close()
    with pytest.raises(StoreClosed):
        use()
    with pytest.raises(StoreLocked):
        reopen()  # not released yet


def store_files_held(path: str) -> list[str]:
    """The files under ``path`` this process holds open or mapped (Linux /proc), sorted, each by
    its kernel name: a removed file's ends in " (deleted)"."""
    prefix = os.path.join(os.path.realpath(path), "")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        held += [fields[5].rstrip("\n") for fields in (line.split(None, 5) for line in maps) if len(fields) == 6]
    return sorted({name for name in held if name.startswith(prefix)})


def store_bytes(path: str, leave_out: tuple[str, ...] = ()) -> dict[str, bytes | None]:
    """Every file and directory under ``path`` by its relative name (a directory as None), but
    those named in ``leave_out``: to check that a refused open wrote nothing."""
    found: dict[str, bytes | None] = {}
    for directory, directories, files in os.walk(path):
        for name in directories + files:
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, path)
            if relative in leave_out:
                continue
            if os.path.isdir(full):
                found[relative] = None
            else:
                with open(full, "rb") as file:
                    found[relative] = file.read()
    return found


def rewrite_log_records(path: str, rewrite: Callable[[int, bytes], bytes]) -> list[tuple[int, bytes]]:
    """Copy the closed store ``path``'s log record by record, one group a record (as each accept,
    ack or snapshot wrote it), each record replaced by ``rewrite(position, record)`` (which must
    keep its length, so that every later position stays). The index, if any, is told the copy's
    log id, as if the log had been changed in place: it is trusted as before. Returns the
    original records."""
    import shutil

    from mwpstore.segment_log import SegmentLog

    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        records = [(position, bytes(record)) for batch in log.scan(0) for position, record in zip(batch.positions, batch.records)]
    forged = os.path.join(path, "forged")
    with SegmentLog.open(forged) as log:
        for position, record in records:
            assert log.append([rewrite(position, record)]) == [position]
        log_id = log.log_id
    shutil.rmtree(os.path.join(path, "log"))
    shutil.move(forged, os.path.join(path, "log"))
    if os.path.exists(os.path.join(path, "index", "data.mdb")):
        index_names_log(path, log_id)
    return records


def index_names_log(path: str, log_id: int) -> None:
    """Make the closed store ``path``'s index name the log ``log_id`` (a test's copy of the log
    written anew stands for the same log changed in place: the open trusts the index as before)."""
    from mwpstore.index import Index, u64

    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    try:
        with index.begin(write=True) as txn:
            index.put(txn, b"meta", b"log_id", u64(log_id))
    finally:
        index.close()


def store_with_one_event_rewritten(tmp_path, missions: int, rewrite) -> tuple[str, list[tuple[int, bytes]]]:
    """A store of ``missions`` accepts whose log is copied record by record (``rewrite_log_records``),
    with the Event of sequence 3 replaced by ``rewrite(event)`` (which must keep its encoded
    length). Returns the path and the original records."""
    from mwpstore.messages import decode_event, encode_event

    path = os.path.join(tmp_path, "store")
    with open_with_group(path) as authority:
        for number in range(missions):
            authority.accept(mission_create(f"m-{number}"))

    def rewrite_record(position: int, record: bytes) -> bytes:
        event = decode_event(memoryview(record)[1:])
        return record[:1] + encode_event(rewrite(event)) if event.seq == 3 else record

    return path, rewrite_log_records(path, rewrite_record)


def record_unseals(monkeypatch, owner: type, table: bytes) -> list[bytes]:
    """The keys of ``table`` that ``owner`` (a class: ``Index``, ``SealedTables``) unseals from
    now on, in order, for a test that pins how many entries a lookup reads. Counted at the C call
    that ``unseal`` and ``get`` both make (``get`` makes it without ``unseal``'s frame), for the
    tables of ``owner``'s instances."""
    unsealed: list[bytes] = []
    unseal = _sealed._unseal
    seed = zlib.crc32(table)

    def counting_unseal(stored, key, table_seed, most):  # type: ignore[no-untyped-def]
        if table_seed == seed and isinstance(sys._getframe(1).f_locals.get("self"), owner):  # get's or unseal's self
            unsealed.append(bytes(key))
        return unseal(stored, key, table_seed, most)

    monkeypatch.setattr(_sealed, "_unseal", counting_unseal)
    return unsealed


def set_database_flag(lmdb_dir, name: bytes, flag: int) -> int:
    """Set ``flag`` in every record of the named database ``name`` in ``data.mdb`` (earlier
    commits leave copies of the main database's leaf in free pages): a leaf node is its 8-byte
    header (data size, flags ``F_SUBDATA``, key size), the key, then the record, whose flags
    follow its 4 bytes of padding. Returns how many records were changed."""
    path = os.path.join(lmdb_dir, "data.mdb")
    data = bytearray(open(path, "rb").read())
    changed = 0
    start = 0
    while (at := data.find(name, start)) >= 0:
        start = at + 1
        header = at - 8
        if header < 0 or data[header + 4 : header + 6] != b"\x02\x00" or int.from_bytes(data[header + 6 : header + 8], "little") != len(name):
            continue
        flags = at + len(name) + 4
        data[flags] |= flag
        changed += 1
    with open(path, "wb") as handle:
        handle.write(data)
    return changed


def loop_database_root(lmdb_dir, name: bytes, *, last_child_only: bool = False) -> int:
    """Point every child of the named database's root branch page back at the root itself (a
    cycle that no search leaves: LMDB descends until its cursor stack is full); with
    ``last_child_only``, only its last child, so that only the keys after the last separator meet
    the cycle and the others are read as before. The root is the
    one the meta page LMDB would use names (``torture.lmdb_roots``); returns its page number
    (``AssertionError`` if the database is missing, empty, or its root a leaf: too small)."""
    from mwpstore.torture import lmdb_roots

    path = os.path.join(lmdb_dir, "data.mdb")
    data = bytearray(open(path, "rb").read())
    page_size, roots = lmdb_roots(bytes(data))
    root = roots.get(name.decode())
    assert root is not None and root != 2**64 - 1, f"no database {name!r}, or an empty one"
    base = root * page_size
    assert struct.unpack_from("<H", data, base + 10)[0] & 0x01, f"the root of {name!r} is not a branch page"
    lower = struct.unpack_from("<H", data, base + 12)[0]
    for pointer in range(lower - 2 if last_child_only else 16, lower, 2):
        at = base + struct.unpack_from("<H", data, base + pointer)[0]
        struct.pack_into("<HHH", data, at, root & 0xFFFF, root >> 16 & 0xFFFF, 0)
    with open(path, "wb") as handle:
        handle.write(data)
    return root



def raising(error: BaseException, wrapped: bool, method: str = "<built-in method get of Transaction object>"):
    """A callable that raises ``error``, or, ``wrapped``, the ``SystemError`` py-lmdb raises
    around an LMDB error from some of its methods ("<method> returned a result with an exception
    set"), with ``error`` as its cause."""

    def failing(*args, **kwargs):
        if not wrapped:
            raise error
        try:
            raise error
        except BaseException as cause:
            raise SystemError(f"{method} returned a result with an exception set") from cause

    return failing
