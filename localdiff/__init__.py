"""localdiff — a single-user, on-device runtime for diffusion language models (DiffusionGemma canvas block
diffusion). Public API: :func:`load`, :class:`Model`, :class:`Generation`, and the events of ``Model.stream``."""

from __future__ import annotations

import os
from pathlib import Path

# large CPU tensors (a step's [C, V] logits: 32 MiB at canvas 256, vocab 32k) in transparent huge pages: torch reads
# this once, at its first allocation of any size, so it is set when the package is imported (before any tensor of a
# bench or a caller exists; it was read too late when set in load()); a fresh tensor then costs ~2.5x less in page
# faults (issue #24). Process-wide: a reference model in the same process gets it too.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from localdiff.events import CanvasDone, Done, GenerationStats, StepEvent

__version__ = "0.1.0"
__all__ = ["load", "Model", "Generation", "StepEvent", "CanvasDone", "Done", "GenerationStats", "__version__"]

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "auto": None,
}


def _resolve_path(name):

    if not isinstance(name, (str, Path)) or not str(name).strip():
        from localdiff.errors import UsageError

        raise UsageError(
            "empty model name"
            if isinstance(name, (str, Path))
            else f"model name must be a string or a path (got {type(name).__name__})"
        )
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


def load(name="tiny", device=None, dtype=None, quant=None, gpu_mem=None, threads=None, draft=None, gpu_layers=None):
    """Load a model: a catalog alias ("tiny"), a pulled "org/repo[@rev]", a checkpoint folder, or a ``.gguf`` file
    (or a pulled GGUF repo: the gguf backend, llama.cpp through llama-cpp-python; ``localdiff.backends.gguf``).

    Args:
        device: "cpu", "cuda", "cuda:N" or None (CUDA when available, else CPU).
        dtype: "float32" | "bfloat16" | "float16" | torch.dtype | None (``$LOCALDIFF_DTYPE``, else on CPU the default
            of :func:`localdiff.capability.choose_cpu_dtype` — bf16 where the CPU has native bf16 GEMM and the model
            is stored in 16 bits or has ≥ 100M parameters, fp32 otherwise — and the checkpoint's on CUDA). The
            choice and why: ``Model.precision``.
        quant: None, "int8" (weight-only int8, see localdiff.quantize.int8) or "int4" (weight-only 4-bit, groups of
            64: localdiff.quantize.int4); either applies the model's recipe (quant/*.toml) to the same tensors.
        gpu_mem: on CUDA, the device memory budget in bytes for the memory plan (default: free memory measured
            now); expert layers the plan keeps on the host stay in CPU memory and run there (like --n-cpu-moe).
        threads: CPU threads, 1 … 4 × ``os.cpu_count()`` (None = the library's default: all cores; "auto" = by
            model size on a CPU torch model, :func:`localdiff.capability.auto_threads`: 1 under 10M parameters).
            The gguf backend's per-model thread count; on the torch backend, torch's process-wide intra-op thread
            count (``torch.set_num_threads``, like ``llama-cli -t``), which the native kernels split their rows
            over too.
        gpu_layers: GGUF models only: layers llama.cpp offloads to the GPU of a Metal / CUDA build of
            llama-cpp-python (``n_gpu_layers``): an int, "all", or None = all when the build can offload, else 0.
        draft: a DFlash draft for a causal target (Qwen3 / Llama): a catalog alias, "org/repo[@rev]" or a folder;
            "auto" = the target's catalog pairing. Generation then runs DFlash speculative decoding.
    Returns:
        Model.
    Raises:
        ModelNotFoundError, CheckpointError, UsageError (bad device / dtype / quant / threads).
    """
    import torch

    from localdiff.setting_values import check_threads
    from localdiff.engine import Model, read_generation_config
    from localdiff.errors import UsageError
    from localdiff.loader import gguf_target, load_model
    from localdiff.tokenizer import load_tokenizer

    auto = threads == "auto"
    threads = None if auto or threads is None else check_threads(threads, "threads")  # before torch sees it
    gguf = gguf_target(name) if isinstance(name, (str, Path)) and str(name).strip() else None
    if gguf is None:
        path, label = _resolve_path(name)
        gguf = gguf_target(path)
    else:
        label = str(name)
    if gguf is not None:
        if device not in (None, "cpu") or quant not in (None, "none") or dtype not in (None, "float32", "fp32"):
            raise UsageError(
                "a GGUF model runs on the CPU in its own quantization (gguf backend): drop --device / --quant / dtype"
            )
        from localdiff.backends.gguf import gpu_layers_value, open_gguf, version

        net, cfg, tok, gen_cfg = open_gguf(gguf, threads, gpu_layers)
        return Model(
            net,
            cfg,
            tok,
            gguf,
            label,
            "cpu",
            torch.float32,
            cfg.quant,
            gen_cfg,
            backend="gguf",
            backend_version=version(),
            threads=net.threads,
            gpu_layers=gpu_layers_value(gpu_layers),
        )
    if gpu_layers is not None:
        raise UsageError(
            "--gpu-layers: only for GGUF models (llama.cpp); a checkpoint folder uses --device and --gpu-mem"
        )
    if threads:
        torch.set_num_threads(int(threads))
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
    if dtype is None and os.environ.get("LOCALDIFF_DTYPE", "").strip():  # the same set and error as gen --dtype
        from localdiff.setting_values import dtype_name

        dtype = getattr(torch, dtype_name(os.environ["LOCALDIFF_DTYPE"], "LOCALDIFF_DTYPE"))
    precision = None
    if dev.type == "cpu":
        precision = _cpu_precision(path, dtype)
        dtype = getattr(torch, precision.dtype)
    if quant not in (None, "none", "int8", "int4"):
        raise UsageError(f"invalid quant {quant!r} (use int8, int4 or none)")
    quant = None if quant == "none" else quant
    host_layers = ()
    from localdiff.quantize.recipe import recipe_for_model

    recipe = recipe_for_model(label) if quant else None  # the plan and the load follow one recipe (int4: its list)
    if dev.type == "cuda":
        from localdiff.paths import read_json
        from localdiff.quantize.plan import plan_memory

        budget = int(gpu_mem) if gpu_mem else torch.cuda.mem_get_info(dev)[0]
        plan = plan_memory(read_json(path / "config.json"), budget, quant or "bf16", recipe=recipe)
        host_layers = tuple(plan.host_expert_layers)
    net, cfg = load_model(path, dev, dtype, quant=quant, recipe=recipe, host_layers=host_layers)
    if net.roles == {"draft"}:
        raise UsageError(f"{label} is a DFlash draft model: load its target and pass this as draft= (gen --draft)")
    why = None
    if auto and dev.type == "cpu":
        from localdiff.capability import auto_threads

        n, why = auto_threads(sum(p.numel() for p in net.parameters()))
        torch.set_num_threads(n)
    gen_cfg = read_generation_config(path)
    eos = gen_cfg.get("eos_token_id", list(cfg.eos_token_id))
    tok = load_tokenizer(path, eos if isinstance(eos, list) else [eos], gen_cfg.get("pad_token_id", cfg.pad_token_id))
    model = Model(
        net,
        cfg,
        tok,
        path,
        label,
        dev,
        next(net.parameters()).dtype,
        quant,
        gen_cfg,
        precision=precision,
        threads_why=why,
    )
    if draft is not None:
        from localdiff.engine.causal import load_draft

        load_draft(model, draft, _resolve_path, dtype)
    return model


def _cpu_precision(path, dtype):
    """The :class:`localdiff.capability.Precision` of a CPU load: ``dtype`` when asked, else the default chosen from
    the detected CPU and the checkpoint (stored dtype, parameter count)."""
    from localdiff import capability

    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        return capability.Precision(
            name,
            "--dtype, LOCALDIFF_DTYPE or load(dtype=)",
            capability.torch_capability(),
            capability.bf16_instructions(),
            {},
            chosen_by="asked",
        )
    from localdiff.arch import get_spec
    from localdiff.paths import read_json

    raw = read_json(path / "config.json")
    try:
        n = int(get_spec(raw).parameter_counts(raw)["total"])
    except (KeyError, ValueError, TypeError):  # the loader reports a bad config in its own words
        n = None
    return capability.choose_cpu_dtype(capability.stored_dtype(raw), n)


def __getattr__(name):
    if name in ("Model", "Generation"):
        from localdiff import engine

        return getattr(engine, name)
    raise AttributeError(name)
