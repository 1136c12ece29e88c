"""A small driver for work-model tests: one MemoryGroup, a settable clock, and helpers that check
that a rejection changed nothing."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from mwpstore.errors import MwpError
from mwpstore.messages import Command, Event, command_bytes
from mwpstore.registry import ENGINE_ACTOR, MemoryGroup, aggregate_key, kind_spec

GROUP = "g1"
START_MS = 1_000_000

CONTRACT: dict[str, Any] = {
    "max_attempts": 3,
    "backoff_initial_ms": 100,
    "backoff_multiplier": 2,
    "backoff_max_ms": 1_000,
    "cost_limit": 50,
    "deadline_ms": None,
    "lease_ms": 1_000,
    "start_ms": 200,
}


class Harness:
    """Drives one Group through ``MemoryGroup.accept`` with an explicit clock.

    The backend-specific part is small (``accept_command``, ``get``, ``revision``, ``states``,
    ``events``), so ``tests/test_work_model_durable.py`` runs the same rule tests through the
    durable Authority by overriding it.
    """

    def __init__(self, group: str = GROUP, now_ms: int = START_MS) -> None:
        self.group_id = group
        self.group = MemoryGroup(group)
        self.now_ms = now_ms
        self._actions = 0
        self.signing_keys: dict[str, Any] = {}

    # -- backend -------------------------------------------------------------------------------

    def accept_command(self, command: Command) -> Event:
        return self.group.accept(command, now_ms=self.now_ms, trusted=command.actor == ENGINE_ACTOR)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.group.get(key)

    def revision(self, key: str) -> int:
        return self.group.revision(key)

    def states(self) -> tuple[dict[str, Any], dict[str, int]]:
        """Copies of every aggregate's state and revision."""
        return copy.deepcopy(self.group.states), dict(self.group.revisions)

    def events(self) -> list[Event]:
        return list(self.group.events)

    def close(self) -> None:
        pass

    # -- Commands ------------------------------------------------------------------------------

    def key_of(self, kind: str, target: str) -> str:
        return aggregate_key(kind_spec(kind).aggregate_type, target)

    def command(
        self,
        actor: str,
        kind: str,
        target: str,
        body: dict[str, Any] | None = None,
        *,
        revision: int | None = None,
        cas: bool = False,
    ) -> Command:
        self._actions += 1
        if cas:
            revision = self.revision(self.key_of(kind, target))
        command = Command(
            actor=actor,
            action_id=f"act-{self._actions}",
            group=self.group_id,
            kind=kind,
            target=target,
            body=body or {},
            expected_revision=revision,
        )
        private_key = self.signing_keys.get(actor)
        if private_key is not None:
            command = msgspec.structs.replace(command, signature=private_key.sign(command_bytes(command)))
        return command

    def accept(
        self,
        actor: str,
        kind: str,
        target: str,
        body: dict[str, Any] | None = None,
        *,
        revision: int | None = None,
        cas: bool = False,
    ) -> Event:
        return self.accept_command(self.command(actor, kind, target, body, revision=revision, cas=cas))

    def reject(self, error: type[MwpError], actor: str, kind: str, target: str, body: dict[str, Any] | None = None, *,
               revision: int | None = None, cas: bool = False, field: str | None = None) -> MwpError:
        """Assert the Command is rejected with ``error`` and that nothing changed."""
        command = self.command(actor, kind, target, body, revision=revision, cas=cas)
        return self.reject_command(error, command, field=field)

    def reject_command(self, error: type[MwpError], command: Command, *, field: str | None = None) -> MwpError:
        before = self.snapshot()
        with pytest.raises(error) as caught:
            self.accept_command(command)
        assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
        assert self.snapshot() == before, "a rejection changed state"
        if field is not None:
            assert caught.value.detail.get("field") == field, caught.value.detail
        return caught.value

    def evidence(self, actor: str, kind: str, target: str, body: dict[str, Any], reason: str | None = None) -> Event:
        """Assert the Command is kept as Evidence: own Event, not authoritative, no state change."""
        before = self.states()
        event = self.accept(actor, kind, target, body)
        assert event.authoritative is False
        assert event.effects == []
        assert self.states() == before
        assert event.body is not None and "evidence" in event.body
        if reason is not None:
            assert event.body["evidence"]["reason"] == reason
        return event

    def snapshot(self) -> tuple[Any, ...]:
        return self.states(), len(self.events())

    # -- State ---------------------------------------------------------------------------------

    def item(self, workitem: str) -> dict[str, Any]:
        state = self.get(f"workitem:{workitem}")
        assert state is not None
        return state

    def member(self, agent: str) -> dict[str, Any]:
        state = self.get(f"member:{agent}")
        assert state is not None
        return state

    def mission(self, mission: str = "m1") -> dict[str, Any]:
        state = self.get(f"mission:{mission}")
        assert state is not None
        return state

    def lease(self, workitem: str) -> dict[str, Any]:
        lease = self.item(workitem)["lease"]
        assert lease is not None
        return lease

    def fence(self, workitem: str) -> dict[str, Any]:
        """The body fields naming the WorkItem's current lease."""
        lease = self.lease(workitem)
        return {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}

    # -- Setup ---------------------------------------------------------------------------------

    def setup(
        self,
        *,
        workers: tuple[str, ...] = ("w1", "w2"),
        mission_cost_limit: int = 1_000,
        approval_required: tuple[str, ...] = (),
        workitems: tuple[str, ...] = ("wi1",),
        contract: dict[str, Any] | None = None,
    ) -> Harness:
        self.accept("owner", "group.create", self.group_id, {"org": "org1"})
        for worker in workers:
            self.accept("owner", "membership.add", worker, {"role": "worker"}, cas=True)
        self.accept("owner", "membership.add", "a1", {"role": "approver"}, cas=True)
        self.accept("owner", "membership.add", "o1", {"role": "observer"}, cas=True)
        self.accept(
            "owner",
            "mission.create",
            "m1",
            {"title": "mission one", "cost_limit": mission_cost_limit, "approval_required": list(approval_required)},
        )
        for workitem in workitems:
            self.create_workitem(workitem, contract=contract)
        return self

    def create_workitem(self, workitem: str, *, contract: dict[str, Any] | None = None, priority: int = 0) -> Event:
        body = {"mission": "m1", "priority": priority, "contract": dict(contract or CONTRACT)}
        return self.accept("owner", "workitem.create", workitem, body)

    def claim(self, agent: str, workitem: str) -> dict[str, Any]:
        session_epoch = self.member(agent)["session_epoch"]
        event = self.accept(agent, "workitem.claim", workitem, {"session_epoch": session_epoch}, cas=True)
        assert event.authoritative
        return self.lease(workitem)

    def start(self, agent: str, workitem: str) -> Event:
        return self.accept(agent, "workitem.start", workitem, self.fence(workitem))

    def claim_and_start(self, agent: str, workitem: str) -> dict[str, Any]:
        self.claim(agent, workitem)
        self.start(agent, workitem)
        return self.lease(workitem)

    def advance(self, milliseconds: int) -> None:
        self.now_ms += milliseconds

    def workitem_states(self) -> list[tuple[str, dict[str, Any]]]:
        states, _ = self.states()
        return [(key.split(":", 1)[1], state) for key, state in sorted(states.items()) if key.startswith("workitem:")]


def fence_of(lease: dict[str, Any]) -> dict[str, Any]:
    return {"lease_id": lease["lease_id"], "ownership_epoch": lease["ownership_epoch"]}
