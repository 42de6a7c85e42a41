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
 * - fuse_session_new: the session is made with pyfuse3's handlers but one. GETXATTR of a name
 *   outside distorefs' own (XATTR_PREFIX: user.distorefs.) is answered ENODATA here, in the
 *   thread that reads the request, without Python. The kernel asks for security.capability
 *   before every write() to a file and at every open with O_TRUNC (to drop file
 *   capabilities, which distorefs never stores): one request per insert and two per
 *   priorities write, each a trip through pyfuse3's dispatch and the trio loop for an answer
 *   that is always the same. (FUSE_HANDLE_KILLPRIV_V2, which would let the kernel stop
 *   asking, is beyond libfuse 3.14.) Names of distorefs' own still go to pyfuse3's handler.
 *   And IOCTL, which pyfuse3 has no handler for, is answered ENOSYS as libfuse would, but
 *   counted: every open by Python's open() asks isatty() (TCGETS), one request each that no
 *   Python handler sees (`distorefs bench ops` reports it). The floor filesystem of the
 *   benchmarks loads the library for that count alone (foreign xattrs then go to Python).
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
#include <string.h>

#define NOFLUSH_FH (UINT64_C(1) << 63)

#define XATTR_PREFIX "user.distorefs."  /* mount/nodes.py XATTR_PREFIX (test_page_cache reads both kinds) */

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t,
                                               void *);
typedef void (*getxattr_fn)(fuse_req_t, fuse_ino_t, const char *, size_t);

static reply_open_fn libfuse_reply_open;
static session_new_fn libfuse_session_new;
static getxattr_fn handler_getxattr;  /* pyfuse3's */
static struct fuse_lowlevel_ops session_ops;  /* libfuse keeps a copy; this one outlives the call anyway */
static unsigned long long noflush_replies;
static unsigned long long foreign_xattr_replies;
static unsigned long long ioctl_replies;
static int answer_foreign_xattrs = 1;

/* Runs when the library is loaded, before anything can call through it. The library is
   linked against libfuse3, so that is loaded already: take its definitions, not ours
   (RTLD_DEFAULT would find ours first). */
__attribute__((constructor)) static void find_libfuse(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL)
        return;
    reply_open_fn reply = (reply_open_fn)dlsym(lib, "fuse_reply_open");
    session_new_fn session_new = (session_new_fn)dlsym(lib, "fuse_session_new");
    if (reply != fuse_reply_open && session_new != fuse_session_new) {
        libfuse_reply_open = reply;
        libfuse_session_new = session_new;
    }
}

static void getxattr_own_names(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    if (strncmp(name, XATTR_PREFIX, sizeof(XATTR_PREFIX) - 1) == 0) {
        handler_getxattr(req, ino, name, size);
        return;
    }
    __atomic_add_fetch(&foreign_xattr_replies, 1, __ATOMIC_RELAXED);
    fuse_reply_err(req, ENODATA);
}

static void ioctl_unsupported(fuse_req_t req, fuse_ino_t ino, unsigned int cmd, void *arg,
                              struct fuse_file_info *fi, unsigned flags, const void *in_buf, size_t in_bufsz,
                              size_t out_bufsz)
{
    __atomic_add_fetch(&ioctl_replies, 1, __ATOMIC_RELAXED);
    fuse_reply_err(req, ENOSYS);
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op, size_t op_size,
                                      void *userdata)
{
    if (libfuse_session_new == NULL)  /* not reached: the import below fails first */
        return NULL;
    if (op_size > sizeof(session_ops) || op->getxattr == NULL)  /* another libfuse's table: as it is */
        return libfuse_session_new(args, op, op_size, userdata);
    memset(&session_ops, 0, sizeof(session_ops));
    memcpy(&session_ops, op, op_size);
    if (answer_foreign_xattrs) {
        handler_getxattr = op->getxattr;
        session_ops.getxattr = getxattr_own_names;
    }
    if (session_ops.ioctl == NULL)
        session_ops.ioctl = ioctl_unsupported;
    return libfuse_session_new(args, &session_ops, op_size, userdata);
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
   library's fuse_reply_open and fuse_session_new, not libfuse's. */
static PyObject *interposed(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlsym(RTLD_DEFAULT, "fuse_reply_open") == (void *)fuse_reply_open &&
                           dlsym(RTLD_DEFAULT, "fuse_session_new") == (void *)fuse_session_new);
}

static PyObject *replies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&noflush_replies, __ATOMIC_RELAXED));
}

static PyObject *xattr_replies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&foreign_xattr_replies, __ATOMIC_RELAXED));
}

static PyObject *ioctls(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&ioctl_replies, __ATOMIC_RELAXED));
}

static PyObject *set_answer_foreign_xattrs(PyObject *self, PyObject *on)
{
    answer_foreign_xattrs = PyObject_IsTrue(on) ? 1 : 0;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"interposed", interposed, METH_NOARGS,
     "Whether pyfuse3's fuse_reply_open and fuse_session_new calls will come here."},
    {"noflush_replies", replies, METH_NOARGS,
     "Opens answered with FOPEN_NOFLUSH since the library was loaded."},
    {"foreign_xattr_replies", xattr_replies, METH_NOARGS,
     "GETXATTR requests of names outside XATTR_PREFIX answered ENODATA here since the library was loaded."},
    {"ioctl_replies", ioctls, METH_NOARGS, "IOCTL requests answered ENOSYS since the library was loaded."},
    {"answer_foreign_xattrs", set_answer_foreign_xattrs, METH_O,
     "Whether sessions made from now on answer GETXATTR of foreign names here (default: yes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_interpose",
    "libfuse's fuse_reply_open (FOPEN_NOFLUSH for handles that ask for it) and fuse_session_new (GETXATTR of "
    "names not distorefs' own answered without Python).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__interpose(void)
{
    if (libfuse_reply_open == NULL) {
        PyErr_SetString(PyExc_ImportError, "libfuse3's fuse_reply_open or fuse_session_new not found");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObject(m, "NOFLUSH_FH", PyLong_FromUnsignedLongLong(NOFLUSH_FH)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
