"""Static checks, configured in pyproject.toml: mypy over the package (it ships py.typed) and
ruff over the whole tree. The test extra installs both; without them these skip and say so."""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import background_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install -e '.[test]' installs it)")


def _run(argv, timeout):
    out = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.background("mypy", [sys.executable, "-m", "mypy"])
def test_mypy_clean(request):
    """mypy partialcoll with the project's settings: no errors (only stub-less packages
    ignored). It runs in the background from the session's start (conftest.py), on the
    cores the multi-rank tests leave idle."""
    _need("mypy", "torch")          # the integration is checked against torch's own types
    rc, output, _ = background_result(request, timeout=600)
    assert rc == 0, output


def test_ruff_clean():
    """ruff check with the project's rules (pyproject.toml [tool.ruff]): nothing reported."""
    _need("ruff")
    rc, output = _run(["ruff", "check", "--no-cache", "."], timeout=300)
    assert rc == 0, output
