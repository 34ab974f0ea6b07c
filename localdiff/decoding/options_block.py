"""Decoder options of the block family (exact block KV cache): SDAR's decoder. A block-family decoder policy is one
frozen dataclass here (registered in :mod:`localdiff.decoding.options`) plus its policy file in ``decoding/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt
from localdiff.errors import UsageError


@dataclass(frozen=True)
class BlockSampling(Options):
    """Sampling options shared by SDAR's and LLaDA2's block decoders (their upstream ``generate`` functions take the
    same three): temperature 0 = the top token, its probability = the confidence; else top-k / top-p filtered
    sampling. Errors: :class:`UsageError` for top-k / top-p given at temperature 0."""

    temperature: float = temperature_opt(0.0, "sampling temperature (0 = the top token, its probability = confidence)")
    top_k: int | None = opt(
        None, "sample among the k most likely tokens", kind=int, lo=1, hi=1_000_000_000, optional=True, metavar="K"
    )
    top_p: float | None = opt(
        None, "nucleus sampling mass", kind=float, lo=0, hi=1, lo_open=True, optional=True, metavar="P"
    )

    def check(self, typed: Mapping[str, str]) -> None:
        if (
            self.temperature == 0
            and (self.top_k is not None or self.top_p not in (None, 1.0))
            and ("top_k" in typed or "top_p" in typed)
        ):
            key = "top_k" if "top_k" in typed else "top_p"
            raise UsageError(f"{typed[key]}: top-k / top-p sampling needs temperature > 0 (got temperature 0)")


@decoder("sdar", "block", policy="localdiff.decoding.sdar:SDAR", family_default=True)
@dataclass(frozen=True)
class SDAROptions(BlockSampling):
    """SDAR's block decoder (JetAstra/SDAR ``generate.py`` ``block_diffusion_generate``, arXiv 2510.06303): per block,
    ``steps`` denoising steps with the schedule ``get_num_transfer_tokens(block, steps)``; each step commits the
    ``k`` most confident masked positions (``low_confidence_static``), or every masked position above
    ``confidence_threshold`` when at least ``k`` are (``low_confidence_dynamic``); ``sequential`` commits the first
    ``k`` masks; ``entropy_bounded`` commits the lowest-entropy masks while their entropies sum below
    ``eb_threshold`` (at least one). Sampling: :class:`BlockSampling`."""

    steps: int | None = opt(
        None,
        "denoising steps per block (default: the block size, one token per step)",
        kind=int,
        lo=1,
        hi=100_000,
        optional=True,
        metavar="N",
        aliases=("denoising_steps",),
    )
    remasking_strategy: str = opt(
        "low_confidence_dynamic",
        "which predictions to commit each step",
        choices=("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded"),
        aliases=("remasking",),
    )
    confidence_threshold: float = opt(
        0.85,
        "low_confidence_dynamic: commit every masked position whose "
        "confidence exceeds this (when at least the step's quota do)",
        lo=0,
        hi=1,
        metavar="X",
    )
    eb_threshold: float = opt(
        0.35,
        "entropy_bounded: commit the lowest-entropy masked positions while their "
        "entropies (nats) sum below this (at least one per step)",
        lo=0,
        metavar="G",
    )


@decoder("fast_dllm_v2", "block", model_types=("fast_dllm_qwen",))
@dataclass(frozen=True)
class FastDLLMv2Options(Options):
    """Fast-dLLM v2's decoder (``Efficient-Large-Model/Fast_dLLM_v2_*`` ``modeling.py`` ``generate``, arXiv
    2509.26328): blocks of the model's ``bd_size``, each decoded sub-block by sub-block (``small_block_size``
    tokens, left to right); per step the masked positions of the sub-block whose confidence exceeds ``threshold``
    are committed, and always the most confident one; logits are token-shifted; a block's first token is decoded
    autoregressively from the previous block's last logits. Sampling: temperature 0 = the top token; else top-p.
    The finished blocks' K/V are always cached (exact: ``kv_cache`` none and prefix both mean this); ``kv_cache``
    dual, or upstream's ``use_block_cache``, adds upstream's sub-block DualCache (``block_past_key_values``,
    :mod:`localdiff.decoding.fastdllm_v2`). Errors: :class:`UsageError` for ``use_block_cache`` with another
    ``kv_cache`` than dual."""

    threshold: float = opt(
        0.9,
        "commit every masked position of the sub-block with confidence above this (and "
        "always the most confident one); 1 = one token per step",
        lo=0,
        hi=1,
        metavar="TAU",
        aliases=("tau",),
    )
    small_block_size: int = opt(
        8, "sub-block length (tokens); must divide the block size", lo=1, hi=100_000, metavar="N"
    )
    temperature: float = temperature_opt(0.0, "sampling temperature (0 = the top token)")
    top_p: float = opt(0.95, "nucleus sampling mass (temperature > 0)", lo=0, hi=1, lo_open=True, metavar="P")
    use_block_cache: bool = opt(
        False,
        "Fast-dLLM v2's sub-block cache: once a sub-block's first token is known, "
        "steps run only the sub-block over the block's cached K/V (approximate unless "
        "small_block_size = the block size)",
    )
    kv_cache: str = opt(
        "prefix",
        "none / prefix: the finished blocks' exact K/V; dual: also Fast-dLLM v2's "
        "sub-block cache inside a block (= use_block_cache)",
        choices=("none", "prefix", "dual"),
    )

    @property
    def sub_block_cache(self) -> bool:
        """Whether upstream's sub-block cache runs (``kv_cache`` dual or ``use_block_cache``)."""
        return self.use_block_cache or self.kv_cache == "dual"

    def check(self, typed: Mapping[str, str]) -> None:
        if self.use_block_cache and self.kv_cache != "dual" and "kv_cache" in typed:
            raise UsageError(
                f"{typed.get('use_block_cache', 'use_block_cache')}: the sub-block cache is kv_cache "
                f"dual; give one of them (got kv_cache={self.kv_cache!r})"
            )
