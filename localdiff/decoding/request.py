"""``Request``: one validated generation, as :class:`localdiff.engine.Model` hands it to a family runner and the
runner to its decoding loop (:mod:`localdiff.decoding.loop`, ``masked_loop``, ``causal_loop``, ``fastdllm_v2``,
``slots_loop``). It lives here, below the engine, so that the loops take it without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localdiff.events import GenerationStats


@dataclass(kw_only=True)
class Request:
    """Everything a family runner (``localdiff.engine.RUNNERS``) and its loop need for one generation.

    Attributes:
        options: the decoder policy's frozen options (``localdiff.decoding.options``), already validated.
        ids: LongTensor[B, T] the prompts left-padded (pad id or 0), on the model's device.
        max_new_tokens: tokens to generate at most (int > 0).
        mask: BoolTensor[B, T] (True = real token) or None when no row is padded.
        rows: the prompt token ids, one list per batch row (unpadded); None = the rows of ``ids`` (and ``mask``).
        eos_ids: the model's EOS ids (a row ends at its first; list[int], may be empty).
        pad_id: the model's pad id (tokens after a row's EOS become pad) or None.
        mask_id: the mask token id of the masked / block / slots families, else None.
        generator: torch.Generator seeded with the run's seed (every draw comes from it), or None.
        stats: GenerationStats to fill (prompt_tokens already set by the engine).
        emit_steps: yield a StepEvent per step (False for ``generate``).
        cache: a cache from ``Model.new_cache`` to reuse across turns, or None.
        start_canvas: canvas-family only: LongTensor[B, C] initial canvas, or None.
        decode: ids → text (the tokenizer's decode) or None without a tokenizer.
        cancel: ``cancel() -> bool`` polled before every denoising step (see ``Model.stream``), or None.
    """

    options: object
    ids: torch.Tensor
    max_new_tokens: int
    mask: torch.Tensor | None = None
    rows: list | None = None
    eos_ids: list = field(default_factory=list)
    pad_id: int | None = None
    mask_id: int | None = None
    generator: torch.Generator | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    emit_steps: bool = True
    cache: object = None
    start_canvas: torch.Tensor | None = None
    decode: object = None
    cancel: object = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = self.ids.tolist() if self.mask is None else [r[m].tolist() for r, m in zip(self.ids, self.mask)]
