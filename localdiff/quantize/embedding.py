"""Quantized embedding tables (int4 / int8) that also serve as the tied LM head: a recipe's ``int4_embeddings``.

The token embedding (and, when tied, the LM head) is the largest float tensor left after ``--quant int4``: for
SDAR-1.7B's shape 311 M of 1.72 B parameters, for DiffusionGemma-26B-A4B 1.38 GiB in bf16. llama.cpp's Q4_K_M keeps
it at 4 bits (``token_embd`` Q4_K; 6 bits, Q6_K, when it is also the output matrix: ``llama-quant.cpp``). Here a
recipe's ``int4_embeddings = "int4"`` (or ``"int8"``) makes ``--quant int4`` store the table in that format instead:

* int4: :mod:`localdiff.quantize.int4`'s format along the hidden dimension (rows = tokens; groups of 64 features,
  uint4 codes + bf16 scale + fp16 zero: 0.5625 bytes per weight).
* int8: :mod:`localdiff.quantize.int8`'s format (per-row absmax int8 + a bf16 scale per token row).

Uses of the table, each without ever materialising it whole:

* lookup (``forward(ids)``): gather the rows' codes / scales, dequantize them in fp32 and cast to the model's float
  dtype — bit-equal to ``F.embedding(ids, dequantize(table))``;
* tied LM head (:meth:`QuantEmbedding.head`): ``h @ tableᵀ`` by the int4 / int8 matmul kernels (the table's
  layout [V, H] is already a linear weight's);
* DiffusionGemma's soft embedding ``p @ table`` (:meth:`QuantEmbedding.weighted_sum`): dequantized
  :data:`CHUNK` rows at a time, partial products summed in fp32.

Only model classes that read their head through ``head_int8`` (``supports_int8_head``: block and DiffusionGemma
models) get a quantized table (:func:`localdiff.quantize.apply.quantize_model`); the rest keep it float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.quantize import int4, int8

#: rows dequantized at a time by :meth:`QuantEmbedding.weighted_sum` (8192 × H bf16: 44 MiB at H = 2816)
CHUNK = 8192


class QuantEmbedding(nn.Module):
    """An int4 / int8 embedding table (module docstring).

    State (checkpoint names as a quantized linear layer's: ``<module>.weight``, ``.weight_scale``[, ``.weight_zero``]):
    int4 — weight uint8 Tensor[V, G·32], weight_scale bf16 Tensor[V, G], weight_zero fp16 Tensor[V, G];
    int8 — weight int8 Tensor[V, H], weight_scale bf16 Tensor[V].
    ``dtype``: the float dtype of the rows it returns (the model's); ``precision``: "int4" / "int8". ``act_int8``
    (a recipe's ``int4_activations`` / ``int8_activations = "int8"`` for its precision): the head's few-row calls on
    int8 activations (:func:`localdiff.quantize.int4.int4_matmul`, :func:`localdiff.quantize.int8.int8_matmul`).
    """

    act_int8 = False

    def __init__(
        self, num_embeddings: int, embedding_dim: int, precision: str, dtype: torch.dtype = torch.bfloat16, device=None
    ):
        super().__init__()
        if precision not in ("int4", "int8"):
            raise ValueError(f"quantized embedding: precision {precision!r} (use int4 or int8)")
        self.num_embeddings, self.embedding_dim, self.precision, self.dtype = (
            num_embeddings,
            embedding_dim,
            precision,
            dtype,
        )
        v, h = num_embeddings, embedding_dim
        if precision == "int4":
            g = int4.groups(h)
            self.register_buffer("weight", torch.zeros(v, g * int4.GROUP // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.ones(v, g, dtype=torch.bfloat16, device=device))
            self.register_buffer("weight_zero", torch.zeros(v, g, dtype=torch.float16, device=device))
        else:
            self.register_buffer("weight", torch.zeros(v, h, dtype=torch.int8, device=device))
            self.register_buffer("weight_scale", torch.ones(v, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, precision: str) -> "QuantEmbedding":
        """Quantize a float nn.Embedding (rows of dtype ``emb.weight.dtype``)."""
        w = emb.weight.detach()
        m = cls(w.shape[0], w.shape[1], precision, w.dtype, device="meta")
        if precision == "int4":
            m.weight, m.weight_scale, m.weight_zero = int4.quantize_tensor(w)
        else:
            m.weight, m.weight_scale = int8.quantize_tensor(w)
        return m

    def table(self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start .. stop − 1`` dequantized: Tensor[stop − start, H] in ``dtype`` (default :attr:`dtype`)."""
        return self._dequantize(slice(start, stop), dtype or self.dtype)

    def _dequantize(self, idx, dtype: torch.dtype) -> torch.Tensor:
        if self.precision == "int4":
            return int4.dequantize(
                self.weight[idx], self.weight_scale[idx], self.weight_zero[idx], self.embedding_dim, dtype
            )
        return (self.weight[idx].float() * self.weight_scale[idx].float()[..., None]).to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[...] → Tensor[..., H] in :attr:`dtype` (= ``F.embedding`` on the dequantized table)."""
        return self._dequantize(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.embedding_dim)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Tied LM head: h Tensor[..., H] → Tensor[..., V] in h's dtype, ``h @ dequantize(table)ᵀ`` by
        :func:`localdiff.quantize.int4.int4_matmul` / :func:`localdiff.quantize.int8.int8_matmul`. Off the CPU
        (where those dequantize their weight before a GEMM) :data:`CHUNK` table rows at a time, so the transient
        float copy is one chunk's, not the table's (the memory plan counts no float table)."""
        if h.device.type == "cpu":
            return self._matmul(h, slice(None))
        v = self.num_embeddings
        return torch.cat([self._matmul(h, slice(a, min(v, a + CHUNK))) for a in range(0, v, CHUNK)], -1)

    def _matmul(self, h: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.precision == "int4":
            return int4.int4_matmul(
                h, self.weight[rows], self.weight_scale[rows], self.weight_zero[rows], self.act_int8
            )
        return int8.int8_matmul(h, self.weight[rows], self.weight_scale[rows], act_int8=self.act_int8)

    def weighted_sum(self, p: torch.Tensor) -> torch.Tensor:
        """``p @ dequantize(table)``: p Tensor[..., V] (any float dtype) → Tensor[..., H] in :attr:`dtype`.

        Computed :data:`CHUNK` table rows at a time in p's dtype (fp32 partial sums), so the whole table is never
        dequantized at once."""
        v = self.num_embeddings
        p2 = p.reshape(-1, p.shape[-1])
        acc = None
        for a in range(0, v, CHUNK):
            b = min(v, a + CHUNK)
            part = F.linear(p2[:, a:b].to(self.dtype), self.table(a, b).t()).float()
            acc = part if acc is None else acc.add_(part)
        return acc.to(self.dtype).reshape(*p.shape[:-1], self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.precision}, rows in {self.dtype}"


class TiedHead:
    """The LM head of a model whose tied embedding is a :class:`QuantEmbedding`: reads the table itself (no copy;
    stored as ``model.head_int8``, outside the state dict). ``__call__(h: Tensor[..., H]) -> Tensor[..., V]``."""

    def __init__(self, emb: QuantEmbedding):
        self.embedding = emb

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.embedding.head(h)
