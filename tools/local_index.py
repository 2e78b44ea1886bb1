"""A real package index on 127.0.0.1 for tests: pypiserver from the locked environment.

    with local_index(tmp / "packages") as url:  # http://127.0.0.1:PORT/
        subprocess.run([... "twine", "upload", "--repository-url", url, ...])
        ... pip install --index-url url + "simple/" ...

Uploads need no password (`-a . -P .`), unknown projects are 404 rather than
redirected elsewhere (`--disable-fallback`), and the server is stopped on
exit, killed if it does not stop within a few seconds.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

__all__ = ["LocalIndexError", "free_port", "local_index"]

HOST = "127.0.0.1"


class LocalIndexError(RuntimeError):
    """The local index did not start (its log is in the message)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "health", timeout=2) as response:  # noqa: S310 (http://127.0.0.1)
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def local_index(package_dir: pathlib.Path, start_timeout: float = 30.0) -> Iterator[str]:
    """Runs pypiserver over `package_dir` on 127.0.0.1; yields its base URL."""
    package_dir.mkdir(parents=True, exist_ok=True)
    log_path = package_dir.parent / f"{package_dir.name}-pypiserver.log"
    for _attempt in range(3):  # another process may take the free port first
        port = free_port()
        url = f"http://{HOST}:{port}/"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pypiserver",
                    "run",
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "-a",
                    ".",
                    "-P",
                    ".",
                    "--disable-fallback",
                    "--server",
                    "wsgiref",
                    str(package_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + start_timeout
        while proc.poll() is None and time.monotonic() < deadline and not _ready(url):
            time.sleep(0.2)
        if proc.poll() is None and _ready(url):
            break
        _stop(proc)
    else:
        raise LocalIndexError(f"pypiserver did not start on {HOST}:\n{log_path.read_text()}")
    try:
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
