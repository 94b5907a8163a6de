/* mpi.c -- messages: the one place that talks to MPI (post, test, cancel, drain),
 * messages larger than one MPI count split in chunks, tag bits, communicator queries,
 * failed peers. It knows messages, not schedules: an op is an index, and errors are
 * return codes with a message (errors.c) for the caller to record.
 * Everything here runs under the calling unit's lock, except pc_comm_failed(). */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* MPIX_Query_cuda_support() of the loaded libmpi (MPICH >= 4, Open MPI), looked up at
 * run time so that the engine loads with any MPI: 1 CUDA-aware, 0 not, -1 no such query. */
int pc_mpi_cuda_support(void)
{
    int (*query)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support");
    return query ? (query() != 0) : -1;
}

/* MPIX_Comm_get_failed of the loaded libmpi (NULL where it has none): looked up in the
 * global scope, else in the library that defines MPI_Comm_rank. PARTIALCOLL_NO_FAILED_QUERY
 * (tests) hides it: the view of an MPI that cannot tell. */
typedef int (*get_failed_fn)(MPI_Comm, MPI_Group *);

static get_failed_fn lookup_get_failed(void)
{
    static int looked;
    static get_failed_fn fn;
    if (__atomic_load_n(&looked, __ATOMIC_ACQUIRE)) return fn;
    const char *hide = getenv("PARTIALCOLL_NO_FAILED_QUERY");
    void *sym = hide && *hide && *hide != '0' ? NULL : dlsym(RTLD_DEFAULT, "MPIX_Comm_get_failed");
    Dl_info where;
    if (!sym && !(hide && *hide && *hide != '0') && dladdr((void *)&MPI_Comm_rank, &where) && where.dli_fname) {
        void *h = dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) { sym = dlsym(h, "MPIX_Comm_get_failed"); dlclose(h); }
    }
    fn = (get_failed_fn)sym;
    __atomic_store_n(&looked, 1, __ATOMIC_RELEASE);
    return fn;
}

/* Runs without any lock (MPI_THREAD_MULTIPLE): it must answer while the progress thread
 * may be stuck inside an MPI call towards the dead peer. */
int pc_comm_failed(void *comm_handle, int *ranks, int max, int *n)
{
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    get_failed_fn get_failed = lookup_get_failed();
    *n = -1;
    if (!get_failed) return PC_OK;
    MPI_Group failed = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    int k = 0;
    if (get_failed(comm, &failed) == MPI_SUCCESS && MPI_Group_size(failed, &k) == MPI_SUCCESS) {
        int m = k < max ? k : max;
        int idx[m > 0 ? m : 1];
        for (int i = 0; i < m; i++) idx[i] = i;
        if (m == 0 || (MPI_Comm_group(comm, &all) == MPI_SUCCESS &&
                       MPI_Group_translate_ranks(failed, m, idx, all, ranks) == MPI_SUCCESS)) {
            *n = m;
            for (int i = 1; i < m; i++)          /* ascending (few ranks: insertion sort) */
                for (int j = i; j > 0 && ranks[j - 1] > ranks[j]; j--) { int t = ranks[j]; ranks[j] = ranks[j - 1]; ranks[j - 1] = t; }
        }
    }
    if (failed != MPI_GROUP_NULL) MPI_Group_free(&failed);
    if (all != MPI_GROUP_NULL) MPI_Group_free(&all);
    return PC_OK;
}

static void mpi_message(int rc, char *msg)
{
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, MPI_MAX_ERROR_STRING, "MPI error %d", rc);
}

int mpi_test_request(MPI_Request *req, MPI_Status *status)
{
    int flag = 0, rc = MPI_Test(req, &flag, status ? status : MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        mpi_message(rc, msg);
        fail(PC_ERR_MPI, "%s", msg);
        return -1;
    }
    return flag != 0;
}

/* Bytes per MPI message: MPI counts are int, so a message of more bytes travels in
 * chunks of at most INT_MAX. PARTIALCOLL_MAX_MESSAGE (tests) forces smaller chunks. */
int64_t mpi_max_chunk(void)
{
    static int64_t chunk;
    int64_t c = __atomic_load_n(&chunk, __ATOMIC_RELAXED);
    if (c) return c;
    const char *forced = getenv("PARTIALCOLL_MAX_MESSAGE");
    c = INT_MAX;
    if (forced && atoll(forced) >= 1 && atoll(forced) < c) c = atoll(forced);
    __atomic_store_n(&chunk, c, __ATOMIC_RELAXED);
    return c;
}

int mpi_init_msgs(pc_msgs *m, MPI_Comm comm, int nops, int64_t nreq)
{
    memset(m, 0, sizeof *m);
    m->comm = comm;
    if (mpi_comm_info(comm, &m->rank, &m->size)) return PC_ERR_MPI;
    m->max_chunk = mpi_max_chunk();
    if (nreq > INT_MAX / 2) return fail(PC_ERR_NOMEM, "a schedule of %lld messages is too large", (long long)nreq);
    m->cap = (int)nreq;
    size_t n = (size_t)nreq + 1, k = (size_t)nops + 1;
    m->reqs = calloc(n, sizeof(MPI_Request));
    m->req_op = calloc(n, sizeof(int));
    m->req_bytes = calloc(n, sizeof(int64_t));
    m->idx = calloc(n, sizeof(int));
    m->statuses = calloc(n, sizeof(MPI_Status));
    m->left = calloc(k, sizeof(int));
    m->done = calloc(k, sizeof(int));
    if (!m->reqs || !m->req_op || !m->req_bytes || !m->idx || !m->statuses || !m->left || !m->done)
        return fail(PC_ERR_NOMEM, "out of memory");
    return PC_OK;
}

void mpi_free_msgs(pc_msgs *m)
{
    free(m->reqs); free(m->req_op); free(m->req_bytes); free(m->idx); free(m->statuses);
    free(m->left); free(m->done); free(m->sent);
}

/* The version wraps at 2^vbits - 1, not 2^vbits: the version of all ones is never
 * used, so that the top tag, (2^(seqbits + vbits)) - 1, stays free for peer errors
 * (mpi_alarm_tag). */
int mpi_tag(const pc_msgs *m, int64_t version, int seq)
{
    int64_t v = version % ((1LL << m->vbits) - 1);
    return (int)((v << m->seqbits) | seq);
}

/* Post op's message: one MPI message per chunk, all with the op's tag. */
int mpi_post(pc_msgs *m, int op, int send, void *buf, int64_t nbytes, int peer, int tag, int64_t busy_bytes)
{
    if (send && !m->sent && !(m->sent = calloc((size_t)m->size, sizeof *m->sent)))
        return fail(PC_ERR_NOMEM, "out of memory for the traffic counters");
    int64_t off = 0;
    do {
        int64_t len = nbytes - off < m->max_chunk ? nbytes - off : m->max_chunk;
        if (m->n >= m->cap) return fail(PC_ERR_STATE, "op %d: more messages in flight than the schedule has", op);
        MPI_Request *r = &m->reqs[m->n];
        char *p = (char *)buf + off;
        int rc = send ? MPI_Isend(p, (int)len, MPI_BYTE, peer, tag, m->comm, r)
                      : MPI_Irecv(p, (int)len, MPI_BYTE, peer, tag, m->comm, r);
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            mpi_message(rc, msg);
            return fail(PC_ERR_MPI, "%s", msg);   /* chunks posted before stay listed: drained */
        }
        m->req_op[m->n] = op;
        m->req_bytes[m->n] = len;
        m->n++;
        m->left[op]++;
        off += len;
    } while (off < nbytes);
    if (nbytes >= busy_bytes) m->big++;
    if (send) m->sent[peer] += nbytes;
    return PC_OK;
}

/* Drop the completed (now MPI_REQUEST_NULL) requests. */
static void compact(pc_msgs *m)
{
    int w = 0;
    for (int r = 0; r < m->n; r++) {
        if (m->reqs[r] != MPI_REQUEST_NULL) {
            m->reqs[w] = m->reqs[r]; m->req_op[w] = m->req_op[r]; m->req_bytes[w] = m->req_bytes[r]; w++;
        }
    }
    m->n = w;
}

/* Test the requests; m->done[0..*ndone) are the ops whose messages all completed. The
 * list is compacted before any error is returned, so what stays listed is in flight.
 * An error names its op in *failed_op (the failed request's, as its status says). */
int mpi_test(pc_msgs *m, const int64_t *op_bytes, const int *is_recv, int *ndone, int *failed_op,
             int64_t busy_bytes)
{
    int outcount = 0, bad = -1;
    char msg[MPI_MAX_ERROR_STRING + 160];
    *ndone = 0;
    *failed_op = -1;
    if (m->n == 0) return PC_OK;
    /* Open MPI's MPI_Testsome looks for completed requests first and only then runs its
     * progress engine: what that progress completes is seen by the next call. So when
     * nothing was complete, test once more. MPICH's looks, progresses and looks again
     * within one call: a second call only polled its progress engine once more, for
     * every schedule with nothing complete in every pass. */
#ifdef OPEN_MPI
    enum { TESTS = 2 };
#else
    enum { TESTS = 1 };
#endif
    int rc = MPI_SUCCESS;
    for (int pass = 0; pass < TESTS && rc == MPI_SUCCESS && outcount == 0; pass++)
        rc = MPI_Testsome(m->n, m->reqs, &outcount, m->idx, m->statuses);
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {     /* no request to blame: the first */
        mpi_message(rc, msg);
        *failed_op = m->req_op[0];
        return fail(PC_ERR_MPI, "%s", msg);
    }
    if (outcount == MPI_UNDEFINED || outcount == 0) return PC_OK;
    int failed = -1, err = MPI_SUCCESS, first = m->req_op[m->idx[0]];
    for (int k = 0; k < outcount; k++) {
        int r = m->idx[k], op = m->req_op[r];
        if (rc == MPI_ERR_IN_STATUS && failed < 0 && m->statuses[k].MPI_ERROR != MPI_SUCCESS
            && m->statuses[k].MPI_ERROR != MPI_ERR_PENDING) {
            failed = op;
            err = m->statuses[k].MPI_ERROR;
        }
        if (is_recv[op] && bad < 0 && failed < 0) {     /* a receive: its size */
            int got = 0;
            if (MPI_Get_count(&m->statuses[k], MPI_BYTE, &got) != MPI_SUCCESS || got != m->req_bytes[r]) {
                snprintf(msg, sizeof msg, "expected %lld bytes, received %d", (long long)m->req_bytes[r], got);
                bad = op;
            }
        }
        if (--m->left[op] == 0) {
            if (op_bytes[op] >= busy_bytes) m->big--;
            m->done[(*ndone)++] = op;
        }
    }
    compact(m);
    if (rc == MPI_ERR_IN_STATUS) {
        mpi_message(failed >= 0 ? err : rc, msg);
        *failed_op = failed >= 0 ? failed : first;
        *ndone = 0;
        return fail(PC_ERR_MPI, "%s", msg);
    }
    if (bad >= 0) {
        *failed_op = bad;
        *ndone = 0;
        return fail(PC_ERR_TRUNCATE, "%s", msg);
    }
    return PC_OK;
}

/* Withdraw: cancel the receives (MPI_Cancel is defined for receives in every MPI;
 * cancelling sends is deprecated and a no-op in Open MPI, so sends are left to
 * complete). mpi_drain() then completes what is left. */
void mpi_cancel_recvs(pc_msgs *m, const int *is_recv)
{
    for (int r = 0; r < m->n; r++)
        if (is_recv[m->req_op[r]]) MPI_Cancel(&m->reqs[r]);
}

/* Test a withdrawn execution's requests; returns how many are still in flight. A
 * receive that was cancelled leaves its peer's message unmatched (m->cancelled). If the
 * MPI can no longer test a request, it is freed (MPI may still complete it) and
 * m->lost is set: the memory it may touch is never freed. */
int mpi_drain(pc_msgs *m)
{
    int outcount = 0;
    if (m->n == 0) return 0;
    int rc = MPI_Testsome(m->n, m->reqs, &outcount, m->idx, m->statuses);
    if (rc == MPI_SUCCESS || rc == MPI_ERR_IN_STATUS) {
        for (int k = 0; k < outcount && outcount != MPI_UNDEFINED; k++) {
            int flag = 0;
            if (MPI_Test_cancelled(&m->statuses[k], &flag) == MPI_SUCCESS && flag) m->cancelled = 1;
        }
        compact(m);
        return m->n;
    }
    /* the list as a whole cannot be tested: one request at a time */
    for (int r = 0; r < m->n; r++) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Test(&m->reqs[r], &flag, &st) != MPI_SUCCESS && m->reqs[r] != MPI_REQUEST_NULL) {
            MPI_Request_free(&m->reqs[r]);
            m->lost = 1;
        } else if (flag) {
            int c = 0;
            if (MPI_Test_cancelled(&st, &c) == MPI_SUCCESS && c) m->cancelled = 1;
        }
    }
    compact(m);
    return m->n;
}

/* Forget requests that will not complete (engine stop): MPI keeps them; their memory
 * is never freed. */
void mpi_forget(pc_msgs *m)
{
    for (int r = 0; r < m->n; r++) MPI_Request_free(&m->reqs[r]);
    if (m->n) m->lost = 1;
    m->n = 0;
}

int mpi_comm_info(MPI_Comm comm, int *rank, int *size)
{
    int rc = MPI_Comm_rank(comm, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, size);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        mpi_message(rc, msg);
        return fail(PC_ERR_MPI, "bad communicator: %s", msg);
    }
    return PC_OK;
}

/* The tag's bits, sized at commit: seq_needed messages between one pair of ranks take
 * the fewest bits that count them; every other bit of MPI_TAG_UB is the version's, so
 * executions wrap as late as the MPI allows. PARTIALCOLL_TAG_UB (tests) forces the view
 * of a smaller MPI_TAG_UB. At least 4 bits of version are left, else an error. */
static int tag_ub_bits(MPI_Comm comm, long long *tag_ub_out)
{
    int *ub = NULL, flag = 0;
    if (MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &flag) != MPI_SUCCESS) flag = 0;
    long long tag_ub = flag && ub ? *ub : 32767;     /* the least the standard guarantees */
    const char *forced = getenv("PARTIALCOLL_TAG_UB");
    if (forced && atoll(forced) >= 255 && atoll(forced) < tag_ub) tag_ub = atoll(forced);
    int bits = 0;
    while (bits < 31 && (1LL << (bits + 1)) - 1 <= tag_ub) bits++;
    *tag_ub_out = tag_ub;
    return bits;
}

int mpi_tag_bits(MPI_Comm comm, int seq_needed, int *seqbits, int *vbits)
{
    long long tag_ub;
    int bits = tag_ub_bits(comm, &tag_ub);
    int s = 0;
    while ((1LL << s) < seq_needed) s++;
    *seqbits = s;
    *vbits = bits - s;
    if (*vbits < 4)
        return fail(PC_ERR_ARG, "%d messages between one pair of ranks in one schedule leave %d bits of "
                    "MPI_TAG_UB (%lld) for the execution number (at least 4 needed)", seq_needed, *vbits, tag_ub);
    return PC_OK;
}

int pc_tag_bits(void *comm_handle, int seq_needed, int *seqbits, int *vbits)
{
    return mpi_tag_bits(*(MPI_Comm *)comm_handle, seq_needed, seqbits, vbits);
}

/* ------------------------------------------------------------------ peer errors */
/* A collective's alarm (coll.c; docs/faults.md, "A rank that fails"): a receive from
 * any rank with the reserved tag, posted while the collective is open, and this rank's
 * own report, sent to every peer. Every function runs under the owning unit's lock,
 * except mpi_alarm_free() (no MPI call: it may run where the collective is freed). */
static int mpi_alarm_tag(MPI_Comm comm)
{
    long long tag_ub;
    return (int)((1LL << tag_ub_bits(comm, &tag_ub)) - 1);    /* version all ones: never a round's */
}

static int alarm_post(pc_alarm *a)
{
    int rc = MPI_Irecv(a->in, PC_ALARM_BYTES, MPI_BYTE, MPI_ANY_SOURCE, a->tag, a->comm, &a->rx);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        mpi_message(rc, msg);
        return fail(PC_ERR_MPI, "posting the receive for peer errors: %s", msg);
    }
    a->listening = 1;
    return PC_OK;
}

int mpi_alarm_listen(pc_alarm *a, MPI_Comm comm, uint64_t ident)
{
    a->comm = comm;
    a->ident = ident;
    a->tag = mpi_alarm_tag(comm);
    if (mpi_comm_info(comm, &a->rank, &a->size)) return PC_ERR_MPI;
    if (!a->in && !(a->in = malloc(PC_ALARM_BYTES))) return fail(PC_ERR_NOMEM, "out of memory");
    return alarm_post(a);
}

/* A report about another collective is stale: a peer sent it on a communicator that
 * both sides have freed since, and MPI gave its context id to this collective's. It is
 * dropped (and counted: mpi_alarm_dropped) and the receive posted again (so stale reports
 * are drained, one per pass). */
static int64_t alarm_dropped;

int64_t mpi_alarm_dropped(void)
{
    return __atomic_load_n(&alarm_dropped, __ATOMIC_RELAXED);
}

int mpi_alarm_heard(pc_alarm *a)
{
    int flag = 0;
    if (!a->listening || MPI_Test(&a->rx, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) return 0;
    a->listening = 0;
    if (((const pc_alarm_msg *)(const void *)a->in)->ident == a->ident) return 1;
    __atomic_add_fetch(&alarm_dropped, 1, __ATOMIC_RELAXED);
    alarm_post(a);              /* if it fails, this collective hears no more reports */
    return 0;
}

/* Stop listening. The receive is completed, not cancelled: a message from this rank
 * to itself matches the receive, unless a peer's report got there first (it is then
 * dropped, as a cancel that came too late would drop it), and the message to itself is
 * then taken by a receive from this rank alone. Cancel stays the fallback where the
 * receive itself fails (ULFM fails an MPI_ANY_SOURCE receive when any process fails),
 * and mpi_alarm_cancel() where the communicator may be freed already (an abandoned
 * collective: Python frees its communicator at a later application call). */
static void cancel_receive(MPI_Request *r)
{
    MPI_Cancel(r);                       /* local for a receive: the wait below returns */
    MPI_Wait(r, MPI_STATUS_IGNORE);
}

void mpi_alarm_cancel(pc_alarm *a)
{
    if (!a->listening) return;
    a->listening = 0;
    cancel_receive(&a->rx);
}

void mpi_alarm_deaf(pc_alarm *a)
{
    if (!a->listening) return;
    a->listening = 0;
    static const pc_alarm_msg self = {.rank = -1};   /* static: MPI may read it after we return */
    pc_alarm_msg other;
    MPI_Request tx;
    MPI_Status st;
    if (MPI_Isend(&self, PC_ALARM_BYTES, MPI_BYTE, a->rank, a->tag, a->comm, &tx) != MPI_SUCCESS) {
        cancel_receive(&a->rx);
        return;
    }
    if (MPI_Wait(&a->rx, &st) == MPI_SUCCESS) {
        if (st.MPI_SOURCE != a->rank)              /* a report came first: take the message */
            MPI_Recv(&other, PC_ALARM_BYTES, MPI_BYTE, a->rank, a->tag, a->comm, MPI_STATUS_IGNORE);
        MPI_Wait(&tx, MPI_STATUS_IGNORE);
        return;
    }
    /* the receive failed: cancel it, and take the message to itself if it is still there */
    cancel_receive(&a->rx);
    MPI_Request rx2;
    int flag = 0;
    if (MPI_Irecv(&other, PC_ALARM_BYTES, MPI_BYTE, a->rank, a->tag, a->comm, &rx2) == MPI_SUCCESS) {
        for (int i = 0; i < 100 && !flag; i++) MPI_Test(&rx2, &flag, MPI_STATUS_IGNORE);
        if (!flag) cancel_receive(&rx2);
    }
    if (flag) MPI_Wait(&tx, MPI_STATUS_IGNORE);
    else MPI_Request_free(&tx);                    /* matched by the failed receive, or lost */
}

int mpi_alarm_send(pc_alarm *a, const pc_alarm_msg *msg)
{
    if (a->nsend) return PC_OK;
    if (!a->out && !(a->out = malloc(PC_ALARM_BYTES))) return fail(PC_ERR_NOMEM, "out of memory");
    if (!a->tx && !(a->tx = malloc(sizeof(MPI_Request) * (size_t)(a->size > 1 ? a->size : 1))))
        return fail(PC_ERR_NOMEM, "out of memory");
    memcpy(a->out, msg, PC_ALARM_BYTES);
    ((pc_alarm_msg *)(void *)a->out)->ident = a->ident;
    for (int r = 0; r < a->size; r++) {
        if (r == a->rank) continue;
        /* a peer that is gone may refuse: the others are told all the same */
        if (MPI_Isend(a->out, PC_ALARM_BYTES, MPI_BYTE, r, a->tag, a->comm, &a->tx[a->nsend]) == MPI_SUCCESS)
            a->nsend++;
    }
    return PC_OK;
}

int mpi_alarm_sent(pc_alarm *a)
{
    int flag = 0;
    if (a->nsend == 0) return 1;
    if (MPI_Testall(a->nsend, a->tx, &flag, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
        a->lost = 1;                     /* a send failed (a dead peer): never freed */
        a->nsend = 0;
        return 1;
    }
    if (flag) a->nsend = 0;
    return flag;
}

void mpi_alarm_free(pc_alarm *a)
{
    /* a receive still posted, or sends in flight: MPI may still write or read them */
    if (!a->listening) free(a->in);
    if (a->nsend == 0 && !a->lost) { free(a->out); free(a->tx); }
    memset(a, 0, sizeof *a);
}
