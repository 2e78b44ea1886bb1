#!/usr/bin/env bash
# The mlx_lattice extension and kernel tests under the sanitizers, in the
# modern lane (docs/topics/sanitizers.rst): AddressSanitizer + LeakSanitizer
# + UBSan (--config=asan), then ThreadSanitizer (--config=tsan). Prints each
# test target's closing pytest line and exits non-zero when a test fails or a
# test log holds a sanitizer report.
set -uo pipefail
cd "$(dirname "$0")/.."

pkg=//packages/mlx_lattice
# The leak check's own test, then the mlx_lattice test suite but for these
# targets: soak_tests and memory_tests bound resident memory, which ASan's
# quarantine and shadow memory inflate (their leak question is
# LeakSanitizer's here); metal_harness_tests (the Metal kernels through the
# MSL CPU harness) takes 7 minutes instrumented: by hand
# (docs/topics/sanitizers.rst), as do fused_int8_metal_tests and
# amx_model_fuzz_tests, which load the harness's extension too (built
# instrumented, 2.5 minutes of the lane); distributed_tests (processes
# over sockets, the same kernels as the rest); metal_gpu_tests (Apple
# GPUs); lint and wheel_test (no native code of their own).
ASAN_TARGETS=(
  //tools:sanitizer_hook_test
  "$pkg:gemm_test"
  "$pkg:gemm_half_test"
  "$pkg:amx_int8_test"
  "$pkg:amx_bf16_test"
  "$pkg:parallel_test"
  "$pkg:relation_tests"
  "$pkg:conv_tests"
  "$pkg:conv_padding_tests"
  "$pkg:half_conv_tests"
  "$pkg:mixed_precision_tests"
  "$pkg:int8_tests"
  "$pkg:quantized_pool_tests"
  "$pkg:quantize_model_tests"
  "$pkg:weight_grad_tests"
  "$pkg:geometry_tests"
  "$pkg:knn_path_tests"
  "$pkg:layer_tests"
  "$pkg:norm_path_tests"
  "$pkg:norm_eval_tests"
  "$pkg:model_tests"
  "$pkg:model_file_tests"
  "$pkg:data_label_tests"
  "$pkg:io_tests"
  "$pkg:coding_tests"
  "$pkg:export_tests"
  "$pkg:user_api_tests"
  "$pkg:validation_thread_tests"
  "$pkg:thread_stress_tests"
  "$pkg:concurrency_tests"
  "$pkg:unit_tests"
  "$pkg:gemm_int8_fused_test"
  "$pkg:inference_tests"
  "$pkg:skip_fusion_tests"
  "$pkg:arena_tests"
  "$pkg:concat_rows_tests"
  "$pkg:kernel_name_tests"
)
# The targets whose kernels run on several threads at once; of the weight
# gradient's tests (4 minutes whole under TSan on 2 cores) those that run
# several thread counts.
TSAN_TARGETS=(
  "$pkg:gemm_test"
  "$pkg:gemm_half_test"
  "$pkg:amx_int8_test"
  "$pkg:amx_bf16_test"
  "$pkg:parallel_test"
  "$pkg:validation_thread_tests"
  "$pkg:thread_stress_tests"
  "$pkg:arena_tests"
  "$pkg:concat_rows_tests"
)
TSAN_FILTERED=("$pkg:weight_grad_tests" --test_arg=-k --test_arg="thread or slabs or grouping")
# The relation builder's parallel passes (the sorted walk's two rounds of
# chunks, the grid, the groupings) at several thread counts.
TSAN_RELATIONS=("$pkg:relation_tests" --test_arg=-k --test_arg="thread or long_slabs")
# The native fuzz targets (docs/topics/reliability.rst) at 40 examples per
# test, in the same run (only fuzz targets read the variable): instrumented,
# each example and each child process runs several times slower, and the
# native tests at their CI budgets (14 of them then) took over 9 minutes
# here; the plain lanes run the full CI budgets. The AMX drivers' fuzz
# targets (amx_model_fuzz_tests) need the MSL harness's extension built
# instrumented as well (2.5 minutes of the lane for 33 s of tests); under
# ASan the drivers run in amx_int8_test, amx_bf16_test and
# gemm_int8_fused_test on the tile model, and the fuzz targets run in the
# plain lanes.
ASAN_FUZZ=("$pkg:fuzz_tests" --test_env=QUANTLATTICE_FUZZ_EXAMPLES=40)

failures=0
run() {  # run CONFIG TARGET|OPTION...: test the targets under one sanitizer config
  local config=$1 t0=$SECONDS rc target log dir found logs
  shift
  echo "=== --config=$config ==="
  ./bazelw test --config="$config" ${QUANTLATTICE_TEST_JOBS:+--local_test_jobs=$QUANTLATTICE_TEST_JOBS} "$@"
  rc=$?
  echo "=== pytest summaries (--config=$config) ==="
  for target in "$@"; do
    [[ $target == //* ]] || continue
    dir=bazel-testlogs/${target#//}
    dir=${dir/://}
    # A sharded target (shard_count) has one log per shard.
    logs=("$dir"/test.log "$dir"/shard_*_of_*/test.log)
    echo "$target"
    found=0
    for log in "${logs[@]}"; do
      [ -f "$log" ] || continue
      found=1
      [ "$log" = "$dir/test.log" ] || echo "  ${log#"$dir"/}" | sed 's|/test.log$||'
      grep -aE '^(=+ )?[0-9]+ (passed|failed|deselected)|^[0-9]+ passed, [0-9]+ failed|no tests ran' "$log" | tail -n 1
      # A report in a test that still passed (e.g. in a child process whose
      # exit status the test ignores) fails the step as well.
      if grep -aqE '^(==[0-9]+==)?(ERROR|WARNING): (Address|Leak|Thread)Sanitizer|runtime error: ' "$log"; then
        echo "  sanitizer report in $log"
        rc=1
      fi
    done
    [ "$found" = 1 ] || echo "  (no test log)"
  done
  echo "=== --config=$config: exit $rc after $((SECONDS - t0)) s ==="
  [ "$rc" = 0 ] || failures=$((failures + 1))
}

start=$SECONDS
run asan "${ASAN_TARGETS[@]}" "${ASAN_FUZZ[@]}"
run tsan "${TSAN_TARGETS[@]}"
run tsan "${TSAN_FILTERED[@]}"
run tsan "${TSAN_RELATIONS[@]}"
echo "=== sanitizers took $((SECONDS - start)) s, $failures failed run(s) ==="
[ "$failures" = 0 ]
