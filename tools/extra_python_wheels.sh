#!/usr/bin/env bash
# Builds and tests mlx_lattice's native wheel for CPython versions the host
# does not have, with the modern lane (Bazel 7.7.1, bzlmod) and Debian's own
# interpreter of that version installed in a forky root of its own
# (QUANTLATTICE_ROOT_PYTHON in ./bazelw):
#
#   tools/extra_python_wheels.sh [VERSION...]    # default: 3.13
#
# For each version: the wheels (//:wheels) built against that interpreter's
# headers and the lock of that version; the wheel installed offline and
# imported by that interpreter with a sparse conv checked (wheel_test);
# auditwheel and twine on it (wheel_audit_test); the conv and unit test
# targets on the extension built for it. Copies the wheels to
# dist/cpXY/ (ignored by git). QUANTLATTICE_DISK_CACHE names a Bazel disk cache. Needs what ./bazelw needs (root, Debian's
# registry, PyPI); the first run of a version builds its root (~2 min) and
# compiles the extension (~6 min on 2 cores), later runs are incremental.
#
# CPython 3.12 is not in any Debian suite (bookworm has 3.11, trixie, forky
# and sid have 3.13), nor on PyPI or npm as an installable interpreter, so
# its wheel cannot be built offline here; see docs/build.rst (Wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ "${#versions[@]}" -gt 0 ] || versions=(3.13)
status=0
for version in "${versions[@]}"; do
  cp=cp${version/./}
  echo "=== CPython $version: wheels and tests (modern lane, Debian's python$version) ==="
  export QUANTLATTICE_ROOT_PYTHON=$version
  # //:wheels named too: the wheels are then top-level outputs, which Bazel
  # fetches from the disk cache; as the tests' inputs only, a run whose tests
  # all come from the cache would leave them out of bazel-bin.
  if ! ./bazelw test //:wheels //packages/mlx_lattice:wheel_test //:wheel_audit_test \
    //packages/mlx_lattice:conv_tests //packages/mlx_lattice:unit_tests \
    ${QUANTLATTICE_DISK_CACHE:+--disk_cache=$QUANTLATTICE_DISK_CACHE}; then
    status=1
  fi
  wheel=$(ls -t bazel-bin/packages/mlx_lattice/*-"$cp"-"$cp"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "extra_python_wheels: no $cp wheel was built" >&2
    status=1
  else
    rm -rf "dist/$cp" && mkdir -p "dist/$cp"
    cp "$wheel" bazel-bin/packages/quantrules/*.whl bazel-bin/packages/taktiny_ops/*.whl "dist/$cp/"
    echo "=== CPython $version: $(cd "dist/$cp" && ls) ==="
  fi
  ./bazelw shutdown
done
exit $status
