/*
 * lmdb_check.h -- a structural check of an LMDB data file, made before LMDB maps it.
 *
 * LMDB trusts its file: a damaged page offset, node size or page number makes it (and its
 * Python binding, which touches every page of a value it returns) read past the page, past the
 * file's end, or write into a page it believes is dirty. That kills the process (SIGBUS or
 * SIGSEGV) instead of giving an error. lc_check_file walks every page reachable from the meta
 * page LMDB would pick and checks what LMDB relies on when it reads, so a file that passes can be
 * handed to LMDB without that risk. It also checks what a range read cannot notice on its own:
 * nodes that fill their page (none hidden) and key order down the tree (no leaf skipped). It does
 * not check what the stores' own seals already check (values, presence): see
 * docs/format/index.md, "Structural check".
 *
 * Covers the 64-bit LMDB 0.9 layout (the one the lmdb binding bundles). Databases with flags
 * (duplicate keys, integer or reversed keys) are refused: mwpstore creates none.
 * Conventions as in segment_log.h: an int result, LC_OK or a negative LC_E_* code, and the
 * struct lc_result says why and where.
 */
#ifndef MWPSTORE_LMDB_CHECK_H
#define MWPSTORE_LMDB_CHECK_H

#include <stdint.h>

#define LC_OK 0
#define LC_E_DAMAGED (-1)   /* the file fails a check: result.reason, .page and .value say which */
#define LC_E_IO (-2)        /* open, stat or map failed: result.sys_errno */
#define LC_E_NO_MEMORY (-3)

#define LC_REASON_NONE 0
#define LC_REASON_FILE_SHORT 1     /* shorter than two meta pages, or than the pages the meta names */
#define LC_REASON_META 2           /* a meta page: magic, version, flags, page number, or the two
                                    * transaction ids not consecutive (LMDB would pick the wrong one) */
#define LC_REASON_PAGE_SIZE 3      /* the page size in the meta is not one LMDB can write */
#define LC_REASON_PAGE_RANGE 4     /* a page number outside [2, next page) */
#define LC_REASON_PAGE_NUMBER 5    /* a page does not carry its own number */
#define LC_REASON_PAGE_FLAGS 6     /* unknown, dirty, or the wrong kind for its place */
#define LC_REASON_PAGE_BOUNDS 7    /* lower/upper bounds of a page */
#define LC_REASON_NODE_BOUNDS 8    /* a node, its key or its inline data outside its page */
#define LC_REASON_NODE_FLAGS 9     /* unknown node flags, or flags not allowed at that place */
#define LC_REASON_OVERFLOW 10      /* an overflow extent: range, header, or data longer than it */
#define LC_REASON_DATABASE 11      /* a database record: size, flags, or a root page */
#define LC_REASON_DEPTH 12         /* a tree deeper than LMDB's cursor stack */
#define LC_REASON_PAGE_TWICE 13    /* a page reachable twice (a cycle or a shared page) */
#define LC_REASON_FREE_LIST 14     /* a free-list record, or a free page that is also in use */
#define LC_REASON_BRANCH_EMPTY 15  /* a branch page without entries */
#define LC_REASON_PAGE_LOST 16     /* a page neither in use nor free: a tree cut short */
#define LC_REASON_NODE_LAYOUT 17   /* a page's nodes do not fill its node area exactly: entries lost */
#define LC_REASON_KEY_ORDER 18     /* keys out of order in a page, or outside their parent's bounds */

struct lc_result {
    int32_t reason;
    int32_t sys_errno;
    uint64_t page;        /* the page the problem was found on (the meta page for meta problems) */
    uint64_t value;       /* the offending value (a page number, an offset, a size), or 0 */
    uint64_t file_bytes;
    uint64_t page_bytes;
    uint64_t next_page;   /* one past the last page the picked meta names */
    uint64_t pages_in_use; /* reachable from the picked meta (metas not counted) */
    uint64_t pages_free;   /* listed in the free list */
};

/* Check the LMDB data file at `path` (read-only; the file is mapped, never handed to LMDB). */
int lc_check_file(const char *path, struct lc_result *out);

/* Check only the two meta pages of the file at `path`, with the walk's own meta rules and results
 * (reasons META, PAGE_SIZE, DATABASE and FILE_SHORT; page_bytes and next_page set when they pass):
 * reads the file's first 2 * 32 KiB and the few pages down the older meta's free database,
 * whatever the file's size. For opens that do not walk. */
int lc_check_meta_pages(const char *path, struct lc_result *out);

#endif
