"""Memory tiers of the block KV cache (:mod:`localdiff.cache.kv`): where K/V bytes live and how they are counted.

* :class:`DeviceTier` — the accelerator (or the CPU when that is the device): per-layer run buffers, bounded by the
  cache's byte budget. Every allocation goes through it, so its counters are the real sizes of the live tensors.
* :class:`HostTier` — host RAM (pinned when the device is CUDA, so copies back are asynchronous DMA): blocks moved
  out of the device tier, and blocks that never fitted.
* :class:`Staging` — device workspace where attention over a layer with host blocks reads its K/V: the host blocks
  are streamed in (on CUDA on a side stream, one layer ahead), followed by the device run and the canvas. It is
  transient working memory for one (CUDA: two) layer(s) at a time, reported separately from the budget.

On a CPU-only machine host and device are the same memory, but the tiers, the budget and the accounting work the
same way, so CPU tests drive every code path except the CUDA stream.
"""

from __future__ import annotations

import torch


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (what the allocator really holds, not just the view)."""
    return t.untyped_storage().nbytes()


class _Tier:
    def __init__(self, name: str):
        self.name = name
        self.bytes = 0
        self.peak = 0
        self._live: dict[int, torch.Tensor] = {}

    def _track(self, t: torch.Tensor) -> torch.Tensor:
        self._live[id(t)] = t
        self.bytes += storage_bytes(t)
        self.peak = max(self.peak, self.bytes)
        return t

    def release(self, *ts: torch.Tensor | None) -> None:
        """Forget tensors allocated by this tier (their memory is freed once no view refers to them)."""
        for t in ts:
            if t is not None and self._live.pop(id(t), None) is not None:
                self.bytes -= storage_bytes(t)

    def tensors(self) -> list[torch.Tensor]:
        """The live tensors this tier allocated (tests sum their real sizes against ``bytes``)."""
        return list(self._live.values())


class DeviceTier(_Tier):
    """Device memory for resident K/V, with an optional byte budget.

    Args:
        device: torch.device of the model.
        budget: bytes the tier may hold at any time (None = unlimited).
    """

    def __init__(self, device: torch.device, budget: int | None):
        super().__init__("device")
        self.device = torch.device(device)
        self.budget = budget

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more can be allocated now without exceeding the budget."""
        return self.budget is None or self.bytes + nbytes <= self.budget

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised Tensor[shape] on the device. Raises RuntimeError (a bug in the caller's plan) when it would
        exceed the budget."""
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if not self.fits(nbytes):
            raise RuntimeError(f"KV device tier over budget: {self.bytes} + {nbytes} > {self.budget} bytes")
        return self._track(torch.empty(shape, dtype=dtype, device=self.device))


class HostTier(_Tier):
    """Host memory for offloaded blocks; pinned (page-locked) when ``pin`` so device copies can run asynchronously."""

    def __init__(self, pin: bool):
        super().__init__("host")
        self.pin = bool(pin)

    def store(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (any device), owned by this tier. Blocking copy: the result is ready on return."""
        h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        h.copy_(t)
        return self._track(h)


class Staging:
    """Device workspace for layers whose K/V are not all resident: slots of Tensor[B, H, cap, D], one per
    (shape, parity) so that on CUDA the next offloaded layer can be filled on the copy stream while the current one
    computes. Slots grow geometrically and are kept between steps (no allocation on the per-step path).

    Attributes: ``bytes`` / ``peak`` (workspace held), ``stream`` (the CUDA copy stream, or None on CPU).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.slots: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0
        self.peak = 0

    def buffers(self, meta: tuple, n: int, parity: int = 0) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(K, V) workspace Tensors[B, H, cap ≥ n, D] for ``meta`` = (B, H, D, dtype), and whether they were
        (re)allocated just now (then any prefetched content is gone). ``parity`` selects the slot (CUDA only)."""
        b, h, d, dtype = meta
        key = (b, h, d, dtype, parity if self.cuda else 0)
        cur = self.slots.get(key)
        if cur is not None and cur[0].shape[2] >= n:
            return cur[0], cur[1], False
        if cur is not None:
            if self.cuda:  # a copy into the old slot may still be in flight
                self.stream.synchronize()
            self.bytes -= 2 * storage_bytes(cur[0])
        cap = max(n, 0 if cur is None else cur[0].shape[2] * 3 // 2)
        k = torch.empty(b, h, cap, d, dtype=dtype, device=self.device)
        v = torch.empty_like(k)
        self.slots[key] = (k, v)
        self.bytes += 2 * storage_bytes(k)
        self.peak = max(self.peak, self.bytes)
        return k, v, True

    def clear(self) -> None:
        """Free all workspace."""
        if self.cuda:
            self.stream.synchronize()
        self.slots.clear()
        self.bytes = 0
