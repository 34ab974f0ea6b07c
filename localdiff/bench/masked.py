"""``localdiff bench --only masked``: the masked family (LLaDA-style models) — cache modes and parallel decoding.

Two measurements, both on a random model with LLaDA-8B's proportions scaled to this machine (hidden 512, 8 layers,
4 heads of 128, SwiGLU 4/3·… ≈ 3× hidden as LLaDA's 12288/4096, vocabulary 32,768; ~50M parameters) and, when it
is installed, on the shipped ``tiny-mdm``:

* **step time per cache mode** at 256 and 1024 prompt tokens (answer 64, block 32): ``none`` = one bidirectional
  pass over prompt + answer (LLaDA), ``prefix`` = a pass over the answer from the current block on, reading the
  prompt's cached K/V, ``dual`` = a pass over the current block alone, reading cached K/V on both sides (Fast-dLLM,
  arXiv 2505.22618). Median of repeated forwards, interleaved. Target: dual ≥ 3× the no-cache step rate at 1k.
* **generation**: tokens/s and tokens per forward (TPF) for each cache mode × {one token per step, threshold 0.9}
  (``localdiff.generate`` end to end).
* **accuracy** (tiny-mdm only): held-out exact match and TPF per decoder setting (:data:`EVAL_SETTINGS`) on its
  eval set; targets: threshold decoding at TPF ≥ 2.5 within 1 point of one token per step, prefix / dual caches
  within 1 point of no cache; dInfer's threshold / credit / hierarchy decoders and its vicinity cache refresh beside
  Fast-dLLM's threshold rows.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

PROPORTIONED = {
    "model_type": "llada",
    "d_model": 512,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_layers": 8,
    "mlp_hidden_size": 1536,
    "vocab_size": 32768,
    "embedding_size": 32768,
    "max_sequence_length": 4096,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "include_bias": False,
    "weight_tying": False,
    "mask_token_id": 32000,
    "eos_token_id": 32001,
    "pad_token_id": 32002,
    "bos_token_id": 32003,
    "activation_type": "silu",
    "block_type": "llama",
    "layer_norm_type": "rms",
}


def build_random(folder: Path, config: dict = PROPORTIONED, seed: int = 0) -> Path:
    """A random-weight LLaDA-layout checkpoint (config.json + model.safetensors) in ``folder``."""
    import torch
    from safetensors.torch import save_file

    from localdiff.arch import get_arch, get_spec

    mod = get_arch(config)
    torch.manual_seed(seed)
    net = mod.MODEL_CLASS(get_spec(config).parse_config(config))
    state = {}
    for name, t in net.state_dict().items():
        t = torch.ones_like(t) if t.dim() == 1 else torch.randn_like(t) * 0.02
        state[mod.checkpoint_names(name)[0]] = t.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def step_times(net, prompt_lens=(256, 1024), answer: int = 64, block: int = 32, reps: int = 5, log=print) -> dict:
    """Median ms of one denoising forward per cache mode and prompt length (module docstring)."""
    import torch

    out = {}
    for p in prompt_lens:
        total = p + answer
        ids = torch.randint(0, net.config.vocab_size - 8, (1, total), generator=torch.Generator().manual_seed(p))
        _, kv = net.forward_window(ids, 0, None, None, return_kv=True)
        start = p + block  # the second block of the answer: prefix and suffix both present
        calls = {
            "none": lambda: net.logits_full(ids),
            "prefix": lambda: net.forward_window(
                ids[:, start:], start, [(k[:, :, :start], v[:, :, :start]) for k, v in kv]
            ),
            "dual": lambda: net.forward_window(ids[:, start : start + block], start, kv),
        }
        times = {k: [] for k in calls}
        for _ in range(reps):  # interleaved, so drift hits every mode alike
            for k, f in calls.items():
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[str(p)] = {
            "ms": med,
            "range_ms": {k: [min(v), max(v)] for k, v in times.items()},
            "speedup_vs_none": {k: med["none"] / med[k] for k in med},
        }
        log(f"masked: prompt {p}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
    return out


def generation(model, prompts: list[str], max_new_tokens: int, log=print) -> list[dict]:
    """tokens/s and TPF per (kv_cache, threshold) over ``prompts`` (seed 0, block 32 or the answer)."""
    rows = []
    for cache in ("none", "prefix", "dual"):
        for thr in (None, 0.9):
            toks = fw = 0
            sec = 0.0
            for pr in prompts:
                g = model.generate(pr, max_new_tokens=max_new_tokens, seed=0, kv_cache=cache, threshold=thr)
                toks, fw, sec = toks + g.stats.new_tokens, fw + g.stats.forwards, sec + g.stats.seconds
            rows.append(
                {
                    "kv_cache": cache,
                    "threshold": thr,
                    "tokens": toks,
                    "forwards": fw,
                    "tokens_per_forward": toks / max(fw, 1),
                    "tokens_per_second": toks / sec if sec else 0.0,
                }
            )
            log(
                f"masked: kv_cache={cache} threshold={thr}: TPF {rows[-1]['tokens_per_forward']:.2f}, "
                f"{rows[-1]['tokens_per_second']:.1f} tokens/s"
            )
    return rows


#: decoder settings of the tiny-mdm accuracy table (#15 targets; a 32-token answer): one token per step vs
#: Fast-dLLM threshold decoding with the answer as one block of 32 (the model's default block), and kv_cache none /
#: prefix / dual over blocks of 8 (with one block the caches hold only the prompt)
EVAL_SETTINGS = [
    ("block 32, one token per step", {"block_length": 32}),
    ("block 32, threshold 0.9", {"block_length": 32, "threshold": 0.9}),
    ("block 32, threshold 0.7", {"block_length": 32, "threshold": 0.7}),
    ("block 32, threshold 0.5", {"block_length": 32, "threshold": 0.5}),
    ("block 8, one token per step", {"block_length": 8}),
    ("block 8, prefix cache", {"block_length": 8, "kv_cache": "prefix"}),
    ("block 8, dual cache", {"block_length": 8, "kv_cache": "dual"}),
    ("block 8, threshold 0.7, dual cache", {"block_length": 8, "threshold": 0.7, "kv_cache": "dual"}),
]
#: dInfer's decoders (inclusionAI/dInfer, defaults: τ 0.9, low_threshold 0.3, credit α 0.7 γ 0.2 β 0.8, vicinity
#: 16 / 16 / 4 warmup steps, aligned blocks) beside Fast-dLLM threshold decoding (the rows above)
EVAL_SETTINGS += [
    ("block 32, dInfer threshold", {"block_length": 32, "parallel_decoding": "threshold", "start_block_align": True}),
    ("block 32, dInfer credit", {"block_length": 32, "parallel_decoding": "credit", "start_block_align": True}),
    ("block 32, dInfer hierarchy", {"block_length": 32, "parallel_decoding": "hierarchy", "start_block_align": True}),
    (
        "block 8, dInfer threshold, vicinity cache",
        {"block_length": 8, "parallel_decoding": "threshold", "start_block_align": True, "kv_cache": "vicinity"},
    ),
    (
        "block 8, dInfer hierarchy, vicinity cache",
        {"block_length": 8, "parallel_decoding": "hierarchy", "start_block_align": True, "kv_cache": "vicinity"},
    ),
]


def accuracy(model, items: list[dict], log=print) -> list[dict]:
    """Held-out exact match and TPF of ``model`` per :data:`EVAL_SETTINGS` (``localdiff.bench.eval_tasks``; seed 0,
    batches of 16, 32 new tokens, one token per step unless a threshold is set)."""
    from localdiff.bench.eval_tasks import evaluate

    rows = []
    for name, opts in EVAL_SETTINGS:
        r = evaluate(model, items, seed=0, batch_size=16, max_new_tokens=32, steps=32, **opts)
        rows.append(
            {
                "setting": name,
                "options": opts,
                "accuracy": r["accuracy"],
                "correct": r["correct"],
                "n": r["n"],
                "tpf": r["tpf"],
                "seconds": r["seconds"],
                "per_family": {f: v["accuracy"] for f, v in r["per_family"].items()},
            }
        )
        log(f"masked: tiny-mdm {name}: accuracy {r['accuracy']:.3f} ({r['correct']}/{r['n']}), TPF {r['tpf']:.2f}")
    return rows


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (see the module docstring)."""
    import localdiff

    res = {}
    with tempfile.TemporaryDirectory(prefix="localdiff-bench-llada-") as d:
        path = build_random(Path(d))
        m = localdiff.load(str(path))
        log(
            f"masked: random LLaDA-8B-proportioned model ({sum(p.numel() for p in m.net.parameters()) / 1e6:.0f}M "
            "parameters)"
        )
        res["proportioned"] = {
            "config": PROPORTIONED,
            "step_ms": step_times(m.net, reps=3 if quick else 7, log=log),
            "generation": generation(m, [[5, 6, 7, 8] * 8], 32 if quick else 64, log=log),
        }
    try:
        tiny = localdiff.load("tiny-mdm")
    except Exception as e:  # not shipped in this build: say so, measure the rest
        res["tiny_mdm"] = {"skipped": f"tiny-mdm not available ({e})"}
    else:
        prompts = ["What is 41 + 93?", "Reverse the letters: d r a g o n", "Sort these words: elk cat gnu"]
        res["tiny_mdm"] = {"generation": generation(tiny, prompts, 32, log=log)}
        from localdiff.bench.eval_tasks import load_items
        from localdiff.paths import models_dir

        items = load_items(models_dir() / "tiny-mdm" / "eval.jsonl", 5 if quick else 20)
        res["tiny_mdm"]["accuracy"] = accuracy(tiny, items, log=log)
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = ["## Masked family (LLaDA-style): cache modes and parallel decoding", ""]
    prop = sec.get("proportioned", {})
    if prop:
        lines += [
            "Step time, random LLaDA-8B-proportioned model (median ms; speed-up vs no cache):",
            "",
            "| prompt tokens | none | prefix | dual | dual speed-up |",
            "|---:|---:|---:|---:|---:|",
        ]
        for p, r in prop["step_ms"].items():
            ms, sp = r["ms"], r["speedup_vs_none"]
            lines.append(
                f"| {p} | {ms['none']:.1f} | {ms['prefix']:.1f} ({sp['prefix']:.2f}×) | {ms['dual']:.1f} | "
                f"**{sp['dual']:.2f}×** |"
            )
        lines.append("")
    for label, key in (("random proportioned model", "proportioned"), ("tiny-mdm", "tiny_mdm")):
        s = sec.get(key, {})
        if "skipped" in s:
            lines += [f"{label}: skipped ({s['skipped']})", ""]
        elif s.get("generation"):
            lines += [f"Generation, {label}:", "", "| kv_cache | threshold | TPF | tokens/s |", "|---|---|---:|---:|"]
            lines += [
                f"| {r['kv_cache']} | {r['threshold'] or 'one token per step'} | {r['tokens_per_forward']:.2f} |"
                f" {r['tokens_per_second']:.1f} |"
                for r in s["generation"]
            ]
            lines.append("")
    acc = sec.get("tiny_mdm", {}).get("accuracy")
    if acc:
        lines += [
            f"Held-out exact match, tiny-mdm ({acc[0]['n']} items; 32 new tokens; ± = points vs one token per "
            "step at the same block length):",
            "",
            "| setting | accuracy | ± | TPF |",
            "|---|---:|---:|---:|",
        ]
        for r in acc:
            bl = r["options"].get("block_length")
            base = next((b["accuracy"] for b in acc if b["options"] == {"block_length": bl}), r["accuracy"])
            lines.append(
                f"| {r['setting']} | {100 * r['accuracy']:.1f}% | {100 * (r['accuracy'] - base):+.1f} | "
                f"{r['tpf']:.2f} |"
            )
        lines.append("")
    return lines
