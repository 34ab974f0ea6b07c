"""One layer's K/V in the block KV cache (:mod:`localdiff.cache.kv`): host blocks followed by a device run.

Positions held by a layer are ``[end - held, end)``. The oldest part lives in the host tier as separate blocks
(each ≤ one canvas length); the newest part is a contiguous *run* at ``buf[:, :, off : off + dev_len]`` of a
device buffer with spare capacity, split into blocks by ``dev_blocks`` (lengths, oldest first). Host blocks are
always older than the run, so "move the oldest block to host" pops the run's first block.

A layer whose K/V are all resident keeps at least one canvas of room after its run: a denoising step writes the
canvas K/V there and attends to a view, so no step copies the history. A layer with host blocks (or no room) is
read through :class:`localdiff.cache.tiers.Staging`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localdiff.cache.tiers import DeviceTier, HostTier, storage_bytes


@dataclass
class Moves:
    """Cumulative traffic counters shared by all layers of a cache."""

    blocks_to_host: int = 0
    bytes_to_host: int = 0
    blocks_to_device: int = 0  # host blocks streamed back for attention (counted per read)
    bytes_to_device: int = 0
    blocks_freed: int = 0  # blocks no layer can see any more (sliding layers), dropped
    prefetched_reads: int = 0  # staged reads whose host part was copied ahead on the CUDA copy stream
    sync_reads: int = 0  # staged reads copied on the compute stream


class LayerKV:
    """K/V of one layer. ``keep``: tokens a sliding layer retains (window - 1 + slack), None for full attention.
    ``cap_limit``: device-buffer capacity in tokens allowed by the cache's plan (None = grow without bound)."""

    def __init__(
        self,
        window: int | None,
        keep: int | None,
        block_len: int,
        dev: DeviceTier,
        host: HostTier,
        moves: Moves,
        cap_limit: int | None,
    ):
        self.window, self.keep, self.C = window, keep, block_len
        self.dev, self.host, self.moves, self.cap_limit = dev, host, moves, cap_limit
        self.host_blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_len = 0
        self.k: torch.Tensor | None = None  # device buffers Tensor[B, H, cap, D]
        self.v: torch.Tensor | None = None
        self.off = 0
        self.dev_len = 0
        self.dev_blocks: list[int] = []
        self.meta: tuple | None = None  # (B, H, D, dtype) once the first tokens arrived

    # -- sizes --------------------------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        return self.host_len + self.dev_len

    @property
    def cap(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def visible_len(self) -> int:
        """Tokens attention may read (sliding layers: at most window - 1)."""
        return self.held if self.window is None else min(self.held, self.window - 1)

    def nbytes(self) -> tuple[int, int]:
        """(device, host) bytes this layer holds (storage sizes)."""
        d = 0 if self.k is None else 2 * storage_bytes(self.k)
        return d, sum(storage_bytes(k) + storage_bytes(v) for k, v in self.host_blocks)

    # -- reading ------------------------------------------------------------------------------------------------
    def resident_view(self, k: torch.Tensor, v: torch.Tensor):
        """Write the canvas k, v (Tensor[B, H, n, D]) after the run and return views of visible past + canvas, or
        None when the layer has host blocks or no room (then read through staging)."""
        n = k.shape[2]
        end = self.off + self.dev_len
        if self.host_len or self.k is None or end + n > self.k.shape[2]:
            return None
        self.k[:, :, end : end + n].copy_(k)
        self.v[:, :, end : end + n].copy_(v)
        lo = end - self.visible_len()
        return self.k[:, :, lo : end + n], self.v[:, :, lo : end + n]

    def run_view(self):
        """(K, V) views of the visible past when it is all resident, else None."""
        if self.host_len or self.k is None:
            return None
        end = self.off + self.dev_len
        lo = end - self.visible_len()
        return self.k[:, :, lo:end], self.v[:, :, lo:end]

    def fill_host(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Copy the visible host-tier tokens into ``dk/dv[:, :, :h]`` (h = visible tokens not in the run).
        Non-blocking from pinned memory: on CUDA the copy is ordered on the current stream."""
        h = self.visible_len() - min(self.visible_len(), self.dev_len)
        pos = h
        for bk, bv in reversed(self.host_blocks):
            if pos <= 0:
                break
            m = bk.shape[2]
            take = min(m, pos)
            dk[:, :, pos - take : pos].copy_(bk[:, :, m - take :], non_blocking=True)
            dv[:, :, pos - take : pos].copy_(bv[:, :, m - take :], non_blocking=True)
            pos -= take
            self.moves.blocks_to_device += 1
            self.moves.bytes_to_device += 2 * take * bk[:, :, :1].numel() * bk.element_size()

    def fill_device(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Copy the visible part of the device run into ``dk/dv[:, :, h:vis]``."""
        vis = self.visible_len()
        r = min(vis, self.dev_len)
        if r:
            end = self.off + self.dev_len
            dk[:, :, vis - r : vis].copy_(self.k[:, :, end - r : end])
            dv[:, :, vis - r : vis].copy_(self.v[:, :, end - r : end])

    # -- writing ------------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append Tensor[B, H, n, D] new tokens, in blocks of ≤ C; sliding layers drop what no window can see."""
        n = k.shape[2]
        if self.meta is None:
            self.meta = (k.shape[0], k.shape[1], k.shape[3], k.dtype)
        if self.keep is not None:
            if n > self.keep:
                k, v, n = k[:, :, n - self.keep :], v[:, :, n - self.keep :], self.keep
                self._drop_front(self.held)
            else:
                self._drop_front(self.held - (self.keep - n))
        for s in range(0, n, self.C):
            self._push(k[:, :, s : s + self.C], v[:, :, s : s + self.C])

    def _push(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        lim = self.cap_limit
        if self.host_len == 0 and (lim is None or self.dev_len + n + self.C <= lim):
            self._room(n + self.C)  # stays fully resident: keep a canvas of room
        elif lim is not None and n <= lim:
            while self.dev_len + n > lim:  # partly offloaded: oldest run blocks go to host
                self._evict()
            self._room(n)
        else:  # cannot be resident at all: straight to host
            while self.dev_blocks:
                self._evict()
            self._to_host(k, v)
            return
        s = self.off + self.dev_len
        self.k[:, :, s : s + n].copy_(k)
        self.v[:, :, s : s + n].copy_(v)
        self.dev_len += n
        self.dev_blocks.append(n)

    def _to_host(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.host_blocks.append((self.host.store(k), self.host.store(v)))
        self.host_len += k.shape[2]
        self.moves.blocks_to_host += 1
        self.moves.bytes_to_host += 2 * k.numel() * k.element_size()

    def _evict(self) -> None:
        """Move the oldest block of the device run to the host tier."""
        m = self.dev_blocks.pop(0)
        self._to_host(self.k[:, :, self.off : self.off + m], self.v[:, :, self.off : self.off + m])
        self.off += m
        self.dev_len -= m
        if not self.dev_len:
            self.off = 0

    def _room(self, need: int) -> None:
        """Make ``off + dev_len + need <= cap``: compact the run to the front, or grow the buffer (within
        ``cap_limit``; the plan guarantees it fits)."""
        if self.k is not None and self.off + self.dev_len + need <= self.cap:
            return
        if self.k is not None and self.dev_len + need <= self.cap:
            self._compact()
            return
        want = self.dev_len + need
        grow = want if self.k is None else max(want, self.cap + self.cap // 2)
        if self.keep is not None:
            grow = max(want, self.keep + 2 * self.C)
        new = -(-max(grow, 2 * self.C) // self.C) * self.C
        if self.cap_limit is not None:
            new = min(new, self.cap_limit)
        self._realloc(new)

    def _compact(self) -> None:
        """Shift the run to offset 0 in non-overlapping chunks (no extra device memory)."""
        s, n = self.off, self.dev_len
        for j in range(0, n, s):
            w = min(s, n - j)
            self.k[:, :, j : j + w].copy_(self.k[:, :, s + j : s + j + w])
            self.v[:, :, j : j + w].copy_(self.v[:, :, s + j : s + j + w])
        self.off = 0

    def _realloc(self, cap: int) -> None:
        b, h, d, dtype = self.meta
        per = b * h * d * dtype.itemsize
        old_k, old_v, n = self.k, self.v, self.dev_len
        bounce = None
        if old_k is not None and not self.dev.fits(2 * cap * per):
            # no room for old + new at once: park the run on the host while the buffer is replaced
            bounce = (old_k[:, :, self.off : self.off + n].cpu(), old_v[:, :, self.off : self.off + n].cpu())
            self.dev.release(old_k, old_v)
            old_k = old_v = None
        k = self.dev.alloc((b, h, cap, d), dtype)
        v = self.dev.alloc((b, h, cap, d), dtype)
        if bounce is not None:
            k[:, :, :n].copy_(bounce[0])
            v[:, :, :n].copy_(bounce[1])
        elif old_k is not None and n:
            k[:, :, :n].copy_(old_k[:, :, self.off : self.off + n])
            v[:, :, :n].copy_(old_v[:, :, self.off : self.off + n])
        if old_k is not None:
            self.dev.release(old_k, old_v)
        self.k, self.v, self.off = k, v, 0

    def _drop_front(self, d: int) -> None:
        """Free the ``d`` oldest tokens (whole host blocks only; the run at token granularity)."""
        while d > 0 and self.host_blocks and self.host_blocks[0][0].shape[2] <= d:
            bk, bv = self.host_blocks.pop(0)
            self.host.release(bk, bv)
            self.host_len -= bk.shape[2]
            d -= bk.shape[2]
            self.moves.blocks_freed += 1
        if d <= 0 or self.host_blocks:
            return
        d = min(d, self.dev_len)
        self.off += d
        self.dev_len -= d
        while d > 0:
            if self.dev_blocks[0] <= d:
                d -= self.dev_blocks.pop(0)
                self.moves.blocks_freed += 1
            else:
                self.dev_blocks[0] -= d
                d = 0
        if not self.dev_len:
            self.off = 0

    def truncate(self, drop: int) -> None:
        """Forget the ``drop`` newest tokens (a partly kept host block is copied so its memory is released)."""
        r = min(drop, self.dev_len)
        self.dev_len -= r
        drop -= r
        while r > 0:
            if self.dev_blocks[-1] <= r:
                r -= self.dev_blocks.pop()
            else:
                self.dev_blocks[-1] -= r
                r = 0
        if not self.dev_len:
            self.off = 0
        while drop > 0 and self.host_blocks:
            bk, bv = self.host_blocks.pop()
            m = bk.shape[2]
            self.host.release(bk, bv)
            self.host_len -= m
            if m > drop:
                self._to_host_kept(bk[:, :, : m - drop], bv[:, :, : m - drop])
            drop -= min(m, drop)

    def _to_host_kept(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.host_blocks.append((self.host.store(k), self.host.store(v)))
        self.host_len += k.shape[2]

    def free(self) -> None:
        """Release everything this layer holds."""
        self.dev.release(self.k, self.v)
        for bk, bv in self.host_blocks:
            self.host.release(bk, bv)
        self.__init__(self.window, self.keep, self.C, self.dev, self.host, self.moves, self.cap_limit)
