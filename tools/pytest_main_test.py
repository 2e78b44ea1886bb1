"""tools/pytest_main.py's sharding: the shards of a target run every test
exactly once between them, whatever the shard count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MAIN = Path(__file__).with_name("pytest_main.py")
NAMES = [f"test_case_{i}" for i in range(7)]


def _suite(tmp_path: Path) -> Path:
    body = "\n".join(
        f"def {name}():\n    open({str(tmp_path / 'ran')!r}, 'a').write('{name}\\n')\n" for name in NAMES
    )
    path = tmp_path / "test_suite.py"
    path.write_text(body)
    return path


def _run(tmp_path: Path, suite: Path, index: int, total: int, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEST_", "XML_OUTPUT"))}
    env.update(TEST_TOTAL_SHARDS=str(total), TEST_SHARD_INDEX=str(index),
               TEST_SHARD_STATUS_FILE=str(tmp_path / f"status{index}"),
               # The suites here need no plugin: skip importing the venv's (Hypothesis, ...).
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # fmt: skip
    return subprocess.run([sys.executable, str(MAIN), "-q", str(suite), *args],
                          env=env, capture_output=True, text=True, cwd=tmp_path, check=False)  # fmt: skip


@pytest.mark.parametrize("total", [2, 3, 9])
def test_shards_run_every_test_once(tmp_path: Path, total: int) -> None:
    suite = _suite(tmp_path)
    for index in range(total):
        done = _run(tmp_path, suite, index, total)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (tmp_path / f"status{index}").exists()  # sharding declared to Bazel
    ran = (tmp_path / "ran").read_text().split()
    assert sorted(ran) == sorted(NAMES)


def test_shards_of_a_k_selection(tmp_path: Path) -> None:
    """-k first, then the shards split what it kept."""
    suite = _suite(tmp_path)
    for index in range(2):
        done = _run(tmp_path, suite, index, 2, "-k", "case_1 or case_4 or case_6")
        assert done.returncode == 0, done.stdout + done.stderr
    assert sorted((tmp_path / "ran").read_text().split()) == ["test_case_1", "test_case_4", "test_case_6"]


def test_a_failure_in_a_shard_fails_it(tmp_path: Path) -> None:
    suite = tmp_path / "test_fail.py"
    suite.write_text("def test_a():\n    pass\n\ndef test_b():\n    assert False\n")
    codes = [_run(tmp_path, suite, index, 2).returncode for index in range(2)]
    assert codes == [0, 1]
