"""Shared settings of the fuzz targets (Hypothesis): budget, seed, replay.

Each fuzz test is decorated with :func:`fuzz`, which applies ``given`` with
the test's strategies, a fixed seed and the budget:

* ``QUANTLATTICE_FUZZ_EXAMPLES=<n>``: examples per test (default: the test's
  own CI budget, small enough for a 2-core CI machine);
* ``QUANTLATTICE_FUZZ_SEED=<n>``: the seed (default: a stable hash of the
  test function's name, so CI runs the same examples every time). A failing test
  names its seed; the same seed replays the same examples.

Hypothesis' example database is off (nothing is written next to the tests),
and there is no deadline (the first example of a JAX op pays its compile).
When ``QUANTLATTICE_FUZZ_TRACE=<file>`` is set, each example's input is
written there before it runs, so a parent process can name the input that
crashed a child (see :func:`run_child`).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings

__all__ = ["examples", "fuzz", "fuzz_seed", "run_child", "target_names"]

EXAMPLES_ENV = "QUANTLATTICE_FUZZ_EXAMPLES"
SEED_ENV = "QUANTLATTICE_FUZZ_SEED"
TRACE_ENV = "QUANTLATTICE_FUZZ_TRACE"


def examples(ci_budget: int) -> int:
    """The number of examples to run: the env override or ``ci_budget``."""
    chosen = os.environ.get(EXAMPLES_ENV, "")
    return int(chosen) if chosen else ci_budget


def fuzz_seed(name: str) -> int:
    """The seed of test ``name``: the env override or a stable hash."""
    chosen = os.environ.get(SEED_ENV, "")
    return int(chosen) if chosen else zlib.crc32(name.encode())


def fuzz(ci_budget: int, **strategies: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``given(**strategies)`` with the seed and budget above.

    A failure carries a note naming the seed and the command-line variable
    that replays it.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        value = fuzz_seed(fn.__qualname__)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            trace = os.environ.get(TRACE_ENV)
            if trace:
                with open(trace, "w") as f:
                    f.write(f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})\n")
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                note = f"fuzz seed {value}: replay with {SEED_ENV}={value}"
                if note not in getattr(e, "__notes__", ()):
                    e.add_note(note)
                raise

        test = given(**strategies)(traced)
        test = settings(
            max_examples=examples(ci_budget),
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.function_scoped_fixture,
            ],
        )(test)
        return seed(value)(test)

    return decorate


def _child_timeout(default: float) -> float:
    """Seconds a child may run: ``default``, but never past the test's own
    Bazel timeout (``TEST_TIMEOUT``, less a margin to report), so a hung
    child is stopped and described before Bazel kills the whole test."""
    budget = os.environ.get("TEST_TIMEOUT", "")
    if not budget.isdigit():
        return default
    left = int(budget) - 30 - (time.monotonic() - _STARTED)
    return max(min(default, left), 10.0)


_STARTED = time.monotonic()


def target_names(test_file: Path) -> list[str]:
    r"""The fuzz tests of ``test_file`` (its top-level ``def test_...``), sorted:
    what a runner parametrizes :func:`run_child` over.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = Path(d) / "fuzz_x.py"
    ...     _ = path.write_text("def test_b(x):\n    pass\ndef test_a(y):\n    pass\n")
    ...     target_names(path)
    ['test_a', 'test_b']
    """
    return sorted(
        line.split("(")[0].removeprefix("def ")
        for line in test_file.read_text().splitlines()
        if line.startswith("def test_")
    )


def run_child(test_file: Path, test_name: str, *, timeout: float = 600) -> None:
    """Runs one fuzz test of ``test_file`` in a child pytest.

    A crash of the child (a signal: segfault, abort), a hang (no result within
    ``timeout`` seconds, or the test's Bazel timeout) or any failure is
    reported as an ``AssertionError`` naming the seed, the input that was
    running (from the trace file) and the child's output; for a hang, the
    Python stack of every thread of the child (``faulthandler``, on SIGABRT).
    """
    trace = Path(os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()) / f"fuzz_trace_{test_name}.txt"
    trace.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONFAULTHANDLER="1")
    env[TRACE_ENV] = str(trace)
    for key in ("XML_OUTPUT_FILE", "TEST_SHARD_STATUS_FILE"):
        env.pop(key, None)
    main = sys.modules["__main__"].__file__
    cmd = [sys.executable, main, "-q", "-x", "--hypothesis-show-statistics",
           f"{test_file}::{test_name}"]
    limit = _child_timeout(timeout)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=limit)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
    if proc.returncode == 0 and not hung:
        print(stdout[-2000:])  # Hypothesis' statistics (shown with pytest -rP)
        return
    last = trace.read_text() if trace.exists() else "(none recorded)"
    if hung:
        how = f"hung (no result within {limit:.0f} s; stopped with SIGABRT)"
    elif proc.returncode < 0:
        how = f"was killed by signal {-proc.returncode}"
    else:
        how = "failed"
    # faulthandler writes the innermost frames first: keep the head too.
    err = stderr if len(stderr) <= 12000 else f"{stderr[:8000]}\n[...]\n{stderr[-4000:]}"
    raise AssertionError(
        f"fuzz child {test_name} {how}; last input: {last.strip()}\n"
        f"replay: {SEED_ENV}={fuzz_seed(test_name)}\n"
        f"--- child output ---\n{stdout[-6000:]}\n{err}"
    )
