"""buildifier (npm @bazel/buildifier, third_party/buildifier) over every BUILD/.bzl file.

Formatting must be exact (`--mode=check`) and lint warnings absent
(`--lint=warn`), except those switched off below, each with its reason.

The files are found in the source tree the runfiles link to, so this test is
tagged `external` (never cached): Bazel does not track every BUILD file as an
input. ./bazelw installs buildifier with `npm ci` and passes its path in
QUANTLATTICE_BUILDIFIER.

Formatting every file in place (after one ./bazelw run installed buildifier):

    python3 tools/buildifier_test.py --fix
"""

import glob
import os
import pathlib
import subprocess
import sys

NAMES = {"BUILD", "BUILD.bazel", "MODULE.bazel", "WORKSPACE", "WORKSPACE.bazel"}
SKIP_DIRS = {".git", "node_modules", ".venv"}

# Warnings that cannot be fixed while Bazel 4.2 (no rules_shell, native-only
# rule sets) stays a supported lane; everything else is on.
DISABLED = [
    "native-sh-binary",  # Bazel 4.2 has no rules_shell; sh_* rules stay native
    "native-sh-test",
]
# The Bazel 4 shims exist to forward to the native rules.
SHIM_DISABLED = [
    *DISABLED,
    "native-cc-binary",
    "native-cc-import",
    "native-cc-library",
    "native-cc-test",
    "native-cc-proto",
    "native-cc-toolchain",
    "native-cc-toolchain-suite",
    "native-cc-objc-library",
    "native-java-binary",
    "native-java-import",
    "native-java-library",
    "native-java-runtime",
    "native-java-test",
    "native-java-toolchain",
    "native-py",
]
SHIMS = ("third_party/rules_cc/", "third_party/rules_java/", "third_party/rules_python/",
         "third_party/remote_coverage_tools/")  # fmt: skip


def source_root(marker: str) -> pathlib.Path:
    """The checkout the runfile `marker` (MODULE.bazel) links to."""
    return pathlib.Path(os.path.realpath(marker)).parent


def build_files(root: pathlib.Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = pathlib.Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS and not (rel == pathlib.Path(".") and d.startswith("bazel-"))
        )
        for name in sorted(filenames):
            if name in NAMES or name.endswith(".bzl"):
                found.append(str(rel / name))
    return found


def run(buildifier: str, root: pathlib.Path, files: list[str], disabled: list[str]) -> int:
    if not files:
        return 0
    warnings = "-" + ",-".join(disabled)
    result = subprocess.run(
        [buildifier, "--mode=check", "--lint=warn", f"--warnings={warnings}", *files],
        cwd=root,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


def find_buildifier() -> str:
    """QUANTLATTICE_BUILDIFIER, else the copy ./bazelw installed in the cache."""
    if os.environ.get("QUANTLATTICE_BUILDIFIER"):
        return os.environ["QUANTLATTICE_BUILDIFIER"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine, "")
    pattern = (
        f"{cache}/quantlattice/buildifier-*/node_modules/@bazel/buildifier/buildifier-linux_{arch}"
    )
    found = sorted(glob.glob(pattern), key=os.path.getmtime)
    return found[-1] if found else ""


def fix(buildifier: str, root: pathlib.Path) -> int:
    files = build_files(root)
    result = subprocess.run([buildifier, "--mode=fix", "--lint=off", *files], cwd=root)
    print(f"formatted {len(files)} BUILD/.bzl files under {root}")
    return result.returncode


def main(argv: list[str]) -> int:
    buildifier = find_buildifier()
    if not buildifier or not os.access(buildifier, os.X_OK):
        print("QUANTLATTICE_BUILDIFIER is not an executable buildifier; run through ./bazelw "
              "(it installs third_party/buildifier with npm ci).", file=sys.stderr)  # fmt: skip
        return 2
    if argv == ["--fix"]:
        return fix(buildifier, pathlib.Path(__file__).resolve().parent.parent)
    root = source_root(argv[0])
    files = build_files(root)
    if "MODULE.bazel" not in files or "tools/py.bzl" not in files:
        print(f"did not find the checkout's build files under {root}", file=sys.stderr)
        return 2
    shims = [f for f in files if f.startswith(SHIMS)]
    rest = [f for f in files if not f.startswith(SHIMS)]
    status = run(buildifier, root, rest, DISABLED) | run(buildifier, root, shims, SHIM_DISABLED)
    if status:
        print("buildifier found problems; format with: python3 tools/buildifier_test.py --fix",
              file=sys.stderr)  # fmt: skip
    else:
        print(f"{len(files)} BUILD/.bzl files formatted and lint-clean")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
