"""The acceptance transaction's own rules, pinned where a mutation round over authority.py
(_prepare, _lookup_receipt, accept, accept_many, _decide, _write_batch and the _Batch they fill)
found no test that noticed them broken:

- a kind the engine alone issues is refused to a member through ``accept_many`` too;
- a replay or a collision is answered from the stored receipt before the Command joins a commit;
- a refusal that does not rest on the batch (decided against the Command alone, in a Group the
  batch did not write, or by the per-commit byte cap) keeps its own answer when the commit fails;
- a refused Command leaves no receipt behind: its Action ID is still free;
- the size bounds are inclusive: an Event of exactly RECORD_BYTES_MAX, and Events that fill
  exactly the log group an empty segment holds;
- the Event carries the content that was hashed, however deep the caller changes its body;
- the Events of a commit are indexed at their own records when an ACK or a snapshot's record
  comes first in the same log group.
"""

from __future__ import annotations

import msgspec
import pytest

from authority_helpers import GROUP, OWNER, FakeClock, group_create, mission_create, open_with_group, record_bytes
from mwpstore import ActionIdCollision, Command, InvalidCommand, LimitExceeded, MwpError, NotAMember, StorageFailed, Unauthorized
from blocking import Caller, wait_for_queue
from test_group_commit import AppendGate, _close_failed, _failing_next_sync


def _with(command: Command, **changes: object) -> Command:
    return msgspec.structs.replace(command, **changes)


def _big(command: Command) -> Command:
    """``command`` with a title of 1,000 characters: an Event of about 1.3 KB."""
    return _with(command, body={"title": "x" * 1_000, "cost_limit": 1})


# -- engine-only kinds ---------------------------------------------------------------------------


def test_accept_many_refuses_an_engine_only_kind_to_a_member_as_accept_does(tmp_path):
    """``lease.expire`` is the engine's (system_only): the owner of the Group sending it in an
    accept_many is refused with UNAUTHORIZED, as through accept (docs/api.md), and nothing is
    appended. Only ``accept_trusted`` marks a Command as the engine's."""
    expire = Command(actor=OWNER, action_id="x-1", group=GROUP, kind="lease.expire", target="wi-1", body={"lease_id": "l-1"})
    with open_with_group(str(tmp_path / "store")) as authority:
        [result] = authority.accept_many([expire])
        assert result.error_code == Unauthorized.code and result.error.detail == {"kind": "lease.expire"}
        with pytest.raises(Unauthorized) as refused:
            authority.accept(expire)
        assert refused.value.detail == {"kind": "lease.expire"}
        assert authority.head(GROUP)[0] == 1


# -- replays answered before the commit ----------------------------------------------------------


def test_a_replay_and_a_collision_are_answered_from_the_stored_receipt_without_joining_a_commit(tmp_path):
    """docs/overview.md, step 1: a Command whose (actor, Action ID) has a receipt is answered from a
    read transaction. With the clock broken (which any commit reads, and is refused on) the replay
    still gets its original receipt (through accept_trusted too) and a changed Command its
    ACTION_ID_COLLISION."""
    clock = FakeClock()
    with open_with_group(str(tmp_path / "store"), clock=clock) as authority:
        command = mission_create("m-1", action_id="a-1")
        receipt = authority.accept(command)

        def broken() -> int:
            raise ZeroDivisionError("clock broke")

        authority._clock = broken
        with pytest.raises(InvalidCommand) as caught:  # a new Command joins a commit: the clock is read
            authority.accept(mission_create("m-2"))
        assert caught.value.detail["field"] == "clock"
        assert authority.accept(command) == receipt
        assert authority.accept_trusted(command) == receipt  # a trusted Command of a member's kind
        with pytest.raises(ActionIdCollision):
            authority.accept(_with(command, body={"title": "changed", "cost_limit": 100}))


# -- which refusals rest on a failed batch ---------------------------------------------------------


def _too_large_for_a_record(monkeypatch, authority_module) -> None:
    from mwpstore import limits

    monkeypatch.setattr(limits, "RECORD_BYTES_MAX", 1_000)


def _too_large_for_a_segment(monkeypatch, authority_module) -> None:
    from mwpstore.segment_log import COMMIT_FRAME_BYTES

    monkeypatch.setattr(authority_module, "group_bytes_max", lambda segment_bytes: COMMIT_FRAME_BYTES + 1_000)


def _decide_raises(monkeypatch, authority_module) -> None:
    run_transition = authority_module.run_transition

    def buggy(view, command, **options):
        if command.target == "m-big":
            raise RuntimeError("a bug in decide")
        return run_transition(view, command, **options)

    monkeypatch.setattr(authority_module, "run_transition", buggy)


@pytest.mark.parametrize(
    ("refusal", "code", "field"),
    [
        (_too_large_for_a_record, LimitExceeded.code, "body"),
        (_too_large_for_a_segment, LimitExceeded.code, "body"),
        (_decide_raises, MwpError.code, None),
    ],
    ids=["record-bytes", "segment-bytes", "decide-raises"],
)
def test_a_refusal_of_the_command_alone_keeps_its_answer_when_the_batch_fails(tmp_path, monkeypatch, refusal, code, field):
    """docs/api.md: when a commit fails, a Command refused against the durable state alone keeps
    its answer. An Event too large for a record or for any log group, or a decide that raises, is
    refused before anything of the batch is decided over: the Command after it, which the failed
    fdatasync refuses, does not turn that answer into STORAGE_FAILED."""
    from mwpstore import authority as authority_module

    recorder, authority = _failing_next_sync(str(tmp_path / "store"))
    try:
        refusal(monkeypatch, authority_module)
        recorder.fail_sync_at = recorder.sync_calls
        results = authority.accept_many([_big(mission_create("m-big")), mission_create("m-1")])
        assert recorder.failures == 1
        assert [result.error_code for result in results] == [code, StorageFailed.code]
        assert results[0].error.detail.get("field") == field
    finally:
        _close_failed(authority)


def test_a_rejection_in_a_group_the_failed_batch_did_not_write_keeps_its_answer(tmp_path):
    """A rejection rests on the batch only when an earlier Command of the batch wrote its Group:
    a stranger refused in a second Group, after an accepted Command of the first, stays
    NOT_A_MEMBER when the fdatasync fails."""
    recorder, authority = _failing_next_sync(str(tmp_path / "store"))
    try:
        authority.accept(group_create("g-2"))
        stranger = _with(mission_create("m-9", group="g-2"), actor="stranger")
        recorder.fail_sync_at = recorder.sync_calls
        results = authority.accept_many([mission_create("m-1"), stranger])
        assert recorder.failures == 1
        assert [result.error_code for result in results] == [StorageFailed.code, NotAMember.code]
    finally:
        _close_failed(authority)


def test_a_command_refused_by_the_byte_cap_keeps_its_retryable_answer_when_the_batch_fails(tmp_path, monkeypatch):
    """docs/api.md: a Command that would take its commit past the byte cap is refused on its own
    with LIMIT_EXCEEDED, field commands, whatever becomes of the Commands before it: the failed
    fdatasync refuses those, not it."""
    from mwpstore import limits

    recorder, authority = _failing_next_sync(str(tmp_path / "store"))
    try:
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", 1_000)  # one small Event, not the large one after it
        recorder.fail_sync_at = recorder.sync_calls
        results = authority.accept_many([mission_create("m-1"), _big(mission_create("m-big"))])
        assert recorder.failures == 1
        assert [result.error_code for result in results] == [StorageFailed.code, LimitExceeded.code]
        assert results[1].error.detail["field"] == "commands"
    finally:
        _close_failed(authority)


# -- a refused Command leaves no receipt -----------------------------------------------------------


def test_a_command_refused_as_too_large_leaves_its_action_id_free(tmp_path, monkeypatch):
    """Nothing of a refused Command is written, its receipt neither: the same Action ID with
    content that fits is accepted afterwards as a new Event (no ACTION_ID_COLLISION), and a replay
    of the refused Command is refused again rather than answered."""
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(limits, "RECORD_BYTES_MAX", 1_000)
        big = _big(mission_create("m-1", action_id="a-1"))
        [refused] = authority.accept_many([big])
        assert refused.error_code == LimitExceeded.code
        with pytest.raises(LimitExceeded):
            authority.accept(big)
        assert authority.accept(mission_create("m-1", action_id="a-1")).seq == 2


# -- inclusive bounds ------------------------------------------------------------------------------


def test_an_event_of_exactly_record_bytes_max_is_accepted(tmp_path, monkeypatch):
    """RECORD_BYTES_MAX bounds the Event's record itself, inclusively: a record of exactly that
    many bytes is accepted, one byte more is LIMIT_EXCEEDED (field body)."""
    from mwpstore import limits

    command = mission_create("m-1", action_id="a-1")
    [size] = record_bytes(str(tmp_path / "measure"), [command])
    with open_with_group(str(tmp_path / "store"), clock=FakeClock()) as authority:
        monkeypatch.setattr(limits, "RECORD_BYTES_MAX", size - 1)
        with pytest.raises(LimitExceeded) as caught:
            authority.accept(command)
        assert caught.value.field == "body"
        monkeypatch.setattr(limits, "RECORD_BYTES_MAX", size)
        assert authority.accept(command).seq == 2


def test_events_that_fill_exactly_the_log_group_an_empty_segment_holds_share_one_commit(tmp_path, monkeypatch):
    """An empty segment's room for a log group (segment_log.group_bytes_max) holds the commit frame
    and the records' framed bytes, inclusively: one Event that fills it alone is accepted, one byte
    less is LIMIT_EXCEEDED for the Event (field body); two Events that fill it share the commit,
    one byte less refuses the second retryably (field commands)."""
    from mwpstore import authority as authority_module
    from mwpstore.segment_log import COMMIT_FRAME_BYTES, framed_bytes

    commands = [mission_create("m-1", action_id="a-1"), mission_create("m-2", action_id="a-2")]
    framed = [framed_bytes(size) for size in record_bytes(str(tmp_path / "measure"), commands)]

    def room(room_bytes: int) -> None:
        monkeypatch.setattr(authority_module, "group_bytes_max", lambda segment_bytes: room_bytes)

    with open_with_group(str(tmp_path / "alone"), clock=FakeClock()) as authority:
        room(COMMIT_FRAME_BYTES + framed[0] - 1)
        with pytest.raises(LimitExceeded) as caught:
            authority.accept(commands[0])
        assert caught.value.field == "body"
        room(COMMIT_FRAME_BYTES + framed[0])
        assert authority.accept(commands[0]).seq == 2
    monkeypatch.undo()  # the room stays patched only after each store's group.create
    with open_with_group(str(tmp_path / "two"), clock=FakeClock()) as authority:
        room(COMMIT_FRAME_BYTES + sum(framed) - 1)
        results = authority.accept_many(commands)
        assert [result.error_code for result in results] == [None, LimitExceeded.code]
        assert results[1].error.detail["field"] == "commands"
    monkeypatch.undo()
    with open_with_group(str(tmp_path / "three"), clock=FakeClock()) as authority:
        room(COMMIT_FRAME_BYTES + sum(framed))
        assert [result.receipt.seq for result in authority.accept_many(commands)] == [2, 3]


# -- the content that was hashed -----------------------------------------------------------------


def test_the_event_carries_the_hashed_content_even_if_the_caller_changes_a_list_inside_the_body(tmp_path):
    """The Command a commit decides is decoded from the canonical bytes that were hashed, all the
    way down: a list inside the caller's body, changed after accept() hashed it (here by a clock
    the commit calls), does not reach the Event or the state."""
    approvals = ["op-a"]
    command = Command(actor=OWNER, action_id="mc-nested", group=GROUP, kind="mission.create", target="m-x",
                      body={"title": "t", "cost_limit": 5, "approval_required": approvals})
    armed = False

    def meddling_clock() -> int:
        if armed:
            approvals.append("op-b")
        return 1_700_000_000_000

    with open_with_group(str(tmp_path / "store"), clock=meddling_clock) as authority:
        armed = True
        receipt = authority.accept(command)
        armed = False
        assert approvals[-1] == "op-b"  # the clock did run during the commit
        [event] = authority.read(GROUP, after=receipt.seq - 1)
        assert event.body["approval_required"] == ["op-a"]
        assert authority.state(GROUP, "mission:m-x")[1]["approval_required"] == ["op-a"]


# -- records of other kinds in the commit -----------------------------------------------------------


@pytest.mark.parametrize("first", ["ack", "snapshot"])
def test_the_events_of_a_commit_are_indexed_at_their_records_after_an_ack_or_snapshot_record(tmp_path, monkeypatch, first):
    """One log group holds an ACK's (or a snapshot reference's) record before two Events: each
    Event is indexed at its own record, not at the position of the record ahead of it, so reads
    and a verify after reopening find the Events the callers were answered with."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        gate = AppendGate(monkeypatch, "hold")
        held = Caller(lambda: authority.accept(mission_create("m-0")))
        assert gate.held.wait(30)
        other = Caller(lambda: authority.ack("c-1", GROUP, 1) if first == "ack" else authority.snapshot(GROUP))
        wait_for_queue(authority, 1)
        many = Caller(lambda: authority.accept_many([mission_create("m-1"), mission_create("m-2")]))
        wait_for_queue(authority, 2)
        gate.release()
        assert held.outcome().seq == 2
        other.outcome()
        receipts = [result.receipt for result in many.outcome()]
        assert [receipt.seq for receipt in receipts] == [3, 4]
        monkeypatch.undo()
    with open_with_group(path) as authority:
        events = authority.read(GROUP, after=2)
        assert [(event.seq, event.event_id, event.aggregate) for event in events] == [
            (receipt.seq, receipt.event_id, f"mission:{name}") for receipt, name in zip(receipts, ("m-1", "m-2"))
        ]
        assert authority.verify().ok

