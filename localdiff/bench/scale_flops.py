"""The scale section's FLOPs cross-check (issue #24): the matmul FLOPs a generation actually executes, counted op by op
from the shapes torch dispatches, next to the arithmetic of :func:`localdiff.bench.scale_shapes.flops_per_step`.

Counted with a ``TorchDispatchMode`` that applies torch's own FLOP formulas (``torch.utils.flop_counter``: ``mm``,
``addmm``, ``bmm``, ``baddbmm`` and the CUDA attention kernels, 2 FLOPs per multiply-add) to every op of the run,
plus formulas torch 2.13 has none for, written here: ``aten._grouped_mm`` (transformers' experts on CPU:
2·rows·K·N over the rows its ``offs`` cover), ``aten._scaled_dot_product_flash_attention_for_cpu`` and
``aten.scaled_dot_product_attention`` (2·B·Hq·L·S·(D + Dv), every key of the mask computed, as the CPU kernel
does), ``localdiff.experts_bf16`` (the native experts: 2·3·H·I per row it computes, each expert's rows padded to
its 16-row tile, :func:`localdiff.kernels.experts.computed_rows`), and ``aten.linear`` / ``aten.matmul``
(2·output elements·K), which under ``torch.inference_mode`` (localdiff's model code) reach the mode whole instead
of as the ``mm`` / ``bmm`` they decompose into (never both). Each op is filed under a component by its shapes: a product with a vocabulary-sized side is the LM head (output V wide) or the
self-conditioning product (reduction over V); a batched product over ``num_experts`` matrices (bmm) or a grouped
one is the experts; attention kernels (and bmm over other batch sizes) are attention; every other product is
"other linears" (q/k/v/o, dense MLPs, router, self-conditioning MLP).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import localdiff.kernels.experts  # noqa: F401 (registers torch.ops.localdiff.experts_bf16)

aten = torch.ops.aten


def _grouped_mm_flops(out, a, b, offs=None, *rest, **kw) -> int:
    rows = int(offs[-1]) if offs is not None and a.dim() == 2 else a.shape[-2] * (a.shape[0] if a.dim() == 3 else 1)
    return 2 * rows * a.shape[-1] * b.shape[-1]


def _attention_flops(out, q, k, v, *rest, **kw) -> int:
    return 2 * q.shape[:-1].numel() * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _linear_flops(out, x, w, *rest, **kw) -> int:
    return 2 * out.numel() * w.shape[-1]


def _matmul_flops(out, a, b, *rest, **kw) -> int:
    return 2 * out.numel() * a.shape[-1]


def _native_experts_flops(out, x, flat, order, weights, gate_up, down, *rest, **kw) -> int:
    from localdiff.kernels.experts import computed_rows

    return 2 * 3 * x.shape[1] * (gate_up.shape[1] // 2) * computed_rows(flat, gate_up.shape[0])


# seen instead of their decomposition (mm / bmm) under torch.inference_mode, which localdiff's model code runs in
_EXTRA = {
    aten._grouped_mm: _grouped_mm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    aten.scaled_dot_product_attention: _attention_flops,
    aten.linear: _linear_flops,
    aten.matmul: _matmul_flops,
    torch.ops.localdiff.experts_bf16: _native_experts_flops,
}
_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten.scaled_dot_product_attention,
}


class FlopCount(TorchDispatchMode):
    """``with FlopCount(vocab, num_experts) as fc: ...`` → ``fc.by_component`` {component: FLOPs} of the block.

    Args:
        vocab: the model's vocabulary size (files the vocab-sized products).
        num_experts: experts per MoE layer (files the batched expert products).
    """

    def __init__(self, vocab: int, num_experts: int):
        super().__init__()
        self.vocab, self.experts = vocab, num_experts
        self.by_component: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _EXTRA:
            n = _EXTRA[packet](out, *args, **kwargs)
        elif packet in flop_registry:
            n = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return out
        self.by_component[self._component(packet, args, out)] += int(n)
        return out

    def _component(self, packet, args, out) -> str:
        if packet in _ATTENTION:
            return "attention scores"
        if packet in (aten._grouped_mm, torch.ops.localdiff.experts_bf16):
            return "experts"
        mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
        if packet in (aten.bmm, aten.baddbmm) or (packet is aten.matmul and min(m.dim() for m in mats) == 3):
            return "experts" if mats[-1].shape[0] == self.experts else "attention scores"
        if out.shape[-1] == self.vocab:
            return "LM head"
        k = mats[-1].shape[-1] if packet is aten.linear else mats[-1].shape[-2]
        if k == self.vocab:  # a reduction over the vocabulary: probs · E
            return "self-conditioning product"
        return "other linears"


def group_arithmetic(by: dict) -> dict:
    """:func:`localdiff.bench.scale_shapes.flops_per_step`'s components in :class:`FlopCount`'s five groups."""
    other = ("attention projections", "dense MLP", "router", "self-conditioning MLP")
    return {
        "experts": by["experts"],
        "LM head": by["LM head"],
        "self-conditioning product": by["self-conditioning product"],
        "attention scores": by["attention scores"],
        "other linears": sum(by[k] for k in other),
    }


def prefill_flops(text: dict, rows: int) -> dict:
    """Arithmetic FLOPs of the prompt's encoder pass (``rows`` tokens, causal, no LM head), in the five groups;
    attention counted over all ``rows`` keys per row (what the CPU flash kernel computes for a full mask)."""
    h = text["hidden_size"]
    heads, kv, d, gd = (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["head_dim"],
        text["global_head_dim"],
    )
    out = dict.fromkeys(("experts", "LM head", "self-conditioning product", "attention scores", "other linears"), 0)
    for ty in text["layer_types"]:
        sliding = ty == "sliding_attention"
        dd, kk = (d, kv) if sliding else (gd, text["num_global_key_value_heads"])
        out["other linears"] += (
            h * heads * dd * 2
            + h * kk * dd * (2 if sliding else 1)
            + 3 * h * text["intermediate_size"]
            + h * text["num_experts"]
        )
        out["attention scores"] += 2 * heads * dd * rows
        out["experts"] += text["top_k_experts"] * 3 * h * text["moe_intermediate_size"]
    return {k: 2 * n * rows for k, n in out.items()}


def cross_check(side, ids: torch.Tensor, text: dict, steps_arith: dict, prompt: int) -> dict:
    """Count one canvas generation of ``side`` (a :class:`localdiff.bench.scale_sides.Side`) and compare.

    Returns {"forwards", "counted": {component: FLOPs per canvas step}, "arithmetic": {component: the same from the
    shapes, the self-conditioning product in F − 1 of the F steps}, "counted_total", "arithmetic_total", "ratio"
    (counted ÷ arithmetic)}: per canvas step = (the run's FLOPs − the prompt's encoder pass by arithmetic) ÷
    forwards, the prompt's pass being part of the first forward (localdiff) or a pass of its own (the reference).
    """
    fc = FlopCount(text["vocab_size"], text["num_experts"])
    with fc:
        got = side.run(ids, 0)
    f = max(got["forwards"], 1)
    pre = prefill_flops(text, prompt)
    arith = group_arithmetic(steps_arith)
    arith["self-conditioning product"] *= (f - 1) / f  # a canvas's first step has no previous distribution
    counted = {k: (fc.by_component.get(k, 0) - pre[k]) / f for k in arith}
    return {
        "forwards": got["forwards"],
        "counted": counted,
        "arithmetic": arith,
        "counted_total": sum(counted.values()),
        "arithmetic_total": sum(arith.values()),
        "ratio": sum(counted.values()) / max(sum(arith.values()), 1),
    }


def real_vocab(name: str, text: dict, build, make_side, ids: torch.Tensor, prompt: int, arith: dict, log=print) -> dict:
    """The cross-check at a model's real vocabulary (``text["vocab_size"]``): ``build(folder, text)`` writes a
    random checkpoint, ``make_side(key, folder)`` loads one side (:class:`localdiff.bench.scale_sides.Side`); one
    canvas of localdiff's default and of the reference (bf16) is counted, not timed. Returns {"name", "vocab", side key:
    :func:`cross_check`'s dict}."""
    import gc
    import tempfile
    from pathlib import Path

    out: dict = {"name": name, "vocab": text["vocab_size"]}
    with tempfile.TemporaryDirectory(prefix="localdiff-scale-vocab-") as tmp:
        log(f"  [scale {name}] counting FLOPs at vocab {text['vocab_size']:,}")
        build(Path(tmp), text)
        for key in ("localdiff default", "reference bfloat16"):
            side = make_side(key, Path(tmp))
            out[key] = cross_check(side, ids, text, arith, prompt)
            del side
            gc.collect()
    return out


def render_md(checks: dict, label: str) -> list[str]:
    """Markdown lines: per side, counted vs arithmetic GFLOP per canvas step by component."""
    comps = next(iter(checks.values()))["arithmetic"].keys()
    out = [
        f"FLOPs per canvas step, {label}: counted by the dispatch-mode counter "
        "(`localdiff.bench.scale_flops`) vs the arithmetic from the shapes (GFLOP)",
        "",
        "| side | " + " | ".join(comps) + " | total | counted ÷ arithmetic |",
        "|---|" + "---:|" * (len(comps) + 2),
    ]
    for key, c in checks.items():
        cells = [f"{c['counted'][k] / 1e9:.2f} / {c['arithmetic'][k] / 1e9:.2f}" for k in comps]
        out.append(
            f"| {key} | " + " | ".join(cells) + f" | {c['counted_total'] / 1e9:.1f} / "
            f"{c['arithmetic_total'] / 1e9:.1f} | {c['ratio']:.3f} |"
        )
    return out
