"""``localdiff bench --only gguf``: localdiff's gguf backend (llama.cpp computes, our decoders decode) against
llama.cpp's own diffusion program (``llama-diffusion-cli``, :mod:`localdiff.bench.gguf_cli`) on the same GGUF file:
the shipped ``tiny-mdm`` (LLaDA architecture) converted to F32 GGUF (:mod:`localdiff.bench.gguf_convert`), its
held-out eval prompts (``models/tiny/eval.jsonl``), chat template, answer budget 32 tokens, same threads.

1. **Same algorithm, same step count**: LLaDA's block schedule with one token per step, greedy (the program:
   ``--top-k 1 --diffusion-block-length B --diffusion-steps P+32``; ours: ``steps=32, block_length=B``,
   low-confidence remasking at temperature 0). B = the largest of 8, 4, 2, 1 dividing the prompt length P, because
   the program needs B | P + 32 and starts blocks at P; it also runs one forward for each of its P / B blocks that
   lie past the end (its loop decodes before it checks for masks) — reported as ``extra_forwards``. Both sides
   report generation time without model load. Target: our tokens/s within 10 % of the program's, per forward.
2. **Equal accuracy**: the program's best setting of (1) vs our Fast-dLLM threshold decoding (τ = 0.9, block 8,
   stopping at EOS): exact-match accuracy and tokens/s (answer budget / generation seconds). Target: ≥ 2× at an
   accuracy no lower.

Tokens/s = 32 answer tokens per prompt / generation seconds, for both. Medians are over prompts; sums are totals.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

G = 32          # answer budget (tokens): as tiny-mdm's eval


def _tiny_mdm() -> Path:
    """The tiny-mdm checkpoint folder: ``$LOCALDIFF_BENCH_TINY_MDM`` or the catalog's ``tiny-mdm``."""
    from localdiff.errors import LocaldiffError

    env = os.environ.get("LOCALDIFF_BENCH_TINY_MDM")
    if env:
        return Path(env)
    try:
        from localdiff.hub.models import resolve_model

        return Path(resolve_model("tiny-mdm"))
    except LocaldiffError as e:
        raise LocaldiffError(f"tiny-mdm is not available ({e}); set LOCALDIFF_BENCH_TINY_MDM") from None


def _block(p: int) -> int:
    return next(b for b in (8, 4, 2, 1) if p % b == 0)


def _ours(m, items, block=None, **kw) -> dict:
    """Per-prompt generation on our backend (chat template, seed 0): accuracy, seconds, forwards. ``block``: a
    function prompt length → block length (else ``kw`` holds it)."""
    from localdiff.bench.eval_tasks import exact_match

    secs, fw, correct = [], 0, 0
    for it in items:
        extra = {"block_length": block(len(m.encode_prompt(it["prompt"])[0]))} if block else {}
        g = m.generate(it["prompt"], max_new_tokens=G, seed=0, **kw, **extra)
        secs.append(g.stats.seconds)
        fw += g.stats.forwards
        correct += exact_match(g.text, it["answer"])
    return _summary(secs, fw, correct, len(items))


def _summary(secs, forwards, correct, n) -> dict:
    total = sum(secs)
    rates = [G / s for s in secs if s > 0]
    return {"accuracy": correct / n, "correct": correct, "n": n, "seconds": total, "forwards": forwards,
            "tokens_per_second": G * n / total if total else 0.0,
            "median_tokens_per_second": statistics.median(rates) if rates else 0.0,
            "range_tokens_per_second": [min(rates), max(rates)] if rates else [],
            "ms_per_forward": 1e3 * total / max(forwards, 1)}


def _cli(exe, gguf, m, items, threads: int, top_k: int) -> dict:
    """The program on each prompt: block schedule, one token per step (module docstring)."""
    from localdiff.bench import gguf_cli
    from localdiff.bench.eval_tasks import exact_match

    secs, fw, extra, correct = [], 0, 0, 0
    for it in items:
        p = len(m.encode_prompt(it["prompt"])[0])
        b = _block(p)
        r = gguf_cli.run(exe, gguf, it["prompt"], p + G, steps=p + G, threads=threads, block_length=b, top_k=top_k)
        secs.append(r["ms"] / 1e3)
        fw += G + p // b
        extra += p // b
        correct += exact_match(r["text"], it["answer"])
    out = _summary(secs, fw, correct, len(items))
    out["extra_forwards"] = extra
    return out


def measure(quick: bool, threads: int = 1, log=print) -> dict:
    """The section's result dict (module docstring). Parts that cannot run say why (``skipped``)."""
    import localdiff
    from localdiff.backends.gguf import version
    from localdiff.bench import gguf_cli
    from localdiff.bench.eval_tasks import load_items
    from localdiff.bench.gguf_convert import convert_llada, tokenizer_agreement
    from localdiff.paths import models_dir

    ckpt = _tiny_mdm()
    res = {"backend": f"gguf ({version()})", "threads": threads, "model": str(ckpt), "answer_tokens": G}
    items = load_items(models_dir() / "tiny" / "eval.jsonl", 2 if quick else 6)
    res["prompts"] = len(items)
    with tempfile.TemporaryDirectory(prefix="localdiff-bench-gguf-") as d:
        gguf = convert_llada(ckpt, Path(d) / "tiny-mdm-F32.gguf")
        m = localdiff.load(str(gguf), threads=threads)
        ref = localdiff.load(str(ckpt))
        texts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": it["prompt"]}]) for it in items]
        res["tokenizer_agreement"] = tokenizer_agreement(ref.tokenizer, m.tokenizer, texts)
        log(f"gguf: tiny-mdm → F32 GGUF; tokenizer agreement with tokenizer.json {res['tokenizer_agreement']:.0%}")
        same = _ours(m, items, block=_block, steps=G)
        thr = _ours(m, items, steps=G, block_length=8, threshold=0.9)
        res["ours"] = {"same_algorithm": same, "threshold_0.9": thr}
        log(f"gguf: ours, one token per step: {same['tokens_per_second']:.1f} tokens/s, accuracy "
            f"{same['accuracy']:.2f}; threshold 0.9: {thr['tokens_per_second']:.1f} tokens/s, accuracy "
            f"{thr['accuracy']:.2f}")
        try:
            exe, flags = gguf_cli.build(version().split()[1], log=log)
        except gguf_cli.CliUnavailable as e:
            res["cli"] = {"skipped": str(e)}
            log(f"gguf: llama-diffusion-cli skipped ({e})")
            return res
        res["cli_build_flags"] = flags
        cli = {"greedy (top-k 1)": _cli(exe, gguf, m, items, threads, 1),
               "default sampling (top-k 40)": _cli(exe, gguf, m, items, threads, 40)}
        res["cli"] = cli
        for k, v in cli.items():
            log(f"gguf: llama-diffusion-cli {k}: {v['tokens_per_second']:.1f} tokens/s, accuracy {v['accuracy']:.2f}"
                f" ({v['extra_forwards']} forwards past the end)")
        g = cli["greedy (top-k 1)"]
        best = max(cli.values(), key=lambda r: (r["accuracy"], r["tokens_per_second"]))
        res["same_algorithm"] = {"tokens_per_second_ratio": same["tokens_per_second"] / g["tokens_per_second"],
                                 "per_forward_ratio": g["ms_per_forward"] / same["ms_per_forward"],
                                 "target": "within 10 % (ratio ≥ 0.9)"}
        res["equal_accuracy"] = {"cli_best": best, "ours": thr,
                                 "tokens_per_second_ratio": thr["tokens_per_second"] / best["tokens_per_second"],
                                 "accuracy_ok": thr["accuracy"] >= best["accuracy"], "target": "≥ 2× at ≥ accuracy"}
        log(f"gguf: same algorithm: ours / program tokens/s {res['same_algorithm']['tokens_per_second_ratio']:.2f}×"
            f" (per forward {res['same_algorithm']['per_forward_ratio']:.2f}×); equal accuracy: threshold / program "
            f"{res['equal_accuracy']['tokens_per_second_ratio']:.2f}×")
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = ["## GGUF backend (llama.cpp) vs llama.cpp's llama-diffusion-cli", ""]
    if "skipped" in sec:
        return lines + [f"skipped: {sec['skipped']}", ""]
    lines += [f"{sec['backend']}, {sec['threads']} thread(s), tiny-mdm as F32 GGUF, {sec['prompts']} eval prompts, "
              f"{sec['answer_tokens']} answer tokens; tokenizer agreement {sec['tokenizer_agreement']:.0%}.", "",
              "| run | accuracy | tokens/s (total) | median [range] | forwards | ms/forward |",
              "|---|---:|---:|---:|---:|---:|"]
    rows = [(f"ours, {k}", v) for k, v in sec["ours"].items()]
    if isinstance(sec.get("cli"), dict) and "skipped" not in sec["cli"]:
        rows += [(f"llama-diffusion-cli, {k}", v) for k, v in sec["cli"].items()]
    for name, r in rows:
        lo, hi = r["range_tokens_per_second"] or [0, 0]
        lines.append(f"| {name} | {r['accuracy']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['median_tokens_per_second']:.1f} [{lo:.1f}–{hi:.1f}] | {r['forwards']} | "
                     f"{r['ms_per_forward']:.2f} |")
    lines.append("")
    if "same_algorithm" in sec:
        s, e = sec["same_algorithm"], sec["equal_accuracy"]
        lines += [f"Same algorithm: ours / program tokens/s **{s['tokens_per_second_ratio']:.2f}×** (per forward "
                  f"{s['per_forward_ratio']:.2f}×; target ≥ 0.9). Equal accuracy: threshold 0.9 / program's best "
                  f"**{e['tokens_per_second_ratio']:.2f}×** (accuracy {e['ours']['accuracy']:.2f} vs "
                  f"{e['cli_best']['accuracy']:.2f}; target ≥ 2×).", ""]
    elif isinstance(sec.get("cli"), dict):
        lines += [f"llama-diffusion-cli: skipped ({sec['cli'].get('skipped')})", ""]
    return lines


def section(ctx) -> dict:
    """The entry ``localdiff bench`` calls (``bench/run.py``): :func:`measure` with the run's quick flag and threads."""
    return measure(ctx.args.quick, ctx.args.threads, log=ctx.log)
