"""``localdiff bench --only gguf-block``: the block family's step on llama.cpp (issue 43's bench).

A random SDAR-1.7B-shaped model (:data:`localdiff.bench.block.SDAR_1_7B`: Qwen3-1.7B sizes, weights N(0, 0.02²),
norms 1) written as an F16 GGUF (``qwen3`` + localdiff's diffusion keys; :func:`write_random_sdar`), then quantized
to Q8_0 and Q4_K_M by llama.cpp's own quantizer (``llama_model_quantize`` in llama-cpp-python). For each file, with
512 tokens of history (more with ``LOCALDIFF_BENCH_GGUF_HISTORY=512,4096``) and ONE thread, interleaved within each
repetition, the median ms of:

* **localdiff block step**: ``GGUFBlockNet.denoise`` (4 tokens, one non-causal batch over the cache, its cells
  dropped after) plus SDAR's decoder step on its logits (``assess`` + ``advance``: what the block loop runs per
  step); and the same without the decoder (``denoise`` only);
* **llama.cpp 4-token decode**: a bare ``llama_decode`` of 4 tokens (non-causal) + ``llama_memory_seq_rm`` on a
  context with the same settings, from Python with the batch prepared once;
* **llama.cpp 1-token step**: a bare causal 1-token ``llama_decode`` (an autoregressive step) on the same settings,
  and on llama.cpp's default context settings (flash attention "auto", what Ollama / llama-server run).

Every context holds F16 K/V (llama.cpp's default; localdiff uses F32 only for F32 files) and, except the default one,
flash attention off (localdiff's setting; exactness). The history is written by one causal batch (its values do not
change the step's cost). Reported: ms (median, range), localdiff ÷ bare 4-token (target ≤ 1.15: our loop, cache
bookkeeping and sampling add ≤ 15 %) and the **break-even TPF** = localdiff's block step ÷ llama.cpp's 1-token step
(a block decoder beats autoregressive decoding of the same model in the same engine above it). ``--quick``: a
smaller shape (hidden 512, 4 layers). Then the masked family's caches on GGUF (:func:`masked_steps`: the dual
cache's step vs the uncached step at a 1k-token prompt; target ≥ 5×). Files are kept in ``$LOCALDIFF_BENCH_CACHE`` when set (else a temporary folder).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

QUICK_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}
QUANTS = {"Q8_0": 7, "Q4_K_M": 15}


def write_random_sdar(path: Path, cfg: dict, seed: int = 0) -> int:
    """An F16 GGUF of a random SDAR model of ``cfg``'s shape (``localdiff.bench.block.SDAR_1_7B`` keys): llama.cpp's
    ``qwen3`` names and keys, tied embeddings (no ``output.weight``), a placeholder GPT-2 vocabulary, the
    ``localdiff.*`` diffusion keys. Returns the parameter count. Raises ImportError without the ``gguf`` package."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    h, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(n)
    w.add_feed_forward_length(f)
    w.add_head_count(hq)
    w.add_head_count_kv(hk)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_string("localdiff.model_type", "sdar")
    w.add_string("localdiff.family", "block")
    w.add_uint32("localdiff.mask_token_id", min(cfg["mask_token_id"], v - 1))
    w.add_uint32("localdiff.block_length", cfg["block_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(0x21 + i) if i < 94 else f"[T{i}]" for i in range(v)])
    w.add_token_types([1] * 94 + [5] * (v - 94))
    w.add_token_merges(['! "'])
    w.add_eos_token_id(min(cfg["eos_token_id"], v - 2))
    count = 0

    def add(name, *shape, one=False):
        nonlocal count
        x = np.ones(shape, np.float32) if one else (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
        w.add_tensor(name, x if len(shape) == 1 else x.astype(np.float16))
        count += x.size

    add("token_embd.weight", v, h)
    add("output_norm.weight", h, one=True)
    for i in range(n):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", h, one=True)
        add(b + "ffn_norm.weight", h, one=True)
        add(b + "attn_q_norm.weight", d, one=True)
        add(b + "attn_k_norm.weight", d, one=True)
        add(b + "attn_q.weight", hq * d, h)
        add(b + "attn_k.weight", hk * d, h)
        add(b + "attn_v.weight", hk * d, h)
        add(b + "attn_output.weight", h, hq * d)
        add(b + "ffn_gate.weight", f, h)
        add(b + "ffn_up.weight", f, h)
        add(b + "ffn_down.weight", h, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return count


def quantize(src: Path, dst: Path, ftype: int, threads: int) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``): ``src`` → ``dst`` in ``ftype`` (a ``llama_ftype``).
    Raises LocaldiffError when it fails."""
    from localdiff.backends.llama_lib import llama_cpp
    from localdiff.errors import LocaldiffError

    lib = llama_cpp()
    p = lib.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, threads
    tmp = dst.with_name(dst.name + ".part")
    if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
        raise LocaldiffError(f"llama.cpp could not quantize {src} (ftype {ftype})")
    tmp.replace(dst)


def _history_ids(n: int, vocab: int):
    import torch

    return torch.randint(100, vocab - 100, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _fill(ctx, ids: list[int]) -> None:
    """``ids`` at positions 0.. of sequence 0, as one causal batch (the history)."""
    lib = ctx.lib
    lib.llama_set_causal_attn(ctx.ctx, True)
    for i, t in enumerate(ids):
        ctx.put(i, t, i, (0,), i == len(ids) - 1)
    ctx.run(len(ids))
    lib.llama_set_causal_attn(ctx.ctx, False)


def step_times(path: Path, history: int, reps: int, log=print) -> dict:
    """Median / range ms of the section's steps (module docstring) on one GGUF file with ``history`` cached tokens."""
    import localdiff
    from localdiff.backends.llama_seq import SeqContext, size_for
    from localdiff.decoding.options import SDAROptions
    from localdiff.decoding.sdar import SDAR

    m = localdiff.load(str(path), threads=1)
    net, lib = m.net, m.net.lib
    c = m.config
    hist = _history_ids(history, c.vocab_size)
    net.min_ubatch = history
    cache = net.new_cache()
    cache.rows = [[]]
    ctx = net._ready(cache, 1, history + 8)
    _fill(ctx, hist)
    cache.rows, cache.seq_len = [list(hist)], history
    import torch

    block = torch.tensor([[hist[5], hist[9], c.mask_token_id, c.mask_token_id]])
    policy = SDAR(SDAROptions.build({"steps": 4}, {}), 1, c.block_size, c.mask_token_id, "cpu", None)
    bare = {}
    for name, causal in (("bare4", False), ("bare1", True)):
        x = SeqContext(lib, net.model, path, size_for(history + 8), history, 1, 1, False)
        _fill(x, hist)
        lib.llama_set_causal_attn(x.ctx, causal)
        bare[name] = x
    cp = lib.llama_context_default_params()  # llama.cpp's defaults (flash attention auto), 1 thread
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = size_for(history + 8), 1, 1
    dflt = lib.llama_init_from_model(net.model, cp)
    d = SeqContext.__new__(SeqContext)
    d.lib, d.path, d.ctx, d.mem, d.n_ubatch, d.n_seq = lib, path, dflt, lib.llama_get_memory(dflt), cp.n_ubatch, 1
    d.n_ctx, d.n_vocab = int(lib.llama_n_ctx(dflt)), net.n_vocab
    d.batch = lib.llama_batch_init(d.n_ubatch, 0, 1)
    import numpy as np

    d.tok = np.ctypeslib.as_array(d.batch.token, shape=(d.n_ubatch,))
    d.pos = np.ctypeslib.as_array(d.batch.pos, shape=(d.n_ubatch,))
    d.nseq = np.ctypeslib.as_array(d.batch.n_seq_id, shape=(d.n_ubatch,))
    d.out = np.ctypeslib.as_array(d.batch.logits, shape=(d.n_ubatch,))
    _fill(d, hist)
    lib.llama_set_causal_attn(dflt, True)
    for x, n in ((bare["bare4"], 4), (bare["bare1"], 1), (d, 1)):  # the step's batch, prepared once
        for i in range(n):
            x.put(i, hist[i], history + i, (0,), True)

    def bare_step(x, n):
        x.run(n)
        x.rm(0, history)

    def ours(sample: bool):
        logits = net.denoise(policy.canvas, cache)
        if sample:
            policy.advance(policy.assess(logits, 1))
            policy.begin_block(block)

    policy.begin_block(block)
    calls = {
        "localdiff_block_step": lambda: ours(True),
        "localdiff_denoise": lambda: ours(False),
        "llama_cpp_4tok": lambda: bare_step(bare["bare4"], 4),
        "llama_cpp_1tok": lambda: bare_step(bare["bare1"], 1),
        "llama_cpp_1tok_default_ctx": lambda: bare_step(d, 1),
    }
    for f in calls.values():  # warm-up
        f()
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    for x in (*bare.values(), d):
        x.close()
    m.net.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    log(f"gguf-block: {path.name} history {history}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
    return {
        "ms": med,
        "range_ms": {k: [min(v), max(v)] for k, v in times.items()},
        "overhead_vs_bare_4tok": med["localdiff_block_step"] / med["llama_cpp_4tok"],
        "denoise_vs_bare_4tok": med["localdiff_denoise"] / med["llama_cpp_4tok"],
        "break_even_tpf": med["localdiff_block_step"] / med["llama_cpp_1tok"],
        "break_even_tpf_default_ctx": med["localdiff_block_step"] / med["llama_cpp_1tok_default_ctx"],
        "bare_4tok_over_1tok": med["llama_cpp_4tok"] / med["llama_cpp_1tok"],
    }


def masked_steps(folder: Path, quick: bool, reps: int, log=print) -> dict:
    """The masked family's caches on GGUF: ms of one denoising step at a 1,024-token prompt with 128 answer positions
    (4 blocks of 32; the first block being decoded) — no cache (a full pass), the block's refresh pass, a prefix-cache
    step (the block and everything after it) and a dual-cache step (the block alone; the block's first one also
    relabels the suffix cells) — on tiny-mdm's GGUF (quick) or
    the bench's random 108M LLaDA (:mod:`localdiff.bench.gguf_random`), F32, one thread."""
    import torch

    import localdiff
    from localdiff.bench.gguf import _tiny_mdm
    from localdiff.bench.gguf_convert import convert_llada
    from localdiff.bench.gguf_random import random_llada

    src = _tiny_mdm()
    ckpt = src if quick else random_llada(src, folder / "random-llada")[0]
    path = folder / ("tiny-mdm-F32.gguf" if quick else "random-llada-F32.gguf")
    if not path.is_file():
        convert_llada(ckpt, path)
    m = localdiff.load(str(path), threads=1)
    net, p, g = m.net, 1024, 128
    x = torch.randint(10, m.config.vocab_size - 10, (1, p + g), generator=torch.Generator().manual_seed(0))
    x[0, p:] = m.config.mask_token_id
    rows = (p, p + 32)
    refresh = lambda: net.forward_window(x, 0, None, return_kv=True, rows=rows)  # noqa: E731
    dual = lambda: net.forward_window(x[:, p : p + 32], p, [None], rows=(0, 32))  # noqa: E731
    # per repetition, in order: a full pass; a refresh then a prefix step; a refresh, the block's first dual step
    # (it relabels the suffix cells once per block) and a later one
    calls = [
        ("none_full_pass", lambda: net.logits_full(x, rows=rows)),
        ("refresh_pass", refresh),
        ("prefix_step", lambda: net.forward_window(x[:, p:], p, [None], rows=(0, 32))),
        (None, refresh),
        ("dual_first_step", dual),
        ("dual_step", dual),
    ]
    times = {k: [] for k, _ in calls if k}
    for _ in range(reps):
        for k, f in calls:
            t0 = time.perf_counter()
            f()
            if k:
                times[k].append((time.perf_counter() - t0) * 1e3)
    net.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    log("gguf-block: masked at a 1k prompt: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
    return {
        "model": path.name,
        "prompt": p,
        "answer": g,
        "block": 32,
        "ms": med,
        "range_ms": {k: [min(v), max(v)] for k, v in times.items()},
        "dual_speedup": med["none_full_pass"] / med["dual_step"],
        "prefix_speedup": med["none_full_pass"] / med["prefix_step"],
    }


def measure(quick: bool, log=print) -> dict:
    """The section's result dict (module docstring). Raises LocaldiffError (skipped) without llama-cpp-python /
    gguf."""
    from localdiff.backends.llama_lib import llama_cpp, version
    from localdiff.bench.block import SDAR_1_7B
    from localdiff.errors import LocaldiffError

    llama_cpp()
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise LocaldiffError('the gguf package is missing (pip install "localdiff[gguf]")') from None
    cfg = dict(SDAR_1_7B, **(QUICK_SHAPE if quick else {}))
    hist = [int(x) for x in os.environ.get("LOCALDIFF_BENCH_GGUF_HISTORY", "512").split(",") if x.strip()]
    reps = 5 if quick else 9
    keep = os.environ.get("LOCALDIFF_BENCH_CACHE")
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="localdiff-gguf-block-")
    folder = Path(keep) / "gguf-block" if keep else Path(tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    tag = "quick" if quick else "1.7b"
    try:
        f16 = folder / f"sdar-{tag}-F16.gguf"
        t0 = time.perf_counter()
        if not f16.is_file():
            part = folder / (f16.name + ".part")
            params = write_random_sdar(part, cfg)
            part.replace(f16)
            log(f"gguf-block: wrote {f16.name} ({params / 1e9:.2f}B parameters) in {time.perf_counter() - t0:.0f} s")
        res = {"llama_cpp": version(), "config": cfg, "history": hist, "reps": reps, "threads": 1, "files": {}}
        for q, ftype in QUANTS.items():
            path = folder / f"sdar-{tag}-{q}.gguf"
            if not path.is_file():
                t0 = time.perf_counter()
                quantize(f16, path, ftype, max(1, os.cpu_count() or 1))
                log(f"gguf-block: quantized to {q} in {time.perf_counter() - t0:.0f} s")
            res["files"][q] = {
                "bytes": path.stat().st_size,
                "history": {str(n): step_times(path, n, reps, log) for n in hist},
            }
        try:
            res["masked"] = masked_steps(folder, quick, 3, log)
        except LocaldiffError as e:  # tiny-mdm missing: the block part stands alone
            res["masked"] = {"skipped": str(e)}
        return res
    finally:
        if tmp is not None:
            tmp.cleanup()


def render_md(sec: dict) -> list[str]:
    """Markdown of the section."""
    lines = [
        "## GGUF block step: localdiff on llama.cpp vs llama.cpp's own steps (random SDAR-1.7B shape, 1 thread)",
        "",
        f"{sec['llama_cpp']}; medians over {sec['reps']} interleaved repetitions (range in brackets), ms.",
        "",
        "| file | history | localdiff block step | denoise only | llama.cpp 4-token | llama.cpp 1-token "
        "| 1-token, default ctx | ours ÷ bare 4-token | break-even TPF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for q, f in sec["files"].items():
        for n, r in f["history"].items():
            ms, rg = r["ms"], r["range_ms"]

            def cell(k):
                return f"{ms[k]:.1f} ({rg[k][0]:.0f}–{rg[k][1]:.0f})"

            lines.append(
                f"| {q} ({f['bytes'] / 2**30:.2f} GiB) | {n} | {cell('localdiff_block_step')} | "
                f"{cell('localdiff_denoise')} | {cell('llama_cpp_4tok')} | {cell('llama_cpp_1tok')} | "
                f"{cell('llama_cpp_1tok_default_ctx')} | {r['overhead_vs_bare_4tok']:.2f} | "
                f"{r['break_even_tpf']:.2f} ({r['break_even_tpf_default_ctx']:.2f} default ctx) |"
            )
    lines += [
        "",
        "Break-even TPF = localdiff's block step ÷ llama.cpp's 1-token step on the same file: a block "
        "decoder beats autoregressive decoding of the same model in the same engine above it.",
    ]
    mk = sec.get("masked")
    if mk and "skipped" in mk:
        lines += ["", f"Masked caches on GGUF: skipped ({mk['skipped']})."]
    elif mk:
        ms = mk["ms"]
        lines += [
            "",
            f"Masked caches on GGUF ({mk['model']}, {mk['prompt']}-token prompt, {mk['answer']} answer "
            f"positions, blocks of {mk['block']}, 1 thread), ms per step: no cache {ms['none_full_pass']:.1f}, "
            f"refresh {ms['refresh_pass']:.1f}, prefix {ms['prefix_step']:.1f}, dual {ms['dual_step']:.1f} (the "
            f"block's first {ms['dual_first_step']:.1f}: it relabels the suffix cells) — "
            f"dual **{mk['dual_speedup']:.1f}×** the uncached step (target ≥ 5×), prefix "
            f"{mk['prefix_speedup']:.1f}×.",
        ]
    return lines
