"""Memory planner and architecture summary: parameter counts vs the reference, byte counts vs real tensors, KV bytes
vs a real cache, the DiffusionGemma-26B-A4B stand-in config and its 24 GiB plan."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from localdiff.errors import LocaldiffError
from localdiff.paths import models_dir
from localdiff.quantize.plan import kv_bytes, kv_tokens_for, plan_for_recipe, plan_memory, summarize, tensor_bytes
from localdiff.quantize.recipe import RecipeError, load_recipe, parse_bytes
from localdiff.summary import parameter_counts

import transformers  # noqa: E402,F401 — test-only reference (the `test` extra)

GIB = 1 << 30
STANDIN = models_dir() / "offline" / "diffusiongemma-26b-a4b" / "config.json"


def _config(path):
    return json.loads((path / "config.json").read_text())


def _by_name(ref):
    return {n: p for n, p in ref.named_parameters() if "vision" not in n}


@pytest.mark.parametrize("which", ["ref_small", "ref_odd"])
def test_parameter_counts_equal_the_reference(which, request):
    ref, path = request.getfixturevalue(which)
    params = _by_name(ref)
    total = sum(p.numel() for p in params.values())  # the reference's own count (tied weights once)
    counts = parameter_counts(_config(path))
    assert counts["total"] == total
    t = ref.config.text_config
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    active = total - experts + experts * t.top_k_experts // t.num_experts
    assert counts["active_per_token"] == active
    assert sum(counts["by_component"].values()) == total


@pytest.mark.parametrize("which", ["ref_small", "ref_odd"])
def test_planner_bytes_equal_checkpoint_tensor_sizes(which, request):
    _, path = request.getfixturevalue(which)
    rows = {r["name"]: r for r in tensor_bytes(_config(path), quant=None, dtype="float32")}
    real = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.startswith("model.decoder."):
                    t = h.get_slice(k)
                    ours = k[len("model.decoder.") :]  # the planner names tensors as our module does
                    if ours.startswith("self_conditioning.") and not ours.startswith("self_conditioning.pre_norm"):
                        ours = ours.replace("self_conditioning.", "self_conditioning.mlp.")
                    real[ours] = (tuple(t.get_shape()), math.prod(t.get_shape()) * 4)
    enc_scalars = [n for n in rows if n.endswith("enc_layer_scalar")]
    assert set(rows) - set(enc_scalars) == set(real)
    for name, (shape, nbytes) in real.items():
        assert rows[name]["shape"] == shape and rows[name]["bytes"] == nbytes, name


def _local_bytes(model) -> dict:
    from localdiff.quantize.int8 import is_quant_state

    """Our model's state-dict bytes keyed like the planner (scales folded into their weight)."""
    out = {}
    for k, t in model.state_dict().items():
        base = k[: -len("_scale")] if is_quant_state(k) else k
        out[base] = out.get(base, 0) + t.numel() * t.element_size()
    return out


@pytest.mark.parametrize("quant", [None, "int8"])
def test_planner_bytes_equal_resident_tensors_of_our_model(ref_small, quant):
    from localdiff.loader import load_model
    from localdiff.quantize.int8 import quantize_model

    _, path = ref_small
    net, _ = load_model(path, "cpu", torch.float32)
    if quant:
        quantize_model(net)
    rows = {r["name"]: r["bytes"] for r in tensor_bytes(_config(path), quant=quant, dtype="float32")}
    assert _local_bytes(net) == rows


def test_kv_bytes_equal_a_real_cache(ref_small):
    import localdiff

    _, path = ref_small
    m = localdiff.load(path, device="cpu", dtype=torch.float32)
    cfg = _config(path)
    cache = m.new_cache()
    n = 13  # longer than the sliding window (6)
    m.prefill(torch.randint(3, 100, (2, n)), cache)
    visible = 0  # the K/V attention reads (reference semantics)
    for i in range(len(cfg["text_config"]["layer_types"])):
        k, v = cache.past(i)
        visible += k.numel() * k.element_size() + v.numel() * v.element_size()
    assert visible == kv_bytes(cfg, n, batch_size=2, dtype="float32", sliding_slack=0)
    # what the cache may hold: sliding layers keep a canvas of slack beyond window - 1
    assert visible < kv_bytes(cfg, n, batch_size=2, dtype="float32") <= kv_bytes(cfg, n + 8, 2, "float32")
    assert kv_bytes(cfg, 3, dtype="float32") < kv_bytes(cfg, n, dtype="float32")


def test_kv_tokens_for_budget_is_the_largest_that_fits():
    cfg = json.loads(STANDIN.read_text())
    t = kv_tokens_for(cfg, 2 * GIB)
    assert kv_bytes(cfg, t) <= 2 * GIB < kv_bytes(cfg, t + 1)


def test_standin_config_matches_published_facts():
    cfg = json.loads(STANDIN.read_text())
    s = summarize(cfg)
    assert cfg["model_type"] == "diffusion_gemma" and cfg["text_config"]["model_type"] == "diffusion_gemma_text"
    assert abs(s["parameters"]["total"] / 25.2e9 - 1) <= 0.03
    assert abs(s["parameters"]["active_per_token"] / 3.8e9 - 1) <= 0.03
    assert s["experts"]["total"] == 128 and s["experts"]["top_k"] == 8
    assert s["vocab_size"] == 262_144 and s["canvas_length"] == 256
    assert s["attention"]["full_attention"]["kv_heads"] == 2
    assert s["parameters"]["by_component"]["dense_mlp"] > 0  # a dense MLP in every layer besides the MoE
    # transformers itself parses it into the same geometry
    from transformers import DiffusionGemmaConfig

    tc = DiffusionGemmaConfig.from_pretrained(STANDIN.parent).text_config
    assert tc.per_layer_config[5].num_key_value_heads == 2 and tc.num_experts == 128


def test_24gib_int8_plan_for_the_standin_fits_with_its_kv_budget():
    cfg = json.loads(STANDIN.read_text())
    recipe = load_recipe("diffusiongemma-26b-a4b")
    plan = plan_for_recipe(cfg, recipe, 0)
    assert plan.gpu_mem_bytes == 24 * GIB and plan.kv_budget_bytes == 2 * GIB
    assert plan.fits and plan.device_total_bytes <= 24 * GIB
    assert plan.weight_bytes > 24 * GIB  # int8 alone does not fit: expert layers must go to host
    assert 0 < plan.n_cpu_moe < 30 and plan.host_expert_layers == list(range(plan.n_cpu_moe))
    assert plan.kv_tokens >= 32768
    # one fewer host layer would not fit
    assert plan.device_total_bytes + plan.expert_layer_bytes[0] > 24 * GIB
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["fits"] and d["n_cpu_moe"] == plan.n_cpu_moe
    text = plan.to_text()
    assert "fits" in text and "--n-cpu-moe" in text
    # bf16 needs far more offloading on the same card
    assert plan_memory(cfg, 24 * GIB, None, 2 * GIB).n_cpu_moe > plan.n_cpu_moe


@pytest.mark.parametrize("name", ["diffusiongemma-26b-a4b", "tiny"])
def test_recipe_plans_agree_with_the_planner(name):
    recipe = load_recipe(name)
    cfg_path = STANDIN if name != "tiny" else models_dir() / "tiny" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for i, vp in enumerate(recipe.plans):
        plan = plan_for_recipe(cfg, recipe, i)
        assert plan.fits
        if vp.host_expert_layers is not None:
            assert plan.n_cpu_moe == vp.host_expert_layers


def test_does_not_fit_is_reported():
    cfg = json.loads(STANDIN.read_text())
    plan = plan_memory(cfg, 4 * GIB, "int8")
    assert not plan.fits and plan.n_cpu_moe == 30 and "does NOT fit" in plan.to_text()


def test_summary_disk_bytes_from_headers(ref_small):
    _, path = ref_small
    s = summarize(_config(path), path)
    files = list(path.glob("*.safetensors"))
    assert s["disk"]["files"] == len(files) > 1
    assert s["disk"]["bytes_on_disk"] == sum(f.stat().st_size for f in files)
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            total += sum(math.prod(h.get_slice(k).get_shape()) * 4 for k in h.keys())
    assert s["disk"]["weight_bytes_by_dtype"] == {"F32": total}
    assert s["disk"]["text_weight_bytes_by_dtype"]["F32"] < total  # the vision tower is excluded there
    assert s["has_vision_tower"] and s["disk"]["vision_weight_bytes"] > 0
    json.dumps(s)
    # before a pull (config only) the text-weight estimate equals what the headers say
    assert summarize(_config(path))["text_weight_bytes_estimate"] == s["disk"]["text_weight_bytes_by_dtype"]


def test_sizes_and_bad_inputs():
    assert parse_bytes("24GiB") == 24 * GIB and parse_bytes("24 GB") == 24 * 10**9 and parse_bytes(512) == 512
    assert parse_bytes("1.5GiB") == 3 * GIB // 2
    for bad in ("abc", "12XB", "", "-1GiB"):
        with pytest.raises(RecipeError):
            parse_bytes(bad)
    assert issubclass(RecipeError, LocaldiffError)
    with pytest.raises(RecipeError):
        plan_memory(json.loads(STANDIN.read_text()), GIB, "int3")
    with pytest.raises(RecipeError, match="available"):
        load_recipe("no-such-recipe")


def test_place_model_follows_the_plan(ref_small):
    """Experts of the plan's host layers stay on the CPU (and run there through hooks); the rest moves to the
    device — here the meta device stands in for a GPU, so the CPU bytes are exactly the host experts."""
    import copy

    from localdiff.cache.kv import KVCache
    from localdiff.loader import load_model
    from localdiff.quantize.offload import device_for, place_model, placement_bytes
    from localdiff.quantize.int8 import quantize_model

    _, path = ref_small
    cfg = _config(path)
    net, _ = load_model(path, "cpu", torch.float32)
    quantize_model(net)
    plan = plan_memory(cfg, 10**9, "int8", dtype="float32")
    host = [0, 2]
    meta = copy.deepcopy(net)
    assert place_model(meta, host, "meta") == ["layers.0.experts", "layers.2.experts"]
    assert placement_bytes(meta)["cpu"] == sum(plan.expert_layer_bytes[i] for i in host)
    assert device_for("layers.2.experts.down_proj", host, "cuda").type == "cpu"
    assert device_for("layers.1.experts.down_proj", host, "cuda").type == "cuda"
    assert device_for("layers.2.mlp.down_proj.weight", host, "cuda").type == "cuda"
    placed = copy.deepcopy(net)
    place_model(placed, host, "cpu")  # hooks installed; results unchanged
    assert [n for n, m in placed.named_modules() if getattr(m, "_offload_hooked", False)] == [
        "layers.0.experts",
        "layers.2.experts",
    ]
    ids, canvas = torch.randint(3, 100, (2, 9)), torch.randint(0, 100, (2, 8))
    outs = []
    for n in (net, placed):
        c = KVCache(n.layer_windows())
        n.prefill(ids, c)
        outs.append(n.denoise(canvas, c))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_place_model_on_cuda_runs_host_experts_on_cpu(ref_small):
    from localdiff.cache.kv import KVCache
    from localdiff.loader import load_model
    from localdiff.quantize.offload import place_model, placement_bytes

    _, path = ref_small
    net, _ = load_model(path, "cpu", torch.float32)
    ids, canvas = torch.randint(3, 100, (2, 9)), torch.randint(0, 100, (2, 8))
    c = KVCache(net.layer_windows())
    net.prefill(ids, c)
    ref = net.denoise(canvas, c)
    place_model(net, [1], "cuda")
    assert net.layers[1].experts.gate_up_proj.device.type == "cpu"
    assert net.layers[0].experts.gate_up_proj.device.type == "cuda"
    assert placement_bytes(net)["cuda"] > 0
    c = KVCache(net.layer_windows())
    net.prefill(ids.cuda(), c)
    out = net.denoise(canvas.cuda(), c).cpu()
    assert (out - ref).abs().max() <= 1e-3
