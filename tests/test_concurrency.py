"""Many threads mixing accept, read, subscribe, ack, snapshot, verify, compaction and AgentStore
delivery, under a watchdog: no deadlock, no wrong result (``mwpstore torture --suite concurrency``).

"""

from __future__ import annotations

import os
import threading

import pytest

from mwpstore import torture
from mwpstore.authority import Authority



def test_concurrency_short_run_without_compaction():
    result = torture.run_concurrency(count=2, seed=1, skip=("compactor",))
    assert result["iterations"] == 2
    assert result["violations"] == 0, "\n".join(result["details"]["violation_messages"][:3])
    operations = result["details"]["operations"]
    for name in ("accepted", "read", "subscribe_events", "ack", "snapshot", "verify", "delivered", "same_action"):
        assert operations.get(name, 0) > 0, name


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
    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 0.3)
    release = threading.Event()
    original = Authority.verify

    def stuck_verify(self, *arguments, **options):
        release.wait(30)
        return original(self, *arguments, **options)

    monkeypatch.setattr(Authority, "verify", stuck_verify)
    try:
        result = torture.run_concurrency(count=1, seed=3, skip=("compactor",))
    finally:
        release.set()
    assert result["violations"] >= 1
    assert "deadlock" in result["details"]["violation_messages"][0]
    assert "stuck_verify" in result["details"]["violation_messages"][0]


def test_skip_from_the_environment(monkeypatch):
    monkeypatch.setenv("MWPSTORE_CONCURRENCY_SKIP", "compactor,verifier,snapshotter,agent")
    monkeypatch.setattr(torture, "CONCURRENCY_ROUND_SECONDS", 1.0)
    result = torture.run_concurrency(count=1, seed=4)
    assert result["violations"] == 0
    assert {"compactor", "verifier"} <= set(result["details"]["skipped"])
    assert "compact" not in result["details"]["operations"]
    assert os.environ["MWPSTORE_CONCURRENCY_SKIP"]
