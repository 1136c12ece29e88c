"""The command line and the demo, one rule a test: what each command prints with and without
--json, the exit codes of what it refuses, its defaults, and what the demo checks and reports.

Each rule here was found unpinned by a mutation round over mwpstore/cli.py and mwpstore/demo.py:
the code kept it, but no test failed when it was switched off."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from authority_helpers import GROUP, OWNER, group_create, mission_create, open_with_group
from mwpstore import Authority, cli, limits
from mwpstore.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_STORE_ERROR, EXIT_USAGE, main
from test_cli import run_json as _run_command_json
from test_cli import store  # noqa: F401  (the fixture: a store with a Group and five Missions)


def run_json(capsys, argv):
    return _run_command_json(capsys, [*argv, "--json"])


def run_text(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


# -- progress and tables ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_progress_draws_at_most_ten_bars_a_second_and_ends_its_line_at_the_total(monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(cli, "time", clock)
    progress = cli.Progress("opening", enabled=True)
    progress(1, 4)
    assert capsys.readouterr().err == "\ropening      [#######.......................]  25.0%"
    clock.now += 0.05
    progress(2, 4)  # within 0.1 s of the last bar: not drawn
    assert capsys.readouterr().err == ""
    progress(4, 4)  # the end is always drawn, and ends the line
    assert capsys.readouterr().err == "\ropening      [##############################] 100.0%\n"
    cli.Progress("opening", enabled=False)(1, 4)
    assert capsys.readouterr().err == ""


def test_progress_of_nothing_to_do_is_complete_not_a_division_by_zero(monkeypatch, capsys):
    monkeypatch.setattr(cli, "time", _Clock())
    cli.Progress("compacting", enabled=True)(0, 0)
    assert capsys.readouterr().err == "\rcompacting   [##############################] 100.0%\n"


@pytest.mark.parametrize("command, label", [("verify", "verifying"), ("rebuild", "rebuilding"), ("compact", "compacting")])
def test_the_long_commands_draw_their_progress_on_a_terminal(store, capsys, monkeypatch, command, label):
    """verify, rebuild and compact hand the engine a progress bar named after what they do; it
    draws on standard error when that is a terminal, and ends its line at the whole log."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run_text(capsys, [command, "--store", store])
    assert code == EXIT_OK
    assert f"\r{label:<12} [" in err
    assert err.endswith("] 100.0%\n")


def test_a_table_s_columns_are_as_wide_as_their_header_or_widest_cell(capsys):
    cli.print_table([("a", "a-long-cell"), ("bb", "c")], ["first column", "x"])
    assert capsys.readouterr().out.splitlines() == [
        "first column  x          ",
        "------------  -----------",
        "a             a-long-cell",
        "bb            c          ",
    ]


# -- what each store command prints ----------------------------------------------------------------


def test_inspect_without_json_prints_the_store_its_log_segments_and_group_heads(store, capsys):
    _, info = run_json(capsys, ["inspect", "--store", store])
    code, lines, _ = run_text(capsys, ["inspect", "--store", store])
    assert code == EXIT_OK
    assert lines[0] == f"store       {info['path']}"
    assert lines[1] == f"opened      {info['open']['mode']} ({info['open']['reason']}, {info['open']['redo_records']} records redone)"
    assert lines[2] == f"log         positions {info['log_start']} .. {info['log_end']}" and info["log_end"] > info["log_start"]
    (segment,) = info["segments"]
    assert lines[4].split() == ["first", "position", "segment", "used", "bytes", "size", "bytes", "sealed"]
    assert lines[6].split() == [str(segment["first_position"]), os.path.basename(segment["path"]), str(segment["used_bytes"]),
                                str(segment["size_bytes"]), "no"]  # the active segment is not sealed
    head = info["groups"][GROUP]
    assert lines[-1].split() == [GROUP, "6", head["head_hash"][:16]] and len(head["head_hash"]) > 16


def test_verify_without_json_prints_each_problem_and_the_verdict(store, capsys):
    code, lines, _ = run_text(capsys, ["verify", "--store", store])
    assert code == EXIT_OK
    assert lines == ["records 6, events 6, groups 1", "OK: frames, hash chains, index, snapshots and audit logs all verify"]
    _, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store])
    path = os.path.join(store, ref["location"])
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    data[-1] ^= 0x01
    os.chmod(path, 0o600)
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    code, lines, _ = run_text(capsys, ["verify", "--store", store])
    assert code == EXIT_CHECK_FAILED
    assert lines[1].startswith("PROBLEM  snapshot ") and "SNAPSHOT_INVALID" in lines[1]
    assert lines[2:] == ["FAILED: 1 problem(s)"]


def test_rebuild_reports_its_rate_and_what_it_rebuilt(store, capsys):
    code, document = run_json(capsys, ["rebuild", "--store", store])
    assert code == EXIT_OK and document["records"] == 6 and document["seconds"] > 0
    assert document["records_per_second"] == pytest.approx(6 / document["seconds"])
    code, lines, _ = run_text(capsys, ["rebuild", "--store", store])
    assert code == EXIT_OK and lines[0].startswith("rebuilt the index from 6 log records in ") and lines[0].endswith(" s")


def _log_bytes(store: str) -> int:
    """What compaction counts as the log's bytes: the size of each file in its directory."""
    directory = os.path.join(store, "log")
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))


def test_compact_reports_each_figure_of_a_compaction_that_removed_something(tmp_path, capsys):
    """A redacted payload and an archived Group's Events: each figure of the report in its own
    field (the other CLI test compacts a store with nothing to remove, where before == after)."""
    path = str(tmp_path / "store")
    with Authority.open(path, segment_bytes=limits.SEGMENT_BYTES_MIN) as authority:  # the command compacts into one of the default size
        authority.accept(group_create(GROUP))
        receipt = authority.accept(mission_create("secret"))
        authority.redact(GROUP, receipt.seq, actor=OWNER, action_id="redact-1", reason="legal")
        authority.accept(group_create("g-2"))
        for start in (0, 100, 200):  # more than one segment's worth
            authority.accept_many([mission_create(f"m-{i}", group="g-2") for i in range(start, start + 100)])
        authority.archive("g-2", actor=OWNER, action_id="archive-g-2", reason="done")
    shutil.copytree(path, str(tmp_path / "copy"))
    records_before = run_json(capsys, ["rebuild", "--store", path])[1]["records"]  # a rebuild reads every log record
    bytes_before = _log_bytes(path)
    code, report = run_json(capsys, ["compact", "--store", path])
    assert code == EXIT_OK
    assert report["payloads_removed"] == 1 and report["events_dropped"] == 302 and report["groups_compacted"] == ["g-2"]
    assert report["records_before"] == records_before and report["bytes_before"] == bytes_before
    assert report["records_after"] == run_json(capsys, ["rebuild", "--store", path])[1]["records"] != records_before
    assert report["bytes_after"] == _log_bytes(path) != bytes_before and report["seconds"] >= 0
    code, lines, _ = run_text(capsys, ["compact", "--store", str(tmp_path / "copy")])  # the same compaction, as text
    assert code == EXIT_OK
    assert lines == [f"records {records_before} -> {report['records_after']}, bytes {bytes_before} -> {report['bytes_after']}",
                     "redacted payloads removed 1; archived Events dropped 302 (g-2)"]


def test_snapshot_create_prints_the_whole_reference(store, capsys):
    code, document = run_json(capsys, ["snapshot", "create", GROUP, "--store", store])
    assert code == EXIT_OK
    with Authority.open(store) as authority:
        ref = authority.snapshot(GROUP)  # the same head: the same reference
    assert document == ref.to_dict()
    code, lines, _ = run_text(capsys, ["snapshot", "create", GROUP, "--store", store])
    assert lines == [f"snapshot of {GROUP} at seq 6: {ref.location} ({ref.file_bytes} bytes, key {ref.key_id})"]


@pytest.fixture
def snapshot_file(store, capsys):
    _, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store])
    return os.path.join(store, ref["location"]), os.path.join(store, "keys", "snapshot-signing.pub"), ref


def test_snapshot_verify_prints_what_it_verified(store, snapshot_file, capsys):
    path, public_key, ref = snapshot_file
    code, document = run_json(capsys, ["snapshot", "verify", path, "--trust", public_key])
    assert code == EXIT_OK
    with Authority.open(store) as authority:
        aggregates = len(authority.aggregates(GROUP))
    assert document == {"ok": True, "org": "acme", "group": GROUP, "seq": 6, "aggregates": aggregates, "key_id": ref["key_id"]}
    code, lines, _ = run_text(capsys, ["snapshot", "verify", path, "--trust", public_key, "--org", "acme"])
    assert code == EXIT_OK and lines == [f"OK: snapshot of {GROUP} (acme) at seq 6, {aggregates} aggregates, key {ref['key_id']}"]


def test_snapshot_verify_trusts_every_key_given(tmp_path, snapshot_file, capsys):
    path, public_key, _ = snapshot_file
    open_with_group(str(tmp_path / "other")).close()
    assert run_json(capsys, ["snapshot", "create", GROUP, "--store", str(tmp_path / "other")])[0] == EXIT_OK
    other_key = str(tmp_path / "other" / "keys" / "snapshot-signing.pub")
    assert run_json(capsys, ["snapshot", "verify", path, "--trust", other_key])[0] == EXIT_CHECK_FAILED
    assert run_json(capsys, ["snapshot", "verify", path, "--trust", other_key, "--trust", public_key])[0] == EXIT_OK


@pytest.mark.parametrize(
    "options, code",
    [(["--org", "acme"], EXIT_OK), (["--org", "other-org"], EXIT_CHECK_FAILED), (["--high-water", "6"], EXIT_OK),
     (["--high-water", "7"], EXIT_CHECK_FAILED), (["--high-water", str(limits.INT_ABS_MAX)], EXIT_CHECK_FAILED)],
)
def test_snapshot_verify_checks_the_organization_and_the_high_water_mark(snapshot_file, capsys, options, code):
    """A snapshot of another Organization, or older than --high-water, fails its check (exit 1);
    the largest high-water mark is still a mark, not bad input."""
    path, public_key, _ = snapshot_file
    result, document = run_json(capsys, ["snapshot", "verify", path, "--trust", public_key, *options])
    assert result == code
    if code == EXIT_CHECK_FAILED:
        assert document["error"]["code"] == "SNAPSHOT_INVALID"


def test_keys_commands_without_json_say_what_became_of_each_key(store, capsys):
    _, before = run_json(capsys, ["keys", "list", "--store", store])
    code, lines, _ = run_text(capsys, ["keys", "rotate", "--store", store])
    _, after = run_json(capsys, ["keys", "list", "--store", store])
    public_path = os.path.join(os.path.abspath(store), "keys", "snapshot-signing.pub")
    assert code == EXIT_OK and lines == [f"new signing key {after['current']}; give verifiers {public_path}",
                                         f"old key {before['current']} retired: still trusted for what it signed"]
    code, lines, _ = run_text(capsys, ["keys", "list", "--store", store])
    assert lines == [f"signing   {after['current']}  {after['public_key']}",
                     f"retired   {before['current']}  (still trusted for what it signed)"]
    code, lines, _ = run_text(capsys, ["keys", "rotate", "--drop-old", "--store", store])
    assert lines[1] == f"old key {after['current']} dropped: snapshots it signed no longer verify here"
    code, lines, _ = run_text(capsys, ["keys", "drop", before["current"], "--store", store])
    assert code == EXIT_OK
    assert lines == [f"retired key {before['current']} dropped: what it signed no longer verifies here; take new snapshots"]


# -- bench, defaults, and the command line itself --------------------------------------------------


def test_bench_runs_the_suite_s_script_and_exits_with_its_code(monkeypatch):
    import subprocess

    calls = []

    def call(command, cwd):
        calls.append((command, cwd))
        return 7

    monkeypatch.setattr(subprocess, "call", call)
    root = os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))
    script = os.path.join(root, "bench", "run_all.py")
    assert main(["bench", "--quick"]) == 7
    assert main(["bench"]) == 7
    assert calls == [([sys.executable, script, "--quick"], root), ([sys.executable, script], root)]


def test_bench_outside_a_checkout_is_a_usage_error(monkeypatch, capsys):
    import subprocess

    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: False if str(path).endswith("run_all.py") else real_exists(path))
    monkeypatch.setattr(subprocess, "call", lambda *arguments, **options: pytest.fail("the suite was run"))
    assert main(["bench"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("mwpstore: the benchmark suite lives in the source tree (bench/run_all.py)")


def test_the_default_store_is_mwpstore_data_authority_or_the_environment_s(tmp_path, monkeypatch, capsys):
    """docs/operations.md: `--store` defaults to `mwpstore-data/authority`, or `$MWPSTORE_STORE`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MWPSTORE_STORE", raising=False)
    open_with_group(str(tmp_path / "mwpstore-data" / "authority")).close()
    code, document = run_json(capsys, ["inspect"])
    assert code == EXIT_OK and document["path"] == str(tmp_path / "mwpstore-data" / "authority")
    monkeypatch.setenv("MWPSTORE_STORE", str(tmp_path / "elsewhere"))
    code, document = run_json(capsys, ["inspect"])
    assert code == EXIT_USAGE and document["error"]["code"] == "STORE_NOT_FOUND"
    assert str(tmp_path / "elsewhere") in document["error"]["message"]


def test_the_demo_and_torture_defaults_are_the_documented_ones():
    parser = cli.build_parser()
    demo = parser.parse_args(["demo"])
    assert (demo.directory, demo.agents, demo.workitems) == ("mwpstore-demo", 4, 200)
    torture = parser.parse_args(["torture"])
    assert (torture.seed, torture.count, torture.seconds, torture.suite) == (1, None, None, None)


def test_main_gives_back_the_standard_output_it_found(store, capsys):
    before = sys.stdout
    assert main(["inspect", "--store", store, "--json"]) == EXIT_OK
    assert sys.stdout is before
    assert main(["inspect", "--no-such-option"]) == EXIT_USAGE
    assert sys.stdout is before


def test_a_standard_output_closed_before_main_is_called_is_an_error_not_silence(tmp_path):
    """A program that closed descriptor 1 and then calls main(): its sys.stdout still names
    descriptor 1, which main puts /dev/null on, so the output would vanish with exit 0; it is an
    error (exit 3) as for a process started without standard output."""
    import subprocess

    script = "import os, sys\nfrom mwpstore.cli import main\nos.close(1)\nsys.exit(main(['--version']))\n"
    completed = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, cwd=str(tmp_path))
    assert completed.returncode == EXIT_STORE_ERROR, completed.stderr.decode()
    assert completed.stderr.decode().strip() == "mwpstore: cannot write standard output: standard output is closed"


def test_json_after_a_double_dash_is_an_argument_not_the_option(capsys):
    """A command line that does not parse answers with a JSON document only when --json is
    among its options: after `--` it is a positional argument."""
    assert main(["inspect", "--no-such-option", "--", "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: mwpstore" in captured.err


def test_a_command_line_that_does_not_parse_names_the_command_in_its_error_document(capsys):
    assert main(["keys", "drop", "--json"]) == EXIT_USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["error"]["detail"] == {"field": "arguments", "command": "mwpstore keys drop"}


# -- the demo --------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [("--agents", "1"), ("--agents", "17"), ("--workitems", "9"), ("--workitems", "100001")])
def test_a_demo_size_out_of_its_range_is_refused_before_anything_is_written(tmp_path, capsys, option, value):
    """--agents 2..16 and --workitems 10..100000 (the command's help), refused at either end."""
    directory = tmp_path / "demo"
    code, document = run_json(capsys, ["demo", str(directory), option, value])
    assert code == EXIT_USAGE and document["error"]["detail"]["field"] == option[2:]
    assert not directory.exists()


@pytest.mark.parametrize("sizes", [{"agents": 3.0}, {"workitems": 20.0}, {"agents": "3"}])
def test_a_demo_size_that_is_not_a_whole_number_is_refused_before_anything_is_written(tmp_path, sizes):
    from mwpstore.demo import run_demo
    from mwpstore.errors import InvalidCommand

    with pytest.raises(InvalidCommand) as refused:
        run_demo(str(tmp_path / "demo"), **sizes)
    assert refused.value.detail["field"] == next(iter(sizes))
    assert os.listdir(tmp_path) == []


def test_the_demo_report_counts_the_log_s_events_and_names_its_directory(tmp_path, capsys):
    """Also: an empty directory may be the demo's (only a non-empty one needs the demo's marker)."""
    from mwpstore.demo import GROUP as DEMO_GROUP, MARKER

    directory = str(tmp_path / "empty")
    os.mkdir(directory)
    code, document = run_json(capsys, ["demo", directory, "--agents", "2", "--workitems", "10"])
    assert code == EXIT_OK and document["directory"] == directory and os.path.isfile(os.path.join(directory, MARKER))
    with Authority.open(os.path.join(directory, "authority")) as authority:
        assert document["counts"]["Events in the log"] == authority.head(DEMO_GROUP)[0] > 10
    assert document["figures"]["total seconds"] > 0
    assert document["counts"]["WorkItems submitted"] == 10


def test_the_demo_report_without_json_lists_each_check_and_the_verdict(tmp_path, capsys):
    directory = str(tmp_path / "demo")
    code, lines, _ = run_text(capsys, ["demo", directory, "--agents", "2", "--workitems", "10"])
    assert code == EXIT_OK
    assert lines[0] == f"mwpstore demo — data in {directory}"
    checks = [line for line in lines if line.startswith("  [")]
    assert len(checks) > 10 and all(line.startswith("  [ok] ") for line in checks)
    assert lines[-1] == f"{len(checks)}/{len(checks)} checks passed"


def _failed_checks(document):
    return {check["name"]: check["detail"] for check in document["checks"] if not check["ok"]}


def test_a_verify_that_finds_a_problem_fails_the_demo(tmp_path, capsys, monkeypatch):
    from mwpstore.authority import VerifyReport

    real_verify = Authority.verify

    def verify(self, *arguments, **options):
        report = real_verify(self, *arguments, **options)
        return VerifyReport(report.records, report.events, report.groups, ["a planted problem"])

    monkeypatch.setattr(Authority, "verify", verify)
    directory = str(tmp_path / "demo")
    code, lines, _ = run_text(capsys, ["demo", directory, "--agents", "2", "--workitems", "10"])
    assert code == EXIT_CHECK_FAILED
    assert "  [FAILED] verify: frames, hash chains and index equal to a rebuild  (a planted problem)" in lines
    checks = [line for line in lines if line.startswith("  [")]
    assert lines[-1] == f"{len(checks) - 1}/{len(checks)} checks passed — FAILED"


def test_an_archived_group_that_accepts_a_command_fails_the_demo(tmp_path, capsys, monkeypatch):
    real_accept = Authority.accept

    def accept(self, command, *arguments, **options):
        if command.target == "too-late":  # the demo's Command to its archived Group
            return None
        return real_accept(self, command, *arguments, **options)

    monkeypatch.setattr(Authority, "accept", accept)
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10"])
    assert code == EXIT_CHECK_FAILED
    assert list(_failed_checks(document)) == ["the archived Group refuses Commands (GROUP_ARCHIVED)"]


def test_a_submission_the_workers_counted_twice_fails_the_demo(tmp_path, capsys, monkeypatch):
    """"Exactly once" is the workers' own tally against the store's: every WorkItem submitted in
    the store, but one submission counted twice (as a stale owner's Evidence would be), fails."""
    from mwpstore import demo

    real_count = demo.Report.count
    doubled = []

    def count(self, name, amount=1):
        if name == "WorkItems submitted" and not doubled:
            doubled.append(name)
            amount += 1
        real_count(self, name, amount)

    monkeypatch.setattr(demo.Report, "count", count)
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10"])
    assert code == EXIT_CHECK_FAILED and document["counts"]["WorkItems submitted"] == 11
    failed = _failed_checks(document)
    assert list(failed) == ["every WorkItem was submitted exactly once"]
    # the detail shows both sides, not only the store's count (which is right here)
    assert failed["every WorkItem was submitted exactly once"] == "10/10 in the store, 11 submissions counted by the workers"


def test_a_reopen_that_is_not_clean_fails_the_demo(tmp_path, capsys, monkeypatch):
    from mwpstore import demo
    from mwpstore.authority import OpenReport

    opened = []

    class Recovering(Authority):
        @classmethod
        def open(cls, *arguments, **options):
            authority = Authority.open(*arguments, **options)
            opened.append(authority)
            if len(opened) == 2:  # the reopen after the scenario
                authority.open_report = OpenReport(mode="redo", reason="planted", redo_records=1)
            return authority

    monkeypatch.setattr(demo, "Authority", Recovering)
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10"])
    assert code == EXIT_CHECK_FAILED and len(opened) == 2
    assert _failed_checks(document) == {"reopen after close is clean (no redo, no rebuild)": "redo"}


def test_an_error_that_stops_the_scenario_is_a_failed_check_of_the_report(tmp_path, capsys, monkeypatch):
    """The report (and its --json document) still comes, the store reopened and the error named,
    rather than the command ending in the error (exit 3) with no report."""
    from mwpstore.errors import StorageFailed

    def failing(self, *arguments, **options):
        raise StorageFailed("the disk went away", reason="test")

    monkeypatch.setattr(Authority, "expire_leases", failing)  # only the scenario asks for it
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10"])
    assert code == EXIT_CHECK_FAILED
    assert _failed_checks(document) == {"the scenario ran to its end": "STORAGE_FAILED: the disk went away"}
    assert document["counts"]["Events in the log"] > 10


def test_a_demo_directory_that_cannot_be_emptied_is_reported_as_such(tmp_path, capsys, monkeypatch):
    import shutil as shutil_module

    directory = tmp_path / "demo"
    directory.mkdir()
    (directory / ".mwpstore-demo").write_text("")

    def refused(path, *arguments, **options):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil_module, "rmtree", refused)
    code, document = run_json(capsys, ["demo", str(directory), "--agents", "2", "--workitems", "10"])
    assert code == EXIT_STORE_ERROR and document["error"]["code"] == "STORAGE_FAILED"
    assert f"emptying {directory}" in document["error"]["message"] and document["error"]["detail"]["errno"] == 13
    assert os.listdir(directory) == [".mwpstore-demo"]
