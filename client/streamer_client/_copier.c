/* A pool of native threads that copy byte ranges between addresses of this process.
 *
 * What it is for (streamer_client/_native_copier.py, its Python side): bytes already in memory copied into
 * buffers of ours. The embedded engine reads a checkpoint in a local directory by mapping its files
 * and copying each batch's ranges into a ring slot (streamer_service/readers/mapped.py); a rank copies a
 * daemon segment's bytes into its CPU tensors or into its pinned staging buffers
 * (streamer_client/_delivery.py). The copies run here, on threads that never touch the
 * interpreter: one call queues a batch (split into chunks), one call waits for it with the GIL
 * released. Python threads doing the same copies contend for the GIL between chunks
 * and run slower for it; here the
 * interpreter is involved twice per batch.
 *
 * A source is a file mapping, and a file cut short under a mapping raises SIGBUS on the next
 * access past its new end. Every copy (a worker's chunk, or copy_here's on the caller's thread)
 * runs under a guard: a SIGBUS raised by that copy's access jumps back out of it, and the batch
 * reports which of its copies failed (Python raises ObjectChangedError naming the file and range)
 * instead of the process dying. Anything else goes where it would have gone without us: a SIGBUS
 * on another thread, one sent by kill(), and a hardware memory error (BUS_MCEERR_*) go to the
 * handler installed before ours, or end the process. A handler installed after ours is chained
 * to: each batch installs ours again over it (ensure_guard).
 *
 * Interface (all addresses and sizes are Python ints; the arrays are bytes of native uint64):
 *   pool(threads, chunk_bytes) -> capsule
 *   submit(pool, dsts, srcs, sizes) -> ticket            queues one batch, returns at once
 *   wait(pool, ticket, timeout_ms) -> None | index       None: not done yet; -1: done; i >= 0:
 *                                                        done, copy i hit SIGBUS (its file shrank)
 *   copy_here(dsts, srcs, sizes) -> index               the copies on the calling thread, guarded alike
 *   close(pool)                                          finishes every queued copy, joins threads
 *   map(fd, nbytes) -> address                           a read-only shared mapping of a file
 *   unmap(address, nbytes)
 * (Python's mmap keeps a duplicate of the file's descriptor per mapping: a checkpoint of a
 * thousand shards would hold a thousand descriptors while its mappings are kept.)
 * The caller keeps sources and destinations alive until the batch is waited for (or close).
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CAPSULE_NAME "streamer_client._copier.pool"
#define MAX_TICKETS 4096 /* batches queued and not yet waited for, per pool */

typedef struct {
    char *dst;
    const char *src;
    size_t nbytes;
    uint32_t ticket_slot;
    uint32_t copy_index; /* which copy of its batch this chunk belongs to */
} chunk_t;

#define MAX_QUEUED (SIZE_MAX / sizeof(chunk_t)) /* chunks one queue can hold: its bytes fit a size_t */

typedef struct {
    int64_t ticket; /* -1: free */
    size_t remaining; /* chunks not yet copied */
    int64_t failed; /* -1, or the lowest copy index that hit SIGBUS */
} batch_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work; /* chunks queued, or stopping */
    pthread_cond_t done; /* a batch finished */
    chunk_t *queue;
    size_t head, count, capacity;
    batch_t batches[MAX_TICKETS];
    int64_t next_ticket;
    size_t chunk_bytes;
    int stopping;
    int nthreads;
    pthread_t *threads;
    pid_t owner; /* a forked child has none of the threads: the pool is not its to use or stop */
    int initialized; /* which of lock, work, done were initialized (bits 1, 2, 4) */
} pool_t;

/* ------------------------------------------------------------------ SIGBUS guard */

/* volatile: memcpy is a builtin the compiler knows cannot read it, so without it the store before
 * the copy is dead to the compiler and goes. initial-exec: the handler reads it, and a thread-local
 * of a dlopen()ed module otherwise goes through __tls_get_addr, which may allocate on a thread's
 * first access (not async-signal-safe). The workers touch it before their first copy. */
static __thread sigjmp_buf *volatile guard __attribute__((tls_model("initial-exec")));

/* Another handler installed after ours (faulthandler.enable(), a runtime's crash reporter) replaces
 * it: each batch checks that ours is in place and installs it again over the newcomer, which it
 * then chains to. Each installation is its own entry point (INSTALLS of them), with the handler it
 * replaced: a newcomer that later restores what it replaced (faulthandler.disable(), or faulthandler
 * handling a fault that is not ours) puts back an older entry point, whose chain is still right.
 * Once every entry point was used, ours is not installed again. */
#define INSTALLS 16
static struct sigaction previous_bus[INSTALLS];
static int installs; /* entry points used */
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;

static void on_bus(int slot, int sig, siginfo_t *info, void *context) {
    /* Raised by an access (a mapped file cut short), not sent by kill() or raise(): only that one
     * ends a copy, wherever the copying thread was. A hardware memory error (BUS_MCEERR_AR: this
     * access read a corrupted page; BUS_MCEERR_AO: one was found elsewhere) is not a file cut
     * short: it goes where it would have gone without us. */
    int code = info != NULL ? info->si_code : 0;
    int fault = code > 0;
    int hardware = code == BUS_MCEERR_AR || code == BUS_MCEERR_AO;
    if (fault && !hardware && guard != NULL) {
        siglongjmp(*guard, 1);
    }
    /* Not one of our copies: what would have happened without us. */
    const struct sigaction *previous = &previous_bus[slot];
    if (previous->sa_handler == SIG_IGN && !fault) {
        return;
    }
    if (previous->sa_handler != SIG_IGN && previous->sa_handler != SIG_DFL) {
        if (previous->sa_flags & SA_SIGINFO) {
            previous->sa_sigaction(sig, info, context);
        } else {
            previous->sa_handler(sig);
        }
        return;
    }
    /* The default action: a faulting access runs again and the process dies of it as it would have
     * (SIGBUS from a fault cannot be ignored either); a hardware memory error (BUS_MCEERR_AO does
     * not come back by itself) and a sent signal are raised again. */
    signal(SIGBUS, SIG_DFL);
    if (!fault || hardware) {
        raise(SIGBUS);
    }
}

#define ENTRY(k) \
    static void on_bus_##k(int sig, siginfo_t *info, void *context) { on_bus(k, sig, info, context); }
ENTRY(0) ENTRY(1) ENTRY(2) ENTRY(3) ENTRY(4) ENTRY(5) ENTRY(6) ENTRY(7)
ENTRY(8) ENTRY(9) ENTRY(10) ENTRY(11) ENTRY(12) ENTRY(13) ENTRY(14) ENTRY(15)
static void (*const entries[INSTALLS])(int, siginfo_t *, void *) = {
    on_bus_0, on_bus_1, on_bus_2, on_bus_3, on_bus_4, on_bus_5, on_bus_6, on_bus_7,
    on_bus_8, on_bus_9, on_bus_10, on_bus_11, on_bus_12, on_bus_13, on_bus_14, on_bus_15,
};

/* Ours is the process's SIGBUS handler when this returns 0 (installed again if another replaced
 * it); -1 with errno set where sigaction failed. Called before every batch. */
static int ensure_guard(void) {
    int result = 0;
    pthread_mutex_lock(&install_lock);
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        result = -1;
    } else if (current.sa_flags & SA_SIGINFO) {
        for (int i = 0; i < installs; i++) {
            if (current.sa_sigaction == entries[i]) {
                pthread_mutex_unlock(&install_lock);
                return 0;
            }
        }
    }
    if (result == 0 && installs < INSTALLS) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = entries[installs];
        /* SA_NODEFER: the jump leaves the handler, so SIGBUS must not stay blocked on that thread. */
        action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        previous_bus[installs] = current; /* before the entry point can run */
        if (sigaction(SIGBUS, &action, NULL) != 0) {
            result = -1;
        } else {
            installs++;
        }
    }
    pthread_mutex_unlock(&install_lock);
    return result;
}

/* 0, or 1 if the copy hit SIGBUS (part of it may have been written). */
static int guarded_copy(char *dst, const char *src, size_t nbytes) {
    sigjmp_buf here;
    if (sigsetjmp(here, 0)) {
        guard = NULL;
        return 1;
    }
    guard = &here;
    memcpy(dst, src, nbytes);
    guard = NULL;
    return 0;
}

/* ------------------------------------------------------------------ workers */

static void *worker(void *arg) {
    pool_t *pool = arg;
    /* The interpreter's signal handling stays on its main thread: block what it would handle. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &mask, NULL);
    /* Whatever the thread that made the pool blocked: a copy's fault must reach the guard (a
     * blocked SIGBUS from a fault kills the process). */
    sigemptyset(&mask);
    sigaddset(&mask, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &mask, NULL);
    guard = NULL; /* this thread's slot exists before any fault can need it */
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (pool->count == 0 && !pool->stopping) {
            pthread_cond_wait(&pool->work, &pool->lock);
        }
        if (pool->count == 0) { /* stopping, and nothing is left to copy */
            break;
        }
        chunk_t chunk = pool->queue[pool->head];
        pool->head = (pool->head + 1) % pool->capacity;
        pool->count--;
        pthread_mutex_unlock(&pool->lock);
        int bus = guarded_copy(chunk.dst, chunk.src, chunk.nbytes);
        pthread_mutex_lock(&pool->lock);
        batch_t *batch = &pool->batches[chunk.ticket_slot];
        if (bus && (batch->failed < 0 || (int64_t)chunk.copy_index < batch->failed)) {
            batch->failed = chunk.copy_index;
        }
        if (--batch->remaining == 0) {
            pthread_cond_broadcast(&pool->done);
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

/* 0, or -1 (no memory, or more chunks than memory could hold). With the lock held. */
static int grow_queue(pool_t *pool, size_t more) {
    if (more > MAX_QUEUED - pool->count) {
        return -1;
    }
    size_t needed = pool->count + more;
    if (needed <= pool->capacity) {
        return 0;
    }
    size_t capacity = pool->capacity ? pool->capacity : 1024;
    while (capacity < needed) {
        capacity = capacity > MAX_QUEUED / 2 ? MAX_QUEUED : capacity * 2;
    }
    chunk_t *queue = malloc(capacity * sizeof *queue);
    if (queue == NULL) {
        return -1;
    }
    for (size_t i = 0; i < pool->count; i++) {
        queue[i] = pool->queue[(pool->head + i) % pool->capacity];
    }
    free(pool->queue);
    pool->queue = queue;
    pool->head = 0;
    pool->capacity = capacity;
    return 0;
}

/* Finish every queued chunk, then join the workers. The GIL must not be held. */
static void stop_pool(pool_t *pool) {
    if ((pool->initialized & 7) != 7) { /* never started: no threads, maybe no lock */
        return;
    }
    pthread_mutex_lock(&pool->lock);
    int running = pool->threads != NULL && !pool->stopping;
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    if (!running) {
        return;
    }
    for (int i = 0; i < pool->nthreads; i++) {
        pthread_join(pool->threads[i], NULL);
    }
}

static void free_pool(pool_t *pool) {
    if (pool->initialized & 1) {
        pthread_mutex_destroy(&pool->lock);
    }
    if (pool->initialized & 2) {
        pthread_cond_destroy(&pool->work);
    }
    if (pool->initialized & 4) {
        pthread_cond_destroy(&pool->done);
    }
    free(pool->threads);
    free(pool->queue);
    free(pool);
}

/* The lock and the two conditions; `done` waits against CLOCK_MONOTONIC (a wall clock set back
 * would stretch a wait's timeout). 0, or the first error. */
static int init_sync(pool_t *pool) {
    int err = pthread_mutex_init(&pool->lock, NULL);
    if (err) {
        return err;
    }
    pool->initialized |= 1;
    if ((err = pthread_cond_init(&pool->work, NULL))) {
        return err;
    }
    pool->initialized |= 2;
    pthread_condattr_t attr;
    if ((err = pthread_condattr_init(&attr))) {
        return err;
    }
    err = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!err) {
        err = pthread_cond_init(&pool->done, &attr);
    }
    pthread_condattr_destroy(&attr);
    if (err) {
        return err;
    }
    pool->initialized |= 4;
    return 0;
}

static void capsule_destructor(PyObject *capsule) {
    pool_t *pool = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (pool == NULL) {
        PyErr_Clear();
        return;
    }
    if (pool->owner != getpid()) { /* inherited through fork: its threads and lock state are not ours */
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    stop_pool(pool);
    Py_END_ALLOW_THREADS
    free_pool(pool);
}

static pool_t *get_pool(PyObject *capsule) {
    pool_t *pool = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (pool != NULL && pool->owner != getpid()) {
        PyErr_SetString(PyExc_ValueError, "the copier pool was made by the parent of this forked process");
        return NULL;
    }
    if (pool != NULL) {
        pthread_mutex_lock(&pool->lock);
        int stopping = pool->stopping;
        pthread_mutex_unlock(&pool->lock);
        if (stopping) {
            PyErr_SetString(PyExc_ValueError, "the copier pool is closed");
            return NULL;
        }
    }
    return pool;
}

/* ------------------------------------------------------------------ module functions */

static PyObject *py_pool(PyObject *self, PyObject *args) {
    int nthreads;
    Py_ssize_t chunk_bytes;
    if (!PyArg_ParseTuple(args, "in", &nthreads, &chunk_bytes)) {
        return NULL;
    }
    if (nthreads < 1 || nthreads > 1024 || chunk_bytes < 4096) {
        PyErr_Format(PyExc_ValueError, "copier pool: threads must be 1-1024 and chunks at least 4096 bytes, got %d, %zd",
                     nthreads, chunk_bytes);
        return NULL;
    }
    if (ensure_guard() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    pool_t *pool = calloc(1, sizeof *pool);
    if (pool == NULL) {
        return PyErr_NoMemory();
    }
    int err = init_sync(pool);
    if (err) {
        free_pool(pool);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    for (int i = 0; i < MAX_TICKETS; i++) {
        pool->batches[i].ticket = -1;
    }
    pool->chunk_bytes = (size_t)chunk_bytes;
    pool->owner = getpid();
    pool->threads = calloc((size_t)nthreads, sizeof *pool->threads);
    if (pool->threads == NULL) {
        free_pool(pool);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < nthreads; i++) {
        err = pthread_create(&pool->threads[i], NULL, worker, pool);
        if (err) {
            pool->nthreads = i;
            Py_BEGIN_ALLOW_THREADS
            stop_pool(pool);
            Py_END_ALLOW_THREADS
            free_pool(pool);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        pool->nthreads = i + 1;
    }
    PyObject *capsule = PyCapsule_New(pool, CAPSULE_NAME, capsule_destructor);
    if (capsule == NULL) {
        Py_BEGIN_ALLOW_THREADS
        stop_pool(pool);
        Py_END_ALLOW_THREADS
        free_pool(pool);
    }
    return capsule;
}

static int as_words(PyObject *object, const uint64_t **words, Py_ssize_t *count, const char *what) {
    char *data;
    Py_ssize_t nbytes;
    if (PyBytes_AsStringAndSize(object, &data, &nbytes) < 0) {
        return -1;
    }
    if (nbytes % 8) {
        PyErr_Format(PyExc_ValueError, "copier: %s must be packed 8-byte words", what);
        return -1;
    }
    *words = (const uint64_t *)data;
    *count = nbytes / 8;
    return 0;
}

static uint64_t left_of(uint64_t left, size_t chunk_bytes) { return left < chunk_bytes ? left : chunk_bytes; }

enum { QUEUED, QUEUE_CLOSED, QUEUE_FULL, QUEUE_NO_MEMORY };

/* Take a ticket and queue a batch's ``chunks`` chunks; QUEUED and the ticket in ``*ticket``, or
 * why not. Without the GIL: it waits for the lock. */
static int queue_batch(pool_t *pool, const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes, Py_ssize_t n,
                       size_t chunks, int64_t *ticket_out) {
    pthread_mutex_lock(&pool->lock);
    if (pool->stopping) { /* closed by another thread since the caller looked */
        pthread_mutex_unlock(&pool->lock);
        return QUEUE_CLOSED;
    }
    /* The next ticket whose slot is free: a batch nobody waited for holds its slot, not the pool. */
    int64_t ticket = pool->next_ticket;
    for (int tried = 1; pool->batches[ticket % MAX_TICKETS].ticket != -1 && tried < MAX_TICKETS; tried++) {
        ticket++;
    }
    uint32_t slot = (uint32_t)(ticket % MAX_TICKETS);
    if (pool->batches[slot].ticket != -1) {
        pthread_mutex_unlock(&pool->lock);
        return QUEUE_FULL;
    }
    if (grow_queue(pool, chunks) < 0) {
        pthread_mutex_unlock(&pool->lock);
        return QUEUE_NO_MEMORY;
    }
    pool->next_ticket = ticket + 1;
    batch_t *batch = &pool->batches[slot];
    batch->ticket = ticket;
    batch->remaining = chunks;
    batch->failed = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (uint64_t done = 0; done < sizes[i]; done += left_of(sizes[i] - done, pool->chunk_bytes)) {
            uint64_t left = sizes[i] - done;
            chunk_t *chunk = &pool->queue[(pool->head + pool->count) % pool->capacity];
            chunk->dst = (char *)(uintptr_t)(dsts[i] + done);
            chunk->src = (const char *)(uintptr_t)(srcs[i] + done);
            chunk->nbytes = left < pool->chunk_bytes ? left : pool->chunk_bytes;
            chunk->ticket_slot = slot;
            chunk->copy_index = (uint32_t)i;
            pool->count++;
        }
    }
    if (chunks) {
        pthread_cond_broadcast(&pool->work);
    }
    pthread_mutex_unlock(&pool->lock);
    *ticket_out = ticket;
    return QUEUED;
}

/* Queue one batch; its ticket, or -1 with a Python error set. */
static int64_t submit_batch(pool_t *pool, PyObject *dsts_obj, PyObject *srcs_obj, PyObject *sizes_obj) {
    const uint64_t *dsts, *srcs, *sizes;
    Py_ssize_t n, n_srcs, n_sizes;
    if (as_words(dsts_obj, &dsts, &n, "destinations") < 0 || as_words(srcs_obj, &srcs, &n_srcs, "sources") < 0 ||
        as_words(sizes_obj, &sizes, &n_sizes, "sizes") < 0) {
        return -1;
    }
    if (n != n_srcs || n != n_sizes || n == 0 || n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "copier: a batch needs one destination, source and size per copy");
        return -1;
    }
    size_t chunks = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > SIZE_MAX || dsts[i] > UINTPTR_MAX - sizes[i] || srcs[i] > UINTPTR_MAX - sizes[i]) {
            PyErr_Format(PyExc_ValueError, "copier: copy %zd (%llu bytes) runs past the end of the address space", i,
                         (unsigned long long)sizes[i]);
            return -1;
        }
        size_t more = (size_t)(sizes[i] / pool->chunk_bytes + (sizes[i] % pool->chunk_bytes != 0));
        if (more > MAX_QUEUED - chunks) {
            PyErr_Format(PyExc_ValueError, "copier: a batch of more than %zu chunks", (size_t)MAX_QUEUED);
            return -1;
        }
        chunks += more;
    }
    if (ensure_guard() != 0) { /* another handler may have replaced ours since the last batch */
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    int64_t ticket;
    int outcome;
    /* The workers take the lock for every chunk: waiting for it here must not hold up the
     * interpreter's other threads. The arrays are the caller's bytes, alive for the call. */
    Py_BEGIN_ALLOW_THREADS
    outcome = queue_batch(pool, dsts, srcs, sizes, n, chunks, &ticket);
    Py_END_ALLOW_THREADS
    switch (outcome) {
    case QUEUED:
        return ticket;
    case QUEUE_CLOSED:
        PyErr_SetString(PyExc_ValueError, "the copier pool is closed");
        return -1;
    case QUEUE_FULL:
        PyErr_Format(PyExc_RuntimeError, "copier: more than %d batches queued and not waited for", MAX_TICKETS);
        return -1;
    default:
        PyErr_NoMemory();
        return -1;
    }
}

/* The batch of ``args`` (pool, dsts, srcs, sizes), queued: its ticket and its pool, or -1 with a
 * Python error set. */
static int64_t submit_args(PyObject *args, pool_t **pool) {
    PyObject *capsule, *dsts_obj, *srcs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "OSSS", &capsule, &dsts_obj, &srcs_obj, &sizes_obj)) {
        return -1;
    }
    *pool = get_pool(capsule);
    if (*pool == NULL) {
        return -1;
    }
    return submit_batch(*pool, dsts_obj, srcs_obj, sizes_obj);
}

static PyObject *py_submit(PyObject *self, PyObject *args) {
    pool_t *pool;
    int64_t ticket = submit_args(args, &pool);
    return ticket < 0 ? NULL : PyLong_FromLongLong(ticket);
}

/* Wait for batch ``ticket`` until it is done, or until ``timeout_ms`` passed (< 0: no limit).
 * 1 and its result in ``failed`` once done (its slot is free again), else 0. The GIL must not
 * be held. */
static int wait_batch(pool_t *pool, int64_t ticket, int timeout_ms, int64_t *failed) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    if (timeout_ms >= 0) {
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&pool->lock);
    batch_t *batch = &pool->batches[ticket % MAX_TICKETS];
    while (batch->remaining > 0) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&pool->done, &pool->lock);
        } else if (pthread_cond_timedwait(&pool->done, &pool->lock, &deadline) == ETIMEDOUT) {
            break;
        }
    }
    int finished = batch->remaining == 0;
    *failed = batch->failed;
    if (finished) {
        batch->ticket = -1;
    }
    pthread_mutex_unlock(&pool->lock);
    return finished;
}

static PyObject *py_wait(PyObject *self, PyObject *args) {
    PyObject *capsule;
    long long ticket;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "OLi", &capsule, &ticket, &timeout_ms)) {
        return NULL;
    }
    pool_t *pool = get_pool(capsule);
    if (pool == NULL) {
        return NULL;
    }
    uint32_t slot = (uint32_t)((ticket < 0 ? 0 : ticket) % MAX_TICKETS);
    pthread_mutex_lock(&pool->lock);
    int queued = ticket >= 0 && pool->batches[slot].ticket == ticket;
    pthread_mutex_unlock(&pool->lock);
    if (!queued) { /* a ticket is waited for by one thread: nobody else can free it meanwhile */
        PyErr_Format(PyExc_ValueError, "copier: no batch %lld is queued", ticket);
        return NULL;
    }
    int finished;
    int64_t failed;
    Py_BEGIN_ALLOW_THREADS
    finished = wait_batch(pool, ticket, timeout_ms, &failed);
    Py_END_ALLOW_THREADS
    if (!finished) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(failed);
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    pool_t *pool;
    int64_t ticket = submit_args(args, &pool);
    if (ticket < 0) {
        return NULL;
    }
    /* Done before the interpreter runs again: nothing (a signal's exception) can leave the copying
     * threads writing into buffers their owner frees. */
    int64_t failed;
    Py_BEGIN_ALLOW_THREADS
    wait_batch(pool, ticket, -1, &failed);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(failed);
}

/* copy_here(dsts, srcs, sizes): the copies run on the calling thread, under the same guard as the
 * workers' (a batch too small to hand to the threads). -1, or the index of the first copy that hit
 * SIGBUS (the copies after it are not made). */
static PyObject *py_copy_here(PyObject *self, PyObject *args) {
    PyObject *dsts_obj, *srcs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "SSS", &dsts_obj, &srcs_obj, &sizes_obj)) {
        return NULL;
    }
    const uint64_t *dsts, *srcs, *sizes;
    Py_ssize_t n, n_srcs, n_sizes;
    if (as_words(dsts_obj, &dsts, &n, "destinations") < 0 || as_words(srcs_obj, &srcs, &n_srcs, "sources") < 0 ||
        as_words(sizes_obj, &sizes, &n_sizes, "sizes") < 0) {
        return NULL;
    }
    if (n != n_srcs || n != n_sizes) {
        PyErr_SetString(PyExc_ValueError, "copier: a batch needs one destination, source and size per copy");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > SIZE_MAX || dsts[i] > UINTPTR_MAX - sizes[i] || srcs[i] > UINTPTR_MAX - sizes[i]) {
            PyErr_Format(PyExc_ValueError, "copier: copy %zd (%llu bytes) runs past the end of the address space", i,
                         (unsigned long long)sizes[i]);
            return NULL;
        }
    }
    if (ensure_guard() != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    /* A fault must reach the guard: a blocked SIGBUS from a fault kills the process. */
    sigset_t bus, before;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, &before);
    for (Py_ssize_t i = 0; i < n && failed < 0; i++) {
        if (guarded_copy((char *)(uintptr_t)dsts[i], (const char *)(uintptr_t)srcs[i], (size_t)sizes[i])) {
            failed = i;
        }
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(failed);
}

static PyObject *py_close(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) {
        return NULL;
    }
    pool_t *pool = get_pool(capsule);
    if (pool == NULL) {
        PyErr_Clear(); /* closed already, or a forked child's copy: nothing to stop */
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    stop_pool(pool);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_map(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "in", &fd, &nbytes)) {
        return NULL;
    }
    if (nbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "copier: a mapping needs at least one byte");
        return NULL;
    }
    void *address = mmap(NULL, (size_t)nbytes, PROT_READ, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)address);
}

static PyObject *py_unmap(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "Kn", &address, &nbytes)) {
        return NULL;
    }
    if (munmap((void *)(uintptr_t)address, (size_t)nbytes) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *py_advise_huge(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "Kn", &address, &nbytes)) {
        return NULL;
    }
    /* The whole pages inside [address, address + nbytes): advice on anything else would reach
       memory that is not the caller's. */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = ((uintptr_t)address + page - 1) & ~(page - 1);
    uintptr_t end = ((uintptr_t)address + (uintptr_t)(nbytes > 0 ? nbytes : 0)) & ~(page - 1);
    if (end <= start) {
        Py_RETURN_FALSE;
    }
#ifdef MADV_HUGEPAGE
    if (madvise((void *)start, end - start, MADV_HUGEPAGE) == 0) {
        Py_RETURN_TRUE;
    }
#endif
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"pool", py_pool, METH_VARARGS, "pool(threads, chunk_bytes): a new pool of copying threads"},
    {"submit", py_submit, METH_VARARGS, "submit(pool, dsts, srcs, sizes): queue one batch; its ticket"},
    {"copy", py_copy, METH_VARARGS, "copy(pool, dsts, srcs, sizes): one batch, waited for: -1 or the index that hit SIGBUS"},
    {"wait", py_wait, METH_VARARGS, "wait(pool, ticket, timeout_ms): None, -1 (done) or a failed copy's index; timeout_ms < 0: until done"},
    {"copy_here", py_copy_here, METH_VARARGS,
     "copy_here(dsts, srcs, sizes): the copies on this thread, guarded: -1 or the index that hit SIGBUS"},
    {"close", py_close, METH_VARARGS, "close(pool): finish every queued copy and stop the threads"},
    {"map", py_map, METH_VARARGS, "map(fd, nbytes): the address of a read-only shared mapping of the file"},
    {"unmap", py_unmap, METH_VARARGS, "unmap(address, nbytes)"},
    {"advise_huge", py_advise_huge, METH_VARARGS,
     "advise_huge(address, nbytes): advise the whole pages inside the range for transparent huge pages; whether taken"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copier", "Native threads that copy byte ranges (streamer_client/_native_copier.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__copier(void) { return PyModule_Create(&module); }
