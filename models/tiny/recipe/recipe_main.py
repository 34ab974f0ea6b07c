"""The command line and training loop shared by the diffusion recipes trained on the embedded model's task families
(``models/tiny-mdm``, ``models/tiny-refusion``, ``models/tiny-bd``): each recipe supplies its config, batches, loss
and writer; this module parses the common flags, builds the model from its config through localdiff's architecture
registry (N(0, 0.02) matrices, unit norms), and runs :class:`train.Run`'s loop with time-based checkpoints.

Flags: ``--minutes`` (wall-clock budget), ``--steps`` (a fixed number of steps instead: smoke tests), ``--batch``,
``--gen`` (answer region G, tokens), ``--lr``, ``--warmup``, ``--seed``, ``--threads``, ``--micro`` (a 2-layer
width-64 model: smoke tests), ``--log-every``, ``--ckpt-every`` (minutes), ``--out`` (the checkpoint folder), and
what a recipe adds through ``extra``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from train import Run  # the bookkeeping: stop rule, lr schedule, AdamW, EMA, logs

from localdiff.arch import get_arch, get_spec

TINY = Path(__file__).resolve().parents[1]


def parse_args(
    doc: str, minutes: float, ckpt_every: float, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The recipe's command line (module docstring); ``minutes`` / ``ckpt_every`` are the recipe's defaults."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=minutes)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32, help="answer region G (tokens)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=float, default=ckpt_every)
    ap.add_argument("--out", type=Path, required=True)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def setup(a: argparse.Namespace, build_config: Callable[[int, bool], dict]):
    """Threads and seed from ``a``; the shared tokenizer; the model of ``build_config(vocab, micro)`` in train mode
    with N(0, 0.02) matrices and unit vectors. Returns (tokenizer, config dict, arch module, fp32 model)."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    config = build_config(tok.get_vocab_size(), a.micro)
    mod, spec = get_arch(config), get_spec(config)
    net = mod.MODEL_CLASS(spec.parse_config(config)).train()
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                p.fill_(1.0)
    return tok, config, mod, net


def train(
    a: argparse.Namespace,
    net: torch.nn.Module,
    next_batch: Callable[[], object],
    loss: Callable[[object], torch.Tensor],
    save: Callable[[torch.nn.Module], None],
) -> None:
    """Run's loop: ``loss(next_batch())`` (an fp32 scalar with autograd) per optimizer step of ``a.batch``
    sequences, ``save(net)`` every ``--ckpt-every`` minutes and once at the end (in eval mode)."""
    run = Run(a, net, "seqs/s")
    while run.next_lr() is not None:
        b = next_batch()
        with torch.enable_grad():
            run.update(loss(b), a.batch)
        if run.checkpoint_due():
            save(net)
    run.done()
    save(net.eval())
