"""Train `tiny-dflash`: a tiny Qwen3 target (causal LM) on the embedded model's task families, then a DFlash draft on
the target's OWN hidden states, in one time budget on CPU, with localdiff's own modules (checkpoints in the upstream
layouts: a Qwen3ForCausalLM folder ``target/`` and a z-lab DFlashDraftModel folder ``draft/``).

Stage 1 (target, ``--target-minutes``): sequences = chat-templated prompt + answer + ``<end_of_turn>``, right-padded;
next-token cross-entropy over the answer tokens (the prompt is context only).

Stage 2 (draft, the rest of ``--minutes``; DFlash, arXiv 2602.06036 §3): the target is frozen; per sequence its
features (outputs of ``target_layer_ids``) at every position; K anchors s drawn in the answer region; block j =
[token s_j, mask × (B − 1)] at positions s_j..s_j+B−1 attends to the projected features of positions < s_j and to
its own block (non-causally), exactly what one cached draft pass sees at decoding time; cross-entropy of the
target's LM head (shared, frozen) on block positions 1..B−1 against the sequence's tokens s_j+1.. (positions past
the answer's end are ignored). The labels are the data's answers, not the target's own generations (the paper
distils on target outputs; a well-fitted target makes the two close).

    python train_dflash.py --minutes 8 --target-minutes 5 --threads 1 --out /tmp/tiny_dflash    # the shipped pair
    python train_dflash.py --steps 3 --draft-steps 3 --micro --out /tmp/x                       # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "tiny"
sys.path.insert(0, str(TINY / "recipe"))
import tasks  # noqa: E402
from train import Run  # noqa: E402  (the recipe's bookkeeping: stop rule, lr, AdamW, EMA, logs)

from localdiff.arch import get_arch, get_spec  # noqa: E402

PAD, EOS, BOS, MASK = 0, 1, 2, 6  # the shared tokenizer's specials (<mask> is id 6)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def target_config(vocab: int, eot: int, micro: bool = False) -> dict:
    """The target's config.json (Qwen3 keys, tied embeddings)."""
    h, layers, heads, kv = (48, 2, 2, 1) if micro else (128, 4, 4, 2)
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": 3 * h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": h // heads,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "eos_token_id": [EOS, eot],
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "torch_dtype": "float32",
    }


def draft_config(target: dict, block: int) -> dict:
    """The draft's config.json (z-lab's layout: a Qwen3 config with DFlash keys)."""
    n = target["num_hidden_layers"]
    ids = [1, n - 1] if n > 2 else [0, 1]
    h = target["hidden_size"]
    return {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "vocab_size": target["vocab_size"],
        "hidden_size": h,
        "intermediate_size": 3 * h,
        "num_hidden_layers": 2,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "block_size": block,
        "num_target_layers": n,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": ids},
        "torch_dtype": "float32",
    }


class Data:
    """Seeded stream of right-padded (ids [B, L], answer mask [B, L]: True at answer tokens incl. <end_of_turn>)."""

    def __init__(self, tok: Tokenizer, seed: int):
        self.tok, self.rng = tok, random.Random(seed)
        self.tpl = jinja2.Environment().from_string((TINY / "chat_template.jinja").read_text())
        self.eot = tok.token_to_id("<end_of_turn>")

    def encode(self, item: dict) -> tuple[list[int], list[int]]:
        prompt = self.tpl.render(
            messages=[{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, bos_token="<bos>"
        )
        return (
            self.tok.encode(prompt, add_special_tokens=False).ids,
            self.tok.encode(item["answer"], add_special_tokens=False).ids + [self.eot],
        )

    def batch(self, n: int):
        rows = [self.encode(tasks.sample(self.rng)) for _ in range(n)]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((n, width), PAD, dtype=torch.long)
        ans = torch.zeros(n, width, dtype=torch.bool)
        for r, (p, a) in enumerate(rows):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
            ans[r, len(p) : len(p) + len(a)] = True
        return ids, ans


def target_loss(net, ids, ans) -> torch.Tensor:
    """Next-token CE over the answer tokens (position i predicts token i + 1)."""
    h, _ = net.hidden(ids)
    logits = net.logits(h[:, :-1])
    want = ans[:, 1:]
    return F.cross_entropy(logits[want], ids[:, 1:][want])


def draft_batch(ids, ans, block: int, anchors: int, gen: torch.Generator):
    """Anchors and the training blocks: (block ids [B, K·n], positions [B, K·n], labels [B, K·n] (-100 =
    ignored), attention mask Bool[B, 1, K·n, T + K·n])."""
    b, t = ids.shape
    kn = anchors * block
    blk = torch.full((b, kn), MASK, dtype=torch.long)
    pos = torch.zeros(b, kn, dtype=torch.long)
    lab = torch.full((b, kn), -100, dtype=torch.long)
    mask = torch.zeros(b, 1, kn, t + kn, dtype=torch.bool)
    for r in range(b):
        cand = ans[r].nonzero().flatten()
        first, last = int(cand[0]), int(cand[-1])  # blocks open at answer tokens, as at decoding time
        choices = torch.randint(first, last, (anchors,), generator=gen)
        for j, s in enumerate(choices.tolist()):
            lo = j * block
            blk[r, lo] = ids[r, s]
            pos[r, lo : lo + block] = torch.arange(s, s + block)
            for k in range(1, block):
                if s + k <= last:
                    lab[r, lo + k] = ids[r, s + k]
            mask[r, 0, lo : lo + block, :s] = True  # context strictly before the anchor
            mask[r, 0, lo : lo + block, t + lo : t + lo + block] = True  # its own block
    return blk, pos, lab, mask


def draft_loss(draft, target, ids, ans, block, anchors, gen) -> torch.Tensor:
    with torch.no_grad():
        _, feats = target.hidden(ids, layers=draft.target_layer_ids)
    blk, pos, lab, mask = draft_batch(ids, ans, block, anchors, gen)
    w = target.embed_tokens.weight
    h = draft.hidden_masked(draft.embed(blk, w), feats, pos, mask)
    logits = F.linear(h, target.head_weight())
    keep = lab >= 0
    return F.cross_entropy(logits[keep].float(), lab[keep])


def save(net, config: dict, out: Path, mod, gen_config: dict | None) -> None:
    """Weights under the upstream names + config.json (+ tokenizer and generation_config.json for the target)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {mod.checkpoint_names(k)[0]: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if gen_config is not None:
        for f in TOKENIZER_FILES:
            shutil.copy(TINY / f, out / f)
        (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")


def build(config: dict):
    mod, spec = get_arch(config), get_spec(config)
    net = mod.MODEL_CLASS(spec.parse_config(config)).train()
    with torch.no_grad():
        for _, p in net.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                p.fill_(1.0)
    return net, mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="total wall-clock budget (target + draft)")
    ap.add_argument("--target-minutes", type=float, default=9.0)
    ap.add_argument("--steps", type=int, default=None, help="target steps (tests; overrides the minutes)")
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--draft-batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=8, help="the draft's block_size")
    ap.add_argument("--anchors", type=int, default=4, help="training blocks per sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=float, default=5.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    t_start = time.time()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    data = Data(tok, a.seed)
    tcfg = target_config(tok.get_vocab_size(), data.eot, a.micro)
    gc = {
        "eos_token_id": [EOS, data.eot],
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "max_new_tokens": 64,
        "temperature": 0.0,
    }
    target, tmod = build(tcfg)
    a.minutes, total = a.target_minutes, a.minutes
    run = Run(a, target, "seqs/s")
    while run.next_lr() is not None:
        ids, ans = data.batch(a.batch)
        with torch.enable_grad():
            run.update(target_loss(target, ids, ans), a.batch)
        if run.checkpoint_due():
            save(target, tcfg, a.out / "target", tmod, gc)
    run.done()
    target.eval().requires_grad_(False)
    save(target, tcfg, a.out / "target", tmod, gc)
    dcfg = draft_config(tcfg, a.block)
    draft, dmod = build(dcfg)
    a.minutes = max(total - (time.time() - t_start) / 60 - 0.3, 0.5)
    a.steps, a.batch = a.draft_steps, a.draft_batch
    gen = torch.Generator().manual_seed(a.seed + 1)
    run = Run(a, draft, "seqs/s")
    while run.next_lr() is not None:
        ids, ans = data.batch(a.batch)
        with torch.enable_grad():
            run.update(draft_loss(draft, target, ids, ans, a.block, a.anchors, gen), a.batch)
        if run.checkpoint_due():
            save(draft, dcfg, a.out / "draft", dmod, None)
    run.done()
    save(draft.eval(), dcfg, a.out / "draft", dmod, None)
    print(f"total {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
