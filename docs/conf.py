"""Sphinx configuration: the manual (Markdown pages, through myst-parser) and the API
reference generated from the docstrings (autodoc + napoleon, Google style).

Build: ``sphinx-build -W -b html docs build/docs`` (``tests/test_docs.py`` does this in
the test suite, warnings as errors).
"""
import importlib.util
import os
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
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}

# Optional dependencies of the integrations: where they are not installed the reference
# is built from mocks (the reference of partialcoll.integrations.torch then still renders).
autodoc_mock_imports = [m for m in ("torch", "cupy") if importlib.util.find_spec(m) is None]

suppress_warnings = ["toc.empty_glob"]  # pages the index names by pattern may not exist yet

html_theme = "alabaster"
html_title = f"partialcoll {release}"
