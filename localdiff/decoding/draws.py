"""One categorical draw per row, equal to ``torch.multinomial(probs, 1, generator=g)`` on the CPU — same token, same
generator state afterwards — but several times faster on wide vocabularies.

torch 2.x draws one sample as ``argmax(p / q)`` with ``q ~ Exp(1)`` (the exponential-race form of the Gumbel-max
trick; ATen ``multinomial``), and its CPU ``exponential_`` is a serial loop over the generator: per element two
32-bit MT19937 outputs make a 53-bit uniform ``u`` and ``q = float32(-log1p(-u))``, about 15 ns each. A canvas of
256 positions over a 262k vocabulary is 67 M draws, about 1 s per denoising step. Here the MT19937 words come from
numpy's ``MT19937`` bit generator loaded with the torch generator's state (the same recurrence, vectorised), the
transform runs vectorised, and the generator is advanced by exactly the words used.

Exactness: ``q`` must round to the same float32. Values whose double lies within a few ulp of a float32 rounding
boundary are recomputed with the C library's ``log1p`` (what ATen calls); a one-time self-check against
``torch.multinomial`` on a cloned generator guards the state layout; on any mismatch, or on non-CPU tensors, torch's
own ``multinomial`` is used.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import torch

_N = 624  # MT19937 state words
_LEFT, _NEXT, _KEY = 8, 16, 24  # byte offsets in torch's CPU generator state (legacy THGeneratorState layout)
_HI21 = np.uint64((1 << 21) - 1)  # the first word's bits that survive the 53-bit mask
_LOW29 = np.uint64((1 << 29) - 1)
_MIN_FAST = 4096  # below this torch's own loop is as fast
_CHUNK = 1 << 18  # elements per chunk (work buffers of ~6 MB)
_MID_LO, _MID_SPAN = np.uint64((1 << 28) - 16), np.uint64(32)  # ±16 ulp around the float32 rounding midpoint
_fast_ok: bool | None = None  # result of the one-time self-check (None = not run yet)


class _MT:
    """A numpy MT19937 bit generator whose state (624 key words + position) is read and written in place through
    its ctypes state address (numpy's ``mt19937_state`` struct), one per thread."""

    def __init__(self):
        self.bg = np.random.MT19937(0)
        self.view = np.ctypeslib.as_array((ctypes.c_uint32 * (_N + 1)).from_address(self.bg.ctypes.state_address))

    def load(self, state: np.ndarray) -> None:
        """Position it where the torch CPU generator whose ``get_state()`` bytes are ``state`` is."""
        left = int(state[_LEFT : _LEFT + 4].view(np.int32)[0])
        nxt = int(state[_NEXT : _NEXT + 8].view(np.uint64)[0])
        self.view[:_N] = state[_KEY : _KEY + 8 * _N].view(np.uint64)
        self.view[_N] = _N if left == 1 else nxt

    def store(self, state: np.ndarray) -> torch.Tensor:
        """``state`` with the MT19937 part replaced by this generator's, as a ByteTensor for ``set_state``."""
        out = state.copy()
        pos = int(self.view[_N])
        out[_KEY : _KEY + 8 * _N].view(np.uint64)[:] = self.view[:_N]
        out[_LEFT : _LEFT + 4].view(np.int32)[0] = _N + 1 - pos
        out[_NEXT : _NEXT + 8].view(np.uint64)[0] = pos
        return torch.from_numpy(out)


_local = threading.local()


def _exponentials(bg: np.random.MT19937, n: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (float32[n]) with Exp(1) variates exactly as ATen's CPU ``exponential_`` makes them from the same
    MT19937 words: ``float32(-log1p(-u))``, ``u = (((w0 << 32) | w1) & (2^53 - 1)) * 2^-53``. Works in chunks
    through reused buffers (fresh multi-MB arrays cost more in page faults than the arithmetic)."""
    for s in range(0, n, _CHUNK):
        m = min(_CHUNK, n - s)
        bits, f, low, near = (t[:m] for t in _buffers(m))
        raw = bg.random_raw(2 * m).reshape(m, 2)
        np.bitwise_and(raw[:, 0], _HI21, out=bits)
        np.left_shift(bits, np.uint64(32), out=bits)
        np.bitwise_or(bits, raw[:, 1], out=bits)
        np.multiply(bits, -(2.0**-53), out=f, casting="unsafe")  # exact: < 2^53, times a power of two
        np.log1p(f, out=f)
        # float32 rounding reads the low 29 mantissa bits; numpy's log1p may differ from the C library's (which ATen
        # calls) by an ulp, which matters only within a few ulp of the rounding midpoint: recompute those with it
        np.bitwise_and(f.view(np.uint64), _LOW29, out=low)
        np.subtract(low, _MID_LO, out=low)
        np.less(low, _MID_SPAN, out=near)
        for i in np.flatnonzero(near):
            f[i] = math.log1p(-float(bits[i]) * 2.0**-53)
        np.negative(f, out=out[s : s + m], casting="same_kind")
    return out


def _buffers(m: int) -> tuple:
    """This thread's work buffers (uint64, float64, uint64, bool) of at least m elements."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf[0].shape[0] < m:
        buf = _local.buf = (
            np.empty(m, np.uint64),
            np.empty(m, np.float64),
            np.empty(m, np.uint64),
            np.empty(m, np.bool_),
        )
    return buf


def _fast(probs: torch.Tensor, generator: torch.Generator, rows: torch.Tensor | None = None) -> torch.Tensor:
    mt = getattr(_local, "mt", None)
    if mt is None:
        mt = _local.mt = _MT()
    state = generator.get_state().numpy()
    mt.load(state)
    if rows is None:
        q = torch.empty(probs.shape, dtype=torch.float32)
        _exponentials(mt.bg, probs.numel(), q.view(-1).numpy())
        generator.set_state(mt.store(state))
        return torch.div(probs, q).argmax(-1, keepdim=True)
    out = torch.zeros(probs.shape[0], 1, dtype=torch.long)
    need = torch.nonzero(rows.reshape(-1).cpu()).view(-1).tolist()
    v, done = probs.shape[1], 0
    q = torch.empty(v, dtype=torch.float32)
    for r in need:  # the words of the rows before r are drawn (the state advances) but never transformed
        if r > done:
            _skip_words(mt.bg, 2 * v * (r - done))
        _exponentials(mt.bg, v, q.numpy())
        out[r, 0] = torch.div(probs[r], q).argmax()
        done = r + 1
    if probs.shape[0] > done:
        _skip_words(mt.bg, 2 * v * (probs.shape[0] - done))
    generator.set_state(mt.store(state))
    return out


def _skip_words(bg: np.random.MT19937, n: int) -> None:
    """Advance ``bg`` by n 32-bit words (generated in chunks and dropped: MT19937 has no cheap jump by n)."""
    while n > 0:
        m = min(n, 4 * _CHUNK)
        bg.random_raw(m)
        n -= m


def _self_check() -> bool:
    """Whether the fast path reproduces torch.multinomial here (token ids and generator state)."""
    try:
        g = torch.Generator().manual_seed(20261129)
        torch.randint(0, 7, (3,), generator=g)  # start mid-block
        p = torch.softmax(torch.randn(9, 700, generator=g), -1)
        a, b = torch.Generator(), torch.Generator()
        a.set_state(g.get_state())
        b.set_state(g.get_state())
        ours = [_fast(p, a) for _ in range(3)]  # crosses a 624-word block boundary
        theirs = [torch.multinomial(p, 1, generator=b) for _ in range(3)]
        return all(torch.equal(x, y) for x, y in zip(ours, theirs)) and torch.equal(a.get_state(), b.get_state())
    except Exception:
        return False


def categorical(
    probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None, valid: bool = False
) -> torch.Tensor:
    """One draw per row of ``probs``: FloatTensor[N, V] (non-negative, finite) → LongTensor[N, 1].

    ``rows`` (BoolTensor[N] or None = all): the rows whose draw is read. The others' random numbers are still
    drawn in order — the generator ends in the same state and the read rows get the same tokens as a full draw —
    but never transformed (the exponential transform is most of the cost); their entries are 0 on the fast path
    (torch's fallback draws every row). ``valid``: the caller made ``probs`` as a softmax of finite values, so the
    three vocabulary-sized validity passes are skipped.

    Equals ``torch.multinomial(probs, 1, generator=generator)`` token for token and leaves ``generator`` in the same
    state (see the module docstring); falls back to it for non-CPU, non-fp32 or non-contiguous tensors, fewer than
    4096 elements, without a generator, for invalid probabilities (inf / NaN / negative entries or a row summing
    to 0, so torch raises its usual error), or when the one-time self-check failed. Reading, advancing and writing
    back the generator state is not atomic: a generator shared by threads needs the caller's lock.
    """
    global _fast_ok
    if (
        generator is None
        or probs.device.type != "cpu"
        or generator.device.type != "cpu"
        or probs.dtype != torch.float32
        or probs.dim() != 2
        or probs.numel() < _MIN_FAST
        or not probs.is_contiguous()
    ):  # torch draws into empty_like(probs): its layout orders the draws
        return torch.multinomial(probs, 1, generator=generator)
    if _fast_ok is None:
        _fast_ok = _self_check()
    if not _fast_ok or not (
        valid or bool(((probs.max() < math.inf) & (probs.min() >= 0) & (probs.sum(-1) > 0).all()).item())
    ):
        return torch.multinomial(probs, 1, generator=generator)
    if rows is not None and 2 * int(rows.sum()) > rows.numel():
        rows = None  # most rows are read: one vectorised pass over all is faster
    return _fast(probs, generator, rows)


def uniform_rows(
    shape: tuple[int, int, int], lo: int, hi: int, generator: torch.Generator | None, device
) -> torch.Tensor:
    """Rows ``lo:hi`` (dim 1) of ``torch.rand(shape, dtype=float64, generator=generator, device=device)`` —
    FloatTensor[B, hi − lo, V], float64 — leaving ``generator`` where that whole draw leaves it.

    On the CPU torch's ``uniform_`` is a serial loop over the generator (two MT19937 words per float64, in memory
    order), so a draw split into consecutive pieces gives the same numbers: the rows outside ``lo:hi`` are drawn
    into a reused buffer of at most 8 MB and dropped, never held whole. Elsewhere (CUDA's Philox: a value depends
    on the whole draw's shape) the whole tensor is drawn and sliced: B·T·V·8 bytes.
    """
    b, t, v = shape
    dev = torch.device(device)
    if dev.type != "cpu":
        return torch.rand(shape, dtype=torch.float64, generator=generator, device=dev)[:, lo:hi]
    out = torch.empty(b, hi - lo, v, dtype=torch.float64)
    buf = torch.empty(min(max(lo, t - hi) * v, 1 << 20), dtype=torch.float64)
    for r in range(b):
        _drop(buf, lo * v, generator)
        out[r].uniform_(generator=generator)
        _drop(buf, (t - hi) * v, generator)
    return out


def _drop(buf: torch.Tensor, n: int, generator: torch.Generator | None) -> None:
    """Advance ``generator`` by ``n`` float64 uniforms (drawn into ``buf`` piece by piece and dropped)."""
    while n > 0:
        m = min(n, buf.numel())
        buf[:m].uniform_(generator=generator)
        n -= m
