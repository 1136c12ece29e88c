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
