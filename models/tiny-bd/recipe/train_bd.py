"""Train `tiny-bd`: a small SDAR-architecture block-diffusion model (Qwen3 layers with q/k norms, block size 4) on
the embedded model's task families, on CPU, with localdiff's own block modules (the checkpoint is written in SDAR's
upstream layout: model_type "sdar", ``model.layers.N...`` tensor names).

Objective (block diffusion, BD3-LM arXiv 2503.09573 / SDAR's training mask ``block_diff_mask``): a sequence is
``r`` pad tokens (r ~ U{0..B-1}: block boundaries fall anywhere relative to the text, as left padding puts them at
inference), the chat-templated prompt, then an answer region of G tokens (the answer, ``<end_of_turn>``, then
``<end_of_turn>`` fill), right-padded. Blocks are B = 4 tokens at absolute positions. One noise level t ~ U(ε, 1)
per block; each answer token of the block is replaced by the mask token with probability t (the prompt never is).
The model runs over [noisy copy ; clean copy] (2L rows, both at positions 0..L-1): a noisy row attends to its own
block's noisy rows and to the clean rows of earlier blocks; a clean row attends block-causally to clean rows — at
inference the clean earlier blocks are exactly the KV cache. Loss = Σ over masked tokens of CE / t, divided by the
number of answer tokens (MDLM's weighting, as SDAR's fused diffusion cross-entropy).

Token-to-token noise (LLaDA2.1, arXiv 2602.08676, whose training mixes mask-to-token and token-to-token examples so
that committed tokens can be re-decided; its rates are not published, ours are ``--edit-blocks`` 0.5 and
``--edit-max`` 0.4): in edit blocks some visible answer tokens are replaced by other answer tokens and every
visible answer position of the block adds CE (weight 1) against the original token (:func:`corrupt`). The answer
region ends one ``<end_of_turn>`` block after the answer's block (``--fill``); batches are length-bucketed.

Reuses tiny-mdm's data encoding and writer, and the shared command line and loop
(``models/tiny/recipe/recipe_main.py``).

    python train_bd.py --minutes 49 --threads 1 --out /tmp/tiny_bd        # the shipped model
    python train_bd.py --steps 3 --micro --out /tmp/x                     # smoke test
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
sys.path.insert(0, str(MODELS / "tiny" / "recipe"))
sys.path.insert(0, str(MODELS / "tiny-mdm" / "recipe"))
import tasks  # noqa: E402
import recipe_main  # noqa: E402  (the shared command line and training loop)
import train_mdm  # noqa: E402
from train_mdm import BOS, EOS, MASK, PAD, Data  # noqa: E402

from localdiff.arch.dense import rope_cos_sin  # noqa: E402

BLOCK = 4
TINY = MODELS / "tiny"


def build_config(vocab_size: int, micro: bool = False) -> dict:
    """The checkpoint's config.json in SDAR's keys (model_type "sdar", ``SDARForCausalLM``)."""
    d, layers, heads = (64, 2, 2) if micro else (160, 4, 5)
    return {
        "model_type": "sdar",
        "architectures": ["SDARForCausalLM"],
        "hidden_size": d,
        "intermediate_size": 8 * d // 3 // 8 * 8,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": d // heads,
        "block_size": BLOCK,
        "vocab_size": vocab_size,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def batches(data: Data, n: int, rng: random.Random, fill: int | None = 1, pool: int = 4):
    """Endless batches of :func:`batch`: ``pool`` batches' rows are drawn, sorted by length and cut into ``pool``
    batches served in random order (less padding; the same rows, so the same data distribution)."""
    while True:
        rows = sorted(sample_rows(data, n * pool, rng, fill), key=lambda r: len(r[0]) + len(r[1]))
        chunks = [rows[i * n : (i + 1) * n] for i in range(pool)]
        rng.shuffle(chunks)
        yield from (batch(c) for c in chunks)


def sample_rows(data: Data, n: int, rng: random.Random, fill: int | None = 1) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt ids, answer-region ids) pairs: r ~ U{0..B-1} pads then the prompt; the answer region is the
    answer and ``<end_of_turn>``, filled with ``<end_of_turn>`` up to the end of its block and then ``fill`` more
    blocks (the decoder stops at the first EOS of a finished block, so later fill is never decoded); ``fill=None``:
    to G tokens (the first tiny-bd's region)."""
    rows = []
    while len(rows) < n:
        p, a = data.encode(tasks.sample(rng))
        if len(a) <= data.gen:
            p = [PAD] * rng.randrange(BLOCK) + p
            g = data.gen if fill is None else -(-(len(p) + len(a)) // BLOCK) * BLOCK + fill * BLOCK - len(p)
            rows.append((p, a + [data.eot] * (g - len(a))))
    return rows


def batch(rows: list[tuple[list[int], list[int]]]):
    """(ids [B, L], key mask [B, L], answer mask [B, L]) of :func:`sample_rows`' rows, right-padded."""
    n = len(rows)
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((n, width), PAD)
    keys = torch.zeros(n, width, dtype=torch.bool)
    ans = torch.zeros_like(keys)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        start = next(j for j, t in enumerate(p) if t != PAD)
        keys[i, start : len(p) + len(a)] = True
        ans[i, len(p) : len(p) + len(a)] = True
    return ids, keys, ans


def bd_mask(keys: torch.Tensor) -> torch.Tensor:
    """BoolTensor[B, 1, 2L, 2L] of the [noisy ; clean] pass (module docstring), padding keys excluded (a padding
    query sees itself)."""
    b, n = keys.shape
    blk = torch.arange(n) // BLOCK
    same, before = blk[:, None] == blk[None, :], blk[None, :] < blk[:, None]
    top = torch.cat([same, before], 1)
    bottom = torch.cat([torch.zeros(n, n, dtype=torch.bool), before | same], 1)
    m = torch.cat([top, bottom], 0)[None, None] & torch.cat([keys, keys], 1)[:, None, None, :]
    return m | torch.eye(2 * n, dtype=torch.bool)[None, None]


def corrupt(ids, ans, masked, edit_blocks: float, edit_max: float, gen: torch.Generator):
    """LLaDA2.1-style token-to-token noise (arXiv 2602.08676: the model learns to re-decide visible tokens as well as
    masks). A fraction ``edit_blocks`` of the blocks are edit blocks; in each, every visible (not masked) answer
    token is replaced with probability u ~ U(0, edit_max) (one u per block) by a token drawn from the batch's answer
    tokens (the empirical distribution: plausible wrong tokens, as a draft's errors are). Returns (noisy ids [B, L],
    BoolTensor[B, L] of the visible answer positions of edit blocks, corrupted or not: their loss targets the
    original token, so the model learns both to keep right tokens and to replace wrong ones)."""
    b, n = ids.shape
    nb = (n + BLOCK - 1) // BLOCK
    per_block = lambda x: x.repeat_interleave(BLOCK, 1)[:, :n]  # noqa: E731
    edit = per_block(torch.rand(b, nb, generator=gen) < edit_blocks) & ans & ~masked
    u = per_block(edit_max * torch.rand(b, nb, generator=gen))
    swap = edit & (torch.rand(ids.shape, generator=gen) < u)
    pool = ids[ans]
    repl = pool[torch.randint(len(pool), ids.shape, generator=gen)]
    return torch.where(swap, repl, ids), edit


def bd_loss(
    net, ids, keys, ans, gen: torch.Generator, eps: float = 1e-3, edit_blocks: float = 0.0, edit_max: float = 0.4
) -> torch.Tensor:
    """The block-diffusion loss (module docstring) plus, with ``edit_blocks`` > 0, the token-to-token term: CE
    (weight 1) at the visible answer positions of edit blocks (:func:`corrupt`); fp32 scalar."""
    b, n = ids.shape
    nb = (n + BLOCK - 1) // BLOCK
    t = ((1 - eps) * torch.rand(b, nb, generator=gen) + eps).repeat_interleave(BLOCK, 1)[:, :n]
    masked = (torch.rand(ids.shape, generator=gen) < t) & ans
    noisy, edit = (
        corrupt(ids, ans, masked, edit_blocks, edit_max, gen) if edit_blocks > 0 else (ids, torch.zeros_like(masked))
    )
    noisy = torch.where(masked, torch.full_like(ids, MASK), noisy)
    x = net.embed_tokens(torch.cat([noisy, ids], 1))
    cos, sin = rope_cos_sin(net._inv_freq, 0, n, x.device)
    cos, sin = torch.cat([cos, cos]), torch.cat([sin, sin])
    mask = bd_mask(keys)
    for layer in net.layers:
        att = layer.self_attn
        q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
        x = layer.ffn(x + att.attend(q, k, v, mask))
    rows = masked | edit
    h = net.norm(x[:, :n])[rows]
    ce = F.cross_entropy(F.linear(h, net.head_weight()).float(), ids[rows], reduction="none")
    weight = torch.where(masked[rows], 1 / t[rows], 1.0)
    return (ce * weight).sum() / ans.sum()


def save(net, config: dict, out: Path, mod) -> None:
    """tiny-mdm's writer (weights under the upstream names — SDAR's here —, config.json, tokenizer), then SDAR's
    generation_config.json."""
    train_mdm.save(net, config, out, mod)
    eot = Tokenizer.from_file(str(TINY / "tokenizer.json")).token_to_id("<end_of_turn>")
    gc = {
        "eos_token_id": [EOS, eot],
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "mask_token_id": MASK,
        "max_new_tokens": 32,
        "steps": BLOCK,
        "temperature": 0.0,
        "remasking_strategy": "low_confidence_dynamic",
        "confidence_threshold": 0.9,
    }
    (out / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")


def extra_args(ap) -> None:
    """train_bd's own flags."""
    ap.add_argument("--fill", type=int, default=1, help="EOS fill blocks after the answer's block (-1: to --gen)")
    ap.add_argument("--edit-blocks", type=float, default=0.5, help="token-to-token: fraction of edit blocks (0: off)")
    ap.add_argument("--edit-max", type=float, default=0.4, help="token-to-token: max corruption rate per block")


def main() -> None:
    a = recipe_main.parse_args(__doc__, minutes=25.0, ckpt_every=5.0, extra=extra_args)
    tok, config, mod, net = recipe_main.setup(a, build_config)
    data = Data(tok, (TINY / "chat_template.jinja").read_text(), a.gen, a.seed)
    stream = batches(data, a.batch, random.Random(a.seed), None if a.fill < 0 else a.fill)
    gen = torch.Generator().manual_seed(a.seed)
    recipe_main.train(
        a,
        net,
        lambda: next(stream),
        lambda b: bd_loss(net, *b, gen, edit_blocks=a.edit_blocks, edit_max=a.edit_max),
        lambda n: save(n, config, a.out, mod),
    )


if __name__ == "__main__":
    main()
