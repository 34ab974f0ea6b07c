"""``localdiff bench --only v2cache``: Fast-dLLM v2's step cost without and with its sub-block cache (#45 item 2).

A random model of Fast-dLLM-v2-1.5B's shape (Qwen2.5-1.5B sizes: hidden 1536, 28 layers, 12 query / 2 key-value heads
of 128, q/k/v bias, SwiGLU 8960, vocabulary 151,936, tied embeddings — 1.54B parameters; block ``bd_size`` 32,
sub-blocks of 8, upstream's defaults), in the precision this CPU runs a skinny GEMM fastest. With 512 and 4096
tokens of history in the exact block cache (random K/V: the step cost does not depend on what they say), the
median ms of the three passes the decoder runs (:mod:`localdiff.decoding.fastdllm_v2`):

* **block step** — every step without the sub-block cache (``--kv-cache prefix``): the 32-token block over the
  cache (``BlockLM.denoise``);
* **capture step** — with it (``--kv-cache dual``), a step whose sub-block starts with a mask: the same pass that
  also keeps the block's K/V (``denoise_capture``);
* **sub-block step** — with it, every other step: the 8 sub-block tokens over the cache and the kept block K/V
  (``denoise_sub``).

All three are interleaved within each repetition (drift hits all alike); one untimed call of each first. Reported:
medians, ranges, and sub-block step ÷ block step (the saving of a step the sub-block cache serves). How many steps
it serves depends on the decoding (a sub-block's first token is committed at its first step when it is the most
confident one): the section also reports that share over a block of one-token steps at temperature 0 on this
random model.
"""

from __future__ import annotations

import statistics
import time

FAST_DLLM_V2_1_5B = {
    "model_type": "Fast_dLLM_Qwen",
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "bd_size": 32,
    "mask_token_id": 151665,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "bos_token_id": 151643,
}
SUB = 8


def build(config: dict, dtype):
    """Our BlockLM of ``config`` with random weights (N(0, 0.02), norms 1) in ``dtype``."""
    import torch

    from localdiff.arch import get_arch, get_spec

    with torch.device("meta"):
        net = get_arch(config).MODEL_CLASS(get_spec(config).parse_config(config))
    net = net.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in net.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    return net.eval()


def step_times(net, history: int, reps: int, dtype, log=print) -> dict:
    """Median / range ms of the three passes (module docstring) with ``history`` cached tokens."""
    import torch

    from localdiff.cache.kv import KVCache

    c = net.config
    g = torch.Generator().manual_seed(history)
    cache = KVCache(**net.cache_layout())
    for i in range(c.num_hidden_layers):
        k = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(dtype)
        v = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(dtype)
        cache.append(i, k, v)
    cache.commit(history, None, 1)
    blk = c.block_size
    canvas = torch.randint(0, c.vocab_size - 1, (1, blk), generator=g)
    _, block_kv = net.denoise_capture(canvas, cache)
    calls = {
        "block_step": lambda: net.denoise(canvas, cache),
        "capture_step": lambda: net.denoise_capture(canvas, cache),
        "sub_block_step": lambda: net.denoise_sub(canvas[:, SUB : 2 * SUB], cache, block_kv, SUB),
    }
    for f in calls.values():
        f()
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "ms": med,
        "range_ms": {k: [min(v), max(v)] for k, v in times.items()},
        "sub_over_block": med["sub_block_step"] / med["block_step"],
    }
    log(
        f"v2cache: history {history}: "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in med.items())
        + f" (sub-block / block {out['sub_over_block']:.2f})"
    )
    return out


def served_share(config: dict) -> float:
    """Share of steps the sub-block cache serves (``denoise_sub`` calls ÷ steps) over one block of one-token steps
    (threshold 1), temperature 0, on a random model of ``config``'s block and sub-block sizes but tiny widths."""
    import torch

    from localdiff.cache.kv import KVCache
    from localdiff.decoding import fastdllm_v2
    from localdiff.decoding.options import FastDLLMv2Options
    from localdiff.decoding.request import Request

    small = dict(
        config,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        mask_token_id=1000,
        eos_token_id=1001,
        pad_token_id=1002,
        bos_token_id=1002,
    )
    net = build(small, torch.float32)
    calls = []
    orig = net.denoise_sub
    net.denoise_sub = lambda ids, *a: calls.append(1) or orig(ids, *a)
    opts = FastDLLMv2Options.build({"threshold": 1.0, "small_block_size": SUB, "kv_cache": "dual"})
    prompt = torch.randint(0, 900, (1, config["bd_size"]), generator=torch.Generator().manual_seed(1))
    req = Request(options=opts, ids=prompt, max_new_tokens=config["bd_size"] - 1, mask_id=1000, emit_steps=False)
    events = list(fastdllm_v2.run(net, req, KVCache(**net.cache_layout()), (prompt, None), prompt[:, :0]))
    return len(calls) / events[-1].stats.forwards


def measure(quick: bool, log=print, config: dict | None = None, dtype=None) -> dict:
    """The section's result dict (module docstring). ``config`` replaces the 1.5B shape (tests); ``dtype`` forces a
    precision instead of the fastest one."""
    import torch

    from localdiff.bench.block import fastest_dtype

    fast, gemm = fastest_dtype(log)
    dtype = dtype or fast
    cfg = config or FAST_DLLM_V2_1_5B
    t0 = time.perf_counter()
    net = build(cfg, dtype)
    log(
        f"v2cache: random Fast-dLLM-v2-1.5B-shaped model built in {time.perf_counter() - t0:.0f} s "
        f"({sum(p.numel() for p in net.parameters()) / 1e9:.2f}B parameters, {dtype})"
    )
    hist = (512,) if quick else (512, 4096)
    res = {
        "config": cfg,
        "dtype": str(dtype).split(".")[-1],
        "gemm_ms": gemm,
        "threads": torch.get_num_threads(),
        "history": {str(h): step_times(net, h, 3 if quick else 5, dtype, log) for h in hist},
    }
    res["served_share"] = served_share(cfg)
    log(f"v2cache: the sub-block cache serves {res['served_share']:.0%} of one-token steps (random model)")
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = [
        "## Fast-dLLM v2: step time without / with the sub-block cache (random Fast-dLLM-v2-1.5B-shaped model)",
        "",
        f"{sec['dtype']}, {sec['threads']} thread(s); median ms (range); block 32, sub-block 8.",
        "",
        "| history | block step (`--kv-cache prefix`) | capture step (dual) | sub-block step (dual) | "
        "sub-block / block |",
        "|---:|---:|---:|---:|---:|",
    ]
    for h, r in sec["history"].items():
        ms, rg = r["ms"], r["range_ms"]
        cell = {k: f"{ms[k]:.0f} ({rg[k][0]:.0f}–{rg[k][1]:.0f})" for k in ms}
        lines.append(
            f"| {h} | {cell['block_step']} | {cell['capture_step']} | {cell['sub_block_step']} | "
            f"**{r['sub_over_block']:.2f}×** |"
        )
    lines += [
        "",
        f"Steps the sub-block cache serves, one token per step at temperature 0 (random model): "
        f"{sec['served_share']:.0%}.",
        "",
    ]
    return lines
