"""LeakSanitizer's check, run while the interpreter is still whole.

Under ``--config=asan`` (docs/topics/sanitizers.rst) ``tools/pytest_main.py``
puts this directory first on ``PYTHONPATH``, so every Python process of a
test (pytest itself and the children it starts) imports it at start-up.

LeakSanitizer's own check runs after the interpreter has finalized: by then
CPython has torn down module dicts and interpreter state while objects they
held (constants of test modules, cached strings, extension modules' static
objects) are still allocated, so they look lost although nothing lost them.
Instead the check runs first thing at exit (the first ``atexit`` handler
registered, so the last to run), after a garbage collection: everything still
referenced from live Python state is reachable, and what is reported was
really lost (memory our extension or MLX allocated and dropped, or a Python
object whose reference count was raised and never lowered). A leak ends the
process with LeakSanitizer's report and its non-zero exit status; the
runtime then skips its own check at exit.

Without a LeakSanitizer runtime (ThreadSanitizer, or no sanitizer) this does
nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import gc


def _leak_check() -> None:
    gc.collect()
    check()


try:
    check = ctypes.CDLL(None).__lsan_do_leak_check
except AttributeError:
    pass
else:
    check.restype = None
    atexit.register(_leak_check)
