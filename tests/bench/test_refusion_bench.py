"""The `slots` bench section's pieces on a tiny checkpoint (speed numbers come from `localdiff bench`, never from
tests): the decoder comparison counts what each decoder returned, and the memory figures are the tensors' bytes."""

from __future__ import annotations

import torch

import localdiff
from localdiff.bench.run import SECTIONS
from localdiff.bench.slots import compare, memory, render_md
from localdiff.decoding.refusion import autoregressive
from refusion_ckpt import build_hf, save_upstream


def test_compare_and_memory(tmp_path):
    save_upstream(build_hf(3, scale=5.0), tmp_path)
    m = localdiff.load(str(tmp_path))
    items = [{"prompt": [3, 4, 5, 6]}, {"prompt": [7, 8, 9]}]
    res = compare(m, items, 12, {"refusion": {"slot_size": 4, "serial_num_blocks": 1}}, log=lambda s: None)
    ar, causal, rf = res["autoregressive"], res["causal"], res["refusion"]
    for row, mask in ((ar, m.mask_token_id), (causal, None)):
        toks = [autoregressive(m.net, it["prompt"], 12, m.eos_token_ids, mask)[0] for it in items]
        assert row["tokens"] == sum(map(len, toks)) and row["forwards"] == row["tokens"]  # one token per forward
    assert rf["tokens"] == sum(
        len(m.generate(it["prompt"], max_new_tokens=12, slot_size=4, serial_num_blocks=1).token_ids) for it in items
    )
    mem = memory(m.net, 10, 6)
    a = m.net.config
    assert mem["refusion_cache_bytes"] == a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 16 * 4
    assert "slots" in SECTIONS
    md = "\n".join(render_md({"proportioned": {"decoders": res, "memory": mem}}))
    assert "| autoregressive" in md and "refusion" in md and "MiB" in md


def test_autoregressive_modes_match_full_causal_passes(tmp_path):
    """Greedy decoding over the K/V buffer = argmax of uncached full passes (transformers' Qwen3), both modes."""
    from refusion_ckpt import MASK

    hf = build_hf(4, scale=5.0)
    save_upstream(hf, tmp_path)
    m = localdiff.load(str(tmp_path))
    prompt = [3, 4, 5, 6, 7]
    for mask in (None, MASK):
        seq, out = list(prompt), []
        for i in range(6):
            ids = seq + ([mask] if mask is not None and i == 0 else [])
            with torch.no_grad():
                out.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            seq.append(out[-1])
        assert autoregressive(m.net, prompt, 6, [-1], mask) == (out, 6)
