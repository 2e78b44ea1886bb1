"""Runs each fuzz target of fuzz_amx_model.py in a child process.

A crash of the AMX drivers on the tile model fails the matching test here
with the seed and the input that was running (``tools/fuzzing.py:
run_child``) instead of killing the test runner.
"""

from __future__ import annotations

from pathlib import Path

import fuzzing
import pytest

TARGETS = Path(__file__).with_name("fuzz_amx_model.py")


@pytest.mark.parametrize("name", fuzzing.target_names(TARGETS))
def test_fuzz_target_in_child(name: str) -> None:
    """The fuzz target ``name`` passes at the configured budget, and its
    process neither crashes nor aborts."""
    fuzzing.run_child(TARGETS, name)
