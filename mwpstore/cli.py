"""The ``mwpstore`` command line.

Exit codes (stable, for scripts): 0 success; 1 a check failed (verify, demo, torture found a
violation); 2 bad usage or bad input; 3 a store error (locked, corrupt, I/O: the message says
which), standard output that cannot be written (a full disk, a closed descriptor) and any error
the engine does not type, and a store that a read-only ``tail`` cannot read until a writer has
opened it; 130 interrupted; 141 the reader of standard output went away.
``--json`` prints one JSON document on standard output instead of tables; when the command fails
(a command line that does not parse and an interrupt included) that document is
``{"ok": false, "error": {"code", "message", "detail"}}``. Messages go to standard error.

``tail`` reads through read-only views and runs beside the process that has the store open;
every other store command takes the store's lock.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import __version__
from .errors import InvalidCommand, InvalidState, MwpError, StoreNotFound

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_STORE_ERROR = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a program its pipe's reader left


class Progress:
    """A progress bar on standard error for long operations; silent when stderr is not a terminal."""

    def __init__(self, label: str, *, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        fraction = 1.0 if total <= 0 else min(1.0, done / total)
        filled = int(fraction * 30)
        sys.stderr.write(f"\r{self.label:<12} [{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}%")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    """A plain, aligned text table."""
    text = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in text]) for i, header in enumerate(headers)]
    print("  ".join(header.ljust(width) for header, width in zip(headers, widths)))
    print("  ".join("-" * width for width in widths))
    for row in text:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


def emit(args: argparse.Namespace, document: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True, default=_json_default))
    else:
        human()


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    import msgspec

    return msgspec.to_builtins(value)


# -- commands -------------------------------------------------------------------------------------


def _open_authority(args: argparse.Namespace, *, progress: bool = True) -> Any:
    from .authority import Authority

    # Maintenance commands never create a store where there is none (StoreNotFound, exit 2).
    return Authority.open(args.store, progress=Progress("opening") if progress else None, create=False)


def cmd_inspect(args: argparse.Namespace) -> int:
    with _open_authority(args) as authority:
        info = authority.info()

    def human() -> None:
        print(f"store       {info['path']}")
        print(f"opened      {info['open']['mode']} ({info['open']['reason']}, {info['open']['redo_records']} records redone)")
        print(f"log         positions {info['log_start']} .. {info['log_end']}")
        print()
        print_table(
            [(s["first_position"], os.path.basename(s["path"]), s["used_bytes"], s["size_bytes"], "yes" if s["sealed"] else "no") for s in info["segments"]],
            ["first position", "segment", "used bytes", "size bytes", "sealed"],
        )
        print()
        print_table([(group, head["seq"], head["head_hash"][:16]) for group, head in sorted(info["groups"].items())], ["group", "head seq", "head hash"])

    emit(args, info, human)
    return EXIT_OK


FOLLOW_POLL_SECONDS = 0.25
"""How often ``tail -f`` looks for new Events."""


def _open_view(args: argparse.Namespace) -> Any:
    from .authority import Authority

    return Authority.open(args.store, readonly=True)


def cmd_tail(args: argparse.Namespace) -> int:
    """Read through read-only views (``Authority.open(readonly=True)``): no lock, so it runs
    beside the application that has the store open, and that application keeps appending while
    ``-f`` follows. Each view shows the store as it was when it opened, durable Events only; ``-f``
    opens a new one on each poll, so a segment rollover, a compaction or a rebuild by the writer
    (which replace files by rename) never leaves it reading the files they replaced."""
    from .errors import NotFound

    if args.timeout is not None and not args.follow:
        # It bounds only the following: without -f it would be ignored without a word, and a
        # script that meant `-f --timeout N` would get one read and take it for N seconds' worth.
        raise InvalidCommand("--timeout applies only with -f (--follow)", field="timeout")
    with _open_view(args) as view:
        head = view.head(args.group)[0]
        if head == 0:  # every Group that exists has at least its group.create Event
            # `Authority.read` answers [] for a Group not created yet, so that a consumer in the
            # process that will create it can start first. A mistyped name must not look like an
            # empty Group, least of all one followed forever (`snapshot create` of one is
            # NOT_FOUND as well).
            raise NotFound(f"group {args.group!r} does not exist", field="group")
        # The last N Events that are retained: a Group with a replay floor (a window, or archived
        # and compacted) serves nothing below it, and the default must not ask for that.
        floor = view.replay_floor(args.group)[0]
        after = max(floor, head - args.lines) if args.after is None else args.after
        cursor = _print_after(args, view, after)
    if not args.follow:
        return EXIT_OK
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        pause = FOLLOW_POLL_SECONDS if deadline is None else min(FOLLOW_POLL_SECONDS, deadline - time.monotonic())
        if pause <= 0:
            return EXIT_OK
        time.sleep(pause)
        try:
            with _open_view(args) as view:
                cursor = _print_after(args, view, cursor)
        except InvalidState as exc:
            # The writer is switching files (a compaction or a rebuild): the next poll sees the
            # new ones. The first open above reports it instead, so a store that only a writer
            # can recover is not followed in silence.
            if exc.detail.get("reason") != "recovery_needed":
                raise


def _print_after(args: argparse.Namespace, view: Any, cursor: int) -> int:
    """Print every Event of the view after ``cursor``; the last sequence printed (or ``cursor``)."""
    while True:
        events = view.read(args.group, after=cursor, limit=1000)
        if not events:
            return cursor
        for event in events:
            _print_event(args, event)
        cursor = events[-1].seq


def _print_event(args: argparse.Namespace, event: Any) -> None:
    if args.json:
        print(json.dumps(_json_default(event), sort_keys=True, default=_json_default), flush=True)
    else:
        flag = "" if event.authoritative else "  [evidence]"
        body = "<redacted>" if event.body is None else json.dumps(event.body, sort_keys=True)
        print(f"{event.seq:>8}  {event.kind:<20} {event.aggregate:<28} rev {event.revision:<4} {event.actor:<12} {body[:80]}{flag}", flush=True)


def cmd_verify(args: argparse.Namespace) -> int:
    with _open_authority(args) as authority:
        report = authority.verify(progress=Progress("verifying"))
    problems = report.problems
    document = {"ok": not problems, "records": report.records, "events": report.events, "groups": report.groups, "problems": problems}

    def human() -> None:
        print(f"records {report.records}, events {report.events}, groups {report.groups}")
        for problem in problems:
            print(f"PROBLEM  {problem}")
        print("OK: frames, hash chains, index, snapshots and audit logs all verify" if not problems else f"FAILED: {len(problems)} problem(s)")

    emit(args, document, human)
    return EXIT_OK if not problems else EXIT_CHECK_FAILED


def cmd_rebuild(args: argparse.Namespace) -> int:
    with _open_authority(args) as authority:
        started = time.perf_counter()
        count = authority.rebuild(progress=Progress("rebuilding"))
        seconds = time.perf_counter() - started
    document = {"records": count, "seconds": seconds, "records_per_second": count / seconds if seconds else None}
    emit(args, document, lambda: print(f"rebuilt the index from {count} log records in {seconds:.2f} s"))
    return EXIT_OK


def cmd_compact(args: argparse.Namespace) -> int:
    with _open_authority(args) as authority:
        report = authority.compact(progress=Progress("compacting"))
    document = {
        "records_before": report.records_before,
        "records_after": report.records_after,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "payloads_removed": report.payloads_removed,
        "events_dropped": report.events_dropped,
        "groups_compacted": report.groups_compacted,
        "seconds": report.seconds,
    }

    def human() -> None:
        print(f"records {report.records_before} -> {report.records_after}, bytes {report.bytes_before} -> {report.bytes_after}")
        print(f"redacted payloads removed {report.payloads_removed}; archived Events dropped {report.events_dropped} ({', '.join(report.groups_compacted) or 'no archived Group'})")

    emit(args, document, human)
    return EXIT_OK


def cmd_snapshot_create(args: argparse.Namespace) -> int:
    with _open_authority(args) as authority:
        ref = authority.snapshot(args.group)
    emit(args, ref.to_dict(), lambda: print(f"snapshot of {ref.group} at seq {ref.seq}: {ref.location} ({ref.file_bytes} bytes, key {ref.key_id})"))
    return EXIT_OK


def cmd_snapshot_verify(args: argparse.Namespace) -> int:
    from . import canonical, limits
    from .snapshot import Keyring, read_snapshot_file, verify_snapshot

    # A name that cannot be a Group's or an Organization's, or a high-water mark beyond every
    # sequence, is bad input (exit 2); it is not a snapshot that failed its check (exit 1).
    for name, value in (("group", args.group), ("org", args.org)):
        if value is not None:
            canonical.check_id(value, name)
    if args.high_water > limits.INT_ABS_MAX:
        raise InvalidCommand(f"--high-water must be at most {limits.INT_ABS_MAX}", field="high_water")
    keyring = Keyring()
    for key_path in args.trust:
        keyring.add_file(key_path)
    data = read_snapshot_file(args.file)
    verified = verify_snapshot(data, keyring=keyring, group=args.group, org=args.org, high_water_seq=args.high_water)
    document = {"ok": True, "org": verified.org, "group": verified.group, "seq": verified.seq, "aggregates": len(verified.aggregates), "key_id": verified.key_id}
    emit(args, document, lambda: print(f"OK: snapshot of {verified.group} ({verified.org}) at seq {verified.seq}, {len(verified.aggregates)} aggregates, key {verified.key_id}"))
    return EXIT_OK


def cmd_keys_list(args: argparse.Namespace) -> int:
    with _open_authority(args, progress=False) as authority:
        current = authority.signing_key
        retired = [key for key in authority.keyring().key_ids if key != current.key_id]
    document = {"current": current.key_id, "public_key": current.public_key.hex(), "retired": retired}

    def human() -> None:
        print(f"signing   {current.key_id}  {current.public_key.hex()}")
        for key_id in retired:
            print(f"retired   {key_id}  (still trusted for what it signed)")

    emit(args, document, human)
    return EXIT_OK


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    with _open_authority(args, progress=False) as authority:
        old = authority.signing_key.key_id
        new = authority.rotate_signing_key(retire=not args.drop_old)
        public_path = os.path.join(authority.path, "keys", "snapshot-signing.pub")
    document = {"old": old, "new": new.key_id, "public_key": new.public_key.hex(), "old_retired": not args.drop_old}

    def human() -> None:
        fate = "dropped: snapshots it signed no longer verify here" if args.drop_old else "retired: still trusted for what it signed"
        print(f"new signing key {new.key_id}; give verifiers {public_path}")
        print(f"old key {old} {fate}")

    emit(args, document, human)
    return EXIT_OK


def cmd_keys_drop(args: argparse.Namespace) -> int:
    with _open_authority(args, progress=False) as authority:
        authority.drop_retired_key(args.key_id)
        trusted = authority.keyring().key_ids
    document = {"dropped": args.key_id, "trusted": trusted}

    def human() -> None:
        print(f"retired key {args.key_id} dropped: what it signed no longer verifies here; take new snapshots")

    emit(args, document, human)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(args.directory, agents=args.agents, workitems=args.workitems, json_output=args.json)
    return EXIT_OK if report["ok"] else EXIT_CHECK_FAILED


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", "run_all.py")
    if not os.path.exists(script):
        raise UsageError("the benchmark suite lives in the source tree (bench/run_all.py); run from a checkout")
    command = [sys.executable, script] + (["--quick"] if args.quick else [])
    return subprocess.call(command, cwd=root)


def cmd_torture(args: argparse.Namespace) -> int:
    from .errors import InvalidCommand
    from .torture import OPTIONAL_SUITES, SUITES, run_torture

    # Refused here as typed errors, so that --json prints its error document for them too.
    unknown = [name for name in args.suite or [] if name not in SUITES + OPTIONAL_SUITES]
    if unknown:
        raise InvalidCommand(f"unknown suite(s) {unknown}; choose from {list(SUITES + OPTIONAL_SUITES)}", field="suite")
    if args.count is not None and args.count < 1:
        raise InvalidCommand("--count must be at least 1", field="count")
    if args.seconds is not None and args.seconds <= 0:
        raise InvalidCommand("--seconds must be above zero", field="seconds")
    return run_torture(args)


# -- parser ---------------------------------------------------------------------------------------


class UsageError(Exception):
    pass


def _count(text: str) -> int:
    """An argparse type: a whole number ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds ≥ 0 (no NaN, no infinity)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite, non-negative number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mwpstore", description="mwpstore: an embedded storage engine for the Mission Work Protocol.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit (with --json, as a JSON document)")
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    store = _Parser(add_help=False)
    store.add_argument("--store", default=os.environ.get("MWPSTORE_STORE", "mwpstore-data/authority"), help="the authority's directory (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", parents=[common], help="run the end-to-end demonstration and report what was checked")
    demo.add_argument("directory", nargs="?", default="mwpstore-demo", help="data directory for the demo (default: %(default)s; recreated on each run)")
    demo.add_argument("--agents", type=int, default=4, help="worker agents (threads), 2..16")
    demo.add_argument("--workitems", type=int, default=200, help="WorkItems in the Mission, 10..100000")
    demo.set_defaults(handler=cmd_demo)

    inspect = commands.add_parser("inspect", parents=[common, store], help="stores, Groups, heads, segments, sizes")
    inspect.set_defaults(handler=cmd_inspect)

    tail = commands.add_parser("tail", parents=[common, store], help="print a Group's Events (and follow new ones)")
    tail.add_argument("group")
    tail.add_argument("-n", "--lines", type=_count, default=20, help="last N Events (default %(default)s)")
    tail.add_argument("--after", type=_count, default=None, help="start after this sequence instead")
    tail.add_argument("-f", "--follow", action="store_true", help="then keep printing new Events as they become durable (read-only: the application that has the store open keeps writing)")
    tail.add_argument("--timeout", type=_seconds, default=None, help="with -f: stop following after this many seconds")
    tail.set_defaults(handler=cmd_tail)

    verify = commands.add_parser("verify", parents=[common, store], help="check frames, hash chains, snapshots and that the index equals a rebuild")
    verify.set_defaults(handler=cmd_verify)

    rebuild = commands.add_parser("rebuild", parents=[common, store], help="regenerate the index from the log")
    rebuild.set_defaults(handler=cmd_rebuild)

    compact = commands.add_parser("compact", parents=[common, store], help="rewrite the log without redacted payloads and archived Groups' Events")
    compact.set_defaults(handler=cmd_compact)

    snapshot = commands.add_parser("snapshot", help="create or verify signed snapshots")
    snapshot_commands = snapshot.add_subparsers(dest="snapshot_command", metavar="ACTION", required=True)
    create = snapshot_commands.add_parser("create", parents=[common, store], help="snapshot a Group at its head")
    create.add_argument("group")
    create.set_defaults(handler=cmd_snapshot_create)
    check = snapshot_commands.add_parser("verify", parents=[common], help="verify a snapshot file against trusted keys")
    check.add_argument("file")
    check.add_argument("--trust", action="append", default=[], required=True, help="a trusted public key file (.pub, hex); repeatable")
    check.add_argument("--group", default=None)
    check.add_argument("--org", default=None)
    check.add_argument("--high-water", type=_count, default=0, help="refuse snapshots older than this sequence")
    check.set_defaults(handler=cmd_snapshot_verify)

    keys = commands.add_parser("keys", help="list, rotate or drop snapshot signing keys")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    key_list = key_commands.add_parser("list", parents=[common, store], help="the current signing key and the retired ones still trusted")
    key_list.set_defaults(handler=cmd_keys_list)
    rotate = key_commands.add_parser("rotate", parents=[common, store], help="sign with a new key from now on; retire the old one")
    rotate.add_argument("--drop-old", action="store_true", help="do not keep trusting the old key (it was compromised)")
    rotate.set_defaults(handler=cmd_keys_rotate)
    drop = key_commands.add_parser("drop", parents=[common, store], help="stop trusting a retired key found compromised later")
    drop.add_argument("key_id", help="the retired key's id (16 hex characters, as `keys list` shows)")
    drop.set_defaults(handler=cmd_keys_drop)

    bench = commands.add_parser("bench", help="run the benchmark suite against SQLite and eventsourcing (bench/run_all.py)")
    bench.add_argument("--quick", action="store_true", help="small sizes, a few minutes")
    bench.set_defaults(handler=cmd_bench)

    torture = commands.add_parser("torture", parents=[common], help="run the reliability suites (crash, power loss, corruption, fsync failure, fuzzing)")
    torture.add_argument("--suite", action="append", default=None, help="run only this suite (repeatable); default: all but lmdb-sweep")
    budget = torture.add_mutually_exclusive_group()  # given both, one would be ignored
    budget.add_argument("--count", type=_count, default=None, help="iterations per suite (default: the suite's short CI count)")
    budget.add_argument("--seconds", type=_seconds, default=None, help="time budget per suite instead of a count: no iteration starts after it, so a suite "
                         "ends within it plus the iteration under way (a fuzz input, a crash-suite child, a "
                         "concurrency round of at least 4 s) and about a second to stop fuzz's atheris child")
    torture.add_argument("--seed", type=int, default=1, help="random seed (default %(default)s)")
    torture.set_defaults(handler=cmd_torture)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    _protect_standard_streams()
    real_output = sys.stdout
    sys.stdout = _StandardOutput(real_output)
    try:
        code = _parse_and_run(arguments)
        # Written out here, not at the interpreter's exit, where a failure could only be reported
        # as "Exception ignored" and exit status 120.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`mwpstore inspect --json | head`), also before an error document:
        # stop quietly.
        _discard_standard_output(real_output)
        return EXIT_BROKEN_PIPE
    except _OutputFailed as failure:
        _discard_standard_output(real_output)
        print(f"mwpstore: cannot write standard output: {failure.error.strerror or failure.error}", file=sys.stderr)
        return EXIT_STORE_ERROR
    finally:
        sys.stdout = real_output


def _parse_and_run(arguments: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
    except _ParserRefused as refused:
        refused.parser.print_usage(sys.stderr)
        print(f"{refused.parser.prog}: error: {refused.message}", file=sys.stderr)
        if _json_asked(arguments):
            error = InvalidCommand(refused.message, field="arguments", command=refused.parser.prog)
            print(json.dumps({"ok": False, "error": error.to_dict()}, sort_keys=True))
        return EXIT_USAGE
    except _VersionAsked:
        if _json_asked(arguments):
            print(json.dumps({"ok": True, "version": __version__}, sort_keys=True))
        else:
            print(f"mwpstore {__version__}")
        return EXIT_OK
    except SystemExit as done:  # --help: printed (always as text), and flushed by main like any output
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The command's exit code; what it raises (but errors writing standard output) turned into its exit code."""
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"mwpstore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MwpError as exc:
        return _report_error(args, exc)
    except KeyboardInterrupt:
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": {"code": "INTERRUPTED", "message": "interrupted", "detail": {}}}, sort_keys=True))
        return EXIT_INTERRUPTED
    except (BrokenPipeError, _OutputFailed):
        raise
    except Exception as exc:
        # Not an error the engine types (a bug, or a foreign error that escaped translation):
        # exit 1 is reserved for a failed check, so report it as the store error it is
        # translated to, with the traceback for the bug report.
        import traceback
        from .errors import translate

        traceback.print_exc(file=sys.stderr)
        return _report_error(args, translate(exc, context=args.command))


def _report_error(args: argparse.Namespace, exc: MwpError) -> int:
    from .errors import CursorTooOld, Rejection, SnapshotInvalid

    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": exc.to_dict()}, default=_json_default, sort_keys=True))
    print(f"mwpstore: {exc.code}: {exc.message}", file=sys.stderr)
    # A Rejection (INVALID_COMMAND, NOT_FOUND, ...) refused the input and changed nothing; so
    # did an open that found no store, and a `tail --after` below the Group's replay floor. A
    # store that needs a writer's recovery before a read-only view can read it is a store error
    # (like one that is locked), though the view refused it as InvalidState.
    if exc.detail.get("reason") == "recovery_needed":
        return EXIT_STORE_ERROR
    if isinstance(exc, (Rejection, StoreNotFound, CursorTooOld)):
        return EXIT_USAGE
    return EXIT_CHECK_FAILED if isinstance(exc, SnapshotInvalid) else EXIT_STORE_ERROR


# -- standard streams -----------------------------------------------------------------------------


def _json_asked(arguments: list[str]) -> bool:
    """Whether ``--json`` is among the options (before a ``--``), for answers given before the
    command line is parsed to its end."""
    return "--json" in (arguments[: arguments.index("--")] if "--" in arguments else arguments)


class _VersionAsked(Exception):
    """``--version`` was given: answered by _parse_and_run, as text or, with --json, as JSON."""


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> NoReturn:
        raise _VersionAsked


class _ParserRefused(Exception):
    """The command line did not parse: raised in place of argparse's exit so that it is answered
    like any bad input (exit 2, and with --json the error document)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParserRefused(self, message)


class _OutputFailed(Exception):
    """Writing standard output failed for a reason other than a reader gone away."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _StandardOutput:
    """``sys.stdout`` while a command runs: a write that fails (a full disk behind ``> file``, a
    closed descriptor) is told apart from the command's own errors. A reader gone away stays a
    BrokenPipeError (exit 141)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ClosedOutput:
    """Standard output of a process started with descriptor 1 closed (``mwpstore inspect >&-``)."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _protect_standard_streams() -> None:
    """Put /dev/null on each of descriptors 0, 1 and 2 that the process was started without.

    Otherwise the first files a store opens take those numbers, and a write meant for standard
    output or error (the C core's assertion message) lands in a store file. Messages for a closed
    standard error are dropped; output for a closed standard output is an error (exit 3)."""
    closed = []
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                continue  # open, whatever else its fstat failed for: it stays the caller's
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != descriptor:
                os.dup2(opened, descriptor)
                os.close(opened)
            closed.append(descriptor)
    if sys.stderr is None or 2 in closed:
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115 - lives as long as the process
    if sys.stdout is None or 1 in closed:
        sys.stdout = _ClosedOutput()


def _discard_standard_output(stream: Any) -> None:
    """Send later writes to standard output, the interpreter's own flush at exit included, to
    /dev/null: what is still buffered cannot be delivered, and must not fail again at exit."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor: nothing flushes it at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
