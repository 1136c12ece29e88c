"""Rules of an authority's snapshots that the snapshot format alone does not show: which snapshot a
Cursor behind the replay floor is sent to, and where the floor stands when there are several."""

from __future__ import annotations

from authority_helpers import GROUP, OWNER, mission_create, record_unseals
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


def test_the_floor_is_found_by_search_not_by_reading_every_snapshot_of_the_group(tmp_path, monkeypatch):
    """read() asks for the replay floor at every call: it looks up the two snapshots it needs
    instead of unsealing and decoding every snapshot the Group ever had (a read cost that grew
    with the Group's snapshots). Neighbours whose keys sort just before and after the Group's own
    (g-0, g-1x) must not be taken for its snapshots."""
    from mwpstore import index as index_module

    with Authority.open(str(tmp_path / "store"), sync=False) as authority:
        for group in ("g-0", GROUP, "g-1x", "g-2"):
            body = {"org": "acme", "policy": {"replay_window_events": 3}}
            authority.accept(Command(actor=OWNER, action_id=f"c-{group}", group=group, kind="group.create", target=group, body=body))
        assert authority.replay_floor(GROUP) == (0, None)
        for group in ("g-0", "g-1x"):  # neighbours only: GROUP has none yet
            for i in range(5):
                authority.accept(mission_create(f"m-{i}", group=group))
                authority.snapshot(group)
        assert authority.replay_floor(GROUP) == (0, None)
        refs = []
        for i in range(40):
            authority.accept(mission_create(f"m-{i}"))
            if i % 2:
                refs.append(authority.snapshot(GROUP))
        head = authority.head(GROUP)[0]
        assert authority.snapshots(GROUP) == refs
        assert authority.replay_floor(GROUP) == (max(ref.seq for ref in refs if ref.seq <= head - 3), refs[-1])

        unsealed = record_unseals(monkeypatch, index_module.Index, b"snapshots")
        assert [event.seq for event in authority.read(GROUP, after=head - 3)] == [head - 2, head - 1, head]
        assert len(unsealed) <= 4  # two searches, each checking the entry it lands on; before: all 20
        for extra in range(3):  # the floor moves with the head, one snapshot at a time
            authority.accept(mission_create(f"x-{extra}"))
            head += 1
            eligible = [ref.seq for ref in refs if ref.seq <= head - 3]
            assert authority.replay_floor(GROUP) == (max(eligible), refs[-1])
