"""A small bidirectional transformer implementing the masked family's model contract (``localdiff.arch.base``
roles ``logits`` + ``window``), for decoder tests that must not depend on the real architectures.

Two layers, RoPE plus a sinusoidal absolute position term (so the answer's masks get different predictions;
positions count from the first real token, so a left-padded row equals its unpadded run), grouped K/V heads,
odd sizes, random weights (scaled so the logits are spread: confidences vary and
threshold decoding commits several tokens per step). ``forward_window`` follows the contract exactly: queries = the
window's tokens at positions start..start+n-1; keys/values = kv before start, the window's fresh K/V, kv from
start+n on (K stored after RoPE); ``attention_mask`` = key padding over the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from localdiff.arch.base import ROLE_LOGITS, ROLE_WINDOW


@dataclass(frozen=True)
class FakeMaskedConfig:
    vocab_size: int = 37
    hidden: int = 30
    heads: int = 3
    kv_heads: int = 1
    head_dim: int = 10
    layers: int = 2
    max_position_embeddings: int = 512
    mask_token_id: int = 36
    eos_token_id: tuple = (2,)
    pad_token_id: int | None = 0
    model_type: str = "fake_llada"
    shift_logits: bool = False
    raw: dict = field(default_factory=dict)


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [B, H, n, D] at positions ``pos`` [B, n] (half-split layout)."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = (pos.float()[..., None] * inv)[:, None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class FakeMaskedNet(nn.Module):
    roles = frozenset({ROLE_LOGITS, ROLE_WINDOW})

    def __init__(
        self, cfg: FakeMaskedConfig | None = None, seed: int = 0, scale: float = 3.0, mask_bias: float = -40.0
    ):
        super().__init__()
        self.config = cfg or FakeMaskedConfig()
        c = self.config
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(c.vocab_size, c.hidden, generator=g))
        hd = c.heads * c.head_dim
        kvd = c.kv_heads * c.head_dim
        self.blocks = nn.ParameterList()
        for _ in range(c.layers):
            for shape in (
                (hd, c.hidden),
                (kvd, c.hidden),
                (kvd, c.hidden),
                (c.hidden, hd),
                (2 * c.hidden, c.hidden),
                (c.hidden, 2 * c.hidden),
            ):
                self.blocks.append(nn.Parameter(torch.randn(*shape, generator=g) / shape[1] ** 0.5))
        self.head = nn.Parameter(scale * torch.randn(c.vocab_size, c.hidden, generator=g) / c.hidden**0.5)
        self.bias = torch.zeros(c.vocab_size)
        self.bias[c.mask_token_id] = mask_bias  # trained models never predict the mask token
        self.windows: list[tuple[int, int, bool]] = []  # (start, n, with kv) per forward: tests read it

    @property
    def shift_logits(self) -> bool:
        return self.config.shift_logits

    @torch.no_grad()
    def logits_full(self, input_ids, attention_mask=None):
        return self.forward_window(input_ids, 0, None, attention_mask)

    @torch.no_grad()
    def forward_window(self, input_ids, start=0, kv=None, attention_mask=None, return_kv=False):
        c = self.config
        b, n = input_ids.shape
        self.windows.append((start, n, kv is not None))
        pads = (~attention_mask.bool()).sum(1, keepdim=True) if attention_mask is not None else 0
        pos = torch.arange(start, start + n)[None, :] - pads  # positions counted from the first real token
        inv = 1.0 / 10.0 ** (torch.arange(0, c.hidden, 2, dtype=torch.float32) / c.hidden)
        ang = pos.float()[..., None] * inv
        h = self.embed[input_ids] + torch.cat([ang.sin(), ang.cos()], -1)[..., : c.hidden]
        keymask = None
        if attention_mask is not None:
            m = attention_mask.bool()
            if kv is None:
                m = m[:, start : start + n]
            keymask = m[:, None, None, :]
        fresh = []
        for layer in range(c.layers):
            wq, wk, wv, wo, w1, w2 = self.blocks[6 * layer : 6 * layer + 6]
            a = nn.functional.layer_norm(h, (c.hidden,))
            q = (a @ wq.T).view(b, n, c.heads, c.head_dim).transpose(1, 2)
            k = (a @ wk.T).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
            v = (a @ wv.T).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
            q, k = _rope(q, pos), _rope(k, pos)
            fresh.append((k, v))
            if kv is not None:
                kc, vc = kv[layer]
                k = torch.cat([kc[:, :, :start], k, kc[:, :, start + n :]], dim=2)
                v = torch.cat([vc[:, :, :start], v, vc[:, :, start + n :]], dim=2)
            rep = c.heads // c.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = q @ k.transpose(-1, -2) / c.head_dim**0.5
            if keymask is not None:
                s = s.masked_fill(~keymask, float("-inf"))
            o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
            h = h + o @ wo.T
            h = h + torch.nn.functional.gelu(nn.functional.layer_norm(h, (c.hidden,)) @ w1.T) @ w2.T
        logits = (nn.functional.layer_norm(h, (c.hidden,)) @ self.head.T + self.bias).float()
        return (logits, fresh) if return_kv else logits


class CharTok:
    """A tokenizer for the fake model: each character one id in 3..35 (EOS 2 and the mask 36 never produced)."""

    def encode(self, text):
        return [3 + ord(ch) % 33 for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x41 + (int(i) - 3)) for i in ids if 3 <= int(i) < 36)


def fake_model(monkeypatch, tmp_path, seed: int = 0, scale: float = 3.0, tokenizer=None, **over):
    """A localdiff ``Model`` over a :class:`FakeMaskedNet` (fp32, CPU) registered as a masked-family model_type for the
    test (``monkeypatch``); ``over`` replaces fields of the config (by default no EOS and no pad token)."""
    import dataclasses

    from localdiff.arch import REGISTRY, ArchEntry
    from localdiff.engine import Model

    cfg = dataclasses.replace(FakeMaskedConfig(eos_token_id=(), pad_token_id=None), **over)
    monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
    return Model(
        FakeMaskedNet(cfg, seed=seed, scale=scale), cfg, tokenizer, tmp_path, "fake", "cpu", torch.float32, None, {}
    )
