"""Decoder options of LLaDA2.x (block family, ``llada2_moe``): the ``llada2`` policy — LLaDA2.0's threshold decoder
and LLaDA2.1's token editing in one option set (editing is off when ``editing_threshold`` is unset).

Upstream names and defaults: the Hub ``modeling_llada2_moe.py`` ``generate`` (2.0: ``steps`` 32, ``threshold`` 0.95,
``minimal_topk`` 1, ``eos_early_stop`` False; 2.1 adds ``editing_threshold`` 0.9 and ``max_post_steps`` 16) and the
diffusers ``LLaDA2Pipeline`` (its 2.1 recommendation: threshold 0.7, editing_threshold 0.5, max_post_steps 16,
eos_early_stop True: the catalog's ``llada2.1:mini`` sampler). The block length is the model's (``block_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from localdiff.decoding.options_block import BlockSampling
from localdiff.decoding.options_masked import DInferParams
from localdiff.decoding.schema import decoder, opt
from localdiff.errors import UsageError


@decoder("llada2", "block", policy="localdiff.decoding.llada2:LLaDA2", model_types=("llada2_moe",))
@dataclass(frozen=True)
class LLaDA2Options(DInferParams, BlockSampling):
    """LLaDA2.x's block decoder (:mod:`localdiff.decoding.llada2`): per block, the step schedule
    ``get_num_transfer_tokens(block, steps)`` with ``steps = min(steps, max_new_tokens // minimal_topk)``; each step
    commits every masked position whose confidence exceeds ``threshold`` when at least the step's quota do, else the
    quota's most confident; with ``editing_threshold``, already committed (non-prompt) tokens of the block are
    replaced when the model's top token differs and its probability exceeds it, for at most ``max_post_steps`` extra
    steps once the block has no masks left (LLaDA2.1 token editing, arXiv 2602.08676). Sampling:
    :class:`BlockSampling`, except that at temperature 0 ``top_k`` / ``top_p`` still filter the logits and the
    confidence is the top token's probability renormalised over the kept tokens (the 2.0 generate's
    ``_sample_with_temperature_topk_topp``); with editing on (the 2.1 generate, which ignores them at temperature 0)
    they are refused there.

    ``parallel_decoding`` replaces the threshold rule and the step schedule with one of dInfer's decoders (as
    dInfer's ``BlockDiffusionLLM`` runs them on LLaDA2: :mod:`localdiff.decoding.llada2`), with the ``llada``
    decoder's parameters of the same names.

    Errors: :class:`UsageError` for ``top_k`` / ``top_p`` typed at temperature 0 with ``editing_threshold``, and for
    ``parallel_decoding`` with ``editing_threshold``."""

    steps: int | None = opt(
        None,
        "denoising steps per block before editing (default: the block length, at least one token per step)",
        kind=int,
        lo=1,
        hi=100_000,
        optional=True,
        metavar="N",
        aliases=("denoising_steps",),
    )
    threshold: float = opt(
        0.95,
        "commit every masked position whose confidence exceeds this (when at least the "
        "step's quota do; else the quota's most confident)",
        lo=0,
        hi=1,
        metavar="TAU",
    )
    minimal_topk: int = opt(
        1, "cap the steps per block at max_new_tokens // minimal_topk", lo=1, hi=100_000, metavar="K"
    )
    editing_threshold: float | None = opt(
        None,
        "LLaDA2.1 token editing: replace a committed token of the block "
        "when another token's probability exceeds this (off = no editing)",
        kind=float,
        lo=0,
        hi=1,
        lo_open=True,
        optional=True,
        metavar="X",
    )
    max_post_steps: int = opt(
        16, "token editing: extra steps per block once it has no masks left", lo=0, hi=10_000, metavar="N"
    )
    eos_early_stop: bool = opt(
        False, "stop as soon as an EOS is committed and every generated position before it is filled (mid-block)"
    )
    parallel_decoding: str | None = opt(
        None,
        "dInfer's parallel decoders on LLaDA2 (inclusionAI/dInfer "
        "BlockDiffusionLLM): threshold (the top-1 and every confidence ≥ τ), credit, "
        "hierarchy; τ = --threshold; no step schedule (off = LLaDA2's threshold rule)",
        kind=str,
        choices=("threshold", "credit", "hierarchy"),
        optional=True,
        metavar="DECODER",
    )

    def check(self, typed: Mapping[str, str]) -> None:
        if self.parallel_decoding is not None and self.editing_threshold is not None:
            raise UsageError(
                f"{typed.get('parallel_decoding', 'parallel_decoding')}: dInfer's decoders do not edit "
                f"committed tokens; leave editing_threshold unset (got {self.editing_threshold})"
            )
        if self.editing_threshold is None:
            return  # LLaDA2.0: top-k / top-p apply at temperature 0 too
        if (
            self.temperature == 0
            and (self.top_k is not None or self.top_p not in (None, 1.0))
            and ("top_k" in typed or "top_p" in typed)
        ):
            key = "top_k" if "top_k" in typed else "top_p"
            raise UsageError(
                f"{typed[key]}: with editing_threshold (LLaDA2.1, whose generate ignores them at "
                f"temperature 0) top-k / top-p need temperature > 0 (got temperature 0)"
            )
