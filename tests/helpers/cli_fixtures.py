"""The CLI and server tests' isolation from the user's settings: no LOCALDIFF_* variables, an empty config file
under tmp_path named by LOCALDIFF_CONFIG (a missing named file is an error) and, for ``isolated``, an offline Hub whose
cache is under tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def clear_user_settings(tmp_path: Path, monkeypatch, name: str = "config.toml") -> Path:
    """Remove every LOCALDIFF_* variable and name an empty config file ``tmp_path / name``; returns ``tmp_path``."""
    for k in [k for k in os.environ if k.startswith("LOCALDIFF_")]:
        monkeypatch.delenv(k)
    (tmp_path / name).touch()
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / name))
    return tmp_path


@pytest.fixture
def isolated_config(tmp_path, monkeypatch):
    """No user settings (:func:`clear_user_settings`)."""
    return clear_user_settings(tmp_path, monkeypatch)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No user settings, and the Hub offline with its cache under ``tmp_path / "hub"``."""
    clear_user_settings(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path
