/*
 * A small batch/N.npz made in one call (distorefs/batch.py, `_rows_file`): a copy of the
 * file's image (_SmallZip: every ZIP and .npy header in place) with each member's bytes
 * written in and its CRC-32 set in its local and central headers.
 *
 * The leading members are a buffer's fields, gathered here from the drawn entries' rows
 * (distorefs/rows.py: each entry's fields side by side), one column per field; the others
 * (keys, seqs, probabilities, weights) are arrays given whole, the keys cast to str here
 * from the ring's name table (ascii_keys) where they come from it. In Python the same file is a
 * contiguous copy and a bytes object per field, a bytes object per array, a CRC and two
 * struct packs per member: some twenty calls whose cost on a busy daemon (cold caches) is
 * several times the copying itself, paid for every batch a learner draws.
 *
 * Optional: without it (no compiler) batch.py makes the file in Python, the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "crc32.h"  /* crc32_of: the members' CRC-32, as zlib computes it */

static void put_u32(unsigned char *at, uint32_t v)
{
    at[0] = (unsigned char)v;
    at[1] = (unsigned char)(v >> 8);
    at[2] = (unsigned char)(v >> 16);
    at[3] = (unsigned char)(v >> 24);
}

/* One member's place in the image: (at, size, local CRC offset, central CRC offset, seed). */
static int member_place(PyObject *places, Py_ssize_t i, Py_ssize_t image_len, Py_ssize_t *at, Py_ssize_t *size,
                        Py_ssize_t *local, Py_ssize_t *central, uint32_t *seed)
{
    PyObject *p = PySequence_Fast_GET_ITEM(places, i);
    unsigned long s;
    if (!PyTuple_Check(p) || !PyArg_ParseTuple(p, "nnnnk", at, size, local, central, &s))
        return -1;
    if (*at < 0 || *size < 0 || *at > image_len - *size || *local < 0 || *local > image_len - 4 ||
        *central < 0 || *central > image_len - 4 || s > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "_batchfill: a member's place is outside the image");
        return -1;
    }
    *seed = (uint32_t)s;
    return 0;
}

/* fill(image, places, rows, spans, bodies) -> bytes */
static PyObject *fill(PyObject *self, PyObject *args)
{
    PyObject *image_obj, *places_obj, *rows_obj, *spans_obj, *bodies_obj;
    if (!PyArg_ParseTuple(args, "OOOOO", &image_obj, &places_obj, &rows_obj, &spans_obj, &bodies_obj))
        return NULL;
    Py_buffer image = {0}, rows = {0};
    PyObject *places = NULL, *spans = NULL, *bodies = NULL, *out = NULL;
    if (PyObject_GetBuffer(image_obj, &image, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0)
        goto done;
    places = PySequence_Fast(places_obj, "_batchfill: places must be a sequence");
    spans = places == NULL ? NULL : PySequence_Fast(spans_obj, "_batchfill: spans must be a sequence");
    bodies = spans == NULL ? NULL : PySequence_Fast(bodies_obj, "_batchfill: bodies must be a sequence");
    if (bodies == NULL)
        goto done;
    Py_ssize_t nfields = PySequence_Fast_GET_SIZE(spans), nbodies = PySequence_Fast_GET_SIZE(bodies);
    if (rows.ndim != 2 || rows.itemsize != 1 || PySequence_Fast_GET_SIZE(places) != nfields + nbodies) {
        PyErr_SetString(PyExc_ValueError, "_batchfill: rows must be (N, width) bytes, and a place given per member");
        goto done;
    }
    Py_ssize_t n = rows.shape[0], width = rows.shape[1];
    out = PyBytes_FromStringAndSize(image.buf, image.len);
    if (out == NULL)
        goto done;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *r = rows.buf;
    for (Py_ssize_t i = 0; i < nfields + nbodies; i++) {
        Py_ssize_t at, size, local, central;
        uint32_t seed;
        if (member_place(places, i, image.len, &at, &size, &local, &central, &seed) < 0)
            goto fail;
        if (i < nfields) {  /* a field: its column of the rows */
            Py_ssize_t start, len;
            PyObject *s = PySequence_Fast_GET_ITEM(spans, i);
            if (!PyTuple_Check(s) || !PyArg_ParseTuple(s, "nn", &start, &len))
                goto fail;
            if (start < 0 || len < 0 || start > width - len || len * n != size) {
                PyErr_SetString(PyExc_ValueError, "_batchfill: a field's span does not fit its rows or its member");
                goto fail;
            }
            for (Py_ssize_t k = 0; k < n; k++)
                memcpy(o + at + k * len, r + k * width + start, (size_t)len);
        } else {  /* an array given whole */
            Py_buffer body;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bodies, i - nfields), &body, PyBUF_C_CONTIGUOUS) < 0)
                goto fail;
            int fits = body.len == size;
            if (fits)
                memcpy(o + at, body.buf, (size_t)size);
            PyBuffer_Release(&body);
            if (!fits) {
                PyErr_SetString(PyExc_ValueError, "_batchfill: an array is not its member's size");
                goto fail;
            }
        }
        uint32_t crc = crc32_of(seed, o + at, (size_t)size);
        put_u32(o + local, crc);
        put_u32(o + central, crc);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(places);
    Py_XDECREF(spans);
    Py_XDECREF(bodies);
    if (rows.obj != NULL)
        PyBuffer_Release(&rows);
    PyBuffer_Release(&image);
    return out;
}

/* take_rows(table, filled, slots, out) -> bool: out[i] = table[slots[i]] for every i, True,
 * if each slot is in the table and filled[slot] is set; else False (out is the caller's to
 * drop). The rows of a drawn batch (distorefs/rows.py, SlotRows.take): in numpy a check of
 * the filled flags and a gather, four calls a batch on a busy daemon's cold caches. */
static PyObject *take_rows(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *filled_obj, *slots_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &table_obj, &filled_obj, &slots_obj, &out_obj))
        return NULL;
    Py_buffer table = {0}, filled = {0}, slots = {0}, out = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(table_obj, &table, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0 ||
        PyObject_GetBuffer(filled_obj, &filled, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0 ||
        PyObject_GetBuffer(slots_obj, &slots, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0 ||
        PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_ND | PyBUF_WRITABLE) < 0)
        goto done;
    if (table.ndim != 2 || table.itemsize != 1 || filled.ndim != 1 || filled.itemsize != 1 || slots.ndim != 1 ||
        slots.itemsize != 8 || out.ndim != 2 || out.itemsize != 1 || out.shape[0] != slots.shape[0] ||
        out.shape[1] != table.shape[1] || filled.shape[0] < table.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "_batchfill: take_rows wants (C, W) and (C,) bytes, int64 slots, (N, W) out");
        goto done;
    }
    Py_ssize_t n = slots.shape[0], width = table.shape[1], capacity = table.shape[0];
    const int64_t *s = slots.buf;
    const unsigned char *f = filled.buf, *t = table.buf;
    unsigned char *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || s[i] >= capacity || !f[s[i]]) {
            result = Py_NewRef(Py_False);
            goto done;
        }
        memcpy(o + i * width, t + s[i] * width, (size_t)width);
    }
    result = Py_NewRef(Py_True);
done:
    if (out.obj != NULL)
        PyBuffer_Release(&out);
    if (slots.obj != NULL)
        PyBuffer_Release(&slots);
    if (filled.obj != NULL)
        PyBuffer_Release(&filled);
    if (table.obj != NULL)
        PyBuffer_Release(&table);
    return result;
}

/* ascii_keys(names) -> (width, bytes) or None: the keys.npy body of a batch whose names come
 * from the ring's table (a 1-D bytes array, ASCII, NUL-padded): each name as `width` UCS-4
 * code points, width the longest name's length (at least 1), as numpy's cast to str of that
 * width makes it. None for a byte past ASCII (never in the table: Python casts then). */
static PyObject *ascii_keys(PyObject *self, PyObject *arg)
{
    Py_buffer names;
    if (PyObject_GetBuffer(arg, &names, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0)
        return NULL;
    PyObject *result = NULL;
    if (names.ndim != 1 || names.itemsize < 1) {
        PyErr_SetString(PyExc_ValueError, "_batchfill: names must be a 1-D bytes array");
        goto done;
    }
    Py_ssize_t n = names.shape[0], item = names.itemsize, width = 1;
    const unsigned char *p = names.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = 0;
        while (len < item && p[i * item + len] != 0) {
            if (p[i * item + len] > 127) {
                result = Py_NewRef(Py_None);
                goto done;
            }
            len++;
        }
        if (len > width)
            width = len;
    }
    PyObject *body = PyBytes_FromStringAndSize(NULL, n * width * 4);
    if (body == NULL)
        goto done;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(body);
    memset(o, 0, (size_t)(n * width * 4));
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t k = 0; k < width && k < item && p[i * item + k] != 0; k++)
            o[(i * width + k) * 4] = p[i * item + k];  /* little-endian: the code point's low byte */
    result = Py_BuildValue("(nN)", width, body);
done:
    PyBuffer_Release(&names);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(image, places, rows, spans, bodies): a copy of `image` with each member's bytes written "
     "at its place (at, size, local CRC offset, central CRC offset, CRC seed) and its CRC-32 set: "
     "member i < len(spans) the column spans[i] = (start, length) of every row of `rows` (N, width), "
     "the rest `bodies`, one each."},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(table, filled, slots, out): out[i] = table[slots[i]], True, if every slot is in the "
     "table and filled; else False."},
    {"ascii_keys", ascii_keys, METH_O,
     "ascii_keys(names): (width, the UCS-4 bytes of the names as str of that width) for a 1-D "
     "ASCII bytes array; None for a byte past ASCII."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchfill", NULL, -1, methods};

PyMODINIT_FUNC PyInit__batchfill(void)
{
    crc32_init();
    return PyModule_Create(&module);
}
