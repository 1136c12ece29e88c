# Types of the C extension built from csrc/index_records.c (used by mwpstore/authority.py and mwpstore/_sealed.py).

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
