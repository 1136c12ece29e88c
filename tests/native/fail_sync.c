/* fail_sync.c: an LD_PRELOAD library that makes chosen disk calls fail, for the disk suite.
 *
 * Built by mwpstore.torture (cc -shared -fPIC) and loaded into a child process. It interposes
 * fsync, fdatasync, write and pwrite; each call on a file whose path contains
 * MWPSTORE_FAULT_PATH (all files when unset) is counted, 1-based, per kind:
 *
 *   MWPSTORE_FAIL_SYNC_AT=n        the n-th fsync/fdatasync returns -1/EIO (once; nothing synced)
 *   MWPSTORE_FAIL_SYNC_FROM=n      every fsync/fdatasync from the n-th on returns -1/EIO
 *   MWPSTORE_ENOSPC_WRITE_AT=n     the n-th write/pwrite returns -1/ENOSPC (nothing written)
 *   MWPSTORE_SHORT_WRITE_AT=n      the n-th write/pwrite writes only half its bytes (at least 1)
 *   MWPSTORE_FAULT_LOG=path        one line per counted call: "<kind> <n> <result> <path>"
 *
 * mwpstore_faults_injected() (found with dlsym or ctypes) returns how many faults were injected
 * so far, so the workload can tell whether a call it made saw one.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*sync_fn)(int);
typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);

static atomic_long sync_calls;
static atomic_long write_calls;
static atomic_long injected;

long mwpstore_faults_injected(void) { return atomic_load(&injected); }

static long env_number(const char *name) {
    const char *value = getenv(name);
    return value == NULL ? 0 : atol(value);
}

/* The file's path, or "" when unknown. */
static void fd_path(int fd, char *out, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, out, size - 1);
    out[length < 0 ? 0 : (size_t)length] = '\0';
}

static int counted(int fd, char *path, size_t size) {
    fd_path(fd, path, size);
    const char *filter = getenv("MWPSTORE_FAULT_PATH");
    return filter == NULL || filter[0] == '\0' || strstr(path, filter) != NULL;
}

static void note(const char *kind, long number, long result, const char *path) {
    const char *log_path = getenv("MWPSTORE_FAULT_LOG");
    if (log_path == NULL || log_path[0] == '\0') return;
    int saved = errno;
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        char line[4352];
        int length = snprintf(line, sizeof line, "%s %ld %ld %s\n", kind, number, result, path);
        write_fn real_write = (write_fn)dlsym(RTLD_NEXT, "write");
        if (length > 0 && real_write != NULL) real_write(fd, line, (size_t)length);
        close(fd);
    }
    errno = saved;
}

static int sync_common(const char *kind, int fd) {
    sync_fn real = (sync_fn)dlsym(RTLD_NEXT, kind);
    char path[4096];
    if (!counted(fd, path, sizeof path)) return real(fd);
    long number = atomic_fetch_add(&sync_calls, 1) + 1;
    long at = env_number("MWPSTORE_FAIL_SYNC_AT");
    long from = env_number("MWPSTORE_FAIL_SYNC_FROM");
    if ((at > 0 && number == at) || (from > 0 && number >= from)) {
        atomic_fetch_add(&injected, 1);
        note(kind, number, -EIO, path);
        errno = EIO;
        return -1;
    }
    int rc = real(fd);
    note(kind, number, rc == 0 ? 0 : -errno, path);
    return rc;
}

int fsync(int fd) { return sync_common("fsync", fd); }
int fdatasync(int fd) { return sync_common("fdatasync", fd); }

/* Decide a write's fate: 0 = do it, -1 = ENOSPC, 1 = short. */
static int write_fate(int fd, size_t count, char *path, size_t size, long *number) {
    if (count == 0 || !counted(fd, path, size)) return 0;
    *number = atomic_fetch_add(&write_calls, 1) + 1;
    if (env_number("MWPSTORE_ENOSPC_WRITE_AT") == *number) return -1;
    if (env_number("MWPSTORE_SHORT_WRITE_AT") == *number) return 1;
    return 0;
}

ssize_t write(int fd, const void *buffer, size_t count) {
    write_fn real = (write_fn)dlsym(RTLD_NEXT, "write");
    char path[4096];
    long number = 0;
    int fate = write_fate(fd, count, path, sizeof path, &number);
    if (fate < 0) {
        atomic_fetch_add(&injected, 1);
        note("write", number, -ENOSPC, path);
        errno = ENOSPC;
        return -1;
    }
    if (fate > 0) {
        atomic_fetch_add(&injected, 1);
        ssize_t done = real(fd, buffer, count / 2 > 0 ? count / 2 : 1);
        note("write-short", number, (long)done, path);
        return done;
    }
    ssize_t done = real(fd, buffer, count);
    if (number > 0) note("write", number, done < 0 ? -errno : (long)done, path);
    return done;
}

ssize_t pwrite(int fd, const void *buffer, size_t count, off_t offset) {
    pwrite_fn real = (pwrite_fn)dlsym(RTLD_NEXT, "pwrite");
    char path[4096];
    long number = 0;
    int fate = write_fate(fd, count, path, sizeof path, &number);
    if (fate < 0) {
        atomic_fetch_add(&injected, 1);
        note("pwrite", number, -ENOSPC, path);
        errno = ENOSPC;
        return -1;
    }
    if (fate > 0) {
        atomic_fetch_add(&injected, 1);
        ssize_t done = real(fd, buffer, count / 2 > 0 ? count / 2 : 1, offset);
        note("pwrite-short", number, (long)done, path);
        return done;
    }
    ssize_t done = real(fd, buffer, count, offset);
    if (number > 0) note("pwrite", number, done < 0 ? -errno : (long)done, path);
    return done;
}

ssize_t pwrite64(int fd, const void *buffer, size_t count, off_t offset) { return pwrite(fd, buffer, count, offset); }
