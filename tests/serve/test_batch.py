"""Step-level batching (localdiff.engine.batch, localdiff.arch.packed): every request's tokens equal the same request
run alone — block and masked families, every masked cache mode, 2 / 3 / 8 requests of different prompt lengths,
arrival steps, max_new_tokens, seeds and temperatures, fp32 and int8, one request cancelled mid-way — and the
packed forwards really share their matmuls."""

from __future__ import annotations

import pytest
import torch

from batch_lanes import alone, batched

import localdiff
from localdiff.arch import packed
from localdiff.engine.batch import RowPolicy, batchable

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
_MODELS: dict = {}


def model(name: str, quant=None):
    key = (name, quant)
    if key not in _MODELS:
        _MODELS[key] = localdiff.load(name, quant=quant)
    return _MODELS[key]


def requests(n: int, masked: bool) -> list[dict]:
    out = []
    for i in range(n):
        r = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": (9, 12, 16, 20)[i % 4], "seed": 10 + i}
        if i % 2:
            r["temperature"] = (0.7, 1.0)[i // 2 % 2]
        if masked:
            r["kv_cache"] = ("none", "prefix", "dual", "vicinity")[i % 4]
            r["block_length"] = 8
            r["steps"] = r["max_new_tokens"] // 2
        out.append(r)
    return out


@pytest.mark.parametrize(
    "name,quant,n",
    [
        ("tiny-bd", None, 2),
        ("tiny-bd", None, 3),
        ("tiny-bd", None, 8),
        ("tiny-bd", "int8", 3),
        ("tiny-mdm", None, 2),
        ("tiny-mdm", None, 3),
        ("tiny-mdm", None, 8),
    ],
)
def test_every_request_of_a_batch_gets_the_tokens_it_gets_alone(name, quant, n):
    m = model(name, quant)
    assert batchable(m)
    reqs = requests(n, masked=name == "tiny-mdm")
    want = [alone(m, r) for r in reqs]
    arrive = [0, 0, 2, 1, 5, 0, 3, 7][:n]
    got, b, widths = batched(m, reqs, arrive)
    assert got == want
    assert max(widths) >= min(n, 3) and b.rows_total > 0  # they did run together


@pytest.mark.parametrize("name", ["tiny-bd", "tiny-mdm"])
def test_a_request_cancelled_mid_way_leaves_without_disturbing_the_others(name):
    m = model(name)
    reqs = requests(3, masked=name == "tiny-mdm")
    want = [alone(m, r) for r in reqs]
    got, b, _ = batched(m, reqs, [0, 0, 1], cancel_at={1: 3})
    assert got[1] is None and got[0] == want[0] and got[2] == want[2]
    assert not b.lanes


def _calls_block(m):
    net = m.net
    calls, own = [], []
    for i, n_pre in enumerate((8, 4, 12)):  # different histories, fused prefill rows, positions
        cache = m.new_cache()
        g = torch.Generator().manual_seed(i)
        pre = torch.randint(10, 300, (1, n_pre), generator=g)
        history = torch.randint(10, 300, (1, 4 * (i + 1)), generator=g)
        net.prefill(history, cache)
        canvas = torch.full((1, 4), m.mask_token_id)
        canvas[0, :i] = 33
        twin = m.new_cache()
        net.prefill(history, twin)
        calls.append((canvas, cache, pre if i != 1 else None, None))
        own.append((canvas, twin, pre if i != 1 else None))
    return calls, own


@pytest.mark.parametrize("quant", [None, "int8"])
def test_packed_block_denoise_equals_each_calls_own_forward_bit_for_bit(quant):
    m = model("tiny-bd", quant)
    calls, own = _calls_block(m)
    policy = RowPolicy(m.net)
    shared = []

    def pack(kind, sizes, layer=None, dtype=torch.float32):
        groups = policy.pack(kind, sizes, layer, dtype)
        shared.append(max(len(g) for g in groups))
        return groups

    got = packed.block_denoise(m.net, calls, pack)
    for (canvas, twin, pre), (_, cache, _, _), out in zip(own, calls, got):
        assert torch.equal(out, m.net.denoise(canvas, twin, None, prefill_ids=pre))
        assert cache.seq_len == twin.seq_len  # the fused prefill rows were appended to each own cache
    assert max(shared) > 1


def test_an_int8_lm_head_is_shared_by_the_lanes_bit_for_bit(monkeypatch):
    """The int8 LM head (a recipe's head = "int8": ``Int8Head``) runs the row-exact native kernel: the lanes share
    one head matmul (it ran once per lane, the largest matmul of an SDAR-1.7B step) and keep their own logits."""
    from localdiff.kernels import int8 as native
    from localdiff.quantize.int8 import quantize_head

    if native.library() is None:
        pytest.skip("the native int8 kernel does not build here")
    monkeypatch.setenv("LOCALDIFF_INT8_KERNEL", "native")
    m = localdiff.load("tiny-bd", quant="int8")
    assert quantize_head(m.net)
    calls, own = _calls_block(m)
    policy = RowPolicy(m.net)
    heads = []

    def pack(kind, sizes, layer=None, dtype=torch.float32):
        groups = policy.pack(kind, sizes, layer, dtype)
        if kind == "head":
            heads.append(groups)
        return groups

    got = packed.block_denoise(m.net, calls, pack)
    for (canvas, twin, pre), out in zip(own, got):
        assert torch.equal(out, m.net.denoise(canvas, twin, None, prefill_ids=pre))
    assert heads == [[[0, 1, 2]]]  # one head matmul for the three requests' 12 rows
    reqs = requests(3, masked=False)
    want = [alone(m, r) for r in reqs]
    assert batched(m, reqs, [0, 0, 1])[0] == want


def test_packed_masked_window_equals_forward_window_in_every_cache_mode():
    m = model("tiny-mdm")
    net = m.net
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 300, (1, n), generator=g) for n in (24, 40, 33)]
    kvs = [net.forward_window(s, 0, None, return_kv=True)[1] for s in seqs]
    sel = torch.zeros(1, 8, dtype=torch.bool)
    sel[0, ::3] = True
    calls = [
        dict(input_ids=seqs[0], start=0, attention_mask=None, return_kv=True, rows=(8, 16)),  # refresh
        dict(input_ids=seqs[1][:, 16:24], start=16, kv=kvs[1], rows=(0, 8), select=sel),  # dual
        dict(
            input_ids=seqs[2][:, 8:],
            start=8,
            kv=[(k[:, :, :8], v[:, :, :8]) for k, v in kvs[2]],  # prefix
            rows=(0, 8),
        ),
    ]
    got = packed.masked_window(net, calls, RowPolicy(net).pack)
    for c, out in zip(calls, got):
        want = net.forward_window(
            c["input_ids"],
            c.get("start", 0),
            c.get("kv"),
            c.get("attention_mask"),
            c.get("return_kv", False),
            c.get("rows"),
            c.get("select"),
        )
        if c.get("return_kv"):
            assert torch.equal(out[0], want[0]) and all(
                torch.equal(a, b) for x, y in zip(out[1], want[1]) for a, b in zip(x, y)
            )
        else:
            assert torch.equal(out, want)


def test_row_policy_keeps_unstable_row_counts_alone():
    net = model("tiny-bd").net
    p = RowPolicy(net)
    p._bad[(torch.float32, 160, torch.get_num_threads())] = {1, 2, 3, 5, 6, 7, 9, 10, 11}  # MKL at 2 threads
    assert p.pack("attn", [4, 1, 4, 8], 0, torch.float32) == [[1], [0, 2, 3]]
    assert p.token("attn", 0, torch.float32, 3) is None and p.token("attn", 0, torch.float32, 12) == ("float",) * 4
    assert p.pack("head", [5, 3], None, torch.float32) == [[0], [1]]
    assert RowPolicy(net, max_rows=8).pack("attn", [4, 4, 4], 0, torch.float32) == [[0, 1], [2]]


def test_moe_feed_forwards_are_never_packed():
    from block_models import build_net

    _, net = build_net("sdar_moe")
    p = RowPolicy(net)
    assert p.pack("ffn", [4, 4], 0, torch.float32) == [[0], [1]]  # layer 0: experts
    assert p.pack("ffn", [4, 4], 1, torch.float32) == [[0, 1]]  # layer 1: mlp_only_layers (dense)


@pytest.mark.parametrize(
    "kind,opts", [("Fast_dLLM_Qwen", {}), ("Fast_dLLM_Qwen", {"use_block_cache": True}), ("sdar_moe", {})]
)
def test_other_block_layouts_batch_exactly(tmp_path, kind, opts):
    from block_models import write_checkpoint

    m = localdiff.load(str(write_checkpoint(tmp_path / kind, kind, tokenizer=True)))
    reqs = [dict(r, **opts) for r in requests(3, masked=False)]
    want = [alone(m, r) for r in reqs]
    got, b, widths = batched(m, reqs, [0, 1, 1])
    assert got == want and max(widths) == 3


def test_the_bench_sections_exactness_check_and_table():
    from localdiff.bench import serve_batch

    assert serve_batch.identical(model("tiny-bd"), "block") and serve_batch.identical(model("tiny-mdm"), "masked")
    r = {"aggregate_tps": 4.0, "per_request_tps": 1.0, "ttft_s": 0.5}
    one = {"aggregate_tps": 1.5, "per_request_tps": 1.5, "ttft_s": 0.3}
    sec = {
        "layers": 4,
        "threads": 1,
        "max_tokens": 16,
        "cpu_capability": "AVX512",
        "families": {
            "block, bfloat16": {
                "identical": True,
                "kernels": "torch bf16 GEMMs",
                "4": {"batched": r, "one_at_a_time": one, "speedup_aggregate": 2.67, "per_request_vs_single": 0.67},
            }
        },
    }
    md = "\n".join(serve_batch.render_md(sec))
    assert "| block, bfloat16 | 4 | 4.00 (2.67×) | 1.00 (0.67×) | 0.50 | 1.50 | 1.50 | 0.30 | 2.67× |" in md
    assert "block, bfloat16: yes" in md


def test_llada2_lanes_batch_exactly(tmp_path):
    from llada2_ref import TINY, write_checkpoint

    write_checkpoint(tmp_path / "llada2")
    m = localdiff.load(str(tmp_path / "llada2"), dtype=torch.float32)
    vocab = TINY["vocab_size"]
    reqs = [
        {
            "prompt": [(7 * i + j) % (vocab - 10) + 3 for j in range(5 + 3 * i)],
            "max_new_tokens": 8 + 4 * i,
            "seed": i,
            **({"temperature": 0.8} if i % 2 else {}),
        }
        for i in range(3)
    ]
    want = [alone(m, r) for r in reqs]
    got, b, widths = batched(m, reqs, [0, 0, 2])
    assert got == want and max(widths) == 3
