"""Which side of a ``fork()`` a handle is on: store handles do not cross it.

A child forked from a process that holds an authority (a pre-fork server, multiprocessing's fork
start method) inherits the handle: its log append would land at the end the parent also writes
to next, its close would mark the index clean and write the log's clean marker under the running
parent. ``generation`` counts the forks this process descends from; a handle remembers it at open
and refuses every call (``StoreClosed``) where it differs. Comparing an int costs nothing on the
read path, where ``os.getpid()`` would be a system call.
"""

from __future__ import annotations

import os
from typing import Any

generation = 0


def wait_for(lock: Any) -> None:
    """``lock.acquire()`` for a ``before`` fork hook, not cut short by a ``KeyboardInterrupt``.
    The interpreter prints an exception raised in a fork hook and forks all the same:
    interrupted while it waited for another thread's loading of the kinds (or pause of the
    collector), the hook let the fork go on without the lock, so the child kept it held by a
    thread it does not have (its first ``kind_spec`` waited forever) and the parent's hook failed
    to release it. The wait goes on, and the interrupt is raised once the lock is held, for the
    interpreter to print as before: an exception in a fork hook reaches no caller.

    ``lock`` is an ``RLock``; whether this call took it is its count for this thread, since the
    interrupt can also come just after ``acquire`` returned (where Python next checks for
    signals), and a second ``acquire`` would keep it held after the fork."""
    held = None
    interrupt = None
    while True:
        try:
            if held is None:
                held = lock._recursion_count()
            while lock._recursion_count() == held:
                lock.acquire()
            break
        except KeyboardInterrupt as exc:
            interrupt = exc
    if interrupt is not None:
        raise interrupt


def _after_fork_in_child() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)

FORKED_MESSAGE = (
    "this handle was opened in the parent of this process and does not cross fork(); "
    "open the store in the process that uses it"
)
