"""An ``index/`` put back beside a log it does not reflect (docs/recovery.md, step 4): one copied
before a compaction switched the log, one of another store, one ahead of or behind its own log.
The writer's open rebuilds what belongs to another log or runs ahead of it and redoes what is
behind; a read-only view refuses the first two until a writer has opened the store; nothing
answers from another log's index or applies a redo onto it."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from authority_helpers import GROUP, OWNER, group_create, in_a_forked_child, mission_create, open_with_group
from mwpstore import Authority, Corruption, InvalidState
from mwpstore.cli import EXIT_OK, EXIT_STORE_ERROR, main

ARCHIVED = "g-9"


def _session(path, work, *, killed):
    """Open the store and run ``work(authority)``; then close it, or leave it as a kill does
    (a forked child that exits without closing: no clean marker, the index marked open)."""
    if killed:
        assert in_a_forked_child([lambda: work(Authority.open(path))]) == ["ok"]
    else:
        with Authority.open(path) as authority:
            work(authority)


def _copy_index(path, saved):
    """What a copy of ``index/`` taken now holds (its ``data.mdb``; LMDB makes its lock file)."""
    os.makedirs(saved)
    shutil.copy2(os.path.join(path, "index", "data.mdb"), os.path.join(saved, "data.mdb"))


def _put_back(path, saved):
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved, os.path.join(path, "index"))


def _take_index(path, saved, work, *, killed):
    """Run ``work`` in a session and copy the index at its end: while the store is open (as a
    kill leaves the index) or once it is closed cleanly."""

    def and_copy(authority):
        work(authority)
        if killed:
            _copy_index(path, saved)

    _session(path, and_copy, killed=killed)
    if not killed:
        _copy_index(path, saved)


def _missions(authority, names, group=GROUP):
    assert all(result.ok for result in authority.accept_many([mission_create(name, group=group) for name in names]))


@pytest.fixture(params=["same boot", "boot changed"])
def boot(request, monkeypatch):
    """The boot id of the sessions that write the store; the put-back index is opened after
    ``restart()``, which changes it in the second case."""
    monkeypatch.setenv("MWPSTORE_BOOT_ID", "boot-before")

    def restart():
        if request.param == "boot changed":
            monkeypatch.setenv("MWPSTORE_BOOT_ID", "boot-after")

    return restart


def _compacted_store(path, saved, *, killed):
    """A store given back the copy of its ``index/`` taken before an archive and a compaction
    switched the log; more commits followed, so the new log reaches past the copy's position.
    Returns what the store answers with its own index."""
    with open_with_group(path) as authority:
        authority.accept(group_create(ARCHIVED))
        _missions(authority, ["m-0", "m-1"], group=ARCHIVED)

    _take_index(path, saved, lambda authority: _missions(authority, ["m-2"]), killed=killed)

    def archive_and_compact(authority):
        authority.archive(ARCHIVED, actor=OWNER, action_id="archive")
        assert authority.compact().events_dropped > 0
        _missions(authority, [f"m-{i}" for i in range(3, 12)])

    _session(path, archive_and_compact, killed=killed)
    expected = _expected(path)
    _put_back(path, saved)
    return expected


def _answers(authority):
    return authority.head(GROUP), authority.read(GROUP), authority.archive_record(ARCHIVED)


def _expected(path):
    with Authority.open(path) as authority:
        return _answers(authority)


def _refused_by_a_view_and_rebuilt(path, expected, reason, *, killed=False):
    """A read-only view refuses the index put back; the writer's open rebuilds it (saying
    ``reason``, or that the machine restarted for a copy taken from a killed store when the boot
    changed and no log id tells first) and answers ``expected``; the rebuilt index verifies."""
    if killed and os.environ["MWPSTORE_BOOT_ID"] == "boot-after":
        reason = "restarted"
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed"
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild" and reason in authority.open_report.reason
        assert _answers(authority) == expected
        assert authority.verify().ok


@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
def test_an_index_from_before_a_compaction_is_rebuilt_from_the_new_log(tmp_path, boot, killed):
    path, saved = str(tmp_path / "store"), str(tmp_path / "saved")
    expected = _compacted_store(path, saved, killed=killed)
    boot()
    _refused_by_a_view_and_rebuilt(path, expected, "another log")
    with Authority.open(path) as authority:  # the rebuilt index names this log: trusted from now on
        assert authority.open_report.mode == "clean"


def test_a_view_and_the_commands_refuse_an_index_from_before_a_compaction_until_a_writer_rebuilds_it(tmp_path, boot, capsys):
    path, saved = str(tmp_path / "store"), str(tmp_path / "saved")
    expected = _compacted_store(path, saved, killed=False)
    boot()
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and "another log" in refused.value.message
    assert main(["tail", GROUP, "--store", path, "--json"]) == EXIT_STORE_ERROR
    assert "INVALID_STATE" in capsys.readouterr().err
    # inspect and verify open the store for writing: the open rebuilds the index, which verifies
    assert main(["inspect", "--store", path, "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["open"]["mode"] == "rebuild" and "another log" in info["open"]["reason"]
    assert info["groups"][GROUP]["seq"] == expected[0][0]
    assert main(["verify", "--store", path, "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["tail", GROUP, "--store", path, "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.splitlines()] == [event.seq for event in expected[1]]
    with Authority.open(path, readonly=True) as view:
        assert _answers(view) == expected


@pytest.mark.parametrize("same_positions", [True, False], ids=["same positions", "other positions"])
@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
def test_an_index_of_another_store_is_rebuilt_and_never_answers(tmp_path, boot, killed, same_positions):
    """The other store's Group has a name of the same length and the same Commands, so with as
    many of them every position it recorded is one in this log too."""
    path, other, saved = str(tmp_path / "store"), str(tmp_path / "other"), str(tmp_path / "saved")
    with open_with_group(path) as authority:
        _missions(authority, [f"m-{i}" for i in range(6)])
    with open_with_group(other, group="g-2"):
        pass
    count = 6 if same_positions else 3
    _take_index(other, saved, lambda authority: _missions(authority, [f"m-{i}" for i in range(count)], group="g-2"), killed=killed)
    expected = _expected(path)
    _put_back(path, saved)
    boot()
    _refused_by_a_view_and_rebuilt(path, expected, "another log")
    with Authority.open(path) as authority:
        assert authority.head("g-2")[0] == 0


def _copy_log(path, saved):
    shutil.copytree(os.path.join(path, "log"), saved, ignore=shutil.ignore_patterns("LOCK"))


def _restore_log(path, saved):
    shutil.rmtree(os.path.join(path, "log"))
    shutil.copytree(saved, os.path.join(path, "log"))


def _index_ahead_of_a_restored_log(path, tmp_path, *, killed):
    """A store whose log is put back from a copy older than the copy of its index returned."""
    old_log, saved = str(tmp_path / "old-log"), str(tmp_path / "saved")
    with open_with_group(path) as authority:
        _missions(authority, ["m-0", "m-1"])
    _copy_log(path, old_log)
    _take_index(path, saved, lambda authority: _missions(authority, [f"m-{i}" for i in range(2, 8)]), killed=killed)
    _restore_log(path, old_log)
    return saved


@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
def test_an_index_ahead_of_a_log_restored_from_an_older_copy_is_rebuilt(tmp_path, boot, killed):
    path = str(tmp_path / "store")
    saved = _index_ahead_of_a_restored_log(path, tmp_path, killed=killed)
    expected = _expected(path)
    assert expected[0][0] == 3
    _put_back(path, saved)
    boot()
    _refused_by_a_view_and_rebuilt(path, expected, "outside the log", killed=killed)


@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
def test_an_index_ahead_of_a_restored_log_that_grew_past_it_since_is_rebuilt(tmp_path, boot, killed):
    """The log, restored from an older copy, was opened (its index rebuilt) and has grown past
    the position of the index copy put back now, with other records: the same log id, and a
    position inside the log that no group of it ends at. The open used to redo from there
    (INVALID_COMMAND: not the start of a record), and a view to read the other history's positions."""
    path = str(tmp_path / "store")
    saved = _index_ahead_of_a_restored_log(path, tmp_path, killed=killed)
    _session(path, lambda authority: _missions(authority, [f"mission-{i}-of-the-new-history" for i in range(12)]), killed=killed)
    expected = _expected(path)
    _put_back(path, saved)
    boot()
    _refused_by_a_view_and_rebuilt(path, expected, "not where a group", killed=killed)


@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
def test_an_index_behind_its_log_is_redone_to_the_same_answers(tmp_path, boot, killed):
    path, saved = str(tmp_path / "store"), str(tmp_path / "saved")
    with open_with_group(path) as authority:
        _missions(authority, ["m-0"])
    _take_index(path, saved, lambda authority: _missions(authority, ["m-1"]), killed=killed)
    _session(path, lambda authority: _missions(authority, [f"m-{i}" for i in range(2, 9)]), killed=killed)
    expected = _expected(path)
    _put_back(path, saved)
    boot()
    with Authority.open(path) as authority:
        assert authority.open_report.mode in ("redo", "rebuild")  # rebuild: unclean, and the boot changed
        assert _answers(authority) == expected
        assert authority.verify().ok


def test_an_index_an_older_build_wrote_without_a_log_id_is_trusted_and_names_the_log_from_then_on(tmp_path):
    import lmdb

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        _missions(authority, ["m-0"])
        log_id = authority.log.log_id
    env = lmdb.open(os.path.join(path, "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        assert txn.delete(b"log_id", db=env.open_db(b"meta", txn=txn))
    env.close()
    with Authority.open(path, readonly=True) as view:  # served as before
        assert view.head(GROUP)[0] == 2
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "clean"
        with authority.index.begin() as txn:
            assert authority.index.get(txn, b"meta", b"log_id") == log_id.to_bytes(8, "big")


@pytest.mark.parametrize(
    "value", [b"", b"abc", b"\x07" * 9, b"\x02" * 16, b"\x01" * (1 << 20)], ids=["empty", "3 bytes", "9 bytes", "16 bytes", "1 MiB"]
)
def test_an_index_whose_log_id_is_no_u64_is_rebuilt_and_its_reason_shows_a_bounded_part_of_it(tmp_path, value):
    """``meta`` ``log_id`` is outside input: a value of another size than the u64 the engine
    writes names no log, so the view refuses and the writer rebuilds; the reason quotes at most
    16 bytes of it (a 1 MiB value made a reason and an error message of 2 MiB)."""
    from mwpstore.index import Index

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        _missions(authority, ["m-0"])
    expected = _expected(path)
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.begin(write=True) as txn:
        index.put(txn, b"meta", b"log_id", value)
    index.close()
    with pytest.raises(InvalidState) as refused:
        Authority.open(path, readonly=True)
    assert refused.value.detail["reason"] == "recovery_needed" and len(str(refused.value)) < 400
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild" and "another log" in authority.open_report.reason
        assert len(authority.open_report.reason) < 200
        if len(value) <= 16:  # shown whole
            assert f"log id {value.hex()}, the log's" in authority.open_report.reason
        assert _answers(authority) == expected


def test_the_index_a_rebuild_or_a_compaction_builds_names_its_log_before_any_reopen(tmp_path):
    """rebuild() and compact() give the index they build the log's id themselves (the open's write
    comes only at the next open): a copy of ``index/`` taken from the running store after either
    names its log, and one put back after the compaction is rebuilt for the log id it names."""
    path, saved = str(tmp_path / "store"), str(tmp_path / "saved")

    def log_id_of_index(authority):
        with authority.index.begin() as txn:
            return bytes(authority.index.get(txn, b"meta", b"log_id"))

    with open_with_group(path) as authority:
        authority.accept(group_create(ARCHIVED))
        _missions(authority, ["m-0"], group=ARCHIVED)
        authority.archive(ARCHIVED, actor=OWNER, action_id="archive")
        old = authority.log.log_id
        authority.rebuild()
        assert log_id_of_index(authority) == old.to_bytes(8, "big")
        _copy_index(path, saved)
        authority.compact()
        new = authority.log.log_id
        assert new != old and log_id_of_index(authority) == new.to_bytes(8, "big")
    expected = _expected(path)
    _put_back(path, saved)
    _refused_by_a_view_and_rebuilt(path, expected, f"the index belongs to another log (log id {old}, the log's is {new})")


def _meta(**entries):
    """A change of the closed store's index ``meta``: each entry put, or deleted when None."""

    def change(path, log):
        from mwpstore.index import Index

        index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
        try:
            with index.begin(write=True) as txn:
                for key, value in entries.items():
                    value = value(log) if callable(value) else value
                    if value is None:
                        txn.delete(key.encode(), db=index.dbs[b"meta"])
                    else:
                        index.put(txn, b"meta", key.encode(), value)
        finally:
            index.close()

    return change


def _u64(value):
    return value.to_bytes(8, "big")


# (meta changed, what a view does, the writer's open mode, a part of its reason). A view refuses
# (recovery_needed) with the writer's own reason where the judgement is _untrusted_index's.
_JUDGED = {
    "as closed": (_meta(), "serves", "clean", "index trusted"),
    "no log id (an older build)": (_meta(log_id=None), "serves", "clean", "index trusted"),
    "another log's id": (_meta(log_id=lambda log: _u64(log["id"] + 1)), "refuses", "rebuild", "the index belongs to another log"),
    "an outsized log id": (_meta(log_id=b"\x01" * (1 << 20)), "refuses", "rebuild", "the index belongs to another log"),
    "a position inside a group": (_meta(log_position=lambda log: _u64(log["inside"])), "refuses", "rebuild", "is not where a group of the log ends"),
    "a position past the log's end": (_meta(log_position=lambda log: _u64(log["end"] + 8)), "refuses", "rebuild", "is outside the log"),
    "not clean, another boot": (_meta(boot_id=b"other-boot", clean=b"0"), "restarted", "rebuild", "the machine restarted"),
    "clean, another boot": (_meta(boot_id=b"other-boot", clean=b"1"), "serves", "clean", "index trusted"),
    "another log's id, not clean, another boot": (
        _meta(log_id=lambda log: _u64(log["id"] + 1), boot_id=b"other-boot", clean=b"0"), "restarted", "rebuild", "another log"),
    "another format": (_meta(format=b"4"), "another format", "rebuild", "index format differs"),
    "a log position of 3 bytes": (_meta(log_position=b"abc"), "damage", "rebuild", "log_position is 3 bytes"),
    "a log position of 9 bytes": (_meta(log_position=b"\x00" * 9), "damage", "rebuild", "log_position is 9 bytes"),
    "no log position": (_meta(log_position=None), "damage", "rebuild", "has no log_position"),
    "a last time of 2 bytes": (_meta(last_ms=b"ab"), "serves", "rebuild", "last_ms is 2 bytes"),
}


@pytest.mark.parametrize("case", list(_JUDGED))
def test_the_writer_and_a_view_judge_each_changed_index_alike(tmp_path, monkeypatch, case):
    """One store per case, its closed index's ``meta`` changed; a read-only view opens it first
    (it writes nothing), then the writer. The view serves exactly what the writer trusts or
    redoes, and refuses the rest; where both judge by ``_untrusted_index`` they give one reason.
    A ``meta`` value of the wrong size is damage (CORRUPTION) for the view and an unreadable
    index for the writer: it was a bare ``struct.error`` from both, or a view served an index
    without a position as if it were at 0 (and the writer's redo from 0 failed on the chain)."""
    monkeypatch.setenv("MWPSTORE_BOOT_ID", "boot-here")
    change, view_does, mode, reason = _JUDGED[case]
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        _missions(authority, ["m-0"])
        group_end = authority.log.end
        _missions(authority, ["m-1", "m-2", "m-3"])  # one group of three records
        [batch] = authority.log.scan(group_end)
        log = {"id": authority.log.log_id, "end": authority.log.end, "inside": batch.positions[1]}
    expected = _expected(path)
    change(path, log)
    if view_does == "serves":
        with Authority.open(path, readonly=True) as view:
            assert view.head(GROUP) == expected[0]  # an index behind its log: the test above
    else:
        error = InvalidState if view_does != "damage" else Corruption
        with pytest.raises(error) as refused:
            Authority.open(path, readonly=True)
        assert len(str(refused.value)) < 400
        if view_does == "damage":
            assert refused.value.detail["reason"] == "index" and reason in refused.value.message
        else:
            assert refused.value.detail["reason"] == "recovery_needed"
            assert {"refuses": reason, "restarted": "not closed cleanly", "another format": "another format"}[view_does] in refused.value.message
    with Authority.open(path) as authority:
        assert authority.open_report.mode == mode and reason in authority.open_report.reason
        assert len(authority.open_report.reason) < 200
        assert _answers(authority) == expected
        assert authority.verify().ok
