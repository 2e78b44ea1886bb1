"""Installs wheels offline into a fresh target directory and imports them.

Usage: wheel_install_test.py --module NAME [--requires REQ]... [--smoke CODE] WHEEL...

The import runs in a new process whose PYTHONPATH is only that directory, so
the sources in Bazel's runfiles cannot stand in for the installed package.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile


def _metadata(wheel: pathlib.Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def _installs(wheel: pathlib.Path, module: str) -> bool:
    """Whether the wheel installs the import package `module` (names may differ)."""
    with zipfile.ZipFile(wheel) as zf:
        return any(n.startswith(module + "/") for n in zf.namelist())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--module", required=True)
    p.add_argument("--requires", action="append", default=[])
    p.add_argument("--smoke", default="")
    p.add_argument("wheels", nargs="+")
    a = p.parse_args()

    wheels = [pathlib.Path(w).resolve() for w in a.wheels]
    main_wheel = next(w for w in wheels if _installs(w, a.module))
    meta = _metadata(main_wheel)
    for req in a.requires:
        if f"Requires-Dist: {req}" not in meta.splitlines():
            print(f"FAIL: {main_wheel.name} lacks 'Requires-Dist: {req}':\n{meta}")
            return 1

    base = pathlib.Path(os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp())
    target = base / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(target),
            *map(str, wheels),
        ],
        check=True,
    )
    code = (
        f"import {a.module}, pathlib\n"
        f"path = pathlib.Path({a.module}.__file__).resolve()\n"
        f"assert path.is_relative_to({str(target.resolve())!r}), path\n"
        f"print('imported', {a.module}.__name__, {a.module}.__version__, 'from the wheel')\n"
        + a.smoke
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RUNFILES"))}
    env["PYTHONPATH"] = str(target)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=base)
    if result.returncode == 0:
        print("1 passed, 0 failed")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
