"""Strict checkpoint loading (issue 40 item 4): every tensor of a checkpoint is read by the model or is known to be
ignorable by its architecture's ``CHECKPOINT_RULES``; any other tensor is a one-line load error naming it and the
config.json field that would read it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from arch_baby import BABY
from localdiff.arch import get_arch, get_spec
from localdiff.errors import CheckpointError
from localdiff.loader import load_model


def _write(folder, raw, seed=0):
    """A baby checkpoint of ``raw`` in its checkpoint layout: (state dict as saved, its folder)."""
    spec, mod = get_spec(raw), get_arch(raw)
    g = torch.Generator().manual_seed(seed)
    state = {mod.checkpoint_names(t.name)[0]: 0.1 * torch.randn(t.shape, generator=g) for t in spec.tensor_shapes(raw)}
    folder.mkdir(exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return state


def _add(folder, extra: dict, state: dict):
    save_file({**state, **extra}, str(folder / "model.safetensors"))


def _error(folder) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(folder, dtype=torch.float32)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("model_type", sorted(BABY))
def test_a_stray_tensor_is_a_one_line_error_and_a_rotary_cache_is_not(model_type, tmp_path):
    raw = BABY[model_type]
    state = _write(tmp_path, raw)
    load_model(tmp_path, dtype=torch.float32)  # the checkpoint as written loads
    first = next(iter(state))
    prefix = first[: first.index("layers.")] if "layers." in first else ""
    _add(tmp_path, {f"{prefix}layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, state)
    load_model(tmp_path, dtype=torch.float32)  # a rotary cache is ignorable
    _add(tmp_path, {"model.stray_proj.weight": torch.ones(3, 3)}, state)
    msg = _error(tmp_path)
    assert "model.stray_proj.weight is in the checkpoint but" in msg and "model.safetensors" in msg


def test_llada_moe_qk_norm_without_qk_layernorm_names_the_field(tmp_path):
    raw = BABY["lladamoe"]
    _write(tmp_path, raw)
    load_model(tmp_path, dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "qk_layernorm"}))
    msg = _error(tmp_path)
    assert msg.endswith(
        "model.layers.0.self_attn.k_norm.weight is in the checkpoint but config.json has no "
        "qk_layernorm: true; 5 more unread tensor(s)"
    ), msg
    (tmp_path / "config.json").write_text(json.dumps({**raw, "qk_layernorm": False}))
    assert "config.json has qk_layernorm: false, not true" in _error(tmp_path)


def test_llada_untied_head_without_weight_tying_names_the_field(tmp_path):
    raw = BABY["llada"]  # weight_tying: false → a separate ff_out head
    _write(tmp_path, raw)
    load_model(tmp_path, dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "weight_tying"}))
    msg = _error(tmp_path)
    assert msg.endswith(
        "model.transformer.ff_out.weight is in the checkpoint but config.json has no weight_tying: "
        "false (it differs from model.transformer.wte.weight, which it would be tied to)"
    ), msg


@pytest.mark.parametrize(
    "model_type,head,embed",
    [
        ("a2d-qwen3", "lm_head.weight", "model.embed_tokens.weight"),
        ("llada2_moe", "lm_head.weight", "model.word_embeddings.weight"),
    ],
)
def test_a_tied_head_copy_loads_only_when_equal_to_the_embeddings(model_type, head, embed, tmp_path):
    raw = {**BABY[model_type], "tie_word_embeddings": True}
    state = _write(tmp_path, raw)
    assert head not in state
    _add(tmp_path, {head: state[embed].clone()}, state)
    load_model(tmp_path, dtype=torch.float32)  # an equal copy, as transformers ties it
    _add(tmp_path, {head: state[embed] + 1}, state)
    msg = _error(tmp_path)
    assert f"{head} is in the checkpoint but config.json has tie_word_embeddings: true, not false" in msg
    assert f"differs from {embed}" in msg


def test_diffusion_gemma_encoder_copies_and_vision_tower(tmp_path):
    raw = BABY["diffusion_gemma"]
    state = _write(tmp_path, raw)
    enc = {
        k.replace("model.decoder.", "model.encoder.language_model."): v.clone()
        for k, v in state.items()
        if k.startswith("model.decoder.layers.1.") and not k.endswith("layer_scalar")
    }
    vision = {
        "model.encoder.vision_tower.encoder.layers.0.mlp.fc1.weight": torch.ones(2, 2),
        "model.encoder.embed_vision.embedding_projection.weight": torch.ones(2, 2),
    }
    _add(tmp_path, {**enc, **vision}, state)
    load_model(tmp_path, dtype=torch.float32)  # tied copies equal, vision tower skipped
    bad = dict(enc)
    name = next(iter(bad))
    bad[name] = bad[name] + 1
    _add(tmp_path, bad, state)
    msg = _error(tmp_path)
    assert f"{name} is in the checkpoint but" in msg and "differs from model.decoder.layers.1." in msg
