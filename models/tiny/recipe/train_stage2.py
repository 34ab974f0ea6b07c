"""Train the embedded `tiny` model with localdiff's own modules, from scratch or continuing a checkpoint.

Same objective as train.py (uniform-noise canvas denoising given the causal prefix, self-conditioning on a share of
the steps, loss over the canvas), made cheaper per example:
* the prefix is encoded once and its K/V shared by ``--draws`` independently noised copies of the target canvas;
* batches are built from length-sorted pools, so little of the encoder's work is padding;
* family weights can shift the mix (``--weights add=6,reverse=5``) toward the families still below their floor.

Because localdiff's backbone equals the reference to 1e-6 (tests/arch/test_backbone.py), a checkpoint trained here is a
normal DiffusionGemma checkpoint: it is written in the Hub layout (``model.decoder.*`` names, the encoder's own
``layer_scalar``s, the stage-1 file's other tensors copied unchanged).

    python train_stage2.py --steps 5000 --out /tmp/tiny            # from scratch (the shipped recipe)
    python train_stage2.py --init /tmp/tiny_stage1 --minutes 40 --out /tmp/tiny_stage2
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tasks  # noqa: E402
import train as stage1  # noqa: E402

from localdiff.arch.base import BlockCache  # noqa: E402
from localdiff.arch.diffusion_gemma import DiffusionGemma, checkpoint_names  # noqa: E402
from localdiff.loader import load_model  # noqa: E402


class GradCache(BlockCache):
    """Autograd-friendly KV cache with the interface DiffusionGemma.prefill/denoise use (concatenation only)."""

    def __init__(self, windows):
        self.w = windows
        self.k = [None] * len(windows)
        self.v = [None] * len(windows)
        self.mask = None
        self.seq_len = 0

    def visible_len(self, i):
        return 0 if self.k[i] is None else self.k[i].shape[2]

    def past(self, i):
        return None if self.k[i] is None else (self.k[i], self.v[i])

    def past_mask(self, i):
        return None if self.mask is None else self.mask[:, self.seq_len - self.visible_len(i) :]

    def append(self, i, k, v):
        w = self.w[i]
        if w is not None and k.shape[2] > w - 1:
            k, v = k[:, :, -(w - 1) :], v[:, :, -(w - 1) :]
        self.k[i], self.v[i] = k, v

    def commit(self, n, mask, b, ids=None):
        self.mask = mask
        self.seq_len += n

    def reset(self):
        self.__init__(self.w)

    def with_canvas(self, i, k, v):
        if self.k[i] is None:
            return k, v
        return torch.cat([self.k[i], k], 2), torch.cat([self.v[i], v], 2)

    def repeat(self, r: int) -> None:
        """Share each row's prefix with r canvases (batch B → B*r, rows repeated in place)."""
        self.k = [None if t is None else t.repeat_interleave(r, 0) for t in self.k]
        self.v = [None if t is None else t.repeat_interleave(r, 0) for t in self.v]
        if self.mask is not None:
            self.mask = self.mask.repeat_interleave(r, 0)


def batches(data: stage1.Data, n: int, pool: int):
    """Length-bucketed batches: draw pool*n examples, sort by prefix length, yield n-sized chunks."""
    while True:
        items = []
        for _ in range(pool):
            ids, mask, tgt = data.batch(n)
            for r in range(n):
                keep = ids[r][mask[r]]
                items.append((keep, tgt[r]))
        items.sort(key=lambda x: len(x[0]))
        chunks = [items[i : i + n] for i in range(0, len(items), n)]
        random.Random(len(items) + int(items[0][0].sum())).shuffle(chunks)
        for ch in chunks:
            L = max(len(p) for p, _ in ch)
            ids = torch.zeros(len(ch), L, dtype=torch.long)
            mask = torch.zeros(len(ch), L, dtype=torch.bool)
            for r, (p, _) in enumerate(ch):
                ids[r, L - len(p) :] = p
                mask[r, L - len(p) :] = True
            yield ids, (None if bool(mask.all()) else mask), torch.stack([t for _, t in ch])


def canvas_loss(
    net: DiffusionGemma,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    target: torch.Tensor,
    draws: int,
    gen: torch.Generator,
    self_condition: bool,
) -> torch.Tensor:
    """The model's objective on one batch: mean cross-entropy over every canvas position.

    ids: LongTensor[B, T] left-padded prefixes (mask Bool[B, T] or None); target: LongTensor[B, C] clean canvases.
    Each prefix is encoded once (causal prefill with autograd) and its K/V shared by ``draws`` copies of its target,
    each corrupted with uniform noise at its own rate t ~ U(0, 1). With ``self_condition``, a no-grad first pass
    gives the logits fed (detached) as self-conditioning to the graded pass.
    """
    prefill, denoise = DiffusionGemma.prefill.__wrapped__, DiffusionGemma.denoise.__wrapped__
    vocab = net.config.vocab_size
    target = target.repeat_interleave(draws, 0)
    b, c = target.shape
    t = torch.rand(b, 1, generator=gen)
    noisy = torch.where(torch.rand(b, c, generator=gen) < t, torch.randint(0, vocab, (b, c), generator=gen), target)
    cache = GradCache(net.layer_windows())
    prefill(net, ids, cache, mask)
    cache.repeat(draws)
    sc = None
    if self_condition:
        with torch.no_grad():
            sc = denoise(net, noisy, cache, None).detach()
    logits = denoise(net, noisy, cache, sc)
    return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))


def save(net: DiffusionGemma, init: Path, out: Path) -> None:
    """Write net in the Hub layout into out (stage-1 file's non-text tensors and metadata files copied)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(init / "model.safetensors"))
    for local, t in list(net.named_parameters()) + list(net.named_buffers()):
        name = next(c for c in checkpoint_names(local) if c in tensors)
        tensors[name] = t.detach().to(tensors[name].dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in init.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue from this checkpoint (default: a fresh reference-initialised model)",
    )
    ap.add_argument("--tokenizer-dir", type=Path, default=HERE.parent, help="tokenizer + template (fresh start)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="prefixes per step")
    ap.add_argument("--draws", type=int, default=4, help="noised canvases per prefix")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sc-prob", type=float, default=0.5)
    ap.add_argument("--weights", default="", help="family weights, e.g. add=6,reverse=5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--history-prob",
        type=float,
        default=0.0,
        help="share of items that follow 1-2 earlier chat turns (multi-turn chats)",
    )
    ap.add_argument("--micro", action="store_true", help="tiny config for tests (fresh start only)")
    ap.add_argument("--ckpt-every", type=float, default=5.0)
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    for kv in filter(None, args.weights.split(",")):
        k, v = kv.split("=")
        tasks.WEIGHTS[k] = float(v)
    if args.init is None:  # fresh start: transformers' own initialisation, saved in the Hub layout, then loaded
        from transformers import DiffusionGemmaForBlockDiffusion

        vocab_size = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json")).get_vocab_size()
        args.init = args.out / "init"
        stage1.save(
            DiffusionGemmaForBlockDiffusion(stage1.build_config(vocab_size, micro=args.micro)),
            args.tokenizer_dir,
            args.init,
        )
    net, cfg = load_model(args.init, "cpu", torch.float32)
    net.train().requires_grad_(True)
    for name, buf in net.named_buffers():
        buf.requires_grad_(False)
    tok = Tokenizer.from_file(str(args.init / "tokenizer.json"))
    data = stage1.Data(
        tok,
        (args.init / "chat_template.jinja").read_text(),
        cfg.canvas_length,
        args.seed,
        history_prob=args.history_prob,
    )
    stream = batches(data, args.batch, pool=8)
    gen = torch.Generator().manual_seed(args.seed)
    coin = random.Random(args.seed)
    run = stage1.Run(args, net, "canvases/s")
    while run.next_lr() is not None:
        ids, mask, target = next(stream)
        loss = canvas_loss(net, ids, mask, target, args.draws, gen, coin.random() < args.sc_prob)
        run.update(loss, target.shape[0] * args.draws)
        if run.checkpoint_due():
            save(net, args.init, args.out)
    save(net, args.init, args.out)
    run.done()


if __name__ == "__main__":
    main()
