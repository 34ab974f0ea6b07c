"""``localdiff bench --only serve``: the cost of going through ``localdiff serve`` instead of calling the engine.

Same model object, same prompt, same seeds, run alternately (ABBA order): in-process ``Model.stream`` without step
events (what ``localdiff gen`` does) vs a streamed ``POST /v1/chat/completions`` to a server on 127.0.0.1 in this
process (uvicorn in a thread; its model worker runs the generations). The in-process runs execute *in the server's
model thread* (``ModelWorker.call``), so both paths use the same thread, the same OpenMP team and the same torch
thread count: only the HTTP path differs. The client is a minimal HTTP/1.1 client on one kept-alive socket
(TCP_NODELAY, :class:`_Client`), reading the SSE events as they come (``http.client`` cost ~0.7 ms CPU per request
here, this one ~0.25 ms: the bench is about the server).

Time to first byte (TTFB) = time until the first piece of answer text reaches the caller (in-process: the first
finished canvas's text; served: the first content delta); tokens/s = generated tokens ÷ wall time of the whole
request, with the same token count on both paths (in-process: the ids returned; served: ``usage.completion_tokens``;
checked per run). CPU ms per request are per thread (``pthread_getcpuclockid``): the client, the server's event
loop, the model thread — on a machine shared with other jobs they are steadier than wall times. The load average
is recorded before and after.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time

WORKLOADS = {  # name → (extra sampler options, canvas events asked for): a typical short answer, one canvas run
    "short answer (default sampler)": ({}, "none"),              # to its step cap, and the canvas-events extension
    "48 steps per canvas": ({"max_denoising_steps": 48, "confidence_threshold": 1e-12}, "none"),
    "short answer, canvas events (steps)": ({}, "steps"),
}


class _Clocks:
    """CPU seconds of named threads (Linux/macOS ``pthread_getcpuclockid``)."""

    def __init__(self, threads: dict) -> None:
        self.ids = {k: time.pthread_getcpuclockid(t.ident) for k, t in threads.items()}

    def read(self) -> dict:
        return {k: time.clock_gettime(c) for k, c in self.ids.items()}


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


class _Client:
    """A minimal HTTP/1.1 client on one kept-alive socket (TCP_NODELAY): sends a prepared POST and reads the chunked
    SSE answer as it arrives. Lean on purpose (roughly what a compiled client costs): the bench measures the
    server; the client's CPU is reported on its own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = None

    def _connect(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=300)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        """Close the connection."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def post_sse(self, path: str, body: bytes, t0: float) -> tuple[float | None, int]:
        """POST ``body`` and read the stream: (seconds from ``t0`` to the first content delta, or None;
        ``usage.completion_tokens``). Raises RuntimeError on a non-200 answer."""
        if self.sock is None:
            self._connect()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
        buf, head = b"", None
        while head is None:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the server closed the connection")
            buf += data
            if b"\r\n\r\n" in buf:
                head, buf = buf.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"server answered {head[:200]!r}")
        first, n, sse, done = None, 0, b"", False
        while not done:
            while True:                       # whole chunks in buf → sse
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end], 16)
                if size == 0:
                    done = True
                    break
                if len(buf) < end + 2 + size + 2:
                    break
                sse += buf[end + 2:end + 2 + size]
                buf = buf[end + 2 + size + 2:]
            *events, sse = sse.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                chunk = json.loads(ev[6:])
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
            if not done:
                data = self.sock.recv(65536)
                if not data:
                    raise RuntimeError("the server closed the connection mid-answer")
                buf += data
        return first, n


def _served(client: _Client, prompt, seed, max_new, opts, events, model_name) -> tuple[float, float, int]:
    body = {"model": model_name, "messages": [{"role": "user", "content": prompt}], "seed": seed, "stream": True,
            "max_tokens": max_new, "stream_options": {"include_usage": True}}
    ext = {**opts, **({"events": events} if events != "none" else {})}
    if ext:
        body["localdiff"] = ext
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    first, n = client.post_sse("/v1/chat/completions", data, t0)
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, n


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summary(rows: list[tuple], cpu: list[dict]) -> dict:
    out = {"ttfb_ms": _stats([r[0] * 1000 for r in rows]),
           "tokens_per_s": _stats([r[2] / r[1] for r in rows if r[1] > 0]),
           "tokens": [r[2] for r in rows]}
    out["cpu_ms"] = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]} if cpu else {}
    out["cpu_total_ms"] = _stats([sum(c.values()) for c in cpu]) if cpu else {}
    return out


def _start_server(model):
    import uvicorn

    from localdiff.serve.app import build_app
    from localdiff.serve.worker import ModelWorker

    worker = ModelWorker(lambda name: model, model.name, max_queue=4, keep_alive=None)
    worker.model = model
    # proto given explicitly: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets (else +40 ms per response on a
    # kept-alive connection: Nagle against delayed ACKs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(worker), log_level="warning", timeout_keep_alive=600))
    worker.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return worker, server, thread, sock


def measure(model, prompt: str, seeds=(0, 1, 2), reps: int = 10, max_new_tokens: int | None = None, warmup: int = 3,
            log=print) -> dict:
    """Run each workload over ``seeds`` × ``reps`` per path, ABBA-alternating in-process and served.

    Returns:
        {"prompt", "seeds", "reps", "load_before", "load_after", "rows": [{"workload", "in_process", "served",
        "ttfb_overhead_ms", "tokens_per_s_overhead", "same_tokens"}]}; per path: TTFB ms and tokens/s as
        median/min/max, the token counts, median CPU ms per request per thread ("client", "loop", "model"; on the
        in-process path the caller only waits and the loop idles) and their per-request sum ("cpu_total_ms").
        Overheads are of the medians: tokens/s (1 − served ÷ in-process) and CPU (served ÷ in-process − 1).
    Raises:
        LocaldiffError: starlette / uvicorn missing (the section is then reported as skipped); RuntimeError when
        the two paths return different token counts for the same seed.
    """
    try:
        import uvicorn  # noqa: F401
    except ImportError as e:
        from localdiff.errors import LocaldiffError

        raise LocaldiffError(f"the serve section needs uvicorn ({e})") from None
    load_before = os.getloadavg()
    worker, server, thread, sock = _start_server(model)
    clocks = _Clocks({"client": threading.current_thread(), "loop": thread, "model": worker._thread})
    conn = _Client(sock.getsockname()[1])
    rows = []

    def run(which, seed, opts, events):
        c0 = clocks.read()
        if which == "in_process":
            r = worker.call(lambda: _inproc(model, prompt, seed, max_new_tokens, opts, events))
        else:
            r = _served(conn, prompt, seed, max_new_tokens, opts, events, model.name)
        c1 = clocks.read()   # all three threads on both paths (in-process: the caller waits, the loop idles)
        return r, {k: (c1[k] - c0[k]) * 1000 for k in c0}

    try:
        for name, (opts, events) in WORKLOADS.items():
            for i in range(warmup):
                run("served", i, opts, events)
                run("in_process", i, opts, events)
            got = {"in_process": ([], []), "served": ([], [])}
            k = 0
            for seed in seeds:
                for _ in range(reps):
                    order = ("in_process", "served") if k % 4 in (0, 3) else ("served", "in_process")
                    k += 1
                    for which in order:
                        r, cpu = run(which, seed, opts, events)
                        got[which][0].append(r)
                        got[which][1].append(cpu)
            ia, sb = _summary(*got["in_process"]), _summary(*got["served"])
            if ia["tokens"] != sb["tokens"]:
                raise RuntimeError(f"serve bench, {name}: token counts differ between the paths "
                                   f"({ia['tokens']} vs {sb['tokens']})")
            row = {"workload": name, "in_process": ia, "served": sb,
                   "ttfb_overhead_ms": sb["ttfb_ms"]["median"] - ia["ttfb_ms"]["median"],
                   "tokens_per_s_overhead": 1 - sb["tokens_per_s"]["median"] / ia["tokens_per_s"]["median"],
                   "cpu_overhead": sb["cpu_total_ms"]["median"] / ia["cpu_total_ms"]["median"] - 1,
                   "same_tokens": True}
            log(f"serve: {name}: TTFB {ia['ttfb_ms']['median']:.1f} → {sb['ttfb_ms']['median']:.1f} ms, tokens/s "
                f"{ia['tokens_per_s']['median']:.1f} → {sb['tokens_per_s']['median']:.1f} "
                f"({100 * row['tokens_per_s_overhead']:+.1f} % overhead); CPU ms/request (client, loop, model) "
                f"in-process " + ", ".join(f"{v:.2f}" for v in ia["cpu_ms"].values()) + ", served "
                + ", ".join(f"{v:.2f}" for v in sb["cpu_ms"].values())
                + f" ({100 * row['cpu_overhead']:+.1f} % CPU)")
            rows.append(row)
    finally:
        conn.close()
        server.should_exit = True
        thread.join(10)
        worker.stop()
        sock.close()
    return {"prompt": prompt, "seeds": list(seeds), "reps": reps, "warmup": warmup, "load_before": load_before,
            "load_after": os.getloadavg(), "stack": _stack(), "rows": rows}


def _stack() -> dict:
    """The event loop and HTTP parser uvicorn picked ("auto": uvloop / httptools when installed)."""
    from importlib.util import find_spec

    return {"loop": "uvloop" if find_spec("uvloop") else "asyncio",
            "http": "httptools" if find_spec("httptools") else "h11"}


def render_md(sec: dict) -> list[str]:
    """Markdown lines for the report."""
    if "rows" not in sec:
        return []
    lb, la = sec.get("load_before", (0, 0, 0)), sec.get("load_after", (0, 0, 0))
    out = ["### Through `localdiff serve` vs in-process (same model, prompt, seeds and model thread)", "",
           f"Prompt {sec['prompt']!r}, seeds {sec['seeds']}, {sec['reps']} runs per seed and path after "
           f"{sec.get('warmup', 0)} warm-up runs, ABBA order; streamed `/v1/chat/completions` on 127.0.0.1 "
           "(a minimal kept-alive HTTP client) vs `Model.stream` in the server's model thread. TTFB = first answer text. "
           "Medians [min–max]. CPU = median ms per request per thread, client + event loop + model thread "
           "(in-process the caller only waits and the loop idles); CPU overhead = of the per-request sums. "
           f"Load average {lb[0]:.1f} before, {la[0]:.1f} after. Event loop / HTTP parser: "
           f"{sec.get('stack', {}).get('loop', '?')} / {sec.get('stack', {}).get('http', '?')}.", "",
           "| workload | TTFB in-process ms | TTFB served ms | tokens/s in-process | tokens/s served | overhead "
           "(tokens/s) | CPU in-process ms | CPU served ms | overhead (CPU) | same tokens |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]

    def cpu(c):
        return f"{c.get('client', 0):.2f} + {c.get('loop', 0):.2f} + {c.get('model', 0):.2f}"

    def rng(s, f="{:.1f}"):
        return f"{f.format(s['median'])} [{f.format(s['min'])}–{f.format(s['max'])}]"

    for r in sec["rows"]:
        a, b = r["in_process"], r["served"]
        cs = b.get("cpu_ms", {})
        out.append(f"| {r['workload']} | {rng(a['ttfb_ms'])} | {rng(b['ttfb_ms'])} | {rng(a['tokens_per_s'])} | "
                   f"{rng(b['tokens_per_s'])} | {100 * r['tokens_per_s_overhead']:+.1f} % | "
                   f"{cpu(a.get('cpu_ms', {}))} | {cpu(cs)} | {100 * r.get('cpu_overhead', float('nan')):+.1f} % | "
                   f"{'yes' if r['same_tokens'] else 'no'} |")
    return out + [""]
