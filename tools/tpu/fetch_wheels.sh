#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels the TPU lane installs on a TPU
# host that has none (docs/topics/tpu.rst): the lock's hashed lines for the
# distributions tools/tpu/wheels.py names, as CPython 3.11 manylinux x86_64
# binary wheels, checked against the lock's hashes (wheels.py install refuses
# them, naming both, on another Python or machine).
#
#   tools/tpu/fetch_wheels.sh [DIR]     # DIR defaults to .whl/tpu (git-ignored)
#
# Then copy DIR to the TPU host's checkout (or pass it as a carried folder)
# and run tools/tpu/run.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-.whl/tpu}"
python="${PYTHON:-python3}"
mkdir -p "$dir"
"$python" tools/tpu/wheels.py requirements third_party/python/requirements_lock.txt \
  > "$dir/requirements.txt"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 --abi abi3 \
  --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  --require-hashes -r "$dir/requirements.txt" -d "$dir"
count=$(ls "$dir"/*.whl | wc -l)
echo "fetched $count wheels ($(du -sh "$dir" | cut -f1)) into $dir"
