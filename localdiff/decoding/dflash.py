"""DFlash speculative decoding: the decoder policy (arXiv 2602.06036; z-lab/dflash ``dflash/model.py``,
``dflash_generate`` / ``sample`` / ``_sampling_probs`` / ``_rejection_sample``).

Per step, :class:`DFlash` proposes a block ``[last token, d_1 … d_{n−1}]`` from one draft pass over
``[last token, mask × (n − 1)]`` (:meth:`DFlash.propose`), then :meth:`DFlash.verify` takes the target's logits of
that block (one forward) and returns how many drafts are accepted and the token after them:

* temperature 0 (greedy, lossless): the target's argmax ``y`` at each block position; accept the longest prefix with
  ``d_i = y_{i−1}``, then the bonus ``y_acc``. The output is exactly the target's own greedy decoding.
* temperature > 0: drafts are sampled from the draft's warped distribution q; draft i is accepted while
  ``u_i · q(d_i) < p(d_i)`` (u ~ U[0, 1): accept with probability min(1, p/q)); at the first rejection the next
  token is drawn from ``max(p − q, 0)`` renormalised (p when that is all zero), after a full acceptance from p at
  the block's last position (speculative sampling, Leviathan et al. arXiv 2211.17192; Chen et al. 2302.01318).
  p and q are softmax(logits / T) restricted to the top-k then the top-p nucleus (:func:`sampling_probs`).

Draws come from the run's generator in the reference's order (draft multinomial, uniforms, bonus multinomial), so a
seeded run equals ``torch.manual_seed(seed); dflash_generate(...)`` on the CPU.
"""

from __future__ import annotations

import torch

from localdiff.decoding.sampling import draw, sampling_probs


def pick(logits: torch.Tensor, options, generator) -> torch.Tensor:
    """Next token(s) from logits Tensor[..., V]: argmax at temperature 0, else a draw from :func:`sampling_probs`."""
    if options.temperature <= 0:
        return logits.argmax(-1)
    return draw(sampling_probs(logits, options.temperature, options.top_p, options.top_k), generator)


class DFlash:
    """The DFlash policy over one row (batch 1, as the reference).

    Args:
        options: :class:`localdiff.decoding.options_causal.CausalOptions` (temperature, top_p, top_k).
        generator: torch.Generator of the run.
    """

    def __init__(self, options, generator: torch.Generator | None):
        self.options, self.generator = options, generator
        self.draft_probs: torch.Tensor | None = None

    def propose(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft tokens LongTensor[1, n−1] from the draft's logits FloatTensor[1, n−1, V] of block positions 1..n−1
        (argmax, or sampled from q which is kept for :meth:`verify`)."""
        o = self.options
        if o.temperature <= 0:
            self.draft_probs = None
            return draft_logits.argmax(-1)
        self.draft_probs = sampling_probs(draft_logits, o.temperature, o.top_p, o.top_k)
        return draw(self.draft_probs, self.generator)

    def verify(self, block: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
        """(accepted drafts a in 0..n−1, the next token) from the block LongTensor[1, n] (drafts at 1..n−1) and the
        target's logits FloatTensor[1, n, V] of the block (position i predicts token i + 1)."""
        o = self.options
        drafts = block[:, 1:]
        gamma = drafts.shape[1]
        if o.temperature <= 0:
            post = target_logits.argmax(-1)
            acc = int((drafts == post[:, :-1]).cumprod(dim=1).sum(dim=1)[0]) if gamma else 0
            return acc, int(post[0, acc])
        p_all = sampling_probs(target_logits, o.temperature, o.top_p, o.top_k)
        if gamma == 0 or self.draft_probs is None:
            return 0, int(draw(p_all[:, -1], self.generator)[0])
        p = p_all[:, :gamma].gather(-1, drafts[..., None])[..., 0]
        q = self.draft_probs.gather(-1, drafts[..., None])[..., 0]
        u = torch.rand(q.shape, generator=self.generator, dtype=q.dtype, device=q.device)
        acc = int((u * q < p).to(torch.int32).cumprod(-1).sum(-1)[0])
        if acc == gamma:
            return acc, int(draw(p_all[:, -1], self.generator)[0])
        residual = (p_all[0, acc] - self.draft_probs[0, acc]).clamp_min(0)
        total = residual.sum()
        residual = residual / total if float(total) > 0 else p_all[0, acc]
        return acc, int(draw(residual[None], self.generator)[0])
