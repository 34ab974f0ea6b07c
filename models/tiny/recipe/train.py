"""Train the embedded `tiny` DiffusionGemma model on 2 CPU cores with the model's own objective.

Objective (block diffusion, uniform noise): for a chat item, the causal prefix is the chat-templated prompt plus
the answer's earlier canvases; the target is the next canvas of C answer tokens (the answer ends with
<end_of_turn>; the rest of the canvas is <pad>, as the reference `generate` pads after EOS). Each target token
is replaced by a uniformly random vocabulary token with probability t ~ U(0, 1) (one t per example); the decoder
denoises the canvas reading the encoder's KV of the prefix; loss = mean cross-entropy over all canvas positions.
Self-conditioning on a share of the steps (--sc-prob): a first decoder pass without it (no grad) gives logits that
are fed, detached, as `self_conditioning_logits` to the second pass, exactly the argument the reference
generation loop passes between denoising steps.

Uses transformers' DiffusionGemmaForBlockDiffusion forward (encoder fills a DynamicCache; the decoder reads it).
Batches are left-padded; padding is masked in both the encoder and the decoder (2-D masks).

    python train.py --minutes 45 --out /tmp/tiny_ckpt          # the shipped model
    python train.py --steps 5 --micro --out /tmp/x             # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tasks  # noqa: E402

PAD, EOS, BOS = 0, 1, 2
GEN_CONFIG = {  # sampler defaults shipped with the model (reference keys only: transformers rejects others):
    # the `localdiff bench` sweep's best accuracy-per-TPF point for the shipped weights (2026-11-29, 180 items):
    # 4 steps (42.2 % at TPF 4.59 vs 43.3 % at 2.35 with 16), then entropy bound 1.0 (41.1 % at TPF 4.85)
    "max_denoising_steps": 4,
    "t_min": 0.4,
    "t_max": 0.8,
    "sampler_config": {"entropy_bound": 1.0, "_cls_name": "EntropyBoundSamplerConfig"},
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "max_new_tokens": 256,
    "bos_token_id": BOS,
    "pad_token_id": PAD,
}


def build_config(vocab_size: int, micro: bool = False):
    """The tiny model's DiffusionGemmaConfig (text only). `micro` = a much smaller one for tests."""
    from transformers import DiffusionGemmaConfig

    h = 64 if micro else 192
    layers = 2 if micro else 4
    text = dict(
        vocab_size=vocab_size,
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=h // 4,
        global_head_dim=h // 4,
        layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"])
        if micro
        else ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=16 if micro else 48,
        max_position_embeddings=1024,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=h // 2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        final_logit_softcapping=30.0,
    )
    # transformers always builds a vision tower; give it a minimal config (text-only use; ~0.35M params)
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=8 if micro else 32,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        tie_word_embeddings=True,
    )


class Data:
    """Seeded stream of (prefix ids, target canvas ids) built from tasks.sample (train split only)."""

    def __init__(self, tok: Tokenizer, template: str, canvas: int, seed: int, history_prob: float = 0.0):
        self.tok, self.canvas, self.rng = tok, canvas, random.Random(seed)
        self.history_prob = history_prob  # share of items preceded by 1-2 earlier chat turns (other items)
        self.tpl = jinja2.Environment().from_string(template)
        self.eot = tok.token_to_id("<end_of_turn>")

    def encode_item(self, item: dict, history: list[dict] = ()) -> tuple[list[int], list[int]]:
        """-> (prompt ids incl. generation prompt, answer ids ending with <end_of_turn>); ``history`` items become
        earlier (user, model) turns of the same chat."""
        msgs = [
            m
            for h in history
            for m in ({"role": "user", "content": h["prompt"]}, {"role": "assistant", "content": h["answer"]})
        ]
        prompt = self.tpl.render(
            messages=msgs + [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, bos_token="<bos>"
        )
        p = self.tok.encode(prompt, add_special_tokens=False).ids
        full = self.tok.encode(prompt + item["answer"] + "<end_of_turn>", add_special_tokens=False).ids
        assert full[: len(p)] == p, "prompt tokens must be a prefix of the full chat tokens"
        return p, full[len(p) :]

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> prefix [n, L] (left-padded, long), prefix mask [n, L] (bool), target canvas [n, C] (long)."""
        C = self.canvas
        prefixes, targets = [], []
        for _ in range(n):
            hist = []
            if self.history_prob and self.rng.random() < self.history_prob:
                hist = [tasks.sample(self.rng) for _ in range(self.rng.randint(1, 2))]
            p, a = self.encode_item(tasks.sample(self.rng), hist)
            k = self.rng.randrange(math.ceil(len(a) / C))
            prefixes.append(p + a[: k * C])
            tgt = a[k * C : (k + 1) * C]
            targets.append(tgt + [PAD] * (C - len(tgt)))
        L = max(len(x) for x in prefixes)
        ids = torch.tensor([[PAD] * (L - len(x)) + x for x in prefixes])
        mask = torch.tensor([[False] * (L - len(x)) + [True] * len(x) for x in prefixes])
        return ids, mask, torch.tensor(targets)


def loss_step(model, ids, mask, target, vocab: int, sc: bool, gen: torch.Generator) -> torch.Tensor:
    """One training forward: noise the target canvas, (optionally) self-condition, return mean CE (fp32 scalar)."""
    B, C = target.shape
    t = torch.rand(B, 1, generator=gen)
    noise = torch.randint(0, vocab, (B, C), generator=gen)
    noisy = torch.where(torch.rand(B, C, generator=gen) < t, noise, target)
    dec_mask = torch.cat([mask, torch.ones(B, C, dtype=torch.bool)], dim=1)
    pkv = model.model.encoder(input_ids=ids, attention_mask=mask).past_key_values  # prefix KV (with grad)
    sc_logits = None
    if sc:
        with torch.no_grad():
            sc_logits = model(past_key_values=pkv, decoder_input_ids=noisy, decoder_attention_mask=dec_mask).logits
    logits = model(
        past_key_values=pkv,
        decoder_input_ids=noisy,
        decoder_attention_mask=dec_mask,
        self_conditioning_logits=sc_logits,
    ).logits
    return F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))


def save(model, tok_dir: Path, out: Path) -> None:
    """save_pretrained + tokenizer files + generation_config.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]:
        shutil.copy(tok_dir / f, out / f)
    eot = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id("<end_of_turn>")
    gc = dict(GEN_CONFIG, eos_token_id=[EOS, eot])
    (out / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")


class Run:
    """Bookkeeping shared by this trainer and train_stage2.py: the stop rule and lr schedule (``--steps``, else
    ``--minutes`` of wall time: warm-up over ``--warmup`` steps, then linear decay to 5 %), AdamW (β 0.9/0.98, weight
    decay 0.01 on matrices except norms), the optimizer step with grad-norm clip 1.0, EMA loss, progress lines
    every ``--log-every`` steps and checkpoints every ``--ckpt-every`` minutes (time-budgeted runs only)."""

    def __init__(self, args, model: torch.nn.Module, unit: str):
        self.args, self.model, self.unit = args, model, unit
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(0.9, 0.98),
        )
        self.t0 = self.last_ckpt = time.time()
        self.step, self.seen, self.ema, self.lr = 0, 0, None, args.lr

    def next_lr(self) -> float | None:
        """Set and return the next step's learning rate, or None when the run is over."""
        a, el = self.args, time.time() - self.t0
        if (a.steps is not None and self.step >= a.steps) or (a.steps is None and el >= a.minutes * 60):
            return None
        frac = self.step / a.steps if a.steps is not None else el / (a.minutes * 60)
        self.lr = a.lr * min(1.0, (self.step + 1) / a.warmup) * max(0.05, 1 - frac)
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        return self.lr

    def update(self, loss: torch.Tensor, n: int) -> None:
        """One optimizer step on ``loss`` (a batch of ``n`` examples), then the EMA and the progress line."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        self.seen += n
        value = loss.item()
        self.ema = value if self.ema is None else 0.98 * self.ema + 0.02 * value
        if self.step % self.args.log_every == 0 or self.step == 1:
            el = time.time() - self.t0
            print(
                f"step {self.step} t {el / 60:.1f}m loss {value:.4f} ema {self.ema:.4f} lr {self.lr:.2e} "
                f"{self.unit} {self.seen / el:.1f}",
                flush=True,
            )

    def checkpoint_due(self) -> bool:
        """True (and the timer restarts) when a time-budgeted run is due a checkpoint."""
        if self.args.steps is None and time.time() - self.last_ckpt > self.args.ckpt_every * 60:
            self.last_ckpt = time.time()
            return True
        return False

    def done(self) -> None:
        el = time.time() - self.t0
        print(
            f"done: {self.step} steps in {el / 60:.1f} min, {self.seen / el:.1f} {self.unit}, "
            f"final ema loss {self.ema:.4f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=45.0, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-dir", type=Path, default=HERE.parent)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--sc-prob", type=float, default=0.5)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU)")
    ap.add_argument("--micro", action="store_true", help="tiny config for tests")
    ap.add_argument("--init", type=Path, default=None, help="continue from this checkpoint's weights")
    ap.add_argument("--threads", type=int, default=1, help="1 is faster than 2 on a shared 2-core machine")
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import DiffusionGemmaForBlockDiffusion

    tok = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = build_config(vocab, micro=args.micro)
    if args.init is not None:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init).train()
        config = model.config
    else:
        model = DiffusionGemmaForBlockDiffusion(config).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M vocab {vocab} canvas {config.canvas_length}", flush=True)
    data = Data(tok, (args.tokenizer_dir / "chat_template.jinja").read_text(), config.canvas_length, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    run = Run(args, model, "ex/s")
    while run.next_lr() is not None:
        ids, mask, target = data.batch(args.batch)
        sc = random.Random(args.seed * 1_000_003 + run.step).random() < args.sc_prob
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_step(model, ids, mask, target, vocab, sc, gen)
        run.update(loss, args.batch)
        if run.checkpoint_due():
            save(model, args.tokenizer_dir, args.out)
            print(f"checkpoint at step {run.step}", flush=True)
    save(model, args.tokenizer_dir, args.out)
    run.done()


if __name__ == "__main__":
    main()
