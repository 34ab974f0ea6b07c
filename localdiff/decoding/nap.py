"""Decoder policy ``nap``: parallel-forced decoding of a multi-trajectory canvas (NAP, Li et al., "Why Diffusion
Language Models Struggle with Truly Parallel (Non-Autoregressive) Decoding?", arXiv 2602.23225; pixeli99/NAP).

NAP's canvas (its README): ``[<think #1>, R(1), <think #2>, R(2), …, <think #m>, R(m), <summary>, S]``; its trainer's
tags are ``<think i>`` and ``<summary>`` (``fsdp_sft_trainer.build_structure_special_tokens``). NAP publishes no
inference code; its decoding is described as *macro-parallel* (the unmasking budget of a step is distributed over
all reasoning blocks) and *micro-confidence* (inside a block, tokens are committed by confidence). The algorithm
implemented here, exactly (``tests/decoding/test_nap.py`` checks it against a transcription of these lines):

1. Canvas (:func:`layout`): after the prompt, for j = 1..m the tag text ``<think j>`` (tokenized, prefilled, never
   masked) then ``think_length`` masks; then ``<summary>`` and ``summary_length`` masks. N_T = m · think_length,
   N_S = summary_length.
2. Phases: the think phase gets S_T steps, the summary S_S: with ``steps`` None, S_T = think_length and
   S_S = summary_length; else S_T = clamp(round(steps · N_T / (N_T + N_S)), 1, steps − 1), S_S = steps − S_T.
3. Every step: one forward over the canvas (the mask token's logit −inf, and the EOS tokens' inside think blocks: a
   think block cannot end the answer); proposals x0 and confidences c = LLaDA's (``llada.predictions``: argmax, or
   Gumbel-max at temperature > 0; c = softmax(logits, float64)[x0]).
4. Think step i (0-based) while a think block has masks: k_i = LLaDA's schedule (``num_transfer_tokens`` of N_T
   over S_T; k_i = all remaining once i ≥ S_T), forced up to u = the number of unfinished think blocks. Split:
   * ``even``: unfinished blocks ranked by their best masked confidence (descending; ties: left block first);
     one token at a time round-robin in that rank, skipping a block whose share has reached its mask count, until
     k_i are placed — every unfinished block gets ⌊k_i/u⌋ or more, the remainder goes to the confident blocks, and
     a finished block's share moves to the others.
   * ``confidence``: each unfinished block its most confident masked position; the other k_i − u go to the most
     confident masked positions of all think blocks.
   Inside a block, its share is its most confident masked positions (``torch.topk``).
5. Summary step j (0-based) once no think block has masks: the most confident k_j masked positions of the summary,
   k_j = ``num_transfer_tokens`` of N_S over S_S (all remaining once j ≥ S_S).

Rows of a batch are decoded independently (their own phase). Works with any masked-family model (LLaDA, Dream,
...): the masked loop (:mod:`localdiff.decoding.masked_loop`) prefills :attr:`NAP.template` and owns forwards,
caches (the canvas is one block), stopping, events and the commit order (template tokens have commit step 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localdiff.decoding.llada import num_transfer_tokens, predictions
from localdiff.decoding.options import NAPOptions
from localdiff.errors import TokenizerMissingError

SUMMARY_TAG = "<summary>"


def think_tag(j: int) -> str:
    """The tag opening think block j (1-based), as NAP's trainer names it."""
    return f"<think {j}>"


@dataclass(frozen=True)
class Layout:
    """A multi-trajectory canvas. ``ids``: the canvas (tag token ids; None = a mask); ``think``: (start, end) of each
    think block's masks, canvas-relative; ``summary``: (start, end) of the summary's masks."""

    ids: tuple
    think: tuple
    summary: tuple

    def __len__(self) -> int:
        return len(self.ids)


def layout(encode, trajectories: int, think_length: int, summary_length: int) -> Layout:
    """The canvas of step 1 of the module docstring. ``encode``: text → list[int] (the model's tokenizer, no
    special tokens)."""
    ids, think = [], []
    for j in range(1, trajectories + 1):
        ids += list(encode(think_tag(j)))
        think.append((len(ids), len(ids) + think_length))
        ids += [None] * think_length
    ids += list(encode(SUMMARY_TAG))
    summary = (len(ids), len(ids) + summary_length)
    ids += [None] * summary_length
    return Layout(tuple(ids), tuple(think), summary)


def summary_text(text: str) -> str:
    """The summary of a decoded multi-trajectory answer: the text after the last ``<summary>`` tag (all of ``text``
    when there is none), stripped."""
    return text.rsplit(SUMMARY_TAG, 1)[-1].strip()


def blocks_of(text: str) -> list[tuple[str, str]]:
    """A decoded multi-trajectory answer split into labelled blocks: [("think 1", R1), …, ("summary", S)] (one
    ("answer", text) block when it has no tags), each text stripped. For front ends (the chat's side-by-side view)."""
    import re

    parts = re.split(r"(<think \d+>|<summary>)", text)
    out = [("answer", parts[0].strip())] if parts[0].strip() else []
    for tag, body in zip(parts[1::2], parts[2::2]):
        out.append((tag[1:-1], body.strip()))
    return out or [("answer", text.strip())]


def phase_steps(steps: int | None, n_think: int, n_summary: int, think_length: int) -> tuple[int, int]:
    """(S_T, S_S) of step 2 of the module docstring."""
    if steps is None:
        return think_length, n_summary
    s_t = min(max(round(steps * n_think / (n_think + n_summary)), 1), steps - 1)
    return s_t, steps - s_t


def split_even(best: list[float], room: list[int], k: int) -> list[int]:
    """Step 4's ``even`` split: shares per unfinished block from each block's best confidence ``best`` and mask count
    ``room`` (both over the unfinished blocks, left to right), total min(k, Σ room)."""
    rank = sorted(range(len(best)), key=lambda b: (-best[b], b))
    share = [0] * len(best)
    left = min(k, sum(room))
    while left > 0:
        for b in rank:
            if left and share[b] < room[b]:
                share[b] += 1
                left -= 1
    return share


class NAP:
    """The ``nap`` policy for one generation (module docstring).

    Args:
        options: :class:`NAPOptions`. generator: torch.Generator for Gumbel noise. mask_id: the mask token id.
        encode: text → list[int] (the tokenizer), for the tags. eos_ids: the model's EOS ids, never proposed inside
            a think block (only the summary ends the answer).
    Attributes the loop reads: ``template`` LongTensor[C] (mask id at masked positions; C = the canvas length the
    runner passes as max_new_tokens), ``cfg_scale`` 0, ``parallel`` True (several tokens per step).
    Raises:
        TokenizerMissingError: ``encode`` is None (the tags are text).
    """

    Options = NAPOptions
    cfg_scale = 0.0
    parallel = True
    block_align = window_at_block = False  # one window, the whole canvas

    def __init__(self, options: NAPOptions, generator: torch.Generator, mask_id: int, encode=None, eos_ids=()):
        if encode is None:
            raise TokenizerMissingError(
                "parallel-forced decoding (trajectories) needs the model's tokenizer for its <think i> / <summary> tags"
            )
        self.o, self.gen, self.mask_id = options, generator, mask_id
        self.layout = layout(encode, options.trajectories, options.think_length, options.summary_length)
        self.template = torch.tensor([mask_id if t is None else int(t) for t in self.layout.ids], dtype=torch.long)
        self.eos_ids = [int(e) for e in eos_ids]

    def begin_window(self, masked: torch.Tensor, steps: int, offset: int = 0) -> None:
        """The canvas (one block): ``masked`` BoolTensor[B, C]; ``steps`` the loop's count (unused: the phases come
        from the options); ``offset`` its position in the sequence (unused)."""
        o, lay = self.o, self.layout
        n_t, n_s = o.trajectories * o.think_length, o.summary_length
        self.s_think, self.s_sum = phase_steps(o.steps, n_t, n_s, o.think_length)
        think = torch.zeros(masked.shape[1], dtype=torch.bool)
        for a, e in lay.think:
            think[a:e] = True
        self.think_pos = think.to(masked.device)
        self.think_k = num_transfer_tokens(self.think_pos[None], self.s_think)[0]
        summ = torch.zeros_like(think)
        summ[lay.summary[0] : lay.summary[1]] = True
        self.sum_k = num_transfer_tokens(summ[None], self.s_sum)[0]
        self.phase_i = [0] * masked.shape[0]  # per row: steps done in its current phase
        self.in_summary = [False] * masked.shape[0]

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor, i: int):
        """One step (shapes as :meth:`localdiff.decoding.llada.LLaDA.step`). Returns (x0, transfer)."""
        if self.eos_ids:  # a think block cannot end the answer: no EOS proposals there
            logits = logits.clone()
            rows = self.think_pos.nonzero().squeeze(1)[:, None]
            logits[:, rows, torch.tensor(self.eos_ids, device=logits.device)[None, :]] = -torch.inf
        x0, conf = predictions(logits, self.o.temperature, "low_confidence", self.gen, masked, xb)
        transfer = torch.zeros_like(masked)
        for r in range(xb.shape[0]):
            if not bool(masked[r].any()):
                continue
            think_left = masked[r] & self.think_pos
            if bool(think_left.any()):
                chosen = self._think(conf[r], think_left, self.phase_i[r])
            else:
                if not self.in_summary[r]:
                    self.in_summary[r], self.phase_i[r] = True, 0
                chosen = self._summary(conf[r], masked[r], self.phase_i[r])
            transfer[r, chosen] = True
            self.phase_i[r] += 1
        return x0, transfer & masked

    def _think(self, conf: torch.Tensor, left: torch.Tensor, i: int) -> list[int]:
        blocks = [(a, e) for a, e in self.layout.think if bool(left[a:e].any())]
        u = len(blocks)
        k = int(self.think_k[i]) if i < self.s_think else int(left.sum())
        k = max(k, u)
        c = torch.where(left, conf, torch.full_like(conf, -torch.inf))
        if self.o.budget == "even":
            best = [float(c[a:e].max()) for a, e in blocks]
            room = [int(left[a:e].sum()) for a, e in blocks]
            out = []
            for (a, e), n in zip(blocks, split_even(best, room, k)):
                out += (a + torch.topk(c[a:e], n).indices).tolist()
            return out
        out = [a + int(torch.topk(c[a:e], 1).indices[0]) for a, e in blocks]
        rest = c.clone()
        rest[out] = -torch.inf
        extra = min(k - u, int(left.sum()) - u)
        if extra > 0:
            out += torch.topk(rest, extra).indices.tolist()
        return out

    def _summary(self, conf: torch.Tensor, masked: torch.Tensor, j: int) -> list[int]:
        a, e = self.layout.summary
        left = masked[a:e]
        k = int(self.sum_k[j]) if j < self.s_sum else int(left.sum())
        k = min(max(k, 1), int(left.sum()))
        c = torch.where(left, conf[a:e], torch.full_like(conf[a:e], -torch.inf))
        return (a + torch.topk(c, k).indices).tolist()
