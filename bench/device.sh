#!/usr/bin/env bash
# One command for a GPU node (one rank per GPU, cores to spare): set up, then measure.
#
#   bash bench/device.sh                                   # every step (about 8 min on an H100 node)
#   bash bench/device.sh --steps info,engine,psld          # the engine's threads, PSLD (~2 min)
#   bash bench/device.sh --steps info,gpu-tests,cuda-torch,buffers,fold   # the GPU paths (~4 min)
#   bash bench/device.sh --steps fig9,torch                # Fig. 9, the torch table (~2.5 min)
#   bash bench/device.sh --dry                             # CPU parts at P = 2, GPU steps skipped
#   python bench/device_report.py --merge a.json b.json --out DIR    # one report of both parts
#
# Setup (each action recorded in the report; a failure is recorded and the steps go on):
#   wheels  the machine reaches no package registry: wheels for its Python carried in .whl/
#           (DEVELOPERS.md) are installed under $PC_DEVICE_PREFIX (default /tmp/pc-device) where
#           mpi4py, cffi or mpiexec are missing; where they import already, nothing is installed
#   build   the native engine, built in place (python native/build_engine.py) unless it loads
# then bench/device_report.py runs the steps and writes report.md and report.json into --out
# (default: $OUT where the device tool sets it, else ./device-report). PC_DEVICE_DRY=1 = --dry.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
PREFIX=${PC_DEVICE_PREFIX:-/tmp/pc-device}
OUTDIR=${OUT:-$REPO/device-report}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[i]}" = "--out" ] && OUTDIR=${args[i + 1]}
done
mkdir -p "$OUTDIR"
SETUP=$OUTDIR/setup.jsonl
: >"$SETUP"

record() {   # step status seconds detail
    "$PY" -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "status": sys.argv[2],
"seconds": float(sys.argv[3]), "detail": sys.argv[4][-4000:]}))' "$1" "$2" "$3" "$4" >>"$SETUP"
    echo "# setup $1: $2 ($3 s)" >&2
}

# what the installed wheels provide, for this and every later process
site=$("$PY" -c "import sysconfig; v = {'base': '$PREFIX', 'platbase': '$PREFIX'}
print(sysconfig.get_path('purelib', 'posix_prefix', v) + ':' + sysconfig.get_path('platlib', 'posix_prefix', v))")
export PATH=$PREFIX/bin:$(dirname "$(command -v "$PY")"):$PATH
export PYTHONPATH=$REPO:$site${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

missing() {   # what the run needs and does not find
    local out=""
    "$PY" -c "import mpi4py.MPI" 2>/dev/null || out+=" mpi4py(+libmpi)"
    "$PY" -c "import cffi" 2>/dev/null || out+=" cffi"
    command -v mpiexec >/dev/null || out+=" mpiexec"
    "$PY" -c "import pytest_mpi" 2>/dev/null || out+=" pytest-mpi"
    echo "$out"
}

t0=$SECONDS
need=$(missing)
if [ -z "$need" ]; then
    record wheels "already installed" $((SECONDS - t0)) "mpi4py, cffi and $(command -v mpiexec) found"
elif compgen -G ".whl/*.whl" >/dev/null; then
    log=$("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --prefix "$PREFIX" .whl/*.whl 2>&1)
    rc=$?
    still=$(missing)
    if [ $rc -eq 0 ] && [ -z "$still" ]; then
        record wheels installed $((SECONDS - t0)) "missing before:$need; installed $(ls .whl | tr '\n' ' ')"
    else
        record wheels failed $((SECONDS - t0)) "pip exit $rc; still missing:$still; $log"
    fi
else
    record wheels failed $((SECONDS - t0)) "missing:$need and no wheels in .whl/ (DEVELOPERS.md: carrying wheels)"
fi

t0=$SECONDS
if "$PY" -c "import partialcoll._native" 2>/dev/null; then
    record build "already built" $((SECONDS - t0)) "$("$PY" -c 'import partialcoll._native as n; print(n.__file__)')"
else
    log=$("$PY" native/build_engine.py 2>&1)
    if "$PY" -c "import partialcoll._native" 2>/dev/null; then
        record build built $((SECONDS - t0)) "python native/build_engine.py (in place)"
    else
        record build failed $((SECONDS - t0)) "$log"
    fi
fi

exec "$PY" bench/device_report.py --setup-log "$SETUP" --out "$OUTDIR" "$@"
