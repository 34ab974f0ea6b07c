"""``localdiff bench --only scale`` on the smoke shape: four sides interleaved, per-repetition ratios, FLOPs by
component, per-group peak memory, and the markdown renders."""

from __future__ import annotations

import pytest

from localdiff.bench import scale


def test_scale_section_smoke():
    out = scale.measure(True, steps=1, reps=1, sizes=["smoke"], log=lambda *_: None)
    s = out["sizes"][0]
    assert set(s["runs"]) == {"localdiff default", "localdiff float32", "reference bfloat16", "reference float32"}
    assert s["ratio_best_per_rep"]["n"] == 1 and s["ratio_best_per_rep"]["min"] > 0
    assert s["flops_per_step"] == sum(s["flops_by_component"].values()) > 0
    assert s["flops_per_step_real_vocab"] > s["flops_per_step"]
    assert [g["sides"] for g in s["group_peak_rss"]] == [list(s["runs"])]
    assert all(g["peak_rss_bytes"] > 0 for g in s["group_peak_rss"])
    ref = s["runs"]["reference float32"]["flops_check"]
    assert ref["ratio"] == pytest.approx(1.0, rel=1e-9)  # the reference computes what the shapes say
    assert s["runs"]["localdiff float32"]["flops_check"]["counted"]["LM head"] == ref["counted"]["LM head"]
    if s["runs"]["localdiff default"]["dtype"] == "bfloat16":
        roof = s["roofline"]
        # (a bound of 1 is compute-bound: the experts at the smoke shape are on a CPU whose bf16 GEMM peak is low
        # next to its bandwidth, e.g. AVX512-BF16 without AMX; bandwidth-bound, < 1, where AMX is fast)
        assert 0 < roof["reachable"] <= 1 and 0 < roof["components"]["experts"]["bound"] <= 1
    text = "\n".join(scale.render_md(out))
    assert "per repetition median" in text and "Peak RSS" in text and "counted ÷ arithmetic" in text


def test_flops_per_step_by_arithmetic():
    text = scale.text_config(*scale.SHAPES["150M"])
    f = scale.flops_per_step(text)
    v, h = text["vocab_size"], text["hidden_size"]
    assert f["LM head"] == f["self-conditioning product"] == 2 * v * h * scale.CANVAS
    real = scale.flops_per_step(text, vocab=scale.REAL_VOCAB)
    assert real["LM head"] == 8 * f["LM head"] and real["experts"] == f["experts"]
    pad = scale.expert_padding(text)
    assert 1.0 < pad < text["num_experts"] / text["top_k_experts"]
