/*
 * Fast yes/no checks of canonical content and IDs, and the one-pass check of a snapshot's rows
 * (rows_check, at the end): the module mwpstore._canonical_c.
 *
 * The rules are those of docs/format/canonical.md, implemented in Python by mwpstore/canonical.py.
 * Every function here answers True only when the Python rules accept the value; it never raises
 * for bad data. On False the caller runs the Python check, which names the offending field in its
 * typed error, so the errors stay where they are written down. tests/test_canonical.py checks that
 * these answers equal the Python fast check's on generated content, and that the bounds below equal
 * mwpstore/limits.py.
 *
 * This is a CPython extension (not cffi) because it walks Python objects (dict, list, str, int,
 * float): no Python code runs during a walk (no __eq__, no __hash__, no iteration protocol), so the
 * borrowed references it reads stay valid. The limited API (abi3, Python >= 3.11) is used.
 */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* Bounds: the same numbers as mwpstore/limits.py (tests/test_canonical.py compares them). */
#define CC_BODY_DEPTH_MAX 32                  /* nesting levels below the top value */
#define CC_BODY_ITEMS_MAX 100000              /* values in one piece of content, all levels */
#define CC_STRING_CHARS_MAX (1024 * 1024)     /* code points in one string (STRING_BYTES_MAX) */
#define CC_INT_ABS_MAX LLONG_MAX              /* 2**63 - 1: integers in [-(2**63 - 1), 2**63 - 1] */
#define CC_ID_CHARS_MAX 128
#define CC_KIND_CHARS_MAX 64

_Static_assert(LLONG_MAX == 9223372036854775807LL, "INT_ABS_MAX is 2**63 - 1");

/* Always on (not removed by NDEBUG): a failed assertion is a bug in this file. */
#define CC_ASSERT(condition)                                                                   \
    do {                                                                                       \
        if (!(condition)) {                                                                    \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #condition); \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

/* An exact str of at most CC_STRING_CHARS_MAX code points that UTF-8 can encode (no lone
 * surrogate: canonical bytes are UTF-8, and the encoder would fail on it later). */
static int string_ok(PyObject *value) {
    Py_ssize_t chars = PyUnicode_GetLength(value);
    CC_ASSERT(chars >= 0); /* an exact str always has a length */
    if (chars > CC_STRING_CHARS_MAX) {
        return 0;
    }
    Py_ssize_t size = 0;
    if (PyUnicode_AsUTF8AndSize(value, &size) == NULL) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int int_ok(PyObject *value) {
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    CC_ASSERT(!(number == -1 && PyErr_Occurred())); /* an exact int never fails, it overflows */
    return overflow == 0 && number >= -CC_INT_ABS_MAX;
}

/*
 * canonical._content_ok, step for step: 1 when every rule holds, else 0. ``budget`` counts the
 * values still allowed. Like the Python fast check, a str or int directly inside a dict is counted
 * and checked there, without a call of its own; a dict at the deepest level may hold nothing,
 * since its items would lie one level deeper.
 */
static int content_ok(PyObject *value, int depth, Py_ssize_t *budget) {
    CC_ASSERT(depth >= 0 && depth <= CC_BODY_DEPTH_MAX + 1); /* the recursion is bounded below */
    if (depth > CC_BODY_DEPTH_MAX) {
        return 0;
    }
    *budget -= 1;
    if (*budget < 0) {
        return 0;
    }
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyUnicode_Type) {
        return string_ok(value);
    }
    if (type == &PyLong_Type) {
        return int_ok(value);
    }
    if (type == &PyBool_Type || value == Py_None) {
        return 1;
    }
    if (type == &PyDict_Type) {
        if (depth >= CC_BODY_DEPTH_MAX && PyDict_Size(value) > 0) {
            return 0;
        }
        Py_ssize_t position = 0;
        PyObject *key = NULL;
        PyObject *item = NULL;
        while (PyDict_Next(value, &position, &key, &item)) {
            if (Py_TYPE(key) != &PyUnicode_Type || !string_ok(key)) {
                return 0;
            }
            PyTypeObject *item_type = Py_TYPE(item);
            if (item_type == &PyUnicode_Type) {
                *budget -= 1;
                if (!string_ok(item)) {
                    return 0;
                }
            } else if (item_type == &PyLong_Type) {
                *budget -= 1;
                if (!int_ok(item)) {
                    return 0;
                }
            } else if (!content_ok(item, depth + 1, budget)) {
                return 0;
            }
        }
        return *budget >= 0;
    }
    if (type == &PyList_Type) {
        for (Py_ssize_t index = 0; index < PyList_Size(value); index++) {
            PyObject *item = PyList_GetItem(value, index);
            CC_ASSERT(item != NULL);
            if (!content_ok(item, depth + 1, budget)) {
                return 0;
            }
        }
        return 1;
    }
    if (type == &PyTuple_Type) {
        for (Py_ssize_t index = 0; index < PyTuple_Size(value); index++) {
            PyObject *item = PyTuple_GetItem(value, index);
            CC_ASSERT(item != NULL);
            if (!content_ok(item, depth + 1, budget)) {
                return 0;
            }
        }
        return 1;
    }
    if (type == &PyFloat_Type) {
        return isfinite(PyFloat_AsDouble(value)) ? 1 : 0;
    }
    return 0;
}

static PyObject *cc_content_ok(PyObject *module, PyObject *value) {
    (void)module;
    Py_ssize_t budget = CC_BODY_ITEMS_MAX;
    if (content_ok(value, 0, &budget)) {
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* The ASCII bytes of an exact str of 1..chars_max code points, else NULL (no exception left). */
static const char *ascii_of(PyObject *value, Py_ssize_t chars_max, Py_ssize_t *length) {
    if (Py_TYPE(value) != &PyUnicode_Type) {
        return NULL;
    }
    Py_ssize_t chars = PyUnicode_GetLength(value);
    if (chars < 1 || chars > chars_max) {
        return NULL;
    }
    const char *data = PyUnicode_AsUTF8AndSize(value, length);
    if (data == NULL) { /* a lone surrogate has no UTF-8: not an ID either */
        PyErr_Clear();
        return NULL;
    }
    if (*length != chars) { /* a code point beyond ASCII took more than one byte */
        return NULL;
    }
    return data;
}

static int id_first_char(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}

static int id_char(char c) {
    return id_first_char(c) || c == '.' || c == '@' || c == '+' || c == '=' || c == '-';
}

/* canonical.check_id's rule: 1..ID_CHARS_MAX characters matching [A-Za-z0-9_][A-Za-z0-9_.@+=-]* */
static PyObject *cc_id_ok(PyObject *module, PyObject *value) {
    (void)module;
    Py_ssize_t length = 0;
    const char *data = ascii_of(value, CC_ID_CHARS_MAX, &length);
    if (data == NULL || !id_first_char(data[0])) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t index = 1; index < length; index++) {
        if (!id_char(data[index])) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* canonical.check_kind's rule: 1..KIND_CHARS_MAX characters matching
 * [a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)* */
static PyObject *cc_kind_ok(PyObject *module, PyObject *value) {
    (void)module;
    Py_ssize_t length = 0;
    const char *data = ascii_of(value, CC_KIND_CHARS_MAX, &length);
    if (data == NULL) {
        Py_RETURN_FALSE;
    }
    int at_part_start = 1;
    for (Py_ssize_t index = 0; index < length; index++) {
        char c = data[index];
        if (at_part_start) {
            if (!(c >= 'a' && c <= 'z')) {
                Py_RETURN_FALSE;
            }
            at_part_start = 0;
        } else if (c == '.') {
            at_part_start = 1;
        } else if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
            Py_RETURN_FALSE;
        }
    }
    if (at_part_start) { /* empty, or ends with '.' */
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* Problems rows_check can report, or-ed together (the same numbers as ROW_* in
 * mwpstore/snapshot.py, whose _row_problems is this function's definition in Python). */
#define CC_ROW_KEY_TYPE 1       /* a key that is not an exact str */
#define CC_ROW_UNORDERED 2      /* two neighbouring str keys not strictly increasing */
#define CC_ROW_FIRST_EMPTY 4    /* the first key is "" */
#define CC_ROW_REVISION_TYPE 8  /* a revision that is not an exact int */
#define CC_ROW_REVISION_LOW 16  /* an int revision below 1 */

/* Key (new reference) and revision (new reference) of one snapshot row: a 3-tuple, or an Effect
 * read through its attributes (a msgspec Struct's member descriptors: no Python code runs). */
static int row_parts(PyObject *row, int by_attribute, PyObject *key_name, PyObject *revision_name, PyObject **key,
                     PyObject **revision) {
    if (by_attribute) {
        *key = PyObject_GetAttr(row, key_name);
        if (*key == NULL) return -1;
        *revision = PyObject_GetAttr(row, revision_name);
        if (*revision == NULL) {
            Py_DECREF(*key);
            return -1;
        }
        return 0;
    }
    if (!PyTuple_Check(row) || PyTuple_Size(row) != 3) {
        PyErr_SetString(PyExc_TypeError, "rows must be 3-tuples");
        return -1;
    }
    *key = PyTuple_GetItem(row, 0);
    *revision = PyTuple_GetItem(row, 1);
    if (*key == NULL || *revision == NULL) return -1;
    Py_INCREF(*key);
    Py_INCREF(*revision);
    return 0;
}

/* rows_check(rows, by_attribute): one pass over a snapshot's rows (a list), reporting every kind
 * of problem found (CC_ROW_*; 0: keys are str, strictly increasing and the first non-empty, every
 * revision an int >= 1). Python's _checked_aggregates turns the report into its typed errors and
 * sorts rows that arrive out of order. */
static PyObject *cc_rows_check(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *rows;
    int by_attribute;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &rows, &by_attribute)) {
        return NULL;
    }
    PyObject *key_name = PyUnicode_InternFromString("aggregate");
    PyObject *revision_name = PyUnicode_InternFromString("revision");
    if (key_name == NULL || revision_name == NULL) {
        Py_XDECREF(key_name);
        Py_XDECREF(revision_name);
        return NULL;
    }
    long problems = 0;
    PyObject *previous = NULL; /* the previous row's key when it was a str (held) */
    PyObject *result = NULL;
    Py_ssize_t count = PyList_Size(rows);
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *row = PyList_GetItem(rows, index);
        PyObject *key, *revision;
        if (row == NULL || row_parts(row, by_attribute, key_name, revision_name, &key, &revision) < 0) {
            goto done;
        }
        if (!PyUnicode_CheckExact(key)) {
            problems |= CC_ROW_KEY_TYPE;
            Py_CLEAR(previous);
            Py_DECREF(key);
        } else {
            if (index == 0 && PyUnicode_GetLength(key) == 0) {
                problems |= CC_ROW_FIRST_EMPTY;
            }
            if (previous != NULL && PyUnicode_Compare(previous, key) >= 0) {
                problems |= CC_ROW_UNORDERED;
            }
            Py_XDECREF(previous);
            previous = key;
        }
        if (!PyLong_CheckExact(revision)) {
            problems |= CC_ROW_REVISION_TYPE;
        } else {
            int overflow = 0;
            long long value = PyLong_AsLongLongAndOverflow(revision, &overflow);
            if (overflow < 0 || (overflow == 0 && value < 1)) {
                problems |= CC_ROW_REVISION_LOW;
            }
        }
        Py_DECREF(revision);
    }
    result = PyLong_FromLong(problems);
done:
    Py_XDECREF(previous);
    Py_DECREF(key_name);
    Py_DECREF(revision_name);
    return result;
}

static PyMethodDef cc_methods[] = {
    {"content_ok", cc_content_ok, METH_O,
     "True when a value is canonical content (the rules of canonical.check_content); never raises."},
    {"id_ok", cc_id_ok, METH_O, "True when a value is a valid ID (canonical.check_id); never raises."},
    {"kind_ok", cc_kind_ok, METH_O, "True when a value is a valid kind (canonical.check_kind); never raises."},
    {"rows_check", cc_rows_check, METH_VARARGS,
     "rows_check(rows, by_attribute): the problems of a snapshot's rows, or-ed (mwpstore.snapshot._row_problems)."},
    {NULL, NULL, 0, NULL},
};

static int cc_exec(PyObject *module) {
    if (PyModule_AddIntConstant(module, "BODY_DEPTH_MAX", CC_BODY_DEPTH_MAX) < 0 ||
        PyModule_AddIntConstant(module, "BODY_ITEMS_MAX", CC_BODY_ITEMS_MAX) < 0 ||
        PyModule_AddIntConstant(module, "STRING_BYTES_MAX", CC_STRING_CHARS_MAX) < 0 ||
        PyModule_AddIntConstant(module, "ID_CHARS_MAX", CC_ID_CHARS_MAX) < 0 ||
        PyModule_AddIntConstant(module, "KIND_CHARS_MAX", CC_KIND_CHARS_MAX) < 0) {
        return -1;
    }
    PyObject *int_abs_max = PyLong_FromLongLong(CC_INT_ABS_MAX);
    if (int_abs_max == NULL) {
        return -1;
    }
    if (PyModule_AddObject(module, "INT_ABS_MAX", int_abs_max) < 0) {
        Py_DECREF(int_abs_max);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot cc_slots[] = {
    {Py_mod_exec, (void *)cc_exec},
    {0, NULL},
};

static struct PyModuleDef cc_module = {
    PyModuleDef_HEAD_INIT,
    "mwpstore._canonical_c",
    "Fast yes/no checks of canonical content and IDs (see csrc/canonical_check.c).",
    0,
    cc_methods,
    cc_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__canonical_c(void) {
    return PyModuleDef_Init(&cc_module);
}
