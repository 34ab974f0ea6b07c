"""Quantized embedding tables (``localdiff.quantize.embedding``): lookup, tied head and soft embedding equal the same
computations on the dequantized table; recipes' ``int4_embeddings``; block and DiffusionGemma models with int4 /
int8 tables equal their float twins on dequantized weights; the flagship's int4 plan is resident on a 16 GiB GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from arch_baby import BABY, build_baby, forward_roles
from localdiff.paths import models_dir, read_json
from localdiff.quantize import embedding, int4, int8
from localdiff.quantize.apply import LinearHead, quantize_model
from localdiff.quantize.embedding import QuantEmbedding, TiedHead
from localdiff.quantize.plan import int4_bytes, plan_memory
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe
from quant_helpers import dequantized_twin

GIB = 1 << 30


def _reference_table(q: QuantEmbedding) -> torch.Tensor:
    """float64 dequantization by the formats' own definitions (int4: s · (q − z) per group; int8: q · s per row)."""
    if q.precision == "int4":
        return int4.dequantize(q.weight, q.weight_scale, q.weight_zero, q.embedding_dim, torch.float64)
    return q.weight.double() * q.weight_scale.double()[:, None]


@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_head_and_weighted_sum_equal_the_dequantized_table(precision, dtype, monkeypatch):
    monkeypatch.setattr(embedding, "CHUNK", 64)  # several chunks in weighted_sum
    g = torch.Generator().manual_seed(0)
    emb = nn.Embedding(301, 100).to(dtype)  # 100 features: a padded last group of 64
    with torch.no_grad():
        emb.weight.copy_(torch.randn(301, 100, generator=g) * 0.3)
    q = QuantEmbedding.from_embedding(emb, precision)
    ref = _reference_table(q)
    assert q.dtype == dtype and (ref - emb.weight.double()).abs().max() < 0.2
    torch.testing.assert_close(q.table(dtype=torch.float64), ref, rtol=0, atol=1e-6)
    ids = torch.randint(0, 301, (3, 7), generator=g)
    assert q(ids).dtype == dtype and torch.equal(q(ids), F.embedding(ids, q.table()))
    h = torch.randn(5, 100, generator=g)
    torch.testing.assert_close(q.head(h).double(), h.double() @ ref.t(), rtol=1e-4, atol=1e-4)
    p = torch.softmax(torch.randn(2, 4, 301, generator=g), -1)
    want = (p.to(dtype).double() @ ref.to(dtype).double()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.weighted_sum(p), want, rtol=tol, atol=tol)
    bytes_ = sum(t.numel() * t.element_size() for t in q.state_dict().values())
    assert bytes_ == (int4_bytes(301, 100) if precision == "int4" else 301 * 100 + 2 * 301)
    with pytest.raises(ValueError, match="precision"):
        QuantEmbedding(3, 4, "int2")


def test_recipe_int4_embeddings():
    r = Recipe.from_dict({"name": "r", "rules": [["*_proj", "int8"]], "int4_embeddings": "int4"})
    assert r.embeddings == "float" and r.with_precision("int8").embeddings == "float"
    r4 = r.with_precision("int4")
    assert r4.embeddings == "int4" and r4.quant() == "int4"
    assert Recipe.from_dict(r4.to_dict()).embeddings == "int4"  # recorded in pre-quantized checkpoints
    assert DEFAULT_RECIPE.with_precision("int4").embeddings == "float"
    with pytest.raises(RecipeError, match="int4_embeddings precision 'int3'"):
        Recipe.from_dict({"int4_embeddings": "int3"})
    for name, want in (("sdar", "int4"), ("diffusiongemma-26b-a4b", "int4"), ("tiny", "int8")):
        assert load_recipe(name).with_precision("int4").embeddings == want  # tiny: int4 tables cost ~1 point


def _twin_with_tables(qnet, net):
    """``net`` with every quantized weight of ``qnet`` (projections, experts, embedding, untied head) dequantized."""
    twin = dequantized_twin(qnet, net)
    with torch.no_grad():
        twin.embed_tokens.weight.copy_(qnet.embed_tokens.table(dtype=torch.float32))
        lm = getattr(qnet, "lm_head", None)
        if isinstance(lm, int4.Int4Linear):
            twin.lm_head.weight.copy_(int4.dequantize(lm.weight, lm.weight_scale, lm.weight_zero, lm.in_features))
        elif isinstance(lm, int8.Int8Linear):
            twin.lm_head.weight.copy_(lm.weight.float() * lm.weight_scale.float()[:, None])
    return twin


@pytest.mark.parametrize(
    "model_type,tied,precision",
    [
        ("sdar", True, "int4"),
        ("sdar", False, "int4"),
        ("diffusion_gemma", True, "int4"),
        ("diffusion_gemma", True, "int8"),
    ],
)
def test_models_with_quantized_tables_equal_their_dequantized_twins(model_type, tied, precision):
    raw = dict(BABY[model_type], tie_word_embeddings=tied)
    net = build_baby(raw, seed=5)
    recipe = Recipe.from_dict(dict(DEFAULT_RECIPE.to_dict(), int4_embeddings=precision))
    qnet = quantize_model(copy.deepcopy(net), recipe, quant="int4")
    assert isinstance(qnet.embed_tokens, QuantEmbedding) and qnet.embed_tokens.precision == precision
    assert isinstance(qnet.head_int8, TiedHead if tied else LinearHead)
    v = qnet.config.vocab_size
    assert not any(
        t.is_floating_point() and tuple(t.shape) == (v, qnet.config.hidden_size) for t in qnet.state_dict().values()
    )  # no float table or head left
    twin = _twin_with_tables(qnet, net)
    ids = torch.randint(2, v, (4, 11), generator=torch.Generator().manual_seed(6))
    out_q, out_t = forward_roles(qnet, ids), forward_roles(twin, ids)
    for role in out_q:
        torch.testing.assert_close(out_q[role], out_t[role], rtol=1e-4, atol=1e-4)
    if model_type == "diffusion_gemma":  # the self-conditioning soft embedding reads the quantized table
        from localdiff.cache.kv import KVCache

        sc = torch.randn(4, 6, v, generator=torch.Generator().manual_seed(7))
        got = []
        for m in (qnet, twin):
            cache = KVCache(**m.cache_layout())
            m.prefill(ids[:, :5], cache)
            got.append(m.denoise(ids[:, 5:], cache, sc))
        torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)


def _flagship():
    return read_json(models_dir() / "offline" / "diffusiongemma-26b-a4b" / "config.json")


def test_flagship_int4_plan_resident_on_16gib_with_every_component_counted():
    cfg, recipe = _flagship(), load_recipe("diffusiongemma-26b-a4b")
    p16 = plan_memory(cfg, 16 * GIB, "int4", recipe=recipe)
    comps = {c["component"]: c for c in p16.components}
    assert comps["embeddings"]["precision"] == "int4"
    assert comps["embeddings"]["bytes"] == int4_bytes(262144, 2816)  # 396 MiB instead of 1.38 GiB bf16
    assert "head_int8" not in comps  # the tied head reads the table
    assert p16.resident and p16.host_expert_layers == [] and p16.reserve_bytes == GIB
    assert (
        p16.device_total_bytes
        == p16.weight_bytes + p16.kv_budget_bytes + p16.sc_buffer_bytes + p16.activation_bytes + p16.reserve_bytes
    )
    assert plan_memory(cfg, 24 * GIB, "int4", recipe=recipe).resident
    cpu = plan_memory(cfg, 32 * GIB, "int4", recipe=recipe, device="cpu")
    assert cpu.fits and cpu.device_total_bytes == p16.device_total_bytes
    # the same recipe without int4 tables: the bf16 table keeps 3 expert layers on the host (the earlier plan)
    float_tables = Recipe.from_dict({k: v for k, v in recipe.to_dict().items() if k != "int4_embeddings"})
    old = plan_memory(cfg, 16 * GIB, "int4", recipe=float_tables)
    assert not old.resident and old.n_cpu_moe == 3
    assert old.device_total_bytes + old.host_weight_bytes - p16.device_total_bytes == 262144 * 2816 * 2 - int4_bytes(
        262144, 2816
    )


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_save_quantized_tables_load_without_a_second_pass(precision, tmp_path):
    import localdiff
    from localdiff.loader import load_model
    from localdiff.quantize.io import save_quantized

    net, _ = load_model(models_dir() / "tiny", "cpu", torch.float32)
    recipe = Recipe.from_dict(dict(load_recipe("tiny").to_dict(), int4_embeddings=precision))
    q = quantize_model(net, recipe, quant="int4")
    save_quantized(q, tmp_path / "q", source_dir=models_dir() / "tiny")
    m = localdiff.load(tmp_path / "q", device="cpu", dtype=torch.float32)
    e = m.net.embed_tokens
    assert isinstance(e, QuantEmbedding) and e.precision == precision and e.dtype == torch.float32
    assert torch.equal(e.weight, q.embed_tokens.weight) and isinstance(m.net.head_int8, TiedHead)
