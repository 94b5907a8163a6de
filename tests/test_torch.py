"""PyTorch integration under mpiexec: the DDP hook in every mode, the partialcoll process
group against gloo, the optimizer wrapper, half precision (torch_checks.py); the
contracts of Horovod's DistributedOptimizer, DDP's process group and PyTorch's Python
process-group tests (torch_contract_checks.py); the CUDA path without a GPU (device
tensors emulated by CPU ones, through host staging and through the stand-in CuPy) and on
a GPU where there is one; importing the integration leaves torch as it was.
Skipped, with the reason printed, where torch is not installed."""
import json
import os

import pytest

from conftest import run_python

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]' installs its CPU build)")

HERE = os.path.dirname(os.path.abspath(__file__))
FAKECUPY = os.path.join(HERE, "fakecupy")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# One job per process count runs the check modules in turn: each rank imports torch
# (seconds of CPU) once for all of them; a failure names its module's check and ranks.
TORCH_CHECKS = ["torch_checks.py", "torch_contract_checks.py", "torch_rna_checks.py",
                "horovod_checks.py"]   # Horovod's API (test/parallel/test_torch.py's cases)
# P = 5 (the largest, odd): the checks whose cases change with P (groups of the hierarchy,
# which need P >= 3, data-parallel groups of 2 and the same-size-other-processes case at
# P >= 4, Horovod's averages; torch.compile and FSDP2 on CPU tensors, uneven shards);
# torch_checks.py's hook, optimizer and process-group paths do the same at every P and run
# at 2 here and at 3 on the stand-in CuPy's device path below (every check of the module).
TORCH_CHECKS_5 = ["torch_contract_checks.py", "torch_rna_checks.py", "horovod_checks.py"]


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2])
def test_torch_integration_contracts_rna(mpirun, nprocs):
    """torch_checks.py, torch_contract_checks.py and torch_rna_checks.py (hierarchy="auto"
    regroups a slow rank and averages the groups' models; lr_scaling="contributors"; bad
    options on every rank), in one job."""
    mpirun(TORCH_CHECKS, nprocs, timeout=600)


@pytest.mark.mpiexec
def test_torch_contracts_rna_5(mpirun):
    """The contracts, RNA and Horovod's API at P = 5 too, in one job (torch.compile and
    FSDP2 on CPU tensors here only)."""
    mpirun(TORCH_CHECKS_5, 5, timeout=600)


@pytest.mark.mpiexec
@pytest.mark.parametrize("kind,script,nprocs", [("emulated", "torch_contract_checks.py", 2),
                                                ("fakecupy", "torch_checks.py", 3)],
                         ids=["emulated-contracts-2", "fakecupy-checks-3"])
def test_torch_device_path_without_gpu(mpirun, kind, script, nprocs):
    """CPU tensors sent down the CUDA path: staged host copies (emulated), or CuPy views and
    partialcoll's device staging run by the stand-in CuPy (fakecupy)."""
    env = {"PC_TEST_TORCH_DEVICE": kind}
    if kind == "fakecupy":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAKECUPY, os.environ.get("PYTHONPATH")]))
    mpirun(script, nprocs, env=env, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [2, 4])
def test_torch_contracts_on_gpu(mpirun, nprocs):
    """CUDA models through partial_ddp, the process group and DistributedOptimizer (every
    rank on the one GPU, or one each where there are several)."""
    if not _cuda():
        pytest.skip("needs a GPU: torch finds no CUDA device")
    mpirun("torch_contract_checks.py", nprocs, env={"PC_TEST_TORCH_DEVICE": "cuda"}, timeout=300)


def test_import_changes_nothing_in_torch():
    """`import partialcoll.integrations.torch` registers no backend or rendezvous handler
    and sets no environment variable; register_backend() then adds exactly the backend and
    the mpi:// scheme, replacing none of torch's handlers."""
    probe = r"""
import json, os, sys
import torch.distributed as dist
import torch.distributed.rendezvous
rdzv = sys.modules["torch.distributed.rendezvous"]
handlers, env = dict(rdzv._rendezvous_handlers), dict(os.environ)
plugins, devices = dict(dist.Backend._plugins), dict(dist.Backend.default_device_backend_map)
import partialcoll.integrations.torch as pct
same = [rdzv._rendezvous_handlers == handlers, dict(os.environ) == env,
        dict(dist.Backend._plugins) == plugins, dict(dist.Backend.default_device_backend_map) == devices]
pct.register_backend()
added = sorted(set(rdzv._rendezvous_handlers) - set(handlers))
kept = all(rdzv._rendezvous_handlers[k] is v for k, v in handlers.items())
print(json.dumps({"same": same, "added": added, "kept": kept, "backend": "PARTIALCOLL" in dist.Backend._plugins,
                  "devices": dict(dist.Backend.default_device_backend_map) == devices}))
"""
    out = run_python(probe)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"] == [True, True, True, True], got
    assert got == {"same": [True] * 4, "added": ["mpi"], "kept": True, "backend": True, "devices": True}, got



def test_group_leaves_dynamo_unloaded():
    """A program that never compiles does not import torch._dynamo (a second of CPU per
    rank) through the partialcoll group: init_process_group("partialcoll"), collectives,
    async work and destroy leave it unloaded (compiled code's calls into the group, which
    Dynamo must not trace, are torch_contract_checks.py's test_compiled_ddp_equals_global_batch)."""
    probe = r"""
import sys
import torch, torch.distributed as dist
import partialcoll.integrations.torch as pct
pct.register_backend()
dist.init_process_group("partialcoll", init_method="mpi://")
t = torch.ones(40000)
dist.all_reduce(t)
work = dist.all_reduce(t, async_op=True)
work.wait()
dist.broadcast(t, 0)
dist.barrier()
dist.destroy_process_group()
assert t[0].item() == 1.0
print("dynamo loaded:", "torch._dynamo" in sys.modules)
"""
    out = run_python(probe)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "dynamo loaded: False", out.stdout
