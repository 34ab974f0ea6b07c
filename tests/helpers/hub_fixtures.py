"""Fixtures of the Hub tests: a stand-in Hub with a few repos and huggingface_hub's cache pointed at tmp_path
(in-process), and where a file's blob lands in that cache."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hub_stand_in import StandInHub, git_blob_sha1, tiny_checkpoint_files

REPO = "acme/tiny-diff"
WEIGHTS = "model.safetensors"


@pytest.fixture
def stand_in():
    with StandInHub() as h:
        h.add_repo(REPO, tiny_checkpoint_files())
        h.add_repo("acme/gated", tiny_checkpoint_files(seed=1), gated=True)
        h.add_repo("acme/pickles", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04x"})
        h.add_as_catalog("google/diffusiongemma-26B-A4B-it", tiny_checkpoint_files(seed=2))
        yield h


@pytest.fixture
def cache(tmp_path, stand_in, monkeypatch):
    """In-process: point huggingface_hub and localdiff at the stand-in and a fresh cache under tmp_path."""
    from huggingface_hub import constants

    hub_dir = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import localdiff.hub.fit as machine                        # the fit check sees a fixed machine, not this one

    monkeypatch.setattr(machine, "ram_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(machine, "gpu_mem_bytes", lambda: 0)
    return hub_dir


def blob_of(cache: Path, repo: str, data: bytes, lfs: bool) -> Path:
    name = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
    return cache / ("models--" + repo.replace("/", "--")) / "blobs" / name
