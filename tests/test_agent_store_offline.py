"""Bounded outage recovery: the offline guard, durable buffered Commands with their binding, and
rebase + Ed25519 re-sign on reconnect, including a buffered Command whose lease was revoked.

The Group is driven by the real work-model rules (``MemoryGroup`` through the test harness); its
Events reach the AgentStore through ``tx.apply``, as they would through delivery.
"""

from __future__ import annotations

import pytest
from agent_store_support import ChainBuilder, apply_all, lease_record, workitem_state
from blocking import Caller
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mwpstore.agent_store import AgentStore
from mwpstore.errors import InvalidCommand, LeaseMismatch
from mwpstore.messages import Command, command_bytes
from mwpstore.offline import BufferedState, OfflineGuard, OfflineRefused, derive_action_id, sign_command
from mwpstore.registry import verify_signature
from work_model_support import GROUP, Harness

AGENT = "w1"
GRACE_MS = 5_000


class Setup:
    def __init__(self, tmp_path) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.harness = Harness()
        self.harness.signing_keys[AGENT] = self.key
        public_key = self.key.public_key().public_bytes_raw().hex()
        h = self.harness
        h.accept("owner", "group.create", GROUP, {"org": "org1"})
        h.accept("owner", "membership.add", AGENT, {"role": "worker", "public_key": public_key}, cas=True)
        h.accept("owner", "membership.add", "w2", {"role": "worker"}, cas=True)
        h.accept("owner", "mission.create", "m1", {"title": "one", "cost_limit": 1_000, "approval_required": []})
        h.create_workitem("wi1")
        h.create_workitem("wi2")
        h.claim_and_start(AGENT, "wi1")
        self.agent = AgentStore.open(tmp_path / "agent")
        self.sync()
        self.guard = OfflineGuard(self.agent, GROUP, AGENT, grace_ms=GRACE_MS)
        self.submitted: list[Command] = []

    def sync(self) -> None:
        with self.agent.begin() as tx:
            for event in self.harness.group.events:
                tx.apply(event)
            tx.advance_cursor(GROUP)

    def submit(self, command: Command):
        self.submitted.append(command)
        return self.harness.accept_command(command)

    def offline_command(self, kind: str, body: dict, *, cas: bool = False, action: str) -> Command:
        revision = self.harness.group.revision(f"workitem:wi1") if cas else None
        command = Command(actor=AGENT, action_id=action, group=GROUP, kind=kind, target="wi1", body=body,
                          expected_revision=revision)
        return sign_command(command, self.key)


@pytest.fixture
def setup(tmp_path):
    state = Setup(tmp_path)
    yield state
    state.agent.close()


def now(setup):
    return setup.harness.now_ms


def test_guard_allows_active_reversible_work_within_grace(setup):
    """MWP-WRK-020: offline, only already-active reversible work within the grace period."""
    setup.guard.service_unreachable(now(setup))
    binding = setup.guard.permit("wi1", now_ms=now(setup) + 10, reversible=True)
    lease = setup.harness.lease("wi1")
    assert binding.lease_id == lease["lease_id"]
    assert binding.ownership_epoch == lease["ownership_epoch"]
    assert binding.session_epoch == lease["session_epoch"]
    assert binding.grace_deadline_ms == min(now(setup) + GRACE_MS, lease["expires_at_ms"])
    assert binding.reversible


@pytest.mark.parametrize(
    "workitem,options,reason",
    [
        ("wi2", dict(reversible=True), "new_work"),
        ("wi1", dict(reversible=False), "irreversible"),
        ("wi1", dict(reversible=True, externally_visible=True), "externally_visible"),
        ("wi1", dict(reversible=True, kind="workitem.submit"), "kind"),
        ("wi1", dict(reversible=True, kind="workitem.claim"), "kind"),
    ],
)
def test_guard_refuses_while_offline(setup, workitem, options, reason):
    setup.guard.service_unreachable(now(setup))
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit(workitem, now_ms=now(setup) + 1, **options)
    assert info.value.detail["reason"] == reason


def test_guard_refuses_after_the_grace_deadline(setup):
    setup.guard.service_unreachable(now(setup))
    deadline = setup.guard.permit("wi1", now_ms=now(setup), reversible=True).grace_deadline_ms
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi1", now_ms=deadline, reversible=True)
    assert info.value.detail["reason"] == "grace_expired"


@pytest.mark.parametrize("moment", [1.5e12, -1, 2**63, "now", True])
def test_a_time_that_is_not_int_milliseconds_is_refused_before_it_is_stored(setup, moment):
    with pytest.raises(InvalidCommand) as caught:
        setup.guard.service_unreachable(moment)
    assert caught.value.detail["field"] == "now_ms" and setup.guard.outage() is None
    setup.guard.service_unreachable(now(setup))
    with pytest.raises(InvalidCommand):
        setup.guard.permit("wi1", now_ms=moment, reversible=True)
    assert setup.guard.outage().since_ms == now(setup)  # what was stored still reads back


@pytest.mark.parametrize("grace_ms", [-1, 2**64, 1.5, None])
def test_a_grace_period_out_of_bounds_is_refused(setup, grace_ms):
    with pytest.raises(InvalidCommand):
        OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=grace_ms)


def test_a_claimed_but_never_started_workitem_is_new_work_offline(setup):
    """MWP-WRK-020: only already-active work; a claim whose work never started is not."""
    setup.harness.claim(AGENT, "wi2")
    setup.sync()
    setup.guard.service_unreachable(now(setup))
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi2", now_ms=now(setup) + 1, reversible=True)
    assert info.value.detail["reason"] == "new_work"
    lease = setup.harness.lease("wi2")
    start = Command(actor=AGENT, action_id="start-offline", group=GROUP, kind="workitem.start", target="wi2",
                    body={"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]})
    with pytest.raises(OfflineRefused) as info:
        setup.guard.buffer(start, now_ms=now(setup) + 1, reversible=True)
    assert info.value.detail["reason"] == "kind" and setup.guard.buffered() == []


def test_a_command_for_another_lease_is_not_buffered(setup):
    """Rebasing moves a buffered Command onto the current lease: one written for an earlier lease
    (a late result) must not get there."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    for field, stale in (("lease_id", "0" * 32), ("ownership_epoch", fence["ownership_epoch"] - 1)):
        body = {**fence, field: stale, "checkpoint": {"step": 99}}
        command = setup.offline_command("workitem.checkpoint", body, action=f"late-{field}")
        with pytest.raises(OfflineRefused) as info:
            setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
        assert info.value.detail["reason"] == "fence"
    assert setup.guard.buffered() == []


def test_outage_survives_a_restart(setup, tmp_path):
    setup.guard.service_unreachable(now(setup))
    setup.agent.close()
    setup.agent = AgentStore.open(tmp_path / "agent")
    guard = OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=GRACE_MS)
    assert guard.offline
    with pytest.raises(OfflineRefused):
        guard.permit("wi2", now_ms=now(setup), reversible=True)


def test_online_irreversible_operation_needs_a_current_lease(setup):
    assert setup.guard.permit("wi1", now_ms=now(setup), reversible=False) is None
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi2", now_ms=now(setup), reversible=False, externally_visible=True)
    assert info.value.detail["reason"] == "no_current_lease"


def test_online_irreversible_operation_is_refused_from_the_lease_expiry_on(setup):
    # A lease expires at expires_at_ms: that millisecond is no longer inside it.
    expires = setup.harness.lease("wi1")["expires_at_ms"]
    assert setup.guard.permit("wi1", now_ms=expires - 1, reversible=False) is None
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi1", now_ms=expires, reversible=False)
    assert info.value.detail["reason"] == "no_current_lease"


def test_buffered_commands_are_durable_with_their_binding(setup, tmp_path):
    """MWP-WRK-021: buffered Commands keep their offline-execution binding, durably."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    command = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1")
    record = setup.guard.buffer(command, now_ms=now(setup) + 5, reversible=True)
    with pytest.raises(OfflineRefused):
        setup.guard.buffer(setup.offline_command("workitem.submit", {**fence, "submission": {}}, action="s-1"),
                           now_ms=now(setup) + 6, reversible=True)
    setup.agent.close()
    setup.agent = AgentStore.open(tmp_path / "agent")
    [stored] = OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=GRACE_MS).buffered()
    assert stored.command == command
    assert stored.binding == record.binding
    assert stored.binding.lease_id == fence["lease_id"]
    assert stored.state is BufferedState.BUFFERED


def test_reconnect_rebases_resigns_and_renames_exactly_where_freshness_changed(setup):
    """MWP-WRK-021, MWP-EXT-005: rebase, re-sign, new Action ID exactly where freshness changed."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    revision = setup.harness.group.revision("workitem:wi1")
    # Two renewals written offline both name the revision the agent knew: the second is stale
    # once the first is accepted, so it is rebased and gets a new Action ID.
    first = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1")
    second = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-2")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 9}}, action="cp-1")
    for command in (first, second, checkpoint):
        setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
    setup.harness.advance(100)
    outcomes = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert [outcome.state for outcome in outcomes] == [BufferedState.SUBMITTED] * 3
    sent = setup.submitted
    # each outcome reports what was sent (the rebased Command) and the receipt it got, as stored
    assert [outcome.command for outcome in outcomes] == sent
    receipts = [record.receipt for record in setup.guard.buffered()]
    assert [outcome.receipt for outcome in outcomes] == receipts and None not in receipts
    assert [outcome.error for outcome in outcomes] == [None] * 3
    assert sent[0].action_id == "renew-1" and sent[0].expected_revision == revision
    assert sent[1].action_id == derive_action_id("renew-2", {"expected_revision": revision + 1})
    assert sent[1].expected_revision == revision + 1
    assert sent[2].action_id == "cp-1"
    public_key = setup.key.public_key().public_bytes_raw()
    for command in sent:
        verify_signature(public_key, command_bytes(command), command.signature)
    setup.sync()
    assert setup.agent.checkpoint(GROUP, "wi1") == {"step": 9}
    assert not setup.guard.offline
    assert setup.guard.reconnect(setup.submit, signing_key=setup.key) == []


def test_reconnect_refuses_arguments_of_the_wrong_kind_and_an_unstorable_receipt_typed(setup):
    """``reconnect`` called ``submit`` and ``sync`` and signed with ``signing_key`` without
    checking them: a ``submit`` that is no callable raised TypeError once the record was stored
    REBASED, a wrong key AttributeError, and a receipt the store cannot encode (a lone
    surrogate, an int past 64 bits) the encoder's own error. Each is now ``InvalidCommand``
    naming the argument; the wrong arguments touch no record, and after the unstorable receipt
    the record stays REBASED and the next ``reconnect`` sends the same bytes again."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    command = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1")
    setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
    before = setup.guard.buffered()
    for field, arguments in [
        ("submit", {"submit": None}),
        ("submit", {"submit": {"not": "callable"}}),
        ("sync", {"sync": True}),
        ("signing_key", {"signing_key": None}),
        ("signing_key", {"signing_key": setup.key.public_key()}),
    ]:
        with pytest.raises(InvalidCommand) as caught:
            setup.guard.reconnect(**{"submit": setup.submit, "signing_key": setup.key, **arguments})
        assert caught.value.field == field
        assert setup.guard.buffered() == before and setup.submitted == []
    for unstorable in ("a\ud800", 2**64):
        with pytest.raises(InvalidCommand) as caught:
            setup.guard.reconnect(lambda command: setup.submit(command) and unstorable, signing_key=setup.key)
        assert caught.value.field == "submit"
        [record] = setup.guard.buffered()
        assert record.state is BufferedState.REBASED and setup.guard.offline
    [outcome] = setup.guard.reconnect(setup.submit, signing_key=setup.key)
    assert outcome.state is BufferedState.SUBMITTED and not setup.guard.offline
    with pytest.raises(InvalidCommand) as caught:  # sign_command, the signing reconnect does, checks the same
        sign_command(command, setup.key.public_key())
    assert caught.value.field == "signing_key"
    assert setup.submitted == [outcome.command] * 3  # the stored bytes each time (the authority's idempotency answers)


def test_a_buffered_command_whose_body_changes_during_the_call_is_stored_as_it_was_checked(setup, monkeypatch):
    """``buffer`` checked the Command, then ran the guard and stored it: a body another thread
    changed meanwhile was stored unchecked, and every later ``reconnect`` refused it when its
    rebase checked the Command again, so the outage never ended. The body stored is now the
    copy that was checked."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    body = {**fence, "checkpoint": {"step": 1}}
    command = setup.offline_command("workitem.checkpoint", body, action="cp-1")
    permit = setup.guard.permit

    def permit_while_another_thread_changes_the_body(*arguments, **options):
        body["checkpoint"] = {"step": float("nan")}  # no content: refused by any check
        return permit(*arguments, **options)

    monkeypatch.setattr(setup.guard, "permit", permit_while_another_thread_changes_the_body)
    record = setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
    monkeypatch.undo()
    assert record.command.body["checkpoint"] == {"step": 1}
    [stored] = setup.guard.buffered()
    assert stored.command.body["checkpoint"] == {"step": 1}
    [outcome] = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert outcome.state is BufferedState.SUBMITTED and not setup.guard.offline
    setup.sync()
    assert setup.agent.checkpoint(GROUP, "wi1") == {"step": 1}


def test_a_rejected_buffered_command_is_not_resubmitted_by_a_later_reconnect(setup):
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-r")
    setup.guard.buffer(checkpoint, now_ms=now(setup) + 1, reversible=True)

    def refuse(command):
        raise InvalidCommand("refused by the authority", field="body")

    [outcome] = setup.guard.reconnect(refuse, signing_key=setup.key, sync=setup.sync)
    assert outcome.state is BufferedState.REJECTED and outcome.error == InvalidCommand.code
    # The authority's answer is final: a later reconnect (the next outage) does not send it again.
    assert setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync) == []
    assert setup.submitted == []
    assert [record.state for record in setup.guard.buffered()] == [BufferedState.REJECTED]


def test_buffered_command_with_a_revoked_lease_is_not_resubmitted(setup):
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 2}}, action="cp-1")
    setup.guard.buffer(checkpoint, now_ms=now(setup) + 1, reversible=True)
    # Meanwhile, at the Group: the owner reassigns the WorkItem (the lease is revoked) and w2 claims it.
    setup.harness.accept("owner", "workitem.reassign", "wi1", {"reason": "w1 unreachable"})
    setup.harness.claim("w2", "wi1")
    outcomes = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert [(outcome.state, outcome.error) for outcome in outcomes] == [(BufferedState.REFUSED, LeaseMismatch.code)]
    assert setup.submitted == []
    [record] = setup.guard.buffered()
    assert record.state is BufferedState.REFUSED
    with pytest.raises(LeaseMismatch):
        setup.guard.rebase(record, setup.key)


def test_session_replacement_meanwhile_revokes_the_binding(setup):
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    setup.guard.buffer(setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {}}, action="cp-1"),
                       now_ms=now(setup) + 1, reversible=True)
    session_epoch = setup.harness.member(AGENT)["session_epoch"]
    setup.harness.accept(AGENT, "session.replace", AGENT, {"session_epoch": session_epoch})
    setup.harness.claim(AGENT, "wi1")  # the agent's new session holds a new lease: still not the bound one
    outcomes = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert outcomes[0].state is BufferedState.REFUSED
    assert setup.submitted == []


def test_rebase_is_deterministic_and_resends_the_stored_bytes_after_a_failed_submit(setup):
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    setup.guard.buffer(setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1"),
                       now_ms=now(setup) + 1, reversible=True)
    setup.guard.buffer(setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-2"),
                       now_ms=now(setup) + 1, reversible=True)
    calls = []

    def flaky(command):
        calls.append(command)
        if len(calls) == 2:
            raise ConnectionError("dropped during reconnect")
        return setup.submit(command)

    with pytest.raises(ConnectionError):
        setup.guard.reconnect(flaky, signing_key=setup.key, sync=setup.sync)
    assert setup.guard.offline
    states = [record.state for record in setup.guard.buffered()]
    assert states == [BufferedState.SUBMITTED, BufferedState.REBASED]
    outcomes = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert [outcome.state for outcome in outcomes] == [BufferedState.SUBMITTED]
    assert setup.submitted[-1] == calls[1], "the very same rebased, signed bytes are resent"


def test_a_record_whose_fence_names_another_lease_is_refused_at_reconnect_not_rewritten(setup):
    """A record stored before ``buffer`` compared fences (or written by other means): rebase does
    not move it onto the current lease, it refuses it like a revoked one."""
    from mwpstore.offline import _BUFFERED_ENCODER, BufferedCommand, _command_key

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    binding = setup.guard.permit("wi1", now_ms=now(setup) + 1, reversible=True)
    late = setup.offline_command("workitem.checkpoint", {**fence, "ownership_epoch": fence["ownership_epoch"] - 1,
                                                         "checkpoint": {"step": 99}}, action="late-cp")
    record = BufferedCommand(number=1, group=GROUP, command=late, binding=binding, buffered_at_ms=now(setup) + 1)
    with setup.agent.begin() as tx:
        tx._offline_put(_command_key(GROUP, 1), _BUFFERED_ENCODER.encode(record))
    outcomes = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    assert [(outcome.state, outcome.error) for outcome in outcomes] == [(BufferedState.REFUSED, "LEASE_MISMATCH")]
    assert setup.submitted == [] and setup.agent.checkpoint(GROUP, "wi1") != {"step": 99}


def test_reset_group_keeps_the_agents_own_records(setup):
    """A rebuild by ``reset_group`` drops what the Events give back and keeps what no Event does:
    the outbox intent with its state and the Command buffered offline with its binding."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    command = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1")
    record = setup.guard.buffer(command, now_ms=now(setup) + 5, reversible=True)
    with setup.agent.begin() as tx:
        intent = tx.record_intent(GROUP, mission="m1", workitem="wi1", ownership_epoch=fence["ownership_epoch"],
                                  operation="notify", request={"to": "ops"})
    digest = setup.agent.projection_digest()
    setup.agent.reset_group(GROUP)
    assert setup.agent.states(GROUP) == {} and setup.agent.cursor(GROUP) == 0
    assert setup.agent.intents(GROUP) == [intent]
    [stored] = setup.guard.buffered()
    assert stored.command == command and stored.binding == record.binding
    setup.sync()
    assert setup.agent.projection_digest() == digest


@pytest.mark.parametrize("kind", sorted(["workitem.claim", "workitem.start", "workitem.submit", "workitem.publish",
                                         "approval.request"]))
def test_every_kind_that_starts_new_work_or_shows_outside_is_refused_offline(setup, kind):
    """Pins the documented list of kinds refused offline on an active, held, reversible lease:
    each of the five, publication included, is refused with reason ``kind``."""
    setup.guard.service_unreachable(now(setup))
    assert setup.guard.permit("wi1", now_ms=now(setup) + 1, reversible=True) is not None
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi1", now_ms=now(setup) + 1, reversible=True, kind=kind)
    assert info.value.detail["reason"] == "kind"


def test_a_lease_held_by_another_agent_is_not_this_agents_work(setup):
    """A WorkItem leased to another agent (started, live) is new work for this one: refused offline
    (``new_work``) and, online, no current lease for an irreversible operation."""
    setup.harness.claim_and_start("w2", "wi2")
    setup.sync()
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi2", now_ms=now(setup), reversible=False)
    assert info.value.detail["reason"] == "no_current_lease"
    setup.guard.service_unreachable(now(setup))
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi2", now_ms=now(setup) + 1, reversible=True)
    assert info.value.detail["reason"] == "new_work"


def test_online_a_claimed_lease_past_its_start_deadline_is_not_current(setup):
    """Online, a claimed lease whose work never started stops being current at its start-by time
    (the claim lapses there), though it has not expired."""
    lease = setup.harness.claim(AGENT, "wi2")
    setup.sync()
    lease = setup.harness.lease("wi2")
    assert not lease["started"] and lease["start_by_ms"] < lease["expires_at_ms"]
    assert setup.guard.permit("wi2", now_ms=lease["start_by_ms"] - 1, reversible=False) is None
    with pytest.raises(OfflineRefused) as info:
        setup.guard.permit("wi2", now_ms=lease["start_by_ms"], reversible=False)
    assert info.value.detail["reason"] == "no_current_lease"


def test_a_mirrored_lease_without_a_started_field_counts_as_started(tmp_path):
    """The mirror keeps a lease as its Events carried it; a lease without ``started`` (a chain made
    by hand) is taken as started by the guard, online past its start-by time and offline alike."""
    chain = ChainBuilder("g1")
    lease = lease_record(AGENT, 1, now_ms=chain.now_ms)
    chain.event("workitem.claim", "workitem:wi1",
                {"workitem:wi1": workitem_state("m1", "leased", attempt=1, ownership_epoch=1, lease=lease)})
    with AgentStore.open(tmp_path / "agent") as agent:
        apply_all(agent, chain.events)
        guard = OfflineGuard(agent, "g1", AGENT, grace_ms=GRACE_MS)
        assert guard.permit("wi1", now_ms=lease["start_by_ms"], reversible=False) is None
        with pytest.raises(OfflineRefused) as info:
            guard.permit("wi1", now_ms=lease["expires_at_ms"], reversible=False)
        assert info.value.detail["reason"] == "no_current_lease"
        guard.service_unreachable(lease["start_by_ms"])
        binding = guard.permit("wi1", now_ms=lease["start_by_ms"], reversible=True)
        assert binding.lease_id == lease["lease_id"]


def test_a_second_unreachable_report_keeps_the_outage_start(setup):
    """The outage starts at the first report: later reports during it do not move the start, so
    they cannot extend the grace period."""
    start = now(setup)
    guard = OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=300)
    guard.service_unreachable(start)
    guard.service_unreachable(start + 200)
    assert guard.outage().since_ms == start
    with pytest.raises(OfflineRefused) as info:
        guard.permit("wi1", now_ms=start + 300, reversible=True)
    assert info.value.detail["reason"] == "grace_expired"


def test_the_grace_period_is_the_one_recorded_when_the_outage_began(setup):
    """A guard made later (after a restart, say) with a longer ``grace_ms`` does not lengthen an
    outage already under way: the deadline uses the grace stored with the outage."""
    start = now(setup)
    short = 300
    assert start + short < setup.harness.lease("wi1")["expires_at_ms"]  # the grace, not the lease, binds
    OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=short).service_unreachable(start)
    longer = OfflineGuard(setup.agent, GROUP, AGENT, grace_ms=GRACE_MS)
    assert longer.outage().grace_ms == short
    assert longer.permit("wi1", now_ms=start + 1, reversible=True).grace_deadline_ms == start + short
    with pytest.raises(OfflineRefused) as info:
        longer.permit("wi1", now_ms=start + short, reversible=True)
    assert info.value.detail["reason"] == "grace_expired"


def test_another_agents_command_is_not_buffered(setup):
    """``buffer`` keeps only this agent's Commands in this Group: one whose actor is another agent
    is ``INVALID_COMMAND`` (field ``command``) and nothing is stored."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    command = Command(actor="w2", action_id="cp-w2", group=GROUP, kind="workitem.checkpoint", target="wi1",
                      body={**fence, "checkpoint": {"step": 1}})
    with pytest.raises(InvalidCommand) as caught:
        setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
    assert caught.value.detail["field"] == "command" and setup.guard.buffered() == []


def test_derived_action_id_depends_on_the_changed_fields(setup):
    """``derive_action_id(old, changed)`` is ``rb-`` + 40 hex of a domain-separated blake3 of the
    old ID and the changed fields: a different change gives a different ID, the same change the
    same one."""
    import blake3

    from mwpstore import canonical
    from mwpstore.offline import DOMAIN_REBASE

    first = derive_action_id("renew-2", {"expected_revision": 4})
    assert first == derive_action_id("renew-2", {"expected_revision": 4})
    assert first != derive_action_id("renew-2", {"expected_revision": 5})
    assert first != derive_action_id("renew-3", {"expected_revision": 4})
    data = canonical.canonical_bytes({"action_id": "renew-2", "changed": {"expected_revision": 4}})
    assert first == "rb-" + blake3.blake3(DOMAIN_REBASE + data).hexdigest()[:40]


def test_a_rebased_command_whose_send_arrived_is_resent_unchanged_though_the_group_moved_on(setup):
    """A send that reached the authority but whose answer was lost: the next reconnect resends the
    stored bytes (same Action ID, same expected revision), never rebases it again onto the revision
    its own acceptance moved, which would make it a second, new renewal."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    setup.guard.buffer(setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1"),
                       now_ms=now(setup) + 1, reversible=True)
    revision = setup.harness.group.revision("workitem:wi1")

    def arrives_then_drops(command):
        setup.submit(command)
        raise ConnectionError("answer lost")

    with pytest.raises(ConnectionError):
        setup.guard.reconnect(arrives_then_drops, signing_key=setup.key, sync=setup.sync)
    first = setup.submitted[-1]
    assert setup.harness.group.revision("workitem:wi1") == revision + 1
    resent = []

    def idempotent(command):
        resent.append(command)
        return None

    [outcome] = setup.guard.reconnect(idempotent, signing_key=setup.key, sync=setup.sync)
    assert outcome.state is BufferedState.SUBMITTED
    assert resent == [first] and first.action_id == "renew-1" and first.expected_revision == revision


@pytest.mark.parametrize("options,field", [
    (dict(reversible="yes"), "reversible"),
    (dict(reversible=1), "reversible"),
    (dict(reversible=True, externally_visible="no"), "externally_visible"),
    (dict(reversible=True, kind=["workitem.start"]), "kind"),
])
def test_guard_options_of_the_wrong_type_are_refused_before_anything_is_stored(setup, options, field):
    """``reversible`` and ``externally_visible`` are bools and ``kind`` a str or None: anything
    else is ``INVALID_COMMAND`` online and offline, and ``buffer`` stores nothing (a binding with a
    non-bool ``reversible`` would be stored and then fail to decode, taking every buffered Command
    of the Group with it)."""
    with pytest.raises(InvalidCommand) as caught:
        setup.guard.permit("wi1", now_ms=now(setup), **options)
    assert caught.value.detail["field"] == field
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    kept = setup.guard.buffer(setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}},
                                                    action="cp-ok"), now_ms=now(setup) + 1, reversible=True)
    with pytest.raises(InvalidCommand) as caught:
        setup.guard.permit("wi1", now_ms=now(setup) + 1, **options)
    assert caught.value.detail["field"] == field
    if field != "kind":  # buffer() takes the kind from the Command
        command = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 2}}, action="cp-bad")
        with pytest.raises(InvalidCommand) as caught:
            setup.guard.buffer(command, now_ms=now(setup) + 1, **options)
        assert caught.value.detail["field"] == field
    assert setup.guard.buffered() == [kept]


def test_a_rebased_action_id_depends_on_the_old_id_and_on_what_changed():
    """``derive_action_id`` is a pure function of both inputs: the same rebase gives the same id
    (a resend is a duplicate), another buffered Command or another new revision gives another one
    (two different rebased Commands never share an Action ID)."""
    rebased = derive_action_id("renew-2", {"expected_revision": 4})
    assert rebased == derive_action_id("renew-2", {"expected_revision": 4})
    assert rebased != derive_action_id("renew-3", {"expected_revision": 4})
    assert rebased != derive_action_id("renew-2", {"expected_revision": 5})
    assert rebased.startswith("rb-")


def test_a_command_buffered_while_reconnect_runs_is_submitted_not_left_behind(setup):
    """The outage ends only once no buffered Command is left to submit. A Command that the agent's
    other work buffered while ``reconnect`` was sending the earlier ones (the outage still stood,
    so the guard allowed it) is sent by the same ``reconnect``; ending the outage first left it
    BUFFERED for good, with ``buffer`` refusing the agent from then on as online."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    revision = setup.harness.group.revision("workitem:wi1")
    first = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1")
    late = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-2")
    setup.guard.buffer(first, now_ms=now(setup) + 1, reversible=True)

    offline_while_sending = []

    def submit_while_work_goes_on(command):
        offline_while_sending.append(setup.guard.offline)
        if command.action_id == "renew-1":  # meanwhile, another thread of the agent buffers its next Command
            setup.guard.buffer(late, now_ms=now(setup) + 2, reversible=True)
        return setup.submit(command)

    outcomes = setup.guard.reconnect(submit_while_work_goes_on, signing_key=setup.key, sync=setup.sync)
    assert [outcome.state for outcome in outcomes] == [BufferedState.SUBMITTED] * 2
    # the outage stands until no Command is left: a crash while the late one is sent leaves both
    # to the next reconnect, not a BUFFERED Command with no outage to send it
    assert offline_while_sending == [True, True]
    assert [record.state for record in setup.guard.buffered()] == [BufferedState.SUBMITTED] * 2
    assert [command.action_id for command in setup.submitted] == [
        "renew-1", derive_action_id("renew-2", {"expected_revision": revision + 1})]
    assert not setup.guard.offline
    assert setup.harness.group.revision("workitem:wi1") == revision + 2


def test_a_command_another_reconnect_rebased_but_could_not_send_is_sent_before_the_outage_ends(setup):
    """A REBASED Command is one still to send as much as a BUFFERED one: here a second reconnect
    (another thread's retry) rebased the late Command, stored it and then failed to send it. The
    first reconnect finds it left and sends its stored bytes; ending the outage on seeing no
    BUFFERED Command left it unsent with no outage to send it."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    first = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1")
    late = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-2")
    setup.guard.buffer(first, now_ms=now(setup) + 1, reversible=True)

    def unreachable_for_the_late_one(command):
        if command.action_id != "renew-1":
            raise ConnectionError("the Group service is unreachable again")
        return setup.submit(command)

    def submit_while_another_reconnect_runs(command):
        if command.action_id == "renew-1" and len(setup.guard.buffered()) == 1:
            setup.guard.buffer(late, now_ms=now(setup) + 2, reversible=True)
            with pytest.raises(ConnectionError):
                setup.guard.reconnect(unreachable_for_the_late_one, signing_key=setup.key, sync=setup.sync)
            assert [record.state for record in setup.guard.buffered()] == [BufferedState.SUBMITTED, BufferedState.REBASED]
        return setup.submit(command)

    setup.guard.reconnect(submit_while_another_reconnect_runs, signing_key=setup.key, sync=setup.sync)
    assert [record.state for record in setup.guard.buffered()] == [BufferedState.SUBMITTED] * 2
    assert not setup.guard.offline


def test_buffer_checks_the_outage_in_its_own_commit(setup, monkeypatch):
    """``buffer`` stores a Command only while the outage it was allowed under still stands when it
    writes: a ``reconnect`` that ended the outage between the guard's check and the write (found no
    Command left, and returned) would never send it. Such a Command is refused as online."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    command = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1")
    real_permit = OfflineGuard.permit

    def permit_then_reconnect_ends_the_outage(self, *args, **kwargs):
        binding = real_permit(self, *args, **kwargs)
        assert setup.guard.reconnect(setup.submit, signing_key=setup.key) == []  # another thread, meanwhile
        return binding

    monkeypatch.setattr(OfflineGuard, "permit", permit_then_reconnect_ends_the_outage)
    with pytest.raises(OfflineRefused) as caught:
        setup.guard.buffer(command, now_ms=now(setup) + 1, reversible=True)
    assert caught.value.detail["reason"] == "online"
    assert setup.guard.buffered() == [] and not setup.guard.offline


def test_two_reconnects_at_once_send_a_buffered_command_once_under_one_action_id(setup):
    """Two threads of the agent reconnect at once. The second read the buffered Command before the
    first rebased, stored and sent it; when it goes on, the Group has moved (the first send was
    accepted), so rebasing again would name the new revision and derive a new Action ID, and the
    authority would take the same renewal twice. The second takes what the first stored instead:
    its record is REBASED or later, and REBASED bytes are resent unchanged."""
    import threading

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    revision = setup.harness.group.revision("workitem:wi1")
    renew = setup.offline_command("lease.renew", dict(fence), cas=True, action="renew-1")
    setup.guard.buffer(renew, now_ms=now(setup) + 1, reversible=True)
    read_the_record, first_done = threading.Event(), threading.Event()

    def sync_after_the_first_reconnect():
        # called by the second reconnect once it holds the record as it read it (BUFFERED)
        read_the_record.set()
        assert first_done.wait(30)
        setup.sync()

    second = Caller(lambda: setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=sync_after_the_first_reconnect))
    try:
        assert read_the_record.wait(30)
        first = setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=setup.sync)
    finally:
        first_done.set()
    second_outcomes = second.outcome()
    assert isinstance(second_outcomes, list), second_outcomes
    assert [outcome.state for outcome in first] == [BufferedState.SUBMITTED]
    assert {command.action_id for command in setup.submitted} == {"renew-1"}  # one key, however often sent
    assert setup.harness.group.revision("workitem:wi1") == revision + 1  # renewed once
    assert [outcome.state for outcome in second_outcomes] == [BufferedState.SUBMITTED]
    [record] = setup.guard.buffered()
    assert record.state is BufferedState.SUBMITTED and record.rebased.action_id == "renew-1"
    assert not setup.guard.offline


def test_rebase_reads_the_lease_and_the_revision_it_rebases_onto_in_one_snapshot(setup, monkeypatch):
    """The lease check and the revision a Command is rebased onto come from one read of the
    mirror. Read apart, a revocation the delivery thread applied between them gave a Command
    checked against the old lease and rebased onto the revocation's revision: the authority's
    compare-and-set passed, and it took the checkpoint (as Evidence) though its lease was revoked.
    From one snapshot, the Command names the revision its lease check saw, and the authority
    refuses it."""
    import contextlib
    import threading

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 3}}, cas=True, action="cp-1")
    setup.guard.buffer(checkpoint, now_ms=now(setup) + 1, reversible=True)
    events_before = len(setup.harness.group.events)
    real_read, real_rebase = AgentStore._read, OfflineGuard.rebase
    rebasing = []

    @contextlib.contextmanager
    def read_then_deliver(self):
        with real_read(self) as txn:
            yield txn
        if rebasing and not rebasing[0]:
            rebasing[0] = True  # after the rebase's first read: the owner reassigns, w2 claims,
            setup.harness.accept("owner", "workitem.reassign", "wi1", {"reason": "w1 unreachable"})
            setup.harness.claim("w2", "wi1")
            delivery = threading.Thread(target=setup.sync)  # and the delivery thread applies it
            delivery.start()
            delivery.join(30)
            assert not delivery.is_alive()

    def rebase_watched(self, record, signing_key):
        rebasing.append(False)
        return real_rebase(self, record, signing_key)

    monkeypatch.setattr(AgentStore, "_read", read_then_deliver)
    monkeypatch.setattr(OfflineGuard, "rebase", rebase_watched)
    [outcome] = setup.guard.reconnect(setup.submit, signing_key=setup.key)
    assert rebasing == [True]
    assert outcome.state in (BufferedState.REFUSED, BufferedState.REJECTED), outcome
    assert [event.kind for event in setup.harness.group.events[events_before:]] == ["workitem.reassign", "workitem.claim"]


def test_rebase_takes_the_lease_the_session_and_the_revision_from_one_read(setup, monkeypatch):
    """The test above catches one order of the reads; this one pins the rule whatever the order:
    everything rebase reads from the mirror (the WorkItem's lease, the member's session, the
    target's revision) comes from one read transaction."""
    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 3}}, cas=True, action="cp-1")
    setup.guard.buffer(checkpoint, now_ms=now(setup) + 1, reversible=True)
    [record] = setup.guard.buffered()
    real_read = AgentStore._read
    reads = []

    def counted(self):  # type: ignore[no-untyped-def]
        reads.append(1)
        return real_read(self)

    monkeypatch.setattr(AgentStore, "_read", counted)
    rebased = setup.guard.rebase(record, setup.key)
    assert len(reads) == 1
    assert rebased.expected_revision == setup.harness.group.revision("workitem:wi1")


def test_rebase_of_a_record_whose_binding_names_no_aggregate_key_is_invalid_command(setup):
    """``rebase`` takes any BufferedCommand a caller hands it: a binding whose WorkItem cannot
    make an aggregate key (here not printable) is refused as such (INVALID_COMMAND), not looked
    up as a key that cannot exist and reported as a revoked lease."""
    import msgspec

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    checkpoint = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 3}}, cas=True, action="cp-1")
    setup.guard.buffer(checkpoint, now_ms=now(setup) + 1, reversible=True)
    [record] = setup.guard.buffered()
    forged = msgspec.structs.replace(record, binding=msgspec.structs.replace(record.binding, workitem="wi\n1"))
    with pytest.raises(InvalidCommand):
        setup.guard.rebase(forged, setup.key)


def test_two_commands_buffered_at_once_are_both_kept(setup, monkeypatch):
    """Two threads buffer a Command each at once. Each number is taken in the commit that stores
    the Command: taken from an earlier read, both would get the same number and the second would
    overwrite the first, a Command buffered and never sent."""
    import threading

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    first = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1")
    second = setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 2}}, action="cp-2")
    checked, first_stored = threading.Event(), threading.Event()
    outcome: dict = {}
    real_begin = AgentStore.begin

    def begin_after_the_first_is_stored(self):
        if threading.current_thread() is thread and not checked.is_set():
            checked.set()  # the guard allowed the second Command; it is about to be stored
            assert first_stored.wait(30)
        return real_begin(self)

    def buffer_second():
        try:
            outcome["record"] = setup.guard.buffer(second, now_ms=now(setup) + 2, reversible=True)
        except BaseException as exc:  # reported to the main thread
            outcome["error"] = exc

    monkeypatch.setattr(AgentStore, "begin", begin_after_the_first_is_stored)
    thread = threading.Thread(target=buffer_second)
    thread.start()
    try:
        assert checked.wait(30)
        setup.guard.buffer(first, now_ms=now(setup) + 1, reversible=True)
    finally:
        first_stored.set()
        thread.join(30)
    assert not thread.is_alive() and "error" not in outcome
    assert [(record.number, record.command.action_id) for record in setup.guard.buffered()] == [(1, "cp-1"), (2, "cp-2")]


@pytest.mark.parametrize(
    "value",
    [b"\x91\x01", b"\x81\xa1x" + b"\x91" * 100_000 + b"\xc0"],  # the second: {"x": [[[...]]]}, a field decoding skips
    ids=["not a record", "nested past the decoder's depth"],
)
def test_an_offline_record_that_passes_its_seal_but_does_not_decode_is_corruption(setup, value):
    """The guard decodes its outage and buffered Commands itself, outside the AgentStore's typed
    read paths: a record rewritten under a sound seal that does not decode was msgspec's bare
    error (or a RecursionError), not ``CORRUPTION``."""
    from mwpstore.errors import Corruption
    from mwpstore.offline import _command_key, _outage_key

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    setup.guard.buffer(setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": 1}}, action="cp-1"),
                       now_ms=now(setup) + 5, reversible=True)
    tables = setup.agent._tables
    for key, calls in [
        (_command_key(GROUP, 1), [setup.guard.buffered, lambda: setup.guard.reconnect(setup.submit, signing_key=setup.key)]),
        (_outage_key(GROUP), [setup.guard.outage, lambda: setup.guard.permit("wi1", now_ms=now(setup), reversible=True)]),
    ]:
        with tables.begin(write=True) as txn:
            tables.put(txn, b"offline", key, value, new=False)
        for call in calls:
            with pytest.raises(Corruption) as caught:
                call()
            assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent", "offline")
    assert setup.submitted == []


@pytest.mark.parametrize("damaged_at", [1, 2], ids=["while its own step is stored", "before the outage's end is decided"])
def test_a_buffered_command_that_stops_decoding_during_a_reconnect_is_corruption(setup, damaged_at):
    """``reconnect`` decodes a stored record again where it stores a step (another reconnect may
    have moved it) and where it decides whether any Command is left before it ends the outage:
    a record rewritten meanwhile (here by ``sync``, called before each record's step) that does
    not decode is ``CORRUPTION`` there too, and the outage stands."""
    from mwpstore.errors import Corruption
    from mwpstore.offline import _command_key

    setup.guard.service_unreachable(now(setup))
    fence = setup.harness.fence("wi1")
    for number in (1, 2):
        setup.guard.buffer(setup.offline_command("workitem.checkpoint", {**fence, "checkpoint": {"step": number}}, action=f"cp-{number}"),
                           now_ms=now(setup) + number, reversible=True)
    tables = setup.agent._tables
    calls = []

    def sync():
        calls.append(1)
        if len(calls) == damaged_at:
            with tables.begin(write=True) as txn:
                tables.put(txn, b"offline", _command_key(GROUP, 1), b"\x91\x01", new=False)
        setup.sync()

    with pytest.raises(Corruption) as caught:
        setup.guard.reconnect(setup.submit, signing_key=setup.key, sync=sync)
    assert (caught.value.detail["reason"], caught.value.detail["database"]) == ("agent", "offline")
    assert setup.guard.offline and len(calls) == damaged_at
