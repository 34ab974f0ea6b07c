"""Fast-dLLM's prefix and dual caches (NVlabs/Fast-dLLM ``generate_with_prefix_cache`` /
``generate_with_dual_cache``, arXiv 2505.22618) for masked-diffusion GGUF files, with the K/V in llama.cpp's memory —
the torch path's ``kv_cache`` semantics (``localdiff.decoding.masked_loop``; ``MaskedLM.forward_window``):

* each block's first step is a full bidirectional pass over the whole sequence (prompt + every answer position); its
  K/V at every position stay in the memory;
* ``prefix``: each later step recomputes the block and everything after it (positions lo .. T − 1) over the cached
  prefix [0, lo) — the window's cells are dropped and decoded again;
* ``dual``: each later step recomputes only the block [lo, end) over the cached prefix AND the cached suffix
  [end, T) from the block's first pass.

llama.cpp's diffusion architectures (``llada``, ``dream``) run without K/V memory, so these passes run on the same
file loaded as the autoregressive architecture with the same graph — LLaDA as ``llama`` (llama.cpp's LLaDA graph is
its Llama graph without the cache, the interleaved RoPE included), Dream as ``qwen2`` — with the metadata renamed
(``general.architecture`` and the ``<arch>.*`` hyper-parameters; :mod:`localdiff.backends.gguf_twin`) and
non-causal attention; the twin holds a second copy of the weights in memory. LLaDA-MoE has no such twin (llama.cpp's
OLMoE graph normalises q/k over the whole projection, LLaDA-MoE's per head): refused with one line.

The dual cache needs one trick: llama.cpp accepts a batch of a sequence only right after that sequence's last cached
position, and the suffix's cells come after the block. After the block's first pass the suffix cells are relabelled
(``llama_state_seq_get_data`` → their position field set to lo − 1 → ``set_data``): their K/V are untouched (RoPE
was applied when they were computed; with non-causal attention a cell's position only orders the sequence), so the
block can be decoded at its true positions lo .. end − 1 and sees prefix, suffix and itself.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from localdiff.backends.gguf_twin import Twin
from localdiff.backends.llama_lib import llama_cpp
from localdiff.backends.llama_seq import SeqContext, size_for
from localdiff.errors import LocaldiffError, UsageError

#: the first word of llama.cpp's per-sequence state (``io_magic`` in ``llama-context.cpp``)
_MAGIC = 0xAF143CD8
#: llama.cpp diffusion architecture → the autoregressive one with the same graph and K/V memory
TWINS = {"llada": "llama", "dream": "qwen2"}


class WindowKV(list):
    """What a refresh pass returns as its "K/V": nothing (they live in llama.cpp's memory); ``prefix`` as
    ``masked_loop``'s list."""

    def prefix(self, end: int) -> "WindowKV":
        return self


class WindowTwin:
    """The prefix / dual caches' llama.cpp model and context for one :class:`localdiff.backends.gguf.GGUFNet`.

    Raises:
        UsageError: the file's architecture has no twin (LLaDA-MoE). CheckpointError: llama.cpp refused the twin.
    """

    def __init__(self, net):
        arch = net.config.architecture
        if arch not in TWINS:
            raise UsageError(
                f"kv_cache prefix/dual: not for GGUF architecture {arch!r} (llama.cpp has no "
                "autoregressive graph with K/V memory for it); use kv_cache none"
            )
        self.net, self.lib = net, llama_cpp()
        self.twin = Twin(self.lib, net.path, arch, TWINS[arch], net.gpu_layers)
        self.model = self.twin.model
        self.ctx: SeqContext | None = None
        self.t, self.b, self.relabelled = 0, 0, None

    def _context(self, b: int, t: int) -> SeqContext:
        ctx = self.ctx
        if ctx is None or ctx.n_ctx < b * t or ctx.n_ubatch < t or ctx.n_seq < b:
            if ctx is not None:
                ctx.close()
            n = max(t, ctx.n_ubatch if ctx is not None else 0)
            self.ctx = SeqContext(
                self.lib,
                self.model,
                self.net.path,
                size_for(b * n),
                size_for(n),
                b,
                self.net.threads,
                self.net.config.quant == "F32",
            )
        return self.ctx

    def forward_window(self, input_ids, start, kv, attention_mask, return_kv, rows, select):
        """``MaskedLM.forward_window``'s contract (see there): kv None → the block's refresh pass over the whole
        sequence (start 0); kv given → the prefix window (it reaches the sequence's end) or the dual window.
        Returns FloatTensor[B, b − a, V] (rows (a, b) of the window; unselected rows 0), with a :class:`WindowKV`
        when ``return_kv``. Raises ValueError: a window that does not start inside the refreshed sequence."""
        b, n = input_ids.shape
        lo, hi = rows if rows is not None else (0, n)
        ids = input_ids.cpu().tolist()
        out = torch.zeros(b, hi - lo, self.net.n_vocab)
        if kv is None:
            if start != 0:
                raise ValueError(f"a refresh pass starts at 0 (got {start})")
            keep = None if attention_mask is None else attention_mask.cpu().bool().tolist()
            ctx = self._context(b, n)
            ctx.clear()
            self.t, self.b, self.relabelled = n, b, None
            for r in range(b):
                real = [i for i in range(n) if keep is None or keep[r][i]]
                self._decode(ctx, r, [(ids[r][i], i) for i in real], lo, hi, out[r])
        else:
            ctx = self.ctx
            if ctx is None or b != self.b or start + n > self.t or start < 1 and start + n < self.t:
                raise ValueError(f"window [{start}, {start + n}) outside the refreshed sequence of {self.t}")
            end = start + n
            if end < self.t and self.relabelled != (start, end):
                for r in range(b):
                    ctx.rm(r, start, end)
                    ctx.set_state(r, _relabel(ctx.state(r), r, end, start - 1))
                self.relabelled = (start, end)
            for r in range(b):
                ctx.rm(r, start, -1 if end == self.t else end)
                self._decode(ctx, r, [(ids[r][i], start + i) for i in range(n)], start + lo, start + hi, out[r])
        if select is not None and not bool(select.all()):
            out.masked_fill_(~select.cpu()[..., None], 0.0)
        out = out.to(input_ids.device)
        return (out, WindowKV()) if return_kv else out

    def _decode(self, ctx: SeqContext, r: int, toks: list, a: int, b: int, into: torch.Tensor) -> None:
        """Row ``r``'s (id, position) pairs as one non-causal batch; output rows for positions a..b − 1 copied into
        ``into`` (FloatTensor[b − a, V]) at position − a."""
        want = []
        for k, (t, p) in enumerate(toks):
            ctx.put(k, t, p, (r,), a <= p < b)
            if a <= p < b:
                want.append(p - a)
        ctx.run(len(toks))
        if want:
            into[want] = ctx.logits(len(want))

    def close(self) -> None:
        """Free the context and the twin model."""
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self.twin.close()
        self.model = None


def _relabel(blob: bytes, seq: int, end: int, to: int) -> bytes:
    """A ``llama_state_seq_get_data`` blob of one sequence with every cell at position ≥ ``end`` moved to position
    ``to`` (llama.cpp's layout, ``llama_context::state_seq_get_data`` + ``llama_kv_cache::state_write``: u32 magic,
    i32 sequence id, u32 streams = 1 (unified cells), u32 cells, then per cell i32 position, u32 sequence count = 1,
    i32 sequence id — no per-cell extension for these models — then K and V).
    Raises LocaldiffError when the blob is not that layout (another llama.cpp version)."""
    data = bytearray(blob)
    bad = LocaldiffError("kv_cache dual: this llama.cpp build saves its cells in a layout localdiff does not know")
    if len(data) < 16:
        raise bad
    magic, sid, streams, cells = struct.unpack_from("<IiII", data, 0)
    if magic != _MAGIC or sid != seq or streams != 1 or 16 + 12 * cells > len(data):
        raise bad
    meta = np.frombuffer(data, dtype="<i4", count=3 * cells, offset=16).reshape(cells, 3)  # a view: writable
    if cells and not ((meta[:, 1] == 1).all() and (meta[:, 2] == seq).all()):
        raise bad
    meta[:, 0][meta[:, 0] >= end] = to
    return bytes(data)
