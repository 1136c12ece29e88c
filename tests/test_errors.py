"""``errors.translate`` (the one place that knows foreign exception types), ``error_from_code``
round trips, and pickling of every error class. Table-driven: one row per foreign error."""

from __future__ import annotations

import errno
import pickle

import lmdb
import msgspec
import pytest
from cryptography.exceptions import InvalidSignature, InvalidTag

from mwpstore import errors
from mwpstore.errors import (
    ERROR_CLASSES,
    ActionIdCollision,
    ArchiveInvalid,
    Corruption,
    CursorTooOld,
    InvalidCommand,
    LimitExceeded,
    MwpError,
    Rejection,
    RevisionMismatch,
    SignatureInvalid,
    SnapshotInvalid,
    StorageFailed,
    error_from_code,
    translate,
)


def _decode_error() -> msgspec.DecodeError:
    try:
        msgspec.json.decode(b"{not json")
    except msgspec.DecodeError as exc:
        return exc
    raise AssertionError("expected a DecodeError")


def _validation_error() -> msgspec.ValidationError:
    try:
        msgspec.json.decode(b'"text"', type=int)
    except msgspec.ValidationError as exc:
        return exc
    raise AssertionError("expected a ValidationError")


def _encode_error() -> msgspec.EncodeError:
    return msgspec.EncodeError("cannot encode this value")


# (foreign exception, expected MwpError class, expected code, expected detail subset)
TRANSLATIONS = [
    pytest.param(lmdb.CorruptedError("bad page"), Corruption, "CORRUPTION", {"reason": "CorruptedError"}, id="lmdb-corrupted"),
    pytest.param(lmdb.PageNotFoundError("gone"), Corruption, "CORRUPTION", {"reason": "PageNotFoundError"}, id="lmdb-page-not-found"),
    pytest.param(lmdb.InvalidError("not lmdb"), Corruption, "CORRUPTION", {"reason": "InvalidError"}, id="lmdb-invalid"),
    pytest.param(lmdb.CursorFullError("stack"), Corruption, "CORRUPTION", {"reason": "CursorFullError"}, id="lmdb-cursor-full"),
    pytest.param(lmdb.PageFullError("page"), Corruption, "CORRUPTION", {"reason": "PageFullError"}, id="lmdb-page-full"),
    pytest.param(lmdb.MapFullError("full"), LimitExceeded, "LIMIT_EXCEEDED", {"field": "map_size"}, id="lmdb-map-full"),
    pytest.param(lmdb.DiskError("disk"), StorageFailed, "STORAGE_FAILED", {"reason": "DiskError"}, id="lmdb-disk"),
    pytest.param(lmdb.ReadonlyError("ro"), StorageFailed, "STORAGE_FAILED", {"reason": "ReadonlyError"}, id="lmdb-readonly"),
    pytest.param(lmdb.Error("other"), StorageFailed, "STORAGE_FAILED", {"reason": "Error"}, id="lmdb-base"),
    pytest.param(_decode_error(), Corruption, "CORRUPTION", {"reason": "decode"}, id="msgspec-decode"),
    pytest.param(_validation_error(), Corruption, "CORRUPTION", {"reason": "decode"}, id="msgspec-validation"),
    pytest.param(_encode_error(), InvalidCommand, "INVALID_COMMAND", {"field": "body"}, id="msgspec-encode"),
    pytest.param(InvalidSignature(), SignatureInvalid, "SIGNATURE_INVALID", {}, id="crypto-invalid-signature"),
    pytest.param(InvalidTag(), ArchiveInvalid, "ARCHIVE_INVALID", {"check": "tag"}, id="crypto-invalid-tag"),
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), StorageFailed, "STORAGE_FAILED", {"errno": errno.ENOSPC}, id="os-enospc"),
    pytest.param(OSError(errno.EDQUOT, "Disk quota exceeded"), StorageFailed, "STORAGE_FAILED", {"errno": errno.EDQUOT}, id="os-edquot"),
    pytest.param(OSError(errno.EIO, "Input/output error"), StorageFailed, "STORAGE_FAILED", {"errno": errno.EIO}, id="os-eio"),
    pytest.param(PermissionError(errno.EACCES, "Permission denied"), StorageFailed, "STORAGE_FAILED", {"errno": errno.EACCES}, id="os-eacces"),
    pytest.param(FileNotFoundError(errno.ENOENT, "missing"), StorageFailed, "STORAGE_FAILED", {"errno": errno.ENOENT}, id="os-enoent"),
    pytest.param(OSError("no errno"), StorageFailed, "STORAGE_FAILED", {"errno": None}, id="os-without-errno"),
    pytest.param(ValueError("surprise"), MwpError, "MWP_ERROR", {"reason": "ValueError"}, id="anything-else"),
]


@pytest.mark.parametrize(("foreign", "cls", "code", "detail"), TRANSLATIONS)
def test_translate_maps_foreign_errors(foreign: BaseException, cls: type[MwpError], code: str, detail: dict) -> None:
    translated = translate(foreign, context="testing")
    assert type(translated) is cls
    assert translated.code == code
    for key, value in detail.items():
        assert translated.detail[key] == value
    assert "(testing)" in translated.message


def test_translate_without_context_has_no_empty_parentheses() -> None:
    assert "()" not in translate(OSError(errno.EIO, "x")).message


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT], ids=errno.errorcode.get)
def test_a_full_disk_or_quota_message_says_no_space(number: int) -> None:
    # docs/recovery.md: free space (ENOSPC, EDQUOT); an exhausted quota is no plain I/O error
    translated = translate(OSError(number, "x"))
    assert "no space left" in translated.message and translated.detail == {"errno": number}


def test_lmdb_damage_message_says_to_rebuild() -> None:
    assert "mwpstore rebuild" in translate(lmdb.CorruptedError("x")).message


@pytest.mark.parametrize(
    "error",
    [
        ActionIdCollision("taken", actor="a", action_id="b"),
        RevisionMismatch("stale", current_revision=4),
        StorageFailed("disk", errno=errno.EIO),
        Corruption("bad", segment="s", offset=7, reason="frame_checksum"),
    ],
    ids=lambda error: error.code,
)
def test_mwp_errors_pass_through_unchanged(error: MwpError) -> None:
    assert translate(error) is error
    assert translate(error, context="anything") is error


def test_every_code_is_unique_and_registered() -> None:
    classes = [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, MwpError)]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert ERROR_CLASSES[cls.code] is cls


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_error_from_code_round_trips(code: str) -> None:
    cls = ERROR_CLASSES[code]
    original = cls("what happened; what to do", field="body", current_revision=3, check="signature")
    rebuilt = error_from_code(original.code, original.message, original.detail)
    assert type(rebuilt) is cls
    assert rebuilt.code == code
    assert rebuilt.message == original.message
    assert rebuilt.detail == original.detail
    assert rebuilt.to_dict() == original.to_dict()


def test_error_from_unknown_code_keeps_the_code() -> None:
    rebuilt = error_from_code("SOMETHING_NEW", "from a newer peer", {"x": 1})
    assert type(rebuilt) is MwpError
    assert rebuilt.code == "SOMETHING_NEW"
    assert rebuilt.detail == {"x": 1}
    assert rebuilt.to_dict() == {"code": "SOMETHING_NEW", "message": "from a newer peer", "detail": {"x": 1}}
    assert MwpError.code == "MWP_ERROR"  # the class attribute is untouched
    copy = pickle.loads(pickle.dumps(rebuilt))  # e.g. through multiprocessing: it was MWP_ERROR after
    assert copy.code == "SOMETHING_NEW" and copy.to_dict() == rebuilt.to_dict()


@pytest.mark.parametrize("key", ["message", "self", "code"])
def test_error_from_code_takes_any_text_key_in_detail(key: str) -> None:
    # detail comes from outside (an AcceptResult decoded from another process): a key named like
    # an __init__ parameter was a TypeError ("got multiple values for argument 'message'")
    rebuilt = error_from_code("NOT_FOUND", "gone", {key: "x", "field": "group"})
    assert type(rebuilt) is ERROR_CLASSES["NOT_FOUND"] and rebuilt.message == "gone" and str(rebuilt) == "gone"
    assert rebuilt.detail == {key: "x", "field": "group"} and rebuilt.code == "NOT_FOUND"
    assert pickle.loads(pickle.dumps(rebuilt)).detail == rebuilt.detail
    from mwpstore.messages import AcceptResult

    decoded = msgspec.json.decode(
        msgspec.json.encode({"error_code": "NOT_FOUND", "message": "gone", "detail": {key: "x"}}), type=AcceptResult
    )
    with pytest.raises(ERROR_CLASSES["NOT_FOUND"]):
        decoded.unwrap()


@pytest.mark.parametrize(
    "code, message, detail, field",
    [(["x"], "m", {}, "code"), (None, "m", {}, "code"), ("NOT_FOUND", 5, {}, "message"), ("NOT_FOUND", "m", [1], "detail"),
     ("NOT_FOUND", "m", {1: 2}, "detail")],
)
def test_error_from_code_refuses_what_cannot_be_an_error(code, message, detail, field) -> None:
    with pytest.raises(InvalidCommand) as caught:  # TypeErrors before
        error_from_code(code, message, detail)
    assert caught.value.field == field


class _KeysItDoesNotHold(dict):
    """A dict whose keys() and iteration name a key it does not hold (a caller's own mapping)."""

    def keys(self):
        return ["field", "absent"]

    def __iter__(self):
        return iter(self.keys())


def test_error_from_code_refuses_a_detail_whose_keys_name_what_it_does_not_hold() -> None:
    # a KeyError from inside error_from_code before
    with pytest.raises(InvalidCommand) as caught:
        error_from_code("NOT_FOUND", "gone", _KeysItDoesNotHold(field="group"))
    assert caught.value.field == "detail"


def test_error_from_code_without_detail() -> None:
    assert error_from_code("CORRUPTION", "bad").detail == {}


def test_error_from_code_keeps_its_own_copy_of_the_detail() -> None:
    # the detail comes from outside (a decoded AcceptResult the caller may reuse or change)
    detail = {"field": "group"}
    rebuilt = error_from_code("NOT_FOUND", "gone", detail)
    detail["field"] = "changed"
    detail["more"] = 1
    assert rebuilt.detail == {"field": "group"}


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_every_error_pickles(code: str) -> None:
    cls = ERROR_CLASSES[code]
    original = cls("message", reason="r", position=12)
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert copy.message == original.message
    assert copy.detail == original.detail
    assert str(copy) == str(original)


def test_typed_accessors_survive_pickling() -> None:
    assert pickle.loads(pickle.dumps(RevisionMismatch("m", current_revision=7))).current_revision == 7
    assert pickle.loads(pickle.dumps(InvalidCommand("m", field="actor"))).field == "actor"
    assert pickle.loads(pickle.dumps(SnapshotInvalid("m", check="binding"))).check == "binding"
    ref = {"group": "g-1", "seq": 40}
    assert pickle.loads(pickle.dumps(CursorTooOld("m", snapshot_ref=ref))).snapshot_ref == ref
    # without the fact: an empty name (no field or check is called "None"), no reference
    assert (InvalidCommand("m").field, SnapshotInvalid("m").check, CursorTooOld("m").snapshot_ref) == ("", "", None)


def test_rejections_are_rejections() -> None:
    for code in ("ACTION_ID_COLLISION", "REVISION_MISMATCH", "INVALID_COMMAND", "LIMIT_EXCEEDED", "NOT_A_MEMBER",
                 "LEASE_MISMATCH", "STALE_OWNERSHIP_EPOCH", "LEASE_EXPIRED", "APPROVAL_REQUIRED", "BUDGET_EXCEEDED",
                 "ATTEMPTS_EXHAUSTED", "DEADLINE_PASSED", "GROUP_ARCHIVED"):
        assert issubclass(ERROR_CLASSES[code], Rejection), code
    for code in ("CORRUPTION", "STORAGE_FAILED", "STORE_LOCKED", "CURSOR_TOO_OLD", "SNAPSHOT_INVALID"):
        assert not issubclass(ERROR_CLASSES[code], Rejection), code
