"""Build the documentation site: ``build_site.py OUT_DIR [BUILDER]``.

Copies the sources next to this file (the ``.rst`` pages, ``conf.py``,
``apiref.py``) into a scratch directory, where ``conf.py`` writes the API
pages, and runs ``sphinx-build -W --keep-going -b BUILDER`` (``html`` by
default) into ``OUT_DIR``: any warning fails the build.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

__all__ = ["build", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))


def build(out_dir: str, builder: str = "html", sources: str = HERE) -> int:
    """Build the site in ``sources`` with ``builder`` into ``out_dir``;
    Sphinx's exit status (non-zero on any warning)."""
    from sphinx.cmd.build import build_main

    with tempfile.TemporaryDirectory(prefix="docs-src-") as scratch:
        src = os.path.join(scratch, "docs")
        shutil.copytree(sources, src, ignore=shutil.ignore_patterns("*.py[co]", "__pycache__", "api", "BUILD*", "*.bzl"))
        args = ["-W", "--keep-going", "-q", "-j", "1", "-b", builder,
                "-d", os.path.join(scratch, "doctrees"), src, os.path.abspath(out_dir)]
        return build_main(args)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    return build(*argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
