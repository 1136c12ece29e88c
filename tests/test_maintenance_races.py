"""Maintenance operations racing each other and accepts: each test forces one interleaving with
``threading.Event`` barriers in monkeypatched hooks (no sleep decides anything)."""

from __future__ import annotations

import os
import threading

import pytest

from authority_helpers import GROUP, OWNER, mission_create, open_with_group
from mwpstore import Authority, Command
from mwpstore.snapshot import SigningKey, verify_snapshot

WAIT = 30  # seconds a barrier waits before the test fails instead of hanging


def _key_on_disk(authority: Authority) -> SigningKey:
    with open(os.path.join(authority.path, "keys", "snapshot-signing.key"), "rb") as handle:
        return SigningKey.from_seed(handle.read())


@pytest.mark.parametrize("use", ["signing_key", "keyring"])
def test_a_key_loaded_beside_a_rotation_never_brings_the_dropped_key_back(tmp_path, monkeypatch, use):
    """A first use of the signing key (``signing_key``, ``keyring()``: archive and verify call it)
    that reads the key file while ``rotate_signing_key(retire=False)`` runs must not install the
    key the rotation dropped as compromised once the rotation has finished: every later snapshot
    would be signed with it, and a keyring opened from the store's files refuses it."""
    from mwpstore import snapshot as snapshot_module

    authority = open_with_group(str(tmp_path / "s"))
    try:
        authority.accept(mission_create("m-1"))
        old = authority.signing_key
        at_retire, go_rotation = threading.Event(), threading.Event()
        loaded, go_loader = threading.Event(), threading.Event()
        real_hit, real_load = snapshot_module.failpoints.hit, SigningKey.load_or_create.__func__
        rotator, loader = [], []

        def hit(name):
            if name == "keys.after_retire" and threading.current_thread().name == "rotator":
                at_retire.set()  # the handle's cached key is cleared, the old key is still on disk
                assert go_rotation.wait(WAIT)
            return real_hit(name)

        def load_or_create(cls, directory, **kwargs):
            key = real_load(cls, directory, **kwargs)
            if threading.current_thread().name == "loader":
                loaded.set()  # it read the old key file
                assert go_loader.wait(WAIT)
            return key

        monkeypatch.setattr(snapshot_module.failpoints, "hit", hit)
        monkeypatch.setattr(SigningKey, "load_or_create", classmethod(load_or_create))

        def rotate():
            rotator.append(authority.rotate_signing_key(retire=False))

        def load():
            loader.append(authority.signing_key if use == "signing_key" else authority.keyring())

        threads = [threading.Thread(target=rotate, name="rotator"), threading.Thread(target=load, name="loader")]
        threads[0].start()
        assert at_retire.wait(WAIT)
        threads[1].start()
        assert loaded.wait(WAIT)  # it read the old key file, the rotation not yet finished
        go_rotation.set()
        threads[0].join(WAIT)
        go_loader.set()
        threads[1].join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        monkeypatch.undo()

        new = rotator[0]
        assert new.key_id != old.key_id and _key_on_disk(authority).key_id == new.key_id
        ref = authority.snapshot(GROUP)  # unfixed: signed with the dropped key
        assert ref.key_id == new.key_id
        assert authority.signing_key.key_id == new.key_id
        verify_snapshot(authority.read_snapshot(ref), keyring=authority.keyring(), group=GROUP)
        assert old.key_id not in authority.keyring().key_ids
    finally:
        authority.close()
