/* errors.c -- error codes and the per-thread message behind pc_last_error(). */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <stdarg.h>
#include <stdio.h>

static __thread char last_error[512];
static __thread int last_peer = -1;

/* Record a message for pc_last_error() (per thread) and return the code. */
int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    last_peer = -1;
    return code;
}

int fail_at(int code, int peer, const char *msg)
{
    fail(code, "%s", msg);
    last_peer = peer;
    return code;
}

const char *pc_last_error(void) { return last_error; }
int pc_last_error_peer(void) { return last_peer; }

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
    case PC_ERR_PEER: return "a peer failed";
    }
    return "unknown error";
}
