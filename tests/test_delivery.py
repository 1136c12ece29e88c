"""Delivery: random schedules (duplicates, reordering, gaps, aborted and reopened transactions,
reconnect replays) end with the projection of clean in-order delivery, and no commit ever leaves
the Cursor beyond a gap. Then the delivery helper over a fault-injecting transport and over a real
Authority."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_store_support import CountingProjection, seen_counts, workload
from mwpstore.agent_store import AgentStore
from mwpstore.delivery import Delivery, DeliveryStats, FaultyTransport, ListSource, TransportDisconnected, deliver_batch, rebuild_group
from mwpstore.errors import EventInvalid, InvalidCommand
from mwpstore.messages import Event

MAP_BYTES = 64 * 1024 * 1024
HISTORIES = {"g-a": workload("g-a", 24, seed=11), "g-b": workload("g-b", 14, seed=12)}
ALL_EVENTS = [event for history in HISTORIES.values() for event in history]


def open_agent(path):
    return AgentStore.open(path, projections=[CountingProjection()], map_size=MAP_BYTES)


def reference_states(events: list[Event], count: int) -> dict[str, dict]:
    states: dict[str, dict | None] = {}
    for event in events[:count]:
        for effect in event.effects:
            states[effect.aggregate] = effect.state
    return {key: state for key, state in states.items() if state is not None}


@pytest.fixture(scope="module")
def clean_dump(tmp_path_factory):
    agent = open_agent(tmp_path_factory.mktemp("clean") / "agent")
    with agent.begin() as tx:
        for event in ALL_EVENTS:
            tx.apply(event)
        for group in HISTORIES:
            tx.advance_cursor(group)
    dump = agent.projection_dump()
    agent.close()
    return dump


def contiguous(delivered: set[int]) -> int:
    seq = 0
    while seq + 1 in delivered:
        seq += 1
    return seq


operation = st.one_of(
    st.tuples(st.just("deliver"), st.sampled_from(sorted(HISTORIES)), st.integers(0, 23)),
    st.tuples(st.just("deliver_run"), st.sampled_from(sorted(HISTORIES)), st.integers(0, 23), st.integers(1, 8)),
    st.tuples(st.just("commit")),
    st.tuples(st.just("commit_without_cursor")),
    st.tuples(st.just("abort")),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("prune"), st.sampled_from(sorted(HISTORIES))),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=st.lists(operation, max_size=40), replay_back=st.integers(0, 6))
def test_random_schedule_converges_and_cursor_never_passes_a_gap(clean_dump, schedule, replay_back):
    """MWP-WRK-029, MWP-FND-018: any delivery schedule converges; no commit passes a gap."""
    directory = tempfile.mkdtemp(prefix="agent-schedule-")
    try:
        agent = open_agent(directory + "/agent")
        committed = {group: set() for group in HISTORIES}
        pending = {group: set() for group in HISTORIES}
        cursor_model = {group: 0 for group in HISTORIES}
        tx = agent.begin()

        def check_after_commit():
            for group, history in HISTORIES.items():
                head = agent.head(group)
                expected = contiguous(committed[group])
                assert head.applied_seq == expected, "applied exactly the contiguous prefix"
                assert head.cursor == cursor_model[group] <= expected, "the Cursor is never beyond a gap"
                assert agent.states(group) == reference_states(history, expected)
                assert set(agent.buffered_seqs(group)) == {seq for seq in committed[group] if seq > expected + 1}
                assert set(seen_counts(agent, group).values()) <= {1}

        for step in schedule:
            kind = step[0]
            if kind in ("deliver", "deliver_run"):
                group, index = step[1], step[2] % len(HISTORIES[step[1]])
                length = step[3] if kind == "deliver_run" else 1
                for event in HISTORIES[group][index : index + length]:
                    tx.apply(event)
                    pending[group].add(event.seq)
            elif kind in ("commit", "commit_without_cursor"):
                for group in HISTORIES:
                    committed[group] |= pending[group]
                    pending[group].clear()
                    if kind == "commit":
                        tx.advance_cursor(group)
                        cursor_model[group] = contiguous(committed[group])
                tx.commit()
                check_after_commit()
                tx = agent.begin()
            elif kind == "abort":
                tx.abort()
                for group in HISTORIES:
                    pending[group].clear()
                tx = agent.begin()
            elif kind == "reopen":
                tx.abort()
                agent.close()
                for group in HISTORIES:
                    pending[group].clear()
                agent = open_agent(directory + "/agent")
                check_after_commit()
                tx = agent.begin()
            elif kind == "prune":
                tx.abort()
                for group in HISTORIES:
                    pending[group].clear()
                agent.prune_inbox(step[1])
                tx = agent.begin()
        tx.abort()
        # Reconnect: replay from a little before the durable Cursor, in order, as a real source would.
        with agent.begin() as tx:
            for group, history in HISTORIES.items():
                start = max(0, agent.cursor(group) - replay_back)
                for event in history[start:]:
                    tx.apply(event)
                tx.advance_cursor(group)
        assert agent.projection_dump() == clean_dump
        agent.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- the delivery helper --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_delivery_over_faulty_transport_matches_clean_delivery(tmp_path, clean_dump, seed):
    source = ListSource(ALL_EVENTS)
    transport = FaultyTransport(source, seed=seed, drop=0.2, duplicate=0.3, reorder=0.5, disconnect=0.1, replay=5)
    agent = open_agent(tmp_path / "agent")
    delivery = Delivery(agent, transport, consumer="agent-7", batch_events=5)
    for group, history in HISTORIES.items():
        for _ in range(10_000):
            try:
                count = delivery.pull_once(group)
            except TransportDisconnected:
                continue
            head = agent.head(group)
            assert head.cursor == head.applied_seq
            assert set(seen_counts(agent, group)) == set(range(1, head.cursor + 1))
            assert source.acks.get(("agent-7", group), 0) == head.cursor
            if head.cursor == len(history) and count == 0:
                break
        assert agent.cursor(group) == len(history)
    assert agent.projection_dump() == clean_dump
    assert delivery.stats.duplicates > 0 and delivery.stats.buffered > 0
    agent.close()


def test_catch_up_reconnects_and_resumes_from_the_durable_cursor(tmp_path, clean_dump):
    transport = FaultyTransport(ListSource(ALL_EVENTS), seed=3, drop=0.3, duplicate=0.3, disconnect=0.3)
    agent = open_agent(tmp_path / "agent")
    delivery = Delivery(agent, transport, batch_events=4)
    for group in HISTORIES:
        delivery.catch_up(group)
    assert delivery.stats.disconnects > 0
    assert agent.projection_dump() == clean_dump
    agent.close()


def test_disconnect_mid_batch_loses_nothing_durable(tmp_path, clean_dump):
    agent = open_agent(tmp_path / "agent")
    history = HISTORIES["g-a"]
    deliver_batch(agent, "g-a", history[:10])
    with pytest.raises(ConnectionError):
        with agent.begin() as tx:
            for event in history[10:15]:
                tx.apply(event)
            raise ConnectionError("connection dropped before the local commit")
    assert agent.cursor("g-a") == 10
    Delivery(agent, ListSource(ALL_EVENTS)).catch_up("g-a")
    Delivery(agent, ListSource(ALL_EVENTS)).catch_up("g-b")
    assert agent.projection_dump() == clean_dump
    agent.close()


def test_deliver_batch_skips_invalid_and_foreign_events(tmp_path):
    import msgspec

    agent = open_agent(tmp_path / "agent")
    history = HISTORIES["g-a"]
    forged = msgspec.structs.replace(history[1], hash=bytes(32))
    stats = DeliveryStats()
    cursor = deliver_batch(agent, "g-a", [history[0], forged, HISTORIES["g-b"][0], history[1], history[2]], stats)
    assert cursor == 3
    assert stats.rejected == 2 and stats.applied == 3
    assert [type(error).__name__ for error in stats.rejections] == ["EventInvalid", "EventInvalid"]
    assert agent.cursor("g-b") == 0
    agent.close()


# -- against the real Authority ---------------------------------------------------------------


def _authority_events(path, count):
    from mwpstore.authority import Authority
    from mwpstore.messages import Command

    clock = iter(range(1_000_000, 10**9, 10))
    authority = Authority.open(path, clock=lambda: next(clock))

    def command(actor, kind, target, body, action, revision=None):
        return Command(actor=actor, action_id=action, group="g-auth", kind=kind, target=target, body=body,
                       expected_revision=revision)

    authority.accept(command("owner", "group.create", "g-auth", {"org": "org-1"}, "a0"))
    authority.accept(command("owner", "mission.create", "m1", {"title": "m", "cost_limit": 100}, "a1"))
    contract = {"max_attempts": 3, "backoff_initial_ms": 100, "backoff_multiplier": 2, "backoff_max_ms": 1_000,
                "cost_limit": 50, "deadline_ms": None, "lease_ms": 1_000, "start_ms": 200}
    results = authority.accept_many(
        [command("owner", "workitem.create", f"wi{index}", {"mission": "m1", "priority": index % 4, "contract": contract},
                 f"c{index}") for index in range(count)]
    )
    assert all(result.ok for result in results)
    return authority


def test_delivery_from_the_authority_with_acks(tmp_path):
    authority = _authority_events(str(tmp_path / "authority"), 40)
    agent = open_agent(tmp_path / "agent")
    delivery = Delivery(agent, FaultyTransport(authority, seed=5, disconnect=0.2), consumer="agent-1", batch_events=7)
    cursor = delivery.catch_up("g-auth")
    assert cursor == 42
    assert authority.acked("agent-1", "g-auth") == 42
    queue = agent.work_queue("g-auth", 10**12)
    assert len(queue) == 40
    assert [entry.priority for entry in queue] == sorted((entry.priority for entry in queue), reverse=True)
    assert agent.states("g-auth")["mission:m1"]["title"] == "m"
    dump = agent.projection_dump()
    agent.close()
    shutil.rmtree(tmp_path / "agent")
    rebuilt = open_agent(tmp_path / "agent")
    Delivery(rebuilt, authority).catch_up("g-auth")
    assert rebuilt.projection_dump() == dump
    rebuilt.close()
    authority.close()


class FlooredSource:
    """A source whose replay starts at a snapshot: reads below the floor raise CursorTooOld."""

    def __init__(self, events, floor, snapshot):
        self.events = events
        self.floor = floor
        self.snapshot = snapshot

    def read(self, group, after=0, limit=1000):
        from mwpstore.errors import CursorTooOld

        if after < self.floor:
            raise CursorTooOld("below the replay floor", group=group, cursor=after, floor=self.floor,
                               snapshot_ref={"seq": self.floor})
        return [event for event in self.events if event.group == group][after : after + limit]


def test_cursor_too_old_restores_from_a_verified_snapshot_and_continues(tmp_path, clean_dump):
    from mwpstore.messages import Effect
    from mwpstore.snapshot import SigningKey, create_snapshot

    history = HISTORIES["g-a"]
    floor = 15
    states: dict = {}
    for event in history[:floor]:
        for effect in event.effects:
            states[effect.aggregate] = (effect.revision, effect.state)
    signer = SigningKey.generate()
    data = create_snapshot(org="org-1", group="g-a", seq=floor, head_hash=history[floor - 1].hash,
                           aggregates=[Effect(key, *value) for key, value in states.items()], signer=signer,
                           created_at_ms=1)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    source = FlooredSource(ALL_EVENTS, floor, data)
    with pytest.raises(Exception) as info:
        Delivery(agent, source).catch_up("g-a")
    assert type(info.value).__name__ == "CursorTooOld"
    fetched = []
    delivery = Delivery(agent, source, org="org-1",
                        restore_snapshot=lambda error: fetched.append(error.snapshot_ref) or source.snapshot)
    assert delivery.catch_up("g-a") == len(history)
    assert fetched == [{"seq": floor}] and delivery.stats.restores == 1
    reference = AgentStore.open(tmp_path / "reference", map_size=MAP_BYTES)
    Delivery(reference, ListSource(ALL_EVENTS)).catch_up("g-a")
    assert agent.states("g-a") == reference.states("g-a")
    assert agent.work_queue("g-a", 10**12) == reference.work_queue("g-a", 10**12)
    agent.close()
    reference.close()


def _snapshot_of(history, seq, signer):
    from mwpstore.messages import Effect
    from mwpstore.snapshot import create_snapshot

    states: dict = {}
    for event in history[:seq]:
        for effect in event.effects:
            states[effect.aggregate] = (effect.revision, effect.state)
    return create_snapshot(org="org-1", group=history[0].group, seq=seq, head_hash=history[seq - 1].hash,
                           aggregates=[Effect(key, *value) for key, value in states.items()], signer=signer,
                           created_at_ms=1)


def test_a_snapshot_below_the_replay_floor_is_refused_not_restored_round_after_round(tmp_path):
    """An authentic snapshot older than the floor (a stale cache, a substituted file) cannot get
    the Cursor past the floor: restoring it only leads to CURSOR_TOO_OLD again."""
    from mwpstore.errors import SnapshotInvalid
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    stale = _snapshot_of(HISTORIES["g-a"], 10, signer)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    delivery = Delivery(agent, FlooredSource(ALL_EVENTS, 15, stale), org="org-1", restore_snapshot=lambda error: stale)
    with pytest.raises(SnapshotInvalid) as caught:
        delivery.catch_up("g-a", rounds_max=50)
    assert caught.value.check == "sequence"
    assert delivery.stats.restores == 0 and agent.cursor("g-a") == 0  # nothing restored
    agent.close()


def test_deliver_batch_accepts_encoded_events_and_rejects_foreign_bytes(tmp_path):
    from mwpstore.messages import encode_event

    agent = open_agent(tmp_path / "agent")
    history = HISTORIES["g-a"]
    stats = DeliveryStats()
    batch = [encode_event(event) for event in history[:4]] + [encode_event(HISTORIES["g-b"][0]), b"\x00garbage"]
    assert deliver_batch(agent, "g-a", batch, stats) == 4
    assert stats.applied == 4 and stats.rejected == 2
    assert agent.cursor("g-b") == 0
    agent.close()


def test_threads_delivering_different_groups_share_one_store(tmp_path, clean_dump):
    import threading

    agent = open_agent(tmp_path / "agent")
    errors = []

    def run(group, seed):
        try:
            transport = FaultyTransport(ListSource(ALL_EVENTS), seed=seed, disconnect=0.1)
            Delivery(agent, transport, batch_events=3).catch_up(group)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(group, index)) for index, group in enumerate(HISTORIES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert agent.projection_dump() == clean_dump
    agent.close()


def test_authority_cursor_too_old_is_recovered_through_its_signed_snapshot(tmp_path):
    """The whole long-gap path against the real Authority: CURSOR_TOO_OLD with a snapshot
    reference → fetch → verify (trusted key, Organization and Group binding) → restore → replay
    strictly after the snapshot."""
    from mwpstore.authority import Authority
    from mwpstore.messages import Command

    clock = iter(range(1_000_000, 10**9, 10))
    authority = Authority.open(str(tmp_path / "authority"), clock=lambda: next(clock))
    actions = iter(range(10**6))

    def accept(kind, target, body):
        return authority.accept(Command(actor="owner", action_id=f"a{next(actions)}", group="g-auth", kind=kind,
                                        target=target, body=body))

    accept("group.create", "g-auth", {"org": "org-1", "policy": {"replay_window_events": 5}})
    accept("mission.create", "m1", {"title": "m", "cost_limit": 100})
    contract = {"max_attempts": 3, "backoff_initial_ms": 100, "backoff_multiplier": 2, "backoff_max_ms": 1_000,
                "cost_limit": 50, "deadline_ms": None, "lease_ms": 1_000, "start_ms": 200}
    for index in range(20):
        accept("workitem.create", f"wi{index}", {"mission": "m1", "priority": index % 3, "contract": contract})
    snapshot_ref = authority.snapshot("g-auth")
    for index in range(20, 30):
        accept("workitem.create", f"wi{index}", {"mission": "m1", "priority": 0, "contract": contract})
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[authority.signing_key.public_key], map_size=MAP_BYTES)
    fetched = []

    def fetch(error):
        from mwpstore.snapshot import SnapshotRef

        ref = error.snapshot_ref
        ref = SnapshotRef.from_dict(ref) if isinstance(ref, dict) else ref
        fetched.append(ref)
        return authority.read_snapshot(ref)

    delivery = Delivery(agent, authority, consumer="agent-1", org="org-1", restore_snapshot=fetch)
    assert delivery.catch_up("g-auth") == 32
    assert [ref.seq for ref in fetched] == [snapshot_ref.seq] == [22]
    assert agent.head("g-auth").floor_seq == 22
    assert len(agent.work_queue("g-auth", 10**12)) == 30
    for key, state in agent.states("g-auth").items():
        assert authority.state("g-auth", key)[1] == state
    assert authority.acked("agent-1", "g-auth") == 32
    agent.close()
    authority.close()


def test_catch_up_from_a_source_serving_another_history_stops_with_a_typed_error(tmp_path):
    agent = AgentStore.open(tmp_path / "agent")
    mine = workload("g-x", 10, seed=1)
    with agent.begin() as tx:
        tx.apply_many(mine[:5])
        tx.advance_cursor("g-x")

    class Counting(ListSource):
        reads = 0

        def read(self, group, after=0, limit=1000):
            Counting.reads += 1
            return super().read(group, after, limit)

    source = Counting(workload("g-x", 40, seed=2))  # the same Group, another history
    with pytest.raises(EventInvalid) as caught:
        Delivery(agent, source).catch_up("g-x", stalled_max=20)
    assert caught.value.detail["reason"] == "no_progress" and caught.value.detail["cursor"] == 5
    assert Counting.reads == 20 and agent.cursor("g-x") == 5  # bounded, and nothing of it applied
    agent.close()


def test_restore_verified_refuses_fields_it_would_store_unreadable(tmp_path):
    from types import SimpleNamespace

    from mwpstore.errors import SnapshotInvalid
    from mwpstore.messages import Effect

    agent = AgentStore.open(tmp_path / "agent")
    good = dict(group="g-x", org="acme", seq=3, head_hash=bytes(32), aggregates=[Effect("group:g-x", 1, {"org": "acme"})])
    for change in (
        {"head_hash": "00" * 32}, {"head_hash": bytes(5)}, {"org": 5},
        {"aggregates": [Effect("group:g-x", "1", {"org": "acme"})]},
        {"aggregates": [Effect("group:g-x", 0, {"org": "acme"})]},
        {"aggregates": [Effect("group:g-x", 1, {"x": float("nan")})]},
        {"aggregates": 5},
    ):
        with pytest.raises(SnapshotInvalid) as caught:
            agent.restore_verified(SimpleNamespace(**{**good, **change}), group="g-x")
        assert caught.value.detail["check"] == "schema", change
    with pytest.raises(SnapshotInvalid):
        agent.restore_verified(object(), group="g-x")
    assert agent.restore_verified(SimpleNamespace(**good), group="g-x") == 3
    assert agent.state("g-x", "group:g-x") == {"org": "acme"} and agent.cursor("g-x") == 3
    agent.close()


def test_agent_readers_refuse_arguments_of_the_wrong_type(tmp_path):
    from mwpstore.errors import InvalidCommand

    agent = AgentStore.open(tmp_path / "agent")
    calls = [
        lambda: agent.state("g-x", None), lambda: agent.aggregate("g-x", 5), lambda: agent.state("g-x", "\udc80"),
        lambda: agent.work_queue("g-x", "now"), lambda: agent.work_queue("g-x", 0, limit="5"),
        lambda: agent.projection_get("g-x", 5, "k"), lambda: agent.projection_get("g-x", "p", "\udc80"),
        lambda: agent.projection_items("g-x", None),
    ]
    for call in calls:
        with pytest.raises(InvalidCommand):
            call()
    with agent.begin() as tx:
        with pytest.raises(InvalidCommand):
            tx.state("g-x", 5)
        with pytest.raises(InvalidCommand):
            tx.apply_many(5)
    with pytest.raises(InvalidCommand):
        AgentStore.open(tmp_path / "other", projections=[object()])
    agent.close()


def test_faulty_transport_reorders_what_it_delivers():
    # The delivery tests rely on the transport really shuffling batches; without it they would
    # test in-order delivery only.
    history = HISTORIES["g-a"]
    source = ListSource(ALL_EVENTS)
    shuffled = FaultyTransport(source, seed=1, drop=0, duplicate=0, reorder=1.0, disconnect=0, replay=0)
    orders = [[event.seq for event in shuffled.read("g-a", after=0)] for _ in range(5)]
    assert all(sorted(order) == [event.seq for event in history] for order in orders)
    assert any(order != sorted(order) for order in orders)
    in_order = FaultyTransport(source, seed=1, drop=0, duplicate=0, reorder=0, disconnect=0, replay=0)
    assert [event.seq for event in in_order.read("g-a", after=0)] == [event.seq for event in history]


def test_a_snapshot_at_the_cursor_is_not_restored_when_the_source_names_no_floor(tmp_path):
    """CURSOR_TOO_OLD without a floor: only a snapshot above the Cursor can move it; one at the
    Cursor itself would be restored round after round."""
    from mwpstore.errors import CursorTooOld, SnapshotInvalid
    from mwpstore.snapshot import SigningKey

    class NoFloorSource:
        def read(self, group, after=0, limit=1000):
            raise CursorTooOld("below the replay floor", group=group, cursor=after)

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history[:10]) == 10
    at_cursor = _snapshot_of(history, 10, signer)
    delivery = Delivery(agent, NoFloorSource(), org="org-1", restore_snapshot=lambda error: at_cursor)
    with pytest.raises(SnapshotInvalid) as caught:
        delivery.catch_up("g-a", rounds_max=20)
    assert caught.value.check == "sequence"
    assert delivery.stats.restores == 0 and agent.cursor("g-a") == 10
    agent.close()


def test_catch_up_gives_up_after_exactly_reconnects_max_reconnects_in_a_row(tmp_path):
    class Down:
        reads = 0

        def read(self, group, after=0, limit=1000):
            Down.reads += 1
            raise TransportDisconnected("down")

    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    delivery = Delivery(agent, Down())
    with pytest.raises(TransportDisconnected):
        delivery.catch_up("g-a", reconnects_max=3)
    assert Down.reads == 4 and delivery.stats.disconnects == 4  # the first read, then 3 reconnects
    agent.close()


def test_a_disconnected_round_is_one_of_catch_ups_rounds_max(tmp_path):
    """``rounds_max`` bounds every round, disconnected ones too: catch_up stops after them and
    returns the Cursor, though ``reconnects_max`` would allow more reconnects."""
    reads = []

    class DownAtFirst(ListSource):
        def read(self, group, after=0, limit=1000):
            reads.append(after)
            if len(reads) <= 3:
                raise TransportDisconnected("down")
            return super().read(group, after, limit)

    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", HISTORIES["g-a"][:2]) == 2
    delivery = Delivery(agent, DownAtFirst(HISTORIES["g-a"]), batch_events=1)
    assert delivery.catch_up("g-a", rounds_max=2, reconnects_max=10) == 2  # both rounds disconnected
    assert delivery.catch_up("g-a", rounds_max=3, reconnects_max=10) == 4  # a reconnect and two batches
    assert reads == [2, 2, 2, 2, 3] and delivery.stats.disconnects == 3
    agent.close()


def test_reconnects_max_counts_disconnects_in_a_row_only(tmp_path, clean_dump):
    """``reconnects_max`` bounds disconnects *in a row*: a source that drops every other read
    still gets the Group delivered with ``reconnects_max=1``, since each successful read resets
    the count."""

    class Flaky(ListSource):
        reads = 0

        def read(self, group, after=0, limit=1000):
            Flaky.reads += 1
            if Flaky.reads % 2:
                raise TransportDisconnected("every other read")
            return super().read(group, after, limit)

    agent = open_agent(tmp_path / "agent")
    delivery = Delivery(agent, Flaky(ALL_EVENTS), batch_events=5)
    assert delivery.catch_up("g-a", reconnects_max=1) == len(HISTORIES["g-a"])
    assert delivery.stats.disconnects > 2
    agent.close()


def test_a_round_that_moves_the_cursor_resets_the_stalled_count(tmp_path):
    """``stalled_max`` counts rounds *in a row* that return Events without moving the Cursor: a
    source that serves a refused Event every other round, and the genuine next batch in between,
    is delivered to the end with ``stalled_max=2``."""
    genuine = workload("g-x", 12, seed=1)
    other = workload("g-x", 12, seed=2)  # the same Group, another history: refused at the link

    class Alternating:
        reads = 0

        def read(self, group, after=0, limit=1000):
            Alternating.reads += 1
            if after >= len(genuine):
                return []
            if Alternating.reads % 2 and after > 0:
                return [other[after]]
            return genuine[after : after + min(limit, 2)]

    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    delivery = Delivery(agent, Alternating())
    assert delivery.catch_up("g-x", stalled_max=2) == len(genuine)
    assert delivery.stats.rejected >= 3
    agent.close()


def test_list_source_reads_at_most_limit_events_after_the_position():
    """``ListSource.read(group, after, limit)`` returns the Events with sequences after ``after``,
    at most ``limit`` of them, in order; an unknown Group has none."""
    source = ListSource(ALL_EVENTS)
    assert [event.seq for event in source.read("g-a", after=2, limit=3)] == [3, 4, 5]
    assert [event.seq for event in source.read("g-a", after=22, limit=5)] == [23, 24]
    assert source.read("g-a", after=24, limit=5) == [] and source.read("g-none", after=0, limit=5) == []


def test_list_source_acks_never_move_backwards():
    """``ListSource.ack`` keeps the highest ACK per consumer and Group, as an Authority does."""
    source = ListSource(ALL_EVENTS)
    assert source.ack("agent-7", "g-a", 10) == 10
    assert source.ack("agent-7", "g-a", 4) == 10
    assert source.acks[("agent-7", "g-a")] == 10
    assert source.ack("agent-8", "g-a", 4) == 4


def test_faulty_transport_never_answers_empty_while_events_remain():
    """Dropping every Event would read as "caught up": the transport then delivers one of the
    Events it read, so an empty answer means the source had nothing."""
    transport = FaultyTransport(ListSource(ALL_EVENTS), seed=1, drop=1.0, duplicate=0.0, disconnect=0.0, replay=0)
    history = HISTORIES["g-a"]
    for after in range(len(history)):
        delivered = transport.read("g-a", after=after, limit=4)
        assert len(delivered) == 1 and delivered[0] in history[after : after + 4]
    assert transport.read("g-a", after=len(history), limit=4) == []


@pytest.mark.parametrize("shape", ["tuple", "generator", "list subclass"])
def test_a_batch_that_is_not_a_list_is_delivered_like_the_list(tmp_path, clean_dump, shape):
    """A source may answer with any sequence of Events (a tuple, a generator, a list subclass):
    ``deliver_batch`` and ``Delivery`` take it as the list of the same Events (the C runs behind
    ``apply_many`` take exactly a list), and a str or bytes is no batch (``INVALID_COMMAND``)."""

    class Items(list):
        pass

    make = {"tuple": tuple, "generator": lambda events: (event for event in events), "list subclass": Items}[shape]

    class Shaped(ListSource):
        def read(self, group, after=0, limit=1000):
            return make(super().read(group, after, limit))

    agent = open_agent(tmp_path / "agent")
    stats = DeliveryStats()
    assert deliver_batch(agent, "g-a", make(HISTORIES["g-a"][:5]), stats) == 5
    assert stats.applied == stats.received == 5
    delivery = Delivery(agent, Shaped(ALL_EVENTS), batch_events=7)
    for group, history in HISTORIES.items():
        assert delivery.catch_up(group) == len(history)
    assert agent.projection_dump() == clean_dump
    for wrong in (b"events", "events", 7):
        with pytest.raises(InvalidCommand) as caught:
            deliver_batch(agent, "g-a", wrong)
        assert caught.value.detail["field"] == "events"
    agent.close()


@pytest.mark.parametrize("options,field", [
    (dict(stalled_max=0), "stalled_max"),
    (dict(stalled_max=None), "stalled_max"),
    (dict(stalled_max=1.5), "stalled_max"),
    (dict(rounds_max="5"), "rounds_max"),
    (dict(rounds_max=-1), "rounds_max"),
    (dict(reconnects_max=None), "reconnects_max"),
    (dict(reconnects_max=True), "reconnects_max"),
])
def test_catch_up_refuses_bounds_that_are_not_counts_before_reading(tmp_path, options, field):
    """``rounds_max`` and ``reconnects_max`` are ints from 0 and ``stalled_max`` an int from 1:
    anything else is ``INVALID_COMMAND`` before the first read (``stalled_max=0`` used to report
    ``no_progress`` after a round that had moved the Cursor; ``None`` or a str a ``TypeError``)."""

    class Counting(ListSource):
        reads = 0

        def read(self, group, after=0, limit=1000):
            Counting.reads += 1
            return super().read(group, after, limit)

    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    with pytest.raises(InvalidCommand) as caught:
        Delivery(agent, Counting(ALL_EVENTS), batch_events=3).catch_up("g-a", **options)
    assert caught.value.detail["field"] == field
    assert Counting.reads == 0 and agent.cursor("g-a") == 0
    agent.close()


def test_pull_once_reads_after_the_durable_cursor_not_the_applied_sequence(tmp_path):
    """A round reads after the Cursor (what was ACKed), not after what happens to be applied: Events
    applied in a commit that did not advance the Cursor come back and are counted as duplicates."""

    class Recording(ListSource):
        afters: list = []

        def read(self, group, after=0, limit=1000):
            Recording.afters.append(after)
            return super().read(group, after, limit)

    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    deliver_batch(agent, "g-a", history[:4])
    with agent.begin() as tx:
        tx.apply_many(history[4:9])  # committed without advance_cursor
    assert agent.cursor("g-a") == 4 and agent.head("g-a").applied_seq == 9
    delivery = Delivery(agent, Recording(ALL_EVENTS), consumer="agent-7")
    assert delivery.pull_once("g-a") == len(history) - 4
    assert Recording.afters == [4]
    assert delivery.stats.duplicates == 5 and delivery.stats.applied == len(history) - 9
    assert agent.cursor("g-a") == len(history)
    agent.close()


def test_every_ack_names_a_cursor_already_committed_and_a_failed_commit_acks_nothing(tmp_path, monkeypatch):
    """MWP-WRK-030: the ACK follows the local commit. What the source is told must already be the
    store's committed Cursor (a read sees only commits, and every commit is synced): an ACK sent
    from inside the round's transaction would name a Cursor a crash could still take back. A
    round whose commit fails sends no ACK at all."""
    from mwpstore.agent_store import AgentTransaction
    from mwpstore.errors import StorageFailed

    class Watching(ListSource):
        def ack(self, consumer, group, cursor):
            seen.append((cursor, agent.cursor(group)))
            return super().ack(consumer, group, cursor)

    seen: list[tuple[int, int]] = []
    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    source = Watching(history)
    delivery = Delivery(agent, source, consumer="agent-7", batch_events=5)
    assert delivery.pull_once("g-a") == 5
    real_commit = AgentTransaction.commit

    def failing(self):
        self.abort()
        raise StorageFailed("the disk refused the commit", errno=5)

    monkeypatch.setattr(AgentTransaction, "commit", failing)
    with pytest.raises(StorageFailed):
        delivery.pull_once("g-a")
    monkeypatch.setattr(AgentTransaction, "commit", real_commit)
    assert seen == [(5, 5)] and agent.cursor("g-a") == 5
    assert delivery.catch_up("g-a") == len(history)
    assert len(seen) > 2 and all(acked == committed for acked, committed in seen), seen
    assert source.acks[("agent-7", "g-a")] == len(history)
    agent.close()


@pytest.mark.parametrize(("with_snapshot", "as_bytes"), [(True, False), (False, False), (False, True)])
def test_a_store_applied_past_the_floor_catches_up_from_its_applied_events(tmp_path, with_snapshot, as_bytes):
    """A store that applied Events past the replay floor in a commit that did not advance its
    Cursor needs nothing from before the floor: a round refused with CURSOR_TOO_OLD moves the
    Cursor to what is applied and reads on from there. The snapshot at the floor would roll the
    store back: restoring it was refused (SNAPSHOT_INVALID) round after round, and without a
    snapshot callback the CURSOR_TOO_OLD stopped the catch-up. The round reads on from the applied
    Event (which must be the source's), also from a source that serves Events as bytes."""
    from mwpstore.messages import encode_event
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    agent = AgentStore.open(tmp_path / "agent", projections=[CountingProjection()], trusted_keys=[signer.public_key],
                            map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history[:10]) == 10
    with agent.begin() as tx:
        tx.apply_many(history[10:18])  # committed without advance_cursor
    fetched: list = []
    acks: list = []

    class Acked(FlooredSource):
        def read(self, group, after=0, limit=1000):  # a source may serve the Events' bytes
            events = super().read(group, after, limit)
            return [encode_event(event) for event in events] if as_bytes else events

        def ack(self, consumer, group, cursor):
            acks.append(cursor)

    delivery = Delivery(agent, Acked(ALL_EVENTS, 15, at_floor), org="org-1", consumer="agent-7", batch_events=4,
                        restore_snapshot=(lambda error: fetched.append(error) or at_floor) if with_snapshot else None)
    assert delivery.pull_once("g-a") == 4  # read on from the applied Event: 18 (its duplicate) to 21
    assert agent.cursor("g-a") == 21 and acks == [21] and delivery.stats.rounds == 1  # moved, committed, ACKed
    assert delivery.catch_up("g-a") == len(history)
    assert fetched == [] and delivery.stats.restores == 0 and acks == [21, len(history)]
    assert agent.head("g-a").floor_seq == 0  # nothing restored: every Event applied once, in order
    assert seen_counts(agent, "g-a") == {seq: 1 for seq in range(1, len(history) + 1)}
    agent.close()


@pytest.mark.parametrize(("floor", "served", "forked"), [(15, 18, True), (15, 24, True), (18, 24, True), (15, 16, False)])
def test_events_applied_past_the_floor_move_the_cursor_only_when_the_source_has_them(tmp_path, floor, served, forked):
    """A store that applied Events past the replay floor moves its Cursor up to them only when the
    source's Event at the applied sequence is the one applied (or its next Event links to it).
    Applied from another history of the Group, or past what the source has, the Cursor jumped over
    them without a look: the round moved it to 18 and ACKed 18, and the catch-up ended there as
    caught up, the conflict nowhere counted."""
    history = workload("g-a", 24, seed=99) if forked else HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    with agent.begin() as tx:
        tx.apply_many(history[:18])  # committed without advance_cursor
    before = agent.projection_dump()
    acks: list = []

    class Acked(FlooredSource):
        def ack(self, consumer, group, cursor):
            acks.append(cursor)

    delivery = Delivery(agent, Acked(HISTORIES["g-a"][:served], floor, None), consumer="agent-7")
    if forked:
        with pytest.raises(EventInvalid) as caught:
            delivery.catch_up("g-a")
        assert caught.value.detail["reason"] == "conflict"
    else:
        with pytest.raises(EventInvalid) as caught:  # rounds that change nothing are stalled rounds
            delivery.catch_up("g-a", stalled_max=5, rounds_max=50)
        assert caught.value.detail["reason"] == "no_progress"
    assert agent.cursor("g-a") == 0 and acks == [] and agent.projection_dump() == before
    agent.close()



@pytest.mark.parametrize(("cursor", "floor"), [(10, None), (0, True), (10, -1), (10, 10), (10, 19), (10, 2**70), (10, "15")])
def test_a_refusal_whose_floor_is_not_past_the_cursor_and_at_or_below_the_applied_sequence_moves_nothing(tmp_path, cursor, floor):
    """Only a replay floor (an int, not a bool) above the Cursor and at or below the applied
    sequence sends a round to read on from the applied Event; any other floor a CURSOR_TOO_OLD
    carries (missing, malformed, at the Cursor, past what is applied) is the refusal it says."""
    from mwpstore.errors import CursorTooOld

    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history[:cursor]) == cursor
    with agent.begin() as tx:
        tx.apply_many(history[cursor:18])  # committed without advance_cursor

    class Refusing(ListSource):  # serves from the applied Event on: a round sent there moves the Cursor
        def read(self, group, after=0, limit=1000):
            if after < 17:
                raise CursorTooOld("below the replay floor", group=group, cursor=after, floor=floor)
            return super().read(group, after, limit)

    with pytest.raises(CursorTooOld):
        Delivery(agent, Refusing(history)).pull_once("g-a")
    assert agent.cursor("g-a") == cursor
    agent.close()


@pytest.mark.parametrize("forked", [False, True])
def test_a_store_applied_up_to_the_floor_of_a_source_with_nothing_after_it_restores_the_checked_snapshot(tmp_path, forked):
    """Applied exactly up to the replay floor, and the source has nothing after it: no Event
    served tells whether the applied ones are the source's, so the floor's snapshot is restored,
    which compares its head hash with the applied Event's. Another history is SNAPSHOT_INVALID
    (``hash``) and the Cursor stays; the source's own reaches the floor. The round used to move
    the Cursor to the floor unchecked, another history too."""
    from mwpstore.errors import SnapshotInvalid
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    with agent.begin() as tx:
        tx.apply_many((workload("g-a", 24, seed=99) if forked else history)[:15])  # without advance_cursor
    delivery = Delivery(agent, FlooredSource(history[:15], 15, at_floor), org="org-1", restore_snapshot=lambda error: at_floor)
    if forked:
        with pytest.raises(SnapshotInvalid) as caught:
            delivery.catch_up("g-a")
        assert caught.value.detail["check"] == "hash" and agent.cursor("g-a") == 0
    else:
        assert delivery.catch_up("g-a") == 15 and delivery.stats.restores == 1
    agent.close()


def test_rebuild_group_of_a_group_behind_a_replay_floor_restores_its_snapshot(tmp_path):
    """rebuild_group of a Group whose history starts at a replay floor restores the snapshot its
    restore_snapshot callback returns and goes on after it, to the projection a Delivery with the
    same callback gives a fresh store. Without the callback it is CURSOR_TOO_OLD before the Group
    is forgotten (it used to reset the Group first, and had no way to take the callback at all),
    and a snapshot it refuses leaves the Group as it was."""
    from mwpstore.errors import CursorTooOld, SnapshotInvalid
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    source = FlooredSource(ALL_EVENTS, 15, at_floor)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history) == len(history)
    before = agent.projection_dump()
    for floor in (15, 1):  # a floor at the first Event refuses the read before it too
        with pytest.raises(CursorTooOld):
            rebuild_group(agent, FlooredSource(ALL_EVENTS, floor, at_floor), "g-a")
        assert agent.projection_dump() == before and agent.cursor("g-a") == len(history)
    # a snapshot below the floor, a forged one and a callback that raises: each refused, the Group
    # left as it was (the reset and the restore are one local commit)
    forged = bytearray(at_floor)
    forged[len(forged) // 2] ^= 1
    for refused, fetch in ((SnapshotInvalid, lambda error: _snapshot_of(history, 10, signer)),
                           (SnapshotInvalid, lambda error: bytes(forged)),
                           (OSError, lambda error: (_ for _ in ()).throw(OSError("the snapshot store is down")))):
        with pytest.raises(refused):
            rebuild_group(agent, source, "g-a", org="org-1", restore_snapshot=fetch)
        assert agent.projection_dump() == before and agent.cursor("g-a") == len(history)
    fetched: list = []
    assert rebuild_group(agent, source, "g-a", org="org-1",
                         restore_snapshot=lambda error: fetched.append(error.detail["floor"]) or at_floor) == len(history)
    assert fetched == [15] and agent.head("g-a").floor_seq == 15
    fresh = AgentStore.open(tmp_path / "fresh", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    Delivery(fresh, source, org="org-1", restore_snapshot=lambda error: at_floor).catch_up("g-a")
    assert agent.projection_digest() == fresh.projection_digest()
    fresh.close()
    agent.close()




class _FloorSaying(FlooredSource):
    """A FlooredSource whose refusals carry ``floor`` as given (missing, malformed or not)."""

    def __init__(self, events, floor, snapshot, said):
        super().__init__(events, floor, snapshot)
        self.said = said

    def read(self, group, after=0, limit=1000):
        from mwpstore.errors import CursorTooOld

        if after < self.floor:
            detail = {} if self.said is None else {"floor": self.said}
            raise CursorTooOld("below the replay floor", group=group, cursor=after, **detail)
        return super().read(group, after, limit)


@pytest.mark.parametrize("said", [None, True, -3, 0, "15", 2**64, 15], ids=["missing", "True", "-3", "0", "text", "2**64", "15"])
def test_rebuild_group_replaces_another_history_and_its_buffer_with_the_snapshot(tmp_path, said):
    """rebuild_group's snapshot replaces whatever the Group holds here: Events of another history
    applied up to the snapshot's sequence (the head hash differs) and Events buffered past it are
    forgotten, and the Group ends as a fresh store's, whatever floor the refusal names. A floor
    missing or malformed still asks for a snapshot past the first Event: one at sequence 0 is
    refused before anything is forgotten. A floor past 2**63 - 1 is malformed too: it used to
    reach the restore as its high_water_seq argument, which refused it as the caller's mistake."""
    from mwpstore.errors import SnapshotInvalid
    from mwpstore.messages import ZERO_HASH
    from mwpstore.snapshot import SigningKey, create_snapshot

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    source = _FloorSaying(ALL_EVENTS, 15, at_floor, said)
    forked = workload("g-a", 30, seed=99)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", forked[:15]) == 15
    with agent.begin() as tx:  # buffered past a gap, of the other history, two past the source's head
        tx.apply_many(forked[16:18] + forked[26:28])
    assert agent.head("g-a").buffered == 4
    before = agent.projection_dump()
    empty = create_snapshot(org="org-1", group="g-a", seq=0, head_hash=ZERO_HASH, aggregates=[], signer=signer,
                            created_at_ms=1)
    with pytest.raises(SnapshotInvalid):
        rebuild_group(agent, source, "g-a", org="org-1", restore_snapshot=lambda error: empty)
    assert agent.projection_dump() == before and agent.head("g-a").buffered == 4
    assert rebuild_group(agent, source, "g-a", org="org-1", restore_snapshot=lambda error: at_floor) == len(history)
    assert agent.head("g-a").buffered == 0
    # a store that knows nothing of the Group (its directory deleted) is bound by org= alone
    fresh = AgentStore.open(tmp_path / "fresh", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert rebuild_group(fresh, source, "g-a", org="org-1", restore_snapshot=lambda error: at_floor) == len(history)
    assert agent.projection_dump() == fresh.projection_dump()
    fresh.close()
    agent.close()


@pytest.mark.parametrize("said", [2**63 - 1, 2**63, 2**64], ids=["2**63-1", "2**63", "2**64"])
def test_a_floor_past_the_largest_sequence_names_no_floor_and_the_largest_is_one(tmp_path, said):
    """A Delivery round and rebuild_group read a refusal's floor past 2**63 - 1 as no floor: the
    snapshot past the Cursor is restored (a round used to end in INVALID_COMMAND on the restore's
    high_water_seq, an argument its caller never passed). 2**63 - 1 itself is a sequence: a
    snapshot below it is refused (``sequence``) and nothing is written."""
    from mwpstore.errors import SnapshotInvalid
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    source = _FloorSaying(ALL_EVENTS, 15, at_floor, said)
    fresh = AgentStore.open(tmp_path / "fresh", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    rebuilt = AgentStore.open(tmp_path / "rebuilt", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(rebuilt, "g-a", history[:10]) == 10
    before = rebuilt.projection_dump()
    delivery = Delivery(fresh, source, org="org-1", restore_snapshot=lambda error: at_floor)
    if said > 2**63 - 1:
        assert delivery.catch_up("g-a") == len(history) and delivery.stats.restores == 1
        assert rebuild_group(rebuilt, source, "g-a", org="org-1", restore_snapshot=lambda error: at_floor) == len(history)
        assert fresh.projection_dump() == rebuilt.projection_dump()
    else:
        for refused in (lambda: delivery.catch_up("g-a"),
                        lambda: rebuild_group(rebuilt, source, "g-a", org="org-1", restore_snapshot=lambda error: at_floor)):
            with pytest.raises(SnapshotInvalid) as caught:
                refused()
            assert caught.value.check == "sequence"
        assert delivery.stats.restores == 0 and fresh.cursor("g-a") == 0 and rebuilt.projection_dump() == before
    fresh.close()
    rebuilt.close()


def test_rebuild_group_of_a_group_served_from_its_first_event_forgets_another_history(tmp_path):
    """A source that serves the Group from its first Event: rebuild_group resets the Group and
    delivers it again, so another history applied here up to the source's head is replaced, and
    the snapshot callback is not called."""
    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", workload("g-a", 24, seed=99)) == len(history)
    called: list = []
    assert rebuild_group(agent, ListSource(ALL_EVENTS), "g-a", org="org-1",
                         restore_snapshot=lambda error: called.append(error)) == len(history)
    fresh = AgentStore.open(tmp_path / "fresh", map_size=MAP_BYTES)
    assert deliver_batch(fresh, "g-a", history) == len(history)
    assert called == [] and agent.projection_dump() == fresh.projection_dump()
    fresh.close()
    agent.close()


@pytest.mark.parametrize("closed", ["before", "while it reads", "while it reads, no callback", "in the callback"],
                         ids=["before", "in-read", "in-read-no-callback", "in-callback"])
def test_rebuild_group_of_a_closed_store_reads_nothing_and_fetches_nothing(tmp_path, closed):
    """A closed AgentStore is StoreClosed before rebuild_group reads the source or calls the
    snapshot callback: it used to read the first Event and fetch the snapshot, and only the
    restore said the store was closed. A store closed while that first read runs (another thread,
    or the source itself) is StoreClosed before the fetch too, as a Delivery round is; it used to
    fetch the snapshot first (and without a callback it is StoreClosed, not CURSOR_TOO_OLD).
    Closed by the callback itself, the store refuses the restore. The Group is left as it was."""
    from mwpstore.errors import StoreClosed
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    reads: list = []
    fetched: list = []
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history[:10]) == 10
    before = agent.projection_dump()

    class Counting(FlooredSource):
        def read(self, group, after=0, limit=1000):
            reads.append(after)
            if closed.startswith("while it reads"):
                agent.close()
            return super().read(group, after, limit)

    def fetch(error):
        fetched.append(error)
        if closed == "in the callback":
            agent.close()
        return at_floor

    if closed == "before":
        agent.close()
    with pytest.raises(StoreClosed):
        rebuild_group(agent, Counting(ALL_EVENTS, 15, at_floor), "g-a", org="org-1",
                      restore_snapshot=None if closed.endswith("no callback") else fetch)
    assert reads == ([] if closed == "before" else [0]) and len(fetched) == (closed == "in the callback")
    reopened = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert reopened.projection_dump() == before and reopened.cursor("g-a") == 10
    reopened.close()


@pytest.mark.parametrize("floored", [False, True], ids=["from-the-first-event", "from-a-snapshot"])
@pytest.mark.parametrize("closed", ["agent in the catch-up", "source at the first read", "source in the catch-up"])
def test_rebuild_group_closed_after_its_first_read_ends_in_store_closed_with_whole_commits(tmp_path, floored, closed):
    """The AgentStore closed during the catch-up that follows the reset or the restore, or a
    source that says ``StoreClosed`` of its own (the Authority closed): one ``StoreClosed``, no
    local transaction or lock left, and the Group as each commit left it whole: as it was (a
    refusal at the first read), or reset or restored with nothing of the catch-up applied."""
    from mwpstore.errors import StoreClosed
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history[:10]) == 10
    before = agent.projection_dump()
    reads: list = []

    class Closing(FlooredSource):
        def read(self, group, after=0, limit=1000):
            reads.append(after)
            if len(reads) == (1 if closed == "source at the first read" else 2):
                if closed.startswith("source"):
                    raise StoreClosed("the authority is closed")
                agent.close()
            return super().read(group, after, limit)

    with pytest.raises(StoreClosed):
        rebuild_group(agent, Closing(ALL_EVENTS, 15 if floored else 0, at_floor), "g-a", org="org-1",
                      restore_snapshot=lambda error: at_floor)
    assert agent._writer is None and agent._write_lock.acquire(blocking=False)
    agent._write_lock.release()
    agent.close()
    reopened = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    if closed == "source at the first read":
        assert reopened.projection_dump() == before
    else:
        assert reopened.cursor("g-a") == (15 if floored else 0) and reopened.head("g-a").applied_seq == reopened.cursor("g-a")
    reopened.close()


@pytest.mark.parametrize("where", ["callback", "hook"])
def test_rebuild_group_interrupted_in_its_restore_leaves_the_group_as_it_was(tmp_path, where):
    """A KeyboardInterrupt from the snapshot callback, or from an application projection's
    ``restore`` hook inside the replacing commit, leaves the Group as it was (nothing of the reset
    is committed) and the store usable: the next rebuild_group completes."""
    from agent_store_support import RestoringProjection
    from mwpstore.snapshot import SigningKey

    class Interrupted(RestoringProjection):
        armed = True

        def restore(self, view, snapshot):
            super().restore(view, snapshot)
            if self.armed:
                raise KeyboardInterrupt

    def fetch(error):
        if where == "callback" and hook.armed:
            raise KeyboardInterrupt
        return at_floor

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    source = FlooredSource(ALL_EVENTS, 15, at_floor)
    hook = Interrupted()
    hook.armed = True
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES, projections=[hook])
    assert deliver_batch(agent, "g-a", history[:20]) == 20
    before, head = agent.projection_dump(), agent.head("g-a")
    with pytest.raises(KeyboardInterrupt):
        rebuild_group(agent, source, "g-a", org="org-1", restore_snapshot=fetch)
    assert agent.projection_dump() == before and agent.head("g-a") == head
    hook.armed = False
    assert rebuild_group(agent, source, "g-a", org="org-1", restore_snapshot=fetch) == len(history)
    assert dict(agent.projection_items("g-a", "restoring")) == {b"last": b"24", b"restored-at": b"15"}
    agent.close()


def test_rebuild_group_reconnects_a_disconnect_of_its_first_read(tmp_path):
    """rebuild_group's read before the reset is retried after a disconnect, as every read of the
    rebuild's catch-up is: that first read raised TransportDisconnected out of the rebuild, which
    a transport with disconnects then failed now and then. The Group stays whole until the read
    succeeds (after 1000 disconnects in a row too), and the 1001st in a row, past
    ``reconnects_max``, is raised."""
    history = HISTORIES["g-a"]
    agent = AgentStore.open(tmp_path / "agent", map_size=MAP_BYTES)
    assert deliver_batch(agent, "g-a", history) == len(history)
    before = agent.projection_dump()

    class Disconnecting(ListSource):
        def __init__(self, events, disconnects):
            super().__init__(events)
            self.disconnects = disconnects

        def read(self, group, after=0, limit=1000):
            if self.disconnects:
                self.disconnects -= 1
                raise TransportDisconnected("down")
            return super().read(group, after, limit)

    for disconnects in (3, 1000):
        assert rebuild_group(agent, Disconnecting(history, disconnects), "g-a") == len(history)
        assert agent.projection_dump() == before
    with pytest.raises(TransportDisconnected):
        rebuild_group(agent, Disconnecting(history, 1001), "g-a")
    assert agent.projection_dump() == before
    agent.close()


def test_faulty_transport_replays_from_a_replay_floor_that_rose_between_its_reads():
    """A floor that rises between the transport's refused replay and its read from the floor (a
    compaction meanwhile) refuses that read too: the transport reads again from the new floor. It
    passed that second CURSOR_TOO_OLD on, for position 10 when 13 was asked for."""
    from mwpstore.errors import CursorTooOld

    history = HISTORIES["g-a"]

    class Rising:
        def __init__(self):
            self.floor, self.refused = 10, []

        def read(self, group, after=0, limit=1000):
            if after < self.floor:
                self.refused.append(after)
                floor, self.floor = self.floor, 12  # the floor rises after its first refusal
                raise CursorTooOld("below the replay floor", group=group, cursor=after, floor=floor)
            return history[after : after + limit]

    refused = 0
    for seed in range(8):
        source = Rising()
        transport = FaultyTransport(source, seed=seed, drop=0, duplicate=0, reorder=0, disconnect=0, replay=4)
        delivered = [event.seq for event in transport.read("g-a", after=13, limit=3)]
        assert delivered == list(range(delivered[0], delivered[0] + 3)) and delivered[0] <= 14
        if source.refused:  # below the first floor, then below the risen one: from the risen one on
            assert len(source.refused) == 2 and delivered[0] == 13
            refused += 1
    assert refused > 0



@pytest.mark.parametrize("floor", [None, "12", "the refused start"])
def test_faulty_transport_replays_from_the_requested_position_when_the_refusal_names_no_floor_past_the_start(floor):
    """A refused replay whose error names no floor (or not an int, or one at or below the refused
    start) is read again from the requested position, once: the transport neither fails on the
    floor nor reads the same start over and over."""
    from mwpstore.errors import CursorTooOld

    history = HISTORIES["g-a"]

    class Refusing:
        refused = 0

        def read(self, group, after=0, limit=1000):
            if after < 13:
                Refusing.refused += 1
                assert Refusing.refused < 10, "the transport reads a refused start again and again"
                detail = {} if floor is None else {"floor": after if floor == "the refused start" else floor}
                raise CursorTooOld("below the replay floor", group=group, cursor=after, **detail)
            return history[after : after + limit]

    for seed in range(8):
        Refusing.refused = 0
        transport = FaultyTransport(Refusing(), seed=seed, drop=0, duplicate=0, reorder=0, disconnect=0, replay=6)
        assert [event.seq for event in transport.read("g-a", after=13, limit=3)] == [14, 15, 16]
        assert Refusing.refused <= 1


def test_faulty_transport_replays_only_what_the_source_still_serves(tmp_path):
    """A replay from before the requested position never reaches below the source's replay floor:
    a store whose Cursor is at the floor reads on through the transport, never told CURSOR_TOO_OLD
    for a position it did not ask for (it was, and its Delivery then refused the floor's snapshot
    as a rollback)."""
    from mwpstore.snapshot import SigningKey

    signer = SigningKey.generate()
    history = HISTORIES["g-a"]
    at_floor = _snapshot_of(history, 15, signer)
    source = FlooredSource(ALL_EVENTS, 15, at_floor)
    for seed in range(8):
        transport = FaultyTransport(source, seed=seed, drop=0, duplicate=0, reorder=0, disconnect=0, replay=5)
        delivered = transport.read("g-a", after=15)
        assert [event.seq for event in delivered] == list(range(16, len(history) + 1))
    agent = AgentStore.open(tmp_path / "agent", trusted_keys=[signer.public_key], map_size=MAP_BYTES)
    agent.restore(at_floor, group="g-a", org="org-1")
    transport = FaultyTransport(source, seed=3, drop=0.2, duplicate=0.2, reorder=0.5, disconnect=0.1, replay=5)
    delivery = Delivery(agent, transport, org="org-1", restore_snapshot=lambda error: at_floor, batch_events=4)
    assert delivery.catch_up("g-a") == len(history)
    assert delivery.stats.restores == 0
    agent.close()
