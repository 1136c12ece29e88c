"""Many threads mixing accept, read, subscribe, ack, snapshot, verify, compaction and AgentStore
delivery, under a watchdog: no deadlock, no wrong result (``mwpstore torture --suite concurrency``).

"""

from __future__ import annotations

import os
import threading
import time

import pytest

from authority_helpers import GROUP, mission_create, open_with_group
from blocking import wait_for_queue
from mwpstore import torture
from mwpstore.authority import Authority
from mwpstore.errors import StoreClosed



def test_concurrency_short_run_without_compaction():
    result = torture.run_concurrency(count=2, seed=1, skip=("compactor",))
    assert result["iterations"] == 2
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:3])
    operations = result["details"]["operations"]
    for name in ("accepted", "read", "subscribe_events", "ack", "snapshot", "verify", "delivered", "same_action"):
        assert operations.get(name, 0) > 0, name
    # Reader processes opened views and bare logs while the writer rolled its 64 KiB segments
    # over, and each round's close stopped a subscriber waiting in poll().
    for name in ("view_reader_opens", "log_reader_opens", "segment_rollovers", "reader_opens_across_rollover", "stopped_by_close"):
        assert operations.get(name, 0) > 0, (name, operations)


def test_concurrency_short_run_with_compaction():
    result = torture.run_concurrency(count=1, seed=1)
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:3])


def test_verify_while_compacting_reports_no_problem(tmp_path):
    """The minimal reproduction: a quiet store, one thread compacting, one verifying."""
    with Authority.open(str(tmp_path / "store")) as authority:
        torture.ensure_groups(authority)
        for number in range(200):
            authority.accept(torture._mission_create(torture.GROUPS[number % 2], f"m-{number}", f"a-{number}"))
        stop = threading.Event()
        errors: list[BaseException] = []

        def compact() -> None:
            try:
                while not stop.is_set():
                    authority.compact()
            except BaseException as exc:  # collected for the assertion below
                errors.append(exc)

        thread = threading.Thread(target=compact)
        thread.start()
        problems = []
        try:
            for _ in range(15):
                problems += authority.verify().problems
        finally:
            stop.set()
            thread.join(timeout=60)
        assert not errors and problems == []


def test_watchdog_reports_a_stuck_thread(monkeypatch):
    """A round whose threads never finish is a violation with their stacks, not a hung suite."""
    monkeypatch.setattr(torture, "CONCURRENCY_WATCHDOG_SECONDS", 0.5)
    # Long enough for the verifier to make its first call on two busy cores: with 0.3 s it
    # sometimes started after the round's end, called nothing, and no thread was stuck.
    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 3.0)
    release = threading.Event()
    original = Authority.verify

    def stuck_verify(self, *arguments, **options):
        release.wait(30)
        return original(self, *arguments, **options)

    monkeypatch.setattr(Authority, "verify", stuck_verify)
    try:
        # No reader processes: on two busy cores they could hold the verifier back past a 0.3 s round.
        result = torture.run_concurrency(count=1, seed=3, skip=("compactor", "view-reader", "log-reader"))
    finally:
        release.set()
    assert result["violations"] >= 1
    assert "deadlock" in result["details"]["violation_messages"][0]
    assert "stuck_verify" in result["details"]["violation_messages"][0]


def test_a_violation_found_under_the_harness_lock_is_reported_not_a_hang(monkeypatch):
    """The acker checks what ``ack`` returned while it holds the round's lock, and reports through
    ``problem``, which takes that lock too: with a plain lock the first wrong ACK hung the acker,
    then the watchdog's own report, and the suite never ended (seen with compaction dropping ACK
    records). A store whose ``ack`` stores less than it was given must come out as violations."""
    original = Authority.ack

    def short_ack(self, consumer, group, cursor):
        stored = original(self, consumer, group, cursor)
        return stored - 1 if stored > 0 else stored

    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 1.0)
    monkeypatch.setattr(torture, "CONCURRENCY_WATCHDOG_SECONDS", 5.0)
    monkeypatch.setattr(Authority, "ack", short_ack)
    skip = ("same_action", "reader", "snapshotter", "verifier", "compactor", "agent", "view-reader", "log-reader")
    results: list[dict] = []
    runner = threading.Thread(target=lambda: results.append(torture.run_concurrency(count=1, seed=6, skip=skip)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert results, "the suite hung on its own lock"
    messages = results[0]["details"]["violation_messages"]
    assert results[0]["violations"] >= 1 and all("ack(" in message for message in messages), messages[:3]


def test_a_subscriber_that_meets_a_closed_store_before_the_round_ends_is_a_violation(monkeypatch):
    """The round's close stops the subscribers (StoreClosed once the round is over is their end,
    counted as stopped_by_close); a StoreClosed while the round runs is a violation."""
    from mwpstore.authority import Subscription

    def closed(self, timeout=None):
        raise StoreClosed("the authority is closed")

    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 1.0)
    monkeypatch.setattr(Subscription, "poll", closed)
    skip = ("compactor", "verifier", "snapshotter", "agent", "view-reader", "log-reader")
    result = torture.run_concurrency(count=1, seed=5, skip=skip)
    messages = result["details"]["violation_messages"]
    assert len(messages) == 2 and all("STORE_CLOSED" in m and "before the round closed the authority" in m for m in messages), messages
    assert "stopped_by_close" not in result["details"]["operations"]


def test_skip_from_the_environment(monkeypatch):
    monkeypatch.setenv("MWPSTORE_CONCURRENCY_SKIP", "compactor,verifier,snapshotter,agent")
    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 1.0)
    result = torture.run_concurrency(count=1, seed=4)
    assert result["violations"] == 0
    assert {"compactor", "verifier"} <= set(result["details"]["skipped"])
    assert "compact" not in result["details"]["operations"]
    assert os.environ["MWPSTORE_CONCURRENCY_SKIP"]


# -- a caller interrupted while it waits for a commit -----------------------------------------


def _leader_held_at_append(monkeypatch, authority):
    """Make the next commit's leader stop just before its log append until ``go`` is set."""
    from mwpstore import failpoints

    entered, go = threading.Event(), threading.Event()
    original = failpoints.hit

    def hit(name: str) -> None:
        if name == "authority.before_log_append" and not go.is_set():
            entered.set()
            go.wait(30)
        original(name)

    monkeypatch.setattr(failpoints, "hit", hit)
    leader = threading.Thread(
        target=authority.accept, args=(torture._mission_create(torture.GROUPS[0], "m-lead", "a-lead"),), daemon=True
    )
    leader.start()
    assert entered.wait(10)
    return leader, go


def test_an_interrupted_waiting_caller_withdraws_and_the_next_one_still_commits(tmp_path, monkeypatch):
    """KeyboardInterrupt while the main thread waits behind a running commit: its Command is
    withdrawn (not written), the leader role passes to the next waiting caller, close() returns."""
    import signal

    group = torture.GROUPS[0]
    authority = Authority.open(str(tmp_path / "store"))  # closed at the end only: a lost leader role would hang close()
    torture.ensure_groups(authority)
    head_before = authority.head(group)[0]
    leader, go = _leader_held_at_append(monkeypatch, authority)
    results: dict[str, object] = {}

    def third() -> None:
        wait_for_queue(authority, 1)  # the main thread's unit is queued first
        waiter = threading.Thread(
            target=lambda: results.setdefault("third", authority.accept(torture._mission_create(group, "m-third", "a-third"))),
            daemon=True,
        )
        waiter.start()
        results["waiter"] = waiter
        wait_for_queue(authority, 2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # A process started in the background by a non-interactive shell inherits SIGINT ignored, and
    # Python then installs no handler: install the one that raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        helper = threading.Thread(target=third)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            authority.accept(torture._mission_create(group, "m-main", "a-main"))
    finally:
        signal.signal(signal.SIGINT, previous)
    helper.join(10)
    go.set()
    leader.join(10)
    waiter = results["waiter"]
    waiter.join(10)
    assert not waiter.is_alive(), "the caller behind the interrupted one was never led"
    assert results["third"].seq == head_before + 2  # the leader's, then the third's: main's is gone
    assert authority.state(group, "mission:m-main") == (0, None)
    again = authority.accept(torture._mission_create(group, "m-main", "a-main"))
    assert again.seq == head_before + 3  # a new Event: nothing of the withdrawn one was kept
    authority.close()


def test_a_caller_interrupted_as_leadership_reaches_it_leads_then_raises(tmp_path, monkeypatch):
    """The interrupt lands just as the leader role is handed over: the caller commits its unit
    first (the role is not lost with it), then raises."""
    from mwpstore.authority import _Unit

    group = torture.GROUPS[0]

    class InterruptedGate:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.lock.acquire()

        def acquire(self, blocking: bool = True) -> bool:
            if not blocking:
                return self.lock.acquire(False)
            self.lock.acquire()  # opened by the leader ...
            self.lock.release()
            raise KeyboardInterrupt  # ... and interrupted right then

        def release(self) -> None:
            self.lock.release()

    with Authority.open(str(tmp_path / "store")) as authority:
        torture.ensure_groups(authority)
        leader, go = _leader_held_at_append(monkeypatch, authority)
        request = authority._prepare(torture._mission_create(group, "m-main", "a-main"))
        unit = _Unit([request])
        unit.gate = InterruptedGate()
        threading.Timer(0.2, go.set).start()
        with pytest.raises(KeyboardInterrupt):
            authority._submit(unit)
        leader.join(10)
        assert unit.done and request.error is None and request.receipt is not None
        assert authority.state(group, "mission:m-main")[0] == 1
        assert not authority._leader


def test_a_caller_interrupted_inside_a_running_commit_still_wakes_the_next(tmp_path, monkeypatch):
    """The interrupt lands after a commit took the caller's unit, before its wake-up arrived: the
    caller waits for that commit and wakes the next answered caller (the wake-ups form a chain),
    then raises. Raising at once left the callers after it asleep."""
    from mwpstore.authority import _Unit

    group = torture.GROUPS[0]
    authority = Authority.open(str(tmp_path / "store"))  # closed at the end only: a lost wake-up would hang close()
    torture.ensure_groups(authority)
    leader, go = _leader_held_at_append(monkeypatch, authority)
    request = authority._prepare(torture._mission_create(group, "m-main", "a-main"))
    unit = _Unit([request])

    class InterruptedGate:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.lock.acquire()
            self.blocking_calls = 0

        def acquire(self, blocking: bool = True) -> bool:
            if not blocking:
                return False  # as if the wake-up had not come yet
            self.blocking_calls += 1
            if self.blocking_calls == 1:
                while not unit.done:  # a commit took the unit and answered it ...
                    threading.Event().wait(0.001)
                raise KeyboardInterrupt  # ... and the interrupt came first
            return self.lock.acquire()

        def release(self) -> None:
            self.lock.release()

    unit.gate = InterruptedGate()
    results: dict[str, object] = {}

    def caller(name: str) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.setdefault(name, authority.accept(torture._mission_create(group, f"m-{name}", f"a-{name}"))),
            daemon=True,
        )
        thread.start()
        return thread

    def arrange() -> None:
        wait_for_queue(authority, 2)  # the second caller, then the main thread, then the third
        results["third_thread"] = caller("third")
        wait_for_queue(authority, 3)
        go.set()

    before = caller("second")
    wait_for_queue(authority, 1)
    threading.Thread(target=arrange, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        authority._submit(unit)
    for thread in (leader, before, results["third_thread"]):
        thread.join(10)
        assert not thread.is_alive(), "a caller after the interrupted one was never woken"
    assert unit.gate.blocking_calls == 2  # it waited for its wake-up before passing it on
    assert request.receipt is not None and results["third"].seq == request.receipt.seq + 1
    authority.close()


# -- close, rebuild and interrupts against readers and leaders (a review of 2026-12-03) -----------


def test_close_waits_for_a_read_in_flight_and_later_reads_are_store_closed(tmp_path, monkeypatch):
    from mwpstore import _sealed

    authority = open_with_group(str(tmp_path / "store"))
    real = _sealed._unseal
    paused, resume = threading.Event(), threading.Event()

    def held(stored, *args):  # the reader holds a view into the index's map here
        if threading.current_thread().name == "reader" and not paused.is_set():
            paused.set()
            resume.wait(10)
        return real(stored, *args)

    monkeypatch.setattr(_sealed, "_unseal", held)
    results: list[object] = []
    reader = threading.Thread(target=lambda: results.append(authority.state(GROUP, f"group:{GROUP}")), name="reader")
    reader.start()
    assert paused.wait(10)
    closer = threading.Thread(target=authority.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # close() waits: the index stays mapped under the reader
    resume.set()
    reader.join(10)
    closer.join(10)
    assert not closer.is_alive() and results[0][0] == 1  # the reader got its answer, not damage
    with pytest.raises(StoreClosed):
        authority.state(GROUP, f"group:{GROUP}")


def test_readers_racing_close_get_store_closed_never_corruption(tmp_path):
    for round_number in range(5):
        authority = open_with_group(str(tmp_path / f"store-{round_number}"))
        authority.accept_many([mission_create(f"m-{i}") for i in range(50)])
        errors: list[BaseException] = []
        stop = threading.Event()

        def read_until_closed() -> None:
            while not stop.is_set():
                try:
                    authority.read(GROUP, after=0, limit=100)
                    authority.aggregates(GROUP)
                    authority.head(GROUP)
                except StoreClosed:
                    return
                except BaseException as exc:  # anything else is the bug
                    errors.append(exc)
                    return

        readers = [threading.Thread(target=read_until_closed) for _ in range(4)]
        for reader in readers:
            reader.start()
        time.sleep(0.05)
        authority.close()
        stop.set()
        for reader in readers:
            reader.join(10)
        assert errors == []


def test_a_rebuild_waiting_behind_a_commit_does_not_run_after_close(tmp_path):
    authority = open_with_group(str(tmp_path / "store"))
    outcome: list[object] = []
    holding, release = threading.Event(), threading.Event()

    def hold_the_leader_role() -> None:
        with authority._exclusive():  # stands for a long commit
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_leader_role)
    holder.start()
    assert holding.wait(10)

    def rebuild() -> None:
        try:
            outcome.append(authority.rebuild())
        except BaseException as exc:
            outcome.append(exc)

    rebuilder = threading.Thread(target=rebuild)
    rebuilder.start()
    closer = threading.Thread(target=authority.close)
    time.sleep(0.1)  # the rebuild waits for the role
    closer.start()
    time.sleep(0.1)
    release.set()
    for thread in (holder, rebuilder, closer):
        thread.join(10)
    assert isinstance(outcome[0], StoreClosed)
    with open_with_group(str(tmp_path / "store")) as again:  # closed cleanly, nothing left open
        assert again.open_report.mode == "clean"


def test_an_interrupt_before_the_log_append_withdraws_the_batch_and_the_handle_keeps_working(tmp_path):
    state = {"interrupt": False}
    queued_behind = threading.Event()

    def clock() -> int:
        if state["interrupt"] and threading.current_thread() is threading.main_thread():
            state["interrupt"] = False
            queued_behind.wait(10)  # another caller's Command is queued behind this leader
            deadline = time.monotonic() + 10
            while not authority._queue and time.monotonic() < deadline:
                time.sleep(0.001)
            raise KeyboardInterrupt
        return 1_700_000_000_000

    authority = open_with_group(str(tmp_path / "store"), clock=clock)
    other: list[object] = []

    def background() -> None:
        queued_behind.set()
        other.append(authority.accept(mission_create("m-other")))

    state["interrupt"] = True
    thread = threading.Thread(target=background)
    with pytest.raises(KeyboardInterrupt):
        thread.start()
        authority.accept(mission_create("m-main"))
    thread.join(10)
    # nothing of the interrupted batch was written; the queued Command was decided again
    assert other[0].seq == 2 and other[0].aggregate == "mission:m-other"
    assert authority.head(GROUP)[0] == 2 and authority.state(GROUP, "mission:m-main") == (0, None)
    assert authority.accept(mission_create("m-main")).seq == 3  # and the handle keeps working
    authority.close()


def test_verify_compares_with_the_index_a_rebuild_installed_meanwhile(tmp_path):
    with open_with_group(str(tmp_path / "store")) as authority:
        log, index = authority._pair  # what a verify() that started now holds
        authority.rebuild()
        authority.accept(mission_create("m-after-rebuild"))  # goes to the new index only
        # no problem, and the live index passed the structural check
        assert authority._compare_with_rebuild(log, index, authority._scratch_directory("index.verify-")) == ([], True)
        assert authority.verify().ok


def test_close_from_a_callback_inside_a_read_is_refused_not_a_hang(tmp_path):
    from mwpstore.errors import InvalidCommand

    authority = open_with_group(str(tmp_path / "store"))
    refused: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        try:
            authority.close()
        except InvalidCommand as exc:
            refused.append(exc)

    assert authority.verify(progress).ok
    assert refused and refused[0].detail["field"] == "close"
    authority.close()  # after the read it closes
    with pytest.raises(StoreClosed):
        authority.head(GROUP)


def test_an_interrupt_as_a_read_registers_still_unregisters_it(tmp_path):
    """CPython delivers a signal's exception (KeyboardInterrupt) when a call returns: right after
    the reader's ``list.append``. The read must still leave the registry, or every close() waits
    for it forever (from another thread) or calls itself a close from inside a read."""
    authority = open_with_group(str(tmp_path / "store"))

    class InterruptedOnce(list):
        def append(self, reader: int) -> None:
            super().append(reader)
            if not hasattr(self, "interrupted"):
                self.interrupted = True
                raise KeyboardInterrupt

    authority._readers = InterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        authority.head(GROUP)
    assert list(authority._readers) == []
    assert authority.head(GROUP)[0] == 1  # the handle keeps working
    closer = threading.Thread(target=authority.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    with pytest.raises(StoreClosed):
        authority.head(GROUP)


def test_reads_after_close_never_register(tmp_path):
    """A read after close() is refused before it registers, so callers retrying in a loop after
    StoreClosed cannot keep a close() that is still waiting for earlier reads from seeing none."""
    authority = open_with_group(str(tmp_path / "store"))

    class Counting(list):
        appends = 0

        def append(self, reader: int) -> None:
            Counting.appends += 1
            super().append(reader)

    authority._readers = Counting()
    authority.head(GROUP)
    assert Counting.appends == 1
    authority.close()
    for _ in range(3):
        with pytest.raises(StoreClosed):
            authority.head(GROUP)
    assert Counting.appends == 1
def test_one_commit_takes_whole_units_up_to_commit_batch_commands_max(tmp_path):
    """The leader gathers queued units into one commit while the total stays within
    COMMIT_BATCH_COMMANDS_MAX; a unit that would pass it waits for the next commit (a unit larger
    than the bound alone is still taken whole: an accept_many shares one commit)."""
    from types import SimpleNamespace

    from mwpstore import limits

    bound = limits.COMMIT_BATCH_COMMANDS_MAX
    authority = Authority.open(str(tmp_path / "store"))
    try:
        units = [SimpleNamespace(requests=[None] * size) for size in (bound + 5, bound - 1, 1, 1)]
        authority._queue.extend(units)
        assert authority._take_units() == units[:1]
        assert authority._take_units() == units[1:3]
        assert authority._take_units() == units[3:]
    finally:
        authority._queue.clear()
        authority.close()


def test_a_close_interrupted_while_it_waits_for_a_read_is_finished_by_the_next_close(tmp_path, sigint_raises):
    """close() waits for the reads in flight. A KeyboardInterrupt in that wait leaves the store
    closed to new work but still holding its lock, index and log; the next close() must release
    them (before, it saw the store closed and returned, and the directory stayed locked)."""
    from authority_helpers import close_interrupted_while_it_waits
    from mwpstore.audit_log import FileKeyProvider

    path = str(tmp_path / "store")
    authority = open_with_group(path)
    inside, leave = threading.Event(), threading.Event()

    class BlockingProvider(FileKeyProvider):
        def current_key(self, org):
            inside.set()
            leave.wait(30)
            return super().current_key(org)

    provider = BlockingProvider(os.path.join(path, "keys", "orgs"))
    outcome: list = []

    def archive() -> None:
        try:
            outcome.append(authority.archive(GROUP, actor="owner", action_id="archive", key_provider=provider))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    reader = threading.Thread(target=archive, daemon=True)
    reader.start()
    assert inside.wait(30)  # archive() is a registered read, waiting in the provider
    close_interrupted_while_it_waits(authority.close, lambda: authority.head(GROUP), lambda: Authority.open(path))
    leave.set()
    reader.join(30)
    assert not reader.is_alive() and isinstance(outcome[0], StoreClosed)  # it went on after close()
    authority.close()
    authority.close()  # idempotent
    with Authority.open(path) as again:
        assert again.open_report.mode == "clean"  # marked clean by the second close()
        assert again.verify().ok


@pytest.mark.parametrize("outer", ["rebuild", "compact"])
@pytest.mark.parametrize(
    "inner",
    [
        "accept", "accept_many", "accept_trusted", "expire_leases", "ack", "redact", "delete_audit_log", "snapshot",
        "archive", "rotate_signing_key", "sync", "rebuild", "compact", "verify", "close", "wait_for", "poll",
    ],
)
def test_a_write_from_a_callback_of_rebuild_or_compact_is_refused_not_a_hang(tmp_path, outer, inner):
    """rebuild() and compact() hold the commit role while they call ``progress``: a commit, a
    verify or a close() asked for from inside it waited for that role (held by its own thread)
    forever. So did a wait for the Group's next Event (``wait_for``, a subscription's ``poll``):
    no commit can publish one before the callback returns."""
    from mwpstore.errors import InvalidCommand

    authority = open_with_group(str(tmp_path / "store"))
    authority.accept(mission_create("m-1"))
    head = authority.head(GROUP)
    calls = {
        "accept": lambda: authority.accept(mission_create("m-2")),
        "accept_many": lambda: authority.accept_many([mission_create("m-3")]),
        "accept_trusted": lambda: authority.accept_trusted(mission_create("m-4")),
        "expire_leases": lambda: authority.expire_leases(GROUP),
        "ack": lambda: authority.ack("agent-1", GROUP, 1),
        "redact": lambda: authority.redact(GROUP, 2, actor="owner", action_id="redact-1", reason="test"),
        "delete_audit_log": lambda: authority.delete_audit_log(GROUP, actor="owner", action_id="delete-1", basis="legal"),
        "snapshot": lambda: authority.snapshot(GROUP),
        "archive": lambda: authority.archive(GROUP, actor="owner", action_id="archive-1"),
        "rotate_signing_key": lambda: authority.rotate_signing_key(),
        "sync": lambda: authority.sync(),
        "rebuild": lambda: authority.rebuild(),
        "compact": lambda: authority.compact(),
        "verify": lambda: authority.verify(),
        "close": lambda: authority.close(),
        "wait_for": lambda: authority.wait_for(GROUP, head[0], None),
        "poll": lambda: authority.subscribe(GROUP, after=head[0]).poll(None),
    }
    refused: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if not refused:
            try:
                calls[inner]()
            except InvalidCommand as exc:
                refused.append(exc)

    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(getattr(authority, outer)(progress)), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), f"{inner} from inside {outer}'s progress hung"
    assert outcome and refused and refused[0].detail["field"] == {"poll": "wait_for"}.get(inner, inner)
    assert authority.head(GROUP) == head  # nothing of the refused call was written
    assert authority.acked("agent-1", GROUP) == 0 and authority.snapshots(GROUP) == []
    assert not os.path.exists(os.path.join(authority.path, "snapshots"))
    assert authority.verify().ok
    authority.close()
    with Authority.open(str(tmp_path / "store")) as reopened:
        assert reopened.head(GROUP) == head and reopened.verify().ok


@pytest.mark.parametrize("call", ["current_key", "key_for"])
def test_an_archive_from_inside_an_archives_key_provider_is_refused_not_a_hang(tmp_path, call):
    """archive() calls run one at a time (a lock): one asked for from the key provider of a running
    archive(), in its thread, waited for the lock its own thread held, for ever. It is refused
    (``InvalidCommand``, field ``archive``), the other Group is not archived, and the running
    archive() completes."""
    from blocking import outcome_within
    from authority_helpers import group_create
    from mwpstore.audit_log import FileKeyProvider
    from mwpstore.errors import InvalidCommand

    path = str(tmp_path / "store")
    authority = open_with_group(path)
    authority.accept(group_create("g-2"))
    head = authority.head("g-2")
    refused: list[BaseException] = []

    class ReenteringProvider(FileKeyProvider):
        def _archive_again(self, name: str) -> None:
            if name == call and not refused:
                try:
                    authority.archive("g-2", actor="owner", action_id="archive-2")
                except InvalidCommand as exc:
                    refused.append(exc)

        def current_key(self, org):
            self._archive_again("current_key")
            return super().current_key(org)

        def key_for(self, org, key_id):
            self._archive_again("key_for")
            return super().key_for(org, key_id)

    provider = ReenteringProvider(os.path.join(path, "keys", "orgs"))
    record = outcome_within(30, lambda: authority.archive(GROUP, actor="owner", action_id="archive-1", key_provider=provider))
    assert record == authority.archive_record(GROUP) is not None
    assert refused and refused[0].detail["field"] == "archive"
    assert authority.head("g-2") == head and authority.archive_record("g-2") is None
    assert authority.archive("g-2", actor="owner", action_id="archive-2").group == "g-2"  # the handle keeps working
    assert authority.verify().ok
    authority.close()


@pytest.mark.parametrize("inner", ["snapshot", "archive", "rotate_signing_key", "drop_retired_key"])
def test_a_clock_read_by_a_snapshot_that_calls_back_into_it_is_refused_not_a_hang(tmp_path, inner):
    """snapshot() reads the clock (the file's creation time) while it holds the lock that lets one
    snapshot or key change run at a time: a snapshot(), an archive() (which takes a snapshot) or a
    key change asked for from that clock waited for the lock its own thread held, for ever. It is
    refused (``InvalidCommand``, field the call's name) before anything is written: the other
    Group is not archived, the key is not changed, and the running snapshot completes."""
    from blocking import outcome_within
    from authority_helpers import group_create
    from mwpstore.errors import InvalidCommand, NotFound

    refused: list[BaseException] = []
    reentering = [False]
    holder: list[Authority] = []
    calls = {
        "snapshot": lambda: holder[0].snapshot("g-2"),
        "archive": lambda: holder[0].archive("g-2", actor="owner", action_id="archive-2"),
        "rotate_signing_key": lambda: holder[0].rotate_signing_key(),
        "drop_retired_key": lambda: holder[0].drop_retired_key("0" * 16),
    }

    def clock() -> int:
        if reentering[0]:
            reentering[0] = False
            try:
                calls[inner]()
            except InvalidCommand as exc:
                refused.append(exc)
        return 1_700_000_000_000

    path = str(tmp_path / "store")
    authority = Authority.open(path, clock=clock)
    holder.append(authority)
    authority.accept(group_create())
    authority.accept(group_create("g-2"))
    key_id = authority.signing_key.key_id
    head = authority.head("g-2")
    reentering[0] = True
    ref = outcome_within(30, lambda: authority.snapshot(GROUP))
    assert ref.seq == 1 and authority.snapshots(GROUP) == [ref]
    assert refused and refused[0].detail["field"] == inner
    assert authority.head("g-2") == head and authority.archive_record("g-2") is None and authority.snapshots("g-2") == []
    assert authority.signing_key.key_id == key_id
    if inner == "drop_retired_key":  # the handle keeps working
        with pytest.raises(NotFound):  # no such retired key: the call itself ran
            calls[inner]()
    else:
        calls[inner]()
    assert authority.verify().ok
    authority.close()


@pytest.mark.parametrize("inner", ["accept", "close", "wait_for"])
def test_a_clock_that_calls_back_into_the_authority_is_refused_not_a_hang(tmp_path, inner):
    """The commit leader reads the clock: an accept() or close() from inside it waited for the
    commit role its own thread held, forever, and so did a wait_for() (no later commit could
    publish the Event it waits for). It is refused instead, as any clock that raises."""
    from mwpstore.errors import InvalidCommand

    holder: list[Authority] = []
    reentering = [False]

    def clock() -> int:
        if reentering[0]:
            reentering[0] = False
            if inner == "accept":
                holder[0].accept(mission_create("m-from-clock"))
            elif inner == "wait_for":
                holder[0].wait_for(GROUP, holder[0].head(GROUP)[0], None)
            else:
                holder[0].close()
        return 1_700_000_000_000

    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    authority = Authority.open(path, clock=clock)
    holder.append(authority)
    head = authority.head(GROUP)
    reentering[0] = True
    outcome: list[BaseException] = []

    def accept() -> None:
        try:
            authority.accept(mission_create("m-1"))
        except InvalidCommand as exc:
            outcome.append(exc)

    worker = threading.Thread(target=accept, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), f"{inner} from inside the clock hung"
    assert outcome and outcome[0].detail["field"] == "clock" and inner in outcome[0].message
    assert authority.head(GROUP) == head
    authority.accept(mission_create("m-2"))  # the handle keeps working
    assert authority.verify().ok
    authority.close()
