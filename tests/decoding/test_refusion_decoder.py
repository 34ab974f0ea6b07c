"""ReFusion's decoder (localdiff.decoding.refusion) against a compact transcription of upstream ``generate_refusion``
(tests/helpers/upstream_refusion.py, on transformers' own Qwen3ForCausalLM), at temperature 0 on tiny random Qwen3
checkpoints with a mask token: tokens, the round sequence (verify / infill, EOS), and the K/V cache after every round.
Plus: the reorder moves K/V instead of recomputing them, and thresholds 1.0 / 1.0 equal a cache-free one-slot
process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from localdiff.decoding.refusion import Refusion
from localdiff.loader import load_model
from refusion_ckpt import EOS, MASK, build_hf, save_upstream
from upstream_refusion import CALLS, generate_refusion

#: (slot_size, serial_num_blocks, slot_threshold, token_threshold, gen_length)
SETTINGS = [(4, 2, 0.3, 0.3, 32), (8, 1, 0.5, 0.15, 32), (2, 2, 0.2, 0.5, 16), (4, 1, 0.9, 0.9, 16)]
PROMPTS = [
    torch.randint(0, 90, (int(n),), generator=torch.Generator().manual_seed(100 + i)).tolist()
    for i, n in enumerate(torch.randint(3, 10, (20,), generator=torch.Generator().manual_seed(7)))
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = []
    for seed, scale, eos_bias in ((0, 6.0, 3.0), (1, 4.0, 5.0)):
        hf = build_hf(seed, scale=scale, eos_bias=eos_bias)
        path = tmp_path_factory.mktemp(f"rf{seed}")
        save_upstream(hf, path)
        net, _ = load_model(path, dtype=torch.float32)
        out.append((hf, net))
    return out


def _opts(k, nb, st, tt):
    return SimpleNamespace(slot_size=k, serial_num_blocks=nb, slot_threshold=st, token_threshold=tt, temperature=0.0)


def _ours(net, prompt, k, nb, st, tt, g, quirk=False):
    dec = Refusion(net, _opts(k, nb, st, tt), MASK, (EOS,), eos_row_quirk=quirk)
    rounds, caches = [], []
    for info in dec.run(prompt, g):
        rounds.append(info)
        caches.append([tuple(t.clone() for t in dec.cache.committed(i)) for i in range(len(net.layers))])
    return dec, rounds, caches


@pytest.mark.slow
def test_token_identical_to_upstream_transcription(models):
    seen = set()
    for mi, (hf, net) in enumerate(models):
        for k, nb, st, tt, g in SETTINGS[2 * mi : 2 * mi + 2]:  # two settings per checkpoint, 20 prompts each
            for prompt in PROMPTS:
                ref, log, ref_caches, _, ref_pos = generate_refusion(
                    hf, torch.tensor([prompt]), g, MASK, EOS, k, nb, st, tt
                )
                dec, rounds, caches = _ours(net, prompt, k, nb, st, tt, g)
                assert dec.answer() == ref[0, len(prompt) :].tolist(), (k, nb, st, tt, prompt)
                assert dec.cache.positions == ref_pos[0].tolist()
                assert dec.forwards == CALLS[0]
                assert [(r.how, r.eos) for r in rounds] == [(h, e) for h, _, e in log]
                for ours, theirs in zip(caches, ref_caches):
                    for (k1, v1), (k2, v2) in zip(ours, theirs):
                        torch.testing.assert_close(k1, k2[:1], rtol=0, atol=2e-4)
                        torch.testing.assert_close(v1, v2[:1], rtol=0, atol=2e-4)
                seen |= {(r.how, r.eos, len(r.picked) > 1) for r in rounds}
    # the suite reaches every branch: EOS in the global verify and in the infill, parallel infill of several slots
    assert ("verify", True, False) in seen or ("verify", True, True) in seen
    assert any(h == "infill" and e for h, e, _ in seen)
    assert ("infill", False, True) in seen


def test_upstream_eos_row_quirk_reproducible(models):
    """With ``eos_row_quirk`` the decoder follows upstream verbatim; the default fixes it, and they differ somewhere."""
    hf, net = models[1]
    differ = False
    for k, nb, st, tt, g in SETTINGS[:2]:
        for prompt in PROMPTS[:10]:
            ref = generate_refusion(hf, torch.tensor([prompt]), g, MASK, EOS, k, nb, st, tt, eos_row_quirk=True)[0]
            quirk = _ours(net, prompt, k, nb, st, tt, g, quirk=True)[0].answer()
            assert quirk == ref[0, len(prompt) :].tolist()
            differ |= quirk != _ours(net, prompt, k, nb, st, tt, g)[0].answer()
    assert differ


def _recording(dec):
    """Wrap dec._pass: after each pass, the K/V it wrote per buffer row (layer 0 and last), the latest write wins."""
    written, orig = {}, dec._pass

    def rec(ids, pos, rows, visible):
        out = orig(ids, pos, rows, visible)
        for li in (0, len(dec.cache.k) - 1):
            for r in rows.tolist():
                written[(li, r)] = (dec.cache.k[li][0, :, r].clone(), dec.cache.v[li][0, :, r].clone())
        return out

    dec._pass = rec
    return written


def _recompute(hf, dec):
    """K/V of a transformers pass over the committed tokens in cache order at their true positions."""
    ids = torch.tensor([dec.cache.token_ids])
    pos = torch.tensor([dec.cache.positions])
    with torch.no_grad():
        out = hf(input_ids=ids, position_ids=pos, use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def test_reorder_moves_kv_without_recompute(models):
    hf, net = models[0]
    parallel_differs = False
    for (k, nb, st, tt, g), one_slot in (((4, 2, 1.0, 0.3, 32), True), ((4, 2, 0.3, 0.3, 32), False)):
        for prompt in PROMPTS[:8]:
            dec = Refusion(net, _opts(k, nb, st, tt), MASK, (EOS,))
            written = _recording(dec)
            parallel = False
            for info in dec.run(prompt, g):
                parallel |= info.how == "infill" and len(info.picked) > 1
                n = dec.cache.length
                for li in (0, len(net.layers) - 1):  # every committed row = the tensor its pass wrote there
                    for r in range(n - len(info.tokens), n):
                        assert torch.equal(dec.cache.k[li][0, :, r], written[(li, r)][0])
                        assert torch.equal(dec.cache.v[li][0, :, r], written[(li, r)][1])
            again = _recompute(hf, dec)
            gap = max(float((dec.cache.committed(i)[0][0] - again[i][0][0]).abs().max()) for i in range(len(again)))
            if one_slot:
                assert gap < 1e-4, gap
            elif parallel:
                parallel_differs |= gap > 1e-3
    assert parallel_differs


def _one_slot_reference(hf, prompt, g, k, nb):
    """Thresholds 1.0 / 1.0 without any cache: each round, a full pass over prompt + committed (commit order) + the
    block's remaining masks picks the slot whose first mask is most confident and drafts its first token; then each
    next token is the argmax at a mask placed after the slot's tokens so far (a full pass each)."""

    def logits(ids, pos):
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])).logits[0]

    p, done = len(prompt), []
    bl = g // nb
    for b in range(nb):
        remaining = [p + b * bl + j * k for j in range(bl // k)]
        stop = False
        while remaining:
            base, bpos = prompt + [t for t, _ in done], list(range(p)) + [q for _, q in done]
            lg = logits(base + [MASK] * (k * len(remaining)), bpos + [s + u for s in remaining for u in range(k)])
            first = lg[len(base) :: k][: len(remaining)]
            s = int(torch.softmax(first, -1).max(-1).values.argmax())
            slot = [int(first[s].argmax())]
            while len(slot) < k and slot[-1] != EOS:
                slot.append(
                    int(
                        logits(base + slot + [MASK], bpos + [remaining[s] + u for u in range(len(slot) + 1)])[
                            -1
                        ].argmax()
                    )
                )
            done += [(t, remaining[s] + u) for u, t in enumerate(slot)]
            if slot[-1] == EOS:
                remaining, stop = remaining[:s], True
            else:
                remaining.pop(s)
        if stop:
            break
    return [t for t, _ in sorted(done, key=lambda x: x[1])]


def test_thresholds_one_equal_cache_free_one_slot_process(models):
    for hf, net in models:
        for k, nb, g in ((4, 2, 16), (3, 1, 12)):
            for prompt in PROMPTS[:6]:
                dec = _ours(net, prompt, k, nb, 1.0, 1.0, g)[0]
                assert dec.answer() == _one_slot_reference(hf, prompt, g, k, nb), (k, prompt)
