"""Apply a recipe of int8 and / or int4 precisions to a model: quantize it in place, make empty quantized modules
for a pre-quantized checkpoint, quantize tensors while loading, and list what is quantized.

The int8 modules are :mod:`localdiff.quantize.int8`'s, the int4 ones :mod:`localdiff.quantize.int4`'s; a recipe
marks modules ``int8`` / ``int4`` (``--quant int4`` turns a recipe's int8 list into int4 with
:meth:`localdiff.quantize.recipe.Recipe.with_precision`). The LM head copy of a recipe's ``head`` is an
:class:`~localdiff.quantize.int8.Int8Head` or :class:`~localdiff.quantize.int4.Int4Head` in ``model.head_int8``
(the attribute the block models read). A recipe's quantized ``embeddings`` (``int4_embeddings`` under ``--quant int4``)
replace the token embedding with a :class:`~localdiff.quantize.embedding.QuantEmbedding` (and an untied LM head with
a quantized linear layer) on models whose class reads ``head_int8``; the head then reads those tensors, no copy.
"""

from __future__ import annotations

import torch
from torch import nn

from localdiff.arch.layers import MoEExperts
from localdiff.quantize import int4, int8
from localdiff.quantize.embedding import QuantEmbedding, TiedHead
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError

QUANT_TYPES = int8.QUANT_TYPES + int4.QUANT_TYPES
#: name endings of the scale / zero-point tensors of quantized modules (kept in their stored dtypes)
STATE_SUFFIXES = int8.SCALE_SUFFIXES + (".weight_zero", ".gate_up_proj_zero", ".down_proj_zero")


def _targets(model: nn.Module, recipe: Recipe) -> list[tuple[str, nn.Module, str]]:
    """(name, module, precision) of the float linear layers / stacked experts the recipe quantizes.

    Raises RecipeError when a rule quantizes an embedding or the LM head (they stay float)."""
    out = []
    for name, mod in model.named_modules():
        prec = recipe.precision_for(name) if name else "float"
        if prec == "float":
            continue
        if isinstance(mod, nn.Embedding) or name == "lm_head" or name.endswith(".lm_head"):
            raise RecipeError(f"recipe {recipe.name!r} asks {prec} for {name!r}: embeddings and the LM head stay float")
        if isinstance(mod, nn.Linear) or (isinstance(mod, MoEExperts) and not isinstance(mod, QUANT_TYPES)):
            out.append((name, mod, prec))
    return out


def _embedding_targets(model: nn.Module, recipe: Recipe) -> list[tuple[str, nn.Module, str]]:
    """(name, module, precision) of the float token embedding (and untied LM head) when ``recipe.embeddings`` is
    quantized and the model's class reads its head through ``head_int8`` (else nothing: they stay float)."""
    prec = recipe.embeddings
    if prec not in ("int8", "int4") or not getattr(type(model), "supports_int8_head", False):
        return []
    out = []
    emb, lm = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if isinstance(emb, nn.Embedding):
        out.append(("embed_tokens", emb, prec))
    if isinstance(lm, nn.Linear):
        out.append(("lm_head", lm, prec))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class LinearHead:
    """An untied LM head quantized in place (an int8 / int4 linear layer ``model.lm_head``) as ``head_int8``:
    ``__call__(h: Tensor[..., H]) -> Tensor[..., V]`` (kept outside the state dict; no copy)."""

    def __init__(self, lin: nn.Module):
        self.linear = lin

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)


def quantize_head(model: nn.Module, precision: str) -> bool:
    """Set ``model.head_int8`` when its class reads one (``supports_int8_head``); returns whether it did. A
    quantized tied embedding (:class:`QuantEmbedding`, whose float ``dtype`` becomes the model's, that of
    ``model.norm.weight``) or a quantized ``lm_head`` serves as the head itself; otherwise a ``precision``
    ("int8" / "int4") copy of ``head_weight()`` is made (nothing for "float")."""
    if not getattr(type(model), "supports_int8_head", False):
        return False
    emb, lm = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if isinstance(emb, QuantEmbedding):
        norm = getattr(getattr(model, "norm", None), "weight", None)
        emb.dtype = norm.dtype if norm is not None and norm.is_floating_point() else emb.dtype
        if lm is None:
            model.head_int8 = TiedHead(emb)
            return True
    if isinstance(lm, QUANT_TYPES):
        model.head_int8 = LinearHead(lm)
        return True
    if precision not in ("int8", "int4"):
        return False
    w = model.head_weight().detach()
    model.head_int8 = int8.Int8Head(w) if precision == "int8" else int4.Int4Head(w)
    return True


def quantize_model(model: nn.Module, recipe: Recipe | None = None, quant: str | None = None) -> nn.Module:
    """Quantize ``model`` in place, module by module (each float weight dropped once its quantized copy exists).

    Args:
        model: a ``localdiff.arch`` model with materialised weights.
        recipe: which modules become int8 / int4 (default :data:`DEFAULT_RECIPE`).
        quant: "int8" / "int4" to apply the recipe's quantized list in that precision; None = as the recipe says.
    Returns:
        the same model; ``model.quant_recipe`` records the recipe applied.
    Raises:
        RecipeError: the recipe quantizes an embedding / LM head, or ``quant`` is unknown.
    """
    recipe = recipe or DEFAULT_RECIPE
    if quant is not None:
        recipe = recipe.with_precision(quant)
    for name, mod, prec in _targets(model, recipe):
        if isinstance(mod, nn.Linear):
            new = (int8.Int8Linear if prec == "int8" else int4.Int4Linear).from_linear(mod)
        else:
            new = (int8.Int8Experts if prec == "int8" else int4.Int4Experts).from_experts(mod)
        _replace(model, name, new)
        del mod
    for name, mod, prec in _embedding_targets(model, recipe):
        if isinstance(mod, nn.Embedding):
            new = QuantEmbedding.from_embedding(mod, prec)
        else:
            new = (int8.Int8Linear if prec == "int8" else int4.Int4Linear).from_linear(mod)
        _replace(model, name, new)
        del mod
    quantize_head(model, recipe.head)
    set_activations(model, recipe)
    model.quant_recipe = recipe
    return model


def set_activations(model: nn.Module, recipe: Recipe) -> int:
    """A recipe's ``int4_activations = "int8"`` on every int4 module of ``model`` (experts, linear layers, an int4
    table serving as the head, an :class:`~localdiff.quantize.int4.Int4Head` copy) and its ``int8_activations =
    "int8"`` on every int8 linear layer, int8 table and :class:`~localdiff.quantize.int8.Int8Head` copy (not the
    int8 experts: their exact kernels stay): their CPU calls of a few rows then quantize activations to int8 for
    the AVX512-VNNI kernels (:mod:`localdiff.quantize.int4`, :mod:`localdiff.quantize.int8`). Returns how many it
    set; nothing for other recipes."""
    mods = []
    if recipe.int4_activations == "int8":
        mods += [m for m in model.modules() if isinstance(m, (int4.Int4Linear, int4.Int4Experts))]
        mods += [m for m in model.modules() if isinstance(m, QuantEmbedding) and m.precision == "int4"]
        mods += [h for h in (getattr(model, "head_int8", None),) if isinstance(h, int4.Int4Head)]
    if recipe.int8_activations == "int8":
        mods += [m for m in model.modules() if isinstance(m, int8.Int8Linear)]
        mods += [m for m in model.modules() if isinstance(m, QuantEmbedding) and m.precision == "int8"]
        mods += [h for h in (getattr(model, "head_int8", None),) if isinstance(h, int8.Int8Head)]
    for m in mods:
        m.act_int8 = True
    return len(mods)


def convert_modules(model: nn.Module, recipe: Recipe | None = None, device=None) -> dict[str, str]:
    """Swap the modules ``recipe`` quantizes for *empty* quantized modules (no quantization), e.g. on a model built
    on the meta device before loading a pre-quantized checkpoint. Returns {module name: precision}."""
    recipe = recipe or DEFAULT_RECIPE
    names = {}
    for name, mod, prec in _targets(model, recipe):
        if isinstance(mod, nn.Linear):
            cls = int8.Int8Linear if prec == "int8" else int4.Int4Linear
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device=device or mod.weight.device)
        else:
            e, two_i, h = mod.gate_up_proj.shape
            cls = int8.Int8Experts if prec == "int8" else int4.Int4Experts
            new = cls(e, h, two_i // 2, device=device or mod.gate_up_proj.device)
        _replace(model, name, new)
        names[name] = prec
    for name, mod, prec in _embedding_targets(model, recipe):
        dev = device or mod.weight.device
        if isinstance(mod, nn.Embedding):
            new = QuantEmbedding(mod.num_embeddings, mod.embedding_dim, prec, mod.weight.dtype, device=dev)
        else:
            cls = int8.Int8Linear if prec == "int8" else int4.Int4Linear
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device=dev)
        _replace(model, name, new)
        names[name] = prec
    set_activations(model, recipe)
    model.quant_recipe = recipe
    return names


def quant_entries(local: str, t: torch.Tensor, precision: str, device=None) -> dict[str, torch.Tensor]:
    """Quantize one float checkpoint tensor while loading into modules made by :func:`convert_modules`: the int8
    (weight + ``_scale``) or int4 (codes + ``_scale`` + ``_zero``) entries of ``local`` on ``device``."""
    return int8.int8_entries(local, t, device) if precision == "int8" else int4.int4_entries(local, t, device)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name → int8 / int4 module of a (partly) quantized model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANT_TYPES)}


def is_quant_state(local: str) -> bool:
    """True for the scale / zero-point tensors of quantized modules, which a loader must not cast to the float
    dtype (bf16 scales, fp16 zero points by construction)."""
    return local.endswith(STATE_SUFFIXES)


def quant_tensor(t: torch.Tensor, precision: str) -> dict[str, torch.Tensor]:
    """A float checkpoint tensor quantized for a pre-quantized checkpoint: {"": data, "_scale": ..[, "_zero": ..]}
    (suffixes to append to its name)."""
    if precision == "int8":
        q, s = int8.quantize_tensor(t)
        return {"": q, "_scale": s}
    q, s, z = int4.quantize_tensor(t)
    return {"": q, "_scale": s, "_zero": z}
