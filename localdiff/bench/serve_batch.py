"""``localdiff bench --only serve-batch``: step-level batching in ``localdiff serve`` (``--max-batch``) — 1, 2, 4 and
8 concurrent streamed requests vs the same requests one at a time.

Models: random weights in the SDAR-1.7B shape (:data:`localdiff.bench.block.SDAR_1_7B`: hidden 2048, 16 heads / 8
KV heads, MLP 6144, vocabulary 151,936; int8 weights with the ``sdar:1.7b`` recipe and fused q/k/v and gate/up, as
``localdiff.load`` makes them on a CPU) as a block model (SDAR, block 4, ``low_confidence_static``: 4 steps per
block) and as a masked model (A2D-Qwen3 layout, Fast-dLLM dual cache, blocks of 8, one token per step). The layer
count is ``LOCALDIFF_BENCH_BATCH_LAYERS`` (default 28, the real depth; ``--quick`` 4): fewer layers keep each
step's matmul shapes and the LM head as they are and only shorten the stack (a shared 2-core machine cannot run
the full depth in minutes). No EOS (every request decodes its ``max_tokens``); the embedded model's tokenizer reads
the prompts (ids past its vocabulary decode as id mod its size).

Each run: ``localdiff serve``'s app (uvicorn in a thread, its model worker with ``max_batch`` 8 or 1) in this process;
the model thread is held while the N requests are queued by N client processes (``serve_client.py``), then released
at once. Per request: time to first token (TTFT: release → arrival of the first content delta) and tokens/s
(completion tokens ÷ release → arrival of the stream's end); aggregate tokens/s = all tokens ÷ the last end.
``identical``: 3 short requests run as lanes of one batch in process get the tokens they get alone.

The canvas family (the 150M DiffusionGemma shape) is the section ``serve-batch-canvas``
(:mod:`localdiff.bench.serve_batch_canvas`), through :func:`run_family`: cells there are medians [range] over
several rounds. The 1-minute load average is recorded before and after each family.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

LAYERS_ENV = "LOCALDIFF_BENCH_BATCH_LAYERS"
CONCURRENCY = (1, 2, 4, 8)
PROMPTS = [
    "What is 41 + 93?",
    "Tell me a story about a cat.",
    "Count from one to ten.",
    "Name three colours.",
    "Spell banana backwards.",
    "What is the capital of France?",
    "hi",
    "Write a haiku about rain.",
]
#: (family, precision) runs: int8 is the CPU default; bf16 is where a step is weight-bandwidth-bound on a CPU
#: whose native int8 kernel has no AMX (its FMA path's time grows with the rows: nothing to share); int8+int8act:
#: the recipe opt-in ``int8_activations = "int8"`` (int8 × int8 VNNI kernel, :mod:`localdiff.kernels.int8_vnni`)
RUNS = (("block", "bfloat16"), ("masked", "bfloat16"), ("block", "int8"), ("block", "int8+int8act"))
FAMILIES = {
    "block": {"remasking_strategy": "low_confidence_static", "steps": 4, "temperature": 0.0},
    "masked": {"kv_cache": "dual", "block_length": 8, "temperature": 0.0},
    "canvas": {"max_denoising_steps": 6, "confidence_threshold": 1e-12},
}  # (serve-batch-canvas)


class _WideVocab:
    """The embedded tokenizer for a random model with a wider vocabulary: ids past its own decode as id mod size."""

    def __init__(self, tok, size: int) -> None:
        self.__dict__["_tok"], self.__dict__["_n"] = tok, size

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __setattr__(self, name, value):
        setattr(self._tok, name, value)

    def decode(self, ids, *a, **kw):
        return self._tok.decode([int(i) % self._n for i in ids], *a, **kw)


def build(family: str, layers: int, precision: str = "int8", log=print):
    """The random model (module docstring) as an engine Model: ``precision`` "int8" (weights int8, activations in
    the faster of fp32 / bf16 here), "int8+int8act" (the same with the recipe's ``int8_activations = "int8"``) or
    "bfloat16"."""
    import torch

    import localdiff
    from localdiff.arch import get_arch, get_spec
    from localdiff.bench.block import SDAR_1_7B, fastest_dtype
    from localdiff.engine import Model
    from localdiff.quantize.fuse import fuse_model
    from localdiff.quantize.int8 import quantize_model
    from localdiff.quantize.recipe import recipe_for_model

    cfg = dict(SDAR_1_7B, num_hidden_layers=layers)
    if family == "masked":
        cfg = {k: v for k, v in cfg.items() if k != "block_size"}
        cfg.update(model_type="a2d-qwen3", architectures=["A2DQwen3LMHeadModel"])
    int8 = precision.startswith("int8")
    dtype = fastest_dtype(log)[0] if int8 else torch.bfloat16
    with torch.device("meta"):
        net = get_arch(cfg).MODEL_CLASS(get_spec(cfg).parse_config(cfg))
    net = net.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.copy_(torch.randn(p.shape, generator=g).mul_(0.02))
    net.eval()
    if int8:
        recipe = recipe_for_model("sdar:1.7b")
        quantize_model(net, recipe)
        if precision == "int8+int8act":
            from dataclasses import replace

            from localdiff.quantize.apply import set_activations

            set_activations(net, replace(recipe, int8_activations="int8"))
        fuse_model(net)
    tok = localdiff.load("tiny").tokenizer
    return Model(
        net,
        net.config,
        _WideVocab(tok, 365),
        None,
        f"random-{family}-{layers}L-{precision}",
        "cpu",
        dtype,
        "int8" if int8 else None,
        {"eos_token_id": [], "max_new_tokens": 16},
    )


def _server(model, max_batch: int):
    """``localdiff serve``'s app around ``model`` (uvicorn in a thread) with ``--max-batch max_batch``."""
    import socket
    import types

    import uvicorn

    from localdiff.serve import uvicorn_config
    from localdiff.serve.app import build_app
    from localdiff.serve.names import ModelNames
    from localdiff.serve.worker import ModelWorker

    srv = types.SimpleNamespace()
    srv.worker = ModelWorker(lambda name: model, model.name, max_queue=16, keep_alive=None, max_batch=max_batch)
    srv.worker.model = model
    srv.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    srv.sock.bind(("127.0.0.1", 0))
    srv.server = uvicorn.Server(
        uvicorn_config(
            build_app(srv.worker, names=ModelNames([model.name], model.name)),
            log_level="warning",
            timeout_keep_alive=600,
        )
    )
    srv.worker.start()
    srv.thread = threading.Thread(target=srv.server.run, kwargs={"sockets": [srv.sock]}, daemon=True)
    srv.thread.start()
    while not srv.server.started:
        time.sleep(0.01)
    return srv


def identical(model, family: str, n: int = 3, max_tokens: int = 4) -> bool:
    """Whether ``n`` requests run as lanes of one batch (:class:`localdiff.engine.batch.Batcher`) get the tokens
    they get alone."""
    from localdiff.engine.batch import Batcher
    from localdiff.events import Done

    def ask(m, i):
        done = None
        for ev in m.stream(PROMPTS[i], max_new_tokens=max_tokens, seed=i, **FAMILIES[family]):
            done = ev if isinstance(ev, Done) else done
        return done.token_ids

    want = [ask(model, i) for i in range(n)]
    got: list = [None] * n
    b = Batcher(model)
    for i in range(n):
        b.add(lambda view, i=i: got.__setitem__(i, ask(view, i)))
    while b.lanes or b.steps == 0:
        b.step()
    return got == want


def _round(srv, model, n: int, family: str, max_tokens: int) -> dict:
    """N concurrent streamed requests, queued while the model thread is held, released together."""
    client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_client.py")
    port = str(srv.sock.getsockname()[1])
    gate = threading.Event()
    threading.Thread(target=srv.worker.call, args=(gate.wait,), daemon=True).start()
    procs = []
    for i in range(n):
        body = {
            "model": model.name,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "localdiff": FAMILIES[family],
        }
        p = subprocess.Popen([sys.executable, client, port], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        p.stdin.write(json.dumps({"path": "/v1/chat/completions", "body": json.dumps(body)}) + "\n")
        p.stdin.close()
        procs.append(p)
    t0 = time.monotonic()
    while srv.worker.queued < n and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    release = time.perf_counter()
    gate.set()
    outs = []
    for p in procs:
        line = p.stdout.readline()
        p.wait(60)
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"serve-batch client: {out['error']}")
        outs.append(out)
    ends = [o["t0"] + o["total"] - release for o in outs]
    ttft = [o["t0"] + o["first"] - release for o in outs]
    toks = [o["n"] for o in outs]
    per = [t / e for t, e in zip(toks, ends)]
    return {
        "aggregate_tps": sum(toks) / max(ends),
        "per_request_tps": statistics.median(per),
        "per_request_tps_min": min(per),
        "ttft_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "tokens": sum(toks),
    }


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (module docstring)."""
    import torch

    layers = int(os.environ.get(LAYERS_ENV) or (4 if quick else 28))
    max_tokens = 8 if quick else 16
    res = {
        "layers": layers,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "families": {},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    for family, precision in RUNS:
        t0 = time.perf_counter()
        model = build(family, layers, precision, log)
        log(f"serve-batch: {model.name} built in {time.perf_counter() - t0:.0f} s")
        rows = run_family(model, family, precision, max_tokens, 1, log)
        from localdiff.quantize.choose import kernel_summary

        rows["kernels"] = kernel_summary() if precision.startswith("int8") else "torch bf16 GEMMs"
        if precision == "int8+int8act":
            from localdiff.kernels import int8_vnni

            rows["kernels"] += f"; linears ≤ 64 rows: {int8_vnni.status()}"
        res["families"][f"{family}, {precision}"] = rows
    return res


def run_family(model, family: str, precision: str, tokens: int, reps: int, log=print, rows: dict | None = None) -> dict:
    """The table rows of one model: the in-process exactness check, then ``reps`` rounds of 1, 2, 4 and 8
    concurrent requests through a batching and a one-at-a-time server (alternating), each cell the median of its
    rounds with their range; the 1-minute load average before and after."""
    rows = dict(rows or {}, identical=identical(model, family), reps=reps, load=[os.getloadavg()[0]])
    servers = {mb: _server(model, mb) for mb in (1, 8)}
    runs: dict = {}
    try:
        for srv in servers.values():  # warm-up: kernel choices and allocations of every shape used
            _round(srv, model, 1, family, tokens)
        for k in range(reps):
            for i, n in enumerate(CONCURRENCY):  # the two servers alternate (ABBA): the machine's load drifts
                for mb in (1, 8) if (i + k) % 2 == 0 else (8, 1):
                    r = _round(servers[mb], model, n, family, tokens)
                    runs.setdefault((str(n), "batched" if mb > 1 else "one_at_a_time"), []).append(r)
                    log(
                        f"serve-batch: {family} {precision} {n} concurrent, max_batch {mb}: "
                        f"{r['aggregate_tps']:.2f} tok/s aggregate, {r['per_request_tps']:.2f} per request, "
                        f"TTFT {r['ttft_s']:.2f} s"
                    )
        for (n, side), rs in runs.items():
            rows.setdefault(n, {})[side] = _merge(rs)
        rows["load"].append(os.getloadavg()[0])
    finally:
        for srv in servers.values():
            srv.server.should_exit = True
            srv.thread.join(10)
            srv.worker.stop(wait=30)
            srv.sock.close()
    base = rows["1"]["one_at_a_time"]  # today's server, one request: the single-stream rates
    for n, r in rows.items():
        if not n.isdigit():
            continue
        b = r["batched"]
        r["speedup_aggregate"] = b["aggregate_tps"] / base["aggregate_tps"]
        r["per_request_vs_single"] = b["per_request_tps"] / base["per_request_tps"]
        r["vs_one_at_a_time"] = b["aggregate_tps"] / r["one_at_a_time"]["aggregate_tps"]  # adjacent rounds
    return rows


def _merge(rounds: list[dict]) -> dict:
    """Rounds of one (requests, server) cell: the median of each figure, and the range of the three shown."""
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for k in ("aggregate_tps", "per_request_tps", "ttft_s"):
        out[k + "_range"] = [min(r[k] for r in rounds), max(r[k] for r in rounds)]
    return out


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = [
        "## serve: step-level batching (`--max-batch 8`) vs one at a time",
        "",
        f"Random SDAR-1.7B-shaped models with {sec['layers']} layers, {sec['threads']} thread(s), "
        f"CPU capability {sec.get('cpu_capability')}, "
        f"{sec['max_tokens']} tokens per request, streamed; block: SDAR static 4 steps per block of 4; masked: "
        "dual cache, blocks of 8. Aggregate tokens/s, median per-request tokens/s and median TTFT; the "
        "one-at-a-time server (`--max-batch 1`) gets the same requests; × = over its 1-request rate; the last "
        "column: batched ÷ one at a time at the same N (adjacent rounds: robust to a drifting load).",
        "",
        "| family, precision | requests | batched agg. tok/s | per request | TTFT s | one at a time agg. | "
        "per request | TTFT s | batched ÷ one at a time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fam, rows in sec["families"].items():
        for n, r in rows.items():
            if not n.isdigit():
                continue
            b, s = r["batched"], r["one_at_a_time"]
            lines.append(
                f"| {fam} | {n} | {b['aggregate_tps']:.2f}{_rng(b, 'aggregate_tps')} "
                f"({r['speedup_aggregate']:.2f}×) | {b['per_request_tps']:.2f}{_rng(b, 'per_request_tps')} "
                f"({r['per_request_vs_single']:.2f}×) | {b['ttft_s']:.2f}{_rng(b, 'ttft_s')} | "
                f"{s['aggregate_tps']:.2f}{_rng(s, 'aggregate_tps')} | "
                f"{s['per_request_tps']:.2f}{_rng(s, 'per_request_tps')} | "
                f"{s['ttft_s']:.2f}{_rng(s, 'ttft_s')} | "
                f"{r.get('vs_one_at_a_time', b['aggregate_tps'] / s['aggregate_tps']):.2f}× |"
            )
    same = ", ".join(f"{f}: {'yes' if r.get('identical') else 'NO'}" for f, r in sec["families"].items())
    kern = "; ".join(f"{f}: {r.get('kernels')}" for f, r in sec["families"].items())
    load = "; ".join(
        f"{f}: {r['load'][0]:.2f} → {r['load'][-1]:.2f}" for f, r in sec["families"].items() if r.get("load")
    )
    return lines + [
        "",
        f"Batched tokens equal the same requests' alone (3 lanes, in process): {same}. Kernels: "
        f"{kern}. Load average (1 min) before → after: {load or 'not recorded'}.",
        "",
    ]


def _rng(r: dict, key: str) -> str:
    """ " [lo–hi]": the range of a cell measured over several rounds (its median shown), else nothing."""
    lo_hi = r.get(key + "_range")
    return f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi and lo_hi[0] != lo_hi[1] else ""
