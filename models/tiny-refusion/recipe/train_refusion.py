"""Train `tiny-refusion`: a small ReFusion model (a Qwen3 causal LM + mask token) on the embedded model's task
families, on CPU, with localdiff's own ReFusion module (the checkpoint is written in ReFusion's upstream layout: a
Qwen3 config.json with ``mask_token_id``, ``model.*`` tensor names).

Objective: ReFusion's mixed loss (arXiv 2512.13586 §3; ML-GSAI/ReFusion ``qwen3/modeling_qwen3_refusion.py``
``forward_process`` + ``Qwen3ForCausalLM.forward``). Per sequence a slot size k is drawn from {4, 8, 16, 32}; the
answer region is cut into slots of k; t ~ U(0, 1), p = (1 − ε) t + ε; each slot is masked with probability p. The
input is prompt, then the CLEAN slots in a random order, then the MASKED slots (all mask tokens) in their original
order; every token keeps its true position id; attention is causal in this input order. AR loss: mean CE of each
clean slot token predicting the next token of the same slot (a slot's last token has no label). Masked-slot loss:
Σ CE(mask position → its own token) / p / answer length, over the batch size. Loss = AR + masked.

Answer region: the answer, ``<end_of_turn>``, then ``<end_of_turn>`` fill to G tokens (as tiny-mdm; upstream trains
on the exact answer + EOS only — the fill tells a fixed-length decoder where the answer ends). Task data:
``models/tiny/recipe/tasks.py`` and tiny-mdm's ``Data`` encoding (imported).

    python train_refusion.py --minutes 20 --threads 1 --out /tmp/tiny_refusion     # the shipped model
    python train_refusion.py --steps 3 --micro --out /tmp/x                        # smoke test
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
MODELS = HERE.parents[1]
TINY = MODELS / "tiny"
sys.path.insert(0, str(TINY / "recipe"))
sys.path.insert(0, str(MODELS / "tiny-mdm" / "recipe"))
import tasks  # noqa: E402,F401
import recipe_main  # noqa: E402  (the shared command line and training loop)
import train_mdm  # noqa: E402
from train_mdm import Data  # noqa: E402  (the chat-template encoding of one task item)


PAD, EOS, BOS, MASK = 0, 1, 2, 6  # the shared tokenizer's specials (<mask> is id 6)
SLOT_SIZES = (4, 8, 16, 32)


def build_config(vocab_size: int, micro: bool = False) -> dict:
    """The checkpoint's config.json: Qwen3's keys + ReFusion's mask id (as GSAI-ML/ReFusion's)."""
    h, layers, heads = (64, 2, 2) if micro else (128, 4, 4)
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": h // heads,
        "num_hidden_layers": layers,
        "intermediate_size": 8 * h // 3 // 8 * 8,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def refusion_batch(data: Data, n: int, rng: random.Random, eps: float = 1e-3):
    """One training batch in ReFusion's layout (module docstring), right-padded.

    Returns (ids, positions, keys, labels, is_masked, weight): LongTensor[B, T] ×2, BoolTensor[B, T], LongTensor[B, T]
    (−100 = no label), BoolTensor[B, T], FloatTensor[B, T] (the masked-slot weight 1 / (p · answer length)).
    """
    rows = []
    while len(rows) < n:
        p, a = data.encode(tasks.sample(data.rng))
        if len(a) > data.gen:
            continue
        a = a + [data.eot] * (data.gen - len(a))
        k = rng.choice(SLOT_SIZES)
        slots = [list(range(i, min(i + k, len(a)))) for i in range(0, len(a), k)]
        pm = (1 - eps) * rng.random() + eps
        masked = [rng.random() < pm for _ in slots]
        clean = [s for s, m in zip(slots, masked) if not m]
        rng.shuffle(clean)
        ids, pos, lab, msk = list(p), list(range(len(p))), [-100] * len(p), [False] * len(p)
        for s in clean:
            ids += [a[j] for j in s]
            pos += [len(p) + j for j in s]
            lab += [a[j] for j in s[1:]] + [-100]
            msk += [False] * len(s)
        for s, m in zip(slots, masked):
            if m:
                ids += [MASK] * len(s)
                pos += [len(p) + j for j in s]
                lab += [a[j] for j in s]
                msk += [True] * len(s)
        rows.append((ids, pos, lab, msk, 1.0 / (pm * len(a))))
    t = max(len(r[0]) for r in rows)
    pad = [t - len(r[0]) for r in rows]
    ids = torch.tensor([r[0] + [PAD] * d for r, d in zip(rows, pad)])
    pos = torch.tensor([r[1] + list(range(len(r[1]), len(r[1]) + d)) for r, d in zip(rows, pad)])
    keys = torch.tensor([[True] * len(r[0]) + [False] * d for r, d in zip(rows, pad)])
    lab = torch.tensor([r[2] + [-100] * d for r, d in zip(rows, pad)])
    msk = torch.tensor([r[3] + [False] * d for r, d in zip(rows, pad)])
    w = torch.tensor([[r[4]] * t for r in rows])
    return ids, pos, keys, lab, msk, w


def refusion_loss(net, batch) -> torch.Tensor:
    """AR loss (mean over clean-slot labels) + masked-slot loss (Σ CE · weight / B); fp32 scalar."""
    ids, pos, keys, lab, msk, w = batch
    logits = net.forward_train(ids, pos, keys)
    ar = (lab != -100) & ~msk
    loss = F.cross_entropy(logits[ar], lab[ar]) if bool(ar.any()) else logits.sum() * 0
    if bool(msk.any()):
        ce = F.cross_entropy(logits[msk], lab[msk], reduction="none")
        loss = loss + (ce * w[msk]).sum() / ids.shape[0]
    return loss


def save(net, config: dict, out: Path, mod) -> None:
    """tiny-mdm's writer (weights under the upstream names, config.json, tokenizer), then ReFusion's
    generation_config.json."""
    train_mdm.save(net, config, out, mod)
    eot = Tokenizer.from_file(str(TINY / "tokenizer.json")).token_to_id("<end_of_turn>")
    gc = {
        "eos_token_id": [EOS, eot],
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "mask_token_id": MASK,
        "max_new_tokens": 32,
        "slot_size": 8,
        "serial_num_blocks": 1,
        "slot_threshold": 0.3,
        "token_threshold": 0.3,
        "temperature": 0.0,
    }  # eval_refusion.py's best held-out point (README)
    (out / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")


def main() -> None:
    a = recipe_main.parse_args(__doc__, minutes=20.0, ckpt_every=5.0)
    tok, config, mod, net = recipe_main.setup(a, build_config)
    data = Data(tok, (TINY / "chat_template.jinja").read_text(), a.gen, a.seed)
    rng = random.Random(a.seed + 1)
    recipe_main.train(
        a,
        net,
        lambda: refusion_batch(data, a.batch, rng),
        lambda b: refusion_loss(net, b),
        lambda n: save(n, config, a.out, mod),
    )


if __name__ == "__main__":
    main()
