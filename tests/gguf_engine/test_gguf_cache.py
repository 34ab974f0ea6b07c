"""Fast-dLLM's prefix and dual caches on masked-diffusion GGUF files (issue 43): the K/V in llama.cpp's memory (the
file loaded as its llama / qwen2 twin, ``localdiff.backends.gguf_window``) give the torch path's tokens at temperature
0 for LLaDA and Dream, every cache mode, 20 prompts each; a prompt past position 512 (a full pass larger than
llama.cpp's default 512-token micro-batch) and a left-padded batch; LLaDA-MoE is refused in one line. Skips without
llama-cpp-python / gguf unless ``LOCALDIFF_REQUIRE_GGUF=1``.
"""

from __future__ import annotations

import json

import pytest
import torch

from localdiff.cli import main

from gguf_models import need as _need

FAMILIES = ["llada", "dream"]
MODES = ["none", "prefix", "dual"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _write(family, folder, seed=3, length=1024):
    """gguf_models.write_both with a longer context (prompts past position 512)."""
    import gguf_models as gm
    from safetensors.torch import save_file

    cfg, sd = gm.upstream(family, gm.dims(family), seed)
    cfg["max_sequence_length" if family == "llada" else "max_position_embeddings"] = length
    hf = folder / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(cfg))
    path = folder / "model-F32.gguf"
    gm.write_gguf(family, cfg, sd, path)
    return hf, path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family → (torch model, GGUF model)."""
    _need("gguf")
    _need("llama_cpp")
    import localdiff

    out = {}
    for fam in FAMILIES:
        hf, path = _write(fam, tmp_path_factory.mktemp(fam))
        out[fam] = (localdiff.load(str(hf)), localdiff.load(str(path), threads=1))
    return out


def _prompts(n=20, lo=3, hi=12, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 120, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _settings(family):
    return dict(steps=8, block_length=4) if family == "llada" else dict(steps=8, block_length=4, alg="entropy")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_temperature_0_tokens_equal_the_torch_path(family, mode, models):
    ref, gg = models[family]
    kw = _settings(family)
    for p in _prompts():
        a = ref.generate(p, max_new_tokens=12, seed=0, kv_cache=mode, **kw)
        b = gg.generate(p, max_new_tokens=12, seed=0, kv_cache=mode, **kw)
        assert a.token_ids == b.token_ids, (family, mode, p)
        assert a.stats.forwards == b.stats.forwards


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompt_and_padded_batch(family, models):
    """A 520-token prompt (the refresh pass is one batch past llama.cpp's default 512-token micro-batch; the
    twin's context grows to it) and a left-padded batch of two rows, prefix and dual."""
    ref, gg = models[family]
    kw = _settings(family)
    long = _prompts(1, 520, 521, seed=5)[0]
    batch = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
    for mode in ("prefix", "dual"):
        for p in (long, batch):
            a = ref.generate(p, max_new_tokens=8, seed=0, kv_cache=mode, **kw)
            b = gg.generate(p, max_new_tokens=8, seed=0, kv_cache=mode, **kw)
            assert a.token_ids == b.token_ids, (family, mode, p)
    assert gg.net._twin.ctx.n_ctx >= 528


def test_the_dual_cache_reads_the_suffix_from_the_blocks_first_pass(models):
    """The dual window's logits equal the torch path's ``forward_window`` over the same cached K/V (first pass over
    the sequence, then a changed block decoded against prefix + stale suffix) — not a full recompute."""
    ref, gg = models["llada"]
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 120, (1, 30), generator=g)
    _, kv = ref.net.forward_window(x, 0, None, return_kv=True)
    gg.net.forward_window(x, 0, None, return_kv=True)
    y = x.clone()
    y[0, 10:14] = torch.tensor([1, 2, 3, 4])
    y[0, 20:] = 126  # the suffix changes too: the cache keeps the first pass's
    a = ref.net.forward_window(y[:, 10:14], 10, kv)
    b = gg.net.forward_window(y[:, 10:14], 10, [None])
    assert ((a - b).abs().max() / a.abs().max()) <= 1e-4
    full = ref.net.logits_full(y)[:, 10:14]
    assert ((full - b).abs().max() / full.abs().max()) > 1e-3


def test_llada_moe_caches_are_refused_in_one_line(tmp_path, capsys):
    _need("gguf")
    _need("llama_cpp")
    import gguf_models as gm

    _, path = gm.write_both("lladamoe", tmp_path, seed=1)
    assert main(["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--kv-cache", "dual"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "kv_cache prefix/dual: not for GGUF architecture 'llada-moe'" in err
    assert main(["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--kv-budget", "1MiB"]) == 2
    assert "--kv-budget: a GGUF model's K/V live in llama.cpp's memory" in capsys.readouterr().err
    assert main(["gen", "-m", str(path), "--raw", "-p", "hi", "-n", "4", "--kv-cache", "none", "-v"]) == 0
    assert "cache kv_cache none (full pass per step)" in capsys.readouterr().err
