#!/usr/bin/env bash
# The AMX check for an Intel host with AMX (a few minutes; no Bazel, MLX or
# Python needed): builds the kernel core with plain g++ (-O3 -std=c++20, as the extension),
# runs //packages/mlx_lattice:amx_int8_test (the AMX-INT8 driver on the
# hardware and on the tile model, bit for bit against the documented math,
# every int8 path forced) and amx_bf16_test (the AMX-BF16 forward and
# feature gradient on both, within cpu/amx_bf16.h's bound), and times the
# kernels on a 100k-row, 5.9-edge, C64 relation (tools/amx/amx_timing.cc: fp32 FMA,
# int8 VNNI, int8 AMX, bf16 AMX, and on every host the AMX drivers with
# their tile instructions left out).
# On a host without AMX it runs the same with the model and the fallbacks
# and says so.
#
# Usage: tools/amx/check.sh [timing rows] [repeats]
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
cpu=packages/mlx_lattice/csrc/cpu
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cxx=(${CXX:-g++} -std=c++20 -O3 -Wall -Wextra -Wno-unused-parameter -Wno-maybe-uninitialized -fno-strict-aliasing -pthread)

echo "== host"
grep -m1 "model name" /proc/cpuinfo || true
flags=$(grep -m1 "^flags" /proc/cpuinfo || true)
for f in avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16; do
  case " $flags " in *" $f "*) printf '%s=yes ' "$f" ;; *) printf '%s=no ' "$f" ;; esac
done
echo
"${cxx[0]}" --version | head -1
uptime

echo "== build"
int8=($cpu/gemm_int8.cpp $cpu/gemm_int8_quant.cpp $cpu/gemm_int8_amx.cpp $cpu/isa.cpp
  $cpu/gemm_arm.cpp $cpu/parallel.cpp)
bf16=($cpu/gemm_bf16.cpp $cpu/gemm_bf16_amx.cpp)
"${cxx[@]}" "${int8[@]}" $cpu/amx_int8_test.cpp -o "$out/amx_int8_test" &
"${cxx[@]}" "${bf16[@]}" $cpu/isa.cpp $cpu/gemm_arm.cpp $cpu/parallel.cpp $cpu/amx_bf16_test.cpp \
  -o "$out/amx_bf16_test" &
"${cxx[@]}" "${int8[@]}" $cpu/conv_forward.cpp $cpu/group_by.cpp $cpu/float_formats.cpp $cpu/quantized_weight.cpp $cpu/conv_forward_half.cpp \
  $cpu/gemm.cpp $cpu/weight_gradient.cpp "${bf16[@]}" -I $cpu tools/amx/amx_timing.cc -o "$out/amx_timing"
wait
echo "built in $(($(date +%s) - start)) s"

echo "== amx_int8_test"
timeout 300 "$out/amx_int8_test" | grep -v "^  ok:"

echo "== amx_bf16_test"
timeout 300 "$out/amx_bf16_test" | grep -v "^  ok:"

echo "== timing"
timeout 300 "$out/amx_timing" "${1:-100000}" "${2:-5}"
echo "== done in $(($(date +%s) - start)) s"
