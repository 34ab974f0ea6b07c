"""One step's vocabulary-sized work in one fused native pass, or few in-place torch passes (issue #24): soft-capping,
temperature, argmax, entropy, confidence and the probabilities, from the model's logits.

Why: at a canvas of 256 and a 32k vocabulary each [C, V] fp32 tensor is 32 MiB; the straightforward sampler
(``logits / T``, ``argmax``, ``logsumexp`` + ``softmax`` for the entropy, ``softmax`` again for the draft, a third in
the model's self-conditioning) made ~20 vocab-sized passes, most into freshly allocated tensors, and was 57 % of a
150M bf16 denoising step here. The same math (``H = log s − Σ eᵢxᵢ / s`` with ``x = z − max z``, ``e = exp x``,
``s = Σ e``, top-1 probability ``1 / s``), rounded differently, so it is used only off the reference-exact fp32
path (:class:`localdiff.decoding.canvas_eb.CanvasEB` with a 16-bit compute dtype).

Native (:mod:`localdiff.kernels.vocab`, when a C compiler builds it and ``LOCALDIFF_VOCAB_KERNEL`` is not
``torch``): the model's raw 16-bit logits (:class:`localdiff.arch.soft_embedding.RawLogits`) are read once and the
probabilities written once in the self-conditioning dtype. Torch fallback: the fp32 cast and soft-capping as the
model's ``logits`` does them, then 7 passes, 6 in place, into one reused buffer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from localdiff.arch.soft_embedding import RawLogits
from localdiff.kernels import vocab as vocab_native


class VocabResult(NamedTuple):
    """What :meth:`VocabPass.run` returns for logits [..., V] (``...`` = B, C or N).

    argmax: LongTensor[...]; entropy: FloatTensor[...] (nats); confidence: FloatTensor[...] (top-1 probability);
    probs: Tensor[..., V] ``softmax(softcap(logits) / T)`` in the pass's probability dtype (bf16 from the native
    pass, fp32 from the torch passes; one of two buffers used in turn: never the previous call's); rows: ``rows(idx)`` with idx LongTensor[n]
    of flattened positions → their probabilities as FloatTensor[n, V] fp32 (native: recomputed by the same kernel,
    bit-identical to the values ``probs`` rounded; torch: a gather), what the categorical draws read.
    """

    argmax: torch.Tensor
    entropy: torch.Tensor
    confidence: torch.Tensor
    probs: torch.Tensor
    rows: Callable[[torch.Tensor], torch.Tensor]


class VocabPass:
    """Reusable buffers for :meth:`run` (one per generation: its shapes are the canvas's).

    Args:
        probs_dtype: dtype of the native pass's probabilities (the self-conditioning product's, bf16 on the fast
            path); the torch passes always give fp32.
        native: use the native kernel when it is available (None = as :func:`vocab_native.library` decides).
    """

    def __init__(self, probs_dtype: torch.dtype = torch.bfloat16, native: bool | None = None):
        self.probs_dtype = probs_dtype if probs_dtype in (torch.bfloat16, torch.float32) else torch.float32
        self.native = vocab_native.library() is not None if native is None else native
        self._out: list[torch.Tensor | None] = [None, None]
        self._flip = 0
        self._scratch: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, logits, temperature: float) -> VocabResult:
        """Statistics of ``softmax(softcap(logits) / temperature)`` per position.

        Args:
            logits: :class:`RawLogits` (16-bit or fp32 values Tensor[..., V] before soft-capping, and the cap), or
                a soft-capped fp32 Tensor[..., V]; an fp32 tensor handed in is owned by the caller and overwritten
                by the torch passes (scratch afterwards).
            temperature: > 0.
        Returns:
            :class:`VocabResult`.
        """
        raw, cap = (logits.values, logits.softcap) if isinstance(logits, RawLogits) else (logits, None)
        if self.native and raw.device.type == "cpu" and raw.dtype in (torch.bfloat16, torch.float32):
            return self._native(raw, cap, temperature)
        if isinstance(logits, RawLogits):  # the model's own fp32 cast and in-place soft-capping
            raw = raw.float()
            if cap is not None:
                raw.div_(cap).tanh_().mul_(cap)
        return self._torch(raw, temperature)

    def _buffer(self, shape, dtype, device) -> torch.Tensor:
        """The probabilities' output buffer: two alternate, so a result's ``probs`` never aliases the previous
        call's (the policy keeps those as the self-conditioning input of stopped rows)."""
        i = self._flip
        self._flip ^= 1
        b = self._out[i]
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device:
            with torch.inference_mode(False):  # a normal tensor: the policy updates it in place (stopped rows)
                b = self._out[i] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def _native(self, raw: torch.Tensor, cap, temperature: float) -> VocabResult:
        shape, v = raw.shape[:-1], raw.shape[-1]
        x = raw.reshape(-1, v)
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = self._buffer(x.shape, self.probs_dtype, x.device)
        threads = max(1, min(torch.get_num_threads(), x.shape[0]))
        if self._scratch is None or self._scratch.numel() < threads * v:
            self._scratch = torch.empty(threads * v, dtype=torch.float32)
        arg, ent, conf = vocab_native.vocab_pass(x, cap, temperature, out, self._scratch, threads)

        def rows(idx: torch.Tensor) -> torch.Tensor:
            sel = x.index_select(0, idx)
            p = torch.empty(sel.shape, dtype=torch.float32)
            vocab_native.vocab_pass(sel, cap, temperature, p, self._scratch, threads)
            return p

        return VocabResult(arg.view(shape), ent.view(shape), conf.view(shape), out.view(*shape, v), rows)

    def _torch(self, logits: torch.Tensor, temperature: float) -> VocabResult:
        x = logits.mul_(1.0 / temperature)
        top, argmax = x.max(-1)
        x.sub_(top[..., None])  # x ≤ 0, exactly 0 at the argmax
        e = self._buffer(x.shape, x.dtype, x.device)
        torch.exp(x, out=e)
        s = e.sum(-1)
        t = x.mul_(e).sum(-1)  # Σ eᵢ·xᵢ (x is consumed)
        entropy = (s.log() - t / s).clamp_(min=0)
        e.div_(s[..., None])
        flat = e.view(-1, e.shape[-1])
        return VocabResult(argmax, entropy, s.reciprocal(), e, lambda idx: flat.index_select(0, idx))
