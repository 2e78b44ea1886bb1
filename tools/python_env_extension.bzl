"""bzlmod: `python_env` (tools/python_env.bzl) as a module extension.

A separate file because Bazel 4.2, which loads python_env.bzl from WORKSPACE,
has no `module_extension`.
"""

load("//tools:python_env.bzl", "python_env")

_env_tag = tag_class(attrs = {
    "name": attr.string(mandatory = True),
    "locks": attr.string_dict(mandatory = True, doc = "CPython minor version -> lock file label"),
    "macos_lock": attr.label(),
})

def _python_env_extension_impl(mctx):
    for mod in mctx.modules:
        for env in mod.tags.env:
            python_env(
                name = env.name,
                locks = {lock: version for version, lock in env.locks.items()},
                macos_lock = env.macos_lock,
            )

python_env_extension = module_extension(
    implementation = _python_env_extension_impl,
    tag_classes = {"env": _env_tag},
)
