"""`py_wheel_package`: one wheel per package, built by tools/build_wheel.py.

The version comes from tools/version.bzl (the single version source). Each entry of
`requires` is pinned with the version the lock file resolved, using the given
operator (`==` for ABI-coupled pins such as mlx/nanobind); siblings in
`sibling_requires` are pinned to this repository's own version.
"""

load("@py_env//:tags.bzl", "NATIVE_TAG")
load("//tools:version.bzl", "VERSION")

def _wheel_impl(ctx):
    # NATIVE_TAG: cpXY-cpXY-manylinux_2_<glibc of the build>_x86_64 on Linux.
    tag = NATIVE_TAG if ctx.attr.platform_specific else "py3-none-any"
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
