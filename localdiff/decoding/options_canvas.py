"""Decoder options of the canvas family (DiffusionGemma's canvas decoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt
from localdiff.errors import UsageError


@decoder("canvas_eb", "canvas", policy="localdiff.decoding.canvas_eb:CanvasEB", family_default=True)
@dataclass(frozen=True)
class CanvasEBOptions(Options):
    """DiffusionGemma's canvas decoder: uniform-noise canvas, temperature schedule, entropy-bound acceptance,
    optional τ-locking and Re-Noising correction, self-conditioning (transformers 5.23.0
    ``DiffusionGemmaForBlockDiffusion.generate``; keys = its ``generation_config``)."""

    max_denoising_steps: int = opt(
        48,
        "max denoising steps per canvas",
        lo=1,
        hi=100_000,
        flag="--steps",
        metavar="N",
        aliases=("steps", "max_steps"),
    )
    t_min: float = temperature_opt(0.4, "temperature at the last step (linear schedule)", flag="--t-min")
    t_max: float = temperature_opt(
        0.8,
        "temperature at the first step; --temperature T is a constant T, MAX:MIN a schedule",
        flag="--temperature",
        metavar="MAX[:MIN]",
        pair_of="t_min",
        aliases=("temperature",),
    )
    entropy_bound: float = opt(
        0.1, "entropy-bound acceptance budget (nats)", lo=0, lo_open=True, metavar="X", aliases=("eb",)
    )
    stability_threshold: int = opt(
        1, "steps a canvas must stay unchanged before it stops early", lo=0, hi=100_000, metavar="N"
    )
    confidence_threshold: float = opt(
        0.005, "mean-entropy level under which a stable canvas is final", lo=0, lo_open=True, metavar="X"
    )
    threshold: float | None = opt(
        None,
        "confidence lock τ: a drafted token with probability ≥ τ is locked",
        kind=float,
        lo=0,
        hi=1,
        lo_open=True,
        optional=True,
        metavar="TAU",
        aliases=("tau",),
    )
    correction: bool = opt(False, "Re-Noising correction: reopen locked tokens that lost confidence")
    correction_floor: float = opt(
        0.05, "reopen a locked token whose probability fell below this", lo=0, hi=1, metavar="P"
    )
    correction_max_reopens: int = opt(8, "at most this many reopened tokens per step", lo=0, hi=100_000, metavar="N")
    reuse_locked: bool = opt(
        False,
        "approximation (needs --threshold): locked positions keep the distribution of "
        "the step that locked them (no LM head / sampler work for them; not reference-exact)",
    )

    def check(self, typed: Mapping[str, str]) -> None:
        if self.t_max < self.t_min:
            key = "t_min" if "t_min" in typed and "t_max" not in typed else "t_max"
            other = "t_max" if key == "t_min" else "t_min"
            rel = "≤" if key == "t_min" else "≥"
            raise UsageError(
                f"{typed.get(key, key)}: must be {rel} {other} ({getattr(self, other)}) (got {getattr(self, key)})"
            )
        if self.t_min == 0 and self.t_max == 0:
            raise UsageError(
                f"{typed.get('t_max', 't_max')}: this decoder needs a temperature > 0 at some step "
                "(the canvas sampler draws every step: no greedy mode; for near-deterministic output use "
                "a small one such as 0.1) (got 0)"
            )
        if self.reuse_locked and (self.threshold is None or self.correction):
            raise UsageError(
                f"{typed.get('reuse_locked', 'reuse_locked')}: needs a confidence lock (threshold) and "
                "no correction (reopening reads the locked positions' fresh distributions)"
            )
