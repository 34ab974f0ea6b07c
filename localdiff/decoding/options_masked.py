"""Decoder options of the masked family: Fast-dLLM's shared options, LLaDA's and Dream's decoders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt
from localdiff.errors import UsageError


@dataclass(frozen=True)
class DInferParams:
    """The parameters of dInfer's credit and hierarchy decoders (inclusionAI/dInfer, ``parallel_decoding``), with
    dInfer's benchmark defaults; shared by the ``llada`` and ``llada2`` decoders (mixed into their options)."""

    low_threshold: float = opt(
        0.3,
        "dInfer hierarchy decoding: a masked run's most confident position is committed only above this",
        lo=0,
        hi=1,
        metavar="P",
    )
    credit_alpha: float = opt(
        0.7, "dInfer credit decoding: weight of log(1 + credit) added to the logits", lo=0, metavar="A"
    )
    boost_gamma: float = opt(
        0.2, "dInfer credit decoding: credit added per step = top-1 probability ^ gamma", lo=0, metavar="G"
    )
    decay_beta: float = opt(0.8, "dInfer credit decoding: per-step decay of the credit", lo=0, hi=1, metavar="B")


@dataclass(frozen=True)
class _FastDLLM(Options):
    """Fast-dLLM's parallel decoding and approximate caches (NVlabs/Fast-dLLM, arXiv 2505.22618), shared by the
    masked family's decoders. ``kv_cache`` is Fast-dLLM's use_cache / dual_cache (``cache`` is Model.stream's)."""

    threshold: float | None = opt(
        None,
        "Fast-dLLM parallel decoding: also commit every masked position of the "
        "block with confidence ≥ τ (off = the step schedule)",
        kind=float,
        lo=0,
        hi=1,
        lo_open=True,
        optional=True,
        metavar="TAU",
    )
    factor: float | None = opt(
        None,
        "Fast-dLLM factor rule: commit the n most confident while the n-th has confidence ≥ 1 − factor/(n+1)",
        kind=float,
        lo=0,
        lo_open=True,
        optional=True,
        metavar="F",
    )
    kv_cache: str = opt(
        "none",
        "approximate K/V cache (Fast-dLLM): none, prefix (prompt + finished blocks) or dual "
        "(also the masked suffix); refreshed at each block",
        choices=("none", "prefix", "dual"),
    )
    stop_at_eos: bool = opt(
        True,
        "end the generation after the first block that holds an EOS (off: decode every "
        "block, as LLaDA's generate.py and llama.cpp's diffusion loop; same answer, more forwards)",
    )

    def check(self, typed: Mapping[str, str]) -> None:
        if self.threshold is not None and self.factor is not None:
            raise UsageError(
                f"{typed.get('factor', 'factor')}: give either threshold or factor, not both "
                f"(got threshold={self.threshold}, factor={self.factor})"
            )
        if getattr(self, "cfg_scale", 0) > 0 and self.kv_cache != "none":
            raise UsageError(
                f"{typed.get('kv_cache', 'kv_cache')}: classifier-free guidance (cfg_scale > 0) "
                f"needs kv_cache none (got {self.kv_cache!r})"
            )


@decoder("llada", "masked", policy="localdiff.decoding.llada:LLaDA", family_default=True)
@dataclass(frozen=True)
class LLaDAOptions(DInferParams, _FastDLLM):
    """LLaDA's decoder (ML-GSAI/LLaDA ``generate.py``, arXiv 2502.09992): ``gen_length`` (our max_new_tokens) masks,
    semi-autoregressive blocks, ``steps`` split over blocks and within a block, low-confidence / random remasking,
    Gumbel-max sampling, classifier-free guidance; plus Fast-dLLM's options. ``noise``: whose draw shapes
    (:mod:`localdiff.decoding.llada`)."""

    steps: int | None = opt(
        None,
        "denoising steps over the whole answer, split evenly over blocks (default: one token per step)",
        kind=int,
        lo=1,
        hi=1_000_000,
        optional=True,
        metavar="N",
    )
    block_length: int = opt(32, "semi-autoregressive block length (tokens)", lo=1, hi=1_000_000, metavar="N")
    temperature: float = temperature_opt(0.0, "Gumbel-max sampling temperature (0 = argmax)")
    cfg_scale: float = opt(0.0, "classifier-free guidance scale (unconditional = prompt masked)", lo=0, metavar="W")
    remasking: str = opt("low_confidence", "which predictions to commit", choices=("low_confidence", "random"))
    noise: str = opt(
        "block",
        "random numbers of the Gumbel noise / random remasking: block (the block's only) or "
        "upstream (the shapes upstream's generate draws: a seed then gives upstream's tokens; costs a "
        "vocabulary of draws per sequence position per step)",
        choices=("block", "upstream"),
    )
    kv_cache: str = opt(
        "none",
        "approximate K/V cache (Fast-dLLM): none, prefix (prompt + finished blocks), dual "
        "(also the masked suffix), refreshed at each block; vicinity (dInfer): dual, each step "
        "recomputing the block and --prefix-look / --after-look tokens around it",
        choices=("none", "prefix", "dual", "vicinity"),
    )
    parallel_decoding: str | None = opt(
        None,
        "dInfer's parallel decoders (inclusionAI/dInfer): threshold (the "
        "top-1 and every confidence ≥ τ), credit (threshold over credit-fused "
        "logits), hierarchy (each masked run's best above --low-threshold, or "
        "> τ); τ = --threshold, default 0.9 (off = Fast-dLLM's rules / the schedule)",
        kind=str,
        choices=("threshold", "credit", "hierarchy"),
        optional=True,
        metavar="DECODER",
    )
    start_block_align: bool = opt(
        False,
        "dInfer's block layout: blocks at multiples of --block-length from the "
        "sequence start (the first one shares the prompt's tail), not from the answer's",
    )
    prefix_look: int = opt(
        16, "kv_cache vicinity: tokens before the block recomputed each step", lo=0, hi=1_000_000, metavar="N"
    )
    after_look: int = opt(
        16, "kv_cache vicinity: tokens after the block recomputed each step", lo=0, hi=1_000_000, metavar="N"
    )
    warmup_steps: int = opt(
        4,
        "kv_cache vicinity: the generation's first N steps are uncached full passes",
        lo=0,
        hi=1_000_000,
        metavar="N",
        aliases=("warmup_times",),
    )
    logits_eos_inf: bool = opt(
        False,
        "LLaDA's logits_eos_inf (paper's Appendix B.4): the EOS token's logit is −inf at "
        "every step, so it is never predicted",
    )
    confidence_eos_eot_inf: bool = opt(
        False,
        "LLaDA's confidence_eos_eot_inf as its generate.py runs it: the "
        "end-of-turn token's logit is −inf in the confidence softmax (a predicted "
        "EoT gets confidence 0: committed last)",
    )

    def check(self, typed: Mapping[str, str]) -> None:
        super().check(typed)
        if self.parallel_decoding is not None and self.factor is not None:
            raise UsageError(
                f"{typed.get('factor', 'factor')}: the factor rule is Fast-dLLM's, not one of dInfer's "
                f"decoders (got parallel_decoding={self.parallel_decoding!r})"
            )
        if self.parallel_decoding is not None and self.confidence_eos_eot_inf:
            raise UsageError(
                f"{typed.get('confidence_eos_eot_inf', 'confidence_eos_eot_inf')}: dInfer's decoders "
                f"compute their own confidences (got parallel_decoding={self.parallel_decoding!r})"
            )
        if self.parallel_decoding is not None and self.remasking != "low_confidence":
            raise UsageError(
                f"{typed.get('remasking', 'remasking')}: dInfer's decoders commit by confidence; "
                f"remasking must be low_confidence (got {self.remasking!r})"
            )


@decoder("dream", "masked", policy="localdiff.decoding.dream:Dream", model_types=("dream",))
@dataclass(frozen=True)
class DreamOptions(_FastDLLM):
    """Dream's decoder (HKUNLP/Dream ``generation_utils.py`` ``diffusion_generate``, arXiv 2508.15487): timesteps
    linspace(1, eps, steps + 1), ``alg``, ``alg_temp``, temperature / top_p / top_k, shifted logits; ``block_length``
    (Fast-dLLM's Dream) splits the answer into semi-autoregressive blocks; plus Fast-dLLM's options."""

    steps: int | None = opt(
        None,
        "denoising steps over the whole answer (default: one token per step)",
        kind=int,
        lo=1,
        hi=1_000_000,
        optional=True,
        metavar="N",
    )
    block_length: int | None = opt(
        None,
        "semi-autoregressive block length (default: one block)",
        kind=int,
        lo=1,
        hi=1_000_000,
        optional=True,
        metavar="N",
    )
    temperature: float = temperature_opt(0.0, "sampling temperature (0 = argmax)")
    top_p: float | None = opt(
        None, "nucleus sampling mass", kind=float, lo=0, hi=1, lo_open=True, optional=True, metavar="P"
    )
    top_k: int | None = opt(
        None, "sample among the k most likely tokens", kind=int, lo=1, hi=1_000_000_000, optional=True, metavar="K"
    )
    alg: str = opt(
        "entropy",
        "which predictions to commit: origin (random), maskgit_plus (top-1 probability), "
        "topk_margin (top-1 − top-2), entropy (lowest entropy)",
        choices=("origin", "maskgit_plus", "topk_margin", "entropy"),
    )
    alg_temp: float | None = opt(
        None,
        "sample the committed positions from softmax(confidence / alg_temp) (off or 0 = the most confident)",
        kind=float,
        lo=0,
        optional=True,
        metavar="T",
    )
    eps: float = opt(1e-3, "last timestep of the schedule", lo=0, hi=1, lo_open=True, hi_open=True, metavar="E")
    block_rule: str = opt(
        "auto",
        "each block's steps: dream (Dream's rule per block, its first step from the "
        "refresh pass), fastdllm (Fast-dLLM v1's Dream block loop: the refresh pass commits the "
        "block's first position, later steps rank by entropy or apply --threshold), auto = "
        "fastdllm with --kv-cache prefix / dual (and --alg entropy or --threshold), else dream",
        choices=("auto", "dream", "fastdllm"),
    )

    def check(self, typed: Mapping[str, str]) -> None:
        super().check(typed)
        if self.block_rule == "fastdllm" and self.alg != "entropy" and self.threshold is None and self.factor is None:
            raise UsageError(
                f"{typed.get('alg', 'alg')}: Fast-dLLM's Dream block loop (block_rule fastdllm) ranks "
                f"by entropy; use alg entropy or block_rule dream (got alg={self.alg!r})"
            )

    def fastdllm_blocks(self) -> bool:
        """True when the blocks run Fast-dLLM v1's Dream loop (``block_rule``; ``auto``: a prefix / dual cache with
        ``alg`` entropy, upstream's ranking, or a parallel rule, which ranks by the top-1 probability in both)."""
        if self.block_rule != "auto":
            return self.block_rule == "fastdllm"
        parallel = self.threshold is not None or self.factor is not None
        return self.kv_cache in ("prefix", "dual") and (self.alg == "entropy" or parallel)
