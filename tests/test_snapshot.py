"""Signed snapshots: round trip, keys, and a corpus of bad snapshots, each with its specific check."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping

import blake3
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocking import outcome_within
from mwpstore import limits
from mwpstore._files import KeyFileInvalid, create_secret_at, open_directory
from mwpstore.errors import InvalidCommand, SnapshotInvalid, StorageFailed
from mwpstore.messages import ZERO_HASH, Command, Effect
from mwpstore.registry import MemoryGroup
from mwpstore.snapshot import (
    DOMAIN_SNAPSHOT,
    FORMAT_VERSION,
    MAGIC,
    PREFIX_BYTES,
    SCHEMA_VERSION,
    SNAPSHOT_FILE_BYTES_MAX,
    Keyring,
    SigningKey,
    SnapshotHeader,
    SnapshotRef,
    _PREFIX,
    aggregates_from,
    check_snapshot_ref,
    create_snapshot,
    header_bytes,
    key_id_of,
    read_snapshot_file,
    snapshot_ref,
    verify_snapshot,
    write_snapshot_file,
)

SIGNER = SigningKey.from_seed(bytes(range(32)))
OTHER_SIGNER = SigningKey.from_seed(bytes(range(1, 33)))


def make_group(group: str = "g1", org: str = "acme", missions: int = 2) -> MemoryGroup:
    memory = MemoryGroup(group)
    memory.accept(
        Command(actor="alice", action_id="a0", group=group, kind="group.create", target=group, body={"org": org}),
        now_ms=1000,
    )
    for index in range(missions):
        memory.accept(
            Command(
                actor="alice",
                action_id=f"m{index}",
                group=group,
                kind="mission.create",
                target=f"mission-{index}",
                body={"title": f"mission {index}"},
            ),
            now_ms=1001 + index,
        )
    return memory


def snapshot_of(memory: MemoryGroup, *, org: str = "acme", signer: SigningKey = SIGNER, **overrides) -> bytes:
    arguments = dict(
        org=org,
        group=memory.group,
        seq=len(memory.events),
        head_hash=memory.head_hash,
        aggregates=aggregates_from(memory.states, memory.revisions),
        signer=signer,
        created_at_ms=2000,
    )
    arguments.update(overrides)
    return create_snapshot(**arguments)


def split(data: bytes) -> tuple[tuple, bytes, bytes, bytes]:
    prefix = _PREFIX.unpack_from(data)
    header_length = prefix[3]
    header = data[PREFIX_BYTES : PREFIX_BYTES + header_length]
    signature = data[PREFIX_BYTES + header_length : PREFIX_BYTES + header_length + 64]
    state = data[PREFIX_BYTES + header_length + 64 :]
    return prefix, header, signature, state


def assemble(header: bytes, state: bytes, *, signer=SIGNER, key_id: str | None = None, version: int = FORMAT_VERSION) -> bytes:
    """Build a file from arbitrary header bytes, signed by ``signer`` (as a forger or a buggy signer would)."""
    key_id = key_id or signer.key_id
    signature = signer.sign(DOMAIN_SNAPSHOT + header)
    prefix = _PREFIX.pack(MAGIC, version, 0, len(header), len(state), key_id.encode("ascii"))
    return prefix + header + signature + state


def resigned(data: bytes, change, *, signer=SIGNER) -> bytes:
    """Decode the header, apply ``change`` to its fields, re-encode canonically and re-sign."""
    _, header, _, state = split(data)
    fields = json.loads(header)
    change(fields)
    return assemble(msgspec.json.encode(fields, order="sorted"), state, signer=signer)


def check_of(data: bytes, **kwargs) -> str:
    kwargs.setdefault("keyring", Keyring([SIGNER.public_key]))
    with pytest.raises(SnapshotInvalid) as info:
        verify_snapshot(data, **kwargs)
    assert info.value.code == "SNAPSHOT_INVALID"
    return info.value.check


@pytest.fixture(scope="module")
def memory() -> MemoryGroup:
    return make_group()


@pytest.fixture(scope="module")
def good(memory) -> bytes:
    return snapshot_of(memory)


# -- round trip ---------------------------------------------------------------------------------------


def test_round_trip_returns_the_group_state(memory, good):
    verified = verify_snapshot(good, keyring=Keyring([SIGNER.public_key]), org="acme", group="g1", high_water_seq=3)
    assert (verified.org, verified.group, verified.seq) == ("acme", "g1", 3)
    assert verified.head_hash == memory.head_hash
    assert verified.key_id == SIGNER.key_id
    assert verified.created_at_ms == 2000
    states, revisions = verified.states_and_revisions()
    assert states == memory.states and revisions == memory.revisions


def test_snapshot_bytes_are_deterministic(memory):
    assert snapshot_of(memory) == snapshot_of(memory)


def test_header_is_canonical_sorted_json(good):
    _, header, _, _ = split(good)
    fields = json.loads(header)
    assert list(fields) == sorted(fields)
    assert header == header_bytes(msgspec.json.decode(header, type=SnapshotHeader))
    assert fields["state_hash"] == blake3.blake3(split(good)[3]).hexdigest()


def test_aggregate_order_does_not_matter(memory):
    aggregates = aggregates_from(memory.states, memory.revisions)
    assert snapshot_of(memory, aggregates=reversed(aggregates)) == snapshot_of(memory)
    tuples = [(a.aggregate, a.revision, a.state) for a in aggregates]
    assert snapshot_of(memory, aggregates=tuples) == snapshot_of(memory)


def test_a_state_that_is_not_a_dict_cannot_pass_verification(memory):
    """create_snapshot leaves state types to the engine's typed index; verify still refuses them."""
    data = snapshot_of(memory, aggregates=[("a", 1, [1, 2])])
    assert check_of(data) == "format"


def test_states_as_canonical_raw_bytes_give_identical_snapshots(memory):
    aggregates = aggregates_from(memory.states, memory.revisions)
    encoder = msgspec.msgpack.Encoder(order="sorted")
    raw = [(a.aggregate, a.revision, None if a.state is None else msgspec.Raw(encoder.encode(a.state))) for a in aggregates]
    assert snapshot_of(memory, aggregates=raw) == snapshot_of(memory)


def test_deleted_aggregate_keeps_its_revision():
    data = create_snapshot(
        org="acme",
        group="g1",
        seq=5,
        head_hash=ZERO_HASH,
        aggregates=[Effect("workitem:gone", 4, None), Effect("group:g1", 1, {"status": "active"})],
        signer=SIGNER,
        created_at_ms=0,
    )
    verified = verify_snapshot(data, keyring=Keyring([SIGNER.public_key]))
    states, revisions = verified.states_and_revisions()
    assert states == {"group:g1": {"status": "active"}}
    assert revisions == {"group:g1": 1, "workitem:gone": 4}
    assert aggregates_from(states, revisions) == verified.aggregates  # an engine's maps give the same rows back


def test_empty_group_at_sequence_zero():
    data = create_snapshot(
        org="acme", group="g1", seq=0, head_hash=ZERO_HASH, aggregates=[], signer=SIGNER, created_at_ms=0
    )
    assert verify_snapshot(data, keyring=Keyring([SIGNER.public_key])).aggregates == []


def test_equal_sequence_to_high_water_mark_is_accepted(good):
    assert verify_snapshot(good, keyring=Keyring([SIGNER.public_key]), high_water_seq=3).seq == 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("org", "../x"),
        ("group", ""),
        ("seq", -1),
        ("seq", True),
        ("head_hash", b"short"),
        ("created_at_ms", -5),
        ("aggregates", [Effect("a", 0, {})]),
        ("aggregates", [Effect("a", 1, {}), Effect("a", 2, {})]),
        ("aggregates", [Effect("", 1, {})]),
        ("aggregates", [Effect("a", 1, {"x": object()})]),
        ("aggregates", [("a", 1)]),
        ("aggregates", [("a", "1", {})]),
        ("aggregates", [("a", 1, {}), Effect("a", 1, {})]),
        ("aggregates", [(1, 1, {})]),
        ("aggregates", [Effect("a", True, {})]),  # a bool is no revision
        ("aggregates", [("a", 1.0, {})]),
        ("aggregates", [("c", 1, {}), ("a", 1, {}), ("a", 2, {})]),  # a duplicate found after sorting
        ("aggregates", [("b", 1, {}), ("", 1, {})]),  # an empty key that sorting brings first
    ],
)
def test_create_refuses_bad_input(memory, field, value):
    with pytest.raises(InvalidCommand):
        snapshot_of(memory, **{field: value})


# -- keys and rotation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("data", ["text", 5, None, [1, 2]])
def test_verify_refuses_data_that_is_not_bytes(data):
    assert check_of(data) == "format"


def test_verify_refuses_a_keyring_or_high_water_mark_of_the_wrong_type(good):
    with pytest.raises(InvalidCommand):
        verify_snapshot(good, keyring=[SIGNER.public_key])
    for mark in ("3", -1, 1.5, None):
        with pytest.raises(InvalidCommand):
            verify_snapshot(good, keyring=Keyring([SIGNER.public_key]), high_water_seq=mark)


@pytest.mark.parametrize("value", [5, "x", None, [("org", "acme")], {"org": "acme"}])
def test_a_snapshot_reference_from_outside_is_checked(value):
    with pytest.raises(SnapshotInvalid) as caught:
        SnapshotRef.from_dict(value)
    assert caught.value.detail["check"] == "format"


def test_key_id_is_short_blake3_of_the_public_key():
    assert SIGNER.key_id == blake3.blake3(SIGNER.public_key).hexdigest()[:16] == key_id_of(SIGNER.public_key)


def test_keyring_holds_several_keys_for_rotation(memory):
    old, new = snapshot_of(memory, signer=SIGNER), snapshot_of(memory, signer=OTHER_SIGNER)
    keyring = Keyring([SIGNER.public_key, OTHER_SIGNER.public_key])
    assert verify_snapshot(old, keyring=keyring).key_id == SIGNER.key_id
    assert verify_snapshot(new, keyring=keyring).key_id == OTHER_SIGNER.key_id
    keyring.remove(SIGNER.key_id)
    assert SIGNER.key_id not in keyring and len(keyring) == 1
    assert check_of(old, keyring=keyring) == "key"
    assert verify_snapshot(new, keyring=keyring).seq == 3


def test_keyring_refuses_malformed_public_keys():
    with pytest.raises(InvalidCommand):
        Keyring([b"\x00" * 31])
    with pytest.raises(InvalidCommand):
        Keyring(["ab" * 32])  # type: ignore[list-item]


@pytest.mark.parametrize("keys", [None, 5, True, SIGNER.public_key, "ab" * 32])
def test_a_keyring_built_from_something_that_is_not_a_list_of_keys_is_invalid_command(keys):
    # None or a number was a TypeError; a single key's bytes were taken as 32 keys of one int each
    with pytest.raises(InvalidCommand) as caught:
        Keyring(keys)
    assert caught.value.detail["field"] == "public_keys"


@pytest.mark.parametrize("key_id", [None, 5, [], {}, b"ab"])
def test_keyring_lookups_with_a_key_id_that_is_not_text_answer_absent(key_id):
    keyring = Keyring([SIGNER.public_key])
    assert keyring.public_key(key_id) is None  # an unhashable one was a TypeError
    assert key_id not in keyring
    keyring.remove(key_id)
    assert keyring.key_ids == [SIGNER.key_id]


class _KeysItDoesNotHold(dict):
    """A dict whose keys() and iteration name a key it does not hold (a caller's own mapping)."""

    def keys(self):
        return ["org", "absent"]

    def __iter__(self):
        return iter(self.keys())


class _FailingMapping(Mapping):
    def __len__(self):
        return 1

    def __iter__(self):
        return iter(["org"])

    def __getitem__(self, key):
        raise RuntimeError("the caller's mapping broke")


@pytest.mark.parametrize(
    "ref",
    [None, 5, "ref", [("org", "acme")], {"org": "acme"}, _KeysItDoesNotHold(org="acme"), _FailingMapping()],
    ids=["None", "int", "str", "list", "partial", "keys_it_does_not_hold", "failing_mapping"],
)
def test_check_snapshot_ref_refuses_a_reference_that_is_not_one(good, ref):
    # an AttributeError (ref.file_bytes) before; a KeyError or the mapping's own error from
    # SnapshotRef.from_dict for the last two
    with pytest.raises(SnapshotInvalid) as caught:
        check_snapshot_ref(good, ref)
    assert caught.value.detail["check"] == "format"


@pytest.mark.parametrize("data", [None, 5, "text"])
def test_check_snapshot_ref_refuses_data_that_is_not_bytes(good, data):
    ref = snapshot_ref(good, location="snapshots/g-1/00000000000000000003.snap")
    check_snapshot_ref(good, ref.to_dict())  # the dict CURSOR_TOO_OLD carries is a reference too
    check_snapshot_ref(memoryview(good), ref)
    with pytest.raises(SnapshotInvalid) as caught:
        check_snapshot_ref(data, ref)  # a TypeError (len) before
    assert caught.value.detail["check"] == "format"


# Encodings of three of the eight Ed25519 points of order at most 8 (tests/test_work_model_bounds.py
# derives all eight): the identity (y = 1), the point of order 2 (y = p - 1) and one of order 4
# (y = 0, which is also what a zero-filled key is).
SMALL_ORDER_KEYS = [(1).to_bytes(32, "little"), (2**255 - 20).to_bytes(32, "little"), bytes(32)]


def test_a_small_order_key_would_verify_a_forged_snapshot():
    """Why the keyring refuses them: with the identity as the public key, the signature R =
    identity, S = 0 verifies for every header, so anyone could sign any snapshot."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    identity = SMALL_ORDER_KEYS[0]
    header = b'{"any":"header"}'
    Ed25519PublicKey.from_public_bytes(identity).verify(identity + bytes(32), DOMAIN_SNAPSHOT + header)


@pytest.mark.parametrize("public_key", SMALL_ORDER_KEYS, ids=["identity", "order_2", "order_4_zero"])
def test_keyring_refuses_small_order_public_keys(public_key):
    with pytest.raises(InvalidCommand) as caught:
        Keyring([public_key])
    assert caught.value.detail["field"] == "public_key"
    keyring = Keyring()
    with pytest.raises(InvalidCommand):
        keyring.add(public_key)
    assert len(keyring) == 0


def test_keyring_refuses_a_small_order_key_file(tmp_path):
    path = tmp_path / "zero.pub"
    path.write_bytes(bytes(32).hex().encode("ascii") + b"\n")  # a zero-filled public key file
    with pytest.raises(InvalidCommand):
        Keyring().add_file(str(path))


def test_signing_key_is_created_once_with_owner_only_permissions(tmp_path):
    directory = str(tmp_path / "keys")
    first = SigningKey.load_or_create(directory)
    second = SigningKey.load_or_create(directory)
    assert first.key_id == second.key_id
    key_file = os.path.join(directory, "snapshot-signing.key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert os.path.getsize(key_file) == 32
    assert [name for name in os.listdir(directory) if name.endswith(".tmp")] == []
    keyring = Keyring()
    assert keyring.add_file(os.path.join(directory, "snapshot-signing.pub")) == first.key_id


def test_signing_key_file_with_loose_permissions_is_refused(tmp_path):
    SigningKey.load_or_create(str(tmp_path))
    key_file = tmp_path / "snapshot-signing.key"
    for mode in (0o644, 0o640, 0o604, 0o660):
        os.chmod(key_file, mode)
        with pytest.raises(KeyFileInvalid) as info:
            SigningKey.load_or_create(str(tmp_path))
        assert info.value.detail["reason"] == "mode"
        assert isinstance(info.value, StorageFailed)
    os.chmod(key_file, 0o400)
    SigningKey.load_or_create(str(tmp_path))  # read-only for the owner is fine


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_signing_key_file_with_wrong_size_is_refused(tmp_path, size):
    key_file = tmp_path / "snapshot-signing.key"
    key_file.write_bytes(b"\x01" * size)
    os.chmod(key_file, 0o600)
    with pytest.raises(KeyFileInvalid) as info:
        SigningKey.load_or_create(str(tmp_path))
    assert info.value.detail["reason"] == "size"


def test_signing_key_symlink_is_refused(tmp_path):
    real = tmp_path / "elsewhere.key"
    real.write_bytes(b"\x01" * 32)
    os.chmod(real, 0o600)
    os.symlink(real, tmp_path / "snapshot-signing.key")
    with pytest.raises(KeyFileInvalid) as info:
        SigningKey.load_or_create(str(tmp_path))
    assert info.value.detail["reason"] == "type"


def test_secret_file_creation_never_replaces_an_existing_key(tmp_path):
    with open_directory(str(tmp_path)) as directory:
        assert create_secret_at(directory, "k.key", b"A" * 32) is True
        assert create_secret_at(directory, "k.key", b"B" * 32) is False
    assert (tmp_path / "k.key").read_bytes() == b"A" * 32
    assert os.listdir(tmp_path) == ["k.key"]


# -- files and references ----------------------------------------------------------------------------


def test_snapshot_file_is_written_atomically_and_read_back(tmp_path, good):
    path = str(tmp_path / "g1-3.snap")
    write_snapshot_file(path, good)
    write_snapshot_file(path, good)  # replacing is atomic too
    assert read_snapshot_file(path) == good
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["g1-3.snap"]
    nested = str(tmp_path / "snapshots" / "g1" / "00000003.snap")
    write_snapshot_file(nested, good)  # parents created durably
    assert read_snapshot_file(nested) == good


def test_a_snapshot_file_above_the_cap_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.snap"
    with open(path, "wb") as handle:
        handle.truncate(SNAPSHOT_FILE_BYTES_MAX + 1)  # sparse: nothing is written
    with pytest.raises(SnapshotInvalid) as info:
        read_snapshot_file(str(path))
    assert info.value.check == "size"


def test_snapshot_ref_names_the_file_and_checks_it(good):
    ref = snapshot_ref(good, location="snapshots/g1/3.snap")
    assert (ref.org, ref.group, ref.seq, ref.key_id, ref.file_bytes) == ("acme", "g1", 3, SIGNER.key_id, len(good))
    assert SnapshotRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    check_snapshot_ref(good, ref)
    tampered = bytearray(good)
    tampered[-1] ^= 1
    with pytest.raises(SnapshotInvalid) as info:
        check_snapshot_ref(bytes(tampered), ref)
    assert info.value.check == "hash"
    with pytest.raises(SnapshotInvalid) as info:
        check_snapshot_ref(good + b"x", ref)
    assert info.value.check == "size"
    with pytest.raises(SnapshotInvalid) as info:
        SnapshotRef.from_dict({"group": "g1"})
    assert info.value.check == "format"


# -- the corpus of bad snapshots ------------------------------------------------------------------------


def test_wrong_key_untrusted_signer_is_unknown_key(memory):
    assert check_of(snapshot_of(memory, signer=OTHER_SIGNER)) == "key"


def test_unknown_key_id_in_prefix(good):
    data = bytearray(good)
    data[24:40] = b"0123456789abcdef"
    assert check_of(bytes(data)) == "key"


def test_wrong_key_claiming_a_trusted_key_id_fails_signature(good):
    _, header, _, state = split(good)
    forged = assemble(header, state, signer=OTHER_SIGNER, key_id=SIGNER.key_id)
    assert check_of(forged) == "signature"


def test_empty_keyring_trusts_nothing(good):
    assert check_of(good, keyring=Keyring()) == "key"


def test_signed_header_naming_another_key_id_is_refused(good):
    forged = resigned(good, lambda fields: fields.update(key_id=OTHER_SIGNER.key_id))
    assert check_of(forged) == "key"


def expected_check_for_flip(offset: int, header_length: int) -> set[str]:
    header_start = PREFIX_BYTES
    signature_start = header_start + header_length
    state_start = signature_start + 64
    if offset < 8:
        return {"format"}  # magic (lengths still add up)
    if offset < 10:
        return {"version"}
    if offset < 12:
        return {"format"}  # reserved
    if offset < 24:
        return {"size"}  # header and state lengths no longer add up
    if offset < header_start:
        return {"key"}
    if offset < state_start:
        return {"signature"}
    return {"hash"}


def test_every_single_bit_flip_is_rejected_with_its_check(good):
    header_length = split(good)[0][3]
    keyring = Keyring([SIGNER.public_key])
    seen: dict[str, int] = {}
    for offset in range(len(good)):
        for bit in range(8):
            data = bytearray(good)
            data[offset] ^= 1 << bit
            with pytest.raises(SnapshotInvalid) as info:
                verify_snapshot(bytes(data), keyring=keyring)
            assert info.value.check in expected_check_for_flip(offset, header_length), (offset, bit, info.value.check)
            seen[info.value.check] = seen.get(info.value.check, 0) + 1
    assert set(seen) == {"format", "version", "size", "key", "signature", "hash"}


def test_every_truncation_is_rejected_as_size(good):
    keyring = Keyring([SIGNER.public_key])
    for length in range(len(good)):
        with pytest.raises(SnapshotInvalid) as info:
            verify_snapshot(good[:length], keyring=keyring)
        assert info.value.check == "size", length


@pytest.mark.parametrize("extra", [b"\x00", b"x" * 63, b"\x00" * 4096])
def test_appended_bytes_are_rejected_as_size(good, extra):
    assert check_of(good + extra) == "size"


def test_state_swapped_from_another_valid_snapshot_fails_hash(memory, good):
    other = snapshot_of(make_group(missions=3))  # same key, same group, another state
    prefix, header, signature, _ = split(good)
    other_state = split(other)[3]
    swapped = _PREFIX.pack(prefix[0], prefix[1], prefix[2], prefix[3], len(other_state), prefix[5]) + header + signature + other_state
    assert check_of(swapped) == "hash"


def test_state_swapped_with_same_length_fails_hash(good):
    _, header, signature, state = split(good)
    same_length = state.replace(b"mission 0", b"mission 9")
    assert len(same_length) == len(state) and same_length != state
    assert check_of(good[: -len(state)] + same_length) == "hash"


def test_header_re_encoded_with_another_key_order_is_rejected(good):
    prefix, header, signature, state = split(good)
    fields = json.loads(header)
    reordered = json.dumps(dict(reversed(list(fields.items()))), separators=(",", ":")).encode()
    assert reordered != header and json.loads(reordered) == fields
    # Same fields, other bytes: the signature covers the exact bytes.
    unsigned = _PREFIX.pack(*prefix[:3], len(reordered), *prefix[4:]) + reordered + signature + state
    assert check_of(unsigned) == "signature"
    # Even signed by a trusted key, a non-canonical header is refused.
    assert check_of(assemble(reordered, state)) == "format"


def test_header_with_extra_whitespace_is_not_canonical(good):
    _, header, _, state = split(good)
    assert check_of(assemble(header.replace(b",", b", "), state)) == "format"


def test_signed_header_that_is_not_json_is_format(good):
    _, _, _, state = split(good)
    assert check_of(assemble(b"\xff not json", state)) == "format"


def test_signed_but_absurdly_nested_header_or_state_is_format(good):
    _, _, _, state = split(good)
    assert check_of(assemble(b"[" * 30000 + b"]" * 30000, state)) == "format"
    assert check_of(_signed_with_state(b"\x91" * 100000 + b"\xc0", 1)) == "format"


def test_other_organization_is_binding(good):
    assert check_of(good, org="other-org") == "binding"


def test_other_group_is_binding(good):
    assert check_of(good, group="g2") == "binding"


def test_snapshot_of_another_group_signed_by_the_same_key_is_binding():
    data = snapshot_of(make_group("g2"))
    assert check_of(data, org="acme", group="g1") == "binding"


def test_older_sequence_than_high_water_mark_is_rollback(good):
    assert check_of(good, high_water_seq=4) == "sequence"


@pytest.mark.parametrize("field, value", [("format_version", 2), ("schema_version", 2), ("format_version", 0)])
def test_unsupported_version_in_signed_header(good, field, value):
    assert check_of(resigned(good, lambda fields: fields.update({field: value}))) == "version"


def test_unsupported_version_with_new_fields_is_still_version(good):
    def future(fields):
        fields.update(format_version=2, compression="zstd")

    assert check_of(resigned(good, future)) == "version"


def test_unsupported_version_in_prefix(good):
    _, header, _, state = split(good)
    assert check_of(assemble(header, state, version=2)) == "version"


def test_oversize_header_is_size_before_parsing(good):
    prefix, header, signature, state = split(good)
    claimed = limits.SNAPSHOT_HEADER_BYTES_MAX + 1
    data = _PREFIX.pack(*prefix[:3], claimed, *prefix[4:]) + b" " * claimed + signature + state
    assert check_of(data) == "size"


def test_oversize_state_length_is_size(good):
    prefix, header, signature, state = split(good)
    data = _PREFIX.pack(*prefix[:4], limits.SNAPSHOT_STATE_BYTES_MAX + 1, prefix[5]) + header + signature + state
    assert check_of(data) == "size"


def test_a_header_length_at_the_cap_is_not_refused_as_size(good):
    """The cap is inclusive: a file whose prefix declares a header of exactly the cap, and which has
    that many bytes, passes the size check and fails only at the signature."""
    prefix, _, signature, state = split(good)
    claimed = limits.SNAPSHOT_HEADER_BYTES_MAX
    data = _PREFIX.pack(*prefix[:3], claimed, *prefix[4:]) + b" " * claimed + signature + state
    assert check_of(data) == "signature"


def test_zero_length_header_is_size(good):
    prefix, _, signature, state = split(good)
    assert check_of(_PREFIX.pack(*prefix[:3], 0, *prefix[4:]) + signature + state) == "size"


@pytest.mark.parametrize(
    "change",
    [
        lambda f: f.update(org="../etc"),
        lambda f: f.update(seq=-1),
        lambda f: f.update(seq=limits.INT_ABS_MAX + 1),
        lambda f: f.update(created_at_ms=limits.INT_ABS_MAX + 1),
        lambda f: f.update(head_hash="zz" * 32),
        lambda f: f.update(aggregates=10**9),
        lambda f: f.update(created_at_ms="now"),
        lambda f: f.update(unknown_field=1),
        lambda f: f.pop("group"),
    ],
)
def test_signed_header_with_bad_fields_is_format(good, change):
    assert check_of(resigned(good, change)) == "format"


def test_declared_state_length_differs_from_file_is_hash(good):
    assert check_of(resigned(good, lambda f: f.update(state_bytes=f["state_bytes"] + 1))) == "hash"


def _signed_with_state(state: bytes, count: int) -> bytes:
    header = SnapshotHeader(
        format_version=FORMAT_VERSION,
        schema_version=SCHEMA_VERSION,
        org="acme",
        group="g1",
        seq=1,
        head_hash=ZERO_HASH.hex(),
        state_hash=blake3.blake3(state).hexdigest(),
        state_bytes=len(state),
        aggregates=count,
        created_at_ms=0,
        key_id=SIGNER.key_id,
    )
    return assemble(header_bytes(header), state)


@pytest.mark.parametrize(
    "aggregates, count",
    [
        ([["b", 1, {}], ["a", 1, {}]], 2),  # unsorted
        ([["a", 1, {}], ["a", 2, {}]], 2),  # duplicate
        ([["a", 0, {}]], 1),  # revision 0
        ([["a", 1, [1]]], 1),  # state not a dict
        ([["a", 1, {}]], 2),  # count differs
        ([["", 1, {}], ["a", 1, {}]], 2),  # an empty key, sorted first
        ("not a list", 0),
    ],
)
def test_signed_but_malformed_state_is_format(aggregates, count):
    state = msgspec.msgpack.encode(aggregates)
    assert check_of(_signed_with_state(state, count)) == "format"


def test_checks_run_in_the_documented_order(good):
    """A file that is wrong in several ways reports the earliest check."""
    _, header, _, state = split(good)
    many_wrongs = resigned(
        good, lambda f: f.update(format_version=9, org="zz", seq=0, key_id=OTHER_SIGNER.key_id), signer=OTHER_SIGNER
    )
    assert check_of(many_wrongs, org="acme", high_water_seq=5) == "key"
    keyring = Keyring([SIGNER.public_key, OTHER_SIGNER.public_key])
    assert check_of(many_wrongs, keyring=keyring, org="acme", high_water_seq=5) == "version"
    stale_other = resigned(good, lambda f: f.update(org="zz", seq=0))
    assert check_of(stale_other, org="acme", high_water_seq=5) == "binding"
    bad_state = bytearray(many_wrongs)
    bad_state[-1] ^= 1
    assert check_of(bytes(bad_state), keyring=keyring, org="acme", high_water_seq=5) == "hash"


# -- properties -----------------------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63) + 1, 2**63 - 1), st.text(max_size=8))
json_value = st.recursive(
    json_leaf,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=5), children, max_size=3)),
    max_leaves=8,
)
aggregate_maps = st.dictionaries(
    st.text(min_size=1, max_size=12),
    st.tuples(st.integers(1, 2**31), st.one_of(st.none(), st.dictionaries(st.text(max_size=5), json_value, max_size=4))),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(aggregates=aggregate_maps, seq=st.integers(0, 2**40))
def test_property_round_trip(aggregates, seq):
    items = [Effect(key, revision, state) for key, (revision, state) in aggregates.items()]
    data = create_snapshot(
        org="acme", group="g1", seq=seq, head_hash=b"\x07" * 32, aggregates=items, signer=SIGNER, created_at_ms=1
    )
    verified = verify_snapshot(data, keyring=Keyring([SIGNER.public_key]), org="acme", group="g1", high_water_seq=seq)
    assert verified.aggregates == sorted(items, key=lambda effect: effect.aggregate)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_any_mutation_is_rejected(good, data):
    position = data.draw(st.integers(0, len(good) - 1))
    mode = data.draw(st.sampled_from(["replace", "insert", "delete", "overwrite"]))
    mutated = bytearray(good)
    if mode == "replace":
        mutated[position] = (mutated[position] + data.draw(st.integers(1, 255))) % 256
    elif mode == "insert":
        mutated[position:position] = data.draw(st.binary(min_size=1, max_size=16))
    elif mode == "delete":
        del mutated[position : position + data.draw(st.integers(1, 16))]
    else:
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        mutated[position : position + len(chunk)] = chunk
    if bytes(mutated) == good:
        return
    with pytest.raises(SnapshotInvalid):
        verify_snapshot(bytes(mutated), keyring=Keyring([SIGNER.public_key]))


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=512))
def test_property_random_bytes_never_crash(blob):
    with pytest.raises(SnapshotInvalid):
        verify_snapshot(MAGIC + blob, keyring=Keyring([SIGNER.public_key]))


def test_fifos_in_place_of_snapshot_and_key_files_are_refused_without_blocking(tmp_path):
    snapshot = tmp_path / "g-1.snapshot"
    os.mkfifo(snapshot)  # opening it for reading would wait for a writer for ever
    error = outcome_within(10, lambda: read_snapshot_file(str(snapshot)))
    assert isinstance(error, StorageFailed) and not isinstance(error, SnapshotInvalid)
    os.mkfifo(tmp_path / "snapshot-signing.key")
    error = outcome_within(10, lambda: SigningKey.load_or_create(str(tmp_path)))
    assert isinstance(error, KeyFileInvalid)
    assert error.detail["reason"] == "type"


# -- Keys from outside: typed refusals, one promise each ---------------------------------------------


@pytest.mark.parametrize("public_key", ["k" * 32, "public key of 32 characters ....", 32])
def test_keyring_refuses_a_public_key_that_is_not_bytes(public_key):
    """A key is 32 raw ``bytes``: text of that length (or anything else) is ``InvalidCommand``
    (``public_key``), never a ``TypeError`` from the Ed25519 library."""
    with pytest.raises(InvalidCommand) as caught:
        Keyring().add(public_key)
    assert caught.value.detail["field"] == "public_key"
    with pytest.raises(InvalidCommand):
        Keyring().add(bytearray(SigningKey.generate().public_key))


@pytest.mark.parametrize("seed", [b"s" * 31, b"s" * 33, b"", "s" * 32, bytearray(32), None])
def test_a_signing_key_seed_is_exactly_32_bytes(seed):
    """``SigningKey.from_seed`` takes 32 ``bytes``: another length or type is ``InvalidCommand``
    (``seed``), not a ``ValueError`` or ``TypeError`` from the library."""
    with pytest.raises(InvalidCommand) as caught:
        SigningKey.from_seed(seed)
    assert caught.value.detail["field"] == "seed"


@pytest.mark.parametrize("name", ["../outside", "a/b", "", ".hidden/../x"])
def test_a_key_name_that_is_no_id_is_refused_before_any_file_is_created(tmp_path, name):
    """``load_or_create(name=)`` takes an id: a name with a slash or ``..`` would put the key
    file outside the key directory. Refused, and nothing is created."""
    directory = tmp_path / "keys"
    with pytest.raises(InvalidCommand):
        SigningKey.load_or_create(str(directory), name=name)
    assert sorted(os.listdir(tmp_path)) == []


def test_the_loser_of_a_key_creation_race_uses_the_winners_key(tmp_path, monkeypatch):
    """Two processes creating the key at once end up with the same key: when another process
    publishes its key file first, ``load_or_create`` returns the key in that file, not the seed it
    generated itself (which signs nothing anyone trusts)."""
    from mwpstore import snapshot as snapshot_module

    winner = SigningKey.from_seed(b"w" * 32)
    real = snapshot_module.create_secret_at

    def racing(directory, name, data):
        real(directory, name, b"w" * 32)  # the other process links its file first
        return real(directory, name, data)

    monkeypatch.setattr(snapshot_module, "create_secret_at", racing)
    key = SigningKey.load_or_create(str(tmp_path))
    assert key.public_key == winner.public_key
    assert (tmp_path / "snapshot-signing.pub").read_bytes() == winner.public_key.hex().encode() + b"\n"


def test_the_public_key_file_is_readable_by_verifiers(tmp_path):
    """``snapshot-signing.pub`` is handed to verifiers: mode 0644 (docs/operations.md), unlike
    the 0600 seed beside it."""
    SigningKey.load_or_create(str(tmp_path))
    assert stat.S_IMODE(os.stat(tmp_path / "snapshot-signing.pub").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "snapshot-signing.key").st_mode) == 0o600


def test_keyring_add_file_of_a_directory_is_storage_failed(tmp_path):
    """``Keyring.add_file`` reads through the capped, regular-file-only reader: a directory is a
    typed ``StorageFailed``, not an ``IsADirectoryError``."""
    with pytest.raises(StorageFailed):
        Keyring().add_file(str(tmp_path))
