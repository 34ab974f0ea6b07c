"""Block KV cache for block diffusion: the prompt and every finished canvas, per layer, in two memory tiers.

The model (``localdiff/arch``) talks to a cache only through this small interface:

* ``seq_len`` — tokens prefilled so far (absolute positions 0..seq_len-1), ``batch_size``.
* ``past(i)`` → (K, V) Tensors[B, Hkv, L, D] visible to layer i (sliding layers: the last ``window - 1`` tokens,
  as the reference's ``DynamicSlidingWindowLayer`` keeps), or None when empty.
* ``visible_len(i)`` → L above; ``past_mask(i)`` → BoolTensor[B, L] (True = real token), or None when nothing is
  padding.
* ``append(i, k, v)`` during prefill, then ``commit(n_tokens, new_mask, batch_size)`` once all layers appended.
* ``with_canvas(i, k, v)`` → (K, V) of past + canvas for a denoising step, without changing what the cache holds.

Layout (see ``cache_layer.py`` / ``cache_tiers.py``): per layer, K/V in blocks of at most one canvas length (the
prompt is split into blocks, a finished canvas becomes one block). The newest blocks sit in a contiguous device
buffer with a canvas of spare room, so a denoising step writes the canvas K/V after the history and attends to a
view — no step re-concatenates the history. With a device byte budget, the oldest blocks of full-attention layers
live in the host tier (pinned on CUDA) and are streamed back into a staging buffer for attention (on CUDA on a side
stream, one layer ahead), in the same order and with the same values, so logits are bit-identical to an unlimited
budget. Sliding-window layers keep only ``window - 1 + slack`` tokens; blocks no layer can see are freed.
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from localdiff.arch.base import BlockCache
from localdiff.cache.layer import LayerKV, Moves
from localdiff.cache.tiers import DeviceTier, HostTier, Staging
from localdiff.errors import UsageError
from localdiff.units import parse_size as _parse_size


def parse_size(text) -> int | None:
    """A KV budget: a byte size (see ``localdiff.units.parse_size``), or ``"unlimited"`` / ``"none"`` / ``None`` →
    None (no budget).

    Raises:
        UsageError: not a size, or negative.
    """
    if text is None or (isinstance(text, str) and text.strip().lower() in ("unlimited", "none", "inf", "")):
        return None
    return _parse_size(text, UsageError)


def plan_capacity(
    budget: int | None, windows: list[int | None], keep: list[int | None], block_len: int, token_bytes: list[int]
) -> list[int | None]:
    """Per-layer device-buffer capacity (tokens) for a byte budget; None = grow freely (no budget).

    Sliding layers come first: each gets ``keep + 2·C`` tokens (all it ever holds, a canvas of room and one of
    slack) when that still fits, else 0 (it lives on the host). Full-attention layers share the rest in whole blocks
    of C tokens, the same number each, leftover blocks to the earliest layers; a full layer whose history outgrows
    its capacity moves its oldest blocks to the host. ``token_bytes[i]``: bytes of K+V per token of layer i.
    Σ capacity × token_bytes ≤ budget.
    """
    if budget is None:
        return [None] * len(windows)
    caps: list[int | None] = [0] * len(windows)
    rem = budget
    for i, w in enumerate(windows):
        if w is not None and (keep[i] + 2 * block_len) * token_bytes[i] <= rem:
            caps[i] = keep[i] + 2 * block_len
            rem -= caps[i] * token_bytes[i]
    full = [i for i, w in enumerate(windows) if w is None]
    per_block = block_len * sum(token_bytes[i] for i in full)
    if per_block:
        each = rem // per_block
        for i in full:
            caps[i] = each * block_len
        rem -= each * per_block
        for i in full:
            if block_len * token_bytes[i] <= rem:
                caps[i] += block_len
                rem -= block_len * token_bytes[i]
    return caps


class KVCache(BlockCache):
    """Block KV cache with a device tier (byte budget) and a host tier. See the module docstring.

    Args:
        layer_windows: per layer, the sliding window in tokens, or None for full-attention layers.
        slack: extra tokens sliding layers retain so a chat can truncate a little (prefix reuse).
        block_len: block size in tokens (the canvas length C); also the canvas room kept after resident runs.
        device_budget_bytes: bytes of K/V the device tier may hold (None = unlimited, never offload; 0 = all K/V on
            the host). Staging workspace for offloaded layers is reported apart (``staging_bytes``).
        layer_heads: per layer (head_dim, num_kv_heads); needed to plan a finite budget.
    Raises:
        UsageError: a negative budget, or a finite budget without ``layer_heads``.
    """

    def __init__(
        self,
        layer_windows: list[int | None],
        slack: int = 0,
        *,
        block_len: int = 256,
        device_budget_bytes: int | None = None,
        layer_heads: list[tuple[int, int]] | None = None,
    ):
        if device_budget_bytes is not None and device_budget_bytes < 0:
            raise UsageError(f"KV budget must be ≥ 0 bytes (got {device_budget_bytes})")
        if device_budget_bytes is not None and layer_heads is None:
            raise UsageError("a finite KV budget needs the layers' (head_dim, num_kv_heads)")
        self.windows = list(layer_windows)
        self.slack = int(slack)
        self.block_len = max(int(block_len), 1)
        self.budget = device_budget_bytes
        self.layer_heads = None if layer_heads is None else [tuple(h) for h in layer_heads]
        self.keep = [None if w is None else max(w - 1, 0) + self.slack for w in self.windows]
        self.moves = Moves()
        self.device_tier: DeviceTier | None = None
        self.host_tier: HostTier | None = None
        self.staging: Staging | None = None
        self.layers: list[LayerKV] | None = None
        self.capacity: list[int | None] | None = None
        self._clear_content()

    def _clear_content(self) -> None:
        self.mask: torch.Tensor | None = None  # BoolTensor[B, seq_len] or None when nothing is padding
        self.seq_len = 0
        self.batch_size = 0
        self.token_ids: list[list[int]] = []  # per row, the ids prefilled so far (for prefix reuse)
        self._last_i = 1 << 30
        self._ready: dict = {}
        self._order: list[int] = []
        self._rank: dict[int, int] = {}
        self._served = 0

    def _setup(self, k: torch.Tensor) -> None:
        """Create the tiers and the per-layer stores on the first append (batch, dtype and device known now)."""
        dev = k.device
        if self.device_tier is None:
            self.device_tier = DeviceTier(dev, self.budget)
            self.host_tier = HostTier(pin=dev.type == "cuda")
            self.staging = Staging(dev)
        tb = [0] * len(self.windows)
        if self.layer_heads is not None:
            tb = [2 * k.shape[0] * h * d * k.dtype.itemsize for d, h in self.layer_heads]
        self.capacity = plan_capacity(self.budget, self.windows, self.keep, self.block_len, tb)
        self.layers = [
            LayerKV(w, self.keep[i], self.block_len, self.device_tier, self.host_tier, self.moves, self.capacity[i])
            for i, w in enumerate(self.windows)
        ]

    # -- read ---------------------------------------------------------------------------------------------------
    def visible_len(self, i: int) -> int:
        """Number of cached tokens layer i attends to (sliding layers: at most window - 1)."""
        return 0 if self.layers is None else self.layers[i].visible_len()

    def past(self, i: int):
        """(K, V) Tensors[B, Hkv, L, D] of layer i's visible past (a view when resident, else a gathered copy on the
        device), or None when empty."""
        if not self.visible_len(i):
            return None
        lay = self.layers[i]
        view = lay.run_view()
        if view is not None:
            return view
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.past(i)
        b, h, d, dtype = lay.meta
        vis = lay.visible_len()
        k = torch.empty(b, h, vis, d, dtype=dtype, device=self.device_tier.device)
        v = torch.empty_like(k)
        lay.fill_host(k, v)
        lay.fill_device(k, v)
        self.moves.sync_reads += 1
        return k, v

    def past_mask(self, i: int) -> torch.Tensor | None:
        """BoolTensor[B, visible_len(i)] (True = real token) or None when nothing is padding."""
        if self.mask is None:
            return None
        return self.mask[:, self.seq_len - self.visible_len(i) :]

    def with_canvas(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Past K/V of layer i followed by the canvas' k, v: Tensor[B, Hkv, C, D] → Tensors[B, Hkv, L + C, D].

        The cache's content is unchanged. The result is a view of a buffer the next call (or the next step) may
        overwrite: use it before calling again. Resident layers: the canvas is written into the room after the
        run. Layers with host blocks: host part, device run and canvas are copied into a staging slot.
        """
        if self.layers is None:
            return k, v
        if not torch.is_inference_mode_enabled():  # the model calls this under inference mode already
            with torch.inference_mode():
                return self.with_canvas(i, k, v)
        if i <= self._last_i:
            self._new_step()
        self._last_i = i
        lay = self.layers[i]
        out = lay.resident_view(k, v)
        if out is None:
            out = self._staged(i, lay, k, v)
        if self.staging.cuda and self._order:
            self._prefetch_after(i, k.shape[2])
        return out

    def _new_step(self) -> None:
        """A denoising step begins: note which layers read through staging (their order drives the prefetch)."""
        if self._ready:  # prefetches of an interrupted step: their slots may still be being written
            cur = torch.cuda.current_stream(self.staging.device)
            for ev in self._ready.values():
                cur.wait_event(ev)
        self._order = [j for j, lay in enumerate(self.layers) if lay.host_len]
        self._rank = {j: r for r, j in enumerate(self._order)}
        self._served = 0
        self._ready = {}

    def _staged(self, i: int, lay: LayerKV, k: torch.Tensor, v: torch.Tensor):
        n, vis = k.shape[2], lay.visible_len()
        r = self._rank.get(i)
        sk, sv, fresh = self.staging.buffers(lay.meta, vis + n, 2 if r is None else r % 2)
        ev = self._ready.pop(i, None)
        if ev is not None and not fresh:
            torch.cuda.current_stream(k.device).wait_event(ev)
            self.moves.prefetched_reads += 1
        else:
            lay.fill_host(sk, sv)
            self.moves.sync_reads += 1
        lay.fill_device(sk, sv)
        sk[:, :, vis : vis + n].copy_(k)
        sv[:, :, vis : vis + n].copy_(v)
        if r is not None:
            self._served = r + 1
        return sk[:, :, : vis + n], sv[:, :, : vis + n]

    def _prefetch_after(self, i: int, n: int) -> None:
        """CUDA: copy the host part of the next offloaded layer into its slot on the copy stream, after the
        compute stream is done with the slot's previous user (two layers back)."""
        pos = bisect_right(self._order, i)
        if pos >= len(self._order) or pos != self._served:
            return
        j = self._order[pos]
        if j in self._ready:
            return
        lay = self.layers[j]
        sk, sv, _ = self.staging.buffers(lay.meta, lay.visible_len() + n, pos % 2)
        cur = torch.cuda.current_stream(self.staging.device)
        free = torch.cuda.Event()
        free.record(cur)
        s = self.staging.stream
        s.wait_event(free)
        with torch.cuda.stream(s):
            lay.fill_host(sk, sv)
        done = torch.cuda.Event()
        done.record(s)
        self._ready[j] = done

    # -- write --------------------------------------------------------------------------------------------------
    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append new tokens' k, v: Tensor[B, Hkv, T, D] to layer i (call for every layer, then :meth:`commit`)."""
        if self.layers is None:
            self._setup(k)
        with torch.inference_mode():
            self.layers[i].append(k, v)

    def commit(self, n: int, new_mask: torch.Tensor | None, batch_size: int, ids: torch.Tensor | None = None) -> None:
        """Advance by n tokens after every layer appended (models call it through :meth:`writing`).
        new_mask: BoolTensor[B, n] or None (all real); ids: LongTensor[B, n] recorded in ``token_ids``."""
        if ids is not None:
            rows = ids.tolist()
            if len(self.token_ids) != len(rows):
                self.token_ids = [[] for _ in rows]
            for have, new in zip(self.token_ids, rows):
                have.extend(new)
        if new_mask is not None and bool(new_mask.all()):
            new_mask = None
        if new_mask is not None or self.mask is not None:
            dev = new_mask.device if new_mask is not None else self.mask.device
            old = (
                self.mask
                if self.mask is not None
                else torch.ones(batch_size, self.seq_len, dtype=torch.bool, device=dev)
            )
            nm = new_mask if new_mask is not None else torch.ones(batch_size, n, dtype=torch.bool, device=dev)
            self.mask = torch.cat([old.to(dev), nm], dim=1)
        self.seq_len += n
        self.batch_size = batch_size
        self._last_i = 1 << 30

    def truncate(self, n: int) -> bool:
        """Drop every token from position n on (prefix reuse when a chat's earlier turn changed).

        Returns False (cache unchanged) when a sliding layer no longer holds the window - 1 tokens before n; the
        caller then starts over with :meth:`reset`.
        """
        n = max(int(n), 0)
        if n >= self.seq_len:
            return True
        for i, lay in enumerate(self.layers or []):
            w = self.windows[i]
            if w is not None and lay.held and n - min(n, w - 1) < self.seq_len - lay.held:
                return False
        with torch.inference_mode():
            for lay in self.layers or []:
                lay.truncate(min(self.seq_len - n, lay.held))
        if self.mask is not None:
            self.mask = self.mask[:, :n]
        self.seq_len = n
        self.token_ids = [row[:n] for row in self.token_ids]
        self._last_i = 1 << 30
        return True

    def reset(self) -> None:
        """Forget every token and free all K/V (the traffic counters and peaks keep counting)."""
        for lay in self.layers or []:
            lay.free()
        if self.staging is not None:
            self.staging.clear()
        self.layers = None
        self._clear_content()

    # -- accounting ---------------------------------------------------------------------------------------------
    def layer_nbytes(self, i: int) -> tuple[int, int]:
        """(device, host) bytes held by layer i."""
        return (0, 0) if self.layers is None else self.layers[i].nbytes()

    def nbytes(self) -> int:
        """Bytes held by the cached K/V tensors in both tiers (staging workspace excluded)."""
        return 0 if self.device_tier is None else self.device_tier.bytes + self.host_tier.bytes

    def tensors(self, tier: str) -> list[torch.Tensor]:
        """Live tensors of the "device" or "host" tier (for checking the accounting against real sizes)."""
        t = self.device_tier if tier == "device" else self.host_tier
        return [] if t is None else t.tensors()

    def stats(self) -> dict:
        """Accounting for GenerationStats.cache: bytes per tier (current, peak), staging workspace, blocks per tier,
        traffic since the cache was created (blocks/bytes moved to host, streamed back to device, freed), tokens."""
        dt, ht, st = self.device_tier, self.host_tier, self.staging
        lays = self.layers or []
        m = self.moves
        return {
            "budget_bytes": self.budget,
            "device_bytes": dt.bytes if dt else 0,
            "device_bytes_peak": dt.peak if dt else 0,
            "host_bytes": ht.bytes if ht else 0,
            "host_bytes_peak": ht.peak if ht else 0,
            "staging_bytes": st.bytes if st else 0,
            "staging_bytes_peak": st.peak if st else 0,
            "blocks_device": sum(len(lay.dev_blocks) for lay in lays),
            "blocks_host": sum(len(lay.host_blocks) for lay in lays),
            "blocks_to_host": m.blocks_to_host,
            "bytes_to_host": m.bytes_to_host,
            "blocks_to_device": m.blocks_to_device,
            "bytes_to_device": m.bytes_to_device,
            "blocks_freed": m.blocks_freed,
            "prefetched_reads": m.prefetched_reads,
            "sync_reads": m.sync_reads,
            "tokens": self.seq_len,
        }
