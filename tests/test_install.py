"""The README's two commands are what CI runs (.ci/run), and nothing else installs the tests."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands():
    """.ci/run's commands, comments and the optional extras (iptables, the second MPI) aside,
    are exactly the README's two, in order."""
    install, test = readme_commands()
    assert "pip install -e \".[test]\"" in install and test == "pytest", (install, test)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    pip = [line for line in lines if "pip install" in line]
    assert pip == [install], pip                    # the README's install, and no other
    assert lines.index(install) < lines.index(test) and lines[-1] == test, lines
