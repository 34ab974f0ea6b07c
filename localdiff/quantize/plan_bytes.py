"""The planner's byte model: bytes of every weight tensor, of the KV cache per token, of the self-conditioning buffers
and of the activation workspace, from ``config.json`` alone (no weights). :mod:`localdiff.quantize.plan` adds them up
into a device plan.

* weights: every tensor of :func:`localdiff.summary.config_tensors`; an int8 tensor costs 1 byte per weight plus one
  bf16 scale per output channel (per expert for stacked experts); an int4 tensor costs :func:`int4_bytes` (groups of
  64 input features: packed uint4 codes + a 16-bit scale and zero per group = 0.5625 bytes per weight); float tensors
  cost the float dtype's bytes. Which modules are quantized (int8 or int4 alike) comes from the recipe (default:
  attention projections, dense MLP, experts); router, norms, embeddings and self-conditioning stay float.
* KV cache per token: K and V for every layer (full-attention layers too: the reference caches the normed, roped
  keys and the un-roped values separately), ``2 · kv_heads · head_dim`` elements; sliding layers hold at most
  ``sliding_window − 1`` tokens plus one canvas of slack (``localdiff.cache.kv`` keeps it for prefix reuse). The canvas'
  own K/V during a denoising step (C tokens, every layer) counts as activation workspace.
* self-conditioning buffers per sequence: the canvas' fp32 logits and fp32 probabilities, ``2 · C · V · 4`` bytes.
* activation workspace for one forward of ``max(C, prefill_chunk)`` tokens (fused attention kernels assumed, so no
  L×L score matrix).
"""

from __future__ import annotations

from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, table_precision
from localdiff.summary import config_tensors, layer_geometry

FLOAT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
SCALE_BYTES = 2  # int8 per-channel scales are stored as bf16
# The int4 weight-only format, in one place: groups of INT4_GROUP input features, packed uint4 codes
# (two per byte) + a 16-bit scale and a 16-bit zero per group: 36 bytes per 64 weights = 0.5625 bytes per weight.
INT4_GROUP = 64
INT4_GROUP_BYTES = INT4_GROUP // 2 + 2 + 2
INT4_BYTES_PER_WEIGHT = INT4_GROUP_BYTES / INT4_GROUP
QUANTS = ("bf16", "int8", "int4")  # the weight precisions localdiff offers, widest first
INT8_ELIGIBLE = ("attention", "dense_mlp", "experts", "shared_expert", "self_conditioning", "router", "lm_head")


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
    return {
        "canvas_length": int(getattr(c, "canvas_length", 0) or 256),
        "self_conditioning": c.model_type == "diffusion_gemma",
        "top_k": int(getattr(c, "top_k_experts", 0) or getattr(c, "num_experts_per_tok", 0) or 0),
        "moe_intermediate_size": int(getattr(c, "moe_intermediate_size", 0) or 0),
        "intermediate_size": max(
            int(c.intermediate_size or 0), int(getattr(c, "shared_expert_intermediate_size", 0) or 0)
        ),
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "vocab_size": c.vocab_size,
        "num_hidden_layers": c.num_hidden_layers,
        "max_position_embeddings": c.max_position_embeddings,
    }


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


def tensor_bytes(
    config: dict, quant: str | None = "int8", dtype: str = "bfloat16", recipe: Recipe | None = None
) -> list[dict]:
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
    tables = table_precision(config, quant, recipe)  # embedding / LM head quantized themselves
    for t in config_tensors(config):
        prec = dtype
        if (
            quant
            and t.component in INT8_ELIGIBLE
            and len(t.shape) >= 2
            and recipe.precision_for(_module_of(t.name)) == "int8"
        ):
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
        out.append(
            {
                "component": t.component,
                "layer": t.layer,
                "name": t.name,
                "shape": t.shape,
                "params": t.numel,
                "precision": prec,
                "bytes": b,
            }
        )
    head = [r for r in out if r["component"] == "lm_head"] or [r for r in out if r["component"] == "embeddings"]
    if quant and recipe.head == "int8" and head and not tables:  # localdiff.quantize.int8.Int8Head: a copy
        h = head[0]
        out.append(
            dict(
                h,
                component="head_int8",
                name="head_int8.weight",
                params=0,
                precision="int8",
                bytes=h["params"] + SCALE_BYTES * h["shape"][0],
            )
        )
    return out


def kv_bytes(
    config: dict, tokens: int, batch_size: int = 1, dtype: str = "bfloat16", sliding_slack: int | None = None
) -> int:
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


def activation_bytes(
    config: dict, batch_size: int = 1, dtype: str = "bfloat16", prefill_chunk: int | None = None
) -> int:
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
