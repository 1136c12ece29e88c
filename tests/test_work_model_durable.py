"""The work-model rules through the durable Authority, and rebuild-equals-state checks.

Every rule test of ``tests/test_work_model.py`` that drives a Group (it takes the ``h`` or
``new_harness`` fixture) runs here again with ``DurableHarness``: the same Commands go through
``Authority.accept`` (segment log + LMDB index, injectable clock), and the Events the tests look at
are read back from the log. The stateful machine of ``tests/test_work_model_stateful.py`` runs on
the Authority too, ending each run with ``rebuild()`` and a reopen that must give the same state.

kill -9 during a work-model load is in ``tests/test_work_model_crash.py`` (the Authority's crash
harness with a work-model child process).
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule

import test_work_model as rules
from authority_helpers import group_create
from mwpstore import Authority
from mwpstore.errors import InvalidState
from mwpstore.messages import Command, Event, receipt_for
from mwpstore.registry import ENGINE_ACTOR, MemoryGroup
from test_work_model_stateful import WorkModelMachine
from work_model_support import CONTRACT, GROUP, Harness, fence_of


class DurableHarness(Harness):
    """A Harness whose Group lives in an ``Authority`` stored under ``path``."""

    def __init__(self, path: str | Path, *, sync: bool = False) -> None:
        super().__init__()
        self.path = str(path)
        self.sync = sync
        self.authority = Authority.open(self.path, clock=self.clock, sync=sync)

    def clock(self) -> int:
        return self.now_ms

    def reopen(self) -> None:
        self.authority.close()
        self.authority = Authority.open(self.path, clock=self.clock, sync=self.sync)

    def accept_command(self, command: Command) -> Event:
        if command.actor == ENGINE_ACTOR:
            receipt = self.authority.accept_trusted(command)
        else:
            receipt = self.authority.accept(command)
        [event] = self.authority.read(self.group_id, after=receipt.seq - 1, limit=1)
        assert receipt_for(event) == receipt
        return event

    def get(self, key: str) -> dict[str, Any] | None:
        return self.authority.state(self.group_id, key)[1]

    def revision(self, key: str) -> int:
        return self.authority.state(self.group_id, key)[0]

    def states(self) -> tuple[dict[str, Any], dict[str, int]]:
        aggregates = self.authority.aggregates(self.group_id)
        states = {key: state for key, _, state in aggregates if state is not None}
        return states, {key: revision for key, revision, _ in aggregates}

    def events(self) -> list[Event]:
        events: list[Event] = []
        while True:
            batch = self.authority.read(self.group_id, after=len(events), limit=10_000)
            if not batch:
                return events
            events.extend(batch)

    def close(self) -> None:
        self.authority.close()


# -- The rule tests, again, through the Authority -------------------------------------------------

for _name, _test in vars(rules).copy().items():
    if _name.startswith("test_") and {"h", "new_harness"} & set(inspect.signature(_test).parameters):
        globals()[_name] = _test


@pytest.fixture
def new_harness(tmp_path: Path) -> Iterator[Callable[[], Harness]]:
    made: list[Harness] = []

    def make() -> Harness:
        made.append(DurableHarness(tmp_path / f"store-{len(made)}"))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def h(new_harness: Callable[[], Harness]) -> Harness:
    return new_harness().setup()


# -- Rebuild equals state ----------------------------------------------------------------------------


def _mixed_flow(h: DurableHarness) -> None:
    """Claims, starts, renewals, checkpoints, a takeover with late Evidence, charges, a block and
    resolution, a failure with backoff, a session replacement, approvals and the lease sweep."""
    h.create_workitem("wi2")
    h.create_workitem("wi3")
    first = h.claim_and_start("w1", "wi1")
    h.advance(100)
    h.accept("w1", "lease.renew", "wi1", fence_of(first), cas=True)
    h.accept("w1", "workitem.charge", "wi1", {**fence_of(first), "cost": 7, "progress": {"rows": 70}})
    h.accept("w1", "workitem.checkpoint", "wi1", {**fence_of(first), "checkpoint": {"row": 70}})
    second = h.claim("w1", "wi1")  # never started: the start window passes
    h.claim_and_start("w2", "wi2")
    h.advance(CONTRACT["start_ms"])
    third = h.claim_and_start("w2", "wi1")  # takeover under a higher ownership epoch
    assert third["ownership_epoch"] == second["ownership_epoch"] + 1
    h.evidence("w1", "workitem.submit", "wi1", {**fence_of(second), "submission": "late"})
    h.accept("w2", "workitem.block", "wi2", {**h.fence("wi2"), "checkpoint": {"p": 1}, "required_resolution": "key"})
    h.accept("owner", "workitem.resolve", "wi2", {"resolution": "given"})
    h.accept("w2", "approval.request", "ap1", {"workitem": "wi1", "operation": "submit"})
    h.accept("a1", "approval.decide", "ap1", {"decision": "approved"}, cas=True)
    h.accept("w2", "workitem.submit", "wi1", {**fence_of(third), "submission": {"answer": 42}, "approval": "ap1"})
    h.claim_and_start("w1", "wi3")
    h.accept("w1", "workitem.fail", "wi3", {**h.fence("wi3"), "reason": "flaky"})
    h.advance(1_000)
    h.claim_and_start("w1", "wi3")
    h.claim("w2", "wi2")
    h.accept("w1", "session.replace", "w1", {"session_epoch": 1})
    h.advance(CONTRACT["start_ms"])
    receipts = h.authority.expire_leases(GROUP)  # w2's unstarted lease on wi2 lapsed
    assert [receipt.kind for receipt in receipts] == ["lease.expire"]
    assert h.item("wi2")["state"] == "queued"


def test_durable_rebuild_and_reopen_give_the_same_state(tmp_path: Path) -> None:
    h = DurableHarness(tmp_path / "store", sync=True)
    h.setup()
    _mixed_flow(h)
    before = h.states()
    events = h.events()
    h.authority.rebuild()
    assert h.states() == before
    h.reopen()
    assert h.states() == before
    assert h.events() == events
    folded = MemoryGroup(GROUP)
    for event in events:
        folded.apply(event)
    assert (folded.states, folded.revisions) == before
    assert h.authority.verify().ok
    h.close()


def test_durable_evidence_receipt_survives_reopen_and_replays(tmp_path: Path) -> None:
    h = DurableHarness(tmp_path / "store", sync=True)
    h.setup()
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    late = h.command("w1", "workitem.submit", "wi1", {**fence_of(old), "submission": "late"})
    receipt = h.authority.accept(late)
    assert receipt.authoritative is False
    h.reopen()
    assert h.authority.accept(late) == receipt  # the original receipt, nothing appended
    assert h.item("wi1")["submission"] is None
    h.close()


def test_durable_replay_of_a_signed_command_gets_its_original_receipt(tmp_path: Path) -> None:
    """MWP-EVT-003 for a member with a registered key: the replay of a signed claim, after the
    key was rotated too, gets the original receipt and appends nothing; the same claim signed
    with the old key under a new Action ID is SIGNATURE_INVALID."""
    import msgspec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mwpstore.errors import SignatureInvalid
    from mwpstore.messages import command_bytes

    h = DurableHarness(tmp_path / "store")
    h.setup(workers=())
    old_key, new_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    h.accept("owner", "membership.add", "w3", {"role": "worker", "public_key": old_key.public_key().public_bytes_raw().hex()},
             cas=True)
    h.signing_keys["w3"] = old_key
    claim = h.command("w3", "workitem.claim", "wi1", {"session_epoch": 1}, cas=True)
    receipt = h.authority.accept(claim)
    head = len(h.events())
    assert h.authority.accept(claim) == receipt
    h.accept("owner", "membership.change", "w3", {"public_key": new_key.public_key().public_bytes_raw().hex()}, cas=True)
    head += 1
    assert h.authority.accept(claim) == receipt and len(h.events()) == head
    renamed = msgspec.structs.replace(claim, action_id="another", signature=None)
    renamed = msgspec.structs.replace(renamed, signature=old_key.sign(command_bytes(renamed)))
    h.reject_command(SignatureInvalid, renamed)
    assert h.lease("wi1")["agent"] == "w3" and h.item("wi1")["ownership_epoch"] == 1
    h.close()


def test_durable_accept_many_mixes_claims_evidence_and_rejections(tmp_path: Path) -> None:
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    old = h.claim_and_start("w1", "wi1")
    h.accept("owner", "workitem.reassign", "wi1", {})
    results = h.authority.accept_many(
        [
            h.command("w2", "workitem.claim", "wi2", {"session_epoch": 1}, cas=True),
            h.command("w1", "workitem.checkpoint", "wi1", {**fence_of(old), "checkpoint": 1}),
            h.command("w1", "workitem.claim", "wi2", {"session_epoch": 1}, revision=1),
        ]
    )
    assert [result.ok for result in results] == [True, True, False]
    assert results[0].unwrap().authoritative and not results[1].unwrap().authoritative
    assert results[2].error_code == "REVISION_MISMATCH"
    assert h.lease("wi2")["agent"] == "w2"
    h.close()


def test_durable_lease_sweep_uses_the_injected_clock(tmp_path: Path) -> None:
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1", "wi2"))
    h.claim("w1", "wi1")
    h.claim_and_start("w2", "wi2")
    assert h.authority.expire_leases(GROUP) == []
    h.advance(CONTRACT["start_ms"])
    assert [receipt.aggregate for receipt in h.authority.expire_leases(GROUP)] == ["workitem:wi1"]
    h.advance(CONTRACT["lease_ms"])
    assert [receipt.aggregate for receipt in h.authority.expire_leases(GROUP)] == ["workitem:wi2"]
    assert h.authority.expire_leases(GROUP) == []
    assert h.member("w1")["leases"] == [] and h.member("w2")["leases"] == []
    h.reject(InvalidState, ENGINE_ACTOR, "lease.expire", "wi1", {})
    h.close()


# -- The stateful machine on the Authority ------------------------------------------------------------


class DurableWorkModelMachine(WorkModelMachine):
    def make_harness(self) -> Harness:
        self.directory = tempfile.mkdtemp(prefix="mwp-work-model-")
        return DurableHarness(self.directory)

    @rule()
    def sweep(self) -> None:
        """The engine's own sweep, on a handle that keeps its leased WorkItems across commits,
        rebuilds and reopens: it expires exactly the leases the model says have lapsed."""
        harness = self.h
        assert isinstance(harness, DurableHarness)
        expected = self.model.sweep()
        receipts = harness.authority.expire_leases(GROUP)
        assert [receipt.aggregate for receipt in receipts] == [f"workitem:{wi}" for wi in expected]
        assert all(receipt.kind == "lease.expire" and receipt.authoritative for receipt in receipts)

    def check_rebuild(self) -> None:
        super().check_rebuild()
        harness = self.h
        assert isinstance(harness, DurableHarness)
        before = harness.states()
        harness.authority.rebuild()
        assert harness.states() == before
        harness.reopen()
        assert harness.states() == before

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


DurableWorkModelMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDurableWorkModelMachine = DurableWorkModelMachine.TestCase


def test_lease_sweeps_keep_a_watch_only_for_groups_with_workitems(tmp_path: Path) -> None:
    """A long-lived handle swept many Group names: none without a WorkItem, nor an archived one,
    keeps an entry in the watches (one per name ever swept piled up for the handle's life)."""
    h = DurableHarness(tmp_path / "store")
    h.setup(workitems=("wi1",))
    for number in range(300):
        assert h.authority.expire_leases(f"g-never-{number}") == []
    h.authority.accept(group_create("g-empty"))
    assert h.authority.expire_leases("g-empty") == []
    assert set(h.authority._lease_watches) == set()
    h.claim("w1", "wi1")
    assert h.authority.expire_leases(GROUP) == []
    assert set(h.authority._lease_watches) == {GROUP}  # a Group with WorkItems keeps its watch
    h.advance(CONTRACT["start_ms"])
    assert [receipt.aggregate for receipt in h.authority.expire_leases(GROUP)] == ["workitem:wi1"]
    h.authority.archive(GROUP, actor="owner", action_id="archive-1")
    assert h.authority._lease_watches == {}
    h.close()
