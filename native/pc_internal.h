/* pc_internal.h -- what the engine's units share: the structs behind the opaque
 * handles of pc_engine.h, the engine state E, and each unit's internal functions.
 *
 *   errors.c    fail(): record a message, return a code
 *   kernels.c   pc_reduce_local(): out = a (op) b for every dtype x op; pc_reduce_div()
 *   mpi.c       the one place that calls MPI (post/test/cancel messages, tag bits)
 *   progress.c  E, its lock, the progress thread, the idle policy, waits
 *   sched.c     schedules: op table, executions, firing and completing ops
 *   coll.c      partial collectives (rounds, accumulator, results, close), candidates
 *
 * Locking: every function below runs with E.lock held unless it says otherwise.
 */
#ifndef PC_INTERNAL_H
#define PC_INTERNAL_H
#include "pc_engine.h"
#include <mpi.h>
#include <pthread.h>
#include <time.h>

/* ------------------------------------------------------------------ structures */
enum { ST_IDLE = 0, ST_FIRED = 1, ST_DONE = 2 };

typedef struct pc_op {
    int kind, peer, dtype, redop, need, tag_seq;
    int64_t count, nbytes;
    double divisor;          /* COMPUTE: 0, or divide the result by it (pc_reduce_div) */
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
    void *scratch;           /* PC_SLOT_SCRATCH buffers (the engine's, freed with the schedule) */
    /* in-flight MPI requests, compact */
    int nreq;
    MPI_Request *reqs;
    int *req_op, *done_idx, *finished;  /* finished: ops whose messages completed in a pass */
    MPI_Status *statuses;
    int64_t inflight_big;    /* messages >= policy.busy_bytes in flight */
    int live;                /* this execution's data is moving: a plain schedule from its start,
                              * a round of a partial collective from its TAKE (before that only
                              * pre-posted receives wait, and they need no polling) */
    int needs_trigger;       /* nothing but pre-posted receives can happen before the TRIGGER
                              * (full rounds: TAKE follows the trigger alone) */
    /* execution state */
    int running, remaining, err;
    int draining;            /* withdrawn (failed, abandoned, engine stopped): receives cancelled,
                              * sends completing, no op fires; off the running list once drained */
    int doomed;              /* free the schedule once it stops running (pc_sched_abandon) */
    int64_t version, executions;
    char errmsg[384];
    int errpeer;             /* with err: the peer of the failed send/receive, or -1 */
    pc_coll *coll;
    pc_sched *next, *prev;   /* running list */
    int64_t *sent;           /* bytes of the sends posted to each peer since creation
                              * (size entries, allocated by the first send; mpi.c) */
};

struct pc_coll {
    pc_collspec spec;
    int rank, size;
    size_t nbytes, itemsize;
    void *buf[3];            /* the three internal buffers */
    void *acc, *work, *result;
    void *work_slot;         /* what WORK ops address: work, or a user's out buffer */
    void *result_ext;        /* result delivered straight into a user's buffer */
    void *acc_ext;           /* acc lent by an in-place post: the user's x == out (or NULL) */
    void *mask_slot;         /* 2*W words: active bits, closing bits */
    uint64_t *res_mask;      /* active bits, then closing bits, of the last delivered round */
    int acc_full, work_filled, closing, finished, triggered, taken, fold;
    int64_t posts, armed_round, completed, pending, res_round;
    int64_t taken_posts;     /* posts read by the rounds so far */
    int64_t takes;           /* results taken (waits of distinct requests, close) */
    int64_t round_lo, round_hi;  /* this rank's post indices in the armed round (from TAKE) */
    int64_t res_lo, res_hi, res_nap;  /* ... in the pending result; NAP summed over its rounds */
    int64_t close_seen;      /* first round whose mask showed a closing rank, or -1 */
    int variants;            /* schedules per round kind (spec.variants, at least 1) */
    pc_sched **sched[2];     /* [0]: the mode's activation, [1]: full rounds; each an
                              * array of `variants`: round n runs on sched[kind][n % variants] */
    pc_sched *armed;
    int abandoned;           /* dropped without close: no new round; freed once none runs */
    int pinned;              /* MPI may still touch its memory (engine stopped): never freed */
    pc_coll *next_doomed;    /* list of abandoned collectives (E.doomed) */
    int err;
    char errmsg[384];
    int errpeer;             /* with err: as pc_sched's */
};

/* ------------------------------------------------------------------ engine state */
/* Locks: E.lock guards every schedule and collective. The progress thread holds it
 * only during a progress pass. Sleeping uses two small mutexes of their own, so that
 * a sleeper never competes with the poller for E.lock:
 *   wmtx + work: the progress thread (or an inline waiter) sleeps; kick() wakes it
 *   dmtx + done: application threads wait for completions; notify_done() wakes them
 * Lock order: E.lock before wmtx or dmtx. */
enum { SLEEP_AWAKE = 0, SLEEP_NAP = 1, SLEEP_PARKED = 2 };
typedef struct {
    pthread_mutex_t lock, wmtx, dmtx;
    pthread_cond_t work;
    pthread_cond_t done;
    pthread_t thread;
    int started, threaded, stop, kicked;
    int sleeping;            /* how the progress thread sleeps: SLEEP_* (under wmtx) */
    double nap_until_us;     /* ... and until when, if it naps (under wmtx) */
    int want;                /* application threads waiting for the lock (atomic) */
    int app_polling;         /* application threads progressing in wait() (atomic) */
    int conds_ready;
    pc_idle_policy policy;
    int64_t last_event_us;   /* see note_event() in progress.c (atomic) */
    int64_t done_seq;        /* completions notified (notify_done); under E.lock and dmtx */
    pc_coll *doomed;         /* abandoned collectives, freed by reap_doomed() */
    pc_sched *running;
} pc_engine_state;
extern pc_engine_state E;

/* errors.c */
int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* fail(code, "%s", msg), naming the peer of a failed send/receive (-1: none) */
int fail_at(int code, int peer, const char *msg);

/* kernels.c */
extern const size_t pc_dt_size[PC_DT_COUNT];
int pc_reduce_local(int redop, int dtype, const void *a, const void *b, void *out, int64_t n);
int pc_reduce_div(int redop, int dtype, const void *a, const void *b, void *out, int64_t n, double d);

/* mpi.c */
int mpi_post(pc_sched *s, int i);
int mpi_test(pc_sched *s, int *ndone);
void mpi_cancel_recvs(pc_sched *s);
int mpi_drain(pc_sched *s);
void mpi_forget(pc_sched *s);
int mpi_comm_info(MPI_Comm comm, int *rank, int *size);
int pc_tag_bits(void *comm_handle, int *seqbits, int *vbits);
int mpi_silent_peers(const pc_sched *s, int *ranks, int max);

/* progress.c */
double now_us(void);
void abs_deadline(struct timespec *ts, double us);
void kick(void);                         /* new work: note the event, wake the poller */
void wake(void);                         /* wake the poller, no new work */
void kick_lazy(void);                    /* a post's kick: wake the poller only if needed */
void kick_eager(void);                   /* ... at once, if anything is in flight */
void wake_lazy(void);
int engine_pollable(void);
int engine_in_flight(void);
int take_kick(void);
void sleep_for_kick(double us);          /* without E.lock */
void notify_done(void);
void app_lock(void);                     /* application threads take E.lock through these */
void app_unlock(void);
int app_lock_within(double seconds);      /* app_lock or PC_ERR_TIMEOUT (see progress.c) */
#define LOCK_GRACE_S 1.0                   /* waits give up on the lock after their timeout + this */
void running_add(pc_sched *s);
void running_remove(pc_sched *s);
int engine_progress_locked(void);
int wait_until(int (*pred)(void *), void *arg, double timeout_s);

/* sched.c */
void *op_addr(const pc_op *op, int i);
void sched_fail(pc_sched *s, int op, int code, const char *what);
void sched_withdraw(pc_sched *s);
int sched_drain(pc_sched *s);            /* [progress] top level only: may free s */
void sched_destroy(pc_sched *s);
int op_complete(pc_sched *s, int first);
void sched_check_done(pc_sched *s);
int sched_begin(pc_sched *s, int64_t version);

/* coll.c */
void coll_round_done(pc_coll *c);
int coll_take(pc_coll *c);
int coll_deliver(pc_coll *c);
int coll_maybe_trigger(pc_coll *c);
void reap_doomed(void);                  /* top level only: frees abandoned collectives */

#endif
