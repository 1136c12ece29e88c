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


def page_text(relative: str, *, flat: bool = False) -> str:
    """The text of ``relative`` (a path under the repository); ``flat``: every run of whitespace one
    space, so that a phrase matches across the page's line breaks."""
    with open(os.path.join(ROOT, relative), encoding="utf-8") as handle:
        text = handle.read()
    return " ".join(text.split()) if flat else text


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



def test_segment_worked_example_matches_the_code(tmp_path: pytest.TempPathFactory) -> None:
    """The hex dump in docs/format/segment.md is a log the C reader and the reference reader both
    read as one record `hi` ending at 56, and its checksums are the ones the page's rules give."""
    import struct

    from mwpstore.segment_log import SegmentLog
    from mwpstore.segment_reference import crc32c, read_log

    with open(os.path.join(ROOT, "docs", "format", "segment.md"), encoding="utf-8") as handle:
        text = handle.read()
    data = bytearray()
    for dump in re.findall(r"^```\n((?:[0-9a-f]{8}  .*\n)+)```", text, re.MULTILINE):
        for line in dump.splitlines():
            assert int(line[:8], 16) == len(data)
            data += bytes.fromhex(line[10 : 10 + 16 * 3].replace(" ", ""))
    assert len(data) == 64 + 56
    log_id = (0x0102030405060708).to_bytes(8, "little")
    assert struct.unpack_from("<I", data, 60)[0] == crc32c(bytes(data[:60])) == 0x6631588C
    assert struct.unpack_from("<I", data, 64)[0] == crc32c(log_id + bytes(data[68:88])) == 0x6EB16A23
    assert struct.unpack_from("<I", data, 88)[0] == crc32c(log_id + bytes(data[92:120]))
    assert struct.unpack_from("<I", data, 116)[0] == crc32c(log_id + bytes(data[64:68])) == 0x2EB3309A
    directory = tmp_path / "log"
    directory.mkdir()
    (directory / "00000000000000000000.seg").write_bytes(bytes(data) + bytes(65536 - len(data)))
    reference = read_log(str(directory))
    assert (reference.records, reference.end) == ([(0, b"hi")], 56)
    log = SegmentLog.open(str(directory), readonly=True)
    try:
        assert (log.end, log.read(0)) == (56, b"hi")
    finally:
        log.close()
    assert "`log.end` is now 56" in text


def test_snapshot_worked_example_matches_the_code() -> None:
    """The sizes, key id, header, hashes and state bytes in docs/format/snapshot.md's worked
    example are what create_snapshot writes for it."""
    from mwpstore.snapshot import Keyring, SigningKey, create_snapshot, verify_snapshot

    with open(os.path.join(ROOT, "docs", "format", "snapshot.md"), encoding="utf-8") as handle:
        text = handle.read()
    example = text[text.index("## Worked example") : text.index("## Trade-offs")]
    signer = SigningKey.from_seed(bytes(32))
    data = create_snapshot(org="acme", group="g1", seq=1, head_hash=b"\xab" * 32, signer=signer,
                           aggregates=[("group:g1", 1, {"org": "acme", "status": "active"})], created_at_ms=1700000000000)
    header_bytes = int.from_bytes(data[12:16], "little")
    header = data[40 : 40 + header_bytes].decode()
    signature = data[40 + header_bytes : 104 + header_bytes].hex()
    state = data[104 + header_bytes :]
    assert f"The file is {len(data)} bytes" in example
    assert f"header ({header_bytes})" in example and f"state ({len(state)})" in example
    assert signer.key_id in example and signer.public_key.hex()[:8] in example and signer.public_key.hex()[-6:] in example
    assert " ".join(f"{byte:02x}" for byte in data[:8]) in example
    shown = example[example.index(f"header ({header_bytes}):") : example.index("(one line, no spaces)")]
    assert "".join(line.strip() for line in shown.splitlines()[1:]) == header.replace("ab" * 32, "abab…ab")
    assert f"{signature[:8]}…{signature[-8:]}" in example
    assert "".join(re.findall(r"^  ([0-9a-f]{2}(?: {1,2}[0-9a-f]{2})*)", example[example.index("state ("):], re.MULTILINE)).replace(" ", "") == state.hex()
    assert verify_snapshot(data, keyring=Keyring([signer.public_key]), org="acme", group="g1").seq == 1

# -- the command lines the pages show ---------------------------------------------------------------

# What a placeholder in a documented command line stands for, so that the line can be parsed.
_PLACEHOLDERS = {
    "DIR": "store", "GROUP": "g-1", "FILE": "g-1.snap", "PUB": "key.pub", "PUBKEY": "key.pub", "G": "g-1",
    "O": "acme", "ORG": "acme", "SEQ": "1", "N": "1", "SECONDS": "1", "LOG": "audit.log", "SNAP": "g-1.snap",
    "ORG_KEY_DIR": "orgs",
}


def _documented_command_lines(program: str) -> list[tuple[str, str]]:
    """(page, line) for every command line of ``program`` the pages show: a `code span` that starts
    with it (after environment assignments), or a command of a ```sh or plain ``` block
    (continuations joined, `&&` split)."""
    found = []
    for path in documentation_pages():
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        page = os.path.relpath(path, ROOT)
        spans = re.findall(r"`([^`\n]+)`", text)
        for block in re.findall(r"^```(?:sh)?[ \t]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                spans += line.split(" #")[0].split("&&")
        for span in spans:
            words = span.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            command = " ".join(words)
            for prefix in (program, ".venv/bin/" + program):
                if command.startswith(prefix + " "):
                    found.append((page, command[len(prefix) + 1 :]))
    return found


def _argv(arguments: str) -> list[str]:
    """A documented argument string as argv: optional groups with "…" dropped, brackets removed,
    redirections dropped, placeholders replaced."""
    arguments = re.sub(r"\[[^\[\]]*(…|\.\.\.)[^\[\]]*\]", "", arguments)
    words = arguments.replace("[", " ").replace("]", " ").split()
    if ">" in words:
        words = words[: words.index(">")]
    return [_PLACEHOLDERS.get(word, word) for word in words]


MWPSTORE_LINES = _documented_command_lines("mwpstore")


def test_the_pages_show_mwpstore_command_lines() -> None:
    pages = {page for page, _ in MWPSTORE_LINES}
    assert {"docs/operations.md", "docs/reliability.md", "docs/overview.md"} <= pages
    assert len(MWPSTORE_LINES) >= 30


@pytest.mark.parametrize(("page", "arguments"), MWPSTORE_LINES, ids=[f"{page}: {arguments}" for page, arguments in MWPSTORE_LINES])
def test_every_documented_mwpstore_command_line_parses(page: str, arguments: str) -> None:
    """Each `mwpstore ...` line of the pages names a subcommand and options the parser accepts
    (parsed only, not run), and every `--suite` it names exists. A span that only names a command
    (`mwpstore verify`) must name one."""
    from mwpstore import torture
    from mwpstore.cli import _VersionAsked, build_parser

    argv = _argv(arguments)
    if all(re.fullmatch(r"[a-z]+", word) for word in argv):  # a command named in prose: `mwpstore verify`
        assert " ".join(argv) in _subcommands(), f"{page}: `mwpstore {arguments}` is no command"
        return
    try:
        args = build_parser().parse_args(argv)
    except _VersionAsked:  # `mwpstore --version`: parsed, and answered before any command
        return
    except SystemExit as exit:  # argparse: unknown subcommand or option, missing argument
        raise AssertionError(f"{page}: `mwpstore {arguments}` does not parse ({argv})") from exit
    assert set(getattr(args, "suite", None) or []) <= set(torture.SUITES + torture.OPTIONAL_SUITES)


def _subcommand_parsers() -> dict[str, "argparse.ArgumentParser"]:
    """Every runnable command of the parser (`demo`, `snapshot create`, ...) and its parser."""
    import argparse

    from mwpstore.cli import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: str) -> dict[str, argparse.ArgumentParser]:
        found: dict[str, argparse.ArgumentParser] = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.update(walk(sub, f"{prefix} {name}".strip()) or {f"{prefix} {name}".strip(): sub})
        return found

    return walk(build_parser(), "")


def _subcommands() -> set[str]:
    return set(_subcommand_parsers())


def test_the_readme_lists_every_command() -> None:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    listing = re.search(r"`mwpstore ([^`]*)`, each with `--help`", text)
    assert listing, "README.md's Commands section lists the commands as `mwpstore a | b | c`"
    listed = set()
    for entry in " ".join(listing.group(1).split()).split(" | "):
        name, _, actions = entry.partition(" ")
        listed |= {f"{name} {action}" for action in actions.split("|")} if actions else {name}
    assert listed == _subcommands()


def test_every_command_but_bench_takes_json() -> None:
    """README.md: "Every command except `bench` takes `--json`"."""
    assert "Every command except `bench` takes `--json`" in page_text("README.md", flat=True)
    commands = _subcommand_parsers()
    takes_json = {name for name, parser in commands.items() if any("--json" in action.option_strings for action in parser._actions)}
    assert set(commands) - takes_json == {"bench"}


def test_the_operations_table_covers_every_store_command() -> None:
    """Every command that takes --store has a row in docs/operations.md's table."""
    with open(os.path.join(ROOT, "docs", "operations.md"), encoding="utf-8") as handle:
        rows = [line for line in handle if line.startswith("| `mwpstore ")]
    documented = {" ".join(word for word in row.split("`")[1].split()[1:3] if re.fullmatch(r"[a-z]+", word)) for row in rows}
    for command, parser in sorted(_subcommand_parsers().items()):
        if any(action.dest == "store" for action in parser._actions):
            assert command in documented, f"`mwpstore {command}` has no row in docs/operations.md"
    assert "inspect" in documented and "snapshot verify" in documented


AUDIT_LOG_LINES = _documented_command_lines("python -m mwpstore.audit_log")


@pytest.mark.parametrize(("page", "arguments"), AUDIT_LOG_LINES, ids=[f"{page}: {arguments}" for page, arguments in AUDIT_LOG_LINES])
def test_every_documented_audit_log_command_line_parses(page: str, arguments: str, tmp_path, monkeypatch, capsys) -> None:
    """`python -m mwpstore.audit_log ...` as the pages show it: run on files that do not exist, it
    reports a failed check (exit 1), never a usage error (exit 2)."""
    from mwpstore import audit_log

    monkeypatch.chdir(tmp_path)
    try:
        code = audit_log.main(_argv(arguments))
    except SystemExit as exit:
        code = exit.code
    assert code == 1, f"{page}: `python -m mwpstore.audit_log {arguments}` exited {code}"


# -- bounds the pages quote ------------------------------------------------------------------------

_UNITS = {"": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "days": 86_400_000}


def _quoted_bounds() -> list[tuple[str, str, str]]:
    """(page, name, value text) for every `NAME` (or `limits.NAME`, or a code span ending in it,
    `1 ≤ H ≤ NAME`) the pages follow with ` = value` or ` (value)`, or put after a value and up to
    three words (`100,000 values in all (`NAME`)`), where NAME is a bound in mwpstore/limits.py or a module's own."""
    from mwpstore import agent_store, delivery, limits

    known = {name for name in vars(limits) if name.isupper()} | {"BUFFERED_EVENTS_MAX", "STALLED_ROUNDS_MAX"}
    assert {"BUFFERED_EVENTS_MAX", "STALLED_ROUNDS_MAX"} <= set(vars(agent_store)) | set(vars(delivery))
    found = []
    for path in documentation_pages():
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        for match in re.finditer(r"`(?:[^`\n]*? )?(?:limits\.)?([A-Z][A-Z0-9_]+)`(?: = | \()((?:2\*\*\d+|[\d,_]+)(?: (?:KiB|MiB|GiB|days))?)", text):
            if match.group(1) in known:
                found.append((os.path.relpath(path, ROOT), match.group(1), match.group(2)))
        # the other order: value, up to three words, (`NAME`) or (`NAME`: ...)
        for match in re.finditer(r"(?<![\w.,])((?:2\*\*\d+|\d[\d,_]*)(?: (?:KiB|MiB|GiB|days))?)(?:\s+[A-Za-z]+){0,3}\**\s+\(`(?:limits\.)?([A-Z][A-Z0-9_]+)`[:)]", text):
            if match.group(2) in known:
                found.append((os.path.relpath(path, ROOT), match.group(2), match.group(1)))
    return found


BOUNDS = _quoted_bounds()


def test_the_pages_quote_bounds() -> None:
    assert len(BOUNDS) >= 10


@pytest.mark.parametrize(("page", "name", "value"), BOUNDS, ids=[f"{page}: {name} {value}" for page, name, value in BOUNDS])
def test_every_quoted_bound_is_the_code_s(page: str, name: str, value: str) -> None:
    from mwpstore import agent_store, delivery, limits

    actual = getattr(limits, name, None)
    if actual is None:
        actual = getattr(agent_store, name, None) or getattr(delivery, name)
    number, _, unit = value.partition(" ")
    base, _, exponent = number.partition("**")
    stated = int(base.replace(",", "").replace("_", "")) ** (int(exponent) if exponent else 1) * _UNITS[unit]
    assert stated == actual, f"{page} says {name} is {value}; the code has {actual}"


# -- signatures the pages write out ----------------------------------------------------------------


def _signature_targets() -> list[tuple[str, str, str]]:
    """(page, signature as the page writes it, the callable's dotted path) for every call the pages
    write out whole in Python's notation: each parameter in order, `*` before the keyword-only ones,
    defaults as written (sizes in KiB, MiB or GiB)."""
    api, agent, work = "docs/api.md", "docs/agent-store.md", "docs/work-model.md"
    return [
        (api, "Authority.open(path, *, clock=None, sync=True, segment_bytes=64 MiB, map_size=64 GiB, progress=None, check_lmdb=None, create=True, readonly=False)", "mwpstore.authority.Authority.open"),
        (api, "MemoryGroup(group).accept(command, *, now_ms, trusted=False)", "mwpstore.MemoryGroup.accept"),
        (api, "accept(command)", "mwpstore.authority.Authority.accept"),
        (api, "accept_many(commands)", "mwpstore.authority.Authority.accept_many"),
        (api, "accept_trusted(command)", "mwpstore.authority.Authority.accept_trusted"),
        (api, "aggregates(group, *, prefix=\"\")", "mwpstore.authority.Authority.aggregates"),
        (api, "read(group, after=0, limit=1000)", "mwpstore.authority.Authority.read"),
        (api, "subscribe(group, after=0)", "mwpstore.authority.Authority.subscribe"),
        (api, "ack(consumer, group, cursor)", "mwpstore.authority.Authority.ack"),
        (api, "acked(consumer, group)", "mwpstore.authority.Authority.acked"),
        (api, "wait_for(group, after, timeout)", "mwpstore.authority.Authority.wait_for"),
        (api, "expire_leases(group, *, now_ms=None)", "mwpstore.authority.Authority.expire_leases"),
        (api, "snapshot(group)", "mwpstore.authority.Authority.snapshot"),
        (api, "replay_floor(group)", "mwpstore.authority.Authority.replay_floor"),
        (api, "archive_record(group)", "mwpstore.authority.Authority.archive_record"),
        (api, "redact(group, seq, *, actor, action_id, reason)", "mwpstore.authority.Authority.redact"),
        (api, "delete_audit_log(group, *, actor, action_id, reason=\"\", basis=\"retention\")", "mwpstore.authority.Authority.delete_audit_log"),
        (api, "compact(progress=None)", "mwpstore.authority.Authority.compact"),
        (api, "drop_retired_key(key_id)", "mwpstore.authority.Authority.drop_retired_key"),
        (api, "check_snapshot_ref(data, ref)", "mwpstore.snapshot.check_snapshot_ref"),
        (api, "mwpstore.errors.error_from_code(code, message, detail=None)", "mwpstore.errors.error_from_code"),
        (agent, "Delivery(agent, source, *, consumer=None, batch_events=1000, restore_snapshot=None, org=None)", "mwpstore.delivery.Delivery"),
        (agent, "agent.aggregate(group, key)", "mwpstore.agent_store.AgentStore.aggregate"),
        (agent, "agent.checkpoint(group, workitem)", "mwpstore.agent_store.AgentStore.checkpoint"),
        (agent, "agent.projection_get(group, name, key)", "mwpstore.agent_store.AgentStore.projection_get"),
        (agent, "agent.projection_items(group, name)", "mwpstore.agent_store.AgentStore.projection_items"),
        (agent, "agent.mark_uncertain(key, error)", "mwpstore.agent_store.AgentStore.mark_uncertain"),
        (agent, "agent.dispatch(key, side_effect, *, lookup=None)", "mwpstore.agent_store.AgentStore.dispatch"),
        (work, "external_idempotency_key(mission_id, workitem_id, ownership_epoch, operation_id)", "mwpstore.work_model.external_idempotency_key"),
        (work, "attempt_key(mission_id, workitem_id, attempt)", "mwpstore.work_model.attempt_key"),
        (work, "lease_id_for(group_id, workitem_id, ownership_epoch)", "mwpstore.work_model.lease_id_for"),
        (work, "backoff_ms(contract, attempt)", "mwpstore.work_model.backoff_ms"),
        (work, "lapsed_workitems(items, now_ms)", "mwpstore.work_model.lapsed_workitems"),
        (work, "retry_outcome(workitem, now_ms, *, retryable=True)", "mwpstore.work_model.retry_outcome"),
    ]


SIGNATURES = _signature_targets()


def _resolve(dotted: str) -> object:
    import importlib

    module_name, _, rest = dotted.partition(".")
    obj: object = importlib.import_module(module_name)
    for part in rest.split("."):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{getattr(obj, '__name__')}.{part}")
    return obj


@pytest.mark.parametrize(("page", "text", "target"), SIGNATURES, ids=[f"{page}: {text.split('(')[0]}" for page, text, _ in SIGNATURES])
def test_every_written_out_signature_is_the_code_s(page: str, text: str, target: str) -> None:
    """The page shows the call as written (line breaks aside), and it is the code's: as many
    parameters, `*` exactly before the keyword-only ones (a parameter the page shows before it can
    be passed by position), the names of those passed by keyword, and every default."""
    import ast
    import inspect

    assert f"`{text}" in page_text(page, flat=True), f"{page} does not show `{text}`"
    written = text[text.rindex("(", 0, text.rindex("(") + 1) + 1 : -1]
    written = re.sub(r"(\d+) (KiB|MiB|GiB)", lambda match: str(int(match.group(1)) * _UNITS[match.group(2)]), written)
    tokens = [token.strip() for token in written.split(",")] if written.strip() else []
    code = [parameter for parameter in inspect.signature(_resolve(target)).parameters.values() if parameter.name != "self"]
    shown = [token for token in tokens if token != "*"]
    assert len(shown) == len(code), f"{page}: `{text}` has {len(shown)} parameters, the code {[p.name for p in code]}"
    keyword_only = False
    index = 0
    for token in tokens:
        if token == "*":
            keyword_only = True
            continue
        parameter = code[index]
        index += 1
        name, has_default, default = token.partition("=")
        assert (parameter.kind is inspect.Parameter.KEYWORD_ONLY) == keyword_only, f"{page}: `{text}`: {parameter.name} is {parameter.kind.description}"
        if keyword_only or has_default:
            assert name == parameter.name, f"{page}: `{text}` names {name}, the code {parameter.name}"
        if has_default:
            assert parameter.default is not inspect.Parameter.empty and ast.literal_eval(default) == parameter.default, f"{page}: `{text}`: {name} defaults to {parameter.default!r}"
        else:
            assert parameter.default is inspect.Parameter.empty, f"{page}: `{text}`: {name} has a default ({parameter.default!r}) the page does not show"


# -- the fields of the records the pages list ------------------------------------------------------

# (page, where the list starts, where it ends, the record's dotted path, names listed that are
# properties or methods rather than fields)
_RECORD_LISTS = [
    ("docs/api.md", "A `Command` asks to change one Group:", ". IDs are", "mwpstore.Command", ()),
    ("docs/api.md", "An `Event` carries", " (see [format/canonical.md]", "mwpstore.Event", ()),
    ("docs/api.md", "It returns one `AcceptResult` per Command, in order:", ". A rejected Command", "mwpstore.AcceptResult", ("ok", "error", "unwrap")),
    ("docs/api.md", "(an `OpenReport`:", ")", "mwpstore.OpenReport", ()),
    ("docs/api.md", "returns a `SnapshotRef` (", ")", "mwpstore.SnapshotRef", ()),
    ("docs/api.md", "logs an `ArchiveRecord` of both (", ")", "mwpstore.ArchiveRecord", ()),
    ("docs/api.md", "`CompactionReport` (", ";", "mwpstore.CompactionReport", ()),
    ("docs/api.md", "it returns a `VerifyReport` (", ")", "mwpstore.VerifyReport", ("ok",)),
    ("docs/agent-store.md", "| `heads` | `G` | msgpack `[", "]`", "mwpstore.agent_store.GroupHead", ()),
]


def _record_fields(dotted: str) -> list[str]:
    import dataclasses

    import msgspec

    record = _resolve(dotted)
    if isinstance(record, type) and issubclass(record, msgspec.Struct):
        return list(record.__struct_fields__)
    return [field.name for field in dataclasses.fields(record)]


@pytest.mark.parametrize(("page", "start", "end", "target", "extra"), _RECORD_LISTS, ids=[target.rsplit(".", 1)[1] for *_, target, _ in _RECORD_LISTS])
def test_every_record_field_list_is_the_code_s(page: str, start: str, end: str, target: str, extra: tuple[str, ...]) -> None:
    """Where a page lists a record's fields, it lists every field, in the record's order, and
    nothing else but the properties and methods named with it."""
    text = page_text(page, flat=True)
    assert start in text, f"{page} no longer says {start!r}"
    begin = text.index(start) + len(start)
    listing = text[begin : text.index(end, begin)]
    if "`[" in start:  # one code span: `[a, b, c]`
        names = [name.strip() for name in listing.split(",")]
    else:
        names = [name for name in re.findall(r"`(\w+)(?:\(\))?`", listing)]
    fields = _record_fields(target)
    assert [name for name in names if name not in extra] == fields, f"{page}: {target} has {fields}, the page lists {names}"
    assert set(extra) <= set(names)


# -- the work-model transitions table --------------------------------------------------------------


def test_the_transitions_table_names_every_work_model_kind_its_issuer_and_compare_and_set() -> None:
    """docs/work-model.md's Transitions table: one row per work-model kind, its "who" column the
    roles the engine lets issue it (a lease holder is a worker, "the agent" any member, "the
    engine" no member at all) and "yes" in the CAS column exactly for the compare-and-set kinds."""
    from mwpstore import work_model
    from mwpstore.registry import kind_spec

    text = page_text("docs/work-model.md")
    table = text[text.index("| kind | who | CAS |") : text.index("Claim checks run in the order listed")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:] if line.startswith("| `")]
    issuers = {"owner": frozenset({"owner"}), "worker": frozenset({"worker"}), "lease holder": frozenset({"worker"}),
               "approver": frozenset({"approver"}), "the agent": frozenset({"owner", "worker", "approver", "observer"})}
    assert sorted(row[0].strip("`") for row in rows) == sorted(work_model.WORK_MODEL_KINDS)
    for kind, who, cas, *_ in rows:
        spec = kind_spec(kind.strip("`"))
        if who == "the engine":
            assert spec.system_only, kind
        else:
            assert not spec.system_only and spec.roles == issuers[who], f"{kind}: the page says {who}, the code {spec.roles}"
        assert spec.compare_and_set == (cas == "yes"), f"{kind}: CAS column {cas!r}"


# -- links between the pages -----------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _heading_anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lowercased, punctuation but `-` and `_`
    dropped, spaces as `-`; a repeated heading gets `-1`, `-2`, ..."""
    with open(path, encoding="utf-8") as handle:
        text = _FENCE.sub("", handle.read())
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", text, re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        anchors.add(f"{anchor}-{seen[anchor]}" if seen[anchor] else anchor)
    return anchors


def _relative_links() -> list[tuple[str, str]]:
    found = []
    for path in documentation_pages():
        with open(path, encoding="utf-8") as handle:
            text = _FENCE.sub("", handle.read())
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", link):
                found.append((os.path.relpath(path, ROOT), link))
    return found


LINKS = _relative_links()


def test_the_pages_link_to_each_other() -> None:
    assert len(LINKS) >= 50


@pytest.mark.parametrize(("page", "link"), LINKS, ids=[f"{page}: {link}" for page, link in LINKS])
def test_every_relative_link_names_a_file_that_exists_and_a_heading_it_has(page: str, link: str) -> None:
    target, _, fragment = link.partition("#")
    path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else os.path.join(ROOT, page)
    assert os.path.exists(path), f"{page} links to {link}, which does not exist"
    if fragment:
        assert fragment in _heading_anchors(path), f"{page} links to {link}: {os.path.relpath(path, ROOT)} has no such heading"


def test_the_agent_store_layout_table_is_the_code_s() -> None:
    """docs/agent-store.md, "LMDB layout": one row per sub-database, in the code's order; the
    presence tags; the format version the `meta` row names."""
    from mwpstore import agent_store

    text = page_text("docs/agent-store.md")
    table = text[text.index("| database | key | value |") : text.index("Group IDs and projection names are checked IDs")]
    rows = [line.split("|")[1:4] for line in table.splitlines()[2:] if line.startswith("| `")]
    assert [name.strip().strip("`").encode() for name, _, _ in rows] == list(agent_store._DATABASES)
    presence = next(key for name, key, _ in rows if name.strip() == "`presence`")
    assert dict((name.encode(), tag.encode()) for name, tag in re.findall(r"`(\w+)` \(`(\w)`\)", presence)) == agent_store._PRESENCE_TAGS
    meta = next(value for name, _, value in rows if name.strip() == "`meta`")
    assert f"(`{agent_store.FORMAT_VERSION}`:" in meta


def test_the_agent_store_fail_point_table_is_every_agent_fail_point_and_each_is_killed_at() -> None:
    """docs/agent-store.md's fail point table names every `agent.*` fail point the code has, and
    the two test files it names kill a child at each one."""
    text = page_text("docs/agent-store.md")
    table = text[text.index("| fail point | where |") : text.index("`tests/test_agent_store_crash.py` kills")]
    documented = re.findall(r"`(agent\.[a-z_]+)`", table)
    in_code = re.findall(r"failpoints\.hit\(\"(agent\.[a-z_]+)\"\)", page_text("mwpstore/agent_store.py"))
    assert sorted(documented) == sorted(in_code)
    tests = page_text("tests/test_agent_store_crash.py") + page_text("tests/test_agent_store_outbox.py")
    assert [name for name in documented if f'"{name}"' not in tests] == []


def test_the_work_model_state_tables_name_every_field_in_the_order_the_rules_write_them() -> None:
    """docs/work-model.md, "State": the Membership, WorkItem, Execution Lease, Work Contract,
    Approval and Mission tables (and the Approval's list) name the fields of the states the rules
    write, in their order. These names are an interface: agents read them."""
    from work_model_support import Harness

    text = page_text("docs/work-model.md")

    def section(heading: str) -> str:
        start = text.index(f"\n### {heading}")
        return text[start : text.index("\n#", start + 1)]

    def table_fields(heading: str) -> list[str]:
        return [line.split("`")[1] for line in section(heading).splitlines() if line.startswith("| `")]

    h = Harness().setup()
    key = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"  # an Ed25519 public key
    h.accept("owner", "membership.add", "signer", {"role": "worker", "public_key": key}, cas=True)  # every field set
    h.claim("w1", "wi1")
    h.accept("w1", "approval.request", "ap-1", {"workitem": "wi1", "operation": "submit"})
    workitem = h.get("workitem:wi1")
    assert table_fields("Membership") == list(h.get("member:signer"))
    assert table_fields("WorkItem") == list(workitem)
    assert table_fields("Execution Lease") == list(workitem["lease"])
    assert table_fields("Work Contract") == list(workitem["contract"])
    assert table_fields("Mission") == list(h.get("mission:m1"))
    approval = section("Approval").split("\n\n")[1]
    listed = re.sub(r"\([^)]*\)", "", approval.split(". The requester")[0])  # the state's values in parentheses
    assert re.findall(r"`(\w+)`", listed) == list(h.get("approval:ap-1"))
