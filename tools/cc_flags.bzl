"""C++ flags in one place: the declared toolchain and the extension macro use them."""

# The language standard of every C++ target (MLX's headers need C++20).
CXX_STANDARD = ["-std=c++20"]

# Warnings and code generation of C++ libraries others link (public symbols).
LIBRARY_COPTS = CXX_STANDARD + [
    "-O3",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]

# The native extension: the same, with only the module init function exported.
NATIVE_COPTS = LIBRARY_COPTS + ["-fvisibility=hidden"]

# The compiler of the modern lane's declared toolchain: Debian bookworm's own
# GCC 12 (`g++-12`), installed in the bookworm sysroot below and run from it,
# so the C++ runtime the extension links (GCC 12's libstdc++ and libgcc, whose
# newest symbol versions are GLIBCXX_3.4.30, CXXABI_1.3.13) is the compiler's
# own: no call into a runtime entry point a newer compiler expects, and no
# runtime symbol defined in the product (//:wheel_audit_test checks both).
GCC_PACKAGE = "g++-12"
GCC_MAJOR = "12"

# The sysroot that toolchain lives in and compiles and links against
# (./bazelw extracts it into its root once): Debian bookworm's glibc 2.36
# (GLIBC_2.35 at the extension's use), GCC 12 and binutils. The wheel's
# manylinux floor (MANYLINUX_GLIBC_MINOR in tools/wheel.bzl) stays MLX's,
# whatever forky, the root Bazel runs in, moves to.
SYSROOT = "/opt/sysroot-bookworm-gcc12"

# Where the compiler and its tools are inside the root.
COMPILER_BIN = SYSROOT + "/usr/bin"
