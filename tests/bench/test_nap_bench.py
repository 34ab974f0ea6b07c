"""``localdiff bench --only nap`` (issue #21): rows of accuracy / TPF / ARness per decoder, the report's table, the
decoding-order PNG, and models that are not installed reported as skipped."""

from __future__ import annotations

import dataclasses

import torch

from fake_masked import CharTok, FakeMaskedConfig, FakeMaskedNet
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.bench import nap as bench_nap
from localdiff.bench import run as bench_run
from localdiff.bench.report import render
from localdiff.engine import Model


def _model(monkeypatch, tmp_path):
    cfg = dataclasses.replace(FakeMaskedConfig(eos_token_id=(2,), pad_token_id=0))
    monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
    return Model(
        FakeMaskedNet(cfg, seed=0),
        cfg,
        CharTok(),
        tmp_path,
        "fake",
        "cpu",
        torch.float32,
        None,
        {"steps": 32, "block_length": 8},
    )


def test_rows_per_decoder(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    model = _model(monkeypatch, tmp_path)
    monkeypatch.setattr(bench_nap, "MAX_NEW", 8)
    items = [{"family": "add", "prompt": "1+2", "answer": "3"}, {"family": "add", "prompt": "2+2", "answer": "4"}]
    llada = bench_nap.run_decoder(model, items, "llada", {"steps": 8, "remasking": "low_confidence"})
    assert llada["n"] == 2 and 0 <= llada["global_arness"] <= 1 and llada["tpf"] > 0
    dream = bench_nap.run_decoder(model, items, "dream", {"alg": "entropy", "steps": 4})
    assert model.options_cls.POLICY == "llada"  # the bench's policy switch is undone
    assert dream["tpf"] > llada["tpf"]  # 2 tokens a step vs 1
    three = bench_nap.run_decoder(model, items, "nap", {"trajectories": 3, "think_length": 4, "summary_length": 3})
    assert three["sampler"]["trajectories"] == 3 and three["tpf"] > 1


def test_render_picture_and_skips(monkeypatch, tmp_path):
    png = tmp_path / "o.png"
    note = bench_nap.picture({"a": [1, 2, 3], "b": [0, 1, 1, 2]}, png, "t")
    try:
        import matplotlib  # noqa: F401  (the bench extra; CI's test extra does not install it)
    except ImportError:
        assert "matplotlib is not installed" in note and not png.exists()
    else:
        assert note is None and png.stat().st_size > 1000
    row = {
        "decoder": "NAP parallel-forced, m = 2",
        "accuracy": 0.5,
        "correct": 1,
        "n": 2,
        "tpf": 1.9,
        "global_arness": 0.4,
        "local_arness": 0.1,
    }
    sec = {
        "items": 2,
        "per_family": 1,
        "models": {"tiny-mdm": {"rows": [row], "picture": str(png)}, "tiny-nap": {"skipped": "not installed"}},
    }
    md = "\n".join(bench_nap.render_md(sec))
    assert "| NAP parallel-forced, m = 2 | 50.0% (1/2) | 1.90 | 0.400 | 0.100 |" in md
    assert "tiny-nap: skipped (not installed)" in md and str(png) in md
    env = {"date": "d", "torch": "t", "threads": 1, "cpu": "c", "device": "cpu"}
    full = render({"quick": True, "environment": env, "duration_s": 1.0, "sections": {"nap": sec}})
    assert "Masked decoders: accuracy, TPF and ARness" in full  # a section in its own file is rendered
    assert "nap" in bench_run.SECTIONS
