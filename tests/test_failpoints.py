"""``mwpstore.failpoints``: named points where a crash test's child kills itself."""

from __future__ import annotations

import os
import subprocess
import sys

_FORKED_WHILE_ANOTHER_THREAD_COUNTS_A_HIT = r"""
import os, signal, threading
from mwpstore import failpoints

counting, release = threading.Event(), threading.Event()


def holder():  # another thread inside hit(), counting a hit of the armed point
    with failpoints._LOCK:
        counting.set()
        release.wait(10)


threading.Thread(target=holder).start()
counting.wait(10)
pid = os.fork()
if pid == 0:
    signal.alarm(5)  # a child that waits for the lock of a thread it does not have: ended here
    failpoints.hit("test.point")  # the first hit of 3: counted, not fired
    print("counted", flush=True)
    os._exit(0)
release.set()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_child_forked_while_another_thread_counts_a_hit_counts_its_own():
    """The count of an armed fail point's hits is kept under a lock. A child forked while another
    thread held it (counting a hit) kept it held by a thread it does not have, and its own next
    hit of the point waited forever (ended by an alarm: exit status -14). The child makes it anew."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_WHILE_ANOTHER_THREAD_COUNTS_A_HIT],
        capture_output=True, text=True, timeout=60, env={**os.environ, "MWPSTORE_FAILPOINT": "test.point:3"},
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "counted\n0\n", "")
