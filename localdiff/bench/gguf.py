"""``localdiff bench --only gguf``: localdiff's gguf backend (llama.cpp computes, our decoders decode) against
llama.cpp's own diffusion program ``llama-diffusion-cli`` (``examples/diffusion``), built by
:func:`localdiff.bench.gguf_cli.build_cli` from the llama.cpp that llama-cpp-python vendors in its sdist, on the same
GGUF file: the shipped ``tiny-mdm`` (LLaDA architecture) converted to F32 GGUF (:mod:`localdiff.bench.gguf_convert`),
its held-out eval prompts (``models/tiny/eval.jsonl``; the program renders the GGUF's chat template itself), answer
budget 32 tokens, the same threads, runs interleaved per prompt.

1. **Same algorithm, same step count**: LLaDA's block schedule with one token per step, greedy. llama.cpp's loop:
   block schedule, confidence-based, ``top_k`` 1, ``steps`` = P + 32 over its (P + 32) / B blocks; ours:
   ``steps=32, block_length=B, stop_at_eos=False``, low-confidence remasking at temperature 0: every block decoded,
   as llama.cpp's loop does (it never stops at EOS), so both run all 32 steps and the per-generation costs weigh
   alike in the per-forward figures (the answer, cut at EOS, is the same as with the default stop). B = the largest of 8, 4, 2, 1 dividing
   the prompt length P, because llama.cpp's loop needs B | P + 32 and starts its blocks at P; it then also runs one
   forward for each of the P / B blocks that lie past the end (it decodes before it looks for masks): counted as
   ``extra_forwards``. (With top-k 1 its confidence is 1 everywhere, so its order is left to right; ours is by
   confidence: the same work per step, different tokens.) Target: our tokens/s within 10 % (ms per forward too).
2. **Equal accuracy**: llama.cpp's best setting (greedy or its default top-k 40 sampling with blocks B, or greedy
   with its timestep schedule over the whole answer, 32 steps) vs our Fast-dLLM threshold decoding (τ = 0.7 / 0.9,
   with llama.cpp's blocks B or one block of the answer, stopping at EOS; the fastest whose accuracy is no lower,
   else the most accurate): exact-match accuracy and tokens/s. Target: ≥ 2× at an accuracy no lower.
3. **Realistic size** (full runs only): run 1's two settings on a random ~108M-parameter LLaDA with tiny-mdm's
   tokenizer (:mod:`localdiff.bench.gguf_random`, same converter, F32), :data:`SIZE_PROMPTS` prompts: per forward,
   where the forward dominates (tiny-mdm's ~4.5 ms forward makes fixed per-step costs count; real models do not).

Tokens/s = 32 answer tokens per prompt / generation seconds (model load excluded on both sides: the program's own
``total time`` of ``diffusion_generate``). Totals, plus the median and range over prompts. CPU time is reported
beside wall time: ours over the generation calls; the program's is its whole process (model load and tokenization
included, so its CPU figures are pessimistic). Without cmake / a compiler the llama.cpp runs are skipped with the
reason; when the program cannot be built, the reason is given too.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

G = 32  # answer budget (tokens): as tiny-mdm's eval


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


def _summary(secs, cpu, forwards, correct, n, extra=0) -> dict:
    total, cpu_total = sum(secs), sum(cpu)
    rates = [G / x for x in secs if x > 0]
    return {
        "accuracy": correct / n,
        "correct": correct,
        "n": n,
        "seconds": total,
        "forwards": forwards,
        "extra_forwards": extra,
        "tokens_per_second": G * n / total if total else 0.0,
        "cpu_seconds": cpu_total,
        "cpu_tokens_per_second": G * n / cpu_total if cpu_total else 0.0,
        "cpu_ms_per_forward": 1e3 * cpu_total / max(forwards, 1),
        "median_tokens_per_second": statistics.median(rates) if rates else 0.0,
        "range_tokens_per_second": [min(rates), max(rates)] if rates else [],
        "ms_per_forward": 1e3 * total / max(forwards, 1),
    }


OURS_SAME = "ours, same algorithm"
#: our threshold decoding: name → (τ, block length; None = llama.cpp's blocks B, else one block of the answer)
THRESHOLDS = {
    f"ours, threshold {t}{'' if bl is None else ', one block'}": (t, bl) for bl in (None, G) for t in (0.7, 0.9)
}
LL_GREEDY, LL_TOPK = "llama.cpp loop, greedy (top-k 1)", "llama.cpp loop, top-k 40"
LL_TIMESTEP = "llama.cpp loop, greedy, timestep schedule (no blocks)"
LL_RUNS = {LL_GREEDY: dict(top_k=1), LL_TOPK: dict(top_k=40), LL_TIMESTEP: dict(top_k=1, timestep=True)}


def _runs(m, gguf, exe, items, threads: int, cli: bool = False, only=None) -> dict:
    """Every run, interleaved per prompt (drift and other load hit all alike): name → :func:`_summary`. ``cli``: ``exe``
    is ``llama-diffusion-cli`` (text in, text out) rather than the driver (token ids in and out). ``only``: these
    run names (None = all)."""
    from localdiff.bench import gguf_cli
    from localdiff.bench.eval_tasks import exact_match

    names = [OURS_SAME, *THRESHOLDS] + (list(LL_RUNS) if exe else [])
    names = [k for k in names if only is None or k in only]
    acc = {k: {"secs": [], "cpu": [], "fw": 0, "extra": 0, "ok": 0} for k in names}
    m.generate(items[0]["prompt"], max_new_tokens=G, seed=0, steps=4)  # warm-up: the context is made once
    for it in items:
        ids = m.encode_prompt(it["prompt"])[0]
        p, b = len(ids), _block(len(ids))
        for k in names:
            a = acc[k]
            if k == OURS_SAME or k in THRESHOLDS:
                kw = (
                    dict(block_length=b, stop_at_eos=False)
                    if k == OURS_SAME
                    else dict(block_length=THRESHOLDS[k][1] or b, threshold=THRESHOLDS[k][0])
                )
                c0 = time.process_time()
                g = m.generate(ids, max_new_tokens=G, seed=0, steps=G, **kw)
                a["cpu"].append(time.process_time() - c0)
                a["secs"].append(g.stats.seconds)
                a["fw"] += g.stats.forwards
                a["ok"] += exact_match(g.text, it["answer"])
                continue
            ts = LL_RUNS[k].get("timestep", False)
            kw = dict(
                steps=G if ts else p + G, threads=threads, block_length=None if ts else b, top_k=LL_RUNS[k]["top_k"]
            )
            if cli:
                r = gguf_cli.run_cli(exe, gguf, it["prompt"], p + G, **kw)
                text = r["text"]
            else:
                r = gguf_cli.run(exe, gguf, ids, p + G, **kw)
                out = r["ids"]
                cut = next((i for i, t in enumerate(out) if t in m.eos_token_ids), len(out))
                text = m.tokenizer.decode(out[:cut])
            a["secs"].append(r["ms"] / 1e3)
            a["cpu"].append(r["cpu_ms"] / 1e3)
            a["fw"] += G if ts else G + p // b
            a["extra"] += 0 if ts else p // b
            a["ok"] += exact_match(text, it["answer"])
    return {k: _summary(a["secs"], a["cpu"], a["fw"], a["ok"], len(items), a["extra"]) for k, a in acc.items()}


def measure(quick: bool, threads: int = 1, log=print) -> dict:
    """The section's result dict (module docstring). A part that cannot run says why."""
    import localdiff
    from localdiff.backends.gguf import version
    from localdiff.bench import gguf_cli
    from localdiff.bench.eval_tasks import load_items
    from localdiff.bench.gguf_convert import convert_llada, tokenizer_agreement
    from localdiff.paths import models_dir

    ckpt = _tiny_mdm()
    from localdiff.backends.gguf import llama_cpp

    res = {
        "backend": f"gguf ({version()})",
        "threads": threads,
        "model": str(ckpt),
        "answer_tokens": G,
        "llama_cpp_system_info": llama_cpp().llama_print_system_info().decode("utf-8", "replace").strip(),
    }
    items = load_items(models_dir() / "tiny" / "eval.jsonl", 2 if quick else 10)
    res["prompts"] = len(items)
    with tempfile.TemporaryDirectory(prefix="localdiff-bench-gguf-") as d:
        gguf = convert_llada(ckpt, Path(d) / "tiny-mdm-F32.gguf")
        m = localdiff.load(str(gguf), threads=threads)
        ref = localdiff.load(str(ckpt))
        texts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": it["prompt"]}]) for it in items]
        res["tokenizer_agreement"] = tokenizer_agreement(ref.tokenizer, m.tokenizer, texts)
        log(f"gguf: tiny-mdm → F32 GGUF; prompts tokenized as tokenizer.json does: {res['tokenizer_agreement']:.0%}")
        exe, cli = None, True
        try:
            exe, how = gguf_cli.build_cli(version().split()[1], log=log)
            res["llama_cpp_loop"] = how
        except gguf_cli.CliUnavailable as e:
            res["llama_cpp_loop"] = f"skipped: {e}"
            log(f"gguf: llama.cpp's loop skipped ({e})")
        runs = _runs(m, gguf, exe, items, threads, cli)
        if exe is not None and not quick:
            res["realistic_size"] = _at_size(ckpt, Path(d), exe, items[:SIZE_PROMPTS], threads, cli, log)
    res["runs"] = runs
    for k, v in runs.items():
        log(
            f"gguf: {k}: {v['tokens_per_second']:.1f} tokens/s, accuracy {v['accuracy']:.2f}, "
            f"{v['ms_per_forward']:.1f} ms/forward"
        )
    if exe is None:
        return res
    same, greedy = runs[OURS_SAME], runs[LL_GREEDY]
    best = max((runs[k] for k in LL_RUNS), key=lambda r: (r["accuracy"], r["tokens_per_second"]))
    best_name = next(k for k in LL_RUNS if runs[k] is best)
    ok = [runs[k] for k in THRESHOLDS if runs[k]["accuracy"] >= best["accuracy"]]
    thr = (
        max(ok, key=lambda r: r["tokens_per_second"])
        if ok
        else max((runs[k] for k in THRESHOLDS), key=lambda r: (r["accuracy"], r["tokens_per_second"]))
    )
    thr_name = next(k for k in THRESHOLDS if runs[k] is thr)
    res["same_algorithm"] = {
        "tokens_per_second_ratio": same["tokens_per_second"] / greedy["tokens_per_second"],
        "per_forward_ratio": greedy["ms_per_forward"] / same["ms_per_forward"],
        "cpu_per_forward_ratio": greedy["cpu_ms_per_forward"] / same["cpu_ms_per_forward"],
        "target": "within 10 % (≥ 0.9)",
    }
    res["equal_accuracy"] = {
        "llama_cpp_best": best,
        "llama_cpp_setting": best_name,
        "ours": thr,
        "ours_setting": thr_name,
        "tokens_per_second_ratio": thr["tokens_per_second"] / best["tokens_per_second"],
        "cpu_tokens_per_second_ratio": thr["cpu_tokens_per_second"] / best["cpu_tokens_per_second"],
        "accuracy_ok": thr["accuracy"] >= best["accuracy"],
        "target": "≥ 2× at ≥ accuracy",
    }
    log(
        f"gguf: same algorithm: ours / llama.cpp tokens/s {res['same_algorithm']['tokens_per_second_ratio']:.2f}× "
        f"(per forward {res['same_algorithm']['per_forward_ratio']:.2f}× wall, "
        f"{res['same_algorithm']['cpu_per_forward_ratio']:.2f}× CPU); equal accuracy: {thr_name} / llama.cpp's "
        f"best {res['equal_accuracy']['tokens_per_second_ratio']:.2f}× (accuracy {thr['accuracy']:.2f} vs "
        f"{best['accuracy']:.2f})"
    )
    return res


#: prompts of the realistic-size check (~190 ms per forward on one core: ~1 min per side)
SIZE_PROMPTS = 3


def _at_size(ckpt: Path, d: Path, exe, items, threads: int, cli: bool, log) -> dict:
    """The same-algorithm comparison on a random ~108M-parameter LLaDA (:mod:`localdiff.bench.gguf_random`, F32
    GGUF by the same converter): per-forward ratios where the forward, not the per-step Python work, dominates."""
    import localdiff
    from localdiff.bench.gguf_convert import convert_llada
    from localdiff.bench.gguf_random import SHAPE, random_llada

    folder, n_params = random_llada(ckpt, d / "random-llada")
    gguf = convert_llada(folder, d / "random-llada-F32.gguf")
    (folder / "model.safetensors").unlink()
    m = localdiff.load(str(gguf), threads=threads)
    runs = _runs(m, gguf, exe, items, threads, cli, only=(OURS_SAME, LL_GREEDY))
    m.net.close()
    same, greedy = runs[OURS_SAME], runs[LL_GREEDY]
    out = {
        "shape": SHAPE,
        "parameters": n_params,
        "prompts": len(items),
        "runs": runs,
        "per_forward_ratio": greedy["ms_per_forward"] / same["ms_per_forward"],
        "cpu_per_forward_ratio": greedy["cpu_ms_per_forward"] / same["cpu_ms_per_forward"],
    }
    log(
        f"gguf: realistic size ({n_params / 1e6:.0f}M random LLaDA, {len(items)} prompts): ours "
        f"{same['ms_per_forward']:.1f} ms/forward, llama.cpp {greedy['ms_per_forward']:.1f} → per forward "
        f"{out['per_forward_ratio']:.2f}× wall, {out['cpu_per_forward_ratio']:.2f}× CPU"
    )
    return out


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = ["## GGUF backend (llama.cpp) vs llama.cpp's own diffusion loop", ""]
    lines += [
        f"{sec['backend']}, {sec['threads']} thread(s), tiny-mdm as F32 GGUF, {sec['prompts']} eval prompts, "
        f"{sec['answer_tokens']} answer tokens; prompts tokenized as tokenizer.json does: "
        f"{sec['tokenizer_agreement']:.0%}. llama.cpp: {sec.get('llama_cpp_system_info', '?')}",
        "",
        "| run | accuracy | tokens/s (total) | median [range] | forwards (extra) | ms/forward | CPU ms/forward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in sec.get("runs", {}).items():
        lo, hi = r["range_tokens_per_second"] or [0, 0]
        lines.append(
            f"| {name} | {r['accuracy']:.2f} | {r['tokens_per_second']:.1f} | "
            f"{r['median_tokens_per_second']:.1f} [{lo:.1f}–{hi:.1f}] | {r['forwards']} "
            f"({r['extra_forwards']}) | {r['ms_per_forward']:.2f} | {r['cpu_ms_per_forward']:.2f} |"
        )
    lines.append("")
    if "same_algorithm" in sec:
        s, e = sec["same_algorithm"], sec["equal_accuracy"]
        lines += [
            f"Same algorithm: ours / llama.cpp tokens/s **{s['tokens_per_second_ratio']:.2f}×** (per forward "
            f"{s['per_forward_ratio']:.2f}× wall, {s['cpu_per_forward_ratio']:.2f}× CPU; target ≥ 0.9). Equal "
            f"accuracy: {e['ours_setting']} / llama.cpp's best ({e.get('llama_cpp_setting', '?')}) **{e['tokens_per_second_ratio']:.2f}×** "
            f"({e['cpu_tokens_per_second_ratio']:.2f}× CPU; accuracy {e['ours']['accuracy']:.2f} vs "
            f"{e['llama_cpp_best']['accuracy']:.2f}; target ≥ 2×).",
            "",
        ]
    if "realistic_size" in sec:
        z = sec["realistic_size"]
        o, ll = z["runs"][OURS_SAME], z["runs"][LL_GREEDY]
        lines += [
            f"Realistic size (random LLaDA, {z['parameters'] / 1e6:.0f}M parameters, {z['prompts']} prompts, "
            f"same algorithm): ours {o['ms_per_forward']:.1f} ms/forward ({o['cpu_ms_per_forward']:.1f} CPU), "
            f"llama.cpp {ll['ms_per_forward']:.1f} ({ll['cpu_ms_per_forward']:.1f} CPU) → per forward "
            f"**{z['per_forward_ratio']:.2f}×** wall, {z['cpu_per_forward_ratio']:.2f}× CPU.",
            "",
        ]
    lines += [f"llama.cpp loop: {sec.get('llama_cpp_loop')}", ""]
    return lines


def section(ctx) -> dict:
    """The entry ``localdiff bench`` calls (``bench/run.py``): :func:`measure` with the run's quick flag and threads."""
    return measure(ctx.args.quick, ctx.args.threads, log=ctx.log)


#: the name ``localdiff bench`` calls for a section in its own file
run = section
