"""Sphinx configuration: the prose pages (Markdown, through MyST) and an API
reference generated from the numpydoc docstrings (autodoc + napoleon).

Build: ``pip install -e '.[docs]' && sphinx-build -W --keep-going docs <out>``.
"""

from __future__ import annotations

import gpushare

project = "gpushare"
author = "gpushare developers"
copyright = "gpushare developers"  # noqa: A001 - Sphinx's name
release = gpushare.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: anchors for "page.md#heading" links between the pages.
myst_heading_anchors = 3

# numpydoc-style docstrings.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "alabaster"
html_title = f"gpushare {release}"
