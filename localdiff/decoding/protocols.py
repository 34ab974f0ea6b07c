"""The decoder contracts as ``typing.Protocol`` s (docs/ARCHITECTURE.md, "The decoder contract").

Two loops drive decoder policies, and each has its own protocol, because the calls differ:

* :class:`BlockPolicy` — the exact-cache block loop (:func:`localdiff.decoding.loop.run`: canvas and block families,
  DiffusionGemma's :class:`~localdiff.decoding.canvas_eb.CanvasEB`, SDAR, LLaDA2). The policy owns the canvas it
  denoises: the loop asks it for the model's inputs, hands it the logits to assess (no random draws), asks whether
  the block ends, then lets it advance (draws).
* :class:`WindowPolicy` — the masked family's loop (:func:`localdiff.decoding.masked_loop.run`: LLaDA, Dream, NAP).
  The loop owns the sequence; the policy is told which positions of the current window are masked and how many
  steps it has, and on each step returns the tokens to commit.

The contract test (``tests/project/test_decoder_protocols.py``) checks every registered policy class against its protocol,
so a new policy that misses a call fails there rather than inside a loop.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class BlockPolicy(Protocol):
    """A decoder policy of the exact-cache block loop.

    Calls, in order, per block: ``begin_block(start)`` once; then per denoising step ``model_inputs()``, the model's
    forward, ``assess(logits, step)``, ``ends_block(assessment, step)`` and, unless the block ended,
    ``advance(assessment)``; ``all_done()`` after each step tells the loop that every row of the batch is finished.
    Optional: ``head_rows()`` (BoolTensor[B, C] or None: the positions whose logits the next forward needs) and the
    attribute ``raw_logits`` (the forward returns the LM head's raw output, which ``assess`` takes).
    """

    def begin_block(self, start: torch.Tensor | None = None) -> None:
        """Open a new block / canvas. ``start``: LongTensor[B, C] initial canvas (the first block only) or None."""

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(canvas ids LongTensor[B, C], self-conditioning input or None) for the next forward."""

    def assess(self, logits: torch.Tensor, step: int) -> Any:
        """Read the forward's logits (FloatTensor[B, C, V]) at denoising step ``step``; no random draws."""

    def ends_block(self, a: Any, step: int) -> bool:
        """True when the block is final after this step (the loop then skips ``advance``)."""

    def advance(self, a: Any) -> dict:
        """Commit / renoise from the assessment ``a`` (random draws happen here); returns the step event's fields."""

    def all_done(self) -> bool:
        """True when every row's block is final."""


@runtime_checkable
class WindowPolicy(Protocol):
    """A decoder policy of the masked family's loop (approximate caches, the loop owns the sequence).

    Attributes the loop reads: ``parallel`` (bool: the rule commits at least one token per step, so the loop allows
    more steps than the schedule's); ``template`` (LongTensor[C] of tokens prefilled in the answer, mask id where
    masked — NAP's tags — or None); ``block_align`` (bool: windows start at multiples of the block length from the
    sequence start, dInfer's ``start_block_align``); ``window_at_block`` (bool: a shifted-logits model's cached
    window starts at the block, Fast-dLLM's Dream loop). Calls per window (block of the answer): ``begin_window(masked, steps, offset)`` once, then
    ``step(logits, x, masked, i)`` per denoising step until no position is masked.
    """

    parallel: bool
    template: torch.Tensor | None
    block_align: bool
    window_at_block: bool

    def begin_window(self, masked: torch.Tensor, steps: int, offset: int = 0) -> None:
        """Open a window. ``masked``: BoolTensor[B, L] masked positions; ``steps``: the window's step budget;
        ``offset``: the window's first absolute position."""

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor, i: int):
        """One denoising step: ``logits`` FloatTensor[B, L, V] of the window, ``xb`` LongTensor[B, L] its ids,
        ``masked`` BoolTensor[B, L]; returns (x0 LongTensor[B, L] proposed ids, transfer BoolTensor[B, L] the
        positions to commit)."""


def conforms(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks or gets wrong against ``protocol``'s methods (empty list: it conforms).

    Checks the class itself (``runtime_checkable`` checks only that instances have the names): each method must
    exist and take the protocol's parameters by the same names, in the same order (extra trailing parameters with
    defaults are allowed). Attributes set in ``__init__`` (``WindowPolicy.parallel``) are checked on instances.
    """
    import inspect

    problems = []
    for name, want in vars(protocol).items():
        if name.startswith("_") or not callable(want):
            continue
        have = getattr(cls, name, None)
        if have is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        wp = [q for q in inspect.signature(want).parameters][1:]
        hp = list(inspect.signature(have).parameters.values())[1:]
        extra = hp[len(wp) :]
        if [q.name for q in hp[: len(wp)]] != wp or any(q.default is inspect.Parameter.empty for q in extra):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(have)} does not match {name}({', '.join(wp)})")
    return problems
