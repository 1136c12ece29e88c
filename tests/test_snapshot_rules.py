"""Rules of an authority's snapshots that the snapshot format alone does not show: which snapshot a
Cursor behind the replay floor is sent to, and where the floor stands when there are several."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from authority_helpers import GROUP, OWNER, mission_create, open_with_group, record_unseals
from blocking import Caller
from mwpstore import Authority, Command
from mwpstore.errors import StorageFailed, StoreClosed
from mwpstore.snapshot import check_snapshot_ref, verify_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot_interrupted(monkeypatch, authority: Authority, *, logged: bool) -> None:
    """``authority.snapshot(GROUP)`` ended by an interrupt as its note goes to the commit: after
    the note was committed (``logged``) or before it was queued."""
    real_submit = authority._submit

    def interrupted(unit) -> None:  # type: ignore[no-untyped-def]
        if logged:
            real_submit(unit)
        raise KeyboardInterrupt

    monkeypatch.setattr(authority, "_submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        authority.snapshot(GROUP)
    monkeypatch.undo()


def test_the_floor_is_the_newest_eligible_snapshot_and_the_reference_the_newest_of_all(tmp_path):
    """With a replay window W the floor is the newest snapshot at most head - W; the reference a
    CURSOR_TOO_OLD offers is the newest snapshot, eligible or not (restoring it lands past the
    floor)."""
    with Authority.open(str(tmp_path / "store")) as authority:
        policy = {"org": "acme", "policy": {"replay_window_events": 2}}
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body=policy))
        authority.accept_many([mission_create(f"m-{i}") for i in range(2)])
        older = authority.snapshot(GROUP)
        authority.accept_many([mission_create(f"n-{i}") for i in range(3)])
        newer = authority.snapshot(GROUP)
        assert (older.seq, newer.seq) == (3, 6)
        authority.accept(mission_create("o-0"))
        assert authority.replay_floor(GROUP) == (3, newer)  # only the older one is at most 7 - 2
        authority.accept(mission_create("o-1"))
        assert authority.replay_floor(GROUP) == (6, newer)  # both are: the newer one is the floor


def test_a_snapshot_at_seq_1_is_the_floor_once_the_head_is_a_window_past_it(tmp_path):
    """The lowest floor there is: a snapshot of the Group's first Event is eligible as soon as
    head - W reaches 1, and not one Event before."""
    with Authority.open(str(tmp_path / "store")) as authority:
        policy = {"org": "acme", "policy": {"replay_window_events": 2}}
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body=policy))
        first = authority.snapshot(GROUP)
        assert first.seq == 1 and authority.replay_floor(GROUP) == (0, None)
        authority.accept(mission_create("m-0"))
        assert authority.replay_floor(GROUP) == (0, None)  # head 2: 2 - 2 = 0, below the snapshot
        authority.accept(mission_create("m-1"))
        assert authority.replay_floor(GROUP) == (1, first)  # head 3: 3 - 2 = 1


def test_the_floor_is_found_by_search_not_by_reading_every_snapshot_of_the_group(tmp_path, monkeypatch):
    """read() asks for the replay floor at every call: it looks up the two snapshots it needs
    instead of unsealing and decoding every snapshot the Group ever had (a read cost that grew
    with the Group's snapshots). Neighbours whose keys sort just before and after the Group's own
    (g-0, g-1x) must not be taken for its snapshots."""
    from mwpstore import index as index_module

    with Authority.open(str(tmp_path / "store"), sync=False) as authority:
        for group in ("g-0", GROUP, "g-1x", "g-2"):
            body = {"org": "acme", "policy": {"replay_window_events": 3}}
            authority.accept(Command(actor=OWNER, action_id=f"c-{group}", group=group, kind="group.create", target=group, body=body))
        assert authority.replay_floor(GROUP) == (0, None)
        for group in ("g-0", "g-1x"):  # neighbours only: GROUP has none yet
            for i in range(5):
                authority.accept(mission_create(f"m-{i}", group=group))
                authority.snapshot(group)
        assert authority.replay_floor(GROUP) == (0, None)
        for i in range(5):  # past the window, still without a snapshot: the neighbours' are not its
            authority.accept(mission_create(f"p-{i}"))
        assert authority.replay_floor(GROUP) == (0, None)
        refs = []
        for i in range(40):
            authority.accept(mission_create(f"m-{i}"))
            if i % 2:
                refs.append(authority.snapshot(GROUP))
        head = authority.head(GROUP)[0]
        assert authority.snapshots(GROUP) == refs
        assert authority.replay_floor(GROUP) == (max(ref.seq for ref in refs if ref.seq <= head - 3), refs[-1])

        unsealed = record_unseals(monkeypatch, index_module.Index, b"snapshots")
        assert [event.seq for event in authority.read(GROUP, after=head - 3)] == [head - 2, head - 1, head]
        assert len(unsealed) <= 4  # two searches, each checking the entry it lands on; before: all 20
        for extra in range(3):  # the floor moves with the head, one snapshot at a time
            authority.accept(mission_create(f"x-{extra}"))
            head += 1
            eligible = [ref.seq for ref in refs if ref.seq <= head - 3]
            assert authority.replay_floor(GROUP) == (max(eligible), refs[-1])


# -- snapshot files no record names ----------------------------------------------------------------


def _snapshot_files(path: str) -> list[str]:
    """Every file under ``snapshots/``, as ``<group>/<name>``, sorted."""
    root = os.path.join(path, "snapshots")
    return sorted(os.path.relpath(os.path.join(where, name), root) for where, _, names in os.walk(root) for name in names)


def test_a_snapshot_that_close_cuts_off_leaves_no_file(tmp_path, monkeypatch):
    """close() while snapshot() writes its file: the note is refused (StoreClosed) before it is
    queued, so no record will ever name the file, and the file goes (it stayed for good: the next
    snapshot at that sequence replaced it, but the Group moved on)."""
    from mwpstore import authority as authority_module

    with open_with_group(str(tmp_path / "store")) as authority:
        written, go_on = threading.Event(), threading.Event()
        real_write = authority_module.write_file_at

        def write_then_wait(directory, name: str, data: bytes, *, mode: int) -> None:
            real_write(directory, name, data, mode=mode)
            written.set()
            assert go_on.wait(30)

        monkeypatch.setattr(authority_module, "write_file_at", write_then_wait)
        snapshot = Caller(lambda: authority.snapshot(GROUP))
        assert written.wait(30)
        closing = Caller(authority.close)
        while not authority._closed:  # close() has begun: it waits for the snapshot, a read
            time.sleep(0.001)
        go_on.set()
        assert isinstance(snapshot.outcome(), StoreClosed)
        assert closing.outcome() is None
    assert _snapshot_files(authority.path) == []
    with Authority.open(authority.path) as authority:
        assert authority.snapshots(GROUP) == [] and authority.verify().ok


@pytest.mark.parametrize("logged", [False, True])
def test_a_snapshot_an_interrupt_ends_leaves_its_file_to_close_which_removes_it_unless_a_record_names_it(tmp_path, monkeypatch, logged):
    """An interrupt (KeyboardInterrupt) can end snapshot() while its note is still queued for a
    later commit, so the file stays while the handle is open; close(), once no commit can run,
    removes it if the note was not logged, and keeps it when it was."""
    with open_with_group(str(tmp_path / "store")) as authority:
        snapshot_interrupted(monkeypatch, authority, logged=logged)
        assert _snapshot_files(authority.path) == [f"{GROUP}/{1:020d}.snap"]
    assert _snapshot_files(authority.path) == ([f"{GROUP}/{1:020d}.snap"] if logged else [])
    with Authority.open(authority.path) as authority:
        assert [ref.seq for ref in authority.snapshots(GROUP)] == ([1] if logged else [])
        assert authority.verify().ok


CHILD_SNAPSHOT = """
import sys
from mwpstore import Authority
with Authority.open(sys.argv[1]) as authority:
    authority.snapshot("g-1")
"""


@pytest.mark.parametrize("failpoint", ["authority.before_log_append", "authority.after_log_sync"])
def test_an_open_after_a_crash_removes_the_snapshot_files_no_record_names_and_keeps_every_named_one(tmp_path, failpoint):
    """A crash between a snapshot file made durable and its record leaves a file no record names:
    the next open (the store not closed cleanly) removes it, and the temporary file of a snapshot
    write that never finished. Kept: a file its record names (a crash after the log's sync: redo
    indexes the record first), and every file at a sequence that has a record, the first one too
    after a re-signing replaced its reference (a read-only view may still name it)."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        first = authority.snapshot(GROUP)
        authority.rotate_signing_key()
        resigned = authority.snapshot(GROUP)  # seq 1 again, signed with the new key: another file
        authority.accept(mission_create("m-1"))
    temp = os.path.join(path, "snapshots", GROUP, f".{2:020d}.snap.0123456789abcdef.tmp")
    with open(temp, "wb") as handle:
        handle.write(b"half a snapshot")
    env = dict(os.environ, PYTHONPATH=REPO, MWPSTORE_FAILPOINT=failpoint)
    result = subprocess.run([sys.executable, "-c", CHILD_SNAPSHOT, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    named = [first.location, resigned.location]
    written = f"snapshots/{GROUP}/{2:020d}.snap"
    assert _snapshot_files(path) == sorted(os.path.relpath(name, "snapshots") for name in [*named, written, temp[len(path) + 1:]])
    with Authority.open(path) as authority:
        kept = named + ([written] if failpoint == "authority.after_log_sync" else [])
        assert _snapshot_files(path) == sorted(os.path.relpath(name, "snapshots") for name in kept)
        assert [ref.location for ref in authority.snapshots(GROUP)] == kept[1:]
        assert authority.verify().ok
        verify_snapshot(authority.read_snapshot(first), keyring=authority.keyring(), group=GROUP)


CHILD_RESIGN_THEN_CRASH = """
import sys
from authority_helpers import mission_create
from mwpstore import Authority
authority = Authority.open(sys.argv[1])
authority.rotate_signing_key()
authority.snapshot("g-1")  # sequence 1 signed again: its reference now names another file
authority.accept(mission_create("m-1"))
authority.snapshot("g-1")  # killed before its record (the third log append)
"""


def test_a_read_only_view_keeps_reading_the_snapshot_it_names_across_a_writer_that_sweeps(tmp_path):
    """A view in another process names the snapshot files of its own moment: the first file of
    a sequence that a writer signed again since (the view still holds the old reference) must
    survive the sweep of the next writer's open after a crash, which removes only the file no
    record names."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        first = authority.snapshot(GROUP)
    view = Authority.open(path, readonly=True)
    try:
        assert view.snapshots(GROUP) == [first]
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO)
        crash = dict(env, MWPSTORE_FAILPOINT="authority.before_log_append:3")
        result = subprocess.run([sys.executable, "-c", CHILD_RESIGN_THEN_CRASH, path], env=crash, capture_output=True, text=True, timeout=120)
        assert result.returncode == -9, result.stderr
        assert f"{GROUP}/{2:020d}.snap" in _snapshot_files(path)
        result = subprocess.run([sys.executable, "-c", CHILD_SNAPSHOT.replace('authority.snapshot("g-1")', "pass"), path],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"{GROUP}/{2:020d}.snap" not in _snapshot_files(path)  # the writer's open swept
        assert len(_snapshot_files(path)) == 2  # sequence 1: the first file and the one signed again
        assert view.snapshots(GROUP) == [first]
        check_snapshot_ref(view.read_snapshot(first), first)  # the very file the view's reference names
    finally:
        view.close()


def test_a_snapshot_whose_note_meets_a_storage_failure_keeps_its_file_until_the_next_open_removes_it(tmp_path, monkeypatch):
    """A storage failure while the note is committed may have logged it without indexing it: the
    file stays, the close is not clean, and the next open (its index redone from the log) removes
    the file if no record names it."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:

        def failing_append(records):
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(authority.log, "append", failing_append)
        with pytest.raises(StorageFailed):
            authority.snapshot(GROUP)
        monkeypatch.undo()
    assert _snapshot_files(path) == [f"{GROUP}/{1:020d}.snap"]
    with Authority.open(path) as authority:
        assert _snapshot_files(path) == [] and authority.snapshots(GROUP) == []
        assert authority.verify().ok


def test_close_keeps_the_file_an_interrupted_snapshot_logged_after_a_re_signing_replaced_its_reference(tmp_path, monkeypatch):
    """An interrupt that ends snapshot() after its note was logged leaves close() to decide; a
    re-signing at the same sequence (a key rotation between) then replaces the reference in the
    index. The first file was named by a record (a read-only view may hold it, and it still
    verifies against the retired key): close() keeps it, as the open's sweep does."""
    with open_with_group(str(tmp_path / "store")) as authority:
        snapshot_interrupted(monkeypatch, authority, logged=True)
        [first] = authority.snapshots(GROUP)
        authority.rotate_signing_key()
        resigned = authority.snapshot(GROUP)
        assert resigned.location != first.location
    assert _snapshot_files(authority.path) == sorted(os.path.relpath(ref.location, "snapshots") for ref in (first, resigned))
    with Authority.open(authority.path) as authority:
        verify_snapshot(authority.read_snapshot(first), keyring=authority.keyring(), group=GROUP)
        assert authority.verify().ok
