"""cffi build script for the C segment log (out-of-line API mode).

``setup.py`` names ``csrc/build_segment_log.py:ffibuilder`` in ``cffi_modules``; setuptools
then compiles ``csrc/*.c`` into the extension ``mwpstore._segment_log_c``. This file imports
nothing from the package, so it runs before the package exists.
"""

from __future__ import annotations

import os
import platform

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

# Declarations visible from Python. `...` values are taken from the C headers at build time,
# so the numbers live only in csrc/segment_format.h and csrc/segment_log.h.
CDEF = """
#define SL_SEGMENT_HEADER_BYTES ...
#define SL_FRAME_HEADER_BYTES ...
#define SL_FRAME_ALIGN_BYTES ...
#define SL_FRAME_LENGTH_BITS ...
#define SL_FORMAT_VERSION ...
#define SL_SEGMENT_MAGIC_BYTES ...
#define SL_KIND_RECORD ...
#define SL_KIND_COMMIT ...
#define SL_KIND_SEAL ...
#define SL_COMMIT_PAYLOAD_BYTES ...
#define SL_COMMIT_FRAME_BYTES ...
#define SL_SEAL_PAYLOAD_BYTES ...
#define SL_SEAL_FRAME_BYTES ...
#define SL_SECTOR_BYTES ...
#define SL_COMMIT_DAMAGE_BITS_MAX ...
#define SL_HEADER_OFFSET_VERSION ...
#define SL_HEADER_OFFSET_HEADER_BYTES ...
#define SL_HEADER_OFFSET_LOG_ID ...
#define SL_HEADER_OFFSET_FIRST_POSITION ...
#define SL_HEADER_OFFSET_SEGMENT_BYTES ...
#define SL_HEADER_OFFSET_RESERVED ...
#define SL_HEADER_OFFSET_CHECKSUM ...
#define SL_SEGMENT_BYTES_DEFAULT ...
#define SL_SEGMENT_BYTES_MIN ...
#define SL_SEGMENT_BYTES_MAX ...
#define SL_RECORD_BYTES_MAX ...
#define SL_GROUP_RECORDS_MAX ...
#define SL_GROUP_BYTES_MAX ...
#define SL_SCAN_BATCH_RECORDS_MAX ...
#define SL_PATH_BYTES_MAX ...

#define SL_OK ...
#define SL_E_IO ...
#define SL_E_CORRUPT ...
#define SL_E_LIMIT ...
#define SL_E_ARGUMENT ...
#define SL_E_FAILED ...
#define SL_E_NOT_RECORD ...
#define SL_E_NO_MEMORY ...

#define SL_REASON_NONE ...
#define SL_REASON_HEADER_SHORT ...
#define SL_REASON_HEADER_MAGIC ...
#define SL_REASON_HEADER_VERSION ...
#define SL_REASON_HEADER_CHECKSUM ...
#define SL_REASON_HEADER_FIELD ...
#define SL_REASON_FRAME_TRUNCATED ...
#define SL_REASON_FRAME_KIND ...
#define SL_REASON_FRAME_LENGTH ...
#define SL_REASON_FRAME_POSITION ...
#define SL_REASON_FRAME_CHECKSUM ...
#define SL_REASON_COMMIT_MISMATCH ...
#define SL_REASON_COMMIT_DAMAGED ...
#define SL_REASON_GROUP_DAMAGED ...
#define SL_REASON_SEAL_MISMATCH ...
#define SL_REASON_SEAL_MISSING ...
#define SL_REASON_DATA_AFTER_SEAL ...
#define SL_REASON_UNEXPECTED_END ...
#define SL_REASON_RECORD_TOO_LARGE ...
#define SL_REASON_GROUP_TOO_LARGE ...
#define SL_REASON_GROUP_TOO_MANY ...
#define SL_REASON_SEGMENT_BYTES ...
#define SL_REASON_NOT_A_RECORD ...
#define SL_REASON_PATH_TOO_LONG ...

struct sl_fault { int32_t reason; int32_t sys_errno; uint64_t offset; uint64_t position; };

struct sl_io {
    void *context;
    int (*create_file)(void *context, const char *path, int *fd_out);
    int (*open_file)(void *context, const char *path, int *fd_out);
    int (*close_file)(void *context, int fd);
    int (*write_at)(void *context, int fd, const uint8_t *data, size_t length, uint64_t offset);
    int (*sync_data)(void *context, int fd);
    int (*sync_file)(void *context, int fd);
    int (*truncate_file)(void *context, int fd, uint64_t length);
    int (*allocate_file)(void *context, int fd, uint64_t length);
    int (*rename_file)(void *context, const char *from_path, const char *to_path);
    int (*remove_file)(void *context, const char *path);
    int (*sync_directory)(void *context, const char *path);
};

struct sl_header { uint32_t version; uint32_t seed; uint64_t log_id; uint64_t first_position;
                   uint64_t segment_bytes; };
struct sl_recovery { uint64_t end_position; uint64_t used_bytes; uint64_t group_count;
                     uint64_t record_count; int32_t sealed; int32_t torn; };
struct sl_scan_state { uint64_t position; uint64_t group_start; uint32_t group_records;
                       uint32_t group_checksum; int32_t group_known; int32_t sealed; };
struct sl_log_state { uint64_t first_position; uint64_t segment_bytes; uint64_t end_position;
                      uint64_t used_bytes; int32_t failed; int32_t sync; int32_t sealed; };
struct sl_log;

const struct sl_io *sl_io_default(void);

uint32_t sl_crc32c(uint32_t crc, const uint8_t *data, size_t length);
uint32_t sl_crc32c_portable(uint32_t crc, const uint8_t *data, size_t length);
int sl_crc32c_hardware(void);

int sl_header_encode(uint64_t log_id, uint64_t first_position, uint64_t segment_bytes,
                     uint8_t *out, size_t out_bytes);
int sl_header_decode(const uint8_t *data, size_t length, struct sl_header *out,
                     struct sl_fault *fault);
uint64_t sl_frame_bytes(uint64_t payload_bytes);

int sl_recover(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header, int bulk,
               struct sl_recovery *out, struct sl_fault *fault);
int sl_recover_readonly(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                        struct sl_recovery *out, struct sl_fault *fault);
int sl_check_after_end(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                       uint64_t end_offset, uint64_t from_offset, struct sl_fault *fault);
int sl_verify_sealed(const uint8_t *data, uint64_t data_bytes, const struct sl_header *header,
                     uint64_t *end_position_out, struct sl_fault *fault);
#define SL_NO_SEAL_CHECK ...
#define SL_FIRST_POSITION_MAX ...
int sl_segments_inspect(const char *directory, const uint64_t *numbers, uint32_t count,
                        struct sl_header *headers_out, uint64_t *file_bytes_out,
                        int *seal_status_out, struct sl_fault *seal_faults_out,
                        uint32_t *stopped_at_out, struct sl_fault *fault);
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

int sl_segment_create(const struct sl_io *io, const char *directory, uint64_t log_id,
                      uint64_t first_position, uint64_t segment_bytes, struct sl_fault *fault);
int sl_segment_truncate(const struct sl_io *io, const char *path, uint64_t keep_bytes,
                        uint64_t allocate_bytes, struct sl_fault *fault);
int sl_remove_file(const struct sl_io *io, const char *directory, const char *path,
                   struct sl_fault *fault);
int sl_create_empty_file(const struct sl_io *io, const char *directory, const char *path,
                         struct sl_fault *fault);
int sl_sync_directory(const struct sl_io *io, const char *path, struct sl_fault *fault);

int sl_log_open(const struct sl_io *io, const char *directory, const struct sl_header *active,
                uint64_t end_position, uint64_t next_segment_bytes, int sync,
                struct sl_log **out, struct sl_fault *fault);
int sl_log_append(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                  const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                  struct sl_fault *fault);
int sl_log_append_state(struct sl_log *log, const uint8_t *data, uint64_t data_bytes,
                        const uint32_t *lengths, uint32_t count, uint64_t *positions_out,
                        struct sl_fault *fault, struct sl_log_state *state_out);
int sl_log_sync(struct sl_log *log, struct sl_fault *fault);
void sl_log_state(const struct sl_log *log, struct sl_log_state *out);
void sl_log_close(struct sl_log *log);

/* The I/O seam's Python side (mwpstore/io_seam.py): a recorder for power-loss tests. */
extern "Python" int sl_py_create_file(void *, const char *, int *);
extern "Python" int sl_py_open_file(void *, const char *, int *);
extern "Python" int sl_py_close_file(void *, int);
extern "Python" int sl_py_write_at(void *, int, const uint8_t *, size_t, uint64_t);
extern "Python" int sl_py_sync_data(void *, int);
extern "Python" int sl_py_sync_file(void *, int);
extern "Python" int sl_py_truncate_file(void *, int, uint64_t);
extern "Python" int sl_py_allocate_file(void *, int, uint64_t);
extern "Python" int sl_py_rename_file(void *, const char *, const char *);
extern "Python" int sl_py_remove_file(void *, const char *);
extern "Python" int sl_py_sync_directory(void *, const char *);
"""

# The compiler and linker flags of all five C extensions (build_lmdb_check.py and setup.py take
# them from here). MWPSTORE_SANITIZE=1 in the environment builds them with AddressSanitizer and
# UndefinedBehaviorSanitizer (docs/reliability.md, "Sanitizers"); -fno-wrapv undoes Python's
# -fwrapv, under which signed overflow is defined and so not reported, and MWPSTORE_SANITIZE
# makes lmdb_check.c read its file into the heap, where AddressSanitizer sees its end.
COMPILE_ARGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2"]
LINK_ARGS: list[str] = []
if platform.system() == "Darwin":  # pragma: no cover - the project targets Linux
    COMPILE_ARGS.append("-Wno-unused-command-line-argument")
if os.environ.get("MWPSTORE_SANITIZE") == "1":
    SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    COMPILE_ARGS = [arg for arg in COMPILE_ARGS if arg != "-O2"]
    COMPILE_ARGS += [*SANITIZERS, "-fno-omit-frame-pointer", "-fno-wrapv", "-g", "-O1", "-DMWPSTORE_SANITIZE=1"]
    LINK_ARGS = SANITIZERS

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "mwpstore._segment_log_c",
    '#include "segment_log.h"\n#include "crc32c.h"\n',
    sources=[os.path.join("csrc", "segment_log.c"), os.path.join("csrc", "crc32c.c")],
    depends=[os.path.join("csrc", name) for name in ("segment_log.h", "segment_format.h", "crc32c.h")],  # an edit rebuilds
    include_dirs=[HERE, "csrc"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=LINK_ARGS,
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
