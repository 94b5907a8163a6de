#!/bin/bash
# tree_netns.sh NP -- the tree allreduce's chain-blocking scenarios on the shared netns harness
# (docs/tree.md). Setup: copy /work/shared/netns/* to /tmp/netns, make its venv with this
# package, ./setup.sh 8, then cp bench/tree.py /tmp/netns/tree_bench.py and
# bench/tree_racks.sh /tmp/netns/racks.sh. One lock hold per scenario (each under 5 min).
NP=$1; D=/tmp/netns
G=$(python3 -c "print(','.join(str(r*2//$NP) for r in range($NP)))")
run() {   # run BYTES ITERS extra-args...
  local b=$1 it=$2; shift 2
  timeout 280 $D/mpirun-ns.sh $NP ofi -- $D/venv/bin/python $D/tree_bench.py time --bytes $b --groups $G \
      --iters $it --warmup 1 "$@" 2>&1 | grep -v "^$" | tail -4
}
scenario() {   # scenario NAME SETUP-CMD [bench args]
  local name=$1 setup=$2; shift 2
  echo "## P=$NP $name ($setup)"
  flock $D/../pc-bench.lock bash -c "$setup >/dev/null 2>&1; $(declare -f run); D=$D NP=$NP G=$G; run 1048576 8 $*; run 16777216 3 $*; $D/linkctl.sh clear all >/dev/null 2>&1; $D/racks.sh clear $NP >/dev/null 2>&1"
}
scenario "base" "true"
scenario "slow link: pcn1 +2 ms each way" "$D/linkctl.sh set pcn1 delay 2ms"
scenario "slow link: pcn1 200 Mbit/s" "$D/linkctl.sh set pcn1 rate 200mbit"
scenario "late sender: rank 1 posts 20 ms late" "true" --late 1:20
scenario "two racks: 200 Mbit/s per host to the other rack" "$D/racks.sh set $NP 200mbit"
