"""``localdiff bench --only dflash``: DFlash speculative decoding (arXiv 2602.06036) vs the target alone, at equal
output (greedy: the tokens are checked identical), with the acceptance length τ.

Pairs:

* **tiny-dflash** (shipped under ``models/tiny-dflash/``: a tiny Qwen3 target and a draft trained here on its
  hidden states): the eval tasks' prompts, the draft's block size and 4. τ is what the draft earns.
* **a random Qwen3-4B-proportioned pair sized for this machine**: target hidden 512, 12 layers (36 / 3), 4 query
  heads of 128 and 1 key/value head (Qwen3-4B: 32 / 8), SwiGLU 3.8 × hidden (9728 / 2560), vocabulary 32,768, tied
  embeddings (~60M parameters); draft: 2 DFlash layers reading target layers [1, 9], block 16 (z-lab's b16). τ is
  FORCED by construction, since random weights draft nothing useful: the "full" pair has the target's and the
  draft's final RMSNorm scales set to 0, so both predict token 0 everywhere and every drafted token is accepted —
  τ = the block size (exactly, but for the last step, which ``max_new_tokens`` cuts; swept 2, 4, 8, 16: the upper
  bound of what a draft of that acceptance buys); the
  "none" pair keeps all weights random (τ ≈ 1: the cost of drafting a block and accepting nothing). Every matmul
  runs at its full size in both; only the norms' values differ.

tokens/s = new tokens / wall time of ``Model.generate`` (prefill included), median of interleaved repetitions with
its range; speed-up = DFlash tokens/s ÷ target-alone tokens/s in the same run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

TARGET = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 32768,
    "hidden_size": 512,
    "intermediate_size": 1946,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "eos_token_id": 32767,
    "bos_token_id": 32766,
}
DRAFT = {
    "model_type": "qwen3",
    "architectures": ["DFlashDraftModel"],
    "vocab_size": 32768,
    "hidden_size": 512,
    "intermediate_size": 1946,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "block_size": 16,
    "num_target_layers": 12,
    "dflash_config": {"mask_token_id": 32765, "target_layer_ids": [1, 9]},
}


def build_pair(folder: Path, full: bool, seed: int = 0) -> tuple[Path, Path]:
    """Random target + draft checkpoints (upstream layouts) under ``folder``; ``full``: final norms zeroed (every
    draft accepted, module docstring)."""
    import torch
    from safetensors.torch import save_file

    from localdiff.arch import get_arch, get_spec

    out = []
    for name, cfg in (("target", TARGET), ("draft", DRAFT)):
        mod = get_arch(cfg)
        with torch.device("meta"):
            net = mod.MODEL_CLASS(get_spec(cfg).parse_config(cfg))
        g = torch.Generator().manual_seed(seed)
        state = {}
        for k, t in net.state_dict().items():
            v = torch.ones(t.shape) if t.dim() == 1 else torch.randn(t.shape, generator=g) * 0.02
            if full and k == "norm.weight":
                v.zero_()
            state[mod.checkpoint_names(k)[0]] = v.contiguous()
        d = folder / name
        d.mkdir(parents=True, exist_ok=True)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        out.append(d)
    return out[0], out[1]


def compare(
    alone, spec, prompts: list, max_new_tokens: int, block_sizes, reps: int, log=print, label: str = ""
) -> list[dict]:
    """Rows {block_size, tau, tokens_per_second (alone / dflash, median and range), speedup, equal} over
    ``prompts`` (greedy, interleaved repetitions)."""

    def run(model, **kw):
        toks, sec, outs, taus = 0, 0.0, [], []
        for p in prompts:
            g = model.generate(p, max_new_tokens=max_new_tokens, chat=not isinstance(p, list), temperature=0.0, **kw)
            toks, sec = toks + g.stats.new_tokens, sec + g.stats.seconds
            outs.append(g.token_ids)
            taus += g.stats.acceptance_lengths
        return toks / sec, outs, (sum(taus) / len(taus) if taus else 1.0)

    rows = []
    run(alone)  # warm-up (allocator, first-call costs)
    for bs in block_sizes:
        a, d = [], []
        for _ in range(reps):
            ta, oa, _ = run(alone)
            td, od, tau = run(spec, block_size=bs)
            a.append(ta)
            d.append(td)
        row = {
            "block_size": bs,
            "tau": tau,
            "alone_tps": statistics.median(a),
            "alone_range": [min(a), max(a)],
            "dflash_tps": statistics.median(d),
            "dflash_range": [min(d), max(d)],
            "equal": oa == od,
        }
        row["speedup"] = row["dflash_tps"] / row["alone_tps"]
        rows.append(row)
        log(
            f"dflash{label}: block {bs}: τ {tau:.2f}, alone {row['alone_tps']:.1f} tokens/s, DFlash "
            f"{row['dflash_tps']:.1f} tokens/s ({row['speedup']:.2f}×), equal output {row['equal']}"
        )
    return rows


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (see the module docstring)."""
    import localdiff
    from localdiff.paths import models_dir

    res: dict = {}
    reps = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="localdiff-bench-dflash-") as d:
        prompt = [[(7 * i + 3) % 32000 for i in range(64)]]
        for kind, sizes in (("full", (2, 4, 8, 16) if not quick else (4, 16)), ("none", (16,))):
            t, dr = build_pair(Path(d) / kind, kind == "full")
            alone, spec = localdiff.load(str(t)), localdiff.load(str(t), draft=str(dr))
            n = sum(p.numel() for p in alone.net.parameters())
            log(f"dflash: random Qwen3-4B-proportioned pair ({n / 1e6:.0f}M target parameters), τ forced: {kind}")
            res[f"proportioned_{kind}"] = compare(
                alone, spec, prompt, 64 if quick else 128, sizes, reps, log, f" ({kind})"
            )
    tiny = models_dir() / "tiny-dflash"
    if not (tiny / "target" / "config.json").is_file():
        res["tiny"] = {"skipped": "models/tiny-dflash not shipped in this build"}
        return res
    alone = localdiff.load(str(tiny / "target"))
    spec = localdiff.load(str(tiny / "target"), draft=str(tiny / "draft"))
    prompts = [
        "What is 41 + 93?",
        "Reverse the letters: d r a g o n",
        "Sort these words: elk cat gnu",
        "Convert 17 h to min.",
        "List the even numbers from 4 to 18.",
    ]
    res["tiny"] = compare(alone, spec, prompts, 48, (spec.draft.block_size, 4), reps + 2, log, " (tiny)")
    return res


def section(ctx) -> dict:
    """``localdiff bench``'s entry point for this section (``ctx``: the run's args and log)."""
    return measure(ctx.args.quick, log=ctx.log)


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = ["## DFlash speculative decoding vs the target alone (greedy, equal output)", ""]
    for key, label in (
        ("tiny", "tiny-dflash (draft trained here)"),
        ("proportioned_full", "random Qwen3-4B-proportioned pair, τ forced = block size"),
        ("proportioned_none", "random Qwen3-4B-proportioned pair, random draft (τ ≈ 1)"),
    ):
        rows = sec.get(key)
        if rows is None:
            continue
        if isinstance(rows, dict):
            lines += [f"{label}: skipped ({rows.get('skipped')})", ""]
            continue
        lines += [
            f"{label}:",
            "",
            "| block | τ | target alone tokens/s | DFlash tokens/s | speed-up | equal output |",
            "|---:|---:|---:|---:|---:|:---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['block_size']} | {r['tau']:.2f} | {r['alone_tps']:.1f} "
                f"({r['alone_range'][0]:.1f}–{r['alone_range'][1]:.1f}) | {r['dflash_tps']:.1f} "
                f"({r['dflash_range'][0]:.1f}–{r['dflash_range'][1]:.1f}) | **{r['speedup']:.2f}×** | "
                f"{'yes' if r['equal'] else 'NO'} |"
            )
        lines.append("")
    return lines


#: the name ``localdiff bench`` calls for a section in its own file
run = section
