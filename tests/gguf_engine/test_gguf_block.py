"""Block-diffusion models on GGUF (issue 43): tiny SDAR / SDAR-MoE / Fast-dLLM v2 written as an upstream checkpoint
and as a qwen3 / qwen3moe / qwen2 GGUF with localdiff's diffusion keys (``gguf_block_models``); llama.cpp (our
``GGUFBlockNet``, the block cache in its K/V memory) against the torch path, token for token at temperature 0, and the
cached GGUF decoding against an uncached GGUF pass per step. Skips without llama-cpp-python / gguf unless
``LOCALDIFF_REQUIRE_GGUF=1``.
"""

from __future__ import annotations

import pytest
import torch

from localdiff.cli import main

from gguf_models import need as _need

KINDS = ["sdar", "sdar_moe", "Fast_dLLM_Qwen"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind → (checkpoint folder, F32 GGUF); contexts of 1024 positions (prompts that cross position 512)."""
    _need("gguf")
    import gguf_block_models as gb

    return {k: gb.write_both(k, tmp_path_factory.mktemp(k), seed=2, max_position_embeddings=1024) for k in KINDS}


def _both(pair):
    import localdiff

    _need("llama_cpp")
    hf, path = pair
    return localdiff.load(str(hf)), localdiff.load(str(path), threads=1)


def _prompts(n=20, lo=3, hi=14, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 125, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_f32_logits_agree_with_the_torch_path(kind, files):
    ref, gg = _both(files[kind])
    assert gg.backend == "gguf" and gg.family == "block" and gg.quant == "F32"
    assert gg.config.block_size == ref.config.block_size and gg.config.token_shift == ref.config.token_shift
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 125, (2, 37), generator=g)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :6] = False
    for m in (None, mask):
        a, b = ref.net.logits_full(ids, m), gg.net.logits_full(ids, m)
        keep = torch.ones(2, 37, dtype=torch.bool) if m is None else m
        err = (a - b)[keep].abs().max() / a[keep].abs().max()
        assert err <= 1e-4, f"{kind}: relative logit error {err:.2e}"


SETTINGS = {
    "sdar": [
        dict(remasking_strategy="low_confidence_static", steps=4),
        dict(remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2),
    ],
    "sdar_moe": [dict(remasking_strategy="low_confidence_static", steps=2)],
    "Fast_dLLM_Qwen": [dict(small_block_size=4, threshold=0.3), dict(small_block_size=8, threshold=0.9)],
}


@pytest.mark.parametrize("kind", KINDS)
def test_temperature_0_decoding_gives_the_same_tokens_on_both_backends(kind, files):
    """20 prompts per decoder setting (SDAR static and dynamic, SDAR-MoE, Fast-dLLM v2 sub-blocks), EOS handling
    included (tiny random models end early on id 1 now and then)."""
    ref, gg = _both(files[kind])
    for kw in SETTINGS[kind]:
        for p in _prompts():
            a = ref.generate(p, max_new_tokens=12, seed=0, **kw)
            b = gg.generate(p, max_new_tokens=12, seed=0, **kw)
            assert a.token_ids == b.token_ids, (kind, kw, p)
            assert a.stats.forwards == b.stats.forwards and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("kind", ["sdar", "Fast_dLLM_Qwen"])
def test_long_prompts_batches_and_a_growing_context(kind, files, monkeypatch):
    """A prompt past position 512 (llama.cpp's default micro-batch; its blocks are decoded one batch each), a
    left-padded batch of two rows whose context grows past its first allocation (llama.cpp rounds contexts to 256
    cells: the cells are copied into the larger context) within one generation."""
    import localdiff.backends.llama_seq as ls

    monkeypatch.setattr(ls, "ROUND", 32)
    ref, gg = _both(files[kind])
    long = _prompts(1, 515, 530, seed=3)[0]
    kw = SETTINGS[kind][0]
    assert ref.generate(long, max_new_tokens=16, **kw).token_ids == gg.generate(long, max_new_tokens=16, **kw).token_ids
    assert gg.net.ctx.n_ctx >= len(long) + 16
    batch = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    gg.net.ctx.close()
    gg.net.ctx, gg.net.owner = None, None
    a = ref.generate(batch, max_new_tokens=128, **kw)
    sizes = []
    grow = ls.grown

    def spy(old, make, seqs):
        new = grow(old, make, seqs)
        sizes.append(new.n_ctx)
        return new

    monkeypatch.setattr("localdiff.backends.gguf_block.grown", spy)
    b = gg.generate(batch, max_new_tokens=128, **kw)
    assert a.token_ids == b.token_ids
    assert len(sizes) >= 2 and sizes == sorted(sizes)  # grown past the first allocation


def test_cached_decoding_equals_an_uncached_pass_per_step(files):
    """Every denoising step's logits (SDAR, 20 prompts, static and dynamic) against an uncached block-causal pass
    over the whole sequence so far on a second model instance (an empty memory each time)."""
    import localdiff

    _need("llama_cpp")
    _, path = files["sdar"]
    gg = localdiff.load(str(path), threads=1)
    fresh = localdiff.load(str(path), threads=1).net
    net = gg.net
    real = net.denoise
    seen = []

    def checked(canvas, cache, sc=None, prefill_ids=None, prefill_mask=None):
        got = real(canvas, cache, sc, prefill_ids, prefill_mask)
        seq = torch.tensor([cache.token_ids[0] + canvas[0].tolist()])
        want = fresh.logits_full(seq)[:, -canvas.shape[1] :]
        assert torch.equal(got, want) or (got - want).abs().max() <= 1e-5 * want.abs().max()
        seen.append(seq.shape[1])
        return got

    net.denoise = checked
    cache = gg.new_cache()
    for kw in SETTINGS["sdar"]:
        for p in _prompts(seed=11):
            gg.generate(p, max_new_tokens=12, **kw)
        gg.generate([9, 8, 7, 6, 5], max_new_tokens=8, cache=cache, **kw)  # a chat turn, then the next one
        gg.generate([9, 8, 7, 6, 5, 4, 3, 2, 1], max_new_tokens=8, cache=cache, **kw)
    assert len(seen) > 200


def test_chat_cache_reuse_matches_a_fresh_generation(files):
    ref, gg = _both(files["sdar"])
    cache = gg.new_cache()
    first = [5, 6, 7, 8, 9, 10]
    a = gg.generate(first, max_new_tokens=8, cache=cache)
    turn = first + a.token_ids + [11, 12, 13]
    b = gg.generate(turn, max_new_tokens=8, cache=cache)
    assert b.stats.prefill_tokens_reused > 0
    assert b.token_ids == ref.generate(turn, max_new_tokens=8).token_ids
    other = gg.new_cache()  # a second chat on the same model: memory rebuilt
    assert (
        gg.generate([50, 51, 52], max_new_tokens=8, cache=other).token_ids
        == ref.generate([50, 51, 52], max_new_tokens=8).token_ids
    )
    c = gg.generate(turn, max_new_tokens=8, cache=cache)  # back to the first chat
    assert c.token_ids == b.token_ids


def test_gen_cli_names_engine_quant_and_cache(files, capsys):
    _need("llama_cpp")
    _, path = files["sdar"]
    assert (
        main(
            [
                "gen",
                "-m",
                str(path),
                "--raw",
                "-p",
                "the cat",
                "-n",
                "8",
                "--seed",
                "0",
                "-v",
                "--threads",
                "1",
                "--gpu-layers",
                "0",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "engine llama.cpp, F32, cache exact block cache (llama.cpp K/V memory), 0 GPU layers, 1 thread" in err
    assert main(["show", str(path), "--json"]) == 0
    import json

    shown = json.loads(capsys.readouterr().out)
    assert shown["summary"]["family"] == "block" and shown["summary"]["block_size"] == 4
    assert shown["decoder"]["policy"] == "sdar"


def test_bad_block_files_and_options_give_one_line(files, tmp_path, capsys):
    import gguf_models as gm
    import gguf_block_models as gb

    hf, path = files["Fast_dLLM_Qwen"]
    cases = []
    bad = tmp_path / "t.gguf"
    gb.write_gguf("sdar", files["sdar"][0], bad, model_type="llada2_moe")
    cases.append((["gen", "-m", str(bad), "-p", "hi", "-n", "4"], 1, "LLaDA2.x is not in llama.cpp yet"))
    cfg, sd = gm.upstream("dream", gm.dims("dream"))
    l2 = tmp_path / "l2.gguf"
    gm.write_gguf("dream", cfg, sd, l2, arch="llada2")
    cases.append((["gen", "-m", str(l2), "-p", "hi", "-n", "4"], 1, "LLaDA2.x is not in llama.cpp yet"))
    wrong = tmp_path / "w.gguf"
    gb.write_gguf("sdar", files["sdar"][0], wrong, model_type="fast_dllm_v2")
    cases.append((["gen", "-m", str(wrong), "-p", "hi", "-n", "4"], 1, "stored as GGUF architecture 'qwen2'"))
    _need("llama_cpp")
    cases.append(
        (
            ["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--use-block-cache"],
            2,
            "use_block_cache: not on a GGUF model",
        )
    )
    cases.append((["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--gpu-layers", "-3"], 2, "--gpu-layers"))
    cases.append(
        (
            ["gen", "--endpoint", "http://127.0.0.1:1", "-p", "hi", "--gpu-layers", "2"],
            2,
            "--gpu-layers applies to local models, not to --endpoint",
        )
    )
    cases.append(
        (["gen", "-m", str(hf), "-p", "hi", "-n", "4", "--gpu-layers", "all"], 2, "--gpu-layers: only for GGUF models")
    )
    cases.append(
        (
            ["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--kv-budget", "1MiB"],
            2,
            "--kv-budget: a GGUF model's K/V live in llama.cpp's memory",
        )
    )
    for argv, code, text in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and text in err, err


def test_serve_answers_from_gguf_files_of_both_families(tmp_path):
    """``localdiff serve`` with GGUF files: the embedded tiny-bd (SDAR) and tiny-mdm (LLaDA) converted with their
    tokenizers and chat templates; the HTTP answer is the direct generation's, and tiny-bd's GGUF gives the torch
    checkpoint's tokens."""
    _need("gguf")
    _need("llama_cpp")
    import httpx
    from servehelpers import Running

    import gguf_block_models as gb
    import localdiff
    from localdiff.bench.gguf_convert import convert_llada
    from localdiff.paths import models_dir

    bd = tmp_path / "tiny-bd.gguf"
    gb.write_gguf("sdar", models_dir() / "tiny-bd", bd, tokenizer=True)
    mdm = convert_llada(models_dir() / "tiny-mdm", tmp_path / "tiny-mdm.gguf")
    q, opts = (
        "What is 41 + 93?",
        {
            "seed": 3,
            "num_predict": 16,
            "steps": 4,
            "remasking_strategy": "low_confidence_dynamic",
            "confidence_threshold": 0.9,
        },
    )
    torch_bd = localdiff.load("tiny-bd").generate(q, max_new_tokens=16, seed=3).token_ids
    from localdiff.serve.names import ModelNames

    s = Running(model=str(bd), names=ModelNames([str(bd), str(mdm)], installed=lambda: []))  # serve -m bd -m mdm
    try:
        for path in (bd, mdm):
            kw = {k: v for k, v in opts.items() if k in ("seed", "num_predict")} if path == mdm else opts
            want = localdiff.load(str(path), threads=1).generate(
                q, max_new_tokens=16, seed=3, **{k: v for k, v in kw.items() if k not in ("seed", "num_predict")}
            )
            r = httpx.post(
                s.url + "/api/chat",
                json={"model": str(path), "stream": False, "messages": [{"role": "user", "content": q}], "options": kw},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["message"]["content"] == want.text
            if path == bd:  # the same ids (llama.cpp's detokenizer keeps the first word's "▁" as a space)
                assert want.token_ids == torch_bd and want.text.strip() == r.json()["message"]["content"].strip()
    finally:
        s.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_and_q4_k_m_top1_agreement_with_f32(kind, tmp_path, capsys):
    """A block model with rows llama.cpp's quantizer takes (hidden 256; Q4_K blocks hold 256 values), written F32
    and quantized by llama.cpp (``llama_model_quantize``): top-1 agreement of the quantized files' logits with the
    F32 file's over 2 × 64 positions, printed and held to a loose floor: random tiny models have small top-1 margins
    (measured: Q8_0 0.84–0.93, Q4_K_M 0.31–0.61 over SDAR, SDAR-MoE, Fast-dLLM v2; llama.cpp also rounds the
    activations to 8 bits in these matmuls)."""
    _need("gguf")
    _need("llama_cpp")
    import gguf_block_models as gb

    import localdiff
    from localdiff.bench.gguf_block import QUANTS, quantize

    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if kind != "Fast_dLLM_Qwen":
        size.update(head_dim=64)
    if kind == "sdar_moe":
        size.update(moe_intermediate_size=256)
    _, f32 = gb.write_both(kind, tmp_path, seed=4, **size)
    ids = torch.randint(3, 125, (2, 64), generator=torch.Generator().manual_seed(0))
    base = localdiff.load(str(f32), threads=1).net.logits_full(ids)
    for q, ftype in QUANTS.items():
        path = tmp_path / f"m-{q}.gguf"
        quantize(f32, path, ftype, 1)
        m = localdiff.load(str(path), threads=1)
        assert m.quant == q
        got = m.net.logits_full(ids)
        agree = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
        with capsys.disabled():
            print(f"\n{kind} {q}: top-1 agreement with F32 {agree:.3f}")
        assert agree >= (0.75 if q == "Q8_0" else 0.2), (kind, q, agree)  # chance: 1 / 131
