"""The causal family (Qwen3, Llama; targets of DFlash): logits equal transformers' own Qwen3ForCausalLM /
LlamaForCausalLM (1e-4, fp32) after loading a ``save_pretrained`` folder, cached passes equal the uncached one,
greedy tokens equal transformers' ``generate``, seeded sampling equals the reference's draws (z-lab/dflash
``sample``), one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import localdiff
from dflash_ref import EOS, VOCAB, ref_generate, write_target
from localdiff.cache.kv import KVCache
from localdiff.errors import CheckpointError, UsageError
from localdiff.loader import load_model


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = write_target(folder, request.param)
    ours, _ = load_model(folder, dtype=torch.float32)
    return request.param, ref, ours, folder


def _ids(b=2, t=13, seed=1):
    return torch.randint(0, VOCAB - 3, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers(pair):
    _, ref, ours, _ = pair
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    got = ours.logits_full(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 13, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    keep = torch.ones_like(ids)
    keep[0, :4] = 0  # left padding: positions count real tokens only
    with torch.no_grad():
        pos = (keep.cumsum(-1) - 1).clamp_min(0)
        want_pad = ref(ids, attention_mask=keep, position_ids=pos).logits
    torch.testing.assert_close(ours.logits_full(ids, keep)[keep.bool()], want_pad[keep.bool()], rtol=0, atol=1e-4)


def test_cached_passes_equal_the_full_pass_and_features_are_transformers_hidden_states(pair):
    _, ref, ours, _ = pair
    ids = _ids(1, 17)
    full = ours.logits_full(ids)
    cache = KVCache(**ours.cache_layout(8))
    parts, feats = [], []
    for a, b in ((0, 7), (7, 10), (10, 11), (11, 17)):  # blocks longer than the room exercise staging
        lg, f = ours.prefill(ids[:, a:b], cache, layers=[0, 2, len(ours.layers) - 1])
        parts.append(lg)
        feats.append(f)
    # cached blocks sum attention in another order than the full pass: 1.01e-5 on an AVX2 CPU at |logit| 0.6
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[1], hs[3], hs[len(ours.layers)]], -1)
    torch.testing.assert_close(torch.cat(feats, 1), want, rtol=0, atol=1e-4)
    cache.truncate(9)  # crop, then continue: same as never having gone on
    lg, _ = ours.prefill(ids[:, 9:12], cache)
    torch.testing.assert_close(lg, full[:, 9:12], rtol=0, atol=1e-5)


def test_greedy_tokens_equal_transformers_generate(pair):
    _, ref, _, folder = pair
    m = localdiff.load(str(folder), device="cpu")
    for seed in range(4):
        prompt = _ids(1, 5 + seed, seed)
        want = ref.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)[
            0, prompt.shape[1] :
        ]
        g = m.generate(prompt[0].tolist(), max_new_tokens=24, chat=False)
        assert g.token_ids == want.tolist()
        assert g.stats.forwards == len(g.token_ids) and g.stats.acceptance_lengths == []
        assert g.finish_reason == ("eos" if g.token_ids[-1] == EOS else "length")


def test_seeded_sampling_equals_the_reference_draws(pair):
    _, ref, _, folder = pair
    m = localdiff.load(str(folder), device="cpu")
    prompt = _ids(1, 6, 3)
    for t, p, k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.8, 11)):
        torch.manual_seed(7)
        want, _ = ref_generate(None, ref, prompt, 20, [EOS], t, p, k, block_size=1)
        g = m.generate(prompt[0].tolist(), max_new_tokens=20, chat=False, seed=7, temperature=t, top_p=p, top_k=k)
        assert g.token_ids == want[0, 6:].tolist()


def test_bad_input_is_one_line(pair, tmp_path):
    _, _, _, folder = pair
    m = localdiff.load(str(folder), device="cpu")
    with pytest.raises(UsageError, match="one prompt at a time"):
        m.generate([[3, 4], [5, 6]], max_new_tokens=3, chat=False)
    with pytest.raises(UsageError, match="needs a DFlash draft"):
        m.generate([3, 4], max_new_tokens=3, chat=False, block_size=4)
    with pytest.raises(UsageError, match="top_p"):
        m.generate([3, 4], max_new_tokens=3, chat=False, top_p=1.5)
    raw = json.loads((folder / "config.json").read_text())
    raw["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="attention_bias") as e:
        load_model(tmp_path)
    assert "\n" not in str(e.value)
