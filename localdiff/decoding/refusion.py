"""ReFusion's decoder: slot-level plan-and-infill with causal K/V reuse (arXiv 2512.13586; ML-GSAI/ReFusion
``generate.py`` ``generate_refusion``, read and re-expressed, not copied).

The answer (``gen_length`` tokens of masks after the prompt) is cut into slots of ``slot_size`` tokens and into
``serial_num_blocks`` sequential blocks. Within a block, each ROUND:

(a) **plan** — one causal pass over every remaining masked slot of the block, fed in index order after the
    committed cache, at their true positions (the first round's pass also prefills the prompt, as upstream). Draft =
    argmax per position (Gumbel-max at ``temperature`` > 0); slot score = the softmax probability of the slot's first
    drafted token; the picked slots are those scoring above ``slot_threshold`` (else the single best), in index order.
(b) **global verify** — the picked drafts fed causally after the cache; token j ≥ 1 of a slot is scored by the
    previous token's (shifted) prediction, token 0 passes; the longest prefix (over the concatenated slots) whose
    tokens pass ``token_threshold`` is found. An EOS in it commits the slots up to the EOS (that slot cut after the
    EOS) and drops every remaining slot from the EOS slot on; else its whole slots, if any, are committed. Committed
    tokens keep the K/V this pass wrote.
(c) otherwise **parallel infill** of the picked slots, each its own autoregressive row: per iteration a draft pass
    (not-yet-accepted tokens fed as masks; their argmax replaces them) then a verify pass (shifted probabilities;
    each row accepts at least one more token, then every next token above ``token_threshold``); all rows advance by
    the smallest accepted length (minus one while any row is unfinished: that token is re-fed so its prediction
    verifies the next). An EOS accepted in row r drops the rows after r and marks row r finished.
(d) **KV reorder** — the committed tokens are appended to the cache in generation order (RoPE already applied at
    their true positions when their K/V were computed); the final text is read in position order.

Cache sharing (ours; upstream copies the cache per infill row with ``batch_repeat_interleave``): the
:class:`localdiff.arch.refusion.SlotKV` buffer holds the committed prefix once (rows 0..L−1); infill row r writes its
slot's K/V at rows L + r·k .. L + r·k + k − 1 and sees only the prefix and its own rows (``visible``), so all rows
run as ONE pass of R·m queries. When a round ends, the committed rows are already where the reorder puts them
(row 0's slot, row 1's slot, ... in index order, cut after an EOS), so the reorder moves nothing: the cache holds,
in commit order, exactly the K/V each committed slot got in its own infill row (upstream's semantics).

Upstream quirk (EOS found during the infill): upstream then drops the remaining slots from index ``r`` on, where r
is the EOS *row* (position among the picked slots), not the EOS slot's index. **Fixed here** (default): the slots
from the EOS slot on are dropped; ``eos_row_quirk=True`` reproduces upstream (the tests check both).

Other deviations, none reached when upstream works: ``gen_length`` is padded up to a multiple of
``slot_size × serial_num_blocks`` (upstream pads to whole slots only, so its blocks can drop tail tokens or fail to
reshape); several EOS ids are honoured (upstream: ``tokenizer.eos_token_id``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class RoundInfo:
    """What one round did. ``block``: serial block index; ``picked``: the planned slots (answer-relative slot
    numbers, index order); ``how``: "verify" (committed by the global verify) or "infill"; ``committed``: the slots
    committed, in commit order; ``tokens``: the committed token ids in commit order; ``forwards``: passes this round;
    ``eos``: an EOS was committed."""

    block: int
    picked: list[int]
    how: str
    committed: list[int]
    tokens: list[int]
    forwards: int
    eos: bool = False


@dataclass
class Refusion:
    """One ReFusion generation over ``net`` (:class:`localdiff.arch.refusion.RefusionLM`). ``options``:
    :class:`localdiff.decoding.options_slots.RefusionOptions`; ``generator``: torch.Generator for temperature > 0.
    After :meth:`run`: ``cache`` (the SlotKV), ``forwards`` (model passes), ``prompt_len``, ``gen_length``."""

    net: object
    options: object
    mask_id: int
    eos_ids: tuple
    generator: torch.Generator | None = None
    eos_row_quirk: bool = False
    forwards: int = 0
    cache: object = None
    prompt_len: int = 0
    gen_length: int = 0
    trace: list = field(default_factory=list)  # tests: (kind, rows LongTensor) of every pass

    # -- passes ---------------------------------------------------------------------------------------------------
    def _pass(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        dev = self.net.embed_tokens.weight.device
        self.forwards += 1
        return self.net.slot_pass(ids.view(1, -1).to(dev), pos.to(dev), self.cache, rows.to(dev), visible.to(dev))[0]

    @staticmethod
    def _causal(start: int, n: int) -> torch.Tensor:
        """BoolTensor[n, start + n]: all of rows 0..start−1, then causal over the n fresh rows."""
        return torch.cat([torch.ones(n, start, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)

    @staticmethod
    def _rows_visible(start: int, r: int, k: int, a: int) -> torch.Tensor:
        """BoolTensor[r·(k−a), start + r·k]: query (row i, offset t) of the infill pass sees the prefix and its own
        row's buffer rows start + i·k + u for u ≤ a + t."""
        m = k - a
        qi, qt = torch.arange(r).repeat_interleave(m), torch.arange(m).repeat(r)
        ki, ku = torch.arange(r).repeat_interleave(k), torch.arange(k).repeat(r)
        own = (qi[:, None] == ki[None]) & (ku[None] <= (a + qt)[:, None])
        return torch.cat([torch.ones(r * m, start, dtype=torch.bool), own], 1)

    def _draft(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids LongTensor[n], softmax probability of each draft FloatTensor[n]) of logits [n, V]."""
        t = float(self.options.temperature)
        if t == 0:
            x0 = logits.argmax(-1)
        else:  # upstream add_gumbel_noise: exp(logits) / (−log u)^t in float64
            u = torch.rand(logits.shape, generator=self.generator, dtype=torch.float64, device=logits.device)
            x0 = (logits.double().exp() / (-torch.log(u)) ** t).argmax(-1)
        return x0, torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]

    def _is_eos(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(ids, torch.tensor(list(self.eos_ids) or [-1], device=ids.device))

    # -- the generation -------------------------------------------------------------------------------------------
    def run(self, prompt: list[int], gen_length: int):
        """Generate after ``prompt`` (token ids); yields one :class:`RoundInfo` per round. See :meth:`answer`."""
        o = self.options
        k, nb = int(o.slot_size), int(o.serial_num_blocks)
        p = len(prompt)
        g = math.ceil(gen_length / (k * nb)) * k * nb
        self.prompt_len, self.gen_length = p, g
        self.cache = self.net.new_slot_cache(p + g)
        block_len, first, eos_flag = g // nb, True, False
        for b in range(nb):
            remaining = [p + b * block_len + j * k for j in range(block_len // k)]
            while remaining:
                f0 = self.forwards
                info, drop = self._round(b, remaining, prompt if first else None)
                first = False
                eos_flag |= info.eos
                remaining = [s for i, s in enumerate(remaining) if i not in drop]
                info.forwards = self.forwards - f0
                yield info
            if eos_flag:
                break

    def _round(self, b: int, remaining: list[int], prompt: list[int] | None) -> tuple[RoundInfo, set]:
        o, c, k = self.options, self.cache, int(self.options.slot_size)
        m, lo = len(remaining), c.length
        starts = torch.tensor(remaining)
        spos = starts[:, None] + torch.arange(k)[None]  # [m, k] true positions
        ids, pos = torch.full((m * k,), self.mask_id), spos.flatten()
        if prompt is not None:
            ids, pos = torch.cat([torch.tensor(prompt), ids]), torch.cat([torch.arange(len(prompt)), pos])
        logits = self._pass(ids, pos, torch.arange(lo, lo + len(ids)), self._causal(lo, len(ids)))
        if prompt is not None:
            c.commit(prompt, list(range(len(prompt))))
            logits, lo = logits[len(prompt) :], c.length
        draft, prob = self._draft(logits.float())
        draft, prob = draft.view(m, k).cpu(), prob.view(m, k).cpu()
        score = prob[:, 0]
        picked = (score > o.slot_threshold).nonzero()[:, 0].tolist() or [int(score.argmax())]
        slot_no = [(remaining[i] - self.prompt_len) // k for i in picked]
        chosen, cpos, cprob = draft[picked], spos[picked], prob[picked].clone()
        r = len(picked)
        # (b) global verify
        v = self._pass(chosen.flatten(), cpos.flatten(), torch.arange(lo, lo + r * k), self._causal(lo, r * k))
        v = torch.cat([v[:1], v[:-1]]).float()
        pv = torch.softmax(v, -1).gather(-1, chosen.flatten()[:, None].to(v.device))[:, 0].cpu()
        cprob[:, 1:] = pv.view(r, k)[:, 1:]
        ok = cprob > o.token_threshold
        ok[:, 0] = True
        tags = torch.cumprod(ok.int(), -1)
        prefix = int(torch.cumprod(ok.flatten().int(), 0).sum())
        flat, fpos = chosen.flatten(), cpos.flatten()
        eos_at = self._is_eos(flat[:prefix]).nonzero()
        if len(eos_at):
            e = int(eos_at[0])
            row = e // k
            c.commit(flat[: e + 1].tolist(), fpos[: e + 1].tolist())
            drop = set(picked[: row + 1]) | set(range(picked[row], m))
            return RoundInfo(b, slot_no, "verify", slot_no[: row + 1], flat[: e + 1].tolist(), 0, True), drop
        if prefix // k > 0:
            n = prefix // k
            c.commit(flat[: n * k].tolist(), fpos[: n * k].tolist())
            return RoundInfo(b, slot_no, "verify", slot_no[:n], flat[: n * k].tolist(), 0), set(picked[:n])
        return self._infill(b, picked, slot_no, chosen.clone(), cpos, tags, remaining)

    def _infill(self, b, picked, slot_no, spec, rpos, tags, remaining) -> tuple[RoundInfo, set]:
        """(c) the parallel autoregressive infill of the picked slots (module docstring), then (d)."""
        o, c, k = self.options, self.cache, int(self.options.slot_size)
        lo, a, e_row = c.length, 0, None
        for _ in range(k):
            if bool((tags == 1).all()):
                break
            r, m = spec.shape[0], k - a
            cur = tags[:, a:].bool()
            rows = (lo + torch.arange(r)[:, None] * k + a + torch.arange(m)[None]).flatten()
            vis = self._rows_visible(lo, r, k, a)
            fpos = rpos[:, a:].flatten()
            masked = torch.where(cur, spec[:, a:], torch.full_like(spec[:, a:], self.mask_id))
            d = self._pass(masked.flatten(), fpos, rows, vis).view(r, m, -1)
            inp = torch.where(cur, spec[:, a:], d.argmax(-1).cpu())
            spec[:, a:] = inp
            vl = self._pass(inp.flatten(), fpos, rows, vis).view(r, m, -1)
            vl = torch.cat([vl[:, :1], vl[:, :-1]], 1).float()
            ok = (torch.softmax(vl, -1).gather(-1, inp[..., None].to(vl.device))[..., 0] > o.token_threshold).cpu()
            ok[F.pad(tags[:, a:], (1, 0), value=1)[:, :-1] == 1] = True
            tags[:, a:] = torch.cumprod(ok.int(), -1)
            hit = self._is_eos(spec[:, a:]) & (tags[:, a:] == 1)
            if bool(hit.any()):
                e_row = int(hit.any(1).nonzero()[0])
                spec, tags, rpos = spec[: e_row + 1], tags[: e_row + 1], rpos[: e_row + 1]
                tags[e_row] = 1
                picked, slot_no = picked[: e_row + 1], slot_no[: e_row + 1]
            n_new = int(tags[:, a:].sum(1).min())
            if n_new > 0:
                a += n_new - 1 if bool((tags == 0).any()) else n_new
        flat = spec.flatten()
        eos = self._is_eos(flat).int()
        keep = int(((torch.cumsum(eos, 0) - eos) == 0).sum())
        c.commit(flat[:keep].tolist(), rpos.flatten()[:keep].tolist())  # (d): rows already in commit order
        drop = set(picked)
        if e_row is not None:
            drop |= set(range(e_row if self.eos_row_quirk else picked[e_row], len(remaining)))
        return RoundInfo(b, slot_no, "infill", slot_no, flat[:keep].tolist(), 0, e_row is not None), drop

    def answer(self) -> list[int]:
        """The generated tokens in position order (positions never filled are skipped), from the cache."""
        c, p = self.cache, self.prompt_len
        pairs = sorted((pos, t) for pos, t in zip(c.positions[p:], c.token_ids[p:]))
        return [t for _, t in pairs]

    def answer_positions(self) -> list[tuple[int, int]]:
        """(answer-relative position, token) of every generated token, sorted by position."""
        c, p = self.cache, self.prompt_len
        return sorted((pos - p, t) for pos, t in zip(c.positions[p:], c.token_ids[p:]))


def autoregressive(
    net, prompt: list[int], max_new_tokens: int, eos_ids, mask_id: int | None = None
) -> tuple[list[int], int]:
    """The same model's greedy left-to-right decoding, one token per forward, for comparisons.

    ``mask_id`` None: plain causal decoding (the first token from the prompt pass's last row). With ``mask_id``: the
    first answer token is read at a mask placed at its position (fed with the prompt), then every next token from the
    previous one's causal prediction — ReFusion's own left-to-right mode: its AR loss stays inside a slot (a slot's
    first token is never labelled from the token before it, ``forward_process``), so a model trained from scratch
    with that objective has no trained prediction from the prompt's last token, while a mask at the next position
    is in its training distribution. Returns (tokens up to and including the first EOS, forwards).
    """
    cache = net.new_slot_cache(len(prompt) + max_new_tokens + 1)
    dec = Refusion(net, None, -1, tuple(eos_ids))
    dec.cache = cache
    ids, pos, out = torch.tensor(prompt), torch.arange(len(prompt)), []
    if mask_id is not None:
        ids, pos = torch.cat([ids, torch.tensor([mask_id])]), torch.arange(len(prompt) + 1)
    while len(out) < max_new_tokens:
        lo = cache.length
        logits = dec._pass(ids, pos, torch.arange(lo, lo + len(ids)), dec._causal(lo, len(ids)))
        n = len(ids) - (1 if mask_id is not None and not out else 0)  # the mask's row is not committed
        cache.commit(ids[:n].tolist(), pos[:n].tolist())
        t = int(logits[-1].argmax())
        out.append(t)
        if t in eos_ids:
            break
        ids, pos = torch.tensor([t]), torch.tensor([len(prompt) + len(out) - 1])
    return out, dec.forwards
