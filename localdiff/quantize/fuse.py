"""One int8 (or int4) matmul for projections that read the same input: q/k/v of an attention and gate/up of a SwiGLU.

:func:`fuse_model` concatenates the int8 rows and the per-row scales of such :class:`Int8Linear` groups into one
weight [sum(out), in] and one scale vector, rebinds each module's ``weight`` / ``weight_scale`` to views of them (no
extra memory, the checkpoint names unchanged) and gives the owner a :class:`FusedInt8` attribute (``qkv_fused`` on
an attention, ``gate_up_fused`` on a SwiGLU) that :mod:`localdiff.arch.dense` / :mod:`localdiff.arch.moe` call instead
of the separate projections. Exact: every kernel of :func:`localdiff.quantize.int8.int8_matmul` computes each output
column from its own weight row and scale and from x alone (the native kernel's activation rounding depends on x's
row only), so the fused output's columns are the unfused outputs, bit for bit (``tests/quant/test_fuse_int8.py``).
Saves one kernel call (its dispatch, the Python layers, the thread start and one weight-stream ramp) per
projection dropped: 3 per layer of a dense block model. :class:`localdiff.quantize.int4.Int4Linear` groups fuse the
same way (codes, scales and zero points concatenated by rows; the int4 kernels also compute each output column from
its own row alone).
"""

from __future__ import annotations

import torch
from torch import nn

from localdiff import hugepages
from localdiff.quantize.int4 import Int4Linear, int4_matmul
from localdiff.quantize.int8 import Int8Linear, int8_matmul


class FusedInt8:
    """Several bias-free :class:`Int8Linear` of one input run as one int8 matmul (module docstring).

    ``__call__(x: Tensor[..., in])`` → tuple of Tensors[..., out_i] in x's dtype (views of one output), or None when
    the modules no longer sit on the fused storage (moved, cast or reloaded since): the caller then runs them one by
    one."""

    def __init__(self, mods: list[Int8Linear] | list[Int4Linear]):
        self.mods = mods
        self.sizes = [m.out_features for m in mods]
        self.weight = _cat([m.weight for m in mods])
        self.scale = torch.cat([m.weight_scale for m in mods])
        self.zero = torch.cat([m.weight_zero for m in mods]) if isinstance(mods[0], Int4Linear) else None
        o = 0
        for m, n in zip(mods, self.sizes):
            m.weight, m.weight_scale = self.weight[o : o + n], self.scale[o : o + n]
            if self.zero is not None:
                m.weight_zero = self.zero[o : o + n]
            o += n
        # the buffer objects bound here: while each module still holds them (checked by identity, no storage
        # queries), the fused call is valid
        self._views = [
            (m, n, m._buffers.get(n))
            for m in mods
            for n in ("weight", "weight_scale", "weight_zero")
            if n in m._buffers
        ]

    def valid(self) -> bool:
        """Whether the modules' buffers are still views of the fused weight and scale (see the class docstring)."""
        if all(m._buffers.get(n) is t for m, n, t in self._views):  # the views set here: still valid
            return True
        first, last = self.mods[0], self.mods[-1]
        return (
            first.weight.data_ptr() == self.weight.data_ptr()
            and first.weight_scale.data_ptr() == self.scale.data_ptr()
            and last.weight.untyped_storage().data_ptr() == self.weight.untyped_storage().data_ptr()
            and last.weight_scale.untyped_storage().data_ptr() == self.scale.untyped_storage().data_ptr()
            and (
                self.zero is None
                or (
                    first.weight_zero.data_ptr() == self.zero.data_ptr()
                    and last.weight_zero.untyped_storage().data_ptr() == self.zero.untyped_storage().data_ptr()
                )
            )
        )

    def __call__(self, x: torch.Tensor):
        if not self.valid():
            return None
        if self.zero is not None:
            return int4_matmul(x, self.weight, self.scale, self.zero, self.mods[0].act_int8).split(self.sizes, dim=-1)
        mod = self.mods[0]
        return int8_matmul(x, self.weight, self.scale, mod.use_bnb, mod.act_int8).split(self.sizes, dim=-1)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0 into a buffer advised for huge pages on the CPU (as the loader's weights are:
    :func:`localdiff.hugepages.resident`)."""
    out = torch.empty((sum(t.shape[0] for t in ts),) + tuple(ts[0].shape[1:]), dtype=ts[0].dtype, device=ts[0].device)
    if out.device.type == "cpu" and hugepages.available() and out.numel() * out.element_size() >= 4 << 20:
        hugepages.advise(out)
    return torch.cat(ts, out=out)


def _group(owner: nn.Module, names: tuple[str, ...]) -> list[Int8Linear] | list[Int4Linear] | None:
    mods = [getattr(owner, n, None) for n in names]
    kind = type(mods[0])
    if kind not in (Int8Linear, Int4Linear) or not all(type(m) is kind and m.bias is None for m in mods):
        return None
    if len({(m.in_features, m.weight.device, m.weight_scale.dtype, getattr(m, "act_int8", 0)) for m in mods}) != 1:
        return None
    return mods


def fuse_model(model: nn.Module) -> int:
    """Fuse every q/k/v (attributes ``q_proj``, ``k_proj``, ``v_proj``) and gate/up (``gate_proj``, ``up_proj``)
    group of bias-free :class:`Int8Linear` (or of :class:`Int4Linear`) in ``model`` (in place; module docstring). Returns the number of groups.
    Owners that already have a fused attribute are skipped."""
    done = 0
    for mod in model.modules():
        for attr, names in (("qkv_fused", ("q_proj", "k_proj", "v_proj")), ("gate_up_fused", ("gate_proj", "up_proj"))):
            if getattr(mod, attr, None) is not None:
                continue
            group = _group(mod, names)
            if group is not None:
                setattr(mod, attr, FusedInt8(group))
                done += 1
    return done
