#!/usr/bin/env bash
# The macOS sources of mlx_lattice checked as far as Linux allows: every C++
# source of the extension's darwin select branch (the Metal encoder, the
# eval_gpu bodies, the graph and CPU code with MLX_LATTICE_METAL defined) is
# parsed by clang with --target=arm64-apple-macos14 -fsyntax-only -Werror
# against the macOS mlx-metal wheel's headers (MLX's Metal backend headers
# and metal-cpp) and nanobind. A probe that misuses MLX's Metal API must
# fail, so a header mix-up cannot pass silently.
#
# Not Apple's: the C and C++ libraries (Debian's aarch64 glibc and
# libstdc++ stand in: int64_t is `long` here, `long long` on macOS), the
# Python headers (the host's CPython 3.11), and the few SDK headers in
# sdk_stubs/. Needs: root or the Debian packages clang-16 and
# libstdc++-12-dev-arm64-cross; PyPI. Caches downloads under
# ${MLX_LATTICE_CI_CACHE:-$HOME/.cache/mlx_lattice_ci}.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tools/macos_check
cache=${MLX_LATTICE_CI_CACHE:-$HOME/.cache/mlx_lattice_ci}/macos_check
pkg=packages/mlx_lattice
start=$(date +%s)

need=()
command -v clang-16 >/dev/null || need+=(clang-16)
[ -d /usr/aarch64-linux-gnu/include/c++/12 ] || need+=(libstdc++-12-dev-arm64-cross)
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y --no-install-recommends "${need[@]}" >/dev/null ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
fi

mkdir -p "$cache/wheels"
if [ ! -f "$cache/unpacked.ok" ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --platform macosx_14_0_arm64 --python-version 3.11 --implementation cp \
    -r "$here/requirements.txt" -d "$cache/wheels"
  rm -rf "$cache/unpacked" && mkdir -p "$cache/unpacked"
  for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache/unpacked"; done
  touch "$cache/unpacked.ok"
fi
mlx_inc=$cache/unpacked/mlx/include
[ -f "$mlx_inc/metal_cpp/Metal/Metal.hpp" ] && [ -f "$mlx_inc/mlx/backend/metal/device.h" ] ||
  { echo "FAIL: the mlx-metal wheel lacks metal-cpp or MLX's Metal headers"; exit 1; }

gen=$(mktemp -d)
trap 'rm -rf "$gen"' EXIT
python3 tools/msl/embed.py kMetalSources "$gen/metal_sources.h" \
  $pkg/csrc/metal/*.metal

x=/usr/aarch64-linux-gnu/include
py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
flags=(--target=arm64-apple-macos14 -std=c++20 -fsyntax-only -Wall -Wextra -Werror
  -Wno-unused-parameter -U__nonnull -D_GNU_SOURCE -DNB_DOMAIN=mlx -DMLX_LATTICE_METAL
  -nostdinc -nostdinc++ -isystem "$(clang-16 -print-resource-dir)/include"
  -isystem $x/c++/12 -isystem $x/c++/12/aarch64-linux-gnu -isystem $x
  -isystem $here/sdk_stubs -isystem "$mlx_inc" -isystem "$mlx_inc/metal_cpp"
  -isystem "$cache/unpacked/nanobind/include" -isystem "$py_inc" -I "$gen")

# Negative control: a wrong call into MLX's Metal command encoder must fail.
cat >"$gen/probe.cpp" <<'PROBE'
#include "mlx/backend/metal/device.h"
void probe(mlx::core::metal::CommandEncoder& e) { e.set_input_array(1, 2, 3, 4, 5); }
PROBE
# Its one error must be that call (so the headers themselves parse).
if clang-16 "${flags[@]}" "$gen/probe.cpp" 2>"$gen/probe.err" ||
  [ "$(grep -c 'error:' "$gen/probe.err")" != 1 ] ||
  ! grep -q "probe.cpp:2:.*error: too many arguments to function call" "$gen/probe.err"; then
  cat "$gen/probe.err"; echo "FAIL: the negative control did not fail as expected"; exit 1
fi

# The darwin branch of the extension: everything but no_metal.cpp (and tests).
failed=0
n=0
for src in $pkg/csrc/*.cpp $pkg/csrc/cpu/*.cpp $pkg/csrc/metal/*.cpp; do
  case $src in */no_metal.cpp | *_test.cpp) continue ;; esac
  n=$((n + 1))
  if ! clang-16 "${flags[@]}" "$src"; then echo "FAIL: $src"; failed=1; fi
done
echo "macOS syntax check: $n sources, $([ $failed = 0 ] && echo ok || echo FAILED)," \
  "$(( $(date +%s) - start )) s"
exit $failed
