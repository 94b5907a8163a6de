"""The ownership stress (bench/stress.py), short: four threads per rank post, wait, test,
close, abandon and drop at random on two collectives (several threads on one request,
out= buffers lent again; in mode solo a collective's thread closes it mid-epoch where
every rank's plan says so, close() being collective), every mode and late, P = 2 (idle "spin") and 3 (the default);
and once under the engine built with AddressSanitizer and with ThreadSanitizer
(tests/sanitize.py), where the compiler has their runtimes.

The full runs: flock /tmp/pc-bench.lock mpiexec -n 3 python bench/soak.py --ops 10000
(every mode and late: 10^5 operations per rank; docs/results.md, "Ownership stress")."""
from __future__ import annotations

import pytest

import sanitize



# one idle policy per P: polling at 2, the default at 3 (which sleeps there, on two cores)
@pytest.mark.parametrize("nprocs,idle", [(2, "spin"), (3, None)])
def test_stress(mpirun, nprocs, idle):
    env = {"PARTIALCOLL_IDLE": idle} if idle else {}
    mpirun("stress_checks.py", nprocs, "300", timeout=150, env=env)


@pytest.mark.parametrize("which", sanitize.SANITIZERS)
def test_stress_sanitized(mpirun, which, request):
    """The short stress on the engine built with -fsanitize=which: no report, nothing wrong."""
    engine = sanitize.engine(which, request.config.cache.mkdir(f"engine-{which}"))
    out = mpirun("stress_checks.py", 2, "200", "--modes", "solo,full", timeout=300,
                 env=sanitize.env(which, engine))
    sanitize.check_clean(which, out)
