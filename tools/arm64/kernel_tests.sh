#!/usr/bin/env bash
# The pure-C++ micro-kernel test (packages/mlx_lattice/csrc/cpu/gemm_test.cpp,
# no MLX) cross-compiled for aarch64 with Debian's g++-aarch64-linux-gnu and
# run under qemu-aarch64-static on several emulated CPUs: for each, the
# features the dispatch reads (getauxval HWCAP/HWCAP2) must be the ones that
# CPU has, and every path it can run is forced and checked against the same
# references as on x86 (an fma chain bit for bit, a double sum to rounding).
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
aarch64-linux-gnu-g++ -std=c++20 -O2 -Wall -Wextra -Werror -static \
  $cpu/gemm.cpp $cpu/gemm_arm.cpp $cpu/isa.cpp $cpu/gemm_test.cpp -o "$out/gemm_test"

# Emulated CPU -> the features it has (qemu 7.2's models).
declare -A expect=(
  [cortex-a53]="neon=1 fp16=0 dotprod=0 bf16=0 i8mm=0"
  [a64fx]="neon=1 fp16=1 dotprod=0 bf16=0 i8mm=0"
  [neoverse-n1]="neon=1 fp16=1 dotprod=1 bf16=0 i8mm=0"
  [max]="neon=1 fp16=1 dotprod=1 bf16=1 i8mm=1"
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
done
echo "aarch64 kernel tests under qemu: $([ $failed = 0 ] && echo ok || echo FAILED)," \
  "$(( $(date +%s) - start )) s"
exit $failed
