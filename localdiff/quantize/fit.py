"""The precision chooser: for a model (its config.json) and a machine (GPU memory and / or RAM), the widest weight
precision of bf16 → int8 → int4 that fits, and one line that says which and why (``pull`` and ``gen`` use it when no
``--quant`` is given, and say so; ``pull`` refuses a model that fits in no precision before any download). The
bytes come from :func:`localdiff.quantize.plan.plan_memory` (config only, no weights).

Rules:

* with a GPU, a precision *fits* when the whole model, its KV budget and the runtime buffers are resident on the
  device (no expert layer on the host); the first of bf16, int8, int4 that does is taken. When none is resident, the
  smallest (int4) is taken if it fits with expert layers on the host (like llama.cpp's ``--n-cpu-moe``) and those
  fit the RAM; else nothing fits on the GPU and the CPU plan below is tried;
* without a GPU, a precision fits when everything (weights, KV budget, buffers, reserve) fits the RAM;
* "bf16" stands for 16-bit weights; the float parts of every precision are in ``dtype`` (bf16 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.quantize.plan import QUANTS, Plan, plan_memory
from localdiff.quantize.recipe import Recipe, format_bytes


@dataclass
class Choice:
    """The chooser's answer.

    Attributes:
        precision: "bf16", "int8" or "int4"; None when the model fits in no precision here.
        device: "cuda" or "cpu": where the chosen plan runs (the plan's device).
        plan: the chosen plan; when nothing fits, the smallest precision's plan (what it would need).
        plans: every plan tried, by precision (GPU plans, then CPU plans under "cpu:" + precision when tried).
        gpu_bytes / ram_bytes: the machine (0 = no GPU / RAM unknown).
        reason: one line: which precision, where, and why not a wider one.
    """

    precision: str | None
    device: str
    plan: Plan
    gpu_bytes: int
    ram_bytes: int
    reason: str
    plans: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.precision is not None

    @property
    def quant(self) -> str | None:
        """What ``localdiff.load(quant=...)`` takes: None for bf16, else "int8" / "int4"."""
        return None if self.precision in (None, "bf16") else self.precision

    def need_line(self) -> str:
        """What the model needs when nothing fits: "about X of RAM in int4" / "about X of GPU memory in int4"."""
        p = self.plan
        return f"about {format_bytes(_need(p))} of {'RAM' if p.device == 'cpu' else 'GPU memory'} in {p.precision}"


def machine_text(gpu_bytes: int, ram_bytes: int) -> str:
    """ "a 16.00 GiB GPU and 64.00 GiB of RAM" / "32.00 GiB of RAM and no GPU"."""
    ram = f"{format_bytes(ram_bytes)} of RAM" if ram_bytes else "unknown RAM"
    return f"a {format_bytes(gpu_bytes)} GPU and {ram}" if gpu_bytes else f"{ram} and no GPU"


def choose_precision(
    config: dict,
    gpu_bytes: int = 0,
    ram_bytes: int = 0,
    *,
    recipe: Recipe | None = None,
    kv_budget_bytes: int | None = None,
    dtype: str = "bfloat16",
    precisions: tuple[str, ...] = QUANTS,
    cpu_fallback: bool = True,
) -> Choice:
    """Pick the widest precision that fits (see the module docstring for the rules).

    Args:
        config: the model's config.json (parsed).
        gpu_bytes: GPU memory budget in bytes (0 = no GPU: plan for the CPU).
        ram_bytes: RAM in bytes (0 = unknown: the host side of a GPU plan is not checked; a CPU plan then fits
            nothing).
        recipe: which modules are quantized (default recipe when None); kv_budget_bytes / dtype: as
            :func:`localdiff.quantize.plan.plan_memory`.
        precisions: the ladder, widest first (default bf16, int8, int4).
        cpu_fallback: when nothing fits the GPU, try the CPU plans (``pull``: the model may run on the CPU here);
            False for a load that will run on the GPU.
    Returns:
        a :class:`Choice` (``precision`` None when nothing fits; its ``plan`` then says what the smallest needs).
    Raises:
        CheckpointError: the config lacks what the planner needs; RecipeError: a bad precision / dtype.
    """
    plans: dict[str, Plan] = {}

    def plan(p: str, device: str, budget: int) -> Plan:
        key = p if device == "cuda" else "cpu:" + p
        plans[key] = plan_memory(
            config, budget, p, kv_budget_bytes, recipe=recipe, dtype=dtype, device=device, ram_bytes=ram_bytes or None
        )
        return plans[key]

    def label(p: Plan) -> str:
        return p.dtype if p.precision == "bf16" and p.dtype != "bfloat16" else p.precision

    gpu_note = ""
    if gpu_bytes:
        gpu = format_bytes(gpu_bytes)
        for p in precisions:
            pl = plan(p, "cuda", gpu_bytes)
            if pl.resident:
                wider = [plans[q] for q in precisions[: precisions.index(p)]]
                return Choice(
                    p,
                    "cuda",
                    pl,
                    gpu_bytes,
                    ram_bytes,
                    _why(f"fits this {gpu} GPU in {label(pl)}, everything on the GPU", wider, "GPU memory", label),
                    plans,
                )
        small = plans[precisions[-1]]
        wider = [plans[q] for q in precisions[:-1]]
        if small.fits and (not ram_bytes or small.host_fits):
            return Choice(
                small.precision,
                "cuda",
                small,
                gpu_bytes,
                ram_bytes,
                _why(
                    f"fits this {gpu} GPU in {label(small)} with the experts of {small.n_cpu_moe} layers "
                    f"({format_bytes(small.host_weight_bytes)}) in host RAM ({label(small)} needs "
                    f"{format_bytes(small.resident_bytes)} to be whole on the GPU)",
                    wider,
                    "GPU memory",
                    label,
                ),
                plans,
            )
        gpu_note = f"no precision fits this {gpu} GPU: {label(small)} needs {format_bytes(small.resident_bytes)}"
        if not ram_bytes or not cpu_fallback:
            return Choice(None, "cuda", small, gpu_bytes, ram_bytes, gpu_note, plans)
    if not ram_bytes:
        small = plan(precisions[-1], "cpu", 0)
        return Choice(None, "cpu", small, gpu_bytes, 0, "the RAM of this machine is unknown", plans)
    ram = format_bytes(ram_bytes)
    tried = []
    for p in precisions:
        pl = plan(p, "cpu", ram_bytes)
        if pl.fits:
            head = f"fits {ram} of RAM in {label(pl)} on the CPU"
            return Choice(
                p,
                "cpu",
                pl,
                gpu_bytes,
                ram_bytes,
                (gpu_note + "; " if gpu_note else "") + _why(head, tried, "RAM", label),
                plans,
            )
        tried.append(pl)
    needs = ", ".join(f"{label(p)} needs {format_bytes(_need(p))}" for p in tried)
    return Choice(
        None, "cpu", tried[-1], gpu_bytes, ram_bytes, (gpu_note + "; " if gpu_note else "") + f"{needs} of RAM", plans
    )


def _need(p: Plan) -> int:
    """Bytes a plan needs on its device with nothing offloaded (the RAM total on a CPU plan)."""
    return p.device_total_bytes if p.device == "cpu" else p.resident_bytes


def _why(head: str, wider: list[Plan], what: str, label) -> str:
    """``head`` + ", not in bf16 (bf16 needs X, int8 needs Y of RAM)" for the wider precisions that did not fit."""
    if not wider:
        return head
    needs = ", ".join(f"{label(p)} needs {format_bytes(_need(p))}" for p in wider)
    return f"{head}, not in {' or '.join(label(p) for p in wider)} ({needs} of {what})"
