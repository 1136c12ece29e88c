"""Fixtures shared by the test files."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from segment_readers import scratch_directory


@pytest.fixture
def scratch() -> Iterator[str]:
    """A scratch directory for segment files (in memory where possible), removed afterwards."""
    directory = scratch_directory()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread (``_thread.interrupt_main`` included)
    for the test. A process started in the background by a non-interactive shell, as CI may start
    the suite, inherits SIGINT ignored, and Python then installs no handler of its own."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def synced_directories(monkeypatch) -> list[str]:
    """The directories fsynced through ``_files.fsync_directory`` (as ``snapshot`` imports it too),
    in order; each is still synced."""
    import os

    from mwpstore import _files
    from mwpstore import snapshot as snapshot_module

    paths: list[str] = []
    real = _files.fsync_directory

    def recording(directory: str) -> None:
        paths.append(os.path.abspath(directory))
        real(directory)

    monkeypatch.setattr(_files, "fsync_directory", recording)
    monkeypatch.setattr(snapshot_module, "fsync_directory", recording)
    return paths
