"""The Commands every subject of the benchmarks accepts: one Group, then Missions in it.

The same generators feed mwpstore and its peers, so each subject does the same work on the same
bytes. ``group.create`` makes the actor ``owner`` the Group's owner; ``mission.create`` with
distinct targets is always accepted; ``mission.update`` with ``expected_revision`` exercises the
revision check.
"""

from __future__ import annotations

from collections.abc import Iterator

import harness  # noqa: F401  (puts the checkout on sys.path)
from mwpstore.messages import Command

OWNER = "owner"
ORG = "acme"


def group_create(group: str) -> Command:
    return Command(
        actor=OWNER, action_id=f"{group}.create", group=group, kind="group.create", target=group, body={"org": ORG}
    )


def mission_create(group: str, index: int, *, prefix: str = "m") -> Command:
    return Command(
        actor=OWNER,
        action_id=f"{prefix}{index}.create",
        group=group,
        kind="mission.create",
        target=f"{prefix}{index}",
        body={"title": "t", "cost_limit": 100},
    )


def mission_creates(group: str, count: int, *, start: int = 0, prefix: str = "m") -> list[Command]:
    return [mission_create(group, index, prefix=prefix) for index in range(start, start + count)]


def mission_update(group: str, index: int, revision: int, *, prefix: str = "m") -> Command:
    """Raise Mission ``index`` from ``revision`` to ``revision + 1`` (compare-and-set)."""
    return Command(
        actor=OWNER,
        action_id=f"{prefix}{index}.update{revision}",
        group=group,
        kind="mission.update",
        target=f"{prefix}{index}",
        body={"cost_limit": 100 + revision},
        expected_revision=revision,
    )


def batches(commands: list[Command], size: int) -> Iterator[list[Command]]:
    for start in range(0, len(commands), size):
        yield commands[start : start + size]


def split(commands: list[Command], parts: int) -> list[list[Command]]:
    """Deal ``commands`` round-robin into ``parts`` lists (one per thread)."""
    return [commands[part::parts] for part in range(parts)]
