"""Checkpoint folder → config → architecture class (built on the meta device) → weights read memory-mapped; on CPU
copied into huge-page memory (:mod:`localdiff.hugepages`: a bandwidth-bound step reads them faster).

Only safetensors are read (pickled ``.bin`` files are never unpickled); no code from a checkpoint runs. Text-only:
tensors of a vision tower are never read. Any missing or inconsistent file raises ``CheckpointError`` naming the file
before a model is returned, so there is never a half-loaded model.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from localdiff.arch import get_arch, get_spec, supported
from localdiff.errors import CheckpointError
from localdiff import heap
from localdiff.hugepages import fits_in_memory, resident
from localdiff.paths import read_json


@contextlib.contextmanager
def _no_init():
    """Skip torch.nn.init while building on the meta device (weights are loaded right after; initialising meta
    tensors costs nothing but pulls in torch's compiler stack, ~2 s and ~70 MB per load)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def load_config(ckpt: Path):
    """(architecture module, parsed config) of a checkpoint folder. Raises CheckpointError."""
    cfg = read_json(ckpt / "config.json")
    try:
        mod, spec = get_arch(cfg), get_spec(cfg)
    except KeyError:
        raise CheckpointError(
            f"{ckpt / 'config.json'}: unknown model_type {cfg.get('model_type')!r} "
            f"(supported: {', '.join(supported())})"
        ) from None
    try:
        return mod, spec.parse_config(cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'config.json'}: invalid text config ({e})") from None


def weight_map(ckpt: Path) -> dict[str, Path]:
    """Tensor name → shard path, from ``model.safetensors.index.json`` or the single ``model.safetensors``.

    Raises CheckpointError when no safetensors weights exist (``.bin`` only is refused) or a listed shard is absent.
    """
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        out = {}
        for name, shard in wm.items():
            p = ckpt / shard
            if not p.is_file():
                raise CheckpointError(f"{p}: shard listed in {index.name} is missing")
            out[name] = p
        return out
    single = ckpt / "model.safetensors"
    files = [single] if single.is_file() else sorted(ckpt.glob("*.safetensors"))
    if not files:
        if list(ckpt.glob("*.bin")) or list(ckpt.glob("*.pt")):
            raise CheckpointError(f"{ckpt}: only pickled .bin/.pt weights found; localdiff loads safetensors only")
        raise CheckpointError(f"{ckpt / 'model.safetensors'}: file not found")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    out[name] = f
        except Exception as e:  # corrupt header
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def _tensor(wm: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(wm[name]), framework="pt", device="cpu") as h:
        return h.get_tensor(name)


def _tied_to(rules, name: str, wm: dict[str, Path], read: set[str]) -> tuple[str | None, bool]:
    """(the read tensor ``name`` is a tied copy of, whether the two are equal) under ``rules.tied``."""
    for pattern, target in rules.tied:
        m = re.fullmatch(pattern, name)
        if m and (of := m.expand(target)) in read:
            a, b = _tensor(wm, name), _tensor(wm, of)
            return of, a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return None, False


def _switch_for(mod, raw: dict, name: str) -> str | None:
    """The ``config.json has no FIELD: VALUE`` clause of the first of ``mod.CHECKPOINT_RULES.switches`` under which
    the model would read checkpoint tensor ``name`` (its spec's tensors, mapped by ``checkpoint_names``), or None."""
    spec = get_spec(raw)
    for field, value in mod.CHECKPOINT_RULES.switches:
        text = raw.get("text_config")
        now = raw.get(field, (text or {}).get(field) if isinstance(text, dict) else None)
        if now == value:
            continue
        alt = {**raw, field: value}
        if isinstance(text, dict):
            alt["text_config"] = {**text, field: value}
        try:
            names = {c for t in spec.tensor_shapes(alt) for c in mod.checkpoint_names(t.name)}
        except (KeyError, ValueError, TypeError, CheckpointError):
            continue
        if name in names:
            return (
                f"config.json has no {field}: {json.dumps(value)}"
                if now is None
                else f"config.json has {field}: {json.dumps(now)}, not {json.dumps(value)}"
            )
    return None


def check_all_read(mod, raw: dict, wm: dict[str, Path], read: set[str]) -> None:
    """Strict loading: every tensor of the checkpoint is read by the model, or is known to be ignorable by the
    architecture's ``CHECKPOINT_RULES`` (:class:`localdiff.arch.base.CheckpointRules`: rotary caches, a vision tower,
    a tied copy equal to the tensor read), so a tensor that config.json turns off is never dropped without a word.

    Args:
        mod: the architecture's model module; raw: config.json; wm: :func:`weight_map`; read: the checkpoint names
            the model reads.
    Raises:
        CheckpointError: one line naming the first unread tensor and, where one exists, the config.json field that
            would read it (``... is in the checkpoint but config.json has no qk_layernorm: true``).
    """
    rules = mod.CHECKPOINT_RULES
    unread, notes = [], {}
    for name in sorted(set(wm) - read):
        if any(re.search(p, name) for p in rules.ignored):
            continue
        of, same = _tied_to(rules, name, wm, read)
        if same:
            continue
        unread.append(name)
        if of is not None:
            notes[name] = f" (it differs from {of}, which it would be tied to)"
    if not unread:
        return
    name = unread[0]
    why = _switch_for(mod, raw, name) or "the model config.json describes has no such tensor"
    more = f"; {len(unread) - 1} more unread tensor(s)" if len(unread) > 1 else ""
    raise CheckpointError(f"{wm[name]}: {name} is in the checkpoint but {why}{notes.get(name, '')}{more}")


def load_model(
    ckpt: Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quant: str | None = None,
    recipe=None,
    host_layers=(),
):
    """Build the model for checkpoint folder ``ckpt`` and load its weights.

    Args:
        ckpt: checkpoint folder (config.json + safetensors).
        device: target device.
        dtype: floating dtype of the weights; None keeps the checkpoint's dtype (bf16 checkpoints become fp32 on CPU
            only when asked).
    Returns:
        (model in eval mode, config).
    Raises:
        CheckpointError: missing / corrupt files, unknown model_type, missing tensors, wrong shapes.
    """
    with heap.for_weights():
        out = _load_model(ckpt, device, dtype, quant, recipe, host_layers)
    heap.for_steps()  # step temporaries from the heap from now on (localdiff.heap: -45 ms/step fp32 150M)
    return out


def _load_model(ckpt: Path, device, dtype, quant, recipe, host_layers):
    """:func:`load_model`'s work, under :func:`localdiff.heap.for_weights`."""
    mod, cfg = load_config(ckpt)
    model_cls = mod.MODEL_CLASS
    wm = weight_map(ckpt)
    from localdiff.quantize.apply import convert_modules, is_quant_state, quant_entries
    from localdiff.quantize.io import checkpoint_recipe
    from localdiff.quantize.recipe import DEFAULT_RECIPE
    from localdiff.quantize.offload import device_for

    with torch.device("meta"), _no_init():
        model = model_cls(cfg)
    pre = checkpoint_recipe(cfg.raw)  # a pre-quantized checkpoint: int8 / int4 tensors + scales on disk
    if pre is not None:
        if quant in ("int8", "int4") and pre.quant() not in (None, quant):
            raise CheckpointError(
                f"{ckpt}: a pre-quantized {pre.quant()} checkpoint; it loads as {pre.quant()} "
                f"(drop --quant {quant}, or quantize the float checkpoint with --quant {quant})"
            )
        convert_modules(model, pre)
    wanted = {}
    for local, t in list(model.named_parameters()) + list(model.named_buffers()):
        for cand in mod.checkpoint_names(local):
            if cand in wm:
                wanted[local] = (cand, tuple(t.shape))
                break
        else:
            shard = next(iter(set(wm.values())), ckpt)
            raise CheckpointError(f"{shard}: tensor for {local!r} not found (looked for {mod.checkpoint_names(local)})")
    check_all_read(mod, cfg.raw, wm, {cand for cand, _ in wanted.values()})
    to_quant: dict[str, str] = {}  # "module." → precision
    applied = pre
    if quant in ("int8", "int4") and pre is None:  # quantize at load, tensor by tensor
        applied = (recipe or DEFAULT_RECIPE).with_precision(quant)
        to_quant = {n + ".": p for n, p in convert_modules(model, applied).items()}
    prefixes = tuple(to_quant)
    by_file: dict[Path, list[str]] = {}
    for local, (cand, _) in wanted.items():
        by_file.setdefault(wm[cand], []).append(local)
    loaded: dict[str, torch.Tensor] = {}
    copy_cpu = fits_in_memory(sum(f.stat().st_size for f in by_file))  # else the weights stay memory-mapped
    for f, locals_ in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for local in locals_:
                cand, shape = wanted[local]
                t = h.get_tensor(cand)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{f}: tensor {cand!r} has shape {tuple(t.shape)}, config implies {shape}")
                dev = device_for(local, host_layers, device)
                if prefixes and local.startswith(prefixes):
                    prec = next(p for n, p in to_quant.items() if local.startswith(n))
                    loaded.update(quant_entries(local, t, prec, dev))
                    continue
                to = (
                    dtype
                    if (
                        t.is_floating_point()
                        and dtype is not None
                        and not mod.keeps_checkpoint_dtype(local)
                        and not is_quant_state(local)
                    )
                    else None
                )
                if torch.device(dev).type == "cpu" and copy_cpu:  # file's 4 KiB pages → huge pages (-16 %/step)
                    loaded[local] = resident(t, to)
                else:
                    loaded[local] = (t if to is None else t.to(to)).to(dev)
    if dtype is not None:
        for local in loaded:
            if mod.keeps_checkpoint_dtype(local):
                loaded[local] = loaded[local].to(dtype)
    model.load_state_dict(loaded, strict=True, assign=True)
    if applied is not None:
        from localdiff.quantize.apply import quantize_head, set_activations
        from localdiff.quantize.fuse import fuse_model

        quantize_head(model, applied.head)  # an int8 / int4 copy of the LM head for the logits (recipe's head)
        set_activations(model, applied)  # int4 / int8_activations = "int8": also on that copy
        fuse_model(model)  # q/k/v and gate/up as one quantized matmul each (exact)
        if torch.device(device).type == "cuda":  # int4 layers in a CUDA library's layout (quantize.cuda4)
            from localdiff.quantize.cuda4 import convert_model

            convert_model(model)
    if host_layers:
        from localdiff.quantize.offload import place_model

        place_model(model, host_layers, device)  # installs the hooks that run host-layer experts on the CPU
    model.eval().requires_grad_(False)
    if hasattr(model, "fuse_projections"):
        model.fuse_projections()
    return model, cfg


def gguf_target(where) -> Path | None:
    """The ``.gguf`` file a model name points at, or None: a GGUF file itself, or a folder (a pulled GGUF repo's
    snapshot) without config.json that holds exactly one ``.gguf`` file.

    Raises:
        CheckpointError: a folder without config.json holding several ``.gguf`` files (which one is ambiguous).
    """
    from localdiff.backends.gguf_file import is_gguf

    p = Path(str(where)).expanduser()
    if p.is_file():
        return p.resolve() if (p.suffix.lower() == ".gguf" or is_gguf(p)) else None
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if len(files) > 1:
            raise CheckpointError(
                f"{p}: {len(files)} .gguf files and no config.json; pass one file "
                f"({', '.join(f.name for f in files[:4])})"
            )
        return files[0].resolve() if files else None
    return None
