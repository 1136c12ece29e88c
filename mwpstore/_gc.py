"""Pausing the cyclic garbage collector around bulk decoding.

Decoding thousands of Events allocates many small containers; each allocation burst triggers the
collector's youngest generation again and again, although none of these objects form cycles.
Pausing it for the duration of one bulk operation removes that cost (measured: a decoded read
goes from ~25 µs to ~5 µs per Event). The collector is resumed afterwards, and only if it was
enabled before: an application that disabled it keeps it disabled.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
