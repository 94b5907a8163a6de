/* pc_engine.h -- the partialcoll schedule engine (C, driven from Python via cffi).
 *
 * A schedule is a flat array of ops plus happens-before edges (fflib2's model):
 *
 *   kind      SEND | RECV | COMPUTE | NOP | TRIGGER | TAKE | DELIVER
 *   peer      SEND/RECV: the other rank (in the schedule's communicator)
 *   nbytes    SEND/RECV: message size in bytes (sent as MPI_BYTE)
 *   buf[3]    SEND/RECV: buf[0]; COMPUTE: out = a (op) b with a=buf[0], b=buf[1], out=buf[2]
 *   dtype     COMPUTE: element type (PC_DT_*); redop: PC_OP_* (PC_OP_COPY: out = a)
 *   count     COMPUTE: number of elements
 *   divisor   COMPUTE: 0 (or 1), or out = (a (op) b) / divisor, for SUM and COPY of a real
 *             floating dtype: an average fused into the pass that makes the sum
 *   need      how many predecessor completions fire the op (all = npred, any = 1, k of n)
 *
 * A buffer is (base, off): the address is *base + off, so a partial collective can
 * swap its accumulator/work/result buffers without rebuilding its schedules.
 * Ops are consumable: an op fires at most once per execution, however many of its
 * predecessors complete. An execution is complete when every op except TRIGGERs is.
 * Tags: tag = (version mod 2^vbits) << seqbits | seq, where seq is the index of the
 * message among those of the same (sender, receiver) pair in op order, so the
 * k-th send to a peer always matches the peer's k-th receive, and messages of
 * different executions (versions) never match. seqbits is sized at commit from the most
 * messages between one pair; a message past INT_MAX bytes travels in chunks.
 *
 * TRIGGER, TAKE and DELIVER belong to a partial collective (pc_coll): TRIGGER
 * completes when the application's post makes this rank start the round, TAKE moves
 * the accumulator into the work buffer (and sets this rank's active bit and posts
 * count), DELIVER publishes the round's result.
 *
 * Threads: any thread may call any function; each locks only the collective or schedule
 * it is given, for one step, and never waits while holding it (docs/engine.md). Progress
 * runs on the engine's progress thread, or inline in test/wait.
 */
#ifndef PC_ENGINE_H
#define PC_ENGINE_H
#include <stdint.h>
#include <stddef.h>

/* CDEF BEGIN -- this block is also the cffi cdef: plain declarations only. */
enum {
    PC_OK = 0, PC_ERR_ARG = 1, PC_ERR_MPI = 2, PC_ERR_NOMEM = 3, PC_ERR_STATE = 4,
    PC_ERR_TIMEOUT = 5, PC_ERR_THREAD = 6, PC_ERR_DTYPE_OP = 7, PC_ERR_TRUNCATE = 8,
    PC_ERR_PEER = 9      /* a peer reported an error on this collective (pc_coll_abort) */
};
enum { PC_SEND = 0, PC_RECV = 1, PC_COMPUTE = 2, PC_NOP = 3, PC_TRIGGER = 4, PC_TAKE = 5, PC_DELIVER = 6 };
enum {
    PC_DT_BOOL = 0, PC_DT_INT8 = 1, PC_DT_INT16 = 2, PC_DT_INT32 = 3, PC_DT_INT64 = 4,
    PC_DT_UINT8 = 5, PC_DT_UINT16 = 6, PC_DT_UINT32 = 7, PC_DT_UINT64 = 8,
    PC_DT_FLOAT32 = 9, PC_DT_FLOAT64 = 10, PC_DT_COMPLEX64 = 11, PC_DT_COMPLEX128 = 12,
    PC_DT_FLOAT16 = 13, PC_DT_BFLOAT16 = 14,   /* reduced in float, rounded back (kernels.c) */
    PC_DT_COUNT = 15
};
enum {
    PC_OP_SUM = 0, PC_OP_PROD = 1, PC_OP_MIN = 2, PC_OP_MAX = 3, PC_OP_LAND = 4, PC_OP_LOR = 5,
    PC_OP_LXOR = 6, PC_OP_BAND = 7, PC_OP_BOR = 8, PC_OP_BXOR = 9, PC_OP_COPY = 10, PC_OP_COUNT = 11
};
/* activation kinds of a partial collective's round schedule */
enum { PC_ACT_FLOOD = 0, PC_ACT_QUORUM = 1, PC_ACT_NONE = 2 };
/* partial collective modes */
enum { PC_MODE_SOLO = 0, PC_MODE_MAJORITY = 1, PC_MODE_PROBE = 2, PC_MODE_QUORUM = 3, PC_MODE_FULL = 4 };
enum { PC_LATE_LATEST = 0, PC_LATE_FOLD = 1 };
/* how a rank's posts fold into its accumulator between two rounds that read it (k posts):
 * SUM: their sum; MEAN: sum / k; RNA: sum_j j x_j / (k (k + 1) / 2), the j-th post since
 * the last read weighing j (RNA's linear weights: newer weigh more). MEAN and RNA: op SUM
 * of a real floating dtype. */
enum { PC_ACC_SUM = 0, PC_ACC_MEAN = 1, PC_ACC_RNA = 2 };
/* timed owners: per owner, the sums of its spans (first block sent -> last result, ns),
 * its first results' latencies (ns), its blocks and its samples (rank x round); then per
 * rank, its arrivals (ns, telemetry.c: + its wait in a full round, - its lateness for a
 * post after its round's TAKE) and, where the owners are rebalanced, its run delay (ns its
 * process's threads were runnable but not running: CPU starvation, idle.c) and its CPU
 * time (ns they ran: the run delay per CPU second is the rank's stretch); only the
 * rank's own words of its row are written */
enum { PC_TIME_FIELDS = 7, PC_TIME_ARRIVAL = 4, PC_TIME_RUN_DELAY = 5, PC_TIME_RUN_CPU = 6 };
/* buffer slots of a partial collective, for pc_opspec.slot */
/* SCRATCH: the schedule's own scratch memory, allocated by the engine, so that no posted
 * receive ever targets memory Python may free */
enum { PC_SLOT_NONE = 0, PC_SLOT_WORK = 1, PC_SLOT_MASK = 2, PC_SLOT_SCRATCH = 3 };

typedef struct pc_opspec {
    int kind;
    int peer;
    int dtype;
    int redop;
    int need;            /* completions of predecessors that fire the op */
    int64_t count;
    int64_t nbytes;
    void *ptr[3];        /* plain buffers; used when slot[i] == PC_SLOT_NONE */
    int slot[3];         /* PC_SLOT_*: buffer owned by the collective or the schedule */
    int64_t off[3];      /* byte offsets into the slot buffer */
    double divisor;      /* COMPUTE: 0 or 1 (none), else out = (a (op) b) / divisor */
} pc_opspec;

typedef struct pc_idle_policy {
    double spin_us;      /* busy-poll this long after the last event */
    double yield_us;     /* then sched_yield() this long */
    double sleep_min_us; /* then sleep, doubling from this ... */
    double sleep_max_us; /* ... up to this cap; a local post wakes the sleeper at once */
    double deep_after_us;/* after this long without any event, the cap grows with the idle
                          * time (a tenth of it over the armed round's message steps: a round
                          * through that many napping ranks takes at most 10 % longer) ... */
    double deep_sleep_us;/* ... up to this (an idle rank costs almost no CPU) */
    int64_t busy_bytes;  /* while a message this large moves (its round has begun), poll ... */
    double busy_cap_us;  /* ... as long as the last event is younger than this */
    double poll_max_us;  /* polling goes on at most this long after the last event */
    int poll_armed;      /* 0 (idle "sleep"), 1 ("spin": the progress thread and wait() poll
                          * while a round is armed, up to an adaptive bound), 2 ("auto": spin
                          * where the node has the CPUs and no interference, idle.c) */
} pc_idle_policy;

typedef struct pc_idle_info {    /* what the idle policy chose and why (pc_idle_state) */
    int setting;         /* poll_armed */
    int polling;         /* 1: polls while armed now, 0: sleeps */
    int cpu_budget;      /* the CPUs this process may use (affinity, cgroup quota) */
    int node_ranks, node_cpus, node_known;
    double hold_s;       /* auto: sleeping at least this much longer after interference */
    double spin_bound_us;/* how long polling goes on after the last event */
    double busy_bound_us;/* how long yielding for a large message goes on after it */
    double run_delay;    /* last sample: the share of runnable time spent waiting for a CPU */
    int64_t throttled;   /* samples that saw the cgroup throttled */
    double steal;        /* last sample: steal time per CPU */
    char reason[160];
} pc_idle_info;

typedef struct pc_sched pc_sched;
typedef struct pc_coll pc_coll;
typedef struct pc_avg pc_avg;

typedef struct pc_collspec {
    int mode;            /* PC_MODE_* */
    int late;            /* PC_LATE_* */
    int candidates;      /* probe: q */
    int quorum;          /* quorum: k */
    int max_staleness;   /* 0: none; s: rounds n with (n+1) % s == 0 are full */
    int mask_words;      /* words of the MASK slot: pc_coll_mask_words(P) (+ timed words) */
    int variants;        /* schedules per round kind (0 or 1: one); round n runs on
                          * variant n mod variants (the tree's rotated aggregators) */
    uint64_t seed;
    int timed;           /* 1: the schedules carry timers (pc_sched_set_timers) and the MASK
                          * slot pc_coll_timed_words(P) more words: each rank's row of
                          * measured service times per owner (pc_coll_stats), then each
                          * rank's count of decisions received (pc_coll_switch) */
    int rebalance_every; /* K > 0: every K rounds the agreed times form an epoch's snapshot;
                          * decisions may lag them by 3 epochs before a round waits */
    int dtype, redop;
    int64_t count;
    const void *identity;    /* one element: the op's identity */
    int accumulate;          /* PC_ACC_* */
    int never_posts;         /* 1: this rank never posts (a dedicated server) and its round
                              * schedules write its round buffer before they read it: TAKE
                              * leaves the buffer as it is instead of filling the identity */
    uint64_t ident;          /* the collective's identity, the same on every rank and (with
                              * high probability) no other collective's: a peer-error report
                              * carries it, and a report for another collective (a stale one,
                              * sent to a freed communicator whose context id MPI reused) is
                              * ignored */
} pc_collspec;

typedef struct pc_result {
    int64_t round;       /* last round included */
    int64_t rounds;      /* how many rounds are folded in */
    int64_t nap;         /* ranks whose data is inside, summed over those rounds */
    int64_t posts;       /* posts whose data is inside (data / posts: their exact mean) */
    int64_t post_lo, post_hi; /* this rank's posts [post_lo, post_hi) are in the data */
    int finished;        /* the collective has completed its final round */
} pc_result;

const char *pc_strerror(int code);
const char *pc_last_error(void);
int pc_last_error_peer(void);   /* the peer of the send/receive that failed, or -1 */

int pc_engine_start(int use_thread, const pc_idle_policy *policy);
int pc_engine_stop(void);
int pc_engine_threaded(void);
/* auto: the node's shared memory (a word per local rank, or NULL: not known yet),
 * this rank in it, its ranks and the CPUs they may use together */
int pc_engine_set_node(void *shared, int local_rank, int local_size, int node_cpus);
int pc_idle_state(pc_idle_info *out);
/* wait for an MPI request made outside the engine (mpi4py's: request and status are the
 * addresses of its MPI_Request and MPI_Status, status may be NULL) under the idle policy,
 * for timeout_s at most, waited_us into the wait; *done = 1 once it completed */
int pc_mpi_request_wait(void *request, void *status, double timeout_s, double busy_us, double waited_us,
                        int *done);
int pc_cpu_budget(void);         /* this process's CPUs: affinity, capped by the cgroup quota */
int pc_cpu_limits(int *affinity, int *quota, char *cgroup, int len);  /* its parts (quota 0: none) */
/* seq bits for seq_needed messages per pair, the rest of MPI_TAG_UB for the version */
int pc_tag_bits(void *comm_handle, int seq_needed, int *seqbits, int *vbits);

int pc_op_valid(int redop, int dtype);
int pc_div_valid(int redop, int dtype);    /* may a COMPUTE of redop on dtype have a divisor */
int pc_mpi_cuda_support(void);
int pc_candidates(uint64_t seed, int64_t round, int size, int q, int *out);

/* pairs: the most messages between one pair of ranks in any schedule on this communicator,
 * the same on every rank (the tag layout: seq bits count them, the rest is the version) */
int pc_sched_create(void *comm_handle, int nops, const pc_opspec *ops, int nedges, const int *edges,
                    pc_coll *coll, int64_t scratch_bytes, int pairs, pc_sched **out);
int pc_sched_start(pc_sched *s, int64_t *execution);
int pc_sched_test(pc_sched *s, int64_t execution, int *done);
int pc_sched_wait(pc_sched *s, int64_t execution, double timeout_s);
int64_t pc_sched_executions(pc_sched *s);
int pc_sched_free(pc_sched *s);
/* wait until `need` of the n executions (s[i], executions[i]) completed; done[i] says which
 * (timeout 0: test once); see waitsome.c */
int pc_sched_wait_some(int n, pc_sched *const *s, const int64_t *executions, int need,
                       double timeout_s, int *done);
/* free now if idle (*deferred = 0), else once nothing posted is in flight (*deferred = 1) */
int pc_sched_abandon(pc_sched *s, int *deferred);
/* a round schedule built for a partial collective and never handed to it (pc_coll_switch):
 * freed now (nothing else points at it); NULL: nothing */
int pc_sched_discard(pc_sched *s);

int pc_coll_mask_words(int size);   /* the MASK slot: active bits, closing bits, posts per rank */
int pc_coll_timed_words(int size);  /* ... and timed: PC_TIME_FIELDS P words per rank, then P (-1: too many) */
int pc_coll_create(const pc_collspec *spec, void *comm_handle, pc_coll **out);
/* the schedule of round kind `kind` (0: the mode's, 1: full) for rounds n with
 * n mod spec.variants == variant */
int pc_coll_set_sched(pc_coll *c, int kind, int variant, pc_sched *s);
int pc_coll_begin(pc_coll *c);
int pc_coll_post(pc_coll *c, const void *x, void *out, int64_t *index, int *late);
/* staged (device) posts: see coll.c */
int pc_coll_acc_full(pc_coll *c, int *full);
/* The user buffers (out=) the engine may still read or write: a lent acc, the buffer a
 * round runs in, the pending result; NULL where none. */
int pc_coll_user_buffers(pc_coll *c, void *bufs[3]);
int pc_coll_post_replace(pc_coll *c, const void *x, int64_t *index, int *late, int *replaced);
int pc_coll_test(pc_coll *c, int64_t index, int *done);
/* wait until round `index` completed here (or the timeout), then copy out the result;
 * mask: pc_coll_mask_words(P) words */
int pc_coll_wait_take(pc_coll *c, int64_t index, double timeout_s, void *out, uint64_t *mask, pc_result *info);
/* the same two for the small-message path: post1 returns (index << 1) | late or -code;
 * wait1 writes round, rounds, nap, post_lo, post_hi, finished, posts, then the mask words */
int64_t pc_coll_post1(pc_coll *c, const void *x, void *out);
int pc_coll_wait1(pc_coll *c, int64_t index, double timeout_s, void *out, int64_t *res);
/* wait1, returning -1 where the result is shaped as the one res held before (its round is
 * index, this request's post inside it, the same rounds, nap, posts and bits; P <= 64) */
int pc_coll_wait1_same(pc_coll *c, int64_t index, double timeout_s, void *out, int64_t *res);
/* post(x, out=y).wait() in one call where the round completes within it (coll.c): post,
 * and take the result into out and res (as wait1) if this request is alone and its round
 * completed (an early take); returned: the last post's early take's wait has returned
 * (pc_coll_returned says it later). pc_coll_give_back: at close, an early take never
 * returned goes back into the pending result (res as wait1 wrote it). Returns
 * (index << 3) | same << 2 | taken << 1 | late, or -code; same: the result's round is
 * index, this post is inside it, and its rounds, nap, posts and bits are the last early
 * take's (P <= 64) */
int64_t pc_coll_post_take(pc_coll *c, const void *x, void *out, int64_t *res, int returned);
int pc_coll_returned(pc_coll *c);
int pc_coll_give_back(pc_coll *c, const void *data, const int64_t *res);
int pc_coll_close(pc_coll *c);
/* on_failure="shrink": what a stopped collective holds (coll.c, coll_salvage): st has 5 words */
int pc_coll_salvage(pc_coll *c, int64_t *st, void *out, uint64_t *mask, pc_result *info);
/* A reference for threads still inside calls on c: the owner that drops c (abandon)
 * while other threads of it may be between reading the handle and their call holds one
 * for them, and the last of them releases it; a dropped collective is freed by whoever
 * lets go last (engine.md, "Ownership"). */
int pc_coll_hold(pc_coll *c);
int pc_coll_release(pc_coll *c);
/* Load-aware owners (algorithm "ps", partialcoll/balance.py). Timers: n triples (send op,
 * receive op, owner) of blocks this rank sends away; the engine times each owner per
 * round, from the first send to it to the last result from it (its span), per block. */
int pc_sched_set_timers(pc_sched *s, int n, const int *triples);
/* sums: PC_TIME_FIELDS x P, each summed over ranks and rounds: the owners' spans (ns),
 * first results' latencies (ns), blocks, samples, then the ranks' arrivals, run delays and
 * CPU times (ns): epoch >= 0: epoch's snapshot (wait up to timeout_s for it; *got = 0 if the
 * collective finished first); epoch < 0: the latest snapshot, or the sums so far */
int pc_coll_stats(pc_coll *c, int64_t epoch, double timeout_s, int64_t *sums, int *got);
/* The balancer stops: a pc_coll_stats waiting for an epoch returns at once (*got = 0), and
 * every later one without waiting */
int pc_coll_stop_stats(pc_coll *c);
/* Decision `epoch` (in order, on every rank): the schedules of the rounds (NULL, NULL: keep
 * the current ones), run from the first round n = m K >= (epoch + 2) K whose previous round
 * found the decision received on every rank (the same n everywhere). The collective owns
 * s0, s1 from here on. */
int pc_coll_switch(pc_coll *c, int64_t epoch, pc_sched *s0, pc_sched *s1);
/* the round from which the k-th switch with schedules runs (k from 0), or -1: not yet */
int pc_coll_switched(pc_coll *c, int64_t k, int64_t *round);
int pc_coll_free(pc_coll *c);          /* after close: frees its schedules too */
/* dropped without close: stop; freed now, or once nothing is in flight (*deferred = 1) */
int pc_coll_abandon(pc_coll *c, int *deferred);
/* A rank that fails tells its peers (docs/faults.md): send this rank's report (its
 * exception's type and message) to every peer on the collective's communicator, stop the
 * collective here (later calls: PC_ERR_STATE), and wait up to timeout_s for the sends.
 * A peer's pending and later posts, tests and waits on it then fail with PC_ERR_PEER,
 * and pc_coll_peer_error() says who failed and how. Nothing is sent after a peer's own
 * report (the first report is the one every rank hears) or after the final round.
 * timeout_s < 0: no MPI call here (a garbage collector's thread): the next progress pass
 * sends it (with progress inline, a short-lived reporter thread's). */
int pc_coll_abort(pc_coll *c, const char *type, const char *message, double timeout_s);
int pc_coll_peer_error(pc_coll *c, int *rank, char *type, int tlen, char *message, int mlen);
/* this process's peer-error reports, since it started: sent (one per collective it reported
 * on: none where a peer's report came first), and the stale reports it dropped (about
 * another collective: sent on a communicator freed since, whose context id MPI reused) */
int pc_report_counts(int64_t *sent, int64_t *dropped);
/* traffic: add the bytes of the sends each schedule posted to peer i since creation
 * to sent[i], i < n; pass a collective (all its round schedules) or a schedule */
int pc_traffic(pc_coll *c, pc_sched *s, int64_t *sent, int n);
/* Faults (issue 14). The ranks of comm that the MPI reports as failed, through
 * MPIX_Comm_get_failed where the loaded libmpi has it (MPICH >= 4.1; ULFM, untried):
 * *n of them (at most max) in ranks, ascending; *n = -1 when the MPI cannot tell. */
int pc_comm_failed(void *comm_handle, int *ranks, int max, int *n);
/* The peers whose receives in the current execution (a collective: its armed round,
 * *round) are still in flight: the ranks not heard from, which a timeout names. */
int pc_sched_silent(pc_sched *s, int *ranks, int max, int *n);
int pc_coll_silent(pc_coll *c, int *ranks, int max, int64_t *round, int *n);
/* Asynchronous averaging through a server rank (avg.c). On the server: create, then one
 * schedule per client rank (RECV push into slot WORK -> DELIVER -> SEND slot MASK); the
 * engine serves and re-arms them. Push: [int64 key][int64 0][data]; reply: [int64 keys]
 * [int64 pushes][the mean of every key's latest data]. */
int pc_avg_create(int dtype, int64_t count, int size, pc_avg **out);
int pc_avg_serve(pc_avg *a, void *comm_handle, int client, int nops, const pc_opspec *ops, int nedges,
                 const int *edges, int pairs);
int pc_avg_push_local(pc_avg *a, const void *push, void *reply);   /* the server's own push */
int pc_avg_state(pc_avg *a, int64_t *keys, int64_t *pushes);
int pc_avg_free(pc_avg *a, double timeout_s, int *deferred);   /* close(): withdraws, waits */
int pc_avg_abandon(pc_avg *a, int *deferred);   /* dropped: no MPI call, the next pass withdraws */
/* Hop's neighbour allreduce (hop.c, partialcoll/neighbor.py): channels on one
 * communicator, backup workers (need = n_in - backup of the in-neighbours), the local
 * staleness bound s, token queues (max_gap g, 0: none), depth R >= 1 + s + max(g, 1)
 * slots per in-neighbour; up to R iterations outstanding. */
typedef struct pc_hop pc_hop;
enum { PC_HOP_WEIGHTS_NONE = 0, PC_HOP_MEAN = 1, PC_HOP_STALENESS = 2 };
enum { PC_HOP_RECEIVED = 0, PC_HOP_USED = 1, PC_HOP_DROPPED = 2, PC_HOP_SKIP_UPDATES = 3, PC_HOP_MAX_BUFFERED = 4,
       PC_HOP_BUFFERS = 5, PC_HOP_SKIPPED = 6, PC_HOP_COMPLETED = 7,
       PC_HOP_EARLY = 8,      /* iterations the engine completed before the application asked */
       PC_HOP_STATS = 9 };
typedef struct pc_hopspec {
    int n_in, n_out;
    const int *sources, *destinations;   /* ranks in the communicator, ascending, no self */
    int backup, max_staleness, max_gap, depth;
    int weights;         /* PC_HOP_* */
    int dtype, redop;
    int64_t count;
    uint64_t ident;      /* the collective's identity in its peer-error reports (as pc_collspec's) */
} pc_hopspec;
int pc_hop_create(const pc_hopspec *spec, void *comm_handle, pc_hop **out);
/* enter the next iteration with update x; its result goes to out (the engine's until
 * pc_hop_wait returns it); entry: the iteration, when it was entered (ns, CLOCK_MONOTONIC),
 * tokens to spare after it (-1: no tokens); skip: one such triple per iteration skipped */
int pc_hop_post(pc_hop *h, const void *x, void *out, double timeout_s, int64_t *entry);
int pc_hop_skip(pc_hop *h, int64_t iterations, double timeout_s, int64_t *skipped, int64_t *entries);
/* iteration k's result: updates (rank, iteration, arrival ns) x info[0]; info: that count,
 * when it completed, whether before this wait asked, when it was entered (ns) */
int pc_hop_wait(pc_hop *h, int64_t k, double timeout_s, int64_t *updates, int64_t *info);
int pc_hop_state(pc_hop *h, int64_t *stats, int64_t *tokens, int64_t *granted, int64_t *newest, int64_t *pos);
int pc_hop_close_begin(pc_hop *h, int64_t *last);
int pc_hop_freeze(pc_hop *h, const int64_t *last, int64_t *posted);
int pc_hop_drain(pc_hop *h, const int64_t *every, double timeout_s);
int pc_hop_serve(pc_hop *h, double seconds);
int pc_hop_free(pc_hop *h, int *deferred);
/* peer errors, as pc_coll_abort and pc_coll_peer_error: this rank's report to every peer
 * (their pending and later calls fail with PC_ERR_PEER), and the report heard */
int pc_hop_abort(pc_hop *h, const char *type, const char *message, double timeout_s);
int pc_hop_peer_error(pc_hop *h, int *rank, char *type, int tlen, char *message, int mlen);
/* on_failure="shrink" (neighbor.py): after the collective failed, iteration k's result
 * where it completed here before the failure (*done 1; updates and info as pc_hop_wait
 * gives them), else *done 0 */
int pc_hop_salvage(pc_hop *h, int64_t k, int64_t *updates, int64_t *info, int *done);
/* Who is slow (telemetry.c, docs/who-is-slow.md): keep a ring of the last cap rounds
 * (0: off, the default); read the totals (PC_TELE_TOTALS doubles), the rounds each rank
 * missed (P) and the ring (*n records of PC_TELE_FIELDS doubles, oldest first, at most max) */
enum { PC_TELE_TOTALS = 8, PC_TELE_FIELDS = 7 };
int pc_coll_telemetry_on(pc_coll *c, int cap);
int pc_coll_telemetry(pc_coll *c, double *totals, int64_t *missed, double *ring, int max, int *n);
/* A reference for threads inside calls on h: Python's _free, dropping h while another
 * of its threads may be between reading the handle and its call, holds one for them, and
 * the last of them releases it (every pc_hop_* call pins h for its length). */
int pc_hop_hold(pc_hop *h);
int pc_hop_release(pc_hop *h);
/* CDEF END */

#endif
