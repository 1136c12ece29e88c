/*
 * segment_format.h -- the on-disk format of the mwpstore segment log, as constants.
 *
 * Every number here is specified in docs/format/segment.md; that document is the
 * authority and this header follows it. The log bounds (SL_*_MAX, SL_*_MIN,
 * SL_*_DEFAULT) are copies of mwpstore/limits.py; tests/test_segment_constants.py
 * checks that both sides agree, and that the Python reference reader
 * (mwpstore/segment_reference.py) uses the same layout.
 *
 * All integers on disk are little-endian.
 */
#ifndef MWPSTORE_SEGMENT_FORMAT_H
#define MWPSTORE_SEGMENT_FORMAT_H

#include <stdint.h>

/* ---- segment header (docs/format/segment.md, "Segment header") ---------------------------- */

/* "MWPSEG" then CR LF: a text-mode transfer that rewrites line ends breaks the magic. */
#define SL_SEGMENT_MAGIC "MWPSEG\r\n"
#define SL_SEGMENT_MAGIC_BYTES 8
#define SL_FORMAT_VERSION 1

#define SL_HEADER_OFFSET_MAGIC 0          /* 8 bytes */
#define SL_HEADER_OFFSET_VERSION 8        /* u32 */
#define SL_HEADER_OFFSET_HEADER_BYTES 12  /* u32, always SL_SEGMENT_HEADER_BYTES */
#define SL_HEADER_OFFSET_LOG_ID 16        /* u64, random, the same in every segment of one log */
#define SL_HEADER_OFFSET_FIRST_POSITION 24 /* u64, position of the first frame in this segment */
#define SL_HEADER_OFFSET_SEGMENT_BYTES 32 /* u64, file size the segment was preallocated to */
#define SL_HEADER_OFFSET_RESERVED 40      /* 20 bytes, zero */
#define SL_HEADER_OFFSET_CHECKSUM 60      /* u32, crc32c of bytes [0, 60) */
#define SL_SEGMENT_HEADER_BYTES (8 + 4 + 4 + 8 + 8 + 8 + 20 + 4)

/* ---- frames (docs/format/segment.md, "Frames") -------------------------------------------- */

#define SL_FRAME_OFFSET_CHECKSUM 0  /* u32, crc32c(log_id as 8 bytes || frame bytes [4, frame end)) */
#define SL_FRAME_OFFSET_LENGTH_KIND 4 /* u32: payload length in bits 0..27, kind in bits 28..31 */
#define SL_FRAME_OFFSET_POSITION 8  /* u64, the frame's own logical position */
#define SL_FRAME_HEADER_BYTES (4 + 4 + 8) /* crc32c, length and kind, position */
#define SL_FRAME_ALIGN_BYTES 8      /* every frame starts at a multiple of 8; payload is zero-padded */
#define SL_FRAME_LENGTH_BITS 28
#define SL_FRAME_LENGTH_MASK ((1u << SL_FRAME_LENGTH_BITS) - 1u)

#define SL_KIND_RECORD 1 /* payload: the record's bytes */
#define SL_KIND_COMMIT 2 /* payload: group_start u64, record_count u32, group_checksum u32 */
#define SL_KIND_SEAL 3   /* payload: segment first_position u64, next_position u64 */

#define SL_COMMIT_PAYLOAD_BYTES (8 + 4 + 4)
#define SL_COMMIT_FRAME_BYTES (SL_FRAME_HEADER_BYTES + SL_COMMIT_PAYLOAD_BYTES)
#define SL_SEAL_PAYLOAD_BYTES (8 + 8)
#define SL_SEAL_FRAME_BYTES (SL_FRAME_HEADER_BYTES + SL_SEAL_PAYLOAD_BYTES)

/* Writes are assumed to tear only at multiples of this (docs/format/segment.md, "Torn tail"). */
#define SL_SECTOR_BYTES 512
/* A damaged commit record within this many flipped bits of the expected one is corruption. */
#define SL_COMMIT_DAMAGE_BITS_MAX 2

/* ---- bounds (copies of mwpstore/limits.py; units last) ------------------------------------ */

#define SL_SEGMENT_BYTES_DEFAULT (64ull * 1024 * 1024)
#define SL_SEGMENT_BYTES_MIN (64ull * 1024)
#define SL_SEGMENT_BYTES_MAX (1024ull * 1024 * 1024)
#define SL_RECORD_BYTES_MAX (16u * 1024 * 1024)
#define SL_GROUP_RECORDS_MAX 65536u
#define SL_GROUP_BYTES_MAX (64ull * 1024 * 1024)
#define SL_SCAN_BATCH_RECORDS_MAX 65536u
/* Segment files are named by their first position: 20 decimal digits, then ".seg". */
#define SL_SEGMENT_NAME_DIGITS 20
#define SL_FIRST_POSITION_MAX (UINT64_MAX / 2) /* a header naming a later first position is damaged */
#define SL_PATH_BYTES_MAX 4096

_Static_assert(SL_SEGMENT_HEADER_BYTES == 64, "segment header is 64 bytes");
_Static_assert(SL_SEGMENT_HEADER_BYTES % SL_FRAME_ALIGN_BYTES == 0, "frames start aligned");
_Static_assert(SL_FRAME_HEADER_BYTES == 16, "frame header is 16 bytes");
_Static_assert(SL_COMMIT_FRAME_BYTES == 32, "commit frame is 32 bytes");
_Static_assert(SL_SEAL_FRAME_BYTES == 32, "seal frame is 32 bytes");
_Static_assert(SL_COMMIT_FRAME_BYTES % SL_FRAME_ALIGN_BYTES == 0, "commit frame keeps alignment");
_Static_assert(SL_RECORD_BYTES_MAX <= SL_FRAME_LENGTH_MASK, "record length fits the length field");
_Static_assert(SL_SEGMENT_BYTES_MIN % 4096 == 0 && SL_SEGMENT_BYTES_MAX % 4096 == 0, "page multiples");
_Static_assert(SL_SEGMENT_BYTES_MIN > SL_SEGMENT_HEADER_BYTES + SL_SEAL_FRAME_BYTES, "room for frames");
_Static_assert(SL_GROUP_RECORDS_MAX <= UINT32_MAX, "record count fits a u32");
_Static_assert(SL_HEADER_OFFSET_CHECKSUM + 4 == SL_SEGMENT_HEADER_BYTES, "checksum ends the header");

#endif
