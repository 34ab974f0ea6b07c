"""Train the `tiny` model's BPE tokenizer with the `tokenizers` library and write the tokenizer files.

Writes into --out: tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json.

Design: Gemma-style special tokens at fixed ids (<pad>=0, <eos>=1, <bos>=2, <unk>=3, <start_of_turn>=4,
<end_of_turn>=5, <mask>=6); SentencePiece-like metaspace ("▁") words; every digit is its own token
(so arithmetic is learnable) and punctuation is split off. A word's letters merge as usual, which is why the
letter tasks spell words with spaces. Vocabulary: --vocab-size (default 512) learned from generated task text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<mask>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "<start_of_turn>{{ role }}{{ '\\n' }}{{ (ns.system if role == 'user' else '') + message['content'] | trim }}"
    "<end_of_turn>{{ '\\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model{{ '\\n' }}{%- endif -%}"
)


def build_tokenizer(vocab_size: int, seed: int, n_texts: int = 20000) -> Tokenizer:
    """Train and return the BPE tokenizer (deterministic for a given seed)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", "isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    rng = random.Random(seed)
    texts = []
    for _ in range(n_texts):
        it = tasks.sample(rng)
        texts += [f"<start_of_turn>user\n{it['prompt']}<end_of_turn>\n<start_of_turn>model\n", it["answer"]]
    texts.append("The quick brown fox jumps over the lazy dog. Hello! How are you? I am a tiny model.")
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet, min_frequency=2, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write(out: Path, tok: Tokenizer) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for s in SPECIALS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "extra_special_tokens": {"start_of_turn_token": "<start_of_turn>", "end_of_turn_token": "<end_of_turn>"},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "mask_token": "<mask>",
            },
            indent=2,
        )
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = build_tokenizer(args.vocab_size, args.seed)
    write(args.out, tok)
    print(f"vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
