"""``mwpstore._gc``: the cyclic collector paused around bulk decoding, and resumed."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_a_fork_with_no_pause_in_progress_leaves_the_collector_as_it_is():
    """The child hook enables the collector only when the parent had pauses in progress: after a
    pause that began with the collector enabled, an application that disabled it and forked (no
    pause in progress) has it disabled in the child too."""
    result = subprocess.run([sys.executable, "-c", _NO_PAUSE_AT_THE_FORK], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")


_NO_PAUSE_AT_THE_FORK = r"""
import gc, os
from mwpstore import _gc

with _gc.paused():
    pass
gc.disable()
pid = os.fork()
if pid == 0:
    print(gc.isenabled(), flush=True)
os._exit(0) if pid == 0 else os.waitpid(pid, 0)
"""


def test_a_child_forked_inside_its_own_nested_pauses_resumes_the_collector_when_the_outer_ends():
    """The child keeps the forking thread's own pauses: forked inside two nested ones, the
    collector stays paused in the child until the outer one ends there."""
    result = subprocess.run([sys.executable, "-c", _FORKED_INSIDE_NESTED_PAUSES], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "False False True\n", "")


_FORKED_INSIDE_NESTED_PAUSES = r"""
import gc, os
from mwpstore import _gc

seen = []
with _gc.paused():
    with _gc.paused():
        pid = os.fork()
        seen.append(gc.isenabled())
    seen.append(gc.isenabled())
seen.append(gc.isenabled())
if pid == 0:
    print(*seen, flush=True)
os._exit(0) if pid == 0 else os.waitpid(pid, 0)
"""


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


@pytest.mark.parametrize(("where", "expected"), [("entering", "True paused\nTrue\n"), ("leaving", "True paused\nTrue\n"), ("disabled by the application", "False paused\nFalse\n")])
def test_a_process_forked_while_another_thread_enters_or_leaves_a_pause_has_its_collector_enabled(where, expected):
    """A pause disables the collector, then counts itself under a lock; its end uncounts itself,
    then enables the collector. A fork from another thread between the two (the child hook looked
    only at the count) left the child a count of 0 with the collector disabled, and nothing in it
    would enable it again: ``False``. The fork now waits for the lock. A fresh interpreter whose
    pausing thread is held (``sys.settrace``) at that line until the fork begins (a fork hook of
    the script's own, which runs before mwpstore's, lets it go); the child, then the parent, say
    whether the collector is enabled, and a thread of the child pauses it too (a lock held at the
    fork would make it wait: ``hung`` after 10 s). An application that had disabled the collector
    before the pause keeps it disabled in both."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_INSIDE_THE_LOCK, where],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, expected, "")


_FORKED_INSIDE_THE_LOCK = r"""
import gc, inspect, os, sys, threading
from mwpstore import _gc

where = sys.argv[1]
function = _gc.paused.__exit__ if where == "leaving" else _gc.paused.__enter__
code = function.__code__
source, first = inspect.getsourcelines(function)
wanted = "if _depth == 0 and _was_enabled:" if where == "leaving" else "_depth += 1"
if where == "disabled by the application":
    gc.disable()
target = first + [line.strip() for line in source].index(wanted)
held, go = threading.Event(), threading.Event()

def trace(frame, event, arg):
    if frame.f_code is not code:
        return None
    def inside(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not held.is_set():
            held.set()
            go.wait(10)
        return inside
    return inside

def pausing():
    sys.settrace(trace)
    with _gc.paused():
        pass
    sys.settrace(None)

thread = threading.Thread(target=pausing)
thread.start()
held.wait(10)
os.register_at_fork(before=go.set)  # runs before mwpstore's own hooks: lets the thread on
pid = os.fork()
if pid == 0:
    done = []

    def pause():
        with _gc.paused():
            done.append(True)

    pauser = threading.Thread(target=pause, daemon=True)
    pauser.start()  # a thread of the child pauses too (the lock is not the parent's)
    pauser.join(10)
    print(gc.isenabled(), "paused" if done else "hung", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
thread.join()
print(gc.isenabled(), flush=True)
"""


_FORKED_AND_INTERRUPTED_WHILE_ANOTHER_THREAD_HOLDS_THE_PAUSES_LOCK = r"""
import os, signal, threading, time
from mwpstore import _gc

held, release = threading.Event(), threading.Event()


def holder():  # another thread between disabling the collector and counting its pause
    with _gc._lock:
        held.set()
        release.wait(10)


threading.Thread(target=holder).start()
held.wait(10)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while the main thread's fork waits
threading.Timer(1.0, release.set).start()
began = time.monotonic()
pid = os.fork()
if pid == 0:
    os._exit(0)
waited = time.monotonic() - began
os.waitpid(pid, 0)
taken = []
other = threading.Thread(target=lambda: taken.append(_gc._lock.acquire(timeout=5)))
other.start()
other.join()
print(waited >= 0.9, taken, flush=True)
"""


def test_a_fork_interrupted_while_it_waits_for_the_pauses_lock_still_waits_for_it():
    """The fork hook of finding 228 waits for the lock of the collector's pauses. A
    ``KeyboardInterrupt`` in the forking (main) thread while it waited ended the hook, and the
    interpreter, which only prints an exception raised in a fork hook, forked without the lock:
    the child could inherit a thread's pause half made (the collector disabled, no pause counted),
    and the parent's hook failed to release a lock it did not hold (a ``RuntimeError``, printed).
    The hook now waits on through the interrupt; the parent's lock is free after the fork."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED_AND_INTERRUPTED_WHILE_ANOTHER_THREAD_HOLDS_THE_PAUSES_LOCK],
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, "True [True]\n")
    assert "KeyboardInterrupt" in result.stderr and "RuntimeError" not in result.stderr
