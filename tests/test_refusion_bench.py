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
    ar, rf = res["autoregressive"], res["refusion"]
    toks = [autoregressive(m.net, it["prompt"], 12, m.eos_token_ids)[0] for it in items]
    assert ar["tokens"] == sum(map(len, toks)) and ar["forwards"] == ar["tokens"]      # one token per forward
    assert rf["tokens"] == sum(len(m.generate(it["prompt"], max_new_tokens=12, slot_size=4,
                                              serial_num_blocks=1).token_ids) for it in items)
    mem = memory(m.net, 10, 6)
    a = m.net.config
    assert mem["refusion_cache_bytes"] == a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 16 * 4
    assert "slots" in SECTIONS
    md = "\n".join(render_md({"proportioned": {"decoders": res, "memory": mem}}))
    assert "| autoregressive" in md and "refusion" in md and "MiB" in md
