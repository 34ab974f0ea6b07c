"""dInfer's parallel decoders on LLaDA2 (#45): the ``llada2`` decoder's ``parallel_decoding`` threshold / credit /
hierarchy equals the transcription of dInfer's block-diffusion pipeline (``upstream_dinfer_bd.py`` with
``upstream_dinfer.py``'s decoders) token for token at temperature 0 on a tiny random ``llada2_moe`` checkpoint; the
threshold decoder's ≥ τ differs from LLaDA2's own > τ rule exactly at τ; option errors are one line."""

from __future__ import annotations


import pytest
import torch

import upstream_dinfer as ud
from llada2_ref import TINY, full_logits_fn as _logits_fn, sharp_model
from localdiff.decoding.dinfer_threshold import threshold_transfer
from localdiff.errors import UsageError
from upstream_dinfer_bd import bd_generate

B, MASK, EOS = TINY["block_size"], TINY["mask_token_id"], TINY["eos_token_id"]


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    """The sharp tiny checkpoint (logits ×3, EOS boosted) test_llada2_decoding uses too."""
    return sharp_model(tmp_path_factory.mktemp("llada2-dinfer"))


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, EOS - 2, (n,), generator=g).tolist()


def _decoder(kind, threshold):
    kw = dict(temperature=0.0, threshold=threshold, mask_id=MASK, eos_id=EOS)
    if kind == "threshold":
        return ud.ThresholdParallelDecoder(**kw)
    if kind == "credit":
        return ud.CreditThresholdParallelDecoder(**kw)
    return ud.HierarchyDecoder(low_threshold=0.3, **kw)


@pytest.mark.parametrize(
    "kind,threshold", [("threshold", 0.9), ("threshold", 0.4), ("credit", 0.6), ("hierarchy", 0.9), ("hierarchy", 0.5)]
)
def test_parallel_decoding_on_llada2_equals_dinfer_block_diffusion(llada2, kind, threshold):
    m, fn = llada2, _logits_fn(llada2)
    differs = 0
    for plen in (3, 4, 5, 6, 9):
        prompt = _prompt(plen, 200 + plen)
        want, fwd = bd_generate(fn, _decoder(kind, threshold), torch.tensor([prompt]), 14, B)
        g = m.generate(prompt, max_new_tokens=14, parallel_decoding=kind, threshold=threshold, temperature=0)
        assert g.token_ids == want, (plen, g.token_ids, want)
        assert g.stats.forwards == fwd
        own = m.generate(prompt, max_new_tokens=14, threshold=threshold, steps=B, temperature=0)
        differs += own.token_ids != g.token_ids or own.stats.forwards != fwd
    if kind != "threshold":  # dInfer's threshold rule is LLaDA2's with steps = B but at τ (the test below)
        assert differs, "dInfer's decoder behaved as LLaDA2's own rule on every prompt: not exercised"


def test_threshold_at_tau_commits_with_dinfer_not_with_llada2():
    """A confidence exactly τ: dInfer's rule (≥) commits it, LLaDA2's (> τ, at least the quota) does not."""
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.75, 0.125, 0.125], [0.4, 0.3, 0.3]]]))
    masked = torch.ones(1, 3, dtype=torch.bool)
    x0 = logits.argmax(-1)
    conf = torch.softmax(logits, -1).max(-1).values
    tau = float(conf[0, 0])  # exactly the first position's confidence
    assert threshold_transfer(logits, x0, masked, 99, tau).tolist() == [[True, True, False]]
    assert (conf > tau).tolist() == [[False, True, False]]


def test_options_and_errors(llada2):
    with pytest.raises(UsageError, match="do not edit") as e:
        llada2.generate(_prompt(5, 1), max_new_tokens=4, parallel_decoding="credit", editing_threshold=0.5)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="parallel_decoding: must be one of threshold, credit, hierarchy"):
        llada2.generate(_prompt(5, 1), max_new_tokens=4, parallel_decoding="fast")
    opts = llada2.sampler_options()
    assert opts["parallel_decoding"] is None and opts["low_threshold"] == 0.3 and opts["credit_alpha"] == 0.7
