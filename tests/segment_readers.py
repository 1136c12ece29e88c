"""The two readers of a segment log directory that the differential tests compare: the C log
(through ``SegmentLog``) and the Python reference reader (``mwpstore.segment_reference``), each
as a plain value — the records served with the end, or the damage named."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from mwpstore import segment_log
from mwpstore.errors import Corruption
from mwpstore.segment_log import CLEAN_FILE_NAME, SegmentLog
from mwpstore.segment_reference import read_log


def c_read(directory: str, batch_records: int = 3):
    """What the C log serves a reader of ``directory`` as it is (a clean marker is honoured)."""
    try:
        with SegmentLog.open(directory, readonly=True) as log:
            records = [(p, bytes(r)) for batch in log.scan(0, batch_records=batch_records) for p, r in zip(batch.positions, batch.records)]
            return ("records", records, log.end)
    except Corruption as exc:
        return ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"])


def c_read_recovered(directory: str, batch_records: int = 3):
    """``c_read`` on the recovery path: the reference reader implements the format's recovery,
    and the clean-close marker only lets the C log skip that scan, so it is removed first."""
    marker = os.path.join(directory, CLEAN_FILE_NAME)
    if os.path.exists(marker):
        os.remove(marker)
    return c_read(directory, batch_records)


def reference_read(directory: str):
    try:
        log = read_log(directory)
        return ("records", log.records, log.end)
    except Corruption as exc:
        return ("corruption", exc.detail["reason"], exc.detail["segment"], exc.detail["offset"])


def files_of(directory: str) -> dict[str, bytes]:
    """Every file of a log directory but its LOCK, by name: to check that nothing was changed."""
    contents = {}
    for name in sorted(os.listdir(directory)):
        if name != "LOCK":
            with open(os.path.join(directory, name), "rb") as file:
                contents[name] = file.read()
    return contents


def scratch_directory(prefix: str = "mwpstore-segments-") -> str:
    """A new directory for segment files, in memory (/dev/shm) where that is writable."""
    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)


@contextlib.contextmanager
def directory_switched_at_open(
    monkeypatch, directory: str, *, at_open: int = 1, complete_at: int | None = None, **options
) -> Iterator[list[SegmentLog]]:
    """As a compaction's switch: at the ``at_open``-th segment file a log open takes by name, the
    directory is renamed to ``directory + ".old"`` and a new log, opened with ``options`` and given
    one record, takes its name, its writer still holding it. With ``complete_at`` the new log takes
    the name only at the ``complete_at``-th file taken by name: the ones between are taken in the
    moment between the switch's two renames, when no file has its name. Yields the list that then
    holds that writer; closes it at the end."""
    real, opened, writers = segment_log._open_segment_fd, [], []
    complete_at = at_open if complete_at is None else complete_at

    def open_segment_fd(path):
        opened.append(path)
        if len(opened) == at_open:
            os.rename(directory, directory + ".old")
        if len(opened) == complete_at:
            writers.append(SegmentLog.open(directory, **options))
            writers[0].append([b"new"])
        return real(path)

    monkeypatch.setattr(segment_log, "_open_segment_fd", open_segment_fd)
    try:
        yield writers
    finally:
        for writer in writers:
            writer.close()
