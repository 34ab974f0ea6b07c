"""Step-level batching of the canvas family (DiffusionGemma): which lanes' ``denoise`` calls pack
(:func:`canvas_call`) and which rows may share a matmul or an experts call (:class:`CanvasRowPolicy`), for the
packed forward :func:`localdiff.arch.packed_canvas.canvas_denoise` (docs/ARCHITECTURE.md, "Step-level batching").

Exactness as for the other families (:mod:`localdiff.engine.batch`): rows share a computation only where the kernel
computes them bit-identically alone and together. The dense matmuls follow :class:`RowPolicy`; the soft-embedding
product (``softmax(sc) · E``, the table read transposed) and the routed experts are probed with the model's own
weights and kernels: an experts call computes a routed row alike at group width m when the rows of an m-row call
equal the same rows of a 256-row call, at the start and at the end of the group (:meth:`CanvasRowPolicy.experts_ok`:
the torch bf16 "stream" path here is stable at every width; fp32's grouped GEMMs round 1-3 rows per expert
differently at one thread, also 5-7 and 9-11 at two — those segments then run their experts alone). Source of the
method: the step-level batching of dlmserve / vLLM-style continuous batching, applied per denoising step.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.diffusion_gemma import DiffusionGemma
from localdiff.arch.layers import MoEExperts
from localdiff.engine.row_policy import RowPolicy

#: experts calls: rows of the probe's reference call (group widths at or above it are taken as stable)
EXPERT_PROBE_ROWS = 256
SOFT_PROBE_ROWS = 64
#: the ``denoise`` arguments a packed canvas call may carry
PACKED_ARGS = frozenset(
    {"canvas_ids", "cache", "self_conditioning_logits", "prefill_ids", "prefill_mask", "raw_logits", "head_rows"}
)


def canvas_call(net, name: str, bound: dict):
    """``(arguments, rows)`` when a lane's gated call packs (a batch-1 ``denoise`` of a DiffusionGemma, fused
    prefill rows included, without ``head_rows``), else None (it runs alone)."""
    if name != "denoise" or not isinstance(net, DiffusionGemma) or not set(bound) <= PACKED_ARGS:
        return None
    ids, pre = bound["canvas_ids"], bound.get("prefill_ids")
    sc = bound.get("self_conditioning_logits")
    sc_rows = getattr(sc, "probs", sc)
    if (
        bound.get("head_rows") is not None
        or ids.shape[0] != 1
        or (pre is not None and pre.shape[0] != 1)
        or (sc_rows is not None and sc_rows.shape[0] != 1)
    ):
        return None
    return dict(bound), ids.shape[1] + (0 if pre is None else pre.shape[1])


#: experts probes, per process (experts type, shapes, dtypes, threads, kernel) → (module, inputs, reference, {width: ok})
_PROBES: dict = {}


def _first_experts(ex, k: int):
    """A plain :class:`MoEExperts` cut to its first ``k`` experts (copies: same per-expert kernels and shapes; the
    probe then costs k/E of a full call), else ``ex`` itself (a quantized or other subclass)."""
    if type(ex) is not MoEExperts or ex.num_experts <= k:
        return ex
    small = copy.copy(ex)
    small.__dict__["_parameters"] = {
        n: nn.Parameter(getattr(ex, n).detach()[:k].clone(), requires_grad=False) for n in ("gate_up_proj", "down_proj")
    }
    small.num_experts = k
    return small


class CanvasRowPolicy(RowPolicy):
    """:class:`RowPolicy` for a :class:`DiffusionGemma` (module docstring): kinds "attn", "ffn" (dense MLP and
    router), "sc" (self-conditioning MLP), "soft" (soft-embedding product), "head", and :meth:`experts`."""

    def __init__(self, net, max_rows: int | None = None):
        super().__init__(net, max_rows)
        self._experts: dict = {}

    def token(self, kind: str, layer, dtype, m: int):
        if kind != "soft":
            return super().token(kind, layer, dtype, m)
        key = (kind, dtype, m)
        if key not in self._ok:
            self._ok[key] = ("soft",) if self._soft_ok(dtype, m) else None
        return self._ok[key]

    def _modules(self, kind: str, layer) -> list | None:
        net = self.net
        if kind == "head":
            head = getattr(net, "head_int8", None)
            w = net.lm_head.weight if net.lm_head is not None else net.embed_tokens.weight
            return [head if head is not None else w]
        if kind == "sc":
            mlp = net.self_conditioning.mlp
            return [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if kind == "ffn":
            mod = net.layers[layer]
            return [mod.mlp.gate_proj, mod.mlp.up_proj, mod.mlp.down_proj, mod.router.proj]
        return super()._modules(kind, layer)

    def _soft_ok(self, dtype, m: int) -> bool:
        """Whether ``F.linear(p, E.t())`` computes m rows as the same rows of a larger product (the real table)."""
        w = self.net.embed_tokens.weight
        if w.device.type != "cpu" or w.dtype != dtype or dtype not in (torch.float32, torch.bfloat16):
            return False
        if m > SOFT_PROBE_ROWS:
            return True
        if "soft" not in self._experts:
            g = torch.Generator().manual_seed(0)
            p = torch.softmax(torch.randn(SOFT_PROBE_ROWS + 8, w.shape[0], generator=g), -1).to(dtype)
            self._experts["soft"] = (p, F.linear(p, w.t()))
        p, ref = self._experts["soft"]
        return torch.equal(F.linear(p[:m], w.t()), ref[:m])

    def experts_ok(self, layer: int, dtype, m: int) -> bool:
        """Whether layer ``layer``'s experts compute a routed row alike in a group of width ``m`` and of any other
        stable width (module docstring). Probed once per process for each experts type, shapes, dtype, thread count
        and width (a fresh server's first batched steps pay the probes of the widths they meet: at the 150M shape
        1–13 ms each, ~2 s for every width)."""
        ex = self.net.layers[layer].experts
        w = getattr(ex, "gate_up_proj", None)
        if w is None or w.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        if m >= EXPERT_PROBE_ROWS:
            return True
        key = (type(ex), tuple(w.shape), w.dtype, dtype, torch.get_num_threads(), getattr(ex, "kernel", None))
        k = self.net.config.top_k_experts
        small = _first_experts(ex, k) if key not in _PROBES and key not in self._experts else None
        if small is not None:
            g = torch.Generator().manual_seed(0)
            r = EXPERT_PROBE_ROWS
            x = torch.randn(r, w.shape[-1], generator=g).to(dtype)
            wt = torch.rand(r, k, generator=g)
            idx = torch.arange(k).repeat(r, 1)
            with torch.inference_mode():  # (a subclass probes itself: kept by this policy only, not the process)
                (_PROBES if small is not ex else self._experts)[key] = (small, x, wt, idx, small(x, wt, idx), {})
        ex0, x, wt, idx, ref, seen = _PROBES[key] if key in _PROBES else self._experts[key]
        if m not in seen:
            r = EXPERT_PROBE_ROWS
            with torch.inference_mode():
                seen[m] = torch.equal(ex0(x[:m], wt[:m], idx[:m]), ref[:m]) and torch.equal(
                    ex0(x[r - m :], wt[r - m :], idx[r - m :]), ref[r - m :]
                )
        return seen[m]

    def _widths_ok(self, layer: int, dtype, counts: list[int]) -> bool:
        nz = [c for c in counts if c]
        return all(self.experts_ok(layer, dtype, c) for c in set(nz) | {max(nz, default=0)} if c)

    def experts(self, layer: int, counts: list[list[int]], dtype) -> list[list[int]]:
        """Groups of expert segments (greedy, in order) that share one experts call: each segment's per-expert
        row counts (and its widest group) and the group's summed ones are stable widths (:meth:`experts_ok`);
        ``counts``: per segment, the rows it routes to each expert."""
        groups, cur, tot = [], [], None
        for j, c in enumerate(counts):
            if not self._widths_ok(layer, dtype, c):
                groups.append([j])
                continue
            if cur:
                both = [a + b for a, b in zip(tot, c)]
                if self._widths_ok(layer, dtype, both) and (
                    self.max_rows is None or sum(both) <= self.max_rows * len(both)
                ):
                    cur.append(j)
                    tot = both
                    continue
                groups.append(cur)
            cur, tot = [j], list(c)
        if cur:
            groups.append(cur)
        return groups
