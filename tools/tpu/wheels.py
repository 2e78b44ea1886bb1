"""The TPU lane's wheels: which pinned lines to fetch, and which to install.

A TPU host brings its own Python, jax, jaxlib and libtpu (they must match
the chip's runtime) plus NumPy, SciPy, pytest and Hypothesis, and often has
no network. The lane (``tools/tpu/run.sh``, docs/topics/tpu.rst) needs the
rest of what the taktiny_ops and quantrules suites import, at the versions
third_party/python/requirements_lock.txt pins.

``requirements LOCK`` prints the lock's hashed lines for :data:`LANE` (for
``pip download --require-hashes`` on a networked machine:
``tools/tpu/fetch_wheels.sh``).

``install WHEELS TARGET`` installs, from the wheel files in WHEELS, each
distribution of :data:`LANE` that this interpreter lacks or has at another
version than the lock's, into TARGET, which the lane puts on ``PYTHONPATH``
(the suites' contracts are stated for the lock's Flax and Qwix). TARGET
never holds jax, jaxlib, libtpu or NumPy, so the host's own stay the ones
imported. It uses
``pip install --no-index --no-deps --target`` where pip exists and unpacks
the wheels itself otherwise (a wheel is a zip archive of its import tree).
Before installing anything it checks each wheel's tags against this
interpreter and machine (fetch_wheels.sh fetches CPython 3.11 manylinux
x86_64 wheels) and exits naming both when one does not fit.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

#: What the suites import beyond the host's jax/jaxlib/libtpu/NumPy/SciPy/
#: pytest/Hypothesis: Flax, Qwix and optax with their dependency closure
#: (extras included, as the lock resolved them for CPython 3.11 on Linux),
#: flatbuffers for jax.export, matplotlib for the training picture.
LANE = (
    "absl-py", "aiofiles", "contourpy", "cycler", "etils", "flatbuffers", "flax", "fonttools",
    "fsspec", "humanize", "kiwisolver", "markdown-it-py", "matplotlib", "mdurl", "msgpack",
    "optax", "orbax-checkpoint", "pillow", "prometheus-client", "protobuf", "psutil", "pygments",
    "pyparsing", "python-dateutil", "pyyaml", "qwix", "rich", "simplejson", "tensorstore",
    "treescope", "typing-extensions", "tzdata", "uvloop", "zipp",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(lock: Path) -> dict[str, list[str]]:
    """The lock's entries by normalized name: each a list of its lines
    (``name==version \\`` and its ``--hash=`` continuation lines)."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name = _norm(line.split("==", 1)[0].strip())
            current = entries.setdefault(name, [])
            current.append(line)
        elif line.strip().startswith("--hash") and current is not None:
            current.append(line)
        else:
            current = None
    return entries


def requirements(lock: Path) -> str:
    """The hashed requirement lines of :data:`LANE`, in the lock's words."""
    entries = pinned(lock)
    missing = [name for name in LANE if _norm(name) not in entries]
    if missing:
        raise SystemExit(f"lock: {lock} does not pin {', '.join(missing)}")
    return "\n".join(line for name in LANE for line in entries[_norm(name)]) + "\n"


def _wheel_name(path: Path) -> str:
    return _norm(path.name.split("-", 1)[0])


_MACHINES = ("x86_64", "aarch64", "arm64", "amd64", "ppc64le", "s390x")


def misfit(wheel: str, version: tuple[int, int], machine: str,
           implementation: str = "CPython") -> str | None:
    """None when an ``implementation`` ``version`` interpreter on ``machine``
    can install the wheel file ``wheel``; else what the wheel's tags need.

    >>> cp311 = "tensorstore-0.1.69-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    >>> misfit(cp311, (3, 11), "x86_64") is None
    True
    >>> misfit(cp311, (3, 12), "x86_64"), misfit(cp311, (3, 11), "aarch64")
    ('CPython 3.11 on x86_64', 'CPython 3.11 on x86_64')
    >>> misfit(cp311, (3, 11), "x86_64", "PyPy")
    'CPython 3.11 on x86_64'
    >>> misfit("optax-0.2.4-py3-none-any.whl", (3, 12), "aarch64") is None
    True
    >>> abi3 = "pyyaml-6.0-cp38-abi3-manylinux_2_17_x86_64.whl"
    >>> misfit(abi3, (3, 11), "x86_64") is None, misfit(abi3, (3, 7), "x86_64")
    (True, 'CPython 3.8 or later on x86_64')
    """
    py, abi, plat = wheel[: -len(".whl")].split("-")[-3:]
    needs = []
    fits_python = False
    for tag in py.split("."):
        if tag.startswith("py3"):
            fits_python = True
        elif tag.startswith("cp3") and tag[3:].isdigit():
            need = (3, int(tag[3:]))
            later = abi == "abi3"
            needs.append(f"CPython 3.{need[1]}" + (" or later" if later else ""))
            fits_python |= implementation == "CPython" and (
                version == need or (later and version >= need))
    plats = plat.split(".")
    fits_machine = "any" in plats or any(t.endswith(machine) for t in plats)
    if fits_python and fits_machine:
        return None
    arch = next((m for m in _MACHINES if any(t.endswith(m) for t in plats)), plat)
    return (needs[0] if needs else py) + ("" if "any" in plats else f" on {arch}")


def install(wheels: Path, target: Path) -> int:
    """Install what the host lacks; print one line per distribution."""
    files = {_wheel_name(p): p for p in sorted(wheels.glob("*.whl"))}
    todo = []
    for name in LANE:
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        wheel = files.get(_norm(name))
        pin = wheel.name.split("-")[1] if wheel else "?"
        if have is not None and (have == pin or wheel is None):
            print(f"have       {name} {have}" + ("" if wheel else " (no wheel fetched)"))
        elif wheel is None:
            print(f"MISSING    {name}: no wheel in {wheels} (run tools/tpu/fetch_wheels.sh)")
            return 1
        else:
            print(f"installing {name} {pin}" + (f" over the host's {have}" if have else ""))
            todo.append(wheel)
    if not todo:
        return 0
    host = (platform.python_implementation(), sys.version_info[:2], platform.machine())
    unfit = [(w.name, need) for w in todo if (need := misfit(w.name, host[1], host[2], host[0]))]
    if unfit:
        print(f"wheels: this host runs {host[0]} {host[1][0]}.{host[1][1]} on {host[2]}, but "
              + "; ".join(f"{name} needs {need}" for name, need in unfit[:3])
              + (f" (and {len(unfit) - 3} more)" if len(unfit) > 3 else "")
              + " (tools/tpu/fetch_wheels.sh fetches CPython 3.11 manylinux x86_64 wheels:"
              " fetch this host's with pip download --python-version/--platform, or run the"
              " lane under CPython 3.11 on x86_64)", file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--upgrade", "--target", str(target)]
    if subprocess.run([sys.executable, "-m", "pip", "--version"],
                      capture_output=True).returncode == 0:
        return subprocess.run(pip + [str(w) for w in todo]).returncode
    for wheel in todo:  # no pip on the host: a wheel is a zip of its import tree
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "requirements":
        sys.stdout.write(requirements(Path(argv[1])))
        return 0
    if len(argv) == 3 and argv[0] == "install":
        return install(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
