#!/bin/bash
# racks.sh (bench/tree_racks.sh) set NP RATE | clear NP -- two racks (hosts 0..NP/2-1 and NP/2..NP-1): each
# host's egress towards the other rack goes through an htb class of RATE (its uplink),
# traffic inside its rack is not shaped.
set -u
cmd=$1; NP=$2; RATE=${3:-200mbit}; half=$((NP/2))
for i in $(seq 0 $((NP-1))); do
  tc -n pcn$i qdisc del dev eth0 root 2>/dev/null
  [ "$cmd" = set ] || continue
  tc -n pcn$i qdisc add dev eth0 root handle 1: htb default 10
  tc -n pcn$i class add dev eth0 parent 1: classid 1:10 htb rate 20gbit quantum 200000
  tc -n pcn$i class add dev eth0 parent 1: classid 1:20 htb rate $RATE burst 256kb cburst 256kb quantum 60000
  for j in $(seq 0 $((NP-1))); do
    if [ $((i / half)) != $((j / half)) ]; then
      tc -n pcn$i filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.77.0.1$j/32 flowid 1:20
    fi
  done
done
true
