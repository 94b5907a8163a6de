#!/usr/bin/env python3
"""Userspace 'netem delay' substitute (this kernel has no sch_netem).

Binds to one or more NFQUEUE queues (pure-Python nfnetlink_queue client, no
extra packages) and re-injects every queued packet (verdict ACCEPT) after a
fixed delay.  FIFO per queue, so packet order is preserved.  Only packet
metadata is copied to userspace (COPY_META) and GSO super-packets are not
split (F_GSO), so the cost is per 64 KiB segment, not per MTU.

Run it inside the namespace whose iptables rules point at the queues (tests/hosts.py
starts it on the emulated switch for pytest --hosts N --link-delay D):
  ip netns exec pcn1 python3 linkdelay.py 0:1ms 1:1ms
  (queue 0 delayed 1 ms, queue 1 delayed 1 ms)  -- see linkctl.sh
"""
import ctypes
import os
import select
import signal
import socket
import struct
import sys
import time
from collections import deque

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR, NLMSG_DONE = 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5


def parse_time(s):
    s = s.strip().lower()
    for suf, mul in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * mul
    return float(s) * 1e-3  # bare number = ms


def nla(atype, payload):
    ln = 4 + len(payload)
    return struct.pack("=HH", ln, atype) + payload + b"\0" * ((4 - ln % 4) % 4)


class NFQ:
    def __init__(self):
        self.s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.s.bind((0, 0))
        for opt in (socket.SO_RCVBUF, 33):  # 33 = SO_RCVBUFFORCE (root)
            try:
                self.s.setsockopt(socket.SOL_SOCKET, opt, 32 << 20)
            except OSError:
                pass
        self.s.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.seq = 0

    def send(self, mtype, qnum, attrs, flags=NLM_F_REQUEST):
        self.seq += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, qnum) + b"".join(attrs)
        hdr = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | mtype, flags, self.seq, 0)
        self.s.send(hdr + body)

    def config(self, qnum, attrs):
        self.send(NFQNL_MSG_CONFIG, qnum, attrs, NLM_F_REQUEST | NLM_F_ACK)
        data = self.s.recv(65536)
        ln, t, fl, seq, pid = struct.unpack_from("=IHHII", data)
        if t == NLMSG_ERROR:
            err = struct.unpack_from("=i", data, 16)[0]
            if err:
                raise OSError(-err, f"NFQUEUE config for queue {qnum}: {os.strerror(-err)}")

    def bind(self, qnum, maxlen=65536):
        self.config(qnum, [nla(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET))])
        self.config(qnum, [nla(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))])
        self.config(qnum, [nla(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))])
        self.config(qnum, [nla(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
                           nla(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))])

    def unbind(self, qnum):
        try:
            self.config(qnum, [nla(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, socket.AF_INET))])
        except OSError:
            pass

    def accept_upto(self, qnum, pid):
        """VERDICT_BATCH: accept every queued packet with id <= pid."""
        self.send(NFQNL_MSG_VERDICT_BATCH, qnum, [nla(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid))])

    def read_packets(self):
        """Yield (queue, packet_id) for every message currently readable."""
        while True:
            try:
                data = self.s.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            off = 0
            while off + 16 <= len(data):
                ln, t, fl, seq, pid = struct.unpack_from("=IHHII", data, off)
                if ln < 16:
                    break
                if t == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    qnum = struct.unpack_from("!H", data, off + 18)[0]
                    a = off + 20
                    end = off + ln
                    while a + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if (atype & 0x7FFF) == NFQA_PACKET_HDR:
                            yield qnum, struct.unpack_from("!I", data, a + 4)[0]
                            break
                        a += (alen + 3) & ~3
                elif t == NLMSG_ERROR:
                    err = struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        print(f"linkdelay: netlink error {os.strerror(-err)}", file=sys.stderr)
                off += (ln + 3) & ~3


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    delays = {}
    for arg in sys.argv[1:]:
        q, d = arg.split(":")
        delays[int(q)] = parse_time(d)
    try:  # 1 ns timer slack -> sub-50us wake-up precision
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)
    except Exception:  # noqa: BLE001 - optional: only a finer timer
        pass
    nfq = NFQ()
    for q in delays:
        nfq.bind(q)
    pend = {q: deque() for q in delays}
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    print(f"linkdelay pid {os.getpid()}: " + ", ".join(f"queue {q}: {d*1e3:g} ms" for q, d in delays.items()),
          flush=True)
    mono = time.monotonic
    while not stop:
        heads = [p[0][0] for p in pend.values() if p]
        timeout = max(0.0, min(heads) - mono()) if heads else 0.2
        try:
            r, _, _ = select.select([nfq.s], [], [], timeout)
        except InterruptedError:
            continue
        now = mono()
        if r:
            for q, pid in nfq.read_packets():
                pend[q].append((now + delays[q], pid))
        now = mono()
        for q, p in pend.items():
            last = None
            while p and p[0][0] <= now:
                last = p.popleft()[1]
            if last is not None:
                nfq.accept_upto(q, last)
    # release everything still held, then unbind
    for q, p in pend.items():
        if p:
            nfq.accept_upto(q, p[-1][1])
    for q in delays:
        nfq.unbind(q)


if __name__ == "__main__":
    main()
