/* kvdepotd.transfer._blockcopy: one KV block between engine memory and the host arena, its xxh3-64
 * taken in the same pass.
 *
 *   bind(create_state, free_state, reset, update, digest)   the xxhash library's streaming functions,
 *                                                           by address (kvdepotd.transfer.blockcopy)
 *   copy_block(runs, block, host, to_host, want_hash) -> int | None
 *   copy_blocks(runs, blocks, hosts, to_host, states) -> None
 *
 * copy_blocks moves part of each of several blocks (a load copied layer by layer passes the runs of
 * one layer): `blocks` and `hosts` pack native int64 block ids and host addresses, one per block,
 * and `states`, empty or one per block, the addresses of xxh3 states the caller made and reset,
 * which each block's bytes update in order: the caller's digest after the last layer is the same
 * checksum copy_block gives for the whole block.
 * `runs` packs, per run of the block, three native int64: address of the run of block 0, the
 * stride from one block to the next, and the run's length. The runs lie back to back in the host
 * block from `host` on, in order, so hashing them in order gives the xxh3 of the host block
 * itself: the same checksum a one-shot hash of the arena's bytes gives, which the disk tier and
 * the other copy paths keep. Each run goes in pieces that fit the core's L1 cache: a piece is
 * hashed where it is read from (engine memory for a store, the arena for a load: what a load
 * checks is the tier's bytes), then copied out of the cache with non-temporal stores, so memory
 * sees one read and one write per byte. A plain memcpy also reads every destination line before
 * writing it; a hash after the copy was a second pass (README, Performance, has the figures).
 *
 * The caller checked every address once, when the engine registered (kvdepotd.transfer.mapping),
 * and keeps the mappings alive while a copy runs. The GIL is released while bytes move.
 *
 * Engine memory is a file the engine can still shrink (a /dev/shm file registered by path): a copy
 * that touches a page past the file's new end gets SIGBUS, which would kill the daemon for every
 * engine on it. So each copy runs guarded: the module's SIGBUS handler (installed by bind(), chained
 * to whatever handler was there) jumps out of a guarded copy on the faulting thread, and copy_block
 * raises OSError(EFAULT) instead; a SIGBUS anywhere else goes on to the earlier handler as before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#endif

#define PIECE ((int64_t)16 << 10) /* hashed, then copied while it is still in L1 */

/* n bytes from s to d, the destination bypassing the cache where the CPU can (x86-64: SSE2). */
static void copy_out(char *d, const char *s, size_t n) {
#ifdef STREAMING
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static struct {
    create_fn create;
    free_fn free;
    reset_fn reset;
    update_fn update;
    digest_fn digest;
} xxh;

/* The guarded copy running on this thread, if any. initial-exec: the handler reads it without the
 * lazy allocation a dlopen()ed module's TLS may otherwise do on first use. */
static __thread sigjmp_buf *guard __attribute__((tls_model("initial-exec")));
static struct sigaction earlier_bus;
static int bus_installed;

static void on_sigbus(int sig, siginfo_t *info, void *uc) {
    sigjmp_buf *g = guard;
    if (g != NULL) {
        guard = NULL;
        siglongjmp(*g, 1);
    }
    if (earlier_bus.sa_flags & SA_SIGINFO) {
        earlier_bus.sa_sigaction(sig, info, uc);
    } else if (earlier_bus.sa_handler != SIG_DFL && earlier_bus.sa_handler != SIG_IGN) {
        earlier_bus.sa_handler(sig);
    } else { /* the default: die of it, as without this module */
        sigaction(SIGBUS, &earlier_bus, NULL);
        raise(SIGBUS);
    }
}

static int install_sigbus(void) {
    if (bus_installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &earlier_bus) != 0)
        return -1;
    bus_installed = 1;
    return 0;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *fns[5];
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "bind() takes the addresses of create_state, free_state, reset, update and digest");
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        fns[i] = PyLong_AsVoidPtr(args[i]);
        if (fns[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bind(): a function address is 0");
            return NULL;
        }
    }
    xxh.create = (create_fn)fns[0];
    xxh.free = (free_fn)fns[1];
    xxh.reset = (reset_fn)fns[2];
    xxh.update = (update_fn)fns[3];
    xxh.digest = (digest_fn)fns[4];
    if (install_sigbus() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* The runs of one block between engine memory and `host`, hashing into `state` (if any) on the way. */
static void copy_runs(const int64_t *runs, Py_ssize_t nruns, int64_t block, char *host, int to_host, void *state) {
    for (Py_ssize_t r = 0; r < nruns; r++) {
        char *engine = (char *)(intptr_t)(runs[3 * r] + block * runs[3 * r + 1]);
        int64_t n = runs[3 * r + 2];
        for (int64_t at = 0; at < n; at += PIECE) {
            size_t k = (size_t)(n - at < PIECE ? n - at : PIECE);
            const char *src = to_host ? engine + at : host + at;
            if (state != NULL)
                xxh.update(state, src, k);
            copy_out(to_host ? host + at : engine + at, src, k);
        }
        host += n;
    }
}

static PyObject *fault_error(void) {
    PyObject *e = Py_BuildValue("(is)", EFAULT, "the engine's memory is gone under the copy (its file was shrunk: SIGBUS caught)");
    if (e != NULL) {
        PyErr_SetObject(PyExc_OSError, e);
        Py_DECREF(e);
    }
    return NULL;
}

static PyObject *copy_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_block(runs, block, host, to_host, want_hash)");
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) % (3 * sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_TypeError, "copy_block(): runs must be bytes of int64 triples");
        return NULL;
    }
    const int64_t *runs = (const int64_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t nruns = PyBytes_GET_SIZE(args[0]) / (Py_ssize_t)(3 * sizeof(int64_t));
    int64_t block = PyLong_AsLongLong(args[1]);
    if (block == -1 && PyErr_Occurred())
        return NULL;
    char *host = (char *)PyLong_AsVoidPtr(args[2]);
    if (host == NULL && PyErr_Occurred())
        return NULL;
    int to_host = PyObject_IsTrue(args[3]);
    int want_hash = PyObject_IsTrue(args[4]);
    if (to_host < 0 || want_hash < 0)
        return NULL;
    if (block < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_block(): negative block");
        return NULL;
    }
    void *state = NULL;
    if (want_hash) {
        if (xxh.create == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "copy_block(): bind() the xxhash functions first");
            return NULL;
        }
        state = xxh.create();
        if (state == NULL || xxh.reset(state) != 0) {
            if (state != NULL)
                xxh.free(state);
            return PyErr_NoMemory();
        }
    }
    uint64_t digest = 0;
    volatile int faulted = 0;
    sigjmp_buf jump;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(jump, 1) != 0) { /* SIGBUS inside the copy: engine memory shrank under it */
        faulted = 1;
        goto done;
    }
    guard = &jump;
    copy_runs(runs, nruns, block, host, to_host, state);
#ifdef STREAMING
    _mm_sfence(); /* the streamed bytes are visible before the caller reports the copy done */
#endif
    if (state != NULL)
        digest = xxh.digest(state);
done:
    guard = NULL;
    if (state != NULL)
        xxh.free(state);
    Py_END_ALLOW_THREADS
    if (faulted)
        return fault_error();
    if (!want_hash)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(digest);
}

static int int64s(PyObject *o, const char *what, const int64_t **out, Py_ssize_t *n) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_TypeError, "copy_blocks(): %s must be bytes of int64", what);
        return -1;
    }
    *out = (const int64_t *)PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o) / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

static PyObject *copy_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_blocks(runs, blocks, hosts, to_host, states)");
        return NULL;
    }
    const int64_t *runs, *blocks, *hosts, *states;
    Py_ssize_t nruns3, n, nhosts, nstates;
    if (int64s(args[0], "runs", &runs, &nruns3) || int64s(args[1], "blocks", &blocks, &n) || int64s(args[2], "hosts", &hosts, &nhosts) ||
        int64s(args[4], "states", &states, &nstates))
        return NULL;
    if (nruns3 % 3 != 0 || nhosts != n || (nstates != 0 && nstates != n)) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks(): runs are int64 triples; hosts, and states unless empty, one per block");
        return NULL;
    }
    int to_host = PyObject_IsTrue(args[3]);
    if (to_host < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (blocks[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_blocks(): negative block");
            return NULL;
        }
    if (nstates != 0 && xxh.update == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "copy_blocks(): bind() the xxhash functions first");
        return NULL;
    }
    volatile int faulted = 0;
    sigjmp_buf jump;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(jump, 1) != 0) {
        faulted = 1;
        goto done;
    }
    guard = &jump;
    for (Py_ssize_t i = 0; i < n; i++)
        copy_runs(runs, nruns3 / 3, blocks[i], (char *)(intptr_t)hosts[i], to_host, nstates ? (void *)(intptr_t)states[i] : NULL);
#ifdef STREAMING
    _mm_sfence();
#endif
done:
    guard = NULL;
    Py_END_ALLOW_THREADS
    if (faulted)
        return fault_error();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, "bind(create_state, free_state, reset, update, digest)"},
    {"copy_block", (PyCFunction)(void (*)(void))copy_block, METH_FASTCALL,
     "copy_block(runs, block, host, to_host, want_hash) -> xxh3 of the block's bytes, or None"},
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_FASTCALL,
     "copy_blocks(runs, blocks, hosts, to_host, states): part of several blocks, updating the caller's xxh3 states"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockcopy(void) { return PyModule_Create(&module); }
