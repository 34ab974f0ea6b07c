"""The CPU's capability and the default compute dtype chosen from it (measured, never assumed).

Machines of the same kind differ: one had AVX512-BF16 + AMX (bf16 GEMM 4.5–8× fp32), another only AVX2 (bf16
GEMM ~100× *slower* than fp32: torch emulates it). So the CPU default is decided per machine and per model:

1. ``bf16_instructions()``: the CPU lists a bf16 GEMM instruction set (x86 ``avx512_bf16`` / ``amx_bf16``,
   AArch64 ``bf16``) in ``/proc/cpuinfo``. Without one, bf16 is never the default (it is not even timed: on AVX2
   the probe alone would take ~0.5 s).
2. ``matmul_rates()``: with one, a small measured table — best-of-5 GFLOP/s of a 256×1024×1024 GEMM in fp32 and
   bf16 on this process's threads (≈ 15 ms, once per process). bf16 must be ≥ :data:`BF16_MIN_SPEEDUP` × fp32.
3. The model: bf16 when its checkpoint is stored in 16 bits (its weights lose nothing) or it has ≥
   :data:`LARGE_MODEL_PARAMS` parameters; a small fp32 checkpoint (the embedded ``tiny``, test models) stays fp32,
   which is what reference-exact runs (tokens equal to transformers in fp32) need.

``dtype="float32"`` (``--dtype float32``, ``LOCALDIFF_DTYPE=float32``) always gives the exact fp32 path.

The sampler path (``Precision.sampler``): "fast" (the fused vocabulary pass, draws for accepted positions only:
:class:`localdiff.decoding.canvas_eb.CanvasEB`'s fast path) wherever the model would be bf16 if the CPU allowed —
16-bit default, or fp32 by default for a large or 16-bit-stored model on a CPU without fast bf16 (150M, fp32, one
core of a Sapphire Rapids: ~500 vs ~700 CPU ms per step); "exact" (the reference's ops and random stream) for a small
fp32 checkpoint and whenever the dtype is asked for.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

#: cpuinfo flags of CPUs with native bf16 GEMM instructions (x86: AVX512-BF16, AMX-BF16; AArch64: BF16)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
#: bf16 becomes the default only when its measured GEMM rate is at least this multiple of fp32's
BF16_MIN_SPEEDUP = 2.0
#: fp32-stored checkpoints from this many parameters up run in bf16 where bf16 is native (smaller ones stay fp32)
LARGE_MODEL_PARAMS = 100_000_000
#: GEMM shape of the probe (M, K, N)
PROBE_SHAPE = (256, 1024, 1024)

_RATES: dict | None = None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on AArch64) from /proc/cpuinfo; empty where there is
    no such file (macOS, Windows)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def bf16_instructions(flags: frozenset[str] | None = None) -> list[str]:
    """The bf16 GEMM instruction sets the CPU lists (subset of :data:`BF16_FLAGS`); empty = none."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in BF16_FLAGS if f in flags]


def torch_capability() -> str:
    """torch's CPU dispatch level (``torch.backends.cpu.get_cpu_capability()``: "AVX2", "AVX512", ...)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch
        return "unknown"


def _gflops(dtype, reps: int = 5) -> float:
    import torch

    m, k, n = PROBE_SHAPE
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(a, b)  # warm-up (packing buffers, thread pool)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def matmul_rates(refresh: bool = False) -> dict:
    """The measured table: ``{"float32": GFLOP/s, "bfloat16": GFLOP/s or None}`` (best of 5, :data:`PROBE_SHAPE`,
    this process's torch threads), measured once per process. bf16 is timed only on CPUs with bf16 instructions
    (None otherwise)."""
    global _RATES
    if _RATES is None or refresh:
        import torch

        rates = {"float32": _gflops(torch.float32), "bfloat16": None}
        if bf16_instructions():
            rates["bfloat16"] = _gflops(torch.bfloat16)
        _RATES = rates
    return dict(_RATES)


@dataclass(frozen=True)
class Precision:
    """The compute dtype a CPU load uses and why.

    Attributes: ``dtype`` ("float32" | "bfloat16"), ``reason`` (one line), ``capability`` (torch's dispatch level),
    ``bf16_instructions`` (the cpuinfo flags found), ``rates`` (:func:`matmul_rates`, GFLOP/s), ``chosen_by``
    ("default" | "asked"), ``sampler`` ("exact" | "fast", see the module; None = by dtype: exact in fp32).
    """

    dtype: str
    reason: str
    capability: str
    bf16_instructions: list[str] = field(default_factory=list)
    rates: dict = field(default_factory=dict)
    chosen_by: str = "default"
    sampler: str | None = None

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "reason": self.reason,
            "cpu_capability": self.capability,
            "bf16_instructions": list(self.bf16_instructions),
            "matmul_gflops": dict(self.rates),
            "chosen_by": self.chosen_by,
            "sampler": self.sampler_path(),
        }

    def sampler_path(self) -> str:
        """ "exact" or "fast": :attr:`sampler`, or by dtype when None (fp32: exact)."""
        return self.sampler or ("exact" if self.dtype == "float32" else "fast")

    def line(self) -> str:
        """One line for ``gen -v`` / ``bench``: dtype, why, the detected capability."""
        flags = ",".join(self.bf16_instructions) or "none"
        rates = ", ".join(f"{k} {v:.0f}" for k, v in self.rates.items() if v) or "not measured"
        return (
            f"{self.dtype} ({self.chosen_by}: {self.reason}), {self.sampler_path()} sampler; CPU "
            f"{platform.machine()} torch {self.capability}, bf16 instructions {flags}, GEMM GFLOP/s {rates}"
        )


def stored_dtype(raw: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in (``dtype`` / ``torch_dtype``, top level
    or ``text_config``), or None."""
    for d in (raw, raw.get("text_config") or {}):
        v = d.get("dtype") or d.get("torch_dtype")
        if isinstance(v, str):
            return v
    return None


def choose_cpu_dtype(stored: str | None, n_params: int | None, measure: bool = True) -> Precision:
    """The default CPU compute dtype for a checkpoint stored in ``stored`` ("float32", "bfloat16", ... or None) with
    ``n_params`` parameters (None = unknown), by the rules of the module docstring. ``measure=False`` skips the
    GEMM probe (``show``: the flags and the model decide; the speed check is left to the load)."""
    cap, flags = torch_capability(), bf16_instructions()
    small = n_params is None or n_params < LARGE_MODEL_PARAMS  # unknown size: as small
    half = stored in ("bfloat16", "float16")
    fast32 = None if small and not half else "fast"  # where bf16 would be the default: the fast sampler in fp32
    if not flags:
        return Precision(
            "float32",
            "no bf16 GEMM instructions on this CPU (bf16 would be emulated, ~100x slower)",
            cap,
            flags,
            {},
            sampler=fast32,
        )
    if small and not half:
        return Precision(
            "float32",
            f"fp32 checkpoint under {LARGE_MODEL_PARAMS // 1_000_000}M parameters or of "
            "unknown size "
            "(kept exact; --dtype bfloat16 to change)",
            cap,
            flags,
            {},
        )
    if not measure:
        return Precision("bfloat16", "bf16 instructions present (speed measured at load)", cap, flags, {})
    rates = matmul_rates()
    speedup = rates["bfloat16"] / rates["float32"]
    if speedup < BF16_MIN_SPEEDUP:
        return Precision(
            "float32",
            f"bf16 GEMM measured only {speedup:.1f}x fp32 (< {BF16_MIN_SPEEDUP:g}x)",
            cap,
            flags,
            rates,
            sampler=fast32,
        )
    why = "checkpoint stored in " + stored if half else f"{n_params / 1e6:.0f}M parameters"
    return Precision("bfloat16", f"bf16 GEMM measured {speedup:.1f}x fp32; {why}", cap, flags, rates)


#: a torch model under this many parameters runs on one CPU thread when the user set no thread count (``threads=
#: "auto"``: gen / chat / serve without --threads, LOCALDIFF_THREADS or the config's ``threads``). Measured on a 2-core
#: VM (issue #40): idle, 2 threads gained at most 1.36× on the embedded models (0.8–3.4M) and 1.33× on a random 5.3M
#: LLaDA (1.43× at 28M); with the machine busy (load average 5–19) 2 threads were 1.5–30× slower at every size. Small
#: models risk the most for the least (milliseconds per forward), so they stay on one thread.
SMALL_MODEL_PARAMS = 10_000_000
_INITIAL_THREADS: list = []  # torch's thread count before localdiff first changed it (the "all cores" default)


def auto_threads(n_params: int) -> tuple[int, str]:
    """The torch thread count for a model of ``n_params`` when the user named none, and why (for ``gen -v``):
    1 under :data:`SMALL_MODEL_PARAMS`, else torch's own default (every core), restored when an earlier small model
    in this process lowered it (``serve`` loads several)."""
    import torch

    if not _INITIAL_THREADS:
        _INITIAL_THREADS.append(torch.get_num_threads())
    if n_params < SMALL_MODEL_PARAMS:
        return 1, f"model under {SMALL_MODEL_PARAMS // 1_000_000}M parameters; --threads N to change"
    return _INITIAL_THREADS[0], "all cores"
