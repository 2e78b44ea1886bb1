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
import sys
import threading

# Locals of the Python frames other threads are running at exit (daemon
# threads, e.g. a deadline watchdog blocked in Condition.wait). CPython 3.11
# keeps running frames on a frame stack it maps itself, memory LeakSanitizer
# does not scan, so objects only those frames reference would look lost.
# Held from this list (heap memory, reachable from the module), with the
# frame objects that reach them, they do not.
_HELD: list[object] = []


def _hold_running_frames() -> None:
    """Everything the other threads' running frames reference, into _HELD
    (nothing is left referenced only from this function's own frame)."""
    frames = sys._current_frames()
    _HELD.append(frames)
    _HELD.append(threading.get_ident())
    for thread_id, top in frames.items():
        frame = top if thread_id != _HELD[1] else None
        while frame is not None:
            _HELD.append(frame)
            _HELD.append(frame.f_locals)
            frame = frame.f_back


def _leak_check() -> None:
    _hold_running_frames()
    gc.collect()
    check()


try:
    check = ctypes.CDLL(None).__lsan_do_leak_check
except AttributeError:
    pass
else:
    check.restype = None
    atexit.register(_leak_check)
