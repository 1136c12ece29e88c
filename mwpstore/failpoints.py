"""Named fail points for crash tests.

Set ``MWPSTORE_FAILPOINT=<name>`` (optionally ``<name>:<n>`` to fire on the n-th hit) in a child
process and the process kills itself with SIGKILL when it reaches that point: no cleanup, no
flush, exactly like ``kill -9``. Unset, a fail point costs one dictionary lookup.

Names used by the engine:

- ``authority.before_log_append`` — a batch is decided, nothing written;
- ``authority.after_log_sync`` — the log group is durable, LMDB not yet committed (redo on open);
- ``authority.after_index_commit`` — both committed, callers not yet woken;
- ``authority.mid_redo`` — while redoing records at open (recovery itself crashes);
- ``authority.mid_rebuild`` — while rebuilding the index;
- ``keys.after_retire`` — a signing key rotation: the old public key retired, the new key not
  yet written;
- ``files.before_rename`` — ``write_file_atomic``: the temporary file written and synced, not yet
  renamed over the file (every atomic file write hits it: count the hits);
- ``agent.*`` — the AgentStore's apply cycle (see ``docs/agent-store.md``);
- ``lmdb.databases_created`` — a new index or AgentStore environment: its named databases made
  in one write transaction, not yet committed.
"""

from __future__ import annotations

import os
import signal
import threading

_SPEC = os.environ.get("MWPSTORE_FAILPOINT", "")
_NAME, _, _COUNT = _SPEC.partition(":")
_REMAINING = int(_COUNT) if _COUNT.isdigit() else 1
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork (counting a hit) is held for good in the child,
    which has no such thread: its next hit of the armed point would wait forever. Made anew."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def hit(name: str) -> None:
    """Kill this process with SIGKILL if ``name`` is the armed fail point (on its n-th hit)."""
    global _REMAINING
    if name != _NAME:
        return
    with _LOCK:
        _REMAINING -= 1
        if _REMAINING > 0:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def armed() -> str:
    return _NAME
