"""Tokenizer and chat template of a checkpoint: ``tokenizer.json`` (HF tokenizers), ``tokenizer_config.json``
(merged with ``special_tokens_map.json`` as transformers 5.23 ``PreTrainedTokenizerBase.from_pretrained`` does),
``chat_template.jinja`` (or the ``chat_template`` key). Templates render in jinja2's immutable sandbox, as
transformers' ``apply_chat_template`` does, so a hostile template from a downloaded repo cannot run code or touch
files."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from localdiff.errors import CheckpointError, LocaldiffError


class ChatTemplateError(LocaldiffError):
    """The chat template failed to render or tried something the sandbox forbids."""


def _raise(msg):
    raise ChatTemplateError(f"chat template: {msg}")


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with the checkpoint's special tokens and chat template.

    Attributes: ``eos_token_ids`` (list[int]), ``pad_token_id``, ``bos_token``, ``chat_template`` (str or None),
    ``special`` (the named special tokens of :data:`SPECIAL_TOKENS`, str or None: the template's variables). A
    ``tokenizer_config.json`` without ``added_tokens_decoder`` (the legacy layout) takes its special tokens from
    ``special_tokens_map.json`` where both name one, as transformers does.

    Raises:
        CheckpointError: an unreadable ``tokenizer.json``, or a tokenizer JSON file that is not a JSON object.
    """

    def __init__(self, path: Path, eos_ids: list[int], pad_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{path / 'tokenizer.json'}: cannot load tokenizer ({e})") from None
        cfg = _json_file(path / "tokenizer_config.json")
        if "added_tokens_decoder" not in cfg:  # transformers' legacy merge: special_tokens_map.json's values win
            cfg = {**cfg, **_json_file(path / "special_tokens_map.json")}
        self.special = {k: _tok_str(cfg.get(k)) for k in SPECIAL_TOKENS}
        self.bos_token = self.special["bos_token"]
        self.eos_token = self.special["eos_token"]
        tpl = None
        if (path / "chat_template.jinja").is_file():
            tpl = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(cfg.get("chat_template"), str):
            tpl = cfg["chat_template"]
        self.chat_template = tpl
        self.eos_token_ids = list(eos_ids)
        self.pad_token_id = pad_id
        self.vocab_size = self._tok.get_vocab_size()
        self._env = None
        self._template = None  # (template text, compiled template): jinja compiles in ~10 ms, once per text

    def encode(self, text: str) -> list[int]:
        """Text → token ids (no special tokens added; chat templates carry their own BOS)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Token ids (list or LongTensor[T]) → text; special tokens dropped by default."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of one token string (e.g. ``"<|eot_id|>"``), or None when the vocabulary has no such token."""
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The token string of one id (for the canvas view)."""
        return self._tok.id_to_token(int(i))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role", "content"}]) with the checkpoint's template in the immutable sandbox.

        Raises:
            ChatTemplateError: no template, a render error (including Python errors raised while rendering, such as
                the sandbox's range limit), or a template that tries to escape the sandbox.
        """
        if not self.chat_template:
            raise ChatTemplateError("this checkpoint has no chat template; use raw mode (--raw / chat=False)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

        if self._env is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._env = env
        try:
            if self._template is None or self._template[0] != self.chat_template:
                self._template = (self.chat_template, self._env.from_string(self.chat_template))
            return self._template[1].render(  # the variables transformers' render_jinja_template passes
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in self.special.items() if v is not None},
            )
        except SecurityError as e:
            raise ChatTemplateError(f"refused: the template tried an unsafe operation ({e})") from None
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"render failed ({e})") from None
        except (
            OverflowError,
            RecursionError,
            MemoryError,
            ArithmeticError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
        ) as e:  # the sandbox's range limit (OverflowError), 1/0, a bad filter argument, ...
            raise ChatTemplateError(f"render failed ({type(e).__name__}: {e})") from None


#: the named special tokens a chat template sees (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _json_file(p: Path) -> dict:
    """A tokenizer JSON file as a dict ({} when absent). Raises CheckpointError for invalid JSON."""
    if not p.is_file():
        return {}
    try:
        out = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{p}: not a JSON object")
    return out


def _tok_str(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def load_tokenizer(path: Path, eos_ids: list[int], pad_id: int | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no ``tokenizer.json`` (ids in, ids out)."""
    if not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer(path, eos_ids, pad_id)


class PieceDecoder:
    """The text of one token id on its own, keeping a leading space: ``decode([id])`` alone loses it for decoders
    such as Metaspace (they drop the space at the start of a text), so decode after an anchor token and cut the
    anchor off (the prefix trick of incremental detokenization, as in vLLM's ``detokenize_incrementally`` and
    text-generation-inference's ``decode_token``).

    Args:
        tokenizer: anything with ``encode(str) -> list[int]`` and ``decode(list[int]) -> str``.
    Call ``decoder(token_id) -> str``: "" for a token the tokenizer cannot render alone (never raises).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._anchor: tuple | None = None

    def __call__(self, token_id: int) -> str:
        try:
            if self._anchor is None:
                ids = self.tokenizer.encode("a")
                self._anchor = (ids[-1], self.tokenizer.decode(ids[-1:])) if ids else ()
            if self._anchor:
                anchor_id, anchor_text = self._anchor
                both = self.tokenizer.decode([anchor_id, token_id])
                if both.startswith(anchor_text):
                    return both[len(anchor_text) :]
            return self.tokenizer.decode([token_id])
        except Exception:  # a token the tokenizer cannot render alone
            return ""
