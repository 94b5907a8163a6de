"""The manual and its API reference: built by Sphinx with warnings as errors (so a docstring
that does not render, a broken link between pages or a page outside the index fails the
suite), and written for users: no issue numbers, commit hashes or paths outside the
repository in the docs, none of the first in the package, the benchmarks or the examples."""
import glob
import importlib.util
import os
import re
import sys

import pytest

from conftest import background_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [os.path.join(ROOT, "README.md"),
                                                        os.path.join(ROOT, "CHANGELOG.md")]

ISSUE = re.compile(r"\b(issue|stop)s? #?[0-9]+", re.I)
# a commit hash: 7 to 40 hexadecimal characters with a letter and a digit among them
HASH = re.compile(r"(?<![\w.#/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
OUTSIDE = re.compile(r"shared/|/work/|DESIGN\.md")


def _hits(paths, pattern):
    hits = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    return hits


@pytest.mark.parametrize("what,pattern", [("issue numbers", ISSUE), ("commit hashes", HASH),
                                          ("paths outside the repository", OUTSIDE)],
                         ids=["issue-numbers", "commit-hashes", "outside-paths"])
def test_docs_are_for_users(what, pattern):
    """README, CHANGELOG and docs/*.md name no issue, no commit and nothing outside the repository."""
    hits = _hits([p for p in PAGES if os.path.exists(p)], pattern)
    assert not hits, f"{what} in the docs:\n" + "\n".join(hits)


def test_code_names_no_issue_numbers():
    """Comments and docstrings of the package, bench/ and examples/ explain, without issue numbers."""
    paths = [p for d in ("partialcoll", "bench", "examples")
             for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
    hits = _hits(paths, re.compile(r"\bissues? #?[0-9]+", re.I))
    assert not hits, "issue numbers in the code:\n" + "\n".join(hits)


@pytest.mark.background("sphinx", [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                                   "-d", "{tmp}/doctrees", DOCS, "{tmp}/html"])
def test_sphinx_builds_without_warnings(request):
    """sphinx-build -W: the Markdown pages (myst-parser) and the API reference (autodoc +
    napoleon). It runs in the background from the session's start (conftest.py)."""
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install -e '.[test]' installs them)")
    rc, output, where = background_result(request, timeout=300)
    assert rc == 0, f"sphinx-build failed:\n{output}"
    with open(os.path.join(where, "html", "api.html"), encoding="utf-8") as f:
        api = f.read()
    # autodoc found the objects and rendered their docstrings (not only the headings)
    for name in ("partialcoll.PartialAllreduce", "partialcoll.Result", "partialcoll.rc",
                 "partialcoll.integrations.torch.partial_ddp"):
        assert f'id="{name}"' in api, name
    # napoleon turned the Google-style "Attributes:" of Result into a field list, and the
    # type hints became parameter types
    assert ">Variables<" in api and ">Parameters<" in api
