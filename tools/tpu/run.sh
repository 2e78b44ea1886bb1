#!/usr/bin/env bash
# The TPU lane (docs/topics/tpu.rst): on a TPU host, from the repository root,
#
#   tools/tpu/run.sh [--wheels DIR] [--no-install] [--no-tests] [--no-bench] [OUT]
#
# 1. installs what the lock pins and the host lacks from the wheels that
#    tools/tpu/fetch_wheels.sh fetched into DIR (default .whl/tpu), into
#    .whl/tpu-site, put on PYTHONPATH after the host's own entries;
# 2. writes the packages' _version.py from tools/version.bzl, as Bazel does;
# 3. runs the whole quantrules and taktiny_ops suites (doctests, fuzz targets
#    and *_test.py files included) in ONE pytest process on the default JAX
#    backend, through tools/pytest_main.py (the seed fixtures): OUT/pytest.log
#    and OUT/pytest.xml (JUnit);
# 4. then runs each TPU benchmark present (benchmarks/tpu_matmul.py, then
#    benchmarks/tpu_train.py) with OUT in the
#    environment, its output in OUT/<name>.txt and .json (and the training
#    loss picture in OUT/tpu_train_loss.png).
# OUT is the argument, else $OUT, else tpu_lane_out. It exits non-zero when
# a test or a benchmark fails. Without a TPU it runs the same on the CPU
# (--no-install where the lock's environment is already there). --no-tests
# and --no-bench split the tests and the benchmarks into two runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=.whl/tpu
install=1
tests=1
bench=1
out="${OUT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --no-tests) tests=0; shift ;;
    --no-bench) bench=0; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
out="${out:-tpu_lane_out}"
python="${PYTHON:-python3}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
site="$(pwd)/.whl/tpu-site"

export PYTHONPATH="packages/quantrules:packages/taktiny_ops:tools${PYTHONPATH:+:$PYTHONPATH}:$site"
export PYTHONDONTWRITEBYTECODE=1

echo "== install (from $wheels)"
if [ "$install" = 1 ]; then
  "$python" tools/tpu/wheels.py install "$wheels" "$site" || exit 1
else
  echo "skipped (--no-install)"
fi

echo "== _version.py from tools/version.bzl"
version=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' tools/version.bzl)
for pkg in quantrules taktiny_ops; do
  "$python" tools/gen_version.py "$version" "packages/$pkg/$pkg/_version.py" || exit 1
done
echo "$version"

echo "== host"
"$python" - <<'PY' | tee "$out/host.txt"
import importlib.metadata as md, platform, jax
print("python", platform.python_version(), platform.machine())
for name in ("jax", "jaxlib", "libtpu", "numpy", "flax", "qwix", "optax", "pytest", "hypothesis"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} -")
print("backend", jax.default_backend(), "devices", [d.device_kind for d in jax.devices()])
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

status=0
if [ "$tests" = 1 ]; then
  echo "== tests (one process)"
  export XML_OUTPUT_FILE="$out/pytest.xml"
  "$python" tools/pytest_main.py -W ignore::DeprecationWarning \
    packages/quantrules/tests/*.py packages/taktiny_ops/tests/*.py \
    --doctest-modules --doctest-continue-on-failure \
    packages/quantrules/quantrules/*.py packages/taktiny_ops/taktiny_ops/*.py \
    2>&1 | tee "$out/pytest.log"
  tests=${PIPESTATUS[0]}
  unset XML_OUTPUT_FILE
  "$python" - "$out/pytest.xml" <<'PY' | tee "$out/summary.txt"
import collections, sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
kinds = collections.Counter()
reasons = collections.Counter()
for case in cases:
    tags = {child.tag for child in case}
    kind = ("failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags
            else "passed")
    kinds[kind] += 1
    if kind == "skipped":
        reasons[case.find("skipped").get("message", "").splitlines()[0][:160]] += 1
print("lane:", ", ".join(f"{kinds[k]} {k}" for k in ("passed", "skipped", "failed")))
for reason, count in reasons.most_common():
    print(f"  skipped {count}: {reason}")
PY
  status=$tests
fi
bench() {  # bench NAME ARGS...: benchmarks/NAME.py, if present, into OUT/NAME.txt
  local name="$1"; shift
  [ -e "benchmarks/$name.py" ] || return 0
  echo "== benchmark $name"
  OUT="$out" "$python" "benchmarks/$name.py" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "benchmark $name exited $rc"; status=1; }
}
if [ "$bench" = 1 ]; then
  bench tpu_matmul --json "$out/tpu_matmul.json"
  bench tpu_train --json "$out/tpu_train.json" --png "$out/tpu_train_loss.png"
fi
echo "== done: exit $status; output in $out"
exit "$status"
