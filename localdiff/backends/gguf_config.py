"""The model a GGUF header describes (torch-free: ``show``, ``list``, the loader's checks): our model_type and family
(masked diffusion archs by ``general.architecture``; block-diffusion models stored under their backbone's
autoregressive architecture and marked ``localdiff.family = "block"``), the config fields the engine reads, and the
caches llama.cpp gives it. The header itself is read by :mod:`localdiff.backends.gguf_file`."""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.backends.gguf_file import ArrayLen, GGUFHeader, check_complete, read_header
from localdiff.errors import CheckpointError

#: GGUF ``general.architecture`` → our model_type (``localdiff.arch.REGISTRY``) for the diffusion archs we run
ARCHS = {"llada": "llada", "llada-moe": "lladamoe", "dream": "Dream"}
#: block-diffusion models are stored under llama.cpp's autoregressive architecture of their backbone, marked by
#: ``localdiff.family = "block"``: ``localdiff.model_type`` → (our model_type, the GGUF architecture it needs)
BLOCK_TYPES = {
    "sdar": ("sdar", "qwen3"),
    "sdar_moe": ("sdar_moe", "qwen3moe"),
    "fast_dllm_v2": ("Fast_dLLM_Qwen", "qwen2"),
    "Fast_dLLM_Qwen": ("Fast_dLLM_Qwen", "qwen2"),
}
#: other diffusion architectures llama.cpp computes that localdiff's decoders do not cover yet
OTHER_DIFFUSION = ("rnd1", "dflash")
#: LLaDA2.x: llama.cpp has no graph for it yet (its pull request, ggml-org/llama.cpp#17454, is open)
LLADA2 = ("llada2", "llada2_moe", "llada2-moe", "llada_moe_v2", "bailingmoe2")
#: (mask id) when the file has no ``tokenizer.ggml.mask_token_id`` — what upstream code hard-codes per model
DEFAULT_MASK = {"llada": 126336, "lladamoe": 156895, "Dream": 151666}


@dataclass(frozen=True)
class GGUFConfig:
    """What the engine reads from a model's config (the fields of ``localdiff.arch.llama_base_spec.LlamaConfig`` /
    ``block_spec.BlockConfig`` that the runners and loops use), from a GGUF header.

    ``shift_logits``: ``diffusion.shift_logits`` when present, else True — llama.cpp's ``diffusion-cli.cpp`` rule
    (Dream's converter writes no key; LLaDA's and LLaDA-MoE's write false); False for block models. ``quant``: the
    file's quantization label. ``family``: "masked" or "block"; ``block_size`` (block models:
    ``localdiff.block_length``) and ``token_shift`` (Fast-dLLM v2). ``raw``: the header's metadata (long arrays as :class:`ArrayLen`)."""

    model_type: str
    architecture: str
    vocab_size: int
    mask_token_id: int
    eos_token_id: tuple
    pad_token_id: int | None
    bos_token_id: int | None
    shift_logits: bool
    max_position_embeddings: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    quant: str
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    family: str = "masked"
    block_size: int = 0
    token_shift: bool = False

    @property
    def canvas_length(self) -> int:
        """The block loop's canvas: one block (block models; ``localdiff.decoding.loop``)."""
        return self.block_size


def _vocab_size(h: GGUFHeader) -> int:
    toks = h.metadata.get("tokenizer.ggml.tokens")
    if isinstance(toks, ArrayLen):
        return toks.n
    if isinstance(toks, list):
        return len(toks)
    n = h.arch_key("vocab_size")
    if n is None:
        raise CheckpointError(f"{h.path}: GGUF has no vocabulary (tokenizer.ggml.tokens)")
    return int(n)


def _kind(h: GGUFHeader) -> tuple[str, str]:
    """(our model_type, family) of a header, or CheckpointError naming why localdiff does not run it."""
    arch, md = h.architecture, h.metadata
    lt = md.get("localdiff.model_type")
    if arch in LLADA2 or (isinstance(lt, str) and lt.lower().replace("-", "_") in LLADA2):
        raise CheckpointError(
            f"{h.path}: LLaDA2.x is not in llama.cpp yet (its pull request, "
            "ggml-org/llama.cpp#17454, is open); run the safetensors checkpoint instead"
        )
    if md.get("localdiff.family") == "block":
        if lt not in BLOCK_TYPES:
            raise CheckpointError(
                f"{h.path}: localdiff.model_type {lt!r} is not a block-diffusion type localdiff "
                f"runs from GGUF ({', '.join(k for k in BLOCK_TYPES if k != 'Fast_dLLM_Qwen')})"
            )
        mt, want = BLOCK_TYPES[lt]
        if arch != want:
            raise CheckpointError(
                f"{h.path}: a {lt} model is stored as GGUF architecture {want!r}, this file says {arch!r}"
            )
        return mt, "block"
    if arch not in ARCHS:
        if arch in OTHER_DIFFUSION:
            raise CheckpointError(
                f"{h.path}: GGUF architecture {arch!r} is a diffusion model localdiff does not run "
                f"yet (supported: {', '.join(ARCHS)})"
            )
        raise CheckpointError(
            f"{h.path}: not a diffusion model (GGUF architecture {arch!r}; localdiff runs "
            f"{', '.join(ARCHS)}, and qwen3 / qwen3moe / qwen2 files marked localdiff.family = "
            "block)"
        )
    return ARCHS[arch], "masked"


def config_from_header(h: GGUFHeader) -> GGUFConfig:
    """The :class:`GGUFConfig` of a GGUF header.

    Raises:
        CheckpointError: an autoregressive architecture ("not a diffusion model"), a diffusion architecture localdiff
            does not run (LLaDA2.x: not in llama.cpp yet), or missing hyper-parameters (the key is named).
    """
    arch = h.architecture
    mt, family = _kind(h)

    def need(name):
        v = h.arch_key(name)
        if v is None:
            raise CheckpointError(f"{h.path}: GGUF metadata has no '{arch}.{name}'")
        return int(v)

    vocab = _vocab_size(h)
    md = h.metadata
    block = family == "block"
    tok_mask = md.get("tokenizer.ggml.mask_token_id", None if block else DEFAULT_MASK[mt])
    mask = md.get("localdiff.mask_token_id", tok_mask) if block else tok_mask
    if mask is None or not 0 <= int(mask) < vocab:
        key = "localdiff.mask_token_id" if block else "tokenizer.ggml.mask_token_id"
        raise CheckpointError(f"{h.path}: no mask token ({key}) inside the vocabulary")
    size = int(md.get("localdiff.block_length", 0) or 0) if block else 0
    if block and size < 1:
        raise CheckpointError(f"{h.path}: GGUF metadata has no 'localdiff.block_length' (the block size)")
    eos = tuple(int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md)
    eos = tuple(dict.fromkeys(eos))
    pad = md.get("tokenizer.ggml.padding_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    heads = need("attention.head_count")
    shift = md.get("diffusion.shift_logits")
    return GGUFConfig(
        model_type=mt,
        architecture=arch,
        vocab_size=vocab,
        mask_token_id=int(mask),
        eos_token_id=eos,
        pad_token_id=None if pad is None else int(pad),
        bos_token_id=None if bos is None else int(bos),
        shift_logits=False if block else (True if shift is None else bool(shift)),
        max_position_embeddings=need("context_length"),
        hidden_size=need("embedding_length"),
        num_hidden_layers=need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=int(h.arch_key("attention.head_count_kv", heads)),
        num_experts=int(h.arch_key("expert_count", 0) or 0),
        num_experts_per_tok=int(h.arch_key("expert_used_count", 0) or 0),
        quant=h.quant,
        raw=md,
        family=family,
        block_size=size,
        token_shift=mt == "Fast_dLLM_Qwen",
    )


def cache_modes(family: str, architecture: str | None = None) -> str:
    """What a GGUF model's caches are (``list`` / ``show`` / ``gen -v``): the block family's exact block cache, or
    the masked family's ``kv_cache`` modes — all in llama.cpp's K/V memory."""
    if family == "block":
        return "exact block cache (llama.cpp K/V memory)"
    if architecture == "llada-moe":
        return "kv_cache none (prefix / dual: no llama.cpp twin with K/V memory)"
    return "kv_cache none | prefix | dual (llama.cpp K/V memory)"


def describe(path) -> tuple[GGUFHeader, GGUFConfig]:
    """Header + config of a GGUF file, after the completeness check. Raises CheckpointError (one line)."""
    h = read_header(path)
    cfg = config_from_header(h)
    check_complete(h)
    return h, cfg
