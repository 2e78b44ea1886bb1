"""The wheels can be published: twine's metadata check and, for native wheels,
auditwheel's symbol analysis against the manylinux tag the wheel carries.

auditwheel leaves one external library allowed: libmlx.so, which the `mlx`
wheel provides (the extension's rpath points into site-packages/mlx/lib), so
`overall_tag` stays linux_x86_64 while `sym_tag` is what the tag rests on.

    wheel_audit_test.py WHEEL...
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

ALLOWED_EXTERNAL = {"libmlx.so"}


def glibc_minor(tag: str) -> int:
    found = re.search(r"manylinux_2_(\d+)_", tag)
    if not found:
        raise ValueError(f"not a manylinux_2_x tag: {tag!r}")
    return int(found.group(1))


def audit(wheel: str) -> list[str]:
    platform = wheel.rsplit("-", 1)[1].removesuffix(".whl")
    if platform == "any":
        return []
    if not platform.startswith("manylinux_"):
        return [f"{wheel}: platform tag {platform!r} is not a manylinux tag"]
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", wheel],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return [f"{wheel}: auditwheel show failed:\n{shown.stderr}"]
    report = json.loads(shown.stdout)
    problems = []
    external = set(report["external_libs"])
    if external - ALLOWED_EXTERNAL:
        problems.append(f"{wheel}: external libraries {sorted(external - ALLOWED_EXTERNAL)}")
    if report["unsupported_isa"]:
        problems.append(f"{wheel}: auditwheel found unsupported ISA extensions")
    if glibc_minor(report["sym_tag"]) > glibc_minor(platform):
        problems.append(
            f"{wheel}: symbols need {report['sym_tag']}, tagged {platform} "
            "(raise MANYLINUX_GLIBC_MINOR in tools/wheel.bzl)"
        )
    elif glibc_minor(report["sym_tag"]) < glibc_minor(platform):
        print(f"{wheel}: this build's symbols would allow {report['sym_tag']}")
    print(
        f"{wheel}: tagged {platform}; auditwheel: symbols {report['sym_tag']}, external {sorted(external)}"
    )
    return problems


def main(wheels: list[str]) -> int:
    assert glibc_minor("manylinux_2_39_x86_64") == 39
    problems = []
    for wheel in wheels:
        problems += audit(wheel)
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *wheels])
    if checked.returncode != 0:
        problems.append("twine check --strict failed")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
