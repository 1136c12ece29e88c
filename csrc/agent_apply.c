/*
 * The AgentStore's in-order apply runs: the module mwpstore._apply_c.
 *
 * AgentTransaction.apply_many (mwpstore/agent_store.py) applies the first Event of a Group with
 * the general apply(), which checks it, loads the Group's head and validates the Group's ID; then
 * it hands the Events that follow to
 *
 *   run(events, start, context, group, prefix, next_seq, prev_hash, inbox_writes, state_writes,
 *       writes_max) -> stop
 *
 * with context = (event_type, effect_type, checked, checked_max, kind_ok, id_ok, astuple)
 * (agent_store._RUN_CONTEXT; astuple is msgspec.structs.astuple, which reads an Event's fields in
 * one call), which takes
 * events[start:] for as long as each one is, exactly as apply() would see it in trusted mode,
 * the plain next Event of ``group``: an ``event_type`` object whose fields have the types
 * admit_trusted_event and _check_shape require, whose Group is ``group``, whose sequence is
 * ``next_seq`` (then one more for each Event taken), whose Event ID is "<group>:<seq>", whose
 * hashes are 32 bytes and whose prev_hash is the previous Event's hash (``prev_hash`` first), and
 * whose effects are ``effect_type`` objects with a dict or None as state, naming valid aggregate
 * keys: one already in the set ``checked`` (the keys agent_store has validated), or "<kind>:<id>"
 * where mwpstore._canonical_c's kind_ok(kind) and id_ok(id) hold (_check_aggregate's rule), which
 * is then added to ``checked`` while it holds fewer than ``checked_max``. For
 * each Event taken it does what _apply_next does for the built-in projection:
 * inbox_writes[prefix + seq (u64 BE)] = hash, and state_writes[prefix + aggregate (UTF-8)] =
 * (revision, state) for each effect. It returns the index of the first Event it did not take
 * (len(events) when it took all), or the index after the Event that brought len(inbox_writes) +
 * len(state_writes) to ``writes_max`` (the caller flushes then), or the index after the Event
 * numbered LLONG_MAX (the count never wraps; a ``next_seq`` beyond it takes nothing, and apply()
 * decides those Events). An Event it does not take is not touched: apply() decides it, with its
 * typed errors, duplicates, buffering and fail points. tests/test_agent_store_apply_many.py
 * compares the two paths over random delivery schedules (and the fuzz target agent_apply_many
 * over arbitrary field values). A Python error raised here (only MemoryError is possible) leaves
 * Events before it written but the Group's head not moved: the caller fails its transaction.
 *
 * With verify="full", apply_many first hands the Events after the first to
 *
 *   check_run(events, start, context, group, next_seq, prev_hash) -> end
 *
 * with context = (event_type, effect_type, checked, check_aggregate, encode_into,
 * canonical_bytes, blake3, domain_payload, domain_event, content_ok, id_ok, kind_ok,
 * event_bytes_max, astuple) (agent_store._CHECK_CONTEXT, messages.HASHING), which returns the index of
 * the first Event of events[start:] that does not pass what admit_event and check_event check
 * (with the chain link from ``prev_hash``) as ``group``'s Event ``next_seq``, ``next_seq`` + 1, and
 * so on: it is agent_store._fully_valid_run, whose end it must equal (tests/test_agent_check_run.py,
 * and the fuzz target agent_check_run over fuzzed and resealed Events). ``group`` must be a valid
 * Group ID (apply() took an Event of it first). It counts sequences as run() does (never past
 * LLONG_MAX), and checks the effects in Python's order: every effect's type and aggregate key
 * (check_aggregate may be Python code) before any revision or state. The run handed to run()
 * then ends there. Event hashes are computed with the same calls as
 * messages.event_hash_of_fields and payload_hash_of (the sorted encoder's encode_into, into two
 * buffers kept for the run, and one blake3 hasher reset after each hash); the Event's encoded size
 * (EVENT_BYTES_MAX) is added up from the parts hashed and the body's length (msgpack_size, which
 * walks the body without encoding it), instead of encoding the Event once more.
 * The fields are read with one astuple call (msgspec.structs.astuple). An Exception raised
 * by a call ends the run, as in _fully_valid_run (apply() then decides that Event); anything else
 * propagates.
 *
 * Why in C: the per-Event checks and bookkeeping cost about 2.6 us in Python, more than the
 * local commit's share, and full validation's Python calls around the hashing another 2 us
 * (docs/performance.md). Limited API (abi3, Python >= 3.11).
 */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <string.h>

#define AA_HASH_BYTES 32
#define AA_KEY_BYTES_MAX 1024 /* group + NUL + aggregate; longer goes to apply() */

static PyObject *s_aggregate, *s_revision, *s_state; /* an Effect's fields */

#define CR_FIELDS 16

/* The Event's fields in the order of its encoding, as astuple gives them (Event.__struct_fields__,
 * which tests/test_agent_check_run.py holds to this order); the first 11 are the hashed header. */
enum {
    F_GROUP, F_SEQ, F_EVENT_ID, F_KIND, F_AGGREGATE, F_REVISION, F_ACTOR, F_ACTION_ID, F_CONTENT_HASH,
    F_ACCEPTED_AT_MS, F_AUTHORITATIVE, F_BODY, F_EFFECTS, F_PAYLOAD_HASH, F_PREV_HASH, F_HASH,
};
#define CR_HEADER_FIELDS 11

typedef struct {
    PyObject *event_type, *effect_type, *group, *checked, *kind_ok, *id_ok, *astuple;
    Py_ssize_t checked_max;
    const char *group_utf8;
    Py_ssize_t group_size;
    const char *prefix;
    Py_ssize_t prefix_size;
} run_t;

#define AA_EFFECTS_HELD 8 /* effects whose aggregate and state the checks keep for the writes */

/* The fields of one Event that the writes need (new references), filled by take_event: its hash,
 * its effects and, for the first ``held`` of them, the aggregate and state the checks read (the
 * writes read them again only for an effect past AA_EFFECTS_HELD). */
typedef struct {
    PyObject *hash, *effects;
    PyObject *aggregates[AA_EFFECTS_HELD], *states[AA_EFFECTS_HELD];
    Py_ssize_t held;
} taken_t;

static void release_taken(taken_t *taken) {
    Py_CLEAR(taken->hash);
    Py_CLEAR(taken->effects);
    for (Py_ssize_t i = 0; i < taken->held; i++) {
        Py_DECREF(taken->aggregates[i]);
        Py_DECREF(taken->states[i]);
    }
    taken->held = 0;
}

static int is_exact_int(PyObject *value) {
    return PyLong_CheckExact(value);
}

/* 1 if ``attr`` of ``object`` satisfies ``check`` (the new reference stored in *out when out is
 * not NULL), 0 if not, -1 on a Python error. */
static int field(PyObject *object, PyObject *name, int (*check)(PyObject *), PyObject **out) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) return -1;
    int ok = check(value);
    if (ok && out != NULL) {
        *out = value;
        return 1;
    }
    Py_DECREF(value);
    return ok;
}

static int is_str(PyObject *value) { return PyUnicode_CheckExact(value); }
static int is_bool(PyObject *value) { return PyBool_Check(value); }
static int is_list(PyObject *value) { return PyList_CheckExact(value); }
static int is_dict_or_none(PyObject *value) { return value == Py_None || PyDict_CheckExact(value); }
static int is_hash(PyObject *value) { return PyBytes_CheckExact(value) && PyBytes_Size(value) == AA_HASH_BYTES; }

/* 1 if predicate(value) returned True, 0 if False, -1 on a Python error. */
static int holds(PyObject *predicate, PyObject *value) {
    PyObject *result = value == NULL ? NULL : PyObject_CallFunctionObjArgs(predicate, value, NULL);
    Py_XDECREF(value);
    if (result == NULL) return -1;
    int ok = result == Py_True;
    Py_DECREF(result);
    return ok;
}

/* A key not yet in ``checked``: 1 (and added to it, while it has room) if it is
 * "<kind>:<id>" with kind_ok(kind) and id_ok(id); 0 if not; -1 on a Python error. */
static int aggregate_ok(const run_t *run, PyObject *aggregate) {
    Py_ssize_t length = PyUnicode_GetLength(aggregate);
    if (length < 0) return -1;
    Py_ssize_t colon = PyUnicode_FindChar(aggregate, ':', 0, length, 1);
    if (colon == -2) return -1;
    if (colon < 0) return 0;
    int ok = holds(run->kind_ok, PyUnicode_Substring(aggregate, 0, colon));
    if (ok == 1) ok = holds(run->id_ok, PyUnicode_Substring(aggregate, colon + 1, length));
    if (ok == 1 && PySet_Size(run->checked) < run->checked_max && PySet_Add(run->checked, aggregate) < 0) return -1;
    return ok;
}

/* 1 if the effect is an effect_type whose aggregate is a checked key and whose state is a dict
 * or None; 0 if not; -1 on a Python error. When it is 1 and ``taken`` has room, the aggregate and
 * state are kept in it (new references) for the writes. */
static int effect_ok(const run_t *run, PyObject *effect, taken_t *taken) {
    if ((PyObject *)Py_TYPE(effect) != run->effect_type) return 0;
    PyObject *aggregate = PyObject_GetAttr(effect, s_aggregate);
    if (aggregate == NULL) return -1;
    int ok = PyUnicode_CheckExact(aggregate) ? PySet_Contains(run->checked, aggregate) : 0;
    if (ok == 0 && PyUnicode_CheckExact(aggregate)) ok = aggregate_ok(run, aggregate);
    PyObject *state = NULL;
    if (ok == 1) ok = field(effect, s_state, is_dict_or_none, &state);
    if (ok == 1 && taken->held < AA_EFFECTS_HELD) {
        taken->aggregates[taken->held] = aggregate;
        taken->states[taken->held++] = state;
        return 1;
    }
    Py_XDECREF(state);
    Py_DECREF(aggregate);
    return ok;
}

/* The decimal digits of a positive ``value`` in ``out`` (no terminator); their count. */
static int decimal(long long value, char *out) {
    char reversed[24];
    int count = 0;
    do {
        reversed[count++] = (char)('0' + value % 10);
        value /= 10;
    } while (value > 0);
    for (int i = 0; i < count; i++) out[i] = reversed[count - 1 - i];
    return count;
}

/* take_event's checks of the fields ``fields`` (astuple's result, held by the caller): 1, 0 or -1. */
static int take_fields(const run_t *run, PyObject *fields, long long seq, const unsigned char *prev, taken_t *taken) {
    if (!PyTuple_CheckExact(fields) || PyTuple_Size(fields) != CR_FIELDS) return 0;
    PyObject *f[CR_FIELDS]; /* borrowed */
    for (int k = 0; k < CR_FIELDS; k++) f[k] = PyTuple_GetItem(fields, k);
    if (!is_str(f[F_GROUP])) return 0;
    int ok = f[F_GROUP] == run->group || PyUnicode_Compare(f[F_GROUP], run->group) == 0;
    if (!ok) return PyErr_Occurred() ? -1 : 0;

    if (!is_exact_int(f[F_SEQ])) return 0;
    int overflow = 0;
    long long got = PyLong_AsLongLongAndOverflow(f[F_SEQ], &overflow);
    if (got == -1 && PyErr_Occurred()) return -1;
    if (overflow || got != seq) return 0;

    if (!is_str(f[F_EVENT_ID])) return 0;
    Py_ssize_t id_size = 0;
    const char *id = PyUnicode_AsUTF8AndSize(f[F_EVENT_ID], &id_size);
    if (id == NULL) {
        PyErr_Clear(); /* not encodable: apply() names the problem */
        return 0;
    }
    char digits[24];
    int digit_count = decimal(seq, digits);
    if (id_size != run->group_size + 1 + digit_count || memcmp(id, run->group_utf8, (size_t)run->group_size) != 0 ||
        id[run->group_size] != ':' || memcmp(id + run->group_size + 1, digits, (size_t)digit_count) != 0)
        return 0;

    if (!is_hash(f[F_PREV_HASH]) || memcmp(PyBytes_AsString(f[F_PREV_HASH]), prev, AA_HASH_BYTES) != 0) return 0;
    if (!is_str(f[F_KIND]) || !is_str(f[F_AGGREGATE]) || !is_exact_int(f[F_REVISION]) ||
        !is_exact_int(f[F_ACCEPTED_AT_MS]) || !is_bool(f[F_AUTHORITATIVE]) || !is_dict_or_none(f[F_BODY]) ||
        !is_list(f[F_EFFECTS]))
        return 0;

    PyObject *effects = f[F_EFFECTS]; /* the caller's tuple holds it while kind_ok/id_ok run */
    for (Py_ssize_t i = 0; i < PyList_Size(effects); i++) { /* kind_ok/id_ok may be Python code */
        PyObject *effect = PyList_GetItem(effects, i);
        Py_XINCREF(effect);
        ok = effect == NULL ? -1 : effect_ok(run, effect, taken);
        Py_XDECREF(effect);
        if (ok != 1) return ok;
    }
    return is_hash(f[F_HASH]);
}

/* 1 if ``event`` is the plain next Event (see the top of the file), with its hash and effects in
 * *taken; 0 if apply() must decide it; -1 on a Python error. Its fields are read with one
 * astuple call (a frozen Struct: no code runs to read a field) and checked in their order. */
static int take_event(const run_t *run, PyObject *event, long long seq, const unsigned char *prev, taken_t *taken) {
    if ((PyObject *)Py_TYPE(event) != run->event_type) return 0;
    PyObject *fields = PyObject_CallFunctionObjArgs(run->astuple, event, NULL);
    if (fields == NULL) return -1;
    int ok = take_fields(run, fields, seq, prev, taken);
    if (ok == 1) {
        taken->hash = PyTuple_GetItem(fields, F_HASH);
        taken->effects = PyTuple_GetItem(fields, F_EFFECTS);
        Py_INCREF(taken->hash);
        Py_INCREF(taken->effects);
    } else {
        release_taken(taken);
    }
    Py_DECREF(fields);
    return ok;
}

/* prefix + tail as a new bytes object; NULL with a Python error on failure. */
static PyObject *prefixed(const run_t *run, const char *tail, Py_ssize_t tail_size) {
    PyObject *key = PyBytes_FromStringAndSize(NULL, run->prefix_size + tail_size);
    if (key == NULL) return NULL;
    char *out = PyBytes_AsString(key);
    memcpy(out, run->prefix, (size_t)run->prefix_size);
    memcpy(out + run->prefix_size, tail, (size_t)tail_size);
    return key;
}

/* The built-in projection's writes for one taken Event; -1 with a Python error on failure. */
static int write_event(const run_t *run, long long seq, const taken_t *taken, PyObject *inbox, PyObject *states) {
    unsigned char be[8];
    for (int i = 0; i < 8; i++) be[i] = (unsigned char)((unsigned long long)seq >> (56 - 8 * i));
    PyObject *key = prefixed(run, (const char *)be, 8);
    if (key == NULL) return -1;
    int failed = PyDict_SetItem(inbox, key, taken->hash);
    Py_DECREF(key);
    if (failed) return -1;
    Py_ssize_t count = PyList_Size(taken->effects); /* no Python code runs from here on */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *effect = PyList_GetItem(taken->effects, i); /* borrowed */
        if (effect == NULL) return -1;
        PyObject *aggregate, *state;
        if (i < taken->held) { /* read by the checks */
            aggregate = taken->aggregates[i];
            state = taken->states[i];
            Py_INCREF(aggregate);
            Py_INCREF(state);
        } else {
            aggregate = PyObject_GetAttr(effect, s_aggregate);
            state = aggregate == NULL ? NULL : PyObject_GetAttr(effect, s_state);
        }
        PyObject *revision = state == NULL ? NULL : PyObject_GetAttr(effect, s_revision);
        Py_ssize_t size = 0;
        const char *utf8 = revision == NULL ? NULL : PyUnicode_AsUTF8AndSize(aggregate, &size);
        PyObject *entry_key = utf8 == NULL ? NULL : prefixed(run, utf8, size);
        PyObject *entry = entry_key == NULL ? NULL : PyTuple_Pack(2, revision, state);
        failed = entry == NULL || PyDict_SetItem(states, entry_key, entry) < 0;
        Py_XDECREF(entry);
        Py_XDECREF(entry_key);
        Py_XDECREF(state);
        Py_XDECREF(revision);
        Py_XDECREF(aggregate);
        if (failed) return -1;
    }
    return 0;
}

/* The run's ``start`` and ``next_seq`` arguments: 1 with them in *start and *seq; 0 when
 * ``next_seq`` is beyond what a long long holds (the caller takes nothing: apply() decides
 * those Events); -1 with a Python error when either is negative, zero (``next_seq``) or not an
 * int. Runs stop after the Event at LLONG_MAX, so a sequence never wraps. */
static int run_bounds(const char *name, PyObject *start_arg, PyObject *seq_arg, Py_ssize_t *start, long long *seq) {
    *start = PyLong_AsSsize_t(start_arg);
    if (*start == -1 && PyErr_Occurred()) return -1;
    int overflow = 0;
    *seq = PyLong_AsLongLongAndOverflow(seq_arg, &overflow);
    if (*seq == -1 && PyErr_Occurred()) return -1;
    if (*start < 0 || overflow < 0 || (overflow == 0 && *seq < 1)) {
        PyErr_Format(PyExc_ValueError, "%s: start must be >= 0 and next_seq positive", name);
        return -1;
    }
    return overflow == 0;
}

static PyObject *aa_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "run takes (events, start, context, group, prefix, next_seq, prev_hash, inbox_writes, "
                        "state_writes, writes_max)");
        return NULL;
    }
    PyObject *events = args[0], *context = args[2], *inbox = args[7], *states = args[8];
    if (!PyTuple_CheckExact(context) || PyTuple_Size(context) != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "run: context is (event_type, effect_type, checked, checked_max, kind_ok, id_ok, astuple)");
        return NULL;
    }
    run_t run = {
        .event_type = PyTuple_GetItem(context, 0),
        .effect_type = PyTuple_GetItem(context, 1),
        .checked = PyTuple_GetItem(context, 2),
        .kind_ok = PyTuple_GetItem(context, 4),
        .id_ok = PyTuple_GetItem(context, 5),
        .astuple = PyTuple_GetItem(context, 6),
        .group = args[3],
    };
    if (!PyList_CheckExact(events) || !PyType_Check(run.event_type) || !PyType_Check(run.effect_type) ||
        !PySet_CheckExact(run.checked) || !PyCallable_Check(run.kind_ok) || !PyCallable_Check(run.id_ok) ||
        !PyCallable_Check(run.astuple) ||
        !PyUnicode_CheckExact(run.group) || !PyBytes_CheckExact(args[4]) || !PyBytes_CheckExact(args[6]) ||
        PyBytes_Size(args[6]) != AA_HASH_BYTES || !PyDict_CheckExact(inbox) || !PyDict_CheckExact(states)) {
        PyErr_SetString(PyExc_TypeError, "run: an argument has the wrong type");
        return NULL;
    }
    Py_ssize_t writes_max = PyLong_AsSsize_t(args[9]);
    if (writes_max == -1 && PyErr_Occurred()) return NULL;
    run.checked_max = PyLong_AsSsize_t(PyTuple_GetItem(context, 3));
    if (run.checked_max == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = 0;
    long long seq = 0;
    int bounded = run_bounds("run", args[1], args[5], &start, &seq);
    if (bounded < 0) return NULL;
    if (bounded == 0) return PyLong_FromSsize_t(start);
    run.group_utf8 = PyUnicode_AsUTF8AndSize(run.group, &run.group_size);
    if (run.group_utf8 == NULL) return NULL;
    run.prefix = PyBytes_AsString(args[4]);
    run.prefix_size = PyBytes_Size(args[4]);
    if (run.prefix_size > AA_KEY_BYTES_MAX) return PyLong_FromSsize_t(start);

    unsigned char prev[AA_HASH_BYTES];
    memcpy(prev, PyBytes_AsString(args[6]), AA_HASH_BYTES);
    Py_ssize_t i = start;
    for (; i < PyList_Size(events); i++, seq++) {
        taken_t taken = {.hash = NULL, .effects = NULL, .held = 0};
        PyObject *event = PyList_GetItem(events, i);
        if (event == NULL) return NULL;
        Py_INCREF(event); /* held: kind_ok and id_ok may be Python code that changes the list */
        int ok = take_event(&run, event, seq, prev, &taken);
        Py_DECREF(event);
        if (ok < 0) return NULL;
        if (ok == 0) break;
        int failed = write_event(&run, seq, &taken, inbox, states);
        if (!failed) memcpy(prev, PyBytes_AsString(taken.hash), AA_HASH_BYTES);
        release_taken(&taken);
        if (failed) return NULL;
        if (PyDict_Size(inbox) + PyDict_Size(states) >= writes_max || seq == LLONG_MAX) {
            i++;
            break;
        }
    }
    return PyLong_FromSsize_t(i);
}

/* -- check_run: full validation of a run, for verify="full" ------------------------------------ */

/* What check_run needs besides the Events (see the top of the file). Borrowed from the context. */
typedef struct {
    PyObject *event_type, *effect_type, *checked, *check_aggregate, *encode_into, *canonical_bytes,
        *blake3, *domain_payload, *domain_event, *content_ok, *id_ok, *kind_ok, *astuple, *group;
    Py_ssize_t event_bytes_max;
    /* Made for the run (new references). One blake3 hasher, its bound update, digest and reset:
     * fed, read and reset for each hash, which costs less than constructing a hasher each time.
     * Two bytearrays that encode_into writes: ``scratch`` the effects (and the body, for its size
     * only, when msgpack_size cannot tell it); ``chained`` what the Event hash covers, the domain
     * prefix (written once), the previous hash, the header (written at the offset after both), the
     * effects' digest and the payload hash. Any error ends the run, so nothing left half-fed is
     * used again. */
    PyObject *update, *digest, *reset, *scratch, *chained;
} check_t;

static PyObject *s_digest, *s_update, *s_reset;

/* 1 if predicate(value) returned True, 0 if anything else, -1 on a Python error; borrows value. */
static int answers_true(PyObject *predicate, PyObject *value) {
    PyObject *result = PyObject_CallFunctionObjArgs(predicate, value, NULL);
    if (result == NULL) return -1;
    int ok = result == Py_True;
    Py_DECREF(result);
    return ok;
}

/* blake3 of ``parts`` one after the other (their join), as a new bytes object, with the run's
 * hasher (reset after); NULL with a Python error on failure. One part may be any buffer (the
 * run's bytearrays); two or more must be bytes objects. */
static PyObject *blake3_of(const check_t *check, PyObject *const *parts, int count) {
    PyObject *joined = parts[0];
    Py_INCREF(joined);
    if (count > 1) { /* one update of the join costs less than an update per part */
        Py_DECREF(joined);
        Py_ssize_t total = 0;
        for (int i = 0; i < count; i++) total += PyBytes_Size(parts[i]);
        joined = PyBytes_FromStringAndSize(NULL, total);
        if (joined == NULL) return NULL;
        char *out = PyBytes_AsString(joined);
        for (int i = 0; i < count; i++) {
            Py_ssize_t size = PyBytes_Size(parts[i]);
            memcpy(out, PyBytes_AsString(parts[i]), (size_t)size);
            out += size;
        }
    }
    PyObject *result = PyObject_CallFunctionObjArgs(check->update, joined, NULL);
    Py_DECREF(joined);
    if (result == NULL) return NULL;
    Py_DECREF(result);
    PyObject *digest = PyObject_CallFunctionObjArgs(check->digest, NULL);
    if (digest == NULL) return NULL;
    result = PyObject_CallFunctionObjArgs(check->reset, NULL);
    if (result == NULL) {
        Py_DECREF(digest);
        return NULL;
    }
    Py_DECREF(result);
    return digest;
}

/* 1 if ``digest`` (a new reference, consumed; NULL after a failed call) is the bytes ``expected``
 * (a 32-byte bytes object), 0 if not, -1 on a Python error. */
static int digest_is(PyObject *digest, PyObject *expected) {
    if (digest == NULL) return -1;
    int ok = PyBytes_CheckExact(digest) && PyBytes_Size(digest) == AA_HASH_BYTES &&
             memcmp(PyBytes_AsString(digest), PyBytes_AsString(expected), AA_HASH_BYTES) == 0;
    Py_DECREF(digest);
    return ok;
}

/* encode_into(value, buffer, offset): 1 when it wrote the encoding of ``value`` at ``offset`` of
 * the bytearray ``buffer`` (which then ends there), -1 on a Python error. */
static int encoded_into(const check_t *check, PyObject *value, PyObject *buffer, Py_ssize_t offset) {
    PyObject *at = PyLong_FromSsize_t(offset);
    PyObject *result = at == NULL ? NULL : PyObject_CallFunctionObjArgs(check->encode_into, value, buffer, at, NULL);
    Py_XDECREF(at);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 1;
}

/* The bytes of a msgpack head for a length ``count`` of a kind whose fixed form holds up to
 * ``fixed_max`` (-1 when it has none) and whose 8-bit form exists when ``has_8``: 1, 2, 3 or 5. */
static Py_ssize_t head_bytes(Py_ssize_t count, Py_ssize_t fixed_max, int has_8) {
    if (count <= fixed_max) return 1;
    if (has_8 && count <= 0xff) return 2;
    return count <= 0xffff ? 3 : 5;
}

#define MS_DEPTH_MAX 64 /* deeper than content_ok lets through (BODY_DEPTH_MAX 32) */

/* The length of the sorted encoder's msgpack for ``value`` (encode_into's, without encoding it:
 * key order does not change a length), for the values content may hold and exact bytes: None,
 * bool, int within a long long, float (always float64), str, bytes, list, tuple and dict with str
 * keys, each of exactly that type; the smallest form of each int and head, as msgspec writes
 * them. -1 (no Python error left) for anything else, a str with no UTF-8 (a lone surrogate) or
 * deeper than MS_DEPTH_MAX: the caller encodes that value instead. tests/test_agent_check_run.py
 * holds it to len(encode(value)) over arbitrary values and at every width boundary. */
static Py_ssize_t msgpack_size(PyObject *value, int depth) {
    if (depth > MS_DEPTH_MAX) return -1;
    if (value == Py_None || PyBool_Check(value)) return 1;
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || (number == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1; /* above 2**63 - 1 or below -2**63: content never holds them */
        }
        if (number >= 0)
            return number < 0x80 ? 1 : number <= 0xff ? 2 : number <= 0xffff ? 3 : number <= 0xffffffffLL ? 5 : 9;
        return number >= -32 ? 1 : number >= -0x80 ? 2 : number >= -0x8000 ? 3 : number >= -0x80000000LL ? 5 : 9;
    }
    if (PyFloat_CheckExact(value)) return 9;
    if (PyUnicode_CheckExact(value)) {
        Py_ssize_t size = 0;
        if (PyUnicode_AsUTF8AndSize(value, &size) == NULL) {
            PyErr_Clear();
            return -1;
        }
        return head_bytes(size, 31, 1) + size;
    }
    if (PyBytes_CheckExact(value)) {
        Py_ssize_t size = PyBytes_Size(value);
        return head_bytes(size, -1, 1) + size;
    }
    int is_list = PyList_CheckExact(value);
    if (is_list || PyTuple_CheckExact(value)) {
        Py_ssize_t count = is_list ? PyList_Size(value) : PyTuple_Size(value);
        Py_ssize_t total = head_bytes(count, 15, 0);
        for (Py_ssize_t i = 0; i < count; i++) { /* no Python code runs here: the list stays as it is */
            Py_ssize_t item = msgpack_size(is_list ? PyList_GetItem(value, i) : PyTuple_GetItem(value, i), depth + 1);
            if (item < 0) return -1;
            total += item;
        }
        return total;
    }
    if (PyDict_CheckExact(value)) {
        Py_ssize_t total = head_bytes(PyDict_Size(value), 15, 0), position = 0;
        PyObject *key = NULL, *item = NULL;
        while (PyDict_Next(value, &position, &key, &item)) {
            if (!PyUnicode_CheckExact(key)) return -1;
            Py_ssize_t key_size = msgpack_size(key, depth + 1), item_size = msgpack_size(item, depth + 1);
            if (key_size < 0 || item_size < 0) return -1;
            total += key_size + item_size;
        }
        return total;
    }
    return -1;
}

/* One effect, in the order Python checks it. The first pass is _check_shape's: an effect_type
 * whose aggregate passes check_aggregate (the set ``checked`` answers for the keys it already
 * passed) and whose state is None or a dict. The second, made once every effect passed the
 * first, is check_event's: the revision is an int >= 1, a state passes content_ok. 1, 0 or -1. */
static int effect_valid(const check_t *check, PyObject *effect, int second_pass) {
    if ((PyObject *)Py_TYPE(effect) != check->effect_type) return 0;
    PyObject *aggregate = PyObject_GetAttr(effect, s_aggregate);
    PyObject *revision = aggregate == NULL ? NULL : PyObject_GetAttr(effect, s_revision);
    PyObject *state = revision == NULL ? NULL : PyObject_GetAttr(effect, s_state);
    int ok = state == NULL ? -1 : PyUnicode_CheckExact(aggregate) && (state == Py_None || PyDict_CheckExact(state));
    if (ok == 1 && !second_pass) {
        ok = PySet_Contains(check->checked, aggregate);
        if (ok == 0) { /* raises EventInvalid for a key it refuses: the run stops there */
            PyObject *result = PyObject_CallFunctionObjArgs(check->check_aggregate, aggregate, NULL);
            ok = result == NULL ? -1 : 1;
            Py_XDECREF(result);
        }
    }
    if (ok == 1 && second_pass) {
        ok = PyLong_CheckExact(revision);
        if (ok == 1) {
            int overflow = 0;
            long long number = PyLong_AsLongLongAndOverflow(revision, &overflow);
            if (number == -1 && PyErr_Occurred()) ok = -1;
            else ok = overflow > 0 || (overflow == 0 && number >= 1);
        }
        if (ok == 1 && state != Py_None) ok = answers_true(check->content_ok, state);
    }
    Py_XDECREF(state);
    Py_XDECREF(revision);
    Py_XDECREF(aggregate);
    return ok;
}

/* The checks of admit_event and check_event (see the top of the file) on an Event whose fields
 * are the tuple ``fields`` (held by the caller): 1 if it passes them all as ``group``'s Event
 * ``seq`` following ``prev``, 0 if not, -1 on a Python error. */
static int fields_valid(const check_t *check, PyObject *fields, long long seq, const unsigned char *prev) {
    PyObject *f[CR_FIELDS]; /* borrowed */
    for (int k = 0; k < CR_FIELDS; k++) f[k] = PyTuple_GetItem(fields, k);
    if (!PyUnicode_CheckExact(f[F_GROUP]) || !PyLong_CheckExact(f[F_SEQ]) || !PyUnicode_CheckExact(f[F_EVENT_ID]) ||
        !PyUnicode_CheckExact(f[F_KIND]) || !PyUnicode_CheckExact(f[F_AGGREGATE]) || !PyLong_CheckExact(f[F_REVISION]) ||
        !PyLong_CheckExact(f[F_ACCEPTED_AT_MS]) || !PyBool_Check(f[F_AUTHORITATIVE]) || !PyList_CheckExact(f[F_EFFECTS]) ||
        !(f[F_BODY] == Py_None || PyDict_CheckExact(f[F_BODY])) || !is_hash(f[F_CONTENT_HASH]) ||
        !is_hash(f[F_PAYLOAD_HASH]) || !is_hash(f[F_PREV_HASH]) || !is_hash(f[F_HASH]))
        return 0;
    int ok = f[F_GROUP] == check->group || PyUnicode_Compare(f[F_GROUP], check->group) == 0;
    if (!ok) return PyErr_Occurred() ? -1 : 0;
    int overflow = 0;
    long long got = PyLong_AsLongLongAndOverflow(f[F_SEQ], &overflow);
    if (got == -1 && PyErr_Occurred()) return -1;
    if (overflow || got != seq) return 0;
    char expected_id[24 + 1];
    int digit_count = decimal(seq, expected_id);
    Py_ssize_t id_size = 0, group_size = 0;
    const char *id = PyUnicode_AsUTF8AndSize(f[F_EVENT_ID], &id_size);
    const char *group = id == NULL ? NULL : PyUnicode_AsUTF8AndSize(check->group, &group_size);
    if (group == NULL) return -1;
    if (id_size != group_size + 1 + digit_count || memcmp(id, group, (size_t)group_size) != 0 || id[group_size] != ':' ||
        memcmp(id + group_size + 1, expected_id, (size_t)digit_count) != 0)
        return 0;
    if (memcmp(PyBytes_AsString(f[F_PREV_HASH]), prev, AA_HASH_BYTES) != 0) return 0;
    if ((ok = answers_true(check->id_ok, f[F_ACTOR])) != 1) return ok;
    if ((ok = answers_true(check->id_ok, f[F_ACTION_ID])) != 1) return ok;
    if ((ok = answers_true(check->kind_ok, f[F_KIND])) != 1) return ok;

    PyObject *effects = f[F_EFFECTS];
    for (int second_pass = 0; second_pass <= 1; second_pass++) {
        for (Py_ssize_t i = 0; i < PyList_Size(effects); i++) {
            PyObject *effect = PyList_GetItem(effects, i);
            if (effect == NULL) return -1;
            Py_INCREF(effect); /* held: check_aggregate is Python code */
            ok = effect_valid(check, effect, second_pass);
            Py_DECREF(effect);
            if (ok != 1) return ok;
        }
    }

    /* The Event's encoded size, from the parts hashed below: it is an array16 of its 16 fields,
     * the 11 header fields as encoded in the hashed header (a fixarray, less its 1-byte head),
     * then body (its msgpack_size), effects and three 32-byte bin8 hashes. Once the body and
     * states are content_ok, the sorted encoder and encode_event give their parts the same bytes
     * but for the order of map entries (tests/test_agent_check_run.py meets the limit at the same
     * byte). */
    Py_ssize_t size = 3 + 3 * (2 + AA_HASH_BYTES);

    PyObject *payload_hash = f[F_PAYLOAD_HASH];
    if (f[F_BODY] == Py_None) {
        size += 1;
    } else {
        if ((ok = answers_true(check->content_ok, f[F_BODY])) != 1) return ok;
        Py_ssize_t body_size = msgpack_size(f[F_BODY], 0); /* it is not hashed: its length is enough */
        if (body_size < 0) {
            if ((ok = encoded_into(check, f[F_BODY], check->scratch, 0)) != 1) return ok;
            body_size = PyByteArray_Size(check->scratch);
        }
        size += body_size;
        PyObject *canonical = PyObject_CallFunctionObjArgs(check->canonical_bytes, f[F_BODY], NULL);
        if (canonical == NULL) return -1;
        if (!PyBytes_CheckExact(canonical)) {
            Py_DECREF(canonical);
            return 0;
        }
        PyObject *parts[2] = {check->domain_payload, canonical};
        ok = digest_is(blake3_of(check, parts, 2), payload_hash);
        Py_DECREF(canonical);
        if (ok != 1) return ok;
    }

    PyObject *header = PyTuple_GetSlice(fields, 0, CR_HEADER_FIELDS);
    if (header == NULL) return -1;
    Py_ssize_t head = PyBytes_Size(check->domain_event) + AA_HASH_BYTES;
    ok = encoded_into(check, header, check->chained, head);
    Py_DECREF(header);
    if (ok != 1) return ok;
    Py_ssize_t header_size = PyByteArray_Size(check->chained) - head;
    /* a fixarray of 11: its head is the one byte 0x9b */
    if (header_size < 1 || (unsigned char)PyByteArray_AsString(check->chained)[head] != 0x9b) return 0;
    if ((ok = encoded_into(check, effects, check->scratch, 0)) != 1) return ok;
    size += header_size - 1 + PyByteArray_Size(check->scratch);
    if (size > check->event_bytes_max) return 0;
    PyObject *effects_digest = blake3_of(check, &check->scratch, 1);
    if (effects_digest == NULL) return -1;
    ok = is_hash(effects_digest);
    if (ok == 1) ok = PyByteArray_Resize(check->chained, head + header_size + 2 * AA_HASH_BYTES) < 0 ? -1 : 1;
    if (ok == 1) {
        char *out = PyByteArray_AsString(check->chained);
        memcpy(out + head - AA_HASH_BYTES, PyBytes_AsString(f[F_PREV_HASH]), AA_HASH_BYTES);
        memcpy(out + head + header_size, PyBytes_AsString(effects_digest), AA_HASH_BYTES);
        memcpy(out + head + header_size + AA_HASH_BYTES, PyBytes_AsString(payload_hash), AA_HASH_BYTES);
        ok = digest_is(blake3_of(check, &check->chained, 1), f[F_HASH]);
    }
    Py_DECREF(effects_digest);
    return ok;
}

static PyObject *check_events(const check_t *check, PyObject *events, Py_ssize_t start, long long seq,
                              const char *prev_hash);

static PyObject *aa_check_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "check_run takes (events, start, context, group, next_seq, prev_hash)");
        return NULL;
    }
    PyObject *events = args[0], *context = args[2];
    if (!PyTuple_CheckExact(context) || PyTuple_Size(context) != 14) {
        PyErr_SetString(PyExc_TypeError,
                        "check_run: context is (event_type, effect_type, checked, check_aggregate, encode_into, "
                        "canonical_bytes, blake3, domain_payload, domain_event, content_ok, id_ok, kind_ok, "
                        "event_bytes_max, astuple)");
        return NULL;
    }
    check_t check = {
        .event_type = PyTuple_GetItem(context, 0),
        .effect_type = PyTuple_GetItem(context, 1),
        .checked = PyTuple_GetItem(context, 2),
        .check_aggregate = PyTuple_GetItem(context, 3),
        .encode_into = PyTuple_GetItem(context, 4),
        .canonical_bytes = PyTuple_GetItem(context, 5),
        .blake3 = PyTuple_GetItem(context, 6),
        .domain_payload = PyTuple_GetItem(context, 7),
        .domain_event = PyTuple_GetItem(context, 8),
        .content_ok = PyTuple_GetItem(context, 9),
        .id_ok = PyTuple_GetItem(context, 10),
        .kind_ok = PyTuple_GetItem(context, 11),
        .astuple = PyTuple_GetItem(context, 13),
        .group = args[3],
    };
    if (!PyList_CheckExact(events) || !PyType_Check(check.event_type) || !PyType_Check(check.effect_type) ||
        !PySet_CheckExact(check.checked) || !PyCallable_Check(check.check_aggregate) ||
        !PyCallable_Check(check.encode_into) || !PyCallable_Check(check.canonical_bytes) ||
        !PyCallable_Check(check.blake3) || !PyBytes_CheckExact(check.domain_payload) ||
        !PyBytes_CheckExact(check.domain_event) || !PyCallable_Check(check.content_ok) ||
        !PyCallable_Check(check.id_ok) || !PyCallable_Check(check.kind_ok) || !PyCallable_Check(check.astuple) ||
        !PyUnicode_CheckExact(check.group) || !PyBytes_CheckExact(args[5]) || PyBytes_Size(args[5]) != AA_HASH_BYTES) {
        PyErr_SetString(PyExc_TypeError, "check_run: an argument has the wrong type");
        return NULL;
    }
    check.event_bytes_max = PyLong_AsSsize_t(PyTuple_GetItem(context, 12));
    if (check.event_bytes_max == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = 0;
    long long seq = 0;
    int bounded = run_bounds("check_run", args[1], args[4], &start, &seq);
    if (bounded < 0) return NULL;
    if (bounded == 0) return PyLong_FromSsize_t(start);

    PyObject *hasher = PyObject_CallNoArgs(check.blake3);
    if (hasher != NULL) {
        check.update = PyObject_GetAttr(hasher, s_update);
        check.digest = check.update == NULL ? NULL : PyObject_GetAttr(hasher, s_digest);
        check.reset = check.digest == NULL ? NULL : PyObject_GetAttr(hasher, s_reset);
        Py_DECREF(hasher);
    }
    Py_ssize_t domain_size = PyBytes_Size(check.domain_event);
    check.scratch = check.reset == NULL ? NULL : PyByteArray_FromStringAndSize(NULL, 0);
    check.chained = check.scratch == NULL ? NULL : PyByteArray_FromStringAndSize(NULL, domain_size + AA_HASH_BYTES);
    PyObject *end = NULL;
    if (check.chained != NULL) {
        memcpy(PyByteArray_AsString(check.chained), PyBytes_AsString(check.domain_event), (size_t)domain_size);
        end = check_events(&check, events, start, seq, PyBytes_AsString(args[5]));
    } else if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear(); /* as a failed call within the run: the run ends, apply() decides */
        end = PyLong_FromSsize_t(start);
    }
    Py_XDECREF(check.chained);
    Py_XDECREF(check.scratch);
    Py_XDECREF(check.reset);
    Py_XDECREF(check.digest);
    Py_XDECREF(check.update);
    return end;
}

/* check_run's loop over events[start:] from sequence ``seq`` after the hash ``prev_hash``. */
static PyObject *check_events(const check_t *check, PyObject *events, Py_ssize_t start, long long seq,
                              const char *prev_hash) {
    unsigned char prev[AA_HASH_BYTES];
    memcpy(prev, prev_hash, AA_HASH_BYTES);
    Py_ssize_t i = start;
    for (; i < PyList_Size(events); i++, seq++) {
        PyObject *event = PyList_GetItem(events, i);
        if (event == NULL) return NULL;
        if ((PyObject *)Py_TYPE(event) != check->event_type) break;
        Py_INCREF(event); /* held: check_aggregate is Python code that could change the list */
        PyObject *fields = PyObject_CallFunctionObjArgs(check->astuple, event, NULL); /* one call, not 16 reads */
        int ok = fields == NULL ? -1 : PyTuple_CheckExact(fields) && PyTuple_Size(fields) == CR_FIELDS;
        if (ok == 1) ok = fields_valid(check, fields, seq, prev);
        if (ok == 1) memcpy(prev, PyBytes_AsString(PyTuple_GetItem(fields, F_HASH)), AA_HASH_BYTES);
        Py_XDECREF(fields);
        Py_DECREF(event);
        if (ok == 1 && seq == LLONG_MAX) {
            i++;
            break;
        }
        if (ok == 1) continue;
        /* An Exception (a refused aggregate key's EventInvalid, an encoder's TypeError, even
         * MemoryError) only ends the run, as in _fully_valid_run: apply() decides that Event. */
        if (ok < 0 && !PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyErr_Clear();
        break;
    }
    return PyLong_FromSsize_t(i);
}

/* msgpack_size(value) -> int | None: msgpack_size's answer, for the tests that hold it to
 * msgspec's encoding (None where it cannot tell). */
static PyObject *aa_msgpack_size(PyObject *module, PyObject *value) {
    (void)module;
    Py_ssize_t size = msgpack_size(value, 0);
    if (size < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(size);
}

static PyMethodDef aa_methods[] = {
    {"run", (PyCFunction)(void (*)(void))aa_run, METH_FASTCALL,
     "run(events, start, context, group, prefix, next_seq, prev_hash, inbox_writes, state_writes, writes_max) -> "
     "stop; see csrc/agent_apply.c."},
    {"check_run", (PyCFunction)(void (*)(void))aa_check_run, METH_FASTCALL,
     "check_run(events, start, context, group, next_seq, prev_hash) -> end; see csrc/agent_apply.c."},
    {"msgpack_size", (PyCFunction)(void (*)(void))aa_msgpack_size, METH_O,
     "msgpack_size(value) -> the length of value's msgpack, or None; see csrc/agent_apply.c."},
    {NULL, NULL, 0, NULL},
};

static int intern(PyObject **slot, const char *name) {
    if (*slot == NULL) *slot = PyUnicode_InternFromString(name);
    return *slot == NULL ? -1 : 0;
}

static int aa_exec(PyObject *module) {
    (void)module;
    if (intern(&s_aggregate, "aggregate") < 0 || intern(&s_revision, "revision") < 0 || intern(&s_state, "state") < 0 ||
        intern(&s_digest, "digest") < 0 || intern(&s_update, "update") < 0 || intern(&s_reset, "reset") < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot aa_slots[] = {
    {Py_mod_exec, (void *)aa_exec},
    {0, NULL},
};

static struct PyModuleDef aa_module = {
    PyModuleDef_HEAD_INIT,
    "mwpstore._apply_c",
    "The AgentStore's in-order apply runs and full-validation checks (see csrc/agent_apply.c).",
    0,
    aa_methods,
    aa_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__apply_c(void) {
    return PyModuleDef_Init(&aa_module);
}
