"""Decoder options of the causal family (Qwen3 / Llama targets): plain sampling, and DFlash speculative decoding when
a draft is loaded. Names as llama.cpp / vLLM / transformers' ``generation_config.json`` (temperature, top_p, top_k)."""

from __future__ import annotations

from dataclasses import dataclass

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt


@decoder("causal", "causal", family_default=True)
@dataclass(frozen=True)
class CausalOptions(Options):
    """Autoregressive decoding (temperature 0 = greedy, else softmax(logits / T) restricted to the top-k then the
    top-p nucleus, as z-lab/dflash ``_sampling_probs`` and transformers' warpers: top-k first). With a DFlash draft
    (``--draft``), the same distribution verifies drafted blocks (lossless: greedy output = the target's own greedy
    output; sampling by the reference's rejection rule), and ``block_size`` overrides the draft's."""

    temperature: float = temperature_opt(0.0, "sampling temperature (0 = greedy argmax)")
    top_p: float = opt(1.0, "nucleus sampling mass (1 = off)", lo=0, hi=1, lo_open=True, metavar="P")
    top_k: int = opt(0, "sample among the k most likely tokens (0 = off)", lo=0, hi=1_000_000_000, metavar="K")
    block_size: int | None = opt(
        None,
        "DFlash: tokens per drafted block, the last accepted token included (default: the draft's block_size)",
        kind=int,
        lo=1,
        hi=4096,
        optional=True,
        metavar="N",
    )
