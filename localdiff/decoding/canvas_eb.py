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

from localdiff.decoding.acceptance import AcceptanceConfig, accept, token_entropy
from localdiff.decoding.canvas import init_canvas, renoise
from localdiff.decoding.correction import CorrectionConfig, correct
from localdiff.decoding.draws import categorical
from localdiff.decoding.options import CanvasEBOptions
from localdiff.decoding.schedules import linear_temperature
from localdiff.decoding.stopping import StableAndConfident


@dataclass
class Assessment:
    """What one step's logits say before any draw: ``proc`` (temperature-scaled logits FloatTensor[B, C, V]),
    ``argmax`` (LongTensor[B, C]), ``entropy`` (FloatTensor[B, C], nats), ``stop`` (BoolTensor[B] rows the stopper
    ends now, or None when some row had already stopped: it is then evaluated after the step)."""

    proc: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor
    stop: torch.Tensor | None


class CanvasEB:
    """The ``canvas_eb`` policy for one generation (see the module docstring).

    Args:
        options: :class:`localdiff.decoding.options.CanvasEBOptions`.
        batch / canvas_length / vocab_size / device: shapes of the canvases.
        generator: torch.Generator for every draw.
        sc_dtype: dtype of the self-conditioning logits fed back to the model (the embedding's dtype).
    """

    Options = CanvasEBOptions

    def __init__(self, options: CanvasEBOptions, batch: int, canvas_length: int, vocab_size: int, device,
                 generator: torch.Generator, sc_dtype: torch.dtype):
        self.o, self.b, self.c, self.v, self.dev, self.gen = options, batch, canvas_length, vocab_size, device, generator
        self.sc_dtype = sc_dtype
        self.max_steps = options.max_denoising_steps
        self.acc_cfg = AcceptanceConfig(options.entropy_bound, options.threshold)
        self.cor_cfg = CorrectionConfig(options.correction, options.correction_floor,
                                        max_reopens=options.correction_max_reopens)
        self.stopper = StableAndConfident(options.stability_threshold, options.confidence_threshold)
        self.temps = _temperatures(self.max_steps, options.t_min, options.t_max)

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
        self.locked = torch.zeros(self.b, self.c, dtype=torch.bool, device=self.dev) \
            if self.o.threshold is not None else None
        self.reopens = torch.zeros(self.b, dtype=torch.long, device=self.dev)
        self.n_done = 0   # host copy of done.sum() (one sync per step)

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(canvas LongTensor[B, C], self-conditioning logits FloatTensor[B, C, V] or None) for the next forward."""
        return self.canvas, self.sc

    # -- per step -----------------------------------------------------------------------------------------------
    def assess(self, logits: torch.Tensor, step: int) -> Assessment:
        """Temperature, argmax, entropy and (while no row has stopped) the stopper's verdict; draws nothing.
        ``step``: 1-based denoising step of this canvas."""
        proc = logits / self.temps[self.max_steps - step + 1]
        argmax = proc.argmax(-1)
        ent = token_entropy(proc)
        stop = self.stopper(argmax, proc, ent) if not self.n_done else None
        return Assessment(proc, argmax, ent, stop)

    def ends_block(self, a: Assessment, step: int) -> bool:
        """True when this step is the canvas's last whatever the draws give (step cap, or every row stops)."""
        return a.stop is not None and (step == self.max_steps or bool(a.stop.all()))

    def advance(self, a: Assessment) -> dict:
        """Draw, accept, lock / correct and renoise: the canvas for the next step. Returns the StepEvent fields
        (canvas, argmax, accepted, renoised, reopened, confidence, entropy, locked; device tensors)."""
        probs = torch.softmax(a.proc, dim=-1, dtype=torch.float32)
        conf = probs.max(-1).values
        acc, new_lock = accept(a.entropy, conf, self.locked, self.acc_cfg)
        canvas, locked, reopened = self.canvas, self.locked, None
        if locked is not None:
            old_lock = locked
            if self.cor_cfg.enabled:
                p_tok = probs.gather(-1, canvas[..., None]).squeeze(-1)
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
        draft = categorical(probs.view(-1, self.v), self.gen, read.reshape(-1)).view(self.b, self.c)
        if locked is not None:
            accepted_canvas = torch.where(acc, torch.where(old_lock, canvas, draft), canvas)
        else:
            accepted_canvas = torch.where(acc, draft, canvas)
        new_canvas, renoised = renoise(accepted_canvas, acc, self.v, self.gen)
        argmax, proc, ent = a.argmax, a.proc, a.entropy
        if self.n_done:   # rows already stopped keep their canvas, argmax and self-conditioning
            argmax = torch.where(self.done[:, None], self.argmax, argmax)
            new_canvas = torch.where(self.done[:, None], canvas, new_canvas)
            proc = torch.where(self.done[:, None, None], self.sc.to(proc.dtype), proc)
            ent = token_entropy(proc)
        self.done |= self.stopper(argmax, proc, ent) if a.stop is None else a.stop
        self.sc = proc.to(self.sc_dtype)
        self.canvas, self.argmax, self.locked = new_canvas, argmax, locked
        self.n_done = int(self.done.sum())
        return {"canvas_ids": new_canvas, "argmax_ids": argmax, "accepted": acc, "renoised": renoised,
                "reopened": torch.zeros_like(acc) if reopened is None else reopened, "confidence": conf,
                "entropy": ent, "locked": locked}

    def all_done(self) -> bool:
        return self.n_done == self.b


@functools.lru_cache(maxsize=32)
def _temperatures(n_steps: int, t_min: float, t_max: float) -> tuple:
    """The schedule's temperature for each count of steps remaining (0..n_steps), made once per setting."""
    return tuple(linear_temperature(s, n_steps, t_min, t_max) for s in range(n_steps + 1))
