"""Architecture summary (``localdiff show``) and exact parameter / byte accounting of a checkpoint from ``config.json``
alone, for every registered architecture: the tensors come from the architecture's spec (``tensor_shapes``,
``layer_geometry``; :mod:`localdiff.arch.base`), never from a second description here.

For DiffusionGemma:

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
from pathlib import Path

from localdiff.arch import get_spec
from localdiff.errors import CheckpointError

#: bytes per element of the safetensors dtype codes
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}


def text_config(config: dict) -> dict:
    """The text part of a config.json dict (``text_config`` when present, else the dict itself)."""
    return dict(config.get("text_config") or config)


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
    return {
        "files": len(files),
        "bytes_on_disk": size,
        "weight_bytes": sum(by_dtype.values()),
        "weight_bytes_by_dtype": by_dtype,
        "text_weight_bytes_by_dtype": text_by_dtype,
        "vision_weight_bytes": sum(by_dtype.values()) - text,
        "quant_metadata": json.loads(meta) if meta else None,
    }


def spec_of(config: dict):
    """The torch-free spec module of a config.json dict. Raises CheckpointError for an unknown model_type."""
    try:
        return get_spec(config)
    except KeyError as e:
        raise CheckpointError(f"config.json: {e.args[0]}") from None


def layer_geometry(config: dict):
    """Per-layer attention geometry (list of :class:`localdiff.arch.base.LayerGeom`) from the config's spec.
    Raises CheckpointError for missing / malformed fields."""
    try:
        return spec_of(config).layer_geometry(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid text_config ({e})") from None


def config_tensors(config: dict, include_buffers: bool = True):
    """Every weight tensor the config implies (list of :class:`localdiff.arch.base.Tensorish`), from its spec."""
    return spec_of(config).tensor_shapes(config, include_buffers=include_buffers)


def parameter_counts(config: dict) -> dict:
    """``total``, ``active_per_token`` and ``by_component`` parameters, from the config's spec."""
    return spec_of(config).parameter_counts(config)


def summarize(config: dict, checkpoint_dir: Path | None = None) -> dict:
    """Architecture summary of a config.json (``localdiff show``).

    Args:
        config: the parsed config.json.
        checkpoint_dir: the checkpoint folder, for bytes on disk (safetensors headers only); None = config only.
    Returns:
        a JSON-serialisable dict: ``architecture``, ``model_type``, ``family``, ``parameters`` (total,
        active_per_token, by_component), ``hidden_size``, ``layers`` (total, by_type), ``attention`` (per layer type:
        heads, head_dim, kv_heads, window, shares_kv), the spec's ``summary_fields`` (DiffusionGemma: ``experts``,
        ``canvas_length``), ``vocab_size``, ``context_length``, ``dtype``, ``quantization``, ``has_vision_tower``
        (tensors on disk; the config's ``vision_config`` before a pull), and with a checkpoint ``disk`` (see
        :func:`disk_summary`), else ``text_weight_bytes_estimate`` (dtype code → bytes of the text weights in the
        config's dtype).
    Raises:
        CheckpointError: unknown model_type, required config fields missing, or an unreadable safetensors header.
    """
    spec = spec_of(config)
    geo = layer_geometry(config)
    try:  # a spec whose config keys differ from the Llama names (LLaDA: d_model, n_heads) normalises them
        t = spec.text_fields(config) if hasattr(spec, "text_fields") else text_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid or incomplete config ({e})") from None
    by_type: dict[str, int] = {}
    attn: dict[str, dict] = {}
    for g in geo:
        by_type[g.type] = by_type.get(g.type, 0) + 1
        attn.setdefault(
            g.type,
            {
                "heads": int(t["num_attention_heads"]),
                "head_dim": g.head_dim,
                "kv_heads": g.kv_heads,
                "window": g.window,
                "shares_kv": not g.has_v,
            },
        )
    try:
        extra = spec.summary_fields(config) if hasattr(spec, "summary_fields") else {}
        out = {
            "architecture": (config.get("architectures") or [None])[0]
            or (spec.architecture_name(config) if hasattr(spec, "architecture_name") else None)
            or getattr(spec, "ARCHITECTURE", spec.MODEL_TYPE),
            "model_type": config.get("model_type"),
            "family": spec.FAMILY,
            "parameters": parameter_counts(config),
            "hidden_size": int(t["hidden_size"]),
            "layers": {"total": len(geo), "by_type": by_type},
            "attention": attn,
            **extra,
            "vocab_size": int(t["vocab_size"]),
            "context_length": int(t.get("max_position_embeddings", 131072)),
            "dtype": config.get("dtype") or config.get("torch_dtype") or t.get("dtype") or t.get("torch_dtype"),
            "quantization": config.get("quantization_config"),
            "has_vision_tower": bool(config.get("vision_config")),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid or incomplete config ({e.__class__.__name__}: {e})") from None
    if checkpoint_dir is not None:
        out["disk"] = disk_summary(Path(checkpoint_dir))
        out["has_vision_tower"] = out["disk"]["vision_weight_bytes"] > 0
    else:  # before a pull: text weights in the config's dtype (buffers included), vision tower not counted
        code = {"float32": "F32", "float16": "F16"}.get(str(out["dtype"]), "BF16")
        n = sum(x.numel for x in config_tensors(config))  # decoder and encoder layer_scalar are both on disk
        out["text_weight_bytes_estimate"] = {code: n * SAFETENSORS_DTYPE_BYTES[code]}
    return out
