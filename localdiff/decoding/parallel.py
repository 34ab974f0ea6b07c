"""Which masked positions to commit in one step: the step schedule's top-k and Fast-dLLM's parallel decoding.

* :func:`topk_transfer` — the ``k`` most confident positions per row (LLaDA ``generate.py``, Dream
  ``generation_utils.py``: a fixed count per step from the schedule).
* :func:`threshold_transfer` — Fast-dLLM's confidence-aware parallel decoding (NVlabs/Fast-dLLM
  ``llada/generate.py`` ``get_transfer_index`` with ``threshold``; arXiv 2505.22618 §3.3; inclusionAI/dInfer's
  ``ThresholdParallelDecoder``): the top-1 masked position plus every masked position whose confidence ≥ τ.
* :func:`factor_transfer` — Fast-dLLM's factor variant (``get_transfer_index_dynamic``): the n most confident while
  the n-th has confidence ≥ 1 − factor / (n + 1), with the upstream edge rules kept.

All take ``confidence`` FloatTensor[B, L] (−inf where nothing may be committed) and return BoolTensor[B, L].
"""

from __future__ import annotations

import torch


def topk_transfer(confidence: torch.Tensor, k) -> torch.Tensor:
    """The ``k[j]`` most confident positions of each row j (``k``: LongTensor[B] or a list of B ints; ties as
    ``torch.topk``)."""
    out = torch.zeros_like(confidence, dtype=torch.bool)
    for j, kj in enumerate(k.tolist() if isinstance(k, torch.Tensor) else k):
        if kj > 0:
            out[j].index_fill_(0, torch.topk(confidence[j], k=kj).indices, True)  # no Python indexing per step
    return out


def threshold_transfer(confidence: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM threshold rule: per row with a masked position, its most confident masked position (as
    ``torch.topk``'s first) and every masked position with confidence ≥ ``threshold``. ``masked``: BoolTensor[B, L]."""
    out = masked & (confidence >= threshold)
    for j in range(confidence.shape[0]):
        if bool(masked[j].any()):
            out[j, torch.topk(confidence[j], k=1).indices] = True
    return out


def factor_transfer(confidence: torch.Tensor, masked: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM factor rule (``get_transfer_index_dynamic``): sorted confidences c_1 ≥ c_2 ≥ ...; thresholds
    t_1 = −1, t_n = 1 − factor / (n + 1); commit the top ``n`` where n is the first index whose confidence falls
    below its threshold — one more when that is the first or the last (upstream's rule, kept as is)."""
    out = torch.zeros_like(confidence, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        n_mask = int(masked[j].sum())
        if n_mask == 0:
            continue
        threshs = [1 - factor / (n + 1) for n in range(1, n_mask + 1)]
        threshs[0] = -1
        ranked = torch.sort(confidence[j][masked[j]], descending=True).values.tolist()
        top = 0
        for top in range(n_mask):
            if ranked[top] < threshs[top]:
                break
        if top == 0 or top == n_mask - 1:
            top += 1
        out[j, torch.topk(confidence[j], k=top).indices] = True
    return out


def select(
    confidence: torch.Tensor,
    masked: torch.Tensor,
    scheduled_k: torch.Tensor | None,
    threshold: float | None,
    factor: float | None,
) -> torch.Tensor:
    """Dispatch: ``factor`` rule, else ``threshold`` rule, else the schedule's ``scheduled_k`` (LongTensor[B] or a
    list of B ints)."""
    if factor is not None:
        return factor_transfer(confidence, masked, factor)
    if threshold is not None:
        return threshold_transfer(confidence, masked, threshold)
    return topk_transfer(confidence, scheduled_k)
