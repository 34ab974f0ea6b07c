"""Token sampling shared by the decoder policies: top-k / top-p filtering and warped draws.

Two upstream conventions live here, each exact to its source, because they differ at the nucleus edge:

* :func:`top_p_logits`, :func:`top_k_logits`, :func:`sample_tokens` — Dream's (HKUNLP/Dream ``generation_utils.py``
  ``top_p_logits`` / ``top_k_logits`` / ``sample_tokens``), which SDAR's and Fast-dLLM v2's generate utilities copy:
  filtered logits go to dtype min, the sample is a ``torch.multinomial`` draw.
* :func:`sampling_probs`, :func:`draw` — z-lab/dflash ``_sampling_probs`` (used by the causal decoder and DFlash's
  speculative sampling): warped probabilities renormalised after the top-k then top-p cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localdiff.decoding.draws import categorical


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches ``top_p`` (the first always); others → dtype min."""
    sorted_logits, order = torch.sort(logits, descending=True)
    drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (ties with the k-th kept); others → dtype min."""
    kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p, top_k, generator, margin: bool = False, neg_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``sample_tokens`` on FloatTensor[N, V]: (confidence FloatTensor[N], tokens LongTensor[N])."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0 and probs.shape[0]:
        x0 = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        confidence = probs.gather(-1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin:
        top2 = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Warped probabilities FloatTensor[..., V] (fp32) of logits Tensor[..., V] for temperature > 0: divide by T,
    keep the top_k largest (0 = all), softmax, keep the smallest prefix of the sorted probabilities whose mass
    reaches top_p (the token that crosses it included), renormalise (z-lab/dflash ``_sampling_probs``)."""
    scores = logits.float() / temperature
    v = scores.shape[-1]
    idx = None
    if 0 < top_k < v:
        scores, idx = torch.topk(scores, top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sp, order = probs.sort(dim=-1, descending=True)
        sp = sp * (sp.cumsum(-1) - sp < top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    if idx is not None:
        probs = torch.zeros(*logits.shape, dtype=probs.dtype, device=probs.device).scatter(-1, idx, probs)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs Tensor[..., V] → LongTensor[...] (``torch.multinomial`` order and values)."""
    return categorical(probs.reshape(-1, probs.shape[-1]).contiguous(), generator).view(probs.shape[:-1])
