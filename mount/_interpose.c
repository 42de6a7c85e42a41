/*
 * libfuse calls that pyfuse3 makes, taken over where pyfuse3 3.5 cannot say what distorefs
 * needs. Loaded with RTLD_GLOBAL before pyfuse3 (mount/interpose.py), this library's
 * definitions are the ones pyfuse3's calls bind to; each forwards to libfuse's own.
 *
 * - fuse_reply_open: an open handler that wants no FLUSH at close (FOPEN_NOFLUSH, which
 *   pyfuse3's FileInfo has no field for) returns its file handle with NOFLUSH_FH set; this
 *   copy of the reply clears that bit (so the kernel, and every later request, carry the
 *   plain handle) and sets fuse_file_info.noflush.
 * - fuse_session_receive_buf: GETXATTR of a name outside user.distorefs. is answered
 *   ENODATA here, in C, and the next request read, so that pyfuse3 and the event loop
 *   never see it. The kernel asks for security.capability before every write() and every
 *   truncating open (it must know whether to drop file capabilities; it would stop asking
 *   only with FUSE_HANDLE_KILLPRIV_V2, which pyfuse3 cannot negotiate), and distorefs holds
 *   no xattr outside its own names: for a small insert that was one Python request in
 *   seven. Whatever is not such a GETXATTR goes to pyfuse3 unchanged.
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
#include <linux/fuse.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define NOFLUSH_FH (UINT64_C(1) << 63)

/* The only xattr names distorefs holds (mount/nodes.py XATTR_PREFIX). */
#define OWN_XATTR_PREFIX "user.distorefs."

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef int (*receive_buf_fn)(struct fuse_session *, struct fuse_buf *);

static reply_open_fn libfuse_reply_open;
static receive_buf_fn libfuse_receive_buf;
static unsigned long long noflush_replies;
static unsigned long long foreign_xattr_replies;

/* Runs when the library is loaded, before anything can call through it. The library is
   linked against libfuse3, so that is loaded already: take its definitions, not ours
   (RTLD_DEFAULT would find ours first). */
__attribute__((constructor)) static void find_libfuse(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL)
        return;
    reply_open_fn reply = (reply_open_fn)dlsym(lib, "fuse_reply_open");
    receive_buf_fn receive = (receive_buf_fn)dlsym(lib, "fuse_session_receive_buf");
    if (reply != fuse_reply_open && receive != fuse_session_receive_buf) {
        libfuse_reply_open = reply;
        libfuse_receive_buf = receive;
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

/* Whether `buf` is a GETXATTR of a name distorefs never holds; its reply is ENODATA. */
static int foreign_getxattr(const struct fuse_buf *buf, size_t size)
{
    const size_t names_at = sizeof(struct fuse_in_header) + sizeof(struct fuse_getxattr_in);
    if ((buf->flags & FUSE_BUF_IS_FD) || buf->mem == NULL || size <= names_at)
        return 0;
    const struct fuse_in_header *in = buf->mem;
    if (in->opcode != FUSE_GETXATTR || in->len != size)
        return 0;
    const char *name = (const char *)buf->mem + names_at;
    size_t room = size - names_at;
    if (memchr(name, '\0', room) == NULL)
        return 0;  /* malformed: libfuse answers it */
    return strncmp(name, OWN_XATTR_PREFIX, sizeof(OWN_XATTR_PREFIX) - 1) != 0;
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    if (libfuse_receive_buf == NULL)  /* not reached: the import below fails first */
        return -EIO;
    for (;;) {
        int res = libfuse_receive_buf(se, buf);
        if (res <= 0 || !foreign_getxattr(buf, (size_t)res))
            return res;
        const struct fuse_in_header *in = buf->mem;
        struct fuse_out_header out = {sizeof(out), -ENODATA, in->unique};
        int fd = fuse_session_fd(se);
        /* A reply the kernel refuses (ENOENT: the request was interrupted) needs nothing more. */
        if (write(fd, &out, sizeof(out)) == (ssize_t)sizeof(out))
            __atomic_add_fetch(&foreign_xattr_replies, 1, __ATOMIC_RELAXED);
        /* The fd blocks (pyfuse3 waits for it to be readable first): read on only if there
           is a request; otherwise pyfuse3 goes back to waiting (EINTR: nothing received). */
        struct pollfd ready = {fd, POLLIN, 0};
        if (poll(&ready, 1, 0) != 1 || !(ready.revents & POLLIN))
            return -EINTR;
    }
}

/* Whether a lookup from the global scope (where pyfuse3's own lookup starts) finds this
   library's fuse_reply_open, not libfuse's. */
static PyObject *interposed(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(dlsym(RTLD_DEFAULT, "fuse_reply_open") == (void *)fuse_reply_open
                           && dlsym(RTLD_DEFAULT, "fuse_session_receive_buf") == (void *)fuse_session_receive_buf);
}

static PyObject *replies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&noflush_replies, __ATOMIC_RELAXED));
}

static PyObject *xattr_replies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&foreign_xattr_replies, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"interposed", interposed, METH_NOARGS,
     "Whether pyfuse3's fuse_reply_open and fuse_session_receive_buf calls will come here."},
    {"foreign_xattr_replies", xattr_replies, METH_NOARGS,
     "GETXATTR requests of names outside user.distorefs. answered ENODATA here."},
    {"noflush_replies", replies, METH_NOARGS,
     "Opens answered with FOPEN_NOFLUSH since the library was loaded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_interpose",
    "libfuse's fuse_reply_open (FOPEN_NOFLUSH) and fuse_session_receive_buf (foreign xattrs).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__interpose(void)
{
    if (libfuse_reply_open == NULL) {
        PyErr_SetString(PyExc_ImportError, "libfuse3's fuse_reply_open or fuse_session_receive_buf not found");
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
