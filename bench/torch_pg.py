"""The partialcoll process group's collectives other than DDP's allreduce, against mpi4py.

    mpiexec -n 4 python bench/torch_pg.py --mib 32 --repeat 7

What FSDP2, DTensor and model set-up call over the group: broadcast,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single and a MAX all_reduce
(the group's MPI path: the engine takes SUM/AVG of float tensors). Each call on float32
tensors of --mib MiB (the input of all_gather_into_tensor is the output's share) runs
--repeat times after a barrier; its time is the median, the slowest rank's. The peer is
the same operation as a blocking mpi4py call on NumPy views of the same tensors, in the
same run. Rank 0 prints ms and the ratio.

--small N then times N calls of dist.all_reduce of small tensors (8 B, 4 KiB, 32 KiB:
below the engine's threshold, MPI's allreduce waited for under the engine's idle
policy: a loss or a metric averaged every step) over the partialcoll group, over a gloo
group, and mpi4py's Allreduce, in turn: us per call, the slowest rank's mean over the N.

--fsdp2 STEPS then trains a 25.2M-parameter MLP (six 1024-2048-1024 blocks, each
sharded with fully_shard, batch 32) for STEPS steps after 2 warm-up steps, over the
partialcoll group and over a gloo group, alternating twice; ms per step, the slowest
rank's.
"""
import argparse

import torch
import torch.distributed as dist
from mpi4py import MPI

import partialcoll.integrations.torch as pct
from _timing import median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--small", type=int, default=0, metavar="N", help="then N small all_reduce calls of each peer")
    ap.add_argument("--fsdp2", type=int, default=0, metavar="STEPS", help="then FSDP2 training, gloo vs partialcoll")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    P = comm.size
    pct.init_process_group(comm)
    n = int(args.mib * (1 << 20)) // 4 // P * P
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)      # torch's newer names
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    x, out, share = torch.ones(n), torch.empty(n), torch.empty(n // P)
    xn, outn, sharen = x.numpy(), out.numpy(), share.numpy()
    rows = [
        ("broadcast", lambda: dist.broadcast(x, 0), lambda: comm.Bcast(xn, 0)),
        ("all_gather_into_tensor", lambda: gather(out, x[:n // P]),
         lambda: comm.Allgather(xn[:n // P], outn)),
        ("reduce_scatter_tensor", lambda: scatter(share, x),
         lambda: comm.Reduce_scatter_block(xn, sharen)),
        ("all_to_all_single", lambda: dist.all_to_all_single(out, x), lambda: comm.Alltoall(xn, outn)),
        ("all_reduce MAX", lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX),
         lambda: comm.Allreduce(MPI.IN_PLACE, xn, op=MPI.MAX)),
    ]
    if comm.rank == 0:
        print(f"# the partialcoll process group vs mpi4py, P = {P}, {args.mib:g} MiB float32, "
              f"median of {args.repeat}, slowest rank")
        print(f"# {'call':24s} {'group ms':>9s} {'mpi4py ms':>10s} {'ratio':>6s}")
    for name, ours, peer in rows:
        a, b = median_ms(comm, ours, args.repeat), median_ms(comm, peer, args.repeat)
        if comm.rank == 0:
            print(f"  {name:24s} {a:9.1f} {b:10.1f} {a / b:6.2f}", flush=True)
    if args.small:
        small_allreduces(comm, args.small)
    if args.fsdp2:
        times = {"partialcoll": [], "gloo": []}
        for backend in ("gloo", "partialcoll") * 2:
            times[backend].append(fsdp2_ms(comm, backend, args.fsdp2))
        if comm.rank == 0:
            print(f"# FSDP2, 25.2M parameters, ms per step over {args.fsdp2} steps: "
                  + ", ".join(f"{b} {' '.join(f'{t:.1f}' for t in ts)}" for b, ts in times.items())
                  + f"; gloo / partialcoll {sum(times['gloo']) / sum(times['partialcoll']):.2f}")
    dist.destroy_process_group()


def small_allreduces(comm, calls: int) -> None:
    """us per dist.all_reduce of 8 B, 4 KiB and 32 KiB: the partialcoll group, gloo, mpi4py."""
    gloo = dist.new_group(backend="gloo")
    if comm.rank == 0:
        print(f"# small all_reduce (SUM, float32), us per call over {calls} calls, slowest rank")
        print(f"# {'bytes':>8s} {'partialcoll':>12s} {'gloo':>9s} {'mpi4py':>9s} {'pc / mpi4py':>12s} {'gloo / pc':>10s}")
    for nbytes in (8, 4096, 32768):
        t = torch.ones(nbytes // 4)
        tn = t.numpy()
        peers = [lambda: dist.all_reduce(t), lambda: dist.all_reduce(t, group=gloo),
                 lambda: comm.Allreduce(MPI.IN_PLACE, tn)]
        us = [median_ms(comm, lambda f=f: [f() for _ in range(calls)], 3) * 1e3 / calls for f in peers]
        if comm.rank == 0:
            print(f"  {nbytes:8d} {us[0]:12.1f} {us[1]:9.1f} {us[2]:9.1f} {us[0] / us[2]:12.1f} {us[1] / us[0]:10.2f}",
                  flush=True)
    dist.destroy_process_group(gloo)


def fsdp2_ms(comm, backend: str, steps: int) -> float:
    """ms per FSDP2 training step over a new group of this backend (the slowest rank's)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    group = dist.new_group(backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                                      torch.nn.Linear(2048, 1024)) for _ in range(6)])
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 1024)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(2):
        step()
    ms = median_ms(comm, lambda: [step() for _ in range(steps)], 1) / steps
    dist.destroy_process_group(group)
    return ms


if __name__ == "__main__":
    main()
