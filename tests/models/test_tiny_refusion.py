"""The shipped tiny-refusion (trained here, models/tiny-refusion/recipe): loads from the catalog in ReFusion's
upstream layout (transformers' Qwen3ForCausalLM reads the same folder), and its default decoding equals the
transcription of upstream generate_refusion on that model."""

from __future__ import annotations

import torch

import localdiff
from localdiff.hub.catalog import lookup
from upstream_refusion import generate_refusion


def test_tiny_refusion_ships_and_decodes_as_upstream():
    from transformers import Qwen3ForCausalLM

    e = lookup("tiny-refusion")
    assert e is not None and e.embedded
    m = localdiff.load("tiny-refusion")
    assert m.family == "slots" and m.mask_token_id == 6
    opts = m.sampler_options()
    hf = Qwen3ForCausalLM.from_pretrained(str(e.embedded_path), dtype=torch.float32).eval()
    eot = 5  # <end_of_turn>: the answers' end in training (the transcription takes one EOS id)
    for prompt in ("What is 41 + 93?", "Reverse the letters: d r a g o n"):
        g = m.generate(prompt, max_new_tokens=32)
        ids = m.encode_prompt(prompt)[0]
        ref = generate_refusion(
            hf,
            torch.tensor([ids]),
            32,
            6,
            eot,
            opts["slot_size"],
            opts["serial_num_blocks"],
            opts["slot_threshold"],
            opts["token_threshold"],
        )[0][0, len(ids) :].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in (1, 5)), len(ref))
        assert g.token_ids == ref[:cut], prompt
