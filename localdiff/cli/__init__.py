"""Command line: argument parsing and dispatch (``localdiff`` console script → :func:`localdiff.cli`)."""

from localdiff.cli.dispatch import main  # noqa: E402,F401  (the console script's entry point)
