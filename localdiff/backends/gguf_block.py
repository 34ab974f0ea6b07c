"""Block-diffusion models on llama.cpp (SDAR / SDAR-MoE as GGUF ``qwen3`` / ``qwen3moe``, Fast-dLLM v2 as ``qwen2``,
marked ``localdiff.family = "block"``): the block family's model roles (``prefill`` / ``denoise`` / ``logits``, as
:class:`localdiff.arch.block.BlockLM`) with the exact block cache living in llama.cpp's K/V memory, so the generic
block loop (:mod:`localdiff.decoding.loop`, SDAR's policy) and Fast-dLLM v2's loop run unchanged on GGUF files.

What is computed, as upstream computes it (SDAR ``modeling_sdar.py`` ``store_kv``; Fast-dLLM v2 ``modeling.py``):

* a finished block (and each of the prompt's whole blocks) is written to the cache once, as one non-causal batch
  over the cache — bidirectional inside the block, attending to every earlier block
  (:meth:`localdiff.backends.llama_seq.SeqContext.decode_blocks`);
* a denoising step decodes the current block (every row of a batch: row r is sequence r) as one NON-causal batch
  over the cache — it attends to every cached cell of its row and to itself — and drops those cells again
  (``llama_memory_seq_rm``);
* ``logits_full`` is the uncached reference: the whole sequence as block-causal batches on an empty memory.

The cache object (:class:`GGUFBlockCache`) records which token ids the memory holds per row; llama.cpp's memory is the
one place the K/V live. When another cache object is used (a second chat), the memory is rebuilt from that cache's
ids (the same block-causal batches: exact), so several caches can share one model. Fast-dLLM v2's approximate
sub-block cache (``use_block_cache``) would rewrite cells inside a block, before the sequence's last position, which
llama.cpp's batch checks refuse: it is refused with one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from localdiff.arch.base import ROLE_DENOISE, ROLE_LOGITS, ROLE_PREFILL
from localdiff.backends.llama_lib import llama_cpp, load_model
from localdiff.backends.gguf_config import GGUFConfig
from localdiff.backends.llama_seq import SeqContext, grown, size_for
from localdiff.errors import CheckpointError, UsageError


class GGUFBlockCache:
    """The exact block cache of a :class:`GGUFBlockNet`: the token ids (per row, whole blocks, ``None`` for left
    padding) whose K/V llama.cpp's memory holds. ``seq_len`` (positions held), ``token_ids`` (row → list of ids),
    ``truncate(n)`` / ``reset()`` as :class:`localdiff.cache.kv.KVCache` for chat reuse."""

    def __init__(self, net: "GGUFBlockNet"):
        self.net, self.rows, self.seq_len = net, [], 0

    @property
    def token_ids(self) -> list[list[int]]:
        """Per row, the ids held (padding left out)."""
        return [[t for t in r if t is not None] for r in self.rows]

    def truncate(self, n: int) -> bool:
        """Keep the first ``n`` positions (a block multiple); False when the cache holds fewer."""
        if n > self.seq_len:
            return False
        self.rows = [r[:n] for r in self.rows]
        self.seq_len = n
        self.net._dropped(self, n)
        return True

    def reset(self) -> None:
        """Hold nothing."""
        self.rows, self.seq_len = [], 0
        self.net._dropped(self, 0)

    def stats(self) -> dict:
        """Counters for ``gen -v``: positions held and the llama.cpp context's cells."""
        ctx = self.net.ctx
        return {
            "engine": "llama.cpp K/V memory",
            "held_tokens": self.seq_len,
            "context_cells": ctx.n_ctx if ctx is not None else 0,
        }


class GGUFBlockNet:
    """A block-diffusion GGUF model (module docstring).

    Args:
        path: the file. config: its :class:`GGUFConfig` (family "block"). threads: llama.cpp threads (None = as
            torch). gpu_layers: layers offloaded to a GPU (``localdiff.backends.gguf.gpu_layers_value``).
    Attributes: ``config``, ``roles``, ``shift_logits`` (False: Fast-dLLM v2 shifts in its decoder), ``ctx`` (the
    :class:`SeqContext` or None).
    Raises:
        CheckpointError: llama.cpp refused the file, or its vocabulary disagrees with the header.
    """

    roles = frozenset({ROLE_PREFILL, ROLE_DENOISE, ROLE_LOGITS})
    shift_logits = False
    selects_rows = False

    def __init__(self, path: Path, config: GGUFConfig, threads: int | None = None, gpu_layers=None):
        lib = llama_cpp()
        self.lib, self.path, self.config = lib, Path(path), config
        self.threads = int(threads) if threads else max(1, torch.get_num_threads())
        self.gpu_layers = gpu_layers
        self.model = load_model(lib, path, gpu_layers)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        if self.n_vocab != config.vocab_size:
            raise CheckpointError(f"{path}: vocabulary of {self.n_vocab} tokens, the header lists {config.vocab_size}")
        self.kv_f32 = config.quant == "F32"
        self.ctx: SeqContext | None = None
        self.owner: GGUFBlockCache | None = None  # the cache whose ids the memory holds
        self.min_ubatch = 0  # the context's micro-batch at least (the bench's history)
        self.rows_held = 0

    # -- the context ------------------------------------------------------------------------------------------------
    def new_cache(self) -> GGUFBlockCache:
        """A fresh (empty) cache for this model."""
        return GGUFBlockCache(self)

    def _ready(self, cache: GGUFBlockCache, b: int, more: int) -> SeqContext:
        """The context, holding ``cache``'s cells for ``b`` rows, with room for ``more`` positions per row."""
        blk = self.config.block_size
        need = b * (cache.seq_len + more) + b * blk
        seqs, ubatch = b, max(b * blk, self.min_ubatch)
        ctx = self.ctx
        if ctx is None or ctx.n_ctx < need or ctx.n_seq < seqs or ctx.n_ubatch < ubatch:
            n_ctx = size_for(max(need, ctx.n_ctx if ctx is not None else 0))
            keep = ctx if self.owner is cache else None
            if ctx is not None and keep is None:
                ctx.close()
            self.ctx = grown(
                keep,
                lambda: SeqContext(self.lib, self.model, self.path, n_ctx, ubatch, seqs, self.threads, self.kv_f32),
                self.rows_held,
            )
            if keep is None:
                self.owner = None
        if self.owner is not cache:
            self.ctx.clear()
            self.owner, self.rows_held = cache, len(cache.rows)
            for r, row in enumerate(cache.rows):  # rebuild the memory from the ids (exact: same batches)
                self._append(r, row, 0, "none")
        return self.ctx

    def _dropped(self, cache: GGUFBlockCache, n: int) -> None:
        if self.owner is cache and self.ctx is not None:
            self.ctx.rm(-1, n)

    def _append(self, r: int, tokens: list, p0: int, outputs: str) -> list[torch.Tensor]:
        """Row ``r``'s tokens (None = padding) at positions p0.. appended block by block; returns the output rows."""
        return self.ctx.decode_blocks(r, tokens, p0, self.config.block_size, outputs)

    # -- roles ------------------------------------------------------------------------------------------------------
    def prefill(
        self,
        input_ids: torch.Tensor,
        cache: GGUFBlockCache,
        attention_mask: torch.Tensor | None = None,
        last_logits: bool = False,
    ):
        """Append whole blocks (LongTensor[B, T], padding mask Bool/Long[B, T] or None) to ``cache``. With
        ``last_logits``: returns the last row's raw logits FloatTensor[B, V] (Fast-dLLM v2's next block opens with
        their argmax); else None."""
        b, t = input_ids.shape
        if cache.rows and len(cache.rows) != b:
            raise UsageError(f"the cache holds {len(cache.rows)} rows, this batch has {b}")
        if not cache.rows:
            cache.rows = [[] for _ in range(b)]
        self._ready(cache, b, t)
        ids = input_ids.cpu().tolist()
        keep = None if attention_mask is None else attention_mask.cpu().bool().tolist()
        last = []
        for r in range(b):
            row = [tok if keep is None or keep[r][i] else None for i, tok in enumerate(ids[r])]
            outs = self._append(r, row, cache.seq_len, "last" if last_logits else "none")
            cache.rows[r].extend(row)
            if last_logits:
                last.append(outs[-1][-1] if outs else torch.zeros(self.n_vocab))
        cache.seq_len += t
        return torch.stack(last) if last_logits else None

    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache: GGUFBlockCache,
        self_conditioning_logits=None,
        prefill_ids=None,
        prefill_mask=None,
    ) -> torch.Tensor:
        """One block's raw logits FloatTensor[B, C, V] over the cache: the block (C tokens at positions
        ``cache.seq_len`` ..) attends to every cached cell of its row and to itself; its cells are dropped after.
        ``prefill_ids`` (LongTensor[B, T], mask Bool[B, T] or None) are prefilled first (the loop's fused stage).

        Raises:
            ValueError: self-conditioning logits given (block models have none).
        """
        if self_conditioning_logits is not None:
            raise ValueError("block-diffusion models take no self-conditioning logits")
        if prefill_ids is not None and prefill_ids.shape[1]:
            self.prefill(prefill_ids, cache, prefill_mask)
        b, c = canvas_ids.shape
        if not cache.rows:
            cache.rows = [[] for _ in range(b)]
        ctx = self._ready(cache, b, c)
        p0 = cache.seq_len
        ids = canvas_ids.cpu().tolist()
        n = 0
        for r in range(b):
            for i in range(c):
                ctx.put(n, ids[r][i], p0 + i, (r,), True)
                n += 1
        ctx.run(n)
        out = ctx.logits(n).clone().view(b, c, self.n_vocab)
        ctx.rm(-1, p0)
        return out

    def logits_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uncached block-causal pass over LongTensor[B, T] (positions 0..T−1; ``attention_mask`` 0 = padding: no
        cell, its row of the result is 0). Returns FloatTensor[B, T, V] raw logits. The memory is rebuilt for the
        next cached call."""
        b, t = input_ids.shape
        scratch = GGUFBlockCache(self)
        scratch.rows = [[] for _ in range(b)]
        self._ready(scratch, b, t)
        ids = input_ids.cpu().tolist()
        keep = None if attention_mask is None else attention_mask.cpu().bool().tolist()
        out = torch.zeros(b, t, self.n_vocab)
        for r in range(b):
            real = [i for i in range(t) if keep is None or keep[r][i]]
            got = self._append(r, [ids[r][i] if keep is None or keep[r][i] else None for i in range(t)], 0, "all")
            if got:
                out[r, real] = torch.cat(got)
        scratch.reset()
        self.owner = None
        return out

    def end_tokens(self) -> list[int]:
        """The ids llama.cpp treats as end of generation, header EOS first (as ``GGUFNet.end_tokens``)."""
        first = [i for i in self.config.eos_token_id if 0 <= i < self.n_vocab]
        rest = [i for i in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, i) and i not in first]
        return first + rest

    def close(self) -> None:
        """Free the llama.cpp context and model."""
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
