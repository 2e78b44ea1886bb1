"""Build a wheel, or a source distribution, from files named on the command line.

No setuptools: writes the `.dist-info` (METADATA, WHEEL, RECORD) itself; with
`--sdist` it writes `<name>-<version>.tar.gz` instead: the same sources, the
same metadata as PKG-INFO, and a pyproject.toml (flit_core backend) from which
pip builds an equivalent pure-Python wheel. Exact pins (`==`,
for ABI-coupled packages) come from the hashed lock file; lower bounds (`>=`)
come from the minimums file (third_party/python/requirements_min.txt, the
oldest versions the package tests pass with, tools/test_minimums.sh) when one
is given, else from the lock.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import io
import re
import sys
import tarfile
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)  # reproducible timestamps
_EPOCH_SECONDS = 315532800  # the same instant for the sdist: wheels built from it need >= 1980


_EXTRA = re.compile(r"extra == '([a-z0-9-]+)'")


def _lock_versions(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\]+)", line)
            if m:
                pins[_normalize(m.group(1))] = m.group(2)
    return pins


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version (2.0.2 -> (2, 0, 2))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _import_name(entries: list[tuple[str, bytes]]) -> str:
    """The top-level package the wheel installs (may differ from the distribution)."""
    tops = sorted({name.split("/", 1)[0] for name, _ in entries if "/" in name})
    return ", ".join(tops)


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pyproject(dist: str, version: str, summary: str, requires: list[str], module: str) -> str:
    """A PEP 621 pyproject.toml that flit_core builds into the same wheel contents."""
    deps = "".join(f"    {_toml_string(r)},\n" for r in sorted(requires))
    return (
        "[build-system]\n"
        'requires = ["flit_core>=3.4,<4"]\n'
        'build-backend = "flit_core.buildapi"\n'
        "\n"
        "[project]\n"
        f"name = {_toml_string(dist)}\n"
        f"version = {_toml_string(version)}\n"
        f"description = {_toml_string(summary)}\n"
        'requires-python = ">=3.11"\n'
        f"dependencies = [\n{deps}]\n"
        "\n"
        "[tool.flit.module]\n"
        f"name = {_toml_string(module)}\n"
    )


def _write_sdist(
    out: str,
    dist: str,
    version: str,
    summary: str,
    requires: list[str],
    entries: list[tuple[str, bytes]],
    pkg_info: str,
) -> None:
    """`<dist>-<version>.tar.gz` with reproducible headers (fixed mtime, root-owned)."""
    if any(name.endswith((".so", ".pyd", ".dylib")) for name, _ in entries):
        sys.exit("build_wheel: --sdist takes pure-Python sources only")
    module = _import_name(entries)
    if not module or ", " in module:
        sys.exit(f"build_wheel: --sdist needs exactly one import package, found {module!r}")
    root = f"{dist}-{version}"
    files = [
        *entries,
        ("PKG-INFO", pkg_info.encode()),
        ("pyproject.toml", _pyproject(dist, version, summary, requires, module).encode()),
    ]
    with (
        open(out, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=_EPOCH_SECONDS) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, data in sorted(files):
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = _EPOCH_SECONDS
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--distribution", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--lock", required=True)
    p.add_argument("--strip-prefix", required=True)
    p.add_argument("--minimums", default="", help="pins used as the lower bounds of '>='")
    p.add_argument("--summary", default="")
    p.add_argument("--requires", action="append", default=[])
    p.add_argument("--sibling", action="append", default=[])
    p.add_argument("--file", action="append", default=[])
    p.add_argument("--sdist", action="store_true", help="write a source distribution (.tar.gz)")
    a = p.parse_args()

    version = a.version
    pins = _lock_versions(a.lock)
    minimums = _lock_versions(a.minimums) if a.minimums else {}
    requires = [f"{s}=={version}" for s in a.sibling]
    for spec in a.requires:
        name, op = spec.split(" ", 1)
        op, _, marker = op.partition(";")
        key = _normalize(name.split("[")[0])
        if key not in pins:
            sys.exit(f"build_wheel: {name!r} is not in the lock file")
        bound = pins[key]
        if op == ">=" and a.minimums:
            if key not in minimums:
                sys.exit(f"build_wheel: {name!r} has no tested minimum in {a.minimums}")
            bound = minimums[key]
            if _release(bound) > _release(pins[key]):
                sys.exit(
                    f"build_wheel: minimum {name}=={bound} is newer than the lock's {pins[key]}"
                )
        req = f"{name}{op}{bound}"
        requires.append(f"{req}; {marker.strip()}" if marker else req)

    # Optional dependencies: a requirement whose marker names an extra
    # (`extra == 'las'`) is installed by `pip install 'dist[las]'`.
    extras = sorted({m.group(1) for r in requires for m in [_EXTRA.search(r)] if m})

    dist = a.distribution.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    tag = a.tag
    entries: list[tuple[str, bytes]] = []
    prefix = a.strip_prefix.rstrip("/") + "/"
    for item in sorted(a.file):
        short, path = item.split("=", 1)
        if not short.startswith(prefix):
            sys.exit(f"build_wheel: {short} is not under {prefix}")
        arcname = short[len(prefix) :]
        if "/__pycache__/" in arcname:
            continue
        with open(path, "rb") as f:
            entries.append((arcname, f.read()))

    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {a.distribution}",
        f"Version: {version}",
        f"Summary: {a.summary}",
        "Requires-Python: >=3.11",
        *[f"Provides-Extra: {e}" for e in extras],
        *[f"Requires-Dist: {r}" for r in sorted(requires)],
        "Description-Content-Type: text/markdown",
        "",
        f"# {a.distribution}",
        "",
        a.summary,
        "",
        f"Import name: `{_import_name(entries)}`. Part of the quantlattice monorepo, "
        "released together at one version.",
    ]
    if a.sdist:
        _write_sdist(a.out, dist, version, a.summary, requires, entries, "\n".join(metadata) + "\n")
        return 0
    wheel = [
        "Wheel-Version: 1.0",
        "Generator: quantlattice build_wheel",
        f"Root-Is-Purelib: {'true' if tag.endswith('-none-any') else 'false'}",
        f"Tag: {tag}",
    ]
    entries.append((f"{info}/METADATA", ("\n".join(metadata) + "\n").encode()))
    entries.append((f"{info}/WHEEL", ("\n".join(wheel) + "\n").encode()))
    record = [_record_line(n, d) for n, d in entries] + [f"{info}/RECORD,,"]
    entries.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))

    with zipfile.ZipFile(a.out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zi = zipfile.ZipInfo(name, date_time=_EPOCH)
            zi.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
