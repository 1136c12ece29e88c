"""Child process of ``test_cross_process_steps.py``: the readers from outside the writer's process.

Usage: python cross_process_reader.py STORE KINDS [PAUSE]

Runs each reader of ``KINDS`` (comma-separated) once on the store at ``STORE`` and prints one JSON
line per reader: ``{"kind": ..., "served": ...}``, ``{"kind": ..., "refused": [code, reason,
message]}`` for a typed error, or ``{"kind": ..., "error": traceback}`` for anything else.

- ``view``: ``Authority.open(STORE, readonly=True)``, every Group read in pages of 3 from seq 1,
  checked contiguous and hash-chained here, and each snapshot its references name read through it
  (``read_snapshot``) and checked against its reference, and ``info()``'s segments checked the
  same as at its open; served: each Group's Event hashes.
- ``log``: a bare ``SegmentLog.open(STORE/log, readonly=True)`` scanned in batches of 2, every
  record read again by position, its ``segments()`` checked the same as at its open and its
  ``verify()`` counting the records served; served: the log id and ``[position, record digest]`` of each.
- ``tail``: ``mwpstore tail --json`` (``cli.main``) of each Group the store's ``snapshots/`` or
  ``archive/`` name plus ``g-1``; served: each Group's ``[seq, hash]`` lines.
- ``files``: every snapshot file (``read_snapshot_file`` and ``verify_snapshot`` against the
  store's public keys) and every archived Group's audit log (``read_audit_log`` with the store's
  Organization keys); served: per file ``[group, seq]`` or the record count, or the refusal.

``PAUSE`` stops the first reader mid-read and prints ``PAUSED`` until a line arrives on standard
input: ``page`` after its first page (``view``) or batch (``log``), ``map`` in the open between
mapping the log's first segment file and its next, ``lastmap`` before it maps the active segment
(``view`` and ``log``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import traceback

import blake3
import msgspec

from mwpstore import Authority, cli, segment_log
from mwpstore.audit_log import FileKeyProvider, read_audit_log
from mwpstore.errors import MwpError
from mwpstore.messages import ZERO_HASH, Event
from mwpstore.segment_log import SegmentLog
from mwpstore.snapshot import Keyring, check_snapshot_ref, read_snapshot_file, retired_public_keys, verify_snapshot

PAGE = 3
ORG = "acme"


def digest(record: bytes | memoryview) -> str:
    return blake3.blake3(record).hexdigest(length=16)


def pause() -> None:
    print("PAUSED", flush=True)
    sys.stdin.readline()


def pause_at_map(store: str, last: bool) -> None:
    """The open maps segment files by name (``_open_segment_fd``): pause before the second, or
    (``last``) before the last of those in the log directory now, the active segment."""
    real, seen = segment_log._open_segment_fd, []
    active = os.path.join(store, "log", sorted(name for name in os.listdir(os.path.join(store, "log")) if name.endswith(".seg"))[-1])

    def open_segment_fd(path):
        seen.append(path)
        if (path == active) if last else len(seen) == 2:
            pause()
        return real(path)

    segment_log._open_segment_fd = open_segment_fd


def read_view(store: str, paused: bool) -> dict[str, list[str]]:
    served: dict[str, list[str]] = {}
    with Authority.open(store, readonly=True) as view:
        opened = view.info()["segments"]
        for group in view.groups():
            floor = view.replay_floor(group)[0]
            after, previous, hashes = floor, None, []
            while batch := view.read(group, after=after, limit=PAGE):
                for event in batch:
                    if event.seq != after + 1 or (previous is not None and event.prev_hash != previous) or (event.seq == 1 and event.prev_hash != ZERO_HASH):
                        raise AssertionError(f"{group}: Event {event.seq} after {after} (chained: {event.prev_hash == previous})")
                    after, previous = event.seq, event.hash
                    hashes.append(event.hash.hex())
                if paused:
                    paused = False
                    pause()
            if view.head(group)[0] != after:
                raise AssertionError(f"{group}: read up to {after}, the head is {view.head(group)[0]}")
            for ref in view.snapshots(group):  # the files its references name, checked against them
                check_snapshot_ref(view.read_snapshot(ref), ref)
            served[group] = [floor, hashes]
        check_same_segments(opened, view.info()["segments"])
    return served


def check_same_segments(before: list[dict], after: list[dict]) -> None:
    """A handle's segments (``info()``'s, ``segments()``'s) after a step are those it described at
    its open: the files it reads, whatever their names hold by then. Only the active one's size may
    differ (the writer seals and trims it)."""
    if [{**one, "size_bytes": None} for one in before] != [{**one, "size_bytes": None} for one in after] or (
            [one["size_bytes"] for one in before[:-1]] != [one["size_bytes"] for one in after[:-1]]):
        raise AssertionError(f"the segments described at the open {before} are now {after}")


def read_log(store: str, paused: bool) -> dict[str, object]:
    records: list[list[object]] = []
    with SegmentLog.open(os.path.join(store, "log"), readonly=True) as log:
        opened = [dataclasses.asdict(segment) for segment in log.segments()]
        for batch in log.scan(log.start, batch_records=2):
            records.extend([position, digest(record)] for position, record in zip(batch.positions, batch.records))
            if paused:
                paused = False
                pause()
        for position, expected in records:
            if digest(log.read(position)) != expected:
                raise AssertionError(f"read({position}) differs from the record the scan served there")
        check_same_segments(opened, [dataclasses.asdict(segment) for segment in log.segments()])
        if log.verify() != len(records):
            raise AssertionError("verify() counts other records than the scan served")
        return {"log_id": log.log_id, "start": log.start, "end": log.end, "records": records}


def groups_named(store: str) -> list[str]:
    names = {"g-1"}
    for top in ("snapshots", "archive"):
        if os.path.isdir(os.path.join(store, top)):
            names.update(os.listdir(os.path.join(store, top)))
    return sorted(names)


def read_tail(store: str) -> dict[str, object]:
    served: dict[str, object] = {}
    for group in groups_named(store):
        output, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(errors):
            code = cli.main(["tail", "--json", "--store", store, "-n", "1000000", group])
        lines = [json.loads(line) for line in output.getvalue().splitlines()]
        if code == 0:
            served[group] = [[event.seq, event.hash.hex()] for event in (msgspec.convert(line, Event) for line in lines)]
        else:  # its error document, as a refusal
            try:
                error = lines[-1]["error"]
                served[group] = {"refused": [error["code"], error["detail"].get("reason"), error["message"][:300]]}
            except (IndexError, KeyError, TypeError):
                served[group] = {"exit": code, "stdout": output.getvalue()[-1000:], "stderr": errors.getvalue()[-1000:]}
    return served


def read_files(store: str) -> dict[str, object]:
    keyring = Keyring()
    keys = os.path.join(store, "keys")
    keyring.add_file(os.path.join(keys, "snapshot-signing.pub"))
    for public_key in retired_public_keys(keys):
        keyring.add(public_key)
    served: dict[str, object] = {}
    for group in groups_named(store):
        directory = os.path.join(store, "snapshots", group)
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if name.endswith(".snap"):
                served[f"snapshots/{group}/{name}"] = attempt(lambda path=os.path.join(directory, name), group=group: (
                    lambda verified: [verified.group, verified.seq])(verify_snapshot(read_snapshot_file(path), keyring=keyring, group=group)))
        directory = os.path.join(store, "archive", group)
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if name.startswith("audit-") and name.endswith(".log"):
                provider = FileKeyProvider(os.path.join(keys, "orgs"))
                served[f"archive/{group}/{name}"] = attempt(lambda path=os.path.join(directory, name), group=group: (
                    len(list(read_audit_log(path, key_provider=provider, org=ORG, group=group)))))
    return served


def attempt(read):
    try:
        return {"served": read()}
    except MwpError as exc:
        return {"refused": [exc.code, exc.detail.get("reason"), exc.message[:300]]}


def main() -> None:
    store, kinds = sys.argv[1], sys.argv[2].split(",")
    where = sys.argv[3] if len(sys.argv) > 3 else ""
    if where in ("map", "lastmap"):
        pause_at_map(store, where == "lastmap")
    readers = {"view": lambda paused: read_view(store, paused), "log": lambda paused: read_log(store, paused),
               "tail": lambda paused: read_tail(store), "files": lambda paused: read_files(store)}
    for number, kind in enumerate(kinds):
        try:
            line = {"kind": kind, "served": readers[kind](where == "page" and number == 0)}
        except MwpError as exc:
            line = {"kind": kind, "refused": [exc.code, exc.detail.get("reason"), exc.message[:600]]}
        except Exception:
            line = {"kind": kind, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
