#!/usr/bin/env bash
# ThreadSanitizer run of the MSL harness (thread-per-lane mode):
# 1. the correct kernels run race-free;
# 2. the planted missing barrier is reported as a data race;
# 3. a planted plain (non-atomic) counter increment is reported too.
# Where TSan cannot run, this fails loudly: skip it explicitly with
# --test_tag_filters=-tsan, never silently.
set -uo pipefail
bin="$1"
out=$("$bin" --threads-only 2>&1)
status=$?
echo "$out" | tail -n 5
if [ $status -ne 0 ]; then
  echo "FAIL: the harness under ThreadSanitizer failed (exit $status); if TSan is unavailable" \
       "on this machine, skip this target with --test_tag_filters=-tsan" >&2
  exit 1
fi
race=$("$bin" --race 2>&1)
if ! echo "$race" | grep -q "ThreadSanitizer: data race"; then
  echo "FAIL: ThreadSanitizer did not report the planted missing barrier" >&2
  echo "$race" | tail -n 20 >&2
  exit 1
fi
echo "$race" | grep -m1 "SUMMARY: ThreadSanitizer"
counter=$("$bin" --race-counter 2>&1)
if ! echo "$counter" | grep -q "ThreadSanitizer: data race"; then
  echo "FAIL: ThreadSanitizer did not report the planted non-atomic increment" >&2
  echo "$counter" | tail -n 20 >&2
  exit 1
fi
echo "3 passed, 0 failed (race-free kernels, atomics included, clean under TSan; planted races reported)"
