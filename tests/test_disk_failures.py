"""fsync and disk failures: EIO at each sync point (once and persistent), ENOSPC, short writes.

The faults come from ``tests/native/fail_sync.c`` (an ``LD_PRELOAD`` library the suite builds
with ``cc``) and from the I/O seam's recorder (``mwpstore.io_seam.RecordingIO``). The invariants:
no acknowledgement after a failed sync, no retry-then-acknowledge, only typed errors, and a
reopen recovers every acknowledged result.

Known engine bugs are pinned by ``xfail`` tests below (``strict=False``, so the fix turns them
into XPASS without breaking CI; remove the marker then).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys

import pytest

from mwpstore import torture
from mwpstore.authority import Authority
from mwpstore.errors import MwpError, StorageFailed
from mwpstore.index import Index
from mwpstore.io_seam import RecordingIO, crash_state, write_crash_state

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")

ACK_AFTER_FAILED_SYNC = (
    "mwpstore/authority.py _commit_batch: newly decided requests already carry their receipt, so they "
    "are never added to `pending` and a failed log append/fdatasync (or index commit) fails nobody"
)
FOREIGN_ERRORS = "lmdb.PanicError / OSError escape the Authority untranslated after a disk failure"


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return torture.build_fail_sync_library(str(tmp_path_factory.mktemp("native")))


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_library_fails_the_chosen_sync_once(library, tmp_path):
    target = tmp_path / "data"
    target.mkdir()
    code = (
        "import os, ctypes\n"
        f"path = {str(target / 'f')!r}\n"
        "fd = os.open(path, os.O_RDWR | os.O_CREAT)\n"
        "results = []\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        os.fsync(fd); results.append('ok')\n"
        "    except OSError as exc:\n"
        "        results.append(exc.errno)\n"
        "print(results, ctypes.CDLL(None).mwpstore_faults_injected())\n"
    )
    env = dict(os.environ, LD_PRELOAD=torture.preload(library), MWPSTORE_FAULT_PATH=str(target), MWPSTORE_FAIL_SYNC_AT="2")
    assert _python(code, env).stdout.split("\n")[0] == "['ok', 5, 'ok'] 1"
    env = dict(os.environ, LD_PRELOAD=torture.preload(library), MWPSTORE_FAULT_PATH=str(target), MWPSTORE_FAIL_SYNC_FROM="2")
    assert _python(code, env).stdout.split("\n")[0] == "['ok', 5, 5] 2"


def test_library_injects_enospc_and_short_writes(library, tmp_path):
    code = (
        "import os\n"
        f"fd = os.open({str(tmp_path / 'f')!r}, os.O_RDWR | os.O_CREAT)\n"
        "out = []\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        out.append(os.write(fd, b'x' * 100))\n"
        "    except OSError as exc:\n"
        "        out.append(exc.errno)\n"
        "print(out)\n"
    )
    base = dict(os.environ, LD_PRELOAD=torture.preload(library), MWPSTORE_FAULT_PATH=str(tmp_path))
    assert _python(code, dict(base, MWPSTORE_ENOSPC_WRITE_AT="2")).stdout.strip() == "[100, 28, 100]"
    assert _python(code, dict(base, MWPSTORE_SHORT_WRITE_AT="3")).stdout.strip() == "[100, 100, 50]"


def test_short_writes_to_the_log_are_completed_or_refused(library):
    result = torture.run_disk(count=4, seed=3, modes=("short_write",), scope="log")
    assert result["iterations"] == 4
    assert result["violations"] == 0, result["details"]["violation_messages"]


def test_the_judge_flags_an_acknowledgement_after_a_failed_sync():
    lines = ["TRY a1", "FAIL STORAGE_FAILED 0 1", "OK a2 g-1 2 g-1:2 1 1", "OK a3 g-1 3 g-1:3 1 2"]
    _, problems = torture._judge_disk_lines(lines, ["/store/log/00000000000000000000.seg"])
    assert any("retry-then-acknowledge" in problem for problem in problems)
    assert any("met an injected failure" in problem for problem in problems)


def _sync_of_the_second_accept(path: str) -> int:
    """The number of the first sync call the second accept makes (counted in a scratch store)."""
    counting = RecordingIO()
    with torture.recorded_log(counting):
        authority = Authority.open(path)
        authority.accept(torture.group_create_command("g-1"))
        before = counting.sync_calls
        authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
        assert counting.sync_calls > before
        authority.close()
    return before


def test_accept_fails_when_its_log_sync_fails(tmp_path):
    """The minimal reproduction: the recorder fails the fdatasync of the second accept's group."""
    path = str(tmp_path / "store")
    recorder = RecordingIO(fail_sync_at=_sync_of_the_second_accept(path + "-count"))
    with torture.recorded_log(recorder):
        authority = Authority.open(path)
        authority.accept(torture.group_create_command("g-1"))
        try:
            with pytest.raises(StorageFailed):
                authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
        finally:
            assert recorder.failures == 1
            authority.close()
    index = Index(os.path.join(path, "index"), map_size=64 * 1024 * 1024)
    try:
        with index.begin() as txn:  # a close after a storage failure leaves the index to be judged again
            assert bytes(index.get(txn, b"meta", b"clean")) == b"0"
    finally:
        index.close()


def test_a_batch_whose_log_sync_failed_is_never_visible_to_readers(tmp_path):
    """Readers see a batch only after its log fdatasync succeeded (the index commits after the
    sync): when that sync fails, nothing of the batch is readable, even in the failed process."""
    path = str(tmp_path / "store")
    recorder = RecordingIO(fail_sync_at=_sync_of_the_second_accept(path + "-count"))
    with torture.recorded_log(recorder):
        authority = Authority.open(path)
        authority.accept(torture.group_create_command("g-1"))
        head = authority.head("g-1")
        try:
            with pytest.raises(StorageFailed):
                authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
            assert recorder.failures == 1
            assert authority.head("g-1") == head
            assert [event.seq for event in authority.read("g-1")] == [1]
            assert authority.state("g-1", "mission:m-1") == (0, None)
        finally:
            try:
                authority.close()
            except MwpError:
                pass


def test_an_event_served_after_its_writer_died_mid_sync_survives_a_power_cut(tmp_path):
    """The writer dies after writing a group and before its fdatasync returned (here the sync
    fails; a kill between the two leaves the same files), so the group is in the page cache only.
    The next open in the same boot finds it whole, indexes it and serves it: every power cut after
    that open returns must keep it, or a later Command is given the sequence readers already saw."""
    path = str(tmp_path / "store")
    recorder = RecordingIO()
    with torture.recorded_log(recorder):
        authority = Authority.open(path)
        authority.accept(torture.group_create_command("g-1"))
        recorder.fail_sync_at = recorder.sync_calls  # the sync of the next accept's group
        with pytest.raises(StorageFailed):
            authority.accept(torture._mission_create("g-1", "m-1", "a-1"))
        try:
            authority.close()
        except MwpError:
            pass  # the failed handle's close: the log keeps no clean-close marker
        recorder.fail_sync_at = None
        reopened = Authority.open(path)
    opened = len(recorder.operations)
    try:
        served = [(event.seq, event.event_id) for event in reopened.read("g-1")]
    finally:
        reopened.close()
    assert [seq for seq, _ in served] == [1, 2]
    for seed in range(20):
        target = str(tmp_path / f"cut-{seed}")
        state = crash_state(recorder.operations, opened, random.Random(seed))
        write_crash_state(state, os.path.join(path, "log"), os.path.join(target, "log"))
        with Authority.open(target) as after:  # no index: rebuilt from what the log kept
            assert [(event.seq, event.event_id) for event in after.read("g-1")] == served, seed


def test_short_writes_anywhere_in_the_store_give_typed_errors(library):
    result = torture.run_disk(count=4, seed=3, modes=("short_write",))
    assert result["violations"] == 0, result["details"]["violation_messages"][:5]


def test_disk_suite_short_run_finds_no_violation(library):
    result = torture.run_disk(count=5, seed=1)
    assert result["iterations"] > 0
    assert result["violations"] == 0, result["details"]["violation_messages"][:5]


def test_the_disk_suite_keeps_no_case_s_store_after_checking_it(library, tmp_path, monkeypatch):
    """Each case's store (a 64 MiB segment) is removed once checked: the suite's scratch space
    stays the size of one case however long it runs. The seam cases used to stay until the end of
    the run, and a 400 s run filled a 24 GiB tmpfs."""
    monkeypatch.setenv("MWPSTORE_TORTURE_DIR", str(tmp_path))
    seen: list[list[str]] = []

    def look(done: int, total: int) -> None:  # called after each case
        seen.append(sorted(name for root in os.listdir(tmp_path) for name in os.listdir(tmp_path / root)
                           if not name.endswith(".so")))

    result = torture.run_disk(count=4, seed=2, modes=("sync_once", "seam_sync"), progress=look)
    assert result["violations"] == 0, result["details"]["violation_messages"][:5]
    assert len(seen) == 4 and seen == [[]] * 4, seen
    assert os.listdir(tmp_path) == []


def test_reopen_after_persistent_eio_keeps_what_was_acknowledged(tmp_path):
    """Whatever the engine did with the failed call, a reopen keeps every earlier acknowledgement."""
    for fail_at in (6, 11, 17):
        path = str(tmp_path / f"store-{fail_at}")
        recorder = RecordingIO(fail_sync_at=fail_at)
        acknowledged = torture.Acknowledged()
        with torture.recorded_log(recorder):
            authority = Authority.open(path)
            rng = random.Random(fail_at)
            torture.ensure_groups(authority)
            for step in range(12):
                try:
                    for command in torture.workload_commands(authority, rng, f"e{step}"):
                        receipt = authority.accept(command)
                        if recorder.failures == 0:
                            acknowledged.add_receipt(receipt.action_id, receipt.group, receipt.seq, receipt.event_id)
                except MwpError:
                    pass  # refused after the failure: allowed
            try:
                authority.close()
            except MwpError:
                pass
        assert recorder.failures == 1
        with Authority.open(path) as reopened:
            assert torture.check_authority(reopened, acknowledged) == []


def test_open_gives_a_typed_error_when_the_index_sync_fails(library, tmp_path):
    store = str(tmp_path / "store")
    code = (
        "from mwpstore.authority import Authority\n"
        "from mwpstore.errors import MwpError\n"
        "try:\n"
        f"    Authority.open({store!r}).close(); print('opened')\n"
        "except MwpError as exc:\n"
        "    print('typed', exc.code)\n"
        "except Exception as exc:\n"
        "    print('foreign', type(exc).__name__)\n"
    )
    env = dict(os.environ, LD_PRELOAD=torture.preload(library), MWPSTORE_FAULT_PATH=os.path.join(store, "index"), MWPSTORE_FAIL_SYNC_FROM="1")
    assert _python(code, env).stdout.strip() == "typed STORAGE_FAILED"
