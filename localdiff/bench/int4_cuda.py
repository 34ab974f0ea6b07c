"""int4 / int8 on a CUDA device (``python -m localdiff.bench.int4_cuda``, run by ``.ci/gpu_check.sh``): exactness
and speed of the kernels :mod:`localdiff.quantize.cuda4` picks, and the CUDA context's real memory next to the
memory plan's 1 GiB runtime reserve. Prints one line per figure and writes JSON with ``--out``.

* exactness: for odd shapes and every row count 1…17 and 256, tinygemm (``aten._weight_int4pack_mm``) against
  float64 ``x · dequantizeᵀ`` with tinygemm's constants, and against our own dequantization; the dequantize
  fallback; bitsandbytes NF4 (when installed: its requantization error); int8 (bitsandbytes when installed).
* speed: median ms of bf16 ``F.linear``, tinygemm int4, dequantize + GEMM, NF4 and int8 at 1 / 4 / 16 / 256 rows for
  [6144 × 2048] and [2048 × 6144] (CUDA events, 50 repetitions after warm-up).
* memory: ``torch.cuda.mem_get_info`` before and after the first CUDA call (the context), and the allocator's reserve.
"""

from __future__ import annotations

import argparse
import json
import statistics


def _lin(n, k, seed):
    import torch
    from torch import nn

    from localdiff.quantize import int4

    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    return int4.Int4Linear.from_linear(lin)


def exactness(dev) -> dict:
    import torch

    from localdiff.quantize import cuda4, int4

    out = {}
    for n, k in ((48, 256), (160, 384), (64, 1024)):
        q = _lin(n, k, n + k)
        sz = cuda4.tinygemm_constants(q.weight_scale, q.weight_zero)
        ref_w = cuda4.tinygemm_dequantize(int4.unpack_codes(q.weight), sz).double()
        ours_w = int4.dequantize(q.weight, q.weight_scale, q.weight_zero, dtype=torch.float64)
        t = cuda4.TinygemmLinear(q.to(dev))
        worst, worst_ours = 0.0, 0.0
        for m in list(range(1, 18)) + [256]:
            x = torch.randn(m, k).to(torch.bfloat16)
            y = t(x.to(dev)).double().cpu()
            ref = x.double() @ ref_w.t()
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
            worst_ours = max(worst_ours, ((y - x.double() @ ours_w.t()).abs().max() / ref.abs().max()).item())
        out[f"tinygemm [{n} x {k}]"] = {"max_rel_err_vs_tinygemm_dequant": worst, "max_rel_err_vs_ours": worst_ours}
    q = _lin(40, 100, 1).to(dev)  # odd shape: the dequantize fallback (exact up to fp32 sums)
    x = torch.randn(7, 100, device=dev)
    ref = x.double() @ int4.dequantize(q.weight, q.weight_scale, q.weight_zero, 100, torch.float64).t()
    out["dequant [40 x 100] fp32"] = {"max_rel_err": ((q(x).double() - ref).abs().max() / ref.abs().max()).item()}
    if cuda4.bnb_installed():
        b = cuda4.BnbNF4Linear(_lin(256, 512, 2).to(dev))
        q = _lin(256, 512, 2)
        x = torch.randn(4, 512)
        ref = x.double() @ int4.dequantize(q.weight, q.weight_scale, q.weight_zero, dtype=torch.float64).t()
        out["bnb nf4 [256 x 512]"] = {
            "max_rel_err_vs_ours": ((b(x.to(dev)).double().cpu() - ref).abs().max() / ref.abs().max()).item()
        }
    return out


def _time(f, reps=50) -> float:
    import torch

    for _ in range(5):
        f()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def speed(dev) -> dict:
    import torch
    import torch.nn.functional as F

    from localdiff.quantize import cuda4, int4, int8

    out = {}
    for n, k in ((6144, 2048), (2048, 6144)):
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        q4 = int4.Int4Linear.from_linear(torch.nn.Linear(k, n, bias=False)).to(dev)
        t = cuda4.TinygemmLinear(q4)
        q8, s8 = (a.to(dev) for a in int8.quantize_tensor(w))
        wd = w.to(dev)
        nf4 = cuda4.BnbNF4Linear(q4) if cuda4.bnb_installed() else None
        for m in (1, 4, 16, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {
                "bf16": _time(lambda: F.linear(x, wd)),
                "int4 tinygemm": _time(lambda: t(x)),
                "int4 dequant+gemm": _time(lambda: q4(x)),
                "int8": _time(lambda: int8.int8_matmul(x, q8, s8)),
            }
            if nf4 is not None:
                row["int4 bnb nf4"] = _time(lambda: nf4(x))
            out[f"[{n} x {k}] {m} rows"] = row
    return out


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("int4_cuda: no CUDA device; nothing to check")
        return 0
    free0, total = torch.cuda.mem_get_info()  # initialises the context
    dev = torch.device("cuda")
    torch.ones(1, device=dev).matmul(torch.ones(1, 1, device=dev))
    free1, _ = torch.cuda.mem_get_info()
    res = {
        "device": torch.cuda.get_device_name(),
        "memory": {
            "total_bytes": total,
            "free_after_context_bytes": free0,
            "used_by_process_after_first_gemm_bytes": total - free1,
            "allocator_reserved_bytes": torch.cuda.memory_reserved(),
            "plan_runtime_reserve_bytes": 1 << 30,
        },
    }
    res["exactness"] = exactness(dev)
    res["speed_ms"] = speed(dev)
    for sec in ("memory", "exactness", "speed_ms"):
        for k, v in res[sec].items():
            print(f"{sec}: {k}: {json.dumps(v)}")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
