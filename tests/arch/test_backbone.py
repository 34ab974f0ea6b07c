"""Backbone equality with the reference (transformers 5.23.0 DiffusionGemmaForBlockDiffusion), loading, show."""

import json
import shutil

import pytest
import torch

import localdiff
from localdiff.errors import CheckpointError

from transformers import DynamicCache  # test-only reference (the `test` extra)

TOL = 1e-4


def _cache(ref):
    return DynamicCache(config=ref.config.get_text_config(decoder=True))


@pytest.mark.parametrize("which", ["ref_small", "ref_odd"])
def test_logits_match_reference(which, request):
    ref, path = request.getfixturevalue(which)
    m = localdiff.load(path, device="cpu")
    v, c_len = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, v, (1, 13), generator=g)  # longer than the sliding window
    canvas = torch.randint(0, v, (1, c_len), generator=g)
    pkv = _cache(ref)
    with torch.no_grad():
        out = ref(input_ids=ids, past_key_values=pkv, decoder_input_ids=canvas)
    cache = m.new_cache()
    m.prefill(ids, cache)
    # (a) first canvas, no self-conditioning
    assert (m.denoise(canvas, cache) - out.logits).abs().max() <= TOL
    # (b) with self-conditioning logits
    sc = out.logits / 0.6
    with torch.no_grad():
        out_b = ref(past_key_values=pkv, decoder_input_ids=canvas, self_conditioning_logits=sc)
    assert (m.denoise(canvas, cache, sc) - out_b.logits).abs().max() <= TOL
    # (c) third canvas after two canvases were prefilled
    for _ in range(2):
        cv = torch.randint(0, v, (1, c_len), generator=g)
        with torch.no_grad():
            ref.model.encoder(input_ids=cv, past_key_values=pkv)
        m.prefill(cv, cache)
    assert cache.seq_len == pkv.get_seq_length()
    with torch.no_grad():
        out_c = ref(past_key_values=pkv, decoder_input_ids=canvas, self_conditioning_logits=sc)
    assert (m.denoise(canvas, cache, sc) - out_c.logits).abs().max() <= TOL


def test_batch_of_two_prompts_left_padded(ref_small):
    ref, path = ref_small
    m = localdiff.load(path, device="cpu")
    v, c_len = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, v, (12,), generator=g)
    b = torch.randint(3, v, (5,), generator=g)
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[0] = a
    ids[1, 7:] = b
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0] = 1
    mask[1, 7:] = 1
    canvas = torch.randint(0, v, (2, c_len), generator=g)
    pkv = _cache(ref)
    dmask = torch.nn.functional.pad(mask.bool(), (0, c_len), value=True)
    with torch.no_grad():
        ref.model.encoder(input_ids=ids, attention_mask=mask, past_key_values=pkv)
        out = ref(past_key_values=pkv, decoder_input_ids=canvas, decoder_attention_mask=dmask)
    cache = m.new_cache()
    m.prefill(ids, cache, mask)
    ours = m.denoise(canvas, cache)
    assert (ours - out.logits).abs().max() <= TOL
    # each row equals the unbatched computation of its own prompt
    solo = m.new_cache()
    m.prefill(b[None], solo)
    row1 = m.denoise(canvas[1:], solo)
    assert (ours[1:] - row1).abs().max() <= TOL


def test_bf16_within_measured_tolerance(ref_small):
    """bf16 vs the reference in bf16 (16 canvases × 8 positions). Measured here: max |Δlogits| ≈ 0.27, mean ≈ 0.006,
    top-1 agreement ≈ 0.95 (random weights have near-ties). Asserted: max ≤ 0.5, mean ≤ 0.05, top-1 ≥ 0.9."""
    import copy

    ref, path = ref_small
    m = localdiff.load(path, device="cpu", dtype="bfloat16")
    refb = copy.deepcopy(ref).to(torch.bfloat16)  # never round the shared fixture's fp32 weights
    v, c_len = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, v, (1, 13), generator=g)
    canvas = torch.randint(0, v, (16, c_len), generator=g)
    pkv = _cache(refb)
    with torch.no_grad():
        refb.model.encoder(input_ids=ids.expand(16, -1), past_key_values=pkv)
        out = refb(past_key_values=pkv, decoder_input_ids=canvas).logits
    cache = m.new_cache()
    m.prefill(ids.expand(16, -1), cache)
    ours = m.denoise(canvas, cache)
    d = (ours - out).abs()
    assert d.max() <= 0.5 and d.mean() <= 0.05
    assert (ours.argmax(-1) == out.argmax(-1)).float().mean() >= 0.9


def test_vision_tower_never_loaded(tmp_path):
    from refmodels import build_reference, save_reference

    ref = build_reference("small", vision=True)
    save_reference(ref, tmp_path, shard="2MB")
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert any("vision_tower" in k for k in idx["weight_map"])
    m = localdiff.load(tmp_path, device="cpu")
    ours = sum(t.numel() * t.element_size() for t in list(m.net.parameters()) + list(m.net.buffers()))
    text_ref = sum(
        p.numel() * p.element_size() for n, p in ref.named_parameters() if "vision" not in n and "lm_head" not in n
    )
    scalars = sum(b.numel() * b.element_size() for n, b in ref.named_buffers() if n.endswith("layer_scalar"))
    assert ours == text_ref + scalars


def test_checkpoint_without_tokenizer_loads_ids_only(ref_small):
    _, path = ref_small
    m = localdiff.load(path, device="cpu")
    assert m.tokenizer is None
    g = m.generate([5, 6, 7], chat=False, seed=0, max_new_tokens=8, max_denoising_steps=2)
    assert isinstance(g.token_ids, list)
    with pytest.raises(localdiff.errors.TokenizerMissingError):
        m.generate("hello", seed=0)


@pytest.mark.parametrize("damage", ["missing_shard", "bad_shape", "unknown_type", "corrupt_config", "bin_only"])
def test_bad_checkpoints_give_one_clear_error(ref_small, tmp_path, damage):
    _, path = ref_small
    d = tmp_path / "ck"
    shutil.copytree(path, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    if damage == "missing_shard":
        victim = sorted(set(idx["weight_map"].values()))[3]
        (d / victim).unlink()
        expect = victim
    elif damage == "bad_shape":
        from safetensors.torch import load_file, save_file

        name = "model.decoder.layers.0.mlp.up_proj.weight"
        f = d / idx["weight_map"][name]
        t = load_file(f)
        t[name] = torch.zeros(3, 3)
        save_file(t, f, metadata={"format": "pt"})
        expect = f.name
    elif damage == "unknown_type":
        c = json.loads((d / "config.json").read_text())
        c["model_type"] = "llama_diffusion_x"
        (d / "config.json").write_text(json.dumps(c))
        expect = "config.json"
    elif damage == "corrupt_config":
        (d / "config.json").write_text("{not json")
        expect = "config.json"
    else:
        for f in d.glob("*.safetensors*"):
            f.unlink()
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
        expect = "safetensors only"
    with pytest.raises(CheckpointError) as e:
        localdiff.load(d, device="cpu")
    msg = str(e.value)
    assert expect in msg and "\n" not in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_equals_the_per_expert_loop(dtype):
    """The no-autograd CPU path (two torch._grouped_mm calls) is bit-identical to the per-expert loop, empty experts
    included."""
    from localdiff.arch.layers import MoEExperts

    torch.manual_seed(0)
    moe = MoEExperts(8, 64, 32).to(dtype)
    moe.kernel = "grouped"  # bf16's default kernel is the streaming bmm (tests/bench/test_speed.py)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.1)
        moe.down_proj.normal_(0, 0.1)
    x = torch.randn(24, 64, dtype=dtype)
    index = torch.randint(0, 6, (24, 2))  # experts 6 and 7 get no tokens
    weights = torch.rand(24, 2)
    with torch.no_grad():
        assert moe._grouped(x)
        grouped = moe(x, weights, index)
    moe.requires_grad_(False)
    with torch.enable_grad():  # autograd on: the per-expert loop
        assert not moe._grouped(x)
        looped = moe(x, weights, index)
    assert torch.equal(grouped, looped)


@pytest.mark.parametrize("which", ["ref_small", "ref_odd"])
def test_fused_prefill_and_first_step_equal_separate_passes(which, request):
    """denoise(canvas, prefill_ids=...) = prefill then denoise: same logits (and the reference's), same cache.

    Covers a left-padded batch, a prompt longer than the sliding window, and a fused commit of a finished canvas
    (the sliding layers then drop tokens while the canvas still needs the ones before). The tolerance is 1e-6 only
    because MKL's sgemm rounds a few small row counts (< 12) differently from the same rows in a larger matmul;
    with row counts it treats alike the two are bit-identical (next test)."""
    ref, path = request.getfixturevalue(which)
    m = localdiff.load(path, device="cpu")
    v, c_len = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, v, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False
    canvas, nxt, done = (torch.randint(0, v, (2, c_len), generator=g) for _ in range(3))
    sc = torch.randn(2, c_len, v, generator=g)
    sep, fused = m.new_cache(), m.new_cache()
    m.prefill(ids, sep, mask)
    want = m.denoise(canvas, sep)
    got = m.net.denoise(canvas, fused, None, prefill_ids=ids, prefill_mask=mask)
    assert (got - want).abs().max() <= 1e-6
    m.prefill(done, sep)
    want2 = m.denoise(nxt, sep, sc)
    got2 = m.net.denoise(nxt, fused, sc, prefill_ids=done)
    assert (got2 - want2).abs().max() <= 1e-6
    assert fused.seq_len == sep.seq_len == 13 + c_len
    assert torch.equal(fused.mask, sep.mask)
    for i in range(m.config.num_hidden_layers):
        (ka, va), (kb, vb) = sep.past(i), fused.past(i)
        assert ka.shape == kb.shape and (ka - kb).abs().max() <= 1e-6 and (va - vb).abs().max() <= 1e-6
    # row 0 (no padding) against the reference
    pkv = _cache(ref)
    with torch.no_grad():
        ref.model.encoder(input_ids=ids[:1], past_key_values=pkv)
        out = ref(past_key_values=pkv, decoder_input_ids=canvas[:1])
    assert (got[:1] - out.logits).abs().max() <= TOL
    # a prefill-only pass skips the last layer's attention output and FFN: the cache is the same either way
    assert (m.denoise(nxt, sep) - m.denoise(nxt, fused)).abs().max() <= 1e-6


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_pass_is_bit_identical(ref_small, threads):
    """With 16-row parts (a row count sgemm rounds alike alone and inside a larger matmul), the fused pass gives
    exactly the logits and K/V of prefill + denoise: attention reads each part's own keys and the experts group each
    part's tokens apart, as the reference's separate encoder and decoder passes do."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = localdiff.load(ref_small[1], device="cpu")
        v = m.config.vocab_size
        g = torch.Generator().manual_seed(9)
        ids, canvas, nxt = (torch.randint(3, v, (1, 16), generator=g) for _ in range(3))
        sc = torch.randn(1, 16, v, generator=g)
        sep, fused = m.new_cache(), m.new_cache()
        m.prefill(ids, sep)
        assert torch.equal(m.net.denoise(canvas, fused, None, prefill_ids=ids), m.denoise(canvas, sep))
        m.prefill(canvas, sep)
        assert torch.equal(m.net.denoise(nxt, fused, sc, prefill_ids=canvas), m.denoise(nxt, sep, sc))
        for i in range(m.config.num_hidden_layers):
            assert all(torch.equal(a, b) for a, b in zip(sep.past(i), fused.past(i)))
    finally:
        torch.set_num_threads(old)


def test_failed_prefilling_pass_leaves_an_empty_cache(ref_small, monkeypatch):
    """An error (or Ctrl-C) inside a pass that prefills leaves some layers' K/V appended without a commit: the cache
    starts over instead, so a chat that keeps it re-prefills and gets the same logits as a fresh cache."""
    m = localdiff.load(ref_small[1], device="cpu")
    g = torch.Generator().manual_seed(2)
    ids, canvas = torch.randint(3, 100, (1, 13), generator=g), torch.randint(0, 100, (1, 8), generator=g)
    cache = m.new_cache()
    m.prefill(ids, cache)
    cache.token_ids = [ids[0].tolist()]
    layer = m.net.layers[1]
    monkeypatch.setattr(layer, "ffn", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        m.net.denoise(canvas, cache, None, prefill_ids=canvas)
    assert cache.seq_len == 0 and cache.token_ids == [] and cache.nbytes() == 0
    monkeypatch.undo()
    fresh = m.new_cache()
    m.prefill(ids, cache)
    m.prefill(ids, fresh)
    assert torch.equal(m.denoise(canvas, cache), m.denoise(canvas, fresh))
