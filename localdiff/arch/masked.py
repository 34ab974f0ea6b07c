"""Masked-diffusion language models (LLaDA-MoE, Dream / DiffuCoder, A2D Qwen3; LLaDA through
:mod:`localdiff.arch.llada`): a bidirectional :class:`localdiff.arch.dense.DenseStack` with the two forward roles the
masked-family decoders use.

* ``logits_full(input_ids, attention_mask=None)`` — one uncached pass, every token attends to every non-padding
  token. RAW logits (for Dream / DiffuCoder ``logits[:, i]`` predicts token ``i + 1``: ``config.shift_logits``; the
  decoder shifts, as Dream's ``generation_utils`` does).
* ``forward_window(input_ids, start, kv=None, attention_mask=None, return_kv=False)`` — Fast-dLLM's approximate
  caches (arXiv 2505.22618; NVlabs/Fast-dLLM ``llada/generate.py`` + ``model/modeling_llada.py``). What we do, and
  how it matches Fast-dLLM:

  - ``kv`` is the per-layer (K, V) list returned by an earlier ``forward_window(x, 0, return_kv=True)`` over the
    whole sequence (Fast-dLLM: the ``past_key_values`` of the full forward at the start of each block). K is stored
    AFTER RoPE (Fast-dLLM stores it before and rotates by absolute position at use: the same numbers).
  - Queries are the window's tokens at absolute positions ``start .. start+n-1``; keys / values are kv's entries at
    positions ``< start``, the window's FRESH K/V, then kv's entries at positions ``>= start + n`` (when kv is
    longer). Prefix cache = kv truncated to the prefix (Fast-dLLM slices ``[:, :, :block_start]``; passing the full
    kv with the window reaching the end is the same), window = everything from the block start to the end. Dual
    cache = kv of the whole sequence, window = the current block (Fast-dLLM writes the block's fresh K/V into the
    cache in place — ``replace_position`` — and reads the rest: the same keys as ours; we never mutate ``kv``).
  - Exactness: with kv from a full pass over the SAME tokens, the window's logits equal that full pass's rows
    (within float rounding, for any start and length: each layer's window K/V are recomputed from the same hidden
    states). Once tokens change (committed tokens), kv entries outside the window are stale — that is the
    approximation, refreshed by the decoder at each block boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localdiff.arch.base import ROLE_LOGITS, ROLE_WINDOW
from localdiff.arch.dense import DenseStack
from localdiff.arch.llama_base import CHECKPOINT_RULES  # noqa: F401  (contract name: the Llama / Qwen layout)
from localdiff.arch.llama_base import checkpoint_names, keeps_checkpoint_dtype  # noqa: F401  (contract names)
from localdiff.arch.llama_base_spec import LlamaConfig


class MaskedLM(DenseStack):
    """A bidirectional masked-diffusion LM (see the module docstring for the roles and the cache semantics).

    ``config``: :class:`localdiff.arch.llama_base_spec.LlamaConfig` (``vocab_size``, ``mask_token_id``,
    ``eos_token_id`` tuple, ``pad_token_id``, ``bos_token_id``, ``shift_logits``, ``max_position_embeddings``,
    ``model_type``, ``raw``)."""

    roles = frozenset({ROLE_LOGITS, ROLE_WINDOW})
    #: logits_full / forward_window take ``rows`` / ``select`` (the LM head only where a decoder reads)
    selects_rows = True

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self.config = cfg

    @property
    def shift_logits(self) -> bool:
        """True when ``logits[:, i]`` predicts token ``i + 1`` (Dream / DiffuCoder)."""
        return self.config.shift_logits

    @torch.inference_mode()
    def logits_full(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rows: tuple[int, int] | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One bidirectional pass.

        Args:
            input_ids: LongTensor[B, T].
            attention_mask: Bool/LongTensor[B, T], 1 = real token, 0 = padding (never attended to); None = all real.
            rows / select: only these logits (see :meth:`forward_window`).
        Returns:
            FloatTensor[B, T, V] fp32 raw logits (V = ``config.vocab_size``), or [B, b − a, V] with ``rows=(a, b)``.
        Raises:
            ValueError: an attention_mask of the wrong shape.
        """
        return self.forward_window(input_ids, 0, None, attention_mask, rows=rows, select=select)

    @torch.inference_mode()
    def forward_window(
        self,
        input_ids: torch.Tensor,
        start: int = 0,
        kv: list | None = None,
        attention_mask: torch.Tensor | None = None,
        return_kv: bool = False,
        rows: tuple[int, int] | None = None,
        select: torch.Tensor | None = None,
    ):
        """The window pass of the Fast-dLLM prefix / dual caches (module docstring).

        Args:
            input_ids: LongTensor[B, n], the tokens at positions ``start .. start+n-1``.
            start: absolute position of the window's first token (int ≥ 0).
            kv: None, or a list (one per layer) of (K, V) FloatTensor[B, kv_heads, S, head_dim] (after RoPE) with
                S ≥ start, as returned with ``return_kv=True`` by a pass at start 0.
            attention_mask: key-padding mask Bool/LongTensor[B, S_total] (1 = real) over the keys in order —
                S_total = start + n + max(0, S − start − n) with kv; with kv=None the keys are the window only, and
                a mask over the full sequence (width ≥ start + n) is sliced to the window. None = all real.
            return_kv: also return the window's fresh per-layer (K, V) [B, kv_heads, n, head_dim].
            rows: (a, b) — the LM head runs only on window positions a..b-1 (a decoder reads one block's logits);
                None = all n.
            select: BoolTensor[B, b − a] or None — within ``rows``, the positions whose logits are read (the
                still-masked ones); the head runs on those only (at least :data:`HEAD_MIN_ROWS` rows, see there)
                and the other rows come back as 0.
        Returns:
            FloatTensor[B, n, V] fp32 logits (B, b − a, V with ``rows``), or (logits, kv_of_window) with
            ``return_kv``. With kv=None and start=0 this is exactly :meth:`logits_full`.
        Raises:
            ValueError: start < 0, a kv of the wrong length / shorter than start, or a mask of the wrong shape.
        """
        b, n = input_ids.shape
        if start < 0:
            raise ValueError(f"start must be >= 0 (got {start})")
        if kv is not None:
            if len(kv) != len(self.layers):
                raise ValueError(f"kv has {len(kv)} layers, the model has {len(self.layers)}")
            s = kv[0][0].shape[2]
            if s < start:
                raise ValueError(f"kv holds {s} positions, fewer than start={start}")
            total = start + n + max(0, s - start - n)
        else:
            total = n
        mask = self._key_mask(attention_mask, b, total, start, n, kv is None, input_ids.device)
        h, fresh = self.run(input_ids, start, mask, kv, return_kv)
        if rows is not None:
            h = h[:, rows[0] : rows[1]]
        logits = self._head(h, select)
        return (logits, fresh) if return_kv else logits

    def _head(self, h: torch.Tensor, select: torch.Tensor | None) -> torch.Tensor:
        """LM head on final hidden states Tensor[B, L, H] → fp32 logits FloatTensor[B, L, V]; with ``select``
        (BoolTensor[B, L]) only on the selected rows, padded to :data:`HEAD_MIN_ROWS` rows (others are 0)."""
        w = self.head_weight()
        v = self.config.vocab_size
        if select is None or bool(select.all()):
            return F.linear(h, w)[..., :v].float()
        sel = head_rows(select)
        out = h.new_zeros(*select.shape, v, dtype=torch.float32)
        out[sel] = F.linear(h[sel], w)[..., :v].float()
        return out

    @staticmethod
    def _key_mask(attention_mask, b: int, total: int, start: int, n: int, no_kv: bool, device):
        """BoolTensor[B, 1, 1, total] (True = real key) or None when nothing is padding. A row whose keys are all
        padding attends to all of them (its outputs are never used; this keeps them finite)."""
        if attention_mask is None:
            return None
        m = attention_mask.to(device).bool()
        if m.dim() != 2 or m.shape[0] != b:
            raise ValueError(f"attention_mask must be [B={b}, S] (got {tuple(m.shape)})")
        if m.shape[1] != total:
            if no_kv and m.shape[1] >= start + n:
                m = m[:, start : start + n]
            else:
                raise ValueError(f"attention_mask covers {m.shape[1]} keys, the pass has {total}")
        if bool(m.all()):
            return None
        m = m | ~m.any(1, keepdim=True)
        return m[:, None, None, :]


#: fewest rows the LM head runs on when committed positions are skipped: MKL's sgemm rounds a row alike alone and
#: inside a larger matmul only from 16 rows up (measured on AVX-512 at 1 and 2 threads; FACTS.md), so a smaller
#: selection is padded with other rows of the block and the read logits stay bit-identical in fp32. (bf16 GEMMs
#: round some row counts up to ~40 differently: there the skipped path can differ by bf16 rounding.)
HEAD_MIN_ROWS = 16


def head_rows(select: torch.Tensor, min_rows: int = HEAD_MIN_ROWS) -> torch.Tensor:
    """``select`` (BoolTensor[B, L]) with unselected positions added in order until ≥ ``min_rows`` are set (or all)."""
    need = min_rows - int(select.sum())
    if need <= 0:
        return select
    sel = select.clone()
    flat = sel.view(-1)
    flat[torch.nonzero(~flat).view(-1)[:need]] = True
    return sel


MODEL_CLASS = MaskedLM
