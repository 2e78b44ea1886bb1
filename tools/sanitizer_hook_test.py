"""The leak check of ``tools/sanitizers/site/sitecustomize.py`` under
``--config=asan`` (docs/topics/sanitizers.rst): a Python process whose
object leaked fails with LeakSanitizer's report. (That objects only a
daemon thread's running frame references are not reported is what
``unit_tests`` and ``distributed_tests`` show under ASan: their deadline
watchdog's locals looked lost before.) Run by
``tools/sanitizers.sh`` (``./bazelw test --config=asan
//tools:sanitizer_hook_test``); tagged manual, since without the sanitizer
runtime there is nothing to check.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# A 4 KiB bytes object made through the C API and returned as a bare
# address (a Python int keeps no pointer to it): a reference nobody gives back.
LEAKED = """
import ctypes
new = ctypes.pythonapi.PyBytes_FromStringAndSize
new.restype = ctypes.c_void_p
new.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
new(None, 4096)
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(autouse=True)
def _needs_leak_sanitizer() -> None:
    try:
        ctypes.CDLL(None).__lsan_do_leak_check  # noqa: B018 - the lookup is the check
    except AttributeError:
        pytest.fail("no LeakSanitizer runtime in this process: run with --config=asan")


def test_a_leaked_object_fails_the_process_with_a_report() -> None:
    run = _run(LEAKED)
    assert run.returncode != 0, run.stderr
    assert "ERROR: LeakSanitizer: detected memory leaks" in run.stderr
    assert "PyBytes_FromStringAndSize" in run.stderr, run.stderr[-2000:]

