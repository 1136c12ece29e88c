"""kill -9 under concurrent accepts: nothing acknowledged is lost, nothing partial is visible.

The default run kills the child ``MWPSTORE_KILLS`` times (50). The long run, documented in
``docs/reliability.md``: ``MWPSTORE_KILLS=2000 python -m pytest tests/test_authority_crash.py``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

from authority_helpers import GROUP
from mwpstore import Authority

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "authority_child.py")
FAILPOINTS = ["authority.after_log_sync", "authority.before_log_append", "authority.after_index_commit", "authority.mid_redo"]


def _kill_once(path: str, run: int, rng: random.Random, child: str | None = None) -> list[tuple[str, int, str]]:
    """Run the child until it has started working (its first line), let it work a random while,
    SIGKILL it, and return what it acknowledged (complete ``OK`` lines only)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO)
    if rng.random() < 0.3:
        env["MWPSTORE_FAILPOINT"] = f"{rng.choice(FAILPOINTS)}:{rng.randrange(1, 40)}"
    process = subprocess.Popen(
        [sys.executable, child or CHILD, path, f"r{run}", "8"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    started = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            started.set()
        started.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    started.wait(timeout=60)  # imports and open can be slow on a loaded machine: start the clock at work
    time.sleep(rng.uniform(0.05, 0.6))
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    reader.join(timeout=60)
    err = process.stderr.read() if process.stderr else ""
    assert process.returncode == -signal.SIGKILL, err[-2000:]
    acknowledged = []
    for line in lines:
        parts = line.split()
        if line.endswith("\n") and len(parts) == 4 and parts[0] == "OK":  # a torn last line was never complete
            acknowledged.append((parts[1], int(parts[2]), parts[3]))
    return acknowledged


def test_kill_9_during_concurrent_accepts_loses_nothing_acknowledged(tmp_path):
    kills = int(os.environ.get("MWPSTORE_KILLS", "50"))
    seed = int(os.environ.get("MWPSTORE_SEED", "1234"))
    rng = random.Random(seed)
    path = str(tmp_path / "store")
    acknowledged: dict[str, tuple[int, str]] = {}
    for run in range(kills):
        for action, seq, event_id in _kill_once(path, run, rng):
            acknowledged[action] = (seq, event_id)
        with Authority.open(path) as authority:
            head, _ = authority.head(GROUP)
            events = []
            after = 0
            while True:
                batch = authority.read(GROUP, after=after, limit=10_000)
                if not batch:
                    break
                events.extend(batch)
                after = batch[-1].seq
            assert [event.seq for event in events] == list(range(1, head + 1)), "sequences are contiguous"
            by_action = {event.action_id: event for event in events}
            for action, (seq, event_id) in acknowledged.items():
                event = by_action.get(action)
                assert event is not None, f"acknowledged {action} lost after kill {run}"
                assert (event.seq, event.event_id) == (seq, event_id)
            if run % 10 == 0 or run == kills - 1:
                report = authority.verify()
                assert report.ok, report.problems
            else:  # the cheaper check: every Event's effects are in the index
                for event in events[-50:]:
                    for effect in event.effects:
                        revision, _ = authority.state(GROUP, effect.aggregate)
                        assert revision >= effect.revision
    assert len(acknowledged) > kills  # the children did real work between kills
