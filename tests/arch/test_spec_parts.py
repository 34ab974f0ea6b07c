"""The checks every Llama-shaped spec shares (localdiff/arch/spec_parts.py): a zero or non-dividing head count, a
mask id equal to the pad id or outside the vocabulary are one ValueError naming the field, for every spec that
parses those keys — never a ZeroDivisionError from ``hidden_size // num_attention_heads``."""

from __future__ import annotations

import copy

import pytest

from arch_baby import BABY
from localdiff.arch import get_spec

#: (registry key, the config.json key of the query-head count); DiffusionGemma's nested text_config is its own
HEADS = [(k, "n_heads" if k == "llada" else "num_attention_heads") for k in sorted(BABY) if k != "diffusion_gemma"]


@pytest.mark.parametrize("kind,key", HEADS)
def test_zero_heads_without_head_dim_is_a_named_value_error(kind, key):
    raw = copy.deepcopy(BABY[kind])
    raw.pop("head_dim", None)
    raw[key] = 0
    with pytest.raises(ValueError, match="num_attention_heads|head dim"):
        get_spec(raw).parse_config(raw)


@pytest.mark.parametrize("kind,key", HEADS)
def test_key_value_heads_must_divide_the_query_heads(kind, key):
    raw = copy.deepcopy(BABY[kind])
    raw["n_kv_heads" if kind == "llada" else "num_key_value_heads"] = 2  # every baby has 3..5 query heads, odd
    raw[key] = 3
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(3\) must be a positive multiple of the key/value "
        r"heads \(2\)",
    ):
        get_spec(raw).parse_config(raw)


@pytest.mark.parametrize("kind", ["llada", "Dream", "sdar", "llada2_moe", "refusion"])
def test_mask_id_equal_to_pad_or_outside_the_vocabulary(kind):
    raw = copy.deepcopy(BABY[kind])
    spec = get_spec(raw)
    mask = spec.parse_config(raw).mask_token_id
    with pytest.raises(ValueError, match=r"'mask_token_id' \(\d+\) equals 'pad_token_id': padding would read"):
        spec.parse_config({**raw, "pad_token_id": mask})
    with pytest.raises(ValueError, match=r"'mask_token_id' \(9999\) is outside the vocabulary \(vocab_size 131\)"):
        spec.parse_config({**raw, "mask_token_id": 9999})


def test_diffusion_gemma_zero_heads_without_head_dim_is_a_named_value_error():
    raw = copy.deepcopy(BABY["diffusion_gemma"])
    text = raw.get("text_config", raw)
    text.pop("head_dim", None)
    text["num_attention_heads"] = 0
    with pytest.raises(ValueError, match="num_attention_heads"):
        get_spec(raw).parse_config(raw)
