"""The authority's read side, rule by rule: the argument checks of every reading call, which
records a read serves (and which index damage it refuses), subscriptions, ``info`` and
progress callables.

Each rule here was found unpinned by a mutation round over the read side and the error
translation: the code kept it, but no test failed when it was switched off."""

from __future__ import annotations

import itertools
import os
import select
import shutil
import signal
import threading

import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group
from blocking import outcome_within
from mwpstore import Authority, Corruption, InvalidCommand, limits
from mwpstore.index import event_key

NOT_IDS = [None, 5, "", "x" * (limits.ID_CHARS_MAX + 1), "bad id", "a\x00b", "-dash"]


def _point_at(authority: Authority, group: str, seq: int, other_group: str, other_seq: int) -> None:
    """Make the index entry of ``group``:``seq`` point at the log record of ``other_group``:``other_seq``
    (sealed as the index seals every value: only where it points is wrong)."""
    index = authority.index
    with index.begin(write=True) as txn:
        value = bytes(index.get(txn, b"events", event_key(other_group, other_seq)))
        index.put(txn, b"events", event_key(group, seq), value, new=False)


# -- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", NOT_IDS, ids=repr)
def test_every_reading_call_refuses_a_group_or_consumer_that_is_not_an_id(tmp_path, bad):
    """Each call refuses it itself, naming the argument (``group`` or ``consumer``), and writes
    nothing: unchecked, an empty or malformed name reads as a Group that has no Events, and one
    that is not a str fails with a foreign error."""
    with open_with_group(str(tmp_path / "store")) as authority:
        end = authority.info()["log_end"]
        by_group = {
            "read": lambda: authority.read(bad),
            "head": lambda: authority.head(bad),
            "state": lambda: authority.state(bad, f"group:{GROUP}"),
            "aggregates": lambda: authority.aggregates(bad),
            "replay_floor": lambda: authority.replay_floor(bad),
            "subscribe": lambda: authority.subscribe(bad),
            "wait_for": lambda: authority.wait_for(bad, 0, 0),
            "ack": lambda: authority.ack("consumer-1", bad, 0),
            "acked": lambda: authority.acked("consumer-1", bad),
        }
        by_consumer = {
            "ack": lambda: authority.ack(bad, GROUP, 1),
            "acked": lambda: authority.acked(bad, GROUP),
        }
        for field, calls in (("group", by_group), ("consumer", by_consumer)):
            for name, call in calls.items():
                with pytest.raises(InvalidCommand) as caught:
                    call()
                assert caught.value.field == field, name
        assert authority.info()["log_end"] == end


def test_the_highest_cursor_is_a_cursor_read_and_subscribe_take(tmp_path):
    """``after`` may be anything in 0..2^63 - 1, the bound included (docs: integers outside
    ±(2^63 - 1) are refused; the bound itself is not outside)."""
    with open_with_group(str(tmp_path / "store")) as authority:
        assert authority.read(GROUP, after=limits.INT_ABS_MAX) == []
        subscription = authority.subscribe(GROUP, after=limits.INT_ABS_MAX)
        assert subscription.cursor == limits.INT_ABS_MAX and subscription.poll(timeout=0) == []


def test_wait_for_takes_every_timeout_up_to_timeout_max_inclusive(tmp_path):
    """``timeout`` is None or 0..threading.TIMEOUT_MAX seconds, both bounds included; with the
    head already past ``after`` it returns True at once whatever the timeout."""
    with open_with_group(str(tmp_path / "store")) as authority:
        for timeout in (0, 0.0, 1, threading.TIMEOUT_MAX, None):
            assert authority.wait_for(GROUP, 0, timeout) is True
        assert authority.wait_for(GROUP, 1, 0) is False


def test_wait_for_in_a_forked_child_is_store_closed_even_when_the_fork_came_while_its_lock_was_held(tmp_path):
    """A handle used in a forked child is StoreClosed. wait_for must say so before it takes its
    condition's lock: a thread of the parent may have held that lock at the fork (a waiter
    between its head read and its sleep), and in the child nobody ever releases it. Here the
    test thread holds it while it forks; the child's wait_for must answer, not hang."""
    with open_with_group(str(tmp_path / "store")) as authority:
        reading, writing = os.pipe()
        with authority._published:  # type: ignore[attr-defined]  # as a waiter in wait_for holds it
            pid = os.fork()
            if pid == 0:  # the child: report through the pipe, never return into pytest
                try:
                    authority.wait_for(GROUP, 5, 0)
                    outcome = "returned"
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    outcome = type(exc).__name__
                os.write(writing, outcome.encode())
                os._exit(0)
        os.close(writing)
        try:
            answered, _, _ = select.select([reading], [], [], 60)  # it answers at once, or never
            if not answered:
                os.kill(pid, signal.SIGKILL)
            outcome = os.read(reading, 100).decode() if answered else "hung"
        finally:
            os.close(reading)
            os.waitpid(pid, 0)
        assert outcome == "StoreClosed"


# -- what a read serves -------------------------------------------------------------------------


def test_an_index_entry_pointing_at_another_groups_event_of_the_same_sequence_is_corruption(tmp_path):
    """The record a read serves must be the Group's own Event, not only one with the right
    sequence: here g-1:2 points at g-2:2."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(group_create("g-2"))
        authority.accept(mission_create("m-1"))
        authority.accept(mission_create("m-2", group="g-2"))
        _point_at(authority, GROUP, 2, "g-2", 2)
        with pytest.raises(Corruption) as caught:
            authority.read(GROUP, after=1)
        assert caught.value.detail["reason"] == "index" and f"{GROUP}:2" in caught.value.message
        assert [event.event_id for event in authority.read("g-2")] == ["g-2:1", "g-2:2"]


def test_an_index_that_points_the_last_wanted_event_at_the_one_before_is_corruption_not_a_short_page(tmp_path):
    """A page of 8 or more Events is read as one run of log records from the first to the last
    the index names. If the last entry points at the Event before it, the run holds one record
    fewer than the page: the read must say CORRUPTION, not serve the shorter page as if the
    Group ended there."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(12)])  # head 13
        _point_at(authority, GROUP, 13, GROUP, 12)
        for after, limit in ((0, 1000), (0, 13), (4, 9)):
            with pytest.raises(Corruption) as caught:
                authority.read(GROUP, after=after, limit=limit)
            assert caught.value.detail["reason"] == "index"
        assert [event.seq for event in authority.read(GROUP, limit=12)] == list(range(1, 13))


def test_a_group_whose_name_starts_another_groups_name_reads_only_its_own(tmp_path):
    """g-1's keys are a prefix of g-10's: reads, aggregates and every other per-Group lookup stop
    at the end of g-1's own entries, whatever the cursor and page size."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(group_create("g-10"))
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])  # g-1: head 4
        authority.accept_many([mission_create(f"n-{i}", group="g-10") for i in range(12)])  # g-10: head 13
        for after in range(5):
            for limit in (1, 2, 1000):
                events = authority.read(GROUP, after=after, limit=limit)
                assert [(event.group, event.seq) for event in events] == [(GROUP, seq) for seq in range(after + 1, 5)][:limit]
        assert [key for key, _, _ in authority.aggregates(GROUP)] == [f"group:{GROUP}", f"member:{OWNER}"] + [f"mission:m-{i}" for i in range(3)]
        assert [key for key, _, _ in authority.aggregates(GROUP, prefix="mission:")] == [f"mission:m-{i}" for i in range(3)]
        assert sorted(authority.groups()) == [GROUP, "g-10"]
        assert (authority.head(GROUP)[0], authority.head("g-10")[0]) == (4, 13)


# -- subscriptions ------------------------------------------------------------------------------


def test_a_poll_returns_every_event_after_the_cursor_once_and_iteration_yields_each_once(tmp_path):
    """A poll returns all the Events after its cursor (up to its batch) and moves the cursor to
    the last of them, so the next poll starts after it; iterating yields every Event of every
    poll, each once, in order."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(4)])  # head 5
        subscription = authority.subscribe(GROUP, after=1)
        assert [event.seq for event in subscription.poll(timeout=0)] == [2, 3, 4, 5] and subscription.cursor == 5
        assert subscription.poll(timeout=0) == [] and subscription.cursor == 5
        authority.accept_many([mission_create(f"n-{i}") for i in range(3)])  # 6, 7, 8 in one commit
        authority.accept(mission_create("o-0"))  # 9
        iterated = outcome_within(60, lambda: [event.seq for event in itertools.islice(subscription, 4)])
        assert iterated == [6, 7, 8, 9] and subscription.cursor == 9
        subscription.close()


# -- info ---------------------------------------------------------------------------------------


def test_info_reports_each_groups_head_the_logs_segments_and_how_the_store_opened(tmp_path):
    """The facts ``mwpstore inspect`` prints: every Group's head sequence and hash, the log's
    bounds, each segment (the sealed one trimmed to what it holds, the active one preallocated
    and partly used), and the open report, redo count included."""
    path = str(tmp_path / "store")
    with Authority.open(path, segment_bytes=65536) as authority:
        authority.accept(group_create())
        authority.accept(group_create("g-2"))
        authority.accept_many([mission_create(f"m-{i}", cost_limit=1) for i in range(300)])  # fills a segment
        facts = authority.info()
        assert facts["path"] == authority.path
        assert facts["groups"] == {group: {"seq": authority.head(group)[0], "head_hash": authority.head(group)[1].hex()}
                                   for group in (GROUP, "g-2")}
        first, active = facts["segments"]
        assert (first["sealed"], active["sealed"]) == (True, False)
        assert first["first_position"] == facts["log_start"] < active["first_position"] < facts["log_end"]
        assert first["used_bytes"] == first["size_bytes"] < 65536  # trimmed when sealed
        assert 0 < active["used_bytes"] < active["size_bytes"] == 65536
        report = authority.open_report
        assert facts["open"] == {"mode": report.mode, "reason": report.reason, "redo_records": report.redo_records}
    shutil.copytree(os.path.join(path, "index"), str(tmp_path / "index-before"))
    with Authority.open(path) as authority:
        assert authority.info()["open"] == {"mode": "clean", "reason": "index trusted", "redo_records": 0}
        authority.ack("consumer-1", GROUP, 1)
        authority.ack("consumer-2", GROUP, 1)
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(str(tmp_path / "index-before"), os.path.join(path, "index"))  # the ACKs are in the log only
    with Authority.open(path) as authority:
        opened = authority.info()["open"]
        assert (opened["mode"], opened["redo_records"]) == ("redo", 2) and opened["reason"] == authority.open_report.reason


# -- progress callables -------------------------------------------------------------------------


def test_an_interrupt_raised_by_a_progress_callable_passes_unchanged(tmp_path):
    """What a progress callable raises reaches the caller as ``InvalidCommand`` (field
    ``progress``) when it is an ``Exception``; what is not (``KeyboardInterrupt``) passes as it
    is, so a Ctrl-C during a verify or a rebuild stays a Ctrl-C. The store is as it was."""
    interrupt = KeyboardInterrupt()

    def progress(done: int, total: int) -> None:
        raise interrupt

    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(20)])
        events = authority.read(GROUP)
        for call in (lambda: authority.verify(progress), lambda: authority.rebuild(progress)):
            with pytest.raises(KeyboardInterrupt) as caught:
                call()
            assert caught.value is interrupt
        assert authority.read(GROUP) == events and authority.verify().ok
        assert authority.accept(mission_create("m-after")).seq == 22


def test_groups_lists_every_group_sorted_by_id_whatever_the_order_they_were_created_in(tmp_path):
    """``groups()`` is sorted by ID (byte order of the ASCII IDs, so ``g-10`` before ``g-2``),
    not in creation order, in the writer, after a reopen and in a read-only view."""
    path = str(tmp_path / "store")
    with Authority.open(path) as authority:
        for group in ("g-2", "g-10", "g-1", "a-9"):
            authority.accept(group_create(group))
        assert authority.groups() == ["a-9", "g-1", "g-10", "g-2"]
    with Authority.open(path) as authority:
        assert authority.groups() == ["a-9", "g-1", "g-10", "g-2"]
    with Authority.open(path, readonly=True) as view:
        assert view.groups() == ["a-9", "g-1", "g-10", "g-2"]
