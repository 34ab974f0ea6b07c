"""The client process of serve_timeline.py: one request per stdin line, its absolute start time and arrivals."""
import json, sys, time
from localdiff.bench.serve_client import Client
c = Client(int(sys.argv[1]))
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter()
    first, total, n = c.post_sse(req["path"], req["body"].encode(), t0)
    sys.stdout.write(json.dumps({"t0": t0, "first": first, "total": total, "n": n}) + "\n"); sys.stdout.flush()
