"""A word-level tokenizer for baby checkpoints: token ``t<i>`` is id i, whitespace-split, ``t0`` for unknown words,
so a test's prompt ``"t5 t6 t7"`` is ids [5, 6, 7] in every model family's ``localdiff gen -m <folder>``."""

from __future__ import annotations

from pathlib import Path


def save_wordlevel_tokenizer(folder: Path, vocab_size: int) -> Path:
    """Write ``folder/tokenizer.json`` with the words ``t0 .. t<vocab_size − 1>``; returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return path
