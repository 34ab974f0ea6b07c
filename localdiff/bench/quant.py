"""Micro-benchmark of the int8 weight-only matmul paths (``python -m localdiff.bench.quant [--device cuda]``).

Prints GFLOP/s (2·M·K·N per call) per path and row count for the weight shapes that matter for DiffusionGemma
26B-A4B (an expert's gate_up [1408, 2816] and down [2816, 704], an attention projection [4096, 2816]), with bf16
and fp32 activations. The numbers quoted in ``localdiff.quantize.int8`` come from this script on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from localdiff.quantize.int8 import _bnb_matmul, bitsandbytes_available, quantize_tensor

SHAPES = ((1408, 2816), (2816, 704), (4096, 2816))


def _time(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def measure(device: str = "cpu", rows=(1, 8, 32, 64, 256), shapes=SHAPES, reps: int = 5) -> list[dict]:
    """One dict per (shape, rows, path): ``{"out", "in", "rows", "path", "gflops"}`` (GFLOP/s)."""
    dev = torch.device(device)
    out = []
    for n, k in shapes:
        q, s = quantize_tensor(torch.randn(n, k) * 0.02)
        q, s = q.to(dev), s.to(dev)
        wb, wf = (q.float() * s.float()[:, None]).to(dev, torch.bfloat16), (q.float() * s.float()[:, None]).to(dev)
        for m in rows:
            xb, xf = torch.randn(m, k, device=dev).bfloat16(), torch.randn(m, k, device=dev)
            paths = {
                "dense bf16": lambda: F.linear(xb, wb),
                "dense fp32": lambda: F.linear(xf, wf),
                "dequant-bf16 GEMM (bf16 act)": lambda: F.linear(xb, q.to(torch.bfloat16)) * s,
                "dequant-fp32 GEMM (fp32 act)": lambda: F.linear(xf, q.float()) * s.float(),
            }
            if dev.type == "cpu" and k % 16 == 0:
                paths["torch int8pack (bf16 act)"] = lambda: torch._weight_int8pack_mm(xb, q, s)
            if bitsandbytes_available():
                paths["bitsandbytes int8 (bf16 act)"] = lambda: _bnb_matmul(xb, q, s)
                paths["bitsandbytes int8 (fp32 act)"] = lambda: _bnb_matmul(xf, q, s)
            for name, fn in paths.items():
                dt = _time(fn, dev, reps)
                out.append({"out": n, "in": k, "rows": m, "path": name, "gflops": round(2 * m * k * n / dt / 1e9, 1)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m localdiff.bench.quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default="1,8,32,64,256")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = measure(a.device, tuple(int(r) for r in a.rows.split(",")), reps=a.reps)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for r in res:
        print(f"[{r['out']:5d}, {r['in']:5d}] rows {r['rows']:4d}  {r['path']:32s} {r['gflops']:8.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
