"""LLaDA2.x memory plans (from the spec's tensor_shapes) and the placement a CUDA load follows, checked on CPU: the
meta device stands in for the GPU, so the bytes left on the CPU are exactly the host-layer experts."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from llada2_ref import TINY, build, write_checkpoint
from localdiff.paths import models_dir
from localdiff.quantize.plan import plan_for_recipe, plan_memory, tensor_bytes
from localdiff.quantize.recipe import load_recipe, recipe_for_model

GIB = 1 << 30
MINI = models_dir() / "offline" / "llada2-mini" / "config.json"


def _mini():
    return json.loads(MINI.read_text())


def test_recipe_plans_agree_with_the_planner():
    recipe = load_recipe("llada2-mini")
    assert recipe_for_model("llada2:mini") is not None and recipe_for_model("llada2.1:mini").name == "llada2-mini"
    for i, vp in enumerate(recipe.plans):
        plan = plan_for_recipe(_mini(), recipe, i)
        assert plan.fits and plan.device_total_bytes <= vp.gpu_mem
        assert plan.n_cpu_moe == vp.host_expert_layers
        if plan.host_expert_layers:  # one fewer host layer would not fit; the dense layer 0 is never moved
            assert 0 not in plan.host_expert_layers
            assert plan.device_total_bytes + plan.expert_layer_bytes[plan.host_expert_layers[-1]] > vp.gpu_mem


def test_sdar_moe_recipe_plans_agree_with_the_planner():
    """SDAR-30B-A3B (the block helper's spec): int8 alone is over 24 GiB, so its 24 GiB plan keeps expert layers
    on the host."""
    cfg = json.loads((models_dir() / "offline" / "sdar-moe-30b-a3b" / "config.json").read_text())
    recipe = load_recipe("sdar-moe-30b-a3b")
    assert recipe_for_model("sdar-moe:30b-a3b").name == recipe.name
    for i, vp in enumerate(recipe.plans):
        plan = plan_for_recipe(cfg, recipe, i)
        assert plan.fits and plan.n_cpu_moe == vp.host_expert_layers
    plan = plan_for_recipe(cfg, recipe, 0)
    assert plan.weight_bytes > 24 * GIB and plan.host_expert_layers == list(range(plan.n_cpu_moe))


def test_24gib_plans():
    recipe = load_recipe("llada2-mini")
    int8 = plan_memory(_mini(), 24 * GIB, "int8", recipe=recipe)
    assert int8.fits and int8.n_cpu_moe == 0 and int8.kv_tokens >= 32768 and int8.sc_buffer_bytes == 0
    precisions = {r["component"]: r["precision"] for r in tensor_bytes(_mini(), "int8", recipe=recipe)}
    assert precisions["experts"] == precisions["attention"] == precisions["shared_expert"] == "int8"
    assert precisions["router"] == precisions["embeddings"] == precisions["lm_head"] == "bfloat16"
    assert "host: no expert layers" in int8.to_text()
    bf16 = plan_memory(_mini(), 24 * GIB, "bf16")
    assert bf16.fits and bf16.host_expert_layers == [1, 2, 3, 4, 5, 6]
    assert bf16.weight_bytes > 24 * GIB and "--n-cpu-moe 6" in bf16.to_text()


def test_show_prints_the_plan(capsys):
    from localdiff.cli import main

    assert main(["show", "llada2:mini", "--plan", "--gpu-mem", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "decoder: llada2" in out  # the stand-in config's model_type picks the decoder
    assert "recipe llada2-mini" in out and "fits" in out and "experts" in out and "host:" in out
    assert main(["show", "llada2:mini", "--plan", "--gpu-mem", "24GiB", "--quant", "bf16"]) == 0
    assert "host: experts of layers 1-6" in capsys.readouterr().out


def test_placement_follows_the_plan():
    from localdiff.quantize.offload import device_for, place_model, placement_bytes

    net = build()
    plan = plan_memory(TINY, 10**9, None, dtype="float32")
    host = [2]
    meta = copy.deepcopy(net)
    placed = place_model(meta, host, "meta")
    assert placed == [f"layers.2.mlp.experts.{e}" for e in range(TINY["num_experts"])]
    assert placement_bytes(meta)["cpu"] == sum(plan.expert_layer_bytes[i] for i in host)
    assert device_for("layers.2.mlp.experts.5.up_proj.weight", host, "cuda").type == "cpu"
    assert device_for("layers.1.mlp.experts.5.up_proj.weight", host, "cuda").type == "cuda"
    assert device_for("layers.2.shared_expert.up_proj.weight", host, "cuda").type == "cuda"
    assert device_for("layers.2.mlp.gate.weight", host, "cuda").type == "cuda"
    hooked = copy.deepcopy(net)
    place_model(hooked, host, "cpu")  # hooks installed; results unchanged
    assert sum(getattr(m, "_offload_hooked", False) for m in hooked.modules()) == TINY["num_experts"]
    ids = torch.randint(0, 96, (1, 10))
    assert torch.equal(hooked.logits_full(ids), net.logits_full(ids))


def test_int8_load_follows_the_recipe_the_plan_counts(tmp_path):
    from localdiff.loader import load_model
    from localdiff.quantize.int8 import Int8Linear

    ckpt = write_checkpoint(tmp_path / "ckpt")
    recipe = load_recipe("llada2-mini")
    net, _ = load_model(ckpt, "cpu", torch.float32, quant="int8", recipe=recipe)
    planned = {
        r["name"].rsplit(".", 1)[0] for r in tensor_bytes(TINY, "int8", "float32", recipe) if r["precision"] == "int8"
    }
    quantized = {n for n, m in net.named_modules() if isinstance(m, Int8Linear)}
    assert quantized == planned
    assert "layers.1.self_attn.query_key_value" in quantized and "layers.1.mlp.gate" not in quantized
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = build().logits_full(ids)
    err = net.logits_full(ids) - ref  # int8 noise (a near-tie in the router may flip an expert): RMS within 5 %
    assert err.pow(2).mean().sqrt() < 0.05 * ref.pow(2).mean().sqrt()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_keeps_host_experts_on_cpu(tmp_path):
    from localdiff.loader import load_model

    ckpt = write_checkpoint(tmp_path / "ckpt")
    ref = build().logits_full(torch.arange(9)[None])
    plan = plan_memory(TINY, 1, None)  # nothing fits: every MoE layer's experts go to the host
    assert plan.host_expert_layers == [1, 2]
    net, _ = load_model(ckpt, "cuda", torch.float32, host_layers=plan.host_expert_layers)
    assert net.layers[1].mlp.experts[0].up_proj.weight.device.type == "cpu"
    assert net.layers[1].mlp.gate.weight.device.type == "cuda"
    assert net.layers[0].mlp.up_proj.weight.device.type == "cuda"
    out = net.logits_full(torch.arange(9, device="cuda")[None]).cpu()
    assert (out - ref).abs().max() < 1e-3
