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

html_theme = "alabaster"
html_theme_options = {"description": "quantization rules, quantized JAX ops, sparse 3-D convolution on MLX"}
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
