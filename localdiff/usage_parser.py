"""One argparse parser for every localdiff command line (``localdiff …`` and ``localdiff bench``)."""

from __future__ import annotations

import argparse
import sys

from localdiff.errors import UsageError


class UsageParser(argparse.ArgumentParser):
    """argparse with one-line errors raised as UsageError (exit 2) instead of usage dumps, and --help / usage text
    whose write errors reach the caller.

    Raises:
        UsageError: ``"<prog>: <message> (see `<prog> --help`)"`` for any parse error.
    """

    def error(self, message: str):  # noqa: D401 — argparse API
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def _print_message(self, message, file=None):  # argparse API: --help / usage text
        """Write and flush, letting OSError through: argparse swallows it, so ``--help >/dev/full`` exited 0."""
        if message:
            file = file or sys.stderr
            file.write(message)
            file.flush()
