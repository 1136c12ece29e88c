# Types of the C extension built from csrc/canonical_check.c (see mwpstore/canonical.py).

from typing import Any

BODY_DEPTH_MAX: int
BODY_ITEMS_MAX: int
STRING_BYTES_MAX: int
ID_CHARS_MAX: int
KIND_CHARS_MAX: int
INT_ABS_MAX: int

def content_ok(value: object, /) -> bool: ...
def id_ok(value: object, /) -> bool: ...
def kind_ok(value: object, /) -> bool: ...
def rows_check(rows: list[Any], by_attribute: bool, /) -> int: ...
