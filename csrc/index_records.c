/*
 * Index entries of Event records, for redo and rebuild, the seal check of sealed reads, and the
 * bytes of a segment log scan's records (record_bytes): the module mwpstore._index_c.
 *
 * Redo and rebuild turn every Event record of the log into index entries (docs/format/index.md):
 *
 *   events   group \0 seq (u64 BE)   -> log position (u64 BE)
 *   states   group \0 aggregate      -> revision (u64 BE) + msgpack state (nothing when deleted)
 *   receipts actor \0 action id      -> content hash (32) + msgpack Receipt
 *
 * each value sealed (followed by the little-endian CRC-32 of the database name, the key and the
 * value), and check the Group's hash chain on the way. mwpstore/authority.py (_index_record) does
 * this in Python and stays the reference; this file does the same for the common case, many
 * records per call, and hands every record it does not fully understand back to Python:
 *
 *   index_events(records, positions, start, heads, writes, seeds) -> (stop, last_ms)
 *
 * handles records[start:] until the first one that is not a plainly well-formed Event extending
 * its Group's chain (another tag, an unexpected msgpack shape, invalid UTF-8, an invalid ID, a
 * Group whose head is not in ``heads``, a chain that does not link), and returns that record's index ``stop``
 * (len(records) when all were handled) with the largest acceptance time it saw. Python applies
 * records[stop] with _index_record (which loads a missing head, indexes other tags, and raises the
 * typed CORRUPTION for a bad record) and calls again from stop + 1. So a record is either indexed
 * here completely or not touched here at all.
 *
 * What is copied instead of re-encoded: the state of an effect and the fields of the Receipt are
 * the record's own msgpack bytes. For records the engine wrote (msgspec, the same encoder as the
 * accept path) they are byte for byte what Python's decode and re-encode gives; the state is
 * validated first (msgpack types msgspec decodes into dict[str, Any]: maps with str keys, valid
 * UTF-8, no extension types), so any record accepted here decodes later to the same values.
 * tests/test_index_records.py compares this module's entries with the Python reference's.
 *
 * ``writes`` is a PendingWrites' (items, new) pair of dicts of lists: sealed (key, value) tuples
 * are appended to items[b"events"], items[b"states"], items[b"receipts"], and keys that need a
 * presence entry (a state at revision 1, every receipt) to new[b"states"], new[b"receipts"].
 * ``heads`` maps a Group (str) to (seq, hash) and is updated here (by the time index_events
 * returns; after an error it may lag the entries appended, and the caller drops the redo).
 * ``seeds`` is the CRC-32 of the three database names (events, states, receipts). Limited API
 * (abi3, Python >= 3.11).
 *
 * The module also checks seals on the way out: unseal(stored, key, seed, size_max) is the check
 * behind every sealed read of both LMDB stores (mwpstore/_sealed.py), done here because in Python
 * it cost about 0.65 us per read against 0.2 us (2026-12-03).
 */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define IR_HASH_BYTES 32
#define IR_EVENT_TAG 'E'
#define IR_EVENT_FIELDS 16
#define IR_RECEIPT_FIELDS 12
#define IR_DEPTH_MAX 64 /* deeper content goes to Python (the engine writes at most 32 levels) */
#define IR_ID_CHARS_MAX 128 /* limits.ID_CHARS_MAX (tests/test_index_records.py compares them) */

/* ---- CRC-32 (the zlib polynomial, reflected; zlib.crc32's value and continuation) ---------- */

/* Slicing by eight: crc_table[k][b] is the CRC of byte b followed by k zero bytes, so eight
 * input bytes are folded with eight table lookups and no dependency between them. */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        for (int k = 1; k < 8; k++) {
            uint32_t c = crc_table[k - 1][n];
            crc_table[k][n] = crc_table[0][c & 0xFF] ^ (c >> 8);
        }
    }
}

static uint32_t crc_update(uint32_t crc, const unsigned char *data, size_t size) {
    crc = ~crc;
    while (size >= 8) {
        uint32_t low = crc ^ ((uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 | (uint32_t)data[3] << 24);
        crc = crc_table[7][low & 0xFF] ^ crc_table[6][(low >> 8) & 0xFF] ^ crc_table[5][(low >> 16) & 0xFF] ^
              crc_table[4][low >> 24] ^ crc_table[3][data[4]] ^ crc_table[2][data[5]] ^ crc_table[1][data[6]] ^
              crc_table[0][data[7]];
        data += 8;
        size -= 8;
    }
    while (size--) {
        crc = crc_table[0][(crc ^ *data++) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

/* ---- msgpack reading: every reader returns 0 on success, -1 for "not handled here" ---------- */

typedef struct {
    const unsigned char *at;
    const unsigned char *end;
} reader_t;

typedef struct {
    const unsigned char *start; /* the value's whole encoding */
    const unsigned char *end;
} span_t;

static int take(reader_t *r, size_t size, const unsigned char **out) {
    if ((size_t)(r->end - r->at) < size) {
        return -1;
    }
    *out = r->at;
    r->at += size;
    return 0;
}

static uint64_t be(const unsigned char *p, int size) {
    uint64_t value = 0;
    for (int i = 0; i < size; i++) {
        value = (value << 8) | p[i];
    }
    return value;
}

/* Strict UTF-8 as Python's decoder takes it: no overlong forms, no surrogates, <= U+10FFFF. */
static int utf8_ok(const unsigned char *s, size_t size) {
    size_t i = 0;
    while (i < size) {
        /* ASCII, eight bytes at a time: IDs, kinds and most state text are ASCII */
        uint64_t word;
        while (size - i >= 8 && (memcpy(&word, s + i, 8), (word & 0x8080808080808080ull) == 0)) {
            i += 8;
        }
        if (i == size) break;
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        unsigned char low = 0x80, high = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0) low = 0xA0;
            if (c == 0xED) high = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0) low = 0x90;
            if (c == 0xF4) high = 0x8F;
        } else {
            return 0;
        }
        if (size - i - 1 < need || s[i + 1] < low || s[i + 1] > high) {
            return 0;
        }
        for (size_t k = 2; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) {
                return 0;
            }
        }
        i += need + 1;
    }
    return 1;
}

static int read_str(reader_t *r, const unsigned char **data, size_t *size) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    unsigned char c = *p;
    size_t n;
    if ((c & 0xE0) == 0xA0) {
        n = c & 0x1F;
    } else if (c == 0xD9 || c == 0xDA || c == 0xDB) {
        int width = c == 0xD9 ? 1 : c == 0xDA ? 2 : 4;
        if (take(r, (size_t)width, &p) < 0) return -1;
        n = (size_t)be(p, width);
    } else {
        return -1;
    }
    if (take(r, n, data) < 0 || !utf8_ok(*data, n)) return -1;
    *size = n;
    return 0;
}

/* canonical.check_id: 1..128 of [A-Za-z0-9_.@+=-], not starting with '.', '@', '+', '=' or '-'. */
static int id_ok(const unsigned char *s, size_t size) {
    if (size < 1 || size > IR_ID_CHARS_MAX) return 0;
    for (size_t i = 0; i < size; i++) {
        unsigned char c = s[i];
        int word = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
        if (!word && (i == 0 || !(c == '.' || c == '@' || c == '+' || c == '=' || c == '-'))) return 0;
    }
    return 1;
}

static int read_bin(reader_t *r, const unsigned char **data, size_t *size) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    unsigned char c = *p;
    if (c != 0xC4 && c != 0xC5 && c != 0xC6) return -1;
    int width = c == 0xC4 ? 1 : c == 0xC5 ? 2 : 4;
    if (take(r, (size_t)width, &p) < 0) return -1;
    size_t n = (size_t)be(p, width);
    if (take(r, n, data) < 0) return -1;
    *size = n;
    return 0;
}

/* A non-negative integer below 2**63 (sequences, revisions, times). */
static int read_uint(reader_t *r, uint64_t *value) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    unsigned char c = *p;
    if (c <= 0x7F) {
        *value = c;
        return 0;
    }
    int width;
    switch (c) {
        case 0xCC: width = 1; break;
        case 0xCD: width = 2; break;
        case 0xCE: width = 4; break;
        case 0xCF: width = 8; break;
        case 0xD0: width = 1; break;
        case 0xD1: width = 2; break;
        case 0xD2: width = 4; break;
        case 0xD3: width = 8; break;
        default: return -1;
    }
    if (take(r, (size_t)width, &p) < 0) return -1;
    uint64_t raw = be(p, width);
    if (c >= 0xD0) { /* signed: accept only a non-negative value */
        if (raw >> (8 * width - 1)) return -1;
    }
    if (raw > (uint64_t)INT64_MAX) return -1;
    *value = raw;
    return 0;
}

static int read_array(reader_t *r, size_t *count) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    unsigned char c = *p;
    if ((c & 0xF0) == 0x90) {
        *count = c & 0x0F;
        return 0;
    }
    if (c != 0xDC && c != 0xDD) return -1;
    int width = c == 0xDC ? 2 : 4;
    if (take(r, (size_t)width, &p) < 0) return -1;
    *count = (size_t)be(p, width);
    return 0;
}

static int read_bool(reader_t *r, int *value) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    if (*p != 0xC2 && *p != 0xC3) return -1;
    *value = *p == 0xC3;
    return 0;
}

static int is_nil(reader_t *r) {
    return r->at < r->end && *r->at == 0xC0;
}

/* Skip one value that msgspec decodes as Any (maps need str keys); -1 for anything else. */
static int skip_value(reader_t *r, int depth) {
    if (depth > IR_DEPTH_MAX) return -1;
    const unsigned char *p;
    if (r->at >= r->end) return -1;
    unsigned char c = *r->at;
    const unsigned char *data;
    size_t n;
    if (c <= 0x7F || c >= 0xE0 || c == 0xC0 || c == 0xC2 || c == 0xC3) {
        r->at++;
        return 0;
    }
    if ((c & 0xE0) == 0xA0 || c == 0xD9 || c == 0xDA || c == 0xDB) {
        return read_str(r, &data, &n);
    }
    if (c == 0xC4 || c == 0xC5 || c == 0xC6) {
        return read_bin(r, &data, &n);
    }
    size_t count;
    int is_map;
    if ((c & 0xF0) == 0x90 || c == 0xDC || c == 0xDD) {
        if (read_array(r, &count) < 0) return -1;
        is_map = 0;
    } else if ((c & 0xF0) == 0x80 || c == 0xDE || c == 0xDF) {
        r->at++;
        if ((c & 0xF0) == 0x80) {
            count = c & 0x0F;
        } else {
            int width = c == 0xDE ? 2 : 4;
            if (take(r, (size_t)width, &p) < 0) return -1;
            count = (size_t)be(p, width);
        }
        is_map = 1;
    } else {
        int width;
        switch (c) {
            case 0xCA: width = 4; break;
            case 0xCB: width = 8; break;
            case 0xCC: case 0xD0: width = 1; break;
            case 0xCD: case 0xD1: width = 2; break;
            case 0xCE: case 0xD2: width = 4; break;
            case 0xCF: case 0xD3: width = 8; break;
            default: return -1; /* extension types and the unused byte */
        }
        r->at++;
        return take(r, (size_t)width, &p);
    }
    if (count > (size_t)(r->end - r->at)) return -1; /* every item takes at least one byte */
    for (size_t i = 0; i < count; i++) {
        if (is_map && read_str(r, &data, &n) < 0) return -1;
        if (skip_value(r, depth + 1) < 0) return -1;
    }
    return 0;
}

static int read_map_or_nil(reader_t *r, span_t *span, int *nil) {
    span->start = r->at;
    if (is_nil(r)) {
        r->at++;
        *nil = 1;
    } else {
        unsigned char c = r->at < r->end ? *r->at : 0;
        if (!((c & 0xF0) == 0x80 || c == 0xDE || c == 0xDF)) return -1;
        if (skip_value(r, 0) < 0) return -1;
        *nil = 0;
    }
    span->end = r->at;
    return 0;
}

/* ---- building entries ---------------------------------------------------------------------- */

#define IR_EFFECTS_MAX 256 /* more effects in one Event go to Python */

typedef struct {
    const unsigned char *aggregate;
    size_t aggregate_size;
    uint64_t revision;
    span_t state;
    int deleted;
} effect_t;

typedef struct {
    span_t field[IR_EVENT_FIELDS];
    const unsigned char *group, *actor, *action_id, *content_hash, *prev_hash, *hash;
    size_t group_size, actor_size, action_id_size;
    uint64_t seq, accepted_at_ms;
    size_t effect_count;
    effect_t effects[IR_EFFECTS_MAX];
} event_t;

static void put_u64(unsigned char *out, uint64_t value) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(value & 0xFF);
        value >>= 8;
    }
}

/* Parse an Event record (tag + msgpack array of 16) into ``e``; -1 if it is not plainly one. */
static int parse_event(const unsigned char *data, size_t size, event_t *e) {
    if (size < 1 || data[0] != IR_EVENT_TAG) return -1;
    reader_t r = {data + 1, data + size};
    size_t count, n;
    const unsigned char *s;
    uint64_t number;
    int flag;
    if (read_array(&r, &count) < 0 || count != IR_EVENT_FIELDS) return -1;
#define FIELD(i, read) \
    e->field[i].start = r.at; \
    if ((read) < 0) return -1; \
    e->field[i].end = r.at;
    FIELD(0, read_str(&r, &e->group, &e->group_size))
    FIELD(1, read_uint(&r, &e->seq))
    FIELD(2, read_str(&r, &s, &n))
    FIELD(3, read_str(&r, &s, &n))
    FIELD(4, read_str(&r, &s, &n))
    FIELD(5, read_uint(&r, &number))
    FIELD(6, read_str(&r, &e->actor, &e->actor_size))
    FIELD(7, read_str(&r, &e->action_id, &e->action_id_size))
    FIELD(8, read_bin(&r, &e->content_hash, &n))
    if (n != IR_HASH_BYTES) return -1;
    FIELD(9, read_uint(&r, &e->accepted_at_ms))
    FIELD(10, read_bool(&r, &flag))
    span_t body;
    FIELD(11, read_map_or_nil(&r, &body, &flag))
    e->field[12].start = r.at;
    if (read_array(&r, &e->effect_count) < 0 || e->effect_count > IR_EFFECTS_MAX) return -1;
    for (size_t i = 0; i < e->effect_count; i++) {
        effect_t *effect = &e->effects[i];
        if (read_array(&r, &count) < 0 || count != 3) return -1;
        if (read_str(&r, &effect->aggregate, &effect->aggregate_size) < 0) return -1;
        if (read_uint(&r, &effect->revision) < 0 || effect->revision < 1) return -1;
        if (read_map_or_nil(&r, &effect->state, &effect->deleted) < 0) return -1;
    }
    e->field[12].end = r.at;
    FIELD(13, read_bin(&r, &s, &n))
    FIELD(14, read_bin(&r, &e->prev_hash, &n))
    if (n != IR_HASH_BYTES) return -1;
    FIELD(15, read_bin(&r, &e->hash, &n))
    if (n != IR_HASH_BYTES) return -1;
#undef FIELD
    if (!id_ok(e->group, e->group_size) || !id_ok(e->actor, e->actor_size) || !id_ok(e->action_id, e->action_id_size)) {
        return -1; /* the keys are built from these: Python refuses them */
    }
    return r.at == r.end ? 0 : -1;
}

/* A key of two parts joined by \0 (plus an optional u64 BE suffix instead of the second part). */
static PyObject *make_key(const unsigned char *a, size_t a_size, const unsigned char *b, size_t b_size) {
    PyObject *key = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(a_size + 1 + b_size));
    if (key == NULL) return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AsString(key);
    memcpy(out, a, a_size);
    out[a_size] = 0;
    memcpy(out + a_size + 1, b, b_size);
    return key;
}

/* Write the seal of the `size` value bytes at `out` into out[size..size+4): the little-endian
 * CRC-32 of the database seed, the key and the value. */
static void seal_tail(uint32_t seed, const unsigned char *key, size_t key_size, unsigned char *out, size_t size) {
    uint32_t crc = crc_update(crc_update(seed, key, key_size), out, size);
    out[size] = (unsigned char)(crc & 0xFF);
    out[size + 1] = (unsigned char)((crc >> 8) & 0xFF);
    out[size + 2] = (unsigned char)((crc >> 16) & 0xFF);
    out[size + 3] = (unsigned char)((crc >> 24) & 0xFF);
}

/* (key, value + seal) with the value built from up to three pieces. */
static PyObject *sealed_item(PyObject *key, uint32_t seed, const unsigned char *p1, size_t n1,
                             const unsigned char *p2, size_t n2, const unsigned char *p3, size_t n3) {
    size_t size = n1 + n2 + n3;
    PyObject *value = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(size + 4));
    if (value == NULL) return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AsString(value);
    memcpy(out, p1, n1);
    if (n2) memcpy(out + n1, p2, n2);
    if (n3) memcpy(out + n1 + n2, p3, n3);
    char *key_data;
    Py_ssize_t key_size;
    if (PyBytes_AsStringAndSize(key, &key_data, &key_size) < 0) {
        Py_DECREF(value);
        return NULL;
    }
    seal_tail(seed, (const unsigned char *)key_data, (size_t)key_size, out, size);
    PyObject *item = PyTuple_Pack(2, key, value);
    Py_DECREF(value);
    return item;
}

static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

typedef struct {
    PyObject *events, *states, *receipts, *states_new, *receipts_new;
    uint32_t events_seed, states_seed, receipts_seed;
} outputs_t;

/* Append the entries of one parsed Event; -1 with a Python error set on failure. */
static int emit(const event_t *e, uint64_t position, const outputs_t *out) {
    unsigned char seq_be[8], number_be[8];
    put_u64(seq_be, e->seq);
    put_u64(number_be, position);
    PyObject *key = make_key(e->group, e->group_size, seq_be, 8);
    if (key == NULL) return -1;
    int rc = append_new(out->events, sealed_item(key, out->events_seed, number_be, 8, NULL, 0, NULL, 0));
    Py_DECREF(key);
    if (rc < 0) return -1;

    for (size_t i = 0; i < e->effect_count; i++) {
        const effect_t *effect = &e->effects[i];
        key = make_key(e->group, e->group_size, effect->aggregate, effect->aggregate_size);
        if (key == NULL) return -1;
        put_u64(number_be, effect->revision);
        size_t state_size = effect->deleted ? 0 : (size_t)(effect->state.end - effect->state.start);
        rc = append_new(out->states, sealed_item(key, out->states_seed, number_be, 8, effect->state.start, state_size, NULL, 0));
        if (rc == 0 && effect->revision == 1) rc = PyList_Append(out->states_new, key);
        Py_DECREF(key);
        if (rc < 0) return -1;
    }

    /* The Receipt: an array of its 12 fields, each the Event's own encoding of that field. */
    static const int receipt_fields[IR_RECEIPT_FIELDS] = {2, 0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 15};
    size_t receipt_size = 1;
    for (int i = 0; i < IR_RECEIPT_FIELDS; i++) {
        receipt_size += (size_t)(e->field[receipt_fields[i]].end - e->field[receipt_fields[i]].start);
    }
    unsigned char stack[1024];
    unsigned char *receipt = receipt_size <= sizeof stack ? stack : PyMem_Malloc(receipt_size);
    if (receipt == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    receipt[0] = 0x90 | IR_RECEIPT_FIELDS;
    size_t at = 1;
    for (int i = 0; i < IR_RECEIPT_FIELDS; i++) {
        const span_t *span = &e->field[receipt_fields[i]];
        memcpy(receipt + at, span->start, (size_t)(span->end - span->start));
        at += (size_t)(span->end - span->start);
    }
    key = make_key(e->actor, e->actor_size, e->action_id, e->action_id_size);
    rc = -1;
    if (key != NULL) {
        rc = append_new(out->receipts, sealed_item(key, out->receipts_seed, e->content_hash, IR_HASH_BYTES, receipt, receipt_size, NULL, 0));
        if (rc == 0) rc = PyList_Append(out->receipts_new, key);
        Py_DECREF(key);
    }
    if (receipt != stack) PyMem_Free(receipt);
    return rc;
}

/* 1: the Group's head in ``heads`` is (seq - 1, prev_hash), and is now (seq, hash); 0: not
 * handled here (no head known, or the chain does not link); -1: a Python error. */
static int advance_head(PyObject *heads, const event_t *e) {
    PyObject *group = PyUnicode_DecodeUTF8((const char *)e->group, (Py_ssize_t)e->group_size, "strict");
    if (group == NULL) return -1;
    PyObject *head = PyDict_GetItemWithError(heads, group); /* borrowed */
    int result = 0;
    if (head == NULL) {
        result = PyErr_Occurred() ? -1 : 0;
    } else if (PyTuple_Check(head) && PyTuple_Size(head) == 2) {
        PyObject *head_seq = PyTuple_GetItem(head, 0);
        PyObject *head_hash = PyTuple_GetItem(head, 1);
        char *hash_data;
        Py_ssize_t hash_size;
        unsigned long long seq = 0;
        int readable = PyLong_Check(head_seq) && PyBytes_Check(head_hash);
        if (readable) {
            seq = PyLong_AsUnsignedLongLong(head_seq);
            readable = !PyErr_Occurred() && seq < (unsigned long long)INT64_MAX;
            PyErr_Clear(); /* a head this file cannot read: Python's path decides */
        }
        if (!readable) {
            result = 0;
        } else if (PyBytes_AsStringAndSize(head_hash, &hash_data, &hash_size) < 0) {
            result = -1;
        } else if (e->seq == seq + 1 && hash_size == IR_HASH_BYTES && memcmp(hash_data, e->prev_hash, IR_HASH_BYTES) == 0) {
            PyObject *new_seq = PyLong_FromUnsignedLongLong(e->seq);
            PyObject *new_hash = PyBytes_FromStringAndSize((const char *)e->hash, IR_HASH_BYTES);
            PyObject *new_head = (new_seq && new_hash) ? PyTuple_Pack(2, new_seq, new_hash) : NULL;
            Py_XDECREF(new_seq);
            Py_XDECREF(new_hash);
            result = (new_head != NULL && PyDict_SetItem(heads, group, new_head) == 0) ? 1 : -1;
            Py_XDECREF(new_head);
        }
    }
    Py_DECREF(group);
    return result;
}

/* The head of the Group of the last Event handled, kept here instead of in ``heads`` while the
 * next Events extend the same Group: a record names its Group as bytes, and looking that up in
 * ``heads`` meant a str, a hash, a dict lookup and a new tuple per record. ``heads`` gets the
 * cached head back (flush_head) when another Group comes, and before index_events returns. */
typedef struct {
    int valid, dirty;
    unsigned char group[IR_ID_CHARS_MAX]; /* an ID (id_ok): at most IR_ID_CHARS_MAX bytes */
    size_t group_size;
    uint64_t seq;
    unsigned char hash[IR_HASH_BYTES];
} head_cache_t;

/* Put the cached head into ``heads`` if it moved since it was taken; 0, or -1 with a Python error. */
static int flush_head(PyObject *heads, head_cache_t *cache) {
    if (!cache->valid || !cache->dirty) return 0;
    PyObject *group = PyUnicode_DecodeUTF8((const char *)cache->group, (Py_ssize_t)cache->group_size, "strict");
    PyObject *seq = PyLong_FromUnsignedLongLong(cache->seq);
    PyObject *hash = PyBytes_FromStringAndSize((const char *)cache->hash, IR_HASH_BYTES);
    PyObject *head = (group && seq && hash) ? PyTuple_Pack(2, seq, hash) : NULL;
    int rc = (head != NULL && PyDict_SetItem(heads, group, head) == 0) ? 0 : -1;
    Py_XDECREF(group);
    Py_XDECREF(seq);
    Py_XDECREF(hash);
    Py_XDECREF(head);
    cache->dirty = 0;
    return rc;
}

/* advance_head through the cache: the same answer, and ``heads`` as advance_head leaves it once
 * flush_head has run. */
static int advance_cached_head(PyObject *heads, head_cache_t *cache, const event_t *e) {
    int cached = cache->valid && e->group_size == cache->group_size && memcmp(e->group, cache->group, e->group_size) == 0;
    if (cached) {
        if (e->seq != cache->seq + 1 || memcmp(e->prev_hash, cache->hash, IR_HASH_BYTES) != 0) return 0;
        cache->dirty = 1;
    } else {
        if (flush_head(heads, cache) < 0) return -1;
        cache->valid = 0;
        int linked = advance_head(heads, e);
        if (linked <= 0) return linked;
        memcpy(cache->group, e->group, e->group_size); /* parse_event checked id_ok: it fits */
        cache->group_size = e->group_size;
        cache->valid = 1;
        cache->dirty = 0; /* advance_head put this Event's head into ``heads`` */
    }
    cache->seq = e->seq;
    memcpy(cache->hash, e->hash, IR_HASH_BYTES);
    return 1;
}

/* The list writes[name] (a new reference); NULL with a Python error. */
static PyObject *list_of(PyObject *dict, const char *name) {
    PyObject *key = PyBytes_FromString(name);
    if (key == NULL) return NULL;
    PyObject *list = PyDict_GetItemWithError(dict, key); /* borrowed */
    Py_DECREF(key);
    if (list == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "writes has no list %s", name);
        return NULL;
    }
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "writes[%s] must be a list", name);
        return NULL;
    }
    return Py_NewRef(list); /* held: Python code may run while entries are appended */
}

/* A database seed argument: a CRC-32; -1 with a Python error otherwise. */
static int seed_arg(PyObject *arg, uint32_t *seed) {
    unsigned long value = PyLong_AsUnsignedLong(arg);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "seed must be a CRC-32");
        return -1;
    }
    *seed = (uint32_t)value;
    return 0;
}

static PyObject *ir_index_events(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *records, *positions, *heads, *items, *new_keys;
    Py_ssize_t start;
    PyObject *seed_args[3];
    uint32_t events_seed, states_seed, receipts_seed;
    /* the seeds are taken as objects and range-checked: "I" would wrap a value past 32 bits */
    if (!PyArg_ParseTuple(args, "O!O!nO!(O!O!)(OOO)", &PyList_Type, &records, &PyList_Type, &positions, &start,
                          &PyDict_Type, &heads, &PyDict_Type, &items, &PyDict_Type, &new_keys, &seed_args[0],
                          &seed_args[1], &seed_args[2]) ||
        seed_arg(seed_args[0], &events_seed) < 0 || seed_arg(seed_args[1], &states_seed) < 0 ||
        seed_arg(seed_args[2], &receipts_seed) < 0) {
        return NULL;
    }
    Py_ssize_t count = PyList_Size(records);
    if (PyList_Size(positions) != count || start < 0 || start > count) {
        PyErr_SetString(PyExc_ValueError, "records and positions must have the same length, start within it");
        return NULL;
    }
    outputs_t out = {.events_seed = events_seed, .states_seed = states_seed, .receipts_seed = receipts_seed};
    PyObject *result = NULL;
    event_t *e = NULL;
    uint64_t last_ms = 0;
    head_cache_t cache = {.valid = 0};
    Py_ssize_t i = start;
    /* one at a time: no call with an exception already set */
    if ((out.events = list_of(items, "events")) == NULL || (out.states = list_of(items, "states")) == NULL ||
        (out.receipts = list_of(items, "receipts")) == NULL || (out.states_new = list_of(new_keys, "states")) == NULL ||
        (out.receipts_new = list_of(new_keys, "receipts")) == NULL) {
        goto done;
    }
    e = PyMem_Malloc(sizeof *e);
    if (e == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* ``e`` points into the record's bytes, and Python code can run between the parse and the
     * last use (a head's __eq__ in the lookup, a replaced head's __del__): each record is held
     * while it is handled, and the lists' lengths are read again for each one. */
    for (; i < PyList_Size(records); i++) {
        PyObject *record = PyList_GetItem(records, i);
        PyObject *position_item = PyList_GetItem(positions, i);
        if (record == NULL || position_item == NULL) goto done;
        char *data;
        Py_ssize_t size;
        if (!PyBytes_Check(record)) {
            PyErr_SetString(PyExc_TypeError, "records must be bytes");
            goto done;
        }
        unsigned long long position = PyLong_AsUnsignedLongLong(position_item);
        if (position == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        if (PyBytes_AsStringAndSize(record, &data, &size) < 0) goto done;
        if (parse_event((const unsigned char *)data, (size_t)size, e) < 0) break;
        Py_INCREF(record);
        int linked = advance_cached_head(heads, &cache, e);
        if (linked > 0 && emit(e, position, &out) < 0) linked = -1; /* the head moved: a Python error ends the redo */
        Py_DECREF(record);
        if (linked < 0) goto done;
        if (linked == 0) break;
        if (e->accepted_at_ms > last_ms) last_ms = e->accepted_at_ms;
    }
    /* on an error ``heads`` may lag the entries appended: the caller drops the whole redo */
    if (flush_head(heads, &cache) < 0) goto done;
    result = Py_BuildValue("(nK)", i, (unsigned long long)last_ms);
done:
    PyMem_Free(e);
    Py_XDECREF(out.events);
    Py_XDECREF(out.states);
    Py_XDECREF(out.receipts);
    Py_XDECREF(out.states_new);
    Py_XDECREF(out.receipts_new);
    return result;
}

/* unseal(stored, key, seed, size_max) -> bytes | None: the value inside a sealed entry, or None
 * when its length is impossible (shorter than the seal, or a value above size_max) or its seal
 * fails. The same check as SealedTables.unseal's reference form in mwpstore/_sealed.py; ``stored``
 * and ``key`` are any contiguous buffers (LMDB's memoryviews included), copied from at once. */
static PyObject *ir_unseal(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unseal takes (stored, key, seed, size_max)");
        return NULL;
    }
    uint32_t seed;
    if (seed_arg(args[2], &seed) < 0) return NULL;
    Py_ssize_t size_max = PyLong_AsSsize_t(args[3]);
    if (size_max == -1 && PyErr_Occurred()) return NULL;
    if (size_max < 0) {
        PyErr_SetString(PyExc_ValueError, "size_max must be non-negative");
        return NULL;
    }
    Py_buffer stored, key;
    if (PyObject_GetBuffer(args[0], &stored, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &key, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&stored);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t size = stored.len - 4;
    if (size >= 0 && size <= size_max) {
        const unsigned char *data = (const unsigned char *)stored.buf;
        uint32_t want = (uint32_t)data[size] | (uint32_t)data[size + 1] << 8 | (uint32_t)data[size + 2] << 16 |
                        (uint32_t)data[size + 3] << 24;
        uint32_t crc = crc_update(crc_update(seed, (const unsigned char *)key.buf, (size_t)key.len), data, (size_t)size);
        if (crc == want) result = PyBytes_FromStringAndSize((const char *)data, size);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&stored);
    if (result == NULL && !PyErr_Occurred()) result = Py_NewRef(Py_None);
    return result;
}

/* The sealed form of one value: value + CRC-32 (little-endian) of seed, key and value; NULL with
 * a Python error set if key or value is not a bytes-like object. */
static PyObject *sealed_value(PyObject *key, PyObject *value, uint32_t seed) {
    Py_buffer key_view, value_view;
    if (PyObject_GetBuffer(key, &key_view, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(value, &value_view, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key_view);
        return NULL;
    }
    PyObject *sealed = PyBytes_FromStringAndSize(NULL, value_view.len + 4);
    if (sealed != NULL) {
        unsigned char *out = (unsigned char *)PyBytes_AsString(sealed);
        if (value_view.len) memcpy(out, value_view.buf, (size_t)value_view.len);
        seal_tail(seed, (const unsigned char *)key_view.buf, (size_t)key_view.len, out, (size_t)value_view.len);
    }
    PyBuffer_Release(&value_view);
    PyBuffer_Release(&key_view);
    return sealed;
}

/* seal(key, value, seed) -> bytes: value followed by its seal (mwpstore/_sealed.py's format). */
static PyObject *ir_seal(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uint32_t seed;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "seal takes (key, value, seed)");
        return NULL;
    }
    if (seed_arg(args[2], &seed) < 0) return NULL;
    return sealed_value(args[0], args[1], seed);
}

/* seal_items(items, seed) -> list: [(key, sealed value)] for a list of (key, value) bytes pairs. */
static PyObject *ir_seal_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uint32_t seed;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "seal_items takes (list of (key, value), seed)");
        return NULL;
    }
    if (seed_arg(args[1], &seed) < 0) return NULL;
    PyObject *items = args[0];
    Py_ssize_t count = PyList_Size(items);
    PyObject *out = PyList_New(count);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        /* Held, and fetched with a check: a buffer export may be Python code (__buffer__, Python
         * 3.12) that changes the list. */
        PyObject *item = PyList_GetItem(items, i);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        if (!PyTuple_Check(item) || PyTuple_Size(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "seal_items takes (key, value) pairs");
            Py_DECREF(out);
            return NULL;
        }
        Py_INCREF(item);
        PyObject *key = PyTuple_GetItem(item, 0), *value = PyTuple_GetItem(item, 1); /* held by item */
        PyObject *sealed = sealed_value(key, value, seed);
        PyObject *pair = sealed == NULL ? NULL : PyTuple_Pack(2, key, sealed);
        Py_XDECREF(sealed);
        Py_DECREF(item);
        if (pair == NULL || PyList_SetItem(out, i, pair) < 0) { /* SetItem steals pair */
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* record_bytes(data, starts, stops, split_tags) -> list | (list, bytes): a scan batch's records
 * copied out of ``data`` (the segment's read-only map), record i being data[starts[i]:stops[i]];
 * ``starts`` and ``stops`` are buffers of native uint64 offsets, the arrays sl_scan filled. With
 * ``split_tags`` each record's first byte goes to the returned bytes instead and the list holds
 * the rest (an empty record gives b"" and no tag byte), as SegmentLog.scan hands them over. Every
 * offset is checked against data before anything is copied: a stop before its start or past
 * data is ValueError, so nothing outside data is read. */
static PyObject *ir_record_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "record_bytes takes (data, starts, stops, split_tags)");
        return NULL;
    }
    int split = PyObject_IsTrue(args[3]);
    if (split < 0) return NULL;
    Py_buffer data, starts, stops;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &starts, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &stops, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&starts);
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *records = NULL, *tags = NULL, *result = NULL;
    Py_ssize_t count = starts.len / 8, tag_count = 0;
    const unsigned char *bytes = (const unsigned char *)data.buf;
    unsigned char *tag_out = NULL;
    if (starts.len != stops.len || starts.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "record_bytes: starts and stops must be uint64 arrays of one length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t start, stop;
        memcpy(&start, (const unsigned char *)starts.buf + 8 * i, 8);
        memcpy(&stop, (const unsigned char *)stops.buf + 8 * i, 8);
        if (start > stop || stop > (uint64_t)data.len) {
            PyErr_SetString(PyExc_ValueError, "record_bytes: a record lies outside the data");
            goto done;
        }
        tag_count += stop > start;
    }
    records = PyList_New(count);
    if (records == NULL) goto done;
    if (split) {
        tags = PyBytes_FromStringAndSize(NULL, tag_count);
        if (tags == NULL) goto done;
        tag_out = (unsigned char *)PyBytes_AsString(tags);
        if (tag_out == NULL) goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t start, stop;
        memcpy(&start, (const unsigned char *)starts.buf + 8 * i, 8);
        memcpy(&stop, (const unsigned char *)stops.buf + 8 * i, 8);
        if (split && stop > start) *tag_out++ = bytes[start++];
        PyObject *record = PyBytes_FromStringAndSize((const char *)bytes + start, (Py_ssize_t)(stop - start));
        if (record == NULL || PyList_SetItem(records, i, record) < 0) goto done; /* SetItem steals record */
    }
    result = split ? PyTuple_Pack(2, records, tags) : Py_NewRef(records);
done:
    Py_XDECREF(tags);
    Py_XDECREF(records);
    PyBuffer_Release(&stops);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&data);
    return result;
}

/* seal_sorted(writes, seed, encode=None) -> list: [(key, sealed value)] for the dict ``writes`` of
 * bytes keys, in key order, each value sealed as seal() seals it (encode(value) first, when
 * ``encode`` is given). What SealedTables.put_many would be handed as
 * seal_items(sorted(writes.items()), seed) (after [(key, encode(value)) ...]), without a tuple per
 * item to sort and one more to seal; tests/test_index_seals.py compares the two. An AgentStore's
 * commit writes its cached inbox entries and states with it. encode may be Python code that
 * changes the dict: each key and value is held while it runs, and a key gone from the dict is a
 * RuntimeError. */
static PyObject *ir_seal_sorted(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uint32_t seed;
    if (nargs < 2 || nargs > 3 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "seal_sorted takes (dict of bytes keys, seed[, encode])");
        return NULL;
    }
    if (seed_arg(args[1], &seed) < 0) return NULL;
    PyObject *writes = args[0], *encode = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    if (encode != NULL && !PyCallable_Check(encode)) {
        PyErr_SetString(PyExc_TypeError, "seal_sorted: encode must be callable or None");
        return NULL;
    }
    PyObject *keys = PyDict_Keys(writes);
    if (keys == NULL) return NULL;
    Py_ssize_t count = PyList_Size(keys);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(PyList_GetItem(keys, i))) { /* sorting compares bytes only: no Python code runs */
            PyErr_SetString(PyExc_TypeError, "seal_sorted takes a dict of bytes keys");
            Py_DECREF(keys);
            return NULL;
        }
    }
    if (PyList_Sort(keys) < 0) {
        Py_DECREF(keys);
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GetItem(keys, i); /* held by keys, which only this function holds */
        PyObject *value = PyDict_GetItemWithError(writes, key); /* borrowed */
        if (value == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "seal_sorted: the dict changed");
            goto failed;
        }
        Py_INCREF(value);
        PyObject *data = value;
        if (encode != NULL) {
            data = PyObject_CallFunctionObjArgs(encode, value, NULL);
            Py_DECREF(value);
            if (data == NULL) goto failed;
        }
        PyObject *sealed = sealed_value(key, data, seed);
        Py_DECREF(data);
        PyObject *pair = sealed == NULL ? NULL : PyTuple_Pack(2, key, sealed);
        Py_XDECREF(sealed);
        if (pair == NULL || PyList_SetItem(out, i, pair) < 0) goto failed; /* SetItem steals pair */
    }
    Py_DECREF(keys);
    return out;
failed:
    Py_DECREF(out);
    Py_DECREF(keys);
    return NULL;
}

static PyMethodDef ir_methods[] = {
    {"index_events", ir_index_events, METH_VARARGS,
     "index_events(records, positions, start, heads, (items, new), (seeds)) -> (stop, last_ms); see csrc/index_records.c."},
    {"seal", (PyCFunction)(void (*)(void))ir_seal, METH_FASTCALL,
     "seal(key, value, seed) -> bytes; see csrc/index_records.c."},
    {"seal_items", (PyCFunction)(void (*)(void))ir_seal_items, METH_FASTCALL,
     "seal_items([(key, value)], seed) -> [(key, sealed value)]; see csrc/index_records.c."},
    {"seal_sorted", (PyCFunction)(void (*)(void))ir_seal_sorted, METH_FASTCALL,
     "seal_sorted({key: value}, seed[, encode]) -> [(key, sealed value)] in key order; see csrc/index_records.c."},
    {"unseal", (PyCFunction)(void (*)(void))ir_unseal, METH_FASTCALL,
     "unseal(stored, key, seed, size_max) -> bytes | None; see csrc/index_records.c."},
    {"record_bytes", (PyCFunction)(void (*)(void))ir_record_bytes, METH_FASTCALL,
     "record_bytes(data, starts, stops, split_tags) -> list | (list, bytes); see csrc/index_records.c."},
    {NULL, NULL, 0, NULL},
};

static int ir_exec(PyObject *module) {
    crc_init();
    return PyModule_AddIntConstant(module, "ID_CHARS_MAX", IR_ID_CHARS_MAX);
}

static PyModuleDef_Slot ir_slots[] = {
    {Py_mod_exec, (void *)ir_exec},
    {0, NULL},
};

static struct PyModuleDef ir_module = {
    PyModuleDef_HEAD_INIT,
    "mwpstore._index_c",
    "Index entries of Event records for redo and rebuild (see csrc/index_records.c).",
    0,
    ir_methods,
    ir_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__index_c(void) {
    return PyModuleDef_Init(&ir_module);
}
