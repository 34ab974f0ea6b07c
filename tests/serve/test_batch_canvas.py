"""Step-level batching of the canvas family (localdiff.engine.batch_canvas, localdiff.arch.packed_canvas): the
packed DiffusionGemma forward equals each call's own ``denoise`` bit for bit (fused prefill rows, self-conditioning
logits or probabilities, raw logits, different histories), really shares its matmuls and expert calls, and every
request of a batch — 2, 3 and 8 of them, different prompts, arrival steps, max_tokens, seeds, temperatures (the
canvas sampler has no temperature 0) and options, one cancelled mid-way — gets the tokens it gets alone, in process
and through ``serve`` with the openai client."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from batch_lanes import alone, batched
from servehelpers import Running

import localdiff
from localdiff.arch import packed_canvas
from localdiff.arch.soft_embedding import Probabilities, RawLogits
from localdiff.engine import Model
from localdiff.engine.batch import batchable
from localdiff.engine.batch_canvas import CanvasRowPolicy

PROMPTS = [
    "What is 41 + 93?",
    "Tell me a story about a cat that",
    "hi",
    "Count: 1 2 3 4 5 6 7",
    "Spell the word banana backwards, please",
    "2 * 7 =",
    "Name three colours.",
    "abc",
]
#: odd sizes everywhere: canvas 11, 7 experts top-3, a sliding window shorter than the histories
ODD = {
    "model_type": "diffusion_gemma",
    "canvas_length": 11,
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "text_config": dict(
        vocab_size=365,
        hidden_size=52,
        intermediate_size=76,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=12,
        global_head_dim=20,
        num_global_key_value_heads=1,
        sliding_window=13,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_experts=7,
        top_k_experts=3,
        moe_intermediate_size=20,
        max_position_embeddings=1024,
        eos_token_id=1,
        pad_token_id=0,
    ),
}
_MODELS: dict = {}


def odd_model(dtype=torch.float32) -> Model:
    """A random DiffusionGemma with :data:`ODD` sizes (fused projections, as ``localdiff.load`` makes them) and the
    embedded model's tokenizer; no EOS, so every request decodes its ``max_new_tokens``."""
    if dtype not in _MODELS:
        from localdiff.arch import get_arch, get_spec

        net = get_arch(ODD).MODEL_CLASS(get_spec(ODD).parse_config(ODD))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(
                    1 + 0.1 * torch.randn(p.shape, generator=g)
                    if p.dim() == 1
                    else 0.3 * torch.randn(p.shape, generator=g)
                )
            for b in net.buffers():  # the decoder's and the encoder's layer scalars, different
                b.copy_(1 + 0.2 * torch.randn(b.shape, generator=g))
        net = net.to(dtype).eval()
        net.fuse_projections()
        tok = localdiff.load("tiny").tokenizer
        _MODELS[dtype] = Model(
            net,
            net.config,
            tok,
            None,
            f"odd-dg-{dtype}",
            "cpu",
            dtype,
            None,
            {"eos_token_id": [], "max_new_tokens": 16},
        )
    return _MODELS[dtype]


def requests(n: int) -> list[dict]:
    out = []
    for i in range(n):
        r = {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_new_tokens": (9, 14, 25, 30)[i % 4],
            "seed": 10 + i,
            "max_denoising_steps": 3 + i % 3,
        }
        if i % 3 == 0:
            r["temperature"] = 0.1  # (the canvas sampler draws every step: it has no temperature 0)
        if i == 5:
            r.update(threshold=0.3, correction=True)
        if i == 7:  # head_rows: its steps after the first run alone, beside the packed ones
            r.update(threshold=0.2, reuse_locked=True)
        out.append(r)
    return out


@pytest.mark.parametrize("dtype,n", [(torch.float32, 2), (torch.float32, 3), (torch.float32, 8), (torch.bfloat16, 3)])
def test_every_canvas_request_of_a_batch_gets_the_tokens_it_gets_alone(dtype, n):
    m = odd_model(dtype)
    assert batchable(m)
    reqs = requests(n)
    want = [alone(m, r) for r in reqs]
    got, b, widths = batched(m, reqs, [0, 0, 2, 1, 5, 0, 3, 7][:n])
    assert got == want
    assert max(widths) >= min(n, 3) and b.rows_total > 0  # they did run together, packed


def test_a_canvas_request_cancelled_mid_way_leaves_without_disturbing_the_others():
    m = odd_model()
    reqs = requests(3)
    want = [alone(m, r) for r in reqs]
    got, b, _ = batched(m, reqs, [0, 0, 1], cancel_at={1: 4})
    assert got[1] is None and got[0] == want[0] and got[2] == want[2]
    assert not b.lanes


def _calls(m):
    """Four denoise calls of different histories: fused prefill (padded), canvas with logits, with probabilities,
    raw logits; each with a twin cache for its own forward."""
    net, c, v = m.net, m.config.canvas_length, m.config.vocab_size
    calls, twins = [], []
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        cache, twin = m.new_cache(), m.new_cache()
        history = torch.randint(3, v, (1, 5 + 7 * i), generator=g)
        for cc in (cache, twin):
            net.prefill(history, cc)
        a = {"canvas_ids": torch.randint(3, v, (1, c), generator=g), "cache": cache}
        if i == 0:
            a["prefill_ids"] = torch.randint(3, v, (1, 9), generator=g)
            a["prefill_mask"] = torch.arange(9)[None] >= 2
        if i in (1, 3):
            a["self_conditioning_logits"] = torch.randn(1, c, v, generator=g)
        if i == 2:
            a["self_conditioning_logits"] = Probabilities(torch.softmax(torch.randn(1, c, v, generator=g), -1))
        if i == 3:
            a["raw_logits"] = True
        calls.append(a)
        twins.append(dict(a, cache=twin))
    return calls, twins


class _Spy(CanvasRowPolicy):
    """Records the largest group of each kind."""

    def __init__(self, net):
        super().__init__(net)
        self.widest: dict = {}

    def pack(self, kind, sizes, layer=None, dtype=torch.float32):
        groups = super().pack(kind, sizes, layer, dtype)
        self.widest[kind] = max(self.widest.get(kind, 0), max(len(g) for g in groups))
        return groups

    def experts(self, layer, counts, dtype):
        groups = super().experts(layer, counts, dtype)
        self.widest["experts"] = max(self.widest.get("experts", 0), max(len(g) for g in groups))
        return groups


@pytest.mark.parametrize("dtype,topk", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 5)])
def test_packed_canvas_denoise_equals_each_calls_own_forward_bit_for_bit(dtype, topk):
    m = odd_model(dtype)
    calls, twins = _calls(m)
    spy = _Spy(m.net)
    m.net.sc_topk = topk  # 5: the top-k soft embedding, per request inside the packed pass
    try:
        got = packed_canvas.canvas_denoise(m.net, calls, spy)
        owns = [m.net.denoise(**t) for t in twins]
    finally:
        m.net.sc_topk = None
    for a, t, out, own in zip(calls, twins, got, owns):
        if isinstance(own, RawLogits):
            assert isinstance(out, RawLogits) and out.softcap == own.softcap
            out, own = out.values, own.values
        assert torch.equal(out, own)
        assert a["cache"].seq_len == t["cache"].seq_len and a["cache"].token_ids == t["cache"].token_ids
    if dtype == torch.bfloat16:  # bf16 GEMMs and experts are row-stable at every width here: everything shares
        assert min(spy.widest[k] for k in ("attn", "ffn", "head", "experts", "soft", "sc")) > 1
    elif torch.get_num_threads() == 1:  # fp32 at one thread: MKL rounds only 1-3 rows apart
        assert spy.widest["attn"] > 1 and spy.widest["ffn"] > 1


def test_expert_segments_share_a_call_only_at_stable_widths():
    p = CanvasRowPolicy(odd_model().net)
    p.experts_ok = lambda layer, dtype, m: m not in (1, 2, 3)  # MKL fp32 at one thread
    assert p.experts(0, [[4, 0, 5], [0, 4, 4], [2, 6, 4], [5, 5, 0]], torch.float32) == [
        [2],
        [0, 1, 3],
    ]  # 2: routes 2 rows
    assert p.experts(0, [[4, 4], [1, 9]], torch.float32) == [[1], [0]]  # a segment routing 1 row: alone
    assert p.experts(0, [[4, 0], [0, 4]], torch.float32) == [[0, 1]]


def test_real_fp32_experts_probe_finds_the_unstable_widths():
    p = CanvasRowPolicy(odd_model().net)
    x = torch.randn(40, 52).float()
    ex = odd_model().net.layers[0].experts
    idx = torch.arange(3).repeat(40, 1)
    w = torch.rand(40, 3)
    with torch.inference_mode():
        full = ex(x, w, idx)
        for m in range(1, 13):
            if p.experts_ok(0, torch.float32, m):
                assert torch.equal(ex(x[:m], w[:m], idx[:m]), full[:m])


def _ask(url, prompt, max_tokens, temperature, seed, stream=False, leave_after=None):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, (r.model_extra or {}).get("localdiff", {})
    text, ext = "", {}
    s = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    for i, chunk in enumerate(s):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        ext = (chunk.model_extra or {}).get("localdiff") or ext
        if leave_after is not None and i >= leave_after:
            s.close()
            return None, {}
    return text, ext


def test_concurrent_diffusiongemma_requests_through_serve_get_their_own_answers():
    m = localdiff.load("tiny")
    asks = [
        ("What is 41 + 93?", 40, 0.1, 1),
        ("Tell me a story about a cat that", 70, 0.8, 2),
        ("hi", 9, 0.3, 3),
        ("Count: 1 2 3 4 5 6 7", 33, 1.0, 4),
        ("Name three colours.", 64, 0.1, 5),
    ]
    want = [m.generate(p, max_new_tokens=n, seed=s, temperature=t).text for p, n, t, s in asks]
    server = Running("tiny", max_batch=8)
    try:
        gate = threading.Event()
        threading.Thread(target=server.worker.call, args=(gate.wait,), daemon=True).start()
        with ThreadPoolExecutor(len(asks)) as pool:
            futs = [
                pool.submit(_ask, server.url, p, n, t, s, stream=i % 2 == 1, leave_after=0 if i == 3 else None)
                for i, (p, n, t, s) in enumerate(asks)
            ]
            t0 = time.monotonic()
            while server.worker.queued < len(asks) and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            gate.set()
            got = [f.result(timeout=120) for f in futs]
        kept = [0, 1, 2, 4]  # request 3's client leaves after its first chunk
        assert [got[i][0] for i in kept] == [want[i] for i in kept] and got[3][0] is None
        assert max(got[i][1]["batch"]["requests_max"] for i in kept) >= 3  # they ran together
    finally:
        server.stop()
    assert "Traceback" not in server.logs.text()


def test_the_canvas_bench_section_renders_its_table_ranges_and_gemm_fraction():
    from localdiff.bench import serve_batch_canvas
    from localdiff.bench.args import SECTIONS

    assert "serve-batch-canvas" in SECTIONS
    b = {"aggregate_tps": 40.0, "per_request_tps": 10.0, "ttft_s": 6.0, "aggregate_tps_range": [38.0, 41.5]}
    one = {"aggregate_tps": 30.0, "per_request_tps": 30.0, "ttft_s": 1.0}
    gemm = {
        "peak_gflops": 216.0,
        "peak_gflops_after": 214.0,
        "flops_per_request_step": 24e9,
        "requests": {"8": {"step_s": 1.7, "step_s_min": 1.6, "step_s_max": 1.9, "gflops": 112.9, "fraction": 0.5227}},
    }
    rows = {
        "identical": True,
        "load": [3.0, 4.5],
        "gemm": gemm,
        "gemm_1b": gemm,
        "cpu": {"8": {"alone_cpu_s": 11.2, "batched_cpu_s": 8.5, "ratio": 1.31, "ratio_range": [1.2, 1.4]}},
        "kernels": "torch bf16 GEMMs",
        "4": {"batched": b, "one_at_a_time": one, "speedup_aggregate": 1.33, "per_request_vs_single": 0.33},
    }
    sec = {"threads": 1, "cpu_capability": "AVX512", "max_tokens": 256, "families": {"canvas 150M, bfloat16": rows}}
    md = "\n".join(serve_batch_canvas.render_md(sec))
    assert "| canvas 150M, bfloat16 | 4 | 40.00 [38.00–41.50] (1.33×) | 10.00 (0.33×) | 6.00 | 30.00 |" in md
    assert "| 8 | 1700 (1600–1900) | 112.9 | 52.3 % |" in md and "3.00 → 4.50" in md and "Canvas 1B shape" in md
    assert "| 8 | 11.20 | 8.50 | 1.31× [1.20–1.40] |" in md


def test_a_canvas_requests_kv_estimate_counts_whole_canvases():
    from localdiff.serve.batching import kv_bytes

    m = localdiff.load("tiny")  # canvas 32
    assert kv_bytes(m, 10, 20) == kv_bytes(m, 10, 32) < kv_bytes(m, 10, 33) == kv_bytes(m, 10, 64) > 0


def test_a_failed_packed_pass_never_hands_a_lane_wrong_tokens(monkeypatch):
    m = odd_model()
    reqs = requests(3)
    want = [alone(m, r) for r in reqs]
    real, calls = packed_canvas._ffn, []

    def flaky(*a):  # the first packed pass (fused prefills: caches being written) fails mid-way
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real(*a)

    monkeypatch.setattr(packed_canvas, "_ffn", flaky)
    got, b, _ = batched(m, reqs, [0, 0, 0])
    assert calls and all(g is None or g == w for g, w in zip(got, want))
    assert None in got  # the lanes whose caches the failed pass had written end with its error
