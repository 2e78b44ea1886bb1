"""Release the three packages to a package index.

    ./bazelw run //:publish -- --repository-url URL [--index-url URL] [--dry-run]

Bazel builds the wheels and sdists (they are this binary's data); the command
then

1. checks that every distribution carries the one version of tools/version.bzl
   and MODULE.bazel (file name and metadata) and pins its siblings to it;
2. audits them: `twine check --strict`, and `auditwheel show` on each native
   wheel, whose tag and symbols must be no newer than manylinux_2_<minor> with
   the minor of MANYLINUX_GLIBC_MINOR in tools/wheel.bzl;
3. refuses when the index already holds this version of any of the projects
   (its simple pages: `--index-url`, by default `<repository-url>simple/`);
4. uploads with `twine upload` (credentials: `--username`/`--password` or
   twine's TWINE_USERNAME/TWINE_PASSWORD); `--dry-run` stops before this step
   and prints what it would upload.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile

__all__ = ["ReleaseError", "main"]

# The extension links against libmlx.so, which the `mlx` wheel provides.
ALLOWED_EXTERNAL = {"libmlx.so"}


class ReleaseError(RuntimeError):
    """A check failed; nothing was uploaded."""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_version(version_bzl: pathlib.Path, module_bazel: pathlib.Path) -> str:
    """VERSION of tools/version.bzl, checked against MODULE.bazel's module version."""
    found = re.search(r'^VERSION = "([^"]+)"', version_bzl.read_text(), re.M)
    if not found:
        raise ReleaseError(f'{version_bzl}: no VERSION = "..." line')
    module = re.search(r"module\((.*?)\)", module_bazel.read_text(), re.S)
    module_version = re.search(r'version = "([^"]+)"', module.group(1)) if module else None
    if not module_version:
        raise ReleaseError(f"{module_bazel}: no module(version = ...)")
    if module_version.group(1) != found.group(1):
        raise ReleaseError(
            f"versions disagree: {version_bzl} says {found.group(1)}, "
            f"{module_bazel} says {module_version.group(1)}"
        )
    return found.group(1)


def read_glibc_minor(wheel_bzl: pathlib.Path) -> int:
    """MANYLINUX_GLIBC_MINOR of tools/wheel.bzl: the newest manylinux_2_<minor> allowed."""
    found = re.search(r"^MANYLINUX_GLIBC_MINOR = (\d+)", wheel_bzl.read_text(), re.M)
    if not found:
        raise ReleaseError(f"{wheel_bzl}: no MANYLINUX_GLIBC_MINOR = <int> line")
    return int(found.group(1))


def _metadata(dist: pathlib.Path) -> dict[str, list[str]]:
    if dist.name.endswith(".whl"):
        with zipfile.ZipFile(dist) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            text = zf.read(name).decode()
    else:
        with tarfile.open(dist) as tar:
            member = next(
                m
                for m in tar.getmembers()
                if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
            )
            text = tar.extractfile(member).read().decode()
    fields: dict[str, list[str]] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        fields.setdefault(key, []).append(value)
    return fields


def project_of(dist: pathlib.Path) -> tuple[str, str]:
    """(project, version) from a wheel's or sdist's file name."""
    name = dist.name
    if name.endswith(".whl"):
        parts = name[: -len(".whl")].split("-")
        if len(parts) != 5:
            raise ReleaseError(f"{name}: not a wheel file name")
        return parts[0], parts[1]
    if name.endswith(".tar.gz"):
        project, _, version = name[: -len(".tar.gz")].rpartition("-")
        return project, version
    raise ReleaseError(f"{name}: neither a wheel nor a .tar.gz sdist")


def check_versions(dists: list[pathlib.Path], version: str) -> dict[str, list[pathlib.Path]]:
    """Every file carries `version`; sibling pins match it. Returns project -> files."""
    projects: dict[str, list[pathlib.Path]] = {}
    for dist in dists:
        project, file_version = project_of(dist)
        projects.setdefault(project, []).append(dist)
        meta = _metadata(dist)
        if file_version != version or meta.get("Version") != [version]:
            raise ReleaseError(
                f"{dist.name}: version {file_version} (metadata {meta.get('Version')}), "
                f"tools/version.bzl says {version}"
            )
        if _normalize(meta["Name"][0]) != _normalize(project):
            raise ReleaseError(f"{dist.name}: metadata names {meta['Name'][0]!r}")
    for dist in dists:
        for req in _metadata(dist).get("Requires-Dist", []):
            name = _normalize(re.split(r"[\s=<>!~;\[]", req, maxsplit=1)[0])
            if name in {_normalize(p) for p in projects} and f"=={version}" not in req:
                raise ReleaseError(f"{dist.name}: sibling requirement {req!r} is not =={version}")
    for project, files in projects.items():
        if not any(f.name.endswith(".whl") for f in files):
            raise ReleaseError(f"{project}: no wheel among {[f.name for f in files]}")
    return projects


def _glibc_minor(tag: str) -> int:
    found = re.search(r"manylinux_2_(\d+)_", tag)
    if not found:
        raise ReleaseError(f"not a manylinux_2_<minor> tag: {tag!r}")
    return int(found.group(1))


def audit(dists: list[pathlib.Path], max_glibc_minor: int) -> list[str]:
    """twine check --strict on all, auditwheel on native wheels. Returns report lines."""
    lines = []
    for dist in dists:
        if not dist.name.endswith(".whl"):
            continue
        platform = dist.name[: -len(".whl")].rsplit("-", 1)[1]
        if platform == "any":
            continue
        if not platform.startswith("manylinux_"):
            raise ReleaseError(f"{dist.name}: platform {platform!r} is not a manylinux tag")
        if _glibc_minor(platform) > max_glibc_minor:
            raise ReleaseError(
                f"{dist.name}: tagged {platform}, newer than manylinux_2_{max_glibc_minor} "
                "(MANYLINUX_GLIBC_MINOR in tools/wheel.bzl)"
            )
        shown = subprocess.run(
            [sys.executable, "-m", "auditwheel", "show", "--json", str(dist)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if shown.returncode != 0:
            raise ReleaseError(f"{dist.name}: auditwheel show failed:\n{shown.stderr}")
        report = json.loads(shown.stdout)
        external = set(report["external_libs"])
        if external - ALLOWED_EXTERNAL:
            raise ReleaseError(f"{dist.name}: links external {sorted(external - ALLOWED_EXTERNAL)}")
        if _glibc_minor(report["sym_tag"]) > _glibc_minor(platform):
            raise ReleaseError(f"{dist.name}: symbols need {report['sym_tag']}, tagged {platform}")
        lines.append(
            f"auditwheel: {dist.name}: symbols {report['sym_tag']}, external {sorted(external)}"
        )
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if checked.returncode != 0:
        raise ReleaseError(f"twine check --strict failed:\n{checked.stdout}{checked.stderr}")
    lines.append(f"twine check --strict: {len(dists)} files PASSED")
    return lines


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.files: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            path = urllib.parse.urlparse(href).path
            self.files.append(urllib.parse.unquote(path.rstrip("/").rsplit("/", 1)[-1]))


def published_files(index_url: str, project: str, timeout: float = 30) -> list[str]:
    """File names the index's simple page lists for `project` ([] when it has none)."""
    url = index_url.rstrip("/") + "/" + _normalize(project) + "/"
    if urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise ReleaseError(f"--index-url must be an http(s) URL, not {index_url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) only)
            page = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise ReleaseError(f"cannot read {url}: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ReleaseError(f"cannot read {url}: {e}") from e
    parser = _Links()
    parser.feed(page)
    return parser.files


def already_published(index_url: str, projects: list[str], version: str) -> list[str]:
    """This version's files of `projects` that the index already holds."""
    found = []
    for project in projects:
        for name in published_files(index_url, project):
            try:
                listed_project, listed_version = project_of(pathlib.Path(name))
            except ReleaseError:
                continue
            if _normalize(listed_project) == _normalize(project) and listed_version == version:
                found.append(name)
    return found


def _upload_order(dists: list[pathlib.Path]) -> list[pathlib.Path]:
    """quantrules first (the others require it), wheels before sdists."""

    def key(dist: pathlib.Path) -> tuple[bool, bool, str]:
        return (
            _normalize(project_of(dist)[0]) != "quantrules",
            not dist.name.endswith(".whl"),
            dist.name,
        )

    return sorted(dists, key=key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository-url", required=True, help="the upload URL, as twine takes it")
    p.add_argument(
        "--index-url", help="the index's simple pages (default: <repository-url>simple/)"
    )
    p.add_argument("--dry-run", action="store_true", help="check and audit, but upload nothing")
    p.add_argument("--username", "-u", help="passed to twine (else TWINE_USERNAME)")
    p.add_argument("--password", "-p", help="passed to twine (else TWINE_PASSWORD)")
    p.add_argument("--version-bzl", required=True, type=pathlib.Path)
    p.add_argument("--module-bazel", required=True, type=pathlib.Path)
    p.add_argument("--wheel-bzl", required=True, type=pathlib.Path)
    p.add_argument("dists", nargs="+", type=pathlib.Path, help="the wheels and sdists to release")
    a = p.parse_args(argv)

    index_url = a.index_url
    if not index_url:
        if a.repository_url.rstrip("/").endswith("/legacy"):
            p.error("--index-url is required for an upload endpoint such as .../legacy/")
        index_url = a.repository_url.rstrip("/") + "/simple/"
    try:
        version = read_version(a.version_bzl, a.module_bazel)
        print(f"version {version} (tools/version.bzl, MODULE.bazel)")
        dists = [d.resolve() for d in a.dists]
        projects = check_versions(dists, version)
        print(f"projects: {', '.join(sorted(projects))}")
        for line in audit(dists, read_glibc_minor(a.wheel_bzl)):
            print(line)
        existing = already_published(index_url, sorted(projects), version)
        if existing:
            raise ReleaseError(
                f"{index_url} already has version {version}: {', '.join(sorted(existing))}; "
                "raise VERSION in tools/version.bzl and MODULE.bazel to release again"
            )
        print(f"{index_url}: no project has version {version} yet")
    except ReleaseError as e:
        print(f"publish: {e}", file=sys.stderr)
        return 1
    ordered = _upload_order(dists)
    verb = "would upload" if a.dry_run else "uploading"
    for dist in ordered:
        digest = hashlib.sha256(dist.read_bytes()).hexdigest()
        print(
            f"{verb} {dist.name} ({dist.stat().st_size} bytes, sha256 {digest}) to {a.repository_url}"
        )
    if a.dry_run:
        print("dry run: nothing uploaded")
        return 0
    command = [
        sys.executable,
        "-m",
        "twine",
        "upload",
        "--non-interactive",
        "--disable-progress-bar",
    ]
    command += ["--repository-url", a.repository_url]
    if a.username:
        command += ["--username", a.username]
    if a.password:
        command += ["--password", a.password]
    result = subprocess.run([*command, *map(str, ordered)], timeout=1800)
    if result.returncode != 0:
        print("publish: twine upload failed", file=sys.stderr)
        return result.returncode
    print(f"uploaded {len(ordered)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
