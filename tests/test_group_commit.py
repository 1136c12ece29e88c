"""The group-commit leader and its waiting callers: batches, wake-ups, withdrawals, failures
that answer every caller of a batch, accept_many's result per Command, subscribe and ACK.

Interleavings are forced through the fail point before the log append (a commit is held there,
or interrupted there) while other callers queue behind it, never by sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from authority_helpers import GROUP, mission_create, open_with_group
from mwpstore import failpoints


class AppendGate:
    """Scripts the commits that reach ``authority.before_log_append``, one step per commit in
    order: ``"hold"`` (stop there until :meth:`release`), ``"interrupt"`` (raise
    KeyboardInterrupt there, before anything reaches the log) or ``"pass"``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *steps: str) -> None:
        self.steps = list(steps)
        self.held = threading.Event()
        self._go = threading.Event()
        original = failpoints.hit

        def hit(name: str) -> None:
            if name == "authority.before_log_append" and self.steps:
                step = self.steps.pop(0)
                if step == "hold":
                    self.held.set()
                    assert self._go.wait(30)
                elif step == "interrupt":
                    raise KeyboardInterrupt
            original(name)

        monkeypatch.setattr(failpoints, "hit", hit)

    def release(self) -> None:
        self._go.set()


class Caller:
    """A call run in its own thread; ``outcome()`` is what it returned or raised."""

    def __init__(self, call: Callable[[], object]) -> None:
        self._outcome: list[object] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self._outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self._outcome.append(exc)

    def outcome(self) -> object:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the caller was never woken"
        return self._outcome[0]


def wait_for_queue(authority, length: int) -> None:
    """Until ``length`` units wait behind the running commit (polled: no sleep decides anything)."""
    for _ in range(3000):
        if len(authority._queue) == length:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"the commit queue never reached {length}")


def held_leader(monkeypatch, authority, *steps: str) -> tuple[AppendGate, Caller]:
    """A first commit (mission m-lead) held before its log append; ``steps`` script the commits after it."""
    gate = AppendGate(monkeypatch, "hold", *steps)
    leader = Caller(lambda: authority.accept(mission_create("m-lead")))
    assert gate.held.wait(30)
    return gate, leader


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
