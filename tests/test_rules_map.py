"""``docs/rules.md`` maps every rule id of the protocol section to code and tests.

Fails when a rule id of the seed has no row, when a row names a test that does not exist, or when a
rule has no test at all. Tests are collected by parsing ``tests/*.py`` for ``def test_…``.
"""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "docs", "rules.md")
RULE_ID = re.compile(r"MWP-[A-Z]+-\d+")
TEST_REF = re.compile(r"(tests/[A-Za-z0-9_]+\.py)::(test_[A-Za-z0-9_]+)")


def seed_path() -> str | None:
    """The protocol section: ``shared/seed/`` beside the repository (or ``$MWPSTORE_SEED_FILE``)."""
    candidates = [os.environ.get("MWPSTORE_SEED_FILE", "")]
    for shared in (os.path.join(os.path.dirname(ROOT), "shared"), os.path.join(ROOT, "shared")):
        candidates += sorted(glob.glob(os.path.join(shared, "seed", "000_*.txt")))
    return next((path for path in candidates if path and os.path.isfile(path)), None)


SEED = seed_path()
needs_seed = pytest.mark.skipif(SEED is None, reason="the protocol section (shared/seed/000_*.txt) is not beside the repository")


def seed_rule_ids() -> set[str]:
    assert SEED is not None
    with open(SEED, encoding="utf-8") as handle:
        return set(RULE_ID.findall(handle.read()))


def rule_rows() -> dict[str, list[tuple[str, str]]]:
    """Rule id -> the (file, test) pairs named in its table row of docs/rules.md."""
    rows: dict[str, list[tuple[str, str]]] = {}
    with open(RULES, encoding="utf-8") as handle:
        for line in handle:
            if not line.startswith("|"):
                continue
            first = line.split("|")[1].strip()
            if RULE_ID.fullmatch(first):
                assert first not in rows, f"{first} has two rows"
                rows[first] = TEST_REF.findall(line)
    return rows


def collected_tests() -> dict[tuple[str, str], str]:
    """(file, test name) -> docstring ("" if none), for every ``def test_…`` in tests/*.py."""
    found: dict[tuple[str, str], str] = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
        relative = "tests/" + os.path.basename(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                found[(relative, node.name)] = ast.get_docstring(node) or ""
    return found


def naming_tests(rule: str, tests: dict[tuple[str, str], str]) -> list[tuple[str, str]]:
    """Tests whose name or docstring holds ``rule`` (``wrk_013`` or ``MWP-WRK-013``, any case)."""
    short = rule.removeprefix("MWP-").replace("-", "_").lower()
    return [
        key for key, doc in tests.items()
        if short in key[1].lower() or rule.lower() in doc.lower() or short in doc.lower()
    ]


@needs_seed
def test_seed_has_rule_ids() -> None:
    assert len(seed_rule_ids()) >= 10


@needs_seed
def test_every_rule_id_has_a_row() -> None:
    missing = sorted(seed_rule_ids() - set(rule_rows()))
    assert not missing, f"docs/rules.md has no row for {missing}"


@needs_seed
def test_rows_name_only_rule_ids_of_the_seed() -> None:
    unknown = sorted(set(rule_rows()) - seed_rule_ids())
    assert not unknown, f"docs/rules.md has rows for ids the seed does not define: {unknown}"


def test_rows_name_only_existing_tests() -> None:
    tests = collected_tests()
    with open(RULES, encoding="utf-8") as handle:
        named = TEST_REF.findall(handle.read())
    assert named
    missing = sorted({f"{path}::{name}" for path, name in named if (path, name) not in tests})
    assert not missing, f"docs/rules.md names tests that do not exist: {missing}"


@needs_seed
def test_every_rule_has_a_test() -> None:
    """A rule is tested when a test names it, or its row lists at least one existing test."""
    tests = collected_tests()
    rows = rule_rows()
    untested = sorted(
        rule for rule in seed_rule_ids()
        if not naming_tests(rule, tests) and not any(ref in tests for ref in rows.get(rule, []))
    )
    assert not untested, f"rules without any test: {untested}"


@needs_seed
def test_every_rule_id_is_named_by_a_test() -> None:
    """Stricter: some test's name or docstring holds the id. Tested-but-unnamed rules are an
    expected failure that lists them; a rule with no test at all fails above."""
    tests = collected_tests()
    unnamed = sorted(rule for rule in seed_rule_ids() if not naming_tests(rule, tests))
    if unnamed:
        pytest.xfail(f"tested (see docs/rules.md) but no test names them yet: {', '.join(unnamed)}")


def test_naming_rule_matches_name_and_docstring_forms() -> None:
    tests = {("tests/a.py", "test_wrk_013_lease"): "", ("tests/b.py", "test_other"): "Shows MWP-EVT-003."}
    assert naming_tests("MWP-WRK-013", tests) == [("tests/a.py", "test_wrk_013_lease")]
    assert naming_tests("MWP-EVT-003", tests) == [("tests/b.py", "test_other")]
    assert naming_tests("MWP-WRK-014", tests) == []
