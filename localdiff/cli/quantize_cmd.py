"""``localdiff quantize MODEL --recipe NAME [--quant int8|int4] -o DIR``: write a pre-quantized checkpoint."""

from __future__ import annotations

import sys

from localdiff.errors import LocaldiffError, UsageError
from localdiff.hub import models as hub
from localdiff.hub.progress import human_bytes


def run_quantize(args) -> int:
    try:
        from localdiff.quantize.io import quantize_checkpoint
    except ImportError as e:
        raise LocaldiffError(f"`localdiff quantize` is not available in this build ({e})") from None
    src = hub.resolve_model(args.name)
    _check_device(args.device)
    made = _check_output_dir(args.output, getattr(args, "force", False))
    try:
        res = quantize_checkpoint(
            src, args.output, recipe=args.recipe, device=args.device, quant=getattr(args, "quant", None)
        )
    except BaseException:
        if made is not None and made.is_dir() and not any(made.iterdir()):  # leave nothing behind we created
            made.rmdir()
        raise
    info = ""
    if isinstance(res, dict) and "bytes_in" in res and "bytes_out" in res:
        info = (
            f" (recipe {res.get('recipe')}: {human_bytes(res['bytes_in'])} -> {human_bytes(res['bytes_out'])}, "
            f"{res.get('quantized_tensors')} {res.get('quant') or 'int8'} tensors)"
        )
    sys.stderr.write(f"wrote {args.output}{info}\n")
    return 0


def _check_device(device: str | None) -> None:
    """``--device``: cpu, cuda or cuda:N of a GPU that is there, checked before any file is written (``--device
    cuda`` without a GPU was "internal error: AssertionError: Torch not compiled with CUDA enabled", ``--device
    tpu`` a RuntimeError listing torch's device types).

    Raises:
        UsageError: naming the device and the accepted ones.
    """
    if not device:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device: invalid device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: unsupported device {device!r} (use cpu, cuda or cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is available (leave --device out to quantize on the CPU)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0 ...)")


def _check_output_dir(path: str, force: bool):
    """``quantize -o DIR`` writes config.json and replaces *.safetensors there: refuse a non-empty folder (or a
    file) unless ``--force``, and a folder that cannot be created or written (``-o /proc/x`` was an internal
    error after the model was quantized). Returns the folder when this call created it, else None."""
    import os
    from pathlib import Path

    if not path.strip():
        raise UsageError("-o: empty folder name")
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"-o {path}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise UsageError(
            f"-o {path}: folder is not empty; choose a new folder, or pass --force to write into it "
            "(its config.json and *.safetensors are replaced)"
        )
    made = None if p.is_dir() else p
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"-o {path}: cannot create the folder: {e.strerror or e}") from None
    if not os.access(p, os.W_OK):
        raise UsageError(f"-o {path}: the folder is not writable")
    return made
