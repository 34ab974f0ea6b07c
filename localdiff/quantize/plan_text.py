"""The memory plan as the table ``localdiff show --plan`` prints (:func:`plan_text`): one row per component with its
parameters, precision, bytes and where it lives (GPU / host RAM / RAM on a CPU plan), the KV budget and the runtime
buffers, the total against the budget, and the expert layers kept on the host. The numbers come from
:mod:`localdiff.quantize.plan`; this module only formats them."""

from __future__ import annotations

from localdiff.quantize.recipe import format_bytes


def _count(n: int) -> str:
    """A parameter count as the field writes it: ``25.25 B``, ``3.36 M``, ``70.08 K``, ``384``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))


def plan_text(plan) -> str:
    """The plan as a small table (see the module docstring); ``plan`` is a :class:`localdiff.quantize.plan.Plan`."""
    cpu = plan.device == "cpu"
    dev = "RAM" if cpu else "device"
    head = (
        f"Memory plan for {format_bytes(plan.gpu_mem_bytes)} of RAM (CPU, no GPU)"
        if cpu
        else f"Memory plan for a {format_bytes(plan.gpu_mem_bytes)} device"
    )
    lines = [
        f"{head}: {plan.weights_text}, float parts in {plan.dtype}, batch {plan.batch_size}",
        f"  parameters: {_count(plan.parameters['total'])} total, "
        f"{_count(plan.parameters['active_per_token'])} active per token",
        f"  {'component':<28}{'params':>14}  {'precision':<10}{'bytes':>12}  where",
    ]
    for c in plan.components:
        where = dev
        if c["component"] == "experts" and plan.host_expert_layers:
            nd = sum(1 for b in plan.expert_layer_bytes if b) - plan.n_cpu_moe
            where = f"device {nd} layers, host {plan.n_cpu_moe} layers ({ranges(plan.host_expert_layers)})"
        lines.append(
            f"  {c['label']:<28}{c['params']:>14,}  {c['precision']:<10}{format_bytes(c['bytes']):>12}  {where}"
        )
    kv = plan.kv_bytes_per_token
    lines.append(
        f"  {'KV cache budget':<28}{plan.kv_tokens:>14,}  {'tokens':<10}"
        f"{format_bytes(plan.kv_budget_bytes):>12}  {dev} ({format_bytes(kv['full_attention'])}/token on "
        f"full-attention layers, sliding layers capped at {format_bytes(kv['sliding_cap_bytes'])})"
    )
    if plan.sc_buffer_bytes:
        lines.append(
            f"  {'self-conditioning buffers':<28}{'C×V fp32 ×2':>14}  {'':<10}"
            f"{format_bytes(plan.sc_buffer_bytes):>12}  {dev}"
        )
    what = "process (Python, torch, allocator slack)" if cpu else "CUDA context, cuBLAS workspace, allocator slack"
    lines += [
        f"  {'activation workspace':<28}{'':>14}  {'':<10}{format_bytes(plan.activation_bytes):>12}  {dev}",
        f"  {'runtime reserve':<28}{'':>14}  {'':<10}{format_bytes(plan.reserve_bytes):>12}  {dev} ({what})",
        f"  {'RAM' if cpu else 'device'} total {format_bytes(plan.device_total_bytes)} of "
        f"{format_bytes(plan.gpu_mem_bytes)}: "
        + (
            f"fits ({format_bytes(plan.free_bytes)} free)"
            if plan.free_bytes >= 0
            else f"does NOT fit ({format_bytes(-plan.free_bytes)} over)"
        ),
    ]
    if not cpu and not plan.host_expert_layers and any(plan.expert_layer_bytes):
        lines.append("  host: no expert layers (every expert layer fits on the device)")
    if plan.host_expert_layers:
        lines.append(
            f"  host: experts of layers {ranges(plan.host_expert_layers)} "
            f"({format_bytes(plan.host_weight_bytes)}; like llama.cpp --n-cpu-moe {plan.n_cpu_moe})"
        )
        lines.append(
            f"  not resident: the whole model on the device would need {format_bytes(plan.resident_bytes)} "
            f"({format_bytes(plan.resident_bytes - plan.gpu_mem_bytes)} over)"
        )
        if plan.ram_bytes is not None:
            lines.append(
                f"  host RAM {format_bytes(plan.host_total_bytes)} (host experts + runtime reserve) of "
                f"{format_bytes(plan.ram_bytes)}: " + ("fits" if plan.host_fits else "does NOT fit")
            )
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def ranges(xs: list[int]) -> str:
    """[0,1,2,5] → "0-2, 5"."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
