"""The `refusion:8b` catalog entry: shows before a pull from its stand-in config, and its sampler and per-task
presets (the paper's eval settings) are valid ReFusion options."""

from __future__ import annotations

import json

from localdiff.decoding.options import POLICIES


def test_refusion_entry_shows_before_pull_and_presets_are_valid(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from localdiff.cli import main
    from localdiff.hub.catalog import lookup

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    e = lookup("refusion:8b")
    assert e.repo == "GSAI-ML/ReFusion" and lookup("refusion") is e
    cls = POLICIES["refusion"]
    opts = {k: v for k, v in e.sampler.items() if k != "gen_length"}
    assert cls.build(opts).slot_size == 4
    assert {"gsm8k", "mbpp", "humaneval", "math", "gpqa", "arc_challenge", "mmlu_pro"} <= set(e.presets)
    for name, preset in e.presets.items():
        built = cls.build(preset)
        assert built.slot_size == preset["slot_size"] and built.temperature == 0.0, name
    assert main(["show", "refusion:8b", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert s["family"] == "slots" and s["mask_token_id"] == 151670
    assert s["parameters"]["total"] == e.approx_params
