"""llama.cpp's 1-token step on a random Qwen3-1.7B-shaped Q4_K_M GGUF, for ``localdiff bench --only int4``.

The file: llama.cpp's ``qwen3`` architecture with SDAR-1.7B's sizes (:data:`localdiff.bench.block.SDAR_1_7B`; the
depth may be cut like the localdiff model's), weights N(0, 0.02²) and norms 1 written as F16 with gguf-py, then
``llama_model_quantize`` to Q4_K_M (llama.cpp's own quantizer, one thread); a stand-in byte-level BPE vocabulary of
151,936 tokens (the GPT-2 byte alphabet, then ``<tN>``), enough to feed token ids. Built once into the user cache
(``platformdirs.user_cache_dir("localdiff")/bench``) and reused. Random weights: only time per step is compared.

The step: 512 random tokens decoded once as history, then each step decodes one token at position 512 and removes
it from the KV memory (``llama_memory_seq_rm``), so every step sees the same 512-token history — the
autoregressive step a user of the Q4_K_M file runs. Context: one sequence, one thread, flash attention off, no
repacked extra buffers (``use_extra_bufts = False``, as :mod:`localdiff.backends.gguf`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table (the byte-level BPE alphabet), 256 strings."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_f16(out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """Write the random F16 ``qwen3`` GGUF (module docstring) to ``out``; returns it."""
    import gguf
    import numpy as np

    from localdiff.bench.block import SDAR_1_7B

    c = dict(SDAR_1_7B, **({"num_hidden_layers": layers} if layers else {}))
    h, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    nh, nkv, n_layers = c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = _byte_alphabet() + [f"<t{i}>" for i in range(256, v)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * v)
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    rng = np.random.default_rng(seed)

    def rnd(*s):
        return (rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)).astype(np.float16)

    w.add_tensor("token_embd.weight", rnd(v, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(n_layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "attn_q_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(b + "attn_k_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(b + "attn_q.weight", rnd(nh * hd, h))
        w.add_tensor(b + "attn_k.weight", rnd(nkv * hd, h))
        w.add_tensor(b + "attn_v.weight", rnd(nkv * hd, h))
        w.add_tensor(b + "attn_output.weight", rnd(h, nh * hd))
        w.add_tensor(b + "ffn_gate.weight", rnd(f, h))
        w.add_tensor(b + "ffn_up.weight", rnd(f, h))
        w.add_tensor(b + "ffn_down.weight", rnd(h, f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def q4_k_m(layers: int | None, log=print) -> Path:
    """The cached Q4_K_M file (built from a temporary F16 one when missing). Raises RuntimeError when llama.cpp's
    quantizer fails."""
    import platformdirs

    from localdiff.backends.gguf import llama_cpp

    lib = llama_cpp()

    d = Path(platformdirs.user_cache_dir("localdiff")) / "bench"
    d.mkdir(parents=True, exist_ok=True)
    out = d / f"qwen3-1.7b-shape-{layers or 28}l-q4_k_m.gguf"
    if out.is_file():
        return out
    f16 = d / f"qwen3-1.7b-shape-{layers or 28}l-f16.gguf.tmp"
    log(f"int4: writing a random Qwen3-1.7B-shaped F16 GGUF ({f16.name}), then llama.cpp's Q4_K_M of it")
    try:
        write_f16(f16, layers)
        p = lib.llama_model_quantize_default_params()
        p.ftype = lib.LLAMA_FTYPE_MOSTLY_Q4_K_M
        p.nthread = 1
        tmp = out.with_suffix(".tmp")
        rc = lib.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(p))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed (code {rc})")
        tmp.replace(out)
    finally:
        f16.unlink(missing_ok=True)
    return out


class Stepper:
    """A llama.cpp context over the Q4_K_M file with ``history`` tokens decoded; :meth:`step` = one 1-token step."""

    def __init__(self, path: Path, history: int):
        import numpy as np

        from localdiff.backends.gguf import llama_cpp

        lib = llama_cpp()  # initialised once, its log kept off the terminal
        self.lib, self.history = lib, history
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"{path}: llama.cpp could not load it")
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = history + 64, history, history
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, 1, 1
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.batch = lib.llama_batch_init(history, 0, 1)
        ids = np.random.default_rng(0).integers(300, 150000, history)
        self._decode(ids.tolist(), 0)
        self.info = {
            "file": path.name,
            "file_bytes": path.stat().st_size,
            "llama_cpp_python": lib.__version__,
            "threads": 1,
        }

    def _decode(self, ids: list[int], pos0: int) -> None:
        b = self.batch
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, int(i == len(ids) - 1)
            b.seq_id[i][0] = 0
        b.n_tokens = len(ids)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def step(self) -> None:
        """Decode one token at position ``history`` (its logits computed), then drop it from the KV memory."""
        self._decode([1234], self.history)
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, self.history, -1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def stepper(layers: int | None, history: int, log=print):
    """A :class:`Stepper` for the Q4_K_M file of ``layers`` layers, or a one-line reason string when llama.cpp
    (llama-cpp-python) or gguf-py is missing or fails."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python / gguf not installed ({e.name})"
    try:
        return Stepper(q4_k_m(layers, log), history)
    except (RuntimeError, OSError, AttributeError) as e:
        return f"llama.cpp: {e}"
