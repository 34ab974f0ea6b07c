"""Timeline of a served short answer (README, "Serving over HTTP"): where the wall time from the client's write to
its last recv goes, stage by stage, against in-process generation in the same model thread.

Run from the repository root: ``taskset -c 1 python docs/tools/serve_timeline.py [uvloop+httptools]`` (env ``N``:
requests, default 40; ``CCPU``: the client's CPU, default 0). The server, its model thread and the client process
are the serve bench's (:class:`localdiff.bench.serve._Server`); each stage's entry (and some exits) is stamped on
``time.perf_counter()``, whose clock the client's ``t0`` shares. Prints the median time of each stage's start in ms
from the client's write, then the client's last arrival and the in-process total."""
import json
import os
import statistics
import sys
import time

import torch

import localdiff
from localdiff.bench import serve as sb
from localdiff.serve import asgi, worker

marks = []


def wrap(obj, attr, name, after=False):
    """Stamp ``name`` when ``obj.attr`` is entered (and ``name.end`` when it returns, with ``after``)."""
    f = getattr(obj, attr)
    if f.__code__.co_flags & 0x80:  # a coroutine function
        async def g(*a, **k):
            marks.append((name, time.perf_counter()))
            r = await f(*a, **k)
            if after:
                marks.append((name + ".end", time.perf_counter()))
            return r
    else:
        def g(*a, **k):
            marks.append((name, time.perf_counter()))
            r = f(*a, **k)
            if after:
                marks.append((name + ".end", time.perf_counter()))
            return r
    setattr(obj, attr, g)


def main() -> None:
    torch.set_num_threads(1)
    model = localdiff.load("tiny")
    wrap(asgi.GenerationRoutes, "_serve", "serve", after=True)
    wrap(asgi, "parse_json", "parse_json")
    wrap(worker.ModelWorker, "submit", "submit")
    wrap(worker.ModelWorker, "_generate", "gen", after=True)
    wrap(worker.Job, "_flush", "flush")
    wrap(asgi, "flush_now", "flush_now")
    wrap(type(model), "encode_prompt", "encode")
    stream = type(model).stream

    def stamped(self, *a, **k):       # both paths go through it
        marks.append(("stream0", time.perf_counter()))
        for ev in stream(self, *a, **k):
            marks.append(("ev." + type(ev).__name__, time.perf_counter()))
            yield ev
    type(model).stream = stamped

    stack = tuple(sys.argv[1].split("+")) if len(sys.argv) > 1 else ("uvloop", "httptools")
    own = sorted(os.sched_getaffinity(0))
    srv = sb._Server(model, stack, {"name": "timeline", "model": own, "loop": own,
                                    "client": [int(os.environ.get("CCPU", 0))]})
    prompt, n, rows = "What is 27 + 58?", int(os.environ.get("N", 40)), []
    try:
        for i in range(n + 5):                     # 5 warm-up requests
            marks.clear()
            out = srv.post(sb._body(prompt, i % 3, None, {}, "none", model.name))
            time.sleep(0.02)
            total = srv.worker.call(lambda: sb._inproc(model, prompt, i % 3, None, {}, "none"))[1]
            if i < 5:
                continue
            row = {}
            for name, t in marks:                  # (the in-process run's stamps come later: the served ones win)
                row.setdefault(name, t - out["t0"])
            row.update(client_end=out["total"], inproc_total=total)
            rows.append(row)
    finally:
        srv.close()
    for k in rows[0]:
        print(f"{k:20s} {1000 * statistics.median(r[k] for r in rows if k in r):8.3f} ms")
    print(json.dumps({"stack": stack, "requests": n}))


if __name__ == "__main__":
    main()
