"""Timeline of a served short answer (README, "Serving over HTTP"): where the wall time from the client's write to
its last recv goes, stage by stage, against in-process generation in the same model thread.

Run from the repository root: ``taskset -c 1 python docs/tools/serve_timeline.py [uvloop+httptools]`` (env ``N``:
requests, default 40; ``CCPU``: the client's CPU, default 0). Prints the median time of each stage's start in ms."""
import json, os, statistics, subprocess, sys, time, threading
import torch
torch.set_num_threads(1)
import localdiff
from localdiff.bench import serve as sb
from localdiff.serve import worker as W, asgi as A, jobs as J
from localdiff.serve import transport as T

marks = []
def mark(name):
    marks.append((name, time.perf_counter(), threading.get_native_id()))

def wrap(obj, attr, name, after=False):
    f = getattr(obj, attr)
    if hasattr(f, "__code__") and f.__code__.co_flags & 0x80:  # coroutine
        async def g(*a, **k):
            mark(name)
            r = await f(*a, **k)
            if after: mark(name + ".end")
            return r
    else:
        def g(*a, **k):
            mark(name)
            r = f(*a, **k)
            if after: mark(name + ".end")
            return r
    setattr(obj, attr, g)

wrap(A.GenerationRoutes, "_serve", "serve", after=True)
wrap(A, "parse_json", "parse_json")
wrap(W.ModelWorker, "submit", "submit")
wrap(W.ModelWorker, "_generate", "gen", after=True)
wrap(W.Job, "_flush", "flush")
wrap(A, "flush_now", "flush_now")
orig_stream = localdiff.Model.stream if hasattr(localdiff, "Model") else None
model = localdiff.load("tiny")
ms = type(model).stream
def stream(self, *a, **k):
    mark("stream0")
    for ev in ms(self, *a, **k):
        mark("ev." + type(ev).__name__)
        yield ev
type(model).stream = stream
wrap(type(model), "encode_prompt", "encode")

stack = ("uvloop", "httptools") if len(sys.argv) < 2 else tuple(sys.argv[1].split("+"))
own = sorted(os.sched_getaffinity(0))
lay = {"name": "x", "model": own, "loop": own, "client": [int(os.environ.get("CCPU", 0))]}
srv = sb._Server(model, stack, lay)
srv.client.kill()
cl = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_timeline_client.py"), str(srv.sock.getsockname()[1])],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
os.sched_setaffinity(cl.pid, {int(os.environ.get("CCPU", 0))})
rows = []
N = int(os.environ.get("N", 40))
for i in range(N + 5):
    marks.clear()
    body = sb._body("What is 27 + 58?", i % 3, None, {}, "none", model.name)
    cl.stdin.write(json.dumps({"path": "/v1/chat/completions", "body": json.dumps(body)}) + "\n"); cl.stdin.flush()
    out = json.loads(cl.stdout.readline())
    time.sleep(0.02)
    # in-process for comparison
    r = srv.worker.call(lambda: sb._inproc(model, "What is 27 + 58?", i % 3, None, {}, "none"))
    if i < 5: continue
    t0 = out["t0"]
    m = {}
    for name, t, tid in marks:
        m.setdefault(name, t - t0)
    m["client_end"] = out["total"]
    m["inproc_total"] = r[1]
    rows.append(m)
keys = list(rows[0].keys())
for k in keys:
    v = [r[k] for r in rows if k in r]
    print(f"{k:20s} {1000*statistics.median(v):8.3f} ms")
srv.close()
