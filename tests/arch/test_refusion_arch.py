"""ReFusion's model (localdiff.arch.refusion) against transformers' own Qwen3ForCausalLM on a tiny odd-sized config
in the upstream checkpoint layout: full causal logits, and the slot pass (tokens cached in generation order, RoPE at
true positions) against transformers fed the same order with explicit position_ids."""

from __future__ import annotations

import torch

from localdiff.arch import entry_for
from localdiff.loader import load_model
from refusion_ckpt import MASK, build_hf, save_upstream


def _load(tmp_path, seed=0):
    hf = build_hf(seed)
    save_upstream(hf, tmp_path)
    net, cfg = load_model(tmp_path, dtype=torch.float32)
    return hf, net, cfg


def test_qwen3_config_with_mask_token_routes_to_refusion(tmp_path):
    hf, net, cfg = _load(tmp_path)
    assert entry_for({"model_type": "qwen3", "mask_token_id": 5}).family == "slots"
    assert cfg.model_type == "refusion" and cfg.mask_token_id == MASK and type(net).__name__ == "RefusionLM"


def test_logits_match_transformers(tmp_path):
    hf, net, _ = _load(tmp_path)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(net.logits_full(ids), ref, rtol=0, atol=1e-4)


def test_slot_pass_matches_transformers_with_position_ids(tmp_path):
    """Prompt, then slots fed out of position order over the cache: same logits as transformers' causal mask over
    cache order with explicit position_ids (ReFusion's modelling)."""
    hf, net, _ = _load(tmp_path)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (1, 17), generator=g)
    pos = torch.cat([torch.arange(5), torch.tensor([13, 14, 15, 16, 5, 6, 7, 8, 9, 10, 11, 12])])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos[None]).logits
    cache = net.new_slot_cache(32)
    vis = torch.ones(9, 9, dtype=torch.bool).tril()
    first = net.slot_pass(ids[:, :9], pos[:9], cache, torch.arange(9), vis)
    cache.commit(ids[0, :9].tolist(), pos[:9].tolist())
    vis2 = torch.cat([torch.ones(8, 9, dtype=torch.bool), torch.ones(8, 8, dtype=torch.bool).tril()], 1)
    second = net.slot_pass(ids[:, 9:], pos[9:], cache, torch.arange(9, 17), vis2)
    torch.testing.assert_close(torch.cat([first, second], 1), ref, rtol=0, atol=1e-4)
