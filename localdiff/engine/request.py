"""``Request``: one validated generation, as :class:`localdiff.engine.Model` hands it to a family runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from localdiff.events import GenerationStats


@dataclass
class Request:
    """Everything a family runner (``localdiff.engine.RUNNERS``) needs for one generation.

    Attributes:
        options: the decoder policy's frozen options (``localdiff.decoding.options``), already validated.
        rows: the prompt token ids, one list per batch row (unpadded).
        ids: LongTensor[B, T] the prompts left-padded (pad id or 0), on the model's device.
        mask: BoolTensor[B, T] (True = real token) or None when no row is padded.
        max_new_tokens: tokens to generate at most (int > 0).
        generator: torch.Generator seeded with the run's seed (every draw comes from it).
        stats: GenerationStats to fill (prompt_tokens already set).
        emit_steps: yield a StepEvent per step (False for ``generate``).
        cache: a cache from ``Model.new_cache`` to reuse across turns, or None.
        start_canvas: canvas-family only: LongTensor[B, C] initial canvas, or None.
        decode: ids → text (the tokenizer's decode) or None without a tokenizer.
        cancel: ``cancel() -> bool`` polled before every denoising step (see ``Model.stream``), or None.
    """

    options: object
    rows: list
    ids: torch.Tensor
    mask: torch.Tensor | None
    max_new_tokens: int
    generator: torch.Generator
    stats: GenerationStats
    emit_steps: bool
    cache: object
    start_canvas: torch.Tensor | None
    decode: object
    cancel: object = None
