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

# The compiler the modern lane's declared toolchain expects: Debian's package
# and the major version it installs (checked when the toolchain is set up).
GCC_PACKAGE = "g++-16"
GCC_MAJOR = "16"

# The sysroot that toolchain compiles and links against (./bazelw extracts it
# into its root once): Debian bookworm's glibc 2.36 and GCC 12's libstdc++ and
# libgcc, whose newest symbol versions are GLIBC_2.35 (at the extension's
# use), GLIBCXX_3.4.30 and CXXABI_1.3.13. g++-16 still compiles (its code
# generation and its own intrinsic headers), but the headers and libraries the
# extension is linked against are bookworm's: the wheel's manylinux floor
# (MANYLINUX_GLIBC_MINOR in tools/wheel.bzl) stays MLX's, whatever forky moves to.
SYSROOT = "/opt/sysroot-bookworm"

# The libstdc++ (and libgcc) of that sysroot: GCC 12's.
SYSROOT_GCC_MAJOR = "12"
