"""Incremental detokenization: the text an answer's new token ids add, piece by piece (a canvas, a block, a
drafted run of tokens), so that the pieces joined equal ``decode(all ids)``.

Decoding each piece alone is wrong for the decoders that treat a sequence's first token specially: SentencePiece
and ``tokenizers``' Metaspace decoder (Llama, Gemma, the embedded models) drop the leading space of what they
decode, so a block that began with a space lost it ("41 + 93= 134." for "41 + 93 = 134.", block length 4).
Method: vLLM's ``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``): decode a window
that starts one piece back, once without and once with the new ids, and give the difference; a text that ends in
U+FFFD (an incomplete UTF-8 sequence of byte-fallback tokens) is held back until later ids complete it.
"""

from __future__ import annotations


class IncrementalText:
    """Turns token ids into text as they arrive. ``decode``: ``list[int] -> str`` (the tokenizer's), or None
    (every piece's text is then "")."""

    __slots__ = ("decode", "ids", "prefix", "read")

    def __init__(self, decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # where the decoding window starts: the start of the last piece given as text
        self.read = 0  # ids before this have been given as text

    def add(self, ids) -> str:
        """The text that ``ids`` (list[int], no EOS or pad: the caller strips them) add to the answer; "" when
        they add none yet (nothing decodable, or an incomplete UTF-8 sequence held back)."""
        if self.decode is None or not len(ids):
            return ""
        self.ids.extend(ids)
        before = self.decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    @property
    def pending(self) -> bool:
        """Whether some ids added have not been given as text yet."""
        return self.read < len(self.ids)
