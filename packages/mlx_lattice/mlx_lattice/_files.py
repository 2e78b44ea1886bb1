"""Writing a file whole or not at all: a temporary file next to the target,
renamed onto it once written (a reader never sees half a file, and a failed
write keeps the old one)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replacing"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def replacing(out: Path, suffix: str = "") -> Iterator[str]:
    """A temporary path in ``out``'s folder (ending in ``suffix``) for the
    block to write; renamed onto ``out`` with a plain file's mode when the
    block ends without an error, removed in any case otherwise. The file is
    a new one, never ``out`` truncated in place. Raises ``OSError`` when
    the folder takes no new file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp made it private
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
