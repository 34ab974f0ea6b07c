"""The causal family's cache across chat turns and server requests (docs/ARCHITECTURE.md, "Caches"): the target's
exact K/V, and with a DFlash draft (arXiv 2602.06036; z-lab/dflash ``dflash/model.py`` ``dflash_generate``) the
draft's context K/V plus the target features of the positions the draft has not read yet.

What each part holds after a generation (``localdiff.decoding.causal_loop``):

* ``target``: the K/V of the prompt and of every answer token but the last (the last one opens the next block, as
  upstream; it is not in the cache), with their ids in ``target.token_ids``;
* ``draft``: the draft's context K/V (``hidden_norm(fc(features))`` projected per layer; one row per position, no
  mixing across positions) of positions ``0 .. draft.seq_len − 1``, ids in ``draft.token_ids``;
* ``feats`` / ``feat_ids``: the target's features (outputs of the draft's ``target_layer_ids``) of the positions
  ``feat_start .. feat_start + k − 1`` that the next draft pass reads first (``feat_start = draft.seq_len``).

Every part is a function of the tokens before it and at its positions only (causal target; position-wise context
projection), so a next prompt that starts with the same tokens may keep them: :meth:`CausalCache.reuse` keeps the
longest prefix that every part still agrees with (by token ids) and drops the rest. The generation then prefills
only the prompt after it; the draft reads the kept features and the new prompt's features in one pass, as it reads
a whole prompt's without reuse. Anything that does not match (another conversation, an edited turn) is dropped.
"""

from __future__ import annotations

import torch

from localdiff.cache.kv import KVCache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CausalCache:
    """A causal model's conversation cache (module docstring).

    Args:
        target: the target's :class:`localdiff.cache.kv.KVCache` (full attention).
    Attributes:
        target: that cache; draft: the draft's KVCache or None (made by :meth:`reuse` for a draft);
        feats: Tensor[1, k, len(target_layer_ids)·H] or None; feat_ids: LongTensor[1, k] or None;
        feat_start: the position of ``feats[:, 0]``.
    """

    def __init__(self, target: KVCache):
        self.target = target
        self.draft: KVCache | None = None
        self._owner = None  # the draft module whose K/V ``draft`` holds
        self.feats: torch.Tensor | None = None
        self.feat_ids: torch.Tensor | None = None
        self.feat_start = 0

    # -- what callers of a family cache read --------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens held by the target cache."""
        return self.target.seq_len

    @property
    def token_ids(self) -> list[list[int]]:
        """The target cache's ids per row."""
        return self.target.token_ids

    def stats(self) -> dict:
        """The target cache's accounting (``KVCache.stats``)."""
        return self.target.stats()

    def reset(self) -> None:
        """Forget everything (target, draft and pending features)."""
        self.target.reset()
        if self.draft is not None:
            self.draft.reset()
        self.keep_features(None, None)

    def keep_features(self, feats: torch.Tensor | None, ids: torch.Tensor | None) -> None:
        """Record the target features Tensor[1, k, F] (and ids LongTensor[1, k]) of the positions right after what
        the draft cache holds (None: none pending). The loop calls it whenever the draft reads or the target adds
        features, so the three parts agree after any step (a cancelled generation included)."""
        self.feats, self.feat_ids = feats, ids
        self.feat_start = self.draft.seq_len if self.draft is not None else 0

    # -- reuse -----------------------------------------------------------------------------------------------
    def reuse(self, ids: list[int], draft=None, draft_layout: dict | None = None) -> int:
        """Keep the longest prefix of ``ids`` (the next prompt, ≥ 1 token) that the cache can serve and drop the
        rest; returns its length t (0 … len(ids) − 1: the prompt's last token is always prefilled again, for its
        logits). With ``draft`` (a ``localdiff.arch.dflash.DFlashDraft`` that will draft this generation) t is also
        limited to the positions whose draft K/V or pending features agree, and on return ``draft.seq_len +
        feats.shape[1] == t`` (``draft_layout``: ``KVCache`` arguments for a new draft cache). Without a draft the
        draft's parts are left as they are (checked again by id at the next drafted turn)."""
        t = min(common_prefix(self.target.token_ids[0] if self.target.token_ids else [], ids), len(ids) - 1)
        if draft is not None:
            if self.draft is None or self._owner is not draft:
                self.draft, self._owner = KVCache(**draft_layout), draft
                self.keep_features(None, None)
            held = self.draft.token_ids[0] if self.draft.token_ids else []
            d = self.draft.seq_len
            if self.feats is None or self.feat_start != d:
                self.feats = self.feat_ids = None
            agree = common_prefix(held, ids)
            if agree < d:
                self.draft.truncate(agree)
                d = agree
                self.keep_features(None, None)
            pending = [] if self.feat_ids is None else self.feat_ids[0].tolist()
            t = min(t, d + common_prefix(pending, ids[d:]))
            if d > t:
                self.draft.truncate(t)
                self.keep_features(None, None)
            elif self.feats is not None:
                self.keep_features(self.feats[:, : t - d], self.feat_ids[:, : t - d])
        if not self.target.truncate(t):  # (full attention: always possible)
            self.target.reset()
            t = 0
        return t
