#!/usr/bin/env bash
# mlx_lattice for linux-aarch64, built and tested on an x86_64 Debian machine
# (docs: docs/guides/arm64.rst):
#   1. tools/arm64/kernel_tests.sh: the C++ micro-kernel test under qemu, on
#      four emulated CPUs, every path forced;
#   2. the extension cross-compiled with g++-aarch64-linux-gnu against the
#      aarch64 mlx/mlx-cpu 0.32.4 wheels and Debian's aarch64 CPython 3.11
#      headers, packed into an aarch64 wheel (tools/build_wheel.py);
#   3. that wheel installed next to the aarch64 mlx and numpy wheels and run
#      by Debian's aarch64 python3.11 under qemu-aarch64-static (-cpu max):
#      the ISA tests and a bounded subset of the conv, quantized conv,
#      bf16/fp16 conv, pooling and relation tests (the mirrored builder's,
#      which has NEON code), against the same references as on x86.
# Needs root (apt-get: g++-aarch64-linux-gnu, qemu-user-static, mmdebstrap),
# PyPI and Debian's registry. Downloads and the aarch64 sysroot are cached
# under ${MLX_LATTICE_CI_CACHE:-$HOME/.cache/mlx_lattice_ci}/arm64; the wheel is
# left in its dist/.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tools/arm64
pkg=packages/mlx_lattice
cache=${MLX_LATTICE_CI_CACHE:-$HOME/.cache/mlx_lattice_ci}/arm64
start=$(date +%s)
stamp() { echo "[arm64 $(( $(date +%s) - start )) s] $*"; }

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y --no-install-recommends "${need[@]}" >/dev/null ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
fi

# 1. The kernels alone.
$here/kernel_tests.sh
stamp "kernel tests done"

# Debian's aarch64 CPython (interpreter, stdlib, headers) unpacked, no scripts run.
sysroot=$cache/sysroot
mkdir -p "$cache"
if [ ! -x "$sysroot/usr/bin/python3.11" ]; then
  rm -rf "$sysroot.tmp"
  mmdebstrap --quiet --variant=extract --arch=arm64 \
    --include=python3.11-minimal,libpython3.11-stdlib,libpython3.11-dev,libstdc++6,libgcc-s1,libc6 \
    --aptopt='Acquire::Check-Valid-Until "false"' bookworm "$sysroot.tmp" http://deb.debian.org/debian
  mv "$sysroot.tmp" "$sysroot"
fi
# The aarch64 wheels, hash-pinned, unpacked into one site directory.
site=$cache/site
if [ ! -f "$site/.ok" ] || ! cmp -s "$here/requirements.txt" "$site/.ok"; then
  rm -rf "$site" && mkdir -p "$cache/wheels" "$site"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --platform manylinux_2_35_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_27_aarch64 --platform manylinux_2_17_aarch64 \
    --python-version 3.11 --implementation cp -r "$here/requirements.txt" -d "$cache/wheels"
  for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  cp "$here/requirements.txt" "$site/.ok"
fi
stamp "sysroot and wheels ready"

# 2. The extension, as the Bazel target builds it (tools/nanobind.bzl).
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
mkdir -p "$build/pyinc/aarch64-linux-gnu"
ln -s "$sysroot/usr/include/aarch64-linux-gnu/python3.11" "$build/pyinc/aarch64-linux-gnu/python3.11"
cxx=(aarch64-linux-gnu-g++ -std=c++20 -fPIC -fvisibility=hidden -fno-strict-aliasing -DNB_DOMAIN=mlx
  -isystem "$site/mlx/include" -isystem "$site/nanobind/include"
  -isystem "$site/nanobind/ext/robin_map/include" -isystem "$sysroot/usr/include/python3.11"
  -isystem "$build/pyinc")
srcs=()
for src in $pkg/csrc/*.cpp $pkg/csrc/cpu/*.cpp; do
  case $src in */*_test.cpp) continue ;; esac # test programs, not the extension
  srcs+=("$src")
done
export build
printf '%s\n' "${srcs[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  'exec "$@" -O3 -Wall -Wextra -Wno-unused-parameter -Wno-psabi -Werror -c {} -o "$build/$(echo {} | tr / _).o"' \
  _ "${cxx[@]}"
"${cxx[@]}" -O2 -Wno-all -c "$site/nanobind/src/nb_combined.cpp" -o "$build/nb_combined.o"
"${cxx[@]}" -shared -o "$build/ext.so" "$build"/*.o -L"$site/mlx/lib" -lmlx \
  -Wl,-rpath-link,"$site/mlx/lib":"$site/mlx_cpu.libs" -Wl,-rpath,'$ORIGIN/../../mlx/lib' \
  -Wl,--as-needed
stamp "extension cross-compiled"

version=$(sed -n 's/^VERSION = "\(.*\)"/\1/p' tools/version.bzl)
dist=$cache/dist
mkdir -p "$dist"
wheel=$dist/mlx_lattice-$version-cp311-cp311-linux_aarch64.whl
python3 tools/gen_version.py "$version" "$build/_version.py"
files=(--file "$pkg/mlx_lattice/_native/ext.so=$build/ext.so"
  --file "$pkg/mlx_lattice/_version.py=$build/_version.py")
while IFS= read -r f; do files+=(--file "$f=$f"); done < <(
  find $pkg/mlx_lattice -name '*.py' ! -name _version.py | sort)
python3 tools/build_wheel.py --out "$wheel" --distribution mlx_lattice --version "$version" \
  --tag cp311-cp311-linux_aarch64 --lock third_party/python/requirements_lock.txt \
  --minimums third_party/python/requirements_min.txt \
  --strip-prefix $pkg --summary "Sparse 3-D convolution on MLX." \
  --requires "mlx ==" --requires "mlx-cpu ==;platform_system == 'Linux'" \
  --requires "nanobind ==" --requires "numpy >=" --sibling quantrules "${files[@]}"
stamp "wheel: $(basename "$wheel")"

# 3. The wheel on aarch64 CPython under qemu.
run=$build/run
mkdir -p "$run/site" "$run/tests"
python3 -m zipfile -e "$wheel" "$run/site"
cp -r packages/quantrules/quantrules "$run/site/"  # pure Python, as its wheel
cp "$build/_version.py" "$run/site/quantrules/_version.py"
cp $pkg/conftest.py "$run/"
cp tools/pytest_main.py "$run/"  # the pytest entry with the seeding plugin the conftest uses
cp $pkg/tests/test_conv.py $pkg/tests/test_quantized_pool.py $pkg/tests/test_relations.py \
  $pkg/tests/test_validation_threads.py $pkg/tests/test_int8_conv.py \
  $pkg/tests/test_bf16_conv.py $pkg/tests/test_half_conv.py $pkg/tests/int8_refs.py \
  $pkg/tests/relation_refs.py "$run/tests/"
aarch64-linux-gnu-readelf -h "$run/site/mlx_lattice/_native/ext.so" | grep -q 'Machine:.*AArch64' ||
  { echo "FAIL: the wheel's extension is not aarch64"; exit 1; }
qemu="qemu-aarch64-static -cpu max -L $sysroot"
py=(timeout "${MLX_LATTICE_ARM64_TIMEOUT:-900}" env PYTHONPATH="$run/site:$site" PYTHONNOUSERSITE=1
  MLX_LATTICE_NUM_THREADS=2 MLX_LATTICE_TEST_LAUNCHER="$qemu" $qemu "$sysroot/usr/bin/python3.11")
(cd "$run" && "${py[@]}" -c 'import platform, mlx.core as mx
from mlx_lattice._native import ext
print(platform.machine(), "mlx", mx.__version__, "fp32 paths", ext.gemm_isas(), "int8",
      ext.int8_isa(), "bf16", ext.bf16_isa(), "fp16", ext.fp16_isa())
assert platform.machine() == "aarch64" and ext.gemm_isas() == ["neon-fma", "scalar"]
assert (ext.int8_isa(), ext.bf16_isa(), ext.fp16_isa()) == ("neon-i8mm", "neon-bf16", "neon-fhm")')
# Deselected here: mx.compile on the CPU stream JIT-compiles C++ with a
# compiler the aarch64 sysroot does not have (both tests run in full on x86).
deselect=(--deselect tests/test_conv.py::test_compile_and_repeated_calls_are_bitwise_stable
  --deselect tests/test_quantized_pool.py::test_compile_through_pool_quantized_and_sorted
  --deselect tests/test_int8_conv.py::test_gradients_compile_and_vmap)
# The tests that force each aarch64 path (neon-i8mm, neon-dotprod,
# neon-bf16, neon-fhm, neon-fma against scalar, bit for bit) or check one
# against a dense or brute-force reference; the rest of these files tests
# what the x86 lanes test, through the same paths.
subset=${MLX_LATTICE_ARM64_SUBSET-isa or micro_kernel or mirror or conversions or matches_dense or brute_force}
# Of the relation tests, those of the one builder with aarch64 code of its
# own (relation_mirror.cpp: the NEON popcount) and the brute-force
# submanifold check; the rest build relations with portable C++ the x86
# lanes test, and took 330 of the subset's 545 process-seconds under qemu
# (the conv, int8 and half tests build relations on aarch64 too).
relations=("tests/test_relations.py::test_mirrored_edge_pass_with_and_without_popcnt"
  "tests/test_relations.py::test_mirrored_relations_are_the_same_bits_at_every_isa"
  "tests/test_relations.py::test_submanifold_matches_brute_force")
# Two shards side by side (tools/pytest_main.py's sharding, every second
# test each): qemu runs a process's Python on one core.
shards=${MLX_LATTICE_ARM64_SHARDS:-2}
pids=()
for ((i = 0; i < shards; i++)); do
  (cd "$run" && TEST_TOTAL_SHARDS=$shards TEST_SHARD_INDEX=$i "${py[@]}" pytest_main.py -q \
    "${relations[@]}" tests/test_conv.py tests/test_quantized_pool.py tests/test_int8_conv.py \
    tests/test_bf16_conv.py tests/test_half_conv.py \
    "tests/test_validation_threads.py::test_every_micro_kernel_path" \
    "tests/test_validation_threads.py::test_half_conversions_round_trip_exactly" \
    "tests/test_validation_threads.py::test_isa_list_is_ordered_and_ends_in_scalar" \
    ${subset:+-k "$subset"} "${deselect[@]}") >"$build/shard$i.log" 2>&1 &
  pids+=("$!")
done
failed=0
for ((i = 0; i < shards; i++)); do
  wait "${pids[$i]}" || failed=1
  echo "--- shard $((i + 1)) of $shards"
  cat "$build/shard$i.log"
done
[ "$failed" = 0 ] || { echo "FAIL: the aarch64 Python subset"; exit 1; }
stamp "aarch64 Python subset passed"
