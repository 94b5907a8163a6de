"""Emulated hosts for the multi-rank tests (pytest --hosts N, issue 14).

One network namespace per "host" (``pch<pid>h<i>``), each with its own ``eth0``
(10.78.0.<i+1>/24) on a veth pair whose other end sits on a bridge in a namespace of
its own (``pch<pid>sw``, "the switch"); the root namespace is untouched. MPICH talks
TCP between hosts (ofi/tcp on eth0), so ranks on different hosts cannot use shared
memory; ranks on the same host (--ppn k) can, as on a real node.

mpiexec runs inside host 0 (the proxies on the other hosts must reach its control
port, and the root namespace is not reachable from them) and starts them through
tests/hosts_launch.sh, an "ssh" that enters the host's namespace.

Link impairments, netem-style on each host's egress (so host-to-host one-way delay is
--link-delay, and a round trip twice that):
- delay: the kernel here has no sch_netem, so tests/linkdelay.py, a user-space
  NFQUEUE relay on the switch, holds every packet a host sends for the delay
  (iptables ``physdev --physdev-in v<i>`` rules with br_netfilter; --queue-bypass
  lets packets through if the relay dies);
- rate: ``tc tbf`` on the host's eth0 (its egress) and on the switch port (its ingress).

Everything is named after the pytest process id (a letter after it tells apart several
sets of hosts in one run) and removed at the end by process id
(``ip netns pids``), then the namespaces are deleted. Namespaces left by a run whose
process is gone are removed when the next run starts.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(HERE, "hosts_launch.sh")
DELAYER = os.path.join(HERE, "linkdelay.py")
SUBNET = "10.78.0"
_NAME = re.compile(r"^pch(\d+)[a-z]?(?:h\d+|sw)$")     # pch<pid>[x]h<i>, pch<pid>[x]sw


@functools.lru_cache(maxsize=None)
def mpi_flavour(exe: str) -> str:
    """'openmpi' or 'mpich': whose mpiexec exe is."""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "prte" in text.lower()) else "mpich"


def keep_going_flags(exe: str) -> List[str]:
    """exe's flags for a job that outlives a rank that dies, so the survivors can report it
    (MPICH: -disable-auto-cleanup; Open MPI: its ULFM)."""
    return ["--with-ft", "ulfm"] if mpi_flavour(exe) == "openmpi" else ["-disable-auto-cleanup"]


def unavailable() -> Optional[str]:
    """Why emulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "--hosts needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None:
        return "--hosts needs iproute2's `ip` (ip netns)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _in(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _ip("netns", "exec", ns, *cmd, check=check)


def _netns_names() -> List[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(ns: str) -> List[int]:
    """End every process inside ns (by pid: TERM, then KILL), delete ns; returns the pids."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                left.append(pid)
            except ProcessLookupError:
                pass
        if not left:
            break
        deadline = time.monotonic() + 1.0
        while any(_alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
    _ip("netns", "delete", ns, check=False)
    return pids


def remove_stale() -> List[str]:
    """Delete namespaces of earlier runs whose pytest process is gone."""
    gone = []
    for ns in _netns_names():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _remove(ns)
            gone.append(ns)
    return gone


class Hosts:
    """n emulated hosts; ``up()`` makes them, ``down()`` removes everything made."""

    def __init__(self, n: int, ppn: int = 1, delay: Optional[str] = None, rate: Optional[str] = None,
                 tag: Optional[str] = None) -> None:
        if n < 1 or ppn < 1:
            raise ValueError(f"--hosts and --ppn must be >= 1, not {n} and {ppn}")
        self.n, self.ppn, self.delay, self.rate = n, ppn, delay, rate
        self.tag = tag or f"pch{os.getpid()}"
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{i}" for i in range(n)]
        self.made: List[str] = []
        self.delayer: Optional[subprocess.Popen] = None
        self.log = os.path.join("/tmp", f"{self.tag}-linkdelay.log")

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def describe(self) -> str:
        extra = "".join(f", {k} {v} per host egress" for k, v in (("delay", self.delay), ("rate", self.rate)) if v)
        return f"{self.n} emulated hosts ({', '.join(self.names)}), {self.ppn} rank(s) per host{extra}"

    # -- making and removing ---------------------------------------------------------
    def up(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        self.made.append(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        if self.rate:
            self._limit_rate()
        if self.delay:
            self._add_delay()

    def _limit_rate(self) -> None:
        # burst must exceed a 64 KiB GSO packet, else tbf splits them and throughput halves
        tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.switch, f"v{i}")):
                proc = subprocess.run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", *tbf],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"tc tbf rate {self.rate} on {where}:{dev}: {proc.stderr.strip()}")

    def _add_delay(self) -> None:
        if shutil.which("iptables") is None:
            raise RuntimeError("--link-delay needs iptables (NFQUEUE rules on the emulated switch): "
                               "apt-get install iptables")
        sw = self.switch
        _in(sw, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
        queues = [f"{i}:{self.delay}" for i in range(self.n)]
        with open(self.log, "w") as log:
            # ip netns exec execs python: the Popen pid is the relay's own
            self.delayer = subprocess.Popen(["ip", "netns", "exec", sw, sys.executable, DELAYER, *queues],
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(self.log) as f:
                if f.read().startswith("linkdelay pid"):
                    break
            if self.delayer.poll() is not None:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("linkdelay.py did not start within 10 s")
        if self.delayer.poll() is not None:
            with open(self.log) as f:
                raise RuntimeError(f"linkdelay.py exited: {f.read()[-2000:]}")
        for i in range(self.n):
            # everything host i sends, held on the switch port it enters by
            _in(sw, "iptables", "-t", "mangle", "-A", "PREROUTING", "-m", "physdev", "--physdev-in", f"v{i}",
                "-j", "NFQUEUE", "--queue-num", str(i), "--queue-bypass")

    def down(self) -> Dict[str, List[int]]:
        """End the processes left in our namespaces by pid, delete the namespaces."""
        if self.delayer is not None and self.delayer.poll() is None:
            self.delayer.terminate()        # releases the packets it holds
            try:
                self.delayer.wait(3)
            except subprocess.TimeoutExpired:
                self.delayer.kill()
                self.delayer.wait()
        for seq in glob.glob(os.path.join(tempfile.gettempdir(), f"{self.tag}-seq-*")):
            os.unlink(seq)                  # Open MPI's rank maps (mpiexec())
        killed = {}
        for ns in reversed(self.made):
            pids = _remove(ns)
            if pids:
                killed[ns] = pids
        self.made = []
        if os.path.exists(self.log):
            os.unlink(self.log)
        return killed

    def reap(self) -> List[int]:
        """End the processes a failed or timed-out run left on the hosts (not the relay)."""
        keep = {self.delayer.pid} if self.delayer is not None else set()
        pids = []
        for ns in self.names:
            for p in _ip("netns", "pids", ns, check=False).stdout.split():
                if int(p) not in keep:
                    pids.append(int(p))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        return pids

    # -- running ---------------------------------------------------------------------
    def mpiexec(self, exe: str, nprocs: int, argv: List[str], extra: Optional[List[str]] = None,
                ppn: Optional[int] = None, keep_going: bool = False) -> List[str]:
        """The command line that runs argv on nprocs ranks spread over the hosts (ppn per
        host), for MPICH's or Open MPI's mpiexec (keep_going: the job outlives a dead rank)."""
        ppn = ppn or self.ppn
        used = min(self.n, math.ceil(nprocs / ppn))
        going = keep_going_flags(exe) if keep_going else []
        if mpi_flavour(exe) == "openmpi":
            # rank r on host (r // ppn) mod used, as Hydra's -ppn places them: a sequential
            # map; PRRTE's daemons started through our "ssh"; their control traffic and every
            # rank's TCP on eth0, shared memory only between ranks of one host
            place = [(r // ppn) % used for r in range(nprocs)]
            if keep_going and nprocs > 1:
                # PRRTE 3.0 dismantles the whole job as soon as every rank of one of its
                # daemons has ended (openpmix/prrte#1698; its odls then logs "Not found" at
                # odls_base_default_fns.c:1751 and the other hosts' ranks are killed): the
                # rank that the fault tests kill, the last, shares the host of the one before
                place[-1] = place[-2]
            seq = os.path.join(tempfile.gettempdir(), f"{self.tag}-seq-{nprocs}-{ppn}-{used}{'-k' if keep_going else ''}")
            with open(seq, "w") as f:
                f.writelines(f"{self.addr(h)}\n" for h in place)
            return ["ip", "netns", "exec", self.names[0], exe, "--hostfile", seq, "--map-by", "seq:OVERSUBSCRIBE",
                    "--bind-to", "none", "--prtemca", "plm_ssh_agent", LAUNCHER,
                    "--prtemca", "oob_tcp_if_include", "eth0", "--mca", "btl", "tcp,sm,self",
                    "--mca", "btl_tcp_if_include", "eth0", *going, *(extra or []), "-n", str(nprocs), *argv]
        hosts = ",".join(self.addr(i) for i in range(used))
        return ["ip", "netns", "exec", self.names[0], exe, "-iface", "eth0",
                "-launcher", "ssh", "-launcher-exec", LAUNCHER,
                "-hosts", hosts, "-ppn", str(ppn), *going, *(extra or []), "-n", str(nprocs), *argv]

    def env(self) -> Dict[str, str]:
        """What mpiexec (and through it the launcher and every rank) needs."""
        return {"PCH_TAG": self.tag, "PCH_SUBNET": SUBNET,
                # keep MPI traffic on the veths: TCP between hosts, never loopback
                "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
                # Open MPI refuses to run as root without these (its daemons too)
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                # the emulated hosts share this machine's cores, which Open MPI cannot see:
                # each host looks undersubscribed, so its blocking calls would poll without
                # yielding (8 ranks on 2 cores: allreduce_init 350 ms instead of 4 ms)
                "OMPI_MCA_mpi_yield_when_idle": "1"}

    def eth0_bytes(self) -> List[int]:
        """Bytes received on each host's eth0 (a check that ranks really talk over the veths)."""
        out = []
        for ns in self.names:
            proc = _in(ns, "cat", "/sys/class/net/eth0/statistics/rx_bytes")
            out.append(int(proc.stdout))
        return out


def main(argv: Optional[List[str]] = None) -> int:
    """python tests/hosts.py [--hosts N] [--ppn k] [--link-delay D] [--link-rate R] -n P -- prog args...

    Make the hosts, run prog on P ranks across them (mpiexec's exit status), remove them."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--ppn", type=int, default=1)
    ap.add_argument("--link-delay")
    ap.add_argument("--link-rate")
    ap.add_argument("-n", type=int, required=True, help="ranks")
    ap.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("prog", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    prog = a.prog[1:] if a.prog[:1] == ["--"] else a.prog
    why = unavailable()
    if why or not prog:
        ap.error(why or "no program to run")
    remove_stale()
    h = Hosts(a.hosts, a.ppn, a.link_delay, a.link_rate, tag=f"pch{os.getpid()}m").up()
    try:
        print(f"# {h.describe()}", flush=True)
        return subprocess.call(h.mpiexec(a.mpiexec, a.n, prog), env=dict(os.environ, **h.env()))
    finally:
        h.down()


if __name__ == "__main__":
    sys.exit(main())
