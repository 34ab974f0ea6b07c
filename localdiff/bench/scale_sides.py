"""The scale section's measured sides: one loaded configuration each (localdiff in its default dtype or fp32, the
transformers reference in bf16 or fp32) generating one canvas, run interleaved (the order rotates every repetition),
and this machine's measures beside them: the GEMM peak by CPU time and the process's peak RSS."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from localdiff.bench.scale_shapes import CANVAS


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to the current RSS (Linux ``/proc/self/clear_refs`` "5"), so the peak of each
    group of sides is its own; silently nothing elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int | None:
    """This process's peak resident set (Linux ``VmHWM``) in bytes, or None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def gemm_peak(dtype) -> float:
    """Best GFLOP/s of a 1024×2048×2048 GEMM (``dtype``) on this process's threads, by CPU time (a shared core's
    time-slicing left out, as in the steps' CPU ms the fractions divide), after ≥ 0.3 s of CPU time of warm-up: a
    cold core's first AMX GEMMs run at ~40 % of its rate (measured 374 vs 975 GFLOP/s bf16 on Sapphire Rapids)."""
    a, b = torch.randn(1024, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        torch.nn.functional.linear(a, b)
        best = min(best, time.process_time() - t0)
    return 2 * 1024 * 2048 * 2048 / best / 1e9


class Side:
    """One configuration: a loaded model and its generate call."""

    def __init__(self, key: str, path: Path, steps: int):
        import localdiff
        from localdiff.bench.ref import _Counter, load_reference

        self.key = key
        impl, dtype = key.split(" ", 1)
        self.ref = impl == "reference"
        ld = localdiff.load(path, device="cpu", dtype=None if dtype == "default" else dtype)
        opts = ld.sampler_options(max_denoising_steps=steps)
        self.opts = {
            k: opts[k]
            for k in (
                "max_denoising_steps",
                "t_min",
                "t_max",
                "entropy_bound",
                "stability_threshold",
                "confidence_threshold",
            )
        }
        self.eos, self.pad = ld.eos_token_ids, ld.pad_token_id
        if self.ref:
            from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

            self.dtype = dtype
            del ld  # free localdiff's copy before the reference loads (the 1B fp32 pair ran out of memory)
            gc.collect()
            self.net = load_reference(path) if dtype == "float32" else load_reference_dtype(path, dtype)
            self.counter = _Counter(self.net.model.decoder)
            o = self.opts
            self.kw = dict(
                max_denoising_steps=int(o["max_denoising_steps"]),
                t_min=float(o["t_min"]),
                t_max=float(o["t_max"]),
                stability_threshold=int(o["stability_threshold"]),
                confidence_threshold=float(o["confidence_threshold"]),
                sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(o["entropy_bound"])),
                eos_token_id=list(self.eos),
                pad_token_id=self.pad,
            )
        else:
            self.net, self.dtype = ld, str(ld.dtype).removeprefix("torch.")
            self.precision = ld.precision.to_dict() if ld.precision else None
            self.kernels = ld.kernels() if hasattr(ld, "kernels") else {}
        mod = self.net if self.ref else self.net.net
        params = list(mod.parameters()) + list(mod.buffers())
        self.weight_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in params}.values())

    def run(self, ids: torch.Tensor, seed: int) -> dict:
        """One canvas: {"seconds" (wall), "cpu_seconds" (this process's CPU time: on a shared core it leaves out
        the time other processes held it), "forwards", "tokens"}."""
        c0, t0 = time.process_time(), time.perf_counter()
        if self.ref:
            self.counter.n = 0
            torch.manual_seed(seed)
            with torch.no_grad():
                out = self.net.generate(ids, max_new_tokens=CANVAS, **self.kw)
            sec = time.perf_counter() - t0
            from localdiff.bench.ref import normalize

            return {
                "seconds": sec,
                "cpu_seconds": time.process_time() - c0,
                "forwards": self.counter.n,
                "tokens": len(normalize(out.sequences[0, ids.shape[1] :].tolist(), self.eos, self.pad)),
            }
        g = self.net.generate(ids[0].tolist(), chat=False, seed=seed, max_new_tokens=CANVAS, **self.opts)
        return {
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
            "forwards": g.stats.forwards,
            "tokens": len(g.token_ids),
        }


def load_reference_dtype(path: Path, dtype: str):
    """transformers' model for ``path`` in ``dtype`` (CPU, eval mode)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()


def spread(xs):
    """{"median", "min", "max", "n"} of the values ``xs``."""
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def interleaved(sides: list[Side], ids, reps: int, log, label: str) -> dict:
    """One warm-up canvas per side, then ``reps`` repetitions of one canvas per side, the order rotating every
    repetition. Returns per side key: dtype, weight bytes, forwards, tokens and the spreads of ms/step, CPU ms/step and
    tokens/s (localdiff sides: also precision and kernels); ``__per_rep__`` / ``__per_rep_cpu__``: tokens/s per
    repetition by wall and CPU time."""
    for s in sides:  # warm-up, not timed
        s.run(ids, 0)
    runs = {s.key: [] for s in sides}
    for r in range(reps):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for s in order:
            runs[s.key].append(s.run(ids, r))
        log(
            f"  [scale {label}] repetition {r + 1}/{reps}: "
            + ", ".join(
                f"{k} {1e3 * v[-1]['seconds'] / max(v[-1]['forwards'], 1):.0f} ms/step" for k, v in runs.items()
            )
        )
    out = {"__per_rep__": [{k: v[r]["tokens"] / v[r]["seconds"] for k, v in runs.items()} for r in range(reps)]}
    out["__per_rep_cpu__"] = [{k: v[r]["tokens"] / v[r]["cpu_seconds"] for k, v in runs.items()} for r in range(reps)]
    for s in sides:
        rs = runs[s.key]
        out[s.key] = {
            "dtype": s.dtype,
            "weight_bytes": s.weight_bytes,
            "forwards": [x["forwards"] for x in rs],
            "tokens": [x["tokens"] for x in rs],
            "ms_per_step": spread([1e3 * x["seconds"] / max(x["forwards"], 1) for x in rs]),
            "cpu_ms_per_step": spread([1e3 * x["cpu_seconds"] / max(x["forwards"], 1) for x in rs]),
            "tokens_per_s": spread([x["tokens"] / x["seconds"] for x in rs]),
        }
        if not s.ref:
            out[s.key]["precision"], out[s.key]["kernels"] = s.precision, s.kernels
    return out
