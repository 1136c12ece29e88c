"""Rules of ``Authority.verify`` (each check reports its own kind of damage), ``rebuild``, the
``lease.expire`` sweep, ``ack``/``acked`` and subscriptions, pinned by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import msgspec
import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group, rewrite_log_records, store_with_one_event_rewritten
from mwpstore import Authority, Command, InvalidCommand, StorageFailed
from mwpstore.audit_log import FileKeyProvider
from mwpstore.cli import EXIT_OK, main
from mwpstore.index import state_key
from mwpstore.messages import recompute_event_hash
from test_lifecycle_rules import _run_child as run_lifecycle_child
from test_work_model_durable import DurableHarness
from work_model_support import CONTRACT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- verify: each check names the damage it exists for ---------------------------------------------


def test_verify_names_a_sequence_that_skips_even_where_the_link_to_the_previous_event_holds(tmp_path):
    """The last Event rewritten with its sequence moved on (its link and its own hash made right
    again): only the sequence check sees that the Group skips one."""

    def skip_one(event):
        event = msgspec.structs.replace(event, seq=event.seq + 2)
        return msgspec.structs.replace(event, hash=recompute_event_hash(event))

    path, records = store_with_one_event_rewritten(tmp_path, 2, skip_one)  # seq 3 is the last Event
    with Authority.open(path) as authority:
        report = authority.verify()
    assert f"chain break in group {GROUP} at seq 5 (position {records[-1][0]})" in report.problems, report.problems


def test_verify_names_a_payload_that_no_longer_matches_its_payload_hash(tmp_path):
    """A body changed in the log with its payload hash (and so the chain) left as it was: the chain
    commits to the payload hash only, so only hashing the body again shows it."""

    def change_body_only(event):
        body = dict(event.body or {})
        body["title"] = "x" * len(body["title"])  # the same length: every later position stays
        return msgspec.structs.replace(event, body=body)

    path, _ = store_with_one_event_rewritten(tmp_path, 3, change_body_only)
    with Authority.open(path) as authority:
        report = authority.verify()
    assert f"payload hash mismatch in group {GROUP} at seq 3" in report.problems, report.problems
    assert not any(problem.startswith(("chain break", "hash mismatch")) for problem in report.problems), report.problems


def test_verify_counts_every_record_every_event_and_every_group(tmp_path):
    """``records`` counts the log's records of every kind (ACKs and snapshot references too),
    ``events`` only the Events, ``groups`` the Groups whose chains it walked."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(group_create("g-2"))
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])
        authority.ack("agent-1", GROUP, 2)
        authority.ack("agent-1", GROUP, 4)
        authority.snapshot(GROUP)
        report = authority.verify()
    assert report.ok, report.problems
    assert (report.records, report.events, report.groups) == (8, 5, 2)


def test_verify_reports_a_frame_that_fails_its_checksum_once_and_stops_there(tmp_path):
    """A byte of a committed record flipped under the open store: the scan's ``CORRUPTION`` is the
    report's one problem (nothing past it can be trusted, so no rebuild is compared)."""
    with open_with_group(str(tmp_path / "s")) as authority:
        for number in range(3):
            authority.accept(mission_create(f"m-{number}"))
        (segment,) = authority.log.segments()
        with open(segment.path, "r+b") as handle:
            data = handle.read()
            offset = data.index(b"mission m-1")
            handle.seek(offset)
            handle.write(b"M")
        report = authority.verify()
    assert len(report.problems) == 1 and report.problems[0].startswith("CORRUPTION: "), report.problems


def test_verify_reports_a_log_record_that_a_rebuild_cannot_index(tmp_path):
    """A record of an unknown tag (the ACK's tag byte changed) is no Event, so the chain walk
    passes it by; the index a rebuild would make from the log is what cannot be made, and the
    report says so."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.ack("agent-1", GROUP, 2)
    rewrite_log_records(path, lambda position, record: b"Z" + record[1:] if record[:1] == b"A" else record)
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "clean"  # the index does not look at the log's records
        report = authority.verify()
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith("rebuilding an index from the log to compare: CORRUPTION: "), report.problems


def _store_with_a_payload_compacted_away(path: str) -> tuple[Authority, int]:
    """An open store whose Event (returned: its sequence) was redacted and its payload removed from
    the log by compaction."""
    authority = open_with_group(path)
    authority.accept(Command(actor=OWNER, action_id="open", group=GROUP, kind="mission.create", target="m-s", body={"title": "t", "cost_limit": 1}))
    secret = authority.accept(Command(actor=OWNER, action_id="secret", group=GROUP, kind="mission.close", target="m-s", body={"reason": "s3cret"}))
    authority.accept(mission_create("m-after"))
    authority.redact(GROUP, secret.seq, actor=OWNER, action_id="redact", reason="legal")
    authority.compact()
    assert authority.read(GROUP)[secret.seq - 1].body is None
    return authority, secret.seq


def test_verify_accepts_a_payload_its_own_tombstone_accounts_for(tmp_path):
    authority, _ = _store_with_a_payload_compacted_away(str(tmp_path / "s"))
    with authority:
        report = authority.verify()
    assert report.ok, report.problems


def test_verify_says_why_it_could_not_look_a_tombstone_up(tmp_path):
    """The tombstone's index entry damaged: the lookup's ``CORRUPTION`` is listed for the payload
    it had to account for, beside the comparison's finding."""
    authority, seq = _store_with_a_payload_compacted_away(str(tmp_path / "s"))
    with authority:
        with authority.index.env.begin(write=True) as txn:  # no longer matches its seal
            txn.put(state_key(GROUP, f"tombstone:{seq}"), b"\x00" * 40, db=authority.index.dbs[b"states"])
        problems = authority.verify().problems
    assert any(problem.startswith("looking up tombstones: CORRUPTION: ") for problem in problems), problems


def test_verify_says_why_it_could_not_list_the_snapshots(tmp_path):
    """A snapshot reference's index entry damaged: listing the files to check fails, and the report
    says so (beside the comparison's finding) instead of leaving the files unmentioned."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.snapshot(GROUP)
        index = authority.index
        ((key, _),) = list(index.iterate(b"snapshots"))
        with index.env.begin(write=True) as txn:  # no longer matches its seal
            txn.put(key, b"\x00" * 40, db=index.dbs[b"snapshots"])
        problems = authority.verify().problems
    assert any(problem.startswith("listing snapshots and audit logs: CORRUPTION: ") for problem in problems), problems


def test_verify_checks_audit_logs_with_the_key_provider_it_is_given(tmp_path):
    """An audit log written with an Organization key kept outside the store verifies with that
    provider, and only with it."""
    provider = FileKeyProvider(str(tmp_path / "keys-elsewhere"))
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        record = authority.archive(GROUP, actor=OWNER, action_id="archive", key_provider=provider)
        assert authority.verify(key_provider=provider).ok
        problems = authority.verify().problems  # the store's own key directory lacks the key
    assert len(problems) == 1 and problems[0].startswith(f"audit log {record.audit_location}: "), problems


def test_verify_reports_a_key_provider_that_raises_as_a_typed_problem_of_the_audit_log(tmp_path):
    """A provider whose key_for raises (its key store unreachable) leaves the audit log unchecked:
    verify says so for that file, as INVALID_COMMAND naming the provider's call, and returns its
    report instead of letting the provider's own exception out."""
    provider = FileKeyProvider(str(tmp_path / "keys-elsewhere"))

    class Unreachable:
        def key_for(self, org, key_id):
            raise ConnectionError("kms unreachable")

    with open_with_group(str(tmp_path / "s")) as authority:
        record = authority.archive(GROUP, actor=OWNER, action_id="archive", key_provider=provider)
        problems = authority.verify(key_provider=Unreachable()).problems
        assert authority.verify(key_provider=provider).ok
    assert problems == [
        f"audit log {record.audit_location}: INVALID_COMMAND the key provider's key_for raised ConnectionError: kms unreachable"
    ]


def test_verify_reports_a_snapshot_file_that_is_not_the_one_its_reference_names(tmp_path):
    """One signed, valid snapshot file put in place of another of the same Group: its signature
    holds, only the reference's size and hash show the swap."""
    with open_with_group(str(tmp_path / "s")) as authority:
        first = authority.snapshot(GROUP)
        authority.accept(mission_create("m-1"))
        second = authority.snapshot(GROUP)
        replaced = os.path.join(authority.path, first.location)
        os.chmod(replaced, 0o600)
        shutil.copyfile(os.path.join(authority.path, second.location), replaced)
        problems = authority.verify().problems
    assert len(problems) == 1, problems
    assert problems[0].startswith((f"snapshot {first.location}: SNAPSHOT_INVALID (size)", f"snapshot {first.location}: SNAPSHOT_INVALID (hash)")), problems


def test_verify_names_a_missing_snapshot_file_by_its_code_with_no_empty_check(tmp_path):
    """A problem line gives the error's ``check`` in parentheses only when the error has one: a
    missing snapshot file is a read failure (``STORAGE_FAILED``), with no check to name."""
    with open_with_group(str(tmp_path / "s")) as authority:
        ref = authority.snapshot(GROUP)
        os.remove(os.path.join(authority.path, ref.location))
        problems = authority.verify().problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"snapshot {ref.location}: STORAGE_FAILED "), problems
    assert "()" not in problems[0]


def test_verify_checks_the_audit_log_of_every_archived_group_after_one_never_archived(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:  # g-1 sorts first and is not archived
        authority.accept(group_create("g-2"))
        authority.accept(mission_create("m-1", group="g-2"))
        record = authority.archive("g-2", actor=OWNER, action_id="archive")
        assert authority.verify().ok
        os.remove(os.path.join(authority.path, record.audit_location))
        problems = authority.verify().problems
    assert problems == [f"audit log {record.audit_location}: missing (no accepted audit.delete explains it)"]


def test_verify_takes_an_accepted_audit_delete_for_the_audit_log_it_removed(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        record = authority.archive(GROUP, actor=OWNER, action_id="archive")
        authority.delete_audit_log(GROUP, actor=OWNER, action_id="delete", basis="legal")
        assert not os.path.exists(os.path.join(authority.path, record.audit_location))
        report = authority.verify()
    assert report.ok, report.problems


# -- the command line's verify --------------------------------------------------------------------


def test_the_verify_command_prints_the_counts_verify_made(tmp_path, capsys):
    """An ACK is a record and no Event: the command's ``events`` is verify's, not ``records``."""
    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        authority.ack("agent-1", GROUP, 2)
    assert main(["verify", "--store", path, "--json"]) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    assert (document["ok"], document["records"], document["events"], document["groups"], document["problems"]) == (True, 3, 2, 1, [])
    assert main(["verify", "--store", path]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[0] == "records 3, events 2, groups 1"


# -- the lease sweep ------------------------------------------------------------------------------


def test_the_sweep_passes_over_a_lease_the_engine_clock_finds_live_and_expires_the_next(tmp_path):
    """``now_ms`` chooses the leases to try; each ``lease.expire`` is still decided at the engine's
    time, so one that is live then is refused and the sweep goes on to the next WorkItem."""
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    h.claim("w2", "wi2")
    h.advance(CONTRACT["start_ms"])  # wi2's lease missed its start
    late = h.claim("w1", "wi1")  # wi1's lease is live at the engine's time
    receipts = h.authority.expire_leases(h.group_id, now_ms=late["start_by_ms"])  # both lapsed by now_ms
    assert [receipt.aggregate for receipt in receipts] == ["workitem:wi2"]
    assert h.item("wi1")["lease"] == late and h.item("wi2")["lease"] is None
    h.close()


def test_the_sweep_commits_its_events_together_and_sends_what_meets_a_full_commit_into_the_next(tmp_path, monkeypatch):
    """The sweep committed each lease.expire on its own: one log append (one fdatasync) per lapsed
    lease. Its Commands now go in together, as accept_many takes them; with a commit bound that
    holds two of them, the rest go into later commits, and every lease is expired once, in the
    order of its WorkItem, under its stable Action ID."""
    from mwpstore import authority as authority_module, limits

    workitems = tuple(f"wi{i}" for i in range(6))
    sizes: list[int] = []
    add_record = authority_module._Batch.add_record

    def spy(batch, record: bytes, framed: int) -> None:
        sizes.append(len(record))
        add_record(batch, record, framed)

    def sweep(name: str, group_bytes_max: int) -> int:
        h = DurableHarness(tmp_path / name)
        h.setup(workitems=workitems)
        leases = [h.claim("w1", workitem)["lease_id"] for workitem in workitems]
        h.advance(CONTRACT["start_ms"])  # none started: every lease lapsed
        appends = []
        append = h.authority.log.append
        monkeypatch.setattr(h.authority.log, "append", lambda records: appends.append(len(records)) or append(records))
        monkeypatch.setattr(authority_module._Batch, "add_record", spy)
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", group_bytes_max)
        receipts = h.authority.expire_leases(h.group_id)
        monkeypatch.undo()
        assert [receipt.aggregate for receipt in receipts] == [f"workitem:{workitem}" for workitem in workitems]
        events = h.events()[-len(workitems):]
        assert [(event.kind, event.action_id) for event in events] == [("lease.expire", f"expire.{lease}") for lease in leases]
        assert all(h.item(workitem)["lease"] is None for workitem in workitems)
        assert h.authority.expire_leases(h.group_id) == []
        h.close()
        return len(appends)

    assert sweep("one-commit", limits.GROUP_BYTES_MAX) == 1
    record = max(sizes)
    assert len(sizes) == len(workitems) and min(sizes) > record * 3 // 4
    assert sweep("two-per-commit", 2 * record + record // 2) == 3


# -- subscriptions --------------------------------------------------------------------------------


def test_a_poll_hands_back_every_event_waiting_at_once(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
        subscription = authority.subscribe(GROUP, after=2)
        assert [event.seq for event in subscription.poll(timeout=0)] == [3, 4, 5, 6]
        assert subscription.cursor == 6 and subscription.poll(timeout=0) == []


# -- verify compares every database of the index ------------------------------------------------------


@pytest.mark.parametrize("database", ["events", "heads", "states", "receipts", "acks", "snapshots", "archives", "presence"])
def test_verify_finds_an_entry_lost_from_any_database_of_the_index(tmp_path, database):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        authority.ack("agent-1", GROUP, 2)
        authority.snapshot(GROUP)
        authority.accept(group_create("g-2"))
        authority.archive("g-2", actor=OWNER, action_id="archive")
        assert authority.verify().ok
        index = authority.index
        key = next(key for key, _ in index.iterate(database.encode()))
        with index.env.begin(write=True) as txn:
            if database == "presence":
                txn.delete(key, db=index.dbs[b"presence"])
            else:
                assert index.delete(txn, database.encode(), key)
        problems = authority.verify().problems
    assert any(problem.startswith(f"index database {database} differs from a rebuild") for problem in problems), problems


def test_the_sweep_leaves_the_lapsed_leases_of_an_archived_group_alone(tmp_path):
    """An archived Group takes no Command, the engine's own included: its sweep expires nothing
    and raises nothing (``GROUP_ARCHIVED`` is one more reason a lapsed lease is not expired)."""
    h = DurableHarness(tmp_path / "store")
    h.setup()
    lease = h.claim("w1", "wi1")
    h.accept("owner", "group.archive", h.group_id, {"reason": "done"})
    h.advance(CONTRACT["start_ms"])  # the lease missed its start
    head = h.authority.head(h.group_id)
    assert h.authority.expire_leases(h.group_id) == []
    assert h.authority.head(h.group_id) == head and h.item("wi1")["lease"] == lease
    h.close()


def _scratch_indexes(path: str) -> list[str]:
    return [name for name in os.listdir(path) if name.startswith("index.verify-")]


def test_verify_leaves_no_scratch_index_behind(tmp_path):
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        assert authority.verify().ok
        assert _scratch_indexes(authority.path) == []
        with authority.index.env.begin(write=True) as txn:  # a verify that finds a difference, too
            authority.index.put(txn, b"states", state_key(GROUP, "mission:m-1"), b"\x01")
        assert not authority.verify().ok
        assert _scratch_indexes(authority.path) == []


def test_verify_of_a_store_without_snapshots_creates_no_signing_key(tmp_path):
    """A check writes nothing it was not asked to: with no snapshot or audit log to verify, no
    key is needed, and ``keys/`` is not created. With a snapshot, the store's key verifies it."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept(mission_create("m-1"))
        assert authority.verify().ok
        assert not os.path.exists(os.path.join(authority.path, "keys"))
        authority.snapshot(GROUP)
        assert authority.verify().ok


def test_verify_names_a_database_that_differs_once_at_its_first_differing_key(tmp_path):
    """The report stays as short as the damage is wide: one problem for a database, however many
    of its entries differ."""
    with open_with_group(str(tmp_path / "s")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])
        with authority.index.env.begin(write=True) as txn:
            for number in range(3):
                authority.index.put(txn, b"states", state_key(GROUP, f"mission:m-{number}"), b"\x01")
        problems = authority.verify().problems
    first = state_key(GROUP, "mission:m-0")
    assert problems == [f"index database states differs from a rebuild from the log at key {first!r}"]


def test_a_scratch_index_that_cannot_be_opened_is_removed_and_ends_verify_as_storage_failed(tmp_path, monkeypatch):
    """The check could not run: ``StorageFailed`` out of verify, never a problem listed against
    the store (``mwpstore verify`` would call the store damaged, exit 1)."""
    from mwpstore import authority as authority_module

    real = authority_module.Index

    def failing(directory, **kwargs):
        if os.path.basename(directory).startswith("index.verify-"):
            raise StorageFailed("the scratch index cannot be opened")
        return real(directory, **kwargs)

    with open_with_group(str(tmp_path / "s")) as authority:
        monkeypatch.setattr(authority_module, "Index", failing)
        with pytest.raises(StorageFailed, match="the scratch index cannot be opened"):
            authority.verify()
        assert _scratch_indexes(authority.path) == []


@pytest.mark.parametrize("failure", ["writing the scratch index", "reading the index file", "removing the scratch index"])
def test_verify_tells_a_failure_of_its_own_work_from_a_problem_of_the_store(tmp_path, monkeypatch, failure):
    """A failure of verify's own work says nothing about the store: an LMDB error writing its
    scratch index, or an I/O failure reading the index file for the structural check, ends it as
    ``StorageFailed`` (not a foreign error, not a problem listed); a scratch index it cannot remove
    afterwards is left to the next open, and the report stands."""
    import lmdb

    from mwpstore import authority as authority_module

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise StorageFailed("no file descriptor left")

    path = str(tmp_path / "s")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        if failure == "writing the scratch index":
            real = authority_module.Index

            def scratch_unwritable(directory, **kwargs):  # type: ignore[no-untyped-def]
                index = real(directory, **kwargs)
                if os.path.basename(directory).startswith("index.verify-"):
                    def put(*args, **kwargs):  # type: ignore[no-untyped-def]
                        raise lmdb.Error("mdb_put: Input/output error")

                    index.put = put
                return index

            monkeypatch.setattr(authority_module, "Index", scratch_unwritable)
        elif failure == "reading the index file":
            monkeypatch.setattr(authority_module, "check_lmdb_file", refused)
        else:
            real_remove = authority_module.remove_index
            monkeypatch.setattr(authority_module, "remove_index", lambda directory: refused() if "index.verify-" in directory else real_remove(directory))
        if failure == "removing the scratch index":
            assert authority.verify().ok
            assert len(_scratch_indexes(path)) == 1
        else:
            with pytest.raises(StorageFailed):
                authority.verify()
        monkeypatch.undo()
    with Authority.open(path) as reopened:
        assert _scratch_indexes(path) == [] and reopened.verify().ok


def test_rebuild_reports_its_progress_as_it_goes_and_ends_at_the_whole_log(tmp_path, monkeypatch):
    from mwpstore import authority as authority_module

    monkeypatch.setattr(authority_module, "REDO_COMMIT_RECORDS", 2)  # a commit after every scan batch
    with open_with_group(str(tmp_path / "s")) as authority:
        for first in range(0, 4500, 500):  # more records than one scan batch holds (4096)
            authority.accept_many([mission_create(f"m-{number}") for number in range(first, first + 500)])
        total = authority.log.end
        calls: list[tuple[int, int]] = []
        assert authority.rebuild(progress=lambda done, whole: calls.append((done, whole))) == 4501
    assert len(calls) > 2 and calls[-1] == (total, total), calls
    assert all(whole == total for _, whole in calls) and [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert calls[0][0] < total


def index_directories(path: str) -> list[str]:
    """The store's entries named index*: the index in use and what a rebuild leaves beside it."""
    return sorted(name for name in os.listdir(path) if name.startswith("index"))


def keeps_working_after_a_failed_rebuild(path: str, authority: Authority, left: list[str]) -> None:
    """After a rebuild() that failed: ``left`` are the index directories in place; the handle
    accepts, verifies and rebuilds (which leaves index/ alone), and the store reopens clean."""
    assert index_directories(path) == left
    authority.accept(mission_create("m-1"))
    assert authority.verify().ok and authority.rebuild() == 2
    assert index_directories(path) == ["index"]
    authority.close()
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "clean" and reopened.head(GROUP)[0] == 2


@pytest.mark.parametrize("failure", ["while it builds", "at its first rename", "between its renames"])
def test_a_failed_rebuild_undoes_its_work_and_the_handle_keeps_its_index(tmp_path, monkeypatch, failure):
    """A rebuild() that failed left its copy in index.rebuild/ until the next rebuild or open,
    against docs/api.md ("after the call has undone its partial work"); failing between its two
    renames it also left no index/ (the index in use only under index.old/), and the handle's
    verify() failed to find it. The copy goes, the index in use is put back under its name, and
    the handle keeps accepting, verifying and rebuilding."""
    import errno

    path = str(tmp_path / "store")
    real_rename = os.rename

    def rename(source, target, *args, **kwargs):
        moving_the_live_index = failure == "at its first rename" and target.endswith("index.old")
        if moving_the_live_index or (failure == "between its renames" and source.endswith("index.rebuild")):
            raise OSError(errno.EIO, "injected")
        return real_rename(source, target, *args, **kwargs)

    def progress(done: int, total: int) -> None:
        raise OSError(errno.EIO, "injected")

    with open_with_group(path) as authority:
        if failure == "while it builds":
            with pytest.raises(InvalidCommand):
                authority.rebuild(progress=progress)
        else:
            monkeypatch.setattr(os, "rename", rename)
            with pytest.raises(StorageFailed):
                authority.rebuild()
            monkeypatch.undo()
        keeps_working_after_a_failed_rebuild(path, authority, ["index"])


@pytest.mark.parametrize("failure", ["syncing the directory", "switching to the copy"])
def test_a_rebuild_failing_after_its_renames_puts_the_index_in_use_back_and_can_run_again(tmp_path, monkeypatch, failure):
    """A failure after both renames (the directory's sync, or the switch to the new index) left
    the copy, not in use, under index/, and the index the handle kept writing to under
    index.old/: the next open deleted that one and rebuilt, and every later rebuild() of the
    handle failed (ENOTEMPTY renaming index/ over index.old/). The index in use is put back, the
    copy goes, and the handle keeps accepting, verifying and rebuilding."""
    import errno

    from mwpstore import authority as authority_module

    path = str(tmp_path / "store")

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "injected")

    with open_with_group(path) as authority:
        if failure == "syncing the directory":
            monkeypatch.setattr(authority_module, "_fsync_directory", fail)
        else:
            monkeypatch.setattr(authority, "_install_index", fail)
        with pytest.raises(StorageFailed):
            authority.rebuild()
        monkeypatch.undo()
        keeps_working_after_a_failed_rebuild(path, authority, ["index"])


def test_a_rebuild_whose_removal_of_the_replaced_index_fails_leaves_it_to_the_next_rebuild(tmp_path, monkeypatch):
    """The replaced index's removal comes after the switch: its failure leaves the handle on the
    complete new index, and the next rebuild removes the leftover before it begins."""
    import errno

    from mwpstore import authority as authority_module

    path = str(tmp_path / "store")
    real_remove = authority_module.remove_index

    def remove(directory: str) -> None:
        if directory.endswith("index.old") and os.path.isdir(directory):
            raise StorageFailed("injected", errno=errno.EIO)
        real_remove(directory)

    with open_with_group(path) as authority:
        monkeypatch.setattr(authority_module, "remove_index", remove)
        assert authority.rebuild() == 1
        monkeypatch.undo()
        keeps_working_after_a_failed_rebuild(path, authority, ["index", "index.old"])


CHILD_REBUILD = """
import sys
from mwpstore import Authority, authority as authority_module
authority_module.REDO_COMMIT_RECORDS = 2  # a commit, and the fail point, every two records
with Authority.open(sys.argv[1]) as authority:
    authority.rebuild()
"""


def test_a_store_whose_rebuild_was_killed_opens_without_the_copy_and_verifies(tmp_path):
    """A rebuild killed midway leaves its half-built copy in index.rebuild/: the next open removes
    it, trusts the index in use, and the store verifies."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(6)])
    env = dict(os.environ, PYTHONPATH=REPO, MWPSTORE_FAILPOINT="authority.mid_rebuild")
    result = subprocess.run([sys.executable, "-c", CHILD_REBUILD, path], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert os.path.isdir(os.path.join(path, "index.rebuild"))
    with Authority.open(path) as authority:
        assert sorted(name for name in os.listdir(path) if name.startswith("index")) == ["index"]
        assert authority.open_report.mode == "clean" and authority.head(GROUP)[0] == 7
        assert authority.verify().ok


def test_an_index_a_rebuild_put_in_place_is_not_clean_until_close(tmp_path, monkeypatch):
    """rebuild() installs its index marked not clean, as open() marks the one it opens: lost with
    the machine after a rebuild (no close), the store is rebuilt on the next boot, not trusted on
    the strength of the clean close before."""
    path = str(tmp_path / "store")
    result = run_lifecycle_child(path, "a.close()", {"MWPSTORE_BOOT_ID": "boot-1"})
    assert result.returncode == 0, result.stderr
    result = run_lifecycle_child(path, "a.rebuild()\nos._exit(0)", {"MWPSTORE_BOOT_ID": "boot-1"})  # no close
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("MWPSTORE_BOOT_ID", "boot-2")
    with Authority.open(path) as authority:
        assert (authority.open_report.mode, authority.head(GROUP)[0]) == ("rebuild", 7)


@pytest.mark.parametrize("archived", [True, False], ids=["with an audit log", "without one"])
@pytest.mark.parametrize("provider", [object(), 5, "keys/orgs", 0], ids=repr)
def test_a_key_provider_that_is_no_provider_is_an_invalid_command_before_verify_runs(tmp_path, archived, provider):
    """verify(key_provider=) takes a provider as archive() does (docs/api.md): an object without
    key_for is InvalidCommand naming key_provider, as archive refuses it, not an AttributeError
    (an error that leaves the API is an MwpError), and whether or not an audit log needs it."""
    import mwpstore

    with open_with_group(str(tmp_path / "store")) as authority:
        if archived:
            authority.archive(GROUP, actor=OWNER, action_id="archive")
        with pytest.raises(mwpstore.InvalidCommand) as refused:
            authority.verify(key_provider=provider)
        assert refused.value.detail["field"] == "key_provider"
        assert not [name for name in os.listdir(authority.path) if name.startswith("index.verify")]
        assert authority.verify().ok
