"""Decoder policy ``llada2``: LLaDA2.x's block decoder (Hub ``modeling_llada2_moe.py`` ``generate`` of LLaDA2.0 and
LLaDA2.1; diffusers ``LLaDA2Pipeline`` + ``BlockRefinementScheduler``) on the generic block loop, built on the SDAR
policy (:class:`localdiff.decoding.sdar.SDAR`: schedule, sampling, dynamic threshold selection).

Per block (the model's block length B; the first block holds the prompt's tail before its masks, blocks sit at
absolute positions): ``steps = min(steps or B, max_new_tokens // minimal_topk)``, quota per step from
``get_num_transfer_tokens(B, steps)``. Each step takes each position's top token (temperature 0; its softmax
probability is the confidence) or a sample, then

* commits every masked position with confidence > ``threshold`` when at least the quota are, else the quota's most
  confident masked positions (LLaDA2.0's threshold decoding);
* with ``editing_threshold`` (LLaDA2.1): replaces committed, non-prompt tokens of the block whose top token differs
  and has probability > ``editing_threshold`` (:mod:`localdiff.decoding.editing`), during the mask steps and for
  at most ``max_post_steps`` steps after the last mask is filled; a post step that edits nothing ends the block;
* ``eos_early_stop``: a row stops as soon as this step committed an EOS and every generated position before the
  first EOS is filled (LLaDA2.0's generate), even mid-block; its later positions are dropped.

Sampling: temperature / top-k / top-p as :class:`SDAR`, and at temperature 0 the 2.0 generate's
``_sample_with_temperature_topk_topp``: ``top_k`` / ``top_p`` still filter the logits, the token is the top one and
its confidence its probability renormalised over the kept tokens (so the threshold sees larger confidences).

dInfer's decoders (``parallel_decoding`` threshold / credit / hierarchy: inclusionAI/dInfer ``serving.py``
``init_generator`` with ``use_bd``, ``generate_uniform.py`` ``BlockDiffusionLLM``, which runs them on LLaDA2 in the
same block layout): each step the decoder (:mod:`localdiff.decoding.dinfer_threshold` and its siblings) reads the
block's logits and commits — dInfer's threshold rule is the top-1 and every confidence ≥ τ (float32 softmax), where
LLaDA2's is > τ with the schedule's quota — with no step schedule (``steps`` / ``minimal_topk`` unread) until the
block is full.

Where we differ from upstream, on purpose: the EOS search looks at generated positions only (the 2.0 generate also
finds an EOS inside the prompt — a chat history — and then returns an empty answer); the post-mask steps are
bounded as the 2.1 generate bounds them (at most ``max_post_steps`` forwards; diffusers runs one more); the quota
comes from the step schedule in both modes (2.1's ``num_to_transfer = n`` is ``steps = B / n``: the default n = 1 is
``steps = B``). Finished blocks are never edited (upstream edits only the current block too), so their cached K/V
stay exact.
"""

from __future__ import annotations

import torch

from localdiff.decoding.editing import EditingConfig, block_finished, edit_positions
from localdiff.decoding.llada import dinfer_decoder
from localdiff.decoding.options import LLaDA2Options, SDAROptions
from localdiff.decoding.sdar import SDAR, transfer_schedule


class LLaDA2(SDAR):
    """The ``llada2`` policy for one generation (module docstring); the loop's calls as :class:`SDAR`.

    Args:
        options: :class:`localdiff.decoding.options.LLaDA2Options`.
        batch, block, mask_id, device, generator: as :class:`SDAR`.
        max_new_tokens: the answer's token budget (``minimal_topk`` caps the steps with it; None = no cap).
        eos_ids: the model's EOS ids (``eos_early_stop``).
    """

    Options = LLaDA2Options
    TAKES_BUDGET = True

    def __init__(
        self,
        options: LLaDA2Options,
        batch: int,
        block: int,
        mask_id: int,
        device,
        generator: torch.Generator | None,
        max_new_tokens: int | None = None,
        eos_ids=(),
    ):
        steps = options.steps or block
        if max_new_tokens is not None:
            steps = min(steps, max(1, max_new_tokens // options.minimal_topk))
        super().__init__(
            SDAROptions(
                steps=steps,
                remasking_strategy="low_confidence_dynamic",
                confidence_threshold=options.threshold,
                temperature=options.temperature,
                top_k=options.top_k,
                top_p=options.top_p,
            ),
            batch,
            block,
            mask_id,
            device,
            generator,
        )
        self.options = options
        #: the 2.0 generate filters at temperature 0; the 2.1 generate (editing on) does not
        self.filter_at_zero = options.editing_threshold is None
        self.editing = EditingConfig(options.editing_threshold, options.max_post_steps)
        self.mask_steps = steps
        self.schedule = transfer_schedule(block, steps)
        if self.editing.enabled:
            self.max_steps = steps + options.max_post_steps
        #: dInfer's decoder (``parallel_decoding``) or None; each of its steps commits ≥ 1 mask: ≤ block steps
        self.dinfer = dinfer_decoder(options, generator, mask_id)
        if self.dinfer is not None:
            self.max_steps = block
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device) if eos_ids else None

    def begin_block(self, start: torch.Tensor | None = None) -> None:
        """As :class:`SDAR`; the start's non-mask positions (the prompt's tail) are never edited."""
        super().begin_block(start)
        self.prompt = self.canvas != self.mask_id
        if self.dinfer is not None:
            self.dinfer.begin_block()
        self.post = torch.zeros(self.b, dtype=torch.long, device=self.dev)

    def assess(self, logits: torch.Tensor, step: int):
        """As :class:`SDAR` (the mask token is never a prediction), with the quota of step ``min(step, steps)``
        (post-mask steps have no masks)."""
        if self.dinfer is not None:  # dInfer's decoders read the logits (the mask token never predicted)
            self.logits = logits.float().clone()
            self.logits[..., self.mask_id] = -torch.inf
        return super().assess(logits, min(step, self.mask_steps))

    def ends_block(self, a, step: int) -> bool:
        """With editing (or dInfer's decoders) a block's end depends on the step: never known in advance."""
        return False if self.editing.enabled or self.dinfer is not None else super().ends_block(a, step)

    def advance(self, a) -> dict:
        """Commit masks, edit committed tokens, stop rows; returns the StepEvent fields (device tensors)."""
        live = ~self.done[:, None]
        if self.dinfer is not None:
            x0, commit = self.dinfer.step(self.logits, self.canvas, a.masked & live)
            conf = a.probs.gather(-1, x0[..., None]).squeeze(-1)
        else:
            x0, conf = self.draw(a)
            commit = self._select(conf, a.masked, a.k) & live
        edits = edit_positions(self.canvas, ~a.masked & ~self.prompt & live, x0, conf, self.editing)
        changed = commit | edits
        self.canvas = torch.where(changed, x0, self.canvas)
        self.argmax = self.canvas
        left = self.canvas == self.mask_id
        had = a.masked.any(-1)
        self.post += (~had & ~self.done).long()
        now = block_finished(had, left.any(-1), edits.any(-1), self.post, self.editing)
        if self.options.eos_early_stop and self.eos is not None:
            now |= self._eos_stop(x0, changed, left)
        self.done = self.done | now
        return self._event(a, x0, conf, left, edits)

    def _eos_stop(self, x0: torch.Tensor, changed: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """BoolTensor[B]: this step committed an EOS and no generated position before the block's first generated
        EOS is a mask (earlier blocks are complete and hold no EOS, or the row would have ended)."""
        committed_eos = (torch.isin(x0, self.eos) & changed).any(-1)
        is_eos = torch.isin(self.canvas, self.eos) & ~self.prompt
        pos = torch.arange(self.c, device=self.dev)
        first = torch.where(is_eos, pos, self.c).min(-1).values
        gap = (left & (pos[None, :] < first[:, None])).any(-1)
        return committed_eos & is_eos.any(-1) & ~gap
