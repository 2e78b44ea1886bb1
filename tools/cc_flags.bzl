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
