"""localdiff reads a checkpoint's tokenizer files as transformers does (issue 40 item 13): the same special tokens
(``tokenizer_config.json`` merged with ``special_tokens_map.json`` in the legacy layout, ignored in the modern one)
and the same rendered chat prompt as ``apply_chat_template`` — with and without a system message, two turns, with
and without the generation prompt. The folders are our own small ones (a word-level tokenizer and templates written
here in the shapes the catalog's families use); tests/fixtures/real/SOURCE.md says which published files exist."""

from __future__ import annotations

import json

import pytest
from jinja2 import TemplateError

from localdiff.errors import CheckpointError
from localdiff.tokenizer import SPECIAL_TOKENS, ChatTemplateError, Tokenizer

SPECIALS = ["<s>", "</s>", "<pad>", "<mask>", "<unk>", "<|im_start|>", "<|im_end|>"]

#: templates of our own, one per prompt shape the catalog uses: ChatML with a default system turn, a BOS-led
#: header template, role tags with the mask token named, and one that reads ``tools`` / every special token
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are "
        "helpful.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "bos_headers": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|h|>' + message['role'] + '<|/h|>\n\n' + message['content'] | trim + eos_token %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|h|>assistant<|/h|>\n\n' }}{% endif %}"
    ),
    "roles": (
        "{% for m in messages %}<role>{{ m['role'] | upper }}</role>{{ m['content'] }}<|role_end|>{% endfor %}"
        "{% if add_generation_prompt %}<role>ASSISTANT</role>{{ mask_token }}{% endif %}"
    ),
    "every_special": (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ mask_token }}|"
        "{{ sep_token is defined }}|{{ cls_token is defined }}|{{ tools is defined }}|{{ tools }}|"
        "{{ documents }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ),
}

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "t5 t6"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "t5 t6"}],
    "two_turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "t5"},
        {"role": "assistant", "content": " t7 "},
        {"role": "user", "content": "t8 t9"},
    ],
}

#: (tokenizer_config.json extra keys, special_tokens_map.json or None): the layouts transformers treats differently
LAYOUTS = {
    "legacy_map_only": (
        {},
        {
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "lstrip": False},
            "pad_token": "<pad>",
            "mask_token": "<mask>",
            "unk_token": "<unk>",
        },
    ),
    "legacy_map_overrides": (
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "</s>"},
        {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>"},
    ),
    "config_only": (
        {
            "bos_token": {"__type": "AddedToken", "content": "<s>"},
            "eos_token": "<|im_end|>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
        None,
    ),
    "modern_ignores_map": (
        {
            "eos_token": "<|im_end|>",
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, t in enumerate(SPECIALS)
            },
        },
        {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>"},
    ),
}


def _repo(folder, template: str, layout: str):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = {t: i for i, t in enumerate(SPECIALS)}
    words.update({f"t{i}": len(SPECIALS) + i for i in range(20)})
    tok = HFTokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    extra, smap = LAYOUTS[layout]
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[template], **extra}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if smap is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(smap))
    return folder


def _transformers(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_special_tokens_are_the_ones_transformers_reads(layout, tmp_path):
    folder = _repo(tmp_path, "every_special", layout)
    theirs = _transformers(folder).special_tokens_map
    ours = {k: v for k, v in Tokenizer(folder, [], None).special.items() if v is not None}
    assert ours == theirs
    assert set(ours) <= set(SPECIAL_TOKENS)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rendered_prompt_is_transformers_apply_chat_template(template, layout, tmp_path):
    folder = _repo(tmp_path, template, layout)
    hf, ours = _transformers(folder), Tokenizer(folder, [], None)
    for name, messages in CONVERSATIONS.items():
        for gen in (True, False):
            try:
                want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            except TemplateError:  # a token the template needs is not set: both refuse
                with pytest.raises(ChatTemplateError):
                    ours.apply_chat_template(messages, add_generation_prompt=gen)
                continue
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want, (name, gen)


def test_a_special_tokens_map_that_is_not_an_object_is_one_line(tmp_path):
    folder = _repo(tmp_path, "chatml", "legacy_map_only")
    (folder / "special_tokens_map.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="special_tokens_map.json: not a JSON object"):
        Tokenizer(folder, [], None)
