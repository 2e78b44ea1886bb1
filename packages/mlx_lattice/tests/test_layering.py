"""Layering: mlx_lattice sees quantrules (declared) but not taktiny_ops."""

import importlib.util
import re

import mlx_lattice
import quantrules


def test_version_matches_sibling():
    assert re.fullmatch(r"\d+\.\d+\.\d+", mlx_lattice.__version__)
    assert mlx_lattice.__version__ == quantrules.__version__


def test_undeclared_sibling_is_not_importable():
    assert importlib.util.find_spec("taktiny_ops") is None
