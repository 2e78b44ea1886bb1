"""Write a package's `_version.py` from tools/version.bzl's VERSION."""

import sys

version, out = sys.argv[1:]
with open(out, "w") as f:
    f.write('"""Generated from tools/version.bzl by the build; do not edit."""\n\n')
    f.write("#: The version of this package (one for the three packages, from tools/version.bzl).\n")
    f.write(f'__version__ = "{version}"\n')
