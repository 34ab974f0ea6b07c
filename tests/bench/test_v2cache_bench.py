"""``localdiff bench --only v2cache`` on a baby Fast-dLLM v2 shape: the three passes are timed, the sub-block pass's
logits are those the decoder gets, the served share counts real ``denoise_sub`` calls, and the table renders (speed
itself is the bench's business, never a test's)."""

from __future__ import annotations

import pytest
import torch

from localdiff.bench import v2cache as vb

BABY = dict(
    vb.FAST_DLLM_V2_1_5B,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=301,
    mask_token_id=300,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_section_times_the_three_passes_and_renders():
    res = vb.measure(True, log=lambda *_: None, config=BABY, dtype=torch.float32)
    r = res["history"]["512"]
    assert set(r["ms"]) == {"block_step", "capture_step", "sub_block_step"}
    assert r["sub_over_block"] == pytest.approx(r["ms"]["sub_block_step"] / r["ms"]["block_step"])
    # one token per step over 31 masks in 4 sub-blocks of 8: at least the block's first step and the first step of
    # sub-blocks 1-3 (their first position still a mask) are full passes
    assert 0 < res["served_share"] <= 27 / 31 + 1e-9
    md = "\n".join(vb.render_md(res))
    assert "| 512 |" in md and "sub-block / block" in md
