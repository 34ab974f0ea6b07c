"""Speed work that must not change results (issue #24): skipped vocab-sized work gives the same tokens, the cached
chat template renders the same text, the bf16 expert kernel stays within bf16 rounding, and the default compute
dtype follows the detected CPU capability and the model."""

from __future__ import annotations

import pytest
import torch

import localdiff
from localdiff import capability


@pytest.mark.parametrize("rows,vocab,frac,seed", [(16, 5000, 0.2, 0), (9, 4096, 0.0, 1), (40, 700, 0.45, 2)])
def test_draws_of_unread_rows_are_skipped_exactly(rows, vocab, frac, seed):
    """categorical(p, g, rows): the read rows get the tokens of the full draw (= torch.multinomial) and the generator
    ends in the same state, over consecutive draws."""
    from localdiff.decoding import categorical

    g = torch.Generator().manual_seed(seed)
    ours, theirs = torch.Generator(), torch.Generator()
    ours.set_state(g.get_state())
    theirs.set_state(g.get_state())
    for step in range(4):
        p = torch.softmax(torch.randn(rows, vocab, generator=g) * (0.5, 4.0)[step % 2], -1)
        read = torch.rand(rows, generator=g) < frac
        if step == 1:
            read[-1] = True
        a = categorical(p, ours, read)
        b = torch.multinomial(p, 1, generator=theirs)
        assert torch.equal(a[read], b[read])
        assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("opts", [{}, {"threshold": 0.5}, {"threshold": 0.3, "correction": True}])
def test_canvas_tokens_same_with_skipped_draws(ref_small, opts, monkeypatch):
    """The canvas decoder reads the draft only where it accepts: tokens equal those of drawing every position (the
    reference's sampler), with locking and the correction too."""
    from localdiff.decoding import canvas_eb, draws

    m = localdiff.load(ref_small[1], device="cpu")
    kw = dict(max_new_tokens=2 * m.config.canvas_length, max_denoising_steps=6, entropy_bound=0.5, chat=False, **opts)
    fast = [m.generate([5, 6, 7 + s], seed=s, **kw).token_ids for s in range(3)]
    full = lambda p, g, rows=None, valid=False: draws.categorical(p, g)  # noqa: E731 — every row drawn, transformed
    monkeypatch.setattr(canvas_eb, "categorical", full)
    slow = [m.generate([5, 6, 7 + s], seed=s, **kw).token_ids for s in range(3)]
    assert fast == slow


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_masked_head_skip_gives_identical_tokens(family, tmp_path, monkeypatch):
    """The masked loop's LM head runs only on still-masked rows of the block: same tokens with and without the skip,
    for each cache mode, LLaDA (greedy, sampled, threshold) and Dream (entropy, origin sampled) decoders."""
    import dataclasses

    from masked_ref import MASK, write_upstream

    from localdiff.decoding import masked_loop
    from localdiff.decoding.dream import Dream
    from localdiff.decoding.llada import LLaDA
    from localdiff.decoding.options import DreamOptions, LLaDAOptions
    from localdiff.decoding.request import Request
    from localdiff.loader import load_model

    write_upstream(family, tmp_path)
    net, _ = load_model(tmp_path, dtype=torch.float32)
    assert net.selects_rows
    prompt = torch.randint(0, MASK - 2, (2, 7), generator=torch.Generator().manual_seed(0))
    if family == "llada":
        cases = [
            (LLaDA, LLaDAOptions(steps=24, block_length=12)),
            (LLaDA, LLaDAOptions(steps=12, block_length=12, temperature=0.7)),
            (LLaDA, LLaDAOptions(steps=24, block_length=24, threshold=0.05)),
        ]
    else:
        cases = [
            (Dream, DreamOptions(steps=12, block_length=12, alg="entropy")),
            (Dream, DreamOptions(steps=12, block_length=24, alg="origin", temperature=0.5)),
        ]

    def tokens(cls, o, cache):
        pol = cls(o, torch.Generator().manual_seed(3), MASK)
        req = Request(
            options=dataclasses.replace(o, kv_cache=cache),
            ids=prompt,
            max_new_tokens=24,
            mask_id=MASK,
            emit_steps=False,
        )
        evs = list(masked_loop.run(net, pol, req))
        return evs[-1].token_ids, evs[-1].stats.forwards

    for cls, o in cases:
        for cache in ("none", "prefix", "dual"):
            monkeypatch.setattr(masked_loop, "SKIP_COMMITTED", True)
            a = tokens(cls, o, cache)
            monkeypatch.setattr(masked_loop, "SKIP_COMMITTED", False)
            b = tokens(cls, o, cache)
            assert a == b, (cls.__name__, o, cache)


def test_head_rows_pads_small_selections():
    from localdiff.arch.masked import head_rows

    sel = torch.zeros(2, 12, dtype=torch.bool)
    sel[1, 3] = True
    out = head_rows(sel, 16)
    assert int(out.sum()) == 16 and bool(out[1, 3]) and bool(out[0].all())
    big = torch.ones(2, 12, dtype=torch.bool)
    assert head_rows(big, 16) is big


def test_stream_experts_within_bf16_rounding():
    """The bf16 weight-streaming expert kernel is as close to the fp32 result as the grouped_mm path is (both bf16),
    empty experts included."""
    from localdiff.arch.layers import MoEExperts

    torch.manual_seed(0)
    moe = MoEExperts(8, 64, 32)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.1)
        moe.down_proj.normal_(0, 0.1)
    x = torch.randn(37, 64)
    index = torch.randint(0, 6, (37, 3))
    weights = torch.rand(37, 3)
    b16 = MoEExperts(8, 64, 32).to(torch.bfloat16)
    with torch.no_grad():
        b16.gate_up_proj.copy_(moe.gate_up_proj)
        b16.down_proj.copy_(moe.down_proj)
        exact = moe(x, weights, index)
        xb = x.bfloat16()
        stream = b16(xb, weights, index).float()
        b16.kernel = "grouped"
        grouped = b16(xb, weights, index).float()
    err_s, err_g = (stream - exact).abs().max(), (grouped - exact).abs().max()
    assert err_s <= 2 * err_g + 1e-3 and err_s < 0.05 * exact.abs().max()


def test_stream_experts_padding_never_reaches_the_output(monkeypatch):
    """The zero-padded groups are left uninitialised: filled with NaN instead, the result is bit-identical to a
    zero-padded transcription of the same products (an output column depends on its own input column only)."""
    import torch.nn.functional as F

    from localdiff.arch.layers import gelu_tanh, stream_experts

    g = torch.Generator().manual_seed(1)
    e, h, i, n, k = 6, 48, 16, 23, 2
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=g) * 0.1).bfloat16()
    flat = torch.randint(0, e - 1, (n * k,), generator=g)  # expert e - 1 gets no rows
    order = torch.argsort(flat, stable=True)
    xs = torch.randn(n, h, generator=g).bfloat16()[order // k]
    w = torch.rand(n * k, generator=g)
    want = []
    for r in range(n * k):  # one row at a time, no padding at all
        ex = int(flat[order[r]])
        gate, up = F.linear(xs[r : r + 1], gate_up[ex]).chunk(2, -1)
        want.append(F.linear(gelu_tanh(gate) * up * w[order][r].bfloat16(), down[ex]))
    plain = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: plain(self, *a, **kw).fill_(float("nan")))
    got = stream_experts(xs, flat, order, gate_up, down, w[order])
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), torch.cat(want).float(), rtol=0.02, atol=2e-3)


def test_chat_template_compiled_once_per_text():
    m = localdiff.load("tiny")
    tok = m.tokenizer
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    first = tok.apply_chat_template(msgs)
    compiled = tok._template[1]
    assert tok.apply_chat_template(msgs) == first and tok._template[1] is compiled
    tok.chat_template = "<{{ messages[0].content }}>"
    assert tok.apply_chat_template(msgs) == "<What is 2 + 3?>"


def test_default_dtype_rules(monkeypatch):
    """bf16 only with bf16 instructions, a measured speed-up and a large or 16-bit-stored model; fp32 otherwise."""
    monkeypatch.setattr(capability, "torch_capability", lambda: "AVX512")
    monkeypatch.setattr(capability, "bf16_instructions", lambda flags=None: [])
    assert capability.choose_cpu_dtype("bfloat16", 10**9).dtype == "float32"
    monkeypatch.setattr(capability, "bf16_instructions", lambda flags=None: ["amx_bf16"])
    monkeypatch.setattr(capability, "matmul_rates", lambda refresh=False: {"float32": 100.0, "bfloat16": 600.0})
    assert capability.choose_cpu_dtype("float32", 3_400_000).dtype == "float32"  # tiny: kept exact
    assert capability.choose_cpu_dtype("bfloat16", 3_400_000).dtype == "bfloat16"
    assert capability.choose_cpu_dtype("float32", 200_000_000).dtype == "bfloat16"
    monkeypatch.setattr(capability, "matmul_rates", lambda refresh=False: {"float32": 100.0, "bfloat16": 120.0})
    p = capability.choose_cpu_dtype("bfloat16", 10**9)
    assert p.dtype == "float32" and "1.2x" in p.reason


def test_flags_parsed_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    flags = capability.cpu_flags(f)
    assert capability.bf16_instructions(flags) == ["avx512_bf16", "amx_bf16"]
    assert capability.bf16_instructions(frozenset({"avx2", "fma"})) == []
    assert capability.cpu_flags(tmp_path / "missing") == frozenset()


def test_tiny_stays_fp32_and_dtype_is_one_setting_away(monkeypatch):
    m = localdiff.load("tiny")
    assert m.dtype == torch.float32 and m.precision.dtype == "float32" and m.kernels()["dtype"] == "float32"
    monkeypatch.setenv("LOCALDIFF_DTYPE", "bfloat16")
    assert localdiff.load("tiny").dtype == torch.bfloat16
    monkeypatch.setenv("LOCALDIFF_DTYPE", "fp8")
    with pytest.raises(localdiff.errors.UsageError, match="LOCALDIFF_DTYPE"):
        localdiff.load("tiny")


def test_topk_self_conditioning_is_opt_in_and_converges():
    """sc_topk=None is the exact product (bit for bit the reference's softmax(sc) @ E); top-k renormalises over the
    k largest logits, equals the exact product when one token holds all the mass, and its error shrinks with k."""
    from localdiff.arch.soft_embedding import soft_embedding

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 24, generator=g)
    sc = torch.randn(2, 5, 300, generator=g) * 3
    exact = soft_embedding(sc, w)
    assert torch.equal(exact, torch.softmax(sc, -1, dtype=torch.float32) @ w)
    errs = [(soft_embedding(sc, w, k) - exact).abs().max() for k in (4, 32, 128, 299)]
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-4
    peaked = torch.full((1, 2, 300), -1e4)
    peaked[0, 0, 7] = peaked[0, 1, 9] = 0.0
    assert torch.allclose(soft_embedding(peaked, w, 2), w[[7, 9]][None], atol=1e-6)
    assert localdiff.load("tiny").net.sc_topk is None
