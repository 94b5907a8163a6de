/* idle.c -- the idle policy: how many CPUs this job may use, whether the node's ranks
 * are interfered with, and how long polling may go on.
 *
 * CPU budget (pc_cpu_budget, computed once): the CPUs of this process's affinity mask,
 * capped by its cgroup's CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cfs_period_us,
 * the smallest along the path to the root). Python, the tests and pc.info() use this
 * one number.
 *
 * Auto (poll_armed 2) polls while a round is armed only where
 *   1. the node has a CPU for each rank's application thread and one for its progress
 *      thread (2 x ranks <= CPUs: pc_engine_set_node, from the shared-memory
 *      communicator's ranks and their budgets), and
 *   2. no rank of the node sees interference in its own signals: the run delay of its
 *      threads (/proc/thread-self/schedstat: time runnable but not running), the cgroup's
 *      throttling, the steal time of a VM. Each rank publishes what it saw into a shared
 *      memory segment of the node (a word per rank, written and read without any MPI call)
 *      and every rank reads all of them, so the node decides as one.
 * Interference makes the node sleep for a hold time (1 s, doubling up to 16 s while the
 * interference comes back each time auto tries polling again; back to 1 s after 30 s of
 * polling without it). Polling itself is bounded: at most idle_spin_bound_us() after the
 * last event (a few times the recent short idle periods, within [spin_us, poll_max_us];
 * spin_us where most idle periods are long); then the sleep policy takes over,
 * which blocks on the engine's condition variables.
 */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <fcntl.h>
#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static struct {
    pthread_mutex_t mtx;         /* one sampler at a time; guards the fields below but spin */
    int budget, quota, affinity;
    char cgroup_dir[512];        /* the cgroup whose cpu.stat counts throttling */
    int cgroup_v2;
    int node_ranks, node_cpus, node_known, local_rank;
    volatile int64_t *slots;     /* the node's segment: per local rank, (ms << 1) | interfered */
    int spin;                    /* (atomic) auto's decision: poll while armed */
    int static_ok;               /* (atomic) the node has 2 CPUs per rank */
    unsigned nsamples;
    double steal_t;
    int64_t steal_ticks;
    double next_us, hold_until_us, hold_us, clean_since_us;
    double gap_ewma_us;          /* short idle periods, and the share of long ones: */
    double long_share;           /* (atomic, relaxed: ld/st below) */
    double busy_gap_us;          /* idle periods while a large message was in flight ... */
    int busy_seen;               /* ... and whether any was seen (atomic, relaxed: written by
                                  * whichever thread completes messages, without mtx; two
                                  * updates at once may lose one sample of an average) */
    double run_delay, steal;
    int64_t throttled;
    char reason[160];
} I = {.mtx = PTHREAD_MUTEX_INITIALIZER, .hold_us = 0.5e6};

/* ------------------------------------------------------------------ the budget */
static int read_line(const char *path, char *buf, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, len - 1);
    close(fd);
    if (n < 0) n = 0;
    buf[n] = 0;
    return (int)n;
}

/* The quota (in whole CPUs, at least 1; 0: none) of cgroup dir and its ancestors under root. */
static int quota_along(const char *root, const char *path, int v2, char *own_dir, size_t own_len)
{
    char dir[512], buf[128], p[512];
    int best = 0;
    snprintf(p, sizeof p, "%s", path);
    snprintf(own_dir, own_len, "%s%s", root, strcmp(path, "/") ? path : "");
    for (;;) {
        snprintf(dir, sizeof dir, "%s%s", root, strcmp(p, "/") ? p : "");
        long long quota = -1, period = 0;
        if (v2) {
            char f[600];
            snprintf(f, sizeof f, "%s/cpu.max", dir);
            if (read_line(f, buf, sizeof buf) > 0 && strncmp(buf, "max", 3) != 0)
                sscanf(buf, "%lld %lld", &quota, &period);
        } else {
            char f[600];
            snprintf(f, sizeof f, "%s/cpu.cfs_quota_us", dir);
            if (read_line(f, buf, sizeof buf) > 0) quota = atoll(buf);
            snprintf(f, sizeof f, "%s/cpu.cfs_period_us", dir);
            if (read_line(f, buf, sizeof buf) > 0) period = atoll(buf);
        }
        if (quota > 0 && period > 0) {
            int cpus = (int)(quota / period);
            if (cpus < 1) cpus = 1;
            if (best == 0 || cpus < best) best = cpus;
        }
        if (!strcmp(p, "/") || !p[0]) break;
        char *slash = strrchr(p, '/');
        if (!slash) break;
        if (slash == p) p[1] = 0; else *slash = 0;
    }
    return best;
}

static void budget_init(void)
{
    cpu_set_t *set = NULL;
    int n = 0;
    for (int ncpu = 1024; ncpu <= 1 << 16 && n == 0; ncpu *= 4) {
        size_t sz = CPU_ALLOC_SIZE(ncpu);
        set = CPU_ALLOC(ncpu);
        if (!set) break;
        CPU_ZERO_S(sz, set);
        if (sched_getaffinity(0, sz, set) == 0) n = CPU_COUNT_S(sz, set);
        CPU_FREE(set);
    }
    if (n < 1) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    I.affinity = n;
    /* /proc/self/cgroup: "0::/path" (v2) or "N:cpu,cpuacct:/path" (v1) */
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c2 = 0;
        const char *ctrl = c1 + 1, *path = c2 + 1;
        int v1cpu = 0;
        for (const char *t = ctrl; *t;) {          /* "cpu" among the comma-separated controllers */
            size_t len = strcspn(t, ",");
            if (len == 3 && !strncmp(t, "cpu", 3)) v1cpu = 1;
            t += len + (t[len] == ',');
        }
        int q = 0;
        char own[512];
        if (v1cpu) {
            const char *roots[] = {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpuacct,cpu"};
            for (int r = 0; r < 3 && !q; r++) {
                char probe[600];
                snprintf(probe, sizeof probe, "%s/cpu.cfs_period_us", roots[r]);
                if (access(probe, R_OK) != 0) continue;
                q = quota_along(roots[r], path, 0, own, sizeof own);
                snprintf(I.cgroup_dir, sizeof I.cgroup_dir, "%s", own);
                I.cgroup_v2 = 0;
            }
        } else if (!ctrl[0] && !I.cgroup_dir[0]) {
            if (access("/sys/fs/cgroup/cgroup.controllers", R_OK) == 0) {
                q = quota_along("/sys/fs/cgroup", path, 1, own, sizeof own);
                snprintf(I.cgroup_dir, sizeof I.cgroup_dir, "%s", own);
                I.cgroup_v2 = 1;
            }
        }
        if (q > 0 && (I.quota == 0 || q < I.quota)) I.quota = q;
    }
    if (f) fclose(f);
    I.budget = I.quota > 0 && I.quota < n ? I.quota : n;
}

int pc_cpu_budget(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, budget_init);
    return I.budget;
}

int pc_cpu_limits(int *affinity, int *quota, char *cgroup, int len)
{
    pc_cpu_budget();
    *affinity = I.affinity;
    *quota = I.quota;
    if (cgroup && len > 0) snprintf(cgroup, (size_t)len, "%s", I.cgroup_dir);
    return PC_OK;
}

/* ------------------------------------------------------------------ the node */
static void decide_static(void)
{
    int ok = I.node_ranks > 0 && 2 * I.node_ranks <= I.node_cpus;
    if (I.node_ranks <= 0)
        snprintf(I.reason, sizeof I.reason, "sleep: the ranks on this node are not known yet");
    else if (!ok)
        snprintf(I.reason, sizeof I.reason, "sleep: %d ranks on this node need %d CPUs (an application and a "
                 "progress thread each), the node's ranks may use %d", I.node_ranks, 2 * I.node_ranks, I.node_cpus);
    else
        snprintf(I.reason, sizeof I.reason, "spin: %d ranks on this node, %d CPUs, no interference seen",
                 I.node_ranks, I.node_cpus);
    if (ok && !LOAD(I.spin)) I.clean_since_us = now_us();
    STORE(I.static_ok, ok);
    STORE(I.spin, ok);
}

/* the node as pc_engine_set_node (progress.c) passes it on */
int idle_set_node(void *shared, int local_rank, int local_size, int node_cpus)
{
    if (local_size < 0 || node_cpus < 0 || (shared && (local_rank < 0 || local_rank >= local_size)))
        return fail(PC_ERR_ARG, "bad node: rank %d of %d, %d CPUs", local_rank, local_size, node_cpus);
    pc_cpu_budget();
    pthread_mutex_lock(&I.mtx);
    if (shared || !I.node_known) {
        I.node_ranks = local_size;
        I.node_cpus = node_cpus;
        I.local_rank = local_rank;
        I.slots = shared;
        I.node_known = shared != NULL;
        I.hold_until_us = 0;
        decide_static();
    }
    pthread_mutex_unlock(&I.mtx);
    return PC_OK;
}

/* Has each rank of the node a CPU for its application thread, and does auto see no
 * interference (where it looks: a node with two CPUs per rank)? Then a thread in wait()
 * may yield its core for a while before it sleeps: no rank computes on that core. The
 * node is the shared-memory communicator's (auto) or else the launcher's count of ranks
 * against this rank's own budget (spin, sleep): a lower bound of the node's CPUs. */
int idle_core_each(void)
{
    int ranks = LOAD(I.node_ranks);
    return ranks > 0 && ranks <= LOAD(I.node_cpus) && !(LOAD(I.static_ok) && !LOAD(I.spin));
}

/* Does the policy poll, with a CPU for each rank's application and progress thread?
 * Then no thread of this node waits for the core a waiter polls on. */
int idle_spare(void)
{
    return idle_poll() && LOAD(I.static_ok);
}

/* ------------------------------------------------------------------ interference */
typedef struct { double t; int64_t run, wait, throttled; } sample;
static __thread sample prev;

static int64_t cgroup_throttled(void)
{
    if (!I.cgroup_dir[0]) return 0;
    char f[600], buf[1024];
    snprintf(f, sizeof f, "%s/cpu.stat", I.cgroup_dir);
    if (read_line(f, buf, sizeof buf) <= 0) return 0;
    const char *key = I.cgroup_v2 ? "throttled_usec " : "throttled_time ";
    char *p = strstr(buf, key);
    return p ? atoll(p + strlen(key)) : 0;
}

static int64_t steal_ticks(void)
{
    char buf[512];
    if (read_line("/proc/stat", buf, sizeof buf) <= 0) return 0;
    long long v[8] = {0};
    if (sscanf(buf, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
               &v[6], &v[7]) < 8) return 0;
    return v[7];
}

static void take_sample(sample *s)
{
    char buf[128];
    s->t = now_us();
    s->run = s->wait = 0;
    if (read_line("/proc/thread-self/schedstat", buf, sizeof buf) > 0) {
        long long a = 0, b = 0;
        sscanf(buf, "%lld %lld", &a, &b);
        s->run = a;
        s->wait = b;
    }
    s->throttled = I.quota > 0 ? cgroup_throttled() : 0;

}

/* ns this process's threads have spent runnable but not running so far (the second field
 * of each /proc/self/task/<tid>/schedstat): the CPU starvation of a rank whose CPU is
 * shared with busy processes, as the scheduler counts it. The balancer's rows carry it
 * (coll.c, TAKE): ~10 us a round for a few threads, only where owners are rebalanced. */
int64_t idle_run_delay_ns(int64_t *cpu)
{
    *cpu = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return 0;
    int64_t ns = 0;
    struct dirent *e;
    char path[64], buf[128];
    while ((e = readdir(d))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/self/task/%.20s/schedstat", e->d_name);
        long long run = 0, wait = 0;
        if (read_line(path, buf, sizeof buf) > 0 && sscanf(buf, "%lld %lld", &run, &wait) == 2) {
            ns += wait;
            *cpu += run;
        }
    }
    closedir(d);
    return ns;
}

/* Is the node interfered with (any rank's fresh word says so)? */
static int node_interfered(double now)
{
    if (!I.slots) return 0;
    int64_t ms = (int64_t)(now / 1000);
    for (int r = 0; r < I.node_ranks; r++) {
        int64_t w = __atomic_load_n(&I.slots[r], __ATOMIC_RELAXED);
        if ((w & 1) && ms - (w >> 1) < 2000) return 1;
    }
    return 0;
}

/* [progress thread, or an inline waiter] every 10 ms: this thread's signals since its
 * last sample; publish them to the node; decide auto's polling. */
void idle_sample(void)
{
    if (LOAD(E.policy.poll_armed) != 2 || !LOAD(I.static_ok)) return;    /* nothing to decide */
    double now = now_us();
    if (now < I.next_us || pthread_mutex_trylock(&I.mtx) != 0) return;
    I.next_us = now + (LOAD(I.spin) ? 10000 : 100000);    /* asleep: a sample per 100 ms */
    sample s;
    take_sample(&s);
    int decisive = 0;
    if (prev.t > 0 && s.t - prev.t < 1e6) {
        double run = (double)(s.run - prev.run), wait = (double)(s.wait - prev.wait);
        if ((++I.nsamples & 7) == 1) {                /* steal: /proc/stat is long, read it seldom */
            long hz = sysconf(_SC_CLK_TCK), ncpu = sysconf(_SC_NPROCESSORS_ONLN);
            int64_t ticks = steal_ticks();
            if (I.steal_t > 0 && hz > 0 && ncpu > 0 && now > I.steal_t)
                I.steal = (double)(ticks - I.steal_ticks) * 1e6 / hz / ((now - I.steal_t) * (double)ncpu);
            I.steal_ticks = ticks;
            I.steal_t = now;
        }
        double steal = I.steal;
        int64_t thr = s.throttled - prev.throttled;
        decisive = run + wait > 2e6 || thr > 0 || steal > 0.05;   /* else: accumulate */
        int interfered = (run + wait > 2e6 && wait > 0.10 * (run + wait)) || thr > 0 || steal > 0.05;
        if (run + wait > 2e6) I.run_delay = wait / (run + wait);
        I.throttled += thr > 0;
        if (decisive && I.slots)
            __atomic_store_n(&I.slots[I.local_rank], ((int64_t)(now / 1000) << 1) | interfered, __ATOMIC_RELAXED);
        int node_bad = interfered || node_interfered(now);
        int static_ok = I.node_ranks > 0 && 2 * I.node_ranks <= I.node_cpus;
        if (static_ok && node_bad && LOAD(I.spin)) {
            /* polling met interference: sleep for the hold, longer each time it comes back
             * soon after polling resumed, 1 s again after 30 s without it */
            I.hold_us = now - I.clean_since_us > 30e6 ? 1e6 : (I.hold_us * 2 > 16e6 ? 16e6 : I.hold_us * 2);
            I.hold_until_us = now + I.hold_us;
            snprintf(I.reason, sizeof I.reason, "sleep: interference on this node (run delay %.0f %%, "
                     "throttled %lld times, steal %.0f %%); polling again in %.1f s at the earliest",
                     100 * I.run_delay, (long long)I.throttled, 100 * I.steal, I.hold_us / 1e6);
            STORE(I.spin, 0);
        } else if (static_ok && !node_bad && !LOAD(I.spin) && now >= I.hold_until_us) {
            I.clean_since_us = now;
            snprintf(I.reason, sizeof I.reason, "spin: %d ranks on this node, %d CPUs, no interference seen",
                     I.node_ranks, I.node_cpus);
            STORE(I.spin, 1);
        }
    }
    if (prev.t == 0 || decisive || s.t - prev.t >= 1e6) prev = s;
    pthread_mutex_unlock(&I.mtx);
}

/* ------------------------------------------------------------------ polling */
int idle_poll(void)
{
    int p = LOAD(E.policy.poll_armed);
    return p == 2 ? LOAD(I.spin) : p;
}

/* How long polling may last at most (poll_max_us; 10 ms where it is not set). */
static double poll_max(void) { return E.policy.poll_max_us > 0 ? E.policy.poll_max_us : 1e4; }

/* Relaxed atomic loads and stores of the running averages (any thread, no lock) */
static double ld(double *p) { double v; __atomic_load(p, &v, __ATOMIC_RELAXED); return v; }
static void st(double *p, double v) { __atomic_store(p, &v, __ATOMIC_RELAXED); }

/* An event came us after the previous one. Only idle periods count: gaps shorter than
 * spin_us are the events of one burst (a post and the round it arms, a round's
 * messages), which say nothing about how long the engine will wait for the next one.
 * A short idle period (under poll_max_us / 2: one polling can catch) sets the scale of
 * polling; a long one (a late peer, a step that computes for tens of ms) only counts
 * towards the share of long ones. Averaging the long ones in, capped, made a few bursts
 * and one long pause average to 5 - 10 ms: polling then lasted poll_max_us after every
 * pause, a spin that ran out each time (2 % of a core for a rank that waits 2 s). */
void idle_note_gap(double us)
{
    if (us < E.policy.spin_us) return;
    if (us < poll_max() / 2) {
        st(&I.gap_ewma_us, 0.875 * ld(&I.gap_ewma_us) + 0.125 * us);
        st(&I.long_share, 0.875 * ld(&I.long_share));
    } else {
        st(&I.long_share, 0.875 * ld(&I.long_share) + 0.125);
    }
}

/* How long polling may go on after the last event: four times the typical short idle
 * period, within [spin_us, poll_max_us]; spin_us alone where idle periods are typically
 * long (half of them or more): polling would mostly run out before the next event. */
double idle_spin_bound_us(void)
{
    double b = 4 * ld(&I.gap_ewma_us), lo = E.policy.spin_us, hi = poll_max();
    if (ld(&I.long_share) >= 0.5) return lo;
    return b < lo ? lo : b > hi ? hi : b;
}

/* An event came us after the previous one while a message of busy_bytes or more was in
 * flight: the time one such transfer took to show progress (or a peer to start it). Only
 * periods under busy_cap_us / 2 count: a longer one is a wait for a late peer (nothing
 * moved: yielding through it only burns the core) or a transfer too long for yielding
 * to bridge anyway. */
void idle_note_busy_gap(double us)
{
    if (us < E.policy.spin_us || us >= E.policy.busy_cap_us / 2) return;
    st(&I.busy_gap_us, __atomic_load_n(&I.busy_seen, __ATOMIC_RELAXED) ? 0.875 * ld(&I.busy_gap_us) + 0.125 * us : us);
    __atomic_store_n(&I.busy_seen, 1, __ATOMIC_RELAXED);
}

/* How long the engine may go on yielding for a large message after the last event: four
 * times the typical period between the events of moving large transfers, at most
 * busy_cap_us (busy_cap_us itself until one was seen). A 1 MiB round's messages show
 * progress every few hundred us: a rank whose peer is late stops yielding after about a
 * millisecond instead of busy_cap_us (10 ms of a core for every late peer). */
double idle_busy_bound_us(void)
{
    double b = 4 * ld(&I.busy_gap_us), hi = E.policy.busy_cap_us;
    return !__atomic_load_n(&I.busy_seen, __ATOMIC_RELAXED) || b > hi ? hi : b;
}

int pc_idle_state(pc_idle_info *out)
{
    pc_cpu_budget();
    pthread_mutex_lock(&I.mtx);
    memset(out, 0, sizeof *out);
    out->setting = LOAD(E.policy.poll_armed);
    out->polling = idle_poll();
    out->cpu_budget = I.budget;
    out->node_ranks = I.node_ranks;
    out->node_cpus = I.node_cpus;
    out->node_known = I.node_known;
    out->hold_s = I.hold_until_us > now_us() ? (I.hold_until_us - now_us()) / 1e6 : 0;
    out->spin_bound_us = idle_spin_bound_us();
    out->busy_bound_us = idle_busy_bound_us();
    out->run_delay = I.run_delay;
    out->throttled = I.throttled;
    out->steal = I.steal;
    snprintf(out->reason, sizeof out->reason, "%s", out->setting == 2 ? I.reason
             : out->setting == 1 ? "spin: set by partialcoll.rc.idle" : "sleep: set by partialcoll.rc.idle");
    pthread_mutex_unlock(&I.mtx);
    return PC_OK;
}
