"""Quantization recipes: ``quant/*.toml`` (one per catalog model) — module patterns → precision, and VRAM plans.

A recipe file::

    name = "tiny"                       # the recipe name (``--recipe NAME``); defaults to the file stem
    models = ["tiny"]                   # catalog aliases / repo ids it is meant for
    description = "..."
    default = "float"                   # precision of modules no rule matches
    head = "float"                      # "int8" / "int4": a quantized copy of the LM head for the logits
    embeddings = "float"                # "int8" / "int4": the token embedding table itself quantized
    int4_embeddings = "int4"            # what ``--quant int4`` sets ``embeddings`` to (default: as ``embeddings``)
    int4_activations = "int8"           # int4 layers: int8 activations (AVX512-VNNI; opt-in); default "float"
    int8_activations = "int8"           # int8 linears / head: int8 activations (AVX512-VNNI; opt-in); "float"
    [[rules]]                           # first matching rule wins
    pattern = "*router*"                # fnmatch glob on a module name
    precision = "float"                 # "int8", "int4" or "float"
    [[plans]]                           # VRAM plans (see localdiff.quantize.plan.plan_memory)
    gpu_mem = "24GiB"
    kv_budget = "2GiB"
    reserve = "1GiB"
    host_expert_layers = 6              # what the planner computes for this budget (tests check it)

Patterns match both our module names (``layers.3.self_attn.q_proj``, ``self_conditioning.mlp.up_proj``) and the
checkpoint's (``model.decoder.layers.3.self_attn.q_proj``, ``model.decoder.self_conditioning.up_proj``), so write
them with a leading ``*``. Only linear layers and stacked experts can be int8 / int4; everything else stays float.

``--quant int4`` applies a recipe's int8 list in 4 bits (:meth:`Recipe.with_precision`): the same tensors
quantized, router / norms / self-conditioning float as for int8 (format: localdiff.quantize.int4), and the embedding
table in the recipe's ``int4_embeddings`` precision (:mod:`localdiff.quantize.embedding`: for models whose class
reads a quantized head, the tied LM head then reads that table and no head copy is made).
"""

from __future__ import annotations

import difflib
import fnmatch
import sys
from dataclasses import dataclass, field
from pathlib import Path

from localdiff.errors import LocaldiffError
from localdiff.paths import quant_dir
from localdiff.units import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRECISIONS = ("int8", "int4", "float")
#: the weight quantizations ``--quant`` offers (each applies a recipe's quantized tensor list)
QUANTS = ("int8", "int4")


class RecipeError(LocaldiffError):
    """A quantization recipe is unknown, malformed, or asks for something unsupported."""


#: the keys a recipe table may hold (TOML files and the copy recorded in a pre-quantized checkpoint)
RECIPE_KEYS = (
    "name",
    "description",
    "models",
    "default",
    "rules",
    "head",
    "embeddings",
    "int4_embeddings",
    "int4_activations",
    "int8_activations",
    "plans",
)


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size: ``24GiB``, ``24 GiB``, ``24G`` (=10⁹·24), ``1.5GB``, ``512MiB``, or a plain number of bytes.

    Raises:
        RecipeError: not a size (message names the text).
    """
    return parse_size(text, RecipeError)


format_bytes = format_size  # the memory plan's name for it (localdiff.units)


@dataclass(frozen=True)
class VramPlan:
    """One stored VRAM plan of a recipe: device budget, KV budget, runtime reserve (bytes) and the number of expert
    layers the planner keeps on host for it (``host_expert_layers``; None when not stated)."""

    gpu_mem: int
    kv_budget: int | None = None
    reserve: int | None = None
    host_expert_layers: int | None = None


@dataclass(frozen=True)
class Recipe:
    """A parsed quantization recipe (see the module docstring)."""

    name: str
    rules: tuple[tuple[str, str], ...]
    default: str = "float"
    models: tuple[str, ...] = ()
    description: str = ""
    plans: tuple[VramPlan, ...] = ()
    source: Path | None = field(default=None, compare=False)
    head: str = "float"
    embeddings: str = "float"
    int4_embeddings: str | None = None
    int4_activations: str = "float"
    int8_activations: str = "float"

    def precision_for(self, module_name: str) -> str:
        """ "int8", "int4" or "float" for a module name (first matching rule, else ``default``)."""
        for pattern, precision in self.rules:
            if fnmatch.fnmatchcase(module_name, pattern):
                return precision
        return self.default

    def with_precision(self, quant: str) -> "Recipe":
        """This recipe with every quantized precision (rules, default, head) set to ``quant`` ("int8" / "int4"):
        ``--quant int4`` quantizes exactly the tensors the int8 recipe lists; with "int4" the embedding table takes
        the recipe's ``int4_embeddings`` precision when it names one. Returns self when nothing changes.

        Raises:
            RecipeError: ``quant`` is not one of :data:`QUANTS`.
        """
        if quant not in QUANTS:
            raise RecipeError(f"unknown quantization {quant!r} (use {' or '.join(QUANTS)})")
        swap = lambda p: quant if p in QUANTS else p  # noqa: E731
        rules = tuple((pat, swap(p)) for pat, p in self.rules)
        emb = self.int4_embeddings if quant == "int4" and self.int4_embeddings else self.embeddings
        if (
            rules == self.rules
            and swap(self.default) == self.default
            and swap(self.head) == self.head
            and emb == self.embeddings
        ):
            return self
        return Recipe(
            name=self.name,
            rules=rules,
            default=swap(self.default),
            models=self.models,
            description=self.description,
            plans=self.plans,
            source=self.source,
            head=swap(self.head),
            embeddings=emb,
            int4_embeddings=self.int4_embeddings,
            int4_activations=self.int4_activations,
            int8_activations=self.int8_activations,
        )

    def quant(self) -> str | None:
        """The quantized precision this recipe uses ("int4" when any rule / its head says int4, else "int8" when
        one says int8), None for an all-float recipe."""
        used = {p for _, p in self.rules} | {self.default, self.head, self.embeddings}
        return "int4" if "int4" in used else "int8" if "int8" in used else None

    def to_dict(self) -> dict:
        """JSON-serialisable form (recorded in pre-quantized checkpoints' metadata)."""
        out = {
            "name": self.name,
            "default": self.default,
            "rules": [list(r) for r in self.rules],
            "models": list(self.models),
        }
        return (
            out
            | ({"head": self.head} if self.head != "float" else {})
            | ({"embeddings": self.embeddings} if self.embeddings != "float" else {})
            | ({"int4_embeddings": self.int4_embeddings} if self.int4_embeddings else {})
            | ({"int4_activations": self.int4_activations} if self.int4_activations != "float" else {})
            | ({"int8_activations": self.int8_activations} if self.int8_activations != "float" else {})
        )

    @classmethod
    def from_dict(cls, data: dict, source: Path | None = None, name: str | None = None) -> "Recipe":
        """Validate a recipe dict (TOML or metadata JSON). Raises RecipeError naming the source: an unknown key
        (:data:`RECIPE_KEYS`), or a value of the wrong kind or range (``rules = 5``, ``host_expert_layers = "abc"``)."""
        where = str(source) if source else "recipe"
        if not isinstance(data, dict):
            raise RecipeError(f"{where}: expected a table")
        unknown = sorted(set(data) - set(RECIPE_KEYS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], RECIPE_KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RecipeError(f"{where}: unknown recipe key {unknown[0]!r}{hint}")
        try:
            return cls._checked(data, where, source, name)
        except (TypeError, ValueError, OverflowError) as e:  # a value of the wrong kind the checks above let through
            raise RecipeError(f"{where}: malformed recipe ({type(e).__name__}: {e})") from None

    @classmethod
    def _checked(cls, data: dict, where: str, source: Path | None, name: str | None) -> "Recipe":
        for key in ("rules", "plans", "models"):
            if not isinstance(data.get(key, []), (list, tuple)):
                raise RecipeError(f"{where}: {key} must be a list (got {data[key]!r})")
        rules = []
        for r in data.get("rules", []):
            if isinstance(r, (list, tuple)) and len(r) == 2:
                r = {"pattern": r[0], "precision": r[1]}
            if not isinstance(r, dict) or not isinstance(r.get("pattern"), str):
                raise RecipeError(f"{where}: every rule needs a string 'pattern'")
            if r.get("precision") not in PRECISIONS:
                raise RecipeError(
                    f"{where}: rule {r.get('pattern')!r} has precision {r.get('precision')!r} "
                    f"(use one of {', '.join(PRECISIONS)})"
                )
            rules.append((r["pattern"], r["precision"]))
        default = data.get("default", "float")
        if default not in PRECISIONS:
            raise RecipeError(f"{where}: default precision {default!r} (use one of {', '.join(PRECISIONS)})")
        head = data.get("head", "float")
        if head not in PRECISIONS:
            raise RecipeError(f"{where}: head precision {head!r} (use one of {', '.join(PRECISIONS)})")
        emb = {}
        for key in ("embeddings", "int4_embeddings"):
            v = data.get(key)
            if v is not None and v not in PRECISIONS:
                raise RecipeError(f"{where}: {key} precision {v!r} (use one of {', '.join(PRECISIONS)})")
            emb[key] = v
        acts = {k: data.get(k, "float") for k in ("int4_activations", "int8_activations")}
        for key, v in acts.items():
            if v not in ("float", "int8"):
                raise RecipeError(f"{where}: {key} {v!r} (use float or int8)")
        plans = []
        for p in data.get("plans", []):
            if not isinstance(p, dict) or "gpu_mem" not in p:
                raise RecipeError(f"{where}: every [[plans]] entry needs 'gpu_mem'")
            try:
                plans.append(
                    VramPlan(
                        gpu_mem=parse_bytes(p["gpu_mem"]),
                        kv_budget=parse_bytes(p["kv_budget"]) if "kv_budget" in p else None,
                        reserve=parse_bytes(p["reserve"]) if "reserve" in p else None,
                        host_expert_layers=int(p["host_expert_layers"]) if "host_expert_layers" in p else None,
                    )
                )
            except RecipeError as e:
                raise RecipeError(f"{where}: {e}") from None
        return cls(
            name=str(data.get("name") or name or (source.stem if source else "custom")),
            rules=tuple(rules),
            default=default,
            models=tuple(data.get("models", ())),
            description=str(data.get("description", "")),
            plans=tuple(plans),
            source=source,
            head=head,
            embeddings=emb["embeddings"] or "float",
            int4_embeddings=emb["int4_embeddings"],
            int4_activations=acts["int4_activations"],
            int8_activations=acts["int8_activations"],
        )


#: The rules used when no recipe is named: int8 for attention projections, the dense MLP and the experts;
#: router, norms, embeddings / tied LM head and self-conditioning stay float.
DEFAULT_RECIPE = Recipe.from_dict(
    {
        "name": "default",
        "rules": [
            ["*self_conditioning*", "float"],
            ["*router*", "float"],
            ["*self_attn.?_proj", "int8"],
            ["*layers.*.mlp.*_proj", "int8"],
            ["*layers.*.experts", "int8"],
        ],
    }
)


def table_precision(config: dict, quant: str | None, recipe: Recipe) -> str | None:
    """ "int8" / "int4" when the token embedding (and LM head) are stored quantized under ``quant``: the recipe's
    ``int4_embeddings`` with int4 (else its ``embeddings``), for architectures whose model reads a quantized head
    (:mod:`localdiff.quantize.embedding`); None when they stay float."""
    from localdiff.arch import get_arch

    if not quant:
        return None
    prec = recipe.int4_embeddings if quant == "int4" and recipe.int4_embeddings else recipe.embeddings
    if prec not in ("int8", "int4") or not getattr(get_arch(config).MODEL_CLASS, "supports_int8_head", False):
        return None
    return prec


def recipe_path(name: str, root: Path | None = None) -> Path:
    """Path of ``quant/<name>.toml`` (``name`` may also be a path to a .toml file)."""
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return p
    return (Path(root) if root is not None else quant_dir()) / f"{name}.toml"


def available_recipes(root: Path | None = None) -> list[str]:
    """Names of the recipes in the ``quant/`` folder."""
    return sorted(p.stem for p in (Path(root) if root is not None else quant_dir()).glob("*.toml"))


def load_recipe(name: str, root: Path | None = None) -> Recipe:
    """Load a recipe by name (``quant/<name>.toml``) or path; "default" gives :data:`DEFAULT_RECIPE`.

    Raises:
        RecipeError: unknown name (lists the available ones), invalid TOML, or invalid content.
    """
    if name == "default":
        return DEFAULT_RECIPE
    path = recipe_path(name, root)
    if not path.is_file():
        raise RecipeError(f"unknown quantization recipe {name!r} (available: {', '.join(available_recipes(root))})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, UnicodeDecodeError, a 4300-digit number, nesting
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    return Recipe.from_dict(data, source=path, name=path.stem)


def recipe_for_model(model: str, root: Path | None = None) -> Recipe:
    """The recipe whose ``models`` list names ``model`` (catalog alias or repo id, case-insensitive), else the
    default recipe."""
    for name in available_recipes(root):
        r = load_recipe(name, root)
        if model.lower() in (m.lower() for m in r.models) or model.lower() == r.name.lower():
            return r
    return DEFAULT_RECIPE
