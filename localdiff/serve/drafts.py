"""``localdiff serve --draft NAME|auto``: the DFlash draft (arXiv 2602.06036; z-lab/dflash) each served model
loads with. A draft pairs with causal targets only (Qwen3, Llama: ``localdiff.engine.causal``); the server's other
models load alone. ``NAME`` (a catalog alias, "org/repo[@rev]" or a folder) goes with every causal model served;
``auto`` gives each causal model its catalog pairing (``draft = ...`` in models/*.toml), and a model without one
runs alone. Each request then decodes with the draft, losslessly (greedy: the target's own tokens), one request at
a time as the worker runs them.

:meth:`Drafts.check` runs before the server starts, so a bad ``--draft`` is one line and exit 2, not an error on
every request: the name must be a draft, and fit (vocabulary, hidden size, target layers) the causal ``-m`` models.
"""

from __future__ import annotations

import json
from pathlib import Path

from localdiff.errors import UsageError


def _config(name: str) -> dict | None:
    """The config.json of the model ``name`` (None: a GGUF file, or no readable config: the load says why)."""
    import localdiff
    from localdiff.loader import gguf_target

    if gguf_target(name) is not None:
        return None
    path = localdiff._resolve_path(name)[0]
    if gguf_target(path) is not None:
        return None
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _causal(raw: dict | None) -> bool:
    from localdiff.arch import entry_for

    try:
        return raw is not None and entry_for(raw).family == "causal"
    except (KeyError, TypeError):
        return False


def pairing(name: str) -> str | None:
    """The catalog's draft for the model ``name`` (alias or "org/repo[@rev]"), or None."""
    from localdiff.hub import catalog

    entry = catalog.lookup(name) or catalog.entry_for_repo(name.split("@", 1)[0])
    return entry.draft if entry is not None and entry.draft else None


class Drafts:
    """The server's ``--draft`` value (None, "auto" or a name) and which model loads with which draft."""

    def __init__(self, draft: str | None):
        self.draft = draft or None

    def for_model(self, name: str) -> str | None:
        """The ``draft=`` of ``localdiff.load`` for the model ``name``: None without ``--draft`` and for models that
        are not causal (or, with "auto", have no catalog pairing)."""
        if self.draft is None or not _causal(_config(name)):
            return None
        if self.draft == "auto":
            return "auto" if pairing(name) else None
        return self.draft

    def check(self, models: list[str]) -> None:
        """Before the server starts: the draft exists and is one, and fits the causal ``models`` (the ``-m``
        names; none given: the name only).

        Raises:
            UsageError: not a draft, no causal model among ``models``, no catalog pairing ("auto"), or a draft that
                does not fit a served target (one line each).
            ModelNotFoundError: the draft (or an "auto" pairing) is not installed.
        """
        if self.draft is None:
            return
        causal = [(m, raw) for m in models if _causal(raw := _config(m))]
        if self.draft == "auto":
            paired = [(m, raw, pairing(m)) for m, raw in causal if pairing(m)]
            if models and not paired:
                raise UsageError(f"--draft auto: the catalog pairs no draft with {', '.join(models)}")
        else:
            paired = [(m, raw, self.draft) for m, raw in causal]
            if models and not causal:
                raise UsageError(
                    f"--draft: DFlash drafts pair with causal targets (Qwen3, Llama); none of "
                    f"{', '.join(models)} is one"
                )
            if not models:
                _draft_config(self.draft)
        for m, raw, name in paired:
            _fits(name, _draft_config(name), m, raw)


def _draft_config(name: str):
    """The parsed config of the draft ``name``. Raises UsageError (not a draft, a bad config), ModelNotFoundError."""
    from localdiff.arch.dflash_spec import parse_config
    from localdiff.hub import catalog

    raw = _config(name)
    if raw is None or not catalog.is_draft(raw):
        raise UsageError(f"--draft {name}: not a DFlash draft model")
    try:
        return parse_config(raw)
    except ValueError as e:
        raise UsageError(f"--draft {name}: {e}") from None


def _fits(name: str, cfg, target: str, raw: dict) -> None:
    """The checks of ``localdiff.engine.causal.attach_draft`` on the configs. Raises UsageError."""
    vocab, hidden = raw.get("vocab_size"), raw.get("hidden_size")
    layers = raw.get("num_hidden_layers")
    if (vocab, hidden) != (cfg.vocab_size, cfg.hidden_size):
        raise UsageError(
            f"--draft {name} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}) does not fit -m {target} "
            f"(vocab {vocab}, hidden {hidden})"
        )
    if isinstance(layers, int) and max(cfg.target_layer_ids) >= layers:
        raise UsageError(f"--draft {name} reads target layers {list(cfg.target_layer_ids)}; -m {target} has {layers}")
