"""Decoder policy ``dream``: Dream's masked-diffusion sampling (HKUNLP/Dream ``generation_utils.py``
``DreamGenerationMixin._sample``, arXiv 2508.15487), optionally in Fast-dLLM's semi-autoregressive blocks
(NVlabs/Fast-dLLM ``dream/model/generation_utils_block.py``) and with Fast-dLLM's parallel decoding.

Per block of ``steps`` steps, timesteps = linspace(1, eps, steps + 1); step i goes from t = ts[i] to s = ts[i + 1].
The logits arrive position-aligned (the loop applies Dream's shift: the raw logit at i − 1 predicts token i).

* ``origin``: each masked position is revealed with probability 1 − s/t (1 at the last step) by a sample
  (``sample_tokens``: temperature, top_p, top_k; argmax at temperature 0).
* ``maskgit_plus`` / ``topk_margin`` / ``entropy``: a sample and a confidence per masked position (top-1 probability,
  top-1 − top-2 margin, negative entropy); int(masked · (1 − s/t)) positions are committed (all at the last step):
  the most confident, or drawn from softmax(confidence / alg_temp) when ``alg_temp`` > 0.
* ``threshold`` / ``factor`` (Fast-dLLM, its Dream ``confidence_threshold``): the top-1 probability is the
  confidence and :mod:`localdiff.decoding.parallel` decides.

``block_rule`` (:meth:`DreamOptions.fastdllm_blocks`) picks what a block's first step does. ``dream``: the rule above
from the block's first pass on. ``fastdllm`` (Fast-dLLM v1's Dream block loop, ``generation_utils_block.py``
``_sample``): the first pass (the caches' refresh) commits the block's first position, whatever its confidence; steps
i ≥ 1 then run the rule above with timesteps ts[i], ts[i + 1] (the schedule's last step commits the rest), or the
threshold rule until the block is full; ``alg_temp`` draws over the cached window as upstream's (the block and the
rest of the sequence with the prefix cache, the block with the dual cache). Its cached passes start at the block (the
loop's ``window_at_block``): the block's first row gets the window's own first logits, upstream's shift, and is never
read. At temperature > 0 the first position's token is drawn from its own row only (upstream samples every
position of the sequence and keeps one), so seeded draws differ from upstream's; at temperature 0 the tokens are
upstream's (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localdiff.decoding import parallel
from localdiff.decoding.sampling import sample_tokens
from localdiff.decoding.options import DreamOptions
from localdiff.errors import UsageError


class Dream:
    """The ``dream`` policy for one generation.

    Args:
        options: :class:`DreamOptions`. generator: torch.Generator for every draw. mask_id: the mask token id.
    """

    Options = DreamOptions
    cfg_scale = 0.0
    template = None  # (the masked loop's policy attributes: decoding/protocols.WindowPolicy)
    block_align = False

    def __init__(self, options: DreamOptions, generator: torch.Generator, mask_id: int):
        self.o, self.gen, self.mask_id = options, generator, mask_id
        self.parallel = options.threshold is not None or options.factor is not None
        #: Fast-dLLM's Dream block loop (module docstring); the loop then starts cached windows at the block
        self.fastdllm = options.fastdllm_blocks()
        self.window_at_block = self.fastdllm
        self.length = None  # the sequence's length P + max_new_tokens (the runner sets it)

    def begin_window(self, masked: torch.Tensor, steps: int, offset: int = 0) -> None:
        """A new block (``masked`` BoolTensor[B, L]) with a budget of ``steps``: its timesteps. ``offset``: the
        block's position in the sequence (the ``alg_temp`` draw runs over the sequence as upstream's does, so the
        same generator state picks the same positions)."""
        self.steps, self.offset = steps, offset
        self.ts = torch.linspace(1, self.o.eps, steps + 1, device=masked.device)
        if self.fastdllm and not self.parallel and steps < 2 and masked.shape[1] > 1:
            raise UsageError(
                f"steps: Fast-dLLM's Dream block loop needs at least 2 steps per block (its first pass "
                f"commits one position; got {steps} for a block of {masked.shape[1]}): give more steps "
                f"or block_rule dream"
            )
        # where upstream's alg_temp draw runs: Dream over the whole sequence (the block at `offset`); Fast-dLLM's
        # block loop over its cached window (the block, then the rest of the sequence without the dual cache)
        end = offset + masked.shape[1]
        rest = (self.length or end) - end if self.o.kv_cache != "dual" else 0
        self.pad = (0, rest) if self.fastdllm else (offset, 0)

    def _sample(self, logits, **kw):
        o = self.o
        return sample_tokens(logits, o.temperature, o.top_p, o.top_k, self.gen, **kw)

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor, i: int):
        """One step (see :meth:`localdiff.decoding.llada.LLaDA.step` for the shapes). Returns (x0, transfer)."""
        o, b = self.o, xb.shape[0]
        x0 = xb.clone()
        if self.fastdllm and i == 0:  # the refresh pass commits the block's first position
            first = torch.zeros_like(masked)
            first[:, 0] = masked[:, 0]
            _, x0[first] = self._sample(logits[first])
            return x0, first
        mask_logits = logits[masked]
        if self.parallel:
            conf, tok = self._sample(mask_logits)
            x0[masked] = tok
            full = torch.full(xb.shape, -torch.inf, dtype=logits.dtype, device=xb.device)
            full[masked] = conf
            return x0, parallel.select(full, masked, None, o.threshold, o.factor) & masked
        last = i >= self.steps - 1
        t, s = self.ts[min(i, self.steps - 1)], self.ts[min(i, self.steps - 1) + 1]
        if o.alg == "origin":
            p_transfer = 1 - s / t if not last else 1
            reveal = torch.rand(mask_logits.shape[0], generator=self.gen, device=xb.device) < p_transfer
            prop = torch.full((mask_logits.shape[0],), self.mask_id, dtype=torch.long, device=xb.device)
            _, prop[reveal] = self._sample(mask_logits[reveal])
            x0[masked] = prop
            transfer = torch.zeros_like(masked)
            transfer[masked] = reveal
            return x0, transfer
        conf, tok = self._sample(mask_logits, margin=o.alg == "topk_margin", neg_entropy=o.alg == "entropy")
        x0[masked] = tok
        rows = masked.any(1)
        num_mask = masked.sum() / max(int(rows.sum()), 1)
        n = int(num_mask * (1 - s / t)) if not last else int(num_mask)
        transfer = torch.zeros_like(masked)
        if n > 0:
            full = torch.full(xb.shape, -torch.inf, dtype=logits.dtype, device=xb.device)
            full[masked] = conf
            if not o.alg_temp:
                idx = torch.topk(full, n).indices
            else:
                full = torch.where(rows[:, None], full, torch.zeros_like(full))  # rows with nothing masked
                full = F.pad(full, self.pad, value=-torch.inf)
                idx = torch.multinomial(F.softmax(full / o.alg_temp, dim=-1), n, generator=self.gen) - self.pad[0]
            transfer[torch.arange(b, device=xb.device)[:, None].expand_as(idx), idx] = True
        return x0, transfer & masked & rows[:, None]
