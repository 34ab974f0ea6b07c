"""The scale section on a CUDA GPU (``python -m localdiff.bench.scale_cuda``; run by ``.ci/gpu_check.sh``).

The same flagship-proportioned random checkpoints as :mod:`localdiff.bench.scale`; per size, localdiff in bf16 and
in int8 (weight-only, bitsandbytes' CUDA kernels when installed) and the reference (transformers) in bf16: ms per
denoising step (one canvas of 256 over a 64-token prompt, CUDA-synchronised, median of repeated steps after a
warm-up) against the HBM bound of that step: the weight bytes one step reads (every weight once — at 256 tokens ×
top-8 of 128 experts every expert is hit — plus the embedding matrix a second time, for the self-conditioning
product and the tied LM head) ÷ the device's measured copy bandwidth (a 1 GiB device-to-device copy: read + write).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev) -> float:
    """Measured device memory bandwidth in bytes/s (read + write of a 1 GiB clone, best of 5)."""
    a = torch.empty(2**29, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / best


def _step_ms(fn, dev, reps: int) -> dict:
    fn()
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(1e3 * (time.perf_counter() - t0))
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": reps}


def _bytes_per_step(net) -> int:
    """Weight bytes one canvas step reads: every parameter/buffer once, the (tied) embedding twice."""
    seen, total = set(), 0
    for t in list(net.parameters()) + list(net.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    emb = net.embed_tokens.weight
    return total + emb.numel() * emb.element_size()


def measure(sizes: list[str], reps: int = 10, device: str = "cuda") -> dict:
    """Per size and configuration: ms per denoising step, the HBM bound and the ratio (see the module docstring)."""
    import localdiff
    from localdiff.bench.ref import load_reference
    from localdiff.bench.scale import CANVAS, PROMPT, SHAPES, build, text_config
    from localdiff.quantize.int8 import bitsandbytes_available

    dev = torch.device(device)
    bw = copy_bandwidth(dev)
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "bandwidth_GBps": bw / 1e9,
        "bitsandbytes": bitsandbytes_available(),
        "sizes": [],
    }
    g = torch.Generator().manual_seed(0)
    for name in sizes:
        text = text_config(*SHAPES[name])
        with tempfile.TemporaryDirectory(prefix="localdiff-scale-cuda-") as tmp:
            path = build(Path(tmp), text)
            v = text["vocab_size"]
            ids = torch.randint(10, v, (1, PROMPT), generator=g).to(dev)
            canvas = torch.randint(0, v, (1, CANVAS), generator=g).to(dev)
            rows = {}
            for label, quant in (("localdiff bfloat16", None), ("localdiff int8", "int8")):
                m = localdiff.load(str(path), device=device, dtype="bfloat16", quant=quant)
                cache = m.new_cache()
                m.prefill(ids, cache)
                sc = m.denoise(canvas, cache)
                rows[label] = {
                    "ms_per_step": _step_ms(lambda: m.denoise(canvas, cache, sc), dev, reps),
                    "bytes_per_step": _bytes_per_step(m.net),
                }
                del m, cache, sc
                torch.cuda.empty_cache()
            ref = load_reference(path).to(device=dev, dtype=torch.bfloat16)
            from transformers.cache_utils import DynamicCache

            pkv = DynamicCache(config=ref.config.get_text_config(decoder=True))
            with torch.no_grad():
                ref.model.encoder(input_ids=ids, past_key_values=pkv)
                first = ref(past_key_values=pkv, decoder_input_ids=canvas).logits
                rows["reference bfloat16"] = {
                    "ms_per_step": _step_ms(
                        lambda: ref(past_key_values=pkv, decoder_input_ids=canvas, self_conditioning_logits=first),
                        dev,
                        reps,
                    ),
                    "bytes_per_step": rows["localdiff bfloat16"]["bytes_per_step"],
                }  # the same bf16 weights
            del ref, pkv
            torch.cuda.empty_cache()
        for r in rows.values():
            r["hbm_bound_ms"] = 1e3 * r["bytes_per_step"] / bw
            r["step_over_bound"] = r["ms_per_step"]["median"] / r["hbm_bound_ms"]
        out["sizes"].append({"name": name, "canvas": CANVAS, "runs": rows})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m localdiff.bench.scale_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="150M,1B", help="comma-separated sizes (150M, 1B)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, help="write the results JSON here")
    p.add_argument("--device", default="cuda", help="cuda (default; cpu only as a smoke run of this script)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.stderr.write("no CUDA device: the CUDA scale section needs a GPU\n")
        return 2
    res = measure([s.strip() for s in args.sizes.split(",") if s.strip()], args.reps, args.device)
    for s in res["sizes"]:
        for k, r in s["runs"].items():
            print(
                f"{s['name']:>5} {k:<20} {r['ms_per_step']['median']:8.2f} ms/step  HBM bound "
                f"{r['hbm_bound_ms']:7.2f} ms ({r['bytes_per_step'] / 2**20:.0f} MiB at "
                f"{res['bandwidth_GBps']:.0f} GB/s)  step/bound {r['step_over_bound']:.1f}x"
            )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
