"""`py_wheel_package`: one wheel per package, built by tools/build_wheel.py;
`py_sdist_package`: the source distribution of a pure-Python package.

The version comes from tools/version.bzl (the single version source). Each entry of
`requires` names an operator: `==` pins the version the lock file resolved
(ABI-coupled packages such as mlx/nanobind), `>=` takes the oldest version
the package tests pass with from third_party/python/requirements_min.txt;
siblings in `sibling_requires` are pinned to this repository's own version.
"""

load("@py_env//:tags.bzl", "NATIVE_TAG")
load("//tools:version.bzl", "VERSION")

# The glibc level of native Linux wheels: manylinux_2_35, MLX's own (mlx's
# Linux wheels are manylinux_2_35) and the policy auditwheel reports for the
# extension from both lanes: the modern lane runs bookworm's own GCC 12 from
# a bookworm sysroot (tools/cc_toolchain.bzl), the Bazel 4.2 lane builds with
# the host's bookworm GCC 12, and neither references a symbol version
# newer than GLIBC_2.35 / GLIBCXX_3.4.30. Bazel names outputs before it builds
# them, so the level is declared here rather than read back;
# //:wheel_audit_test fails when the symbols need a newer one.
MANYLINUX_GLIBC_MINOR = 35

def native_tag(tag = NATIVE_TAG, glibc_minor = MANYLINUX_GLIBC_MINOR):
    """A native wheel tag with its manylinux level capped.

    Args:
      tag: cpXY-cpXY-<platform>, the platform as the build's glibc gives it.
      glibc_minor: the highest manylinux_2_<minor> level to tag.

    Returns:
      `tag` with manylinux_2_<min(build's, glibc_minor)>; other platforms as given.
    """
    python, abi, platform = tag.split("-")
    if platform.startswith("manylinux_2_"):
        _, _, build_minor, arch = platform.split("_", 3)
        platform = "manylinux_2_%d_%s" % (min(glibc_minor, int(build_minor)), arch)
    return "-".join([python, abi, platform])

def _dist_impl(ctx, sdist):
    # cpXY-cpXY-manylinux_2_35_x86_64 on Linux, the interpreter's platform elsewhere.
    tag = native_tag() if ctx.attr.platform_specific else "py3-none-any"
    if sdist:
        out = ctx.actions.declare_file("%s-%s.tar.gz" % (ctx.attr.distribution, VERSION))
    else:
        out = ctx.actions.declare_file("%s-%s-%s.whl" % (ctx.attr.distribution, VERSION, tag))
    args = ctx.actions.args()
    if sdist:
        args.add("--sdist")
    args.add("--out", out)
    args.add("--distribution", ctx.attr.distribution)
    args.add("--version", VERSION)
    args.add("--tag", tag)
    args.add("--lock", ctx.file.lock)
    args.add("--minimums", ctx.file.minimums)
    args.add("--strip-prefix", ctx.attr.strip_prefix)
    args.add("--summary", ctx.attr.summary)
    for name, op in sorted(ctx.attr.requires.items()):
        args.add("--requires", name + " " + op)
    for sibling in ctx.attr.sibling_requires:
        args.add("--sibling", sibling)
    inputs = []
    for target in ctx.attr.srcs:
        for f in target[DefaultInfo].files.to_list():
            inputs.append(f)
            args.add("--file", f.short_path + "=" + f.path)
    ctx.actions.run(
        outputs = [out],
        inputs = inputs + [ctx.file.lock, ctx.file.minimums],
        executable = ctx.executable._builder,
        arguments = [args],
        mnemonic = "PySdist" if sdist else "PyWheel",
        progress_message = "Building %s %s" % ("sdist" if sdist else "wheel", ctx.attr.distribution),
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

def _wheel_impl(ctx):
    return _dist_impl(ctx, sdist = False)

def _sdist_impl(ctx):
    if ctx.attr.platform_specific:
        fail("py_sdist_package: %s is platform-specific; sdists are for pure-Python packages" % ctx.label)
    return _dist_impl(ctx, sdist = True)

_DIST_ATTRS = {
    "distribution": attr.string(mandatory = True),
    "summary": attr.string(default = ""),
    "srcs": attr.label_list(allow_files = True, mandatory = True),
    "strip_prefix": attr.string(mandatory = True),
    "requires": attr.string_dict(doc = "distribution -> '==' | '>=' | '==;marker' pinned from the lock"),
    "sibling_requires": attr.string_list(),
    "platform_specific": attr.bool(default = False),
    "lock": attr.label(default = "//third_party/python:requirements_lock.txt", allow_single_file = True),
    "minimums": attr.label(
        default = "//third_party/python:requirements_min.txt",
        allow_single_file = True,
        doc = "the lower bounds of '>=' requirements (the oldest versions the tests pass with)",
    ),
    "_builder": attr.label(default = "//tools:build_wheel", executable = True, cfg = "exec"),
}

py_wheel_package = rule(
    implementation = _wheel_impl,
    attrs = _DIST_ATTRS,
)

# The same attributes as py_wheel_package (`platform_specific` must stay False:
# an sdist of a native package would need the extension's build system).
# Writes <distribution>-<version>.tar.gz with PKG-INFO and a flit_core
# pyproject.toml, so `pip install` of the sdist builds the same pure wheel.
py_sdist_package = rule(
    implementation = _sdist_impl,
    attrs = _DIST_ATTRS,
)
