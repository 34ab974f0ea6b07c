"""``localdiff bench --only serve``: the cost of going through ``localdiff serve`` instead of calling the engine.

Same model object, same prompt, same seeds, run alternately (ABBA order): in-process ``Model.stream`` without step
events (what ``localdiff gen`` does) vs a streamed ``POST /v1/chat/completions`` to ``localdiff serve``'s app on
127.0.0.1 in this process, with the uvicorn config ``localdiff serve`` uses (:func:`localdiff.serve.uvicorn_config`;
uvicorn in a thread, its model worker runs the generations). The in-process runs execute *in the server's model
thread* (``ModelWorker.call``), so both paths use the same thread, the same OpenMP team and the same torch thread
count: only the HTTP path differs. The client is a separate process, as a real client is (``serve_client.py``: a
minimal HTTP/1.1 client on one kept-alive socket, TCP_NODELAY, reading the SSE events as they come).

Pinning (:func:`localdiff.bench.serve_harness.layouts`): the model thread runs on the CPUs this process was started on (``taskset -c 1``), the
client process on the other CPUs. Layouts: the event loop on the model's CPUs ("server on one core": its CPU
comes straight out of the model's time), the event loop on the other CPUs ("event loop on another core", as on a
user's machine whose other cores are idle), and everything on the model's CPUs, the client too ("client on the same
core": its CPU and context switches count as overhead). Each HTTP stack is measured: uvloop + httptools (base dependencies where
they install; what uvicorn's "auto" picks) when installed, and asyncio + h11 (where uvloop does not install).

Time to first byte (TTFB) = time until the first piece of answer text reaches the caller (in-process: the first
finished canvas's text; served: the arrival at the client process of the bytes holding the first content delta,
i.e. the return of its ``recv()``, before the client parses them: the in-process consumer does nothing with its text
either); tokens/s = generated tokens ÷ wall time of the whole request (served: to the arrival of the stream's
end), with the same token count on both paths (in-process: the ids returned; served: ``usage.completion_tokens``;
checked per run). Overheads are per ABBA pair (same seed, back to back), reported as
median and range. CPU ms per request are per thread (``pthread_getcpuclockid``; the client's is its own
``thread_time``): on a machine shared with other jobs they are steadier than wall times. The load average is
recorded before and after each stack × layout.
"""

from __future__ import annotations

import os
import statistics
import time

from localdiff.bench import serve_harness

WORKLOADS = {  # name → (extra sampler options, canvas events asked for): a typical short answer, canvases run
    "short answer (default sampler)": ({}, "none"),  # to their step cap, and the canvas-events extension
    "12 steps per canvas": ({"max_denoising_steps": 12, "confidence_threshold": 1e-12}, "none"),
    "48 steps per canvas": ({"max_denoising_steps": 48, "confidence_threshold": 1e-12}, "none"),
    "short answer, canvas events (steps)": ({}, "steps"),
}


def _inproc(model, prompt, seed, max_new, opts, events) -> tuple[float, float, int]:
    from localdiff.events import CanvasDone, Done

    t0 = time.perf_counter()
    first = None
    n = 0
    for ev in model.stream(prompt, max_new_tokens=max_new, seed=seed, emit_steps=events == "steps", **opts):
        if isinstance(ev, CanvasDone) and first is None and ev.text:
            first = time.perf_counter() - t0
        elif isinstance(ev, Done):
            n = len(ev.token_ids)
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, n


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _spread(values: list[float]) -> dict:
    """Median, quartiles, range, and a distribution-free 95 % confidence interval of the median ("ci",
    :func:`median_ci`)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "min": min(values),
        "max": max(values),
        "ci": median_ci(values),
    }


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (95 % for z = 1.96): the sorted values
    at 1-based ranks round(n/2 − z·√n/2) and round(1 + n/2 + z·√n/2) (the sign test's interval, binomial(n, ½)
    approximated as normal; e.g. Conover, *Practical Nonparametric Statistics*, 3rd ed., §3.2; n = 100: the 40th
    and 61st). Fewer than 6 values: their range."""
    v = sorted(values)
    n = len(v)
    if n < 6:
        return (v[0], v[-1])
    half = z * n**0.5 / 2
    lo, hi = max(round(n / 2 - half) - 1, 0), min(round(n / 2 + half + 1) - 1, n - 1)
    return (v[lo], v[hi])


def _summary(rows: list[tuple], cpu: list[dict]) -> dict:
    out = {
        "ttfb_ms": _stats([r[0] * 1000 for r in rows]),
        "tokens_per_s": _stats([r[2] / r[1] for r in rows if r[1] > 0]),
        "tokens": [r[2] for r in rows],
    }
    out["cpu_ms"] = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]} if cpu else {}
    out["cpu_total_ms"] = _stats([sum(c.values()) for c in cpu]) if cpu else {}
    return out


def _body(prompt, seed, max_new, opts, events, model_name) -> dict:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": prompt}],
        "seed": seed,
        "stream": True,
        "max_tokens": max_new,
        "stream_options": {"include_usage": True},
    }
    ext = {**opts, **({"events": events} if events != "none" else {})}
    if ext:
        body["localdiff"] = ext
    return body


def _pair_overheads(pairs: list[tuple]) -> dict:
    """Per ABBA pair (same seed, back to back): TTFB served ÷ in-process − 1 and tokens/s 1 − served ÷ in-process
    (fractions), each as median / quartiles / range."""
    ttfb = [s[0] / i[0] - 1 for i, s in pairs]
    tps = [1 - (s[2] / s[1]) / (i[2] / i[1]) for i, s in pairs]
    return {"ttfb": _spread(ttfb), "tokens_per_s": _spread(tps)}


def _measure_one(
    srv: _Server, model, prompt, seeds, reps, max_new_tokens, warmup, log, min_seconds: float = 0.0
) -> list[dict]:
    def run(which, seed, opts, events):
        c0 = srv.clocks.read()
        if which == "in_process":
            r = srv.worker.call(lambda: _inproc(model, prompt, seed, max_new_tokens, opts, events))
            client = 0.0
        else:
            out = srv.post(_body(prompt, seed, max_new_tokens, opts, events, model.name))
            r = (out["first"] if out["first"] is not None else out["total"], out["total"], out["n"])
            client = out["cpu_ms"]
        c1 = srv.clocks.read()  # in-process: the caller only waits and the loop idles
        return r, {"client": client, **{k: (c1[k] - c0[k]) * 1000 for k in c0}}

    rows = []
    for name, (opts, events) in WORKLOADS.items():
        t_warm = time.perf_counter()
        for i in range(warmup):
            run("served", i, opts, events)
            run("in_process", i, opts, events)
        n_reps = _reps_for(reps, min_seconds, (time.perf_counter() - t_warm) / max(warmup, 1), len(seeds))
        got = {"in_process": ([], []), "served": ([], [])}
        pairs = []
        k = 0
        for seed in seeds:
            for _ in range(n_reps):
                order = ("in_process", "served") if k % 4 in (0, 3) else ("served", "in_process")
                k += 1
                pair = {}
                for which in order:
                    r, cpu = run(which, seed, opts, events)
                    got[which][0].append(r)
                    got[which][1].append(cpu)
                    pair[which] = r
                pairs.append((pair["in_process"], pair["served"]))
        ia, sb = _summary(*got["in_process"]), _summary(*got["served"])
        if ia["tokens"] != sb["tokens"]:
            raise RuntimeError(
                f"serve bench, {name}: token counts differ between the paths ({ia['tokens']} vs {sb['tokens']})"
            )
        row = {
            "workload": name,
            "reps": n_reps,
            "in_process": ia,
            "served": sb,
            "pairs": _pair_overheads(pairs),
            "ttfb_overhead_ms": sb["ttfb_ms"]["median"] - ia["ttfb_ms"]["median"],
            "tokens_per_s_overhead": 1 - sb["tokens_per_s"]["median"] / ia["tokens_per_s"]["median"],
            "cpu_overhead": sb["cpu_total_ms"]["median"] / ia["cpu_total_ms"]["median"] - 1,
            "same_tokens": True,
        }
        po = row["pairs"]
        log(
            f"serve: {name}: TTFB {ia['ttfb_ms']['median']:.1f} → {sb['ttfb_ms']['median']:.1f} ms "
            f"({100 * po['ttfb']['median']:+.1f} %, 95 % CI {_ci_pct(po['ttfb'])}), tokens/s "
            f"{ia['tokens_per_s']['median']:.1f} → {sb['tokens_per_s']['median']:.1f} "
            f"({100 * po['tokens_per_s']['median']:+.1f} % overhead, 95 % CI {_ci_pct(po['tokens_per_s'])}, "
            f"{len(pairs)} pairs {100 * po['tokens_per_s']['min']:+.1f}…{100 * po['tokens_per_s']['max']:+.1f}); "
            f"CPU ms/request "
            f"(client, loop, model) in-process "
            + ", ".join(f"{v:.2f}" for v in ia["cpu_ms"].values())
            + ", served "
            + ", ".join(f"{v:.2f}" for v in sb["cpu_ms"].values())
        )
        rows.append(row)
    return rows


def _reps_for(reps: int, min_seconds: float, warm_pair_s: float, n_seeds: int) -> int:
    """Runs per seed and path: ``reps``, or more for a short workload, so that its pairs take about ``min_seconds``
    (from the warm-up pairs' mean time ``warm_pair_s``), at most 20 × ``reps``: the per-pair spread of a ~30 ms
    answer (±20–30 % on a shared 2-core machine) needs a few hundred pairs for a median within ~±1 %."""
    if min_seconds <= 0 or warm_pair_s <= 0:
        return reps
    return max(reps, min(20 * reps, int(min_seconds / (warm_pair_s * n_seeds)) + 1))


def _ci_pct(s: dict) -> str:
    lo, hi = s["ci"]
    return f"{100 * lo:+.1f}…{100 * hi:+.1f} %"


def measure(
    model,
    prompt: str,
    seeds=(0, 1, 2),
    reps: int = 10,
    max_new_tokens: int | None = None,
    warmup: int = 3,
    log=print,
    stacks=None,
    layouts=None,
    min_seconds: float = 0.0,
) -> dict:
    """For each HTTP stack (:func:`serve_harness.stacks`) and thread layout (:func:`localdiff.bench.serve_harness.layouts`), run each workload over ``seeds``
    × ``reps`` per path (more for a workload whose warm-up pairs show that its pairs would take under
    ``min_seconds``: :func:`_reps_for`), ABBA-alternating in-process and served.

    Returns:
        {"prompt", "seeds", "reps", "warmup", "cpus", "runs": [{"stack": {"loop", "http"}, "layout": {"name",
        "model", "loop", "client": CPU lists}, "load_before", "load_after", "rows": [{"workload", "in_process",
        "served", "pairs", "ttfb_overhead_ms", "tokens_per_s_overhead", "cpu_overhead", "same_tokens"}]}]}; per path:
        TTFB ms and tokens/s as median/min/max, the token counts, median CPU ms per request per thread ("client":
        the client process, "loop", "model"; in-process the caller only waits and the loop idles) and their
        per-request sum ("cpu_total_ms"). ``pairs``: overheads per ABBA pair (TTFB served ÷ in-process − 1, tokens/s
        1 − served ÷ in-process) as median / quartiles / range / 95 % CI of the median (:func:`median_ci`);
        ``reps``: the runs per seed and path that workload got. Overheads of the medians too.
    Raises:
        LocaldiffError: starlette / uvicorn missing (the section is then reported as skipped); RuntimeError when
        the two paths return different token counts for the same seed.
    """
    try:
        import uvicorn  # noqa: F401
    except ImportError as e:
        from localdiff.errors import LocaldiffError

        raise LocaldiffError(f"the serve section needs uvicorn ({e})") from None
    runs = []
    for stack in stacks or serve_harness.stacks():
        for layout in layouts or serve_harness.layouts():
            log(
                f"serve: {stack[0]} + {stack[1]}, {layout['name']} (model thread on CPU {layout['model']}, event "
                f"loop on {layout['loop']}, client process on {layout['client']})"
            )
            load_before = os.getloadavg()
            srv = serve_harness.Server(model, stack, layout)
            try:
                rows = _measure_one(srv, model, prompt, seeds, reps, max_new_tokens, warmup, log, min_seconds)
            finally:
                srv.close()
            runs.append(
                {
                    "stack": {"loop": stack[0], "http": stack[1]},
                    "layout": layout,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                    "rows": rows,
                }
            )
    return {
        "prompt": prompt,
        "seeds": list(seeds),
        "reps": reps,
        "warmup": warmup,
        "cpus": sorted(os.sched_getaffinity(0)),
        "runs": runs,
    }


def render_md(sec: dict) -> list[str]:
    """Markdown lines for the report."""
    if "runs" not in sec:
        return []
    out = [
        "### Through `localdiff serve` vs in-process (same model, prompt, seeds and model thread)",
        "",
        f"Prompt {sec['prompt']!r}, seeds {sec['seeds']}, {sec['reps']} runs (or more: the pairs column) per seed and path after "
        f"{sec.get('warmup', 0)} warm-up runs, ABBA order. Served: a streamed `/v1/chat/completions` on 127.0.0.1 "
        "from a client process (a minimal kept-alive HTTP client) to `localdiff serve`'s app and uvicorn config "
        "(its access line per request written) in this process; in-process: `Model.stream` in the server's model thread (same thread, "
        "same torch threads). TTFB = first answer text (served: when its bytes reach the client, before it parses them; "
        "the end likewise). Overheads per ABBA pair: median (95 % CI of the median) [min–max]; TTFB "
        "served ÷ in-process − 1, tokens/s 1 − served ÷ in-process. CPU = median ms per request: client process + "
        "event loop + model thread. Load = load average before → after.",
        "",
        "| stack | layout (CPUs: model / loop / client) | load | workload | TTFB in-process ms | TTFB served ms | "
        "TTFB overhead | tokens/s in-process | tokens/s served | tokens/s overhead | pairs | CPU served ms | same tokens |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]

    def pct(s):
        ci = f" (CI {_ci_pct(s)})" if "ci" in s else ""
        return f"{100 * s['median']:+.1f} %{ci} [{100 * s['min']:+.1f}…{100 * s['max']:+.1f}]"

    def cpus(c):
        return ",".join(map(str, c))

    for run in sec["runs"]:
        lay, st = run["layout"], run["stack"]
        where = f"{lay['name']} ({cpus(lay['model'])} / {cpus(lay['loop'])} / {cpus(lay['client'])})"
        load = f"{run['load_before'][0]:.1f}→{run['load_after'][0]:.1f}"
        for r in run["rows"]:
            a, b, c = r["in_process"], r["served"], r["served"].get("cpu_ms", {})
            out.append(
                f"| {st['loop']} + {st['http']} | {where} | {load} | {r['workload']} | "
                f"{a['ttfb_ms']['median']:.1f} | {b['ttfb_ms']['median']:.1f} | {pct(r['pairs']['ttfb'])} | "
                f"{a['tokens_per_s']['median']:.1f} | {b['tokens_per_s']['median']:.1f} | "
                f"{pct(r['pairs']['tokens_per_s'])} | {r.get('reps', sec['reps']) * len(sec['seeds'])} | "
                f"{c.get('client', 0):.2f} + {c.get('loop', 0):.2f} + "
                f"{c.get('model', 0):.2f} | {'yes' if r['same_tokens'] else 'no'} |"
            )
    return out + [""]
