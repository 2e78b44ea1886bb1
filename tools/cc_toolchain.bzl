"""The declared C++ toolchain of the modern lane (no auto-detection).

`quantlattice_cc` names the compiler it expects (Debian bookworm's `g++-12`
in the bookworm sysroot, see tools/cc_flags.bzl), checks its version, asks it
for its built-in include directories and declares a Linux x86_64
`cc_toolchain` with C++20 and the flags of tools/cc_flags.bzl. The runtime ABI is libstdc++'s C++11 ABI, the
one `libmlx.so` in the mlx wheel is built with (checked by the extension
loading and running in the tests).

The compiler runs from that sysroot and compiles and links against it
(`--sysroot`): bookworm's glibc headers and libraries, and its own GCC 12
libstdc++ and libgcc, so the C++ runtime the extension links is the one its
compiler was built for, and the extension references no symbol version a
manylinux_2_35 system lacks; //:wheel_audit_test checks both.
"""

load("//tools:cc_flags.bzl", "COMPILER_BIN", "CXX_STANDARD", "GCC_MAJOR", "GCC_PACKAGE", "SYSROOT")

_BUILD = """\
load("@bazel_tools//tools/cpp:unix_cc_toolchain_config.bzl", "cc_toolchain_config")

package(default_visibility = ["//visibility:public"])

filegroup(name = "empty")

cc_toolchain_config(
    name = "config",
    cpu = "k8",
    compiler = "gcc",
    toolchain_identifier = "quantlattice-gcc-{major}",
    host_system_name = "x86_64-linux-gnu",
    target_system_name = "x86_64-linux-gnu",
    target_libc = "glibc",
    abi_version = "gcc",
    abi_libc_version = "glibc",
    cxx_builtin_include_directories = {includes},
    tool_paths = {tools},
    compile_flags = ["-U_FORTIFY_SOURCE", "-fstack-protector", "-Wall", "-fno-omit-frame-pointer"],
    opt_compile_flags = ["-g0", "-O2", "-D_FORTIFY_SOURCE=1", "-DNDEBUG", "-ffunction-sections", "-fdata-sections"],
    dbg_compile_flags = ["-g"],
    conly_flags = [],
    cxx_flags = {cxx_flags},
    link_flags = ["-fuse-ld=bfd", "-Wl,-no-as-needed", "-Wl,-z,relro,-z,now", "-pass-exit-codes"],
    link_libs = ["-Wl,--push-state,-as-needed", "-lstdc++", "-Wl,--pop-state", "-Wl,--push-state,-as-needed", "-lm", "-Wl,--pop-state"],
    opt_link_flags = ["-Wl,--gc-sections"],
    unfiltered_compile_flags = ["-fno-canonical-system-headers"],
    coverage_compile_flags = ["--coverage"],
    coverage_link_flags = ["--coverage"],
    supports_start_end_lib = False,
    builtin_sysroot = {sysroot},
)

cc_toolchain(
    name = "cc_toolchain",
    all_files = ":empty",
    ar_files = ":empty",
    as_files = ":empty",
    compiler_files = ":empty",
    dwp_files = ":empty",
    linker_files = ":empty",
    objcopy_files = ":empty",
    strip_files = ":empty",
    supports_param_files = 1,
    toolchain_config = ":config",
    toolchain_identifier = "quantlattice-gcc-{major}",
)

toolchain(
    name = "toolchain",
    exec_compatible_with = ["@platforms//os:linux", "@platforms//cpu:x86_64"],
    target_compatible_with = ["@platforms//os:linux", "@platforms//cpu:x86_64"],
    toolchain = ":cc_toolchain",
    toolchain_type = "@bazel_tools//tools/cpp:toolchain_type",
)
"""

def _which(rctx, name):
    # The compiler's own programs from the sysroot; binutils (which add no
    # runtime code) from the root's PATH, as bookworm's link the root's
    # missing libbfd-2.40.
    own = rctx.path("%s/%s" % (COMPILER_BIN, name))
    if name.endswith("-" + GCC_MAJOR) and own.exists:
        return str(own)
    path = rctx.which(name)
    if path == None:
        fail("quantlattice_cc: `%s` is not on PATH; install Debian's %s (./bazelw's modern lane does)." %
             (name, GCC_PACKAGE))
    return str(path)

def _cc_impl(rctx):
    if not rctx.os.name.lower().startswith("linux"):
        rctx.file("BUILD.bazel", "# The declared toolchain covers Linux x86_64 only.\n")
        return

    # Our modern lane turns auto-detection off and must get this toolchain; a
    # consumer's build without the sysroot's g++-12 keeps Bazel's auto-detected one.
    if not rctx.path("%s/g++-%s" % (COMPILER_BIN, GCC_MAJOR)).exists and rctx.os.environ.get("BAZEL_DO_NOT_DETECT_CPP_TOOLCHAIN") != "1":
        rctx.file("BUILD.bazel", "# No %s here: Bazel's auto-detected C++ toolchain is used.\n" % GCC_PACKAGE)
        return
    gxx = _which(rctx, "g++-" + GCC_MAJOR)
    version = rctx.execute([gxx, "-dumpfullversion"]).stdout.strip()
    if version.split(".")[0] != GCC_MAJOR:
        fail("quantlattice_cc: %s is version %s; the toolchain expects GCC %s (Debian package %s)." %
             (gxx, version, GCC_MAJOR, GCC_PACKAGE))
    sysroot = rctx.path(SYSROOT)
    if not sysroot.get_child(".complete").exists:
        fail("quantlattice_cc: the sysroot %s is missing; ./bazelw's modern lane extracts it (bookworm's libc6-dev, %s)." %
             (SYSROOT, GCC_PACKAGE))
    cxx_flags = CXX_STANDARD
    probe = rctx.execute([gxx, "-E", "-xc++", "-v", "/dev/null", "--sysroot=" + SYSROOT] + cxx_flags)
    if probe.return_code != 0:
        fail("quantlattice_cc: %s cannot preprocess against the sysroot %s:\n%s" % (gxx, SYSROOT, probe.stderr))
    includes, inside = [], False
    for line in probe.stderr.splitlines():
        if line.startswith("#include <...> search starts here:"):
            inside = True
        elif line.startswith("End of search list."):
            inside = False
        elif inside:
            # As GCC prints it (relative to its own directory) and resolved.
            includes.append(line.strip())
            resolved = str(rctx.path(line.strip()).realpath)
            if resolved not in includes:
                includes.append(resolved)
    tools = {
        "gcc": _which(rctx, "gcc-" + GCC_MAJOR),
        "cpp": _which(rctx, "cpp-" + GCC_MAJOR),
        "ar": _which(rctx, "ar"),
        "ld": _which(rctx, "ld"),
        "nm": _which(rctx, "nm"),
        "objcopy": _which(rctx, "objcopy"),
        "objdump": _which(rctx, "objdump"),
        "strip": _which(rctx, "strip"),
        "gcov": _which(rctx, "gcov-" + GCC_MAJOR),
        "llvm-cov": "/bin/false",
    }
    rctx.file("BUILD.bazel", _BUILD.format(
        major = GCC_MAJOR,
        includes = repr(includes),
        tools = repr(tools),
        cxx_flags = repr(cxx_flags),
        sysroot = repr(SYSROOT),
    ))

quantlattice_cc = repository_rule(
    implementation = _cc_impl,
    environ = ["PATH", "BAZEL_DO_NOT_DETECT_CPP_TOOLCHAIN"],
    local = True,
)

def _cc_toolchain_extension_impl(_mctx):
    quantlattice_cc(name = "quantlattice_cc")

cc_toolchain_extension = module_extension(implementation = _cc_toolchain_extension_impl)
