"""``localdiff convert``'s output handling: ``--force``, atomic output (Ctrl-C, disk full, a failing quantizer leave
no partial file and keep an existing one), and bad input (one line, non-zero exit, nothing written)."""

from __future__ import annotations

import json

import pytest

from localdiff.cli import main

from convert_helpers import ROOT, block_checkpoint, convert, masked_checkpoint
from gguf_models import need


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_refuses_to_overwrite_without_force_and_keeps_the_old_file_until_the_new_one_is_complete(
    tmp_path, capsys, monkeypatch
):
    need("gguf")
    from localdiff.backends import gguf_write

    ck = block_checkpoint("sdar", tmp_path / "ck")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old contents")
    assert convert(ck, out) == 2
    assert "--force" in _one_line_error(capsys) and out.read_bytes() == b"old contents"
    calls = []
    real = gguf_write._as_stored

    def interrupted(x, dtype):  # Ctrl-C after a few tensors were written
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(x, dtype)

    monkeypatch.setattr(gguf_write, "_as_stored", interrupted)
    assert convert(ck, out, "F32", "--force") == 130
    assert out.read_bytes() == b"old contents" and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "m.gguf"]
    monkeypatch.setattr(gguf_write, "_as_stored", real)
    assert convert(ck, out, "BF16", "--force") == 0
    from localdiff.backends.gguf_file import read_header

    h = read_header(out)
    assert h.quant == "BF16" and h.architecture == "qwen3" and h.metadata["localdiff.model_type"] == "sdar"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "m.gguf"]


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    need("gguf")
    from localdiff.backends import gguf_write

    ck = masked_checkpoint("dream", tmp_path / "ck")

    def full(x, dtype):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_write, "_as_stored", full)
    assert convert(ck, tmp_path / "m.gguf", "F16") == 1
    assert "disk full" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_failing_quantizer_leaves_no_partial_files(tmp_path, capsys, monkeypatch):
    need("gguf")
    need("llama_cpp")
    from localdiff.backends import gguf_quant
    from localdiff.errors import LocaldiffError

    ck = masked_checkpoint("llada", tmp_path / "ck", q8=True)

    def broken(src, dst, qtype, threads=0, advance=None):
        assert src.name == "m.gguf.tmp.partial" and src.stat().st_size > 0
        dst.write_bytes(b"half")
        raise LocaldiffError("llama.cpp could not quantize (test)")

    monkeypatch.setattr(gguf_quant, "quantize", broken)
    assert convert(ck, tmp_path / "m.gguf", "Q8_0") == 1
    assert "could not quantize" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "type",
        "diffusion_gemma",
        "refusion",
        "llada2",
        "no_dir",
        "dir",
        "gguf_src",
        "moe_dense_layer",
        "no_tokenizer",
        "threads",
        "missing_tensor",
        "unknown_tensor",
        "shared_expert",
        "causal",
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    need("gguf")
    ck = block_checkpoint("sdar", tmp_path / "ck")
    out, args, rc, words = tmp_path / "m.gguf", [], 2, ""
    src = ck
    if case == "missing":
        src, words = tmp_path / "nope", "no such folder"
    elif case == "type":
        args, words = ["--type", "Q3_K"], "unknown type"
    elif case == "diffusion_gemma":
        src, rc, words = ROOT / "models/tiny", 1, "llama.cpp has no such architecture"
    elif case == "refusion":
        src, rc, words = ROOT / "models/tiny-refusion", 1, "llama.cpp has no such architecture"
    elif case == "llada2":
        from arch_baby import BABY

        (ck / "config.json").write_text(json.dumps(BABY["llada2_moe"]))
        rc, words = 1, "LLaDA2.x cannot be converted: llama.cpp has no such architecture"
    elif case == "no_dir":
        out, words = tmp_path / "nodir" / "m.gguf", "does not exist"
    elif case == "dir":
        out, words = tmp_path, "is a folder"
    elif case == "gguf_src":
        src = tmp_path / "x.gguf"
        src.write_bytes(b"GGUF" + bytes(20))
        words = "already a GGUF file"
    elif case == "moe_dense_layer":
        src, rc, words = block_checkpoint("sdar_moe", tmp_path / "moe", mlp_only_layers=[1]), 1, "MoE in every layer"
    elif case == "no_tokenizer":
        (ck / "tokenizer.json").unlink()
        rc, words = 1, "tokenizer.json: file not found"
    elif case in ("missing_tensor", "unknown_tensor"):
        from safetensors.torch import load_file, save_file

        sd = load_file(str(ck / "model.safetensors"))
        if case == "missing_tensor":
            del sd["model.layers.2.self_attn.v_proj.weight"]
            words = "no tensor for llama.cpp's blk.2.attn_v.weight"
        else:
            sd["model.layers.0.mlp.shared_expert.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].clone()
            words = "'model.layers.0.mlp.shared_expert.up_proj.weight' has no counterpart in llama.cpp's qwen3 graph"
        save_file(sd, str(ck / "model.safetensors"))
        rc = 1
    elif case in ("shared_expert", "causal"):
        from arch_baby import BABY

        cfg = dict(BABY["lladamoe"], shared_expert_intermediate_size=20) if case == "shared_expert" else BABY["qwen3"]
        (ck / "config.json").write_text(json.dumps(cfg))
        rc, words = 1, ("no shared expert" if case == "shared_expert" else "is not a family convert writes")
    elif case == "threads":
        args, words = ["--threads", "0"], "--threads"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(src), "-o", str(out), *args]) == rc
    assert words in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_too_little_disk_space_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    need("gguf")
    import shutil as sh
    from collections import namedtuple

    ck = block_checkpoint("sdar", tmp_path / "ck")
    monkeypatch.setattr(sh, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 30, 1 << 30, 1 << 20))
    assert convert(ck, tmp_path / "m.gguf") == 1
    assert "not enough disk space" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("missing", ["gguf", "llama_cpp"])
def test_a_missing_package_is_one_line_naming_the_extra(missing, tmp_path, capsys, monkeypatch):
    """Without ``gguf`` nothing can be written; without llama-cpp-python the quantized types are refused before
    the intermediate is written (the direct types still work)."""
    import sys

    need("gguf")
    from localdiff.backends import llama_lib as backend  # the shared llama.cpp loader

    ck = block_checkpoint("sdar", tmp_path / "ck")
    monkeypatch.setattr(backend, "_LIB", None)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    assert convert(ck, tmp_path / "m.gguf", "Q8_0") == 1
    assert 'pip install "localdiff[gguf]"' in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    if missing == "llama_cpp":
        assert convert(ck, tmp_path / "m.gguf", "F16") == 0
