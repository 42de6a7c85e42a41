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
 * - The front (fuse_session_fd, fuse_session_receive_buf, fuse_session_destroy): one native
 *   thread of this library reads every request from /dev/fuse, without the GIL. What the
 *   table above answers without Python (those GETXATTRs and IOCTLs) it answers there and
 *   then; every other request it queues for pyfuse3, whose loop waits on an eventfd in
 *   place of /dev/fuse and whose receive takes the next queued request (its buffer swapped
 *   for the one pyfuse3 is done with, not copied). So a request Python never sees no longer
 *   wakes the trio loop, takes pyfuse3's read lock and waits for the GIL behind whatever
 *   the loop is doing: a learner's `priorities` write asks two GETXATTRs and an IOCTL, an
 *   insert one of each. The cost is one more thread hand-off for each request Python
 *   answers. At most FRONT_QUEUE requests wait for Python; then the front stops reading.
 *
 * - Answers Python leaves to the front (fuse_reply_attr, fuse_reply_entry; the session's
 *   GETATTR and FLUSH handlers): an inode whose attributes Python holds (hold_attributes:
 *   a file whose attributes change only by an act Python sees, which drops them) gets its
 *   GETATTR answered by the front from the attributes Python last replied with; a handle
 *   Python marks as having nothing to do at close (flush_answered) gets its FLUSH answered
 *   0 by the front. A `priorities` write paid a GETATTR (the truncating open drops the
 *   kernel's attributes and Python's open() stats the file) and a FLUSH: both in C now.
 *   And RELEASE of a handle Python marks as having nothing to do then but bookkeeping
 *   (release_free: the read-only opens that send no FLUSH) is answered by the front, its
 *   number kept for Python to take (take_released) before it handles its next request:
 *   every read of an entry, a batch or a dataset item paid a trip through Python for it.
 *   Python may ask to be woken at that RELEASE (notes_efd; a learner's batch it opened: the
 *   next batch is set aside then).
 *   On pyfuse3's own thread those handlers are pyfuse3's, always.
 *
 * - Opens the front answers (the session's OPEN handler): an inode Python marks
 *   (answer_opens) has its opens of one access mode answered with a handle number of the
 *   front's own (FRONT_FH): a write-only open of `priorities`, which only makes a handle,
 *   and the next open of a sealed dataset item whose value is in the page cache already
 *   (a `once` mark, keep_cache and noflush in the reply; the inode is noted for Python,
 *   take_opened). Python makes the handle at the handle's first request that reaches it
 *   (adopt_opened); the RELEASE of one it never saw ends here. And a learner's next
 *   batch/N.npz, put into its inode's page cache while it trained: a `once` mark for the
 *   learner's thread alone (the request's pid), `adopted`: the handle is Python's from the
 *   open on (take_opened gives its number, its RELEASE goes to take_released), and the
 *   front writes notes_efd after answering its RELEASE (not its OPEN: one wake-up of
 *   Python per batch), so Python counts the draw and sets the next batch aside while the
 *   learner trains.
 *
 * - A FLUSH that waits for commits (flush_pending, flush_committed): a `priorities` write
 *   Python answers returns once queued, and its close's FLUSH is parked here until the
 *   committer's thread says the transaction committed; answered then, with the first error.
 *
 * - `priorities` WRITEs the front answers (answer_opens with MARK_PRIORITIES, priority_log):
 *   a write of whole, well-formed lines on a handle the front opened is appended to the
 *   store's priority write-ahead file (distorefs/priowal.py) and answered, then queued for
 *   Python (take_writes), which commits it into the buffer's journal. The close that
 *   follows has nothing to wait for: the front answers its FLUSH at once. A learner's step
 *   then waits for no Python at all (its batch open is the front's too): before, its close
 *   waited for the WRITE's trip through the trio loop, the commit queue and an LMDB
 *   transaction, behind whatever else the loop was doing (1.5-1.8 ms a step under 2 actors).
 *
 * - Entry WRITEs the front collects (collect_writes, take_collected): Python marks the
 *   handle of a new entry's writer (write-only, nothing written yet) at its CREATE or
 *   truncating OPEN, and the front keeps what its WRITEs write, each answered at once,
 *   while they land within what was written or right after it, within the buffer's limit
 *   (at most 8 MiB a handle, 64 MiB in all). Python takes the bytes at the handle's first
 *   request that reaches it, its close's FLUSH (which commits them, as before) or a WRITE
 *   the front did not keep (then that handle's later WRITEs are Python's too), and reads
 *   their size meanwhile for the inode's attributes (collected_size). While one writer
 *   alone writes an inode this way, the front answers its GETATTRs too, from the writer's
 *   attributes Python gave with collect_writes, the size kept so far and the time now (a
 *   chmod or chown of it ends the keeping). An insert was four requests through pyfuse3
 *   and the trio loop (LOOKUP, CREATE, WRITE, FLUSH), np.save's ten (an fstat's GETATTR,
 *   five WRITEs, and a second FLUSH, which the front now answers too: flush_free once the
 *   first committed); now three either way. Nothing is acknowledged before the FLUSH:
 *   what the front held when the daemon dies was never committed, as Python's staged
 *   bytes were not.
 *
 * - Checkpoint WRITEs the front copies into chunks Python lends (chunks_arm, chunks_lend,
 *   chunks_full, chunks_stop): a checkpoint file's writer, armed at a chunk boundary at
 *   its end, has chunk-sized buffers of Python's (budgeted, reused from one checkpoint to
 *   the next) lent to the front, which copies each WRITE that continues where the last one
 *   ended into them and answers it. A chunk filled whole goes to `chunks_full` (notes_efd
 *   is written), and Python persists it as it persisted Python-written chunks; Python lends
 *   the next. A WRITE anywhere else, or past the chunks lent, goes to Python, and so do the
 *   handle's later ones: Python stops the handle first (chunks_stop), taking every chunk,
 *   the partly filled ones too, as it does at the close's FLUSH and at any other request
 *   of that file. A 1 MiB WRITE was a trip through pyfuse3's copy into new bytes and the
 *   trio loop (about 460 us of the loop's time); a checkpoint is 2,048 of them per 2 GiB.
 *
 * - LOOKUPs of names a directory certainly lacks (absent_names, name_counted): Python gives
 *   the front the names an `entries/` directory has (its ring's keys, and the names of the
 *   inodes its writers created and hold), and keeps the count of each as they come and go;
 *   a LOOKUP in that directory of a name it does not hold is answered ENOENT here. Every
 *   insert of a new entry asked one (the kernel looks a name up before it creates it:
 *   fuse_atomic_open), a trip through pyfuse3 and the trio loop for an answer the front
 *   can give (68 us of the daemon's CPU each). The names are kept as 64-bit hashes with a
 *   count: a name whose hash collides with one held goes to Python (which answers as
 *   before), and one that is held is never answered here. A name Python refuses (empty,
 *   `.`, `..`, past 255 bytes) goes to Python too, for its errno.
 *
 * - CREATEs of new entries the front answers (answer_creates, create_inodes, take_created):
 *   in a directory whose names the front holds (above) and whose creates Python lets it
 *   answer (an `entries/` with no rate limiter to wait for), a write-only CREATE of a name
 *   it certainly lacks is answered here: an inode number from the pool Python gave, a
 *   handle number of the front's own whose WRITEs it collects (above) and whose RELEASE is
 *   Python's bookkeeping (release_free), the writer's attributes (the mode less the umask,
 *   the caller's uid and gid, size 0, the time now), and the name counted as held. Python
 *   makes the inode and the writer from the record it takes (take_created) before it
 *   handles any request, so the FLUSH that commits finds them, and the LOOKUP of the name
 *   by anyone goes to Python as before. An insert was three requests through pyfuse3 and
 *   the trio loop (CREATE, the committing FLUSH, and before the names, the LOOKUP); now
 *   its FLUSH alone.
 *
 * - FUSE_PARALLEL_DIROPS (fuse_session_mount, the session's INIT handler): libfuse before 3.17
 *   never passes it to the kernel (it wants it by default, but its INIT reply leaves the flag
 *   out; libfuse #861), so the kernel took a directory's mutex around every LOOKUP and
 *   READDIR in it: a reader's LOOKUP of an item waited for a whole READDIRPLUS of the name
 *   warmer (57 % of a cold epoch's reader time, in the kernel's fuse_lock_inode), and
 *   readers of one `entries/` looked names up one at a time. The session's replies go
 *   through libfuse's custom io (fuse_session_custom_io, the same read and writev), whose
 *   writev adds the flag to the INIT reply when libfuse wanted it and the kernel offered it.
 *
 * - FUSE passthrough (Linux 6.9; beyond libfuse 3.14, so done here): when the kernel offers
 *   it, the INIT reply asks for it (FUSE_PASSTHROUGH in flags2, max_stack_depth 1), and an
 *   open whose handle number carries PASSTHROUGH_FH (`passthrough(fh, id)`) is answered
 *   FOPEN_PASSTHROUGH with the id of a backing file registered on the session's fd
 *   (`backing_open`: FUSE_DEV_IOC_BACKING_OPEN, which needs CAP_SYS_ADMIN). The kernel
 *   then reads that file for the handle itself, in the reader's thread, without a READ
 *   request: a large batch file, written into a memfd, reads at tmpfs speed, and its pages
 *   are not the FUSE inode's (which an open without keep_cache drops and read-ahead
 *   allocates again for every batch).
 *
 * Built against the same libfuse headers as pyfuse3 (pkg-config fuse3), so the bitfield
 * is where pyfuse3's libfuse expects it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>

#include <dlfcn.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../distorefs/crc32.h"  /* crc32_of: a priority log record's CRC-32, as zlib computes it */

#define NOFLUSH_FH (UINT64_C(1) << 63)
#define PASSTHROUGH_FH (UINT64_C(1) << 61)  /* (FRONT_FH is bit 62) */

#define XATTR_PREFIX "user.distorefs."  /* mount/nodes.py XATTR_PREFIX (test_page_cache reads both kinds) */

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t,
                                               void *);
typedef void (*getxattr_fn)(fuse_req_t, fuse_ino_t, const char *, size_t);
typedef void (*file_op_fn)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef int (*reply_attr_fn)(fuse_req_t, const struct stat *, double);
typedef int (*reply_entry_fn)(fuse_req_t, const struct fuse_entry_param *);
typedef int (*session_fd_fn)(struct fuse_session *);
typedef int (*receive_buf_fn)(struct fuse_session *, struct fuse_buf *);
typedef void (*process_buf_fn)(struct fuse_session *, const struct fuse_buf *);
typedef void (*session_destroy_fn)(struct fuse_session *);
typedef int (*session_mount_fn)(struct fuse_session *, const char *);
typedef int (*custom_io_fn)(struct fuse_session *, const struct fuse_custom_io *, int);
typedef void (*init_fn)(void *, struct fuse_conn_info *);
typedef void (*write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t, struct fuse_file_info *);

/* The kernel's request layout (linux/fuse.h, which clashes with libfuse's headers):
   struct fuse_in_header is 40 bytes with the opcode at offset 4; a GETXATTR's name follows
   its 8-byte struct fuse_getxattr_in. */
#define IN_HEADER_SIZE 40
#define IN_OPCODE_OFFSET 4
#define GETXATTR_IN_SIZE 8
#define OPCODE_LOOKUP 1
#define OPCODE_GETATTR 3
#define OPCODE_FLUSH 25
#define OPCODE_GETXATTR 22
#define OPCODE_IOCTL 39
#define OPCODE_CREATE 35
#define CREATE_IN_SIZE 16  /* struct fuse_create_in: flags, mode, umask, open_flags; then the name */
#define IN_UID_OFFSET 24
#define IN_GID_OFFSET 28
#define IN_NODEID_OFFSET 16
#define IN_PID_OFFSET 32  /* the asking thread's id */
#define FLUSH_IN_FH_OFFSET 0  /* struct fuse_flush_in: fh first */
#define FLUSH_IN_SIZE 24
#define OPCODE_RELEASE 18
#define OPCODE_OPEN 14
#define OPEN_IN_SIZE 8  /* struct fuse_open_in: flags, open_flags */
#define OPCODE_WRITE 16
#define WRITE_IN_SIZE 40  /* struct fuse_write_in: fh, offset, size, write_flags, lock_owner, flags, padding */
#define WRITE_IN_SIZE_OFFSET 16
#define FRONT_FH (UINT64_C(1) << 62)  /* handle numbers the front gives out (Python's count from 1) */
#define RELEASE_IN_SIZE 24  /* struct fuse_release_in: fh first */
#define OUT_HEADER_SIZE 16  /* struct fuse_out_header: len, error, unique */
#define INIT_OUT_FLAGS_OFFSET 12  /* struct fuse_init_out: major, minor, max_readahead, flags */
#define KERNEL_PARALLEL_DIROPS (UINT32_C(1) << 18)  /* FUSE_PARALLEL_DIROPS of linux/fuse.h */
#define OPCODE_INIT 26
#define KERNEL_WRITEBACK_CACHE (UINT32_C(1) << 16)
#define KERNEL_INIT_EXT (UINT32_C(1) << 30)
#define KERNEL_PASSTHROUGH2 (UINT32_C(1) << 5)  /* FUSE_PASSTHROUGH (bit 37), in flags2 */
#define INIT_IN_FLAGS_OFFSET 12  /* struct fuse_init_in: major, minor, max_readahead, flags, flags2 */
#define INIT_IN_FLAGS2_OFFSET 16
#define INIT_OUT_FLAGS2_OFFSET 32  /* struct fuse_init_out (7.40): ..., flags2, max_stack_depth */
#define INIT_OUT_STACK_DEPTH_OFFSET 36
#define FOPEN_DIRECT_IO_BIT 1
#define FOPEN_KEEP_CACHE_BIT 2
#define FOPEN_NONSEEKABLE_BIT 4
#define FOPEN_NOFLUSH_BIT 32
#define FOPEN_PASSTHROUGH_BIT 128
struct backing_map { int32_t fd; uint32_t flags; uint64_t padding; };  /* struct fuse_backing_map */
#define DEV_IOC_BACKING_OPEN _IOW(229, 1, struct backing_map)
#define DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)
#define PASSTHROUGH_MAX 64  /* passthrough opens Python answered whose reply is not sent yet */
#define RELEASE_MAX 1024    /* handles whose RELEASE the front may answer, and answered ones not yet taken */
#define HELD_MAX 64  /* handles with nothing at flush, and handles the front opened, at most */
/* Inodes with held attributes at most: every buffer's entries/ in use holds one for good, and
   its `priorities` another (64 ran out in a mount with some forty buffers: their GETATTRs
   went to Python). Searched linearly, over the inodes held only. */
#define HOLDS_MAX 1024

#define FRONT_QUEUE 64  /* requests read ahead of pyfuse3 at most (the kernel's own queue holds the rest) */
#define FRONT_SPARE 8   /* request buffers (libfuse's size, about 1 MiB each) kept for reuse */

static reply_open_fn libfuse_reply_open;
static session_new_fn libfuse_session_new;
static session_fd_fn libfuse_session_fd;
static receive_buf_fn libfuse_receive_buf;
static process_buf_fn libfuse_process_buf;
static session_destroy_fn libfuse_session_destroy;
static session_mount_fn libfuse_session_mount;
static custom_io_fn libfuse_custom_io;
static init_fn handler_init;  /* pyfuse3's */
/* The flags the INIT reply of front_se gains (set by its INIT handler, taken by the writev that
   sends the reply), and whether the kernel was given parallel directory operations. */
static uint32_t init_adds;
static int parallel_dirops;
static uint32_t kernel_init_flags2;  /* what the kernel's INIT offered (io_read) */
static int passthrough_wanted = 1;   /* set_passthrough(False): the next session does not ask */
static int passthrough_on;            /* the INIT reply asked for it */
static int session_dev_fd = -1;       /* the session's /dev/fuse descriptor, for the backing ioctls */
static pthread_mutex_t passthrough_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t fh; int32_t id; } passthrough_ids[PASSTHROUGH_MAX];
static unsigned passthrough_count;
static unsigned long long passthrough_replies;
static reply_attr_fn libfuse_reply_attr;
static reply_entry_fn libfuse_reply_entry;
static getxattr_fn handler_getxattr;  /* pyfuse3's */
static struct fuse_lowlevel_ops session_ops;  /* libfuse keeps a copy; this one outlives the call anyway */
static unsigned long long noflush_replies;
static unsigned long long foreign_xattr_replies;
static unsigned long long ioctl_replies;
static int answer_foreign_xattrs = 1;

/* The front. Its queue, spares and end are guarded by front_lock; front_se and front_efd
   are set before the thread starts and read-only after. */
static int front_wanted = 1;
static struct fuse_session *front_se;  /* the session fuse_session_new made with session_ops */
static int front_efd = -1;             /* one count per queued request (EFD_SEMAPHORE) */
/* Written when the front answered a request Python wants to hear of at once (notes_fd). */
static int notes_efd = -1;
static int front_started;
static pthread_t front_thread;
static pthread_mutex_t front_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t front_room = PTHREAD_COND_INITIALIZER;
static struct queued { void *mem; size_t size; } front_queue[FRONT_QUEUE];
static unsigned front_head, front_count;
static void *front_spares[FRONT_SPARE];
static unsigned front_spare_count;
static int front_ended, front_result;
static unsigned long long front_passed;  /* requests handed to pyfuse3 */

/* What Python leaves to the front, guarded by held_lock. */
/* `once`: given by Python with an answer it made (give_attributes) for the GETATTR that
   follows it; answered once, and only until `until` (CLOCK_MONOTONIC seconds). */
static struct held { uint64_t ino; int valid; int once; double until; struct stat attr; double timeout; } held[HOLDS_MAX];
static unsigned held_count;
/* Handles whose FLUSH the front answers: nothing to do at close once `pending` commits
   Python queued for them are done (flush_pending, flush_committed); a FLUSH that comes
   before is parked and answered by the last of them, with the first error seen. */
struct parked { fuse_req_t req; struct parked *next; };
static struct flushing { uint64_t fh; int python; unsigned pending; int err; struct parked *parked; } flushing[HELD_MAX];
static unsigned flushing_count;
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t release_free[RELEASE_MAX];  /* handles whose release is Python's bookkeeping only */
/* release_free[i]'s RELEASE writes notes_efd: Python has work to do at it at once (a learner's
   batch/N.npz opened through Python: the next batch goes into the page cache while it trains) */
static unsigned char release_free_wake[RELEASE_MAX];
static unsigned release_free_count;
static uint64_t released[RELEASE_MAX];  /* answered here, for Python to take */
static unsigned released_count;
/* Inodes whose opens of one access mode the front answers itself (answer_opens: a hash
   table, open addressing, inode 0 marks a free slot), the handles it gave out that are not
   released yet (Python adopts one, adopt_opened, at its first request that reaches Python),
   and the inodes of ONCE marks opened here, for Python to take (take_opened). */
/* A power of 2; filled to 3/4 at most (196,608 marks, 4 MiB): a cold epoch's prefetcher
   pushes values far ahead of the readers (a mark each), and with 16,384 slots the marks of
   an epoch of 100,000 items ran out, its later opens going through Python. */
#define MARKS_MAX 262144
#define MARK_KEEP_CACHE 1
#define MARK_NOFLUSH 2
#define MARK_ONCE 4  /* one open, then the mark goes and the inode is noted for Python */
#define MARK_ADOPTED 8  /* the handle is Python's from the open on (take_opened gives its number):
                           its RELEASE goes to take_released */
#define MARK_PRIORITIES 16  /* a buffer's `priorities` (its ns_id the mark's tag): the front takes
                               its handles' WRITEs of whole, well-formed lines (see priority_log) */
#define NOTICES_MAX 4096
/* pid: only opens by that thread (0: anyone's) */
static struct mark { uint64_t ino; int accmode; int flags; uint32_t pid; uint32_t tag; } marks[MARKS_MAX];
static unsigned marks_count;
/* adopted: an `adopted` mark's handle, Python's from the open on, whose RELEASE writes
   notes_efd (Python takes it, and the open's note, at once); tag: a MARK_PRIORITIES handle's
   buffer (0: not one); passed: one of its WRITEs went to Python (a line left open, say), and
   so do the rest, in order behind it */
static struct { uint64_t fh; uint64_t ino; uint32_t flags; int adopted; uint32_t tag; int passed; } opened[HELD_MAX];
static unsigned opened_count;
static uint64_t opened_next;
static struct notice { uint64_t ino; uint64_t fh; } notices[NOTICES_MAX];
static unsigned notices_count;
static unsigned long long front_opens, front_releases;  /* releases: of handles Python never saw */

/* `priorities` WRITEs the front answered (distorefs/priowal.py): each appended to the store's
   write-ahead file before its reply, so that the close that follows has nothing to wait for,
   and queued for Python to commit (take_writes). The file, its numbering and size are
   guarded by log_lock (the front appends, the committer's thread trims); the queue by
   held_lock. A WRITE the front cannot take (no file, queue full, a failed append, lines
   Python must read) goes to Python, which commits it before the close returns. */
#define WRITES_MAX 256
#define WRITE_TAKE_MAX (64 << 10)  /* a longer WRITE goes to Python */
#define LOG_MAGIC UINT32_C(0x4C525044)
#define LOG_HEAD_SIZE 20  /* magic u32, ns_id u32, number u64, length u32; then crc u32 */
#define LOG_TRIM_BYTES (1 << 20)  /* the file is emptied once past this and all committed */
/* Past this the front takes no more until the file is emptied: a trim needs a moment when
   everything appended is committed, which writes coming faster than Python commits them
   could put off for good; going to Python meanwhile, they let it catch up. */
#define LOG_MAX_BYTES (64 << 20)
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_fd = -1;
static uint64_t log_next;  /* the number the next record gets */
static off_t log_bytes;    /* where the next record goes */
static double priority_max = 1e15;  /* distorefs.config.MAX_PRIORITY */
static struct taken_write { uint32_t tag; uint64_t number; char *text; uint32_t size; } writes[WRITES_MAX];
static unsigned writes_count;
static unsigned long long front_writes, log_trims;
static write_buf_fn handler_write_buf;  /* pyfuse3's */
static file_op_fn handler_getattr, handler_flush, handler_release, handler_open;  /* pyfuse3's */
static unsigned long long front_getattrs, front_flushes;  /* RELEASEs of Python's handles: Python counts them as it takes them */
/* On the front's thread: the answer answered_in_c found for the request it processes next. */
static __thread struct { int opcode; struct stat attr; double timeout; uint64_t fh; int mark; size_t size; } front_answer;

/* Entry WRITEs the front collects (collect_writes, take_collected): the bytes a new entry's
   writer writes are kept here, each WRITE answered by the front, until Python's first
   request of the handle (its close's FLUSH, which commits them) takes them. */
#define COLLECT_MAX 64  /* handles collecting at once */
#define COLLECT_HANDLE_MAX (8 << 20)  /* bytes one handle collects at most (then: Python's, with them) */
#define COLLECT_TOTAL_MAX (64 << 20)  /* bytes all collecting handles hold at most */
static pthread_mutex_t collect_lock = PTHREAD_MUTEX_INITIALIZER;
static struct collect {
    uint64_t fh, ino, limit;
    char *data;
    size_t size, cap;
    int passed;
    struct stat attr;  /* the writer's attributes but size and times (a GETATTR's answer) */
    double timeout;
} collects[COLLECT_MAX];
static unsigned collect_count;
static size_t collect_bytes;  /* what the handles' buffers take together */
static unsigned long long collected_writes;

/* Checkpoint WRITEs the front copies into chunks Python lends (chunks_arm...): per armed
   handle, where its next WRITE must land (pos), the chunks lent (the Py_buffer keeps each
   bytearray from being resized; the front writes into it without the GIL, Python reads it
   only once taken back), and `passed` once a WRITE went to Python. Chunks filled whole wait
   in `fulls` for Python. Guarded by chunk_lock. */
#define CHUNKERS_MAX 64
#define CHUNK_SLOTS 8
#define FULLS_MAX 256
struct chunk_slot { Py_buffer view; uint64_t index; uint64_t filled; };
static pthread_mutex_t chunk_lock = PTHREAD_MUTEX_INITIALIZER;
static struct chunker {
    uint64_t fh, pos, chunk_bytes, limit;
    int passed;
    unsigned nslots;
    struct chunk_slot slots[CHUNK_SLOTS];
} chunkers[CHUNKERS_MAX];
static unsigned chunker_count;
static struct { uint64_t fh; struct chunk_slot slot; } fulls[FULLS_MAX];
static unsigned full_count;
static unsigned long long chunked_writes, chunks_filled, writes_landed;
/* The handle the front reads for (0: none): the one whose WRITE it took last, or whose
   chunk was last lent where it writes next; the next request is read with its payload
   landing where that handle's next WRITE would go (read_landing). */
static uint64_t landing_fh;

/* Names directories hold (absent_names, name_counted): per directory inode, an
   open-addressed table of the names' 64-bit hashes (0: an empty slot) with a count each
   (a name a ring holds and writers hold too counts once for each). */
#define NAME_DIRS_MAX 256  /* directories answered at once (then: Python's, as before) */
#define NAME_MAX_BYTES 255  /* longer: Python's (ENAMETOOLONG) */
typedef void (*lookup_fn)(fuse_req_t, fuse_ino_t, const char *);
static lookup_fn handler_lookup;  /* pyfuse3's */
static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;
struct name_slot { uint64_t hash; uint64_t count; };
static struct name_dir {
    uint64_t ino;
    struct name_slot *slots;
    size_t mask, used;  /* slots - 1 (a power of two less one), slots in use */
    int creates;  /* the front answers CREATEs of names it lacks here (answer_creates) */
    uint64_t create_limit;  /* bytes its writers collect at most (the buffer's max_entry_bytes) */
    double create_timeout;  /* how long the kernel may cache a created entry's name and attributes */
} name_dirs[NAME_DIRS_MAX];
static unsigned name_dir_count;
static uint64_t name_seed;  /* (random: no name collides with another by design of its writer) */
static unsigned long long front_lookups;

/* Entry CREATEs the front answers: inode numbers Python reserved for them (names_lock), and
   the creates answered, for Python to take (take_created; held_lock). */
#define CREATE_POOL_MAX 256
#define CREATED_MAX 256
typedef void (*create_fn)(fuse_req_t, fuse_ino_t, const char *, mode_t, struct fuse_file_info *);
static create_fn handler_create;  /* pyfuse3's */
static uint64_t create_pool[CREATE_POOL_MAX];
static unsigned create_pool_count;
static unsigned create_dirs;  /* directories with `creates` on */
static struct created {
    uint64_t dir, ino, fh;
    uint32_t flags, mode, uid, gid, pid;
    uint32_t namelen;
    char name[NAME_MAX_BYTES + 1];
} created[CREATED_MAX];
static unsigned created_count;
static unsigned long long front_creates;

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
    session_fd_fn session_fd = (session_fd_fn)dlsym(lib, "fuse_session_fd");
    receive_buf_fn receive_buf = (receive_buf_fn)dlsym(lib, "fuse_session_receive_buf");
    session_destroy_fn session_destroy = (session_destroy_fn)dlsym(lib, "fuse_session_destroy");
    if (reply != fuse_reply_open && session_new != fuse_session_new && session_fd != fuse_session_fd &&
        receive_buf != fuse_session_receive_buf && session_destroy != fuse_session_destroy) {
        libfuse_reply_open = reply;
        libfuse_session_new = session_new;
        libfuse_session_fd = session_fd;
        libfuse_receive_buf = receive_buf;
        libfuse_process_buf = (process_buf_fn)dlsym(lib, "fuse_session_process_buf");
        libfuse_session_destroy = session_destroy;
        libfuse_reply_attr = (reply_attr_fn)dlsym(lib, "fuse_reply_attr");
        libfuse_reply_entry = (reply_entry_fn)dlsym(lib, "fuse_reply_entry");
        libfuse_session_mount = (session_mount_fn)dlsym(lib, "fuse_session_mount");
        libfuse_custom_io = (custom_io_fn)dlsym(lib, "fuse_session_custom_io");
    }
}

static struct held *held_find(uint64_t ino)  /* with held_lock held */
{
    for (unsigned i = 0; i < held_count; i++)
        if (held[i].ino == ino)
            return &held[i];
    return NULL;
}

static double monotonic_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Slots of `held` that only attributes given `once` take: lasting holds never crowd out the
   attributes Python gives at an OPEN for the GETATTR that follows (a sample file's new
   size): with the table full of lasting holds, those went to Python every time. A lasting
   hold past the rest is not made (Python answers its GETATTRs). */
#define HELD_ONCE_ROOM 16

static int held_lasting_room(void)  /* with held_lock held */
{
    unsigned lasting = 0;
    for (unsigned i = 0; i < held_count; i++)
        lasting += !held[i].once;
    return lasting < HOLDS_MAX - HELD_ONCE_ROOM;
}

/* A slot for `ino`'s attributes (with held_lock held): its own, a free one, or the one of
   the hold given once that ends first (a GETATTR that never came: the kernel held them
   still); NULL: none (a lasting hold past HOLDS_MAX - HELD_ONCE_ROOM, or the table full of
   lasting holds). */
static struct held *held_slot(uint64_t ino, int lasting)
{
    struct held *h = held_find(ino), *first = NULL;
    if (h != NULL)
        return h;
    if (lasting && !held_lasting_room())
        return NULL;
    if (held_count < HOLDS_MAX) {
        h = &held[held_count++];
        *h = (struct held){.ino = ino};
        return h;
    }
    for (unsigned i = 0; i < held_count; i++)
        if (held[i].once && (first == NULL || held[i].until < first->until))
            first = &held[i];
    if (first != NULL)
        *first = (struct held){.ino = ino};
    return first;
}

/* Attributes of inodes whose attributes change only by an act Python sees (a sealed
   dataset's items, Python's keep_attributes): the front answers their GETATTRs, until Python
   forgets them. The kernel may hold such inodes from before they were sealed, with attributes
   it may not cache: the permission check of every first open asked Python again. Open
   addressing by inode number (linear probing, deletion by shifting back); made at the
   first keep; at most KEPT_MAX of them. With held_lock held. */
#define KEPT_BITS 14
#define KEPT_SLOTS (1u << KEPT_BITS)
#define KEPT_MAX (KEPT_SLOTS / 2)
static struct kept { uint64_t ino; struct stat attr; double timeout; } *kept;  /* ino 0: free */
static unsigned kept_count;

static unsigned kept_home(uint64_t ino)
{
    return (unsigned)((ino * 0x9E3779B97F4A7C15ull) >> (64 - KEPT_BITS));  /* Fibonacci hashing */
}

static struct kept *kept_find(uint64_t ino)
{
    if (kept_count == 0 || ino == 0)
        return NULL;
    for (unsigned i = kept_home(ino);; i = (i + 1) & (KEPT_SLOTS - 1)) {
        if (kept[i].ino == ino)
            return &kept[i];
        if (kept[i].ino == 0)
            return NULL;
    }
}

static struct kept *kept_slot(uint64_t ino)  /* NULL: no room */
{
    struct kept *k = kept_find(ino);
    if (k != NULL)
        return k;
    if (ino == 0 || kept_count >= KEPT_MAX)
        return NULL;
    if (kept == NULL && (kept = calloc(KEPT_SLOTS, sizeof(*kept))) == NULL)
        return NULL;
    unsigned i = kept_home(ino);
    while (kept[i].ino != 0)
        i = (i + 1) & (KEPT_SLOTS - 1);
    kept[i].ino = ino;
    kept_count++;
    return &kept[i];
}

static void kept_drop(uint64_t ino)
{
    struct kept *k = kept_find(ino);
    if (k == NULL)
        return;
    unsigned hole = (unsigned)(k - kept);
    kept[hole].ino = 0;
    kept_count--;
    /* Shift back the entries after it that the hole would cut off from their home slot. */
    for (unsigned i = (hole + 1) & (KEPT_SLOTS - 1); kept[i].ino != 0; i = (i + 1) & (KEPT_SLOTS - 1)) {
        unsigned home = kept_home(kept[i].ino);
        if (((hole - home) & (KEPT_SLOTS - 1)) < ((i - home) & (KEPT_SLOTS - 1))) {  /* the hole is on its way */
            kept[hole] = kept[i];
            kept[i].ino = 0;
            hole = i;
        }
    }
}

static int number_at(const uint64_t *numbers, unsigned count, uint64_t n)  /* its index or -1 */
{
    for (unsigned i = 0; i < count; i++)
        if (numbers[i] == n)
            return (int)i;
    return -1;
}

static struct flushing *flushing_find(uint64_t fh)  /* with held_lock held */
{
    for (unsigned i = 0; i < flushing_count; i++)
        if (flushing[i].fh == fh)
            return &flushing[i];
    return NULL;
}

static struct flushing *flushing_add(uint64_t fh, int python)  /* with held_lock held; NULL: no room */
{
    if (flushing_count == HELD_MAX)
        return NULL;
    flushing[flushing_count] = (struct flushing){.fh = fh, .python = python};
    return &flushing[flushing_count++];
}

static unsigned mark_home(uint64_t ino)
{
    return (unsigned)((ino * UINT64_C(0x9E3779B97F4A7C15)) >> 40) & (MARKS_MAX - 1);
}

static struct mark *mark_find(uint64_t ino)  /* with held_lock held */
{
    for (unsigned i = mark_home(ino);; i = (i + 1) & (MARKS_MAX - 1)) {
        if (marks[i].ino == ino)
            return &marks[i];
        if (marks[i].ino == 0)
            return NULL;
    }
}

static int mark_set(uint64_t ino, int accmode, int flags, uint32_t pid, uint32_t tag)  /* with held_lock held; 0: no room */
{
    unsigned i = mark_home(ino);
    while (marks[i].ino != 0 && marks[i].ino != ino)
        i = (i + 1) & (MARKS_MAX - 1);
    if (marks[i].ino == 0) {
        if (ino == 0 || marks_count >= MARKS_MAX / 4 * 3)
            return 0;
        marks_count++;
    }
    marks[i] = (struct mark){ino, accmode, flags, pid, tag};
    return 1;
}

static void mark_drop(uint64_t ino)  /* with held_lock held */
{
    unsigned i = mark_home(ino);
    while (marks[i].ino != ino) {
        if (marks[i].ino == 0)
            return;
        i = (i + 1) & (MARKS_MAX - 1);
    }
    marks_count--;
    /* Backward shift: a later mark of the same run moves into the hole unless the hole lies
       before its home slot (then a search for it would stop at the hole). */
    for (unsigned j = (i + 1) & (MARKS_MAX - 1); marks[j].ino != 0; j = (j + 1) & (MARKS_MAX - 1)) {
        unsigned from_home = (j - mark_home(marks[j].ino)) & (MARKS_MAX - 1);
        if (from_home >= ((j - i) & (MARKS_MAX - 1))) {
            marks[i] = marks[j];
            i = j;
        }
    }
    marks[i].ino = 0;
}

/* Answer the FLUSHes parked on `f` (none pending any more) with its first error, taken. */
static struct parked *flushing_unpark(struct flushing *f, int *err)  /* with held_lock held */
{
    struct parked *p = f->parked;
    *err = f->err;
    f->parked = NULL;
    if (p != NULL)
        f->err = 0;  /* reported once */
    return p;
}

static void reply_parked(struct parked *p, int err)  /* without held_lock */
{
    while (p != NULL) {
        struct parked *next = p->next;
        fuse_reply_err(p->req, err);
        free(p);
        p = next;
    }
}

/* Python's attribute replies: kept for the inodes it holds. */
static void held_remember(const struct stat *attr, double timeout)
{
    pthread_mutex_lock(&held_lock);
    struct held *h = held_count ? held_find((uint64_t)attr->st_ino) : NULL;
    if (h != NULL) {
        h->attr = *attr;
        h->timeout = timeout;
        h->valid = 1;
    }
    struct kept *k = kept_find((uint64_t)attr->st_ino);
    if (k != NULL) {
        k->attr = *attr;
        k->timeout = timeout;
    }
    pthread_mutex_unlock(&held_lock);
}

int fuse_reply_attr(fuse_req_t req, const struct stat *attr, double attr_timeout)
{
    if (held_count || kept_count)  /* unlocked peek: a hold made now applies from the next reply */
        held_remember(attr, attr_timeout);
    return libfuse_reply_attr(req, attr, attr_timeout);
}

int fuse_reply_entry(fuse_req_t req, const struct fuse_entry_param *e)
{
    if ((held_count || kept_count) && e->ino != 0)
        held_remember(&e->attr, e->attr_timeout);
    return libfuse_reply_entry(req, e);
}

static uint64_t name_hash(const char *name, size_t n)
{
    uint64_t h = UINT64_C(0xcbf29ce484222325) ^ name_seed;  /* FNV-1a, then a 64-bit finalizer */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)name[i];
        h *= UINT64_C(0x100000001b3);
    }
    h ^= h >> 33;
    h *= UINT64_C(0xff51afd7ed558ccd);
    h ^= h >> 33;
    h *= UINT64_C(0xc4ceb9fe1a85ec53);
    h ^= h >> 33;
    return h ? h : 1;
}

static struct name_dir *name_dir_find(uint64_t ino)  /* with names_lock held */
{
    for (unsigned i = 0; i < name_dir_count; i++)
        if (name_dirs[i].ino == ino)
            return &name_dirs[i];
    return NULL;
}

static struct name_slot *name_slot_find(const struct name_dir *d, uint64_t hash)  /* NULL: not held */
{
    for (size_t i = hash & d->mask;; i = (i + 1) & d->mask) {
        if (d->slots[i].hash == hash)
            return &d->slots[i];
        if (d->slots[i].hash == 0)
            return NULL;
    }
}

/* The length of the name at `name` (at most `room` bytes) if the front may answer for it;
   0 if not terminated there, or a name Python refuses (empty, `.`, `..`, past 255 bytes):
   Python's, for its errno. */
static size_t name_for_front(const char *name, size_t room)
{
    size_t n = strnlen(name, room);
    if (n == room || n == 0 || n > NAME_MAX_BYTES || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return 0;
    return n;
}

static void name_dir_end(struct name_dir *d)  /* with names_lock held: its LOOKUPs are Python's */
{
    if (d->creates)
        create_dirs--;
    free(d->slots);
    *d = name_dirs[--name_dir_count];
}

/* One more holder of `hash`; 0: no memory (the directory's LOOKUPs are Python's again). */
static int name_slot_add(struct name_dir *d, uint64_t hash, uint64_t count)
{
    struct name_slot *held = name_slot_find(d, hash);
    if (held != NULL) {
        held->count += count;
        return 1;
    }
    if ((d->used + 1) * 2 > d->mask + 1) {  /* at most half full: probes stay short */
        size_t slots = (d->mask + 1) * 2;
        struct name_slot *grown = calloc(slots, sizeof(*grown));
        if (grown == NULL)
            return 0;
        struct name_slot *old = d->slots;
        size_t old_slots = d->mask + 1;
        d->slots = grown;
        d->mask = slots - 1;
        for (size_t i = 0; i < old_slots; i++)
            if (old[i].hash != 0) {
                size_t j = old[i].hash & d->mask;
                while (grown[j].hash != 0)
                    j = (j + 1) & d->mask;
                grown[j] = old[i];
            }
        free(old);
    }
    size_t i = hash & d->mask;
    while (d->slots[i].hash != 0)
        i = (i + 1) & d->mask;
    d->slots[i] = (struct name_slot){hash, count};
    d->used++;
    return 1;
}

static void name_slot_drop(struct name_dir *d, uint64_t hash)
{
    struct name_slot *held = name_slot_find(d, hash);
    if (held == NULL || --held->count > 0)
        return;
    /* Emptied: the slots after it in its run move back where their probe would find them
       (no tombstones: a table whose names come and go forever stays as short to probe). */
    size_t i = (size_t)(held - d->slots), j = i;
    for (;;) {
        j = (j + 1) & d->mask;
        if (d->slots[j].hash == 0)
            break;
        size_t home = d->slots[j].hash & d->mask;
        if (((j - home) & d->mask) >= ((j - i) & d->mask)) {  /* its home is at or before i */
            d->slots[i] = d->slots[j];
            i = j;
        }
    }
    d->slots[i] = (struct name_slot){0, 0};
    d->used--;
}

static void lookup_absent(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    if (front_answer.opcode == OPCODE_LOOKUP) {  /* the front's thread: not a name the directory holds */
        front_answer.opcode = 0;
        __atomic_add_fetch(&front_lookups, 1, __ATOMIC_RELAXED);
        fuse_reply_err(req, ENOENT);
        return;
    }
    handler_lookup(req, parent, name);
}

static void create_answered(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                            struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_CREATE) {  /* the front's thread: noted in `created` already */
        struct fuse_entry_param e;
        struct fuse_file_info out;
        front_answer.opcode = 0;
        memset(&e, 0, sizeof(e));
        memset(&out, 0, sizeof(out));
        e.ino = front_answer.attr.st_ino;
        e.attr = front_answer.attr;
        e.attr_timeout = e.entry_timeout = front_answer.timeout;
        out.fh = front_answer.fh;
        out.flags = fi->flags;
        __atomic_add_fetch(&front_creates, 1, __ATOMIC_RELAXED);
        fuse_reply_create(req, &e, &out);
        return;
    }
    handler_create(req, parent, name, mode, fi);
}

static void getattr_held(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_GETATTR) {  /* the front's thread, with the answer */
        front_answer.opcode = 0;
        __atomic_add_fetch(&front_getattrs, 1, __ATOMIC_RELAXED);
        libfuse_reply_attr(req, &front_answer.attr, front_answer.timeout);
        return;
    }
    handler_getattr(req, ino, fi);
}

static void open_answered(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_OPEN) {  /* its number is in `opened` already */
        struct fuse_file_info out;
        front_answer.opcode = 0;
        memset(&out, 0, sizeof(out));
        out.fh = front_answer.fh;
        out.keep_cache = (front_answer.mark & MARK_KEEP_CACHE) != 0;
        out.noflush = (front_answer.mark & MARK_NOFLUSH) != 0;
        __atomic_add_fetch(&front_opens, 1, __ATOMIC_RELAXED);
        libfuse_reply_open(req, &out);
        return;
    }
    handler_open(req, ino, fi);
}

static void release_answered(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_RELEASE) {  /* its number is in `released` already */
        front_answer.opcode = 0;
        fuse_reply_err(req, 0);
        return;
    }
    handler_release(req, ino, fi);
}

static void flush_answered(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_FLUSH) {
        front_answer.opcode = 0;
        __atomic_add_fetch(&front_flushes, 1, __ATOMIC_RELAXED);
        struct parked *p = malloc(sizeof(*p));
        int err = 0;
        pthread_mutex_lock(&held_lock);
        struct flushing *f = flushing_find(fi->fh);
        if (f != NULL && f->pending && p != NULL) {  /* answered by the last commit it waits for */
            *p = (struct parked){req, f->parked};
            f->parked = p;
            req = NULL;
        } else if (f != NULL) {
            err = f->err;
            f->err = 0;
        }
        pthread_mutex_unlock(&held_lock);
        if (req != NULL) {
            free(p);
            fuse_reply_err(req, err);
        }
        return;
    }
    handler_flush(req, ino, fi);
}

static void write_taken(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                        struct fuse_file_info *fi)
{
    if (front_answer.opcode == OPCODE_WRITE) {  /* appended and queued already */
        front_answer.opcode = 0;
        fuse_reply_write(req, front_answer.size);
        return;
    }
    handler_write_buf(req, ino, bufv, off, fi);
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

/* pyfuse3's INIT handler, then: the flag libfuse wants but leaves out of its reply. Runs in
   libfuse's do_init just before that reply is written (io_writev). */
static void init_wanting_parallel_dirops(void *userdata, struct fuse_conn_info *conn)
{
    handler_init(userdata, conn);
    uint32_t adds = 0;
    if ((conn->want & FUSE_CAP_PARALLEL_DIROPS) && (conn->capable & FUSE_CAP_PARALLEL_DIROPS))
        adds |= KERNEL_PARALLEL_DIROPS;
    if (passthrough_wanted && (kernel_init_flags2 & KERNEL_PASSTHROUGH2) && !(conn->want & FUSE_CAP_WRITEBACK_CACHE))
        adds |= KERNEL_INIT_EXT;  /* (stands for: and passthrough, in flags2) */
    if (adds)
        __atomic_store_n(&init_adds, adds, __ATOMIC_RELEASE);
}

static ssize_t read_landing(int fd, char *buf, size_t len);

/* The session's reads (the front's thread). The device is non-blocking (fuse_session_mount):
   read_landing holds chunk_lock across its read, which must not wait for a request. */
static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    ssize_t n;
    for (;;) {
        n = read_landing(fd, buf, len);
        if (n >= 0 || errno != EAGAIN)
            break;
        struct pollfd ready = {.fd = fd, .events = POLLIN};
        if (poll(&ready, 1, -1) < 0 && errno != EINTR)
            return -1;
    }
    uint32_t opcode, flags;
    if (n >= IN_HEADER_SIZE + INIT_IN_FLAGS2_OFFSET + 4) {  /* the kernel's INIT: what it offers */
        memcpy(&opcode, (char *)buf + IN_OPCODE_OFFSET, sizeof(opcode));
        if (opcode == OPCODE_INIT) {
            memcpy(&flags, (char *)buf + IN_HEADER_SIZE + INIT_IN_FLAGS_OFFSET, sizeof(flags));
            if (flags & KERNEL_INIT_EXT)
                memcpy(&kernel_init_flags2, (char *)buf + IN_HEADER_SIZE + INIT_IN_FLAGS2_OFFSET,
                       sizeof(kernel_init_flags2));
        }
    }
    return n;
}

/* Every reply of the session; the INIT reply (the first, sent while init_adds is set) gains
   init_adds in a copy of its argument. */
static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    uint32_t adds = __atomic_load_n(&init_adds, __ATOMIC_ACQUIRE) ? __atomic_exchange_n(&init_adds, 0, __ATOMIC_ACQ_REL) : 0;
    if (adds && count == 2 && iov[0].iov_len == OUT_HEADER_SIZE &&
        iov[1].iov_len >= INIT_OUT_FLAGS_OFFSET + sizeof(uint32_t) && iov[1].iov_len <= 256) {
        int32_t error;
        memcpy(&error, (char *)iov[0].iov_base + 4, sizeof(error));
        if (error == 0) {
            unsigned char arg[256];
            uint32_t flags;
            memcpy(arg, iov[1].iov_base, iov[1].iov_len);
            memcpy(&flags, arg + INIT_OUT_FLAGS_OFFSET, sizeof(flags));
            int passthrough = (adds & KERNEL_INIT_EXT) && iov[1].iov_len >= INIT_OUT_STACK_DEPTH_OFFSET + 4 &&
                              !(flags & KERNEL_WRITEBACK_CACHE);
            flags |= adds & ~KERNEL_INIT_EXT;
            if (passthrough) {
                uint32_t flags2, depth = 1;  /* backing files on a filesystem that stacks on none */
                memcpy(&flags2, arg + INIT_OUT_FLAGS2_OFFSET, sizeof(flags2));
                flags |= KERNEL_INIT_EXT;
                flags2 |= KERNEL_PASSTHROUGH2;
                memcpy(arg + INIT_OUT_FLAGS2_OFFSET, &flags2, sizeof(flags2));
                memcpy(arg + INIT_OUT_STACK_DEPTH_OFFSET, &depth, sizeof(depth));
            }
            memcpy(arg + INIT_OUT_FLAGS_OFFSET, &flags, sizeof(flags));
            struct iovec patched[2] = {iov[0], {arg, iov[1].iov_len}};
            ssize_t res = writev(fd, patched, 2);
            if (res >= 0 && (adds & KERNEL_PARALLEL_DIROPS))
                __atomic_store_n(&parallel_dirops, 1, __ATOMIC_RELAXED);
            if (res >= 0 && passthrough) {
                __atomic_store_n(&session_dev_fd, fd, __ATOMIC_RELEASE);
                __atomic_store_n(&passthrough_on, 1, __ATOMIC_RELEASE);
            }
            return res;
        }
    }
    return writev(fd, iov, count);
}

static const struct fuse_custom_io front_io = {.read = io_read, .writev = io_writev};

/* Mounted: the session's replies go through io_writev from now on (the kernel's INIT is the
   first request it reads). Without libfuse's custom io the session stays as it was. */
int fuse_session_mount(struct fuse_session *se, const char *mountpoint)
{
    if (libfuse_session_mount == NULL)  /* not reached: the import below fails first */
        return -1;
    int res = libfuse_session_mount(se, mountpoint);
    if (res == 0 && se == front_se && handler_init != NULL && libfuse_custom_io != NULL) {
        int fd = libfuse_session_fd(se);
        if (fd >= 0 && libfuse_custom_io(se, &front_io, fd) == 0) {
            int flags = fcntl(fd, F_GETFL);  /* io_read waits in poll instead (read_landing) */
            if (flags >= 0)
                fcntl(fd, F_SETFL, flags | O_NONBLOCK);
        }
    }
    return res;
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
    if (front_wanted && op->getattr != NULL && op->flush != NULL && op->release != NULL) {
        handler_getattr = op->getattr;
        session_ops.getattr = getattr_held;
        handler_flush = op->flush;
        session_ops.flush = flush_answered;
        handler_release = op->release;
        session_ops.release = release_answered;
        if (op->open != NULL) {
            handler_open = op->open;
            session_ops.open = open_answered;
        }
        if (op->init != NULL) {
            handler_init = op->init;
            session_ops.init = init_wanting_parallel_dirops;
        }
        if (op->write_buf != NULL) {
            handler_write_buf = op->write_buf;
            session_ops.write_buf = write_taken;
        }
        if (op->lookup != NULL) {
            handler_lookup = op->lookup;
            session_ops.lookup = lookup_absent;
        }
        if (op->create != NULL && op->write_buf != NULL) {
            handler_create = op->create;
            session_ops.create = create_answered;
        }
    }
    struct fuse_session *se = libfuse_session_new(args, &session_ops, op_size, userdata);
    if (se != NULL && front_wanted && front_se == NULL)
        front_se = se;
    return se;
}

/* ----- the front ------------------------------------------------------------------------ */

/* Set on the front's thread when the request it answers is one Python hears of at once:
   notes_efd is written after the reply, so that waking Python does not delay it. */
static __thread int notes_due;

static void notes_wake(void)
{
    uint64_t one = 1;
    int fd = __atomic_load_n(&notes_efd, __ATOMIC_ACQUIRE);
    if (fd >= 0 && write(fd, &one, sizeof(one)) < 0) {
        /* full (never, at 2^64 - 1) or closed: Python takes it at its next request */
    }
}

/* Whether the front answers the RELEASE of handle fh: one it opened that Python never saw,
   or one whose release is Python's bookkeeping only (its number goes to `released`, for
   take_released; with no room there, pyfuse3's handler releases it). Out of the front's
   sets either way: this is the handle's last request. With held_lock held. */
static int release_here(uint64_t fh)
{
    int j = -1, wake = 0;
    for (unsigned k = 0; k < opened_count && j < 0; k++)
        if (opened[k].fh == fh)
            j = (int)k;
    if (j >= 0) {
        int adopted = opened[j].adopted;
        opened[j] = opened[--opened_count];
        if (!adopted) {  /* nothing of it anywhere but here */
            struct flushing *f = flushing_find(fh);
            if (f != NULL && !f->pending && f->parked == NULL)
                *f = flushing[--flushing_count];
            front_releases++;
            return 1;
        }
        wake = 1;  /* an adopted handle: its draw is counted, the next batch set aside */
    } else {
        int i = number_at(release_free, release_free_count, fh);
        if (i < 0)
            return 0;
        wake = release_free_wake[i];
        release_free_count--;
        release_free[i] = release_free[release_free_count];
        release_free_wake[i] = release_free_wake[release_free_count];
    }
    if (released_count == RELEASE_MAX)
        return 0;
    released[released_count++] = fh;
    if (wake)
        notes_due = 1;
    return 1;
}

/* Whether `text` is "KEY PRIORITY" lines that distorefs/names.py parse_priorities reads on its
   fast path, every one a priority Buffer.queue_priorities accepts: whole lines (the last ends
   the text), each a key without '#' or '\\' and a plain decimal number in 0..priority_max,
   separated by blanks. Anything else (comments, escapes, a line split across writes, blank
   lines, a bad number) is Python's, which says what is wrong with it. */
static int priorities_text_ok(const char *text, size_t n)
{
    size_t i = 0;
    if (n == 0 || text[n - 1] != '\n')
        return 0;
    while (i < n) {
        while (text[i] == ' ' || text[i] == '\t')
            i++;
        size_t key = i;
        while (!isspace((unsigned char)text[i]) && text[i] != '#' && text[i] != '\\' && text[i] != '\0')
            i++;
        if (i == key || (text[i] != ' ' && text[i] != '\t'))
            return 0;
        while (text[i] == ' ' || text[i] == '\t')
            i++;
        char number[64];
        size_t len = 0;
        while (text[i] != '\0' && strchr("0123456789.eE+-", text[i]) != NULL) {
            if (len == sizeof(number) - 1)
                return 0;
            number[len++] = text[i++];
        }
        while (text[i] == ' ' || text[i] == '\t' || text[i] == '\r')
            i++;
        if (len == 0 || text[i] != '\n')
            return 0;
        i++;
        number[len] = '\0';
        char *end;
        double value = strtod(number, &end);
        if (end != number + len || !isfinite(value) || !(value >= 0) || value > priority_max)
            return 0;
    }
    return 1;
}

/* Append a record of `text` for buffer `tag` (log_lock held): its number, or 0 if it could not
   be written whole (what was written of it is cut off again). */
static uint64_t log_append(uint32_t tag, const char *text, uint32_t length)
{
    unsigned char head[LOG_HEAD_SIZE + 4];
    uint32_t magic = LOG_MAGIC, crc;
    uint64_t number = log_next;
    memcpy(head, &magic, 4);  /* (little-endian, as the machines distorefs runs on) */
    memcpy(head + 4, &tag, 4);
    memcpy(head + 8, &number, 8);
    memcpy(head + 16, &length, 4);
    crc = crc32_of(crc32_of(0, head, LOG_HEAD_SIZE), (const unsigned char *)text, length);
    memcpy(head + LOG_HEAD_SIZE, &crc, 4);
    struct iovec iov[2] = {{head, sizeof(head)}, {(void *)text, length}};
    ssize_t total = (ssize_t)sizeof(head) + length;
    ssize_t n = writev(log_fd, iov, 2);
    if (n != total) {
        if (n > 0 && ftruncate(log_fd, log_bytes) != 0)
            log_fd = -1;  /* a record cut short ends what a replay reads: append nothing after it
                             (the descriptor stays Python's to close) */
        return 0;
    }
    log_bytes += total;
    log_next++;
    return number;
}

/* A WRITE of a `priorities` handle the front opened: taken here if its lines are whole and
   well-formed and it could be appended to the write-ahead file (queued for take_writes; the
   reply follows). 0: Python's, and so are the handle's later WRITEs. */
static int write_taken_here(uint64_t fh, const char *text, uint32_t length)
{
    if ((fh & FRONT_FH) == 0)
        return 0;
    uint32_t tag = 0;
    int k = -1;
    pthread_mutex_lock(&held_lock);
    for (unsigned j = 0; j < opened_count && k < 0; j++)
        if (opened[j].fh == fh)
            k = (int)j;
    if (k >= 0 && !opened[k].passed)
        tag = opened[k].tag;
    int room = writes_count < WRITES_MAX;
    pthread_mutex_unlock(&held_lock);
    if (tag == 0)
        return 0;
    char *copy = NULL;
    uint64_t number = 0;
    if (room && length <= WRITE_TAKE_MAX && priorities_text_ok(text, length) && (copy = malloc(length)) != NULL) {
        memcpy(copy, text, length);
        pthread_mutex_lock(&log_lock);
        if (log_fd >= 0 && log_bytes < LOG_MAX_BYTES)
            number = log_append(tag, text, length);
        pthread_mutex_unlock(&log_lock);
    }
    pthread_mutex_lock(&held_lock);
    /* opened[k] is still this handle: only this thread adds to `opened` or moves its entries
       (release_here), and the handle's RELEASE comes after this WRITE's reply */
    if (number == 0)
        opened[k].passed = 1;
    if (number != 0) {  /* (room: only this thread adds) */
        writes[writes_count++] = (struct taken_write){tag, number, copy, length};
        copy = NULL;
        front_writes++;
    }
    pthread_mutex_unlock(&held_lock);
    free(copy);
    if (number == 0)
        return 0;
    front_answer.opcode = OPCODE_WRITE;
    front_answer.size = length;
    /* Python is not woken for it: it takes the writes before the next request it handles
       (a learner's next batch, a read of what they changed) or within FRONT_NOTES_S, one
       wake-up of the trio loop fewer a step; the file holds them meanwhile. */
    return 1;
}

static struct collect *collect_find(uint64_t fh)  /* with collect_lock held */
{
    for (unsigned i = 0; i < collect_count; i++)
        if (collects[i].fh == fh)
            return &collects[i];
    return NULL;
}

/* A new entry's writer's attributes: size 0, times 0 (the caller sets them). */
static struct stat writer_attr(uint64_t ino, uint32_t mode, uint32_t uid, uint32_t gid)
{
    struct stat attr;
    memset(&attr, 0, sizeof(attr));
    attr.st_ino = (ino_t)ino;
    attr.st_mode = (mode_t)mode;
    attr.st_nlink = 1;
    attr.st_uid = (uid_t)uid;
    attr.st_gid = (gid_t)gid;
    attr.st_blksize = 128 << 10;  /* (mount/nodes.py make_attrs) */
    return attr;
}

/* Handle fh (of inode ino, a writer with attributes mode, uid and gid) collects its WRITEs
   from now on, up to `limit` bytes. 0: no room. With collect_lock held. */
static int collect_start(uint64_t fh, uint64_t ino, uint64_t limit, uint32_t mode, uint32_t uid, uint32_t gid,
                         double timeout)
{
    if (collect_count == COLLECT_MAX)
        return 0;
    collects[collect_count++] = (struct collect){
        .fh = fh, .ino = ino, .limit = limit < COLLECT_HANDLE_MAX ? limit : COLLECT_HANDLE_MAX,
        .attr = writer_attr(ino, mode, uid, gid), .timeout = timeout};
    return 1;
}

/* A WRITE of a handle collecting its bytes (collect_writes): kept here if it lands within
   what was written so far or right after it, and within the handle's limit and the front's
   room (the reply follows). 0: Python's, and so are the handle's later WRITEs (Python takes
   what was collected before it handles this one). */
static int write_collected_here(uint64_t fh, uint64_t off, const char *data, uint32_t length)
{
    if (__atomic_load_n(&collect_count, __ATOMIC_RELAXED) == 0)
        return 0;
    int taken = 0;
    pthread_mutex_lock(&collect_lock);
    struct collect *c = collect_find(fh);
    if (c != NULL && !c->passed) {
        uint64_t end = off + length;
        if (off <= c->size && end >= off && end <= c->limit) {
            if (end > c->cap) {
                size_t cap = c->cap ? c->cap : 4096;
                while (cap < end)
                    cap *= 2;
                if (cap > c->limit)
                    cap = (size_t)c->limit;
                char *grown = collect_bytes - c->cap + cap <= COLLECT_TOTAL_MAX ? realloc(c->data, cap) : NULL;
                if (grown != NULL) {
                    collect_bytes += cap - c->cap;
                    c->data = grown;
                    c->cap = cap;
                }
            }
            if (end <= c->cap) {
                memcpy(c->data + off, data, length);
                if (end > c->size)
                    c->size = (size_t)end;
                collected_writes++;
                taken = 1;
            }
        }
        if (!taken)
            c->passed = 1;
    }
    pthread_mutex_unlock(&collect_lock);
    if (taken) {
        front_answer.opcode = OPCODE_WRITE;
        front_answer.size = length;
    }
    return taken;
}

static struct chunker *chunker_find(uint64_t fh)  /* with chunk_lock held */
{
    for (unsigned i = 0; i < chunker_count; i++)
        if (chunkers[i].fh == fh)
            return &chunkers[i];
    return NULL;
}

/* A WRITE request's handle, offset and length (its struct fuse_write_in after the header). */
static void write_in_of(const char *mem, uint64_t *fh, uint64_t *off, uint32_t *length)
{
    memcpy(fh, mem + IN_HEADER_SIZE, sizeof(*fh));
    memcpy(off, mem + IN_HEADER_SIZE + sizeof(*fh), sizeof(*off));
    memcpy(length, mem + IN_HEADER_SIZE + WRITE_IN_SIZE_OFFSET, sizeof(*length));
}

/* With chunk_lock held: the chunk lent to `c` for chunk `index` of its file, or NULL. */
static struct chunk_slot *chunk_slot_of(struct chunker *c, uint64_t index)
{
    for (unsigned k = 0; k < c->nslots; k++)
        if (c->slots[k].index == index)
            return &c->slots[k];
    return NULL;
}

/* With chunk_lock held: the chunks lent to `c` that [off, end) falls in (at most two), if
   it lands where the last WRITE ended and within the file's limit; 0 otherwise. */
static int chunk_parts(struct chunker *c, uint64_t off, uint64_t end, struct chunk_slot *parts[2])
{
    if (c->passed || end <= off || off != c->pos || end > c->limit)
        return 0;
    uint64_t first = off / c->chunk_bytes, last = (end - 1) / c->chunk_bytes;
    if (last - first >= 2)
        return 0;
    parts[0] = parts[1] = NULL;
    for (uint64_t i = first; i <= last; i++)
        if ((parts[i - first] = chunk_slot_of(c, i)) == NULL)
            return 0;
    return 1;
}

/* With chunk_lock held: [off, end) of `c` is in its chunks `parts` (copied there from
   `data`, or NULL: read into them already); chunks filled whole go to `fulls`. 1: one did
   (Python is to be woken). */
static int chunk_took(struct chunker *c, struct chunk_slot *parts[2], uint64_t off, uint64_t end, const char *data)
{
    uint64_t first = off / c->chunk_bytes, at = off;
    int filled = 0;
    for (uint64_t i = first; at < end; i++) {
        struct chunk_slot *slot = parts[i - first];
        uint64_t lo = at - i * c->chunk_bytes;
        uint64_t n = (end < (i + 1) * c->chunk_bytes ? end : (i + 1) * c->chunk_bytes) - at;
        if (data != NULL)
            memcpy((char *)slot->view.buf + lo, data + (at - off), n);
        slot->filled = lo + n;
        at += n;
    }
    c->pos = end;
    for (unsigned k = 0; k < c->nslots;) {  /* chunks filled whole: Python's to persist */
        if (c->slots[k].filled == c->chunk_bytes && full_count < FULLS_MAX) {
            fulls[full_count].fh = c->fh;
            fulls[full_count++].slot = c->slots[k];
            c->slots[k] = c->slots[--c->nslots];
            chunks_filled++;
            filled = 1;
        } else {
            k++;
        }
    }
    chunked_writes++;
    landing_fh = c->fh;
    return filled;
}

/* Set by read_landing on the front's thread: the WRITE just read landed in its handle's
   chunks and is counted there; answered_in_c replies to it. */
static __thread struct { int set, filled; } landed;

/* A WRITE of an armed checkpoint handle (chunks_arm): copied into the chunks lent if it
   lands where the last one ended, within the file's limit, and every chunk it touches is
   lent (the reply follows; a chunk it fills goes to `fulls` and Python is woken). 0:
   Python's, and so are the handle's later WRITEs (Python stops the handle first). */
static int write_chunked_here(uint64_t fh, uint64_t off, const char *data, uint32_t length)
{
    int taken = 0, filled = 0;
    if (landed.set) {  /* (read into its chunks: read_landing) */
        landed.set = 0;
        taken = 1;
        filled = landed.filled;
    } else {
        if (__atomic_load_n(&chunker_count, __ATOMIC_RELAXED) == 0)
            return 0;
        pthread_mutex_lock(&chunk_lock);
        struct chunker *c = chunker_find(fh);
        if (c != NULL && !c->passed) {
            struct chunk_slot *parts[2];
            if (length > 0 && chunk_parts(c, off, off + length, parts)) {
                filled = chunk_took(c, parts, off, off + length, data);
                taken = 1;
            } else {
                c->passed = 1;
            }
        }
        pthread_mutex_unlock(&chunk_lock);
    }
    if (taken) {
        front_answer.opcode = OPCODE_WRITE;
        front_answer.size = length;
        if (filled)
            notes_due = 1;
    }
    return taken;
}

/* One request from the device into `buf`. While a checkpoint writer streams WRITEs (the
   handle `landing_fh`), the read puts whatever follows a WRITE's 80 bytes of header into
   the chunks where that writer's next WRITE lands, so that its bytes are copied once (the
   kernel's copy), not into `buf` and again into the chunk (that second copy took 28 % of
   the daemon's samples in a 2 GiB checkpoint, most of it for the chunk's cold memory,
   which the kernel's copy now writes). A WRITE that did land there is counted in its
   chunks now (`landed`), with chunk_lock held from before the read, so nobody takes the
   chunks back in between; any other request's bytes are moved back into `buf` before the
   lock is let go. The chunks' bytes past what is filled mean nothing (a lent chunk is
   filled from its start, and Python takes `filled` bytes of it), so a request that lands
   there and goes elsewhere spoils nothing. */
#define WRITE_HEADER (IN_HEADER_SIZE + WRITE_IN_SIZE)
static int landing_off = -1;  /* DISTOREFS_LANDING=0 in the daemon's environment: every read into `buf` */

static ssize_t read_landing(int fd, char *buf, size_t len)
{
    landed.set = 0;
    if (landing_off < 0) {
        const char *env = getenv("DISTOREFS_LANDING");
        landing_off = env != NULL && strcmp(env, "0") == 0;
    }
    if (landing_off || __atomic_load_n(&chunker_count, __ATOMIC_RELAXED) == 0 || len <= WRITE_HEADER)
        return read(fd, buf, len);
    pthread_mutex_lock(&chunk_lock);
    struct chunker *c = landing_fh != 0 ? chunker_find(landing_fh) : NULL;
    struct iovec iov[4];
    int parts = 0;
    size_t room = len - WRITE_HEADER, lent = 0;
    if (c != NULL && !c->passed) {
        for (int part = 0; part < 2 && lent < room; part++) {
            uint64_t at = c->pos + lent, lo = at % c->chunk_bytes;
            struct chunk_slot *slot = chunk_slot_of(c, at / c->chunk_bytes);
            if (slot == NULL)
                break;
            size_t n = c->chunk_bytes - lo < room - lent ? c->chunk_bytes - lo : room - lent;
            iov[1 + parts++] = (struct iovec){(char *)slot->view.buf + lo, n};
            lent += n;
        }
    }
    if (parts == 0) {
        pthread_mutex_unlock(&chunk_lock);
        return read(fd, buf, len);
    }
    iov[0] = (struct iovec){buf, WRITE_HEADER};
    int count = 1 + parts;
    if (room > lent)  /* (the device wants room for its largest request) */
        iov[count++] = (struct iovec){buf + WRITE_HEADER, room - lent};
    ssize_t n = readv(fd, iov, count);
    if (n < 0) {
        int err = errno;
        pthread_mutex_unlock(&chunk_lock);
        errno = err;
        return -1;
    }
    size_t body = (size_t)n > WRITE_HEADER ? (size_t)n - WRITE_HEADER : 0;
    if (body > 0 && body <= lent) {
        uint32_t opcode, length;
        uint64_t fh, off;
        memcpy(&opcode, buf + IN_OPCODE_OFFSET, sizeof(opcode));
        write_in_of(buf, &fh, &off, &length);
        struct chunk_slot *slots[2];
        if (opcode == OPCODE_WRITE && fh == c->fh && length == body && chunk_parts(c, off, off + length, slots)) {
            landed.filled = chunk_took(c, slots, off, off + length, NULL);
            landed.set = 1;
            writes_landed++;
            pthread_mutex_unlock(&chunk_lock);
            return n;
        }
    }
    /* anything else: its bytes in order after the header, in `buf` */
    size_t in_chunks = body < lent ? body : lent;
    if (body > lent)
        memmove(buf + WRITE_HEADER + lent, buf + WRITE_HEADER, body - lent);
    size_t at = 0;
    for (int i = 1; at < in_chunks; i++) {
        size_t n_i = iov[i].iov_len < in_chunks - at ? iov[i].iov_len : in_chunks - at;
        memcpy(buf + WRITE_HEADER + at, iov[i].iov_base, n_i);
        at += n_i;
    }
    pthread_mutex_unlock(&chunk_lock);
    return n;
}

/* A GETATTR of an inode one writer alone writes while the front keeps its bytes: the
   attributes Python gave with collect_writes, the size written so far, the times now (as
   Python answers a writer's inode: mount/nodes.py EntryNode.attributes). np.save's fstat
   after its header's WRITE (the kernel drops a file's size at each write) asks one. */
static int getattr_collected_here(uint64_t ino)
{
    struct collect *found = NULL;
    int writers = 0;
    if (__atomic_load_n(&collect_count, __ATOMIC_RELAXED) == 0)
        return 0;
    pthread_mutex_lock(&collect_lock);
    for (unsigned i = 0; i < collect_count; i++)
        if (collects[i].ino == ino) {
            found = &collects[i];
            writers++;
        }
    if (found != NULL && writers == 1 && !found->passed) {  /* (co-writers: Python says which size) */
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        front_answer.attr = found->attr;
        front_answer.attr.st_size = (off_t)found->size;
        front_answer.attr.st_blocks = (blkcnt_t)((found->size + 511) / 512);
        front_answer.attr.st_atim = front_answer.attr.st_mtim = front_answer.attr.st_ctim = now;
        front_answer.timeout = found->timeout;
        front_answer.opcode = OPCODE_GETATTR;
    } else {
        found = NULL;
    }
    pthread_mutex_unlock(&collect_lock);
    return found != NULL;
}

/* A CREATE the front answers (answer_creates): write-only, of a valid name its directory
   certainly lacks, with an inode number in the pool and room to note it for Python. Its
   name is counted held, its writer noted (created), its RELEASE made Python's bookkeeping
   and its WRITEs collected, all before the reply: whatever request of it follows finds them.
   0: Python's, as before. */
static int create_here(const char *mem, size_t size)
{
    uint64_t parent, ino = 0, limit = 0, fh = 0;
    uint32_t flags, mode, umask_bits, uid, gid, pid;
    double timeout = 0;
    if (size <= IN_HEADER_SIZE + CREATE_IN_SIZE)
        return 0;
    memcpy(&parent, mem + IN_NODEID_OFFSET, sizeof(parent));
    memcpy(&uid, mem + IN_UID_OFFSET, sizeof(uid));
    memcpy(&gid, mem + IN_GID_OFFSET, sizeof(gid));
    memcpy(&pid, mem + IN_PID_OFFSET, sizeof(pid));
    memcpy(&flags, mem + IN_HEADER_SIZE, sizeof(flags));
    memcpy(&mode, mem + IN_HEADER_SIZE + 4, sizeof(mode));
    memcpy(&umask_bits, mem + IN_HEADER_SIZE + 8, sizeof(umask_bits));
    const char *name = mem + IN_HEADER_SIZE + CREATE_IN_SIZE;
    size_t n = name_for_front(name, size - IN_HEADER_SIZE - CREATE_IN_SIZE);
    if (n == 0 || (flags & O_ACCMODE) != O_WRONLY)  /* (a writer that reads too: Python's) */
        return 0;
    uint64_t hash = name_hash(name, n);
    pthread_mutex_lock(&names_lock);
    struct name_dir *d = name_dir_find(parent);
    if (d != NULL && d->creates && create_pool_count > 0 && name_slot_find(d, hash) == NULL &&
        name_slot_add(d, hash, 1)) {
        ino = create_pool[--create_pool_count];
        limit = d->create_limit;
        timeout = d->create_timeout;
    }
    pthread_mutex_unlock(&names_lock);
    if (ino == 0)
        return 0;
    uint32_t final_mode = S_IFREG | (mode & ~umask_bits & 07777);
    pthread_mutex_lock(&held_lock);
    if (created_count < CREATED_MAX && release_free_count < RELEASE_MAX) {
        fh = FRONT_FH | ++opened_next;
        release_free[release_free_count] = fh;
        release_free_wake[release_free_count++] = 0;
        struct created *c = &created[created_count++];
        *c = (struct created){.dir = parent, .ino = ino, .fh = fh, .flags = flags, .mode = final_mode,
                              .uid = uid, .gid = gid, .pid = pid, .namelen = (uint32_t)n};
        memcpy(c->name, name, n);
    }
    pthread_mutex_unlock(&held_lock);
    if (fh == 0) {  /* no room to note it: given back, Python's */
        pthread_mutex_lock(&names_lock);
        d = name_dir_find(parent);
        if (d != NULL)
            name_slot_drop(d, hash);
        if (create_pool_count < CREATE_POOL_MAX)
            create_pool[create_pool_count++] = ino;
        pthread_mutex_unlock(&names_lock);
        return 0;
    }
    struct stat attr = writer_attr(ino, final_mode, uid, gid);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    attr.st_atim = attr.st_mtim = attr.st_ctim = now;
    /* Its WRITEs collected from the first (no room: they go to Python, which writes them) */
    pthread_mutex_lock(&collect_lock);
    collect_start(fh, ino, limit, final_mode, uid, gid, timeout);
    pthread_mutex_unlock(&collect_lock);
    front_answer.opcode = OPCODE_CREATE;
    front_answer.attr = attr;
    front_answer.timeout = timeout;
    front_answer.fh = fh;
    return 1;
}

/* Whether session_ops answers this request in C alone (so the front may process it). */
static int answered_in_c(const char *mem, size_t size)
{
    uint32_t opcode;
    if (size < IN_HEADER_SIZE)
        return 0;
    memcpy(&opcode, mem + IN_OPCODE_OFFSET, sizeof(opcode));
    if (opcode == OPCODE_IOCTL)
        return session_ops.ioctl == ioctl_unsupported;
    if (opcode == OPCODE_LOOKUP && session_ops.lookup == lookup_absent &&
        __atomic_load_n(&name_dir_count, __ATOMIC_RELAXED) != 0) {
        uint64_t parent;
        memcpy(&parent, mem + IN_NODEID_OFFSET, sizeof(parent));
        const char *name = mem + IN_HEADER_SIZE;
        size_t n = name_for_front(name, size - IN_HEADER_SIZE);
        if (n == 0)
            return 0;
        uint64_t hash = name_hash(name, n);
        pthread_mutex_lock(&names_lock);
        struct name_dir *d = name_dir_find(parent);
        int absent = d != NULL && name_slot_find(d, hash) == NULL;
        pthread_mutex_unlock(&names_lock);
        if (absent)
            front_answer.opcode = OPCODE_LOOKUP;
        return absent;
    }
    if (opcode == OPCODE_CREATE && session_ops.create == create_answered &&
        __atomic_load_n(&create_dirs, __ATOMIC_RELAXED) != 0)
        return create_here(mem, size);
    if (opcode == OPCODE_WRITE && session_ops.write_buf == write_taken && size >= IN_HEADER_SIZE + WRITE_IN_SIZE) {
        uint64_t fh, off;
        uint32_t length;
        write_in_of(mem, &fh, &off, &length);
        const char *data = mem + IN_HEADER_SIZE + WRITE_IN_SIZE;
        if (landed.set)  /* its bytes are in its chunks, not here */
            return write_chunked_here(fh, off, NULL, length);
        /* (the bytes whole in the request: a WRITE read any other way is Python's) */
        return size == IN_HEADER_SIZE + WRITE_IN_SIZE + (size_t)length &&
               (write_taken_here(fh, data, length) || write_collected_here(fh, off, data, length) ||
                write_chunked_here(fh, off, data, length));
    }
    if (opcode == OPCODE_GETATTR && session_ops.getattr == getattr_held) {
        uint64_t ino;
        int found = 0;
        memcpy(&ino, mem + IN_NODEID_OFFSET, sizeof(ino));
        pthread_mutex_lock(&held_lock);
        struct held *h = held_count ? held_find(ino) : NULL;
        if (h != NULL && h->once && monotonic_now() > h->until) {
            *h = held[--held_count];  /* given for a GETATTR that did not come in time */
        } else if (h != NULL && h->valid) {
            front_answer.opcode = OPCODE_GETATTR;
            front_answer.attr = h->attr;
            front_answer.timeout = h->timeout;
            found = 1;
            if (h->once)
                *h = held[--held_count];
        } else {
            struct kept *k = kept_find(ino);
            if (k != NULL) {
                front_answer.opcode = OPCODE_GETATTR;
                front_answer.attr = k->attr;
                front_answer.timeout = k->timeout;
                found = 1;
            }
        }
        pthread_mutex_unlock(&held_lock);
        return found || getattr_collected_here(ino);
    }
    if (opcode == OPCODE_OPEN && session_ops.open == open_answered && size >= IN_HEADER_SIZE + OPEN_IN_SIZE) {
        uint64_t ino;
        uint32_t flags, pid;
        int found = 0;
        memcpy(&ino, mem + IN_NODEID_OFFSET, sizeof(ino));
        memcpy(&pid, mem + IN_PID_OFFSET, sizeof(pid));
        memcpy(&flags, mem + IN_HEADER_SIZE, sizeof(flags));
        pthread_mutex_lock(&held_lock);
        struct mark *m = marks_count ? mark_find(ino) : NULL;
        /* no room for the handle (or for the notice): pyfuse3's handler opens it */
        /* A read-only open with O_TRUNC needs write permission and a truncation: Python's. */
        if (m != NULL && m->accmode == (int)(flags & O_ACCMODE) && opened_count < HELD_MAX &&
            (m->pid == 0 || m->pid == pid) &&
            !(m->accmode == O_RDONLY && (flags & O_TRUNC)) &&
            (!(m->flags & MARK_ONCE) || notices_count < NOTICES_MAX)) {
            uint64_t fh = FRONT_FH | ++opened_next;
            int mark = m->flags;
            opened[opened_count++] = (typeof(opened[0])){fh, ino, flags, (mark & MARK_ADOPTED) != 0,
                                                         (mark & MARK_PRIORITIES) ? m->tag : 0, 0};
            if (!(mark & MARK_NOFLUSH))
                flushing_add(fh, 0);  /* nothing to do at its close yet (no room: Python's flush) */
            if (mark & MARK_ONCE) {
                notices[notices_count++] = (struct notice){ino, fh};
                mark_drop(ino);
                /* An adopted handle's open wakes no Python: the RELEASE that follows does, and
                   Python takes both notes on that one wake-up (counts the draw, sets the next
                   batch aside), one trip through the trio loop per batch, not two. A request
                   that reaches Python first takes the note before it (release_taken), and
                   the periodic take (FRONT_NOTES_S) a batch held open long. */
            }
            front_answer.opcode = OPCODE_OPEN;
            front_answer.fh = fh;
            front_answer.mark = mark;
            found = 1;
        }
        pthread_mutex_unlock(&held_lock);
        return found;
    }
    if (opcode == OPCODE_RELEASE && session_ops.release == release_answered &&
        size >= IN_HEADER_SIZE + RELEASE_IN_SIZE) {
        uint64_t fh;
        memcpy(&fh, mem + IN_HEADER_SIZE, sizeof(fh));
        pthread_mutex_lock(&held_lock);
        int found = release_here(fh);
        pthread_mutex_unlock(&held_lock);
        if (found)
            front_answer.opcode = OPCODE_RELEASE;
        return found;
    }
    if (opcode == OPCODE_FLUSH && session_ops.flush == flush_answered && size >= IN_HEADER_SIZE + FLUSH_IN_SIZE) {
        uint64_t fh;
        int found;
        memcpy(&fh, mem + IN_HEADER_SIZE + FLUSH_IN_FH_OFFSET, sizeof(fh));
        pthread_mutex_lock(&held_lock);
        struct flushing *f = flushing_find(fh);
        found = f != NULL && !f->python;
        pthread_mutex_unlock(&held_lock);
        if (found)
            front_answer.opcode = OPCODE_FLUSH;
        return found;
    }
    if (opcode == OPCODE_GETXATTR && session_ops.getxattr == getxattr_own_names) {
        size_t prefix = sizeof(XATTR_PREFIX) - 1;
        if (size < IN_HEADER_SIZE + GETXATTR_IN_SIZE + prefix)
            return 1;  /* a name shorter than the prefix: not ours */
        return strncmp(mem + IN_HEADER_SIZE + GETXATTR_IN_SIZE, XATTR_PREFIX, prefix) != 0;
    }
    return 0;
}

static void *front_take_spare(void)  /* with front_lock held */
{
    return front_spare_count ? front_spares[--front_spare_count] : NULL;
}

/* The front's thread runs at this nice value where the daemon may raise its priority
   (CAP_SYS_NICE; else it stays at the daemon's): a caller blocked in a request the front
   answers in C waits for that thread to get a core, and on a machine whose cores the
   daemon's Python, the actors and the learner share, a thread of the default weight waits
   out others' slices. It needs little CPU, so it takes little from them.
   DISTOREFS_FRONT_NICE in the daemon's environment sets another value (0: as the rest). */
#define FRONT_NICE (-10)

static void *front_run(void *unused)
{
    struct fuse_buf buf;
    int res;
    memset(&buf, 0, sizeof(buf));
    const char *nice_env = getenv("DISTOREFS_FRONT_NICE");
    int nice_value = nice_env != NULL ? atoi(nice_env) : FRONT_NICE;
    if (nice_value != 0 && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice_value) != 0) {
        /* not allowed: the thread runs at the daemon's priority */
    }
    pthread_setname_np(pthread_self(), "distorefs-front");  /* (in top, py-spy, /proc/PID/task) */
    for (;;) {
        res = libfuse_receive_buf(front_se, &buf);  /* blocks; allocates buf.mem when NULL */
        if (res == -EINTR || res == -EAGAIN)
            continue;
        if (res <= 0)
            break;
        if (answered_in_c(buf.mem, buf.size)) {
            libfuse_process_buf(front_se, &buf);
            front_answer.opcode = 0;  /* used (or the request refused before its handler) */
            if (notes_due) {
                notes_due = 0;
                notes_wake();
            }
            continue;  /* the same buffer for the next request */
        }
        pthread_mutex_lock(&front_lock);
        while (front_count == FRONT_QUEUE)
            pthread_cond_wait(&front_room, &front_lock);
        front_queue[(front_head + front_count) % FRONT_QUEUE] = (struct queued){buf.mem, buf.size};
        front_count++;
        front_passed++;
        buf.mem = front_take_spare();
        pthread_mutex_unlock(&front_lock);
        uint64_t one = 1;
        if (write(front_efd, &one, sizeof(one)) < 0) {
            /* not reached: the counter cannot overflow with at most FRONT_QUEUE counts */
        }
    }
    pthread_mutex_lock(&front_lock);
    front_ended = 1;
    front_result = res;
    pthread_mutex_unlock(&front_lock);
    uint64_t all = UINT64_C(1) << 40;  /* every pyfuse3 task waiting wakes, finds the end */
    if (write(front_efd, &all, sizeof(all)) < 0) {
        /* nothing to do: the loop also ends at its own check of the session */
    }
    free(buf.mem);
    return NULL;
}

static int front_start(struct fuse_session *se)
{
    sigset_t all, old;
    if (libfuse_session_fd(se) < 0)  /* not mounted: nothing to read */
        return 0;
    front_efd = eventfd(0, EFD_NONBLOCK | EFD_SEMAPHORE | EFD_CLOEXEC);
    if (front_efd < 0)
        return 0;
    sigfillset(&all);  /* signals stay with Python's threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&front_thread, NULL, front_run, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        close(front_efd);
        front_efd = -1;
        return 0;
    }
    front_started = 1;
    return 1;
}

/* pyfuse3 asks once, after mounting, and waits on what it gets for requests. */
int fuse_session_fd(struct fuse_session *se)
{
    if (se == front_se && (front_started || front_start(se)))
        return front_efd;
    return libfuse_session_fd(se);
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    uint64_t count;
    void *drop = NULL;
    if (!front_started || se != front_se)
        return libfuse_receive_buf(se, buf);
    if (read(front_efd, &count, sizeof(count)) != sizeof(count))
        return -EINTR;  /* another task took it: pyfuse3 waits again */
    pthread_mutex_lock(&front_lock);
    if (front_count == 0) {
        int res = front_ended ? front_result : -EINTR;
        pthread_mutex_unlock(&front_lock);
        return res;
    }
    struct queued q = front_queue[front_head];
    front_head = (front_head + 1) % FRONT_QUEUE;
    front_count--;
    if (buf->mem != NULL) {  /* the request pyfuse3 answered last: its buffer is free */
        if (front_spare_count < FRONT_SPARE)
            front_spares[front_spare_count++] = buf->mem;
        else
            drop = buf->mem;
    }
    pthread_cond_signal(&front_room);
    pthread_mutex_unlock(&front_lock);
    free(drop);
    buf->mem = q.mem;
    buf->size = q.size;
    buf->flags = 0;
    buf->pos = 0;
    return (int)q.size;
}

/* After an unmount the front's read ends (ENODEV); wait for it before the session goes.
   A front still reading after 2 s (an unmount that did not happen) keeps the session. */
void fuse_session_destroy(struct fuse_session *se)
{
    if (se == front_se && front_started) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 2;
        if (pthread_timedjoin_np(front_thread, NULL, &until) != 0)
            return;
        front_started = 0;
        for (unsigned i = 0; i < front_count; i++)
            free(front_queue[(front_head + i) % FRONT_QUEUE].mem);
        while (front_spare_count)
            free(front_spares[--front_spare_count]);
        front_count = 0;
        /* A FLUSH still parked is answered before its session goes (a commit finishing
           later finds none): its request belongs to the session. */
        pthread_mutex_lock(&held_lock);
        struct parked *all = NULL;
        for (unsigned i = 0; i < flushing_count; i++) {
            int err;
            struct parked *p = flushing_unpark(&flushing[i], &err);
            while (p != NULL) {
                struct parked *next = p->next;
                p->next = all;
                all = p;
                p = next;
            }
        }
        pthread_mutex_unlock(&held_lock);
        reply_parked(all, EIO);
        pthread_mutex_lock(&held_lock);
        created_count = 0;  /* (their writers never closed: nothing of them was acknowledged) */
        pthread_mutex_unlock(&held_lock);
        pthread_mutex_lock(&collect_lock);  /* what no FLUSH took is not acknowledged: dropped */
        while (collect_count)
            free(collects[--collect_count].data);
        collect_bytes = 0;
        pthread_mutex_unlock(&collect_lock);
    }
    libfuse_session_destroy(se);
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    if (libfuse_reply_open == NULL)  /* not reached: the import below fails first */
        return fuse_reply_err(req, EIO);
    if (fi->fh & PASSTHROUGH_FH) {  /* (with its backing id in passthrough_ids) */
        uint64_t fh = fi->fh & ~(PASSTHROUGH_FH | NOFLUSH_FH);
        int32_t id = 0;
        pthread_mutex_lock(&passthrough_lock);
        for (unsigned i = 0; i < passthrough_count; i++)
            if (passthrough_ids[i].fh == fh) {
                id = passthrough_ids[i].id;
                passthrough_ids[i] = passthrough_ids[--passthrough_count];
                break;
            }
        pthread_mutex_unlock(&passthrough_lock);
        if (id > 0) {
            struct { uint64_t fh; uint32_t open_flags; int32_t backing_id; } out = {
                fh, FOPEN_PASSTHROUGH_BIT | (fi->direct_io ? FOPEN_DIRECT_IO_BIT : 0) |
                    (fi->keep_cache ? FOPEN_KEEP_CACHE_BIT : 0) | (fi->nonseekable ? FOPEN_NONSEEKABLE_BIT : 0) |
                    ((fi->fh & NOFLUSH_FH) || fi->noflush ? FOPEN_NOFLUSH_BIT : 0), id};
            __atomic_add_fetch(&passthrough_replies, 1, __ATOMIC_RELAXED);
            return fuse_reply_buf(req, (const char *)&out, sizeof(out));
        }
        struct fuse_file_info copy = *fi;  /* (not registered: a plain open) */
        copy.fh = fh | (fi->fh & NOFLUSH_FH);
        return fuse_reply_open(req, &copy);
    }
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
                           dlsym(RTLD_DEFAULT, "fuse_session_new") == (void *)fuse_session_new &&
                           dlsym(RTLD_DEFAULT, "fuse_session_fd") == (void *)fuse_session_fd &&
                           dlsym(RTLD_DEFAULT, "fuse_session_receive_buf") == (void *)fuse_session_receive_buf &&
                           dlsym(RTLD_DEFAULT, "fuse_session_destroy") == (void *)fuse_session_destroy &&
                           dlsym(RTLD_DEFAULT, "fuse_reply_attr") == (void *)fuse_reply_attr &&
                           dlsym(RTLD_DEFAULT, "fuse_reply_entry") == (void *)fuse_reply_entry &&
                           dlsym(RTLD_DEFAULT, "fuse_session_mount") == (void *)fuse_session_mount);
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

static PyObject *front_state(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&front_lock);
    unsigned long long passed = front_passed;
    pthread_mutex_unlock(&front_lock);
    return Py_BuildValue("(OK)", front_started ? Py_True : Py_False, passed);
}

static PyObject *dirops(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(__atomic_load_n(&parallel_dirops, __ATOMIC_RELAXED));
}

static PyObject *notes_fd(PyObject *self, PyObject *unused)
{
    if (notes_efd < 0)  /* made once, at the first call (with the GIL: one caller at a time) */
        __atomic_store_n(&notes_efd, eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), __ATOMIC_RELEASE);
    return PyLong_FromLong(notes_efd);
}

static PyObject *hold_attributes(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    int on, done = 1;
    if (!PyArg_ParseTuple(args, "Kp", &ino, &on))
        return NULL;
    pthread_mutex_lock(&held_lock);
    struct held *h = held_find(ino);
    if (on && h == NULL) {
        if (held_slot(ino, 1) == NULL)
            done = 0;
    } else if (on && h->once && !held_lasting_room()) {
        done = 0;  /* (it stays once) */
    } else if (on) {
        h->once = 0;  /* (one given once lasts now, from the next reply) */
    } else if (!on && h != NULL) {
        *h = held[--held_count];
    }
    if (!on)
        kept_drop(ino);
    if (!on && marks_count)  /* and its opens reach Python again, until answer_opens */
        mark_drop(ino);
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(done);
}

/* Attributes Python answers with but does not send: the front answers the GETATTR that
   follows with them (once: that one only, within ONCE_SECONDS; else as hold_attributes,
   until forgotten or replaced by the next reply). */
#define ONCE_SECONDS 1.0

/* (ino, mode, nlink, uid, gid, size, blocks, blksize, atime_ns, mtime_ns, ctime_ns, timeout,
   and a flag when `flag` is not NULL) into a struct stat; 0: a Python error is set. */
static int attributes_from(PyObject *args, struct stat *out, double *timeout, int *flag)
{
    unsigned long long ino, nlink;
    unsigned int mode, uid, gid;
    long long size, blocks, blksize, atime_ns, mtime_ns, ctime_ns;
    if (!PyArg_ParseTuple(args, flag != NULL ? "KIKIILLLLLLdp" : "KIKIILLLLLLd", &ino, &mode, &nlink, &uid, &gid,
                          &size, &blocks, &blksize, &atime_ns, &mtime_ns, &ctime_ns, timeout, flag))
        return 0;
    struct stat attr;
    memset(&attr, 0, sizeof(attr));
    attr.st_ino = (ino_t)ino;
    attr.st_mode = (mode_t)mode;
    attr.st_nlink = (nlink_t)nlink;
    attr.st_uid = (uid_t)uid;
    attr.st_gid = (gid_t)gid;
    attr.st_size = (off_t)size;
    attr.st_blocks = (blkcnt_t)blocks;
    attr.st_blksize = (blksize_t)blksize;
    attr.st_atim = (struct timespec){(time_t)(atime_ns / 1000000000), (long)(atime_ns % 1000000000)};
    attr.st_mtim = (struct timespec){(time_t)(mtime_ns / 1000000000), (long)(mtime_ns % 1000000000)};
    attr.st_ctim = (struct timespec){(time_t)(ctime_ns / 1000000000), (long)(ctime_ns % 1000000000)};
    *out = attr;
    return 1;
}

static PyObject *give_attributes(PyObject *self, PyObject *args)
{
    struct stat attr;
    double timeout;
    int once;
    if (!attributes_from(args, &attr, &timeout, &once))
        return NULL;
    uint64_t ino = (uint64_t)attr.st_ino;
    pthread_mutex_lock(&held_lock);
    struct held *h = held_find(ino);
    int lasting = h != NULL && !h->once;  /* a lasting hold stays one */
    if (h == NULL)
        h = held_slot(ino, !once);
    if (h != NULL) {
        h->attr = attr;
        h->timeout = timeout;
        h->valid = 1;
        h->once = once && !lasting;
        h->until = monotonic_now() + ONCE_SECONDS;
    }
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(h != NULL);
}

/* Attributes the front answers every GETATTR of ino with, until forgotten (hold_attributes
   off) or replaced by Python's next reply for it. */
static PyObject *keep_attributes(PyObject *self, PyObject *args)
{
    struct stat attr;
    double timeout;
    if (!attributes_from(args, &attr, &timeout, NULL))
        return NULL;
    pthread_mutex_lock(&held_lock);
    struct kept *k = kept_slot((uint64_t)attr.st_ino);
    if (k != NULL) {
        k->attr = attr;
        k->timeout = timeout;
    }
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(k != NULL);
}

static PyObject *answer_opens(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    int accmode, flags, done;
    unsigned int pid = 0, tag = 0;
    if (!PyArg_ParseTuple(args, "Kii|II", &ino, &accmode, &flags, &pid, &tag))
        return NULL;
    if ((flags & MARK_PRIORITIES) && tag == 0) {
        PyErr_SetString(PyExc_ValueError, "a priorities mark names its buffer (tag > 0)");
        return NULL;
    }
    pthread_mutex_lock(&held_lock);
    done = mark_set(ino, accmode, flags, pid, tag);
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(done);
}

/* The tables are read under held_lock and their Python objects made after it: an allocation
   may run the cycle collector, whose callbacks are Python code that may let go of the GIL,
   and a Python thread that then took the GIL and waited for held_lock (answer_opens) would
   never give it back (tests/unit/test_interpose_locks.py). */

/* A copy of the `*count` items (of `size` bytes) of a table the front fills, which is
   emptied, taken under held_lock; their number in *n. The copy has room for `max` items (the
   table's size: it cannot grow while the lock is not held yet); NULL: no memory (raised). */
static void *table_take(const void *table, unsigned *count, size_t size, unsigned max, unsigned *n)
{
    void *copy = malloc(max * size);
    if (copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    pthread_mutex_lock(&held_lock);
    *n = *count;
    memcpy(copy, table, *n * size);
    *count = 0;
    pthread_mutex_unlock(&held_lock);
    return copy;
}

/* The handles whose RELEASE the front answered, as a tuple; the list is emptied. */
static PyObject *take_released(PyObject *self, PyObject *unused)
{
    unsigned n;
    if (__atomic_load_n(&released_count, __ATOMIC_RELAXED) == 0)  /* the usual answer, unlocked */
        return PyTuple_New(0);
    uint64_t *copy = table_take(released, &released_count, sizeof(*copy), RELEASE_MAX, &n);
    if (copy == NULL)
        return NULL;
    PyObject *out = PyTuple_New(n);
    for (unsigned i = 0; out != NULL && i < n; i++) {
        PyObject *number = PyLong_FromUnsignedLongLong(copy[i]);
        if (number == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, number);
    }
    if (out == NULL) {  /* no memory: the numbers go back, for the next call */
        pthread_mutex_lock(&held_lock);
        for (unsigned i = 0; i < n && released_count < RELEASE_MAX; i++)
            released[released_count++] = copy[i];
        pthread_mutex_unlock(&held_lock);
    }
    free(copy);
    return out;
}

static PyObject *take_opened(PyObject *self, PyObject *unused)
{
    unsigned n;
    if (__atomic_load_n(&notices_count, __ATOMIC_RELAXED) == 0)  /* the usual answer, unlocked */
        return PyTuple_New(0);
    struct notice *copy = table_take(notices, &notices_count, sizeof(*copy), NOTICES_MAX, &n);
    if (copy == NULL)
        return NULL;
    PyObject *out = PyTuple_New(n);
    for (unsigned i = 0; out != NULL && i < n; i++) {
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)copy[i].ino, (unsigned long long)copy[i].fh);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, pair);
    }
    if (out == NULL) {  /* no memory: the notices go back, for the next call */
        pthread_mutex_lock(&held_lock);
        for (unsigned i = 0; i < n && notices_count < NOTICES_MAX; i++)
            notices[notices_count++] = copy[i];
        pthread_mutex_unlock(&held_lock);
    }
    free(copy);
    return out;
}

static PyObject *adopt_opened(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&held_lock);
    for (unsigned i = 0; i < opened_count; i++)
        if (opened[i].fh == fh && !opened[i].adopted) {
            opened[i].adopted = 1;  /* its RELEASE is answered here and handed to take_released */
            unsigned long long ino = opened[i].ino;
            unsigned flags = opened[i].flags;
            pthread_mutex_unlock(&held_lock);
            return Py_BuildValue("(KI)", ino, flags);
        }
    pthread_mutex_unlock(&held_lock);
    Py_RETURN_NONE;
}

static PyObject *set_flush_free(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int on, done = 1;
    if (!PyArg_ParseTuple(args, "Kp", &fh, &on))
        return NULL;
    pthread_mutex_lock(&held_lock);
    struct flushing *f = flushing_find(fh);
    if (on) {
        if (f == NULL)
            f = flushing_add(fh, 0);
        if (f != NULL)
            f->python = 0;
        else
            done = 0;
    } else if (f != NULL && !f->pending && f->parked == NULL) {
        *f = flushing[--flushing_count];
    } else if (f != NULL) {  /* its commits still count down: kept, its FLUSH goes to Python */
        f->python = 1;
    }
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(done);
}

static PyObject *flush_pending(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    int done = 0;
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&held_lock);
    if (front_started && session_ops.flush == flush_answered) {  /* else no FLUSH ever parks here */
        struct flushing *f = flushing_find(fh);
        if (f == NULL)
            f = flushing_add(fh, 1);
        if (f != NULL) {
            f->pending++;
            done = 1;
        }
    }
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(done);
}

static PyObject *flush_committed(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int err;
    struct parked *p = NULL;
    if (!PyArg_ParseTuple(args, "Ki", &fh, &err))
        return NULL;
    pthread_mutex_lock(&held_lock);
    struct flushing *f = flushing_find(fh);
    if (f != NULL && f->pending) {
        if (err && !f->err)
            f->err = err;
        if (--f->pending == 0) {
            p = flushing_unpark(f, &err);
            if (f->python && p == NULL)  /* its FLUSH goes to Python, which has the errors too */
                *f = flushing[--flushing_count];
        }
    }
    pthread_mutex_unlock(&held_lock);
    if (p != NULL) {
        Py_BEGIN_ALLOW_THREADS
        reply_parked(p, err);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *passthrough_state(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("(iK)", __atomic_load_n(&passthrough_on, __ATOMIC_ACQUIRE),
                         __atomic_load_n(&passthrough_replies, __ATOMIC_RELAXED));
}

static PyObject *backing_open(PyObject *self, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg), dev = __atomic_load_n(&session_dev_fd, __ATOMIC_ACQUIRE), id;
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (dev < 0 || !__atomic_load_n(&passthrough_on, __ATOMIC_ACQUIRE)) {
        errno = EOPNOTSUPP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct backing_map map = {fd, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    id = ioctl(dev, DEV_IOC_BACKING_OPEN, &map);
    Py_END_ALLOW_THREADS
    if (id < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(id);
}

static PyObject *backing_close(PyObject *self, PyObject *arg)
{
    long value = PyLong_AsLong(arg);
    int dev = __atomic_load_n(&session_dev_fd, __ATOMIC_ACQUIRE), res = 0;
    if (value == -1 && PyErr_Occurred())
        return NULL;
    uint32_t id = (uint32_t)value;
    if (dev >= 0) {
        Py_BEGIN_ALLOW_THREADS
        res = ioctl(dev, DEV_IOC_BACKING_CLOSE, &id);
        Py_END_ALLOW_THREADS
    }
    if (res < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *passthrough_fh(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int id, done = 0;
    if (!PyArg_ParseTuple(args, "Ki", &fh, &id))
        return NULL;
    pthread_mutex_lock(&passthrough_lock);
    if (passthrough_count < PASSTHROUGH_MAX && id > 0) {
        passthrough_ids[passthrough_count++].fh = fh & ~(PASSTHROUGH_FH | NOFLUSH_FH);
        passthrough_ids[passthrough_count - 1].id = id;
        done = 1;
    }
    pthread_mutex_unlock(&passthrough_lock);
    return PyLong_FromUnsignedLongLong(done ? fh | PASSTHROUGH_FH : fh);
}

static PyObject *set_passthrough(PyObject *self, PyObject *on)
{
    passthrough_wanted = PyObject_IsTrue(on);
    Py_RETURN_NONE;
}

/* The `priorities` WRITEs the front took since the last call, in order: ((ns_id, number, text),
   ...). Copied out under held_lock, their objects made after it (see take_released). */
static PyObject *take_writes(PyObject *self, PyObject *unused)
{
    unsigned n;
    if (__atomic_load_n(&writes_count, __ATOMIC_RELAXED) == 0)  /* the usual answer, unlocked */
        return PyTuple_New(0);
    struct taken_write *taken = table_take(writes, &writes_count, sizeof(*taken), WRITES_MAX, &n);
    if (taken == NULL)
        return NULL;
    PyObject *out = PyTuple_New(n);
    unsigned i = 0;
    for (; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(IKy#)", taken[i].tag, (unsigned long long)taken[i].number, taken[i].text,
                                       (Py_ssize_t)taken[i].size);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        free(taken[i].text);
        PyTuple_SET_ITEM(out, i, item);
    }
    if (out == NULL) {  /* no memory: the rest go back, before any taken since (they are in the file anyway) */
        pthread_mutex_lock(&held_lock);
        unsigned back = n - i;
        if (writes_count + back <= WRITES_MAX) {
            memmove(writes + back, writes, writes_count * sizeof(*writes));
            memcpy(writes, taken + i, back * sizeof(*writes));
            writes_count += back;
            back = 0;
        }
        pthread_mutex_unlock(&held_lock);
        for (unsigned j = n - back; j < n; j++)  /* (never: only this call empties the queue) */
            free(taken[j].text);
    }
    free(taken);
    return out;
}

/* (fd, next_number, priority_max): the write-ahead file the front appends taken `priorities`
   WRITEs to (fd -1: none, the front takes none). The descriptor stays Python's. */
static PyObject *set_priority_log(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long next;
    double max;
    if (!PyArg_ParseTuple(args, "iKd", &fd, &next, &max))
        return NULL;
    off_t end = fd >= 0 ? lseek(fd, 0, SEEK_END) : 0;
    if (end < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&log_lock);
    log_fd = fd;
    log_next = next;
    log_bytes = end;
    priority_max = max;
    pthread_mutex_unlock(&log_lock);
    Py_RETURN_NONE;
}

/* Record `number` is committed: if it is the last appended and the file is past
   LOG_TRIM_BYTES, the file is emptied (everything in it is committed). Whether it was. */
static PyObject *priority_log_trim(PyObject *self, PyObject *arg)
{
    unsigned long long number = PyLong_AsUnsignedLongLong(arg);
    int trimmed = 0;
    if (number == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&log_lock);
    if (log_fd >= 0 && number + 1 == log_next && log_bytes >= LOG_TRIM_BYTES && ftruncate(log_fd, 0) == 0) {
        log_bytes = 0;
        log_trims++;
        trimmed = 1;
    }
    pthread_mutex_unlock(&log_lock);
    return PyBool_FromLong(trimmed);
}

/* (WRITEs taken, times the file was emptied, the number the next record gets). */
static PyObject *priority_log_state(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&held_lock);
    unsigned long long taken = front_writes;
    pthread_mutex_unlock(&held_lock);
    pthread_mutex_lock(&log_lock);
    unsigned long long trims = log_trims, next = log_next;
    pthread_mutex_unlock(&log_lock);
    return Py_BuildValue("(KKK)", taken, trims, next);
}

static PyObject *front_answers(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&held_lock);
    unsigned long long releases = front_releases;
    pthread_mutex_unlock(&held_lock);
    return Py_BuildValue("(KKKK)", __atomic_load_n(&front_getattrs, __ATOMIC_RELAXED),
                         __atomic_load_n(&front_flushes, __ATOMIC_RELAXED),
                         __atomic_load_n(&front_opens, __ATOMIC_RELAXED), releases);
}

/* Requests the front queued for pyfuse3 (a hint, read without the lock: the loop that takes
   them asks again when a receive finds none). */
static PyObject *front_queued(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLong(__atomic_load_n(&front_count, __ATOMIC_RELAXED));
}

static PyObject *front_tables(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&held_lock);
    unsigned counts[8] = {held_count, marks_count, opened_count, flushing_count, release_free_count,
                          released_count, notices_count, kept_count};
    pthread_mutex_unlock(&held_lock);
    return Py_BuildValue("{sIsIsIsIsIsIsIsI}", "held", counts[0], "opens_answered", counts[1], "opened", counts[2],
                         "flushing", counts[3], "release_free", counts[4], "released", counts[5],
                         "opened_noted", counts[6], "kept", counts[7]);
}

/* (fh, limit, ino, mode, uid, gid, timeout): the front collects the WRITEs of handle fh (a
   new entry's writer, nothing written yet), up to `limit` bytes, and answers GETATTRs of its
   inode with those attributes meanwhile. False: not (no front, no room). */
static PyObject *collect_writes(PyObject *self, PyObject *args)
{
    unsigned long long fh, limit, ino;
    unsigned mode, uid, gid;
    double timeout;
    int done = 0;
    if (!PyArg_ParseTuple(args, "KKKIIId", &fh, &limit, &ino, &mode, &uid, &gid, &timeout))
        return NULL;
    pthread_mutex_lock(&collect_lock);
    if (front_started && session_ops.write_buf == write_taken && collect_find(fh) == NULL)
        done = collect_start(fh, ino, limit, mode, uid, gid, timeout);
    pthread_mutex_unlock(&collect_lock);
    return PyBool_FromLong(done);
}

/* fh: the bytes the front collected for the handle (b"" if none were written), and it
   collects no more; None if it was not collecting. */
static PyObject *take_collected(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&collect_lock);
    struct collect *c = collect_find(fh), taken;
    if (c != NULL) {
        taken = *c;
        *c = collects[--collect_count];
        collect_bytes -= taken.cap;
    }
    pthread_mutex_unlock(&collect_lock);
    if (c == NULL)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(taken.size ? taken.data : "", (Py_ssize_t)taken.size);
    free(taken.data);
    return out;
}

/* fh: how many bytes the front has collected for the handle (it goes on), or None. */
static PyObject *collected_size(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&collect_lock);
    struct collect *c = collect_find(fh);
    Py_ssize_t size = c != NULL ? (Py_ssize_t)c->size : -1;
    pthread_mutex_unlock(&collect_lock);
    if (size < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(size);
}

static PyObject *collect_state(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&collect_lock);
    PyObject *out = Py_BuildValue("(KIn)", collected_writes, collect_count, (Py_ssize_t)collect_bytes);
    pthread_mutex_unlock(&collect_lock);
    return out;
}

/* (fh, pos, chunk_bytes, limit): the front copies handle fh's WRITEs into chunks lent to it
   (chunks_lend), the first landing at pos (a multiple of chunk_bytes), none past limit.
   False: not (no front, no room, armed already). */
static PyObject *chunks_arm(PyObject *self, PyObject *args)
{
    unsigned long long fh, pos, chunk_bytes, limit;
    int done = 0;
    if (!PyArg_ParseTuple(args, "KKKK", &fh, &pos, &chunk_bytes, &limit))
        return NULL;
    if (chunk_bytes == 0 || pos % chunk_bytes != 0) {
        PyErr_SetString(PyExc_ValueError, "pos must be a multiple of chunk_bytes");
        return NULL;
    }
    pthread_mutex_lock(&chunk_lock);
    if (front_started && session_ops.write_buf == write_taken && chunker_count < CHUNKERS_MAX &&
        chunker_find(fh) == NULL) {
        chunkers[chunker_count++] = (struct chunker){.fh = fh, .pos = pos, .chunk_bytes = chunk_bytes, .limit = limit};
        done = 1;
    }
    pthread_mutex_unlock(&chunk_lock);
    return PyBool_FromLong(done);
}

/* (fh, index, buffer): lend a writable buffer of chunk_bytes for chunk `index` of an armed
   handle (not one before its next WRITE's). False: not taken (the buffer is the caller's). */
static PyObject *chunks_lend(PyObject *self, PyObject *args)
{
    unsigned long long fh, index;
    PyObject *obj;
    int done = 0;
    if (!PyArg_ParseTuple(args, "KKO", &fh, &index, &obj))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    pthread_mutex_lock(&chunk_lock);
    struct chunker *c = chunker_find(fh);
    if (c != NULL && !c->passed && c->nslots < CHUNK_SLOTS && (uint64_t)view.len == c->chunk_bytes &&
        index >= c->pos / c->chunk_bytes) {
        if (chunk_slot_of(c, index) == NULL) {
            c->slots[c->nslots++] = (struct chunk_slot){.view = view, .index = index, .filled = 0};
            done = 1;
            if (index == c->pos / c->chunk_bytes)  /* a writer armed now: its first WRITE lands too */
                landing_fh = fh;
        }
    }
    pthread_mutex_unlock(&chunk_lock);
    if (!done)
        PyBuffer_Release(&view);
    return PyBool_FromLong(done);
}

/* A taken slot as (index, buffer, bytes filled), its view let go. */
static PyObject *slot_tuple(struct chunk_slot *slot)
{
    PyObject *obj = slot->view.obj;
    Py_INCREF(obj);
    PyBuffer_Release(&slot->view);
    PyObject *out = Py_BuildValue("(KNK)", (unsigned long long)slot->index, obj, (unsigned long long)slot->filled);
    return out;
}

/* The chunks the front filled whole since the last call: [(fh, index, buffer, filled)]. */
static PyObject *chunks_full(PyObject *self, PyObject *unused)
{
    static struct { uint64_t fh; struct chunk_slot slot; } taken[FULLS_MAX];
    pthread_mutex_lock(&chunk_lock);
    unsigned n = full_count;
    memcpy(taken, fulls, n * sizeof(fulls[0]));
    full_count = 0;
    pthread_mutex_unlock(&chunk_lock);
    PyObject *out = PyList_New(n);
    for (unsigned i = 0; i < n; i++) {
        PyObject *slot = slot_tuple(&taken[i].slot);
        PyList_SET_ITEM(out, i, Py_BuildValue("(KN)", (unsigned long long)taken[i].fh, slot));
    }
    return out;
}

/* fh: the front copies no more of its WRITEs; (pos, [(index, buffer, filled)]): where its
   next WRITE would have landed and every chunk lent to it (filled whole, in part or not at
   all), those waiting in chunks_full included. None: it was not armed. */
static PyObject *chunks_stop(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    struct chunk_slot taken[CHUNK_SLOTS + FULLS_MAX];
    unsigned n = 0;
    uint64_t pos = 0;
    pthread_mutex_lock(&chunk_lock);
    struct chunker *c = chunker_find(fh);
    if (c != NULL) {
        pos = c->pos;
        for (unsigned k = 0; k < full_count;) {
            if (fulls[k].fh == fh) {
                taken[n++] = fulls[k].slot;
                memmove(&fulls[k], &fulls[k + 1], (full_count - k - 1) * sizeof(fulls[0]));
                full_count--;
            } else {
                k++;
            }
        }
        for (unsigned k = 0; k < c->nslots; k++)
            taken[n++] = c->slots[k];
        *c = chunkers[--chunker_count];
    }
    pthread_mutex_unlock(&chunk_lock);
    if (c == NULL)
        Py_RETURN_NONE;
    PyObject *slots = PyList_New(n);
    for (unsigned i = 0; i < n; i++)
        PyList_SET_ITEM(slots, i, slot_tuple(&taken[i]));
    return Py_BuildValue("(KN)", (unsigned long long)pos, slots);
}

/* fh: where its next WRITE would land (it goes on), or None if it is not armed. */
static PyObject *chunks_pos(PyObject *self, PyObject *arg)
{
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&chunk_lock);
    struct chunker *c = chunker_find(fh);
    int armed = c != NULL;
    unsigned long long pos = armed ? c->pos : 0;
    pthread_mutex_unlock(&chunk_lock);
    if (!armed)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(pos);
}

static PyObject *chunks_state(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&chunk_lock);
    PyObject *out = Py_BuildValue("(KKIK)", chunked_writes, chunks_filled, chunker_count, writes_landed);
    pthread_mutex_unlock(&chunk_lock);
    return out;
}

static PyObject *set_release_free(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int wake = 0, done = 0;
    if (!PyArg_ParseTuple(args, "K|p", &fh, &wake))
        return NULL;
    pthread_mutex_lock(&held_lock);
    if (front_started && release_free_count < RELEASE_MAX) {  /* only the front takes them out */
        release_free[release_free_count] = fh;
        release_free_wake[release_free_count++] = (unsigned char)wake;
        done = 1;
    }
    pthread_mutex_unlock(&held_lock);
    return PyBool_FromLong(done);
}

static PyObject *set_front(PyObject *self, PyObject *on)
{
    front_wanted = PyObject_IsTrue(on) ? 1 : 0;
    Py_RETURN_NONE;
}

static PyObject *set_answer_foreign_xattrs(PyObject *self, PyObject *on)
{
    answer_foreign_xattrs = PyObject_IsTrue(on) ? 1 : 0;
    Py_RETURN_NONE;
}

/* (ino, names): the front answers LOOKUPs in directory ino of names not among `names` (an
   iterable of bytes), nor added since by name_counted, ENOENT. False: no room (or memory), or
   no front. */
static PyObject *absent_names(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    PyObject *names;
    if (!PyArg_ParseTuple(args, "KO", &ino, &names))
        return NULL;
    PyObject *it = PyObject_GetIter(names);
    if (it == NULL)
        return NULL;
    /* Hashed first, without the lock (a million names take a while) */
    size_t count = 0, cap = 1024;
    uint64_t *hashes = malloc(cap * sizeof(*hashes));
    PyObject *item;
    while (hashes != NULL && (item = PyIter_Next(it)) != NULL) {
        char *data;
        Py_ssize_t n;
        if (PyBytes_AsStringAndSize(item, &data, &n) < 0) {
            Py_DECREF(item);
            break;
        }
        if (count == cap) {
            uint64_t *grown = realloc(hashes, 2 * cap * sizeof(*hashes));
            if (grown == NULL) {
                free(hashes);
                hashes = NULL;
                Py_DECREF(item);
                break;
            }
            hashes = grown;
            cap *= 2;
        }
        hashes[count++] = name_hash(data, (size_t)n);
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        free(hashes);
        return NULL;
    }
    int done = hashes != NULL && front_se != NULL && session_ops.lookup == lookup_absent;
    pthread_mutex_lock(&names_lock);
    struct name_dir *d = name_dir_find(ino);
    if (d != NULL)
        name_dir_end(d);  /* (anew: what it held before goes) */
    if (done && name_dir_count < NAME_DIRS_MAX) {
        size_t slots = 64;
        while (slots < 2 * (count + 1))
            slots *= 2;
        d = &name_dirs[name_dir_count];
        *d = (struct name_dir){ino, calloc(slots, sizeof(struct name_slot)), slots - 1, 0};
        if (d->slots != NULL) {
            name_dir_count++;
            for (size_t i = 0; i < count; i++)
                name_slot_add(d, hashes[i], 1);  /* (room for all: no growing) */
        } else {
            done = 0;
        }
    } else {
        done = 0;
    }
    pthread_mutex_unlock(&names_lock);
    free(hashes);
    return PyBool_FromLong(done);
}

/* (ino, name, present): one holder of `name` more (True) or fewer in directory ino. */
static PyObject *name_counted(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    const char *name;
    Py_ssize_t n;
    int present;
    if (!PyArg_ParseTuple(args, "Ky#p", &ino, &name, &n, &present))
        return NULL;
    uint64_t hash = name_hash(name, (size_t)n);
    pthread_mutex_lock(&names_lock);
    struct name_dir *d = name_dir_find(ino);
    if (d != NULL) {
        if (!present)
            name_slot_drop(d, hash);
        else if (!name_slot_add(d, hash, 1))
            name_dir_end(d);  /* no memory: Python answers every LOOKUP there */
    }
    pthread_mutex_unlock(&names_lock);
    Py_RETURN_NONE;
}

/* ino: the front answers no LOOKUP of that directory any more. */
static PyObject *absent_names_end(PyObject *self, PyObject *arg)
{
    unsigned long long ino = PyLong_AsUnsignedLongLong(arg);
    if (ino == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (__atomic_load_n(&name_dir_count, __ATOMIC_RELAXED) == 0)
        Py_RETURN_NONE;
    pthread_mutex_lock(&names_lock);
    struct name_dir *d = name_dir_find(ino);
    if (d != NULL)
        name_dir_end(d);
    pthread_mutex_unlock(&names_lock);
    Py_RETURN_NONE;
}

/* (LOOKUPs the front answered ENOENT, directories it answers, names they hold). */
static PyObject *absent_state(PyObject *self, PyObject *unused)
{
    size_t names = 0;
    pthread_mutex_lock(&names_lock);
    unsigned dirs = name_dir_count;
    for (unsigned i = 0; i < dirs; i++)
        names += name_dirs[i].used;
    pthread_mutex_unlock(&names_lock);
    return Py_BuildValue("(KIn)", __atomic_load_n(&front_lookups, __ATOMIC_RELAXED), dirs, (Py_ssize_t)names);
}

/* (ino, on, limit, timeout): the front answers CREATEs of names directory ino lacks (whose
   names it holds: absent_names), or no longer (on False); its writers collect up to `limit`
   bytes, its entries' names and attributes are cached `timeout` seconds. Whether it does. */
static PyObject *answer_creates(PyObject *self, PyObject *args)
{
    unsigned long long ino, limit;
    int on, done = 0;
    double timeout;
    if (!PyArg_ParseTuple(args, "KpKd", &ino, &on, &limit, &timeout))
        return NULL;
    pthread_mutex_lock(&names_lock);
    struct name_dir *d = name_dir_find(ino);
    if (d != NULL && session_ops.create == create_answered) {
        on = on && front_started;
        if (on && !d->creates)
            create_dirs++;
        else if (!on && d->creates)
            create_dirs--;
        d->creates = on;
        d->create_limit = limit;
        d->create_timeout = timeout;
        done = on;
    }
    pthread_mutex_unlock(&names_lock);
    return PyBool_FromLong(done);
}

/* numbers: inode numbers the front may give the entries it creates (never used elsewhere);
   how many it took (the pool holds CREATE_POOL_MAX). */
static PyObject *create_inodes(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "inode numbers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), took = 0;
    uint64_t numbers[CREATE_POOL_MAX];
    for (Py_ssize_t i = 0; i < n && i < CREATE_POOL_MAX; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        numbers[i] = v;
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&names_lock);
    for (Py_ssize_t i = 0; i < n && i < CREATE_POOL_MAX && create_pool_count < CREATE_POOL_MAX; i++)
        if (numbers[i] != 0) {
            create_pool[create_pool_count++] = numbers[i];
            took++;
        }
    pthread_mutex_unlock(&names_lock);
    return PyLong_FromSsize_t(took);
}

/* ((dir, name, ino, fh, flags, mode, uid, gid, pid), ...): the CREATEs the front answered
   since the last call, in order. */
static PyObject *take_created(PyObject *self, PyObject *unused)
{
    static struct created taken[CREATED_MAX];  /* (only Python's thread takes, with the GIL) */
    unsigned n;
    pthread_mutex_lock(&held_lock);
    n = created_count;
    memcpy(taken, created, n * sizeof(*taken));
    created_count = 0;
    pthread_mutex_unlock(&held_lock);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (unsigned i = 0; i < n; i++) {
        struct created *c = &taken[i];
        PyObject *item = Py_BuildValue("(Ky#KKIIIII)", (unsigned long long)c->dir, c->name, (Py_ssize_t)c->namelen,
                                       (unsigned long long)c->ino, (unsigned long long)c->fh, c->flags, c->mode,
                                       c->uid, c->gid, c->pid);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* (CREATEs the front answered so far, inode numbers in its pool, directories it answers them in). */
static PyObject *create_state(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&names_lock);
    unsigned pool = create_pool_count, dirs = create_dirs;
    pthread_mutex_unlock(&names_lock);
    return Py_BuildValue("(KII)", __atomic_load_n(&front_creates, __ATOMIC_RELAXED), pool, dirs);
}

static PyMethodDef methods[] = {
    {"interposed", interposed, METH_NOARGS,
     "Whether pyfuse3's fuse_reply_open and fuse_session_new calls will come here."},
    {"noflush_replies", replies, METH_NOARGS,
     "Opens answered with FOPEN_NOFLUSH since the library was loaded."},
    {"foreign_xattr_replies", xattr_replies, METH_NOARGS,
     "GETXATTR requests of names outside XATTR_PREFIX answered ENODATA here since the library was loaded."},
    {"ioctl_replies", ioctls, METH_NOARGS, "IOCTL requests answered ENOSYS since the library was loaded."},
    {"front", front_state, METH_NOARGS,
     "(whether the front thread reads the session's requests, requests it handed to pyfuse3)."},
    {"parallel_dirops", dirops, METH_NOARGS,
     "Whether the kernel was given FUSE_PARALLEL_DIROPS in the INIT reply (lookups and readdirs of one "
     "directory side by side)."},
    {"notes_fd", notes_fd, METH_NOARGS,
     "An eventfd the front writes when it answers the OPEN or the RELEASE of an `adopted` mark's handle "
     "(-1: none)."},
    {"use_front", set_front, METH_O, "Whether the next session made is read by the front (default: yes)."},
    {"hold_attributes", hold_attributes, METH_VARARGS,
     "(ino, on): the front answers GETATTR of ino with Python's last attribute reply for it (False: no room)."},
    {"flush_free", set_flush_free, METH_VARARGS,
     "(fh, on): the front answers FLUSH of handle fh itself (False: no room)."},
    {"flush_pending", flush_pending, METH_O,
     "fh: one more commit for handle fh; a FLUSH the front answers waits for it (False: no room, or no front)."},
    {"flush_committed", flush_committed, METH_VARARGS,
     "(fh, errno): one of fh's pending commits is done (0) or failed; the last answers its parked FLUSHes."},
    {"front_answers", front_answers, METH_NOARGS, "(GETATTRs, FLUSHes, OPENs, RELEASEs of handles Python never saw) the front answered itself."},
    {"front_queued", front_queued, METH_NOARGS, "How many requests the front queued for pyfuse3 now (a hint)."},
    {"front_tables", front_tables, METH_NOARGS, "How full the front's tables are (each holds at most 64 but "
     "marks, 262144, release_free and released, 1024, notices, 4096, and kept, 8192)."},
    {"give_attributes", give_attributes, METH_VARARGS,
     "(ino, mode, nlink, uid, gid, size, blocks, blksize, atime_ns, mtime_ns, ctime_ns, timeout, once): the "
     "front answers the next GETATTR of ino with these (once: that one only, within a second); False: no room."},
    {"keep_attributes", keep_attributes, METH_VARARGS,
     "(ino, mode, nlink, uid, gid, size, blocks, blksize, atime_ns, mtime_ns, ctime_ns, timeout): the front "
     "answers every GETATTR of ino with these, until hold_attributes(ino, False); False: no room."},
    {"answer_opens", answer_opens, METH_VARARGS,
     "(ino, accmode, flags[, pid[, tag]]): the front answers opens of ino with that access mode itself (by "
     "thread pid alone if given, 0: anyone's), with a handle number of its own (flags: 1 keep_cache, 2 noflush, "
     "4 once: its first open only, noted for take_opened; 8 adopted: the handle is Python's from the open, its "
     "RELEASE handed to take_released; 16 priorities: a buffer's `priorities`, tag its ns_id, its WRITEs taken "
     "as priority_log says); False: no room; until hold_attributes(ino, False)."},
    {"take_opened", take_opened, METH_NOARGS,
     "(inode, handle number) of each `once` mark the front opened since the last call."},
    {"adopt_opened", adopt_opened, METH_O,
     "fh: (ino, open flags) of a handle the front opened, now Python's (its RELEASE goes to take_released); "
     "None if it opened no such handle."},
    {"release_free", set_release_free, METH_VARARGS,
     "(fh[, wake]): the front answers handle fh's RELEASE itself and keeps its number for take_released, "
     "writing notes_efd then if `wake` (False: no room)."},
    {"collect_writes", collect_writes, METH_VARARGS,
     "(fh, limit, ino, mode, uid, gid, timeout): the front collects the WRITEs of that handle, up to limit bytes, "
     "answering GETATTRs of its inode meanwhile; False: it does not."},
    {"take_collected", take_collected, METH_O,
     "fh: the bytes collected for that handle (it collects no more), or None if it was not collecting."},
    {"collected_size", collected_size, METH_O,
     "fh: the bytes collected so far for that handle (it collects on), or None if it is not collecting."},
    {"collect_state", collect_state, METH_NOARGS, "(WRITEs collected so far, handles collecting, bytes held)."},
    {"chunks_arm", chunks_arm, METH_VARARGS,
     "(fh, pos, chunk_bytes, limit): the front copies that handle's WRITEs into chunks lent to it, the first at pos."},
    {"chunks_lend", chunks_lend, METH_VARARGS,
     "(fh, index, buffer): lend a buffer of chunk_bytes for that chunk of an armed handle; False: not taken."},
    {"chunks_full", chunks_full, METH_NOARGS, "[(fh, index, buffer, filled)]: the chunks filled whole since the last call."},
    {"chunks_stop", chunks_stop, METH_O,
     "fh: (pos, [(index, buffer, filled)]): the handle is disarmed, every chunk lent given back; None: not armed."},
    {"chunks_pos", chunks_pos, METH_O, "fh: where the armed handle's next WRITE would land; None: not armed."},
    {"chunks_state", chunks_state, METH_NOARGS, "(WRITEs copied into chunks, chunks filled, handles armed)."},
    {"absent_names", absent_names, METH_VARARGS,
     "(ino, names): the front answers LOOKUPs in directory ino of names it does not hold ENOENT; it holds "
     "`names` (bytes) and what name_counted adds; False: it does not (no room, no front)."},
    {"name_counted", name_counted, METH_VARARGS,
     "(ino, name, present): directory ino holds name once more (True) or once less."},
    {"absent_names_end", absent_names_end, METH_O, "ino: the front answers no LOOKUP in that directory any more."},
    {"absent_state", absent_state, METH_NOARGS,
     "(LOOKUPs answered ENOENT by the front, directories it answers, names they hold)."},
    {"answer_creates", answer_creates, METH_VARARGS,
     "(ino, on, limit, timeout): the front answers write-only CREATEs of names directory ino lacks (or no longer); "
     "whether it does."},
    {"create_inodes", create_inodes, METH_O, "numbers: inode numbers for the entries the front creates; how many it took."},
    {"take_created", take_created, METH_NOARGS,
     "((dir, name, ino, fh, flags, mode, uid, gid, pid), ...): the CREATEs the front answered since the last call."},
    {"create_state", create_state, METH_NOARGS,
     "(CREATEs answered by the front, inode numbers in its pool, directories it answers them in)."},
    {"take_released", take_released, METH_NOARGS, "The handles whose RELEASE the front answered since the last call."},
    {"take_writes", take_writes, METH_NOARGS,
     "((ns_id, number, text), ...): the `priorities` WRITEs the front answered since the last call, in order, "
     "each appended to the priority write-ahead file as record `number`."},
    {"priority_log", set_priority_log, METH_VARARGS,
     "(fd, next_number, priority_max): the write-ahead file the front appends the `priorities` WRITEs it takes "
     "to (fd -1: it takes none)."},
    {"priority_log_trim", priority_log_trim, METH_O,
     "number: that record is committed; the file is emptied if it was the last and the file is past 1 MiB."},
    {"priority_log_state", priority_log_state, METH_NOARGS,
     "(WRITEs taken, times the file was emptied, the number the next record gets)."},
    {"passthrough", passthrough_state, METH_NOARGS,
     "(whether the INIT reply asked the kernel for FUSE passthrough, opens answered FOPEN_PASSTHROUGH so far)."},
    {"backing_open", backing_open, METH_O,
     "fd: register an open file as a backing file on the session (FUSE_DEV_IOC_BACKING_OPEN); its id."},
    {"backing_close", backing_close, METH_O, "id: unregister a backing file (its opens keep it)."},
    {"passthrough_fh", passthrough_fh, METH_VARARGS,
     "(fh, id): the handle number to return from open() for it to be answered FOPEN_PASSTHROUGH with backing "
     "file id (unchanged when the table is full)."},
    {"use_passthrough", set_passthrough, METH_O,
     "Whether the next session asks the kernel for FUSE passthrough when it offers it (default: yes)."},
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
    if (getrandom(&name_seed, sizeof(name_seed), GRND_NONBLOCK) != (ssize_t)sizeof(name_seed))
        name_seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObject(m, "NOFLUSH_FH", PyLong_FromUnsignedLongLong(NOFLUSH_FH)) < 0 ||
                      PyModule_AddIntConstant(m, "HOLDS_MAX", HOLDS_MAX) < 0 ||
                      PyModule_AddIntConstant(m, "HELD_ONCE_ROOM", HELD_ONCE_ROOM) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
