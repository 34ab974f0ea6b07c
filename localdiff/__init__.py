"""localdiff — a single-user, on-device runtime for diffusion language models (DiffusionGemma canvas block
diffusion). Public API: :func:`load`, :class:`Model`, :class:`Generation`, and the events of ``Model.stream``."""
from __future__ import annotations

from localdiff.events import CanvasDone, Done, GenerationStats, StepEvent

__version__ = "0.1.0"
__all__ = ["load", "Model", "Generation", "StepEvent", "CanvasDone", "Done", "GenerationStats", "__version__"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "auto": None}


def _resolve_path(name):
    from pathlib import Path

    if not isinstance(name, (str, Path)) or not str(name).strip():
        from localdiff.errors import UsageError

        raise UsageError("empty model name" if isinstance(name, (str, Path)) else
                         f"model name must be a string or a path (got {type(name).__name__})")
    p = Path(str(name)).expanduser()
    if p.is_dir():
        return p.resolve(), str(p)
    try:
        from localdiff.hub.models import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return Path(resolve_model(str(name))), str(name)
    from localdiff.errors import ModelNotFoundError
    from localdiff.paths import models_dir

    if name == "tiny" and (models_dir() / "tiny").is_dir():
        return models_dir() / "tiny", "tiny"
    raise ModelNotFoundError(f"model {name!r} not found")


def load(name="tiny", device=None, dtype=None, quant=None, gpu_mem=None, draft=None):
    """Load a model: a catalog alias ("tiny"), a pulled "org/repo[@rev]", or a checkpoint folder.

    Args:
        device: "cpu", "cuda", "cuda:N" or None (CUDA when available, else CPU).
        dtype: "float32" | "bfloat16" | "float16" | torch.dtype | None (fp32 on CPU, the checkpoint's on CUDA).
        quant: None or "int8" (weight-only int8, see localdiff.quantize.int8).
        gpu_mem: on CUDA, the device memory budget in bytes for the memory plan (default: free memory measured
            now); expert layers the plan keeps on the host stay in CPU memory and run there (like --n-cpu-moe).
        draft: a DFlash draft for a causal target (Qwen3 / Llama): a catalog alias, "org/repo[@rev]" or a folder;
            "auto" = the target's catalog pairing. Generation then runs DFlash speculative decoding.
    Returns:
        Model.
    Raises:
        ModelNotFoundError, CheckpointError, UsageError (bad device / dtype / quant).
    """
    import torch

    from localdiff.engine import Model, read_generation_config
    from localdiff.errors import UsageError
    from localdiff.loader import load_model
    from localdiff.tokenizer import load_tokenizer

    path, label = _resolve_path(name)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"invalid device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device!r} (use cpu or cuda)")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise UsageError(f"invalid dtype {dtype!r} (use float32, bfloat16 or float16)")
        dtype = _DTYPES[dtype] and getattr(torch, _DTYPES[dtype])
    if dtype is None and dev.type == "cpu":
        dtype = torch.float32
    if quant not in (None, "none", "int8"):
        raise UsageError(f"invalid quant {quant!r} (use int8 or none)")
    quant = None if quant == "none" else quant
    host_layers = ()
    if dev.type == "cuda":
        from localdiff.paths import read_json
        from localdiff.quantize.plan import plan_memory

        budget = int(gpu_mem) if gpu_mem else torch.cuda.mem_get_info(dev)[0]
        plan = plan_memory(read_json(path / "config.json"), budget, quant or "bf16")
        host_layers = tuple(plan.host_expert_layers)
    net, cfg = load_model(path, dev, dtype, quant=quant, host_layers=host_layers)
    if net.roles == {"draft"}:
        raise UsageError(f"{label} is a DFlash draft model: load its target and pass this as draft= (gen --draft)")
    gen_cfg = read_generation_config(path)
    eos = gen_cfg.get("eos_token_id", list(cfg.eos_token_id))
    tok = load_tokenizer(path, eos if isinstance(eos, list) else [eos], gen_cfg.get("pad_token_id", cfg.pad_token_id))
    model = Model(net, cfg, tok, path, label, dev, next(net.parameters()).dtype, quant, gen_cfg)
    if draft is not None:
        from localdiff.engine.causal import load_draft

        load_draft(model, draft, _resolve_path, dtype)
    return model


def __getattr__(name):
    if name in ("Model", "Generation"):
        from localdiff import engine

        return getattr(engine, name)
    raise AttributeError(name)
