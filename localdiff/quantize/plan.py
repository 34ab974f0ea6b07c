"""Memory planner: bytes of every component of a model from ``config.json`` alone (no weights; DiffusionGemma, and
any architecture whose spec has ``plan_fields`` — LLaDA2.x), and for a device budget, which expert layers stay in host memory and run there (like llama.cpp's ``--n-cpu-moe N``:
the experts of the first N layers live on the host).

Byte model (all exact for weights; runtime buffers are stated estimates):

* weights: every tensor of :func:`localdiff.summary.config_tensors`; an int8 tensor costs 1 byte per weight plus one
  bf16 scale per output channel (per expert for stacked experts); an int4 tensor costs :func:`int4_bytes` (groups of
  64 input features: packed uint4 codes + a 16-bit scale and zero per group = 0.5625 bytes per weight); float tensors
  cost the float dtype's bytes. Which modules are quantized (int8 or int4 alike) comes from the recipe (default:
  attention projections, dense MLP, experts); router, norms, embeddings and self-conditioning stay float.
* device "cpu" (``plan_memory(..., device="cpu")``): the budget is RAM and everything lives there (no offload).
* KV cache per token: K and V for every layer (full-attention layers too: the reference caches the normed, roped
  keys and the un-roped values separately), ``2 · kv_heads · head_dim`` elements; sliding layers hold at most
  ``sliding_window − 1`` tokens plus one canvas of slack (``localdiff.cache.kv`` keeps it for prefix reuse). The canvas'
  own K/V during a denoising step (C tokens, every layer) counts as activation workspace.
* self-conditioning buffers per sequence: the canvas' fp32 logits and fp32 probabilities, ``2 · C · V · 4`` bytes.
* activation workspace for one forward of ``max(C, prefill_chunk)`` tokens (fused attention kernels assumed, so no
  L×L score matrix), and a fixed runtime reserve (CUDA context, cuBLAS workspace, allocator slack).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, format_bytes, table_precision
from localdiff.summary import config_tensors, layer_geometry, parameter_counts, summarize, text_config  # noqa: F401

FLOAT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
SCALE_BYTES = 2  # int8 per-channel scales are stored as bf16
# The int4 weight-only format, in one place: groups of INT4_GROUP input features, packed uint4 codes
# (two per byte) + a 16-bit scale and a 16-bit zero per group: 36 bytes per 64 weights = 0.5625 bytes per weight.
INT4_GROUP = 64
INT4_GROUP_BYTES = INT4_GROUP // 2 + 2 + 2
INT4_BYTES_PER_WEIGHT = INT4_GROUP_BYTES / INT4_GROUP
QUANTS = ("bf16", "int8", "int4")   # the weight precisions localdiff offers, widest first
INT8_ELIGIBLE = ("attention", "dense_mlp", "experts", "shared_expert", "self_conditioning", "router", "lm_head")
DEFAULT_RESERVE = 1 << 30
DEFAULT_KV_TOKENS = 32768
GIB = 1 << 30

_LABELS = {"embeddings": "embeddings (tied LM head)", "lm_head": "LM head", "attention": "attention projections",
           "attention_norms": "q/k norms", "dense_mlp": "dense MLP", "router": "routers", "experts": "experts",
           "norms": "norms + layer scalars", "self_conditioning": "self-conditioning block",
           "shared_expert": "shared experts", "head_int8": "int8 LM head copy"}


def plan_fields(config: dict) -> dict:
    """Sizes the runtime-buffer estimates need, from the spec's parsed config (every architecture: DiffusionGemma's
    ``DiffusionGemmaConfig``, the masked / block families' configs): tokens per denoising forward
    (``canvas_length``: a canvas, or one block), whether self-conditioning buffers exist (DiffusionGemma only),
    the MoE top-k and sizes (0 for dense models). Raises CheckpointError for missing / malformed fields."""
    from localdiff.errors import CheckpointError
    from localdiff.summary import spec_of
    try:
        c = spec_of(config).parse_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid text_config ({e})") from None
    return {"canvas_length": int(getattr(c, "canvas_length", 0) or 256),
            "self_conditioning": c.model_type == "diffusion_gemma",
            "top_k": int(getattr(c, "top_k_experts", 0) or getattr(c, "num_experts_per_tok", 0) or 0),
            "moe_intermediate_size": int(getattr(c, "moe_intermediate_size", 0) or 0),
            "intermediate_size": max(int(c.intermediate_size or 0),
                                     int(getattr(c, "shared_expert_intermediate_size", 0) or 0)),
            "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads, "vocab_size": c.vocab_size,
            "num_hidden_layers": c.num_hidden_layers, "max_position_embeddings": c.max_position_embeddings}


def int4_bytes(rows: int, in_features: int) -> int:
    """Bytes of an int4 weight of ``rows`` output rows (× experts for stacked experts) by ``in_features``: every row
    holds ``ceil(in_features / INT4_GROUP)`` groups of ``INT4_GROUP_BYTES`` (a last partial group is padded)."""
    return rows * -(-in_features // INT4_GROUP) * INT4_GROUP_BYTES


def normalize_quant(quant: str | None) -> str | None:
    """None (16-bit weights), "int8" or "int4" from a user's spelling; raises RecipeError for anything else."""
    if quant in (None, "none", "float", "bf16", "bfloat16"):
        return None
    if quant not in QUANTS:
        raise RecipeError(f"unknown quantization {quant!r} (use bf16, int8 or int4)")
    return quant


def _module_of(name: str) -> str:
    """Module name of a tensor name (``layers.0.self_attn.q_proj.weight`` → ``layers.0.self_attn.q_proj``;
    stacked experts ``layers.0.experts.gate_up_proj`` → ``layers.0.experts``)."""
    return name.rsplit(".", 1)[0]


def tensor_bytes(config: dict, quant: str | None = "int8", dtype: str = "bfloat16",
                 recipe: Recipe | None = None) -> list[dict]:
    """Bytes of every weight tensor: list of {component, layer, name, shape, params, precision, bytes}.

    An int8 tensor (a 2-D ``.weight`` or a 3-D stacked expert tensor whose module the recipe marks int8) costs
    ``numel + SCALE_BYTES · (rows)`` where rows = out_features (2-D) or experts × out_features (3-D); with
    ``quant="int4"`` the same tensors cost :func:`int4_bytes` (rows, in_features = the last dimension). A recipe's
    int8 LM-head copy (``head = "int8"``) stays int8 under int4 too; none when the tables are quantized (``tables``).
    Raises RecipeError (unknown dtype / quant / recipe problem) or CheckpointError (config lacks fields).
    """
    if dtype not in FLOAT_BYTES:
        raise RecipeError(f"unknown float dtype {dtype!r} (use one of {', '.join(FLOAT_BYTES)})")
    fb = FLOAT_BYTES[dtype]
    quant = normalize_quant(quant)
    recipe = recipe or DEFAULT_RECIPE
    out = []
    tables = table_precision(config, quant, recipe)     # embedding / LM head quantized themselves
    for t in config_tensors(config):
        prec = dtype
        if quant and t.component in INT8_ELIGIBLE and len(t.shape) >= 2 and \
                recipe.precision_for(_module_of(t.name)) == "int8":
            prec = quant
        if tables and t.component in ("embeddings", "lm_head") and len(t.shape) == 2:
            prec = tables
        rows = t.shape[0] if len(t.shape) <= 2 else t.shape[0] * t.shape[1]
        if prec == "int8":
            b = t.numel + SCALE_BYTES * rows
        elif prec == "int4":
            b = int4_bytes(rows, t.shape[-1])
        else:
            b = t.numel * fb
        out.append({"component": t.component, "layer": t.layer, "name": t.name, "shape": t.shape,
                    "params": t.numel, "precision": prec, "bytes": b})
    head = [r for r in out if r["component"] == "lm_head"] or [r for r in out if r["component"] == "embeddings"]
    if quant and recipe.head == "int8" and head and not tables:    # localdiff.quantize.int8.Int8Head: a copy
        h = head[0]
        out.append(dict(h, component="head_int8", name="head_int8.weight", params=0, precision="int8",
                        bytes=h["params"] + SCALE_BYTES * h["shape"][0]))
    return out


def kv_bytes(config: dict, tokens: int, batch_size: int = 1, dtype: str = "bfloat16",
             sliding_slack: int | None = None) -> int:
    """KV-cache bytes for ``tokens`` cached tokens per sequence.

    Sliding layers hold at most ``window − 1 + sliding_slack`` tokens: the reference attends to window − 1, and
    ``localdiff.cache.kv`` keeps one canvas of slack (default ``sliding_slack`` = canvas length) for chat prefix reuse;
    ``sliding_slack=0`` gives exactly what attention reads.
    """
    fb = FLOAT_BYTES[dtype]
    slack = int(config.get("canvas_length") or 256) if sliding_slack is None else sliding_slack
    total = 0
    for g in layer_geometry(config):
        n = tokens if g.window is None else min(tokens, max(g.window - 1, 0) + slack)
        total += 2 * g.kv_heads * g.head_dim * n * fb
    return total * batch_size


def kv_tokens_for(config: dict, budget: int, batch_size: int = 1, dtype: str = "bfloat16") -> int:
    """Largest number of cached tokens per sequence whose KV bytes fit ``budget`` (binary search)."""
    lo, hi = 0, 1 << 40
    if kv_bytes(config, 1, batch_size, dtype) > budget:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_bytes(config, mid, batch_size, dtype) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def sc_buffer_bytes(config: dict, batch_size: int = 1) -> int:
    """Self-conditioning buffers: fp32 logits + fp32 probabilities of one canvas, ``2 · C · V · 4`` per sequence
    (0 for models without self-conditioning)."""
    f = plan_fields(config)
    if not f["self_conditioning"]:
        return 0
    return 2 * f["canvas_length"] * f["vocab_size"] * 4 * batch_size


def activation_bytes(config: dict, batch_size: int = 1, dtype: str = "bfloat16", prefill_chunk: int | None = None) -> int:
    """Transient activations for ``max(C, prefill_chunk)`` tokens: per layer the residual, normed input, q/k/v,
    attention output, dense-MLP gate/up/act, the top-k-expanded expert input/output and one expert's
    intermediate (fused attention kernels assumed: no score matrix); the canvas' K/V in every layer; and the
    canvas' logits and probabilities in the float dtype (``2 · C · V``) before they become the fp32
    self-conditioning buffers."""
    f = plan_fields(config)
    fb = FLOAT_BYTES[dtype]
    n = max(f["canvas_length"], prefill_chunk or 0) * batch_size
    h, inter, heads = f["hidden_size"], f["intermediate_size"], f["num_attention_heads"]
    k, im = f["top_k"], f["moe_intermediate_size"]
    geo = layer_geometry(config)
    dq = max(heads * g.head_dim for g in geo)
    dkv = max(g.kv_heads * g.head_dim for g in geo)
    per_token = 4 * h + 2 * dq + 2 * dkv + 3 * inter + 2 * k * h + 3 * im
    canvas = f["canvas_length"] * batch_size
    canvas_kv = sum(2 * g.kv_heads * g.head_dim for g in geo) * canvas * fb
    return n * per_token * fb + n * k * 12 + 2 * canvas * f["vocab_size"] * fb + canvas_kv


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
        """"bf16" (16-bit / float weights: the ``dtype``), "int8" or "int4"."""
        return self.quant or "bf16"

    @property
    def weights_text(self) -> str:
        """"int8 weights (recipe R)", "int4 weights (...; groups of 64, 0.5625 bytes per weight)" or
        "bfloat16 weights"."""
        if self.quant == "int4":
            return (f"int4 weights (recipe {self.recipe}'s quantized set; groups of {INT4_GROUP}, "
                    f"{INT4_BYTES_PER_WEIGHT:g} bytes per weight)")
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
        return (self.device_weight_bytes + self.kv_budget_bytes + self.sc_buffer_bytes + self.activation_bytes
                + self.reserve_bytes)

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
        """"host" or "device" for the experts of ``layer``."""
        return "host" if layer in self.host_expert_layers else "device"

    def to_dict(self) -> dict:
        """JSON-serialisable plan (all sizes in bytes)."""
        return {"device": self.device, "gpu_mem_bytes": self.gpu_mem_bytes, "ram_bytes": self.ram_bytes,
                "quant": self.quant, "precision": self.precision, "dtype": self.dtype, "recipe": self.recipe,
                "batch_size": self.batch_size, "parameters": self.parameters, "components": self.components,
                "weight_bytes": self.weight_bytes, "device_weight_bytes": self.device_weight_bytes,
                "host_weight_bytes": self.host_weight_bytes, "expert_layer_bytes": self.expert_layer_bytes,
                "host_expert_layers": self.host_expert_layers, "n_cpu_moe": self.n_cpu_moe,
                "kv_budget_bytes": self.kv_budget_bytes, "kv_tokens": self.kv_tokens,
                "kv_bytes_per_token": self.kv_bytes_per_token, "sc_buffer_bytes": self.sc_buffer_bytes,
                "activation_bytes": self.activation_bytes, "reserve_bytes": self.reserve_bytes,
                "device_total_bytes": self.device_total_bytes, "resident_bytes": self.resident_bytes,
                "host_total_bytes": self.host_total_bytes, "free_bytes": self.free_bytes, "fits": self.fits,
                "resident": self.resident, "notes": self.notes}

    def to_text(self) -> str:
        """The plan as a small table for ``localdiff show --plan`` (:func:`localdiff.quantize.plan_text.plan_text`)."""
        from localdiff.quantize.plan_text import plan_text

        return plan_text(self)


def plan_memory(config: dict, gpu_mem_bytes: int, quant: str | None = "int8", kv_budget_bytes: int | None = None, *,
                recipe: Recipe | None = None, dtype: str = "bfloat16", reserve_bytes: int | None = None,
                batch_size: int = 1, prefill_chunk: int | None = None, device: str = "cuda",
                ram_bytes: int | None = None) -> Plan:
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
        c = comps.setdefault(r["component"], {"component": r["component"], "label": _LABELS[r["component"]],
                                               "params": 0, "bytes": 0, "precisions": set()})
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
    per_tok = {"full_attention": sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is None),
               "sliding_attention": sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is not None),
               "sliding_cap_bytes": kv_bytes(config, 1 << 40, 1, dtype)
               - (1 << 40) * sum(2 * g.kv_heads * g.head_dim * fb for g in geo if g.window is None)}
    notes = []
    if kv_budget_bytes is None:
        tokens = min(pf["max_position_embeddings"], DEFAULT_KV_TOKENS)
        kv_budget_bytes = kv_bytes(config, tokens, batch_size, dtype)
    kv_tokens = kv_tokens_for(config, kv_budget_bytes, batch_size, dtype)
    plan = Plan(gpu_mem_bytes=int(gpu_mem_bytes), quant=quant, dtype=dtype, recipe=recipe.name,
                components=components, expert_layer_bytes=expert_layer, host_expert_layers=[],
                kv_budget_bytes=int(kv_budget_bytes), kv_tokens=kv_tokens, kv_bytes_per_token=per_tok,
                sc_buffer_bytes=sc_buffer_bytes(config, batch_size),
                activation_bytes=activation_bytes(config, batch_size, dtype, prefill_chunk),
                reserve_bytes=DEFAULT_RESERVE if reserve_bytes is None else int(reserve_bytes),
                batch_size=batch_size, parameters={k: v for k, v in params.items() if k != "by_component"},
                notes=notes, device=device, ram_bytes=None if ram_bytes is None or device == "cpu" else int(ram_bytes))
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
        notes.append("does not fit even with every expert layer on the host: lower the KV budget, a lower precision "
                     "(int8, int4), or a larger device")
    elif not plan.host_fits:
        notes.append(f"the host expert layers need {format_bytes(plan.host_total_bytes)} of RAM with the runtime "
                     f"reserve; this machine has {format_bytes(plan.ram_bytes)}")
    elif plan.host_expert_layers:
        notes.append(f"experts of {plan.n_cpu_moe} of {len(movable)} MoE layers run on the host (CPU); the rest of the "
                     "model, the KV cache and the runtime buffers stay on the device")
    return plan


def plan_for_recipe(config: dict, recipe: Recipe, index: int = 0, quant: str = "int8") -> Plan:
    """The plan for the ``index``-th stored VRAM plan of ``recipe`` (``quant`` on the recipe's quantized set)."""
    vp = recipe.plans[index]
    return plan_memory(config, vp.gpu_mem, quant, vp.kv_budget, recipe=recipe, reserve_bytes=vp.reserve)
