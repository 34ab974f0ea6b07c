"""Masked-diffusion architectures (LLaDA, LLaDA-MoE, Dream / DiffuCoder, A2D-Qwen3): logits equal transformers'
Llama / Qwen3-MoE / Qwen2 / Qwen3 under a bidirectional 4D mask (1e-4, fp32) after loading a checkpoint written in
each UPSTREAM layout with the loader; forward_window (Fast-dLLM prefix / dual cache) equals the full pass; padding;
one-line errors naming the field; ``localdiff show`` on each."""

from __future__ import annotations

import json

import pytest
import torch

from masked_ref import EOS, MASK, VOCAB, ref_logits, upstream_config, write_upstream
from localdiff.arch import get_arch
from localdiff.errors import CheckpointError
from localdiff.loader import load_config, load_model

FAMILIES = ["llada", "lladamoe", "dream", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, reference model, our model loaded from the upstream layout)."""
    folder = tmp_path_factory.mktemp(request.param)
    ref = write_upstream(request.param, folder)
    ours, cfg = load_model(folder, dtype=torch.float32)
    return request.param, ref, ours, folder


def _ids(b=2, t=13, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_the_transformers_reference_under_a_bidirectional_mask(pair):
    family, ref, ours, _ = pair
    ids = _ids()
    want = ref_logits(ref, ids)
    got = ours.logits_full(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 13, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # the mask really is bidirectional: changing the LAST token changes the FIRST row, in both
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % VOCAB
    assert not torch.allclose(ref_logits(ref, ids2)[:, 0], want[:, 0])
    torch.testing.assert_close(ours.logits_full(ids2), ref_logits(ref, ids2), rtol=0, atol=1e-4)


def test_padding_keys_are_never_attended(pair):
    family, ref, ours, _ = pair
    ids = _ids()
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :4] = False  # left padding in row 0
    keep[1, -3:] = False  # right padding in row 1
    got = ours.logits_full(ids, keep.long())
    torch.testing.assert_close(got, ref_logits(ref, ids, keep), rtol=0, atol=1e-4)
    # right padding: the real tokens' logits equal those of the unpadded sequence alone, whatever the pads hold
    alone = ours.logits_full(ids[1:, :-3])
    junk = ids.clone()
    junk[1, -3:] = 7
    torch.testing.assert_close(ours.logits_full(junk, keep)[1, :-3], alone[0], rtol=0, atol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("start,length", [(0, 13), (5, 8), (4, 3), (12, 1), (0, 4)])
def test_forward_window_with_kv_of_the_same_tokens_equals_the_full_pass(pair, start, length):
    family, ref, ours, _ = pair
    ids = _ids()
    full, kv = ours.forward_window(ids, 0, return_kv=True)
    assert torch.equal(full, ours.logits_full(ids))  # kv=None, start=0 is logits_full exactly
    assert len(kv) == len(ours.layers) and kv[0][0].shape[2] == 13
    win = ids[:, start : start + length]
    dual = ours.forward_window(win, start, kv)  # dual cache: kv of the whole sequence
    torch.testing.assert_close(dual, full[:, start : start + length], rtol=0, atol=1e-5)
    if start + length == 13:  # prefix cache: kv of the prefix only
        prefix = [(k[:, :, :start], v[:, :, :start]) for k, v in kv]
        logits, fresh = ours.forward_window(win, start, prefix, return_kv=True)
        torch.testing.assert_close(logits, full[:, start:], rtol=0, atol=1e-5)
        torch.testing.assert_close(fresh[0][0], kv[0][0][:, :, start:], rtol=0, atol=1e-5)


def test_forward_window_reads_stale_kv_outside_the_window(pair):
    """The approximation: keys outside the window come from kv, not from the current tokens."""
    family, ref, ours, _ = pair
    ids = _ids()
    _, kv = ours.forward_window(ids, 0, return_kv=True)
    changed = ids.clone()
    changed[:, 10:] = MASK  # tokens after the window changed
    stale = ours.forward_window(changed[:, 4:8], 4, kv)
    torch.testing.assert_close(stale, ours.logits_full(ids)[:, 4:8], rtol=0, atol=1e-5)
    assert not torch.allclose(stale, ours.logits_full(changed)[:, 4:8], atol=1e-4)


def test_window_padding_mask_covers_the_full_sequence(pair):
    family, ref, ours, _ = pair
    ids = _ids()
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :3] = False
    full, kv = ours.forward_window(ids, 0, attention_mask=keep, return_kv=True)
    torch.testing.assert_close(
        ours.forward_window(ids[:, 6:10], 6, kv, attention_mask=keep), full[:, 6:10], rtol=0, atol=1e-5
    )
    with pytest.raises(ValueError, match="keys"):
        ours.forward_window(ids[:, 6:10], 6, kv, attention_mask=keep[:, :5])


def test_config_fields_of_the_contract(pair):
    family, _, ours, _ = pair
    c = ours.config
    assert (c.vocab_size, c.mask_token_id, c.max_position_embeddings) == (VOCAB, MASK, 256)
    assert isinstance(c.eos_token_id, tuple) and c.eos_token_id == (EOS,)
    assert ours.shift_logits is c.shift_logits is (family == "dream")
    assert c.raw["model_type"] == upstream_config(family)["model_type"] and c.bos_token_id in (None, EOS)


def test_show_summarises_each_checkpoint(pair, capsys):
    from localdiff.cli import main

    family, ref, _, folder = pair
    assert main(["show", str(folder), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert s["family"] == "masked" and s["hidden_size"] == 48 and s["vocab_size"] == VOCAB
    assert s["parameters"]["total"] == sum(p.numel() for p in ref.parameters())
    assert s["mask_token_id"] == MASK and s["layers"]["total"] == 5
    if family == "lladamoe":
        assert s["experts"]["total"] == 5 and s["parameters"]["active_per_token"] < s["parameters"]["total"]


# -- the MoE pieces the Qwen3-MoE reference does not have: shared expert, expert bias ------------------------------
def test_lladamoe_router_bias_and_shared_expert_follow_the_hub_code():
    """Transcription of the LLaDA-MoE Hub ``LLaDAMoESparseMoeBlock.forward`` + the decoder layer's shared expert."""
    from localdiff.arch.dense import DecoderLayer
    from localdiff.arch.masked_spec import parse_config

    raw = upstream_config("lladamoe") | {"shared_expert_intermediate_size": 20, "moe_router_enable_expert_bias": True}
    cfg = parse_config(raw)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 1)
    with torch.no_grad():
        for p in list(layer.parameters()) + list(layer.buffers()):
            p.copy_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 7, 48)
    moe = layer.mlp
    h = layer.post_attention_layernorm(x).view(-1, 48)
    w = torch.softmax(moe.gate(h), dim=1, dtype=torch.float) + moe.expert_bias
    w, sel = torch.topk(w, 3, dim=-1)
    want = torch.zeros_like(h)
    for e in range(5):
        idx, top = torch.where(torch.nn.functional.one_hot(sel, 5).permute(2, 1, 0)[e])
        want.index_add_(0, top, moe.experts[e](h[top]) * w[top, idx, None])
    want = x + (want.view(2, 7, 48) + layer.shared_expert(layer.post_attention_layernorm(x)))
    torch.testing.assert_close(layer.ffn(x), want, rtol=0, atol=1e-6)


# -- bad input: one line naming the field -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,change,field",
    [
        ("llada", {"mask_token_id": None}, "mask_token_id"),
        ("llada", {"mask_token_id": EOS}, "mask_token_id"),
        ("dream", {"pad_token_id": MASK}, "mask_token_id"),
        ("llada", {"d_model": None}, "d_model"),
        ("llada", {"layer_norm_type": "default"}, "layer_norm_type"),
        ("dream", {"num_hidden_layers": None}, "num_hidden_layers"),
        ("qwen3", {"mask_token_id": 999}, "mask_token_id"),
        ("lladamoe", {"moe_layer_freq": [1, 1]}, "moe_layer_freq"),
        ("lladamoe", {"expert_intermediate_size": None}, "expert_intermediate_size"),
        ("dream", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(tmp_path, family, change, field):
    raw = upstream_config(family)
    for k, v in change.items():
        if v is None:
            raw.pop(k)
            if k == "mask_token_id":
                raw[k] = None
        else:
            raw[k] = v
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"'{field}'" in msg and "config.json" in msg


def test_missing_mask_id_uses_the_known_default_of_the_model_type(tmp_path):
    raw = upstream_config("dream")
    raw.pop("mask_token_id"), raw.pop("pad_token_id")
    (tmp_path / "config.json").write_text(json.dumps(raw | {"vocab_size": 151936, "model_type": "dream"}))
    _, cfg = load_config(tmp_path)
    assert (cfg.model_type, cfg.mask_token_id, cfg.pad_token_id, cfg.shift_logits) == ("Dream", 151666, 151643, True)


def test_llada_checkpoint_names_are_the_olmo_layout():
    mod = get_arch("llada")
    assert mod.checkpoint_names("layers.3.self_attn.o_proj.weight") == ["model.transformer.blocks.3.attn_out.weight"]
    assert mod.checkpoint_names("layers.0.mlp.down_proj.weight") == ["model.transformer.blocks.0.ff_out.weight"]
    assert mod.checkpoint_names("lm_head.weight") == ["model.transformer.ff_out.weight"]
    assert mod.checkpoint_names("embed_tokens.weight") == ["model.transformer.wte.weight"]


# -- catalog ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias,repo,mask",
    [
        ("llada:8b", "GSAI-ML/LLaDA-8B-Instruct", 126336),
        ("llada-moe:7b", "inclusionAI/LLaDA-MoE-7B-A1B-Instruct", 156895),
        ("dream:7b", "Dream-org/Dream-v0-Instruct-7B", 151666),
        ("diffucoder:7b", "apple/DiffuCoder-7B-cpGRPO", 151666),
        ("qwen3-mdm:0.6b", "dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1", 151669),
    ],
)
def test_catalog_entries_show_before_pull(alias, repo, mask, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from localdiff.cli import main
    from localdiff.hub.catalog import lookup

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    e = lookup(alias)
    assert e.repo == repo and e.sampler and e.allow_patterns and e.approx_size_bytes > 0
    assert main(["show", alias, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    s = shown["summary"]
    assert "offline stand-in" in shown["source"] and s["family"] == "masked" and s["mask_token_id"] == mask
    assert s["parameters"]["total"] == e.approx_params and s["parameters"]["active_per_token"] == e.active_params
