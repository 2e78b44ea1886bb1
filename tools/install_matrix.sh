#!/usr/bin/env bash
# The wheels install where MLX does: a fresh virtual environment of (a) the
# host's CPython and (b) Debian 12 (bookworm)'s CPython 3.11 in a minimal
# root of its own installs the three wheels (their dependencies from the index
# pip is configured with), imports them and runs tools/install_check.py: a
# sparse conv against MLX's dense conv, an int8 taktiny_ops.linear against
# jnp.dot.
#
#   tools/install_matrix.sh [WHEEL_DIR]
#
# WHEEL_DIR holds //:wheels (default: `./bazelw build //:wheels` in the lane
# QUANTLATTICE_LANE names, as .ci/run builds them). The bookworm root is made
# once with mmdebstrap under ${XDG_CACHE_HOME:-~/.cache}/quantlattice/
# (~1 min; QUANTLATTICE_DEBIAN_MIRROR as in ./bazelw) and entered with
# unshare + chroot, seeing the machine's pip configuration and CA
# certificates. Needs root (or sudo -n) and the package index. Each
# environment's steps are bounded by `timeout`; exits non-zero on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$SECONDS
version=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' tools/version.bzl)
python=${QUANTLATTICE_PYTHON:-python3}
mirror=${QUANTLATTICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/quantlattice
bookworm=$cache/bookworm-python3.11
sudo=
[ "$(id -u)" = 0 ] || sudo="sudo -n"

work=$(mktemp -d)
trap '$sudo rm -rf "$work"' EXIT
mkdir -p "$work/wheels"
if [ $# -ge 1 ]; then
  cp "$1"/*.whl "$work/wheels/"
else
  rm -f bazel-bin/packages/*/*.whl # only this build's wheels
  QUANTLATTICE_LANE=${QUANTLATTICE_LANE:-modern} ./bazelw build //:wheels
  cp bazel-bin/packages/*/*.whl "$work/wheels/"
fi
cp tools/install_check.py "$work/"
echo "=== install matrix: $(cd "$work/wheels" && ls | tr '\n' ' ')==="
projects=(quantlattice_mlx_lattice=="$version" taktiny_ops=="$version" quantrules=="$version")

# The three projects must come from WHEEL_DIR, never from an index that
# happens to hold the same names.
check_report='
import json, sys
wheels = sys.argv[2]
for item in json.load(open(sys.argv[1]))["install"]:
    name, url = item["metadata"]["name"], item["download_info"]["url"]
    if name in ("quantlattice_mlx_lattice", "taktiny_ops", "quantrules") and not url.startswith("file://" + wheels + "/"):
        sys.exit(f"{name} came from {url}, not from {wheels}")
'

status=0
run_env() {  # run_env NAME COMMAND...: one environment, timed
  local name=$1 t0=$SECONDS
  shift
  echo "=== install matrix: $name ==="
  if "$@"; then
    echo "=== install matrix: $name passed after $((SECONDS - t0)) s ==="
  else
    echo "=== install matrix: $name FAILED after $((SECONDS - t0)) s ===" >&2
    status=1
  fi
}

# Inside the environment: venv, install, check. Arguments: PYTHON VENV_DIR.
inner='
set -euo pipefail
python=$1 venv=$2 work=$3 version=$4 check_report=$5
shift 5
timeout 300 "$python" -m venv "$venv"
glibc=$("$venv/bin/python" -c "import platform; print(*platform.libc_ver())")
echo "$("$venv/bin/python" -V) ($glibc)"
if ! timeout 1200 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --find-links "$work/wheels" --report "$venv.report.json" "$@"; then
  echo "pip could not install $* from $work/wheels here ($glibc); the wheels: $(ls "$work/wheels")" >&2
  exit 1
fi
"$venv/bin/python" -c "$check_report" "$venv.report.json" "$work/wheels"
cd "$work" && timeout 600 "$venv/bin/python" -I install_check.py "$version"
'

run_env "host CPython ($("$python" -V 2>&1))" \
  env -u PYTHONPATH bash -c "$inner" inner "$python" "$work/host" "$work" "$version" "$check_report" "${projects[@]}"

make_bookworm() {
  [ -e "$bookworm/.complete" ] && return 0
  echo "install matrix: building a Debian bookworm root in $bookworm (once, ~1 min)..."
  $sudo rm -rf "$bookworm.tmp"
  mkdir -p "$cache"
  # The machine clock may be past the Release file's validity.
  if ! timeout 900 $sudo mmdebstrap --quiet --variant=minbase \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --include=python3,python3-venv,ca-certificates bookworm "$bookworm.tmp" "$mirror" \
    >"$cache/mmdebstrap-bookworm.log" 2>&1; then
    echo "install matrix: mmdebstrap failed; see $cache/mmdebstrap-bookworm.log" >&2
    return 1
  fi
  $sudo touch "$bookworm.tmp/.complete"
  $sudo mv "$bookworm.tmp" "$bookworm"
}

# pip inside the root sees the machine's pip configuration (as ./bazelw's
# roots do): its variables, config files, CA certificates, local paths they name.
passenv=()
while IFS= read -r name; do passenv+=("$name=${!name}"); done < <(
  env | sed -n 's/^\(PIP_[A-Z_]*\|SSL_CERT_[A-Z]*\|REQUESTS_CA_BUNDLE\|CURL_CA_BUNDLE\|[Hh][Tt][Tt][Pp][Ss]*_[Pp][Rr][Oo][Xx][Yy]\|[Nn][Oo]_[Pp][Rr][Oo][Xx][Yy]\)=.*/\1/p')
mapfile -t pipdirs < <("$python" - "$HOME" <<'PY'
import os, re, subprocess, sys
home = sys.argv[1]
paths = {"/etc/ssl", "/etc/pip.conf", "/etc/xdg/pip", home + "/.config/pip", home + "/.pip"}
text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
text += "\n".join(v for k, v in os.environ.items() if k.startswith("PIP_") or "CERT" in k or "CA_BUNDLE" in k)
for path in re.findall(r"(?:file://)?(/[^\s'\"]+)", text):
    # a local simple index links to files beside it
    paths.add(os.path.dirname(path.rstrip("/")) if path.rstrip("/").endswith("/simple") else path)
kept = []
for p in sorted({os.path.realpath(p) for p in paths}):
    if os.path.exists(p) and not p.startswith(("/proc", "/dev", "/sys", "/tmp")):
        if not any(p.startswith(k + "/") for k in kept):  # inside one already bound
            kept.append(p)
print("\n".join(kept))
PY
)

in_bookworm() {  # in_bookworm COMMAND...: run inside the bookworm root
  # shellcheck disable=SC2016 # expanded by the inner shell
  $sudo env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$HOME" LANG=C.UTF-8 \
    ROOTFS="$bookworm" WORK="$work" PIPDIRS="${pipdirs[*]}" "${passenv[@]}" \
    unshare --mount --propagation private -- bash -euo pipefail -c '
bind() {  # bind SRC at the same path inside the root (read-only with "ro")
  local src=$1 dst=$ROOTFS$1
  if [ -d "$src" ]; then mkdir -p "$dst"; elif [ ! -e "$dst" ]; then mkdir -p "$(dirname "$dst")"; touch "$dst"; fi
  mount --rbind "$src" "$dst"
  if [ "${2:-}" = ro ]; then mount -o remount,bind,ro "$dst"; fi
}
mount -t proc proc "$ROOTFS/proc"
bind /dev
bind /sys
bind "$WORK"
mkdir -p "$HOME/.cache/pip" && bind "$HOME/.cache/pip"
for d in $PIPDIRS; do bind "$d" ro; done
cp -L /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
cp -L /etc/hosts "$ROOTFS/etc/hosts" 2>/dev/null || true
exec chroot "$ROOTFS" "$@"
' in-bookworm "$@"
}

bookworm_env() {
  make_bookworm || return 1
  in_bookworm bash -c "$inner" inner /usr/bin/python3 "$work/bookworm" "$work" "$version" "$check_report" "${projects[@]}"
}
run_env "Debian 12 (bookworm) CPython 3.11" bookworm_env

echo "=== install matrix: took $((SECONDS - start)) s ==="
exit $status
