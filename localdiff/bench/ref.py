"""`localdiff bench` section 1: localdiff vs the reference (transformers' ``DiffusionGemmaForBlockDiffusion.generate``).

Same checkpoint folder, same prompt ids, same sampler settings passed explicitly to both, same seed
(``torch.manual_seed(S); ref.generate(...)`` vs ``m.generate(ids, chat=False, seed=S, ...)``), in the same process,
interleaved (the order alternates every repetition) so machine noise hits both sides alike.

transformers is a test / bench-only dependency: it is imported here lazily, never by the runtime.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

# A wider tiny-random DiffusionGemma (~10M parameters): the reference's per-step costs that do not shrink with
# the model (masks, cache bookkeeping, sampler) show up at this size too. Minimal vision tower: transformers always
# builds one; the runtime never loads it.
WIDE_TEXT = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=64,
    num_global_key_value_heads=1,
    sliding_window=64,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=128,
    max_position_embeddings=4096,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
)
# A random DiffusionGemma (~65M parameters) with DiffusionGemma-26B-A4B's proportions for the history scaling:
# five sliding layers then one global, a window of 4 canvases, and attention over 8k keys ≈ 0.19 of a canvas
# token's other FLOPs (the 26B-A4B: 1.34 + 0.42 GFLOP of global + sliding attention at 8k vs ≈ 9.2 GFLOP; here
# 12.6 + 2.0 vs ≈ 78 MFLOP). On the small models the 8k attention alone outweighs the rest of the step.
PROPORTIONED_TEXT = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=64,
    num_global_key_value_heads=1,
    sliding_window=256,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=512,
    max_position_embeddings=16384,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)
WIDE_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=16,
    global_head_dim=16,
)


def transformers_available() -> str | None:
    """None when the reference can be imported, else the reason it can't (one line)."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion  # noqa: F401
    except Exception as e:  # ImportError, or an incompatible version failing at import
        return f"transformers with DiffusionGemma is not importable ({type(e).__name__}: {e})"
    return None


def build_random(folder: Path | None = None, canvas_length: int = 64, seed: int = 0, text: dict | None = None) -> Path:
    """Save a random-weight DiffusionGemma (``text`` config, default WIDE_TEXT; canvas ``canvas_length``) with
    transformers; returns its folder.

    Random weights give near-uniform logits, which makes long denoising runs chaotic (a 1e-7 logit difference flips
    a draw), so the comparison on this model uses few denoising steps per canvas.
    """
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    folder = Path(folder or tempfile.mkdtemp(prefix="localdiff-bench-random-"))
    cfg = DiffusionGemmaConfig(
        text_config=dict(text or WIDE_TEXT), vision_config=dict(WIDE_VISION), canvas_length=canvas_length
    )
    torch.manual_seed(seed)
    DiffusionGemmaForBlockDiffusion(cfg).eval().save_pretrained(folder)
    return folder


def load_reference(path: Path):
    """transformers' model for checkpoint folder ``path`` (fp32, CPU, eval mode)."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()


def normalize(ids: list[int], eos_ids: list[int], pad_id: int | None) -> list[int]:
    """New-token ids up to and including the first EOS, pad removed (the reference pads after EOS)."""
    from localdiff.decoding.answer import strip_generated

    return strip_generated(ids, eos_ids, pad_id, keep_eos=True)


class _Counter:
    """Counts calls of a module (a forward pre-hook); used for the reference's decoder forwards."""

    def __init__(self, module):
        self.n = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def _run_ref(ref, ids, seed, max_new, ref_kw, counter, eos, pad):
    counter.n = 0
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=max_new, **ref_kw)
    sec = time.perf_counter() - t0
    toks = normalize(out.sequences[0, ids.shape[1] :].tolist(), eos, pad)
    return {"tokens": toks, "seconds": sec, "forwards": counter.n}


def _run_ld(m, ids, seed, max_new, opts):
    t0 = time.perf_counter()
    g = m.generate(ids[0].tolist(), chat=False, seed=seed, max_new_tokens=max_new, **opts)
    sec = time.perf_counter() - t0
    return {
        "tokens": normalize(g.token_ids, m.eos_token_ids, m.pad_token_id),
        "seconds": sec,
        "forwards": g.stats.forwards,
    }


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def compare(
    path: Path,
    label: str,
    prompts: list[list[int]],
    seeds: list[int],
    reps: int,
    max_new_tokens: int,
    steps: int | None,
    log=print,
    ld_dtype: str = "float32",
) -> dict:
    """Run both implementations on ``path`` for every (prompt, seed) pair ``reps`` times; return the results dict.

    Args:
        prompts: one token-id prompt per seed (cycled if shorter).
        steps: max_denoising_steps for both (None = the checkpoint's / built-in default).
        ld_dtype: localdiff's compute dtype (the reference always runs fp32); tokens then match only as far as
            the model is robust to the rounding.
    Returns:
        {"model", "path", "settings", "seeds": [per-seed rows], "summary"} — per seed: identical (bool), forwards
        and tokens of both, tokens/s, ms per denoising step (wall time / decoder forwards) and the speed ratio
        (localdiff tokens/s ÷ reference tokens/s), each as {median, min, max, n} over repetitions. The summary's
        ratio pools only seeds whose tokens were identical.
    """
    import localdiff

    m = localdiff.load(path, device="cpu", dtype=ld_dtype)
    ref = load_reference(path)
    counter = _Counter(ref.model.decoder)
    opts = m.sampler_options(max_denoising_steps=steps)
    ld_opts = {
        k: opts[k]
        for k in (
            "max_denoising_steps",
            "t_min",
            "t_max",
            "entropy_bound",
            "stability_threshold",
            "confidence_threshold",
        )
    }
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    ref_kw = dict(
        max_denoising_steps=int(opts["max_denoising_steps"]),
        t_min=float(opts["t_min"]),
        t_max=float(opts["t_max"]),
        stability_threshold=int(opts["stability_threshold"]),
        confidence_threshold=float(opts["confidence_threshold"]),
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(opts["entropy_bound"])),
        eos_token_id=list(m.eos_token_ids),
        pad_token_id=m.pad_token_id,
    )
    eos, pad = m.eos_token_ids, m.pad_token_id
    cases = [(s, torch.tensor([prompts[i % len(prompts)]], dtype=torch.long)) for i, s in enumerate(seeds)]
    # warm-up (first-call allocations, lazy init), not timed
    _run_ref(ref, cases[0][1], cases[0][0], max_new_tokens, ref_kw, counter, eos, pad)
    _run_ld(m, cases[0][1], cases[0][0], max_new_tokens, ld_opts)
    runs = {s: {"ref": [], "ld": []} for s, _ in cases}
    for r in range(reps):
        for s, ids in cases:
            order = ("ref", "ld") if (r % 2 == 0) else ("ld", "ref")
            for side in order:
                res = (
                    _run_ref(ref, ids, s, max_new_tokens, ref_kw, counter, eos, pad)
                    if side == "ref"
                    else _run_ld(m, ids, s, max_new_tokens, ld_opts)
                )
                runs[s][side].append(res)
        log(f"  [{label}] repetition {r + 1}/{reps} done")
    counter.handle.remove()
    rows, pooled = [], []
    for s, ids in cases:
        ref_runs, ld_runs = runs[s]["ref"], runs[s]["ld"]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(ref_runs, ld_runs))
        n_tok = len(ld_runs[0]["tokens"])
        ratios = [
            (len(b["tokens"]) / b["seconds"]) / (len(a["tokens"]) / a["seconds"]) for a, b in zip(ref_runs, ld_runs)
        ]
        row = {
            "seed": s,
            "prompt_tokens": int(ids.shape[1]),
            "identical": same,
            "new_tokens": {"ref": len(ref_runs[0]["tokens"]), "localdiff": n_tok},
            "forwards": {"ref": ref_runs[0]["forwards"], "localdiff": ld_runs[0]["forwards"]},
            "tpf": {
                "ref": len(ref_runs[0]["tokens"]) / max(ref_runs[0]["forwards"], 1),
                "localdiff": n_tok / max(ld_runs[0]["forwards"], 1),
            },
            "tokens_per_s": {
                "ref": _spread([len(a["tokens"]) / a["seconds"] for a in ref_runs]),
                "localdiff": _spread([len(b["tokens"]) / b["seconds"] for b in ld_runs]),
            },
            "ms_per_step": {
                "ref": _spread([1e3 * a["seconds"] / max(a["forwards"], 1) for a in ref_runs]),
                "localdiff": _spread([1e3 * b["seconds"] / max(b["forwards"], 1) for b in ld_runs]),
            },
            "speed_ratio": _spread(ratios),
        }
        if not same:
            diff = [i for i, (a, b) in enumerate(zip(ref_runs[0]["tokens"], ld_runs[0]["tokens"])) if a != b]
            row["first_difference"] = diff[0] if diff else min(len(ref_runs[0]["tokens"]), n_tok)
        else:
            pooled.extend(ratios)
        rows.append(row)
    n_same = sum(r["identical"] for r in rows)
    summary = {
        "identical_seeds": n_same,
        "seeds": len(rows),
        "speed_ratio": _spread(pooled) if pooled else None,
        "tokens_per_s": {
            k: statistics.median(r["tokens_per_s"][k]["median"] for r in rows) for k in ("ref", "localdiff")
        },
        "ms_per_step": {
            k: statistics.median(r["ms_per_step"][k]["median"] for r in rows) for k in ("ref", "localdiff")
        },
        "tpf": {k: statistics.median(r["tpf"][k] for r in rows) for k in ("ref", "localdiff")},
        "forwards": {k: sum(r["forwards"][k] for r in rows) for k in ("ref", "localdiff")},
    }
    return {
        "model": label,
        "path": str(path),
        "canvas_length": m.config.canvas_length,
        "parameters": sum(p.numel() for p in m.net.parameters()),
        "settings": {
            "max_new_tokens": max_new_tokens,
            **ld_opts,
            "reps": reps,
            "localdiff_dtype": ld_dtype,
            "reference_dtype": "float32",
        },
        "seeds": rows,
        "summary": summary,
    }
