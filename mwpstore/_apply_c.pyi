# Types of the C extension built from csrc/agent_apply.c (used by mwpstore/agent_store.py).

from collections.abc import Callable
from typing import Any

def run(
    events: list[Any],
    start: int,
    context: tuple[type, type, set[str], int, Callable[[object], bool], Callable[[object], bool], Callable[[Any], tuple[Any, ...]]],
    group: str,
    prefix: bytes,
    next_seq: int,
    prev_hash: bytes,
    inbox_writes: dict[bytes, bytes],
    state_writes: dict[bytes, tuple[int, dict[str, Any] | None]],
    writes_max: int,
    /,
) -> int: ...

def check_run(
    events: list[Any],
    start: int,
    context: tuple[Any, ...],
    group: str,
    next_seq: int,
    prev_hash: bytes,
    /,
) -> int: ...

def msgpack_size(value: object, /) -> int | None: ...
