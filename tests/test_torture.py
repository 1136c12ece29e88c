"""Short runs of the reliability suites (``mwpstore torture``), and proof that their checks bite.

Each suite's short run asserts iterations > 0 and no violation. The long runs and their figures
are in ``docs/reliability.md``. ``MWPSTORE_KILLS`` and ``MWPSTORE_POWER_LOSS_STATES`` lengthen the
crash and power runs here, e.g. ``MWPSTORE_POWER_LOSS_STATES=100000 python -m pytest
tests/test_torture.py -k power``.

Known engine bugs found by the suites are pinned by ``xfail(strict=False)`` tests (remove the
marker once fixed): the LMDB families of the corruption suite are run separately for that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mwpstore import torture
from mwpstore._segment_log_c import lib
from mwpstore.agent_store import AgentStore
from mwpstore.authority import Authority
from mwpstore.delivery import Delivery
from mwpstore.segment_log import SegmentLog

SL_SEGMENT_HEADER_BYTES = lib.SL_SEGMENT_HEADER_BYTES
def _assert_clean(result: dict) -> None:
    assert result["iterations"] > 0
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:5])


def test_crash_short_run():
    kills = int(os.environ.get("MWPSTORE_KILLS", "10"))
    result = torture.run_crash(count=kills, seed=1)
    _assert_clean(result)
    assert result["details"]["acknowledged_results"] > kills  # the children did real work


def test_power_short_run():
    states = int(os.environ.get("MWPSTORE_POWER_LOSS_STATES", "300"))
    result = torture.run_power(count=states, seed=1, verify_every=1 if states <= 1000 else 10)
    _assert_clean(result)
    assert result["details"]["losses_during_recovery"] > 0
    assert set(result["details"]["index_after_loss"]) >= {"deleted", "last_synced_image"}
    assert result["details"]["bulk_mode_states"] > 0  # the second workload runs with sync=False


def test_the_power_suite_catches_a_bulk_mode_writer_that_leaves_no_mark(monkeypatch):
    """In bulk mode a later group may reach the disk before an earlier one; only the BULK file
    tells the next open to cut there instead of refusing the log. Without it the suite's bulk-mode
    crash states fail to open, and without a working sync() promised results are lost."""
    monkeypatch.setattr(SegmentLog, "_mark_bulk", lambda self: setattr(self, "_bulk_written", True))
    monkeypatch.setattr(SegmentLog, "_unmark_bulk", lambda self: setattr(self, "_bulk_written", False))
    result = torture.run_power(count=500, seed=7)
    assert result["violations"] > 0
    assert all("bulk mode" in message and "group_damaged" in message
               for message in result["details"]["violation_messages"])
    monkeypatch.undo()
    monkeypatch.setattr(Authority, "sync", lambda self: None)
    result = torture.run_power(count=500, seed=7)
    assert any("is lost" in message and "bulk mode" in message for message in result["details"]["violation_messages"])


def test_corruption_short_run_of_the_log_snapshot_and_audit_families():
    families = tuple(family for family in torture.CORRUPTION_FAMILIES if not family.endswith("lmdb_flip"))
    result = torture.run_corruption(count=600, seed=1, families=families)
    _assert_clean(result)
    outcomes = result["details"]["outcomes"]
    assert set(outcomes["sealed_flip"]) == {"detected"}
    assert set(outcomes["header_flip"]) == {"detected"}
    assert set(outcomes["active_block"]) <= {"detected", "intact"} and outcomes["active_block"].get("detected", 0) > 0
    assert all(outcome.startswith("rejected:") for outcome in outcomes["snapshot_flip"])
    assert all(outcome.startswith("rejected:") for outcome in outcomes["audit_flip"])


def test_corruption_short_run_of_lmdb_bit_flips():
    """Sealed index entries and presence-checked misses: a flipped bit in a trusted data.mdb ends in
    a typed error, a rebuild, or answers equal to the oracle — never wrong answers until verify()."""
    result = torture.run_corruption(count=200, seed=1, families=("lmdb_flip",))
    _assert_clean(result)
    outcomes = result["details"]["outcomes"]["lmdb_flip"]
    assert outcomes.get("typed_error:CORRUPTION", 0) > 0, outcomes  # some flips did reach an answer


def test_corruption_short_run_of_agent_store_lmdb_bit_flips():
    """The same for an AgentStore's data.mdb: every answer of its read API equals the undamaged
    store's, or opening/reading it is a typed error; then a write is refused with CORRUPTION or
    leaves answers equal to the undamaged store's after the same write."""
    result = torture.run_corruption(count=200, seed=1, families=("agent_lmdb_flip",))
    _assert_clean(result)
    outcomes = result["details"]["outcomes"]["agent_lmdb_flip"]
    assert outcomes.get("typed_error:CORRUPTION", 0) > 0 and outcomes.get("no_effect", 0) > 0, outcomes


def test_the_agent_flip_check_catches_a_silently_different_answer(tmp_path):
    """``agent_answers`` must tell a store that answers differently (here: one more applied Event)."""
    from mwpstore.delivery import Delivery

    authority, _ = _store_with_receipts(str(tmp_path / "store"))
    with authority, AgentStore.open(str(tmp_path / "agent"), projections=[torture.CountingProjection()]) as agent:
        Delivery(agent, authority).catch_up("g-1")
        before = torture.agent_answers(agent)
        authority.accept(torture._mission_create("g-1", "m-extra", "a-extra"))
        Delivery(agent, authority).catch_up("g-1")
        assert torture.agent_answers(agent) != before


@pytest.mark.parametrize("write", ["as the fixture's", "a different write", "refused as damage", "refused otherwise"])
def test_the_agent_flip_check_judges_the_write_after_the_reads(tmp_path, monkeypatch, capsys, write):
    """Each ``agent_lmdb_flip`` copy also takes a write: answers that differ after it (here: the
    write itself changed) are wrong, a refusal is ``CORRUPTION`` or a violation. The flip is in a
    meta page's unused bytes, so the copy is the undamaged store."""
    from mwpstore.errors import Corruption, LimitExceeded

    authority, _ = _store_with_receipts(str(tmp_path / "store"))
    with authority, AgentStore.open(str(tmp_path / "agent"), projections=[torture.CountingProjection()]) as agent:
        Delivery(agent, authority).catch_up("g-1")
        read = torture.agent_answers(agent)
    written = torture._agent_written_dump(str(tmp_path / "agent"), str(tmp_path / "written"))
    (tmp_path / "cases.json").write_text(json.dumps([[200, 0]]))
    (tmp_path / "expected.json").write_text(json.dumps({"read": read, "written": written}))
    (tmp_path / "work").mkdir()
    original = torture._agent_flip_write

    def changed(agent):
        if write == "a different write":
            original(agent)
            with agent.begin() as tx:
                tx.record_intent("g-1", mission="m-other", workitem="wi-other", ownership_epoch=1, operation="notify")
        elif write == "refused as damage":
            raise Corruption("damaged", reason="agent")
        elif write == "refused otherwise":
            raise LimitExceeded("the LMDB map is full")
        else:
            original(agent)

    monkeypatch.setattr(torture, "_agent_flip_write", changed)
    torture.corruption_agent_lmdb_child([str(tmp_path / "agent"), str(tmp_path / "work"), str(tmp_path / "cases.json"),
                                         str(tmp_path / "expected.json")])
    done = [json.loads(line) for line in capsys.readouterr().out.splitlines() if "done" in line]
    expected = {"as the fixture's": ("no_effect", ""), "a different write": ("wrong", "after the write"),
                "refused as damage": ("write_refused:CORRUPTION", ""), "refused otherwise": ("write_refused_untyped", "LIMIT_EXCEEDED")}
    outcome, violation = expected[write]
    assert len(done) == 1 and done[0]["outcome"] == outcome and violation in done[0]["violation"]
    assert bool(done[0]["violation"]) == bool(violation)


# -- the checks can fail --------------------------------------------------------------------------


def _store_with_receipts(path: str) -> tuple[Authority, torture.Acknowledged]:
    authority = Authority.open(path)
    torture.ensure_groups(authority)
    oracle = torture.Acknowledged()
    for number in range(5):
        receipt = authority.accept(torture._mission_create("g-1", f"m-{number}", f"a-{number}"))
        oracle.add_receipt(receipt.action_id, receipt.group, receipt.seq, receipt.event_id)
    return authority, oracle


def test_the_oracle_check_passes_on_an_intact_store(tmp_path):
    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        assert torture.check_authority(authority, oracle) == []


def test_the_oracle_check_catches_a_lost_acknowledged_record(tmp_path):
    """Zero the last commit group of the log (as a lost write would): the store reopens as a
    shorter but consistent store, and only the oracle can tell an acknowledged record is gone."""
    path = str(tmp_path / "store")
    authority, oracle = _store_with_receipts(path)
    log = authority.log
    last_position = [position for batch in log.scan(0) for position in batch.positions][-1]
    segment = log.segments()[-1]
    authority.close()
    offset = SL_SEGMENT_HEADER_BYTES + last_position - segment.first_position
    with open(segment.path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes(segment.used_bytes - offset))
    with Authority.open(path) as reopened:
        problems = torture.check_authority(reopened, oracle)
    assert any("a-4" in problem and "lost" in problem for problem in problems), problems


def test_the_oracle_check_catches_a_moved_receipt_and_a_phantom(tmp_path):
    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        oracle.receipts["a-2"] = ("g-1", 99, "g-1:99")
        oracle.attempted.update({"a-0", "a-1", "a-2", "a-3"})  # a-4 "was never submitted"
        problems = torture.check_authority(authority, oracle, full_verify=False)
    assert any("a-2 moved" in problem for problem in problems)
    assert any("a-4 that was never submitted" in problem for problem in problems)


def test_the_partial_transition_check_catches_an_index_ahead_of_the_log(tmp_path):
    from mwpstore.index import encode_state, state_key

    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        with authority.index.env.begin(write=True) as txn:  # well-formed and sealed, but never logged
            authority.index.put(txn, b"states", state_key("g-1", "mission:m-0"), encode_state(7, {"title": "never logged"}))
        problems = torture.check_authority(authority, oracle, full_verify=True)
    assert any("partial transition" in problem for problem in problems)
    assert any(problem.startswith("verify:") for problem in problems)


def test_the_agent_check_catches_a_cursor_past_a_gap(tmp_path):
    authority, _ = _store_with_receipts(str(tmp_path / "store"))
    with authority, AgentStore.open(str(tmp_path / "agent"), projections=[torture.CountingProjection()]) as agent:
        Delivery(agent, authority).catch_up("g-1")
        assert torture.check_agent(agent, authority) == []
        # Forge a Cursor beyond what was applied, as a buggy apply cycle would: the store refuses
        # such a head itself (CORRUPTION), and the check reports that instead of raising.
        from mwpstore.agent_store import _HEAD_DECODER, _HEAD_ENCODER

        tables = agent._tables
        with agent._env.begin(write=True) as txn:  # sealed: well-formed, but wrong
            head = _HEAD_DECODER.decode(tables.get(txn, b"heads", b"g-1"))
            head.cursor = head.applied_seq + 3
            tables.put(txn, b"heads", b"g-1", _HEAD_ENCODER.encode(head))
        problems = torture.check_agent(agent, authority)
    assert any("refuses its head" in problem and "impossible head" in problem for problem in problems), problems


def test_the_agent_check_catches_an_event_applied_twice(tmp_path):
    """The CountingProjection count is what tells a double apply: forge a second application of
    one applied Event (what a re-apply after a crash would leave) and the check must say so."""
    from mwpstore.agent_store import ProjectionView

    authority, _ = _store_with_receipts(str(tmp_path / "store"))
    with authority, AgentStore.open(str(tmp_path / "agent"), projections=[torture.CountingProjection()]) as agent:
        Delivery(agent, authority).catch_up("g-1")
        assert torture.check_agent(agent, authority) == []
        applied = agent.head("g-1").applied_seq
        [event] = authority.read("g-1", after=applied - 1)
        with agent.begin() as tx:
            torture.CountingProjection().apply(ProjectionView(tx, "g-1", torture.CountingProjection.name), event)
        problems = torture.check_agent(agent, authority)
    assert any("projection counts wrong" in problem and f"twice [{applied}]" in problem for problem in problems), problems


def _power_state_with_ack(target: str) -> None:
    with Authority.open(target, segment_bytes=torture.POWER_SEGMENT_BYTES) as authority:
        torture.ensure_groups(authority)
        authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
        assert authority.ack("agent-p", "g-1", 1) == 1


def test_the_power_check_catches_a_lost_acknowledged_ack(tmp_path):
    """_check_power_state compares each acknowledged ACK with the recovered store's."""
    for name, acknowledged, expected in (("kept", 1, []), ("lost", 2, ["acknowledged ACK agent-p/g-1=2 lost"])):
        target = str(tmp_path / name)
        _power_state_with_ack(target)
        problems, _ = torture._check_power_state(target, torture.Acknowledged(), {("agent-p", "g-1"): acknowledged},
                                                 f"boot-{name}", False, {})
        assert problems == expected, problems


def test_the_power_check_reads_the_log_back_after_the_post_recovery_write(tmp_path, monkeypatch):
    """A recovery that kept part of a torn group left a log that reads until the next append
    (then its commit frame does not match): the power check reads the log back after its write."""
    from mwpstore.errors import Corruption

    target = str(tmp_path / "state")
    _power_state_with_ack(target)

    def damaged(self):
        raise Corruption("the group's commit frame does not match its records", reason="commit_mismatch")

    monkeypatch.setattr(SegmentLog, "verify", damaged)
    problems, _ = torture._check_power_state(target, torture.Acknowledged(), {}, "boot-v", False, {})
    assert len(problems) == 1 and problems[0].startswith("the log does not read back after the post-recovery write"), problems


def test_a_suite_that_breaks_reports_it_as_a_violation(monkeypatch):
    def broken(**options):
        raise RuntimeError("harness bug")

    monkeypatch.setitem(torture._suite_functions.__globals__, "run_fuzz", broken)
    result = torture.run_suite("fuzz", count=1, seed=1)
    assert result["violations"] == 1 and "harness bug" in result["details"]["violation_messages"][0]


# -- readers in other processes: the prefix check, and the end of a reader child ------------------


def _reader_fixture(path: str) -> tuple[Authority, torture.FinalStore, dict]:
    """A store, its FinalStore, and the document of a reader that saw it whole, as the reader
    child writes it (a view, then a bare log open)."""
    import random

    authority, _ = _store_with_receipts(path)
    final = torture.FinalStore.of(authority, set())
    heads = {group: [len(hashes), hashes[-1].hex()] for group, hashes in final.event_hashes.items()}  # a view of it whole
    problems: list[str] = []
    log = torture._read_log_once(path, random.Random(1), problems)
    assert problems == []
    document = {"views": [{"t": [1.0, 2.0], "heads": heads}], "logs": [{"t": [3.0, 4.0], **log}],
                "refusals": [], "errors": [], "problems": []}
    return authority, final, document


def test_the_reader_check_passes_on_what_a_reader_of_the_store_saw(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        assert document["logs"][0]["records"] == len(final.log_digests) > 0
        assert torture.check_reader(document, final, []) == []


def test_the_reader_check_catches_a_view_whose_event_differs_from_the_store_s(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        seq, digest = document["views"][0]["heads"]["g-1"]
        document["views"][0]["heads"]["g-1"] = [seq - 1, digest]  # the hash of seq, said of seq - 1
        problems = torture.check_reader(document, final, [])
    assert len(problems) == 1 and f"g-1 Event {seq - 1} with hash" in problems[0], problems


def test_the_reader_check_catches_a_view_past_the_store_or_behind_an_earlier_one(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        seq, digest = document["views"][0]["heads"]["g-1"]
        document["views"].append({"t": [5.0, 6.0], "heads": {"g-1": [seq + 1, digest]}})
        document["views"].append({"t": [7.0, 8.0], "heads": {"g-1": [1, final.event_hashes["g-1"][0].hex()]}})
        problems = torture.check_reader(document, final, [])
    assert any(f"up to {seq + 1}; the final store ends at {seq}" in problem for problem in problems), problems
    assert any(f"up to 1 after an earlier one showed {seq + 1}" in problem for problem in problems), problems


def test_the_reader_check_catches_a_bare_log_record_unlike_the_final_log_s(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        seen = document["logs"][0]
        ordinal, position, digest = seen["samples"][0]
        moved = dict(seen, samples=[[ordinal, position + 8, digest]])
        changed = dict(seen, samples=[[ordinal, position, "00" * 16]], digest="00" * 32)
        assert torture.check_reader(dict(document, logs=[moved]), final, []) == [
            f"a bare log open served record {ordinal} at position {position + 8}; the final log has it at {position}"]
        problems = torture.check_reader(dict(document, logs=[changed]), final, [])
    assert any("are not the final log's first" in problem for problem in problems), problems
    assert any(f"served record {ordinal} (position {position}) unlike the final log's" in problem for problem in problems), problems


def test_a_reader_refusal_is_a_violation_unless_a_compaction_explains_it(tmp_path):
    authority, final, document = _reader_fixture(str(tmp_path / "store"))
    with authority:
        corruption = {"kind": "view-reader", "t": [10.0, 10.5], "code": "CORRUPTION", "reason": "frame_checksum", "message": "damaged"}
        needs_writer = dict(corruption, code="INVALID_STATE", reason="recovery_needed")
        replaced = dict(corruption, kind="log-reader", reason="segment_replaced")
        compaction = [(10.2, 10.3)]
        for refusal, compactions, violations in ((corruption, [], 1), (corruption, compaction, 1), (needs_writer, [], 1),
                                                 (needs_writer, compaction, 0), (replaced, [], 1), (replaced, compaction, 0)):
            problems = torture.check_reader(dict(document, refusals=[refusal]), final, compactions)
            assert len(problems) == violations, (refusal, compactions, problems)
        problems = torture.check_reader(dict(document, errors=[{"kind": "log-reader", "t": [1, 2], "error": "KeyError: 3"}]), final, [])
    assert problems == ["reader raised (log-reader): KeyError: 3"]


def test_a_reader_child_killed_by_a_signal_is_a_violation(tmp_path):
    import signal

    path = str(tmp_path / "store")
    _store_with_receipts(path)[0].close()
    reader = torture._ReaderChild(path, str(tmp_path / "reader.json"), "1", list(torture.READER_KINDS))
    try:
        assert reader.wait_ready()
        reader.process.send_signal(signal.SIGSEGV)
        reader.process.wait(timeout=60)
        document, failure = reader.stop()
    finally:
        reader.kill()
    assert document is None and failure.startswith("died of signal SIGSEGV"), failure


def test_a_reader_child_told_to_stop_leaves_what_it_saw(tmp_path):
    path = str(tmp_path / "store")
    authority, _ = _store_with_receipts(path)
    authority.close()
    reader = torture._ReaderChild(path, str(tmp_path / "reader.json"), "1", list(torture.READER_KINDS))
    try:
        assert reader.wait_ready()
        document, failure = reader.stop()
    finally:
        reader.kill()
    assert failure == "" and document is not None
    assert len(document["views"]) == len(document["logs"]) == 1  # each kind once, however soon it is told
    with Authority.open(path) as reopened:
        assert torture.check_reader(document, torture.FinalStore.of(reopened, set()), []) == []
    assert document["refusals"] == document["errors"] == document["problems"] == []


def test_a_reader_exit_without_a_document_is_a_violation(tmp_path):
    missing = str(tmp_path / "none.json")
    assert torture.judge_reader_exit(0, "", missing)[1].startswith("left no readable document")
    assert torture.judge_reader_exit(1, "Traceback: boom", missing)[1] == "exited with 1: Traceback: boom"
    assert torture.judge_reader_exit(None, "", missing)[1].startswith("did not stop")


# -- the command ----------------------------------------------------------------------------------


def _cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mwpstore", "torture", *arguments], capture_output=True, text=True, timeout=600)


def test_command_prints_figures_and_exits_zero():
    completed = _cli("--suite", "power", "--count", "20", "--seed", "3", "--json")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    document = json.loads(completed.stdout)
    (result,) = document["results"]
    assert (result["suite"], result["seed"], result["iterations"], result["violations"]) == ("power", 3, 20, 0)


def test_command_exits_one_on_a_violation(monkeypatch, capsys):
    from mwpstore.cli import main

    def failing(name, **options):
        return {"suite": name, "seed": 1, "iterations": 1, "duration_s": 0.0, "violations": 1,
                "details": {"violation_messages": ["an invariant broke"]}}

    monkeypatch.setattr(torture, "run_suite", failing)
    assert main(["torture", "--suite", "crash", "--count", "1"]) == 1
    assert "VIOLATION: an invariant broke" in capsys.readouterr().out


def test_command_refuses_an_unknown_suite():
    completed = _cli("--suite", "nope")
    assert completed.returncode == 2
    assert "unknown suite" in completed.stderr


def test_log_prefix_judge_tells_outcomes_apart(tmp_path):
    directory = str(tmp_path / "log")
    with SegmentLog.open(directory, segment_bytes=64 * 1024) as log:
        log.append([b"one", b"two"])
        log.append([b"three"])
        original = [(p, bytes(r)) for batch in log.scan(0) for p, r in zip(batch.positions, batch.records)]
    assert torture._judge_log(directory, original, must_keep_all=True) == ("intact", "")
    outcome, violation = torture._judge_log(directory, original + [(10_000, b"lost")], must_keep_all=True)
    assert outcome == "prefix" and "torn tail" in violation
    outcome, violation = torture._judge_log(directory, [(0, b"other")] + original[1:], must_keep_all=False)
    assert outcome == "wrong" and violation


def test_a_second_snapshot_at_the_same_sequence_never_breaks_the_first_reference(tmp_path, monkeypatch):
    authority, oracle = _store_with_receipts(str(tmp_path / "store"))
    with authority:
        first = authority.snapshot("g-1")
        oracle.snapshots.add((first.group, first.seq))

        def crash_before_logging(*arguments, **options):
            raise RuntimeError("the process died here")

        monkeypatch.setattr(authority, "_log_note", crash_before_logging)
        assert authority.snapshot("g-1") == first  # same head: the signed reference is reused, no file rewritten
        monkeypatch.undo()
        problems = torture.check_authority(authority, oracle, full_verify=False)
    assert problems == []


# -- lmdb-sweep: every byte of two small LMDB files ---------------------------------------------


def test_lmdb_sweep_slice_over_both_stores(tmp_path):
    """A spread slice of the exhaustive sweep (every 200th byte of each store's used pages, a
    rotating bit): each damaged copy, opened with the structural check and without, answers every
    read and write as the undamaged store does, or with a typed error. The one class finding 233
    leaves open is let through, and only it: an open without the check whose copy the checked open
    refuses (LMDB's own writes over a page whose structure or key order is damaged). The full sweep
    and its figures are in docs/reliability.md."""
    record = tmp_path / "cases.jsonl"
    result = torture.run_lmdb_sweep(stride=200, bits="rotating", record=str(record))
    cases = [json.loads(line) for line in record.read_text().splitlines()]
    checked = {(case["store"], case["offset"], case["bit"]): case["outcome"] for case in cases if case["check"]}
    left = [case for case in cases if case["outcome"] == "violation"]
    for case in left:
        assert not case["check"], case
        assert checked[case["store"], case["offset"], case["bit"]].startswith("refused_at_open:"), case
    assert result["iterations"] > 0 and result["violations"] == len(left) <= 2, result["details"]["violation_messages"][:5]
    figures = result["details"]["stores"]
    assert figures["agent"]["cases"] > 30 and figures["index"]["cases"] > 20, figures
    for kind in ("agent", "index"):
        for mode in ("checked", "unchecked"):
            outcomes = result["details"]["outcomes"][kind][mode]
            assert outcomes.get("typed_error", 0) > 0 and outcomes.get("no_effect", 0) > 0, (kind, mode, outcomes)


def test_a_crash_without_the_structural_check_is_counted_but_no_violation(monkeypatch):
    """An open without the structural check may die inside LMDB (what the check is for): the
    sweep counts it apart; the same crash in an open with the check is a violation."""
    def chunk(kind, fixture, work, cases):
        return [{"offset": offset, "bit": bit, "check": check, "outcome": "interpreter_crash",
                 "problems": [f"{kind} offset {offset} bit {bit}: the process exit -7"]} for offset, bit, check in cases]

    monkeypatch.setattr(torture, "_sweep_chunk", chunk)
    result = torture.run_lmdb_sweep(stores=("agent",), offsets=[0], bits="rotating")
    assert result["details"]["outcomes"]["agent"] == {"checked": {"interpreter_crash": 1}, "unchecked": {"interpreter_crash": 1}}
    assert result["violations"] == 1 and "[meta]" in result["details"]["violation_messages"][0]


def test_the_sweep_runs_the_stores_named_in_the_environment_and_records_each_case(monkeypatch, tmp_path):
    """``MWPSTORE_SWEEP_STORES`` picks the stores (one all-bits run each fits in an hour) and
    ``MWPSTORE_SWEEP_RECORD`` gets one JSON line per case; a store it does not know is refused."""
    record = tmp_path / "cases.jsonl"
    monkeypatch.setenv("MWPSTORE_SWEEP_STORES", " index,")  # spaces and an empty item are left out
    monkeypatch.setenv("MWPSTORE_SWEEP_RECORD", str(record))
    result = torture.run_suite("lmdb-sweep", count=4)
    assert (result["iterations"], result["violations"]) == (4, 0), result
    assert list(result["details"]["stores"]) == ["index"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 4 and {line["store"] for line in lines} == {"index"}
    assert {line["check"] for line in lines} == {True, False}
    monkeypatch.setenv("MWPSTORE_SWEEP_STORES", "agent,idx")
    with pytest.raises(ValueError, match="idx"):
        torture.run_suite("lmdb-sweep", count=4)


def test_the_swept_index_runs_with_its_clock_gone_back_so_a_lost_last_ms_is_seen(tmp_path):
    """The swept index is opened with a clock behind its fixture's: a damaged copy that lost its
    ``meta`` ``last_ms`` (a flipped bit in the key, which the structural check passes) would stamp
    the new Command earlier than the undamaged store does. Every flip of the key's last byte is
    found by the open (the index rebuilt), none is an answer."""
    fixture = str(tmp_path / "index")
    with torture._boot_id("lmdb-sweep"):
        torture._sweep_build_index(fixture)
    with open(os.path.join(fixture, torture._sweep_data_file("index")), "rb") as handle:
        offset = handle.read().index(b"last_ms") + len(b"last_ms") - 1
    assert torture._sweep_clock_back() < torture._sweep_clock()
    result = torture.run_lmdb_sweep(stores=("index",), offsets=[offset], bits="all")
    _assert_clean(result)
    assert result["details"]["outcomes"]["index"] == {"checked": {"rebuilt_at_open": 8}, "unchecked": {"rebuilt_at_open": 8}}


def test_the_sweep_covers_each_used_page_but_not_its_free_gap(tmp_path):
    """The swept spans are the meta pages' metas and the pages reachable from the current meta
    without the gap between a page's pointers and its nodes: they touch as many pages as LMDB
    counts in its trees (plus the free list's), and far fewer bytes than the file holds."""
    import lmdb

    fixture = str(tmp_path / "agent")
    torture._sweep_build_agent(fixture)
    data = os.path.join(fixture, "lmdb", "data.mdb")
    spans = torture.lmdb_page_spans(data)
    env = lmdb.open(os.path.join(fixture, "lmdb"), readonly=True, lock=False, max_dbs=32)
    try:
        page, last = env.stat()["psize"], env.info()["last_pgno"]
        with env.begin() as txn:
            names = [bytes(key) for key, _ in txn.cursor()]
            stats = [txn.stat()] + [txn.stat(env.open_db(name, txn=txn, create=False)) for name in names]
    finally:
        env.close()
    in_trees = sum(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] for stat in stats)
    touched = {number for start, end in spans for number in range(start // page, (end - 1) // page + 1)}
    assert {0, 1} <= touched and max(touched) <= last
    assert 2 + in_trees <= len(touched) <= 2 + in_trees + 2  # the metas, the trees, the free list's page(s)
    swept = sum(end - start for start, end in spans)
    assert swept < (last + 1) * page // 4  # the free gaps are left out
    cases = torture.sweep_cases("agent", fixture, "rotating")
    assert len(cases) == swept and {bit for _, bit in cases} == set(range(8))
    assert len(torture.sweep_cases("agent", fixture, "all")) == 8 * swept


def test_the_sweep_judge_catches_a_wrong_answer_a_foreign_error_and_a_changed_write(tmp_path, monkeypatch):
    """The sweep's oracle bites: with the seal check taken out, a flipped bit in a stored state is
    a wrong answer; a bare exception from a read, and a write that answers differently, are
    violations too."""
    from mwpstore import _sealed

    fixture = str(tmp_path / "agent")
    torture._sweep_build_agent(fixture)
    oracle = torture._SweepOracle("agent", fixture, str(tmp_path / "work"))
    os.makedirs(oracle.work)
    intact = oracle.session(frozenset())
    assert intact["open"] == ("ok", "") and len(intact["applied"]) == oracle.writes
    assert torture._sweep_judge(intact, oracle) == []

    damaged = str(tmp_path / "damaged")

    shutil.copytree(fixture, damaged, ignore=shutil.ignore_patterns(*torture._SWEEP_IGNORE))
    data = os.path.join(damaged, "lmdb", "data.mdb")
    with open(data, "r+b") as handle:
        content = bytearray(handle.read())
        at = -1
        while (at := content.find(b"three", at + 1)) >= 0:  # the state of g-3's Mission: the live copy and
            content[at] ^= 0x01  # those left in free pages by earlier commits
        handle.seek(0)
        handle.write(content)
    monkeypatch.setattr(_sealed, "_unseal", lambda stored, key, seed, most: bytes(stored[:-4]))
    session = torture._sweep_session("agent", damaged, False)
    problems = torture._sweep_judge(session, oracle)
    assert any(problem.startswith("states g-3 (before any write) answered") for problem in problems), problems

    broken = json.loads(json.dumps(intact))
    broken["reads"][2][0] = [broken["reads"][2][0][0], ["foreign", "KeyError: 'x'"]]
    broken["writes"][4] = [broken["writes"][4][0], ["ok", "41"]]
    problems = torture._sweep_judge(broken, oracle)
    assert len(problems) == 2
    assert any(problem.startswith("write 'prune_inbox g-2' answered 41") for problem in problems)
    assert any(problem.startswith(f"{broken['reads'][2][0][0]} (after 'reset_group g-3'): KeyError")
               for problem in problems), problems


def _pages_by_number(path: str) -> dict[int, bytes]:
    with open(path, "rb") as handle:
        data = handle.read()
    return {number: data[number * 4096:(number + 1) * 4096] for number in range(len(data) // 4096)}


def test_the_page_sweep_damages_every_used_page_each_way(tmp_path):
    """``damage="pages"``: every page the byte sweep touches (both metas and every tree page) is
    read back as zeros, as garbage, as the next used page and as a used page of another tree (a
    misdirected write), and as the same page of each older image where it differs (a lost write:
    the fixture keeps one after an early commit and one after a middle one)."""
    fixture = str(tmp_path / "agent")
    torture._sweep_build_agent(fixture, torture._sweep_images(fixture))
    data = os.path.join(fixture, "lmdb", "data.mdb")
    roles = torture.lmdb_page_roles(data)
    touched = {number for start, end in torture.lmdb_page_spans(data) for number in range(start // 4096, (end - 1) // 4096 + 1)}
    assert set(roles) == touched and roles[0] == roles[1] == "meta"
    current = _pages_by_number(data)
    images = {name: _pages_by_number(os.path.join(torture._sweep_images(fixture), name + ".mdb")) for name in torture.SWEEP_IMAGES}
    by_page: dict[int, list[str]] = {}
    for page, damage in torture.sweep_page_cases("agent", fixture):
        by_page.setdefault(page, []).append(damage)
    assert set(by_page) == set(roles)
    for page, damages in by_page.items():
        assert damages[:2] == ["zero", "garble"], damages
        sources = [int(damage.split()[1]) for damage in damages if damage.startswith("other ")]
        assert sources and page not in sources and set(sources) <= set(roles)
        tree = roles[page].split()[0]
        # a meta page's role is "meta" alone (the AgentStore's database `meta` is "meta leaf"):
        # every tree page gets a source of another tree, the database `meta`'s pages included
        assert roles[page] == "meta" or any(roles[source] != "meta" and roles[source].split()[0] != tree for source in sources), (page, damages)
        for name, image in images.items():
            assert (f"stale {name}" in damages) == (page in image and image[page] != current[page]), (page, name)
    kinds = {damage.split()[0] for damages in by_page.values() for damage in damages}
    assert kinds == set(torture.SWEEP_PAGE_DAMAGES)
    assert all(any(f"stale {name}" in damages for damages in by_page.values()) for name in torture.SWEEP_IMAGES)

    copy = str(tmp_path / "copy.mdb")
    page, other = 2, next(int(damage.split()[1]) for damage in by_page[2] if damage.startswith("other "))
    stale = next(damage for damages in by_page.values() for damage in damages if damage.startswith("stale "))
    stale_page = next(number for number, damages in by_page.items() if stale in damages)
    for number, damage, want in ((page, "zero", bytes(4096)), (page, f"other {other}", current[other]),
                                 (stale_page, stale, images[stale.split()[1]][stale_page]), (page, "garble", None)):
        shutil.copyfile(data, copy)
        torture._sweep_damage_page(copy, fixture, number, damage)
        damaged = _pages_by_number(copy)
        assert {n for n in current if damaged[n] != current[n]} == {number}, damage
        assert want is None or damaged[number] == want, damage
    garbled = damaged[page]
    torture._sweep_damage_page(copy, fixture, page, "garble")
    assert _pages_by_number(copy)[page] == garbled  # seeded: the same garbage every run


def test_lmdb_sweep_of_whole_pages_over_both_stores(tmp_path):
    """A slice of the page sweep (every fourth case of each store): each copy with one page read
    back as zeros, garbage, another page or an older image's page, opened with the structural
    check and without, answers as the undamaged store or with a typed error. Left through, and
    only it: the lost write of the newer meta page, which leaves the two meta pages exactly as a
    crash before that commit's meta write would (consecutive ids, the older snapshot sound and
    sealed): the AgentStore opens one commit behind in both opens. The full run's figures are in
    docs/reliability.md."""
    record = tmp_path / "cases.jsonl"
    result = torture.run_lmdb_sweep(damage="pages", stride=4, record=str(record))
    cases = [json.loads(line) for line in record.read_text().splitlines()]
    assert {case["damage"].split()[0] for case in cases} == set(torture.SWEEP_PAGE_DAMAGES)
    left = [case for case in cases if case["outcome"] == "violation"]
    for case in left:
        assert (case["store"], case["role"], case["damage"].split()[0]) == ("agent", "meta", "stale"), case
    assert result["violations"] == len(left) <= 2, result["details"]["violation_messages"][:5]
    assert result["details"]["damage"] == "pages" and "bits" not in result["details"]
    for kind in ("agent", "index"):
        assert result["details"]["stores"][kind]["swept_pages"] > 5
        outcomes = result["details"]["outcomes"][kind]
        assert sum(outcomes["checked"].values()) == sum(outcomes["unchecked"].values()) > 10, outcomes


def test_the_page_sweep_finds_a_heads_page_written_back_from_an_older_commit(tmp_path):
    """The index's ``heads`` page read back as the early image holds it (a lost write): sound
    entries under sound seals, Group g-1's head at Event 1 of 5. The structural check passes it;
    ``head``, ``read`` and a new Command in g-1 are ``CORRUPTION`` (the Event after the head is
    indexed), never an answer from the older head."""
    fixture = str(tmp_path / "index")
    with torture._boot_id("lmdb-sweep"):
        torture._sweep_build_index(fixture, torture._sweep_images(fixture))
    data = os.path.join(fixture, torture._sweep_data_file("index"))
    (page,) = [number for number, role in torture.lmdb_page_roles(data).items() if role == "heads leaf"]
    early = _pages_by_number(os.path.join(torture._sweep_images(fixture), "early.mdb"))[page]
    assert early != _pages_by_number(data)[page] and b"g-1" in early  # an older heads leaf at that page
    result = torture.run_lmdb_sweep(stores=("index",), damage="pages", pages=[page])
    _assert_clean(result)
    assert result["details"]["outcomes"]["index"]["checked"].get("typed_error", 0) >= 1


def test_a_refused_rebuild_after_a_reset_that_committed_is_no_violation(tmp_path):
    """The AgentStore's projection page read back as the buffer's (a misdirected write), opened
    without the walk: ``reset_group("g-3")`` commits, and the rebuild of g-3 after it is refused
    with ``CORRUPTION``. Both answers are right; as one write of the sweep ("reset_group g-3 and
    rebuild it"), the refusal made the judge expect the reads of a store the reset had not touched,
    and the reset's empty g-3 read as 80 wrong answers."""
    fixture = str(tmp_path / "agent")
    torture._sweep_build_agent(fixture, torture._sweep_images(fixture))
    roles = torture.lmdb_page_roles(os.path.join(fixture, "lmdb", "data.mdb"))
    (page,) = [number for number, role in roles.items() if role == "projection leaf"]
    damages = [damage for number, damage in torture.sweep_page_cases("agent", fixture)
               if number == page and damage.startswith("other ") and roles[int(damage.split()[1])] == "buffer leaf"]
    assert damages, roles
    record = tmp_path / "cases.jsonl"
    result = torture.run_lmdb_sweep(stores=("agent",), damage="pages", pages=[page], record=str(record))
    _assert_clean(result)
    (case,) = [json.loads(line) for line in record.read_text().splitlines()
               if json.loads(line)["damage"] == damages[0] and not json.loads(line)["check"]]
    assert case["outcome"] == "typed_error", case


def test_the_sweep_takes_its_damage_from_the_environment(monkeypatch, tmp_path):
    """``MWPSTORE_SWEEP_DAMAGE=pages`` sweeps whole pages (the record names page and damage);
    ``bits`` is the default; another value is refused."""
    record = tmp_path / "cases.jsonl"
    monkeypatch.setenv("MWPSTORE_SWEEP_STORES", "index")
    monkeypatch.setenv("MWPSTORE_SWEEP_RECORD", str(record))
    monkeypatch.setenv("MWPSTORE_SWEEP_DAMAGE", "pages")
    result = torture.run_suite("lmdb-sweep", count=4)
    assert (result["iterations"], result["violations"], result["details"]["damage"]) == (4, 0, "pages"), result
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(line["page"], line["damage"], line["role"]) for line in lines[:2]] == [(0, "zero", "meta")] * 2
    monkeypatch.setenv("MWPSTORE_SWEEP_DAMAGE", "blocks")
    with pytest.raises(ValueError, match="blocks"):
        torture.run_suite("lmdb-sweep", count=4)


def test_command_runs_the_lmdb_sweep_only_when_named():
    completed = _cli("--suite", "lmdb-sweep", "--count", "4", "--json")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (result,) = json.loads(completed.stdout)["results"]
    assert (result["suite"], result["iterations"], result["violations"]) == ("lmdb-sweep", 4, 0)
    assert result["details"]["bits"] == "rotating"
    assert "lmdb-sweep" not in torture.SUITES  # the default run leaves it out
