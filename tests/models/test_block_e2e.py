"""End to end on baby block checkpoints (#16): ``localdiff gen -m <folder>`` on an SDAR checkpoint written in its
upstream layout with a word-level tokenizer equals the transcription of upstream SDAR generate; the KV budget flag;
bad input is one line and a non-zero exit (missing mask id, mask = pad, a config lacking a field, another family's
option, a Fast-dLLM v2 sub-block that does not divide its block)."""

from __future__ import annotations

import json

import pytest
import torch

from block_ref import EOS, MASK, VOCAB, ref_logits, upstream_config, write_upstream
from localdiff.cli import main
from wordlevel import save_wordlevel_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


def _tokenizer(folder):
    save_wordlevel_tokenizer(folder, VOCAB)


def test_gen_equals_upstream_sdar_and_honours_the_kv_budget(tmp_path, capsys):
    from upstream_sdar import sdar_generate

    folder = tmp_path / "sdar"
    folder.mkdir()
    ref = write_upstream("sdar", folder, seed=5)
    _tokenizer(folder)
    argv = [
        "gen",
        "-m",
        str(folder),
        "--raw",
        "-p",
        "t5 t6 t7 t8 t9 t10",
        "-n",
        "10",
        "--seed",
        "0",
        "--json",
        "--steps",
        "4",
        "--temperature",
        "0",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)

    def logits_fn(ids):
        lg = ref_logits(ref, ids, 4)
        lg[..., MASK] = -torch.inf
        return lg

    x = sdar_generate(logits_fn, torch.tensor([[5, 6, 7, 8, 9, 10]]), MASK, 10, 4, 4, stopping_criteria_idx=[EOS])
    want = [t for t in x[0, 6:].tolist() if t != upstream_config("sdar")["pad_token_id"]]
    want = want[: want.index(EOS) + 1] if EOS in want else want[:10]
    assert out["token_ids"] == want
    assert out["sampler"]["steps"] == 4 and out["sampler"]["remasking_strategy"] == "low_confidence_dynamic"
    assert main(argv + ["--kv-budget", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want


@pytest.mark.parametrize(
    "layout,change,field",
    [
        ("sdar", {"mask_token_id": None}, "mask_token_id"),
        ("sdar", {"pad_token_id": MASK}, "pad_token_id"),
        ("sdar", {"num_hidden_layers": None}, "num_hidden_layers"),
        ("Fast_dLLM_Qwen", {"bd_size": -1}, "bd_size"),
    ],
)
def test_bad_checkpoint_is_one_line_and_exit_code(tmp_path, capsys, layout, change, field):
    folder = tmp_path / "bad"
    folder.mkdir()
    write_upstream(layout, folder)
    _tokenizer(folder)
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))
    rc = main(["gen", "-m", str(folder), "--raw", "-p", "t5 t6", "-n", "4"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and field in err and "Traceback" not in err


def test_other_family_options_and_bad_sub_blocks_are_one_line(tmp_path, capsys):
    folder = tmp_path / "sdar"
    folder.mkdir()
    write_upstream("sdar", folder)
    _tokenizer(folder)
    assert main(["gen", "-m", str(folder), "--raw", "-p", "t5 t6", "-n", "4", "--alg", "entropy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is an option of the" in err
    fd = tmp_path / "fd"
    fd.mkdir()
    write_upstream("Fast_dLLM_Qwen", fd)
    _tokenizer(fd)
    assert main(["gen", "-m", str(fd), "--raw", "-p", "t5 t6", "-n", "4", "-q", "--small-block-size", "5"]) == 0
    capsys.readouterr()
    assert main(["gen", "-m", str(fd), "--raw", "-p", "t5 t6", "-n", "4", "--small-block-size", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "small_block_size" in err
