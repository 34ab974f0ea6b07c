"""Test helpers for LLaDA2.x (``llada2_moe``): tiny configs in the Hub's config.json keys, a tiny checkpoint written
in the Hub layout (``model.word_embeddings``, fused ``attention.query_key_value``, ``mlp.gate.expert_bias``,
``mlp.shared_experts``), and the independent reference: transformers 5.23's own ``Glm4MoeForCausalLM`` (the same
layer math: partial rotate-half RoPE, per-head q/k RMSNorm, first-k dense layers, sigmoid + correction-bias
group-limited router with shared experts) loaded with the same weights and run under a block-causal 4D mask."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

# odd sizes: 3 heads over 1 KV head, head_dim 20 (rotary 10), 12 experts in 4 groups (2 kept), top-3, 1 shared
TINY = dict(
    model_type="llada2_moe",
    architectures=["LLaDA2MoeModelLM"],
    hidden_size=40,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=20,
    num_hidden_layers=3,
    intermediate_size=56,
    moe_intermediate_size=24,
    num_experts=12,
    num_experts_per_tok=3,
    num_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    use_qk_norm=True,
    use_bias=False,
    use_qkv_bias=False,
    rms_norm_eps=1e-6,
    vocab_size=97,
    max_position_embeddings=512,
    block_size=4,
    mask_token_id=96,
    eos_token_id=95,
    pad_token_id=94,
    tie_word_embeddings=False,
)


def random_state(raw: dict, seed: int = 0) -> dict:
    """Our-named random weights for a config (norms near 1, expert biases spread so they change the choice)."""
    from localdiff.arch.llada2_spec import tensor_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in tensor_shapes(raw):
        if t.name.endswith("expert_bias"):
            out[t.name] = 0.3 * torch.randn(t.shape, generator=g)
        elif len(t.shape) == 1:
            out[t.name] = 1 + 0.2 * torch.randn(t.shape, generator=g)
        else:
            out[t.name] = 0.15 * torch.randn(t.shape, generator=g)
    return out


def build(raw: dict = TINY, seed: int = 0):
    """Our model with :func:`random_state` weights (eval, fp32)."""
    from localdiff.arch.llada2_moe import LLaDA2MoE
    from localdiff.arch.llada2_spec import parse_config

    net = LLaDA2MoE(parse_config(raw)).eval()
    net.load_state_dict(random_state(raw, seed), strict=True)
    return net


def write_checkpoint(path, raw: dict = TINY, seed: int = 0):
    """config.json + model.safetensors in the Hub layout (names via the model's checkpoint_names)."""
    from localdiff.arch.llada2_moe import checkpoint_names

    path.mkdir(parents=True, exist_ok=True)
    state = {checkpoint_names(k)[0]: v.contiguous() for k, v in random_state(raw, seed).items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


def sharp_model(folder, seed: int = 11):
    """A loaded fp32 localdiff model of a :data:`TINY` checkpoint written to ``folder`` whose head is scaled ×3 (sharp
    logits: thresholds commit several tokens per step) and whose EOS row ×1.8 more (EOS shows up in some answers)."""
    import localdiff
    import torch
    from localdiff.arch.llada2_moe import checkpoint_names

    state = random_state(TINY, seed=seed)
    state["lm_head.weight"] = state["lm_head.weight"] * 3.0
    state["lm_head.weight"][TINY["eos_token_id"]] *= 1.8
    folder.mkdir(parents=True, exist_ok=True)
    save_file({checkpoint_names(k)[0]: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY))
    return localdiff.load(str(folder), dtype=torch.float32)


def full_logits_fn(m):
    """``x [1, L] int64 → logits [1, L, V] fp32`` of ``m``'s net over the whole sequence, the mask id never predicted
    (as in our decoders): the uncached model call the upstream transcriptions take."""
    import torch

    def fn(x):
        out = m.net.logits_full(x).clone()
        out[..., TINY["mask_token_id"]] = -torch.inf
        return out

    return fn


def glm4_reference(raw: dict, seed: int = 0):
    """transformers' Glm4MoeForCausalLM carrying the same weights as :func:`build` (q/k/v split from the fused
    projection; experts stacked [E, 2I, H] / [E, H, I]; the attention output bias added when ``use_bias``)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    c = raw
    cfg = Glm4MoeConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        rms_norm_eps=c["rms_norm_eps"],
        attention_bias=c["use_qkv_bias"],
        moe_intermediate_size=c["moe_intermediate_size"],
        num_experts_per_tok=c["num_experts_per_tok"],
        n_shared_experts=c["num_shared_experts"],
        n_routed_experts=c["num_experts"],
        routed_scaling_factor=c["routed_scaling_factor"],
        n_group=c["n_group"],
        topk_group=c["topk_group"],
        first_k_dense_replace=c["first_k_dense_replace"],
        norm_topk_prob=True,
        use_qk_norm=c["use_qk_norm"],
        tie_word_embeddings=False,
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c["rope_theta"],
            "partial_rotary_factor": c["partial_rotary_factor"],
        },
        attn_implementation="eager",
    )
    ref = Glm4MoeForCausalLM(cfg).eval()
    ours = random_state(raw, seed)
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    st = {
        "model.embed_tokens.weight": ours["embed_tokens.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["lm_head.weight"],
    }
    for i in range(c["num_hidden_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        w = ours[p + "self_attn.query_key_value.weight"]
        st[q + "self_attn.q_proj.weight"], st[q + "self_attn.k_proj.weight"], st[q + "self_attn.v_proj.weight"] = (
            w.split([heads * d, kv * d, kv * d], 0)
        )
        st[q + "self_attn.o_proj.weight"] = ours[p + "self_attn.dense.weight"]
        st[q + "self_attn.q_norm.weight"] = ours[p + "self_attn.query_layernorm.weight"]
        st[q + "self_attn.k_norm.weight"] = ours[p + "self_attn.key_layernorm.weight"]
        for n in ("input_layernorm", "post_attention_layernorm"):
            st[q + n + ".weight"] = ours[p + n + ".weight"]
        if i < c["first_k_dense_replace"]:
            for n in ("gate_proj", "up_proj", "down_proj"):
                st[q + f"mlp.{n}.weight"] = ours[p + f"mlp.{n}.weight"]
            continue
        st[q + "mlp.gate.weight"] = ours[p + "mlp.gate.weight"]
        st[q + "mlp.gate.e_score_correction_bias"] = ours[p + "mlp.expert_bias"]
        e = range(c["num_experts"])
        st[q + "mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([ours[p + f"mlp.experts.{j}.gate_proj.weight"], ours[p + f"mlp.experts.{j}.up_proj.weight"]])
                for j in e
            ]
        )
        st[q + "mlp.experts.down_proj"] = torch.stack([ours[p + f"mlp.experts.{j}.down_proj.weight"] for j in e])
        for n in ("gate_proj", "up_proj", "down_proj"):
            st[q + f"mlp.shared_experts.{n}.weight"] = ours[p + f"shared_expert.{n}.weight"]
    missing, unexpected = ref.load_state_dict(st, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    if c.get("use_bias", True):  # Glm4Moe's o_proj has no bias: give it ours
        for i, layer in enumerate(ref.model.layers):
            layer.self_attn.o_proj.bias = torch.nn.Parameter(ours[f"layers.{i}.self_attn.dense.bias"].clone())
    return ref


def upstream_gate(x, weight, bias, top_k, n_group, topk_group, scale):
    """Test-side transcription of the Hub ``LLaDA2MoeGate.forward`` (+ ``group_limited_topk``): returns (idx, w)."""
    logits = torch.nn.functional.linear(x.float(), weight.float())
    scores = torch.sigmoid(logits)
    routing = scores + bias
    n = routing.shape[0]
    gs = routing.view(n, n_group, -1).topk(2, dim=-1)[0].sum(-1)
    gi = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    gm = torch.zeros_like(gs).scatter_(1, gi, 1)
    sm = gm.unsqueeze(-1).expand(n, n_group, routing.shape[1] // n_group).reshape(n, -1)
    _, idx = torch.topk(routing.masked_fill(~sm.bool(), float("-inf")), k=top_k, dim=-1)
    s = torch.gather(scores, 1, idx)
    w = s / (s.sum(-1, keepdim=True) + 1e-20) if top_k > 1 else s
    return idx, w * scale
