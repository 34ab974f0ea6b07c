"""Tokens per second of block decoding vs autoregressive decoding of the same model (``localdiff bench --only
block``, issue #16's "tokens/s at the recommended settings above the same model's AR tokens/s").

On the random SDAR-1.7B-shaped model of :mod:`localdiff.bench.block`, end to end through ``Model.generate`` (the
block runner, the exact block KV cache, the decoder, sampling over the 151,936-token vocabulary), after a
``history``-token prompt held in a reused cache (so the timing is decoding, not the prompt's prefill), ``new``
tokens (16; ``--quick`` 8), no EOS (every run decodes all of them):

* **AR**: the same weights with ``block_size`` 1 — a block of one token is autoregressive decoding (each forward
  prefills the previous token and predicts the next), the recommended sampler;
* **static** (lower bound): SDAR's ``low_confidence_static``, 4 steps per block of 4 — one token per forward;
* **recommended**: the catalog's ``sdar:1.7b`` sampler (dynamic threshold 0.85, temperature 0.6, top-k 20, top-p
  0.95). Random weights are never confident, so this runs like the lower bound;
* **forced** (upper bound): the recommended sampler with ``confidence_threshold`` 0 — every masked position passes,
  as if the model were confident everywhere: the whole block in one forward (TPF 4);
* **projection** (not a measurement): the tokens per forward that the trained ``tiny-bd`` reaches at the
  recommended threshold on its held-out items (measured here, temperature 0: ``eval_tasks.evaluate``) times the
  forwards per second of the static run. A real SDAR-1.7B's TPF on real prompts is unknown here (no weights).

Source of the sampler: ``models/block.toml`` (JetAstra/SDAR README / generation_config).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

RECOMMENDED = {
    "steps": 4,
    "remasking_strategy": "low_confidence_dynamic",
    "confidence_threshold": 0.85,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}
SETTINGS = {
    "static": {"remasking_strategy": "low_confidence_static", "steps": 4, "temperature": 0.0},
    "recommended": RECOMMENDED,
    "forced": dict(RECOMMENDED, confidence_threshold=0.0),
}


def _model(net, dtype, new: int, block_size: int | None = None):
    """An engine Model around ``net`` (no tokenizer, no EOS: every generation runs to ``new`` tokens); with
    ``block_size`` a view of the same weights with another block size (1 = autoregressive)."""
    from localdiff.engine import Model

    if block_size is not None:
        net = copy.copy(net)  # shares every module and weight; only .config differs
        net.config = dataclasses.replace(net.config, block_size=block_size)
    return Model(
        net,
        net.config,
        None,
        None,
        "bench-sdar-1.7b-shaped",
        "cpu",
        dtype,
        None,
        {"eos_token_id": [], "max_new_tokens": new},
    )


def decode_rate(m, prompt: list[int], opts: dict, reps: int, new: int) -> dict:
    """Median / range tokens/s, TPF and ms per forward of ``reps`` generations after ``prompt`` (a warm-up
    generation first fills the reused cache with the prompt's whole blocks)."""
    cache = m.new_cache()
    m.generate(prompt, max_new_tokens=new, chat=False, cache=cache, seed=0, **opts)
    tps, tpf, msf = [], [], []
    for r in range(reps):
        g = m.generate(prompt, max_new_tokens=new, chat=False, cache=cache, seed=r + 1, **opts)
        st = g.stats
        tps.append(st.tokens_per_second)
        tpf.append(st.tokens_per_forward)
        msf.append(st.seconds / max(st.forwards, 1) * 1e3)
    return {
        "tokens_per_second": statistics.median(tps),
        "range": [min(tps), max(tps)],
        "tokens_per_forward": statistics.median(tpf),
        "ms_per_forward": statistics.median(msf),
        "new_tokens": len(g.token_ids),
        "prefill_tokens_reused": g.stats.prefill_tokens_reused,
    }


def tiny_bd_tpf(per_family: int, log=print) -> dict | None:
    """Held-out accuracy and TPF of the embedded ``tiny-bd`` at the recommended threshold (temperature 0), and one
    token per step for reference; None when tiny-bd is not installed."""
    import localdiff
    from localdiff.bench.eval_tasks import evaluate, load_items
    from localdiff.paths import models_dir

    folder = models_dir() / "tiny-bd"
    if not (folder / "model.safetensors").exists():
        return None
    m = localdiff.load(str(folder))
    items = load_items(models_dir() / "tiny" / "eval.jsonl", per_family)
    out = {}
    for name, opts in (
        ("threshold 0.85", {"confidence_threshold": RECOMMENDED["confidence_threshold"]}),
        ("one token per step", {"remasking_strategy": "low_confidence_static"}),
    ):
        r = evaluate(m, items, seed=0, batch_size=1, max_new_tokens=32, temperature=0.0, steps=4, **opts)
        out[name] = {"accuracy": r["accuracy"], "tpf": r["tpf"], "n": r["n"]}
    log(
        f"block: tiny-bd at threshold 0.85: TPF {out['threshold 0.85']['tpf']:.2f}, accuracy "
        f"{out['threshold 0.85']['accuracy']:.3f} (one token per step {out['one token per step']['accuracy']:.3f}), "
        f"{out['threshold 0.85']['n']} items"
    )
    return out


def measure_tps(net, dtype, history: int, reps: int, log=print, tiny: dict | None = None, new: int = 16) -> dict:
    """The section's tokens/s part (module docstring) for ``net`` as it is (bf16, or int8 after quantization)."""
    import torch

    g = torch.Generator().manual_seed(7)
    high = min(net.config.vocab_size, net.config.mask_token_id) - 1  # any token below the specials
    prompt = torch.randint(0, high, (history,), generator=g).tolist()
    t0 = time.perf_counter()
    rows = {"ar": decode_rate(_model(net, dtype, new, block_size=1), prompt, RECOMMENDED, reps, new)}
    block = _model(net, dtype, new)
    for name, opts in SETTINGS.items():
        rows[name] = decode_rate(block, prompt, opts, reps, new)
    ar = rows["ar"]["tokens_per_second"]
    res = {
        "history": history,
        "new_tokens": new,
        "reps": reps,
        "rows": rows,
        "over_ar": {k: v["tokens_per_second"] / ar for k, v in rows.items() if k != "ar"},
    }
    if tiny:
        tpf = tiny["threshold 0.85"]["tpf"]
        proj = tpf * 1e3 / rows["static"]["ms_per_forward"]
        res["projection"] = {"tiny_bd_tpf": tpf, "tokens_per_second": proj, "over_ar": proj / ar}
    log(
        f"block: tokens/s after {history} tokens ({time.perf_counter() - t0:.0f} s): "
        + ", ".join(f"{k} {v['tokens_per_second']:.2f} (TPF {v['tokens_per_forward']:.2f})" for k, v in rows.items())
        + (f", projection {res['projection']['tokens_per_second']:.2f}" if tiny else "")
    )
    return res


def render_tps(sec: dict) -> list[str]:
    """Markdown lines of the tokens/s part(s) of the block section."""
    lines = []
    for prec, t in sec.get("tokens_per_second", {}).items():
        ar = t["rows"]["ar"]["tokens_per_second"]
        lines += [
            f"### Tokens/s, {prec} (after {t['history']} tokens, {t['new_tokens']} new, median of "
            f"{t['reps']}; random weights)",
            "",
            "| decoding | tokens/s (range) | TPF | ms/forward | vs AR |",
            "|---|---:|---:|---:|---:|",
        ]
        for k, r in t["rows"].items():
            vs = "1.00×" if k == "ar" else f"{r['tokens_per_second'] / ar:.2f}×"
            lines.append(
                f"| {k} | {r['tokens_per_second']:.2f} ({r['range'][0]:.2f}–{r['range'][1]:.2f}) | "
                f"{r['tokens_per_forward']:.2f} | {r['ms_per_forward']:.0f} | {vs} |"
            )
        if "projection" in t:
            p = t["projection"]
            lines.append(
                f"| projection: tiny-bd's TPF {p['tiny_bd_tpf']:.2f} × static forwards/s (not measured "
                f"end to end) | {p['tokens_per_second']:.2f} | {p['tiny_bd_tpf']:.2f} | – | "
                f"{p['over_ar']:.2f}× |"
            )
        lines += [
            "",
            "Peer tool: 6.1 tokens/s for SDAR-1.7B through upstream transformers on an 8-core laptop CPU "
            "(published; different hardware and threads — not comparable one to one).",
            "",
        ]
    return lines
