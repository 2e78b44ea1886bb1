"""Entry point of every pytest test target: runs pytest, reports JUnit XML.

Bazel passes the XML path in XML_OUTPUT_FILE; pytest writes it, so Bazel
sees each test case. The closing `N passed` line goes to the test log.

It also installs the repository's seeding plugin: every test that asks for
the ``seed`` fixture (or ``rng``, a NumPy generator made from it) gets a
seed that is stable per test (derived from the test's id), and a failing
test prints its seed. ``TEST_SEED=<int>`` replays one seed everywhere;
``TEST_SEED=fresh`` draws a new seed per test (still printed on failure).
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


def main() -> int:
    args = ["-p", "no:cacheprovider", "--import-mode=importlib", "-ra"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    # Bazel's test sharding protocol is not implemented; declare it unsupported.
    if "TEST_SHARD_STATUS_FILE" in os.environ:
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()
    code = pytest.main(args + sys.argv[1:], plugins=[SeedPlugin()])
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
