"""LLaDA's ``logits_eos_inf`` and ``confidence_eos_eot_inf`` (#45): the ``llada`` decoder with either equals the
transcription of ML-GSAI/LLaDA ``generate.py`` (``upstream_llada_eos.py``) token for token at temperature 0, on the
contract-exact fake model (random weights, few steps), with the EOS / EoT ids the runner resolves; option surfaces
and errors."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import upstream_llada_eos as up
from fake_masked import FakeMaskedConfig, FakeMaskedNet
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.engine import Model
from localdiff.engine.masked import eos_and_eot
from localdiff.errors import UsageError

MASK = 36
PROMPTS = [
    torch.randint(3, 36, (int(n),), generator=torch.Generator().manual_seed(100 + i)).tolist()
    for i, n in enumerate(torch.randint(2, 10, (20,), generator=torch.Generator().manual_seed(7)))
]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(monkeypatch, tmp_path, eos=()):
    cfg = dataclasses.replace(FakeMaskedConfig(eos_token_id=tuple(eos), pad_token_id=None))
    monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
    return Model(FakeMaskedNet(cfg, seed=0), cfg, None, tmp_path, "fake", "cpu", torch.float32, None, {})


def _logits(m):
    def fn(x):
        out = m.net.logits_full(x).clone()
        out[..., MASK] = -torch.inf
        return out

    return fn


@pytest.fixture
def llada(monkeypatch, tmp_path):
    """A model whose EOS and EoT are the two tokens the random model predicts most (so both options matter)."""
    plain = _model(monkeypatch, tmp_path)
    counts = collections.Counter(
        t for p in PROMPTS for t in plain.generate(p, max_new_tokens=8, steps=8, block_length=4, chat=False).token_ids
    )
    (eos, _), (eot, _) = counts.most_common(2)
    return _model(monkeypatch, tmp_path, (eos, eot))


@pytest.mark.parametrize(
    "flags",
    [
        {"logits_eos_inf": True},
        {"confidence_eos_eot_inf": True},
        {"logits_eos_inf": True, "confidence_eos_eot_inf": True},
    ],
)
def test_eos_options_equal_llada_generate(llada, flags):
    eos, eot = llada.config.eos_token_id
    assert eos_and_eot(llada, True) == (eos, eot)
    differs = 0
    for p in PROMPTS:
        want = up.generate(_logits(llada), torch.tensor([p]), 8, 8, 4, MASK, eos, eot, **flags)[0, len(p) :].tolist()
        cut = next((k for k, t in enumerate(want) if t in (eos, eot)), None)
        want = want if cut is None else want[: cut + 1]
        g = llada.generate(p, max_new_tokens=8, steps=8, block_length=4, chat=False, **flags)
        assert g.token_ids == want, (p, g.token_ids, want)
        if flags.get("logits_eos_inf"):
            assert eos not in g.token_ids
        plain = up.generate(_logits(llada), torch.tensor([p]), 8, 8, 4, MASK, eos, eot)[0, len(p) :].tolist()
        full = up.generate(_logits(llada), torch.tensor([p]), 8, 8, 4, MASK, eos, eot, **flags)[0, len(p) :].tolist()
        differs += plain != full
    assert differs, "the option changed no answer: not exercised"


def test_surfaces_and_errors(llada, monkeypatch, tmp_path):
    from localdiff.cli.dispatch import build_parser

    flags = build_parser()._subparsers._group_actions[0].choices["gen"]._option_string_actions
    assert "--logits-eos-inf" in flags and "--confidence-eos-eot-inf" in flags
    opts = llada.sampler_options()
    assert opts["logits_eos_inf"] is False and opts["confidence_eos_eot_inf"] is False
    no_eot = _model(monkeypatch, tmp_path, (5,))
    with pytest.raises(UsageError, match="no end-of-turn token") as e:
        no_eot.generate([5, 6], max_new_tokens=4, chat=False, confidence_eos_eot_inf=True)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="compute their own confidences"):
        llada.generate([5, 6], max_new_tokens=4, chat=False, confidence_eos_eot_inf=True, parallel_decoding="threshold")
    with pytest.raises(UsageError, match="logits_eos_inf: must be on or off"):
        llada.generate([5, 6], max_new_tokens=4, chat=False, logits_eos_inf="maybe")
