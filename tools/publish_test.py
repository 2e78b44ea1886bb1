"""The release command against a real pypiserver on 127.0.0.1: the dry run
uploads nothing, the upload puts byte-identical files on the index, and a
second release of the same version, a version mismatch or a manylinux level
above tools/wheel.bzl's are refused before anything is uploaded."""

from __future__ import annotations

import hashlib
import pathlib
import re
import shutil

import pytest

from tools import publish
from tools.local_index import local_index

VERSION_BZL = pathlib.Path("tools/version.bzl")
MODULE_BAZEL = pathlib.Path("MODULE.bazel")
WHEEL_BZL = pathlib.Path("tools/wheel.bzl")
DISTS = sorted(pathlib.Path("packages").glob("*/*.whl")) + sorted(
    pathlib.Path("packages").glob("*/*.tar.gz")
)


def _digests(paths: list[pathlib.Path]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _run(
    capsys: pytest.CaptureFixture[str], url: str, *extra: str, **paths: pathlib.Path
) -> tuple[int, str]:
    rc = publish.main(
        [
            "--repository-url",
            url,
            *extra,
            "--version-bzl",
            str(paths.get("version_bzl", VERSION_BZL)),
            "--module-bazel",
            str(MODULE_BAZEL),
            "--wheel-bzl",
            str(paths.get("wheel_bzl", WHEEL_BZL)),
            *map(str, DISTS),
        ]
    )
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_the_release_set():
    # Three wheels (one native), two sdists, all at tools/version.bzl's version.
    version = publish.read_version(VERSION_BZL, MODULE_BAZEL)
    names = sorted(p.name for p in DISTS)
    assert len(names) == 5, names
    assert f"quantrules-{version}.tar.gz" in names and f"taktiny_ops-{version}.tar.gz" in names
    assert sum(n.endswith("-py3-none-any.whl") for n in names) == 2
    assert any(
        re.match(rf"quantlattice_mlx_lattice-{version}-cp3\d+-cp3\d+-manylinux_2_\d+_", n)
        for n in names
    )


def test_dry_run_then_upload_then_refuse(tmp_path, capsys):
    packages = tmp_path / "packages"
    with local_index(packages) as url:
        rc, out = _run(capsys, url, "--dry-run")
        assert rc == 0, out
        assert "dry run: nothing uploaded" in out
        for dist in DISTS:
            assert f"would upload {dist.name} " in out
        assert "twine check --strict: 5 files PASSED" in out
        assert "auditwheel: quantlattice_mlx_lattice-" in out
        assert list(packages.iterdir()) == []

        rc, out = _run(capsys, url, "-u", "x", "-p", "x")
        assert rc == 0, out
        assert "uploaded 5 files" in out
        assert _digests(sorted(packages.iterdir())) == _digests(DISTS)
        version = publish.read_version(VERSION_BZL, MODULE_BAZEL)
        listed = publish.published_files(url + "simple/", "quantlattice-mlx-lattice")
        assert [n for n in listed if n.endswith(".whl")] == [
            d.name for d in DISTS if "mlx_lattice" in d.name
        ]
        assert publish.published_files(url + "simple/", "not-a-project") == []

        # The same version again: refused, the index unchanged.
        before = _digests(sorted(packages.iterdir()))
        rc, out = _run(capsys, url, "-u", "x", "-p", "x")
        assert rc == 1
        assert f"already has version {version}" in out and "quantrules-" in out
        assert "uploading" not in out
        assert _digests(sorted(packages.iterdir())) == before


def test_refuses_a_version_other_than_version_bzl(tmp_path, capsys):
    other = tmp_path / "version.bzl"
    other.write_text(VERSION_BZL.read_text().replace('VERSION = "', 'VERSION = "9', 1))
    with local_index(tmp_path / "packages") as url:
        rc, out = _run(capsys, url, "--dry-run", version_bzl=other)
    assert rc == 1
    assert "versions disagree" in out and "would upload" not in out


def test_refuses_a_manylinux_level_above_wheel_bzl(tmp_path, capsys):
    native = next(d for d in DISTS if "manylinux_2_" in d.name)
    tagged = int(re.search(r"manylinux_2_(\d+)_", native.name).group(1))
    lower = tmp_path / "wheel.bzl"
    text = WHEEL_BZL.read_text()
    assert publish.read_glibc_minor(WHEEL_BZL) >= tagged
    lower.write_text(
        re.sub(r"(?m)^MANYLINUX_GLIBC_MINOR = \d+", f"MANYLINUX_GLIBC_MINOR = {tagged - 1}", text)
    )
    with local_index(tmp_path / "packages") as url:
        rc, out = _run(capsys, url, "--dry-run", wheel_bzl=lower)
    assert rc == 1
    assert f"newer than manylinux_2_{tagged - 1}" in out and "would upload" not in out


def test_refuses_a_wheel_whose_metadata_disagrees(tmp_path):
    wheel = next(d for d in DISTS if d.name.startswith("quantrules-") and d.name.endswith(".whl"))
    version = publish.read_version(VERSION_BZL, MODULE_BAZEL)
    renamed = tmp_path / wheel.name.replace(version, version + ".post1")
    shutil.copy(wheel, renamed)
    with pytest.raises(publish.ReleaseError, match=r"tools/version\.bzl says"):
        publish.check_versions([renamed], version)


def test_upload_endpoint_needs_index_url(capsys):
    with pytest.raises(SystemExit):
        publish.main(
            [
                "--repository-url",
                "http://127.0.0.1:9/legacy/",
                "--version-bzl",
                str(VERSION_BZL),
                "--module-bazel",
                str(MODULE_BAZEL),
                "--wheel-bzl",
                str(WHEEL_BZL),
                *map(str, DISTS),
            ]
        )
    assert "--index-url is required" in capsys.readouterr().err
