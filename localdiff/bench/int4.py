"""``localdiff bench --only int4``: 4-bit weights (issue 42's bench) — speed, memory and accuracy on this CPU.

* **Steps**: a random model of SDAR-1.7B's shape (:data:`localdiff.bench.block.SDAR_1_7B`, 1.72B parameters) in
  bf16, then int8 and int4 copies by SDAR's recipe (``quant/sdar.toml``: attention and MLP projections quantized
  and a quantized copy of the tied LM head, int8 resp. int4; embeddings / norms bf16; bf16 activations; q/k/v and
  gate/up fused as the loader does). With 512 tokens of random history in each model's cache, the ms of one
  4-token **block step** and one **1-token step** (``BlockLM.denoise``), all six interleaved in every round (the
  order rotated per round), on **one pinned core** (``os.sched_setaffinity`` to the last allowed core,
  ``torch.set_num_threads(1)``): medians and ranges. Targets: int4 block step ≤ 0.6× int8's; resident bytes
  (parameters + buffers + the head copy) ≤ 0.3× bf16's.
* **llama.cpp**: when llama-cpp-python imports, a Q4_K_M GGUF of the same shape and weights' distribution
  (:mod:`localdiff.bench.gguf_qwen3`), its 1-token step at 512 history in the same rounds.
* **int4 + int8 act** (CPUs with AVX512-VNNI): the same int4 model with the recipe opt-in ``int4_activations =
  "int8"`` switched on (:func:`localdiff.quantize.apply.set_activations`: linears and the int4 head quantize each
  activation row to int8 per group of 64, as llama.cpp quantizes its activations to q8_K for Q4_K_M), its block and
  1-token steps in the same rounds, beside — not instead of — the exact int4 figures. Every step's thread CPU time
  is recorded too (steadier than wall time on a shared core).
* **Canvas**: DiffusionGemma's denoising step int4 vs bf16 at the flagship's proportions
  (:mod:`localdiff.bench.int4_dg`; target ≤ 0.75× bf16).
* **Accuracy**: the embedded model's held-out eval (``eval.jsonl``) in exact fp32 and with int4 weights,
  paired over seeds as ``--only precision`` does (:func:`localdiff.bench.precision.paired`); target: int4 within
  2 points of fp32 (mean paired difference; its 95 % interval reported).
* **Accuracy of the int8-activation opt-in on dense layers** (:func:`accuracy_int8_act`): the trained block model
  ``tiny-bd`` (an SDAR: dense int4 linears at 4-row blocks) on the same held-out items, fp32 vs int4 vs int4 with
  ``int4_activations = "int8"``, paired seeds at temperature 0.5 (its default, 0, has no randomness to pair).
"""

from __future__ import annotations

import copy
import os
import statistics
import time

from localdiff.bench.onecore import cpu_name, resident  # noqa: F401  (resident: the section's byte count)
from localdiff.bench.onecore import pin as _pin


def _random_sdar(layers: int | None):
    """The bf16 BlockLM of SDAR-1.7B's shape (``layers`` overrides the depth), weights N(0, 0.02²), norms 1."""
    import torch

    from localdiff.arch import get_arch, get_spec
    from localdiff.bench.block import SDAR_1_7B

    cfg = dict(SDAR_1_7B, **({"num_hidden_layers": layers} if layers else {}))
    with torch.device("meta"):
        net = get_arch(cfg).MODEL_CLASS(get_spec(cfg).parse_config(cfg))
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in net.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    return net.eval()


def _cache(net, history: int):
    import torch

    from localdiff.cache.kv import KVCache

    c = net.config
    g = torch.Generator().manual_seed(history)
    cache = KVCache(**net.cache_layout())
    for i in range(c.num_hidden_layers):
        k = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(torch.bfloat16)
        cache.append(i, k, v)
    cache.commit(history, None, 1)
    return cache


def _stats(v: list[float]) -> dict:
    return {"median_ms": statistics.median(v), "range_ms": [min(v), max(v)], "runs": len(v)}


def steps(quick: bool, log=print, history: int = 512, layers: int | None = None, gguf: bool = True) -> dict:
    """The step timings, resident bytes and targets of the module docstring (one pinned core)."""
    import torch

    from dataclasses import replace

    from localdiff.kernels import int4 as native4, int4_vnni, int8 as native
    from localdiff.quantize.apply import quantize_model, quantized_modules, set_activations
    from localdiff.quantize.int8 import resident_bytes
    from localdiff.quantize.fuse import fuse_model
    from localdiff.quantize.recipe import recipe_for_model

    before, threads = _pin()
    try:
        llama, why = None, None  # first: the GGUF build's temporaries are gone before the models are built
        if gguf:
            from localdiff.bench import gguf_qwen3

            llama = gguf_qwen3.stepper(layers, history, log)
            if isinstance(llama, str):
                llama, why = None, llama
        log("int4: building the random SDAR-1.7B-shaped model (bf16), then its int4 and int8 copies")
        nets = {"bf16": _random_sdar(layers)}
        recipe = recipe_for_model("sdar:1.7b")
        for q in ("int4", "int8"):
            nets[q] = quantize_model(copy.deepcopy(nets["bf16"]), recipe, quant=q)
            fuse_model(nets[q])
        res = {
            "shape": "SDAR-1.7B (Qwen3-1.7B)" + (f", {layers} layers" if layers else ""),
            "history": history,
            "threads": 1,
            "core": max(os.sched_getaffinity(0)),
            "cpu": cpu_name(),
            "kernels": {"int4": native4.status(), "int4+int8act": int4_vnni.status(), "int8": native.status()},
            "resident_bytes": {k: resident(n) for k, n in nets.items()},
            "llama_cpp": llama.info if llama is not None else {"skipped": why or "not asked"},
        }
        bf16_mods = dict(nets["bf16"].named_modules())
        qmods = quantized_modules(nets["int4"])
        res["quantized_tensor_bytes"] = {
            "int4": sum(resident_bytes(m) for m in qmods.values()),
            "bf16": sum(resident_bytes(bf16_mods[n]) for n in qmods),
        }
        caches = {k: _cache(n, history) for k, n in nets.items()}
        # the int4+int8 act opt-in: the same int4 modules, switched per call (outside the timed region)
        set_activations(nets["int4"], replace(recipe, int4_activations="int8"))
        acts = [m for m in nets["int4"].modules() if getattr(m, "act_int8", False)]
        acts += [m for m in (getattr(nets["int4"], "head_int8", None),) if getattr(m, "act_int8", False)]
        kinds = list(nets)
        if acts and int4_vnni.library() is not None:
            caches["int4+int8act"] = _cache(nets["int4"], history)
            kinds.insert(1, "int4+int8act")
        g = torch.Generator().manual_seed(1)
        ids = {n: torch.randint(0, nets["bf16"].config.vocab_size - 1, (1, n), generator=g) for n in (4, 1)}
        calls = {
            f"{k} {name}": (lambda k=k, n=n: nets[k.split("+")[0]].denoise(ids[n], caches[k]))
            for k in kinds
            for name, n in (("block", 4), ("1tok", 1))
        }
        if llama is not None:
            calls["llama.cpp Q4_K_M 1tok"] = llama.step

        def opt_in(key: str) -> None:
            for m in acts:
                m.act_int8 = key.startswith("int4+int8act")

        with torch.inference_mode():
            for k, f in calls.items():  # warm-up (and the kernels' first-use builds)
                opt_in(k)
                f()
            times = {k: [] for k in calls}
            cpu = {k: [] for k in calls}
            names = list(calls)
            for r in range(3 if quick else 7):
                for k in names[r % len(names) :] + names[: r % len(names)]:
                    opt_in(k)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    calls[k]()
                    cpu[k].append((time.thread_time() - c0) * 1e3)
                    times[k].append((time.perf_counter() - t0) * 1e3)
                log(f"int4: round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in times.items()) + " ms")
            opt_in("")
        if llama is not None:
            llama.close()
        res["steps"] = {k: _stats(v) | {"cpu_median_ms": statistics.median(cpu[k])} for k, v in times.items()}
        res["load_average"] = os.getloadavg()
        med = {k: v["median_ms"] for k, v in res["steps"].items()}
        rb = res["resident_bytes"]
        res["ratios"] = {
            "int4_over_int8_block": med["int4 block"] / med["int8 block"],
            "int4_over_int8_1tok": med["int4 1tok"] / med["int8 1tok"],
            "int4_over_bf16_block": med["int4 block"] / med["bf16 block"],
            "int4_over_bf16_resident": rb["int4"] / rb["bf16"],
            "int8_over_bf16_resident": rb["int8"] / rb["bf16"],
            "int4_over_bf16_quantized_tensors": res["quantized_tensor_bytes"]["int4"]
            / res["quantized_tensor_bytes"]["bf16"],
        }
        if "int4+int8act 1tok" in med:
            res["ratios"]["int4_int8act_over_int4_1tok"] = med["int4+int8act 1tok"] / med["int4 1tok"]
            res["ratios"]["int4_int8act_over_int8_block"] = med["int4+int8act block"] / med["int8 block"]
        if "llama.cpp Q4_K_M 1tok" in med:
            cpu_med = {k: v["cpu_median_ms"] for k, v in res["steps"].items()}
            for k in ("int4", "int4+int8act"):
                if f"{k} 1tok" in med:
                    key = k.replace("+", "_")
                    res["ratios"][f"{key}_1tok_over_llama_q4km_1tok"] = med[f"{k} 1tok"] / med["llama.cpp Q4_K_M 1tok"]
                    res["ratios"][f"{key}_1tok_over_llama_q4km_1tok_cpu"] = (
                        cpu_med[f"{k} 1tok"] / cpu_med["llama.cpp Q4_K_M 1tok"]
                    )
        res["targets"] = {
            "int4 block step <= 0.6x int8 block step": res["ratios"]["int4_over_int8_block"] <= 0.6,
            "resident bytes <= 0.3x bf16": res["ratios"]["int4_over_bf16_resident"] <= 0.3,
        }
        if "int4_1tok_over_llama_q4km_1tok" in res["ratios"]:
            res["targets"]["int4 1-token step <= 0.7x llama.cpp Q4_K_M 1-token step"] = (
                res["ratios"]["int4_1tok_over_llama_q4km_1tok"] <= 0.7
            )
        if "int4_int8act_1tok_over_llama_q4km_1tok" in res["ratios"]:
            res["targets"]["int4 + int8 act (opt-in) 1-token step <= 0.7x llama.cpp Q4_K_M"] = (
                res["ratios"]["int4_int8act_1tok_over_llama_q4km_1tok"] <= 0.7
            )
        return res
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def accuracy(ctx, seeds: int) -> dict:
    """The embedded model's held-out eval in fp32 and with int4 weights (fp32 activations), paired over seeds
    (``--per-family`` items per task family: default quick 3, full 20 of its 36–50)."""
    import torch

    import localdiff
    from localdiff.bench.eval_tasks import evaluate
    from localdiff.bench.precision import paired

    a = ctx.args
    items = ctx.items(a.per_family or (3 if a.quick else 20))
    models = {
        q: localdiff.load(a.model, device="cpu", dtype=torch.float32, quant=None if q == "float32" else q)
        for q in ("float32", "int4")
    }
    rows = []
    for k in range(seeds):
        row = {"seed": 1000 * k}
        for q, m in models.items():
            row[q] = evaluate(m, items, seed=row["seed"], batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)[
                "correct"
            ]
        ctx.log(f"int4: eval seed {row['seed']}: " + ", ".join(f"{q} {row[q]}/{len(items)}" for q in models))
        rows.append(row)
    n = len(items)
    out = {
        "model": a.model,
        "n_items": n,
        "rows": rows,
        "mean_accuracy": {q: statistics.mean(r[q] for r in rows) / n for q in models},
    }
    out["int4_minus_float32"] = paired([r["int4"] for r in rows], [r["float32"] for r in rows], n)
    p = out["int4_minus_float32"]
    out["int4_within_2pt"] = abs(p["mean_pt"]) <= 2.0
    return out


def accuracy_int8_act(ctx, seeds: int, temperature: float = 0.5, weights: str = "int4") -> dict | None:
    """tiny-bd's held-out eval: float32, ``weights`` ("int4" / "int8") and the same + int8 activations (fp32
    activations quantized per row and group of 64 by the recipe's ``int4_activations`` / ``int8_activations``
    opt-in), paired over seeds; None when tiny-bd is not installed or the CPU has no VNNI path."""
    from dataclasses import replace

    import torch

    import localdiff
    from localdiff.bench.eval_tasks import evaluate, load_items
    from localdiff.bench.precision import paired
    from localdiff.kernels import int4_vnni, int8_vnni
    from localdiff.paths import models_dir
    from localdiff.quantize.apply import set_activations

    folder = models_dir() / "tiny-bd"
    if not (folder / "model.safetensors").exists() or (int4_vnni if weights == "int4" else int8_vnni).library() is None:
        return None
    a = ctx.args
    items = load_items(models_dir() / "tiny" / "eval.jsonl", a.per_family or (3 if a.quick else 100))
    models = {"float32": localdiff.load(str(folder), device="cpu", dtype=torch.float32)}
    models[weights] = localdiff.load(str(folder), device="cpu", dtype=torch.float32, quant=weights)
    models[weights + "+int8act"] = localdiff.load(str(folder), device="cpu", dtype=torch.float32, quant=weights)
    net = models[weights + "+int8act"].net
    opted = set_activations(net, replace(net.quant_recipe, **{weights + "_activations": "int8"}))
    rows = []
    for k in range(seeds):
        row = {"seed": 1000 * k}
        for q, m in models.items():
            row[q] = evaluate(m, items, seed=row["seed"], batch_size=1, temperature=temperature)["correct"]
        ctx.log(
            f"{weights}: tiny-bd eval seed {row['seed']}: " + ", ".join(f"{q} {row[q]}/{len(items)}" for q in models)
        )
        rows.append(row)
    n = len(items)
    diff = lambda q, b: paired([r[q] for r in rows], [r[b] for r in rows], n)  # noqa: E731
    return {
        "model": "tiny-bd",
        "n_items": n,
        "temperature": temperature,
        "modules_opted_in": opted,
        "rows": rows,
        "mean_accuracy": {q: statistics.mean(r[q] for r in rows) / n for q in models},
        "weights": weights,
        f"{weights}_int8act_minus_float32": diff(weights + "+int8act", "float32"),
        f"{weights}_int8act_minus_{weights}": diff(weights + "+int8act", weights),
    }


def run(ctx) -> dict:
    a = ctx.args
    from localdiff.bench.int4_dg import canvas_steps

    sec = {
        "steps": steps(bool(a.quick), ctx.log, layers=8 if a.quick else None),
        "canvas": canvas_steps(bool(a.quick), ctx.log),
    }
    sec["accuracy"] = accuracy(ctx, a.seeds or (2 if a.quick else 4))
    sec["accuracy_int8_act"] = accuracy_int8_act(ctx, a.seeds or (2 if a.quick else 8))
    sec["accuracy_int8_act_int8"] = accuracy_int8_act(ctx, a.seeds or (2 if a.quick else 8), weights="int8")
    return sec


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    s = sec.get("steps", {})
    lines = (
        [f"### int4 weights: {s.get('shape', '?')}, {s.get('history')} history, one core ({s.get('cpu', '?')})", ""]
        if "steps" in s
        else ["### int4 weights", ""]
    )
    if "steps" in s:
        lines += ["| step | median ms | range ms | CPU ms (median) |", "|---|---:|---:|---:|"]
        lines += [
            f"| {k} | {v['median_ms']:.1f} | {v['range_ms'][0]:.1f} … {v['range_ms'][1]:.1f} | "
            f"{v.get('cpu_median_ms', float('nan')):.1f} |"
            for k, v in s["steps"].items()
        ]
        rb, r = s["resident_bytes"], s["ratios"]
        lines += [
            "",
            "resident bytes: "
            + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in rb.items())
            + f" (int4 / bf16 = {r['int4_over_bf16_resident']:.3f})",
            "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()),
            "targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in s["targets"].items()),
            f"kernels: int4 — {s['kernels']['int4']}; int4 + int8 act (opt-in) — "
            f"{s['kernels'].get('int4+int8act', '?')}; int8 — {s['kernels']['int8']}.",
        ]
        if "skipped" in s.get("llama_cpp", {}):
            lines.append(f"llama.cpp: skipped ({s['llama_cpp']['skipped']}).")
    if sec.get("canvas"):
        from localdiff.bench.int4_dg import render_md as canvas_md

        lines += [""] + canvas_md(sec["canvas"])
    acc = sec.get("accuracy")
    if acc:
        p = acc["int4_minus_float32"]
        ci = "" if p["ci_pt"] is None else f" (95 % CI {p['ci_pt'][0]:+.2f} … {p['ci_pt'][1]:+.2f})"
        lines += [
            "",
            f"held-out eval ({acc['model']}, {acc['n_items']} items, {len(acc['rows'])} paired seeds): "
            + ", ".join(f"{q} {100 * v:.2f} %" for q, v in acc["mean_accuracy"].items())
            + f"; int4 − fp32 {p['mean_pt']:+.2f} pt{ci}: "
            + ("within 2 points" if acc["int4_within_2pt"] else "NOT within 2 points"),
        ]
    for acc in (sec.get("accuracy_int8_act"), sec.get("accuracy_int8_act_int8")):
        if not acc:
            continue
        w = acc.get("weights", "int4")
        p, q = acc[f"{w}_int8act_minus_float32"], acc[f"{w}_int8act_minus_{w}"]
        ci = lambda d: "" if d["ci_pt"] is None else f" (95 % CI {d['ci_pt'][0]:+.2f} … {d['ci_pt'][1]:+.2f})"  # noqa: E731
        lines += [
            "",
            f"int8-activation opt-in, {w} dense layers ({acc['model']}, {acc['n_items']} items, {len(acc['rows'])} "
            f"paired seeds, temperature {acc['temperature']}): "
            + ", ".join(f"{k} {100 * v:.2f} %" for k, v in acc["mean_accuracy"].items())
            + f"; {w}+int8act − fp32 {p['mean_pt']:+.2f} pt{ci(p)}, − {w} {q['mean_pt']:+.2f} pt{ci(q)}",
        ]
    return lines + [""]
