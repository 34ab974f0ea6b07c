"""``localdiff bench --only block``: block diffusion's step cost on this CPU (issue #16's bench).

A random model of SDAR-1.7B's shape (Qwen3-1.7B sizes: hidden 2048, 28 layers, 16 query / 8 key-value heads of
128, SwiGLU 6144, vocabulary 151,936, tied embeddings — 1.72B parameters), in the precision this CPU runs a skinny
GEMM fastest (fp32 vs bf16, measured first). With 512 and 4096 tokens of history in the cache (random K/V: the
step cost does not depend on what the history says), the median ms of:

* one **block step** (4 tokens, one denoising forward over the cache) and one **1-token step** (an autoregressive
  decoding step of the same model), by localdiff (``BlockLM.denoise`` over ``KVCache``);
* the same two by transformers' ``Qwen3ForCausalLM`` with a block mask and its ``DynamicCache`` on the same
  weights (shared storage, no copy) and the same inputs — the path upstream SDAR runs (its ``store_kv=False``
  forward concatenates the step's K/V to the cache without keeping them; here ``DynamicCache.crop`` drops them
  after each forward, inside the timing — a crop is a slice).

One untimed block step of each first (warm-up; their logits are compared: same weights, same inputs). All four
are interleaved within each repetition (drift hits all alike). Reported: medians, ranges, the ratios
block / 1-token (target ≤ 1.3× for localdiff: memory-bound, as reading the weights once should be) and localdiff
vs transformers per step (target ≥ 2× the transformers block-step rate), and the break-even tokens per forward
(block step ÷ 1-token step: a block decoder beats AR decoding of the same model above it).

Then tokens/s end to end (:mod:`localdiff.bench.block_tps`: AR vs static / recommended / forced block decoding, and
a projection from the trained tiny-bd's TPF). When bf16 is the precision, the model is then quantized to int8
weights by SDAR's recipe (``quant/sdar.toml``: also an int8 copy of the tied LM head; bf16 activations, the kernel
chosen per shape: :mod:`localdiff.quantize.int8`, the native one for these row counts) and the step timings and
tokens/s are measured again, against the same transformers bf16 model: both bf16-vs-bf16 and localdiff's fastest
vs transformers' fastest measured here (transformers in fp32 is not run: bf16 is its faster precision wherever the
probe picks bf16).
"""

from __future__ import annotations

import statistics
import time

SDAR_1_7B = {
    "model_type": "sdar",
    "architectures": ["SDARForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "block_size": 4,
    "mask_token_id": 151669,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "bos_token_id": 151643,
}


def fastest_dtype(log=print):
    """fp32 or bf16: whichever runs a [4, 2048] × [2048, 6144] matmul faster here (median of 20)."""
    import torch

    best, out = None, {}
    for dt in (torch.float32, torch.bfloat16):
        a, w = torch.randn(4, 2048, dtype=dt), torch.randn(6144, 2048, dtype=dt)
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, w)
            ts.append(time.perf_counter() - t0)
        out[str(dt).split(".")[-1]] = statistics.median(ts) * 1e3
        if best is None or out[str(dt).split(".")[-1]] < out[str(best).split(".")[-1]]:
            best = dt
    log("block: skinny GEMM " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()) + f" → {best}")
    return best, out


def _build(config: dict, dtype, cfg_over: dict | None = None):
    """(our BlockLM, transformers Qwen3ForCausalLM sharing its weights) with random weights in ``dtype``."""
    import torch
    import transformers as tf

    from localdiff.arch import get_arch, get_spec

    cfg = dict(config, **(cfg_over or {}))
    with torch.device("meta"):
        net = get_arch(cfg).MODEL_CLASS(get_spec(cfg).parse_config(cfg))
    net = net.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    net.eval()
    hcfg = tf.Qwen3Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rope_theta=cfg["rope_theta"],
        rms_norm_eps=cfg["rms_norm_eps"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        attn_implementation="sdpa",
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    with torch.device("meta"):
        ref = tf.Qwen3ForCausalLM(hcfg)
    state = {("model." + k): v for k, v in net.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref.load_state_dict(state, strict=False, assign=True)
    ref.model.rotary_emb = type(ref.model.rotary_emb)(hcfg)  # its buffers, off the meta device
    return net, ref.to(dtype).eval()


def step_times(net, ref, history: int, reps: int, dtype, log=print) -> dict:
    """Median / range ms of the four steps (module docstring) with ``history`` cached tokens."""
    import torch
    from transformers import DynamicCache

    from localdiff.cache.kv import KVCache

    c = net.config
    g = torch.Generator().manual_seed(history)
    cache = KVCache(**net.cache_layout())
    dyn = DynamicCache(config=ref.config)
    for i in range(c.num_hidden_layers):
        k = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(dtype)
        v = torch.randn(1, c.num_key_value_heads, history, c.head_dim, generator=g).to(dtype)
        cache.append(i, k, v)
        dyn.update(k, v, i)
    cache.commit(history, None, 1)
    ids = {n: torch.randint(0, c.vocab_size - 1, (1, n), generator=g) for n in (4, 1)}

    def hf(n):
        pos = torch.arange(history, history + n)[None]
        mask = torch.zeros(1, 1, n, history + n, dtype=dtype)  # the block's rows see every key
        with torch.inference_mode():
            out = ref(input_ids=ids[n], attention_mask=mask, position_ids=pos, past_key_values=dyn, use_cache=True)
        dyn.crop(-n)  # drop the step's K/V (transformers 5: a negative count)
        return out.logits

    calls = {
        "localdiff_block": lambda: net.denoise(ids[4], cache),
        "localdiff_1tok": lambda: net.denoise(ids[1], cache),
        "transformers_block": lambda: hf(4),
        "transformers_1tok": lambda: hf(1),
    }
    diff = (calls["localdiff_block"]().float() - calls["transformers_block"]().float()).abs().max().item()
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "max_abs_logit_diff": diff,
        "ms": med,
        "range_ms": {k: [min(v), max(v)] for k, v in times.items()},
        "block_over_1tok": {
            "localdiff": med["localdiff_block"] / med["localdiff_1tok"],
            "transformers": med["transformers_block"] / med["transformers_1tok"],
        },
        "localdiff_speedup": {
            "block": med["transformers_block"] / med["localdiff_block"],
            "1tok": med["transformers_1tok"] / med["localdiff_1tok"],
        },
    }
    log(
        f"block: history {history}: "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in med.items())
        + f" (same inputs: block-step logits differ by at most {diff:.2g})"
    )
    return out


def measure(quick: bool, log=print, config: dict | None = None, dtype=None, tps: bool = True) -> dict:
    """The section's result dict (module docstring). ``config`` replaces the SDAR-1.7B shape (tests); ``dtype``
    forces a precision instead of the fastest one; ``tps`` False skips the tokens/s and int8 parts."""
    import torch

    fast, gemm = fastest_dtype(log)
    dtype = dtype or fast
    cfg = config or SDAR_1_7B
    t0 = time.perf_counter()
    net, ref = _build(cfg, dtype)
    log(
        f"block: random SDAR-1.7B-shaped model built in {time.perf_counter() - t0:.0f} s "
        f"({sum(p.numel() for p in net.parameters()) / 1e9:.2f}B parameters, {dtype})"
    )
    hist = (512,) if quick else (512, 4096)
    res = {
        "config": cfg,
        "dtype": str(dtype).split(".")[-1],
        "gemm_ms": gemm,
        "threads": torch.get_num_threads(),
        "history": {str(h): step_times(net, ref, h, 3 if quick else 5, dtype, log) for h in hist},
    }
    if not tps:
        return res
    from localdiff.bench.block_tps import measure_tps, tiny_bd_tpf

    reps, new = (1, 8) if quick else (2, 16)
    res["tiny_bd"] = tiny_bd_tpf(3 if quick else 20, log)
    res["tokens_per_second"] = {res["dtype"]: measure_tps(net, dtype, 512, reps, log, res["tiny_bd"], new)}
    if dtype == torch.bfloat16:
        from localdiff.quantize.int8 import quantize_model
        from localdiff.quantize.recipe import recipe_for_model

        quantize_model(net, recipe_for_model("sdar:1.7b"))  # in place, SDAR's recipe (int8 head copy too); ref bf16
        from localdiff.quantize.fuse import fuse_model

        fuse_model(net)  # as the loader does for int8: q/k/v, gate/up fused
        res["int8"] = {str(h): step_times(net, ref, h, 3 if quick else 5, dtype, log) for h in hist}
        from localdiff.quantize.choose import kernel_summary

        res["int8_kernel"] = kernel_summary()  # which int8 kernel ran (native AMX / FMA, or why not; choices)
        log(f"block: int8 kernels: {res['int8_kernel']}")
        res["tokens_per_second"]["int8"] = measure_tps(net, dtype, 512, reps, log, res["tiny_bd"], new)
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = [
        "## Block diffusion: block step vs 1-token step (random SDAR-1.7B-shaped model)",
        "",
        f"{sec['dtype']}, {sec['threads']} thread(s); median ms (range); block = 4 tokens, one forward.",
        "",
        "| history | localdiff block | localdiff 1-token | block/1-token | transformers block | "
        "transformers 1-token | block/1-token | localdiff speed-up (block) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h, r in sec["history"].items():
        ms, rg = r["ms"], r["range_ms"]
        cell = {k: f"{ms[k]:.0f} ({rg[k][0]:.0f}–{rg[k][1]:.0f})" for k in ms}
        lines.append(
            f"| {h} | {cell['localdiff_block']} | {cell['localdiff_1tok']} | "
            f"{r['block_over_1tok']['localdiff']:.2f}× | {cell['transformers_block']} | "
            f"{cell['transformers_1tok']} | {r['block_over_1tok']['transformers']:.2f}× | "
            f"**{r['localdiff_speedup']['block']:.2f}×** |"
        )
    for h, r in sec.get("int8", {}).items():
        ms, rg = r["ms"], r["range_ms"]
        lines.append(
            f"| {h}, localdiff int8 (bf16 act.) + int8 head vs transformers bf16 | {ms['localdiff_block']:.0f} "
            f"({rg['localdiff_block'][0]:.0f}–{rg['localdiff_block'][1]:.0f}) | "
            f"{ms['localdiff_1tok']:.0f} | "
            f"{r['block_over_1tok']['localdiff']:.2f}× | {ms['transformers_block']:.0f} | "
            f"{ms['transformers_1tok']:.0f} | {r['block_over_1tok']['transformers']:.2f}× | "
            f"**{r['localdiff_speedup']['block']:.2f}×** |"
        )
    if sec.get("int8_kernel"):
        lines += ["", f"int8 kernels: {sec['int8_kernel']}."]
    lines.append("")
    from localdiff.bench.block_tps import render_tps

    return lines + render_tps(sec)
