#!/usr/bin/env bash
# The wheels' lower bounds are real: installs the oldest versions in
# third_party/python/requirements_min.txt (the Requires-Dist lower bounds
# tools/build_wheel.py writes) into throwaway virtual environments of the
# host's CPython, the built wheels next to them, and runs the packages' pytest
# suites against the installed wheels, outside Bazel:
#
#   tools/test_minimums.sh WHEEL_DIR
#
#   mlx env: numpy at its minimum, mlx/mlx-cpu/nanobind and the `las`
#            extra's laspy/lazrs at the lock's exact pins, plyfile 1.0.3 (the
#            PLY writer's reference reader; the lock's 1.1.5 needs a newer
#            numpy); quantrules and
#            mlx_lattice tests (not the Metal harness tests, the AMX tile model's
#            fuzz targets and the two-process tests, whose extra targets the
#            wheel lacks).
#   jax env: jax, jaxlib, flax and flatbuffers at their minimums, qwix at
#            the lock's pin;
#            quantrules and taktiny_ops tests.
#
# The two environments are built and tested side by side (each suite is one
# pytest process); their output is printed one after the other.
#
# WHEEL_DIR holds //:wheels of either lane (both are manylinux_2_35: their
# extension runs on a glibc 2.35 host or newer, bookworm's among them). Needs
# PyPI. Each test prints its closing pytest line; exits non-zero on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
wheels=$(cd "${1:?usage: tools/test_minimums.sh WHEEL_DIR}" && pwd -P)
python=${QUANTLATTICE_PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# JAX's persistent compilation cache, the one ./bazelw's lanes use (its
# entries are keyed by the JAX version among the rest): a second run loads
# the programs the first one compiled.
export JAX_COMPILATION_CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/quantlattice/jax-cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
mkdir -p "$JAX_COMPILATION_CACHE_DIR"

pin() {  # pin NAME FILE: the NAME==version line of FILE
  grep -iE "^$1==" "$2" | sed 's/[ \\].*//'
}
mins=third_party/python/requirements_min.txt
lock=third_party/python/requirements_lock.txt

env_with() {  # env_with DIR REQUIREMENT...: a venv with these installed
  local dir=$1
  shift
  "$python" -m venv "$dir"
  if ! "$dir/bin/pip" install --quiet --disable-pip-version-check --only-binary=:all: "$@" >"$dir.log" 2>&1; then
    cat "$dir.log" >&2
    return 1
  fi
  "$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-index \
    "$wheels"/quantrules-*.whl "${extra_wheels[@]}"
  "$dir/bin/pip" list --disable-pip-version-check 2>/dev/null | grep -iE "^(numpy|jax|jaxlib|flax|mlx|qwix) " | tr -s ' ' | tr '\n' ' ' || true
  echo
}

run_tests() {  # run_tests ENV PACKAGE PATH... (test paths under packages/PACKAGE; --ignore=PATH)
  local env=$1 package=$2 arg args=() log
  shift 2
  log=$env-$package.log
  for arg in "$@"; do
    case "$arg" in
    --ignore=*) args+=("--ignore=$root/packages/$package/${arg#--ignore=}") ;;
    *) args+=("$root/packages/$package/$arg") ;;
    esac
  done
  echo "=== minimums: $package tests ==="
  # From a folder outside the sources: tests that start a fresh interpreter
  # must import the installed wheel, not packages/*/ of the checkout.
  (cd "$work" && "$env/bin/python" "$root/tools/pytest_main.py" -q \
    -W ignore::DeprecationWarning "${args[@]}") >"$log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$log" || true
  tail -n 1 "$log"
}

# The mlx wheel's extension is copied in place (pip would check the wheel's
# manylinux level against this host; the extension itself is what runs).
mlx_env() {
  local status=0 site extra_wheels=()
  echo "=== minimums: mlx env ==="
  env_with "$work/mlx" "$(pin numpy $mins)" "$(pin mlx $lock)" "$(pin mlx-cpu $lock)" \
    "$(pin nanobind $lock)" "$(pin laspy $lock)" "$(pin lazrs $lock)" \
    plyfile==1.0.3 pytest hypothesis scipy || return 1
  site=$("$work/mlx/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$work/mlx/bin/python" -m zipfile -e "$(ls "$wheels"/*mlx_lattice-*.whl)" "$site"
  run_tests "$work/mlx" mlx_lattice tests --ignore=tests/test_metal_harness.py \
    --ignore=tests/test_fused_int8_metal.py \
    --ignore=tests/test_fuzz_amx_model.py --ignore=tests/test_distributed.py \
    --ignore=tests/distributed_worker.py
  run_tests "$work/mlx" quantrules tests --ignore=tests/test_qwix.py
  return $status
}

jax_env() {
  local status=0 extra_wheels=("$wheels"/taktiny_ops-*.whl)
  echo "=== minimums: jax env ==="
  env_with "$work/jax" "$(pin jax $mins)" "$(pin jaxlib $mins)" "$(pin flax $mins)" "$(pin flatbuffers $mins)" \
    "$(pin qwix $lock)" pytest hypothesis absl-py || return 1
  run_tests "$work/jax" quantrules tests
  run_tests "$work/jax" taktiny_ops tests tests/sharding_test.py
  return $status
}

# The two environments side by side: each suite is one pytest process, one
# core's work. Their output is printed whole, one after the other.
mlx_env >"$work/mlx.out" 2>&1 &
mlx_pid=$!
jax_env >"$work/jax.out" 2>&1 &
jax_pid=$!
status=0
wait "$mlx_pid" || status=1
cat "$work/mlx.out"
wait "$jax_pid" || status=1
cat "$work/jax.out"
exit $status
