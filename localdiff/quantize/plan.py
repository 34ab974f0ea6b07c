"""Memory planner: for a device budget, where every component of a model lives — which expert layers stay in host
memory and run there (like llama.cpp's ``--n-cpu-moe N``: the experts of the first N layers live on the host) — from
``config.json`` alone (no weights; every architecture whose spec gives its tensors).

The bytes of each component come from the byte model in :mod:`localdiff.quantize.plan_bytes` (exact for weights;
runtime buffers are stated estimates); this module adds a fixed runtime reserve (CUDA context, cuBLAS workspace,
allocator slack) and places the expert layers.

* device "cpu" (``plan_memory(..., device="cpu")``): the budget is RAM and everything lives there (no offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.quantize.plan_bytes import (  # noqa: F401  (the byte model's names, re-exported: plan's public API)
    FLOAT_BYTES,
    INT4_BYTES_PER_WEIGHT,
    INT4_GROUP,
    INT4_GROUP_BYTES,
    INT8_ELIGIBLE,
    QUANTS,
    SCALE_BYTES,
    activation_bytes,
    int4_bytes,
    kv_bytes,
    kv_tokens_for,
    normalize_quant,
    plan_fields,
    sc_buffer_bytes,
    tensor_bytes,
)
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, format_bytes
from localdiff.summary import layer_geometry, parameter_counts, summarize  # noqa: F401

DEFAULT_RESERVE = 1 << 30
DEFAULT_KV_TOKENS = 32768
GIB = 1 << 30

_LABELS = {
    "embeddings": "embeddings (tied LM head)",
    "lm_head": "LM head",
    "attention": "attention projections",
    "attention_norms": "q/k norms",
    "dense_mlp": "dense MLP",
    "router": "routers",
    "experts": "experts",
    "norms": "norms + layer scalars",
    "self_conditioning": "self-conditioning block",
    "shared_expert": "shared experts",
    "head_int8": "int8 LM head copy",
}


@dataclass
class Plan:
    """A memory plan. Byte fields are ints; see :func:`plan_memory` for their meaning. ``gpu_mem_bytes`` is the
    budget of the plan's ``device``: GPU memory for "cuda", RAM for "cpu" (then nothing is offloaded);
    ``ram_bytes`` (None = not checked) is the host RAM that a GPU plan's host expert layers must fit."""

    gpu_mem_bytes: int
    quant: str | None
    dtype: str
    recipe: str
    components: list[dict]
    expert_layer_bytes: list[int]
    host_expert_layers: list[int]
    kv_budget_bytes: int
    kv_tokens: int
    kv_bytes_per_token: dict
    sc_buffer_bytes: int
    activation_bytes: int
    reserve_bytes: int
    batch_size: int
    parameters: dict
    notes: list[str] = field(default_factory=list)
    device: str = "cuda"
    ram_bytes: int | None = None

    @property
    def n_cpu_moe(self) -> int:
        """Number of expert layers kept on host (llama.cpp ``--n-cpu-moe`` equivalent)."""
        return len(self.host_expert_layers)

    @property
    def precision(self) -> str:
        """ "bf16" (16-bit / float weights: the ``dtype``), "int8" or "int4"."""
        return self.quant or "bf16"

    @property
    def weights_text(self) -> str:
        """ "int8 weights (recipe R)", "int4 weights (...; groups of 64, 0.5625 bytes per weight)" or
        "bfloat16 weights"."""
        if self.quant == "int4":
            return (
                f"int4 weights (recipe {self.recipe}'s quantized set; groups of {INT4_GROUP}, "
                f"{INT4_BYTES_PER_WEIGHT:g} bytes per weight)"
            )
        return f"int8 weights (recipe {self.recipe})" if self.quant == "int8" else f"{self.dtype} weights"

    @property
    def weight_bytes(self) -> int:
        return sum(c["bytes"] for c in self.components)

    @property
    def host_weight_bytes(self) -> int:
        return sum(self.expert_layer_bytes[i] for i in self.host_expert_layers)

    @property
    def device_weight_bytes(self) -> int:
        return self.weight_bytes - self.host_weight_bytes

    @property
    def device_total_bytes(self) -> int:
        return (
            self.device_weight_bytes
            + self.kv_budget_bytes
            + self.sc_buffer_bytes
            + self.activation_bytes
            + self.reserve_bytes
        )

    @property
    def resident_bytes(self) -> int:
        """What the device holds with every expert layer on it: weights + KV budget + buffers + reserve."""
        return self.device_total_bytes + self.host_weight_bytes

    @property
    def free_bytes(self) -> int:
        return self.gpu_mem_bytes - self.device_total_bytes

    @property
    def host_total_bytes(self) -> int:
        """Host RAM a GPU plan needs: its host expert layers plus the runtime reserve of the process (0 layers: 0)."""
        return self.host_weight_bytes + self.reserve_bytes if self.host_expert_layers else 0

    @property
    def host_fits(self) -> bool:
        """The host expert layers fit ``ram_bytes`` (True when RAM is not checked or nothing is on the host)."""
        return self.ram_bytes is None or self.host_total_bytes <= self.ram_bytes

    @property
    def resident(self) -> bool:
        """Everything on the plan's device (no expert layer on the host) and it fits."""
        return self.fits and not self.host_expert_layers

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0 and self.host_fits

    def device_for_layer_experts(self, layer: int) -> str:
        """ "host" or "device" for the experts of ``layer``."""
        return "host" if layer in self.host_expert_layers else "device"

    def to_dict(self) -> dict:
        """JSON-serialisable plan (all sizes in bytes)."""
        return {
            "device": self.device,
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "ram_bytes": self.ram_bytes,
            "quant": self.quant,
            "precision": self.precision,
            "dtype": self.dtype,
            "recipe": self.recipe,
            "batch_size": self.batch_size,
            "parameters": self.parameters,
            "components": self.components,
            "weight_bytes": self.weight_bytes,
            "device_weight_bytes": self.device_weight_bytes,
            "host_weight_bytes": self.host_weight_bytes,
            "expert_layer_bytes": self.expert_layer_bytes,
            "host_expert_layers": self.host_expert_layers,
            "n_cpu_moe": self.n_cpu_moe,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_tokens": self.kv_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "sc_buffer_bytes": self.sc_buffer_bytes,
            "activation_bytes": self.activation_bytes,
            "reserve_bytes": self.reserve_bytes,
            "device_total_bytes": self.device_total_bytes,
            "resident_bytes": self.resident_bytes,
            "host_total_bytes": self.host_total_bytes,
            "free_bytes": self.free_bytes,
            "fits": self.fits,
            "resident": self.resident,
            "notes": self.notes,
        }

    def to_text(self) -> str:
        """The plan as a small table for ``localdiff show --plan`` (:func:`localdiff.quantize.plan_text.plan_text`)."""
        from localdiff.quantize.plan_text import plan_text

        return plan_text(self)


def plan_memory(
    config: dict,
    gpu_mem_bytes: int,
    quant: str | None = "int8",
    kv_budget_bytes: int | None = None,
    *,
    recipe: Recipe | None = None,
    dtype: str = "bfloat16",
    reserve_bytes: int | None = None,
    batch_size: int = 1,
    prefill_chunk: int | None = None,
    device: str = "cuda",
    ram_bytes: int | None = None,
) -> Plan:
    """Plan device memory for any architecture whose spec gives the config's tensors (every family).

    Args:
        config: parsed config.json (no weights needed).
        gpu_mem_bytes: the device budget in bytes (card memory, or measured free memory; RAM for device "cpu").
        quant: "int8" / "int4" (the modules ``recipe`` quantizes) or None / "none" / "float" / "bf16" (all weights in
            ``dtype``).
        kv_budget_bytes: bytes reserved for the KV cache; None = enough for min(context length, 32768) tokens
            per sequence.
        recipe: which modules are int8 (default :data:`localdiff.quantize.recipe.DEFAULT_RECIPE`).
        dtype: float dtype of the non-quantized weights, KV cache and activations ("bfloat16", "float16", "float32").
        reserve_bytes: runtime reserve (default 1 GiB: CUDA context, cuBLAS workspace, allocator slack).
        batch_size: sequences decoded together (scales KV, self-conditioning buffers and activations).
        prefill_chunk: tokens per prefill forward when larger than the canvas (activation workspace).
        device: "cuda" (expert layers may go to the host) or "cpu" (the budget is RAM; everything lives there).
        ram_bytes: host RAM that the host expert layers (+ the reserve) must fit on a GPU plan (None = not checked).
    Returns:
        a :class:`Plan`: every component's bytes, which expert layers stay on host (the first N, as llama.cpp's
        ``--n-cpu-moe``), and whether the device total fits. Everything except the experts stays on the device;
        when even that does not fit, ``fits`` is False and ``notes`` say why.
    Raises:
        CheckpointError: the config lacks required fields; RecipeError: bad quant, recipe or dtype.
    """
    quant = normalize_quant(quant)
    if device not in ("cuda", "cpu"):
        raise RecipeError(f"unknown plan device {device!r} (use cuda or cpu)")
    recipe = recipe or DEFAULT_RECIPE
    pf = plan_fields(config)
    rows = tensor_bytes(config, quant, dtype, recipe)
    n_layers = pf["num_hidden_layers"]
    params = parameter_counts(config)
    comps: dict[str, dict] = {}
    expert_layer = [0] * n_layers
    for r in rows:
        c = comps.setdefault(
            r["component"],
            {
                "component": r["component"],
                "label": _LABELS[r["component"]],
                "params": 0,
                "bytes": 0,
                "precisions": set(),
            },
        )
        c["params"] += r["params"]
        c["bytes"] += r["bytes"]
        c["precisions"].add(r["precision"])
        if r["component"] == "experts":
            expert_layer[r["layer"]] += r["bytes"]
    if "lm_head" in comps and "embeddings" in comps:
        comps["embeddings"]["label"] = "embeddings"
    components = []
    for c in comps.values():
        precs = sorted(c.pop("precisions"))
        c["precision"] = precs[0] if len(precs) == 1 else "+".join(precs)
        components.append(c)
    geo = layer_geometry(config)
    fb = FLOAT_BYTES[dtype]
    per_tok = {
        "full_attention": sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is None),
        "sliding_attention": sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is not None),
        "sliding_cap_bytes": kv_bytes(config, 1 << 40, 1, dtype)
        - (1 << 40) * sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is None),
    }
    notes = []
    if kv_budget_bytes is None:
        tokens = min(pf["max_position_embeddings"], DEFAULT_KV_TOKENS)
        kv_budget_bytes = kv_bytes(config, tokens, batch_size, dtype)
    kv_tokens = kv_tokens_for(config, kv_budget_bytes, batch_size, dtype)
    plan = Plan(
        gpu_mem_bytes=int(gpu_mem_bytes),
        quant=quant,
        dtype=dtype,
        recipe=recipe.name,
        components=components,
        expert_layer_bytes=expert_layer,
        host_expert_layers=[],
        kv_budget_bytes=int(kv_budget_bytes),
        kv_tokens=kv_tokens,
        kv_bytes_per_token=per_tok,
        sc_buffer_bytes=sc_buffer_bytes(config, batch_size),
        activation_bytes=activation_bytes(config, batch_size, dtype, prefill_chunk),
        reserve_bytes=DEFAULT_RESERVE if reserve_bytes is None else int(reserve_bytes),
        batch_size=batch_size,
        parameters={k: v for k, v in params.items() if k != "by_component"},
        notes=notes,
        device=device,
        ram_bytes=None if ram_bytes is None or device == "cpu" else int(ram_bytes),
    )
    if device == "cpu":
        if not plan.fits:
            notes.append("does not fit this RAM: a lower precision (int8, int4), a smaller KV budget, or more RAM")
        return plan
    # Offload expert layers (first layers first, like --n-cpu-moe; layers without experts are skipped) until the
    # device total fits.
    movable = [i for i in range(n_layers) if expert_layer[i]]
    while plan.free_bytes < 0 and len(plan.host_expert_layers) < len(movable):
        plan.host_expert_layers.append(movable[len(plan.host_expert_layers)])
    if plan.free_bytes < 0:
        notes.append(
            "does not fit even with every expert layer on the host: lower the KV budget, a lower precision "
            "(int8, int4), or a larger device"
        )
    elif not plan.host_fits:
        notes.append(
            f"the host expert layers need {format_bytes(plan.host_total_bytes)} of RAM with the runtime "
            f"reserve; this machine has {format_bytes(plan.ram_bytes)}"
        )
    elif plan.host_expert_layers:
        notes.append(
            f"experts of {plan.n_cpu_moe} of {len(movable)} MoE layers run on the host (CPU); the rest of the "
            "model, the KV cache and the runtime buffers stay on the device"
        )
    return plan


def plan_for_recipe(config: dict, recipe: Recipe, index: int = 0, quant: str = "int8") -> Plan:
    """The plan for the ``index``-th stored VRAM plan of ``recipe`` (``quant`` on the recipe's quantized set)."""
    vp = recipe.plans[index]
    return plan_memory(config, vp.gpu_mem, quant, vp.kv_budget, recipe=recipe, reserve_bytes=vp.reserve)
