"""Compare two sets of wheels (e.g. the modern and the Bazel 4.2 lane's //:wheels).

Wheels match when their names (platform tag included: both lanes tag the
manylinux level of tools/wheel.bzl, manylinux_2_35), member lists and
.dist-info METADATA and WHEEL files are equal; compiled members may differ in
bytes (different compilers), everything else must be byte-identical. Exits 1
on a difference.

    python3 tools/compare_wheels.py DIR_A DIR_B
"""

from __future__ import annotations

import pathlib
import sys
import zipfile


def describe(wheel: pathlib.Path) -> dict[str, bytes | None]:
    """member -> content (None for compiled members, compared by name only)."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: None if name.endswith((".so", ".dylib", ".pyd", "/RECORD"))
            else archive.read(name)
            for name in sorted(archive.namelist())
        }  # fmt: skip


def compare(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    problems = []
    wheels_a = {w.name: w for w in sorted(a.glob("*.whl"))}
    wheels_b = {w.name: w for w in sorted(b.glob("*.whl"))}
    if not wheels_a:
        problems.append(f"no wheels in {a}")
    if wheels_a.keys() != wheels_b.keys():
        problems.append(f"wheel names differ: {sorted(wheels_a)} vs {sorted(wheels_b)}")
    for name in sorted(wheels_a.keys() & wheels_b.keys()):
        da, db = describe(wheels_a[name]), describe(wheels_b[name])
        if da.keys() != db.keys():
            problems.append(f"{name}: members differ: {sorted(da.keys() ^ db.keys())}")
        for member in sorted(da.keys() & db.keys()):
            if da[member] != db[member]:
                problems.append(f"{name}: {member} differs")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = compare(pathlib.Path(argv[0]), pathlib.Path(argv[1]))
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"wheels in {argv[0]} and {argv[1]} match (names, members, metadata)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
