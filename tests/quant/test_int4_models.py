"""int4 on whole models: every family's baby model (DiffusionGemma canvas, LLaDA-MoE / LLaDA2 / SDAR-MoE experts,
SDAR / LLaDA / Dream dense) equals its float twin with dequantized weights and agrees with fp32 on top-1 (reported;
a loose floor asserted); the embedded trained model's int4 logits; ``gen --quant int4`` on every embedded model;
pre-quantized int4 checkpoints (``quantize --quant int4``, ``save_quantized``) load without a second pass and give
the same logits as quantizing at load."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from arch_baby import BABY, build_baby, forward_roles
from localdiff.loader import load_model
from localdiff.paths import models_dir
from localdiff.quantize import int4
from localdiff.quantize.apply import quantize_model, quantized_modules
from localdiff.quantize.embedding import QuantEmbedding
from localdiff.quantize.io import checkpoint_recipe, quantize_checkpoint, save_quantized
from localdiff.quantize.recipe import load_recipe
from quant_helpers import agreement, denoise_pairs, dequantized_twin

FAMILIES = ["diffusion_gemma", "lladamoe", "llada2_moe", "sdar_moe", "sdar", "llada", "Dream"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_int4_equals_dequantized_twin_and_agrees_with_fp32(model_type, capsys):
    raw = BABY[model_type]
    net = build_baby(raw, seed=3)
    qnet = quantize_model(copy.deepcopy(net), quant="int4")
    kinds = {type(m) for m in quantized_modules(qnet).values()}
    assert int4.Int4Linear in kinds
    if model_type in ("diffusion_gemma", "lladamoe", "llada2_moe", "sdar_moe"):
        assert int4.Int4Experts in kinds or any("expert" in n for n in quantized_modules(qnet)), kinds
    vocab = qnet.config.vocab_size
    ids = torch.randint(2, vocab, (8, 11), generator=torch.Generator().manual_seed(4))
    out_q, out_f = forward_roles(qnet, ids), forward_roles(net, ids)
    out_twin = forward_roles(dequantized_twin(qnet, net), ids)
    out_bf16 = forward_roles(copy.deepcopy(net).to(torch.bfloat16), ids)
    for role in out_q:
        # the int4 model is the float model on the dequantized weights (its kernels: fp32 sums)
        torch.testing.assert_close(out_q[role], out_twin[role], rtol=1e-4, atol=1e-4)
        top1 = (out_q[role].argmax(-1) == out_f[role].argmax(-1)).float().mean().item()
        top1_bf16 = (out_bf16[role].float().argmax(-1) == out_f[role].argmax(-1)).float().mean().item()
        with capsys.disabled():
            print(f"\n[int4 top-1] {model_type} {role}: int4 vs fp32 {top1:.3f}, bf16 vs fp32 {top1_bf16:.3f}")
        assert top1 >= 0.4, (model_type, role, top1, top1_bf16)  # random nets: near-flat outputs (test_quant)


@pytest.fixture(scope="module")
def tiny_fp32():
    net, _ = load_model(models_dir() / "tiny", "cpu", torch.float32)
    return net


def test_embedded_model_int4_accuracy(tiny_fp32, capsys):
    """The trained tiny DiffusionGemma: int4 logits keep fp32's decided top-1 tokens (the held-out eval within 2
    points of fp32 is measured by ``localdiff bench --only int4``)."""
    qnet = quantize_model(copy.deepcopy(tiny_fp32), load_recipe("tiny"), quant="int4")
    a, b = denoise_pairs(tiny_fp32, qnet, n_canvases=16)
    top1, kl, top1_decided, n_decided = agreement(a, b)
    with capsys.disabled():
        print(f"\n[int4 top-1] tiny (trained): {top1:.3f} all, {top1_decided:.3f} of {n_decided} decided, KL {kl:.4f}")
    assert top1 >= 0.93 and top1_decided >= 0.95 and kl <= 0.05, (top1, top1_decided, kl)


def test_quantize_checkpoint_int4_loads_like_on_the_fly(tiny_fp32, tmp_path):
    import localdiff

    src = models_dir() / "tiny"
    res = quantize_checkpoint(src, tmp_path / "q4", recipe="tiny", quant="int4")
    assert res["quant"] == "int4" and res["quantized_tensors"] > 0
    assert res["bytes_out"] < 0.5 * res["bytes_in"] or res["bytes_in"] < (1 << 20)
    cfg = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "localdiff-int4"
    assert checkpoint_recipe(cfg).quant() == "int4"
    with pytest.raises(Exception, match="already an int4"):
        quantize_checkpoint(tmp_path / "q4", tmp_path / "q5")
    pre = localdiff.load(tmp_path / "q4", device="cpu", dtype=torch.float32)
    with pytest.raises(Exception, match="pre-quantized int4 checkpoint"):  # never a silent other precision
        localdiff.load(tmp_path / "q4", device="cpu", dtype=torch.float32, quant="int8")
    live = localdiff.load("tiny", device="cpu", dtype=torch.float32, quant="int4")  # the same recipe, tiny's
    assert {type(m) for m in quantized_modules(pre.net).values()} == {int4.Int4Linear, int4.Int4Experts}
    assert isinstance(pre.net.embed_tokens, QuantEmbedding) and isinstance(live.net.embed_tokens, QuantEmbedding)
    a, b = denoise_pairs(live.net, pre.net, n_canvases=2, batch=2, canvas_len=8)
    assert torch.equal(a, b)
    # a live int4 model saved and loaded back: the same logits again
    out = save_quantized(
        quantize_model(copy.deepcopy(tiny_fp32), load_recipe("tiny"), quant="int4"), tmp_path / "s4", source_dir=src
    )
    back = localdiff.load(out, device="cpu", dtype=torch.float32)
    a2, b2 = denoise_pairs(live.net, back.net, n_canvases=2, batch=2, canvas_len=8)
    assert torch.equal(a2, b2)


def test_cli_quantize_int4(tmp_path, capsys):
    from localdiff.cli import main

    assert main(["quantize", "tiny", "--recipe", "tiny", "--quant", "int4", "-o", str(tmp_path / "o")]) == 0
    assert "int4 tensors" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["bits"] == 4


def _embedded_aliases():
    from localdiff.hub import catalog

    return [e.alias for e in catalog.entries() if e.embedded and "dflash" not in e.alias]


@pytest.mark.parametrize("alias", _embedded_aliases())
def test_gen_quant_int4_runs_each_embedded_model(alias, capsys):
    from localdiff.cli import main

    rc = main(["gen", "-m", alias, "--quant", "int4", "--seed", "0", "-n", "6", "--json", "-p", "What is 2 + 3?"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec.get("quant") == "int4", rec
