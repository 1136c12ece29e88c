"""In-process delivery: pull a Group's Events from a source into an AgentStore, at least once.

Each round reads a batch after the durable Cursor, applies it in one local transaction, advances
the Cursor and commits, and only then ACKs the Cursor to the source (MWP-WRK-030). A crash anywhere
in a round loses nothing: the next round reads again after the durable Cursor, and whatever was
already applied comes back as duplicates.

:class:`FaultyTransport` wraps a source for tests: it duplicates, reorders and drops Events,
replays Events from before the requested position, and disconnects now and then.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from . import canonical, limits
from .agent_store import AgentStore, ApplyStatus, GroupHead, admit_event
from .errors import TransportDisconnected  # noqa: F401  (defined with the other errors; re-exported here)
from .errors import CursorTooOld, EventInvalid, InvalidCommand, LimitExceeded, MwpError
from .messages import Event

BATCH_EVENTS_DEFAULT = 1000
STALLED_ROUNDS_MAX = 100  # rounds in a row that return Events without moving the Cursor
ROUNDS_MAX_DEFAULT = 1_000_000
RECONNECTS_MAX_DEFAULT = 1000  # disconnects in a row that catch_up reconnects after
REJECTIONS_KEPT_MAX = 100
"""``DeliveryStats.rejections`` keeps the first errors only; ``rejected`` counts them all."""


@runtime_checkable
class EventSource(Protocol):
    """Anything that serves a Group's Events in order after a sequence (an ``Authority``)."""

    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[Event]: ...



@dataclass
class DeliveryStats:
    rounds: int = 0
    received: int = 0
    applied: int = 0
    duplicates: int = 0
    buffered: int = 0
    rejected: int = 0
    disconnects: int = 0
    restores: int = 0
    rejections: list[MwpError] = field(default_factory=list)

    def add(self, status: ApplyStatus) -> None:
        if status is ApplyStatus.APPLIED:
            self.applied += 1
        elif status is ApplyStatus.DUPLICATE:
            self.duplicates += 1
        else:
            self.buffered += 1


def deliver_batch(agent: AgentStore, group: str, events: Iterable[Any], stats: DeliveryStats | None = None) -> int:
    """Apply one batch in one local transaction, advance the Cursor, commit; return the Cursor.

    An Event that fails validation is counted as rejected and skipped (nothing of it is written);
    the rest of the batch still applies. An Event of another Group is rejected. An error that
    leaves the transaction unusable (a full map; in trusted mode a state that cannot be stored)
    ends the batch with that error, and nothing of the batch is committed. ``events`` may be
    any iterable of Events (a source's answer); it is taken as a list.
    """
    _check_agent(agent)
    if stats is not None and not isinstance(stats, DeliveryStats):
        raise InvalidCommand("stats must be a DeliveryStats or None", field="stats")
    stats = stats if stats is not None else DeliveryStats()
    events = _as_batch(events)
    with agent.begin() as tx:
        if all(type(event) is Event and event.group == group for event in events):
            _apply_skipping_rejected(tx, events, stats)  # the common case: apply_many's C runs
            return tx.advance_cursor(group)
        for event in events:
            stats.received += 1
            try:
                if not isinstance(event, Event):
                    event = admit_event(event)[0]  # bytes: decode (bounded) to see their Group
                if event.group != group:
                    raise EventInvalid(f"an Event of group {event.group!r} was delivered for {group!r}", reason="group")
                stats.add(tx.apply(event))
            except (EventInvalid, LimitExceeded) as exc:
                if _ends_batch(tx, exc):
                    raise
                stats.rejected += 1
                if len(stats.rejections) < REJECTIONS_KEPT_MAX:
                    stats.rejections.append(exc)
        cursor = tx.advance_cursor(group)
    return cursor


def _as_batch(events: Any) -> list[Any]:
    """A source's answer as a list: the C runs behind ``apply_many`` take exactly a list, and a
    generator would be used up by a first look (and is true even when empty)."""
    if type(events) is list:
        return events
    if isinstance(events, (str, bytes, bytearray, memoryview)) or not isinstance(events, Iterable):
        raise InvalidCommand("a batch is an iterable of Events (or their bytes)", field="events")
    return list(events)


def _apply_skipping_rejected(tx: Any, events: list[Event], stats: DeliveryStats) -> None:
    """``tx.apply_many`` over ``events``; an Event that fails validation is counted as rejected
    and skipped, and the rest applies: what applying them one by one does."""
    start = 0
    while start < len(events):
        statuses: list[ApplyStatus] = []
        rejected = 0
        try:
            tx._apply_into(events if start == 0 else events[start:], statuses)
        except (EventInvalid, LimitExceeded) as exc:  # statuses stops just before it
            if _ends_batch(tx, exc):
                raise
            rejected = 1
            stats.rejected += 1
            if len(stats.rejections) < REJECTIONS_KEPT_MAX:
                stats.rejections.append(exc)
        for status in statuses:
            stats.add(status)
        stats.received += len(statuses) + rejected
        start += len(statuses) + rejected


def _ends_batch(tx: Any, exc: MwpError) -> bool:
    """Whether an error out of ``apply`` ends the batch instead of rejecting one Event: the
    AgentStore's map found full (``LIMIT_EXCEEDED``, field ``map_size``), no fault of the Event,
    whose skipping would leave a gap; or any error that has failed the transaction (a full map
    too, and in trusted mode a state that cannot be stored, found when the write cache is flushed,
    which may be in the middle of a batch), after which nothing more can apply. Either way the
    batch ends with that error, as the same error at its commit does."""
    full = isinstance(exc, LimitExceeded) and exc.detail.get("field") == "map_size"
    return full or tx._failed is not None


class Delivery:
    """Pulls Groups from ``source`` into ``agent``.

    ``consumer`` names this agent in the source's ACK table (when the source has ``ack``).
    ``restore_snapshot(error)`` is called on ``CursorTooOld`` and must return the snapshot bytes to
    restore (e.g. fetched by ``error.snapshot_ref``); without it ``CursorTooOld`` propagates. A
    snapshot below the error's replay floor (or at or below the refused Cursor) is refused with
    ``SnapshotInvalid`` (``sequence``) before anything is written.
    ``org`` binds such a snapshot to the Group's Organization when the store does not know it yet.
    """

    def __init__(
        self,
        agent: AgentStore,
        source: EventSource,
        *,
        consumer: str | None = None,
        batch_events: int = BATCH_EVENTS_DEFAULT,
        restore_snapshot: Callable[[CursorTooOld], bytes] | None = None,
        org: str | None = None,
    ) -> None:
        if type(batch_events) is not int or not 0 < batch_events <= limits.READ_LIMIT_MAX:
            raise InvalidCommand(f"batch_events must be in 1..{limits.READ_LIMIT_MAX}", field="batch_events")
        # every argument checked here, before the first round: used there, a wrong one was
        # AttributeError or TypeError, the restore callback's only once the source said
        # CURSOR_TOO_OLD, and a consumer's only at the ACK, after every local commit
        _check_agent(agent)
        _check_source(source)
        if restore_snapshot is not None and not callable(restore_snapshot):
            raise InvalidCommand("restore_snapshot must be a callable(error) returning snapshot bytes, or None", field="restore_snapshot")
        for name, value in (("consumer", consumer), ("org", org)):
            if value is not None:
                canonical.check_id(value, name)
        self.agent = agent
        self.source = source
        self.consumer = consumer
        self.batch_events = batch_events
        self.restore_snapshot = restore_snapshot
        self.org = org
        self.stats = DeliveryStats()

    def pull_once(self, group: str) -> int:
        """One round: read after the durable Cursor, apply, advance, commit, ACK. Returns how many
        Events the source returned (0: caught up; -1: the source said CURSOR_TOO_OLD and the
        Group was restored from a snapshot, or, the store having applied Events past the replay
        floor, the source served nothing that tells whether they are its own). A store that
        applied Events past the floor reads on from its applied sequence instead of restoring."""
        after = self.agent.cursor(group)
        try:
            events = _as_batch(self.source.read(group, after=after, limit=self.batch_events))
        except CursorTooOld as exc:
            floor = _floor_of(exc)
            head = self.agent.head(group)
            if floor is not None and after < floor <= head.applied_seq:
                # Applied here past the floor, in a commit that did not advance the Cursor: nothing
                # before the floor is needed, and the floor's snapshot would roll the store back
                # and be refused.
                count = self._read_past_the_floor(group, floor, head)
                if count is not None:
                    return count
            if self.restore_snapshot is None:
                raise
            # Only a snapshot at or above the floor lets the next read succeed; an older one (a
            # stale copy) would be restored, refused by the source again, and restored again.
            needed = max(after + 1, floor or 0)
            self.agent.restore(self.restore_snapshot(exc), group=group, org=self.org, high_water_seq=needed)
            self.stats.restores += 1
            return -1
        self.stats.rounds += 1
        if not events:
            return 0
        self._ack(group, deliver_batch(self.agent, group, events, self.stats))
        return len(events)

    def _read_past_the_floor(self, group: str, floor: int, head: GroupHead) -> int | None:
        """The round of a store that applied Events past the replay ``floor`` without advancing
        its Cursor: read from the applied sequence's Event on (what the source still serves), and
        deliver that batch, which moves the Cursor to what is applied and beyond, only if the
        source's Event at the applied sequence is the one applied here (its hash covers every
        Event before it) or its next Event links to it. Events of another history are
        ``EventInvalid`` (``conflict``) and the Cursor stays: moved over them, it would claim (and
        ACK) Events the source never had. Returns the Events read; -1 when the source served
        neither Event (the round changed nothing); None when the floor is the applied sequence and
        the source served nothing after it: only the snapshot's head hash can tell, and the
        restore compares it."""
        applied = head.applied_seq
        events = _as_batch(self.source.read(group, after=max(floor, applied - 1), limit=self.batch_events))
        self.stats.rounds += 1
        verdicts = set()
        for item in events:
            try:
                event = item if type(item) is Event else admit_event(item)[0]  # bytes: decoded (bounded)
            except (EventInvalid, LimitExceeded):
                continue  # deliver_batch would count it as rejected
            if event.group == group and event.seq in (applied, applied + 1):
                verdicts.add((event.hash if event.seq == applied else event.prev_hash) == head.applied_hash)
        if False in verdicts:
            raise EventInvalid(
                f"group {group}: the source's Events at sequence {applied} differ from those applied here past "
                f"the replay floor {floor} (another history of the Group?)",
                reason="conflict",
                group=group,
                cursor=self.agent.cursor(group),
            )
        if not verdicts:
            return None if floor == applied else -1
        self._ack(group, deliver_batch(self.agent, group, events, self.stats))
        return len(events)

    def _ack(self, group: str, cursor: int) -> None:
        """ACK a committed Cursor to the source, if it takes ACKs and this Delivery has a consumer."""
        ack = getattr(self.source, "ack", None)
        if ack is not None and self.consumer is not None and cursor > 0:
            ack(self.consumer, group, cursor)

    def catch_up(
        self, group: str, *, rounds_max: int = ROUNDS_MAX_DEFAULT, reconnects_max: int = RECONNECTS_MAX_DEFAULT,
        stalled_max: int = STALLED_ROUNDS_MAX
    ) -> int:
        """Pull until the source has nothing after the Cursor; reconnect on disconnects.

        Returns the Cursor. Raises ``TransportDisconnected`` after ``reconnects_max`` in a row, and
        ``EventInvalid`` (reason ``no_progress``) after ``stalled_max`` rounds in a row that
        returned Events but did not move the Cursor: the Event after it is refused every time
        (a source serving another history of the Group), and more rounds would not change that.
        A round that met the replay floor and changed nothing (the source served none of the
        Events applied here past it) counts as such a round too.
        """
        for name, value, least in (("rounds_max", rounds_max, 0), ("reconnects_max", reconnects_max, 0),
                                   ("stalled_max", stalled_max, 1)):
            if type(value) is not int or value < least:
                raise InvalidCommand(f"{name} must be an integer of at least {least}", field=name)

        def round_() -> tuple[int, int]:
            before = self.agent.cursor(group)
            return before, self.pull_once(group)

        stalled = 0
        rounds = 0
        while rounds < rounds_max:
            answer, calls = _reconnecting(round_, self.stats, reconnects_max, rounds_max - rounds)
            rounds += calls
            if answer is _GAVE_UP:
                break  # every round left disconnected
            before, count = answer
            if count == 0:
                return self.agent.cursor(group)
            stalled = stalled + 1 if count != 0 and self.agent.cursor(group) == before else 0
            if stalled >= stalled_max:
                raise EventInvalid(
                    f"group {group}: {stalled} rounds in a row returned Events and none applied after cursor {before}; "
                    "the source's Event after the Cursor is refused (another history of the Group?)",
                    reason="no_progress",
                    group=group,
                    cursor=before,
                )
        return self.agent.cursor(group)


def rebuild_group(
    agent: AgentStore,
    source: EventSource,
    group: str,
    *,
    batch_events: int = BATCH_EVENTS_DEFAULT,
    restore_snapshot: Callable[[CursorTooOld], bytes] | None = None,
    org: str | None = None,
) -> int:
    """Forget ``group`` locally and re-apply it from the source's Events; returns the Cursor.

    A Group whose history starts at a replay floor is rebuilt from the snapshot that
    ``restore_snapshot`` returns (as for :class:`Delivery`, with ``org``), which replaces the Group
    in one local commit: a refused snapshot leaves the Group as it was. Without the callback, such
    a Group is ``CursorTooOld`` before anything is forgotten: its first Event is read before the
    reset.
    """
    delivery = Delivery(agent, source, batch_events=batch_events, restore_snapshot=restore_snapshot, org=org)
    canonical.check_id(group, "group")
    agent.check_open()  # a closed store says so before the source is read or a snapshot fetched
    try:
        # CURSOR_TOO_OLD here, while the Group is still whole; a disconnect is retried as
        # catch_up retries one (it reconnected the rebuild's every read before this one was added)
        _reconnecting(lambda: source.read(group, after=0, limit=1), delivery.stats, RECONNECTS_MAX_DEFAULT)
    except CursorTooOld as exc:
        # closed while the source was read: said so before the snapshot is fetched, as a
        # Delivery round's head() says it
        agent.check_open()
        if restore_snapshot is None:
            raise
        # The snapshot replaces the Group in one local commit (reset and restore together): a
        # refused one, or a callback that raises, leaves the Group as it was.
        needed = max(1, _floor_of(exc) or 0)
        agent._restore(restore_snapshot(exc), group=group, org=org, high_water_seq=needed, replace=True)
        delivery.stats.restores += 1
    else:
        agent.reset_group(group)
    return delivery.catch_up(group)


_GAVE_UP: Any = object()
"""What ``_reconnecting`` answers when its every call disconnected and none is left."""


def _reconnecting(
    call: Callable[[], Any], stats: DeliveryStats, reconnects_max: int, calls_max: int | None = None
) -> tuple[Any, int]:
    """Call ``call`` until it returns instead of raising ``TransportDisconnected``; return what it
    returned and how many calls were made. Each disconnect is counted in ``stats``, and the one
    after ``reconnects_max`` in a row is raised. After ``calls_max`` calls (None: no bound) that
    all disconnected, the answer is ``_GAVE_UP``. The one reconnect loop of catch_up's rounds and
    of rebuild_group's first read."""
    calls = 0
    while calls_max is None or calls < calls_max:
        calls += 1
        try:
            return call(), calls
        except TransportDisconnected:
            stats.disconnects += 1
            if calls > reconnects_max:
                raise
    return _GAVE_UP, calls


def _floor_of(error: CursorTooOld) -> int | None:
    """The replay floor a ``CURSOR_TOO_OLD`` names, or None when it names none a sequence can be:
    the error comes from the source, and a bool, a negative or one past 2**63 - 1 (which a restore
    would have refused as its own ``high_water_seq`` argument) tells nothing."""
    floor = error.detail.get("floor")
    return floor if type(floor) is int and 0 <= floor <= limits.INT_ABS_MAX else None


def _check_agent(agent: object) -> None:
    if not isinstance(agent, AgentStore):
        raise InvalidCommand(f"agent must be an AgentStore, not {type(agent).__name__}", field="agent")


def _check_source(source: object) -> None:
    if not callable(getattr(source, "read", None)):
        raise InvalidCommand(
            f"source must have read(group, after, limit) (an Authority), not {type(source).__name__}", field="source"
        )


class ListSource:
    """An in-memory source over lists of Events per Group (for tests and benchmarks)."""

    def __init__(self, events: list[Event] | None = None) -> None:
        self.groups: dict[str, list[Event]] = {}
        self.acks: dict[tuple[str, str], int] = {}
        for event in events or ():
            self.append(event)

    def append(self, event: Event) -> None:
        history = self.groups.setdefault(event.group, [])
        assert event.seq == len(history) + 1, "ListSource holds each Group's Events in sequence"
        history.append(event)

    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[Event]:
        return self.groups.get(group, [])[after : after + limit]

    def ack(self, consumer: str, group: str, cursor: int) -> int:
        key = (consumer, group)
        self.acks[key] = max(self.acks.get(key, 0), cursor)
        return self.acks[key]


class FaultyTransport:
    """Wraps a source and misbehaves like a real network around it (for tests).

    Per read: with ``disconnect`` probability it raises ``TransportDisconnected``; otherwise it
    reads from somewhat before ``after`` (``replay`` Events: what a reconnect may repeat, never
    below what the source still serves: a replay refused with ``CursorTooOld`` starts at the
    source's replay floor, or at ``after``, and again from a floor that rose meanwhile), then
    drops, duplicates and shuffles Events with the given probabilities. Deterministic per seed.
    """

    def __init__(
        self,
        source: EventSource,
        *,
        seed: int = 0,
        drop: float = 0.1,
        duplicate: float = 0.1,
        reorder: float = 0.3,
        disconnect: float = 0.05,
        replay: int = 3,
    ) -> None:
        # checked here: used, a wrong one was a TypeError or ValueError from random at some read
        _check_source(source)
        if type(seed) is not int:
            raise InvalidCommand("seed must be an int", field="seed")
        for name, probability in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder), ("disconnect", disconnect)):
            if type(probability) not in (int, float) or not 0 <= probability <= 1:
                raise InvalidCommand(f"{name} must be a probability in 0..1", field=name)
        if type(replay) is not int or not 0 <= replay <= limits.READ_LIMIT_MAX:
            raise InvalidCommand(f"replay must be an int in 0..{limits.READ_LIMIT_MAX}", field="replay")
        self.source = source
        self.rng = random.Random(seed)
        self.drop = drop
        self.duplicate = duplicate
        self.reorder = reorder
        self.disconnect = disconnect
        self.replay = replay
        self.reads = 0

    def read(self, group: str, after: int = 0, limit: int = 1000) -> list[Event]:
        self.reads += 1
        rng = self.rng
        if rng.random() < self.disconnect:
            raise TransportDisconnected("simulated disconnect")
        start = max(0, after - rng.randint(0, self.replay))
        while True:
            try:
                events = list(self.source.read(group, after=start, limit=limit))
                break
            except CursorTooOld as exc:
                if start == after:
                    raise
                # A replay repeats only what the source still serves: from its replay floor (or
                # the requested position). Below it, the refusal was of a position the reader
                # never asked for, and its Delivery would restore (or refuse) a snapshot it does
                # not need. A floor that rose meanwhile refuses the new start too: read again from
                # the higher one (each try starts later, the last at ``after``).
                floor = _floor_of(exc)
                start = floor if floor is not None and start < floor <= after else after
        delivered: list[Event] = []
        for event in events:
            if rng.random() < self.drop:
                continue
            delivered.append(event)
            if rng.random() < self.duplicate:
                delivered.append(event)
        if events and not delivered:
            delivered.append(rng.choice(events))  # an empty answer would read as "caught up"
        if rng.random() < self.reorder:
            rng.shuffle(delivered)
        return delivered

    def ack(self, consumer: str, group: str, cursor: int) -> Any:
        ack = getattr(self.source, "ack", None)
        return None if ack is None else ack(consumer, group, cursor)


__all__ = [
    "Delivery",
    "DeliveryStats",
    "EventSource",
    "FaultyTransport",
    "ListSource",
    "TransportDisconnected",
    "deliver_batch",
    "rebuild_group",
]
