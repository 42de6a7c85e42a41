/*
 * Lets an open ask the kernel not to send FLUSH at close (FOPEN_NOFLUSH), which pyfuse3
 * 3.5's FileInfo has no field for.
 *
 * This library defines libfuse's fuse_reply_open. Loaded with RTLD_GLOBAL before pyfuse3
 * (mount/openreply.py), it is the definition pyfuse3's call binds to; it forwards every
 * reply to libfuse's own function. An open handler that wants no FLUSH returns its file
 * handle with NOFLUSH_FH set: this copy of the reply clears that bit (so the kernel, and
 * every later request, carry the plain handle) and sets fuse_file_info.noflush.
 *
 * Built against the same libfuse headers as pyfuse3 (pkg-config fuse3), so the bitfield
 * is where pyfuse3's libfuse expects it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

#define NOFLUSH_FH (UINT64_C(1) << 63)

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);

static reply_open_fn libfuse_reply_open;
static unsigned long long noflush_replies;

/* Runs when the library is loaded, before anything can call fuse_reply_open through it.
   The library is linked against libfuse3, so that is loaded already: take its definition,
   not ours (RTLD_DEFAULT would find ours first). */
__attribute__((constructor)) static void find_libfuse_reply_open(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    if (lib != NULL) {
        reply_open_fn found = (reply_open_fn)dlsym(lib, "fuse_reply_open");
        if (found != fuse_reply_open)
            libfuse_reply_open = found;
    }
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    if (libfuse_reply_open == NULL)  /* not reached: the import below fails first */
        return fuse_reply_err(req, EIO);
    if (fi->fh & NOFLUSH_FH) {
        struct fuse_file_info copy = *fi;
        copy.fh &= ~NOFLUSH_FH;
        copy.noflush = 1;
        __atomic_add_fetch(&noflush_replies, 1, __ATOMIC_RELAXED);
        return libfuse_reply_open(req, &copy);
    }
    return libfuse_reply_open(req, fi);
}

/* Whether a lookup from the global scope (where pyfuse3's own lookup starts) finds this
   library's fuse_reply_open, not libfuse's. */
static PyObject *interposed(PyObject *self, PyObject *unused)
{
    void *found = dlsym(RTLD_DEFAULT, "fuse_reply_open");
    return PyBool_FromLong(found == (void *)fuse_reply_open);
}

static PyObject *replies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&noflush_replies, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"interposed", interposed, METH_NOARGS,
     "Whether pyfuse3's fuse_reply_open calls will come here."},
    {"noflush_replies", replies, METH_NOARGS,
     "Opens answered with FOPEN_NOFLUSH since the library was loaded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_openreply",
    "libfuse's fuse_reply_open, with FOPEN_NOFLUSH for handles that ask for it.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__openreply(void)
{
    if (libfuse_reply_open == NULL) {
        PyErr_SetString(PyExc_ImportError, "libfuse3's fuse_reply_open not found");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObject(m, "NOFLUSH_FH",
                                        PyLong_FromUnsignedLongLong(NOFLUSH_FH)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
