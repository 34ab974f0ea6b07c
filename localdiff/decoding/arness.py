"""ARness: how autoregressive (left to right) a generation's decoding order was (torch-free, pure).

Definitions (DiffuCoder, Gong et al., arXiv 2506.20639, §4.1 and Appendix A.2 "Generation autoregressive-ness";
used unchanged by NAP, Li et al., arXiv 2602.23225, whose README reports "Global-ARness@1" 0.73 for LLaDA-8B and
0.92 for Dream-7B). With one token unmasked per step, p_t the position unmasked at step t = 1..T and M_{t−1} the
positions still masked just before step t, sorted m⁽¹⁾ < m⁽²⁾ < …:

    Local AR-ness@k  (NTP@k) = 1/T · Σ_t I_local(t, k),   I_local(t, k)  = 1 iff p_{t−i} = p_t − i for i = 1..k
    Global AR-ness@k (FMS@k) = 1/T · Σ_t I_global(t, k),  I_global(t, k) = 1 iff p_t ∈ {m⁽¹⁾, …, m⁽ᵏ⁾} of M_{t−1}

(Appendix A.2 writes the local condition as the set equality {p_{t−i}}ᵢ₌₁ᵏ = {p_t − i}ᵢ₌₁ᵏ; its Figure 3 caption
says "together with the k immediately preceding predicted tokens, forms a strictly increasing consecutive
sequence", which is the element-wise reading used here.) Both are 1 for strictly left-to-right decoding; local
ARness falls with k, global rises with k.

What the paper leaves open, and the conventions taken here (each one keeps left-to-right decoding at exactly 1):

* Steps before the first: the prompt counts as decoded left to right before the answer (p_{1−j} = −j for j ≥ 1,
  positions 0-based from the answer's first token), so the first answer token continues it.
* Several tokens committed in one step (parallel decoding, Fast-dLLM thresholds, NAP): the tokens of one step are
  taken left to right, which makes the order a permutation p_1..p_N of the N decoded tokens, and the averages are over
  tokens (T = N). With one token per step this is exactly the paper's formula.
* Positions not decoded by the model (commit step ≤ 0: template tokens a canvas prefills, such as NAP's
  ``<think i>`` tags) are left out, and positions are re-numbered over the decoded ones (the template is context,
  like the prompt).
"""

from __future__ import annotations

from typing import Sequence

#: the k reported in stats and by the CLI
KS = (1, 2, 3, 4)


def decoding_order(commit_step: Sequence[int]) -> list[int]:
    """The decoding order p_1..p_N from a commit-step list.

    Args:
        commit_step: per position (0-based, left to right) the 1-based step it was committed at
            (``GenerationStats.commit_step`` for one row); ≤ 0 = not decoded (left out).
    Returns:
        Positions re-numbered 0..N−1 over the decoded ones, in decoding order; ties (one step) left to right.
    """
    decoded = [(int(s), i) for i, s in enumerate(commit_step) if int(s) > 0]
    rank = {i: r for r, (_, i) in enumerate(sorted(decoded, key=lambda x: x[1]))}
    return [rank[i] for _, i in sorted(decoded)]


def local_arness(order: Sequence[int], k: int) -> float:
    """Local AR-ness@k (NTP@k, DiffuCoder Appendix A.2) of a decoding order (a permutation of 0..N−1), with the
    prompt as the decoded history before p_1 (module docstring). 0.0 for an empty order. Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"k must be ≥ 1 (got {k})")
    if not order:
        return 0.0
    hist = [-j for j in range(k, 0, -1)] + list(order)  # p_{1-k} .. p_0 = the prompt, then p_1 .. p_N
    hits = sum(all(hist[t - i] == hist[t] - i for i in range(1, k + 1)) for t in range(k, len(hist)))
    return hits / len(order)


def global_arness(order: Sequence[int], k: int) -> float:
    """Global AR-ness@k (FMS@k, DiffuCoder Appendix A.2) of a decoding order (a permutation of 0..N−1): the fraction
    of steps whose token is among the k leftmost positions still masked. 0.0 for an empty order. Raises ValueError
    for k < 1 or an order that is not a permutation."""
    if k < 1:
        raise ValueError(f"k must be ≥ 1 (got {k})")
    left = masked_left(order)
    return sum(c < k for c in left) / len(left) if left else 0.0


def masked_left(order: Sequence[int]) -> list[int]:
    """Per step t, how many positions left of p_t are still masked just before step t (0 = p_t is the leftmost mask;
    p_t is among the k leftmost iff this is < k). O(N log N) (a Fenwick tree over decoded positions).
    Raises ValueError when ``order`` is not a permutation of 0..N−1."""
    n = len(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of 0..N-1")
    tree = [0] * (n + 1)
    out = []
    for p in order:
        i, decoded_left = p, 0
        while i > 0:  # decoded positions in [0, p)
            decoded_left += tree[i]
            i -= i & -i
        out.append(p - decoded_left)
        i = p + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
    return out


def summary(commit_step, ks: Sequence[int] = KS) -> dict:
    """``{"local@k": float, "global@k": float}`` for each k in ``ks``; for a batch (a list of lists) the mean over
    rows with at least one decoded token. Empty dict when nothing was decoded (e.g. the canvas family, whose
    ``commit_step`` is empty)."""
    rows = commit_step if commit_step and isinstance(commit_step[0], (list, tuple)) else [commit_step]
    orders = [o for o in (decoding_order(r) for r in rows) if o]
    if not orders:
        return {}
    out = {}
    for k in ks:
        out[f"local@{k}"] = sum(local_arness(o, k) for o in orders) / len(orders)
    for k in ks:
        out[f"global@{k}"] = sum(global_arness(o, k) for o in orders) / len(orders)
    return out


def describe(arness: dict, ks: Sequence[int] = (1,)) -> str:
    """One line for humans: ``"ARness local@1 0.93 global@1 0.97"`` ("" when empty)."""
    if not arness:
        return ""
    parts = [
        f"{kind}@{k} {arness[f'{kind}@{k}']:.2f}" for kind in ("local", "global") for k in ks if f"{kind}@{k}" in arness
    ]
    return "ARness " + " ".join(parts)
