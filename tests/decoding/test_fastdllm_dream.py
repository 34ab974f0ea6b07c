"""Fast-dLLM v1's Dream block loop (#45): Dream's decoder with ``block_rule`` fastdllm (the default with a prefix /
dual cache) equals the transcription of NVlabs/Fast-dLLM ``generation_utils_block.py`` ``_sample``
(``upstream_fastdllm_dream.py``) token for token at temperature 0, on the contract-exact fake model with shifted
logits (random weights: few steps per block)."""

from __future__ import annotations


import pytest
import torch

from fake_masked import FakeMaskedConfig, FakeMaskedNet
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.engine import Model
from localdiff.errors import UsageError
import upstream_fastdllm_dream as up

PROMPTS = [
    torch.randint(3, 36, (int(n),), generator=torch.Generator().manual_seed(100 + i)).tolist()
    for i, n in enumerate(torch.randint(2, 10, (20,), generator=torch.Generator().manual_seed(7)))
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def dream(monkeypatch, tmp_path):
    cfg = FakeMaskedConfig(eos_token_id=(), pad_token_id=None, model_type="Dream", shift_logits=True)
    monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
    return Model(FakeMaskedNet(cfg, seed=0), cfg, None, tmp_path, "fake", "cpu", torch.float32, None, {})


def _gen(m, p, n, seed=0, **kw):
    return m.generate(list(p), max_new_tokens=n, seed=seed, chat=False, **kw)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize(
    "kw", [{"steps": 8}, {"steps": 12}, {"threshold": 0.9}, {"threshold": 0.3}, {"steps": 8, "alg_temp": 0.5}]
)
def test_dream_blocks_equal_fastdllm_block_loop(dream, cache, kw):
    """16 tokens in blocks of 4 (steps = total over the blocks): tokens and forwards equal upstream's."""
    differs = 0
    for i, p in enumerate(PROMPTS):
        up_kw = {k: v for k, v in kw.items() if k != "steps"}
        want, nfe = up.fastdllm_dream_generate(
            dream.net,
            torch.tensor([p]),
            kw.get("steps", 16),
            16,
            4,
            dual_cache=cache == "dual",
            generator=torch.Generator().manual_seed(i),
            **up_kw,
        )
        g = _gen(dream, p, 16, seed=i, block_length=4, kv_cache=cache, **kw)
        assert g.token_ids == want[0, len(p) :].tolist(), p
        assert g.stats.forwards <= nfe  # a step that commits nothing reuses its logits (upstream reruns)
        old = _gen(dream, p, 16, seed=i, block_length=4, kv_cache=cache, block_rule="dream", **kw)
        differs += old.token_ids != g.token_ids
    assert differs > 0  # the rule is not Dream's per-block rule (this test could fail without it)


def test_block_rule_auto_and_explicit(dream):
    p = PROMPTS[0]
    auto = _gen(dream, p, 8, block_length=4, steps=4, kv_cache="dual")
    assert (
        auto.token_ids == _gen(dream, p, 8, block_length=4, steps=4, kv_cache="dual", block_rule="fastdllm").token_ids
    )
    # without a cache (and with another alg) auto is Dream's rule; fastdllm can be asked for
    assert (
        _gen(dream, p, 8, block_length=4, steps=4).token_ids
        == _gen(dream, p, 8, block_length=4, steps=4, block_rule="dream").token_ids
    )
    assert (
        _gen(dream, p, 8, block_length=4, steps=4, kv_cache="dual", alg="maskgit_plus").token_ids
        == _gen(dream, p, 8, block_length=4, steps=4, kv_cache="dual", alg="maskgit_plus", block_rule="dream").token_ids
    )
    _gen(dream, p, 8, block_length=4, steps=4, block_rule="fastdllm")


def test_block_rule_refusals_are_one_line(dream):
    for kw, want in [
        ({"block_rule": "fastdllm", "alg": "maskgit_plus"}, "ranks by entropy"),
        ({"block_rule": "fastdllm", "steps": 2}, "at least 2 steps per block"),
        ({"block_rule": "fast"}, "block_rule: must be one of auto, dream, fastdllm"),
    ]:
        with pytest.raises(UsageError) as e:
            _gen(dream, PROMPTS[1], 8, block_length=4, **kw)
        assert want in str(e.value) and "\n" not in str(e.value)
