"""The steps of bench/device.sh (run it, not this): each bounded in time, each failure
recorded without stopping the others, one report as Markdown and JSON.

    bash bench/device.sh [--dry] [--steps a,b,...] [--budget SECONDS] [--out DIR]
    python bench/device_report.py --merge part1.json part2.json --out DIR

Steps (the issue's numbering in brackets):
  info        [1] pc.info(), the GPU's model, driver and memory, the CPU budget
  gpu-tests   [2] every gpu-marked test (P = 2 and 4, as the tests define them)
  cuda-torch  [2] bench/device_torch.py: DDP hook, partial_ddp, DistributedOptimizer on a
                  CUDA model, full (checked against MPI) and solo, P = 2 and 4
  buffers     [3] 64 MiB float32 full-mode allreduce, P = 2: CuPy buffers, NumPy buffers,
                  MPI_Allreduce staged (D2H, MPI, H2D) and on host memory
  fold        [3] bench/device_fold.py: what a post that folds on the device costs, P = 2
  fig9        [4] partialcoll-bench skew (the paper's method, linear 1 ms, 64 iterations),
                  P = 8 and 16, idle=auto, against the targets
  torch       [5] bench/torch_mlp.py, P = 4 and 8: hook and wrapper, full and solo,
                  against DDP+gloo and the mpi4py loop (target: >= 0.9x the best)
  engine      the engine's threads where cores are spare, P = 2, idle=auto and idle=spin:
                  bench/small.py (8 B full post+wait / MPI_Allreduce <= 1.3, and one
                  call's time over 20000 calls), bench/threads.py lock (a post while
                  another thread waits: worst <= 5x the median alone) and latency (8 B
                  beside a 100 MiB post <= 1.5x alone), bench/idle.py (armed and waiting
                  cost beyond the round's work < 1 % of a core; and how soon a waiting
                  rank answers a peer 50 and 300 ms late, no target)
  psld        bench/psld.py one, two, none (24 rounds, twice), transient (60 rounds): P = 6,
                  4 dedicated servers, 32 MiB in 1 MiB blocks, the slow servers pinned with
                  four busy processes to the last CPU (computation interference; with two,
                  an H100 node's slow server was only 1.17x static's baseline in one
                  run, too little of a straggler for any assignment to be 1.2x faster
                  than static, and too fast to fall below 1/(2P)): psld <= 1.2x
                  the no-straggler baseline and >= 1.2x faster than static; the slow
                  servers below 1/(2P) of the blocks; nothing slow: psld <= 1.03x static;
                  transient: the recovered server holds >= half its fair share over the
                  last third

--dry (or PC_DEVICE_DRY=1): what runs without a GPU, at P = 2 with few iterations: info;
the gpu-marked tests collected, not run; cuda-torch on the CPU; buffers and fold with a
stand-in CuPy on host memory (tests/fakecupy: the code path, not its timing); fig9 and
torch at P = 2; engine and psld, each benchmark once with few iterations (engine: idle=auto; psld at P = 5,
4 MiB, 8 rounds). Targets are shown and marked, never a failure of the run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
STEPS = ("info", "gpu-tests", "cuda-torch", "buffers", "fold", "fig9", "torch", "engine", "psld")
BUDGET = {"info": 60, "gpu-tests": 270, "cuda-torch": 110, "buffers": 70, "fold": 40, "fig9": 200, "torch": 300,
          "engine": 150, "psld": 360}
FIG9_TARGETS = {"solo": 25.0, "majority": 2.5, "probe": 5.8}   # MPI latency / mode latency
IDEAL_WITHIN = 1.1                                              # majority, probe: latency <= 1.1 x ideal
TORCH_TARGET = 0.9                                              # x the best of DDP+gloo, mpi4py loop
SMALL_TARGET = 1.3          # 8 B full post+wait / MPI_Allreduce, P = 2
LOCK_TARGET = 5.0           # a post while another thread waits: worst / median alone
BESIDE_TARGET = 1.5         # an 8 B round beside a 100 MiB post / alone
IDLE_TARGET = 1.0           # % of a core: armed, and waiting beyond the round's work
PSLD_BASELINE = 1.2         # psld round / no-straggler baseline (at most)
PSLD_STATIC = 1.2           # static round / psld round (at least)
PSLD_EXPLORE = 1.03         # nothing slow: psld round / static round (at most)


class Runner:
    """Runs commands with a time limit (the whole process group is killed at the limit),
    appends their output to one log, and keeps each run's record."""

    def __init__(self, log_path: str, deadline: float) -> None:
        self.log_path, self.deadline = log_path, deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: List[str], limit: float, env: Optional[dict] = None) -> dict:
        limit = max(1.0, min(limit, self.left()))
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}   (limit {limit:.0f} s)\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=limit)
                rc, timed_out = proc.returncode, False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                rc, timed_out = -9, True
            log.write(out)
        return {"cmd": " ".join(cmd), "rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1),
                "tail": out[-3000:], "output": out}


def mpiexec() -> str:
    here = os.path.join(os.path.dirname(PY), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


def mpi(n: int, *argv: str) -> List[str]:
    return [mpiexec(), "-n", str(n), *argv]


def fake_cupy_env() -> dict:
    fake = os.path.join(REPO, "tests", "fakecupy")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [fake, os.environ.get("PYTHONPATH")]))}


def gpu_present() -> Optional[str]:
    """None if a GPU is usable here (CuPy sees one), else why not."""
    probe = subprocess.run([PY, "-c", "import cupy; n = cupy.cuda.runtime.getDeviceCount(); print(n)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return "CuPy finds no GPU: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    return None if probe.stdout.strip() not in ("", "0") else "CuPy sees 0 devices"


def _json_file(tmp: str, name: str) -> str:
    return os.path.join(tmp, name)


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _at_sizes(r: Runner, tmp: str, name: str, sizes, argv: Callable[[int, str], List[str]], limit: float,
              env: Optional[dict] = None) -> List[tuple]:
    """Run mpiexec -n P argv(P, json_path) for each P in sizes, sharing the limit:
    [(P, its run, the JSON it wrote or None)]."""
    out = []
    for n in sizes:
        path = _json_file(tmp, f"{name}_{n}.json")
        run = r.run(mpi(n, *argv(n, path)), limit / len(sizes), env)
        out.append((n, run, _load(path)))
    return out


def _status(runs: List[dict]) -> str:
    if any(r["timed_out"] for r in runs):
        return "timed out"
    return "passed" if all(r["rc"] == 0 for r in runs) else "failed"


# -- the steps --------------------------------------------------------------------------
def step_info(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    run = r.run([PY, "-c", "import json, partialcoll as pc; print(json.dumps(pc.info()))"], limit / 3)
    info = None
    if run["rc"] == 0:
        info = json.loads(run["output"].strip().splitlines()[-1])
    gpu = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = r.run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"], 20)
        parts = [x.strip() for x in q["output"].strip().splitlines()[0].split(",")] if q["rc"] == 0 else []
        if len(parts) >= 3:
            gpu = {"name": parts[0], "driver": parts[1], "memory": parts[2],
                   "compute_capability": parts[3] if len(parts) > 3 else None}
    versions = r.run([PY, "-c", "import json\nout = {}\n"
                      "try:\n import cupy; out['cupy'] = cupy.__version__; out['cuda_runtime'] = "
                      "cupy.cuda.runtime.runtimeGetVersion()\nexcept Exception as e: out['cupy'] = 'none: ' + str(e)[:200]\n"
                      "try:\n import torch; out['torch'] = torch.__version__; out['torch_cuda'] = torch.version.cuda; "
                      "out['torch_gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
                      "except Exception as e: out['torch'] = 'none: ' + str(e)[:200]\n"
                      "print(json.dumps(out))"], limit / 2)
    if versions["rc"] == 0:
        gpu.update(json.loads(versions["output"].strip().splitlines()[-1]))
    else:
        gpu["versions_error"] = versions["tail"][-300:] or f"timed out after {versions['seconds']} s"
    cpu = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "load_1min": os.getloadavg()[0],
           "model": _cpu_model(), "memory_gib": _mem_gib(), "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
           "python": platform.python_version(), "machine": platform.machine()}
    if not gpu.get("name"):
        gpu["none"] = "no NVIDIA GPU: nvidia-smi " + ("gave no GPU" if smi else "not found")
    return {"status": "passed" if info else "failed", "runs": [run], "numbers": {"info": info, "gpu": gpu, "cpu": cpu}}


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_model() -> Optional[str]:
    text = _read("/proc/cpuinfo") or ""
    m = re.search(r"model name\s*:\s*(.*)", text)
    return m.group(1) if m else platform.processor() or None


def _mem_gib() -> Optional[float]:
    m = re.search(r"MemTotal:\s*(\d+) kB", _read("/proc/meminfo") or "")
    return round(int(m.group(1)) / 2 ** 20, 1) if m else None


def _pytest_counts(out: str) -> dict:
    counts = {}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|tests? collected)", out):
        counts[what] = counts.get(what, 0) + int(n)
    return counts


def gpu_test_files() -> List[str]:
    """The test modules that mark tests gpu (the rest need not be collected: seconds of
    imports)."""
    tests = os.path.join(REPO, "tests")
    return [os.path.join("tests", name) for name in sorted(os.listdir(tests))
            if name.startswith("test_") and name.endswith(".py")
            and "mark.gpu" in open(os.path.join(tests, name), encoding="utf-8").read()]


def step_gpu_tests(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    base = [PY, "-P", "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()]
    if dry:
        run = r.run(base + ["--co", "-q"], limit)
        counts = _pytest_counts(run["output"])
        ids = [line for line in run["output"].splitlines() if "::" in line]
        status = "skipped" if run["rc"] == 0 and ids else "failed"
        return {"status": status, "runs": [run], "reason": f"dry run: no GPU; {len(ids)} gpu-marked tests collected",
                "numbers": {"collected": ids, "counts": counts}}
    run = r.run(base + ["-v", "-rs"], limit)
    counts = _pytest_counts(run["output"])
    status = _status([run])
    if status == "passed" and (counts.get("skipped") or not counts.get("passed")):
        status = "failed"             # on a GPU machine a skipped gpu test measured nothing
    return {"status": status, "runs": [run], "numbers": {"counts": counts,
            "results": re.findall(r"(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", run["output"])}}


def step_cuda_torch(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    extra = ["--device", "cpu", "--steps", "3", "--warmup", "3"] if dry else ["--device", "cuda"]
    done = _at_sizes(r, tmp, "torch_paths", (2,) if dry else (2, 4),
                     lambda n, path: [PY, "bench/device_torch.py", *extra, "--json", path], limit)
    results = [row for _, _, data in done if data for row in data["results"]]
    out = {"status": _status([run for _, run, _ in done]), "runs": [run for _, run, _ in done],
           "numbers": {"results": results}}
    if dry:
        out["reason"] = "dry run: the same paths on a CPU model (no GPU)"
    return out


def _latency(r: Runner, tmp: str, buffers: str, size: str, iters: str, warm: str, limit: float, env=None):
    path = _json_file(tmp, f"latency_{buffers}.json")
    run = r.run(mpi(2, PY, "-m", "partialcoll.bench", "latency", "-m", f"{size}:{size}", "-i", iters, "-x", warm,
                    "--modes", "mpi,full", "--buffers", buffers, "--json", path), limit, env)
    data = _load(path)
    # one row per (size, mode): {mode: avg_us}
    return run, ({row["mode"]: row for row in data["rows"]} if data and data.get("rows") else None)


def step_buffers(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    size, iters, warm = ("4M", "3", "1") if dry else ("64M", "30", "3")
    env = fake_cupy_env() if dry else None
    run_d, dev = _latency(r, tmp, "cupy", size, iters, warm, limit / 2, env)
    run_h, host = _latency(r, tmp, "host", size, iters, warm, limit / 2)
    numbers = {"bytes": (dev or host or {}).get("full", {}).get("bytes")}
    if dev:
        numbers.update(cupy_full_us=dev["full"]["avg_us"], staged_mpi_us=dev["mpi"]["avg_us"])
    if host:
        numbers.update(numpy_full_us=host["full"]["avg_us"], host_mpi_us=host["mpi"]["avg_us"])
    out = {"status": _status([run_d, run_h]), "runs": [run_d, run_h], "numbers": numbers}
    if dry:
        out["reason"] = "dry run: 4 MiB; CuPy is tests/fakecupy (host memory): the code path, no GPU timing"
    return out


def step_fold(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    size = "4M" if dry else "64M"
    runs, numbers = [], {}
    for buffers, env in (("cupy", fake_cupy_env() if dry else None), ("host", None)):
        path = _json_file(tmp, f"fold_{buffers}.json")
        runs.append(r.run(mpi(2, PY, "bench/device_fold.py", "--buffers", buffers, "--size", size, "--json", path),
                          limit / 2, env))
        numbers[buffers] = _load(path)
    out = {"status": _status(runs), "runs": runs, "numbers": numbers}
    if dry:
        out["reason"] = "dry run: 4 MiB; CuPy is tests/fakecupy (host memory): the code path, no GPU timing"
    return out


def _target(what: str, value: Optional[float], target: float, at_most: bool = True) -> dict:
    """A target's row in the report: met is None where the value is unknown (None or NaN)."""
    known = value is not None and value == value
    met = (value <= target if at_most else value >= target) if known else None
    return {"what": what, "value": float("nan") if value is None else value,
            "target": f"{'<=' if at_most else '>='} {target}", "met": met}


def fig9_targets(rows: List[dict], p: int) -> List[dict]:
    by = {row["mode"]: row for row in rows}
    out = []
    for mode, target in FIG9_TARGETS.items():
        if mode in by and "mpi" in by:
            out.append(_target(f"P={p} MPI/{mode}", by[mode]["mpi_over"], target, at_most=False))
    for mode in ("majority", "probe"):
        if mode in by:
            ideal = by[mode]["ideal_us"]
            x = by[mode]["latency_us"] / ideal if ideal > 0 else float("nan")   # ideal 0: every rank eligible
            out.append(_target(f"P={p} {mode} latency / ideal", x, IDEAL_WITHIN))
    return out


def step_fig9(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    extra = ["-i", "8", "-r", "1", "--modes", "mpi,solo,majority,probe"] if dry else ["-i", "64"]
    done = _at_sizes(r, tmp, "fig9", (2,) if dry else (8, 16),
                     lambda n, path: [PY, "-m", "partialcoll.bench", "skew", "--skew", "linear:1ms", "--sync",
                                      "iteration", "--rc", "idle=auto", *extra, "--json", path], limit)
    tables, policy, targets = {}, {}, []
    for n, _, data in done:
        if data:
            tables[str(n)] = [{k: row[k] for k in ("mode", "latency_us", "mpi_over", "nap", "ideal_us",
                                                  "late_fraction", "initiator_us")} for row in data["rows"]]
            # what auto chose by the end of the run (rank 0's node), and the signals it read
            info = data.get("info", {})
            policy[str(n)] = {k: info.get(k) for k in ("idle", "idle_reason", "spin_bound_us", "run_delay", "steal",
                                                       "throttled_samples")}
            targets += fig9_targets(data["rows"], n)
    runs = [run for _, run, _ in done]
    return {"status": _status(runs), "runs": runs, "numbers": {"tables": tables, "idle": policy}, "targets": targets,
            **({"reason": "dry run: P = 2, 8 iterations (the targets are for P = 8 and 16 with cores to spare)"}
               if dry else {})}


def step_torch(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    extra = ["--steps", "2", "--warmup", "1", "--repeat", "1"] if dry else ["--repeat", "3"]
    done = _at_sizes(r, tmp, "torch_mlp", (2,) if dry else (4, 8),
                     lambda n, path: [PY, "bench/torch_mlp.py", *extra, "--json", path], limit)
    tables, targets = {}, []
    for n, _, data in done:
        if not data:
            continue
        rates = data["steps_per_s"]
        best = max((rates[p] for p in ("gloo", "mpi4py") if p in rates), default=None)
        tables[str(n)] = {"steps_per_s": rates, "best_peer": best}
        for v in ("hook-full", "hook-solo", "optim-full", "optim-solo"):
            if v in rates and best:
                x = rates[v] / best
                targets.append(_target(f"P={n} {v} / best of DDP+gloo, mpi4py", x, TORCH_TARGET, at_most=False))
    runs = [run for _, run, _ in done]
    return {"status": _status(runs), "runs": runs, "numbers": {"tables": tables}, "targets": targets,
            **({"reason": "dry run: P = 2, 2 steps, 1 repetition"} if dry else {})}


def step_engine(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    small = ["-b", "1", "-i", "200", "--rounds", "1000"] if dry else ["-b", "9", "--rounds", "20000"]
    reps = ["--reps", "1", "--seconds", "1"] if dry else ["--reps", "3", "--seconds", "3"]
    # the big post beside the 8 B rounds: 16 MiB in a dry run, so that its second (and a
    # loaded machine) leaves time for rounds with thread B asleep, the ratio's other half
    big = 16 if dry else 100
    idle = (["--seconds", "0.3", "--sizes", "8B,1MiB", "--modes", "full", "--answer", "50"] if dry
            else ["--seconds", "2", "--answer", "50,300"])     # answer: what the sleep tiers cost a late peer
    runs, numbers, targets = [], {}, []

    def bench(name, argv, share):
        path = _json_file(tmp, f"{name}.json")
        runs.append(r.run(mpi(2, PY, *argv, "--json", path), limit * share))
        numbers[name] = _load(path)
        return numbers[name]

    # a dry run: the default policy only (the code is the same for both; the spin policy's
    # engine is the suite's: test_engine, test_neighbor, test_small)
    for idle_rc in ("auto",) if dry else ("auto", "spin"):
        rows = bench(f"small_{idle_rc}", ["bench/small.py", *small, "--rc", f"idle={idle_rc}"], 0.12) or []
        full = next((row for row in rows if row.get("peer") == "full" and "ratio" in row), None)
        targets.append(_target(f"idle={idle_rc}: 8 B full post+wait / MPI_Allreduce, P=2",
                               full and full["ratio"], SMALL_TARGET))
        row = bench(f"lock_{idle_rc}", ["bench/threads.py", "lock", *reps, "--rc", f"idle={idle_rc}"], 0.12)
        targets.append(_target(f"idle={idle_rc}: a post while another thread waits, worst / median alone",
                               row and row["worst_over_alone_median"], LOCK_TARGET))
        row = bench(f"latency_{idle_rc}", ["bench/threads.py", "latency", *reps, "--big-mib", str(big),
                                           "--rc", f"idle={idle_rc}"], 0.12)
        targets.append(_target(f"idle={idle_rc}: 8 B round beside a {big} MiB post / alone",
                               row and row.get("ratio"), BESIDE_TARGET))
    for row in bench("idle", ["bench/idle.py", "--progress", "thread", *idle], 0.25) or []:
        if "mode" not in row:
            continue                    # a late peer's answer: reported, no target
        for what in ("armed", "overhead"):
            targets.append(_target(f"idle CPU %, {row['mode']} {row['size']} {what} (policy {row['idle']})",
                                   row[what], IDLE_TARGET))
    return {"status": _status(runs), "runs": runs, "numbers": numbers, "targets": targets,
            **({"reason": "dry run: each benchmark once (idle=auto), few iterations (the targets are for a node "
                          "with cores to spare)"} if dry else {})}


def psld_targets(scenario: str, res: dict) -> List[dict]:
    c = res["configs"]
    psld, base, static = c["psld"]["mean_ms"], c["baseline"]["mean_ms"], c["static"]["mean_ms"]
    if scenario == "none":
        return [_target("psld nothing slow: psld / static", psld / static, PSLD_EXPLORE)]
    if scenario == "transient":
        servers = len(c["psld"]["blocks_per_server"][0])       # blocks per server, per round
        return [_target("psld transient: the recovered server's share over the last third",
                        c["psld"].get("recovered_share"), round(1 / (2 * servers), 3), at_most=False)]
    below = c["psld"].get("below_at")
    return [_target(f"psld {scenario} slow: psld / no-straggler baseline", psld / base, PSLD_BASELINE),
            _target(f"psld {scenario} slow: static / psld", static / psld, PSLD_STATIC, at_most=False),
            {"what": f"psld {scenario} slow: round at which the slow servers hold < 1/(2P)",
             "value": float("nan") if below is None else float(below), "target": "reached", "met": below is not None}]


def step_psld(r: Runner, dry: bool, tmp: str, limit: float) -> dict:
    size = (["--np", "5", "--servers", "3", "--mib", "4", "--block-mib", "1", "--repeat", "1"] if dry
            else ["--np", "6", "--servers", "4", "--mib", "32", "--block-mib", "1", "--hogs", "4"])
    # rounds, repetitions; transient: slow for the first third, then enough decisions after
    # the recovery for epsilon to explore it
    plan = ({s: ["--rounds", "8"] for s in ("one", "two", "none", "transient")} if dry else
            {"one": ["--rounds", "24", "--repeat", "2"], "two": ["--rounds", "24", "--repeat", "2"],
             "none": ["--rounds", "24", "--repeat", "2"], "transient": ["--rounds", "60", "--repeat", "1"]})
    runs, numbers, targets = [], {}, []
    for scenario, argv in plan.items():
        path = _json_file(tmp, f"psld_{scenario}.json")
        share = limit / len(plan)
        runs.append(r.run([PY, "bench/psld.py", scenario, *size, *argv, "--timeout", str(max(10, int(share) - 10)),
                           "--json", path], share))
        res = _load(path)
        if res:
            numbers[scenario] = res["configs"]      # blocks per server per round too: what a decision did
            targets += psld_targets(scenario, res)
    return {"status": _status(runs), "runs": runs, "numbers": numbers, "targets": targets,
            **({"reason": "dry run: P = 5, 3 dedicated servers, 4 MiB, 8 rounds, one run (the targets are for "
                          "a node with cores to spare)"} if dry else {})}


STEP_FUNCS: Dict[str, Callable] = {"info": step_info, "gpu-tests": step_gpu_tests, "cuda-torch": step_cuda_torch,
                                   "buffers": step_buffers, "fold": step_fold, "fig9": step_fig9, "torch": step_torch,
                                   "engine": step_engine, "psld": step_psld}
NEEDS_GPU = {"gpu-tests", "cuda-torch", "buffers", "fold"}     # their GPU form; dry runs their CPU form


# -- the report ----------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = [f"# partialcoll on a device node: {report['when']}", ""]
    info = (report["steps"].get("info") or {}).get("numbers") or {}
    gpu, cpu, pci = info.get("gpu") or {}, info.get("cpu") or {}, info.get("info") or {}
    lines += [f"- mode: {'dry (CPU parts, P = 2)' if report['dry'] else 'full'}; host {report['host']}",
              f"- GPU: {gpu.get('name') or gpu.get('none', '?')}"
              + (f", driver {gpu['driver']}, {gpu.get('memory')}" if gpu.get("driver") else ""),
              f"- CuPy {gpu.get('cupy', '?')}; torch {gpu.get('torch', '?')} (CUDA {gpu.get('torch_cuda')})"
              + (f"; versions not read: {_cell(gpu['versions_error'])}" if "versions_error" in gpu else ""),
              f"- CPU: {cpu.get('model')}; {cpu.get('affinity')} of {cpu.get('cpu_count')} cores usable; "
              f"cgroup cpu.max {cpu.get('cgroup_cpu_max')}; {cpu.get('memory_gib')} GiB; Python {cpu.get('python')}",
              "- partialcoll: " + (", ".join(f"{k} {v}" for k, v in pci.items()) if pci else "not importable"), ""]
    lines += ["| step | status | seconds | note |", "|---|---|---|---|"]
    for s in report.get("setup", []):
        lines.append(f"| setup: {s['step']} | {s['status']} | {s['seconds']:.0f} | {_cell(s['detail'])} |")
    for name, st in report["steps"].items():
        note = st.get("reason") or st.get("error") or ""
        lines.append(f"| {name} | {st['status']} | {st.get('seconds', 0):.0f} | {_cell(note)} |")
    targets = [t for st in report["steps"].values() for t in st.get("targets", [])]
    if targets:
        lines += ["", "## Targets", ""]
        if report["dry"]:
            lines += ["Dry run: P = 2 on this machine's cores; the targets are for a GPU node's P and cores "
                      "and are shown only so the numbers can be read.", ""]
        lines += ["| what | value | target | met |", "|---|---|---|---|"]
        lines += [f"| {t['what']} | {t['value']:.2f} | {t['target']} | "
                  f"{'n/a' if t['met'] is None else 'yes' if t['met'] else 'NO'} |" for t in targets]
    for name, st in report["steps"].items():
        lines += ["", f"## {name}: {st['status']}", ""]
        nums = st.get("numbers")
        if nums:
            lines += ["```json", json.dumps(nums, indent=1, default=str)[:6000], "```"]
        for run in st.get("runs", []):
            if run["rc"] != 0 or run["timed_out"]:
                lines += ["", f"`{run['cmd']}`: exit {run['rc']}{' (timed out)' if run['timed_out'] else ''}, "
                              f"{run['seconds']} s; last output:", "```", run["tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split())[:160].replace("|", "/")


def write(report: dict, out: str) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", default=os.environ.get("PC_DEVICE_DRY") == "1")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--budget", type=float, default=1700.0, help="seconds for every step together (default 1700)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "device-report"))
    ap.add_argument("--setup-log", help="device.sh's record of its setup (JSON lines)")
    ap.add_argument("--merge", nargs="+", metavar="REPORT.json", help="merge reports of several calls into one")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        parts = [json.load(open(p)) for p in args.merge]
        report = dict(parts[0], steps={}, setup=[])
        for part in parts:
            report["steps"].update(part["steps"])
            report["setup"] += part.get("setup", [])
        write(report, args.out)
        print(markdown(report))
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEP_FUNCS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {','.join(STEPS)}")
    setup = [json.loads(line) for line in open(args.setup_log)] if args.setup_log else []
    start = time.monotonic()
    runner = Runner(os.path.join(args.out, "steps.log"), start + args.budget)
    report = {"when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "host": platform.node(), "dry": args.dry, "budget_s": args.budget, "setup": setup, "steps": {}}
    no_gpu = None if args.dry else gpu_present()
    with tempfile.TemporaryDirectory(prefix="pc-device-") as tmp:
        for name in steps:
            t0 = time.monotonic()
            if runner.left() < 5:
                res = {"status": "skipped", "reason": f"out of time (budget {args.budget:.0f} s)"}
            elif no_gpu and name in NEEDS_GPU:
                res = {"status": "failed", "reason": f"no GPU: {no_gpu} (bench/device.sh --dry runs the CPU form)"}
            else:
                try:
                    res = STEP_FUNCS[name](runner, args.dry, tmp, min(BUDGET[name], runner.left()))
                except Exception as exc:          # noqa: BLE001 - recorded; the next steps go on
                    res = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            res["seconds"] = round(time.monotonic() - t0, 1)
            for run in res.get("runs", []):
                run.pop("output", None)
            report["steps"][name] = res
            sys.stderr.write(f"# step {name}: {res['status']} ({res['seconds']} s)\n")
            write(report, args.out)                  # what is done so far survives a kill
    print(markdown(report))
    return 0 if all(s["status"] in ("passed", "skipped") for s in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
