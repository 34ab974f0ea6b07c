"""``localdiff bench --only slots``: ReFusion (arXiv 2512.13586) — plan-and-infill decoding vs the same model's
autoregressive decoding, and the reordered cache's memory.

* **tiny-refusion** (when shipped): held-out exact match (the embedded eval set, ``models/tiny/eval.jsonl``), tokens
  per forward and tokens/s of ReFusion decoding (its generation_config settings and upstream's default thresholds) vs greedy
  left-to-right decoding of the same weights (:func:`localdiff.decoding.refusion.autoregressive`: ReFusion's AR
  mode, the first token read at a mask; and plain causal decoding), item by item, interleaved. Target (#19): TPF ≥ 2
  within 2 points of AR accuracy.
* **random Qwen3-proportioned model** sized for this machine (Qwen3-8B's shape ratios: head dim 128, 4 query heads
  per key/value head, SwiGLU 3× hidden; hidden 512, 8 layers, vocabulary 32,768; ~50M parameters): tokens/s and TPF
  of both decoders on the same prompts (random weights: the planner rarely finds confident slots, so this is the
  cost side of ReFusion's extra passes).
* **memory**: bytes of ReFusion's reordered K/V buffer (prompt + answer rows, all layers; measured from the tensors)
  vs what a masked-diffusion model of the same shape materialises: the K/V of the whole sequence recomputed every
  forward (no cache), or held approximately (Fast-dLLM dual cache). Tensor bytes, not allocator peaks.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

PROPORTIONED = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "vocab_size": 32768,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "mask_token_id": 32000,
    "eos_token_id": 32001,
    "pad_token_id": 32002,
    "bos_token_id": 32003,
}
STRICT = {"slot_size": 4, "slot_threshold": 0.9, "token_threshold": 0.9}  # generate_refusion's thresholds


def _ar(model, prompt: str, max_new: int, mask_first: bool) -> dict:
    from localdiff.decoding.refusion import autoregressive

    ids = model.encode_prompt(prompt, chat=True)[0]
    t0 = time.perf_counter()
    toks, fw = autoregressive(model.net, ids, max_new, model.eos_token_ids, model.mask_token_id if mask_first else None)
    sec = time.perf_counter() - t0
    text = model.tokenizer.decode([t for t in toks if t not in model.eos_token_ids]) if model.tokenizer else ""
    return {"tokens": len(toks), "forwards": fw, "seconds": sec, "text": text}


def _rf(model, prompt, max_new: int, opts: dict) -> dict:
    g = model.generate(prompt, max_new_tokens=max_new, seed=0, **opts)
    return {"tokens": g.stats.new_tokens, "forwards": g.stats.forwards, "seconds": g.stats.seconds, "text": g.text}


def compare(model, items: list[dict], max_new: int, settings: dict, log=print) -> dict:
    """Per decoder — "autoregressive" (left to right, one token per forward, the first token read at a mask:
    ReFusion's own AR mode, :func:`localdiff.decoding.refusion.autoregressive`), "causal" (plain next-token
    decoding from the prompt's last row) and each named ReFusion setting: accuracy (when items have answers), TPF,
    tokens/s (total tokens / total seconds) and the median / range of per-item tokens/s. Items run interleaved."""
    from localdiff.bench.eval_tasks import exact_match

    runs = {"autoregressive": [], "causal": []} | {name: [] for name in settings}
    for it in items:
        runs["autoregressive"].append(_ar(model, it["prompt"], max_new, True) | {"answer": it.get("answer")})
        runs["causal"].append(_ar(model, it["prompt"], max_new, False) | {"answer": it.get("answer")})
        for name, opts in settings.items():
            runs[name].append(_rf(model, it["prompt"], max_new, opts) | {"answer": it.get("answer")})
    out = {}
    for name, rs in runs.items():
        toks, fw, sec = (sum(r[k] for r in rs) for k in ("tokens", "forwards", "seconds"))
        per = [r["tokens"] / r["seconds"] for r in rs if r["seconds"] > 0]
        row = {
            "options": settings.get(name, {}),
            "items": len(rs),
            "tokens": toks,
            "forwards": fw,
            "tokens_per_forward": toks / max(fw, 1),
            "tokens_per_second": toks / sec if sec else 0.0,
            "tokens_per_second_median": statistics.median(per) if per else 0.0,
            "tokens_per_second_range": [min(per), max(per)] if per else [0.0, 0.0],
        }
        if all(r["answer"] is not None for r in rs):
            row["accuracy"] = sum(exact_match(r["text"], r["answer"]) for r in rs) / max(len(rs), 1)
        out[name] = row
        acc = f"accuracy {row['accuracy']:.3f}, " if "accuracy" in row else ""
        log(
            f"slots: {name}: {acc}TPF {row['tokens_per_forward']:.2f}, {row['tokens_per_second']:.1f} tokens/s "
            f"(median {row['tokens_per_second_median']:.1f})"
        )
    return out


def memory(net, prompt_len: int = 256, answer: int = 256) -> dict:
    """Bytes of ReFusion's K/V buffer for prompt + answer vs a same-shape masked model's per-forward recompute."""
    import torch

    cache = net.new_slot_cache(prompt_len + answer)
    cache.commit([0] * (prompt_len + answer), list(range(prompt_len + answer)))
    a, n = net.config, prompt_len + answer
    per_pass = (
        a.num_hidden_layers
        * 2
        * a.num_key_value_heads
        * a.head_dim
        * n
        * torch.finfo(net.embed_tokens.weight.dtype).bits
        // 8
    )
    return {
        "sequence_tokens": n,
        "refusion_cache_bytes": cache.nbytes,
        "refusion_buffer_bytes": cache.buffer_bytes,
        "masked_recompute_kv_bytes_per_forward": per_pass,
        "masked_dual_cache_bytes": per_pass,
        "note": "ReFusion keeps exact K/V once; a masked model recomputes the same K/V every forward (none) or "
        "holds an approximate copy (dual)",
    }


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (module docstring)."""
    import torch

    import localdiff
    from localdiff.bench.eval_tasks import load_items
    from localdiff.bench.masked import build_random

    res = {}
    try:
        tiny = localdiff.load("tiny-refusion")
    except Exception as e:  # not shipped in this build: say so, measure the rest
        res["tiny_refusion"] = {"skipped": f"tiny-refusion not available ({e})"}
    else:
        items = load_items(Path(tiny.path).parent / "tiny" / "eval.jsonl", 3 if quick else 20)
        res["tiny_refusion"] = {
            "items": len(items),
            "decoders": compare(tiny, items, 32, {"refusion": {}, "refusion strict": STRICT}, log),
        }
    with tempfile.TemporaryDirectory(prefix="localdiff-bench-refusion-") as d:
        path = build_random(Path(d), PROPORTIONED)
        m = localdiff.load(str(path))
        n = sum(p.numel() for p in m.net.parameters())
        log(f"slots: random Qwen3-proportioned model ({n / 1e6:.0f}M parameters)")
        prompts = [{"prompt": [5 + i, 6, 7, 8] * 8} for i in range(2 if quick else 4)]
        with torch.inference_mode():
            res["proportioned"] = {
                "config": PROPORTIONED,
                "parameters": n,
                "decoders": compare(m, prompts, 32 if quick else 64, {"refusion": {"slot_size": 8}}, log),
                "memory": memory(m.net),
            }
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = ["## Slots family (ReFusion): plan-and-infill vs autoregressive decoding", ""]
    for label, key in (
        ("tiny-refusion (held-out eval items)", "tiny_refusion"),
        ("random Qwen3-proportioned model", "proportioned"),
    ):
        s = sec.get(key, {})
        if "skipped" in s:
            lines += [f"{label}: skipped ({s['skipped']})", ""]
            continue
        if not s.get("decoders"):
            continue
        lines += [
            f"{label}:",
            "",
            "| decoder | accuracy | TPF | tokens/s | per-item median (range) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in s["decoders"].items():
            acc = f"{r['accuracy']:.3f}" if "accuracy" in r else "–"
            lo, hi = r["tokens_per_second_range"]
            lines.append(
                f"| {name} {json.dumps(r['options']) if r['options'] else ''} | {acc} | "
                f"{r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
                f"{r['tokens_per_second_median']:.1f} ({lo:.1f}–{hi:.1f}) |"
            )
        lines.append("")
    mem = sec.get("proportioned", {}).get("memory")
    if mem:
        lines += [
            f"Memory at {mem['sequence_tokens']} tokens: ReFusion K/V cache {mem['refusion_cache_bytes'] / 2**20:.1f}"
            f" MiB held once; a masked model recomputes {mem['masked_recompute_kv_bytes_per_forward'] / 2**20:.1f}"
            " MiB of K/V every forward (or holds it approximately: dual cache).",
            "",
        ]
    return lines
