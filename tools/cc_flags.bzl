"""C++ flags in one place: the declared toolchain and the extension macro use them."""

# The language standard of every C++ target (MLX's headers need C++20).
CXX_STANDARD = ["-std=c++20"]

# Warnings and code generation for the native extension and its libraries.
NATIVE_COPTS = CXX_STANDARD + [
    "-O3",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]

# The compiler the modern lane's declared toolchain expects: Debian's package
# and the major version it installs (checked when the toolchain is set up).
GCC_PACKAGE = "g++-16"
GCC_MAJOR = "16"
