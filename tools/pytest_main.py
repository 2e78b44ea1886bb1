"""Entry point of every pytest test target: runs pytest, reports JUnit XML.

Bazel passes the XML path in XML_OUTPUT_FILE; pytest writes it, so Bazel
sees each test case. The closing `N passed` line goes to the test log.

It also installs the repository's seeding plugin: every test that asks for
the ``seed`` fixture (or ``rng``, a NumPy generator made from it) gets a
seed that is stable per test (derived from the test's id), and a failing
test prints its seed. ``TEST_SEED=<int>`` replays one seed everywhere;
``TEST_SEED=fresh`` draws a new seed per test (still printed on failure).

Targets with ``shard_count`` run in shards: Bazel starts one process per
shard with ``TEST_TOTAL_SHARDS``/``TEST_SHARD_INDEX``, and each runs every
``TEST_TOTAL_SHARDS``-th test of the collection (``ShardPlugin``).

Under ``--config=asan``/``--config=tsan`` (.bazelrc) the instrumented
extension needs its sanitizer runtime loaded first in the interpreter, which
is not instrumented. ``QUANTLATTICE_SANITIZER_PRELOAD`` names that runtime
and libstdc++ (loaded when the runtime starts, so that its ``__cxa_throw``
interceptor finds the real one); this entry re-executes the interpreter with
them in ``LD_PRELOAD`` (Bazel's test wrapper does not run under them) and
the suppression files of ``tools/sanitizers`` in ``LSAN_OPTIONS``/
``UBSAN_OPTIONS``/``TSAN_OPTIONS``, and ``tools/sanitizers/site`` first on
``PYTHONPATH`` (its ``sitecustomize`` runs LeakSanitizer's check at exit
while the interpreter is still whole, in pytest and in every Python child)
and ``tools/sanitizers/bin`` first on ``PATH`` (the ``g++`` that MLX runs
for ``mx.compile``'s CPU kernels starts without the runtime: the compiler
is not under test).
pytest then captures ``sys.stdout``/``sys.stderr`` only, so a report written
to file descriptor 2 reaches the test log.
"""

from __future__ import annotations

import os
import secrets
import sys
import zlib

import pytest

_SEED_KEY = pytest.StashKey[int]()


class SeedPlugin:
    """Seeds random test inputs and names the seed of a failing test."""

    @pytest.fixture
    def seed(self, request: pytest.FixtureRequest) -> int:
        chosen = os.environ.get("TEST_SEED", "")
        if chosen == "fresh":
            value = secrets.randbits(32)
        elif chosen:
            value = int(chosen)
        else:
            value = zlib.crc32(request.node.nodeid.encode())
        request.node.stash[_SEED_KEY] = value
        return value

    @pytest.fixture
    def rng(self, seed: int):
        import numpy as np

        return np.random.default_rng(seed)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        seed = item.stash.get(_SEED_KEY, None)
        if seed is not None and report.failed:
            report.sections.append(
                (
                    "random seed",
                    f"{item.nodeid} drew its inputs with seed {seed}; replay with TEST_SEED={seed}",
                )
            )


class ShardPlugin:
    """Bazel's test sharding (``shard_count`` on the target): shard ``index``
    of ``total`` runs every ``total``-th selected test from ``index`` on, in
    collection order, so the shards together run each test exactly once.

    A shard left without tests (more shards than tests, or a ``-k`` that
    keeps few) passes instead of pytest's "no tests ran" status.
    """

    def __init__(self, index: int, total: int) -> None:
        self.index, self.total = index, total
        self.kept = 0
        self.selected = 0

    @pytest.hookimpl(trylast=True)  # after -k/-m have deselected theirs
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        self.selected = len(items)
        kept = [item for i, item in enumerate(items) if i % self.total == self.index]
        dropped = [item for i, item in enumerate(items) if i % self.total != self.index]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        self.kept = len(kept)

    def pytest_report_header(self) -> str:
        return f"shard {self.index + 1} of {self.total}"


def _shard_plugin() -> ShardPlugin | None:
    """The sharding plugin when Bazel runs this test in shards.

    Bazel sets ``TEST_TOTAL_SHARDS``/``TEST_SHARD_INDEX`` and expects the
    runner to touch ``TEST_SHARD_STATUS_FILE`` to say it shards.
    """
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
        open(status, "w").close()
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "0") or 0)
    if total <= 1:
        return None
    return ShardPlugin(int(os.environ.get("TEST_SHARD_INDEX", "0")), total)


_SUPPRESSIONS = {
    "LSAN_OPTIONS": "lsan.supp",
    "UBSAN_OPTIONS": "ubsan.supp",
    "TSAN_OPTIONS": "tsan.supp",
}


def _preload_sanitizer() -> None:
    """Re-executes the interpreter with QUANTLATTICE_SANITIZER_PRELOAD preloaded."""
    runtime = os.environ.get("QUANTLATTICE_SANITIZER_PRELOAD", "")
    preloaded = os.environ.get("LD_PRELOAD", "")
    if not runtime or preloaded.startswith(runtime):
        return
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (runtime, preloaded) if p))
    # Absolute paths: child processes of the tests may run elsewhere.
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sanitizers")
    for name, file in _SUPPRESSIONS.items():
        path = os.path.join(here, file)
        if os.path.exists(path):
            env[name] = ":".join(o for o in (env.get(name, ""), f"suppressions={path}") if o)
    # Every Python process of the test imports site/sitecustomize.py first:
    # LeakSanitizer's check then runs at exit before CPython finalizes.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(here, "site"), env.get("PYTHONPATH", "")) if p)
    # mx.compile's C++ compiler (a child process) runs without the runtime.
    env["PATH"] = os.pathsep.join(p for p in (os.path.join(here, "bin"), env.get("PATH", "")) if p)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)  # noqa: S606 - this very interpreter


def main() -> int:
    args = ["-p", "no:cacheprovider", "--import-mode=importlib", "-ra"]
    if os.environ.get("QUANTLATTICE_SANITIZER_PRELOAD"):
        # A sanitizer report ends the process from native code, on file
        # descriptor 2: pytest's default (fd) capture would swallow it.
        args.append("--capture=sys")
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    shards = _shard_plugin()
    plugins: list[object] = [SeedPlugin()]
    if shards is not None:
        plugins.append(shards)
    code = pytest.main(args + sys.argv[1:], plugins=plugins)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and shards is not None and shards.selected:
        return 0  # the other shards ran this target's tests
    return int(code)


if __name__ == "__main__":
    _preload_sanitizer()
    sys.exit(main())
