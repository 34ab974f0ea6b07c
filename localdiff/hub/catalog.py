"""The model catalog: ``models/*.toml`` (one file per family) mapping short aliases to Hub repos or embedded folders.

A catalog file holds ``[[models]]`` tables with these keys:

- ``alias`` (str, required) and ``aliases`` (list of extra names);
- either ``embedded = true`` with ``path`` (relative to the ``models/`` data folder), or ``repo`` ("org/name") with
  ``revision`` (branch, tag or commit; default "main"), ``allow_patterns`` / ``ignore_patterns`` (fnmatch globs);
- optional ``gguf_repo`` / ``gguf_revision`` (a repo of GGUF files: ``<alias>-<quant>`` names one),
  ``description``, ``model_type``, ``approx_size_bytes``, ``approx_params``, ``active_params``,
  ``offline_config`` (path under ``models/`` of a stand-in config.json used before a pull), ``draft`` (the alias of
  the DFlash draft paired with a causal target: ``gen --draft auto``) and a ``[models.sampler]`` table of
  recommended sampler options.
"""

from __future__ import annotations

import difflib
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from localdiff.errors import CheckpointError
from localdiff.paths import models_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Files the runtime needs from a checkpoint repo when the catalog does not say otherwise (never pickles).
DEFAULT_ALLOW_PATTERNS: tuple[str, ...] = (
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.jinja",
    "*.model",
    "*.tiktoken",
)
DEFAULT_IGNORE_PATTERNS: tuple[str, ...] = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5")


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog model.

    Attributes:
        alias: the primary short name (e.g. "diffusiongemma:26b-a4b").
        aliases: extra names that resolve to the same entry.
        repo: Hub repo id ("org/name"), or None for an embedded model.
        revision: branch, tag or 40-hex commit to pull ("main" until a commit is pinned).
        embedded_path: absolute folder of an embedded model, or None.
        allow_patterns / ignore_patterns: fnmatch globs selecting the files to pull.
        approx_size_bytes: approximate download size in bytes (0 when unknown).
        offline_config: absolute path of a stand-in config.json usable before a pull, or None.
        sampler: recommended sampler options (keys as in ``generation_config.json``).
        presets: named sampler option sets (``[models.presets.<task>]``, e.g. a paper's per-benchmark settings).
        single_turn: True for a model trained on single-turn prompts only (a chat sends each message fresh).
        prompt_examples: prompts in the formats the model knows (shown by the chat at start-up); may be empty.
        source: the catalog file this entry came from.
        gguf_repo / gguf_revision: a Hub repo of GGUF files of this model: ``<alias>-<quant>`` pulls one of them
            (``localdiff.hub.gguf_names``).
        draft: the catalog alias of the DFlash draft paired with this (causal) target, or None.
    """

    alias: str
    aliases: tuple[str, ...] = ()
    repo: str | None = None
    revision: str = "main"
    embedded_path: Path | None = None
    description: str = ""
    model_type: str | None = None
    allow_patterns: tuple[str, ...] = DEFAULT_ALLOW_PATTERNS
    ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE_PATTERNS
    approx_size_bytes: int = 0
    approx_params: int = 0
    active_params: int = 0
    offline_config: Path | None = None
    sampler: dict = field(default_factory=dict)
    presets: dict = field(default_factory=dict)
    single_turn: bool = False
    prompt_examples: tuple[str, ...] = ()
    source: Path | None = None
    gguf_repo: str | None = None
    gguf_revision: str = "main"
    draft: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """All names of this entry, primary alias first."""
        return (self.alias, *self.aliases)

    @property
    def embedded(self) -> bool:
        """True for a model shipped inside the package (no pull needed)."""
        return self.embedded_path is not None


def _parse_entry(raw: dict, source: Path, root: Path) -> CatalogEntry:
    """Validate one ``[[models]]`` table; raises CheckpointError naming the file on a malformed entry."""
    if not isinstance(raw, dict) or not isinstance(raw.get("alias"), str) or not raw["alias"]:
        raise CheckpointError(f"catalog {source.name}: every [[models]] entry needs a string 'alias'")
    alias = raw["alias"]
    embedded = bool(raw.get("embedded", False))
    if embedded == bool(raw.get("repo")):
        raise CheckpointError(f"catalog {source.name}: '{alias}' needs exactly one of embedded=true or repo")
    if raw.get("repo") and raw["repo"].count("/") != 1:
        raise CheckpointError(f"catalog {source.name}: '{alias}' repo must look like org/name")
    offline = raw.get("offline_config")
    return CatalogEntry(
        alias=alias,
        aliases=tuple(raw.get("aliases", ())),
        repo=raw.get("repo"),
        revision=str(raw.get("revision", "main")),
        embedded_path=(root / raw.get("path", alias)) if embedded else None,
        description=str(raw.get("description", "")),
        model_type=raw.get("model_type"),
        allow_patterns=tuple(raw.get("allow_patterns", DEFAULT_ALLOW_PATTERNS)),
        ignore_patterns=tuple(raw.get("ignore_patterns", DEFAULT_IGNORE_PATTERNS)),
        approx_size_bytes=int(raw.get("approx_size_bytes", 0)),
        approx_params=int(raw.get("approx_params", 0)),
        active_params=int(raw.get("active_params", 0)),
        offline_config=(root / offline) if offline else None,
        sampler=dict(raw.get("sampler", {})),
        presets={str(k): dict(v) for k, v in dict(raw.get("presets", {})).items()},
        single_turn=bool(raw.get("single_turn", False)),
        prompt_examples=tuple(str(x) for x in raw.get("prompt_examples", ())),
        source=source,
        gguf_repo=raw.get("gguf_repo"),
        gguf_revision=str(raw.get("gguf_revision", "main")),
        draft=raw.get("draft"),
    )


@functools.lru_cache(maxsize=4)
def load_catalog(root: Path | None = None) -> dict[str, CatalogEntry]:
    """Read every ``*.toml`` in the catalog folder.

    Args:
        root: the catalog folder; default ``localdiff.paths.models_dir()``.
    Returns:
        dict name → CatalogEntry, with one key per alias (several keys may share an entry).
    Raises:
        CheckpointError: a catalog file is not valid TOML, is malformed, or two entries claim the same name.
    """
    root = Path(root) if root is not None else models_dir()
    out: dict[str, CatalogEntry] = {}
    for path in sorted(root.glob("*.toml")):
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:  # TOMLDecodeError, UnicodeDecodeError, a 4300-digit number, nesting
            raise CheckpointError(f"catalog file {path} is not valid TOML: {e}") from None
        for raw in data.get("models", []):
            entry = _parse_entry(raw, path, root)
            for name in entry.names:
                if name in out:
                    raise CheckpointError(f"catalog name '{name}' is defined twice ({out[name].source}, {path})")
                out[name] = entry
    return out


def entries(root: Path | None = None) -> list[CatalogEntry]:
    """Distinct catalog entries in file order (one per model, not per alias)."""
    seen: dict[str, CatalogEntry] = {}
    for e in load_catalog(root).values():
        seen.setdefault(e.alias, e)
    return list(seen.values())


def lookup(name: str, root: Path | None = None) -> CatalogEntry | None:
    """The catalog entry for ``name`` (exact alias match), or None."""
    return load_catalog(root).get(name)


def entry_for_repo(repo_id: str, root: Path | None = None) -> CatalogEntry | None:
    """The catalog entry whose repo is ``repo_id`` (case-insensitive), or None."""
    for e in entries(root):
        if e.repo and e.repo.lower() == repo_id.lower():
            return e
    return None


def suggest(name: str, extra: list[str] | tuple[str, ...] = (), n: int = 3) -> list[str]:
    """Nearest catalog names (and ``extra`` names, e.g. pulled repos) to a mistyped ``name``.

    A name is offered when its difflib ratio is ≥ 0.6 and within 0.1 of the best one (so "lada:8b" offers
    "llada:8b", not also "sdar:8b"; "bad name!" offers nothing), or when it starts with ``name``.
    """
    pool = list(dict.fromkeys([*load_catalog().keys(), *extra]))
    lowered = {p.lower(): p for p in pool}
    scored = sorted(((difflib.SequenceMatcher(None, name.lower(), p).ratio(), p) for p in lowered), reverse=True)
    best = scored[0][0] if scored else 0.0
    hits = [p for r, p in scored[:n] if r >= max(0.6, best - 0.1)]
    # Also offer names that contain the query as a prefix ("diffusion" → "diffusiongemma:26b-a4b").
    for p in pool:
        if len(hits) < n and name and p.lower().startswith(name.lower()) and p.lower() not in hits:
            hits.append(p.lower())
    cat = load_catalog()
    primary = [cat[lowered[h]].alias if lowered[h] in cat else lowered[h] for h in hits]
    return list(dict.fromkeys(primary))


def is_draft(cfg: dict) -> bool:
    """True when a config.json is a DFlash draft's (``localdiff.arch``'s "drafts" family: it does not run alone,
    only as ``--draft`` of its target)."""
    from localdiff.arch import entry_for

    try:
        return entry_for(cfg).family == "drafts"
    except (KeyError, AttributeError, TypeError):
        return False


def draft_targets(alias: str) -> list[str]:
    """The catalog targets whose ``draft`` pairing is ``alias`` (``tiny-dflash`` → ``["tiny-qwen3"]``)."""
    return [e.alias for e in entries() if e.draft and e.draft == alias]
