"""Decoder options of LLaDA2.x (block family, ``llada2_moe``): the ``llada2`` policy — LLaDA2.0's threshold decoder
and LLaDA2.1's token editing in one option set (editing is off when ``editing_threshold`` is unset).

Upstream names and defaults: the Hub ``modeling_llada2_moe.py`` ``generate`` (2.0: ``steps`` 32, ``threshold`` 0.95,
``minimal_topk`` 1, ``eos_early_stop`` False; 2.1 adds ``editing_threshold`` 0.9 and ``max_post_steps`` 16) and the
diffusers ``LLaDA2Pipeline`` (its 2.1 recommendation: threshold 0.7, editing_threshold 0.5, max_post_steps 16,
eos_early_stop True: the catalog's ``llada2.1:mini`` sampler). The block length is the model's (``block_size``).
"""
from __future__ import annotations

from dataclasses import dataclass

from localdiff.decoding.options_block import BlockSampling
from localdiff.decoding.schema import decoder, opt


@decoder("llada2", "block", policy="localdiff.decoding.llada2:LLaDA2", model_types=("llada2_moe",))
@dataclass(frozen=True)
class LLaDA2Options(BlockSampling):
    """LLaDA2.x's block decoder (:mod:`localdiff.decoding.llada2`): per block, the step schedule
    ``get_num_transfer_tokens(block, steps)`` with ``steps = min(steps, max_new_tokens // minimal_topk)``; each step
    commits every masked position whose confidence exceeds ``threshold`` when at least the step's quota do, else the
    quota's most confident; with ``editing_threshold``, already committed (non-prompt) tokens of the block are
    replaced when the model's top token differs and its probability exceeds it, for at most ``max_post_steps`` extra
    steps once the block has no masks left (LLaDA2.1 token editing, arXiv 2602.08676). Sampling:
    :class:`BlockSampling`."""

    steps: int | None = opt(None, "denoising steps per block before editing (default: the block length, at least "
                            "one token per step)", kind=int, lo=1, hi=100_000, optional=True, metavar="N",
                            aliases=("denoising_steps",))
    threshold: float = opt(0.95, "commit every masked position whose confidence exceeds this (when at least the "
                           "step's quota do; else the quota's most confident)", lo=0, hi=1, metavar="TAU")
    minimal_topk: int = opt(1, "cap the steps per block at max_new_tokens // minimal_topk", lo=1, hi=100_000,
                            metavar="K")
    editing_threshold: float | None = opt(None, "LLaDA2.1 token editing: replace a committed token of the block "
                                          "when another token's probability exceeds this (off = no editing)",
                                          kind=float, lo=0, hi=1, lo_open=True, optional=True, metavar="X")
    max_post_steps: int = opt(16, "token editing: extra steps per block once it has no masks left", lo=0,
                              hi=10_000, metavar="N")
    eos_early_stop: bool = opt(False, "stop as soon as an EOS is committed and every generated position before it "
                               "is filled (mid-block)")
