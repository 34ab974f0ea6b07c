"""Decoder options of the slots family: ReFusion's plan-and-infill decoder (ML-GSAI/ReFusion ``generate.py``
``generate_refusion``, arXiv 2512.13586). Names and defaults are ``generate_refusion``'s keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass

from localdiff.decoding.schema import Options, decoder, opt, temperature_opt


@decoder("refusion", "slots", policy="localdiff.decoding.refusion:Refusion", family_default=True)
@dataclass(frozen=True)
class RefusionOptions(Options):
    """ReFusion's decoder (:mod:`localdiff.decoding.refusion`): the answer (``gen_length`` = our max_new_tokens,
    padded to whole slots) is cut into slots of ``slot_size`` tokens and ``serial_num_blocks`` sequential blocks;
    each round plans (slot score = probability of a slot's first drafted token; slots above ``slot_threshold``, else
    the best one), verifies the picked drafts globally and otherwise infills them autoregressively in parallel,
    accepting tokens whose verify probability exceeds ``token_threshold``."""

    slot_size: int = opt(8, "tokens per slot (the unit planned, infilled and committed)", lo=1, hi=4096, metavar="K")
    serial_num_blocks: int = opt(
        2,
        "sequential blocks the answer is split into (slots are planned within the current block only)",
        lo=1,
        hi=100_000,
        metavar="N",
    )
    slot_threshold: float = opt(
        0.9,
        "plan: pick every slot whose first-token probability exceeds this (else the single best slot)",
        lo=0,
        hi=1,
        metavar="P",
    )
    token_threshold: float = opt(
        0.9,
        "verify: accept a drafted token when the causal pass gives it a probability above this",
        lo=0,
        hi=1,
        metavar="P",
    )
    temperature: float = temperature_opt(0.0, "Gumbel-max sampling temperature of the plan's drafts (0 = argmax)")
