"""Pre-quantized int8 / int4 checkpoints: write them (from a live model or streaming from a float checkpoint) and
prepare a model to load them.

Format: a normal checkpoint folder (``config.json``, safetensors shards, tokenizer files) where each int8 module's
float weight is replaced by an int8 tensor under the same name plus a bf16 ``<name>_scale`` tensor
(``...q_proj.weight`` + ``...q_proj.weight_scale``; ``...experts.gate_up_proj`` + ``...experts.gate_up_proj_scale``),
and each int4 module's by its packed uint8 codes under the same name plus ``<name>_scale`` (bf16) and
``<name>_zero`` (fp16) per group (:mod:`localdiff.quantize.int4`). ``config.json`` gains ``quantization_config =
{"quant_method": "localdiff-int8" | "localdiff-int4", "recipe": {...}}`` (the recipe's rules say which module has
which precision) and every shard's safetensors metadata has ``localdiff.quant`` (the same JSON), so the next load
skips the work.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from localdiff.errors import CheckpointError
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe, recipe_for_model

QUANT_METHOD = "localdiff-int8"
QUANT_METHODS = {"int8": QUANT_METHOD, "int4": "localdiff-int4"}
META_KEY = "localdiff.quant"
DEFAULT_SHARD_BYTES = 2 << 30
COPY_PATTERNS = ("*.json", "tokenizer*", "*.jinja", "*.model", "*.tiktoken", "*.txt")


def quant_info(recipe: Recipe, modules: list[str]) -> dict:
    """The ``quantization_config`` / metadata record of a pre-quantized checkpoint."""
    if recipe.quant() == "int4":
        return {
            "quant_method": QUANT_METHODS["int4"],
            "bits": 4,
            "group_size": 64,
            "scales": "per group of 64 inputs: bf16 scale (max - min) / 15 rounded up, fp16 zero point",
            "recipe": recipe.to_dict(),
            "modules": sorted(modules),
        }
    return {
        "quant_method": QUANT_METHOD,
        "bits": 8,
        "scales": "per-output-channel absmax / 127, bf16 rounded up",
        "recipe": recipe.to_dict(),
        "modules": sorted(modules),
    }


def checkpoint_recipe(config: dict) -> Recipe | None:
    """The recipe a pre-quantized checkpoint was written with (from its config.json), or None for a float one.

    Raises:
        CheckpointError: ``quantization_config`` names a method localdiff cannot load.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") not in QUANT_METHODS.values():
        raise CheckpointError(
            f"config.json: quantization method {qc.get('quant_method')!r} is not supported "
            f"(localdiff loads float checkpoints and its own "
            f"{' / '.join(map(repr, QUANT_METHODS.values()))})"
        )
    return Recipe.from_dict(qc.get("recipe") or {}, name="checkpoint")


def _precision(name: str, ndim: int, recipe: Recipe, tables: bool = False) -> str | None:
    """ "int8" / "int4" when checkpoint tensor ``name`` is quantized by ``recipe`` (2-D ``*.weight`` of a linear layer
    or 3-D stacked experts; the token embedding / LM head only with ``tables`` — the model class reads a quantized
    head — and the recipe's ``embeddings`` quantized; never vision tensors), else None."""
    if "vision" in name:
        return None
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return recipe.embeddings if tables and ndim == 2 and recipe.embeddings in ("int8", "int4") else None
    module = name.rsplit(".", 1)[0]
    if (ndim == 2 and name.endswith(".weight")) or (ndim == 3 and name.endswith((".gate_up_proj", ".down_proj"))):
        prec = recipe.precision_for(module)
        return prec if prec != "float" else None
    return None


class _ShardWriter:
    """Accumulates tensors and writes ``model-XXXXX.safetensors`` shards of at most ``max_bytes`` each."""

    def __init__(self, out_dir: Path, metadata: dict, max_bytes: int):
        self.out, self.meta, self.max = out_dir, metadata, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.max:
            self.flush()
        # a view into a larger storage (fused int8 projections: localdiff.quantize.fuse) is saved as its own copy
        self.buf[name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.buf:
            return
        fname = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buf, str(self.out / fname), metadata=self.meta)
        _as_umask_allows(self.out / fname)  # safetensors writes its file 0600; the folder's other files follow umask
        self.files.append((fname, list(self.buf)))
        self.buf, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.files) == 1:
            (self.out / self.files[0][0]).rename(self.out / "model.safetensors")
            return
        wm = {n: f for f, names in self.files for n in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": wm}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _as_umask_allows(path: Path) -> None:
    """Give ``path`` the mode a newly created file gets under the process umask (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _prepare_out(out_dir: Path, src: Path | None) -> Path:
    out_dir = Path(out_dir)
    if src is not None and out_dir.resolve() == Path(src).resolve():
        raise CheckpointError(f"{out_dir}: output folder must differ from the source checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("*.safetensors")) + list(out_dir.glob("model.safetensors.index.json")):
        old.unlink()
    return out_dir


def _copy_side_files(src: Path, out_dir: Path) -> None:
    """Tokenizer, generation config, chat template (config.json and the weight index are written separately)."""
    for pat in COPY_PATTERNS:
        for f in Path(src).glob(pat):
            if f.name in ("config.json", "model.safetensors.index.json") or not f.is_file():
                continue
            shutil.copy2(f, out_dir / f.name)


def _write_config(config: dict, out_dir: Path, info: dict) -> None:
    cfg = dict(config)
    cfg["quantization_config"] = info
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_quantized(
    model,
    out_dir: Path,
    recipe: Recipe | None = None,
    source_dir: Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a quantized ``localdiff.arch`` model as a pre-quantized checkpoint.

    Args:
        model: a DiffusionGemma (``localdiff.arch``) after :func:`localdiff.quantize.int8.quantize_model`; its
            ``config.raw`` is the source config.json.
        out_dir: output folder (created; old safetensors in it are removed).
        recipe: the recipe recorded in the metadata (default: ``model.quant_recipe``).
        source_dir: a checkpoint folder to copy tokenizer / generation-config / chat-template files from.
        max_shard_bytes: shard size limit.
    Returns:
        out_dir. Tensor names follow the checkpoint convention (``model.decoder.…``; the encoder's own
        ``layer_scalar`` under ``model.encoder.language_model.…``), so :func:`localdiff.load` reads it back.
    """
    from localdiff.arch import get_arch
    from localdiff.quantize.apply import quantized_modules

    recipe = recipe or getattr(model, "quant_recipe", None) or DEFAULT_RECIPE
    arch = get_arch(model.config.raw or model.config.model_type)
    out_dir = _prepare_out(out_dir, source_dir)
    info = quant_info(recipe, list(quantized_modules(model)))
    w = _ShardWriter(out_dir, {"format": "pt", META_KEY: json.dumps(info)}, max_shard_bytes)
    for local, t in model.state_dict().items():
        w.add(arch.checkpoint_names(local)[0], t.detach().to("cpu"))
    w.finish()
    _write_config(model.config.raw, out_dir, info)
    if source_dir is not None:
        _copy_side_files(Path(source_dir), out_dir)
    return out_dir


def _weight_files(src: Path) -> list[Path]:
    files = sorted(Path(src).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{Path(src) / 'model.safetensors'}: file not found (safetensors weights needed)")
    return files


def _default_recipe_for(src: Path) -> Recipe:
    for part in reversed(Path(src).resolve().parts):
        if part.startswith("models--"):
            return recipe_for_model(part[len("models--") :].replace("--", "/"))
    return recipe_for_model(Path(src).name)


def quantize_checkpoint(
    src: Path,
    out_dir: Path,
    recipe: str | Recipe | None = None,
    device: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quant: str | None = None,
) -> dict:
    """``localdiff quantize``: stream a float checkpoint tensor by tensor into a pre-quantized int8 / int4
    checkpoint.

    Peak host memory ≈ one output shard (``max_shard_bytes``) + the largest input tensor (+ one expert's fp32
    temporary): tensors are read one at a time from the memory-mapped input.

    Args:
        src: float checkpoint folder (config.json + safetensors).
        out_dir: output folder (must differ from src).
        recipe: recipe name (``quant/<name>.toml``), a Recipe, or None = the model's own recipe (by repo id /
            folder name), else the default recipe.
        device: device used for the quantization arithmetic ("cpu" default; "cuda" is faster for huge tensors).
        quant: "int8" / "int4": the recipe's quantized list in that precision (None: as the recipe says).
    Returns:
        dict with ``recipe``, ``quantized_tensors``, ``float_tensors``, ``bytes_in``, ``bytes_out``.
    Raises:
        CheckpointError: missing / unreadable files, already-quantized input; RecipeError: bad recipe, or one that
            quantizes none of the checkpoint's tensors (no folder written).
    """
    from localdiff.paths import read_json
    from localdiff.quantize.apply import quant_tensor

    src = Path(src)
    config = read_json(src / "config.json")
    if checkpoint_recipe(config) is not None:
        kind = "int4" if config["quantization_config"].get("quant_method") == QUANT_METHODS["int4"] else "int8"
        raise CheckpointError(f"{src}: already an {kind} checkpoint")
    if recipe is None:
        recipe = _default_recipe_for(src)
    elif isinstance(recipe, str):
        recipe = load_recipe(recipe)
    if quant is not None:
        recipe = recipe.with_precision(quant)
    files = _weight_files(src)
    from localdiff.arch import get_arch

    tables = bool(getattr(get_arch(config).MODEL_CLASS, "supports_int8_head", False))  # as apply's targets
    modules: set[str] = set()
    bytes_in = 0
    # First pass over headers only: which tensors are quantized (recorded in every shard's metadata).
    names = []
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                names.append(name)
                shape = h.get_slice(name).get_shape()
                if _precision(name, len(shape), recipe, tables):
                    modules.add(name.rsplit(".", 1)[0])
    if recipe.quant() and not modules:  # a checkpoint marked int8 with nothing in int8 would load as if it were
        raise RecipeError(
            f"recipe {recipe.name!r} matches none of the tensor names in {src} (e.g. {names[len(names) // 2]!r}): "
            "nothing to quantize, no folder written; quantize at load instead (gen -m MODEL --quant int8|int4)"
        )
    out_dir = _prepare_out(out_dir, src)
    info = quant_info(recipe, list(modules))
    w = _ShardWriter(out_dir, {"format": "pt", META_KEY: json.dumps(info)}, max_shard_bytes)
    n_q = n_f = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                bytes_in += t.numel() * t.element_size()
                prec = _precision(name, t.dim(), recipe, tables)
                if prec:
                    for suffix, part in quant_tensor(t.to(device) if device else t, prec).items():
                        w.add(name + suffix, part.cpu())
                    n_q += 1
                else:
                    w.add(name, t)
                    n_f += 1
                del t
    w.finish()
    _write_config(config, out_dir, info)
    _copy_side_files(src, out_dir)
    return {
        "recipe": recipe.name,
        "quant": recipe.quant(),
        "quantized_tensors": n_q,
        "float_tensors": n_f,
        "bytes_in": bytes_in,
        "bytes_out": w.total,
    }
