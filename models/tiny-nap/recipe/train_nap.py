"""Fine-tune `tiny-mdm` into `tiny-nap`: the masked tiny model on a multi-trajectory version of the embedded model's
task families (NAP's parallel data curation, arXiv 2602.23225: several independent worked attempts + a summary).

Data: each task item (``models/tiny/recipe/tasks.py``, train split; the long ``list`` family is left out) becomes
the canvas of parallel-forced decoding (:func:`localdiff.decoding.nap.layout`, the same template the decoder
prefills): ``<think 1>`` R(1) … ``<think m>`` R(m) ``<summary>`` S, m ∈ {1, 2, 3} per batch. Each R(j) is one worked
attempt drawn without replacement from the item's attempts (:func:`attempts`: the answer itself, a commuted or
checked form, another order of the steps, the letters moved with "->", ...), in random order (NAP's
``shuffle_think``), padded with ``<pad>`` to ``think_length``; S is the task's answer then ``<end_of_turn>`` fill to
``summary_length`` (as tiny-mdm's answer region). The tags are never masked.

Objective: tiny-mdm's, imported (``train_mdm.mdm_loss``: LLaDA SFT, t ~ U(ε, 1), masked CE / t over the maskable
positions = the think and summary contents).

    python train_nap.py --init /work/train/tiny_mdm --minutes 12 --threads 1 --out /tmp/tiny_nap
    python train_nap.py --init /tmp/some_mdm --steps 3 --out /tmp/x                            # smoke test
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tiny-mdm" / "recipe"))
import train_mdm  # noqa: E402  (tiny-mdm's objective, data encoding, checkpoint writer; it puts tasks on sys.path)
from train_mdm import PAD, Data, Run, mdm_loss, save, tasks  # noqa: E402

from localdiff.arch import get_arch, get_spec  # noqa: E402
from localdiff.decoding.nap import layout  # noqa: E402

THINK, SUMMARY = 32, 32  # think_length / summary_length the model is trained (and decodes) with


def attempts(item: dict) -> list[str]:
    """Independent worked attempts at one task item (each one a correct way to get the answer)."""
    fam, ans, prompt = item["family"], item["answer"], item["prompt"]
    out = [ans]
    nums = [int(x) for x in re.findall(r"\d+", ans)]
    if fam in ("add", "arith"):
        a, b, r = nums[0], nums[1], nums[2]
        if " + " in ans:
            out += [f"{b} + {a} = {r}.", f"{r} - {b} = {a}. so {a} + {b} = {r}."]
        else:
            out += [f"{b} + {r} = {a}. so {a} - {b} = {r}.", f"{a} - {r} = {b}. so {a} - {b} = {r}."]
    elif fam == "word_problem":
        a, b, s1, _, c, s2 = nums
        if a >= c:
            out.append(f"{a} - {c} = {a - c}. {a - c} + {b} = {s2}.")
        if b >= c:
            out.append(f"{b} - {c} = {b - c}. {a} + {b - c} = {s2}.")
    elif fam in ("reverse", "sort_letters", "sort_words"):
        src = prompt.split(": ", 1)[1]
        out.append(f"{src} -> {ans}")
    elif fam == "count_letter":
        ch = re.match(r"How many times does (\w) appear", prompt).group(1)
        n = int(ans)
        out.append(f"{' '.join([ch] * n)} = {n}" if n else f"no {ch} = 0")
    elif fam == "convert":
        v, r = nums[0], nums[1]
        out.append(f"{v} * {r // v} = {r}.")
    return out


class NapData(Data):
    """Seeded batches of (ids [B, L], key mask [B, L], maskable [B, L]) on the multi-trajectory canvas."""

    def __init__(self, tok: Tokenizer, template: str, seed: int):
        super().__init__(tok, template, SUMMARY, seed)
        self.enc = lambda s: tok.encode(s, add_special_tokens=False).ids

    def row(self, m: int):
        """(prompt ids, canvas ids, maskable flags) of one item with m attempts, or None when it does not fit."""
        item = tasks.sample(self.rng)
        if item["family"] == "list":
            return None
        p, a = self.encode(item)
        if len(a) > SUMMARY:
            return None
        tries = [self.enc(t) for t in attempts(item)]
        tries = [t for t in tries if len(t) <= THINK]
        if not tries:
            return None
        picks = [self.rng.choice(tries) for _ in range(m)] if len(tries) < m else self.rng.sample(tries, m)
        lay = layout(self.enc, m, THINK, SUMMARY)
        canvas, maskable = [t if t is not None else PAD for t in lay.ids], [t is None for t in lay.ids]
        for (s, _), r in zip(lay.think, picks):
            canvas[s : s + len(r)] = r
        s = lay.summary[0]
        canvas[s : s + SUMMARY] = a + [self.eot] * (SUMMARY - len(a))
        return p, canvas, maskable

    def batch(self, n: int, m: int):
        rows = []
        while len(rows) < n:
            r = self.row(m)
            if r is not None:
                rows.append(r)
        lp = max(len(p) for p, _, _ in rows)
        ids = torch.tensor([[PAD] * (lp - len(p)) + p + c for p, c, _ in rows])
        keys = torch.tensor([[False] * (lp - len(p)) + [True] * (len(p) + len(c)) for p, c, _ in rows])
        ans = torch.tensor([[False] * lp + f for _, _, f in rows])
        return ids, keys, ans


def load_init(net, mod, path: Path) -> None:
    """tiny-mdm's weights (LLaDA upstream names) into ``net`` (our names)."""
    state = load_file(str(path / "model.safetensors"))
    net.load_state_dict({k: state[mod.checkpoint_names(k)[0]] for k in net.state_dict()})


def write_generation_config(out: Path, enc) -> None:
    """generation_config.json: ``decoder`` nap and NAP's keys, so the checkpoint runs parallel-forced decoding by
    default."""
    gc = json.loads((out / "generation_config.json").read_text())
    for k in ("steps", "block_length", "remasking"):
        gc.pop(k, None)
    gc.update(
        {
            "decoder": "nap",
            "trajectories": 2,
            "think_length": THINK,
            "summary_length": SUMMARY,
            "budget": "even",
            "max_new_tokens": len(layout(enc, 2, THINK, SUMMARY)),
        }
    )
    (out / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", type=Path, required=True, help="the tiny-mdm checkpoint folder to start from")
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=float, default=4.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(str(train_mdm.TINY / "tokenizer.json"))
    config = json.loads((a.init / "config.json").read_text())
    mod, spec = get_arch(config), get_spec(config)
    net = mod.MODEL_CLASS(spec.parse_config(config))
    load_init(net, mod, a.init)
    net.train()
    data = NapData(tok, (train_mdm.TINY / "chat_template.jinja").read_text(), a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    run = Run(a, net, "seqs/s")
    while run.next_lr() is not None:
        ids, keys, ans = data.batch(a.batch, 1 + run.step % 3)
        with torch.enable_grad():
            run.update(mdm_loss(net, ids, keys, ans, gen), a.batch)
        if run.checkpoint_due():
            save(net, config, a.out, mod)
            write_generation_config(a.out, data.enc)
    run.done()
    save(net.eval(), config, a.out, mod)
    write_generation_config(a.out, data.enc)


if __name__ == "__main__":
    main()
