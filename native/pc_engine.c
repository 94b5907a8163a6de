/* pc_engine.c -- schedule engine, reduction kernels, progress, partial collectives.
 *
 * Everything that talks to MPI is in the section "MPI" below (Isend/Irecv/Testsome,
 * cancel at shutdown). Everything runs under one engine lock; the progress thread
 * (progress_main) and the inline test/wait paths call the same engine_progress().
 */
#define _GNU_SOURCE
#include "pc_engine.h"
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <dlfcn.h>

/* ------------------------------------------------------------------ errors */
static __thread char last_error[512];

/* Record a message for pc_last_error() (per thread) and return the code. */
static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

const char *pc_last_error(void) { return last_error; }

const char *pc_strerror(int code)
{
    switch (code) {
    case PC_OK: return "success";
    case PC_ERR_ARG: return "invalid argument";
    case PC_ERR_MPI: return "MPI error";
    case PC_ERR_NOMEM: return "out of memory";
    case PC_ERR_STATE: return "invalid state";
    case PC_ERR_TIMEOUT: return "timed out";
    case PC_ERR_THREAD: return "thread error";
    case PC_ERR_DTYPE_OP: return "operation not defined for this datatype";
    case PC_ERR_TRUNCATE: return "message size mismatch";
    }
    return "unknown error";
}

/* ------------------------------------------------------------------ kernels */
typedef struct { float re, im; } c64;
typedef struct { double re, im; } c128;

/* class of each dtype: 0 bool, 1 integer, 2 floating, 3 complex */
static const int dt_class[PC_DT_COUNT] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3};
static const size_t dt_size[PC_DT_COUNT] = {1, 1, 2, 4, 8, 1, 2, 4, 8, 4, 8, 8, 16};

/* MPIX_Query_cuda_support() of the loaded libmpi (MPICH >= 4, Open MPI), looked up at
 * run time so that the engine loads with any MPI: 1 CUDA-aware, 0 not, -1 no such query. */
int pc_mpi_cuda_support(void)
{
    int (*query)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support");
    return query ? (query() != 0) : -1;
}

int pc_op_valid(int redop, int dtype)
{
    if (dtype < 0 || dtype >= PC_DT_COUNT || redop < 0 || redop >= PC_OP_COUNT) return 0;
    int k = dt_class[dtype];
    switch (redop) {
    case PC_OP_COPY: return 1;
    case PC_OP_SUM: case PC_OP_PROD: return k != 0;          /* MPI: no arithmetic on C_BOOL */
    case PC_OP_MIN: case PC_OP_MAX: return k == 1 || k == 2;
    case PC_OP_LAND: case PC_OP_LOR: case PC_OP_LXOR: return k <= 1;
    default: return k == 1;                                  /* BAND BOR BXOR: integers */
    }
}

#define LOOP(T, EXPR) do { const T *x = (const T *)a, *y = (const T *)b; T *z = (T *)out; \
        for (int64_t i = 0; i < n; i++) { T u = x[i], v = y[i]; z[i] = (T)(EXPR); } } while (0)

#define ARITH(T) switch (redop) { \
    case PC_OP_SUM: LOOP(T, u + v); return PC_OK; \
    case PC_OP_PROD: LOOP(T, u * v); return PC_OK; \
    case PC_OP_MIN: LOOP(T, v < u ? v : u); return PC_OK; \
    case PC_OP_MAX: LOOP(T, v > u ? v : u); return PC_OK; \
    case PC_OP_LAND: LOOP(T, (u != 0) && (v != 0)); return PC_OK; \
    case PC_OP_LOR: LOOP(T, (u != 0) || (v != 0)); return PC_OK; \
    case PC_OP_LXOR: LOOP(T, (u != 0) != (v != 0)); return PC_OK; }

#define BITS(T) switch (redop) { \
    case PC_OP_BAND: LOOP(T, u & v); return PC_OK; \
    case PC_OP_BOR: LOOP(T, u | v); return PC_OK; \
    case PC_OP_BXOR: LOOP(T, u ^ v); return PC_OK; }

#define COMPLEX(T) switch (redop) { \
    case PC_OP_SUM: { const T *x = a, *y = b; T *z = out; for (int64_t i = 0; i < n; i++) { \
        T r = {x[i].re + y[i].re, x[i].im + y[i].im}; z[i] = r; } return PC_OK; } \
    case PC_OP_PROD: { const T *x = a, *y = b; T *z = out; for (int64_t i = 0; i < n; i++) { \
        T r = {x[i].re * y[i].re - x[i].im * y[i].im, x[i].re * y[i].im + x[i].im * y[i].re}; \
        z[i] = r; } return PC_OK; } }

/* out = a (op) b, elementwise; out may alias a or b. */
static int pc_reduce_local(int redop, int dtype, const void *a, const void *b, void *out, int64_t n)
{
    if (!pc_op_valid(redop, dtype))
        return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", redop, dtype);
    if (n <= 0) return PC_OK;
    if (redop == PC_OP_COPY) {
        if (out != a) memmove(out, a, (size_t)n * dt_size[dtype]);
        return PC_OK;
    }
    switch (dtype) {
    case PC_DT_BOOL: { const uint8_t *x = a, *y = b; uint8_t *z = out;
        for (int64_t i = 0; i < n; i++) {
            int u = x[i] != 0, v = y[i] != 0;
            z[i] = (uint8_t)(redop == PC_OP_LAND ? (u && v) : redop == PC_OP_LOR ? (u || v) : (u != v));
        }
        return PC_OK; }
    case PC_DT_INT8: ARITH(int8_t) BITS(int8_t) break;
    case PC_DT_INT16: ARITH(int16_t) BITS(int16_t) break;
    case PC_DT_INT32: ARITH(int32_t) BITS(int32_t) break;
    case PC_DT_INT64: ARITH(int64_t) BITS(int64_t) break;
    case PC_DT_UINT8: ARITH(uint8_t) BITS(uint8_t) break;
    case PC_DT_UINT16: ARITH(uint16_t) BITS(uint16_t) break;
    case PC_DT_UINT32: ARITH(uint32_t) BITS(uint32_t) break;
    case PC_DT_UINT64: ARITH(uint64_t) BITS(uint64_t) break;
    case PC_DT_FLOAT32: ARITH(float) break;
    case PC_DT_FLOAT64: ARITH(double) break;
    case PC_DT_COMPLEX64: COMPLEX(c64) break;
    case PC_DT_COMPLEX128: COMPLEX(c128) break;
    }
    return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", redop, dtype);
}

/* ------------------------------------------------------------------ candidates */
static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* q distinct ranks out of [0, size) for (seed, round): a partial Fisher-Yates shuffle
 * driven by a counter-based hash, so every rank computes the same set without messages. */
int pc_candidates(uint64_t seed, int64_t round, int size, int q, int *out)
{
    if (size <= 0 || q <= 0 || q > size) return fail(PC_ERR_ARG, "candidates: need 0 < q <= size");
    int *perm = malloc(sizeof(int) * (size_t)size);
    if (!perm) return fail(PC_ERR_NOMEM, "candidates: out of memory");
    for (int i = 0; i < size; i++) perm[i] = i;
    uint64_t key = splitmix64(seed ^ splitmix64((uint64_t)round));
    for (int i = 0; i < q; i++) {
        int j = i + (int)(splitmix64(key + (uint64_t)i) % (uint64_t)(size - i));
        int t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        out[i] = perm[i];
    }
    free(perm);
    return PC_OK;
}

/* ------------------------------------------------------------------ structures */
enum { ST_IDLE = 0, ST_FIRED = 1, ST_DONE = 2 };

typedef struct pc_op {
    int kind, peer, dtype, redop, need, tag_seq;
    int64_t count, nbytes;
    void **base[3];          /* address = *base[i] + off[i] */
    int64_t off[3];
    void *own[3];            /* storage for plain buffers */
    int nsucc, *succ;        /* ops that depend on this one */
    int got, state;          /* per execution */
} pc_op;

struct pc_sched {
    MPI_Comm comm;
    int rank, size, seqbits, vbits;
    int nops, nrequired;     /* nrequired: ops that must complete (all but TRIGGERs) */
    pc_op *ops;
    int *succ_store, *stack;
    int trigger_op;          /* index of the TRIGGER op, or -1 */
    /* in-flight MPI requests, compact */
    int nreq;
    MPI_Request *reqs;
    int *req_op, *done_idx, *finished;  /* finished: ops whose messages completed in a pass */
    MPI_Status *statuses;
    int64_t inflight_big;    /* messages >= policy.busy_bytes in flight */
    /* execution state */
    int running, remaining, err;
    int64_t version, executions;
    char errmsg[384];
    pc_coll *coll;
    pc_sched *next, *prev;   /* running list */
};

struct pc_coll {
    pc_collspec spec;
    int rank, size;
    size_t nbytes, itemsize;
    void *buf[3];            /* the three internal buffers */
    void *acc, *work, *result;
    void *work_slot;         /* what WORK ops address: work, or a user's out buffer */
    void *result_ext;        /* result delivered straight into a user's buffer */
    void *mask_slot;         /* 2*W words: active bits, closing bits */
    uint64_t *res_mask;      /* active bits, then closing bits, of the last delivered round */
    int acc_full, work_filled, closing, closing_taken, finished, triggered, taken, fold;
    int64_t posts, armed_round, completed, pending, res_round;
    int64_t close_seen;      /* first round whose mask showed a closing rank, or -1 */
    pc_sched *sched[2];      /* [0]: the mode's activation, [1]: full rounds */
    pc_sched *armed;
    int err;
    char errmsg[384];
};

/* ------------------------------------------------------------------ engine */
/* Locks: E.lock guards every schedule and collective. The progress thread holds it
 * only during a progress pass. Sleeping uses two small mutexes of their own, so that
 * a sleeper never competes with the poller for E.lock:
 *   wmtx + work: the progress thread (or an inline waiter) sleeps; kick() wakes it
 *   dmtx + done: application threads wait for completions; notify_done() wakes them
 * Lock order: E.lock before wmtx or dmtx. */
static struct {
    pthread_mutex_t lock, wmtx, dmtx;
    pthread_cond_t work;
    pthread_cond_t done;
    pthread_t thread;
    int started, threaded, stop, kicked;
    int want;                /* application threads waiting for the lock (atomic) */
    int app_polling;         /* application threads progressing in wait() (atomic) */
    int conds_ready;
    pc_idle_policy policy;
    pc_sched *running;
} E = {.lock = PTHREAD_MUTEX_INITIALIZER, .wmtx = PTHREAD_MUTEX_INITIALIZER, .dmtx = PTHREAD_MUTEX_INITIALIZER,
       .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void abs_deadline(struct timespec *ts, double us)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)(us * 1e3);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

static void kick(void)
{
    pthread_mutex_lock(&E.wmtx);
    E.kicked = 1;
    pthread_cond_signal(&E.work);
    pthread_mutex_unlock(&E.wmtx);
}

static int take_kick(void)
{
    pthread_mutex_lock(&E.wmtx);
    int k = E.kicked;
    E.kicked = 0;
    pthread_mutex_unlock(&E.wmtx);
    return k;
}

/* Sleep until kicked or for us microseconds (us < 0: until kicked). No E.lock held. */
static void sleep_for_kick(double us)
{
    pthread_mutex_lock(&E.wmtx);
    if (!E.kicked && !E.stop) {
        if (us < 0) {
            pthread_cond_wait(&E.work, &E.wmtx);
        } else {
            struct timespec ts;
            abs_deadline(&ts, us);
            pthread_cond_timedwait(&E.work, &E.wmtx, &ts);
        }
    }
    E.kicked = 0;            /* a kick ends one sleep */
    pthread_mutex_unlock(&E.wmtx);
}

static void notify_done(void)
{
    pthread_mutex_lock(&E.dmtx);
    pthread_cond_broadcast(&E.done);
    pthread_mutex_unlock(&E.dmtx);
}

/* Application threads take the lock through app_lock(): the progress thread sees
 * E.want > 0 and steps aside, so a post never waits behind a polling loop. */
static void app_lock(void)
{
    __atomic_add_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&E.lock);
    __atomic_sub_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
}

static void app_unlock(void) { pthread_mutex_unlock(&E.lock); }

static void *op_addr(const pc_op *op, int i) { return (char *)*op->base[i] + op->off[i]; }

static void running_add(pc_sched *s)
{
    s->prev = NULL;
    s->next = E.running;
    if (E.running) E.running->prev = s;
    E.running = s;
}

static void running_remove(pc_sched *s)
{
    if (s->prev) s->prev->next = s->next; else if (E.running == s) E.running = s->next;
    if (s->next) s->next->prev = s->prev;
    s->next = s->prev = NULL;
}

static void coll_round_done(pc_coll *c);
static int coll_take(pc_coll *c);
static int coll_deliver(pc_coll *c);

static void sched_fail(pc_sched *s, int op, int code, const char *what)
{
    if (s->err) return;
    s->err = code;
    snprintf(s->errmsg, sizeof s->errmsg, "schedule op %d (%s) failed at rank %d, execution %lld: %s",
             op, op >= 0 ? (const char *[]){"send", "recv", "compute", "nop", "trigger", "take",
                                             "deliver"}[s->ops[op].kind] : "-",
             s->rank, (long long)s->version, what);
    if (s->coll && !s->coll->err) {
        s->coll->err = code;
        memcpy(s->coll->errmsg, s->errmsg, sizeof s->errmsg);
    }
    if (s->running) { s->running = 0; running_remove(s); }
    notify_done();
}

/* ------------------------------------------------------------------ MPI */
static int mpi_tag(const pc_sched *s, const pc_op *op)
{
    int64_t v = s->version & ((1LL << s->vbits) - 1);
    return (int)((v << s->seqbits) | op->tag_seq);
}

static int mpi_post(pc_sched *s, int i)
{
    pc_op *op = &s->ops[i];
    MPI_Request *r = &s->reqs[s->nreq];
    int rc = op->kind == PC_SEND
        ? MPI_Isend(op_addr(op, 0), (int)op->nbytes, MPI_BYTE, op->peer, mpi_tag(s, op), s->comm, r)
        : MPI_Irecv(op_addr(op, 0), (int)op->nbytes, MPI_BYTE, op->peer, mpi_tag(s, op), s->comm, r);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING]; int len = 0;
        MPI_Error_string(rc, msg, &len);
        sched_fail(s, i, PC_ERR_MPI, msg);
        return PC_ERR_MPI;
    }
    s->req_op[s->nreq++] = i;
    if (op->nbytes >= E.policy.busy_bytes) s->inflight_big++;
    return PC_OK;
}

/* Test the schedule's requests; complete the ops whose messages are done. */
static int mpi_test(pc_sched *s, int *ndone)
{
    int outcount = 0;
    *ndone = 0;
    if (s->nreq == 0) return PC_OK;
    int rc = MPI_Testsome(s->nreq, s->reqs, &outcount, s->done_idx, s->statuses);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING]; int len = 0;
        MPI_Error_string(rc, msg, &len);
        sched_fail(s, s->req_op[0], PC_ERR_MPI, msg);
        return PC_ERR_MPI;
    }
    if (outcount == MPI_UNDEFINED || outcount == 0) return PC_OK;
    for (int k = 0; k < outcount; k++) {
        int op = s->req_op[s->done_idx[k]];
        if (s->ops[op].kind == PC_RECV) {
            int got = 0;
            MPI_Get_count(&s->statuses[k], MPI_BYTE, &got);
            if (got != s->ops[op].nbytes) {
                char msg[160];
                snprintf(msg, sizeof msg, "expected %lld bytes from rank %d, received %d",
                         (long long)s->ops[op].nbytes, s->ops[op].peer, got);
                sched_fail(s, op, PC_ERR_TRUNCATE, msg);
                return PC_ERR_TRUNCATE;
            }
        }
        if (s->ops[op].nbytes >= E.policy.busy_bytes) s->inflight_big--;
        s->done_idx[k] = op;   /* reuse as the list of completed ops */
    }
    /* compact: drop the completed (now MPI_REQUEST_NULL) requests */
    int w = 0;
    for (int r = 0; r < s->nreq; r++) {
        if (s->reqs[r] != MPI_REQUEST_NULL) { s->reqs[w] = s->reqs[r]; s->req_op[w] = s->req_op[r]; w++; }
    }
    s->nreq = w;
    *ndone = outcount;
    return PC_OK;
}

static void mpi_cancel_all(pc_sched *s)
{
    for (int r = 0; r < s->nreq; r++) {
        MPI_Cancel(&s->reqs[r]);
        MPI_Request_free(&s->reqs[r]);
    }
    s->nreq = 0;
}

static int pc_tag_bits(void *comm_handle, int *seqbits, int *vbits)
{
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    int *ub = NULL, flag = 0;
    MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &flag);
    long long tag_ub = flag && ub ? *ub : 32767;
    int bits = 0;
    while (bits < 31 && (1LL << (bits + 1)) - 1 <= tag_ub) bits++;
    *seqbits = bits >= 24 ? 16 : bits - 4;   /* at least 4 bits of version */
    *vbits = bits - *seqbits;
    return PC_OK;
}

/* ------------------------------------------------------------------ execution */
static int op_fire(pc_sched *s, int i);

/* Mark op i complete and fire every successor whose need is met (iteratively). */
static int op_complete(pc_sched *s, int first)
{
    int top = 0;
    s->stack[top++] = first;
    while (top > 0) {
        int i = s->stack[--top];
        pc_op *op = &s->ops[i];
        op->state = ST_DONE;
        if (op->kind != PC_TRIGGER) s->remaining--;
        for (int k = 0; k < op->nsucc; k++) {
            pc_op *n = &s->ops[op->succ[k]];
            if (++n->got == n->need && n->state == ST_IDLE) {
                int rc = op_fire(s, op->succ[k]);
                if (rc > 0) return rc;
                if (rc == -1) s->stack[top++] = op->succ[k];  /* completed at once */
            }
        }
    }
    return PC_OK;
}

/* Start op i. Returns -1 if it completed at once (local ops), 0 if in flight, >0 on error. */
static int op_fire(pc_sched *s, int i)
{
    pc_op *op = &s->ops[i];
    int rc;
    op->state = ST_FIRED;
    switch (op->kind) {
    case PC_SEND: case PC_RECV:
        return mpi_post(s, i);
    case PC_COMPUTE:
        rc = pc_reduce_local(op->redop, op->dtype, op_addr(op, 0), op_addr(op, 1), op_addr(op, 2), op->count);
        if (rc) { sched_fail(s, i, rc, last_error); return rc; }
        return -1;
    case PC_TAKE:
        rc = coll_take(s->coll);
        if (rc) { sched_fail(s, i, rc, last_error); return rc; }
        return -1;
    case PC_DELIVER:
        rc = coll_deliver(s->coll);
        if (rc) { sched_fail(s, i, rc, last_error); return rc; }
        return -1;
    case PC_TRIGGER:
        op->state = ST_IDLE;   /* only pc_coll fires triggers */
        return 0;
    default:
        return -1;             /* NOP */
    }
}

static void sched_check_done(pc_sched *s)
{
    if (!s->running || s->err || s->remaining > 0) return;
    s->running = 0;
    running_remove(s);
    s->executions++;
    if (s->coll) coll_round_done(s->coll);
    notify_done();
}

/* Begin one execution with the given version: reset the ops, fire those without deps. */
static int sched_begin(pc_sched *s, int64_t version)
{
    if (s->running) return fail(PC_ERR_STATE, "schedule is already running");
    s->version = version;
    s->remaining = s->nrequired;
    s->err = 0;
    s->nreq = 0;
    s->inflight_big = 0;
    for (int i = 0; i < s->nops; i++) { s->ops[i].got = 0; s->ops[i].state = ST_IDLE; }
    s->running = 1;
    running_add(s);
    for (int i = 0; i < s->nops && !s->err; i++) {
        pc_op *op = &s->ops[i];
        if (op->need == 0 && op->state == ST_IDLE && op->kind != PC_TRIGGER) {
            int rc = op_fire(s, i);
            if (rc == -1) rc = op_complete(s, i);
            if (rc > 0) return rc;
        }
    }
    sched_check_done(s);
    kick();
    return s->err ? fail(s->err, "%s", s->errmsg) : PC_OK;
}

/* [progress] one pass over every running schedule. */
static int engine_progress_locked(void)
{
    int progressed = 0;
    pc_sched *s = E.running;
    while (s) {
        pc_sched *next = s->next;   /* s may leave the list (and a new one join at the head) */
        int ndone = 0;
        if (mpi_test(s, &ndone) == PC_OK && ndone > 0) {
            progressed = 1;
            /* copy first: completing ops may post (and test) new requests */
            memcpy(s->finished, s->done_idx, sizeof(int) * (size_t)ndone);
            for (int k = 0; k < ndone && !s->err; k++) op_complete(s, s->finished[k]);
            sched_check_done(s);
        }
        s = next;
    }
    return progressed;
}

static int engine_busy(void)
{
    for (pc_sched *s = E.running; s; s = s->next)
        if (s->inflight_big > 0) return 1;
    return 0;
}

/* The adaptive idle policy, shared by the progress thread and inline waits:
 * spin, then yield, then sleep with a doubling, capped backoff (never while a large
 * message is in flight: its transfer needs polling). A kick (a local post) ends a
 * sleep at once. Called without E.lock. */
typedef struct { double idle_since, sleep_us; unsigned spins; } idle_state;

static void idle_reset(idle_state *st)
{
    st->idle_since = now_us();
    st->sleep_us = E.policy.sleep_min_us;
    st->spins = 0;
}

static void idle_step(idle_state *st, int busy)
{
    /* read the clock on every 16th spin only: one read per spin was a fifth of a busy loop */
    if ((++st->spins & 15) != 0 && st->sleep_us == E.policy.sleep_min_us) return;
    double idle = now_us() - st->idle_since;
    if (idle < E.policy.spin_us) return;
    if (idle < E.policy.spin_us + E.policy.yield_us || busy) {
        sched_yield();
        return;
    }
    sleep_for_kick(st->sleep_us);
    double cap = idle > E.policy.deep_after_us ? E.policy.deep_sleep_us : E.policy.sleep_max_us;
    st->sleep_us *= 2;
    if (st->sleep_us > cap) st->sleep_us = cap;
}

/* Take E.lock from the progress thread, after any application thread that wants it. */
static void progress_lock(void)
{
    while (__atomic_load_n(&E.want, __ATOMIC_SEQ_CST) > 0) sched_yield();
    pthread_mutex_lock(&E.lock);
}

static void *progress_main(void *arg)
{
    (void)arg;
    idle_state st;
    idle_reset(&st);
    for (;;) {
        progress_lock();
        if (E.stop) break;
        if (__atomic_load_n(&E.app_polling, __ATOMIC_SEQ_CST) > 0) {
            /* an application thread is polling in wait(): stay off its core */
            pthread_mutex_unlock(&E.lock);
            sleep_for_kick(E.policy.sleep_max_us);
            idle_reset(&st);
            continue;
        }
        int any = E.running != NULL;
        int progressed = any && engine_progress_locked();
        int busy = any && engine_busy();
        pthread_mutex_unlock(&E.lock);
        if (!any) {                           /* nothing to do: sleep until a post */
            sleep_for_kick(-1);
            idle_reset(&st);
        } else if (progressed || take_kick()) {
            idle_reset(&st);
        } else {
            idle_step(&st, busy);
        }
    }
    pthread_mutex_unlock(&E.lock);
    return NULL;
}

int pc_engine_start(int use_thread, const pc_idle_policy *policy)
{
    int provided = 0, rc = PC_OK;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
        return fail(PC_ERR_THREAD, "partialcoll needs MPI_THREAD_MULTIPLE, but MPI provides level %d "
                    "(initialize MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE); mpi4py does so by default)",
                    provided);
    app_lock();
    if (E.started) { app_unlock(); return fail(PC_ERR_STATE, "engine already started"); }
    if (!E.conds_ready) {             /* deadlines are CLOCK_MONOTONIC (abs_deadline) */
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&E.work, &attr);
        pthread_cond_init(&E.done, &attr);
        pthread_condattr_destroy(&attr);
        E.conds_ready = 1;
    }
    E.policy = *policy;
    E.stop = 0;
    E.threaded = use_thread;
    if (use_thread && pthread_create(&E.thread, NULL, progress_main, NULL) != 0)
        rc = fail(PC_ERR_THREAD, "cannot start the progress thread: %s", strerror(errno));
    E.started = rc == PC_OK;
    app_unlock();
    return rc;
}

int pc_engine_stop(void)
{
    app_lock();
    if (!E.started) { app_unlock(); return PC_OK; }
    E.stop = 1;
    app_unlock();
    kick();
    if (E.threaded) pthread_join(E.thread, NULL);
    app_lock();
    while (E.running) {                   /* abandon what is still in flight */
        pc_sched *s = E.running;
        mpi_cancel_all(s);
        sched_fail(s, -1, PC_ERR_STATE, "engine stopped (partialcoll.finalize) while running");
    }
    E.started = 0;
    notify_done();
    app_unlock();
    return PC_OK;
}

int pc_engine_threaded(void) { return E.started && E.threaded; }

/* Wait (E.lock held on entry and exit) until pred(arg) or the timeout.
 * Thread mode: poll pred briefly, then sleep on the done signal without E.lock.
 * Inline mode: this thread drives progress, under the adaptive idle policy. */
static int wait_until(int (*pred)(void *), void *arg, double timeout_s)
{
    double deadline = timeout_s >= 0 ? now_us() + timeout_s * 1e6 : -1;
    idle_state st;
    idle_reset(&st);
    int polling = 0, rc = PC_OK;
    while (!pred(arg)) {
        if (!E.started) { rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)"); break; }
        double now = now_us();
        if (deadline >= 0 && now >= deadline) { rc = PC_ERR_TIMEOUT; break; }
        if (E.threaded && now - st.idle_since < E.policy.spin_us) {
            /* spin phase: progress here, sparing the hand-off to the progress thread */
            if (!polling) { polling = 1; __atomic_add_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); }
            if (engine_progress_locked()) idle_reset(&st);
        } else if (E.threaded) {
            if (polling) { polling = 0; __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); kick(); }
            pthread_mutex_unlock(&E.lock);
            {
                double slice = deadline >= 0 && deadline - now < 10000.0 ? deadline - now : 10000.0;
                struct timespec ts;
                abs_deadline(&ts, slice);
                pthread_mutex_lock(&E.dmtx);
                if (!pred(arg)) pthread_cond_timedwait(&E.done, &E.dmtx, &ts);
                pthread_mutex_unlock(&E.dmtx);
            }
            app_lock();
        } else if (engine_progress_locked()) {
            idle_reset(&st);
        } else {
            int busy = engine_busy();
            pthread_mutex_unlock(&E.lock);
            idle_step(&st, busy);
            app_lock();
        }
    }
    if (polling) { __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); kick(); }
    return rc;
}

/* ------------------------------------------------------------------ schedules */
int pc_sched_create(void *comm_handle, int nops, const pc_opspec *spec, int nedges, const int *edges,
                    pc_coll *coll, pc_sched **out)
{
    if (nops < 0 || nedges < 0) return fail(PC_ERR_ARG, "negative op or edge count");
    pc_sched *s = calloc(1, sizeof *s);
    if (!s) return fail(PC_ERR_NOMEM, "out of memory");
    s->comm = *(MPI_Comm *)comm_handle;
    MPI_Comm_rank(s->comm, &s->rank);
    MPI_Comm_size(s->comm, &s->size);
    pc_tag_bits(comm_handle, &s->seqbits, &s->vbits);
    s->nops = nops;
    s->coll = coll;
    s->trigger_op = -1;
    s->ops = calloc((size_t)nops + 1, sizeof(pc_op));
    s->succ_store = calloc((size_t)nedges + 1, sizeof(int));
    s->stack = calloc((size_t)nops + 1, sizeof(int));
    s->reqs = calloc((size_t)nops + 1, sizeof(MPI_Request));
    s->req_op = calloc((size_t)nops + 1, sizeof(int));
    s->done_idx = calloc((size_t)nops + 1, sizeof(int));
    s->finished = calloc((size_t)nops + 1, sizeof(int));
    s->statuses = calloc((size_t)nops + 1, sizeof(MPI_Status));
    int *sendseq = calloc((size_t)s->size, sizeof(int)), *recvseq = calloc((size_t)s->size, sizeof(int));
    int rc = PC_OK;
    if (!s->ops || !s->succ_store || !s->stack || !s->reqs || !s->req_op || !s->done_idx || !s->finished
        || !s->statuses
        || !sendseq || !recvseq) {
        rc = fail(PC_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < nops && rc == PC_OK; i++) {
        const pc_opspec *p = &spec[i];
        pc_op *op = &s->ops[i];
        op->kind = p->kind; op->peer = p->peer; op->dtype = p->dtype; op->redop = p->redop;
        op->need = p->need; op->count = p->count; op->nbytes = p->nbytes;
        for (int b = 0; b < 3; b++) {
            op->own[b] = p->ptr[b];
            op->off[b] = p->off[b];
            op->base[b] = &op->own[b];
            if (p->slot[b] != PC_SLOT_NONE) {
                if (!coll) { rc = fail(PC_ERR_ARG, "op %d uses a collective's buffer slot without a collective", i); break; }
                op->base[b] = p->slot[b] == PC_SLOT_WORK ? &coll->work_slot : &coll->mask_slot;
            }
        }
        if (p->kind < PC_SEND || p->kind > PC_DELIVER)
            rc = fail(PC_ERR_ARG, "op %d: unknown kind %d", i, p->kind);
        else if ((p->kind == PC_SEND || p->kind == PC_RECV) && (p->peer < 0 || p->peer >= s->size))
            rc = fail(PC_ERR_ARG, "op %d: peer %d out of range for a communicator of size %d (this is rank %d)",
                      i, p->peer, s->size, s->rank);
        else if ((p->kind == PC_SEND || p->kind == PC_RECV) && (p->nbytes < 0 || p->nbytes > INT_MAX))
            rc = fail(PC_ERR_ARG, "op %d: message of %lld bytes (at most %d)", i, (long long)p->nbytes, INT_MAX);
        else if (p->kind == PC_COMPUTE && !pc_op_valid(p->redop, p->dtype))
            rc = fail(PC_ERR_DTYPE_OP, "op %d: reduction op %d is not defined for dtype %d", i, p->redop, p->dtype);
        else if ((p->kind == PC_TRIGGER || p->kind == PC_TAKE || p->kind == PC_DELIVER) && !coll)
            rc = fail(PC_ERR_ARG, "op %d: trigger/take/deliver ops need a partial collective", i);
        else if (p->kind == PC_TRIGGER && s->trigger_op >= 0)
            rc = fail(PC_ERR_ARG, "op %d: a schedule has at most one trigger", i);
        if (p->kind == PC_TRIGGER) s->trigger_op = i;
        else s->nrequired++;
        if (p->kind == PC_SEND) op->tag_seq = sendseq[p->peer]++;
        if (p->kind == PC_RECV) op->tag_seq = recvseq[p->peer]++;
        if ((p->kind == PC_SEND || p->kind == PC_RECV) && op->tag_seq >= (1 << s->seqbits))
            rc = fail(PC_ERR_ARG, "more than %d messages between one pair of ranks", 1 << s->seqbits);
    }
    if (rc) goto out;
    /* successor lists (CSR) from the edges (pred -> succ) */
    int *cnt = s->stack;
    memset(cnt, 0, sizeof(int) * (size_t)(nops + 1));
    for (int e = 0; e < nedges; e++) {
        int a = edges[2 * e], b = edges[2 * e + 1];
        if (a < 0 || a >= nops || b < 0 || b >= nops || a == b) { rc = fail(PC_ERR_ARG, "bad edge %d -> %d", a, b); goto out; }
        cnt[a]++;
    }
    int acc = 0;
    for (int i = 0; i < nops; i++) { s->ops[i].succ = s->succ_store + acc; acc += cnt[i]; s->ops[i].nsucc = 0; }
    for (int e = 0; e < nedges; e++) {
        pc_op *a = &s->ops[edges[2 * e]];
        a->succ[a->nsucc++] = edges[2 * e + 1];
    }
    memset(cnt, 0, sizeof(int) * (size_t)(nops + 1));
    for (int e = 0; e < nedges; e++) cnt[edges[2 * e + 1]]++;
    for (int i = 0; i < nops; i++) {
        int npred = cnt[i];
        pc_op *op = &s->ops[i];
        if (op->kind == PC_TRIGGER) { op->need = INT_MAX; continue; }
        if (op->need < 0 || op->need > npred || (npred > 0 && op->need == 0)) {
            rc = fail(PC_ERR_ARG, "op %d: need %d of %d dependencies", i, op->need, npred);
            goto out;
        }
    }
out:
    free(sendseq); free(recvseq);
    if (rc) { pc_sched_free(s); return rc; }
    *out = s;
    return PC_OK;
}

int pc_sched_start(pc_sched *s)
{
    app_lock();
    int rc;
    if (!E.started) rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)");
    else if (s->coll) rc = fail(PC_ERR_STATE, "this schedule belongs to a partial collective");
    else rc = sched_begin(s, s->executions);
    app_unlock();
    return rc;
}

typedef struct { pc_sched *s; int64_t execution; } sched_wait_arg;

static int sched_reached(void *p)
{
    sched_wait_arg *a = p;
    return a->s->err || a->s->executions > a->execution;
}

int pc_sched_test(pc_sched *s, int64_t execution, int *done)
{
    app_lock();
    if (!E.threaded) engine_progress_locked();
    sched_wait_arg a = {s, execution};
    *done = sched_reached(&a);
    int rc = s->err ? fail(s->err, "%s", s->errmsg) : PC_OK;
    app_unlock();
    return rc;
}

int pc_sched_wait(pc_sched *s, int64_t execution, double timeout_s)
{
    app_lock();
    sched_wait_arg a = {s, execution};
    int rc = wait_until(sched_reached, &a, timeout_s);
    if (rc == PC_OK && s->err) rc = fail(s->err, "%s", s->errmsg);
    else if (rc == PC_ERR_TIMEOUT)
        rc = fail(PC_ERR_TIMEOUT, "schedule execution %lld did not complete (rank %d; %d messages in flight)",
                  (long long)execution, s->rank, s->nreq);
    app_unlock();
    return rc;
}

int64_t pc_sched_executions(pc_sched *s) { return s->executions; }

int pc_sched_free(pc_sched *s)
{
    if (!s) return PC_OK;
    app_lock();
    if (s->running) { app_unlock(); return fail(PC_ERR_STATE, "cannot free a running schedule"); }
    app_unlock();
    free(s->ops); free(s->succ_store); free(s->stack); free(s->reqs); free(s->req_op);
    free(s->done_idx); free(s->finished); free(s->statuses); free(s);
    return PC_OK;
}

/* ------------------------------------------------------------------ partial collectives
 *
 * Round n runs on sched[kind(n)] with version n. Buffers: acc (what post folds into),
 * work (what the round's allreduce reduces), result (what wait returns); moving data
 * between them is a pointer swap wherever possible, so a post costs one pass over x.
 *
 *   post(x):   acc = acc (op) x; posts++; maybe trigger the armed round
 *   TAKE:      work = acc; acc = empty; set my active bit if posts > n, closing bit if closing
 *   DELIVER:   result = work (latest) or result = result (op) work (fold); completed = n + 1
 *   done:      arm round n + 1, unless every rank was closing in round n
 */
static void fill_identity(pc_coll *c, void *dst)
{
    const unsigned char *id = c->spec.identity;
    size_t k, z = 1;
    for (k = 0; k < c->itemsize; k++) z &= id[k] == 0;
    if (z) { memset(dst, 0, c->nbytes); return; }
    for (int64_t i = 0; i < c->spec.count; i++) memcpy((char *)dst + i * c->itemsize, id, c->itemsize);
}

static void swap_ptr(void **a, void **b) { void *t = *a; *a = *b; *b = t; }

static int pc_coll_round_kind(pc_coll *c, int64_t n)
{
    if (c->spec.mode == PC_MODE_FULL) return 1;
    if (c->spec.max_staleness > 0 && (n + 1) % c->spec.max_staleness == 0) return 1;
    if (c->close_seen >= 0 && n > c->close_seen) return 1;   /* someone is closing: full rounds */
    return 0;
}

static int pc_coll_eligible(pc_coll *c, int64_t n, int rank)
{
    if (pc_coll_round_kind(c, n) == 1) return 1;
    int q;
    switch (c->spec.mode) {
    case PC_MODE_MAJORITY: q = 1; break;
    case PC_MODE_PROBE: q = c->spec.candidates; break;
    default: return 1;   /* solo: everyone; quorum: everyone notifies the leader */
    }
    int cand[q > 0 ? q : 1], hit = 0;
    if (pc_candidates(c->spec.seed, n, c->size, q, cand)) return 0;
    for (int i = 0; i < q; i++) hit |= cand[i] == rank;
    return hit;
}

/* Fire the armed round's trigger if this rank may start it now (lock held). */
static int coll_maybe_trigger(pc_coll *c)
{
    pc_sched *s = c->armed;
    if (!s || c->triggered || !s->running || s->trigger_op < 0) return PC_OK;
    int64_t n = c->armed_round;
    if (!(c->closing || (c->posts > n && pc_coll_eligible(c, n, c->rank)))) return PC_OK;
    c->triggered = 1;
    s->ops[s->trigger_op].state = ST_FIRED;
    int rc = op_complete(s, s->trigger_op);
    sched_check_done(s);
    kick();
    return rc;
}

static int coll_arm(pc_coll *c, int64_t n)
{
    pc_sched *s = c->sched[pc_coll_round_kind(c, n)];
    if (!s) return fail(PC_ERR_STATE, "no schedule for round %lld", (long long)n);
    c->armed_round = n;
    c->armed = s;
    c->triggered = 0;
    c->taken = 0;
    int rc = sched_begin(s, n);
    if (rc) return rc;
    return coll_maybe_trigger(c);
}

static int coll_take(pc_coll *c)
{
    int64_t n = c->armed_round;
    if (c->work_filled) {
        c->work_filled = 0;            /* a direct post already placed the data */
    } else if (c->acc_full) {
        swap_ptr(&c->acc, &c->work);
        c->work_slot = c->work;
    } else {
        fill_identity(c, c->work);
    }
    c->acc_full = 0;
    c->taken = 1;
    c->closing_taken = c->closing;
    if (c->spec.has_mask) {
        uint64_t *m = c->mask_slot;
        int W = c->spec.mask_words;
        memset(m, 0, sizeof(uint64_t) * 2 * (size_t)W);
        if (c->posts > n) m[c->rank / 64] |= 1ULL << (c->rank % 64);
        if (c->closing) m[W + c->rank / 64] |= 1ULL << (c->rank % 64);
    }
    return PC_OK;
}

static int coll_round_end(pc_coll *c, int64_t n, int all_closing)
{
    c->res_round = n;
    c->completed = n + 1;
    if (all_closing && c->closing) c->finished = 1;
    return PC_OK;
}

static int coll_deliver(pc_coll *c)
{
    int64_t n = c->armed_round;
    int W = c->spec.mask_words, all_closing = 1;
    uint64_t *m = c->mask_slot;
    if (c->spec.has_mask) {
        memcpy(c->res_mask, m, sizeof(uint64_t) * 2 * (size_t)W);
        for (int r = 0; r < c->size; r++) all_closing &= (int)((m[W + r / 64] >> (r % 64)) & 1);
    } else {
        all_closing = c->closing_taken;   /* full mode: close is one collective final round */
        memset(c->res_mask, 0, sizeof(uint64_t) * 2 * (size_t)W);
        for (int r = 0; r < c->size; r++) {
            c->res_mask[r / 64] |= 1ULL << (r % 64);
            if (all_closing) c->res_mask[W + r / 64] |= 1ULL << (r % 64);
        }
    }
    if (c->spec.has_mask && c->close_seen < 0)
        for (int w = 0; w < W; w++) if (m[W + w]) c->close_seen = n;
    void *src = c->work_slot;
    if ((c->fold || c->closing) && c->pending > 0) {
        void *dst = c->result_ext ? c->result_ext : c->result;
        int rc = pc_reduce_local(c->spec.redop, c->spec.dtype, dst, src, dst, c->spec.count);
        if (rc) return rc;
        if (src != c->work) c->work_slot = c->work;
        c->pending++;
        return coll_round_end(c, n, all_closing);
    }
    if (src != c->work) {         /* the round ran in the user's out buffer */
        c->result_ext = src;
        c->work_slot = c->work;
    } else {
        c->result_ext = NULL;
        swap_ptr(&c->work, &c->result);
        c->work_slot = c->work;
    }
    c->pending = 1;
    return coll_round_end(c, n, all_closing);
}

static void coll_round_done(pc_coll *c)
{
    c->armed = NULL;
    if (c->finished || c->err) return;
    int rc = coll_arm(c, c->completed);
    if (rc && !c->err) { c->err = rc; snprintf(c->errmsg, sizeof c->errmsg, "%s", last_error); }
}

int pc_coll_create(const pc_collspec *spec, void *comm_handle, pc_coll **out)
{
    if (!pc_op_valid(spec->redop, spec->dtype) || spec->redop == PC_OP_COPY)
        return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", spec->redop, spec->dtype);
    if (spec->count < 0) return fail(PC_ERR_ARG, "count must be >= 0");
    pc_coll *c = calloc(1, sizeof *c);
    if (!c) return fail(PC_ERR_NOMEM, "out of memory");
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    MPI_Comm_rank(comm, &c->rank);
    MPI_Comm_size(comm, &c->size);
    c->spec = *spec;
    c->itemsize = dt_size[spec->dtype];
    c->nbytes = (size_t)spec->count * c->itemsize;
    void *id = malloc(c->itemsize);
    int W = spec->mask_words > 0 ? spec->mask_words : 1;
    c->spec.mask_words = W;
    c->mask_slot = calloc(2 * (size_t)W, sizeof(uint64_t));
    c->res_mask = calloc(2 * (size_t)W, sizeof(uint64_t));
    for (int b = 0; b < 3; b++) c->buf[b] = malloc(c->nbytes ? c->nbytes : 1);
    if (!id || !c->mask_slot || !c->res_mask || !c->buf[0] || !c->buf[1] || !c->buf[2]) {
        free(id);
        pc_coll_free(c);
        return fail(PC_ERR_NOMEM, "out of memory for a partial allreduce of %zu bytes", c->nbytes);
    }
    memcpy(id, spec->identity, c->itemsize);
    c->spec.identity = id;
    c->acc = c->buf[0]; c->work = c->buf[1]; c->result = c->buf[2];
    c->work_slot = c->work;
    c->fold = spec->late == PC_LATE_FOLD;
    c->armed_round = -1;
    c->close_seen = -1;
    fill_identity(c, c->result);
    *out = c;
    return PC_OK;
}

int pc_coll_set_sched(pc_coll *c, int kind, pc_sched *s)
{
    if (kind < 0 || kind > 1 || s->coll != c) return fail(PC_ERR_ARG, "bad schedule for this collective");
    c->sched[kind] = s;
    return PC_OK;
}

int pc_coll_begin(pc_coll *c)
{
    app_lock();
    int rc = !E.started ? fail(PC_ERR_STATE, "the engine is not running") : coll_arm(c, 0);
    app_unlock();
    return rc;
}

static int coll_error(pc_coll *c) { return fail(c->err, "%s", c->errmsg); }

/* Every post begins here (lock held): refuse after an error or close, number the post. */
static int coll_post_begin(pc_coll *c, int64_t *index, int *late)
{
    if (c->err) return coll_error(c);
    if (c->closing) return fail(PC_ERR_STATE, "post after close");
    *index = c->posts;
    /* late: round #index has already read this rank's input (or completed) */
    *late = c->completed > c->posts || (c->armed_round == c->posts && c->taken);
    return PC_OK;
}

/* ... and ends here, once x is in place: count it, and start the round if eligible. */
static int coll_post_end(pc_coll *c)
{
    c->posts++;
    int rc = coll_maybe_trigger(c);
    return rc == PC_OK && c->err ? coll_error(c) : rc;
}

int pc_coll_post(pc_coll *c, const void *x, void *out, int64_t *index, int *late)
{
    app_lock();
    int rc = coll_post_begin(c, index, late);
    if (rc) goto out;
    int direct = c->spec.mode == PC_MODE_FULL && c->armed_round == c->posts && c->armed && !c->triggered
                 && !c->acc_full && !c->work_filled && !(c->fold && c->pending > 0);
    if (direct) {                        /* full mode: x goes straight into the round's buffer */
        void *dst = out ? out : c->work;
        if (dst != x) memcpy(dst, x, c->nbytes);
        c->work_slot = dst;
        c->work_filled = 1;
    } else if (c->acc_full) {
        rc = pc_reduce_local(c->spec.redop, c->spec.dtype, c->acc, x, c->acc, c->spec.count);
        if (rc) goto out;
    } else {
        memcpy(c->acc, x, c->nbytes);
        c->acc_full = 1;
    }
    rc = coll_post_end(c);
out:
    app_unlock();
    return rc;
}

/* Staged posts (device buffers, partialcoll/_device.py). The caller keeps a copy of
 * what its earlier posts put into acc and folds x into it where x lives (on the GPU),
 * so that a post costs one device-side op and one copy to the host:
 *   pc_coll_acc_full:     does acc hold posts that no round has taken yet?
 *   pc_coll_post_replace: if it still does, acc = x (x is acc (op) the new post) and
 *                         the post counts; if a TAKE emptied acc meanwhile, nothing
 *                         happens (*replaced = 0) and the caller posts the new data alone.
 * Only posts fill acc, and only TAKE empties it, so "still full" means "unchanged". */
int pc_coll_acc_full(pc_coll *c, int *full)
{
    app_lock();
    *full = c->acc_full;
    int rc = c->err ? coll_error(c) : PC_OK;
    app_unlock();
    return rc;
}

int pc_coll_post_replace(pc_coll *c, const void *x, int64_t *index, int *late, int *replaced)
{
    app_lock();
    int rc = coll_post_begin(c, index, late);
    *replaced = 0;
    if (rc == PC_OK && c->acc_full) {
        memcpy(c->acc, x, c->nbytes);
        *replaced = 1;
        rc = coll_post_end(c);
    }
    app_unlock();
    return rc;
}

typedef struct { pc_coll *c; int64_t index; } coll_wait_arg;

static int coll_reached(void *p)
{
    coll_wait_arg *a = p;
    return a->c->err || a->c->finished || a->c->completed > a->index;
}

int pc_coll_test(pc_coll *c, int64_t index, int *done)
{
    app_lock();
    if (!E.threaded) engine_progress_locked();
    coll_wait_arg a = {c, index};
    *done = coll_reached(&a);
    int rc = c->err ? coll_error(c) : PC_OK;
    app_unlock();
    return rc;
}

static int pc_coll_wait(pc_coll *c, int64_t index, double timeout_s)
{
    app_lock();
    coll_wait_arg a = {c, index};
    int rc = wait_until(coll_reached, &a, timeout_s);
    if (rc == PC_OK && c->err) rc = coll_error(c);
    else if (rc == PC_ERR_TIMEOUT)
        rc = fail(PC_ERR_TIMEOUT, "round %lld did not complete at rank %d "
                  "(%lld rounds completed here; the round waits for its initiator or for peers)",
                  (long long)(index >= (1LL << 61) ? c->completed : index), c->rank, (long long)c->completed);
    app_unlock();
    return rc;
}

/* Copy out the result: the latest round (latest), or the fold of the rounds not yet
 * taken (fold, and always after close). */
static int pc_coll_take_result(pc_coll *c, void *out, uint64_t *mask, pc_result *info)
{
    app_lock();
    void *src = c->result_ext ? c->result_ext : c->result;
    int folding = c->fold || c->closing;
    if (folding && c->pending == 0) fill_identity(c, out);
    else if (out != src) memcpy(out, src, c->nbytes);
    info->round = c->res_round;
    info->rounds = folding ? c->pending : (c->completed > 0);
    info->finished = c->finished;
    memcpy(mask, c->res_mask, sizeof(uint64_t) * 2 * (size_t)c->spec.mask_words);
    c->pending = 0;
    app_unlock();
    return PC_OK;
}

/* pc_coll_wait, then pc_coll_take_result: one call on the hot path. */
int pc_coll_wait_take(pc_coll *c, int64_t index, double timeout_s, void *out, uint64_t *mask, pc_result *info)
{
    int rc = pc_coll_wait(c, index, timeout_s);
    return rc ? rc : pc_coll_take_result(c, out, mask, info);
}

/* Start closing: from now on this rank triggers every round it is armed for, and a
 * round in which every rank is closing is the final one. */
int pc_coll_close(pc_coll *c)
{
    app_lock();
    int rc = PC_OK;
    if (!c->closing) {
        c->closing = 1;
        if (!c->fold && c->pending == 0) {   /* from now on fold: close never drops a round */
            c->result_ext = NULL;
            fill_identity(c, c->result);
        }
        rc = coll_maybe_trigger(c);
    }
    app_unlock();
    return rc;
}

int pc_coll_free(pc_coll *c)
{
    if (!c) return PC_OK;
    app_lock();
    int busy = (c->sched[0] && c->sched[0]->running) || (c->sched[1] && c->sched[1]->running);
    app_unlock();
    if (busy) return fail(PC_ERR_STATE, "cannot free a partial collective with a round in flight");
    for (int b = 0; b < 3; b++) free(c->buf[b]);
    free(c->mask_slot); free(c->res_mask); free((void *)c->spec.identity);
    free(c);
    return PC_OK;
}
