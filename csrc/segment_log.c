/*
 * segment_log.c -- the append-only segment log: frame encoding and parsing, open-time
 * recovery, batched scans, and the single writer (group commit, seal and rollover).
 *
 * The format is specified in docs/format/segment.md; section names from that document are
 * cited in the comments below. File mutations go through struct sl_io (the I/O seam).
 */
#define _GNU_SOURCE
#include "segment_log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"

/* Always-on assertion for programmer errors (not removed by NDEBUG). */
#define SL_ASSERT(condition)                                                                  \
    do {                                                                                      \
        if (!(condition)) {                                                                   \
            fprintf(stderr, "mwpstore segment log: assertion failed: %s (%s:%d)\n", #condition, \
                    __FILE__, __LINE__);                                                      \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

/* ---- little-endian loads and stores (docs/format/segment.md: "all integers little-endian") - */

static uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t load_u64(const uint8_t *p) {
    return (uint64_t)load_u32(p) | (uint64_t)load_u32(p + 4) << 32;
}

static void store_u32(uint8_t *p, uint32_t value) {
    p[0] = (uint8_t)value;
    p[1] = (uint8_t)(value >> 8);
    p[2] = (uint8_t)(value >> 16);
    p[3] = (uint8_t)(value >> 24);
}

static void store_u64(uint8_t *p, uint64_t value) {
    store_u32(p, (uint32_t)value);
    store_u32(p + 4, (uint32_t)(value >> 32));
}

static int fault_set(struct sl_fault *fault, int code, int32_t reason, uint64_t offset,
                     uint64_t position) {
    if (fault != NULL) {
        fault->reason = reason;
        fault->offset = offset;
        fault->position = position;
    }
    return code;
}

static int fault_io(struct sl_fault *fault, int negative_errno) {
    SL_ASSERT(negative_errno < 0);
    if (fault != NULL) {
        fault->sys_errno = -negative_errno;
    }
    return SL_E_IO;
}

static void fault_clear(struct sl_fault *fault) {
    if (fault != NULL) {
        memset(fault, 0, sizeof(*fault));
    }
}

uint64_t sl_frame_bytes(uint64_t payload_bytes) {
    uint64_t unaligned = SL_FRAME_HEADER_BYTES + payload_bytes;
    return (unaligned + (SL_FRAME_ALIGN_BYTES - 1)) & ~(uint64_t)(SL_FRAME_ALIGN_BYTES - 1);
}

static uint32_t checksum_u32(uint32_t crc, uint32_t value) {
    uint8_t bytes[4];
    store_u32(bytes, value);
    return sl_crc32c(crc, bytes, 4);
}

static uint64_t offset_of(const struct sl_header *header, uint64_t position) {
    return SL_SEGMENT_HEADER_BYTES + (position - header->first_position);
}

static uint64_t position_of(const struct sl_header *header, uint64_t offset) {
    return header->first_position + (offset - SL_SEGMENT_HEADER_BYTES);
}

/* ---- segment header ("Segment header") --------------------------------------------------- */

static int segment_bytes_valid(uint64_t segment_bytes) {
    return segment_bytes >= SL_SEGMENT_BYTES_MIN && segment_bytes <= SL_SEGMENT_BYTES_MAX &&
           segment_bytes % 4096 == 0;
}

int sl_header_encode(uint64_t log_id, uint64_t first_position, uint64_t segment_bytes,
                     uint8_t *out, size_t out_bytes) {
    if (out_bytes < SL_SEGMENT_HEADER_BYTES || !segment_bytes_valid(segment_bytes) ||
        first_position % SL_FRAME_ALIGN_BYTES != 0) {
        return SL_E_ARGUMENT;
    }
    memset(out, 0, SL_SEGMENT_HEADER_BYTES);
    memcpy(out + SL_HEADER_OFFSET_MAGIC, SL_SEGMENT_MAGIC, SL_SEGMENT_MAGIC_BYTES);
    store_u32(out + SL_HEADER_OFFSET_VERSION, SL_FORMAT_VERSION);
    store_u32(out + SL_HEADER_OFFSET_HEADER_BYTES, SL_SEGMENT_HEADER_BYTES);
    store_u64(out + SL_HEADER_OFFSET_LOG_ID, log_id);
    store_u64(out + SL_HEADER_OFFSET_FIRST_POSITION, first_position);
    store_u64(out + SL_HEADER_OFFSET_SEGMENT_BYTES, segment_bytes);
    store_u32(out + SL_HEADER_OFFSET_CHECKSUM, sl_crc32c(0, out, SL_HEADER_OFFSET_CHECKSUM));
    return SL_OK;
}

static uint32_t seed_of(uint64_t log_id) {
    uint8_t bytes[8];
    store_u64(bytes, log_id);
    return sl_crc32c(0, bytes, 8);
}

int sl_header_decode(const uint8_t *data, size_t length, struct sl_header *out,
                     struct sl_fault *fault) {
    fault_clear(fault);
    memset(out, 0, sizeof(*out));
    if (length < SL_SEGMENT_HEADER_BYTES) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_HEADER_SHORT, 0, 0);
    }
    if (memcmp(data + SL_HEADER_OFFSET_MAGIC, SL_SEGMENT_MAGIC, SL_SEGMENT_MAGIC_BYTES) != 0) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_HEADER_MAGIC, 0, 0);
    }
    if (load_u32(data + SL_HEADER_OFFSET_CHECKSUM) != sl_crc32c(0, data, SL_HEADER_OFFSET_CHECKSUM)) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_HEADER_CHECKSUM, SL_HEADER_OFFSET_CHECKSUM, 0);
    }
    out->version = load_u32(data + SL_HEADER_OFFSET_VERSION);
    if (out->version != SL_FORMAT_VERSION) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_HEADER_VERSION, SL_HEADER_OFFSET_VERSION, 0);
    }
    out->log_id = load_u64(data + SL_HEADER_OFFSET_LOG_ID);
    out->first_position = load_u64(data + SL_HEADER_OFFSET_FIRST_POSITION);
    out->segment_bytes = load_u64(data + SL_HEADER_OFFSET_SEGMENT_BYTES);
    out->seed = seed_of(out->log_id);
    int reserved_zero = 1;
    for (size_t i = SL_HEADER_OFFSET_RESERVED; i < SL_HEADER_OFFSET_CHECKSUM; i++) {
        reserved_zero &= data[i] == 0;
    }
    if (load_u32(data + SL_HEADER_OFFSET_HEADER_BYTES) != SL_SEGMENT_HEADER_BYTES ||
        !segment_bytes_valid(out->segment_bytes) ||
        out->first_position % SL_FRAME_ALIGN_BYTES != 0 ||
        out->first_position > SL_FIRST_POSITION_MAX || !reserved_zero) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_HEADER_FIELD, 0, 0);
    }
    return SL_OK;
}

/* ---- frames ("Frames", "Validity") ------------------------------------------------------- */

enum frame_status { FRAME_OK = 0, FRAME_END = 1, FRAME_BAD = 2 };

struct frame {
    uint32_t kind;
    uint32_t length;
    uint32_t checksum;
    uint64_t frame_bytes;
    int checksum_ok; /* when FRAME_BAD: the checksum held, so the bytes were written as they are */
    int32_t reason;
    const uint8_t *payload;
};

static int all_zero(const uint8_t *p, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        if (p[i] != 0) {
            return 0;
        }
    }
    return 1;
}

/* Parse the frame expected at `offset` (logical `position`). FRAME_END: sixteen zero bytes, or
 * the end of the readable bytes with nothing but zeros left. */
static int frame_parse(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                       uint64_t offset, uint64_t position, struct frame *f) {
    memset(f, 0, sizeof(*f));
    if (offset >= data_bytes) {
        return FRAME_END;
    }
    if (data_bytes - offset < SL_FRAME_HEADER_BYTES) {
        if (all_zero(data + offset, data_bytes - offset)) {
            return FRAME_END;
        }
        f->reason = SL_REASON_FRAME_TRUNCATED;
        return FRAME_BAD;
    }
    const uint8_t *h = data + offset;
    if (all_zero(h, SL_FRAME_HEADER_BYTES)) {
        return FRAME_END;
    }
    f->checksum = load_u32(h + SL_FRAME_OFFSET_CHECKSUM);
    uint32_t length_kind = load_u32(h + SL_FRAME_OFFSET_LENGTH_KIND);
    f->kind = length_kind >> SL_FRAME_LENGTH_BITS;
    f->length = length_kind & SL_FRAME_LENGTH_MASK;
    f->payload = h + SL_FRAME_HEADER_BYTES;
    if (f->length > SL_RECORD_BYTES_MAX) {
        f->reason = SL_REASON_FRAME_LENGTH;
        return FRAME_BAD;
    }
    f->frame_bytes = sl_frame_bytes(f->length);
    if (f->frame_bytes > data_bytes - offset) {
        f->reason = SL_REASON_FRAME_TRUNCATED;
        return FRAME_BAD;
    }
    uint32_t computed = sl_crc32c(header->seed, h + 4, (size_t)f->frame_bytes - 4);
    if (computed != f->checksum) {
        f->reason = SL_REASON_FRAME_CHECKSUM;
        return FRAME_BAD;
    }
    f->checksum_ok = 1;
    if (f->kind != SL_KIND_RECORD && f->kind != SL_KIND_COMMIT && f->kind != SL_KIND_SEAL) {
        f->reason = SL_REASON_FRAME_KIND;
        return FRAME_BAD;
    }
    if ((f->kind == SL_KIND_COMMIT && f->length != SL_COMMIT_PAYLOAD_BYTES) ||
        (f->kind == SL_KIND_SEAL && f->length != SL_SEAL_PAYLOAD_BYTES)) {
        f->reason = SL_REASON_FRAME_LENGTH;
        return FRAME_BAD;
    }
    if (load_u64(h + SL_FRAME_OFFSET_POSITION) != position) {
        f->reason = SL_REASON_FRAME_POSITION;
        return FRAME_BAD;
    }
    return FRAME_OK;
}

static void frame_write_header(uint8_t *frame, uint32_t kind, uint32_t length, uint64_t position) {
    store_u32(frame + SL_FRAME_OFFSET_LENGTH_KIND, kind << SL_FRAME_LENGTH_BITS | length);
    store_u64(frame + SL_FRAME_OFFSET_POSITION, position);
}

static uint32_t frame_seal_checksum(uint8_t *frame, uint64_t frame_bytes, uint32_t seed) {
    uint32_t checksum = sl_crc32c(seed, frame + 4, (size_t)frame_bytes - 4);
    store_u32(frame + SL_FRAME_OFFSET_CHECKSUM, checksum);
    return checksum;
}

static void commit_encode(uint8_t *frame, uint64_t position, uint64_t group_start,
                          uint32_t record_count, uint32_t group_checksum, uint32_t seed) {
    memset(frame, 0, SL_COMMIT_FRAME_BYTES);
    frame_write_header(frame, SL_KIND_COMMIT, SL_COMMIT_PAYLOAD_BYTES, position);
    store_u64(frame + SL_FRAME_HEADER_BYTES, group_start);
    store_u32(frame + SL_FRAME_HEADER_BYTES + 8, record_count);
    store_u32(frame + SL_FRAME_HEADER_BYTES + 12, group_checksum);
    frame_seal_checksum(frame, SL_COMMIT_FRAME_BYTES, seed);
}

static void seal_encode(uint8_t *frame, uint64_t position, uint64_t first_position, uint32_t seed) {
    memset(frame, 0, SL_SEAL_FRAME_BYTES);
    frame_write_header(frame, SL_KIND_SEAL, SL_SEAL_PAYLOAD_BYTES, position);
    store_u64(frame + SL_FRAME_HEADER_BYTES, first_position);
    store_u64(frame + SL_FRAME_HEADER_BYTES + 8, position); /* the next segment starts here */
    frame_seal_checksum(frame, SL_SEAL_FRAME_BYTES, seed);
}

static int commit_matches(const struct frame *f, uint64_t group_start, uint32_t records,
                          uint32_t group_checksum) {
    return records >= 1 && load_u64(f->payload) == group_start &&
           load_u32(f->payload + 8) == records && load_u32(f->payload + 12) == group_checksum;
}

static int seal_matches(const struct frame *f, const struct sl_header *header, uint64_t position) {
    return load_u64(f->payload) == header->first_position && load_u64(f->payload + 8) == position;
}

/* ---- open-time recovery ("Torn tail") ------------------------------------------------------ */

static int popcount8(uint8_t value) {
    int count = 0;
    while (value != 0) {
        count += value & 1u;
        value >>= 1;
    }
    return count;
}

/* Bits that differ between the commit frame a complete group would end with and what is there. */
static int commit_distance(const uint8_t *data, uint64_t data_bytes, uint64_t offset,
                           const uint8_t *expected) {
    int distance = 0;
    for (uint64_t i = 0; i < SL_COMMIT_FRAME_BYTES; i++) {
        if (offset + i < data_bytes) {
            distance += popcount8((uint8_t)(data[offset + i] ^ expected[i]));
        } else {
            distance += 8;
        }
    }
    return distance;
}

/* Which commit frames completed_write_follows counts: the group's own (naming group_start), any
 * group's, or only a later group's. */
enum follows { FOLLOWS_OWN = 0, FOLLOWS_ANY = 1, FOLLOWS_LATER = 2 };

/* Is there, after `from_offset`, an intact commit frame at its own position of the groups `which`
 * selects, or an intact seal? Either proves the write that began at group_start completed, so
 * damage before it is corruption rather than a torn tail: the writer writes a group only after
 * the one before it is durable (outside bulk mode), and syncs before every seal. Candidates sit
 * at multiples of the frame alignment. */
static int completed_write_follows(const uint8_t *data, uint64_t data_bytes,
                                   const struct sl_header *header, uint64_t from_offset,
                                   uint64_t group_start, enum follows which) {
    const uint32_t commit_word = (uint32_t)SL_KIND_COMMIT << SL_FRAME_LENGTH_BITS | SL_COMMIT_PAYLOAD_BYTES;
    const uint32_t seal_word = (uint32_t)SL_KIND_SEAL << SL_FRAME_LENGTH_BITS | SL_SEAL_PAYLOAD_BYTES;
    uint64_t candidate = (from_offset + SL_FRAME_ALIGN_BYTES - 1) & ~(uint64_t)(SL_FRAME_ALIGN_BYTES - 1);
    for (; candidate + SL_COMMIT_FRAME_BYTES <= data_bytes; candidate += SL_FRAME_ALIGN_BYTES) {
        const uint8_t *h = data + candidate;
        uint64_t position = position_of(header, candidate);
        if (load_u64(h + SL_FRAME_OFFSET_POSITION) != position) {
            continue;
        }
        uint32_t word = load_u32(h + SL_FRAME_OFFSET_LENGTH_KIND);
        if (word != commit_word && word != seal_word) {
            continue;
        }
        struct frame f;
        if (frame_parse(data, data_bytes, header, candidate, position, &f) != FRAME_OK) {
            continue;
        }
        const uint64_t named = f.kind == SL_KIND_COMMIT ? load_u64(f.payload) : 0;
        if (f.kind == SL_KIND_COMMIT && (which == FOLLOWS_ANY || (which == FOLLOWS_OWN) == (named == group_start))) {
            return 1;
        }
        if (f.kind == SL_KIND_SEAL && seal_matches(&f, header, position)) {
            return 1;
        }
    }
    return 0;
}

/* Recovery of sl_recover and sl_recover_readonly; `readonly` selects the latter's rules, `bulk`
 * the former's for a log written in bulk mode (groups not synced one by one, so a later group can
 * reach the disk before an earlier one: only a group's own commit frame or a seal proves it). */
static int recover(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                   int readonly, int bulk, struct sl_recovery *out, struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header != NULL && out != NULL);
    fault_clear(fault);
    memset(out, 0, sizeof(*out));
    if (data_bytes > header->segment_bytes) {
        data_bytes = header->segment_bytes;
    }
    uint64_t position = header->first_position;
    uint64_t offset = SL_SEGMENT_HEADER_BYTES;
    for (;;) {
        const uint64_t group_start = position;
        uint32_t records = 0;
        uint32_t group_checksum = header->seed;
        struct frame f;
        int status;
        for (;;) {
            status = frame_parse(data, data_bytes, header, offset, position, &f);
            if (status != FRAME_OK || f.kind != SL_KIND_RECORD || records == SL_GROUP_RECORDS_MAX) {
                break;
            }
            records++;
            group_checksum = checksum_u32(group_checksum, f.checksum);
            position += f.frame_bytes;
            offset += f.frame_bytes;
        }
        if (status == FRAME_OK && f.kind == SL_KIND_COMMIT) {
            if (!commit_matches(&f, group_start, records, group_checksum)) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_COMMIT_MISMATCH, offset, position);
            }
            position += SL_COMMIT_FRAME_BYTES;
            offset += SL_COMMIT_FRAME_BYTES;
            out->group_count++;
            out->record_count += records;
            continue;
        }
        if (status == FRAME_OK && f.kind == SL_KIND_SEAL) {
            if (records != 0 || !seal_matches(&f, header, position)) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_SEAL_MISMATCH, offset, position);
            }
            out->sealed = 1;
            out->end_position = position; /* the seal takes no position: the next segment's first */
            out->used_bytes = offset + SL_SEAL_FRAME_BYTES;
            /* read-only: what follows the seal is the writer's to trim, never read */
            out->torn = !readonly && !all_zero(data + out->used_bytes, data_bytes - out->used_bytes);
            return SL_OK;
        }
        if (status == FRAME_OK) { /* a record group larger than any writer makes */
            return fault_set(fault, SL_E_CORRUPT, SL_REASON_GROUP_TOO_MANY, offset, position);
        }
        out->end_position = group_start;
        out->used_bytes = offset_of(header, group_start);
        if (status == FRAME_END && records == 0) {
            /* The clean end: zeros where the next group would start. What follows them is looked
             * at by sl_check_after_end, where the caller finds bytes that are not zero (a scan
             * here would touch every page of a preallocated segment at every recovery). */
            return SL_OK;
        }
        if (status == FRAME_BAD && f.checksum_ok) {
            /* Intact bytes that are wrong here were written wrong or moved: never a tear. */
            return fault_set(fault, SL_E_CORRUPT, f.reason, offset, position);
        }
        /* Read-only (beside a live writer), a group is damage only once a later write is seen
         * complete: any intact commit frame at its own position, or an intact seal. Without one,
         * the bytes may be a group the writer is still copying in, whatever they look like (a
         * half-copied commit frame can be within two bits of the whole one). */
        const int proven = !readonly ||
                           completed_write_follows(data, data_bytes, header,
                                                   offset + SL_FRAME_ALIGN_BYTES, group_start, FOLLOWS_ANY);
        if (records >= 1 && proven) {
            uint8_t expected[SL_COMMIT_FRAME_BYTES];
            commit_encode(expected, position, group_start, records, group_checksum, header->seed);
            if (commit_distance(data, data_bytes, offset, expected) <= SL_COMMIT_DAMAGE_BITS_MAX) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_COMMIT_DAMAGED, offset, position);
            }
        }
        if (readonly ? proven
                     : completed_write_follows(data, data_bytes, header,
                                               offset + SL_FRAME_ALIGN_BYTES, group_start,
                                               bulk ? FOLLOWS_OWN : FOLLOWS_ANY)) {
            return fault_set(fault, SL_E_CORRUPT, SL_REASON_GROUP_DAMAGED, offset, position);
        }
        out->torn = 1;
        return SL_OK;
    }
}

int sl_recover(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header, int bulk,
               struct sl_recovery *out, struct sl_fault *fault) {
    return recover(data, data_bytes, header, 0, bulk != 0, out, fault);
}

int sl_recover_readonly(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                        struct sl_recovery *out, struct sl_fault *fault) {
    return recover(data, data_bytes, header, 1, 0, out, fault);
}

int sl_check_after_end(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                       uint64_t end_offset, uint64_t from_offset, struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header != NULL);
    fault_clear(fault);
    if (end_offset < SL_SEGMENT_HEADER_BYTES || end_offset >= data_bytes ||
        data_bytes - end_offset < SL_FRAME_HEADER_BYTES ||
        !all_zero(data + end_offset, SL_FRAME_HEADER_BYTES)) {
        return SL_OK; /* no clean end here (a writer has appended since): nothing to judge */
    }
    if (from_offset < end_offset + SL_FRAME_ALIGN_BYTES) {
        from_offset = end_offset + SL_FRAME_ALIGN_BYTES;
    }
    const uint64_t end_position = position_of(header, end_offset);
    /* The group that would start at the end may be a torn last write whose own commit frame
     * reached the disk before its first bytes (the repair cuts it, as before); a later group's
     * commit frame proves that group was durable. */
    if (completed_write_follows(data, data_bytes, header, from_offset, end_position, FOLLOWS_LATER)) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_GROUP_DAMAGED, end_offset, end_position);
    }
    return SL_OK;
}

/* Can a segment with this header end with a seal at `end_position`? */
static int seal_position_ok(const struct sl_header *header, uint64_t end_position) {
    return end_position > header->first_position &&
           end_position - header->first_position <=
               header->segment_bytes - SL_SEGMENT_HEADER_BYTES - SL_SEAL_FRAME_BYTES &&
           end_position % SL_FRAME_ALIGN_BYTES == 0;
}

/* Is `frame` (`frame_bytes` read at file offset `offset`, where the seal must be) an intact seal
 * at `end_position`? */
static int check_seal_frame(const uint8_t *frame, uint64_t frame_bytes, uint64_t offset,
                            const struct sl_header *header, uint64_t end_position,
                            struct sl_fault *fault) {
    fault_clear(fault);
    if (!seal_position_ok(header, end_position)) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_SEAL_MISSING, 0, end_position);
    }
    struct frame f;
    int status = frame_parse(frame, frame_bytes, header, 0, end_position, &f);
    if (status != FRAME_OK || f.kind != SL_KIND_SEAL || !seal_matches(&f, header, end_position)) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_SEAL_MISSING, offset, end_position);
    }
    return SL_OK;
}

/* pread until `want` bytes or the end of the file; the count read, or a negative errno. */
static int64_t read_at(int fd, uint8_t *out, size_t want, uint64_t offset) {
    size_t got = 0;
    while (got < want) {
        ssize_t n = pread(fd, out + got, want - got, (off_t)(offset + got));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            return -errno;
        }
        if (n == 0) {
            break;
        }
        got += (size_t)n;
    }
    return (int64_t)got;
}

/* The header and the seal frame of the open segment file `fd`: see sl_segments_inspect. */
static int inspect_segment(int fd, uint64_t seal_position, struct sl_header *header_out,
                           uint64_t *file_bytes_out, int *seal_status_out,
                           struct sl_fault *seal_fault, struct sl_fault *fault) {
    fault_clear(seal_fault);
    memset(header_out, 0, sizeof(*header_out));
    *file_bytes_out = 0;
    *seal_status_out = SL_OK;
    uint8_t header[SL_SEGMENT_HEADER_BYTES];
    uint8_t seal[SL_SEAL_FRAME_BYTES];
    struct stat st;
    if (fstat(fd, &st) != 0) {
        return fault_io(fault, -errno);
    }
    if (!S_ISREG(st.st_mode)) { /* a directory, a FIFO, a device: nothing a segment can be */
        return fault_io(fault, S_ISDIR(st.st_mode) ? -EISDIR : -EINVAL);
    }
    *file_bytes_out = (uint64_t)st.st_size;
    int64_t got = read_at(fd, header, sizeof(header), 0);
    if (got < 0) {
        return fault_io(fault, (int)got);
    }
    int rc = sl_header_decode(header, (size_t)got, header_out, fault);
    if (rc != SL_OK || seal_position == SL_NO_SEAL_CHECK) {
        return rc;
    }
    uint64_t offset = 0;
    got = 0;
    if (seal_position_ok(header_out, seal_position)) {
        offset = offset_of(header_out, seal_position);
        got = read_at(fd, seal, sizeof(seal), offset);
        if (got < 0) {
            return fault_io(fault, (int)got);
        }
    }
    *seal_status_out =
        check_seal_frame(seal, (uint64_t)got, offset, header_out, seal_position, seal_fault);
    return SL_OK;
}

static int segment_path(char *out, size_t out_bytes, const char *directory, uint64_t first_position,
                        const char *suffix);

int sl_segments_inspect(const char *directory, const uint64_t *numbers, uint32_t count,
                        struct sl_header *headers_out, uint64_t *file_bytes_out,
                        int *seal_status_out, struct sl_fault *seal_faults_out,
                        uint32_t *stopped_at_out, struct sl_fault *fault) {
    SL_ASSERT(directory != NULL && stopped_at_out != NULL);
    fault_clear(fault);
    *stopped_at_out = 0;
    if (count == 0) {
        return SL_OK;
    }
    /* One directory handle: each segment is then opened by its name alone. */
    int directory_fd = open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (directory_fd < 0) {
        return fault_io(fault, -errno);
    }
    int rc = SL_OK;
    uint32_t i = 0;
    for (; i < count; i++) {
        char name[64];
        int named = segment_path(name, sizeof(name), ".", numbers[i], "");
        SL_ASSERT(named == SL_OK);
        /* O_NONBLOCK: opening a FIFO placed under a segment's name must not wait for a writer;
         * O_NOFOLLOW: a symbolic link there is no segment of this log (ELOOP). */
        int fd = openat(directory_fd, name, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
        if (fd < 0) {
            rc = fault_io(fault, -errno);
            break;
        }
        rc = inspect_segment(fd, i + 1 < count ? numbers[i + 1] : SL_NO_SEAL_CHECK, &headers_out[i],
                             &file_bytes_out[i], &seal_status_out[i], &seal_faults_out[i], fault);
        close(fd);
        if (rc != SL_OK) {
            break;
        }
    }
    close(directory_fd);
    *stopped_at_out = i;
    return rc;
}

int sl_segment_check_mapped(const uint8_t *data, uint64_t data_bytes, uint64_t seal_position,
                            struct sl_header *header_out, int *seal_status_out,
                            struct sl_fault *seal_fault, struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header_out != NULL && seal_status_out != NULL);
    fault_clear(fault);
    fault_clear(seal_fault);
    memset(header_out, 0, sizeof(*header_out));
    *seal_status_out = SL_OK;
    size_t header_bytes = data_bytes < SL_SEGMENT_HEADER_BYTES ? (size_t)data_bytes : SL_SEGMENT_HEADER_BYTES;
    int rc = sl_header_decode(data, header_bytes, header_out, fault);
    if (rc != SL_OK) {
        return rc;
    }
    uint64_t offset = 0;
    uint64_t got = 0;
    if (seal_position_ok(header_out, seal_position)) {
        offset = offset_of(header_out, seal_position);
        if (offset < data_bytes) {
            got = data_bytes - offset < SL_SEAL_FRAME_BYTES ? data_bytes - offset : SL_SEAL_FRAME_BYTES;
        }
    }
    *seal_status_out = check_seal_frame(got ? data + offset : data, got, offset, header_out, seal_position, seal_fault);
    return SL_OK;
}

/* ---- reading ------------------------------------------------------------------------------ */

int sl_read_record(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                   uint64_t position, uint64_t *offset_out, uint32_t *length_out,
                   struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header != NULL && offset_out != NULL && length_out != NULL);
    fault_clear(fault);
    if (position < header->first_position || position % SL_FRAME_ALIGN_BYTES != 0 ||
        position - header->first_position >= data_bytes - SL_SEGMENT_HEADER_BYTES ||
        data_bytes <= SL_SEGMENT_HEADER_BYTES) {
        return fault_set(fault, SL_E_NOT_RECORD, SL_REASON_NOT_A_RECORD, 0, position);
    }
    uint64_t offset = offset_of(header, position);
    struct frame f;
    int status = frame_parse(data, data_bytes, header, offset, position, &f);
    if (status == FRAME_OK && f.kind == SL_KIND_RECORD) {
        *offset_out = offset + SL_FRAME_HEADER_BYTES;
        *length_out = f.length;
        return SL_OK;
    }
    /* A frame that names this position but fails its checks is damage; anything else means the
     * caller's position is not where a record starts. */
    int names_position = offset + SL_FRAME_HEADER_BYTES <= data_bytes &&
                         load_u64(data + offset + SL_FRAME_OFFSET_POSITION) == position;
    if (status == FRAME_BAD && names_position && !f.checksum_ok) {
        return fault_set(fault, SL_E_CORRUPT, f.reason, offset, position);
    }
    return fault_set(fault, SL_E_NOT_RECORD, SL_REASON_NOT_A_RECORD, offset, position);
}

int sl_scan(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
            uint64_t stop_position, uint32_t records_max, struct sl_scan_state *state,
            uint64_t *positions_out, uint64_t *starts_out, uint64_t *stops_out,
            uint32_t *count_out, struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header != NULL && state != NULL && count_out != NULL);
    SL_ASSERT(positions_out != NULL && starts_out != NULL && stops_out != NULL);
    fault_clear(fault);
    *count_out = 0;
    if (records_max == 0 || records_max > SL_SCAN_BATCH_RECORDS_MAX) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_NONE, 0, 0);
    }
    if (data_bytes > header->segment_bytes || data_bytes < SL_SEGMENT_HEADER_BYTES) {
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_NONE, 0, 0);
    }
    if (state->position < header->first_position || state->position % SL_FRAME_ALIGN_BYTES != 0) {
        return fault_set(fault, SL_E_NOT_RECORD, SL_REASON_NOT_A_RECORD, 0, state->position);
    }
    uint32_t count = 0;
    const uint64_t end_position = position_of(header, data_bytes);
    while (count < records_max && state->position < stop_position &&
           state->position < end_position && !state->sealed) {
        uint64_t position = state->position;
        uint64_t offset = offset_of(header, position);
        struct frame f;
        int status = frame_parse(data, data_bytes, header, offset, position, &f);
        if (status != FRAME_OK) {
            if (!state->group_known && state->group_records == 0 && count == 0) {
                /* The very first frame of a scan that starts somewhere the caller chose. */
                int names_position = offset + SL_FRAME_HEADER_BYTES <= data_bytes &&
                                     load_u64(data + offset + SL_FRAME_OFFSET_POSITION) == position;
                if (!(status == FRAME_BAD && names_position && !f.checksum_ok)) {
                    return fault_set(fault, SL_E_NOT_RECORD, SL_REASON_NOT_A_RECORD, offset, position);
                }
            }
            int32_t reason = status == FRAME_END ? SL_REASON_UNEXPECTED_END : f.reason;
            return fault_set(fault, SL_E_CORRUPT, reason, offset, position);
        }
        if (f.kind == SL_KIND_RECORD) {
            if (state->group_records == SL_GROUP_RECORDS_MAX) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_GROUP_TOO_MANY, offset, position);
            }
            positions_out[count] = position;
            starts_out[count] = offset + SL_FRAME_HEADER_BYTES;
            stops_out[count] = offset + SL_FRAME_HEADER_BYTES + f.length;
            count++;
            state->group_records++;
            state->group_checksum = checksum_u32(state->group_checksum, f.checksum);
        } else if (f.kind == SL_KIND_COMMIT) {
            if (state->group_known &&
                !commit_matches(&f, state->group_start, state->group_records, state->group_checksum)) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_COMMIT_MISMATCH, offset, position);
            }
            state->group_known = 1;
            state->group_start = position + SL_COMMIT_FRAME_BYTES;
            state->group_records = 0;
            state->group_checksum = header->seed;
        } else {
            if (state->group_records != 0 || !seal_matches(&f, header, position)) {
                return fault_set(fault, SL_E_CORRUPT, SL_REASON_SEAL_MISMATCH, offset, position);
            }
            state->sealed = 1;
            break; /* the seal's position is the next segment's first position */
        }
        state->position = position + f.frame_bytes;
    }
    *count_out = count;
    return SL_OK;
}

int sl_verify_sealed(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                     uint64_t *end_position_out, struct sl_fault *fault) {
    SL_ASSERT(data != NULL && header != NULL && end_position_out != NULL);
    struct sl_recovery recovery;
    int rc = sl_recover(data, data_bytes, header, 0, &recovery, fault);
    if (rc != SL_OK) {
        return rc;
    }
    if (!recovery.sealed) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_SEAL_MISSING, recovery.used_bytes,
                         recovery.end_position);
    }
    if (recovery.torn) {
        return fault_set(fault, SL_E_CORRUPT, SL_REASON_DATA_AFTER_SEAL, recovery.used_bytes,
                         recovery.end_position);
    }
    *end_position_out = recovery.end_position;
    return SL_OK;
}

int sl_find_nonzero(int fd, uint64_t from_offset, uint64_t to_offset, uint64_t *found_out,
                    struct sl_fault *fault) {
    SL_ASSERT(found_out != NULL);
    fault_clear(fault);
    *found_out = to_offset;
    enum { CHUNK_BYTES = 1 << 20 };
    uint8_t *chunk = NULL;
    uint64_t offset = from_offset;
    while (offset < to_offset) {
        /* Skip holes and unwritten extents where the file system reports them; reading is the
         * fallback everywhere else, so the answer never depends on SEEK_DATA support. */
        off_t data = lseek(fd, (off_t)offset, SEEK_DATA);
        if (data < 0) {
            if (errno == ENXIO) {
                break;
            }
            data = (off_t)offset;
        }
        if ((uint64_t)data >= to_offset) {
            break;
        }
        off_t hole = lseek(fd, data, SEEK_HOLE);
        uint64_t stop = (hole < 0 || (uint64_t)hole > to_offset) ? to_offset : (uint64_t)hole;
        if (stop <= (uint64_t)data) {
            stop = to_offset;
        }
        if (chunk == NULL && (chunk = malloc(CHUNK_BYTES)) == NULL) {
            return SL_E_NO_MEMORY;
        }
        for (uint64_t at = (uint64_t)data; at < stop;) {
            size_t want = (size_t)((stop - at) < CHUNK_BYTES ? (stop - at) : CHUNK_BYTES);
            ssize_t got = pread(fd, chunk, want, (off_t)at);
            if (got < 0 && errno == EINTR) {
                continue;
            }
            if (got < 0) {
                int saved = errno;
                free(chunk);
                return fault_io(fault, -saved);
            }
            if (got == 0) { /* the file is shorter than expected: the rest reads as nothing */
                stop = at;
                to_offset = at;
                break;
            }
            for (ssize_t i = 0; i < got; i++) {
                if (chunk[i] != 0) {
                    *found_out = at + (uint64_t)i;
                    free(chunk);
                    return SL_OK;
                }
            }
            at += (uint64_t)got;
        }
        offset = stop;
    }
    free(chunk);
    return SL_OK;
}

/* ---- the default I/O seam ------------------------------------------------------------------ */

static int io_create_file(void *context, const char *path, int *fd_out) {
    (void)context;
    /* O_EXCL already refuses a link at the name (EEXIST); O_NOFOLLOW says so outright */
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
        return -errno;
    }
    *fd_out = fd;
    return 0;
}

static int io_open_file(void *context, const char *path, int *fd_out) {
    (void)context;
    /* never through a symbolic link at a segment's name: appends would land in the file it names */
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        return -errno;
    }
    *fd_out = fd;
    return 0;
}

static int io_close_file(void *context, int fd) {
    (void)context;
    return close(fd) == 0 ? 0 : -errno;
}

static int io_write_at(void *context, int fd, const uint8_t *data, size_t length, uint64_t offset) {
    (void)context;
    while (length > 0) {
        ssize_t written = pwrite(fd, data, length, (off_t)offset);
        if (written < 0 && errno == EINTR) {
            continue;
        }
        if (written < 0) {
            return -errno;
        }
        if (written == 0) {
            return -EIO;
        }
        data += written;
        length -= (size_t)written;
        offset += (uint64_t)written;
    }
    return 0;
}

static int io_sync_data(void *context, int fd) {
    (void)context;
    return fdatasync(fd) == 0 ? 0 : -errno;
}

static int io_sync_file(void *context, int fd) {
    (void)context;
    return fsync(fd) == 0 ? 0 : -errno;
}

static int io_truncate_file(void *context, int fd, uint64_t length) {
    (void)context;
    return ftruncate(fd, (off_t)length) == 0 ? 0 : -errno;
}

static int io_allocate_file(void *context, int fd, uint64_t length) {
    (void)context;
    int rc = posix_fallocate(fd, 0, (off_t)length);
    if (rc == EOPNOTSUPP || rc == EINVAL) { /* no preallocation here: a sparse file still works */
        return ftruncate(fd, (off_t)length) == 0 ? 0 : -errno;
    }
    return -rc;
}

static int io_rename_file(void *context, const char *from_path, const char *to_path) {
    (void)context;
    return rename(from_path, to_path) == 0 ? 0 : -errno;
}

static int io_remove_file(void *context, const char *path) {
    (void)context;
    return unlink(path) == 0 ? 0 : -errno;
}

static int io_sync_directory(void *context, const char *path) {
    (void)context;
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return -errno;
    }
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

static const struct sl_io io_default = {
    NULL,           io_create_file,   io_open_file,     io_close_file,
    io_write_at,    io_sync_data,     io_sync_file,     io_truncate_file,
    io_allocate_file, io_rename_file, io_remove_file,   io_sync_directory,
};

const struct sl_io *sl_io_default(void) { return &io_default; }

/* ---- files -------------------------------------------------------------------------------- */

static int segment_path(char *out, size_t out_bytes, const char *directory, uint64_t first_position,
                        const char *suffix) {
    int n = snprintf(out, out_bytes, "%s/%020llu.seg%s", directory,
                     (unsigned long long)first_position, suffix);
    return (n > 0 && (size_t)n < out_bytes) ? SL_OK : SL_E_ARGUMENT;
}

int sl_segment_create(const struct sl_io *io, const char *directory, uint64_t log_id,
                      uint64_t first_position, uint64_t segment_bytes, struct sl_fault *fault) {
    SL_ASSERT(io != NULL && directory != NULL);
    fault_clear(fault);
    char path[SL_PATH_BYTES_MAX];
    char temporary[SL_PATH_BYTES_MAX];
    uint8_t header[SL_SEGMENT_HEADER_BYTES];
    if (segment_path(path, sizeof(path), directory, first_position, "") != SL_OK ||
        segment_path(temporary, sizeof(temporary), directory, first_position, ".tmp") != SL_OK) {
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_PATH_TOO_LONG, 0, first_position);
    }
    if (sl_header_encode(log_id, first_position, segment_bytes, header, sizeof(header)) != SL_OK) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_SEGMENT_BYTES, 0, first_position);
    }
    int fd = -1;
    int rc = io->create_file(io->context, temporary, &fd);
    if (rc == -EEXIST) { /* left by a crash during an earlier creation; it was never renamed */
        rc = io->remove_file(io->context, temporary);
        if (rc == 0) {
            rc = io->create_file(io->context, temporary, &fd);
        }
    }
    if (rc != 0) {
        return fault_io(fault, rc);
    }
    rc = io->allocate_file(io->context, fd, segment_bytes);
    if (rc == 0) {
        rc = io->write_at(io->context, fd, header, sizeof(header), 0);
    }
    if (rc == 0) {
        rc = io->sync_file(io->context, fd);
    }
    int close_rc = io->close_file(io->context, fd);
    if (rc == 0) {
        rc = close_rc;
    }
    if (rc == 0) {
        rc = io->rename_file(io->context, temporary, path);
    }
    if (rc == 0) {
        rc = io->sync_directory(io->context, directory);
    }
    return rc == 0 ? SL_OK : fault_io(fault, rc);
}

int sl_segment_truncate(const struct sl_io *io, const char *path, uint64_t keep_bytes,
                        uint64_t allocate_bytes, struct sl_fault *fault) {
    SL_ASSERT(io != NULL && path != NULL);
    fault_clear(fault);
    int fd = -1;
    int rc = io->open_file(io->context, path, &fd);
    if (rc != 0) {
        return fault_io(fault, rc);
    }
    rc = io->truncate_file(io->context, fd, keep_bytes);
    if (rc == 0 && allocate_bytes > keep_bytes) {
        rc = io->allocate_file(io->context, fd, allocate_bytes);
    }
    if (rc == 0) {
        rc = io->sync_file(io->context, fd);
    }
    int close_rc = io->close_file(io->context, fd);
    if (rc == 0) {
        rc = close_rc;
    }
    return rc == 0 ? SL_OK : fault_io(fault, rc);
}

int sl_remove_file(const struct sl_io *io, const char *directory, const char *path,
                   struct sl_fault *fault) {
    SL_ASSERT(io != NULL && directory != NULL && path != NULL);
    fault_clear(fault);
    int rc = io->remove_file(io->context, path);
    if (rc == 0) {
        rc = io->sync_directory(io->context, directory);
    }
    return rc == 0 ? SL_OK : fault_io(fault, rc);
}

int sl_create_empty_file(const struct sl_io *io, const char *directory, const char *path,
                         struct sl_fault *fault) {
    SL_ASSERT(io != NULL && directory != NULL && path != NULL);
    fault_clear(fault);
    int fd = -1;
    int rc = io->create_file(io->context, path, &fd);
    if (rc == -EEXIST) {
        rc = 0; /* there already: only its name counts */
    } else if (rc == 0) {
        rc = io->close_file(io->context, fd);
    }
    if (rc == 0) {
        rc = io->sync_directory(io->context, directory);
    }
    return rc == 0 ? SL_OK : fault_io(fault, rc);
}

int sl_sync_directory(const struct sl_io *io, const char *path, struct sl_fault *fault) {
    SL_ASSERT(io != NULL && path != NULL);
    fault_clear(fault);
    int rc = io->sync_directory(io->context, path);
    return rc == 0 ? SL_OK : fault_io(fault, rc);
}

/* ---- the writer ("Commit groups", "Seal and rollover") ------------------------------------- */

/* A group that reaches never-written space is written with this many zero bytes after it (in the
 * same write): fallocate leaves "unwritten" extents, and an fdatasync after writing into one must
 * also commit the extent's conversion to the journal. Writing into blocks that already hold
 * zeros is a plain overwrite, so most group syncs flush only data. A writer tuning, not part of
 * the format (the zeros are what unused space holds anyway). */
#define SL_ZERO_AHEAD_BYTES (1024u * 1024u)

struct sl_log {
    const struct sl_io *io;
    char directory[SL_PATH_BYTES_MAX];
    int fd;
    int failed;
    int sync;
    int sealed;
    uint64_t log_id;
    uint32_t seed;
    uint64_t first_position; /* of the active segment */
    uint64_t segment_bytes;  /* of the active segment */
    uint64_t next_segment_bytes;
    uint64_t end_position;
    uint64_t zeroed_until; /* file offset: bytes before it were written (with zeros or frames) */
    uint8_t *buffer;
    uint64_t buffer_bytes;
};

int sl_log_open(const struct sl_io *io, const char *directory, const struct sl_header *active,
                uint64_t end_position, uint64_t next_segment_bytes, int sync,
                struct sl_log **out, struct sl_fault *fault) {
    SL_ASSERT(io != NULL && directory != NULL && active != NULL && out != NULL);
    fault_clear(fault);
    *out = NULL;
    if (!segment_bytes_valid(next_segment_bytes)) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_SEGMENT_BYTES, 0, 0);
    }
    /* The header and end come from the caller: checked as a decoded header is, and the end by
     * its distance from the first position (offset_of would wrap for an end near 2**64 and
     * pass a segment's start, where appends would then overwrite the header). */
    if (!segment_bytes_valid(active->segment_bytes) || active->first_position % SL_FRAME_ALIGN_BYTES != 0 ||
        active->first_position > SL_FIRST_POSITION_MAX || end_position < active->first_position ||
        end_position % SL_FRAME_ALIGN_BYTES != 0 ||
        end_position - active->first_position >
            active->segment_bytes - SL_SEGMENT_HEADER_BYTES - SL_SEAL_FRAME_BYTES) {
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_NONE, 0, end_position);
    }
    struct sl_log *log = calloc(1, sizeof(*log));
    if (log == NULL) {
        return SL_E_NO_MEMORY;
    }
    char path[SL_PATH_BYTES_MAX];
    if (strlen(directory) >= sizeof(log->directory) ||
        segment_path(path, sizeof(path), directory, active->first_position, "") != SL_OK) {
        free(log);
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_PATH_TOO_LONG, 0, 0);
    }
    int rc = io->open_file(io->context, path, &log->fd);
    if (rc != 0) {
        free(log);
        return fault_io(fault, rc);
    }
    memcpy(log->directory, directory, strlen(directory) + 1);
    log->io = io;
    log->sync = sync ? 1 : 0;
    log->log_id = active->log_id;
    log->seed = active->seed;
    log->first_position = active->first_position;
    log->segment_bytes = active->segment_bytes;
    log->next_segment_bytes = next_segment_bytes;
    log->end_position = end_position;
    log->zeroed_until = offset_of(active, end_position);
    *out = log;
    return SL_OK;
}

static int log_fail(struct sl_log *log, struct sl_fault *fault, int rc) {
    log->failed = 1;
    return fault_io(fault, rc);
}

/* How many bytes to write for a group of `group_bytes` at `offset`: the group, plus zeros up to
 * SL_ZERO_AHEAD_BYTES past it when the group reaches space that was never written. */
static uint64_t log_write_bytes(const struct sl_log *log, uint64_t offset, uint64_t group_bytes) {
    if (offset + group_bytes <= log->zeroed_until) {
        return group_bytes;
    }
    uint64_t target = offset + group_bytes + SL_ZERO_AHEAD_BYTES;
    if (target > log->segment_bytes) {
        target = log->segment_bytes;
    }
    return target - offset;
}

/* Create an empty segment of next_segment_bytes starting at first_position (durably, renamed over
 * any file of that name) and make it the active one. The active descriptor is closed already. */
static int log_start_segment(struct sl_log *log, uint64_t first_position, struct sl_fault *fault) {
    const struct sl_io *io = log->io;
    int rc = sl_segment_create(io, log->directory, log->log_id, first_position, log->next_segment_bytes,
                               fault);
    if (rc != SL_OK) {
        log->failed = 1;
        return rc;
    }
    char path[SL_PATH_BYTES_MAX];
    SL_ASSERT(segment_path(path, sizeof(path), log->directory, first_position, "") == SL_OK);
    rc = io->open_file(io->context, path, &log->fd);
    if (rc != 0) {
        return log_fail(log, fault, rc);
    }
    log->first_position = first_position;
    log->segment_bytes = log->next_segment_bytes;
    log->zeroed_until = SL_SEGMENT_HEADER_BYTES;
    log->sealed = 0;
    return SL_OK;
}

/* Replace the empty active segment with an empty one of next_segment_bytes. A group that does not
 * fit an empty segment but fits the next size (the log was reopened with a larger segment_bytes)
 * lands here. Sealing instead would be wrong: a seal takes no position, so the next segment would
 * be named like this one and renamed over it, while readers still map the sealed file. The
 * creation renames over the old file, so a crash leaves either segment, each a valid empty one. */
static int log_replace_empty(struct sl_log *log, struct sl_fault *fault) {
    const struct sl_io *io = log->io;
    int rc = io->close_file(io->context, log->fd);
    log->fd = -1;
    if (rc != 0) {
        return log_fail(log, fault, rc);
    }
    return log_start_segment(log, log->first_position, fault);
}

/* Seal the active segment and start the next one. Every step is durable before the next. An
 * empty active segment is replaced instead (log_replace_empty). */
static int log_roll(struct sl_log *log, struct sl_fault *fault) {
    if (log->end_position == log->first_position) {
        return log_replace_empty(log, fault);
    }
    uint8_t seal[SL_SEAL_FRAME_BYTES];
    uint64_t offset = offset_of(&(struct sl_header){.first_position = log->first_position},
                                log->end_position);
    SL_ASSERT(offset + SL_SEAL_FRAME_BYTES <= log->segment_bytes);
    seal_encode(seal, log->end_position, log->first_position, log->seed);
    const struct sl_io *io = log->io;
    /* Groups first, then the seal: an intact seal must prove that everything before it is
     * durable (recovery relies on it), also in bulk mode where groups were never synced. */
    int rc = io->sync_data(io->context, log->fd);
    if (rc == 0) {
        rc = io->write_at(io->context, log->fd, seal, sizeof(seal), offset);
    }
    if (rc == 0) {
        rc = io->sync_data(io->context, log->fd);
    }
    if (rc != 0) {
        return log_fail(log, fault, rc);
    }
    /* The seal is durable: the next segment starts at end_position, whatever happens next. */
    log->sealed = 1;
    rc = io->truncate_file(io->context, log->fd, offset + SL_SEAL_FRAME_BYTES);
    if (rc == 0) {
        rc = io->sync_file(io->context, log->fd);
    }
    int close_rc = io->close_file(io->context, log->fd);
    log->fd = -1;
    if (rc == 0) {
        rc = close_rc;
    }
    if (rc != 0) {
        return log_fail(log, fault, rc);
    }
    return log_start_segment(log, log->end_position, fault);
}

int sl_log_append(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                  const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                  struct sl_fault *fault) {
    SL_ASSERT(log != NULL && lengths != NULL && positions_out != NULL);
    SL_ASSERT(data != NULL || data_bytes == 0);
    fault_clear(fault);
    if (log->failed) {
        return SL_E_FAILED;
    }
    if (count == 0) {
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_NONE, 0, 0);
    }
    if (count > SL_GROUP_RECORDS_MAX) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_GROUP_TOO_MANY, 0, 0);
    }
    if (data_bytes > SL_GROUP_BYTES_MAX) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_GROUP_TOO_LARGE, 0, 0);
    }
    uint64_t payload_bytes = 0;
    uint64_t group_bytes = SL_COMMIT_FRAME_BYTES;
    for (uint32_t i = 0; i < count; i++) {
        if (lengths[i] > SL_RECORD_BYTES_MAX) {
            return fault_set(fault, SL_E_LIMIT, SL_REASON_RECORD_TOO_LARGE, 0, i);
        }
        payload_bytes += lengths[i];
        group_bytes += sl_frame_bytes(lengths[i]);
    }
    if (payload_bytes != data_bytes) {
        return fault_set(fault, SL_E_ARGUMENT, SL_REASON_NONE, 0, 0);
    }
    /* A group never spans segments; it must fit an empty segment with room left for the seal. */
    if (SL_SEGMENT_HEADER_BYTES + group_bytes + SL_SEAL_FRAME_BYTES > log->next_segment_bytes) {
        return fault_set(fault, SL_E_LIMIT, SL_REASON_GROUP_TOO_LARGE, 0, 0);
    }
    struct sl_header active = {.first_position = log->first_position};
    if (offset_of(&active, log->end_position) + group_bytes + SL_SEAL_FRAME_BYTES > log->segment_bytes) {
        int rc = log_roll(log, fault);
        if (rc != SL_OK) {
            return rc;
        }
        active.first_position = log->first_position;
    }
    const uint64_t offset = offset_of(&active, log->end_position);
    const uint64_t write_bytes = log_write_bytes(log, offset, group_bytes);
    if (log->buffer_bytes < write_bytes) {
        uint8_t *grown = realloc(log->buffer, (size_t)write_bytes);
        if (grown == NULL) {
            return SL_E_NO_MEMORY;
        }
        log->buffer = grown;
        log->buffer_bytes = write_bytes;
    }
    /* Build the record frames and the commit frame; they must add up to group_bytes exactly. */
    uint8_t *frame = log->buffer;
    uint64_t position = log->end_position;
    uint32_t group_checksum = log->seed;
    const uint8_t *source = data;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t frame_bytes = sl_frame_bytes(lengths[i]);
        frame_write_header(frame, SL_KIND_RECORD, lengths[i], position);
        if (lengths[i] > 0) {
            memcpy(frame + SL_FRAME_HEADER_BYTES, source, lengths[i]);
        }
        memset(frame + SL_FRAME_HEADER_BYTES + lengths[i], 0,
               (size_t)(frame_bytes - SL_FRAME_HEADER_BYTES - lengths[i]));
        uint32_t checksum = frame_seal_checksum(frame, frame_bytes, log->seed);
        group_checksum = checksum_u32(group_checksum, checksum);
        positions_out[i] = position;
        source += lengths[i];
        frame += frame_bytes;
        position += frame_bytes;
    }
    commit_encode(frame, position, log->end_position, count, group_checksum, log->seed);
    frame += SL_COMMIT_FRAME_BYTES;
    SL_ASSERT((uint64_t)(frame - log->buffer) == group_bytes);
    SL_ASSERT(source == data + data_bytes);
    memset(frame, 0, (size_t)(write_bytes - group_bytes));
    const struct sl_io *io = log->io;
    int rc = io->write_at(io->context, log->fd, log->buffer, (size_t)write_bytes, offset);
    if (rc != 0) {
        return log_fail(log, fault, rc);
    }
    if (offset + write_bytes > log->zeroed_until) {
        log->zeroed_until = offset + write_bytes;
    }
    if (log->sync) {
        rc = io->sync_data(io->context, log->fd);
        if (rc != 0) { /* never retried: the kernel may already have dropped the dirty pages */
            return log_fail(log, fault, rc);
        }
    }
    log->end_position += group_bytes;
    return SL_OK;
}

int sl_log_append_state(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                        const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                        struct sl_fault *fault, struct sl_log_state *state_out) {
    int rc = sl_log_append(log, data, data_bytes, lengths, count, positions_out, fault);
    sl_log_state(log, state_out);
    return rc;
}

int sl_log_sync(struct sl_log *log, struct sl_fault *fault) {
    SL_ASSERT(log != NULL);
    fault_clear(fault);
    if (log->failed) {
        return SL_E_FAILED;
    }
    int rc = log->io->sync_data(log->io->context, log->fd);
    return rc == 0 ? SL_OK : log_fail(log, fault, rc);
}

void sl_log_state(const struct sl_log *log, struct sl_log_state *out) {
    SL_ASSERT(log != NULL && out != NULL);
    out->first_position = log->first_position;
    out->segment_bytes = log->segment_bytes;
    out->end_position = log->end_position;
    out->used_bytes = SL_SEGMENT_HEADER_BYTES + (log->end_position - log->first_position);
    out->failed = log->failed;
    out->sync = log->sync;
    out->sealed = log->sealed;
}

void sl_log_close(struct sl_log *log) {
    if (log == NULL) {
        return;
    }
    if (log->fd >= 0) {
        log->io->close_file(log->io->context, log->fd);
    }
    free(log->buffer);
    free(log);
}
