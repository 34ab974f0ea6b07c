"""``gen`` without ``--quant`` (flag, ``LOCALDIFF_QUANT`` or the config file): the weight precision from the memory
plan — bf16 → int8 → int4, the first that fits the device the model will run on
(:func:`localdiff.quantize.fit.choose_precision`) — said on stderr whenever it is not the 16-bit default, never
silently."""

from __future__ import annotations

import sys


def _machine(device: str | None, gpu_mem: int | None) -> tuple[str, int, int]:
    """(device type, GPU budget in bytes or 0, RAM in bytes) the load will see: ``--gpu-mem`` or the free CUDA memory
    measured now (as :func:`localdiff.load` plans), the total RAM."""
    import torch

    from localdiff.hub.fit import ram_bytes

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "cuda" if str(dev).startswith("cuda") else "cpu"
    gpu = 0
    if kind == "cuda" and torch.cuda.is_available():
        gpu = int(gpu_mem) if gpu_mem else int(torch.cuda.mem_get_info(torch.device(dev))[0])
    return kind, gpu, ram_bytes()


def auto_quant(
    name: str, device: str | None = None, gpu_mem: int | None = None, dtype: str | None = None, write=None
) -> str | None:
    """The ``quant`` for :func:`localdiff.load` when none was asked: None (16-bit) when that fits, else "int8" or
    "int4"; one line on stderr (``write``) when it picks a lower precision or when nothing fits (then the smallest,
    int4, is tried). None without a line for a model the planner cannot size (a GGUF file, an unknown config, a
    name the load will refuse with its own message).
    """
    from localdiff.capability import choose_cpu_dtype, stored_dtype
    from localdiff.hub import models as hub
    from localdiff.paths import read_json
    from localdiff.quantize.fit import choose_precision
    from localdiff.quantize.recipe import recipe_for_model
    from localdiff.summary import parameter_counts

    from localdiff.errors import LocaldiffError
    from localdiff.loader import gguf_target

    write = write or sys.stderr.write
    try:
        if gguf_target(name) is not None:  # a GGUF file: llama.cpp's own quantization
            return None
        folder = hub.resolve_model(name)
        if not folder.is_dir() or gguf_target(folder) is not None:
            return None
        cfg = read_json(folder / "config.json")
    except LocaldiffError:  # the load reports a bad name / folder itself
        return None
    kind, gpu, ram = _machine(device, gpu_mem)
    if not (gpu if kind == "cuda" else ram):  # the budget is unknown (or CUDA is missing: the load says so)
        return None
    try:
        if dtype is None and kind == "cpu":  # what the load would pick (without its GEMM probe)
            dtype = choose_cpu_dtype(stored_dtype(cfg), parameter_counts(cfg)["total"], measure=False).dtype
        plan_dtype = {"float32": "float32", "float16": "float16"}.get(str(dtype), "bfloat16")
        c = choose_precision(cfg, gpu, ram, recipe=recipe_for_model(name), dtype=plan_dtype, cpu_fallback=kind == "cpu")
    except Exception:  # noqa: BLE001 — a config the planner cannot size: load as asked (the default)
        return None
    if c.fits and c.precision == "bf16":
        return None
    if c.fits:
        write(f"memory: {name} {c.reason}: loading it in {c.precision} (--quant chooses)\n")
        return c.quant
    write(
        f"warning: {name} needs {c.need_line()} ({c.reason}); loading it in {c.plan.precision}, the smallest "
        "precision, which may run out of memory (--quant chooses)\n"
    )
    return c.plan.quant
