"""The GGUF backend: llama.cpp (through llama-cpp-python's low-level bindings) computes a masked-diffusion model's
full-sequence logits; localdiff's own decoders (``localdiff.decoding``: LLaDA / Dream / Fast-dLLM threshold) run on
top, unchanged — the backend presents the model contract's ``logits_full`` role (``localdiff.arch.base``).

How one pass runs (llama.cpp ``examples/diffusion/diffusion.cpp`` does the same, per step): the whole sequence goes
into one ``llama_batch`` with an output row for every position; ``llama_set_causal_attn(ctx, false)`` (LLaDA,
LLaDA-MoE and Dream GGUFs are marked non-causal too); ``llama_decode`` runs the no-KV-memory (encoder) path of the
diffusion architectures, so the context's ``n_ubatch`` must hold the whole sequence; ``llama_get_logits`` returns
[T, V] fp32. Flash attention is disabled: with it llama.cpp casts K/V to F16 (no KV memory to hold them), which
costs ~4e-3 relative logit error instead of ~1e-6 (measured on tiny LLaDA / Dream GGUFs). The context is sized to
the sequence (prompt + generation) and grown when a longer one comes. Logits are RAW: when
``diffusion.shift_logits`` (default true, as ``diffusion-cli.cpp``) logit row i predicts token i + 1 and the masked
loop shifts, as for Dream checkpoints.

Left padding (a batch of prompts): padding tokens are left out of the llama.cpp batch and the real tokens keep
their positions in the padded row — the torch path's rule (padding keys masked, positions = row index). Rows run as
separate passes. The Fast-dLLM approximate caches (``kv_cache`` prefix / dual) run on a second llama.cpp context with
K/V memory (:mod:`localdiff.backends.gguf_window`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from localdiff.arch.base import ROLE_LOGITS
from localdiff.backends.gguf_config import GGUFConfig, describe
from localdiff.backends.gguf_tokenizer import GGUFTokenizer

# the shared llama.cpp setup (re-exported: other modules import these names from here)
from localdiff.backends.llama_lib import (  # noqa: F401
    EXTRA_HINT,
    GROW,
    BackendMissingError,
    _LOG_TAIL,
    gpu_layers_value,
    llama_cpp,
    load_model,
    version,
)
from localdiff.errors import CheckpointError, LocaldiffError, UsageError


class GGUFNet:
    """A loaded GGUF model presenting the masked family's ``logits`` role.

    Args:
        path: the ``.gguf`` file. config: its :class:`GGUFConfig`. threads: llama.cpp threads (None = all cores).
        gpu_layers: layers llama.cpp offloads to a GPU (Metal / CUDA builds; :func:`gpu_layers_value`).
    Attributes: ``config``, ``roles`` = {logits}, ``shift_logits``, ``n_ctx`` (the current context's size).
    Raises:
        CheckpointError: llama.cpp refused the file (its last log line is quoted), or it is not a diffusion model.
    """

    roles = frozenset({ROLE_LOGITS})
    kv_in_backend = True  # the prefix / dual caches' K/V live in llama.cpp (no device budget)

    def __init__(self, path: Path, config: GGUFConfig, threads: int | None = None, gpu_layers: int | None = None):
        lib = llama_cpp()
        self.lib, self.path, self.config = lib, Path(path), config
        self.threads = int(threads) if threads else max(1, (torch.get_num_threads()))
        self.gpu_layers = gpu_layers
        self.model = load_model(lib, path, gpu_layers)
        self._twin = None  # the prefix / dual caches' context (localdiff.backends.gguf_window)
        if not lib.llama_model_is_diffusion(self.model):
            lib.llama_model_free(self.model)
            self.model = None
            raise CheckpointError(f"{path}: not a diffusion model (llama.cpp computes it causally)")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        if self.n_vocab != config.vocab_size:
            raise CheckpointError(f"{path}: vocabulary of {self.n_vocab} tokens, the header lists {config.vocab_size}")
        self.ctx, self.n_ctx = None, 0
        # llama_get_logits as its own ctypes function returning the address as an int (no cast per pass)
        self._logits_addr = type(lib.llama_get_logits)(("llama_get_logits", lib.llama_cpp._lib))
        self._logits_addr.argtypes, self._logits_addr.restype = [ctypes.c_void_p], ctypes.c_void_p

    @property
    def shift_logits(self) -> bool:
        """True when raw logit row i predicts token i + 1 (``diffusion.shift_logits``)."""
        return self.config.shift_logits

    def _context(self, n: int):
        """A context whose n_ctx = n_batch = n_ubatch ≥ n tokens (grown in steps of 64; never shrunk)."""
        if self.ctx is not None and n <= self.n_ctx:
            return self.ctx
        lib = self.lib
        if self.ctx is not None:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None
        size = (n + GROW - 1) // GROW * GROW
        cp = lib.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = size
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        _LOG_TAIL.clear()
        ctx = lib.llama_init_from_model(self.model, cp)
        if not ctx:
            why = _LOG_TAIL[-1] if _LOG_TAIL else "out of memory?"
            raise LocaldiffError(f"{self.path}: llama.cpp could not create a {size}-token context ({why})")
        lib.llama_set_causal_attn(ctx, False)
        self.ctx, self.n_ctx = ctx, size
        self._view_addr, self._view = None, None  # the logits view (:meth:`_logits_view`)
        self._batch = b = lib.llama_batch_init(size, 0, 1)
        for i in range(size):  # one sequence, an output row for every position: set once
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        # zero-copy torch views of the batch's token / position arrays: a pass writes ids with one copy (int64 →
        # int32). Torch, not numpy, on the per-pass path: after a pass llama.cpp has evicted the caches, and every
        # op's code runs cold; one library's ops instead of two is measurably less (localdiff.bench.gguf)
        self._tok = torch.from_numpy(np.ctypeslib.as_array(b.token, shape=(size,)))
        self._pos = torch.from_numpy(np.ctypeslib.as_array(b.pos, shape=(size,)))
        self._pos.copy_(torch.arange(size, dtype=torch.int32))
        self._pos_plain = True  # positions = row index (no left padding): nothing to write per pass
        return ctx

    def _pass(self, ids: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """One llama.cpp pass: LongTensor ids [n] (CPU) at positions ``pos`` (IntTensor [n]; None = 0..n-1) → a
        float32 [n, V] VIEW of llama.cpp's logits buffer (valid until the next pass: copy what you keep)."""
        lib, n = self.lib, len(ids)
        ctx = self._context(n)
        if n:
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self.n_vocab:
                raise UsageError(f"token id out of range [0, {self.n_vocab})")
        self._tok[:n].copy_(ids)  # int64 → int32, in place in the batch
        if pos is not None:
            self._pos[:n].copy_(pos)
            self._pos_plain = False
        elif not self._pos_plain:
            self._pos[:n].copy_(torch.arange(n, dtype=torch.int32))
            self._pos_plain = True
        self._batch.n_tokens = n
        rc = lib.llama_decode(ctx, self._batch)
        if rc != 0:
            raise LocaldiffError(f"{self.path}: llama.cpp decode failed (code {rc})")
        return self._logits_view(n)

    def _logits_view(self, n: int) -> torch.Tensor:
        """float32 [n, V] torch view of llama.cpp's logits buffer. The view over the whole context is made once per
        buffer address (llama.cpp moves the buffer only when it reallocates its outputs; only the first n rows, this
        pass's outputs, are ever read): building a ctypes array type per pass cost more than the rest of the pass's
        Python work."""
        addr = self._logits_addr(self.ctx)
        if addr != self._view_addr:
            arr = (ctypes.c_float * (self.n_ctx * self.n_vocab)).from_address(addr)
            self._view = torch.frombuffer(arr, dtype=torch.float32).view(self.n_ctx, self.n_vocab)
            self._view_addr = addr
        return self._view.narrow(0, 0, n)

    #: logits_full takes ``rows`` / ``select`` (arch.base): only those rows are copied out of llama.cpp's buffer
    #: (llama.cpp's encoder path still computes every row: it has no output selection for non-causal passes)
    selects_rows = True

    def logits_full(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rows: tuple[int, int] | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One bidirectional pass per row (llama.cpp).

        Args:
            input_ids: LongTensor[B, T]. attention_mask: Bool/LongTensor[B, T] (1 = real, 0 = left padding) or None.
            rows: (a, b): return only positions a..b-1. select: BoolTensor[B, b − a]: rows outside it are returned
                as 0 (the masked loop reads only still-masked positions), as :class:`localdiff.arch.masked.MaskedLM`.
        Returns:
            FloatTensor[B, T, V] fp32 raw logits, or [B, b − a, V] with ``rows`` (padding positions' rows are 0).
        Raises:
            UsageError: a token id outside the vocabulary; LocaldiffError: llama.cpp failed.
        """
        b, t = input_ids.shape
        lo, hi = rows if rows is not None else (0, t)
        ids = input_ids.cpu()
        keep = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool().cpu()
        if b == 1 and keep is None:
            got = self._pass(ids[0], None).narrow(0, lo, hi - lo)
            if select is None:
                return got.clone().unsqueeze(0)
            # one op: the selected rows copied out of llama.cpp's buffer, the rest 0 (no Python indexing)
            return torch.where(select.cpu()[0].unsqueeze(-1), got, 0.0).unsqueeze(0)
        out = torch.zeros((b, hi - lo, self.n_vocab), dtype=torch.float32)
        for r in range(b):
            if keep is None:
                out[r] = self._pass(ids[r], None)[lo:hi]
                continue
            pos = keep[r].nonzero()[:, 0]  # real tokens keep their padded-row positions
            logits = self._pass(ids[r][pos], pos.to(torch.int32))
            inside = (pos >= lo) & (pos < hi)
            out[r, pos[inside] - lo] = logits[inside]
        if select is not None and not bool(select.all()):
            out.masked_fill_(~select.to(out.device)[..., None], 0.0)
        return out.to(input_ids.device)

    def end_tokens(self) -> list[int]:
        """The ids llama.cpp treats as end of generation (``llama_vocab_is_eog``: EOS, EOT, EOM and the end-of-turn
        tokens it recognises by text), header EOS first."""
        first = [i for i in self.config.eos_token_id if 0 <= i < self.n_vocab]
        rest = [i for i in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, i) and i not in first]
        return first + rest

    def forward_window(
        self,
        input_ids: torch.Tensor,
        start: int = 0,
        kv=None,
        attention_mask=None,
        return_kv: bool = False,
        rows: tuple[int, int] | None = None,
        select: torch.Tensor | None = None,
    ):
        """The Fast-dLLM prefix / dual caches' window pass on llama.cpp (``MaskedLM.forward_window``'s contract;
        :mod:`localdiff.backends.gguf_window` holds the K/V in llama.cpp's memory). Raises UsageError for a file
        whose architecture has no llama.cpp twin with K/V memory (LLaDA-MoE)."""
        if self._twin is None:
            from localdiff.backends.gguf_window import WindowTwin

            self._twin = WindowTwin(self)
        return self._twin.forward_window(input_ids, start, kv, attention_mask, return_kv, rows, select)

    def close(self) -> None:
        """Free the llama.cpp context, batch and model."""
        lib = self.lib
        if getattr(self, "_twin", None) is not None:
            self._twin.close()
            self._twin = None
        if getattr(self, "ctx", None):
            lib.llama_batch_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def open_gguf(path, threads: int | None = None, gpu_layers=None):
    """Open a ``.gguf`` file for the engine (llama.cpp computes, localdiff decodes): a masked-diffusion file
    (:class:`GGUFNet`) or a block-diffusion one (``localdiff.family = "block"``:
    :class:`localdiff.backends.gguf_block.GGUFBlockNet`).

    Args:
        path: the file. threads: llama.cpp threads (None = as many as torch uses). gpu_layers: layers offloaded to
            a GPU (:func:`gpu_layers_value`: None = all when the build can offload, else 0; "all"; an int).
    Returns:
        (net, GGUFConfig, GGUFTokenizer, generation config dict {"eos_token_id": llama.cpp's end tokens}).
    Raises:
        CheckpointError: not GGUF, truncated, not a diffusion model, unsupported architecture (one line each);
        BackendMissingError: llama-cpp-python missing (names the extra); UsageError: a bad ``gpu_layers``.
    """
    path = Path(path)
    _, cfg = describe(path)
    if cfg.family == "block":
        from localdiff.backends.gguf_block import GGUFBlockNet

        net = GGUFBlockNet(path, cfg, threads, gpu_layers)
    else:
        net = GGUFNet(path, cfg, threads, gpu_layers)
    eos = net.end_tokens()
    return net, cfg, GGUFTokenizer(net, eos, cfg.pad_token_id), ({"eos_token_id": eos} if eos else {})
