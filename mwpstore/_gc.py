"""Pausing the cyclic garbage collector around bulk decoding.

Decoding thousands of Events allocates many small containers; each allocation burst triggers the
collector's youngest generation again and again, although none of these objects form cycles.
Pausing it for the duration of one bulk operation removes that cost (measured: a decoded read
goes from ~25 µs to ~5 µs per Event). The collector is resumed afterwards, and only if it was
enabled before: an application that disabled it keeps it disabled.

A process forked while other threads are inside a pause has none of them: its count is its own
thread's pauses alone, and with none the collector is resumed in it (if it was enabled before).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_this_thread = threading.local()  # .depth: the pauses the calling thread is inside


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
        _this_thread.depth = getattr(_this_thread, "depth", 0) + 1
    try:
        yield
    finally:
        with _lock:
            _this_thread.depth -= 1
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    """The child has only the thread that forked: the other threads' pauses never end in it, and
    the lock may have been held by one of them."""
    global _lock, _depth
    _lock = threading.Lock()
    inherited, _depth = _depth, getattr(_this_thread, "depth", 0)
    if inherited and not _depth and _was_enabled:
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)
