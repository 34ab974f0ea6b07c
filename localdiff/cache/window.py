"""Memory tiers for the approximate K/V of bidirectional (masked) models: Fast-dLLM's prefix / dual caches.

Fast-dLLM (NVlabs/Fast-dLLM ``llada/generate.py`` ``generate_with_prefix_cache`` / ``generate_with_dual_cache``,
arXiv 2505.22618) refreshes every layer's K/V with one full pass at the start of each block and reuses them for the
block's other steps. Those K/V are approximate (the masked suffix changes as the block is decoded) and live for one
block, so they do not go in the exact block cache (:mod:`localdiff.cache.kv`); they do use the same memory tiers
(:mod:`localdiff.cache.tiers`): a device byte budget, whole layers past it in the host tier (pinned on CUDA), copied
back into a device staging buffer when a layer attends. Values are copied, never recomputed, so logits are
bit-identical for every budget.

* :class:`WindowStore` — what ``Model.new_cache(device_budget_bytes=...)`` returns for a masked model: the budget and
  the tiers with their counters, kept across the blocks of a generation (and across generations: each block's
  refresh replaces the previous K/V).
* :class:`WindowKV` — one refresh's per-layer (K, V), indexable as the list ``forward_window`` takes.
"""

from __future__ import annotations

import torch

from localdiff.cache.tiers import DeviceTier, HostTier, Staging, storage_bytes
from localdiff.errors import UsageError


class WindowStore:
    """Device budget + host tier for the approximate caches of one masked model.

    Args:
        device: torch.device of the model.
        device_budget_bytes: K/V bytes allowed in the device tier (None = unlimited; 0 = every layer on the host).
    Raises:
        UsageError: a negative budget.
    """

    def __init__(self, device, device_budget_bytes: int | None = None):
        if device_budget_bytes is not None and device_budget_bytes < 0:
            raise UsageError(f"kv budget: must be >= 0 bytes (got {device_budget_bytes})")
        self.device = torch.device(device)
        self.budget = device_budget_bytes
        self.tier = DeviceTier(self.device, device_budget_bytes)
        self.host = HostTier(pin=self.device.type == "cuda")
        self.staging = Staging(self.device)
        self.current: WindowKV | None = None
        self.layers_on_host = 0

    def place(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> "WindowKV":
        """Take the per-layer (K, V) Tensors[B, Hkv, S, D] of a refresh pass: layers in order stay on the device while
        the budget allows, the rest are moved to the host tier. Releases the previous refresh's tensors."""
        if self.current is not None:
            self.current.release()
        placed = []
        on_host = 0
        for k, v in kv:
            nbytes = storage_bytes(k) + storage_bytes(v)
            if self.tier.fits(nbytes):
                placed.append((self.tier._track(k), self.tier._track(v), False))
            else:
                placed.append((self.host.store(k), self.host.store(v), True))
                on_host += 1
        self.layers_on_host = max(self.layers_on_host, on_host)
        self.current = WindowKV(self, placed)
        return self.current

    def release(self) -> None:
        """Drop the last refresh's K/V (the end of a generation); the peak counters stay."""
        if self.current is not None:
            self.current.release()
            self.current = None

    def accounting(self) -> dict:
        """Byte counters (current / peak) of the device tier, host tier and staging, and layers kept on the host."""
        return {
            "device_bytes": self.tier.bytes,
            "device_peak_bytes": self.tier.peak,
            "host_bytes": self.host.bytes,
            "host_peak_bytes": self.host.peak,
            "staging_peak_bytes": self.staging.peak,
            "budget_bytes": self.budget,
            "layers_on_host": self.layers_on_host,
        }


class WindowKV:
    """Per-layer (K, V) of one refresh, as ``forward_window``'s ``kv`` argument: ``len()``, ``[i]`` → (K, V) device
    Tensors[B, Hkv, S, D] (a host layer is copied into a staging slot; the slot is reused by layer i + 2, so use the
    pair before asking for the layer after next), and :meth:`prefix`."""

    def __init__(self, store: WindowStore, layers: list, end: int | None = None):
        self.store, self.layers, self.end = store, layers, end

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, host = self.layers[i]
        if self.end is not None:
            k, v = k[:, :, : self.end], v[:, :, : self.end]
        if not host:
            return k, v
        b, h, s, d = k.shape
        sk, sv, _ = self.store.staging.buffers((b, h, d, k.dtype), s, parity=i % 2)
        sk, sv = sk[:, :, :s], sv[:, :, :s]
        sk.copy_(k, non_blocking=True)
        sv.copy_(v, non_blocking=True)
        return sk, sv

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def prefix(self, end: int) -> "WindowKV":
        """The same layers cut to their first ``end`` positions (the prefix cache's keys), without copying."""
        return WindowKV(self.store, self.layers, end if self.end is None else min(end, self.end))

    def release(self) -> None:
        """Return this refresh's tensors to their tiers."""
        for k, v, host in self.layers:
            (self.store.host if host else self.store.tier).release(k, v)
        self.layers = []
