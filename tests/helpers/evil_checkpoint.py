"""A checkpoint whose tokenizer decodes to terminal control sequences (for the terminal-safety tests).

The shared random-weight checkpoint with its tokenizer replaced by a WordLevel vocabulary of the same size: the
special tokens keep their ids (pad 0, eos 1, bos 2, unk 3, turn markers 4/5, mask 6) and every other id decodes to
one of OSC "set window title" (``ESC ] 0 ; … BEL``), SGR colour (``ESC [ 31 m``), backspaces, a carriage return,
a C1 CSI (U+009B), DEL or a NUL, so whatever the model samples carries control characters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EVIL = ["\x1b]0;PWNED\x07", "\x1b[31mRED\x1b[0m", "ab\x08\x08XY", "\rOVER", "\x9b2J", "DEL\x7f", "nul\x00"]
CONTROL_BYTES = [b"\x1b", b"\x07", b"\x08", b"\r", b"\xc2\x9b", b"\x7f", b"\x00"]


def build_evil_checkpoint(src: Path, dst: Path) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with the control-sequence tokenizer; returns ``dst``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    vocab_size = json.loads((dst / "config.json").read_text())["text_config"]["vocab_size"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<mask>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"{EVIL[i % len(EVIL)]}{i}"] = i
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(dst / "tokenizer.json"))
    return dst
