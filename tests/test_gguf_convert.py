"""``localdiff convert`` (issue 43 item 3): tiny checkpoints in each upstream layout (LLaDA / LLaDA-MoE / Dream from
``gguf_models``, SDAR / SDAR-MoE / Fast-dLLM v2 from ``block_models``, all with the shipped tiny tokenizer) →
GGUF; llama.cpp's logits on the F32 file (flash attention off, F32 K/V) against the torch checkpoint's; ``gen`` on
converted files; Q8_0 / Q4_K_M through llama.cpp's quantizer; ``--force``, atomic output and bad input.

Block models are checked with their own attention: llama.cpp decodes the sequence block by block into its K/V
memory with causal attention off (each block sees the finished blocks and itself, bidirectionally) — the torch
model's block-causal ``logits_full``. Skips without ``gguf`` / ``llama_cpp`` (fails under LOCALDIFF_REQUIRE_GGUF=1).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from localdiff.cli import main

from gguf_models import need

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
MASKED = ["llada", "lladamoe", "dream"]
BLOCK = {"sdar": {}, "sdar_moe": {"mlp_only_layers": []}, "Fast_dLLM_Qwen": {}}
#: sizes whose rows are multiples of 32 (Q8_0 / Q5_0 blocks) for the quantized checks
Q_BLOCK = dict(hidden_size=64, head_dim=16, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def masked_checkpoint(family: str, folder, q8: bool = False, seed: int = 3):
    """A LLaDA / LLaDA-MoE / Dream checkpoint in its upstream layout with the tiny tokenizer (365 tokens)."""
    import gguf_models as gm
    from safetensors.torch import save_file

    cfg, sd = gm.upstream(family, dict(gm.dims(family, q8), vocab=365), seed)
    cfg.update(mask_token_id=6, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        shutil.copy(ROOT / "models/tiny" / f, folder / f)
    return folder


def block_checkpoint(kind: str, folder, seed: int = 3, **over):
    from block_models import write_checkpoint

    return write_checkpoint(folder, kind, seed=seed, tokenizer=True, **dict(BLOCK[kind], **over))


def convert(src, out, qtype="F32", *extra) -> int:
    return main(["convert", str(src), "-o", str(out), "--type", qtype, "-q", *extra])


def llama_logits(path, ids: list[int], block: int | None = None) -> torch.Tensor:
    """llama.cpp's raw logits [T, V] for ``ids``: one non-causal batch (``block`` None), or block by block into the
    K/V memory with causal attention off. CPU, one thread, flash attention off, F32 K/V."""
    from localdiff.backends.gguf import llama_cpp

    lib = llama_cpp()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp refused {path}"
    n, step = len(ids), block or len(ids)
    cp = lib.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (n + 63) // 64 * 64
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, 1, 1
    cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = 0                                    # GGML_TYPE_F32
    ctx = lib.llama_init_from_model(model, cp)
    lib.llama_set_causal_attn(ctx, False)
    nv = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(step, 0, 1)
    out = []
    try:
        for s in range(0, n, step):
            chunk = ids[s:s + step]
            batch.n_tokens = len(chunk)
            for j, t in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, s + j, 1, 1
                batch.seq_id[j][0] = 0
            assert lib.llama_decode(ctx, batch) == 0
            arr = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(chunk) * nv,))
            out.append(torch.from_numpy(arr.copy()).view(len(chunk), nv))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return torch.cat(out)


def _ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 365, (n,), generator=g)
    ids[n // 2:] = 6                                            # a canvas of masks after a "prompt"
    return ids.tolist()


def _torch_logits(ckpt, ids):
    import localdiff

    return localdiff.load(str(ckpt), dtype="float32").net.logits_full(torch.tensor([ids]))[0]


def _source(family, tmp_path, **kw):
    if family in MASKED:
        return masked_checkpoint(family, tmp_path / family, **kw), None
    ck = block_checkpoint(family, tmp_path / family, **kw)
    return ck, json.loads((ck / "config.json").read_text()).get("block_size") or json.loads(
        (ck / "config.json").read_text())["bd_size"]


@pytest.mark.parametrize("family", MASKED + list(BLOCK))
def test_f32_round_trip_logits_equal_the_checkpoint(family, tmp_path):
    need("gguf")
    need("llama_cpp")
    ck, block = _source(family, tmp_path)
    out = tmp_path / "m.gguf"
    assert convert(ck, out) == 0
    ids = _ids(24 if block else 37)
    a, b = _torch_logits(ck, ids), llama_logits(out, ids, block)
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert err <= 1e-5, f"{family}: relative logit error {err:.2e}"
    if block:   # the block mask matters: a fully bidirectional pass over the same ids differs
        assert ((a - llama_logits(out, ids, None)).abs().max() / a.abs().max()).item() > 1e-3
    from localdiff.backends.gguf_file import read_header

    md = read_header(out).metadata
    assert md["localdiff.mask_token_id"] == 6 and md["tokenizer.ggml.mask_token_id"] == 6
    assert md["localdiff.family"] == ("block" if block else "masked")
    assert md.get("localdiff.block_length") == block and md["tokenizer.ggml.eos_token_id"] == 1
    assert isinstance(md.get("tokenizer.chat_template"), str)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_gen_runs_a_converted_file_and_matches_the_torch_path(family, tmp_path, capsys):
    need("gguf")
    need("llama_cpp")
    import localdiff

    ck = masked_checkpoint(family, tmp_path / family)
    out = tmp_path / f"{family}.gguf"
    assert convert(ck, out, "F16") == 0
    assert main(["gen", "-m", str(out), "-p", "hello", "-n", "4", "--steps", "4", "-q"]) == 0
    capsys.readouterr()
    assert convert(ck, out, "F32", "--force") == 0
    ref, gg = localdiff.load(str(ck), dtype="float32"), localdiff.load(str(out), threads=1)
    assert gg.backend == "gguf" and gg.eos_token_ids[:2] == [1, 5]
    for prompt in ([9, 10, 11, 12], [40, 41, 42]):
        assert ref.generate(prompt, max_new_tokens=8, steps=8).token_ids == \
            gg.generate(prompt, max_new_tokens=8, steps=8).token_ids


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_q8_0_and_q4_k_m_files_load_and_mostly_agree_with_f32(family, tmp_path):
    """Top-1 agreement of the quantized files with the F32 file over 48 positions (reported; floors are loose: a
    random tiny model's top-1 margins are small — measured: LLaDA Q8_0 1.000, Q4_K_M 0.958; SDAR (weights
    N(0, 0.3²), flat logits) Q8_0 0.979, Q4_K_M 0.396. With 64-wide rows llama.cpp's Q4_K_M mix falls back to Q5_0 /
    Q8_0, as its quantizer does for rows that are not a multiple of 256)."""
    need("gguf")
    need("llama_cpp")
    from localdiff.backends.gguf_file import read_header

    if family == "llada":
        ck, block = masked_checkpoint(family, tmp_path / family, q8=True), None
    else:
        ck, block = block_checkpoint(family, tmp_path / family, **Q_BLOCK), 4
    assert convert(ck, tmp_path / "f32.gguf") == 0
    ids = _ids(48, seed=4)
    ref = llama_logits(tmp_path / "f32.gguf", ids, block)
    for qtype, floor in (("Q8_0", 0.9), ("Q4_K_M", 0.3)):
        path = tmp_path / f"{qtype}.gguf"
        assert convert(ck, path, qtype) == 0
        h = read_header(path)
        assert h.quant == qtype and path.stat().st_size < (tmp_path / "f32.gguf").stat().st_size / 2
        got = llama_logits(path, ids, block)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{family} {qtype}: top-1 agreement with F32 {agree:.3f}")
        assert agree >= floor, f"{family} {qtype}: top-1 agreement {agree:.3f}"
    assert not list(tmp_path.glob("*.partial"))


# -- atomic output, --force, bad input (no llama.cpp needed except for the quantizer's failure) ---------------------
def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_refuses_to_overwrite_without_force_and_keeps_the_old_file_until_the_new_one_is_complete(tmp_path, capsys,
                                                                                                   monkeypatch):
    need("gguf")
    from localdiff.backends import gguf_write

    ck = block_checkpoint("sdar", tmp_path / "ck")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old contents")
    assert convert(ck, out) == 2
    assert "--force" in _one_line_error(capsys) and out.read_bytes() == b"old contents"
    calls = []
    real = gguf_write._as_stored

    def interrupted(x, dtype):           # Ctrl-C after a few tensors were written
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


@pytest.mark.parametrize("case", ["missing", "type", "diffusion_gemma", "refusion", "llada2", "no_dir", "dir",
                                  "gguf_src", "moe_dense_layer", "no_tokenizer", "threads"])
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
    elif case == "threads":
        args, words = ["--threads", "0"], "--threads"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(src), "-o", str(out), *args]) == rc
    assert words in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_byte_level_bpe_tokenizer_is_written_as_llama_cpp_gpt2_and_tokenizes_alike(tmp_path):
    """Dream / SDAR / Fast-dLLM ship byte-level BPE (Qwen2's pre-tokenizer regex): written as ``gpt2`` with the
    merges and pre-tokenizer "qwen2"; llama.cpp's encoding equals the ``tokenizers`` library's."""
    need("gguf")
    need("llama_cpp")
    import gguf_models as gm
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    import localdiff
    from localdiff.backends.gguf_vocab import PRE_TOKENIZERS

    ck = masked_checkpoint("dream", tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    toks, types, merges = gm._vocab(365)
    vocab = {t: i for i, t in enumerate(toks) if types[i] != 5}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    regex = next(k for k, v in PRE_TOKENIZERS.items() if v == "qwen2")
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(gm.SPECIALS.values()))
    tk.save(str(ck / "tokenizer.json"))
    cfg.update(mask_token_id=gm.MASK, eos_token_id=gm.EOS, pad_token_id=gm.PAD, bos_token_id=122)
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "generation_config.json").unlink()
    (ck / "chat_template.jinja").write_text(gm.TEMPLATE)
    out = tmp_path / "d.gguf"
    assert convert(ck, out) == 0
    from localdiff.backends.gguf_file import read_header

    md = read_header(out).metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
    gg = localdiff.load(str(out), threads=1)
    texts = ["the theory in the set", "  spaces,   then\nnew lines\n\n and 2024 digits!",
             "<|user|>are these the ones?<|end|><|assistant|>"]
    for t in texts:
        assert gg.tokenizer.encode(t) == tk.encode(t).ids, t
    assert gg.tokenizer.decode(tk.encode(texts[1]).ids) == texts[1]


def test_a_bf16_checkpoint_is_written_bit_exact_and_quantized_from_a_bf16_intermediate(tmp_path, capsys):
    """BF16 / F16 output keeps the checkpoint's bits (a bf16 checkpoint → BF16 file: identical); a quantized type
    goes through the lossless BF16 intermediate (named in the progress lines) and loads."""
    need("gguf")
    import gguf
    from safetensors.torch import load_file, save_file

    ck = block_checkpoint("sdar", tmp_path / "ck", **Q_BLOCK)
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(ck / "model.safetensors")).items()}
    save_file(sd, str(ck / "model.safetensors"))
    out = tmp_path / "b.gguf"
    assert main(["convert", str(ck), "-o", str(out), "--type", "bf16"]) == 0
    err = capsys.readouterr().err
    assert "writing b.gguf (BF16)" in err and "wrote " in err
    r = gguf.GGUFReader(str(out))
    got = {t.name: t for t in r.tensors}
    q = got["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    want = sd["model.layers.1.self_attn.q_proj.weight"].view(torch.int16).numpy()
    assert np.array_equal(np.asarray(q.data).view(np.int16).reshape(want.shape), want)
    assert got["blk.1.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    need("llama_cpp")
    assert main(["convert", str(ck), "-o", str(tmp_path / "q.gguf"), "--type", "Q8_0"]) == 0
    assert "writing the BF16 intermediate" in capsys.readouterr().err
    ids = _ids(48, seed=4)       # the random SDAR's margins are small: 0.958 here (loose floor)
    agree = (llama_logits(tmp_path / "q.gguf", ids, 4).argmax(-1) == llama_logits(out, ids, 4).argmax(-1))
    assert agree.float().mean().item() >= 0.8
    assert convert(ck, tmp_path / "quiet.gguf", "F16") == 0 and capsys.readouterr().err == ""
