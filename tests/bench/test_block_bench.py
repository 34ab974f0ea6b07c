"""``localdiff bench --only block`` on a baby SDAR shape: the four step timings, the same logits from both
implementations in fp32, and the Markdown table (speed itself is the bench's business, never a test's)."""

from __future__ import annotations

import torch

from localdiff.bench import block as bb

BABY = dict(
    bb.SDAR_1_7B,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=301,
    mask_token_id=300,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
)


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


def test_tokens_per_second_rows_and_int8_pass(monkeypatch):
    """The tokens/s part on the baby shape in bf16 (then int8): AR decodes one token per forward, static one per
    forward, forced the whole block per forward (TPF 4: every threshold passed); the projection multiplies the
    tiny-bd TPF (stubbed here: its eval is the bench's) by the static forwards/s; the tables render."""
    from localdiff.bench import block_tps

    tiny = {"threshold 0.85": {"tpf": 2.5, "accuracy": 0.5, "n": 9}, "one token per step": {"tpf": 1.0}}
    monkeypatch.setattr(block_tps, "tiny_bd_tpf", lambda *a, **k: tiny)
    res = bb.measure(True, log=lambda *_: None, config=BABY, dtype=torch.bfloat16)
    for prec in ("bfloat16", "int8"):
        rows = res["tokens_per_second"][prec]["rows"]
        assert rows["ar"]["tokens_per_forward"] == 1.0 and rows["static"]["tokens_per_forward"] == 1.0
        assert rows["forced"]["tokens_per_forward"] == 4.0 and rows["ar"]["new_tokens"] == 8
        assert rows["static"]["prefill_tokens_reused"] == 512  # the prompt came from the reused cache
    assert set(res["int8"]["512"]["ms"]) == {
        "localdiff_block",
        "localdiff_1tok",
        "transformers_block",
        "transformers_1tok",
    }
    md = "\n".join(bb.render_md(res))
    assert "Tokens/s, int8" in md and "6.1 tokens/s" in md and "int8 (bf16 act.)" in md
    t = res["tokens_per_second"]["bfloat16"]
    assert abs(t["projection"]["tokens_per_second"] - 2.5e3 / t["rows"]["static"]["ms_per_forward"]) < 1e-9
