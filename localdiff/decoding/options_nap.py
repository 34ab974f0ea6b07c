"""Decoder options of parallel-forced decoding (NAP, arXiv 2602.23225) for multi-trajectory canvases: a policy of the
masked family (:mod:`localdiff.decoding.nap`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt
from localdiff.errors import UsageError


@decoder("nap", "masked", policy="localdiff.decoding.nap:NAP", selectable=True)
@dataclass(frozen=True)
class NAPOptions(Options):
    """Parallel-forced decoding (NAP, Li et al., arXiv 2602.23225; pixeli99/NAP): a canvas of ``trajectories`` think
    blocks of ``think_length`` masks and a summary block of ``summary_length`` masks (``<think 1> … <think m> …
    <summary> …``); every step unmasks in every unfinished think block (the step's budget split by ``budget``), by
    confidence inside a block; then the summary, LLaDA low-confidence. The canvas length is the template's
    (max_new_tokens does not apply)."""

    trajectories: int = opt(
        2,
        "parallel-forced decoding: number of think blocks m (independent reasoning trajectories) before the summary",
        lo=1,
        hi=16,
        metavar="M",
    )
    think_length: int = opt(32, "tokens (masks) per think block", lo=1, hi=4096, metavar="N")
    summary_length: int = opt(32, "tokens (masks) of the summary block", lo=1, hi=4096, metavar="N")
    budget: str = opt(
        "even",
        "how a step's unmasking budget is split over the unfinished think blocks: even "
        "(the remainder to the most confident blocks) or confidence (one per block, the rest to the "
        "most confident positions of any block)",
        choices=("even", "confidence"),
    )
    steps: int | None = opt(
        None,
        "denoising steps over the whole canvas, split between the think phase and the "
        "summary by their lengths (default: one token per think block per step, then one per "
        "step)",
        kind=int,
        lo=2,
        hi=1_000_000,
        optional=True,
        metavar="N",
    )
    temperature: float = temperature_opt(0.0, "Gumbel-max sampling temperature (0 = argmax)")
    kv_cache: str = opt(
        "none",
        "approximate K/V cache (Fast-dLLM): none, prefix or dual; the canvas is one block",
        choices=("none", "prefix", "dual"),
    )

    @property
    def block_length(self) -> None:
        """The masked loop's block length: the whole canvas is one block (the policy does its own phases)."""
        return None

    def check(self, typed: Mapping[str, str]) -> None:
        if self.trajectories * self.think_length + self.summary_length > 65536:
            raise UsageError(
                f"{typed.get('think_length', 'think_length')}: the canvas is too long "
                f"({self.trajectories} × {self.think_length} + {self.summary_length} tokens)"
            )
