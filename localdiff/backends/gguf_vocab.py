"""A checkpoint's tokenizer as GGUF ``tokenizer.*`` metadata (llama.cpp's vocabulary keys), for ``localdiff convert``
and the bench's converter — no ``transformers``, no llama.cpp checkout: ``tokenizer.json`` is read directly.

Two kinds of ``tokenizer.json`` BPE models are written (anything else — WordPiece, Unigram, WordLevel — is refused):

* **byte-level BPE** (GPT-2 / Qwen2 / Llama-3 style: a ``ByteLevel`` pre-tokenizer): ``tokenizer.ggml.model =
  "gpt2"``, the vocabulary strings as they are (already in GPT-2's byte-to-unicode alphabet), the merges, and the
  pre-tokenizer name llama.cpp uses for the ``Split`` regex found (:data:`PRE_TOKENIZERS`: Qwen2's → "qwen2",
  Llama-3's → "llama-bpe", none → "gpt-2"; an unknown regex → "default", reported as a note). This is what
  llama.cpp's ``convert_hf_to_gguf.py`` writes for Dream, SDAR and Fast-dLLM v2 (``_set_vocab_gpt2``).
* **SentencePiece-like BPE** (a ``Metaspace`` pre-tokenizer, "▁" for spaces): ``tokenizer.ggml.model = "llama"``;
  a merged token's score is minus its merge rank, so llama.cpp's highest-score-first bigram merging applies the
  merges in BPE order; ``<0xXX>`` byte-fallback tokens are BYTE. No space prefix for a Metaspace pre-tokenizer:
  llama.cpp would add it after every special token, Metaspace (``prepend_scheme: first``) only at offset 0 — so
  chat-templated text (it starts with a special token) tokenizes identically; raw text without a leading special
  token loses the leading "▁" of its first word. A Llama-2-style normalizer (``Prepend`` "▁" + ``Replace``) gets
  llama.cpp's space prefix.

Token types (llama.cpp ``llama_token_type``): NORMAL 1; added tokens CONTROL 3 when special, else USER_DEFINED 4;
ids without a string (the embedding has more rows than the vocabulary) are ``[PADi]`` UNUSED 5.
Special ids come from the parsed config (bos / eos / pad / mask), the extra end tokens of
``generation_config.json`` as ``eot``; the chat template from ``chat_template.jinja`` or ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from localdiff.errors import CheckpointError

#: a ``Split`` pre-tokenizer regex → llama.cpp's pre-tokenizer name (``llama-vocab.cpp``: the same regexes)
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {_WORDS + r"\p{N}" + _REST: "qwen2", _WORDS + r"\p{N}{1,3}" + _REST: "llama-bpe"}
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _steps(node) -> list[dict]:
    """The flat list of a (possibly ``Sequence``) pre-tokenizer / normalizer / decoder node."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        out = []
        for key in ("pretokenizers", "normalizers", "decoders"):
            for sub in node.get(key) or []:
                out += _steps(sub)
        return out
    return [node]


def read_vocab(ckpt: Path, n_tokens: int) -> dict:
    """The tokenizer of checkpoint folder ``ckpt`` as GGUF fields.

    Args:
        ckpt: folder with ``tokenizer.json``. n_tokens: the embedding's rows (the token list is padded to it).
    Returns:
        dict: ``model`` ("gpt2" | "llama"), ``pre``, ``tokens`` (list[str], n_tokens), ``types`` (list[int]),
        ``scores`` (list[float] | None), ``merges`` (list[str] | None), ``notes`` (list[str]: what the user should
        know, e.g. an unknown pre-tokenizer), ``template`` (str | None), ``add_bos`` (bool).
    Raises:
        CheckpointError: no / unreadable ``tokenizer.json``, not a BPE model, a vocabulary larger than the embedding.
    """
    path = ckpt / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (convert writes the tokenizer into the GGUF)")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
        vocab = dict(model["vocab"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None
    if model.get("type", "BPE") != "BPE" or not isinstance(vocab, dict):
        raise CheckpointError(
            f"{path}: a {model.get('type')} tokenizer; convert writes BPE tokenizers (byte-level "
            "or SentencePiece-style) only"
        )
    added = {int(a["id"]): a for a in tj.get("added_tokens") or []}
    for i, a in added.items():
        vocab.setdefault(a["content"], i)
    top = max(vocab.values(), default=-1) + 1
    if top > n_tokens:
        raise CheckpointError(f"{path}: token id {top - 1} is outside the model's {n_tokens} embedding rows")
    tokens, types = [f"[PAD{i}]" for i in range(n_tokens)], [UNUSED] * n_tokens
    for s, i in vocab.items():
        tokens[i], types[i] = s, NORMAL
    for i, a in added.items():
        types[i] = CONTROL if a.get("special") else USER_DEFINED
    pre_steps = _steps(tj.get("pre_tokenizer"))
    kinds = {s.get("type") for s in pre_steps} | {s.get("type") for s in _steps(tj.get("decoder"))}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    out = dict(tokens=tokens, types=types, notes=[], scores=None, merges=None)
    if "ByteLevel" in kinds:
        split = [s for s in pre_steps if s.get("type") == "Split"]
        regex = (split[0].get("pattern") or {}).get("Regex") if split else None
        pre = "gpt-2" if regex is None else PRE_TOKENIZERS.get(regex)
        if pre is None:
            pre = "default"
            out["notes"].append(
                f"{path.name}: pre-tokenizer regex not known to llama.cpp's list; wrote 'default' "
                "(text may split differently from the checkpoint's tokenizer)"
            )
        out.update(model="gpt2", pre=pre, merges=merges)
    elif "Metaspace" in kinds or any(s.get("type") == "Replace" for s in _steps(tj.get("normalizer"))):
        scores = [0.0] * n_tokens
        for rank, m in enumerate(merges):
            a, b = m.split(" ", 1)
            if a + b in vocab:
                scores[vocab[a + b]] = -float(rank + 1)
        if model.get("byte_fallback"):
            for i, s in enumerate(tokens):
                if types[i] == NORMAL and _BYTE_TOKEN.match(s):
                    types[i] = BYTE
        prepend = any(st.get("type") == "Prepend" for st in _steps(tj.get("normalizer")))  # Llama-2 style
        out.update(model="llama", pre="default", scores=scores, space_prefix=prepend)
    else:
        raise CheckpointError(
            f"{path}: BPE without a ByteLevel or Metaspace pre-tokenizer; convert cannot tell how "
            "llama.cpp should split text"
        )
    tc = _json(ckpt / "tokenizer_config.json")
    out["add_bos"] = bool(tc.get("add_bos_token", False))
    tpl = ckpt / "chat_template.jinja"
    template = tpl.read_text(encoding="utf-8") if tpl.is_file() else tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    out["template"] = template if isinstance(template, str) else None
    return out


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def end_tokens(ckpt: Path, eos: tuple) -> list[int]:
    """The ids ``generation_config.json`` ends generation at besides config.json's ``eos`` (in order)."""
    ends = _json(ckpt / "generation_config.json").get("eos_token_id")
    ends = ends if isinstance(ends, list) else [ends]
    return [int(e) for e in ends if isinstance(e, int) and e not in eos]


def write_vocab(w, v: dict, ids: dict) -> None:
    """Add the tokenizer fields of :func:`read_vocab` and the special ids to ``gguf.GGUFWriter`` ``w``.

    ``ids``: bos / eos / pad / mask / eot → int or None (None = not written)."""
    w.add_tokenizer_model(v["model"])
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if v["scores"] is not None:
        w.add_token_scores(v["scores"])
        w.add_add_space_prefix(bool(v.get("space_prefix")))
    if v["merges"] is not None:
        w.add_token_merges(v["merges"])
    w.add_add_bos_token(v["add_bos"])
    adders = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "pad": w.add_pad_token_id,
        "mask": w.add_mask_token_id,
        "eot": w.add_eot_token_id,
    }
    for key, add in adders.items():
        if ids.get(key) is not None:
            add(int(ids[key]))
    if v["template"]:
        w.add_chat_template(v["template"])
