"""The model contract (localdiff/arch/base.py), checked for every registered architecture on a baby config:
spec tensors = the built module's tensors, declared roles are implemented, forward shapes, save → load → same
logits, and unknown model types give one line listing the supported ones (like mlx-lm's shared model test runner)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from arch_baby import BABY
from localdiff.arch import REGISTRY, get_arch, get_spec, supported
from localdiff.arch.base import ROLE_DENOISE, ROLE_DRAFT, ROLE_LOGITS, ROLE_PREFILL, ROLE_WINDOW, ROLES
from localdiff.cache.kv import KVCache
from localdiff.errors import CheckpointError
from localdiff.loader import load_config, load_model


def test_every_registered_architecture_has_a_baby_config():
    assert sorted(BABY) == supported()


def _build(raw, seed=0):
    mod, spec = get_arch(raw), get_spec(raw)
    torch.manual_seed(seed)
    net = mod.MODEL_CLASS(spec.parse_config(raw)).eval()
    with torch.no_grad():    # every tensor set here (modules may leave some uninitialised); norms / scalars ≠ 1
        for name, p in list(net.named_parameters()) + list(net.named_buffers()):
            if p.is_floating_point():
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() <= 1 else 0.08 * torch.randn_like(p))
    return net


def _forward(net, ids):
    """Logits of every role the model declares, on the same ids (one canvas / window after a 5-token prompt)."""
    out = {}
    prompt, tail = ids[:, :5], ids[:, 5:]
    if ROLE_PREFILL in net.roles and ROLE_DENOISE in net.roles:
        cache = KVCache(**net.cache_layout())
        net.prefill(prompt, cache)
        out["denoise"] = net.denoise(tail, cache)
    if ROLE_LOGITS in net.roles:
        out["logits"] = net.logits_full(ids)
    if ROLE_WINDOW in net.roles:
        out["window"] = net.forward_window(ids, 0)
    if ROLE_PREFILL in net.roles and ROLE_DENOISE not in net.roles:   # causal: cached pass = uncached pass
        cache = KVCache(**net.cache_layout())
        a, _ = net.prefill(prompt, cache)
        b, _ = net.prefill(tail, cache)
        out["prefill"] = torch.cat([a, b], 1)
    if ROLE_DRAFT in net.roles:   # a DFlash draft: the target's embeddings / LM head and features are inputs
        g = torch.Generator().manual_seed(2)
        emb = torch.randn(net.config.vocab_size, net.config.hidden_size, generator=g)
        feats = torch.randn(ids.shape[0], 5, net.fc.in_features, generator=g)
        out["draft"] = net.draft(net.embed(tail, emb), feats, KVCache(**net.cache_layout()), emb)
    return out


@pytest.mark.parametrize("model_type", sorted(BABY))
def test_contract(model_type, tmp_path):
    raw = BABY[model_type]
    mod, spec = get_arch(raw), get_spec(raw)
    assert model_type in getattr(spec, "MODEL_TYPES", (spec.MODEL_TYPE,))
    assert spec.FAMILY == REGISTRY[model_type].family
    net = _build(raw)
    # one description: the spec's tensors are exactly the module's parameters and buffers
    ours = {n: tuple(t.shape) for n, t in list(net.named_parameters()) + list(net.named_buffers())
            if not n.startswith("_")}
    described = {t.name: tuple(t.shape) for t in spec.tensor_shapes(raw)}
    assert described == ours
    assert len(spec.layer_geometry(raw)) == len(net.layers)
    # roles: declared ⊆ known, and each declared role's method exists
    assert net.roles and set(net.roles) <= set(ROLES)
    methods = {ROLE_PREFILL: "prefill", ROLE_DENOISE: "denoise", ROLE_LOGITS: "logits_full", ROLE_WINDOW: "forward_window",
               ROLE_DRAFT: "draft"}
    for role in net.roles:
        assert callable(getattr(net, methods[role], None)), role
    vocab = spec.parse_config(raw).vocab_size
    ids = torch.randint(2, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    before = _forward(net, ids)
    assert before and all(v.shape[:2] in ((2, 6), (2, 11)) and v.shape[-1] == vocab and v.dtype == torch.float32
                          for v in before.values())
    # save in the checkpoint layout (first candidate name), load through the loader: same logits
    state = {mod.checkpoint_names(n)[0]: t.detach().clone().contiguous() for n, t in net.state_dict().items()
             if n in ours}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded, cfg = load_model(tmp_path, dtype=torch.float32)
    assert cfg.vocab_size == vocab
    after = _forward(loaded, ids)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-5)


def test_unknown_model_type_is_one_line_listing_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neo"}))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "'gpt_neo'" in msg and all(t in msg for t in supported())
