"""Sphinx configuration: the manual (Markdown pages, through myst-parser) and the API
reference generated from the docstrings (autodoc + napoleon, Google style).

Build: ``sphinx-build -W -b html docs build/docs`` (``tests/test_docs.py`` does this in
the test suite, warnings as errors).
"""
import importlib.util
import os
import re
import sys

# The installed partialcoll (pip install -e . makes it this tree); the source tree itself only
# where none is installed (its extension must then have been built in place).
if importlib.util.find_spec("partialcoll") is None:
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

project = "partialcoll"
author = "the partialcoll authors"
copyright = "the partialcoll authors, BSD-3-Clause"

try:
    from partialcoll._version import __version__ as release
except ImportError:  # pragma: no cover - the build needs the package, as autodoc does
    release = "unknown"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
master_doc = "index"
exclude_patterns = ["_build"]

# Markdown: "#anchors" to headings, and GitHub-style tables.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

# API reference: Google-style docstrings (napoleon), members in source order, the
# signatures' type hints in the description.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list: the __slots__ are not described twice
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
autodoc_preserve_defaults = True      # MPI.SUM, MPI.COMM_WORLD as written, not their reprs
# the package's type aliases (partialcoll/_typing.py) by name, not expanded
autodoc_type_aliases = {name: name for name in ("Buffer", "ReduceOp", "ComputeOp", "DTypeLike")}

# Optional dependencies of the integrations: where they are not installed the reference
# is built from mocks (the reference of partialcoll.integrations.torch then still renders).
autodoc_mock_imports = [m for m in ("torch", "cupy") if importlib.util.find_spec(m) is None]



def _index_lists_what_exists(app, docname, source):
    """The index's toctree names pages in reading order, some of which may not exist yet in
    a checkout (pages are added alongside the code): entries without a page are dropped, and
    pages it does not name are listed before the API reference, so the build never fails on
    the index alone. Rows of the index's table that link a missing page are left out too."""
    if docname != "index":
        return
    here = os.path.dirname(os.path.abspath(__file__))
    pages = {os.path.splitext(f)[0] for f in os.listdir(here) if f.endswith(".md")} - {"index"}
    text = source[0]
    start = text.index("```{toctree}")
    end = text.index("```", start + 3)
    lines = text[start:end].split("\n")
    entries = [ln.strip() for ln in lines[1:] if ln.strip() and not ln.strip().startswith(":")]
    kept = [e for e in entries if e in pages]
    extra = sorted(pages - set(kept))
    at = kept.index("api") if "api" in kept else len(kept)
    kept[at:at] = extra
    options = [ln for ln in lines[1:] if ln.strip().startswith(":")]
    block = "\n".join([lines[0], *options, "", *kept, ""])
    text = text[:start] + block + text[end:]
    # and the table above it: a row that links a page not in this checkout is left out
    rows = [ln for ln in text.split("\n")
            if not any(m not in pages for m in re.findall(r"\]\(([\w-]+)\.md\)", ln))]
    source[0] = "\n".join(rows)


def setup(app):
    app.connect("source-read", _index_lists_what_exists)

html_theme = "alabaster"
html_title = f"partialcoll {release}"
