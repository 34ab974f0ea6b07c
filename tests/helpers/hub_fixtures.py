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


def point_hub_at(stand_in: StandInHub, tmp_path: Path, monkeypatch) -> Path:
    """In-process: huggingface_hub (and so localdiff) talks to ``stand_in``, with no token, online, its cache a fresh
    folder under ``tmp_path``; returns that cache folder."""
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
    return hub_dir


@pytest.fixture
def cache(tmp_path, stand_in, monkeypatch):
    """:func:`point_hub_at` the stand-in, on a fixed machine for the fit check (64 GiB RAM, no GPU)."""
    hub_dir = point_hub_at(stand_in, tmp_path, monkeypatch)
    import localdiff.hub.fit as machine  # the fit check sees a fixed machine, not this one

    monkeypatch.setattr(machine, "ram_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(machine, "gpu_mem_bytes", lambda: 0)
    return hub_dir


def blob_of(cache: Path, repo: str, data: bytes, lfs: bool) -> Path:
    name = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
    return cache / ("models--" + repo.replace("/", "--")) / "blobs" / name
