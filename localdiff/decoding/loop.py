"""The block-diffusion generation loop (DESIGN.md "What the runtime computes"): block-autoregressive over canvases,
diffusion within each canvas. Random numbers are drawn in the order and shapes of transformers'
``DiffusionGemmaGenerationMixin.generate`` (reference, 5.23.0), so a seeded run on CPU with the reference sampler
(no locking, no correction) reproduces its tokens.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch

from localdiff.events import CanvasDone, Done, GenerationStats, StepEvent
from localdiff.decoding import (AcceptanceConfig, CorrectionConfig, StableAndConfident, accept, categorical, correct, finalize_canvas, init_canvas, linear_temperature, renoise, token_entropy)


@dataclass(frozen=True)
class SamplerSettings:
    """Resolved sampler options (see ``Model.sampler_options``)."""

    max_denoising_steps: int
    t_min: float
    t_max: float
    entropy_bound: float
    stability_threshold: int
    confidence_threshold: float
    threshold: float | None
    correction: bool
    correction_floor: float
    correction_max_reopens: int


def run(net, cache, input_ids, attention_mask, settings: SamplerSettings, max_new_tokens: int, generator,
        eos_ids: list[int], pad_id: int | None, prefill_ids=None, start_canvas=None, emit_steps: bool = True,
        decode=None, stats: GenerationStats | None = None):
    """Generate after a prompt; yields StepEvent (when ``emit_steps``), CanvasDone per canvas, then Done.

    Args:
        net: the backbone (``prefill`` / ``denoise`` / ``config``).
        cache: KV cache already holding any reused prefix; ``prefill_ids`` (LongTensor[B, T'] or None) are the
            prompt tokens still to prefill, with ``attention_mask`` (Bool[B, T'] or None).
        input_ids: unused except for its batch size (LongTensor[B, T]).
        settings: SamplerSettings; max_new_tokens: spans ceil(max_new_tokens / C) canvases.
        generator: torch.Generator for every random draw. Without step events, the step that ends the generation
            skips its draws (nothing reads them), so the generator ends earlier in its stream than the reference's.
        eos_ids / pad_id: sequence stopping.
        start_canvas: optional LongTensor[B, C] for the first canvas (a random one is still drawn, as upstream).
        decode: ids → text (row 0) for CanvasDone/Done, or None.
    """
    cfg = net.config
    b = input_ids.shape[0]
    dev = input_ids.device
    c_len, vocab = cfg.canvas_length, cfg.vocab_size
    n_steps = settings.max_denoising_steps
    st = stats or GenerationStats()
    t0 = time.perf_counter()
    # tokens still to prefill ride along with the next canvas's first denoising step (one fused forward)
    pending = (prefill_ids, attention_mask, None) if prefill_ids is not None and prefill_ids.shape[1] else None
    eos_t = torch.tensor(eos_ids, device=dev) if eos_ids else None
    acc_cfg = AcceptanceConfig(settings.entropy_bound, settings.threshold)
    cor_cfg = CorrectionConfig(settings.correction, settings.correction_floor, max_reopens=settings.correction_max_reopens)
    stopper = StableAndConfident(settings.stability_threshold, settings.confidence_threshold)
    temps = _temperatures(n_steps, settings.t_min, settings.t_max)
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    forwards = torch.zeros(b, dtype=torch.long, device=dev)  # summed once at the end: no per-step host sync
    generated: list[torch.Tensor] = []
    reason = "length"
    for ci in range(math.ceil(max_new_tokens / c_len)):
        canvas = init_canvas(b, c_len, vocab, dev, generator)
        if start_canvas is not None and ci == 0:
            canvas = start_canvas.to(dev)
        sc = None
        done_den = torch.zeros(b, dtype=torch.bool, device=dev)
        stopper.reset()
        argmax = canvas
        locked = torch.zeros(b, c_len, dtype=torch.bool, device=dev) if settings.threshold is not None else None
        reopens = torch.zeros(b, dtype=torch.long, device=dev)
        steps_used = 0
        last_canvas = (ci + 1) * c_len >= max_new_tokens
        done_fin = None   # finalize_canvas of the step that ended the generation early, when it did
        n_done = 0  # rows of this canvas whose denoising has stopped (host copy, one sync per step)
        for cur in range(n_steps, 0, -1):
            forwards += ~(done_den | finished)
            steps_used += 1
            if pending is None:
                logits = net.denoise(canvas, cache, sc)
            else:
                tp = time.perf_counter()
                logits = net.denoise(canvas, cache, sc, prefill_ids=pending[0], prefill_mask=pending[1])
                st.prefill_seconds += time.perf_counter() - tp
                st.prefill_tokens_computed += pending[0].shape[1]
                if pending[2] is not None and hasattr(cache, "token_ids") and cache.token_ids:
                    cache.token_ids[0].extend(pending[2])
                pending = None
            proc = logits / temps[cur]
            new_argmax = proc.argmax(-1)
            ent = token_entropy(proc)
            stop = None
            if not n_done:  # the stopper sees the same inputs now as after the draws; test it first
                stop = stopper(new_argmax, proc, ent)
                if not emit_steps and (cur == 1 or bool(stop.all())):
                    # this step ends the canvas; when it also ends the generation, its draws are never used
                    fin = finalize_canvas(new_argmax, finished, eos_t, pad_id)
                    if last_canvas or bool(fin[1].all()):
                        argmax, done_fin = new_argmax, fin
                        break
            probs = torch.softmax(proc, dim=-1, dtype=torch.float32)
            draft = categorical(probs.view(-1, vocab), generator).view(b, c_len)
            conf = probs.max(-1).values if (emit_steps or locked is not None) else None
            acc, new_lock = accept(ent, conf, locked, acc_cfg)
            reopened = None
            if locked is not None:
                keep_tok = torch.where(locked, canvas, draft)
                if cor_cfg.enabled:
                    p_tok = probs.gather(-1, canvas[..., None]).squeeze(-1)
                    reopened = correct(locked, canvas, p_tok, reopens, cor_cfg)
                    reopens += reopened.sum(-1)
                    locked = (locked & ~reopened) | new_lock
                    acc = (acc | locked) & ~reopened
                else:
                    locked = locked | new_lock
                    acc = acc | locked
                accepted_canvas = torch.where(acc, keep_tok, canvas)
            else:
                accepted_canvas = torch.where(acc, draft, canvas)
            new_canvas, renoised = renoise(accepted_canvas, acc, vocab, generator)
            if n_done:
                new_argmax = torch.where(done_den[:, None], argmax, new_argmax)
                new_canvas = torch.where(done_den[:, None], canvas, new_canvas)
                proc = torch.where(done_den[:, None, None], sc.to(proc.dtype), proc)
                ent = token_entropy(proc)
            done_den |= stopper(new_argmax, proc, ent) if stop is None else stop
            sc = proc.to(net.embed_tokens.weight.dtype)
            canvas, argmax = new_canvas, new_argmax
            if emit_steps:
                reopened = torch.zeros_like(acc) if reopened is None else reopened
                yield StepEvent(ci, n_steps - cur + 1, n_steps, canvas.cpu(), argmax.cpu(), acc.cpu(), renoised.cpu(),
                                reopened.cpu(), conf.cpu(), ent.cpu(), None if locked is None else locked.cpu())
            n_done = int(done_den.sum())
            if n_done == b:
                break
        final, finished_now = done_fin or finalize_canvas(argmax, finished, eos_t, pad_id)
        finished = finished_now
        generated.append(final)
        st.canvases += 1
        room = max_new_tokens - ci * c_len          # tokens of this canvas within max_new_tokens
        text = decode(strip_generated(final[0, :room], eos_ids, pad_id)) if decode else ""
        yield CanvasDone(ci, final.cpu(), text, steps_used, finished.cpu())
        if bool(finished.all()):
            reason = "eos"
            break
        if (ci + 1) * c_len >= max_new_tokens:
            break
        pending = (final, None, final[0].tolist())
    out = torch.cat(generated, dim=1) if generated else torch.zeros(b, 0, dtype=torch.long)
    rows = [strip_generated(out[r], eos_ids, pad_id, keep_eos=True)[:max_new_tokens] for r in range(b)]
    st.forwards = int(forwards.sum())
    kept = out[:, :max_new_tokens]
    st.new_tokens = int((kept != pad_id).sum()) if pad_id is not None else int(kept.numel())
    st.tokens_per_forward = st.new_tokens / max(st.forwards, 1)
    st.seconds = time.perf_counter() - t0
    st.tokens_per_second = st.new_tokens / st.seconds if st.seconds > 0 else 0.0
    if hasattr(cache, "stats"):
        st.cache = cache.stats()
    texts = [decode(strip_generated(r, eos_ids, pad_id)) if decode else "" for r in rows]
    yield Done(texts[0] if b == 1 else texts, rows if b > 1 else rows[0], st, reason)


@functools.lru_cache(maxsize=32)
def _temperatures(n_steps: int, t_min: float, t_max: float) -> tuple:
    """The schedule's temperature for each count of steps remaining (0..n_steps), made once per setting."""
    return tuple(linear_temperature(s, n_steps, t_min, t_max) for s in range(n_steps + 1))


def strip_generated(ids, eos_ids, pad_id, keep_eos: bool = False) -> list[int]:
    """Generated ids (LongTensor[T] or list) up to the first EOS (included when keep_eos), without pad."""
    out = []
    for t in (ids.tolist() if hasattr(ids, "tolist") else ids):
        if eos_ids and t in eos_ids:
            if keep_eos:
                out.append(t)
            break
        if pad_id is not None and t == pad_id:
            continue
        out.append(t)
    return out

