"""`nanobind_extension`: a Python extension module of MLX primitives.

Compiles against the nanobind sources and the MLX headers/`libmlx.so` of the
locked environment (so the extension's ABI always matches the `mlx` wheel it
runs with), with NB_DOMAIN=mlx so `mx.array` arguments are accepted.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary")
load("//tools:cc_flags.bzl", "NATIVE_COPTS")

def nanobind_extension(name, srcs, deps = [], mlx_rpath = "$$ORIGIN/../../mlx/lib", copts = [], **kwargs):
    """Builds `<name>.so`, importable as the module `name`'s last component.

    Args:
      name: output path without `.so`, relative to the package, e.g.
        "mlx_lattice/_native/ext".
      srcs: C++ sources and private headers.
      deps: cc_library dependencies.
      mlx_rpath: where an installed wheel finds `libmlx.so`, relative to the
        extension ($ORIGIN). Inside Bazel, `import mlx.core` loads it first.
      copts: extra compiler options.
      **kwargs: passed to cc_binary (visibility, tags, ...).
    """
    cc_binary(
        name = name + ".so",
        srcs = srcs,
        copts = NATIVE_COPTS + copts,
        linkopts = select({
            # macOS: @loader_path is the dyld spelling of $ORIGIN.
            "@bazel_tools//src/conditions:darwin": [
                "-Wl,-rpath," + mlx_rpath.replace("$$ORIGIN", "@loader_path"),
                "-undefined",
                "dynamic_lookup",
            ],
            "//conditions:default": [
                "-Wl,-rpath," + mlx_rpath,
                "-Wl,--as-needed",
            ],
        }),
        linkshared = True,
        deps = deps + [
            "@py_env//:mlx",
            "@py_env//:nanobind",
        ],
        **kwargs
    )
