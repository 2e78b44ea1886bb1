"""The declared C++ toolchain of the modern lane (no auto-detection).

`quantlattice_cc` names the compiler it expects (Debian's `g++-16`, see
tools/cc_flags.bzl), checks its version, asks it for its built-in include
directories and declares a Linux x86_64 `cc_toolchain` with C++20 and the
flags of tools/cc_flags.bzl. The runtime ABI is libstdc++'s C++11 ABI, the
one `libmlx.so` in the mlx wheel is built with (checked by the extension
loading and running in the tests).

It compiles and links against the bookworm sysroot of tools/cc_flags.bzl
(`--sysroot`): bookworm's glibc headers and libraries, and GCC 12's libstdc++
headers (`-nostdinc++` drops GCC 16's) and libraries (`-L` its directory
comes before the compiler's own), so the extension references no symbol
version a manylinux_2_35 system lacks; //:wheel_audit_test checks that.
"""

load("//tools:cc_flags.bzl", "CXX_STANDARD", "GCC_MAJOR", "GCC_PACKAGE", "SYSROOT", "SYSROOT_GCC_MAJOR")

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
    link_flags = {sysroot_link_flags} + ["-fuse-ld=bfd", "-Wl,-no-as-needed", "-Wl,-z,relro,-z,now", "-pass-exit-codes"],
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
    # consumer's build without g++-16 keeps Bazel's auto-detected one.
    if rctx.which("g++-" + GCC_MAJOR) == None and rctx.os.environ.get("BAZEL_DO_NOT_DETECT_CPP_TOOLCHAIN") != "1":
        rctx.file("BUILD.bazel", "# No %s here: Bazel's auto-detected C++ toolchain is used.\n" % GCC_PACKAGE)
        return
    gxx = _which(rctx, "g++-" + GCC_MAJOR)
    version = rctx.execute([gxx, "-dumpfullversion"]).stdout.strip()
    if version.split(".")[0] != GCC_MAJOR:
        fail("quantlattice_cc: %s is version %s; the toolchain expects GCC %s (Debian package %s)." %
             (gxx, version, GCC_MAJOR, GCC_PACKAGE))
    sysroot = rctx.path(SYSROOT)
    if not sysroot.get_child(".complete").exists:
        fail("quantlattice_cc: the sysroot %s is missing; ./bazelw's modern lane extracts it (bookworm's libc6-dev, libstdc++-%s-dev)." %
             (SYSROOT, SYSROOT_GCC_MAJOR))
    cxx_std_headers = ["-nostdinc++"]
    for d in ["c++/{v}", "x86_64-linux-gnu/c++/{v}", "c++/{v}/backward"]:
        cxx_std_headers += ["-isystem", "%s/usr/include/%s" % (SYSROOT, d.format(v = SYSROOT_GCC_MAJOR))]
    cxx_flags = CXX_STANDARD + cxx_std_headers
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
            includes.append(line.strip())
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
        # GCC 12's libstdc++.so and libgcc_s.so before GCC 16's own.
        sysroot_link_flags = repr(["-L%s/usr/lib/gcc/x86_64-linux-gnu/%s" % (SYSROOT, SYSROOT_GCC_MAJOR)]),
    ))

quantlattice_cc = repository_rule(
    implementation = _cc_impl,
    environ = ["PATH", "BAZEL_DO_NOT_DETECT_CPP_TOOLCHAIN"],
    local = True,
)

def _cc_toolchain_extension_impl(_mctx):
    quantlattice_cc(name = "quantlattice_cc")

cc_toolchain_extension = module_extension(implementation = _cc_toolchain_extension_impl)
