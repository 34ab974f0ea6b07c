"""Block-diffusion architectures (SDAR, SDAR-MoE, Fast-dLLM v2, Tiny-A2D BD3LM): logits equal transformers' Qwen3 /
Qwen3-MoE / Qwen2 under a block-causal 4D mask (1e-4, fp32) after loading a checkpoint written in each UPSTREAM
layout; the cached roles (prefill, denoise, the fused pass) equal the uncached pass; one-line config errors."""

from __future__ import annotations

import json

import pytest
import torch

from block_ref import LAYOUTS, VOCAB, ref_logits, upstream_config, write_upstream
from localdiff.cache.kv import KVCache
from localdiff.errors import CheckpointError
from localdiff.loader import load_config, load_model


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace("_", "-"))
    ref = write_upstream(request.param, folder)
    ours, cfg = load_model(folder, dtype=torch.float32)
    return request.param, ref, ours


def _ids(b=2, t=13, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_the_transformers_reference_under_a_block_causal_mask(pair):
    layout, ref, ours = pair
    block = LAYOUTS[layout][1]
    assert ours.config.block_size == block and ours.config.canvas_length == block
    ids = _ids()
    want = ref_logits(ref, ids, block)
    got = ours.logits_full(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # causal across blocks, bidirectional inside: the last token changes its own block's first row, not earlier
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % VOCAB
    got2 = ours.logits_full(ids2)
    last_block = (13 - 1) // block * block
    assert not torch.allclose(got2[:, last_block], want[:, last_block])
    torch.testing.assert_close(got2[:, :last_block], got[:, :last_block], rtol=0, atol=1e-6)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :3] = False
    torch.testing.assert_close(ours.logits_full(ids, keep), ref_logits(ref, ids, block, keep), rtol=0, atol=1e-4)


@pytest.mark.parametrize("budget", [None, 0, 2000])
def test_cached_roles_equal_the_uncached_pass(pair, budget):
    """prompt whole blocks via prefill, then each block by denoise (fused with the previous block's prefill):
    every block's logits equal logits_full's rows, with the device budget unlimited, 0 (all on the host) or
    partial."""
    layout, _, ours = pair
    blk = ours.config.block_size
    ids = _ids(t=4 * blk)
    want = ours.logits_full(ids)
    cache = KVCache(**ours.cache_layout(), device_budget_bytes=budget)
    ours.prefill(ids[:, :blk], cache)
    assert cache.seq_len == blk
    got = [ours.denoise(ids[:, blk : 2 * blk], cache)]
    for k in (2, 3):
        got.append(ours.denoise(ids[:, k * blk : (k + 1) * blk], cache, prefill_ids=ids[:, (k - 1) * blk : k * blk]))
    assert cache.seq_len == 3 * blk and cache.token_ids[0] == ids[0, : 3 * blk].tolist()
    torch.testing.assert_close(torch.cat(got, 1), want[:, blk:], rtol=0, atol=2e-5)
    # fused == prefill then denoise (not bit for bit: a linear over n + c rows may round differently from one over
    # c rows on this CPU's GEMM; ~1e-7 in practice)
    c2 = KVCache(**ours.cache_layout(), device_budget_bytes=budget)
    ours.prefill(ids[:, :blk], c2)
    ours.prefill(ids[:, blk : 2 * blk], c2)
    sep = ours.denoise(ids[:, 2 * blk : 3 * blk], c2)
    torch.testing.assert_close(sep, got[1], rtol=0, atol=1e-5)


def test_padding_in_the_cache_is_never_attended(pair):
    _, _, ours = pair
    blk = ours.config.block_size
    ids = _ids(t=3 * blk)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, : blk + 1] = False
    cache = KVCache(**ours.cache_layout())
    ours.prefill(ids[:, : 2 * blk], cache, keep[:, : 2 * blk])
    got = ours.denoise(ids[:, 2 * blk :], cache)
    torch.testing.assert_close(got, ours.logits_full(ids, keep)[:, 2 * blk :], rtol=0, atol=2e-5)
    junk = ids.clone()
    junk[0, : blk + 1] = 5
    cache.reset()
    ours.prefill(junk[:, : 2 * blk], cache, keep[:, : 2 * blk])
    torch.testing.assert_close(ours.denoise(ids[:, 2 * blk :], cache), got, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "layout,change,field",
    [
        ("sdar", {"mask_token_id": None}, "mask_token_id"),
        ("sdar", {"pad_token_id": 126}, "mask_token_id"),
        ("sdar", {"hidden_size": None}, "hidden_size"),
        ("sdar", {"rope_theta": None}, "rope_theta"),
        ("sdar_moe", {"num_experts": None}, "num_experts"),
        ("Fast_dLLM_Qwen", {"bd_size": 0}, "bd_size"),
        ("sdar", {"mask_token_id": 500}, "mask_token_id"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(tmp_path, layout, change, field):
    cfg = upstream_config(layout)
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_bd3lm_is_told_apart_from_the_masked_a2d_model_by_its_block_size():
    from localdiff.arch import entry_for

    cfg = upstream_config("a2d-qwen3-bd3lm")
    assert entry_for(cfg).family == "block"
    assert entry_for({k: v for k, v in cfg.items() if k != "block_size"}).family == "masked"
