"""dInfer's vicinity refresh of the dual cache (inclusionAI/dInfer ``python/dinfer/decoding/generate_uniform.py``
``VicinityCacheIteration`` with ``utils.DiffusionKVCacheManager.require_update``; arXiv 2510.08666): the masked loop's
``kv_cache vicinity`` (:mod:`localdiff.decoding.masked_loop`).

Like Fast-dLLM's dual cache, every layer's K/V of the whole sequence is kept from a full pass and each step
recomputes a window over them; the window is the block widened by ``prefix_look`` tokens before it and
``after_look`` after it (clipped to the sequence), so the K/V next to the block — the most stale — are fresh at every
step (the cached K/V themselves are not overwritten). dInfer's schedule, kept exactly (one dInfer iteration = one
or two of the loop's steps, each one forward and one decision):

* the generation's first ``warmup_steps`` iterations are uncached full passes (``full``);
* then an iteration is a ``refresh`` (a full pass that also stores the K/V; the block is decided from it) followed
  by a ``window`` step, or a ``window`` step alone. A refresh happens when no K/V exist yet, or when the block
  changed since the last check and is not the first block — the check (``require_update``) runs only once K/V exist,
  so the block where the cache is first made is refreshed again at its next iteration unless it is the first block.

Token-identical to dInfer's loop with ``maximum_unroll=1``; dInfer's loop unrolling (several iterations between mask
checks, a CUDA-graph device) runs extra passes on a finished block, which localdiff skips (fewer forwards).
"""

from __future__ import annotations


class VicinityRefresh:
    """The refresh schedule of one generation.

    Args: prefix_look / after_look: tokens before / after the block in each window step; warmup_steps: uncached
        iterations at the start.
    """

    def __init__(self, prefix_look: int, after_look: int, warmup_steps: int):
        self.prefix_look, self.after_look, self.warmup = prefix_look, after_look, warmup_steps
        self.iter_no = 0  # dInfer's iteration counter (iter_no): counts every forward
        self.has_cache = False
        self.seen = None  # the block require_update last saw (block_start, block_end)
        self.window_next = False
        self.block = (0, 0, 0)

    def begin_block(self, block_id: int, start: int, end: int) -> None:
        """A new block ``block_id`` over sequence positions [start, end) (dInfer's block, which may begin in the
        prompt with aligned blocks)."""
        self.block = (block_id, start, end)
        self.window_next = False  # a refresh that finished its block is not followed by a window pass

    def next(self) -> str:
        """The kind of the next forward: ``"full"`` (uncached), ``"refresh"`` (full + store the K/V) or
        ``"window"`` (see :meth:`window`)."""
        self.iter_no += 1
        if self.window_next:
            self.window_next = False
            return "window"
        if self.iter_no - 1 < self.warmup:
            return "full"
        block_id, start, end = self.block
        refresh = not self.has_cache
        if not refresh:  # require_update: has the block changed since last time?
            changed = self.seen != (start, end)
            self.seen = (start, end)
            refresh = changed and block_id > 0
        if refresh:
            self.has_cache = True
            self.window_next = True
            return "refresh"
        return "window"

    def window(self, total: int) -> tuple[int, int]:
        """The recomputed window [lo, hi) of sequence positions in a ``window`` step (``total``: sequence length)."""
        _, start, end = self.block
        return max(0, start - self.prefix_look), min(total, end + self.after_look)
