"""Draw eager-SGD Fig. 9 from `partialcoll-bench skew --json` files (no MPI needed).

    python -m partialcoll.bench.fig9 -o docs/skew-fig9.png p4-iteration.json p8-iteration.json ...

Left: --sync iteration (the paper's method), right: --sync none. For each mode, the
latency gain over MPI_Allreduce (MPI latency / mode latency, same run) against P,
measured (solid) and ideal (dashed: a zero-cost collective under the same delays), with
the paper's P = 32 figures (solo 53.32x, majority 2.46x) as stars.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

PAPER_P32 = {"solo": 53.32, "majority": 2.46}      # eager-SGD, PPoPP'20, Sec. 6 (P = 32, Piz Daint)
TARGETS_P8 = {"solo": 20.0, "majority": 2.4, "probe": 5.5}   # the targets set for the paper method, P = 8
COLORS = {"solo": "C0", "majority": "C1", "probe": "C2", "quorum": "C3", "full": "C4", "impi": "C5"}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m partialcoll.bench.fig9", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="the PNG to write")
    ap.add_argument("files", nargs="+", help="skew --json files (any P, both --sync)")
    args = ap.parse_args(argv)
    runs: Dict[str, Dict[int, dict]] = {"iteration": {}, "none": {}}
    for path in args.files:
        with open(path) as f:
            run = json.load(f)
        first = run["rows"][0].get("bytes") if run["rows"] else None        # the first size of a sweep
        runs[run.get("sync", "iteration")][run["P"]] = {r["mode"]: r for r in run["rows"]
                                                        if r.get("bytes", first) == first}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    titles = {"iteration": "--sync iteration (paper's method)", "none": "--sync none (free-running)"}
    for ax, (sync, by_p) in zip(axes, runs.items()):
        ps = sorted(by_p)
        for mode, color in COLORS.items():
            if not ps or mode not in by_p[ps[0]] or "mpi" not in by_p[ps[0]]:
                continue
            meas = [by_p[p]["mpi"]["latency_us"] / by_p[p][mode]["latency_us"] for p in ps]
            ax.plot(ps, meas, "o-", color=color, label=f"{mode} measured")
            if mode not in ("solo", "full", "impi"):
                ideal = [by_p[p]["mpi"]["ideal_us"] / by_p[p][mode]["ideal_us"] for p in ps]
                ax.plot(ps, ideal, "--", color=color, alpha=0.7, label=f"{mode} ideal")
            if sync == "iteration" and mode in PAPER_P32:
                ax.plot([32], [PAPER_P32[mode]], "*", color=color, markersize=13, label=f"{mode} paper (P=32)")
            if sync == "iteration" and mode in TARGETS_P8:
                ax.plot([8], [TARGETS_P8[mode]], "_", color=color, markersize=22, mew=2.5,
                        label=f"{mode} target (P=8)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([4, 8, 16, 32])
        ax.set_xticklabels(["4", "8", "16\n(8 ranks/core)", "32"])
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("P (ranks)")
        ax.set_title(titles[sync])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MPI_Allreduce latency / mode latency")
    handles: Dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles.keys()), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("eager-SGD Fig. 9: linear skew 1 ms, 8 B, 64 iterations (2-core machine, shared)")
    fig.savefig(args.output, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
