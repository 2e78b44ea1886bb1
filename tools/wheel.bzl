"""`py_wheel_package`: one wheel per package, built by tools/build_wheel.py.

The version comes from tools/version.bzl (the single version source). Each entry of
`requires` is pinned with the version the lock file resolved, using the given
operator (`==` for ABI-coupled pins such as mlx/nanobind); siblings in
`sibling_requires` are pinned to this repository's own version.
"""

load("@py_env//:tags.bzl", "NATIVE_TAG")
load("//tools:version.bzl", "VERSION")

# The platform tag of Linux x86_64 native wheels. The modern lane's glibc 2.42
# headers redirect strtol & co. to GLIBC_2.38 symbols and auditwheel puts the
# extension at manylinux_2_39 (the Bazel 4.2 lane's at a lower one), so both
# lanes tag 2_39; //:wheel_audit_test checks the symbols against it. libmlx.so
# is left to the `mlx` wheel (rpath into site-packages/mlx/lib).
MANYLINUX_X86_64 = "manylinux_2_39_x86_64"

def _wheel_impl(ctx):
    tag = NATIVE_TAG.replace("linux_x86_64", MANYLINUX_X86_64) if ctx.attr.platform_specific else "py3-none-any"
    out = ctx.actions.declare_file("%s-%s-%s.whl" % (ctx.attr.distribution, VERSION, tag))
    args = ctx.actions.args()
    args.add("--out", out)
    args.add("--distribution", ctx.attr.distribution)
    args.add("--version", VERSION)
    args.add("--tag", tag)
    args.add("--lock", ctx.file.lock)
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
        inputs = inputs + [ctx.file.lock],
        executable = ctx.executable._builder,
        arguments = [args],
        mnemonic = "PyWheel",
        progress_message = "Building wheel %s" % ctx.attr.distribution,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

py_wheel_package = rule(
    implementation = _wheel_impl,
    attrs = {
        "distribution": attr.string(mandatory = True),
        "summary": attr.string(default = ""),
        "srcs": attr.label_list(allow_files = True, mandatory = True),
        "strip_prefix": attr.string(mandatory = True),
        "requires": attr.string_dict(doc = "distribution -> '==' | '>=' | '==;marker' pinned from the lock"),
        "sibling_requires": attr.string_list(),
        "platform_specific": attr.bool(default = False),
        "lock": attr.label(default = "//third_party/python:requirements_lock.txt", allow_single_file = True),
        "_builder": attr.label(default = "//tools:build_wheel", executable = True, cfg = "exec"),
    },
)
