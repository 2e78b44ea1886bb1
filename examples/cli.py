"""Command lines of the example and benchmark programs, on ``absl.app`` and
``absl.flags``.

Each program defines its flags at the top of its own module
(``_STEPS = flags.DEFINE_integer("steps", ...)``), reads them where it uses
them (``_STEPS.value``) and ends with ``cli.run(main)``. On the command line
that gives absl's ``--help``/``--helpfull`` and ``--flagfile=FILE`` (one
flag per line). ``main(argv)`` also takes the flags as a list, for tests and
callers in the same process::

    demo.main(["--quick", "--out-dir", "pictures"])  # every other flag at its default

absl keeps every flag of a process in one registry (``flags.FLAGS``), so
modules that several programs import (``pictures``, ``sparse_unet``,
``benchmarks.timing``) define no flags, and no process imports two programs
that define a flag of the same name (``--seed``, ``--steps``, ...):
``//benchmarks:distributed`` starts ``train_distributed`` as a child
process rather than importing it.

A flag that does not parse or fails its check (``lower_bound``, a
validator) prints the error and exits with status 2, as the programs'
earlier argparse command lines did; so do positional arguments, which no
program takes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import app, flags

__all__ = ["parse", "parsed", "run"]

FLAGS = flags.FLAGS


def parse(argv: Sequence[str], *, program: str | None = None) -> None:
    """Parse the flags ``argv`` (without the program name) into ``flags.FLAGS``,
    every flag starting again from its default (so one process can parse
    several command lines in turn).

    A bad flag or a positional argument prints the error on stderr and
    raises ``SystemExit(2)``.

    >>> from absl import flags
    >>> flags.FLAGS(["prog"])  # flags of this module: absl's own
    ['prog']
    >>> parse(["--verbosity=1"]); flags.FLAGS.verbosity
    1
    >>> parse([]); flags.FLAGS.verbosity
    -1
    """
    app.define_help_flags()  # --help, --helpfull, ... also when main(argv) parses
    program = program or sys.argv[0]
    FLAGS.unparse_flags()
    try:
        rest = FLAGS([program, *argv])
    except flags.Error as error:
        print(f"{program}: error: {error}\nPass --helpfull to see help on flags.", file=sys.stderr)
        raise SystemExit(2) from None
    if len(rest) > 1:
        print(f"{program}: error: unexpected arguments {rest[1:]} (flags only)", file=sys.stderr)
        raise SystemExit(2)


def parsed(argv: Sequence[str] | None) -> None:
    """The flags of ``main(argv)``: ``argv`` if given, else the command line
    (``sys.argv``) unless ``app.run`` has parsed it already."""
    if argv is not None:
        parse(argv)
    elif not FLAGS.is_parsed():
        parse(sys.argv[1:])


def run(main: Callable[[Sequence[str] | None], int | None]) -> NoReturn:
    """Run ``main(None)`` under ``absl.app.run``: absl's help and flag-file
    flags and logging set-up, the exit status from ``main``'s return value.

    Logging stays at warnings unless ``--verbosity`` says otherwise
    (``app.run`` alone would show every library's info messages, such as
    JAX's search for accelerators).
    """

    def parse_command_line(argv: list[str]) -> list[str]:
        parse(argv[1:], program=argv[0])
        if FLAGS["verbosity"].using_default_value:
            FLAGS.verbosity = -1  # absl's WARNING
        return argv[:1]

    app.run(lambda _: main(None), flags_parser=parse_command_line)
