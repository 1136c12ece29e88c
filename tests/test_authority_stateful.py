"""A stateful test of accept / duplicate / collision / reopen / rebuild against a model."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from authority_helpers import GROUP, mission_create, mission_update, open_with_group
from mwpstore import ActionIdCollision, Authority, RevisionMismatch
from mwpstore.errors import AlreadyExists, NotFound
from mwpstore.messages import encode_receipt

MISSIONS = ["m-a", "m-b", "m-c"]


class AcceptMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="mwp-stateful-")
        self.authority = open_with_group(self.directory)
        self.head = 1
        self.missions: dict[str, tuple[int, str]] = {}
        self.sent: dict[str, tuple[object, bytes]] = {}  # action -> (command, receipt bytes)
        self.counter = 0

    def _action(self) -> str:
        self.counter += 1
        return f"act-{self.counter}"

    @rule(mission=st.sampled_from(MISSIONS))
    def create(self, mission: str) -> None:
        command = mission_create(mission, action_id=self._action())
        if mission in self.missions:
            try:
                self.authority.accept(command)
                raise AssertionError("creating an existing mission must be refused")
            except AlreadyExists:
                return
        receipt = self.authority.accept(command)
        self.head += 1
        assert receipt.seq == self.head
        self.missions[mission] = (1, f"mission {mission}")
        self.sent[command.action_id] = (command, encode_receipt(receipt))

    @rule(mission=st.sampled_from(MISSIONS), stale=st.booleans(), title=st.text(min_size=1, max_size=5))
    def update(self, mission: str, stale: bool, title: str) -> None:
        revision = self.missions.get(mission, (0, ""))[0]
        command = mission_update(mission, revision + 1 if stale else revision, title, action_id=self._action())
        try:
            receipt = self.authority.accept(command)
        except RevisionMismatch as exc:
            assert stale and exc.current_revision == revision
            return
        except NotFound:
            assert mission not in self.missions
            return
        assert not stale and mission in self.missions
        self.head += 1
        self.missions[mission] = (revision + 1, title)
        self.sent[command.action_id] = (command, encode_receipt(receipt))

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def replay(self, data) -> None:
        action = data.draw(st.sampled_from(sorted(self.sent)))
        command, receipt = self.sent[action]
        assert encode_receipt(self.authority.accept(command)) == receipt

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def collide(self, data) -> None:
        action = data.draw(st.sampled_from(sorted(self.sent)))
        try:
            self.authority.accept(mission_create("m-other", action_id=action))
            raise AssertionError("different content under a used Action ID must collide")
        except ActionIdCollision:
            pass

    @rule()
    def reopen(self) -> None:
        self.authority.close()
        self.authority = Authority.open(self.directory)

    @rule()
    def rebuild(self) -> None:
        self.authority.rebuild()

    @invariant()
    def matches_model(self) -> None:
        assert self.authority.head(GROUP)[0] == self.head
        for mission in MISSIONS:
            revision, state = self.authority.state(GROUP, f"mission:{mission}")
            if mission in self.missions:
                assert (revision, state["title"]) == self.missions[mission]
            else:
                assert state is None

    def teardown(self) -> None:
        self.authority.close()
        shutil.rmtree(self.directory, ignore_errors=True)


AcceptMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestAcceptMachine = AcceptMachine.TestCase
