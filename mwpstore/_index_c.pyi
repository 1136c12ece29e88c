# Types of the C extension built from csrc/index_records.c (used by mwpstore/authority.py, mwpstore/_sealed.py and
# mwpstore/agent_store.py).

from collections.abc import Callable
from typing import Any

ID_CHARS_MAX: int

def index_events(
    records: list[bytes],
    positions: list[int],
    start: int,
    heads: dict[str, tuple[int, bytes]],
    writes: tuple[dict[bytes, list[tuple[bytes, bytes]]], dict[bytes, list[bytes]]],
    seeds: tuple[int, int, int],
    /,
) -> tuple[int, int]: ...

def unseal(stored: bytes | memoryview, key: bytes | memoryview, seed: int, size_max: int, /) -> bytes | None: ...
def seal(key: bytes | memoryview, value: bytes | memoryview, seed: int, /) -> bytes: ...
def seal_items(items: list[tuple[bytes, bytes]], seed: int, /) -> list[tuple[bytes, bytes]]: ...
def seal_sorted(writes: dict[bytes, Any], seed: int, encode: Callable[[Any], bytes] | None = None, /) -> list[tuple[bytes, bytes]]: ...
