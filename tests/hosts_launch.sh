#!/bin/bash
# The "ssh" of mpiexec under pytest --hosts (tests/hosts.py):
#   hosts_launch.sh [ssh options] HOST COMMAND...
# HOST is an emulated host's address $PCH_SUBNET.<i+1>; COMMAND (joined and run by a
# shell, as ssh does) runs inside that host's namespace ${PCH_TAG}h<i> (for Open MPI's
# prted, also in a UTS namespace whose hostname is that namespace's name).
set -u
while [ $# -gt 0 ]; do
  case "$1" in
    -[oplibcFEJLRDSWwmeOQBI]) shift 2 ;;   # ssh options taking a value
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "hosts_launch.sh: usage: [opts] host command..." >&2; exit 255; }
host=${1#*@}; shift
case "$host" in
  "$PCH_SUBNET".*) ns=${PCH_TAG}h$(( ${host##*.} - 1 )) ;;
  *) echo "hosts_launch.sh: unknown host '$host' (expected $PCH_SUBNET.N)" >&2; exit 255 ;;
esac
case "$*" in
  *prted*)   # Open MPI's daemons tell hosts apart by hostname: give this one its own
    exec ip netns exec "$ns" unshare --uts -- /bin/bash -c 'hostname "$1"; exec /bin/bash -c "$2"' launch "$ns" "$*" ;;
  *) exec ip netns exec "$ns" /bin/bash -c "$*" ;;
esac
