"""A llama.cpp context WITH K/V memory, for localdiff's caches on GGUF files (docs/ARCHITECTURE.md "GGUF backend").

llama.cpp keeps K/V in cells tagged with a position and a set of sequence ids; a token of a batch attends to every
cell that carries its (first) sequence id — with ``llama_set_causal_attn(ctx, false)`` whatever the cell's
position — and to the batch's own tokens of that sequence. What localdiff builds on it:

* ``rm(seq, p0, p1)`` (``llama_memory_seq_rm``) drops cells: a denoising step's block is decoded over the cache and
  its cells dropped again.
* **Block-causal appends** (:meth:`SeqContext.decode_blocks`): one non-causal batch per block, so a block sees the
  cells before it and itself — bidirectional inside a block, causal across blocks. (One batch for several blocks
  would need a token in several sequences — a block's tokens in the sequences of every later block — but llama.cpp
  keeps a token's sequence ids in an ``unordered_set`` and masks by whichever comes first, so which one a token
  attends as is not defined: measured, it is the last one given, with this build's standard library.)
* Growing: a larger context gets each sequence's cells byte for byte (``llama_state_seq_get_data`` /
  ``set_data``), so a cache survives a context that grows past its first allocation unchanged.

Settings: unified K/V cells (``kv_unified``: sequences share the cells), F32 K/V for F32 files (exact against the torch
path) else llama.cpp's default F16, flash attention disabled (it casts K/V to F16 on CPU), one micro-batch
(``n_ubatch = n_batch``): llama.cpp requires a non-causal batch to fit in one.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from localdiff.errors import LocaldiffError

GGML_F32, GGML_F16 = 0, 1
#: cells are allocated in steps of this many tokens (a context is never shrunk)
ROUND = 256


class SeqContext:
    """One llama.cpp context with unified K/V memory and non-causal attention.

    Args:
        lib: the ``llama_cpp`` module. model: a loaded model pointer. path: the file (for messages).
        n_ctx: cells (tokens over all sequences). n_ubatch: the largest batch (one micro-batch). n_seq: sequences.
        threads: llama.cpp threads. kv_f32: F32 K/V (else F16).
    Attributes: ``n_ctx``, ``n_ubatch``, ``n_seq``, ``n_vocab``.
    Raises:
        LocaldiffError: llama.cpp could not create the context (its last log line is quoted).
    """

    def __init__(self, lib, model, path, n_ctx: int, n_ubatch: int, n_seq: int, threads: int, kv_f32: bool):
        from localdiff.backends.llama_lib import _LOG_TAIL

        self.lib, self.path = lib, path
        cp = lib.llama_context_default_params()
        cp.n_ctx = int(n_ctx)
        cp.n_batch = cp.n_ubatch = int(n_ubatch)
        cp.n_seq_max = int(n_seq)
        cp.kv_unified = True
        cp.type_k = cp.type_v = GGML_F32 if kv_f32 else GGML_F16
        cp.n_threads = cp.n_threads_batch = int(threads)
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        _LOG_TAIL.clear()
        self.ctx = lib.llama_init_from_model(model, cp)
        if not self.ctx:
            why = _LOG_TAIL[-1] if _LOG_TAIL else "out of memory?"
            raise LocaldiffError(f"{path}: llama.cpp could not create a {n_ctx}-token context ({why})")
        lib.llama_set_causal_attn(self.ctx, False)
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_ctx, self.n_ubatch, self.n_seq = int(lib.llama_n_ctx(self.ctx)), int(n_ubatch), int(n_seq)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch = b = lib.llama_batch_init(self.n_ubatch, 0, self.n_seq)
        self.tok = np.ctypeslib.as_array(b.token, shape=(self.n_ubatch,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(self.n_ubatch,))
        self.nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_ubatch,))
        self.out = np.ctypeslib.as_array(b.logits, shape=(self.n_ubatch,))
        self._logits_fn = type(lib.llama_get_logits)(("llama_get_logits", lib.llama_cpp._lib))
        self._logits_fn.argtypes, self._logits_fn.restype = [ctypes.c_void_p], ctypes.c_void_p

    # -- cells ------------------------------------------------------------------------------------------------------
    def rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop ``seq``'s cells with positions in [p0, p1) (−1: open end; seq −1: every sequence)."""
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Tag ``src``'s cells in [p0, p1) with ``dst`` too (no copy: unified cells)."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def clear(self) -> None:
        """Drop every cell."""
        self.lib.llama_memory_clear(self.mem, True)

    def pos_max(self, seq: int) -> int:
        """The largest cached position of ``seq`` (−1 when it holds none)."""
        return int(self.lib.llama_memory_seq_pos_max(self.mem, seq))

    def state(self, seq: int) -> bytes:
        """``seq``'s cells (positions, K and V) as llama.cpp serialises them (``llama_state_seq_get_data``)."""
        n = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        got = self.lib.llama_state_seq_get_data(self.ctx, buf, n, seq)
        return ctypes.string_at(buf, got)

    def set_state(self, seq: int, data: bytes) -> None:
        """Replace ``seq``'s cells by a :meth:`state` blob. Raises LocaldiffError when llama.cpp refuses it."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if self.lib.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == 0 and data:
            raise LocaldiffError(f"{self.path}: llama.cpp could not restore the cache's cells (context too small?)")

    # -- batches ----------------------------------------------------------------------------------------------------
    def put(self, i: int, token: int, pos: int, seqs, out: bool) -> None:
        """Batch slot ``i``: ``token`` at ``pos`` in sequences ``seqs`` (first = the one it attends as), with or
        without an output row."""
        self.tok[i], self.pos[i], self.out[i] = token, pos, 1 if out else 0
        self.nseq[i] = len(seqs)
        row = self.batch.seq_id[i]
        for k, s in enumerate(seqs):
            row[k] = s

    def run(self, n: int) -> None:
        """``llama_decode`` of the first ``n`` slots. Raises LocaldiffError on failure (code and llama.cpp's
        last log line)."""
        from localdiff.backends.llama_lib import _LOG_TAIL

        if n > self.n_ubatch:
            raise LocaldiffError(f"{self.path}: a batch of {n} tokens exceeds the context's {self.n_ubatch}")
        self.batch.n_tokens = n
        _LOG_TAIL.clear()
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            why = f": {_LOG_TAIL[-1]}" if _LOG_TAIL else ""
            raise LocaldiffError(f"{self.path}: llama.cpp decode failed (code {rc}){why}")

    def logits(self, n: int) -> torch.Tensor:
        """float32 [n, V] view of the last decode's output rows (in batch order; valid until the next decode)."""
        addr = self._logits_fn(self.ctx)
        arr = (ctypes.c_float * (n * self.n_vocab)).from_address(addr)
        return torch.frombuffer(arr, dtype=torch.float32).view(n, self.n_vocab)

    def decode_blocks(self, seq: int, tokens, p0: int, block: int, outputs: str = "none") -> list[torch.Tensor]:
        """Append one row's tokens block-causally after its cached cells: one non-causal batch per block (module
        docstring), so each block attends to the cells before it and to itself.

        Args:
            seq: the row's sequence. tokens: list of ids (None = left padding: no cell, the position stays taken)
                at positions ``p0 ..``. block: the block size (blocks at absolute positions p // block).
            outputs: "none", "last" (the last real token's row) or "all" (every real token's row).
        Returns:
            the output rows, FloatTensor[n, V] copies, one per block that has any.
        """
        got = []
        i = 0
        while i < len(tokens):
            j = min(len(tokens), ((p0 + i) // block + 1) * block - p0)
            n = 0
            for k in range(i, j):
                if tokens[k] is not None:
                    out = outputs == "all" or (outputs == "last" and k == len(tokens) - 1)
                    self.put(n, tokens[k], p0 + k, (seq,), out)
                    n += 1
            if n:
                self.run(n)
                rows = n if outputs == "all" else int(outputs == "last" and j == len(tokens))
                if rows:
                    got.append(self.logits(rows).clone())
            i = j
        return got

    def close(self) -> None:
        """Free the batch and the context."""
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def grown(old: SeqContext | None, make, seqs: int) -> SeqContext:
    """A new context from ``make()`` holding ``old``'s cells of sequences 0 .. seqs − 1 (byte copies), ``old``
    freed. With ``old`` None: just ``make()``."""
    new = make()
    if old is not None:
        for s in range(seqs):
            if old.pos_max(s) >= 0:
                new.set_state(s, old.state(s))
        old.close()
    return new


def size_for(n: int) -> int:
    """Cells to allocate for ``n`` tokens: rounded up to :data:`ROUND`."""
    return max(ROUND, (n + ROUND - 1) // ROUND * ROUND)
