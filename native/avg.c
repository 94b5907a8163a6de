/* avg.c -- asynchronous averaging through a server rank (RNA's parameter server).
 *
 * The server holds one persistent schedule per client rank c (c = the server too, when
 * it pushes), built in Python (partialcoll/averager.py) from the schedule vocabulary:
 *
 *   0  RECV    in  <- rank c      push:  [int64 key][int64 0][data]
 *   1  DELIVER     after 0        avg_deliver: latest[key] = data; out = mean(latest[*])
 *   2  SEND    out -> rank c      reply: [int64 keys][int64 pushes][mean]   after 1
 *
 * and re-arms it (version + 1) when an execution completes (the server's own pushes
 * fold on its calling thread: pc_avg_push_local), so the progress thread serves
 * pushes with no Python call: a push from c only ever waits for c's own schedule, never
 * for another client's. The client runs the mirror image (send the push, receive the
 * reply) as a plain schedule on the same communicator; the k-th push of c matches the
 * k-th execution of the server's schedule for c (the same version in the tag).
 *
 * Calls go one way: avg.c -> sched.c (sched_create, sched_begin, sched_withdraw) and
 * kernels.c (pc_mean_local); nothing calls avg.c but the application (pc_avg_*) and the
 * owner callbacks it registers on its own schedules.
 *
 * Threads and locks: each client is a unit (its lock guards its schedule, in, out and
 * stopped; held by the progress pass that steps it, or by pc_avg_stop). The key table
 * (pc_avg.lock) is shared by the clients: held for one fold and one mean, inside a
 * client's unit lock (order: client unit lock -> pc_avg.lock), never across a wait.
 */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HDR 16                   /* bytes of a push's or a reply's header */

typedef struct avg_client {
    pc_owner owner;              /* first member: its unit */
    struct pc_avg *avg;
    int client;                  /* the rank this schedule serves */
    void *in, *out;              /* (unit) the push received, the reply sent */
    pc_sched *sched;             /* (unit) */
    int stopped;                 /* (unit) no re-arm after this */
} avg_client;

struct pc_avg {
    pthread_mutex_t lock;        /* guards the fields below up to clients */
    int dtype;
    int64_t count;
    size_t nbytes;
    int nkeys, cap;
    int64_t *keys;               /* in the order of their first push */
    void **latest;               /* latest[i]: the vector last pushed under keys[i] */
    int64_t pushes;              /* served so far */
    int err;                     /* the first failure of a client's schedule */
    char errmsg[384];
    int refs;                    /* (atomic) live clients + the application's handle */
    int size;
    avg_client **clients;        /* [size], NULL where not served (written by pc_avg_serve) */
};

static void avg_unref(pc_avg *a)
{
    if (__atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
    for (int i = 0; i < a->nkeys; i++) free(a->latest[i]);
    free(a->keys); free(a->latest); free(a->clients);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* Fold a push (in: header + data) into the table and write the reply (out: header +
 * the mean). Takes the table lock: a progress pass (DELIVER) or the server's own push. */
static int avg_fold(pc_avg *a, const void *in, void *out)
{
    int64_t key, hdr[2];
    memcpy(&key, in, sizeof key);
    pthread_mutex_lock(&a->lock);
    int i = 0;
    while (i < a->nkeys && a->keys[i] != key) i++;
    if (i == a->nkeys) {                 /* a new key */
        if (a->nkeys == a->cap) {
            int cap = 2 * a->cap + 4;
            int64_t *keys = realloc(a->keys, sizeof *keys * (size_t)cap);
            if (keys) a->keys = keys;
            void **latest = keys ? realloc(a->latest, sizeof *latest * (size_t)cap) : NULL;
            if (latest) a->latest = latest;
            if (!keys || !latest) { pthread_mutex_unlock(&a->lock); return fail(PC_ERR_NOMEM, "out of memory"); }
            a->cap = cap;
        }
        void *v = malloc(a->nbytes ? a->nbytes : 1);
        if (!v) { pthread_mutex_unlock(&a->lock); return fail(PC_ERR_NOMEM, "out of memory"); }
        a->keys[i] = key;
        a->latest[i] = v;
        a->nkeys++;
    }
    memcpy(a->latest[i], (const char *)in + HDR, a->nbytes);
    a->pushes++;
    hdr[0] = a->nkeys;
    hdr[1] = a->pushes;
    int rc = pc_mean_local(a->dtype, (const void *const *)a->latest, a->nkeys, (char *)out + HDR, a->count);
    pthread_mutex_unlock(&a->lock);
    memcpy(out, hdr, sizeof hdr);
    return rc;
}

/* [pass] DELIVER of client cl's schedule: fold the push received, make the reply. */
static int avg_deliver(pc_owner *o)
{
    avg_client *cl = (avg_client *)o;
    return avg_fold(cl->avg, cl->in, cl->out);
}

/* The server's own push: folded on the calling thread, no message (MPI's path from a
 * rank to itself copies large messages slowly). */
int pc_avg_push_local(pc_avg *a, const void *push, void *reply)
{
    return avg_fold(a, push, reply);
}

static int avg_take(pc_owner *o) { (void)o; return fail(PC_ERR_STATE, "an averager's schedule has no TAKE"); }

/* [pass] An execution completed: serve the next push. */
static void avg_done(pc_owner *o, pc_sched *s)
{
    (void)s;
    avg_client *cl = (avg_client *)o;
    if (cl->stopped) return;
    pc_avg *a = cl->avg;
    int rc = sched_begin(cl->sched, cl->sched->version + 1);
    cl->sched->live = 1;                 /* a push moves data from its first byte (idle policy) */
    if (rc) {
        pthread_mutex_lock(&a->lock);
        if (!a->err) { a->err = rc; snprintf(a->errmsg, sizeof a->errmsg, "%s", pc_last_error()); }
        pthread_mutex_unlock(&a->lock);
    }
}

static void avg_failed(pc_owner *o, int code, int peer, const char *msg)
{
    (void)peer;
    pc_avg *a = ((avg_client *)o)->avg;
    pthread_mutex_lock(&a->lock);
    if (!a->err) { a->err = code; snprintf(a->errmsg, sizeof a->errmsg, "%s", msg); }
    pthread_mutex_unlock(&a->lock);
}

static void avg_client_destroy(pc_unit *u)
{
    avg_client *cl = (avg_client *)u;
    int leaked = u->leaked;              /* MPI may still touch in and out: kept */
    if (cl->sched) sched_destroy(cl->sched);
    if (!leaked) { free(cl->in); free(cl->out); }
    pthread_mutex_destroy(&u->lock);
    pc_avg *a = cl->avg;
    free(cl);
    avg_unref(a);
}

static void avg_client_abandon(pc_unit *u)
{
    avg_client *cl = (avg_client *)u;
    cl->stopped = 1;
    if (cl->sched) sched_withdraw(cl->sched);
}

int pc_avg_create(int dtype, int64_t count, int size, pc_avg **out)
{
    if (dtype < 0 || dtype >= PC_DT_COUNT || dtype == PC_DT_BOOL)
        return fail(PC_ERR_DTYPE_OP, "an average is not defined for dtype %d", dtype);
    if (count < 0 || size < 1) return fail(PC_ERR_ARG, "count %lld, size %d", (long long)count, size);
    if (count > (INT64_MAX / 4) / (int64_t)pc_dt_size[dtype])
        return fail(PC_ERR_NOMEM, "an average of %lld elements is too large", (long long)count);
    pc_avg *a = calloc(1, sizeof *a);
    if (!a || !(a->clients = calloc((size_t)size, sizeof *a->clients))) {
        free(a);
        return fail(PC_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&a->lock, NULL);
    a->dtype = dtype;
    a->count = count;
    a->nbytes = (size_t)count * pc_dt_size[dtype];
    a->size = size;
    a->refs = 1;
    *out = a;
    return PC_OK;
}

/* The server's schedule for `client` (any rank but the server) (ops built in Python: slot WORK is the push
 * received, slot MASK the reply), created on comm and begun (version 0). */
int pc_avg_serve(pc_avg *a, void *comm_handle, int client, int nops, const pc_opspec *ops, int nedges,
                 const int *edges, int pairs)
{
    if (client < 0 || client >= a->size || a->clients[client])
        return fail(PC_ERR_ARG, "client %d out of range or served already", client);
    if (!LOAD(E.started)) return fail(PC_ERR_STATE, "the engine is not running");
    avg_client *cl = calloc(1, sizeof *cl);
    if (!cl) return fail(PC_ERR_NOMEM, "out of memory");
    unit_init(&cl->owner.unit, avg_client_destroy, avg_client_abandon);
    cl->avg = a;
    cl->client = client;
    cl->in = calloc(1, HDR + a->nbytes);
    cl->out = calloc(1, HDR + a->nbytes);
    __atomic_add_fetch(&a->refs, 1, __ATOMIC_ACQ_REL);
    if (!cl->in || !cl->out) { avg_client_destroy(&cl->owner.unit); return fail(PC_ERR_NOMEM, "out of memory"); }
    cl->owner.slot[PC_SLOT_WORK] = &cl->in;
    cl->owner.slot_bytes[PC_SLOT_WORK] = HDR + (int64_t)a->nbytes;
    cl->owner.slot[PC_SLOT_MASK] = &cl->out;
    cl->owner.slot_bytes[PC_SLOT_MASK] = HDR + (int64_t)a->nbytes;
    cl->owner.take = avg_take;
    cl->owner.deliver = avg_deliver;
    cl->owner.done = avg_done;
    cl->owner.failed = avg_failed;
    int rc = sched_create(comm_handle, nops, ops, nedges, edges, &cl->owner, 0, pairs, &cl->sched);
    if (rc) { avg_client_destroy(&cl->owner.unit); return rc; }
    a->clients[client] = cl;
    unit_lock(&cl->owner.unit);
    rc = sched_begin(cl->sched, 0);
    cl->sched->live = 1;
    unit_unlock(&cl->owner.unit);
    return rc;
}

/* keys and pushes so far; the first failure of a client's schedule, as an error code */
int pc_avg_state(pc_avg *a, int64_t *keys, int64_t *pushes)
{
    pthread_mutex_lock(&a->lock);
    *keys = a->nkeys;
    *pushes = a->pushes;
    int rc = a->err ? fail(a->err, "%s", a->errmsg) : PC_OK;
    pthread_mutex_unlock(&a->lock);
    return rc;
}

static int avg_idle(void *p)
{
    pc_avg *a = p;
    for (int c = 0; c < a->size; c++)
        if (a->clients[c] && LOAD(a->clients[c]->owner.unit.nrunning) > 0) return 0;
    return 1;
}

/* Dropped without close() (the garbage collector's thread, or a with block left by an
 * exception): no MPI call and no wait here. Each client stops re-arming; its running
 * execution (the receive it keeps posted) is withdrawn by the next progress pass
 * (pc_unit.withdraw -> avg_client_abandon: MPI_Cancel there, never here), and the engine
 * frees each client once it no longer runs, the key table with the last of them.
 * *deferred = 1: an execution still ran, so MPI may still use the communicator. */
int pc_avg_abandon(pc_avg *a, int *deferred)
{
    *deferred = 0;
    if (!a) return PC_OK;
    for (int c = 0; c < a->size; c++) {
        avg_client *cl = a->clients[c];
        if (!cl) continue;
        pc_unit *u = &cl->owner.unit;
        unit_lock(u);
        cl->stopped = 1;
        if (cl->sched->running) { u->withdraw = 1; *deferred = 1; }
        unit_doom(u);                    /* freed by whoever lets go of it last */
        unit_unlock(u);
    }
    avg_unref(a);                        /* the handle's reference: the clients hold theirs */
    reap_units();
    if (*deferred) kick();
    return PC_OK;
}

/* Stop serving: withdraw every client's schedule (its posted receive is cancelled; a
 * reply in flight completes), wait up to timeout_s for them to drain, then free (now, or
 * once drained: *deferred = 1). Every client must have had its last reply. */
int pc_avg_free(pc_avg *a, double timeout_s, int *deferred)
{
    *deferred = 0;
    if (!a) return PC_OK;
    for (int c = 0; c < a->size; c++) {
        avg_client *cl = a->clients[c];
        if (!cl) continue;
        unit_lock(&cl->owner.unit);
        cl->stopped = 1;
        if (cl->sched->running) sched_withdraw(cl->sched);
        unit_unlock(&cl->owner.unit);
    }
    kick();
    wait_until(avg_idle, a, timeout_s);
    *deferred = !avg_idle(a);
    for (int c = 0; c < a->size; c++)
        if (a->clients[c]) unit_doom(&a->clients[c]->owner.unit);
    avg_unref(a);                        /* the handle's reference: the clients hold theirs */
    reap_units();
    return PC_OK;
}
