"""Maintenance operations racing each other and accepts: each test forces one interleaving with
``threading.Event`` barriers in monkeypatched hooks (no sleep decides anything)."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import pytest

from authority_helpers import GROUP, OWNER, mission_create, open_with_group
from mwpstore import Authority, Command, StorageFailed
from mwpstore.snapshot import SigningKey, verify_snapshot

WAIT = 30  # seconds a barrier waits before the test fails instead of hanging


def _key_on_disk(authority: Authority) -> SigningKey:
    with open(os.path.join(authority.path, "keys", "snapshot-signing.key"), "rb") as handle:
        return SigningKey.from_seed(handle.read())


@pytest.mark.parametrize("rotation", ["finishes", "fails after writing the new key", "fails after the loader took the old key"])
@pytest.mark.parametrize("use", ["signing_key", "keyring"])
def test_a_key_loaded_beside_a_rotation_never_brings_the_dropped_key_back(tmp_path, monkeypatch, use, rotation):
    """A first use of the signing key (``signing_key``, ``keyring()``: archive and verify call it)
    that reads the key file while ``rotate_signing_key(retire=False)`` runs must not install the
    key the rotation dropped as compromised once the rotation has ended: every later snapshot
    would be signed with it, and a keyring opened from the store's files refuses it. A rotation
    that fails after writing the new key leaves no key cached, whether the loader that read the
    old key is still running then (it must not install it) or took it before (it is dropped):
    the file holds the new key."""
    from mwpstore import snapshot as snapshot_module

    authority = open_with_group(str(tmp_path / "s"))
    try:
        authority.accept(mission_create("m-1"))
        old = authority.signing_key
        at_retire, go_rotation = threading.Event(), threading.Event()
        loaded, go_loader = threading.Event(), threading.Event()
        real_hit, real_load = snapshot_module.failpoints.hit, SigningKey.load_or_create.__func__
        rotator, loader = [], []

        def hit(name):
            if name == "keys.after_retire" and threading.current_thread().name == "rotator":
                at_retire.set()  # the handle's cached key is cleared, the old key is still on disk
                assert go_rotation.wait(WAIT)
            return real_hit(name)

        def load_or_create(cls, directory, **kwargs):
            key = real_load(cls, directory, **kwargs)
            if threading.current_thread().name == "loader":
                loaded.set()  # it read the old key file
                if rotation != "fails after the loader took the old key":
                    assert go_loader.wait(WAIT)
            if threading.current_thread().name == "rotator" and rotation != "finishes" and at_retire.is_set():
                raise StorageFailed("cannot write snapshot-signing.pub", errno=errno.EIO)  # its last step
            return key

        monkeypatch.setattr(snapshot_module.failpoints, "hit", hit)
        monkeypatch.setattr(SigningKey, "load_or_create", classmethod(load_or_create))

        def rotate():
            try:
                rotator.append(authority.rotate_signing_key(retire=False))
            except StorageFailed as exc:
                rotator.append(exc)

        def load():
            loader.append(authority.signing_key if use == "signing_key" else authority.keyring())

        threads = [threading.Thread(target=rotate, name="rotator"), threading.Thread(target=load, name="loader")]
        threads[0].start()
        assert at_retire.wait(WAIT)
        threads[1].start()
        assert loaded.wait(WAIT)  # it read the old key file, the rotation not yet finished
        if rotation == "fails after the loader took the old key":
            threads[1].join(WAIT)
        go_rotation.set()
        threads[0].join(WAIT)
        go_loader.set()
        threads[1].join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        monkeypatch.undo()

        new = _key_on_disk(authority)
        assert new.key_id != old.key_id
        assert isinstance(rotator[0], StorageFailed) if rotation != "finishes" else rotator[0].key_id == new.key_id
        ref = authority.snapshot(GROUP)  # unfixed: signed with the dropped key
        assert ref.key_id == new.key_id
        assert authority.signing_key.key_id == new.key_id
        verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), group=GROUP)
        assert old.key_id not in authority.keyring().key_ids
    finally:
        authority.close()


def _fill(authority: Authority, count: int) -> None:
    for result in authority.accept_many([mission_create(f"m-{i}") for i in range(count)]):
        result.unwrap()


@pytest.mark.parametrize("moment", ["before writing", "writing", "checking"])
def test_a_legal_deletion_accepted_while_archive_writes_or_checks_the_file_is_invalid_state(tmp_path, monkeypatch, moment):
    """audit.delete can be accepted (another thread) once group.archive is, while archive() still
    writes its audit log under a temporary name, or checks the file in place: the deletion removes
    that file. archive() then answers what happened, ``InvalidState`` (state ``deleted``), as it does
    for a deletion accepted before the file existed, not the ``STORAGE_FAILED`` of the file it lost
    (which tells the operator to look for a failing disk and reopen the store). A deletion accepted
    after the final snapshot and before the file is written finds nothing to remove: archive() then
    removes the file it wrote, and logs no record."""
    from mwpstore.errors import InvalidState

    authority = open_with_group(str(tmp_path / "s"))
    try:
        _fill(authority, 3)
        directory = os.path.join(authority.path, "archive", GROUP)
        seen: list[list[str]] = []

        def delete_now() -> None:
            seen.append(sorted(os.listdir(directory)) if os.path.isdir(directory) else [])  # what the deletion will find there
            thread = threading.Thread(
                target=authority.delete_audit_log, args=(GROUP,), kwargs={"actor": OWNER, "action_id": "del", "basis": "legal"}
            )
            thread.start()
            thread.join(WAIT)
            assert not thread.is_alive()

        if moment == "before writing":
            real_snapshot = Authority.snapshot

            def snapshot(self, group):
                ref = real_snapshot(self, group)
                delete_now()  # the final snapshot is taken, the audit log not yet begun
                return ref

            monkeypatch.setattr(Authority, "snapshot", snapshot)
        elif moment == "writing":
            real_payloads = Authority._event_payloads

            def payloads(self, group, last_seq):
                yield from real_payloads(self, group, last_seq)
                delete_now()  # the temporary file is written and open, not yet renamed

            monkeypatch.setattr(Authority, "_event_payloads", payloads)
        else:
            real_keyring = Authority.keyring

            def keyring(self):
                delete_now()  # the audit log is in place, its check about to read it
                return real_keyring(self)

            monkeypatch.setattr(Authority, "keyring", keyring)

        with pytest.raises(InvalidState) as raised:
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        monkeypatch.undo()
        assert raised.value.detail.get("state") == "deleted"
        assert len(seen) == 1
        if moment == "before writing":
            assert seen[0] == []
        else:
            assert len(seen[0]) == 1 and seen[0][0].endswith(".tmp" if moment == "writing" else ".log")
        assert authority.read(GROUP)[-1].kind == "audit.delete"
        assert authority.archive_record(GROUP) is None
        assert os.listdir(directory) == []
        assert authority.verify().ok
    finally:
        authority.close()


@pytest.mark.parametrize("count", [3, 20])  # below and above the read that looks up only both ends
def test_a_read_that_meets_a_compaction_of_its_group_never_reports_index_damage(tmp_path, monkeypatch, count):
    """A read of an archived Group whose compaction switches the log and index between the replay
    floor's check and the Events' lookup must answer from one pair: the Events (as the pair it
    began on holds them) or ``CursorTooOld`` (as the new one says), never the ``CORRUPTION`` of
    Events missing from the new index ("run mwpstore rebuild"), nor anything a subscriber would
    take for damage. Its tombstones come from that pair too: a payload redacted before the
    archive is still in the old log, and the new index no longer holds the archived Group's
    tombstones."""
    from mwpstore import CursorTooOld

    authority = open_with_group(str(tmp_path / "s"))
    try:
        _fill(authority, count)
        authority.redact(GROUP, 2, actor=OWNER, action_id="redact-2", reason="legal request")
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        expected = [(event.seq, event.body is None) for event in authority.read(GROUP)]
        assert [seq for seq, _ in expected] == list(range(1, record.last_seq + 1))
        assert [seq for seq, redacted in expected if redacted] == [2]
        at_lookup, go_on = threading.Event(), threading.Event()
        real = Authority._read_events
        outcome: list[object] = []

        def read_events(self, *args, **kwargs):
            if threading.current_thread().name == "reader":
                at_lookup.set()  # the floor is checked: the Group is not compacted yet
                assert go_on.wait(WAIT)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Authority, "_read_events", read_events)

        def read() -> None:
            try:
                outcome.append([(event.seq, event.body is None) for event in authority.read(GROUP)])
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)

        reader = threading.Thread(target=read, name="reader")
        reader.start()
        assert at_lookup.wait(WAIT)
        report = authority.compact()
        assert report.groups_compacted == [GROUP]
        go_on.set()
        reader.join(WAIT)
        assert not reader.is_alive()
        assert outcome == [expected] or (isinstance(outcome[0], CursorTooOld) and outcome[0].floor == record.last_seq), outcome
        monkeypatch.undo()
        with pytest.raises(CursorTooOld):  # a read that begins after the switch
            authority.read(GROUP)
    finally:
        authority.close()


def _until(condition, what: str) -> None:
    """Polls ``condition`` (no sleep decides anything); fails the test if it never holds."""
    for _ in range(6000):
        if condition():
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"never: {what}")


def test_a_close_during_an_audit_delete_commit_answers_its_receipt_and_removes_the_file(tmp_path, monkeypatch):
    """close() refuses new work at once and waits for the running commit. A commit that holds an
    audit.delete removes the file after its index commit, looking up the archive record: that
    lookup must not meet the closed flag as a new read would (``StoreClosed``), which escaped the
    commit after the Event was durable: the leader's caller was told the store was closed for a
    Command it had accepted, and the audit log stayed on disk until the next open."""
    from mwpstore import authority as authority_module

    authority = open_with_group(str(tmp_path / "s"))
    closer = None
    try:
        _fill(authority, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        audit = os.path.join(authority.path, record.audit_location)
        assert os.path.exists(audit)
        real_hit = authority_module.failpoints.hit

        def hit(name):
            nonlocal closer
            if name == "authority.after_index_commit" and closer is None:
                closer = threading.Thread(target=authority.close, name="closer")
                closer.start()
                _until(lambda: authority._closed, "close() began")
            return real_hit(name)

        monkeypatch.setattr(authority_module.failpoints, "hit", hit)
        receipt = authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal")
        assert receipt.seq == record.last_seq + 1
        assert not os.path.exists(audit)
        closer.join(WAIT)
        assert not closer.is_alive()
    finally:
        authority.close()
    with Authority.open(str(tmp_path / "s")) as reopened:
        assert reopened.read(GROUP)[-1].kind == "audit.delete"
        assert reopened.verify().ok


@pytest.mark.parametrize("moment", ["scan", "files"])
def test_a_verify_that_meets_close_raises_store_closed_and_lists_no_problem(tmp_path, monkeypatch, moment):
    """close() waits for a verify() in flight, and from its start turns new reads and the commit
    role away: verify() must pass that ``StoreClosed`` on, whether it meets it comparing the index
    (``scan``: close() begins during the log scan) or checking the audit log against its final
    snapshot, the last file it checks (``files``), not list
    it as problems of a store that has none (``mwpstore verify`` exits 1 for a listed problem)."""
    from mwpstore import StoreClosed

    authority = open_with_group(str(tmp_path / "s"))
    _fill(authority, 3)
    authority.snapshot(GROUP)
    final = authority.archive(GROUP, actor=OWNER, action_id="archive").final_snapshot
    paused, go_on = threading.Event(), threading.Event()
    outcome: list[object] = []

    def pause() -> None:
        if threading.current_thread().name == "verifier" and not paused.is_set():
            paused.set()
            assert go_on.wait(WAIT)

    if moment == "files":
        real_read_snapshot = Authority.read_snapshot
        reads_of_final = []

        def read_snapshot(self, ref):
            if ref == final and threading.current_thread().name == "verifier":
                reads_of_final.append(ref)
                if len(reads_of_final) == 2:  # listed among the snapshots, then for the audit log's check
                    pause()
            return real_read_snapshot(self, ref)

        monkeypatch.setattr(Authority, "read_snapshot", read_snapshot)

    def verify() -> None:
        try:
            outcome.append(authority.verify((lambda done, total: pause()) if moment == "scan" else None))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    verifier = threading.Thread(target=verify, name="verifier")
    verifier.start()
    assert paused.wait(WAIT)
    closer = threading.Thread(target=authority.close, name="closer")
    closer.start()
    _until(lambda: authority._closed, "close() began")
    go_on.set()
    verifier.join(WAIT)
    closer.join(WAIT)
    assert not verifier.is_alive() and not closer.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], StoreClosed), outcome
    monkeypatch.undo()
    with Authority.open(str(tmp_path / "s")) as reopened:
        assert reopened.verify().ok


def _verify_in_thread(authority: Authority, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``authority.verify()`` in a thread named ``verifier`` (the patched hooks act in it alone),
    joined; the patches are undone before its report is returned."""
    reports = []
    verifier = threading.Thread(target=lambda: reports.append(authority.verify()), name="verifier")
    verifier.start()
    verifier.join(WAIT)
    assert not verifier.is_alive()
    monkeypatch.undo()
    return reports[0]


def _run_in_thread(action) -> None:
    """``action()`` in another thread, joined (another caller of the authority, at this point)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("moment", ["before_look", "while_checking"])
def test_verify_lists_no_problem_for_an_audit_log_deleted_while_it_checks(tmp_path, monkeypatch, moment):
    """verify() reads whether an archived Group's audit log was deleted, then looks for the file
    and checks it: an audit.delete accepted between the two removes it (``before_look``), or
    removes it as the check is about to read it (``while_checking``), and neither is damage
    ("missing, no accepted audit.delete explains it", or the check's failure to read it)."""
    authority = open_with_group(str(tmp_path / "s"))
    try:
        _fill(authority, 3)
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        deletions = []

        def delete() -> None:
            deletions.append(None)
            _run_in_thread(lambda: authority.delete_audit_log(GROUP, actor=OWNER, action_id="del", basis="legal"))

        if moment == "before_look":
            real_state = Authority.state

            def state(self, group, aggregate):
                answer = real_state(self, group, aggregate)
                if aggregate == f"group:{GROUP}" and threading.current_thread().name == "verifier" and not deletions:
                    delete()
                return answer

            monkeypatch.setattr(Authority, "state", state)
        else:
            real_read_snapshot = Authority.read_snapshot
            reads_of_final = []

            def read_snapshot(self, ref):
                if ref == record.final_snapshot and threading.current_thread().name == "verifier":
                    reads_of_final.append(ref)
                    if len(reads_of_final) == 2:  # listed among the snapshots, then for the audit log's check
                        delete()
                return real_read_snapshot(self, ref)

            monkeypatch.setattr(Authority, "read_snapshot", read_snapshot)
        report = _verify_in_thread(authority, monkeypatch)
        assert deletions and not os.path.exists(os.path.join(authority.path, record.audit_location))
        assert report.problems == []
        assert authority.verify().ok
    finally:
        authority.close()


def test_verify_lists_no_problem_for_a_snapshot_signed_after_a_rotation_while_it_checks(tmp_path, monkeypatch):
    """verify() takes the store's keyring at the first file it checks. A rotation (the old key
    retired, still trusted) and a snapshot signed with the new key after that are no damage: the
    snapshot verifies with the store's keyring as it is once verify() reads it."""
    authority = open_with_group(str(tmp_path / "s"))
    try:
        authority.accept(Command(actor=OWNER, action_id="g2", group="g-2", kind="group.create", target="g-2", body={"org": "acme"}))
        authority.snapshot(GROUP)
        authority.snapshot("g-2")
        real_snapshots = Authority.snapshots
        rotated = []

        def snapshots(self, group):
            if group == "g-2" and threading.current_thread().name == "verifier" and not rotated:
                # GROUP's snapshot was checked: the keyring is taken
                rotated.append(None)

                def rotate_and_sign() -> None:
                    rotated.append(authority.rotate_signing_key())
                    rotated.append(authority.snapshot("g-2"))

                _run_in_thread(rotate_and_sign)
            return real_snapshots(self, group)

        monkeypatch.setattr(Authority, "snapshots", snapshots)
        report = _verify_in_thread(authority, monkeypatch)
        _, new, ref = rotated
        assert ref.key_id == new.key_id
        assert report.problems == []
        assert authority.verify().ok
    finally:
        authority.close()


@pytest.mark.parametrize("operation", ["rotate_signing_key", "drop_retired_key"])
def test_close_waits_for_a_key_change_in_flight(tmp_path, monkeypatch, operation):
    """close() releases the store (its lock) once it returns: another process may open it and sign
    with the key it finds. A rotation (or a retired key's removal) still changing the key files
    then could let that process sign with the key being dropped. close() waits for it, as for a
    read: here close() finds it running and the key change goes on only once close() waits."""
    from mwpstore import authority as authority_module
    from mwpstore import snapshot as snapshot_module

    authority = open_with_group(str(tmp_path / "s"))
    if operation == "drop_retired_key":
        retired = authority.signing_key.key_id
        authority.rotate_signing_key()
    paused, go_on, finished = threading.Event(), threading.Event(), threading.Event()
    real_hit, real_fsync, real_sleep = snapshot_module.failpoints.hit, snapshot_module.fsync_directory, authority_module.time.sleep

    def pause() -> None:
        if threading.current_thread().name == "maintainer" and not paused.is_set():
            paused.set()
            assert go_on.wait(WAIT)

    def hit(name):
        if name == "keys.after_retire":
            pause()  # the old key retired, the new one not yet written
        return real_hit(name)

    def fsync_directory(directory):
        pause()  # the retired key's file removed, the removal not yet durable
        return real_fsync(directory)

    def sleep(seconds):
        if threading.current_thread().name == "closer":
            go_on.set()  # close() waits for what is in flight: let it finish
        return real_sleep(seconds)

    monkeypatch.setattr(snapshot_module.failpoints, "hit", hit)
    monkeypatch.setattr(snapshot_module, "fsync_directory", fsync_directory)
    monkeypatch.setattr(authority_module.time, "sleep", sleep)

    def maintain() -> None:
        try:
            if operation == "rotate_signing_key":
                authority.rotate_signing_key(retire=False)
            else:
                authority.drop_retired_key(retired)
        finally:
            finished.set()

    maintainer = threading.Thread(target=maintain, name="maintainer")
    maintainer.start()
    assert paused.wait(WAIT)
    closer = threading.Thread(target=authority.close, name="closer")
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive()
    closed_after_it = finished.is_set()
    go_on.set()  # unfixed: close() returned without waiting; let the key change end
    maintainer.join(WAIT)
    assert not maintainer.is_alive()
    monkeypatch.undo()
    assert closed_after_it
