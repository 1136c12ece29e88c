"""The acceptance engine: atomicity, idempotency receipts, revisions, group commit, replay, ACK."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import lmdb
import pytest

from authority_helpers import (
    GROUP,
    OWNER,
    FakeClock,
    group_create,
    in_a_forked_child,
    index_names_log,
    mission_create,
    mission_update,
    open_with_group,
    store_with_one_event_rewritten,
)
from mwpstore import canonical, limits
from mwpstore import (
    ActionIdCollision,
    Authority,
    Command,
    Corruption,
    CursorTooOld,
    InvalidCommand,
    LimitExceeded,
    MwpError,
    NotAMember,
    RevisionMismatch,
    SequenceGap,
    StorageFailed,
    StoreClosed,
    StoreLocked,
    StoreNotFound,
    Unauthorized,
)
from mwpstore.errors import AlreadyExists, UnknownKind
from mwpstore.index import Index, read_u64, receipt_key, remove_index, u64
from mwpstore.messages import encode_receipt
from mwpstore.segment_log import SegmentLog
from mwpstore.snapshot import SigningKey, SnapshotRef, verify_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def store(tmp_path):
    clock = FakeClock()
    authority = open_with_group(str(tmp_path / "store"), clock=clock)
    authority.test_clock = clock  # type: ignore[attr-defined]
    yield authority
    authority.close()


# -- MWP-EVT-005: one atomic result ---------------------------------------------------------------


def test_evt_005_event_state_revision_and_receipt_are_one_result(store):
    receipt = store.accept(mission_create("m-1"))
    assert receipt.seq == 2 and receipt.revision == 1 and receipt.aggregate == "mission:m-1"
    [event] = store.read(GROUP, after=1)
    assert event.event_id == receipt.event_id == f"{GROUP}:2"
    assert event.hash == receipt.event_hash
    revision, state = store.state(GROUP, "mission:m-1")
    assert revision == 1 and state is not None and state["title"] == "mission m-1"
    assert store.head(GROUP) == (2, event.hash)


def test_evt_005_rejected_command_leaves_no_trace(store):
    head = store.head(GROUP)
    with pytest.raises(NotAMember):
        store.accept(Command(actor="stranger", action_id="x1", group=GROUP, kind="mission.create", target="m-9", body={"title": "t", "cost_limit": 1}))
    assert store.head(GROUP) == head
    assert store.state(GROUP, "mission:m-9") == (0, None)
    # a rejected Command left no receipt: the same Action ID with other content is not a collision
    with pytest.raises(NotAMember):
        store.accept(Command(actor="stranger", action_id="x1", group=GROUP, kind="mission.create", target="m-8", body={"title": "t", "cost_limit": 1}))


def test_evt_005_rejection_inside_batch_does_not_disturb_the_others(store):
    commands = [mission_create(f"m-{i}") for i in range(5)]
    commands.insert(2, mission_create("m-1", action_id="dup-target"))  # m-1 exists by then: rejected
    results = store.accept_many(commands)
    assert [result.ok for result in results] == [True, True, False, True, True, True]
    assert results[2].error_code == AlreadyExists.code
    assert isinstance(results[2].error, AlreadyExists)
    seqs = [result.receipt.seq for result in results if result.ok]
    assert seqs == [2, 3, 4, 5, 6]
    assert [event.seq for event in store.read(GROUP)] == [1, 2, 3, 4, 5, 6]


# -- MWP-EVT-003: permanent idempotency receipts ------------------------------------------------


def test_evt_003_duplicate_returns_original_receipt_and_appends_nothing(store):
    command = mission_create("m-1", action_id="act-1")
    first = store.accept(command)
    head = store.head(GROUP)
    second = store.accept(command)
    assert encode_receipt(second) == encode_receipt(first)
    assert store.head(GROUP) == head


def test_evt_003_different_content_same_action_id_is_collision(store):
    store.accept(mission_create("m-1", action_id="act-1"))
    with pytest.raises(ActionIdCollision) as caught:
        store.accept(mission_create("m-2", action_id="act-1"))
    assert caught.value.code == "ACTION_ID_COLLISION"
    assert store.state(GROUP, "mission:m-2") == (0, None)


def test_evt_003_receipt_is_identical_after_reopen_and_rebuild(tmp_path):
    path = str(tmp_path / "store")
    command = mission_create("m-1", action_id="act-1")
    with open_with_group(path) as authority:
        original = encode_receipt(authority.accept(command))
    with Authority.open(path) as authority:
        assert encode_receipt(authority.accept(command)) == original
        authority.rebuild()
        assert encode_receipt(authority.accept(command)) == original
        with pytest.raises(ActionIdCollision):
            authority.accept(mission_create("m-1", action_id="act-1", cost_limit=5))
        assert authority.head(GROUP)[0] == 2


def test_evt_003_two_threads_same_command_make_one_event(store):
    for round_number in range(20):
        command = mission_create(f"race-{round_number}", action_id=f"race-{round_number}")
        receipts: list[bytes] = []
        barrier = threading.Barrier(2)

        def send() -> None:
            barrier.wait()
            receipts.append(encode_receipt(store.accept(command)))

        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(receipts) == 2 and receipts[0] == receipts[1]
    events = store.read(GROUP)
    assert len(events) == 21
    assert len({event.action_id for event in events}) == 21


def test_evt_003_duplicates_inside_one_accept_many(store):
    command = mission_create("m-1", action_id="same")
    results = store.accept_many([command, command, mission_create("m-1", action_id="same", cost_limit=7)])
    assert results[0].ok and results[1].ok
    assert encode_receipt(results[0].receipt) == encode_receipt(results[1].receipt)
    assert results[2].error_code == ActionIdCollision.code
    assert store.head(GROUP)[0] == 2


# -- MWP-EVT-007: optimistic concurrency ----------------------------------------------------------


def test_evt_007_revision_mismatch_rejects_whole_command_with_current_revision(store):
    store.accept(mission_create("m-1"))
    store.accept(mission_update("m-1", expected_revision=1, title="second"))
    with pytest.raises(RevisionMismatch) as caught:
        store.accept(mission_update("m-1", expected_revision=1, title="stale"))
    assert caught.value.current_revision == 2
    assert store.state(GROUP, "mission:m-1")[1]["title"] == "second"


def test_evt_007_compare_and_set_kind_requires_expected_revision(store):
    store.accept(mission_create("m-1"))
    with pytest.raises(InvalidCommand) as caught:
        store.accept(mission_update("m-1", expected_revision=None, title="x"))
    assert caught.value.field == "expected_revision"


def test_evt_007_concurrent_updates_only_one_wins(store):
    store.accept(mission_create("m-1"))
    outcomes: list[str] = []

    def update(index: int) -> None:
        try:
            store.accept(mission_update("m-1", expected_revision=1, title=f"t{index}"))
            outcomes.append("ok")
        except RevisionMismatch:
            outcomes.append("mismatch")

    threads = [threading.Thread(target=update, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["mismatch"] * 7 + ["ok"]
    assert store.state(GROUP, "mission:m-1")[0] == 2


# -- group commit ---------------------------------------------------------------------------------


def test_group_commit_16_threads_contiguous_sequences_and_own_receipts(store):
    per_thread = 40
    receipts: dict[str, int] = {}
    lock = threading.Lock()

    def work(thread_index: int) -> None:
        for i in range(per_thread):
            action = f"t{thread_index}-{i}"
            receipt = store.accept(mission_create(f"m-{action}", action_id=action))
            with lock:
                receipts[action] = receipt.seq

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = store.read(GROUP, limit=10_000)
    assert [event.seq for event in events] == list(range(1, 16 * per_thread + 2))
    by_action = {event.action_id: event.seq for event in events}
    assert all(by_action[action] == seq for action, seq in receipts.items())
    assert store.verify().ok


def test_group_commit_hands_leadership_over_while_rebuild_and_verify_hold_it_off(store):
    """Leadership passes from caller to caller; ``rebuild``/``verify`` (which hold commits off)
    still get their turn, and after them the queued callers are led again: no caller is left
    asleep, none is answered twice, and the close at the end finds nothing pending."""
    per_thread, threads_count = 25, 8
    receipts: dict[str, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(thread_index: int) -> None:
        try:
            for i in range(per_thread):
                action = f"h{thread_index}-{i}"
                receipt = store.accept(mission_create(f"m-{action}", action_id=action))
                with lock:
                    receipts[action] = receipt.seq
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    for thread in threads:
        thread.start()
    for _ in range(3):
        store.rebuild()
        assert store.verify().ok
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a caller was never woken"
    assert errors == []
    events = store.read(GROUP, limit=10_000)
    assert len(receipts) == per_thread * threads_count
    assert [event.seq for event in events] == list(range(1, per_thread * threads_count + 2))
    assert {event.action_id: event.seq for event in events if event.action_id in receipts} == receipts


# -- replay, subscribe, ACK ----------------------------------------------------------------------


def test_read_in_sequence_order_with_after_and_limit(store):
    store.accept_many([mission_create(f"m-{i}") for i in range(10)])
    assert [event.seq for event in store.read(GROUP, after=3, limit=4)] == [4, 5, 6, 7]
    assert store.read(GROUP, after=11) == []
    assert store.read("unknown-group") == []


def test_read_pages_are_the_same_whether_the_log_holds_one_group_or_interleaves_others(store):
    """A page whose Events lie one after another in the log is read as one run of records; a page
    with other Groups' Events or ACKs in between is looked up Event by Event. Every page size, from
    every cursor, gives the same Events as reading them one at a time."""
    other = "g-other"
    store.accept(group_create(other, action_id="other.create"))
    store.accept_many([mission_create(f"a-{i}") for i in range(20)])  # a run of this Group alone
    for i in range(12):  # then interleaved with another Group's Events and ACKs
        store.accept(mission_create(f"b-{i}"))
        store.accept(mission_create(f"o-{i}", group=other))
        if i % 4 == 0:
            store.ack("consumer", GROUP, store.head(GROUP)[0])
    store.accept_many([mission_create(f"c-{i}") for i in range(20)])
    head = store.head(GROUP)[0]
    one_by_one = [store.read(GROUP, after=seq - 1, limit=1)[0] for seq in range(1, head + 1)]
    assert [event.seq for event in one_by_one] == list(range(1, head + 1))
    for limit in (7, 8, 9, 15, 30, 1000):
        for after in range(0, head + 1, 5):
            assert store.read(GROUP, after=after, limit=limit) == one_by_one[after : after + limit]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"after": -1}, "after"), ({"after": "1"}, "after"), ({"limit": 0}, "limit"), ({"limit": 10**9}, "limit"),
     ({"limit": True}, "limit"), ({"limit": 5.0}, "limit")],
)
def test_read_rejects_bad_arguments(store, kwargs, field):
    with pytest.raises(InvalidCommand) as caught:
        store.read(GROUP, **kwargs)
    assert caught.value.field == field


def test_subscribe_yields_events_as_they_are_accepted(store):
    subscriptions = [store.subscribe(GROUP, after=1) for _ in range(3)]
    seen: list[list[int]] = [[] for _ in subscriptions]

    def consume(index: int) -> None:
        while len(seen[index]) < 5:
            seen[index].extend(event.seq for event in subscriptions[index].poll(timeout=5))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for i in range(5):
        store.accept(mission_create(f"m-{i}"))
    for thread in threads:
        thread.join(timeout=10)
    assert seen == [[2, 3, 4, 5, 6]] * 3
    assert subscriptions[0].poll(timeout=0.05) == []


def test_ack_is_durable_monotonic_and_never_beyond_head(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
        assert authority.ack("agent-1", GROUP, 4) == 4
        assert authority.ack("agent-1", GROUP, 2) == 4  # never moves backwards
        with pytest.raises(SequenceGap):
            authority.ack("agent-1", GROUP, 7)
        assert authority.acked("agent-1", GROUP) == 4
    with Authority.open(path) as authority:
        assert authority.acked("agent-1", GROUP) == 4
        assert len(authority.read(GROUP)) == 6  # ACK deletes no history
        authority.rebuild()
        assert authority.acked("agent-1", GROUP) == 4


def test_cursor_below_replay_floor_is_cursor_too_old_with_signed_snapshot(tmp_path):
    with Authority.open(str(tmp_path / "store")) as authority:
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body={"org": "acme", "policy": {"replay_window_events": 2}}))
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
        assert authority.replay_floor(GROUP) == (0, None)  # no snapshot yet: everything replayable
        assert len(authority.read(GROUP)) == 6
        head_at_snapshot = authority.head(GROUP)
        ref = authority.snapshot(GROUP)
        assert ref.seq == 6 and authority.snapshots(GROUP) == [ref]
        assert authority.replay_floor(GROUP) == (0, None)  # the snapshot is inside the window
        authority.accept_many([mission_create(f"n-{i}") for i in range(3)])
        assert authority.replay_floor(GROUP) == (6, ref)
        with pytest.raises(CursorTooOld) as caught:
            authority.read(GROUP, after=2)
        assert SnapshotRef.from_dict(caught.value.snapshot_ref) == ref
        assert [event.seq for event in authority.read(GROUP, after=6)] == [7, 8, 9]
        verified = verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), group=GROUP, org="acme")
        assert (verified.seq, verified.head_hash) == head_at_snapshot
        authority.rebuild()
        assert authority.snapshots(GROUP) == [ref]  # the reference is in the log, not only the index
        assert authority.verify().ok


def test_acceptance_time_never_moves_backwards_when_the_clock_does(tmp_path):
    """accepted_at_ms is the clock's reading but never before the last acceptance time: in the
    same process, and after a reopen (the time is kept in the index)."""
    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "store")
    authority = open_with_group(path, clock=clock)
    first = authority.accept(mission_create("m-1"))
    assert first.accepted_at_ms == 1_700_000_000_000
    clock.now_ms = 1_600_000_000_000  # the wall clock stepped back
    second = authority.accept(mission_create("m-2"))
    assert second.accepted_at_ms == first.accepted_at_ms
    authority.close()
    with Authority.open(path, clock=clock) as reopened:
        third = reopened.accept(mission_create("m-3"))
        assert third.accepted_at_ms == first.accepted_at_ms
        clock.now_ms = 1_700_000_000_500
        assert reopened.accept(mission_create("m-4")).accepted_at_ms == 1_700_000_000_500
        assert [event.accepted_at_ms for event in reopened.read(GROUP, after=1)] == [first.accepted_at_ms] * 3 + [1_700_000_000_500]


def test_a_clean_reopen_takes_the_newest_events_time_from_the_index(tmp_path):
    """The index keeps the time of the commit's own Event, not the one before it: after the clock
    moved on and back, a clean reopen stamps no Event before the newest."""
    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "store")
    with open_with_group(path, clock=clock) as authority:
        clock.advance(1_000)
        newest = authority.accept(mission_create("m-1")).accepted_at_ms
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back
    with Authority.open(path, clock=clock) as authority:
        assert authority.open_report.mode == "clean"
        assert authority.accept(mission_create("m-2")).accepted_at_ms == newest == 1_700_000_001_000


def test_a_redo_of_records_without_a_time_keeps_the_last_acceptance_time(tmp_path):
    """The last acceptance time survives a redo that brings none: an ACK is logged without one,
    and a redo of the ACK alone must keep the index's time, not set it to that of the redone
    records (none: 0), or the next acceptance after a clock step back comes before the last."""
    import shutil

    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "store")
    with open_with_group(path, clock=clock) as authority:
        first = authority.accept(mission_create("m-1"))
    saved = str(tmp_path / "index-before-ack")
    shutil.copytree(os.path.join(path, "index"), saved)
    with Authority.open(path, clock=clock) as authority:
        assert authority.ack("consumer", GROUP, 2) == 2
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved, os.path.join(path, "index"))  # the ACK is in the log only
    clock.now_ms = 1_600_000_000_000  # the wall clock stepped back
    with Authority.open(path, clock=clock) as authority:
        assert (authority.open_report.mode, authority.open_report.redo_records) == ("redo", 1)
        assert authority.acked("consumer", GROUP) == 2
        assert authority.accept(mission_create("m-2")).accepted_at_ms == first.accepted_at_ms


@pytest.mark.parametrize("reopen_first", [False, True], ids=["same handle", "reopened at once"])
@pytest.mark.parametrize("commit", ["refusal", "ack", "snapshot"])
def test_a_commit_that_accepts_no_event_leaves_the_last_acceptance_time(tmp_path, commit, reopen_first):
    """The last acceptance time is that of the last Event: a commit of refusals alone, an ACK or a
    snapshot's note accepts none, so a clock that steps back after it stamps the next Event with
    its own reading, in this handle as after a rebuild and a reopen (the stamp once moved up to the
    refusal's or the note's time, and only until the reopen or the rebuild), and in a handle
    opened right after that commit, on the index it left (no Event or rebuild wrote it since)."""
    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "store")
    authority = open_with_group(path, clock=clock)
    clock.advance(1_000)
    if commit == "refusal":
        with pytest.raises(AlreadyExists):
            authority.accept(group_create(GROUP, action_id="create-again"))
    elif commit == "ack":
        assert authority.ack("consumer", GROUP, 1) == 1
    else:
        assert authority.snapshot(GROUP).seq == 1
    if reopen_first:
        authority.close()
        authority = Authority.open(path, clock=clock)
        assert authority.open_report.mode == "clean"
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back, still after the last Event
    assert authority.accept(mission_create("m-1")).accepted_at_ms == 1_700_000_000_500
    authority.rebuild()
    authority.close()
    with Authority.open(path, clock=clock) as authority:
        assert authority.accept(mission_create("m-2")).accepted_at_ms == 1_700_000_000_500


def test_replay_floor_and_cursor_too_old_boundaries_are_exact(tmp_path):
    """The floor is the newest snapshot at most head - W (equal counts); a Cursor one below the
    floor is CURSOR_TOO_OLD, a Cursor at the floor reads on."""
    with Authority.open(str(tmp_path / "store")) as authority:
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body={"org": "acme", "policy": {"replay_window_events": 2}}))
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
        ref = authority.snapshot(GROUP)
        assert ref.seq == 6
        authority.accept(mission_create("n-0"))
        assert authority.head(GROUP)[0] == 7 and authority.replay_floor(GROUP) == (0, None)  # 6 > 7 - 2
        authority.accept(mission_create("n-1"))
        assert authority.head(GROUP)[0] == 8 and authority.replay_floor(GROUP) == (6, ref)  # 6 <= 8 - 2
        with pytest.raises(CursorTooOld) as caught:
            authority.read(GROUP, after=5)
        assert caught.value.detail == {"group": GROUP, "cursor": 5, "floor": 6, "snapshot_ref": ref.to_dict()}
        assert [event.seq for event in authority.read(GROUP, after=6)] == [7, 8]


# -- recovery ------------------------------------------------------------------------------------


def _run_child(path: str, code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


CHILD_ACCEPT = """
import sys
from authority_helpers import open_with_group, mission_create
a = open_with_group(sys.argv[1] if len(sys.argv) > 1 else {path!r})
for i in range(3):
    r = a.accept(mission_create(f"m-{{i}}", action_id=f"a-{{i}}"))
    print(r.seq, flush=True)
a.close()
"""


def test_crash_between_log_sync_and_index_commit_is_redone(tmp_path):
    path = str(tmp_path / "store")
    result = _run_child(path, CHILD_ACCEPT.format(path=path), {"MWPSTORE_FAILPOINT": "authority.after_log_sync:4"})
    assert result.returncode == -9, result.stderr
    assert result.stdout.split() == ["2", "3"]  # the fourth commit (m-2) died after its log sync
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "redo" and authority.open_report.redo_records == 1
        assert authority.head(GROUP)[0] == 4  # the durable, unacknowledged Event is kept
        assert authority.state(GROUP, "mission:m-1")[0] == 1
        assert authority.verify().ok
        receipt = authority.accept(mission_create("m-2", action_id="a-2"))
        assert receipt.seq == 4  # its receipt survived the redo


CHILD_BULK = """
import os, signal, sys
from authority_helpers import group_create, mission_create
from mwpstore import Authority
a = Authority.open({path!r}, sync=False, segment_bytes=64 * 1024)
print(os.path.exists(os.path.join({path!r}, "log", "BULK")), flush=True)
a.accept(group_create())
for i in range(200):
    a.accept(mission_create(f"m-{{i}}", action_id=f"a-{{i}}"))
a.sync()
print(a.head("g-1")[0], flush=True)
for i in range(200, 230):
    a.accept(mission_create(f"m-{{i}}", action_id=f"a-{{i}}"))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_bulk_mode_store_marks_its_log_and_a_crash_keeps_what_sync_made_durable(tmp_path):
    """sync=False: the log carries BULK while the handle is open (and after its crash); the next
    open without bulk mode recovers (under the bulk-mode rule), keeps every Event that sync()
    made durable, and removes BULK; a bulk-mode close removes it too, compaction included."""
    path = str(tmp_path / "store")
    result = _run_child(path, CHILD_BULK.format(path=path), {})
    assert result.returncode == -9, result.stderr
    marked, synced = result.stdout.split()
    assert marked == "True" and int(synced) == 201
    assert os.path.exists(os.path.join(path, "log", "BULK"))
    with Authority.open(path, segment_bytes=64 * 1024) as authority:
        assert authority.head(GROUP)[0] >= 201  # the page cache outlived the process: maybe all 231
        assert authority.verify().ok
        assert not os.path.exists(os.path.join(path, "log", "BULK"))
    with Authority.open(path, segment_bytes=64 * 1024, sync=False) as bulk:
        assert os.path.exists(os.path.join(path, "log", "BULK"))
        bulk.accept(mission_create("m-bulk", action_id="a-bulk"))
        bulk.compact()
        assert os.path.exists(os.path.join(path, "log", "BULK"))  # the compacted log's writer is bulk too
    assert not os.path.exists(os.path.join(path, "log", "BULK"))
    with Authority.open(path, segment_bytes=64 * 1024) as authority:
        assert authority.open_report.mode == "clean" and authority.verify().ok


@pytest.mark.parametrize("sync", [True, False])
def test_after_a_compaction_the_clean_close_marks_the_new_log_not_the_retired_one(tmp_path, sync):
    """The log handle a compaction retired stays open for readers until close(); its close wrote
    its own clean-close marker (the old log id) into log/, the new log's directory, over the new
    log's marker, so the next open never took its end on the marker's word; in bulk mode it
    also removed the new log's BULK (StorageFailed at close when the new log had removed it)."""
    path = str(tmp_path / "store")
    with open_with_group(path) if sync else Authority.open(path, sync=False) as authority:
        if not sync:
            authority.accept(group_create())
        authority.accept(mission_create("m-1"))
        authority.compact()
        authority.accept(mission_create("m-2"))
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        assert log._clean_marker  # the end came from the marker the new log's close wrote
class _RedoInterrupted(Exception):
    """Raised where a crash test's child would die: right after one of redo's commits."""


def _open_interrupted_after_a_redo_commit(monkeypatch, open_store) -> None:
    """Call ``open_store`` with redo committing after every scan batch, interrupted right after
    its first commit (as a crash test's child dies at ``authority.mid_redo``)."""
    from mwpstore import authority as authority_module
    from mwpstore import failpoints

    monkeypatch.setattr(authority_module, "REDO_COMMIT_RECORDS", 1)
    hit = failpoints.hit

    def interrupt(name: str) -> None:
        if name == "authority.mid_redo":
            raise _RedoInterrupted
        hit(name)

    monkeypatch.setattr(failpoints, "hit", interrupt)
    with pytest.raises(_RedoInterrupted):
        open_store()
    monkeypatch.setattr(failpoints, "hit", hit)


def _index_put_back_behind(tmp_path, write, **options) -> tuple[str, tuple[int, bytes]]:
    """A store whose clean index of its first session (a Group created) is put back after a second
    session ran ``write(authority)``: the next open redoes what that wrote. Returns the path and
    the Group's head."""
    import shutil

    path, saved = str(tmp_path / "store"), str(tmp_path / "index-after-create")
    with Authority.open(path, **options) as authority:
        authority.accept(group_create())
    shutil.copytree(os.path.join(path, "index"), saved)
    with Authority.open(path, **options) as authority:
        write(authority)
        head = authority.head(GROUP)
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved, os.path.join(path, "index"))
    return path, head


def _accept_in_groups(authority, sizes) -> None:
    """One accept_many (one group of the log) of that many mission.create per size."""
    for group, size in enumerate(sizes):
        assert all(result.ok for result in authority.accept_many([mission_create(f"m-{group}-{n}") for n in range(size)]))


def _interrupted_redo_at_a_seal(tmp_path, monkeypatch) -> tuple[str, tuple[int, bytes], list[int]]:
    """A store of 64 KiB segments whose open was interrupted right after redo's first commit,
    which ended with the first segment (a scan batch ends at a seal): the path, the head, and the
    records of each scan batch."""
    from mwpstore.limits import SEGMENT_BYTES_MIN
    from mwpstore.segment_log import SegmentLog

    path, head = _index_put_back_behind(tmp_path, lambda authority: _accept_in_groups(authority, [20] * 20), segment_bytes=SEGMENT_BYTES_MIN)
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        batches = [len(batch.positions) for batch in log.scan(0)]
        second = log.segments()[1].first_position
    assert len(batches) >= 3 and sum(batches) == 401  # the first redo commit leaves more than one batch to do
    _open_interrupted_after_a_redo_commit(monkeypatch, lambda: Authority.open(path, segment_bytes=SEGMENT_BYTES_MIN))
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.begin() as txn:
        assert index.log_position(txn) == second
    index.close()
    return path, head, batches


def test_a_redo_interrupted_after_one_of_its_commits_resumes_from_that_commit(tmp_path, monkeypatch):
    """Redo commits every REDO_COMMIT_RECORDS records (after a whole scan batch, here a segment),
    each commit recording the log position and the Groups' heads it reflects. Interrupted right
    after one, the next open redoes exactly the rest: a position recorded too far would lose the
    Events past it, a commit without the heads would make the rest break the chain."""
    from mwpstore.limits import SEGMENT_BYTES_MIN

    path, head, batches = _interrupted_redo_at_a_seal(tmp_path, monkeypatch)
    with Authority.open(path, segment_bytes=SEGMENT_BYTES_MIN) as authority:
        assert authority.open_report.mode == "redo"
        assert authority.open_report.redo_records == sum(batches[1:])  # the first commit held batch 0 (less the create)
        assert authority.head(GROUP) == head
        assert authority.state(GROUP, "mission:m-19-19")[0] == 1
        assert authority.verify().ok
        assert authority.accept(mission_create("m-after")).seq == head[0] + 1


def test_an_index_at_a_seal_whose_sealed_segment_is_damaged_is_redone_and_the_damage_reported_by_reads(tmp_path, monkeypatch):
    """The open reads the commit frame before the index's position (docs/recovery.md, step 4), at
    a seal's position in the sealed segment, which a clean close vouched for unread. When that
    segment cannot be read (its header damaged since) the judgement is as before: the index is
    trusted and redone from its position, past that segment, and the reads that reach the segment
    and verify report the damage; neither a rebuild (which would end in Corruption at open) nor
    the check's own Corruption out of the open."""
    from mwpstore.limits import SEGMENT_BYTES_MIN
    from mwpstore.segment_log import CLEAN_FILE_NAME

    path, head, batches = _interrupted_redo_at_a_seal(tmp_path, monkeypatch)
    assert os.path.exists(os.path.join(path, "log", CLEAN_FILE_NAME))  # the sealed segments are taken on its word
    first = os.path.join(path, "log", sorted(os.listdir(os.path.join(path, "log")))[0])
    with open(first, "r+b") as segment:
        segment.seek(40)  # a reserved byte of the header
        segment.write(b"\x01")
    with Authority.open(path, segment_bytes=SEGMENT_BYTES_MIN) as authority:
        assert authority.open_report.mode == "redo" and authority.open_report.redo_records == sum(batches[1:])
        assert authority.head(GROUP) == head
        with pytest.raises(Corruption):
            authority.read(GROUP)
        assert not authority.verify().ok


def test_a_redo_interrupted_after_one_of_its_commits_left_a_position_where_a_group_ends_and_resumes(tmp_path, monkeypatch):
    """A scan batch ends after so many records, mostly inside a group or just before its commit
    frame. Redo's commits along the way recorded that batch end, where no group of the log ends,
    and the next open, which rebuilds an index whose position is not a group end (docs/recovery.md,
    step 4), rebuilt the whole index instead of resuming. Each commit now goes after the last group
    that ends in its batch; a batch inside one group commits nothing."""
    import shutil

    from mwpstore import authority as authority_module
    from mwpstore.segment_log import SegmentLog

    # groups of 3 records, then one of 25: longer than a scan batch
    path, head = _index_put_back_behind(tmp_path, lambda authority: _accept_in_groups(authority, [3] * 6 + [25]))
    saved = str(tmp_path / "index-behind")
    shutil.copytree(os.path.join(path, "index"), saved)
    scan = SegmentLog.scan
    monkeypatch.setattr(SegmentLog, "scan", lambda self, start=0, **kw: scan(self, start, **{**kw, "batch_records": 4}))
    commits = []
    put = Index.put

    def recording_put(self, txn, name, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (name, key) == (b"meta", b"log_position"):
            commits.append(read_u64(value))
        return put(self, txn, name, key, value, *args, **kwargs)

    monkeypatch.setattr(Index, "put", recording_put)
    monkeypatch.setattr(authority_module, "REDO_COMMIT_RECORDS", 1)
    # each of the open's redo commits where a group ends, none inside the long group
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "redo" and authority.open_report.redo_records == 43
    assert len(commits) >= 6  # after groups 1-5 or so, and at the end
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        assert all(log.group_ends_at(position) for position in commits)
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved, os.path.join(path, "index"))
    _open_interrupted_after_a_redo_commit(monkeypatch, lambda: Authority.open(path))
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "redo"  # resumed, not rebuilt
        assert authority.open_report.redo_records == 43 - 3
        assert authority.head(GROUP) == head
        assert authority.verify().ok


def test_a_clean_open_of_a_store_of_many_segments_maps_none_of_them(tmp_path, monkeypatch):
    """The open's check that the index's position is a group end reads nothing when the position is
    the log's end, as after every clean close: a clean open costs the same whatever the number of
    segments (a read-only view maps each of them, on purpose: SegmentLog.hold_files)."""
    from mwpstore import segment_log
    from mwpstore.limits import SEGMENT_BYTES_MIN

    path = str(tmp_path / "store")
    with Authority.open(path, segment_bytes=SEGMENT_BYTES_MIN) as authority:
        authority.accept(group_create())
        _accept_in_groups(authority, [20] * 30)
        assert len(authority.log.segments()) >= 4
    mapped = []
    mapping = segment_log._Segment.mapping
    monkeypatch.setattr(segment_log._Segment, "mapping", lambda segment: mapped.append(segment.path) or mapping(segment))
    with Authority.open(path, segment_bytes=SEGMENT_BYTES_MIN) as authority:
        assert authority.open_report.mode == "clean"
    assert mapped == []


def test_a_redo_interrupted_after_its_last_commit_keeps_the_last_acceptance_time(tmp_path, monkeypatch):
    """Redo's commits along the way record the log position they reflect; the last acceptance
    time of the records they cover must go with it. Interrupted right after a commit that reached
    the log's end, the next open has nothing left to redo: the time of the Events that commit
    indexed is then the index's or none (it was written only by redo's final commit, so a clock
    that stepped back stamped the next Event before them)."""
    import shutil


    clock = FakeClock(start_ms=1_700_000_000_000)
    path = str(tmp_path / "store")
    with open_with_group(path, clock=clock):
        pass
    saved = str(tmp_path / "index-after-create")
    shutil.copytree(os.path.join(path, "index"), saved)  # a clean index, behind what follows
    with Authority.open(path, clock=clock) as authority:
        clock.advance(1_000)
        newest = authority.accept(mission_create("m-1")).accepted_at_ms
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved, os.path.join(path, "index"))

    _open_interrupted_after_a_redo_commit(monkeypatch, lambda: Authority.open(path, clock=clock))
    clock.now_ms = 1_700_000_000_500  # the wall clock stepped back
    with Authority.open(path, clock=clock) as authority:
        assert (authority.open_report.mode, authority.open_report.redo_records) == ("clean", 0)  # nothing left to redo
        assert authority.accept(mission_create("m-2")).accepted_at_ms == newest == 1_700_000_001_000


def test_leftovers_of_an_interrupted_rebuild_or_verify_are_removed_at_open(tmp_path):
    """A rebuild or verify killed midway leaves its scratch index behind: the next open removes
    it even when it trusts the index and builds nothing (the space would stay taken otherwise)."""
    path = str(tmp_path / "store")
    open_with_group(path).close()
    leftovers = ["index.rebuild", "index.old", "index.verify", "index.verify-x1y2"]
    for name in leftovers:
        os.makedirs(os.path.join(path, name))
        with open(os.path.join(path, name, "data.mdb"), "wb") as handle:
            handle.write(b"\x00" * 4096)
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "clean"
    assert [name for name in leftovers if os.path.exists(os.path.join(path, name))] == []


def test_restart_of_machine_without_clean_close_rebuilds_index(tmp_path):
    path = str(tmp_path / "store")
    code = CHILD_ACCEPT.format(path=path).replace("a.close()", "import os; os._exit(0)")
    result = _run_child(path, code, {"MWPSTORE_BOOT_ID": "boot-before"})
    assert result.returncode == 0, result.stderr
    os.environ["MWPSTORE_BOOT_ID"] = "boot-after"
    try:
        with Authority.open(path) as authority:
            assert authority.open_report.mode == "rebuild"
            assert "restarted" in authority.open_report.reason
            assert authority.head(GROUP)[0] == 4
    finally:
        del os.environ["MWPSTORE_BOOT_ID"]


def test_clean_close_is_trusted_across_restart(tmp_path):
    path = str(tmp_path / "store")
    result = _run_child(path, CHILD_ACCEPT.format(path=path), {"MWPSTORE_BOOT_ID": "boot-before"})
    assert result.returncode == 0, result.stderr
    os.environ["MWPSTORE_BOOT_ID"] = "boot-after"
    try:
        with Authority.open(path) as authority:
            assert authority.open_report.mode == "clean"
    finally:
        del os.environ["MWPSTORE_BOOT_ID"]


def test_a_rebuild_killed_after_its_renames_leaves_an_index_this_boot_trusts_and_a_restart_rebuilds(tmp_path, monkeypatch):
    """A rebuild killed once its copy has the name index/, before the switch to it: the copy is
    complete and synced, and holds this boot's id and clean = 0 from its first transaction
    (docs/recovery.md, step 5). The next open in the same boot trusts it (nothing to redo, not
    rebuilt a second time); after a restart it is an index not closed cleanly, and rebuilt."""
    import shutil

    path = str(tmp_path / "store")
    killed = {boot: str(tmp_path / boot) for boot in ("this-boot", "next-boot")}
    monkeypatch.setenv("MWPSTORE_BOOT_ID", "this-boot")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        head = authority.head(GROUP)
        install = authority._install_index

        def killed_before_the_switch(*args, **kwargs):  # type: ignore[no-untyped-def]
            for copy in killed.values():
                shutil.copytree(path, copy)  # the files as a kill here leaves them
            install(*args, **kwargs)

        monkeypatch.setattr(authority, "_install_index", killed_before_the_switch)
        authority.rebuild()
    expected = {
        "this-boot": ("clean", "index trusted"),
        "next-boot": ("rebuild", "the machine restarted since the index was last written without a clean close"),
    }
    for boot, copy in killed.items():
        assert sorted(name for name in os.listdir(copy) if name.startswith("index")) == ["index", "index.old"]
        monkeypatch.setenv("MWPSTORE_BOOT_ID", boot)
        with Authority.open(copy) as authority:
            assert (authority.open_report.mode, authority.open_report.reason) == expected[boot]
            assert authority.open_report.redo_records == 0
            assert authority.head(GROUP) == head
            assert authority.verify().ok


def test_index_ahead_of_log_is_rebuilt(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    with index.begin(write=True) as txn:  # sealed: the position, not a failed seal, must decide
        index.put(txn, b"meta", b"log_position", u64(10**12))
    index.close()
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "rebuild"
        assert "outside the log" in authority.open_report.reason
        assert authority.head(GROUP)[0] == 2
        assert authority.verify().ok


def test_verify_reports_a_broken_hash_chain_instead_of_raising(tmp_path):
    """A log rewritten with one Event re-chained (every frame intact, every Event's own hash
    right, the same positions, so the clean index still opens): verify() returns a report that
    names the chain break; it used to raise CORRUPTION from its rebuild comparison, dropping it."""
    import msgspec

    from mwpstore.messages import recompute_event_hash

    def rechain(event):
        event = msgspec.structs.replace(event, prev_hash=bytes(32))
        return msgspec.structs.replace(event, hash=recompute_event_hash(event))

    path, _ = store_with_one_event_rewritten(tmp_path, 4, rechain)
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "clean"
        report = authority.verify()
    assert not report.ok
    assert any(problem.startswith(f"chain break in group {GROUP} at seq 3") for problem in report.problems), report.problems
    assert any(problem.startswith(f"chain break in group {GROUP} at seq 4") for problem in report.problems), report.problems


def test_verify_reports_an_event_whose_content_no_longer_matches_its_hash(tmp_path):
    """A log rewritten with one Event's body changed and its payload hash recomputed, the chain
    hash left as it was: every frame, link and index entry holds (the body is in no index entry),
    so only recomputing the Event's hash shows it."""
    import msgspec

    from mwpstore.messages import payload_hash_of

    def change_body(event):
        body = dict(event.body or {})
        body["title"] = "x" * len(body["title"])  # the same length: every later position stays
        return msgspec.structs.replace(event, body=body, payload_hash=payload_hash_of(body))

    path, records = store_with_one_event_rewritten(tmp_path, 3, change_body)
    with Authority.open(path) as authority:
        report = authority.verify()
    assert report.problems == [f"hash mismatch in group {GROUP} at seq 3 (position {records[2][0]})"]


def test_verify_finds_an_index_that_differs_from_the_log(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        with authority.index.env.begin(write=True) as txn:  # well-formed and sealed, but not what the log says
            authority.index.put(txn, b"states", b"g-1\x00mission:m-1", u64(9) + b"\x80")
        report = authority.verify()
        assert not report.ok and any("states" in problem for problem in report.problems)
        authority.rebuild()
        assert authority.verify().ok
        assert authority.state(GROUP, "mission:m-1")[0] == 1


@pytest.mark.parametrize("change", ["an entry past the last", "the last entry lost", "a presence entry"])
def test_verify_finds_entries_the_log_does_not_explain_or_that_it_lacks(tmp_path, change):
    """verify compares every database, presence included, to its end on both sides: an entry
    sorting after every other, or one missing at the end, is a difference like a changed value."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        index = authority.index
        with index.env.begin(write=True) as txn:  # sealed and well-formed, but not what the log says
            if change == "an entry past the last":
                index.put(txn, b"states", b"zz\x00mission:m-9", u64(1) + b"\x80")
            elif change == "the last entry lost":
                last_key = [key for key, _ in index.iterate(b"states")][-1]
                assert index.delete(txn, b"states", last_key)
            else:
                txn.put(b"s" + b"g-1\x00mission:m-9", b"", db=index.dbs[b"presence"])
        report = authority.verify()
        database = "presence" if change == "a presence entry" else "states"
        assert not report.ok and any(f"index database {database} differs" in problem for problem in report.problems), report.problems
        authority.rebuild()
        assert authority.verify().ok


@pytest.mark.parametrize("meanwhile", ["a commit", "a rebuild, then a commit"])
def test_verify_compares_what_was_committed_while_it_rebuilt(tmp_path, monkeypatch, meanwhile):
    """verify rebuilds an index from the log before it holds commits off: what is committed in the
    meantime (into the index a rebuild meanwhile put in place) is caught up under the hold, and a
    healthy store verifies clean."""
    path = str(tmp_path / "store")
    redo = Authority._redo
    done: list[str] = []

    def redo_then_change(self, index, progress, *args, **kwargs):
        count = redo(self, index, progress, *args, **kwargs)
        if os.path.basename(index.directory).startswith("index.verify-") and not done:
            done.append(meanwhile)
            if meanwhile != "a commit":
                self.rebuild()
            self.accept(mission_create("m-meanwhile"))
        return count

    with open_with_group(path) as authority:
        authority.accept(mission_create("m-1"))
        monkeypatch.setattr(Authority, "_redo", redo_then_change)
        report = authority.verify()
        assert done == [meanwhile]
        assert report.ok, report.problems
        assert authority.state(GROUP, "mission:m-meanwhile")[0] == 1


def test_a_batch_that_meets_index_damage_answers_every_command(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        first = mission_create("m-1")
        authority.accept(first)
        with authority.index.env.begin(write=True) as txn:  # m-1's receipt no longer matches its seal
            key = receipt_key(first.actor, first.action_id)
            txn.put(key, b"\x00" * 40, db=authority.index.dbs[b"receipts"])
        results = authority.accept_many([mission_create("m-2"), first, mission_create("m-3")])
        # the damaged receipt fails the batch: every Command in it gets the error, none is left
        # without an answer (m-3 was never decided)
        assert [result.error_code for result in results] == ["CORRUPTION"] * 3
        with pytest.raises(StorageFailed):
            authority.accept(mission_create("m-4"))
    with Authority.open(path) as authority:  # a rebuild makes the index whole again
        authority.rebuild()
        assert authority.head(GROUP)[0] == 2 and authority.accept(mission_create("m-4")).seq == 3


class _Millis(int):
    """An int subclass (as an IntEnum is): not an ``int`` to store."""


@pytest.mark.parametrize(
    "reading",
    [1_700_000_000_000.5, True, -1, limits.TIME_MS_MAX + 1, 2**63, _Millis(1_700_000_000_000), "1700000000000", None, ZeroDivisionError],
    ids=repr,
)
def test_a_bad_clock_reading_is_refused_before_anything_is_written(tmp_path, reading):
    clock = FakeClock()
    path = str(tmp_path / "store")
    with open_with_group(path, clock=clock) as authority:
        good = clock.now_ms
        end = authority.log.end

        def bad() -> object:
            if reading is ZeroDivisionError:
                raise ZeroDivisionError("clock broke")
            return reading

        authority._clock = bad  # the clock the application injected goes wrong after open
        with pytest.raises(InvalidCommand) as caught:
            authority.accept(mission_create("m-1"))
        assert caught.value.detail["field"] == "clock"
        with pytest.raises(InvalidCommand):
            authority.expire_leases(GROUP)
        with pytest.raises(InvalidCommand):
            authority.expire_leases(GROUP, now_ms=reading if reading is not ZeroDivisionError else 1.5)
        assert authority.log.end == end  # nothing reached the log
        authority._clock = lambda: good
        assert authority.accept(mission_create("m-1")).seq == 2  # the handle still writes
    with Authority.open(path) as authority:  # and the store reopens with the same history
        assert [event.accepted_at_ms for event in authority.read(GROUP)] == [good, good]
    with pytest.raises(InvalidCommand):
        Authority.open(path, clock=1_700_000_000_000)


def test_state_and_aggregates_refuse_keys_that_are_not_text(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        for aggregate in (None, 5, "", "x" * 300, "bad\ud800"):
            with pytest.raises(InvalidCommand) as caught:
                authority.state(GROUP, aggregate)
            assert caught.value.detail["field"] == "aggregate"
        for prefix in (None, 5, b"group:"):
            with pytest.raises(InvalidCommand):
                authority.aggregates(GROUP, prefix=prefix)
        assert authority.state(GROUP, f"group:{GROUP}")[0] == 1 and authority.aggregates(GROUP, prefix="group:")


def test_read_and_wait_for_refuse_impossible_cursors_and_timeouts(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        for after in (2**63, 10**30, -1, "1", 1.0):
            with pytest.raises(InvalidCommand) as caught:
                authority.read(GROUP, after=after)
            assert caught.value.detail["field"] == "after"
        for timeout in (float("nan"), float("inf"), -1, "1", True, 1e10):
            with pytest.raises(InvalidCommand) as caught:
                authority.wait_for(GROUP, 0, timeout)
            assert caught.value.detail["field"] == "timeout"
        for after in (-1, True, 1.0, "1", None):
            with pytest.raises(InvalidCommand) as caught:
                authority.wait_for(GROUP, after, 0)
            assert caught.value.detail["field"] == "after"
        assert authority.wait_for(GROUP, 0, 0.01) and not authority.wait_for(GROUP, 1, 0.01)


def test_wait_for_without_a_timeout_raises_store_closed_when_the_authority_closes_meanwhile(tmp_path):
    """docs/api.md: wait_for raises StoreClosed if the authority is closed while it waits; with no
    timeout it must not wait for ever (Subscription iteration ends on it)."""
    authority = open_with_group(str(tmp_path / "store"))
    outcome: list[object] = []

    def waiter() -> None:
        try:
            outcome.append(authority.wait_for(GROUP, 5, None))
        except StoreClosed as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    while not authority._published._waiters:  # type: ignore[attr-defined]  # the waiter sleeps in wait_for
        thread.join(0.01)
    authority.close()
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], StoreClosed)


def test_wait_for_without_a_timeout_wakes_at_the_next_commit_of_its_group(tmp_path):
    """A commit wakes wait_for only while one is in progress (counted in ``_published_waiting``
    before its first look at the head): a waiter with no timeout asleep in it wakes at the next
    Event of its Group, and the count is back to 0 once it returns."""
    authority = open_with_group(str(tmp_path / "store"))
    head = authority.head(GROUP)[0]
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(authority.wait_for(GROUP, head, None)), daemon=True)
    thread.start()
    while not authority._published._waiters:  # type: ignore[attr-defined]  # the waiter sleeps in wait_for
        thread.join(0.01)
    assert authority._published_waiting == 1
    authority.accept(mission_create("m-wakes"))
    thread.join(30)
    assert not thread.is_alive() and outcome == [True] and authority._published_waiting == 0
    authority.close()


@pytest.mark.parametrize("body", [{"title": "a\ud800b", "cost_limit": 1}, {"title": "t", "cost_limit": 1, "\udc00": 1},
                                  {"title": "t", "cost_limit": 1, "x": [{"y": "\udfff"}]}])
def test_a_lone_surrogate_in_a_body_is_an_invalid_command(tmp_path, body):
    with open_with_group(str(tmp_path / "store")) as authority:
        hostile = Command(actor=OWNER, action_id="m-s", group=GROUP, kind="mission.create", target="m-s", body=body)
        with pytest.raises(InvalidCommand):
            authority.accept(hostile)
        results = authority.accept_many([mission_create("m-good"), hostile])
        assert results[0].ok and results[1].error_code == "INVALID_COMMAND"


def test_second_writer_gets_store_locked(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path):
        with pytest.raises(StoreLocked):
            Authority.open(path)


def test_open_without_create_refuses_a_directory_that_holds_no_store(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a store")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(StoreNotFound) as caught:
            Authority.open(path, create=False)
        assert caught.value.code == "STORE_NOT_FOUND"
        assert caught.value.detail["path"] == str(path)  # the directory it looked in, absolute
    assert sorted(os.listdir(empty)) == ["notes.txt"]  # nothing written: no lock file, no log
    assert not (tmp_path / "missing").exists()
    store = str(tmp_path / "store")
    with open_with_group(store):
        pass
    with Authority.open(store, create=False) as authority:
        assert authority.head(GROUP)[0] == 1


@pytest.mark.parametrize("lost", ["whole log directory", "every segment"])
def test_a_store_whose_log_is_gone_is_refused_not_restarted_empty(tmp_path, lost):
    store = str(tmp_path / "store")
    with open_with_group(store) as authority:
        authority.accept(mission_create("m-1"))
        authority.signing_key  # the keys directory exists too
    log = os.path.join(store, "log")
    if lost == "whole log directory":
        os.rename(log, str(tmp_path / "elsewhere"))
    else:
        for name in os.listdir(log):
            if name.endswith(".seg"):
                os.remove(os.path.join(log, name))
    index_before = open(os.path.join(store, "index", "data.mdb"), "rb").read()
    for options in ({"create": True}, {"create": False}, {"readonly": True}):
        with pytest.raises(Corruption) as caught:
            Authority.open(store, **options)
        assert caught.value.detail["reason"] == "log_missing", options
    # the index that still describes the history is left as it was, not rebuilt to nothing
    assert open(os.path.join(store, "index", "data.mdb"), "rb").read() == index_before
    if lost == "whole log directory":
        os.rename(str(tmp_path / "elsewhere"), log)  # the volume is back: the store opens as before
        with Authority.open(store) as authority:
            assert authority.head(GROUP)[0] == 2 and authority.open_report.mode == "clean"


@pytest.mark.parametrize("path", [123, b"/tmp/store", "", "store\x00x"])
def test_open_refuses_a_path_that_is_not_a_text_path(tmp_path, path):
    with pytest.raises(InvalidCommand) as caught:
        Authority.open(path)
    assert caught.value.detail["field"] == "path"
    with pytest.raises(InvalidCommand):
        Authority.open(str(tmp_path / "s"), create="yes")


def test_a_relative_path_keeps_naming_the_store_after_the_process_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    authority = open_with_group("store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative self.path named elsewhere/store from here on
    try:
        assert authority.path == str(tmp_path / "store")
        ref = authority.snapshot(GROUP)
        assert authority.verify().ok
        assert authority.rebuild() == 2  # the Event and the snapshot reference
        record = authority.archive(GROUP, actor=OWNER, action_id="archive-1")
        authority.compact()
        assert authority.verify().ok
    finally:
        authority.close()
    assert os.listdir(elsewhere) == []  # nothing was written beside the new working directory
    assert os.path.isfile(tmp_path / "store" / ref.location)
    assert os.path.isfile(tmp_path / "store" / record.audit_location)
    with Authority.open(str(tmp_path / "store")) as reopened:
        assert reopened.verify().ok and reopened.archive_record(GROUP) == record


@pytest.mark.parametrize(
    "option, value",
    [
        ("sync", None),  # was taken as False: a bulk-load (not durable) store from a "default"
        ("sync", "yes"),
        ("sync", 1),
        ("map_size", -1),  # these four raised OverflowError or TypeError out of LMDB
        ("map_size", "64"),
        ("map_size", 2**64),
        ("map_size", float("nan")),
        ("map_size", True),
        ("map_size", 0),
        ("progress", 5),  # called only once there is something to redo: a TypeError mid-open
        ("progress", "bar"),
        ("segment_bytes", -1),  # refused only after authority.lock was created
        ("segment_bytes", 2**40),
        ("clock", 5),
        ("check_lmdb", 0),  # equal to False, but it checked the file at every open, as True does
        ("check_lmdb", 1.0),
        ("create", 0),  # docs/api.md: True or False, not a falsy or truthy stand-in
        ("readonly", None),
        ("readonly", 1),
    ],
)
def test_open_refuses_a_bad_option_before_anything_is_written(tmp_path, option, value):
    fresh = tmp_path / "fresh"
    with pytest.raises(InvalidCommand) as caught:
        Authority.open(str(fresh), **{option: value})
    assert caught.value.field == option
    assert not fresh.exists()  # no directory, no lock file that would make it look like a store
    store = str(tmp_path / "store")
    with open_with_group(store):
        pass
    before = sorted(os.listdir(store))
    with pytest.raises(InvalidCommand):
        Authority.open(store, **{option: value})
    assert sorted(os.listdir(store)) == before
    with Authority.open(store, create=False) as authority:
        assert authority.head(GROUP)[0] == 1 and authority.verify().ok


@pytest.mark.parametrize("name", ["st\udcffore", "st\ud800ore"])
def test_open_refuses_a_path_utf8_cannot_encode_before_creating_it(tmp_path, name):
    # LMDB takes only UTF-8 paths: this was a UnicodeEncodeError once the directory and the log
    # had been created (a surrogate-escaped file name from os.listdir is such a path)
    path = os.path.join(str(tmp_path), name)
    with pytest.raises(InvalidCommand) as caught:
        Authority.open(path)
    assert caught.value.field == "path"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("progress", [5, "bar", True, b"x"])
def test_verify_and_rebuild_refuse_a_progress_that_is_not_callable(tmp_path, progress):
    # a TypeError out of the scan before (compact already refused it)
    with open_with_group(str(tmp_path / "store")) as authority:
        for call in (authority.verify, authority.rebuild, authority.compact):
            with pytest.raises(InvalidCommand) as caught:
                call(progress)
            assert caught.value.field == "progress"
        assert authority.head(GROUP)[0] == 1 and authority.verify().ok


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("raised", [Cancelled("stop here"), OSError(28, "No space left on device")])
def test_what_a_progress_callable_raises_reaches_the_caller_typed_with_the_store_as_it_was(tmp_path, raised):
    """The same in open, verify, rebuild and compact: ``InvalidCommand`` naming ``progress``, the
    callable's own exception as the cause. Before, compact turned it into ``StorageFailed`` or
    an "unexpected error", and open and rebuild turned an ``OSError`` into ``StorageFailed``: an
    I/O failure of the store's own, which it was not."""

    def progress(done: int, total: int) -> None:
        raise raised

    def check(call) -> None:
        with pytest.raises(InvalidCommand) as caught:
            call()
        assert caught.value.field == "progress"
        assert caught.value.__cause__ is raised

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        for number in range(20):
            authority.accept(mission_create(f"m-{number}"))
        events = authority.read(GROUP, after=0, limit=100)
        check(lambda: authority.verify(progress))
        check(lambda: authority.rebuild(progress))
        check(lambda: authority.compact(progress))
        assert authority.read(GROUP, after=0, limit=100) == events
        assert authority.accept(mission_create("m-after")).seq == 22
        assert not os.path.exists(os.path.join(path, "log.compact"))
        assert authority.verify().ok
    remove_index(os.path.join(path, "index"))  # the next open rebuilds it and reports progress
    check(lambda: Authority.open(path, progress=progress))
    with Authority.open(path) as authority:  # the failed open released the store
        assert authority.head(GROUP)[0] == 22 and authority.verify().ok


@pytest.mark.parametrize("retire", [None, 0, "", [], "no", 1])
def test_rotate_signing_key_refuses_a_retire_that_is_not_a_bool(tmp_path, retire):
    # a falsy retire (None as "the default", 0) dropped the old key as if it were compromised:
    # every snapshot it signed stopped verifying
    with open_with_group(str(tmp_path / "store")) as authority:
        ref = authority.snapshot(GROUP)
        before = authority.signing_key.key_id
        with pytest.raises(InvalidCommand) as caught:
            authority.rotate_signing_key(retire=retire)
        assert caught.value.field == "retire"
        assert authority.signing_key.key_id == before
        assert authority.keyring().key_ids == [before]
        with pytest.raises(InvalidCommand):
            SigningKey.rotate(os.path.join(authority.path, "keys"), retire=retire)
        verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring())
        assert authority.verify().ok


def test_verify_and_rebuild_in_a_directory_they_cannot_write_are_storage_failed(tmp_path, monkeypatch):
    """A store directory mode 0500 (as its owner, not root): the scratch index of verify() and
    the index.rebuild/ of rebuild() cannot be created. That was an untyped PermissionError."""
    import errno

    store = str(tmp_path / "store")
    authority = open_with_group(store)
    real_mkdir = os.mkdir

    def refusing(path, *args, **kwargs):  # what mkdir does in a directory without write permission
        if os.path.dirname(os.path.abspath(path)) == store:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refusing)
    for call in (authority.verify, authority.rebuild):
        with pytest.raises(StorageFailed) as caught:
            call()
        assert caught.value.detail["errno"] == errno.EACCES
    authority.accept(mission_create("m-1"))  # the handle keeps working
    monkeypatch.undo()
    assert authority.verify().ok and authority.rebuild() == 2
    authority.close()


@pytest.mark.parametrize("create", [True, False])
def test_open_refuses_a_directory_that_holds_an_agent_store(tmp_path, create):
    # it was opened as a new authority: log/, index/ and authority.lock went in beside the agent's lmdb/
    from mwpstore.agent_store import AgentStore

    path = tmp_path / "agent"
    AgentStore.open(str(path)).close()
    before = sorted(os.listdir(path))
    with pytest.raises(InvalidCommand) as caught:
        Authority.open(str(path), create=create)
    assert caught.value.field == "path" and "AgentStore" in caught.value.message
    assert sorted(os.listdir(path)) == before
    AgentStore.open(str(path)).close()
    other = tmp_path / "other"  # a directory with an unrelated lmdb/ of its own is no AgentStore
    (other / "lmdb").mkdir(parents=True)
    if create:
        Authority.open(str(other)).close()


def test_an_index_map_that_fills_at_a_commit_is_storage_failed_naming_the_map(tmp_path):
    """The log holds the batch by the time the index commit finds the map full: its outcome is
    unknown, as for any STORAGE_FAILED (docs said LIMIT_EXCEEDED, which promises nothing was
    written), and the detail says it was the map. A reopen with a larger map redoes it."""
    store = str(tmp_path / "store")
    with open_with_group(store):
        pass
    authority = Authority.open(store, map_size=1 << 20)
    failed = None
    for number in range(5000):
        command = Command(actor=OWNER, action_id=f"fill-{number}", group=GROUP, kind="mission.create",
                          target=f"m-{number}", body={"title": "x" * 1000, "cost_limit": 1})
        try:
            authority.accept(command)
        except StorageFailed as exc:
            failed = (command, exc)
            break
    assert failed is not None, "the 1 MiB map never filled"
    command, error = failed
    assert error.code == "STORAGE_FAILED" and error.detail["field"] == "map_size"
    with pytest.raises(StorageFailed):
        authority.accept(mission_create("after"))  # the handle refuses writes until reopened
    authority.close()
    with Authority.open(store, map_size=1 << 24) as reopened:
        assert reopened.open_report.mode == "redo"
        receipt = reopened.accept(command)  # the refused Command had landed: its receipt answers
        assert receipt.seq == reopened.head(GROUP)[0] and reopened.verify().ok


def test_a_handle_used_in_a_forked_child_is_store_closed_and_the_store_stays_intact(tmp_path):
    """A pre-fork server opens the authority, then forks: the child's accept wrote into the log
    at the parent's end, the parent then wrote its next Event over it (a receipt handed out for
    an Event that is gone, a broken chain, Corruption at every later read) and the child's
    close() marked the index clean and wrote the log's clean marker under the running parent."""
    store = str(tmp_path / "store")
    authority = open_with_group(store)
    authority.accept(mission_create("m-1"))
    outcomes = in_a_forked_child([
        lambda: authority.accept(mission_create("m-child")),
        lambda: authority.accept_many([mission_create("m-child-2")]),
        lambda: authority.ack("agent", GROUP, 1),
        lambda: authority.read(GROUP),
        lambda: authority.snapshot(GROUP),
        lambda: authority.log.append([b"x"]),
        lambda: authority.close(),
    ])
    assert outcomes == ["StoreClosed"] * 6 + ["ok"]  # close() in the child touches nothing
    with authority.index.begin() as txn:  # the child's close() did not mark the index clean
        assert bytes(authority.index.get(txn, b"meta", b"clean")) == b"0"
    receipt = authority.accept(mission_create("m-2"))
    assert receipt.seq == 3 and [event.seq for event in authority.read(GROUP)] == [1, 2, 3]
    assert authority.verify().ok and not os.path.exists(os.path.join(store, "snapshots"))
    authority.close()
    with Authority.open(store) as reopened:
        assert reopened.head(GROUP)[0] == 3 and reopened.verify().ok


# -- hostile input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, error, field",
    [
        ({"group": "../escape"}, InvalidCommand, "group"),
        ({"group": ""}, InvalidCommand, "group"),
        ({"actor": "a" * 129}, InvalidCommand, "actor"),
        ({"actor": "a/b"}, InvalidCommand, "actor"),
        ({"action_id": 7}, InvalidCommand, "action_id"),
        ({"kind": "No.Such"}, InvalidCommand, "kind"),
        ({"kind": "no.such"}, UnknownKind, "kind"),
        ({"target": ".hidden"}, InvalidCommand, "target"),
        ({"body": {"title": float("nan"), "cost_limit": 1}}, InvalidCommand, "body.title"),
        ({"body": {"title": "t", "cost_limit": float("inf")}}, InvalidCommand, "body.cost_limit"),
        ({"body": {1: "x"}}, InvalidCommand, "body"),
        ({"body": {"x": object()}}, InvalidCommand, "body.x"),
        ({"body": {"x": 2**64}}, InvalidCommand, "body.x"),
        ({"body": {"x": "y" * (2 * 1024 * 1024)}}, LimitExceeded, "body.x"),
        ({"body": "not a dict"}, InvalidCommand, "body"),
        ({"expected_revision": -1}, InvalidCommand, "expected_revision"),
        ({"signature": b"short"}, InvalidCommand, "signature"),
    ],
)
def test_hostile_commands_get_typed_errors_and_change_nothing(store, changes, error, field):
    fields = {
        "actor": OWNER,
        "action_id": "hostile",
        "group": GROUP,
        "kind": "mission.create",
        "target": "m-1",
        "body": {"title": "t", "cost_limit": 1},
    }
    fields.update(changes)
    head = store.head(GROUP)
    with pytest.raises(error) as caught:
        store.accept(Command(**fields))
    assert caught.value.field == field
    assert store.head(GROUP) == head


def test_deep_nesting_is_limit_exceeded(store):
    body: dict = {"title": "t", "cost_limit": 1}
    node = body
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(LimitExceeded):
        store.accept(Command(actor=OWNER, action_id="deep", group=GROUP, kind="mission.create", target="m-1", body=body))


def test_non_command_and_non_sequence_inputs(store):
    with pytest.raises(InvalidCommand):
        store.accept({"actor": OWNER})  # type: ignore[arg-type]
    with pytest.raises(InvalidCommand):
        store.accept_many("not a list")  # type: ignore[arg-type]
    results = store.accept_many([None])  # type: ignore[list-item]
    assert results[0].error_code == InvalidCommand.code


def test_engine_actor_and_system_kinds_are_reserved(store):
    with pytest.raises(InvalidCommand):
        store.accept(Command(actor="_engine", action_id="x", group=GROUP, kind="mission.create", target="m", body={}))


def test_owner_only_kinds_refuse_other_roles(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(
            Command(actor=OWNER, action_id="add-w", group=GROUP, kind="membership.add", target="worker-1", body={"role": "worker"}, expected_revision=0)
        )
        with pytest.raises(Unauthorized):
            authority.accept(Command(actor="worker-1", action_id="w1", group=GROUP, kind="mission.create", target="m-1", body={"title": "t", "cost_limit": 1}))


def test_closed_store_refuses_everything(tmp_path):
    authority = open_with_group(str(tmp_path / "store"))
    ref = authority.snapshot(GROUP)
    authority.close()
    authority.close()  # idempotent
    for call in (
        lambda: authority.accept(mission_create("m-1")),
        lambda: authority.read(GROUP),
        lambda: authority.ack("c", GROUP, 1),
        lambda: authority.head(GROUP),
        lambda: authority.subscribe(GROUP),  # was a Subscription whose iterator ended at once
        lambda: authority.keyring(),
        lambda: authority.read_snapshot(ref),
    ):
        with pytest.raises(StoreClosed):
            call()


def test_a_closed_store_refuses_each_write_before_it_looks_at_the_arguments(tmp_path):
    # The writers' gate tests the common case (open, writable, no commit of this thread, no
    # failure) in one condition; close() must be part of it, or a closed handle answered with the
    # error of its argument (INVALID_COMMAND for accept(None)) instead of STORE_CLOSED.
    authority = open_with_group(str(tmp_path / "store"))
    authority.close()
    for call in (
        lambda: authority.accept(None),
        lambda: authority.accept_trusted(None),
        lambda: authority.accept_many(None),
        lambda: authority.expire_leases(None),
        lambda: authority.snapshot(None),
        lambda: authority.redact(None, -1, actor="", action_id="", reason=""),
        lambda: authority.drop_retired_key(None),
        lambda: authority.ack(None, None, None),
    ):
        with pytest.raises(StoreClosed):
            call()


def test_a_closed_store_refuses_subscribe_and_wait_for_before_it_looks_at_the_arguments(tmp_path):
    # as every other method of a closed handle, reads included: they said INVALID_COMMAND for
    # a bad group or cursor
    authority = open_with_group(str(tmp_path / "store"))
    authority.close()
    for call in (lambda: authority.subscribe(None, after=-1), lambda: authority.wait_for(None, -1, -1)):
        with pytest.raises(StoreClosed):
            call()


def test_a_closed_handle_does_not_create_the_signing_key(tmp_path):
    # signing_key after close() created keys/ in a directory this handle no longer held
    store = tmp_path / "store"
    authority = open_with_group(str(store))
    authority.close()
    with pytest.raises(StoreClosed):
        authority.signing_key
    assert not (store / "keys").exists()


@pytest.mark.parametrize("after", [-1, None, "0", 1.0, True, 2**63])
def test_subscribe_refuses_an_impossible_cursor_at_once(tmp_path, after):
    # it was taken as given and refused only by the first poll (or ended iteration at once)
    with open_with_group(str(tmp_path / "store")) as authority:
        with pytest.raises(InvalidCommand) as caught:
            authority.subscribe(GROUP, after=after)
        assert caught.value.field == "after"


def test_group_create_twice_is_already_exists(store):
    with pytest.raises(AlreadyExists):
        store.accept(group_create(action_id="again"))
    with pytest.raises(MwpError):
        store.accept(Command(actor=OWNER, action_id="m-other", group="other", kind="mission.create", target="m", body={"title": "t", "cost_limit": 1}))


# -- archival (MWP-MSN-009) --------------------------------------------------------------------


def test_msn_009_archive_writes_final_snapshot_and_audit_log_then_refuses_commands(tmp_path):
    from mwpstore.audit_log import FileKeyProvider, verify_audit_log_against_snapshot
    from mwpstore.errors import GroupArchived

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(20)])
        record = authority.archive(GROUP, actor=OWNER, action_id="archive-1", reason="done")
        assert record.last_seq == 22 and record.events == 22 and record.final_snapshot.seq == 22
        with pytest.raises(GroupArchived):
            authority.accept(mission_create("late"))
        assert authority.archive(GROUP, actor=OWNER, action_id="archive-1") == record  # idempotent
        data = authority.read_snapshot(record.final_snapshot)
        verified = verify_snapshot(data, keyring=authority.keyring(), group=GROUP, org="acme")
        assert verified.states_and_revisions()[0][f"group:{GROUP}"]["status"] == "archived"
        provider = FileKeyProvider(os.path.join(path, "keys", "orgs"))
        info = verify_audit_log_against_snapshot(os.path.join(path, record.audit_location), verified, provider)
        assert info.last_seq == 22
        assert len(authority.read(GROUP)) == 22  # active history is kept until compaction
    with Authority.open(path) as authority:
        authority.rebuild()
        assert authority.archive_record(GROUP) == record


def test_archive_completes_for_a_group_archived_without_its_record(tmp_path):
    """A crash between the group.archive Event and the archive record: archive() finishes the job."""
    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept(Command(actor=OWNER, action_id="arch-1", group=GROUP, kind="group.archive", target=GROUP, body={}))
        assert authority.archive_record(GROUP) is None
        record = authority.archive(GROUP, actor=OWNER, action_id="arch-2")
        assert record.last_seq == 2 and authority.archive_record(GROUP) == record


def test_snapshot_twice_at_the_same_sequence_returns_the_same_reference(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        first = authority.snapshot(GROUP)
        second = authority.snapshot(GROUP)
        assert second == first and authority.snapshots(GROUP) == [first]
        refs = []
        threads = [threading.Thread(target=lambda: refs.append(authority.snapshot(GROUP))) for _ in range(4)]
        authority.accept(mission_create("m-1"))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len({ref.file_hash for ref in refs}) == 1
        from mwpstore.snapshot import check_snapshot_ref

        for ref in authority.snapshots(GROUP):
            check_snapshot_ref(authority.read_snapshot(ref), ref)


def test_damaged_index_values_surface_as_corruption_not_foreign_errors(tmp_path):
    from mwpstore import Corruption

    path = str(tmp_path / "store")
    command = mission_create("m-1", action_id="act-1")
    with open_with_group(path) as authority:
        authority.accept(command)
        with authority.index.env.begin(write=True) as txn:
            txn.put(b"g-1\x00mission:m-1", b"\x00" * 8 + b"\xc1\xc1", db=authority.index.dbs[b"states"])
            good = txn.get(b"owner\x00act-1", db=authority.index.dbs[b"receipts"])
            txn.put(b"owner\x00act-1", b"\x00" * 32 + good[32:], db=authority.index.dbs[b"receipts"])
            txn.put(b"g-1", b"short", db=authority.index.dbs[b"heads"])
        for call in (
            lambda: authority.state(GROUP, "mission:m-1"),
            lambda: authority.head(GROUP),
            lambda: authority.accept(command),
        ):
            with pytest.raises(Corruption):
                call()
        assert not authority.verify().ok  # verify names the damage
        authority.rebuild()
        assert authority.state(GROUP, "mission:m-1")[0] == 1 and authority.head(GROUP)[0] == 2
        assert encode_receipt(authority.accept(command)) == encode_receipt(authority.accept(command))


def test_an_index_entry_pointing_at_the_wrong_record_is_corruption(tmp_path):
    from mwpstore import Corruption
    from mwpstore.index import event_key

    with open_with_group(str(tmp_path / "store")) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(3)])
        index = authority.index
        # sealed as the index seals its values: a sound entry that points at the wrong record (an
        # unsealed value failed the seal check and never reached the read's own sequence check)
        with index.begin(write=True) as txn:
            other = bytes(index.get(txn, b"events", event_key(GROUP, 2)))
            index.put(txn, b"events", event_key(GROUP, 3), other, new=False)  # seq 3 now points at seq 2's record
            assert read_u64(other) >= 0
        with pytest.raises(Corruption):
            authority.read(GROUP)
        assert authority.read(GROUP, limit=2)[-1].seq == 2


@pytest.mark.parametrize("tag", [b"A", b"X"])
def test_a_log_record_that_is_not_an_event_is_never_read_as_one(tmp_path, tag):
    """A read checks each record's tag byte. Here the log is written anew with Event 6's record
    relabelled (as an ACK record, or as no known kind), every frame and commit checksum sound, and
    the index left pointing at it: a read that takes the Group's run of records in one scan (8 or
    more) and one that reads the records one by one (fewer) both say CORRUPTION; the Events before
    it still read. (Reads once decoded what followed the tag without looking at it.)"""
    import shutil

    from mwpstore import Corruption
    from mwpstore.segment_log import SegmentLog

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(12)])
    with SegmentLog.open(os.path.join(path, "log")) as log:
        (batch,) = list(log.scan(log.start))
    records = list(batch.records)
    records[5] = tag + records[5][1:]
    with SegmentLog.open(str(tmp_path / "relabelled")) as log:  # the same two commit groups
        assert log.append(records[:1]) + log.append(records[1:]) == batch.positions
        log_id = log.log_id
    shutil.rmtree(os.path.join(path, "log"))
    shutil.copytree(str(tmp_path / "relabelled"), os.path.join(path, "log"))
    index_names_log(path, log_id)
    with Authority.open(path) as authority:
        assert authority.open_report.mode == "clean"
        for after, limit in ((0, 1000), (3, 4), (5, 1)):
            with pytest.raises(Corruption) as caught:
                authority.read(GROUP, after=after, limit=limit)
            assert caught.value.detail["reason"] == "index" and f"{GROUP}:6" in caught.value.message
        assert [event.seq for event in authority.read(GROUP, limit=5)] == [1, 2, 3, 4, 5]
        assert [event.seq for event in authority.read(GROUP, after=6, limit=8)] == list(range(7, 14))


def test_accept_many_takes_at_most_accept_many_commands_max_commands(tmp_path, monkeypatch):
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        too_many = [mission_create(f"m-{i}") for i in range(limits.ACCEPT_MANY_COMMANDS_MAX + 1)]
        with pytest.raises(LimitExceeded) as caught:
            authority.accept_many(too_many)
        assert caught.value.field == "commands"
        assert [event.seq for event in authority.read(GROUP)] == [1]  # nothing of it accepted
        monkeypatch.setattr(limits, "ACCEPT_MANY_COMMANDS_MAX", 3)  # the bound itself is inclusive
        assert all(result.ok for result in authority.accept_many(too_many[:3]))
        with pytest.raises(LimitExceeded):
            authority.accept_many(too_many[3:7])
        assert [event.seq for event in authority.read(GROUP)] == [1, 2, 3, 4]


def test_accept_many_decides_the_commands_it_was_given_when_the_sequence_changes_or_lies(tmp_path, monkeypatch):
    """accept_many counted its result slots with len() and then iterated the sequence: a list
    another thread appended to while the Commands were being checked, or a Sequence whose len()
    says less than it yields, ended in an IndexError after the commit had accepted the extra
    Commands (and more of them than ACCEPT_MANY_COMMANDS_MAX). It now takes one bounded copy
    first; a sequence that fails while read is InvalidCommand, nothing accepted."""
    from collections.abc import Sequence

    from mwpstore import limits

    class Lying(Sequence):
        def __init__(self, items, length):
            self.items, self.length = items, length

        def __len__(self):
            return self.length

        def __getitem__(self, index):
            if isinstance(index, slice) or index >= len(self.items):
                raise IndexError(index)
            return self.items[index]

    class Failing(Lying):
        def __getitem__(self, index):
            raise RuntimeError("the caller's sequence broke")

    with open_with_group(str(tmp_path / "store")) as authority:
        commands = [mission_create(f"m-{i}") for i in range(3)]
        results = authority.accept_many(Lying(commands, 1))
        assert [result.unwrap().seq for result in results] == [2, 3, 4]

        growing = [mission_create("m-3")]
        checked = authority._checked

        def check_while_the_list_grows(command, *options):
            if len(growing) == 1:
                growing.append(mission_create("m-4"))  # as another thread would, mid-call
            return checked(command, *options)

        monkeypatch.setattr(authority, "_checked", check_while_the_list_grows)
        assert [result.unwrap().seq for result in authority.accept_many(growing)] == [5]
        monkeypatch.undo()
        assert authority.accept(growing[1]).seq == 6  # decided afresh, not by the call before

        monkeypatch.setattr(limits, "ACCEPT_MANY_COMMANDS_MAX", 3)
        with pytest.raises(LimitExceeded) as caught:
            authority.accept_many(Lying([mission_create(f"x-{i}") for i in range(4)], 1))
        assert caught.value.field == "commands"
        with pytest.raises(InvalidCommand) as failed:
            authority.accept_many(Failing([], 2))
        assert failed.value.field == "commands" and isinstance(failed.value.__cause__, RuntimeError)
        assert authority.head(GROUP)[0] == 6  # nothing of the refused calls accepted
        assert authority.verify().ok


def test_read_limit_is_bounded_by_read_limit_max_inclusive(tmp_path):
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        assert [event.seq for event in authority.read(GROUP, limit=limits.READ_LIMIT_MAX)] == [1]
        for limit in (0, limits.READ_LIMIT_MAX + 1):
            with pytest.raises(InvalidCommand) as caught:
                authority.read(GROUP, limit=limit)
            assert caught.value.field == "limit"


def test_an_event_above_record_bytes_max_refuses_only_its_command(tmp_path, monkeypatch):
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(limits, "RECORD_BYTES_MAX", 1_000)  # far below what the log itself takes
        big = Command(actor=OWNER, action_id="big", group=GROUP, kind="mission.create", target="m-big",
                      body={"title": "x" * 1_000, "cost_limit": 1})  # an Event of about 2 KB; the others 350 B
        results = authority.accept_many([mission_create("m-0"), big, mission_create("m-1")])
        assert [result.ok for result in results] == [True, False, True]
        assert results[1].error_code == LimitExceeded.code
        with pytest.raises(LimitExceeded) as caught:
            authority.accept(big)
        assert caught.value.field == "body"
        assert [event.seq for event in authority.read(GROUP)] == [1, 2, 3]
        monkeypatch.undo()
        assert authority.accept(big).seq == 4
        assert authority.verify().ok


def test_a_commit_that_would_exceed_the_log_group_bound_refuses_only_the_overflowing_commands(tmp_path, monkeypatch):
    from mwpstore import limits

    with open_with_group(str(tmp_path / "store")) as authority:
        monkeypatch.setattr(limits, "GROUP_BYTES_MAX", 2_000)  # a few Events' worth
        results = authority.accept_many([mission_create(f"m-{i}") for i in range(20)])
        accepted = [result for result in results if result.ok]
        refused = [result for result in results if not result.ok]
        assert accepted and refused and {result.error_code for result in refused} == {LimitExceeded.code}
        assert [event.seq for event in authority.read(GROUP)] == list(range(1, len(accepted) + 2))
        monkeypatch.undo()
        assert authority.accept(mission_create("m-19", action_id="again")).seq == len(accepted) + 2
        assert authority.verify().ok


def test_with_small_segments_a_commit_refuses_only_the_commands_one_segment_cannot_hold(tmp_path):
    """A commit is one log group, and a group must fit an empty segment. With 64 KiB segments an
    accept_many whose Events together passed that was refused whole at the log's append
    (LIMIT_EXCEEDED, field group_too_large, every Command of the commit), instead of the
    documented per-Command refusal (field commands) that a retry gets past."""
    path = str(tmp_path / "store")
    Authority.open(path, segment_bytes=64 * 1024).close()
    with Authority.open(path, segment_bytes=64 * 1024) as authority:
        authority.accept(group_create())
        wide = {"title": "t" * 1024, "cost_limit": 1}  # about 2 KiB an Event: 32 of them pass 64 KiB
        commands = [Command(actor=OWNER, action_id=f"w-{i}", group=GROUP, kind="mission.create", target=f"m-{i}", body=wide)
                    for i in range(40)]
        results = authority.accept_many(commands)
        accepted = [result for result in results if result.ok]
        refused = [command for command, result in zip(commands, results) if not result.ok]
        assert accepted and refused
        assert {(result.error_code, result.error.detail["field"]) for result in results if not result.ok} == {
            (LimitExceeded.code, "commands")
        }
        assert authority.head(GROUP)[0] == 1 + len(accepted)
        again = authority.accept_many(refused)  # retryable: they go into a later commit
        assert all(result.ok for result in again)
        assert authority.head(GROUP)[0] == 41
        # One Event that no segment of this size holds is refused on its own, for good.
        huge = Command(actor=OWNER, action_id="huge", group=GROUP, kind="mission.create", target="m-huge",
                       body={"title": "t", "cost_limit": 1, "approval_required": [f"op-{i:06}" for i in range(8000)]})
        with pytest.raises(LimitExceeded) as caught:
            authority.accept(huge)
        assert caught.value.field == "body" and "segment_bytes" in caught.value.message
        assert authority.accept(mission_create("m-after")).seq == 42  # the handle keeps working
        assert authority.verify().ok


def test_the_event_carries_the_content_its_receipt_hashes_even_if_the_caller_changes_the_body(tmp_path):
    """The body is the caller's dict. Changed after accept() hashed it (here by a clock the commit
    calls; another thread of the application does the same), it was recorded in the Event while
    the receipt's content hash was of the original: a replay of the original then matched a
    receipt whose Event says something else."""
    from mwpstore.messages import command_bytes

    body = {"title": "original", "cost_limit": 5}
    command = Command(actor=OWNER, action_id="mc-mutated", group=GROUP, kind="mission.create", target="m-x", body=body)
    original = command_bytes(command)

    armed = False

    def meddling_clock() -> int:
        if armed:  # only once accept() of the command has hashed it
            body["title"] = "changed"
            body["cost_limit"] = 999
        return 1_700_000_000_000

    with open_with_group(str(tmp_path / "s"), clock=meddling_clock) as authority:
        armed = True
        receipt = authority.accept(command)
        armed = False
        event = authority.read(GROUP, after=receipt.seq - 1, limit=1)[0]
        assert body["title"] == "changed"  # the clock did run during the commit
        assert (event.body["title"], event.body["cost_limit"]) == ("original", 5)
        assert authority.state(GROUP, "mission:m-x")[1]["cost_limit"] == 5
        assert receipt.content_hash == canonical.content_hash(original)
        assert authority.accept(Command(actor=OWNER, action_id="mc-mutated", group=GROUP, kind="mission.create", target="m-x", body={"title": "original", "cost_limit": 5})) == receipt


def test_redo_writes_each_commit_only_the_heads_its_records_moved(tmp_path, monkeypatch):
    """A rebuild of a log with many Groups, then a long history in one of them: each redo commit
    writes the heads that moved since the last commit. Writing every head seen since the start at
    every commit made a rebuild's head writes (Groups x commits) quadratic in a long log of many
    Groups. The heads kept between commits are bounded (REDO_HEADS_CACHED_MAX): past the bound,
    a Group met again is read back from the index, and its chain still checks."""
    from mwpstore import _sealed
    from mwpstore import authority as authority_module
    from mwpstore.segment_log import SegmentLog

    groups, tail = 200, 600
    path = str(tmp_path / "store")
    with Authority.open(path, sync=False) as authority:
        commands = [group_create(f"g-{n}") for n in range(groups)]
        commands += [mission_create(f"m-{n}", group="g-0") for n in range(tail)]
        commands += [mission_create("m-last", group=f"g-{n}") for n in range(groups)]
        for at in range(0, len(commands), 10):  # groups of 10 records: redo commits where a group ends
            assert all(result.ok for result in authority.accept_many(commands[at : at + 10]))
        heads = {f"g-{n}": authority.head(f"g-{n}") for n in range(groups)}

    scan = SegmentLog.scan
    monkeypatch.setattr(SegmentLog, "scan", lambda self, start=0, **kw: scan(self, start, **{**kw, "batch_records": 10}))
    monkeypatch.setattr(authority_module, "REDO_COMMIT_RECORDS", 1)  # a commit after every group of 10 records
    writes = []
    put = _sealed.SealedTables.put

    def counting_put(self, txn, name, key, value, new=True):  # type: ignore[no-untyped-def]
        if name == b"heads":
            writes.append(bytes(key))
        return put(self, txn, name, key, value, new)

    monkeypatch.setattr(_sealed.SealedTables, "put", counting_put)
    kept, per_commit = [], []  # heads held and written at each commit
    flush_heads = authority_module._flush_heads

    def measured_flush(index, txn, heads, flushed):  # type: ignore[no-untyped-def]
        kept.append((len(heads), len(flushed)))
        before = len(writes)
        flush_heads(index, txn, heads, flushed)
        per_commit.append(len(writes) - before)

    monkeypatch.setattr(authority_module, "_flush_heads", measured_flush)
    records = groups + tail + groups
    with Authority.open(path, sync=False) as authority:
        assert authority.rebuild() == records
        assert max(len_flushed for _, len_flushed in kept) == groups  # under the bound, every head is kept
        assert max(per_commit) <= 10  # the last commit too: 10 records move at most 10 heads
        # At most one write per record (each moves one head); before: ~200 heads at each of
        # the ~100 commits, some 20,000 writes.
        assert len(writes) <= records
        assert {f"g-{n}": authority.head(f"g-{n}") for n in range(groups)} == heads
        writes.clear()
        kept.clear()
        monkeypatch.setattr(authority_module, "REDO_HEADS_CACHED_MAX", 50)  # heads read back from the index
        assert authority.rebuild() == records
        assert len(writes) <= records
        # Between commits at most 50 heads are kept (and the copy of what was written): the heads
        # a commit holds are those plus the 10 records' worth it indexed.
        assert max(len_flushed for _, len_flushed in kept) <= 50 and max(len_heads for len_heads, _ in kept) <= 60
        assert {f"g-{n}": authority.head(f"g-{n}") for n in range(groups)} == heads
        monkeypatch.undo()
        assert authority.verify().ok


def _written_by_a_fixed_history(path: str) -> str:
    """blake3 of every log record and every checked index value (events, heads, states,
    receipts) that a fixed history of Commands writes, with a fixed clock: Missions, a Membership,
    a WorkItem claimed, started, renewed, checkpointed, claimed again and submitted, a rejected
    Command among them, some through ``accept_many`` and some through ``accept``."""
    import blake3

    from mwpstore.work_keys import lease_id_for

    contract = {"max_attempts": 3, "backoff_initial_ms": 100, "backoff_multiplier": 2, "backoff_max_ms": 1_000,
                "cost_limit": 50, "deadline_ms": None, "lease_ms": 60_000, "start_ms": 60_000}

    def command(actor, action_id, kind, target, body, revision=None):
        return Command(actor=actor, action_id=action_id, group=GROUP, kind=kind, target=target, body=body,
                       expected_revision=revision)

    def fence(epoch, **more):
        return {"lease_id": lease_id_for(GROUP, "wi", epoch), "ownership_epoch": epoch, **more}

    clock = FakeClock()
    with open_with_group(path, clock=clock) as authority:
        setup = [
            mission_create("m1", action_id="m1"),
            mission_update("m1", 1, "renamed", action_id="m1-u"),
            mission_update("m1", 1, "stale", action_id="m1-stale"),  # rejected: the revision moved
            command(OWNER, "add-w", "membership.add", "w", {"role": "worker"}, 0),
            command(OWNER, "wi", "workitem.create", "wi", {"mission": "m1", "priority": 0, "contract": contract}),
        ]
        assert [result.ok for result in authority.accept_many(setup)] == [True, True, False, True, True]
        steps = [
            ("workitem.claim", {"session_epoch": 1}, 1),
            ("workitem.start", fence(1), None),
            ("lease.renew", fence(1), 3),
            ("workitem.checkpoint", fence(1, checkpoint={"step": 3, "notes": ["a", "b"]}), None),
            ("workitem.claim", {"session_epoch": 1}, 5),
            ("workitem.start", fence(2), None),
            ("workitem.submit", fence(2, submission={"ok": True, "score": 0.5}), None),
        ]
        for step, (kind, body, revision) in enumerate(steps):
            clock.advance(7)
            authority.accept(command("w", f"wi-{step}", kind, "wi", body, revision))
        end = authority.log.end
    digest = blake3.blake3()
    _digest_store_bytes(digest, path, end, (b"events", b"heads", b"states", b"receipts"))
    return digest.hexdigest()


def _digest_store_bytes(digest, path: str, end: int, names: tuple[bytes, ...]) -> None:
    """Feed ``digest`` every log record up to ``end``, then every checked value of the index's
    ``names``, each with its length (and the database's name and the key), in order."""
    with SegmentLog.open(os.path.join(path, "log"), readonly=True) as log:
        for batch in log.scan(0, end=end):
            for record in batch.records:
                digest.update(len(record).to_bytes(4, "big") + bytes(record))
    index = Index(os.path.join(path, "index"), map_size=1 << 26, readonly=True)
    try:
        with index.begin() as txn:
            for name in names:
                for key, value in index.range(txn, name, b""):
                    digest.update(name + len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + bytes(value))
    finally:
        index.close()


def test_a_fixed_history_writes_the_same_bytes_as_before_the_accept_path_was_made_cheaper(tmp_path):
    """The log and index formats are fixed (docs/format/): making the acceptance transaction
    cheaper (positional Events and Context, encoders called directly, the hashed body
    decoded alone) must not change a byte. The digest is that of the build before those changes
    (4f07246), for the same history."""
    assert _written_by_a_fixed_history(str(tmp_path / "s")) == "90c8cc4189694e524cba8425ed83273301b845e6c826c97a5efebcb08a4e7606"


def _outcomes_and_bytes_of_every_kind(path: str) -> str:
    """blake3 of what a fixed history that uses every kind but mission.update (the history above
    has it), group.archive and audit.delete (an archive's snapshot is signed with a new key each
    time) gives: each outcome, a
    rejection's code, message and detail included, every log record, and every checked index value
    (events, heads, states, receipts, acks). Accepted, rejected and engine-issued Commands, through
    ``accept``, ``accept_many``, ``expire_leases`` and ``ack``, with a fixed clock."""
    import blake3

    from mwpstore.work_keys import lease_id_for

    contract = {"max_attempts": 2, "backoff_initial_ms": 100, "backoff_multiplier": 2, "backoff_max_ms": 1_000,
                "cost_limit": 10, "deadline_ms": None, "lease_ms": 1_000, "start_ms": 1_000}

    def command(actor, action_id, kind, target, body, revision=None):
        return Command(actor=actor, action_id=action_id, group=GROUP, kind=kind, target=target, body=body, expected_revision=revision)

    def fence(workitem, epoch, **more):
        return {"lease_id": lease_id_for(GROUP, workitem, epoch), "ownership_epoch": epoch, **more}

    clock = FakeClock()
    outcomes: list[object] = []
    with open_with_group(path, clock=clock) as authority:

        def one(*args, revision=None):
            clock.advance(3)
            try:
                outcomes.append(("ok", authority.accept(command(*args, revision)).kind))
            except MwpError as exc:
                outcomes.append((exc.code, exc.message, exc.detail))

        def revision_of(aggregate):
            return authority.state(GROUP, aggregate)[0]

        setup = [
            mission_create("m1", action_id="m1"),
            command(OWNER, "m2", "mission.create", "m2", {"title": "gated", "cost_limit": 5, "approval_required": ["publish", "submit"]}),
            command(OWNER, "add-w", "membership.add", "w", {"role": "worker"}, 0),
            command(OWNER, "add-v", "membership.add", "v", {"role": "worker"}, 0),
            command(OWNER, "add-ap", "membership.add", "ap", {"role": "approver"}, 0),
            command(OWNER, "add-obs", "membership.add", "obs", {"role": "observer"}, 0),
            command(OWNER, "bad", "mission.create", "m3", {"title": "", "cost_limit": -1}),
            command(OWNER, "unknown", "no.such", "x", {}),
        ] + [command(OWNER, f"wi{n}", "workitem.create", f"wi{n}", {"mission": "m2" if n == 3 else "m1", "priority": n, "contract": contract})
             for n in range(1, 6)]
        for result in authority.accept_many(setup):
            outcomes.append(("ok", result.receipt.kind) if result.ok else (result.error_code, result.message, result.detail))
        one(OWNER, "change", "membership.change", "obs", {"role": "approver"}, revision=revision_of("member:obs"))
        one("w", "session", "session.replace", "w", {"session_epoch": 1})
        one("w", "claim-1", "workitem.claim", "wi1", {"session_epoch": 2}, revision=revision_of("workitem:wi1"))
        one("w", "claim-stale", "workitem.claim", "wi2", {"session_epoch": 1}, revision=revision_of("workitem:wi2"))
        one("w", "start-1", "workitem.start", "wi1", fence("wi1", 1))
        one("w", "charge-1", "workitem.charge", "wi1", fence("wi1", 1, cost=4, progress={"p": 1}))
        one("w", "charge-over", "workitem.charge", "wi1", fence("wi1", 1, cost=40))
        one("w", "block-1", "workitem.block", "wi1", fence("wi1", 1, checkpoint={"s": 1}, required_resolution="a human look"))
        one(OWNER, "resolve-1", "workitem.resolve", "wi1", {"resolution": "looked"})
        one("v", "claim-2", "workitem.claim", "wi2", {"session_epoch": 1}, revision=revision_of("workitem:wi2"))
        one("v", "start-2", "workitem.start", "wi2", fence("wi2", 1))
        one("v", "fail-2", "workitem.fail", "wi2", fence("wi2", 1, reason="boom", retryable=True))
        one("v", "claim-3", "workitem.claim", "wi3", {"session_epoch": 1}, revision=revision_of("workitem:wi3"))
        one("v", "start-3", "workitem.start", "wi3", fence("wi3", 1))
        one("v", "request-1", "approval.request", "ap-1", {"workitem": "wi3", "operation": "publish", "reason": "ship"})
        one("v", "publish-unapproved", "workitem.publish", "wi3", fence("wi3", 1, publication={"url": "x"}, approval="ap-1"))
        one("ap", "decide-1", "approval.decide", "ap-1", {"decision": "approved", "reason": "fine"}, revision=revision_of("approval:ap-1"))
        one("v", "publish-3", "workitem.publish", "wi3", fence("wi3", 1, publication={"url": "x"}, approval="ap-1"))
        one("v", "request-2", "approval.request", "ap-2", {"workitem": "wi3", "operation": "submit"})
        one("obs", "decide-2", "approval.decide", "ap-2", {"decision": "rejected"}, revision=revision_of("approval:ap-2"))
        one("v", "submit-rejected", "workitem.submit", "wi3", fence("wi3", 1, submission={"ok": 1}, approval="ap-2"))
        one("w", "claim-4", "workitem.claim", "wi4", {"session_epoch": 2}, revision=revision_of("workitem:wi4"))
        one(OWNER, "reassign-4", "workitem.reassign", "wi4", {"reason": "moved"})
        one(OWNER, "cancel-5", "workitem.cancel", "wi5", {"reason": "not needed"})
        one("w", "claim-5", "workitem.claim", "wi5", {"session_epoch": 2}, revision=revision_of("workitem:wi5"))
        one("v", "claim-4b", "workitem.claim", "wi4", {"session_epoch": 1}, revision=revision_of("workitem:wi4"))
        epoch = authority.state(GROUP, "workitem:wi4")[1]["ownership_epoch"]
        one("v", "start-4", "workitem.start", "wi4", fence("wi4", epoch))
        one("v", "renew-4", "lease.renew", "wi4", fence("wi4", epoch), revision=revision_of("workitem:wi4"))
        one("v", "checkpoint-4", "workitem.checkpoint", "wi4", fence("wi4", epoch, checkpoint={"step": 2}))
        one("v", "submit-4", "workitem.submit", "wi4", fence("wi4", epoch, submission={"ok": True, "score": 0.25}))
        clock.advance(5_000)
        outcomes.extend(("expired", receipt.kind, receipt.seq) for receipt in authority.expire_leases(GROUP))
        one(OWNER, "redact-1", "event.redact", "3", {"reason": "pii"})
        one(OWNER, "redact-again", "event.redact", "3", {"reason": "pii"})
        one(OWNER, "close-1", "mission.close", "m1", {"reason": "done"})
        one(OWNER, "remove-obs", "membership.remove", "obs", {"reason": "left"}, revision=revision_of("member:obs"))
        one("obs", "gone", "mission.create", "m9", {"title": "t", "cost_limit": 1})
        one(OWNER, "m1", "mission.create", "m1", {"title": "other", "cost_limit": 1})  # the Action ID again, other content
        outcomes.append(("ack", authority.ack("c1", GROUP, 5)))
        end = authority.log.end
    assert (sum(outcome[0] == "ok" for outcome in outcomes), len(outcomes)) == (39, 51)
    digest = blake3.blake3(repr(outcomes).encode())
    _digest_store_bytes(digest, path, end, (b"events", b"heads", b"states", b"receipts", b"acks"))
    return digest.hexdigest()


def test_every_kind_accepted_or_rejected_gives_the_same_outcomes_and_bytes_as_before_the_accept_path_was_made_cheaper(tmp_path):
    """The fixed history above covers the kinds and the rejections that the cheaper acceptance
    transaction's own test (Missions and one WorkItem's lease) does not: a positional Context or
    Event, the group view's batch reads, the body decoded alone and the kinds loaded once must
    change no outcome, no rejection's code, message or detail, no log record and no index value.
    The digest is that of the build before those changes (0743b1d), for the same history."""
    assert _outcomes_and_bytes_of_every_kind(str(tmp_path / "s")) == "b238b68a8da0996ac9721fa8120113898a3e843330c0904ca8996889ac3af2df"


_KINDS_LOADED_MEANWHILE = r"""
import sys, threading
from mwpstore import Command, MemoryGroup
from mwpstore.errors import UnknownKind

loading, asked, answered = threading.Event(), threading.Event(), threading.Event()


class PauseInTheWorkModelsImport:  # holds the first thread inside the kinds' loading
    def find_spec(self, name, path=None, target=None):
        if name == "mwpstore.work_model" and threading.current_thread().name == "first":
            loading.set()
            asked.wait(10)
            answered.wait(1)  # the fixed loading makes the second thread wait for it: no answer yet
        return None


sys.meta_path.insert(0, PauseInTheWorkModelsImport())
command = Command(actor="owner", action_id="c", group="g-1", kind="group.create", target="g-1", body={"org": "acme"})
first = threading.Thread(name="first", target=lambda: MemoryGroup("g-1").accept(command, now_ms=1))
first.start()
loading.wait(10)
asked.set()
try:
    from mwpstore.registry import kind_spec

    print(kind_spec("workitem.create").kind)
except UnknownKind as exc:
    print(exc.code)
answered.set()
first.join()
"""


def test_a_kind_asked_for_while_another_thread_loads_the_kinds_is_known():
    """The kinds are registered by importing their modules at the first ``kind_spec``. The flag
    that says so was set before the imports: a second thread's first Command meanwhile found it
    set and its kind not yet registered, and a valid Command was ``UNKNOWN_KIND`` (seen with four
    ``MemoryGroup``\\ s accepting their first ``group.create`` at once). Now the second thread waits
    for the loading to end. A fresh interpreter, whose first thread is held inside the work
    model's import while the second asks for a work-model kind."""
    result = subprocess.run([sys.executable, "-c", _KINDS_LOADED_MEANWHILE], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "workitem.create\n", "")


_FIRST_THREAD_HELD_IN_THE_KINDS_LOADING = r"""
import os, signal, sys, threading, time
from mwpstore.errors import UnknownKind
from mwpstore.registry import kind_spec

loading, release = threading.Event(), threading.Event()


class PauseInTheWorkModelsImport:  # holds the first thread inside the kinds' loading
    def find_spec(self, name, path=None, target=None):
        if name == "mwpstore.work_model" and threading.current_thread().name == "first":
            loading.set()
            release.wait(10)
        return None


sys.meta_path.insert(0, PauseInTheWorkModelsImport())
first = threading.Thread(name="first", target=lambda: kind_spec("group.create"))
first.start()
loading.wait(10)
"""
"""The start of a child script: its thread "first" is held inside the work model's import, the
kinds' loading, until the script sets ``release``."""

_FORKED_DURING_THE_KINDS_LOADING = _FIRST_THREAD_HELD_IN_THE_KINDS_LOADING + r"""
child = []


def fork_and_ask():
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child that waits for the lock of a thread it does not have: ended here
        answers = []
        for kind in ("group.create", "workitem.create"):
            try:
                answers.append(kind_spec(kind).kind)
            except UnknownKind as exc:
                answers.append(exc.code)
        print(" ".join(answers), flush=True)
        os._exit(0)
    child.append(pid)


forker = threading.Thread(target=fork_and_ask)
forker.start()
forker.join(1)  # the fixed fork waits for the loading: not forked yet
release.set()
forker.join()
first.join()
_, status = os.waitpid(child[0], 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_while_another_thread_loads_the_kinds_knows_them():
    """The kinds are loaded under a lock (finding 221). A process forked while another thread
    held it inherited it held, by a thread the child does not have: the child's first
    ``kind_spec``, of any kind, waited for it forever. Now a fork waits for the loading to end.
    A fresh interpreter whose first thread is held inside the work model's import while a second
    forks; the child, ended by an alarm if it waits, asks for a kind of each module."""
    # (-W: Python 3.12 and later warn of a fork in a process with threads.)
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_DURING_THE_KINDS_LOADING],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "group.create workitem.create\n0\n", "")


_FORKED_AND_INTERRUPTED_DURING_THE_KINDS_LOADING = _FIRST_THREAD_HELD_IN_THE_KINDS_LOADING + r"""
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while the main thread's fork waits
threading.Timer(1.0, release.set).start()
began = time.monotonic()
pid = os.fork()
if pid == 0:
    signal.alarm(5)  # a child that waits for the lock of a thread it does not have: ended here
    print(" ".join(kind_spec(kind).kind for kind in ("group.create", "workitem.create")), flush=True)
    os._exit(0)
waited = time.monotonic() - began
first.join()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), waited >= 0.9, flush=True)
"""


def test_a_fork_interrupted_while_it_waits_for_the_kinds_loading_still_waits_for_it():
    """The fork hook of finding 222 waits for another thread's loading of the kinds. A
    ``KeyboardInterrupt`` in the forking (main) thread while it waited ended the hook with it, and
    the interpreter, which only prints an exception raised in a fork hook, forked all the same:
    the child kept the lock held by a thread it does not have and its first ``kind_spec`` waited
    forever (ended by an alarm: exit status -14), and the parent's hook failed to release a lock
    it did not hold (a ``RuntimeError``, printed). The hook now waits on through the interrupt,
    which the interpreter prints once the lock is held."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_AND_INTERRUPTED_DURING_THE_KINDS_LOADING],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, "group.create workitem.create\n0 True\n")
    assert "KeyboardInterrupt" in result.stderr and "RuntimeError" not in result.stderr


def test_a_fork_before_the_kinds_are_loaded_leaves_the_loading_to_every_thread_of_both_processes():
    """The fork hook of finding 222 takes the kinds' lock before a fork and gives it back after,
    in the parent and in the child. A fork before any loading: the forking thread holds the lock
    across it, and a hook that did not give it back in one of the two processes left it held by
    that process's forking thread, so another thread's first ``kind_spec`` there waited forever
    (the forking thread itself would go through: the lock is reentrant). In each process a new
    thread asks for a kind of the work model; one that waits is reported as ``hung`` after 10 s."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_BEFORE_THE_KINDS_LOADING],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\nchild workitem.create\nparent workitem.create\n", "")


_FORKED_BEFORE_THE_KINDS_LOADING = r"""
import os, threading
from mwpstore import registry

print(registry._KINDS_LOADED, flush=True)


def asked_in_a_new_thread():
    answer = []
    thread = threading.Thread(target=lambda: answer.append(registry.kind_spec("workitem.create").kind), daemon=True)
    thread.start()
    thread.join(10)
    return answer[0] if answer else "hung"


pid = os.fork()
if pid == 0:
    print("child", asked_in_a_new_thread(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent", asked_in_a_new_thread(), flush=True)
"""


def test_a_process_forked_by_the_loading_thread_itself_goes_on_with_the_loading():
    """The fork hook takes the kinds' lock, which is reentrant: a fork from inside the loading, in
    the thread that loads (here a ``sys.meta_path`` finder forks when the work model is imported),
    is let through, and the child's thread goes on with the loading it was in. A lock that is not
    reentrant would make that fork wait for itself forever (ended by an alarm: exit status -14)."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_BY_THE_LOADING_THREAD],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "child workitem.create\nparent workitem.create\n", "")


_FORKED_BY_THE_LOADING_THREAD = r"""
import os, signal, sys
from mwpstore import registry

signal.alarm(20)
forked = []


class ForkInTheWorkModelsImport:
    def find_spec(self, name, path=None, target=None):
        if name == "mwpstore.work_model" and not forked:
            forked.append(os.fork())
        return None


sys.meta_path.insert(0, ForkInTheWorkModelsImport())
kind = registry.kind_spec("workitem.create").kind
if forked[0] == 0:
    print("child", kind, flush=True)
    os._exit(0)
os.waitpid(forked[0], 0)
print("parent", kind, flush=True)
"""


def test_a_kind_registered_twice_by_a_live_module_is_still_refused():
    """Finding 225 lets a kind be registered again when its spec came from a run of its module
    that failed (its ``decide`` belongs to a module that is no longer in ``sys.modules``). A spec
    of a live module registered again, or a copy of it, or one whose ``decide`` has no module
    globals to tell by (a callable object), is still refused ("registered twice"), and the
    registered spec is kept."""
    import dataclasses

    from mwpstore.registry import REGISTRY, kind_spec, register

    spec = kind_spec("group.create")

    class Decide:
        def __call__(self, view, command, context):
            return spec.decide(view, command, context)

    for again in (spec, dataclasses.replace(spec), dataclasses.replace(spec, decide=Decide())):
        with pytest.raises(AssertionError, match="group.create registered twice"):
            register(again)
        assert REGISTRY["group.create"] is spec
    loose = dataclasses.replace(spec, kind="test.loose", decide=Decide())
    try:
        assert register(loose) is loose
        with pytest.raises(AssertionError, match="test.loose registered twice"):
            register(dataclasses.replace(loose))
    finally:
        REGISTRY.pop("test.loose", None)


_LOADING_INTERRUPTED = r"""
import sys
from mwpstore import canonical, registry

check_kind = canonical.check_kind


def interrupted(kind):  # an interrupt inside a module's registrations, after its first
    if kind == sys.argv[1]:
        raise KeyboardInterrupt
    return check_kind(kind)


registry.canonical.check_kind = interrupted
try:
    if sys.argv[2] == "kind_spec":
        registry.kind_spec("group.create")
    else:
        import mwpstore.authority
except KeyboardInterrupt:
    pass
registry.canonical.check_kind = check_kind
if sys.argv[2] == "import-again":
    import mwpstore.authority
answers = []
for kind in ("group.create", "membership.add", "membership.change", "event.redact", "audit.delete", "workitem.create"):
    try:
        answers.append(registry.kind_spec(kind).kind)
    except BaseException as exc:
        answers.append(type(exc).__name__)
print(" ".join(answers))
# every kind is the live module's, not one of the failed run's (whose functions keep that run's
# globals: its caches, its classes)
print(all(spec.decide.__globals__ is sys.modules[spec.decide.__module__].__dict__ for spec in registry.REGISTRY.values()))
"""


@pytest.mark.parametrize(
    ("interrupted_at", "then"),
    [("membership.change", "kind_spec"), ("audit.delete", "import"), ("audit.delete", "import-again")],
    ids=["the first kind_spec's loading", "an import of the authority", "an import of the authority, then again"],
)
def test_kinds_whose_first_loading_was_interrupted_are_loaded_at_the_next_ask(interrupted_at, then):
    """A module that registers kinds and whose import fails part way (an interrupt, an error)
    is forgotten by Python and run again at the next import, with the kinds it registered before
    it failed still registered: its second run failed ``register``'s assertion ("registered
    twice"), and so did every later ``kind_spec`` of the process, ``group.create`` included (since
    finding 221, which retries a failed loading; before it, a loading that failed left the
    missing kinds ``UNKNOWN_KIND``, and an import that failed outside the loading, the assertion).
    Now a kind registered by a run of a module that is no longer the module may be registered
    again. A fresh interpreter whose registration of one kind raises ``KeyboardInterrupt`` once,
    in the first loading or in an import of the authority (then the kinds are asked for, or the
    import is run again first)."""
    result = subprocess.run(
        [sys.executable, "-c", _LOADING_INTERRUPTED, interrupted_at, then],
        capture_output=True, text=True, timeout=60,
    )
    expected = "group.create membership.add membership.change event.redact audit.delete workitem.create\nTrue\n"
    assert (result.returncode, result.stdout, result.stderr) == (0, expected, "")
