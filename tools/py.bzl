"""Macros for Python packages: library + version, pytest tests, lint."""

load("@rules_python//python:defs.bzl", "py_library", "py_test")
load("//tools:version.bzl", "VERSION")

def py_package(name, package, srcs, deps = [], data = []):
    """A py_library for one import package, with `_version.py` from VERSION.

    Args:
      name: target name (usually the folder name).
      package: the import package, e.g. "quantrules".
      srcs: the package's Python sources.
      deps: other py_library targets it imports.
      data: runtime data files (e.g. native extensions).
    """
    srcs = [s for s in srcs if not s.endswith("/_version.py")]  # generated below
    native.genrule(
        name = name + "_version",
        outs = [package + "/_version.py"],
        cmd = "$(location //tools:gen_version) %s $@" % VERSION,
        tools = ["//tools:gen_version"],
    )
    py_library(
        name = name,
        srcs = srcs + [package + "/_version.py"],
        data = data,
        imports = ["."],
        deps = deps,
        visibility = ["//visibility:public"],
    )

def _runfile(path):
    pkg = native.package_name()
    return pkg + "/" + path if pkg else path

def py_pytest(name, srcs, deps = [], data = [], args = [], doctest_srcs = [], size = "small", tags = [], **kwargs):
    """A py_test running pytest over `srcs` (and doctests of `doctest_srcs`).

    JUnit XML reaches Bazel through XML_OUTPUT_FILE.

    Args:
      name: the test target.
      srcs: pytest files.
      deps: py_library targets the tests import.
      data: runtime data files.
      args: extra pytest arguments.
      doctest_srcs: modules whose doctests run too.
      size: the test size.
      tags: test tags.
      **kwargs: passed to py_test (env, timeout, ...).
    """
    extra = []
    if doctest_srcs:
        extra = ["--doctest-modules", "--doctest-continue-on-failure"] + [_runfile(s) for s in doctest_srcs]
    py_test(
        name = name,
        srcs = srcs + ["//tools:pytest_main.py"],
        main = "//tools:pytest_main.py",
        args = args + [_runfile(s) for s in srcs] + extra,
        data = data + doctest_srcs + ["//:pytest.ini", "//tools/sanitizers:suppressions"],
        deps = deps,
        size = size,
        tags = tags,
        python_version = "PY3",
        **kwargs
    )

def py_lint_test(name, srcs):
    """`ruff check` over `srcs` with the repository's ruff.toml."""
    py_test(
        name = name,
        srcs = ["//tools:lint_main.py"],
        main = "//tools:lint_main.py",
        args = ["ruff.toml"] + [_runfile(s) for s in srcs],
        data = srcs + ["//:ruff.toml"],
        size = "small",
        python_version = "PY3",
    )

def py_wheel_install_test(name, module, wheels, requires = [], smoke = ""):
    """Installs `wheels` into a fresh directory and imports `module` from it.

    Args:
      name: the test target.
      module: the import name to import from the installed wheels.
      wheels: wheel targets to install (offline, with the locked environment's pip).
      requires: requirement strings the installed set must satisfy.
      smoke: Python code run after the import.
    """
    args = ["--module", module]
    for req in requires:
        args += ["--requires", "'%s'" % req]
    if smoke:
        args += ["--smoke", "'%s'" % smoke]
    py_test(
        name = name,
        srcs = ["//tools:wheel_install_test.py"],
        main = "//tools:wheel_install_test.py",
        args = args + ["$(location %s)" % w for w in wheels],
        data = wheels,
        size = "small",
        python_version = "PY3",
    )
