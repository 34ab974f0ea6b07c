"""A small fake model for loop and engine tests that need no transformers and no trained weights.

``FakeNet`` implements the ``prefill`` + ``denoise`` roles over a real ``KVCache`` with logits that make a chosen
answer overwhelmingly likely: position p of the generated sequence (absolute, counted from the first canvas) gets
``answer[p]`` (or ``fill`` after the answer). Every forward is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from localdiff.arch.base import ROLE_DENOISE, ROLE_PREFILL


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 50
    canvas_length: int = 4
    max_position_embeddings: int = 4096
    eos_token_id: tuple = (1,)
    pad_token_id: int | None = 0
    model_type: str = "diffusion_gemma"  # runs the canvas family's policy
    raw: dict = field(default_factory=dict)


class FakeNet(nn.Module):
    roles = frozenset({ROLE_PREFILL, ROLE_DENOISE})

    def __init__(self, answer: list[int], fill: int = 7, cfg: FakeConfig | None = None, margin: float = 30.0):
        super().__init__()
        self.config = cfg or FakeConfig()
        self.answer, self.fill, self.margin = list(answer), fill, margin
        self.embed_tokens = nn.Embedding(self.config.vocab_size, 4)
        self.prompt_len = None
        self.forwards = 0

    def cache_layout(self) -> dict:
        return {"layer_windows": [None], "slack": 0, "block_len": self.config.canvas_length, "layer_heads": [(2, 1)]}

    def _write(self, ids, mask, cache):
        with cache.writing(ids, mask):
            cache.append(
                0, torch.zeros(ids.shape[0], 1, ids.shape[1], 2), torch.zeros(ids.shape[0], 1, ids.shape[1], 2)
            )

    def prefill(self, input_ids, cache, attention_mask=None):
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        self._write(input_ids, attention_mask, cache)

    def denoise(self, canvas_ids, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None):
        self.forwards += 1
        if prefill_ids is not None:
            self.prefill(prefill_ids, cache, prefill_mask)
        b, c = canvas_ids.shape
        start = cache.seq_len - (self.prompt_len or 0)
        logits = torch.zeros(b, c, self.config.vocab_size)
        for j in range(c):
            p = start + j
            tok = self.answer[p] if p < len(self.answer) else self.fill
            logits[:, j, tok] = self.margin
        return logits
