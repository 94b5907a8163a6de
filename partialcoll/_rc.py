"""Runtime options (like mpi4py.rc): one object, documented defaults, unknown keys rejected."""
from __future__ import annotations

import os
from typing import Any


IDLE_POLICIES = ("auto", "spin", "sleep")


def _value(text: str) -> Any:
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def keywords(text: str, what: str) -> dict:
    """"a=1,b=x" -> {"a": 1, "b": "x"} (numbers become numbers, "none" None)."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"{what}: {item.strip()!r} is not name=value (e.g. \"mode=solo,late=fold\")")
        out[key.strip()] = _value(value.strip())
    return out


class RC:
    """Runtime options, read when the engine starts (first use, or after finalize).

    Attributes:
        progress: "thread" (a native progress thread, default) or "inline" (test/wait
            drive progress); environment PARTIALCOLL_PROGRESS.
        spin_us: busy-poll this long after the last event (default 20).
        yield_us: then sched_yield() this long (default 200).
        sleep_min_us: then sleep, doubling from this (default 10) ...
        sleep_max_us: ... up to this cap (default 200); a local post wakes the engine at once.
        deep_after_us: after this long without any event (default 20000; or, where longer,
            four periods between this process's posts, or while a thread of the rank waits
            for a round four times the idle time at which three of its last eight waits
            ended, at most five times this: a rank of a loop is not idle mid-iteration, nor
            while it waits as long as it routinely does), the sleep cap grows
            to a tenth of the idle time divided by the message steps of the armed round, so
            a round that crosses that many napping ranks takes at most ~10 % longer ...
        deep_sleep_us: ... up to this (default 20000): an idle or waiting rank costs under 1 %
            of a core, a rank idle for up to 200 ms answers a peer within a tenth of that,
            and one idle for longer within 20 ms.
        busy_bytes: while a message at least this large moves (its round has read this rank's
            input, or a plain schedule has started), keep polling (default 65536) ...
        busy_cap_us: ... until at most this long after the last event (default 10000): four
            times the period at which large transfers showed progress before (pc.info()'s
            busy_bound_us; a 1 MiB round's messages: a few hundred us), so that a peer
            later than that is waited for asleep.
        timeout: default timeout in seconds of wait() (default 600, like PyTorch's NCCL
            process groups; None: wait forever), so a rank that never posts to a full
            round is named instead of hanging its peers; environment PARTIALCOLL_TIMEOUT
            ("none": forever).
        stall_warning: a wait that has not completed after this many seconds logs, once,
            the ranks it has not heard from in its round (default 60, as Horovod's stall
            inspector; None: never), on logger "partialcoll"; environment
            PARTIALCOLL_STALL_WARNING ("none": never).
        idle: what the progress thread does while a round is armed and nothing moves:
            "sleep" (the policy above: spin, yield, then sleep; for nodes with more
            threads than CPUs), "spin" (poll while a round is armed, and wait()
            polls too, up to poll_max_us after the last event: the lowest latency,
            a core per rank), or "auto" (default): "spin" where the node's ranks may
            use two CPUs each (partialcoll.info()["cpu_budget"]: affinity and cgroup
            quota) and none of them sees interference (run delay of its threads,
            cgroup throttling, steal time), else "sleep"; environment
            PARTIALCOLL_IDLE. Read when the engine starts: only this option sets the
            policy. partialcoll.info()["idle"] says what runs, "idle_reason" why.
        poll_max_us: polling (idle "spin", or auto's) goes on at most this long after the last
            event (default 20000); the bound adapts to a few times the recent gap
            between events, then the engine sleeps as above.
        close_timeout: default timeout in seconds of close() (default 300; None: forever), so a
            peer that died never hangs it; environment PARTIALCOLL_CLOSE_TIMEOUT.
        abort_on_exception: once partialcoll is in use (a collective made, or the torch
            integration's init_process_group), an exception nobody caught ends the whole job with MPI.COMM_WORLD.Abort()
            after it is reported to the peers and printed, as ``python -m mpi4py`` does, so
            ranks waiting in MPI calls partialcoll does not own (mpi4py's, a torch process
            group's) do not hang (default True); environment
            PARTIALCOLL_ABORT_ON_EXCEPTION ("0": off, for jobs whose other ranks carry on).
        telemetry: record who is slow in every round of the collectives created from now on
            (default True; coll.stats(), docs/who-is-slow.md); environment
            PARTIALCOLL_TELEMETRY ("0": off).
        telemetry_rounds: how many of the last rounds each collective keeps (default 1024).
        on_failure: what the collectives created from now on do when a peer fails (default
            "raise": every survivor's calls raise PeerError or MPIError; "shrink": the
            survivors agree on the failed ranks and go on without them, where the MPI can:
            partialcoll.info()["shrink"]; docs/faults.md); environment PARTIALCOLL_ON_FAILURE.
        torch: keyword options of the torch integration's DistributedOptimizer that a
            call does not pass itself (default {}: Horovod's behaviour, mode "full"), so a
            launcher picks a partial mode for a script it does not edit; environment
            PARTIALCOLL_TORCH, comma-separated, e.g. "mode=solo,late=fold,average=nap"
            (numbers become numbers, "none" None).

    Whatever the timeout, a wait raises MPIError as soon as the MPI reports a peer as
    failed (MPIX_Comm_get_failed: MPICH under mpiexec -disable-auto-cleanup; ULFM untried).
    """

    _defaults = {"progress": "thread", "spin_us": 20.0, "yield_us": 200.0, "sleep_min_us": 10.0,
                 "sleep_max_us": 200.0, "deep_after_us": 20000.0,
                 "deep_sleep_us": 20000.0, "busy_bytes": 65536, "busy_cap_us": 10000.0,
                 "timeout": 600.0, "stall_warning": 60.0, "idle": "auto", "close_timeout": 300.0,
                 "poll_max_us": 20000.0, "abort_on_exception": True, "telemetry": True,
                 "telemetry_rounds": 1024, "on_failure": "raise", "torch": {}}

    def __init__(self) -> None:
        object.__setattr__(self, "_values", dict(self._defaults, torch={}))    # a dict of its own
        env = os.environ.get("PARTIALCOLL_PROGRESS")
        if env:
            self.progress = env
        for name in ("timeout", "stall_warning"):
            env = os.environ.get("PARTIALCOLL_" + name.upper())
            if env:
                setattr(self, name, None if env.lower() == "none" else float(env))
        env = os.environ.get("PARTIALCOLL_IDLE")
        if env:
            self.idle = env
        env = os.environ.get("PARTIALCOLL_ABORT_ON_EXCEPTION")
        if env:
            self.abort_on_exception = env.strip().lower() not in ("0", "false", "no", "off")
        env = os.environ.get("PARTIALCOLL_TELEMETRY")
        if env is not None:
            self.telemetry = env.lower() not in ("0", "false", "no", "off")
        env = os.environ.get("PARTIALCOLL_ON_FAILURE")
        if env:
            self.on_failure = env.strip().lower()
        env = os.environ.get("PARTIALCOLL_CLOSE_TIMEOUT")
        if env:
            self.close_timeout = None if env.lower() == "none" else float(env)
        env = os.environ.get("PARTIALCOLL_TORCH")
        if env:
            self.torch = keywords(env, "PARTIALCOLL_TORCH")

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"unknown partialcoll option {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._defaults:
            raise AttributeError(f"unknown partialcoll option {name!r}; "
                                 f"known: {', '.join(self._defaults)}")
        if name == "progress" and value not in ("thread", "inline"):
            raise ValueError(f"progress must be 'thread' or 'inline', not {value!r}")
        if name == "on_failure" and value not in ("raise", "shrink"):
            raise ValueError(f"on_failure must be 'raise' or 'shrink', not {value!r}")
        if name == "torch" and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            raise ValueError(f"torch must be a dict of keyword options, not {value!r}")
        if name == "idle" and value not in IDLE_POLICIES:
            raise ValueError(f"idle must be one of {', '.join(map(repr, IDLE_POLICIES))}, not {value!r}")
        self._values[name] = value

    def __call__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return "partialcoll.rc(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


rc = RC()
