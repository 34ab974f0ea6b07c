"""Block KV cache (localdiff/cache/): offload tiers give bit-identical logits and tokens, the device budget holds
at every step (and the accounting equals the tensors' real sizes), multi-turn prefix reuse, flat sliding memory."""

from pathlib import Path

import pytest
import torch

from localdiff.arch.base import BlockCache
from hypothesis import given, settings
from hypothesis import strategies as st

from localdiff.arch.diffusion_gemma import DiffusionGemma, DiffusionGemmaConfig
from localdiff.cache.kv import KVCache, parse_size, plan_capacity
from localdiff.engine import Model
from localdiff.errors import UsageError
from localdiff.events import StepEvent

V = 160


def tiny_model(
    canvas=8,
    window=6,
    seed=0,
    layers=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    device="cpu",
) -> Model:
    """A random-weight DiffusionGemma (sliding + full layers with different head shapes), no tokenizer."""
    cfg = DiffusionGemmaConfig.from_dict(
        dict(
            canvas_length=canvas,
            text_config=dict(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=len(layers),
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                global_head_dim=16,
                num_global_key_value_heads=1,
                sliding_window=window,
                layer_types=list(layers),
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=16,
                max_position_embeddings=1 << 16,
            ),
        )
    )
    torch.manual_seed(seed)
    net = DiffusionGemma(cfg)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(
                1.0 + 0.3 * torch.randn(p.shape) if ("norm" in n or n.endswith("scale")) else 0.1 * torch.randn(p.shape)
            )
    net.to(device).eval().requires_grad_(False)
    return Model(net, cfg, None, Path("."), "test", device, torch.float32, None, {})


class ConcatCache(BlockCache):
    """The oracle: every token of every layer in one tensor, past + canvas concatenated each step, no tiers."""

    def __init__(self, windows):
        self.windows, self.k, self.v = windows, [None] * len(windows), [None] * len(windows)
        self.seq_len, self.batch_size, self.mask, self.token_ids = 0, 0, None, []

    def visible_len(self, i):
        n = 0 if self.k[i] is None else self.k[i].shape[2]
        return n if self.windows[i] is None else min(n, self.windows[i] - 1)

    def past(self, i):
        n = self.visible_len(i)
        return None if not n else (self.k[i][:, :, -n:], self.v[i][:, :, -n:])

    def past_mask(self, i):
        return None if self.mask is None else self.mask[:, self.seq_len - self.visible_len(i) :]

    def with_canvas(self, i, k, v):
        p = self.past(i)
        return (k, v) if p is None else (torch.cat([p[0], k], 2), torch.cat([p[1], v], 2))

    def append(self, i, k, v):
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], 2)
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], 2)

    def reset(self):
        self.__init__(self.windows)

    def commit(self, n, new_mask, b, ids=None):
        if ids is not None:
            self.token_ids = self.token_ids or [[] for _ in range(b)]
            for have, new in zip(self.token_ids, ids.tolist()):
                have.extend(new)
        if new_mask is not None or self.mask is not None:
            old = self.mask if self.mask is not None else torch.ones(b, self.seq_len, dtype=torch.bool)
            nm = new_mask.bool() if new_mask is not None else torch.ones(b, n, dtype=torch.bool)
            self.mask = torch.cat([old, nm], 1)
        self.seq_len += n
        self.batch_size = b

    def truncate(self, n):
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, :n], self.v[i][:, :, :n]
        self.mask = None if self.mask is None else self.mask[:, :n]
        self.seq_len = n
        return True


def check_accounting(cache, budget):
    """Device bytes within the budget (current and peak) and equal to the real sizes of the live tensors."""
    s = cache.stats()
    if budget is not None:
        assert s["device_bytes"] <= budget and s["device_bytes_peak"] <= budget
    for tier in ("device", "host"):
        ts = cache.tensors(tier)
        real = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in ts}.values())
        assert real == s[f"{tier}_bytes"]
        assert all(t.device.type == ("cpu" if tier == "host" else cache.device_tier.device.type) for t in ts)
    layer_dev = sum(cache.layer_nbytes(i)[0] for i in range(len(cache.windows)))
    layer_host = sum(cache.layer_nbytes(i)[1] for i in range(len(cache.windows)))
    assert (layer_dev, layer_host) == (s["device_bytes"], s["host_bytes"])
    return s


def one_block(m) -> int:
    """Bytes of one block (C tokens, K and V) of the first full-attention layer, batch 1, fp32."""
    d, h = m.config.layer_heads[m.config.layer_types.index("full_attention")]
    return m.config.canvas_length * 2 * h * d * 4


def budgets(m):
    return {"unlimited": None, "one block": one_block(m), "zero": 0, "partial": 9 * one_block(m)}


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("0") == 0 and parse_size(4096) == 4096
    assert parse_size("1PiB") == 2**50 and parse_size("2 PB") == 2 * 10**15  # big, but sizes
    assert parse_size("unlimited") is None and parse_size(None) is None
    for bad in ("2 parsecs", "-1", "GiB", "1e9"):
        with pytest.raises(UsageError):
            parse_size(bad)
    for bad in (-1, "-1"):
        with pytest.raises(UsageError):
            parse_size(bad)
    with pytest.raises(UsageError):
        KVCache([None], device_budget_bytes=-1, layer_heads=[(4, 1)])
    with pytest.raises(UsageError):
        KVCache([None], device_budget_bytes=1024)  # a finite budget needs the layer shapes


def test_device_tier_refuses_to_exceed_its_budget():
    from localdiff.cache.tiers import DeviceTier

    tier = DeviceTier(torch.device("cpu"), 100)
    tier.alloc((1, 1, 5, 5), torch.float32)
    assert tier.bytes == tier.peak == 100
    with pytest.raises(RuntimeError):
        tier.alloc((1,), torch.float32)


def test_buffer_growth_under_a_budget_parks_the_run_on_the_host():
    """Growing a resident buffer needs old + new at once; when that does not fit, the run is parked on the host
    while the buffer is replaced, so the device peak never passes the budget."""
    heads, per_token = [(4, 1)], 2 * 1 * 4 * 4
    budget = 40 * per_token
    cache = KVCache([None], block_len=4, device_budget_bytes=budget, layer_heads=heads)
    ora = ConcatCache([None])
    g = torch.Generator().manual_seed(0)
    caps = []
    for _ in range(16):
        k, v = torch.randn(1, 1, 4, 4, generator=g), torch.randn(1, 1, 4, 4, generator=g)
        for c in (cache, ora):
            c.append(0, k, v)
            c.commit(4, None, 1)
        caps.append(cache.layers[0].cap)
        check_accounting(cache, budget)
        ck = torch.randn(1, 1, 4, 4, generator=g)
        assert torch.equal(cache.with_canvas(0, ck, ck)[0], ora.with_canvas(0, ck, ck)[0])
    assert caps[-1] == 40 and sorted(set(caps)) == sorted(set(caps), key=caps.index)  # grew up to the plan
    assert cache.stats()["device_bytes_peak"] == budget
    assert cache.stats()["blocks_host"] == 16 - 10 and cache.stats()["blocks_device"] == 10


def test_plan_capacity_respects_budget_and_prefers_sliding_layers():
    windows, keep, tb = [4, None, 4, None], [11, None, 11, None], [64, 32, 64, 48]
    for budget in (0, 100, 32 * 8, 29 * 64, 29 * 128 + 8 * 80 * 3 + 8 * 32, 10**6):
        caps = plan_capacity(budget, windows, keep, 8, tb)
        assert sum(c * t for c, t in zip(caps, tb)) <= budget
        assert all(c in (0, 11 + 16) for c, w in zip(caps, windows) if w is not None)
        assert all(c % 8 == 0 for c, w in zip(caps, windows) if w is None)
    caps = plan_capacity(29 * 128 + 8 * 80 * 3 + 8 * 32, windows, keep, 8, tb)
    assert caps == [27, 32, 27, 24]  # sliding first, then 3 blocks per full layer, a leftover block to layer 1
    assert plan_capacity(None, windows, keep, 8, tb) == [None] * 4


def _denoise_run(m, cache, prompt, mask=None, n_canvas=4, check=None):
    """Prefill the prompt, then per canvas: two denoise steps (second self-conditioned), prefill the canvas."""
    g = torch.Generator().manual_seed(5)
    m.prefill(prompt, cache, mask)
    out = []
    for _ in range(n_canvas):
        canvas = torch.randint(0, V, (prompt.shape[0], m.config.canvas_length), generator=g)
        lg = m.denoise(canvas, cache)
        out.append(lg)
        out.append(m.denoise(canvas, cache, lg / 0.7))
        if check:
            check(cache)
        m.prefill(lg.argmax(-1), cache)
        if check:
            check(cache)
    return torch.stack(out)


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_bit_identical_for_every_budget(batch):
    m = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (batch, 13), generator=g)  # 13 tokens: blocks of 8 + 5; longer than the window
    mask = None
    if batch == 2:
        mask = torch.ones(2, 13, dtype=torch.bool)
        mask[1, :4] = False
    ref = _denoise_run(m, ConcatCache(m.net.layer_windows()), prompt, mask)
    for name, budget in budgets(m).items():
        cache = m.new_cache(device_budget_bytes=None if budget is None else budget * batch)
        got = _denoise_run(m, cache, prompt, mask, check=lambda c: check_accounting(c, c.budget))
        assert torch.equal(got, ref), name
        s = check_accounting(cache, cache.budget)
        assert s["tokens"] == 13 + 4 * m.config.canvas_length
        if name == "unlimited":
            assert s["host_bytes"] == 0 and s["blocks_to_host"] == 0
        else:  # the tiers were really used: blocks went to the host and were streamed back
            assert s["host_bytes"] > 0 and s["blocks_to_host"] > 0 and s["blocks_to_device"] > 0
        if name == "one block":
            assert s["blocks_device"] == 1 and s["device_bytes"] == one_block(m) * batch
        if name == "partial":  # sliding layers resident, the newest blocks of full layers on device
            assert 0 < s["device_bytes"] and s["blocks_device"] > 2 and s["blocks_host"] > 0


def test_generate_tokens_identical_and_budget_holds_every_step():
    m = tiny_model()
    prompt = torch.randint(3, V, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    kw = dict(max_new_tokens=4 * m.config.canvas_length, seed=123, max_denoising_steps=4, entropy_bound=0.5)
    ref = m.generate(prompt, **kw)
    assert len(ref.token_ids) > 2 * m.config.canvas_length
    for name, budget in budgets(m).items():
        cache = m.new_cache(device_budget_bytes=budget)
        steps = 0
        for ev in m.stream(prompt, cache=cache, **kw):
            if isinstance(ev, StepEvent):
                check_accounting(cache, budget)
                steps += 1
            else:
                final = ev
        assert steps >= 4
        assert final.token_ids == ref.token_ids, name
        assert final.stats.cache["device_bytes_peak"] <= (budget if budget is not None else 1 << 40)
        assert final.stats.cache["tokens"] == cache.seq_len


def test_two_turn_chat_prefills_only_new_tokens():
    m = tiny_model()
    c = m.config.canvas_length
    p1 = torch.randint(3, V, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = dict(seed=7, max_denoising_steps=3, entropy_bound=0.5)
    for budget in (None, 2 * one_block(m)):
        cache = m.new_cache(device_budget_bytes=budget)
        g1 = m.generate(p1, max_new_tokens=2 * c, cache=cache, **kw)
        held = list(cache.token_ids[0])
        assert held[:19] == p1 and len(held) == 19 + c == cache.seq_len  # prompt + the first (prefilled) canvas
        p2 = p1 + g1.token_ids + [5, 6, 7, 8, 9]
        s2 = m.generate(p2, max_new_tokens=c, cache=cache, **kw).stats
        assert s2.prefill_tokens_reused == 19 + c
        assert s2.prefill_tokens_computed == len(p2) - (19 + c)
        assert cache.seq_len == len(p2) and cache.token_ids[0] == p2
        # the reused cache denoises like a cache that prefilled the whole conversation at once (to float rounding)
        fresh = m.new_cache()
        m.prefill(torch.tensor([p2]), fresh)
        canvas = torch.randint(0, V, (1, c), generator=torch.Generator().manual_seed(4))
        assert (m.denoise(canvas, cache) - m.denoise(canvas, fresh)).abs().max() < 1e-4
        check_accounting(cache, budget)
        # an edit near the end (within the sliding slack) truncates at the first difference
        p3 = list(p2)
        p3[-3] = 100
        s3 = m.generate(p3, max_new_tokens=c, cache=cache, **kw).stats
        assert s3.prefill_tokens_reused == len(p2) - 3 and s3.prefill_tokens_computed == 3
        # an edited early turn: sliding layers no longer hold that window, so the cache starts over
        p4 = [99] + p3[1:]
        s4 = m.generate(p4, max_new_tokens=c, cache=cache, **kw).stats
        assert s4.prefill_tokens_reused == 0 and s4.prefill_tokens_computed == len(p4)
        assert cache.seq_len == len(p4)
        check_accounting(cache, budget)


def test_truncate_into_host_blocks_matches_oracle():
    m = tiny_model()
    prompt = torch.randint(3, V, (1, 30), generator=torch.Generator().manual_seed(6))
    canvas = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(8))
    for budget in (None, 0, one_block(m), 9 * one_block(m)):
        ora, cache = ConcatCache(m.net.layer_windows()), m.new_cache(device_budget_bytes=budget)
        for cch in (ora, cache):
            m.prefill(prompt, cch)
            assert cch.truncate(25)  # within the slack: into a block, possibly on the host
            m.prefill(prompt[:, :3], cch)  # 28 tokens again
        assert torch.equal(m.denoise(canvas, cache), m.denoise(canvas, ora))
        assert not cache.truncate(5) and cache.seq_len == 28  # too far back for the sliding layers: unchanged
        check_accounting(cache, budget)
        cache.reset()
        assert cache.seq_len == 0 and cache.stats()["device_bytes"] == 0 and cache.stats()["host_bytes"] == 0


@pytest.mark.parametrize("budget", [None, 0])
def test_sliding_layer_memory_flat_to_4k_tokens(budget):
    m = tiny_model(canvas=128, window=16)
    cache = m.new_cache(device_budget_bytes=budget)
    sliding = [i for i, w in enumerate(cache.windows) if w is not None]
    full = [i for i, w in enumerate(cache.windows) if w is None]
    g = torch.Generator().manual_seed(9)
    sizes, full_sizes = [], []
    while cache.seq_len < 4096 + 128:
        m.prefill(torch.randint(0, V, (1, 128), generator=g), cache)
        sizes.append([sum(cache.layer_nbytes(i)) for i in sliding])
        full_sizes.append(sum(sum(cache.layer_nbytes(i)) for i in full))
        assert all(cache.layers[i].held <= 15 + 128 + 128 for i in sliding)  # window - 1 + slack (+ a block)
    assert sizes[2:] == [sizes[2]] * len(sizes[2:])  # flat once the window (plus slack) is full
    assert all(cache.layers[i].held == cache.seq_len for i in full)  # full layers keep everything
    assert full_sizes[-1] >= cache.seq_len * sum(2 * 16 * 4 for _ in full) > 10 * full_sizes[1]
    assert cache.stats()["blocks_freed"] >= len(sliding) * 30
    check_accounting(cache, budget)
    assert all(cache.visible_len(i) == 15 for i in sliding)
    assert cache.past(full[0])[0].shape[2] == cache.seq_len


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["append", "truncate", "read"]), st.integers(1, 23)), min_size=1, max_size=14),
    st.sampled_from([None, 0, 1, 3, 7, 40]),
)
def test_cache_reads_equal_oracle_under_random_operations(ops, budget_tokens):
    """Appends of any length, truncations and reads, per budget: every read equals a plain concatenation."""
    windows, heads = [5, None, None], [(4, 2), (6, 1), (4, 3)]
    tok = [2 * h * d * 4 for d, h in heads]
    budget = None if budget_tokens is None else budget_tokens * 4 * tok[1]
    cache = KVCache(windows, slack=4, block_len=4, device_budget_bytes=budget, layer_heads=heads)
    ora = ConcatCache(windows)
    g = torch.Generator().manual_seed(len(ops))
    for op, n in ops:
        if op == "append":
            for i, (d, h) in enumerate(heads):
                k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
                cache.append(i, k, v)
                ora.append(i, k, v)
            mask = torch.rand(1, n, generator=g) > 0.2 if n % 3 == 0 else None  # some appends carry padding
            cache.commit(n, mask, 1)
            ora.commit(n, mask, 1)
        elif op == "truncate":
            t = max(cache.seq_len - n, 0)
            if cache.truncate(t):
                ora.truncate(t)
            else:
                assert cache.seq_len == ora.seq_len
        for i, (d, h) in enumerate(heads):
            assert cache.visible_len(i) == ora.visible_len(i)
            pm, qm = cache.past_mask(i), ora.past_mask(i)
            assert (pm is None and (qm is None or bool(qm.all()))) or torch.equal(pm, qm)
            ck, cv = torch.randn(1, h, 3, d, generator=g), torch.randn(1, h, 3, d, generator=g)
            a, b = cache.with_canvas(i, ck, cv), ora.with_canvas(i, ck, cv)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            p, q = cache.past(i), ora.past(i)
            assert (p is None) == (q is None) and (p is None or torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]))
        check_accounting(cache, budget)


class _StandInStream:
    def wait_event(self, ev):
        pass

    def synchronize(self):
        pass


class _StandInEvent:
    def record(self, stream=None):
        pass


def test_prefetch_schedule_keeps_slots_apart(monkeypatch):
    """The CUDA prefetch path (copy the next offloaded layer into the other staging slot while this one computes)
    driven on the CPU with stand-in streams: copies run at once, so a prefetch into the slot still being read
    would change the logits."""
    import contextlib

    import localdiff.cache.kv as cache_mod

    class CudaLikeStaging(cache_mod.Staging):
        def __init__(self, device):
            super().__init__(device)
            self.cuda, self.stream = True, _StandInStream()

    monkeypatch.setattr(cache_mod, "Staging", CudaLikeStaging)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StandInStream())
    monkeypatch.setattr(torch.cuda, "Event", _StandInEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    m = tiny_model(
        layers=("sliding_attention", "full_attention", "full_attention", "sliding_attention", "full_attention")
    )
    prompt = torch.randint(3, V, (1, 19), generator=torch.Generator().manual_seed(3))
    ref = _denoise_run(m, ConcatCache(m.net.layer_windows()), prompt, n_canvas=3)
    for budget in (0, one_block(m), 12 * one_block(m)):
        cache = m.new_cache(device_budget_bytes=budget)
        assert torch.equal(_denoise_run(m, cache, prompt, n_canvas=3), ref)
        s = cache.stats()
        assert s["prefetched_reads"] > 0 and s["blocks_to_device"] > 0
        assert len(cache.staging.slots) >= 2  # two parities in use


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_bit_identical_with_pinned_host_tier():
    m = tiny_model(device="cuda")
    prompt = torch.randint(3, V, (1, 29), generator=torch.Generator().manual_seed(1)).cuda()
    ref = _denoise_run(m, m.new_cache(), prompt, n_canvas=5)
    for budget in (0, one_block(m), 9 * one_block(m)):
        cache = m.new_cache(device_budget_bytes=budget)
        got = _denoise_run(m, cache, prompt, n_canvas=5, check=lambda c: check_accounting(c, c.budget))
        assert torch.equal(got, ref)
        assert all(t.is_pinned() for t in cache.tensors("host"))
        s = cache.stats()
        assert s["prefetched_reads"] > 0 and s["blocks_to_device"] > 0
