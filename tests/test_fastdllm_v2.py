"""Fast-dLLM v2's decoder (token shift, AR first token of each block, sub-block threshold decoding) equals a
transcription of upstream ``generate`` (temperature 0) on transformers' Qwen2 weights, through the block KV cache
with device budget unlimited / 0."""
from __future__ import annotations

import json

import pytest
import torch

import localdiff
from block_ref import EOS, MASK, ref_logits, write_upstream
from localdiff.errors import UsageError
from upstream_fastdllm_v2 import v2_generate

BLK = 6


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fdllm2")
    ref = write_upstream("Fast_dLLM_Qwen", folder, seed=7)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, bd_size=BLK)))
    return ref, localdiff.load(str(folder), dtype=torch.float32)


@pytest.mark.parametrize("plen", [3, 7, 12, 13])
@pytest.mark.parametrize("threshold,sbs,budget", [(0.05, 3, None), (1.0, 2, 0), (0.2, 6, None)])
def test_equals_upstream_generate(v2, plen, threshold, sbs, budget):
    ref, m = v2
    g = torch.Generator().manual_seed(plen)
    prompt = torch.randint(0, EOS - 2, (1, plen), generator=g)

    def logits_fn(ids):
        out = ref_logits(ref, ids, BLK)
        out[..., MASK] = -torch.inf      # a model that never predicts the mask token (ours never does)
        return out

    x = v2_generate(logits_fn, prompt, 4 * BLK, MASK, threshold, sbs, BLK, EOS)
    want = [t for t in x[0, plen:].tolist() if t != m.pad_token_id][:14]
    got = m.generate(prompt[0].tolist(), max_new_tokens=14, threshold=threshold, small_block_size=sbs,
                     cache=m.new_cache(budget))
    assert got.token_ids == want


def test_small_block_must_divide_the_block(v2):
    _, m = v2
    with pytest.raises(UsageError, match="small_block_size"):
        m.generate([5, 6, 7], max_new_tokens=4, small_block_size=4)
