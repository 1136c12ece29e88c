/*
 * lmdb_check.c -- the structural check of an LMDB data file (see lmdb_check.h).
 *
 * Layout facts (64-bit LMDB 0.9, host byte order), in bytes:
 *   page header (16): page number u64 @0, flags u16 @10, lower u16 @12, upper u16 @14; an
 *     overflow page keeps its page count as u32 @12 instead. Node offsets, u16 each, follow
 *     the header up to `lower`; nodes live between `upper` and the page's end.
 *   node header (8): lo u16 @0, hi u16 @2, flags u16 @4, key size u16 @6, then the key, then
 *     the data. A branch node's child page is lo | hi << 16 | flags << 32; a leaf node's data
 *     size is lo | hi << 16, and with F_BIGDATA its data is the u64 number of an overflow page.
 *     A node takes header + key (+ data, or 8 bytes with F_BIGDATA) bytes, rounded up to even;
 *     a page's nodes fill [upper, page end) without a gap.
 *   meta page: the page header, then magic u32 @16, version u32 @20, the free database's
 *     record @40 (its first u32 is the page size), the main database's record @88, the last
 *     page number u64 @136, the transaction id u64 @144. LMDB uses the meta with the higher
 *     transaction id (meta 0 on a tie).
 *   database record (48): flags u16 @4, root page u64 @40 (all ones when empty).
 *   free-list record: key = transaction id (u64), data = count u64, then count page numbers.
 */
#define _GNU_SOURCE
#include "lmdb_check.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PAGE_HEADER_BYTES 16u
#define NODE_HEADER_BYTES 8u
#define DATABASE_RECORD_BYTES 48u
#define META_COUNT 2u
#define META_MAGIC 0xBEEFC0DEu
#define META_VERSION 1u
#define PAGE_BYTES_MIN 512u
#define PAGE_BYTES_MAX 0x8000u
#define CURSOR_STACK_DEPTH 32
#define NO_PAGE UINT64_MAX
/* How far the meta's page count may run past the file's end (pages LMDB allocated and freed
 * in one transaction are never written); beyond it the number is damage, and it bounds the
 * bitmaps this check allocates. */
#define SHORT_TAIL_PAGES_MAX (1u << 20)

#define P_BRANCH 0x01u
#define P_LEAF 0x02u
#define P_OVERFLOW 0x04u
#define P_META 0x08u

#define F_BIGDATA 0x01u
#define F_SUBDATA 0x02u
#define F_DUPDATA 0x04u

/* The free database's keys are 8-byte transaction ids compared as integers (MDB_INTEGERKEY,
 * LMDB reads 8 bytes of each). mwpstore's own databases are created without flags: a flag that
 * appears on one (integer keys, reversed keys, duplicates) changes how LMDB reads its keys and
 * values, so it is damage. */
#define DB_FLAG_INTEGER_KEYS 0x08u
#define FREE_KEY_BYTES 8u

enum tree_role { ROLE_FREE, ROLE_MAIN, ROLE_NAMED };

struct walk {
    const uint8_t *map;
    uint64_t map_bytes; /* the file's first bytes that map holds: all of it for the walk */
    int fd;             /* where the pages past map_bytes are read from (-1: none) */
    uint8_t *page_copy; /* one page read from fd */
    uint64_t file_bytes;
    uint64_t page_bytes;
    uint64_t next_page;
    uint8_t *in_use;  /* bitmap over [0, next_page) */
    uint8_t *is_free; /* bitmap over [0, next_page) */
    uint16_t *node_bytes_at; /* scratch, all zero between pages: [offset / 2] = that node's bytes */
    struct lc_result *out;
};

static uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static int bit_get(const uint8_t *bits, uint64_t n) {
    return (bits[n >> 3] >> (n & 7)) & 1;
}

static void bit_set(uint8_t *bits, uint64_t n) {
    bits[n >> 3] |= (uint8_t)(1u << (n & 7));
}

static int damaged(struct walk *w, int32_t reason, uint64_t page, uint64_t value) {
    w->out->reason = reason;
    w->out->page = page;
    w->out->value = value;
    return LC_E_DAMAGED;
}

/* Claim `count` pages from `first` as in use: in range, inside the file, seen once. */
static int claim_pages(struct walk *w, uint64_t from_page, uint64_t first, uint64_t count) {
    if (first < META_COUNT || first >= w->next_page || count > w->next_page - first) {
        return damaged(w, LC_REASON_PAGE_RANGE, from_page, first);
    }
    if ((first + count) > w->file_bytes / w->page_bytes) {
        return damaged(w, LC_REASON_FILE_SHORT, from_page, first);
    }
    for (uint64_t n = first; n < first + count; n++) {
        if (bit_get(w->in_use, n)) {
            return damaged(w, LC_REASON_PAGE_TWICE, from_page, n);
        }
        bit_set(w->in_use, n);
    }
    w->out->pages_in_use += count;
    return LC_OK;
}

static const uint8_t *page_at(const struct walk *w, uint64_t page) {
    return w->map + page * w->page_bytes;
}

static int check_free_record(struct walk *w, uint64_t page, const uint8_t *data, uint64_t size) {
    if (size < 8 || size % 8 != 0) {
        return damaged(w, LC_REASON_FREE_LIST, page, size);
    }
    uint64_t count = u64_at(data);
    if (count > size / 8 - 1) {
        return damaged(w, LC_REASON_FREE_LIST, page, count);
    }
    for (uint64_t i = 1; i <= count; i++) {
        uint64_t free_page = u64_at(data + 8 * i);
        if (free_page < META_COUNT || free_page >= w->next_page || bit_get(w->is_free, free_page)) {
            return damaged(w, LC_REASON_FREE_LIST, page, free_page);
        }
        bit_set(w->is_free, free_page);
        w->out->pages_free++;
    }
    return LC_OK;
}

/* A key as LMDB compares it; `bytes` NULL for "no bound". */
struct key {
    const uint8_t *bytes;
    uint32_t size;
};

/* LMDB's order: the free database's keys as native u64 (integer keys, 8 bytes: checked before
 * any comparison), the others byte by byte, a shorter key first when one is the other's prefix. */
static int key_compare(enum tree_role role, struct key a, struct key b) {
    if (role == ROLE_FREE) {
        uint64_t x = u64_at(a.bytes), y = u64_at(b.bytes);
        return (x > y) - (x < y);
    }
    uint32_t shorter = a.size < b.size ? a.size : b.size;
    int diff = shorter == 0 ? 0 : memcmp(a.bytes, b.bytes, shorter);
    if (diff != 0) {
        return diff < 0 ? -1 : 1;
    }
    return (a.size > b.size) - (a.size < b.size);
}

static int walk_tree(struct walk *w, uint64_t from_page, uint64_t root, enum tree_role role);

/*
 * The page's nodes exactly fill [upper, page end), one after the other. LMDB keeps them so: a
 * node is added just below `upper` (its size rounded up to even), and deleting one moves the
 * nodes below it up over the hole. A page whose offsets leave bytes unclaimed has lost entries:
 * a flipped bit in `lower` drops the last offsets, and a range read would skip their nodes
 * without an error. Two offsets naming one node, or nodes overlapping, fail the same way.
 * Called after every offset and key size was found inside the page; each node's size is noted
 * at its offset in the scratch array, which is walked from `upper` node by node, then cleared.
 */
static int check_tiling(struct walk *w, uint64_t page, const uint8_t *p, uint64_t count, uint64_t upper, int branch) {
    uint16_t *at = w->node_bytes_at;
    int rc = LC_OK;
    uint64_t noted = 0;
    for (; noted < count && rc == LC_OK; noted++) {
        uint32_t offset = u16_at(p + PAGE_HEADER_BYTES + 2 * noted);
        const uint8_t *node = p + offset;
        uint64_t bytes = NODE_HEADER_BYTES + (uint64_t)u16_at(node + 6);
        if (!branch) { /* a leaf's data: inline, or the number of its first overflow page */
            uint64_t data = (uint64_t)u16_at(node) | ((uint64_t)u16_at(node + 2) << 16);
            bytes += (u16_at(node + 4) & F_BIGDATA) ? 8u : data;
        }
        bytes += bytes & 1u;
        if (bytes > w->page_bytes - offset) {
            rc = damaged(w, LC_REASON_NODE_BOUNDS, page, offset);
        } else if (offset % 2 != 0 || at[offset / 2] != 0) {
            rc = damaged(w, LC_REASON_NODE_LAYOUT, page, offset);
        } else {
            at[offset / 2] = (uint16_t)bytes;
        }
    }
    if (rc == LC_OK) {
        uint64_t position = upper, seen = 0;
        while (position < w->page_bytes && at[position / 2] != 0) {
            position += at[position / 2];
            seen++;
        }
        if (position != w->page_bytes || seen != count) {
            rc = damaged(w, LC_REASON_NODE_LAYOUT, page, position);
        }
    }
    for (uint64_t i = 0; i < noted; i++) { /* leave the scratch all zero for the next page */
        at[u16_at(p + PAGE_HEADER_BYTES + 2 * i) / 2] = 0;
    }
    return rc;
}

/* A leaf node's data: inline, or on an overflow extent; a named database's record in the main
 * database; a free-list record in the free database. */
static int check_leaf_data(struct walk *w, uint64_t page, const uint8_t *node, uint64_t room,
                           uint32_t key_bytes, enum tree_role role) {
    uint16_t flags = u16_at(node + 4);
    uint64_t size = (uint64_t)u16_at(node) | ((uint64_t)u16_at(node + 2) << 16);
    const uint8_t *data = node + NODE_HEADER_BYTES + key_bytes;
    uint64_t data_room = room - NODE_HEADER_BYTES - key_bytes;
    if ((flags & ~(uint16_t)(F_BIGDATA | F_SUBDATA | F_DUPDATA)) != 0 || (flags & F_DUPDATA) != 0 ||
        ((flags & F_SUBDATA) != 0 && ((flags & F_BIGDATA) != 0 || role != ROLE_MAIN))) {
        return damaged(w, LC_REASON_NODE_FLAGS, page, flags);
    }
    if (flags & F_BIGDATA) {
        if (data_room < 8) {
            return damaged(w, LC_REASON_NODE_BOUNDS, page, (uint64_t)(node - page_at(w, page)));
        }
        uint64_t first = u64_at(data);
        if (first < META_COUNT || first >= w->next_page ||
            (first + 1) > w->file_bytes / w->page_bytes) {
            return damaged(w, LC_REASON_OVERFLOW, page, first);
        }
        const uint8_t *head = page_at(w, first);
        uint64_t pages = u32_at(head + 12);
        if (u64_at(head) != first || u16_at(head + 10) != P_OVERFLOW || pages == 0 ||
            size > pages * w->page_bytes - PAGE_HEADER_BYTES) {
            return damaged(w, LC_REASON_OVERFLOW, first, size);
        }
        int rc = claim_pages(w, page, first, pages);
        if (rc != LC_OK) {
            return rc;
        }
        return role == ROLE_FREE ? check_free_record(w, first, head + PAGE_HEADER_BYTES, size) : LC_OK;
    }
    if (size > data_room) {
        return damaged(w, LC_REASON_NODE_BOUNDS, page, size);
    }
    if (role == ROLE_FREE) {
        return check_free_record(w, page, data, size);
    }
    if (flags & F_SUBDATA) {
        if (size != DATABASE_RECORD_BYTES) {
            return damaged(w, LC_REASON_DATABASE, page, size);
        }
        uint16_t db_flags = u16_at(data + 4);
        if (db_flags != 0) {
            return damaged(w, LC_REASON_DATABASE, page, db_flags);
        }
        uint64_t root = u64_at(data + 40);
        return root == NO_PAGE ? LC_OK : walk_tree(w, page, root, ROLE_NAMED);
    }
    return LC_OK;
}

/*
 * Key order, which LMDB's searches rely on: a page's keys strictly ascending (a branch's first key
 * is never compared), and every key of a subtree at or above the parent's key for it and below
 * the parent's next key (`low` and `high`, inherited down the tree). A damaged key in a branch
 * sends searches, and so range reads, to the wrong leaf: entries are skipped without an error.
 */
static int walk_page(struct walk *w, uint64_t from_page, uint64_t page, enum tree_role role, int depth,
                     struct key low, struct key high) {
    if (depth > CURSOR_STACK_DEPTH) {
        return damaged(w, LC_REASON_DEPTH, from_page, page);
    }
    int rc = claim_pages(w, from_page, page, 1);
    if (rc != LC_OK) {
        return rc;
    }
    const uint8_t *p = page_at(w, page);
    if (u64_at(p) != page) {
        return damaged(w, LC_REASON_PAGE_NUMBER, page, u64_at(p));
    }
    uint16_t flags = u16_at(p + 10);
    if (flags != P_BRANCH && flags != P_LEAF) {
        return damaged(w, LC_REASON_PAGE_FLAGS, page, flags);
    }
    uint64_t lower = u16_at(p + 12);
    uint64_t upper = u16_at(p + 14);
    if (lower < PAGE_HEADER_BYTES || lower > upper || upper > w->page_bytes ||
        (lower - PAGE_HEADER_BYTES) % 2 != 0) {
        return damaged(w, LC_REASON_PAGE_BOUNDS, page, lower << 16 | upper);
    }
    uint64_t count = (lower - PAGE_HEADER_BYTES) / 2;
    if (flags == P_BRANCH && count == 0) {
        return damaged(w, LC_REASON_BRANCH_EMPTY, page, 0);
    }
    for (uint64_t i = 0; i < count; i++) {
        uint64_t offset = u16_at(p + PAGE_HEADER_BYTES + 2 * i);
        if (offset < upper || offset + NODE_HEADER_BYTES > w->page_bytes) {
            return damaged(w, LC_REASON_NODE_BOUNDS, page, offset);
        }
        uint32_t key_bytes = u16_at(p + offset + 6);
        if (NODE_HEADER_BYTES + (uint64_t)key_bytes > w->page_bytes - offset) {
            return damaged(w, LC_REASON_NODE_BOUNDS, page, offset);
        }
        /* Integer keys are read as 8 bytes; a branch's first key is never compared. */
        if (role == ROLE_FREE && key_bytes != FREE_KEY_BYTES && !(flags == P_BRANCH && i == 0)) {
            return damaged(w, LC_REASON_NODE_BOUNDS, page, key_bytes);
        }
    }
    rc = check_tiling(w, page, p, count, upper, flags == P_BRANCH);
    if (rc != LC_OK) {
        return rc;
    }
    struct key previous = {NULL, 0}, first = {NULL, 0};
    for (uint64_t i = flags == P_BRANCH ? 1 : 0; i < count; i++) {
        const uint8_t *node = p + u16_at(p + PAGE_HEADER_BYTES + 2 * i);
        struct key key = {node + NODE_HEADER_BYTES, u16_at(node + 6)};
        if (previous.bytes != NULL && key_compare(role, previous, key) >= 0) {
            return damaged(w, LC_REASON_KEY_ORDER, page, i);
        }
        if (first.bytes == NULL) {
            first = key;
        }
        previous = key;
    }
    /* Ascending: the first and the last key bound the rest. */
    if (first.bytes != NULL && ((low.bytes != NULL && key_compare(role, first, low) < 0) ||
                                (high.bytes != NULL && key_compare(role, previous, high) >= 0))) {
        return damaged(w, LC_REASON_KEY_ORDER, page, count);
    }
    for (uint64_t i = 0; i < count; i++) {
        uint64_t offset = u16_at(p + PAGE_HEADER_BYTES + 2 * i);
        const uint8_t *node = p + offset;
        uint32_t key_bytes = u16_at(node + 6);
        uint64_t room = w->page_bytes - offset;
        if (flags == P_BRANCH) {
            uint64_t child = (uint64_t)u16_at(node) | ((uint64_t)u16_at(node + 2) << 16) |
                             ((uint64_t)u16_at(node + 4) << 32);
            struct key child_low = low, child_high = high;
            if (i > 0) {
                child_low = (struct key){node + NODE_HEADER_BYTES, key_bytes};
            }
            if (i + 1 < count) {
                const uint8_t *next = p + u16_at(p + PAGE_HEADER_BYTES + 2 * (i + 1));
                child_high = (struct key){next + NODE_HEADER_BYTES, u16_at(next + 6)};
            }
            rc = walk_page(w, page, child, role, depth + 1, child_low, child_high);
        } else {
            rc = check_leaf_data(w, page, node, room, key_bytes, role);
        }
        if (rc != LC_OK) {
            return rc;
        }
    }
    return LC_OK;
}

static int walk_tree(struct walk *w, uint64_t from_page, uint64_t root, enum tree_role role) {
    struct key none = {NULL, 0};
    return walk_page(w, from_page, root, role, 1, none, none);
}

/* A meta page's own fields; the page size comes from meta 0 (as LMDB reads it). */
static int check_meta(struct walk *w, uint64_t number, uint64_t *txnid_out) {
    const uint8_t *p = w->map + number * w->page_bytes;
    if (u64_at(p) != number || u16_at(p + 10) != P_META || u32_at(p + 16) != META_MAGIC ||
        u32_at(p + 20) != META_VERSION) {
        return damaged(w, LC_REASON_META, number, 0);
    }
    uint16_t main_flags = u16_at(p + 88 + 4);
    uint16_t free_flags = u16_at(p + 40 + 4);
    if (main_flags != 0 || free_flags != DB_FLAG_INTEGER_KEYS) {
        return damaged(w, LC_REASON_DATABASE, number, (uint64_t)main_flags << 16 | free_flags);
    }
    *txnid_out = u64_at(p + 144);
    return LC_OK;
}

/* Page `page` of the file, from the map or read from the file into w->page_copy (valid until the
 * next read); NULL when it lies past the file's end or cannot be read. */
static const uint8_t *page_for_meta_stage(struct walk *w, uint64_t page) {
    if (page >= w->file_bytes / w->page_bytes) {
        return NULL;
    }
    if ((page + 1) * w->page_bytes <= w->map_bytes) {
        return page_at(w, page);
    }
    if (w->fd < 0 || w->page_copy == NULL) {
        return NULL;
    }
    uint64_t got = 0;
    while (got < w->page_bytes) {
        ssize_t n = pread(w->fd, w->page_copy + got, (size_t)(w->page_bytes - got), (off_t)(page * w->page_bytes + got));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return NULL;
        }
        got += (uint64_t)n;
    }
    return w->page_copy;
}

/*
 * The last key of a free database from `root` down its last children: the highest transaction id
 * with a free-list record in that snapshot. 0 (and *key_out untouched) when a page on the way is
 * not a sound branch or leaf: the walk judges the picked meta's tree, and the other meta's is
 * then not judged at all.
 */
static int last_free_key(struct walk *w, uint64_t root, uint64_t *key_out) {
    uint64_t page = root;
    for (int depth = 1; depth <= CURSOR_STACK_DEPTH; depth++) {
        const uint8_t *p = page_for_meta_stage(w, page);
        if (p == NULL || u64_at(p) != page) {
            return 0;
        }
        uint16_t flags = u16_at(p + 10);
        uint64_t lower = u16_at(p + 12);
        uint64_t upper = u16_at(p + 14);
        if ((flags != P_BRANCH && flags != P_LEAF) || lower <= PAGE_HEADER_BYTES || lower > upper ||
            upper > w->page_bytes || (lower - PAGE_HEADER_BYTES) % 2 != 0) {
            return 0;
        }
        uint64_t offset = u16_at(p + lower - 2);
        if (offset < upper || offset + NODE_HEADER_BYTES > w->page_bytes) {
            return 0;
        }
        const uint8_t *node = p + offset;
        if (flags == P_LEAF) {
            if (u16_at(node + 6) != FREE_KEY_BYTES || offset + NODE_HEADER_BYTES + FREE_KEY_BYTES > w->page_bytes) {
                return 0;
            }
            *key_out = u64_at(node + NODE_HEADER_BYTES);
            return 1;
        }
        page = (uint64_t)u16_at(node) | ((uint64_t)u16_at(node + 2) << 16) | ((uint64_t)u16_at(node + 4) << 32);
    }
    return 0;
}

/*
 * The meta stage, shared by the walk and lc_check_meta_pages: the page size, both meta pages,
 * the one LMDB picks and the pages it names. Reads the file's first two pages (w->map may hold
 * no more), its size, and the pages down the older meta's free database (page_for_meta_stage);
 * w->file_bytes is at least PAGE_BYTES_MIN (open_data_file). Sets w->page_bytes and w->next_page
 * (and their result fields) and the picked meta's number.
 */
static int check_metas(struct walk *w, uint64_t *picked_out) {
    struct lc_result *out = w->out;
    uint32_t page_bytes = u32_at(w->map + 40);
    if (page_bytes < PAGE_BYTES_MIN || page_bytes > PAGE_BYTES_MAX || (page_bytes & (page_bytes - 1)) != 0) {
        return damaged(w, LC_REASON_PAGE_SIZE, 0, page_bytes);
    }
    w->page_bytes = page_bytes;
    out->page_bytes = page_bytes;
    if (w->file_bytes < (uint64_t)META_COUNT * page_bytes) {
        return damaged(w, LC_REASON_FILE_SHORT, 0, w->file_bytes);
    }
    uint64_t txnid[META_COUNT];
    for (uint64_t number = 0; number < META_COUNT; number++) {
        int rc = check_meta(w, number, &txnid[number]);
        if (rc != LC_OK) {
            return rc;
        }
    }
    uint64_t picked = txnid[0] < txnid[1] ? 1 : 0;
    /* Transaction T writes meta page T mod 2, so at rest the two ids are consecutive (or both 0
     * before the first commit) and the newer one sits on its parity's page. A flipped id would
     * otherwise make LMDB open the older snapshot: consistent, sealed, and one commit behind. */
    uint64_t newest = txnid[picked];
    uint64_t older = txnid[1 - picked];
    if (!(newest == 0 && older == 0) && (newest - older != 1 || newest % 2 != picked)) {
        return damaged(w, LC_REASON_META, picked, newest);
    }
    const uint8_t *meta = w->map + picked * page_bytes;
    if (u32_at(meta + 40) != page_bytes) {
        return damaged(w, LC_REASON_PAGE_SIZE, picked, u32_at(meta + 40));
    }
    /* Transaction T records the pages it freed under key T, so a snapshot's free database holds no
     * key above its own id. The newer meta's id turned into the older one's predecessor (T read as
     * T-2) stays consecutive and LMDB opens the older snapshot; the newer meta's free database,
     * whose last key is then above its id, shows it. (The older snapshot's pages are intact: LMDB
     * reuses no page the newest two snapshots hold.) */
    uint64_t other_free_root = u64_at(w->map + (1 - picked) * page_bytes + 40 + 40);
    uint64_t last_key;
    if (other_free_root != NO_PAGE && last_free_key(w, other_free_root, &last_key) && last_key > older) {
        return damaged(w, LC_REASON_META, 1 - picked, last_key);
    }
    uint64_t last_page = u64_at(meta + 136);
    uint64_t pages_in_file = w->file_bytes / page_bytes;
    if (last_page < META_COUNT - 1 || last_page >= pages_in_file + SHORT_TAIL_PAGES_MAX) {
        return damaged(w, LC_REASON_FILE_SHORT, picked, last_page);
    }
    w->next_page = last_page + 1;
    out->next_page = w->next_page;
    *picked_out = picked;
    return LC_OK;
}

static int check_mapped(struct walk *w) {
    uint64_t picked;
    int rc = check_metas(w, &picked);
    if (rc != LC_OK) {
        return rc;
    }
    size_t bitmap_bytes = (size_t)((w->next_page + 7) / 8);
    w->in_use = calloc(bitmap_bytes, 1);
    w->is_free = calloc(bitmap_bytes, 1);
    w->node_bytes_at = calloc(w->page_bytes / 2, sizeof(w->node_bytes_at[0]));
    if (w->in_use == NULL || w->is_free == NULL || w->node_bytes_at == NULL) {
        return LC_E_NO_MEMORY;
    }
    const uint8_t *meta = page_at(w, picked);
    uint64_t free_root = u64_at(meta + 40 + 40);
    uint64_t main_root = u64_at(meta + 88 + 40);
    rc = free_root == NO_PAGE ? LC_OK : walk_tree(w, picked, free_root, ROLE_FREE);
    if (rc == LC_OK && main_root != NO_PAGE) {
        rc = walk_tree(w, picked, main_root, ROLE_MAIN);
    }
    if (rc != LC_OK) {
        return rc;
    }
    /* A page both free and in use would be handed out again while still referenced; a page
     * neither is a subtree cut off from its tree (a damaged root or child number that still
     * lands on a sound page of the same tree), whose entries a range would silently miss. */
    for (uint64_t page = META_COUNT; page < w->next_page; page++) {
        if (bit_get(w->in_use, page) && bit_get(w->is_free, page)) {
            return damaged(w, LC_REASON_FREE_LIST, picked, page);
        }
    }
    for (uint64_t page = META_COUNT; page < w->next_page; page++) {
        if (!bit_get(w->in_use, page) && !bit_get(w->is_free, page)) {
            return damaged(w, LC_REASON_PAGE_LOST, picked, page);
        }
    }
    return LC_OK;
}

/* Open the data file for reading into *fd_out: a regular file of at least PAGE_BYTES_MIN bytes
 * (w->file_bytes and out->file_bytes set). LC_OK, LC_E_IO (out->sys_errno) or LC_E_DAMAGED. */
static int open_data_file(const char *path, struct walk *w, int *fd_out) {
    struct lc_result *out = w->out;
    /* O_NONBLOCK: a FIFO put where the file was (after the caller's stat) must not hang the open;
     * it is then refused as no regular file. Reads of a regular file ignore the flag. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        out->sys_errno = errno;
        return LC_E_IO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        out->sys_errno = errno;
        close(fd);
        return LC_E_IO;
    }
    if (!S_ISREG(st.st_mode)) {
        out->sys_errno = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        close(fd);
        return LC_E_IO;
    }
    w->file_bytes = (uint64_t)st.st_size;
    out->file_bytes = w->file_bytes;
    if (w->file_bytes < PAGE_BYTES_MIN) {
        close(fd);
        return damaged(w, LC_REASON_FILE_SHORT, 0, w->file_bytes);
    }
    *fd_out = fd;
    return LC_OK;
}

/* Read the first `bytes` bytes of the file into `buffer`. LC_OK or LC_E_IO (out->sys_errno). */
static int read_head(int fd, uint8_t *buffer, uint64_t bytes, struct lc_result *out) {
    uint64_t got = 0;
    while (got < bytes) {
        ssize_t n = pread(fd, buffer + got, (size_t)(bytes - got), (off_t)got);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            out->sys_errno = n < 0 ? errno : EIO; /* shorter than fstat said: changed under us */
            return LC_E_IO;
        }
        got += (uint64_t)n;
    }
    return LC_OK;
}

/* The first `bytes` of the file read into a new heap block (*copy), exactly that long, so that a
 * sanitizer build reports a read past them. The caller frees it; on an error there is none. */
static int read_copy(int fd, uint64_t bytes, struct lc_result *out, uint8_t **copy) {
    *copy = malloc((size_t)bytes);
    if (*copy == NULL) {
        return LC_E_NO_MEMORY;
    }
    int rc = read_head(fd, *copy, bytes, out);
    if (rc != LC_OK) {
        free(*copy);
        *copy = NULL;
    }
    return rc;
}

/* What both entry points do first: a cleared result, a walk that owns no descriptor yet, and the
 * data file opened (its size in w->file_bytes). */
static int start_check(const char *path, struct lc_result *out, struct walk *w, int *fd) {
    memset(out, 0, sizeof(*out));
    *w = (struct walk){.fd = -1, .out = out};
    return open_data_file(path, w, fd);
}

int lc_check_meta_pages(const char *path, struct lc_result *out) {
    struct walk w;
    int fd;
    int rc = start_check(path, out, &w, &fd);
    if (rc != LC_OK) {
        return rc;
    }
    /* Both meta pages at the largest page size, or the whole file when it is shorter: exactly
     * what is read, so a sanitizer build reports a read past it. */
    uint64_t head_bytes = w.file_bytes < (uint64_t)META_COUNT * PAGE_BYTES_MAX ? w.file_bytes
                                                                              : (uint64_t)META_COUNT * PAGE_BYTES_MAX;
    uint8_t *head;
    rc = read_copy(fd, head_bytes, out, &head);
    if (rc == LC_OK) {
        uint64_t picked;
        w.map = head;
        w.map_bytes = head_bytes;
        w.fd = fd;
        w.page_copy = malloc(PAGE_BYTES_MAX);
        rc = w.page_copy == NULL ? LC_E_NO_MEMORY : check_metas(&w, &picked);
    }
    close(fd);
    free(w.page_copy);
    free(head);
    return rc;
}

int lc_check_file(const char *path, struct lc_result *out) {
    struct walk w;
    int fd;
    int rc = start_check(path, out, &w, &fd);
    if (rc != LC_OK) {
        return rc;
    }
#ifdef MWPSTORE_SANITIZE
    /* A sanitizer build (docs/reliability.md, "Sanitizers") reads the file into the heap instead:
     * AddressSanitizer knows where a heap block ends, so a read past the file's last byte is
     * reported, where in a mapping it would land unnoticed in the rest of the last page. */
    uint8_t *copy;
    rc = read_copy(fd, w.file_bytes, out, &copy);
    close(fd);
    if (rc != LC_OK) {
        return rc;
    }
    w.map = copy;
    w.map_bytes = w.file_bytes;
#else
    void *map = mmap(NULL, (size_t)w.file_bytes, PROT_READ, MAP_SHARED, fd, 0);
    int saved = errno;
    close(fd);
    if (map == MAP_FAILED) {
        out->sys_errno = saved;
        return LC_E_IO;
    }
    (void)madvise(map, (size_t)w.file_bytes, MADV_WILLNEED);
    w.map = map;
    w.map_bytes = w.file_bytes;
#endif
    rc = check_mapped(&w);
    free(w.in_use);
    free(w.is_free);
    free(w.node_bytes_at);
#ifdef MWPSTORE_SANITIZE
    free(copy);
#else
    munmap(map, (size_t)w.file_bytes);
#endif
    return rc;
}
