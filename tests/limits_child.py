"""Child process for the process-limit tests: one public call under an ``RLIMIT_NOFILE`` or
``RLIMIT_FSIZE`` the parent chooses, so the limit never reaches pytest.

Usage: python limits_child.py PATH CALL LIMIT VALUE [--preload MODULE ...]

Opens (creating) the store at PATH with 64 KiB segments, creates the Group and accepts Commands
until the index's ``data.mdb`` is at least 128 KiB, printing ``OK <action_id> <seq>`` after each
accept returned. Then it sets the limit and makes CALL (``verify``, ``rebuild`` or ``archive``):

- ``nofile VALUE``: every free descriptor is taken (duplicates of /dev/null) but VALUE, so the
  call may open exactly VALUE more files;
- ``fsize VALUE``: ``RLIMIT_FSIZE`` = VALUE bytes (CPython ignores ``SIGXFSZ``: a write past it
  fails with ``EFBIG``).

It prints ``CALL ok <result>``, ``CALL typed <code> <message>`` for an ``MwpError``, or
``CALL foreign <type> <message>`` for anything else, lifts the limit, makes one more accept
(printed like the others; for ``archive``, the archive again: ``AGAIN ok <last_seq>``), or
``AFTER typed <code>``, and closes the store (``CLOSED``).
``--preload`` imports modules before the limit (the import of one that is not loaded yet is
itself I/O).
"""

from __future__ import annotations

import importlib
import os
import resource
import sys

from authority_helpers import GROUP, group_create, mission_create
from mwpstore import Authority, MwpError

path, call, limit, value = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for name in sys.argv[6:] if sys.argv[5:6] == ["--preload"] else []:
    importlib.import_module(name)

authority = Authority.open(path, segment_bytes=64 * 1024)
authority.accept(group_create())
counter = 0


def accept() -> None:
    global counter
    counter += 1
    receipt = authority.accept(mission_create(f"m-{counter}", action_id=f"a-{counter}"))
    print(f"OK {receipt.action_id} {receipt.seq}", flush=True)


while os.path.getsize(os.path.join(path, "index", "data.mdb")) < 128 * 1024:
    accept()

held: list[int] = []
if limit == "nofile":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1024), hard))
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for _ in range(value):
        os.close(held.pop())
else:
    resource.setrlimit(resource.RLIMIT_FSIZE, (value, resource.RLIM_INFINITY))
try:
    if call == "verify":
        report = authority.verify()
        outcome = f"ok {report.ok} {report.problems}"
    elif call == "rebuild":
        outcome = f"ok {authority.rebuild()}"
    elif call == "archive":
        outcome = f"ok {authority.archive(GROUP, actor='owner', action_id='archive-1').last_seq}"
    else:
        raise SystemExit(f"unknown call {call}")
    line = f"{call} {outcome}"
except MwpError as exc:
    line = f"{call} typed {exc.code} {exc.message}"
except BaseException as exc:  # what the test is about: nothing foreign may come out
    line = f"{call} foreign {type(exc).__name__} {exc}"
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(line, flush=True)
try:
    if call == "archive":  # safe to call again after a failure part-way
        print(f"AGAIN ok {authority.archive(GROUP, actor='owner', action_id='archive-1').last_seq}", flush=True)
    else:
        accept()
except MwpError as exc:
    print(f"AFTER typed {exc.code}", flush=True)
authority.close()
print("CLOSED", flush=True)
