"""``localdiff bench --only serve``: the cost of going through ``localdiff serve`` instead of calling the engine.

Same model object, same prompt, same seed, run alternately: in-process ``Model.stream`` (what ``localdiff gen``
does) vs a streamed ``POST /v1/chat/completions`` to a server on 127.0.0.1 in this process (uvicorn in a thread;
its model worker runs the generations). Time to first byte = time until the first piece of answer text (the first
finished canvas) reaches the caller; tokens/s = generated tokens ÷ wall time of the whole request. The server runs
with step events on (so a client that leaves stops its generation within one step); that cost is included.
"""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time

WORKLOADS = {  # name → extra sampler options: a typical short answer, and one canvas run to its step cap
    "short answer (default sampler)": {},
    "48 steps per canvas": {"max_denoising_steps": 48, "confidence_threshold": 1e-12},
}


def _inproc(model, prompt, seed, max_new, opts) -> tuple[float, float, int]:
    from localdiff.events import CanvasDone, Done

    t0 = time.perf_counter()
    first = None
    n = 0
    for ev in model.stream(prompt, max_new_tokens=max_new, seed=seed, emit_steps=False, **opts):
        if isinstance(ev, CanvasDone) and first is None and ev.text:
            first = time.perf_counter() - t0
        elif isinstance(ev, Done):
            n = len(ev.token_ids)
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, n


def _served(client, url, prompt, seed, max_new, opts, model_name="") -> tuple[float, float, int]:
    body = {"model": model_name, "messages": [{"role": "user", "content": prompt}], "seed": seed, "stream": True,
            "max_tokens": max_new, "stream_options": {"include_usage": True}}
    if opts:
        body["localdiff"] = opts
    t0 = time.perf_counter()
    first, n = None, 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, n


def _summary(rows: list[tuple[float, float, int]]) -> dict:
    ttfb = [r[0] * 1000 for r in rows]
    tps = [r[2] / r[1] for r in rows if r[1] > 0]
    return {"ttfb_ms": statistics.median(ttfb), "ttfb_ms_range": [min(ttfb), max(ttfb)],
            "tokens_per_s": statistics.median(tps), "tokens": rows[0][2]}


def measure(model, prompt: str, seeds=(0, 1, 2), reps: int = 3, max_new_tokens: int | None = None, log=print) -> dict:
    """Run each workload over ``seeds`` × ``reps``, alternating in-process and served; returns a dict with one
    row per workload: medians of TTFB (ms) and tokens/s on both paths and the overhead (served ÷ in-process − 1).

    Raises:
        LocaldiffError: starlette / uvicorn / httpx missing (the section is then reported as skipped).
    """
    try:
        import httpx
        import uvicorn
    except ImportError as e:
        from localdiff.errors import LocaldiffError

        raise LocaldiffError(f"the serve section needs uvicorn and httpx ({e})") from None
    from localdiff.serve.app import build_app
    from localdiff.serve.worker import ModelWorker

    worker = ModelWorker(lambda name: model, model.name, max_queue=4, keep_alive=None)
    worker.model = model
    # proto given explicitly: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets (else +40 ms per response on a
    # kept-alive connection: Nagle against delayed ACKs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(worker), log_level="warning"))
    worker.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    rows = []
    try:
        with httpx.Client(timeout=300) as client:
            for name, opts in WORKLOADS.items():
                _served(client, url, prompt, 0, max_new_tokens, opts, model.name)   # warm both paths
                _inproc(model, prompt, 0, max_new_tokens, opts)
                a, b = [], []
                for seed in seeds:
                    for rep in range(reps):
                        order = (0, 1) if rep % 2 == 0 else (1, 0)
                        for which in order:
                            if which == 0:
                                a.append(_inproc(model, prompt, seed, max_new_tokens, opts))
                            else:
                                b.append(_served(client, url, prompt, seed, max_new_tokens, opts, model.name))
                ia, sb = _summary(a), _summary(b)
                row = {"workload": name, "in_process": ia, "served": sb,
                       "ttfb_overhead_ms": sb["ttfb_ms"] - ia["ttfb_ms"],
                       "tokens_per_s_overhead": 1 - sb["tokens_per_s"] / ia["tokens_per_s"],
                       "same_tokens": [x[2] for x in a] == [x[2] for x in b]}
                log(f"serve: {name}: TTFB {ia['ttfb_ms']:.1f} → {sb['ttfb_ms']:.1f} ms, tokens/s "
                    f"{ia['tokens_per_s']:.1f} → {sb['tokens_per_s']:.1f} "
                    f"({100 * row['tokens_per_s_overhead']:+.1f} % overhead)")
                rows.append(row)
    finally:
        server.should_exit = True
        thread.join(10)
        worker.stop()
        sock.close()
    return {"prompt": prompt, "seeds": list(seeds), "reps": reps, "rows": rows}


def render_md(sec: dict) -> list[str]:
    """Markdown lines for the report."""
    if "rows" not in sec:
        return []
    out = ["### Through `localdiff serve` vs in-process (same model, prompt and seeds)", "",
           f"Prompt {sec['prompt']!r}, seeds {sec['seeds']}, {sec['reps']} repetitions each, alternating; "
           "streamed `/v1/chat/completions` on 127.0.0.1 vs `Model.stream`. TTFB = first answer text.", "",
           "| workload | TTFB in-process ms | TTFB served ms | tokens/s in-process | tokens/s served | overhead "
           "(tokens/s) | same token counts |", "|---|---:|---:|---:|---:|---:|:---:|"]
    for r in sec["rows"]:
        a, b = r["in_process"], r["served"]
        out.append(f"| {r['workload']} | {a['ttfb_ms']:.1f} | {b['ttfb_ms']:.1f} | {a['tokens_per_s']:.1f} | "
                   f"{b['tokens_per_s']:.1f} | {100 * r['tokens_per_s_overhead']:+.1f} % | "
                   f"{'yes' if r['same_tokens'] else 'no'} |")
    return out + [""]
