"""The ``eventsourcing`` peer: the library's Application and Aggregate on its SQLite persistence module.

Each ``mission.create`` Command becomes one ``Mission`` aggregate created and saved
(``Application.save``: one SQLite transaction, WAL; SQLite's default ``synchronous`` for WAL is
FULL in this build, which :meth:`EventsourcingPeer.settings` reads back from the library's own
connection). ``mission.update`` becomes get + command method + save, the library's optimistic
concurrency (aggregate version) standing in for the expected-revision check. Aggregate IDs are
version-5 UUIDs of (group, target), so updates find their aggregate without a lookup table.

The library has no idempotency receipts, Group sequences or hash chains: this peer does less work
than mwpstore, and the tables say so. Reads go through the application's notification log
(``select_notifications``) and its mapper (``to_domain_event``), i.e. decoded domain events.

This is a benchmark peer, not part of the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the checkout on sys.path)
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event
from mwpstore.messages import Command

DATABASE_NAME = "eventsourcing.sqlite3"
_NAMESPACE = uuid.UUID("6d2f1f43-5a3c-4a8e-9b8e-2f6f7d8c1a10")


def mission_id(group: str, target: str) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, f"{group}/{target}")


class Mission(Aggregate):
    """A Mission as an event-sourced aggregate: created, then updated."""

    @staticmethod
    def create_id(group: str, target: str, **_: Any) -> uuid.UUID:
        return mission_id(group, target)

    @event("Created")
    def __init__(self, group: str, target: str, title: str, cost_limit: int) -> None:
        self.group = group
        self.target = target
        self.title = title
        self.cost_limit = cost_limit

    @event("Updated")
    def update(self, cost_limit: int) -> None:
        self.cost_limit = cost_limit


class Missions(Application):
    """The application whose repository holds the Mission aggregates."""

    name = "Missions"


class RevisionConflict(Exception):
    """The aggregate's version is not the expected revision."""


class EventsourcingPeer:
    """Create-and-save and update-and-save of ``Mission`` aggregates through ``eventsourcing``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / DATABASE_NAME
        self.app = Missions(
            env={
                "PERSISTENCE_MODULE": "eventsourcing.sqlite",
                "SQLITE_DBNAME": str(self.path),
                "SQLITE_LOCK_TIMEOUT": "30",
                "ORIGINATOR_ID_TYPE": "uuid",
            }
        )

    @classmethod
    def open(cls, path: str | Path) -> EventsourcingPeer:
        return cls(path)

    def settings(self) -> dict[str, Any]:
        """The durability settings in force on the library's own SQLite connection."""
        datastore = self.app.factory.datastore  # type: ignore[attr-defined]
        with datastore.transaction(commit=False) as cursor:
            cursor.execute("PRAGMA journal_mode")
            journal_mode = cursor.fetchone()[0]
            cursor.execute("PRAGMA synchronous")
            synchronous = cursor.fetchone()[0]
        return {
            "persistence_module": "eventsourcing.sqlite",
            "journal_mode": journal_mode,
            "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[synchronous],
        }

    def close(self) -> None:
        self.app.close()

    def __enter__(self) -> EventsourcingPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes --------------------------------------------------------------------------------

    @staticmethod
    def _new_mission(command: Command) -> Mission:
        body = command.body
        return Mission(group=command.group, target=command.target, title=body["title"], cost_limit=body["cost_limit"])

    def create(self, command: Command) -> uuid.UUID:
        """A ``mission.create`` Command: create the aggregate and save it (one transaction)."""
        mission = self._new_mission(command)
        self.app.save(mission)
        return mission.id

    def create_many(self, commands: Sequence[Command]) -> list[uuid.UUID]:
        """Several ``mission.create`` Commands saved in one transaction."""
        missions = [self._new_mission(command) for command in commands]
        self.app.save(*missions)
        return [mission.id for mission in missions]

    def update(self, command: Command) -> int:
        """A ``mission.update`` Command: get, check the expected revision, update, save."""
        mission: Mission = self.app.repository.get(mission_id(command.group, command.target))
        if command.expected_revision is not None and mission.version != command.expected_revision:
            raise RevisionConflict(f"{command.target} is at version {mission.version}, not {command.expected_revision}")
        mission.update(cost_limit=command.body["cost_limit"])
        self.app.save(mission)
        return mission.version

    # -- reads ---------------------------------------------------------------------------------

    def get(self, group: str, target: str) -> Mission:
        return self.app.repository.get(mission_id(group, target))

    def read(self, after: int = 0, limit: int = 1000) -> list[Any]:
        """Domain events with notification ID > ``after``, decoded by the application's mapper."""
        notifications = self.app.recorder.select_notifications(start=after + 1, limit=limit)
        to_domain_event = self.app.mapper.to_domain_event
        return [to_domain_event(notification) for notification in notifications]

    def read_positions(self, after: int = 0, limit: int = 1000) -> tuple[list[Any], int]:
        """Like :meth:`read`, plus the last notification ID (the cursor for the next page)."""
        notifications = self.app.recorder.select_notifications(start=after + 1, limit=limit)
        to_domain_event = self.app.mapper.to_domain_event
        last = notifications[-1].id if notifications else after
        return [to_domain_event(notification) for notification in notifications], last
