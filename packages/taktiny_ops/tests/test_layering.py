"""Layering: taktiny_ops sees quantrules (declared) but not mlx_lattice."""

import importlib.util
import re

import quantrules
import taktiny_ops


def test_version_matches_sibling():
    assert re.fullmatch(r"\d+\.\d+\.\d+", taktiny_ops.__version__)
    assert taktiny_ops.__version__ == quantrules.__version__


def test_undeclared_sibling_is_not_importable():
    assert importlib.util.find_spec("mlx_lattice") is None
