"""Decoder policy ``canvas_eb``: DiffusionGemma's canvas decoding (reference: transformers 5.23.0
``DiffusionGemmaGenerationMixin.generate`` with ``EntropyBoundSampler``; entropy bound: arXiv 2505.24857).

Owns what is particular to this family; the generic loop (:mod:`localdiff.decoding.loop`) owns blocks, prefill
scheduling, sequence stopping, events and stats. Per canvas: a canvas of uniform random tokens; per denoising step:
temperature from a linear schedule, self-conditioning on the previous step's scaled logits, a categorical draft,
entropy-bound acceptance (and optional τ-locking, Re-Noising correction), uniform renoising of the rest; a row stops
when stable and confident. Random numbers are drawn in the reference's order and shapes, so a seeded CPU run with
the reference sampler (no locking, no correction) reproduces its tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from localdiff.arch.soft_embedding import Probabilities
from localdiff.decoding.acceptance import AcceptanceConfig, accept, token_entropy
from localdiff.decoding.canvas import init_canvas, renoise
from localdiff.decoding.correction import CorrectionConfig, correct
from localdiff.decoding.draws import categorical
from localdiff.decoding.options import CanvasEBOptions
from localdiff.decoding.schedules import linear_temperature
from localdiff.decoding.stopping import StableAndConfident
from localdiff.decoding.vocab_pass import VocabPass


@dataclass
class Assessment:
    """What one step's logits say before any draw: ``proc`` (temperature-scaled logits FloatTensor[B, C, V]),
    ``argmax`` (LongTensor[B, C]), ``entropy`` (FloatTensor[B, C], nats), ``stop`` (BoolTensor[B] rows the stopper
    ends now, or None when some row had already stopped: it is then evaluated after the step). On the 16-bit fast
    path ``proc`` is None and ``probs`` (softmax of it, Tensor[B, C, V]: bf16 from the native pass, fp32 from the
    torch passes), ``confidence`` (top-1 probability, FloatTensor[B, C]) and ``rows`` (flattened positions
    LongTensor[n] → their fp32 probabilities FloatTensor[n, V], what the draws read) come from
    :class:`localdiff.decoding.vocab_pass.VocabPass`."""

    proc: torch.Tensor | None
    argmax: torch.Tensor
    entropy: torch.Tensor
    stop: torch.Tensor | None
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    rows: object = None


class CanvasEB:
    """The ``canvas_eb`` policy for one generation (see the module docstring).

    Args:
        options: :class:`localdiff.decoding.options.CanvasEBOptions`.
        batch / canvas_length / vocab_size / device: shapes of the canvases.
        generator: torch.Generator for every draw.
        sc_dtype: dtype of the self-conditioning logits fed back to the model (the embedding's dtype). fp32 is the
            reference-exact path (the reference's ops in its order); any other dtype takes the fast path: the
            vocabulary-sized work in one fused pass over the model's raw logits (:mod:`localdiff.decoding.vocab_pass`;
            ``raw_logits`` is then True: the loop asks ``denoise`` for them) and the self-conditioning input handed
            over as probabilities in ``sc_dtype`` (no second softmax in the model).
        fast: force the fast path on (True) or off (False); None = by ``sc_dtype`` as above.
    """

    Options = CanvasEBOptions

    def __init__(
        self,
        options: CanvasEBOptions,
        batch: int,
        canvas_length: int,
        vocab_size: int,
        device,
        generator: torch.Generator,
        sc_dtype: torch.dtype,
        fast: bool | None = None,
    ):
        self.o, self.b, self.c, self.v, self.dev, self.gen = (
            options,
            batch,
            canvas_length,
            vocab_size,
            device,
            generator,
        )
        self.sc_dtype = sc_dtype
        self.max_steps = options.max_denoising_steps
        self.acc_cfg = AcceptanceConfig(options.entropy_bound, options.threshold)
        self.cor_cfg = CorrectionConfig(
            options.correction, options.correction_floor, max_reopens=options.correction_max_reopens
        )
        self.stopper = StableAndConfident(options.stability_threshold, options.confidence_threshold)
        self.temps = _temperatures(self.max_steps, options.t_min, options.t_max)
        self.vocab_pass = VocabPass(sc_dtype) if (sc_dtype != torch.float32 if fast is None else fast) else None
        self.raw_logits = self.vocab_pass is not None
        self._p16: torch.Tensor | None = None

    # -- per canvas ---------------------------------------------------------------------------------------------
    def begin_block(self, start: torch.Tensor | None = None) -> None:
        """A fresh canvas of uniform random tokens (drawn even when ``start`` LongTensor[B, C] replaces it)."""
        self.canvas = init_canvas(self.b, self.c, self.v, self.dev, self.gen)
        if start is not None:
            self.canvas = start.to(self.dev)
        self.sc = None
        self.done = torch.zeros(self.b, dtype=torch.bool, device=self.dev)
        self.stopper.reset()
        self.argmax = self.canvas
        self.locked = (
            torch.zeros(self.b, self.c, dtype=torch.bool, device=self.dev) if self.o.threshold is not None else None
        )
        self.reopens = torch.zeros(self.b, dtype=torch.long, device=self.dev)
        self.n_done = 0  # host copy of done.sum() (one sync per step)

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(canvas LongTensor[B, C], self-conditioning logits FloatTensor[B, C, V] or None) for the next forward."""
        return self.canvas, self.sc

    # -- per step -----------------------------------------------------------------------------------------------
    def assess(self, logits: torch.Tensor, step: int) -> Assessment:
        """Temperature, argmax, entropy and (while no row has stopped) the stopper's verdict; draws nothing.
        ``step``: 1-based denoising step of this canvas. ``logits``: FloatTensor[B, C, V] (soft-capped), or on the
        fast path also :class:`localdiff.arch.soft_embedding.RawLogits`; an fp32 tensor may be overwritten there."""
        if self.vocab_pass is not None:
            r = self.vocab_pass.run(logits, self.temps[self.max_steps - step + 1])
            stop = self.stopper(r.argmax, None, r.entropy) if not self.n_done else None
            return Assessment(None, r.argmax, r.entropy, stop, r.probs, r.confidence, r.rows)
        proc = logits / self.temps[self.max_steps - step + 1]
        argmax = proc.max(-1).indices  # = argmax(-1) (first index on ties, NaN/-inf rows alike; test), 30 % faster
        ent = token_entropy(proc)
        stop = self.stopper(argmax, proc, ent) if not self.n_done else None
        return Assessment(proc, argmax, ent, stop)

    def ends_block(self, a: Assessment, step: int) -> bool:
        """True when this step is the canvas's last whatever the draws give (step cap, or every row stops)."""
        return a.stop is not None and (step == self.max_steps or bool(a.stop.all()))

    def advance(self, a: Assessment) -> dict:
        """Draw, accept, lock / correct and renoise: the canvas for the next step. Returns the StepEvent fields
        (canvas, argmax, accepted, renoised, reopened, confidence, entropy, locked; device tensors)."""
        if a.probs is not None:
            probs, conf = a.probs, a.confidence
        else:
            probs = torch.softmax(a.proc, dim=-1, dtype=torch.float32)
            conf = probs.max(-1).values
        acc, new_lock = accept(a.entropy, conf, self.locked, self.acc_cfg)
        canvas, locked, reopened = self.canvas, self.locked, None
        if locked is not None:
            old_lock = locked
            if self.cor_cfg.enabled:
                p_tok = probs.gather(-1, canvas[..., None]).squeeze(-1).float()
                reopened = correct(locked, canvas, p_tok, self.reopens, self.cor_cfg)
                self.reopens += reopened.sum(-1)
                locked = (locked & ~reopened) | new_lock
                acc = (acc | locked) & ~reopened
            else:
                locked = locked | new_lock
                acc = acc | locked
            read = acc & ~old_lock
        else:
            read = acc
        # the draft is read only where accepted (and not kept locked): the other positions' random numbers are
        # drawn in order but not transformed (same tokens and generator state as the full draw)
        draft = self._draw(probs if a.rows is None else a.rows, read, a.probs is not None)
        if locked is not None:
            accepted_canvas = torch.where(acc, torch.where(old_lock, canvas, draft), canvas)
        else:
            accepted_canvas = torch.where(acc, draft, canvas)
        new_canvas, renoised = renoise(accepted_canvas, acc, self.v, self.gen)
        if a.proc is None:
            argmax, ent, new_canvas = self._carry_fast(a, new_canvas)
        else:
            argmax, ent, new_canvas = self._carry_exact(a, new_canvas, probs)
        self.canvas, self.argmax, self.locked = new_canvas, argmax, locked
        self.n_done = int(self.done.sum())
        return {
            "canvas_ids": new_canvas,
            "argmax_ids": argmax,
            "accepted": acc,
            "renoised": renoised,
            "reopened": torch.zeros_like(acc) if reopened is None else reopened,
            "confidence": conf,
            "entropy": ent,
            "locked": locked,
        }

    def _draw(self, probs, read: torch.Tensor, valid: bool) -> torch.Tensor:
        """The draft LongTensor[B, C]: one categorical draw per position from ``probs`` FloatTensor[B, C, V] (or on
        the fast path the row function of :class:`localdiff.decoding.vocab_pass.VocabResult`), read only where
        ``read`` BoolTensor[B, C]. Exact path: the reference's random stream (every position's numbers drawn in
        order, :func:`localdiff.decoding.draws.categorical`). Fast path (``valid``): only the read positions are
        drawn (:func:`draw_rows`), so the generator advances by those rows alone."""
        if valid:
            src = probs if callable(probs) else probs.view(-1, self.v)
            return draw_rows(src, read.reshape(-1), self.gen).view(self.b, self.c)
        return categorical(probs.view(-1, self.v), self.gen, read.reshape(-1), valid=valid).view(self.b, self.c)

    def _carry_exact(self, a: Assessment, new_canvas: torch.Tensor, probs: torch.Tensor) -> tuple:
        """Rows already stopped keep their canvas, argmax and self-conditioning; the stopper's verdict; the next
        self-conditioning logits (the reference's ``proc`` in ``sc_dtype``). In fp32 with no row stopped, the
        self-conditioning input also carries ``probs`` (this step's ``softmax(proc, fp32)``, Tensor[B, C, V]) so the
        model does not compute the same softmax again (150M: ~26 ms per step). Returns (argmax, entropy, canvas)."""
        argmax, proc, ent = a.argmax, a.proc, a.entropy
        fresh = not self.n_done
        if self.n_done:
            argmax = torch.where(self.done[:, None], self.argmax, argmax)
            new_canvas = torch.where(self.done[:, None], self.canvas, new_canvas)
            prev = self.sc.logits if isinstance(self.sc, Probabilities) else self.sc
            proc = torch.where(self.done[:, None, None], prev.to(proc.dtype), proc)
            ent = token_entropy(proc)
        self.done |= self.stopper(argmax, proc, ent) if a.stop is None else a.stop
        sc = proc.to(self.sc_dtype)
        self.sc = Probabilities(probs, sc) if fresh and sc.dtype == probs.dtype == torch.float32 else sc
        return argmax, ent, new_canvas

    def _carry_fast(self, a: Assessment, new_canvas: torch.Tensor) -> tuple:
        """:meth:`_carry_exact` on the fast path: the self-conditioning input is ``a.probs`` — as it is when the
        vocab pass wrote it in ``sc_dtype`` (never the buffer of the previous step's input), else rounded into a
        reused ``sc_dtype`` buffer; rows already stopped keep theirs, and their argmax, canvas and entropy."""
        argmax, ent = a.argmax, a.entropy
        if a.probs.dtype == self.sc_dtype:
            p16 = a.probs
            if self.n_done:
                p16[self.done] = self.sc.probs[self.done]
        else:
            p16 = self._p16
            if p16 is None or p16.shape != a.probs.shape:
                p16 = self._p16 = torch.empty(a.probs.shape, dtype=self.sc_dtype, device=a.probs.device)
            if self.n_done:
                live = torch.nonzero(~self.done).view(-1)
                p16[live] = a.probs[live].to(self.sc_dtype)
            else:
                p16.copy_(a.probs)
        if self.n_done:
            keep = self.done[:, None]
            argmax = torch.where(keep, self.argmax, argmax)
            new_canvas = torch.where(keep, self.canvas, new_canvas)
            ent = torch.where(keep, self.entropy, ent)
        self.done |= self.stopper(argmax, None, ent) if a.stop is None else a.stop
        self.sc, self.entropy = Probabilities(p16), ent
        return argmax, ent, new_canvas

    def all_done(self) -> bool:
        return self.n_done == self.b


def draw_rows(probs, read: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One categorical draw for each row of ``probs`` FloatTensor[N, V] (a softmax: finite, rows sum to 1) where
    ``read`` BoolTensor[N]; LongTensor[N] with 0 elsewhere. ``probs`` may instead be a function idx LongTensor[n] →
    FloatTensor[n, V] of those rows (:class:`localdiff.decoding.vocab_pass.VocabResult`'s ``rows``). Random numbers
    are drawn for the read rows only (a canvas of 256 positions reads a few per step; drawing all of them is
    ~2·N·V generator words)."""
    out = torch.zeros(read.shape[0], dtype=torch.long, device=read.device)
    idx = torch.nonzero(read).view(-1)
    if idx.numel():
        rows = probs(idx) if callable(probs) else probs.index_select(0, idx)
        out[idx] = categorical(rows, generator, valid=True).view(-1)
    return out


@functools.lru_cache(maxsize=32)
def _temperatures(n_steps: int, t_min: float, t_max: float) -> tuple:
    """The schedule's temperature for each count of steps remaining (0..n_steps), made once per setting."""
    return tuple(linear_temperature(s, n_steps, t_min, t_max) for s in range(n_steps + 1))
