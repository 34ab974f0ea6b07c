"""LLaDA2.x MoE (``llada2_moe``): the router against a transcription of the Hub gate and transformers' own
group-limited router, the whole model's logits against transformers' Glm4MoeForCausalLM (same layer math) under a
block-causal 4D mask, cached = uncached through the block KV cache, and a tiny Hub-layout checkpoint loading."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from block_ref import block_mask as block_causal_4d
from llada2_ref import TINY, build, glm4_reference, upstream_gate, write_checkpoint
from localdiff.arch.llada2_spec import parameter_counts, parse_config
from localdiff.arch.moe import sigmoid_group_route
from localdiff.cache.kv import KVCache
from localdiff.errors import CheckpointError
from localdiff.loader import load_model


@pytest.mark.parametrize("e,k,groups,keep", [(12, 3, 4, 2), (16, 1, 4, 1), (9, 4, 1, 1), (10, 2, 5, 5)])
def test_router_matches_the_hub_gate(e, k, groups, keep):
    g = torch.Generator().manual_seed(e * 10 + k)
    x, w = torch.randn(37, 24, generator=g), torch.randn(e, 24, generator=g)
    bias = 0.4 * torch.randn(e, generator=g)
    idx_ref, w_ref = upstream_gate(x, w, bias, k, groups, keep, 2.5)
    ours_w, ours_idx = sigmoid_group_route(torch.nn.functional.linear(x, w), bias, k, groups, keep, 2.5)
    assert torch.equal(ours_idx, idx_ref)
    torch.testing.assert_close(ours_w, w_ref, rtol=0, atol=1e-6)
    # the bias steers the choice but never the weights: without it some picks differ
    plain_idx, _ = upstream_gate(x, w, torch.zeros(e), k, groups, keep, 2.5)
    if k < e:
        assert not torch.equal(plain_idx, idx_ref)


def test_router_matches_transformers_group_limited_router():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(
        hidden_size=24,
        n_routed_experts=12,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    r = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        r.weight.copy_(torch.randn(12, 24, generator=g))
        r.e_score_correction_bias.copy_(0.4 * torch.randn(12, generator=g))
    x = torch.randn(29, 24, generator=g)
    _, w_ref, idx_ref = r(x)
    w, idx = sigmoid_group_route(torch.nn.functional.linear(x, r.weight), r.e_score_correction_bias, 3, 4, 2, 2.5)
    order_ref, order = idx_ref.argsort(-1), idx.argsort(-1)  # transformers' top-k is unsorted
    assert torch.equal(idx.gather(1, order), idx_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_bias", [False, True])
def test_logits_match_transformers_under_a_block_causal_mask(use_bias):
    raw = dict(TINY, use_bias=use_bias)
    net, ref = build(raw), glm4_reference(raw)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=block_causal_4d(11, 4, b=2)).logits.float()
    got = net.logits_full(ids)
    assert (got - want).abs().max().item() < 1e-4
    # the mask matters: a different block length changes the logits
    assert (build(dict(raw, block_size=3)).logits_full(ids) - want).abs().max().item() > 1e-3


def test_logits_with_left_padding_match_transformers():
    net, ref = build(), glm4_reference(TINY)
    ids = torch.randint(0, 94, (2, 9), generator=torch.Generator().manual_seed(6))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=block_causal_4d(9, 4, keep, b=2)).logits.float()
    got = net.logits_full(ids, keep)
    assert (got - want)[keep].abs().max().item() < 1e-4


@pytest.mark.parametrize("budget", [None, 0, 2000])
def test_cached_blocks_equal_the_uncached_pass(budget):
    """Prompt of 10 tokens, blocks of 4: blocks 0-1 are prefilled (fused with the first step); the prompt's tail
    (2 tokens) and 2 masks form the first canvas; then that block is prefilled and the next canvas denoised."""
    net = build()
    ids = torch.randint(0, 96, (1, 18), generator=torch.Generator().manual_seed(7))
    full = net.logits_full(ids)
    cache = KVCache(**net.cache_layout(), device_budget_bytes=budget)
    first = net.denoise(ids[:, 8:12], cache, prefill_ids=ids[:, :8])
    assert cache.seq_len == 8
    torch.testing.assert_close(first, full[:, 8:12], rtol=0, atol=1e-5)
    again = net.denoise(ids[:, 8:12], cache)  # a later step: the cache is only read
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)
    second = net.denoise(ids[:, 12:16], cache, prefill_ids=ids[:, 8:12])
    torch.testing.assert_close(second, full[:, 12:16], rtol=0, atol=1e-5)
    net.prefill(ids[:, 12:16], cache)
    third = net.denoise(ids[:, 16:18], cache)
    torch.testing.assert_close(third, full[:, 16:18], rtol=0, atol=1e-5)
    assert cache.token_ids[0] == ids[0, :16].tolist()


def test_hub_layout_checkpoint_loads(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    loaded, cfg = load_model(ckpt, dtype=torch.float32)
    assert cfg.mask_token_id == 96 and cfg.block_size == 4 and cfg.moe_layers == (False, True, True)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(8))
    assert torch.equal(loaded.logits_full(ids), build().logits_full(ids))


def test_unsupported_router_is_a_one_line_error(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text(__import__("json").dumps(dict(TINY, score_function="softmax")))
    with pytest.raises(CheckpointError, match="score_function"):
        load_model(ckpt)
    with pytest.raises(ValueError, match="n_group"):
        parse_config(dict(TINY, n_group=5))


def test_real_mini_config_counts():
    """LLaDA2.0-mini's config.json (as published): 16B total, ~1.4B active parameters per token."""
    mini = dict(
        model_type="llada2_moe",
        vocab_size=157184,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        num_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        rope_theta=600000,
        use_qk_norm=True,
        use_qkv_bias=False,
        use_bias=False,
        score_function="sigmoid",
        max_position_embeddings=32768,
        pad_token_id=156892,
        tie_word_embeddings=False,
    )
    c = parse_config(mini)
    assert c.mask_token_id == 156895 and c.eos_token_id == (156892,) and sum(c.moe_layers) == 19
    assert dataclasses.asdict(c)["rope_parameters"]["partial_rotary_factor"] == 0.5
    counts = parameter_counts(mini)
    assert 16.0e9 < counts["total"] < 16.5e9, counts["total"]
    assert 1.3e9 < counts["active_per_token"] < 1.5e9, counts["active_per_token"]
