"""Tiny upstream-layout checkpoints for the causal family and DFlash: a Qwen3 / Llama target written by
transformers' own ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` (``save_pretrained``: config.json + safetensors names
as on the Hub), and a DFlash draft in z-lab's layout (Qwen3 config.json with ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers``, ``dflash_config``; tensors ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``).
Odd sizes. Used by tests/arch/test_causal.py and tests/decoding/test_dflash.py."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

VOCAB, MASK, EOS = 97, 96, 95


def target_config(kind: str = "qwen3", layers: int = 5) -> dict:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=56,
        num_hidden_layers=layers,
        num_attention_heads=5,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=EOS,
        bos_token_id=1,
        rms_norm_eps=1e-6,
    )
    if kind == "qwen3":
        return dict(
            common,
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            head_dim=12,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    return dict(
        common,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    )


def write_target(folder, kind: str = "qwen3", layers: int = 5, seed: int = 0):
    """Write a random target with transformers; returns the transformers model (eval, fp32)."""
    import transformers

    raw = target_config(kind, layers)
    cfg_cls = transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig
    cls = transformers.Qwen3ForCausalLM if kind == "qwen3" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    ref = cls(cfg_cls(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, input-dependent logits
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15 if "embed" not in name else 1.0)
    ref.config._attn_implementation = "sdpa"
    ref.save_pretrained(folder, safe_serialization=True)
    return ref


def draft_config(target: dict, layers: int = 2, block_size: int = 6, layer_ids=None) -> dict:
    raw = dict(
        model_type="qwen3",
        architectures=["DFlashDraftModel"],
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=44,
        num_hidden_layers=layers,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=12,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        block_size=block_size,
        num_target_layers=target["num_hidden_layers"],
        dflash_config={"mask_token_id": MASK},
        attention_bias=False,
        tie_word_embeddings=False,
    )
    if layer_ids is not None:
        raw["dflash_config"]["target_layer_ids"] = list(layer_ids)
    return raw


def write_draft(folder, target: dict, layers: int = 2, block_size: int = 6, layer_ids=None, seed: int = 1) -> dict:
    """Write a random draft checkpoint in z-lab's layout; returns its config dict."""
    from localdiff.arch.dflash_spec import build_target_layer_ids

    raw = draft_config(target, layers, block_size, layer_ids)
    ids = layer_ids or build_target_layer_ids(target["num_hidden_layers"], layers)
    h, i, d = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: 0.15 * torch.randn(*s, generator=g)  # noqa: E731
    one = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    t = {"fc.weight": rnd(h, len(ids) * h), "hidden_norm.weight": one(h), "norm.weight": one(h)}
    for n in range(layers):
        p = f"layers.{n}."
        t.update(
            {
                p + "self_attn.q_proj.weight": rnd(q, h),
                p + "self_attn.k_proj.weight": rnd(kv, h),
                p + "self_attn.v_proj.weight": rnd(kv, h),
                p + "self_attn.o_proj.weight": rnd(h, q),
                p + "self_attn.q_norm.weight": one(d),
                p + "self_attn.k_norm.weight": one(d),
                p + "mlp.gate_proj.weight": rnd(i, h),
                p + "mlp.up_proj.weight": rnd(i, h),
                p + "mlp.down_proj.weight": rnd(h, i),
                p + "input_layernorm.weight": one(h),
                p + "post_attention_layernorm.weight": one(h),
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return raw


# -- a compact test-side transcription of z-lab/dflash ``dflash/model.py`` (PyPI dflash 0.1.0) ---------------------
# (its package pins datasets / requests / tqdm, so CI does not install it; tests/decoding/test_dflash.py also checks this
# transcription against the package itself when it is importable). Built on transformers' own Qwen3 modules, as
# upstream: Qwen3RMSNorm, Qwen3MLP, Qwen3RotaryEmbedding, rotate_half, DynamicCache with crop.
def _sampling_probs(logits, temperature, top_p=1.0, top_k=0):
    scores = logits.float() / temperature
    indices = None
    if 0 < top_k < scores.shape[-1]:
        scores, indices = torch.topk(scores, top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs * (sorted_probs.cumsum(dim=-1) - sorted_probs < top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
    return probs


def _sample_probs(probs):
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def _sample(logits, temperature, top_p, top_k):
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    return _sample_probs(_sampling_probs(logits, temperature, top_p, top_k))


def _rejection_sample(draft_tokens, target_probs, draft_probs):
    gamma = draft_tokens.shape[1]
    p = target_probs[:, :gamma].gather(-1, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    accepted = (torch.rand_like(q) * q < p).to(torch.int32).cumprod(-1).sum(-1)[0].item()
    if accepted == gamma:
        return accepted, _sample_probs(target_probs[:, -1])[0]
    residual = target_probs[0, accepted].clone()
    residual.sub_(draft_probs[0, accepted])
    residual.clamp_min_(0)
    total = residual.sum()
    residual = torch.where(
        total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), target_probs[0, accepted]
    )
    return accepted, _sample_probs(residual[None])[0]


class RefDraft(torch.nn.Module):
    """``DFlashDraftModel`` (v1) transcribed: Qwen3 layers whose K/V read [target context ; noise block]."""

    def __init__(self, raw: dict):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

        keep = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dflash_config")}
        cfg = Qwen3Config(**keep)
        self.cfg, nn = cfg, torch.nn
        h, d = cfg.hidden_size, cfg.head_dim
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            att = nn.Module()
            att.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
            att.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            att.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            att.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
            att.q_norm, att.k_norm = Qwen3RMSNorm(d, cfg.rms_norm_eps), Qwen3RMSNorm(d, cfg.rms_norm_eps)
            layer.self_attn, layer.mlp = att, Qwen3MLP(cfg)
            layer.input_layernorm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
            layer.post_attention_layernorm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
            self.layers.append(layer)
        dc = raw["dflash_config"]
        from localdiff.arch.dflash_spec import build_target_layer_ids

        self.target_layer_ids = dc.get("target_layer_ids") or build_target_layer_ids(
            raw["num_target_layers"], cfg.num_hidden_layers
        )
        self.norm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
        self.block_size, self.mask_token_id = raw["block_size"], dc["mask_token_id"]

    def forward(self, position_ids, noise_embedding, target_hidden, past_key_values):
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        x = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, q_len = x.shape[:2]
        ctx_len = target_hidden.shape[1]
        d = self.cfg.head_dim
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            res = x
            hs = layer.input_layernorm(x)
            q = att.q_norm(att.q_proj(hs).view(b, q_len, -1, d)).transpose(1, 2)
            k = torch.cat([att.k_proj(target_hidden), att.k_proj(hs)], 1).view(b, ctx_len + q_len, -1, d)
            v = torch.cat([att.v_proj(target_hidden), att.v_proj(hs)], 1).view(b, ctx_len + q_len, -1, d)
            k, v = att.k_norm(k).transpose(1, 2), v.transpose(1, 2)
            q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
            k = k * cos + rotate_half(k) * sin
            k, v = past_key_values.update(k, v, i)
            rep = q.shape[1] // k.shape[1]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            )
            x = res + att.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def load_ref_draft(folder) -> RefDraft:
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    m = RefDraft(raw)
    m.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    return m.eval()


@torch.inference_mode()
def ref_generate(
    draft, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0, top_p=1.0, top_k=0, block_size=None
):
    """``dflash_generate`` transcribed (v1 draft, batch 1): (output ids LongTensor[1, P + new], acceptance
    lengths list[int])."""
    from transformers import DynamicCache

    def crop(cache, n):  # upstream _crop_to: transformers 5 crops by a negative count
        cache.crop(-(cache.get_seq_length() - n))

    def make(config):
        c = DynamicCache(config=config)
        c.activate_past_recording()
        return c

    n_in = input_ids.shape[1]
    max_length = n_in + max_new_tokens
    block_size = draft.block_size if block_size is None else block_size
    out_ids = torch.full((1, max_length + 1), MASK if draft is None else draft.mask_token_id, dtype=torch.long)
    pos = torch.arange(out_ids.shape[1]).unsqueeze(0)
    tcache, dcache = make(target.config), (make(draft.cfg) if draft is not None else None)
    o = target(
        input_ids,
        position_ids=pos[:, :n_in],
        past_key_values=tcache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
    )
    out_ids[:, :n_in] = input_ids
    out_ids[:, n_in : n_in + 1] = _sample(o.logits, temperature, top_p, top_k)
    feat = lambda hs: torch.cat([hs[i + 1] for i in draft.target_layer_ids], -1)  # noqa: E731
    if block_size > 1:
        target_hidden = feat(o.hidden_states)
    lengths, start = [], n_in
    stops = torch.tensor(stop_token_ids) if stop_token_ids is not None else None
    stopped = stops is not None and torch.isin(out_ids[:, start], stops).any()
    embed, head = target.get_input_embeddings().weight, target.lm_head
    while start + 1 < max_length and not stopped:
        vs = min(block_size, max_length - start)
        block = out_ids[:, start : start + vs].clone()
        if vs > 1:
            dh = draft(
                pos[:, start - target_hidden.shape[1] : start + vs],
                torch.nn.functional.embedding(block, embed),
                target_hidden,
                dcache,
            )[:, 1 - vs :, :]
            crop(dcache, start)
            dl = head(dh)
            if temperature > 0:
                dprobs = _sampling_probs(dl, temperature, top_p, top_k)
                block[:, 1:] = _sample_probs(dprobs)
            else:
                block[:, 1:] = torch.argmax(dl, dim=-1)
        o = target(
            block,
            position_ids=pos[:, start : start + vs],
            past_key_values=tcache,
            use_cache=True,
            output_hidden_states=vs > 1,
        )
        if temperature > 0:
            tprobs = _sampling_probs(o.logits, temperature, top_p, top_k)
            if vs > 1:
                acc, bonus = _rejection_sample(block[:, 1:], tprobs, dprobs)
            else:
                acc, bonus = 0, _sample_probs(tprobs[:, -1])[0]
        else:
            post = torch.argmax(o.logits, dim=-1)
            acc = (block[:, 1:] == post[:, :-1]).cumprod(dim=1).sum(dim=1)[0].item()
            bonus = post[:, acc][0]
        out_ids[:, start : start + acc + 1] = block[:, : acc + 1]
        out_ids[:, start + acc + 1] = bonus
        produced = min(acc + 1, max_length - start - 1)
        if stops is not None:
            hit = torch.isin(out_ids[0, start + 1 : start + produced + 1], stops).nonzero(as_tuple=True)[0]
            if hit.numel() > 0:
                produced, stopped = hit[0].item() + 1, True
        start += produced
        crop(tcache, start)
        lengths.append(produced)
        if vs > 1:
            target_hidden = feat(o.hidden_states)[:, :produced, :]
    return out_ids[:, : min(start + 1, max_length)], lengths


def force_acceptance(target_folder, draft_folder, push: float = 1.8, strength: float = 0.05, token: int = 7) -> None:
    """Make a random target + draft agree often, by construction. Both models' attention / MLP outputs are scaled
    by ``strength`` (their hidden state stays close to the input embedding), every embedding row of the target gets
    ``push`` added to hidden dimension 0, and the LM head's row ``token`` reads that dimension strongly: the target
    then predicts ``token`` after most tokens (after ``token`` itself too) and the draft — whose masked positions
    hold the pushed mask embedding — drafts mostly ``token``. Blocks are accepted in full once the target has
    reached ``token``, rejected around the other tokens: acceptance lengths between 1 and the block size."""
    from safetensors.torch import load_file

    def shrink(d):
        for k in d:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                d[k] = d[k] * strength

    tf = target_folder / "model.safetensors"
    t = load_file(str(tf))
    shrink(t)
    t["model.embed_tokens.weight"][:, 0] += push
    t["lm_head.weight"][token, 0] = 3.0
    save_file(t, str(tf), metadata={"format": "pt"})
    df = draft_folder / "model.safetensors"
    d = load_file(str(df))
    shrink(d)
    save_file(d, str(df))
