/* progress.c -- the engine: its lock, the progress thread, the idle policy, and the
 * waits of application threads (thread mode) or inline progress (inline mode). */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
#include <sched.h>
#include <string.h>
#include <time.h>

pc_engine_state E = {.lock = PTHREAD_MUTEX_INITIALIZER, .wmtx = PTHREAD_MUTEX_INITIALIZER,
                     .dmtx = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
                     .done = PTHREAD_COND_INITIALIZER};

double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

void abs_deadline(struct timespec *ts, double us)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)(us * 1e3);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

/* The time of the last event (a message completed, a post, a round armed), in us:
 * the idle policy counts from it, so waits that return to Python in slices and
 * wake-ups that bring no work do not restart its spinning. */
static void note_event(void)
{
    __atomic_store_n(&E.last_event_us, (int64_t)now_us(), __ATOMIC_RELAXED);
}

static int node_contended(void);

/* The idle policy "auto" chose to poll (poll_armed 2) because MPI sees a core for each of
 * this node's threads. But a "node" may share its cores with other ranks that MPI cannot
 * see (emulated hosts, containers, VMs on one machine): polling there takes the cores of
 * the ranks that must answer. So auto polls only while this machine has no more runnable
 * threads than cores, sampled every 10 ms; once it has, auto sleeps for a second before
 * it looks again (the sleepers then make the machine look idle, so no shorter hold). */
static int auto_poll_ok(void)
{
    static int64_t next_us;
    static int ok = 1;
    static __thread unsigned calls;        /* the clock on every 64th call only: a spin loop's */
    if ((++calls & 63) != 0) return __atomic_load_n(&ok, __ATOMIC_RELAXED);
    int64_t now = (int64_t)now_us();
    if (now < __atomic_load_n(&next_us, __ATOMIC_RELAXED)) return __atomic_load_n(&ok, __ATOMIC_RELAXED);
    int fine = !node_contended();
    __atomic_store_n(&ok, fine, __ATOMIC_RELAXED);
    __atomic_store_n(&next_us, now + (fine ? 10000 : 1000000), __ATOMIC_RELAXED);
    return fine;
}

/* The idle policy "spin" (1), or auto's spin while the machine has cores to spare (2);
 * pc_engine_set_poll may switch it while the engine runs. */
static int poll_armed(void)
{
    int p = __atomic_load_n(&E.policy.poll_armed, __ATOMIC_RELAXED);
    return p == 2 ? auto_poll_ok() : p;
}

/* New work: note the event and wake the poller. */
void kick(void)
{
    note_event();
    wake();
}

/* Wake the poller (the progress thread, or an inline waiter) without new work. */
void wake(void)
{
    pthread_mutex_lock(&E.wmtx);
    E.kicked = 1;
    pthread_cond_signal(&E.work);
    pthread_mutex_unlock(&E.wmtx);
}

/* The kick of a post or of a round armed (E.lock held): the caller will usually drive
 * progress itself in the wait() that follows, so a futex wake-up of the progress thread
 * (a few us, and a thread competing for the lock) is spent only where it is needed:
 *  - nothing to poll (engine_pollable: no message in flight, or a full round waiting for
 *    this rank's post; one process): no wake-up, only the event is noted;
 *  - the progress thread parked (asleep until kicked), or napping for longer than
 *    sleep_max_us, or inline progress (a waiter of another thread sleeps): wake it now;
 *  - the progress thread napping for at most sleep_max_us more (it naps while the
 *    application polls in wait(), and in its own short sleeps), or awake: it finds the
 *    kick when its nap ends; a wait() or test() in between progresses inline.
 * So a post the application never waits for reaches the progress thread within
 * sleep_max_us, and a parked thread at once. */
void kick_lazy(void)
{
    note_event();
    if (E.threaded && !(poll_armed() ? engine_in_flight() : engine_pollable())) return;
    wake_lazy();
}

/* The kick of a post that starts a round for others: wake the progress thread at once,
 * but only if it could do something (nothing to poll at P = 1). E.lock held. */
void kick_eager(void)
{
    note_event();
    if (E.threaded && !engine_in_flight()) return;
    wake();
}

void wake_lazy(void)
{
    pthread_mutex_lock(&E.wmtx);
    E.kicked = 1;
    if (!E.threaded || E.sleeping == SLEEP_PARKED
        || (E.sleeping == SLEEP_NAP && E.nap_until_us - now_us() > E.policy.sleep_max_us))
        pthread_cond_signal(&E.work);
    pthread_mutex_unlock(&E.wmtx);
}

int take_kick(void)
{
    pthread_mutex_lock(&E.wmtx);
    int k = E.kicked;
    E.kicked = 0;
    pthread_mutex_unlock(&E.wmtx);
    return k;
}

/* Set by the progress thread itself (E.thread may not be stored yet when it starts). */
static __thread int on_progress_thread;

/* Sleep until kicked or for us microseconds (us < 0: until kicked). No E.lock held.
 * The progress thread says how it sleeps (E.sleeping, E.nap_until_us: see wake_lazy). */
void sleep_for_kick(double us)
{
    int me = on_progress_thread;
    pthread_mutex_lock(&E.wmtx);
    if (!E.kicked && !__atomic_load_n(&E.stop, __ATOMIC_SEQ_CST)) {
        if (us < 0) {
            if (me) E.sleeping = SLEEP_PARKED;
            pthread_cond_wait(&E.work, &E.wmtx);
        } else {
            struct timespec ts;
            if (me) { E.sleeping = SLEEP_NAP; E.nap_until_us = now_us() + us; }
            abs_deadline(&ts, us);
            pthread_cond_timedwait(&E.work, &E.wmtx, &ts);
        }
        E.sleeping = SLEEP_AWAKE;
    }
    E.kicked = 0;            /* a kick ends one sleep */
    pthread_mutex_unlock(&E.wmtx);
}

void notify_done(void)
{
    pthread_mutex_lock(&E.dmtx);
    E.done_seq++;                 /* written under E.lock and dmtx: readable under either */
    pthread_cond_broadcast(&E.done);
    pthread_mutex_unlock(&E.dmtx);
}

/* Application threads take the lock through app_lock(): the progress thread sees
 * E.want > 0 and steps aside, so a post never waits behind a polling loop. */
void app_lock(void)
{
    __atomic_add_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&E.lock);
    __atomic_sub_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
}

void app_unlock(void) { pthread_mutex_unlock(&E.lock); }

/* app_lock(), giving up after `seconds` (< 0: never): PC_OK with E.lock held, or
 * PC_ERR_TIMEOUT with a message. The lock is held for microseconds at a time unless a
 * thread is stuck inside an MPI call (a peer died under some transports): a wait then
 * still returns to Python, which reports the failed or silent peers. */
int app_lock_within(double seconds)
{
    if (seconds < 0) { app_lock(); return PC_OK; }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(seconds * 1e9);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    __atomic_add_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
    int rc = pthread_mutex_timedlock(&E.lock, &ts);
    __atomic_sub_fetch(&E.want, 1, __ATOMIC_SEQ_CST);
    if (rc == 0) return PC_OK;
    return fail(PC_ERR_TIMEOUT, "the engine has been inside an MPI call for more than %.2f s "
                "(a peer may have died)", seconds);
}

void running_add(pc_sched *s)
{
    s->prev = NULL;
    s->next = E.running;
    if (E.running) E.running->prev = s;
    E.running = s;
}

void running_remove(pc_sched *s)
{
    if (s->prev) s->prev->next = s->next; else if (E.running == s) E.running = s->next;
    if (s->next) s->next->prev = s->prev;
    s->next = s->prev = NULL;
}

int engine_progress_locked(void)
{
    int progressed = 0;
    pc_sched *s = E.running;
    while (s) {
        pc_sched *next = s->next;   /* s may leave the list (and a new one join at the head) */
        int ndone = 0;
        if (s->draining) {
            progressed |= sched_drain(s) || !s->running;
            s = next;
            continue;
        }
        if (mpi_test(s, &ndone) == PC_OK && ndone > 0) {
            progressed = 1;
            note_event();
            /* copy first: completing ops may post (and test) new requests */
            memcpy(s->finished, s->done_idx, sizeof(int) * (size_t)ndone);
            for (int k = 0; k < ndone && !s->err; k++) op_complete(s, s->finished[k]);
            sched_check_done(s);
        }
        s = next;
    }
    if (E.doomed) reap_doomed();
    return progressed;
}

/* Is a large message moving? Only in a live execution (see pc_sched.live): the receives
 * a round pre-posts when it is armed wait for peers that may be computing for seconds. */
static int engine_busy(void)
{
    for (pc_sched *s = E.running; s; s = s->next)
        if (s->live && s->inflight_big > 0) return 1;
    return 0;
}

/* Does any running schedule need polling? One with no message in flight does not:
 * only a local event (a post, close) can move it, and those progress it themselves.
 * Nor does a full round waiting for this rank's own post: nothing it holds can complete
 * first, and the post kicks the engine. (The progress thread still polls such rounds
 * through its short spin and yield phases right after an event, so the next post of a
 * busy loop finds it awake: sleeping at once made an 8 B round 8 us slower, by a futex
 * wake-up per round.) */
/* Has any running schedule a message in flight (or a withdrawal to finish)? The spin
 * policy polls exactly then: while a round is armed with its first receives posted. */
int engine_in_flight(void)
{
    for (pc_sched *s = E.running; s; s = s->next)
        if (s->draining || s->nreq > 0) return 1;
    return 0;
}

int engine_pollable(void)
{
    for (pc_sched *s = E.running; s; s = s->next) {
        if (s->draining) return 1;
        if (s->nreq == 0) continue;
        if (!s->needs_trigger || !s->coll) return 1;
        if (s->trigger_op >= 0 && s->ops[s->trigger_op].state == ST_DONE) return 1;
    }
    return 0;
}

/* The adaptive idle policy, shared by the progress thread and inline waits:
 * spin, then yield, then sleep with a doubling, capped backoff. While a large message
 * moves (engine_busy) it keeps yielding instead of sleeping, since the transfer needs
 * polling, but only up to busy_cap_us after the last event: a peer that is late by
 * more than that is not worth a core. Past deep_after_us without events the sleep cap
 * grows to a tenth of the idle time (at most deep_sleep_us), so that a long-idle rank
 * costs almost no CPU while a wake-up adds at most ~10 % to how long it was idle.
 * A kick (a local post) ends a sleep at once. Called without E.lock. */
typedef struct { double idle_since, sleep_us; unsigned spins; int contended; } idle_state;

/* Is the node's CPU contended: more runnable threads than cores (the 4th field of
 * /proc/loadavg, this thread included)? Then the ranks are computing while their rounds
 * move, and polling a large message slows the computation more than it speeds the
 * transfer: the busy phase is skipped and the thread sleeps (backing off as usual) until
 * the next event. Without contention (the application threads wait, as in a benchmark
 * loop) the busy phase polls as before. Asked once per idle period; 0 where unknown. */
static int node_contended(void)
{
    static long cores = 0;
    if (cores == 0) cores = sysconf(_SC_NPROCESSORS_ONLN);
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    long running = 0;
    char *slash = strchr(buf, '/');
    if (!slash) return 0;
    char *p = slash;
    while (p > buf && p[-1] >= '0' && p[-1] <= '9') p--;
    running = strtol(p, NULL, 10);
    return cores > 0 && running > cores;
}

static void idle_reset(idle_state *st)
{
    st->idle_since = (double)__atomic_load_n(&E.last_event_us, __ATOMIC_RELAXED);
    st->sleep_us = E.policy.sleep_min_us;
    st->spins = 0;
    st->contended = -1;                   /* not asked yet */
}

static void idle_step(idle_state *st, int busy)
{
    if (poll_armed()) {                   /* cores to spare: poll (the caller checked that a
                                           * round is armed), only yielding to other threads */
        if ((++st->spins & 63) == 0) sched_yield();
        return;
    }
    /* read the clock on every 16th spin only: one read per spin was a fifth of a busy loop */
    if ((++st->spins & 15) != 0 && st->sleep_us == E.policy.sleep_min_us) return;
    double idle = now_us() - st->idle_since;
    if (idle < E.policy.spin_us) return;
    if (idle < E.policy.spin_us + E.policy.yield_us) {
        sched_yield();
        return;
    }
    if (busy && idle < E.policy.busy_cap_us && !st->contended) {
        if (st->contended < 0) st->contended = node_contended();
        if (!st->contended) {
            sched_yield();
            return;
        }
    }
    sleep_for_kick(st->sleep_us);
    double cap = E.policy.sleep_max_us;
    if (idle > E.policy.deep_after_us && idle / 10 > cap)
        cap = idle / 10 < E.policy.deep_sleep_us ? idle / 10 : E.policy.deep_sleep_us;
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
    on_progress_thread = 1;
    pthread_setname_np(pthread_self(), "pc-progress");    /* top -H, perf, /proc/PID/task */
    idle_state st;
    idle_reset(&st);
    for (;;) {
        progress_lock();
        if (E.stop) break;
        if (__atomic_load_n(&E.app_polling, __ATOMIC_SEQ_CST) > 0) {
            /* an application thread is polling in wait(): stay off its core (the spin
             * policy waits for it awake, so it takes over without a wake-up) */
            pthread_mutex_unlock(&E.lock);
            if (poll_armed()) sched_yield();
            else sleep_for_kick(E.policy.sleep_max_us);
            idle_reset(&st);
            continue;
        }
        int poll = poll_armed();
        int any = E.running != NULL, pollable = any && (poll ? engine_in_flight() : engine_pollable());
        int progressed = any && engine_progress_locked();
        int busy = any && engine_busy();
        pthread_mutex_unlock(&E.lock);
        if (!any || (!pollable && !progressed
                     && (poll || now_us() - st.idle_since > E.policy.spin_us + E.policy.yield_us))) {
            sleep_for_kick(-1);               /* nothing to poll: sleep until a post */
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
    __atomic_store_n(&E.stop, 1, __ATOMIC_SEQ_CST);
    app_unlock();
    kick();
    if (E.threaded) pthread_join(E.thread, NULL);
    app_lock();
    /* Withdraw what is still running: receives are cancelled, sends get up to a second
     * to complete (cancelling sends is no-op in Open MPI; freeing them while they read
     * a buffer would be wrong). What is still in flight then is forgotten, and the
     * memory it may touch is leaked on purpose, never freed. */
    for (pc_sched *s = E.running; s; s = s->next)
        sched_fail(s, -1, PC_ERR_STATE, "engine stopped (partialcoll.finalize) while running");
    double until = now_us() + 1e6;
    while (E.running && now_us() < until) engine_progress_locked();
    while (E.running) {
        pc_sched *s = E.running;
        mpi_forget(s);
        s->doomed = 0;                    /* may still be read by MPI: never freed */
        if (s->coll) s->coll->pinned = 1;
        sched_drain(s);
    }
    if (E.doomed) reap_doomed();
    E.started = 0;
    notify_done();
    app_unlock();
    return PC_OK;
}

/* The idle policy "auto" learns how many ranks share the node from the collectives'
 * communicators (partialcoll/_engine.py) and switches between polling and sleeping. */
int pc_engine_set_poll(int on)
{
    if (on < 0 || on > 2) return fail(PC_ERR_ARG, "poll_armed must be 0, 1 or 2, not %d", on);
    __atomic_store_n(&E.policy.poll_armed, on, __ATOMIC_RELAXED);
    wake();
    return PC_OK;
}

int pc_engine_threaded(void)
{
    app_lock();
    int t = E.started && E.threaded;
    app_unlock();
    return t;
}

/* Wait (E.lock held on entry and exit) until pred(arg) or the timeout.
 * Thread mode: poll pred briefly, then sleep on the done signal without E.lock.
 * Inline mode: this thread drives progress, under the adaptive idle policy. */
int wait_until(int (*pred)(void *), void *arg, double timeout_s)
{
    double deadline = timeout_s >= 0 ? now_us() + timeout_s * 1e6 : -1;
    idle_state st;
    idle_reset(&st);
    int polling = 0, rc = PC_OK;
    while (!pred(arg)) {
        if (!E.started) { rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)"); break; }
        double now = now_us();
        if (deadline >= 0 && now >= deadline) { rc = PC_ERR_TIMEOUT; break; }
        if (E.threaded && (poll_armed() || now - st.idle_since < E.policy.spin_us)) {
            /* spin phase: progress here, sparing the hand-off to the progress thread */
            if (!polling) { polling = 1; __atomic_add_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); }
            if (engine_progress_locked()) idle_reset(&st);
        } else if (E.threaded) {
            if (polling) { polling = 0; __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); wake(); }
            /* pred() reads engine state: only under E.lock. Sleep until the completion
             * count moves (notify_done) instead, so no completion between the unlock
             * and the sleep is missed. */
            int64_t seen = E.done_seq;
            pthread_mutex_unlock(&E.lock);
            {
                double slice = deadline >= 0 && deadline - now < 10000.0 ? deadline - now : 10000.0;
                struct timespec ts;
                abs_deadline(&ts, slice);
                pthread_mutex_lock(&E.dmtx);
                if (E.done_seq == seen) pthread_cond_timedwait(&E.done, &E.dmtx, &ts);
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
    /* the progress thread takes over: at once if it is parked, else when its nap ends */
    if (polling) { __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); wake_lazy(); }
    return rc;
}
