"""The model contract: what every architecture under ``localdiff/arch`` provides (docs/ARCHITECTURE.md).

An architecture is two modules, registered once in :data:`localdiff.arch.REGISTRY`:

* a **spec** (torch-free, so ``show`` and the memory planner never import torch): :class:`ArchSpec` —
  ``parse_config(raw) -> args`` (a frozen dataclass built from ``config.json``), ``tensor_shapes(raw)`` (every weight
  tensor the config implies: the single description ``show``, ``plan`` and the memory planner read), and
  ``layer_geometry(raw)`` (per-layer K/V geometry for cache sizing);
* a **model** module: the ``nn.Module`` class (``MODEL_CLASS``) built from the args, declaring the forward
  :data:`ROLES` it supports, plus the checkpoint rules (``checkpoint_names`` / ``keeps_checkpoint_dtype``: our
  "sanitize", applied lazily tensor by tensor so a large checkpoint never sits in memory twice) and
  ``CHECKPOINT_RULES`` (:class:`CheckpointRules`: what the checkpoint may hold that the model does not read — the
  loader refuses any other unread tensor, so a tensor the config turns off is never dropped without a word).

Forward roles (an architecture implements the methods of the roles it lists in ``roles``):

* ``ROLE_PREFILL`` — ``prefill(input_ids, cache, attention_mask=None)``: cached causal pass, K/V appended.
* ``ROLE_DENOISE`` — ``denoise(canvas_ids, cache, self_conditioning_logits=None, prefill_ids=None,
  prefill_mask=None) -> FloatTensor[B, C, V]``: a canvas pass over the cache (optionally fused with a prefill).
* ``ROLE_LOGITS`` — ``logits_full(input_ids, attention_mask=None) -> FloatTensor[B, T, V]``: one uncached pass
  over the whole sequence with the family's own attention pattern (bidirectional for masked models).
* ``ROLE_WINDOW`` — ``forward_window(input_ids, start, kv=None, attention_mask=None, return_kv=False)``: the
  approximate-cache pass of bidirectional models (Fast-dLLM prefix / dual cache, arXiv 2505.22618): queries are the
  window's tokens at positions ``start .. start+n-1``; keys/values are ``kv``'s entries before ``start`` and after
  ``start+n`` around the window's fresh ones. Returns logits FloatTensor[B, n, V] (and the window's per-layer K/V
  when ``return_kv``).
* Optional on both: a model with ``selects_rows = True`` also takes ``rows=(a, b)`` (the LM head only on positions
  a..b-1) and ``select=BoolTensor[B, b-a]`` (only on the selected rows; the others return 0), so the masked loop
  computes no vocabulary-sized work for committed positions (``localdiff.arch.masked.MaskedLM``).
* ``ROLE_DRAFT`` — ``draft(block_embeds, features, cache, head_weight, feature_ids=None) -> FloatTensor[B, n, V]``:
  a DFlash draft pass (``localdiff.arch.dflash``): a block of the target's embeddings attends, non-causally, to the
  cached and new context features of the target; the target's LM head gives the logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

ROLE_PREFILL = "prefill"
ROLE_DENOISE = "denoise"
ROLE_LOGITS = "logits"
ROLE_WINDOW = "window"
ROLE_DRAFT = "draft"
ROLES = (ROLE_PREFILL, ROLE_DENOISE, ROLE_LOGITS, ROLE_WINDOW, ROLE_DRAFT)

#: the families of the registry (docs/ARCHITECTURE.md): each but "drafts" has a runner (``localdiff.engine.RUNNERS``:
#: its loop and decoders); a DFlash draft is not run alone but attached to a causal target
FAMILIES = ("canvas", "masked", "block", "slots", "causal", "drafts")


@dataclass(frozen=True)
class Tensorish:
    """One weight tensor implied by a config: ``component`` (e.g. "attention", "experts": the planner's and
    ``show``'s grouping), ``layer`` index (None = not per layer), ``name`` (ours, as in ``named_parameters``) and
    ``shape``. ``buffer`` marks a buffer (not a parameter; counted in bytes, not in parameter counts)."""

    component: str
    layer: int | None
    name: str
    shape: tuple[int, ...]
    buffer: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


#: rotary-embedding caches some checkpoints carry (recomputed from the config, never read)
ROTARY_CACHES = r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq|cos_cached|sin_cached)$"


@dataclass(frozen=True)
class CheckpointRules:
    """The one place per architecture that says which checkpoint tensors the loader may leave unread.

    ``ignored``: regular expressions (``re.search`` on the checkpoint name) of tensors known to be harmless to skip
    (rotary ``inv_freq`` caches, a vision tower of a text-only runtime). ``tied``: (pattern, replacement) pairs
    (``re.fullmatch`` then ``re.Match.expand``) naming the tensor a checkpoint tensor is a tied copy of (an LM head
    tied to the embeddings, DiffusionGemma's encoder copies of decoder weights); a copy is skipped only when that
    tensor is read and the two are equal. ``switches``: (config.json field, value) pairs whose value would make the
    model read more tensors (``qk_layernorm: true``); the loader's error for an unread tensor names the switch that
    would read it.
    """

    ignored: tuple[str, ...] = (ROTARY_CACHES,)
    tied: tuple[tuple[str, str], ...] = ()
    switches: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class LayerGeom:
    """Attention geometry of one layer: ``type`` ("sliding_attention" / "full_attention"), ``head_dim``,
    ``kv_heads``, ``has_v`` (False when keys double as values), ``window`` (tokens; None for full attention)."""

    type: str
    head_dim: int
    kv_heads: int
    has_v: bool
    window: int | None


@runtime_checkable
class ArchSpec(Protocol):
    """Torch-free description of an architecture (a module; see the module docstring)."""

    MODEL_TYPE: str
    FAMILY: str

    def parse_config(self, raw: dict) -> Any: ...

    def tensor_shapes(self, raw: dict) -> list[Tensorish]: ...

    def layer_geometry(self, raw: dict) -> list[LayerGeom]: ...


class BlockCache(Protocol):
    """What a model's ``prefill`` / ``denoise`` roles read and write: the cache protocol. ``localdiff.cache.kv.
    KVCache`` (tiers, budget, offload) and the test / training-recipe caches declare it by subclassing; ``arch``
    never imports an implementation.

    Reads: ``seq_len`` (tokens held), ``visible_len(i)``, ``past(i)`` → (K, V) Tensors[B, Hkv, L, D] or None,
    ``past_mask(i)`` → Bool[B, L] or None, ``with_canvas(i, k, v)`` (past followed by a canvas' K/V, cache
    unchanged). Writes happen only inside :meth:`writing`: ``append(i, k, v)`` per layer, then the context commits
    (advancing ``seq_len``, extending the padding mask, recording the token ids: the one writer of ``token_ids``) —
    or, on any exception (Ctrl-C included), resets the cache, so uncommitted K/V never survive a failed pass.
    """

    seq_len: int
    token_ids: list

    def visible_len(self, i: int) -> int: ...

    def past(self, i: int): ...

    def past_mask(self, i: int): ...

    def with_canvas(self, i: int, k, v): ...

    def append(self, i: int, k, v) -> None: ...

    def commit(self, n: int, new_mask, batch_size: int, ids=None) -> None: ...

    def reset(self) -> None: ...

    @contextlib.contextmanager
    def writing(self, ids, new_mask=None):
        """The prefill context: ``ids`` LongTensor[B, n] being prefilled, ``new_mask`` Bool[B, n] or None (no
        padding). Commits when the block exits normally, resets the cache when it raises."""
        try:
            yield self
        except BaseException:
            self.reset()
            raise
        self.commit(ids.shape[1], new_mask, ids.shape[0], ids)


@runtime_checkable
class Architecture(Protocol):
    """What the engine and the loops need from a built model (an ``nn.Module``)."""

    config: Any
    roles: frozenset

    def make_cache(self, device_budget_bytes: int | None = None) -> Any: ...


def parameter_counts(tensors: list[Tensorish], inactive: int = 0) -> dict:
    """``total`` parameters (buffers excluded), ``active_per_token`` (total − ``inactive``, the MoE experts a token
    does not use) and ``by_component`` of a :func:`ArchSpec.tensor_shapes` list."""
    by: dict[str, int] = {}
    for t in tensors:
        if not t.buffer:
            by[t.component] = by.get(t.component, 0) + t.numel
    total = sum(by.values())
    return {"total": total, "active_per_token": total - inactive, "by_component": by}
