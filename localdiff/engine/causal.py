"""Runner of the causal family (Qwen3 / Llama): exact KV cache, plain AR decoding or DFlash speculative decoding
when a draft is attached (:func:`attach_draft`; ``localdiff.load(..., draft=...)``, ``gen --draft``), through
:mod:`localdiff.decoding.causal_loop` and the :class:`localdiff.decoding.dflash.DFlash` policy."""

from __future__ import annotations

from localdiff.cache.causal import CausalCache
from localdiff.cache.kv import KVCache
from localdiff.decoding import causal_loop
from localdiff.errors import CheckpointError, UsageError

#: room kept after the cached run (tokens): a drafted block is appended without reallocating
_BLOCK_ROOM = 64


def prepare(model) -> None:
    """Nothing to check beyond the config parser; no mask token (a draft has its own). ``model.draft`` is None
    until :func:`attach_draft`."""


def attach_draft(model, draft_net, where: str = "draft") -> None:
    """Pair a loaded DFlash draft (``localdiff.arch.dflash.DFlashDraft``) with the target ``model``.

    Raises:
        CheckpointError: the draft does not fit the target (vocabulary, hidden size, target layer ids, mask id).
    """
    c, t = draft_net.config, model.config
    if c.vocab_size != t.vocab_size or c.hidden_size != t.hidden_size:
        raise CheckpointError(
            f"{where}: draft (vocab {c.vocab_size}, hidden {c.hidden_size}) does not fit the target "
            f"(vocab {t.vocab_size}, hidden {t.hidden_size})"
        )
    if max(c.target_layer_ids) >= t.num_hidden_layers:
        raise CheckpointError(
            f"{where}: draft reads target layers {list(c.target_layer_ids)}, the target has {t.num_hidden_layers}"
        )
    model.draft = draft_net


def load_draft(model, name, resolve, dtype=None) -> None:
    """Load the DFlash draft ``name`` (catalog alias, "org/repo[@rev]", folder; "auto" = the target's catalog
    pairing, ``draft = ...`` in models/*.toml) through ``resolve`` (name → (path, label)) and attach it.

    Raises:
        UsageError: a target that is not causal, "auto" without a pairing, a checkpoint that is not a draft.
        ModelNotFoundError / CheckpointError: from resolving and loading.
    """
    from localdiff.loader import load_model

    if model.family != "causal":
        raise UsageError(
            f"--draft: DFlash drafts pair with causal targets (Qwen3, Llama); {model.name} is a {model.family} model"
        )
    if name == "auto":
        from localdiff.hub import catalog

        entry = catalog.lookup(str(model.name)) or catalog.entry_for_repo(str(model.name).split("@", 1)[0])
        if entry is None or not entry.draft:
            raise UsageError(f"--draft auto: the catalog pairs no draft with {model.name}")
        name = entry.draft
    path, label = resolve(name)
    net, _ = load_model(path, model.device, dtype)
    if set(net.roles) != {"draft"}:
        raise UsageError(f"--draft: {label} is not a DFlash draft model")
    attach_draft(model, net, str(path))
    model.draft_name = label


def new_cache(model, device_budget_bytes: int | None = None) -> CausalCache:
    """A fresh conversation cache (:class:`localdiff.cache.causal.CausalCache`: the target's KV cache, full
    attention, blocks of 64 tokens; the draft's parts are added at the first drafted turn), to pass to every turn.
    Raises UsageError for a negative budget."""
    return CausalCache(KVCache(**model.net.cache_layout(_BLOCK_ROOM), device_budget_bytes=device_budget_bytes))


def stream(model, req):
    """Prefill the prompt and decode (with the draft when one is attached); yields the loop's events. A cache from
    :func:`new_cache` passed in keeps the prefix of the prompt it already holds — the target's K/V and, when this
    turn drafts, the draft's context K/V and pending features (``CausalCache.reuse``); only the rest is prefilled
    (``stats.prefill_tokens_reused``). The tokens are those of a run without the cache.

    Raises:
        UsageError: a batch of several prompts, ``block_size`` without a draft, or a cache that is not one of this
            family's.
    """
    if len(req.rows) != 1:
        raise UsageError(f"causal models decode one prompt at a time (batch of {len(req.rows)} given)")
    opts = req.options
    if opts.block_size is not None and model.draft is None:
        raise UsageError(f"block_size: needs a DFlash draft (--draft) (got {opts.block_size})")
    conv = req.cache if req.cache is not None else new_cache(model)
    if not isinstance(conv, CausalCache):
        raise UsageError("cache: pass the cache of this model's new_cache() (a causal model's conversation cache)")
    draft = model.draft
    drafts = draft is not None and int(opts.block_size or draft.block_size) > 1
    kept = conv.reuse(req.rows[0], draft if drafts else None, draft.cache_layout(_BLOCK_ROOM) if drafts else None)
    req.stats.prefill_tokens_reused = kept
    yield from causal_loop.run(
        model.net, req, conv.target, draft, conv.draft if drafts else None, prompt_ids=req.ids[:, kept:], pending=conv
    )
