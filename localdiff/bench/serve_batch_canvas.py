"""``localdiff bench --only serve-batch-canvas``: step-level batching in ``localdiff serve`` for the canvas family —
the table of ``serve-batch`` (:mod:`localdiff.bench.serve_batch`: 1, 2, 4 and 8 concurrent streamed requests,
batched vs one at a time; aggregate and per-request tokens/s, TTFT) for the random 150M DiffusionGemma shape
(:data:`localdiff.bench.scale.SHAPES` "150M": hidden 448, 6 layers, 128 experts top-8 of width 112, vocab 32,768,
canvas 256; the flagship's proportions) in bf16 with fused projections, as ``localdiff.load`` makes it on a CPU,
and the fraction of this core's measured bf16 GEMM peak that one packed canvas step reaches at 1, 2, 4 and 8
requests (:func:`gemm_fraction`). A request is one canvas of 256 tokens at 6 denoising steps (random weights never
converge: every canvas runs its cap); each cell is the median [range] of 3 rounds (1 with ``--quick``).

Step FLOPs are counted from the shapes (:func:`localdiff.bench.scale.flops_per_step`: every canvas row's q/k/v/o,
attention over a 64-token history + the canvas, dense MLP, router, its top-8 experts (routed rows only), the
self-conditioning MLP and soft-embedding product, the LM head) × the requests; the step is the forward alone
(:func:`localdiff.arch.packed_canvas.canvas_denoise`, with self-conditioning logits; one request: ``denoise``), timed by
this thread's CPU time (a shared core's time-slicing left out, as the peak is), median and range over repetitions;
the peak is :func:`localdiff.bench.scale._gemm_peak` (a 1024×2048×2048 bf16 GEMM) measured in the same run.
"""

from __future__ import annotations

import statistics
import time

from localdiff.bench import serve_batch

HISTORY = 64


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (module docstring)."""
    import torch

    from localdiff.kernels import experts

    t0 = time.perf_counter()
    model, text = build()
    log(f"serve-batch-canvas: {model.name} built in {time.perf_counter() - t0:.0f} s")
    rows = {
        "gemm": gemm_fraction(model, text, reps=3 if quick else 7, log=log),
        "cpu": cpu_compare(model, reps=1 if quick else 3, log=log),
    }
    rows = serve_batch.run_family(model, "canvas", "bfloat16", model.config.canvas_length, 1 if quick else 3, log, rows)
    name, tokens = model.name, model.config.canvas_length
    if not quick:  # the 1B shape's forward too: there the experts are a larger part of the step
        del model
        big, text = build("1B")
        rows["gemm_1b"] = gemm_fraction(big, text, reps=3, log=log)
        del big
    rows["kernels"] = "torch bf16 GEMMs, experts: " + (
        "native" if experts.library() is not None else f"torch bf16 stream ({experts.status()})"
    )
    return {
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "max_tokens": tokens,
        "model": name,
        "families": {"canvas 150M, bfloat16": rows},
    }


def build(size: str = "150M"):
    """The random DiffusionGemma of :data:`localdiff.bench.scale.SHAPES` ``size`` (module docstring) as an engine
    Model (bf16, no EOS; the embedded tokenizer reads ids past its vocabulary as id mod its size) and its text
    config."""
    import torch

    import localdiff
    from localdiff.arch import get_arch, get_spec
    from localdiff.bench.scale import SHAPES, text_config
    from localdiff.engine import Model

    text = text_config(*SHAPES[size])
    raw = {
        "model_type": "diffusion_gemma",
        "canvas_length": 256,
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "text_config": dict(text, eos_token_id=1, pad_token_id=0),
    }
    with torch.device("meta"):
        net = get_arch(raw).MODEL_CLASS(get_spec(raw).parse_config(raw))
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.copy_(torch.randn(p.shape, generator=g).mul_(0.02))
        for b in net.buffers():
            b.fill_(1.0)
    net.eval()
    net.fuse_projections()
    tok = localdiff.load("tiny").tokenizer
    model = Model(
        net,
        net.config,
        serve_batch._WideVocab(tok, 365),
        None,
        f"random-diffusiongemma-{size}-bf16",
        "cpu",
        torch.bfloat16,
        None,
        {"eos_token_id": [], "max_new_tokens": 256},
    )
    return model, text


def cpu_compare(model, reps: int = 3, log=print) -> dict:
    """In process, N requests (one canvas each, the section's options, seeds 0..N-1) run one after the other vs as
    lanes of one :class:`localdiff.engine.batch.Batcher`, alternating, timed by the process's CPU time (every
    thread: the lanes' decoders too; a shared core's time-slicing left out): per N, the median and range of
    ``alone_cpu_s`` / ``batched_cpu_s`` and their ratio (tokens per CPU second, batched ÷ alone)."""
    from localdiff.engine.batch import Batcher

    opts = dict(serve_batch.FAMILIES["canvas"], max_new_tokens=model.config.canvas_length)

    def one(m, i):
        for _ in m.stream(serve_batch.PROMPTS[i % len(serve_batch.PROMPTS)], seed=i, **opts):
            pass

    b = Batcher(model)

    def batched(n):
        for i in range(n):
            b.add(lambda view, i=i: one(view, i))
        while b.lanes:
            b.step()

    batched(8)  # warm-up: the row-exactness probes of every width seen
    out = {}
    for n in (2, 4, 8):
        a, t = [], []
        for r in range(reps):
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                c0 = time.process_time()
                batched(n) if side else [one(model, i) for i in range(n)]
                (t if side else a).append(time.process_time() - c0)
        ratio = [x / y for x, y in zip(a, t)]
        out[str(n)] = {
            "alone_cpu_s": statistics.median(a),
            "alone_range": [min(a), max(a)],
            "batched_cpu_s": statistics.median(t),
            "batched_range": [min(t), max(t)],
            "ratio": statistics.median(ratio),
            "ratio_range": [min(ratio), max(ratio)],
        }
        log(
            f"serve-batch-canvas: {n} requests, CPU s alone {statistics.median(a):.2f}, batched "
            f"{statistics.median(t):.2f} ({statistics.median(ratio):.2f}× tokens per CPU second)"
        )
    return out


def _calls(model, n: int):
    """n denoise calls of a canvas after its own 64-token history, with self-conditioning logits."""
    import torch

    net, v = model.net, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        cache = model.new_cache()
        net.prefill(torch.randint(3, v, (1, HISTORY), generator=g), cache)
        out.append(
            {
                "canvas_ids": torch.randint(3, v, (1, 256), generator=g),
                "cache": cache,
                "self_conditioning_logits": torch.randn(1, 256, v, generator=g),
            }
        )
    return out


def gemm_fraction(model, text: dict, reps: int = 5, log=print) -> dict:
    """Per request count: GFLOP/s of one canvas step (the forward) and its fraction of the bf16 GEMM peak."""
    import torch

    from localdiff.arch.packed_canvas import canvas_denoise
    from localdiff.bench.scale import _gemm_peak, flops_per_step
    from localdiff.engine.batch_canvas import CanvasRowPolicy

    per = sum(flops_per_step(text, 256, HISTORY).values())
    policy = CanvasRowPolicy(model.net)
    peak = _gemm_peak(torch.bfloat16)
    res = {"peak_gflops": peak, "flops_per_request_step": per, "requests": {}}
    for n in (1, 2, 4, 8):
        calls = _calls(model, n)
        times = []
        for r in range(reps + 1):
            t0 = time.thread_time()
            if n == 1:
                a = calls[0]
                model.net.denoise(a["canvas_ids"], a["cache"], a["self_conditioning_logits"])
            else:
                canvas_denoise(model.net, calls, policy)
            if r:  # (the first: warm-up)
                times.append(time.thread_time() - t0)
        med = statistics.median(times)
        res["requests"][str(n)] = {
            "step_s": med,
            "step_s_min": min(times),
            "step_s_max": max(times),
            "gflops": n * per / med / 1e9,
            "fraction": n * per / med / 1e9 / peak,
        }
        log(
            f"serve-batch-canvas: {model.name} step, {n} request(s): {med * 1000:.0f} ms, "
            f"{n * per / med / 1e9:.1f} GFLOP/s = {100 * n * per / med / 1e9 / peak:.1f} % of {peak:.0f}"
        )
    res["peak_gflops_after"] = _gemm_peak(torch.bfloat16)
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section: the table of ``serve-batch`` and the step's fraction of the GEMM peak."""
    table = serve_batch.render_md(dict(sec, layers=6))[4:]
    head = [
        "## serve: step-level batching of DiffusionGemma (150M shape, `--max-batch 8`) vs one at a time",
        "",
        f"Random 150M DiffusionGemma shape in bf16 (hidden 448, 6 layers, 128 experts top-8, vocab 32,768), "
        f"{sec['threads']} thread(s), CPU capability {sec.get('cpu_capability')}; a request is one canvas of 256 "
        "tokens at 6 denoising steps, streamed; cells: median [range] over the rounds; columns as in serve-batch.",
        "",
    ]
    lines = head + table
    for rows in sec["families"].values():
        lines += _cpu_md(rows.get("cpu")) + _gemm_md(rows.get("gemm"), "150M") + _gemm_md(rows.get("gemm_1b"), "1B")
    return lines


def _cpu_md(c: dict | None) -> list[str]:
    if not c:
        return []
    lines = [
        "",
        "In process, by CPU time (all threads; robust to a shared core's time-slicing), N requests one after "
        "the other vs as lanes of one batch: median [range].",
        "",
        "| requests | CPU s alone | CPU s batched | tokens per CPU s, batched ÷ alone |",
        "|---:|---:|---:|---:|",
    ]
    for n, r in c.items():
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {n} | {r['alone_cpu_s']:.2f} | {r['batched_cpu_s']:.2f} | {r['ratio']:.2f}× [{lo:.2f}–{hi:.2f}] |"
        )
    return lines


def _gemm_md(g: dict | None, size: str) -> list[str]:
    if not g:
        return []
    lines = [
        "",
        f"Canvas {size} shape, one packed step (the forward, self-conditioning on; CPU time, median of "
        f"repetitions): bf16 GEMM peak {g['peak_gflops']:.0f} GFLOP/s before, "
        f"{g['peak_gflops_after']:.0f} after; {g['flops_per_request_step'] / 1e9:.1f} GFLOP per request.",
        "",
        "| requests | step ms (range) | GFLOP/s | fraction of peak |",
        "|---:|---:|---:|---:|",
    ]
    for n, r in g["requests"].items():
        lines.append(
            f"| {n} | {r['step_s'] * 1000:.0f} ({r['step_s_min'] * 1000:.0f}–{r['step_s_max'] * 1000:.0f}) | "
            f"{r['gflops']:.1f} | {100 * r['fraction']:.1f} % |"
        )
    return lines
