"""``localdiff convert`` (issue 43 item 3): tiny checkpoints in each upstream layout (LLaDA / LLaDA-MoE / Dream from
``gguf_models``, SDAR / SDAR-MoE / Fast-dLLM v2 from ``block_models``, all with the shipped tiny tokenizer) →
GGUF; llama.cpp's logits on the F32 file (flash attention off, F32 K/V) against the torch checkpoint's; ``gen`` on
converted files; Q8_0 / Q4_K_M through llama.cpp's quantizer; the tokenizer kinds. Output handling and bad input:
``test_gguf_convert_cli.py``.

Block models are checked with their own attention: llama.cpp decodes the sequence block by block into its K/V
memory with causal attention off (each block sees the finished blocks and itself, bidirectionally) — the torch
model's block-causal ``logits_full``. Skips without ``gguf`` / ``llama_cpp`` (fails under LOCALDIFF_REQUIRE_GGUF=1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from localdiff.cli import main

from convert_helpers import (
    BLOCK,
    MASKED,
    Q_BLOCK,
    block_checkpoint,
    convert,
    llama_logits,
    masked_checkpoint,
    random_ids,
)
from gguf_models import need


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _torch_logits(ckpt, ids):
    import localdiff

    return localdiff.load(str(ckpt), dtype="float32").net.logits_full(torch.tensor([ids]))[0]


def _source(family, tmp_path, **kw):
    if family in MASKED:
        return masked_checkpoint(family, tmp_path / family, **kw), None
    ck = block_checkpoint(family, tmp_path / family, **kw)
    return ck, json.loads((ck / "config.json").read_text()).get("block_size") or json.loads(
        (ck / "config.json").read_text()
    )["bd_size"]


@pytest.mark.parametrize("family", MASKED + list(BLOCK))
def test_f32_round_trip_logits_equal_the_checkpoint(family, tmp_path):
    need("gguf")
    need("llama_cpp")
    ck, block = _source(family, tmp_path)
    out = tmp_path / "m.gguf"
    assert convert(ck, out) == 0
    ids = random_ids(24 if block else 37)
    a, b = _torch_logits(ck, ids), llama_logits(out, ids, block)
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert err <= 1e-5, f"{family}: relative logit error {err:.2e}"
    if block:  # the block mask matters: a fully bidirectional pass over the same ids differs
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
        assert (
            ref.generate(prompt, max_new_tokens=8, steps=8).token_ids
            == gg.generate(prompt, max_new_tokens=8, steps=8).token_ids
        )


@pytest.mark.parametrize("family", MASKED + list(BLOCK))
def test_q8_0_and_q4_k_m_files_load_and_mostly_agree_with_f32(family, tmp_path):
    """Top-1 agreement of the quantized files with the F32 file over 48 positions (reported; floors are loose: a
    random tiny model's top-1 margins are small). Measured, seeds 3 / 4 / 5, Q8_0 | Q4_K_M: LLaDA 1.00 0.98 1.00 |
    0.96 0.92 0.96; LLaDA-MoE 0.94 0.96 0.96 | 0.81 0.92 0.92; Dream 0.96 1.00 0.85 | 0.96 0.96 0.90; SDAR 0.98 0.90
    0.96 | 0.40 0.60 0.79; SDAR-MoE 0.98 0.90 0.92 | 0.58 0.60 0.63; Fast-dLLM v2 0.83 0.94 0.83 | 0.46 0.56 0.52 (the
    block models' random weights are N(0, 0.3²): flat logits). With 64-wide rows llama.cpp's Q4_K_M mix falls back
    to Q5_0 / Q8_0, as its quantizer does for rows that are not a multiple of 256."""
    need("gguf")
    need("llama_cpp")
    from localdiff.backends.gguf_file import read_header

    if family in MASKED:
        ck, block = masked_checkpoint(family, tmp_path / family, q8=True), None
    else:
        ck = block_checkpoint(family, tmp_path / family, **Q_BLOCK)
        block = 8 if family == "Fast_dLLM_Qwen" else 4
    assert convert(ck, tmp_path / "f32.gguf") == 0
    ids = random_ids(48, seed=4)
    ref = llama_logits(tmp_path / "f32.gguf", ids, block)
    for qtype, floor in (("Q8_0", 0.75), ("Q4_K_M", 0.3)):
        path = tmp_path / f"{qtype}.gguf"
        assert convert(ck, path, qtype) == 0
        h = read_header(path)
        assert h.quant == qtype and path.stat().st_size < (tmp_path / "f32.gguf").stat().st_size / 2
        got = llama_logits(path, ids, block)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{family} {qtype}: top-1 agreement with F32 {agree:.3f}")
        assert agree >= floor, f"{family} {qtype}: top-1 agreement {agree:.3f}"
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("qtype", ["Q5_K_M", "Q6_K"])
def test_q5_k_m_and_q6_k_files_load(qtype, tmp_path):
    need("gguf")
    need("llama_cpp")
    from localdiff.backends.gguf_file import read_header

    ck = masked_checkpoint("dream", tmp_path / "ck", q8=True)
    assert convert(ck, tmp_path / "f32.gguf") == 0 and convert(ck, tmp_path / "q.gguf", qtype) == 0
    assert read_header(tmp_path / "q.gguf").quant == qtype
    ids = random_ids(40, seed=2)
    a, b = llama_logits(tmp_path / "f32.gguf", ids), llama_logits(tmp_path / "q.gguf", ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75
    assert 1e-4 < ((a - b).abs().max() / a.abs().max()).item() < 0.1  # really quantized, and close


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
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
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
    texts = [
        "the theory in the set",
        "  spaces,   then\nnew lines\n\n and 2024 digits!",
        "<|user|>are these the ones?<|end|><|assistant|>",
    ]
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
    ids = random_ids(48, seed=4)  # the random SDAR's margins are small: 0.958 here (loose floor)
    agree = llama_logits(tmp_path / "q.gguf", ids, 4).argmax(-1) == llama_logits(out, ids, 4).argmax(-1)
    assert agree.float().mean().item() >= 0.8
    assert convert(ck, tmp_path / "quiet.gguf", "F16") == 0 and capsys.readouterr().err == ""


def test_a_catalog_name_resolves_like_gen_and_the_trained_tiny_sdar_round_trips(tmp_path):
    """SRC resolved as ``gen -m`` does (the embedded ``tiny-bd``, a trained SDAR): its F32 file's block-causal logits
    equal the torch model's, and llama.cpp tokenizes a chat-templated prompt as tokenizer.json does."""
    need("gguf")
    need("llama_cpp")
    import localdiff
    from localdiff.backends.gguf_file import read_header

    out = tmp_path / "bd.gguf"
    assert convert("tiny-bd", out) == 0
    md = read_header(out).metadata
    assert md["general.architecture"] == "qwen3" and md["localdiff.model_type"] == "sdar"
    assert md["localdiff.block_length"] == 4 and md["localdiff.family"] == "block"
    assert md["tokenizer.ggml.eot_token_id"] == 5  # generation_config's second end token
    ref = localdiff.load("tiny-bd", dtype="float32")
    text = ref.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 plus 7?"}])
    ids = ref.tokenizer.encode(text)
    ids = ids + [6] * (-len(ids) % 4 + 8)
    a, b = ref.net.logits_full(torch.tensor([ids]))[0], llama_logits(out, ids, 4)
    assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-5
    from localdiff.backends.gguf import llama_cpp

    lib = llama_cpp()
    mp = lib.llama_model_default_params()
    mp.vocab_only = True
    model = lib.llama_model_load_from_file(str(out).encode(), mp)
    buf = (lib.llama_token * 512)()
    n = lib.llama_tokenize(lib.llama_model_get_vocab(model), text.encode(), len(text.encode()), buf, 512, False, True)
    lib.llama_model_free(model)
    assert list(buf[:n]) == ref.tokenizer.encode(text)
