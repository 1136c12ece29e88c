"""The group-commit leader and its waiting callers: batches, wake-ups, withdrawals, failures
that answer every caller of a batch, accept_many's result per Command, subscribe and ACK.

Interleavings are forced through the fail point before the log append (a commit is held there,
or interrupted there) while other callers queue behind it, never by sleeping."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

import lmdb
import pytest

from authority_helpers import GROUP, mission_create, open_with_group
from blocking import Caller, wait_for_queue
from mwpstore import Authority, failpoints, torture
from mwpstore.errors import ActionIdCollision, AlreadyExists, InvalidCommand, LimitExceeded, MwpError, NotAMember, SequenceGap, StorageFailed, StoreClosed
from mwpstore.io_seam import RecordingIO
from mwpstore.messages import encode_receipt


class AppendGate:
    """Scripts the commits that reach ``authority.before_log_append``, one step per commit in
    order: ``"hold"`` (stop there until :meth:`release`), ``"interrupt"`` (raise
    KeyboardInterrupt there, before anything reaches the log), ``"pass"``, or a callable run
    there (what it raises is raised there). ``after_sync``
    is raised at ``authority.after_log_sync`` of the first commit that gets there once
    :meth:`release` was called (the log holds the batch, the index does not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *steps: str | Callable[[], None], after_sync: BaseException | None = None) -> None:
        self.steps = list(steps)
        self.held = threading.Event()
        self._go = threading.Event()
        self._after_sync = after_sync
        original = failpoints.hit

        def hit(name: str) -> None:
            if name == "authority.before_log_append" and self.steps:
                step = self.steps.pop(0)
                if step == "hold":
                    self.held.set()
                    assert self._go.wait(30)
                elif step == "interrupt":
                    raise KeyboardInterrupt
                elif callable(step):
                    step()
            if name == "authority.after_log_sync" and self._go.is_set() and self._after_sync is not None:
                raised, self._after_sync = self._after_sync, None
                raise raised
            original(name)

        monkeypatch.setattr(failpoints, "hit", hit)

    def release(self) -> None:
        self._go.set()


def wait_for_exclusive(authority) -> None:
    """Until a rebuild, compaction or verify waits for the leader role (polled, as above)."""
    for _ in range(3000):
        if authority._exclusive_waiting:
            break
        threading.Event().wait(0.005)
    assert authority._exclusive_waiting == 1


def held_leader(monkeypatch, authority, *steps: str | Callable[[], None], after_sync: BaseException | None = None) -> tuple[AppendGate, Caller]:
    """A first commit (mission m-lead) held before its log append; ``steps`` script the commits after it."""
    gate = AppendGate(monkeypatch, "hold", *steps, after_sync=after_sync)
    leader = Caller(lambda: authority.accept(mission_create("m-lead")))
    assert gate.held.wait(30)
    return gate, leader


def rebuild_after_held_leader(monkeypatch, authority, gate: AppendGate, leader: Caller, wake: type[threading.Condition]) -> Caller:
    """A rebuild started while ``leader`` holds its commit at ``gate``, with the handle's wake-up
    condition replaced by ``wake`` (a ``threading.Condition`` subclass scripting what happens as
    waiters wake); returns once the leader's commit (seq 2) ended with the rebuild waiting behind it."""
    monkeypatch.setattr(authority, "_wake", wake(authority._lock))
    rebuild = Caller(authority.rebuild, name="rebuild")
    wait_for_exclusive(authority)
    gate.release()
    assert leader.outcome().seq == 2
    return rebuild


# -- a batch withdrawn by an interrupt before the log append -------------------------------------


def test_an_ack_with_nothing_to_write_in_a_withdrawn_batch_is_decided_again_as_an_ack(tmp_path, monkeypatch):
    """An ACK at or below the stored Cursor writes nothing; when its batch is withdrawn (an
    interrupt before the log append) the next leader decides it again, still as an ACK. Before,
    deciding it the first time erased the ACK from the request, so the next leader took it for a
    Command and the authority failed (StorageFailed) over an ACK that changes nothing."""
    with open_with_group(str(tmp_path / "store")) as authority:
        assert authority.ack("consumer-1", GROUP, 1) == 1
        gate, leader = held_leader(monkeypatch, authority, "interrupt")
        interrupted = Caller(lambda: authority.accept(mission_create("m-interrupted")))
        wait_for_queue(authority, 1)
        ack = Caller(lambda: authority.ack("consumer-1", GROUP, 1))
        wait_for_queue(authority, 2)
        gate.release()  # m-lead commits; m-interrupted's caller leads the next batch (it and the ACK)
        assert leader.outcome().seq == 2
        assert isinstance(interrupted.outcome(), KeyboardInterrupt)
        assert ack.outcome() == 1
        assert authority.acked("consumer-1", GROUP) == 1
        assert authority.accept(mission_create("m-after")).seq == 3  # not failed, nothing of the withdrawn batch kept
        assert authority.state(GROUP, "mission:m-interrupted") == (0, None)


def test_the_units_of_a_withdrawn_batch_go_back_to_the_front_of_the_queue_in_their_order(tmp_path, monkeypatch):
    """A batch interrupted before its log append: its other units are decided again before any
    unit that queued up meanwhile, in the order they were queued; nothing decided in it is kept
    (the interrupted Command sent again is decided afresh)."""

    callers: dict[str, Caller] = {}
    commands = {name: mission_create(f"m-{name}") for name in ("interrupted", "first", "second")}

    def interrupt_once_another_caller_queued() -> None:
        callers["late"] = Caller(lambda: authority.accept(mission_create("m-late")))
        wait_for_queue(authority, 1)  # "late" queued while this batch was being decided
        raise KeyboardInterrupt

    with open_with_group(str(tmp_path / "store")) as authority:
        gate, leader = held_leader(monkeypatch, authority, interrupt_once_another_caller_queued)
        for length, name in enumerate(["interrupted", "first", "second"], start=1):
            callers[name] = Caller(lambda name=name: authority.accept(commands[name]))
            wait_for_queue(authority, length)
        gate.release()  # m-lead commits; the next batch (interrupted, first, second) is withdrawn
        assert leader.outcome().seq == 2
        assert isinstance(callers["interrupted"].outcome(), KeyboardInterrupt)
        assert [callers[name].outcome().seq for name in ("first", "second", "late")] == [3, 4, 5]
        assert authority.state(GROUP, "mission:m-interrupted") == (0, None)
        again = authority.accept(commands["interrupted"])
        assert (again.seq, again.aggregate) == (6, "mission:m-interrupted")


def test_a_withdrawn_command_refused_when_decided_again_gets_no_answer_from_the_withdrawn_batch(tmp_path, monkeypatch):
    """The next commit after a withdrawal refuses the Commands put back (here: the clock gives a
    bad reading): each caller gets that refusal, not the receipt decided in the withdrawn batch,
    whose Event was never written."""
    readings: list[object] = []

    def clock() -> object:
        return readings.pop() if readings else 1_700_000_000_000

    def interrupt_and_break_the_clock() -> None:
        readings.append("not a time")  # the next commit's reading
        raise KeyboardInterrupt

    with open_with_group(str(tmp_path / "store"), clock=clock) as authority:
        gate, leader = held_leader(monkeypatch, authority, interrupt_and_break_the_clock)
        interrupted = Caller(lambda: authority.accept(mission_create("m-interrupted")))
        wait_for_queue(authority, 1)
        behind = Caller(lambda: authority.accept(mission_create("m-behind")))
        wait_for_queue(authority, 2)
        gate.release()
        assert leader.outcome().seq == 2
        assert isinstance(interrupted.outcome(), KeyboardInterrupt)
        refused = behind.outcome()
        assert isinstance(refused, InvalidCommand) and refused.detail["field"] == "clock"
        assert authority.head(GROUP)[0] == 2
        assert authority.accept(mission_create("m-after")).seq == 3


def test_a_caller_arriving_while_a_rebuild_waits_for_the_role_queues_behind_the_rebuild(tmp_path, monkeypatch):
    """The leader gives the role up when rebuild (or compact, verify) waits for it. A Command
    that arrives in the moment between that and the rebuild taking the role must queue, not
    lead: a steady stream of such callers would keep the rebuild waiting for ever."""
    with open_with_group(str(tmp_path / "store")) as authority:
        gate, leader = held_leader(monkeypatch, authority)
        late: list[Caller] = []

        class Hooked(threading.Condition):
            def wait(self, timeout: float | None = None) -> bool:
                woken = super().wait(timeout)
                if threading.current_thread().name == "rebuild" and not authority._leader and not late:
                    # the role was just given up for the rebuild, which has not taken it yet
                    authority._lock.release()
                    try:
                        late.append(Caller(lambda: authority.accept(mission_create("m-late"))))
                        for _ in range(3000):  # until it sleeps in the queue, or it committed
                            if (len(authority._queue) == 1 and not authority._leader) or late[0]._outcome:
                                break
                            threading.Event().wait(0.005)
                    finally:
                        authority._lock.acquire()
                return woken

        rebuild = rebuild_after_held_leader(monkeypatch, authority, gate, leader, Hooked)
        assert rebuild.outcome() == 2  # the group.create and m-lead records: m-late came after it
        assert late and late[0].outcome().seq == 3


def test_a_rebuild_waiting_for_the_role_goes_before_the_callers_queued_behind_the_commit(tmp_path, monkeypatch):
    """A commit ends with Commands queued behind it and a rebuild waiting for the leader role:
    the role goes to the rebuild first, then to the queued Commands."""
    with open_with_group(str(tmp_path / "store")) as authority:
        gate, leader = held_leader(monkeypatch, authority)
        behind = Caller(lambda: authority.accept(mission_create("m-behind")))
        wait_for_queue(authority, 1)
        rebuild = Caller(authority.rebuild)
        wait_for_exclusive(authority)
        gate.release()
        assert leader.outcome().seq == 2
        assert rebuild.outcome() == 2  # the group.create and m-lead records: m-behind came after it
        assert behind.outcome().seq == 3


def test_close_while_a_rebuild_waits_for_the_role_still_commits_the_callers_queued_behind_it(tmp_path, monkeypatch):
    """close() runs while a rebuild waits for the leader role and a Command waits behind the
    running commit. The commit gives the role up for the rebuild, which finds the store closed
    and raises StoreClosed; it must hand the role on to the queued Command, which close() waits
    for. Before, nobody woke that caller and close() waited for it for ever."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    gate, leader = held_leader(monkeypatch, authority)
    behind = Caller(lambda: authority.accept(mission_create("m-behind")))
    wait_for_queue(authority, 1)
    rebuild = Caller(authority.rebuild)
    wait_for_exclusive(authority)
    closer = Caller(authority.close)
    for _ in range(3000):
        if authority._closed:
            break
        threading.Event().wait(0.005)
    assert authority._closed
    gate.release()
    assert leader.outcome().seq == 2
    assert isinstance(rebuild.outcome(), StoreClosed)
    assert behind.outcome().seq == 3  # queued before close(): committed, as close() promises
    assert closer.outcome() is None
    monkeypatch.undo()
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "clean"
        assert reopened.head(GROUP)[0] == 3


# -- a commit that fails answers every caller of its batch and of the batches behind it ----------


def _failing_next_sync(path: str) -> tuple[RecordingIO, Authority]:
    recorder = RecordingIO()
    with torture.recorded_log(recorder):
        authority = open_with_group(path)
    return recorder, authority


def _close_failed(authority: Authority) -> None:
    try:
        authority.close()
    except MwpError:
        pass  # a failed handle may refuse to mark its index clean


def test_a_commit_failing_after_its_log_sync_fails_the_batch_queued_behind_it(tmp_path, monkeypatch):
    """The log holds the failed batch, the index does not: a batch that was waiting behind it is
    refused (STORAGE_FAILED), never decided against the stale index and appended after it (its
    Events would repeat the failed batch's sequences in the log)."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    try:
        gate, leader = held_leader(monkeypatch, authority, after_sync=OSError(errno.EIO, "index write failed"))
        behind = Caller(lambda: authority.accept_many([mission_create("m-1"), mission_create("m-2")]))
        wait_for_queue(authority, 1)
        gate.release()
        assert isinstance(leader.outcome(), StorageFailed)
        assert [result.error_code for result in behind.outcome()] == [StorageFailed.code] * 2
        with pytest.raises(StorageFailed):
            authority.accept(mission_create("m-3"))
    finally:
        _close_failed(authority)
    with Authority.open(path) as reopened:  # the failed batch is redone from the log, nothing after it
        assert [event.aggregate for event in reopened.read(GROUP)] == [f"group:{GROUP}", "mission:m-lead"]
        assert reopened.verify().ok


def test_an_interrupt_after_the_log_append_answers_every_caller_and_fails_the_authority(tmp_path, monkeypatch):
    """KeyboardInterrupt once the batch is in the log (here: after its fdatasync, before the
    index commit): it is not withdrawn and decided again (the log holds it already); the
    authority refuses writes, the callers behind it are refused, the interrupt reaches its caller."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    try:
        gate, leader = held_leader(monkeypatch, authority, after_sync=KeyboardInterrupt())
        behind = Caller(lambda: authority.accept(mission_create("m-behind")))
        wait_for_queue(authority, 1)
        gate.release()
        assert isinstance(leader.outcome(), KeyboardInterrupt)
        assert isinstance(behind.outcome(), StorageFailed)
        assert authority.head(GROUP)[0] == 1
    finally:
        _close_failed(authority)
    with Authority.open(path) as reopened:
        assert [event.aggregate for event in reopened.read(GROUP)] == [f"group:{GROUP}", "mission:m-lead"]
        assert reopened.verify().ok


def test_a_failed_commit_keeps_the_sequence_gap_of_an_ack_beyond_every_head(tmp_path, monkeypatch):
    """An ACK beyond the Group's head is refused whatever becomes of the batch it was decided in:
    the batch failing leaves it SEQUENCE_GAP (its Commands are STORAGE_FAILED)."""

    def fail_with_eio() -> None:
        raise OSError(errno.EIO, "the log append failed")

    authority = open_with_group(str(tmp_path / "store"))
    try:
        gate, leader = held_leader(monkeypatch, authority, fail_with_eio)
        beyond = Caller(lambda: authority.ack("consumer-1", GROUP, 99))
        wait_for_queue(authority, 1)
        accepted = Caller(lambda: authority.accept(mission_create("m-1")))
        wait_for_queue(authority, 2)
        gate.release()  # m-lead commits; the next batch (the ACK, m-1) fails before its append
        assert leader.outcome().seq == 2
        assert isinstance(beyond.outcome(), SequenceGap)
        assert isinstance(accepted.outcome(), StorageFailed)
    finally:
        _close_failed(authority)


def test_an_index_transaction_that_cannot_begin_fails_the_batch_and_the_authority(tmp_path, monkeypatch):
    authority = open_with_group(str(tmp_path / "store"))
    try:
        begin = authority.index.begin

        def failing(*, write: bool = False):
            if write:
                raise lmdb.Error("the index cannot begin a write transaction")
            return begin(write=write)

        monkeypatch.setattr(authority.index, "begin", failing)
        with pytest.raises(StorageFailed):
            authority.accept(mission_create("m-1"))
        monkeypatch.undo()
        with pytest.raises(StorageFailed):  # refused until reopened, though the index works again
            authority.accept(mission_create("m-2"))
        assert authority.head(GROUP)[0] == 1
    finally:
        _close_failed(authority)


def test_a_failed_log_sync_refuses_an_in_batch_duplicate_too(tmp_path):
    """Two identical Commands in one batch: the second is answered from the first's receipt,
    which is only as durable as the batch. When the batch's fdatasync fails both are refused."""
    path = str(tmp_path / "store")
    recorder, authority = _failing_next_sync(path)
    command = mission_create("m-1", action_id="same")
    try:
        recorder.fail_sync_at = recorder.sync_calls  # the next fdatasync: this batch's
        results = authority.accept_many([command, command])
        assert recorder.failures == 1
        assert [result.error_code for result in results] == [StorageFailed.code] * 2
        assert authority.head(GROUP)[0] == 1
    finally:
        _close_failed(authority)


def test_a_failed_log_sync_refuses_a_rejection_that_rests_on_the_failed_batch(tmp_path):
    """A Command rejected because of an earlier Command of the same batch (the mission it
    creates exists only in that batch) is refused with the batch when its fdatasync fails: the
    mission may never exist. A rejection against the durable state alone stays a rejection."""
    path = str(tmp_path / "store")
    recorder, authority = _failing_next_sync(path)
    stranger = mission_create("m-9")
    stranger = type(stranger)(**{**{field: getattr(stranger, field) for field in stranger.__struct_fields__}, "actor": "stranger"})
    try:
        recorder.fail_sync_at = recorder.sync_calls
        results = authority.accept_many([stranger, mission_create("m-1"), mission_create("m-1")])
        assert recorder.failures == 1
        assert [result.error_code for result in results] == [NotAMember.code, StorageFailed.code, StorageFailed.code]
        assert authority.state(GROUP, "mission:m-1") == (0, None)
    finally:
        _close_failed(authority)


def test_a_failed_log_sync_still_answers_a_replay_of_a_durable_receipt(tmp_path):
    """A Command accepted in an earlier commit, sent again in a batch whose fdatasync fails, gets
    its original receipt (durable already); the batch's new Command is refused."""
    path = str(tmp_path / "store")
    recorder, authority = _failing_next_sync(path)
    command = mission_create("m-1", action_id="earlier")
    try:
        original = encode_receipt(authority.accept(command))
        recorder.fail_sync_at = recorder.sync_calls
        replay, new = authority.accept_many([command, mission_create("m-2")])
        assert recorder.failures == 1
        assert replay.ok and encode_receipt(replay.receipt) == original
        assert new.error_code == StorageFailed.code
        with pytest.raises(StorageFailed):  # the handle refuses writes until reopened, a replay too
            authority.accept(command)
    finally:
        _close_failed(authority)


def test_a_commit_takes_events_up_to_exactly_group_bytes_max(tmp_path, monkeypatch):
    """The per-commit byte cap is inclusive: Events that fill it exactly share one commit."""
    from mwpstore import limits

    from authority_helpers import FakeClock, record_bytes

    commands = [mission_create("m-1", action_id="a-1"), mission_create("m-2", action_id="a-2")]
    sizes = record_bytes(str(tmp_path / "measure"), commands)
    with open_with_group(str(tmp_path / "store"), clock=FakeClock()) as authority:  # the same Events again
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", sum(sizes))
        assert [result.ok for result in authority.accept_many(commands)] == [True, True]
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", sum(sizes) - 1)
        results = authority.accept_many([mission_create("m-3", action_id="a-3"), mission_create("m-4", action_id="a-4")])
        assert [result.error_code for result in results] == [None, LimitExceeded.code]


def test_a_command_refused_by_the_byte_cap_leaves_no_trace_for_the_commands_after_it(tmp_path, monkeypatch):
    """A Command refused because its Event would pass the per-commit byte cap takes no sequence:
    a smaller Command after it in the same commit gets the next one, chained to the last Event."""
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", 1_000)  # two Events of about 350 B, not a third of 1.3 KB
        big = mission_create("m-big", action_id="a-big")
        big = type(big)(**{**{field: getattr(big, field) for field in big.__struct_fields__}, "body": {"title": "x" * 1_000, "cost_limit": 1}})
        results = authority.accept_many([mission_create("m-1", action_id="a-1"), big, mission_create("m-2", action_id="a-2")])
        assert [result.error_code for result in results] == [None, LimitExceeded.code, None]
        assert [results[0].receipt.seq, results[2].receipt.seq] == [2, 3]
        monkeypatch.undo()
        assert authority.verify().ok


def test_a_command_refused_as_too_large_leaves_no_state_for_the_commands_after_it(tmp_path, monkeypatch):
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(limits, "RECORD_BYTES_MAX", 1_000)
        big = mission_create("m-1", action_id="a-big")
        big = type(big)(**{**{field: getattr(big, field) for field in big.__struct_fields__}, "body": {"title": "x" * 1_000, "cost_limit": 1}})
        results = authority.accept_many([big, mission_create("m-1", action_id="a-small")])
        assert [result.error_code for result in results] == [LimitExceeded.code, None]
        assert results[1].receipt.seq == 2 and authority.state(GROUP, "mission:m-1")[0] == 1


def test_a_kind_whose_decide_raises_refuses_only_its_command(tmp_path, monkeypatch):
    """An exception that is no typed error, raised while deciding one Command (a bug in a kind's
    decide), refuses that Command alone; the batch and the authority carry on."""
    from mwpstore import authority as authority_module

    run_transition = authority_module.run_transition

    def buggy(view, command, **options):
        if command.target == "m-bug":
            raise RuntimeError("a bug in decide")
        return run_transition(view, command, **options)

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(authority_module, "run_transition", buggy)
        results = authority.accept_many([mission_create("m-1"), mission_create("m-bug"), mission_create("m-2")])
        assert [result.ok for result in results] == [True, False, True]
        assert results[1].error_code == MwpError.code and "RuntimeError" in results[1].message
        assert authority.accept(mission_create("m-3")).seq == 4


# -- ACKs decided in one batch# -- ACKs decided in one batch --------------------------------------------------------------------


def test_acks_in_one_batch_see_the_batch_head_and_each_other(tmp_path, monkeypatch):
    """An ACK decided in the batch that also accepts the Event it names is within the head; a
    lower ACK of the same consumer decided after it in that batch does not move it backwards."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])  # head 6
        gate, leader = held_leader(monkeypatch, authority)  # m-lead: 7
        calls = [
            lambda: authority.accept(mission_create("m-8")),
            lambda: authority.ack("consumer-1", GROUP, 8),
            lambda: authority.ack("consumer-1", GROUP, 5),
            lambda: authority.ack("consumer-1", GROUP, 9),
        ]
        queued = []
        for call in calls:  # queued one after the other, in this order
            queued.append(Caller(call))
            wait_for_queue(authority, len(queued))
        gate.release()
        assert leader.outcome().seq == 7
        receipt, higher, lower, beyond = (caller.outcome() for caller in queued)
        assert receipt.seq == 8
        assert (higher, lower) == (8, 8)
        assert isinstance(beyond, SequenceGap) and beyond.detail == {"cursor": 9, "head": 8}
        assert authority.acked("consumer-1", GROUP) == 8


@pytest.mark.parametrize("cursor", [-1, True, 1.0])
def test_an_ack_of_an_impossible_cursor_is_refused_before_the_commit(tmp_path, cursor):
    with open_with_group(str(tmp_path / "store")) as authority:
        with pytest.raises(InvalidCommand) as caught:
            authority.ack("consumer-1", GROUP, cursor)
        assert caught.value.detail["field"] == "cursor"
        assert authority.acked("consumer-1", GROUP) == 0


def test_an_ack_at_the_stored_cursor_writes_nothing(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        assert authority.ack("consumer-1", GROUP, 1) == 1
        end = authority.info()["log_end"]
        assert authority.ack("consumer-1", GROUP, 1) == 1
        assert authority.ack("consumer-1", GROUP, 0) == 1
        assert authority.info()["log_end"] == end


# -- subscribe and wait_for --------------------------------------------------------------------


def test_wait_for_is_true_only_once_the_head_passes_the_cursor(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        head = authority.head(GROUP)[0]
        assert authority.wait_for(GROUP, head - 1, 0) is True
        assert authority.wait_for(GROUP, head, 0) is False
        assert authority.wait_for("g-unknown", 0, 0) is False


def _subscriber_waiting(monkeypatch, authority) -> threading.Event:
    """Set once a caller of ``authority.wait_for`` sleeps on its condition (it holds the
    condition's lock until then, so no commit or close can notify it in between)."""
    waiting = threading.Event()

    class Recorded(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(authority, "_published", Recorded(threading.Lock()))
    return waiting


def test_a_waiting_subscriber_is_woken_with_the_events_accepted_meanwhile(tmp_path, monkeypatch):
    with open_with_group(str(tmp_path / "store")) as authority:
        subscription = authority.subscribe(GROUP, after=1)
        waiting = _subscriber_waiting(monkeypatch, authority)
        polled = Caller(lambda: subscription.poll(timeout=120))  # woken by the commit, long before that
        assert waiting.wait(30)  # it read nothing new before this accept and sleeps
        receipt = authority.accept(mission_create("m-1"))
        assert [event.seq for event in polled.outcome()] == [receipt.seq]
        assert subscription.cursor == receipt.seq


def test_close_wakes_a_subscriber_waiting_without_a_timeout(tmp_path, monkeypatch):
    authority = open_with_group(str(tmp_path / "store"))
    subscription = authority.subscribe(GROUP, after=1)
    waiting = _subscriber_waiting(monkeypatch, authority)
    polled = Caller(lambda: subscription.poll(timeout=None))
    assert waiting.wait(30)
    authority.close()
    assert isinstance(polled.outcome(), StoreClosed)
    assert list(subscription) == []  # iterating a subscription of a closed store ends at once


@pytest.mark.parametrize("timeout", [None, 120.0, 0])
def test_a_poll_the_close_meets_between_its_head_read_and_its_sleep_raises_store_closed(tmp_path, monkeypatch, timeout):
    """close() marks the store closed, then wakes the waiters once it gets the condition's lock. A
    poll whose wait_for had read the head just before (holding that lock, so close() could not wake
    it yet) saw the store closed and returned [], where a poll woken by close() raises StoreClosed:
    it raises StoreClosed too, also when its timeout has run out by then (0: it returned [] as if
    no Event had come). A poll after the close raises it; iterating just ends."""
    authority = open_with_group(str(tmp_path / "store"))
    subscription = authority.subscribe(GROUP, after=1)
    read_head, closing = authority.head, []

    def head(group: str) -> tuple[int, bytes]:
        answer = read_head(group)
        if not closing:  # close() begins here and waits for the condition lock this poll holds
            closing.append(Caller(authority.close))
            while not authority._closed:
                threading.Event().wait(0.001)
        return answer

    monkeypatch.setattr(authority, "head", head)
    with pytest.raises(StoreClosed):
        subscription.poll(timeout=timeout)
    assert closing and closing[0].outcome() is None
    with pytest.raises(StoreClosed):
        subscription.poll(timeout=0)
    assert list(subscription) == []


def test_a_closed_subscription_refuses_to_poll_and_stops_iterating(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        subscription = authority.subscribe(GROUP)
        subscription.close()
        with pytest.raises(StoreClosed):
            subscription.poll(timeout=0)
        assert list(subscription) == []


# -- close against a caller on its way into the commit queue -----------------------------------


def test_a_command_that_reaches_the_queue_after_close_is_store_closed(tmp_path, monkeypatch):
    """accept() passed its checks, then close() ran to its end before the Command was queued: it
    is refused (STORE_CLOSED) instead of being committed to the closed log and index."""
    from mwpstore import authority as authority_module

    path = str(tmp_path / "store")
    authority = open_with_group(path)
    on_the_way, closed = threading.Event(), threading.Event()
    prepare = authority_module._decide_on_what_was_hashed

    def held(request) -> None:  # the first step of _submit, before the queue's lock
        on_the_way.set()
        assert closed.wait(30)
        prepare(request)

    monkeypatch.setattr(authority_module, "_decide_on_what_was_hashed", held)
    late = Caller(lambda: authority.accept(mission_create("m-late")))
    assert on_the_way.wait(30)
    authority.close()
    closed.set()
    assert isinstance(late.outcome(), StoreClosed)
    monkeypatch.undo()
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "clean"
        assert reopened.head(GROUP)[0] == 1


# -- accept_many: one result per Command, in order ---------------------------------------------


def test_accept_many_answers_each_command_in_its_place_around_refused_ones(tmp_path):
    """Commands refused before the commit (invalid) and in it (a rejection) keep their places;
    the accepted ones around them get their own receipts."""
    with open_with_group(str(tmp_path / "store")) as authority:
        invalid = mission_create("m-x")
        invalid = type(invalid)(**{**{field: getattr(invalid, field) for field in invalid.__struct_fields__}, "group": "not a group!"})
        results = authority.accept_many([invalid, mission_create("m-1"), mission_create("m-1"), invalid, mission_create("m-2")])
        assert [result.error_code for result in results] == [InvalidCommand.code, None, AlreadyExists.code, InvalidCommand.code, None]
        assert [result.receipt.aggregate for result in results if result.ok] == ["mission:m-1", "mission:m-2"]
        assert [result.receipt.seq for result in results if result.ok] == [2, 3]


# -- an ACK or a snapshot's record that meets a full commit ------------------------------------


def _commit_bytes_of(tmp_path, monkeypatch, commands: list) -> int:
    """The record bytes that ``commands``, accepted in one commit after a commit of one Command,
    take on a store like the tests below (same clock, same sequences): a spy on the batch, which
    changes nothing."""
    from mwpstore import authority as authority_module

    sizes: list[int] = []
    add_record = authority_module._Batch.add_record

    def spy(batch, record: bytes, framed: int) -> None:
        sizes.append(len(record))
        add_record(batch, record, framed)

    with open_with_group(str(tmp_path / "measure"), clock=lambda: 1_700_000_000_000) as authority:
        authority.accept(mission_create("m-first"))
        monkeypatch.setattr(authority_module._Batch, "add_record", spy)
        assert all(result.ok for result in authority.accept_many(commands))
        monkeypatch.undo()
    return sum(sizes)


@pytest.mark.parametrize("late", ["ack", "snapshot"])
def test_an_ack_or_a_snapshot_record_that_meets_a_full_commit_is_refused_retryably(tmp_path, monkeypatch, late):
    """docs/api.md: an ack, or the record a snapshot writes, that meets a commit already full is
    refused like a Command past the bound (LIMIT_EXCEEDED, field commands), retryably; the
    Commands of that commit stay accepted and a second call succeeds."""
    from mwpstore import limits

    commands = [mission_create("m-1"), mission_create("m-2")]
    full = _commit_bytes_of(tmp_path, monkeypatch, commands)
    with open_with_group(str(tmp_path / "store"), clock=lambda: 1_700_000_000_000) as authority:
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", full)  # exactly the two Commands' records
        gate = AppendGate(monkeypatch, "hold")
        first = Caller(lambda: authority.accept(mission_create("m-first")))
        assert gate.held.wait(30)
        many = Caller(lambda: authority.accept_many(commands))
        wait_for_queue(authority, 1)
        second = Caller(lambda: authority.ack("c-1", GROUP, 1) if late == "ack" else authority.snapshot(GROUP))
        wait_for_queue(authority, 2)
        gate.release()
        assert first.outcome().seq == 2
        assert [result.receipt.seq for result in many.outcome()] == [3, 4]
        refused = second.outcome()
        assert isinstance(refused, LimitExceeded) and refused.field == "commands", refused
        assert "again" in refused.message
        assert authority.acked("c-1", GROUP) == 0 and authority.snapshots(GROUP) == []
        snapshot_files = [name for _, _, names in os.walk(os.path.join(authority.path, "snapshots")) for name in names]
        assert snapshot_files == []  # a refused snapshot leaves no file that no reference names
        monkeypatch.undo()
        if late == "ack":
            assert authority.ack("c-1", GROUP, 1) == 1
        else:
            assert authority.snapshot(GROUP).seq == 4
            assert [ref.seq for ref in authority.snapshots(GROUP)] == [4]
        assert authority.verify().ok


def test_an_archive_whose_record_meets_a_full_commit_leaves_no_audit_log_and_a_retry_archives(tmp_path, monkeypatch):
    """The archive record is logged after the audit log is written: refused by a full commit
    (here a commit bound below the record's size while it is logged), archive() raised the
    retryable LIMIT_EXCEEDED and left the audit log that no record names; now the file goes and
    a second archive() writes it again and logs its record."""
    from mwpstore import authority as authority_module, limits

    with open_with_group(str(tmp_path / "store")) as authority:
        log_note = authority._log_note

        def full_for_the_record(tag: bytes, key: bytes, value: bytes) -> None:
            if tag != authority_module.ARCHIVE_TAG:
                return log_note(tag, key, value)
            with monkeypatch.context() as patch:
                patch.setattr(limits, "GROUP_BYTES_MAX", len(tag) + len(value) - 1)
                return log_note(tag, key, value)

        monkeypatch.setattr(authority, "_log_note", full_for_the_record)
        with pytest.raises(LimitExceeded) as caught:
            authority.archive(GROUP, actor="owner", action_id="archive-1")
        assert caught.value.field == "commands"
        assert authority.archive_record(GROUP) is None
        assert os.listdir(os.path.join(authority.path, "archive", GROUP)) == []
        monkeypatch.undo()
        record = authority.archive(GROUP, actor="owner", action_id="archive-1")
        assert os.path.isfile(os.path.join(authority.path, record.audit_location))
        assert authority.archive_record(GROUP) == record and authority.verify().ok


def test_a_rebuild_interrupted_while_a_commit_holds_the_role_leaves_the_role_to_it(tmp_path, monkeypatch):
    """An interrupt (KeyboardInterrupt) reaching a rebuild while it still waits for the leader
    role, which a commit holds: the role stays the commit's. Handed on or given up there, a
    Command accepted next would commit beside the commit in flight instead of queueing behind it."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    gate, leader = held_leader(monkeypatch, authority)

    class Interrupting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            woken = super().wait(timeout)
            if threading.current_thread().name == "rebuild" and authority._leader:
                raise KeyboardInterrupt  # still waiting: the commit holds the role
            return woken

    monkeypatch.setattr(authority, "_wake", Interrupting(authority._lock))
    rebuild = Caller(authority.rebuild, name="rebuild")
    assert isinstance(rebuild.outcome(), KeyboardInterrupt)
    behind = Caller(lambda: authority.accept(mission_create("m-behind")))
    wait_for_queue(authority, 1)  # behind the commit in flight
    gate.release()
    assert leader.outcome().seq == 2
    assert behind.outcome().seq == 3
    assert authority._exclusive_waiting == 0 and not authority._leader
    assert authority.rebuild() == 3
    monkeypatch.undo()
    authority.close()
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "clean" and reopened.head(GROUP)[0] == 3


def test_a_rebuild_interrupted_as_the_role_is_given_up_for_it_hands_the_role_to_the_queue(tmp_path, monkeypatch):
    """A commit ends with a Command queued behind it and a rebuild waiting for the leader role:
    the leader gives the role up for the rebuild. An interrupt (KeyboardInterrupt) that reaches
    the rebuild right then must not drop the role: the queued caller would sleep for ever, and
    close() would wait for it for ever. The queued caller then leads with the role marked taken:
    a Command accepted while its commit runs queues behind it, as behind any commit."""
    path = str(tmp_path / "store")
    authority = open_with_group(path)
    during: list[Caller] = []

    def another_command_meanwhile() -> None:  # in m-behind's commit
        during.append(Caller(lambda: authority.accept(mission_create("m-during"))))
        wait_for_queue(authority, 1)

    gate, leader = held_leader(monkeypatch, authority, another_command_meanwhile)
    behind = Caller(lambda: authority.accept(mission_create("m-behind")))
    wait_for_queue(authority, 1)

    class Interrupting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            woken = super().wait(timeout)
            if threading.current_thread().name == "rebuild" and not authority._leader:
                raise KeyboardInterrupt  # the role was just given up for the rebuild
            return woken

    rebuild = rebuild_after_held_leader(monkeypatch, authority, gate, leader, Interrupting)
    assert isinstance(rebuild.outcome(), KeyboardInterrupt)
    assert behind.outcome().seq == 3
    assert during[0].outcome().seq == 4
    assert authority._exclusive_waiting == 0 and not authority._leader
    assert authority.accept(mission_create("m-after")).seq == 5  # the handle keeps working
    assert authority.rebuild() == 5
    closer = Caller(authority.close)
    assert closer.outcome() is None
    monkeypatch.undo()
    with Authority.open(path) as reopened:
        assert reopened.open_report.mode == "clean"
        assert reopened.head(GROUP)[0] == 5
