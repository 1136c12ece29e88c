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

generation = 0


def _after_fork_in_child() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)

FORKED_MESSAGE = (
    "this handle was opened in the parent of this process and does not cross fork(); "
    "open the store in the process that uses it"
)
