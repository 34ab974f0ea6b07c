"""dInfer's hierarchy decoder (inclusionAI/dInfer ``python/dinfer/decoding/parallel_strategy.py``
``HierarchyDecoder.get_transfer_index``; arXiv 2510.08666), a part of the ``llada`` policy
(``parallel_decoding hierarchy``).

The block's masked positions fall into runs of consecutive masks. Per step: x0 = argmax (Gumbel-max when
temperature > 0); confidence = exp(log_softmax(logits)[x0]) at masked positions (the dtype's lowest value elsewhere);
committed: in each run the positions holding the run's highest confidence if it is > ``low_threshold`` (default 0.3,
dInfer's entry points'; the class's is 0.4), or'ed with every confidence > τ (``threshold``, default 0.9), or'ed with
the block's most confident position (its first on ties) — so decoding spreads over separated runs, one token each,
forcing the model to decode apart.
"""

from __future__ import annotations

import torch

from localdiff.decoding.dinfer_threshold import DEFAULT_THRESHOLD, proposals


def hierarchy_transfer(
    logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, threshold: float | None, low_threshold: float | None
) -> torch.Tensor:
    """The decision of dInfer's ``HierarchyDecoder``: BoolTensor[B, L] ⊆ ``masked`` (BoolTensor[B, L]).

    Args: logits FloatTensor[B, L, V]; x0 LongTensor[B, L] proposals; threshold / low_threshold (None = not
        applied).
    """
    b, n = masked.shape
    p = torch.log_softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1).exp()
    low = torch.finfo(p.dtype).min
    conf = torch.where(masked, p, torch.tensor(low, device=p.device, dtype=p.dtype))
    prev = torch.cat([masked.new_zeros((b, 1)), masked[:, :-1]], dim=1)
    starts = masked & ~prev
    run = torch.where(masked, torch.cumsum(starts.to(torch.int64), dim=-1) - 1, 0)
    best = torch.full((b, n), low, device=p.device, dtype=p.dtype)
    best = torch.scatter_reduce(best, 1, run, conf, reduce="amax", include_self=True)
    out = conf == best.gather(1, run)
    if low_threshold is not None:
        out &= conf > low_threshold
    if threshold is not None:
        out |= conf > threshold
    out |= torch.nn.functional.one_hot(conf.argmax(dim=-1), num_classes=n).to(torch.bool)
    return out & masked


class HierarchyDecoder:
    """``parallel_decoding hierarchy``. Args: threshold τ (None: 0.9), low_threshold, temperature, generator."""

    def __init__(
        self,
        threshold: float | None,
        low_threshold: float | None,
        temperature: float,
        generator: torch.Generator | None,
    ):
        self.threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        self.low_threshold, self.temperature, self.gen = low_threshold, temperature, generator

    def begin_block(self) -> None:
        """A new block (no state)."""

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor):
        """(x0 LongTensor[B, L] = ``xb`` where not masked, transfer BoolTensor[B, L] ⊆ ``masked``)."""
        x0 = proposals(logits, self.temperature, self.gen)
        transfer = hierarchy_transfer(logits, x0, masked, self.threshold, self.low_threshold)
        return torch.where(masked, x0, xb), transfer
