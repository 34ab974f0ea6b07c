"""Train `tiny-mdm`: a small LLaDA-architecture masked diffusion model on the embedded model's task families,
on 2 CPU cores, with localdiff's own LLaDA modules (the checkpoint is written in LLaDA's upstream layout).

Objective (LLaDA SFT, arXiv 2502.09992 §2.3 / Appendix B): a sequence is the chat-templated prompt followed by an
answer region of G tokens (the answer, `<end_of_turn>`, then `<end_of_turn>` fill — the model learns where an answer
ends, as LLaDA pads with |EOS|). One t ~ U(ε, 1) per sequence; each answer-region token is replaced by the mask token
with probability t; the prompt is never masked. Loss = Σ over masked tokens of CE / t, divided by the answer
region's length (G), averaged over the batch. Attention is bidirectional over the non-padding tokens (prompts are
left-padded).

    python train_mdm.py --minutes 40 --out /tmp/tiny_mdm        # the shipped model
    python train_mdm.py --steps 3 --micro --out /tmp/x          # smoke test
"""

from __future__ import annotations

import json
import random
import shutil
import sys
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
import recipe_main  # noqa: E402  (the shared command line and training loop)


PAD, EOS, BOS, MASK = 0, 1, 2, 6  # the shared tokenizer's specials (<mask> is id 6)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_config(vocab_size: int, micro: bool = False) -> dict:
    """The checkpoint's config.json (LLaDA's own keys: model_type "llada", OLMo-style names)."""
    d, layers, heads = (64, 2, 2) if micro else (160, 4, 5)
    return {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": heads,
        "n_layers": layers,
        "mlp_hidden_size": 8 * d // 3 // 8 * 8,
        "mlp_ratio": 4,
        "max_sequence_length": 512,
        "vocab_size": vocab_size,
        "embedding_size": vocab_size,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "include_bias": False,
        "include_qkv_bias": False,
        "weight_tying": False,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "activation_type": "silu",
        "block_type": "llama",
        "layer_norm_type": "rms",
        "rope": True,
        "alibi": False,
        "attention_layer_norm": False,
        "init_std": 0.02,
        "torch_dtype": "float32",
    }


class Data:
    """Seeded stream of (ids [B, L], key mask [B, L], answer-region mask [B, L]) from tasks.sample (train split)."""

    def __init__(self, tok: Tokenizer, template: str, gen: int, seed: int):
        self.tok, self.gen, self.rng = tok, gen, random.Random(seed)
        self.tpl = jinja2.Environment().from_string(template)
        self.eot = tok.token_to_id("<end_of_turn>")

    def encode(self, item: dict) -> tuple[list[int], list[int]]:
        prompt = self.tpl.render(
            messages=[{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, bos_token="<bos>"
        )
        p = self.tok.encode(prompt, add_special_tokens=False).ids
        a = self.tok.encode(item["answer"], add_special_tokens=False).ids + [self.eot]
        return p, a

    def batch(self, n: int):
        rows = []
        while len(rows) < n:
            p, a = self.encode(tasks.sample(self.rng))
            if len(a) <= self.gen:  # longer answers do not fit the answer region
                rows.append((p, a + [self.eot] * (self.gen - len(a))))
        lp = max(len(p) for p, _ in rows)
        ids = torch.tensor([[PAD] * (lp - len(p)) + p + a for p, a in rows])
        keys = torch.tensor([[False] * (lp - len(p)) + [True] * (len(p) + self.gen) for p, _ in rows])
        ans = torch.zeros_like(keys)
        ans[:, lp:] = True
        return ids, keys, ans


def _forward(net, ids, keys):
    """``net.logits_full`` with autograd: the runtime's passes run under inference mode; training calls the same
    function undecorated."""
    return type(net).forward_window.__wrapped__(net, ids, 0, None, keys)


def mdm_loss(net, ids, keys, ans, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """LLaDA's SFT loss (see the module docstring); fp32 scalar."""
    b, g = ids.shape[0], int(ans[0].sum())
    t = (1 - eps) * torch.rand(b, 1, generator=gen) + eps
    masked = (torch.rand(ids.shape, generator=gen) < t) & ans
    noisy = torch.where(masked, torch.full_like(ids, MASK), ids)
    logits = _forward(net, noisy, keys)
    ce = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    return (ce / t.expand_as(ids)[masked]).sum() / (b * g)


def save(net, config: dict, out: Path, mod) -> None:
    """Weights under LLaDA's upstream names + config.json + tokenizer + generation_config.json into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    state = {mod.checkpoint_names(k)[0]: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy(TINY / f, out / f)
    eot = Tokenizer.from_file(str(TINY / "tokenizer.json")).token_to_id("<end_of_turn>")
    gc = {
        "eos_token_id": [EOS, eot],
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "mask_token_id": MASK,
        "max_new_tokens": 32,
        "steps": 32,
        "block_length": 32,
        "temperature": 0.0,
        "remasking": "low_confidence",
    }
    (out / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")


def main() -> None:
    a = recipe_main.parse_args(__doc__, minutes=40.0, ckpt_every=10.0)
    tok, config, mod, net = recipe_main.setup(a, build_config)
    data = Data(tok, (TINY / "chat_template.jinja").read_text(), a.gen, a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    recipe_main.train(
        a, net, lambda: data.batch(a.batch), lambda b: mdm_loss(net, *b, gen), lambda n: save(n, config, a.out, mod)
    )


if __name__ == "__main__":
    main()
