"""The names the documentation pages use are the code's: every call a page writes names a callable
that takes what it shows; every error code, constant and environment variable in capitals is one
the code has; every `reason`, `check` and `field` value a page names is one the code raises; every
command-line option is one a command takes; every file, test and domain tag named exists; the
store layout of docs/operations.md is what a store holds; the exit codes are the command line's.

``tests/test_docs.py`` runs the examples and checks the signatures, record fields, bounds and
command lines the pages write out in full; this file checks the names scattered through the prose.
docs/reliability.md, docs/performance.md and docs/benchmarks.md are records of runs, kept by their
own tools, and are left out where they quote other programs' names (compiler flags, Linux
constants)."""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import pkgutil
import re
import stat

import pytest

import mwpstore
from authority_helpers import GROUP, OWNER, group_create, mission_create
from mwpstore import errors
from test_docs import ROOT, _UNITS, _subcommand_parsers, documentation_pages, page_text

# Pages written by hand about the code (the run records are left out, see the module docstring).
RUN_RECORDS = {"docs/reliability.md", "docs/performance.md", "docs/benchmarks.md"}
PAGES = [os.path.relpath(path, ROOT) for path in documentation_pages()]
REFERENCE_PAGES = [page for page in PAGES if page not in RUN_RECORDS]
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(page: str) -> str:
    """The page without its fenced blocks, every run of whitespace one space."""
    return " ".join(_FENCE.sub("", page_text(page)).split())


def _modules() -> dict[str, object]:
    """Every module of the package by its short name (`canonical`, `_apply_c`, ...)."""
    found: dict[str, object] = {}
    for info in pkgutil.iter_modules(mwpstore.__path__):
        if info.name != "__main__":  # running it would parse the test run's argv
            found[info.name] = importlib.import_module(f"mwpstore.{info.name}")
    return found


MODULES = _modules()


def _source_words() -> set[str]:
    """Every word of the code, its tests, benchmarks and CI scripts (not of the pages)."""
    words: set[str] = set()
    for pattern in ("mwpstore/*.py", "csrc/*", "tests/*.py", "tests/native/*", "bench/*.py", ".ci/*", "setup.py"):
        for path in glob.glob(os.path.join(ROOT, pattern)):
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as handle:
                    words |= set(re.findall(r"\w+", handle.read()))
    return words


def _string_literals() -> set[str]:
    """The string literals of the engine's Python and C sources, and the reasons the sealed tables
    build from their `reason` and the kind of damage (`index_checksum`, `agent_order`, ...)."""
    literals: set[str] = set()
    for pattern in ("mwpstore/*.py", "csrc/*.c", "csrc/*.h"):
        for path in glob.glob(os.path.join(ROOT, pattern)):
            with open(path, encoding="utf-8") as handle:
                literals |= set(re.findall(r"\"([\w.]+)\"", handle.read()))
    from mwpstore import agent_store
    from mwpstore.index import Index

    sealed = page_text("mwpstore/_sealed.py")
    kinds = set(re.findall(r"_damage\(\"(\w+)\"", sealed))
    assert {"checksum", "missing", "order"} <= kinds
    tables = [Index] + [value for value in vars(agent_store).values() if isinstance(value, type) and "reason" in vars(value)]
    return literals | {f"{table.reason}_{kind}" for table in tables for kind in kinds}


# -- calls written in the prose ---------------------------------------------------------------------

# What a call's receiver is called in the pages, and what it is.
def _receivers() -> dict[str, list[object]]:
    from mwpstore import agent_store, audit_log, authority, delivery, offline, segment_log, snapshot

    classes = [authority.Authority, authority.Subscription, agent_store.AgentStore, agent_store.AgentTransaction,
               agent_store.ProjectionView, offline.OfflineGuard, delivery.Delivery, snapshot.Keyring,
               snapshot.SigningKey, snapshot.SnapshotRef, audit_log.FileKeyProvider, segment_log.SegmentLog,
               mwpstore.MemoryGroup, mwpstore.AcceptResult]
    receivers: dict[str, list[object]] = {cls.__name__: [cls] for cls in classes}
    receivers.update({name: [module] for name, module in MODULES.items()})
    receivers.update({
        "mwpstore": [mwpstore], "authority": [authority.Authority, authority], "view": [authority.Authority],
        "agent": [agent_store.AgentStore], "tx": [agent_store.AgentTransaction], "guard": [offline.OfflineGuard],
        "delivery": [delivery, delivery.Delivery], "log": [segment_log.SegmentLog], "subscription": [authority.Subscription],
        "signing_key": [snapshot.SigningKey], "result": [mwpstore.AcceptResult],
    })
    return receivers


RECEIVERS = _receivers()
# Receivers that are not mwpstore's, and callables the caller supplies (named as the page names
# the parameter that takes them) or that are arithmetic in the prose.
FOREIGN_RECEIVERS = {"lmdb", "msgspec", "os", "blake3", "time", "struct", "msgpack", "json", "auth"}  # auth: the design brief's
CALLER_SUPPLIED = {"progress", "side_effect", "lookup", "clock", "submit", "sync", "min", "max", "blake3", "fetch", "unwrap", "restore", "apply"}


def _arguments(text: str) -> list[str]:
    """The top-level comma-separated arguments of a written call (brackets, braces and quotes kept whole)."""
    parts, depth, current, quote = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def _written_calls() -> list[tuple[str, str, str, str, str]]:
    """(page, the span, receiver, name, arguments) of every call a page writes in a `code span`
    outside its examples: `name(...)` or `receiver.name(...)`, arguments without parentheses."""
    found = []
    for page in REFERENCE_PAGES:
        text = _prose(page)
        text = text.replace("the brief's `redact(group, seq, reason, actor)`", "")  # the design brief's, compared
        for match in re.finditer(r"`((?:[\w]+\.)*)(\w+)\(([^`()]*)\)(?: -> [^`]*)?`", text):
            receiver = match.group(1).rstrip(".").split(".")[-1] if match.group(1) else ""
            found.append((page, match.group(0), receiver, match.group(2), match.group(3)))
    return found


CALLS = _written_calls()


def test_the_pages_write_calls() -> None:
    assert len(CALLS) >= 100
    assert {page for page, *_ in CALLS} >= {"docs/api.md", "docs/agent-store.md", "docs/operations.md", "docs/work-model.md"}


def _value(text: str) -> object:
    """A default as a page writes it (`64 MiB`, `True`, `""`); ``...`` when it is no literal."""
    text = re.sub(r"^(\d+) (KiB|MiB|GiB)$", lambda match: str(int(match.group(1)) * _UNITS[match.group(2)]), text.strip())
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ...


@pytest.mark.parametrize(("page", "span", "receiver", "name", "arguments"), CALLS, ids=[f"{page}: {span}" for page, span, *_ in CALLS])
def test_every_call_the_pages_write_takes_what_they_show(page: str, span: str, receiver: str, name: str, arguments: str) -> None:
    """A call in the prose names a callable of mwpstore (on the receiver the page gives it, or on
    any public class or module when it gives none) that takes every keyword the page shows and at
    least as many positional arguments as it shows. Where the page writes a signature (with `*`),
    each literal after `=` is the parameter's default; elsewhere it is a value passed."""
    if receiver in FOREIGN_RECEIVERS or (not receiver and name in CALLER_SUPPLIED):
        return
    if receiver and receiver not in RECEIVERS:
        raise AssertionError(f"{page}: {span}: no receiver called {receiver!r} is known to this test (add it to RECEIVERS)")
    owners = RECEIVERS[receiver] if receiver else [owner for owners in RECEIVERS.values() for owner in owners]
    callables = [getattr(owner, name) for owner in owners if callable(getattr(owner, name, None))]
    assert callables, f"{page}: {span}: no {name} on {receiver or 'any public class or module'}"
    signature_written = "*" in _arguments(arguments)
    keywords = {}
    positional = []
    after_star = False
    for argument in _arguments(arguments):
        if argument == "*":
            after_star = True
        elif re.fullmatch(r"\w+ *=.*", argument):
            keyword, _, default = argument.partition("=")
            keywords[keyword.strip()] = default
        elif after_star and re.fullmatch(r"\w+", argument):  # a keyword-only parameter
            keywords[argument] = "..."
        elif argument not in ("…", "...", "**"):
            positional.append(argument)
    reasons = []
    for function in callables:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin or C function without a signature
            return
        parameters = [parameter for parameter in signature.parameters.values() if parameter.name not in ("self", "cls")]
        takes_positional = [parameter for parameter in parameters if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
        by_name = {parameter.name: parameter for parameter in parameters}
        unknown = [keyword for keyword in keywords if keyword not in by_name]
        wrong = [keyword for keyword, default in keywords.items() if signature_written and keyword in by_name and _value(default) is not ...
                 and by_name[keyword].default is not inspect.Parameter.empty and _value(default) != by_name[keyword].default]
        if any(parameter.kind is parameter.VAR_POSITIONAL for parameter in parameters):
            takes_positional = parameters
        if inspect.isclass(function) and parameters and all(parameter.kind is parameter.KEYWORD_ONLY for parameter in parameters):
            # a record, written with its fields: all of them, in order
            if not keywords and positional == list(by_name):
                return
            reasons.append(f"{signature}: the record's fields are {list(by_name)}")
            continue
        if not unknown and not wrong and len(positional) <= len(takes_positional):
            return
        reasons.append(f"{signature}: unknown {unknown}, other defaults {wrong}, {len(positional)} positional shown")
    raise AssertionError(f"{page}: {span} is not how the code is called: {reasons}")


def test_a_call_with_a_keyword_the_code_does_not_take_fails() -> None:
    """The check above can fail: a keyword the callable does not have, a default it does not have."""
    with pytest.raises(AssertionError, match="not how the code is called"):
        test_every_call_the_pages_write_takes_what_they_show("p", "`agent.restore(data, groups=...)`", "agent", "restore", "data, groups=...")
    with pytest.raises(AssertionError, match="not how the code is called"):
        test_every_call_the_pages_write_takes_what_they_show("p", "`agent.restore(data, *, group, org=None, high_water_seq=1)`", "agent", "restore", "data, *, group, org=None, high_water_seq=1")
    with pytest.raises(AssertionError, match="no ack"):
        test_every_call_the_pages_write_takes_what_they_show("p", "`tx.ack(group)`", "tx", "ack", "group")


# -- dotted names -----------------------------------------------------------------------------------


def _dotted_names() -> list[tuple[str, str]]:
    """(page, name) for every `module.name` (or `mwpstore.module.name`) span of a module of the
    package, with or without a call after it."""
    found = []
    # `authority` and `index` also name a store's files (`authority.lock`, `index.old`) and an
    # Authority in the examples (`authority.path`): only `mwpstore.authority.x` is the module's.
    modules = "|".join(re.escape(name) for name in MODULES if name not in ("authority", "index"))
    for page in REFERENCE_PAGES:
        for match in re.finditer(rf"`(?:mwpstore\.)?((?:{modules})\.\w+(?:\.\w+)?)(?:\([^`]*\))?`|`mwpstore\.((?:authority|index)\.\w+)", _prose(page)):
            found.append((page, match.group(1) or match.group(2)))
    return sorted(set(found))


DOTTED = _dotted_names()


@pytest.mark.parametrize(("page", "name"), DOTTED, ids=[f"{page}: {name}" for page, name in DOTTED])
def test_every_dotted_name_the_pages_give_exists(page: str, name: str) -> None:
    obj: object = MODULES[name.split(".")[0]]
    for part in name.split(".")[1:]:
        assert hasattr(obj, part), f"{page}: `{name}`: {part} does not exist"
        obj = getattr(obj, part)


def test_the_pages_give_dotted_names() -> None:
    assert len(DOTTED) >= 20


# -- names in capitals ------------------------------------------------------------------------------

# Linux and C names the pages quote that are not mwpstore's.
OPERATING_SYSTEM_NAMES = {"FALLOC_FL_ZERO_RANGE", "O_DIRECT", "O_DSYNC", "RWF_DSYNC", "RLIMIT_AS", "ENAMETOOLONG"}


def _capital_names() -> list[tuple[str, str]]:
    found = set()
    for page in PAGES:
        found |= {(page, name) for name in re.findall(r"`(?:\$|limits\.)?([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)`", page_text(page)) if len(name) >= 3}
    return sorted(found)


CAPITAL_NAMES = _capital_names()
SOURCE_WORDS = _source_words()


def test_the_pages_name_error_codes_and_constants() -> None:
    names = {name for _, name in CAPITAL_NAMES}
    assert set(errors.ERROR_CLASSES) - {"MWP_ERROR", "REJECTED"} <= names
    assert len(names) >= 60


@pytest.mark.parametrize(("page", "name"), CAPITAL_NAMES, ids=[f"{page}: {name}" for page, name in CAPITAL_NAMES])
def test_every_name_in_capitals_is_the_code_s(page: str, name: str) -> None:
    """An error code, a constant, a fail point or environment variable: the code has it."""
    known = name in errors.ERROR_CLASSES or name in OPERATING_SYSTEM_NAMES or name in SOURCE_WORDS
    assert known, f"{page} names `{name}`, which is no error code and appears nowhere in the code"


def test_every_code_of_the_errors_table_is_an_error_code_of_its_class() -> None:
    """docs/api.md's Errors table, the other way round from tests/test_public_surface.py: each
    code in its first column is a code of errors.py, of the class its second column names."""
    api = page_text("docs/api.md")
    table = api[api.index("\n## Errors\n") :]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 30
    for row in rows:
        codes = re.findall(r"`(\w+)`", row[0])
        classes = re.findall(r"`(\w+)`", row[1].split("(")[0])
        assert len(codes) == len(classes), row
        for code, name in zip(codes, classes):
            assert code in errors.ERROR_CLASSES, f"docs/api.md's Errors table names {code}, which errors.py does not have"
            assert errors.ERROR_CLASSES[code].__name__ == name, f"{code} is {errors.ERROR_CLASSES[code].__name__}, not {name}"


# -- reason, check and field values -----------------------------------------------------------------

_LISTED = r"((?:`[a-z_.]+`(?:, (?:or |and )?| or | and | / )?)+)"


def _named_values() -> list[tuple[str, str, str]]:
    """(page, what, value) for every value a page gives an error's `reason`, `check` or `field`:
    "`reason` `x`", "reason `x`, `y` or `z`", "`check` `x`", "`field` `x`", "field `x`"."""
    found = set()
    for page in REFERENCE_PAGES:
        text = _prose(page)
        for what, pattern in (("reason", r"`?reason`?"), ("check", r"`check`"), ("field", r"`?field`?")):
            for match in re.finditer(pattern + r":? " + _LISTED, text):
                found |= {(page, what, value) for value in re.findall(r"`([a-z_.]+)`", match.group(1))}
    return sorted(found)


NAMED_VALUES = _named_values()
LITERALS = _string_literals()


def test_the_pages_name_reasons_checks_and_fields() -> None:
    kinds = {what for _, what, _ in NAMED_VALUES}
    assert kinds == {"reason", "check", "field"} and len(NAMED_VALUES) >= 50


@pytest.mark.parametrize(("page", "what", "value"), NAMED_VALUES, ids=[f"{page}: {what} {value}" for page, what, value in NAMED_VALUES])
def test_every_reason_check_and_field_the_pages_name_is_one_the_code_gives(page: str, what: str, value: str) -> None:
    """A value of `reason`, `check` or `field` is a string the engine writes (a field under
    `body.` is the body field's name, given by the rules that check it)."""
    name = value.removeprefix("body.contract.").removeprefix("body.")
    assert name in LITERALS, f"{page} names {what} `{value}`, which the code never gives"


# -- command-line options ---------------------------------------------------------------------------


def _options() -> list[tuple[str, str]]:
    found = set()
    for page in REFERENCE_PAGES:
        found |= {(page, option) for option in re.findall(r"`(--?[a-z][a-z-]*)`", page_text(page))}
    return sorted(found)


OPTIONS = _options()


@pytest.mark.parametrize(("page", "option"), OPTIONS, ids=[f"{page}: {option}" for page, option in OPTIONS])
def test_every_option_the_pages_name_is_one_a_command_takes(page: str, option: str) -> None:
    from mwpstore.cli import build_parser

    taken = {string for parser in [build_parser(), *_subcommand_parsers().values()] for action in parser._actions for string in action.option_strings}
    assert option in taken, f"{page} names `{option}`, which no mwpstore command takes"


def test_the_pages_name_options() -> None:
    assert {"--json", "--store", "-f", "--after", "--timeout"} <= {option for _, option in OPTIONS}


# -- files, tests and domain tags the pages name ----------------------------------------------------


def _named_files() -> list[tuple[str, str]]:
    found = set()
    for page in REFERENCE_PAGES:
        for path in re.findall(r"(?<![\w/])((?:mwpstore|csrc|tests|bench|\.ci)/[\w./-]*\w)", page_text(page)):
            if not re.fullmatch(r"mwpstore/[a-z-]+/v\d", path):  # a domain tag, checked below
                found.add((page, path))
    return sorted(found)


NAMED_FILES = _named_files()


@pytest.mark.parametrize(("page", "path"), NAMED_FILES, ids=[f"{page}: {path}" for page, path in NAMED_FILES])
def test_every_file_the_pages_name_exists(page: str, path: str) -> None:
    assert os.path.exists(os.path.join(ROOT, path)), f"{page} names {path}, which does not exist"


def _test_names() -> str:
    text = ""
    for path in glob.glob(os.path.join(ROOT, "tests", "*.py")):
        with open(path, encoding="utf-8") as handle:
            text += handle.read()
    return text


def _named_tests() -> list[tuple[str, str, str]]:
    """(page, file or "", name or name prefix ending in `_`) for `tests/f.py::test_x`, `test_x`
    and `test_x_*`."""
    found = set()
    for page in REFERENCE_PAGES:
        text = page_text(page)
        found |= {(page, file, name) for file, name in re.findall(r"(tests/\w+\.py)::(test_\w+)", text)}
        found |= {(page, "", name) for name in re.findall(r"`(test_\w+?)(?:\*)?`", text)}
    return sorted(found)


NAMED_TESTS = _named_tests()
ALL_TESTS = _test_names()


@pytest.mark.parametrize(("page", "file", "name"), NAMED_TESTS, ids=[f"{page}: {file}::{name}" for page, file, name in NAMED_TESTS])
def test_every_test_the_pages_name_exists(page: str, file: str, name: str) -> None:
    source = page_text(file) if file else ALL_TESTS
    pattern = rf"def {name}" + ("" if name.endswith("_") else r"\b")
    assert re.search(pattern, source), f"{page} names the test {file + '::' if file else ''}{name}, which does not exist"


def test_the_pages_name_tests_and_files() -> None:
    assert len(NAMED_TESTS) >= 20 and len(NAMED_FILES) >= 40


def test_every_domain_tag_the_pages_name_is_the_code_s() -> None:
    """`"mwpstore/<purpose>/v1\\0"` and the audit log's key context: the bytes the code hashes."""
    code = "".join(page_text(os.path.relpath(path, ROOT)) for path in glob.glob(os.path.join(ROOT, "mwpstore", "*.py")))
    tags = {tag for page in REFERENCE_PAGES for tag in re.findall(r"mwpstore/[a-z-]+/v\d|mwpstore 2026 [a-z -]+ v\d", page_text(page))}
    assert len(tags) >= 9
    assert sorted(tag for tag in tags if tag not in code) == []


# -- the store layout of docs/operations.md ---------------------------------------------------------


def _layout() -> list[tuple[str, str]]:
    """(path pattern, description) of every entry of the tree in docs/operations.md, "What is on
    disk": placeholders as `*`, directories ending in `/`."""
    text = page_text("docs/operations.md")
    start = text.index("```\n<store>/\n") + 4
    block = text[start : text.index("```", start)]
    entries: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in re.sub(r"<[^>]*>", "*", block).splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        name, _, description = line.strip().partition("  ")
        if indent >= 16 or name == "…":  # the description goes on, or "more of the same"
            entries[-1] = (entries[-1][0], f"{entries[-1][1]} {line.strip()}")
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        if path.endswith("/"):
            stack.append((indent, path))
        entries.append((path, description.strip()))
    return entries


def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile(re.escape(entry).replace(r"\*", "[^/]+"))


def test_the_store_layout_in_operations_md_is_what_a_store_holds(tmp_path) -> None:
    """Every file and directory the tree lists is in a store that has used every feature (a
    snapshot, an archive, a rotated key, a snapshot again after it, a bulk-mode writer open), with
    the mode and the size in bytes the tree states; and every file of that store is listed."""
    from mwpstore.authority import Authority

    path = str(tmp_path / "store")
    with Authority.open(path) as authority:
        authority.accept(group_create())
        authority.accept(mission_create("m-1"))
        authority.snapshot(GROUP)
        authority.rotate_signing_key()
        authority.snapshot(GROUP)  # the same head, signed again: <seq>-<key id>.snap
        authority.accept(group_create(group="g-2", action_id="c-2"))
        authority.archive("g-2", actor=OWNER, action_id="c-3")
    with Authority.open(path, sync=False):  # a bulk-mode writer: log/BULK while it is open
        held = {os.path.relpath(os.path.join(directory, name), path) + ("/" if name in dirs else "")
                for directory, dirs, files in os.walk(path) for name in dirs + files}
        stats = {name: os.stat(os.path.join(path, name)) for name in held}
    entries = _layout()
    assert len(entries) >= 15
    for entry, description in entries:
        matches = [name for name in held if _pattern(entry).fullmatch(name)]
        assert matches, f"docs/operations.md lists {entry}, which the store does not hold ({sorted(held)})"
        mode = re.search(r"mode (0[0-7]{3})", description)
        size = re.search(r"(\d+) bytes", description)
        for name in matches:
            info = stats[name]
            if mode:
                assert stat.S_IMODE(info.st_mode) == int(mode.group(1), 8), f"{name} has mode {stat.S_IMODE(info.st_mode):o}, the page says {mode.group(1)}"
            if size and not name.endswith("/"):
                assert info.st_size == int(size.group(1)), f"{name} is {info.st_size} bytes, the page says {size.group(1)}"
    listed = {name for name in held if any(_pattern(entry).fullmatch(name) for entry, _ in entries)}
    listed |= {name for name in held if name.endswith("/") and any(other.startswith(name) for other in listed)}
    unlisted = sorted(name for name in held - listed if not name.startswith("index/"))
    assert unlisted == [], f"the store holds files docs/operations.md does not list: {unlisted}"


# -- index presence tags, exit codes ----------------------------------------------------------------


def test_the_index_presence_tags_are_the_code_s() -> None:
    from mwpstore.index import PRESENCE_TAGS

    text = _prose("docs/format/index.md")
    row = text[text.index("| `presence` |") :]
    row = row[: row.index("| empty |")]
    assert {name.encode(): tag.encode() for tag, name in re.findall(r"`(\w)` (\w+)", row)} == PRESENCE_TAGS


def test_the_exit_codes_the_pages_list_are_the_command_line_s() -> None:
    """README.md and docs/operations.md list the exit codes with their meanings."""
    from mwpstore import cli

    meanings = {cli.EXIT_OK: "success", cli.EXIT_CHECK_FAILED: "a check failed", cli.EXIT_USAGE: "bad usage",
                cli.EXIT_STORE_ERROR: "a store error", cli.EXIT_INTERRUPTED: "interrupted",
                cli.EXIT_BROKEN_PIPE: "the reader of standard output went away"}
    assert set(meanings) == {value for name, value in vars(cli).items() if name.startswith("EXIT_")}
    for page in ("README.md", "docs/operations.md"):
        text = page_text(page, flat=True)
        listing = text[text.index("Exit codes:") :]
        listing = listing[: listing.index(meanings[cli.EXIT_BROKEN_PIPE]) + 60]
        for code, meaning in meanings.items():
            assert re.search(rf"(?:^|[:;,] ){code} {meaning}", listing), f"{page} does not say exit {code} is {meaning!r}"
