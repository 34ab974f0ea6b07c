"""Stopping: per canvas (stable-and-confident, reference ``StableAndConfidentStoppingCriteria``) and per
sequence (any EOS id ends a row; tokens after its first EOS become pad; max_new_tokens)."""

from __future__ import annotations

import torch

from localdiff.decoding.acceptance import token_entropy


class StableAndConfident:
    """Stop a row's canvas when its argmax canvas equals each of the last ``stability`` argmax canvases and the
    mean per-position entropy of the (temperature-scaled) logits is below ``confidence`` (nats).

    Call :meth:`reset` at each new canvas; ``__call__(argmax[B, C], logits[B, C, V]) -> BoolTensor[B]``.
    """

    def __init__(self, stability: int, confidence: float):
        self.stability = int(stability)
        self.confidence = float(confidence)
        self.history = None

    def reset(self) -> None:
        self.history = None

    def __call__(self, argmax: torch.Tensor, logits: torch.Tensor, entropy: torch.Tensor | None = None) -> torch.Tensor:
        if self.stability == 0:
            stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        else:
            if self.history is None:  # the last `stability` argmax canvases, oldest first (-1 = none yet)
                self.history = [torch.full_like(argmax, -1)] * self.stability
            stable = (self.history[0] == argmax).all(-1)
            for h in self.history[1:]:
                stable &= (h == argmax).all(-1)
            self.history = self.history[1:] + [argmax]
        ent = entropy if entropy is not None else token_entropy(logits)
        return stable & (ent.mean(-1) < self.confidence)


def finalize_canvas(
    canvas: torch.Tensor, finished: torch.Tensor, eos_ids: torch.Tensor | None, pad_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply sequence stopping to a just-finished canvas.

    Args:
        canvas: LongTensor[B, C] (argmax canvas, modified copy returned); finished: BoolTensor[B] rows finished in
            earlier canvases; eos_ids: LongTensor[K] or None; pad_id: pad token or None.
    Returns:
        (canvas with rows finished earlier set to pad and tokens after each row's first EOS set to pad,
         finished BoolTensor[B] updated with rows that produced an EOS or an all-pad canvas).
    """
    canvas = canvas.clone()
    now = torch.zeros_like(finished)
    if eos_ids is not None and eos_ids.numel():
        is_eos = torch.isin(canvas, eos_ids)
        now = is_eos.any(-1)
    if pad_id is not None:  # a canvas of nothing but pad: the model has ended the answer without an EOS token
        now = now | (canvas == pad_id).all(-1)
    if pad_id is not None:
        canvas[finished] = pad_id
        if eos_ids is not None and bool(now.any()):
            c = is_eos.cumsum(-1)
            after = (c > 0) & ~((c == 1) & is_eos)
            fresh = now & ~finished
            canvas[after & fresh[:, None]] = pad_id
    return canvas, finished | now
