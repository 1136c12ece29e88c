"""Every bound the engine enforces, in one place. Names end with their unit.

The C segment log has its own copies of the log bounds in ``csrc/segment_format.h``; a test
(``tests/test_segment_constants.py``) checks that both sides agree.
"""

from __future__ import annotations

# -- Segment log --------------------------------------------------------------------------------
SEGMENT_BYTES_DEFAULT = 64 * 1024 * 1024
SEGMENT_BYTES_MIN = 64 * 1024
SEGMENT_BYTES_MAX = 1024 * 1024 * 1024
RECORD_BYTES_MAX = 16 * 1024 * 1024
GROUP_RECORDS_MAX = 65536
GROUP_BYTES_MAX = 64 * 1024 * 1024
SCAN_BATCH_RECORDS_MAX = 65536
# Sealed segments one log handle keeps mapped (each map holds a descriptor): the least recently
# read beyond these are unmapped, and mapped again when read.
SEGMENT_MAPS_MAX = 64

# -- IDs and Commands ---------------------------------------------------------------------------
ID_CHARS_MAX = 128
KIND_CHARS_MAX = 64
AGGREGATE_CHARS_MAX = KIND_CHARS_MAX + 1 + ID_CHARS_MAX  # an aggregate key, "<type>:<id>" with a kind as its type
BODY_BYTES_MAX = 1024 * 1024
BODY_DEPTH_MAX = 32
BODY_ITEMS_MAX = 100_000
STRING_BYTES_MAX = 1024 * 1024
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
INT_ABS_MAX = 2**63 - 1
TIME_MS_MAX = 2**62  # a clock reading or acceptance time (ms since the epoch): room left for durations added to it

# -- Work Contracts -----------------------------------------------------------------------------
WORK_ATTEMPTS_MAX = 1000  # bound on a Work Contract's max_attempts (also bounds backoff exponents)
BACKOFF_MULTIPLIER_TERM_MAX = 1_000_000  # bound on a backoff multiplier or each term of its ratio
# Bound on a Work Contract's durations (lease_ms, start_ms, backoff_initial_ms, backoff_max_ms):
# 100 years of 365.25 days. Far above any useful lease or retry delay, and small enough that an
# acceptance time from any real clock plus such a duration stays far below INT_ABS_MAX (about 292
# million years). Times derived from them also saturate at INT_ABS_MAX (leases.time_after).
WORK_DURATION_MS_MAX = 36_525 * 24 * 60 * 60 * 1000  # 36,525 days

# -- Acceptance ---------------------------------------------------------------------------------
ACCEPT_MANY_COMMANDS_MAX = 10_000
COMMIT_BATCH_COMMANDS_MAX = 4096
READ_LIMIT_MAX = 100_000

# -- Delivered Events and snapshots --------------------------------------------------------------
EVENT_BYTES_MAX = RECORD_BYTES_MAX
SNAPSHOT_HEADER_BYTES_MAX = 64 * 1024
SNAPSHOT_STATE_BYTES_MAX = 1024 * 1024 * 1024
AUDIT_CHUNK_BYTES = 1024 * 1024
AUDIT_CHUNK_BYTES_MAX = 16 * 1024 * 1024

# -- LMDB ---------------------------------------------------------------------------------------
LMDB_MAP_BYTES_DEFAULT = 64 * 1024 * 1024 * 1024
AGENT_LMDB_MAP_BYTES_DEFAULT = 16 * 1024 * 1024 * 1024
# Reads under way at once in one LMDB environment (each holds a slot of its reader table): the
# authority's index counts its own reads and those of every process's read-only views; an
# AgentStore its threads' reads. One more is StorageFailed (reason readers_full) until one ends.
LMDB_READERS_MAX = 512
LMDB_VALUE_BYTES_MAX = RECORD_BYTES_MAX  # any value either LMDB store holds (a state, an encoded Event, a projection value)
# Opening a store checks its LMDB file's structure first (csrc/lmdb_check.c) when the file is at
# most this large (about 20 ms from the page cache, 0.1 s cold, measured on this project's
# machines); larger files are checked when asked (check_lmdb=True) and by verify().
LMDB_CHECK_AT_OPEN_BYTES_MAX = 64 * 1024 * 1024
