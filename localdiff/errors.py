"""Exception types. Every error a user can cause is a ``LocaldiffError``: the CLI prints its message on one line
and exits with its ``exit_code`` (1 runtime, 2 usage)."""

from __future__ import annotations


class LocaldiffError(Exception):
    """Base class for errors with a clear one-line message meant for the user."""

    exit_code = 1


class UsageError(LocaldiffError):
    """Bad flags or arguments (exit code 2)."""

    exit_code = 2


class CheckpointError(LocaldiffError):
    """A checkpoint folder is missing files, has inconsistent tensors, or an unknown ``model_type``."""


class ModelNotFoundError(LocaldiffError):
    """A model name is neither a catalog alias, a pulled repo, nor a checkpoint path."""


class TokenizerMissingError(LocaldiffError):
    """A text call on a checkpoint that ships no tokenizer files."""


class HubError(LocaldiffError):
    """Download / Hub failures (gated, not found, offline, disk full)."""
