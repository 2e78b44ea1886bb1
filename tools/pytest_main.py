"""Entry point of every pytest test target: runs pytest, reports JUnit XML.

Bazel passes the XML path in XML_OUTPUT_FILE; pytest writes it, so Bazel
sees each test case. The closing `N passed` line goes to the test log.
"""

from __future__ import annotations

import os
import sys

import pytest


def main() -> int:
    args = ["-p", "no:cacheprovider", "--import-mode=importlib", "-ra"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    # Bazel's test sharding protocol is not implemented; declare it unsupported.
    if "TEST_SHARD_STATUS_FILE" in os.environ:
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()
    code = pytest.main(args + sys.argv[1:])
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
