/* pc_internal.h -- what the engine's units share: the structs behind the opaque
 * handles of pc_engine.h, the engine state E, and each unit's internal functions.
 *
 *   errors.c    fail(): record a message, return a code
 *   kernels.c   pc_reduce_local(): out = a (op) b for every dtype x op; pc_reduce_div()
 *   mpi.c       messages: the one place that calls MPI (post/test/cancel, chunks, tags)
 *   sched.c     schedules: op table, executions, firing and completing ops
 *   coll.c      partial collectives (rounds, accumulator, results, close), candidates
 *   progress.c  E, the progress passes, the progress thread, waits
 *   idle.c      the idle policy: the CPU budget, interference, spin bounds
 *   waitsome.c  waits for k of n schedules' executions (Hop's backup workers)
 *   mpiwait.c   waits for requests of MPI's own (mpi4py's) under the idle policy
 *   avg.c       asynchronous averaging through a server rank (owns schedules, like coll.c)
 *   hop.c       Hop's neighbour allreduce: channels, backup workers, staleness, tokens (owns schedules)
 *   telemetry.c who is slow: a collective's rounds recorded per rank (coll.c calls it)
 *
 * Calls go one way: coll.c -> sched.c -> mpi.c, avg.c and hop.c -> sched.c; progress.c drives sched.c through
 * sched_progress() and owners (collectives) through the callbacks in pc_owner; sched.c
 * and coll.c signal progress.c (kick, notify_done) and nothing else of it; mpiwait.c
 * tests requests through mpi.c and asks idle.c how to wait.
 *
 * Locks (docs/engine.md, "Threads and locks"):
 *   unit lock  one per partial collective (with all its round schedules) and one per
 *              standalone schedule (pc_unit.lock): guards everything of that unit. Held
 *              for one post, one progress step of the unit, one result copy: never
 *              across a wait. The progress thread only ever trylocks it.
 *   E.lock     the running list and the unit bookkeeping (passes, doomed): short sections,
 *              no MPI call, no pass over data.
 *   E.wmtx     the progress thread's sleep (kicked, sleeping, nap_until_us)
 *   E.dmtx     completions: waiters sleep on E.done; the balancer on E.books
 * Lock order: unit lock -> E.lock -> E.wmtx / E.dmtx. Fields marked (atomic) are
 * written under their owner's lock and read anywhere with __atomic loads.
 */
#ifndef PC_INTERNAL_H
#define PC_INTERNAL_H
#include "pc_engine.h"
#include <mpi.h>
#include <pthread.h>
#include <time.h>

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)

/* ------------------------------------------------------------------ messages (mpi.c) */
/* One schedule's messages. An op's message of more than max_chunk bytes travels as
 * several MPI messages with the same tag (MPI's non-overtaking order matches them in
 * turn). Protected by the owning unit's lock. */
typedef struct pc_msgs {
    MPI_Comm comm;
    int rank, size;
    int seqbits, vbits;      /* tag = (version mod 2^vbits) << seqbits | seq (set at commit) */
    int64_t max_chunk;       /* bytes per MPI message (INT_MAX, or PARTIALCOLL_MAX_MESSAGE) */
    int n, cap;              /* requests in flight, capacity */
    MPI_Request *reqs;
    int *req_op;             /* the op each request belongs to */
    int64_t *req_bytes;      /* the bytes each request moves */
    int *left;               /* per op: its requests still in flight */
    int *done;               /* after mpi_test: the ops whose messages all completed */
    int *idx;
    MPI_Status *statuses;
    int64_t big;             /* ops of >= busy_bytes in flight */
    int64_t *sent;           /* bytes of the sends posted to each peer since creation */
    int cancelled;           /* a receive was cancelled: its peer's message may still come */
    int lost;                /* requests the MPI could no longer test: memory stays (never freed) */
} pc_msgs;

int mpi_init_msgs(pc_msgs *m, MPI_Comm comm, int nops, int64_t nreq);
void mpi_free_msgs(pc_msgs *m);
/* post op's message (send or recv) of nbytes at buf; PC_OK or a code (pc_last_error) */
int mpi_post(pc_msgs *m, int op, int send, void *buf, int64_t nbytes, int peer, int tag, int64_t busy_bytes);
/* test; *ndone ops completed (m->done); on error *failed_op names the op */
int mpi_test(pc_msgs *m, const int64_t *op_bytes, const int *is_recv, int *ndone, int *failed_op,
             int64_t busy_bytes);
void mpi_cancel_recvs(pc_msgs *m, const int *is_recv);
int mpi_drain(pc_msgs *m);                   /* requests still in flight */
void mpi_forget(pc_msgs *m);
int mpi_comm_info(MPI_Comm comm, int *rank, int *size);
/* MPI_Test of a request the engine did not make (mpi4py's): 1 completed (MPI set it to
 * MPI_REQUEST_NULL), 0 not yet, -1 failed (PC_ERR_MPI recorded by fail()) */
int mpi_test_request(MPI_Request *req, MPI_Status *status);
int mpi_tag_bits(MPI_Comm comm, int seq_needed, int *seqbits, int *vbits);
int mpi_tag(const pc_msgs *m, int64_t version, int seq);
int64_t mpi_max_chunk(void);

/* A collective's peer errors (coll.c): a receive from any rank with the reserved tag
 * (the top tag: no round's version is all ones), posted while the collective is open,
 * and this rank's own report to every peer. Message: PC_ALARM_BYTES, a pc_alarm_msg.
 * Protected by the owning unit's lock. */
#define PC_ALARM_BYTES 512
typedef struct pc_alarm_msg {
    uint64_t ident;          /* the collective it is about (pc_collspec.ident) */
    int64_t upto;            /* the rounds the reporter completed: rounds < upto complete at
                              * its peers too (its part of them is done), later ones fail */
    int32_t rank;            /* the rank that failed first (a report is never relayed) */
    char type[60];           /* its exception type, NUL-terminated */
    char message[432];       /* its message, NUL-terminated */
} pc_alarm_msg;
_Static_assert(sizeof(pc_alarm_msg) == PC_ALARM_BYTES, "a report is PC_ALARM_BYTES on every rank");

typedef struct pc_alarm {
    MPI_Comm comm;
    uint64_t ident;          /* reports about another collective are dropped (mpi_alarm_heard) */
    int tag, rank, size;
    int listening;           /* rx is posted */
    int nsend, lost;         /* sends in flight; lost: a send failed (buffers never freed) */
    MPI_Request rx, *tx;
    char *in, *out;          /* PC_ALARM_BYTES each */
} pc_alarm;

int mpi_alarm_listen(pc_alarm *a, MPI_Comm comm, uint64_t ident);
int mpi_alarm_heard(pc_alarm *a);            /* 1: a peer's report about this collective is in a->in */
int64_t mpi_alarm_dropped(void);             /* reports about other collectives dropped, this process */
void mpi_alarm_deaf(pc_alarm *a);            /* complete the receive (a message to itself) */
void mpi_alarm_cancel(pc_alarm *a);          /* cancel it: where the communicator may be freed */
int mpi_alarm_send(pc_alarm *a, const pc_alarm_msg *msg);   /* to every peer, with a->ident */
int mpi_alarm_sent(pc_alarm *a);             /* 1: every send completed (or failed) */
void mpi_alarm_free(pc_alarm *a);            /* no MPI call; leaks what MPI may still touch */

/* A collective's peer errors (report.c, for coll.c and hop.c): the receive that hears a
 * peer's report, and this rank's own. Protected by the owning unit's lock. */
typedef struct pc_report {
    pc_alarm alarm;
    int made;                /* this rank made its report (report_make) ... */
    int pending;             /* ... which the next pass sends (report_defer: made where no
                              * MPI call may be; counted in E.deferred) */
    pc_alarm_msg mine;       /* that report */
    pc_alarm_msg peer;       /* the report heard (report_heard) */
} pc_report;

int report_listen(pc_report *r, MPI_Comm comm, uint64_t ident);
int report_make(pc_report *r, int rank, const char *type, const char *message);  /* 0: made before */
void report_deaf(pc_report *r, int cancel);  /* stop listening (cancel: the comm may be freed) */
void report_send(pc_report *r, int64_t upto, int cancel);  /* deaf, then the report to every peer */
void report_defer(pc_report *r);             /* no MPI call: the next pass sends it (kick_report) */
int report_heard(pc_report *r);              /* [pass] 1: a peer's report is in r->peer */
void report_describe(const pc_report *r, int rank, char *buf, size_t len);  /* its error message */
void report_free(pc_report *r);              /* no MPI call */

/* ------------------------------------------------------------------ units */
/* What one lock guards: a partial collective with its schedules, or a standalone schedule. */
typedef struct pc_unit {
    pthread_mutex_t lock;
    int waiters;             /* application threads blocked on lock (atomic): passes skip it */
    int passes;              /* progress passes holding a pointer to the unit (E.lock) */
    int pins;                /* threads inside a call on the unit (atomic; unit_pin below) */
    int nrunning;            /* its schedules on the running list (E.lock; atomic reads) */
    int doomed;              /* free once nothing runs, no pass holds it, nothing pins it and its
                              * lock is free (E.lock; atomic reads) */
    int leaked;              /* MPI may still touch its memory: never freed (E.lock) */
    int withdraw;            /* abandoned: the next pass withdraws what has not started (unit) */
    void (*destroy)(struct pc_unit *);   /* frees the owner (registered by it) */
    void (*abandon)(struct pc_unit *);   /* withdraws what it may (registered; unit lock held) */
    int (*poll)(struct pc_unit *);       /* [pass] messages outside its schedules (a collective's
                                          * peer errors), or NULL; unit lock held; 1: progressed */
    uint64_t polled;                     /* the pass that called poll last (unit lock) */
    struct pc_unit *next_doomed;         /* E.doomed (E.lock) */
    int listening;           /* on E.polled: every pass polls it though none of its schedules
                              * runs (a parked collective's peer reports, a deferred report)
                              * (E.lock; atomic reads) */
    int due;                 /* a message it must still send (a deferred report): not reaped
                              * before a pass sent it (unit; atomic reads) */
    struct pc_unit *next_polled;         /* E.polled (E.lock) */
} pc_unit;

void unit_init(pc_unit *u, void (*destroy)(pc_unit *), void (*abandon)(pc_unit *));
void unit_lock(pc_unit *u);                  /* an application thread */
int unit_lock_within(pc_unit *u, double seconds);
void unit_unlock(pc_unit *u);
void unit_doom(pc_unit *u);                  /* E.lock taken; freed by reap_units() */
void reap_units(void);                       /* no lock held: frees doomed, idle, unpinned units */
void unit_listen(pc_unit *u, int on, int due);   /* on E.polled or off it; due: see pc_unit (unit lock held) */

/* ------------------------------------------------------------------ pins (progress.c)
 * A unit's lifetime has one owner (the kernel's kref): every thread inside a C API call
 * on a unit holds a pin for the whole call; free, close and abandon only mark the unit
 * doomed (unit_doom: that drops the owner's own reference), and whoever lets go last,
 * the last pin (unit_unpin), the last pass or the doomer, frees it once none of its
 * schedules runs (reap_units). A pin is taken only by a thread that holds a reference
 * already: the handle's owner (Python's object, which dooms the unit once and never
 * while another of its threads is between reading the handle and pinning it), or a pin
 * it holds itself. Pins are atomic and take no lock; unpinning a doomed unit reaps.
 *
 *     unit_pin(&c->owner.unit);  ... the call ...  unit_unpin(&c->owner.unit);
 *
 * Passes hold units through `passes` (under E.lock), not pins: a unit's retired
 * schedules wait for the passes only (coll_reap_retired), never for the caller itself. */
static inline void unit_pin(pc_unit *u) { __atomic_add_fetch(&u->pins, 1, __ATOMIC_ACQ_REL); }
void unit_unpin(pc_unit *u);
void report_flush(pc_unit *u, pc_report *r, double timeout_s);  /* no lock held: the sends leave */
int report_peer_error(pc_unit *u, const pc_report *r, const int *err, int *rank, char *type, int tlen,
                      char *message, int mlen);     /* no lock held */

/* ------------------------------------------------------------------ schedules (sched.c) */
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
    double t_us;             /* timed schedules: SEND when posted, RECV when completed (unit) */
} pc_op;

/* What a schedule's owner (a partial collective) registers: its buffer slots and the
 * callbacks of its TAKE and DELIVER ops. All run under the owner's unit lock. */
typedef struct pc_owner {
    pc_unit unit;            /* first member: the owner's lock is its schedules' lock */
    void **slot[PC_SLOT_SCRATCH];        /* PC_SLOT_WORK, PC_SLOT_MASK: address of the base */
    int64_t slot_bytes[PC_SLOT_SCRATCH];
    int (*take)(struct pc_owner *);
    int (*deliver)(struct pc_owner *);
    void (*done)(struct pc_owner *, pc_sched *s);   /* an execution of s completed */
    void (*failed)(struct pc_owner *, int code, int peer, const char *msg);
} pc_owner;

/* Sched flags published for the engine (atomic): what the idle policy needs to know */
enum { SF_INFLIGHT = 1, SF_POLLABLE = 2, SF_BUSY = 4 };

struct pc_sched {
    pc_unit own;             /* a standalone schedule's unit */
    pc_unit *unit;           /* &own, or the owner's unit */
    pc_owner *owner;         /* NULL for a standalone schedule */
    pc_msgs msgs;            /* (unit) */
    int nops, nrequired;     /* nrequired: ops that must complete (all but TRIGGERs) */
    pc_op *ops;
    int *succ_store, *stack, *is_recv;   /* is_recv: per op, for mpi.c */
    int64_t *op_bytes;       /* per op: its message's bytes (mpi.c) */
    int trigger_op;          /* index of the TRIGGER op, or -1 */
    void *scratch;           /* PC_SLOT_SCRATCH buffers (the engine's, freed with the schedule) */
    int64_t scratch_bytes;
    int live;                /* this execution's data is moving: a plain schedule from its start,
                              * a round of a partial collective from its TAKE */
    int needs_trigger;       /* nothing but pre-posted receives can happen before the TRIGGER */
    int hops;                /* receives on the longest dependency chain: the message steps a
                              * round may take through ranks that nap (progress.c's deep sleep) */
    int running;             /* (unit; atomic): an execution runs; Hop's entry predicate reads it */
    int remaining, draining; /* (unit) */
    int err;                 /* (unit; atomic) */
    int64_t version;
    int64_t executions;      /* (unit; atomic): waits read it */
    int flags;               /* SF_* (atomic) */
    char errmsg[384];
    int errpeer;
    int owner_index;         /* the owner's name for this schedule (hop.c: its channel) */
    int ntimers, *timers;    /* (send op, recv op, owner) triples (pc_sched_set_timers; unit) */
    int on_list;             /* on E.running (E.lock) */
    pc_sched *next, *prev;   /* E.running (E.lock) */
};

int sched_create(void *comm_handle, int nops, const pc_opspec *ops, int nedges, const int *edges,
                 pc_owner *owner, int64_t scratch_bytes, int pairs, pc_sched **out);
void *op_addr(const pc_op *op, int i);
void sched_fail(pc_sched *s, int op, int code, const char *what);
void sched_withdraw(pc_sched *s);
void sched_destroy(pc_sched *s);
int op_complete(pc_sched *s, int first);
void sched_check_done(pc_sched *s);
int sched_begin(pc_sched *s, int64_t version);
int sched_begin_at(pc_sched *s, int64_t version, double now);   /* now: as the kicks' (progress.c) */
void sched_publish(pc_sched *s);             /* recompute s->flags */
int sched_fire_trigger(pc_sched *s);
int sched_progress(pc_sched *s);             /* [pass] one step of s (unit lock held); 1: progressed */
int sched_silent_peers(const pc_sched *s, int *ranks, int max);
void sched_add_traffic(const pc_sched *s, int64_t *sent, int n);

/* ------------------------------------------------------------------ telemetry (telemetry.c)
 * Who is slow (docs/who-is-slow.md): one record per round in a ring of the last cap rounds,
 * and running totals. All fields (unit lock): written by a post (application thread),
 * TAKE and the round's end (whichever thread steps the unit); read by pc_coll_telemetry
 * under the lock. Times are this rank's CLOCK_MONOTONIC, never compared across ranks. */
typedef struct pc_tele_rec {
    int64_t round;           /* the round (and post index) this slot holds; -1: none */
    double post_us;          /* post #round made here (0: not yet) */
    double take_us;          /* round's TAKE here: this rank's view of its start (0: not yet;
                              * post_us when the post came first: no clock read) */
    double done_us;          /* a full round that this rank posted to: completed here (else 0) */
    double late_us;          /* post_us - take_us when the post came after the TAKE, else 0 */
    double wait_us;          /* a full round: done_us - post_us */
    int flags;               /* 1 completed, 2 full round, 4 this rank's data inside */
} pc_tele_rec;

typedef struct pc_tele {
    int rank, size, cap;     /* cap 0: off (every hook returns at once) */
    pc_tele_rec *ring;       /* round n in ring[n % cap] */
    int64_t rounds, full;    /* rounds completed here (closing rounds not counted), full ones */
    int64_t posts, late;     /* posts, and those after their round's TAKE */
    double late_us, wait_us; /* summed lateness of the late posts; summed full-round waits */
    int64_t lost;            /* events whose round had left the ring (totals only) */
    int64_t *missed;         /* P: rounds each rank's data was not inside (from the masks) */
    int64_t arrival_ns;      /* since the last TAKE: + full rounds' waits - late posts' lateness */
} pc_tele;

int tele_init(pc_tele *t, int rank, int size);
void tele_free(pc_tele *t);
void tele_post(pc_tele *t, int64_t n);       /* post #n, before it may trigger its round ... */
void tele_post_time(pc_tele *t, int64_t n, double now);   /* ... and its time, after */
void tele_take(pc_tele *t, int64_t n, int64_t *times);   /* round n's TAKE (times: a timed row, or NULL) */
void tele_round(pc_tele *t, int64_t n, const uint64_t *mask, int W, int full);   /* round n completed */

/* ------------------------------------------------------------------ collectives (coll.c) */
/* Load-aware owners: epochs' snapshots kept (a decision may lag the rounds by up to
 * PC_SNAPS - 1 epochs before a round waits for it), and a decision received, not applied. */
enum { PC_SNAPS = 4 };
/* Requests whose take the engine checks (the PC_CLAIMS latest posts' requests) */
enum { PC_CLAIMS = 4096 };
typedef struct { int64_t epoch; pc_sched *s[2]; } coll_switch;

struct pc_coll {
    pc_owner owner;          /* first member: unit (its lock guards everything below) */
    pc_collspec spec;
    int rank, size;
    size_t nbytes, itemsize;
    /* Buffers (coll.c, "Buffers"; docs/engine.md, "Ownership"), all (unit): whichever
     * thread holds the unit lock (a post, a progress step's TAKE and DELIVER, a take,
     * close) reads and writes them; no other thread touches them. */
    void *buf[3];            /* the three internal buffers */
    void *acc, *work, *result;
    void *work_slot;         /* what WORK ops address: work, or user (the round runs there) */
    void *user;              /* the one user buffer the engine holds, or NULL: the input
                              * (input == IN_LENT), the round's buffer (work_slot == user) or
                              * else the pending result */
    int input;               /* where posted data no round has taken is: IN_NONE, IN_ACC,
                              * IN_LENT (in user), IN_WORK (in work_slot) */
    int shaped;              /* shape: the last early take's rounds, nap, posts, active and closing
                              * words (P <= 64), for coll_same_shape */
    int64_t shape[5];
    void *mask_slot;         /* mask_words(P) words: active bits, closing bits, posts per rank */
    uint64_t *res_mask;      /* the same, of the pending result (folded rounds: OR, posts summed) */
    int closing, triggered, taken, fold;
    int finished;            /* (atomic) */
    int err;                 /* (atomic) */
    int64_t completed;       /* (atomic): rounds completed here */
    int64_t posts, armed_round, pending, res_round;
    int64_t taken_posts;     /* posts read by the rounds so far */
    int64_t takes;           /* requests whose result was taken (each once: claimed; an early take
                              * once its wait returned); posts - takes are outstanding (unit) */
    uint64_t claimed[PC_CLAIMS / 64];   /* (unit) request i's result taken: bit i mod PC_CLAIMS,
                              * for the last PC_CLAIMS posts (coll.c, coll_claim) */
    int64_t round_lo, round_hi;  /* this rank's post indices in the armed round (from TAKE) */
    int64_t res_lo, res_hi, res_nap, res_posts;  /* ... of the pending result; NAP and posts summed */
    int64_t close_seen;      /* first round whose mask showed a closing rank, or -1 */
    int variants;
    pc_sched **sched[2];     /* [0]: the mode's activation, [1]: full rounds */
    pc_sched *armed;
    int abandoned;           /* (unit; atomic): the balancer's wait reads it */
    int stats_stopped;       /* (atomic) pc_coll_stop_stats: the balancer's wait ends */
    /* load-aware owners (spec.timed, spec.rebalance_every; coll.c "Owners"), all (unit) but epochs */
    int64_t *meas;           /* PC_TIME_FIELDS x P: this rank's times per owner since its last TAKE */
    int64_t *agreed;         /* PC_TIME_FIELDS x P: the rows of every rank, summed since the last epoch */
    int64_t run_delay;       /* this process's run delay at the last TAKE (ns; idle_run_delay_ns) */
    int64_t run_cpu;         /* ... and its threads' CPU time then (ns) */
    int64_t *snap[PC_SNAPS]; /* epoch e's agreed sums in snap[e % PC_SNAPS] */
    int64_t epochs;          /* (atomic) snapshots out */
    int64_t decided;         /* decisions received here (pc_coll_switch) */
    int64_t ready;           /* decisions received on every rank (the least decided of the
                              * last round's masks: the same on every rank) */
    int64_t parked;          /* a round waiting for a decision (the lag bound), or -1 */
    coll_switch pend[PC_SNAPS + 2];  /* decisions with schedules received, not applied yet, oldest
                              * first (at most PC_SNAPS + 1: the lag bound) */
    int npend;
    int64_t *switched;       /* the round from which each applied switch that carried
                              * schedules runs, in order (pc_coll_switched) */
    int64_t nswitched, capswitched;
    pc_sched **retired;      /* replaced schedules, freed once no pass can hold them */
    int nretired, capretired;
    int64_t *retired_sent;   /* P: the traffic of freed retired schedules */
    char errmsg[384];
    int errpeer;
    pc_report rep;           /* (unit) peer errors: pc_coll_abort, coll_poll; rep.peer is the
                              * report heard, when err is PC_ERR_PEER ... */
    int peer_heard;          /* (unit) ... or heard while a round before peer.upto runs here:
                              * that round completes, the next fails (coll_arm) */
    double peer_heard_us;    /* (unit) when: a round that has not completed 2 s later fails */
    double alarm_us;         /* (unit) when a pass last tested the alarm receive (coll_alarm_due) */
    pc_tele tele;            /* (unit) who is slow: telemetry.c */
};

int pc_coll_mask_words(int size);            /* 2 * ceil(P/64) + P */
int coll_maybe_trigger(pc_coll *c, double *now);

/* ------------------------------------------------------------------ engine (progress.c) */
enum { SLEEP_AWAKE = 0, SLEEP_NAP = 1, SLEEP_PARKED = 2, SLEEP_ASIDE = 3 };
typedef struct {
    pthread_mutex_t lock, wmtx, dmtx;
    pthread_cond_t work;     /* (wmtx) the progress thread's sleep */
    pthread_cond_t done;     /* (dmtx) completions */
    pthread_cond_t books;    /* (dmtx) a timed collective's epoch ended, or it stopped */
    pthread_t thread;
    int started;             /* (E.lock; atomic) */
    int threaded, stop;      /* (E.lock; stop atomic) */
    int kicked;              /* (wmtx) */
    int sleeping;            /* (wmtx; written atomically: wait_until looks without it) SLEEP_* */
    double nap_until_us;     /* (wmtx) */
    int app_polling;         /* application threads progressing in wait() (atomic) */
    int done_sleepers;       /* threads about to sleep or asleep on E.done (dmtx; atomic) */
    int64_t app_left_us;     /* when one last left such a wait (atomic) */
    int64_t pass_since_us;   /* the progress thread's pass began then; 0 between passes (atomic) */
    int conds_ready;
    pc_idle_policy policy;   /* written at start; poll_armed atomic */
    int64_t last_event_us;   /* (atomic) see note_event() */
    int64_t last_post_us, post_period_us;   /* (atomic) see note_post() */
    unsigned nposts;         /* (atomic) local posts, for note_post() */
    /* (atomic) the last waits of application threads, and how many so far (note_wait()):
     * a cache line of their own, written at every wait, read by a sleeping progress thread */
    _Alignas(64) int64_t waits_us[8];
    _Alignas(64) unsigned nwaits;
    char waits_pad[60];
    int nrunning;            /* schedules on E.running (E.lock; atomic reads) */
    int nflag[3];            /* running schedules with SF_INFLIGHT, SF_POLLABLE, SF_BUSY (atomic) */
    int deferred;            /* reports made where no MPI call could be (report_defer), not
                              * sent yet (atomic) */
    int reporter_on;         /* inline progress: the reporter thread runs (atomic; kick_report) */
    pc_unit *doomed;         /* (E.lock; written atomically: unit_unpin looks without it) */
    pc_sched *running;       /* (E.lock) */
    pc_unit *polled;         /* units polled by every pass outside their schedules (E.lock) */
    int npolled;             /* units on E.polled (E.lock; atomic reads) */
} pc_engine_state;
extern pc_engine_state E;

/* errors.c */
int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int fail_at(int code, int peer, const char *msg);

/* kernels.c */
extern const size_t pc_dt_size[PC_DT_COUNT];
int pc_reduce_local(int redop, int dtype, const void *a, const void *b, void *out, int64_t n);
int pc_reduce_div(int redop, int dtype, const void *a, const void *b, void *out, int64_t n, double d);
int pc_axpy(int dtype, const void *a, const void *b, void *out, int64_t n, double w);  /* out = a + w b */
int pc_mean_local(int dtype, const void *const *v, int k, void *out, int64_t n);   /* widened mean */

/* clock.c */
double now_us(void);                     /* CLOCK_MONOTONIC, microseconds */
void abs_deadline(struct timespec *ts, double us);

/* progress.c */
double note_event(void);
void note_post(void);                    /* a local post: the period between posts (the deep sleep) */
void kick(void);                         /* new work: note the event, wake the poller */
void kick_report(void);                  /* a report deferred: kick; inline, a thread sends it */
void wake(void);
/* The kicks' now: the caller's clock read of this event, noted by the kick; 0: the kick
 * reads it; < 0: noted already (the completion whose step makes this event, us ago).
 * They return the clock they noted (0: none). */
double kick_lazy(double now);            /* a post's kick: wake the poller only if needed */
double kick_eager(double now);
void notify_done(void);                  /* a wait's predicate may have changed */
void notify_books(void);                 /* wait_passive's predicate may have changed */
void running_add(pc_sched *s);           /* unit lock held; takes E.lock */
void running_remove(pc_sched *s);
void engine_set_flags(pc_sched *s, int f);   /* unit lock held: s's SF_* flags are f now */
int engine_pass(void);                   /* no lock held: one progress pass over every unit */
/* How progress.c runs a schedule: registered by sched.c (sched_create), so that the
 * progress loop knows the running list and the units, not how a schedule steps. Each
 * is called with the schedule's unit lock held. */
typedef struct pc_stepper {
    int (*step)(pc_sched *s);                    /* one step; 1: progressed */
    void (*fail)(pc_sched *s, const char *why);  /* stop its execution with an error */
    void (*forget)(pc_sched *s);                 /* drop the requests MPI no longer finishes */
} pc_stepper;
void engine_set_stepper(const pc_stepper *st);
int wait_until(int (*pred)(void *), void *arg, double timeout_s);   /* no lock held */
int wait_passive(int (*pred)(void *), void *arg, double timeout_s); /* no lock held; drives nothing */

/* idle.c */
int idle_set_node(void *shared, int local_rank, int local_size, int node_cpus);
int idle_poll(void);                     /* poll while armed now? (spin, or auto's spin) */
int idle_core_each(void);                /* a CPU per rank of the node (its application thread) */
int64_t idle_run_delay_ns(int64_t *cpu); /* ns this process's threads were runnable, not running
                                           (*cpu: ns they ran) */
int idle_spare(void);                    /* idle_poll() and a CPU per thread of the node (2 per rank) */
double idle_spin_bound_us(void);         /* how long polling may go on after the last event */
void idle_note_gap(double us);           /* an event came us after the previous one */
void idle_note_busy_gap(double us);      /* ... while a large message was in flight */
double idle_busy_bound_us(void);         /* how long yielding for a large message may go on */
void idle_sample(void);                  /* [progress] interference, every ~10 ms */

#endif
