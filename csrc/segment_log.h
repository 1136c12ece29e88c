/*
 * segment_log.h -- the C core of the mwpstore segment log.
 *
 * Format: docs/format/segment.md (constants in segment_format.h). Conventions: flat
 * signatures, inputs first and outputs last, an int result that is SL_OK or a negative
 * SL_E_* code; when it is an error, the struct sl_fault passed last says why (reason,
 * errno, file offset, logical position). Programmer errors (NULL handles, impossible
 * states) abort through SL_ASSERT, which NDEBUG does not remove.
 *
 * Reading functions work on a caller-supplied buffer (the Python wrapper's read-only memory
 * map of a segment file) and never write. Every mutating file operation goes through a
 * struct sl_io, so tests can substitute a recorder that simulates power loss.
 */
#ifndef MWPSTORE_SEGMENT_LOG_H
#define MWPSTORE_SEGMENT_LOG_H

#include <stddef.h>
#include <stdint.h>

#include "segment_format.h"

#define SL_OK 0
#define SL_E_IO (-1)         /* an I/O call failed; fault.sys_errno says which errno */
#define SL_E_CORRUPT (-2)    /* damaged bytes on disk; fault.reason/offset/position say where */
#define SL_E_LIMIT (-3)      /* a bound in segment_format.h was exceeded; fault.reason says which */
#define SL_E_ARGUMENT (-4)   /* an argument is malformed (e.g. lengths do not add up) */
#define SL_E_FAILED (-5)     /* the handle saw an I/O failure earlier and refuses writes */
#define SL_E_NOT_RECORD (-6) /* the position asked for is not the start of a record frame */
#define SL_E_NO_MEMORY (-7)

#define SL_REASON_NONE 0
#define SL_REASON_HEADER_SHORT 1
#define SL_REASON_HEADER_MAGIC 2
#define SL_REASON_HEADER_VERSION 3
#define SL_REASON_HEADER_CHECKSUM 4
#define SL_REASON_HEADER_FIELD 5
#define SL_REASON_FRAME_TRUNCATED 6
#define SL_REASON_FRAME_KIND 7
#define SL_REASON_FRAME_LENGTH 8
#define SL_REASON_FRAME_POSITION 9
#define SL_REASON_FRAME_CHECKSUM 10
#define SL_REASON_COMMIT_MISMATCH 11
#define SL_REASON_COMMIT_DAMAGED 12
#define SL_REASON_GROUP_DAMAGED 13
#define SL_REASON_SEAL_MISMATCH 14
#define SL_REASON_SEAL_MISSING 15
#define SL_REASON_DATA_AFTER_SEAL 16
#define SL_REASON_UNEXPECTED_END 17
#define SL_REASON_RECORD_TOO_LARGE 18
#define SL_REASON_GROUP_TOO_LARGE 19
#define SL_REASON_GROUP_TOO_MANY 20
#define SL_REASON_SEGMENT_BYTES 21
#define SL_REASON_NOT_A_RECORD 22
#define SL_REASON_PATH_TOO_LONG 23

struct sl_fault {
    int32_t reason;
    int32_t sys_errno;
    uint64_t offset;   /* file offset of the damage, when there is one */
    uint64_t position; /* logical position of the damage, when there is one */
};

/* The I/O seam. Every function returns 0 or a negative errno. */
struct sl_io {
    void *context;
    int (*create_file)(void *context, const char *path, int *fd_out); /* O_CREAT|O_EXCL|O_RDWR */
    int (*open_file)(void *context, const char *path, int *fd_out);   /* O_RDWR */
    int (*close_file)(void *context, int fd);
    int (*write_at)(void *context, int fd, const uint8_t *data, size_t length, uint64_t offset);
    int (*sync_data)(void *context, int fd); /* fdatasync */
    int (*sync_file)(void *context, int fd); /* fsync: also size changes */
    int (*truncate_file)(void *context, int fd, uint64_t length);
    int (*allocate_file)(void *context, int fd, uint64_t length);
    int (*rename_file)(void *context, const char *from_path, const char *to_path);
    int (*remove_file)(void *context, const char *path);
    int (*sync_directory)(void *context, const char *path);
};

const struct sl_io *sl_io_default(void);

struct sl_header {
    uint32_t version;
    uint32_t seed; /* crc32c of log_id: where every frame checksum starts (not on disk) */
    uint64_t log_id;
    uint64_t first_position;
    uint64_t segment_bytes;
};

struct sl_recovery {
    uint64_t end_position; /* just after the last whole group, or after the seal */
    uint64_t used_bytes;   /* file bytes up to end_position, header included */
    uint64_t group_count;
    uint64_t record_count;
    int32_t sealed; /* the segment ends with a valid seal frame */
    int32_t torn;   /* bytes after end_position belong to a write that never completed */
};

struct sl_scan_state {
    uint64_t position;      /* where the next frame is expected; advanced by sl_scan */
    uint64_t group_start;   /* first position of the group being read */
    uint32_t group_records; /* records of that group seen so far */
    uint32_t group_checksum;
    int32_t group_known; /* 1 once the scan has seen the group from its start */
    int32_t sealed;      /* 1 when the scan reached this segment's seal */
};

struct sl_log_state {
    uint64_t first_position; /* of the active segment */
    uint64_t segment_bytes;  /* of the active segment */
    uint64_t end_position;
    uint64_t used_bytes;
    int32_t failed;
    int32_t sync;
    int32_t sealed; /* the active segment is sealed and no next segment is open (after a failure) */
};

struct sl_log;

/* -- format -- */
int sl_header_encode(uint64_t log_id, uint64_t first_position, uint64_t segment_bytes,
                     uint8_t *out, size_t out_bytes);
int sl_header_decode(const uint8_t *data, size_t length, struct sl_header *out,
                     struct sl_fault *fault);
uint64_t sl_frame_bytes(uint64_t payload_bytes);

/* -- reading a mapped segment (data = file bytes from offset 0, data_bytes readable) -- */
/* The walk over the last segment's groups (docs/format/segment.md, "Opening and the torn tail").
 * Damage followed by an intact commit frame at its own position or an intact seal is corruption
 * (group_damaged); with `bulk` (a log a bulk-mode writer had open) only the damaged group's own
 * commit frame or a seal counts. Zeros where a group would start end the walk (the clean end);
 * what follows them is sl_check_after_end's to judge. */
int sl_recover(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header, int bulk,
               struct sl_recovery *out, struct sl_fault *fault);
/* sl_recover for a read-only open beside a live writer, over bytes read from the file while the
 * writer may be appending: the first incomplete group is damage (commit_damaged, group_damaged)
 * only if an intact commit frame at its own position (of any group) or an intact seal follows
 * it; otherwise it is taken as a group in flight (torn = 1, the end before it). Bytes after a
 * seal are not looked at (torn = 0). The other checks are sl_recover's. */
int sl_recover_readonly(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                        struct sl_recovery *out, struct sl_fault *fault);
/* After a clean end at `end_offset` (zeros where a group would start) in a log not written in bulk
 * mode: an intact commit frame at its own position of a later group (one not starting at the end)
 * or an intact seal at or after
 * `from_offset` (aligned up; a caller passes where it found bytes that are not zero) means the zeros
 * lie over written groups: SL_E_CORRUPT, group_damaged, at end_offset. SL_OK when the 16 bytes at
 * end_offset are not zero (no clean end there any more) or nothing completed follows. */
int sl_check_after_end(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                       uint64_t end_offset, uint64_t from_offset, struct sl_fault *fault);
int sl_verify_sealed(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                     uint64_t *end_position_out, struct sl_fault *fault);

/* -- inspecting a segment file at open, without mapping it -- */
#define SL_NO_SEAL_CHECK UINT64_MAX
/* For the segments named numbers[0..count) in `directory` (ascending), without mapping them: read
 * and decode each header into headers_out[i] and its file size into file_bytes_out[i]; for each
 * but the last, read the frame where its seal must be (where the next segment begins) and check
 * it, into seal_status_out[i] / seal_faults_out[i]. Per segment: open, fstat, two preads, close.
 * Stops at the first segment whose file cannot be read or whose header is damaged (its error in
 * `fault`, its index in stopped_at_out); stopped_at_out = count when all were read. */
int sl_segments_inspect(const char *directory, const uint64_t *numbers, uint32_t count,
                        struct sl_header *headers_out, uint64_t *file_bytes_out,
                        int *seal_status_out, struct sl_fault *seal_faults_out,
                        uint32_t *stopped_at_out, struct sl_fault *fault);
/* The checks sl_segments_inspect makes of one sealed segment, made on its mapped bytes instead:
 * the header decoded into header_out (a damaged header is the error returned, in `fault`), and
 * the status of the seal frame expected at seal_position in seal_status_out / seal_fault. Used
 * for a segment that open() took on the word of a clean close, at its first mapping. */
int sl_segment_check_mapped(const uint8_t *data, uint64_t data_bytes, uint64_t seal_position,
                            struct sl_header *header_out, int *seal_status_out,
                            struct sl_fault *seal_fault, struct sl_fault *fault);
int sl_read_record(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                   uint64_t position, uint64_t *offset_out, uint32_t *length_out,
                   struct sl_fault *fault);
int sl_scan(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
            uint64_t stop_position, uint32_t records_max, struct sl_scan_state *state,
            uint64_t *positions_out, uint64_t *starts_out, uint64_t *stops_out,
            uint32_t *count_out, struct sl_fault *fault);
int sl_find_nonzero(int fd, uint64_t from_offset, uint64_t to_offset, uint64_t *found_out,
                    struct sl_fault *fault);

/* -- files, through the seam -- */
int sl_segment_create(const struct sl_io *io, const char *directory, uint64_t log_id,
                      uint64_t first_position, uint64_t segment_bytes, struct sl_fault *fault);
int sl_segment_truncate(const struct sl_io *io, const char *path, uint64_t keep_bytes,
                        uint64_t allocate_bytes, struct sl_fault *fault);
int sl_remove_file(const struct sl_io *io, const char *directory, const char *path,
                   struct sl_fault *fault);
/* Create an empty file (nothing if the name exists: only the name counts), then sync the directory. */
int sl_create_empty_file(const struct sl_io *io, const char *directory, const char *path,
                         struct sl_fault *fault);
int sl_sync_directory(const struct sl_io *io, const char *path, struct sl_fault *fault);

/* -- the writer -- */
int sl_log_open(const struct sl_io *io, const char *directory, const struct sl_header *active,
                uint64_t end_position, uint64_t next_segment_bytes, int sync,
                struct sl_log **out, struct sl_fault *fault);
int sl_log_append(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                  const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                  struct sl_fault *fault);
/* sl_log_append, then sl_log_state into state_out whatever it returned: one call for what the
 * Python writer reads after every append. */
int sl_log_append_state(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                        const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                        struct sl_fault *fault, struct sl_log_state *state_out);
int sl_log_sync(struct sl_log *log, struct sl_fault *fault);
void sl_log_state(const struct sl_log *log, struct sl_log_state *out);
void sl_log_close(struct sl_log *log);

#endif
