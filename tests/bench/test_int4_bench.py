"""``localdiff bench --only int4``'s parts that run in seconds: resident bytes count the quantized head copy, the
report renders targets met / not met, and the llama.cpp helper's stand-in vocabulary and missing-package reason."""

from __future__ import annotations

import copy

import torch

from arch_baby import BABY, build_baby
from localdiff.bench import gguf_qwen3
from localdiff.bench import int4 as bench_int4
from localdiff.bench.args import SECTIONS
from localdiff.quantize.apply import quantize_model
from localdiff.quantize.recipe import Recipe


def test_section_is_listed():
    assert "int4" in SECTIONS


def test_resident_bytes_count_the_head_copy_and_shrink():
    net = build_baby(BABY["sdar"]).to(torch.bfloat16)
    recipe = Recipe.from_dict(
        {"rules": [["*self_attn.?_proj", "int8"], ["*layers.*.mlp.*_proj", "int8"]], "head": "int8"}
    )
    q4 = quantize_model(copy.deepcopy(net), recipe, quant="int4")
    q8 = quantize_model(copy.deepcopy(net), recipe, quant="int8")
    head = net.head_weight()
    h4 = head.shape[0] * ((head.shape[1] + 63) // 64) * (32 + 4)  # codes + bf16 scale + fp16 zero
    h8 = head.shape[0] * (head.shape[1] + 2)
    assert bench_int4.resident(q4) - sum(t.numel() * t.element_size() for t in q4.state_dict().values()) == h4
    assert bench_int4.resident(q8) - sum(t.numel() * t.element_size() for t in q8.state_dict().values()) == h8
    assert bench_int4.resident(q4) < bench_int4.resident(q8) < bench_int4.resident(net) + h8


def test_render_reports_targets():
    steps = {
        "shape": "SDAR-1.7B",
        "history": 512,
        "cpu": "Test CPU",
        "steps": {
            k: {"median_ms": v, "range_ms": [v, v + 1], "runs": 3}
            for k, v in {
                "bf16 block": 300,
                "bf16 1tok": 280,
                "int4 block": 100,
                "int4 1tok": 60,
                "int8 block": 180,
                "int8 1tok": 120,
            }.items()
        },
        "resident_bytes": {"bf16": 100, "int4": 40, "int8": 60},
        "ratios": {"int4_over_int8_block": 0.56, "int4_over_bf16_resident": 0.4},
        "targets": {"int4 block step <= 0.6x int8 block step": True, "resident bytes <= 0.3x bf16": False},
        "kernels": {"int4": "k4", "int8": "k8"},
        "llama_cpp": {"skipped": "not installed"},
    }
    acc = {
        "model": "tiny",
        "n_items": 10,
        "rows": [{"seed": 0}],
        "mean_accuracy": {"float32": 0.5, "int4": 0.5},
        "int4_minus_float32": {"mean_pt": 0.0, "ci_pt": None},
        "int4_within_2pt": True,
    }
    md = "\n".join(bench_int4.render_md({"steps": steps, "accuracy": acc}))
    assert "Test CPU" in md and "| int4 block | 100.0 |" in md
    assert "int4 block step <= 0.6x int8 block step: met" in md and "resident bytes <= 0.3x bf16: NOT met" in md
    assert "llama.cpp: skipped (not installed)" in md and "within 2 points" in md


def test_render_reports_the_int8_activation_opt_in():
    """The int4 + int8 act rows (beside the exact int4 ones) with thread CPU time, their llama.cpp target and the
    tiny-bd eval line."""
    steps = {
        "shape": "SDAR-1.7B",
        "history": 512,
        "cpu": "Test CPU",
        "steps": {
            k: {"median_ms": v, "range_ms": [v, v + 1], "runs": 3, "cpu_median_ms": v - 0.5}
            for k, v in {"int4 1tok": 60, "int4+int8act 1tok": 48, "llama.cpp Q4_K_M 1tok": 70}.items()
        },
        "resident_bytes": {"bf16": 100, "int4": 40, "int8": 60},
        "ratios": {"int4_over_bf16_resident": 0.4, "int4_int8act_1tok_over_llama_q4km_1tok": 48 / 70},
        "targets": {"int4 + int8 act (opt-in) 1-token step <= 0.7x llama.cpp Q4_K_M": True},
        "kernels": {"int4": "k4", "int4+int8act": "kv", "int8": "k8"},
        "llama_cpp": {},
    }
    d = {"mean_pt": -0.25, "ci_pt": [-0.75, 0.25]}
    acc = {
        "model": "tiny-bd",
        "n_items": 436,
        "temperature": 0.5,
        "rows": [{"seed": 0}, {"seed": 1000}],
        "mean_accuracy": {"float32": 0.5, "int4": 0.49, "int4+int8act": 0.495},
        "int4_int8act_minus_float32": d,
        "int4_int8act_minus_int4": {"mean_pt": 0.1, "ci_pt": None},
    }
    md = "\n".join(bench_int4.render_md({"steps": steps, "accuracy_int8_act": acc}))
    assert "| int4+int8act 1tok | 48.0 | 48.0 … 49.0 | 47.5 |" in md and "| int4 1tok | 60.0 |" in md
    assert "int4 + int8 act (opt-in) 1-token step <= 0.7x llama.cpp Q4_K_M: met" in md
    assert "int4+int8act − fp32 -0.25 pt (95 % CI -0.75 … +0.25), − int4 +0.10 pt" in md
    acc8 = dict(acc, weights="int8", mean_accuracy={"float32": 0.5, "int8": 0.5, "int8+int8act": 0.49})
    acc8 |= {"int8_int8act_minus_float32": d, "int8_int8act_minus_int8": {"mean_pt": -0.5, "ci_pt": None}}
    md = "\n".join(bench_int4.render_md({"accuracy_int8_act_int8": acc8}))
    assert "int8-activation opt-in, int8 dense layers (tiny-bd, 436 items, 2 paired seeds" in md
    assert "int8+int8act − fp32 -0.25 pt (95 % CI -0.75 … +0.25), − int8 -0.50 pt" in md


def test_stand_in_vocabulary_is_the_byte_alphabet():
    a = gguf_qwen3._byte_alphabet()
    assert len(a) == len(set(a)) == 256 and a[ord("A")] == "A" and a[ord(" ")] == "Ġ" and a[ord("\n")] == "Ċ"


def test_stepper_without_llama_cpp_says_why(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "llama_cpp":
            raise ImportError("no llama_cpp", name="llama_cpp")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    why = gguf_qwen3.stepper(2, 8)
    assert isinstance(why, str) and "not installed" in why and "llama" in why.replace("-", "_")  # names what is missing


def test_canvas_part_runs_at_the_smoke_shape():
    from localdiff.bench import int4_dg

    r = int4_dg.canvas_steps(True, lambda *_: None, size="smoke", reps=1)
    assert {"bf16", "int4"} <= set(r["steps"]) <= {"bf16", "int4", "int4-exact"} and r["resident_bytes"]["int4"] < r[
        "resident_bytes"
    ]["bf16"]
    md = "\n".join(int4_dg.render_md(r))
    assert "| int4 |" in md and "target ≤ 0.75" in md
