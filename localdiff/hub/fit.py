"""Does a model fit this machine, and in which precision — before a pull downloads it and when ``gen`` picks its
precision: the machine's RAM and GPU memory (:func:`ram_bytes`, :func:`gpu_mem_bytes`, measured
without torch), the precision chooser on a config (:func:`fit_choice`, :func:`memory_estimate`) and the pull's check
(:func:`check_fit`: a note on stderr, or a one-line refusal unless ``--force``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from localdiff.errors import HubError
from localdiff.hub.progress import human_bytes


def ram_bytes() -> int:
    """Total physical RAM in bytes (0 when it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_mem_bytes() -> int:
    """Total memory of the first NVIDIA GPU via ``nvidia-smi`` (no torch import), or 0 when there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return 0
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        return int(out.split()[0]) * 1024 * 1024
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def fit_choice(cfg: dict, gpu: int | None = None, ram: int | None = None, recipe=None):
    """:func:`localdiff.quantize.fit.choose_precision` for ``cfg`` on this machine (``gpu`` / ``ram`` default to the
    measured ones; 0 = none), or None when the planner does not understand the config."""
    from localdiff.quantize.fit import choose_precision

    gpu = gpu_mem_bytes() if gpu is None else gpu
    ram = ram_bytes() if ram is None else ram
    if not gpu and not ram:  # an unknown machine: nothing to judge (never a refusal)
        return None
    try:
        return choose_precision(cfg, gpu, ram, recipe=recipe)
    except Exception:  # noqa: BLE001 — a config the planner does not know: the byte rule instead
        return None


def memory_estimate(cfg: dict, weight_bytes: int, gpu: int | None = None, ram: int | None = None, recipe=None):
    """How the model will fit this machine, from config.json alone (before the weights are downloaded).

    Uses the precision chooser (:func:`fit_choice`: bf16 → int8 → int4, the first that fits) when the config is one
    the planner understands; otherwise compares the safetensors bytes (16-bit; about half in int8, about
    ``INT4_BYTES_PER_WEIGHT / 2`` of them in int4) with GPU memory or RAM.

    Args:
        cfg: parsed config.json; weight_bytes: total safetensors bytes (from the Hub or the catalog).
        gpu / ram: bytes of GPU memory / RAM (default: measured; 0 = none).
    Returns:
        (one-line text, fits) — fits False when the model runs here in no precision localdiff offers — or None
        when nothing useful can be said.
    """
    from localdiff.quantize.plan_bytes import INT4_BYTES_PER_WEIGHT

    gpu = gpu_mem_bytes() if gpu is None else gpu
    ram = ram_bytes() if ram is None else ram
    c = fit_choice(cfg, gpu, ram, recipe)
    if c is not None:
        if not c.fits:
            from localdiff.quantize.fit import machine_text

            return (
                f"needs {c.need_line()}, the smallest precision localdiff offers, and this machine has "
                f"{machine_text(c.gpu_bytes, c.ram_bytes)} ({c.reason})",
                False,
            )
        return f"memory: {c.reason}" + (
            "" if c.precision == "bf16" else f"; gen loads it in {c.precision} when no --quant is given"
        ), True
    budget = gpu or ram
    where = f"{human_bytes(gpu)} GPU memory" if gpu else f"{human_bytes(ram)} RAM and no NVIDIA GPU"
    if not budget or weight_bytes <= 0.9 * budget:
        return None
    for name, factor in (("int8", 0.5), ("int4", INT4_BYTES_PER_WEIGHT / 2)):
        if factor * weight_bytes <= 0.9 * budget:
            return (
                f"memory: weights are {human_bytes(weight_bytes)}, this machine has {where}: about "
                f"{human_bytes(factor * weight_bytes)} in {name}"
            ), True
    return (
        f"needs about {human_bytes(INT4_BYTES_PER_WEIGHT / 2 * weight_bytes)} for the weights in int4 (the "
        f"smallest precision localdiff offers; {human_bytes(weight_bytes)} in 16 bits) and this machine has "
        f"{where}"
    ), False


def check_fit(
    t: "Target", cfg: dict | None, weight_bytes: int, force: bool, progress, fetched: str = "nothing was downloaded"
) -> None:
    """The fit check of a pull: say on stderr which precision the model fits in here; refuse (HubError) when it fits
    in none, unless ``force`` (``fetched``: what the refusal says was downloaded). ``cfg`` None and ``weight_bytes``
    0: nothing to check."""
    from localdiff.quantize.recipe import recipe_for_model

    if cfg is None and not weight_bytes:
        return
    est = memory_estimate(cfg or {}, weight_bytes, recipe=recipe_for_model(t.entry.alias if t.entry else t.name))
    if est is None:
        return
    text, fits = est
    if fits:
        progress.note(text.replace("memory: ", f"memory: {t.name} ", 1))
        return
    if not force:
        raise HubError(f"{t.name} cannot run on this machine: it {text}; {fetched} (pass --force to pull it anyway)")
    progress.note(f"warning: {t.name} {text}; pulling anyway (--force)")


def catalog_config(t: "Target") -> dict | None:
    """The catalog's stand-in config.json of ``t`` (read from the package; no network), or None."""
    e = t.entry
    if e is None or getattr(t, "quant", None) or e.offline_config is None or not e.offline_config.is_file():
        return None
    try:
        cfg = json.loads(e.offline_config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg else None
