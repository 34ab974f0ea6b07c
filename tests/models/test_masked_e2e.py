"""End to end on real baby masked checkpoints (#15): ``localdiff gen -m <folder>`` on a LLaDA and a Dream checkpoint
written in their upstream layouts (``masked_ref.write_upstream``) with a small word-level tokenizer; the tokens equal
the compact transcription of the upstream decoder (``upstream_masked``) on the same model."""

from __future__ import annotations

import json

import pytest
import torch

import upstream_masked as up
from localdiff.cli import main
from masked_ref import EOS, MASK, VOCAB, write_upstream
from wordlevel import save_wordlevel_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint(family, folder):
    folder.mkdir()
    write_upstream(family, folder)
    save_wordlevel_tokenizer(folder, VOCAB)
    return folder


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_gen_on_a_baby_checkpoint_equals_the_upstream_transcription(family, tmp_path, capsys):
    import localdiff

    folder = _checkpoint(family, tmp_path / family)
    flags = ["--steps", "8", "--block-length", "4"] if family == "llada" else ["--steps", "8", "--alg", "entropy"]
    assert (
        main(["gen", "-m", str(folder), "--raw", "-p", "t5 t6 t7 t8", "-n", "8", "--seed", "0", "--json", *flags]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    m = localdiff.load(str(folder))
    prompt = torch.tensor([[5, 6, 7, 8]])
    if family == "llada":
        want = up.llada_generate(m.net.logits_full, prompt, 8, 8, 4, mask_id=MASK)[0, 4:].tolist()
    else:
        want = up.dream_generate(m.net.logits_full, prompt, 8, 8, mask_token_id=MASK, alg="entropy")[0, 4:].tolist()
    want = want[: want.index(EOS) + 1] if EOS in want else want
    assert out["token_ids"] == want
    assert out["sampler"]["steps"] == 8 and len(out["stats"]["commit_step"]) == len(want)
    for extra in (["--kv-cache", "dual", "--threshold", "0.5"], ["--kv-cache", "prefix"]):
        assert (
            main(
                ["gen", "-m", str(folder), "--raw", "-p", "t5 t6 t7 t8", "-n", "8", "--seed", "0", "-q", *flags, *extra]
            )
            == 0
        )
    capsys.readouterr()
    bad = ["--alg", "entropy"] if family == "llada" else ["--cfg-scale", "1"]
    assert main(["gen", "-m", str(folder), "--raw", "-p", "t5 t6", "-n", "4", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is an option of the" in err


def test_saved_settings_of_another_family_do_not_stop_a_masked_model(tmp_path, monkeypatch, capsys):
    """A config file / LOCALDIFF_* variable written for DiffusionGemma (entropy_bound, /set in the chat) applies to
    the models whose decoder has it: a LLaDA checkpoint runs, the embedded model still reads it; typed as a flag it
    stays a one-line usage error, and an unknown saved key is still refused."""
    folder = _checkpoint("llada", tmp_path / "llada")
    conf = tmp_path / "config.toml"
    conf.write_text("[sampler]\nentropy_bound = 0.5\nblock_length = 4\n")
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(conf))
    monkeypatch.setenv("LOCALDIFF_T_MIN", "0.3")
    base = ["gen", "-m", str(folder), "--raw", "-p", "t5 t6 t7 t8", "-n", "8", "--seed", "0", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampler"]["block_length"] == 4 and "entropy_bound" not in out["sampler"]
    assert main(["gen", "-m", "tiny", "-p", "What is 1 + 2?", "-n", "8", "--seed", "0", "--json"]) == 0
    tiny = json.loads(capsys.readouterr().out)["sampler"]
    assert tiny["entropy_bound"] == 0.5 and tiny["t_min"] == 0.3
    assert main([*base, "--entropy-bound", "0.5"]) == 2
    assert "entropy-bound" in capsys.readouterr().err
    conf.write_text("[sampler]\nentropy_bnd = 0.5\n")
    assert main(base) == 2
    assert "entropy_bnd" in capsys.readouterr().err


def test_shipped_tiny_mdm_answers_its_formats_and_threshold_decoding_keeps_them():
    """The embedded tiny-mdm (trained here) loads offline from its LLaDA layout and reverses letters correctly, one
    token per step and with Fast-dLLM threshold decoding (fewer forwards, same answers)."""
    import localdiff

    m = localdiff.load("tiny-mdm")
    prompts = ["Reverse the letters: d r a g o n", "Reverse the letters: p l a n e t"]
    one = m.generate(prompts, max_new_tokens=32, seed=0)
    par = m.generate(prompts, max_new_tokens=32, seed=0, threshold=0.7)
    assert one.text == par.text == ["n o g a r d", "t e n a l p"]
    assert par.stats.forwards < one.stats.forwards
