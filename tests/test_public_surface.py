"""What mwpstore shows the outside: the names `mwpstore` re-exports, the error codes docs/api.md
lists, the command line's exit codes, and the argument checks of the public constructors.

Each test pins one place where the documentation and the code must say the same thing."""

from __future__ import annotations

import os
import re
import types

import pytest

import mwpstore
from authority_helpers import GROUP, open_with_group
from mwpstore import Command, errors
from mwpstore.cli import EXIT_CHECK_FAILED, EXIT_STORE_ERROR, EXIT_USAGE, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as handle:
        return handle.read()


API = _read("docs", "api.md")
ERROR_SUBCLASSES = sorted(
    (value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, errors.MwpError)),
    key=lambda cls: cls.__name__,
)


def _api_section(heading: str) -> str:
    start = API.index(f"\n## {heading}\n")
    end = API.find("\n## ", start + 1)
    return API[start : None if end < 0 else end]


# -- the names mwpstore re-exports ----------------------------------------------------------------


@pytest.mark.parametrize("cls", ERROR_SUBCLASSES, ids=lambda cls: cls.__name__)
def test_every_error_class_is_reexported_at_top_level(cls: type[errors.MwpError]) -> None:
    assert getattr(mwpstore, cls.__name__) is cls
    assert cls.__name__ in mwpstore.__all__


def test_every_error_class_is_in_the_code_table() -> None:
    assert sorted(errors.ERROR_CLASSES.values(), key=lambda cls: cls.__name__) == ERROR_SUBCLASSES


@pytest.mark.parametrize("code", sorted(errors.ERROR_CLASSES), ids=str)
def test_every_error_code_and_its_class_appear_in_the_api_errors_table(code: str) -> None:
    table = _api_section("Errors")
    rows = [line for line in table.splitlines() if line.startswith("| ") and f"`{code}`" in line.split(" | ")[0]]
    assert rows, f"{code} has no row in docs/api.md's Errors table"
    cls = errors.ERROR_CLASSES[code]
    assert f"`{cls.__name__}`" in rows[0]
    # "A class in parentheses is the one it derives from besides MwpError": `except` that parent
    # catches it, and no other class of the table does (e.g. a Rejection is no SEQUENCE_GAP)
    named = re.search(r"\((?:all )?`(\w+)`\)", rows[0].split(" | ")[1])
    parent = errors.MwpError if named is None else getattr(errors, named.group(1))
    assert cls.__bases__ == ((Exception,) if cls is errors.MwpError else (parent,)), f"docs/api.md: {cls.__name__}({parent.__name__})"


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert mwpstore.__all__ == sorted(mwpstore.__all__)
    assert len(set(mwpstore.__all__)) == len(mwpstore.__all__)
    for name in mwpstore.__all__:
        assert getattr(mwpstore, name) is not None, name


def test_the_api_page_names_every_public_name() -> None:
    """The error classes are named in the Errors table (above); every other name in the list."""
    listed = API[API.index("What is public") : API.index("## Opening an authority")]
    error_names = {cls.__name__ for cls in ERROR_SUBCLASSES}
    missing = [name for name in mwpstore.__all__ if name not in error_names and f"`{name}`" not in listed]
    assert missing == []


def test_importing_mwpstore_loads_no_compiled_log_and_each_lazy_name_loads_on_first_use() -> None:
    """docs/api.md: the authority, the agent side and snapshots are "loaded on first use, so that
    importing `mwpstore` does not load the compiled log"; each name the page lists there resolves
    when first used."""
    import subprocess
    import sys

    listed = API[API.index("loaded on first use") : API.index("- Names that live only in their own module")]
    lazy = re.findall(r"`(\w+)`", listed.split(":", 1)[1])
    assert {"Authority", "AgentStore", "verify_snapshot"} <= set(lazy)
    heavy = ["mwpstore.segment_log", "mwpstore._segment_log_c", "mwpstore.authority", "mwpstore.agent_store", "mwpstore.snapshot"]
    script = (
        "import sys, mwpstore\n"
        f"print(sorted(name for name in {heavy!r} if name in sys.modules))\n"
        f"print(all(getattr(mwpstore, name) is not None for name in {lazy!r}))\n"
        "print('mwpstore._segment_log_c' in sys.modules)\n"
    )
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert output.split("\n")[:3] == ["[]", "True", "True"]


# -- the command line's exit codes -----------------------------------------------------------------


@pytest.fixture
def store(tmp_path) -> str:
    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    return path


def test_a_rejection_is_a_usage_error(store, capsys) -> None:
    assert main(["snapshot", "create", "nosuch", "--store", store]) == EXIT_USAGE
    assert "NOT_FOUND" in capsys.readouterr().err


def test_an_invalid_command_is_still_a_usage_error(store, capsys) -> None:
    assert main(["snapshot", "create", "../x", "--store", store]) == EXIT_USAGE
    assert "INVALID_COMMAND" in capsys.readouterr().err


def test_an_invalid_snapshot_is_still_a_failed_check(store, capsys, tmp_path) -> None:
    with mwpstore.Authority.open(store) as authority:
        ref = authority.snapshot(GROUP)
    path = os.path.join(store, ref.location)
    public_key = os.path.join(store, "keys", "snapshot-signing.pub")
    assert main(["snapshot", "verify", path, "--trust", public_key, "--group", "other"]) == EXIT_CHECK_FAILED
    assert "SNAPSHOT_INVALID" in capsys.readouterr().err


def test_a_missing_snapshot_file_is_an_io_error(store, capsys, tmp_path) -> None:
    """docs/operations.md: a file that cannot be read counts as I/O (exit 3)."""
    with mwpstore.Authority.open(store) as authority:
        authority.snapshot(GROUP)
    public_key = os.path.join(store, "keys", "snapshot-signing.pub")
    assert main(["snapshot", "verify", str(tmp_path / "missing.snap"), "--trust", public_key]) == EXIT_STORE_ERROR
    assert "STORAGE_FAILED" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sizes",
    [["--agents", "1"], ["--agents", "17"], ["--workitems", "5"], ["--workitems", "100001"]],
    ids=lambda sizes: " ".join(sizes),
)
def test_demo_sizes_outside_the_help_range_are_usage_errors(tmp_path, capsys, sizes) -> None:
    directory = tmp_path / "demo"
    assert main(["demo", str(directory), *sizes]) == EXIT_USAGE
    assert "INVALID_COMMAND" in capsys.readouterr().err
    assert not directory.exists()  # refused before anything was written


# -- argument checks of the public constructors ----------------------------------------------------


@pytest.mark.parametrize("batch_events", [0, -1, 100_001, "10", 1.5, True])
def test_delivery_batch_size_out_of_range_is_an_invalid_command(tmp_path, batch_events: int) -> None:
    from mwpstore.agent_store import AgentStore
    from mwpstore.delivery import Delivery, ListSource

    with AgentStore.open(str(tmp_path / "agent")) as agent:
        with pytest.raises(mwpstore.InvalidCommand) as caught:
            Delivery(agent, ListSource([]), batch_events=batch_events)
    assert caught.value.field == "batch_events"


@pytest.mark.parametrize(
    "function, name, value",
    [
        ("Delivery", "agent", None),
        ("Delivery", "source", object()),
        ("Delivery", "restore_snapshot", True),
        ("Delivery", "consumer", 7),
        ("Delivery", "org", "a\x00b"),
        ("deliver_batch", "agent", None),
        ("deliver_batch", "stats", {}),
        ("rebuild_group", "source", None),
        ("rebuild_group", "batch_events", 0),
        ("rebuild_group", "restore_snapshot", True),
        ("rebuild_group", "org", "a\x00b"),
        ("rebuild_group", "group", "a/b"),
        ("FaultyTransport", "source", None),
        ("FaultyTransport", "drop", "0.1"),
        ("FaultyTransport", "reorder", float("nan")),
        ("FaultyTransport", "disconnect", 1.5),
        ("FaultyTransport", "replay", -1),
        ("FaultyTransport", "seed", {}),
    ],
    ids=lambda part: part if isinstance(part, str) and part.isidentifier() else type(part).__name__,
)
def test_delivery_arguments_of_the_wrong_kind_are_refused_before_anything_is_read_or_written(tmp_path, function, name, value) -> None:
    """Delivery kept its arguments unchecked: the first round failed with AttributeError or
    TypeError, the restore callback only once the source said CURSOR_TOO_OLD, a consumer only at
    the ACK after each local commit. rebuild_group forgot the Group before Delivery refused its
    batch size (or before its source failed): the Group's copy was gone, nothing read back.
    FaultyTransport's probabilities and replay failed in random's hands at some read. Each is now
    InvalidCommand naming the argument, before a read or a write."""
    from agent_store_support import workload
    from mwpstore.agent_store import AgentStore
    from mwpstore.delivery import Delivery, DeliveryStats, FaultyTransport, ListSource, deliver_batch, rebuild_group

    events = workload(GROUP, 5)
    with AgentStore.open(str(tmp_path / "agent")) as agent:
        deliver_batch(agent, GROUP, events)
        digest = agent.projection_digest()
        reads: list = []

        class Counted(ListSource):
            def read(self, group, after=0, limit=1000):
                reads.append(group)
                return super().read(group, after, limit)

        source = Counted(events)
        with pytest.raises(mwpstore.InvalidCommand) as caught:
            if function == "Delivery":
                Delivery(**{"agent": agent, "source": source, name: value}).catch_up(GROUP)
            elif function == "deliver_batch":
                deliver_batch(**{"agent": agent, "group": GROUP, "events": events, "stats": DeliveryStats(), name: value})
            elif function == "FaultyTransport":
                for _ in range(20):  # a read draws each probability (the disconnect one first)
                    Delivery(agent, FaultyTransport(**{"source": source, "disconnect": 0.5, name: value})).pull_once(GROUP)
            else:
                rebuild_group(**{"agent": agent, "source": source, "group": GROUP, name: value})
        assert caught.value.field == name and reads == []  # nothing read
        assert agent.projection_digest() == digest and agent.cursor(GROUP) == 5  # nothing forgotten or written


def test_offline_guard_refusals_while_online(tmp_path) -> None:
    from mwpstore.agent_store import AgentStore
    from mwpstore.offline import OfflineGuard

    with AgentStore.open(str(tmp_path / "agent")) as agent:
        guard = OfflineGuard(agent, GROUP, "bob", grace_ms=1000)
        with pytest.raises(mwpstore.OfflineRefused) as caught:
            guard.permit("wi-1", now_ms=0, reversible=False)
        assert caught.value.detail["reason"] == "no_current_lease"
        command = Command(actor="bob", action_id="b-1", group=GROUP, kind="workitem.checkpoint", target="wi-1")
        with pytest.raises(mwpstore.OfflineRefused) as caught:
            guard.buffer(command, now_ms=0, reversible=True)
        assert caught.value.detail["reason"] == "online"


def test_every_offline_refusal_reason_is_documented() -> None:
    reasons = set(re.findall(r'reason="([a-z_]+)"', _read("mwpstore", "offline.py")))
    assert {"no_current_lease", "online", "new_work", "grace_expired"} <= reasons
    documented = _read("docs", "agent-store.md")
    assert [reason for reason in sorted(reasons) if f"`{reason}`" not in documented] == []


def test_restoring_a_snapshot_whose_aggregates_are_not_effects_fails_the_schema_check(tmp_path) -> None:
    from mwpstore.agent_store import AgentStore
    from mwpstore.messages import ZERO_HASH

    snapshot = types.SimpleNamespace(org="acme", group=GROUP, seq=3, head_hash=ZERO_HASH, aggregates=[("group:g-1", 1, {})])
    with AgentStore.open(str(tmp_path / "agent")) as agent:
        with pytest.raises(mwpstore.SnapshotInvalid) as caught:
            agent.restore_verified(snapshot, group=GROUP)
        assert agent.head(GROUP).applied_seq == 0  # nothing was written
    assert caught.value.check == "schema"
    assert "`schema`" in _api_section("Snapshots, replay window and CURSOR_TOO_OLD")


# -- every public parameter given a value of the wrong kind ------------------------------------------


class _IntSubclass(int):
    pass


class _StrSubclass(str):
    pass


class _KeysItDoesNotHold(dict):
    """A dict whose keys() and iteration name a key it does not hold."""

    def keys(self):
        return ["absent"]

    def __iter__(self):
        return iter(self.keys())


def _odd_values():
    from hypothesis import strategies as st

    return st.one_of(
        st.sampled_from([None, True, False, -1, 0, 2**63, 2**64, 10**40, 1.5, float("nan"), float("inf"), "", "a\x00b",
                         "a\ud800", "../x", b"g-1", bytearray(b"g-1"), memoryview(b"g-1"), [], ("g-1",), {1}, object()]),
        st.builds(_IntSubclass, st.integers(-3, 3)),
        st.builds(_StrSubclass, st.sampled_from(["g-1", "acme", "m-1"])),
        st.builds(_KeysItDoesNotHold),
        st.integers(),
        st.text(max_size=6),
        st.binary(max_size=6),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )


def test_every_public_parameter_given_a_value_of_the_wrong_kind_is_a_typed_error_and_writes_nothing(tmp_path) -> None:
    """One call of the public surface (the authority, the AgentStore and its outbox, delivery,
    the offline guard, the stable keys, snapshot references, errors), one of its parameters
    replaced by a value of the wrong kind (None, a bool, an int subclass, a float, bytes for text,
    text with a NUL or a lone surrogate, a dict whose keys() lies, ...): it either works or raises
    an ``MwpError``, and a refused call leaves the authority's head, the AgentStore's projections
    and its outbox as they were."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from agent_store_support import workload
    from authority_helpers import mission_create
    from mwpstore import work_keys
    from mwpstore.agent_store import AgentStore
    from mwpstore.delivery import Delivery, FaultyTransport, ListSource
    from mwpstore.errors import error_from_code
    from mwpstore.offline import OfflineGuard
    from mwpstore.registry import MemoryGroup
    from mwpstore.snapshot import Keyring, SnapshotRef, check_snapshot_ref

    authority = open_with_group(str(tmp_path / "authority"))
    authority.accept(mission_create("m-1"))
    reference = authority.snapshot(GROUP)
    data = authority.read_snapshot(reference)
    events = workload(GROUP, 8)
    agent = AgentStore.open(str(tmp_path / "agent"))
    with agent.begin() as tx:
        tx.apply_many(events[:6])
        tx.advance_cursor(GROUP)
        key = tx.record_intent(GROUP, mission="m-1", workitem="wi-1", ownership_epoch=1, operation="send").key

    def command(**fields):
        values = {"actor": "owner", "action_id": "odd-1", "group": GROUP, "kind": "mission.create", "target": "m-9",
                  "body": {"title": "t", "cost_limit": 1}}
        return Command(**{**values, **fields})

    calls = {
        "read": (authority.read, {"group": GROUP, "after": 0, "limit": 10}),
        "state": (authority.state, {"group": GROUP, "aggregate": "mission:m-1"}),
        "aggregates": (authority.aggregates, {"group": GROUP, "prefix": "m"}),
        "replay_floor": (authority.replay_floor, {"group": GROUP}),
        "read_snapshot": (authority.read_snapshot, {"ref": reference}),
        "subscribe": (authority.subscribe, {"group": GROUP, "after": 0}),
        "ack": (authority.ack, {"consumer": "c", "group": GROUP, "cursor": 0}),
        "acked": (authority.acked, {"consumer": "c", "group": GROUP}),
        "expire_leases": (authority.expire_leases, {"group": GROUP, "now_ms": 0}),
        "redact": (authority.redact, {"group": GROUP, "seq": 99, "actor": "owner", "action_id": "redact-1", "reason": "r"}),
        "accept": (lambda **fields: authority.accept(command(**fields)),
                   {"actor": "owner", "group": GROUP, "target": "m-1", "body": {}, "expected_revision": None}),
        "accept_many": (authority.accept_many, {"commands": [command(target="m-1")]}),
        "agent.aggregate": (agent.aggregate, {"group": GROUP, "key": "workitem:wi-1"}),
        "agent.work_queue": (agent.work_queue, {"group": GROUP, "now_ms": 0, "limit": 2}),
        "agent.projection_get": (agent.projection_get, {"group": GROUP, "name": "p", "key": "k"}),
        "agent.projection_digest": (agent.projection_digest, {"group": GROUP}),
        "agent.intents": (agent.intents, {"group": GROUP, "pending_only": True}),
        "agent.mark_uncertain": (agent.mark_uncertain, {"intent_key": key, "error": "e"}),
        "agent.record_receipt": (agent.record_receipt, {"intent_key": "no-such-intent", "receipt": {}}),
        "agent.dispatch": (agent.dispatch, {"intent_key": key, "side_effect": lambda intent: {}, "lookup": None}),
        "agent.reconcile": (agent.reconcile, {"intent_key": key, "lookup": lambda intent: None}),
        "agent.restore": (agent.restore, {"data": data, "group": "g-2", "org": "acme", "high_water_seq": 0}),
        "tx.apply_many": (lambda events: _in_a_transaction(agent, "apply_many", events), {"events": events[6:]}),
        "tx.record_intent": (lambda group, **fields: _in_a_transaction(agent, "record_intent", group, **fields),
                             {"group": GROUP, "mission": "m-1", "workitem": "wi-2", "ownership_epoch": 1, "operation": "o",
                              "request": {"to": "ops"}}),
        "MemoryGroup.get": (MemoryGroup(GROUP).get, {"key": "group:g-1"}),
        "Delivery": (lambda **arguments: Delivery(**arguments).pull_once(GROUP),
                     {"agent": agent, "source": ListSource(events[:6]), "consumer": None, "batch_events": 5,
                      "restore_snapshot": None, "org": None}),
        "OfflineGuard.permit": (lambda group, agent_id, grace_ms, workitem, now_ms, reversible: OfflineGuard(
            agent, group, agent_id, grace_ms=grace_ms).permit(workitem, now_ms=now_ms, reversible=reversible),
            {"group": GROUP, "agent_id": "bob", "grace_ms": 10, "workitem": "wi-1", "now_ms": 0, "reversible": True}),
        "external_idempotency_key": (work_keys.external_idempotency_key,
                                     {"mission_id": "m", "workitem_id": "w", "ownership_epoch": 1, "operation_id": "o"}),
        "attempt_key": (work_keys.attempt_key, {"mission_id": "m", "workitem_id": "w", "attempt": 1}),
        "check_snapshot_ref": (check_snapshot_ref, {"data": data, "ref": reference.to_dict()}),
        "SnapshotRef.from_dict": (SnapshotRef.from_dict, {"value": reference.to_dict()}),
        "Keyring": (Keyring, {"public_keys": [authority.signing_key.public_key]}),
        "FaultyTransport": (lambda **arguments: Delivery(agent, FaultyTransport(ListSource(events[:6]), **arguments)).pull_once(GROUP),
                            {"seed": 1, "drop": 0.1, "duplicate": 0.1, "reorder": 0.5, "disconnect": 0.0, "replay": 2}),
        "error_from_code": (error_from_code, {"code": "NOT_FOUND", "message": "m", "detail": {"field": "x"}}),
    }

    def unchanged():
        return authority.head(GROUP), agent.projection_digest(), agent.intents()

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(sorted(calls)), st.data())
    def check(name, draw):
        function, good = calls[name]
        parameter = draw.draw(st.sampled_from(sorted(good)), label="parameter")
        value = draw.draw(_odd_values(), label="value")
        before = unchanged()
        try:
            function(**{**good, parameter: value})
        except mwpstore.MwpError:
            assert unchanged() == before, f"{name}({parameter}={value!r}) was refused after it wrote"

    try:
        check()
    finally:
        agent.close()
        authority.close()


def _in_a_transaction(agent, method: str, *arguments, **options):
    """``tx.<method>(*arguments, **options)`` in a local transaction that is aborted whatever happens."""
    tx = agent.begin()
    try:
        return getattr(tx, method)(*arguments, **options)
    finally:
        tx.abort()


# -- on-disk facts the format pages state -----------------------------------------------------------


def test_the_clean_marker_has_the_size_the_format_page_states(tmp_path) -> None:
    path = str(tmp_path / "store")
    with open_with_group(path):
        pass
    size = os.path.getsize(os.path.join(path, "log", "CLEAN"))
    assert size == 48
    assert f"`CLEAN` in the log directory:\n{size} bytes." in _read("docs", "format", "segment.md")


def test_the_index_page_states_max_dbs_and_every_meta_key(tmp_path) -> None:
    from mwpstore.index import DATABASE_NAMES

    page = _read("docs", "format", "index.md")
    assert f"max_dbs={len(DATABASE_NAMES) + 2}," in page
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        index = authority.index
        with index.env.begin(db=index.dbs[b"meta"]) as txn:
            keys = [bytes(key).decode() for key, _ in txn.cursor()]
    assert "last_ms" in keys
    assert [key for key in keys if f"| `{key}` |" not in page] == []
