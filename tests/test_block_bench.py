"""``localdiff bench --only block`` on a baby SDAR shape: the four step timings, the same logits from both
implementations in fp32, and the Markdown table (speed itself is the bench's business, never a test's)."""
from __future__ import annotations

import torch

from localdiff.bench import block as bb

BABY = dict(bb.SDAR_1_7B, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=301, mask_token_id=300, eos_token_id=1, pad_token_id=0,
            bos_token_id=2)


def test_step_times_compare_the_same_model():
    net, ref = bb._build(BABY, torch.float32)
    r = bb.step_times(net, ref, 37, 1, torch.float32, log=lambda *_: None)
    assert r["max_abs_logit_diff"] < 1e-4
    assert set(r["ms"]) == {"localdiff_block", "localdiff_1tok", "transformers_block", "transformers_1tok"}
    sec = {"dtype": "float32", "threads": 1, "history": {"37": r}}
    md = "\n".join(bb.render_md(sec))
    assert "| 37 |" in md and "block/1-token" in md


def test_fastest_dtype_is_one_of_the_two():
    dt, ms = bb.fastest_dtype(log=lambda *_: None)
    assert dt in (torch.float32, torch.bfloat16) and set(ms) == {"float32", "bfloat16"}
