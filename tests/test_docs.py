"""Every ```python block of ``README.md`` and of every page under ``docs/`` runs, each in a fresh
temporary directory as the working directory and a fresh namespace, and none raises. The examples
assert what they show, so a block that runs is a block that still tells the truth.

(``bench/README.md``'s block is a template for writing a bench module, not a program; it is not run.)"""

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


def documentation_pages() -> list[str]:
    """README.md and every Markdown page under docs/, in a stable order."""
    pages = [os.path.join(ROOT, "README.md")]
    for directory, _, names in sorted(os.walk(os.path.join(ROOT, "docs"))):
        pages += [os.path.join(directory, name) for name in sorted(names) if name.endswith(".md")]
    return pages


BLOCKS = python_blocks(API)
EXAMPLES = [(path, line, source) for path in documentation_pages() for line, source in python_blocks(path)]


def test_api_doc_has_examples() -> None:
    assert len(BLOCKS) >= 10


def test_every_page_with_an_example_is_collected() -> None:
    collected = {os.path.relpath(path, ROOT) for path, _, _ in EXAMPLES}
    assert {"README.md", "docs/api.md", "docs/overview.md", "docs/agent-store.md", "docs/format/canonical.md"} <= collected


@pytest.mark.parametrize(
    ("path", "line", "source"), EXAMPLES, ids=[f"{os.path.relpath(path, ROOT)}:{line}" for path, line, _ in EXAMPLES]
)
def test_doc_example_runs(path: str, line: int, source: str, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{path}:{line}", "exec")
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_canonical_worked_example_matches_the_code(tmp_path: pytest.TempPathFactory) -> None:
    """The bytes and hashes printed in docs/format/canonical.md are the ones the code computes."""
    import blake3
    import msgspec

    import mwpstore
    from mwpstore import canonical
    from mwpstore.messages import command_bytes, recompute_event_hash

    with open(os.path.join(ROOT, "docs", "format", "canonical.md"), encoding="utf-8") as handle:
        text = handle.read()
    command = mwpstore.Command(actor="alice", action_id="a-1", group="g-1", kind="group.create", target="g-1", body={"org": "acme"})
    data = command_bytes(command)
    with mwpstore.Authority.open(str(tmp_path) + "/authority", clock=lambda: 1767225600000) as authority:
        receipt = authority.accept(command)
        event = authority.read("g-1")[0]
    encoder = msgspec.msgpack.Encoder(order="sorted")
    header = encoder.encode([event.group, event.seq, event.event_id, event.kind, event.aggregate, event.revision,
                             event.actor, event.action_id, event.content_hash, event.accepted_at_ms, event.authoritative])
    effects = encoder.encode(event.effects)
    assert data.decode() in text and f"({len(data)} bytes)" in text
    assert canonical.content_hash(data).hex() in text
    assert canonical.canonical_bytes(event.body).decode() in text
    assert event.payload_hash.hex() in text
    assert f"{len(header)} bytes of msgpack" in text and f"{len(effects)} bytes of msgpack" in text
    assert blake3.blake3(effects).hexdigest() in text
    assert recompute_event_hash(event) == event.hash == receipt.event_hash
    assert event.hash.hex() in text


def test_index_worked_example_matches_the_code(tmp_path: pytest.TempPathFactory) -> None:
    """The keys and values in docs/format/index.md's worked example are the ones a store writes."""
    import mwpstore
    from mwpstore.index import DATABASE_NAMES, unseal

    with open(os.path.join(ROOT, "docs", "format", "index.md"), encoding="utf-8") as handle:
        text = handle.read()
    for name in DATABASE_NAMES:
        assert f"| `{name.decode()}` |" in text, name
    with mwpstore.Authority.open(str(tmp_path) + "/authority", clock=lambda: 1767225600000) as authority:
        authority.accept(mwpstore.Command(actor="alice", action_id="a-1", group="g-1", kind="group.create", target="g-1", body={"org": "acme"}))
        authority.ack("bob", "g-1", 1)
        meta = dict(authority.index.iterate(b"meta"))
        events = list(authority.index.iterate(b"events"))
        receipts = list(authority.index.iterate(b"receipts"))
        states = [key for key, _ in authority.index.iterate(b"states")]
    position = unseal(b"meta", b"log_position", meta[b"log_position"])
    assert f"`{position.hex()}` (position {int.from_bytes(position, 'big')}" in text
    assert [(key, unseal(b"events", key, value)) for key, value in events] == [(b"g-1\x00" + (1).to_bytes(8, "big"), (0).to_bytes(8, "big"))]
    receipt_value = unseal(b"receipts", receipts[0][0], receipts[0][1])
    assert receipts[0][0] == b"alice\x00a-1" and f"msgpack receipt ({len(receipt_value) - 32} bytes)" in text
    assert states == [b"g-1\x00group:g-1", b"g-1\x00member:alice"]
