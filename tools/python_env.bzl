"""Repository rule: a Python environment built from the hashed lock file.

The rule finds a CPython of the requested minor version, creates a virtual
environment (shared by every output base, see below), installs the lock with
`pip install --require-hashes --no-deps --only-binary=:all:` and exposes:

* `:toolchain` — the Python toolchain (an `interpreter_path` runtime; a
  glob-of-files runtime would put ~33k files into every test's runfiles);
* `:python_headers`, `:mlx`, `:nanobind` — C++ inputs for native extensions,
  taken from the same environment so ABI and headers always agree.

Editing the lock file re-runs the rule (Bazel tracks files a repository rule
reads). Set QUANTLATTICE_PYTHON to choose the interpreter explicitly.

The venv lives outside the output base, in QUANTLATTICE_VENV_ROOT (bazelw
sets it to a folder of its cache; otherwise $XDG_CACHE_HOME or ~/.cache,
then quantlattice/python-envs), in a folder named by a hash of the
interpreter, its version and the lock's text (the interpreter's path and
build included). Every output base of the machine (each checkout, each
lane, the downstream module) shares it: it is built once, and since the
interpreter's path is part of every test action (the launcher names it), a
clone's tests match the disk cache entries another clone stored.

On macOS the `macos_lock` is installed instead (the Metal MLX runtime:
libmlx.dylib, metal-cpp headers, the Metal frameworks).
"""

_SITE = "{venv}/lib/python{version}/site-packages"

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")
load("@rules_cc//cc:defs.bzl", "cc_import", "cc_library")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!/usr/bin/env python3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h", "python_multiarch_include/**/*.h"]),
    includes = ["python_include", "python_multiarch_include"],
)

cc_import(
    name = "libmlx",
    interface_library = "site/mlx/lib/{libmlx}",
    system_provided = 1,
)

cc_library(
    name = "mlx",
    hdrs = glob(["site/mlx/include/**/*.h", "site/mlx/include/**/*.hpp"]),
    includes = {mlx_includes},
    linkopts = {mlx_linkopts},
    deps = [":libmlx"],
)

cc_library(
    name = "nanobind",
    srcs = ["site/nanobind/src/nb_combined.cpp"],
    textual_hdrs = glob(
        ["site/nanobind/src/*.cpp", "site/nanobind/src/*.h"],
        exclude = ["site/nanobind/src/nb_combined.cpp"],
    ),
    hdrs = glob([
        "site/nanobind/include/**/*.h",
        "site/nanobind/ext/robin_map/include/**/*.h",
    ]),
    copts = ["-std=c++20", "-fvisibility=hidden", "-fno-strict-aliasing", "-O2", "-Wno-all"],
    defines = ["NB_DOMAIN=mlx"],
    includes = [
        "site/nanobind/ext/robin_map/include",
        "site/nanobind/include",
    ],
    deps = [":python_headers"],
    alwayslink = 1,
)

exports_files(["venv_python", "tags.bzl"])
"""

_PROBE = "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); print(sysconfig.get_paths()['include'])"

# The wheel tag of native extensions built here: manylinux_2_<glibc minor> on
# glibc Linux (an extension compiled against glibc 2.N headers needs at most
# 2.N), else the interpreter's platform. tools/wheel.bzl lowers the glibc
# level to the one it declares; auditwheel checks the symbols against it in
# //:wheel_audit_test.
_TAG_PROBE = """
import os, sys, sysconfig
i = 'cp%d%d' % sys.version_info[:2]
plat = sysconfig.get_platform().replace('-', '_').replace('.', '_')
libc = os.confstr('CS_GNU_LIBC_VERSION') if hasattr(os, 'confstr') else None
if plat == 'linux_x86_64' and libc and libc.startswith('glibc 2.'):
    plat = 'manylinux_2_%s_x86_64' % libc.split('.')[1]
print('%s-%s-%s' % (i, i, plat))
"""

def _find_python(rctx, versions):
    """The first candidate interpreter whose minor version has a lock."""
    override = rctx.os.environ.get("QUANTLATTICE_PYTHON")
    candidates = [override] if override else ["python3"] + ["python" + v for v in versions]
    seen = []
    for name in candidates:
        path = rctx.which(name) if "/" not in name else rctx.path(name)
        if path == None or not path.exists:
            continue
        probe = rctx.execute([path, "-c", _PROBE])
        if probe.return_code != 0:
            seen.append("%s (does not run)" % path)
            continue
        found_version, include = probe.stdout.strip().split("\n")
        if found_version in versions:
            return path, found_version, include
        seen.append("%s is Python %s" % (path, found_version))
    fail(("python_env needs CPython %s (the versions with a lock file), but found %s. " +
          "Install one of them or point QUANTLATTICE_PYTHON at one.") %
         (", ".join(versions), ", ".join(seen) if seen else "none on PATH"))

def _run(rctx, args, what, timeout = 600):
    result = rctx.execute(args, timeout = timeout, quiet = True)
    if result.return_code != 0:
        fail("python_env: %s failed (exit %d):\n%s\n%s" %
             (what, result.return_code, result.stdout[-4000:], result.stderr[-4000:]))
    return result

# Builds (once) the shared venv for an interpreter and lock, under an
# exclusive lock file so that two Bazel servers never build it at once; a
# venv without its ".complete" mark (an interrupted build) is rebuilt.
# Prints the venv's folder. argv: root, lock file, minor version.
_SHARED_VENV = """
import fcntl, hashlib, os, shutil, subprocess, sys
root, lock, version = sys.argv[1:4]
h = hashlib.sha256()
for part in (os.path.realpath(sys.executable), sys.version, version, open(lock, "rb").read().decode()):
    h.update(part.encode() + b"\\0")
venv = os.path.join(root, "py%s-%s" % (version, h.hexdigest()[:16]))
os.makedirs(root, exist_ok=True)
with open(venv + ".lock", "w") as guard:
    fcntl.flock(guard, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(venv, ".complete")):
        shutil.rmtree(venv, ignore_errors=True)
        def run(*args):
            r = subprocess.run(args, capture_output=True, text=True)
            if r.returncode:
                shutil.rmtree(venv, ignore_errors=True)
                sys.exit("%s failed (exit %d):\\n%s\\n%s" % (" ".join(args[:4]), r.returncode, r.stdout[-4000:], r.stderr[-4000:]))
        run(sys.executable, "-m", "venv", venv)
        run(os.path.join(venv, "bin", "python3"), "-m", "pip", "install", "--quiet",
            "--disable-pip-version-check", "--no-input", "--require-hashes", "--no-deps",
            "--only-binary=:all:", "-r", lock)
        # Bazel 4 labels cannot contain spaces; no installed code needs such files.
        run("find", venv, "-name", "* *", "-prune", "-exec", "rm", "-rf", "{}", "+")
        open(os.path.join(venv, ".complete"), "w").close()
print(venv)
"""

def _venv_root(rctx):
    """The folder of the shared venvs.

    QUANTLATTICE_VENV_ROOT, else the user's cache folder (this repository's
    own folder where the user has none).
    """
    env = rctx.os.environ
    if env.get("QUANTLATTICE_VENV_ROOT"):
        return env["QUANTLATTICE_VENV_ROOT"]
    cache = env.get("XDG_CACHE_HOME") or (env["HOME"] + "/.cache" if env.get("HOME") else None)
    return cache + "/quantlattice/python-envs" if cache else str(rctx.path("python-envs"))

def _python_env_impl(rctx):
    locks = _locks(rctx.attr)
    python, version, include = _find_python(rctx, sorted(locks))
    macos = rctx.os.name.lower().startswith("mac")
    if macos and rctx.attr.macos_lock == None:
        fail("python_env: no macos_lock is set for this macOS machine")
    lock_label = rctx.attr.macos_lock if macos else locks[version]
    lock = rctx.path(lock_label)  # read here, so editing the lock re-runs this rule
    rctx.report_progress("creating the virtual environment (installing %s)" % lock_label.name)
    venv = _run(
        rctx,
        [python, "-c", _SHARED_VENV, _venv_root(rctx), str(lock), version],
        "building the venv",
        timeout = 1800,
    ).stdout.strip()
    venv_python = rctx.path(venv + "/bin/python3")
    rctx.symlink(include, "python_include")

    # Debian's pyconfig.h includes <x86_64-linux-gnu/python3.X/pyconfig.h>,
    # found in /usr/include, which a --sysroot build (tools/cc_toolchain.bzl)
    # does not search: that one folder is linked beside the headers.
    inc = rctx.path(include)
    multiarch = _run(rctx, [python, "-c", "import sysconfig; print(sysconfig.get_config_var('MULTIARCH') or '')"], "probing MULTIARCH").stdout.strip()
    arch_include = rctx.path("%s/%s/%s" % (inc.dirname, multiarch, inc.basename))
    if multiarch and arch_include.exists:
        rctx.symlink(arch_include, "python_multiarch_include/%s/%s" % (multiarch, inc.basename))
    else:
        rctx.file("python_multiarch_include/README", "The interpreter's pyconfig.h needs no multiarch folder.\n")
    site = _SITE.format(venv = venv, version = version)
    rctx.symlink(site, "site")
    rctx.symlink(venv_python, "venv_python")
    tag = _run(rctx, [venv_python, "-c", _TAG_PROBE], "probing the wheel tag").stdout.strip()
    rctx.file("tags.bzl", 'NATIVE_TAG = "%s"\n' % tag)
    rctx.file("BUILD.bazel", _BUILD.format(
        interpreter = str(venv_python),
        libmlx = "libmlx.dylib" if macos else "libmlx.so",
        mlx_includes = repr(["site/mlx/include", "site/mlx/include/metal_cpp"] if macos else ["site/mlx/include"]),
        mlx_linkopts = repr(["-framework", "Metal", "-framework", "Foundation", "-framework", "QuartzCore"] if macos else []),
    ))

def _locks(attr):
    """{minor version: lock label} from `locks` plus the single `lock`."""
    locks = {version: label for label, version in attr.locks.items()}
    if attr.lock:
        locks[attr.python_version] = attr.lock
    if not locks:
        fail("python_env: give `locks` (or `lock` and `python_version`)")
    return locks

_ATTRS = {
    "lock": attr.label(allow_single_file = True, doc = "the lock of `python_version` (older form)"),
    "locks": attr.label_keyed_string_dict(allow_files = True, doc = "lock file -> CPython minor version"),
    "macos_lock": attr.label(allow_single_file = True),
    "python_version": attr.string(default = "3.11"),
}

python_env = repository_rule(
    implementation = _python_env_impl,
    attrs = _ATTRS,
    environ = ["QUANTLATTICE_PYTHON", "QUANTLATTICE_VENV_ROOT", "XDG_CACHE_HOME", "HOME"],
    # Fetched again whenever the Bazel server starts: cheap when the shared
    # venv exists (a few interpreter probes), and a venv folder removed from
    # the cache is rebuilt rather than left as dangling links.
    local = True,
)
