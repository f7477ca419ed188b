"""The one exit-status rule of every `lorafast` subcommand, and the one way a subcommand reports a usage error.

- `OK` (0): all fine;
- `FAILED` (1): something failed or does not serve: an adapter that failed or has a problem, a check that
  fails, an engine that would refuse, a file that cannot be read (a `LorafastError` or an `OSError`);
- `USAGE` (2): a usage error: argparse's, a flag or a combination of flags that is refused (`--index` with
  `--backend ray`, `--convert` without `--out`, a malformed `--adapter` spec), an engine version refused by
  `--strict-version`.
"""

from __future__ import annotations

import argparse
import sys
from enum import IntEnum
from typing import NoReturn


class ExitStatus(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2

    @classmethod
    def failed_if(cls, failed: object) -> ExitStatus:
        """`FAILED` when `failed` is true, else `OK`."""
        return cls.FAILED if failed else cls.OK


def usage_error(command: str, message: str) -> ExitStatus:
    """`lorafast COMMAND: error: MESSAGE` on stderr; `USAGE`."""
    print(f"lorafast {command}: error: {message}", file=sys.stderr)
    return ExitStatus.USAGE


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (no usage dump): `lorafast scan: error: ...`, exit status 2. Its
    subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitStatus.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
