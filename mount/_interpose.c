/*
 * libfuse calls that pyfuse3 makes, taken over where pyfuse3 3.5 cannot say what distorefs
 * needs. Loaded with RTLD_GLOBAL before pyfuse3 (mount/interpose.py), this library's
 * definitions are the ones pyfuse3's calls bind to; each forwards to libfuse's own.
 *
 * - fuse_reply_open: an open handler that wants no FLUSH at close (FOPEN_NOFLUSH, which
 *   pyfuse3's FileInfo has no field for) returns its file handle with NOFLUSH_FH set; this
 *   copy of the reply clears that bit (so the kernel, and every later request, carry the
 *   plain handle) and sets fuse_file_info.noflush.
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

/* Runs when the library is loaded, before anything can call through it. The library is
   linked against libfuse3, so that is loaded already: take its definitions, not ours
   (RTLD_DEFAULT would find ours first). */
__attribute__((constructor)) static void find_libfuse(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL)
        return;
    reply_open_fn reply = (reply_open_fn)dlsym(lib, "fuse_reply_open");
    if (reply != fuse_reply_open)
        libfuse_reply_open = reply;
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
    return PyBool_FromLong(dlsym(RTLD_DEFAULT, "fuse_reply_open") == (void *)fuse_reply_open);
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
    PyModuleDef_HEAD_INIT, "_interpose",
    "libfuse's fuse_reply_open, with FOPEN_NOFLUSH for handles that ask for it.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__interpose(void)
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
