"""Entry point of lint test targets: `ruff check` over the given files."""

from __future__ import annotations

import subprocess
import sys


def main() -> int:
    config, *files = sys.argv[1:]
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", config, *files]
    code = subprocess.call(cmd)
    if code == 0:
        print(f"lint: {len(files)} files clean")
    return code


if __name__ == "__main__":
    sys.exit(main())
