"""The CLI tests' isolation: no LOCALDIFF_* variables, an empty config file and the Hub cache under tmp_path,
offline."""
from __future__ import annotations

import os

import pytest


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("LOCALDIFF_"):
            monkeypatch.delenv(k)
    (tmp_path / "config.toml").touch()   # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path
