"""MODULE.bazel's module version is tools/version.bzl's VERSION (one source)."""

import pathlib
import re
import sys


def _read(path: str) -> str:
    return pathlib.Path(path).read_text()


def module_version(text: str) -> str:
    block = re.search(r"^module\((.*?)^\)", text, re.S | re.M)
    if not block:
        raise ValueError("MODULE.bazel has no module(...) call")
    found = re.search(r'^\s*version\s*=\s*"([^"]+)"', block.group(1), re.M)
    if not found:
        raise ValueError("MODULE.bazel's module(...) has no version")
    return found.group(1)


def bzl_version(text: str) -> str:
    found = re.search(r'^VERSION\s*=\s*"([^"]+)"', text, re.M)
    if not found:
        raise ValueError("tools/version.bzl has no VERSION")
    return found.group(1)


def main(argv: list[str]) -> int:
    module, bzl = argv
    a, b = module_version(_read(module)), bzl_version(_read(bzl))
    if a != b:
        print(f"MODULE.bazel says version {a!r} but tools/version.bzl says {b!r}", file=sys.stderr)
        return 1
    # The parser itself must reject a mismatch and a missing version.
    assert module_version('module(\n    name = "x",\n    version = "9.9",\n)\n') == "9.9"
    try:
        module_version('module(\n    name = "x",\n)\n')
    except ValueError:
        pass
    else:
        raise AssertionError("a module() without version was accepted")
    print(f"version {a}: MODULE.bazel and tools/version.bzl agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
