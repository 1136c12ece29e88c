"""``mwpstore._gc``: the cyclic collector paused around bulk decoding, and resumed."""

from __future__ import annotations

import subprocess
import sys

_FORKED_DURING_A_READ = r"""
import gc, os, sys, threading
from mwpstore import Authority, Command
from mwpstore import authority as authority_module

inside, leave = threading.Event(), threading.Event()
decode_events = authority_module.decode_events


def held_decode(bodies):  # holds the reading thread inside the read's pause of the collector
    inside.set()
    leave.wait(10)
    return decode_events(bodies)


store = Authority.open(sys.argv[1])
store.accept(Command(actor="owner", action_id="c", group="g-1", kind="group.create", target="g-1", body={"org": "acme"}))
authority_module.decode_events = held_decode
reader = threading.Thread(target=lambda: store.read("g-1"))
reader.start()
inside.wait(10)
pid = os.fork()
if pid == 0:
    print(gc.isenabled(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
leave.set()
reader.join()
store.close()
print(gc.isenabled())
"""


def test_a_process_forked_during_another_threads_read_has_its_collector_enabled(tmp_path):
    """Reads and commits pause the cyclic collector and count the pauses in progress; the last
    to end resumes it. A process forked while another thread read inherited the count, with
    the collector disabled, and none of its threads would end that pause: the child ran without
    the cyclic collector for its whole life, its own reads and commits included. Now the
    child keeps only its own thread's pauses, and with none the collector runs. A fresh
    interpreter whose reading thread is held inside the read's decoding while the main thread
    forks; the child says whether its collector is enabled."""
    result = subprocess.run(
        # (-W: Python 3.12 and later warn of a fork in a process with threads.)
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_DURING_A_READ, str(tmp_path / "s")],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "True\nTrue\n", "")


def test_the_collector_stays_as_the_application_left_it():
    """A pause resumes the collector only if it was enabled; a fork with no pause in progress
    leaves it as it is (an application that disabled it after a pause keeps it disabled)."""
    result = subprocess.run(
        [sys.executable, "-c", _DISABLED_BY_THE_APPLICATION], capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "False False\n", "")


_DISABLED_BY_THE_APPLICATION = r"""
import gc, os
from mwpstore import _gc

with _gc.paused():
    pass
gc.disable()
with _gc.paused():
    pass
after_pause = gc.isenabled()
pid = os.fork()
if pid == 0:
    print(after_pause, gc.isenabled(), flush=True)
os._exit(0) if pid == 0 else os.waitpid(pid, 0)
"""
