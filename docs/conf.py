"""Sphinx configuration of the documentation site (``//docs:site``)."""

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import apiref

import quantrules

project = "quantlattice"
author = "the quantlattice authors"
copyright = "the quantlattice authors"
version = release = quantrules.__version__

extensions = ["sphinx.ext.autodoc"]
exclude_patterns = ["_build"]

# The theme of MLX's and JAX's docs (sphinx-book-theme, in the lock). No
# repository button, launch buttons or version switcher: each would link to
# a place this offline build cannot check. ``_static/custom.css`` wraps code
# examples at the content column's width (no horizontal scroll at 1280 px;
# tools/docs_screenshot.sh checks it).
html_theme = "sphinx_book_theme"
html_title = "quantlattice"
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_copy_source = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

# The API pages are generated from each public module's __all__.
apiref.write_pages(os.path.join(os.path.dirname(os.path.abspath(__file__)), "api"))


def _google_sections(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """``Args:``/``Returns:``/``Raises:`` sections as fields (napoleon's
    Google style), except in attribute docstrings, whose ``x: text`` first
    lines napoleon would read as a type."""
    if what in ("attribute", "data", "property"):
        return
    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    config = Config(napoleon_numpy_docstring=False)
    lines[:] = GoogleDocstring(lines, config, what=what, name=name, obj=obj, options=options).lines()


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _google_sections)
