"""Running a call that must not block or in a thread of its own, and waiting for an authority's commit queue (not a test module)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def outcome_within(seconds: float, action: Callable[[], object]) -> object:
    """``action()``'s result or the exception it raised, run in a daemon thread; fails the test if
    it is still running after ``seconds`` (it blocked, e.g. opening a FIFO for reading)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(action())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "it blocked"
    return outcome[0]


def wait_for_queue(authority: object, length: int) -> None:
    """Until ``length`` units wait behind the running commit of ``authority`` (polled: no sleep
    decides anything); fails the test if the queue never gets there."""
    for _ in range(3000):
        if len(authority._queue) == length:  # type: ignore[attr-defined]
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"the commit queue never reached {length}")


class Caller:
    """A call run in its own thread; ``outcome()`` is what it returned or raised."""

    def __init__(self, call: Callable[[], object], name: str | None = None) -> None:
        self._outcome: list[object] = []
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
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
