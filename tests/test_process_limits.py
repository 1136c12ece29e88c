"""Limits a host process may run under: out of file descriptors (``RLIMIT_NOFILE``) and a file
size limit (``RLIMIT_FSIZE``). Each case runs in a child (``tests/limits_child.py``) so the limit
never reaches pytest. The invariants: the call ends in an ``MwpError`` or a result, never a
foreign exception; the handle goes on working or refuses with ``StorageFailed``; it closes; and
a reopen without the limit holds every acknowledged Command and verifies.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mwpstore import Authority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE / descriptor counting as on Linux")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "limits_child.py")
ENV = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO)
GROUP = "g-1"


def _run(path: str, call: str, limit: str, value: int, *preload: str) -> dict[str, str]:
    arguments = [sys.executable, CHILD, path, call, limit, str(value)]
    if preload:
        arguments += ["--preload", *preload]
    done = subprocess.run(arguments, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "CLOSED", done.stdout[-2000:] + done.stderr[-2000:]
    outcome = next(line for line in lines if line.startswith(f"{call} "))
    acknowledged = {}
    for line in lines:
        words = line.split()
        if words[0] == "OK":
            acknowledged[words[1]] = int(words[2])
    return {"outcome": outcome, "lines": lines, "acknowledged": acknowledged}  # type: ignore[dict-item]


def _reopen_holds(path: str, acknowledged: dict[str, int]) -> None:
    """Without the limit: every acknowledged Command's Event is there, and the store verifies."""
    with Authority.open(path) as authority:
        seqs = {event.seq: event.action_id for event in authority.read(GROUP, after=0, limit=10_000)}
        for action_id, seq in acknowledged.items():
            assert seqs.get(seq) == action_id, (action_id, seq)
        report = authority.verify()
        assert report.ok, report.problems
        assert not [name for name in os.listdir(path) if name.startswith("index.")]


@pytest.mark.parametrize("free", [0, 1])
def test_verify_out_of_file_descriptors_ends_typed(tmp_path, free):
    """With no descriptor left for its scratch index, verify's clean-up of that index (an rmtree
    that needs a descriptor itself) raised a bare OSError (EMFILE) out of verify."""
    path = str(tmp_path / "store")
    result = _run(path, "verify", "nofile", free, "tempfile")
    outcome = result["outcome"]
    assert " foreign " not in outcome, outcome
    # the check could not run: StorageFailed, never a report listing the process's limit as damage
    assert outcome.startswith("verify typed STORAGE_FAILED") or outcome.startswith("verify ok True []"), outcome
    _reopen_holds(path, result["acknowledged"])


def test_archive_out_of_file_descriptors_ends_typed_and_completes_when_called_again(tmp_path):
    """archive() loaded the audit-log module at its first call: in a process out of descriptors
    that import failed with a bare OSError. Once the limit is lifted, archive() runs to its end."""
    path = str(tmp_path / "store")
    result = _run(path, "archive", "nofile", 0)
    outcome = result["outcome"]
    assert outcome.startswith("archive typed STORAGE_FAILED"), outcome
    assert any(line.startswith("AGAIN ok ") for line in result["lines"]), result["lines"]
    _reopen_holds(path, result["acknowledged"])
    with Authority.open(path) as authority:
        assert authority.archive_record(GROUP) is not None


# Above LMDB's lock file (32,896 bytes) and the first pages of a new data.mdb, below the 128 KiB
# the child's index holds: the scratch index opens, and its first large commit fails with EFBIG.
FSIZE_BYTES = 48 * 1024


def test_rebuild_past_the_file_size_limit_is_storage_failed(tmp_path):
    """A rebuild's commit that cannot write (EFBIG) escaped as a bare ``lmdb.Error``."""
    path = str(tmp_path / "store")
    result = _run(path, "rebuild", "fsize", FSIZE_BYTES)
    assert result["outcome"].startswith("rebuild typed STORAGE_FAILED"), result["outcome"]
    assert not any(line.startswith("AFTER ") for line in result["lines"]), result["lines"]  # the handle still writes
    _reopen_holds(path, result["acknowledged"])


def test_verify_past_the_file_size_limit_does_not_call_the_index_damaged(tmp_path):
    """verify's scratch index failing to write (EFBIG) reached the read guard as an ``lmdb.Error``
    and came out as ``CORRUPTION`` of the store's index, telling the operator to rebuild it; then
    it was listed as a problem of the store. The check could not run: ``StorageFailed``."""
    path = str(tmp_path / "store")
    result = _run(path, "verify", "fsize", FSIZE_BYTES)
    outcome = result["outcome"]
    assert outcome.startswith("verify typed STORAGE_FAILED"), outcome  # not a problem of the store
    _reopen_holds(path, result["acknowledged"])
