"""Every ```python block of ``docs/api.md`` runs, each in a fresh temporary directory as the
working directory and a fresh namespace, and none raises. The examples assert what they show,
so a block that runs is a block that still tells the truth."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api.md")
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(path: str) -> list[tuple[int, str]]:
    """(line number, source) of every ```python fenced block in ``path``."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    return [(text.count("\n", 0, match.start()) + 2, match.group(1)) for match in _BLOCK.finditer(text)]


BLOCKS = python_blocks(API)


def test_api_doc_has_examples() -> None:
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize(("line", "source"), BLOCKS, ids=[f"api.md:{line}" for line, _ in BLOCKS])
def test_api_example_runs(line: int, source: str, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{API}:{line}", "exec")
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    exec(code, namespace)  # noqa: S102 - the documentation's own examples
