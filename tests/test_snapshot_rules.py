"""Rules of an authority's snapshots that the snapshot format alone does not show: which snapshot a
Cursor behind the replay floor is sent to, and where the floor stands when there are several."""

from __future__ import annotations

from authority_helpers import GROUP, OWNER, mission_create
from mwpstore import Authority, Command


def test_the_floor_is_the_newest_eligible_snapshot_and_the_reference_the_newest_of_all(tmp_path):
    """With a replay window W the floor is the newest snapshot at most head - W; the reference a
    CURSOR_TOO_OLD offers is the newest snapshot, eligible or not (restoring it lands past the
    floor)."""
    with Authority.open(str(tmp_path / "store")) as authority:
        policy = {"org": "acme", "policy": {"replay_window_events": 2}}
        authority.accept(Command(actor=OWNER, action_id="g", group=GROUP, kind="group.create", target=GROUP, body=policy))
        authority.accept_many([mission_create(f"m-{i}") for i in range(2)])
        older = authority.snapshot(GROUP)
        authority.accept_many([mission_create(f"n-{i}") for i in range(3)])
        newer = authority.snapshot(GROUP)
        assert (older.seq, newer.seq) == (3, 6)
        authority.accept(mission_create("o-0"))
        assert authority.replay_floor(GROUP) == (3, newer)  # only the older one is at most 7 - 2
        authority.accept(mission_create("o-1"))
        assert authority.replay_floor(GROUP) == (6, newer)  # both are: the newer one is the floor
