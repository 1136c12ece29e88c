"""Running a call that must not block (not a test module)."""

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
