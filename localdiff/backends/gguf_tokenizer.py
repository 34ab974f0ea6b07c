"""The tokenizer of a GGUF file, through llama.cpp (``llama_tokenize`` / ``llama_detokenize``)."""

from __future__ import annotations

import ctypes

from localdiff.tokenizer import Tokenizer


class GGUFTokenizer(Tokenizer):
    """The GGUF's own tokenizer (llama.cpp ``llama_tokenize`` / ``llama_detokenize``: the vocabulary, merges and
    pre-tokenizer the file declares) and its chat template (``tokenizer.chat_template``), rendered in the same jinja
    sandbox as safetensors checkpoints (:meth:`localdiff.tokenizer.Tokenizer.apply_chat_template`)."""

    def __init__(
        self,
        net: GGUFNet,  # noqa: F821 (backends.gguf.GGUFNet imports this module)
        eos_ids: list[int],
        pad_id: int | None,
    ):
        self.lib, self.vocab = net.lib, net.vocab
        md = net.config.raw
        tpl = md.get("tokenizer.chat_template")
        self.chat_template = tpl if isinstance(tpl, str) else None
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        self.special = {
            "bos_token": self._text(bos),
            "eos_token": self._text(eos),
            "pad_token": None,
            "unk_token": None,
        }
        self.bos_token, self.eos_token = self.special["bos_token"], self.special["eos_token"]
        self.eos_token_ids, self.pad_token_id = list(eos_ids), pad_id
        self.vocab_size = net.n_vocab
        self._env = None
        self._template = None  # compiled chat template (localdiff.tokenizer.Tokenizer.apply_chat_template)

    def _text(self, i):
        if i is None:
            return None
        return self.lib.llama_vocab_get_text(self.vocab, int(i)).decode("utf-8", "replace")

    def encode(self, text: str) -> list[int]:
        """Text → ids (special tokens in the text are parsed; no BOS added: chat templates carry their own)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, False, True)
        if n < 0:
            cap = -n
            buf = (self.lib.llama_token * cap)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, False, True)
        return list(buf[:n])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids (list or LongTensor[T]) → text; special tokens dropped by default."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if not ids:
            return ""
        arr = (self.lib.llama_token * len(ids))(*ids)
        cap = 16 * len(ids) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = self.lib.llama_detokenize(
                self.vocab, arr, len(ids), buf, cap, skip_special_tokens, not skip_special_tokens
            )
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = -n + 16
        return ""

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary string of one id."""
        return self._text(i)
