"""The documentation site: API coverage, the built pages.

The guides' ``>>>`` examples run as doctests of the ``.rst`` files (the
target passes them with ``--doctest-glob``); the site itself is built by
``//docs:site`` with ``sphinx-build -W`` (a warning fails the build, and
with it this test, which reads the built site).
"""

from __future__ import annotations

import glob
import os
import sys
import types
import zlib

import apiref
import build_site
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")


def _inventory() -> set[str]:
    """The Python object names in the site's ``objects.inv``."""
    with open(os.path.join(SITE, "objects.inv"), "rb") as f:
        for _ in range(4):  # "# Sphinx inventory version 2", project, version, compression note
            f.readline()
        body = zlib.decompress(f.read()).decode()
    names = set()
    for line in body.splitlines():
        name, domain_role = line.split(" ", 2)[:2]
        if domain_role.startswith("py:"):
            names.add(name)
    return names


MODULES = [m for package in apiref.PACKAGES for m in apiref.public_modules(package)]


def test_documents_every_package_and_public_module():
    assert {"quantrules", "taktiny_ops", "mlx_lattice", "mlx_lattice.ops", "mlx_lattice.nn"} <= set(MODULES)
    assert not [m for m in MODULES if any(p.startswith("_") for p in m.split("."))]
    for module in MODULES:
        assert os.path.isfile(os.path.join(SITE, "api", module + ".html")), module


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_docstring(module):
    assert apiref.undocumented(apiref.entries(module)) == []


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_in_the_api_reference(module):
    assert apiref.missing_from(apiref.entries(module), _inventory()) == []


def test_checks_catch_a_fake_public_name(monkeypatch):
    """By construction: a name added to ``__all__`` without a docstring and
    without a page fails both checks."""
    import quantrules

    def fake_undocumented_name():
        pass

    monkeypatch.setattr(quantrules, "fake_undocumented_name", fake_undocumented_name, raising=False)
    monkeypatch.setattr(quantrules, "__all__", [*quantrules.__all__, "fake_undocumented_name"])
    items = apiref.entries("quantrules")
    assert apiref.undocumented(items) == ["quantrules.fake_undocumented_name"]
    assert apiref.missing_from(items, _inventory()) == ["quantrules.fake_undocumented_name"]


def test_checks_catch_an_undocumented_constant_and_a_missing_all():
    fake = types.ModuleType("quantrules.fake_public")
    fake.LIMIT = 3
    fake.__all__ = ["LIMIT"]
    sys.modules[fake.__name__] = fake
    try:
        assert apiref.undocumented(apiref.entries(fake.__name__)) == ["quantrules.fake_public.LIMIT"]
        fake.__all__ = ["LIMIT", "absent"]
        with pytest.raises(ValueError, match="absent"):
            apiref.entries(fake.__name__)
        del fake.__all__
        with pytest.raises(ValueError, match="__all__"):
            apiref.entries(fake.__name__)
    finally:
        del sys.modules[fake.__name__]


def test_every_page_is_in_the_site():
    pages = [os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "**", "*.rst"), recursive=True)]
    assert "index.rst" in pages and os.path.join("topics", "index.rst") in pages
    for page in pages:
        assert os.path.isfile(os.path.join(SITE, page[: -len(".rst")] + ".html")), page
    with open(os.path.join(SITE, "index.html"), encoding="utf-8") as f:
        index = f.read()
    for linked in ("getting_started.html", "api/index.html", "topics/index.html"):
        assert linked in index


def test_a_warning_fails_the_build(tmp_path):
    """The site's builder runs Sphinx with -W: the same tiny project builds
    cleanly, and fails once one page has a warning (an unknown target)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text('project = "t"\n')
    (src / "index.rst").write_text("Title\n=====\n\nText.\n")
    assert build_site.build(str(tmp_path / "ok"), sources=str(src)) == 0
    assert (tmp_path / "ok" / "index.html").is_file()
    (src / "index.rst").write_text("Title\n=====\n\nSee :doc:`missing_page`.\n")
    assert build_site.build(str(tmp_path / "bad"), sources=str(src)) != 0


def test_taktiny_ops_guide_shows_the_shipped_loader():
    """The plain-JAX loader in the guide is, line for line, taktiny_ops.LOADER."""
    import taktiny_ops

    with open(os.path.join(HERE, "guides", "taktiny_ops.rst")) as f:
        guide = f.read()
    start = guide.index("    import json\n    import jax\n")
    end = guide.index("    y = load(", start)
    shown = "\n".join(line[4:] for line in guide[start:end].rstrip().splitlines()) + "\n"
    assert shown == taktiny_ops.LOADER
