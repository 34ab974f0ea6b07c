"""The model contract (localdiff/arch/base.py), checked for every registered architecture on a baby config:
spec tensors = the built module's tensors, declared roles are implemented, forward shapes, save → load → same
logits, and unknown model types give one line listing the supported ones (like mlx-lm's shared model test runner)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from arch_baby import BABY, build_baby, forward_roles
from localdiff.arch import REGISTRY, get_arch, get_spec, supported
from localdiff.arch.base import ROLE_DENOISE, ROLE_DRAFT, ROLE_LOGITS, ROLE_PREFILL, ROLE_WINDOW, ROLES
from localdiff.errors import CheckpointError
from localdiff.loader import load_config, load_model


def test_every_registered_architecture_has_a_baby_config():
    assert sorted(BABY) == supported()


@pytest.mark.parametrize("model_type", sorted(BABY))
def test_contract(model_type, tmp_path):
    raw = BABY[model_type]
    mod, spec = get_arch(raw), get_spec(raw)
    assert model_type in getattr(spec, "MODEL_TYPES", (spec.MODEL_TYPE,))
    assert spec.FAMILY == REGISTRY[model_type].family
    net = build_baby(raw)
    # one description: the spec's tensors are exactly the module's parameters and buffers
    ours = {
        n: tuple(t.shape) for n, t in list(net.named_parameters()) + list(net.named_buffers()) if not n.startswith("_")
    }
    described = {t.name: tuple(t.shape) for t in spec.tensor_shapes(raw)}
    assert described == ours
    assert len(spec.layer_geometry(raw)) == len(net.layers)
    # roles: declared ⊆ known, and each declared role's method exists
    assert net.roles and set(net.roles) <= set(ROLES)
    methods = {
        ROLE_PREFILL: "prefill",
        ROLE_DENOISE: "denoise",
        ROLE_LOGITS: "logits_full",
        ROLE_WINDOW: "forward_window",
        ROLE_DRAFT: "draft",
    }
    for role in net.roles:
        assert callable(getattr(net, methods[role], None)), role
    vocab = spec.parse_config(raw).vocab_size
    ids = torch.randint(2, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    before = forward_roles(net, ids)
    assert before and all(
        v.shape[:2] in ((2, 6), (2, 11)) and v.shape[-1] == vocab and v.dtype == torch.float32 for v in before.values()
    )
    # save in the checkpoint layout (first candidate name), load through the loader: same logits
    state = {
        mod.checkpoint_names(n)[0]: t.detach().clone().contiguous() for n, t in net.state_dict().items() if n in ours
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded, cfg = load_model(tmp_path, dtype=torch.float32)
    assert cfg.vocab_size == vocab
    after = forward_roles(loaded, ids)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-5)


def test_unknown_model_type_is_one_line_listing_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neo"}))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "'gpt_neo'" in msg and all(t in msg for t in supported())
