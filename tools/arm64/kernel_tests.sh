#!/usr/bin/env bash
# The pure-C++ micro-kernel tests (packages/mlx_lattice/csrc/cpu/gemm_test.cpp
# and gemm_half_test.cpp, no MLX) cross-compiled for aarch64 with Debian's
# g++-aarch64-linux-gnu and run under qemu-aarch64-static on several emulated
# CPUs: for each, the features the dispatch reads (getauxval HWCAP/HWCAP2)
# must be the ones that CPU has, and every path it can run is forced and
# checked against the same references as on x86 (fp32: an fma chain bit for
# bit, a double sum to rounding; bf16/fp16 convolution: an exact emulation of
# the documented order, bit for bit), and the half-precision paths a CPU lacks
# must fall back to float32.
# Needs root or the Debian packages g++-aarch64-linux-gnu and qemu-user-static.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y --no-install-recommends "${need[@]}" >/dev/null ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cpu=packages/mlx_lattice/csrc/cpu
cxx=(aarch64-linux-gnu-g++ -std=c++20 -O2 -Wall -Wextra -Werror -static)
"${cxx[@]}" $cpu/gemm.cpp $cpu/gemm_arm.cpp $cpu/isa.cpp $cpu/gemm_test.cpp -o "$out/gemm_test" &
"${cxx[@]}" $cpu/gemm_bf16.cpp $cpu/gemm_arm.cpp $cpu/isa.cpp $cpu/parallel.cpp \
  $cpu/gemm_half_test.cpp -o "$out/gemm_half_test" -pthread
wait $!

# Emulated CPU -> the features it has (qemu 7.2's models).
declare -A expect=(
  [cortex-a53]="neon=1 fp16=0 fhm=0 dotprod=0 bf16=0 i8mm=0"
  [a64fx]="neon=1 fp16=1 fhm=0 dotprod=0 bf16=0 i8mm=0"
  [neoverse-n1]="neon=1 fp16=1 fhm=0 dotprod=1 bf16=0 i8mm=0"
  [max]="neon=1 fp16=1 fhm=1 dotprod=1 bf16=1 i8mm=1"
)
# Half-precision convolution: "ceiling bf16-path fp16-path" per forced run.
# Only `max` has FEAT_BF16 and FEAT_FHM; the others must fall back.
declare -A half=(
  [cortex-a53]="neon-bf16,float32,float32"
  [a64fx]="neon-bf16,float32,float32"
  [neoverse-n1]="neon-bf16,float32,float32"
  [max]="neon-bf16,neon-bf16,neon-fhm neon-i8mm,float32,neon-fhm neon-dotprod,float32,float32"
)
failed=0
for model in cortex-a53 a64fx neoverse-n1 max; do
  run=(timeout 120 qemu-aarch64-static -cpu "$model" "$out/gemm_test")
  got=$("${run[@]}" --features)
  if [ "$got" != "${expect[$model]}" ]; then
    echo "FAIL $model: features '$got', expected '${expect[$model]}'"; failed=1
  fi
  for isa in neon-fma scalar; do
    echo -n "$model: " && "${run[@]}" "$isa" || failed=1
  done
  for forced in ${half[$model]}; do
    IFS=, read -r ceiling bf16 fp16 <<<"$forced"
    echo -n "$model: " &&
      timeout 120 qemu-aarch64-static -cpu "$model" "$out/gemm_half_test" "$ceiling" "$bf16" "$fp16" ||
      failed=1
  done
done
# The half blocks as clang (the macOS compiler's family) builds them, where
# clang-16 is installed (tools/macos_check installs it).
if command -v clang++-16 >/dev/null; then
  clang++-16 --target=aarch64-linux-gnu -std=c++20 -O2 -Wall -Wextra -Werror -static -pthread \
    $cpu/gemm_bf16.cpp $cpu/gemm_arm.cpp $cpu/isa.cpp $cpu/parallel.cpp $cpu/gemm_half_test.cpp \
    -o "$out/gemm_half_test_clang"
  echo -n "max, clang-16 build: " &&
    timeout 120 qemu-aarch64-static -cpu max "$out/gemm_half_test_clang" neon-bf16 neon-bf16 \
      neon-fhm || failed=1
fi
echo "aarch64 kernel tests under qemu: $([ $failed = 0 ] && echo ok || echo FAILED)," \
  "$(( $(date +%s) - start )) s"
exit $failed
