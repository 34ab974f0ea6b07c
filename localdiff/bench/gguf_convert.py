"""Convert a LLaDA-layout checkpoint (config.json + safetensors + tokenizer.json; e.g. the shipped ``tiny-mdm``) to
an F32 GGUF file for the ``gguf`` bench section — ``localdiff convert``'s writer
(:mod:`localdiff.backends.gguf_write`: llama.cpp tensor names, q/k rows permuted for its interleaved "NORM" RoPE,
``diffusion.shift_logits`` = false, non-causal attention; the tokenizer as :mod:`localdiff.backends.gguf_vocab`
writes it).

:func:`tokenizer_agreement` measures how often llama.cpp's encoding of a text equals the HF tokenizer's (the bench
reports it: a mismatch would cost both GGUF runs accuracy alike).
"""

from __future__ import annotations

from pathlib import Path


def convert_llada(ckpt: Path, out: Path) -> Path:
    """Write ``out`` (F32 GGUF) from the LLaDA checkpoint folder ``ckpt``. Returns ``out``.

    Raises:
        ImportError: the ``gguf`` package is missing (the gguf extra). ValueError: not a LLaDA checkpoint.
        CheckpointError: a layout llama.cpp cannot compute (one line).
    """
    from localdiff.arch import canonical_type
    from localdiff.backends.gguf_convert import convert_checkpoint
    from localdiff.paths import read_json

    if canonical_type(read_json(Path(ckpt) / "config.json")) != "llada":
        raise ValueError(f"{ckpt}: not a LLaDA checkpoint")
    convert_checkpoint(Path(ckpt), Path(out), "F32")
    return Path(out)


def tokenizer_agreement(hf_tokenizer, gguf_tokenizer, texts: list[str]) -> float:
    """Fraction of ``texts`` whose token ids are identical under both tokenizers (``encode``)."""
    same = sum(hf_tokenizer.encode(t) == gguf_tokenizer.encode(t) for t in texts)
    return same / max(len(texts), 1)
