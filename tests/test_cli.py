"""The command line: the demo end to end, and every store command with --json and exit codes."""

from __future__ import annotations

import base64
import json
import errno
import os
import subprocess
import sys
import time

import pytest

from authority_helpers import GROUP, mission_create, open_with_group
from mwpstore import InvalidState
from mwpstore.cli import EXIT_BROKEN_PIPE, EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORE_ERROR, EXIT_USAGE, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(capsys, argv):
    code = main(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def test_demo_runs_end_to_end_and_every_check_passes(tmp_path, capsys):
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "3", "--workitems", "30", "--json"])
    assert code == EXIT_OK, [check for check in document["checks"] if not check["ok"]]
    names = " ".join(check["name"] for check in document["checks"])
    for expected in ("ACTION_ID_COLLISION", "Evidence", "CURSOR_TOO_OLD", "archive", "sweep", "duplicates, reordering"):
        assert expected in names
    assert document["counts"]["WorkItems submitted"] == 30
    # a second run reuses its own directory; a foreign non-empty directory is refused
    assert main(["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10", "--json"]) == EXIT_OK
    capsys.readouterr()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    assert main(["demo", str(foreign)]) == EXIT_USAGE
    assert (foreign / "precious.txt").read_text() == "keep me"


def _demo_directories(tmp_path):
    """Paths that cannot be a demo directory, each beside what must survive the refusal."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    demo = tmp_path / "real-demo"
    demo.mkdir()
    (demo / ".mwpstore-demo").write_text("")
    (demo / "result.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(demo)
    return {
        "a file": (str(afile), "directory"),
        "a foreign directory": (str(foreign), "directory"),
        "below a file": (str(afile / "sub"), "directory"),
        "a link to a demo directory": (str(tmp_path / "link"), "directory"),
        "the link with a slash": (str(tmp_path / "link") + "/", "directory"),
        "an empty path": ("", "path"),
        "a name that is not UTF-8": (str(tmp_path / "\udcff"), "path"),
    }


@pytest.mark.parametrize("case", ["a file", "a foreign directory", "below a file", "a link to a demo directory",
                                  "the link with a slash", "an empty path", "a name that is not UTF-8"])
def test_a_demo_directory_that_cannot_be_one_is_bad_input_and_nothing_changes(tmp_path, capsys, case):
    """`demo FILE` was a store error (exit 3, code MWP_ERROR); a path below a file, a symbolic link
    or an empty path raised an untyped OSError (a traceback, exit 1); a name the stores refuse
    was refused only after its directory had been created."""
    directory, field = _demo_directories(tmp_path)[case]
    before = sorted((str(path), path.is_file() and path.read_text()) for path in tmp_path.rglob("*"))
    assert main(["demo", directory, "--agents", "2", "--workitems", "10", "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["ok"] is False and document["error"]["code"] == "INVALID_COMMAND"
    assert document["error"]["detail"]["field"] == field
    assert captured.err.startswith("mwpstore: INVALID_COMMAND: ")
    assert sorted((str(path), path.is_file() and path.read_text()) for path in tmp_path.rglob("*")) == before



def test_an_interrupted_demo_stops_its_workers_before_it_closes_the_stores(tmp_path, monkeypatch, sigint_raises):
    """Ctrl-C while the workers ran closed the authority under them: every worker thread ended in
    a StoreClosed traceback on standard error after the command had already exited 130."""
    import signal
    import threading

    from mwpstore import demo

    working = threading.Event()
    stops: list[threading.Event] = []

    def work(agent, report, lock, stop, rng):
        stops.append(stop)
        working.set()
        while not stop.is_set():
            agent.authority.head(demo.GROUP)  # StoreClosed once the authority is closed
            time.sleep(0.01)

    failures = []
    monkeypatch.setattr(demo, "_work", work)
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    main_thread = threading.main_thread().ident

    def interrupt():
        # Sent again only while the demo has not begun to stop: a KeyboardInterrupt that lands in
        # a finalizer the main thread happens to run is printed and dropped by Python, and these
        # workers never end on their own (the suite once hung here for its 900 s timeout).
        working.wait(60)
        for _ in range(5):
            signal.pthread_kill(main_thread, signal.SIGINT)
            if stops[0].wait(5):
                return

    threading.Thread(target=interrupt, daemon=True).start()
    assert main(["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10"]) == EXIT_INTERRUPTED
    workers = [thread for thread in threading.enumerate() if thread.name.startswith("agent-")]
    for thread in workers:
        thread.join(10)
    assert failures == [] and not [thread for thread in workers if thread.is_alive()]


def test_a_worker_that_meets_an_error_fails_a_check_of_the_demo_report(tmp_path, capsys, monkeypatch):
    """A worker thread ended by an error died with a traceback on standard error; the report only
    said that some WorkItems were not submitted, and its --json document did not carry the error."""
    import threading

    from mwpstore.agent_store import AgentStore
    from mwpstore.errors import StorageFailed

    def failing(self, *arguments, **options):
        raise StorageFailed("the disk went away", reason="test")

    failures = []
    monkeypatch.setattr(AgentStore, "work_queue", failing)  # only the worker threads ask for it
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    code, document = run_json(capsys, ["demo", str(tmp_path / "demo"), "--agents", "2", "--workitems", "10", "--json"])
    assert code == EXIT_CHECK_FAILED and failures == []
    failed = {check["name"]: check["detail"] for check in document["checks"] if not check["ok"]}
    assert failed["agent-1 worked to the end without an error"] == "STORAGE_FAILED: the disk went away"
    assert failed["agent-2 worked to the end without an error"] == "STORAGE_FAILED: the disk went away"

@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept_many([mission_create(f"m-{i}") for i in range(5)])
    return path


def test_inspect_verify_rebuild_snapshot_json(store, capsys):
    code, info = run_json(capsys, ["inspect", "--store", store, "--json"])
    assert code == EXIT_OK and info["groups"][GROUP]["seq"] == 6 and info["segments"]
    code, report = run_json(capsys, ["verify", "--store", store, "--json"])
    assert code == EXIT_OK and report["ok"] and report["events"] == 6
    code, rebuilt = run_json(capsys, ["rebuild", "--store", store, "--json"])
    assert code == EXIT_OK and rebuilt["records"] == 6
    code, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store, "--json"])
    assert code == EXIT_OK and ref["seq"] == 6
    snapshot_file = os.path.join(store, ref["location"])
    public_key = os.path.join(store, "keys", "snapshot-signing.pub")
    code, checked = run_json(capsys, ["snapshot", "verify", snapshot_file, "--trust", public_key, "--group", GROUP, "--json"])
    assert code == EXIT_OK and checked["seq"] == 6
    code, _ = run_json(capsys, ["snapshot", "verify", snapshot_file, "--trust", public_key, "--group", "other", "--json"])
    assert code == EXIT_CHECK_FAILED
    code, compacted = run_json(capsys, ["compact", "--store", store, "--json"])
    assert code == EXIT_OK and compacted["records_after"] == compacted["records_before"] == 7
    code, report = run_json(capsys, ["verify", "--store", store, "--json"])
    assert code == EXIT_OK and report["ok"]


def test_keys_rotate_and_list(store, capsys):
    code, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store, "--json"])
    assert code == EXIT_OK
    code, before = run_json(capsys, ["keys", "list", "--store", store, "--json"])
    assert code == EXIT_OK and before["current"] == ref["key_id"] and before["retired"] == []
    code, rotated = run_json(capsys, ["keys", "rotate", "--store", store, "--json"])
    assert code == EXIT_OK and rotated["old"] == ref["key_id"] != rotated["new"] and rotated["old_retired"]
    code, after = run_json(capsys, ["keys", "list", "--store", store, "--json"])
    assert after["current"] == rotated["new"] and after["retired"] == [ref["key_id"]]
    with open(os.path.join(store, "keys", "snapshot-signing.pub")) as handle:
        assert handle.read().strip() == after["public_key"] == rotated["public_key"]
    code, report = run_json(capsys, ["verify", "--store", store, "--json"])
    assert code == EXIT_OK and report["ok"]  # the snapshot signed before the rotation still verifies
    code, dropped = run_json(capsys, ["keys", "rotate", "--drop-old", "--store", store, "--json"])
    assert code == EXIT_OK and not dropped["old_retired"]
    code, listed = run_json(capsys, ["keys", "list", "--store", store, "--json"])
    assert listed["retired"] == [ref["key_id"]]  # the second key was dropped, the first stays retired
    code, gone = run_json(capsys, ["keys", "drop", ref["key_id"], "--store", store, "--json"])
    assert code == EXIT_OK and gone == {"dropped": ref["key_id"], "trusted": [listed["current"]]}
    code, listed = run_json(capsys, ["keys", "list", "--store", store, "--json"])
    assert listed["retired"] == []
    code, report = run_json(capsys, ["verify", "--store", store, "--json"])
    assert code == EXIT_CHECK_FAILED and "SNAPSHOT_INVALID (key)" in report["problems"][0]  # signed by the dropped key
    for key_id, error in ((ref["key_id"], "NOT_FOUND"), ("XYZ", "INVALID_COMMAND")):
        code, refused = run_json(capsys, ["keys", "drop", key_id, "--store", store, "--json"])
        assert code == 2 and refused["error"]["code"] == error


def test_verify_exit_code_when_a_snapshot_is_damaged(store, capsys):
    code, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store, "--json"])
    path = os.path.join(store, ref["location"])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    os.chmod(path, 0o600)
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    code, report = run_json(capsys, ["verify", "--store", store, "--json"])
    assert code == EXIT_CHECK_FAILED and not report["ok"] and "SNAPSHOT_INVALID" in report["problems"][0]


def test_tail_prints_events(store, capsys):
    assert main(["tail", GROUP, "--store", store, "-n", "3", "--json"]) == EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)[1] for line in lines] == [4, 5, 6]
    # docs/operations.md: each line is the Event as a JSON array of its fields in order, its byte
    # fields in base64 (a script reads them by position)
    from mwpstore import Authority, Event

    fields = Event.__struct_fields__
    with Authority.open(store) as authority:
        events = authority.read(GROUP, after=3)
    for line, event in zip(lines, events):
        row = json.loads(line)
        assert len(row) == len(fields) and row[fields.index("event_id")] == event.event_id
        for name in ("content_hash", "payload_hash", "prev_hash", "hash"):
            assert base64.b64decode(row[fields.index(name)]) == getattr(event, name)



@pytest.mark.parametrize("follow", [[], ["-f", "--timeout", "0.2"]])
def test_tail_of_a_group_that_does_not_exist_is_not_found(store, capsys, follow):
    """A mistyped Group printed nothing and exited 0, like a Group without Events (there is none:
    each has its group.create); with -f it waited for a Group no other process could create
    while the command held the store's lock."""
    assert main(["tail", "g-missing", "--store", store, *follow, "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"] == {"code": "NOT_FOUND", "message": "group 'g-missing' does not exist",
                                                 "detail": {"field": "group"}}
    assert "NOT_FOUND" in captured.err
    assert main(["tail", GROUP, "--store", store, "--after", "6", "--json"]) == EXIT_OK  # exists, nothing after 6
    assert capsys.readouterr().out == ""

def test_tail_prints_every_event_asked_for_past_one_read(tmp_path, capsys):
    """A read returns at most 1000 Events: `tail --after 0` of a longer Group prints them all,
    not the first read's worth."""
    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        for start in (0, 600):
            authority.accept_many([mission_create(f"m-{number}") for number in range(start, start + 600)])
    assert main(["tail", GROUP, "--store", path, "--after", "0", "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.splitlines()] == list(range(1, 1202))


def test_tail_timeout_without_follow_is_a_usage_error(store, capsys):
    """--timeout bounds only the following: without -f it was ignored without a word (the last
    Events printed, exit 0), so a script that left out -f took one read for N seconds of them."""
    assert main(["tail", GROUP, "--store", store, "--timeout", "1", "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # the error document alone: no Event printed before it
    assert document["ok"] is False and document["error"]["code"] == "INVALID_COMMAND"
    assert document["error"]["detail"]["field"] == "timeout"
    assert "--timeout applies only with -f" in captured.err
    assert main(["tail", GROUP, "--store", str(store) + "-missing", "--timeout", "1"]) == EXIT_USAGE  # before the store is opened
    assert "INVALID_COMMAND" in capsys.readouterr().err


class _FollowClock:
    """``time`` for ``mwpstore.cli`` while ``tail -f`` runs in this process: the clock moves only
    when it sleeps, and ``on_pause(n)`` runs at the n-th pause (the writer's work between two
    polls). A loop that never sleeps, or never stops sleeping, is stopped."""

    def __init__(self, on_pause=None) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []
        self.on_pause = on_pause
        self.readings = 0

    def monotonic(self) -> float:
        self.readings += 1
        if self.readings > 1000:
            raise RuntimeError("tail -f reads the clock without sleeping")
        return self.now

    def sleep(self, seconds: float) -> None:
        if len(self.pauses) >= 1000:
            raise RuntimeError("tail -f keeps following past its timeout")
        self.pauses.append(seconds)
        self.now += seconds
        if self.on_pause is not None:
            self.on_pause(len(self.pauses))


def _accept_in_between(store: str, missions: list[str]) -> None:
    """A writer's turn between two polls, in this process (no view is open between polls)."""
    from mwpstore import Authority

    with Authority.open(store) as authority:
        for mission in missions:
            authority.accept(mission_create(mission))


def test_tail_follow_pauses_between_polls_and_stops_when_its_timeout_has_passed(store, capsys, monkeypatch):
    """A poll every 0.25 s, the last pause cut to what is left of --timeout: it stops when the
    timeout has passed, not up to a poll later, and never polls without pausing."""
    from mwpstore import cli

    clock = _FollowClock()
    monkeypatch.setattr(cli, "time", clock)
    assert main(["tail", GROUP, "--store", store, "-f", "--timeout", "0.6", "--json"]) == EXIT_OK
    assert clock.pauses == [0.25, 0.25, pytest.approx(0.1)]
    assert [json.loads(line)[1] for line in capsys.readouterr().out.splitlines()] == [1, 2, 3, 4, 5, 6]


def test_tail_follow_skips_a_poll_that_meets_a_switch_and_prints_each_new_event_once(store, capsys, monkeypatch):
    """A poll whose view is refused as recovery_needed (a compaction or rebuild switching files)
    is skipped and the next one prints what came meanwhile; each poll starts after the last Event
    printed and closes its view. Any other refusal ends tail -f with its error."""
    from mwpstore import StoreClosed, cli

    real_open_view = cli._open_view
    views = []

    def open_view(args):
        if len(views) == 1:  # the first poll meets a switch
            views.append(None)
            raise InvalidState("the store has a compaction switching its log", reason="recovery_needed")
        views.append(real_open_view(args))
        return views[-1]

    monkeypatch.setattr(cli, "_open_view", open_view)
    clock = _FollowClock(lambda pause: _accept_in_between(store, {1: ["m-a"], 3: ["m-b", "m-c"]}.get(pause, [])))
    monkeypatch.setattr(cli, "time", clock)
    assert main(["tail", GROUP, "--store", store, "--after", "4", "-f", "--timeout", "1", "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.splitlines()] == [5, 6, 7, 8, 9]
    assert len(views) == 5 and views[1] is None  # the first open, the skipped poll, three more
    for view in views[:1] + views[2:]:
        with pytest.raises(StoreClosed):
            view.head(GROUP)

    calls = []

    def refused_when_polled(args):
        calls.append(args)
        if len(calls) > 1:
            raise InvalidState("a refusal other than a switch", reason="readonly")
        return real_open_view(args)

    monkeypatch.setattr(cli, "_open_view", refused_when_polled)
    monkeypatch.setattr(cli, "time", _FollowClock())
    assert main(["tail", GROUP, "--store", store, "-f", "--timeout", "1", "--json"]) != EXIT_OK
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[-1])["error"]["detail"]["reason"] == "readonly" and len(printed) == 10


def test_tail_follow_after_a_cursor_beyond_the_head_prints_only_what_passes_it(store, capsys, monkeypatch):
    """`--after 8 -f` of a Group at 6 prints nothing at first, then only the Events after 8."""
    from mwpstore import cli

    monkeypatch.setattr(cli, "time", _FollowClock(lambda pause: _accept_in_between(store, ["m-a", "m-b", "m-c"] if pause == 1 else [])))
    assert main(["tail", GROUP, "--store", store, "--after", "8", "-f", "--timeout", "0.5", "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.splitlines()] == [9]


def test_tail_of_a_group_with_a_replay_floor_starts_at_the_floor(tmp_path, capsys):
    """`tail GROUP` (the last 20) of a Group with a replay window asked for Events below its
    floor: CURSOR_TOO_OLD, exit 3, though the store was fine and the retained Events readable."""
    from mwpstore import Command

    path = str(tmp_path / "store")
    with open_with_group(path) as authority:
        authority.accept(Command(actor="owner", action_id="windowed", group="g-2", kind="group.create", target="g-2",
                                 body={"org": "acme", "policy": {"replay_window_events": 2}}))
        for number in range(5):
            authority.accept(Command(actor="owner", action_id=f"w-{number}", group="g-2", kind="mission.create",
                                     target=f"m-{number}", body={"title": "t", "cost_limit": 1}))
        authority.snapshot("g-2")  # at 6
        for number in range(5, 8):
            authority.accept(Command(actor="owner", action_id=f"w-{number}", group="g-2", kind="mission.create",
                                     target=f"m-{number}", body={"title": "t", "cost_limit": 1}))
        assert authority.replay_floor("g-2")[0] == 6 and authority.head("g-2")[0] == 9
    assert main(["tail", "g-2", "--store", path, "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.strip().splitlines()] == [7, 8, 9]
    assert main(["tail", "g-2", "--store", path, "-n", "2", "--json"]) == EXIT_OK
    assert [json.loads(line)[1] for line in capsys.readouterr().out.strip().splitlines()] == [8, 9]
    # a cursor asked for explicitly below the floor is bad input, with the snapshot to restore from
    assert main(["tail", "g-2", "--store", path, "--after", "1", "--json"]) == EXIT_USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["error"]["code"] == "CURSOR_TOO_OLD" and document["error"]["detail"]["floor"] == 6


def test_usage_errors(tmp_path, capsys):
    assert main(["inspect", "--store", str(tmp_path / "missing")]) == EXIT_USAGE
    assert main(["no-such-command"]) == EXIT_USAGE
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"], ["verify"], ["rebuild"], ["compact"], ["tail", GROUP],
        ["snapshot", "create", GROUP], ["keys", "list"], ["keys", "rotate"],
    ],
)
def test_store_commands_never_create_a_store_in_a_directory_without_one(tmp_path, capsys, argv):
    directory = tmp_path / "not-a-store"
    directory.mkdir()
    (directory / "keep.txt").write_text("keep me")
    assert main([*argv, "--store", str(directory)]) == EXIT_USAGE
    assert "STORE_NOT_FOUND: no store at" in capsys.readouterr().err
    assert main([*argv, "--store", str(directory), "--json"]) == EXIT_USAGE
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "STORE_NOT_FOUND"
    assert sorted(os.listdir(directory)) == ["keep.txt"]


def test_a_refused_input_with_json_prints_a_json_document(tmp_path, capsys):
    assert main(["demo", str(tmp_path / "demo"), "--agents", "1", "--json"]) == EXIT_USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False and document["error"]["code"] == "INVALID_COMMAND"


@pytest.mark.parametrize(
    "argv, field",
    [(["--suite", "nosuch"], "suite"), (["--suite", "crash", "--count", "0"], "count"), (["--suite", "crash", "--seconds", "0"], "seconds")],
)
def test_torture_refusing_its_options_with_json_prints_a_json_document(capsys, argv, field):
    # it printed only a line on standard error: a script reading --json got nothing
    assert main(["torture", *argv, "--json"]) == EXIT_USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False and document["error"]["code"] == "INVALID_COMMAND"
    assert document["error"]["detail"]["field"] == field



def test_torture_refuses_a_count_and_a_time_budget_together(capsys):
    """Given both, the count won and --seconds was ignored without a word."""
    assert main(["torture", "--suite", "nosuch", "--count", "1", "--seconds", "1", "--json"]) == EXIT_USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["error"]["detail"]["field"] == "arguments"
    assert "not allowed with argument" in document["error"]["message"]


@pytest.mark.parametrize(
    "options, field",
    [(["--group", "no/such group"], "group"), (["--org", ""], "org"), (["--high-water", str(2**63)], "high_water")],
)
def test_snapshot_verify_refuses_what_no_snapshot_could_match_as_bad_input(store, capsys, options, field):
    """A --group or --org that is no valid name, or a --high-water mark beyond every sequence,
    was reported as a snapshot failing its check (SNAPSHOT_INVALID, exit 1)."""
    code, ref = run_json(capsys, ["snapshot", "create", GROUP, "--store", store, "--json"])
    public_key = os.path.join(store, "keys", "snapshot-signing.pub")
    code, document = run_json(capsys, ["snapshot", "verify", os.path.join(store, ref["location"]), "--trust", public_key,
                                       *options, "--json"])
    assert code == EXIT_USAGE
    assert document["error"]["code"] == "INVALID_COMMAND" and document["error"]["detail"]["field"] == field

def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    store = str(tmp_path / "store")
    open_with_group(store).close()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte (`... | head -0`)
    try:
        command = subprocess.run(
            [sys.executable, "-m", "mwpstore", "inspect", "--store", store, "--json"],
            stdout=write_end, stderr=subprocess.PIPE, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    finally:
        os.close(write_end)
    assert command.returncode == EXIT_BROKEN_PIPE
    assert command.stderr == b"", command.stderr.decode()


def test_a_reader_that_goes_away_before_the_error_document_ends_the_command_quietly(tmp_path):
    """With --json a failed command prints its error document on standard output: a reader gone
    by then ends it the same way (it raised BrokenPipeError inside the error handler)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        command = subprocess.run(
            [sys.executable, "-m", "mwpstore", "inspect", "--store", str(tmp_path / "nowhere"), "--json"],
            stdout=write_end, stderr=subprocess.PIPE, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    finally:
        os.close(write_end)
    assert command.returncode == EXIT_BROKEN_PIPE
    assert b"Traceback" not in command.stderr, command.stderr.decode()



def _mwpstore(argv, **options):
    """``python -m mwpstore ARGV`` as a shell runs it: Python's default buffering (not the
    unbuffered output a test environment may set), standard error captured."""
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    environment["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, "-m", "mwpstore", *argv], stderr=subprocess.PIPE, timeout=120,
                          env=environment, **options)


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "--json"], ["keys", "list", "--json"], ["verify", "--json", "--store", "nowhere"]])
def test_a_reader_gone_before_buffered_output_is_written_ends_the_command_quietly(tmp_path, monkeypatch, argv):
    """The output stayed in Python's buffer until the interpreter's exit, whose failed flush
    printed "Exception ignored ... BrokenPipeError" and exited 120 instead of 141 (the other tests
    ran with PYTHONUNBUFFERED set, which hid it). The last case is an error document."""
    monkeypatch.chdir(tmp_path)
    open_with_group("store").close()
    argv = [*argv, "--store", "store"] if "--store" not in argv else argv
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        completed = _mwpstore(argv, stdout=write_end)
    finally:
        os.close(write_end)
    assert completed.returncode == EXIT_BROKEN_PIPE, completed.stderr.decode()
    assert b"Exception ignored" not in completed.stderr and b"Traceback" not in completed.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_standard_output_that_cannot_be_written_is_an_io_error(tmp_path, json_flag):
    """`inspect > /dev/full` (a full disk behind the redirection) ended in a traceback, exit 1 (a
    failed check) or 120."""
    store = str(tmp_path / "store")
    open_with_group(store).close()
    with open("/dev/full", "w") as full:
        completed = _mwpstore(["inspect", "--store", store, *json_flag], stdout=full)
    assert completed.returncode == EXIT_STORE_ERROR
    assert completed.stderr.decode().strip() == "mwpstore: cannot write standard output: No space left on device"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_standard_descriptor_whose_fstat_fails_for_another_reason_is_left_open(monkeypatch):
    """Only ``EBADF`` says a standard descriptor is closed: one whose fstat fails otherwise (EIO,
    EOVERFLOW) is open, and stays the caller's instead of being covered with /dev/null and its
    output refused as if it were closed."""
    from mwpstore import cli

    real_fstat = os.fstat

    def fstat(descriptor):
        if descriptor == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real_fstat(descriptor)

    replaced = []
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test, whatever the call did
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(cli.os, "fstat", fstat)
    monkeypatch.setattr(cli.os, "dup2", lambda *pair: replaced.append(pair))
    stdout = sys.stdout
    cli._protect_standard_streams()
    assert replaced == []
    assert sys.stdout is stdout


def test_a_closed_standard_stream_is_not_reused_for_a_store_file(tmp_path):
    """Started with descriptors 1 and 2 closed, the store's first files took those numbers (a
    write meant for standard error, such as the C core's assertion message, would land in one);
    with standard error closed every command exited 1 (sys.stderr was None); with standard
    output closed the output was dropped and the command exited 0."""
    store = str(tmp_path / "store")
    open_with_group(store).close()
    seen = str(tmp_path / "seen")
    script = (
        "import os, sys\n"
        "import mwpstore.authority as module\n"
        "from mwpstore.cli import main\n"
        "original = module.Authority.info\n"
        "def info(self):\n"
        "    with open(sys.argv[1], 'w') as out:\n"
        "        out.write(' '.join(os.readlink(f'/proc/self/fd/{fd}') for fd in (1, 2)))\n"
        "    return original(self)\n"
        "module.Authority.info = info\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(close):
        return subprocess.run([sys.executable, "-c", script, seen, "inspect", "--store", store, "--json"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment, timeout=120,
                              preexec_fn=lambda: [os.close(descriptor) for descriptor in close])

    completed = run((1, 2))
    assert completed.returncode == EXIT_STORE_ERROR  # the output could not be written (and its message had nowhere to go)
    assert open(seen).read() == f"{os.devnull} {os.devnull}"
    completed = run((2,))
    assert completed.returncode == EXIT_OK
    completed = run((1,))
    assert completed.returncode == EXIT_STORE_ERROR
    assert completed.stderr.decode().strip() == "mwpstore: cannot write standard output: standard output is closed"


def test_an_interrupted_command_with_json_prints_a_json_document(store, capsys, monkeypatch):
    """Ctrl-C (exit 130) left standard output empty: a script reading --json got nothing."""
    from mwpstore.authority import Authority

    def interrupted(self, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Authority, "verify", interrupted)
    assert main(["verify", "--store", store, "--json"]) == EXIT_INTERRUPTED
    assert json.loads(capsys.readouterr().out) == {"ok": False, "error": {"code": "INTERRUPTED", "message": "interrupted", "detail": {}}}
    assert main(["verify", "--store", store]) == EXIT_INTERRUPTED
    assert capsys.readouterr().out == ""


def test_an_error_the_engine_does_not_type_is_a_store_error_not_a_failed_check(store, capsys, monkeypatch):
    """An untyped exception escaping a command ended in Python's traceback and exit 1, which
    scripts read as "a check failed"."""
    from mwpstore.authority import Authority

    def broken(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Authority, "info", broken)
    assert main(["inspect", "--store", store, "--json"]) == EXIT_STORE_ERROR
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["code"] == "STORAGE_FAILED"
    assert "Traceback" in captured.err and "mwpstore: STORAGE_FAILED: I/O error (inspect)" in captured.err

@pytest.mark.parametrize(
    "argv",
    [
        ["tail", GROUP, "-n", "-5"], ["tail", GROUP, "-n", "x"], ["tail", GROUP, "-f", "--timeout", "nan"],
        ["tail", GROUP, "-f", "--timeout", "-1"], ["tail", GROUP, "-f", "--timeout", "inf"],
        ["torture", "--seconds", "nan"], ["torture", "--count", "-3"], ["tail", GROUP, "--after", "x"],
        ["snapshot", "verify", "f", "--trust", "k", "--high-water", "-1"],
    ],
)
@pytest.mark.timeout(120)  # a bound taken by mistake (--timeout inf) would follow forever: fail in minutes
def test_bad_numbers_are_usage_errors(store, capsys, argv):
    assert main([*argv, *(["--store", store] if argv[0] == "tail" else [])]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "error: argument" in captured.err and captured.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--agents", "1.5"], ["demo", "a", "b"], ["tail", "--store", "s", "-n", "x"], ["tail"],
        ["snapshot", "verify", "f"], ["keys", "drop"], ["keys", "rotate", "extra"], ["torture", "--seed", "1e3"],
        ["inspect", "--no-such-option"], ["snapshot"],
    ],
)
def test_a_command_line_that_does_not_parse_with_json_prints_a_json_document(capsys, argv):
    """argparse's refusals printed only usage on standard error (and main raised SystemExit): a
    script reading --json got nothing on standard output."""
    assert main([*argv, "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["ok"] is False and document["error"]["code"] == "INVALID_COMMAND"
    assert document["error"]["detail"]["field"] == "arguments"
    assert document["error"]["message"] in captured.err and "usage: mwpstore" in captured.err


def test_a_cursor_beyond_any_sequence_is_a_usage_error_not_damage(store, capsys):
    assert main(["tail", GROUP, "--store", store, "--after", str(10**30)]) == EXIT_USAGE
    assert "INVALID_COMMAND" in capsys.readouterr().err


def test_locked_store_is_a_store_error(store, capsys):
    with open_with_group(store + "-2") as _:
        pass
    from mwpstore import Authority

    with Authority.open(store):
        assert main(["inspect", "--store", store]) == EXIT_STORE_ERROR
    assert "STORE_LOCKED" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--version"], ["--json", "--version"], ["--version", "--json"]])
def test_version_is_text_and_with_json_one_json_document(capsys, argv):
    """--version printed its text also under --json, where a script expects one JSON document."""
    from mwpstore import __version__

    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    if "--json" in argv:
        assert json.loads(out) == {"ok": True, "version": __version__}
    else:
        assert out == f"mwpstore {__version__}\n"


def test_console_script_and_module_entry_points(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mwpstore", "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "demo" in result.stdout and "torture" in result.stdout
    for command in ("demo", "inspect", "tail", "verify", "rebuild", "compact", "snapshot", "keys", "bench", "torture"):
        sub = subprocess.run([sys.executable, "-m", "mwpstore", command, "--help"], capture_output=True, text=True, cwd=REPO)
        assert sub.returncode == 0, (command, sub.stderr)
