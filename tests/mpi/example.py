"""Run one of examples/ under this launcher: python example.py NAME [ARGS ...]

The example runs as its own __main__ (runpy), with ARGS as its command line; PASSED
<rank> follows where it returned (tests/test_examples.py checks what it printed).
"""
from __future__ import annotations

import os
import runpy
import sys

from _util import main

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def run(comm) -> None:
    name, *args = sys.argv[1:]
    sys.argv = [name, *args]
    runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")


if __name__ == "__main__":
    main(run)
