"""Smoke test of ``bench/count_instructions.py``: every driver runs at a tiny size, without
valgrind, and did the operations it claims. Nothing here counts or asserts speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import count_instructions  # noqa: E402


def test_every_driver_does_the_operations_it_claims(tmp_path: Path) -> None:
    output = tmp_path / "counts.json"
    assert count_instructions.main(["--no-valgrind", "--json", str(output)]) == 0
    result = json.loads(output.read_text(encoding="utf-8"))
    assert result["mode"] == "no-valgrind"
    paths = result["paths"]
    assert set(paths) == {path.name for path in count_instructions.PATHS}
    for name, row in paths.items():
        facts = row["facts"]
        if name == "redo":
            assert facts["mode"] == "redo" and facts["redo_records"] == row["ops"]
        elif name == "accept_duplicate":
            assert facts["replays"] == row["ops"] and facts["appended"] == 0
        elif name == "work_mix":
            assert facts["events"] == row["ops"] * len(count_instructions.bench_work_model.MIX)
        else:
            assert facts["events"] == row["ops"]


def test_a_driver_that_falls_short_of_its_claim_stops_the_run() -> None:
    path = count_instructions.BY_NAME["accept_duplicate"]
    with pytest.raises(SystemExit, match="did not do what it claims"):
        count_instructions.check(path, {"replays": 3, "expected": 4, "appended": 1})


def test_without_valgrind_a_count_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(count_instructions.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="valgrind is not installed"):
        count_instructions.main(["--only", "accept"])
