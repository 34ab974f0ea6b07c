"""Architecture summary and exact parameter / byte accounting of a DiffusionGemma checkpoint from ``config.json`` alone.

Counting follows the reference model (transformers 5.23.0 ``DiffusionGemmaForBlockDiffusion``):
``sum(p.numel() for name, p in model.named_parameters() if "vision" not in name)`` — tied embeddings / LM head
counted once, encoder and decoder share all weights (counted once), the self-conditioning block included, the vision
tower and its embedder excluded. Buffers (the per-layer ``layer_scalar``) are not parameters; they appear in the
byte accounting as ``norms`` (one decoder and one encoder scalar per layer, as our runtime keeps them).

Only the JSON header of each safetensors file is read (no tensor data) for bytes on disk.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from localdiff.arch.geometry import layer_geometry as _resolve_layers
from localdiff.errors import CheckpointError

#: bytes per element of the safetensors dtype codes
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                           "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def text_config(config: dict) -> dict:
    """The text part of a config.json dict (``text_config`` when present, else the dict itself)."""
    return dict(config.get("text_config") or config)


@dataclass(frozen=True)
class LayerGeom:
    """Attention geometry of one layer: type ("sliding_attention" / "full_attention"), head_dim, KV heads,
    whether it has its own v_proj (sliding layers; full-attention layers share k = v), and the window (tokens,
    None for full attention)."""

    type: str
    head_dim: int
    kv_heads: int
    has_v: bool
    window: int | None


def layer_geometry(config: dict) -> list[LayerGeom]:
    """Per-layer attention geometry, resolved as the reference does (``per_layer_config`` for full-attention layers,
    else ``global_head_dim`` / ``num_global_key_value_heads``; the last layer is always full attention).

    Raises:
        CheckpointError: required fields are missing or ``layer_types`` has the wrong length.
    """
    t = text_config(config)
    try:
        types, dims = _resolve_layers(t)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid text_config ({e})") from None
    window = int(t.get("sliding_window", 512))
    out = []
    for ty, (head_dim, kv) in zip(types, dims):
        sliding = ty == "sliding_attention"
        out.append(LayerGeom(ty, head_dim, kv, sliding, window if sliding else None))
    return out


@dataclass(frozen=True)
class Tensorish:
    """One weight tensor implied by the config: component, layer index (None = not per layer), its name relative
    to the text model (checkpoint naming, decoder side) and its shape."""

    component: str
    layer: int | None
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _req(t: dict, key: str) -> int:
    v = t.get(key)
    if v is None:
        raise CheckpointError(f"config.json: text_config lacks '{key}'")
    return int(v)


def config_tensors(config: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every text-model weight tensor implied by ``config`` (one copy of shared weights).

    Components: ``embeddings`` (tied LM head counted here once; an untied ``lm_head`` is its own component),
    ``attention``, ``attention_norms``, ``dense_mlp``, ``router``, ``experts``, ``norms`` (layer norms, the final
    norm and — with ``include_buffers`` — the decoder and encoder ``layer_scalar`` buffers), ``self_conditioning``.
    Names follow the checkpoint's decoder naming (``layers.{i}.self_attn.q_proj.weight`` ...).
    """
    t = text_config(config)
    h, v = _req(t, "hidden_size"), _req(t, "vocab_size")
    inter, heads = _req(t, "intermediate_size"), _req(t, "num_attention_heads")
    e, im = _req(t, "num_experts"), _req(t, "moe_intermediate_size")
    bias = bool(t.get("attention_bias", False))
    tied = bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", True)))
    out = [Tensorish("embeddings", None, "embed_tokens.weight", (v, h))]
    if not tied:
        out.append(Tensorish("lm_head", None, "lm_head.weight", (v, h)))
    for i, g in enumerate(layer_geometry(config)):
        p = f"layers.{i}."
        projs = [("q_proj", heads * g.head_dim, h), ("k_proj", g.kv_heads * g.head_dim, h)]
        if g.has_v:
            projs.append(("v_proj", g.kv_heads * g.head_dim, h))
        projs.append(("o_proj", h, heads * g.head_dim))
        for name, o, k in projs:
            out.append(Tensorish("attention", i, f"{p}self_attn.{name}.weight", (o, k)))
            if bias:
                out.append(Tensorish("attention", i, f"{p}self_attn.{name}.bias", (o,)))
        for name in ("q_norm", "k_norm"):
            out.append(Tensorish("attention_norms", i, f"{p}self_attn.{name}.weight", (g.head_dim,)))
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out.append(Tensorish("dense_mlp", i, f"{p}mlp.{name}.weight", shape))
        out += [Tensorish("router", i, f"{p}router.proj.weight", (e, h)),
                Tensorish("router", i, f"{p}router.scale", (h,)),
                Tensorish("router", i, f"{p}router.per_expert_scale", (e,)),
                Tensorish("experts", i, f"{p}experts.gate_up_proj", (e, 2 * im, h)),
                Tensorish("experts", i, f"{p}experts.down_proj", (e, h, im))]
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            out.append(Tensorish("norms", i, f"{p}{name}.weight", (h,)))
        if include_buffers:
            out.append(Tensorish("norms", i, f"{p}layer_scalar", (1,)))
            out.append(Tensorish("norms", i, f"{p}enc_layer_scalar", (1,)))
    out.append(Tensorish("norms", None, "norm.weight", (h,)))
    out += [Tensorish("self_conditioning", None, "self_conditioning.pre_norm.weight", (h,)),
            Tensorish("self_conditioning", None, "self_conditioning.gate_proj.weight", (inter, h)),
            Tensorish("self_conditioning", None, "self_conditioning.up_proj.weight", (inter, h)),
            Tensorish("self_conditioning", None, "self_conditioning.down_proj.weight", (h, inter))]
    return out


def parameter_counts(config: dict) -> dict:
    """Parameters (not buffers) of the text model: ``total``, ``active_per_token`` (total minus the experts a token
    does not use: ``layers × (E − k) × 3·H·I_moe``) and ``by_component``."""
    t = text_config(config)
    by: dict[str, int] = {}
    for x in config_tensors(config, include_buffers=False):
        by[x.component] = by.get(x.component, 0) + x.numel
    total = sum(by.values())
    e, k = _req(t, "num_experts"), _req(t, "top_k_experts")
    per_expert = 3 * _req(t, "hidden_size") * _req(t, "moe_intermediate_size")
    inactive = _req(t, "num_hidden_layers") * (e - k) * per_expert
    return {"total": total, "active_per_token": total - inactive, "by_component": by}


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file (tensor name → {dtype, shape, data_offsets}; ``__metadata__``).

    Raises:
        CheckpointError: the file is missing, truncated or its header is not valid JSON.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise CheckpointError(f"{path}: safetensors header length {n} is implausible")
            head = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return data


def is_vision_tensor(name: str) -> bool:
    """True for tensors of the vision tower / vision embedder (never loaded by the text runtime)."""
    return "vision" in name


def disk_summary(checkpoint_dir: Path) -> dict:
    """Bytes on disk of a checkpoint folder's safetensors files, from their headers only.

    Returns a dict: ``files`` (count), ``bytes_on_disk`` (sum of file sizes), ``weight_bytes`` (tensor data),
    ``weight_bytes_by_dtype`` (all tensors), ``text_weight_bytes_by_dtype`` (vision tensors excluded),
    ``vision_weight_bytes``,
    ``quant_metadata`` (the ``localdiff.quant`` entry of the first file's metadata, if any).
    """
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    by_dtype: dict[str, int] = {}
    text_by_dtype: dict[str, int] = {}
    size = 0
    meta = None
    for f in files:
        head = read_safetensors_header(f)
        size += f.stat().st_size
        m = head.get("__metadata__") or {}
        if meta is None and "localdiff.quant" in m:
            meta = m["localdiff.quant"]
        for name, info in head.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + (b - a)
            if not is_vision_tensor(name):
                text_by_dtype[info["dtype"]] = text_by_dtype.get(info["dtype"], 0) + (b - a)
    text = sum(text_by_dtype.values())
    return {"files": len(files), "bytes_on_disk": size, "weight_bytes": sum(by_dtype.values()),
            "weight_bytes_by_dtype": by_dtype, "text_weight_bytes_by_dtype": text_by_dtype,
            "vision_weight_bytes": sum(by_dtype.values()) - text,
            "quant_metadata": json.loads(meta) if meta else None}


def summarize(config: dict, checkpoint_dir: Path | None = None) -> dict:
    """Architecture summary of a DiffusionGemma config.json (``localdiff show``).

    Args:
        config: the parsed config.json.
        checkpoint_dir: the checkpoint folder, for bytes on disk (safetensors headers only); None = config only.
    Returns:
        a JSON-serialisable dict: ``architecture``, ``model_type``, ``parameters`` (total, active_per_token,
        by_component), ``hidden_size``, ``layers`` (total, by_type), ``attention`` (per layer type: heads, head_dim,
        kv_heads, window, shares_kv), ``experts`` (total, top_k, moe_intermediate_size, dense_mlp_intermediate_size),
        ``canvas_length``, ``vocab_size``, ``context_length``, ``dtype``, ``quantization``, ``has_vision_tower``
        (tensors on disk; the config's ``vision_config`` before a pull), and with a checkpoint ``disk`` (see
        :func:`disk_summary`, weight bytes by dtype from the safetensors headers), else
        ``text_weight_bytes_estimate`` (dtype code → bytes of the text weights in the config's dtype).
    Raises:
        CheckpointError: required config fields are missing, or a safetensors header is unreadable.
    """
    t = text_config(config)
    geo = layer_geometry(config)
    by_type: dict[str, int] = {}
    attn: dict[str, dict] = {}
    for g in geo:
        by_type[g.type] = by_type.get(g.type, 0) + 1
        attn.setdefault(g.type, {"heads": int(t["num_attention_heads"]), "head_dim": g.head_dim,
                                 "kv_heads": g.kv_heads, "window": g.window, "shares_kv": not g.has_v})
    arch = (config.get("architectures") or [None])[0] or "DiffusionGemmaForBlockDiffusion"
    out = {
        "architecture": arch,
        "model_type": config.get("model_type"),
        "parameters": parameter_counts(config),
        "hidden_size": _req(t, "hidden_size"),
        "layers": {"total": len(geo), "by_type": by_type},
        "attention": attn,
        "experts": {"total": _req(t, "num_experts"), "top_k": _req(t, "top_k_experts"),
                    "moe_intermediate_size": _req(t, "moe_intermediate_size"),
                    "dense_mlp_intermediate_size": _req(t, "intermediate_size")},
        "canvas_length": int(config.get("canvas_length") or 256),
        "vocab_size": _req(t, "vocab_size"),
        "context_length": int(t.get("max_position_embeddings", 131072)),
        "dtype": config.get("dtype") or config.get("torch_dtype") or t.get("dtype") or t.get("torch_dtype"),
        "quantization": config.get("quantization_config"),
        "has_vision_tower": bool(config.get("vision_config")),
    }
    if checkpoint_dir is not None:
        out["disk"] = disk_summary(Path(checkpoint_dir))
        out["has_vision_tower"] = out["disk"]["vision_weight_bytes"] > 0
    else:  # before a pull: text weights in the config's dtype (buffers included), vision tower not counted
        code = {"float32": "F32", "float16": "F16"}.get(str(out["dtype"]), "BF16")
        n = sum(x.numel for x in config_tensors(config))   # decoder and encoder layer_scalar are both on disk
        out["text_weight_bytes_estimate"] = {code: n * SAFETENSORS_DTYPE_BYTES[code]}
    return out
