/*
 * The two loops of distorefs/sumtree.py that numpy runs as some twenty calls per tree level:
 * bringing the ancestors of a few updated leaves up to date, and the descent of find().
 * A learner's step updates a tree three times (its priorities, the inserts since the last
 * draw in two trees) and draws once: each of those is a few microseconds here against
 * 20-80 in numpy, whose per-call cost, not the arithmetic, is what a small batch pays.
 *
 * The arrays are SumTree's own (float64 levels, C-contiguous), reached through the buffer
 * protocol: no numpy headers are needed. Layout (see sumtree.py): level k+1 node i is the
 * sum of level k nodes i*B .. i*B+B-1; mins[k] (k >= 1) is the smallest positive leaf below
 * a node (inf: none). What could make a loop leave its arrays is checked here (their
 * types, the levels' sizes, each slot of an update; a bad slot or value makes update()
 * return False for sumtree.py's numpy code to name it). Optional: without it (no
 * compiler) sumtree.py runs its numpy code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_LEVELS 16

typedef struct {
    Py_buffer view[2 * MAX_LEVELS + 2];
    int count;
} views;

static void views_release(views *v)
{
    for (int i = 0; i < v->count; i++)
        PyBuffer_Release(&v->view[i]);
    v->count = 0;
}

/* A contiguous buffer of float64 (`ints` 0) or int64 (`ints` 1) from `obj`. */
static void *take(views *v, PyObject *obj, int writable, int ints, Py_ssize_t *len)
{
    Py_buffer *b = &v->view[v->count];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    v->count++;
    const char *f = b->format == NULL ? "" : b->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    int ok = b->itemsize == 8 && f[0] != '\0' && f[1] == '\0' && (ints ? (f[0] == 'q' || f[0] == 'l') : f[0] == 'd');
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, ints ? "_sumtree: an int64 array was expected"
                                              : "_sumtree: a float64 array was expected");
        return NULL;
    }
    *len = b->len / 8;
    return b->buf;
}

/* Levels: a list of float64 arrays. */
static int take_levels(views *v, PyObject *list, int first, double **out, Py_ssize_t *lens, int *n)
{
    if (!PyList_Check(list) || PyList_GET_SIZE(list) > MAX_LEVELS) {
        PyErr_SetString(PyExc_TypeError, "_sumtree: levels must be a list of at most 16 arrays");
        return -1;
    }
    *n = (int)PyList_GET_SIZE(list);
    for (int k = first; k < *n; k++) {
        out[k] = take(v, PyList_GET_ITEM(list, k), 1, 0, &lens[k]);
        if (out[k] == NULL)
            return -1;
    }
    return 0;
}

/* Level k (k >= 1) holds a node for every row of b nodes of level k - 1, and no more
 * rows than that: so a parent's children, and a node's children in find(), are in range. */
static int sum_lens_ok(const Py_ssize_t *lens, int k, Py_ssize_t b)
{
    return lens[k - 1] % b == 0 && lens[k - 1] / b <= lens[k] && lens[k] * b <= lens[k - 1] + b * b;
}

/* The sums and minima of every ancestor of `slots`, recomputed from their children level by
 * level; a parent shared by several slots is recomputed once per slot (the same values), as
 * the numpy code does. */
static void refresh_ancestors(double **sums, double **mins, int levels, Py_ssize_t b, const int64_t *slots,
                              Py_ssize_t nslots)
{
    for (Py_ssize_t i = 0; i < nslots; i++) {
        int64_t node = slots[i];
        for (int k = 1; k < levels; k++) {
            int64_t parent = node / b;
            const double *child = sums[k - 1] + parent * b;
            double total = 0.0, least = INFINITY;
            if (k == 1) {
                for (Py_ssize_t j = 0; j < b; j++) {
                    total += child[j];
                    if (child[j] > 0.0 && child[j] < least)
                        least = child[j];
                }
            } else {
                const double *child_min = mins[k - 1] + parent * b;
                for (Py_ssize_t j = 0; j < b; j++) {
                    total += child[j];
                    if (child_min[j] < least)
                        least = child_min[j];
                }
            }
            sums[k][parent] = total;
            mins[k][parent] = least;
            node = parent;
        }
    }
}

/* update(sums, mins, branching, capacity, slots, values): leaf slots[i] = values[i] (a
 * repeated slot: the last value), then its ancestors. False, nothing changed, if a slot is
 * out of range or a value is not finite and >= 0 (the numpy code then says which). */
static PyObject *update(PyObject *self, PyObject *args)
{
    PyObject *sums_list, *mins_list, *slots_obj, *values_obj;
    Py_ssize_t b, capacity, nslots, nvalues;
    views v = {.count = 0};
    double *sums[MAX_LEVELS], *mins[MAX_LEVELS];
    Py_ssize_t sum_lens[MAX_LEVELS], min_lens[MAX_LEVELS];
    int levels, min_levels;
    if (!PyArg_ParseTuple(args, "OOnnOO", &sums_list, &mins_list, &b, &capacity, &slots_obj, &values_obj))
        return NULL;
    if (take_levels(&v, sums_list, 0, sums, sum_lens, &levels) < 0 ||
        take_levels(&v, mins_list, 1, mins, min_lens, &min_levels) < 0)
        goto fail;
    const int64_t *slots = take(&v, slots_obj, 0, 1, &nslots);
    const double *values = slots == NULL ? NULL : take(&v, values_obj, 0, 0, &nvalues);
    if (values == NULL)
        goto fail;
    if (min_levels != levels || b < 1 || nvalues != nslots || capacity > sum_lens[0]) {
        PyErr_SetString(PyExc_ValueError, "_sumtree: bad update arguments");
        goto fail;
    }
    for (int k = 1; k < levels; k++) {  /* every parent of the level below is in this one */
        if (sum_lens_ok(sum_lens, k, b) == 0 || min_lens[k] != sum_lens[k]) {
            PyErr_SetString(PyExc_ValueError, "_sumtree: levels of the wrong sizes");
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < nslots; i++) {
        if (slots[i] < 0 || slots[i] >= capacity || !(values[i] >= 0.0 && values[i] < INFINITY)) {
            views_release(&v);
            Py_RETURN_FALSE;
        }
    }
    for (Py_ssize_t i = 0; i < nslots; i++)
        sums[0][slots[i]] = values[i];
    refresh_ancestors(sums, mins, levels, b, slots, nslots);
    views_release(&v);
    Py_RETURN_TRUE;
fail:
    views_release(&v);
    return NULL;
}

/* find(sums, branching, q, out[, stride]): for each prefix q[i] (clamped into [0, total)), the
 * slot whose cumulative range holds it, into out[i] (int64); ValueError for a prefix that is
 * not finite, or a tree whose total is 0. With a stride, the prefixes are (i + q[i]) * stride:
 * a stratified draw's, from its uniforms in [0, 1), without the three numpy calls (and their
 * arrays) that make them, each costing a draw more than this descent on a busy daemon.
 * The numpy code's rules: a prefix at or past the total goes to the last positive top node;
 * within a row, the first child whose inclusive prefix sum exceeds q (the last child if
 * none does); a child of 0 reached through rounding is left for the nearest positive
 * sibling, the next one (entered at its start), else the previous one (at its end).
 * With `pw` (float64, 2 * len(q)) too, each slot's probability and importance weight are
 * written there as the sampler computes them (distorefs/sampler.py, `probabilities`): the
 * slot's leaf p (its priority**alpha), p / total into pw[i] and (p / smallest)**-beta
 * into pw[len(q) + i] (0 where p is 0). A prioritized batch drawn ahead then costs one
 * call where the draw and its weights were some ten numpy calls, each several times this
 * arithmetic on a busy daemon. */
static PyObject *find(PyObject *self, PyObject *args)
{
    PyObject *sums_list, *q_obj, *out_obj, *pw_obj = NULL;
    Py_ssize_t b, nq, nout, npw = 0;
    double *pw = NULL, total_given = 0.0, smallest = 0.0, beta = 0.0;
    views v = {.count = 0};
    double *sums[MAX_LEVELS];
    Py_ssize_t lens[MAX_LEVELS];
    int levels;
    double *c = NULL;
    double stride = 0.0;
    if (!PyArg_ParseTuple(args, "OnOO|dOddd", &sums_list, &b, &q_obj, &out_obj, &stride, &pw_obj, &total_given,
                          &smallest, &beta))
        return NULL;
    if (take_levels(&v, sums_list, 0, sums, lens, &levels) < 0)
        goto fail;
    const double *q = take(&v, q_obj, 0, 0, &nq);
    int64_t *out = q == NULL ? NULL : take(&v, out_obj, 1, 1, &nout);
    if (out == NULL)
        goto fail;
    if (pw_obj != NULL && pw_obj != Py_None) {
        pw = take(&v, pw_obj, 1, 0, &npw);
        if (pw == NULL)
            goto fail;
        if (npw != 2 * nq || !(total_given > 0.0) || !(smallest > 0.0) || !isfinite(beta)) {
            PyErr_SetString(PyExc_ValueError, "_sumtree: bad find weights arguments");
            goto fail;
        }
    }
    if (nout != nq || levels < 1 || b < 1) {
        PyErr_SetString(PyExc_ValueError, "_sumtree: bad find arguments");
        goto fail;
    }
    for (int k = 1; k < levels; k++) {  /* every node's children are in the level below */
        if (sum_lens_ok(lens, k, b) == 0) {
            PyErr_SetString(PyExc_ValueError, "_sumtree: levels of the wrong sizes");
            goto fail;
        }
    }
    const double *top = sums[levels - 1];
    Py_ssize_t ntop = lens[levels - 1];
    c = malloc((size_t)(ntop + 1) * sizeof(double));
    if (c == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    c[0] = 0.0;
    for (Py_ssize_t i = 0; i < ntop; i++)
        c[i + 1] = c[i] + top[i];
    double total = c[ntop];
    if (!isfinite(stride) || stride < 0.0) {
        PyErr_SetString(PyExc_ValueError, "_sumtree: bad stride");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < nq; i++) {
        if (!isfinite(q[i])) {
            PyErr_SetString(PyExc_ValueError, "prefix values must be finite");
            goto fail;
        }
    }
    if (!(total > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "cannot find a slot: every priority is 0");
        goto fail;
    }
    /* last positive top node: the first index whose cumulative sum reaches the total, less 1 */
    Py_ssize_t lo = 0, hi = ntop + 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (c[mid] < total)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_ssize_t last = lo - 1;
    for (Py_ssize_t i = 0; i < nq; i++) {
        double x = stride > 0.0 ? ((double)i + q[i]) * stride : q[i];
        if (!(x > 0.0))
            x = 0.0;
        /* how many of c are <= x, less 1 */
        lo = 0;
        hi = ntop + 1;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (c[mid] <= x)
                lo = mid + 1;
            else
                hi = mid;
        }
        int64_t idx = lo - 1;
        if (idx > last)
            idx = last;
        x -= c[idx];
        for (int k = levels - 2; k >= 0; k--) {
            const double *child = sums[k] + idx * b;
            double csum = 0.0, before = 0.0;
            Py_ssize_t j = 0;
            for (; j < b; j++) {
                csum += child[j];
                if (csum > x)
                    break;
                before = csum;
            }
            if (j == b) {  /* x reached the row's total (rounding, clamping): the last child */
                j = b - 1;
                before = csum - child[j];
            }
            x -= before;
            if (child[j] <= 0.0) {
                Py_ssize_t r = j + 1;
                while (r < b && !(child[r] > 0.0))
                    r++;
                if (r < b) {
                    j = r;
                    x = 0.0;
                } else {
                    Py_ssize_t l = j - 1;
                    while (l > 0 && !(child[l] > 0.0))
                        l--;
                    j = l < 0 ? 0 : l;
                    x = child[j];
                }
            }
            idx = idx * b + j;
        }
        out[i] = idx;
        if (pw != NULL) {
            double p = sums[0][idx], ratio = p / smallest;
            pw[i] = p / total_given;
            pw[nq + i] = ratio > 0.0 ? pow(ratio, -beta) : 0.0;
        }
    }
    free(c);
    views_release(&v);
    Py_RETURN_NONE;
fail:
    free(c);
    views_release(&v);
    return NULL;
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS,
     "update(sums, mins, branching, capacity, slots, values): set leaves and their ancestors; "
     "False (nothing changed) for a bad slot or value."},
    {"find", find, METH_VARARGS,
     "find(sums, branching, q, out[, stride[, pw, total, smallest, beta]]): the slot holding each "
     "prefix q[i] (with a stride: (i + q[i]) * stride), into out[i]; with pw, each slot's probability "
     "leaf / total into pw[i] and weight (leaf / smallest)**-beta into pw[len(q) + i]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sumtree", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sumtree(void)
{
    return PyModule_Create(&module);
}
