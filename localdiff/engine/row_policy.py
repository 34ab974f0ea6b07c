"""Which rows of a packed phase may share one matmul (docs/ARCHITECTURE.md, "Step-level batching"):
:class:`RowPolicy`, the exactness rule of :mod:`localdiff.engine.batch` — rows share a matmul only where the kernel
computes them bit-identically alone and packed (the native int8 kernel ≤ 16 rows, the int8 LM head included, or the
int8 × int8 VNNI kernel ≤ 64 rows where a recipe opts in with ``int8_activations = "int8"``; float
GEMMs at the row counts a probe on this machine finds stable; never MoE experts: their row counts change with the
batch — :mod:`localdiff.engine.batch_canvas` probes those for the canvas family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = 64  # float matmuls: row counts probed for stability (larger counts are taken as stable)


class RowPolicy:
    """Which row segments of a packed phase may share one matmul (see the module docstring):
    ``pack(kind, sizes, layer, dtype) -> list[list[int]]`` for :mod:`localdiff.arch.packed`. ``max_rows``: most rows
    of one group (None = no limit beyond the kernels')."""

    def __init__(self, net, max_rows: int | None = None):
        self.net, self.max_rows = net, max_rows
        self._ok: dict = {}
        self._bad: dict = {}

    def pack(self, kind: str, sizes: list[int], layer=None, dtype=torch.float32) -> list[list[int]]:
        """Groups of segment indexes (greedy, in order): segments share a group when every matmul of the phase runs
        the same row-exact kernel class for each of them and for the group's total row count (:meth:`token`); the
        others run alone."""
        groups, cur, tot, tok = [], [], 0, None
        for j, m in enumerate(sizes):
            t = self.token(kind, layer, dtype, m)
            if t is None:
                groups.append([j])
                continue
            if cur and not (
                t == tok
                and self.token(kind, layer, dtype, tot + m) == tok
                and (self.max_rows is None or tot + m <= self.max_rows)
            ):
                groups.append(cur)
                cur, tot = [], 0
            cur.append(j)
            tot, tok = tot + m, t
        if cur:
            groups.append(cur)
        return groups

    def token(self, kind: str, layer, dtype, m: int):
        """The kernel classes the phase's matmuls run ``m`` rows with, when each computes them like the same rows
        of any larger matmul of that class ("native": the native int8 kernel; "float": a float GEMM at a stable
        row count; "vnni": the int8 × int8 VNNI kernel); None when some matmul does not (those rows run alone)."""
        key = (kind, layer, dtype, m)
        if key not in self._ok:
            mods = self._modules(kind, layer)
            toks = None if mods is None else tuple(self._kernel(w, dtype, m) for w in mods)
            self._ok[key] = None if toks is None or None in toks else toks
        return self._ok[key]

    def _modules(self, kind: str, layer) -> list | None:
        """The weights (modules, fused callables or tensors) of a phase, or None when it is never packed."""
        net = self.net
        if kind == "head":
            head = getattr(net, "head_int8", None)
            return [head if head is not None else net.head_weight()]
        mod = net.layers[layer]
        if kind == "attn":
            att = mod.self_attn
            names = ("q_proj", "k_proj", "v_proj", "o_proj", "query_key_value", "dense")
            out = [getattr(att, n) for n in names if isinstance(getattr(att, n, None), nn.Module)]
            return out + ([att.qkv_fused] if getattr(att, "qkv_fused", None) is not None else [])
        mlps = [mod.mlp] + ([mod.shared_expert] if getattr(mod, "shared_expert", None) is not None else [])
        out = []
        for mlp in mlps:
            kids = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if any(k is None for k in kids) or len(list(mlp.children())) != 3:
                return None  # MoE (or an unknown FFN): not packed
            out += kids + ([mlp.gate_up_fused] if getattr(mlp, "gate_up_fused", None) is not None else [])
        return out

    def _kernel(self, w, dtype, m: int):
        if isinstance(w, torch.Tensor):
            return "float" if self._float_ok(w.dtype, w.shape[-1], w.device, m) else None
        if type(w) is nn.Linear:
            ok = w.bias is None and self._float_ok(w.weight.dtype, w.in_features, w.weight.device, m)
            return "float" if ok else None
        weight = getattr(w, "weight", None)
        if (
            type(w).__name__ not in ("Int8Linear", "FusedInt8", "Int8Head")
            or weight is None
            or weight.dtype != torch.int8
            or weight.device.type != "cpu"
            or getattr(w, "use_bnb", None)
            or getattr(w, "bias", None) is not None
            or dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        from localdiff.quantize.choose import cpu_kernel
        from localdiff.quantize.int8 import vnni_runs

        if vnni_runs(weight.new_empty(0, dtype=dtype), m, getattr(getattr(w, "mods", [w])[0], "act_int8", False)):
            return "vnni"  # localdiff.kernels.int8_vnni: each row by the same instructions whatever the row count
        kind = cpu_kernel(m, weight.shape[1], weight.shape[0], dtype)
        if kind == "dequant":  # a float GEMM on the dequantized weight (localdiff.quantize.int8)
            return "float" if self._float_ok(dtype, weight.shape[1], weight.device, m) else None
        return "native" if kind == "native" else None  # (int8pack: row behaviour unknown)

    def _float_ok(self, dtype, k: int, device, m: int) -> bool:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        if m > PROBE_ROWS:
            return True
        key = (dtype, k, torch.get_num_threads())
        if key not in self._bad:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(PROBE_ROWS + 32, k, generator=g).to(dtype)
            w = torch.randn(256, k, generator=g).to(dtype)
            big = F.linear(x, w)
            self._bad[key] = {r for r in range(1, PROBE_ROWS + 1) if not torch.equal(F.linear(x[:r], w), big[:r])}
        return m not in self._bad[key]
